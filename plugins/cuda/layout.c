/*
 * layout.c: the CPU twins of the cuda-nvfp4 PWAL transforms (layout.h holds
 * the index math both share). Each output byte is gathered from its source
 * through the inverse mapping, as the GPU kernels do, so padding comes out
 * zero. The backend runs these when configured with `pwal = host`; CI tests
 * them against an independent formula and round trips.
 */
#include "cuda_nvfp4.h"

#include <string.h>

#include "layout.h"

void nvfp4_stream_plan(int64_t m, int64_t n, int64_t k, int sms, const struct nvfp4_tuning *tune,
                       struct nvfp4_tuning *out) {
  const int rows = tune ? tune->rows : 0, unroll = tune ? tune->unroll : 0, split = tune ? tune->split_k : 0;
  const int64_t tiles = nvfp4_w_rows(n) / NVFP4_TILE_ROWS, chunks = nvfp4_w_chunks(k);
  const int64_t want = 3 * (int64_t)sms / 2;
  out->kernel = NVFP4_KERNEL_STREAM;
  out->multicast = 1;
  out->fp8 = 0;
  out->tile_m = m <= 8 ? 8 : 16;
  out->depth = tune && tune->depth == 3 ? 3 : 0;
  if (rows == 1 || rows == 2 || rows == 4)
    out->rows = rows;
  else
    out->rows = (tiles + 3) / 4 >= sms ? 4 : (tiles + 1) / 2 >= want ? 2 : 1;
  out->unroll = unroll == 4 || unroll == 8 ? unroll : 4;
  const int64_t blocks = (tiles + out->rows - 1) / out->rows;
  const int64_t runs = NVFP4_STREAM_WARPS / out->rows;
  if (split > 0)
    out->split_k = nvfp4_clamp(split, 1, NVFP4_MAX_SPLIT);
  else if (blocks >= sms)
    out->split_k = 1;
  else
    out->split_k = nvfp4_clamp((2 * (int64_t)sms + blocks - 1) / blocks, 1,
                               nvfp4_clamp(chunks / (runs * 2 * out->unroll), 1, NVFP4_MAX_SPLIT));
}

void nvfp4_wgmma_plan(int64_t m, int64_t n, int64_t k, int sms, const struct nvfp4_tuning *tune,
                      struct nvfp4_tuning *out) {
  const int tile_m = tune ? tune->tile_m : 0, rows = tune ? tune->rows : 0, split = tune ? tune->split_k : 0;
  const int64_t chunks = nvfp4_w_chunks(k);
  out->kernel = NVFP4_KERNEL_WGMMA;
  out->depth = out->unroll = 0;
  /* FP8 activations: one 64-row MMA tile per consumer warpgroup, token tiles of 32 to 256. */
  out->fp8 = tune && tune->fp8 && m >= NVFP4_FP8_MIN_M;
  out->rows = rows == 2 && !out->fp8 ? 2 : 1;
  const int64_t row_blocks = (n + 128 * out->rows - 1) / (128 * out->rows);
  if (tile_m == 8 || tile_m == 16 || tile_m == 32 || tile_m == 64 || tile_m == 128 || tile_m == 256) {
    out->tile_m = tile_m;
  } else if (out->fp8 && m >= NVFP4_FP8_TILE256_M) {
    out->tile_m = 256; /* half the passes over the weights, each decoding and rounding them to e4m3 */
  } else {
    out->tile_m = m <= 32 ? 32 : m <= 64 ? 64 : 128;
    /* Too few blocks even split in two: half the token tile (the weights are read twice,
     * at the same time, so mostly once from memory). */
    if (out->tile_m > 32 &&
        (m + out->tile_m - 1) / out->tile_m * row_blocks * NVFP4_WGMMA_SPLIT_AUTO < sms / 2)
      out->tile_m /= 2;
  }
  if (out->rows == 2 && out->tile_m > 128)
    out->tile_m = 128; /* 2 x 64 x 256 accumulators do not fit a thread's registers */
  if (out->fp8 && out->tile_m < 32)
    out->tile_m = 32;
  const int64_t blocks = (m + out->tile_m - 1) / out->tile_m * row_blocks;
  if (split > 0)
    out->split_k = nvfp4_clamp(split, 1, nvfp4_clamp(chunks, 1, NVFP4_MAX_SPLIT));
  else
    out->split_k = nvfp4_clamp(sms / (blocks > 0 ? blocks : 1), 1,
                               nvfp4_clamp(chunks / NVFP4_WGMMA_SPLIT_CHUNKS, 1, NVFP4_WGMMA_SPLIT_AUTO));
  const int mc = tune ? tune->multicast : 0;
  if (out->split_k > 1)
    out->multicast = 1;
  else if (mc == 1 || mc == 2 || mc == 4)
    out->multicast = mc;
  else
    out->multicast = 1;
}

