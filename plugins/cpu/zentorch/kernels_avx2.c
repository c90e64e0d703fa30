/*
 * kernels_avx2.c: the AVX2 (with FMA and F16C) kernels of cpu-zentorch on the blocked
 * zentorch layout (zentorch.h): the floor every x86 CPU it runs on has. Built for these
 * instruction sets whatever the compiler's default; backend.c calls them only on a CPU
 * that has them.
 *
 * A tile is ZT_MR rows by ZT_NV 8-lane vectors (16 columns) of one block; a block is
 * covered in up to four such passes, the later ones reading the block's rows from L2.
 * da8w4 forms the int32 dot products with vpmaddubsw + vpmaddwd (u4 x s8 pair sums are at
 * most 2 * 15 * 127, and four of them 7620: no int16 saturation).
 */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "zentorch.h"

#define ZT_MR 2
#define ZT_NV 2
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* f32 scales of elements at..at+7 of g's scales [groups, n]. */
ALWAYS_INLINE __m256 load_scales(const struct zt_gemm *g, int64_t at) {
  if (g->scale_dtype == QKEEP_DTYPE_F32)
    return _mm256_loadu_ps((const float *)g->scales + at);
  __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)g->scales + at));
  if (g->scale_dtype == QKEEP_DTYPE_BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

/* The zero points of columns col..col+7 (col a multiple of 8) of group row `zeros`. */
ALWAYS_INLINE __m256i load_zeros(const int32_t *zeros, int64_t col) {
  if (!zeros)
    return _mm256_set1_epi32(8);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(zeros[col / 8]), shifts),
                          _mm256_set1_epi32(0xf));
}

/* Columns [c0, c0 + 8 nv) of block b (width `width`), rows m..m+mr-1. */
ALWAYS_INLINE void w4a16_tile(const struct zt_gemm *g, int64_t m, int mr, int64_t b, int64_t c0, int nv) {
  int64_t col0 = b * ZT_BLOCK_N, width = g->n - col0 < ZT_BLOCK_N ? g->n - col0 : ZT_BLOCK_N;
  const int32_t *codes = g->codes + col0 * (g->k / 8) + c0;
  int64_t words = g->k / 8 / g->groups;
  const __m256i nib = _mm256_set1_epi32(0xf), flip = _mm256_set1_epi32(g->zeros ? 0 : 8);
  __m256 acc[ZT_MR][ZT_NV];
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++)
      acc[r][v] = _mm256_setzero_ps();
  for (int64_t grp = 0; grp < g->groups; grp++) {
    __m256 part[ZT_MR][ZT_NV];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
      for (int v = 0; v < nv; v++)
        part[r][v] = _mm256_setzero_ps();
    for (int64_t kw = grp * words; kw < (grp + 1) * words; kw++) {
      const int32_t *row = codes + kw * width;
#pragma GCC unroll 4
      for (int v = 0; v < nv; v++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(row + 8 * v));
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
          __m256 c =
              _mm256_cvtepi32_ps(_mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi32(w, 4 * j), nib), flip));
