/*
 * kernels_avx512.c: the AVX-512 kernels (F, BW, VL, DQ; VNNI for one of them) of
 * cpu-zentorch on the blocked zentorch layout (zentorch.h). Built for these instruction
 * sets whatever the compiler's default; backend.c calls them only on a CPU that has them.
 *
 * Each call covers column blocks [b0, b1) and rows [m0, m1). With fewer than ZT_MR_DEC rows,
 * a tile is ZT_MR rows by one block (four 16-lane vectors, masked for a narrower last block):
 * per group, the code products accumulate in registers (f32 for w4a16, int32 for da8w4), then
 * the group's zero-point correction is subtracted and the result scaled into the f32
 * accumulators. With more rows, each group of a block is decoded once and every row multiplies
 * with the decoded codes (the "many rows" sections below), in the same operations and order.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>
#include <string.h>

#include "zentorch.h"

#define ZT_MR 2 /* rows per tile */
/* Whether column block b of g is ZT_BLOCK_N columns wide (every block but a narrower last one). */
#define FULL_BLOCK(g, b) (((b) + 1) * ZT_BLOCK_N <= (g)->n)
#define ZT_NV 4 /* 16-lane vectors per tile: one block */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The lanes of vector v of a block `width` columns wide. */
ALWAYS_INLINE __mmask16 lane_mask(int64_t width, int v) {
  int64_t left = width - 16 * v;
  return left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* f32 scales of elements at..at+15 (masked) of g's scales [groups, n]. */
ALWAYS_INLINE __m512 load_scales(const struct zt_gemm *g, int64_t at, __mmask16 mask) {
  if (g->scale_dtype == QKEEP_DTYPE_F32)
    return _mm512_maskz_loadu_ps(mask, (const float *)g->scales + at);
  __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)g->scales + at);
  if (g->scale_dtype == QKEEP_DTYPE_BF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

/* The zero points of columns col..col+15 (col a multiple of 16) of group row `zeros`, as int32 lanes. */
ALWAYS_INLINE __m512i load_zeros(const int32_t *zeros, int64_t col, int64_t n, __mmask16 mask) {
  if (!zeros)
    return _mm512_set1_epi32(8);
  if (!mask)
    return _mm512_setzero_si512();
  const int32_t *w = zeros + col / 8;
  __m512i both =
      _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(w[0]), _mm512_set1_epi32(col + 8 < n ? w[1] : 0));
  const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  return _mm512_and_si512(_mm512_srlv_epi32(both, shifts), _mm512_set1_epi32(0xf));
}

/*
 * Asks for group grp's scales and zero points of the `width` columns at col0, ZT_AHEAD groups
 * before a tile reads them: a group's 64 scales are one short piece of a row N scales long, which
 * no hardware prefetcher follows. At M = 1 the da8w4 tile waited on them for a quarter of its
 * time (4096 x 4096 on a Zen 5 EPYC, one thread: 400 us without, 300 us with).
 */
#define ZT_AHEAD 4
ALWAYS_INLINE void prefetch_group(const struct zt_gemm *g, int64_t grp, int64_t col0, int64_t width) {
  if (grp >= g->groups)
    return;
  size_t size = g->scale_dtype == QKEEP_DTYPE_F32 ? 4 : 2;
  const char *first = (const char *)g->scales + (size_t)(grp * g->n + col0) * size;
  const char *end = first + (size_t)width * size;
  for (const char *line = first - (uintptr_t)first % 64; line < end; line += 64)
    _mm_prefetch(line, _MM_HINT_T0);
  if (g->zeros)
    _mm_prefetch((const char *)(g->zeros + grp * (g->n / 8) + col0 / 8), _MM_HINT_T0);
}

/*
 * Loads and stores of a block's vectors: plain for a full block (`full`, a constant at every call
 * site, so each tile is compiled twice), masked only for the narrower last one. On a Zen 5 EPYC
 * the masked 64-byte load of the code stream alone held the M = 1 da8w4 tile to 12.9 GB/s where
 * the plain one reaches 41.5 GB/s (a read of the same bytes: 53.7 GB/s).
 */
#define LOAD_I32(full, mask, p) ((full) ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32((mask), (p)))
#define LOAD_F32(full, mask, p) ((full) ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((mask), (p)))
#define STORE_F32(full, mask, p, v)                                                                          \
  do {                                                                                                       \
    if (full)                                                                                                \
      _mm512_storeu_ps((p), (v));                                                                            \
    else                                                                                                     \
      _mm512_mask_storeu_ps((p), (mask), (v));                                                               \
  } while (0)

/* (a & b) ^ c in one instruction: the u4 code of a masked nibble, s4 codes flipped back. */
#define CODE(a, b, c) _mm512_ternarylogic_epi32((a), (b), (c), 0x6a)

/*
 * The f32 codes of the low nibble of each lane of w, from `table` (code_table): vpermps reads only the
 * low 4 bits of each index, so one permute turns 16 nibbles into 16 floats, where masking, flipping
 * and converting them took three instructions. The floats are the same (small integers are exact).
 */
#define CODE_F32(w, table) _mm512_permutexvar_ps((w), (table))

