/*
 * check_mxfp4_layout.c: the MXFP4 kernel layout (plugins/gpu/mxfp4_layout.h) on the
 * CPU, for both waves (32: the CUDA build; 64: the HIP build), no GPU needed:
 *   - code and scale positions are bijections of their padded domains, with spot
 *     values worked out by hand from the layout's description;
 *   - the transforms round-trip and write zero padding;
 *   - the tiles read back the way the GEMM reads them: an emulation of each vendor's
 *     MMA written from its ISA's fragment tables (mma.m16n8k16 on wave 32, MFMA
 *     16x16x16 on wave 64), fed with the kernel's register choice and bit tricks, its
 *     block-wise accumulation and its e8m0 scaling of the accumulator rows, must
 *     reproduce x W^T of the dequantised checkpoint, bf16 and f16;
 *   - the kernel plan covers every chunk with whole stages and honours its limits.
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "mxfp4.h"
#include "private.h"
#include "testutil.h"

/* [rows, k], k % 32 == 0; aligned and ragged in rows (16) and K (64). */
static const int64_t shapes[][2] = {{1, 32}, {5, 96}, {16, 64}, {17, 160}, {40, 224}, {64, 512}, {130, 96}};
#define N_SHAPES (sizeof shapes / sizeof shapes[0])
static const int waves[] = {32, 64};

START_TEST(code_positions_are_a_bijection) {
  for (size_t s = 0; s < N_SHAPES; s++) {
    int wave = waves[_i];
    int64_t rows = shapes[s][0], k = shapes[s][1], chunks = mxfp4_chunks(k);
    int64_t pr = mxfp4_tiles(rows) * 16, pk = chunks * 64, words = mxfp4_code_bytes(rows, k) / 4;
    ck_assert_int_eq(words * 8, pr * pk);
    uint8_t *seen = calloc((size_t)(words * 8), 1);
    for (int64_t r = 0; r < pr; r++)
      for (int64_t kk = 0; kk < pk; kk++) {
        int slot;
        int64_t w = mxfp4_w_position(r, kk, chunks, wave, &slot), r2, k2;
        ck_assert(w >= 0 && w < words && slot >= 0 && slot < 8);
        ck_assert(!seen[w * 8 + slot]);
        seen[w * 8 + slot] = 1;
        mxfp4_w_source(w, slot, chunks, wave, &r2, &k2);
        ck_assert_int_eq(r2, r);
        ck_assert_int_eq(k2, kk);
      }
    free(seen);
  }
}
END_TEST

START_TEST(scale_positions_are_a_bijection) {
  for (size_t s = 0; s < N_SHAPES; s++) {
    int wave = waves[_i];
    int64_t rows = shapes[s][0], k = shapes[s][1], chunks = mxfp4_chunks(k);
    int64_t pr = mxfp4_tiles(rows) * 16, pb = chunks * 2, bytes = mxfp4_scale_bytes(rows, k);
    ck_assert_int_eq(bytes, pr * pb);
    uint8_t *seen = calloc((size_t)bytes, 1);
    for (int64_t r = 0; r < pr; r++)
      for (int64_t b = 0; b < pb; b++) {
        int64_t o = mxfp4_s_offset(r, b, chunks, wave), r2, b2;
        ck_assert(o >= 0 && o < bytes && !seen[o]);
        seen[o] = 1;
        mxfp4_s_source(o, chunks, wave, &r2, &b2);
        ck_assert_int_eq(r2, r);
        ck_assert_int_eq(b2, b);
      }
    free(seen);
  }
}
END_TEST

