/*
 * bench_int4.c: the cpu-zentorch int4 linear layer (GPTQ int4, symmetric, groups of 128,
 * in both modes: w4a16 and da8w4) against, in the same run and on the same activations,
 *   - the cpu-onednn int8 backend on the same shape (w8a8, dynamic per-token activations);
 *   - dequantise-to-f32 + oneDNN's packed f32 matmul (what a user without an int4 kernel
 *     runs; the dequantisation is done once, only the matmul is timed);
 *   - a copy ceiling: the int4 layer's bytes (codes and f16 scales) over the memcpy
 *     bandwidth measured here with the same threads (bytes read plus written, as
 *     docs/PERFORMANCE.md measures it, so a kernel that only reads can come in under it);
 *   - with $QKEEP_BENCH_GGML set, ggml's Q4_0 product (llama.cpp's int4 format: groups of 32,
 *     f16 scales) on weights of the same shape, through ggml's CPU backend with the same threads,
 *     in its plain buffer and in its repacking one (bench/ggml_peer.h); its output is checked
 *     against an f32 product of the dequantised Q4_0 weights computed here, and a time whose
 *     result is off by more than GGML_TOLERANCE is printed as null (and the program exits 1);
 * at M = 1, 16, 128, 512 for K x N = 4096 x 4096, 4096 x 14336 and 14336 x 4096. One JSON
 * object per line: per shape and M, one line per zentorch mode with every peer's time.
 *
 * Weights are out of cache, as in decode: each side cycles through enough copies of its
 * weights to exceed twice the last-level cache. The sides run interleaved, call by call.
 * Times are medians of `runs` timed calls after warm-up (every copy once).
 *
 *   bench_int4 [THREADS]     (default: $QKEEP_BENCH_THREADS, else every online CPU;
 *                             $QKEEP_BENCH_SECONDS: the time budget per point, default 0.5;
 *                             $QKEEP_BENCH_SHAPES: a subset of the shapes, e.g. "1,2";
 *                             $QKEEP_BENCH_GGML: ggml's libggml-cpu.so, or a directory holding
 *                             it (a CMake build tree or an install prefix); unset, the ggml peer
 *                             is skipped and a line {"peer":"ggml_q4_0","skipped":...} says so)
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
#include "ggml_peer.h"
#include "private.h"
#include "testutil.h"

#define GROUP 128
/* The largest relative error (L2, per output row) the ggml peer's result may have against the f32
 * product of its dequantised weights: ggml quantises the activations to 8 bits per group of 32
 * (about 0.5 % here); a wrong layout, row or stride gives errors of order 1. */
#define GGML_TOLERANCE 2e-2

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
  char od_probe[256];
  struct ggml_peer *ggml; /* NULL: the ggml peer is skipped */
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
  struct ggml_point *gp; /* the ggml sides, plain then repacked; NULL where absent */
};

/* Sides 0 and 1: cpu-zentorch in w4a16 and da8w4; 2: cpu-onednn int8; 3: dequantised f32;
 * 4 and up: ggml Q4_0, plain then repacked. The two modes share one set of weight copies, so da8w4
 * reads the copy half a cycle away from the one w4a16 has just read (which, where a copy fits in
 * the LLC, it would otherwise find in cache). */
static double call(void *arg, int s, int c) {
  struct timed *t = arg;
  const struct point *p = &t->p;
  switch (s) {
  case 0: set_mode(t->cx, "w4a16"); return side_run(t->zt, c, p->m, p->x, p->y);
  case 1: set_mode(t->cx, "da8w4"); return side_run(t->zt, c + t->zt->copies / 2, p->m, p->x, p->y);
  case 2: return side_run(t->od, c, p->m, p->x, p->y);
  case 3: return f32_run(p->f, c);
  default: return ggml_point_run(t->cx->ggml, &t->gp[s - 4], c);
  }
}

/* ---- the ggml peer of one shape ------------------------------------------------------------------- */

/* ggml's weights of one shape: the same Q4_0 blocks in the plain buffer and, where ggml has one,
 * the repacking buffer (`sides` of them, 0 when the peer is skipped). */
