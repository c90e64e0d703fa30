/*
 * check_schemes.c: every scheme end to end. A small unquantized model (with
 * fused attention and MLP shards and an MoE block) is quantized into each
 * scheme by qkeep_quantize, loaded through the reference backend, and checked:
 * the census is clean; every checkpoint tensor resolves to a param that still
 * holds its bytes where the loader put them; the reference kernel agrees with
 * an independent dequantisation of the checkpoint files (core/quantize.c's
 * dequantisers, fed straight from the files); and the result stays within
 * each format's error of the original weights. Plus fused slots, shards in
 * any order, tied embeddings and kv-cache scales.
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "private.h"
#include "ckptutil.h"
#include "fixture.h"
#include "testutil.h"

#define H 64
#define KV 32
#define I 128
#define E_I 64
#define EXPERTS 2
#define VOCAB 96

/* Deterministic source values for tensor `name`, element i. */
static float source_value(const char *name, size_t i) {
  uint64_t s = 1469598103934665603ULL;
  for (const char *p = name; *p; p++)
    s = (s ^ (unsigned char)*p) * 1099511628211ULL;
  s += i * 0x9e3779b97f4a7c15ULL;
  return tu_randf(&s) * 0.25f;
}

static void add_f32(struct st_writer *w, const char *name, int64_t rows, int64_t cols) {
  size_t n = (size_t)(rows * (cols ? cols : 1));
  float *v = malloc(n * sizeof *v);
  for (size_t i = 0; i < n; i++)
    v[i] = cols ? source_value(name, i) : 1.0f;
  struct qkeep_spec s = {QKEEP_DTYPE_F32, cols ? 2 : 1, {rows, cols}};
  ck_assert_int_eq(st_writer_add(w, name, &s, v), 0);
  free(v);
}

/* An unquantized source: 2 decoder layers (the second with an MoE block), embedding, lm_head. */
static char *write_source(const char *file, bool tied) {
  struct st_writer *w;
  char name[160];
  ck_assert_int_eq(st_writer_new(&w), 0);
  add_f32(w, "model.embed_tokens.weight", VOCAB, H);
  if (!tied)
    add_f32(w, "lm_head.weight", VOCAB, H);
  add_f32(w, "model.norm.weight", H, 0);
  for (int l = 0; l < 2; l++) {
    static const char *const proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    static const int rows[] = {H, KV, KV, H};
    for (int p = 0; p < 4; p++) {
      snprintf(name, sizeof name, "model.layers.%d.self_attn.%s.weight", l, proj[p]);
      add_f32(w, name, rows[p], H);
    }
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
    add_f32(w, name, H, 0);
    if (l == 0) {
      add_f32(w, "model.layers.0.mlp.gate_proj.weight", I, H);
      add_f32(w, "model.layers.0.mlp.up_proj.weight", I, H);
      add_f32(w, "model.layers.0.mlp.down_proj.weight", H, I);
      continue;
    }
    add_f32(w, "model.layers.1.mlp.gate.weight", EXPERTS, H);
    for (int e = 0; e < EXPERTS; e++) {
      snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.gate_proj.weight", e);
      add_f32(w, name, E_I, H);
      snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.up_proj.weight", e);
      add_f32(w, name, E_I, H);
      snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.down_proj.weight", e);
      add_f32(w, name, H, E_I);
    }
  }
  char *path = tu_path(dir, file);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  return path;
}

static char *quantize(const char *source, const char *scheme, const char *out, int64_t shard_bytes) {
  char *path = tu_path(dir, out);
  struct qkeep_quantize_options o = {.size = sizeof o,
                                     .scheme = scheme,
                                     .group_size = 32,
                                     .kv_cache_scales = true,
                                     .activation_amax = 4,
                                     .max_shard_bytes = shard_bytes};
  ck_assert_msg(qkeep_quantize(source, path, &o) == 0, "%s: %s", scheme, qkeep_errmsg());
  return path;
}

/* Every source's bytes are still in its param where the loader put them, for every param whose
 * layout normalisation kept (a merge of per-shard scales rewrites its prefix by design). */
