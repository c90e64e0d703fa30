/*
 * bench_mxfp4.cu: the shared MXFP4 W4A16 GEMM (plugins/gpu/mxfp4_kernel.h, its CUDA
 * build) against cuBLAS bf16 on the same layer (the MXFP4 weights dequantised to
 * bf16), and the bandwidth ceiling, in one process. One JSON object per line
 * (docs/PERFORMANCE.md, "Method"):
 *
 *   {"bench":"d2d_copy", ...}                          the ceiling's bandwidth
 *   {"bench":"mxfp4_w4a16","M":..,"N":..,"K":..,"qkeep_us":..,"peer":"cublas_bf16",
 *    "peer_us":..,"ratio":..,"ceiling_us":..,"of_ceiling":.., ...}
 *   {"bench":"mxfp4_sweep", ...}                       with QKEEP_BENCH_SWEEP=1: every K split
 *
 * Timing: a CUDA graph of back-to-back launches that cycle through enough copies
 * of the weights (>= 512 MiB) to keep them out of the 50 MB L2, between two events;
 * the median of 7 runs after a warm-up, qkeep and cuBLAS interleaved three times.
 * The ceiling is the bytes the kernel must read (codes + e8m0 scales) over the
 * measured device-to-device copy bandwidth (read + write). Before timing, each shape's
 * output is compared with cuBLAS's (max_rel_err: bf16 rounding of both outputs).
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "cuda_nvfp4.h"
#include "gpu_benchutil.h"
#include "mxfp4.h"

namespace {

/* The checkpoint-layout weight as bf16 [n, k] for cuBLAS (exact: every MXFP4 value is a bf16). */
__global__ void dequant_kernel(const uint8_t *codes, const uint8_t *scales, __nv_bfloat16 *w, int64_t n,
                               int64_t k) {
  const float e2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * k;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = i / k, c = i % k;
    uint8_t b = codes[r * (k / 2) + c / 2], code = (c & 1) ? b >> 4 : b & 0xf;
    w[i] = __float2bfloat16(e2m1[code] * ldexpf(1.0f, (int)scales[r * (k / 32) + c / 32] - 127));
  }
}

struct Layer {
  int64_t n, k;
  int copies_q, copies_b;
  std::vector<mxfp4_weights> q;      /* tiled copies */
  std::vector<__nv_bfloat16 *> bf16; /* dequantised copies for cuBLAS */
  std::vector<void *> allocations;
};

Layer make_layer(int64_t n, int64_t k, cudaStream_t stream) {
  Layer L;
  L.n = n, L.k = k;
  const size_t code_bytes = (size_t)mxfp4_code_bytes(n, k), scale_bytes = (size_t)mxfp4_scale_bytes(n, k);
  L.copies_q =
      (int)std::max<size_t>(2, (kCycleBytes + code_bytes + scale_bytes - 1) / (code_bytes + scale_bytes));
  L.copies_b = (int)std::max<size_t>(2, (kCycleBytes + (size_t)(n * k) * 2 - 1) / ((size_t)(n * k) * 2));
  uint8_t *codes, *scales;
  CHECK_CUDA(cudaMalloc(&codes, (size_t)(n * k / 2)));
  CHECK_CUDA(cudaMalloc(&scales, (size_t)(n * k / 32)));
  gbu_fill_kernel<<<1024, 256, 0, stream>>>(codes, (size_t)(n * k / 2), scales, (size_t)(n * k / 32), 7, 119,
                                            8);
  CHECK_CUDA(cudaGetLastError());
  for (int c = 0; c < L.copies_q; c++) {
    void *w, *s;
    CHECK_CUDA(cudaMalloc(&w, code_bytes));
    CHECK_CUDA(cudaMalloc(&s, scale_bytes));
    CHECK_CUDA((cudaError_t)mxfp4_tile_gpu_run(false, codes, w, 1, n, k, stream));
    CHECK_CUDA((cudaError_t)mxfp4_tile_gpu_run(true, scales, s, 1, n, k, stream));
    L.q.push_back(mxfp4_weights{w, s, nullptr, QKEEP_DTYPE_BF16, n, k, 1});
    L.allocations.push_back(w), L.allocations.push_back(s);
  }
  for (int c = 0; c < L.copies_b; c++) {
    __nv_bfloat16 *w;
    CHECK_CUDA(cudaMalloc(&w, (size_t)(n * k) * 2));
    dequant_kernel<<<1024, 256, 0, stream>>>(codes, scales, w, n, k);
    CHECK_CUDA(cudaGetLastError());
    L.bf16.push_back(w);
    L.allocations.push_back(w);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaFree(codes));
  CHECK_CUDA(cudaFree(scales));
  return L;
}

