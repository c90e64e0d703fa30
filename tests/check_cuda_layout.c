/*
 * check_cuda_layout.c: the cuda-nvfp4 kernel layouts on the CPU (no GPU
 * needed). The scale swizzle against vLLM's formula (its NVFP4 block-scale
 * swizzle, written out here independently of layout.h); both
 * layouts as bijections of their padded domains; transform round trips with
 * zero padding; and the weight tiles read back the way the GEMM reads them:
 * an emulation of mma.m16n8k16's fragments, fed by the same bit tricks the
 * kernel uses, must reproduce x W^T exactly; the same tiles as the wgmma kernel's
 * register-sourced A with the activations staged for its shared-memory B operand, likewise; and
 * the in-place transforms, emulated group by group through a cluster's slices as the kernel runs
 * them, give the transforms' bytes.
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "cuda_nvfp4.h"
#include "layout.h"
#include "mxfp4.h"
#include "private.h"
#include "testutil.h"

/* Shapes: [rows, k] with k % 16 == 0; aligned and ragged in every dimension. */
static const int64_t shapes[][2] = {{1, 16},    {5, 48},    {16, 64},   {17, 80},  {128, 64},
                                    {130, 112}, {300, 208}, {256, 256}, {40, 1024}};
#define N_SHAPES (sizeof shapes / sizeof shapes[0])

/* ---- scales ------------------------------------------------------------------------------ */

/* vLLM's swizzle_blockscale: reshape (M'/128, 4, 32, Kb'/4, 4), permute to
 * (M'/128, Kb'/4, 32, 4, 4), flatten: element (m, k) lands at
 * (((m/128)(Kb'/4) + k/4) * 32 + m%32) * 16 + ((m%128)/32) * 4 + k%4. */
static int64_t vllm_swizzle_offset(int64_t m, int64_t k, int64_t kb_padded) {
  return (((m / 128) * (kb_padded / 4) + k / 4) * 32 + m % 32) * 16 + ((m % 128) / 32) * 4 + k % 4;
}

START_TEST(test_sf_offset_matches_vllm) {
  for (int64_t cols = 1; cols <= 13; cols++) {
    int64_t cp = nvfp4_sf_cols(cols);
    for (int64_t r = 0; r < 384; r++)
      for (int64_t c = 0; c < cp; c++)
        ck_assert_int_eq(nvfp4_sf_offset(r, c, cp), vllm_swizzle_offset(r, c, cp));
  }
  /* Spot values worked out by hand: row 33, column 5 of a 4-atom-wide matrix is in atom 1,
   * at 16 * (33 % 32) + 4 * (33 / 32) + 5 % 4 = 16 + 4 + 1. */
  ck_assert_int_eq(nvfp4_sf_offset(33, 5, 16), 512 + 21);
  ck_assert_int_eq(nvfp4_sf_offset(128, 0, 8), 2 * 512);
  ck_assert_int_eq(nvfp4_sf_rows(1), 128);
  ck_assert_int_eq(nvfp4_sf_cols(5), 8);
}
END_TEST

START_TEST(test_sf_bijection) {
  for (size_t s = 0; s < N_SHAPES; s++) {
    int64_t rows = shapes[s][0], cols = shapes[s][1] / 16, cp = nvfp4_sf_cols(cols);
    int64_t bytes = nvfp4_sf_bytes(rows, cols);
    uint8_t *seen = calloc((size_t)bytes, 1);
    for (int64_t off = 0; off < bytes; off++) {
      int64_t r, c;
      nvfp4_sf_source(off, cp, &r, &c);
      ck_assert(r >= 0 && r < nvfp4_sf_rows(rows) && c >= 0 && c < cp);
      ck_assert_int_eq(nvfp4_sf_offset(r, c, cp), off);
      ck_assert(!seen[off]);
      seen[off] = 1;
    }
    free(seen);
  }
}
END_TEST

START_TEST(test_sf_round_trip) {
  for (size_t s = 0; s < N_SHAPES; s++) {
    int64_t rows = shapes[s][0], cols = shapes[s][1] / 16, cp = nvfp4_sf_cols(cols);
    size_t n = (size_t)(rows * cols), bytes = (size_t)nvfp4_sf_bytes(rows, cols);
    uint8_t *src = tu_xmalloc(n), *sw = tu_xmalloc(bytes), *back = tu_xmalloc(n);
    tu_fill_bytes(src, n, 11 + s);
    memset(sw, 0xee, bytes);
    nvfp4_swizzle_scales(src, rows, cols, sw);
    for (int64_t r = 0; r < rows; r++)
      for (int64_t c = 0; c < cols; c++)
        ck_assert_uint_eq(sw[vllm_swizzle_offset(r, c, cp)], src[r * cols + c]);
    /* Every byte that holds no scale is zero padding. */
    size_t used = 0;
    for (size_t off = 0; off < bytes; off++) {
      int64_t r, c;
      nvfp4_sf_source((int64_t)off, cp, &r, &c);
      if (r < rows && c < cols)
        used++;
      else
        ck_assert_uint_eq(sw[off], 0);
    }
    ck_assert_uint_eq(used, n);
    nvfp4_unswizzle_scales(sw, rows, cols, back);
    ck_assert(memcmp(src, back, n) == 0);
    free(src), free(sw), free(back);
  }
}
END_TEST

/* ---- weights ----------------------------------------------------------------------------- */

START_TEST(test_w_bijection) {
  for (size_t s = 0; s < N_SHAPES; s++) {
    int64_t rows = shapes[s][0], k = shapes[s][1], chunks = nvfp4_w_chunks(k);
    int64_t words = nvfp4_w_bytes(rows, k) / 4;
    ck_assert_int_eq(nvfp4_w_bytes(rows, k), nvfp4_w_rows(rows) * nvfp4_round_up(k, 64) / 2);
    if (rows % 16 == 0 && k % 64 == 0)
      ck_assert_int_eq(nvfp4_w_bytes(rows, k),
                       rows * k / 2); /* same size as the checkpoint: repacked in place */
    uint8_t *seen = calloc((size_t)words * 8, 1);
    for (int64_t w = 0; w < words; w++)
      for (int slot = 0; slot < 8; slot++) {
        int64_t r, kk;
        int slot2;
        nvfp4_w_source(w, slot, rows, chunks, &r, &kk);
        ck_assert(r >= 0 && r < nvfp4_w_rows(rows) && kk >= 0 && kk < chunks * 64);
        ck_assert_int_eq(nvfp4_w_position(r, kk, rows, chunks, &slot2), w);
        ck_assert_int_eq(slot2, slot);
        ck_assert(!seen[8 * w + slot]);
        seen[8 * w + slot] = 1;
      }
    free(seen);
  }
  /* The eight slots of a word use its 32 bits exactly once. */
  uint32_t all = 0;
  for (int slot = 0; slot < 8; slot++) {
    uint32_t bits = nvfp4_w_put(0, slot, 0xf);
    ck_assert_int_eq(__builtin_popcount(bits), 4);
    ck_assert_uint_eq(all & bits, 0);
    all |= bits;
    for (unsigned code = 0; code < 16; code++)
      ck_assert_uint_eq(nvfp4_w_get(nvfp4_w_put(0, slot, code) | ~bits, slot), code);
  }
  ck_assert_uint_eq(all, 0xffffffffu);
}
END_TEST

