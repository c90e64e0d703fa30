/*
 * check_formats.c: the element and scale codecs (formats.h, quantize.c) and
 * the checkpoint quantizers of quant.h. Expected bytes are worked out by hand
 * from docs/FORMATS.md and the exporters' recipes in the comments next to them, never
 * taken from the code under test; the random round trips check error bounds
 * derived from each recipe.
 */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "private.h"
#include "qkeep/qkeep.h"
#include "testutil.h"

/* Half the distance to the neighbouring e2m1 values, by magnitude index 0..7
 * (0, 0.5, 1, 1.5, 2, 3, 4, 6): the largest rounding error a code can carry
 * while its input lies inside [-6, 6]. */
static const float e2m1_half_gap[8] = {0.25f, 0.25f, 0.25f, 0.25f, 0.5f, 0.5f, 1.0f, 1.0f};

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  ck_assert_ptr_nonnull(p);
  return p;
}

/* ---- e2m1 ---------------------------------------------------------------------------- */

START_TEST(test_e2m1_decode_table) {
  static const float expect[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int c = 0; c < 16; c++) {
    ck_assert_float_eq(qk_e2m1_decode((uint8_t)c), expect[c]);
    ck_assert_int_eq(signbit(qk_e2m1_decode((uint8_t)c)) != 0, c >= 8);
    /* Only the low nibble counts. */
    ck_assert_float_eq(qk_e2m1_decode((uint8_t)(0xf0 | c)), expect[c]);
  }
}
END_TEST

START_TEST(test_e2m1_encode_ties) {
  /* §1.2: ties 0.25, 1.25, 2.5, 5.0 go down; 0.75, 1.75, 3.5 go up (mantissa bit 0). */
  static const struct {
    float x;
    uint8_t below, at, above;
  } ties[] = {
      {0.25f, 0x0, 0x0, 0x1}, /* 0 | 0.5 */
      {0.75f, 0x1, 0x2, 0x2}, /* 0.5 | 1 */
      {1.25f, 0x2, 0x2, 0x3}, /* 1 | 1.5 */
      {1.75f, 0x3, 0x4, 0x4}, /* 1.5 | 2 */
      {2.5f, 0x4, 0x4, 0x5},  /* 2 | 3 */
      {3.5f, 0x5, 0x6, 0x6},  /* 3 | 4 */
      {5.0f, 0x6, 0x6, 0x7},  /* 4 | 6 */
  };
  for (size_t i = 0; i < sizeof ties / sizeof ties[0]; i++) {
    float x = ties[i].x;
    ck_assert_uint_eq(qk_e2m1_encode(nextafterf(x, 0.0f)), ties[i].below);
    ck_assert_uint_eq(qk_e2m1_encode(x), ties[i].at);
    ck_assert_uint_eq(qk_e2m1_encode(nextafterf(x, 10.0f)), ties[i].above);
    ck_assert_uint_eq(qk_e2m1_encode(-nextafterf(x, 0.0f)), ties[i].below | 0x8);
    ck_assert_uint_eq(qk_e2m1_encode(-x), ties[i].at | 0x8);
    ck_assert_uint_eq(qk_e2m1_encode(-nextafterf(x, 10.0f)), ties[i].above | 0x8);
  }
}
END_TEST

START_TEST(test_e2m1_sign_and_saturation) {
  /* §9: the sign bit is set iff x < 0. */
  ck_assert_uint_eq(qk_e2m1_encode(0.0f), 0x0);
  ck_assert_uint_eq(qk_e2m1_encode(-0.0f), 0x0);
  ck_assert_uint_eq(qk_e2m1_encode(-0.1f), 0x8);
  ck_assert_uint_eq(qk_e2m1_encode(-FLT_TRUE_MIN), 0x8);
  ck_assert_uint_eq(qk_e2m1_encode(-0.25f), 0x8);
  ck_assert_uint_eq(qk_e2m1_encode(-0.3f), 0x9);
  ck_assert_uint_eq(qk_e2m1_encode(6.0f), 0x7);
  ck_assert_uint_eq(qk_e2m1_encode(6.5f), 0x7);
  ck_assert_uint_eq(qk_e2m1_encode(1e30f), 0x7);
  ck_assert_uint_eq(qk_e2m1_encode(FLT_MAX), 0x7);
  ck_assert_uint_eq(qk_e2m1_encode(-100.0f), 0xf);
  ck_assert_uint_eq(qk_e2m1_encode(INFINITY), 0x7);
  ck_assert_uint_eq(qk_e2m1_encode(-INFINITY), 0xf);
  /* Every value encodes back to its code, except -0.0 (0x8), which is not < 0. */
  for (int c = 0; c < 16; c++)
    ck_assert_uint_eq(qk_e2m1_encode(qk_e2m1_decode((uint8_t)c)), c == 8 ? 0 : c);
}
END_TEST

START_TEST(test_fp4_nibble_order) {
  /* One MXFP4 row of 32 whose block amax is 6 (scale byte 127, X = 1), holding the
   * e2m1 value of code j % 16 at position j. §1.3: element 2i low, 2i+1 high, so
   * byte i = code(2i) | code(2i+1) << 4. Code 8 (-0.0) encodes as 0x0. */
  float w[32];
  for (int j = 0; j < 32; j++)
    w[j] = qk_e2m1_decode((uint8_t)(j % 16));
  static const uint8_t expect[16] = {0x10, 0x32, 0x54, 0x76, 0x90, 0xba, 0xdc, 0xfe,
                                     0x10, 0x32, 0x54, 0x76, 0x90, 0xba, 0xdc, 0xfe};
  uint8_t packed[16], scale;
  ck_assert_int_eq(quant_mxfp4(w, 1, 32, packed, &scale), 0);
  ck_assert_uint_eq(scale, 0x7f);
  ck_assert_mem_eq(packed, expect, 16);
  for (int j = 0; j < 32; j++)
    ck_assert_uint_eq(qk_fp4_code(packed, j), (j % 16) == 8 ? 0 : j % 16);
}
END_TEST

/* ---- e4m3 ---------------------------------------------------------------------------- */