static void assert_bytes_kept(qkeep_model *m, const struct ckpt *ck) {
  for (size_t l = 0; l < qkeep_model_layer_count(m); l++) {
    qkeep_layer *layer = qkeep_model_layer(m, l);
    for (size_t i = 0; i < layer->n_sources; i++) {
      const struct source *s = &layer->sources[i];
      if (!spec_equal(&s->param->view.spec, &s->param->create_spec))
        continue;
      const struct ckpt_tensor *t = ckpt_find(ck, s->checkpoint_name);
      ck_assert_ptr_nonnull(t);
      unsigned char *want = malloc(t->t->nbytes + 1);
      ck_assert_int_eq(ckpt_read(ck, t, want), 0);
      const unsigned char *have = (const unsigned char *)s->param->view.storage->data + s->dst_offset;
      for (size_t r = 0; r < s->rows; r++)
        ck_assert_msg(memcmp(have + r * s->dst_stride, want + r * s->row_bytes, s->row_bytes) == 0,
                      "%s: bytes of %s changed after PWAL", layer->name, s->checkpoint_name);
      free(want);
    }
  }
}

/* Every tensor of the checkpoint resolves to a live-or-retired param of the model. */
static void assert_names_resolve(qkeep_model *m, const struct ckpt *ck) {
  for (size_t i = 0; i < ck->n_tensors; i++) {
    qkeep_layer *layer = NULL;
    qkeep_param *p = qkeep_model_lookup(m, ck->tensors[i].t->name, &layer);
    ck_assert_msg(p != NULL, "%s does not resolve", ck->tensors[i].t->name);
    ck_assert_ptr_eq(qkeep_param_lookup(layer, qkeep_param_checkpoint_name(p)), p);
  }
}

/* ---- an independent dequantisation of one (unfused) module, straight from the files ---- */

static void *read_tensor(const struct ckpt *ck, const char *module, const char *local) {
  char name[200];
  snprintf(name, sizeof name, "%s.%s", module, local);
  const struct ckpt_tensor *t = ckpt_find(ck, name);
  ck_assert_msg(t != NULL, "no %s", name);
  void *buf = malloc(t->t->nbytes + 1);
  ck_assert_int_eq(ckpt_read(ck, t, buf), 0);
  return buf;
}

static float read_scalar(const struct ckpt *ck, const char *module, const char *local) {
  float *v = read_tensor(ck, module, local), x = *v;
  free(v);
  return x;
}

/* W [n, k] of `module` as its scheme's checkpoint defines it. */
static float *oracle_weight(const struct ckpt *ck, const char *scheme, const char *module, int64_t n,
                            int64_t k) {
  float *w = malloc((size_t)(n * k) * sizeof *w);
  if (strcmp(scheme, "modelopt-nvfp4") == 0 || strcmp(scheme, "ct-nvfp4") == 0) {
    bool ct = scheme[0] == 'c';
    uint8_t *q = read_tensor(ck, module, ct ? "weight_packed" : "weight"),
            *s = read_tensor(ck, module, "weight_scale");
    float g = read_scalar(ck, module, ct ? "weight_global_scale" : "weight_scale_2");
    dequant_nvfp4(q, s, ct ? 1.0f / g : g, n, k, w);
    free(q);
    free(s);
  } else if (strcmp(scheme, "mxfp4") == 0) {
    uint8_t *q = read_tensor(ck, module, "weight_packed"), *s = read_tensor(ck, module, "weight_scale");
    dequant_mxfp4(q, s, n, k, w);
    free(q);
    free(s);
  } else if (strcmp(scheme, "w8a8-int8") == 0) {
    int8_t *q = read_tensor(ck, module, "weight");
    float *s = read_tensor(ck, module, "weight_scale");
    for (int64_t i = 0; i < n * k; i++)
      w[i] = (float)q[i] * s[i / k];
    free(q);
    free(s);
  } else if (strcmp(scheme, "gptq-int4") == 0) {
    int32_t *q = read_tensor(ck, module, "qweight"), *z = read_tensor(ck, module, "qzeros"),
            *g = read_tensor(ck, module, "g_idx");
    uint16_t *s = read_tensor(ck, module, "scales");
    dequant_gptq_int4(q, s, z, g, n, k, 32, false, w);
    free(q), free(z), free(g), free(s);
  } else if (strcmp(scheme, "awq-int4") == 0) {
    /* AWQ [K, N/8] words, column c in nibble {0,4,1,5,2,6,3,7}[c % 8]; symmetric: zero 8. */
    static const int nibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    int32_t *q = read_tensor(ck, module, "qweight");
    uint16_t *s = read_tensor(ck, module, "scales");
    for (int64_t c = 0; c < n; c++)
      for (int64_t kk = 0; kk < k; kk++) {
        int v = (int)(((uint32_t)q[kk * (n / 8) + c / 8] >> (4 * nibble[c % 8])) & 15);
        w[c * k + kk] = (float)(v - 8) * qk_f16_to_f32(s[(kk / 32) * n + c]);
      }
    free(q);
    free(s);
  } else if (strcmp(scheme, "ct-int4") == 0) {
    /* compressed-tensors [N, K/8] words along K, code - 8 signed; f32 scales [N, K/32] (an f32 source). */
    int32_t *q = read_tensor(ck, module, "weight_packed");
    float *s = read_tensor(ck, module, "weight_scale");
    int64_t *shape = read_tensor(ck, module, "weight_shape");
    ck_assert(shape[0] == n && shape[1] == k);
    for (int64_t r = 0; r < n; r++)
      for (int64_t kk = 0; kk < k; kk++) {
        int v = (int)(((uint32_t)q[r * (k / 8) + kk / 8] >> (4 * (kk % 8))) & 15) - 8;
        w[r * k + kk] = (float)v * s[r * (k / 32) + kk / 32];
      }
    free(q), free(s), free(shape);
  } else {
    ck_abort_msg("no oracle for %s", scheme);
  }
  return w;
}

