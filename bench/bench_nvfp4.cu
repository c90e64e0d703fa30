/*
 * bench_nvfp4.cu: the cuda-nvfp4 W4A16 GEMM against cuBLAS bf16 on the same
 * layer (the NVFP4 weights dequantised to bf16), and the bandwidth ceiling,
 * in one process; then PWAL time and peak device memory of a load through
 * the plugin. One JSON object per line (docs/PERFORMANCE.md, "Method"):
 *
 *   {"bench":"d2d_copy", ...}                          the ceiling's bandwidth
 *   {"bench":"nvfp4_w4a16","M":..,"N":..,"K":.., "qkeep_us":.., "peer":"cublas_bf16",
 *    "peer_us":.., "ratio":.., "ceiling_us":.., "of_ceiling":.., ...}
 *   {"bench":"nvfp4_moe","matrix":"w13"|"w2","tokens":.., ...}   Qwen3-30B-A3B's routed experts
 *   {"bench":"fp8_scaled_mm", ...}, {"bench":"nvfp4_vs_fp8", ...}  torch's fp8 GEMM (bench/peer_fp8.py)
 *   {"bench":"nvfp4_transform", ...}                  PWAL's layout transforms (into a new buffer and in
 *                                                     place) against a device copy
 *   {"bench":"nvfp4_pwal", ...}
 *   {"bench":"nvfp4_sweep", ...}                        with QKEEP_BENCH_SWEEP=1: every kernel shape
 *                                                       (=stream: only the streaming kernel's, m <= 16;
 *                                                       =wgmma: the streaming and wgmma kernels')
 *
 * QKEEP_BENCH_PARTS (default all): a list of dense, moe, transform, fp8 and load, the parts to run.
 * QKEEP_BENCH_M (default all): the dense part's token counts to run, e.g. "256" or "64,256";
 * QKEEP_BENCH_SHAPES (default all): its shapes by index (0: 8192 x 8192, 1: 4096 x 14336, 2: 14336 x 4096),
 * e.g. "0" (for a profiler: one launch per kernel of interest).
 *
 * Timing: a CUDA graph of back-to-back launches that cycle through enough
 * copies of the weights (>= 512 MiB) to keep them out of the 50 MB L2, between
 * two events; the median of 7 runs after a warm-up, qkeep and cuBLAS
 * interleaved. The ceiling is the bytes the kernel must read (codes + block
 * scales) over the measured device-to-device copy bandwidth (read + write).
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <unistd.h>

#include "cuda_nvfp4.h"
#include "gpu_benchutil.h"
#include "layout.h"
#include "qkeep/qkeep.h"

namespace {

/* W [n, k] in bf16 from the linear codes and scales (alpha = 1: exact). */
__global__ void dequant_kernel(const uint8_t *codes, const uint8_t *scales, __nv_bfloat16 *w, int64_t n,
                               int64_t k) {
  const float e2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n * k;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = i / k, c = i % k;
    uint8_t b = codes[r * (k / 2) + c / 2], code = (c & 1) ? b >> 4 : b & 0xf;
    uint8_t s = scales[r * (k / 16) + c / 16];
    float scale = ldexpf(1.0f + (float)(s & 7) / 8.0f, ((s >> 3) & 15) - 7);
    w[i] = __float2bfloat16(e2m1[code] * scale);
  }
}

/* Reads n 16-byte words (4 loads in flight per thread) and folds them into one word per
 * thread: the plain read rate of the same bytes, next to the kernel's. */