/* Positions worked out by hand from the description in mxfp4_layout.h (one chunk, one tile). */
START_TEST(spot_positions) {
  int slot;
  /* wave 32: lane 4 (r % 8) + (k % 32) / 8 owns 4 words; word 2 b + s, pair 2 j + h */
  ck_assert_int_eq(mxfp4_w_position(0, 0, 1, 32, &slot), 0);
  ck_assert_int_eq(slot, 0);
  ck_assert_int_eq(mxfp4_w_position(0, 1, 1, 32, &slot), 0);
  ck_assert_int_eq(slot, 1);
  ck_assert_int_eq(mxfp4_w_position(8, 0, 1, 32, &slot), 0);
  ck_assert_int_eq(slot, 2); /* h 1 */
  ck_assert_int_eq(mxfp4_w_position(0, 2, 1, 32, &slot), 0);
  ck_assert_int_eq(slot, 4); /* j 1 */
  ck_assert_int_eq(mxfp4_w_position(0, 4, 1, 32, &slot), 1);
  ck_assert_int_eq(slot, 0); /* s 1 */
  ck_assert_int_eq(mxfp4_w_position(0, 32, 1, 32, &slot), 2);
  ck_assert_int_eq(slot, 0); /* b 1 */
  ck_assert_int_eq(mxfp4_w_position(0, 8, 1, 32, &slot), 4);
  ck_assert_int_eq(slot, 0);                                        /* lane 1 */
  ck_assert_int_eq(mxfp4_w_position(1, 0, 1, 32, &slot), 16);       /* lane 4 */
  ck_assert_int_eq(mxfp4_w_position(16, 0, 3, 32, &slot), 3 * 128); /* unit 3 */
  ck_assert_int_eq(mxfp4_w_position(0, 64, 3, 32, &slot), 128);     /* unit 1 */
  /* wave 64: lane r % 16 + 16 ((k % 32) / 8) owns 2 words; word b, pair 2 s + j */
  ck_assert_int_eq(mxfp4_w_position(1, 0, 1, 64, &slot), 2);
  ck_assert_int_eq(slot, 0);
  ck_assert_int_eq(mxfp4_w_position(0, 8, 1, 64, &slot), 32);
  ck_assert_int_eq(mxfp4_w_position(0, 2, 1, 64, &slot), 0);
  ck_assert_int_eq(slot, 2);
  ck_assert_int_eq(mxfp4_w_position(0, 4, 1, 64, &slot), 0);
  ck_assert_int_eq(slot, 4);
  ck_assert_int_eq(mxfp4_w_position(0, 32, 1, 64, &slot), 1);
  ck_assert_int_eq(slot, 0);
  /* scales: [group][block][i]: wave 32 group r % 8, i r / 8; wave 64 group r / 4, i r % 4 */
  ck_assert_int_eq(mxfp4_s_offset(0, 0, 1, 32), 0);
  ck_assert_int_eq(mxfp4_s_offset(8, 0, 1, 32), 1);
  ck_assert_int_eq(mxfp4_s_offset(0, 1, 1, 32), 2);
  ck_assert_int_eq(mxfp4_s_offset(3, 1, 1, 32), 3 * 4 + 2);
  ck_assert_int_eq(mxfp4_s_offset(5, 0, 1, 64), 1 * 8 + 1);
  ck_assert_int_eq(mxfp4_s_offset(5, 1, 1, 64), 1 * 8 + 4 + 1);
  ck_assert_int_eq(mxfp4_s_offset(0, 2, 2, 64), 32);
  ck_assert_int_eq(mxfp4_code_bytes(17, 160), 2 * 3 * 512);
  ck_assert_int_eq(mxfp4_scale_bytes(17, 160), 2 * 3 * 32);
  ck_assert_int_eq(mxfp4_code_bytes(64, 512), 64 * 256); /* aligned: the checkpoint's size */
  ck_assert_int_eq(mxfp4_scale_bytes(64, 512), 64 * 16);
}
END_TEST