START_TEST(test_w_layout_by_hand) {
  /* K = 64, one tile: lane 4g + t holds rows g and g + 8 at k = 16t .. 16t + 15, word j
   * for k-step j. Row 0, k 0 (e 0, row g) is a0: word 0, slot 0, at the bits of a bf16
   * (m 6, e0 7, e1 8, s 15). */
  int slot;
  ck_assert_int_eq(nvfp4_w_position(0, 0, 16, 1, &slot), 0);
  ck_assert_int_eq(slot, 0);
  ck_assert_uint_eq(nvfp4_w_put(0, 0, 0xf), 0x000081c0u);
  /* Row 0, k 1: a1, slot 1, the high bf16 (bits 22, 23, 24, 31). Row 8, k 1: a3, slot 3,
   * the high half shifted down by 3 (19, 20, 21, 28). */
  ck_assert_int_eq(nvfp4_w_position(0, 1, 16, 1, &slot), 0);
  ck_assert_int_eq(slot, 1);
  ck_assert_uint_eq(nvfp4_w_put(0, 1, 0xf), 0x81c00000u);
  ck_assert_int_eq(nvfp4_w_position(8, 1, 16, 1, &slot), 0);
  ck_assert_int_eq(slot, 3);
  ck_assert_uint_eq(nvfp4_w_put(0, 3, 0xf), 0x10380000u);
  /* Row 9, k = 16 * 2 + 4 * 3 + 2 (g 1, t 2, j 3, e 2, row g + 8): lane 6, word 3, a6,
   * slot 6, the leftover bits 10, 11, 13, 14. */
  ck_assert_int_eq(nvfp4_w_position(9, 46, 16, 1, &slot), 6 * 4 + 3);
  ck_assert_int_eq(slot, 6);
  ck_assert_uint_eq(nvfp4_w_put(0, 6, 0xf), 0x00006c00u);
  ck_assert_uint_eq(nvfp4_w_put(0, 7, 0xf), 0x6c000000u);
  /* Tiles interleave per chunk within a group of 8: with 2 tiles (32 rows), row 16 at
   * chunk 1 is unit 1 * 2 + 1; with 10 tiles (160 rows), tile 9 is in the second group (2
   * tiles, after 8 x 3 units of the first), chunk 0: unit 24 + 1; tile 7, chunk 2 of the
   * first: 2 * 8 + 7. */
  ck_assert_int_eq(nvfp4_w_position(16, 64, 32, 3, &slot), (1 * 2 + 1) * 128);
  ck_assert_int_eq(nvfp4_w_position(9 * 16, 0, 160, 3, &slot), (24 + 1) * 128);
  ck_assert_int_eq(nvfp4_w_position(7 * 16, 128, 160, 3, &slot), (2 * 8 + 7) * 128);
  ck_assert_int_eq(nvfp4_w_tile_offset(9, 2, 10, 3), (24 + 2 * 2 + 1) * 512);
}
END_TEST

START_TEST(test_w_round_trip) {
  for (size_t s = 0; s < N_SHAPES; s++) {
    int64_t rows = shapes[s][0], k = shapes[s][1];
    size_t n = (size_t)(rows * k / 2), bytes = (size_t)nvfp4_w_bytes(rows, k);
    uint8_t *src = tu_xmalloc(n), *tiled = tu_xmalloc(bytes), *back = tu_xmalloc(n);
    tu_fill_bytes(src, n, 29 + s);
    memset(tiled, 0xee, bytes);
    nvfp4_tile_weights(src, rows, k, tiled);
    for (size_t w = 0; w < bytes / 4; w++)
      for (int slot = 0; slot < 8; slot++) {
        int64_t r, kk;
        uint32_t word;
        memcpy(&word, tiled + 4 * w, 4);
        nvfp4_w_source((int64_t)w, slot, rows, nvfp4_w_chunks(k), &r, &kk);
        unsigned want = r < rows && kk < k ? qk_fp4_code(src + r * (k / 2), kk) : 0;
        ck_assert_uint_eq(nvfp4_w_get(word, slot), want);
      }
    nvfp4_untile_weights(tiled, rows, k, back);
    ck_assert(memcmp(src, back, n) == 0);
    free(src), free(tiled), free(back);
  }
}
END_TEST

/* ---- the transforms in place ------------------------------------------------------------ */

/* The bytes at `at` of a group spread over parts of `slice` bytes (a cluster's shared memory). */
static const uint8_t *in_slices(uint8_t *const *part, int64_t slice, unsigned at) {
  return part[at / slice] + at % slice;
}

/*
 * What the GPU's in-place transform does, block by block: per expert and 128-row group, each of the
 * cluster's parts takes its slice of the group, then writes its share of the group's units from the
 * slices (layout.h's nvfp4_w_lane_reads / nvfp4_sf_group_read, as the kernel). k is the scales'
 * columns for scales. -1 when the group is too large for a cluster.
 */
static int emulate_in_place(bool scales, uint8_t *data, int64_t experts, int64_t rows, int64_t k) {
  const unsigned row_bytes = (unsigned)(scales ? k : k / 2);
  const int64_t tiles = rows / 16, groups = scales ? rows / 128 : (tiles + 7) / 8;
  int64_t parts, slice;
  if (nvfp4_in_place_split((scales || tiles >= 8 ? 128 : rows) * (int64_t)row_bytes, &parts, &slice))
    return -1;
  uint8_t *part[NVFP4_IN_PLACE_MAX_PARTS];
  for (int64_t p = 0; p < parts; p++)
    part[p] = tu_xmalloc((size_t)slice);
  for (int64_t e = 0; e < experts; e++)
    for (int64_t g = 0; g < groups; g++) {
      const unsigned group_tiles = scales ? 8u : (unsigned)(tiles - g * 8 < 8 ? tiles - g * 8 : 8);
      const unsigned bytes = group_tiles * 16 * row_bytes,
                     units = scales ? row_bytes / 4 : group_tiles * (row_bytes / 32);
      uint8_t *base = data + ((size_t)e * (size_t)rows + (size_t)g * 128) * row_bytes;
      for (int64_t p = 0; p < parts; p++) {
        memset(part[p], 0xcd, (size_t)slice);
        int64_t from = p * slice < bytes ? p * slice : bytes,
                to = from + slice < bytes ? from + slice : bytes;
        memcpy(part[p], base + from, (size_t)(to - from));
      }
      for (int64_t p = 0; p < parts; p++)
        for (unsigned u = (unsigned)(units * p / parts); u < units * (p + 1) / parts; u++)
          if (scales) { /* a word per thread */
            for (unsigned word = 0; word < 128; word++)
              memcpy(base + (size_t)u * NVFP4_TILE_BYTES + word * 4,
                     in_slices(part, slice, nvfp4_sf_group_read(u, word, row_bytes)), 4);
          } else { /* a lane per thread: two 8-byte reads (within one slice), four words */
            for (unsigned lane = 0; lane < 32; lane++) {
              unsigned lo_at, hi_at;
              nvfp4_w_lane_reads(u, lane, group_tiles, row_bytes, &lo_at, &hi_at);
              ck_assert(lo_at % 8 == 0 && lo_at / slice == (lo_at + 7) / slice &&
                        hi_at / slice == (hi_at + 7) / slice);
              uint16_t lo[4], hi[4];
              memcpy(lo, in_slices(part, slice, lo_at), 8);
              memcpy(hi, in_slices(part, slice, hi_at), 8);
              for (unsigned j = 0; j < 4; j++) {
                uint32_t v = nvfp4_w_word(lo[j], hi[j]);
                memcpy(base + (size_t)u * NVFP4_TILE_BYTES + (lane * 4 + j) * 4, &v, 4);
              }
            }
          }
    }
  for (int64_t p = 0; p < parts; p++)
    free(part[p]);
  return 0;
}

/* nvfp4_w_word's shifts and masks put every bit where nvfp4_w_put puts it for the slot: every value of
 * each 16-bit half (the other half random; the halves' bits are disjoint). */