__global__ void stream_kernel(const uint4 *w, size_t n, uint32_t *sink) {
  uint32_t acc = 0;
  size_t stride = (size_t)gridDim.x * blockDim.x, i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = __ldcs(w + i), b = __ldcs(w + i + stride), c = __ldcs(w + i + 2 * stride),
          d = __ldcs(w + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    uint4 a = __ldcs(w + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x12345678u)
    sink[0] = acc;
}

const char *kernel_name(int kernel) {
  return kernel == NVFP4_KERNEL_STREAM ? "stream" : kernel == NVFP4_KERNEL_WGMMA ? "wgmma" : "ring";
}

struct Layer {
  int64_t n, k;
  int copies_q, copies_b;
  std::vector<nvfp4_weights> q;      /* tiled copies */
  std::vector<__nv_bfloat16 *> bf16; /* dequantised copies for cuBLAS */
  std::vector<void *> allocations;
  float *alpha;
};

Layer make_layer(int64_t n, int64_t k, cudaStream_t stream) {
  Layer L;
  L.n = n, L.k = k;
  size_t codes = (size_t)(n * k / 2), scales = (size_t)(n * k / 16);
  size_t w_bytes = (size_t)nvfp4_w_bytes(n, k), s_bytes = (size_t)nvfp4_sf_bytes(n, k / 16);
  L.copies_q = (int)std::max<size_t>(2, (kCycleBytes + w_bytes + s_bytes - 1) / (w_bytes + s_bytes));
  L.copies_b = (int)std::max<size_t>(2, (kCycleBytes + n * k * 2 - 1) / (n * k * 2));
  uint8_t *lin_codes, *lin_scales;
  CHECK_CUDA(cudaMalloc(&lin_codes, codes));
  CHECK_CUDA(cudaMalloc(&lin_scales, scales));
  CHECK_CUDA(cudaMalloc(&L.alpha, sizeof(float)));
  const float one = 1.0f;
  CHECK_CUDA(cudaMemcpy(L.alpha, &one, sizeof one, cudaMemcpyHostToDevice));
  gbu_fill_kernel<<<1024, 256, 0, stream>>>(lin_codes, codes, lin_scales, scales, (uint64_t)(n * 7 + k), 0x28,
                                            32);
  CHECK_CUDA(cudaGetLastError());
  for (int c = 0; c < L.copies_q; c++) {
    void *w, *s;
    CHECK_CUDA(cudaMalloc(&w, w_bytes));
    CHECK_CUDA(cudaMalloc(&s, s_bytes));
    CHECK_CUDA((cudaError_t)nvfp4_tile_weights_gpu(lin_codes, w, 1, n, k, stream));
    CHECK_CUDA((cudaError_t)nvfp4_swizzle_scales_gpu(lin_scales, s, 1, n, k / 16, stream));
    L.q.push_back(nvfp4_weights{w, s, L.alpha, nullptr, QKEEP_DTYPE_F32, n, k, 1});
    L.allocations.push_back(w), L.allocations.push_back(s);
  }
  for (int c = 0; c < L.copies_b; c++) {
    __nv_bfloat16 *w;
    CHECK_CUDA(cudaMalloc(&w, (size_t)(n * k) * 2));
    dequant_kernel<<<4096, 256, 0, stream>>>(lin_codes, lin_scales, w, n, k);
    CHECK_CUDA(cudaGetLastError());
    L.bf16.push_back(w);
    L.allocations.push_back(w);
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaFree(lin_codes));
  CHECK_CUDA(cudaFree(lin_scales));
  return L;
}

void free_layer(Layer &L) {
  for (void *p : L.allocations)
    CHECK_CUDA(cudaFree(p));
  CHECK_CUDA(cudaFree(L.alpha));
}

/*
 * The opt-in FP8 activations at m tokens: the plan's shape and token tiles 128 and 256, each
 * checked first; its error against cuBLAS's bf16 output (y_ref, the exact W4A16 product rounded
 * to bf16) beside W4A16's own, as the largest and the root mean square.
 */
template <class With>
void bench_fp8_activations(int64_t m, int64_t n, int64_t k, const __nv_bfloat16 *y,
                           const __nv_bfloat16 *y_ref, __nv_bfloat16 *y_w4a16, double w4a16_us,
                           double peer_us, double w4a16_err, const With &qkeep_with, int copies,
                           cudaStream_t stream) {
  const size_t values = (size_t)(m * n);
  qkeep_with(nullptr)(0); /* the default W4A16 output, kept */
  CHECK_CUDA(cudaMemcpyAsync(y_w4a16, y, values * 2, cudaMemcpyDeviceToDevice, stream));
  nvfp4_tuning want = {};
  want.fp8 = 1;
  nvfp4_tuning plan;
  nvfp4_gemm_plan(m, n, k, QKEEP_DTYPE_BF16, &want, &plan);
  qkeep_with (&want)(0);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  const double err = compare(y, y_ref, values), rms = compare_rms(y, y_ref, values);
  const double w4a16_rms = compare_rms(y_w4a16, y_ref, values), vs_w4a16 = compare_rms(y, y_w4a16, values);
  std::vector<double> runs;
  for (int r = 0; r < 3; r++)
    runs.push_back(time_us(stream, copies, qkeep_with(&want), nullptr));
  const double us = median(runs);
  std::string tiles_s;
  double tiles_err = 0;
  for (int tm = 128; tm <= 256; tm *= 2) {
    nvfp4_tuning t = want;
    t.tile_m = tm;
    qkeep_with (&t)(0);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    tiles_err = std::max(tiles_err, compare_rms(y, y_ref, values));
    char one[48];
    snprintf(one, sizeof one, "%s%d:%.2f", tiles_s.empty() ? "" : " ", tm,
             time_us(stream, copies, qkeep_with(&t), nullptr));
    tiles_s += one;
  }
  printf("{\"bench\":\"nvfp4_fp8_activations\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"qkeep_us\":%.2f,"
         "\"peer\":\"cublas_bf16\",\"peer_us\":%.2f,\"ratio\":%.2f,\"w4a16_us\":%.2f,\"vs_w4a16\":%.2f,"
         "\"tile_m\":%d,\"split_k\":%d,\"fp8\":%d,\"tiles_us\":\"%s\",\"max_rel_err\":%.2e,"
         "\"rms_rel_err\":%.2e,\"w4a16_max_rel_err\":%.2e,\"w4a16_rms_rel_err\":%.2e,"
         "\"rms_vs_w4a16\":%.2e,\"tiles_max_rms_rel_err\":%.2e,\"method\":\"graph\"}\n",
         (long long)m, (long long)n, (long long)k, us, peer_us, peer_us / us, w4a16_us, w4a16_us / us,
         plan.tile_m, plan.split_k, plan.fp8, tiles_s.c_str(), err, rms, w4a16_err, w4a16_rms, vs_w4a16,
         tiles_err);
  fflush(stdout);
}

/* qkeep's default time per (M, N, K) of bench_gemm, for the fp8 peer's ratio. */
struct DenseTime {
  int64_t m, n, k;
  double us;
};
std::vector<DenseTime> dense_times;

void bench_gemm(cublasHandle_t blas, cudaStream_t stream, double bandwidth, const char *sweep) {
  uint32_t *sink;
  CHECK_CUDA(cudaMalloc(&sink, sizeof *sink));
  static const int64_t shapes[][2] = {{8192, 8192}, {4096, 14336}, {14336, 4096}};
  static const int64_t ms[] = {1, 4, 16, 32, 64, 128, 256, 1024};
  const int64_t max_m = 1024;
  /* "a,b,c" holds v: an unset or empty list holds every value. */
  auto listed = [](const char *list, long long v) {
    if (!list || !*list)
      return true;
    for (const char *p = list; *p;) {
      char *end;
      const long long x = strtoll(p, &end, 10);
      if (end == p)
        return false;
      if (x == v)
        return true;
      p = *end == ',' ? end + 1 : end;
    }
    return false;
  };
  const char *only_m = getenv("QKEEP_BENCH_M"), *only_shapes = getenv("QKEEP_BENCH_SHAPES");
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
    if (!listed(only_shapes, (long long)si))
      continue;
    const auto &shape = shapes[si];
    Layer L = make_layer(shape[0], shape[1], stream);
    const int64_t n = L.n, k = L.k;
    __nv_bfloat16 *x, *y, *y_ref, *y_w4a16;
    CHECK_CUDA(cudaMalloc(&x, (size_t)(max_m * k) * 2));
    CHECK_CUDA(cudaMalloc(&y, (size_t)(max_m * n) * 2));
    CHECK_CUDA(cudaMalloc(&y_ref, (size_t)(max_m * n) * 2));
    CHECK_CUDA(cudaMalloc(&y_w4a16, (size_t)(max_m * n) * 2));
    random_bf16_kernel<<<256, 256, 0, stream>>>(x, (size_t)(max_m * k), 11);
    CHECK_CUDA(cudaGetLastError());
    const double read_bytes = (double)(nvfp4_w_bytes(n, k) + nvfp4_sf_bytes(n, k / 16));
    for (int64_t m : ms) {
      if (!listed(only_m, (long long)m))
        continue;
      nvfp4_tuning plan;
      nvfp4_gemm_plan(m, n, k, QKEEP_DTYPE_BF16, nullptr, &plan);
      auto qkeep_with = [&](const nvfp4_tuning *tune) {
        return [&, tune](int c) {
          CHECK_CUDA((cudaError_t)nvfp4_gemm_run(&L.q[c], 0, m, x, QKEEP_DTYPE_BF16, y, QKEEP_DTYPE_BF16,
                                                 tune, nullptr, stream));
        };
      };
      auto peer = [&](int c) {
        const float one = 1.0f, zero = 0.0f;
        CHECK_CUBLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)m, (int)k, &one, L.bf16[c],
                                  CUDA_R_16BF, (int)k, x, CUDA_R_16BF, (int)k, &zero, y_ref, CUDA_R_16BF,
                                  (int)n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      /* Correctness first: the same layer through both. */
      qkeep_with(nullptr)(0);
      peer(0);
      CHECK_CUDA(cudaStreamSynchronize(stream));
      double err = compare(y, y_ref, (size_t)(m * n));
      auto stream_read = [&](int c) {
        stream_kernel<<<4 * 132, 256, 0, stream>>>(static_cast<const uint4 *>(L.q[c].w),
                                                   (size_t)nvfp4_w_bytes(n, k) / 16, sink);
      };
      std::vector<double> q_runs, p_runs;
      int launches = 0;
      for (int r = 0; r < 3; r++) { /* interleaved */
        q_runs.push_back(time_us(stream, L.copies_q, qkeep_with(nullptr), &launches));
        p_runs.push_back(time_us(stream, L.copies_b, peer, nullptr));
      }
      double s_us = time_us(stream, L.copies_q, stream_read, nullptr);
      /* The streaming kernel without programmatic dependent launch: each launch after the last ends. */
      const nvfp4_tuning late = {0, 0, 0, 0, 0, 0, 0, 1, 0, 0};
      const double late_us =
          plan.kernel == NVFP4_KERNEL_STREAM ? time_us(stream, L.copies_q, qkeep_with(&late)) : -1;
      /* The wgmma plan's token tile without a K split and with 1, 2 and 4 row blocks sharing the
       * activations ("multicast:us ..."), each checked against cuBLAS's output first. */
      std::string mc_s;
      double mc_err = 0;
      for (int mc = 1; mc <= 4 && plan.kernel == NVFP4_KERNEL_WGMMA; mc *= 2) {
        const nvfp4_tuning t = {plan.tile_m, 1, 0, NVFP4_KERNEL_WGMMA, plan.rows, 0, 0, 0, mc, 0};
        qkeep_with (&t)(0);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        const double e = compare(y, y_ref, (size_t)(m * n));
        mc_err = e > mc_err ? e : mc_err;
        char one[48];
        snprintf(one, sizeof one, "%s%d:%.2f", mc_s.empty() ? "" : " ", mc,
                 time_us(stream, L.copies_q, qkeep_with(&t), nullptr));
        mc_s += one;
      }
      double q_us = median(q_runs), p_us = median(p_runs), ceiling = 1e6 * read_bytes / bandwidth;
      printf(
          "{\"bench\":\"nvfp4_w4a16\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"qkeep_us\":%.2f,"
          "\"peer\":\"cublas_bf16\",\"peer_us\":%.2f,\"ratio\":%.2f,\"ceiling_us\":%.2f,\"of_ceiling\":%.2f,"
          "\"weight_tbps\":%.2f,\"stream_us\":%.2f,\"kernel\":\"%s\",\"tile_m\":%d,\"split_k\":%d,"
          "\"rows\":%d,\"unroll\":%d,\"multicast\":%d,\"late_us\":%.2f,\"unsplit_multicast_us\":\"%s\","
          "\"multicast_max_rel_err\":%.2e,\"max_rel_err\":%.2e,\"runs\":%d,\"launches\":%d,"
          "\"method\":\"graph\"}"
          "\n",
          (long long)m, (long long)n, (long long)k, q_us, p_us, p_us / q_us, ceiling, ceiling / q_us,
          read_bytes / q_us / 1e6, s_us, kernel_name(plan.kernel), plan.tile_m, plan.split_k, plan.rows,
          plan.unroll, plan.multicast, late_us, mc_s.c_str(), mc_err, err, 3 * kRuns, launches);
      fflush(stdout);
      dense_times.push_back({m, n, k, q_us});
      if (plan.kernel == NVFP4_KERNEL_WGMMA && m >= NVFP4_FP8_MIN_M)
        bench_fp8_activations(m, n, k, y, y_ref, y_w4a16, q_us, p_us, err, qkeep_with, L.copies_q, stream);
      if (!sweep)
        continue;
      /* One forced shape: its error against cuBLAS's output, then its time. */
      auto measure = [&](const nvfp4_tuning &tune, double *err_out) {
        qkeep_with (&tune)(0);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        *err_out = compare(y, y_ref, (size_t)(m * n));
        return time_us(stream, L.copies_q, qkeep_with(&tune), nullptr);
      };
      if (m <= 16) { /* the streaming kernel's shapes */
        static const int rows[] = {1, 2, 4}, unrolls[] = {4, 8, 43}, ssplits[] = {1, 2, 4, 8};
        for (int rw : rows)
          for (int un : unrolls) /* 43: unroll 4, registers for 3 blocks per SM (depth 3) */
            for (int sk : ssplits) {
              const int dp = un == 43 ? 3 : 0, u = un == 43 ? 4 : un;
              double e, us = measure({0, sk, dp, NVFP4_KERNEL_STREAM, rw, u, 0, 0, 0, 0}, &e);
              printf("{\"bench\":\"nvfp4_sweep\",\"kernel\":\"stream\",\"M\":%lld,\"N\":%lld,\"K\":%lld,"
                     "\"rows\":%d,\"unroll\":%d,\"depth\":%d,\"split_k\":%d,\"us\":%.2f,\"vs_cublas\":%.2f,"
                     "\"of_ceiling\":%.2f,\"max_rel_err\":%.2e}\n",
                     (long long)m, (long long)n, (long long)k, rw, u, dp, sk, us, p_us / us, ceiling / us, e);
              fflush(stdout);
            }
      }
      if (strcmp(sweep, "stream") == 0)
        continue;
      { /* the wgmma kernel's shapes */
        static const int wtiles[] = {8, 16, 32, 64, 128, 256}, wrows[] = {1, 2}, wsplits[] = {1, 2, 4, 8};
        for (int tm : wtiles)
          for (int rw : wrows)
            for (int sk : wsplits) {
              const bool few = m <= 16; /* the decode sizes: token tiles 8 and 16, splits to 8 */
              if ((rw == 2 && tm > 128) || (few && tm > 16) ||
                  (!few && (tm < 32 || tm > 4 * m || (tm < 64 && m >= 128) || sk == 8)))
                continue;
              double e, us = measure({tm, sk, 0, NVFP4_KERNEL_WGMMA, rw, 0, 0, 0, 1, 0}, &e);
              printf("{\"bench\":\"nvfp4_sweep\",\"kernel\":\"wgmma\",\"M\":%lld,\"N\":%lld,\"K\":%lld,"
                     "\"tile_m\":%d,\"rows\":%d,\"split_k\":%d,\"us\":%.2f,\"vs_cublas\":%.2f,"
                     "\"max_rel_err\":%.2e}\n",
                     (long long)m, (long long)n, (long long)k, tm, rw, sk, us, p_us / us, e);
              fflush(stdout);
            }
      }
      if (strcmp(sweep, "wgmma") == 0)
        continue;
      static const int tiles[] = {8, 16, 32, 64}, splits[] = {1, 2, 4, 8}, depths[] = {0, 8};
      for (int tm : tiles)
        for (int sk : splits)
          for (int dp : depths) {
            if ((m >= 64 && tm < 32) || (m <= 16 && tm > 32))
              continue;
            double e, us = measure({tm, sk, dp, NVFP4_KERNEL_RING, 0, 0, 0, 0, 0, 0}, &e);
            printf("{\"bench\":\"nvfp4_sweep\",\"kernel\":\"ring\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"tile_"
                   "m\":%d,\"split_k\":%d,"
                   "\"depth\":\"%s\",\"us\":%.2f,\"of_ceiling\":%.2f,\"max_rel_err\":%.2e}\n",
                   (long long)m, (long long)n, (long long)k, tm, sk, dp ? "deep" : "default", us,
                   ceiling / us, e);
            fflush(stdout);
          }
    }
    CHECK_CUDA(cudaFree(x));
    CHECK_CUDA(cudaFree(y));
    CHECK_CUDA(cudaFree(y_ref));
    CHECK_CUDA(cudaFree(y_w4a16));
    free_layer(L);
  }
  CHECK_CUDA(cudaFree(sink));
}

