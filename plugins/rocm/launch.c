/*
 * launch.c: the launchers of mxfp4.h for the HIP build: the same plan, arguments and
 * kernel sequence as the CUDA build (plugins/cuda/mxfp4.cu), through
 * hipModuleLaunchKernel on the kernels of the current device's code object
 * (rocm_current_kernels). Scratch (bf16 activations from f32, K-split partial sums,
 * routed W2 slots) is stream-ordered where the runtime has hipMallocAsync (ROCm 5.1
 * and later), else allocated, and freed after the stream drains.
 */
#include <stdint.h>
#include <string.h>

#include "mxfp4.h"
#include "mxfp4_args.h"
#include "rocm.h"

static const struct hip_api *hip(void) {
  const char *why;
  return rocm_hip(&why);
}

static bool float_dtype(enum qkeep_dtype d) {
  return d == QKEEP_DTYPE_F32 || d == QKEEP_DTYPE_F16 || d == QKEEP_DTYPE_BF16;
}

static unsigned flat_blocks(int64_t total) {
  int64_t b = (total + MXFP4_THREADS - 1) / MXFP4_THREADS;
  return (unsigned)(b < 1 ? 1 : b > 8192 ? 8192 : b);
}

static hipError_t launch(hipFunction_t f, unsigned gx, unsigned gy, unsigned gz, void *args, hipStream_t s) {
  void *params[] = {args};
  return hip()->ModuleLaunchKernel(f, gx, gy, gz, MXFP4_THREADS, 1, 1, 0, s, params, NULL);
}

/* Scratch of `bytes` on stream s, and its release (after the work queued on s). */
static hipError_t scratch_alloc(void **p, size_t bytes, hipStream_t s) {
  return hip()->MallocAsync ? hip()->MallocAsync(p, bytes, s) : hip()->Malloc(p, bytes);
}

static void scratch_free(void *p, hipStream_t s) {
  if (!p)
    return;
  if (hip()->FreeAsync) {
    (void)hip()->FreeAsync(p, s);
  } else {
    (void)hip()->StreamSynchronize(s);
    (void)hip()->Free(p);
  }
}

/* n bytes of scratch: from the caller's workspace (ws set: never allocates), else stream-ordered. */
static hipError_t scratch_get(struct gpu_scratch *ws, void **out, size_t n, hipStream_t s) {
  if (!ws)
    return scratch_alloc(out, n, s);
  *out = gpu_scratch_take(ws, n);
  return *out ? hipSuccess : hipErrorOutOfMemory;
}

static void scratch_put(struct gpu_scratch *ws, void *p, hipStream_t s) {
  if (!ws)
    scratch_free(p, s);
}

static size_t x16_bytes(enum qkeep_dtype dtype, int64_t elems) {
  return dtype == QKEEP_DTYPE_F32 ? gpu_scratch_round((size_t)elems * 2 + 16) : 0;
}

static hipError_t activations(const struct rocm_kernels *k, const void *x, enum qkeep_dtype dtype,
                              int64_t elems, struct gpu_scratch *ws, hipStream_t s, const uint16_t **out,
                              void **scratch) {
  *scratch = NULL;
  if (dtype != QKEEP_DTYPE_F32) {
    *out = x;
    return hipSuccess;
  }
  hipError_t err = scratch_get(ws, scratch, (size_t)elems * 2 + 16, s);
  if (err != hipSuccess)
    return err;
  struct mxfp4_convert_args c = {x, *scratch, elems};
  *out = *scratch;
  return launch(k->convert, flat_blocks(elems), 1, 1, &c, s);
}

static struct mxfp4_gemm_args base_args(const struct mxfp4_weights *wt, const uint16_t *x, void *y,
                                        enum qkeep_dtype y_dtype) {
  struct mxfp4_gemm_args a;
  memset(&a, 0, sizeof a);
  a.codes = wt->codes, a.scales = wt->scales, a.bias = wt->bias;
  a.bias_dtype = wt->bias ? (int32_t)wt->bias_dtype : -1;
  a.x = x, a.y = y, a.y_dtype = (int32_t)y_dtype;
  a.n = wt->n, a.k = wt->k, a.ldx = wt->k;
  a.tiles = mxfp4_tiles(wt->n), a.chunks = mxfp4_chunks(wt->k);
  a.expert_code_bytes = mxfp4_code_bytes(wt->n, wt->k);
  a.expert_scale_bytes = mxfp4_scale_bytes(wt->n, wt->k);
  a.experts = (int32_t)wt->experts;
  a.x_div = 1;
  return a;
}

static int size_index(int tokens) { return tokens <= 16 ? 0 : tokens <= 32 ? 1 : 2; }

