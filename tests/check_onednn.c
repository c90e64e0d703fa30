/*
 * check_onednn.c: the cpu-onednn backend against the reference backend
 * loaded from the same checkpoint.
 *
 * Checkpoints come from qkeep_quantize (w8a8 per channel, activations dynamic
 * or static, symmetric or asymmetric) and by hand (per-tensor scales of fused
 * shards), over a small model with fused q/k/v and gate/up, an MoE block and
 * an lm_head, in two sets of dims: K and N not multiples of 64, and all
 * multiples of 64. For each: the census is clean (missing, C1, C2, released
 * all 0), every checkpoint name resolves, and the kernels agree
 *   - with an oracle written here from the documented recipe (activation
 *     codes, zero points, s32 products) to 1e-5, and within the int8
 *     quantisation bound |y - x W^T| <= a/2 * sum_k |w| of the reference;
 *   - with the reference through qkeep_compare at M = 1, 7 and 64.
 * Plus unquantized f32/bf16/f16, a tied lm_head (never repacked), reload
 * W0 -> W1 equal to a cold start with no data pointer moving, the config
 * keys, the shipped example, and (in a child process, so oneDNN starts
 * fresh) a simulated CPU without VNNI: 7-bit activations, or a refusal.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "private.h"
#include "checkutil.h"
#include "testutil.h"

struct dims {
  int64_t h, kv, inter, e_inter, experts, vocab;
};
/* K and N off every multiple of 64 (packed layouts pad them; 70 is off 4 and 32 too, for the few-row
 * kernel's tails), and all multiples of 64 (they fit in place). */
static const struct dims odd = {70, 40, 200, 56, 3, 100};
static const struct dims even = {64, 64, 128, 64, 2, 128};

static char *dir;
static qkeep_plugin *onednn, *ref;
static qkeep_plugin *ref_int8; /* the reference with activations = int8 (int8-7bit without VNNI) */
static int act_levels;         /* 255 with VNNI, 127 without (the probe says which) */

static void open_plugins(void) {
  ck_assert_msg(qkeep_plugin_open("cpu-onednn", NULL, &onednn) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &ref) == 0, "%s", qkeep_errmsg());
  char msg[256];
  ck_assert_int_eq(qkeep_plugin_probe(onednn, msg, sizeof msg), 0);
  act_levels = strstr(msg, "7-bit") ? 127 : 255;
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &ref_int8) == 0, "%s", qkeep_errmsg());
  const struct qkeep_backend *be = qkeep_plugin_backend(ref_int8);
  ck_assert_int_eq(be->configure(be, "activations", act_levels == 255 ? "int8" : "int8-7bit"), 0);
}

static void setup(void) {
  dir = tu_tmpdir("onednn");
  ck_assert_ptr_nonnull(dir);
  open_plugins();
}

static void teardown(void) {
  qkeep_plugin_close(onednn);
  qkeep_plugin_close(ref);
  qkeep_plugin_close(ref_int8);
  tu_rmtree(dir);
  free(dir);
}

/* ---- checkpoints ------------------------------------------------------------------------- */

/* Uniform in [-1, 1): 24 random bits (tu_randf spans [-1, 3): it scales 24 bits by 2^-23). */
static float uniform(uint64_t *state) { return (float)((double)(tu_rand(state) >> 40) / 8388608.0 - 1.0); }

static float source_value(uint64_t seed, const char *name, size_t i) {
  uint64_t s = 1469598103934665603ULL ^ seed;
  for (const char *p = name; *p; p++)
    s = (s ^ (unsigned char)*p) * 1099511628211ULL;
  s += i * 0x9e3779b97f4a7c15ULL;
  return uniform(&s) * 0.25f;
}

/* A tensor [rows, cols] of source values in dtype; cols 0: [rows] of ones (a norm), cols -1: [rows] of
 * values. */
static void add_tensor(struct st_writer *w, const char *name, enum qkeep_dtype dt, int64_t rows, int64_t cols,
                       uint64_t seed) {
  size_t n = (size_t)(rows * (cols > 0 ? cols : 1));
  unsigned char *buf = malloc(n * 4);
  for (size_t i = 0; i < n; i++) {
    float v = cols ? source_value(seed, name, i) : 1.0f;
    if (dt == QKEEP_DTYPE_F32)
      memcpy(buf + 4 * i, &v, 4);
    else
      ((uint16_t *)buf)[i] = dt == QKEEP_DTYPE_BF16 ? qk_f32_to_bf16(v) : qk_f32_to_f16(v);
  }
  struct qkeep_spec s = {dt, cols > 0 ? 2 : 1, {rows, cols > 0 ? cols : 0}};
  ck_assert_int_eq(st_writer_add(w, name, &s, buf), 0);
  free(buf);
}