START_TEST(test_w_word_matches_the_slots) {
  uint64_t rng = 5;
  for (unsigned v = 0; v < 65536; v++)
    for (int side = 0; side < 2; side++) {
      unsigned lo = side ? (unsigned)(tu_rand(&rng) & 0xffff) : v,
               hi = side ? v : (unsigned)(tu_rand(&rng) & 0xffff);
      uint32_t want = 0;
      for (int e = 0; e < 4; e++) {
        want = nvfp4_w_put(want, nvfp4_w_slot(e, 0), (lo >> (4 * e)) & 15u);
        want = nvfp4_w_put(want, nvfp4_w_slot(e, 1), (hi >> (4 * e)) & 15u);
      }
      ck_assert_uint_eq(nvfp4_w_word(lo, hi), want);
    }
}
END_TEST

/* `experts` matrices [rows, k] (k: the scales' columns for scales) of random bytes, transformed in place
 * by the emulation, equal layout.c's transforms of them into a new buffer (as large: no padding). */
static void assert_in_place(bool scales, int64_t experts, int64_t rows, int64_t k, uint64_t seed) {
  const size_t one = (size_t)(scales ? rows * k : rows * k / 2);
  ck_assert_int_eq(scales ? nvfp4_sf_bytes(rows, k) : nvfp4_w_bytes(rows, k), (int64_t)one);
  uint8_t *data = tu_xmalloc(one * (size_t)experts), *want = tu_xmalloc(one * (size_t)experts);
  tu_fill_bytes(data, one * (size_t)experts, seed);
  for (int64_t e = 0; e < experts; e++)
    (scales ? nvfp4_swizzle_scales : nvfp4_tile_weights)(data + (size_t)e * one, rows, k,
                                                         want + (size_t)e * one);
  ck_assert_int_eq(emulate_in_place(scales, data, experts, rows, k), 0);
  ck_assert_msg(memcmp(data, want, one * (size_t)experts) == 0, "%s %lld x %lld",
                scales ? "scales" : "weights", (long long)rows, (long long)k);
  free(data), free(want);
}

/* In place over the checkpoint bytes, group by group through a cluster's slices, the bytes of the
 * transforms into a new buffer: one to eight parts, a last group of fewer tiles, stacked experts,
 * and the largest group a cluster holds; one larger is refused. */
START_TEST(test_in_place_equals_the_transforms) {
  static const int64_t weights[][3] = {{1, 16, 64},    {3, 48, 128},    {2, 272, 2048},
                                       {1, 256, 4096}, {1, 144, 14336}, {1, 128, 25600}};
  static const int64_t scales[][3] = {{1, 128, 4}, {3, 384, 16}, {2, 256, 896}, {1, 128, 1600}};
  for (size_t i = 0; i < sizeof weights / sizeof weights[0]; i++)
    assert_in_place(false, weights[i][0], weights[i][1], weights[i][2], 71 + i);
  for (size_t i = 0; i < sizeof scales / sizeof scales[0]; i++)
    assert_in_place(true, scales[i][0], scales[i][1], scales[i][2], 91 + i);
  int64_t parts, slice;
  ck_assert_int_eq(nvfp4_in_place_split(128 * 25600 / 2, &parts, &slice), 0);
  ck_assert_int_eq(parts, NVFP4_IN_PLACE_MAX_PARTS);
  ck_assert_int_eq(nvfp4_in_place_split(128 * 25664 / 2, &parts, &slice), -1);
  ck_assert_int_eq(nvfp4_in_place_split(64 << 10, &parts, &slice), 0);
  ck_assert_int_eq(parts, 1);
}
END_TEST

/* ---- the GEMM's view of the tiles -------------------------------------------------------- */

/* The float a 16-bit pattern stands for, undoing the decode's bias (2^-126 bf16, 2^-14 f16). */
static float unbias(uint16_t bits, bool bf16) {
  return bf16 ? ldexpf(qk_bf16_to_f32(bits), 126) : ldexpf(qk_f16_to_f32(bits), 14);
}

/* Register pair `pair` of word q as the kernel decodes it for bf16 or f16 MMAs. */
static uint32_t decode_pair(uint32_t q, int pair, bool bf16) {
  uint32_t p = nvfp4_pair_bf16(q, pair);
  return bf16 ? p : nvfp4_bf16x2_to_f16x2(p);
}

START_TEST(test_pair_decode_every_code) {
  uint64_t rng = 99;
  for (int bf16 = 0; bf16 < 2; bf16++)
    for (int pair = 0; pair < 4; pair++)
      for (unsigned lo = 0; lo < 16; lo++)
        for (unsigned hi = 0; hi < 16; hi++) {
          /* The pair's two codes, random codes in the other six slots. */
          uint32_t q = nvfp4_w_put(nvfp4_w_put(0, 2 * pair, lo), 2 * pair + 1, hi);
          for (int slot = 0; slot < 8; slot++)
            if (slot / 2 != pair)
              q = nvfp4_w_put(q, slot, (unsigned)(tu_rand(&rng) & 15));
          uint32_t p = decode_pair(q, pair, bf16);
          float vlo = unbias((uint16_t)(p & 0xffff), bf16), vhi = unbias((uint16_t)(p >> 16), bf16);
          ck_assert_float_eq(vlo, qk_e2m1_decode((uint8_t)lo));
          ck_assert_float_eq(vhi, qk_e2m1_decode((uint8_t)hi));
          ck_assert_int_eq(signbit(vlo) != 0, lo >= 8);
          ck_assert_int_eq(signbit(vhi) != 0, hi >= 8);
        }
}
END_TEST

/*
 * Emulates one warp of the GEMM over the tiled weight: for each 16-row tile and 64-K
 * chunk, lane (g, t) takes its 16 bytes, turns word j into the A fragment of k-step j
 * (a0a1, a2a3, a4a5, a6a7 = pairs 0..3) and reads its B fragment from x at
 * k = 16t + 4j + {0,1} (b0b1) and + {2,3} (b2b3), as the kernel does; then applies
 * mma.m16n8k16's definition (A row-major 16x16, B 16x8, fragments per the PTX ISA).
 */
/* y[m, rows] is exactly x[m, k] times the e2m1 codes `packed` [rows, k / 2] transposed (the inputs
 * are small integers, so every product and sum is exact in double). */
static void assert_fp4_gemm(const uint8_t *packed, int64_t rows, int64_t k, const float *x, int64_t m,
                            const double *y) {
  for (int64_t t = 0; t < m; t++)
    for (int64_t r = 0; r < rows; r++) {
      double want = 0;
      for (int64_t kk = 0; kk < k; kk++)
        want += (double)qk_e2m1_decode(qk_fp4_code(packed + r * (k / 2), kk)) * x[t * k + kk];
      ck_assert_double_eq(y[t * rows + r], want);
    }
}

