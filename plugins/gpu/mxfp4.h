/*
 * mxfp4.h: private declarations of the MXFP4 GPU path that two backends share:
 * cuda-nvfp4 (its MXFP4 layers, wave 32) and rocm-mxfp4 (wave 64). The
 * layout itself is in mxfp4_layout.h, the kernels in mxfp4_kernel.h; this
 * header is plain C: the host twins of the layout transforms
 * (mxfp4_layout.c), the kernel plan (mxfp4_plan.c), PWAL (mxfp4_pwal.c) and
 * the launchers each vendor implements (plugins/cuda/mxfp4.cu,
 * plugins/rocm/launch.c). Nothing here is exported from a plugin.
 */
#ifndef QKEEP_GPU_MXFP4_H
#define QKEEP_GPU_MXFP4_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mxfp4_layout.h"
#include "scratch.h"
#include "qkeep/qkeep_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- CPU transforms (mxfp4_layout.c), one expert each ----------------------------------------- */

/* Writes the tiled copy of packed e2m1 src [rows, k/2] (k % 32 == 0) for a wave of `wave` lanes
 * (32 or 64) into dst (mxfp4_code_bytes(rows, k) bytes, padding zero). */
void mxfp4_tile_codes(const uint8_t *src, int64_t rows, int64_t k, int wave, uint8_t *dst);
/* The inverse: dst [rows, k/2] from the tiled src. */
void mxfp4_untile_codes(const uint8_t *src, int64_t rows, int64_t k, int wave, uint8_t *dst);
/* Writes the tiled copy of e8m0 scales src [rows, k/32] into dst (mxfp4_scale_bytes(rows, k)
 * bytes, padding zero). */
void mxfp4_tile_scales(const uint8_t *src, int64_t rows, int64_t k, int wave, uint8_t *dst);
/* The inverse: dst [rows, k/32] from the tiled src. */
void mxfp4_untile_scales(const uint8_t *src, int64_t rows, int64_t k, int wave, uint8_t *dst);

/* ---- the GEMM ----------------------------------------------------------------------------------- */

/* One MXFP4 weight set after PWAL: `experts` (1 for a linear layer) matrices [n, k], tiled codes and
 * scales per expert back to back, and an optional bias [experts, n]. */
struct mxfp4_weights {
  const void *codes;  /* experts x mxfp4_code_bytes(n, k) */
  const void *scales; /* experts x mxfp4_scale_bytes(n, k) */
  const void *bias;   /* NULL or [experts, n] */
  enum qkeep_dtype bias_dtype;
  int64_t n, k, experts;
};

/* Most MMA token blocks a launch takes at once (64 tokens on either wave), and the K split's limit. */
#define MXFP4_MAX_TOKENS 64
#define MXFP4_MAX_SPLIT 8

/*
 * How a launch covers an [m, n] x [n, k] product: `tokens` per block (8, 16, 32 or 64 on wave
 * 32; 16, 32 or 64 on wave 64), `stage` chunks of activations staged in shared memory / LDS at
 * a time (8 up to 16 tokens, 4 above: at most 37 KiB of LDS with its padding), `waves` per block,
 * one 16-row tile each, and a K split of `split` blocks (chunks_per_split chunks each, a multiple
 * of `stage`), whose f32 partial sums a second kernel adds in a fixed order.
 * grid: x = tile groups, y = token groups, z = split.
 */
struct mxfp4_plan {
  int tokens, stage, waves, split;
  int64_t chunks_per_split;
  int64_t grid_x, grid_y;
};

/*
 * The plan for m tokens (m >= 1) of an [n, k] matrix on `units` multiprocessors / compute units
 * with waves of `wave` lanes; plain arithmetic, tested in CI. Tokens: the smallest block that
 * holds m, at most 64 (larger m runs in groups of 64). Waves per block: 8 on wave 32, 4 on wave
 * 64 (256 threads either way). Split: enough K splits that the grid covers every unit twice,
 * each split keeping at least two stages, the f32 partial sums (8 m n bytes per split, written
 * and read) within a quarter of the weight bytes, at most MXFP4_MAX_SPLIT; `split_k` > 0 forces
 * it (still capped by the chunks).
 */
void mxfp4_plan_gemm(int64_t m, int64_t n, int64_t k, int wave, int units, int split_k,
                     struct mxfp4_plan *out);

/* Bytes of LDS / shared memory a block of `tokens` tokens and `stage` chunks stages. */
size_t mxfp4_stage_bytes(int tokens, int stage);

/* ---- PWAL (mxfp4_pwal.c), shared by both backends -------------------------------------------------- */

