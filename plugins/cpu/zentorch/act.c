/*
 * act.c: what apply computes from the activations before a GEMM (zentorch.h): the da8w4
 * per-token int8 quantisation with its group sums, and the w4a16 group sums. The results must
 * not depend on the instruction set, so no fused multiply-add is allowed to form here (the file
 * is built with -ffp-contract=off). The quantisation is written for AVX2, the floor of every
 * CPU the backend runs on: as plain C, rintf was a libm call per element and quantising 128
 * rows of 4096 took 0.7 ms, a seventh of the da8w4 GEMM they feed.
 */
#pragma GCC target("avx2")
#include <immintrin.h>
#include <string.h>

#include "zentorch.h"

/*
 * The recipe of zentorch.h, 8 elements (one word of codes) per vector. Every step gives what the
 * scalar recipe gives: max_ps ignores a NaN |x| as the scalar comparison does, x * inv is one f32
 * multiply, and vcvtps2dq rounds in the current (default: half to even) mode as rintf does; the
 * clamp in int32 equals the clamp of the rounded f32, which is within a unit of +-127.
 */
void zt_quantise_row(const float *x, int64_t k, int64_t groups, int32_t *xq, int32_t *xsum, float *a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8)
    vmax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), vmax);
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float amax = 0.0f;
  for (int j = 0; j < 8; j++)
    amax = lanes[j] > amax ? lanes[j] : amax;
  float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  *a = amax / 127.0f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
  /* k 0,2,4,6 into the low 128-bit lane and k 1,3,5,7 into the high one, then narrowed to bytes */
  const __m256i evens_odds = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  int64_t words = k / 8 / groups;
  for (int64_t g = 0; g < groups; g++) {
    __m256i sum = _mm256_setzero_si256();
    for (int64_t kw = g * words; kw < (g + 1) * words; kw++) {
      __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + kw * 8), vinv));
      q = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
      sum = _mm256_add_epi32(sum, q);
      __m256i bytes = _mm256_permutevar8x32_epi32(q, evens_odds);
      bytes = _mm256_packs_epi32(bytes, bytes);
      bytes = _mm256_packs_epi16(bytes, bytes);
      xq[2 * kw] = _mm256_cvtsi256_si32(bytes);
      xq[2 * kw + 1] = _mm256_extract_epi32(bytes, 4);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    xsum[g] = _mm_cvtsi128_si32(s4);
  }
}

void zt_group_sums(const float *x, int64_t k, int64_t groups, float *xsum) {
  int64_t per_group = k / groups;
  for (int64_t g = 0; g < groups; g++) {
    float s = 0.0f;
    for (int64_t i = 0; i < per_group; i++)
      s += x[g * per_group + i];
    xsum[g] = s;
  }
}

void zt_amx_pack_row(const int32_t *xq_row, int64_t k, int ks, int64_t rows, int64_t r, int8_t *tiles) {
  const int8_t *src = (const int8_t *)xq_row;
  for (int64_t c = 0; c < k / ks; c++)
    memcpy(tiles + (c * rows + r) * ks, src + c * ks, (size_t)ks);
}