/* An unquantized model directory: a dense layer with q/k/v biases, an MoE layer, embedding, lm_head. */
static char *write_source(const char *sub, const struct dims *d, enum qkeep_dtype dt, uint64_t seed,
                          bool tied) {
  char *path = tu_path(dir, sub), name[160];
  ck_assert_int_eq(mkdir(path, 0755), 0);
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  add_tensor(w, "model.embed_tokens.weight", dt, d->vocab, d->h, seed);
  if (!tied)
    add_tensor(w, "lm_head.weight", dt, d->vocab, d->h, seed);
  add_tensor(w, "model.norm.weight", dt, d->h, 0, seed);
  static const char *const proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  for (int l = 0; l < 2; l++) {
    int64_t rows[] = {d->h, d->kv, d->kv, d->h};
    for (int p = 0; p < 4; p++) {
      snprintf(name, sizeof name, "model.layers.%d.self_attn.%s.weight", l, proj[p]);
      add_tensor(w, name, dt, rows[p], d->h, seed);
      if (l == 0 && p < 3) {
        snprintf(name, sizeof name, "model.layers.%d.self_attn.%s.bias", l, proj[p]);
        add_tensor(w, name, dt, rows[p], -1, seed);
      }
    }
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
    add_tensor(w, name, dt, d->h, 0, seed);
    if (l == 0) {
      add_tensor(w, "model.layers.0.mlp.gate_proj.weight", dt, d->inter, d->h, seed);
      add_tensor(w, "model.layers.0.mlp.up_proj.weight", dt, d->inter, d->h, seed);
      add_tensor(w, "model.layers.0.mlp.down_proj.weight", dt, d->h, d->inter, seed);
      continue;
    }
    add_tensor(w, "model.layers.1.mlp.gate.weight", dt, d->experts, d->h, seed);
    for (int64_t e = 0; e < d->experts; e++) {
      snprintf(name, sizeof name, "model.layers.1.mlp.experts.%lld.gate_proj.weight", (long long)e);
      add_tensor(w, name, dt, d->e_inter, d->h, seed);
      snprintf(name, sizeof name, "model.layers.1.mlp.experts.%lld.up_proj.weight", (long long)e);
      add_tensor(w, name, dt, d->e_inter, d->h, seed);
      snprintf(name, sizeof name, "model.layers.1.mlp.experts.%lld.down_proj.weight", (long long)e);
      add_tensor(w, name, dt, d->h, d->e_inter, seed);
    }
  }
  char *file = tu_path(path, "model.safetensors"), *config = tu_path(path, "config.json");
  ck_assert_int_eq(st_writer_write(w, file), 0);
  st_writer_free(w);
  const char *json = tied ? "{\"tie_word_embeddings\": true}" : "{\"tie_word_embeddings\": false}";
  ck_assert_int_eq(tu_write_file(config, json, strlen(json)), 0);
  free(file);
  free(config);
  return path;
}

/* The activation variants of w8a8-int8 that qkeep_quantize writes. */
struct variant {
  const char *name;
  bool static_input, asym_input;
};
static const struct variant variants[] = {
    {"dynamic-sym", false, false},
    {"dynamic-asym", false, true},
    {"static-sym", true, false},
    {"static-asym", true, true},
};

static char *quantize(const char *source, const char *out, const struct variant *v) {
  char *path = tu_path(dir, out);
  struct qkeep_quantize_options o = {.size = sizeof o,
                                     .scheme = "w8a8-int8",
                                     .static_input = v->static_input,
                                     .asym_input = v->asym_input,
                                     .kv_cache_scales = true,
                                     .activation_amax = 2};
  ck_assert_msg(qkeep_quantize(source, path, &o) == 0, "%s: %s", v->name, qkeep_errmsg());
  return path;
}

static qkeep_model *load(qkeep_plugin *plugin, const char *path) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

/* Every tensor of the checkpoint resolves to a param of the model, registered under its own name. */
static void assert_names_resolve(qkeep_model *m, const char *path) {
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(path, &ck), 0);
  for (size_t i = 0; i < ck->n_tensors; i++) {
    qkeep_layer *layer = NULL;
    qkeep_param *p = qkeep_model_lookup(m, ck->tensors[i].t->name, &layer);
    ck_assert_msg(p != NULL, "%s does not resolve", ck->tensors[i].t->name);
    ck_assert_ptr_eq(qkeep_param_lookup(layer, qkeep_param_checkpoint_name(p)), p);
  }
  ckpt_close(ck);
}

/* ---- comparisons ----------------------------------------------------------------------------- */

struct tolerance {
  double max_rel;
  double worst;
};

static int within(void *user, const struct qkeep_layer_error *e) {
  struct tolerance *t = user;
  ck_assert_msg(e->max_rel <= t->max_rel, "%s (expert %d, matrix %d, M %lld): max_rel %g > %g", e->layer,
                e->expert, (int)e->matrix, (long long)e->m, e->max_rel, t->max_rel);
  if (e->max_rel > t->worst)
    t->worst = e->max_rel;
  return 0;
}

static const int64_t ms[] = {1, 7, 64};

/* Every linear layer and expert matrix against the reference at M = 1, 7, 64. */
static double compare_all(qkeep_model *m, qkeep_model *r, double max_rel) {
  struct tolerance t = {max_rel, 0};
  for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++)
    ck_assert_msg(qkeep_compare(m, r, ms[i], 11 + i, within, &t) == 0, "%s", qkeep_errmsg());
  return t.worst;
}

/* The view of a param or buffer. */
static struct qkeep_view view_of(qkeep_layer *layer, const char *name) {
  struct qkeep_view v = {.size = sizeof v};
  ck_assert_msg(qkeep_view_of(layer, name, &v) == 0, "%s", qkeep_errmsg());
  return v;
}

static bool has_name(qkeep_layer *layer, const char *name) {
  struct qkeep_view v = {.size = sizeof v};
  return qkeep_view_of(layer, name, &v) == 0;
}

/* One matrix of a layer as the checkpoint holds it (read from the reference model's params). */
struct int8_matrix {
  int64_t n, k;
  const int8_t *q;  /* [n, k] */
  float *scale;     /* [n], expanded */
  const void *bias; /* [n] or NULL */
  enum qkeep_dtype bias_dtype;
  bool dynamic, asym;
  float in_scale;  /* static */
  int32_t in_zero; /* static asymmetric */
};

