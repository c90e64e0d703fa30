/*
 * cuda_nvfp4.h: private declarations of the cuda-nvfp4 backend, shared by
 * backend.c (C: the table and PWAL), kernels.cu (the kernels and their
 * launchers), layout.c (CPU transforms), the GPU test and the bench. Nothing
 * here is exported from the plugin; the layouts themselves are in layout.h.
 *
 * Launchers return a cudaError_t value as int (0 on success); they run on
 * `stream` (NULL: the legacy default stream) and do not synchronise. Device
 * pointers are the caller's; launchers allocate only stream-ordered scratch,
 * freed on the same stream.
 */
#ifndef QKEEP_CUDA_NVFP4_H
#define QKEEP_CUDA_NVFP4_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../gpu/scratch.h"
#include "qkeep/qkeep_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- CPU transforms (layout.c) ------------------------------------------------------------ */

/* Writes the 128x4-swizzled copy of scales src [rows, cols] into dst
 * (nvfp4_sf_bytes(rows, cols) bytes, padding zero). */
void nvfp4_swizzle_scales(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst);
/* The inverse: dst [rows, cols] from the swizzled src. */
void nvfp4_unswizzle_scales(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst);
/* Writes the fragment-tiled copy of packed e2m1 src [rows, k/2] (k % 16 == 0) into dst
 * (nvfp4_w_bytes(rows, k) bytes, padding zero). */
void nvfp4_tile_weights(const uint8_t *src, int64_t rows, int64_t k, uint8_t *dst);
/* The inverse: dst [rows, k/2] from the tiled src. */
void nvfp4_untile_weights(const uint8_t *src, int64_t rows, int64_t k, uint8_t *dst);

/* ---- GPU transforms (kernels.cu) --------------------------------------------------------- */

/* The GPU twins of nvfp4_tile_weights / nvfp4_swizzle_scales for `experts` stacked
 * matrices ([experts, rows, k/2] -> experts x nvfp4_w_bytes; [experts, rows, cols] ->
 * experts x nvfp4_sf_bytes). src and dst are device memory and must not overlap; the weights'
 * src is 8-byte aligned (else cudaErrorMisalignedAddress), dst 16-byte aligned. */
int nvfp4_tile_weights_gpu(const void *src, void *dst, int64_t experts, int64_t rows, int64_t k,
                           void *stream);
int nvfp4_swizzle_scales_gpu(const void *src, void *dst, int64_t experts, int64_t rows, int64_t cols,
                             void *stream);
/* The same transforms in place, over data [experts, rows, k/2] or [experts, rows, cols] (device
 * memory), for matrices whose kernel layout is exactly as large as the checkpoint's: weights with rows
 * % 16 == 0 and k % 64 == 0, scales with rows % 128 == 0 and cols % 4 == 0. cudaErrorNotSupported
 * (nothing launched) for other shapes, and where a 128-row group is larger than a cluster's shared
 * memory takes (weights with k above about 25,000): then the caller transforms into a new tensor. */
int nvfp4_tile_weights_in_place_gpu(void *data, int64_t experts, int64_t rows, int64_t k, void *stream);
int nvfp4_swizzle_scales_in_place_gpu(void *data, int64_t experts, int64_t rows, int64_t cols, void *stream);
/* alpha[e] = scale[e] for experts merged global scales (f32, device memory); invert: the
 * compressed-tensors encode factor, alpha = 1 / scale (0 when scale is 0). Queued on stream. */
int nvfp4_alpha_gpu(const float *scale, float *alpha, int64_t experts, int invert, void *stream);

/* One piece of a batched device copy: at most NVFP4_COPY_CHUNK bytes (cut so by the caller). */
struct nvfp4_copy_chunk {
  char *dst;
  const char *src;
  uint64_t bytes;
};
#define NVFP4_COPY_CHUNK ((size_t)256 << 10)
/* Copies the n chunks of the table (device memory) on stream, one thread block each; no chunk's
 * dst may overlap another chunk. */
int nvfp4_copy_chunks_gpu(const struct nvfp4_copy_chunk *table, size_t n, void *stream);