/* Max |y - y'| / max |y'| of x W^T over m rows, against the layer's apply. */
static double apply_error(qkeep_layer *layer, const float *w, int64_t n, int64_t k, int expert, int matrix) {
  enum { M = 3 };
  float *x = malloc((size_t)(M * k) * sizeof *x), *y = malloc((size_t)(M * n) * sizeof *y);
  uint64_t rng = 7;
  for (int64_t i = 0; i < M * k; i++)
    x[i] = tu_randf(&rng);
  int rc = expert < 0 ? qkeep_layer_apply_f32(layer, M, x, y)
                      : qkeep_layer_apply_expert_f32(layer, expert, (enum qkeep_moe_matrix)matrix, M, x, y);
  ck_assert_msg(rc == 0, "%s", qkeep_errmsg());
  double max_err = 0, max_ref = 0;
  for (int r = 0; r < M; r++)
    for (int64_t j = 0; j < n; j++) {
      double ref = 0;
      for (int64_t i = 0; i < k; i++)
        ref += (double)x[r * k + i] * w[j * k + i];
      max_err = fmax(max_err, fabs(ref - y[r * n + j]));
      max_ref = fmax(max_ref, fabs(ref));
    }
  free(x);
  free(y);
  return max_err / max_ref;
}

/* The source weights [n, k] of a module. */
static float *source_weight(const char *module, int64_t n, int64_t k) {
  char name[200];
  snprintf(name, sizeof name, "%s.weight", module);
  float *w = malloc((size_t)(n * k) * sizeof *w);
  for (int64_t i = 0; i < n * k; i++)
    w[i] = source_value(name, (size_t)i);
  return w;
}

static const char *const schemes[] = {"modelopt-nvfp4", "ct-nvfp4", "mxfp4",  "w8a8-int8",
                                      "gptq-int4",      "awq-int4", "ct-int4"};
/* Relative output error (max abs over max |y|, K = 64) allowed against the original weights: a sanity
 * bound; the exact per-element bounds are in check_formats, the exact agreement with an
 * independent dequantisation is asserted to 1e-5 below. */
static const double format_error[] = {0.25, 0.25, 0.3, 0.03, 0.25, 0.25, 0.25};

