/*
 * bench_int4.c: the cpu-zentorch int4 linear layer (GPTQ int4, symmetric, groups of 128,
 * in both modes: w4a16 and da8w4) against, in the same run and on the same activations,
 *   - the cpu-onednn int8 backend on the same shape (w8a8, dynamic per-token activations);
 *   - dequantise-to-f32 + oneDNN's packed f32 matmul (what a user without an int4 kernel
 *     runs; the dequantisation is done once, only the matmul is timed);
 *   - a copy ceiling: the int4 layer's bytes (codes and f16 scales) over the memcpy
 *     bandwidth measured here with the same threads (bytes read plus written, as
 *     BENCHMARKING.md measures it, so a kernel that only reads can come in under it);
 * at M = 1, 16, 128, 512 for K x N = 4096 x 4096, 4096 x 14336 and 14336 x 4096. One JSON
 * object per line: per shape and M, one line per zentorch mode with every peer's time.
 *
 * Weights are out of cache, as in decode: each side cycles through enough copies of its
 * weights to exceed twice the last-level cache. The sides run interleaved, call by call.
 * Times are medians of `runs` timed calls after warm-up (every copy once).
 *
 *   bench_int4 [THREADS]     (default: $QKEEP_BENCH_THREADS, else every online CPU;
 *                             $QKEEP_BENCH_SECONDS: the time budget per point, default 0.5)
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <oneapi/dnnl/dnnl.h>

#include "benchutil.h"
#include "internal.h"
#include "numeric.h"
#include "testutil.h"

#define GROUP 128

static void die(const char *what) {
  fprintf(stderr, "bench_int4: %s: %s\n", what, qkeep_errmsg());
  exit(1);
}

/* ---- a backend's side: layers built by hand, PWAL and apply through the backend's table ---- */

struct side {
  const struct qkeep_backend *be;
  qkeep_model *model;
  qkeep_layer **layers;
  int copies;
};

static void build_gptq(struct side *q, qkeep_plugin *plugin, int64_t k, int64_t n, int copies) {
  q->be = qkeep_plugin_backend(plugin);
  q->copies = copies;
  q->layers = calloc((size_t)copies, sizeof *q->layers);
  if (qkeep_model_new(plugin, &q->model))
    die("model");
  uint64_t rng = 42;
  for (int c = 0; c < copies; c++) {
    char name[64];
    snprintf(name, sizeof name, "bench.%d.down_proj", c);
    qkeep_layer *layer;
    qkeep_param *w, *s;
    struct qkeep_spec ws = {QKEEP_DTYPE_I32, 2, {k / 8, n}}, ss = {QKEEP_DTYPE_F16, 2, {k / GROUP, n}};
    struct qkeep_layer_info info = {
        .size = sizeof info, .n = n, .k = k, .group_size = GROUP, .shards = 1, .shard_n = {n}};
    if (qkeep_layer_add(q->model, name, QKEEP_LAYER_LINEAR, "gptq-int4", &layer) ||
        qkeep_layer_set_dims(layer, &info) || qkeep_param_create(layer, "qweight", &ws, &w) ||
        qkeep_param_create(layer, "scales", &ss, &s))
      die("building a gptq layer");
    layer->dims.flags = QKEEP_LAYER_F_WEIGHT_SYM;
    struct qkeep_view wv = {.size = sizeof wv}, sv = {.size = sizeof sv};
    qkeep_param_view(w, &wv);
    qkeep_param_view(s, &sv);
    for (int64_t i = 0; i < k / 8 * n; i++)
      ((uint32_t *)wv.data)[i] = (uint32_t)tu_rand(&rng);
    for (int64_t i = 0; i < k / GROUP * n; i++)
      ((uint16_t *)sv.data)[i] = qk_f32_to_f16(1e-3f * (1.0f + (float)(tu_rand(&rng) % 100) / 100.0f));
    if (q->be->pwal(q->be, layer))
      die("PWAL");
    q->layers[c] = layer;
  }
}