struct ggml_shape {
  unsigned char *q;
  struct ggml_weights w[2];
  int sides, copies;
  size_t bytes;
};

static void ggml_shape_build(const struct context *cx, struct ggml_shape *gs, int64_t k, int64_t n) {
  memset(gs, 0, sizeof *gs);
  if (!cx->ggml)
    return;
  uint64_t rng = 42;
  gs->q = q4_0_blocks(k, n, &rng);
  gs->bytes = (size_t)(n * (k / Q4_0_BLOCK)) * Q4_0_BYTES;
  gs->copies = copies_for(gs->bytes, cx->llc);
  void *bufts[2] = {cx->ggml->plain_buft, cx->ggml->repack_buft};
  for (int i = 0; i < 2 && bufts[i]; i++, gs->sides++)
    ggml_weights_build(cx->ggml, &gs->w[i], bufts[i], k, n, gs->copies, gs->q);
}

static void ggml_shape_free(const struct context *cx, struct ggml_shape *gs) {
  for (int i = 0; i < gs->sides; i++)
    ggml_weights_free(cx->ggml, &gs->w[i]);
  free(gs->q);
}

/* The check of one point after its timing: rows 0 and m - 1 of every ggml side and weight copy
 * against the f32 reference; the worst relative error. */
static double ggml_check(const struct context *cx, const struct ggml_shape *gs, struct ggml_point *gp,
                         int64_t m, const float *x) {
  int64_t k = gs->w[0].k, n = gs->w[0].n, rows[2] = {0, m - 1};
  int nrows = m > 1 ? 2 : 1;
  double *ref = malloc((size_t)(nrows * n) * sizeof *ref), worst = 0;
  if (!ref)
    die("out of memory for the reference");
  for (int r = 0; r < nrows; r++)
    q4_0_reference(gs->q, k, n, x + rows[r] * k, ref + r * n);
  for (int i = 0; i < gs->sides; i++) {
    double e = ggml_point_error(cx->ggml, &gp[i], rows, nrows, ref);
    worst = e > worst || e != e ? e : worst;
  }
  free(ref);
  return worst;
}

/* The ggml fields of a line (each starting with a comma): times, ratios to qkeep_us, bytes, error. */
static void print_ggml(const struct context *cx, const struct ggml_shape *gs, const double *us,
                       double qkeep_us, double err) {
  static const char *const names[] = {"ggml_q4_0", "ggml_q4_0_repack"};
  int ok = err <= GGML_TOLERANCE;
  for (int i = 0; i < 2; i++)
    if (i < gs->sides && ok)
      printf(",\"%s_us\":%.1f,\"%s_ratio\":%.2f", names[i], us[i], names[i], us[i] / qkeep_us);
    else
      printf(",\"%s_us\":null,\"%s_ratio\":null", names[i], names[i]);
  printf(",\"ggml_bytes\":%zu,\"ggml_copies\":%d,\"ggml_rel_err\":%.2e,\"ggml_tolerance\":%.0e,"
         "\"ggml\":\"ggml %s, CPU backend, %d threads\"",
         gs->bytes, gs->copies, err, GGML_TOLERANCE, cx->ggml->version, cx->ggml->threads);
}

