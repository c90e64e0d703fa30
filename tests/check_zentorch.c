/*
 * check_zentorch.c: the cpu-zentorch backend against the reference backend loaded from the
 * same checkpoint, and its layouts against this file's own reading of the formats.
 *
 * Checkpoints: an unquantized model (fused q/k/v with biases and gate/up, an MoE block, an
 * embedding and lm_head) quantized by qkeep_quantize into gptq-int4, awq-int4 and ct-int4
 * (compressed-tensors pack-quantized), symmetric and asymmetric, then rewritten here into the variants the
 * quantizer does not write: GPTQ v2 zero points, act order (g_idx a shuffled group assignment, desc_act
 * true), and an asymmetric config whose zero points are all 8. Two sets of dims: N off every multiple of 64
 * (the blocked layout's narrow last block) with groups of 8, and multiples of 64 with groups of 32.
 *
 * For every variant x mode (w4a16, da8w4) x every ISA this CPU can run (lower ones forced
 * through the `isa` key), every linear layer and MoE expert matrix agrees with
 *   - w4a16: the reference on the same f32 activations, to 2e-6 of sum_k |x_k| |W_nk|;
 *   - da8w4: the reference on activations quantised and dequantised here by the recipe of
 *     zentorch.h (an independent copy of it), to 2e-6 of the same bound: one unit of any
 *     int32 group sum would be well past it.
 * At 1 to 130 rows, each row of a product equals bit for bit the product of that row alone
 * (the kernels group rows into tiles and passes; that must not show). Plus: the census is
 * clean (missing, C1, C2, released 0), qweight holds the documented blocked codes (decoded
 * here from the checkpoint), zero points and g_idx are where the header says; reload W0 -> W1
 * in place equals a cold start on W1 byte for byte with no storage moving, and so does a
 * reload back to W0; bf16 activations; config keys and refusals; and a chain
 * `cpu-zentorch, reference` on checkpoints written by `qkeep quantize`.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkutil.h"
#include "private.h"
#include "testutil.h"
#include "zentorch.h"

struct dims {
  int64_t h, kv, inter, e_inter, experts, vocab, group;
};
/* N = 64 + 40 + 40 (qkv), 400 (gate_up), 112 (w13): narrow last blocks; groups of one word. */
static const struct dims odd = {64, 40, 200, 56, 2, 64, 8};
static const struct dims even = {64, 64, 128, 64, 2, 64, 32};

static char *dir;
static qkeep_plugin *zt, *ref;

static void setup(void) {
  dir = tu_tmpdir("zentorch");
  ck_assert_ptr_nonnull(dir);
  ck_assert_msg(qkeep_plugin_open("cpu-zentorch", NULL, &zt) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &ref) == 0, "%s", qkeep_errmsg());
}

static void teardown(void) {
  qkeep_plugin_close(zt);
  qkeep_plugin_close(ref);
  tu_rmtree(dir);
  free(dir);
}

static int set_key(const char *key, const char *value) {
  const struct qkeep_backend *be = qkeep_plugin_backend(zt);
  return be->configure(be, key, value);
}

/* ---- checkpoints ------------------------------------------------------------------------------ */

static float source_value(uint64_t seed, const char *name, size_t i) {
  uint64_t s = 1469598103934665603ULL ^ seed;
  for (const char *p = name; *p; p++)
    s = (s ^ (unsigned char)*p) * 1099511628211ULL;
  s += i * 0x9e3779b97f4a7c15ULL;
  return (float)((double)(tu_rand(&s) >> 40) / 8388608.0 - 1.0) * 0.25f;
}

/* A bf16 tensor [rows, cols] of source values; cols 0: [rows] of ones (a norm), cols -1: [rows] of values. */
static void add_tensor(struct st_writer *w, const char *name, int64_t rows, int64_t cols, uint64_t seed) {
  size_t n = (size_t)(rows * (cols > 0 ? cols : 1));
  uint16_t *buf = malloc(n * 2);
  for (size_t i = 0; i < n; i++)
    buf[i] = qk_f32_to_bf16(cols ? source_value(seed, name, i) : 1.0f);
  struct qkeep_spec s = {QKEEP_DTYPE_BF16, cols > 0 ? 2 : 1, {rows, cols > 0 ? cols : 0}};
  ck_assert_int_eq(st_writer_add(w, name, &s, buf), 0);
  free(buf);
}