/* CODE_F32's table: float(nibble) for u4 codes, float(nibble ^ 8) for s4 ones (every zero 8). */
ALWAYS_INLINE __m512 code_table(const struct zt_gemm *g) {
  return g->zeros ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                  : _mm512_setr_ps(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
}

/*
 * Rows m..m+mr-1 by blocks b..b+nb-1 (nb 2 only for one row and two full blocks: 8 independent
 * multiply-add chains, enough to keep both FMA pipes of a Zen 5 busy where one block's 4 chains
 * wait on the FMA latency). Per column, the products of a group are summed in k order, then the
 * zero-point correction and the scale are applied group by group, whatever mr and nb.
 */
ALWAYS_INLINE void w4a16_tile(const struct zt_gemm *g, int64_t m, int mr, int64_t b, int nb, bool full) {
  int64_t col0 = b * ZT_BLOCK_N, width = g->n - col0 < ZT_BLOCK_N ? g->n - col0 : ZT_BLOCK_N;
  const int32_t *codes = g->codes + col0 * (g->k / 8);
  int64_t words = g->k / 8 / g->groups, block_words = ZT_BLOCK_N * (g->k / 8);
  int nv = nb * ZT_NV;
  __mmask16 mask[2 * ZT_NV];
#pragma GCC unroll 8
  for (int v = 0; v < nv; v++)
    mask[v] = lane_mask(nb * width, v);
  const __m512 table = code_table(g);
  __m512 acc[ZT_MR][2 * ZT_NV];
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
    for (int v = 0; v < nv; v++)
      acc[r][v] = _mm512_setzero_ps();
  for (int64_t grp = 0; grp < g->groups; grp++) {
    prefetch_group(g, grp + ZT_AHEAD, col0, nb * width);
    __m512 part[ZT_MR][2 * ZT_NV];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
      for (int v = 0; v < nv; v++)
        part[r][v] = _mm512_setzero_ps();
    for (int64_t kw = grp * words; kw < (grp + 1) * words; kw++) {
      __m512i w[2 * ZT_NV];
#pragma GCC unroll 8
      for (int v = 0; v < nv; v++)
        w[v] = LOAD_I32(full, mask[v], codes + v / ZT_NV * block_words + kw * width + 16 * (v % ZT_NV));
        /* j outermost: consecutive multiply-adds go to independent accumulators */
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++)
#pragma GCC unroll 8
        for (int v = 0; v < nv; v++) {
          __m512 c = CODE_F32(j ? _mm512_srli_epi32(w[v], 4 * j) : w[v], table);
#pragma GCC unroll 4
          for (int r = 0; r < mr; r++)
            part[r][v] = _mm512_fmadd_ps(c, _mm512_set1_ps(g->x[(m + r) * g->k + kw * 8 + j]), part[r][v]);
        }
    }
#pragma GCC unroll 8
    for (int v = 0; v < nv; v++) {
      __m512 s = load_scales(g, grp * g->n + col0 + 16 * v, mask[v]);
      __m512 z = _mm512_cvtepi32_ps(
          load_zeros(g->zeros ? g->zeros + grp * (g->n / 8) : NULL, col0 + 16 * v, g->n, mask[v]));
#pragma GCC unroll 4
      for (int r = 0; r < mr; r++) {
        __m512 t = _mm512_fnmadd_ps(z, _mm512_set1_ps(g->xsumf[(m + r) * g->groups + grp]), part[r][v]);
        acc[r][v] = _mm512_fmadd_ps(t, s, acc[r][v]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
    for (int v = 0; v < nv; v++)
      STORE_F32(full, mask[v], g->y + (m + r) * g->n + col0 + 16 * v, acc[r][v]);
}

/*
 * Many rows: each group of a block is decoded once into f32 codes in `dec` (words x 4 x 8
 * vectors, in L1 for groups of 128), then every tile of ZT_MR_DEC rows multiplies with it;
 * the f32 accumulators live in y between groups.
 */
#define ZT_MR_DEC 4

ALWAYS_INLINE void w4a16_decoded_tile(const struct zt_gemm *g, const __m512 *dec, int64_t m, int mr,
                                      int64_t b, int64_t grp, const __mmask16 *mask, bool full) {
  int64_t col0 = b * ZT_BLOCK_N, words = g->k / 8 / g->groups;
  __m512 part[ZT_MR_DEC][ZT_NV];
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int v = 0; v < ZT_NV; v++)
      part[r][v] = _mm512_setzero_ps();
  for (int64_t kw = 0; kw < words; kw++) {
    const float *x = g->x + m * g->k + (grp * words + kw) * 8;
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
#pragma GCC unroll 4
      for (int v = 0; v < ZT_NV; v++) {
        __m512 c = dec[(kw * ZT_NV + v) * 8 + j];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
          part[r][v] = _mm512_fmadd_ps(c, _mm512_set1_ps(x[r * g->k + j]), part[r][v]);
      }
  }
#pragma GCC unroll 4
  for (int v = 0; v < ZT_NV; v++) {
    __m512 s = load_scales(g, grp * g->n + col0 + 16 * v, mask[v]);
    __m512 z = _mm512_cvtepi32_ps(
        load_zeros(g->zeros ? g->zeros + grp * (g->n / 8) : NULL, col0 + 16 * v, g->n, mask[v]));
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
      float *y = g->y + (m + r) * g->n + col0 + 16 * v;
      __m512 t = _mm512_fnmadd_ps(z, _mm512_set1_ps(g->xsumf[(m + r) * g->groups + grp]), part[r][v]);
      __m512 prev = grp ? LOAD_F32(full, mask[v], y) : _mm512_setzero_ps();
      STORE_F32(full, mask[v], y, _mm512_fmadd_ps(t, s, prev));
    }
  }
}

ALWAYS_INLINE void w4a16_decoded(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b, __m512 *dec,
                                 bool full) {
  int64_t col0 = b * ZT_BLOCK_N, width = g->n - col0 < ZT_BLOCK_N ? g->n - col0 : ZT_BLOCK_N;
  const int32_t *codes = g->codes + col0 * (g->k / 8);
  int64_t words = g->k / 8 / g->groups;
  __mmask16 mask[ZT_NV];
#pragma GCC unroll 4
  for (int v = 0; v < ZT_NV; v++)
    mask[v] = lane_mask(width, v);
  const __m512 table = code_table(g);
  for (int64_t grp = 0; grp < g->groups; grp++) {
    for (int64_t kw = 0; kw < words; kw++)
#pragma GCC unroll 4
      for (int v = 0; v < ZT_NV; v++) {
        __m512i w = LOAD_I32(full, mask[v], codes + (grp * words + kw) * width + 16 * v);
        for (int j = 0; j < 8; j++)
          dec[(kw * ZT_NV + v) * 8 + j] = CODE_F32(_mm512_srli_epi32(w, 4 * j), table);
      }
    int64_t m = m0;
    for (; m + ZT_MR_DEC <= m1; m += ZT_MR_DEC)
      w4a16_decoded_tile(g, dec, m, ZT_MR_DEC, b, grp, mask, full);
    switch (m1 - m) {
    case 3: w4a16_decoded_tile(g, dec, m, 3, b, grp, mask, full); break;
    case 2: w4a16_decoded_tile(g, dec, m, 2, b, grp, mask, full); break;
    case 1: w4a16_decoded_tile(g, dec, m, 1, b, grp, mask, full); break;
    }
  }
}

void zt_w4a16_avx512(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  if (m1 - m0 >= ZT_MR_DEC) {
    __m512 *dec = _mm_malloc((size_t)(g->k / 8 / g->groups) * ZT_NV * 8 * sizeof *dec, 64);
    if (dec) {
      for (int64_t b = b0; b < b1; b++) {
        if (FULL_BLOCK(g, b))
          w4a16_decoded(g, m0, m1, b, dec, true);
        else
          w4a16_decoded(g, m0, m1, b, dec, false);
      }
      _mm_free(dec);
      return;
    }
  }
  /* Few rows: tiles of two rows by one block, and the last row alone by two full blocks at a time. */
  for (int64_t b = b0; b < b1;) {
    int nb = b + 1 < b1 && FULL_BLOCK(g, b + 1) ? 2 : 1;
    int64_t m = m0;
    for (; m + 2 <= m1; m += 2)
      for (int64_t bb = b; bb < b + nb; bb++) {
        if (FULL_BLOCK(g, bb))
          w4a16_tile(g, m, 2, bb, 1, true);
        else
          w4a16_tile(g, m, 2, bb, 1, false);
      }
    if (m < m1) {
      if (nb == 2)
        w4a16_tile(g, m, 1, b, 2, true);
      else if (FULL_BLOCK(g, b))
        w4a16_tile(g, m, 1, b, 1, true);
      else
        w4a16_tile(g, m, 1, b, 1, false);
    }
    b += nb;
  }
}

/*
 * The da8w4 tile, once per way of forming the int32 dot products: ZT_DOT(acc, codes, act)
 * adds, per 32-bit lane, the four products of the u8 code bytes and the s8 activation bytes.
 */
#define DA8W4_TILE(NAME, ATTR, DOT)                                                                          \
  ATTR ALWAYS_INLINE void NAME(const struct zt_gemm *g, int64_t m, int mr, int64_t b, bool full) {           \
    int64_t col0 = b * ZT_BLOCK_N, width = g->n - col0 < ZT_BLOCK_N ? g->n - col0 : ZT_BLOCK_N;              \
    const int32_t *codes = g->codes + col0 * (g->k / 8);                                                     \
    int64_t words = g->k / 8 / g->groups;                                                                    \
    __mmask16 mask[ZT_NV];                                                                                   \
    _Pragma("GCC unroll 4") for (int v = 0; v < ZT_NV; v++) mask[v] = lane_mask(width, v);                   \
    const __m512i nib = _mm512_set1_epi32(0x0f0f0f0f), flip = _mm512_set1_epi32(g->zeros ? 0 : 0x08080808);  \
    const __m512i ones = _mm512_set1_epi16(1);                                                               \
    (void)ones;                                                                                              \
    __m512 acc[ZT_MR][ZT_NV];                                                                                \
    _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++)                                                     \
        _Pragma("GCC unroll 4") for (int v = 0; v < ZT_NV; v++) acc[r][v] = _mm512_setzero_ps();             \
    for (int64_t grp = 0; grp < g->groups; grp++) {                                                          \
      prefetch_group(g, grp + ZT_AHEAD, col0, width);                                                        \
      __m512i part[ZT_MR][ZT_NV];                                                                            \
      _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++)                                                   \
          _Pragma("GCC unroll 4") for (int v = 0; v < ZT_NV; v++) part[r][v] = _mm512_setzero_si512();       \
      for (int64_t kw = grp * words; kw < (grp + 1) * words; kw++) {                                         \
        const int32_t *row = codes + kw * width;                                                             \
        _Pragma("GCC unroll 4") for (int v = 0; v < ZT_NV; v++) {                                            \
          __m512i w = LOAD_I32(full, mask[v], row + 16 * v);                                                 \
          __m512i lo = CODE(w, nib, flip), hi = CODE(_mm512_srli_epi32(w, 4), nib, flip);                    \
          _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++) {                                             \
            const int32_t *xq = g->xq + (m + r) * (g->k / 4) + 2 * kw;                                       \
            DOT(part[r][v], lo, hi, _mm512_set1_epi32(xq[0]), _mm512_set1_epi32(xq[1]));                     \
          }                                                                                                  \
        }                                                                                                    \
      }                                                                                                      \
      _Pragma("GCC unroll 4") for (int v = 0; v < ZT_NV; v++) {                                              \
        __m512 s = load_scales(g, grp * g->n + col0 + 16 * v, mask[v]);                                      \
        __m512i z = load_zeros(g->zeros ? g->zeros + grp * (g->n / 8) : NULL, col0 + 16 * v, g->n, mask[v]); \
        _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++) {                                               \
          __m512i xs = _mm512_set1_epi32(g->xsum[(m + r) * g->groups + grp]);                                \
          __m512i t = _mm512_sub_epi32(part[r][v], _mm512_mullo_epi32(z, xs));                               \
          acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc[r][v]);                                  \
        }                                                                                                    \
      }                                                                                                      \
    }                                                                                                        \
    _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++) {                                                   \
      __m512 a = _mm512_set1_ps(g->xscale[m + r]);                                                           \
      _Pragma("GCC unroll 4") for (int v = 0; v < ZT_NV; v++)                                                \
          STORE_F32(full, mask[v], g->y + (m + r) * g->n + col0 + 16 * v, _mm512_mul_ps(acc[r][v], a));      \
    }                                                                                                        \
  }

