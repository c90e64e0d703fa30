/*
 * reference.c: the `reference` backend. Portable C, every scheme qkeep reads;
 * its PWAL leaves params exactly as loaded (under the rules), and apply
 * dequantises each scheme exactly as docs/FORMATS.md specifies, to f32,
 * and multiplies with double accumulation. MoE layers apply one expert's w13
 * or w2 at a time. It is the
 * oracle the other backends are tested against, so it favours clarity over
 * speed.
 *
 * Activations: by default the reference multiplies with the f32 activations it is given,
 * whatever the scheme. With `activations = int8` (or `int8-7bit`) it first quantises each
 * row of a w8a8-int8 layer's activations exactly as a W8A8 kernel with 255 (127) levels
 * does, and multiplies with the dequantised codes, so that a forward check can tell an int8
 * pipeline from a float one (docs/SCHEMES.md states the recipe and the tolerance).
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qkeep/qkeep_backend.h"
#include "qkeep/qkeep_backend_util.h"

/* How a w8a8-int8 layer's activations enter the GEMM. */
enum act_mode { ACT_FLOAT, ACT_INT8, ACT_INT8_7BIT };

struct reference {
  struct qkeep_backend be; /* first, so the core's pointer is ours */
  const struct qkeep_host *host;
  enum act_mode activations;
};

static const struct qkeep_host *host_of(const struct qkeep_backend *be) {
  return ((const struct reference *)be)->host;
}

static int reference_probe(const struct qkeep_backend *be, char *msg, size_t msg_len) {
  (void)be;
  if (msg_len)
    strncpy(msg, "portable C on the host CPU", msg_len - 1), msg[msg_len - 1] = 0;
  return 0;
}

static const struct qkeep_backend_key reference_keys[] = {
    {"activations", QKEEP_KEY_ENUM, "float|int8|int8-7bit", "float",
     "w8a8-int8 layers: multiply f32 activations, or quantise them per row as an int8 kernel with 255 "
     "(int8) or 127 (int8-7bit) levels does"},
};

/* The core checked the key and that the value is one of reference_keys' values. */
static int reference_configure(const struct qkeep_backend *be, const char *key, const char *value) {
  struct reference *r = (struct reference *)(void *)(uintptr_t)be;
  if (strcmp(key, "activations") != 0)
    return r->host->set_error(QKEEP_E_CONFIG, "unknown key '%s' (the reference takes activations)", key);
  r->activations = strcmp(value, "int8") == 0        ? ACT_INT8
                   : strcmp(value, "int8-7bit") == 0 ? ACT_INT8_7BIT
                                                     : ACT_FLOAT;
  return 0;
}

static const char *const schemes[] = {"unquantized", "modelopt-nvfp4", "ct-nvfp4", "mxfp4",
                                      "w8a8-int8",   "gptq-int4",      "awq-int4", "ct-int4"};

static int reference_supports(const struct qkeep_backend *be, const char *scheme,
                              enum qkeep_layer_kind kind) {
  (void)be;
  (void)kind;
  for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++)
    if (strcmp(scheme, schemes[i]) == 0)
      return 1;
  return 0;
}

/* Every layer of every scheme: the end of any chain. */
static int reference_supports_layer(const struct qkeep_backend *be, const struct qkeep_layer_info *info,
                                    char *reason, size_t reason_len) {
  if ((info->kind != QKEEP_LAYER_LINEAR && info->kind != QKEEP_LAYER_MOE) ||
      reference_supports(be, info->scheme, info->kind))
    return 1;
  snprintf(reason, reason_len, "scheme %s is not one of its schemes", info->scheme);
  return 0;
}

/* The reference kernel reads the checkpoint layout, so PWAL changes nothing. */
static int reference_pwal(const struct qkeep_backend *be, qkeep_layer *layer) {
  (void)be;
  (void)layer;
  return 0;
}

/* One matrix to multiply with: rows x cols, expert `expert` of a stacked param, names prefixed. */
struct matrix {
  const struct qkeep_host *host;
  qkeep_layer *layer;
  const struct qkeep_layer_info *info;
  const char *prefix; /* "", "w13_" or "w2_" */
  int64_t rows, cols, expert;
};