void bench_gemm(cublasHandle_t blas, cudaStream_t stream, double bandwidth, int sms, bool sweep) {
  static const int64_t shapes[][2] = {{8192, 8192}, {4096, 14336}, {14336, 4096}};
  static const int64_t ms[] = {1, 4, 16, 32, 64, 256};
  const int64_t max_m = 256;
  for (auto &shape : shapes) {
    Layer L = make_layer(shape[0], shape[1], stream);
    const int64_t n = L.n, k = L.k;
    __nv_bfloat16 *x, *y, *y_ref;
    CHECK_CUDA(cudaMalloc(&x, (size_t)(max_m * k) * 2));
    CHECK_CUDA(cudaMalloc(&y, (size_t)(max_m * n) * 2));
    CHECK_CUDA(cudaMalloc(&y_ref, (size_t)(max_m * n) * 2));
    random_bf16_kernel<<<256, 256, 0, stream>>>(x, (size_t)(max_m * k), 11);
    CHECK_CUDA(cudaGetLastError());
    const double read_bytes = (double)(mxfp4_code_bytes(n, k) + mxfp4_scale_bytes(n, k));
    for (int64_t m : ms) {
      auto qkeep_with = [&](int split) {
        return [&, split](int c) {
          CHECK_CUDA((cudaError_t)mxfp4_gemm_run(&L.q[c], 0, m, x, QKEEP_DTYPE_BF16, y, QKEEP_DTYPE_BF16,
                                                 split, nullptr, stream));
        };
      };
      auto peer = [&](int c) {
        const float one = 1.0f, zero = 0.0f;
        CHECK_CUBLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)m, (int)k, &one, L.bf16[c],
                                  CUDA_R_16BF, (int)k, x, CUDA_R_16BF, (int)k, &zero, y_ref, CUDA_R_16BF,
                                  (int)n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      qkeep_with(0)(0);
      peer(0);
      CHECK_CUDA(cudaStreamSynchronize(stream));
      double err = compare(y, y_ref, (size_t)(m * n));
      std::vector<double> q_runs, p_runs;
      for (int r = 0; r < 3; r++) { /* interleaved */
        q_runs.push_back(time_us(stream, L.copies_q, qkeep_with(0)));
        p_runs.push_back(time_us(stream, L.copies_b, peer));
      }
      mxfp4_plan plan;
      mxfp4_plan_gemm(m, n, k, 32, sms, 0, &plan);
      /* The wgmma kernel (opt-in: kernel = wgmma) where it applies, checked first, beside the default. */
      const bool wgmma = mxfp4_wgmma_applies(m, QKEEP_DTYPE_BF16, 0);
      double wg_us = -1, wg_err = -1;
      if (wgmma) {
        auto on_wgmma = [&](int c) {
          CHECK_CUDA((cudaError_t)mxfp4_wgmma_run(&L.q[c], 0, m, x, QKEEP_DTYPE_BF16, y, QKEEP_DTYPE_BF16,
                                                  nullptr, stream));
        };
        on_wgmma(0);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        wg_err = compare(y, y_ref, (size_t)(m * n));
        wg_us = time_us(stream, L.copies_q, on_wgmma);
      }
      double q_us = median(q_runs), p_us = median(p_runs), ceiling = 1e6 * read_bytes / bandwidth;
      printf(
          "{\"bench\":\"mxfp4_w4a16\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"qkeep_us\":%.2f,"
          "\"peer\":\"cublas_bf16\",\"peer_us\":%.2f,\"ratio\":%.2f,\"ceiling_us\":%.2f,\"of_ceiling\":%.2f,"
          "\"weight_tbps\":%.2f,\"tokens\":%d,\"split_k\":%d,\"grid\":[%lld,%lld,%d],\"max_rel_err\":%.2e,"
          "\"wgmma_us\":%.2f,\"wgmma_ratio\":%.2f,\"wgmma_max_rel_err\":%.2e,\"runs\":%d,"
          "\"method\":\"graph\"}\n",
          (long long)m, (long long)n, (long long)k, q_us, p_us, p_us / q_us, ceiling, ceiling / q_us,
          read_bytes / q_us / 1e6, plan.tokens, plan.split, (long long)plan.grid_x, (long long)plan.grid_y,
          plan.split, err, wg_us, wgmma ? p_us / wg_us : -1.0, wg_err, 3 * kRuns);
      fflush(stdout);
      for (int split = 1; sweep && split <= MXFP4_MAX_SPLIT; split *= 2) {
        qkeep_with(split)(0);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        double e = compare(y, y_ref, (size_t)(m * n)), us = time_us(stream, L.copies_q, qkeep_with(split));
        printf("{\"bench\":\"mxfp4_sweep\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"split_k\":%d,\"us\":%.2f,"
               "\"vs_cublas\":%.2f,\"max_rel_err\":%.2e}\n",
               (long long)m, (long long)n, (long long)k, split, us, p_us / us, e);
        fflush(stdout);
      }
    }
    CHECK_CUDA(cudaFree(x));
    CHECK_CUDA(cudaFree(y));
    CHECK_CUDA(cudaFree(y_ref));
    for (void *p : L.allocations)
      CHECK_CUDA(cudaFree(p));
  }
}

} // namespace

int main(void) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    printf("{\"bench\":\"mxfp4\",\"skipped\":\"no CUDA device\"}\n");
    return 0;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  printf("{\"bench\":\"device\",\"name\":\"%s\",\"sms\":%d,\"cc\":\"%d.%d\",\"l2_mb\":%.1f}\n", prop.name,
         prop.multiProcessorCount, prop.major, prop.minor, prop.l2CacheSize / 1048576.0);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t blas;
  CHECK_CUBLAS(cublasCreate(&blas));
  CHECK_CUBLAS(cublasSetStream(blas, stream));
  void *blas_workspace; /* cuBLAS's own, so that graph capture never allocates */
  const size_t blas_workspace_bytes = size_t(64) << 20;
  CHECK_CUDA(cudaMalloc(&blas_workspace, blas_workspace_bytes));
  CHECK_CUBLAS(cublasSetWorkspace(blas, blas_workspace, blas_workspace_bytes));
  double bw = copy_bandwidth(stream);
  const char *sweep = getenv("QKEEP_BENCH_SWEEP");
  bench_gemm(blas, stream, bw, prop.multiProcessorCount, sweep && *sweep && strcmp(sweep, "0") != 0);
  CHECK_CUBLAS(cublasDestroy(blas));
  CHECK_CUDA(cudaFree(blas_workspace));
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}