/*
 * Many rows (da8w4). A call's rows go in passes of up to ZT_PASS_ROWS. Per pass and group,
 * the block's codes of the group are decoded once into u8 code vectors (`dec`: per word the
 * ZT_NV lo vectors, codes of k 0,2,4,6, then the ZT_NV hi ones, k 1,3,5,7; 512 bytes a word,
 * 8 KiB for groups of 128), then tiles of up to MR rows by the whole block multiply with them:
 * MR x ZT_NV int32 sums in zmm registers, each activation quad broadcast once per row and
 * half-word. The f32 sums over the groups so far live in `acc` ([ZT_PASS_ROWS][ZT_BLOCK_N],
 * 16 KiB) rather than in y, whose rows N floats apart would share a few L1 sets; after the
 * last group they go to y times the row scale. Per element the operations, and the order of
 * the float ones, are the direct tile's, so y is the same bit for bit whatever the rows of a call.
 */
#define ZT_PASS_ROWS 64

/* What a da8w4 call decodes into and sums in, and the current group's scales and zero points of the block. */
struct da8w4_scratch {
  __m512i *dec; /* [words per group][2][ZT_NV] */
  float *acc;   /* [ZT_PASS_ROWS][ZT_BLOCK_N], zero before a pass's first group */
  __m512 scale[ZT_NV];
  __m512i minus_zero[ZT_NV]; /* -z (asymmetric layers read it) */
};

