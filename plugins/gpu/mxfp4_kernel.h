/*
 * mxfp4_kernel.h: the MXFP4 W4A16 kernels, one source for the CUDA build
 * (plugins/cuda/mxfp4.cu: sm_90, wave 32, mma.sync m16n8k16) and the HIP
 * build (plugins/rocm/mxfp4.hip: gfx942, wave 64, MFMA 16x16x16). Decode,
 * tiling and data movement are here; the matrix step and the handful of
 * vendor primitives are in mxfp4_mma.h, which the including file selects by
 * compiling as CUDA or as HIP.
 *
 * The GEMM ("swap AB": weight rows are the MMA's M, tokens its N). A block of
 * 256 threads is `MX_WAVES` waves (8 of 32 lanes, 4 of 64), one 16-row tile
 * each, over one K range (the split, grid z) and one group of tokens (grid
 * y). Per stage of STAGE 64-K chunks: every wave issues the loads of its
 * tile's codes and scales for the stage (one load per lane per chunk: 16 or
 * 8 bytes of codes, 4 or 8 of scales), the block stages the tokens'
 * activations for the stage in shared memory / LDS (zero past m and K),
 * then each wave, per chunk and scale block, decodes the two k-steps' A
 * operands from the code words (wave 32: a mask and a multiply per register,
 * mxfp4_pair_bf16 then the exact 2^126 or 2^14 rescale; wave 64: byte-permute
 * table lookups, mxfp4_w64_operand), runs the MMAs
 * into a zeroed block accumulator, and adds it times the rows' e8m0 scale
 * (an f32 multiply by 2^(s - 127), exact) to the running sum. So the scale
 * never touches the 4-bit codes, every e8m0 value (0..254) is exact, and the
 * summation order is fixed. The epilogue writes y (+ bias, in y's dtype) or,
 * for a K split, f32 partial sums that mxfp4_reduce adds in split order.
 */
#ifndef QKEEP_GPU_MXFP4_KERNEL_H
#define QKEEP_GPU_MXFP4_KERNEL_H

#include "mxfp4_args.h"
#include "mxfp4_layout.h"
#include "mxfp4_mma.h"