static float load_f(const void *p, enum qkeep_dtype dt, size_t i) {
  if (dt == QKEEP_DTYPE_F32)
    return ((const float *)p)[i];
  uint16_t h;
  memcpy(&h, (const char *)p + 2 * i, 2);
  return dt == QKEEP_DTYPE_BF16 ? qk_bf16_to_f32(h) : qk_f16_to_f32(h);
}

static struct int8_matrix int8_matrix_of(qkeep_layer *layer, const char *prefix, int expert, bool w2) {
  struct qkeep_layer_info info = {.size = sizeof info};
  ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
  int64_t experts = info.experts ? info.experts : 1;
  struct int8_matrix mx = {.n = w2 ? info.k : info.n, .k = w2 ? info.n / 2 : info.k};
  char name[64];
  snprintf(name, sizeof name, "%sweight", prefix);
  struct qkeep_view w = view_of(layer, name);
  ck_assert_int_eq(w.spec.dtype, QKEEP_DTYPE_I8);
  mx.q = (const int8_t *)w.data + (size_t)expert * (size_t)(mx.n * mx.k);
  snprintf(name, sizeof name, "%sweight_scale", prefix);
  struct qkeep_view s = view_of(layer, name);
  int64_t count = qkeep_spec_numel(&s.spec) / experts;
  int shards = w2 ? 1 : info.shards;
  mx.scale = malloc((size_t)mx.n * sizeof *mx.scale);
  int shard = 0;
  int64_t end = w2 ? mx.n : info.shard_n[0];
  for (int64_t r = 0; r < mx.n; r++) {
    while (r >= end && shard + 1 < shards)
      end += info.shard_n[++shard];
    int64_t idx = count == mx.n ? r : count > 1 ? shard : 0;
    mx.scale[r] = load_f(s.data, s.spec.dtype, (size_t)(expert * count + idx));
  }
  snprintf(name, sizeof name, "%sbias", prefix);
  if (has_name(layer, name)) {
    struct qkeep_view b = view_of(layer, name);
    mx.bias_dtype = b.spec.dtype;
    mx.bias = (const char *)b.data + (size_t)(expert * mx.n) * qkeep_dtype_size(b.spec.dtype);
  }
  mx.dynamic = info.flags & QKEEP_LAYER_F_INPUT_DYNAMIC;
  mx.asym = info.flags & QKEEP_LAYER_F_INPUT_ASYM;
  if (!mx.dynamic) {
    snprintf(name, sizeof name, "%sinput_scale", prefix);
    struct qkeep_view in = view_of(layer, name);
    int64_t c = qkeep_spec_numel(&in.spec) / experts;
    mx.in_scale = 0;
    for (int64_t i = 0; i < c; i++)
      mx.in_scale = fmaxf(mx.in_scale, ((const float *)in.data)[expert * c + i]);
    snprintf(name, sizeof name, "%sinput_zero_point", prefix);
    if (mx.asym && has_name(layer, name)) {
      struct qkeep_view z = view_of(layer, name);
      int64_t at = expert * (qkeep_spec_numel(&z.spec) / experts);
      mx.in_zero =
          z.spec.dtype == QKEEP_DTYPE_I8 ? ((const int8_t *)z.data)[at] : ((const int32_t *)z.data)[at];
    }
  }
  return mx;
}

/*
 * The recipe of plugins/cpu/onednn/onednn.h written out again: codes u in 0..L with
 * x ~ a (u - zp), from a row's range (dynamic) or the checkpoint's scale and zero point.
 */
static void oracle_codes(const struct int8_matrix *mx, int levels, const float *x, uint8_t *u, float *a_out,
                         int32_t *zp_out) {
  float a, zp, l = (float)levels;
  if (!mx->dynamic) {
    float z = mx->asym ? (float)mx->in_zero + 128.0f : 128.0f;
    a = levels == 255 ? mx->in_scale : 2.0f * mx->in_scale;
    zp = levels == 255 ? z : nearbyintf(z * 0.5f);
  } else {
    float lo = 0, hi = 0;
    for (int64_t i = 0; i < mx->k; i++) {
      lo = fminf(lo, x[i]);
      hi = fmaxf(hi, x[i]);
    }
    if (!mx->asym) {
      float h = (l - 1.0f) * 0.5f;
      a = fmaxf(-lo, hi) / h;
      zp = h + 1.0f;
    } else {
      a = (hi - lo) / l;
      zp = a > 0 ? nearbyintf(-lo / a) : 0.0f;
    }
  }
  float inv = a > 0 ? 1.0f / a : 0.0f;
  for (int64_t i = 0; i < mx->k; i++)
    u[i] = (uint8_t)nearbyintf(fminf(fmaxf(x[i] * inv + zp, 0.0f), l));
  *a_out = a;
  *zp_out = (int32_t)zp;
}

/*
 * Runs one matrix of the cpu-onednn model on m rows and checks it against the oracle
 * (to 1e-5 of the largest output) and against x W^T of the dequantised weights within
 * the quantisation bound a/2 * sum_k |w| (+ 1e-5 for float rounding).
 */
