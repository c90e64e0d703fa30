/*
 * qkeep_backend_util.h: what a backend needs besides the ABI, installed beside it so that a
 * plugin built out of tree gets the same helpers the in-tree ones use: dtype sizes and spec
 * arithmetic, the element and scale decoders of the checkpoint formats (docs/FORMATS.md),
 * the int4 packing of GPTQ and AWQ, a guard for optional slots of size-prefixed tables, and
 * the check of a configure key's whole-number value.
 *
 * Everything here is static inline and needs no library: a backend never links libqkeep
 * (the core that loads it provides everything else through struct qkeep_host). The core
 * uses these same definitions, so a backend decodes exactly as the core and the reference
 * backend do.
 */
#ifndef QKEEP_BACKEND_UTIL_H
#define QKEEP_BACKEND_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qkeep_backend.h"
#include "qkeep_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * True when the size-prefixed table `table` (any struct whose first member is `size_t
 * size`) of type `type` reaches slot `slot` and the slot is set: a slot past the size the
 * other side was built with is absent. Use it for every slot added after ABI 1.0, e.g.
 * QKEEP_HAS_SLOT(host, struct qkeep_host, some_later_slot).
 */
#define QKEEP_HAS_SLOT(table, type, slot)                                                                    \
  ((table)->size >= offsetof(type, slot) + sizeof(((type *)0)->slot) && (table)->slot)

/* The bytes of one value under a find_bad_values rule (enum qkeep_value_rule, ABI 1.6): 1, 2 or 4; 0 for
 * a rule this header does not know (find_bad_values answers QKEEP_E_INVAL). */
static inline size_t qkeep_be_value_size(int rule) {
  static const size_t sizes[] = {0, 1, 1, 2, 2, 4};
  return rule > 0 && rule <= QKEEP_RULE_F32_FINITE ? sizes[rule] : 0;
}

/* Whether the value at p (qkeep_be_value_size(rule) bytes, little-endian, any alignment) breaks the rule. */
static inline bool qkeep_be_bad_value(const unsigned char *p, int rule) {
  uint32_t v = 0;
  for (size_t b = 0; b < qkeep_be_value_size(rule); b++)
    v |= (uint32_t)p[b] << (8 * b);
  switch (rule) {
  case QKEEP_RULE_E4M3_SCALE: return (v & 0x7f) == 0x7f || v > 0x80; /* NaN, or negative and not -0 */
  case QKEEP_RULE_E8M0_SCALE: return v == 0xff;
  case QKEEP_RULE_BF16_FINITE: return (v & 0x7f80) == 0x7f80;
  case QKEEP_RULE_F16_FINITE: return (v & 0x7c00) == 0x7c00;
  case QKEEP_RULE_F32_FINITE: return (v & 0x7f800000u) == 0x7f800000u;
  default: return false;
  }
}

/*
 * The value of a whole-number key for a backend's configure: `value` a decimal integer
 * (strtol's syntax, nothing after it) from lo to hi goes into *out and 0 is returned; anything
 * else returns QKEEP_E_CONFIG through host->set_error ("threads = 'two': expected a whole number
 * from 1 to 4096"), *out untouched. The core checks declared keys before it calls configure, but
 * a benchmark, a test or an older core calls configure directly: a backend checks again.
 */
static inline int qkeep_be_int_key(const struct qkeep_host *host, const char *key, const char *value, long lo,
                                   long hi, int *out) {
  char *end;
  long v = strtol(value, &end, 10);
  if (end == value || *end || v < lo || v > hi)
    return host->set_error(QKEEP_E_CONFIG, "%s = '%s': expected a whole number from %ld to %ld", key, value,
                           lo, hi);
  *out = (int)v;
  return 0;
}

/* ---- dtypes and specs ---------------------------------------------------------------------- */

/* Bits per element (4 for F4, 6 for F6_*: the sub-byte dtypes of plain checkpoint tensors); 0 when
 * the dtype is not one this header knows. */
static inline unsigned qkeep_be_dtype_bits(enum qkeep_dtype dtype) {
  switch (dtype) {
  case QKEEP_DTYPE_F4: return 4;
  case QKEEP_DTYPE_F6_E2M3:
  case QKEEP_DTYPE_F6_E3M2: return 6;
  case QKEEP_DTYPE_F8_E4M3:
  case QKEEP_DTYPE_F8_E8M0:
  case QKEEP_DTYPE_U8:
  case QKEEP_DTYPE_I8:
  case QKEEP_DTYPE_BOOL:
  case QKEEP_DTYPE_F8_E5M2:
  case QKEEP_DTYPE_F8_E4M3FNUZ:
  case QKEEP_DTYPE_F8_E5M2FNUZ: return 8;
  case QKEEP_DTYPE_F16:
  case QKEEP_DTYPE_BF16:
  case QKEEP_DTYPE_I16:
  case QKEEP_DTYPE_U16: return 16;
  case QKEEP_DTYPE_F32:
  case QKEEP_DTYPE_I32:
  case QKEEP_DTYPE_U32: return 32;
  case QKEEP_DTYPE_I64:
  case QKEEP_DTYPE_U64:
  case QKEEP_DTYPE_F64:
  case QKEEP_DTYPE_C64: return 64;
  default: return 0;
  }
}

/* Bytes per element (the storage element of packed types: a U8 holds two e2m1 codes); 0 when
 * the dtype is not one this header knows or is sub-byte (F4, F6_*: see qkeep_be_dtype_bits). */
static inline size_t qkeep_be_dtype_size(enum qkeep_dtype dtype) {
  unsigned bits = qkeep_be_dtype_bits(dtype);
  return bits % 8 ? 0 : bits / 8;
}

/* Elements of a spec (1 for a rank-0 scalar). */
static inline int64_t qkeep_be_spec_numel(const struct qkeep_spec *spec) {
  int64_t n = 1;
  for (int i = 0; i < spec->ndim; i++)
    n *= spec->shape[i];
  return n;
}

/* Bytes of a spec: numel * bits / 8, rounded up (whole bytes for every shape a checkpoint holds). */
static inline size_t qkeep_be_spec_bytes(const struct qkeep_spec *spec) {
  return ((size_t)qkeep_be_spec_numel(spec) * qkeep_be_dtype_bits(spec->dtype) + 7) / 8;
}

/* Same dtype, rank and shape. */
static inline bool qkeep_be_spec_equal(const struct qkeep_spec *a, const struct qkeep_spec *b) {
  if (a->dtype != b->dtype || a->ndim != b->ndim)
    return false;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i])
      return false;
  return true;
}

/* ---- 16-bit floats ---------------------------------------------------------------------------- */

static inline uint32_t qkeep_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float qkeep_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* bf16 to f32: exact. */
static inline float qkeep_bf16_to_f32(uint16_t b) { return qkeep_bits_f32((uint32_t)b << 16); }

/* f32 to bf16, round to nearest even; NaN stays a quiet NaN. */
static inline uint16_t qkeep_f32_to_bf16(float f) {
  uint32_t u = qkeep_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

/* IEEE half to f32: exact, subnormals and infinities included. */
static inline float qkeep_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f)
    return qkeep_bits_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    /* Subnormal half: value is man * 2^-24, exact in f32. */
    float v = (float)man * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return qkeep_bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* f32 to IEEE half, round to nearest even with subnormals; overflow goes to infinity. */
static inline uint16_t qkeep_f32_to_f16(float f) {
  uint32_t u = qkeep_f32_bits(f), sign = (u >> 16) & 0x8000;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u)
    return (uint16_t)(sign | 0x7e00);
  if (abs >= 0x477ff000u) /* rounds to >= 65520: infinity */
    return (uint16_t)(sign | 0x7c00);
  if (abs < 0x38800000u) {                       /* below the smallest normal half: subnormal or zero */
    float a = qkeep_bits_f32(abs) * 16777216.0f; /* in units of 2^-24 */
    uint32_t q = (uint32_t)a;
    float rem = a - (float)q;
    if (rem > 0.5f || (rem == 0.5f && (q & 1)))
      q++;
    return (uint16_t)(sign | q);
  }
  uint32_t exp = (abs >> 23) - 112, man = abs & 0x7fffff;
  uint32_t h = (exp << 10) | (man >> 13), rest = man & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1)))
    h++;
  return (uint16_t)(sign | h);
}

/* Element i of a float tensor (F32, F16 or BF16) as f32; 0 for any other dtype. */
static inline float qkeep_load_float(const void *data, enum qkeep_dtype dtype, size_t i) {
  uint16_t h;
  switch (dtype) {
  case QKEEP_DTYPE_F32: return ((const float *)data)[i];
  case QKEEP_DTYPE_F16: memcpy(&h, (const char *)data + 2 * i, 2); return qkeep_f16_to_f32(h);
  case QKEEP_DTYPE_BF16: memcpy(&h, (const char *)data + 2 * i, 2); return qkeep_bf16_to_f32(h);
  default: return 0.0f;
  }
}

/* ---- FP4 and FP8 elements and scales ------------------------------------------------------------ */

/*
 *   e2m1 (FP4): 1 sign, 2 exponent, 1 mantissa bit; packed two per byte, element 2i in the low
 *               nibble, 2i+1 in the high nibble.
 *   e4m3 (FP8, OCP "fn"): bias 7, subnormals, max 448, NaN = 0x7f / 0xff, no infinity.
 *   e8m0: an unsigned exponent, value 2^(b-127); 0xff is NaN.
 */

/* The value of a 4-bit e2m1 code (the low 4 bits of `code`). */
static inline float qkeep_e2m1_to_f32(uint8_t code) {
  static const float values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return values[code & 0xf];
}

/* Element k of a row of packed e2m1 codes. */
static inline uint8_t qkeep_fp4_code(const uint8_t *row, int64_t k) {
  uint8_t b = row[k >> 1];
  return (k & 1) ? (uint8_t)(b >> 4) : (uint8_t)(b & 0xf);
}

/* The value of an e4m3fn byte (NaN for 0x7f and 0xff). */
static inline float qkeep_e4m3_to_f32(uint8_t b) {
  int sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 7;
  float v;
  if (exp == 0xf && man == 7)
    return NAN;
  if (exp == 0)
    v = ldexpf((float)man, -9); /* subnormal: man/8 * 2^-6 */
  else
    v = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
  return sign ? -v : v;
}

/* The value of an e8m0 scale byte (NaN for 0xff). */
static inline float qkeep_e8m0_to_f32(uint8_t b) { return b == 0xff ? NAN : ldexpf(1.0f, (int)b - 127); }

/* ---- int4 words (GPTQ, AWQ, compressed-tensors pack-quantized) ---------------------------------- */

/* Nibble `j` (0..7) of a packed int4 word: bits 4j..4j+3. */
static inline int qkeep_int4_nibble(int32_t word, int j) { return (int)(((uint32_t)word >> (4 * j)) & 0xf); }

/* AWQ packs columns {0, 2, 4, 6, 1, 3, 5, 7} into nibbles 0..7: column c of a word is in nibble
 * qkeep_awq_nibble(c). */
static inline int qkeep_awq_nibble(int c) {
  static const int nibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  return nibble[c & 7];
}

/*
 * Zero point of GPTQ column n in group `group` from qzeros [groups, N/8] (N = n_cols): v1
 * checkpoints store (zero - 1) & 0xf and readers take (stored + 1) & 0xf, as AutoGPTQ's reader
 * does (so a zero of 0 survives); v2 (v2 true) store the zero itself.
 */
static inline int qkeep_gptq_zero(const int32_t *qzeros, int64_t n_cols, int64_t group, int64_t n, bool v2) {
  int stored = qkeep_int4_nibble(qzeros[group * (n_cols / 8) + n / 8], (int)(n % 8));
  return v2 ? stored : (stored + 1) & 0xf;
}

/* ---- apply for a host kernel that takes f32 ------------------------------------------------------ */

/*
 * A host backend whose kernel computes one matrix in f32 (y[m, out] = x[m, in] W^T for a linear
 * layer or one MoE expert's w13 or w2) gets every activation dtype and routed MoE from these
 * two helpers: qkeep_be_f32_workspace for its workspace slot, qkeep_be_f32_apply for its apply.
 * They stage x and y as f32 in the workspace when the dtypes are not f32, and run routed MoE as
 * one kernel call per expert hit, over that expert's rows gathered in slot order, combining W2's
 * rows in slot order (so the result does not depend on thread counts). The kernel sees only f32,
 * contiguous, 64-byte aligned arrays.
 */
typedef int (*qkeep_be_f32_kernel)(void *user, int32_t expert, enum qkeep_moe_matrix matrix, int64_t m,
                                   const float *x, float *y);

/* The matrix an apply multiplies with, as the host helpers need it. */
struct qkeep_be_matrix_dims {
  int64_t in, out; /* K and N of the matrix: a linear layer's k and n; MoE W13 (H, 2I), W2 (I, H) */
  int64_t experts; /* an MoE layer's experts; 0 for a linear layer */
};

/* The dims of a's matrix for a layer described by info. */
static inline struct qkeep_be_matrix_dims qkeep_be_dims(const struct qkeep_layer_info *info,
                                                        const struct qkeep_apply_args *a) {
  struct qkeep_be_matrix_dims d = {info->k, info->n, 0};
  if (info->kind == QKEEP_LAYER_MOE) {
    d.experts = info->experts;
    if (a->matrix == QKEEP_MOE_W2)
      d.in = info->n / 2, d.out = info->k;
  }
  return d;
}

static inline size_t qkeep_be_align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* Whether a has the routed-MoE fields (a caller built before they existed has not). */
static inline int32_t qkeep_be_topk(const struct qkeep_apply_args *a) {
  return a->size >= offsetof(struct qkeep_apply_args, topk_weights) + sizeof a->topk_weights ? a->topk : 0;
}

/* Bytes of the f32 staging (and routing) the helpers need; 0 for f32 in and out, unrouted. */
static inline size_t qkeep_be_f32_workspace(const struct qkeep_apply_args *a, struct qkeep_be_matrix_dims d) {
  int32_t topk = qkeep_be_topk(a);
  size_t m = (size_t)(a->m > 0 ? a->m : 0);
  if (topk <= 0) {
    size_t x = a->x_dtype == QKEEP_DTYPE_F32 ? 0 : qkeep_be_align64(m * (size_t)d.in * 4);
    size_t y = a->y_dtype == QKEEP_DTYPE_F32 ? 0 : qkeep_be_align64(m * (size_t)d.out * 4);
    return x + y;
  }
  size_t pairs = m * (size_t)topk;
  return qkeep_be_align64(pairs * (size_t)d.in * 4) + qkeep_be_align64(pairs * (size_t)d.out * 4) +
         qkeep_be_align64(m * (size_t)d.out * 4) + qkeep_be_align64(pairs * sizeof(int64_t)) +
         qkeep_be_align64(((size_t)d.experts + 1 + pairs) * sizeof(int64_t));
}

static inline void qkeep_be_row_to_f32(const void *src, enum qkeep_dtype dt, size_t first, size_t n,
                                       float *dst) {
  if (dt == QKEEP_DTYPE_F32) {
    memcpy(dst, (const float *)src + first, n * sizeof *dst);
    return;
  }
  for (size_t i = 0; i < n; i++)
    dst[i] = qkeep_load_float(src, dt, first + i);
}

static inline void qkeep_be_row_from_f32(const float *src, size_t n, enum qkeep_dtype dt, void *dst,
                                         size_t first) {
  if (dt == QKEEP_DTYPE_F32) {
    memcpy((float *)dst + first, src, n * sizeof *src);
    return;
  }
  uint16_t *out = (uint16_t *)dst + first;
  for (size_t i = 0; i < n; i++)
    out[i] = dt == QKEEP_DTYPE_BF16 ? qkeep_f32_to_bf16(src[i]) : qkeep_f32_to_f16(src[i]);
}

/* Routed MoE through kernel: W13 one output row per (token, slot); W2 the weighted sum over slots. */
static inline int qkeep_be_f32_routed(const struct qkeep_apply_args *a, struct qkeep_be_matrix_dims d,
                                      qkeep_be_f32_kernel kernel, void *user) {
  const size_t m = (size_t)a->m, topk = (size_t)a->topk, pairs = m * topk, in = (size_t)d.in,
               out = (size_t)d.out;
  const bool w2 = a->matrix == QKEEP_MOE_W2;
  char *ws = (char *)a->workspace;
  float *xg = (float *)ws;
  float *yg = (float *)(ws += qkeep_be_align64(pairs * in * 4));
  float *acc = (float *)(ws += qkeep_be_align64(pairs * out * 4));
  int64_t *order = (int64_t *)(ws += qkeep_be_align64(m * out * 4));
  int64_t *start = (int64_t *)(ws + qkeep_be_align64(pairs * sizeof(int64_t)));
  for (int64_t e = 0; e <= d.experts; e++)
    start[e] = 0;
  /* an id outside [0, experts) skips its slot, as the GPU kernels do: no W13 row, no W2 term */
  for (size_t p = 0; p < pairs; p++) {
    int32_t e = a->topk_ids[p];
    if (e >= 0 && e < d.experts)
      start[e + 1]++;
  }
  for (int64_t e = 0; e < d.experts; e++)
    start[e + 1] += start[e];
  const size_t hit = (size_t)start[d.experts];
  /* order: the pairs of expert 0 in slot order, then expert 1's, ... (a stable counting sort) */
  for (size_t p = 0; p < pairs; p++)
    if (a->topk_ids[p] >= 0 && a->topk_ids[p] < d.experts)
      order[start[a->topk_ids[p]]++] = (int64_t)p;
  for (int64_t e = d.experts; e > 0; e--)
    start[e] = start[e - 1];
  start[0] = 0;
  for (size_t i = 0; i < hit; i++) {
    size_t p = (size_t)order[i], row = w2 ? p : p / topk;
    qkeep_be_row_to_f32(a->x, a->x_dtype, row * in, in, xg + i * in);
  }
  for (int64_t e = 0; e < d.experts; e++) {
    int64_t rows = start[e + 1] - start[e];
    int rc = rows ? kernel(user, (int32_t)e, a->matrix, rows, xg + (size_t)start[e] * in,
                           yg + (size_t)start[e] * out)
                  : 0;
    if (rc)
      return rc;
  }
  if (!w2) {
    for (size_t i = 0; i < hit; i++)
      qkeep_be_row_from_f32(yg + i * out, out, a->y_dtype, a->y, (size_t)order[i] * out);
    return 0;
  }
  /* where each pair's row landed (the inverse of order), then each token's slots in order */
  int64_t *where = start + d.experts + 1;
  for (size_t p = 0; p < pairs; p++)
    where[p] = -1;
  for (size_t i = 0; i < hit; i++)
    where[order[i]] = (int64_t)i;
  for (size_t t = 0; t < m; t++) {
    float *row = acc + t * out;
    for (size_t j = 0; j < out; j++)
      row[j] = 0.0f;
    for (size_t s = 0; s < topk; s++) {
      if (where[t * topk + s] < 0)
        continue;
      float w = a->topk_weights[t * topk + s];
      const float *src = yg + (size_t)where[t * topk + s] * out;
      for (size_t j = 0; j < out; j++)
        row[j] += w * src[j];
    }
    qkeep_be_row_from_f32(row, out, a->y_dtype, a->y, t * out);
  }
  return 0;
}

/*
 * Runs args (any activation dtype, routed or not) for the layer info describes through kernel,
 * with the workspace qkeep_be_f32_workspace asked for. A caller of an older ABI that passes no workspace gets
 * f32 only; other dtypes or routing without a workspace are QKEEP_E_UNSUPPORTED.
 */
static inline int qkeep_be_f32_apply(const struct qkeep_host *host, const struct qkeep_layer_info *info,
                                     const struct qkeep_apply_args *args, qkeep_be_f32_kernel kernel,
                                     void *user) {
  /* An older core's arguments end early: the fields past its size are expert 0, W13, unrouted. */
  struct qkeep_apply_args full;
  memset(&full, 0, sizeof full);
  memcpy(&full, args, args->size < sizeof full ? args->size : sizeof full);
  bool has_ws =
      args->size >= offsetof(struct qkeep_apply_args, workspace_bytes) + sizeof full.workspace_bytes;
  full.size = sizeof full;
  const struct qkeep_apply_args *a = &full;
  const char *layer_name = info->name;
  struct qkeep_be_matrix_dims d = qkeep_be_dims(info, a);
  size_t need = qkeep_be_f32_workspace(a, d);
  bool float_ok =
      (a->x_dtype == QKEEP_DTYPE_F32 || a->x_dtype == QKEEP_DTYPE_BF16 || a->x_dtype == QKEEP_DTYPE_F16) &&
      (a->y_dtype == QKEEP_DTYPE_F32 || a->y_dtype == a->x_dtype);
  if (!float_ok)
    return host->set_error(QKEEP_E_UNSUPPORTED, "%s: x and y must be F32, BF16 or F16 (y F32 or x's dtype)",
                           layer_name);
  if (need && (!has_ws || !a->workspace || a->workspace_bytes < need))
    return host->set_error(QKEEP_E_INVAL, "%s: needs %zu bytes of workspace", layer_name, need);
  if (a->m <= 0)
    return 0;
  if (qkeep_be_topk(a) > 0) {
    if (d.experts < 1 || !a->topk_ids || (a->matrix == QKEEP_MOE_W2 && !a->topk_weights))
      return host->set_error(QKEEP_E_INVAL,
                             "%s: routed MoE needs an MoE layer, topk_ids and (W2) topk_weights", layer_name);
    return qkeep_be_f32_routed(a, d, kernel, user);
  }
  if (d.experts && (a->expert < 0 || a->expert >= d.experts))
    return host->set_error(QKEEP_E_INVAL, "%s: expert %d of %lld", layer_name, (int)a->expert,
                           (long long)d.experts);
  size_t nx = (size_t)a->m * (size_t)d.in, ny = (size_t)a->m * (size_t)d.out;
  char *ws = (char *)(need ? a->workspace : NULL);
  const float *x = (const float *)a->x;
  float *y = (float *)a->y;
  if (a->x_dtype != QKEEP_DTYPE_F32) {
    float *xs = (float *)ws;
    qkeep_be_row_to_f32(a->x, a->x_dtype, 0, nx, xs);
    x = xs;
    ws += qkeep_be_align64(nx * 4);
  }
  if (a->y_dtype != QKEEP_DTYPE_F32)
    y = (float *)ws;
  int rc = kernel(user, d.experts ? a->expert : 0, a->matrix, a->m, x, y);
  if (!rc && a->y_dtype != QKEEP_DTYPE_F32)
    qkeep_be_row_from_f32(y, ny, a->y_dtype, a->y, 0);
  return rc;
}

#ifdef __cplusplus
}
#endif
#endif