void nvfp4_moe_plan(int64_t pairs, int64_t experts, int64_t n, int64_t k, int sms, bool wgmma,
                    const struct nvfp4_tuning *tune, struct nvfp4_tuning *out) {
  const int forced_kernel = tune ? tune->kernel : NVFP4_KERNEL_AUTO, tile_m = tune ? tune->tile_m : 0;
  const int64_t hit = pairs < experts ? pairs : experts;
  const int64_t per_expert = hit > 0 ? (pairs + hit - 1) / hit : 1;
  int kernel = forced_kernel;
  if (kernel == NVFP4_KERNEL_WGMMA && !wgmma)
    kernel = NVFP4_KERNEL_RING;
  if (kernel != NVFP4_KERNEL_STREAM && kernel != NVFP4_KERNEL_WGMMA && kernel != NVFP4_KERNEL_RING)
    kernel = per_expert <= NVFP4_MOE_STREAM_MAX ? NVFP4_KERNEL_STREAM
             : wgmma                            ? NVFP4_KERNEL_WGMMA
                                                : NVFP4_KERNEL_RING;
  int tm;
  if (kernel == NVFP4_KERNEL_STREAM)
    tm = tile_m == 8 || tile_m == 16 ? tile_m : per_expert <= 8 ? 8 : 16;
  else if (kernel == NVFP4_KERNEL_WGMMA)
    tm = tile_m == 8 || tile_m == 16 || tile_m == 32 || tile_m == 64 || tile_m == 128 || tile_m == 256
             ? tile_m
         : per_expert <= 16 ? 16
         : per_expert <= 32 ? 32
         : per_expert <= 64 ? 64
                            : 128;
  else
    tm = tile_m == 8 || tile_m == 16 || tile_m == 32 || tile_m == 64 ? tile_m
         : per_expert <= 8                                           ? 8
         : per_expert <= 16                                          ? 16
         : per_expert <= 32                                          ? 32
                                                                     : 64;
  /* Token tiles if every expert hit gets its share: at least one each. */
  const int64_t tiles = hit > (pairs + tm - 1) / tm ? hit : (pairs + tm - 1) / tm;
  struct nvfp4_tuning t = {0};
  if (tune)
    t = *tune;
  t.tile_m = tm;
  if (kernel == NVFP4_KERNEL_STREAM) {
    nvfp4_stream_plan(tm, tiles * nvfp4_w_rows(n), k, sms, &t, out);
  } else if (kernel == NVFP4_KERNEL_WGMMA) {
    if (!t.multicast)
      t.multicast = 1; /* routed: not measured yet */

    nvfp4_wgmma_plan(tiles * tm, n, k, sms, &t, out);
  } else {
    out->kernel = NVFP4_KERNEL_RING;
    out->multicast = 1;
    out->fp8 = 0;
    out->tile_m = tm;
    out->split_k = 0;
    out->depth = tune ? tune->depth : 0;
    out->rows = out->unroll = 0;
  }
}

/* Element k of a row of packed e2m1 codes (element 2i in the low nibble). */
static unsigned row_code(const uint8_t *row, int64_t k) {
  return (k & 1) ? row[k / 2] >> 4 : row[k / 2] & 0xfu;
}

void nvfp4_swizzle_scales(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
  int64_t cols_padded = nvfp4_sf_cols(cols), bytes = nvfp4_sf_bytes(rows, cols);
  for (int64_t off = 0; off < bytes; off++) {
    int64_t r, c;
    nvfp4_sf_source(off, cols_padded, &r, &c);
    dst[off] = r < rows && c < cols ? src[r * cols + c] : 0;
  }
}

void nvfp4_unswizzle_scales(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
  int64_t cols_padded = nvfp4_sf_cols(cols);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++)
      dst[r * cols + c] = src[nvfp4_sf_offset(r, c, cols_padded)];
}

void nvfp4_tile_weights(const uint8_t *src, int64_t rows, int64_t k, uint8_t *dst) {
  int64_t chunks = nvfp4_w_chunks(k), words = nvfp4_w_bytes(rows, k) / 4;
  for (int64_t w = 0; w < words; w++) {
    uint32_t word = 0;
    for (int slot = 0; slot < 8; slot++) {
      int64_t r, kk;
      nvfp4_w_source(w, slot, rows, chunks, &r, &kk);
      if (r < rows && kk < k)
        word = nvfp4_w_put(word, slot, row_code(src + r * (k / 2), kk));
    }
    memcpy(dst + 4 * w, &word, 4); /* little-endian, as the GPU reads it */
  }
}

void nvfp4_untile_weights(const uint8_t *src, int64_t rows, int64_t k, uint8_t *dst) {
  int64_t chunks = nvfp4_w_chunks(k);
  memset(dst, 0, (size_t)(rows * (k / 2)));
  for (int64_t r = 0; r < rows; r++)
    for (int64_t kk = 0; kk < k; kk++) {
      int slot;
      uint32_t word;
      memcpy(&word, src + 4 * nvfp4_w_position(r, kk, rows, chunks, &slot), 4);
      dst[r * (k / 2) + kk / 2] |= (uint8_t)(nvfp4_w_get(word, slot) << (4 * (kk & 1)));
    }
}
