/*
 * layout.h: the kernel layouts of the cuda-nvfp4 backend, as index math that
 * the CPU transforms (layout.c, tested in CI by tests/check_cuda_layout.c)
 * and the GPU code (kernels.cu: PWAL transforms and the GEMM's loads) share:
 * one copy. Plain C; under nvcc every function is __host__ __device__.
 *
 * Block scales (e4m3, checkpoint [R, C] with C = K/16, row-major) use the
 * 128x4 swizzle of CUTLASS / cuBLAS / FlashInfer / vLLM:
 * rows padded to Rp = round_up(R, 128), columns to Cp = round_up(C, 4), the
 * padding zero, and scale (r, c) at byte
 *
 *   ((r / 128) * (Cp / 4) + c / 4) * 512 + (r % 32) * 16 + ((r / 32) % 4) * 4 + c % 4.
 *
 * One 512-byte atom holds 128 rows x 64 K; the GEMM's 128-row block reads
 * exactly one atom per 64-K chunk.
 *
 * Weights (packed e2m1, checkpoint [R, K/2], element 2i in the low nibble)
 * use "fragment tiles", the A-operand layout of mma.m16n8k16 with a K
 * permutation inside each 64-K chunk: rows padded to Rp = round_up(R, 16)
 * and K to Kp = round_up(K, 64) (zero codes), then 512 bytes (32 lanes x
 * 16 bytes) for each 16-row tile and 64-K chunk, in groups of 8 tiles (128
 * rows, one scale atom; the last group may have fewer, T): group outermost,
 * then chunk, then the group's T tiles (nvfp4_w_tile_offset), so that one
 * chunk of a group is T x 512 contiguous bytes and a run of chunks one
 * contiguous copy (the wgmma kernel's bulk copies). Lane
 * l = 4g + t holds rows g and g + 8 of the tile at the 16 K of scale block
 * t of the chunk (k = 16t + 4j + e, j = 0..3, e = 0..3), as four 32-bit
 * words, word j for mma k-step j. A word holds the fragment's four register
 * pairs a0a1 (row g, e 0/1), a2a3 (row g + 8, e 0/1), a4a5 (row g, e 2/3)
 * and a6a7 (row g + 8, e 2/3) with the four bits of each code (sign s and
 * magnitude e1 e0 m) placed where the bf16 conversion wants them: pair 0 at
 * the bits of a bf16x2 (s at 15 / 31, e1 e0 m at 8..6 / 24..22), pairs 1
 * and 2 at the same bits shifted down by 3 and by 6, pair 3 in the 8 bits
 * left over (nvfp4_w_bits). Decoding a pair is then one mask (pair 0), a
 * shift and a mask (pairs 1, 2), or three of each (pair 3). When R % 16 == 0
 * and K % 64 == 0 the tiled weight is exactly as large as the checkpoint's.
 */
#ifndef QKEEP_CUDA_LAYOUT_H
#define QKEEP_CUDA_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define NVFP4_INLINE static inline __host__ __device__
#else
#define NVFP4_INLINE static inline
#endif

#define NVFP4_BLOCK 16       /* K elements per e4m3 block scale */
#define NVFP4_SF_ROWS 128    /* rows of a swizzle atom */
#define NVFP4_SF_COLS 4      /* scale columns of a swizzle atom */
#define NVFP4_SF_ATOM 512    /* bytes of a swizzle atom */
#define NVFP4_TILE_ROWS 16   /* rows of a weight fragment tile */
#define NVFP4_CHUNK_K 64     /* K of a weight fragment tile (4 scale blocks) */
#define NVFP4_TILE_BYTES 512 /* bytes of one tile x chunk: 32 lanes x 16 bytes */

NVFP4_INLINE int64_t nvfp4_round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
/* v limited to [lo, hi]. */
NVFP4_INLINE int nvfp4_clamp(int64_t v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : (int)v; }

/* ---- block scales: the 128x4 swizzle -------------------------------------------------- */

/* Padded rows and columns of the swizzled scales of an [rows, cols] scale matrix. */
NVFP4_INLINE int64_t nvfp4_sf_rows(int64_t rows) { return nvfp4_round_up(rows, NVFP4_SF_ROWS); }
NVFP4_INLINE int64_t nvfp4_sf_cols(int64_t cols) { return nvfp4_round_up(cols, NVFP4_SF_COLS); }
/* Bytes of the swizzled scales (one expert). */
NVFP4_INLINE int64_t nvfp4_sf_bytes(int64_t rows, int64_t cols) {
  return nvfp4_sf_rows(rows) * nvfp4_sf_cols(cols);
}

