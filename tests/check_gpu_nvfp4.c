/*
 * check_gpu_nvfp4.c: the cuda-nvfp4 backend on a GPU (`make check-gpu`; exits
 * 77 when the plugin's probe finds no device). A small model with fused
 * attention and MLP shards, biases, an MoE block, and N and K that are not
 * multiples of 128 (nor K of 64), quantized into both NVFP4 namings, is
 * loaded twice, through the reference backend and through cuda-nvfp4:
 *   - every linear layer and expert matrix agrees with the reference within
 *     bf16 error, for several token counts and every kernel shape;
 *   - the census is clean; consumed scales are retired, not dropped;
 *   - the transformed bytes equal layout.c's CPU transforms of the
 *     checkpoint bytes, and PWAL on the host gives the same digest;
 *   - reload W0 -> W1 equals a cold start on W1 byte for byte with every
 *     device pointer unchanged;
 *   - bf16 and f16 activations, and the routed MoE apply (forced through
 *     each kernel, 1 to 256 tokens, top-k 8 over 16 experts of which some
 *     get no token and one most), agree with the f32 per-expert results;
 *   - the batched memory slots against the host: copy_d2d_batch (ranges of
 *     every alignment, some cut into chunks) gives memmove's bytes, and
 *     find_bad_values finds the lowest range holding a bad value (e4m3 and
 *     e8m0 scales, bf16, f16 and f32 weights; every alignment) wherever it
 *     lies in the range, or none.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "cuda_nvfp4.h"
#include "gpu_testutil.h"
#include "layout.h"
#include "private.h"
#include "testutil.h"

#define H 208  /* hidden: a multiple of 16, not of 64 or 128 */
#define KV 40  /* k/v rows: not a multiple of 16 (seen alone when unfused) */
#define I 336  /* MLP intermediate */
#define E_I 80 /* expert intermediate */
#define EXPERTS 3
#define VOCAB 100
#define TOLERANCE 1e-2 /* max |y - y_ref| / max |y_ref|: x is rounded to bf16 for the tensor cores */

static char *dir;
static qkeep_plugin *gpu, *ref;
static const char *const schemes[] = {"modelopt-nvfp4", "ct-nvfp4"};

static const struct qkeep_backend *backend(void) { return qkeep_plugin_backend(gpu); }

static void configure(const char *key, const char *value) {
  ck_assert_msg(backend()->configure(backend(), key, value) == 0, "%s = %s: %s", key, value, qkeep_errmsg());
}

/* The plugins stay open for the whole run (main): CUDA is initialised once per process. */
static void setup(void) {
  dir = tu_tmpdir("gpu-nvfp4");
  ck_assert_ptr_nonnull(dir);
  configure("tile_m", "auto");
  configure("split_k", "auto");
  configure("depth", "auto");
  configure("kernel", "auto");
  configure("rows", "auto");
  configure("unroll", "auto");
  configure("multicast", "auto");
  configure("fp8_activations", "false");
  configure("pwal", "gpu");
}

static void teardown(void) {
  tu_rmtree(dir);
  free(dir);
}

/* ---- the model ------------------------------------------------------------------------------ */

static const struct gtu_model model = {H, KV, I, E_I, EXPERTS, VOCAB};

static char *write_source(const char *file, uint64_t seed) {
  return gtu_write_source(dir, file, seed, &model);
}

static char *quantize(const char *source, const char *scheme, const char *out) {
  char *path = tu_path(dir, out);
  struct qkeep_quantize_options o = {
      .size = sizeof o, .scheme = scheme, .kv_cache_scales = true, .activation_amax = 4};
  ck_assert_msg(qkeep_quantize(source, path, &o) == 0, "%s: %s", scheme, qkeep_errmsg());
  return path;
}

/* Clean, with the consumed scales retired and the alpha buffers added. */
static void assert_census_clean(qkeep_model *m) {
  struct qkeep_census c = tu_assert_census_clean(m);
  ck_assert_int_gt(c.retired, 0);
  ck_assert_int_gt(c.buffers, 0);
}

/* ---- forward check against the reference -------------------------------------------------- */

static void assert_agrees(qkeep_model *m, qkeep_model *r, int64_t tokens, const char *what) {
  gtu_assert_agrees(m, r, tokens, what, TOLERANCE);
}

