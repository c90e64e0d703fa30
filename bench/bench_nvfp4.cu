/*
 * bench_nvfp4.cu: the cuda-nvfp4 W4A16 GEMM against cuBLAS bf16 on the same
 * layer (the NVFP4 weights dequantised to bf16), and the bandwidth ceiling,
 * in one process; then PWAL time and peak device memory of a load through
 * the plugin. One JSON object per line (docs/BENCHMARKING.md):
 *
 *   {"bench":"d2d_copy", ...}                          the ceiling's bandwidth
 *   {"bench":"nvfp4_w4a16","M":..,"N":..,"K":.., "qkeep_us":.., "peer":"cublas_bf16",
 *    "peer_us":.., "ratio":.., "ceiling_us":.., "of_ceiling":.., ...}
 *   {"bench":"nvfp4_pwal", ...}
 *   {"bench":"nvfp4_sweep", ...}                        with QKEEP_BENCH_SWEEP=1: every kernel shape
 *                                                       (=stream: only the streaming kernel's, m <= 16;
 *                                                       =wgmma: the streaming and wgmma kernels')
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
#include "layout.h"
#include "qkeep.h"

#define CHECK_CUDA(x)                                                                                        \
  do {                                                                                                       \
    cudaError_t err_ = (x);                                                                                  \
    if (err_ != cudaSuccess) {                                                                               \
      fprintf(stderr, "bench_nvfp4: %s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_));     \
      exit(1);                                                                                               \
    }                                                                                                        \
  } while (0)
#define CHECK_CUBLAS(x)                                                                                      \
  do {                                                                                                       \
    cublasStatus_t st_ = (x);                                                                                \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                                      \
      fprintf(stderr, "bench_nvfp4: %s:%d: %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)st_);       \
      exit(1);                                                                                               \
    }                                                                                                        \
  } while (0)

namespace {

constexpr size_t kCycleBytes = size_t(512) << 20; /* per side, to stay out of L2 */
constexpr int kRuns = 7;
constexpr int kMinLaunches = 200;

/* Random linear codes and e4m3 scales in [2^-2, 2^2) (bytes 0x28..0x47), deterministic. */
__global__ void fill_kernel(uint8_t *codes, size_t n_codes, uint8_t *scales, size_t n_scales, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_codes;
       i += (size_t)gridDim.x * blockDim.x) {
    uint64_t z = (i + seed) * 0x9e3779b97f4a7c15ULL;
    z ^= z >> 31, z *= 0xbf58476d1ce4e5b9ULL, z ^= z >> 29;
    codes[i] = (uint8_t)z;
    if (i < n_scales)
      scales[i] = (uint8_t)(0x28 + (z >> 40) % 32);
  }
}

__global__ void random_bf16_kernel(__nv_bfloat16 *x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint64_t z = (i + seed) * 0x9e3779b97f4a7c15ULL;
    z ^= z >> 29, z *= 0xbf58476d1ce4e5b9ULL, z ^= z >> 32;
    x[i] = __float2bfloat16((float)((z >> 40) % 2001) / 1000.0f - 1.0f);
  }
}

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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/* Microseconds per launch of `launch(copy)`, cycling copies, through a CUDA graph. */
double time_us(cudaStream_t stream, int copies, const std::function<void(int)> &launch, int *launches_out) {
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

/* Device-to-device copy bandwidth (read + write bytes per second). */
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
  fill_kernel<<<1024, 256, 0, stream>>>(lin_codes, codes, lin_scales, scales, (uint64_t)(n * 7 + k));
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

float bf16_value(__nv_bfloat16 v) { return __bfloat162float(v); }

/* max |a - b| / max |b| over n bf16 values on the device. */
double compare(const __nv_bfloat16 *a, const __nv_bfloat16 *b, size_t n) {
  std::vector<__nv_bfloat16> ha(n), hb(n);
  CHECK_CUDA(cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hb.data(), b, n * 2, cudaMemcpyDeviceToHost));
  double err = 0, ref = 0;
  for (size_t i = 0; i < n; i++) {
    double d = std::fabs((double)bf16_value(ha[i]) - bf16_value(hb[i]));
    if (!(d <= err))
      err = d;
    ref = std::max(ref, std::fabs((double)bf16_value(hb[i])));
  }
  return ref > 0 ? err / ref : err;
}