/* Byte offset of scale (r, c) in the swizzled layout with padded columns cols_padded. */
NVFP4_INLINE int64_t nvfp4_sf_offset(int64_t r, int64_t c, int64_t cols_padded) {
  return ((r / 128) * (cols_padded / 4) + c / 4) * 512 + (r % 32) * 16 + ((r / 32) % 4) * 4 + c % 4;
}

/* The inverse: the (r, c) that byte `offset` of the swizzled layout holds (padding
 * included: r may be >= rows, c >= cols). */
NVFP4_INLINE void nvfp4_sf_source(int64_t offset, int64_t cols_padded, int64_t *r, int64_t *c) {
  int64_t atom = offset / 512, inner = offset % 512;
  int64_t atoms_per_row_block = cols_padded / 4;
  *r = (atom / atoms_per_row_block) * 128 + ((inner / 4) % 4) * 32 + inner / 16;
  *c = (atom % atoms_per_row_block) * 4 + inner % 4;
}

/* ---- weights: fragment tiles ----------------------------------------------------------- */

/* Padded rows, K chunks and bytes of the tiled weight of an [rows, k] matrix (one expert). */
NVFP4_INLINE int64_t nvfp4_w_rows(int64_t rows) { return nvfp4_round_up(rows, NVFP4_TILE_ROWS); }
NVFP4_INLINE int64_t nvfp4_w_chunks(int64_t k) { return nvfp4_round_up(k, NVFP4_CHUNK_K) / NVFP4_CHUNK_K; }
NVFP4_INLINE int64_t nvfp4_w_bytes(int64_t rows, int64_t k) {
  return nvfp4_w_rows(rows) / NVFP4_TILE_ROWS * nvfp4_w_chunks(k) * NVFP4_TILE_BYTES;
}

/*
 * Bit positions of slot `slot` (0..7) of a tile word: slot = 2 * pair + (e & 1), pair =
 * h + 2 * (e >> 1) for row g + 8h and element e of the k-step. Returns the positions of
 * the code's sign, e1, e0 and m bits in bits[3..0].
 */
NVFP4_INLINE void nvfp4_w_bits(int slot, int bits[4]) {
  static const unsigned char pos[8][4] = {{6, 7, 8, 15},    {22, 23, 24, 31}, {3, 4, 5, 12},
                                          {19, 20, 21, 28}, {0, 1, 2, 9},     {16, 17, 18, 25},
                                          {10, 11, 13, 14}, {26, 27, 29, 30}};
  for (int i = 0; i < 4; i++)
    bits[i] = pos[slot][i];
}

/* The slot of element e (0..3) of row g + 8h in its word. */
NVFP4_INLINE int nvfp4_w_slot(int e, int h) { return 2 * (h + 2 * (e >> 1)) + (e & 1); }

/* Tiles of the 8-tile group that tile `tile` is in, of a matrix with `tiles` tiles. */
NVFP4_INLINE int64_t nvfp4_w_group_tiles(int64_t tile, int64_t tiles) {
  int64_t left = tiles - tile / 8 * 8;
  return left < 8 ? left : 8;
}

/* Byte offset of the 512 bytes of (tile, chunk) in one expert's tiled weight of `tiles`
 * tiles and `chunks` chunks. */
NVFP4_INLINE int64_t nvfp4_w_tile_offset(int64_t tile, int64_t chunk, int64_t tiles, int64_t chunks) {
  return ((tile / 8) * 8 * chunks + chunk * nvfp4_w_group_tiles(tile, tiles) + tile % 8) * NVFP4_TILE_BYTES;
}

/* The 32-bit word (index into one expert's tiled weight) and *slot that hold code (r, k)
 * of a matrix of `rows` rows and `chunks` K chunks. */