START_TEST(test_e4m3_points) {
  /* byte = s eeee mmm, bias 7; subnormal value m * 2^-9. */
  ck_assert_uint_eq(qk_e4m3_encode(0.0f), 0x00);
  ck_assert_uint_eq(qk_e4m3_encode(0x1p-9f), 0x01);     /* smallest subnormal */
  ck_assert_uint_eq(qk_e4m3_encode(7 * 0x1p-9f), 0x07); /* largest subnormal */
  ck_assert_uint_eq(qk_e4m3_encode(0x1p-6f), 0x08);     /* smallest normal: e = 1, m = 0 */
  ck_assert_uint_eq(qk_e4m3_encode(1.0f), 0x38);        /* e = 7 */
  ck_assert_uint_eq(qk_e4m3_encode(-1.0f), 0xb8);
  ck_assert_uint_eq(qk_e4m3_encode(0.125f), 0x20);        /* e = 4 */
  ck_assert_uint_eq(qk_e4m3_encode(1.75f * 64.0f), 0x6e); /* 112: e = 13, m = 6 */
  ck_assert_uint_eq(qk_e4m3_encode(448.0f), 0x7e);        /* 1.75 * 2^8: e = 15, m = 6 */
  ck_assert_uint_eq(qk_e4m3_encode(-448.0f), 0xfe);
  ck_assert_uint_eq(qk_e4m3_encode(464.0f), 0x7e); /* a cast would give NaN from here; §9 saturates */
  ck_assert_uint_eq(qk_e4m3_encode(500.0f), 0x7e);
  ck_assert_uint_eq(qk_e4m3_encode(-1e30f), 0xfe);
  ck_assert_uint_eq(qk_e4m3_encode(FLT_MAX), 0x7e);
  ck_assert_uint_eq(qk_e4m3_encode(-0.0f), 0x80);
  ck_assert_float_eq(qk_e4m3_decode(0x01), 0x1p-9f);
  ck_assert_float_eq(qk_e4m3_decode(0x07), 7 * 0x1p-9f);
  ck_assert_float_eq(qk_e4m3_decode(0x08), 0x1p-6f);
  ck_assert_float_eq(qk_e4m3_decode(0x38), 1.0f);
  ck_assert_float_eq(qk_e4m3_decode(0x7e), 448.0f);
  ck_assert_float_eq(qk_e4m3_decode(0xfe), -448.0f);
  ck_assert(isnan(qk_e4m3_decode(0x7f)));
  ck_assert(isnan(qk_e4m3_decode(0xff)));
}
END_TEST

START_TEST(test_e4m3_ties_to_even) {
  /* Halfway points go to the even mantissa; a hair either side goes to the nearer. */
  static const struct {
    float x;
    uint8_t below, at, above;
  } ties[] = {
      {0x1p-10f, 0x00, 0x00, 0x01},      /* 0 | 2^-9 */
      {3 * 0x1p-10f, 0x01, 0x02, 0x02},  /* 2^-9 | 2^-8 */
      {15 * 0x1p-10f, 0x07, 0x08, 0x08}, /* largest subnormal | smallest normal */
      {1.0625f, 0x38, 0x38, 0x39},       /* 1 | 1.125 */
      {1.1875f, 0x39, 0x3a, 0x3a},       /* 1.125 | 1.25 */
      {1.9375f, 0x3f, 0x40, 0x40},       /* 1.875 | 2: carries into the exponent */
      {232.0f, 0x76, 0x76, 0x77},        /* 224 | 240 */
      {248.0f, 0x77, 0x78, 0x78},        /* 240 | 256 */
      {432.0f, 0x7d, 0x7e, 0x7e},        /* 416 | 448 */
  };
  for (size_t i = 0; i < sizeof ties / sizeof ties[0]; i++) {
    float x = ties[i].x;
    ck_assert_uint_eq(qk_e4m3_encode(nextafterf(x, 0.0f)), ties[i].below);
    ck_assert_uint_eq(qk_e4m3_encode(x), ties[i].at);
    ck_assert_uint_eq(qk_e4m3_encode(nextafterf(x, 1000.0f)), ties[i].above);
    ck_assert_uint_eq(qk_e4m3_encode(-x), ties[i].at | 0x80);
  }
  /* Below half the smallest subnormal: zero (with the sign). */
  ck_assert_uint_eq(qk_e4m3_encode(0x1p-11f), 0x00);
  ck_assert_uint_eq(qk_e4m3_encode(-0x1p-11f), 0x80);
}
END_TEST

START_TEST(test_e4m3_round_trip) {
  int finite = 0;
  for (int b = 0; b < 256; b++) {
    float v = qk_e4m3_decode((uint8_t)b);
    if (isnan(v)) {
      ck_assert(b == 0x7f || b == 0xff);
      continue;
    }
    finite++;
    ck_assert_msg(qk_e4m3_encode(v) == b, "byte 0x%02x (%g) encodes to 0x%02x", b, (double)v,
                  qk_e4m3_encode(v));
  }
  ck_assert_int_eq(finite, 254);
}
END_TEST

/* ---- e8m0 ---------------------------------------------------------------------------- */

START_TEST(test_e8m0) {
  ck_assert_float_eq(qk_e8m0_decode(0x7f), 1.0f);
  ck_assert_float_eq(qk_e8m0_decode(0x00), 0x1p-127f);
  ck_assert_float_eq(qk_e8m0_decode(0xfe), 0x1p127f);
  ck_assert(isnan(qk_e8m0_decode(0xff)));
  /* byte = floor(log2(amax)) - 2 + 127, clamped to [0, 254]. */
  ck_assert_uint_eq(qk_e8m0_from_amax(1.0f), 125);
  ck_assert_uint_eq(qk_e8m0_from_amax(6.0f), 127);
  ck_assert_uint_eq(qk_e8m0_from_amax(7.5f), 127); /* scale 1: 7.5 will store 6 */
  ck_assert_uint_eq(qk_e8m0_from_amax(nextafterf(8.0f, 0.0f)), 127);
  ck_assert_uint_eq(qk_e8m0_from_amax(8.0f), 128);
  ck_assert_uint_eq(qk_e8m0_from_amax(0.3f), 123); /* floor(log2 0.3) = -2 */
  ck_assert_uint_eq(qk_e8m0_from_amax(0.0f), 0);   /* FP32_MIN_NORMAL: -126 - 2 -> -127 */
  ck_assert_uint_eq(qk_e8m0_from_amax(0x1p-124f), 1);
  ck_assert_uint_eq(qk_e8m0_from_amax(0x1p-125f), 0);
  ck_assert_uint_eq(qk_e8m0_from_amax(FLT_MIN), 0);
  ck_assert_uint_eq(qk_e8m0_from_amax(FLT_TRUE_MIN), 0); /* subnormal */
  ck_assert_uint_eq(qk_e8m0_from_amax(0x1p127f), 252);
  /* The largest finite amax gives 125 + 127: the +127 clamp cannot be reached by a finite f32. */
  ck_assert_uint_eq(qk_e8m0_from_amax(FLT_MAX), 252);
  /* Every power of two and its predecessor, against frexpf. */
  for (int e = -149; e <= 127; e++) {
    float a = ldexpf(1.0f, e);
    int expect = e - 2 < -127 ? 0 : e - 2 + 127;
    ck_assert_uint_eq(qk_e8m0_from_amax(a), expect);
    float below = nextafterf(a, 0.0f);
    if (below > 0.0f) {
      int fe;
      frexpf(below, &fe);
      int shared = fe - 1 - 2;
      ck_assert_uint_eq(qk_e8m0_from_amax(below), shared < -127 ? 0 : shared + 127);
    }
  }
}
END_TEST

/* ---- NVFP4 --------------------------------------------------------------------------- */

/* Two 16-blocks of one row with amax 2688, so weight_scale_2 = 2688/2688 = 1 exactly
 * (and ct's global 2688/2688 = 1): every step below is exact.
 *   block 0: amax_b = 2688 -> s_b = 2688 / 6 = 448 -> 0x7e; x = W / 448.
 *   block 1: amax_b = 100 -> s_b = 16.67 -> e4m3 quantum 2 in [16, 32): 16 -> 0x58
 *            (e = 4 + 7 = 11, m = 0); x = W / 16. */
