/*
 * act.c: what apply computes from the activations before a GEMM (zentorch.h): the
 * da8w4 per-token int8 quantisation with its group sums, and the w4a16 group sums. Plain C, vectorised by the
 * compiler where it can; the results must not depend on the instruction set, so no fused multiply-add is
 * allowed to form here (the file is built with -ffp-contract=off).
 */
#include <math.h>

#include "zentorch.h"

void zt_quantise_row(const float *x, int64_t k, int64_t groups, int32_t *xq, int32_t *xsum, float *a) {
  float amax = 0.0f;
  for (int64_t i = 0; i < k; i++)
    amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
  float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  *a = amax / 127.0f;
  int64_t per_group = k / groups;
  for (int64_t g = 0; g < groups; g++)
    xsum[g] = 0;
  for (int64_t kw = 0; kw < k / 8; kw++) {
    uint32_t even = 0, odd = 0;
    int32_t sum = 0;
    for (int j = 0; j < 8; j++) {
      float r = rintf(x[kw * 8 + j] * inv);
      int32_t q = r > 127.0f ? 127 : r < -127.0f ? -127 : (int32_t)r;
      sum += q;
      uint32_t byte = (uint32_t)(uint8_t)(int8_t)q;
      if (j % 2)
        odd |= byte << (8 * (j / 2));
      else
        even |= byte << (8 * (j / 2));
    }
    xq[2 * kw] = (int32_t)even;
    xq[2 * kw + 1] = (int32_t)odd;
    xsum[kw * 8 / per_group] += sum;
  }
}

void zt_group_sums(const float *x, int64_t k, int64_t groups, float *xsum) {
  int64_t per_group = k / groups;
  for (int64_t g = 0; g < groups; g++) {
    float s = 0.0f;
    for (int64_t i = 0; i < per_group; i++)
      s += x[g * per_group + i];
    xsum[g] = s;
  }
}