NVFP4_INLINE int64_t nvfp4_w_position(int64_t r, int64_t k, int64_t rows, int64_t chunks, int *slot) {
  int64_t tile = r / 16, chunk = k / 64;
  int g = (int)(r % 8), h = (int)((r % 16) / 8);
  int kk = (int)(k % 64), t = kk / 16, j = (kk % 16) / 4, e = kk % 4;
  *slot = nvfp4_w_slot(e, h);
  return nvfp4_w_tile_offset(tile, chunk, nvfp4_w_rows(rows) / 16, chunks) / 4 + (4 * g + t) * 4 + j;
}

/* The inverse: the code (r, k) that slot `slot` of word `word` holds (padding included:
 * r may be >= rows, k >= K). */
NVFP4_INLINE void nvfp4_w_source(int64_t word, int slot, int64_t rows, int64_t chunks, int64_t *r,
                                 int64_t *k) {
  int j = (int)(word % 4), lane = (int)((word / 4) % 32);
  int64_t unit = word / 128, group = unit / (8 * chunks), in_group = unit % (8 * chunks);
  int64_t group_tiles = nvfp4_w_group_tiles(group * 8, nvfp4_w_rows(rows) / 16);
  int64_t tile = group * 8 + in_group % group_tiles, chunk = in_group / group_tiles;
  int pair = slot / 2, h = pair & 1, e = 2 * (pair >> 1) + (slot & 1);
  *r = tile * 16 + lane / 4 + 8 * h;
  *k = chunk * 64 + 16 * (lane % 4) + 4 * j + e;
}

/* Word with code (4 bits) stored in `slot` (whose bits must be clear). */
NVFP4_INLINE uint32_t nvfp4_w_put(uint32_t word, int slot, unsigned code) {
  int bits[4];
  nvfp4_w_bits(slot, bits);
  for (int i = 0; i < 4; i++)
    word |= (uint32_t)((code >> i) & 1) << bits[i];
  return word;
}

/* The code in `slot` of word. */
NVFP4_INLINE unsigned nvfp4_w_get(uint32_t word, int slot) {
  int bits[4];
  nvfp4_w_bits(slot, bits);
  unsigned code = 0;
  for (int i = 0; i < 4; i++)
    code |= ((word >> bits[i]) & 1u) << i;
  return code;
}

/*
 * Tile word (lane 4g + t, word j) of a chunk from the two 16-bit reads it needs: codes k = 16t + 4j + e
 * (e = 0..3) of rows g (lo) and g + 8 (hi), element 2i in the low nibble of byte i. Each code's four
 * bits go where nvfp4_w_bits puts them for its slot (nvfp4_w_slot(e, 0 / 1): slots 0, 1, 4, 5 for
 * row g, 2, 3, 6, 7 for row g + 8), written out as shifts and masks: the transforms run this once
 * per word, and a loop over the 32 bits cost the GPU about a hundred instructions a word.
 */
NVFP4_INLINE uint32_t nvfp4_w_word(unsigned lo, unsigned hi) {
  return ((lo & 0x7u) << 6) | ((lo & 0x8u) << 12) |       /* row g, e 0: slot 0, bits 6..8, 15 */
         ((lo & 0x70u) << 18) | ((lo & 0x80u) << 24) |    /* e 1: slot 1, 22..24, 31 */
         ((lo >> 8) & 0x7u) | ((lo >> 2) & 0x200u) |      /* e 2: slot 4, 0..2, 9 */
         ((lo & 0x7000u) << 4) | ((lo & 0x8000u) << 10) | /* e 3: slot 5, 16..18, 25 */
         ((hi & 0x7u) << 3) | ((hi & 0x8u) << 9) |        /* row g + 8, e 0: slot 2, 3..5, 12 */
         ((hi & 0x70u) << 15) | ((hi & 0x80u) << 21) |    /* e 1: slot 3, 19..21, 28 */
         ((hi & 0x300u) << 2) | ((hi & 0xc00u) << 3) |    /* e 2: slot 6, 10, 11, 13, 14 */
         ((hi & 0x3000u) << 14) | ((hi & 0xc000u) << 15); /* e 3: slot 7, 26, 27, 29, 30 */
}

/* ---- the transforms in place ----------------------------------------------------------- */

