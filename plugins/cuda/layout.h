/*
 * layout.h: the kernel layouts of the cuda-nvfp4 backend, as index math that
 * the CPU transforms (layout.c, tested in CI by tests/check_cuda_layout.c)
 * and the GPU code (kernels.cu: PWAL transforms and the GEMM's loads) share:
 * one copy. Plain C; under nvcc every function is __host__ __device__.
 *
 * Block scales (e4m3, checkpoint [R, C] with C = K/16, row-major) use the
 * 128x4 swizzle of CUTLASS / cuBLAS / FlashInfer / vLLM (formats.md §2.5):
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
 * and K to Kp = round_up(K, 64) (zero codes), then for each 16-row tile
 * (outer) and 64-K chunk (inner) 512 bytes: 32 lanes x 16 bytes. Lane
 * l = 4g + t holds rows g and g + 8 of the tile at the 16 K of scale block
 * t of the chunk (k = 16t + 4j + e, j = 0..3, e = 0..3), as four 32-bit
 * words, word j for mma k-step j. Inside word j the nibble of (row g + 8h,
 * e) is {3, 7, 1, 5}[e] - h, so that nibbles (3, 7), (2, 6), (1, 5), (0, 4)
 * are the register pairs a0a1, a2a3, a4a5, a6a7 of the fragment, each
 * turned into a bf16x2 / f16x2 by nvfp4_fp4x2_biased below. When R % 16 == 0
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

#define NVFP4_BLOCK 16        /* K elements per e4m3 block scale */
#define NVFP4_SF_ROWS 128     /* rows of a swizzle atom */
#define NVFP4_SF_COLS 4       /* scale columns of a swizzle atom */
#define NVFP4_SF_ATOM 512     /* bytes of a swizzle atom */
#define NVFP4_TILE_ROWS 16    /* rows of a weight fragment tile */
#define NVFP4_CHUNK_K 64      /* K of a weight fragment tile (4 scale blocks) */
#define NVFP4_TILE_BYTES 512  /* bytes of one tile x chunk: 32 lanes x 16 bytes */

NVFP4_INLINE int64_t nvfp4_round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* ---- block scales: the 128x4 swizzle -------------------------------------------------- */

/* Padded rows and columns of the swizzled scales of an [rows, cols] scale matrix. */
NVFP4_INLINE int64_t nvfp4_sf_rows(int64_t rows) { return nvfp4_round_up(rows, NVFP4_SF_ROWS); }
NVFP4_INLINE int64_t nvfp4_sf_cols(int64_t cols) { return nvfp4_round_up(cols, NVFP4_SF_COLS); }
/* Bytes of the swizzled scales (one expert). */
NVFP4_INLINE int64_t nvfp4_sf_bytes(int64_t rows, int64_t cols) { return nvfp4_sf_rows(rows) * nvfp4_sf_cols(cols); }

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

/* The nibble (0..7) of word j that holds element e (0..3) of row g + 8 * high. */
NVFP4_INLINE int nvfp4_w_nibble(int e, int high) { return ((e & 1) ? 7 : 3) - ((e & 2) ? 2 : 0) - high; }

/* Where code (r, k) lives in the tiled layout of a matrix with `chunks` K chunks:
 * byte offset, and *high = 1 for the high nibble of that byte. */
NVFP4_INLINE int64_t nvfp4_w_position(int64_t r, int64_t k, int64_t chunks, int *high) {
  int64_t tile = r / 16, chunk = k / 64;
  int g = (int)(r % 8), h = (int)((r % 16) / 8);
  int kk = (int)(k % 64), t = kk / 16, j = (kk % 16) / 4, e = kk % 4;
  int nib = nvfp4_w_nibble(e, h);
  *high = nib & 1;
  return ((tile * chunks + chunk) * 32 + 4 * g + t) * 16 + 4 * j + nib / 2;
}

/* The inverse: the code (r, k) that nibble `high` of byte `offset` holds (padding
 * included: r may be >= rows, k >= K). */
NVFP4_INLINE void nvfp4_w_source(int64_t offset, int high, int64_t chunks, int64_t *r, int64_t *k) {
  int nib = (int)(offset % 4) * 2 + high;
  int j = (int)((offset / 4) % 4), lane = (int)((offset / 16) % 32);
  int64_t tile_chunk = offset / 512;
  int h = !(nib & 1);
  int e = (nib >> 1) == 0 ? 2 : (nib >> 1) == 1 ? 0 : (nib >> 1) == 2 ? 3 : 1;
  *r = (tile_chunk / chunks) * 16 + lane / 4 + 8 * h;
  *k = (tile_chunk % chunks) * 64 + 16 * (lane % 4) + 4 * j + e;
}

/*
 * Two e2m1 codes, at bits 15:12 and 31:28 of q, as the bit patterns of two 16-bit
 * floats (low half from bits 15:12): the sign bit moved to bit 15 / 31, the three
 * magnitude bits to the low exponent bits and the top mantissa bit. shift 6 gives
 * bf16 values code * 2^-126, shift 3 gives f16 values code * 2^-14, exactly (the
 * code 0.5 lands on the smallest subnormal of the right exponent). The GEMM
 * multiplies the pair by its block scale times the inverse power of two.
 */
NVFP4_INLINE uint32_t nvfp4_fp4x2_biased(uint32_t q, int shift) {
  return (q & 0x80008000u) | ((q >> shift) & (0x70007000u >> shift));
}
#define NVFP4_SHIFT_BF16 6
#define NVFP4_SHIFT_F16 3

#endif
