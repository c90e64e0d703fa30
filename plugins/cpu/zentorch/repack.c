/*
 * repack.c: the cpu-zentorch layout transforms PWAL runs (zentorch.h describes the
 * layouts). Pure functions of their inputs: a reload repacks byte for byte what a cold
 * start does. tests/check_zentorch.c links this file to check them against its own
 * reading of the checkpoint formats.
 */
#include <string.h>

#include "zentorch.h"

static inline uint32_t nibble(uint32_t word, int j) { return (word >> (4 * j)) & 0xfu; }

/* The u4 code of row `row`, column `col` of a checkpoint qweight. */
static inline uint32_t code_at(enum zt_source src, const int32_t *in, int64_t n, int64_t k, int64_t row,
                               int64_t col) {
  if (src == ZT_CT)
    return nibble((uint32_t)in[col * (k / 8) + row / 8], (int)(row % 8));
  if (src == ZT_AWQ)
    return nibble((uint32_t)in[row * (n / 8) + col / 8], qkeep_awq_nibble((int)(col % 8)));
  return nibble((uint32_t)in[(row / 8) * n + col], (int)(row % 8));
}

void zt_repack_codes(enum zt_source src, const int32_t *in, int64_t n, int64_t k, const int32_t *perm,
                     bool s4, int32_t *out) {
  uint32_t flip = s4 ? 0x88888888u : 0;
  if (src == ZT_GPTQ && !perm) {
    for (int64_t i = 0; i < k / 8 * n; i++)
      out[i] = (int32_t)((uint32_t)in[i] ^ flip);
    return;
  }
  if (src == ZT_CT && !perm) { /* a word transpose */
    for (int64_t col = 0; col < n; col++)
      for (int64_t kw = 0; kw < k / 8; kw++)
        out[kw * n + col] = (int32_t)((uint32_t)in[col * (k / 8) + kw] ^ flip);
    return;
  }
  for (int64_t kw = 0; kw < k / 8; kw++)
    for (int64_t col = 0; col < n; col++) {
      uint32_t word = 0;
      for (int j = 0; j < 8; j++) {
        int64_t row = perm ? perm[kw * 8 + j] : kw * 8 + j;
        word |= code_at(src, in, n, k, row, col) << (4 * j);
      }
      out[kw * n + col] = (int32_t)(word ^ flip);
    }
}

int64_t zt_blocked_index(int64_t n, int64_t k, int64_t kw, int64_t col) {
  int64_t b = col / ZT_BLOCK_N, c = col % ZT_BLOCK_N;
  int64_t width = n - b * ZT_BLOCK_N < ZT_BLOCK_N ? n - b * ZT_BLOCK_N : ZT_BLOCK_N;
  return b * ZT_BLOCK_N * (k / 8) + kw * width + c;
}

void zt_block_codes(const int32_t *plain, int64_t n, int64_t k, int32_t *blocked) {
  for (int64_t b0 = 0; b0 < n; b0 += ZT_BLOCK_N) {
    int64_t width = n - b0 < ZT_BLOCK_N ? n - b0 : ZT_BLOCK_N;
    int32_t *dst = blocked + b0 * (k / 8);
    for (int64_t kw = 0; kw < k / 8; kw++)
      memcpy(dst + kw * width, plain + kw * n + b0, (size_t)width * sizeof *plain);
  }
}

void zt_repack_zeros(enum zt_source src, bool gptq_v2, int32_t *zeros, int64_t n, int64_t groups) {
  for (int64_t i = 0; i < groups * (n / 8); i++) {
    uint32_t in = (uint32_t)zeros[i], out = 0;
    for (int c = 0; c < 8; c++) {
      uint32_t z = src == ZT_AWQ ? nibble(in, qkeep_awq_nibble(c))
                   : gptq_v2     ? nibble(in, c)
                                 : (nibble(in, c) + 1) & 0xfu;
      out |= z << (4 * c);
    }
    zeros[i] = (int32_t)out;
  }
}

void zt_repack_ct_zeros(const int32_t *in, int64_t n, int64_t groups, int32_t *out) {
  for (int64_t w = 0; w < n / 8; w++)
    for (int64_t g = 0; g < groups; g++)
      out[g * (n / 8) + w] = in[w * groups + g];
}

int zt_act_order_perm(const int32_t *g_idx, int64_t k, int64_t groups, int32_t *perm, int64_t *bad) {
  for (int64_t i = 0; i < k; i++)
    if (g_idx[i] < 0 || g_idx[i] >= groups) {
      *bad = i;
      return -1;
    }
  /* Group by group, rows in order: stable, and O(K groups), which PWAL can afford. */
  int64_t filled = 0;
  for (int64_t g = 0; g < groups; g++) {
    int64_t start = filled;
    for (int64_t i = 0; i < k; i++)
      if (g_idx[i] == g)
        perm[filled++] = (int32_t)i;
    if (filled - start != k / groups) {
      *bad = g;
      return -1;
    }
  }
  return 0;
}