/*
 * Without padding (weights: rows % 16 == 0 and K % 64 == 0; scales: rows % 128 == 0 and
 * cols % 4 == 0) both layouts permute bytes only within a 128-row group, the group's bytes
 * staying where they were, so a group read whole can be written back over itself. The GPU
 * spreads a group of `bytes` over `parts` blocks of `slice` bytes each (the shared memory of a
 * thread-block cluster): part p holds bytes [p * slice, (p + 1) * slice) and writes units
 * [units * p / parts, units * (p + 1) / parts) of the group's 512-byte units.
 */
#define NVFP4_IN_PLACE_SLICE ((int64_t)64 << 10)      /* a block's aim: three blocks an SM */
#define NVFP4_IN_PLACE_MAX_SLICE ((int64_t)200 << 10) /* the most a block takes */
#define NVFP4_IN_PLACE_MAX_PARTS 8                    /* a portable cluster */

/* The parts and slice of a group of `bytes`; 0, or -1 when even 8 blocks cannot hold it. */
NVFP4_INLINE int nvfp4_in_place_split(int64_t bytes, int64_t *parts, int64_t *slice) {
  int64_t want = (bytes + NVFP4_IN_PLACE_SLICE - 1) / NVFP4_IN_PLACE_SLICE;
  *parts = want < 1 ? 1 : want < NVFP4_IN_PLACE_MAX_PARTS ? want : NVFP4_IN_PLACE_MAX_PARTS;
  *slice = ((bytes + *parts - 1) / *parts + 15) / 16 * 16;
  return *slice > NVFP4_IN_PLACE_MAX_SLICE ? -1 : 0;
}

/* Where lane `lane` (4g + t) of unit u of a weight group (group_tiles tiles, rows of row_bytes) reads
 * the codes of its four words: 8 bytes of row g (lo) and 8 of row g + 8 (hi), codes k = 16t .. 16t + 15
 * of the unit's chunk, word j's in bytes 2j and 2j + 1 of each; byte offsets in the group, multiples
 * of 8 (unit u is tile u % group_tiles of chunk u / group_tiles). */
NVFP4_INLINE void nvfp4_w_lane_reads(unsigned u, unsigned lane, unsigned group_tiles, unsigned row_bytes,
                                     unsigned *lo, unsigned *hi) {
  const unsigned g = lane / 4, t = lane % 4;
  const unsigned r = (u % group_tiles) * 16 + g, byte = (u / group_tiles) * 32 + 8 * t;
  *lo = r * row_bytes + byte;
  *hi = *lo + 8 * row_bytes;
}

/* Where word `word` of atom u of a scale group (rows of `cols` bytes) reads its 32 bits: row
 * 32 (word % 4) + word / 4 of the group, columns 4u .. 4u + 3. */
NVFP4_INLINE unsigned nvfp4_sf_group_read(unsigned u, unsigned word, unsigned cols) {
  return ((word % 4) * 32 + word / 4) * cols + u * 4;
}

/*
 * Register pair `pair` (0..3) of a tile word as the bit patterns of two bf16 values,
 * code * 2^-126 each, exactly (the code 0.5 lands on the smallest bf16 subnormal, the
 * others on normals; the low half holds the first element). The GEMM multiplies the pair
 * by its block scale times 2^63 and the result by 2^63 at the end.
 */
NVFP4_INLINE uint32_t nvfp4_pair_bf16(uint32_t q, int pair) {
  const uint32_t t = 0x81c081c0u; /* s at 15 / 31, e1 e0 m at 8..6 / 24..22 */
  switch (pair) {
  case 0: return q & t;
  case 1: return (q << 3) & t;
  case 2: return (q << 6) & t;
  default: return ((q >> 4) & 0x00c000c0u) | ((q >> 5) & 0x01000100u) | ((q << 1) & 0x80008000u);
  }
}

/* The same pair as f16 bit patterns, code * 2^-14 each, from the bf16 ones (e1 e0 m move
 * from bits 8..6 to 11..9). */
NVFP4_INLINE uint32_t nvfp4_bf16x2_to_f16x2(uint32_t p) {
  return (p & 0x80008000u) | ((p << 3) & 0x0e000e00u);
}

/* ---- activations staged for the wgmma kernel ------------------------------------------- */