/* Decodes group grp of block b into s->dec and loads its scales and zero points into s. */
ALWAYS_INLINE void da8w4_decode_group(const struct zt_gemm *g, struct da8w4_scratch *s, int64_t b,
                                      int64_t grp, const __mmask16 *mask, bool full) {
  int64_t col0 = b * ZT_BLOCK_N, width = g->n - col0 < ZT_BLOCK_N ? g->n - col0 : ZT_BLOCK_N;
  int64_t words = g->k / 8 / g->groups;
  const int32_t *codes = g->codes + col0 * (g->k / 8) + grp * words * width;
  const __m512i nib = _mm512_set1_epi32(0x0f0f0f0f), flip = _mm512_set1_epi32(g->zeros ? 0 : 0x08080808);
  prefetch_group(g, grp + ZT_AHEAD, col0, width);
  bool ahead = grp + 1 < g->groups;
  for (int64_t kw = 0; kw < words; kw++) {
    __m512i *d = s->dec + kw * 2 * ZT_NV;
    /* The next group's codes, on their way from memory while the rows multiply with these. */
    if (ahead)
      for (int64_t line = 0; line < width * 4; line += 64)
        _mm_prefetch((const char *)(codes + (words + kw) * width) + line, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int v = 0; v < ZT_NV; v++) {
      __m512i w = LOAD_I32(full, mask[v], codes + kw * width + 16 * v);
      d[v] = CODE(w, nib, flip);
      d[ZT_NV + v] = CODE(_mm512_srli_epi32(w, 4), nib, flip);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < ZT_NV; v++) {
    s->scale[v] = load_scales(g, grp * g->n + col0 + 16 * v, mask[v]);
    s->minus_zero[v] =
        _mm512_sub_epi32(_mm512_setzero_si512(), load_zeros(g->zeros ? g->zeros + grp * (g->n / 8) : NULL,
                                                            col0 + 16 * v, g->n, mask[v]));
  }
}

/*
 * The int32 sums of rows m..m+mr-1 before group grp's products: minus the group's zero-point
 * correction z * xsum (int32 arithmetic wraps, so adding it first or last gives the same sum).
 */
ALWAYS_INLINE void da8w4_start_group(const struct zt_gemm *g, const struct da8w4_scratch *s,
                                     __m512i part[][ZT_NV], int64_t m, int mr, int64_t grp) {
  const int32_t *xsum = g->xsum + m * g->groups + grp;
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) {
    __m512i xs = _mm512_set1_epi32(xsum[r * g->groups]);
    if (!g->zeros) { /* every zero 8 (s4 codes): one shift for the whole row */
      __m512i minus = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(xs, 3));
#pragma GCC unroll 4
      for (int v = 0; v < ZT_NV; v++)
        part[r][v] = minus;
    } else {
#pragma GCC unroll 4
      for (int v = 0; v < ZT_NV; v++)
        part[r][v] = _mm512_mullo_epi32(s->minus_zero[v], xs);
    }
  }
}