static void emulate_gemm(const uint8_t *tiled, int64_t rows, int64_t k, const float *x, int64_t m, bool bf16,
                         double *y) {
  int64_t chunks = nvfp4_w_chunks(k), tiles = nvfp4_w_rows(rows) / 16;
  memset(y, 0, (size_t)(m * rows) * sizeof *y);
  for (int64_t tile = 0; tile < tiles; tile++)
    for (int64_t c = 0; c < chunks; c++)
      for (int j = 0; j < 4; j++)
        for (int64_t n0 = 0; n0 < m; n0 += 8) {
          float a[16][16] = {{0}}, b[16][8] = {{0}};
          for (int lane = 0; lane < 32; lane++) {
            int g = lane / 4, t = lane % 4;
            uint32_t q;
            memcpy(&q, tiled + nvfp4_w_tile_offset(tile, c, tiles, chunks) + lane * 16 + 4 * j, 4);
            /* a0a1 (g, 2t..), a2a3 (g+8, 2t..), a4a5 (g, 2t+8..), a6a7 (g+8, 2t+8..) */
            for (int i = 0; i < 4; i++) {
              uint32_t reg = decode_pair(q, i, bf16);
              int row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);
              a[row][col] = unbias((uint16_t)(reg & 0xffff), bf16);
              a[row][col + 1] = unbias((uint16_t)(reg >> 16), bf16);
            }
            /* b0b1 (2t.., n = g), b2b3 (2t+8.., n = g): x[token n0 + g][16t + 4j + e] */
            int64_t token = n0 + g, kbase = c * 64 + 16 * t + 4 * j;
            for (int e = 0; e < 4; e++) {
              int krow = 2 * t + (e & 1) + 8 * (e >> 1);
              b[krow][g] = token < m && kbase + e < k ? x[token * k + kbase + e] : 0.0f;
            }
          }
          for (int row = 0; row < 16; row++)
            for (int n = 0; n < 8; n++) {
              double acc = 0;
              for (int kk = 0; kk < 16; kk++)
                acc += (double)a[row][kk] * b[kk][n];
              int64_t r = tile * 16 + row, token = n0 + n;
              if (r < rows && token < m)
                y[token * rows + r] += acc;
            }
        }
}

/* The streaming kernel's plan: on the H200's 132 SMs it picks the shapes the sweep measured
 * fastest (docs/PERFORMANCE.md), stays in the instantiated range for any matrix, splits K
 * only for narrow matrices, and honours forced fields. */
START_TEST(test_stream_plan) {
  struct nvfp4_tuning p;
  static const struct {
    int64_t n, k;
    int rows;
  } h200[] = {{8192, 8192, 2}, {4096, 14336, 1}, {14336, 4096, 4}};
  static const int64_t tokens[] = {1, 4, 16};
  for (size_t i = 0; i < sizeof h200 / sizeof h200[0]; i++)
    for (size_t t = 0; t < sizeof tokens / sizeof tokens[0]; t++) {
      nvfp4_stream_plan(tokens[t], h200[i].n, h200[i].k, 132, NULL, &p);
      ck_assert_int_eq(p.kernel, NVFP4_KERNEL_STREAM);
      ck_assert_int_eq(p.tile_m, tokens[t] <= 8 ? 8 : 16);
      ck_assert_int_eq(p.rows, h200[i].rows);
      ck_assert_int_eq(p.unroll, 4);
      ck_assert_int_eq(p.split_k, 1);
    }
  /* Narrow: 64 tiles, so one per block and a split that brings 64 blocks towards 264,
   * bounded by two batches per warp (16384 / 64 / (8 * 2 * 4) = 4). */
  nvfp4_stream_plan(1, 1024, 16384, 132, NULL, &p);
  ck_assert_int_eq(p.rows, 1);
  ck_assert_int_eq(p.split_k, 4);
  nvfp4_stream_plan(1, 1024, 4096, 132, NULL, &p); /* too little K to split */
  ck_assert_int_eq(p.split_k, 1);
  for (int64_t n = 16; n <= 65536; n = n * 3 + 16)
    for (int64_t k = 16; k <= 65536; k = k * 5 + 16)
      for (int sms = 1; sms <= 264; sms *= 4) {
        nvfp4_stream_plan(9, n, k, sms, NULL, &p);
        ck_assert(p.rows == 1 || p.rows == 2 || p.rows == 4);
        ck_assert(p.split_k >= 1 && p.split_k <= NVFP4_MAX_SPLIT);
        ck_assert_int_eq(p.tile_m, 16);
      }
  struct nvfp4_tuning forced = {0, 3, 0, NVFP4_KERNEL_STREAM, 2, 8, 0, 0, 0, 0};
  nvfp4_stream_plan(1, 8192, 8192, 132, &forced, &p);
  ck_assert(p.rows == 2 && p.unroll == 8 && p.split_k == 3);
  forced = (struct nvfp4_tuning){0, 20, 0, NVFP4_KERNEL_STREAM, 3, 5, 0,
                                 0, 0,  0}; /* invalid: automatic, clamped */
  nvfp4_stream_plan(1, 8192, 8192, 132, &forced, &p);
  ck_assert(p.rows == 2 && p.unroll == 4 && p.split_k == NVFP4_MAX_SPLIT && p.depth == 0);
  forced = (struct nvfp4_tuning){0, 0, 3, NVFP4_KERNEL_STREAM, 0, 0, 0, 0, 0, 0}; /* 3 blocks per SM */
  nvfp4_stream_plan(1, 8192, 8192, 132, &forced, &p);
  ck_assert(p.rows == 2 && p.unroll == 4 && p.depth == 3);
}
END_TEST

START_TEST(test_fragments_reproduce_gemm) {
  static const int64_t gemm_shapes[][3] = {{16, 64, 8}, {37, 208, 3}, {130, 112, 9}, {8, 1024, 1}};
  for (size_t s = 0; s < sizeof gemm_shapes / sizeof gemm_shapes[0]; s++) {
    int64_t rows = gemm_shapes[s][0], k = gemm_shapes[s][1], m = gemm_shapes[s][2];
    size_t n = (size_t)(rows * k / 2);
    uint8_t *packed = tu_xmalloc(n), *tiled = tu_xmalloc((size_t)nvfp4_w_bytes(rows, k));
    float *x = tu_xmalloc((size_t)(m * k) * sizeof *x);
    double *y = tu_xmalloc((size_t)(m * rows) * sizeof *y);
    tu_fill_bytes(packed, n, 5 + s);
    uint64_t rng = 77 + s;
    for (int64_t i = 0; i < m * k; i++)
      x[i] = (float)(tu_rand(&rng) % 17) - 8.0f; /* small integers: every product and sum is exact */
    nvfp4_tile_weights(packed, rows, k, tiled);
    for (int bf16 = 0; bf16 < 2; bf16++) {
      emulate_gemm(tiled, rows, k, x, m, bf16, y);
      assert_fp4_gemm(packed, rows, k, x, m, y);
    }
    free(packed), free(tiled), free(x), free(y);
  }
}
END_TEST

/* ---- activations staged for the wgmma kernel --------------------------------------------- */

/* The staging (16-bit, or FP8's bytes) is a bijection onto [0, round_up(m, mt)) x [0, K rounded to 64). */
static void assert_staging_bijection(bool fp8) {
  static const int64_t xs[][3] = {{1, 16, 32}, {31, 208, 32}, {64, 64, 64}, {100, 1024, 128}, {257, 80, 256}};
  for (size_t s = 0; s < sizeof xs / sizeof xs[0]; s++) {
    int64_t m = xs[s][0], k = xs[s][1], chunks = nvfp4_w_chunks(k);
    int mt = (int)xs[s][2];
    int64_t elems = nvfp4_x_elems(m, k, mt);
    ck_assert_int_eq(elems, nvfp4_round_up(m, mt) * nvfp4_round_up(k, 64));
    uint8_t *seen = calloc((size_t)elems, 1);
    for (int64_t off = 0; off < elems; off++) {
      int64_t token, kk;
      (fp8 ? nvfp4_x8_source : nvfp4_x_source)(off, chunks, mt, &token, &kk);
      ck_assert(token >= 0 && token < nvfp4_round_up(m, mt) && kk >= 0 && kk < chunks * 64);
      ck_assert_int_eq((fp8 ? nvfp4_x8_offset : nvfp4_x_offset)(token, kk, chunks, mt), off);
      ck_assert(!seen[off]);
      seen[off] = 1;
    }
    free(seen);
  }
}