static void build_int8(struct side *q, qkeep_plugin *plugin, int64_t k, int64_t n, int copies) {
  q->be = qkeep_plugin_backend(plugin);
  q->copies = copies;
  q->layers = calloc((size_t)copies, sizeof *q->layers);
  if (qkeep_model_new(plugin, &q->model))
    die("model");
  uint64_t rng = 42;
  for (int c = 0; c < copies; c++) {
    char name[64];
    snprintf(name, sizeof name, "bench.%d.down_proj", c);
    qkeep_layer *layer;
    qkeep_param *w, *s;
    struct qkeep_spec ws = {QKEEP_DTYPE_I8, 2, {n, k}}, ss = {QKEEP_DTYPE_F32, 2, {n, 1}};
    struct qkeep_layer_info info = {.size = sizeof info, .n = n, .k = k, .shards = 1, .shard_n = {n}};
    if (qkeep_layer_add(q->model, name, QKEEP_LAYER_LINEAR, "w8a8-int8", &layer) ||
        qkeep_param_create(layer, "weight", &ws, &w) || qkeep_param_create(layer, "weight_scale", &ss, &s) ||
        qkeep_layer_set_dims(layer, &info))
      die("building an int8 layer");
    layer->dims.flags = QKEEP_LAYER_F_WEIGHT_SYM | QKEEP_LAYER_F_INPUT_DYNAMIC;
    struct qkeep_view wv = {.size = sizeof wv}, sv = {.size = sizeof sv};
    qkeep_param_view(w, &wv);
    qkeep_param_view(s, &sv);
    for (int64_t i = 0; i < n * k; i++)
      ((int8_t *)wv.data)[i] = (int8_t)((int)(tu_rand(&rng) % 255) - 127);
    for (int64_t i = 0; i < n; i++)
      ((float *)sv.data)[i] = 1e-3f;
    if (q->be->pwal(q->be, layer))
      die("PWAL");
    q->layers[c] = layer;
  }
}

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

/* ---- dequantise + oneDNN packed f32 matmul ---------------------------------------------------- */

struct f32_side {
  dnnl_engine_t engine;
  dnnl_stream_t stream;
  dnnl_primitive_t prim;
  dnnl_memory_t src, dst, *wei;
  int copies;
};

static void check(dnnl_status_t s, const char *what) {
  if (s != dnnl_success) {
    fprintf(stderr, "bench_int4: oneDNN %s failed (%d)\n", what, (int)s);
    exit(1);
  }
}

static void f32_build(struct f32_side *f, int64_t m, int64_t k, int64_t n, int copies, float *x, float *y) {
  dnnl_memory_desc_t a_md, w_md, d_md, plain;
  dnnl_matmul_desc_t md;
  dnnl_primitive_desc_t pd, rpd;
  dnnl_primitive_t reorder;
  check(dnnl_engine_create(&f->engine, dnnl_cpu, 0), "engine");
  check(dnnl_stream_create(&f->stream, f->engine, dnnl_stream_default_flags), "stream");
  check(dnnl_memory_desc_init_by_tag(&a_md, 2, (dnnl_dims_t){m, k}, dnnl_f32, dnnl_ab), "md");
  check(dnnl_memory_desc_init_by_tag(&w_md, 2, (dnnl_dims_t){k, n}, dnnl_f32, dnnl_format_tag_any), "md");
  check(dnnl_memory_desc_init_by_tag(&d_md, 2, (dnnl_dims_t){m, n}, dnnl_f32, dnnl_ab), "md");
  check(dnnl_memory_desc_init_by_tag(&plain, 2, (dnnl_dims_t){k, n}, dnnl_f32, dnnl_ba), "md");
  check(dnnl_matmul_desc_init(&md, &a_md, &w_md, NULL, &d_md), "matmul desc");
  check(dnnl_primitive_desc_create(&pd, &md, NULL, f->engine, NULL), "matmul pd");
  const dnnl_memory_desc_t *packed = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
  check(dnnl_primitive_create(&f->prim, pd), "matmul");
  check(dnnl_reorder_primitive_desc_create(&rpd, &plain, f->engine, packed, f->engine, NULL), "reorder pd");
  check(dnnl_primitive_create(&reorder, rpd), "reorder");
  /* The dequantised int4 weights: (q - 8) * scale, one scale per group of 128 along K. */
  float *w = malloc((size_t)(n * k) * sizeof *w);
  uint64_t rng = 7;
  for (int64_t i = 0; i < n * k; i++)
    w[i] = (float)((int)(tu_rand(&rng) % 16) - 8) * 1e-3f;
  dnnl_memory_t from;
  check(dnnl_memory_create(&from, &plain, f->engine, w), "memory");
  f->copies = copies;
  f->wei = calloc((size_t)copies, sizeof *f->wei);
  for (int c = 0; c < copies; c++) {
    check(dnnl_memory_create(&f->wei[c], packed, f->engine, DNNL_MEMORY_ALLOCATE), "memory");
    check(dnnl_primitive_execute(reorder, f->stream, 2,
                                 (dnnl_exec_arg_t[]){{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, f->wei[c]}}),
          "reorder");
  }
  check(dnnl_stream_wait(f->stream), "wait");
  check(dnnl_memory_create(&f->src, &a_md, f->engine, x), "memory");
  check(dnnl_memory_create(&f->dst, &d_md, f->engine, y), "memory");
  dnnl_memory_destroy(from);
  dnnl_primitive_destroy(reorder);
  dnnl_primitive_desc_destroy(rpd);
  dnnl_primitive_desc_destroy(pd);
  free(w);
}