/*
 * The end of group grp for rows m..m+mr-1 of the pass starting at row `first`: the int32 sums
 * scaled into the f32 sums, and after the last group times the row scale into y.
 */
ALWAYS_INLINE void da8w4_end_group(const struct zt_gemm *g, const struct da8w4_scratch *s,
                                   __m512i part[][ZT_NV], int64_t m, int mr, int64_t first, int64_t b,
                                   int64_t grp, const __mmask16 *mask, bool full) {
  float *acc = s->acc + (m - first) * ZT_BLOCK_N;
  if (grp < g->groups - 1) {
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
      for (int v = 0; v < ZT_NV; v++) {
        float *sum = acc + r * ZT_BLOCK_N + 16 * v;
        _mm512_store_ps(sum,
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[r][v]), s->scale[v], _mm512_load_ps(sum)));
      }
    return;
  }
  float *y = g->y + m * g->n + b * ZT_BLOCK_N;
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) {
    __m512 a = _mm512_set1_ps(g->xscale[m + r]);
#pragma GCC unroll 4
    for (int v = 0; v < ZT_NV; v++) {
      __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[r][v]), s->scale[v],
                                   _mm512_load_ps(acc + r * ZT_BLOCK_N + 16 * v));
      STORE_F32(full, mask[v], y + r * g->n + 16 * v, _mm512_mul_ps(sum, a));
    }
  }
}

#define VNNI __attribute__((target("avx512vnni")))
#define ZT_MR_VNNI 6 /* 24 sums, 4 code vectors and a broadcast: 29 of the 32 zmm registers */
#define ZT_MR_BW 4   /* 16 sums, 8 code vectors, 2 broadcasts and the int16 steps */

/*
 * *acc += the u8 x s8 quad products of c and a (vpdpbusd), in place. Written in asm because gcc 12
 * keeps the intrinsic's result apart from its accumulator input: with 24 sums live it copied them
 * from register to register and spilled them, at half the rate of this form.
 */
VNNI ALWAYS_INLINE void dpbusd(__m512i *acc, __m512i c, __m512i a) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(*acc) : "v"(c), "v"(a));
}

/* Group grp for rows m..m+mr-1 (mr <= ZT_MR_VNNI) with vpdpbusd: per half-word, 4 code vectors times each
 * row's quad. */
VNNI ALWAYS_INLINE void da8w4_rows_vnni(const struct zt_gemm *g, const struct da8w4_scratch *s, int64_t m,
                                        int mr, int64_t first, int64_t b, int64_t grp, const __mmask16 *mask,
                                        bool full) {
  int64_t words = g->k / 8 / g->groups, stride = g->k / 4;
  const int32_t *xq = g->xq + m * stride + 2 * grp * words;
  __m512i part[ZT_MR_VNNI][ZT_NV];
  da8w4_start_group(g, s, part, m, mr, grp);
  for (int64_t kw = 0; kw < words; kw++) {
    const __m512i *d = s->dec + kw * 2 * ZT_NV;
#pragma GCC unroll 2
    for (int half = 0; half < 2; half++) {
      __m512i c[ZT_NV];
#pragma GCC unroll 4
      for (int v = 0; v < ZT_NV; v++)
        c[v] = d[half * ZT_NV + v];
#pragma GCC unroll 8
      for (int r = 0; r < mr; r++) {
        __m512i a = _mm512_set1_epi32(xq[r * stride + 2 * kw + half]);
#pragma GCC unroll 4
        for (int v = 0; v < ZT_NV; v++)
          dpbusd(&part[r][v], c[v], a);
      }
    }
  }
  da8w4_end_group(g, s, part, m, mr, first, b, grp, mask, full);
}

/*
 * The same without VNNI: u8 x s8 pairs into int16 (at most 2 * 15 * 127 each, and 4 of them
 * per lane pair after adding lo and hi: no saturation), then pairs of int16 into int32.
 */
#define DOT_BW(acc, lo, hi, xe, xo)                                                                          \
  acc = _mm512_add_epi32(                                                                                    \
      acc,                                                                                                   \
      _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo, xe), _mm512_maddubs_epi16(hi, xo)), ones))
ALWAYS_INLINE void da8w4_rows_bw(const struct zt_gemm *g, const struct da8w4_scratch *s, int64_t m, int mr,
                                 int64_t first, int64_t b, int64_t grp, const __mmask16 *mask, bool full) {
  int64_t words = g->k / 8 / g->groups, stride = g->k / 4;
  const int32_t *xq = g->xq + m * stride + 2 * grp * words;
  const __m512i ones = _mm512_set1_epi16(1);
  __m512i part[ZT_MR_BW][ZT_NV];
  da8w4_start_group(g, s, part, m, mr, grp);
  for (int64_t kw = 0; kw < words; kw++) {
    const __m512i *d = s->dec + kw * 2 * ZT_NV;
#pragma GCC unroll 4
    for (int v = 0; v < ZT_NV; v++)
#pragma GCC unroll 8
      for (int r = 0; r < mr; r++)
        DOT_BW(part[r][v], d[v], d[ZT_NV + v], _mm512_set1_epi32(xq[r * stride + 2 * kw]),
               _mm512_set1_epi32(xq[r * stride + 2 * kw + 1]));
  }
  da8w4_end_group(g, s, part, m, mr, first, b, grp, mask, full);
}

