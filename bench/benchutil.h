/*
 * benchutil.h: what the CPU linear-layer benchmarks (bench_int8, bench_int4) share beyond
 * tests/testutil.h: the last-level cache's size, the copy bandwidth peer (the ceiling of a
 * memory-bound kernel), how many weight copies keep a kernel out of cache, a backend's side
 * (layers built by hand, PWAL and apply through the backend's table), the w8a8-int8 layers of
 * cpu-onednn, oneDNN's packed f32 matmul as a peer, the interleaved timing loop and the ceiling
 * fields of the JSON line. Header-only; the programs that include it build with OpenMP, link
 * oneDNN, and define BENCH_NAME (their name, for messages) before including it.
 */
#ifndef QKEEP_BENCHUTIL_H
#define QKEEP_BENCHUTIL_H

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <oneapi/dnnl/dnnl.h>

#include "private.h"
#include "testutil.h"

#ifndef BENCH_NAME
#error "define BENCH_NAME (the program's name) before including benchutil.h"
#endif

/* Prints what failed, with qkeep's last error message, and exits 1. */
static void die(const char *what) {
  fprintf(stderr, BENCH_NAME ": %s: %s\n", what, qkeep_errmsg());
  exit(1);
}

/* The last-level cache in bytes: sysfs (what lscpu shows), else sysconf, else 32 MiB. sysconf's
 * CPUID answer can be the host's under a hypervisor (256 MiB on the 32 MiB test VM). */
static size_t llc_bytes(void) {
  FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
  unsigned long kb = 0;
  int got = f ? fscanf(f, "%luK", &kb) : 0;
  if (f)
    fclose(f);
  if (got == 1 && kb)
    return (size_t)kb << 10;
  long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return v > 0 ? (size_t)v : (size_t)32 << 20;
}

/* Copy bandwidth with `threads` threads over buffers of 4 x LLC: memcpy, bytes read plus written per second.
 */
static double copy_bandwidth(size_t llc, int threads) {
  size_t bytes = 4 * llc;
  unsigned char *a = malloc(bytes), *b = malloc(bytes);
  if (!a || !b)
    die("out of memory for the bandwidth test");
  memset(a, 1, bytes);
  memset(b, 2, bytes);
  double t[9];
  for (int r = 0; r < 9; r++) {
    double t0 = tu_now();
#pragma omp parallel num_threads(threads)
    {
      int n = omp_get_num_threads(), i = omp_get_thread_num();
      size_t part = bytes / (size_t)n, off = part * (size_t)i;
      memcpy(b + off, a + off, i == n - 1 ? bytes - off : part);
    }
    t[r] = tu_now() - t0;
  }
  free(a);
  free(b);
  return 2.0 * (double)bytes / tu_median(t, 9);
}

/* How many copies of `bytes` of weights exceed twice the LLC (at least 2). */
static int copies_for(size_t bytes, size_t llc) {
  size_t c = (2 * llc + bytes - 1) / bytes;
  return c < 2 ? 2 : (int)c;
}

/* ---- a backend's side: layers built by hand, PWAL and apply through the backend's table ---- */

struct side {
  const struct qkeep_backend *be;
  qkeep_model *model;
  qkeep_layer **layers;
  int copies;
};

/* Adds layer `name` (K x N) to `model` with its loader params filled from `rng`; dies on failure. */
typedef qkeep_layer *(*side_layer_fn)(qkeep_model *model, const char *name, int64_t k, int64_t n,
                                      uint64_t *rng);

/* `copies` layers "bench.<c>.down_proj" of one shape on `plugin`'s backend, each made by `make`
 * (one generator over all copies, seeded 42) and run through the backend's PWAL. */
static void side_build(struct side *q, qkeep_plugin *plugin, int64_t k, int64_t n, int copies,
                       side_layer_fn make) {
  q->be = qkeep_plugin_backend(plugin);
  q->copies = copies;
  q->layers = calloc((size_t)copies, sizeof *q->layers);
  if (!q->layers)
    die("out of memory for the layers");
  if (qkeep_model_new(plugin, &q->model))
    die("model");
  uint64_t rng = 42;
  for (int c = 0; c < copies; c++) {
    char name[64];
    snprintf(name, sizeof name, "bench.%d.down_proj", c);
    qkeep_layer *layer = make(q->model, name, k, n, &rng);
    if (q->be->pwal(q->be, layer))
      die("PWAL");
    q->layers[c] = layer;
  }
}

/* One apply of weight copy c % copies on m rows of f32 x into f32 y; seconds. */
static double side_run(struct side *q, int c, int64_t m, const float *x, float *y) {
  struct qkeep_apply_args a = {
      .size = sizeof a, .m = m, .x = x, .x_dtype = QKEEP_DTYPE_F32, .y = y, .y_dtype = QKEEP_DTYPE_F32};
  double t0 = tu_now();
  if (q->be->apply(q->be, q->layers[c % q->copies], &a))
    die("apply");
  return tu_now() - t0;
}