/* The live param `name` (prefixed); *data points at this expert's slice of `slice_bytes`. */
static int slice(const struct matrix *m, const char *name, size_t slice_bytes, struct qkeep_view *v,
                 const unsigned char **data) {
  char full[64];
  snprintf(full, sizeof full, "%s%s", m->prefix, name);
  v->size = sizeof *v;
  int rc = m->host->get_live(m->layer, full, v);
  if (rc)
    return rc;
  size_t offset = (size_t)m->expert * slice_bytes;
  if (offset + slice_bytes > v->nbytes)
    return m->host->set_error(QKEEP_E_FORMAT, "%s.%s: %zu bytes, expected %zu per expert", m->info->name,
                              full, v->nbytes, slice_bytes);
  *data = (const unsigned char *)v->data + offset;
  return 0;
}

/* A scalar f32 global scale: [] or [1] for a linear layer, element `expert` of [E] for MoE. */
static int global_scale(const struct matrix *m, const char *name, float *out) {
  struct qkeep_view v;
  const unsigned char *p;
  int rc = slice(m, name, sizeof(float), &v, &p);
  if (!rc && v.nbytes != sizeof(float) * (size_t)(m->info->experts ? m->info->experts : 1))
    rc = m->host->set_error(QKEEP_E_FORMAT, "%s.%s%s: expected one merged scale (per expert)", m->info->name,
                            m->prefix, name);
  if (!rc)
    memcpy(out, p, sizeof *out);
  return rc;
}

/* out[k] = the e2m1 code k of row times scale, for k0 <= k < end (k0 even): two codes a byte. */
static void decode_fp4(const unsigned char *row, int64_t k0, int64_t end, float scale, float *out) {
  int64_t k = k0;
  for (; k + 1 < end; k += 2) {
    unsigned char b = row[k >> 1];
    out[k] = qkeep_e2m1_to_f32(b & 0xf) * scale;
    out[k + 1] = qkeep_e2m1_to_f32(b >> 4) * scale;
  }
  if (k < end)
    out[k] = qkeep_e2m1_to_f32(qkeep_fp4_code(row, k)) * scale;
}

static int dequant_nvfp4(const struct matrix *m, float *w, bool ct) {
  struct qkeep_view wv, sv;
  const unsigned char *packed, *scales;
  float global;
  int rc = slice(m, "weight", (size_t)(m->rows * m->cols / 2), &wv, &packed);
  if (!rc)
    rc = slice(m, "weight_scale", (size_t)(m->rows * m->cols / 16), &sv, &scales);
  if (!rc)
    rc = global_scale(m, ct ? "weight_global_scale" : "weight_scale_2", &global);
  if (rc)
    return rc;
  /* compressed-tensors stores the encode factor; an all-zero tensor stores 0 and decodes to 0. */
  float decode = ct ? (global == 0.0f ? 0.0f : 1.0f / global) : global;
  for (int64_t r = 0; r < m->rows; r++)
    for (int64_t k0 = 0; k0 < m->cols; k0 += 16) {
      float scale = qkeep_e4m3_to_f32(scales[r * m->cols / 16 + k0 / 16]) * decode;
      decode_fp4(packed + r * m->cols / 2, k0, k0 + 16 < m->cols ? k0 + 16 : m->cols, scale, w + r * m->cols);
    }
  return 0;
}

static int dequant_mxfp4(const struct matrix *m, float *w) {
  struct qkeep_view wv, sv;
  const unsigned char *packed, *scales;
  int rc = slice(m, "weight", (size_t)(m->rows * m->cols / 2), &wv, &packed);
  if (!rc)
    rc = slice(m, "weight_scale", (size_t)(m->rows * m->cols / 32), &sv, &scales);
  if (rc)
    return rc;
  for (int64_t r = 0; r < m->rows; r++)
    for (int64_t k0 = 0; k0 < m->cols; k0 += 32) {
      float scale = qkeep_e8m0_to_f32(scales[r * m->cols / 32 + k0 / 32]);
      decode_fp4(packed + r * m->cols / 2, k0, k0 + 32 < m->cols ? k0 + 32 : m->cols, scale, w + r * m->cols);
    }
  return 0;
}

