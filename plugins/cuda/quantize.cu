/*
 * quantize.cu: online quantization on the GPU (the backend's quantize slot, ABI 1.5): NVFP4 in both
 * namings (ModelOpt, compressed-tensors) and MXFP4, from F32, F16 or BF16 weights, giving the bytes
 * of the core's host quantizer (libqkeep/quantize/quantize.c) for every input.
 *
 * Two kernels per member. The scan reads every value once: the max magnitude (as the bits of the
 * float magnitude, whose unsigned order is the magnitudes' for finite values, so any order of
 * reduction gives the host's amax exactly) and the first NaN or Inf (its row-major index, by an
 * atomic minimum). The host side reads both back before anything is written, so a refused unit
 * leaves every output as it was. The quantization then runs one thread per block of 16 (NVFP4) or
 * 32 (MXFP4) values: the block's amax, its scale byte, the codes (fp4_quant.h, the arithmetic a CPU
 * test checks against the host quantizer).
 *
 * Numerics as the host's, step by step: every float operation is an explicit IEEE round-to-nearest
 * intrinsic (__fdiv_rn, __fmul_rn), so neither contraction nor a fast division can change a bit;
 * rounding to an integer is __float2int_rn (ties to even, as round_half_even); scale bytes are built
 * from the float's bits as e4m3_code and qk_e8m0_from_amax build them; and the plugin is built
 * without -use_fast_math or -ftz, so subnormal inputs, scales and quotients are kept as the host
 * keeps them. The global scales (amax / 2688, 2688 / amax) come from the host, divided there.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "cuda_nvfp4.h"
#include "fp4_quant.h"

namespace {

constexpr int kThreads = 256;

/* ---- loading values ---------------------------------------------------------------------------- */

template <int DT> struct elem {
  using type = typename std::conditional<DT == QKEEP_DTYPE_F32, uint32_t, uint16_t>::type;
};

/* The f32 bits of one element's own encoding e (dtype: F32, F16 or BF16). F16 converts exactly
 * (subnormals too). */
template <int DT> __device__ __forceinline__ uint32_t bits_of(uint32_t e) {
  if (DT == QKEEP_DTYPE_F32)
    return e;
  if (DT == QKEEP_DTYPE_BF16)
    return e << 16;
  return __float_as_uint(__half2float(__ushort_as_half(static_cast<uint16_t>(e))));
}

/* Whether the encoding e has its exponent all ones (NaN or Inf). */
template <int DT> __device__ __forceinline__ bool not_finite(uint32_t e) {
  if (DT == QKEEP_DTYPE_F32)
    return (e & 0x7f800000u) == 0x7f800000u;
  return DT == QKEEP_DTYPE_BF16 ? (e & 0x7f80u) == 0x7f80u : (e & 0x7c00u) == 0x7c00u;
}

/* Values first .. first + N - 1 of src as floats: 16-byte loads that bypass L1 (each value is read
 * once) where src is 16-byte aligned (vec; N values are a multiple of 16 bytes), else one by one. */
template <int DT, int N>
__device__ __forceinline__ void load_values(const void *src, int64_t first, bool vec, float (&x)[N]) {
  using E = typename elem<DT>::type;
  const E *p = static_cast<const E *>(src) + first;
  if (vec) {
    constexpr int kVectors = N * static_cast<int>(sizeof(E)) / 16;
    uint4 raw[kVectors];
#pragma unroll
    for (int i = 0; i < kVectors; i++)
      raw[i] = __ldcs(reinterpret_cast<const uint4 *>(p) + i);
    const E *e = reinterpret_cast<const E *>(raw);
#pragma unroll
    for (int j = 0; j < N; j++)
      x[j] = __uint_as_float(bits_of<DT>(e[j]));
    return;
  }
#pragma unroll
  for (int j = 0; j < N; j++)
    x[j] = __uint_as_float(bits_of<DT>(p[j]));
}

/* ---- the scan ----------------------------------------------------------------------------------------- */

/* Folds element i (encoding e) into the running max magnitude bits and first non-finite index. */
template <int DT>
__device__ __forceinline__ void scan_one(uint32_t e, int64_t i, uint32_t &top, unsigned long long &bad) {
  if (not_finite<DT>(e)) {
    bad = static_cast<unsigned long long>(i) < bad ? static_cast<unsigned long long>(i) : bad;
    return;
  }
  uint32_t a = bits_of<DT>(e) & 0x7fffffffu;
  top = a > top ? a : top;
}

/* Folds one 16-byte vector of elements (the first's index `first`) into top and bad. BF16 takes two
 * values per 32-bit word: their magnitudes' maximum by a SIMD maximum, and a carry into bit 15 of a
 * half that flags an exponent of all ones; a vector with such a value goes element by element, for
 * the index of the first. */
