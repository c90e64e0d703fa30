/*
 * bench_int8.c: the cpu-onednn int8 linear layer (what apply runs: dynamic
 * per-token activation quantisation, the packed s8 GEMM, the epilogue)
 * against oneDNN f32 with packed weights, PyTorch's int8 dynamic-quantized
 * linear (bench/peer_torch.py, run with /usr/bin/python3) and a memory
 * bandwidth ceiling, at M = 1, 16, 128, 512 for K x N = 4096 x 4096,
 * 4096 x 14336 and 14336 x 4096. One JSON object per line.
 *
 * Weights are out of cache, as in decode: each side cycles through enough
 * copies of its weights to exceed twice the last-level cache. qkeep and the
 * f32 peer run interleaved in this process on the same activations; the
 * torch peer runs right after, in its own process. Times are medians of
 * `runs` timed calls after warm-up. The ceiling is the weight bytes over the
 * copy bandwidth measured here with the same threads (memcpy, bytes read
 * plus written, as BENCHMARKING.md measures it): streaming weights only
 * reads, so a kernel can come in under it (ceiling_ratio < 1).
 *
 *   bench_int8 [THREADS]     (default: $QKEEP_BENCH_THREADS, else every online CPU;
 *                             $QKEEP_BENCH_PYTHON: the torch peer's interpreter, default /usr/bin/python3)
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <oneapi/dnnl/dnnl.h>

#include "benchutil.h"
#include "internal.h"
#include "testutil.h"

static void die(const char *what) {
  fprintf(stderr, "bench_int8: %s: %s\n", what, qkeep_errmsg());
  exit(1);
}

/* ---- qkeep: w8a8 layers built by hand, PWAL and apply through the backend's table ---- */

struct qkeep_side {
  const struct qkeep_backend *be;
  qkeep_model *model;
  qkeep_layer **layers;
  int copies;
};

static void qkeep_build(struct qkeep_side *q, qkeep_plugin *plugin, int64_t k, int64_t n, int copies) {
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
      die("building a layer");
    layer->dims.flags = QKEEP_LAYER_F_WEIGHT_SYM | QKEEP_LAYER_F_INPUT_DYNAMIC;
    struct qkeep_view wv = {.size = sizeof wv}, sv = {.size = sizeof sv};
    qkeep_param_view(w, &wv);
    qkeep_param_view(s, &sv);
    for (int64_t i = 0; i < n * k; i++)
      ((int8_t *)wv.data)[i] = (int8_t)((int)(tu_rand(&rng) % 255) - 127);
    for (int64_t i = 0; i < n; i++)
      ((float *)sv.data)[i] = 1e-3f * (1.0f + (float)(tu_rand(&rng) % 100) / 100.0f);
    if (q->be->pwal(q->be, layer))
      die("PWAL");
    q->layers[c] = layer;
  }
}

static double qkeep_run(struct qkeep_side *q, int c, int64_t m, const float *x, float *y) {
  struct qkeep_apply_args a = {
      .size = sizeof a, .m = m, .x = x, .x_dtype = QKEEP_DTYPE_F32, .y = y, .y_dtype = QKEEP_DTYPE_F32};
  double t0 = tu_now();
  if (q->be->apply(q->be, q->layers[c % q->copies], &a))
    die("apply");
  return tu_now() - t0;
}

/* ---- the f32 peer: oneDNN matmul with packed weights, straight through the C API ---- */

struct f32_side {
  dnnl_engine_t engine;
  dnnl_stream_t stream;
  dnnl_primitive_t prim;
  dnnl_memory_t src, dst, *wei;
  int copies;
};

