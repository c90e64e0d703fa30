/*
 * check_gpu_mxfp4.c: the shared MXFP4 kernels' CUDA build, through cuda-nvfp4's
 * `mxfp4` layers, on a GPU (`make check-gpu`; exits 77 when the plugin's probe
 * finds no device). Two checkpoints, each loaded through the reference backend and
 * through cuda-nvfp4:
 *   - compressed-tensors mxfp4-pack-quantized, from `qkeep quantize`: fused attention
 *     and MLP shards with biases, a per-expert MoE block, N not a multiple of 16 and K
 *     not of 64 (so the tiles pad and rebind);
 *   - gpt-oss naming: pre-stacked `*_blocks` / `*_scales` / `*_bias` experts written
 *     by this suite, with scales spread over a wide e8m0 range;
 * and checked:
 *   - every linear layer and expert matrix agrees with the reference within bf16
 *     error, for token counts of every token block and K split, forced and automatic,
 *     and on the wgmma kernel (`kernel = wgmma`, from 32 tokens on compute capability 9.0);
 *   - the census is clean and nothing is retired or released;
 *   - the repacked bytes equal mxfp4_layout.c's CPU transforms of the checkpoint
 *     bytes (wave 32), and PWAL on the host gives the same digest;
 *   - reload W0 -> W1 equals a cold start on W1 byte for byte with every device
 *     pointer unchanged, and the kernels give the cold start's bits;
 *   - bf16 and f16 activations, and the routed MoE apply (both namings; on the mma.sync kernel
 *     and with `kernel = wgmma`), agree with the f32 per-expert results.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "gpu_testutil.h"
#include "mxfp4.h"
#include "mxfp4_fixture.h"
#include "private.h"
#include "testutil.h"

#define H 224  /* hidden: a multiple of 32, not of 64 */
#define KV 40  /* k/v rows: not a multiple of 16 (seen alone when unfused) */
#define I 352  /* MLP intermediate */
#define E_I 96 /* expert intermediate */
#define EXPERTS 3
#define VOCAB 100
#define TOLERANCE 1e-2 /* max |y - y_ref| / max |y_ref|: x is rounded to bf16 for the tensor cores */

static char *dir;
static qkeep_plugin *gpu, *ref;

static const struct qkeep_backend *backend(void) { return qkeep_plugin_backend(gpu); }

static void configure(const char *key, const char *value) {
  ck_assert_msg(backend()->configure(backend(), key, value) == 0, "%s = %s: %s", key, value, qkeep_errmsg());
}

static void setup(void) {
  dir = tu_tmpdir("gpu-mxfp4");
  ck_assert_ptr_nonnull(dir);
  configure("split_k", "auto");
  configure("kernel", "auto");
  configure("pwal", "gpu");
}

static void teardown(void) {
  tu_rmtree(dir);
  free(dir);
}

/* ---- the checkpoints ------------------------------------------------------------------------ */

static const struct gtu_model model = {H, KV, I, E_I, EXPERTS, VOCAB};

static char *write_source(const char *file, uint64_t seed) {
  return gtu_write_source(dir, file, seed, &model);
}

static char *quantize(const char *source, const char *out) {
  char *path = tu_path(dir, out);
  struct qkeep_quantize_options o = {
      .size = sizeof o, .scheme = "mxfp4", .kv_cache_scales = true, .activation_amax = 4};
  ck_assert_msg(qkeep_quantize(source, path, &o) == 0, "%s", qkeep_errmsg());
  return path;
}

/* Clean, and every param still live: PWAL retires nothing. */
static void assert_census_clean(qkeep_model *m) {
  struct qkeep_census c = tu_assert_census_clean(m);
  ck_assert_int_eq(c.retired, 0);
}

/* ---- forward check against the reference -------------------------------------------------- */

static void assert_agrees(qkeep_model *m, qkeep_model *r, int64_t tokens, const char *what) {
  gtu_assert_agrees(m, r, tokens, what, TOLERANCE);
}

/* Token counts at and around every token block (8, 16, 32, 64) and past one group of 64. */
static const int64_t tokens[] = {1, 3, 8, 9, 16, 17, 31, 32, 33, 64, 65, 130, 256};
static const char *const splits[] = {"auto", "1", "2", "3", "8"};