START_TEST(test_x_bijection) {
  assert_staging_bijection(false);
  /* By hand: token 9 of a 32-token tile, k = 64 + 16 * 3 + 4 * 2 + 2 * 1 + 1 = 123: chunk 1,
   * run (j 2, h 1) = 5, token group 1, row 1, element 2 * 3 + 1. */
  ck_assert_int_eq(nvfp4_x_offset(9, 123, 4, 32), 1 * 64 * 32 + (5 * 4 + 1) * 64 + 1 * 8 + 7);
}
END_TEST

/* x [m, k] staged as `source` lays it out for tiles of mt tokens (zero past m and k), one float an element.
 */
typedef void staging_source_fn(int64_t offset, int64_t chunks, int mt, int64_t *token, int64_t *k);
static float *staged_for(staging_source_fn *source, const float *x, int64_t m, int64_t k, int mt) {
  int64_t chunks = nvfp4_w_chunks(k), elems = nvfp4_x_elems(m, k, mt);
  float *staged = tu_xmalloc((size_t)elems * sizeof *staged);
  for (int64_t off = 0; off < elems; off++) {
    int64_t token, kk;
    source(off, chunks, mt, &token, &kk);
    staged[off] = token < m && kk < k ? x[token * k + kk] : 0.0f;
  }
  return staged;
}

/*
 * Emulates a consumer warpgroup of the wgmma kernel: warp w of the group takes tile 4i + w's
 * words as its A fragments (as emulate_gemm), the B operand of k-step j is read through the
 * descriptor the kernel builds (start 32 * mt bytes per step, leading byte offset 16 * mt
 * between the step's two core matrices, stride 128 bytes between 8-token groups, 16 bytes a
 * token in a core matrix) from activations staged by nvfp4_x_source; then m64nNk16's
 * definition. Must reproduce x W^T exactly.
 */
/*
 * One k-step's MMA for a 16-row tile, as the wgmma definition has it: y[token, tile * 16 + row] +=
 * sum over col < cols of a[row][col] times B(col, token), B read from a stage through the descriptor
 * (the step at `start` bytes, 16 * mt bytes between its core matrices, 128 between 8-token groups,
 * 16 bytes a token, eb bytes an element: 2 for 16-bit activations, 1 for e4m3; the stage holds one
 * float per element), for the mt tokens of token tile tt; rows past `rows` and tokens past m are
 * dropped.
 */
static void mma_step(const double a[16][32], int cols, const float *stage, int64_t start, int eb, int mt,
                     int64_t tt, int64_t tile, int64_t rows, int64_t m, double *y) {
  const int64_t lbo = 16 * mt, sbo = 128, per = 16 / eb; /* elements per core-matrix row */
  for (int n = 0; n < mt; n++) {
    int64_t token = tt * mt + n;
    for (int row = 0; row < 16; row++) {
      double acc = 0;
      for (int col = 0; col < cols; col++) {
        int64_t byte = start + (col / per) * lbo + (n / 8) * sbo + (n % 8) * 16 + (col % per) * eb;
        acc += a[row][col] * stage[byte / eb];
      }
      int64_t r = tile * 16 + row;
      if (r < rows && token < m)
        y[token * rows + r] += acc;
    }
  }
}

static void emulate_wgmma(const uint8_t *tiled, int64_t rows, int64_t k, const float *x, int64_t m, int mt,
                          double *y) {
  int64_t chunks = nvfp4_w_chunks(k), tiles = nvfp4_w_rows(rows) / 16;
  float *staged = staged_for(nvfp4_x_source, x, m, k, mt);
  memset(y, 0, (size_t)(m * rows) * sizeof *y);
  for (int64_t group = 0; group * 4 < tiles; group++)
    for (int64_t tt = 0; tt * mt < m; tt++)
      for (int64_t c = 0; c < chunks; c++)
        for (int j = 0; j < 4; j++) {
          const float *stage = staged + (tt * chunks + c) * 64 * mt;
          const int64_t start = j * 32 * mt;
          for (int w = 0; w < 4 && group * 4 + w < tiles; w++) {
            int64_t tile = group * 4 + w;
            double a[16][32] = {{0}};
            for (int lane = 0; lane < 32; lane++) {
              int g = lane / 4, t = lane % 4;
              uint32_t q;
              memcpy(&q, tiled + nvfp4_w_tile_offset(tile, c, tiles, chunks) + lane * 16 + 4 * j, 4);
              for (int i = 0; i < 4; i++) {
                uint32_t reg = decode_pair(q, i, true);
                int row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);
                a[row][col] = unbias((uint16_t)(reg & 0xffff), true);
                a[row][col + 1] = unbias((uint16_t)(reg >> 16), true);
              }
            }
            mma_step(a, 16, stage, start, 2, mt, tt, tile, rows, m, y);
          }
        }
  free(staged);
}

/* Each emulation (a consumer's MMAs from the tiles and the staged activations) reproduces x W^T exactly:
 * small integers, unit scales; shapes {rows, k, m, mt}. */
typedef void emulate_fn(const uint8_t *tiled, int64_t rows, int64_t k, const float *x, int64_t m, int mt,
                        double *y);
static void assert_operands_reproduce_gemm(emulate_fn *emulate, const int64_t (*gemms)[4], size_t count,
                                           uint64_t seed) {
  for (size_t s = 0; s < count; s++) {
    int64_t rows = gemms[s][0], k = gemms[s][1], m = gemms[s][2];
    int mt = (int)gemms[s][3];
    size_t n = (size_t)(rows * k / 2);
    uint8_t *packed = tu_xmalloc(n), *tiled = tu_xmalloc((size_t)nvfp4_w_bytes(rows, k));
    float *x = tu_xmalloc((size_t)(m * k) * sizeof *x);
    double *y = tu_xmalloc((size_t)(m * rows) * sizeof *y);
    tu_fill_bytes(packed, n, seed + s);
    uint64_t rng = 172 + seed + s;
    for (int64_t i = 0; i < m * k; i++)
      x[i] = (float)(tu_rand(&rng) % 17) - 8.0f; /* small integers: every product and sum is exact */
    nvfp4_tile_weights(packed, rows, k, tiled);
    emulate(tiled, rows, k, x, m, mt, y);
    assert_fp4_gemm(packed, rows, k, x, m, y);
    free(packed), free(tiled), free(x), free(y);
  }
}

START_TEST(test_wgmma_operands_reproduce_gemm) {
  static const int64_t gemms[][4] = {
      {16, 64, 8, 32}, {37, 208, 33, 32}, {130, 112, 9, 64}, {80, 1024, 3, 128}};
  assert_operands_reproduce_gemm(emulate_wgmma, gemms, sizeof gemms / sizeof gemms[0], 15);
}
END_TEST

/* The FP8 staging: a bijection as the 16-bit one; by hand, one byte; each k of a chunk once. */
START_TEST(test_x8_bijection) {
  assert_staging_bijection(true);
  /* Token 9 of a 32-token tile, k = 64 + 16 * 3 + 8 * 1 + 4 * 0 + 2 = 122: chunk 1, run (s 1,
   * q 0) = 2, token group 1, row 1, byte 4 * 3 + 2. */
  ck_assert_int_eq(nvfp4_x8_offset(9, 122, 4, 32), 1 * 64 * 32 + (2 * 4 + 1) * 128 + 1 * 16 + 14);
  /* Every logical column of both steps names a different k of the chunk. */
  uint8_t hit[64] = {0};
  for (int st = 0; st < 2; st++)
    for (int col = 0; col < 32; col++)
      hit[nvfp4_x8_k(st, col)]++;
  for (int kk = 0; kk < 64; kk++)
    ck_assert_int_eq(hit[kk], 1);
}
END_TEST

