/*
 * quantize.c: the checkpoint quantizers of quant.h (NVFP4 as ModelOpt and as
 * compressed-tensors write it, MXFP4, int8 per channel, GPTQ int4) and their
 * dequantizers. Every rounding step follows the exporters' recipes (docs/FORMATS.md,
 * "6. qkeep quantize") so that the bytes are reproducible; the comments say where a
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

#include "base/base.h"
#include "base/numeric.h"
#include "quantize/quant.h"

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
 * (rintf would follow fesetround), as an integer. x must not be NaN; |x| above
 * 2^23 counts as +-2^23 (every caller clamps the result to a few bits, so the
 * answer is the same). Exact: the conversion to int truncates (C says so,
 * whatever the mode), and the difference is exact below 2^23. No branches, so
 * that loops of it vectorize: which way a weight rounds is a coin toss, and a
 * mispredicted branch per element costs more than the rest of the quantizer.
 */
static inline int32_t round_half_even(float x) {
  /* The clamp on the bits (integer selects vectorize where float ones do not). */
  uint32_t bits = qk_f32_bits(x), big = (bits & 0x7fffffffu) >= 0x4b000000u; /* |x| >= 2^23 */
  bits = big ? (bits & 0x80000000u) | 0x4b000000u : bits;
  memcpy(&x, &bits, sizeof x);
  int32_t i = (int32_t)x;
  float rest = x - (float)i; /* in (-1, 1), the sign of x */
  int32_t odd = i & 1;
  int32_t up = (rest > 0.5f) | ((rest == 0.5f) & odd), down = (rest < -0.5f) | ((rest == -0.5f) & odd);
  return i + up - down;
}

/* 2^e as a float for -127 <= e <= 127 (2^-127 is the one subnormal), built from its bits so that
 * no libm call runs per block. */
static float pow2f(int e) {
  assert(e >= -127 && e <= 127);
  uint32_t bits = e >= -126 ? (uint32_t)(e + 127) << 23 : 0x00400000u;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* qk_e2m1_encode, inlined into the quantizers' inner loops. */
static inline uint8_t e2m1_code(float x) {
  /* NaN is outside the contract (the quantizers refuse it first); +0 keeps a stray
   * NaN from ever looking like a saturated weight: every comparison below is false
   * for NaN, so its magnitude code is 0 and its sign test false. */
  float a = fabsf(x);
  /* The e2m1 rounding bounds, counted without branches (the table's codes are the
   * number of bounds passed): > where the tie goes down to the even neighbour, >=
   * where it goes up. Above 5 everything, Inf included, saturates at 6. */
  uint8_t code = (uint8_t)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                           (a >= 3.5f) + (a > 5.0f));
  /* ModelOpt's sign rule (§9): x < 0, so -0.0 gives 0x0 but -0.1 gives 0x8. */
  return x < 0.0f ? (uint8_t)(code | 0x8) : code;
}

uint8_t qk_e2m1_encode(float x) { return e2m1_code(x); }

/* qk_e4m3_encode, inlined into the NVFP4 block loop. */
static inline uint8_t e4m3_code(float x) {
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
  if (a >= 0x1p-6f) /* a normal float: e = floor(log2(a)) is its exponent field less the bias */
    e = (int)(qk_f32_bits(a) >> 23) - 127;
  /* a in units of the quantum: exact (a power-of-two scaling), in [0, 16). */
  int32_t units = round_half_even(a * pow2f(3 - e));
  /* Normal: ((e + 7) << 3) | (units - 8) = (e + 6) * 8 + units; a subnormal has
   * e = -6 and byte = units. units = 16 (or 8 for a subnormal) carries into the
   * exponent field, which is the next binade's first value; below 448 the
   * largest result is (8 + 6) * 8 + 14 = 0x7e. */
  int byte = (e + 6) * 8 + (int)units;
  assert(byte >= 0 && byte <= 0x7e);
  return (uint8_t)(sign | byte);
}