/* Every K split (a forced one keeps the mma.sync kernel; `auto` takes the wgmma kernel from 64 tokens on
 * compute capability 9.0), then `kernel = wgmma` (the wgmma kernel from 32 tokens, the mma.sync one below). */
static void assert_agrees_everywhere(qkeep_model *m, qkeep_model *r, const char *what) {
  for (size_t s = 0; s <= sizeof splits / sizeof splits[0]; s++) {
    bool wgmma = s == sizeof splits / sizeof splits[0];
    configure("split_k", wgmma ? "auto" : splits[s]);
    configure("kernel", wgmma ? "wgmma" : "auto");
    char label[96];
    snprintf(label, sizeof label, "%s %s %s", what, wgmma ? "kernel" : "split_k",
             wgmma ? "wgmma" : splits[s]);
    for (size_t t = 0; t < sizeof tokens / sizeof tokens[0]; t++)
      assert_agrees(m, r, tokens[t], label);
  }
  configure("split_k", "auto");
  configure("kernel", "auto");
}

START_TEST(compressed_tensors_agrees_with_reference) {
  char *source = write_source("source.safetensors", 1), *path = quantize(source, "q");
  qkeep_model *m = gtu_load(gpu, path, NULL), *r = gtu_load(ref, path, NULL);
  assert_census_clean(m);
  ck_assert_str_eq(qkeep_layer_backend(qkeep_model_find_layer(m, "model.layers.0.self_attn.qkv_proj")),
                   "cuda-nvfp4");
  assert_agrees_everywhere(m, r, "ct mxfp4");
  qkeep_model_free(m);
  qkeep_model_free(r);
  /* Unfused: k_proj and v_proj alone have 40 rows. */
  m = gtu_load(gpu, path, "none"), r = gtu_load(ref, path, "none");
  assert_census_clean(m);
  assert_agrees(m, r, 3, "unfused");
  assert_agrees(m, r, 33, "unfused");
  qkeep_model_free(m);
  qkeep_model_free(r);
  free(source), free(path);
}
END_TEST

START_TEST(gptoss_agrees_with_reference) {
  char *path = mxfp4_write_gptoss(dir, "gptoss", 1);
  qkeep_model *m = gtu_load(gpu, path, NULL), *r = gtu_load(ref, path, NULL);
  assert_census_clean(m);
  qkeep_layer *moe = qkeep_model_find_layer(m, "model.layers.0.mlp.experts");
  ck_assert_ptr_nonnull(moe);
  ck_assert_str_eq(qkeep_layer_backend(moe), "cuda-nvfp4");
  /* the checkpoint names still resolve, to the objects the kernel reads */
  ck_assert_ptr_eq(qkeep_param_lookup(moe, "w13_weight"), qkeep_param_lookup(moe, "gate_up_proj_blocks"));
  ck_assert_ptr_eq(qkeep_param_lookup(moe, "w2_weight_scale"), qkeep_param_lookup(moe, "down_proj_scales"));
  assert_agrees_everywhere(m, r, "gpt-oss");
  qkeep_model_free(m);
  qkeep_model_free(r);
  free(path);
}
END_TEST

/* ---- what PWAL left -------------------------------------------------------------------------- */

static void *device_to_host(const struct qkeep_view *v, size_t bytes) {
  void *h = malloc(bytes + 1);
  ck_assert_ptr_nonnull(h);
  ck_assert_int_eq(backend()->memory->copy_d2h(backend(), h, v->data, bytes), 0);
  return h;
}

static void view(qkeep_layer *layer, const char *name, struct qkeep_view *v) {
  v->size = sizeof *v;
  ck_assert_msg(qkeep_view_of(layer, name, v) == 0, "%s", qkeep_errmsg());
}

/* One matrix set (prefix "" / "w13_" / "w2_") of a gpu layer against mxfp4_layout.c applied to the
 * reference layer's checkpoint bytes (host memory). */
