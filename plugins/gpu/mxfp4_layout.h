/*
 * mxfp4_layout.h: the kernel layout of MXFP4 weights (e2m1 codes, e8m0
 * scales per 32 along K) shared by the CUDA build (cuda-nvfp4's MXFP4 path,
 * wave 32, mma.m16n8k16) and the HIP build (rocm-mxfp4, wave 64, MFMA
 * 16x16x16), as index math that the CPU transforms (mxfp4_layout.c, tested in
 * CI by tests/check_mxfp4_layout.c), the GPU transforms and the GEMM's loads
 * (mxfp4_kernel.h) share: one copy. Plain C; under nvcc or hipcc/clang HIP
 * every function is __host__ __device__.
 *
 * The weight is cut into units of one 16-row tile by one 64-K chunk (two
 * scale blocks): rows padded to round_up(R, 16), K to round_up(K, 64), the
 * padding zero codes and zero scale bytes. Unit (tile, chunk) sits at index
 * tile * chunks + chunk, so one tile's chunks are one contiguous run. A unit
 * holds 512 bytes of codes and, in the scale tensor, 32 scale bytes.
 *
 * Codes. A wave of W lanes (32 or 64) reads a unit with one load per lane:
 * lane l owns the 512 / W bytes at l * 512 / W (16 bytes, 4 words, on wave
 * 32; 8 bytes, 2 words, on wave 64). Each 32-bit word holds four "pairs",
 * each pair the two codes that make one 32-bit register of the MMA's A
 * operand (two consecutive K of one row), with the bits placed for the
 * decode of each build (mxfp4_w_bits): on wave 32 where a bf16 conversion by
 * masks wants them; on wave 64 as plain nibbles, pairs 0 and 1 in the low
 * nibbles of bytes 0, 1 and 2, 3, pairs 2 and 3 in the high nibbles, so that
 * a byte permute (v_perm_b32) looks four codes' bf16 bytes up at once
 * (mxfp4_w64_operand). Pair P of a lane (P = 4 * word +
 * pair) is, with rpl the A rows per lane (2 on wave 32, 1 on wave 64),
 *   h = P % rpl, j = (P / rpl) % 2, s = (P / (2 rpl)) % 2, b = P / (4 rpl),
 * and its element e (0, 1) is code
 *   row  = a_row(l, h)        wave 32: l / 4 + 8 h;  wave 64: l % 16
 *   k    = 32 b + 8 q(l) + 4 s + 2 j + e,   q(l) = wave 32: l % 4; wave 64: l / 16
 * of the unit. So every MMA k-step (16 K) lies inside one scale block b, and
 * a lane's K within a block are 8 consecutive elements (one 16-byte load of
 * the activations). Step s of block b reads word 2b + s on wave 32 (its four
 * pairs are mma.m16n8k16's a0a1 a2a3 a4a5 a6a7) and pairs 2s, 2s + 1 of
 * word b on wave 64 (MFMA 16x16x16's four A elements).
 *
 * Scales. The MMA accumulates each scale block separately and multiplies the
 * f32 result by 2^(e8m0 - 127) per output row, so a lane needs the scales of
 * the rows its accumulators hold: "d-rows" d_row(l, i), i < drpl, wave 32:
 * rows l / 4 + 8 i (drpl 2: mma's c0c1, c2c3); wave 64: rows 4 (l / 16) + i
 * (drpl 4: MFMA's four outputs). Rows group by lane: group g = l / 4 (wave
 * 32, 8 groups) or l / 16 (wave 64, 4 groups); the unit's 32 scale bytes are
 * [group][block 2][i], i.e. byte g * 2 drpl + b * drpl + i, so a lane reads
 * its 4 (wave 32) or 8 (wave 64) scale bytes with one load.
 *
 * When R % 16 == 0 and K % 64 == 0 the tiled codes and scales are exactly as
 * large as the checkpoint's, so PWAL repacks them in their own storage.
 */