static void side_free(struct side *q) {
  qkeep_model_free(q->model);
  free(q->layers);
}

/* A w8a8-int8 layer as cpu-onednn runs it: symmetric s8 weights [N, K] in [-127, 127], f32 scales per
 * channel [N, 1] in [1e-3, 2e-3), activations quantised dynamically per token. */
static qkeep_layer *int8_layer(qkeep_model *model, const char *name, int64_t k, int64_t n, uint64_t *rng) {
  qkeep_layer *layer;
  qkeep_param *w, *s;
  struct qkeep_spec ws = {QKEEP_DTYPE_I8, 2, {n, k}}, ss = {QKEEP_DTYPE_F32, 2, {n, 1}};
  struct qkeep_layer_info info = {.size = sizeof info, .n = n, .k = k, .shards = 1, .shard_n = {n}};
  if (qkeep_layer_add(model, name, QKEEP_LAYER_LINEAR, "w8a8-int8", &layer) ||
      qkeep_param_create(layer, "weight", &ws, &w) || qkeep_param_create(layer, "weight_scale", &ss, &s) ||
      qkeep_layer_set_dims(layer, &info))
    die("building an int8 layer");
  layer->dims.flags = QKEEP_LAYER_F_WEIGHT_SYM | QKEEP_LAYER_F_INPUT_DYNAMIC;
  struct qkeep_view wv = {.size = sizeof wv}, sv = {.size = sizeof sv};
  qkeep_param_view(w, &wv);
  qkeep_param_view(s, &sv);
  for (int64_t i = 0; i < n * k; i++)
    ((int8_t *)wv.data)[i] = (int8_t)((int)(tu_rand(rng) % 255) - 127);
  for (int64_t i = 0; i < n; i++)
    ((float *)sv.data)[i] = 1e-3f * (1.0f + (float)(tu_rand(rng) % 100) / 100.0f);
  return layer;
}

/* The activations of one point: m x k f32 in [-1, 1), the same for every side and shape (seed 3). */
static float *activations(int64_t m, int64_t k) {
  float *x = malloc((size_t)(m * k) * sizeof *x);
  if (!x)
    die("out of memory for the activations");
  uint64_t rng = 3;
  for (int64_t j = 0; j < m * k; j++)
    x[j] = tu_randf(&rng);
  return x;
}

/* ---- the f32 peer: oneDNN matmul with packed weights, straight through the C API ---- */

struct f32_side {
  dnnl_engine_t engine;
  dnnl_stream_t stream;
  dnnl_primitive_t prim;
  dnnl_memory_t src, dst, *wei;
  int copies;
};

static void onednn_check(dnnl_status_t s, const char *what) {
  if (s != dnnl_success) {
    fprintf(stderr, BENCH_NAME ": oneDNN %s failed (%d)\n", what, (int)s);
    exit(1);
  }
}

/* y[m, n] = x[m, k] w: `copies` packed copies of the plain weights w ([N, K] row-major, what oneDNN
 * calls ba for a [K, N] operand), x and y borrowed until f32_free. */
static void f32_build(struct f32_side *f, int64_t m, int64_t k, int64_t n, int copies, const float *w,
                      float *x, float *y) {
  dnnl_memory_desc_t a_md, w_md, d_md, plain;
  dnnl_matmul_desc_t md;
  dnnl_primitive_desc_t pd, rpd;
  dnnl_primitive_t reorder;
  onednn_check(dnnl_engine_create(&f->engine, dnnl_cpu, 0), "engine");
  onednn_check(dnnl_stream_create(&f->stream, f->engine, dnnl_stream_default_flags), "stream");
  onednn_check(dnnl_memory_desc_init_by_tag(&a_md, 2, (dnnl_dims_t){m, k}, dnnl_f32, dnnl_ab), "md");
  onednn_check(dnnl_memory_desc_init_by_tag(&w_md, 2, (dnnl_dims_t){k, n}, dnnl_f32, dnnl_format_tag_any),
               "md");
  onednn_check(dnnl_memory_desc_init_by_tag(&d_md, 2, (dnnl_dims_t){m, n}, dnnl_f32, dnnl_ab), "md");
  onednn_check(dnnl_memory_desc_init_by_tag(&plain, 2, (dnnl_dims_t){k, n}, dnnl_f32, dnnl_ba), "md");
  onednn_check(dnnl_matmul_desc_init(&md, &a_md, &w_md, NULL, &d_md), "matmul desc");
  onednn_check(dnnl_primitive_desc_create(&pd, &md, NULL, f->engine, NULL), "matmul pd");
  const dnnl_memory_desc_t *packed = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
  onednn_check(dnnl_primitive_create(&f->prim, pd), "matmul");
  onednn_check(dnnl_reorder_primitive_desc_create(&rpd, &plain, f->engine, packed, f->engine, NULL),
               "reorder pd");
  onednn_check(dnnl_primitive_create(&reorder, rpd), "reorder");
  dnnl_memory_t from;
  /* The reorder only reads `from`. */
  onednn_check(dnnl_memory_create(&from, &plain, f->engine, (void *)w), "memory");
  f->copies = copies;
  f->wei = calloc((size_t)copies, sizeof *f->wei);
  if (!f->wei)
    die("out of memory for the f32 weights");
  for (int c = 0; c < copies; c++) {
    onednn_check(dnnl_memory_create(&f->wei[c], packed, f->engine, DNNL_MEMORY_ALLOCATE), "memory");
    onednn_check(dnnl_primitive_execute(reorder, f->stream, 2,
                                        (dnnl_exec_arg_t[]){{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, f->wei[c]}}),
                 "reorder");
  }
  onednn_check(dnnl_stream_wait(f->stream), "wait");
  onednn_check(dnnl_memory_create(&f->src, &a_md, f->engine, x), "memory");
  onednn_check(dnnl_memory_create(&f->dst, &d_md, f->engine, y), "memory");
  dnnl_memory_destroy(from);
  dnnl_primitive_destroy(reorder);
  dnnl_primitive_desc_destroy(rpd);
  dnnl_primitive_desc_destroy(pd);
}