START_TEST(transforms_round_trip_with_zero_padding) {
  for (size_t s = 0; s < N_SHAPES; s++) {
    int wave = waves[_i];
    int64_t rows = shapes[s][0], k = shapes[s][1];
    size_t cb = (size_t)(rows * k / 2), sb = (size_t)(rows * k / 32);
    size_t tcb = (size_t)mxfp4_code_bytes(rows, k), tsb = (size_t)mxfp4_scale_bytes(rows, k);
    uint8_t *codes = tu_xmalloc(cb), *scales = tu_xmalloc(sb), *tc = tu_xmalloc(tcb), *ts = tu_xmalloc(tsb);
    uint8_t *back_c = tu_xmalloc(cb), *back_s = tu_xmalloc(sb);
    tu_fill_bytes(codes, cb, 1 + s);
    tu_fill_bytes(scales, sb, 100 + s);
    memset(tc, 0xa5, tcb), memset(ts, 0xa5, tsb);
    mxfp4_tile_codes(codes, rows, k, wave, tc);
    mxfp4_tile_scales(scales, rows, k, wave, ts);
    mxfp4_untile_codes(tc, rows, k, wave, back_c);
    mxfp4_untile_scales(ts, rows, k, wave, back_s);
    ck_assert_int_eq(memcmp(codes, back_c, cb), 0);
    ck_assert_int_eq(memcmp(scales, back_s, sb), 0);
    /* every padding code and scale byte is zero */
    int64_t chunks = mxfp4_chunks(k);
    for (int64_t w = 0; w < (int64_t)tcb / 4; w++)
      for (int slot = 0; slot < 8; slot++) {
        int64_t r, kk;
        mxfp4_w_source(w, slot, chunks, wave, &r, &kk);
        uint32_t word;
        memcpy(&word, tc + 4 * w, 4);
        if (r >= rows || kk >= k)
          ck_assert_uint_eq(mxfp4_w_get(word, slot, wave), 0);
      }
    for (int64_t o = 0; o < (int64_t)tsb; o++) {
      int64_t r, b;
      mxfp4_s_source(o, chunks, wave, &r, &b);
      if (r >= rows || b >= k / 32)
        ck_assert_uint_eq(ts[o], 0);
    }
    free(codes), free(scales), free(tc), free(ts), free(back_c), free(back_s);
  }
}
END_TEST

/* ---- the GEMM's reading of the tiles, through an emulated MMA ------------------------------------ */

static const float e2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};

/* The value of one 16-bit half of an A register after the kernel's rescale (mx_rescale): the bf16
 * pattern code * 2^-126 times 2^126, or its f16 twin code * 2^-14 times 2^14. */
static double operand_value(uint32_t reg, int half, bool f16, int wave) {
  if (wave == 64) /* the wave-64 decode gives the values themselves */
    return f16 ? (double)qk_f16_to_f32((uint16_t)(reg >> (16 * half)))
               : (double)qk_bf16_to_f32((uint16_t)(reg >> (16 * half)));
  if (!f16)
    return (double)qk_bf16_to_f32((uint16_t)(reg >> (16 * half))) * ldexp(1.0, 126);
  uint32_t h = mxfp4_bf16x2_to_f16x2(reg);
  return (double)qk_f16_to_f32((uint16_t)(h >> (16 * half))) * ldexp(1.0, 14);
}

/*
 * y [tokens, rows] from the tiled codes and scales, the way the kernel reads them, one emulated
 * MMA per k-step. The fragment tables are the ISAs':
 *   wave 32, mma.m16n8k16: lane = 4 g + t; A reg 0 (row g, K 2t, 2t+1), 1 (row g + 8, same K),
 *     2 (row g, K 2t + 8, +9), 3 (row g + 8, K 2t + 8, +9); B reg 0 (K 2t, 2t+1, token g),
 *     1 (K 2t + 8, +9, token g); C c0 c1 (row g, tokens 2t, 2t + 1), c2 c3 (row g + 8).
 *   wave 64, MFMA 16x16x16: A regs 0, 1 (row l % 16, K 4 (l/16) + 0..3); B the same K, token
 *     l % 16; D d_i (row 4 (l/16) + i, token l % 16).
 * B comes from x at the K the layout gives each lane (8 q + 4 s + 2 j + e of the scale block).
 */
