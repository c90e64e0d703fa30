/*
 * mxfp4_mma.h: the per-vendor part of the MXFP4 kernels (mxfp4_kernel.h),
 * kept to the matrix step and a few primitives:
 *
 *   MX_WAVE, MX_WAVES      lanes per wave, waves per 256-thread block
 *   MX_MMA_N, MX_A_REGS    tokens per MMA (its N), A registers per k-step
 *   mx_mma<F16>(c, a, b)   c[4] += A (16 rows x 16 K) B (16 K x MX_MMA_N), f32 accumulators
 *   mx_acc_row(i), mx_acc_token(lane, i)   which accumulator row index / token c[i] holds
 *   mx_rescale<F16>(p)     (wave 32) a register of two codes * 2^-126 (bf16 bits,
 *                          mxfp4_pair_bf16) -> the codes' exact bf16 (or f16) values
 *   mx_e8m0(s)             2^(s - 127) as f32 (s 0..254 exact)
 *   thread/block ids, a wave-uniform value, barrier, 16-byte vectors, loads, bit casts,
 *   f16 conversions.
 *
 * CUDA (nvcc, sm_90): mma.sync.m16n8k16 (row.col, f32 accumulate); A's registers
 * a0a1 a2a3 a4a5 a6a7 are rows g, g + 8, g, g + 8 (g = lane / 4) at the logical K 2t, 2t,
 * 2t + 8, 2t + 8 (t = lane % 4); B's b0b1 b2b3 token g at 2t and 2t + 8; c0c1 row g, c2c3
 * row g + 8, tokens 2t and 2t + 1. The rescale is one fma.rn.bf16x2 (or f16x2) by 2^126
 * (2^14), exact.
 * HIP (clang, gfx942): v_mfma_f32_16x16x16_bf16 (the _1k variant) / _f16; lane l holds A row
 * l % 16 and B token l % 16 at the logical K 4 (l / 16) .. + 3, and outputs rows
 * 4 (l / 16) + i, token l % 16. gfx942 has no packed bf16 multiply, so its layout stores
 * plain nibbles and the A registers come from v_perm_b32 table lookups
 * (mxfp4_w64_operand: 8 instructions for four codes, bf16 or f16, no rescale); the e8m0
 * scale is one v_ldexp_f32 (255, e8m0's NaN, gives 2^128 there).
 * Compiled without the HIP headers (-nogpuinc): the few attributes and builtins are spelt out.
 */
#ifndef QKEEP_GPU_MXFP4_MMA_H
#define QKEEP_GPU_MXFP4_MMA_H

#include <stdint.h>

#include "mxfp4_layout.h"

#if defined(__HIP__)
/* ---------------------------------------------------------------- HIP, gfx942, wave 64 */
#ifndef __global__
#define __global__ __attribute__((global))
#endif
#ifndef __device__
#define __device__ __attribute__((device))
#endif
#ifndef __host__
#define __host__ __attribute__((host))
#endif
#ifndef __shared__
#define __shared__ __attribute__((shared))
#endif
#define MX_GLOBAL __global__
#define MX_DEVICE __device__
#define MX_SHARED __shared__
#define MX_BOUNDS __attribute__((amdgpu_flat_work_group_size(1, 256)))
#define MX_WAVE 64
#define MX_WAVES 4
#define MX_MMA_N 16
#define MX_A_REGS 2

/* A 16-byte vector (.x .y .z .w): a vector type, so that it lives in registers, never in scratch. */
typedef uint32_t mx_u4 __attribute__((ext_vector_type(4)));

MX_DEVICE inline int mx_thread() { return (int)__builtin_amdgcn_workitem_id_x(); }
/* A value the same in every lane of the wave, so kept in a scalar register. */
MX_DEVICE inline int mx_uniform(int v) { return __builtin_amdgcn_readfirstlane(v); }
MX_DEVICE inline int mx_block_x() { return (int)__builtin_amdgcn_workgroup_id_x(); }
MX_DEVICE inline int mx_block_y() { return (int)__builtin_amdgcn_workgroup_id_y(); }
MX_DEVICE inline int mx_block_z() { return (int)__builtin_amdgcn_workgroup_id_z(); }
/* Blocks along x: the dispatch packet's grid size over the work-group size. */
MX_DEVICE inline int mx_grid_x() {
  const uint16_t *packet = (const uint16_t *)__builtin_amdgcn_dispatch_ptr();
  const uint32_t grid = ((const uint32_t *)packet)[3]; /* grid_size_x, byte 12 */
  return (int)(grid / packet[2]);                      /* workgroup_size_x, byte 4 */
}
MX_DEVICE inline void mx_barrier() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
MX_DEVICE inline float mx_bits_f32(uint32_t u) { return __builtin_bit_cast(float, u); }
MX_DEVICE inline uint32_t mx_f32_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
MX_DEVICE inline float mx_f16_bits_to_f32(uint16_t h) { return (float)__builtin_bit_cast(_Float16, h); }
MX_DEVICE inline uint16_t mx_f32_to_f16_bits(float f) { return __builtin_bit_cast(uint16_t, (_Float16)f); }