/*
 * What PWAL needs of a backend. tile_gpu (NULL: host only) rewrites `experts` stacked matrices
 * [experts, rows, k/2] codes (scales false) or [experts, rows, k/32] scales (scales true) from
 * device src into the kernel layout at device dst (not overlapping); it returns 0 or a QKEEP_E_*
 * code with the error set. on_host runs the CPU twins instead (device -> host -> device).
 */
struct mxfp4_device {
  const struct qkeep_host *host;
  const struct qkeep_backend *be; /* its memory ops move the bytes */
  const char *backend_name;       /* for messages */
  int wave;                       /* 32 or 64 */
  bool on_host;
  int (*tile_gpu)(void *ctx, bool scales, const void *src, void *dst, int64_t experts, int64_t rows,
                  int64_t k);
  void *ctx;
};

/* What apply needs of an MXFP4 layer: the linear matrix in w[0], or MoE's w13 and w2. */
struct mxfp4_layer {
  bool moe;
  struct mxfp4_weights w[2];
};

/*
 * PWAL of one mxfp4 linear or MoE layer (normalised: {prefix}weight codes, {prefix}weight_scale
 * scales, optional {prefix}bias, prefix "", or "w13_" and "w2_" for MoE): codes and scales are
 * repacked from their checkpoint layout into the kernel's through replace (in their own storage
 * when the layout is no larger; rebound when padding makes it larger), the bias stays as it is.
 * Fills *out with the device pointers PWAL leaves. Refuses a param that is not in its
 * checkpoint layout (QKEEP_E_STATE when already transformed: reload restores the checkpoint
 * bytes before it runs PWAL again). Errors name the layer and tensor.
 */
int mxfp4_pwal(const struct mxfp4_device *d, qkeep_layer *layer, const struct qkeep_layer_info *info,
               struct mxfp4_layer *out);

/* ---- launchers (one per vendor) ------------------------------------------------------------------ */

/*
 * y [m, n] = x [m, k] W_e^T + bias[e] for expert e of wt. x in F32, F16 or BF16 (F32 rounds to
 * bf16; f16 runs f16 MMAs, the others bf16), rows 16-byte aligned; y in F32, F16 or BF16.
 * Accumulates in f32; the sum order is fixed, so equal inputs give equal bits. Runs on `stream`
 * (NULL: the default stream) and does not synchronise. Returns 0 or the vendor's error code.
 * Scratch comes from ws (mxfp4_gemm_workspace bytes; nothing is allocated, so the launch can be
 * captured in a graph); ws NULL: stream-ordered allocation (benchmarks and tools).
 */
int mxfp4_gemm_run(const struct mxfp4_weights *wt, int32_t expert, int64_t m, const void *x,
                   enum qkeep_dtype x_dtype, void *y, enum qkeep_dtype y_dtype, int split_k,
                   struct gpu_scratch *ws, void *stream);
/* The workspace bytes mxfp4_gemm_run takes from ws (the bf16 copy of f32 x, the K-split partials);
 * sms: the multiprocessors (CUs) the launch plans for, 0 for the current device's. */
size_t mxfp4_gemm_workspace(const struct mxfp4_weights *wt, int64_t m, enum qkeep_dtype x_dtype, int split_k,
                            int sms);

/*
 * Routed MoE over all experts of wt, as cuda-nvfp4's nvfp4_moe_run: topk_ids [m, topk] (int32,
 * device) name each token's experts, an id outside [0, experts) skips that slot;
 *   combine false (w13): x [m, k] -> y [m * topk, n], row t * topk + s = x[t] W_{ids[t,s]}^T + bias
 *     (rows of skipped slots are not written);
 *   combine true (w2): x [m * topk, k] -> y [m, n], y[t] = sum_s topk_weights[t, s] * (x[t * topk
 *     + s] W_{ids[t,s]}^T + bias), summed in slot order.
 */
int mxfp4_moe_run(const struct mxfp4_weights *wt, int64_t m, int32_t topk, const int32_t *topk_ids,
                  const float *topk_weights, bool combine, const void *x, enum qkeep_dtype x_dtype, void *y,
                  enum qkeep_dtype y_dtype, struct gpu_scratch *ws, void *stream);
/* The workspace bytes mxfp4_moe_run takes from ws. */
size_t mxfp4_moe_workspace(const struct mxfp4_weights *wt, int64_t m, int32_t topk, bool combine,
                           enum qkeep_dtype x_dtype);

/* The GPU transform of struct mxfp4_device's tile_gpu, for `wave`'s own build (device pointers). */
int mxfp4_tile_gpu_run(bool scales, const void *src, void *dst, int64_t experts, int64_t rows, int64_t k,
                       void *stream);

#ifdef __cplusplus
}
#endif
#endif