/* One piece of a batched byte check (find_bad_values): at most NVFP4_COPY_CHUNK bytes of range `range`. */
struct nvfp4_check_chunk {
  const unsigned char *at;
  uint32_t range;
  uint32_t rule; /* enum qkeep_value_rule */
  uint64_t bytes;
};
/* Checks the n chunks of the table (device memory) on stream, one thread block each: *first_bad (device
 * memory, set to all ones before) becomes the lowest range of a chunk holding a byte its rule refuses. */
int nvfp4_check_chunks_gpu(const struct nvfp4_check_chunk *table, size_t n, unsigned long long *first_bad,
                           void *stream);

/* ---- the W4A16 GEMM ------------------------------------------------------------------------ */

/*
 * One NVFP4 weight set after PWAL: `experts` (1 for a linear layer) matrices of
 * [n, k], tiled weights and swizzled scales back to back per expert, the decode
 * global scale of each expert (alpha), and an optional bias [experts, n].
 */
struct nvfp4_weights {
  const void *w;      /* experts x nvfp4_w_bytes(n, k) */
  const void *sf;     /* experts x nvfp4_sf_bytes(n, k / 16) */
  const float *alpha; /* [experts] f32 */
  const void *bias;   /* NULL or [experts, n] */
  enum qkeep_dtype bias_dtype;
  int64_t n, k, experts;
};

/* Which GEMM kernel: the shared-memory ring (any m, mma.sync), the streaming kernel (m <= 16),
 * or the wgmma kernel (any m; sm_90a, so compute capability 9.0 only). */
enum nvfp4_kernel {
  NVFP4_KERNEL_AUTO = 0,
  NVFP4_KERNEL_RING = 1,
  NVFP4_KERNEL_STREAM = 2,
  NVFP4_KERNEL_WGMMA = 3
};

/*
 * Kernel shape, every field 0 for automatic. The ring kernel: tokens per block (8, 16, 32
 * or 64), the K split across a thread-block cluster (1..8), and the pipeline: 0 (or a
 * small value) keeps 3 stages of 2 chunks in flight for tile_m 8 and 16 and 2 above,
 * depth >= 6 (tile_m <= 16) or >= 4 (above) twice as many. The streaming kernel (auto for
 * m <= 16 unless tile_m is forced above 16): tile_m 8 or 16 follows m, split_k as above,
 * rows 1, 2 or 4 weight tiles of 16 rows per block, unroll 4 or 8 chunks loaded at once,
 * depth 3 (with unroll 4) registers capped for 3 blocks per SM instead of 2.
 * The wgmma kernel (auto for m > 16 on compute capability 9.0): tile_m 8, 16, 32, 64, 128 or 256
 * tokens per block, rows 1 or 2 64-row MMA tiles per consumer warpgroup (128 or 256 weight
 * rows per block; 2 needs tile_m <= 128), split_k as above; depth and unroll unused.
 */
/* How a routed streaming launch finds its token tiles: automatic (each block routes itself up to 32
 * (token, slot) pairs, else a sorting kernel first), always the sorting kernel (moe_align_kernel), or each
 * block itself up to 256 pairs. */
enum nvfp4_route { NVFP4_ROUTE_AUTO = 0, NVFP4_ROUTE_ALIGN = 1, NVFP4_ROUTE_SELF = 2 };

struct nvfp4_tuning {
  int tile_m;
  int split_k;
  int depth;
  int kernel; /* enum nvfp4_kernel */
  int rows;
  int unroll;
  int route; /* enum nvfp4_route */
  int late;  /* 1: the streaming kernel starts after the kernel before it ends (benches: without programmatic
              * dependent launch) */
  int multicast; /* the wgmma kernel: row blocks of a cluster (1, 2 or 4) that share each activation tile,
                  * read once from L2 and multicast into every block's ring (0: automatic) */
  int fp8;       /* 1: FP8 activations (opt-in, approximate): from NVFP4_FP8_MIN_M tokens on the wgmma kernel,
                  * x quantized to e4m3 per token (scale max |x| / 448) and the weights' decoded values
                  * (code x block scale x 2^-7) rounded to e4m3, on the FP8 tensor cores; a plan keeps it only
                  * where it applies (the wgmma kernel, plain or routed MoE: NVFP4_FP8_MIN_M staged rows) */
};