static void check_int8_matrix(qkeep_layer *layer, qkeep_layer *ref_layer, const char *prefix, int expert,
                              bool w2, int64_t m, int levels) {
  struct int8_matrix mx = int8_matrix_of(ref_layer, prefix, expert, w2);
  float *x = malloc((size_t)(m * mx.k) * sizeof *x), *y = malloc((size_t)(m * mx.n) * sizeof *y);
  uint8_t *u = malloc((size_t)mx.k);
  uint64_t rng = 5 + (uint64_t)m;
  for (int64_t i = 0; i < m * mx.k; i++)
    x[i] = uniform(&rng) * (i % 5 == 0 ? 1.0f : 0.5f) + (i % 7 == 0 ? 0.25f : 0.0f);
  int rc = ref_layer->kind == QKEEP_LAYER_MOE
               ? qkeep_layer_apply_expert_f32(layer, expert, w2 ? QKEEP_MOE_W2 : QKEEP_MOE_W13, m, x, y)
               : qkeep_layer_apply_f32(layer, m, x, y);
  ck_assert_msg(rc == 0, "%s", qkeep_errmsg());
  double max_out = 1e-30, max_oracle = 0, max_bound_excess = -1;
  double *expect = malloc((size_t)mx.n * sizeof *expect);
  for (int64_t r = 0; r < m; r++) {
    float a;
    int32_t zp;
    const float *xr = x + r * mx.k;
    oracle_codes(&mx, levels, xr, u, &a, &zp);
    for (int64_t n = 0; n < mx.n; n++) {
      int64_t acc = 0;
      double exact = 0, abs_w = 0;
      for (int64_t k = 0; k < mx.k; k++) {
        int q = mx.q[n * mx.k + k];
        acc += (int64_t)(u[k] - zp) * q;
        exact += (double)xr[k] * q * mx.scale[n];
        abs_w += fabs((double)q * mx.scale[n]);
      }
      double bias = mx.bias ? load_f(mx.bias, mx.bias_dtype, (size_t)n) : 0.0;
      expect[n] = (double)a * mx.scale[n] * (double)acc + bias;
      exact += bias;
      double got = y[r * mx.n + n];
      max_out = fmax(max_out, fabs(expect[n]));
      max_oracle = fmax(max_oracle, fabs(got - expect[n]));
      /* Static scales clamp rows beyond their range; the test's x stays inside (|x| < 1.3 < amax 2). */
      max_bound_excess =
          fmax(max_bound_excess, fabs(got - exact) - (a * 0.5 * abs_w + 1e-5 * (fabs(exact) + 1)));
    }
  }
  ck_assert_msg(max_oracle <= 1e-5 * max_out, "%s%s expert %d M %lld: %g off the oracle (max |y| %g)",
                ref_layer->name, prefix, expert, (long long)m, max_oracle, max_out);
  ck_assert_msg(max_bound_excess <= 0, "%s%s expert %d M %lld: beyond the quantisation bound by %g",
                ref_layer->name, prefix, expert, (long long)m, max_bound_excess);
  free(expect);
  free(mx.scale);
  free(x);
  free(y);
  free(u);
}

/* The oracle on the unfused o_proj, the fused qkv (with bias), down_proj and both MoE matrices. */
static void check_int8_kernels(qkeep_model *m, qkeep_model *r, int levels) {
  static const char *const linear[] = {"model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.qkv_proj",
                                       "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.qkv_proj"};
  for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
    for (size_t l = 0; l < sizeof linear / sizeof linear[0]; l++) {
      qkeep_layer *a = qkeep_model_find_layer(m, linear[l]), *b = qkeep_model_find_layer(r, linear[l]);
      ck_assert_msg(a && b, "no layer %s", linear[l]);
      check_int8_matrix(a, b, "", 0, false, ms[i], levels);
    }
    qkeep_layer *a = qkeep_model_find_layer(m, "model.layers.1.mlp.experts");
    qkeep_layer *b = qkeep_model_find_layer(r, "model.layers.1.mlp.experts");
    ck_assert_ptr_nonnull(a);
    check_int8_matrix(a, b, "w13_", 1, false, ms[i], levels);
    check_int8_matrix(a, b, "w2_", (int)b->dims.experts - 1, true, ms[i], levels);
  }
}

/* ---- w8a8-int8 ------------------------------------------------------------------------------ */

/* The tolerance against the reference: the quantisation error of uniform activations, doubled at 7 bits. */
static double int8_tolerance(const struct variant *v) {
  return (v->static_input ? 0.06 : 0.03) * (255.0 / act_levels);
}

static void int8_round_trip(const struct dims *d, const struct variant *v) {
  char *source = write_source("source", d, QKEEP_DTYPE_F32, 1, false);
  char *path = quantize(source, "q", v);
  qkeep_model *m = load(onednn, path), *r = load(ref, path);
  tu_assert_census_clean(m);
  assert_names_resolve(m, path);
  check_int8_kernels(m, r, act_levels);
  double worst = compare_all(m, r, int8_tolerance(v));
  ck_assert_double_gt(worst, 1e-3); /* activations are quantised: far from the f32 reference */
  /* The reference quantising activations as an int8 kernel does agrees to f32 rounding. */
  qkeep_model *r8 = load(ref_int8, path);
  compare_all(m, r8, 2e-5);
  qkeep_model_free(r8);

  /* Per-channel f32 scales are read as loaded; the zero-point correction is a buffer. */
  qkeep_layer *qkv = qkeep_model_find_layer(m, "model.layers.0.self_attn.qkv_proj");
  ck_assert_int_eq(qkeep_param_state(qkeep_param_lookup(qkv, "weight_scale")), QKEEP_PARAM_LIVE);
  ck_assert(!has_name(qkv, "weight_scale_channel"));
  struct qkeep_view adj = view_of(qkv, "azp_adj");
  ck_assert_int_eq(adj.spec.dtype, QKEEP_DTYPE_I32);
  ck_assert_int_eq(adj.spec.shape[0], d->h + 2 * d->kv);
  qkeep_layer *experts = qkeep_model_find_layer(m, "model.layers.1.mlp.experts");
  adj = view_of(experts, "w2_azp_adj");
  ck_assert_int_eq(adj.spec.ndim, 2);
  ck_assert_int_eq(adj.spec.shape[0], d->experts);
  ck_assert_int_eq(adj.spec.shape[1], d->h);

  /* The packed weights live in the weight's own storage: in place when they fit (no rebind, C1 kept). */
  struct qkeep_view w = view_of(qkv, "weight");
  size_t loaded = (size_t)((d->h + 2 * d->kv) * d->h);
  ck_assert_uint_ge(w.capacity, loaded);
  if (w.nbytes <= loaded)
    ck_assert_uint_eq(w.capacity, loaded);
  if (d->h % 64 == 0 && d->kv % 64 == 0)
    ck_assert_msg(w.nbytes == loaded && w.capacity == loaded, "dims of 64: %zu packed bytes in %zu", w.nbytes,
                  w.capacity);
  qkeep_model_free(m);
  qkeep_model_free(r);
  free(path);
  free(source);
}