static const float hand_w[32] = {
    /* block 0, W = 448 x: x = */
    0.0f, 224.0f, -448.0f, 672.0f,      /* 0, .5, -1, 1.5 */
    896.0f, 1344.0f, 1792.0f, 2688.0f,  /* 2, 3, 4, 6 */
    -134.4f, 89.6f, 1120.0f, 1568.0f,   /* -.3, .2, 2.5 (tie down), 3.5 (tie up) */
    2284.8f, -336.0f, 784.0f, -2688.0f, /* 5.1, -.75 (tie up), 1.75 (tie up), -6 */
    /* block 1, x = W / 16 */
    100.0f, -100.0f, 40.0f, 56.0f, /* 6.25 (sat), -6.25, 2.5, 3.5 */
    8.0f, 4.0f, -4.0f, 24.0f,      /* .5, .25 (tie down to 0), -.25 (-> 0x8), 1.5 */
    28.0f, 20.0f, 12.0f, 80.0f,    /* 1.75, 1.25, .75, 5 (tie down) */
    81.0f, 0.0f, -0.0f, 64.0f,     /* 5.06, 0, -0 (-> 0x0), 4 */
};
/* codes: block 0: 0 1 A 3 | 4 5 6 7 | 9 0 4 6 | 7 A 4 F
 *        block 1: 7 F 4 6 | 1 0 8 3 | 4 2 2 6 | 7 0 0 6 */
static const uint8_t hand_packed[16] = {0x10, 0x3a, 0x54, 0x76, 0x09, 0x64, 0xa7, 0xf4,
                                        0xf7, 0x64, 0x01, 0x38, 0x24, 0x62, 0x07, 0x60};

START_TEST(test_nvfp4_hand_block) {
  uint8_t packed[16], scales[2];
  float global;
  ck_assert_int_eq(quant_nvfp4(hand_w, 1, 32, false, packed, scales, &global), 0);
  ck_assert_float_eq(global, 1.0f);
  ck_assert_uint_eq(scales[0], 0x7e);
  ck_assert_uint_eq(scales[1], 0x58);
  ck_assert_mem_eq(packed, hand_packed, 16);
  /* compressed-tensors: global 2688/2688 = 1; s_b = amax_b / 6 * 1: the same bytes. */
  memset(packed, 0xaa, sizeof packed);
  ck_assert_int_eq(quant_nvfp4(hand_w, 1, 32, true, packed, scales, &global), 0);
  ck_assert_float_eq(global, 1.0f);
  ck_assert_uint_eq(scales[0], 0x7e);
  ck_assert_uint_eq(scales[1], 0x58);
  ck_assert_mem_eq(packed, hand_packed, 16);
  /* Dequantised: e2m1 * (f32(sc) * 1). */
  float back[32];
  dequant_nvfp4(packed, scales, 1.0f, 1, 32, back);
  ck_assert_float_eq(back[7], 2688.0f);
  ck_assert_float_eq(back[8], -224.0f);
  ck_assert_float_eq(back[10], 896.0f);
  ck_assert_float_eq(back[16], 96.0f);
  ck_assert_float_eq(back[18], 32.0f);
}
END_TEST

START_TEST(test_nvfp4_hand_global) {
  /* amax 1: weight_scale_2 = 1/2688 (f32), not a power of two. Worked in f32:
   *   block 0: amax_b = 1: 1 / (6 * ws2) = 447.99997 -> 0x7e; f32(sc) * ws2 = 1/6, x = 6 W.
   *   block 1: amax_b = 0.25: 0.25 / (6 * ws2) = 111.99999 -> 112 -> 0x6e; x = 24 W.
   * Every x is at least 0.01 from a rounding boundary. ct: global = 2688, s_b =
   * 1/6 * 2688 = 448 and 0.25/6 * 2688 = 112, f32(sc) / 2688 the same divisors. */
  static const float w[32] = {
      1.0f,    -1.0f,  0.5f,   0.3f,
      0.1f,    0.02f,  -0.02f, 0.7f, /* x 6, -6, 3, 1.8, .6, .12, -.12, 4.2 */
      0.8f,    0.9f,   0.2f,   0.22f,
      0.45f,   0.38f,  -0.55f, 0.05f, /* 4.8, 5.4, 1.2, 1.32, 2.7, 2.28, -3.3, .3 */
      0.25f,   0.1f,   0.05f,  0.01f,
      -0.125f, 0.17f,  0.21f,  0.0f, /* 6, 2.4, 1.2, .24, -3, 4.08, 5.04, 0 */
      -0.25f,  0.03f,  0.07f,  0.12f,
      0.02f,   -0.04f, 0.09f,  0.15f, /* -6, .72, 1.68, 2.88, .48, -.96, 2.16, 3.6 */
  };
  /* codes: 7 F 5 4 1 0 8 6 | 6 7 2 3 5 4 D 1 | 7 4 2 0 D 6 7 0 | F 1 3 5 1 A 4 6 */
  static const uint8_t expect[16] = {0xf7, 0x45, 0x01, 0x68, 0x76, 0x32, 0x45, 0x1d,
                                     0x47, 0x02, 0x6d, 0x07, 0x1f, 0x53, 0xa1, 0x64};
  uint8_t packed[16], scales[2];
  float global;
  for (int ct = 0; ct <= 1; ct++) {
    ck_assert_int_eq(quant_nvfp4(w, 1, 32, ct, packed, scales, &global), 0);
    ck_assert_float_eq(global, ct ? 2688.0f : 1.0f / 2688.0f);
    ck_assert_uint_eq(scales[0], 0x7e);
    ck_assert_uint_eq(scales[1], 0x6e);
    ck_assert_mem_eq(packed, expect, 16);
  }
}
END_TEST

START_TEST(test_nvfp4_division_order) {
  /* §9: true float32 divisions in the reference's order. These inputs were found by
   * searching for cases where the orders disagree; each check also shows that the
   * alternative (a reciprocal multiply, or dividing in two steps) would give another
   * byte, so the test can fail.
   * ModelOpt: amax 0x1.00001p+0 -> ws2 = amax / 2688, block scale 448 (0x7e); the
   * element 0x1.aaaac6p-3 sits just above the 1.25 tie under W / (448 * ws2). */
  float w[16] = {0};
  uint8_t packed[8], scale;
  float global;
  w[0] = 0x1.00001p+0f;
  w[1] = 0x1.aaaac6p-3f;
  float ws2 = w[0] / 2688.0f, divisor = 448.0f * ws2;
  ck_assert_uint_eq(qk_e2m1_encode(w[1] / divisor), 0x3);
  ck_assert_uint_ne(qk_e2m1_encode(w[1] * (1.0f / divisor)), 0x3);
  ck_assert_uint_ne(qk_e2m1_encode(w[1] / 448.0f / ws2), 0x3);
  ck_assert_int_eq(quant_nvfp4(w, 1, 16, false, packed, &scale, &global), 0);
  ck_assert_float_eq(global, ws2);
  ck_assert_uint_eq(scale, 0x7e);
  ck_assert_uint_eq(packed[0], 0x37);
  /* ct: amax 1 -> global 2688, divisor 448 / 2688; 0x1.2aaaaap-2 sits just below 1.75. */
  w[0] = 1.0f;
  w[1] = 0x1.2aaaaap-2f;
  float ct_divisor = 448.0f / 2688.0f;
  ck_assert_uint_eq(qk_e2m1_encode(w[1] / ct_divisor), 0x3);
  ck_assert_uint_ne(qk_e2m1_encode(w[1] * 2688.0f / 448.0f), 0x3);
  ck_assert_int_eq(quant_nvfp4(w, 1, 16, true, packed, &scale, &global), 0);
  ck_assert_float_eq(global, 2688.0f);
  ck_assert_uint_eq(scale, 0x7e);
  ck_assert_uint_eq(packed[0], 0x37);
  /* ct stores 2688 / amax, which is not always 1 / weight_scale_2. */
  w[0] = 0x1.00000ap+0f;
  w[1] = 0.0f;
  ck_assert_float_ne(2688.0f / w[0], 1.0f / (w[0] / 2688.0f));
  ck_assert_int_eq(quant_nvfp4(w, 1, 16, true, packed, &scale, &global), 0);
  ck_assert_float_eq(global, 2688.0f / w[0]);
  /* weight_scale_2 is amax / 2688, not amax * (1 / 2688). */
  w[0] = 0x1.000002p+0f;
  ck_assert_float_ne(w[0] / 2688.0f, w[0] * (1.0f / 2688.0f));
  ck_assert_int_eq(quant_nvfp4(w, 1, 16, false, packed, &scale, &global), 0);
  ck_assert_float_eq(global, w[0] / 2688.0f);
}
END_TEST