#define NVFP4_FP8_MIN_M 64 /* tokens from which FP8 activations apply (below: the W4A16 kernels) */
/* From this many tokens FP8 takes token tiles of 256 (an H100 at 1024 tokens: 1.06-1.29x tiles of 128;
 * at 256 tokens faster on two shapes of three, slower on the third). */
#define NVFP4_FP8_TILE256_M 512

#define NVFP4_STREAM_WARPS 8 /* warps of a streaming-kernel block */
#define NVFP4_MAX_SPLIT 8    /* blocks of a K-split cluster (the portable cluster size) */

/*
 * The streaming kernel's shape for m (<= 16) tokens of an [n, k] matrix on a GPU of `sms`
 * multiprocessors, honouring the valid fields of `tune` (NULL: all automatic); plain
 * arithmetic, so CI tests it (layout.c). Two blocks fit on an SM; on the H200 the best of
 * every swept shape was one wave of about two blocks per SM, unroll 4 and no K split
 * (docs/PERFORMANCE.md); on an H100 a routed 1-token MoE step (8 experts of 96 tiles) ran
 * fastest with 4 tiles a block and no split, one block per SM. So: 4 tiles per block where
 * that still gives a block per SM, else the most (2, 1) that give 1.5 blocks per SM; unroll 4;
 * a K split only where fewer blocks than SMs are left, as many as bring it to two blocks per
 * SM while each warp keeps two batches of chunks.
 */
void nvfp4_stream_plan(int64_t m, int64_t n, int64_t k, int sms, const struct nvfp4_tuning *tune,
                       struct nvfp4_tuning *out);

#define NVFP4_WGMMA_SPLIT_CHUNKS 8  /* fewest 64-K chunks per split the wgmma plan makes */
#define NVFP4_WGMMA_SPLIT_AUTO 2    /* largest K split the wgmma plan picks by itself */
#define NVFP4_WGMMA_MULTICAST_MAX 4 /* most row blocks sharing an activation tile */

/*
 * The wgmma kernel's shape for m tokens of an [n, k] matrix on `sms` multiprocessors,
 * honouring the valid fields of `tune` (NULL: automatic); plain arithmetic, tested in CI.
 * One block per SM (its ring takes most of shared memory). From the H200 sweep
 * (docs/PERFORMANCE.md): tile_m the smallest of 32, 64, 128 that holds m (128 above),
 * halved where even a split in two would leave fewer than half the SMs a block; rows 1
 * (256-row blocks never won); a K split of sms / blocks, at most 2 (4 and 8 lost to 2 in
 * every shape measured) and at least NVFP4_WGMMA_SPLIT_CHUNKS chunks a split. No cluster of row
 * blocks sharing the activations (multicast 1): on the H200 pairs of them took 1.25-2.0x as long
 * as one block alone, fours 1.6-3.7x, at every m from 32 to 1024 (docs/PERFORMANCE.md). A forced
 * multicast is honoured where there is no K split (else 1); the grid then rounds the row blocks
 * up to whole clusters.
 */
void nvfp4_wgmma_plan(int64_t m, int64_t n, int64_t k, int sms, const struct nvfp4_tuning *tune,
                      struct nvfp4_tuning *out);

#define NVFP4_MOE_STREAM_MAX 16 /* most tokens per routed expert the MoE plan gives the streaming kernel */

/*
 * The kernel and shape of a routed MoE GEMM (nvfp4_moe_run) over `pairs` (token, slot)
 * pairs and `experts` experts of [n, k] matrices on `sms` multiprocessors; `wgmma`: the
 * wgmma kernel can run (compute capability 9.0). Plain arithmetic, tested in CI. The pairs
 * are sorted by expert and cut into token tiles of tile_m pairs of one expert; the host
 * does not know how many experts are hit, so the plan takes the tokens per expert as
 * pairs / min(pairs, experts) (all hit, evenly) and as many tiles as that gives. Auto:
 * the streaming kernel (tile_m 8 or 16) up to NVFP4_MOE_STREAM_MAX tokens per expert,
 * each block reading one expert's rows once for its tile's tokens; above, the wgmma kernel
 * (tile_m 16, 32, 64 or 128 holding the tokens per expert) where `wgmma`, else the ring
 * kernel (tile_m 8..64; split_k 0: nvfp4_moe_run sizes it from occupancy). Rows and the K
 * split follow nvfp4_stream_plan / nvfp4_wgmma_plan on the blocks of all those tiles. A
 * forced kernel (tune->kernel) is honoured at any size (wgmma only where `wgmma`), and so
 * are its valid shape fields; the streaming kernel's tile_m is at most 16.
 */
