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
  int64_t chunks = nvfp4_w_chunks(k), bytes = nvfp4_w_bytes(rows, k);
  for (int64_t off = 0; off < bytes; off++) {
    uint8_t out = 0;
    for (int high = 0; high < 2; high++) {
      int64_t r, kk;
      nvfp4_w_source(off, high, chunks, &r, &kk);
      if (r < rows && kk < k) {
        uint8_t b = src[r * (k / 2) + kk / 2];
        uint8_t code = (kk & 1) ? (uint8_t)(b >> 4) : (uint8_t)(b & 0xf);
        out |= (uint8_t)(code << (4 * high));
      }
    }
    dst[off] = out;
  }
}

void nvfp4_untile_weights(const uint8_t *src, int64_t rows, int64_t k, uint8_t *dst) {
  int64_t chunks = nvfp4_w_chunks(k);
  memset(dst, 0, (size_t)(rows * (k / 2)));
  for (int64_t r = 0; r < rows; r++)
    for (int64_t kk = 0; kk < k; kk++) {
      int high;
      int64_t off = nvfp4_w_position(r, kk, chunks, &high);
      uint8_t code = (uint8_t)((src[off] >> (4 * high)) & 0xf);
      dst[r * (k / 2) + kk / 2] |= (uint8_t)(code << (4 * (kk & 1)));
    }
}