/*
 * Rows [m0, m1) of block b through ROWS (tiles of MR rows and one of the rest), pass by pass and
 * group by group.
 */
#define DA8W4_DECODED(NAME, ATTR, ROWS, MR)                                                                  \
  ATTR ALWAYS_INLINE void NAME(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b,                   \
                               struct da8w4_scratch *s, bool full) {                                         \
    int64_t width = g->n - b * ZT_BLOCK_N < ZT_BLOCK_N ? g->n - b * ZT_BLOCK_N : ZT_BLOCK_N;                 \
    __mmask16 mask[ZT_NV];                                                                                   \
    _Pragma("GCC unroll 4") for (int v = 0; v < ZT_NV; v++) mask[v] = lane_mask(width, v);                   \
    for (int64_t first = m0; first < m1; first += ZT_PASS_ROWS) {                                            \
      int64_t end = first + ZT_PASS_ROWS < m1 ? first + ZT_PASS_ROWS : m1;                                   \
      memset(s->acc, 0, (size_t)(end - first) * ZT_BLOCK_N * sizeof *s->acc);                                \
      for (int64_t grp = 0; grp < g->groups; grp++) {                                                        \
        da8w4_decode_group(g, s, b, grp, mask, full);                                                        \
        int64_t m = first;                                                                                   \
        for (; m + MR <= end; m += MR)                                                                       \
          ROWS(g, s, m, MR, first, b, grp, mask, full);                                                      \
        int64_t left = end - m; /* fewer than MR; MR is at most 6 */                                         \
        if (MR > 5 && left == 5)                                                                             \
          ROWS(g, s, m, 5, first, b, grp, mask, full);                                                       \
        else if (MR > 4 && left == 4)                                                                        \
          ROWS(g, s, m, 4, first, b, grp, mask, full);                                                       \
        else if (left == 3)                                                                                  \
          ROWS(g, s, m, 3, first, b, grp, mask, full);                                                       \
        else if (left == 2)                                                                                  \
          ROWS(g, s, m, 2, first, b, grp, mask, full);                                                       \
        else if (left == 1)                                                                                  \
          ROWS(g, s, m, 1, first, b, grp, mask, full);                                                       \
      }                                                                                                      \
    }                                                                                                        \
  }

/* The entry point of one way of forming the products: the decoded path for many rows, direct tiles of ZT_MR
 * rows for few. */