static int dequant_int8(const struct matrix *m, float *w) {
  struct qkeep_view wv, sv;
  const unsigned char *q, *s;
  int rc = slice(m, "weight", (size_t)(m->rows * m->cols), &wv, &q);
  if (rc)
    return rc;
  /* The scales of this expert: per channel [N, 1], or one per fused shard ([S], [] or [1]). */
  char name[64];
  snprintf(name, sizeof name, "%sweight_scale", m->prefix);
  sv.size = sizeof sv;
  if ((rc = m->host->get_live(m->layer, name, &sv)))
    return rc;
  size_t esize = qkeep_be_dtype_size(sv.spec.dtype);
  size_t n_scales = sv.nbytes / esize / (size_t)(m->info->experts ? m->info->experts : 1);
  if ((rc = slice(m, "weight_scale", n_scales * esize, &sv, &s)))
    return rc;
  int shard = 0;
  int64_t shard_end = m->info->shard_n[0];
  for (int64_t r = 0; r < m->rows; r++) {
    while (r >= shard_end && shard + 1 < m->info->shards)
      shard_end += m->info->shard_n[++shard];
    /* Per channel [N, 1]; per tensor one per fused shard [S], or [] / [1]. */
    size_t idx = n_scales == (size_t)m->rows ? (size_t)r : n_scales > 1 ? (size_t)shard : 0;
    float scale = qkeep_load_float(s, sv.spec.dtype, idx);
    for (int64_t k = 0; k < m->cols; k++)
      w[r * m->cols + k] = (float)(int8_t)q[r * m->cols + k] * scale;
  }
  return 0;
}

/* GPTQ ([K/8, N] words) and AWQ ([K, N/8] words): w[n][k] = (q - zero) * scale. */
static int dequant_int4(const struct matrix *m, float *w, bool awq) {
  int64_t n_cols = m->rows, k_rows = m->cols, g = m->info->group_size ? m->info->group_size : k_rows;
  struct qkeep_view qv, sv, zv = {.size = sizeof zv}, gv = {.size = sizeof gv};
  const unsigned char *qw, *sc;
  int rc = slice(m, "qweight", (size_t)(k_rows * n_cols / 2), &qv, &qw);
  if (!rc)
    rc = slice(m, "scales", (size_t)(k_rows / g * n_cols * 2), &sv, &sc);
  if (rc)
    return rc;
  bool sym = m->info->flags & QKEEP_LAYER_F_WEIGHT_SYM, v2 = m->info->flags & QKEEP_LAYER_F_GPTQ_V2;
  const unsigned char *zp = NULL, *gp = NULL;
  /* Symmetric zero points and a trivial g_idx are retired: no kernel reads them. */
  if (!sym && (rc = slice(m, "qzeros", (size_t)(k_rows / g * n_cols / 8) * 4, &zv, &zp)))
    return rc;
  if (!awq && (m->info->flags & QKEEP_LAYER_F_ACT_ORDER) &&
      (rc = slice(m, "g_idx", (size_t)k_rows * 4, &gv, &gp)))
    return rc;
  const int32_t *zeros = (const int32_t *)zp, *g_idx = (const int32_t *)gp;
  const int32_t *words = (const int32_t *)qw;
  for (int64_t n = 0; n < n_cols; n++) {
    int64_t last = -1; /* the group whose zero and scale are at hand */
    int zero = 0;
    float scale = 0;
    for (int64_t k = 0; k < k_rows; k++) {
      int64_t group = g_idx ? g_idx[k] : k / g;
      if (group != last) {
        if (awq)
          zero = sym ? 8
                     : qkeep_int4_nibble(zeros[group * (n_cols / 8) + n / 8], qkeep_awq_nibble((int)(n % 8)));
        else
          zero = sym ? 8 : qkeep_gptq_zero(zeros, n_cols, group, n, v2);
        scale = qkeep_load_float(sc, sv.spec.dtype, (size_t)(group * n_cols + n));
        last = group;
      }
      int q = awq ? qkeep_int4_nibble(words[k * (n_cols / 8) + n / 8], qkeep_awq_nibble((int)(n % 8)))
                  : qkeep_int4_nibble(words[(k / 8) * n_cols + n], (int)(k % 8));
      w[n * k_rows + k] = (float)(q - zero) * scale;
    }
  }
  return 0;
}