static char *write_source(const char *sub, const struct dims *d, uint64_t seed) {
  char *path = tu_path(dir, sub), name[160];
  ck_assert_int_eq(mkdir(path, 0755), 0);
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  add_tensor(w, "model.embed_tokens.weight", d->vocab, d->h, seed);
  add_tensor(w, "lm_head.weight", d->vocab, d->h, seed);
  add_tensor(w, "model.norm.weight", d->h, 0, seed);
  static const char *const proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  for (int l = 0; l < 2; l++) {
    int64_t rows[] = {d->h, d->kv, d->kv, d->h};
    for (int p = 0; p < 4; p++) {
      snprintf(name, sizeof name, "model.layers.%d.self_attn.%s.weight", l, proj[p]);
      add_tensor(w, name, rows[p], d->h, seed);
      if (l == 0 && p < 3) {
        snprintf(name, sizeof name, "model.layers.%d.self_attn.%s.bias", l, proj[p]);
        add_tensor(w, name, rows[p], -1, seed);
      }
    }
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
    add_tensor(w, name, d->h, 0, seed);
    if (l == 0) {
      add_tensor(w, "model.layers.0.mlp.gate_proj.weight", d->inter, d->h, seed);
      add_tensor(w, "model.layers.0.mlp.up_proj.weight", d->inter, d->h, seed);
      add_tensor(w, "model.layers.0.mlp.down_proj.weight", d->h, d->inter, seed);
      continue;
    }
    add_tensor(w, "model.layers.1.mlp.gate.weight", d->experts, d->h, seed);
    for (int64_t e = 0; e < d->experts; e++) {
      static const char *const mlp[] = {"gate_proj", "up_proj", "down_proj"};
      for (int p = 0; p < 3; p++) {
        snprintf(name, sizeof name, "model.layers.1.mlp.experts.%lld.%s.weight", (long long)e, mlp[p]);
        add_tensor(w, name, p < 2 ? d->e_inter : d->h, p < 2 ? d->h : d->e_inter, seed);
      }
    }
  }
  char *file = tu_path(path, "model.safetensors"), *config = tu_path(path, "config.json");
  ck_assert_int_eq(st_writer_write(w, file), 0);
  st_writer_free(w);
  const char *json = "{\"tie_word_embeddings\": false}";
  ck_assert_int_eq(tu_write_file(config, json, strlen(json)), 0);
  free(file);
  free(config);
  return path;
}

/* The int4 variants under test: what qkeep_quantize writes, and what this file rewrites from it. */
struct variant {
  const char *name;
  const char *scheme;
  bool asym;      /* quantized with zero points */
  bool v2;        /* rewritten: GPTQ v2 zero points */
  bool act_order; /* rewritten: shuffled g_idx, desc_act */
  bool all_eight; /* rewritten: symmetric codes under an asymmetric config (every zero point 8) */
};
static const struct variant variants[] = {
    {"gptq-sym", "gptq-int4", false, false, false, false},
    {"gptq-asym", "gptq-int4", true, false, false, false},
    {"gptq-asym-v2", "gptq-int4", true, true, false, false},
    {"gptq-sym-act-order", "gptq-int4", false, false, true, false},
    {"gptq-asym-v2-act-order", "gptq-int4", true, true, true, false},
    {"gptq-all-eight", "gptq-int4", false, false, false, true},
    {"awq-sym", "awq-int4", false, false, false, false},
    {"awq-asym", "awq-int4", true, false, false, false},
    {"ct-sym", "ct-int4", false, false, false, false},
    {"ct-asym", "ct-int4", true, false, false, false},
};
#define N_VARIANTS (int)(sizeof variants / sizeof variants[0])

static bool ends_with(const char *s, const char *tail) {
  size_t a = strlen(s), b = strlen(tail);
  return a >= b && strcmp(s + a - b, tail) == 0;
}

/* g_idx of an act-order checkpoint: row k belongs to group inv[k] / g for a shuffle inv of K (per K, so
 * fused shards agree). */
static void shuffled_g_idx(int32_t *g_idx, int64_t k, int64_t g) {
  int32_t *order = malloc((size_t)k * sizeof *order);
  for (int64_t i = 0; i < k; i++)
    order[i] = (int32_t)i;
  uint64_t s = 77 + (uint64_t)k;
  for (int64_t i = k - 1; i > 0; i--) {
    int64_t j = (int64_t)(tu_rand(&s) % (uint64_t)(i + 1));
    int32_t t = order[i];
    order[i] = order[j], order[j] = t;
  }
  for (int64_t i = 0; i < k; i++)
    g_idx[order[i]] = (int32_t)(i / g);
  free(order);
}

/* Rewrites checkpoint `in` into `out` as variant v (tensors and config.json). */
static void rewrite(const char *in, const char *out, const struct variant *v, int64_t group) {
  ck_assert_int_eq(mkdir(out, 0755), 0);
  char *src = tu_path(in, "model.safetensors"), *dst = tu_path(out, "model.safetensors");
  struct st_file *f;
  ck_assert_int_eq(st_open(src, &f), 0);
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  for (size_t i = 0; i < f->n_tensors; i++) {
    const struct st_tensor *t = &f->tensors[i];
    unsigned char *data = malloc(t->nbytes + 1);
    ck_assert_int_eq(st_read(f, t, data), 0);
    int32_t *words = (int32_t *)data;
    size_t n_words = t->nbytes / 4;
    if (ends_with(t->name, ".qzeros") && v->v2)
      for (size_t j = 0; j < n_words; j++) {
        uint32_t in_w = (uint32_t)words[j], out_w = 0;
        for (int c = 0; c < 8; c++)
          out_w |= (((in_w >> (4 * c)) + 1) & 0xfu) << (4 * c);
        words[j] = (int32_t)out_w;
      }
    if (ends_with(t->name, ".g_idx") && v->act_order)
      shuffled_g_idx(words, (int64_t)n_words, group);
    struct qkeep_spec s = {(enum qkeep_dtype)t->dtype, t->ndim, {0}};
    memcpy(s.shape, t->shape, sizeof s.shape);
    ck_assert_int_eq(st_writer_add(w, t->name, &s, data), 0);
    free(data);
  }
  st_close(f);
  ck_assert_int_eq(st_writer_write(w, dst), 0);
  st_writer_free(w);
  char json[512], *config = tu_path(out, "config.json");
  snprintf(
      json, sizeof json,
      "{\"tie_word_embeddings\": false, \"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 4, "
      "\"group_size\": %lld, \"desc_act\": %s, \"sym\": %s, \"checkpoint_format\": \"%s\"}}",
      (long long)group, v->act_order ? "true" : "false", v->asym || v->all_eight ? "false" : "true",
      v->v2 ? "gptq_v2" : "gptq");
  ck_assert_int_eq(tu_write_file(config, json, strlen(json)), 0);
  free(config);
  free(src);
  free(dst);
}