START_TEST(agrees_with_reference) {
  const char *scheme = schemes[_i];
  char *source = write_source("source.safetensors", 1), *path = quantize(source, scheme, "q");
  qkeep_model *m = gtu_load(gpu, path, NULL), *r = gtu_load(ref, path, NULL);
  assert_census_clean(m);
  /* Every bucket the plan picks: the streaming kernel (8 and 16 tokens), the wgmma kernel's
   * token tiles 32, 64 and 128, partial and whole. */
  static const int64_t tokens[] = {1, 4, 5, 6, 13, 16, 19, 31, 32, 37, 64, 100, 256, 1024};
  for (size_t t = 0; t < sizeof tokens / sizeof tokens[0]; t++)
    assert_agrees(m, r, tokens[t], scheme);
  /* Every ring kernel shape and K split, forced. */
  configure("kernel", "ring");
  static const char *const tile_m[] = {"8", "16", "32", "64"};
  static const char *const split[] = {"1", "2", "3", "8"};
  for (int a = 0; a < 4; a++)
    for (int b = 0; b < 4; b++)
      for (int deep = 0; deep < (b == 1 ? 2 : 1); deep++) {
        char what[96];
        configure("tile_m", tile_m[a]);
        configure("split_k", split[b]);
        configure("depth", deep ? "8" : "auto");
        snprintf(what, sizeof what, "%s tile_m %s split_k %s depth %s", scheme, tile_m[a], split[b],
                 deep ? "deep" : "default");
        assert_agrees(m, r, 13, what);
        assert_agrees(m, r, 70, what);
      }
  configure("tile_m", "auto");
  configure("depth", "auto");
  /* Every wgmma kernel shape and K split, forced (on a GPU other than compute capability 9.0
   * the plan falls back to the ring kernel). */
  configure("kernel", "wgmma");
  static const char *const wg_tile[] = {"8", "16", "32", "64", "128", "256"}, *const wg_rows[] = {"1", "2"};
  for (int a = 0; a < 6; a++)
    for (int rw = 0; rw < 2; rw++)
      for (int b = 0; b < 4; b++) {
        char what[96];
        configure("tile_m", wg_tile[a]);
        configure("rows", wg_rows[rw]);
        configure("split_k", split[b]);
        snprintf(what, sizeof what, "%s wgmma tile_m %s rows %s split_k %s", scheme, wg_tile[a], wg_rows[rw],
                 split[b]);
        assert_agrees(m, r, 1, what);
        assert_agrees(m, r, 13, what);
        assert_agrees(m, r, 70, what);
        assert_agrees(m, r, 257, what);
      }
  /* Clusters of row blocks sharing the activations (multicast), the grid rounded up to whole
   * clusters where the row blocks do not fill them (this model's 2, 3 and 6 row blocks). */
  configure("split_k", "1");
  static const char *const wg_mc[] = {"2", "4"};
  enum { MC_TOKENS = 257, MC_N = 2 * I };
  float *mc_x = malloc(sizeof(float) * MC_TOKENS * H), *mc_y1 = malloc(sizeof(float) * MC_TOKENS * MC_N),
        *mc_y = malloc(sizeof(float) * MC_TOKENS * MC_N);
  ck_assert(mc_x && mc_y1 && mc_y);
  for (int i = 0; i < MC_TOKENS * H; i++)
    mc_x[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
  qkeep_layer *gate_up = qkeep_model_find_layer(m, "model.layers.0.mlp.gate_up_proj");
  ck_assert_ptr_nonnull(gate_up);
  for (int a = 2; a < 6; a++)
    for (int rw = 0; rw < 2; rw++)
      for (int c = 0; c < 2; c++) {
        char what[96];
        configure("tile_m", wg_tile[a]);
        configure("rows", wg_rows[rw]);
        configure("multicast", wg_mc[c]);
        snprintf(what, sizeof what, "%s wgmma tile_m %s rows %s multicast %s", scheme, wg_tile[a],
                 wg_rows[rw], wg_mc[c]);
        assert_agrees(m, r, 13, what);
        assert_agrees(m, r, 257, what);
        assert_agrees(m, r, 1024, what);
        /* The same bits as without a cluster: each block's tiles and order of sums are the same. */
        ck_assert_int_eq(qkeep_layer_apply_f32(gate_up, MC_TOKENS, mc_x, mc_y), 0);
        configure("multicast", "1");
        ck_assert_int_eq(qkeep_layer_apply_f32(gate_up, MC_TOKENS, mc_x, mc_y1), 0);
        ck_assert_msg(memcmp(mc_y, mc_y1, sizeof(float) * MC_TOKENS * MC_N) == 0,
                      "%s: not the bits of multicast 1", what);
      }
  free(mc_x), free(mc_y1), free(mc_y);
  configure("multicast", "auto");
  configure("tile_m", "auto");
  configure("rows", "auto");
  /* Every streaming kernel shape and K split, forced, at token counts of both widths. */
  configure("kernel", "stream");
  static const char *const rows[] = {"1", "2", "4"}, *const unroll[] = {"4", "8"};
  static const int64_t few[] = {1, 6, 13};
  for (int a = 0; a < 3; a++)
    for (int u = 0; u < 3; u++) /* unroll 4, 8, and 4 with registers for 3 blocks per SM */
      for (int b = 0; b < 4; b++) {
        char what[96];
        configure("rows", rows[a]);
        configure("unroll", unroll[u % 2]);
        configure("depth", u == 2 ? "3" : "auto");
        configure("split_k", split[b]);
        snprintf(what, sizeof what, "%s stream rows %s unroll %s%s split_k %s", scheme, rows[a],
                 unroll[u % 2], u == 2 ? " depth 3" : "", split[b]);
        for (size_t t = 0; t < sizeof few / sizeof few[0]; t++)
          assert_agrees(m, r, few[t], what);
      }
  configure("kernel", "auto");
  configure("rows", "auto");
  configure("unroll", "auto");
  configure("depth", "auto");
  configure("split_k", "auto");
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

/* One matrix (prefix "" / "w13_" / "w2_") of a gpu layer against layout.c applied to the
 * reference layer's checkpoint bytes (host memory). */
static void assert_matrix_layout(qkeep_layer *g, qkeep_layer *r, const char *prefix, int64_t rows, int64_t k,
                                 int64_t experts, bool ct) {
  char name[64];
  struct qkeep_view gw, gs, rw, rs, ga, rg;
  snprintf(name, sizeof name, "%sweight", prefix);
  view(g, name, &gw);
  view(r, name, &rw);
  snprintf(name, sizeof name, "%sweight_scale", prefix);
  view(g, name, &gs);
  view(r, name, &rs);
  ck_assert_int_eq(gw.state, QKEEP_PARAM_LIVE);
  ck_assert_int_eq(gs.state, QKEEP_PARAM_LIVE);
  int64_t e_count = experts ? experts : 1, cols = k / 16;
  size_t w_bytes = (size_t)nvfp4_w_bytes(rows, k), s_bytes = (size_t)nvfp4_sf_bytes(rows, cols);
  ck_assert_uint_eq(gw.nbytes, w_bytes * (size_t)e_count);
  ck_assert_uint_eq(gs.nbytes, s_bytes * (size_t)e_count);
  uint8_t *have_w = device_to_host(&gw, gw.nbytes), *have_s = device_to_host(&gs, gs.nbytes);
  uint8_t *want_w = malloc(w_bytes), *want_s = malloc(s_bytes);
  for (int64_t e = 0; e < e_count; e++) {
    nvfp4_tile_weights((const uint8_t *)rw.data + e * rows * k / 2, rows, k, want_w);
    nvfp4_swizzle_scales((const uint8_t *)rs.data + e * rows * cols, rows, cols, want_s);
    ck_assert_msg(memcmp(have_w + (size_t)e * w_bytes, want_w, w_bytes) == 0, "%s%s: weight tiles differ",
                  prefix, "weight");
    ck_assert_msg(memcmp(have_s + (size_t)e * s_bytes, want_s, s_bytes) == 0, "%s%s: swizzled scales differ",
                  prefix, "weight_scale");
  }
  /* alpha: the decode global scale; the consumed and the unread scales retired, bytes kept. */
  snprintf(name, sizeof name, "%salpha", prefix);
  view(g, name, &ga);
  snprintf(name, sizeof name, "%s%s", prefix, ct ? "weight_global_scale" : "weight_scale_2");
  view(r, name, &rg);
  float *alpha = device_to_host(&ga, ga.nbytes);
  ck_assert_uint_eq(ga.nbytes, sizeof(float) * (size_t)e_count);
  for (int64_t e = 0; e < e_count; e++) {
    float g0 = ((const float *)rg.data)[e];
    ck_assert_float_eq(alpha[e], ct ? (g0 == 0 ? 0 : 1.0f / g0) : g0);
  }
  struct qkeep_view retired;
  view(g, name, &retired);
  ck_assert_int_eq(retired.state, QKEEP_PARAM_RETIRED);
  ck_assert_ptr_null(qkeep_get_live_param(g, name));
  snprintf(name, sizeof name, "%s%s", prefix, ct ? "input_global_scale" : "input_scale");
  view(g, name, &retired);
  ck_assert_int_eq(retired.state, QKEEP_PARAM_RETIRED);
  if (ct) { /* the alias: one object under both names */
    snprintf(name, sizeof name, "%sweight_packed", prefix);
    char alias[64];
    snprintf(alias, sizeof alias, "%sweight", prefix);
    ck_assert_ptr_eq(qkeep_param_lookup(g, name), qkeep_param_lookup(g, alias));
  }
  free(have_w), free(have_s), free(want_w), free(want_s), free(alpha);
}

START_TEST(layouts_match_cpu_transforms) {
  const char *scheme = schemes[_i];
  bool ct = scheme[0] == 'c';
  char *source = write_source("source.safetensors", 3), *path = quantize(source, scheme, "q");
  qkeep_model *m = gtu_load(gpu, path, NULL), *r = gtu_load(ref, path, NULL);
  static const char *const linear[] = {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                                       "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"};
  for (size_t i = 0; i < sizeof linear / sizeof linear[0]; i++) {
    qkeep_layer *g = qkeep_model_find_layer(m, linear[i]), *rl = qkeep_model_find_layer(r, linear[i]);
    ck_assert_ptr_nonnull(g);
    struct qkeep_layer_info info = {.size = sizeof info};
    ck_assert_int_eq(qkeep_layer_get_info(g, &info), 0);
    assert_matrix_layout(g, rl, "", info.n, info.k, 0, ct);
  }
  qkeep_layer *g = qkeep_model_find_layer(m, "model.layers.1.mlp.experts");
  qkeep_layer *rl = qkeep_model_find_layer(r, "model.layers.1.mlp.experts");
  ck_assert_ptr_nonnull(g);
  assert_matrix_layout(g, rl, "w13_", 2 * E_I, H, EXPERTS, ct);
  assert_matrix_layout(g, rl, "w2_", H, E_I, EXPERTS, ct);
  /* The same transforms run on the host (layout.c) give the same model, byte for byte. */
  configure("pwal", "host");
  qkeep_model *h = gtu_load(gpu, path, NULL);
  configure("pwal", "gpu");
  struct qkeep_digest a = gtu_digest(m), b = gtu_digest(h);
  ck_assert(a.hi == b.hi && a.lo == b.lo);
  qkeep_model_free(h);
  qkeep_model_free(m);
  qkeep_model_free(r);
  free(source), free(path);
}
END_TEST

/* ---- reload ------------------------------------------------------------------------------------ */

/* Device storages to the host, for snapshots. */
static int gpu_to_host(void *dst, const void *src, size_t n) {
  return backend()->memory->copy_d2h(backend(), dst, src, n);
}

START_TEST(reload_equals_cold_start_in_place) {
  const char *scheme = schemes[_i];
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, scheme, "q0"), *w1 = quantize(s1, scheme, "q1");
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
  /* And back to W0. */
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  d = gtu_digest(m);
  ck_assert(d.hi == d0.hi && d.lo == d0.lo);
  /* The kernels give the cold start's bits on the reloaded weights. */
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  float x[2 * H], y0[2 * (H + 2 * KV)], y1[2 * (H + 2 * KV)];
  for (int i = 0; i < 2 * H; i++)
    x[i] = (float)i / H - 1.0f;
  ck_assert_int_eq(
      qkeep_layer_apply_f32(qkeep_model_find_layer(m, "model.layers.0.self_attn.qkv_proj"), 2, x, y0), 0);
  ck_assert_int_eq(
      qkeep_layer_apply_f32(qkeep_model_find_layer(cold, "model.layers.0.self_attn.qkv_proj"), 2, x, y1), 0);
  ck_assert_int_eq(memcmp(y0, y1, sizeof y0), 0);
  tu_release_snapshot(&before);
  tu_release_snapshot(&after);
  tu_release_snapshot(&cold_bytes);
  qkeep_model_free(m);
  qkeep_model_free(cold);
  free(s0), free(s1), free(w0), free(w1);
}
END_TEST

/* The extra device memory a model's load needed: its peak over what it holds. */
static int64_t load_extra(qkeep_model *m) {
  struct qkeep_memory_stats mem = {.size = sizeof mem};
  ck_assert_int_eq(qkeep_model_memory(m, &mem, false), 0);
  return mem.storage_peak - mem.storage_bytes;
}

static bool same_digest(struct qkeep_digest a, struct qkeep_digest b) { return a.hi == b.hi && a.lo == b.lo; }

/*
 * With pwal = in-place, shapes whose kernel layout is as large as the checkpoint's are transformed in
 * their own memory: K up to 8192 (a
 * 128-row group of down_proj spread over a cluster of 8 blocks' shared memory), fused q/k/v of 1,152
 * rows, stacked experts. The bytes equal the transforms into a new tensor and their CPU twins (digests),
 * the load needs no result memory (less extra memory than into new tensors), and a reload in place equals
 * a cold start with no pointer moved.
 */
START_TEST(in_place_transforms_equal_the_copies) {
  static const struct gtu_model big = {1024, 64, 8192, 256, 3, 64};
  char *s0 = gtu_write_source(dir, "in-place-0.safetensors", 11, &big);
  char *s1 = gtu_write_source(dir, "in-place-1.safetensors", 12, &big);
  char *w0 = quantize(s0, "modelopt-nvfp4", "in-place-q0"),
       *w1 = quantize(s1, "modelopt-nvfp4", "in-place-q1");
  configure("pwal", "in-place");
  qkeep_model *m = gtu_load(gpu, w0, NULL);
  configure("pwal", "gpu");
  qkeep_model *copied = gtu_load(gpu, w0, NULL);
  configure("pwal", "host");
  qkeep_model *host = gtu_load(gpu, w0, NULL);
  configure("pwal", "in-place"); /* for the reloads below (and the cold start they equal) */
  struct qkeep_digest d0 = gtu_digest(m);
  ck_assert(same_digest(d0, gtu_digest(copied)));
  ck_assert(same_digest(d0, gtu_digest(host)));
  ck_assert_int_lt(load_extra(m), load_extra(copied));
  assert_census_clean(m);
  qkeep_model *cold = gtu_load(gpu, w1, NULL);
  struct tu_storages before = {.to_host = gpu_to_host}, after = before, cold_bytes = before;
  tu_snapshot(m, &before);
  tu_snapshot(cold, &cold_bytes);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same_digest(gtu_digest(m), gtu_digest(cold)));
  tu_snapshot(m, &after);
  tu_assert_in_place_and_equal(&before, &after, &cold_bytes);
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same_digest(gtu_digest(m), d0));
  configure("pwal", "gpu");
  tu_release_snapshot(&before), tu_release_snapshot(&after), tu_release_snapshot(&cold_bytes);
  qkeep_model_free(cold), qkeep_model_free(host), qkeep_model_free(copied), qkeep_model_free(m);
  free(s0), free(s1), free(w0), free(w1);
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