#define DA8W4_ENTRY(NAME, ATTR, TILE, DECODED)                                                               \
  ATTR void NAME(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {                  \
    if (m1 - m0 >= ZT_MR_DEC) {                                                                              \
      struct da8w4_scratch s;                                                                                \
      s.dec = _mm_malloc((size_t)(g->k / 8 / g->groups) * 2 * ZT_NV * sizeof *s.dec, 64);                    \
      s.acc = _mm_malloc((size_t)ZT_PASS_ROWS * ZT_BLOCK_N * sizeof *s.acc, 64);                             \
      if (s.dec && s.acc) {                                                                                  \
        for (int64_t b = b0; b < b1; b++) {                                                                  \
          if (FULL_BLOCK(g, b))                                                                              \
            DECODED(g, m0, m1, b, &s, true);                                                                 \
          else                                                                                               \
            DECODED(g, m0, m1, b, &s, false);                                                                \
        }                                                                                                    \
        _mm_free(s.dec);                                                                                     \
        _mm_free(s.acc);                                                                                     \
        return;                                                                                              \
      }                                                                                                      \
      _mm_free(s.dec);                                                                                       \
      _mm_free(s.acc);                                                                                       \
    }                                                                                                        \
    for (int64_t b = b0; b < b1; b++)                                                                        \
      for (int64_t m = m0; m < m1; m += ZT_MR) {                                                             \
        bool two = m1 - m >= 2;                                                                              \
        if (FULL_BLOCK(g, b))                                                                                \
          two ? TILE(g, m, 2, b, true) : TILE(g, m, 1, b, true);                                             \
        else                                                                                                 \
          two ? TILE(g, m, 2, b, false) : TILE(g, m, 1, b, false);                                           \
      }                                                                                                      \
  }

DA8W4_TILE(da8w4_tile_bw, , DOT_BW)
DA8W4_DECODED(da8w4_decoded_bw, , da8w4_rows_bw, ZT_MR_BW)
DA8W4_ENTRY(zt_da8w4_avx512, , da8w4_tile_bw, da8w4_decoded_bw)

#define DOT_VNNI(acc, lo, hi, xe, xo) acc = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, xe), hi, xo)
DA8W4_TILE(da8w4_tile_vnni, VNNI, DOT_VNNI)
DA8W4_DECODED(da8w4_decoded_vnni, VNNI, da8w4_rows_vnni, ZT_MR_VNNI)
DA8W4_ENTRY(zt_da8w4_avx512_vnni, VNNI, da8w4_tile_vnni, da8w4_decoded_vnni)

/* ---- AMX: da8w4 from ZT_AMX_MIN_ROWS rows on AMX-INT8 tiles ----------------------------------------- */

/*
 * Per pass (up to ZT_PASS_ROWS rows) and group, the group's codes are decoded as for the VNNI
 * path (da8w4_decode_group): that buffer is tdpbsud's B operand already (zentorch.h), row r of
 * code tile v at byte 256 r + 64 v. Then per pair of 16-row tiles and pair of 16-column tiles:
 *   tmm0-3  the int32 sums of the 2 x 2 output tiles, zeroed per group,
 *   tmm4-5  the two row tiles' activations, `ks` bytes a row (zt_amx_kstep) from xq_tiles, where
 *           a tile's rows are contiguous,
 *   tmm6-7  the two column tiles' codes, ks / 4 rows of 64 bytes,
 * stored after the group into `sums` ([ZT_PASS_ROWS][ZT_BLOCK_N] int32), from where the VNNI
 * path's own steps (da8w4_start_group's zero-point term, da8w4_end_group) finish the group.
 * The last pair of a pass may reach past m1 into xq_tiles' zero rows; their sums are not read.
 */
struct amx_config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

#ifdef ZT_AMX_EMULATE
/*
 * The tests' software model of the tile registers (tests/check_zentorch_amx.c builds this file
 * with ZT_AMX_EMULATE, to run the AMX kernel's addressing on a CPU without AMX): the
 * instructions as the Intel SDM defines them, aborting where the hardware would fault on a shape.
 */
#include <stdlib.h>
struct amx_tile {
  int rows, colsb;
  uint8_t b[16][64];
};
static _Thread_local struct amx_tile amx_tmm[8];
static _Thread_local bool amx_configured;
static void amx_emu_config(const struct amx_config *c) {
  if (c->palette != 1)
    abort();
  for (int t = 0; t < 8; t++) {
    if (c->rows[t] > 16 || c->colsb[t] > 64 || c->colsb[t] % 4)
      abort();
    amx_tmm[t].rows = c->rows[t], amx_tmm[t].colsb = c->colsb[t];
    memset(amx_tmm[t].b, 0, sizeof amx_tmm[t].b);
  }
  amx_configured = true;
}
static struct amx_tile *amx_emu_tile(int t) {
  if (!amx_configured || t < 0 || t > 7 || !amx_tmm[t].rows)
    abort();
  return &amx_tmm[t];
}
static void amx_emu_zero(int t) { memset(amx_emu_tile(t)->b, 0, sizeof amx_tmm[t].b); }
static void amx_emu_load(int t, const void *p, int64_t stride) {
  struct amx_tile *x = amx_emu_tile(t);
  memset(x->b, 0, sizeof x->b);
  for (int r = 0; r < x->rows; r++)
    memcpy(x->b[r], (const char *)p + r * stride, (size_t)x->colsb);
}
static void amx_emu_store(int t, void *p, int64_t stride) {
  struct amx_tile *x = amx_emu_tile(t);
  for (int r = 0; r < x->rows; r++)
    memcpy((char *)p + r * stride, x->b[r], (size_t)x->colsb);
}
/* tdpbsud: C[m][n] += sum over k of (s8) A[m][k] * (u8) B[k / 4][4 n + k % 4], in int32. */
static void amx_emu_dpbsud(int tc, int ta, int tb) {
  struct amx_tile *c = amx_emu_tile(tc), *a = amx_emu_tile(ta), *b = amx_emu_tile(tb);
  if (a->rows != c->rows || b->rows != a->colsb / 4 || b->colsb != c->colsb)
    abort();
  for (int m = 0; m < c->rows; m++)
    for (int n = 0; n < c->colsb / 4; n++) {
      int32_t sum;
      memcpy(&sum, &c->b[m][4 * n], 4);
      for (int k = 0; k < a->colsb; k++)
        sum = (int32_t)((uint32_t)sum + (uint32_t)((int8_t)a->b[m][k] * (int32_t)b->b[k / 4][4 * n + k % 4]));
      memcpy(&c->b[m][4 * n], &sum, 4);
    }
}
#define AMX_ATTR VNNI
#define AMX_CONFIG(c) amx_emu_config(c)
#define AMX_ZERO(t) amx_emu_zero(t)
#define AMX_LOAD(t, p, stride) amx_emu_load(t, p, stride)
#define AMX_STORE(t, p, stride) amx_emu_store(t, p, stride)
#define AMX_DP(c, a, b) amx_emu_dpbsud(c, a, b)
#define AMX_RELEASE() (void)(amx_configured = false)
#else
#define AMX_ATTR __attribute__((target("avx512vnni,amx-tile,amx-int8")))
#define AMX_CONFIG(c) _tile_loadconfig(c)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define AMX_STORE(t, p, stride) _tile_stored(t, p, stride)
#define AMX_DP(c, a, b) _tile_dpbsud(c, a, b)
#define AMX_RELEASE() _tile_release()
#endif

/* The tiles' shapes for steps of ks bytes (rows and bytes per row, tmm0-7 as above). */
static void amx_configure(struct amx_config *c, int ks) {
  memset(c, 0, sizeof *c);
  c->palette = 1;
  for (int t = 0; t < 4; t++)
    c->rows[t] = 16, c->colsb[t] = 64;
  for (int t = 4; t < 6; t++)
    c->rows[t] = 16, c->colsb[t] = (uint16_t)ks;
  for (int t = 6; t < 8; t++)
    c->rows[t] = (uint8_t)(ks / 4), c->colsb[t] = 64;
}

/* Group grp's sums for rows m..m+mr-1 of the pass at `first`, from the tile sums, into the f32 sums or y. */
AMX_ATTR ALWAYS_INLINE void da8w4_amx_rows(const struct zt_gemm *g, const struct da8w4_scratch *s,
                                           const int32_t *sums, int64_t m, int mr, int64_t first, int64_t b,
                                           int64_t grp, const __mmask16 *mask, bool full) {
  __m512i part[8][ZT_NV];
  da8w4_start_group(g, s, part, m, mr, grp);
  const int32_t *row = sums + (m - first) * ZT_BLOCK_N;
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int v = 0; v < ZT_NV; v++)
      part[r][v] = _mm512_add_epi32(part[r][v], _mm512_load_si512(row + r * ZT_BLOCK_N + 16 * v));
  da8w4_end_group(g, s, part, m, mr, first, b, grp, mask, full);
}