/*
 * The wgmma kernel takes the weight tile words above as its register-sourced A operand
 * (per warp, wgmma's A fragment is mma.m16n8k16's), so the K permutation inside each
 * 64-K chunk carries over: logical column c = 8h + 2t + e' (h, e' in 0..1, t in 0..3) of
 * k-step j holds k = 16t + 4j + 2h + e' of the chunk. The B operand (activations) comes
 * from shared memory through a descriptor, in wgmma's no-swizzle K-major layout: core
 * matrices of 8 tokens x 8 logical K (16 bytes a token, 128 bytes each). A launch first
 * stages x [m, K] (16-bit) into that order, zero past m and K, tokens in tiles of `mt`
 * (a multiple of 8): per tile and 64-K chunk one block of mt x 64 elements,
 *
 *   [j 4][h 2][token / 8][token % 8][2t + e'],
 *
 * so k-step j of a chunk starts at element j * 16 * mt, its two core matrices along K are
 * 8 * mt elements apart (the descriptor's leading byte offset, 16 * mt bytes) and 8-token
 * groups 64 elements apart (its stride byte offset, 128 bytes). A stage of the kernel's
 * ring is one contiguous block (one bulk copy).
 */

/* Elements of the staged activations of m tokens x k (tiles of mt tokens). */
NVFP4_INLINE int64_t nvfp4_x_elems(int64_t m, int64_t k, int mt) {
  return nvfp4_round_up(m, mt) * nvfp4_w_chunks(k) * NVFP4_CHUNK_K;
}

/* Element index of x[token][k] in the staged activations (tiles of mt tokens). */
NVFP4_INLINE int64_t nvfp4_x_offset(int64_t token, int64_t k, int64_t chunks, int mt) {
  int64_t tile = token / mt, n = token % mt, chunk = k / 64;
  int kk = (int)(k % 64), t = kk / 16, j = (kk % 16) / 4, h = (kk % 4) / 2, e = kk % 2;
  return (tile * chunks + chunk) * 64 * mt + ((2 * j + h) * (mt / 8) + n / 8) * 64 + (n % 8) * 8 + 2 * t + e;
}

/* The inverse: the (token, k) that element `offset` holds (padding included). */
NVFP4_INLINE void nvfp4_x_source(int64_t offset, int64_t chunks, int mt, int64_t *token, int64_t *k) {
  int64_t block = offset / (64 * mt), inner = offset % (64 * mt);
  int q = (int)(inner % 8), n8 = (int)((inner / 64) % (mt / 8)), jh = (int)(inner / (8 * mt));
  int n = n8 * 8 + (int)((inner / 8) % 8);
  *token = (block / chunks) * mt + n;
  *k = (block % chunks) * 64 + 16 * (q / 2) + 4 * (jh / 2) + 2 * (jh % 2) + q % 2;
}

/* ---- FP8 activations for the wgmma kernel (opt-in) ------------------------------------- */

/*
 * With FP8 activations the wgmma kernel runs m64nNk32 on e4m3 operands: per warp, thread
 * 4g + t holds A registers a0 (row g, logical K 4t .. 4t + 3 of the step), a1 (row g + 8, the
 * same), a2 (row g, 16 + 4t ..) and a3 (row g + 8, 16 + 4t ..), four e4m3 bytes each, the
 * lowest first. The kernel builds them from the tile words as they are: k-step s (0..1) of a
 * 64-K chunk takes words 2s (a0, a1) and 2s + 1 (a2, a3), whose elements e = 0..3 are k = 16t
 * + 4j + e (word j). So logical column 16q + 4t + e of step s holds
 *
 *   k = 16t + 8s + 4q + e                                      (nvfp4_x8_k)
 *
 * and the activations are staged in that order, one byte each: per tile of mt tokens and
 * 64-K chunk one block of mt x 64 bytes, [s 2][q 2][token / 8][token % 8][4t + e], which is
 * the 16-bit layout's geometry in bytes: step s starts at byte 32 * s * mt, its two core
 * matrices along K (8 tokens x 16 bytes) are 16 * mt bytes apart and 8-token groups 128.
 * Each staged token row has a scale (its max |x| / 448).
 */

/* The k (in the chunk) of logical column `col` (0..31) of k-step s. */
NVFP4_INLINE int nvfp4_x8_k(int s, int col) {
  int q = col / 16, t = (col % 16) / 4, e = col % 4;
  return 16 * t + 8 * s + 4 * q + e;
}