template <int DT>
__device__ __forceinline__ void scan_vector(const uint4 &raw, int64_t first, uint32_t &top,
                                            unsigned long long &bad) {
  using E = typename elem<DT>::type;
  constexpr int kPer = 16 / static_cast<int>(sizeof(E));
  if (DT == QKEEP_DTYPE_BF16) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    uint32_t flags = 0, pair = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
      uint32_t m = w[i] & 0x7fff7fffu;
      flags |= (m + 0x00800080u) & 0x80008000u;
      pair = __vmaxu2(pair, m);
    }
    if (!flags) {
      uint32_t most = (pair >> 16) > (pair & 0xffffu) ? (pair >> 16) : (pair & 0xffffu);
      top = (most << 16) > top ? most << 16 : top;
      return;
    }
  }
  const E *e = reinterpret_cast<const E *>(&raw);
#pragma unroll
  for (int j = 0; j < kPer; j++)
    scan_one<DT>(e[j], first + j, top, bad);
}

/* out[0]: max magnitude bits (atomicMax); out64[0]: the first non-finite element (atomicMin; ~0: none).
 * vec: src is 16-byte aligned, so whole 16-byte vectors are read, four per thread at a time (the tail
 * past the last vector singly). */
template <int DT>
__global__ void __launch_bounds__(kThreads)
    scan_kernel(const void *src, int64_t count, bool vec, uint32_t *max_bits, unsigned long long *first_bad) {
  using E = typename elem<DT>::type;
  constexpr int kPer = 16 / static_cast<int>(sizeof(E));
  const E *p = static_cast<const E *>(src);
  const uint4 *p4 = reinterpret_cast<const uint4 *>(src);
  uint32_t top = 0;
  unsigned long long bad = ~0ull;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = vec ? count / kPer : 0;
  int64_t v = first;
  for (; v + 3 * stride < vectors; v += 4 * stride) { /* four loads in flight before any is used */
    uint4 raw[4];
#pragma unroll
    for (int u = 0; u < 4; u++)
      raw[u] = __ldcs(p4 + v + u * stride);
#pragma unroll
    for (int u = 0; u < 4; u++)
      scan_vector<DT>(raw[u], (v + u * stride) * kPer, top, bad);
  }
  for (; v < vectors; v += stride)
    scan_vector<DT>(__ldcs(p4 + v), v * kPer, top, bad);
  for (int64_t i = vectors * kPer + first; i < count; i += stride)
    scan_one<DT>(p[i], i, top, bad);
  top = __reduce_max_sync(0xffffffffu, top);
  for (int off = 16; off > 0; off >>= 1) {
    unsigned long long other = __shfl_down_sync(0xffffffffu, bad, off);
    bad = other < bad ? other : bad;
  }
  if ((threadIdx.x & 31) == 0) {
    if (top)
      atomicMax(max_bits, top);
    if (bad != ~0ull)
      atomicMin(first_bad, bad);
  }
}

/* Writes n bytes (8 or 16) of codes: one vector store where aligned, else byte by byte. */
template <int N> __device__ __forceinline__ void store_codes(uint8_t *dst, const uint32_t (&word)[N / 4]) {
  if ((reinterpret_cast<uintptr_t>(dst) & (N - 1)) == 0) {
    if constexpr (N == 8)
      *reinterpret_cast<uint2 *>(dst) = make_uint2(word[0], word[1]);
    else
      *reinterpret_cast<uint4 *>(dst) = make_uint4(word[0], word[1], word[2], word[3]);
    return;
  }
  for (int i = 0; i < N; i++)
    dst[i] = static_cast<uint8_t>(word[i / 4] >> (8 * (i % 4)));
}

/* ---- the quantization kernels ------------------------------------------------------------------------ */

struct nvfp4_args {
  const void *src;
  bool vec;       /* src 16-byte aligned: whole blocks by 16-byte loads */
  int64_t blocks; /* n * k / 16 */
  uint8_t *codes, *scales;
  float ws2;    /* ModelOpt: weight_scale_2 = amax / 2688 */
  float global; /* compressed-tensors: 2688 / amax */
  bool ct;
  bool zero; /* amax 0: codes 0, every block the flavour's zero scale */
};

/* One thread per 16-block (fp4q_nvfp4_block). */
template <int DT> __global__ void __launch_bounds__(kThreads) nvfp4_quant_kernel(nvfp4_args a) {
  int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= a.blocks)
    return;
  uint32_t word[2] = {0, 0};
  if (a.zero) {
    a.scales[b] = a.ct ? FP4Q_E4M3_EIGHTH : FP4Q_E4M3_ONE;
    store_codes<8>(a.codes + 8 * b, word);
    return;
  }
  float x[16];
  load_values<DT>(a.src, 16 * b, a.vec, x);
  a.scales[b] = fp4q_nvfp4_block(x, a.ct, a.ws2, a.global, word);
  store_codes<8>(a.codes + 8 * b, word);
}

