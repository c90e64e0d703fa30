/*
 * quantize.c: the checkpoint quantizers of quant.h (NVFP4 as ModelOpt and as
 * compressed-tensors write it, MXFP4, int8 per channel, GPTQ int4) and their
 * dequantizers. Every rounding step follows reference/formats.md and its §9
 * decisions so that the bytes are reproducible; the comments say where a
 * reference's order of operations matters.
 *
 * All arithmetic is IEEE float32 evaluated in float32 (FLT_EVAL_METHOD 0, as on
 * x86-64 SSE and AArch64; x87 excess precision would change bytes). The recipes
 * have only divisions and lone products, so FP_CONTRACT cannot fuse anything, and
 * the rounding helper below does not depend on the floating-point environment.
 */
#include <assert.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "numeric.h"
#include "quant.h"

#define NVFP4_BLOCK 16
#define MXFP4_BLOCK 32
#define E2M1_MAX 6.0f
#define E4M3_MAX 448.0f
/* 6 * 448: the amax that maps to the largest e2m1 value under the largest e4m3 scale. */
#define NVFP4_RANGE 2688.0f
#define E4M3_ONE 0x38    /* 1.0: ModelOpt's scale for an all-zero block */
#define E4M3_EIGHTH 0x20 /* 0.125, torch.finfo(float8_e4m3fn).eps: compressed-tensors' zero-scale fill */

/* ---- scalar encoders -------------------------------------------------------------- */

/*
 * Round to nearest, ties to even, whatever the current rounding mode is
 * (rintf would follow fesetround). Exact: floorf and the difference are exact
 * for |x| < 2^23, and larger floats are integers already.
 */
static float round_half_even(float x) {
  if (!(fabsf(x) < 8388608.0f))
    return x;
  float fl = floorf(x), rest = x - fl;
  if (rest > 0.5f || (rest == 0.5f && fmodf(fl, 2.0f) != 0.0f))
    fl += 1.0f;
  return fl;
}

uint8_t qk_e2m1_encode(float x) {
  /* NaN is outside the contract (the quantizers refuse it first); +0 keeps a stray
   * NaN from ever looking like a saturated weight. */
  if (isnan(x))
    return 0x0;
  float a = fabsf(x);
  uint8_t code;
  /* The formats.md §1.2 bounds: <= where the tie goes down to the even neighbour,
   * < where it goes up. Above 5 everything, Inf included, saturates at 6. */
  if (a <= 0.25f)
    code = 0;
  else if (a < 0.75f)
    code = 1;
  else if (a <= 1.25f)
    code = 2;
  else if (a < 1.75f)
    code = 3;
  else if (a <= 2.5f)
    code = 4;
  else if (a < 3.5f)
    code = 5;
  else if (a <= 5.0f)
    code = 6;
  else
    code = 7;
  /* ModelOpt's sign rule (§9): x < 0, so -0.0 gives 0x0 but -0.1 gives 0x8. */
  return x < 0.0f ? (uint8_t)(code | 0x8) : code;
}

uint8_t qk_e4m3_encode(float x) {
  /* e4m3 copies the sign bit like torch's and ml_dtypes' casts do, so that every
   * finite byte, 0x80 (-0.0) included, survives decode then encode. Block scales
   * are never negative, so the quantizers do not depend on this choice. */
  uint8_t sign = signbit(x) ? 0x80 : 0x00;
  float a = fabsf(x);
  if (isnan(x))
    return (uint8_t)(sign | 0x7f);
  if (a >= E4M3_MAX) /* a cast would give NaN above 464; §9 saturates */
    return (uint8_t)(sign | 0x7e);
  /* The quantum is 2^(e-3) for a normal with exponent e, and 2^-9 for every
   * subnormal, which is the quantum of e = -6. */
  int e = -6;
  if (a >= 0x1p-6f) {
    frexpf(a, &e); /* a = f * 2^e with f in [0.5, 1) */
    e -= 1;
  }
  /* a in units of the quantum: exact (a power-of-two scaling), in [0, 16). */
  float units = round_half_even(ldexpf(a, 3 - e));
  /* Normal: ((e + 7) << 3) | (units - 8) = (e + 6) * 8 + units; a subnormal has
   * e = -6 and byte = units. units = 16 (or 8 for a subnormal) carries into the
   * exponent field, which is the next binade's first value; below 448 the
   * largest result is (8 + 6) * 8 + 14 = 0x7e. */
  int byte = (e + 6) * 8 + (int)units;
  assert(byte >= 0 && byte <= 0x7e);
  return (uint8_t)(sign | byte);
}