START_TEST(int8_odd_dims) { int8_round_trip(&odd, &variants[_i]); }
END_TEST

START_TEST(int8_dims_of_64) { int8_round_trip(&even, &variants[_i]); }
END_TEST

/* A checkpoint by hand: per-tensor scales, one per q/k/v shard (different), one for o_proj ([1]). */
static char *write_per_tensor(const char *sub, const struct dims *d, uint64_t seed, bool asym) {
  char *path = tu_path(dir, sub), name[128];
  ck_assert_int_eq(mkdir(path, 0755), 0);
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  static const char *const proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  int64_t rows[] = {d->h, d->kv, d->kv, d->h};
  int8_t *q = malloc((size_t)(d->h * d->h));
  for (int p = 0; p < 4; p++) {
    uint64_t s = seed * 131 + (uint64_t)p;
    for (int64_t i = 0; i < rows[p] * d->h; i++)
      q[i] = (int8_t)((int)(tu_rand(&s) % 255) - 127);
    q[0] = 127, q[1] = -127; /* full range in every shard */
    struct qkeep_spec ws = {QKEEP_DTYPE_I8, 2, {rows[p], d->h}}, scalar = {QKEEP_DTYPE_F32, 0, {0}},
                      one = {QKEEP_DTYPE_F32, 1, {1}};
    snprintf(name, sizeof name, "model.layers.0.self_attn.%s.weight", proj[p]);
    ck_assert_int_eq(st_writer_add(w, name, &ws, q), 0);
    float scale = 0.002f * (float)(p + 1) * (float)(seed + 1);
    snprintf(name, sizeof name, "model.layers.0.self_attn.%s.weight_scale", proj[p]);
    ck_assert_int_eq(st_writer_add(w, name, p == 3 ? &one : &scalar, &scale), 0);
  }
  free(q);
  char *file = tu_path(path, "model.safetensors"), *config = tu_path(path, "config.json");
  ck_assert_int_eq(st_writer_write(w, file), 0);
  st_writer_free(w);
  char json[1024];
  snprintf(
      json, sizeof json,
      "{\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": \"int-quantized\", "
      "\"config_groups\": {\"group_0\": {\"targets\": [\"Linear\"], \"weights\": {\"num_bits\": 8, \"type\": "
      "\"int\", \"symmetric\": true, \"dynamic\": false, \"strategy\": \"tensor\"}, \"input_activations\": "
      "{\"num_bits\": 8, \"type\": \"int\", \"symmetric\": %s, \"dynamic\": true, \"strategy\": "
      "\"token\"}}}}}",
      asym ? "false" : "true");
  ck_assert_int_eq(tu_write_file(config, json, strlen(json)), 0);
  free(file);
  free(config);
  return path;
}

START_TEST(int8_per_tensor_fused_scales) {
  char *path = write_per_tensor("pt", &odd, 3, _i == 1);
  qkeep_model *m = load(onednn, path), *r = load(ref, path);
  tu_assert_census_clean(m);
  assert_names_resolve(m, path);
  qkeep_layer *qkv = qkeep_model_find_layer(m, "model.layers.0.self_attn.qkv_proj");
  ck_assert_ptr_nonnull(qkv);
  ck_assert(qkv->dims.flags & QKEEP_LAYER_F_WEIGHT_PER_TENSOR);
  /* Expanded per channel into a buffer; the checkpoint's three scales stay, retired, in their slots. */
  struct qkeep_view ch = view_of(qkv, "weight_scale_channel"), ws = view_of(qkv, "weight_scale");
  ck_assert_int_eq(ws.state, QKEEP_PARAM_RETIRED);
  ck_assert_int_eq(ws.spec.ndim, 1);
  ck_assert_int_eq(ws.spec.shape[0], 3);
  const float *slots = ws.data, *expanded = ch.data;
  for (int s = 0; s < 3; s++)
    ck_assert_float_eq(slots[s], 0.002f * (float)(s + 1) * 4.0f);
  ck_assert_float_eq(expanded[0], slots[0]);
  ck_assert_float_eq(expanded[odd.h], slots[1]);
  ck_assert_float_eq(expanded[odd.h + odd.kv + 1], slots[2]);
  qkeep_layer *o = qkeep_model_find_layer(m, "model.layers.0.self_attn.o_proj");
  ck_assert_int_eq(view_of(o, "weight_scale").state, QKEEP_PARAM_RETIRED);
  for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
    check_int8_matrix(qkv, qkeep_model_find_layer(r, qkv->name), "", 0, false, ms[i], act_levels);
    check_int8_matrix(o, qkeep_model_find_layer(r, o->name), "", 0, false, ms[i], act_levels);
  }
  compare_all(m, r, 0.03 * 255.0 / act_levels);
  qkeep_model_free(m);
  qkeep_model_free(r);
  free(path);
}
END_TEST