static double f32_run(struct f32_side *f, int c) {
  double t0 = tu_now();
  check(dnnl_primitive_execute(f->prim, f->stream, 3,
                               (dnnl_exec_arg_t[]){{DNNL_ARG_SRC, f->src},
                                                   {DNNL_ARG_WEIGHTS, f->wei[c % f->copies]},
                                                   {DNNL_ARG_DST, f->dst}}),
        "matmul");
  check(dnnl_stream_wait(f->stream), "wait");
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

/* ---- one shape ------------------------------------------------------------------------------------ */

struct context {
  qkeep_plugin *zt, *od;
  int threads;
  size_t llc;
  double copy_bw, seconds;
  char zt_probe[256], od_probe[256];
};

static void set_mode(const struct context *cx, const char *mode) {
  const struct qkeep_backend *be = qkeep_plugin_backend(cx->zt);
  if (be->configure(be, "mode", mode))
    die("mode");
}

static void bench_shape(const struct context *cx, int64_t k, int64_t n) {
  static const int64_t ms[] = {1, 16, 128, 512};
  size_t int4_bytes = (size_t)(k * n / 2) + (size_t)(k / GROUP * n) * 2, int8_bytes = (size_t)(k * n),
         f32_bytes = 4 * int8_bytes;
  struct side zt = {0}, od = {0};
  int zt_copies = copies_for(int4_bytes, cx->llc);
  build_gptq(&zt, cx->zt, k, n, zt_copies);
  build_int8(&od, cx->od, k, n, copies_for(int8_bytes, cx->llc));
  double ceiling_us = (double)int4_bytes / cx->copy_bw * 1e6;
  for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
    int64_t m = ms[i];
    float *x = malloc((size_t)(m * k) * sizeof *x), *y = malloc((size_t)(m * n) * sizeof *y),
          *yf = malloc((size_t)(m * n) * sizeof *yf);
    uint64_t rng = 3;
    for (int64_t j = 0; j < m * k; j++)
      x[j] = tu_randf(&rng);
    struct f32_side f;
    int saved = omp_get_max_threads();
    omp_set_num_threads(cx->threads);
    f32_build(&f, m, k, n, copies_for(f32_bytes, cx->llc), x, yf);
    double est = 0;
    int most = zt.copies > od.copies ? zt.copies : od.copies;
    most = most > f.copies ? most : f.copies;
    for (int c = 0; c < most; c++) {
      set_mode(cx, "w4a16");
      est = side_run(&zt, c, m, x, y);
      set_mode(cx, "da8w4");
      est += side_run(&zt, c, m, x, y) + side_run(&od, c, m, x, y) + f32_run(&f, c);
    }
    int runs = (int)(cx->seconds / est);
    runs = runs < 7 ? 7 : runs > 301 ? 301 : runs;
    double *t[4];
    for (int s = 0; s < 4; s++)
      t[s] = malloc((size_t)runs * sizeof *t[s]);
    for (int r = 0; r < runs; r++) {
      set_mode(cx, "w4a16");
      t[0][r] = side_run(&zt, r, m, x, y);
      set_mode(cx, "da8w4");
      t[1][r] = side_run(&zt, r, m, x, y);
      t[2][r] = side_run(&od, r, m, x, y);
      t[3][r] = f32_run(&f, r);
    }
    double us[4];
    for (int s = 0; s < 4; s++)
      us[s] = tu_median(t[s], runs) * 1e6;
    static const char *const modes[] = {"w4a16", "da8w4"};
    for (int md = 0; md < 2; md++)
      printf("{\"bench\":\"int4_linear\",\"mode\":\"%s\",\"M\":%lld,\"K\":%lld,\"N\":%lld,\"group\":%d,"
             "\"threads\":%d,\"runs\":%d,\"qkeep_us\":%.1f,"
             "\"peer\":\"onednn_int8\",\"peer_us\":%.1f,\"ratio\":%.2f,"
             "\"dequant_f32_us\":%.1f,\"dequant_f32_ratio\":%.2f,"
             "\"ceiling_us\":%.1f,\"ceiling_ratio\":%.2f,\"copy_gbps\":%.1f,\"int4_bytes\":%zu,"
             "\"weight_copies\":%d,\"llc_mib\":%zu,\"backend\":\"%s\",\"peer_backend\":\"%s\"}\n",
             modes[md], (long long)m, (long long)k, (long long)n, GROUP, cx->threads, runs, us[md], us[2],
             us[2] / us[md], us[3], us[3] / us[md], ceiling_us, us[md] / ceiling_us, cx->copy_bw / 1e9,
             int4_bytes, zt_copies, cx->llc >> 20, cx->zt_probe, cx->od_probe);
    fflush(stdout);
    omp_set_num_threads(saved);
    f32_free(&f);
    for (int s = 0; s < 4; s++)
      free(t[s]);
    free(x), free(y), free(yf);
  }
  side_free(&zt);
  side_free(&od);
}