static void assert_matrix_layout(qkeep_layer *g, qkeep_layer *r, const char *prefix, int64_t rows, int64_t k,
                                 int64_t experts) {
  char name[64];
  struct qkeep_view gw, gs, rw, rs;
  snprintf(name, sizeof name, "%sweight", prefix);
  view(g, name, &gw);
  view(r, name, &rw);
  snprintf(name, sizeof name, "%sweight_scale", prefix);
  view(g, name, &gs);
  view(r, name, &rs);
  ck_assert_int_eq(gw.state, QKEEP_PARAM_LIVE);
  ck_assert_int_eq(gs.state, QKEEP_PARAM_LIVE);
  int64_t e_count = experts ? experts : 1;
  size_t w_bytes = (size_t)mxfp4_code_bytes(rows, k), s_bytes = (size_t)mxfp4_scale_bytes(rows, k);
  ck_assert_uint_eq(gw.nbytes, w_bytes * (size_t)e_count);
  ck_assert_uint_eq(gs.nbytes, s_bytes * (size_t)e_count);
  uint8_t *have_w = device_to_host(&gw, gw.nbytes), *have_s = device_to_host(&gs, gs.nbytes);
  uint8_t *want_w = malloc(w_bytes), *want_s = malloc(s_bytes);
  for (int64_t e = 0; e < e_count; e++) {
    mxfp4_tile_codes((const uint8_t *)rw.data + e * rows * k / 2, rows, k, 32, want_w);
    mxfp4_tile_scales((const uint8_t *)rs.data + e * rows * (k / 32), rows, k, 32, want_s);
    ck_assert_msg(memcmp(have_w + (size_t)e * w_bytes, want_w, w_bytes) == 0, "%sweight: tiles differ",
                  prefix);
    ck_assert_msg(memcmp(have_s + (size_t)e * s_bytes, want_s, s_bytes) == 0, "%sweight_scale: tiles differ",
                  prefix);
  }
  free(have_w), free(have_s), free(want_w), free(want_s);
}

START_TEST(layouts_match_cpu_transforms) {
  char *source = write_source("source.safetensors", 3), *path = quantize(source, "q"),
       *oss = mxfp4_write_gptoss(dir, "oss", 3);
  qkeep_model *m = gtu_load(gpu, path, NULL), *r = gtu_load(ref, path, NULL);
  static const char *const linear[] = {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                                       "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"};
  for (size_t i = 0; i < sizeof linear / sizeof linear[0]; i++) {
    qkeep_layer *g = qkeep_model_find_layer(m, linear[i]), *rl = qkeep_model_find_layer(r, linear[i]);
    ck_assert_ptr_nonnull(g);
    struct qkeep_layer_info info = {.size = sizeof info};
    ck_assert_int_eq(qkeep_layer_get_info(g, &info), 0);
    assert_matrix_layout(g, rl, "", info.n, info.k, 0);
    /* the alias: one object under both names */
    ck_assert_ptr_eq(qkeep_param_lookup(g, "weight_packed"), qkeep_param_lookup(g, "weight"));
  }
  qkeep_layer *g = qkeep_model_find_layer(m, "model.layers.1.mlp.experts");
  qkeep_layer *rl = qkeep_model_find_layer(r, "model.layers.1.mlp.experts");
  ck_assert_ptr_nonnull(g);
  assert_matrix_layout(g, rl, "w13_", 2 * E_I, H, EXPERTS);
  assert_matrix_layout(g, rl, "w2_", H, E_I, EXPERTS);
  /* The same transforms run on the host (mxfp4_layout.c) give the same model, byte for byte. */
  configure("pwal", "host");
  qkeep_model *h = gtu_load(gpu, path, NULL);
  configure("pwal", "gpu");
  struct qkeep_digest a = gtu_digest(m), b = gtu_digest(h);
  ck_assert(a.hi == b.hi && a.lo == b.lo);
  qkeep_model_free(h);
  qkeep_model_free(m);
  qkeep_model_free(r);
  /* gpt-oss's stacked experts, likewise */
  m = gtu_load(gpu, oss, NULL), r = gtu_load(ref, oss, NULL);
  g = qkeep_model_find_layer(m, "model.layers.0.mlp.experts");
  rl = qkeep_model_find_layer(r, "model.layers.0.mlp.experts");
  assert_matrix_layout(g, rl, "w13_", 192, 160, 3);
  assert_matrix_layout(g, rl, "w2_", 160, 96, 3);
  configure("pwal", "host");
  h = gtu_load(gpu, oss, NULL);
  configure("pwal", "gpu");
  a = gtu_digest(m), b = gtu_digest(h);
  ck_assert(a.hi == b.hi && a.lo == b.lo);
  qkeep_model_free(h);
  qkeep_model_free(m);
  qkeep_model_free(r);
  free(source), free(path), free(oss);
}
END_TEST

/* ---- reload ------------------------------------------------------------------------------------ */