#pragma GCC unroll 4
          for (int r = 0; r < mr; r++)
            part[r][v] = _mm256_fmadd_ps(c, _mm256_set1_ps(g->x[(m + r) * g->k + kw * 8 + j]), part[r][v]);
        }
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++) {
      int64_t col = col0 + c0 + 8 * v;
      __m256 s = load_scales(g, grp * g->n + col);
      __m256 z = _mm256_cvtepi32_ps(load_zeros(g->zeros ? g->zeros + grp * (g->n / 8) : NULL, col));
#pragma GCC unroll 4
      for (int r = 0; r < mr; r++) {
        __m256 t = _mm256_fnmadd_ps(z, _mm256_set1_ps(g->xsumf[(m + r) * g->groups + grp]), part[r][v]);
        acc[r][v] = _mm256_fmadd_ps(t, s, acc[r][v]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++)
      _mm256_storeu_ps(g->y + (m + r) * g->n + col0 + c0 + 8 * v, acc[r][v]);
}

ALWAYS_INLINE void da8w4_tile(const struct zt_gemm *g, int64_t m, int mr, int64_t b, int64_t c0, int nv) {
  int64_t col0 = b * ZT_BLOCK_N, width = g->n - col0 < ZT_BLOCK_N ? g->n - col0 : ZT_BLOCK_N;
  const int32_t *codes = g->codes + col0 * (g->k / 8) + c0;
  int64_t words = g->k / 8 / g->groups;
  const __m256i nib = _mm256_set1_epi32(0x0f0f0f0f), flip = _mm256_set1_epi32(g->zeros ? 0 : 0x08080808);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[ZT_MR][ZT_NV];
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++)
      acc[r][v] = _mm256_setzero_ps();
  for (int64_t grp = 0; grp < g->groups; grp++) {
    __m256i part[ZT_MR][ZT_NV];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
      for (int v = 0; v < nv; v++)
        part[r][v] = _mm256_setzero_si256();
    for (int64_t kw = grp * words; kw < (grp + 1) * words; kw++) {
      const int32_t *row = codes + kw * width;
#pragma GCC unroll 4
      for (int v = 0; v < nv; v++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(row + 8 * v));
        __m256i lo = _mm256_xor_si256(_mm256_and_si256(w, nib), flip);
        __m256i hi = _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi32(w, 4), nib), flip);
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
          const int32_t *xq = g->xq + (m + r) * (g->k / 4) + 2 * kw;
          __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[0])),
                                       _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[1])));
          part[r][v] = _mm256_add_epi32(part[r][v], _mm256_madd_epi16(p, ones));
        }
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++) {
      int64_t col = col0 + c0 + 8 * v;
      __m256 s = load_scales(g, grp * g->n + col);
      __m256i z = load_zeros(g->zeros ? g->zeros + grp * (g->n / 8) : NULL, col);
#pragma GCC unroll 4
      for (int r = 0; r < mr; r++) {
        __m256i xs = _mm256_set1_epi32(g->xsum[(m + r) * g->groups + grp]);
        __m256i t = _mm256_sub_epi32(part[r][v], _mm256_mullo_epi32(z, xs));
        acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), s, acc[r][v]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++) {
    __m256 a = _mm256_set1_ps(g->xscale[m + r]);
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++)
      _mm256_storeu_ps(g->y + (m + r) * g->n + col0 + c0 + 8 * v, _mm256_mul_ps(acc[r][v], a));
  }
}

/* Every (row pair, 16-column pass) of blocks [b0, b1), rows [m0, m1), through TILE. */
#define SWEEP(TILE)                                                                                          \
  for (int64_t b = b0; b < b1; b++) {                                                                        \
    int64_t width = g->n - b * ZT_BLOCK_N < ZT_BLOCK_N ? g->n - b * ZT_BLOCK_N : ZT_BLOCK_N;                 \
    for (int64_t c0 = 0; c0 < width; c0 += 8 * ZT_NV) {                                                      \
      bool two = width - c0 >= 16;                                                                           \
      for (int64_t m = m0; m < m1; m += ZT_MR) {                                                             \
        bool pair = m1 - m >= 2;                                                                             \
        if (pair && two)                                                                                     \
          TILE(g, m, 2, b, c0, 2);                                                                           \
        else if (pair)                                                                                       \
          TILE(g, m, 2, b, c0, 1);                                                                           \
        else if (two)                                                                                        \
          TILE(g, m, 1, b, c0, 2);                                                                           \
        else                                                                                                 \
          TILE(g, m, 1, b, c0, 1);                                                                           \
      }                                                                                                      \
    }                                                                                                        \
  }

/*
 * Many rows: each group of a 16-column pass decoded once (f32 codes for w4a16, u8 code
 * vectors for da8w4) into `dec`, then tiles of ZT_MR_DEC rows multiply with it; the f32
 * accumulators live in y between groups.
 */
#define ZT_MR_DEC 4