int mxfp4_gemm_run(const struct mxfp4_weights *wt, int32_t expert, int64_t m, const void *x,
                   enum qkeep_dtype x_dtype, void *y, enum qkeep_dtype y_dtype, int split_k,
                   struct gpu_scratch *ws, void *stream) {
  const struct rocm_kernels *k = rocm_current_kernels();
  if (!k || !float_dtype(x_dtype) || !float_dtype(y_dtype) || ((uintptr_t)x & 15) || expert < 0 ||
      expert >= wt->experts || m < 0)
    return hipErrorInvalidValue;
  if (m == 0)
    return hipSuccess;
  hipStream_t s = stream;
  struct mxfp4_plan plan;
  mxfp4_plan_gemm(m, wt->n, wt->k, 64, k->compute_units, split_k, &plan);
  if (plan.grid_y > 65535)
    return hipErrorInvalidValue;
  const uint16_t *x16 = NULL;
  void *x_scratch, *partial = NULL;
  hipError_t err = activations(k, x, x_dtype, m * wt->k, ws, s, &x16, &x_scratch);
  struct mxfp4_gemm_args a = base_args(wt, x16, y, y_dtype);
  a.m = m, a.expert = expert, a.chunks_per_split = plan.chunks_per_split, a.out_rows = m;
  if (err == hipSuccess && plan.split > 1) {
    err = scratch_get(ws, &partial, sizeof(float) * (size_t)(plan.split * m * wt->n), s);
    a.partial = partial;
  }
  if (err == hipSuccess)
    err = launch(k->gemm[x_dtype == QKEEP_DTYPE_F16][size_index(plan.tokens)], (unsigned)plan.grid_x,
                 (unsigned)plan.grid_y, (unsigned)plan.split, &a, s);
  if (err == hipSuccess && partial) {
    struct mxfp4_reduce_args r = {partial,      wt->bias,         y,     m, wt->n, plan.split,
                                  a.bias_dtype, (int32_t)y_dtype, expert};
    err = launch(k->reduce, flat_blocks(m * wt->n), 1, 1, &r, s);
  }
  scratch_put(ws, partial, s);
  scratch_put(ws, x_scratch, s);
  return err;
}

int mxfp4_moe_run(const struct mxfp4_weights *wt, int64_t m, int32_t topk, const int32_t *topk_ids,
                  const float *topk_weights, bool combine, const void *x, enum qkeep_dtype x_dtype, void *y,
                  enum qkeep_dtype y_dtype, struct gpu_scratch *ws, void *stream) {
  const struct rocm_kernels *k = rocm_current_kernels();
  const int64_t slots = m * topk;
  if (!k || !float_dtype(x_dtype) || !float_dtype(y_dtype) || ((uintptr_t)x & 15) || topk < 1 || !topk_ids ||
      (combine && !topk_weights) || m < 0 || slots > 65535)
    return hipErrorInvalidValue;
  if (m == 0)
    return hipSuccess;
  hipStream_t s = stream;
  const uint16_t *x16 = NULL;
  void *x_scratch, *partial = NULL;
  hipError_t err = activations(k, x, x_dtype, (combine ? slots : m) * wt->k, ws, s, &x16, &x_scratch);
  struct mxfp4_gemm_args a = base_args(wt, x16, y, y_dtype);
  a.m = slots, a.ids = topk_ids, a.x_div = combine ? 1 : topk, a.out_rows = slots;
  a.chunks_per_split = mxfp4_round_up(a.chunks, 8); /* one split: the 16-token kernel's stage is 8 */
  if (err == hipSuccess && combine) {
    err = scratch_get(ws, &partial, sizeof(float) * (size_t)(slots * wt->n), s);
    a.partial = partial;
  }
  if (err == hipSuccess)
    err = launch(k->gemm[x_dtype == QKEEP_DTYPE_F16][0], (unsigned)((a.tiles + 3) / 4), (unsigned)slots, 1,
                 &a, s);
  if (err == hipSuccess && combine) {
    struct mxfp4_combine_args c = {
        partial,      wt->bias,        topk_ids, topk_weights, y, m, wt->n, topk, (int32_t)wt->experts,
        a.bias_dtype, (int32_t)y_dtype};
    err = launch(k->combine, flat_blocks(m * wt->n), 1, 1, &c, s);
  }
  scratch_put(ws, partial, s);
  scratch_put(ws, x_scratch, s);
  return err;
}

int mxfp4_tile_gpu_run(bool scales, const void *src, void *dst, int64_t experts, int64_t rows, int64_t k,
                       void *stream) {
  const struct rocm_kernels *kn = rocm_current_kernels();
  if (!kn)
    return hipErrorInvalidValue;
  struct mxfp4_tile_args t = {src, dst, experts, rows, k};
  int64_t total = experts * (scales ? mxfp4_scale_bytes(rows, k) : mxfp4_code_bytes(rows, k) / 4);
  return launch(scales ? kn->tile_scales : kn->tile_codes, flat_blocks(total), 1, 1, &t, stream);
}

size_t mxfp4_gemm_workspace(const struct mxfp4_weights *wt, int64_t m, enum qkeep_dtype x_dtype, int split_k,
                            int sms) {
  const struct rocm_kernels *k = rocm_current_kernels();
  if (m <= 0)
    return 0;
  struct mxfp4_plan plan;
  mxfp4_plan_gemm(m, wt->n, wt->k, 64, sms > 0 ? sms : k ? k->compute_units : 304, split_k, &plan);
  size_t partial = plan.split > 1 ? gpu_scratch_round(sizeof(float) * (size_t)(plan.split * m * wt->n)) : 0;
  return x16_bytes(x_dtype, m * wt->k) + partial;
}

size_t mxfp4_moe_workspace(const struct mxfp4_weights *wt, int64_t m, int32_t topk, bool combine,
                           enum qkeep_dtype x_dtype) {
  if (m <= 0 || topk < 1)
    return 0;
  const int64_t slots = m * topk;
  return x16_bytes(x_dtype, (combine ? slots : m) * wt->k) +
         (combine ? gpu_scratch_round(sizeof(float) * (size_t)(slots * wt->n)) : 0);
}