static int gpu_to_host(void *dst, const void *src, size_t n) {
  return backend()->memory->copy_d2h(backend(), dst, src, n);
}

/* Reload W0 -> W1 in place; then `layer` (expert 1's w13 when moe) gives the cold start's bits. */
static void assert_reload_in_place(const char *w0, const char *w1, const char *layer, bool moe, int64_t k,
                                   int64_t n) {
  qkeep_model *m = gtu_load(gpu, w0, NULL), *cold = gtu_load(gpu, w1, NULL);
  struct qkeep_digest d0 = gtu_digest(m), d1 = gtu_digest(cold);
  ck_assert(!(d0.hi == d1.hi && d0.lo == d1.lo));
  struct tu_storages before = {.to_host = gpu_to_host}, after = before, cold_bytes = before;
  tu_snapshot(m, &before);
  tu_snapshot(cold, &cold_bytes);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  struct qkeep_digest d = gtu_digest(m);
  ck_assert(d.hi == d1.hi && d.lo == d1.lo);
  tu_snapshot(m, &after);
  tu_assert_in_place_and_equal(&before, &after, &cold_bytes); /* no device pointer moved */
  assert_census_clean(m);
  /* And back to W0, and to W1 again. */
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  d = gtu_digest(m);
  ck_assert(d.hi == d0.hi && d.lo == d0.lo);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  /* The kernels give the cold start's bits on the reloaded weights (a fixed summation order). */
  enum { T = 5 };
  float *x = malloc(sizeof(float) * (size_t)(T * k)), *y[2];
  for (int64_t i = 0; i < T * k; i++)
    x[i] = (float)(i % 97) / 48.0f - 1.0f;
  qkeep_model *pair[2] = {m, cold};
  for (int p = 0; p < 2; p++) {
    qkeep_layer *l = qkeep_model_find_layer(pair[p], layer);
    ck_assert_ptr_nonnull(l);
    y[p] = malloc(sizeof(float) * (size_t)(T * n));
    ck_assert_int_eq(moe ? qkeep_layer_apply_expert_f32(l, 1, QKEEP_MOE_W13, T, x, y[p])
                         : qkeep_layer_apply_f32(l, T, x, y[p]),
                     0);
  }
  ck_assert_int_eq(memcmp(y[0], y[1], sizeof(float) * (size_t)(T * n)), 0);
  free(x), free(y[0]), free(y[1]);
  tu_release_snapshot(&before);
  tu_release_snapshot(&after);
  tu_release_snapshot(&cold_bytes);
  qkeep_model_free(m);
  qkeep_model_free(cold);
}

START_TEST(reload_equals_cold_start_in_place) {
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, "q0"), *w1 = quantize(s1, "q1");
  assert_reload_in_place(w0, w1, "model.layers.0.self_attn.qkv_proj", false, H, H + 2 * KV);
  char *g0 = mxfp4_write_gptoss(dir, "g0", 1), *g1 = mxfp4_write_gptoss(dir, "g1", 2);
  assert_reload_in_place(g0, g1, "model.layers.0.mlp.experts", true, 160, 192);
  free(s0), free(s1), free(w0), free(w1), free(g0), free(g1);
}
END_TEST

/* ---- activations in bf16 / f16, and the routed MoE apply ---------------------------------------- */

static void *to_device(const void *host, size_t bytes) {
  void *d;
  ck_assert_int_eq(backend()->memory->alloc(backend(), bytes, &d), 0);
  ck_assert_int_eq(backend()->memory->copy_h2d(backend(), d, host, bytes), 0);
  return d;
}

static void from_device(void *host, const void *d, size_t bytes) {
  ck_assert_int_eq(backend()->memory->sync(backend()), 0);
  ck_assert_int_eq(backend()->memory->copy_d2h(backend(), host, d, bytes), 0);
}

static void *narrow(const float *x, size_t n, enum qkeep_dtype dtype) {
  uint16_t *h = malloc(n * 2 + 2);
  for (size_t i = 0; i < n; i++)
    h[i] = dtype == QKEEP_DTYPE_BF16 ? qk_f32_to_bf16(x[i]) : qk_f32_to_f16(x[i]);
  return h;
}

static float widen(const void *p, enum qkeep_dtype dtype, size_t i) {
  uint16_t h = ((const uint16_t *)p)[i];
  return dtype == QKEEP_DTYPE_BF16 ? qk_bf16_to_f32(h) : qk_f16_to_f32(h);
}