ALWAYS_INLINE void w4a16_dec_tile(const struct zt_gemm *g, const __m256 *dec, int64_t m, int mr, int64_t col,
                                  int nv, int64_t grp) {
  int64_t words = g->k / 8 / g->groups;
  __m256 part[ZT_MR_DEC][ZT_NV];
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++)
      part[r][v] = _mm256_setzero_ps();
  for (int64_t kw = 0; kw < words; kw++) {
    const float *x = g->x + m * g->k + (grp * words + kw) * 8;
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
#pragma GCC unroll 4
      for (int v = 0; v < nv; v++) {
        __m256 c = dec[(kw * ZT_NV + v) * 8 + j];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
          part[r][v] = _mm256_fmadd_ps(c, _mm256_set1_ps(x[r * g->k + j]), part[r][v]);
      }
  }
#pragma GCC unroll 4
  for (int v = 0; v < nv; v++) {
    __m256 s = load_scales(g, grp * g->n + col + 8 * v);
    __m256 z = _mm256_cvtepi32_ps(load_zeros(g->zeros ? g->zeros + grp * (g->n / 8) : NULL, col + 8 * v));
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
      float *y = g->y + (m + r) * g->n + col + 8 * v;
      __m256 t = _mm256_fnmadd_ps(z, _mm256_set1_ps(g->xsumf[(m + r) * g->groups + grp]), part[r][v]);
      _mm256_storeu_ps(y, _mm256_fmadd_ps(t, s, grp ? _mm256_loadu_ps(y) : _mm256_setzero_ps()));
    }
  }
}

ALWAYS_INLINE void da8w4_dec_tile(const struct zt_gemm *g, const __m256i *dec, int64_t m, int mr, int64_t col,
                                  int nv, int64_t grp) {
  int64_t words = g->k / 8 / g->groups;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i part[ZT_MR_DEC][ZT_NV];
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++)
      part[r][v] = _mm256_setzero_si256();
  for (int64_t kw = 0; kw < words; kw++) {
    const int32_t *xq = g->xq + m * (g->k / 4) + 2 * (grp * words + kw);
#pragma GCC unroll 4
    for (int v = 0; v < nv; v++) {
      __m256i lo = dec[(kw * ZT_NV + v) * 2], hi = dec[(kw * ZT_NV + v) * 2 + 1];
#pragma GCC unroll 4
      for (int r = 0; r < mr; r++) {
        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[r * (g->k / 4)])),
                                     _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[r * (g->k / 4) + 1])));
        part[r][v] = _mm256_add_epi32(part[r][v], _mm256_madd_epi16(p, ones));
      }
    }
  }
  bool last = grp == g->groups - 1;
#pragma GCC unroll 4
  for (int v = 0; v < nv; v++) {
    __m256 s = load_scales(g, grp * g->n + col + 8 * v);
    __m256i z = load_zeros(g->zeros ? g->zeros + grp * (g->n / 8) : NULL, col + 8 * v);
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
      float *y = g->y + (m + r) * g->n + col + 8 * v;
      __m256i t = _mm256_sub_epi32(
          part[r][v], _mm256_mullo_epi32(z, _mm256_set1_epi32(g->xsum[(m + r) * g->groups + grp])));
      __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), s, grp ? _mm256_loadu_ps(y) : _mm256_setzero_ps());
      if (last)
        acc = _mm256_mul_ps(acc, _mm256_set1_ps(g->xscale[m + r]));
      _mm256_storeu_ps(y, acc);
    }
  }
}

/* Every tile of rows [m0, m1) over one decoded group, ZT_MR_DEC rows at a time, nv vectors wide. */
#define DEC_ROWS(TILE, NV)                                                                                   \
  do {                                                                                                       \
    int64_t m = m0;                                                                                          \
    for (; m + ZT_MR_DEC <= m1; m += ZT_MR_DEC)                                                              \
      TILE(g, dec, m, ZT_MR_DEC, col, NV, grp);                                                              \
    if (m1 - m == 3)                                                                                         \
      TILE(g, dec, m, 3, col, NV, grp);                                                                      \
    else if (m1 - m == 2)                                                                                    \
      TILE(g, dec, m, 2, col, NV, grp);                                                                      \
    else if (m1 - m == 1)                                                                                    \
      TILE(g, dec, m, 1, col, NV, grp);                                                                      \
  } while (0)

