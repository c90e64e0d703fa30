/*
 * mxfp4.cu: the CUDA build of the shared MXFP4 kernels (plugins/gpu/mxfp4_kernel.h,
 * wave 32, mma.sync) and their launchers, cuda-nvfp4's path for `mxfp4` layers.
 * Launchers allocate only stream-ordered scratch (bf16 activations from f32, K-split
 * partial sums, the routed W2 slots), freed on the same stream.
 */
#include <cuda_runtime.h>

#include "mxfp4.h"
#include "mxfp4_kernel.h"

MXFP4_GEMM_KERNELS(8, 1, 8)
MXFP4_GEMM_KERNELS(16, 2, 8)
MXFP4_GEMM_KERNELS(32, 4, 4)
MXFP4_GEMM_KERNELS(64, 8, 4)
MXFP4_OTHER_KERNELS

namespace {

typedef void (*gemm_kernel)(const mxfp4_gemm_args);

gemm_kernel pick(int tokens, bool f16) {
  switch (tokens) {
  case 8: return f16 ? mxfp4_k_gemm_f16_t8 : mxfp4_k_gemm_bf16_t8;
  case 16: return f16 ? mxfp4_k_gemm_f16_t16 : mxfp4_k_gemm_bf16_t16;
  case 32: return f16 ? mxfp4_k_gemm_f16_t32 : mxfp4_k_gemm_bf16_t32;
  default: return f16 ? mxfp4_k_gemm_f16_t64 : mxfp4_k_gemm_bf16_t64;
  }
}

/* Multiprocessors of the current device (looked up each call: cheap, and right after a device switch). */
int sm_count() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev))
    return 132;
  return sms;
}

bool float_dtype(enum qkeep_dtype d) {
  return d == QKEEP_DTYPE_F32 || d == QKEEP_DTYPE_F16 || d == QKEEP_DTYPE_BF16;
}

unsigned flat_blocks(int64_t total) {
  int64_t b = (total + MXFP4_THREADS - 1) / MXFP4_THREADS;
  return (unsigned)(b < 1 ? 1 : b > 8192 ? 8192 : b);
}

/* n bytes of scratch: from the caller's workspace, or (ws NULL) stream-ordered, *owned set. */
cudaError_t scratch(struct gpu_scratch *ws, size_t n, cudaStream_t s, void **out, bool *owned) {
  *owned = ws == nullptr;
  if (ws) {
    *out = gpu_scratch_take(ws, n);
    return *out ? cudaSuccess : cudaErrorMemoryAllocation;
  }
  return cudaMallocAsync(out, n, s);
}

void scratch_done(void *p, bool owned, cudaStream_t s) {
  if (p && owned)
    (void)cudaFreeAsync(p, s);
}

size_t x16_bytes(enum qkeep_dtype dtype, int64_t elems) {
  return dtype == QKEEP_DTYPE_F32 ? gpu_scratch_round((size_t)elems * 2 + 16) : 0;
}

/* x as 16-bit activations: itself, or a bf16 copy of f32 in scratch (*scratch_out, *owned as scratch()). */
cudaError_t activations(const void *x, enum qkeep_dtype dtype, int64_t elems, struct gpu_scratch *ws,
                        cudaStream_t s, const uint16_t **out, void **scratch_out, bool *owned) {
  *scratch_out = nullptr;
  *owned = false;
  if (dtype != QKEEP_DTYPE_F32) {
    *out = static_cast<const uint16_t *>(x);
    return cudaSuccess;
  }
  cudaError_t err = scratch(ws, (size_t)elems * 2 + 16, s, scratch_out, owned);
  if (err != cudaSuccess)
    return err;
  mxfp4_convert_args c = {static_cast<const float *>(x), static_cast<uint16_t *>(*scratch_out), elems};
  mxfp4_k_convert<<<flat_blocks(elems), MXFP4_THREADS, 0, s>>>(c);
  *out = static_cast<const uint16_t *>(*scratch_out);
  return cudaGetLastError();
}

mxfp4_gemm_args base_args(const mxfp4_weights *wt, const uint16_t *x, void *y, enum qkeep_dtype y_dtype) {
  mxfp4_gemm_args a = {};
  a.codes = static_cast<const uint8_t *>(wt->codes);
  a.scales = static_cast<const uint8_t *>(wt->scales);
  a.bias = wt->bias;
  a.bias_dtype = wt->bias ? (int32_t)wt->bias_dtype : -1;
  a.x = x;
  a.y = y;
  a.y_dtype = (int32_t)y_dtype;
  a.n = wt->n, a.k = wt->k, a.ldx = wt->k;
  a.tiles = mxfp4_tiles(wt->n), a.chunks = mxfp4_chunks(wt->k);
  a.expert_code_bytes = mxfp4_code_bytes(wt->n, wt->k);
  a.expert_scale_bytes = mxfp4_scale_bytes(wt->n, wt->k);
  a.experts = (int32_t)wt->experts;
  a.x_div = 1;
  return a;
}

} // namespace