/* The checkpoint of variant v on dims d from source seed `seed`; malloc'd path. */
static char *checkpoint(const struct dims *d, const struct variant *v, uint64_t seed) {
  char sub[96];
  snprintf(sub, sizeof sub, "src-%lld-%llu", (long long)d->group, (unsigned long long)seed);
  char *source = tu_path(dir, sub);
  struct stat sb;
  if (stat(source, &sb) != 0) {
    free(source);
    source = write_source(sub, d, seed);
  }
  snprintf(sub, sizeof sub, "q-%s-%lld-%llu", v->name, (long long)d->group, (unsigned long long)seed);
  char *path = tu_path(dir, sub);
  bool rewritten = v->v2 || v->act_order || v->all_eight;
  char *quantized = rewritten ? tu_path(dir, "tmp-q") : strdup(path);
  tu_rmtree(quantized);
  struct qkeep_quantize_options o = {.size = sizeof o,
                                     .scheme = v->scheme,
                                     .group_size = d->group,
                                     .asym_weights = v->asym,
                                     .activation_amax = 1};
  ck_assert_msg(qkeep_quantize(source, quantized, &o) == 0, "%s: %s", v->name, qkeep_errmsg());
  if (rewritten) {
    rewrite(quantized, path, v, d->group);
    tu_rmtree(quantized);
  }
  free(quantized);
  free(source);
  return path;
}