static void w4a16_decoded(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b, __m256 *dec) {
  int64_t col0 = b * ZT_BLOCK_N, width = g->n - col0 < ZT_BLOCK_N ? g->n - col0 : ZT_BLOCK_N;
  int64_t words = g->k / 8 / g->groups;
  const __m256i nib = _mm256_set1_epi32(0xf), flip = _mm256_set1_epi32(g->zeros ? 0 : 8);
  for (int64_t c0 = 0; c0 < width; c0 += 8 * ZT_NV) {
    int nv = width - c0 >= 16 ? 2 : 1;
    int64_t col = col0 + c0;
    const int32_t *codes = g->codes + col0 * (g->k / 8) + c0;
    for (int64_t grp = 0; grp < g->groups; grp++) {
      for (int64_t kw = 0; kw < words; kw++)
        for (int v = 0; v < nv; v++) {
          __m256i w = _mm256_loadu_si256((const __m256i *)(codes + (grp * words + kw) * width + 8 * v));
          for (int j = 0; j < 8; j++)
            dec[(kw * ZT_NV + v) * 8 + j] = _mm256_cvtepi32_ps(
                _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi32(w, 4 * j), nib), flip));
        }
      if (nv == 2)
        DEC_ROWS(w4a16_dec_tile, 2);
      else
        DEC_ROWS(w4a16_dec_tile, 1);
    }
  }
}

static void da8w4_decoded(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b, __m256i *dec) {
  int64_t col0 = b * ZT_BLOCK_N, width = g->n - col0 < ZT_BLOCK_N ? g->n - col0 : ZT_BLOCK_N;
  int64_t words = g->k / 8 / g->groups;
  const __m256i nib = _mm256_set1_epi32(0x0f0f0f0f), flip = _mm256_set1_epi32(g->zeros ? 0 : 0x08080808);
  for (int64_t c0 = 0; c0 < width; c0 += 8 * ZT_NV) {
    int nv = width - c0 >= 16 ? 2 : 1;
    int64_t col = col0 + c0;
    const int32_t *codes = g->codes + col0 * (g->k / 8) + c0;
    for (int64_t grp = 0; grp < g->groups; grp++) {
      for (int64_t kw = 0; kw < words; kw++)
        for (int v = 0; v < nv; v++) {
          __m256i w = _mm256_loadu_si256((const __m256i *)(codes + (grp * words + kw) * width + 8 * v));
          dec[(kw * ZT_NV + v) * 2] = _mm256_xor_si256(_mm256_and_si256(w, nib), flip);
          dec[(kw * ZT_NV + v) * 2 + 1] =
              _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi32(w, 4), nib), flip);
        }
      if (nv == 2)
        DEC_ROWS(da8w4_dec_tile, 2);
      else
        DEC_ROWS(da8w4_dec_tile, 1);
    }
  }
}

void zt_w4a16_avx2(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  if (m1 - m0 >= ZT_MR_DEC) {
    __m256 *dec = _mm_malloc((size_t)(g->k / 8 / g->groups) * ZT_NV * 8 * sizeof *dec, 32);
    if (dec) {
      for (int64_t b = b0; b < b1; b++)
        w4a16_decoded(g, m0, m1, b, dec);
      _mm_free(dec);
      return;
    }
  }
  SWEEP(w4a16_tile)
}

void zt_da8w4_avx2(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  if (m1 - m0 >= ZT_MR_DEC) {
    __m256i *dec = _mm_malloc((size_t)(g->k / 8 / g->groups) * ZT_NV * 2 * sizeof *dec, 32);
    if (dec) {
      for (int64_t b = b0; b < b1; b++)
        da8w4_decoded(g, m0, m1, b, dec);
      _mm_free(dec);
      return;
    }
  }
  SWEEP(da8w4_tile)
}
