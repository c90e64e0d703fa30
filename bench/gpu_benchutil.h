/*
 * gpu_benchutil.h: what the CUDA benchmarks (bench_nvfp4, bench_mxfp4) share: error
 * checks that exit, random bf16 activations, the graph timing of back-to-back launches
 * cycling weight copies out of L2, the device copy bandwidth (the ceilings' divisor) and
 * the bf16 output comparison. Header-only, for one translation unit each.
 */
#ifndef QKEEP_BENCH_GPU_BENCHUTIL_H
#define QKEEP_BENCH_GPU_BENCHUTIL_H

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CHECK_CUDA(x)                                                                                        \
  do {                                                                                                       \
    cudaError_t err_ = (x);                                                                                  \
    if (err_ != cudaSuccess) {                                                                               \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_));                  \
      exit(1);                                                                                               \
    }                                                                                                        \
  } while (0)
#define CHECK_CUBLAS(x)                                                                                      \
  do {                                                                                                       \
    cublasStatus_t st_ = (x);                                                                                \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                                      \
      fprintf(stderr, "%s:%d: %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)st_);                    \
      exit(1);                                                                                               \
    }                                                                                                        \
  } while (0)

namespace {

constexpr size_t kCycleBytes = size_t(512) << 20; /* per side, to stay out of L2 */
constexpr int kRuns = 7;
constexpr int kMinLaunches = 200;

/* Activations uniform in [-1, 1] in steps of 1/1000, deterministic. */
__global__ void random_bf16_kernel(__nv_bfloat16 *x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint64_t z = (i + seed) * 0x9e3779b97f4a7c15ULL;
    z ^= z >> 29, z *= 0xbf58476d1ce4e5b9ULL, z ^= z >> 32;
    x[i] = __float2bfloat16((float)((z >> 40) % 2001) / 1000.0f - 1.0f);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/* Microseconds per launch of `launch(copy)`, cycling copies, through a CUDA graph of at least
 * kMinLaunches launches; the median of kRuns graph runs after a warm-up. */
double time_us(cudaStream_t stream, int copies, const std::function<void(int)> &launch,
               int *launches_out = nullptr) {
  int passes = (kMinLaunches + copies - 1) / copies, launches = passes * copies;
  for (int c = 0; c < copies; c++) /* warm-up, outside the graph */
    launch(c);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int p = 0; p < passes; p++)
    for (int c = 0; c < copies; c++)
      launch(c);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphLaunch(exec, stream)); /* warm-up of the graph */
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> runs;
  for (int r = 0; r < kRuns; r++) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    runs.push_back(1000.0 * ms / launches);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  if (launches_out)
    *launches_out = launches;
  return median(runs);
}

/* Device-to-device copy bandwidth (read + write bytes per second); prints its JSON line. */
double copy_bandwidth(cudaStream_t stream) {
  size_t bytes = size_t(1) << 30;
  void *a, *b;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemsetAsync(a, 1, bytes, stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> runs;
  for (int r = 0; r < kRuns + 1; r++) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream));
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (r)
      runs.push_back(2.0 * (double)bytes / (ms / 1000.0));
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  double bw = median(runs);
  printf("{\"bench\":\"d2d_copy\",\"bytes\":%zu,\"gbps\":%.1f,\"runs\":%d}\n", bytes, bw / 1e9, kRuns);
  return bw;
}

/* n bf16 values of two device arrays, as doubles on the host. */
void to_host(const __nv_bfloat16 *a, const __nv_bfloat16 *b, size_t n, std::vector<double> &ha,
             std::vector<double> &hb) {
  std::vector<__nv_bfloat16> ta(n), tb(n);
  CHECK_CUDA(cudaMemcpy(ta.data(), a, n * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(tb.data(), b, n * 2, cudaMemcpyDeviceToHost));
  ha.resize(n), hb.resize(n);
  for (size_t i = 0; i < n; i++)
    ha[i] = __bfloat162float(ta[i]), hb[i] = __bfloat162float(tb[i]);
}

/* max |a - b| / max |b| over n bf16 values on the device (NaN counts as the worst). */
double compare(const __nv_bfloat16 *a, const __nv_bfloat16 *b, size_t n) {
  std::vector<double> ha, hb;
  to_host(a, b, n, ha, hb);
  double err = 0, ref = 0;
  for (size_t i = 0; i < n; i++) {
    double d = std::fabs(ha[i] - hb[i]);
    if (!(d <= err))
      err = d;
    ref = std::max(ref, std::fabs(hb[i]));
  }
  return ref > 0 ? err / ref : err;
}

/* The root mean square of a - b over that of b (two bf16 device arrays of n values). */
double compare_rms(const __nv_bfloat16 *a, const __nv_bfloat16 *b, size_t n) {
  std::vector<double> ha, hb;
  to_host(a, b, n, ha, hb);
  double err = 0, ref = 0;
  for (size_t i = 0; i < n; i++) {
    err += (ha[i] - hb[i]) * (ha[i] - hb[i]);
    ref += hb[i] * hb[i];
  }
  return ref > 0 ? std::sqrt(err / ref) : std::sqrt(err);
}

} // namespace

/* Random code bytes, and scale bytes uniform in [scale_base, scale_base + scale_span), deterministic from
 * the seed (a splitmix of each index): the weights a bench times, in the checkpoint's layout. */
static __global__ void gbu_fill_kernel(uint8_t *codes, size_t n_codes, uint8_t *scales, size_t n_scales,
                                       uint64_t seed, unsigned scale_base, unsigned scale_span) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_codes;
       i += (size_t)gridDim.x * blockDim.x) {
    uint64_t z = (i + seed) * 0x9e3779b97f4a7c15ULL;
    z ^= z >> 31, z *= 0xbf58476d1ce4e5b9ULL, z ^= z >> 29;
    codes[i] = (uint8_t)z;
    if (i < n_scales)
      scales[i] = (uint8_t)(scale_base + (z >> 40) % scale_span);
  }
}

#endif