/* Rounds x to a 16-bit type (BF16 or F16) and back, element by element. */
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

/* max |a - b| / max |b| */
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
  char *source = write_source("source.safetensors", 5), *path = quantize(source, "modelopt-nvfp4", "q");
  qkeep_model *m = gtu_load(gpu, path, NULL);
  qkeep_layer *layer = qkeep_model_find_layer(m, "model.layers.0.mlp.down_proj");
  enum { M = 21 };
  float x[M * I], want[M * H], got[M * H];
  random_x(x, M * I, 9);
  ck_assert_int_eq(qkeep_layer_apply_f32(layer, M, x, want), 0);
  static const enum qkeep_dtype types[] = {QKEEP_DTYPE_BF16, QKEEP_DTYPE_F16};
  for (int t = 0; t < 2; t++) {
    void *xh = narrow(x, M * I, types[t]), *dx = to_device(xh, M * I * 2), *dy = to_device(got, M * H * 2);
    struct qkeep_apply_args a = {
        .size = sizeof a, .m = M, .x = dx, .x_dtype = types[t], .y = dy, .y_dtype = types[t]};
    ck_assert_msg(backend()->apply(backend(), layer, &a) == 0, "%s", qkeep_errmsg());
    uint16_t yh[M * H];
    from_device(yh, dy, sizeof yh);
    for (int i = 0; i < M * H; i++)
      got[i] = widen(yh, types[t], (size_t)i);
    double err = rel_error(got, want, M * H);
    ck_assert_msg(err <= 2 * TOLERANCE, "%s activations: %g", t ? "f16" : "bf16", err);
    backend()->memory->free(backend(), dx);
    backend()->memory->free(backend(), dy);
    free(xh);
  }
  qkeep_model_free(m);
  free(source), free(path);
}
END_TEST

/* ---- FP8 activations (opt-in) ---------------------------------------------------------------- */

/* v (a float value) rounded to e4m3 as cvt.rn.satfinite does it: nearest even, subnormals from 2^-9,
 * saturating at 448, which is the quantizer's qk_e4m3_encode. */
static double e4m3_round(float v) { return qk_e4m3_decode(qk_e4m3_encode(v)); }