START_TEST(test_nvfp4_scale_order) {
  /* The block scale's own rounding order, pinned by amax_b values whose quotient lands
   * next to an e4m3 tie (found by search). amax 1 in block 0, so ws2 = 1/2688 and
   * ct's global = 2688. ModelOpt: amax_b / (6 * ws2), 6 * ws2 rounded first. */
  float w[32] = {0};
  uint8_t packed[16], scales[2];
  float global, ws2 = 1.0f / 2688.0f;
  w[0] = 1.0f;
  w[16] = 0x1.800002p-6f;
  uint8_t expect = qk_e4m3_encode(w[16] / (6.0f * ws2));
  ck_assert_uint_ne(expect, qk_e4m3_encode(w[16] / 6.0f / ws2));
  ck_assert_int_eq(quant_nvfp4(w, 1, 32, false, packed, scales, &global), 0);
  ck_assert_uint_eq(scales[1], expect);
  /* ct: amax_b / 6 * global (calculate_qparams), not amax_b * global / 6. */
  w[16] = 0x1.1b6db6p-5f;
  expect = qk_e4m3_encode(w[16] / 6.0f * 2688.0f);
  ck_assert_uint_ne(expect, qk_e4m3_encode(w[16] * 2688.0f / 6.0f));
  ck_assert_int_eq(quant_nvfp4(w, 1, 32, true, packed, scales, &global), 0);
  ck_assert_uint_eq(scales[1], expect);
}
END_TEST

START_TEST(test_nvfp4_zero_block) {
  /* Block 0 all zero (one -0.0), block 1 with amax 2688. ModelOpt: the zero block's
   * scale is 1.0 before the cast (0x38); ct: 0.125 after it (0x20). Codes 0. */
  float w[32] = {0};
  w[3] = -0.0f;
  w[16] = 2688.0f;
  uint8_t packed[16], scales[2];
  float global;
  ck_assert_int_eq(quant_nvfp4(w, 1, 32, false, packed, scales, &global), 0);
  ck_assert_uint_eq(scales[0], 0x38);
  ck_assert_uint_eq(scales[1], 0x7e);
  for (int i = 0; i < 8; i++)
    ck_assert_uint_eq(packed[i], 0);
  ck_assert_uint_eq(packed[8], 0x07);
  ck_assert_int_eq(quant_nvfp4(w, 1, 32, true, packed, scales, &global), 0);
  ck_assert_uint_eq(scales[0], 0x20);
  ck_assert_uint_eq(scales[1], 0x7e);
  for (int i = 0; i < 8; i++)
    ck_assert_uint_eq(packed[i], 0);
  ck_assert_uint_eq(packed[8], 0x07);
}
END_TEST

START_TEST(test_nvfp4_underflow_block) {
  /* ws2 = 1 (amax 2688 in block 1); block 0's amax 1e-4 gives s_b = 1.7e-5, below
   * half the smallest e4m3 subnormal (2^-10): the scale casts to 0. §9: codes 0 (not
   * ModelOpt's ±6 from dividing by zero), negative elements included; the ModelOpt
   * scale stays 0x00, ct's becomes 0.125. */
  float w[32] = {0};
  w[0] = 1e-4f;
  w[1] = -1e-4f;
  w[2] = -5e-5f;
  w[16] = 2688.0f;
  uint8_t packed[16], scales[2];
  float global;
  ck_assert_int_eq(quant_nvfp4(w, 1, 32, false, packed, scales, &global), 0);
  ck_assert_uint_eq(scales[0], 0x00);
  for (int i = 0; i < 8; i++)
    ck_assert_uint_eq(packed[i], 0);
  float back[32];
  dequant_nvfp4(packed, scales, global, 1, 32, back);
  ck_assert_float_eq(back[0], 0.0f);
  ck_assert_float_eq(back[1], 0.0f);
  ck_assert_float_eq(back[16], 2688.0f);
  ck_assert_int_eq(quant_nvfp4(w, 1, 32, true, packed, scales, &global), 0);
  ck_assert_uint_eq(scales[0], 0x20);
  for (int i = 0; i < 8; i++)
    ck_assert_uint_eq(packed[i], 0);
  /* Just above the underflow: s_b = 2^-9 -> 0x01 in both flavours. */
  w[0] = 6 * 0x1p-9f;
  w[1] = w[2] = 0.0f;
  for (int ct = 0; ct <= 1; ct++) {
    ck_assert_int_eq(quant_nvfp4(w, 1, 32, ct, packed, scales, &global), 0);
    ck_assert_uint_eq(scales[0], 0x01);
    ck_assert_uint_eq(packed[0], 0x07);
  }
}
END_TEST

START_TEST(test_nvfp4_all_zero) {
  float w[64] = {0};
  w[5] = -0.0f;
  uint8_t packed[32], scales[4];
  float global = 123.0f;
  memset(packed, 0xaa, sizeof packed);
  ck_assert_int_eq(quant_nvfp4(w, 2, 32, false, packed, scales, &global), 0);
  ck_assert_float_eq(global, 0.0f);
  for (int i = 0; i < 4; i++)
    ck_assert_uint_eq(scales[i], 0x38);
  for (int i = 0; i < 32; i++)
    ck_assert_uint_eq(packed[i], 0);
  global = 123.0f;
  memset(packed, 0xaa, sizeof packed);
  ck_assert_int_eq(quant_nvfp4(w, 2, 32, true, packed, scales, &global), 0);
  ck_assert_float_eq(global, 0.0f);
  for (int i = 0; i < 4; i++)
    ck_assert_uint_eq(scales[i], 0x20);
  for (int i = 0; i < 32; i++)
    ck_assert_uint_eq(packed[i], 0);
  /* An empty tensor takes the same path. */
  ck_assert_int_eq(quant_nvfp4(NULL, 0, 32, false, NULL, NULL, &global), 0);
  ck_assert_float_eq(global, 0.0f);
}
END_TEST