static void emulated_gemm(const uint8_t *tc, const uint8_t *ts, int64_t rows, int64_t k, const float *x,
                          int64_t tokens, int wave, bool f16, double *y) {
  int64_t chunks = mxfp4_chunks(k), tiles = mxfp4_tiles(rows);
  int lane_words = 512 / 4 / wave, n_mma = wave == 32 ? 8 : 16, drpl = wave == 32 ? 2 : 4;
  int64_t token_blocks = (tokens + n_mma - 1) / n_mma;
  memset(y, 0, sizeof(double) * (size_t)(tokens * rows));
  for (int64_t tile = 0; tile < tiles; tile++)
    for (int64_t tb = 0; tb < token_blocks; tb++) {
      double acc[64][4] = {{0}};
      for (int64_t c = 0; c < chunks; c++)
        for (int b = 0; b < 2; b++) {
          double part[64][4] = {{0}};
          for (int s = 0; s < 2; s++) {
            double A[16][16] = {{0}}, B[16][16] = {{0}}; /* A[row][kl], B[kl][token] */
            for (int l = 0; l < wave; l++) {
              const uint8_t *lw = tc + ((tile * chunks + c) * 512) + l * 4 * lane_words;
              uint32_t words[4];
              memcpy(words, lw, 4 * (size_t)lane_words);
              int q = wave == 32 ? l % 4 : l / 16, tok = wave == 32 ? l / 4 : l % 16;
              /* the kernel's register choice (a_operand) */
              uint32_t a[4];
              int n_a = wave == 32 ? 4 : 2;
              if (wave == 32)
                for (int i = 0; i < n_a; i++)
                  a[i] = mxfp4_pair_bf16(words[2 * b + s], i);
              else
                mxfp4_w64_operand(words[b], s, f16, a); /* through the model of v_perm_b32 */
              /* B: x at K 32 b + 8 q + 4 s + 2 j + e, j = register, e = half */
              double bv[2][2];
              for (int j = 0; j < 2; j++)
                for (int e = 0; e < 2; e++) {
                  int64_t kk = c * 64 + 32 * b + 8 * q + 4 * s + 2 * j + e, t = tb * n_mma + tok;
                  double v = t < tokens && kk < k ? x[t * k + kk] : 0.0;
                  bv[j][e] = f16 ? (double)qk_f16_to_f32(qk_f32_to_f16((float)v))
                                 : (double)qk_bf16_to_f32(qk_f32_to_bf16((float)v));
                }
              if (wave == 32) {
                int g = l / 4, t = l % 4;
                for (int e = 0; e < 2; e++) {
                  A[g][2 * t + e] = operand_value(a[0], e, f16, wave);
                  A[g + 8][2 * t + e] = operand_value(a[1], e, f16, wave);
                  A[g][2 * t + 8 + e] = operand_value(a[2], e, f16, wave);
                  A[g + 8][2 * t + 8 + e] = operand_value(a[3], e, f16, wave);
                  B[2 * t + e][g] = bv[0][e];
                  B[2 * t + 8 + e][g] = bv[1][e];
                }
              } else {
                for (int i = 0; i < 4; i++) {
                  A[l % 16][4 * (l / 16) + i] = operand_value(a[i / 2], i % 2, f16, wave);
                  B[4 * (l / 16) + i][l % 16] = bv[i / 2][i % 2];
                }
              }
            }
            /* D = A B, handed to the lanes by the output table */
            for (int l = 0; l < wave; l++)
              for (int i = 0; i < 4; i++) {
                int row = wave == 32 ? l / 4 + 8 * (i / 2) : 4 * (l / 16) + i;
                int tok = wave == 32 ? 2 * (l % 4) + i % 2 : l % 16;
                double d = 0;
                for (int kl = 0; kl < 16; kl++)
                  d += A[row][kl] * B[kl][tok];
                part[l][i] += d;
              }
          }
          /* the rows' e8m0 scales, from the bytes the lane loads */
          for (int l = 0; l < wave; l++) {
            const uint8_t *sl = ts + (tile * chunks + c) * 32 + (l / (wave == 32 ? 4 : 16)) * 2 * drpl;
            for (int i = 0; i < 4; i++) {
              int ri = wave == 32 ? i / 2 : i;
              acc[l][i] += part[l][i] * ldexp(1.0, (int)sl[b * drpl + ri] - 127);
            }
          }
        }
      for (int l = 0; l < wave; l++)
        for (int i = 0; i < 4; i++) {
          int64_t row = tile * 16 + mxfp4_d_row(l, wave == 32 ? i / 2 : i, wave);
          int64_t t = tb * n_mma + (wave == 32 ? 2 * (l % 4) + i % 2 : l % 16);
          if (row < rows && t < tokens)
            y[t * rows + row] = acc[l][i];
        }
    }
}