/*
 * A linear layer's output with fp8_activations on, against its emulation on the host from the bytes
 * PWAL left on the device (codes, block scales, alpha, bias): per token, amax = max |x| (as the
 * device reads x), x rounded to e4m3 after x * (448 / amax); each weight code x block scale x 2^-7
 * rounded to e4m3; their products summed, times 2^7 x alpha x amax / 448, plus the bias. Only the
 * order and precision of the sums differ: every value within 2e-3 of the sum of |products|, and the
 * output's distance to the emulation under 5 % of the emulation's distance to W4A16 (root mean
 * squares). W4A16 (the option off): within 8 % (e4m3's own error), and below 64 tokens the same bits.
 */
static void assert_fp8_layer(qkeep_model *m, const char *name, int64_t tokens, enum qkeep_dtype x_dtype) {
  qkeep_layer *layer = qkeep_model_find_layer(m, name);
  ck_assert_ptr_nonnull(layer);
  struct qkeep_layer_info info = {.size = sizeof info};
  ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
  const int64_t n = info.n, k = info.k, cols = k / 16;
  struct qkeep_view vw, vs, va, vb;
  view(layer, "weight", &vw);
  view(layer, "weight_scale", &vs);
  view(layer, "alpha", &va);
  vb.size = sizeof vb;
  bool has_bias = qkeep_view_of(layer, "bias", &vb) == 0;
  uint8_t *tiled = device_to_host(&vw, vw.nbytes), *swizzled = device_to_host(&vs, vs.nbytes);
  uint8_t *codes = tu_xmalloc((size_t)(n * k / 2)), *scales = tu_xmalloc((size_t)(n * cols));
  nvfp4_untile_weights(tiled, n, k, codes);
  nvfp4_unswizzle_scales(swizzled, n, cols, scales);
  float alpha, *bias = NULL;
  ck_assert_int_eq(backend()->memory->copy_d2h(backend(), &alpha, va.data, sizeof alpha), 0);
  if (has_bias) {
    bias = tu_xmalloc((size_t)n * sizeof *bias);
    if (vb.spec.dtype == QKEEP_DTYPE_F32) {
      ck_assert_int_eq(backend()->memory->copy_d2h(backend(), bias, vb.data, (size_t)n * 4), 0);
    } else {
      uint16_t *h = device_to_host(&vb, (size_t)n * 2);
      for (int64_t i = 0; i < n; i++)
        bias[i] = widen(h, vb.spec.dtype, (size_t)i);
      free(h);
    }
  }
  /* x: random, one row of zeros, one with an outlier 40 times the rest. */
  float *x = tu_xmalloc((size_t)(tokens * k) * sizeof *x);
  random_x(x, (size_t)(tokens * k), 31 + (uint64_t)tokens);
  memset(x + 3 * k, 0, (size_t)k * sizeof *x);
  x[5 * k + 7] = 40.0f;
  const size_t xb = x_dtype == QKEEP_DTYPE_F32 ? 4 : 2;
  void *xh = x_dtype == QKEEP_DTYPE_F32 ? x : narrow(x, (size_t)(tokens * k), x_dtype);
  void *dx = to_device(xh, (size_t)(tokens * k) * xb), *dy;
  float *got = tu_xmalloc((size_t)(tokens * n) * sizeof *got), *exact = tu_xmalloc((size_t)(tokens * n) * 4);
  ck_assert_int_eq(backend()->memory->alloc(backend(), (size_t)(tokens * n) * 4, &dy), 0);
  for (int fp8 = 1; fp8 >= 0; fp8--) {
    configure("fp8_activations", fp8 ? "true" : "false");
    struct qkeep_apply_args a = {
        .size = sizeof a, .m = tokens, .x = dx, .x_dtype = x_dtype, .y = dy, .y_dtype = QKEEP_DTYPE_F32};
    ck_assert_msg(backend()->apply(backend(), layer, &a) == 0, "%s: %s", name, qkeep_errmsg());
    from_device(fp8 ? got : exact, dy, (size_t)(tokens * n) * 4);
  }
  if (tokens < NVFP4_FP8_MIN_M) { /* W4A16 either way: the same bits */
    ck_assert_msg(memcmp(got, exact, (size_t)(tokens * n) * sizeof *got) == 0, "%s: %lld tokens", name,
                  (long long)tokens);
  } else {
    double off_emulation = 0, off_w4a16 = 0, norm = 0;
    for (int64_t t = 0; t < tokens; t++) {
      float amax = 0;
      for (int64_t i = 0; i < k; i++) {
        float v = x_dtype == QKEEP_DTYPE_F32 ? x[t * k + i] : widen(xh, x_dtype, (size_t)(t * k + i));
        amax = fmaxf(amax, fabsf(v));
      }
      const float inv = amax > 0 ? 448.0f / amax : 0.0f;
      for (int64_t r = 0; r < n; r++) {
        double sum = 0, mag = 0;
        for (int64_t i = 0; i < k; i++) {
          float v = x_dtype == QKEEP_DTYPE_F32 ? x[t * k + i] : widen(xh, x_dtype, (size_t)(t * k + i));
          double xq = e4m3_round(v * inv);
          double wq = e4m3_round(qk_e2m1_decode(qk_fp4_code(codes + r * (k / 2), i)) *
                                 qk_e4m3_decode(scales[r * cols + i / 16]) / 128.0f); /* exact in f32 */
          sum += wq * xq, mag += fabs(wq * xq);
        }
        const double scale = 128.0 * alpha * (amax / 448.0f);
        const double want = sum * scale + (bias ? bias[r] : 0), have = got[t * n + r],
                     w4a16 = exact[t * n + r];
        /* No element far off (a wrong k, row or token is off by about the whole sum) ... */
        ck_assert_msg(fabs(have - want) <= 2e-3 * mag * scale + 1e-6 * fabs(want),
                      "%s, %lld tokens, x %d: token %lld row %lld: %g, emulated %g", name, (long long)tokens,
                      (int)x_dtype, (long long)t, (long long)r, have, want);
        off_emulation += (have - want) * (have - want);
        off_w4a16 += (want - w4a16) * (want - w4a16);
        norm += w4a16 * w4a16;
      }
    }
    /* ... and the whole output far nearer the emulation than the emulation is to W4A16 (a rounding
     * that differs from the emulation's moves it by about that much); W4A16 within a few percent. */
    ck_assert_msg(off_w4a16 > 0 && off_emulation <= 0.0025 * off_w4a16,
                  "%s, %lld tokens, x %d: off the emulation %g (rms), the emulation off W4A16 %g", name,
                  (long long)tokens, (int)x_dtype, sqrt(off_emulation), sqrt(off_w4a16));
    ck_assert_msg(off_w4a16 < 0.0064 * norm, "%s: FP8 vs W4A16 %g (relative rms)", name,
                  sqrt(off_w4a16 / (norm > 0 ? norm : 1)));
  }
  backend()->memory->free(backend(), dx);
  backend()->memory->free(backend(), dy);
  if (xh != x)
    free(xh);
  free(x), free(got), free(exact), free(tiled), free(swizzled), free(codes), free(scales), free(bias);
}