/*
 * compressed-tensors pack-quantized int4: weight_packed [N, K/8] (code of k at bits 4 (k % 8) of
 * word k / 8, stored + 8), weight_scale [N, K/G] (any float dtype), weight_zero_point [N/8, K/G]
 * packed along N when asymmetric, weight_g_idx [K] under act order: w = (code - zero) * scale.
 */
static int dequant_ct_int4(const struct matrix *m, float *w) {
  int64_t n_rows = m->rows, k_cols = m->cols, g = m->info->group_size ? m->info->group_size : k_cols;
  int64_t groups = k_cols / g;
  struct qkeep_view pv, sv = {.size = sizeof sv}, zv = {.size = sizeof zv}, gv = {.size = sizeof gv};
  const unsigned char *packed, *sc, *zp = NULL, *gp = NULL;
  char name[64];
  snprintf(name, sizeof name, "%sweight_scale", m->prefix);
  int rc = slice(m, "weight_packed", (size_t)(n_rows * k_cols / 2), &pv, &packed);
  if (!rc)
    rc = m->host->get_live(m->layer, name, &sv);
  if (!rc)
    rc = slice(m, "weight_scale", (size_t)(n_rows * groups) * qkeep_be_dtype_size(sv.spec.dtype), &sv, &sc);
  bool sym = m->info->flags & QKEEP_LAYER_F_WEIGHT_SYM;
  if (!rc && !sym)
    rc = slice(m, "weight_zero_point", (size_t)(n_rows / 8 * groups) * 4, &zv, &zp);
  if (!rc && (m->info->flags & QKEEP_LAYER_F_ACT_ORDER))
    rc = slice(m, "weight_g_idx", (size_t)k_cols * 4, &gv, &gp);
  if (rc)
    return rc;
  const int32_t *words = (const int32_t *)packed, *zeros = (const int32_t *)zp, *g_idx = (const int32_t *)gp;
  for (int64_t n = 0; n < n_rows; n++) {
    int64_t last = -1; /* the group whose zero and scale are at hand */
    int zero = 0;
    float scale = 0;
    for (int64_t k = 0; k < k_cols; k++) {
      int64_t group = g_idx ? g_idx[k] : k / g;
      if (group != last) {
        if (group < 0 || group >= groups)
          return m->host->set_error(
              QKEEP_E_FORMAT, "%s.%sweight_g_idx[%lld] = %lld: not a group (%lld groups)", m->info->name,
              m->prefix, (long long)k, (long long)group, (long long)groups);
        zero = sym ? 8 : qkeep_int4_nibble(zeros[(n / 8) * groups + group], (int)(n % 8));
        scale = qkeep_load_float(sc, sv.spec.dtype, (size_t)(n * groups + group));
        last = group;
      }
      int q = qkeep_int4_nibble(words[n * (k_cols / 8) + k / 8], (int)(k % 8));
      w[n * k_cols + k] = (float)(q - zero) * scale;
    }
  }
  return 0;
}

static int dequant_float(const struct matrix *m, float *w) {
  struct qkeep_view wv;
  const unsigned char *p;
  char full[64];
  snprintf(full, sizeof full, "%sweight", m->prefix);
  wv.size = sizeof wv;
  int rc = m->host->get_live(m->layer, full, &wv);
  if (rc)
    return rc;
  size_t esize = qkeep_be_dtype_size(wv.spec.dtype);
  if ((rc = slice(m, "weight", (size_t)(m->rows * m->cols) * esize, &wv, &p)))
    return rc;
  for (int64_t i = 0; i < m->rows * m->cols; i++)
    w[i] = qkeep_load_float(p, wv.spec.dtype, (size_t)i);
  return 0;
}

/* Dequantises one matrix [rows, cols] of the layer into w as its scheme specifies. */
static int dequantise(const struct matrix *m, float *w) {
  const char *s = m->info->scheme;
  if (strcmp(s, "unquantized") == 0)
    return dequant_float(m, w);
  if (strcmp(s, "modelopt-nvfp4") == 0 || strcmp(s, "ct-nvfp4") == 0)
    return dequant_nvfp4(m, w, s[0] == 'c');
  if (strcmp(s, "mxfp4") == 0)
    return dequant_mxfp4(m, w);
  if (strcmp(s, "w8a8-int8") == 0)
    return dequant_int8(m, w);
  if (strcmp(s, "gptq-int4") == 0 || strcmp(s, "awq-int4") == 0)
    return dequant_int4(m, w, s[0] == 'a');
  if (strcmp(s, "ct-int4") == 0)
    return dequant_ct_int4(m, w);
  return m->host->set_error(QKEEP_E_UNSUPPORTED, "%s: the reference has no kernel for scheme %s",
                            m->info->name, s);
}