namespace mxfp4 {

/* f32 -> bf16 bits, round to nearest even (NaN stays NaN). */
MX_DEVICE inline uint16_t f32_to_bf16(float f) {
  uint32_t u = mx_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Element i of a bias or y buffer in dtype (0 F32, 1 F16, 2 BF16). */
MX_DEVICE inline float load_float(const void *p, int64_t i, int dtype) {
  if (dtype == 0)
    return static_cast<const float *>(p)[i];
  uint16_t h = static_cast<const uint16_t *>(p)[i];
  return dtype == 1 ? mx_f16_bits_to_f32(h) : mx_bits_f32((uint32_t)h << 16);
}

MX_DEVICE inline void store_float(void *p, int64_t i, int dtype, float v) {
  if (dtype == 0)
    static_cast<float *>(p)[i] = v;
  else
    static_cast<uint16_t *>(p)[i] = dtype == 1 ? mx_f32_to_f16_bits(v) : f32_to_bf16(v);
}

/* The A operand registers of k-step s of scale block b from a lane's code words. */
template <bool F16> MX_DEVICE inline void a_operand(const uint32_t *words, int b, int s, uint32_t *a) {
#if MX_WAVE == 32
  /* word 2b + s holds the step's four registers a0a1 a2a3 a4a5 a6a7 as pairs 0..3 */
  const uint32_t w = words[2 * b + s];
  a[0] = mx_rescale<F16>(mxfp4_pair_bf16(w, 0));
  a[1] = mx_rescale<F16>(mxfp4_pair_bf16(w, 1));
  a[2] = mx_rescale<F16>(mxfp4_pair_bf16(w, 2));
  a[3] = mx_rescale<F16>(mxfp4_pair_bf16(w, 3));
#else
  /* pairs 2s and 2s + 1 of word b (its low nibbles for s 0, high for s 1) are MFMA's four A
   * elements, looked up by byte permutes as exact bf16 / f16 values: no rescale */
  mxfp4_w64_operand(words[b], s, F16, a);
#endif
}

constexpr int kLaneWords = MXFP4_UNIT_BYTES / 4 / MX_WAVE; /* code words per lane per chunk */
constexpr int kDrpl = MX_WAVE == 32 ? 2 : 4;               /* accumulator rows per lane */
constexpr int kScaleWords = 2 * kDrpl / 4;                 /* scale words per lane per chunk */
constexpr int kGroupLanes = MX_WAVE == 32 ? 4 : 16;        /* lanes that share a scale group */

/*
 * The GEMM body for NB token blocks of MX_MMA_N tokens, STAGE chunks staged at a time, F16
 * (f16 activations and MMAs) or bf16.
 */
template <int NB, int STAGE, bool F16> MX_DEVICE inline void gemm(const mxfp4_gemm_args &a) {
  constexpr int kTokens = NB * MX_MMA_N;
  constexpr int kRow = STAGE * MXFP4_CHUNK_K + MXFP4_X_PAD; /* staged elements per token */
  MX_SHARED mx_u4 xs_raw[kTokens * kRow / 8];
  uint16_t *xs = reinterpret_cast<uint16_t *>(xs_raw);

  const int tid = mx_thread(), lane = tid % MX_WAVE, wave = mx_uniform(tid / MX_WAVE);
  const int64_t tile = (int64_t)mx_block_x() * MX_WAVES + wave;
  const int64_t group = mx_block_y();
  int64_t out0, xrow0, ntok;
  int32_t expert;
  if (a.ids) {
    expert = a.ids[group];
    if (expert < 0 || expert >= a.experts)
      return; /* the whole block: no barrier is left waiting */
    out0 = group, xrow0 = group / a.x_div, ntok = 1;
  } else {
    expert = a.expert;
    out0 = xrow0 = group * kTokens;
    ntok = a.m - out0 < kTokens ? a.m - out0 : kTokens;
  }
  const int64_t c_begin = (int64_t)mx_block_z() * a.chunks_per_split;
  const int64_t c_end = c_begin + a.chunks_per_split < a.chunks ? c_begin + a.chunks_per_split : a.chunks;
  const bool active = tile < a.tiles; /* waves past the last tile still stage and meet every barrier */
  const int64_t unit0 = (active ? tile : 0) * a.chunks;
  const uint8_t *wp =
      a.codes + expert * a.expert_code_bytes + unit0 * MXFP4_UNIT_BYTES + lane * (4 * kLaneWords);
  const uint8_t *sp = a.scales + expert * a.expert_scale_bytes + unit0 * MXFP4_UNIT_SCALES +
                      (lane / kGroupLanes) * (2 * kDrpl);
  const int q = MX_WAVE == 32 ? lane % 4 : lane / 16;    /* the lane's 8-K run inside a scale block */
  const int btok = MX_WAVE == 32 ? lane / 4 : lane % 16; /* the lane's token inside an MMA token block */

  float acc[NB][4];
#pragma unroll
  for (int nb = 0; nb < NB; nb++)
#pragma unroll
    for (int i = 0; i < 4; i++)
      acc[nb][i] = 0.0f;

  for (int64_t c0 = c_begin; c0 < c_end; c0 += STAGE) {
    /* The stage's weights first: their loads fly while the block stages activations. */
    uint32_t words[STAGE][kLaneWords], sw[STAGE][kScaleWords];
    const uint8_t *wc = wp + c0 * MXFP4_UNIT_BYTES, *sc = sp + c0 * MXFP4_UNIT_SCALES;
    const int64_t left = active ? c_end - c0 : 0; /* chunks of this stage the wave reads */
#pragma unroll
    for (int c = 0; c < STAGE; c++) {
      if (c < left) { /* constant offsets from one base per stage */
        mx_load_words<kLaneWords>(wc + c * MXFP4_UNIT_BYTES, words[c]);
        mx_load_words<kScaleWords>(sc + c * MXFP4_UNIT_SCALES, sw[c]);
      } else {
#pragma unroll
        for (int i = 0; i < kLaneWords; i++)
          words[c][i] = 0;
#pragma unroll
        for (int i = 0; i < kScaleWords; i++)
          sw[c][i] = 0;
      }
    }
    mx_barrier(); /* the previous stage's readers are done with xs */
    for (int i = tid; i < kTokens * STAGE * 8; i += MXFP4_THREADS) {
      const int t = i / (STAGE * 8), c8 = i % (STAGE * 8);
      const int64_t kk = c0 * MXFP4_CHUNK_K + c8 * 8;
      mx_u4 v = {0, 0, 0, 0};
      if (t < ntok && kk < a.k)
        v = *reinterpret_cast<const mx_u4 *>(a.x + (xrow0 + t) * a.ldx + kk);
      *reinterpret_cast<mx_u4 *>(xs + t * kRow + c8 * 8) = v;
    }
    mx_barrier();
    if (!active)
      continue;
#pragma unroll
    for (int c = 0; c < STAGE; c++) {
#pragma unroll
      for (int b = 0; b < 2; b++) {
        float part[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
          for (int i = 0; i < 4; i++)
            part[nb][i] = 0.0f;
        uint32_t bx[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
          const mx_u4 v = *reinterpret_cast<const mx_u4 *>(xs + (nb * MX_MMA_N + btok) * kRow +
                                                           c * MXFP4_CHUNK_K + 32 * b + 8 * q);
          bx[nb][0] = v.x, bx[nb][1] = v.y, bx[nb][2] = v.z, bx[nb][3] = v.w;
        }
#pragma unroll
        for (int s = 0; s < 2; s++) {
          uint32_t am[MX_A_REGS];
          a_operand<F16>(words[c], b, s, am);
#pragma unroll
          for (int nb = 0; nb < NB; nb++)
            mx_mma<F16>(part[nb], am, &bx[nb][2 * s]);
        }
        /* 2^(e8m0 - 127) of each accumulator row, exact in f32 */
        float scale[kDrpl];
#pragma unroll
        for (int i = 0; i < kDrpl; i++) {
          const int byte = b * kDrpl + i;
          scale[i] = mx_e8m0((sw[c][byte / 4] >> (8 * (byte % 4))) & 0xffu);
        }
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
          for (int i = 0; i < 4; i++)
            acc[nb][i] += part[nb][i] * scale[mx_acc_row(i)];
      }
    }
  }
  if (!active)
    return;
#pragma unroll
  for (int nb = 0; nb < NB; nb++)
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int64_t row = tile * MXFP4_TILE_ROWS + mxfp4_d_row(lane, mx_acc_row(i), MX_WAVE);
      const int64_t t = nb * MX_MMA_N + mx_acc_token(lane, i);
      if (row >= a.n || t >= ntok)
        continue;
      const int64_t o = out0 + t;
      if (a.partial) {
        a.partial[((int64_t)mx_block_z() * a.out_rows + o) * a.n + row] = acc[nb][i];
      } else {
        float v = acc[nb][i];
        if (a.bias)
          v += load_float(a.bias, (int64_t)expert * a.n + row, a.bias_dtype);
        store_float(a.y, o * a.n + row, a.y_dtype, v);
      }
    }
}

MX_DEVICE inline void reduce(const mxfp4_reduce_args &a) {
  const int64_t total = a.rows * a.n;
  for (int64_t i = (int64_t)mx_block_x() * MXFP4_THREADS + mx_thread(); i < total;
       i += (int64_t)mx_grid_x() * MXFP4_THREADS) {
    float v = 0.0f;
    for (int z = 0; z < a.split; z++)
      v += a.partial[z * total + i];
    if (a.bias)
      v += load_float(a.bias, (int64_t)a.expert * a.n + i % a.n, a.bias_dtype);
    store_float(a.y, i, a.y_dtype, v);
  }
}

MX_DEVICE inline void combine(const mxfp4_combine_args &a) {
  const int64_t total = a.m * a.n;
  for (int64_t i = (int64_t)mx_block_x() * MXFP4_THREADS + mx_thread(); i < total;
       i += (int64_t)mx_grid_x() * MXFP4_THREADS) {
    const int64_t t = i / a.n, r = i % a.n;
    float v = 0.0f;
    for (int s = 0; s < a.topk; s++) {
      const int64_t slot = t * a.topk + s;
      const int32_t e = a.ids[slot];
      if (e < 0 || e >= a.experts)
        continue;
      float y = a.partial[slot * a.n + r];
      if (a.bias)
        y += load_float(a.bias, (int64_t)e * a.n + r, a.bias_dtype);
      v += a.weights[slot] * y;
    }
    store_float(a.y, i, a.y_dtype, v);
  }
}

MX_DEVICE inline void convert(const mxfp4_convert_args &a) {
  for (int64_t i = (int64_t)mx_block_x() * MXFP4_THREADS + mx_thread(); i < a.n;
       i += (int64_t)mx_grid_x() * MXFP4_THREADS)
    a.dst[i] = f32_to_bf16(a.src[i]);
}

/* One output word of the tiled codes per thread: the device twin of mxfp4_tile_codes. */
MX_DEVICE inline void tile_codes(const mxfp4_tile_args &a) {
  const int64_t chunks = mxfp4_chunks(a.k), words = mxfp4_code_bytes(a.rows, a.k) / 4;
  const int64_t src_bytes = a.rows * (a.k / 2);
  for (int64_t i = (int64_t)mx_block_x() * MXFP4_THREADS + mx_thread(); i < a.experts * words;
       i += (int64_t)mx_grid_x() * MXFP4_THREADS) {
    const int64_t e = i / words, w = i % words;
    uint32_t word = 0;
    for (int slot = 0; slot < 8; slot++) {
      int64_t r, k;
      mxfp4_w_source(w, slot, chunks, MX_WAVE, &r, &k);
      if (r < a.rows && k < a.k)
        word = mxfp4_w_put(word, slot, MX_WAVE,
                           (a.src[e * src_bytes + r * (a.k / 2) + k / 2] >> (4 * (k % 2))) & 0xfu);
    }
    reinterpret_cast<uint32_t *>(a.dst)[i] = word;
  }
}

/* One output byte of the tiled scales per thread: the device twin of mxfp4_tile_scales. */
MX_DEVICE inline void tile_scales(const mxfp4_tile_args &a) {
  const int64_t chunks = mxfp4_chunks(a.k), bytes = mxfp4_scale_bytes(a.rows, a.k),
                blocks = a.k / MXFP4_BLOCK;
  for (int64_t i = (int64_t)mx_block_x() * MXFP4_THREADS + mx_thread(); i < a.experts * bytes;
       i += (int64_t)mx_grid_x() * MXFP4_THREADS) {
    const int64_t e = i / bytes;
    int64_t r, kb;
    mxfp4_s_source(i % bytes, chunks, MX_WAVE, &r, &kb);
    a.dst[i] = r < a.rows && kb < blocks ? a.src[(e * a.rows + r) * blocks + kb] : 0;
  }
}

} // namespace mxfp4

/*
 * The kernels with C names, so that the HIP build finds them in its code object by name
 * (hipModuleGetFunction) and the CUDA build launches the same symbols. Token blocks: 1, 2, 4
 * and 8 on wave 32 (8 to 64 tokens); 1, 2 and 4 on wave 64 (16 to 64).
 */
#define MXFP4_GEMM_KERNEL(name, NB, STAGE, F16)                                                              \
  extern "C" MX_GLOBAL void MX_BOUNDS name(const mxfp4_gemm_args a) { mxfp4::gemm<NB, STAGE, F16>(a); }
#define MXFP4_GEMM_KERNELS(tokens, NB, STAGE)                                                                \
  MXFP4_GEMM_KERNEL(mxfp4_k_gemm_bf16_t##tokens, NB, STAGE, false)                                           \
  MXFP4_GEMM_KERNEL(mxfp4_k_gemm_f16_t##tokens, NB, STAGE, true)

#define MXFP4_OTHER_KERNELS                                                                                  \
  extern "C" MX_GLOBAL void MX_BOUNDS mxfp4_k_reduce(const mxfp4_reduce_args a) { mxfp4::reduce(a); }        \
  extern "C" MX_GLOBAL void MX_BOUNDS mxfp4_k_combine(const mxfp4_combine_args a) { mxfp4::combine(a); }     \
  extern "C" MX_GLOBAL void MX_BOUNDS mxfp4_k_convert(const mxfp4_convert_args a) { mxfp4::convert(a); }     \
  extern "C" MX_GLOBAL void MX_BOUNDS mxfp4_k_tile_codes(const mxfp4_tile_args a) { mxfp4::tile_codes(a); }  \
  extern "C" MX_GLOBAL void MX_BOUNDS mxfp4_k_tile_scales(const mxfp4_tile_args a) { mxfp4::tile_scales(a); }

#endif