START_TEST(scheme_round_trip) {
  const char *scheme = schemes[_i];
  char *source = write_source("source.safetensors", false);
  char *path = quantize(source, scheme, "q", 0);
  qkeep_model *m = load(path);
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(path, &ck), 0);
  ck_assert_str_eq(ck->qc.scheme, scheme);

  tu_assert_census_clean(m);
  assert_names_resolve(m, ck);
  assert_bytes_kept(m, ck);

  /* o_proj (unfused), and expert 1's down projection: reference vs the independent oracle,
   * and vs the original weights within the format's error. */
  qkeep_layer *o = qkeep_model_find_layer(m, "model.layers.0.self_attn.o_proj");
  ck_assert_ptr_nonnull(o);
  ck_assert_str_eq(o->scheme, scheme);
  float *w = oracle_weight(ck, scheme, "model.layers.0.self_attn.o_proj", H, H);
  ck_assert_double_le(apply_error(o, w, H, H, -1, 0), 1e-5);
  free(w);
  w = source_weight("model.layers.0.self_attn.o_proj", H, H);
  double err = apply_error(o, w, H, H, -1, 0);
  ck_assert_msg(err <= format_error[_i] && err > 0, "%s: error %g vs the source", scheme, err);
  free(w);
  qkeep_layer *moe = qkeep_model_find_layer(m, "model.layers.1.mlp.experts");
  ck_assert_ptr_nonnull(moe);
  ck_assert_int_eq(moe->kind, QKEEP_LAYER_MOE);
  w = oracle_weight(ck, scheme, "model.layers.1.mlp.experts.1.down_proj", H, E_I);
  ck_assert_double_le(apply_error(moe, w, H, E_I, 1, QKEEP_MOE_W2), 1e-5);
  free(w);

  /* The fused qkv against its shards' own dequantisations, stacked. */
  qkeep_layer *qkv = qkeep_model_find_layer(m, "model.layers.1.self_attn.qkv_proj");
  ck_assert_ptr_nonnull(qkv);
  ck_assert_int_eq(qkv->dims.shards, 3);
  float *stacked = malloc((size_t)((H + 2 * KV) * H) * sizeof *stacked);
  static const char *const parts[] = {"q_proj", "k_proj", "v_proj"};
  int64_t row = 0;
  for (int p = 0; p < 3; p++) {
    char module[96];
    int64_t n = p ? KV : H;
    snprintf(module, sizeof module, "model.layers.1.self_attn.%s", parts[p]);
    float *part = oracle_weight(ck, scheme, module, n, H);
    memcpy(stacked + row * H, part, (size_t)(n * H) * sizeof *part);
    free(part);
    row += n;
  }
  ck_assert_double_le(apply_error(qkv, stacked, H + 2 * KV, H, -1, 0), 1e-5);
  free(stacked);
  ckpt_close(ck);
  qkeep_model_free(m);
  free(path);
  free(source);
}
END_TEST

START_TEST(sharded_checkpoint_in_any_order_loads_the_same) {
  char *source = write_source("source.safetensors", false);
  char *whole = quantize(source, "modelopt-nvfp4", "whole", 0);
  char *sharded = quantize(source, "modelopt-nvfp4", "sharded", 20000);
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(sharded, &ck), 0);
  ck_assert_int_gt(ck->n_files, 3);
  ckpt_close(ck);
  qkeep_model *a = load(whole), *b = load(sharded);
  struct qkeep_digest da, db;
  ck_assert_int_eq(qkeep_digest(a, &da), 0);
  ck_assert_int_eq(qkeep_digest(b, &db), 0);
  ck_assert(da.hi == db.hi && da.lo == db.lo);
  qkeep_model_free(a);
  qkeep_model_free(b);
  free(whole);
  free(sharded);
  free(source);
}
END_TEST