START_TEST(fp8_activations_match_their_emulation) {
  char *source = write_source("source.safetensors", 7), *path = quantize(source, "modelopt-nvfp4", "q");
  qkeep_model *m = gtu_load(gpu, path, NULL);
  static const enum qkeep_dtype types[] = {QKEEP_DTYPE_BF16, QKEEP_DTYPE_F16, QKEEP_DTYPE_F32};
  static const int64_t tokens[] = {64, 100, 256};
  const char *tiles[] = {"auto", "32", "256"};
  for (int t = 0; t < 3; t++) {
    configure("tile_m", tiles[t]);
    for (size_t i = 0; i < sizeof tokens / sizeof tokens[0]; i++) {
      assert_fp8_layer(m, "model.layers.0.mlp.down_proj", tokens[i], types[(i + t) % 3]);
      assert_fp8_layer(m, "model.layers.0.mlp.gate_up_proj", tokens[i], types[(i + t + 1) % 3]);
      assert_fp8_layer(m, "model.layers.0.self_attn.qkv_proj", tokens[i], types[(i + t + 2) % 3]);
    }
  }
  configure("tile_m", "auto");
  assert_fp8_layer(m, "model.layers.0.mlp.down_proj", 40, QKEEP_DTYPE_BF16); /* below 64: W4A16 */
  configure("fp8_activations", "false");
  qkeep_model_free(m);
  free(source), free(path);
}
END_TEST

/* The routed apply of `matrix` to host x (x_floats) into host y (y_floats) through the current
 * configuration; ids and router weights on the device. */
static void routed_apply(qkeep_layer *moe, int matrix, int64_t tokens, int32_t topk, void *d_ids, void *d_w,
                         const float *x, size_t x_floats, float *y, size_t y_floats) {
  void *dx = to_device(x, x_floats * sizeof *x), *dy = to_device(y, y_floats * sizeof *y);
  struct qkeep_apply_args a = {.size = sizeof a,
                               .m = tokens,
                               .x = dx,
                               .x_dtype = QKEEP_DTYPE_F32,
                               .y = dy,
                               .y_dtype = QKEEP_DTYPE_F32,
                               .matrix = matrix,
                               .topk = topk,
                               .topk_ids = d_ids,
                               .topk_weights = d_w};
  ck_assert_msg(backend()->apply(backend(), moe, &a) == 0, "%s", qkeep_errmsg());
  from_device(y, dy, y_floats * sizeof *y);
  backend()->memory->free(backend(), dx);
  backend()->memory->free(backend(), dy);
}

/* A decode chain on one stream: each apply reads what the apply before it wrote, with no wait between
 * them; the streaming kernel starts before the kernel before it ends (programmatic dependent launch) and
 * must wait for it before it reads its activations. The same chain with a device sync after every apply
 * gives the same bits at every step. */
START_TEST(chained_applies_read_the_outputs_before_them) {
  const char *scheme = schemes[_i];
  char *source = write_source("source.safetensors", 4), *path = quantize(source, scheme, "q");
  qkeep_model *m = gtu_load(gpu, path, NULL);
  qkeep_layer *o = qkeep_model_find_layer(m, "model.layers.0.self_attn.o_proj");
  ck_assert_ptr_nonnull(o);
  enum { STEPS = 12, M = 4 };
  float x[M * H], chained[M * H], synced[M * H];
  random_x(x, M * H, 21);
  void *buf[STEPS + 1];
  for (int i = 0; i <= STEPS; i++)
    buf[i] = to_device(x, sizeof x);
  for (int pass = 0; pass < 2; pass++) {
    for (int i = 0; i < STEPS; i++) {
      struct qkeep_apply_args a = {.size = sizeof a,
                                   .m = M,
                                   .x = buf[i],
                                   .x_dtype = QKEEP_DTYPE_F32,
                                   .y = buf[i + 1],
                                   .y_dtype = QKEEP_DTYPE_F32};
      ck_assert_msg(backend()->apply(backend(), o, &a) == 0, "%s", qkeep_errmsg());
      if (pass == 1)
        ck_assert_int_eq(backend()->memory->sync(backend()), 0);
    }
    from_device(pass ? synced : chained, buf[STEPS], sizeof x);
    for (int i = 1; i <= STEPS; i++) /* the next pass starts from fresh buffers */
      ck_assert_int_eq(backend()->memory->copy_h2d(backend(), buf[i], x, sizeof x), 0);
  }
  ck_assert_msg(memcmp(chained, synced, sizeof x) == 0, "%s: a chain of applies without waits differs",
                scheme);
  for (int i = 0; i <= STEPS; i++)
    backend()->memory->free(backend(), buf[i]);
  qkeep_model_free(m);
  free(source), free(path);
}
END_TEST

START_TEST(routed_moe) {
  const char *scheme = schemes[_i];
  char *source = write_source("source.safetensors", 7), *path = quantize(source, scheme, "q");
  qkeep_model *m = gtu_load(gpu, path, NULL);
  qkeep_layer *moe = qkeep_model_find_layer(m, "model.layers.1.mlp.experts");
  ck_assert_ptr_nonnull(moe);
  enum { T = 11, TOPK = 2, P = T * TOPK };
  int32_t ids[P];
  float weights[P];
  uint64_t rng = 3;
  for (int p = 0; p < P; p++) {
    ids[p] = p == 5 ? -1 : (int32_t)(tu_rand(&rng) % EXPERTS); /* one skipped slot */
    weights[p] = 0.25f + 0.5f * (float)(tu_rand(&rng) % 100) / 100.0f;
  }
  static float x13[T * H], y13[P * 2 * E_I], x2[P * E_I], y2[T * H], one[2 * E_I > H ? 2 * E_I : H];
  random_x(x13, T * H, 4);
  random_x(x2, P * E_I, 5);
  void *d_ids = to_device(ids, sizeof ids), *d_w = to_device(weights, sizeof weights);
  routed_apply(moe, QKEEP_MOE_W13, T, TOPK, d_ids, d_w, x13, T * H, y13, P * 2 * E_I);
  /* Row t * TOPK + s is x[t] through expert ids[.]'s w13, as the single-expert apply gives it. */
  for (int p = 0; p < P; p++) {
    if (ids[p] < 0)
      continue;
    ck_assert_int_eq(qkeep_layer_apply_expert_f32(moe, ids[p], QKEEP_MOE_W13, 1, x13 + (p / TOPK) * H, one),
                     0);
    double err = rel_error(y13 + (size_t)p * 2 * E_I, one, 2 * E_I);
    ck_assert_msg(err <= 1e-5, "w13 pair %d: %g", p, err);
  }
  routed_apply(moe, QKEEP_MOE_W2, T, TOPK, d_ids, d_w, x2, P * E_I, y2, T * H);
  for (int t = 0; t < T; t++) {
    float want[H] = {0};
    for (int s = 0; s < TOPK; s++) {
      int p = t * TOPK + s;
      if (ids[p] < 0)
        continue;
      ck_assert_int_eq(qkeep_layer_apply_expert_f32(moe, ids[p], QKEEP_MOE_W2, 1, x2 + p * E_I, one), 0);
      for (int j = 0; j < H; j++)
        want[j] += weights[p] * one[j];
    }
    double err = rel_error(y2 + t * H, want, H);
    ck_assert_msg(err <= 1e-5, "w2 token %d: %g", t, err);
  }
  backend()->memory->free(backend(), d_ids);
  backend()->memory->free(backend(), d_w);
  qkeep_model_free(m);
  free(source), free(path);
}
END_TEST

/* Routed MoE forced through each kernel, top-k 8 over 16 experts at 1 to 256 tokens, against
 * the single-expert apply of each (token, slot) pair: half the slots go to expert 0 (one
 * expert with many tokens), the rest to experts 1..7 (experts 8..15 get none), one slot is
 * skipped. The plan's token tiles 8 and 16 (stream), 16, 32, 64 and 128 (wgmma), K splits. */
enum { R_EXPERTS = 16, R_TOPK = 8 };