/* ---- routed MoE: Qwen3-30B-A3B's experts ------------------------------------------------------ */

/* One expert matrix set of the MoE ([experts, n, k]): the tiled master copy, the bf16 one. */
struct MoeMatrix {
  const char *name;
  int64_t n, k;
  size_t w_bytes, sf_bytes; /* per expert, tiled */
  uint8_t *w, *sf;          /* experts x tiled weights / swizzled scales */
  __nv_bfloat16 *bf16;      /* [experts, n, k] */
};

MoeMatrix make_moe_matrix(const char *name, int64_t experts, int64_t n, int64_t k, uint64_t seed,
                          cudaStream_t stream) {
  MoeMatrix M = {name,    n,       k,      (size_t)nvfp4_w_bytes(n, k), (size_t)nvfp4_sf_bytes(n, k / 16),
                 nullptr, nullptr, nullptr};
  const size_t codes = (size_t)(experts * n * k / 2), scales = (size_t)(experts * n * k / 16);
  uint8_t *lin_codes, *lin_scales;
  CHECK_CUDA(cudaMalloc(&lin_codes, codes));
  CHECK_CUDA(cudaMalloc(&lin_scales, scales));
  CHECK_CUDA(cudaMalloc(&M.w, M.w_bytes * (size_t)experts));
  CHECK_CUDA(cudaMalloc(&M.sf, M.sf_bytes * (size_t)experts));
  CHECK_CUDA(cudaMalloc(&M.bf16, (size_t)(experts * n * k) * 2));
  gbu_fill_kernel<<<4096, 256, 0, stream>>>(lin_codes, codes, lin_scales, scales, seed, 0x28, 32);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA((cudaError_t)nvfp4_tile_weights_gpu(lin_codes, M.w, experts, n, k, stream));
  CHECK_CUDA((cudaError_t)nvfp4_swizzle_scales_gpu(lin_scales, M.sf, experts, n, k / 16, stream));
  dequant_kernel<<<8192, 256, 0, stream>>>(lin_codes, lin_scales, M.bf16, experts * n, k); /* rows stack */
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaFree(lin_codes));
  CHECK_CUDA(cudaFree(lin_scales));
  return M;
}