void nvfp4_moe_plan(int64_t pairs, int64_t experts, int64_t n, int64_t k, int sms, bool wgmma,
                    const struct nvfp4_tuning *tune, struct nvfp4_tuning *out);

/* The shape nvfp4_gemm_run uses for m tokens of an [n, k] matrix with x_dtype activations
 * (`tune` may be NULL). */
void nvfp4_gemm_plan(int64_t m, int64_t n, int64_t k, enum qkeep_dtype x_dtype,
                     const struct nvfp4_tuning *tune, struct nvfp4_tuning *out);

/*
 * y [m, n] = (x [m, k] W_e^T) * alpha[e] + bias[e] for expert e of wt (0 for a linear
 * layer). x in F32, F16 or BF16 (F32 is rounded to bf16 for the tensor cores; f16 runs
 * f16 MMAs, the others bf16), 16-byte aligned; y in F32, F16 or BF16. Accumulates in f32.
 * Scratch comes from ws (nvfp4_gemm_workspace bytes; the launch then allocates nothing and can
 * be captured in a graph); ws NULL: stream-ordered allocation (benchmarks and tools).
 */
int nvfp4_gemm_run(const struct nvfp4_weights *wt, int32_t expert, int64_t m, const void *x,
                   enum qkeep_dtype x_dtype, void *y, enum qkeep_dtype y_dtype,
                   const struct nvfp4_tuning *tune, struct gpu_scratch *ws, void *stream);
/* The workspace bytes nvfp4_gemm_run takes from ws for these arguments (0: none). */
size_t nvfp4_gemm_workspace(const struct nvfp4_weights *wt, int64_t m, enum qkeep_dtype x_dtype,
                            const struct nvfp4_tuning *tune);

/*
 * Routed MoE GEMM over all experts of wt at once, on the kernel nvfp4_moe_plan picks (its
 * tile count is read on the device: the host never waits). topk_ids [m, topk] (int32,
 * device) name each token's experts; an id outside [0, experts) skips that slot.
 *   combine false (w13): x [m, k] -> y [m * topk, n], row t * topk + s = x[t] W_{ids[t,s]}^T
 *     * alpha + bias (rows of skipped slots are not written);
 *   combine true (w2): x [m * topk, k] -> y [m, n], y[t] = sum_s topk_weights[t, s] *
 *     (x[t * topk + s] W_{ids[t,s]}^T * alpha + bias), summed in a fixed order.
 * Needs experts <= 2048.
 */
int nvfp4_moe_run(const struct nvfp4_weights *wt, int64_t m, int32_t topk, const int32_t *topk_ids,
                  const float *topk_weights, bool combine, const void *x, enum qkeep_dtype x_dtype, void *y,
                  enum qkeep_dtype y_dtype, const struct nvfp4_tuning *tune, struct gpu_scratch *ws,
                  void *stream);
/* The workspace bytes nvfp4_moe_run takes from ws for these arguments. */
size_t nvfp4_moe_workspace(const struct nvfp4_weights *wt, int64_t m, int32_t topk, bool combine,
                           enum qkeep_dtype x_dtype, const struct nvfp4_tuning *tune);

/*
 * MXFP4 on the wgmma kernel (kernels.cu): the tiled MXFP4 codes (wave 32) and e8m0 scales
 * (plugins/gpu/mxfp4_layout.h) read as they are, each k-step's A fragment a lane's code word with the
 * scale of its rows folded in exactly (layout.h, mxfp4_wg_scale), bf16 MMAs. mxfp4_wgmma_applies:
 * whether mxfp4_gemm_run takes it (compute capability 9.0, MXFP4_WGMMA_MIN_M tokens or more, bf16 or
 * f32 activations, no forced K split); mxfp4_wgmma_workspace its scratch bytes; mxfp4_wgmma_run the
 * plain (not routed) GEMM of expert `expert`, arguments as mxfp4_gemm_run's.
 */