/* A model of `path` on the chain (cpu-zentorch, reference) or on the reference alone. */
static qkeep_model *load(bool zentorch, const char *path) {
  qkeep_plugin *chain[] = {zt, ref};
  qkeep_model *m;
  ck_assert_int_eq(zentorch ? qkeep_model_new_chain(chain, 2, &m) : qkeep_model_new(ref, &m), 0);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

/* ---- the oracle ------------------------------------------------------------------------------- */

/* One GEMM of a layer: a linear layer's, or expert e's w13 / w2. */
struct gemm {
  qkeep_layer *layer, *ref_layer;
  bool moe, w2;
  int32_t expert;
  int64_t n, k;
};

static int apply(qkeep_layer *layer, const struct gemm *g, int64_t m, const float *x, float *y) {
  return g->moe
             ? qkeep_layer_apply_expert_f32(layer, g->expert, g->w2 ? QKEEP_MOE_W2 : QKEEP_MOE_W13, m, x, y)
             : qkeep_layer_apply_f32(layer, m, x, y);
}

/* |W| of the reference, [k, n], from its columns (the reference applied to unit rows). */
static float *abs_weights(const struct gemm *g) {
  float *eye = calloc((size_t)(g->k * g->k), sizeof *eye), *w = malloc((size_t)(g->k * g->n) * sizeof *w),
        *zero = calloc((size_t)g->k, sizeof *zero), *bias = malloc((size_t)g->n * sizeof *bias);
  for (int64_t i = 0; i < g->k; i++)
    eye[i * g->k + i] = 1.0f;
  ck_assert_int_eq(apply(g->ref_layer, g, g->k, eye, w), 0);
  ck_assert_int_eq(apply(g->ref_layer, g, 1, zero, bias), 0);
  for (int64_t i = 0; i < g->k * g->n; i++)
    w[i] = fabsf(w[i] - bias[i % g->n]);
  free(eye), free(zero), free(bias);
  return w;
}

/* The da8w4 recipe of zentorch.h, written again: each row's codes, dequantised (a q) into xd. */
static void quantise_dequantise(const float *x, int64_t m, int64_t k, float *xd) {
  for (int64_t r = 0; r < m; r++) {
    float amax = 0.0f;
    for (int64_t i = 0; i < k; i++)
      amax = fabsf(x[r * k + i]) > amax ? fabsf(x[r * k + i]) : amax;
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f, a = amax / 127.0f;
    for (int64_t i = 0; i < k; i++) {
      float q = rintf(x[r * k + i] * inv);
      q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
      xd[r * k + i] = a * q;
    }
  }
}

/* The m x k activations of a check from `seed` (malloc'd). */
static float *activations_of(uint64_t seed, int64_t m, int64_t k) {
  float *x = malloc((size_t)(m * k) * sizeof *x);
  uint64_t s = seed + (uint64_t)m;
  for (int64_t i = 0; i < m * k; i++)
    x[i] = tu_randf(&s);
  return x;
}

/* m rows of the GEMM under the current mode against the oracle, activations from `seed`; y_out, when not
 * NULL, receives the result (m x n floats). */
static void check_rows(const struct gemm *g, const float *absw, bool da8w4, uint64_t seed, int64_t m,
                       const char *what, float *y_out) {
  float *x = activations_of(seed, m, g->k), *xd = malloc((size_t)(m * g->k) * sizeof *xd);
  float *y = malloc((size_t)(m * g->n) * sizeof *y), *yr = malloc((size_t)(m * g->n) * sizeof *yr);
  if (da8w4)
    quantise_dequantise(x, m, g->k, xd);
  else
    memcpy(xd, x, (size_t)(m * g->k) * sizeof *x);
  ck_assert_msg(apply(g->layer, g, m, x, y) == 0, "%s: %s", what, qkeep_errmsg());
  ck_assert_int_eq(apply(g->ref_layer, g, m, xd, yr), 0);
  for (int64_t r = 0; r < m; r++)
    for (int64_t n = 0; n < g->n; n++) {
      double bound = 0;
      for (int64_t k = 0; k < g->k; k++)
        bound += fabs((double)xd[r * g->k + k]) * absw[k * g->n + n];
      double diff = fabs((double)y[r * g->n + n] - yr[r * g->n + n]);
      ck_assert_msg(diff <= 2e-6 * bound + 1e-7, "%s: %s expert %d%s m %lld row %lld col %lld: %.9g vs %.9g",
                    what, g->layer->name, (int)g->expert, g->w2 ? " w2" : "", (long long)m, (long long)r,
                    (long long)n, y[r * g->n + n], yr[r * g->n + n]);
    }
  if (y_out)
    memcpy(y_out, y, (size_t)(m * g->n) * sizeof *y);
  free(x), free(xd), free(y), free(yr);
}

/* Direct tiles of 1-2 rows; decoded tiles (6 rows with VNNI, 4 without) and their tails. */
static const int64_t ms[] = {1, 2, 6, 7};

/* The GEMM under the current mode against the oracle, at each of ms, activations from `seed`. */
static void check_gemm(const struct gemm *g, bool da8w4, uint64_t seed, const char *what) {
  float *absw = abs_weights(g);
  for (size_t t = 0; t < sizeof ms / sizeof ms[0]; t++)
    check_rows(g, absw, da8w4, seed, ms[t], what, NULL);
  free(absw);
}

/*
 * The row counts a call may be split into: direct tiles (1, 3), decoded tiles with a tail (5, 17),
 * and passes of 64 rows with a 2-row chunk after them (130), each against the oracle; and every
 * row of the 130-row product equal bit for bit to the product of that row alone, so that how the
 * kernels group rows never shows in y.
 */
static void check_row_counts(const struct gemm *g, bool da8w4, uint64_t seed, const char *what) {
  static const int64_t counts[] = {1, 3, 5, 17, 130};
  const size_t n_counts = sizeof counts / sizeof counts[0];
  int64_t most = counts[n_counts - 1];
  float *absw = abs_weights(g), *y = malloc((size_t)(most * g->n) * sizeof *y);
  for (size_t t = 0; t < n_counts; t++)
    check_rows(g, absw, da8w4, seed, counts[t], what, y);
  float *x = activations_of(seed, most, g->k), *row = malloc((size_t)g->n * sizeof *row);
  for (int64_t r = 0; r < most; r++) {
    /* Under a memory checker, the rows at each end of a 64-row pass and of the product: the one-row
     * call is the same code for every row (plain make check compares all 130). */
    if (tu_under_memcheck() && r % 64 > 1 && r % 64 < 63 && r < most - 2)
      continue;
    ck_assert_int_eq(apply(g->layer, g, 1, x + r * g->k, row), 0);
    for (int64_t n = 0; n < g->n; n++)
      ck_assert_msg(memcmp(&row[n], &y[r * g->n + n], sizeof *row) == 0,
                    "%s: %s expert %d%s row %lld col %lld: %.9g in %lld rows, %.9g alone", what,
                    g->layer->name, (int)g->expert, g->w2 ? " w2" : "", (long long)r, (long long)n,
                    y[r * g->n + n], (long long)most, row[n]);
  }
  free(absw), free(y), free(x), free(row);
}

typedef void (*gemm_check)(const struct gemm *g, bool da8w4, uint64_t seed, const char *what);

/* Every int4 GEMM of m (run by cpu-zentorch) against r through `check`, under the current mode. */
static int check_model_with(qkeep_model *m, qkeep_model *r, bool da8w4, const char *what, gemm_check check) {
  int checked = 0;
  for (size_t l = 0; l < qkeep_model_layer_count(m); l++) {
    qkeep_layer *layer = qkeep_model_layer(m, l);
    if (strcmp(qkeep_layer_backend(layer), "cpu-zentorch") != 0)
      continue;
    struct qkeep_layer_info info = {.size = sizeof info};
    ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
    struct gemm g = {
        layer, qkeep_model_find_layer(r, info.name), info.kind == QKEEP_LAYER_MOE, false, 0, info.n, info.k};
    if (!g.moe) {
      check(&g, da8w4, 100 + l, what), checked++;
      continue;
    }
    for (int32_t e = 0; e < info.experts; e++) {
      g.expert = e;
      g.w2 = false, g.n = info.n, g.k = info.k;
      check(&g, da8w4, 200 + l, what), checked++;
      g.w2 = true, g.n = info.k, g.k = info.n / 2;
      check(&g, da8w4, 300 + l, what), checked++;
    }
  }
  return checked;
}

/* Every int4 GEMM of m against r at the row counts of ms. */
static int check_model(qkeep_model *m, qkeep_model *r, bool da8w4, const char *what) {
  return check_model_with(m, r, da8w4, what, check_gemm);
}

static const char *const isas[] = {"avx2", "avx512", "avx512_vnni", "amx"};
static const char *const modes[] = {"w4a16", "da8w4"};

/* Every mode x ISA this CPU runs, each GEMM through `check`; the number of ISAs run. */
static int check_all_paths(qkeep_model *m, qkeep_model *r, const char *name, gemm_check check) {
  int paths = 0;
  for (size_t i = 0; i < sizeof isas / sizeof isas[0]; i++) {
    if (set_key("isa", isas[i]) != 0)
      continue; /* above this CPU */
    paths++;
    for (int md = 0; md < 2; md++) {
      ck_assert_int_eq(set_key("mode", modes[md]), 0);
      char what[128];
      snprintf(what, sizeof what, "%s %s %s", name, isas[i], modes[md]);
      ck_assert_int_gt(check_model_with(m, r, md == 1, what, check), 0);
    }
  }
  ck_assert_int_eq(set_key("isa", "auto"), 0);
  ck_assert_int_eq(set_key("mode", "w4a16"), 0);
  return paths;
}

/* ---- the layouts after PWAL ----------------------------------------------------------------------- */

static struct qkeep_view view_of(qkeep_layer *layer, const char *name) {
  struct qkeep_view v = {.size = sizeof v};
  ck_assert_msg(qkeep_view_of(layer, name, &v) == 0, "%s", qkeep_errmsg());
  return v;
}

/* qkv's qweight holds the blocked zentorch codes of the checkpoint's codes (rows in g_idx's permutation
 * under act order, s4 when symmetric); qzeros and g_idx are in their documented states. */
static void check_layout(qkeep_model *m, const char *path, const struct variant *v) {
  const char *layer_name = "model.layers.0.self_attn.qkv_proj";
  qkeep_layer *layer = qkeep_model_find_layer(m, layer_name);
  struct qkeep_layer_info info = {.size = sizeof info};
  ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
  int64_t n = info.n, k = info.k;
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(path, &ck), 0);
  /* The q_proj shard's checkpoint codes: columns [0, h) of the fused layer. */
  bool awq = v->scheme[0] == 'a', ct = v->scheme[0] == 'c', sym = !v->asym;
  const char *codes = ct ? "weight_packed" : "qweight", *zeros = ct ? "weight_zero_point" : "qzeros",
             *g_idx = ct ? "weight_g_idx" : "g_idx";
  char tname[128];
  snprintf(tname, sizeof tname, "model.layers.0.self_attn.q_proj.%s", codes);
  const struct ckpt_tensor *t = ckpt_find(ck, tname);
  ck_assert_ptr_nonnull(t);
  int32_t *words = malloc(t->t->nbytes);
  ck_assert_int_eq(ckpt_read(ck, t, words), 0);
  int64_t nq = awq ? t->t->shape[1] * 8 : ct ? t->t->shape[0] : t->t->shape[1];
  struct qkeep_view qw = view_of(layer, codes);
  ck_assert_int_eq(qw.spec.dtype, QKEEP_DTYPE_I32);
  ck_assert_int_eq(qw.spec.ndim, 1);
  ck_assert_int_eq(qw.spec.shape[0], k / 8 * n);
  const int32_t *perm = NULL;
  if (v->act_order) {
    struct qkeep_view gv = view_of(layer, g_idx);
    ck_assert_int_eq(gv.state, QKEEP_PARAM_LIVE);
    perm = gv.data;
  }
  static const int awq_nibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  for (int64_t i = 0; i < k; i++)
    for (int64_t col = 0; col < nq; col++) {
      int64_t row = perm ? perm[i] : i;
      uint32_t want = awq  ? ((uint32_t)words[row * (nq / 8) + col / 8] >> (4 * awq_nibble[col % 8])) & 0xf
                      : ct ? ((uint32_t)words[col * (k / 8) + row / 8] >> (4 * (row % 8))) & 0xf
                           : ((uint32_t)words[(row / 8) * nq + col] >> (4 * (row % 8))) & 0xf;
      if (sym)
        want ^= 8;
      uint32_t word = (uint32_t)((const int32_t *)qw.data)[zt_blocked_index(n, k, i / 8, col)];
      ck_assert_msg(((word >> (4 * (i % 8))) & 0xf) == want, "%s: code (%lld, %lld)", v->name, (long long)i,
                    (long long)col);
    }
  if (ct && sym) { /* a symmetric compressed-tensors checkpoint has no zero points */
    free(words);
    ckpt_close(ck);
    return;
  }
  struct qkeep_view zv = view_of(layer, zeros);
  ck_assert_int_eq(zv.state, sym ? QKEEP_PARAM_RETIRED : QKEEP_PARAM_LIVE);
  if (!sym) {
    /* The zero itself, natural column order: the reference's zero of q_proj column 5, group 0. */
    snprintf(tname, sizeof tname, "model.layers.0.self_attn.q_proj.%s", zeros);
    const struct ckpt_tensor *zt_ = ckpt_find(ck, tname);
    int32_t *z = malloc(zt_->t->nbytes);
    ck_assert_int_eq(ckpt_read(ck, zt_, z), 0);
    for (int64_t col = 0; col < nq; col++) {
      /* group 0: AWQ and GPTQ [groups, N/8] (row 0), compressed-tensors [N/8, groups] (column 0) */
      int32_t word = ct ? z[(col / 8) * zt_->t->shape[1]] : z[col / 8];
      uint32_t stored = awq ? ((uint32_t)word >> (4 * awq_nibble[col % 8])) & 0xf
                            : ((uint32_t)word >> (4 * (col % 8))) & 0xf;
      uint32_t zero = awq || ct || v->v2 ? stored : (stored + 1) & 0xf;
      ck_assert_uint_eq(((uint32_t)((const int32_t *)zv.data)[col / 8] >> (4 * (col % 8))) & 0xf, zero);
    }
    free(z);
  }
  free(words);
  ckpt_close(ck);
}