struct routed_case {
  const char *kernel, *tile_m, *split_k, *route;
};

START_TEST(routed_moe_every_kernel) {
  const char *scheme = schemes[_i];
  static const struct gtu_model moe_model = {H, KV, I, E_I, R_EXPERTS, VOCAB};
  char *source = gtu_write_source(dir, "moe.safetensors", 11, &moe_model),
       *path = quantize(source, scheme, "q");
  qkeep_model *m = gtu_load(gpu, path, NULL);
  qkeep_layer *moe = qkeep_model_find_layer(m, "model.layers.1.mlp.experts");
  ck_assert_ptr_nonnull(moe);
  static const int64_t tokens[] = {1, 6, 13, 64, 256};
  static const struct routed_case cases[] = {
      {"auto", "auto", "auto", "auto"},  {"stream", "auto", "auto", "auto"},  {"stream", "16", "2", "auto"},
      {"wgmma", "auto", "auto", "auto"}, {"wgmma", "auto", "2", "auto"},      {"wgmma", "64", "auto", "auto"},
      {"stream", "8", "auto", "auto"},   {"stream", "auto", "auto", "align"}, {"stream", "16", "2", "align"}};
  float one[2 * E_I > H ? 2 * E_I : H];
  for (size_t ti = 0; ti < sizeof tokens / sizeof tokens[0]; ti++) {
    const int64_t T = tokens[ti], P = T * R_TOPK;
    int32_t *ids = malloc((size_t)P * sizeof *ids);
    float *weights = malloc((size_t)P * sizeof *weights), *x13 = malloc((size_t)(T * H) * sizeof(float));
    float *x2 = malloc((size_t)(P * E_I) * sizeof(float)),
          *y13 = malloc((size_t)(P * 2 * E_I) * sizeof(float));
    float *want13 = calloc((size_t)(P * 2 * E_I), sizeof(float)),
          *y2 = malloc((size_t)(T * H) * sizeof(float));
    float *want2 = calloc((size_t)(T * H), sizeof(float));
    uint64_t rng = 17 + (uint64_t)T;
    for (int64_t p = 0; p < P; p++) {
      const uint64_t r = tu_rand(&rng) % 16;
      ids[p] = p == 3 ? -1 : r < 8 ? 0 : (int32_t)(1 + tu_rand(&rng) % 7);
      weights[p] = 0.25f + 0.5f * (float)(tu_rand(&rng) % 100) / 100.0f;
    }
    random_x(x13, (size_t)(T * H), 4 + (uint64_t)T);
    random_x(x2, (size_t)(P * E_I), 5 + (uint64_t)T);
    /* The reference: pair by pair through the single-expert apply, combined in slot order. */
    for (int64_t p = 0; p < P; p++) {
      if (ids[p] < 0)
        continue;
      ck_assert_int_eq(qkeep_layer_apply_expert_f32(moe, ids[p], QKEEP_MOE_W13, 1, x13 + (p / R_TOPK) * H,
                                                    want13 + p * 2 * E_I),
                       0);
      ck_assert_int_eq(qkeep_layer_apply_expert_f32(moe, ids[p], QKEEP_MOE_W2, 1, x2 + p * E_I, one), 0);
      for (int j = 0; j < H; j++)
        want2[(p / R_TOPK) * H + j] += weights[p] * one[j];
    }
    void *d_ids = to_device(ids, (size_t)P * sizeof *ids),
         *d_w = to_device(weights, (size_t)P * sizeof *weights);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
      configure("kernel", cases[c].kernel);
      configure("tile_m", cases[c].tile_m);
      configure("split_k", cases[c].split_k);
      configure("route", cases[c].route);
      memset(y13, 0, (size_t)(P * 2 * E_I) * sizeof(float));
      routed_apply(moe, QKEEP_MOE_W13, T, R_TOPK, d_ids, d_w, x13, (size_t)(T * H), y13,
                   (size_t)(P * 2 * E_I));
      for (int64_t p = 0; p < P; p++) {
        if (ids[p] < 0)
          continue;
        double err = rel_error(y13 + p * 2 * E_I, want13 + p * 2 * E_I, 2 * E_I);
        ck_assert_msg(err <= 1e-4,
                      "%s %s tile_m %s split_k %s route %s, %lld tokens: w13 pair %lld (expert %d): %g",
                      scheme, cases[c].kernel, cases[c].tile_m, cases[c].split_k, cases[c].route,
                      (long long)T, (long long)p, ids[p], err);
      }
      routed_apply(moe, QKEEP_MOE_W2, T, R_TOPK, d_ids, d_w, x2, (size_t)(P * E_I), y2, (size_t)(T * H));
      for (int64_t t = 0; t < T; t++) {
        double err = rel_error(y2 + t * H, want2 + t * H, H);
        ck_assert_msg(err <= 1e-4, "%s %s tile_m %s split_k %s route %s, %lld tokens: w2 token %lld: %g",
                      scheme, cases[c].kernel, cases[c].tile_m, cases[c].split_k, cases[c].route,
                      (long long)T, (long long)t, err);
      }
    }
    /* A streaming block that finds its own token tile computes what it computes after the sorting kernel,
     * bit for bit (the same tiles; an MMA's token columns never mix). */
    float *a13 = calloc((size_t)(P * 2 * E_I), sizeof(float)), *a2 = calloc((size_t)(T * H), sizeof(float));
    configure("kernel", "stream");
    configure("tile_m", "auto");
    configure("split_k", "auto");
    configure("route", "align");
    routed_apply(moe, QKEEP_MOE_W13, T, R_TOPK, d_ids, d_w, x13, (size_t)(T * H), a13, (size_t)(P * 2 * E_I));
    routed_apply(moe, QKEEP_MOE_W2, T, R_TOPK, d_ids, d_w, x2, (size_t)(P * E_I), a2, (size_t)(T * H));
    configure("route", "self");
    memset(y13, 0, (size_t)(P * 2 * E_I) * sizeof(float));
    routed_apply(moe, QKEEP_MOE_W13, T, R_TOPK, d_ids, d_w, x13, (size_t)(T * H), y13, (size_t)(P * 2 * E_I));
    routed_apply(moe, QKEEP_MOE_W2, T, R_TOPK, d_ids, d_w, x2, (size_t)(P * E_I), y2, (size_t)(T * H));
    ck_assert_msg(memcmp(a13, y13, (size_t)(P * 2 * E_I) * sizeof(float)) == 0 &&
                      memcmp(a2, y2, (size_t)(T * H) * sizeof(float)) == 0,
                  "%s, %lld tokens: the self-routed streaming kernel differs from the sorted one", scheme,
                  (long long)T);
    free(a13), free(a2);
    configure("route", "auto");
    configure("kernel", "auto");
    configure("tile_m", "auto");
    configure("split_k", "auto");
    backend()->memory->free(backend(), d_ids);
    backend()->memory->free(backend(), d_w);
    free(ids), free(weights), free(x13), free(x2), free(y13), free(want13), free(y2), free(want2);
  }
  qkeep_model_free(m);
  free(source), free(path);
}
END_TEST

/* Rows `rows` (count) of x [*, k] through expert e's `matrix` as one plain batch of at least
 * NVFP4_FP8_MIN_M rows (the first row repeated to fill it: with FP8 activations each row is scaled on
 * its own), into out [count, n]. */