extern "C" int mxfp4_gemm_run(const struct mxfp4_weights *wt, int32_t expert, int64_t m, const void *x,
                              enum qkeep_dtype x_dtype, void *y, enum qkeep_dtype y_dtype, int split_k,
                              struct gpu_scratch *ws, void *stream) {
  if (!float_dtype(x_dtype) || !float_dtype(y_dtype) || ((uintptr_t)x & 15) || expert < 0 ||
      expert >= wt->experts || m < 0)
    return cudaErrorInvalidValue;
  if (m == 0)
    return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  mxfp4_plan plan;
  mxfp4_plan_gemm(m, wt->n, wt->k, 32, sm_count(), split_k, &plan);
  if (plan.grid_y > 65535)
    return cudaErrorInvalidValue;
  const uint16_t *x16;
  void *x_scratch, *partial = nullptr;
  bool x_owned, partial_owned = false;
  cudaError_t err = activations(x, x_dtype, m * wt->k, ws, s, &x16, &x_scratch, &x_owned);
  mxfp4_gemm_args a = base_args(wt, x16, y, y_dtype);
  a.m = m, a.expert = expert, a.chunks_per_split = plan.chunks_per_split, a.out_rows = m;
  if (err == cudaSuccess && plan.split > 1) {
    err = scratch(ws, sizeof(float) * (size_t)(plan.split * m * wt->n), s, &partial, &partial_owned);
    a.partial = static_cast<float *>(partial);
  }
  if (err == cudaSuccess) {
    pick(plan.tokens, x_dtype == QKEEP_DTYPE_F16)<<<
        dim3((unsigned)plan.grid_x, (unsigned)plan.grid_y, (unsigned)plan.split), MXFP4_THREADS, 0, s>>>(a);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess && partial) {
    mxfp4_reduce_args r = {static_cast<const float *>(partial),
                           wt->bias,
                           y,
                           m,
                           wt->n,
                           plan.split,
                           a.bias_dtype,
                           (int32_t)y_dtype,
                           expert};
    mxfp4_k_reduce<<<flat_blocks(m * wt->n), MXFP4_THREADS, 0, s>>>(r);
    err = cudaGetLastError();
  }
  scratch_done(partial, partial_owned, s);
  scratch_done(x_scratch, x_owned, s);
  return err;
}

extern "C" int mxfp4_moe_run(const struct mxfp4_weights *wt, int64_t m, int32_t topk, const int32_t *topk_ids,
                             const float *topk_weights, bool combine, const void *x, enum qkeep_dtype x_dtype,
                             void *y, enum qkeep_dtype y_dtype, struct gpu_scratch *ws, void *stream) {
  const int64_t slots = m * topk;
  if (!float_dtype(x_dtype) || !float_dtype(y_dtype) || ((uintptr_t)x & 15) || topk < 1 || !topk_ids ||
      (combine && !topk_weights) || m < 0 || slots > 65535)
    return cudaErrorInvalidValue;
  if (m == 0)
    return cudaSuccess;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uint16_t *x16;
  void *x_scratch, *partial = nullptr;
  bool x_owned, partial_owned = false;
  cudaError_t err = activations(x, x_dtype, (combine ? slots : m) * wt->k, ws, s, &x16, &x_scratch, &x_owned);
  mxfp4_gemm_args a = base_args(wt, x16, y, y_dtype);
  a.m = slots, a.ids = topk_ids, a.x_div = combine ? 1 : topk, a.out_rows = slots;
  a.chunks_per_split = mxfp4_round_up(a.chunks, 8);
  if (err == cudaSuccess && combine) {
    err = scratch(ws, sizeof(float) * (size_t)(slots * wt->n), s, &partial, &partial_owned);
    a.partial = static_cast<float *>(partial);
  }
  if (err == cudaSuccess) {
    dim3 grid((unsigned)((a.tiles + MX_WAVES - 1) / MX_WAVES), (unsigned)slots, 1);
    pick(8, x_dtype == QKEEP_DTYPE_F16)<<<grid, MXFP4_THREADS, 0, s>>>(a);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess && combine) {
    mxfp4_combine_args c = {static_cast<const float *>(partial),
                            wt->bias,
                            topk_ids,
                            topk_weights,
                            y,
                            m,
                            wt->n,
                            topk,
                            (int32_t)wt->experts,
                            a.bias_dtype,
                            (int32_t)y_dtype};
    mxfp4_k_combine<<<flat_blocks(m * wt->n), MXFP4_THREADS, 0, s>>>(c);
    err = cudaGetLastError();
  }
  scratch_done(partial, partial_owned, s);
  scratch_done(x_scratch, x_owned, s);
  return err;
}

extern "C" size_t mxfp4_gemm_workspace(const struct mxfp4_weights *wt, int64_t m, enum qkeep_dtype x_dtype,
                                       int split_k, int sms) {
  if (m <= 0)
    return 0;
  mxfp4_plan plan;
  mxfp4_plan_gemm(m, wt->n, wt->k, 32, sms > 0 ? sms : sm_count(), split_k, &plan);
  size_t partial = plan.split > 1 ? gpu_scratch_round(sizeof(float) * (size_t)(plan.split * m * wt->n)) : 0;
  return x16_bytes(x_dtype, m * wt->k) + partial;
}

extern "C" size_t mxfp4_moe_workspace(const struct mxfp4_weights *wt, int64_t m, int32_t topk, bool combine,
                                      enum qkeep_dtype x_dtype) {
  if (m <= 0 || topk < 1)
    return 0;
  const int64_t slots = m * topk;
  return x16_bytes(x_dtype, (combine ? slots : m) * wt->k) +
         (combine ? gpu_scratch_round(sizeof(float) * (size_t)(slots * wt->n)) : 0);
}

extern "C" int mxfp4_tile_gpu_run(bool scales, const void *src, void *dst, int64_t experts, int64_t rows,
                                  int64_t k, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  mxfp4_tile_args t = {static_cast<const uint8_t *>(src), static_cast<uint8_t *>(dst), experts, rows, k};
  if (scales)
    mxfp4_k_tile_scales<<<flat_blocks(experts * mxfp4_scale_bytes(rows, k)), MXFP4_THREADS, 0, s>>>(t);
  else
    mxfp4_k_tile_codes<<<flat_blocks(experts * mxfp4_code_bytes(rows, k) / 4), MXFP4_THREADS, 0, s>>>(t);
  return cudaGetLastError();
}