/*
 * Emulates a consumer warpgroup of the wgmma kernel with FP8 activations, with values instead of
 * e4m3 bytes: k-step s (0..1) of a chunk, thread 4g + t of warp w builds a0 / a1 (rows g / g + 8,
 * logical columns 4t .. 4t + 3) from tile word 2s and a2 / a3 (columns 16 + 4t ..) from word 2s + 1,
 * element e of the word's row being byte e (e4m3_fragment); B is read through the descriptor
 * (start 32 * mt bytes per step, 16 * mt between the step's two core matrices, 128 between 8-token
 * groups, 16 bytes a token, a byte an element) from activations staged by nvfp4_x8_source; then
 * m64nNk32's definition. Must reproduce x W^T exactly (small integers, unit scales).
 */
static void emulate_wgmma_fp8(const uint8_t *tiled, int64_t rows, int64_t k, const float *x, int64_t m,
                              int mt, double *y) {
  int64_t chunks = nvfp4_w_chunks(k), tiles = nvfp4_w_rows(rows) / 16;
  float *staged = staged_for(nvfp4_x8_source, x, m, k, mt);
  memset(y, 0, (size_t)(m * rows) * sizeof *y);
  for (int64_t tile = 0; tile < tiles; tile++)
    for (int64_t tt = 0; tt * mt < m; tt++)
      for (int64_t c = 0; c < chunks; c++)
        for (int st = 0; st < 2; st++) {
          const float *stage = staged + (tt * chunks + c) * 64 * mt;
          double a[16][32] = {{0}};
          for (int lane = 0; lane < 32; lane++) {
            int g = lane / 4, t = lane % 4;
            for (int reg = 0; reg < 4; reg++) {
              uint32_t q;
              int j = 2 * st + reg / 2, h = reg % 2; /* word, row half */
              memcpy(&q, tiled + nvfp4_w_tile_offset(tile, c, tiles, chunks) + lane * 16 + 4 * j, 4);
              for (int e = 0; e < 4; e++)
                a[g + 8 * h][4 * t + 16 * (reg / 2) + e] = qk_e2m1_decode(nvfp4_w_get(q, nvfp4_w_slot(e, h)));
            }
          }
          mma_step(a, 32, stage, st * 32 * mt, 1, mt, tt, tile, rows, m, y);
        }
  free(staged);
}

START_TEST(test_wgmma_fp8_operands_reproduce_gemm) {
  static const int64_t gemms[][4] = {
      {16, 64, 8, 32}, {37, 208, 33, 32}, {130, 112, 9, 64}, {80, 1024, 3, 128}, {48, 128, 70, 256}};
  assert_operands_reproduce_gemm(emulate_wgmma_fp8, gemms, sizeof gemms / sizeof gemms[0], 25);
}
END_TEST

/* ---- MXFP4 on the wgmma kernel ---------------------------------------------------------- */

/* Whether v is a bf16 value (normal or subnormal, not past the largest). */
static bool is_bf16(double v) {
  double a = fabs(v);
  if (a == 0)
    return true;
  if (a > 0x1.fep127 || a < 0x1p-133)
    return false;
  int e = (int)floor(log2(a));
  double quantum = ldexp(1.0, (e < -126 ? -126 : e) - 7);
  return a / quantum == floor(a / quantum);
}

/* The bf16 value of bits. */
static double bf16_value(uint16_t bits) { return (double)qk_bf16_to_f32(bits); }

/* A decoded pair's element (code x 2^-126) times an e8m0 scale's two factors, as the kernel's two bf16
 * multiplies: each product a bf16 value (so the multiply is exact), the result code x 2^(e - 130). */
static double mx_scaled(uint16_t decoded, unsigned e) {
  uint32_t first, second;
  mxfp4_wg_scale(e, &first, &second);
  double f1 = bf16_value((uint16_t)first), f2 = bf16_value((uint16_t)second);
  ck_assert(f1 == bf16_value((uint16_t)(first >> 16)) && f2 == bf16_value((uint16_t)(second >> 16)));
  double once = bf16_value(decoded) * f1, twice = once * f2;
  ck_assert_msg(is_bf16(once) && is_bf16(twice), "e %u, code bits 0x%04x", e, decoded);
  return twice;
}

START_TEST(test_mx_scale_factors_are_exact) {
  for (unsigned e = 0; e <= 254; e++)
    for (unsigned code = 0; code < 16; code++) {
      uint32_t q = nvfp4_w_put(0, 0, code); /* pair 0, element 0 */
      double v = mx_scaled((uint16_t)(nvfp4_pair_bf16(q, 0) & 0xffff), e);
      ck_assert_double_eq(v, qk_e2m1_decode(code) * ldexp(1.0, (int)e - 130));
    }
}
END_TEST

/*
 * A consumer warpgroup of the wgmma kernel on MXFP4 units (wave 32), as emulate_wgmma: warp w takes
 * tile 4i + w; per k-step j its A fragment is the lane's word j (unit tile * chunks + chunk), each
 * pair times the e8m0 scale of its row and block j / 2 (the lane's four scale bytes g * 4 + 2b + i)
 * by mx_scaled; B from activations staged by mxfp4_wg_x_source through the descriptor; the sums
 * times 2^3. Must reproduce sum_k code x 2^(e - 127) x x exactly.
 */
static void emulate_wgmma_mx(const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t k,
                             const float *x, int64_t m, int mt, double *y) {
  int64_t chunks = nvfp4_w_chunks(k), tiles = nvfp4_w_rows(rows) / 16;
  float *staged = staged_for(mxfp4_wg_x_source, x, m, k, mt);
  memset(y, 0, (size_t)(m * rows) * sizeof *y);
  for (int64_t tile = 0; tile < tiles; tile++)
    for (int64_t tt = 0; tt * mt < m; tt++)
      for (int64_t c = 0; c < chunks; c++)
        for (int j = 0; j < 4; j++) {
          const float *stage = staged + (tt * chunks + c) * 64 * mt;
          const int64_t unit = tile * chunks + c;
          double a[16][32] = {{0}};
          for (int lane = 0; lane < 32; lane++) {
            int g = lane / 4, t = lane % 4;
            uint32_t q;
            memcpy(&q, codes + unit * MXFP4_UNIT_BYTES + lane * 16 + 4 * j, 4);
            for (int i = 0; i < 4; i++) {
              uint32_t reg = nvfp4_pair_bf16(q, i);
              unsigned e = scales[unit * MXFP4_UNIT_SCALES + g * 4 + (j / 2) * 2 + (i & 1)];
              int row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);
              a[row][col] = mx_scaled((uint16_t)(reg & 0xffff), e) * 8;
              a[row][col + 1] = mx_scaled((uint16_t)(reg >> 16), e) * 8;
            }
          }
          mma_step(a, 16, stage, j * 32 * mt, 2, mt, tt, tile, rows, m, y);
        }
  free(staged);
}

/* The staging for MXFP4 is a bijection; the emulated MMAs on tiled MXFP4 codes and scales (scales of 2^-7
 * to 2^7) reproduce x W^T exactly. */