#ifndef QKEEP_GPU_MXFP4_LAYOUT_H
#define QKEEP_GPU_MXFP4_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define MXFP4_INLINE static inline __host__ __device__
#elif defined(__HIP__) /* built without the HIP headers (mxfp4_mma.h) */
#define MXFP4_INLINE static inline __attribute__((host, device))
#else
#define MXFP4_INLINE static inline
#endif

#define MXFP4_BLOCK 32       /* K elements per e8m0 scale */
#define MXFP4_TILE_ROWS 16   /* rows of a unit */
#define MXFP4_CHUNK_K 64     /* K of a unit (two scale blocks) */
#define MXFP4_UNIT_BYTES 512 /* code bytes of a unit */
#define MXFP4_UNIT_SCALES 32 /* scale bytes of a unit: 16 rows x 2 blocks */

MXFP4_INLINE int64_t mxfp4_round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Tiles, chunks and bytes of one expert's tiled codes and scales ([rows, k] matrix). */
MXFP4_INLINE int64_t mxfp4_tiles(int64_t rows) {
  return mxfp4_round_up(rows, MXFP4_TILE_ROWS) / MXFP4_TILE_ROWS;
}
MXFP4_INLINE int64_t mxfp4_chunks(int64_t k) { return mxfp4_round_up(k, MXFP4_CHUNK_K) / MXFP4_CHUNK_K; }
MXFP4_INLINE int64_t mxfp4_code_bytes(int64_t rows, int64_t k) {
  return mxfp4_tiles(rows) * mxfp4_chunks(k) * MXFP4_UNIT_BYTES;
}
MXFP4_INLINE int64_t mxfp4_scale_bytes(int64_t rows, int64_t k) {
  return mxfp4_tiles(rows) * mxfp4_chunks(k) * MXFP4_UNIT_SCALES;
}

/* A rows per lane and d-rows per lane of a wave of `wave` lanes (32 or 64). */
MXFP4_INLINE int mxfp4_rpl(int wave) { return wave == 32 ? 2 : 1; }
MXFP4_INLINE int mxfp4_drpl(int wave) { return wave == 32 ? 2 : 4; }

/*
 * Bit positions of slot `slot` (0..7: pair slot / 2, element slot % 2) of a code word of
 * wave `wave`: the code's m, e0, e1 and sign bits in bits[0..3]. Wave 32: pair 0 sits at
 * the bits of a bf16x2 (e1 e0 m at 8..6 / 24..22, sign at 15 / 31), pairs 1 and 2 at the
 * same bits shifted down by 3 and by 6, pair 3 in the bits left over (mxfp4_pair_bf16
 * decodes them). Wave 64: plain nibbles, element e of pair p in byte e + 2 (p % 2), the low
 * nibble for pairs 0 and 1, the high one for pairs 2 and 3.
 */
MXFP4_INLINE void mxfp4_w_bits(int slot, int wave, int bits[4]) {
  static const unsigned char pos[8][4] = {{6, 7, 8, 15},    {22, 23, 24, 31}, {3, 4, 5, 12},
                                          {19, 20, 21, 28}, {0, 1, 2, 9},     {16, 17, 18, 25},
                                          {10, 11, 13, 14}, {26, 27, 29, 30}};
  int pair = slot / 2, base = 8 * (slot % 2 + 2 * (pair % 2)) + 4 * (pair / 2);
  for (int i = 0; i < 4; i++)
    bits[i] = wave == 32 ? pos[slot][i] : base + i;
}

/* Word with the 4-bit code stored in `slot` (whose bits must be clear). */
MXFP4_INLINE uint32_t mxfp4_w_put(uint32_t word, int slot, int wave, unsigned code) {
  int bits[4];
  mxfp4_w_bits(slot, wave, bits);
  for (int i = 0; i < 4; i++)
    word |= (uint32_t)((code >> i) & 1u) << bits[i];
  return word;
}

/* The code in `slot` of word. */
MXFP4_INLINE unsigned mxfp4_w_get(uint32_t word, int slot, int wave) {
  int bits[4];
  mxfp4_w_bits(slot, wave, bits);
  unsigned code = 0;
  for (int i = 0; i < 4; i++)
    code |= ((word >> bits[i]) & 1u) << i;
  return code;
}