/* Uniform random weights in [-1, 1) scaled by 2^tensor_exp, each row by a further
 * 2^-(0..row_spread) and each block of `block` by 2^-(0..block_spread). */
static float *random_weights(int64_t n, int64_t k, int64_t block, int tensor_exp, int row_spread,
                             int block_spread, uint64_t seed) {
  float *w = xcalloc((size_t)(n * k), sizeof *w);
  uint64_t st = seed;
  for (int64_t r = 0; r < n; r++) {
    int row_exp = tensor_exp - (int)(tu_rand(&st) % (uint64_t)(row_spread + 1));
    for (int64_t b = 0; b < k / block; b++) {
      int block_exp = row_exp - (int)(tu_rand(&st) % (uint64_t)(block_spread + 1));
      for (int64_t j = 0; j < block; j++)
        w[r * k + b * block + j] = ldexpf(tu_randf(&st), block_exp);
    }
  }
  return w;
}

/* Checks one NVFP4 quantisation against its recipe: each block scale within half
 * an e4m3 step of s_b; each element's error at most half the e2m1 gap around its
 * code, times the block's divisor D; and |W| / D <= 6 * 16/15, which is where a
 * scale rounded down by at most 1/16 can push the saturated top code. */
static void check_nvfp4(const float *w, int64_t n, int64_t k, bool ct) {
  uint8_t *packed = xcalloc((size_t)(n * k / 2), 1), *scales = xcalloc((size_t)(n * k / 16), 1);
  float *back = xcalloc((size_t)(n * k), sizeof *back), global;
  ck_assert_int_eq(quant_nvfp4(w, n, k, ct, packed, scales, &global), 0);
  float amax = 0.0f;
  for (int64_t i = 0; i < n * k; i++)
    amax = fmaxf(amax, fabsf(w[i]));
  float ws2 = amax / 2688.0f;
  ck_assert_float_eq(global, ct ? 2688.0f / amax : ws2);
  float decode_global = ct ? 1.0f / global : global;
  dequant_nvfp4(packed, scales, decode_global, n, k, back);
  for (int64_t r = 0; r < n; r++)
    for (int64_t b = 0; b < k / 16; b++) {
      const float *x = w + r * k + b * 16;
      float amax_b = 0.0f;
      for (int j = 0; j < 16; j++)
        amax_b = fmaxf(amax_b, fabsf(x[j]));
      float s_b = ct ? amax_b / 6.0f * global : amax_b / (6.0f * ws2);
      float sc = qk_e4m3_decode(scales[r * (k / 16) + b]);
      ck_assert(s_b >= 0x1p-6f); /* the data keeps scales normal */
      int e;
      frexpf(fminf(s_b, 448.0f), &e);
      ck_assert_msg(fabsf(sc - fminf(s_b, 448.0f)) <= ldexpf(1.0f, e - 1 - 4), "scale %g for s_b %g",
                    (double)sc, (double)s_b);
      float divisor = ct ? sc / global : sc * ws2;
      for (int j = 0; j < 16; j++) {
        int64_t i = r * k + b * 16 + j;
        uint8_t code = qk_fp4_code(packed + r * (k / 2), b * 16 + j);
        float err = fabsf(w[i] - back[i]);
        float bound = e2m1_half_gap[code & 7] * divisor * (1.0f + 1e-5f);
        ck_assert_msg(err <= bound, "row %lld col %lld: w %g dq %g code %x err %g bound %g", (long long)r,
                      (long long)(b * 16 + j), (double)w[i], (double)back[i], code, (double)err,
                      (double)bound);
        ck_assert(fabsf(w[i]) / divisor <= 6.4f * (1.0f + 1e-6f));
        if (back[i] != 0.0f)
          ck_assert_int_eq(signbit(back[i]) != 0, signbit(w[i]) != 0);
      }
    }
  free(packed);
  free(scales);
  free(back);
}

START_TEST(test_nvfp4_random_round_trip) {
  for (uint64_t seed = 1; seed <= 4; seed++) {
    /* One global scale per tensor: rows share a magnitude so that block scales stay
     * e4m3 normals; the tensor's magnitude varies with the seed (2^-7 .. 2^14). */
    float *w = random_weights(16, 256, 16, (int)seed * 7 - 14, 0, 6, seed);
    check_nvfp4(w, 16, 256, false);
    check_nvfp4(w, 16, 256, true);
    free(w);
  }
}
END_TEST

START_TEST(test_nvfp4_tiny_amax_refused) {
  /* weight_scale_2 would be subnormal: refused rather than dividing by an underflowed 0. */
  float w[16] = {0};
  w[0] = 1e-36f;
  uint8_t packed[8], scale;
  float global;
  ck_assert_int_eq(quant_nvfp4(w, 1, 16, false, packed, &scale, &global), QKEEP_E_INVAL);
  ck_assert_int_eq(quant_nvfp4(w, 1, 16, true, packed, &scale, &global), QKEEP_E_INVAL);
  w[0] = 1e-30f; /* fine: ws2 = 3.7e-34 is normal */
  ck_assert_int_eq(quant_nvfp4(w, 1, 16, false, packed, &scale, &global), 0);
  ck_assert_uint_eq(scale, 0x7e);
  ck_assert_uint_eq(packed[0], 0x07);
}
END_TEST

/* ---- MXFP4 --------------------------------------------------------------------------- */

START_TEST(test_mxfp4_hand) {
  /* Block 0: amax 7.5 -> floor(log2) 2 -> shared 0 -> byte 127, X = 1: 7.5 saturates
   *          to 6 (the recipe's known weakness). Block 1: all zero -> byte 0, codes 0.
   * Block 2: amax 0.3 -> floor(log2) -2 -> shared -4 -> byte 123, X = 1/16. */
  float w[96] = {0};
  w[0] = 7.5f;      /* 7 */
  w[1] = 2.5f;      /* tie -> 2: 4 */
  w[2] = -0.25f;    /* tie -> 0, negative: 8 */
  w[3] = 0.75f;     /* tie -> 1: 2 */
  w[4] = -3.5f;     /* tie -> 4: E */
  w[64] = 0.3f;     /* 4.8 -> 4: 6 */
  w[65] = -0.1f;    /* -1.6 -> -1.5: B */
  w[66] = 0.15625f; /* 2.5 -> 2: 4 */
  uint8_t packed[48], scales[3];
  ck_assert_int_eq(quant_mxfp4(w, 1, 96, packed, scales), 0);
  ck_assert_uint_eq(scales[0], 127);
  ck_assert_uint_eq(scales[1], 0);
  ck_assert_uint_eq(scales[2], 123);
  ck_assert_uint_eq(packed[0], 0x47);
  ck_assert_uint_eq(packed[1], 0x28);
  ck_assert_uint_eq(packed[2], 0x0e);
  for (int i = 3; i < 32; i++)
    ck_assert_uint_eq(packed[i], 0);
  ck_assert_uint_eq(packed[32], 0xb6);
  ck_assert_uint_eq(packed[33], 0x04);
  float back[96];
  dequant_mxfp4(packed, scales, 1, 96, back);
  ck_assert_float_eq(back[0], 6.0f);
  ck_assert_float_eq(back[4], -4.0f);
  ck_assert_float_eq(back[64], 0.25f);
  ck_assert_float_eq(back[65], -1.5f / 16.0f);
}
END_TEST