/* ---- tests ----------------------------------------------------------------------------------------- */

static void round_trip(const struct dims *d, const struct variant *v) {
  char *path = checkpoint(d, v, 1);
  qkeep_model *m = load(true, path), *r = load(false, path);
  struct qkeep_census c = tu_assert_census_clean(m);
  ck_assert_int_eq(c.buffers, 0);
  check_layout(m, path, v);
  ck_assert_int_ge(check_all_paths(m, r, v->name, check_gemm), 1);
  qkeep_model_free(m);
  qkeep_model_free(r);
  free(path);
}

START_TEST(every_variant_mode_and_isa_odd_dims) { round_trip(&odd, &variants[_i]); }
END_TEST

START_TEST(every_variant_mode_and_isa_dims_of_64) { round_trip(&even, &variants[_i]); }
END_TEST

/* Loop index i: gptq-sym (s4 codes) or gptq-asym (zero points), on the odd dims (narrow last blocks,
 * groups of one word) or the dims of 64 (groups of four words). */
START_TEST(every_row_count_gives_each_row_its_product_alone) {
  const struct dims *d = _i / 2 ? &even : &odd;
  const struct variant *v = &variants[_i % 2];
  char *path = checkpoint(d, v, 1);
  qkeep_model *m = load(true, path), *r = load(false, path);
  ck_assert_int_ge(check_all_paths(m, r, v->name, check_row_counts), 1);
  qkeep_model_free(m);
  qkeep_model_free(r);
  free(path);
}
END_TEST