/* Random bf16 values in [-1, 1] on the host (the peer's gathered copy is built from them). */
std::vector<__nv_bfloat16> host_bf16(size_t n, uint64_t seed) {
  std::vector<__nv_bfloat16> v(n);
  for (size_t i = 0; i < n; i++) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    v[i] = __float2bfloat16((float)((seed >> 40) % 2001) / 1000.0f - 1.0f);
  }
  return v;
}

/* max |a[p] - b[row[p]]| / max |b| over rows of n bf16 values (host copies). */
double compare_rows(const std::vector<__nv_bfloat16> &a, const std::vector<__nv_bfloat16> &b,
                    const std::vector<int> &row, int64_t n) {
  double err = 0, ref = 0;
  for (size_t p = 0; p < row.size(); p++)
    for (int64_t j = 0; j < n; j++) {
      double x = __bfloat162float(a[p * n + j]), y = __bfloat162float(b[(size_t)row[p] * n + j]);
      double d = std::fabs(x - y);
      if (!(d <= err))
        err = d;
      ref = std::max(ref, std::fabs(y));
    }
  return ref > 0 ? err / ref : err;
}

template <typename T> T *device_copy(const std::vector<T> &v) {
  T *d;
  CHECK_CUDA(cudaMalloc(&d, v.size() * sizeof(T) + 16));
  CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

/*
 * Qwen3-30B-A3B's MoE (128 experts, hidden 2048, expert intermediate 768, top-8): the routed
 * w13 (gate_up, [1536, 2048] per expert) and w2 (down, [2048, 768], with the router-weighted
 * combine) at 1, 16, 64, 256 and 1024 tokens, random routing (8 distinct experts per token, fixed
 * seed), bf16 activations. Peers in the same run: the ceiling for the bytes of the experts
 * hit (tiled codes + swizzled scales over the copy bandwidth), and cuBLAS bf16 on the same
 * dequantised experts, one GEMM per expert hit over its tokens' rows gathered beforehand
 * (neither the gather nor the combine is timed for cuBLAS; both are in qkeep's time), as a
 * loop of launches (peer_us) and as one grouped call (cublasGemmGroupedBatchedEx, grouped_us).
 * Each side cycles weight copies of the experts hit, >= 512 MiB, out of L2. Also the plan's
 * kernel forced each way (stream_us, wgmma_us); a plain read of the experts' bytes (read_us);
 * at 1 token, the dense streaming kernel over the same bytes as one matrix (dense_us: the
 * GEMM without the routing).
 */
void bench_moe(cublasHandle_t blas, cudaStream_t stream, double bandwidth, int sms, bool wgmma) {
  const int64_t experts = 128, hidden = 2048, inter = 768;
  const int topk = 8;
  static const int64_t token_counts[] = {1, 16, 64, 256, 1024};
  float *alpha;
  uint32_t *sink;
  CHECK_CUDA(cudaMalloc(&sink, sizeof *sink));
  {
    std::vector<float> ones((size_t)experts, 1.0f);
    alpha = device_copy(ones);
  }
  for (int mat = 0; mat < 2; mat++) {
    const bool w2 = mat == 1;
    MoeMatrix W = w2 ? make_moe_matrix("w2", experts, hidden, inter, 77, stream)
                     : make_moe_matrix("w13", experts, 2 * inter, hidden, 76, stream);
    const int64_t n = W.n, k = W.k;
    for (int64_t T : token_counts) {
      const int64_t pairs = T * topk;
      /* Routing: topk distinct experts per token, router weights in [0.05, 0.3). */
      std::vector<int32_t> ids((size_t)pairs);
      std::vector<float> weights((size_t)pairs);
      uint64_t rng = 1000 + (uint64_t)T;
      auto next = [&rng]() {
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        return rng >> 33;
      };
      for (int64_t t = 0; t < T; t++)
        for (int s = 0; s < topk; s++) {
          int32_t e;
          bool again;
          do {
            e = (int32_t)(next() % experts);
            again = false;
            for (int q = 0; q < s; q++)
              again |= ids[(size_t)(t * topk + q)] == e;
          } while (again);
          ids[(size_t)(t * topk + s)] = e;
          weights[(size_t)(t * topk + s)] = 0.05f + 0.25f * (float)(next() % 1000) / 1000.0f;
        }
      /* The experts hit, their pairs in order (the peer's gathered rows), each pair's row there. */
      std::vector<int> hit, first((size_t)experts, -1), count((size_t)experts, 0), row((size_t)pairs);
      for (int64_t p = 0; p < pairs; p++)
        count[(size_t)ids[(size_t)p]]++;
      int rows = 0;
      for (int e = 0; e < experts; e++)
        if (count[(size_t)e]) {
          hit.push_back(e);
          first[(size_t)e] = rows;
          rows += count[(size_t)e];
        }
      {
        std::vector<int> fill((size_t)experts, 0);
        for (int64_t p = 0; p < pairs; p++) {
          const int e = ids[(size_t)p];
          row[(size_t)p] = first[(size_t)e] + fill[(size_t)e]++;
        }
      }
      const int64_t x_rows = w2 ? pairs : T;
      std::vector<__nv_bfloat16> x = host_bf16((size_t)(x_rows * k), 31 + (uint64_t)T),
                                 xg((size_t)(pairs * k));
      for (int64_t p = 0; p < pairs; p++)
        memcpy(&xg[(size_t)(row[(size_t)p] * k)], &x[(size_t)((w2 ? p : p / topk) * k)], (size_t)k * 2);
      __nv_bfloat16 *d_x = device_copy(x), *d_xg = device_copy(xg), *d_y, *d_yg, *d_rows;
      CHECK_CUDA(cudaMalloc(&d_y, (size_t)(pairs * n) * 2));
      CHECK_CUDA(cudaMalloc(&d_rows, (size_t)(pairs * n) * 2));
      CHECK_CUDA(cudaMalloc(&d_yg, (size_t)(pairs * n) * 2));
      int32_t *d_ids = device_copy(ids);
      float *d_weights = device_copy(weights);

      /* Weight copies of the experts hit (the rest of each copy is never read). */
      const size_t hit_q = hit.size() * (W.w_bytes + W.sf_bytes), hit_b = hit.size() * (size_t)(n * k) * 2;
      const int copies_q = (int)std::max<size_t>(2, (kCycleBytes + hit_q - 1) / hit_q);
      const int copies_b = (int)std::max<size_t>(2, (kCycleBytes + hit_b - 1) / hit_b);
      std::vector<nvfp4_weights> q;
      std::vector<void *> allocations;
      for (int c = 0; c < copies_q; c++) {
        uint8_t *w, *sf;
        CHECK_CUDA(cudaMalloc(&w, W.w_bytes * (size_t)experts));
        CHECK_CUDA(cudaMalloc(&sf, W.sf_bytes * (size_t)experts));
        for (int e : hit) {
          CHECK_CUDA(cudaMemcpyAsync(w + e * W.w_bytes, W.w + e * W.w_bytes, W.w_bytes,
                                     cudaMemcpyDeviceToDevice, stream));
          CHECK_CUDA(cudaMemcpyAsync(sf + e * W.sf_bytes, W.sf + e * W.sf_bytes, W.sf_bytes,
                                     cudaMemcpyDeviceToDevice, stream));
        }
        q.push_back(nvfp4_weights{w, sf, alpha, nullptr, QKEEP_DTYPE_F32, n, k, experts});
        allocations.push_back(w), allocations.push_back(sf);
      }
      std::vector<__nv_bfloat16 *> b; /* compact: the experts hit, in order */
      for (int c = 0; c < copies_b; c++) {
        __nv_bfloat16 *w;
        CHECK_CUDA(cudaMalloc(&w, hit_b));
        for (size_t i = 0; i < hit.size(); i++)
          CHECK_CUDA(cudaMemcpyAsync(w + i * (size_t)(n * k), W.bf16 + (size_t)hit[i] * (size_t)(n * k),
                                     (size_t)(n * k) * 2, cudaMemcpyDeviceToDevice, stream));
        b.push_back(w);
        allocations.push_back(w);
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));

      auto qkeep_with = [&](const nvfp4_tuning *tune) {
        return [&, tune](int c) {
          CHECK_CUDA((cudaError_t)nvfp4_moe_run(&q[(size_t)c], T, topk, d_ids, d_weights, w2, d_x,
                                                QKEEP_DTYPE_BF16, d_y, QKEEP_DTYPE_BF16, tune, nullptr,
                                                stream));
        };
      };
      auto peer = [&](int c) {
        const float one = 1.0f, zero = 0.0f;
        for (size_t i = 0; i < hit.size(); i++) {
          const int e = hit[i], r0 = first[(size_t)e];
          CHECK_CUBLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, count[(size_t)e], (int)k, &one,
                                    b[(size_t)c] + i * (size_t)(n * k), CUDA_R_16BF, (int)k,
                                    d_xg + (size_t)r0 * k, CUDA_R_16BF, (int)k, &zero, d_yg + (size_t)r0 * n,
                                    CUDA_R_16BF, (int)n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }
      };
      /* Correctness: every pair's row through qkeep (for w2 without the combine: one slot per
       * pair) against cuBLAS's row of the same pair; each forced kernel too. */
      peer(0);
      std::vector<int32_t> flat(ids);
      int32_t *d_flat = device_copy(flat);
      auto rows_error = [&](const nvfp4_tuning *tune) {
        if (w2)
          CHECK_CUDA((cudaError_t)nvfp4_moe_run(&q[0], pairs, 1, d_flat, nullptr, false, d_x,
                                                QKEEP_DTYPE_BF16, d_rows, QKEEP_DTYPE_BF16, tune, nullptr,
                                                stream));
        else
          CHECK_CUDA((cudaError_t)nvfp4_moe_run(&q[0], T, topk, d_ids, nullptr, false, d_x, QKEEP_DTYPE_BF16,
                                                d_rows, QKEEP_DTYPE_BF16, tune, nullptr, stream));
        CHECK_CUDA(cudaStreamSynchronize(stream));
        std::vector<__nv_bfloat16> got((size_t)(pairs * n)), want((size_t)(pairs * n));
        CHECK_CUDA(cudaMemcpy(got.data(), d_rows, got.size() * 2, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(want.data(), d_yg, want.size() * 2, cudaMemcpyDeviceToHost));
        return compare_rows(got, want, row, n);
      };
      const nvfp4_tuning as_stream = {0, 0, 0, NVFP4_KERNEL_STREAM, 0, 0, 0, 0, 0, 0},
                         as_wgmma = {0, 0, 0, NVFP4_KERNEL_WGMMA, 0, 0, 0, 0, 0, 0},
                         as_fp8 = {0, 0, 0, NVFP4_KERNEL_WGMMA, 0, 0, 0, 0, 0, 1}; /* FP8 activations */
      double err = rows_error(nullptr), err_s = rows_error(&as_stream), err_w = rows_error(&as_wgmma);
      const bool fp8 = wgmma && T >= 64;
      const double err_f = fp8 ? rows_error(&as_fp8) : -1;
      /* cuBLAS's grouped GEMM: one group per expert hit (pointer arrays per copy, on the device). */
      const int groups = (int)hit.size();
      std::vector<cublasOperation_t> op_a((size_t)groups, CUBLAS_OP_T), op_b((size_t)groups, CUBLAS_OP_N);
      std::vector<int> gm((size_t)groups, (int)n), gn((size_t)groups), gk((size_t)groups, (int)k),
          one_each((size_t)groups, 1);
      std::vector<float> g_alpha((size_t)groups, 1.0f), g_beta((size_t)groups, 0.0f);
      for (int i = 0; i < groups; i++)
        gn[(size_t)i] = count[(size_t)hit[(size_t)i]];
      std::vector<const void **> g_a, g_b;
      std::vector<void **> g_c;
      for (int c = 0; c < copies_b; c++) {
        std::vector<const void *> pa((size_t)groups), pb((size_t)groups);
        std::vector<void *> pc((size_t)groups);
        for (int i = 0; i < groups; i++) {
          const int r0 = first[(size_t)hit[(size_t)i]];
          pa[(size_t)i] = b[(size_t)c] + (size_t)i * (size_t)(n * k);
          pb[(size_t)i] = d_xg + (size_t)r0 * k;
          pc[(size_t)i] = d_y + (size_t)r0 * n; /* not d_yg: the loop's rows stay for the check */
        }
        g_a.push_back(device_copy(pa)), g_b.push_back(device_copy(pb)), g_c.push_back(device_copy(pc));
      }
      auto grouped_call = [&](int c) {
        return cublasGemmGroupedBatchedEx(
            blas, op_a.data(), op_b.data(), gm.data(), gn.data(), gk.data(), g_alpha.data(), g_a[(size_t)c],
            CUDA_R_16BF, gk.data(), g_b[(size_t)c], CUDA_R_16BF, gk.data(), g_beta.data(), g_c[(size_t)c],
            CUDA_R_16BF, gm.data(), groups, one_each.data(), CUBLAS_COMPUTE_32F);
      };
      cublasStatus_t g_status = grouped_call(0);
      double g_err = -1, g_us = -1;
      if (g_status == CUBLAS_STATUS_SUCCESS) {
        CHECK_CUDA(cudaStreamSynchronize(stream));
        g_err = compare(d_y, d_yg, (size_t)(pairs * n)); /* the same rows as the loop's */
      }
      std::vector<double> q_runs, p_runs, g_runs;
      int launches = 0;
      for (int r = 0; r < 3; r++) { /* interleaved */
        q_runs.push_back(time_us(stream, copies_q, qkeep_with(nullptr), &launches));
        p_runs.push_back(time_us(stream, copies_b, peer));
        if (g_status == CUBLAS_STATUS_SUCCESS)
          g_runs.push_back(time_us(stream, copies_b, [&](int c) { CHECK_CUBLAS(grouped_call(c)); }));
      }
      if (!g_runs.empty())
        g_us = median(g_runs);
      const double s_us = time_us(stream, copies_q, qkeep_with(&as_stream));
      /* The streaming kernel after the sorting kernel (route = align), where it routes itself by default. */
      const nvfp4_tuning as_aligned = {0, 0, 0, NVFP4_KERNEL_STREAM, 0, 0, NVFP4_ROUTE_ALIGN, 0, 0, 0};
      const double a_us = time_us(stream, copies_q, qkeep_with(&as_aligned));
      /* Decode: the streaming kernel's shapes, rows per block x K split ("rows/split:us ..."). */
      std::string sweep_s;
      for (int rw = 1; rw <= 4 && T <= 16; rw *= 2)
        for (int sk = 1; sk <= 4; sk *= 2) {
          const nvfp4_tuning shape = {0, sk, 0, NVFP4_KERNEL_STREAM, rw, 0, 0, 0, 0, 0};
          char one[48];
          snprintf(one, sizeof one, "%s%d/%d:%.2f", sweep_s.empty() ? "" : " ", rw, sk,
                   time_us(stream, copies_q, qkeep_with(&shape)));
          sweep_s += one;
        }
      const double w_us = time_us(stream, copies_q, qkeep_with(&as_wgmma));
      const double f_us = fp8 ? time_us(stream, copies_q, qkeep_with(&as_fp8)) : -1;
      const nvfp4_tuning as_wgmma32 = {32, 0, 0, NVFP4_KERNEL_WGMMA,
                                       0,  0, 0}; /* a token tile above the mean */
      const double w32_us = T >= 64 ? time_us(stream, copies_q, qkeep_with(&as_wgmma32)) : -1;
      const double r_us = time_us(stream, copies_q, [&](int c) {
        stream_kernel<<<4 * 132, 256, 0, stream>>>(static_cast<const uint4 *>(q[(size_t)c].w),
                                                   hit.size() * W.w_bytes / 16, sink);
      });
      double d_us = -1;
      if (T == 1) { /* the experts hit as one [hit x n, k] matrix (copy slots 0..hit-1, same bytes) */
        std::vector<nvfp4_weights> dense;
        for (const nvfp4_weights &w : q)
          dense.push_back(
              nvfp4_weights{w.w, w.sf, alpha, nullptr, QKEEP_DTYPE_F32, n * (int64_t)hit.size(), k, 1});
        d_us = time_us(stream, copies_q, [&](int c) {
          CHECK_CUDA((cudaError_t)nvfp4_gemm_run(&dense[(size_t)c], 0, 1, d_x, QKEEP_DTYPE_BF16, d_rows,
                                                 QKEEP_DTYPE_BF16, nullptr, nullptr, stream));
        });
      }
      const double q_us = median(q_runs), p_us = median(p_runs), ceiling = 1e6 * (double)hit_q / bandwidth;
      nvfp4_tuning plan, plan_s, plan_w;
      nvfp4_moe_plan(pairs, experts, n, k, sms, wgmma, nullptr, &plan);
      nvfp4_moe_plan(pairs, experts, n, k, sms, wgmma, &as_stream, &plan_s);
      nvfp4_moe_plan(pairs, experts, n, k, sms, wgmma, &as_wgmma, &plan_w);
      printf(
          "{\"bench\":\"nvfp4_moe\",\"model\":\"Qwen3-30B-A3B\",\"matrix\":\"%s\",\"experts\":%lld,\"topk\":%"
          "d,"
          "\"tokens\":%lld,\"experts_hit\":%zu,\"N\":%lld,\"K\":%lld,\"qkeep_us\":%.2f,\"kernel\":\"%s\","
          "\"tile_m\":%d,\"rows\":%d,\"split_k\":%d,\"peer\":\"cublas_bf16_per_expert\",\"peer_us\":%.2f,"
          "\"ratio\":%.2f,\"ceiling_us\":%.2f,\"of_ceiling\":%.2f,\"hit_bytes\":%zu,\"stream_us\":%.2f,"
          "\"stream_shape\":\"%d/%d/"
          "%d\",\"stream_aligned_us\":%.2f,\"stream_sweep\":\"%s\",\"wgmma_us\":%.2f,\"wgmma_shape\":\"%d/"
          "%d/%d\",\"max_rel_err\":%.2e,"
          "\"stream_err\":%.2e,\"wgmma_err\":%.2e,\"grouped_us\":%.2f,\"grouped_status\":%d,\"grouped_err\":%"
          ".2e,"
          "\"wgmma32_us\":%.2f,\"wgmma_fp8_us\":%.2f,\"wgmma_fp8_err\":%.2e,\"read_us\":%.2f,\"dense_us\":%."
          "2f,"
          "\"runs\":%d,\"launches\":%d,\"copies\":%d,\"method\":\"graph\"}\n",
          W.name, (long long)experts, topk, (long long)T, hit.size(), (long long)n, (long long)k, q_us,
          kernel_name(plan.kernel), plan.tile_m, plan.rows, plan.split_k, p_us, p_us / q_us, ceiling,
          ceiling / q_us, hit_q, s_us, plan_s.tile_m, plan_s.rows, plan_s.split_k, a_us, sweep_s.c_str(),
          w_us, plan_w.tile_m, plan_w.rows, plan_w.split_k, err, err_s, err_w, g_us, (int)g_status, g_err,
          w32_us, f_us, err_f, r_us, d_us, 3 * kRuns, launches, copies_q);
      fflush(stdout);
      for (void *p : allocations)
        CHECK_CUDA(cudaFree(p));
      for (int c = 0; c < copies_b; c++) {
        CHECK_CUDA(cudaFree(g_a[(size_t)c]));
        CHECK_CUDA(cudaFree(g_b[(size_t)c]));
        CHECK_CUDA(cudaFree(g_c[(size_t)c]));
      }
      void *bufs[] = {d_x, d_xg, d_y, d_yg, d_rows, d_ids, d_weights, d_flat};
      for (void *p : bufs)
        CHECK_CUDA(cudaFree(p));
    }
    CHECK_CUDA(cudaFree(W.w));
    CHECK_CUDA(cudaFree(W.sf));
    CHECK_CUDA(cudaFree(W.bf16));
  }
  CHECK_CUDA(cudaFree(alpha));
  CHECK_CUDA(cudaFree(sink));
}

/* ---- torch's fp8 GEMM (bench/peer_fp8.py) ------------------------------------------------------- */

/*
 * Runs bench/peer_fp8.py (torch._scaled_mm, e4m3 weights and activations, per-tensor scales,
 * bf16 out) on the dense shapes with $QKEEP_BENCH_PYTHON (default python3): passes its JSON
 * lines through and adds one line per shape and M with qkeep's time of this run beside it;
 * a missing torch is a {"skipped": ...} line, never a failure.
 */
/* The PWAL transforms (weights tiled, block scales swizzled) of a MoE's stacked experts and of
 * Llama-3-8B's largest linears, into a new buffer and in place (pwal = in-place), against a device
 * copy of the same bytes in the same run. */
void bench_transform(cudaStream_t stream) {
  struct Case {
    const char *matrix;
    int64_t experts, rows, k;
  };
  static const Case cases[] = {{"qwen3_w13", 128, 1536, 2048},
                               {"qwen3_w2", 128, 2048, 768},
                               {"llama3_gate_up", 1, 28672, 4096},
                               {"llama3_down", 1, 4096, 14336}};
  for (const Case &c : cases) {
    const size_t codes = (size_t)(c.experts * c.rows * c.k / 2),
                 scales = (size_t)(c.experts * c.rows * c.k / 16);
    const size_t tiled = (size_t)(c.experts * nvfp4_w_bytes(c.rows, c.k)),
                 swizzled = (size_t)(c.experts * nvfp4_sf_bytes(c.rows, c.k / 16));
    uint8_t *w, *w_out, *sf, *sf_out;
    CHECK_CUDA(cudaMalloc(&w, codes));
    CHECK_CUDA(cudaMalloc(&w_out, tiled));
    CHECK_CUDA(cudaMalloc(&sf, scales));
    CHECK_CUDA(cudaMalloc(&sf_out, swizzled));
    CHECK_CUDA(cudaMemsetAsync(w, 0x5a, codes, stream));
    CHECK_CUDA(cudaMemsetAsync(sf, 0x38, scales, stream));
    double tile_us = time_us(stream, 1, [&](int) {
      CHECK_CUDA((cudaError_t)nvfp4_tile_weights_gpu(w, w_out, c.experts, c.rows, c.k, stream));
    });
    double swizzle_us = time_us(stream, 1, [&](int) {
      CHECK_CUDA((cudaError_t)nvfp4_swizzle_scales_gpu(sf, sf_out, c.experts, c.rows, c.k / 16, stream));
    });
    /* In place (the default PWAL for these shapes): the same permutation over the checkpoint bytes. */
    double tile_in_place_us = time_us(stream, 1, [&](int) {
      CHECK_CUDA((cudaError_t)nvfp4_tile_weights_in_place_gpu(w, c.experts, c.rows, c.k, stream));
    });
    double swizzle_in_place_us = time_us(stream, 1, [&](int) {
      CHECK_CUDA((cudaError_t)nvfp4_swizzle_scales_in_place_gpu(sf, c.experts, c.rows, c.k / 16, stream));
    });
    double copy_us = time_us(stream, 1, [&](int) {
      CHECK_CUDA(cudaMemcpyAsync(w_out, w, codes, cudaMemcpyDeviceToDevice, stream));
      CHECK_CUDA(cudaMemcpyAsync(sf_out, sf, scales, cudaMemcpyDeviceToDevice, stream));
    });
    printf("{\"bench\":\"nvfp4_transform\",\"matrix\":\"%s\",\"experts\":%lld,\"rows\":%lld,\"k\":%lld,"
           "\"bytes\":%zu,\"tile_us\":%.1f,\"swizzle_us\":%.1f,\"tile_in_place_us\":%.1f,"
           "\"swizzle_in_place_us\":%.1f,\"peer\":\"d2d_copy\",\"peer_us\":%.1f,\"of_copy\":%.3f,"
           "\"in_place_of_copy\":%.3f}\n",
           c.matrix, (long long)c.experts, (long long)c.rows, (long long)c.k, codes + scales, tile_us,
           swizzle_us, tile_in_place_us, swizzle_in_place_us, copy_us, copy_us / (tile_us + swizzle_us),
           copy_us / (tile_in_place_us + swizzle_in_place_us));
    fflush(stdout);
    CHECK_CUDA(cudaFree(w));
    CHECK_CUDA(cudaFree(w_out));
    CHECK_CUDA(cudaFree(sf));
    CHECK_CUDA(cudaFree(sf_out));
  }
}

void bench_fp8_peer(void) {
  const char *python = getenv("QKEEP_BENCH_PYTHON"), *srcdir = getenv("QKEEP_TEST_SRCDIR");
  std::string cmd =
      std::string("'") + (python && *python ? python : "python3") + "' '" +
      (srcdir && *srcdir ? srcdir : ".") +
      "/bench/peer_fp8.py' --shapes 8192x8192,4096x14336,14336x4096 --ms 1,4,16,32,64,128,256,1024 "
      "2>&1";
  FILE *p = popen(cmd.c_str(), "r");
  if (!p) {
    printf("{\"bench\":\"fp8_scaled_mm\",\"skipped\":\"cannot run %s\"}\n", python ? python : "python3");
    return;
  }
  char line[4096];
  while (fgets(line, sizeof line, p)) {
    fputs(line, stdout);
    long long m, n, k;
    double us;
    const char *mm = strstr(line, "\"M\": "), *nn = strstr(line, "\"N\": "), *kk = strstr(line, "\"K\": "),
               *tt = strstr(line, "\"fp8_us\": ");
    if (mm && nn && kk && tt && sscanf(mm + 5, "%lld", &m) == 1 && sscanf(nn + 5, "%lld", &n) == 1 &&
        sscanf(kk + 5, "%lld", &k) == 1 && sscanf(tt + 10, "%lf", &us) == 1)
      for (const DenseTime &d : dense_times)
        if (d.m == m && d.n == n && d.k == k)
          printf("{\"bench\":\"nvfp4_vs_fp8\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"qkeep_us\":%.2f,"
                 "\"peer\":\"torch_scaled_mm_fp8\",\"peer_us\":%.2f,\"ratio\":%.2f}\n",
                 m, n, k, d.us, us, us / d.us);
    fflush(stdout);
  }
  int rc = pclose(p);
  if (rc != 0)
    printf("{\"bench\":\"fp8_scaled_mm\",\"skipped\":\"bench/peer_fp8.py exited with status %d\"}\n", rc);
}

/* ---- a load through the plugin ------------------------------------------------------------------ */

/* Writes an unquantized bf16 safetensors file of the given tensors ([rows, cols] each). */
void write_bf16_safetensors(const std::string &path,
                            const std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> &tensors) {
  std::string header = "{";
  size_t offset = 0;
  for (size_t i = 0; i < tensors.size(); i++) {
    size_t bytes = (size_t)(tensors[i].second.first * tensors[i].second.second) * 2;
    char entry[512];
    snprintf(entry, sizeof entry,
             "%s\"%s\":{\"dtype\":\"BF16\",\"shape\":[%lld,%lld],\"data_offsets\":[%zu,%zu]}", i ? "," : "",
             tensors[i].first.c_str(), (long long)tensors[i].second.first,
             (long long)tensors[i].second.second, offset, offset + bytes);
    header += entry;
    offset += bytes;
  }
  header += "}";
  while (header.size() % 8)
    header += ' ';
  FILE *f = fopen(path.c_str(), "wb");
  if (!f) {
    perror(path.c_str());
    exit(1);
  }
  uint64_t len = header.size();
  fwrite(&len, 8, 1, f);
  fwrite(header.data(), 1, header.size(), f);
  std::vector<uint16_t> row;
  uint64_t state = 12345;
  for (auto &t : tensors) {
    size_t count = (size_t)(t.second.first * t.second.second);
    row.resize(count);
    for (size_t i = 0; i < count; i++) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      float v = ((float)((state >> 40) % 2001) / 1000.0f - 1.0f) * 0.05f;
      uint32_t bits;
      memcpy(&bits, &v, 4);
      row[i] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    }
    fwrite(row.data(), 2, count, f);
  }
  fclose(f);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/* One Llama-3-8B-sized decoder layer (hidden 4096, intermediate 14336, 8 kv heads), quantized to
 * modelopt-nvfp4 and loaded through the plugin: PWAL time per layer, reload, and peak memory. */
void bench_load(void) {
  const char *builddir = getenv("QKEEP_TEST_BUILDDIR");
  std::string plugin = std::string(builddir ? builddir : ".") + "/plugins/cuda/.libs/backend-cuda-nvfp4.so";
  char tmpl[] = "/tmp/bench_nvfp4.XXXXXX";
  if (!mkdtemp(tmpl)) {
    perror("mkdtemp");
    exit(1);
  }
  std::string dir = tmpl, source = dir + "/source.safetensors", ckpt = dir + "/q";
  const int64_t h = 4096, inter = 14336, kv = 1024;
  write_bf16_safetensors(source, {{"model.layers.0.self_attn.q_proj.weight", {h, h}},
                                  {"model.layers.0.self_attn.k_proj.weight", {kv, h}},
                                  {"model.layers.0.self_attn.v_proj.weight", {kv, h}},
                                  {"model.layers.0.self_attn.o_proj.weight", {h, h}},
                                  {"model.layers.0.mlp.gate_proj.weight", {inter, h}},
                                  {"model.layers.0.mlp.up_proj.weight", {inter, h}},
                                  {"model.layers.0.mlp.down_proj.weight", {h, inter}}});
  qkeep_quantize_options opt = {};
  opt.size = sizeof opt, opt.scheme = "modelopt-nvfp4", opt.activation_amax = 4;
  if (qkeep_quantize(source.c_str(), ckpt.c_str(), &opt)) {
    fprintf(stderr, "bench_nvfp4: quantize: %s\n", qkeep_errmsg());
    exit(1);
  }
  qkeep_plugin *p;
  qkeep_model *m;
  if (qkeep_plugin_open_path(plugin.c_str(), &p) || qkeep_model_new(p, &m) ||
      qkeep_model_load(m, ckpt.c_str())) {
    fprintf(stderr, "bench_nvfp4: load: %s\n", qkeep_errmsg());
    exit(1);
  }
  qkeep_load_stats stats = {};
  stats.size = sizeof stats;
  qkeep_memory_stats mem = {};
  mem.size = sizeof mem;
  qkeep_model_load_stats(m, &stats);
  qkeep_model_memory(m, &mem, true);
  int layers = 0;
  for (size_t i = 0; i < qkeep_model_layer_count(m); i++) {
    qkeep_layer_info info = {};
    info.size = sizeof info;
    qkeep_layer_get_info(qkeep_model_layer(m, i), &info);
    layers += strcmp(info.scheme, "modelopt-nvfp4") == 0;
  }
  auto t0 = std::chrono::steady_clock::now();
  int rc = qkeep_model_reload(m, ckpt.c_str(), 0);
  double reload_s = seconds_since(t0);
  qkeep_memory_stats mem2 = {};
  mem2.size = sizeof mem2;
  qkeep_model_memory(m, &mem2, false);
  printf(
      "{\"bench\":\"nvfp4_pwal\",\"layers\":%d,\"pwal_ms_per_layer\":%.2f,\"load_s\":%.3f,\"read_s\":%.3f,"
      "\"checkpoint_bytes\":%lld,\"storage_bytes\":%lld,\"storage_peak\":%lld,\"peak_over_checkpoint\":%.3f,"
      "\"reload_s\":%.3f,\"reload_rc\":%d,\"reload_storage_peak\":%lld,\"reload_staging_peak\":%lld}\n",
      layers, 1000.0 * stats.pwal_seconds / (layers ? layers : 1),
      stats.open_seconds + stats.read_seconds + stats.pwal_seconds, stats.read_seconds,
      (long long)stats.checkpoint_bytes, (long long)mem.storage_bytes, (long long)mem.storage_peak,
      (double)mem.storage_peak / (double)stats.checkpoint_bytes, reload_s, rc, (long long)mem2.storage_peak,
      (long long)mem2.staging_peak);
  qkeep_model_free(m);
  qkeep_plugin_close(p);
  std::string rm = "rm -rf '" + dir + "'";
  if (system(rm.c_str()) != 0)
    fprintf(stderr, "bench_nvfp4: could not remove %s\n", dir.c_str());
}

} // namespace

int main(void) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    printf("{\"bench\":\"nvfp4\",\"skipped\":\"no CUDA device\"}\n");
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
  const char *sweep = getenv("QKEEP_BENCH_SWEEP"), *parts = getenv("QKEEP_BENCH_PARTS");
  auto part = [parts](const char *name) { return !parts || !*parts || strstr(parts, name) != nullptr; };
  if (part("transform"))
    bench_transform(stream);
  if (part("moe"))
    bench_moe(blas, stream, bw, prop.multiProcessorCount, prop.major == 9 && prop.minor == 0);
  if (part("dense"))
    bench_gemm(blas, stream, bw, sweep && *sweep && strcmp(sweep, "0") != 0 ? sweep : nullptr);
  CHECK_CUBLAS(cublasDestroy(blas));
  CHECK_CUDA(cudaFree(blas_workspace));
  CHECK_CUDA(cudaStreamDestroy(stream));
  if (part("fp8"))
    bench_fp8_peer();
  if (part("load"))
    bench_load();
  return 0;
}
