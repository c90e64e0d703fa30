/*
 * bench_int4.c: the cpu-zentorch int4 linear layer (GPTQ int4, symmetric, groups of 128,
 * in both modes: w4a16 and da8w4) against, in the same run and on the same activations,
 *   - the cpu-onednn int8 backend on the same shape (w8a8, dynamic per-token activations);
 *   - dequantise-to-f32 + oneDNN's packed f32 matmul (what a user without an int4 kernel
 *     runs; the dequantisation is done once, only the matmul is timed);
 *   - a copy ceiling: the int4 layer's bytes (codes and f16 scales) over the memcpy
 *     bandwidth measured here with the same threads (bytes read plus written, as
 *     docs/PERFORMANCE.md measures it, so a kernel that only reads can come in under it);
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

#define BENCH_NAME "bench_int4"
#include "benchutil.h"
#include "private.h"
#include "testutil.h"

#define GROUP 128

/* A GPTQ int4 layer, symmetric, groups of 128: random codes, f16 scales in [1e-3, 2e-3). */
static qkeep_layer *gptq_layer(qkeep_model *model, const char *name, int64_t k, int64_t n, uint64_t *rng) {
  qkeep_layer *layer;
  qkeep_param *w, *s;
  struct qkeep_spec ws = {QKEEP_DTYPE_I32, 2, {k / 8, n}}, ss = {QKEEP_DTYPE_F16, 2, {k / GROUP, n}};
  struct qkeep_layer_info info = {
      .size = sizeof info, .n = n, .k = k, .group_size = GROUP, .shards = 1, .shard_n = {n}};
  if (qkeep_layer_add(model, name, QKEEP_LAYER_LINEAR, "gptq-int4", &layer) ||
      qkeep_layer_set_dims(layer, &info) || qkeep_param_create(layer, "qweight", &ws, &w) ||
      qkeep_param_create(layer, "scales", &ss, &s))
    die("building a gptq layer");
  layer->dims.flags = QKEEP_LAYER_F_WEIGHT_SYM;
  struct qkeep_view wv = {.size = sizeof wv}, sv = {.size = sizeof sv};
  qkeep_param_view(w, &wv);
  qkeep_param_view(s, &sv);
  for (int64_t i = 0; i < k / 8 * n; i++)
    ((uint32_t *)wv.data)[i] = (uint32_t)tu_rand(rng);
  for (int64_t i = 0; i < k / GROUP * n; i++)
    ((uint16_t *)sv.data)[i] = qk_f32_to_f16(1e-3f * (1.0f + (float)(tu_rand(rng) % 100) / 100.0f));
  return layer;
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

struct timed {
  struct point p;
  const struct context *cx;
  struct side *zt, *od;
};

/* Sides 0 and 1: cpu-zentorch in w4a16 and da8w4; 2: cpu-onednn int8; 3: dequantised f32. */
static double call(void *arg, int s, int c) {
  struct timed *t = arg;
  const struct point *p = &t->p;
  switch (s) {
  case 0: set_mode(t->cx, "w4a16"); return side_run(t->zt, c, p->m, p->x, p->y);
  case 1: set_mode(t->cx, "da8w4"); return side_run(t->zt, c, p->m, p->x, p->y);
  case 2: return side_run(t->od, c, p->m, p->x, p->y);
  default: return f32_run(p->f, c);
  }
}

static void bench_shape(const struct context *cx, int64_t k, int64_t n) {
  static const int64_t ms[] = {1, 16, 128, 512};
  size_t int4_bytes = (size_t)(k * n / 2) + (size_t)(k / GROUP * n) * 2, int8_bytes = (size_t)(k * n),
         f32_bytes = 4 * int8_bytes;
  struct side zt = {0}, od = {0};
  int zt_copies = copies_for(int4_bytes, cx->llc);
  side_build(&zt, cx->zt, k, n, zt_copies, gptq_layer);
  side_build(&od, cx->od, k, n, copies_for(int8_bytes, cx->llc), int8_layer);
  /* The dequantised int4 weights: (q - 8) * scale, one scale per group of 128 along K. */
  float *w = malloc((size_t)(n * k) * sizeof *w);
  uint64_t wrng = 7;
  for (int64_t i = 0; i < n * k; i++)
    w[i] = (float)((int)(tu_rand(&wrng) % 16) - 8) * 1e-3f;
  for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
    int64_t m = ms[i];
    float *x = activations(m, k), *y = malloc((size_t)(m * n) * sizeof *y),
          *yf = malloc((size_t)(m * n) * sizeof *yf);
    struct f32_side f;
    int saved = omp_get_max_threads();
    omp_set_num_threads(cx->threads);
    f32_build(&f, m, k, n, copies_for(f32_bytes, cx->llc), w, x, yf);
    int most = zt.copies > od.copies ? zt.copies : od.copies;
    most = most > f.copies ? most : f.copies;
    struct timed t = {{&f, m, x, y}, cx, &zt, &od};
    double us[4];
    int runs = time_interleaved(call, &t, 4, most, cx->seconds, 301, us);
    static const char *const modes[] = {"w4a16", "da8w4"};
    for (int md = 0; md < 2; md++) {
      printf("{\"bench\":\"int4_linear\",\"mode\":\"%s\",\"M\":%lld,\"K\":%lld,\"N\":%lld,\"group\":%d,"
             "\"threads\":%d,\"runs\":%d,\"qkeep_us\":%.1f,"
             "\"peer\":\"onednn_int8\",\"peer_us\":%.1f,\"ratio\":%.2f,"
             "\"dequant_f32_us\":%.1f,\"dequant_f32_ratio\":%.2f,\"int4_bytes\":%zu,",
             modes[md], (long long)m, (long long)k, (long long)n, GROUP, cx->threads, runs, us[md], us[2],
             us[2] / us[md], us[3], us[3] / us[md], int4_bytes);
      print_ceiling(int4_bytes, us[md], cx->copy_bw, zt_copies, cx->llc, cx->zt_probe);
      printf(",\"peer_backend\":\"%s\"}\n", cx->od_probe);
    }
    fflush(stdout);
    omp_set_num_threads(saved);
    f32_free(&f);
    free(x), free(y), free(yf);
  }
  free(w);
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