/* Round half to even in f32 (the default rounding mode). */
static float round_even(float v) { return nearbyintf(v); }

/* Element `index` of a zero point of any integer or float dtype, as a float. */
static float zero_point_at(const struct qkeep_view *v, const unsigned char *p) {
  switch (v->spec.dtype) {
  case QKEEP_DTYPE_I32: {
    int32_t z;
    memcpy(&z, p, sizeof z);
    return (float)z;
  }
  case QKEEP_DTYPE_I8: return (float)(int8_t)p[0];
  default: return qkeep_load_float(p, v->spec.dtype, 0);
  }
}

/*
 * Replaces each of the m rows of x (cols wide) by its int8 quantisation, dequantised: the
 * recipe of a W8A8 kernel with L = 255 levels (127 with ACT_INT8_7BIT), x ~ a * (u - zp):
 *   dynamic symmetric:  h = (L - 1) / 2, a = max|x| / h, zp = h + 1;
 *   dynamic asymmetric: [lo, hi] = the row's range widened to hold 0, a = (hi - lo) / L,
 *                       zp = rne(-lo / a);
 *   static:             a = input_scale, zp = 128 + input_zero_point (no zero point: 128);
 *                       7 bits: a = 2 * input_scale, zp = rne((128 + input_zero_point) / 2);
 * then u = clamp(rne(x * (1 / a) + zp), 0, L), the product and the sum each rounded to f32,
 * NaN to 0. A zero scale (an all-zero row) gives u = zp: the row contributes nothing.
 */
static int quantize_activations(const struct matrix *m, enum act_mode mode, float *x, int64_t rows) {
  const float levels = mode == ACT_INT8 ? 255.0f : 127.0f;
  bool dynamic = m->info->flags & QKEEP_LAYER_F_INPUT_DYNAMIC,
       asym = m->info->flags & QKEEP_LAYER_F_INPUT_ASYM;
  float a = 0, zp = 0;
  if (!dynamic) {
    struct qkeep_view sv = {.size = sizeof sv}, zv;
    const unsigned char *sp, *zptr;
    char scale_name[64];
    snprintf(scale_name, sizeof scale_name, "%sinput_scale", m->prefix);
    /* F32, or compressed-tensors' BF16 / F16 (one per expert once the scheme merged the shards) */
    int rc = m->host->get_live(m->layer, scale_name, &sv);
    if (!rc)
      rc = slice(m, "input_scale", qkeep_be_dtype_size(sv.spec.dtype), &sv, &sp);
    if (rc)
      return rc;
    float z = 128.0f;
    if (asym) {
      char name[64];
      snprintf(name, sizeof name, "%sinput_zero_point", m->prefix);
      struct qkeep_view probe = {.size = sizeof probe};
      if ((rc = m->host->get_live(m->layer, name, &probe)))
        return rc;
      if ((rc = slice(m, "input_zero_point", qkeep_be_dtype_size(probe.spec.dtype), &zv, &zptr)))
        return rc;
      z += zero_point_at(&zv, zptr);
    }
    float scale = qkeep_load_float(sp, sv.spec.dtype, 0);
    a = mode == ACT_INT8 ? scale : 2.0f * scale;
    zp = mode == ACT_INT8 ? z : round_even(z * 0.5f);
  }
  for (int64_t r = 0; r < rows; r++) {
    float *row = x + r * m->cols;
    if (dynamic) {
      float lo = 0, hi = 0;
      for (int64_t k = 0; k < m->cols; k++) {
        lo = row[k] < lo ? row[k] : lo;
        hi = row[k] > hi ? row[k] : hi;
      }
      if (!asym) {
        float h = (levels - 1.0f) * 0.5f;
        a = (-lo > hi ? -lo : hi) / h;
        zp = h + 1.0f;
      } else {
        a = (hi - lo) / levels;
        zp = a > 0.0f ? round_even(-lo / a) : 0.0f;
      }
    }
    float inv = a > 0.0f ? 1.0f / a : 0.0f;
    for (int64_t k = 0; k < m->cols; k++) {
      float t = row[k] * inv;
      t = t + zp;
      t = t > 0.0f ? t : 0.0f; /* NaN to 0 too */
      t = t < levels ? t : levels;
      row[k] = a * (round_even(t) - zp);
    }
  }
  return 0;
}