uint8_t qk_e4m3_encode(float x) { return e4m3_code(x); }

/* qk_e4m3_decode of a byte that is not NaN, from its bits (no libm call): a normal
 * 1.m * 2^(e-7) is the f32 with exponent e - 7 and m in the top mantissa bits; a
 * subnormal is m * 2^-9, a product by a power of two, exact. */
static inline float e4m3_value(uint8_t b) {
  uint32_t exp = (b >> 3) & 0xfu, man = b & 7u;
  float v;
  if (exp == 0) {
    v = (float)man * 0x1p-9f;
  } else {
    uint32_t bits = (exp - 7 + 127) << 23 | man << 20;
    memcpy(&v, &bits, sizeof v);
  }
  return b & 0x80 ? -v : v;
}

float quant_e4m3_value(uint8_t b) { return e4m3_value(b); }

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

/* max |x| of finite values (as fmaxf would give it, without its NaN handling). Four
 * running maxima, one per vector lane: max is exact, so the order does not matter. */
static inline float amax_of(const float *x, int64_t count) {
  float lane[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int64_t quads = count / 4;
  for (int64_t q = 0; q < quads; q++)
    for (int l = 0; l < 4; l++) {
      float a = fabsf(x[4 * q + l]);
      lane[l] = a > lane[l] ? a : lane[l];
    }
  for (int l = 0; l < (int)(count % 4); l++) {
    float a = fabsf(x[4 * quads + l]);
    lane[l] = a > lane[l] ? a : lane[l];
  }
  float amax = lane[0];
  for (int l = 1; l < 4; l++)
    amax = lane[l] > amax ? lane[l] : amax;
  return amax;
}

int quant_check_rows(const float *w, int64_t row0, int64_t rows, int64_t k, float *amax) {
  /* A vector pass that only notes whether a NaN or Inf is there, then, if one is, a
   * search for the first. */
  int32_t bad = 0;
  for (int64_t i = 0; i < rows * k; i++)
    bad |= !(fabsf(w[i]) <= FLT_MAX);
  for (int64_t i = 0; bad && i < rows * k; i++)
    if (!isfinite(w[i])) {
      int64_t at = row0 * k + i;
      return set_error(QKEEP_E_INVAL, "element %lld (row %lld, column %lld) is %s", (long long)at,
                       (long long)(at / k), (long long)(at % k), isnan(w[i]) ? "NaN" : "infinite");
    }
  if (amax)
    *amax = amax_of(w, rows * k);
  return 0;
}

/* Refuses NaN and Inf, naming the first offender (the caller adds the tensor name). */
static int check_finite(const float *w, int64_t n, int64_t k) { return quant_check_rows(w, 0, n, k, NULL); }

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

/*
 * x[j] / divisor as e2m1 codes (e2m1_code's), two per byte along the row: element 2i
 * low, 2i+1 high (§1.3); count is even and at most 32. Plain array loops that compilers
 * vectorize (the divisions and the table's bounds four or eight lanes at a time).
 */
static inline void e2m1_pack(const float *x, float divisor, int count, uint8_t *out) {
  int32_t code[MXFP4_BLOCK];
  assert(count % 2 == 0 && count <= MXFP4_BLOCK);
  for (int j = 0; j < count; j++) {
    float v = x[j] / divisor, a = fabsf(v);
    code[j] = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
              (a > 5.0f) + ((v < 0.0f) << 3);
  }
  for (int j = 0; j < count / 2; j++)
    out[j] = (uint8_t)(code[2 * j] | code[2 * j + 1] << 4);
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
  uint8_t sc = e4m3_code(s_b < E4M3_MAX ? s_b : E4M3_MAX); /* fminf: s_b is not NaN */
  bool zero_scale = sc == 0;
  if (zero_scale && ct)
    sc = E4M3_EIGHTH;
  *scale_byte = sc;
  float divisor = ct ? e4m3_value(sc) / global : e4m3_value(sc) * ws2;
  uint8_t *out = packed + first / 2;
  if (zero_scale) {
    memset(out, 0, NVFP4_BLOCK / 2);
    return;
  }
  e2m1_pack(x, divisor, NVFP4_BLOCK, out);
}

int quant_nvfp4_global(float amax, bool ct, float *global) {
  if (amax == 0.0f) {
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
  *global = ct ? NVFP4_RANGE / amax : amax / NVFP4_RANGE;
  return 0;
}

void quant_nvfp4_rows(const float *w, int64_t rows, int64_t k, bool ct, float amax, uint8_t *packed,
                      uint8_t *block_scale) {
  assert(rows >= 0 && k % NVFP4_BLOCK == 0);
  int64_t blocks = k / NVFP4_BLOCK;
  if (amax == 0.0f) {
    /* §9: ModelOpt would compute 0/0; every block takes its flavour's zero scale
     * and the global scale is 0 in both (a reader must not invert ct's 0). */
    if (rows * k > 0) {
      memset(packed, 0, (size_t)(rows * k / 2));
      memset(block_scale, ct ? E4M3_EIGHTH : E4M3_ONE, (size_t)(rows * blocks));
    }
    return;
  }
  float ws2 = amax / NVFP4_RANGE, ct_global = NVFP4_RANGE / amax;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t b = 0; b < blocks; b++)
      nvfp4_block(w + r * k + b * NVFP4_BLOCK, ct, ws2, ct_global, packed + r * (k / 2), b * NVFP4_BLOCK,
                  block_scale + r * blocks + b);
}

int quant_nvfp4(const float *w, int64_t n, int64_t k, bool ct, uint8_t *packed, uint8_t *block_scale,
                float *global) {
  int rc = check_matrix("NVFP4", w, n, k, NVFP4_BLOCK);
  if (rc)
    return rc;
  if (!global || (n * k > 0 && (!packed || !block_scale)))
    return set_error(QKEEP_E_INVAL, "NVFP4: missing output");
  float amax = amax_of(w, n * k), g = 0.0f;
  if ((rc = quant_nvfp4_global(amax, ct, &g)) != 0)
    return rc;
  quant_nvfp4_rows(w, n, k, ct, amax, packed, block_scale);
  *global = g;
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
  quant_mxfp4_rows(w, n, k, packed, scales);
  return 0;
}

void quant_mxfp4_rows(const float *w, int64_t rows, int64_t k, uint8_t *packed, uint8_t *scales) {
  assert(rows >= 0 && k % MXFP4_BLOCK == 0);
  int64_t blocks = k / MXFP4_BLOCK;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t b = 0; b < blocks; b++) {
      const float *x = w + r * k + b * MXFP4_BLOCK;
      uint8_t byte = qk_e8m0_from_amax(amax_of(x, MXFP4_BLOCK));
      scales[r * blocks + b] = byte;
      /* X = 2^(byte - 127) is a power of two (2^-127 is an exact subnormal), so
       * x / X is exact; |x / X| < 8 because amax < 2^(e+1) and X >= 2^(e-2). */
      float shared = pow2f((int)byte - 127);
      e2m1_pack(x, shared, MXFP4_BLOCK, packed + r * (k / 2) + b * MXFP4_BLOCK / 2);
    }
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
  return quant_int8_rows(w, 0, n, k, q, scales);
}

