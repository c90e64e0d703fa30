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
      nvfp4_w_source(w, slot, chunks, &r, &kk);
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
      memcpy(&word, src + 4 * nvfp4_w_position(r, kk, chunks, &slot), 4);
      dst[r * (k / 2) + kk / 2] |= (uint8_t)(nvfp4_w_get(word, slot) << (4 * (kk & 1)));
    }
}