START_TEST(test_mxfp4_random_round_trip) {
  int64_t n = 8, k = 256;
  float *w = random_weights(n, k, 32, 0, 40, 30, 99);
  uint8_t *packed = xcalloc((size_t)(n * k / 2), 1), *scales = xcalloc((size_t)(n * k / 32), 1);
  float *back = xcalloc((size_t)(n * k), sizeof *back);
  ck_assert_int_eq(quant_mxfp4(w, n, k, packed, scales), 0);
  dequant_mxfp4(packed, scales, n, k, back);
  for (int64_t r = 0; r < n; r++)
    for (int64_t b = 0; b < k / 32; b++) {
      float amax_b = 0.0f;
      for (int j = 0; j < 32; j++)
        amax_b = fmaxf(amax_b, fabsf(w[r * k + b * 32 + j]));
      int e;
      frexpf(amax_b, &e); /* floor(log2) = e - 1 */
      int shared = e - 1 - 2;
      ck_assert_int_eq(scales[r * (k / 32) + b], shared < -127 ? 0 : shared + 127);
      float x_unit = ldexpf(1.0f, shared < -127 ? -127 : shared);
      for (int j = 0; j < 32; j++) {
        int64_t i = r * k + b * 32 + j;
        float x = w[i] / x_unit; /* exact */
        ck_assert(fabsf(x) < 8.0f);
        uint8_t code = qk_fp4_code(packed + r * (k / 2), b * 32 + j);
        /* Inside [-6, 6]: half the gap; above it the clamp to 6. */
        float bound = fmaxf(e2m1_half_gap[code & 7], fabsf(x) - 6.0f) * x_unit;
        ck_assert_msg(fabsf(w[i] - back[i]) <= bound, "w %g dq %g", (double)w[i], (double)back[i]);
      }
    }
  free(w);
  free(packed);
  free(scales);
  free(back);
}
END_TEST

/* ---- int8 ---------------------------------------------------------------------------- */

START_TEST(test_int8_channel) {
  /* Row 0: amax 127 -> scale 1 exactly; ties go to even. Row 1: all zero -> scale 1. */
  static const float w[16] = {127.0f, 2.5f, 3.5f, -2.5f, -126.6f, 0.49f, -0.0f, 1.5f, 0, 0, 0, 0, 0, 0, 0, 0};
  static const int8_t expect[8] = {127, 2, 4, -2, -127, 0, 0, 2};
  int8_t q[16];
  float scales[2];
  ck_assert_int_eq(quant_int8_channel(w, 2, 8, q, scales), 0);
  ck_assert_float_eq(scales[0], 1.0f);
  ck_assert_float_eq(scales[1], 1.0f);
  ck_assert_mem_eq(q, expect, 8);
  for (int i = 8; i < 16; i++)
    ck_assert_int_eq(q[i], 0);

  int64_t n = 16, k = 200;
  float *rw = random_weights(n, k, 8, 3, 20, 10, 7);
  int8_t *rq = xcalloc((size_t)(n * k), 1);
  float *rs = xcalloc((size_t)n, sizeof *rs);
  ck_assert_int_eq(quant_int8_channel(rw, n, k, rq, rs), 0);
  for (int64_t r = 0; r < n; r++) {
    float amax = 0.0f;
    int qmax = 0;
    for (int64_t j = 0; j < k; j++) {
      amax = fmaxf(amax, fabsf(rw[r * k + j]));
      qmax = abs(rq[r * k + j]) > qmax ? abs(rq[r * k + j]) : qmax;
    }
    ck_assert_float_eq(rs[r], amax / 127.0f);
    ck_assert_int_eq(qmax, 127);
    for (int64_t j = 0; j < k; j++) {
      float err = fabsf(rw[r * k + j] - (float)rq[r * k + j] * rs[r]);
      ck_assert(err <= rs[r] * 0.5f * (1.0f + 1e-5f));
    }
  }
  free(rw);
  free(rq);
  free(rs);

  /* amax / 127 underflows to 0 for amax below 64 * 2^-149: refused, not divided by. */
  float tiny[2] = {10 * FLT_TRUE_MIN, 0.0f};
  ck_assert_int_eq(quant_int8_channel(tiny, 1, 2, q, scales), QKEEP_E_INVAL);
  tiny[0] = 1e-40f; /* subnormal, but its scale is not zero */
  ck_assert_int_eq(quant_int8_channel(tiny, 1, 2, q, scales), 0);
  ck_assert_int_eq(q[0], 127);
}
END_TEST

/* ---- GPTQ int4 ----------------------------------------------------------------------- */