uint8_t qk_e8m0_from_amax(float amax) {
  uint32_t bits = qk_f32_bits(amax) & 0x7fffffffu;
  int e;
  if (bits == 0) {
    e = -126; /* microxcaling adds FP32_MIN_NORMAL to a zero amax */
  } else if (bits < 0x00800000u) {
    /* Subnormal: man * 2^-149, so floor(log2) is -149 + floor(log2(man)). */
    int p = 0;
    for (uint32_t man = bits; man > 1; man >>= 1)
      p++;
    e = -149 + p;
  } else {
    /* Exact floor(log2) from the exponent field. microxcaling's float32 log2
     * rounds up just below a power of two (§9), so it is not used. Non-finite
     * amax (outside the contract) reads as 128. */
    e = (int)(bits >> 23) - 127;
  }
  int shared = e - 2; /* emax of e2m1 */
  if (shared < -127)
    shared = -127;
  if (shared > 127)
    shared = 127;
  return (uint8_t)(shared + 127);
}

/* ---- validation --------------------------------------------------------------------- */

/* Refuses NaN and Inf, naming the first offender (the caller adds the tensor name). */
static int check_finite(const float *w, int64_t n, int64_t k) {
  for (int64_t i = 0; i < n * k; i++)
    if (!isfinite(w[i]))
      return set_error(QKEEP_E_INVAL, "element %lld (row %lld, column %lld) is %s", (long long)i,
                       (long long)(i / k), (long long)(i % k), isnan(w[i]) ? "NaN" : "infinite");
  return 0;
}

/* n and k non-negative, k a multiple of `multiple`, n * k representable, and the
 * input present when the tensor is not empty. */
static int check_matrix(const char *format, const float *w, int64_t n, int64_t k, int64_t multiple) {
  if (n < 0 || k < 0)
    return set_error(QKEEP_E_INVAL, "%s: negative shape [%lld, %lld]", format, (long long)n, (long long)k);
  if (k % multiple != 0)
    return set_error(QKEEP_E_INVAL, "%s: k = %lld is not a multiple of %lld", format, (long long)k,
                     (long long)multiple);
  if (n > 0 && k > INT64_MAX / n)
    return set_error(QKEEP_E_INVAL, "%s: shape [%lld, %lld] is too large", format, (long long)n,
                     (long long)k);
  if (n * k > 0 && !w)
    return set_error(QKEEP_E_INVAL, "%s: no input", format);
  return check_finite(w, n, k);
}

static float amax_of(const float *x, int64_t count) {
  float amax = 0.0f;
  for (int64_t i = 0; i < count; i++)
    amax = fmaxf(amax, fabsf(x[i]));
  return amax;
}

/* Two e2m1 codes per byte along the row: element 2i low, 2i+1 high (§1.3). */
static void pack_pair(uint8_t *packed, int64_t i, uint8_t code) {
  if (i & 1)
    packed[i >> 1] = (uint8_t)((packed[i >> 1] & 0x0f) | (code << 4));
  else
    packed[i >> 1] = (uint8_t)((packed[i >> 1] & 0xf0) | code);
}

/* ---- NVFP4 ---------------------------------------------------------------------------- */