/*
 * Pair `pair` (0..3) of a code word as two bf16 bit patterns, code * 2^-126 each exactly
 * (the code 0.5 lands on the smallest bf16 subnormal; the low half is element 0).
 */
MXFP4_INLINE uint32_t mxfp4_pair_bf16(uint32_t q, int pair) {
  const uint32_t t = 0x81c081c0u;
  switch (pair) {
  case 0: return q & t;
  case 1: return (q << 3) & t;
  case 2: return (q << 6) & t;
  default: return ((q >> 4) & 0x00c000c0u) | ((q >> 5) & 0x01000100u) | ((q << 1) & 0x80008000u);
  }
}

/* The same pair as f16 bit patterns, code * 2^-14 each (e1 e0 m move from bits 8..6 to 11..9). */
MXFP4_INLINE uint32_t mxfp4_bf16x2_to_f16x2(uint32_t p) {
  return (p & 0x80008000u) | ((p << 3) & 0x0e000e00u);
}

/*
 * v_perm_b32's byte permute, for the selector bytes used here: 0..7 pick byte n of the
 * 8 bytes {lo (bytes 0..3), hi (4..7)}, 12 gives 0x00. HIP device code runs the instruction
 * (MXFP4_PERM); elsewhere this is its model, so CI tests the decode.
 */
MXFP4_INLINE uint32_t mxfp4_perm_model(uint32_t hi, uint32_t lo, uint32_t sel) {
  uint64_t t = ((uint64_t)hi << 32) | lo;
  uint32_t d = 0;
  for (int i = 0; i < 4; i++) {
    unsigned s = (sel >> (8 * i)) & 0xffu;
    uint32_t byte = s < 8 ? (uint32_t)(t >> (8 * s)) & 0xffu : 0u;
    d |= byte << (8 * i);
  }
  return d;
}
#if defined(__HIP__) && defined(__HIP_DEVICE_COMPILE__)
#define MXFP4_PERM(hi, lo, sel) __builtin_amdgcn_perm((hi), (lo), (sel)) /* v_perm_b32 */
#else
#define MXFP4_PERM mxfp4_perm_model
#endif

/*
 * The two A registers of k-step s (0: the low nibbles, 1: the high ones) of a wave-64 code
 * word, as the codes' exact bf16 (f16 0) or f16 values: one byte permute looks up the high
 * bytes of four codes' values by their magnitudes, one the low bytes (f16's are all zero),
 * the signs go into the high bytes, two more permutes interleave them into pairs.
 */
MXFP4_INLINE void mxfp4_w64_operand(uint32_t word, int s, int f16, uint32_t a[2]) {
  const uint32_t q = s ? word >> 4 : word, mag = q & 0x07070707u, sign = (q & 0x08080808u) << 4;
  /* magnitudes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 */
  if (f16) {
    const uint32_t h = MXFP4_PERM(0x46444240u, 0x3e3c3800u, mag) | sign;
    a[0] = MXFP4_PERM(h, 0u, 0x050c040cu);
    a[1] = MXFP4_PERM(h, 0u, 0x070c060cu);
  } else {
    const uint32_t h = MXFP4_PERM(0x40404040u, 0x3f3f3f00u, mag) | sign;
    const uint32_t l = MXFP4_PERM(0xc0804000u, 0xc0800000u, mag);
    a[0] = MXFP4_PERM(h, l, 0x05010400u);
    a[1] = MXFP4_PERM(h, l, 0x07030602u);
  }
}

/* ---- codes: (row, k) <-> (word, slot) ------------------------------------------------------- */