void bench_gemm(cublasHandle_t blas, cudaStream_t stream, double bandwidth, const char *sweep) {
  uint32_t *sink;
  CHECK_CUDA(cudaMalloc(&sink, sizeof *sink));
  static const int64_t shapes[][2] = {{8192, 8192}, {4096, 14336}, {14336, 4096}};
  static const int64_t ms[] = {1, 4, 16, 32, 64, 128, 256, 1024};
  const int64_t max_m = 1024;
  for (auto &shape : shapes) {
    Layer L = make_layer(shape[0], shape[1], stream);
    const int64_t n = L.n, k = L.k;
    __nv_bfloat16 *x, *y, *y_ref;
    CHECK_CUDA(cudaMalloc(&x, (size_t)(max_m * k) * 2));
    CHECK_CUDA(cudaMalloc(&y, (size_t)(max_m * n) * 2));
    CHECK_CUDA(cudaMalloc(&y_ref, (size_t)(max_m * n) * 2));
    random_bf16_kernel<<<256, 256, 0, stream>>>(x, (size_t)(max_m * k), 11);
    CHECK_CUDA(cudaGetLastError());
    const double read_bytes = (double)(nvfp4_w_bytes(n, k) + nvfp4_sf_bytes(n, k / 16));
    for (int64_t m : ms) {
      nvfp4_tuning plan;
      nvfp4_gemm_plan(m, n, k, QKEEP_DTYPE_BF16, nullptr, &plan);
      auto qkeep_with = [&](const nvfp4_tuning *tune) {
        return [&, tune](int c) {
          CHECK_CUDA((cudaError_t)nvfp4_gemm_run(&L.q[c], 0, m, x, QKEEP_DTYPE_BF16, y, QKEEP_DTYPE_BF16,
                                                 tune, stream));
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
      double q_us = median(q_runs), p_us = median(p_runs), ceiling = 1e6 * read_bytes / bandwidth;
      printf(
          "{\"bench\":\"nvfp4_w4a16\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"qkeep_us\":%.2f,"
          "\"peer\":\"cublas_bf16\",\"peer_us\":%.2f,\"ratio\":%.2f,\"ceiling_us\":%.2f,\"of_ceiling\":%.2f,"
          "\"weight_tbps\":%.2f,\"stream_us\":%.2f,\"kernel\":\"%s\",\"tile_m\":%d,\"split_k\":%d,"
          "\"rows\":%d,\"unroll\":%d,\"max_rel_err\":%.2e,\"runs\":%d,\"launches\":%d,\"method\":\"graph\"}"
          "\n",
          (long long)m, (long long)n, (long long)k, q_us, p_us, p_us / q_us, ceiling, ceiling / q_us,
          read_bytes / q_us / 1e6, s_us, kernel_name(plan.kernel), plan.tile_m, plan.split_k, plan.rows,
          plan.unroll, err, 3 * kRuns, launches);
      fflush(stdout);
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
              double e, us = measure({0, sk, dp, NVFP4_KERNEL_STREAM, rw, u}, &e);
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
              double e, us = measure({tm, sk, 0, NVFP4_KERNEL_WGMMA, rw, 0}, &e);
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
            double e, us = measure({tm, sk, dp, NVFP4_KERNEL_RING, 0, 0}, &e);
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
    free_layer(L);
  }
  CHECK_CUDA(cudaFree(sink));
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
  const char *sweep = getenv("QKEEP_BENCH_SWEEP");
  bench_gemm(blas, stream, bw, sweep && *sweep && strcmp(sweep, "0") != 0 ? sweep : nullptr);
  CHECK_CUBLAS(cublasDestroy(blas));
  CHECK_CUDA(cudaFree(blas_workspace));
  CHECK_CUDA(cudaStreamDestroy(stream));
  bench_load();
  return 0;
}