/* ModelOpt q/k/v by hand, in three shards, with different per-shard global scales. */
START_TEST(fused_slots_land_in_their_rows_and_slots) {
  char *d = tu_path(dir, "fused");
  ck_assert_int_eq(mkdir(d, 0755), 0);
  static const char *const parts[] = {"k_proj", "v_proj", "q_proj"}; /* not in shard order */
  static const int rows[] = {KV, KV, H};
  static const float ws2[] = {3.0f, 2.0f, 1.0f}, in[] = {0.5f, 0.25f, 0.75f};
  char index[4096] = "{\"weight_map\": {";
  for (int p = 0; p < 3; p++) {
    struct st_writer *w;
    char name[128], file[64];
    ck_assert_int_eq(st_writer_new(&w), 0);
    uint8_t packed[H * H / 2], scales[H * H / 16];
    memset(packed, 0x10 * (p + 1) + (p + 1), sizeof packed);
    memset(scales, 0x38 + p, sizeof scales);
    struct qkeep_spec ps = {QKEEP_DTYPE_U8, 2, {rows[p], H / 2}},
                      ss = {QKEEP_DTYPE_F8_E4M3, 2, {rows[p], H / 16}}, scalar = {QKEEP_DTYPE_F32, 0, {0}};
    snprintf(name, sizeof name, "model.layers.0.self_attn.%s.weight", parts[p]);
    ck_assert_int_eq(st_writer_add(w, name, &ps, packed), 0);
    snprintf(index + strlen(index), sizeof index - strlen(index), "%s\"%s\": \"s%d.safetensors\"",
             p ? ", " : "", name, p);
    snprintf(name, sizeof name, "model.layers.0.self_attn.%s.weight_scale", parts[p]);
    ck_assert_int_eq(st_writer_add(w, name, &ss, scales), 0);
    snprintf(index + strlen(index), sizeof index - strlen(index), ", \"%s\": \"s%d.safetensors\"", name, p);
    snprintf(name, sizeof name, "model.layers.0.self_attn.%s.weight_scale_2", parts[p]);
    ck_assert_int_eq(st_writer_add(w, name, &scalar, &ws2[p]), 0);
    snprintf(index + strlen(index), sizeof index - strlen(index), ", \"%s\": \"s%d.safetensors\"", name, p);
    snprintf(name, sizeof name, "model.layers.0.self_attn.%s.input_scale", parts[p]);
    ck_assert_int_eq(st_writer_add(w, name, &scalar, &in[p]), 0);
    snprintf(index + strlen(index), sizeof index - strlen(index), ", \"%s\": \"s%d.safetensors\"", name, p);
    snprintf(file, sizeof file, "s%d.safetensors", p);
    char *path = tu_path(d, file);
    ck_assert_int_eq(st_writer_write(w, path), 0);
    st_writer_free(w);
    free(path);
  }
  strcat(index, "}}");
  char *ip = tu_path(d, "model.safetensors.index.json"), *cp = tu_path(d, "hf_quant_config.json");
  ck_assert_int_eq(tu_write_file(ip, index, strlen(index)), 0);
  const char *hq = "{\"quantization\": {\"quant_algo\": \"NVFP4\", \"group_size\": 16}}";
  ck_assert_int_eq(tu_write_file(cp, hq, strlen(hq)), 0);

  qkeep_model *m = load(d);
  qkeep_layer *qkv = qkeep_model_find_layer(m, "model.layers.0.self_attn.qkv_proj");
  ck_assert_ptr_nonnull(qkv);
  struct qkeep_view v = {.size = sizeof v};
  ck_assert_int_eq(qkeep_view_of(qkv, "weight", &v), 0);
  const uint8_t *bytes = v.data;
  ck_assert_int_eq(bytes[0], 0x33);                    /* q rows first */
  ck_assert_int_eq(bytes[H * H / 2], 0x11);            /* then k */
  ck_assert_int_eq(bytes[(H + KV) * H / 2 + 5], 0x22); /* then v */
  ck_assert_int_eq(qkeep_view_of(qkv, "weight_scale", &v), 0);
  ck_assert_int_eq(((uint8_t *)v.data)[0], 0x3a);
  ck_assert_int_eq(((uint8_t *)v.data)[H * H / 16], 0x38);
  /* Merged by max into the prefix, shard slots kept: [max, k, v] = [3, 3, 2]. */
  ck_assert_int_eq(qkeep_view_of(qkv, "weight_scale_2", &v), 0);
  ck_assert_int_eq(v.spec.ndim, 0);
  ck_assert_uint_eq(v.capacity, 12);
  ck_assert_float_eq(((float *)v.data)[0], 3.0f);
  ck_assert_float_eq(((float *)v.data)[1], 3.0f);
  ck_assert_float_eq(((float *)v.data)[2], 2.0f);
  ck_assert_int_eq(qkeep_view_of(qkv, "input_scale", &v), 0);
  ck_assert_float_eq(((float *)v.data)[0], 0.75f);
  /* The attention block got kv-scale placeholders set to 1. */
  qkeep_layer *attn = qkeep_model_find_layer(m, "model.layers.0.self_attn.attn");
  ck_assert_ptr_nonnull(attn);
  ck_assert_int_eq(qkeep_view_of(attn, "k_scale", &v), 0);
  ck_assert_float_eq(*(float *)v.data, 1.0f);
  qkeep_model_free(m);
  free(ip);
  free(cp);
  free(d);
}
END_TEST

static int count_storage(void *user, const char *layer, const char *name, const void *data, size_t capacity) {
  (void)layer, (void)name, (void)data, (void)capacity;
  ++*(int *)user;
  return 0;
}