static void expert_rows(qkeep_layer *moe, int32_t e, enum qkeep_moe_matrix matrix, const float *x, int64_t k,
                        const int64_t *rows, int64_t count, int64_t n, float *out) {
  const int64_t batch = count < NVFP4_FP8_MIN_M ? NVFP4_FP8_MIN_M : count;
  float *xb = tu_xmalloc((size_t)(batch * k) * sizeof *xb),
        *yb = tu_xmalloc((size_t)(batch * n) * sizeof *yb);
  for (int64_t i = 0; i < batch; i++)
    memcpy(xb + i * k, x + rows[i < count ? i : 0] * k, (size_t)k * sizeof *xb);
  ck_assert_msg(qkeep_layer_apply_expert_f32(moe, e, matrix, batch, xb, yb) == 0, "%s", qkeep_errmsg());
  memcpy(out, yb, (size_t)(count * n) * sizeof *out);
  free(xb), free(yb);
}

/* Routed MoE with FP8 activations on the wgmma kernel: each pair's w13 row equals its expert's plain FP8
 * GEMM of that token, and each token's w2 row the router-weighted sum (in slot order) of its pairs'
 * plain FP8 GEMMs, within the order of the f32 sums (the same e4m3 operands either way). */
START_TEST(routed_fp8_equals_each_experts_fp8) {
  static const struct gtu_model moe_model = {H, KV, I, E_I, R_EXPERTS, VOCAB};
  char *source = gtu_write_source(dir, "moe.safetensors", 12, &moe_model),
       *path = quantize(source, "modelopt-nvfp4", "q");
  qkeep_model *m = gtu_load(gpu, path, NULL);
  qkeep_layer *moe = qkeep_model_find_layer(m, "model.layers.1.mlp.experts");
  ck_assert_ptr_nonnull(moe);
  configure("fp8_activations", "true");
  configure("kernel", "wgmma");
  enum { T = 96, P = T * R_TOPK };
  int32_t *ids = tu_xmalloc(P * sizeof *ids);
  float *weights = tu_xmalloc(P * sizeof *weights), *x13 = tu_xmalloc((size_t)T * H * sizeof(float));
  float *x2 = tu_xmalloc((size_t)P * E_I * sizeof(float)),
        *y13 = tu_xmalloc((size_t)P * 2 * E_I * sizeof(float));
  float *want13 = tu_xmalloc((size_t)P * 2 * E_I * sizeof(float)),
        *y2 = tu_xmalloc((size_t)T * H * sizeof(float));
  float *one2 = tu_xmalloc((size_t)P * H * sizeof(float)), *want2 = calloc((size_t)T * H, sizeof(float));
  uint64_t rng = 61;
  for (int64_t p = 0; p < P; p++) {
    ids[p] = p % 37 == 5 ? -1 : (int32_t)(tu_rand(&rng) % R_EXPERTS);
    weights[p] = 0.25f + 0.5f * (float)(tu_rand(&rng) % 100) / 100.0f;
  }
  random_x(x13, (size_t)T * H, 62);
  random_x(x2, (size_t)P * E_I, 63);
  /* The reference: per expert, its pairs' rows as one plain batch. */
  int64_t *rows13 = tu_xmalloc(P * sizeof *rows13), *rows2 = tu_xmalloc(P * sizeof *rows2),
          *pair = tu_xmalloc(P * sizeof *pair);
  float *out = tu_xmalloc((size_t)P * (2 * E_I > H ? 2 * E_I : H) * sizeof *out);
  for (int32_t e = 0; e < R_EXPERTS; e++) {
    int64_t count = 0;
    for (int64_t p = 0; p < P; p++)
      if (ids[p] == e)
        rows13[count] = p / R_TOPK, rows2[count] = p, pair[count++] = p;
    if (!count)
      continue;
    expert_rows(moe, e, QKEEP_MOE_W13, x13, H, rows13, count, 2 * E_I, out);
    for (int64_t i = 0; i < count; i++)
      memcpy(want13 + pair[i] * 2 * E_I, out + i * 2 * E_I, 2 * E_I * sizeof(float));
    expert_rows(moe, e, QKEEP_MOE_W2, x2, E_I, rows2, count, H, out);
    for (int64_t i = 0; i < count; i++)
      memcpy(one2 + pair[i] * H, out + i * H, H * sizeof(float));
  }
  for (int64_t p = 0; p < P; p++)
    for (int j = 0; j < H && ids[p] >= 0; j++)
      want2[(p / R_TOPK) * H + j] += weights[p] * one2[p * H + j];
  void *d_ids = to_device(ids, P * sizeof *ids), *d_w = to_device(weights, P * sizeof *weights);
  routed_apply(moe, QKEEP_MOE_W13, T, R_TOPK, d_ids, d_w, x13, (size_t)T * H, y13, (size_t)P * 2 * E_I);
  for (int64_t p = 0; p < P; p++)
    if (ids[p] >= 0) {
      double err = rel_error(y13 + p * 2 * E_I, want13 + p * 2 * E_I, 2 * E_I);
      ck_assert_msg(err <= 1e-4, "w13 pair %lld (expert %d): %g", (long long)p, ids[p], err);
    }
  routed_apply(moe, QKEEP_MOE_W2, T, R_TOPK, d_ids, d_w, x2, (size_t)P * E_I, y2, (size_t)T * H);
  for (int64_t t = 0; t < T; t++) {
    double err = rel_error(y2 + t * H, want2 + t * H, H);
    ck_assert_msg(err <= 1e-4, "w2 token %lld: %g", (long long)t, err);
  }
  configure("fp8_activations", "false");
  configure("kernel", "auto");
  backend()->memory->free(backend(), d_ids);
  backend()->memory->free(backend(), d_w);
  free(ids), free(weights), free(x13), free(x2), free(y13), free(want13), free(y2), free(one2), free(want2);
  free(rows13), free(rows2), free(pair), free(out);
  qkeep_model_free(m);
  free(source), free(path);
}
END_TEST

/* ---- the batched memory slots (ABI 1.5, 1.6) ------------------------------------------------------ */

enum { ARENA = 4 << 20, RANGES = 40 };

/* Random ranges in an arena: offsets of every alignment, lengths 0 to 600 KB (several chunks). */
static void random_ranges(uint64_t *seed, size_t *at, size_t *bytes, size_t n, size_t limit) {
  size_t next = 0;
  for (size_t i = 0; i < n; i++) {
    size_t len = tu_rand(seed) % 4 == 0 ? tu_rand(seed) % 600000 : tu_rand(seed) % 3000;
    at[i] = next + tu_rand(seed) % 64;
    bytes[i] = at[i] + len <= limit ? len : 0;
    next = at[i] + bytes[i];
  }
}

/* Writes v's qkeep_be_value_size(rule) low bytes at p, little-endian. */
static void put_value(unsigned char *p, int rule, uint32_t v) {
  for (size_t b = 0; b < qkeep_be_value_size(rule); b++)
    p[b] = (unsigned char)(v >> (8 * b));
}

/* A random value the rule takes. */
static uint32_t valid_value(int rule, uint64_t *seed) {
  uint32_t v = (uint32_t)tu_rand(seed);
  switch (rule) {
  case QKEEP_RULE_E4M3_SCALE: return v % 8 ? v % 0x7f : 0x80;
  case QKEEP_RULE_E8M0_SCALE: return v % 0xff;
  case QKEEP_RULE_BF16_FINITE: return (v & 0xffff) ^ (((v & 0x7f80) == 0x7f80) << 7);
  case QKEEP_RULE_F16_FINITE: return (v & 0xffff) ^ (((v & 0x7c00) == 0x7c00) << 10);
  default: return v ^ (((v & 0x7f800000u) == 0x7f800000u) << 23);
  }
}

