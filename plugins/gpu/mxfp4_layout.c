/*
 * mxfp4_layout.c: the CPU transforms of the MXFP4 kernel layout
 * (mxfp4_layout.h), the host twins of the GPU transforms in mxfp4_kernel.h.
 * Each walks its destination once and reads the source element that lands
 * there, so the padding is written zero and the cost is linear in the bytes.
 */
#include "mxfp4.h"

#include <string.h>

void mxfp4_tile_codes(const uint8_t *src, int64_t rows, int64_t k, int wave, uint8_t *dst) {
  int64_t chunks = mxfp4_chunks(k), words = mxfp4_code_bytes(rows, k) / 4;
  for (int64_t w = 0; w < words; w++) {
    uint32_t word = 0;
    for (int slot = 0; slot < 8; slot++) {
      int64_t r, kk;
      mxfp4_w_source(w, slot, chunks, wave, &r, &kk);
      if (r < rows && kk < k)
        word = mxfp4_w_put(word, slot, wave, (src[r * (k / 2) + kk / 2] >> (4 * (kk % 2))) & 0xfu);
    }
    memcpy(dst + 4 * w, &word, 4); /* little-endian words, as the GPU reads them */
  }
}

void mxfp4_untile_codes(const uint8_t *src, int64_t rows, int64_t k, int wave, uint8_t *dst) {
  int64_t chunks = mxfp4_chunks(k);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t kk = 0; kk < k; kk += 2) {
      uint8_t byte = 0;
      for (int e = 0; e < 2; e++) {
        int slot;
        int64_t w = mxfp4_w_position(r, kk + e, chunks, wave, &slot);
        uint32_t word;
        memcpy(&word, src + 4 * w, 4);
        byte |= (uint8_t)(mxfp4_w_get(word, slot, wave) << (4 * e));
      }
      dst[r * (k / 2) + kk / 2] = byte;
    }
}

void mxfp4_tile_scales(const uint8_t *src, int64_t rows, int64_t k, int wave, uint8_t *dst) {
  int64_t chunks = mxfp4_chunks(k), bytes = mxfp4_scale_bytes(rows, k), blocks = k / MXFP4_BLOCK;
  for (int64_t o = 0; o < bytes; o++) {
    int64_t r, kb;
    mxfp4_s_source(o, chunks, wave, &r, &kb);
    dst[o] = r < rows && kb < blocks ? src[r * blocks + kb] : 0;
  }
}

void mxfp4_untile_scales(const uint8_t *src, int64_t rows, int64_t k, int wave, uint8_t *dst) {
  int64_t chunks = mxfp4_chunks(k), blocks = k / MXFP4_BLOCK;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t kb = 0; kb < blocks; kb++)
      dst[r * blocks + kb] = src[mxfp4_s_offset(r, kb, chunks, wave)];
}