template <int N> MX_DEVICE inline void mx_load_words(const uint8_t *p, uint32_t *out) {
  typedef uint32_t vec __attribute__((ext_vector_type(N)));
  const vec v = *(const vec *)p;
  for (int i = 0; i < N; i++)
    out[i] = v[i];
}

MX_DEVICE inline float mx_e8m0(unsigned s) { return __builtin_amdgcn_ldexpf(0x1p-127f, (int)s); }

template <bool F16> MX_DEVICE inline void mx_mma(float *c, const uint32_t *a, const uint32_t *b) {
  typedef float float4_t __attribute__((ext_vector_type(4)));
  float4_t acc = {c[0], c[1], c[2], c[3]};
  if (F16) {
    typedef _Float16 half4 __attribute__((ext_vector_type(4)));
    typedef uint32_t u2 __attribute__((ext_vector_type(2)));
    const u2 av = {a[0], a[1]}, bv = {b[0], b[1]};
    acc = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(half4, av), __builtin_bit_cast(half4, bv),
                                                acc, 0, 0, 0);
  } else {
    typedef short short4 __attribute__((ext_vector_type(4)));
    typedef uint32_t u2 __attribute__((ext_vector_type(2)));
    const u2 av = {a[0], a[1]}, bv = {b[0], b[1]};
    acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(short4, av),
                                                    __builtin_bit_cast(short4, bv), acc, 0, 0, 0);
  }
  c[0] = acc[0], c[1] = acc[1], c[2] = acc[2], c[3] = acc[3];
}

MX_DEVICE inline int mx_acc_row(int i) { return i; }
MX_DEVICE inline int mx_acc_token(int lane, int i) {
  (void)i;
  return lane % 16;
}

#else
/* ---------------------------------------------------------------- CUDA, sm_90, wave 32 */
#define MX_GLOBAL __global__
#define MX_DEVICE __device__
#define MX_SHARED __shared__
#define MX_BOUNDS __launch_bounds__(256)
#define MX_WAVE 32
#define MX_WAVES 8
#define MX_MMA_N 8
#define MX_A_REGS 4

struct __align__(16) mx_u4 {
  uint32_t x, y, z, w;
};

MX_DEVICE inline int mx_thread() { return (int)threadIdx.x; }
MX_DEVICE inline int mx_uniform(int v) { return v; }
MX_DEVICE inline int mx_block_x() { return (int)blockIdx.x; }
MX_DEVICE inline int mx_block_y() { return (int)blockIdx.y; }
MX_DEVICE inline int mx_block_z() { return (int)blockIdx.z; }
MX_DEVICE inline int mx_grid_x() { return (int)gridDim.x; }
MX_DEVICE inline void mx_barrier() { __syncthreads(); }
MX_DEVICE inline float mx_bits_f32(uint32_t u) { return __uint_as_float(u); }
MX_DEVICE inline uint32_t mx_f32_bits(float f) { return __float_as_uint(f); }
MX_DEVICE inline float mx_f16_bits_to_f32(uint16_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
MX_DEVICE inline uint16_t mx_f32_to_f16_bits(float f) {
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

/* Streaming loads (the weights are read once per launch): no L1 allocation. */
template <int N> MX_DEVICE inline void mx_load_words(const uint8_t *p, uint32_t *out) {
  if (N == 4) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
        : "l"(p));
  } else if (N == 2) {
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(out[0]), "=r"(out[1]) : "l"(p));
  } else {
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(out[0]) : "l"(p));
  }
}

template <bool F16> MX_DEVICE inline uint32_t mx_rescale(uint32_t p) {
  uint32_t d;
  if (F16)
    asm("fma.rn.f16x2 %0, %1, %2, %3;"
        : "=r"(d)
        : "r"(mxfp4_bf16x2_to_f16x2(p)), "r"(0x74007400u), "r"(0x80008000u));
  else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(p), "r"(0x7e807e80u), "r"(0x80008000u));
  return d;
}

template <bool F16> MX_DEVICE inline void mx_mma(float *c, const uint32_t *a, const uint32_t *b) {
  if (F16)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

MX_DEVICE inline float mx_e8m0(unsigned s) { return __uint_as_float(mxfp4_e8m0_f32_bits(s)); }

MX_DEVICE inline int mx_acc_row(int i) { return i / 2; }
MX_DEVICE inline int mx_acc_token(int lane, int i) { return 2 * (lane % 4) + i % 2; }

#endif
#endif