/* What the f32 kernel of one apply needs besides its arguments. */
struct ref_call {
  const struct qkeep_backend *be;
  qkeep_layer *layer;
  const struct qkeep_layer_info *info;
};

/* Rows of w summed side by side: a panel [cols][PANEL] of them, transposed. */
#define PANEL 8

/* y[r, n0 + j] for j < lanes from the panel: the sums of x's row r with each panel row, from first[j]. */
static void multiply_panel(const float *restrict x, int64_t cols, const float *restrict panel,
                           const double *first, int lanes, float *y) {
  double a0 = first[0], a1 = first[1], a2 = first[2], a3 = first[3], a4 = first[4], a5 = first[5],
         a6 = first[6], a7 = first[7];
  for (int64_t k = 0; k < cols; k++, panel += PANEL) {
    double xk = x[k];
    a0 += xk * (double)panel[0], a1 += xk * (double)panel[1], a2 += xk * (double)panel[2];
    a3 += xk * (double)panel[3], a4 += xk * (double)panel[4], a5 += xk * (double)panel[5];
    a6 += xk * (double)panel[6], a7 += xk * (double)panel[7];
  }
  const double sums[PANEL] = {a0, a1, a2, a3, a4, a5, a6, a7};
  for (int j = 0; j < lanes; j++)
    y[j] = (float)sums[j];
}

/*
 * y[r, n] = bias[n] + sum over k of x[r, k] * w[n, k] (w: [rows, cols]; bias NULL for none), each
 * sum in double in the order of k: a product of two floats is exact in double, so the sums are
 * the only roundings, and the result is that of one accumulator per output, FMA or not. Eight
 * rows of w are summed at once from a transposed panel, independent sums the compiler keeps in
 * vector registers: the oracle then costs a few instructions a product, under valgrind and the
 * sanitizers too.
 */
static int multiply(const struct matrix *m, const float *x, int64_t rows_m, const float *w,
                    const unsigned char *bias, enum qkeep_dtype bias_dtype, float *y) {
  float *panel = malloc((size_t)m->cols * PANEL * sizeof *panel + 1);
  if (!panel)
    return m->host->set_error(QKEEP_E_NOMEM, "%s: out of memory multiplying", m->info->name);
  for (int64_t n0 = 0; n0 < m->rows; n0 += PANEL) {
    int lanes = m->rows - n0 < PANEL ? (int)(m->rows - n0) : PANEL;
    double first[PANEL] = {0};
    for (int j = 0; j < lanes; j++) {
      const float *row = w + (n0 + j) * m->cols;
      for (int64_t k = 0; k < m->cols; k++)
        panel[k * PANEL + j] = row[k];
      if (bias)
        first[j] = qkeep_load_float(bias, bias_dtype, (size_t)(n0 + j));
    }
    for (int j = lanes; j < PANEL; j++)
      for (int64_t k = 0; k < m->cols; k++)
        panel[k * PANEL + j] = 0.0f;
    for (int64_t r = 0; r < rows_m; r++)
      multiply_panel(x + r * m->cols, m->cols, panel, first, lanes, y + r * m->rows + n0);
  }
  free(panel);
  return 0;
}