static void random_x(float *x, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++)
    x[i] = tu_randf(&seed);
}

static double rel_error(const float *a, const float *b, size_t n) {
  double err = 0, ref_max = 0;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - b[i]);
    if (!(d <= err))
      err = d;
    ref_max = fmax(ref_max, fabs((double)b[i]));
  }
  return ref_max > 0 ? err / ref_max : err;
}

START_TEST(half_precision_activations) {
  char *source = write_source("source.safetensors", 5), *path = quantize(source, "q");
  qkeep_model *m = gtu_load(gpu, path, NULL);
  qkeep_layer *layer = qkeep_model_find_layer(m, "model.layers.0.mlp.down_proj");
  static const int64_t counts[] = {3, 21, 70};
  for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
    const int64_t M = counts[c];
    float *x = malloc(sizeof(float) * (size_t)(M * I)), *want = malloc(sizeof(float) * (size_t)(M * H)),
          *got = malloc(sizeof(float) * (size_t)(M * H));
    uint16_t *yh = malloc(2 * (size_t)(M * H));
    random_x(x, (size_t)(M * I), 9);
    ck_assert_int_eq(qkeep_layer_apply_f32(layer, M, x, want), 0);
    static const enum qkeep_dtype types[] = {QKEEP_DTYPE_BF16, QKEEP_DTYPE_F16};
    for (int t = 0; t < 2; t++) {
      void *xh = narrow(x, (size_t)(M * I), types[t]), *dx = to_device(xh, (size_t)(M * I) * 2),
           *dy = to_device(yh, (size_t)(M * H) * 2);
      struct qkeep_apply_args a = {
          .size = sizeof a, .m = M, .x = dx, .x_dtype = types[t], .y = dy, .y_dtype = types[t]};
      ck_assert_msg(backend()->apply(backend(), layer, &a) == 0, "%s", qkeep_errmsg());
      from_device(yh, dy, (size_t)(M * H) * 2);
      for (int64_t i = 0; i < M * H; i++)
        got[i] = widen(yh, types[t], (size_t)i);
      double err = rel_error(got, want, (size_t)(M * H));
      ck_assert_msg(err <= 2 * TOLERANCE, "%s activations, m %lld: %g", t ? "f16" : "bf16", (long long)M,
                    err);
      backend()->memory->free(backend(), dx);
      backend()->memory->free(backend(), dy);
      free(xh);
    }
    free(x), free(want), free(got), free(yh);
  }
  qkeep_model_free(m);
  free(source), free(path);
}
END_TEST