/* Word index (into one expert's tiled codes, `chunks` chunks) and *slot holding code (r, k). */
MXFP4_INLINE int64_t mxfp4_w_position(int64_t r, int64_t k, int64_t chunks, int wave, int *slot) {
  int rr = (int)(r % MXFP4_TILE_ROWS), kk = (int)(k % MXFP4_CHUNK_K);
  int b = kk / 32, in = kk % 32, q = in / 8, s = (in % 8) / 4, j = (in % 4) / 2, e = in % 2;
  int rpl = mxfp4_rpl(wave), lane, h;
  if (wave == 32)
    lane = 4 * (rr % 8) + q, h = rr / 8;
  else
    lane = rr + 16 * q, h = 0;
  int p = ((b * 2 + s) * 2 + j) * rpl + h;
  int lane_words = MXFP4_UNIT_BYTES / 4 / wave;
  *slot = 2 * (p % 4) + e;
  int64_t unit = (r / MXFP4_TILE_ROWS) * chunks + k / MXFP4_CHUNK_K;
  return unit * (MXFP4_UNIT_BYTES / 4) + lane * lane_words + p / 4;
}

/* The inverse: the code (r, k) in `slot` of `word` (padding included: r may be >= rows, k >= K). */
MXFP4_INLINE void mxfp4_w_source(int64_t word, int slot, int64_t chunks, int wave, int64_t *r, int64_t *k) {
  int lane_words = MXFP4_UNIT_BYTES / 4 / wave, rpl = mxfp4_rpl(wave);
  int64_t unit = word / (MXFP4_UNIT_BYTES / 4);
  int in_unit = (int)(word % (MXFP4_UNIT_BYTES / 4));
  int lane = in_unit / lane_words, p = (in_unit % lane_words) * 4 + slot / 2, e = slot % 2;
  int h = p % rpl, j = (p / rpl) % 2, s = (p / (2 * rpl)) % 2, b = p / (4 * rpl);
  int q = wave == 32 ? lane % 4 : lane / 16;
  int row = wave == 32 ? lane / 4 + 8 * h : lane % 16;
  *r = (unit / chunks) * MXFP4_TILE_ROWS + row;
  *k = (unit % chunks) * MXFP4_CHUNK_K + 32 * b + 8 * q + 4 * s + 2 * j + e;
}

/* ---- scales: (row, block) <-> byte ---------------------------------------------------------- */

/* Byte offset (into one expert's tiled scales) of the scale of row r, K block kb (k / 32). */
MXFP4_INLINE int64_t mxfp4_s_offset(int64_t r, int64_t kb, int64_t chunks, int wave) {
  int rr = (int)(r % MXFP4_TILE_ROWS), b = (int)(kb % 2), drpl = mxfp4_drpl(wave);
  int g = wave == 32 ? rr % 8 : rr / 4, i = wave == 32 ? rr / 8 : rr % 4;
  int64_t unit = (r / MXFP4_TILE_ROWS) * chunks + kb / 2;
  return unit * MXFP4_UNIT_SCALES + g * 2 * drpl + b * drpl + i;
}

/* The inverse: the (r, kb) whose scale byte `offset` holds (padding included). */
MXFP4_INLINE void mxfp4_s_source(int64_t offset, int64_t chunks, int wave, int64_t *r, int64_t *kb) {
  int64_t unit = offset / MXFP4_UNIT_SCALES;
  int in = (int)(offset % MXFP4_UNIT_SCALES), drpl = mxfp4_drpl(wave);
  int g = in / (2 * drpl), b = (in / drpl) % 2, i = in % drpl;
  int rr = wave == 32 ? g + 8 * i : 4 * g + i;
  *r = (unit / chunks) * MXFP4_TILE_ROWS + rr;
  *kb = (unit % chunks) * 2 + b;
}

/* The d-row (row within the tile) of accumulator row index i of lane l. */
MXFP4_INLINE int mxfp4_d_row(int lane, int i, int wave) {
  return wave == 32 ? lane / 4 + 8 * i : 4 * (lane / 16) + i;
}

/* 2^(e8m0 - 127) as f32 bits: 0 is 2^-127 (a subnormal), 255 is NaN. */
MXFP4_INLINE uint32_t mxfp4_e8m0_f32_bits(unsigned s) {
  return s == 0 ? 0x00400000u : s == 255 ? 0x7fc00000u : (uint32_t)s << 23;
}

#endif