START_TEST(test_wgmma_mx_operands_reproduce_gemm) {
  static const int64_t xs[][3] = {{1, 32, 32}, {31, 224, 32}, {100, 1024, 128}, {257, 96, 256}};
  for (size_t s = 0; s < sizeof xs / sizeof xs[0]; s++) {
    int64_t m = xs[s][0], k = xs[s][1], chunks = nvfp4_w_chunks(k),
            elems = nvfp4_x_elems(m, k, (int)xs[s][2]);
    uint8_t *seen = calloc((size_t)elems, 1);
    for (int64_t off = 0; off < elems; off++) {
      int64_t token, kk;
      mxfp4_wg_x_source(off, chunks, (int)xs[s][2], &token, &kk);
      ck_assert_int_eq(mxfp4_wg_x_offset(token, kk, chunks, (int)xs[s][2]), off);
      ck_assert(!seen[off]);
      seen[off] = 1;
    }
    free(seen);
  }
  static const int64_t gemms[][4] = {
      {16, 64, 8, 32}, {37, 224, 33, 32}, {130, 128, 9, 64}, {48, 1024, 70, 128}};
  for (size_t s = 0; s < sizeof gemms / sizeof gemms[0]; s++) {
    int64_t rows = gemms[s][0], k = gemms[s][1], m = gemms[s][2], blocks = k / 32;
    int mt = (int)gemms[s][3];
    uint8_t *packed = tu_xmalloc((size_t)(rows * k / 2)), *scale = tu_xmalloc((size_t)(rows * blocks));
    uint8_t *codes = tu_xmalloc((size_t)mxfp4_code_bytes(rows, k)),
            *tiled = tu_xmalloc((size_t)mxfp4_scale_bytes(rows, k));
    float *x = tu_xmalloc((size_t)(m * k) * sizeof *x);
    double *y = tu_xmalloc((size_t)(m * rows) * sizeof *y);
    tu_fill_bytes(packed, (size_t)(rows * k / 2), 41 + s);
    uint64_t rng = 411 + s;
    for (int64_t i = 0; i < rows * blocks; i++)
      scale[i] = (uint8_t)(120 + tu_rand(&rng) % 15);
    for (int64_t i = 0; i < m * k; i++)
      x[i] = (float)(tu_rand(&rng) % 17) - 8.0f;
    mxfp4_tile_codes(packed, rows, k, 32, codes);
    mxfp4_tile_scales(scale, rows, k, 32, tiled);
    emulate_wgmma_mx(codes, tiled, rows, k, x, m, mt, y);
    for (int64_t t = 0; t < m; t++)
      for (int64_t r = 0; r < rows; r++) {
        double want = 0;
        for (int64_t kk = 0; kk < k; kk++)
          want += (double)qk_e2m1_decode(qk_fp4_code(packed + r * (k / 2), kk)) *
                  ldexp(1.0, scale[r * blocks + kk / 32] - 127) * x[t * k + kk];
        ck_assert_double_eq(y[t * rows + r], want);
      }
    free(packed), free(scale), free(codes), free(tiled), free(x), free(y);
  }
}
END_TEST

/* FP8 activations in the plans: kept from NVFP4_FP8_MIN_M tokens on the wgmma kernel with one MMA
 * tile per consumer and token tiles of 32 or more, plain or routed; never below that, never on the
 * streaming or ring kernels. */
START_TEST(test_fp8_plan) {
  struct nvfp4_tuning p, want = {.fp8 = 1};
  for (int64_t m = 17; m <= 5000; m = m * 3 + 1)
    for (int64_t n = 16; n <= 65536; n = n * 5 + 16) {
      nvfp4_wgmma_plan(m, n, 8192, 132, &want, &p);
      ck_assert_int_eq(p.fp8, m >= NVFP4_FP8_MIN_M);
      if (p.fp8)
        ck_assert(p.rows == 1 && p.tile_m >= 32 && (m < NVFP4_FP8_TILE256_M || p.tile_m == 256));
      nvfp4_wgmma_plan(m, n, 8192, 132, NULL, &p);
      ck_assert_int_eq(p.fp8, 0);
    }
  struct nvfp4_tuning forced = {.fp8 = 1, .rows = 2, .tile_m = 16};
  nvfp4_wgmma_plan(256, 8192, 8192, 132, &forced, &p);
  ck_assert(p.fp8 == 1 && p.rows == 1 && p.tile_m == 32);
  nvfp4_stream_plan(8, 8192, 8192, 132, &want, &p);
  ck_assert_int_eq(p.fp8, 0);
  /* Routed: on the wgmma kernel (many tokens per expert), never on the streaming or ring kernels. */
  for (int64_t pairs = 1; pairs <= 16384; pairs *= 4) {
    nvfp4_moe_plan(pairs, 128, 1536, 2048, 132, true, &want, &p);
    ck_assert_int_eq(p.fp8, p.kernel == NVFP4_KERNEL_WGMMA);
    if (p.fp8)
      ck_assert(p.rows == 1 && p.tile_m >= 32);
    nvfp4_moe_plan(pairs, 128, 1536, 2048, 132, true, NULL, &p);
    ck_assert_int_eq(p.fp8, 0);
    nvfp4_moe_plan(pairs, 128, 1536, 2048, 132, false, &want, &p);
    ck_assert_int_eq(p.fp8, 0);
  }
  nvfp4_moe_plan(16384, 128, 1536, 2048, 132, true, &want, &p);
  ck_assert(p.kernel == NVFP4_KERNEL_WGMMA && p.fp8 == 1);
}
END_TEST

/* The wgmma plan: on the H200's 132 SMs the shapes its sweep measured fastest (or within
 * its noise) for the benchmarked matrices, and forced fields honoured within range. */
START_TEST(test_wgmma_plan) {
  struct nvfp4_tuning p;
  static const struct {
    int64_t m, n, k;
    int tile_m, rows, split, multicast;
  } want[] = {{32, 8192, 8192, 32, 1, 2, 1},    {64, 8192, 8192, 64, 1, 2, 1},
              {128, 8192, 8192, 128, 1, 2, 1},  {256, 8192, 8192, 128, 1, 1, 1},
              {1024, 8192, 8192, 128, 1, 1, 1}, {17, 4096, 14336, 32, 1, 2, 1},
              {100, 4096, 14336, 64, 1, 2, 1},  {1024, 4096, 14336, 128, 1, 1, 1},
              {64, 14336, 4096, 64, 1, 1, 1},   {1024, 14336, 4096, 128, 1, 1, 1}};
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    nvfp4_wgmma_plan(want[i].m, want[i].n, want[i].k, 132, NULL, &p);
    ck_assert_int_eq(p.kernel, NVFP4_KERNEL_WGMMA);
    ck_assert_int_eq(p.tile_m, want[i].tile_m);
    ck_assert_int_eq(p.rows, want[i].rows);
    ck_assert_int_eq(p.split_k, want[i].split);
    ck_assert_int_eq(p.multicast, want[i].multicast);
  }
  for (int64_t m = 17; m <= 5000; m = m * 3 + 1)
    for (int64_t n = 16; n <= 65536; n = n * 3 + 16)
      for (int64_t k = 16; k <= 65536; k = k * 5 + 16) {
        nvfp4_wgmma_plan(m, n, k, 132, NULL, &p);
        ck_assert(p.tile_m == 32 || p.tile_m == 64 || p.tile_m == 128);
        ck_assert_int_eq(p.rows, 1);
        ck_assert(p.split_k >= 1 && p.split_k <= NVFP4_WGMMA_SPLIT_AUTO);
        ck_assert(p.split_k == 1 || nvfp4_w_chunks(k) / p.split_k >= NVFP4_WGMMA_SPLIT_CHUNKS);
        ck_assert_int_eq(p.multicast, 1); /* measured slower: forced only */
      }
  struct nvfp4_tuning forced = {.tile_m = 128, .kernel = NVFP4_KERNEL_WGMMA, .split_k = 1, .multicast = 4};
  nvfp4_wgmma_plan(1024, 4224, 8192, 132, &forced, &p); /* 33 row blocks: the grid rounds them up */
  ck_assert(p.multicast == 4 && p.split_k == 1);
  forced.split_k = 2; /* a cluster is one or the other */
  nvfp4_wgmma_plan(1024, 4224, 8192, 132, &forced, &p);
  ck_assert(p.multicast == 1 && p.split_k == 2);
  forced = (struct nvfp4_tuning){.tile_m = 128, .kernel = NVFP4_KERNEL_WGMMA, .multicast = 1};
  nvfp4_wgmma_plan(1024, 8192, 8192, 132, &forced, &p);
  ck_assert(p.multicast == 1 && p.split_k == 1);
  forced = (struct nvfp4_tuning){256, 5, 0, NVFP4_KERNEL_WGMMA, 1, 0, 0, 0, 0, 0};
  nvfp4_wgmma_plan(64, 8192, 8192, 132, &forced, &p);
  ck_assert(p.tile_m == 256 && p.rows == 1 && p.split_k == 5);
  forced =
      (struct nvfp4_tuning){256, 8, 0, NVFP4_KERNEL_WGMMA, 2, 0, 0, 0, 0, 0}; /* 2 x 256 does not fit: 128 */
  nvfp4_wgmma_plan(64, 8192, 64, 132, &forced, &p);
  ck_assert(p.tile_m == 128 && p.rows == 2 && p.split_k == 1);                    /* one chunk: no split */
  forced = (struct nvfp4_tuning){12, 0, 0, NVFP4_KERNEL_WGMMA, 4, 0, 0, 0, 0, 0}; /* invalid: automatic */
  nvfp4_wgmma_plan(64, 8192, 8192, 132, &forced, &p);
  ck_assert(p.tile_m == 64 && p.rows == 1 && p.split_k == 2);
}
END_TEST

