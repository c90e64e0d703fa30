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
 * 32 (MXFP4) values: the block's amax, its scale byte, the codes.
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

#include "cuda_nvfp4.h"

namespace {

constexpr int kThreads = 256;
constexpr float kE4m3Max = 448.0f;
constexpr uint8_t kE4m3One = 0x38;    /* 1.0: ModelOpt's scale of an all-zero tensor's blocks */
constexpr uint8_t kE4m3Eighth = 0x20; /* 0.125: compressed-tensors' zero-scale fill */

/* ---- loading values ---------------------------------------------------------------------------- */

/* The f32 bits of element i of src (dtype: F32, F16 or BF16). F16 converts exactly (subnormals too). */
template <int DT> __device__ __forceinline__ uint32_t value_bits(const void *src, int64_t i) {
  if (DT == QKEEP_DTYPE_F32)
    return static_cast<const uint32_t *>(src)[i];
  uint16_t h = static_cast<const uint16_t *>(src)[i];
  if (DT == QKEEP_DTYPE_BF16)
    return static_cast<uint32_t>(h) << 16;
  return __float_as_uint(__half2float(__ushort_as_half(h)));
}

template <int DT> __device__ __forceinline__ float value(const void *src, int64_t i) {
  return __uint_as_float(value_bits<DT>(src, i));
}

/* Whether the element's own encoding has its exponent all ones (NaN or Inf). */
template <int DT> __device__ __forceinline__ bool not_finite(const void *src, int64_t i) {
  if (DT == QKEEP_DTYPE_F32)
    return (static_cast<const uint32_t *>(src)[i] & 0x7f800000u) == 0x7f800000u;
  uint16_t h = static_cast<const uint16_t *>(src)[i];
  return DT == QKEEP_DTYPE_BF16 ? (h & 0x7f80u) == 0x7f80u : (h & 0x7c00u) == 0x7c00u;
}

/* ---- the scan ----------------------------------------------------------------------------------------- */

/* out[0]: max magnitude bits (atomicMax); out64[0]: the first non-finite element (atomicMin; ~0: none). */
template <int DT>
__global__ void __launch_bounds__(kThreads)
    scan_kernel(const void *src, int64_t count, uint32_t *max_bits, unsigned long long *first_bad) {
  uint32_t top = 0;
  unsigned long long bad = ~0ull;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    if (not_finite<DT>(src, i)) {
      bad = static_cast<unsigned long long>(i) < bad ? static_cast<unsigned long long>(i) : bad;
      continue;
    }
    uint32_t a = value_bits<DT>(src, i) & 0x7fffffffu;
    top = a > top ? a : top;
  }
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

/* ---- scale bytes and codes, as quantize.c builds them ----------------------------------------------- */

/* 2^e for -127 <= e <= 127 from its bits (2^-127 is the one subnormal). */
__device__ __forceinline__ float pow2f(int e) {
  return __uint_as_float(e >= -126 ? static_cast<uint32_t>(e + 127) << 23 : 0x00400000u);
}

/* e4m3fn byte of a in [0, 448] (quantize.c's e4m3_code for a non-negative, non-NaN value). */
__device__ __forceinline__ uint8_t e4m3_code(float a) {
  if (a >= kE4m3Max)
    return 0x7e;
  int e = -6;
  if (a >= 0x1p-6f)
    e = static_cast<int>(__float_as_uint(a) >> 23) - 127;
  int units = __float2int_rn(__fmul_rn(a, pow2f(3 - e))); /* exact scaling, then ties to even */
  return static_cast<uint8_t>((e + 6) * 8 + units);
}

/* The value of an e4m3fn byte that is not NaN. */
__device__ __forceinline__ float e4m3_value(uint8_t b) {
  uint32_t exp = (b >> 3) & 0xfu, man = b & 7u;
  float v = exp == 0 ? __fmul_rn(static_cast<float>(man), 0x1p-9f)
                     : __uint_as_float((exp - 7 + 127) << 23 | man << 20);
  return b & 0x80 ? -v : v;
}

/* MXFP4's shared scale byte for a block's amax (qk_e8m0_from_amax). */
__device__ __forceinline__ uint8_t e8m0_from_amax(float amax) {
  uint32_t bits = __float_as_uint(amax) & 0x7fffffffu;
  int e;
  if (bits == 0)
    e = -126;
  else if (bits < 0x00800000u)
    e = -149 + (31 - __clz(bits)); /* floor(log2) of a subnormal */
  else
    e = static_cast<int>(bits >> 23) - 127;
  int shared = e - 2;
  shared = shared < -127 ? -127 : shared > 127 ? 127 : shared;
  return static_cast<uint8_t>(shared + 127);
}

/* e2m1 code of x / divisor (quantize.c's e2m1_pack): the bounds passed, the sign of the quotient. */
__device__ __forceinline__ uint32_t e2m1_code(float x, float divisor) {
  float v = __fdiv_rn(x, divisor), a = fabsf(v);
  uint32_t code =
      (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return code | (v < 0.0f ? 8u : 0u);
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
  int64_t blocks; /* n * k / 16 */
  uint8_t *codes, *scales;
  float ws2;    /* ModelOpt: weight_scale_2 = amax / 2688 */
  float global; /* compressed-tensors: 2688 / amax */
  bool ct;
  bool zero; /* amax 0: codes 0, every block the flavour's zero scale */
};

/* One thread per 16-block (quantize.c's nvfp4_block). */
template <int DT> __global__ void __launch_bounds__(kThreads) nvfp4_quant_kernel(nvfp4_args a) {
  int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= a.blocks)
    return;
  uint32_t word[2] = {0, 0};
  if (a.zero) {
    a.scales[b] = a.ct ? kE4m3Eighth : kE4m3One;
    store_codes<8>(a.codes + 8 * b, word);
    return;
  }
  float x[16], amax_b = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; j++) {
    x[j] = value<DT>(a.src, 16 * b + j);
    amax_b = fmaxf(amax_b, fabsf(x[j]));
  }
  float s_b;
  if (a.ct) {
    s_b = __fmul_rn(__fdiv_rn(amax_b, 6.0f), a.global);
  } else {
    s_b = __fdiv_rn(amax_b, __fmul_rn(6.0f, a.ws2));
    if (s_b == 0.0f)
      s_b = 1.0f;
  }
  uint8_t sc = e4m3_code(s_b < kE4m3Max ? s_b : kE4m3Max);
  bool zero_scale = sc == 0;
  if (zero_scale && a.ct)
    sc = kE4m3Eighth;
  a.scales[b] = sc;
  if (!zero_scale) {
    float divisor = a.ct ? __fdiv_rn(e4m3_value(sc), a.global) : __fmul_rn(e4m3_value(sc), a.ws2);
#pragma unroll
    for (int j = 0; j < 16; j++)
      word[j / 8] |= e2m1_code(x[j], divisor) << (4 * (j % 8));
  }
  store_codes<8>(a.codes + 8 * b, word);
}