static int same_output(void *user, const struct qkeep_layer_error *e) {
  (void)user;
  ck_assert_msg(e->max_abs == 0.0, "%s differs from a cold start by %g", e->layer, e->max_abs);
  return 0;
}

static void assert_reload_equals_cold(qkeep_model *m, const char *w, struct tu_storages *before) {
  ck_assert_msg(qkeep_model_reload(m, w, 0) == 0, "%s", qkeep_errmsg());
  qkeep_model *cold = load(true, w);
  struct tu_storages after = {0}, cold_s = {0};
  tu_snapshot(m, &after);
  tu_snapshot(cold, &cold_s);
  tu_assert_in_place_and_equal(before, &after, &cold_s);
  struct qkeep_digest dm, dc;
  ck_assert_int_eq(qkeep_digest(m, &dm), 0);
  ck_assert_int_eq(qkeep_digest(cold, &dc), 0);
  ck_assert_mem_eq(&dm, &dc, sizeof dm);
  tu_assert_census_clean(m);
  for (int md = 0; md < 2; md++) {
    ck_assert_int_eq(set_key("mode", modes[md]), 0);
    ck_assert_int_eq(qkeep_compare(m, cold, 3, 9, same_output, NULL), 0);
  }
  ck_assert_int_eq(set_key("mode", "w4a16"), 0);
  tu_release_snapshot(&after);
  tu_release_snapshot(&cold_s);
  qkeep_model_free(cold);
}

START_TEST(reload_in_place_equals_a_cold_start) {
  const struct variant *v = &variants[_i];
  char *w0 = checkpoint(&odd, v, 1), *w1 = checkpoint(&odd, v, 2);
  qkeep_model *m = load(true, w0);
  struct tu_storages before = {0};
  tu_snapshot(m, &before);
  assert_reload_equals_cold(m, w1, &before);
  assert_reload_equals_cold(m, w0, &before); /* and back: nothing of W1 stays behind */
  /* The reloaded model still agrees with the reference on W0. */
  qkeep_model *r = load(false, w0);
  ck_assert_int_gt(check_model(m, r, false, "after reload"), 0);
  qkeep_model_free(r);
  tu_release_snapshot(&before);
  qkeep_model_free(m);
  free(w0);
  free(w1);
}
END_TEST