START_TEST(tied_lm_head_shares_the_embedding) {
  char *d = tu_path(dir, "tied");
  ck_assert_int_eq(mkdir(d, 0755), 0);
  free(dir);
  dir = d; /* write_source writes into the tied directory */
  char *source = write_source("model.safetensors", true);
  char *config = tu_path(d, "config.json");
  ck_assert_int_eq(tu_write_file(config, "{\"tie_word_embeddings\": true}", 29), 0);
  qkeep_model *m = load(d);
  qkeep_layer *head = qkeep_model_find_layer(m, "lm_head"),
              *embed = qkeep_model_find_layer(m, "model.embed_tokens");
  ck_assert_ptr_nonnull(head);
  ck_assert_ptr_eq(qkeep_param_lookup(head, "weight"), qkeep_param_lookup(embed, "weight"));
  struct qkeep_census c = tu_assert_census_clean(m);
  ck_assert_int_eq(c.aliases, 1);
  /* The shared weight is one storage: an offloader copies it once. */
  int storages = 0;
  ck_assert_int_eq(qkeep_foreach_storage(m, count_storage, &storages), 0);
  ck_assert_int_eq(storages, c.loader_params + c.buffers);
  float *w = source_weight("model.embed_tokens", VOCAB, H);
  ck_assert_double_le(apply_error(head, w, VOCAB, H, -1, 0), 1e-6);
  free(w);
  qkeep_model_free(m);
  free(config);
  free(source);
}
END_TEST

START_TEST(kv_scales_load_or_default) {
  char *source = write_source("source.safetensors", false);
  char *path = quantize(source, "w8a8-int8", "kv", 0);
  qkeep_model *m = load(path);
  qkeep_layer *attn = qkeep_model_find_layer(m, "model.layers.1.self_attn.attn");
  ck_assert_ptr_nonnull(attn);
  struct qkeep_view v = {.size = sizeof v};
  ck_assert_int_eq(qkeep_view_of(attn, "v_scale", &v), 0);
  ck_assert_float_eq(*(float *)v.data, 4.0f / 448.0f); /* written by --kv-scales */
  qkeep_layer *found;
  ck_assert_ptr_eq(qkeep_model_lookup(m, "model.layers.1.self_attn.k_proj.k_scale", &found),
                   qkeep_param_lookup(attn, "k_scale"));
  qkeep_model_free(m);
  free(path);
  free(source);
}
END_TEST

START_TEST(quantize_refuses_and_leaves_nothing) {
  char *source = write_source("source.safetensors", false);
  char *q = quantize(source, "w8a8-int8", "once", 0);
  struct qkeep_quantize_options o = {.size = sizeof o, .scheme = "w8a8-int8"};
  ck_assert_int_eq(qkeep_quantize(source, q, &o), QKEEP_E_EXISTS); /* never overwrites */
  char *again = tu_path(dir, "again");
  ck_assert_int_eq(qkeep_quantize(q, again, &o), QKEEP_E_INVAL); /* already quantized */
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "already quantized"));
  struct stat st;
  ck_assert_int_ne(stat(again, &st), 0);
  o.scheme = "fp3";
  ck_assert_int_eq(qkeep_quantize(source, again, &o), QKEEP_E_UNSUPPORTED);
  ck_assert_int_ne(stat(again, &st), 0);
  free(again);
  free(q);
  free(source);
}
END_TEST

START_TEST(quantize_is_deterministic) {
  char *source = write_source("source.safetensors", false);
  char *a = quantize(source, "gptq-int4", "a", 0), *b = quantize(source, "gptq-int4", "b", 0);
  char *fa = tu_path(a, "model.safetensors"), *fb = tu_path(b, "model.safetensors");
  size_t na, nb;
  void *da = tu_read_file(fa, &na), *db = tu_read_file(fb, &nb);
  ck_assert_uint_eq(na, nb);
  ck_assert_int_eq(memcmp(da, db, na), 0);
  free(da), free(db), free(fa), free(fb), free(a), free(b), free(source);
}
END_TEST