int main(int argc, char **argv) {
  const char *env = getenv("QKEEP_BENCH_THREADS"), *secs = getenv("QKEEP_BENCH_SECONDS");
  struct context cx = {.threads = argc > 1 ? atoi(argv[1])
                                  : env    ? atoi(env)
                                           : (int)sysconf(_SC_NPROCESSORS_ONLN),
                       .seconds = secs ? atof(secs) : 0.5};
  if (cx.threads < 1)
    cx.threads = 1;
  if (qkeep_plugin_open("cpu-zentorch", NULL, &cx.zt))
    die("opening cpu-zentorch");
  if (qkeep_plugin_open("cpu-onednn", NULL, &cx.od))
    die("opening cpu-onednn");
  char value[16];
  snprintf(value, sizeof value, "%d", cx.threads);
  qkeep_plugin *both[] = {cx.zt, cx.od};
  for (int i = 0; i < 2; i++) {
    const struct qkeep_backend *be = qkeep_plugin_backend(both[i]);
    if (be->configure(be, "threads", value))
      die("threads");
  }
  qkeep_plugin_probe(cx.zt, cx.zt_probe, sizeof cx.zt_probe);
  qkeep_plugin_probe(cx.od, cx.od_probe, sizeof cx.od_probe);
  cx.llc = llc_bytes();
  cx.copy_bw = copy_bandwidth(cx.llc, cx.threads);
  static const int64_t shapes[][2] = {{4096, 4096}, {4096, 14336}, {14336, 4096}};
  const char *only = getenv("QKEEP_BENCH_SHAPES"); /* e.g. "0" or "0,2": a subset, for quick looks */
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
    if (!only || strchr(only, (int)('0' + s)))
      bench_shape(&cx, shapes[s][0], shapes[s][1]);
  qkeep_plugin_close(cx.zt);
  qkeep_plugin_close(cx.od);
  return 0;
}