START_TEST(emulated_mma_reproduces_the_product) {
  int wave = waves[_i / 2];
  bool f16 = _i % 2;
  for (size_t s = 0; s < N_SHAPES; s++) {
    int64_t rows = shapes[s][0], k = shapes[s][1], tokens = 19;
    size_t cb = (size_t)(rows * k / 2), sb = (size_t)(rows * k / 32);
    uint8_t *codes = tu_xmalloc(cb), *scales = tu_xmalloc(sb);
    uint8_t *tc = tu_xmalloc((size_t)mxfp4_code_bytes(rows, k)),
            *ts = tu_xmalloc((size_t)mxfp4_scale_bytes(rows, k));
    tu_fill_bytes(codes, cb, 7 + s);
    uint64_t rng = 11 + s;
    for (size_t i = 0; i < sb; i++) /* the whole e8m0 range bf16 products stay finite in, f16 a narrow one */
      scales[i] = f16 ? (uint8_t)(120 + tu_rand(&rng) % 8) : (uint8_t)(1 + tu_rand(&rng) % 200);
    mxfp4_tile_codes(codes, rows, k, wave, tc);
    mxfp4_tile_scales(scales, rows, k, wave, ts);
    float *x = tu_xmalloc(sizeof(float) * (size_t)(tokens * k));
    for (int64_t i = 0; i < tokens * k; i++)
      x[i] = tu_randf(&rng);
    double *y = tu_xmalloc(sizeof(double) * (size_t)(tokens * rows));
    emulated_gemm(tc, ts, rows, k, x, tokens, wave, f16, y);
    for (int64_t t = 0; t < tokens; t++)
      for (int64_t r = 0; r < rows; r++) {
        double want = 0, mag = 0;
        for (int64_t b = 0; b < k / 32; b++) {
          double block = 0;
          for (int64_t kk = 32 * b; kk < 32 * b + 32; kk++) {
            float xv = f16 ? qk_f16_to_f32(qk_f32_to_f16(x[t * k + kk]))
                           : qk_bf16_to_f32(qk_f32_to_bf16(x[t * k + kk]));
            double w = e2m1[(codes[r * (k / 2) + kk / 2] >> (4 * (kk % 2))) & 0xf];
            block += w * xv;
            mag += fabs(w * xv) * ldexp(1.0, scales[r * (k / 32) + b] - 127);
          }
          want += block * ldexp(1.0, scales[r * (k / 32) + b] - 127);
        }
        double got = y[t * rows + r];
        ck_assert_msg(fabs(got - want) <= 1e-12 * (mag + 1e-300),
                      "wave %d %s [%lld, %lld] t %lld r %lld: %g vs %g", wave, f16 ? "f16" : "bf16",
                      (long long)rows, (long long)k, (long long)t, (long long)r, got, want);
      }
    free(codes), free(scales), free(tc), free(ts), free(x), free(y);
  }
}
END_TEST