/* gpt-oss names its MXFP4 experts pre-stacked: gate_up_proj_blocks [E, 2I, H/32, 16] and so on. */
START_TEST(gpt_oss_mxfp4_moe_loads_and_applies) {
  enum { E = 3, GI = 64, GH = 64 };
  char *d = tu_path(dir, "gptoss");
  ck_assert_int_eq(mkdir(d, 0755), 0);
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  static const struct {
    const char *name;
    int64_t rows, cols;
  } mats[2] = {{"gate_up_proj", 2 * GI, GH}, {"down_proj", GH, GI}};
  float *source[2][E];
  uint8_t *packed[2][E], *scales[2][E];
  for (int m = 0; m < 2; m++) {
    int64_t rows = mats[m].rows, cols = mats[m].cols;
    uint8_t *blocks = malloc((size_t)(E * rows * cols / 2)), *sc = malloc((size_t)(E * rows * cols / 32));
    uint16_t *bias = malloc((size_t)(E * rows) * 2);
    for (int e = 0; e < E; e++) {
      char name[96];
      snprintf(name, sizeof name, "gptoss.%s.%d", mats[m].name, e);
      source[m][e] = malloc((size_t)(rows * cols) * sizeof(float));
      for (int64_t i = 0; i < rows * cols; i++)
        source[m][e][i] = source_value(name, (size_t)i);
      packed[m][e] = blocks + e * rows * cols / 2;
      scales[m][e] = sc + e * rows * cols / 32;
      ck_assert_int_eq(quant_mxfp4(source[m][e], rows, cols, packed[m][e], scales[m][e]), 0);
      for (int64_t r = 0; r < rows; r++)
        bias[e * rows + r] = qk_f32_to_bf16(0.01f * (float)(r % 7));
    }
    tu_add_gptoss_experts(w, "model.layers.0.mlp.experts", mats[m].name, E, rows, cols, blocks, sc, bias);
    free(bias);
  }
  uint16_t router[E * GH];
  for (int i = 0; i < E * GH; i++)
    router[i] = qk_f32_to_bf16(source_value("router", (size_t)i));
  struct qkeep_spec rs = {QKEEP_DTYPE_BF16, 2, {E, GH}};
  ck_assert_int_eq(st_writer_add(w, "model.layers.0.mlp.router.weight", &rs, router), 0);
  char *file = tu_path(d, "model.safetensors"), *config = tu_path(d, "config.json");
  ck_assert_int_eq(st_writer_write(w, file), 0);
  st_writer_free(w);
  const char *cfg = "{\"quantization_config\": {\"quant_method\": \"mxfp4\", \"modules_to_not_convert\": "
                    "[\"model.layers.*.mlp.router\"]}}";
  ck_assert_int_eq(tu_write_file(config, cfg, strlen(cfg)), 0);

  qkeep_model *m = load(d);
  qkeep_layer *moe = qkeep_model_find_layer(m, "model.layers.0.mlp.experts");
  ck_assert_ptr_nonnull(moe);
  ck_assert_int_eq(moe->kind, QKEEP_LAYER_MOE);
  ck_assert_str_eq(moe->scheme, "mxfp4");
  ck_assert_int_eq(moe->dims.experts, E);
  ck_assert_ptr_eq(qkeep_param_lookup(moe, "w13_weight"), qkeep_param_lookup(moe, "gate_up_proj_blocks"));
  ck_assert_ptr_eq(qkeep_param_lookup(moe, "w2_weight_scale"), qkeep_param_lookup(moe, "down_proj_scales"));
  ck_assert_str_eq(qkeep_model_find_layer(m, "model.layers.0.mlp.router")->scheme, "unquantized");
  struct qkeep_census c = tu_assert_census_clean(m);
  ck_assert_int_eq(c.aliases, 6);
  /* Every expert matrix against the independent dequantisation (plus its bias). */
  for (int e = 0; e < E; e++)
    for (int mat = 0; mat < 2; mat++) {
      int64_t rows = mats[mat].rows, cols = mats[mat].cols;
      float *want = malloc((size_t)(rows * cols) * sizeof *want);
      dequant_mxfp4(packed[mat][e], scales[mat][e], rows, cols, want);
      float x[GH], y[2 * GI];
      for (int i = 0; i < cols; i++)
        x[i] = (float)(i % 9) / 9.0f - 0.4f;
      ck_assert_int_eq(qkeep_layer_apply_expert_f32(moe, e, (enum qkeep_moe_matrix)mat, 1, x, y), 0);
      for (int64_t r = 0; r < rows; r++) {
        double ref = qk_bf16_to_f32(qk_f32_to_bf16(0.01f * (float)(r % 7))); /* the bias */
        for (int64_t k = 0; k < cols; k++)
          ref += (double)x[k] * want[r * cols + k];
        ck_assert_double_eq_tol(y[r], ref, 1e-4);
      }
      free(want);
    }
  /* A reload of the same checkpoint lands in place, equal to the cold start. */
  struct qkeep_digest d0, d1;
  ck_assert_int_eq(qkeep_digest(m, &d0), 0);
  ck_assert_int_eq(qkeep_model_reload(m, d, 0), 0);
  ck_assert_int_eq(qkeep_digest(m, &d1), 0);
  ck_assert(d0.hi == d1.hi && d0.lo == d1.lo);
  for (int mat = 0; mat < 2; mat++) {
    free(packed[mat][0]);
    free(scales[mat][0]);
    for (int e = 0; e < E; e++)
      free(source[mat][e]);
  }
  qkeep_model_free(m);
  free(file), free(config), free(d);
}
END_TEST