static uint32_t u32(int32_t v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

START_TEST(test_gptq_sym_layout) {
  /* n = 8 outputs, k = 8, one group. Row r of w is output column r of qweight.
   *   row 0: min -7.5, max 7 -> sym: xmax 7.5, xmin -7.5, scale 15/15 = 1, zero 8;
   *          q = rint(w) + 8: -7.5 -> -8 (even) -> 0, -7 -> 1, -3 -> 5, 0 -> 8,
   *          1 -> 9, 2 -> A, 3 -> B, 7 -> F; nibble j = k j: 0xFBA98510.
   *   row 2: no negative value: xmin stays 0, scale = 7.5/15 = 0.5 (GPTQ's rule), zero 8;
   *          q = rint(2w) + 8 clamped to 15: 8 A C E F F F F -> 0xFFFFECA8.
   *   other rows all zero: [-1, 1], scale 2/15 (f16 0x3044), q 8 -> 0x88888888.
   * qzeros: zero 8 stored as 7 in every nibble (v1). */
  float w[64] = {0};
  static const float row0[8] = {-7.5f, -7, -3, 0, 1, 2, 3, 7};
  static const float row2[8] = {0, 1, 2, 3, 4, 5, 6, 7.5f};
  memcpy(w, row0, sizeof row0);
  memcpy(w + 16, row2, sizeof row2);
  int32_t qweight[8], qzeros[1], g_idx[8];
  uint16_t scales[8];
  ck_assert_int_eq(quant_gptq_int4(w, 8, 8, 8, true, qweight, scales, qzeros, g_idx), 0);
  ck_assert_uint_eq(u32(qweight[0]), 0xFBA98510u);
  ck_assert_uint_eq(u32(qweight[2]), 0xFFFFECA8u);
  for (int c = 0; c < 8; c++) {
    if (c != 0 && c != 2) {
      ck_assert_uint_eq(u32(qweight[c]), 0x88888888u);
      ck_assert_uint_eq(scales[c], 0x3044);
    }
    ck_assert_int_eq(g_idx[c], 0);
  }
  ck_assert_uint_eq(scales[0], 0x3c00);
  ck_assert_uint_eq(scales[2], 0x3800);
  ck_assert_uint_eq(u32(qzeros[0]), 0x77777777u);
  float back[64];
  dequant_gptq_int4(qweight, scales, qzeros, g_idx, 8, 8, 8, false, back);
  ck_assert_float_eq(back[0], -8.0f);
  ck_assert_float_eq(back[7], 7.0f);
  ck_assert_float_eq(back[16 + 7], 3.5f); /* clipped at 7 * 0.5 */
  ck_assert_float_eq(back[8], 0.0f);
}
END_TEST

START_TEST(test_gptq_asym_layout) {
  /* row 0: xmin -1, xmax 6.5 -> scale 0.5, zero rint(2) = 2 (stored 1);
   *        q = rint(2w) + 2: 0 2 3 4 6 8 A F -> 0xFA864320.
   * row 1: xmin 0 (the range includes 0), xmax 8 -> scale f32(8/15) = 0.53333336
   *        (f16 0x3844), zero 0 (stored (0 - 1) & 0xf = 0xF); w / scale = .94 1.87 3.75
   *        5.62 9.37 11.25 13.12 15.0 -> 1 2 4 6 9 B D F -> 0xFDB96421.
   * row 2: xmin -1.25, xmax 6.25 -> scale 0.5, -xmin / scale = 2.5 exactly: zero 2
   *        (half to even, stored 1); q = rint(2w) + 2: -2.5 -> -2 -> 0, 12.5 -> 12 -> 14,
   *        0 -> 2: 0x222222E0.
   * rows 3-7 zero: [-1, 1], scale f32(2/15) = 0.13333334, so -xmin / scale =
   *        7.4999995 -> zero 7 (stored 6), q 7 -> 0x77777777.
   * qzeros = nibbles (1, F, 1, 6, 6, 6, 6, 6) = 0x666661F1. */
  float w[64] = {0};
  static const float row0[8] = {-1, 0, 0.5f, 1, 2, 3, 4, 6.5f};
  static const float row1[8] = {0.5f, 1, 2, 3, 5, 6, 7, 8};
  memcpy(w, row0, sizeof row0);
  memcpy(w + 8, row1, sizeof row1);
  w[16] = -1.25f;
  w[17] = 6.25f;
  int32_t qweight[8], qzeros[1], g_idx[8];
  uint16_t scales[8];
  ck_assert_int_eq(quant_gptq_int4(w, 8, 8, 8, false, qweight, scales, qzeros, g_idx), 0);
  ck_assert_uint_eq(u32(qweight[0]), 0xFA864320u);
  ck_assert_uint_eq(u32(qweight[1]), 0xFDB96421u);
  ck_assert_uint_eq(u32(qweight[2]), 0x222222E0u);
  ck_assert_uint_eq(scales[2], 0x3800);
  for (int c = 3; c < 8; c++) {
    ck_assert_uint_eq(u32(qweight[c]), 0x77777777u);
    ck_assert_uint_eq(scales[c], 0x3044);
  }
  ck_assert_uint_eq(scales[0], 0x3800);
  ck_assert_uint_eq(scales[1], 0x3844);
  ck_assert_uint_eq(u32(qzeros[0]), 0x666661F1u);
  float back[64];
  dequant_gptq_int4(qweight, scales, qzeros, g_idx, 8, 8, 8, false, back);
  for (int j = 0; j < 8; j++)
    ck_assert_float_eq(back[j], row0[j]); /* every value of row 0 is on the grid */
  ck_assert_float_eq(back[8 + 7], qk_f16_to_f32(0x3844) * 15.0f);
  ck_assert_float_eq(back[16], -1.0f);
  ck_assert_float_eq(back[17], 6.0f);
  ck_assert_float_eq(back[24], 0.0f);
}
END_TEST

START_TEST(test_gptq_dequant_g_idx_and_zeros) {
  /* Hand-built: k = 16, two groups of 8, every code 9; group 0 scale 1, group 1
   * scale 2; act-order g_idx alternates groups. */
  int32_t qweight[16], qzeros[2], g_idx[16];
  uint16_t scales[16];
  for (int i = 0; i < 16; i++) {
    qweight[i] = (int32_t)0x99999999u;
    scales[i] = i < 8 ? 0x3c00 : 0x4000;
    g_idx[i] = i % 2;
  }
  float back[128];
  /* v1, 0x77777777: zero 8 -> w = scale * (9 - 8). */
  qzeros[0] = qzeros[1] = 0x77777777;
  dequant_gptq_int4(qweight, scales, qzeros, g_idx, 8, 16, 8, false, back);
  for (int r = 0; r < 8; r++)
    for (int j = 0; j < 16; j++)
      ck_assert_float_eq(back[r * 16 + j], j % 2 ? 2.0f : 1.0f);
  /* v2 stores zero itself: 0x88888888 means 8. Read as v1 it would be 9. */
  qzeros[0] = qzeros[1] = (int32_t)0x88888888u;
  dequant_gptq_int4(qweight, scales, qzeros, g_idx, 8, 16, 8, true, back);
  ck_assert_float_eq(back[1], 2.0f);
  dequant_gptq_int4(qweight, scales, qzeros, g_idx, 8, 16, 8, false, back);
  ck_assert_float_eq(back[1], 0.0f);
  /* v1 0xF is zero 0 ((15 + 1) & 0xf), not 16. */
  qzeros[0] = qzeros[1] = -1;
  dequant_gptq_int4(qweight, scales, qzeros, g_idx, 8, 16, 8, false, back);
  ck_assert_float_eq(back[0], 9.0f);
  ck_assert_float_eq(back[1], 18.0f);
  /* No g_idx: k / g. */
  dequant_gptq_int4(qweight, scales, qzeros, NULL, 8, 16, 8, false, back);
  ck_assert_float_eq(back[1], 9.0f);
  ck_assert_float_eq(back[9], 18.0f);
}
END_TEST

/* Quantises and checks every group against GPTQ's rules, recomputed here. */
static void check_gptq(int64_t n, int64_t k, int64_t g, bool sym, uint64_t seed) {
  float *w = random_weights(n, k, 8, 0, 4, 4, seed);
  int64_t groups = k / g;
  int32_t *qweight = xcalloc((size_t)(k / 8 * n), 4), *qzeros = xcalloc((size_t)(groups * n / 8), 4);
  int32_t *g_idx = xcalloc((size_t)k, 4);
  uint16_t *scales = xcalloc((size_t)(groups * n), 2);
  float *back = xcalloc((size_t)(n * k), sizeof *back);
  ck_assert_int_eq(quant_gptq_int4(w, n, k, g, sym, qweight, scales, qzeros, g_idx), 0);
  dequant_gptq_int4(qweight, scales, qzeros, g_idx, n, k, g, false, back);
  for (int64_t kk = 0; kk < k; kk++)
    ck_assert_int_eq(g_idx[kk], kk / g);
  for (int64_t r = 0; r < n; r++)
    for (int64_t gi = 0; gi < groups; gi++) {
      const float *x = w + r * k + gi * g;
      float lo = 0.0f, hi = 0.0f;
      for (int64_t j = 0; j < g; j++) {
        lo = fminf(lo, x[j]);
        hi = fmaxf(hi, x[j]);
      }
      bool clips = sym && lo == 0.0f; /* GPTQ's rule: an all-positive sym group clips at 7 steps */
      if (sym) {
        hi = fmaxf(-lo, hi);
        if (lo < 0.0f)
          lo = -hi;
      }
      float scale = (hi - lo) / 15.0f;
      int zero = sym ? 8 : (int)nearbyintf(-lo / scale);
      ck_assert_uint_eq(scales[gi * n + r], qk_f32_to_f16(scale));
      uint32_t stored = (u32(qzeros[gi * (n / 8) + r / 8]) >> (4 * (r % 8))) & 0xf;
      ck_assert_uint_eq(stored, (uint32_t)(zero - 1) & 0xf);
      /* Half a step, plus the f16 rounding of the scale times at most 15 steps;
       * asym never clips, sym clips only an all-positive group, above 7 steps. */
      float s16 = qk_f16_to_f32(scales[gi * n + r]);
      float bound = scale * 0.5f * (1.0f + 1e-5f) + 15.0f * fabsf(scale - s16);
      for (int64_t j = 0; j < g; j++) {
        int64_t i = r * k + gi * g + j;
        float clip = clips ? fmaxf(0.0f, w[i] - 7.0f * s16) : 0.0f;
        ck_assert_msg(fabsf(w[i] - back[i]) <= bound + clip, "w %g dq %g scale %g", (double)w[i],
                      (double)back[i], (double)scale);
      }
    }
  free(w);
  free(qweight);
  free(qzeros);
  free(g_idx);
  free(scales);
  free(back);
}

START_TEST(test_gptq_random_round_trip) {
  check_gptq(16, 256, 128, true, 11);
  check_gptq(16, 256, 32, false, 12);
  check_gptq(8, 96, 12, true, 13); /* a group size that is not a multiple of 8 */
  check_gptq(8, 96, 12, false, 14);
  check_gptq(8, 64, 64, false, 15);
}
END_TEST

/* ---- refusals ------------------------------------------------------------------------ */

START_TEST(test_refuse_non_finite) {
  float w[64];
  for (int i = 0; i < 64; i++)
    w[i] = 0.1f * (float)(i % 7);
  uint8_t packed[32], scales[4];
  int8_t q[64];
  float fs[2], global;
  int32_t qweight[8], qzeros[1], g_idx[8];
  uint16_t hs[8];
  const float bad[2] = {NAN, -INFINITY};
  for (int b = 0; b < 2; b++) {
    w[37] = bad[b];
    ck_assert_int_eq(quant_nvfp4(w, 2, 32, false, packed, scales, &global), QKEEP_E_INVAL);
    ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "element 37 (row 1, column 5)"));
    ck_assert_int_eq(quant_nvfp4(w, 2, 32, true, packed, scales, &global), QKEEP_E_INVAL);
    ck_assert_int_eq(quant_mxfp4(w, 2, 32, packed, scales), QKEEP_E_INVAL);
    ck_assert_int_eq(quant_int8_channel(w, 2, 32, q, fs), QKEEP_E_INVAL);
    ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), b ? "infinite" : "NaN"));
    ck_assert_int_eq(quant_gptq_int4(w, 8, 8, 8, true, qweight, hs, qzeros, g_idx), QKEEP_E_INVAL);
  }
}
END_TEST