/* A random value the rule refuses: a NaN, an infinity, a negative scale. */
static uint32_t bad_value(int rule, uint64_t *seed) {
  uint32_t v = (uint32_t)tu_rand(seed);
  static const unsigned char e4m3[] = {0x7f, 0xff, 0x81, 0xc0};
  switch (rule) {
  case QKEEP_RULE_E4M3_SCALE: return e4m3[v % 4];
  case QKEEP_RULE_E8M0_SCALE: return 0xff;
  case QKEEP_RULE_BF16_FINITE: return (v & 0x807f) | 0x7f80;
  case QKEEP_RULE_F16_FINITE: return (v & 0x83ff) | 0x7c00;
  default: return (v & 0x807fffffu) | 0x7f800000u;
  }
}

START_TEST(batched_copies_and_value_checks_match_the_host) {
  const struct qkeep_memory_ops *ops = backend()->memory;
  ck_assert(ops->copy_d2d_batch && ops->find_bad_values);
  uint64_t seed = 99;
  unsigned char *host = malloc(ARENA), *got = malloc(ARENA), *want = malloc(ARENA);
  void *src, *dst;
  ck_assert_int_eq(ops->alloc(backend(), ARENA, &src), 0);
  ck_assert_int_eq(ops->alloc(backend(), ARENA, &dst), 0);
  size_t at[RANGES], bytes[RANGES], to[RANGES], unused[RANGES];
  for (int round = 0; round < 4; round++) {
    for (size_t i = 0; i < ARENA; i++)
      host[i] = (unsigned char)tu_rand(&seed), want[i] = (unsigned char)(i * 7);
    ck_assert_int_eq(ops->copy_h2d(backend(), src, host, ARENA), 0);
    ck_assert_int_eq(ops->copy_h2d(backend(), dst, want, ARENA), 0);
    random_ranges(&seed, at, bytes, RANGES, ARENA);
    random_ranges(&seed, to, unused, RANGES, ARENA); /* destinations: as far apart, other alignments */
    struct qkeep_copy_range r[RANGES];
    size_t n = 0;
    for (size_t i = 0; i < RANGES; i++)
      if (bytes[i] && to[i] + bytes[i] <= ARENA && (i + 1 == RANGES || to[i] + bytes[i] <= to[i + 1])) {
        r[n++] = (struct qkeep_copy_range){(char *)dst + to[i], (char *)src + at[i], bytes[i]};
        memcpy(want + to[i], host + at[i], bytes[i]);
      }
    ck_assert_int_eq(ops->copy_d2d_batch(backend(), r, n), 0);
    ck_assert_int_eq(ops->copy_d2h(backend(), got, dst, ARENA), 0);
    for (size_t i = 0; i < ARENA; i++)
      ck_assert_msg(got[i] == want[i], "round %d: byte %zu is %u after the batch, %u by memmove", round, i,
                    got[i], want[i]);
  }
  /* Valid values under each rule (e4m3 scales 0 to 0x7e and -0; e8m0 0 to 0xfe; bf16, f16 and f32 of
   * every exponent but the all-ones one), at every alignment (2- and 4-byte values at odd addresses
   * too), then one bad value in some ranges: the first, the last, or one inside. */
  for (int round = 0; round < 40; round++) {
    random_ranges(&seed, at, bytes, RANGES, ARENA);
    struct qkeep_value_range r[RANGES];
    for (size_t i = 0; i < RANGES; i++) {
      int rule = 1 + (int)(tu_rand(&seed) % 5);
      size_t size = qkeep_be_value_size(rule);
      bytes[i] -= bytes[i] % size;
      r[i] = (struct qkeep_value_range){(char *)src + at[i], bytes[i], rule};
      for (size_t j = 0; j < bytes[i]; j += size)
        put_value(host + at[i] + j, rule, valid_value(rule, &seed));
    }
    size_t expect = RANGES, bad_ranges = round % 4; /* round 0, 4, ...: none */
    for (size_t b = 0; b < bad_ranges; b++) {
      size_t i = tu_rand(&seed) % RANGES, size = qkeep_be_value_size(r[i].rule), values = bytes[i] / size;
      if (!values)
        continue;
      size_t where = b == 0 ? 0 : b == 1 ? values - 1 : tu_rand(&seed) % values;
      put_value(host + at[i] + where * size, r[i].rule, bad_value(r[i].rule, &seed));
      expect = i < expect ? i : expect;
    }
    ck_assert_int_eq(ops->copy_h2d(backend(), src, host, ARENA), 0);
    size_t first = 12345;
    ck_assert_int_eq(ops->find_bad_values(backend(), r, RANGES, &first), 0);
    ck_assert_msg(first == expect, "round %d: the device found range %zu, the host %zu", round, first,
                  expect);
  }
  size_t first;
  struct qkeep_value_range odd[] = {{src, 16, 9}, {src, 15, QKEEP_RULE_F32_FINITE}};
  for (int i = 0; i < 2; i++)
    ck_assert_int_eq(ops->find_bad_values(backend(), &odd[i], 1, &first), QKEEP_E_INVAL);
  ops->free(backend(), src);
  ops->free(backend(), dst);
  free(host), free(got), free(want);
}
END_TEST

START_TEST(probe_and_config) {
  char msg[256];
  ck_assert_int_eq(qkeep_plugin_probe(gpu, msg, sizeof msg), 0);
  ck_assert(strstr(msg, "compute capability") != NULL);
  ck_assert_int_eq(backend()->configure(backend(), "tile_m", "12"), QKEEP_E_CONFIG);
  ck_assert_int_eq(backend()->configure(backend(), "split_k", "9"), QKEEP_E_CONFIG);
  ck_assert_int_eq(backend()->configure(backend(), "threads", "2"), QKEEP_E_CONFIG);
  ck_assert(backend()->supports(backend(), "ct-nvfp4", QKEEP_LAYER_MOE));
  ck_assert(!backend()->supports(backend(), "gptq-int4", QKEEP_LAYER_LINEAR));
}
END_TEST

static Suite *gpu_suite(void) {
  Suite *s = suite_create("gpu_nvfp4");
  TCase *tc = tcase_create("cuda-nvfp4");
  tcase_set_timeout(tc, 600);
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, probe_and_config);
  tcase_add_loop_test(tc, agrees_with_reference, 0, 2);
  tcase_add_loop_test(tc, layouts_match_cpu_transforms, 0, 2);
  tcase_add_loop_test(tc, reload_equals_cold_start_in_place, 0, 2);
  tcase_add_test(tc, in_place_transforms_equal_the_copies);
  tcase_add_test(tc, half_precision_activations);
  tcase_add_test(tc, fp8_activations_match_their_emulation);
  tcase_add_loop_test(tc, chained_applies_read_the_outputs_before_them, 0, 2);
  suite_add_tcase(s, tc);
  /* The batched memory slots on their own (CK_RUN_CASE=memory runs them alone). */
  tc = tcase_create("memory");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, batched_copies_and_value_checks_match_the_host);
  suite_add_tcase(s, tc);
  /* Routed MoE on its own (CK_RUN_CASE=routed runs it alone). */
  tc = tcase_create("routed");
  tcase_set_timeout(tc, 600);
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_loop_test(tc, routed_moe, 0, 2);
  tcase_add_loop_test(tc, routed_moe_every_kernel, 0, 2);
  tcase_add_test(tc, routed_fp8_equals_each_experts_fp8);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return gtu_main("check_gpu_nvfp4", gpu_suite, &gpu, &ref); }