/* ---- unquantized ------------------------------------------------------------------------------ */

static const enum qkeep_dtype float_dtypes[] = {QKEEP_DTYPE_F32, QKEEP_DTYPE_BF16, QKEEP_DTYPE_F16};

START_TEST(unquantized_float_weights) {
  enum qkeep_dtype dt = float_dtypes[_i];
  char *path = write_source("float", &odd, dt, 4, false);
  qkeep_model *m = load(onednn, path), *r = load(ref, path);
  tu_assert_census_clean(m);
  assert_names_resolve(m, path);
  /* f32 and converted weights compute in f32; native bf16 rounds activations to bf16. */
  double worst = compare_all(m, r, dt == QKEEP_DTYPE_F32 ? 1e-5 : 2e-2);
  if (dt == QKEEP_DTYPE_F32)
    ck_assert_double_le(worst, 1e-5);
  qkeep_layer *head = qkeep_model_find_layer(m, "lm_head");
  ck_assert_ptr_nonnull(head);
  struct qkeep_view w = view_of(head, "weight");
  ck_assert_uint_ge(w.capacity, (size_t)(odd.vocab * odd.h) * qkeep_dtype_size(dt));
  qkeep_model_free(m);
  qkeep_model_free(r);
  free(path);
}
END_TEST

/* The tied lm_head is the embedding's param: it runs unpacked (or from a packed buffer), never repacked. */
START_TEST(tied_lm_head_keeps_the_embedding) {
  enum qkeep_dtype dt = float_dtypes[_i];
  char *source = write_source("tied", &odd, dt, 5, true);
  struct variant dyn = variants[0];
  char *quantized = quantize(source, "tied-q", &dyn);
  const char *paths[] = {source, quantized};
  for (int p = 0; p < 2; p++) {
    qkeep_model *m = load(onednn, paths[p]), *r = load(ref, paths[p]);
    qkeep_layer *head = qkeep_model_find_layer(m, "lm_head"),
                *embed = qkeep_model_find_layer(m, "model.embed_tokens");
    ck_assert_ptr_nonnull(head);
    ck_assert(head->dims.flags & QKEEP_LAYER_F_TIED);
    ck_assert_ptr_eq(qkeep_param_lookup(head, "weight"), qkeep_param_lookup(embed, "weight"));
    struct qkeep_view w = view_of(embed, "weight");
    ck_assert_int_eq(w.spec.dtype, dt);
    ck_assert_int_eq(w.spec.ndim, 2);
    ck_assert_uint_eq(w.capacity, w.nbytes);
    /* The embedding's rows are the checkpoint's values. */
    for (int64_t i = 0; i < odd.vocab * odd.h; i += 97) {
      float want = source_value(5, "model.embed_tokens.weight", (size_t)i);
      float have = load_f(w.data, dt, (size_t)i);
      if (dt == QKEEP_DTYPE_F32)
        ck_assert_float_eq(have, want);
      else
        ck_assert_float_eq_tol(have, want, 4e-3);
    }
    struct qkeep_census c = tu_assert_census_clean(m);
    ck_assert_int_ge(c.aliases, 1);
    /* A buffer only where oneDNN cannot read the dtype as is. */
    if (dt == QKEEP_DTYPE_F32)
      ck_assert(!has_name(head, "weight_packed"));
    struct tolerance t = {dt == QKEEP_DTYPE_F32 ? 1e-5 : 3e-2, 0};
    for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
      qkeep_layer *rh = qkeep_model_find_layer(r, "lm_head");
      int64_t rows = ms[i];
      float *x = malloc((size_t)(rows * odd.h) * sizeof *x),
            *y = malloc((size_t)(rows * odd.vocab) * sizeof *y),
            *yr = malloc((size_t)(rows * odd.vocab) * sizeof *yr);
      uint64_t rng = 77;
      for (int64_t j = 0; j < rows * odd.h; j++)
        x[j] = uniform(&rng);
      ck_assert_int_eq(qkeep_layer_apply_f32(head, rows, x, y), 0);
      ck_assert_int_eq(qkeep_layer_apply_f32(rh, rows, x, yr), 0);
      double err = 0, big = 0;
      for (int64_t j = 0; j < rows * odd.vocab; j++) {
        err = fmax(err, fabs(y[j] - yr[j]));
        big = fmax(big, fabs(yr[j]));
      }
      ck_assert_msg(err <= t.max_rel * big, "tied lm_head M %lld: %g of %g", (long long)rows, err, big);
      free(x), free(y), free(yr);
    }
    qkeep_model_free(m);
    qkeep_model_free(r);
  }
  free(quantized);
  free(source);
}
END_TEST

/* ---- reload -------------------------------------------------------------------------------- */

struct pointers {
  const char *names[256];
  const void *data[256];
  size_t n;
};

static int record_name(void *user, const char *name, bool is_buffer, const struct qkeep_view *v) {
  (void)is_buffer;
  struct pointers *p = user;
  ck_assert_uint_lt(p->n, 256);
  p->names[p->n] = name;
  p->data[p->n++] = v->data;
  return 0;
}

/* Every registered name's data pointer, layer by layer. */
static void record_pointers(qkeep_model *m, struct pointers *p) {
  p->n = 0;
  for (size_t l = 0; l < qkeep_model_layer_count(m); l++)
    ck_assert_int_eq(qkeep_foreach_name(qkeep_model_layer(m, l), record_name, p), 0);
}

/* Bitwise-equal outputs of every matrix: reload and cold start run the same bytes. */
static int same_output(void *user, const struct qkeep_layer_error *e) {
  (void)user;
  ck_assert_msg(e->max_abs == 0, "%s (expert %d): reload and cold start differ by %g", e->layer, e->expert,
                e->max_abs);
  return 0;
}

