/*
 * check_fp4_quant.c: the arithmetic of cuda-nvfp4's quantize kernels (plugins/cuda/fp4_quant.h, compiled
 * here as C) against the core's host quantizer (libqkeep/quantize/quantize.c), on any machine. The
 * GPU runs the same source with __fdiv_rn, __fmul_rn and __float2int_rn for the operations C does in
 * float32 (tests/check_gpu_online.c compares the GPU's bytes themselves):
 *
 *   - the scalar steps: e4m3 bytes of every e4m3 value, its midpoints and random floats up to 448;
 *     e8m0 bytes of random amaxes, subnormal ones included; e2m1 codes of random quotients;
 *   - whole matrices of BF16 and F16 weights, block by block, in ModelOpt's and compressed-tensors'
 *     NVFP4 and in MXFP4: blocks of random magnitudes, of the dtype's whole exponent range, of zeros
 *     and subnormals, and of values near 1 where ties are common.
 */
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "fp4_quant.h"
#include "private.h"
#include "testutil.h"

START_TEST(scale_bytes_and_codes_step_by_step_equal_the_host_quantizers) {
  for (int b = 0; b < 0x7f; b++) { /* every finite non-negative e4m3 value, and the midpoint above it */
    float v = quant_e4m3_value((uint8_t)b), next = quant_e4m3_value((uint8_t)(b + 1));
    ck_assert_uint_eq(fp4q_e4m3_code(v), qk_e4m3_encode(v));
    if (b + 1 < 0x7f) {
      float mid = (v + next) / 2; /* exact: both share an exponent or the quantum doubles */
      ck_assert_msg(fp4q_e4m3_code(mid) == qk_e4m3_encode(mid), "e4m3 of %a: 0x%02x, the host 0x%02x",
                    (double)mid, fp4q_e4m3_code(mid), qk_e4m3_encode(mid));
    }
    ck_assert(fp4q_e4m3_value((uint8_t)b) == v);
  }
  uint64_t s = 7;
  /* (ck_abort_msg only on a difference: in a forked suite every assertion is written out) */
  for (int i = 0; i < 300000; i++) {
    uint32_t bits = (uint32_t)tu_rand(&s) % 0x43e00001u; /* [0, 448] */
    float a;
    memcpy(&a, &bits, sizeof a);
    if (fp4q_e4m3_code(a) != qk_e4m3_encode(a))
      ck_abort_msg("e4m3 of %a: 0x%02x, the host 0x%02x", (double)a, fp4q_e4m3_code(a), qk_e4m3_encode(a));
    uint32_t any = (uint32_t)tu_rand(&s) & 0x7f7fffffu; /* finite, non-negative, subnormals too */
    memcpy(&a, &any, sizeof a);
    if (fp4q_e8m0(a) != qk_e8m0_from_amax(a))
      ck_abort_msg("e8m0 of %a: 0x%02x, the host 0x%02x", (double)a, fp4q_e8m0(a), qk_e8m0_from_amax(a));
    float x = tu_randf(&s) * 8.0f, d = (float)(1 + tu_rand(&s) % 8) * 0.5f;
    if (fp4q_e2m1(x, d) != qk_e2m1_encode(x / d))
      ck_abort_msg("e2m1 of %a / %a: %u, the host %u", (double)x, (double)d, fp4q_e2m1(x, d),
                   qk_e2m1_encode(x / d));
  }
}
END_TEST