/* count (at most 64) codes of x / scale; a constant count lets the compiler vectorize it. */
static inline void int8_run(const float *x, float scale, int count, int8_t *q) {
  int32_t code[64];
  for (int j = 0; j < count; j++) {
    int32_t c = round_half_even(x[j] / scale);
    c = c < -127 ? -127 : c;
    code[j] = c > 127 ? 127 : c;
  }
  for (int j = 0; j < count; j++)
    q[j] = (int8_t)code[j];
}

int quant_int8_rows(const float *w, int64_t row0, int64_t rows, int64_t k, int8_t *q, float *scales) {
  for (int64_t r = 0; r < rows; r++) {
    const float *x = w + r * k;
    float amax = amax_of(x, k);
    /* vLLM's amax / 127 (not llm-compressor's 127.5), §9. */
    float scale = amax == 0.0f ? 1.0f : amax / 127.0f;
    if (scale == 0.0f)
      return set_error(QKEEP_E_INVAL, "int8: row %lld: amax %g is too small for a float32 scale",
                       (long long)(row0 + r), (double)amax);
    scales[r] = scale;
    /* |x / scale| <= 127 up to rounding, so the clamp only catches that ulp. In runs of
     * 64 through int32, so that the compiler vectorizes the arithmetic. */
    int64_t j0 = 0;
    for (; j0 + 64 <= k; j0 += 64)
      int8_run(x + j0, scale, 64, q + r * k + j0);
    int8_run(x + j0, scale, (int)(k - j0), q + r * k + j0);
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
  /* Finite inputs: plain comparisons are fminf / fmaxf (a signed zero's sign never
   * matters below); four running extremes, one per vector lane, exact in any order. */
  float lo[4] = {0.0f, 0.0f, 0.0f, 0.0f}, hi[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int64_t quads = g / 4;
  for (int64_t q = 0; q < quads; q++)
    for (int l = 0; l < 4; l++) {
      float v = x[4 * q + l];
      lo[l] = v < lo[l] ? v : lo[l];
      hi[l] = v > hi[l] ? v : hi[l];
    }
  for (int l = 0; l < (int)(g % 4); l++) {
    float v = x[4 * quads + l];
    lo[l] = v < lo[l] ? v : lo[l];
    hi[l] = v > hi[l] ? v : hi[l];
  }
  float xmin = lo[0], xmax = hi[0];
  for (int l = 1; l < 4; l++) {
    xmin = lo[l] < xmin ? lo[l] : xmin;
    xmax = hi[l] > xmax ? hi[l] : xmax;
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
  int32_t q = round_half_even(x / scale) + zero;
  q = q < 0 ? 0 : q;
  return (uint32_t)(q > GPTQ_MAXQ ? GPTQ_MAXQ : q);
}

/*
 * The codes of count (a multiple of 8, at most 64) elements of one group, packed 8 to a
 * word, the lowest k in the lowest nibble (gptq_code's, in vector loops).
 */
static inline void int4_words(const float *x, float scale, int zero, int count, uint32_t *words) {
  int32_t code[64];
  for (int j = 0; j < count; j++) {
    int32_t q = round_half_even(x[j] / scale) + zero;
    q = q < 0 ? 0 : q;
    code[j] = q > GPTQ_MAXQ ? GPTQ_MAXQ : q;
  }
  for (int w = 0; w < count / 8; w++) {
    uint32_t v = 0;
    for (int b = 0; b < 8; b++)
      v |= (uint32_t)code[8 * w + b] << (4 * b);
    words[w] = v;
  }
}

/* The words of one group of g (a multiple of 8) elements, in runs of 64 (constant, so vectorized). */
static void group_words(const float *x, int64_t g, float scale, int zero, uint32_t *words) {
  int64_t j = 0;
  for (; j + 64 <= g; j += 64)
    int4_words(x + j, scale, zero, 64, words + j / 8);
  if (j < g)
    int4_words(x + j, scale, zero, (int)(g - j), words + j / 8);
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
  rc = quant_gptq_int4_rows(w, 0, n, n, k, g, sym, qweight, scales, qzeros);
  if (rc)
    return rc;
  for (int64_t kk = 0; kk < k; kk++)
    g_idx[kk] = (int32_t)(kk / g);
  return 0;
}

int quant_gptq_int4_rows(const float *w, int64_t row0, int64_t rows, int64_t n, int64_t k, int64_t g,
                         bool sym, int32_t *qweight, uint16_t *scales, int32_t *qzeros) {
  assert(row0 % 8 == 0 && rows % 8 == 0 && row0 + rows <= n && k % g == 0);
  int64_t groups = k / g;
  /* Check pass: a scale that overflows float16 is refused before anything is written. */
  for (int64_t r = 0; r < rows; r++)
    for (int64_t gi = 0; gi < groups; gi++) {
      float scale;
      int zero;
      gptq_params(w + r * k + gi * g, g, sym, &scale, &zero);
      if (isinf(qk_f16_to_f32(qk_f32_to_f16(scale))))
        return set_error(QKEEP_E_INVAL, "GPTQ: row %lld, group %lld: scale %g overflows float16",
                         (long long)(row0 + r), (long long)gi, (double)scale);
    }
  for (int64_t gi = 0; gi < groups && rows > 0; gi++) /* these rows' zero words only */
    memset(qzeros + gi * (n / 8) + row0 / 8, 0, (size_t)(rows / 8) * sizeof *qzeros);
  if (g % 8 == 0) { /* every word inside one group: a group at a time */
    uint32_t words[64];
    for (int64_t out = row0; out < row0 + rows; out++)
      for (int64_t gi = 0; gi < groups; gi++) {
        const float *x = w + (out - row0) * k + gi * g;
        float scale;
        int zero;
        gptq_params(x, g, sym, &scale, &zero);
        set_group(scales, qzeros, n, gi, out, scale, zero);
        for (int64_t j = 0; j < g; j += 512) { /* words[] holds 64 words */
          int64_t m = g - j < 512 ? g - j : 512;
          group_words(x + j, m, scale, zero, words);
          for (int64_t wd = 0; wd < m / 8; wd++)
            qweight[((gi * g + j) / 8 + wd) * n + out] = word_i32(words[wd]);
        }
      }
    return 0;
  }
  for (int64_t out = row0; out < row0 + rows; out++) {
    const float *x = w + (out - row0) * k;
    int64_t group = -1, group_end = 0;
    float scale = 0.0f;
    int zero = 0;
    /* qweight [k/8, n]: nibble j of word [kb][out] is k = 8 kb + j (lowest k lowest).
     * g need not be a multiple of 8, so a word may span two groups. */
    for (int64_t kb = 0; kb < k / 8; kb++) {
      uint32_t word = 0;
      for (int j = 0; j < 8; j++) {
        int64_t kk = kb * 8 + j;
        if (kk == group_end) { /* kk / g changes here */
          group++;
          group_end += g;
          gptq_params(x + group * g, g, sym, &scale, &zero);
          set_group(scales, qzeros, n, group, out, scale, zero);
        }
        word |= gptq_code(x[kk], scale, zero) << (4 * j);
      }
      qweight[kb * n + out] = word_i32(word);
    }
  }
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
  quant_ct_int4_rows(w, n, k, g, sym, packed, scales, zero_points);
  return 0;
}

void quant_ct_int4_rows(const float *w, int64_t rows, int64_t k, int64_t g, bool sym, int32_t *packed,
                        float *scales, int32_t *zero_points) {
  assert(rows % 8 == 0 && k % 8 == 0 && k % g == 0);
  int64_t groups = k / g;
  if (!sym && rows * k > 0)
    memset(zero_points, 0, (size_t)(rows / 8 * groups) * sizeof *zero_points);
  for (int64_t out = 0; out < rows; out++) {
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
      if (g % 8 == 0) { /* whole words: in vector runs */
        uint32_t words[64];
        for (int64_t j = 0; j < g; j += 512) {
          int64_t m = g - j < 512 ? g - j : 512;
          group_words(x + gi * g + j, m, scale, zero, words);
          for (int64_t wd = 0; wd < m / 8; wd++)
            packed[out * (k / 8) + (gi * g + j) / 8 + wd] = word_i32(words[wd]);
        }
        continue;
      }
      for (int64_t j = gi * g; j < (gi + 1) * g; j++) {
        int32_t *word = &packed[out * (k / 8) + j / 8];
        if (j % 8 == 0)
          *word = 0;
        *word = word_i32(word_u32(*word) | gptq_code(x[j], scale, zero) << (4 * (j % 8)));
      }
    }
  }
}