START_TEST(test_refuse_shapes) {
  float w[96] = {0};
  uint8_t packed[48], scales[8];
  int8_t q[96];
  float fs[8], global;
  int32_t qweight[16], qzeros[4], g_idx[16];
  uint16_t hs[16];
  ck_assert_int_eq(quant_nvfp4(w, 1, 24, false, packed, scales, &global), QKEEP_E_INVAL);
  ck_assert_int_eq(quant_nvfp4(w, -1, 16, false, packed, scales, &global), QKEEP_E_INVAL);
  ck_assert_int_eq(quant_nvfp4(w, 1, 16, false, packed, scales, NULL), QKEEP_E_INVAL);
  ck_assert_int_eq(quant_mxfp4(w, 1, 48, packed, scales), QKEEP_E_INVAL);
  ck_assert_int_eq(quant_mxfp4(w, 1, 16, packed, scales), QKEEP_E_INVAL);
  ck_assert_int_eq(quant_int8_channel(w, -2, 8, q, fs), QKEEP_E_INVAL);
  ck_assert_int_eq(quant_int8_channel(NULL, 2, 8, q, fs), QKEEP_E_INVAL);
  ck_assert_int_eq(quant_gptq_int4(w, 4, 8, 8, true, qweight, hs, qzeros, g_idx), QKEEP_E_INVAL);  /* n % 8 */
  ck_assert_int_eq(quant_gptq_int4(w, 8, 12, 4, true, qweight, hs, qzeros, g_idx), QKEEP_E_INVAL); /* k % 8 */
  ck_assert_int_eq(quant_gptq_int4(w, 8, 8, 0, true, qweight, hs, qzeros, g_idx), QKEEP_E_INVAL);
  ck_assert_int_eq(quant_gptq_int4(w, 8, 8, 3, true, qweight, hs, qzeros, g_idx), QKEEP_E_INVAL); /* k % g */
  ck_assert_int_eq(quant_gptq_int4(w, 8, 8, -1, true, qweight, hs, qzeros, g_idx), QKEEP_E_INVAL);
  /* A group scale beyond float16: (1e6 - 0) / 15 > 65504. */
  w[0] = 1e6f;
  ck_assert_int_eq(quant_gptq_int4(w, 8, 8, 8, false, qweight, hs, qzeros, g_idx), QKEEP_E_INVAL);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "float16"));
}
END_TEST

static Suite *formats_suite(void) {
  Suite *s = suite_create("formats");
  TCase *codec = tcase_create("codecs");
  tcase_add_test(codec, test_e2m1_decode_table);
  tcase_add_test(codec, test_e2m1_encode_ties);
  tcase_add_test(codec, test_e2m1_sign_and_saturation);
  tcase_add_test(codec, test_fp4_nibble_order);
  tcase_add_test(codec, test_e4m3_points);
  tcase_add_test(codec, test_e4m3_ties_to_even);
  tcase_add_test(codec, test_e4m3_round_trip);
  tcase_add_test(codec, test_e8m0);
  suite_add_tcase(s, codec);
  TCase *quant = tcase_create("quantizers");
  tcase_add_test(quant, test_nvfp4_hand_block);
  tcase_add_test(quant, test_nvfp4_hand_global);
  tcase_add_test(quant, test_nvfp4_division_order);
  tcase_add_test(quant, test_nvfp4_scale_order);
  tcase_add_test(quant, test_nvfp4_zero_block);
  tcase_add_test(quant, test_nvfp4_underflow_block);
  tcase_add_test(quant, test_nvfp4_all_zero);
  tcase_add_test(quant, test_nvfp4_random_round_trip);
  tcase_add_test(quant, test_nvfp4_tiny_amax_refused);
  tcase_add_test(quant, test_mxfp4_hand);
  tcase_add_test(quant, test_mxfp4_random_round_trip);
  tcase_add_test(quant, test_int8_channel);
  tcase_add_test(quant, test_gptq_sym_layout);
  tcase_add_test(quant, test_gptq_asym_layout);
  tcase_add_test(quant, test_gptq_dequant_g_idx_and_zeros);
  tcase_add_test(quant, test_gptq_random_round_trip);
  tcase_add_test(quant, test_refuse_non_finite);
  tcase_add_test(quant, test_refuse_shapes);
  suite_add_tcase(s, quant);
  return s;
}

int main(void) { return tu_run_suite(formats_suite(), CK_NORMAL); }
