/*
 * quantize/quant.h: the quantize layer (libqkeep/quantize): the offline quantizer behind
 * `qkeep quantize` (quantize_model.c, which uses scheme and format) and its numerics (quantize.c,
 * base only). Loads that quantize on their way use it through its plan (quantize/plan.h), so it
 * sits below the layers that load (plugin, model, load, reload).
 *
 * The quantizers that write checkpoints (libqkeep/quantize/quantize.c), following
 * the exporters' recipes exactly (docs/FORMATS.md, "6. qkeep quantize"), so their output is
 * reproducible byte for byte. Weights are row-major f32 [n, k] (n outputs, k
 * inputs). Every function returns 0, or QKEEP_E_INVAL when the input holds
 * NaN or Inf or the shape does not fit the format (detail via set_error,
 * without a tensor name: callers add it).
 */
#ifndef QKEEP_QUANT_H
#define QKEEP_QUANT_H

#include <stdbool.h>
#include <stdint.h>

#include "base/formats.h"

/* e2m1 code of x: the OCP MX e2m1 values (RNE, ties per the table, saturate at ±6);
 * the sign bit is set iff x < 0. x must be finite. */
uint8_t qk_e2m1_encode(float x);
/* e4m3fn byte of x: round to nearest even with subnormals, saturating at ±448. */
uint8_t qk_e4m3_encode(float x);
/* MXFP4 shared scale byte for a block's amax: floor(log2(amax)) - 2 from the float's
 * exponent (amax 0 uses FP32_MIN_NORMAL), clamped to [-127, 127], stored + 127. */
uint8_t qk_e8m0_from_amax(float amax);
/* qk_e4m3_decode's value of a byte other than NaN (0x7f, 0xff), without libm: what the NVFP4
 * quantizer divides by. */
float quant_e4m3_value(uint8_t b);

/*
 * NVFP4 (k % 16 == 0). packed u8 [n, k/2]; block_scale e4m3 [n, k/16].
 * ModelOpt (ct = false): *global = weight_scale_2 = amax/2688 (a decode factor), zero
 * blocks get scale 1.0. compressed-tensors (ct = true): *global = 2688/amax (an encode
 * factor), zero blocks get 0.125 after the cast. All-zero tensor: global 0 (ModelOpt) or
 * 0 (ct), every block scale per the zero rule, codes 0.
 */
int quant_nvfp4(const float *w, int64_t n, int64_t k, bool ct, uint8_t *packed, uint8_t *block_scale,
                float *global);
/* Dequantises NVFP4 into w [n, k]: e2m1(q) * (f32(scale) * decode_global), where
 * decode_global is weight_scale_2 (ModelOpt) or 1/global (compressed-tensors). */
void dequant_nvfp4(const uint8_t *packed, const uint8_t *block_scale, float decode_global, int64_t n,
                   int64_t k, float *w);

/* MXFP4 (k % 32 == 0): packed u8 [n, k/2], e8m0 scales [n, k/32], RNE elements. */
int quant_mxfp4(const float *w, int64_t n, int64_t k, uint8_t *packed, uint8_t *scales);
void dequant_mxfp4(const uint8_t *packed, const uint8_t *scales, int64_t n, int64_t k, float *w);

/* int8 per output channel: scale = amax/127 (1.0 for an all-zero row), q = clamp(rint(w/scale), ±127). */
int quant_int8_channel(const float *w, int64_t n, int64_t k, int8_t *q, float *scales);

/*
 * GPTQ int4 with groups of g along k (k % g == 0, k % 8 == 0, n % 8 == 0), round to
 * nearest (no Hessian update), GPTQ's scale rules (docs/FORMATS.md, 6). Layout as AutoGPTQ v1
 * writes it: qweight i32 [k/8, n] (lowest k in the lowest nibble), scales f16 bits
 * [k/g, n], qzeros i32 [k/g, n/8] packed along n storing zero - 1, g_idx i32 [k] = k/g.
 * sym: zero = 8.
 */