/* Byte index of x[token][k] in the staged FP8 activations (tiles of mt tokens). */
NVFP4_INLINE int64_t nvfp4_x8_offset(int64_t token, int64_t k, int64_t chunks, int mt) {
  int64_t tile = token / mt, n = token % mt, chunk = k / 64;
  int kk = (int)(k % 64), t = kk / 16, s = (kk % 16) / 8, q = (kk % 8) / 4, e = kk % 4;
  return (tile * chunks + chunk) * 64 * mt + ((2 * s + q) * (mt / 8) + n / 8) * 128 + (n % 8) * 16 + 4 * t +
         e;
}

/* The inverse: the (token, k) that byte `offset` holds (padding included). */
NVFP4_INLINE void nvfp4_x8_source(int64_t offset, int64_t chunks, int mt, int64_t *token, int64_t *k) {
  int64_t block = offset / (64 * mt), inner = offset % (64 * mt);
  int sq = (int)(inner / (16 * mt)), n8 = (int)((inner / 128) % (mt / 8)),
      n = n8 * 8 + (int)((inner / 16) % 8);
  int col = 16 * (sq % 2) + (int)(inner % 16);
  *token = (block / chunks) * mt + n;
  *k = (block % chunks) * 64 + nvfp4_x8_k(sq / 2, col);
}

/* ---- MXFP4 weights on the wgmma kernel ------------------------------------------------- */

/*
 * MXFP4's wave-32 code units (plugins/gpu/mxfp4_layout.h) are fragment tiles too: lane 4g + t's
 * word j is k-step j's A fragment, its pairs in the bits nvfp4_pair_bf16 decodes, but with K in
 * another order inside the chunk: logical column 8h + 2t + e' of k-step j holds k = 32 (j / 2) + 8t
 * + 4 (j % 2) + 2h + e' (every k-step inside one 32-K scale block). The activations are staged
 * for it in the same geometry as for NVFP4 ([j 4][h 2][token / 8][token % 8][2t + e'], 16-bit),
 * only that order changes.
 */

/* Element index of x[token][k] in the activations staged for MXFP4 (tiles of mt tokens). */
NVFP4_INLINE int64_t mxfp4_wg_x_offset(int64_t token, int64_t k, int64_t chunks, int mt) {
  int64_t tile = token / mt, n = token % mt, chunk = k / 64;
  int kk = (int)(k % 64), j = 2 * (kk / 32) + (kk % 8) / 4, t = (kk % 32) / 8, h = (kk % 4) / 2, e = kk % 2;
  return (tile * chunks + chunk) * 64 * mt + ((2 * j + h) * (mt / 8) + n / 8) * 64 + (n % 8) * 8 + 2 * t + e;
}

/* The inverse: the (token, k) that element `offset` holds (padding included). */
NVFP4_INLINE void mxfp4_wg_x_source(int64_t offset, int64_t chunks, int mt, int64_t *token, int64_t *k) {
  int64_t block = offset / (64 * mt), inner = offset % (64 * mt);
  int q = (int)(inner % 8), n8 = (int)((inner / 64) % (mt / 8)), jh = (int)(inner / (8 * mt));
  int n = n8 * 8 + (int)((inner / 8) % 8), j = jh / 2, h = jh % 2;
  *token = (block / chunks) * mt + n;
  *k = (block % chunks) * 64 + 32 * (j / 2) + 8 * (q / 2) + 4 * (j % 2) + 2 * h + q % 2;
}

/*
 * An e8m0 scale byte e (0..254) as two bf16 factors (each duplicated into a bf16x2): a decoded pair
 * (code x 2^-126, nvfp4_pair_bf16) times the first, then the second, is code x 2^(e - 130) exactly,
 * from 2^-131 (the smallest code at e 0, a bf16 subnormal) to 6 x 2^124 (the largest at 254): each
 * factor 2^-2 .. 2^125 and each product a bf16 value. The GEMM multiplies its sums by 2^3.
 */
NVFP4_INLINE void mxfp4_wg_scale(unsigned e, uint32_t *first, uint32_t *second) {
  const int total = (int)e - 4, half = total >= 0 ? total / 2 : -((-total + 1) / 2); /* floor */
  const uint32_t a = (uint32_t)(half + 127) << 7, b = (uint32_t)(total - half + 127) << 7;
  *first = a | a << 16;
  *second = b | b << 16;
}


#endif
