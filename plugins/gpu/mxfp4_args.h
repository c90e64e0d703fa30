/*
 * mxfp4_args.h: the argument blocks of the MXFP4 kernels (mxfp4_kernel.h),
 * passed by value. Plain C with fixed-width fields only, so that the C
 * launcher of the HIP build (plugins/rocm/launch.c, through
 * hipModuleLaunchKernel) and the device code agree on the layout.
 * Dtypes are enum qkeep_dtype values (0 F32, 1 F16, 2 BF16); -1 means none.
 */
#ifndef QKEEP_GPU_MXFP4_ARGS_H
#define QKEEP_GPU_MXFP4_ARGS_H

#include <stdint.h>

/* Activation row padding in the staged copy (elements): keeps the rows 64 bytes off the banks. */
#define MXFP4_X_PAD 32
/* Threads of every MXFP4 kernel block. */
#define MXFP4_THREADS 256

/*
 * The GEMM. Plain: block y covers tokens [y * tokens, ...) of x rows 0..m-1, expert `expert`.
 * Routed (ids non-NULL): block y is slot y of [m_slots], expert ids[y] (a block whose id is out of
 * [0, experts) returns at once), one token, x row y / x_div. Output row o (the token, or the slot):
 * partial NULL: y[o, row] = acc + bias (y_dtype); else partial[(z * out_rows + o) * n + row] = acc.
 */
struct mxfp4_gemm_args {
  const uint8_t *codes, *scales;
  const void *bias;
  const uint16_t *x; /* bf16 or f16 bits, rows of ldx elements */
  void *y;
  float *partial;
  const int32_t *ids;
  int64_t n, k, m, ldx, tiles, chunks, chunks_per_split, out_rows;
  int64_t expert_code_bytes, expert_scale_bytes;
  int32_t bias_dtype, y_dtype, expert, experts, x_div, pad_;
};

/* The K-split sum: y[o, r] = sum_z partial[z, o, r] + bias[expert, r], o < rows. */
struct mxfp4_reduce_args {
  const float *partial;
  const void *bias;
  void *y;
  int64_t rows, n;
  int32_t split, bias_dtype, y_dtype, expert;
};

/* The routed W2 combine: y[t, r] = sum_s w[t, s] (partial[t * topk + s, r] + bias[ids[t, s], r])
 * over the slots whose id is in [0, experts), t < m. */
struct mxfp4_combine_args {
  const float *partial;
  const void *bias;
  const int32_t *ids;
  const float *weights;
  void *y;
  int64_t m, n;
  int32_t topk, experts, bias_dtype, y_dtype;
};

/* x (F32) -> bf16 bits, n elements. */
struct mxfp4_convert_args {
  const float *src;
  uint16_t *dst;
  int64_t n;
};

/* The layout transforms: `experts` stacked [rows, k/2] codes or [rows, k/32] scales -> tiled. */
struct mxfp4_tile_args {
  const uint8_t *src;
  uint8_t *dst;
  int64_t experts, rows, k;
};

#endif