int quant_gptq_int4(const float *w, int64_t n, int64_t k, int64_t g, bool sym, int32_t *qweight,
                    uint16_t *scales, int32_t *qzeros, int32_t *g_idx);
/* Dequantises GPTQ int4 (v1 qzeros: stored zero + 1; v2: as stored) into w [n, k],
 * honouring g_idx (act order). */
void dequant_gptq_int4(const int32_t *qweight, const uint16_t *scales, const int32_t *qzeros,
                       const int32_t *g_idx, int64_t n, int64_t k, int64_t g, bool v2_zeros, float *w);

/*
 * compressed-tensors pack-quantized int4 (k % g == 0, k % 8 == 0, n % 8 == 0) with GPTQ's round to
 * nearest and scale rules (as quant_gptq_int4: the same codes and f32 scales). packed i32 [n, k/8]:
 * code of k at bits 4 (k % 8) of word k/8, stored as q + 8 (so as GPTQ's unsigned code); scales f32
 * [n, k/g] (the writer stores them in the model's dtype); zero_points i32 [n/8, k/g] packed along n
 * (zero + 8 = GPTQ's unsigned zero) when !sym, else unused (may be NULL).
 */
int quant_ct_int4(const float *w, int64_t n, int64_t k, int64_t g, bool sym, int32_t *packed, float *scales,
                  int32_t *zero_points);

/*
 * Row ranges, for quantizing one matrix on several threads (quantize_model.c). Each
 * call covers rows [row0, row0 + rows) of an [n, k] matrix: w points at row row0's
 * f32 values, and the outputs at that row's first output (row0's bytes of packed,
 * block scales, q, ...), except where said. The shape and the options are checked by
 * the caller (the whole-matrix functions above show which checks apply). Together,
 * the ranges of a matrix write exactly the bytes of the whole-matrix call, and a
 * range's error is the one the whole-matrix call reports when that range holds the
 * matrix's first offending row (row numbers count from row 0 of the matrix).
 */
/* Refuses NaN and Inf (naming element, row and column of the matrix); *amax (may be NULL)
 * gets max |w| of the rows. */
int quant_check_rows(const float *w, int64_t row0, int64_t rows, int64_t k, float *amax);
/* The NVFP4 global scale (as quant_nvfp4 stores it) for a matrix's amax; QKEEP_E_INVAL
 * when that scale would be subnormal. */
int quant_nvfp4_global(float amax, bool ct, float *global);
/* NVFP4 codes and block scales of finite rows, given the whole matrix's amax. */
void quant_nvfp4_rows(const float *w, int64_t rows, int64_t k, bool ct, float amax, uint8_t *packed,
                      uint8_t *block_scale);
/* MXFP4 of finite rows. */
void quant_mxfp4_rows(const float *w, int64_t rows, int64_t k, uint8_t *packed, uint8_t *scales);
/* int8 per channel of finite rows. */
int quant_int8_rows(const float *w, int64_t row0, int64_t rows, int64_t k, int8_t *q, float *scales);
/* GPTQ int4 of finite rows (row0 and rows multiples of 8): qweight, scales and qzeros are
 * the whole [k/8, n], [k/g, n] and [k/g, n/8] tensors (a row is a column there); the
 * caller fills g_idx. */
int quant_gptq_int4_rows(const float *w, int64_t row0, int64_t rows, int64_t n, int64_t k, int64_t g,
                         bool sym, int32_t *qweight, uint16_t *scales, int32_t *qzeros);
/* pack-quantized int4 of finite rows (row0 and rows multiples of 8): zero_points points at
 * word row0 / 8 * (k / g). */
void quant_ct_int4_rows(const float *w, int64_t rows, int64_t k, int64_t g, bool sym, int32_t *packed,
                        float *scales, int32_t *zero_points);

#endif