/* One matmul on weight copy c % copies; seconds. */
static double f32_run(struct f32_side *f, int c) {
  double t0 = tu_now();
  onednn_check(dnnl_primitive_execute(f->prim, f->stream, 3,
                                      (dnnl_exec_arg_t[]){{DNNL_ARG_SRC, f->src},
                                                          {DNNL_ARG_WEIGHTS, f->wei[c % f->copies]},
                                                          {DNNL_ARG_DST, f->dst}}),
               "matmul");
  onednn_check(dnnl_stream_wait(f->stream), "wait");
  return tu_now() - t0;
}

static void f32_free(struct f32_side *f) {
  for (int c = 0; c < f->copies; c++)
    dnnl_memory_destroy(f->wei[c]);
  free(f->wei);
  dnnl_memory_destroy(f->src);
  dnnl_memory_destroy(f->dst);
  dnnl_primitive_destroy(f->prim);
  dnnl_stream_destroy(f->stream);
  dnnl_engine_destroy(f->engine);
}

/* What every timed call of one point (a shape at one M) reads: m rows of activations x, the output
 * y, and the f32 peer. */
struct point {
  struct f32_side *f;
  int64_t m;
  const float *x;
  float *y;
};

/* ---- timing and the JSON line ---------------------------------------------------------------- */

/* One timed call of side `s` (0 .. sides-1) on weight copy `c`; seconds. */
typedef double (*bench_call_fn)(void *arg, int s, int c);

/*
 * Times `sides` calls interleaved call by call (side by side, docs/PERFORMANCE.md's method): a warm-up over
 * every weight copy (page faults, JIT; `copies` is the most any side has), whose last round sizes
 * the run count to about `seconds` (at least 7, at most max_runs), then that many rounds of every
 * side in turn. us[s] is side s's median in microseconds; returns the run count.
 */
static int time_interleaved(bench_call_fn call, void *arg, int sides, int copies, double seconds,
                            int max_runs, double *us) {
  double est = 0;
  for (int c = 0; c < copies; c++) {
    est = 0;
    for (int s = 0; s < sides; s++)
      est += call(arg, s, c);
  }
  int runs = (int)(seconds / est);
  runs = runs < 7 ? 7 : runs > max_runs ? max_runs : runs;
  double *t = malloc((size_t)sides * (size_t)runs * sizeof *t);
  if (!t)
    die("out of memory for the timings");
  for (int r = 0; r < runs; r++)
    for (int s = 0; s < sides; s++)
      t[(size_t)s * (size_t)runs + (size_t)r] = call(arg, s, r);
  for (int s = 0; s < sides; s++)
    us[s] = tu_median(t + (size_t)s * (size_t)runs, runs) * 1e6;
  free(t);
  return runs;
}

/* The fields every line ends with, without the closing brace: the copy ceiling of `bytes` of weights
 * against qkeep's qkeep_us, the copy bandwidth, the weight copies, the LLC and qkeep's backend. */
static void print_ceiling(size_t bytes, double qkeep_us, double copy_bw, int copies, size_t llc,
                          const char *backend) {
  double ceiling_us = (double)bytes / copy_bw * 1e6;
  printf("\"ceiling_us\":%.1f,\"ceiling_ratio\":%.2f,\"copy_gbps\":%.1f,\"weight_copies\":%d,\"llc_mib\":%zu,"
         "\"backend\":\"%s\"",
         ceiling_us, qkeep_us / ceiling_us, copy_bw / 1e9, copies, llc >> 20, backend);
}

#endif