static void check(dnnl_status_t s, const char *what) {
  if (s != dnnl_success) {
    fprintf(stderr, "bench_int8: oneDNN %s failed (%d)\n", what, (int)s);
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
  float *w = malloc((size_t)(n * k) * sizeof *w);
  uint64_t rng = 7;
  for (int64_t i = 0; i < n * k; i++)
    w[i] = tu_randf(&rng) * 0.05f;
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

/* ---- the torch peer ------------------------------------------------------------------------- */

struct torch_row {
  int64_t m;
  double us;
};

/* Runs bench/peer_torch.py for one shape; fills rows (us < 0 where missing) and the reason it was skipped. */
static void torch_peer(int64_t k, int64_t n, const int64_t *ms, int n_ms, int threads, size_t min_bytes,
                       double *us, char *skipped, size_t skipped_len) {
  for (int i = 0; i < n_ms; i++)
    us[i] = -1;
  skipped[0] = 0;
  char cmd[4096], list[64] = "";
  for (int i = 0; i < n_ms; i++)
    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%lld", i ? "," : "", (long long)ms[i]);
  /* Debian's python3-torch lives under /usr/bin/python3; QKEEP_BENCH_PYTHON names another interpreter. */
  const char *python = getenv("QKEEP_BENCH_PYTHON");
  snprintf(cmd, sizeof cmd,
           "'%s' '%s/bench/peer_torch.py' --k %lld --n %lld --ms %s --threads %d --min-bytes %zu 2>&1",
           python && *python ? python : "/usr/bin/python3", tu_srcdir(), (long long)k, (long long)n, list,
           threads, min_bytes);
  FILE *p = popen(cmd, "r");
  if (!p) {
    snprintf(skipped, skipped_len, "cannot run %s", python && *python ? python : "/usr/bin/python3");
    return;
  }
  char line[2048];
  while (fgets(line, sizeof line, p)) {
    const char *s = strstr(line, "\"skipped\": \"");
    long long m;
    double t;
    const char *mm = strstr(line, "\"M\": "), *tt = strstr(line, "\"torch_us\": ");
    if (s) {
      snprintf(skipped, skipped_len, "%s", s + 12);
      char *end = strchr(skipped, '"');
      if (end)
        *end = 0;
    } else if (mm && tt && sscanf(mm + 5, "%lld", &m) == 1 && sscanf(tt + 12, "%lf", &t) == 1) {
      for (int i = 0; i < n_ms; i++)
        if (ms[i] == m)
          us[i] = t;
    }
  }
  int rc = pclose(p);
  if (rc != 0 && !skipped[0])
    snprintf(skipped, skipped_len, "bench/peer_torch.py exited with status %d", rc);
}

/* ---- one shape -------------------------------------------------------------------------------- */

static void bench_shape(qkeep_plugin *plugin, int64_t k, int64_t n, int threads, size_t llc, double copy_bw,
                        const char *probe) {
  static const int64_t ms[] = {1, 16, 128, 512};
  enum { N_MS = sizeof ms / sizeof ms[0] };
  size_t int8_bytes = (size_t)(k * n), f32_bytes = 4 * int8_bytes;
  struct qkeep_side q = {0};
  int q_copies = copies_for(int8_bytes, llc);
  qkeep_build(&q, plugin, k, n, q_copies);
  double results[N_MS][2];
  int runs_used[N_MS];
  for (int i = 0; i < N_MS; i++) {
    int64_t m = ms[i];
    float *x = malloc((size_t)(m * k) * sizeof *x), *y = malloc((size_t)(m * n) * sizeof *y),
          *yf = malloc((size_t)(m * n) * sizeof *yf);
    uint64_t rng = 3;
    for (int64_t j = 0; j < m * k; j++)
      x[j] = tu_randf(&rng);
    struct f32_side f;
    int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    f32_build(&f, m, k, n, copies_for(f32_bytes, llc), x, yf);
    /* Warm-up: every copy once on each side (page faults, JIT), then size the run count to ~2 s. */
    double est = 0;
    for (int c = 0; c < (q.copies > f.copies ? q.copies : f.copies); c++)
      est = qkeep_run(&q, c, m, x, y) + f32_run(&f, c);
    int runs = (int)(2.0 / est);
    runs = runs < 7 ? 7 : runs > 201 ? 201 : runs;
    double *tq = malloc((size_t)runs * sizeof *tq), *tf = malloc((size_t)runs * sizeof *tf);
    for (int r = 0; r < runs; r++) {
      tq[r] = qkeep_run(&q, r, m, x, y);
      tf[r] = f32_run(&f, r);
    }
    results[i][0] = tu_median(tq, runs) * 1e6;
    results[i][1] = tu_median(tf, runs) * 1e6;
    runs_used[i] = runs;
    omp_set_num_threads(saved);
    f32_free(&f);
    free(tq), free(tf), free(x), free(y), free(yf);
  }
  qkeep_model_free(q.model);
  free(q.layers);
  double torch_us[N_MS];
  char skipped[512];
  torch_peer(k, n, ms, N_MS, threads, 2 * llc, torch_us, skipped, sizeof skipped);
  double ceiling_us = (double)int8_bytes / copy_bw * 1e6;
  for (int i = 0; i < N_MS; i++) {
    printf("{\"bench\":\"int8_linear\",\"M\":%lld,\"K\":%lld,\"N\":%lld,\"threads\":%d,\"runs\":%d,"
           "\"qkeep_us\":%.1f,\"peer\":\"onednn_f32_packed\",\"peer_us\":%.1f,\"ratio\":%.2f,",
           (long long)ms[i], (long long)k, (long long)n, threads, runs_used[i], results[i][0], results[i][1],
           results[i][1] / results[i][0]);
    if (torch_us[i] > 0)
      printf("\"torch_int8_us\":%.1f,\"torch_ratio\":%.2f,", torch_us[i], torch_us[i] / results[i][0]);
    else
      printf("\"torch_int8_us\":null,\"torch_skipped\":\"%s\",", skipped[0] ? skipped : "no result");
    printf(
        "\"ceiling_us\":%.1f,\"ceiling_ratio\":%.2f,\"copy_gbps\":%.1f,\"weight_copies\":%d,\"llc_mib\":%zu,"
        "\"backend\":\"%s\"}\n",
        ceiling_us, results[i][0] / ceiling_us, copy_bw / 1e9, q_copies, llc >> 20, probe);
    fflush(stdout);
  }
}

int main(int argc, char **argv) {
  const char *env = getenv("QKEEP_BENCH_THREADS");
  int threads = argc > 1 ? atoi(argv[1]) : env ? atoi(env) : (int)sysconf(_SC_NPROCESSORS_ONLN);
  if (threads < 1)
    threads = 1;
  qkeep_plugin *plugin;
  if (qkeep_plugin_open("cpu-onednn", NULL, &plugin))
    die("opening cpu-onednn");
  char value[16], probe[256];
  snprintf(value, sizeof value, "%d", threads);
  const struct qkeep_backend *be = qkeep_plugin_backend(plugin);
  if (be->configure(be, "threads", value))
    die("threads");
  qkeep_plugin_probe(plugin, probe, sizeof probe);
  size_t llc = llc_bytes();
  double copy_bw = copy_bandwidth(llc, threads);
  static const int64_t shapes[][2] = {{4096, 4096}, {4096, 14336}, {14336, 4096}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
    bench_shape(plugin, shapes[s][0], shapes[s][1], threads, llc, copy_bw, probe);
  qkeep_plugin_close(plugin);
  return 0;
}