#define MXFP4_WGMMA_MIN_M 32
/* With kernel = auto, plain MXFP4 GEMMs take the wgmma kernel from this many tokens (measured on an
 * H100: 1.08-1.25x the mma.sync kernel at 64 tokens and 1.9-2.2x at 256, but 0.5-0.75x at 32);
 * kernel = wgmma takes it from MXFP4_WGMMA_MIN_M, and routed MoE only then. */
#define MXFP4_WGMMA_AUTO_M 64
struct mxfp4_weights;
bool mxfp4_wgmma_applies(int64_t m, enum qkeep_dtype x_dtype, int split_k);
size_t mxfp4_wgmma_workspace(const struct mxfp4_weights *wt, int64_t m);
int mxfp4_wgmma_run(const struct mxfp4_weights *wt, int32_t expert, int64_t m, const void *x,
                    enum qkeep_dtype x_dtype, void *y, enum qkeep_dtype y_dtype, struct gpu_scratch *ws,
                    void *stream);
/* Routed MoE on the same kernel (arguments as mxfp4_moe_run's; bf16 or f32 activations, compute capability
 * 9.0: mxfp4_wgmma_moe_applies), the tiles and the combine as nvfp4_moe_run has them. */
bool mxfp4_wgmma_moe_applies(int64_t m, int32_t topk, enum qkeep_dtype x_dtype);
size_t mxfp4_wgmma_moe_workspace(const struct mxfp4_weights *wt, int64_t m, int32_t topk, bool combine);
int mxfp4_wgmma_moe_run(const struct mxfp4_weights *wt, int64_t m, int32_t topk, const int32_t *topk_ids,
                        const float *topk_weights, bool combine, const void *x, enum qkeep_dtype x_dtype,
                        void *y, enum qkeep_dtype y_dtype, struct gpu_scratch *ws, void *stream);

/* y [m, n] = x [m, k] W^T + bias for an unquantized weight W [n, k] (F32, F16 or BF16);
 * a plain CUDA-core kernel, correct for any shape, not tuned. */
int dense_gemm_run(const void *w, enum qkeep_dtype w_dtype, const void *bias, enum qkeep_dtype bias_dtype,
                   int64_t n, int64_t k, int64_t m, const void *x, enum qkeep_dtype x_dtype, void *y,
                   enum qkeep_dtype y_dtype, void *stream);

/* ---- online quantization (quantize.cu): the quantize slot's kernels ------------------------------ */

enum fp4_quant_scheme { FP4_QUANT_MODELOPT_NVFP4 = 0, FP4_QUANT_CT_NVFP4 = 1, FP4_QUANT_MXFP4 = 2 };

/* One matrix to quantize: src [n, k] of dtype (F32, F16, BF16; device memory aligned to the element),
 * codes n * k / 2 bytes and scales n * k / 16 (NVFP4) or n * k / 32 (MXFP4) bytes of device memory. */
struct fp4_quant_member {
  const void *src;
  enum qkeep_dtype dtype;
  int64_t n, k;
  void *codes, *scales;
};

/* What the scan finds (device memory the caller sets before the scan: max_bits 0, first_bad all ones).
 * max_bits: the f32 bits of max |x| over the finite values; first_bad: the row-major index of the first
 * NaN or Inf (all ones: none). */
struct fp4_quant_scan {
  uint32_t max_bits;
  uint32_t unused;
  unsigned long long first_bad;
};

/* Queues the scan of m's values into scratch (a struct fp4_quant_scan, set as said above). */
int fp4_quant_scan_gpu(const struct fp4_quant_member *m, void *scratch, void *stream);
/* Queues the quantization of m's finite values, given the amax of m's whole unit (NVFP4: the fusion
 * group's; the global scales are divided on the host as libqkeep/quantize does it): codes and scales
 * get the host quantizer's bytes. */
int fp4_quant_gpu(const struct fp4_quant_member *m, enum fp4_quant_scheme scheme, float amax, void *stream);

#ifdef __cplusplus
}
#endif
#endif