/* Random bits of one dtype (BF16 or F16) for an [n, k] matrix, per 32-block of one kind. */
static void random_matrix(uint16_t *raw, float *w, int64_t count, bool bf16, uint64_t *s) {
  int bias = bf16 ? 127 : 15, emax = bf16 ? 254 : 30, man_bits = bf16 ? 7 : 10;
  for (int64_t b = 0; b < count / 32; b++) {
    int kind = (int)(tu_rand(s) % 5);
    for (int j = 0; j < 32; j++) {
      uint32_t sign = (uint32_t)(tu_rand(s) & 1), man = (uint32_t)tu_rand(s) & ((1u << man_bits) - 1);
      int e;
      switch (kind) {
      case 0: e = bias - 8 + (int)(tu_rand(s) % 16); break;      /* random magnitudes */
      case 1: e = 1 + (int)(tu_rand(s) % (uint64_t)emax); break; /* the whole range */
      case 2: e = 0, man = j % 3 ? 0 : man; break;               /* zeros and subnormals */
      case 3:
        e = bias + (int)(tu_rand(s) % 3), man &= ~((1u << (man_bits - 2)) - 1);
        break;                                                                          /* near 1: ties */
      default: e = tu_rand(s) % 4 ? 0 : (bf16 ? bias - 20 : 1) + (int)(tu_rand(s) % 8); /* tiny */
      }
      uint16_t h = (uint16_t)(sign << 15 | (uint32_t)e << man_bits | man);
      raw[32 * b + j] = h;
      w[32 * b + j] = bf16 ? qkeep_bf16_to_f32(h) : qkeep_f16_to_f32(h);
    }
  }
}

START_TEST(whole_matrices_block_by_block_equal_the_host_quantizers) {
  enum { N = 64, K = 512 };
  static uint16_t raw[N * K];
  static float w[N * K];
  static uint8_t host_codes[N * K / 2], host_scales[N * K / 16], codes[N * K / 2], scales[N * K / 16];
  uint64_t s = 11;
  int compared = 0;
  for (int iter = 0; iter < 300; iter++) {
    bool bf16 = iter % 2 == 0;
    random_matrix(raw, w, N * K, bf16, &s);
    float amax;
    ck_assert_int_eq(quant_check_rows(w, 0, N, K, &amax), 0);
    for (int scheme = 0; scheme < 3; scheme++) {
      bool mx = scheme == 2, ct = scheme == 1;
      int block = mx ? 32 : 16;
      float global;
      if (!mx && (amax == 0.0f || quant_nvfp4_global(amax, ct, &global) != 0))
        continue; /* the slot refuses or zero-fills these before any block runs */
      if (mx)
        quant_mxfp4_rows(w, N, K, host_codes, host_scales);
      else
        quant_nvfp4_rows(w, N, K, ct, amax, host_codes, host_scales);
      float ws2 = amax / 2688.0f, ct_global = 2688.0f / amax; /* as quantize.cu's launcher divides */
      for (int64_t b = 0; b < (int64_t)N * K / block; b++) {
        uint32_t word[4];
        scales[b] =
            mx ? fp4q_mxfp4_block(w + 32 * b, word) : fp4q_nvfp4_block(w + 16 * b, ct, ws2, ct_global, word);
        for (int i = 0; i < block / 2; i++)
          codes[b * block / 2 + i] = (uint8_t)(word[i / 4] >> (8 * (i % 4)));
      }
      static const char *const names[] = {"ModelOpt NVFP4", "compressed-tensors NVFP4", "MXFP4"};
      for (int64_t i = 0; i < (int64_t)N * K / block; i++)
        if (scales[i] != host_scales[i])
          ck_abort_msg("%s, %s matrix %d: block %lld's scale 0x%02x, the host's 0x%02x", names[scheme],
                       bf16 ? "BF16" : "F16", iter, (long long)i, scales[i], host_scales[i]);
      for (int64_t i = 0; i < (int64_t)N * K / 2; i++)
        if (codes[i] != host_codes[i])
          ck_abort_msg("%s, %s matrix %d: code byte %lld (elements %lld, %lld) 0x%02x, the host's 0x%02x",
                       names[scheme], bf16 ? "BF16" : "F16", iter, (long long)i, (long long)(2 * i),
                       (long long)(2 * i + 1), codes[i], host_codes[i]);
      compared++;
    }
  }
  ck_assert_int_gt(compared, 700);
}
END_TEST

int main(void) {
  Suite *su = suite_create("fp4_quant");
  TCase *tc = tcase_create("fp4_quant");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, scale_bytes_and_codes_step_by_step_equal_the_host_quantizers);
  tcase_add_test(tc, whole_matrices_block_by_block_equal_the_host_quantizers);
  suite_add_tcase(su, tc);
  return tu_run_suite(su, CK_NORMAL);
}