/* ---- the plan ------------------------------------------------------------------------------------ */

START_TEST(plan_covers_every_chunk) {
  static const int64_t ms[] = {1, 7, 8, 9, 16, 17, 33, 64, 65, 256};
  static const int64_t nk[][2] = {{8192, 8192}, {4096, 14336}, {14336, 4096}, {40, 96}, {2880, 2880}};
  for (int w = 0; w < 2; w++)
    for (size_t a = 0; a < sizeof ms / sizeof ms[0]; a++)
      for (size_t b = 0; b < sizeof nk / sizeof nk[0]; b++)
        for (int split = 0; split <= 9; split++) {
          struct mxfp4_plan p;
          int64_t m = ms[a], n = nk[b][0], k = nk[b][1], chunks = mxfp4_chunks(k);
          mxfp4_plan_gemm(m, n, k, waves[w], w ? 304 : 132, split, &p);
          ck_assert(p.tokens >= (waves[w] == 32 ? 8 : 16) && p.tokens <= MXFP4_MAX_TOKENS);
          ck_assert(p.tokens >= m || p.tokens == MXFP4_MAX_TOKENS);
          ck_assert_int_eq(p.grid_y, (m + p.tokens - 1) / p.tokens);
          ck_assert_int_eq(p.grid_x * p.waves >= mxfp4_tiles(n), 1);
          ck_assert_int_eq((p.grid_x - 1) * p.waves < mxfp4_tiles(n), 1);
          ck_assert_int_eq(p.chunks_per_split % p.stage, 0);
          ck_assert(p.split >= 1 && p.split <= MXFP4_MAX_SPLIT + 1);
          ck_assert(p.split <= (split > 0 ? split : MXFP4_MAX_SPLIT));
          /* the splits cover every chunk once, none empty */
          ck_assert(p.split * p.chunks_per_split >= chunks);
          ck_assert((p.split - 1) * p.chunks_per_split < chunks);
          /* automatic: the partial sums within a quarter of the weight bytes */
          if (split == 0 && p.split > 1)
            ck_assert_int_le(8 * (int64_t)p.split * m * n,
                             (mxfp4_code_bytes(n, k) + mxfp4_scale_bytes(n, k)) / 4 + 8 * m * n);
          /* LDS: the HIP build's 64 KiB per workgroup, with room to spare */
          ck_assert_uint_le(mxfp4_stage_bytes(p.tokens, p.stage), 40 * 1024);
        }
  /* 8192^2 at m = 1 on the H200's 132 SMs: 64 blocks of 8 tiles, split to cover the SMs twice */
  struct mxfp4_plan p;
  mxfp4_plan_gemm(1, 8192, 8192, 32, 132, 0, &p);
  ck_assert_int_eq(p.tokens, 8);
  ck_assert_int_eq(p.grid_x, 64);
  ck_assert_int_eq(p.split, 4);
  ck_assert_int_eq(p.chunks_per_split, 32);
  /* at m = 64 the partial sums would outweigh the split: two splits, not five */
  mxfp4_plan_gemm(64, 8192, 8192, 32, 132, 0, &p);
  ck_assert_int_eq(p.tokens, 64);
  ck_assert_int_eq(p.split, 2);
}
END_TEST

static Suite *layout_suite(void) {
  Suite *s = suite_create("mxfp4_layout");
  TCase *tc = tcase_create("layout");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, code_positions_are_a_bijection, 0, 2);
  tcase_add_loop_test(tc, scale_positions_are_a_bijection, 0, 2);
  tcase_add_test(tc, spot_positions);
  tcase_add_loop_test(tc, transforms_round_trip_with_zero_padding, 0, 2);
  tcase_add_loop_test(tc, emulated_mma_reproduces_the_product, 0, 4);
  tcase_add_test(tc, plan_covers_every_chunk);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run_suite(layout_suite(), CK_NORMAL); }