static void reload_equals_cold_start(const char *w0, const char *w1) {
  qkeep_model *m = load(onednn, w0), *cold = load(onednn, w1);
  struct pointers before, after;
  record_pointers(m, &before);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  record_pointers(m, &after);
  ck_assert_uint_eq(before.n, after.n);
  for (size_t i = 0; i < before.n; i++)
    ck_assert_msg(before.data[i] == after.data[i], "%s moved on reload", before.names[i]);
  struct qkeep_digest dr, dc;
  ck_assert_int_eq(qkeep_digest(m, &dr), 0);
  ck_assert_int_eq(qkeep_digest(cold, &dc), 0);
  ck_assert_msg(dr.hi == dc.hi && dr.lo == dc.lo, "reload W0 -> W1 differs from a cold start on W1");
  tu_assert_census_clean(m);
  for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++)
    ck_assert_int_eq(qkeep_compare(m, cold, ms[i], 3, same_output, NULL), 0);
  /* And back: W1 -> W0 equals a cold start on W0, pointers still in place. */
  qkeep_model *cold0 = load(onednn, w0);
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  record_pointers(m, &after);
  for (size_t i = 0; i < before.n; i++)
    ck_assert_msg(before.data[i] == after.data[i], "%s moved on the second reload", before.names[i]);
  ck_assert_int_eq(qkeep_digest(m, &dr), 0);
  ck_assert_int_eq(qkeep_digest(cold0, &dc), 0);
  ck_assert(dr.hi == dc.hi && dr.lo == dc.lo);
  qkeep_model_free(cold0);
  qkeep_model_free(cold);
  qkeep_model_free(m);
}

START_TEST(reload_w8a8_in_place) {
  const struct variant *v = &variants[_i];
  char *s0 = write_source("s0", &odd, QKEEP_DTYPE_F32, 10, false),
       *s1 = write_source("s1", &odd, QKEEP_DTYPE_F32, 20, false);
  char *w0 = quantize(s0, "w0", v), *w1 = quantize(s1, "w1", v);
  reload_equals_cold_start(w0, w1);
  free(w0), free(w1), free(s0), free(s1);
}
END_TEST

START_TEST(reload_per_tensor_and_float_in_place) {
  char *p0 = write_per_tensor("p0", &odd, 1, true), *p1 = write_per_tensor("p1", &odd, 2, true);
  reload_equals_cold_start(p0, p1);
  char *f0 = write_source("f0", &odd, QKEEP_DTYPE_BF16, 30, true),
       *f1 = write_source("f1", &odd, QKEEP_DTYPE_BF16, 40, true);
  reload_equals_cold_start(f0, f1);
  free(p0), free(p1), free(f0), free(f1);
}
END_TEST

/* ---- configuration, the shipped example ---------------------------------------------------------- */

START_TEST(config_keys) {
  const struct qkeep_backend *be = qkeep_plugin_backend(onednn);
  tu_assert_int_key(be, "threads", 1, 4096);
  ck_assert_int_eq(be->configure(be, "int8_without_vnni", "7bit"), 0);
  ck_assert_int_eq(be->configure(be, "int8_without_vnni", "maybe"), QKEEP_E_CONFIG);
  ck_assert_int_eq(be->configure(be, "thread", "2"), QKEEP_E_CONFIG);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "unknown key 'thread'"));
  /* Through a config file: the backend's section reaches configure, with file:line on errors. */
  char *ini = tu_path(dir, "q.ini");
  const char *text = "[qkeep]\nbackend = cpu-onednn\n[backend.cpu-onednn]\nthreads = 2\nbogus = 1\n";
  ck_assert_int_eq(tu_write_file(ini, text, strlen(text)), 0);
  qkeep_config *cfg;
  ck_assert_int_eq(qkeep_config_load(ini, &cfg), 0);
  ck_assert_int_eq(qkeep_plugin_configure(onednn, cfg), QKEEP_E_CONFIG);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "bogus"));
  qkeep_config_free(cfg);
  free(ini);
  /* One thread computes what two compute. */
  char *source = write_source("threads", &odd, QKEEP_DTYPE_F32, 6, false);
  char *path = quantize(source, "threads-q", &variants[1]);
  qkeep_model *m = load(onednn, path), *r = load(ref, path);
  compare_all(m, r, int8_tolerance(&variants[1]));
  ck_assert_int_eq(be->configure(be, "threads", "2"), 0);
  compare_all(m, r, int8_tolerance(&variants[1]));
  qkeep_model_free(m);
  qkeep_model_free(r);
  free(path);
  free(source);
}
END_TEST

START_TEST(unknown_isa_limit_fails_to_open) {
  qkeep_plugin_close(onednn);
  onednn = NULL;
  setenv("QKEEP_ONEDNN_MAX_ISA", "avx9000", 1);
  qkeep_plugin *p = NULL;
  int rc = qkeep_plugin_open("cpu-onednn", NULL, &p);
  unsetenv("QKEEP_ONEDNN_MAX_ISA");
  ck_assert_int_eq(rc, QKEEP_E_CONFIG);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "QKEEP_ONEDNN_MAX_ISA=avx9000"));
  ck_assert_ptr_null(p);
  ck_assert_int_eq(qkeep_plugin_open("cpu-onednn", NULL, &onednn), 0);
}
END_TEST