/*
 * One 16-block. ModelOpt (ct = false), with ws2 = weight_scale_2:
 *   s_b = amax_b / (6 * ws2)           6.0f * ws2 rounded first, then the division
 *   s_b = 0 -> 1.0                     before the cast
 *   sc  = e4m3(min(s_b, 448))
 *   q   = e2m1(W / (f32(sc) * ws2))
 * compressed-tensors (ct = true), with global = 2688 / amax (an encode factor):
 *   s_b = amax_b / 6 * global          calculate_qparams: global * (max_val_pos / 6)
 *   sc  = e4m3(min(s_b, 448)); sc = 0 -> 0.125 after the cast
 *   q   = e2m1(W / (f32(sc) / global)) _quantize: scale = scale / global_scale; x / scale
 * so that the decode factor is f32(sc) / global, which dequant_nvfp4 evaluates as
 * f32(sc) * (1 / global) like vLLM (it can differ from the quotient by an ulp, well
 * inside half an e2m1 step).
 * A block whose scale casts to e4m3 zero gets codes 0 (§9), in both flavours: ModelOpt
 * keeps the 0x00 scale (dividing by it would give ±6), ct stores 0.125. For ct that
 * is also what compressed-tensors writes: s_b <= 2^-10 puts every |x| below
 * 48 * 2^-10 < 0.25, and its packer takes the sign from the rounded value (-0.0 -> 0x0).
 */
static void nvfp4_block(const float *x, bool ct, float ws2, float global, uint8_t *packed, int64_t first,
                        uint8_t *scale_byte) {
  float amax_b = amax_of(x, NVFP4_BLOCK), s_b;
  if (ct) {
    s_b = amax_b / E2M1_MAX * global;
  } else {
    s_b = amax_b / (E2M1_MAX * ws2);
    if (s_b == 0.0f)
      s_b = 1.0f;
  }
  uint8_t sc = qk_e4m3_encode(fminf(s_b, E4M3_MAX));
  bool zero_scale = sc == 0;
  if (zero_scale && ct)
    sc = E4M3_EIGHTH;
  *scale_byte = sc;
  float divisor = ct ? qk_e4m3_decode(sc) / global : qk_e4m3_decode(sc) * ws2;
  for (int64_t j = 0; j < NVFP4_BLOCK; j++)
    pack_pair(packed, first + j, zero_scale ? 0 : qk_e2m1_encode(x[j] / divisor));
}

int quant_nvfp4(const float *w, int64_t n, int64_t k, bool ct, uint8_t *packed, uint8_t *block_scale,
                float *global) {
  int rc = check_matrix("NVFP4", w, n, k, NVFP4_BLOCK);
  if (rc)
    return rc;
  if (!global || (n * k > 0 && (!packed || !block_scale)))
    return set_error(QKEEP_E_INVAL, "NVFP4: missing output");
  int64_t blocks = k / NVFP4_BLOCK;
  float amax = amax_of(w, n * k);
  if (amax == 0.0f) {
    /* §9: ModelOpt would compute 0/0; every block takes its flavour's zero scale
     * and the global scale is 0 in both (a reader must not invert ct's 0). */
    if (n * k > 0) {
      memset(packed, 0, (size_t)(n * k / 2));
      memset(block_scale, ct ? E4M3_EIGHTH : E4M3_ONE, (size_t)(n * blocks));
    }
    *global = 0.0f;
    return 0;
  }
  /* A subnormal weight_scale_2 would make f32(sc) * ws2 underflow to 0 for small
   * blocks (and ct's 2688/amax overflow for smaller amax): refuse rather than
   * write codes divided by zero. */
  if (amax < NVFP4_RANGE * FLT_MIN)
    return set_error(QKEEP_E_INVAL,
                     "NVFP4: amax %g is below 2688 * FLT_MIN; the global scale would be subnormal",
                     (double)amax);
  /* True IEEE divisions, in ModelOpt's order (§9): torch on CUDA would multiply by
   * a reciprocal. ct stores its own quotient, not 1 / weight_scale_2. */
  float ws2 = amax / NVFP4_RANGE, ct_global = NVFP4_RANGE / amax;
  for (int64_t r = 0; r < n; r++)
    for (int64_t b = 0; b < blocks; b++)
      nvfp4_block(w + r * k + b * NVFP4_BLOCK, ct, ws2, ct_global, packed + r * (k / 2), b * NVFP4_BLOCK,
                  block_scale + r * blocks + b);
  *global = ct ? ct_global : ws2;
  return 0;
}

