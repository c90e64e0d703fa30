/*
 * formats.h: decoding of the quantized element and scale formats
 * (../docs and reference/formats.md §1-3, §9), static inline so that the core
 * and the CPU backends share one copy.
 *
 *   e2m1 (FP4): 1 sign, 2 exponent, 1 mantissa bit; packed two per byte,
 *               element 2i in the low nibble, 2i+1 in the high nibble.
 *   e4m3 (FP8, OCP "fn"): bias 7, subnormals, max 448, NaN = 0x7f / 0xff, no Inf.
 *   e8m0: an unsigned exponent, value 2^(b-127); 0xff is NaN.
 */
#ifndef QKEEP_FORMATS_H
#define QKEEP_FORMATS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "numeric.h"

static const float qk_e2m1_table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* The value of a 4-bit e2m1 code (low 4 bits of `code`). */
static inline float qk_e2m1_decode(uint8_t code) { return qk_e2m1_table[code & 0xf]; }

/* Element k of a row of packed e2m1 codes. */
static inline uint8_t qk_fp4_code(const uint8_t *row, int64_t k) {
  uint8_t b = row[k >> 1];
  return (k & 1) ? (uint8_t)(b >> 4) : (uint8_t)(b & 0xf);
}

/* The value of an e4m3fn byte. */
static inline float qk_e4m3_decode(uint8_t b) {
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

/* The value of an e8m0 scale byte. */
static inline float qk_e8m0_decode(uint8_t b) { return b == 0xff ? NAN : ldexpf(1.0f, (int)b - 127); }

/* The value of an element of a float tensor of the given dtype (F32, F16, BF16). */
static inline float qk_load_float(const void *data, int dtype, size_t i) {
  if (dtype == 0)
    return ((const float *)data)[i];
  uint16_t h;
  memcpy(&h, (const char *)data + 2 * i, 2);
  return dtype == 1 ? qk_f16_to_f32(h) : qk_bf16_to_f32(h);
}

/* Nibble `j` (0..7) of a packed int4 word. */
static inline int qk_nibble(int32_t word, int j) { return (int)(((uint32_t)word >> (4 * j)) & 0xf); }

/* AWQ packs columns {0, 2, 4, 6, 1, 3, 5, 7} into nibbles 0..7: column c is in nibble awq_nibble[c]. */
static const int qk_awq_nibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};

/*
 * Zero point of GPTQ column n in group `group` from qzeros [groups, N/8]:
 * v1 checkpoints store (zero - 1) & 0xf and readers take (stored + 1) & 0xf,
 * as AutoGPTQ's reader does (so a zero of 0 survives); v2 store the zero itself.
 */
static inline int qk_gptq_zero(const int32_t *qzeros, int64_t n_cols, int64_t group, int64_t n, int v2) {
  int stored = qk_nibble(qzeros[group * (n_cols / 8) + n / 8], (int)(n % 8));
  return v2 ? stored : (stored + 1) & 0xf;
}

#endif