/* bf16 activations and outputs: the f32 kernel's result on the bf16-rounded input, rounded to bf16. */
START_TEST(bf16_activations) {
  char *path = checkpoint(&even, &variants[1], 1);
  qkeep_model *m = load(true, path);
  qkeep_layer *layer = qkeep_model_find_layer(m, "model.layers.0.mlp.down_proj");
  struct qkeep_layer_info info = {.size = sizeof info};
  ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
  const struct qkeep_backend *be = qkeep_plugin_backend(zt);
  int64_t rows = 3;
  float *x = malloc((size_t)(rows * info.k) * 4), *y = malloc((size_t)(rows * info.n) * 4);
  uint16_t *xb = malloc((size_t)(rows * info.k) * 2), *yb = malloc((size_t)(rows * info.n) * 2);
  uint64_t s = 5;
  for (int64_t i = 0; i < rows * info.k; i++) {
    xb[i] = qk_f32_to_bf16(tu_randf(&s));
    x[i] = qk_bf16_to_f32(xb[i]);
  }
  for (int md = 0; md < 2; md++) {
    ck_assert_int_eq(set_key("mode", modes[md]), 0);
    ck_assert_int_eq(qkeep_layer_apply_f32(layer, rows, x, y), 0);
    struct qkeep_apply_args a = {.size = sizeof a,
                                 .m = rows,
                                 .x = xb,
                                 .x_dtype = QKEEP_DTYPE_BF16,
                                 .y = yb,
                                 .y_dtype = QKEEP_DTYPE_BF16};
    ck_assert_msg(be->apply(be, layer, &a) == 0, "%s", qkeep_errmsg());
    for (int64_t i = 0; i < rows * info.n; i++)
      ck_assert_uint_eq(yb[i], qk_f32_to_bf16(y[i]));
  }
  ck_assert_int_eq(set_key("mode", "w4a16"), 0);
  free(x), free(y), free(xb), free(yb);
  qkeep_model_free(m);
  free(path);
}
END_TEST

START_TEST(config_keys_and_refusals) {
  ck_assert_int_eq(set_key("mode", "w4a8"), QKEEP_E_CONFIG);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "w4a16 or da8w4"));
  tu_assert_int_key(qkeep_plugin_backend(zt), "threads", 1, 4096);
  ck_assert_int_eq(set_key("threads", "2"), 0);
  ck_assert_int_eq(set_key("isa", "sse2"), QKEEP_E_CONFIG);
  ck_assert_int_eq(set_key("isa", "avx2"), 0);
  ck_assert_int_eq(set_key("isa", "auto"), 0);
  ck_assert_int_eq(set_key("tile", "4"), QKEEP_E_CONFIG);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "unknown key 'tile'"));
  const struct qkeep_backend *be = qkeep_plugin_backend(zt);
  ck_assert_uint_eq(be->abi_minor, 0);
  char msg[256];
  ck_assert_int_eq(qkeep_plugin_probe(zt, msg, sizeof msg), 0);
  static const struct {
    const char *scheme;
    enum qkeep_layer_kind kind;
    int64_t group;
    int verdict;
  } cases[] = {
      {"gptq-int4", QKEEP_LAYER_LINEAR, 32, 1},     {"awq-int4", QKEEP_LAYER_MOE, 32, 1},
      {"gptq-int4", QKEEP_LAYER_LINEAR, 0, 1},      {"gptq-int4", QKEEP_LAYER_LINEAR, 4, 0},
      {"unquantized", QKEEP_LAYER_LINEAR, 0, 0},    {"w8a8-int8", QKEEP_LAYER_LINEAR, 0, 0},
      {"unquantized", QKEEP_LAYER_EMBEDDING, 0, 0}, {"unquantized", QKEEP_LAYER_OTHER, 0, 0},
      {"kv-scales", QKEEP_LAYER_KV_SCALES, 0, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    struct qkeep_layer_info info = {.size = sizeof info,
                                    .name = "l",
                                    .scheme = cases[i].scheme,
                                    .kind = cases[i].kind,
                                    .n = 64,
                                    .k = 64,
                                    .experts = 2,
                                    .group_size = cases[i].group,
                                    .shards = 1,
                                    .weight_dtype = -1};
    char reason[256] = "";
    ck_assert_int_eq(be->supports_layer(be, &info, reason, sizeof reason), cases[i].verdict);
    ck_assert_msg(cases[i].verdict || reason[0], "case %zu refused without a reason", i);
  }
}
END_TEST

/* The chain on checkpoints written by the `qkeep quantize` command: int4 layers on cpu-zentorch, the rest
 * on the reference; census clean; every GEMM within the forward check of both modes. */
static int within(void *user, const struct qkeep_layer_error *e) {
  double bound = *(const double *)user;
  ck_assert_msg(e->max_rel <= bound, "%s: relative error %g", e->layer, e->max_rel);
  return 0;
}