/* Times one shape at every M and prints its lines; 1 if a ggml result failed its check, else 0. */
static int bench_shape(const struct context *cx, int64_t k, int64_t n) {
  static const int64_t ms[] = {1, 16, 128, 512};
  size_t int4_bytes = (size_t)(k * n / 2) + (size_t)(k / GROUP * n) * 2, int8_bytes = (size_t)(k * n),
         f32_bytes = 4 * int8_bytes;
  struct side zt = {0}, od = {0};
  int zt_copies = copies_for(int4_bytes, cx->llc);
  side_build(&zt, cx->zt, k, n, zt_copies, gptq_layer);
  side_build(&od, cx->od, k, n, copies_for(int8_bytes, cx->llc), int8_layer);
  struct ggml_shape gs;
  ggml_shape_build(cx, &gs, k, n);
  int failed = 0;
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
    most = most > gs.copies ? most : gs.copies;
    struct ggml_point gp[2];
    for (int g = 0; g < gs.sides; g++)
      ggml_point_build(cx->ggml, &gp[g], &gs.w[g], m, x);
    struct timed t = {{&f, m, x, y}, cx, &zt, &od, gp};
    double us[6];
    int runs = time_interleaved(call, &t, 4 + gs.sides, most, cx->seconds, 301, us);
    double err = gs.sides ? ggml_check(cx, &gs, gp, m, x) : 0;
    if (gs.sides && !(err <= GGML_TOLERANCE)) {
      fprintf(stderr,
              BENCH_NAME ": ggml's result at M = %lld, K = %lld, N = %lld is off by %.3g (tolerance %g)\n",
              (long long)m, (long long)k, (long long)n, err, GGML_TOLERANCE);
      failed = 1;
    }
    static const char *const modes[] = {"w4a16", "da8w4"};
    for (int md = 0; md < 2; md++) {
      printf("{\"bench\":\"int4_linear\",\"mode\":\"%s\",\"M\":%lld,\"K\":%lld,\"N\":%lld,\"group\":%d,"
             "\"threads\":%d,\"runs\":%d,\"qkeep_us\":%.1f,"
             "\"peer\":\"onednn_int8\",\"peer_us\":%.1f,\"ratio\":%.2f,"
             "\"dequant_f32_us\":%.1f,\"dequant_f32_ratio\":%.2f,\"int4_bytes\":%zu,",
             modes[md], (long long)m, (long long)k, (long long)n, GROUP, cx->threads, runs, us[md], us[2],
             us[2] / us[md], us[3], us[3] / us[md], int4_bytes);
      /* The probe names the mode and the instruction set: taken in the mode of this line. */
      char probe[256];
      set_mode(cx, modes[md]);
      qkeep_plugin_probe(cx->zt, probe, sizeof probe);
      print_ceiling(int4_bytes, us[md], cx->copy_bw, zt_copies, cx->llc, probe);
      printf(",\"peer_backend\":\"%s\"", cx->od_probe);
      if (gs.sides)
        print_ggml(cx, &gs, us + 4, us[md], err);
      printf("}\n");
    }
    fflush(stdout);
    for (int g = 0; g < gs.sides; g++)
      ggml_point_free(cx->ggml, &gp[g]);
    omp_set_num_threads(saved);
    f32_free(&f);
    free(x), free(y), free(yf);
  }
  free(w);
  side_free(&zt);
  side_free(&od);
  ggml_shape_free(cx, &gs);
  return failed;
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
  qkeep_plugin_probe(cx.od, cx.od_probe, sizeof cx.od_probe);
  cx.llc = llc_bytes();
  cx.copy_bw = copy_bandwidth(cx.llc, cx.threads);
  struct ggml_peer ggml;
  const char *ggml_path = getenv("QKEEP_BENCH_GGML");
  char why[512] = "QKEEP_BENCH_GGML not set";
  if (ggml_path && *ggml_path && ggml_peer_open(&ggml, ggml_path, cx.threads, why, sizeof why) == 0)
    cx.ggml = &ggml;
  else
    printf("{\"bench\":\"int4_linear\",\"peer\":\"ggml_q4_0\",\"skipped\":\"%s\"}\n", why);
  static const int64_t shapes[][2] = {{4096, 4096}, {4096, 14336}, {14336, 4096}};
  const char *only = getenv("QKEEP_BENCH_SHAPES"); /* e.g. "0" or "0,2": a subset, for quick looks */
  int failed = 0;
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
    if (!only || strchr(only, (int)('0' + s)))
      failed |= bench_shape(&cx, shapes[s][0], shapes[s][1]);
  if (cx.ggml)
    ggml_peer_close(cx.ggml);
  qkeep_plugin_close(cx.zt);
  qkeep_plugin_close(cx.od);
  return failed;
}