/* The routed MoE plan on the Qwen3-30B-A3B shapes (128 experts; w13 1536 x 2048, w2 2048 x
 * 768) and 132 SMs: the streaming kernel up to 16 tokens per expert, with the rows and splits
 * nvfp4_stream_plan gives all the experts' tiles together; wgmma above (the ring kernel
 * without it); forced kernels and tiles honoured where valid. */
START_TEST(test_moe_plan) {
  struct nvfp4_tuning p;
  static const struct {
    int64_t pairs, n, k;
    bool wgmma;
    int kernel, tile_m, rows, split;
  } want[] = {
      {8, 1536, 2048, true, NVFP4_KERNEL_STREAM, 8, 4, 1},     /* 1 token, top-8: 8 experts of 96 tiles */
      {8, 2048, 768, true, NVFP4_KERNEL_STREAM, 8, 4, 1},      /* 8 x 128 tiles */
      {128, 1536, 2048, true, NVFP4_KERNEL_STREAM, 8, 4, 1},   /* 16 tokens: 1 per expert */
      {2048, 1536, 2048, true, NVFP4_KERNEL_STREAM, 16, 4, 1}, /* 256 tokens: 16 per expert */
      {4096, 1536, 2048, true, NVFP4_KERNEL_WGMMA, 32, 1, 1},  /* 512 tokens: 32 per expert */
      {16384, 2048, 768, true, NVFP4_KERNEL_WGMMA, 128, 1, 1}, /* 2048 tokens */
      {4096, 1536, 2048, false, NVFP4_KERNEL_RING, 32, 0, 0},  /* no wgmma: the ring kernel */
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    nvfp4_moe_plan(want[i].pairs, 128, want[i].n, want[i].k, 132, want[i].wgmma, NULL, &p);
    ck_assert_int_eq(p.kernel, want[i].kernel);
    ck_assert_int_eq(p.tile_m, want[i].tile_m);
    ck_assert_int_eq(p.rows, want[i].rows);
    ck_assert_int_eq(p.split_k, want[i].split);
  }
  /* Forced: the streaming kernel at prefill sizes keeps 16-token tiles; a forced tile of 8. */
  struct nvfp4_tuning forced = {0, 0, 0, NVFP4_KERNEL_STREAM, 0, 0, 0, 0, 0, 0};
  nvfp4_moe_plan(16384, 128, 1536, 2048, 132, true, &forced, &p);
  ck_assert(p.kernel == NVFP4_KERNEL_STREAM && p.tile_m == 16);
  forced.tile_m = 8;
  nvfp4_moe_plan(16384, 128, 1536, 2048, 132, true, &forced, &p);
  ck_assert(p.kernel == NVFP4_KERNEL_STREAM && p.tile_m == 8);
  forced.tile_m = 64; /* not a streaming tile: automatic */
  nvfp4_moe_plan(8, 128, 1536, 2048, 132, true, &forced, &p);
  ck_assert(p.kernel == NVFP4_KERNEL_STREAM && p.tile_m == 8);
  /* The wgmma kernel at decode sizes: 16-token tiles, or the forced one; without it, the ring kernel. */
  forced = (struct nvfp4_tuning){0, 2, 0, NVFP4_KERNEL_WGMMA, 0, 0, 0, 0, 0, 0};
  nvfp4_moe_plan(8, 128, 1536, 2048, 132, true, &forced, &p);
  ck_assert(p.kernel == NVFP4_KERNEL_WGMMA && p.tile_m == 16 && p.split_k == 2 && p.rows == 1);
  forced.tile_m = 256;
  nvfp4_moe_plan(8, 128, 1536, 2048, 132, true, &forced, &p);
  ck_assert(p.kernel == NVFP4_KERNEL_WGMMA && p.tile_m == 256);
  nvfp4_moe_plan(8, 128, 1536, 2048, 132, false, &forced, &p);
  ck_assert(p.kernel == NVFP4_KERNEL_RING && p.tile_m == 8);
  /* Every size: valid shapes of the kernel picked. */
  for (int64_t pairs = 1; pairs <= 1 << 20; pairs = pairs * 3 + 1)
    for (int64_t experts = 1; experts <= 2048; experts *= 4) {
      nvfp4_moe_plan(pairs, experts, 1536, 2048, 132, true, NULL, &p);
      const int64_t per =
          (pairs + (pairs < experts ? pairs : experts) - 1) / (pairs < experts ? pairs : experts);
      ck_assert_int_eq(p.kernel, per <= NVFP4_MOE_STREAM_MAX ? NVFP4_KERNEL_STREAM : NVFP4_KERNEL_WGMMA);
      ck_assert(p.kernel == NVFP4_KERNEL_STREAM ? p.tile_m == 8 || p.tile_m == 16
                                                : p.tile_m >= per || p.tile_m == 128);
      ck_assert(p.split_k >= 1 && p.split_k <= NVFP4_MAX_SPLIT);
    }
}
END_TEST

static Suite *layout_suite(void) {
  Suite *s = suite_create("cuda_layout");
  TCase *tc = tcase_create("scales");
  tcase_add_test(tc, test_sf_offset_matches_vllm);
  tcase_add_test(tc, test_sf_bijection);
  tcase_add_test(tc, test_sf_round_trip);
  suite_add_tcase(s, tc);
  tc = tcase_create("weights");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_w_bijection);
  tcase_add_test(tc, test_w_layout_by_hand);
  tcase_add_test(tc, test_w_round_trip);
  tcase_add_test(tc, test_w_word_matches_the_slots);
  tcase_add_test(tc, test_in_place_equals_the_transforms);
  tcase_add_test(tc, test_pair_decode_every_code);
  tcase_add_test(tc, test_fragments_reproduce_gemm);
  tcase_add_test(tc, test_stream_plan);
  suite_add_tcase(s, tc);
  tc = tcase_create("wgmma");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, test_x_bijection);
  tcase_add_test(tc, test_wgmma_operands_reproduce_gemm);
  tcase_add_test(tc, test_x8_bijection);
  tcase_add_test(tc, test_wgmma_fp8_operands_reproduce_gemm);
  tcase_add_test(tc, test_wgmma_plan);
  tcase_add_test(tc, test_fp8_plan);
  tcase_add_test(tc, test_mx_scale_factors_are_exact);
  tcase_add_test(tc, test_wgmma_mx_operands_reproduce_gemm);
  tcase_add_test(tc, test_moe_plan);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run_suite(layout_suite(), CK_NORMAL); }