struct mxfp4_args {
  const void *src;
  bool vec;
  int64_t blocks; /* n * k / 32 */
  uint8_t *codes, *scales;
};

/* One thread per 32-block (fp4q_mxfp4_block). */
template <int DT> __global__ void __launch_bounds__(kThreads) mxfp4_quant_kernel(mxfp4_args a) {
  int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= a.blocks)
    return;
  float x[32];
  load_values<DT>(a.src, 32 * b, a.vec, x);
  uint32_t word[4];
  a.scales[b] = fp4q_mxfp4_block(x, word);
  store_codes<16>(a.codes + 16 * b, word);
}

/* ---- dispatch by dtype --------------------------------------------------------------------------------- */

bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

int grid_for(int64_t items) {
  int64_t g = (items + kThreads - 1) / kThreads;
  return static_cast<int>(g < 1 ? 1 : g);
}

} // namespace

extern "C" int fp4_quant_scan_gpu(const struct fp4_quant_member *m, void *scratch, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  struct fp4_quant_scan *out = static_cast<struct fp4_quant_scan *>(scratch);
  uint32_t *max_bits = &out->max_bits;
  unsigned long long *first_bad = &out->first_bad;
  int64_t count = m->n * m->k;
  /* One wave of resident blocks (8 of 256 threads per SM), each striding over the member with four
   * 16-byte loads in flight per thread: no tail of partly filled waves. */
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms < 1)
    sms = 132;
  int64_t grid = grid_for((count + 31) / 32), wave = 8 * static_cast<int64_t>(sms);
  int blocks = static_cast<int>(grid < wave ? grid : wave);
  bool vec = aligned16(m->src);
  switch (m->dtype) {
  case QKEEP_DTYPE_F32:
    scan_kernel<QKEEP_DTYPE_F32><<<blocks, kThreads, 0, s>>>(m->src, count, vec, max_bits, first_bad);
    break;
  case QKEEP_DTYPE_F16:
    scan_kernel<QKEEP_DTYPE_F16><<<blocks, kThreads, 0, s>>>(m->src, count, vec, max_bits, first_bad);
    break;
  case QKEEP_DTYPE_BF16:
    scan_kernel<QKEEP_DTYPE_BF16><<<blocks, kThreads, 0, s>>>(m->src, count, vec, max_bits, first_bad);
    break;
  default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

extern "C" int fp4_quant_gpu(const struct fp4_quant_member *m, enum fp4_quant_scheme scheme, float amax,
                             void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  int64_t count = m->n * m->k;
  if (scheme == FP4_QUANT_MXFP4) {
    mxfp4_args a = {m->src, aligned16(m->src), count / 32, static_cast<uint8_t *>(m->codes),
                    static_cast<uint8_t *>(m->scales)};
    if (!a.blocks)
      return 0;
    int g = grid_for(a.blocks);
    switch (m->dtype) {
    case QKEEP_DTYPE_F32: mxfp4_quant_kernel<QKEEP_DTYPE_F32><<<g, kThreads, 0, s>>>(a); break;
    case QKEEP_DTYPE_F16: mxfp4_quant_kernel<QKEEP_DTYPE_F16><<<g, kThreads, 0, s>>>(a); break;
    case QKEEP_DTYPE_BF16: mxfp4_quant_kernel<QKEEP_DTYPE_BF16><<<g, kThreads, 0, s>>>(a); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
    }
    return static_cast<int>(cudaGetLastError());
  }
  nvfp4_args a = {m->src,
                  aligned16(m->src),
                  count / 16,
                  static_cast<uint8_t *>(m->codes),
                  static_cast<uint8_t *>(m->scales),
                  0.0f,
                  0.0f,
                  scheme == FP4_QUANT_CT_NVFP4,
                  amax == 0.0f};
  if (!a.zero) { /* the host's divisions, in float32 (this is host code): quant_nvfp4_rows's ws2, ct_global */
    a.ws2 = amax / 2688.0f;
    a.global = 2688.0f / amax;
  }
  if (!a.blocks)
    return 0;
  int g = grid_for(a.blocks);
  switch (m->dtype) {
  case QKEEP_DTYPE_F32: nvfp4_quant_kernel<QKEEP_DTYPE_F32><<<g, kThreads, 0, s>>>(a); break;
  case QKEEP_DTYPE_F16: nvfp4_quant_kernel<QKEEP_DTYPE_F16><<<g, kThreads, 0, s>>>(a); break;
  case QKEEP_DTYPE_BF16: nvfp4_quant_kernel<QKEEP_DTYPE_BF16><<<g, kThreads, 0, s>>>(a); break;
  default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}