void dequant_nvfp4(const uint8_t *packed, const uint8_t *block_scale, float decode_global, int64_t n,
                   int64_t k, float *w) {
  assert(n >= 0 && k >= 0 && k % NVFP4_BLOCK == 0);
  int64_t blocks = k / NVFP4_BLOCK;
  for (int64_t r = 0; r < n; r++) {
    const uint8_t *row = packed + r * (k / 2);
    for (int64_t b = 0; b < blocks; b++) {
      /* ModelOpt's order: the block's factor first, then the element. */
      float factor = qk_e4m3_decode(block_scale[r * blocks + b]) * decode_global;
      for (int64_t j = b * NVFP4_BLOCK; j < (b + 1) * NVFP4_BLOCK; j++)
        w[r * k + j] = qk_e2m1_decode(qk_fp4_code(row, j)) * factor;
    }
  }
}

/* ---- MXFP4 ---------------------------------------------------------------------------- */

int quant_mxfp4(const float *w, int64_t n, int64_t k, uint8_t *packed, uint8_t *scales) {
  int rc = check_matrix("MXFP4", w, n, k, MXFP4_BLOCK);
  if (rc)
    return rc;
  if (n * k > 0 && (!packed || !scales))
    return set_error(QKEEP_E_INVAL, "MXFP4: missing output");
  int64_t blocks = k / MXFP4_BLOCK;
  for (int64_t r = 0; r < n; r++)
    for (int64_t b = 0; b < blocks; b++) {
      const float *x = w + r * k + b * MXFP4_BLOCK;
      uint8_t byte = qk_e8m0_from_amax(amax_of(x, MXFP4_BLOCK));
      scales[r * blocks + b] = byte;
      /* X = 2^(byte - 127) is a power of two (2^-127 is an exact subnormal), so
       * x / X is exact; |x / X| < 8 because amax < 2^(e+1) and X >= 2^(e-2). */
      float shared = ldexpf(1.0f, (int)byte - 127);
      for (int64_t j = 0; j < MXFP4_BLOCK; j++)
        pack_pair(packed + r * (k / 2), b * MXFP4_BLOCK + j, qk_e2m1_encode(x[j] / shared));
    }
  return 0;
}

void dequant_mxfp4(const uint8_t *packed, const uint8_t *scales, int64_t n, int64_t k, float *w) {
  assert(n >= 0 && k >= 0 && k % MXFP4_BLOCK == 0);
  int64_t blocks = k / MXFP4_BLOCK;
  for (int64_t r = 0; r < n; r++) {
    const uint8_t *row = packed + r * (k / 2);
    for (int64_t j = 0; j < k; j++)
      w[r * k + j] =
          qk_e2m1_decode(qk_fp4_code(row, j)) * qk_e8m0_decode(scales[r * blocks + j / MXFP4_BLOCK]);
  }
}

/* ---- int8 per channel ----------------------------------------------------------------- */

int quant_int8_channel(const float *w, int64_t n, int64_t k, int8_t *q, float *scales) {
  int rc = check_matrix("int8", w, n, k, 1);
  if (rc)
    return rc;
  if (n > 0 && (!scales || (k > 0 && !q)))
    return set_error(QKEEP_E_INVAL, "int8: missing output");
  for (int64_t r = 0; r < n; r++) {
    const float *x = w + r * k;
    float amax = amax_of(x, k);
    /* vLLM's amax / 127 (not llm-compressor's 127.5), §9. */
    float scale = amax == 0.0f ? 1.0f : amax / 127.0f;
    if (scale == 0.0f)
      return set_error(QKEEP_E_INVAL, "int8: row %lld: amax %g is too small for a float32 scale",
                       (long long)r, (double)amax);
    scales[r] = scale;
    for (int64_t j = 0; j < k; j++)
      q[r * k + j] = (int8_t)fminf(fmaxf(round_half_even(x[j] / scale), -127.0f), 127.0f);
  }
  return 0;
}

/* ---- GPTQ int4 ------------------------------------------------------------------------ */

#define GPTQ_MAXQ 15

/* Reinterprets packed bits as the int32 the checkpoint stores. */
static int32_t word_i32(uint32_t u) {
  int32_t s;
  memcpy(&s, &u, sizeof s);
  return s;
}

static uint32_t word_u32(int32_t s) {
  uint32_t u;
  memcpy(&u, &s, sizeof u);
  return u;
}