START_TEST(chain_on_checkpoints_from_the_cli) {
  static const char *const args[] = {"--scheme gptq-int4", "--scheme gptq-int4 --asym",
                                     "--scheme awq-int4",  "--scheme awq-int4 --asym --group 64",
                                     "--scheme ct-int4",   "--scheme ct-int4 --asym"};
  char *ini = tu_path(dir, "chain.ini");
  char text[512];
  snprintf(text, sizeof text,
           "[qkeep]\nbackend = cpu-zentorch, reference\nplugin_dir = %s/plugins/cpu/.libs\n"
           "[backend.cpu-zentorch]\nmode = da8w4\nthreads = 2\n",
           tu_builddir());
  ck_assert_int_eq(tu_write_file(ini, text, strlen(text)), 0);
  for (size_t i = 0; i < sizeof args / sizeof args[0]; i++) {
    char out[64], cmd[1024];
    snprintf(out, sizeof out, "cli-%zu", i);
    char *path = tu_path(dir, out);
    snprintf(cmd, sizeof cmd, "%s/cli/qkeep quantize %s/examples/tiny/model.safetensors %s %s >/dev/null",
             tu_builddir(), tu_builddir(), path, args[i]);
    ck_assert_msg(system(cmd) == 0, "%s", cmd);
    qkeep_config *cfg;
    ck_assert_msg(qkeep_config_load(ini, &cfg) == 0, "%s", qkeep_errmsg());
    qkeep_plugin **plugins;
    size_t n;
    ck_assert_msg(qkeep_plugins_open_config(cfg, &plugins, &n) == 0, "%s", qkeep_errmsg());
    ck_assert_uint_eq(n, 2);
    qkeep_model *m, *r = load(false, path);
    ck_assert_int_eq(qkeep_model_new_chain(plugins, n, &m), 0);
    ck_assert_msg(qkeep_model_load(m, path) == 0, "%s", qkeep_errmsg());
    tu_assert_census_clean(m);
    int int4 = 0;
    for (size_t l = 0; l < qkeep_model_layer_count(m); l++) {
      qkeep_layer *layer = qkeep_model_layer(m, l);
      struct qkeep_layer_info info = {.size = sizeof info};
      ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
      bool mine = strcmp(info.scheme, "unquantized") != 0 &&
                  (info.kind == QKEEP_LAYER_LINEAR || info.kind == QKEEP_LAYER_MOE);
      ck_assert_str_eq(qkeep_layer_backend(layer), mine ? "cpu-zentorch" : "reference");
      int4 += mine;
    }
    ck_assert_int_gt(int4, 0);
    double bound = 0.02; /* da8w4: int8 activations against f32 ones */
    ck_assert_int_eq(qkeep_compare(m, r, 4, 3, within, &bound), 0);
    qkeep_model_free(m);
    qkeep_model_free(r);
    qkeep_plugins_close(plugins, n);
    qkeep_config_free(cfg);
    free(path);
  }
  free(ini);
}
END_TEST

/* Act order that is not a permutation of whole groups is refused with the tensor named. */
START_TEST(bad_act_order_is_refused) {
  int32_t g_idx[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1}, perm[16];
  int64_t bad = -1;
  ck_assert_int_eq(zt_act_order_perm(g_idx, 16, 2, perm, &bad), -1);
  ck_assert_int_eq(bad, 0);
  g_idx[0] = 2;
  ck_assert_int_eq(zt_act_order_perm(g_idx, 16, 2, perm, &bad), -1);
  ck_assert_int_eq(bad, 0);
  for (int i = 0; i < 16; i++)
    g_idx[i] = (i * 7) % 16 / 8;
  ck_assert_int_eq(zt_act_order_perm(g_idx, 16, 2, perm, &bad), 0);
  for (int i = 1; i < 16; i++)
    ck_assert(g_idx[perm[i - 1]] < g_idx[perm[i]] ||
              (g_idx[perm[i - 1]] == g_idx[perm[i]] && perm[i - 1] < perm[i]));
}
END_TEST

static Suite *zentorch_suite(void) {
  Suite *s = suite_create("zentorch");
  TCase *tc = tcase_create("zentorch");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 300);
  tcase_add_loop_test(tc, every_variant_mode_and_isa_odd_dims, 0, N_VARIANTS);
  tcase_add_loop_test(tc, every_variant_mode_and_isa_dims_of_64, 0, N_VARIANTS);
  tcase_add_loop_test(tc, every_row_count_gives_each_row_its_product_alone, 0, 4);
  tcase_add_loop_test(tc, reload_in_place_equals_a_cold_start, 0, N_VARIANTS);
  tcase_add_test(tc, bf16_activations);
  tcase_add_test(tc, config_keys_and_refusals);
  tcase_add_test(tc, chain_on_checkpoints_from_the_cli);
  tcase_add_test(tc, bad_act_order_is_refused);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  /* Before the plugin loads libgomp: idle OpenMP workers sleep instead of spinning, which on a
   * shared machine with few cores would starve the other test threads. */
  setenv("OMP_WAIT_POLICY", "passive", 0);
  return tu_run_suite(zentorch_suite(), CK_NORMAL);
}
