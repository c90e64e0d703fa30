/*
 * numeric.h: scalar conversions between f32 and the 16-bit float formats,
 * shared by the core and the CPU backends (one copy, static inline).
 */
#ifndef QKEEP_NUMERIC_H
#define QKEEP_NUMERIC_H

#include <stdint.h>
#include <string.h>

static inline uint32_t qk_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float qk_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float qk_bf16_to_f32(uint16_t b) { return qk_bits_f32((uint32_t)b << 16); }

/* Round to nearest even; NaN stays a quiet NaN. */
static inline uint16_t qk_f32_to_bf16(float f) {
  uint32_t u = qk_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

static inline float qk_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f)
    return qk_bits_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    /* Subnormal half: value is man * 2^-24, exact in f32. */
    float v = (float)man * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return qk_bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* Round to nearest even with subnormals; overflow goes to infinity. */
static inline uint16_t qk_f32_to_f16(float f) {
  uint32_t u = qk_f32_bits(f), sign = (u >> 16) & 0x8000;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u)
    return (uint16_t)(sign | 0x7e00);
  if (abs >= 0x477ff000u) /* rounds to >= 65520: infinity */
    return (uint16_t)(sign | 0x7c00);
  if (abs < 0x38800000u) {                    /* below the smallest normal half: subnormal or zero */
    float a = qk_bits_f32(abs) * 16777216.0f; /* in units of 2^-24 */
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

#endif