START_TEST(shipped_example_loads) {
  char *path = tu_path(tu_builddir(), "examples/tiny-w8a8-int8");
  struct stat st;
  ck_assert_msg(stat(path, &st) == 0, "%s: not built", path);
  qkeep_model *m = load(onednn, path), *r = load(ref, path);
  tu_assert_census_clean(m);
  ck_assert_ptr_nonnull(qkeep_model_find_layer(m, "model.layers.2.mlp.experts"));
  /* bf16 lm_head, int8 experts; the example's activations scale is 4 (quantize --activation-amax 4). */
  compare_all(m, r, 0.03 * 255.0 / act_levels);
  qkeep_model_free(m);
  qkeep_model_free(r);
  free(path);
}
END_TEST

/* ---- a CPU without VNNI, simulated in a child process ------------------------------------------- */

/*
 * Runs in a fresh process with QKEEP_ONEDNN_MAX_ISA=avx2 (oneDNN's ISA can only be
 * lowered before it generates code): activations take 7 bits and match the oracle; with
 * int8_without_vnni = refuse the scheme is refused before a byte loads, unquantized runs.
 */
static const char *child_path, *child_float_path;

START_TEST(non_vnni_child) {
  const char *path = child_path, *float_path = child_float_path;
  dir = tu_tmpdir("onednn-child");
  open_plugins();
  char msg[256];
  qkeep_plugin_probe(onednn, msg, sizeof msg);
  ck_assert_msg(strstr(msg, "avx2") && strstr(msg, "7-bit"), "probe: %s", msg);
  ck_assert_int_eq(act_levels, 127);
  qkeep_model *m = load(onednn, path), *r = load(ref, path), *r7 = load(ref_int8, path);
  check_int8_kernels(m, r, 127);
  compare_all(m, r, 0.06);
  compare_all(m, r7, 2e-5); /* the reference with 7-bit activations (open_plugins chose int8-7bit) */
  qkeep_model_free(m);
  qkeep_model_free(r);
  qkeep_model_free(r7);
  const struct qkeep_backend *be = qkeep_plugin_backend(onednn);
  ck_assert_int_eq(be->configure(be, "int8_without_vnni", "refuse"), 0);
  qkeep_plugin_probe(onednn, msg, sizeof msg);
  ck_assert_ptr_nonnull(strstr(msg, "refused"));
  ck_assert_int_eq(qkeep_model_new(onednn, &m), 0);
  ck_assert_int_eq(qkeep_model_load(m, path), QKEEP_E_UNSUPPORTED);
  /* The refusal names the scheme and the backend's reason (the chain's error, not a log line). */
  ck_assert_msg(strstr(qkeep_errmsg(), "w8a8-int8") && strstr(qkeep_errmsg(), "cpu-onednn: ") &&
                    strstr(qkeep_errmsg(), "VNNI"),
                "%s", qkeep_errmsg());
  ck_assert_uint_eq(qkeep_model_layer_count(m), 0);
  qkeep_model_free(m);
  m = load(onednn, float_path); /* unquantized layers need no VNNI */
  r = load(ref, float_path);
  compare_all(m, r, 1e-5);
  qkeep_model_free(m);
  qkeep_model_free(r);
  teardown();
}
END_TEST

START_TEST(without_vnni_7bit_or_refused) {
  char *source = write_source("nv", &odd, QKEEP_DTYPE_F32, 8, false);
  char *path = quantize(source, "nv-q", &variants[_i]);
  char exe[4096];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  ck_assert_int_gt(n, 0);
  exe[n] = 0;
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    setenv("QKEEP_ONEDNN_MAX_ISA", "avx2", 1);
    execl(exe, exe, "--non-vnni-child", path, source, (char *)NULL);
    _exit(127);
  }
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the non-VNNI child failed (status %d)",
                status);
  free(path);
  free(source);
}
END_TEST

static Suite *onednn_suite(void) {
  Suite *s = suite_create("onednn");
  TCase *tc = tcase_create("onednn");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 300);
  int nv = (int)(sizeof variants / sizeof variants[0]);
  tcase_add_loop_test(tc, int8_odd_dims, 0, nv);
  tcase_add_loop_test(tc, int8_dims_of_64, 0, nv);
  tcase_add_loop_test(tc, int8_per_tensor_fused_scales, 0, 2);
  tcase_add_loop_test(tc, unquantized_float_weights, 0, 3);
  tcase_add_loop_test(tc, tied_lm_head_keeps_the_embedding, 0, 3);
  tcase_add_loop_test(tc, reload_w8a8_in_place, 0, nv);
  tcase_add_test(tc, reload_per_tensor_and_float_in_place);
  tcase_add_test(tc, config_keys);
  tcase_add_test(tc, unknown_isa_limit_fails_to_open);
  tcase_add_test(tc, shipped_example_loads);
  tcase_add_loop_test(tc, without_vnni_7bit_or_refused, 0, nv);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) {
  Suite *s;
  if (argc == 4 && strcmp(argv[1], "--non-vnni-child") == 0) {
    child_path = argv[2];
    child_float_path = argv[3];
    s = suite_create("onednn-non-vnni");
    TCase *tc = tcase_create("non-vnni");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, non_vnni_child);
    suite_add_tcase(s, tc);
  } else {
    s = onednn_suite();
  }
  SRunner *sr = srunner_create(s);
  /* The child reports its failures on stderr, not as a second summary line of this suite. */
  srunner_run_all(sr, child_path ? CK_SILENT : CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  if (child_path && failed) {
    TestResult **r = srunner_failures(sr);
    for (int i = 0; i < failed; i++)
      fprintf(stderr, "non-VNNI child: %s:%d: %s\n", tr_lfile(r[i]), tr_lno(r[i]), tr_msg(r[i]));
    free(r);
  }
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