/*
 * GPTQ's Quantizer.find_params for one group of one output channel (a row of w,
 * a column of qweight; `out` below), maxq = 15:
 * the range always includes 0; symmetric widens it to ±max|x| only when the
 * group has a negative value (so an all-positive group gets xmax / 15 and
 * zero 8, and clips above 7 * scale: GPTQ's own rule, §9); an all-zero group
 * uses [-1, 1].
 */
static void gptq_params(const float *x, int64_t g, bool sym, float *scale, int *zero) {
  float xmin = 0.0f, xmax = 0.0f;
  for (int64_t i = 0; i < g; i++) {
    xmin = fminf(xmin, x[i]);
    xmax = fmaxf(xmax, x[i]);
  }
  if (sym) {
    xmax = fmaxf(fabsf(xmin), xmax);
    if (xmin < 0.0f)
      xmin = -xmax;
  }
  if (xmin == 0.0f && xmax == 0.0f) {
    xmin = -1.0f;
    xmax = 1.0f;
  }
  *scale = (xmax - xmin) / (float)GPTQ_MAXQ;
  /* torch.round is half-to-even; -xmin / scale <= 15 (+ an ulp), so zero is in [0, 15]. */
  *zero = sym ? (GPTQ_MAXQ + 1) / 2 : (int)round_half_even(-xmin / *scale);
  assert(*zero >= 0 && *zero <= GPTQ_MAXQ);
}

/* q against the float32 scale, as GPTQ quantizes before the scales are cast to f16. */
static uint32_t gptq_code(float x, float scale, int zero) {
  float q = round_half_even(x / scale) + (float)zero;
  return (uint32_t)fminf(fmaxf(q, 0.0f), (float)GPTQ_MAXQ);
}

/* Writes one group's f16 scale and its v1 zero nibble. */
static void set_group(uint16_t *scales, int32_t *qzeros, int64_t n, int64_t group, int64_t out, float scale,
                      int zero) {
  scales[group * n + out] = qk_f32_to_f16(scale);
  /* AutoGPTQ v1 stores zero - 1. Masked to the nibble: AutoGPTQ's own packer lets
   * zero 0's -1 spill into the neighbouring nibbles; its reader computes
   * (stored + 1) & 0xf, so 0xf reads back as 0. */
  uint32_t stored = (uint32_t)(zero - 1) & 0xfu;
  int32_t *word = &qzeros[group * (n / 8) + out / 8];
  *word = word_i32(word_u32(*word) | stored << (4 * (out % 8)));
}

static int gptq_check(int64_t n, int64_t k, int64_t g) {
  if (n < 0 || k < 0 || g <= 0)
    return set_error(QKEEP_E_INVAL, "GPTQ: bad shape [%lld, %lld] or group size %lld", (long long)n,
                     (long long)k, (long long)g);
  if (k % 8 != 0 || n % 8 != 0 || k % g != 0)
    return set_error(
        QKEEP_E_INVAL,
        "GPTQ: shape [%lld, %lld], group size %lld: n and k must be multiples of 8, k of the group size",
        (long long)n, (long long)k, (long long)g);
  if (k > INT32_MAX || (n > 0 && k > INT64_MAX / n))
    return set_error(QKEEP_E_INVAL, "GPTQ: shape [%lld, %lld] is too large", (long long)n, (long long)k);
  return 0;
}