/* Rows [m0, m1) of block b (m0 a multiple of ZT_AMX_PAD_ROWS), the tiles configured for steps of ks bytes. */
AMX_ATTR ALWAYS_INLINE void da8w4_amx_block(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b,
                                            int ks, struct da8w4_scratch *s, int32_t *sums, bool full) {
  int64_t width = g->n - b * ZT_BLOCK_N < ZT_BLOCK_N ? g->n - b * ZT_BLOCK_N : ZT_BLOCK_N;
  int64_t gs = g->k / g->groups;
  int col_pairs = width > 32 ? 2 : 1;
  __mmask16 mask[ZT_NV];
#pragma GCC unroll 4
  for (int v = 0; v < ZT_NV; v++)
    mask[v] = lane_mask(width, v);
  for (int64_t first = m0; first < m1; first += ZT_PASS_ROWS) {
    int64_t end = first + ZT_PASS_ROWS < m1 ? first + ZT_PASS_ROWS : m1;
    memset(s->acc, 0, (size_t)(end - first) * ZT_BLOCK_N * sizeof *s->acc);
    for (int64_t grp = 0; grp < g->groups; grp++) {
      da8w4_decode_group(g, s, b, grp, mask, full);
      const char *dec = (const char *)s->dec;
      for (int64_t p = first; p < end; p += 32) {
        /* K slice s of rows p.. is at (s * xq_rows + p) * ks in xq_tiles; the group starts at slice
         * grp * gs / ks. */
        const char *xa = (const char *)g->xq_tiles + (grp * gs / ks * g->xq_rows + p) * ks;
        for (int cp = 0; cp < col_pairs; cp++) {
          AMX_ZERO(0);
          AMX_ZERO(1);
          AMX_ZERO(2);
          AMX_ZERO(3);
          for (int64_t kk = 0; kk < gs; kk += ks) {
            const char *step = xa + kk / ks * g->xq_rows * ks;
            AMX_LOAD(4, step, ks);
            AMX_LOAD(5, step + 16 * ks, ks);
            AMX_LOAD(6, dec + kk / 4 * 256 + cp * 128, 256);
            AMX_LOAD(7, dec + kk / 4 * 256 + cp * 128 + 64, 256);
            AMX_DP(0, 4, 6);
            AMX_DP(1, 4, 7);
            AMX_DP(2, 5, 6);
            AMX_DP(3, 5, 7);
          }
          int32_t *c = sums + (p - first) * ZT_BLOCK_N + cp * 32;
          AMX_STORE(0, c, 4 * ZT_BLOCK_N);
          AMX_STORE(1, c + 16, 4 * ZT_BLOCK_N);
          AMX_STORE(2, c + 16 * ZT_BLOCK_N, 4 * ZT_BLOCK_N);
          AMX_STORE(3, c + 16 * ZT_BLOCK_N + 16, 4 * ZT_BLOCK_N);
        }
      }
      int64_t m = first;
      for (; m + 8 <= end; m += 8)
        da8w4_amx_rows(g, s, sums, m, 8, first, b, grp, mask, full);
      if (m < end)
        da8w4_amx_rows(g, s, sums, m, (int)(end - m), first, b, grp, mask, full);
    }
  }
}

AMX_ATTR void zt_da8w4_amx(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  if (m1 - m0 < ZT_AMX_MIN_ROWS || !g->xq_tiles) {
    zt_da8w4_avx512_vnni(g, m0, m1, b0, b1);
    return;
  }
  struct da8w4_scratch s;
  s.dec = _mm_malloc((size_t)(g->k / 8 / g->groups) * 2 * ZT_NV * sizeof *s.dec, 64);
  s.acc = _mm_malloc((size_t)ZT_PASS_ROWS * ZT_BLOCK_N * sizeof *s.acc, 64);
  int32_t *sums = _mm_malloc((size_t)ZT_PASS_ROWS * ZT_BLOCK_N * sizeof *sums, 64);
  if (s.dec && s.acc && sums) {
    int ks = zt_amx_kstep(g->k / g->groups);
    struct amx_config cfg;
    amx_configure(&cfg, ks);
    AMX_CONFIG(&cfg);
    for (int64_t b = b0; b < b1; b++) {
      if (FULL_BLOCK(g, b))
        da8w4_amx_block(g, m0, m1, b, ks, &s, sums, true);
      else
        da8w4_amx_block(g, m0, m1, b, ks, &s, sums, false);
    }
    AMX_RELEASE();
  } else {
    zt_da8w4_avx512_vnni(g, m0, m1, b0, b1);
  }
  _mm_free(s.dec);
  _mm_free(s.acc);
  _mm_free(sums);
}