struct mxfp4_args {
  const void *src;
  int64_t blocks; /* n * k / 32 */
  uint8_t *codes, *scales;
};

/* One thread per 32-block (quantize.c's quant_mxfp4_rows). */
template <int DT> __global__ void __launch_bounds__(kThreads) mxfp4_quant_kernel(mxfp4_args a) {
  int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= a.blocks)
    return;
  float x[32], amax_b = 0.0f;
#pragma unroll
  for (int j = 0; j < 32; j++) {
    x[j] = value<DT>(a.src, 32 * b + j);
    amax_b = fmaxf(amax_b, fabsf(x[j]));
  }
  uint8_t byte = e8m0_from_amax(amax_b);
  a.scales[b] = byte;
  float shared = pow2f(static_cast<int>(byte) - 127);
  uint32_t word[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < 32; j++)
    word[j / 8] |= e2m1_code(x[j], shared) << (4 * (j % 8));
  store_codes<16>(a.codes + 16 * b, word);
}

/* ---- dispatch by dtype --------------------------------------------------------------------------------- */

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
  int64_t grid = grid_for(count);
  int blocks = static_cast<int>(grid < 4096 ? grid : 4096); /* grid-stride beyond */
  switch (m->dtype) {
  case QKEEP_DTYPE_F32:
    scan_kernel<QKEEP_DTYPE_F32><<<blocks, kThreads, 0, s>>>(m->src, count, max_bits, first_bad);
    break;
  case QKEEP_DTYPE_F16:
    scan_kernel<QKEEP_DTYPE_F16><<<blocks, kThreads, 0, s>>>(m->src, count, max_bits, first_bad);
    break;
  case QKEEP_DTYPE_BF16:
    scan_kernel<QKEEP_DTYPE_BF16><<<blocks, kThreads, 0, s>>>(m->src, count, max_bits, first_bad);
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
    mxfp4_args a = {m->src, count / 32, static_cast<uint8_t *>(m->codes), static_cast<uint8_t *>(m->scales)};
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
  nvfp4_args a = {m->src, count / 16, static_cast<uint8_t *>(m->codes), static_cast<uint8_t *>(m->scales),
                  0.0f,   0.0f,       scheme == FP4_QUANT_CT_NVFP4,     amax == 0.0f};
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