int quant_gptq_int4(const float *w, int64_t n, int64_t k, int64_t g, bool sym, int32_t *qweight,
                    uint16_t *scales, int32_t *qzeros, int32_t *g_idx) {
  int rc = gptq_check(n, k, g);
  if (!rc)
    rc = check_matrix("GPTQ", w, n, k, 1);
  if (rc)
    return rc;
  if ((n * k > 0 && (!qweight || !scales || !qzeros)) || (k > 0 && !g_idx))
    return set_error(QKEEP_E_INVAL, "GPTQ: missing output");
  int64_t groups = k / g;
  /* Check pass: a scale that overflows float16 is refused before anything is written. */
  for (int64_t out = 0; out < n; out++)
    for (int64_t gi = 0; gi < groups; gi++) {
      float scale;
      int zero;
      gptq_params(w + out * k + gi * g, g, sym, &scale, &zero);
      if (isinf(qk_f16_to_f32(qk_f32_to_f16(scale))))
        return set_error(QKEEP_E_INVAL, "GPTQ: row %lld, group %lld: scale %g overflows float16",
                         (long long)out, (long long)gi, (double)scale);
    }
  if (n * k > 0)
    memset(qzeros, 0, (size_t)(groups * (n / 8)) * sizeof *qzeros);
  for (int64_t out = 0; out < n; out++) {
    const float *x = w + out * k;
    int64_t group = -1;
    float scale = 0.0f;
    int zero = 0;
    /* qweight [k/8, n]: nibble j of word [kb][out] is k = 8 kb + j (lowest k lowest).
     * g need not be a multiple of 8, so a word may span two groups. */
    for (int64_t kb = 0; kb < k / 8; kb++) {
      uint32_t word = 0;
      for (int j = 0; j < 8; j++) {
        int64_t kk = kb * 8 + j;
        if (kk / g != group) {
          group = kk / g;
          gptq_params(x + group * g, g, sym, &scale, &zero);
          set_group(scales, qzeros, n, group, out, scale, zero);
        }
        word |= gptq_code(x[kk], scale, zero) << (4 * j);
      }
      qweight[kb * n + out] = word_i32(word);
    }
  }
  for (int64_t kk = 0; kk < k; kk++)
    g_idx[kk] = (int32_t)(kk / g);
  return 0;
}

void dequant_gptq_int4(const int32_t *qweight, const uint16_t *scales, const int32_t *qzeros,
                       const int32_t *g_idx, int64_t n, int64_t k, int64_t g, bool v2_zeros, float *w) {
  assert(n >= 0 && k >= 0 && g > 0 && k % 8 == 0 && n % 8 == 0 && k % g == 0);
  for (int64_t kk = 0; kk < k; kk++) {
    /* g_idx names each input row's group (in any order with act order); NULL: k / g. */
    int64_t gi = g_idx ? g_idx[kk] : kk / g;
    assert(gi >= 0 && gi < k / g);
    for (int64_t out = 0; out < n; out++) {
      int q = (int)((word_u32(qweight[(kk / 8) * n + out]) >> (4 * (kk % 8))) & 0xfu);
      int zero = (int)((word_u32(qzeros[gi * (n / 8) + out / 8]) >> (4 * (out % 8))) & 0xfu);
      if (!v2_zeros)
        zero = (zero + 1) & 0xf; /* AutoGPTQ v1: stored + 1, masked to 4 bits */
      w[out * k + kk] = qk_f16_to_f32(scales[gi * n + out]) * (float)(q - zero);
    }
  }
}

/* ---- compressed-tensors pack-quantized int4 ------------------------------------------ */

int quant_ct_int4(const float *w, int64_t n, int64_t k, int64_t g, bool sym, int32_t *packed, float *scales,
                  int32_t *zero_points) {
  int rc = gptq_check(n, k, g);
  if (!rc)
    rc = check_matrix("int4", w, n, k, 1);
  if (rc)
    return rc;
  if (n * k > 0 && (!packed || !scales || (!sym && !zero_points)))
    return set_error(QKEEP_E_INVAL, "int4: missing output");
  int64_t groups = k / g;
  if (!sym && n * k > 0)
    memset(zero_points, 0, (size_t)(n / 8 * groups) * sizeof *zero_points);
  for (int64_t out = 0; out < n; out++) {
    const float *x = w + out * k;
    for (int64_t gi = 0; gi < groups; gi++) {
      float scale;
      int zero;
      gptq_params(x + gi * g, g, sym, &scale, &zero);
      scales[out * groups + gi] = scale;
      if (!sym) { /* code zero - 8 is the signed zero point; stored + 8, i.e. as the code */
        int32_t *word = &zero_points[(out / 8) * groups + gi];
        *word = word_i32(word_u32(*word) | (uint32_t)zero << (4 * (out % 8)));
      }
      for (int64_t j = gi * g; j < (gi + 1) * g; j++) {
        int32_t *word = &packed[out * (k / 8) + j / 8];
        if (j % 8 == 0)
          *word = 0;
        *word = word_i32(word_u32(*word) | gptq_code(x[j], scale, zero) << (4 * (j % 8)));
      }
    }
  }
  return 0;
}