/* GPTQ with act order: g_idx maps each input row to any group; the kernel must follow it. */
START_TEST(gptq_act_order_follows_g_idx) {
  char *source = write_source("source.safetensors", false);
  char *q = quantize(source, "gptq-int4", "q", 0);
  char *in = tu_path(q, "model.safetensors"), *out_dir = tu_path(dir, "act"), *out,
       *cfg_in = tu_path(q, "config.json"), *cfg_out;
  ck_assert_int_eq(mkdir(out_dir, 0755), 0);
  out = tu_path(out_dir, "model.safetensors");
  cfg_out = tu_path(out_dir, "config.json");
  /* Every g_idx of layer 0's attention (q, k, v share one) becomes a permutation of the groups. */
  struct tu_tensors ts = tu_read_tensors(in);
  for (size_t i = 0; i < ts.n; i++) {
    const struct tu_tensor *t = &ts.items[i];
    if (strstr(t->name, "layers.0.self_attn.") && strstr(t->name, ".g_idx")) {
      int32_t *g = (int32_t *)t->data;
      for (int64_t k = 0; k < t->spec.shape[0]; k++)
        g[k] = (int32_t)((k * 7 + 3) % t->spec.shape[0]) / 32; /* rows scattered over the K/32 groups */
    }
  }
  tu_write_tensors(&ts, out);
  size_t n;
  char *cfg = tu_read_file(cfg_in, &n), *flag = strstr(cfg, "\"desc_act\": false");
  ck_assert_ptr_nonnull(flag);
  memcpy(flag, "\"desc_act\": true ", 17); /* same length: "false" -> "true " */
  ck_assert_int_eq(tu_write_file(cfg_out, cfg, n), 0);
  free(cfg);

  qkeep_model *m = load(out_dir);
  qkeep_layer *o = qkeep_model_find_layer(m, "model.layers.0.self_attn.o_proj");
  ck_assert(o->dims.flags & QKEEP_LAYER_F_ACT_ORDER);
  ck_assert_ptr_nonnull(qkeep_get_live_param(o, "g_idx")); /* act order: the kernel reads it */
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(out_dir, &ck), 0);
  float *want = oracle_weight(ck, "gptq-int4", "model.layers.0.self_attn.o_proj", H, H);
  ck_assert_double_le(apply_error(o, want, H, H, -1, 0), 1e-5);
  /* ... and the trivial-g_idx reading would differ: the permutation matters. */
  int32_t *qw = read_tensor(ck, "model.layers.0.self_attn.o_proj", "qweight"),
          *qz = read_tensor(ck, "model.layers.0.self_attn.o_proj", "qzeros");
  uint16_t *sc = read_tensor(ck, "model.layers.0.self_attn.o_proj", "scales");
  float *trivial = malloc(H * H * sizeof *trivial);
  dequant_gptq_int4(qw, sc, qz, NULL, H, H, 32, false, trivial);
  ck_assert_double_gt(apply_error(o, trivial, H, H, -1, 0), 1e-3);
  free(qw), free(qz), free(sc), free(trivial), free(want);
  ckpt_close(ck);
  qkeep_model_free(m);
  free(source), free(q), free(in), free(out_dir), free(out), free(cfg_in), free(cfg_out);
}
END_TEST

static Suite *schemes_suite(void) {
  Suite *s = suite_create("schemes");
  TCase *tc = tcase_create("schemes");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 60);
  tcase_add_loop_test(tc, scheme_round_trip, 0, (int)(sizeof schemes / sizeof schemes[0]));
  tcase_add_test(tc, sharded_checkpoint_in_any_order_loads_the_same);
  tcase_add_test(tc, fused_slots_land_in_their_rows_and_slots);
  tcase_add_test(tc, tied_lm_head_shares_the_embedding);
  tcase_add_test(tc, gpt_oss_mxfp4_moe_loads_and_applies);
  tcase_add_test(tc, gptq_act_order_follows_g_idx);
  tcase_add_test(tc, kv_scales_load_or_default);
  tcase_add_test(tc, quantize_refuses_and_leaves_nothing);
  tcase_add_test(tc, quantize_is_deterministic);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  fixture_name = "schemes";
  return tu_run_suite(schemes_suite(), CK_NORMAL);
}
