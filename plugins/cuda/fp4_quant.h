/*
 * fp4_quant.h: the arithmetic of one NVFP4 or MXFP4 block, as the quantize slot's kernels run it
 * (quantize.cu) and as a CPU test checks it against the core's host quantizer (tests/check_fp4_quant.c,
 * which compiles this header as C). One source, so that what the test proves is what the GPU runs.
 *
 * Every float operation is an IEEE round-to-nearest division or product: __fdiv_rn and __fmul_rn on the
 * device (never contracted, never approximated), plain float32 operations in C (FLT_EVAL_METHOD 0).
 * Rounding to an integer is ties-to-even in both. Scale bytes are built from the float's bits, as
 * libqkeep/quantize/quantize.c builds them; the comments there give each recipe's source.
 */
#ifndef QKEEP_FP4_QUANT_H
#define QKEEP_FP4_QUANT_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define FP4Q_FN __host__ __device__ static inline
#else
#define FP4Q_FN static inline
#endif

#define FP4Q_E4M3_MAX 448.0f
#define FP4Q_E4M3_ONE 0x38    /* 1.0: ModelOpt's scale of an all-zero tensor's blocks */
#define FP4Q_E4M3_EIGHTH 0x20 /* 0.125: compressed-tensors' zero-scale fill */

FP4Q_FN float fp4q_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

FP4Q_FN float fp4q_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

FP4Q_FN uint32_t fp4q_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

FP4Q_FN float fp4q_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/* x (0 <= x < 2^23) to the nearest integer, ties to even, whatever the rounding mode. */
FP4Q_FN int fp4q_rint(float x) {
#ifdef __CUDA_ARCH__
  return __float2int_rn(x);
#else
  int i = (int)x; /* truncates: exact below 2^23 */
  float rest = x - (float)i;
  return i + (rest > 0.5f || (rest == 0.5f && (i & 1)));
#endif
}

/* floor(log2(bits)) of a nonzero integer. */
FP4Q_FN int fp4q_log2(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return 31 - __clz((int)bits);
#else
  return 31 - __builtin_clz(bits);
#endif
}

/* 2^e for -127 <= e <= 127 from its bits (2^-127 is the one subnormal). */
FP4Q_FN float fp4q_pow2(int e) { return fp4q_float(e >= -126 ? (uint32_t)(e + 127) << 23 : 0x00400000u); }

/* e4m3fn byte of a in [0, 448] (quantize.c's e4m3_code for a non-negative, non-NaN value). */
FP4Q_FN uint8_t fp4q_e4m3_code(float a) {
  if (a >= FP4Q_E4M3_MAX)
    return 0x7e;
  int e = -6;
  if (a >= 0x1p-6f)
    e = (int)(fp4q_bits(a) >> 23) - 127;
  int units = fp4q_rint(fp4q_mul(a, fp4q_pow2(3 - e))); /* an exact scaling, then ties to even */
  return (uint8_t)((e + 6) * 8 + units);
}

/* The value of an e4m3fn byte that is not NaN. */
FP4Q_FN float fp4q_e4m3_value(uint8_t b) {
  uint32_t exp = (b >> 3) & 0xfu, man = b & 7u;
  float v = exp == 0 ? fp4q_mul((float)man, 0x1p-9f) : fp4q_float((exp - 7 + 127) << 23 | man << 20);
  return b & 0x80 ? -v : v;
}

/* MXFP4's shared scale byte for a block's amax (qk_e8m0_from_amax). */
FP4Q_FN uint8_t fp4q_e8m0(float amax) {
  uint32_t bits = fp4q_bits(amax) & 0x7fffffffu;
  int e = bits == 0 ? -126 : bits < 0x00800000u ? -149 + fp4q_log2(bits) : (int)(bits >> 23) - 127;
  int shared = e - 2;
  shared = shared < -127 ? -127 : shared > 127 ? 127 : shared;
  return (uint8_t)(shared + 127);
}

/* The e2m1 code of x / divisor (quantize.c's e2m1_pack): the rounding bounds passed, the quotient's sign. */
FP4Q_FN uint32_t fp4q_e2m1(float x, float divisor) {
  float v = fp4q_div(x, divisor), a = fabsf(v);
  uint32_t code = (uint32_t)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                             (a >= 3.5f) + (a > 5.0f));
  return code | (v < 0.0f ? 8u : 0u);
}

/*
 * One NVFP4 block of 16 finite values (quantize.c's nvfp4_block): its scale byte, and its codes as two
 * little-endian words (element 2i low in byte i). ModelOpt (ct false) with ws2 = weight_scale_2 =
 * amax / 2688; compressed-tensors with global = 2688 / amax; amax (the unit's) nonzero.
 */
FP4Q_FN uint8_t fp4q_nvfp4_block(const float x[16], bool ct, float ws2, float global, uint32_t word[2]) {
  float amax_b = 0.0f;
  for (int j = 0; j < 16; j++)
    amax_b = fmaxf(amax_b, fabsf(x[j]));
  float s_b;
  if (ct) {
    s_b = fp4q_mul(fp4q_div(amax_b, 6.0f), global);
  } else {
    s_b = fp4q_div(amax_b, fp4q_mul(6.0f, ws2));
    if (s_b == 0.0f)
      s_b = 1.0f;
  }
  uint8_t sc = fp4q_e4m3_code(s_b < FP4Q_E4M3_MAX ? s_b : FP4Q_E4M3_MAX);
  bool zero_scale = sc == 0;
  word[0] = word[1] = 0;
  if (zero_scale) /* codes 0; ct stores 0.125 */
    return ct ? (uint8_t)FP4Q_E4M3_EIGHTH : sc;
  float divisor = ct ? fp4q_div(fp4q_e4m3_value(sc), global) : fp4q_mul(fp4q_e4m3_value(sc), ws2);
  for (int j = 0; j < 16; j++)
    word[j / 8] |= fp4q_e2m1(x[j], divisor) << (4 * (j % 8));
  return sc;
}

/* One MXFP4 block of 32 finite values (quantize.c's quant_mxfp4_rows): its e8m0 byte and four words. */
FP4Q_FN uint8_t fp4q_mxfp4_block(const float x[32], uint32_t word[4]) {
  float amax_b = 0.0f;
  for (int j = 0; j < 32; j++)
    amax_b = fmaxf(amax_b, fabsf(x[j]));
  uint8_t byte = fp4q_e8m0(amax_b);
  float shared = fp4q_pow2((int)byte - 127); /* a power of two: x / shared is exact */
  for (int w = 0; w < 4; w++)
    word[w] = 0;
  for (int j = 0; j < 32; j++)
    word[j / 8] |= fp4q_e2m1(x[j], shared) << (4 * (j % 8));
  return byte;
}

#endif