/* Routed apply of both matrices against the single-expert apply, per slot (one skipped). */
static void assert_routed(qkeep_layer *moe, int64_t rows13, int64_t hidden, int64_t inter, int64_t experts) {
  enum { T = 11, TOPK = 2, P = T * TOPK };
  int32_t ids[P];
  float weights[P];
  uint64_t rng = 3;
  for (int p = 0; p < P; p++) {
    ids[p] = p == 5 ? -1 : (int32_t)(tu_rand(&rng) % (uint64_t)experts);
    weights[p] = 0.25f + 0.5f * (float)(tu_rand(&rng) % 100) / 100.0f;
  }
  size_t n13 = (size_t)rows13, nh = (size_t)hidden, ni = (size_t)inter;
  float *x13 = malloc(sizeof(float) * T * nh), *y13 = calloc(P * n13, sizeof(float));
  float *x2 = malloc(sizeof(float) * P * ni), *y2 = calloc(T * nh, sizeof(float));
  float *one = malloc(sizeof(float) * (n13 > nh ? n13 : nh)), *want = malloc(sizeof(float) * nh);
  random_x(x13, T * nh, 4);
  random_x(x2, P * ni, 5);
  void *d_ids = to_device(ids, sizeof ids), *d_w = to_device(weights, sizeof weights);
  void *dx13 = to_device(x13, sizeof(float) * T * nh), *dy13 = to_device(y13, sizeof(float) * P * n13);
  void *dx2 = to_device(x2, sizeof(float) * P * ni), *dy2 = to_device(y2, sizeof(float) * T * nh);
  struct qkeep_apply_args a = {.size = sizeof a,
                               .m = T,
                               .x = dx13,
                               .x_dtype = QKEEP_DTYPE_F32,
                               .y = dy13,
                               .y_dtype = QKEEP_DTYPE_F32,
                               .matrix = QKEEP_MOE_W13,
                               .topk = TOPK,
                               .topk_ids = d_ids,
                               .topk_weights = d_w};
  ck_assert_msg(backend()->apply(backend(), moe, &a) == 0, "%s", qkeep_errmsg());
  from_device(y13, dy13, sizeof(float) * P * n13);
  for (int p = 0; p < P; p++) {
    if (ids[p] < 0)
      continue;
    ck_assert_int_eq(qkeep_layer_apply_expert_f32(moe, ids[p], QKEEP_MOE_W13, 1, x13 + (p / TOPK) * nh, one),
                     0);
    double err = rel_error(y13 + (size_t)p * n13, one, n13);
    ck_assert_msg(err <= 1e-5, "w13 pair %d: %g", p, err);
  }
  a.m = T, a.x = dx2, a.y = dy2, a.matrix = QKEEP_MOE_W2;
  ck_assert_msg(backend()->apply(backend(), moe, &a) == 0, "%s", qkeep_errmsg());
  from_device(y2, dy2, sizeof(float) * T * nh);
  for (int t = 0; t < T; t++) {
    memset(want, 0, sizeof(float) * nh);
    for (int s = 0; s < TOPK; s++) {
      int p = t * TOPK + s;
      if (ids[p] < 0)
        continue;
      ck_assert_int_eq(qkeep_layer_apply_expert_f32(moe, ids[p], QKEEP_MOE_W2, 1, x2 + p * ni, one), 0);
      for (size_t j = 0; j < nh; j++)
        want[j] += weights[p] * one[j];
    }
    double err = rel_error(y2 + t * nh, want, nh);
    ck_assert_msg(err <= 1e-5, "w2 token %d: %g", t, err);
  }
  void *ptrs[] = {d_ids, d_w, dx13, dy13, dx2, dy2};
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
    backend()->memory->free(backend(), ptrs[i]);
  free(x13), free(y13), free(x2), free(y2), free(one), free(want);
}

START_TEST(routed_moe) {
  char *source = write_source("source.safetensors", 7), *path = quantize(source, "q"),
       *oss = mxfp4_write_gptoss(dir, "oss", 7);
  qkeep_model *m = gtu_load(gpu, path, NULL);
  qkeep_layer *moe = qkeep_model_find_layer(m, "model.layers.1.mlp.experts");
  ck_assert_ptr_nonnull(moe);
  for (int wgmma = 0; wgmma < 2; wgmma++) { /* the mma.sync kernel, then `kernel = wgmma` */
    configure("kernel", wgmma ? "wgmma" : "auto");
    assert_routed(moe, 2 * E_I, H, E_I, EXPERTS);
  }
  qkeep_model_free(m);
  m = gtu_load(gpu, oss, NULL);
  moe = qkeep_model_find_layer(m, "model.layers.0.mlp.experts");
  ck_assert_ptr_nonnull(moe);
  for (int wgmma = 0; wgmma < 2; wgmma++) {
    configure("kernel", wgmma ? "wgmma" : "auto");
    assert_routed(moe, 192, 160, 96, 3);
  }
  configure("kernel", "auto");
  qkeep_model_free(m);
  free(source), free(path), free(oss);
}
END_TEST

START_TEST(supports_mxfp4) {
  ck_assert(backend()->supports(backend(), "mxfp4", QKEEP_LAYER_LINEAR));
  ck_assert(backend()->supports(backend(), "mxfp4", QKEEP_LAYER_MOE));
  ck_assert(!backend()->supports(backend(), "gptq-int4", QKEEP_LAYER_LINEAR));
}
END_TEST

static Suite *gpu_suite(void) {
  Suite *s = suite_create("gpu_mxfp4");
  TCase *tc = tcase_create("cuda-nvfp4 mxfp4");
  tcase_set_timeout(tc, 600);
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, supports_mxfp4);
  tcase_add_test(tc, compressed_tensors_agrees_with_reference);
  tcase_add_test(tc, gptoss_agrees_with_reference);
  tcase_add_test(tc, layouts_match_cpu_transforms);
  tcase_add_test(tc, reload_equals_cold_start_in_place);
  tcase_add_test(tc, half_precision_activations);
  tcase_add_test(tc, routed_moe);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return gtu_main("check_gpu_mxfp4", gpu_suite, &gpu, &ref); }