/* y[m, rows] = x[m, cols] W^T in f32 for the linear matrix or one expert's (qkeep_be_f32_kernel). */
static int reference_kernel(void *user, int32_t expert, enum qkeep_moe_matrix matrix, int64_t rows_m,
                            const float *x_in, float *y) {
  const struct ref_call *call = user;
  const struct qkeep_host *host = host_of(call->be);
  const struct qkeep_layer_info *info = call->info;
  qkeep_layer *layer = call->layer;
  bool moe = info->kind == QKEEP_LAYER_MOE, w2 = moe && matrix == QKEEP_MOE_W2;
  struct matrix m = {host,
                     layer,
                     info,
                     moe ? (w2 ? "w2_" : "w13_") : "",
                     w2 ? info->k : info->n,
                     w2 ? info->n / 2 : info->k,
                     moe ? expert : 0};
  enum act_mode mode = ((const struct reference *)call->be)->activations;
  bool quantize = mode != ACT_FLOAT && strcmp(info->scheme, "w8a8-int8") == 0;
  float *w = malloc((size_t)(m.rows * m.cols) * sizeof *w);
  float *xq = quantize ? malloc((size_t)(rows_m * m.cols) * sizeof *xq + 1) : NULL;
  if (!w || (quantize && !xq)) {
    free(w);
    return host->set_error(QKEEP_E_NOMEM, "%s: out of memory dequantising", info->name);
  }
  int rc = dequantise(&m, w);
  if (!rc && quantize) {
    memcpy(xq, x_in, (size_t)(rows_m * m.cols) * sizeof *xq);
    rc = quantize_activations(&m, mode, xq, rows_m);
  }
  struct qkeep_view bias = {.size = sizeof bias};
  const unsigned char *bias_data = NULL;
  char bias_name[64];
  snprintf(bias_name, sizeof bias_name, "%sbias", m.prefix);
  if (!rc && host->view(layer, bias_name, &bias) == 0 && bias.state == QKEEP_PARAM_LIVE)
    bias_data = (const unsigned char *)bias.data +
                (size_t)m.expert * (size_t)m.rows * qkeep_be_dtype_size(bias.spec.dtype);
  if (!rc)
    rc = multiply(&m, quantize ? xq : x_in, rows_m, w, bias_data, bias.spec.dtype, y);
  free(w);
  free(xq);
  return rc;
}

static int reference_workspace(const struct qkeep_backend *be, qkeep_layer *layer,
                               const struct qkeep_apply_args *a, size_t *bytes) {
  struct qkeep_layer_info info = {.size = sizeof info};
  int rc = host_of(be)->layer_info(layer, &info);
  if (!rc)
    *bytes = qkeep_be_f32_workspace(a, qkeep_be_dims(&info, a));
  return rc;
}

/* Any activation dtype and routed MoE through the f32 kernel (qkeep_be_f32_apply). Not graph-safe:
 * the reference dequantises the weight on every call, into memory it allocates. */
static int reference_apply(const struct qkeep_backend *be, qkeep_layer *layer,
                           const struct qkeep_apply_args *a) {
  const struct qkeep_host *host = host_of(be);
  struct qkeep_layer_info info = {.size = sizeof info};
  int rc = host->layer_info(layer, &info);
  if (rc)
    return rc;
  struct ref_call call = {be, layer, &info};
  return qkeep_be_f32_apply(host, &info, a, reference_kernel, &call);
}

static int reference_device(const struct qkeep_backend *be, enum qkeep_device_type *type, int *index) {
  (void)be;
  *type = QKEEP_DEVICE_HOST, *index = 0;
  return 0;
}

static void reference_fini(const struct qkeep_backend *be) { free((void *)be); }

QKEEP_BACKEND_EXPORT int qkeep_backend_init(const struct qkeep_host *host, const struct qkeep_backend **out) {
  if (!host || host->abi_major != QKEEP_BACKEND_ABI_MAJOR)
    return QKEEP_E_ABI;
  struct reference *r = calloc(1, sizeof *r);
  if (!r)
    return host->set_error(QKEEP_E_NOMEM, "reference: out of memory");
  r->host = host;
  r->be = (struct qkeep_backend){
      .size = sizeof(struct qkeep_backend),
      .abi_major = QKEEP_BACKEND_ABI_MAJOR,
      .abi_minor = 0,
      .name = "reference",
      .description = "portable C reference kernels (dequantise + f32 GEMM); the test oracle",
      .probe = reference_probe,
      .configure = reference_configure,
      .memory = NULL,
      .supports = reference_supports,
      .pwal = reference_pwal,
      .apply = reference_apply,
      .layer_cleanup = NULL,
      .fini = reference_fini,
      .supports_layer = reference_supports_layer,
      .keys = reference_keys,
      .n_keys = sizeof reference_keys / sizeof reference_keys[0],
      .key_size = sizeof reference_keys[0],
      .workspace = reference_workspace,
      .device = reference_device,
      .flags = QKEEP_BACKEND_F_ROUTED_MOE,
  };
  *out = &r->be;
  return 0;
}
