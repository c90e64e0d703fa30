/*
 * kernels.cu: the cuda-nvfp4 kernels and their extern "C" launchers
 * (contracts in cuda_nvfp4.h, layouts in layout.h).
 *
 * The W4A16 GEMM (Hopper has no FP4 tensor cores), three kernels that read the
 * same PWAL layout: the streaming kernel (m <= 16), the wgmma kernel (m > 16 on
 * compute capability 9.0, sm_90a) and the mma.sync ring kernel (any m on other
 * GPUs); nvfp4_gemm_plan picks one per call. Routed MoE runs the same kernels
 * over expert-sorted token tiles (nvfp4_moe_plan picks by tokens per expert). The ring kernel:
 * y^T = W x^T with the weight as the A operand of mma.m16n8k16. A block
 * covers 128 output rows (8 fragment tiles, one 128x4 scale atom per 64-K
 * chunk) and up to 64 tokens.
 * cp.async fills a ring of shared-memory stages (weights in their tiled
 * layout, the scale atom, the activations) a few stages ahead; each warp
 * reads its lane's 16 bytes of weights per chunk, turns them into fragments
 * (one to three bit operations per pair of codes, one multiply by the e4m3
 * block scale) and multiplies them with bf16 (or f16) activations. The K range
 * is split across a thread-block cluster of up to 8 blocks whose partial sums
 * are added through distributed shared memory in a fixed order, so a launch is
 * one kernel, needs no workspace and gives the same bits every time.
 *
 * Numerics: each dequantised weight is code * scale * 2^-63 (bf16) or
 * code * scale * 2^-7 (f16), exact in 16 bits (a 2-bit by 4-bit significand
 * product); products accumulate in f32 and the epilogue multiplies by
 * alpha * 2^63 (or 2^7), where alpha is the decode global scale.
 */
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <stdint.h>
#include <type_traits>

#include "cuda_nvfp4.h"
#include "layout.h"
#include "mxfp4.h"

namespace cg = cooperative_groups;

namespace {

constexpr int kRowsPerBlock = 128;            /* 8 tiles of 16 rows: one scale atom */
constexpr int kRedStride = kRowsPerBlock + 4; /* f32 words per token of the reduction tile */
constexpr int kMaxSplit = NVFP4_MAX_SPLIT;
constexpr int kMaxMoeExperts = 2048;

/* A block shape: MT tokens, RT 16-row tiles per warp (8 / RT warps), NS pipeline stages. */
template <int MT_, int RT_, int NS_> struct Shape {
  static constexpr int MT = MT_;
  static constexpr int RT = RT_;
  static constexpr int WARPS = 8 / RT_;
  static constexpr int THREADS = WARPS * 32;
  static constexpr int NT = MT_ / 8;
  static constexpr int NS = NS_;
};
/* The deep pipeline for tile_m, in stages of kChunksPerStage chunks of weights, scales and
 * activations: 6 for the bandwidth-bound shapes, 4 where the activations take more room.
 * The default is half of it: on the H200 the smaller ring lets more blocks share an SM,
 * which paid more than depth in every shape measured (docs/PERFORMANCE.md);
 * nvfp4_tuning.depth >= depth_for(tile_m) selects the deep one. */
constexpr int depth_for(int tile_m) { return tile_m <= 16 ? 6 : 4; }
constexpr int kChunksPerStage = 2;

struct GemmArgs {
  const uint8_t *w;   /* tiled weights of expert 0 */
  const uint8_t *sf;  /* swizzled scales of expert 0 */
  const float *alpha; /* [experts] */
  const void *bias;   /* [experts, n] or NULL */
  int bias_dtype;
  const void *x;
  void *y;
  float *y_pairs; /* routed w2: f32 rows per (token, slot) instead of y */
  int y_dtype;
  int m; /* plain: tokens */
  int n, k;
  int chunks;   /* 64-K chunks per row */
  int sf_atoms; /* scale atoms per 128-row block (padded scale columns / 4) */
  int w_tiles;  /* 16-row tiles per expert */
  long long w_expert_bytes, sf_expert_bytes;
  int expert;        /* plain mode */
  const int4 *tiles; /* routed: {expert, first sorted slot, slots} per token tile */
  const int *num_tiles;
  const int *pairs; /* routed: token * topk + slot, sorted by expert */
  int x_div;        /* routed: x row = pair / x_div */
  int splits;
  /* Routed in the streaming kernel without moe_align_kernel (tiles NULL): the expert of each pair, and
   * the pairs (at most kStreamWarps * 32) and experts; every block finds its own tile (route_tile). */
  const int32_t *route_ids;
  int route_pairs, route_experts;
};

/* ---- small device helpers ------------------------------------------------------------------- */

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool ok) {
  uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);
  int bytes = ok ? 16 : 0; /* 0: zero-fill */
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

template <bool BF16>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t bits_of(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t *>(&v); }
__device__ __forceinline__ uint32_t bits_of(__half2 v) { return *reinterpret_cast<uint32_t *>(&v); }

template <bool BF16> __device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  if constexpr (BF16)
    return bits_of(__hmul2(*reinterpret_cast<__nv_bfloat162 *>(&a), *reinterpret_cast<__nv_bfloat162 *>(&b)));
  else
    return bits_of(__hmul2(*reinterpret_cast<__half2 *>(&a), *reinterpret_cast<__half2 *>(&b)));
}

/* The e4m3 block scales of rows g (lo) and g + 8 (hi) as 16-bit pairs, times the power of
 * two that undoes half of nvfp4_pair_bf16's bias (2^63 of 2^126 for bf16, 2^7 of 2^14 for
 * f16; the epilogue undoes the rest). */
template <bool BF16>
__device__ __forceinline__ void block_scales(uint32_t lo, uint32_t hi, uint32_t &s_lo, uint32_t &s_hi) {
  __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(lo | (hi << 8)), __NV_E4M3);
  float2 f = __half22float2(*reinterpret_cast<__half2 *>(&raw));
  if constexpr (BF16) {
    s_lo = bits_of(__float2bfloat162_rn(f.x * 0x1p63f));
    s_hi = bits_of(__float2bfloat162_rn(f.y * 0x1p63f));
  } else {
    s_lo = bits_of(__float2half2_rn(f.x * 128.0f));
    s_hi = bits_of(__float2half2_rn(f.y * 128.0f));
  }
}

/* Register pair `pair` of tile word q, scaled: bf16 from nvfp4_pair_bf16, or f16. */
template <bool BF16, int pair> __device__ __forceinline__ uint32_t scaled_pair(uint32_t q, uint32_t scale) {
  uint32_t p = nvfp4_pair_bf16(q, pair);
  return hmul2<BF16>(BF16 ? p : nvfp4_bf16x2_to_f16x2(p), scale);
}

/* The A fragment of one k-step from word q of a lane's tile bytes (layout.h). */
template <bool BF16>
__device__ __forceinline__ void dequant(uint32_t q, uint32_t s_lo, uint32_t s_hi, uint32_t (&a)[4]) {
  a[0] = scaled_pair<BF16, 0>(q, s_lo); /* row g,     k 2t, 2t+1 */
  a[1] = scaled_pair<BF16, 1>(q, s_hi); /* row g + 8, k 2t, 2t+1 */
  a[2] = scaled_pair<BF16, 2>(q, s_lo); /* row g,     k 2t+8, 2t+9 */
  a[3] = scaled_pair<BF16, 3>(q, s_hi); /* row g + 8, k 2t+8, 2t+9 */
}

/* The B fragments of one chunk: a lane's 16 consecutive activations of one token (k =
 * 16t .. 16t + 15 of the chunk), held as sizeof(TI) 16-byte vectors, as 8 registers, b[2j],
 * b[2j+1] for k-step j (f32 rounded to bf16). */
template <typename TI>
__device__ __forceinline__ void b_from(const uint4 (&v)[sizeof(TI)], uint32_t (&b)[8]) {
  if constexpr (sizeof(TI) == 2) {
    b[0] = v[0].x, b[1] = v[0].y, b[2] = v[0].z, b[3] = v[0].w, b[4] = v[1].x, b[5] = v[1].y, b[6] = v[1].z,
    b[7] = v[1].w;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      b[2 * i] = bits_of(__floats2bfloat162_rn(__uint_as_float(v[i].x), __uint_as_float(v[i].y)));
      b[2 * i + 1] = bits_of(__floats2bfloat162_rn(__uint_as_float(v[i].z), __uint_as_float(v[i].w)));
    }
  }
}

/* The same from shared memory at p. */
template <typename TI> __device__ __forceinline__ void load_b(const unsigned char *p, uint32_t (&b)[8]) {
  uint4 v[sizeof(TI)];
#pragma unroll
  for (int i = 0; i < (int)sizeof(TI); ++i)
    v[i] = reinterpret_cast<const uint4 *>(p)[i];
  b_from<TI>(v, b);
}

__device__ __forceinline__ float load_f(const void *p, int dtype, long long i) {
  switch (dtype) {
  case QKEEP_DTYPE_F32: return static_cast<const float *>(p)[i];
  case QKEEP_DTYPE_F16: return __half2float(static_cast<const __half *>(p)[i]);
  default: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
  }
}

__device__ __forceinline__ void store_f(void *p, int dtype, long long i, float v) {
  switch (dtype) {
  case QKEEP_DTYPE_F32: static_cast<float *>(p)[i] = v; break;
  case QKEEP_DTYPE_F16: static_cast<__half *>(p)[i] = __float2half_rn(v); break;
  default: static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v); break;
  }
}

/* ---- the GEMM -------------------------------------------------------------------------------- */

/*
 * Shared memory of one pipeline stage: the weights of the block's 8 tiles and the scale
 * atom for kChunksPerStage chunks, and the activations of all MT tokens over those chunks
 * (rows padded by 16 bytes against bank conflicts). NS stages form a ring that cp.async
 * fills NS - 1 stages ahead: asynchronous copies, so the depth costs no registers and no
 * load scoreboards. The reduction tile reuses the ring.
 */
template <class S, typename TI> struct Smem {
  static constexpr int G = kChunksPerStage;
  static constexpr int W_BYTES = G * 8 * NVFP4_TILE_BYTES;
  static constexpr int SF_BYTES = G * NVFP4_SF_ATOM;
  static constexpr int X_ROW = G * NVFP4_CHUNK_K * (int)sizeof(TI) + 16;
  static constexpr int X_UNITS = G * NVFP4_CHUNK_K * (int)sizeof(TI) / 16; /* 16-byte copies per token */
  static constexpr int STAGE = W_BYTES + SF_BYTES + S::MT * X_ROW;
  static constexpr int RED_BYTES = S::MT * kRedStride * 4;
  static constexpr int BYTES = S::NS * STAGE > RED_BYTES ? S::NS *STAGE : RED_BYTES;
};

template <class S, typename TI>
__global__ void __launch_bounds__(S::THREADS) nvfp4_gemm_kernel(const GemmArgs a) {
  using L = Smem<S, TI>;
  constexpr bool BF16 = !std::is_same<TI, __half>::value;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int x_row[S::MT], y_row[S::MT];

  cg::cluster_group cluster = cg::this_cluster();
  const int split = (int)cluster.block_rank();
  int expert = a.expert, start, count;
  if (a.tiles) {
    if ((int)blockIdx.x >= *a.num_tiles)
      return; /* the whole cluster leaves: its blocks share blockIdx.x */
    const int4 tile = a.tiles[blockIdx.x];
    expert = tile.x, start = tile.y, count = tile.z;
  } else {
    start = (int)blockIdx.x * S::MT;
    count = min(S::MT, a.m - start);
  }
  for (int i = threadIdx.x; i < S::MT; i += S::THREADS) {
    int xr = -1, yr = -1;
    if (i < count) {
      if (a.pairs) {
        const int pair = a.pairs[start + i];
        xr = pair / a.x_div, yr = pair;
      } else {
        xr = yr = start + i;
      }
    }
    x_row[i] = xr, y_row[i] = yr;
  }
  __syncthreads();

  const int per_split = (a.chunks + a.splits - 1) / a.splits;
  const int c_begin = min(a.chunks, split * per_split), c_end = min(a.chunks, c_begin + per_split);
  const int stages = (c_end - c_begin + L::G - 1) / L::G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int rb = blockIdx.y;
  const uint8_t *w_block = a.w + expert * a.w_expert_bytes + (long long)rb * 8 * a.chunks * NVFP4_TILE_BYTES;
  const uint8_t *sf_block = a.sf + expert * a.sf_expert_bytes + (long long)rb * a.sf_atoms * NVFP4_SF_ATOM;
  const int block_tiles = min(8, a.w_tiles - rb * 8); /* tiles of this block inside the matrix */

  /* cp.async of stage `stage` (chunks c_begin + G * stage ...) into ring slot stage % NS;
   * zeros for tiles past the matrix, chunks past this split's end and K past the end. */
  auto issue = [&](int stage) {
    unsigned char *st = smem + (stage % S::NS) * L::STAGE;
    const int c0 = c_begin + stage * L::G;
#pragma unroll
    for (int u = threadIdx.x; u < L::W_BYTES / 16; u += S::THREADS) {
      const int gi = u / 256, tib = (u / 32) % 8, c = c0 + gi;
      const bool ok = c < c_end && tib < block_tiles;
      const uint8_t *src = w_block + ((long long)c * block_tiles + tib) * NVFP4_TILE_BYTES + (u % 32) * 16;
      cp_async16(st + u * 16, ok ? src : a.w, ok);
    }
    for (int u = threadIdx.x; u < L::SF_BYTES / 16; u += S::THREADS) {
      const int c = c0 + u / 32;
      const bool ok = c < c_end;
      cp_async16(st + L::W_BYTES + u * 16,
                 ok ? sf_block + (long long)c * NVFP4_SF_ATOM + (u % 32) * 16 : a.sf, ok);
    }
    unsigned char *xs = st + L::W_BYTES + L::SF_BYTES;
    for (int u = threadIdx.x; u < S::MT * L::X_UNITS; u += S::THREADS) {
      const int i = u / L::X_UNITS, j = u % L::X_UNITS, xr = x_row[i];
      const int kk = c0 * NVFP4_CHUNK_K + j * (16 / (int)sizeof(TI));
      const bool ok = xr >= 0 && kk < a.k && kk < c_end * NVFP4_CHUNK_K;
      const TI *src = static_cast<const TI *>(a.x) + (ok ? (long long)xr * a.k + kk : 0);
      cp_async16(xs + i * L::X_ROW + j * 16, src, ok);
    }
  };

  /* With one row tile per warp, even and odd k-steps accumulate apart: two independent
   * MMA chains instead of one four long per chunk. */
  constexpr int BANKS = S::RT == 1 ? 2 : 1;
  float acc[BANKS][S::RT][S::NT][4];
#pragma unroll
  for (int bank = 0; bank < BANKS; ++bank)
#pragma unroll
    for (int rt = 0; rt < S::RT; ++rt)
#pragma unroll
      for (int nt = 0; nt < S::NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          acc[bank][rt][nt][i] = 0.0f;
  bool active[S::RT];
  int sf_lane[S::RT];
#pragma unroll
  for (int rt = 0; rt < S::RT; ++rt) {
    const int tib = warp * S::RT + rt;
    active[rt] = tib < block_tiles;
    /* row 16 * tib + g of the atom: (r % 32) * 16 + ((r / 32) % 4) * 4 + column t */
    sf_lane[rt] = (16 * (tib & 1) + g) * 16 + (tib >> 1) * 4 + t;
  }

#pragma unroll
  for (int s = 0; s < S::NS - 1; ++s) {
    if (s < stages)
      issue(s);
    cp_async_commit();
  }
  for (int s = 0; s < stages; ++s) {
    cp_async_wait<S::NS - 2>(); /* this thread's copies of stage s have landed */
    __syncthreads();            /* everyone's have; and everyone is done with stage s - 1 */
    if (s + S::NS - 1 < stages)
      issue(s + S::NS - 1); /* into the slot stage s - 1 used */
    cp_async_commit();
    const unsigned char *st = smem + (s % S::NS) * L::STAGE;
#pragma unroll
    for (int gi = 0; gi < L::G; ++gi) {
      if (c_begin + s * L::G + gi >= c_end)
        break;
      uint32_t frag[S::RT][4][4];
#pragma unroll
      for (int rt = 0; rt < S::RT; ++rt) {
        const uint4 q = *reinterpret_cast<const uint4 *>(
            st + (gi * 8 + warp * S::RT + rt) * NVFP4_TILE_BYTES + lane * 16);
        const unsigned char *sf = st + L::W_BYTES + gi * NVFP4_SF_ATOM + sf_lane[rt];
        uint32_t s_lo, s_hi;
        block_scales<BF16>(sf[0], sf[128], s_lo, s_hi);
        dequant<BF16>(q.x, s_lo, s_hi, frag[rt][0]);
        dequant<BF16>(q.y, s_lo, s_hi, frag[rt][1]);
        dequant<BF16>(q.z, s_lo, s_hi, frag[rt][2]);
        dequant<BF16>(q.w, s_lo, s_hi, frag[rt][3]);
      }
      const unsigned char *xs =
          st + L::W_BYTES + L::SF_BYTES + g * L::X_ROW + (gi * NVFP4_CHUNK_K + 16 * t) * (int)sizeof(TI);
      /* Two token groups at a time, k-step outermost: consecutive MMAs go to different
       * accumulators, so they do not wait for each other. */
      constexpr int NG = S::NT < 2 ? S::NT : 2;
#pragma unroll
      for (int ng = 0; ng < S::NT; ng += NG) {
        uint32_t b[NG][8];
#pragma unroll
        for (int i = 0; i < NG; ++i)
          load_b<TI>(xs + (ng + i) * 8 * L::X_ROW, b[i]);
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int i = 0; i < NG; ++i)
#pragma unroll
            for (int rt = 0; rt < S::RT; ++rt)
              if (active[rt])
                mma<BF16>(acc[j % BANKS][rt][ng + i], frag[rt][j], b[i][2 * j], b[i][2 * j + 1]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads(); /* the ring is free for the reduction tile */

  /* Partial tile [token][row] into shared memory, then each block of the cluster adds up
   * 1/splits of it over all blocks, in rank order, and writes it out. */
  float *red = reinterpret_cast<float *>(smem);
#pragma unroll
  for (int rt = 0; rt < S::RT; ++rt) {
    const int row = (warp * S::RT + rt) * 16 + g;
#pragma unroll
    for (int nt = 0; nt < S::NT; ++nt) {
      const int tok = nt * 8 + 2 * t;
      float c[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        c[i] = BANKS == 2 ? acc[0][rt][nt][i] + acc[BANKS - 1][rt][nt][i] : acc[0][rt][nt][i];
      red[tok * kRedStride + row] = c[0];
      red[(tok + 1) * kRedStride + row] = c[1];
      red[tok * kRedStride + row + 8] = c[2];
      red[(tok + 1) * kRedStride + row + 8] = c[3];
    }
  }
  cluster.sync();
  const float out_scale = a.alpha[expert] * (BF16 ? 0x1p63f : 128.0f);
  constexpr int total = S::MT * kRowsPerBlock;
  const int per = (total + a.splits - 1) / a.splits;
  const int e_end = min(total, (split + 1) * per);
  for (int e = split * per + threadIdx.x; e < e_end; e += S::THREADS) {
    const int tok = e / kRowsPerBlock, row = e % kRowsPerBlock, n = rb * kRowsPerBlock + row;
    if (tok >= count || n >= a.n)
      continue;
    float v = 0.0f;
    for (int q = 0; q < a.splits; ++q)
      v += cluster.map_shared_rank(red, q)[tok * kRedStride + row];
    v *= out_scale;
    if (a.bias)
      v += load_f(a.bias, a.bias_dtype, (long long)expert * a.n + n);
    const long long yi = (long long)y_row[tok] * a.n + n;
    if (a.y_pairs)
      a.y_pairs[yi] = v;
    else
      store_f(a.y, a.y_dtype, yi, v);
  }
  cluster.sync(); /* the others may still read our partial tile */
}

/* ---- the streaming kernel for few tokens ------------------------------------------------------------ */

/*
 * For m <= 16 the weights are read once and used by at most 16 tokens, so the GEMM is a
 * stream through the weight bytes. No shared-memory ring and no barrier in the main loop:
 * each warp owns one 16-row tile and a run of 64-K chunks, and loads U chunks at a time
 * (its 16 bytes of codes, its two block scales, its tokens' activations) straight into
 * registers before it decodes any of them, so every warp keeps U x 512 bytes of weights in
 * flight. A block is R tiles x 8 / R runs of K (8 warps); a cluster of `splits` blocks
 * covers the rest of K. Partial sums meet in shared memory, then across the cluster
 * through distributed shared memory, in a fixed order (the same bits every time). BPS is
 * the blocks per SM the registers are capped for: 1 for U = 8; 2, or 3 (depth 3: half as
 * many bytes in flight again per SM, if the compiler keeps the batch's loads together in
 * fewer registers) for U = 4. On the H200 3 gained at most 3% at m <= 4 and lost at m = 16
 * (docs/PERFORMANCE.md), so the plan keeps 2.
 *
 * Routed MoE (a.tiles set): blockIdx.x is a token tile of moe_align_kernel's list (one
 * expert, at most MT of its sorted (token, slot) pairs) and blockIdx.y the row block; a
 * block reads its expert's rows once and gathers its tokens' activations through the
 * pair list. Tiles past the device-side tile count leave at once, so experts without a
 * token cost one empty block each at most and the host never waits for the count.
 */
constexpr int kStreamWarps = NVFP4_STREAM_WARPS;
/* Pairs a streaming block can route itself: a thread each. */
constexpr int kRouteMaxPairs = kStreamWarps * 32;
/* Most pairs a routed launch routes in each block by default: every block pays two passes over the pairs, so
 * past a few tokens the sorting kernel is cheaper (H100, Qwen3-30B-A3B experts: 1 token 12.0 against 13.3 us
 * for w13, 16 tokens 127 against 66 us). */
constexpr int kRouteAutoPairs = 32;

/*
 * Token tile `tile` of a routed launch, found by the block itself (a thread per pair): tiles in
 * moe_align_kernel's order (experts ascending, each expert's pairs cut into tiles of MT), an expert's
 * pairs in pair order. Sets pair_of[0, MT) (past the count: the tile's first pair), *expert and *count
 * (0: no such tile). Two passes over the pairs in shared memory; ids outside [0, experts) are skipped.
 */
template <int MT>
__device__ __forceinline__ void route_tile(const GemmArgs &a, int tile, int *key, int *rank, int *pair_of,
                                           int *expert, int *count) {
  const int p = (int)threadIdx.x, pairs = a.route_pairs;
  __shared__ int tile_expert, tile_count;
  int e = -1;
  if (p < pairs) {
    e = a.route_ids[p];
    e = e >= 0 && e < a.route_experts ? e : -1;
    key[p] = e;
  }
  if (p == 0)
    tile_count = 0;
  __syncthreads();
  int r = 0, n = 0;
  if (e >= 0)
    for (int q = 0; q < pairs; ++q) {
      const int kq = key[q];
      r += kq == e && q < p;
      n += kq == e;
    }
  if (p < pairs)
    rank[p] = r;
  __syncthreads();
  if (e >= 0) {
    int before = 0; /* tiles of the experts below e: the pairs that start one */
    for (int q = 0; q < pairs; ++q) {
      const int kq = key[q];
      before += kq >= 0 && kq < e && rank[q] % MT == 0;
    }
    if (before + r / MT == tile) {
      pair_of[r % MT] = p;
      if (r % MT == 0)
        tile_expert = e, tile_count = min(MT, n - r);
    }
  }
  __syncthreads();
  *expert = tile_expert, *count = tile_count;
  if (p < MT && p >= *count && *count)
    pair_of[p] = pair_of[0];
  __syncthreads();
}

template <typename TI, int MT, int R, int U, int BPS>
__global__ void __launch_bounds__(kStreamWarps * 32, BPS) nvfp4_stream_kernel(const GemmArgs a) {
  constexpr bool BF16 = !std::is_same<TI, __half>::value;
  constexpr int NT = MT / 8, RUNS = kStreamWarps / R, XU = (int)sizeof(TI); /* 16-byte loads per 16 K */
  __shared__ float red[kStreamWarps][16][MT + 1];
  __shared__ int pair_of[MT];

  cg::cluster_group cluster = cg::this_cluster();
  const int split = (int)cluster.block_rank();
  const bool routed = a.tiles != nullptr || a.route_ids != nullptr;
  int expert = a.expert, count = a.m;
  /* Launched early (programmatic dependent launch): the kernel after this one may start once every
   * block here has; griddepcontrol.wait stands before anything the kernel before may still write (the
   * routing, the activations) is read, or anything is written. Plain: the first batch of weights and
   * scales (written only by PWAL, which a load or reload waits for) is loaded before it. */
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if (routed)
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (a.route_ids) {
    __shared__ int key[kRouteMaxPairs], rank[kRouteMaxPairs];
    route_tile<MT>(a, (int)blockIdx.x, key, rank, pair_of, &expert, &count);
    if (!count)
      return; /* the whole cluster leaves: its blocks share blockIdx.x */
  } else if (routed) {
    if ((int)blockIdx.x >= *a.num_tiles)
      return; /* the whole cluster leaves: its blocks share blockIdx.x */
    const int4 tl = a.tiles[blockIdx.x];
    expert = tl.x, count = tl.z;
    if ((int)threadIdx.x < MT)
      pair_of[threadIdx.x] = a.pairs[tl.y + ((int)threadIdx.x < count ? (int)threadIdx.x : 0)];
    __syncthreads();
  }
  const int rb = routed ? (int)blockIdx.y : (int)blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int rt = warp % R, run = warp / R;
  const int tile = rb * R + rt;
  const bool active = tile < a.w_tiles;

  /* This warp's chunks: the split's share of K, then the warp's run of it. */
  const int per_split = (a.chunks + a.splits - 1) / a.splits;
  const int s_begin = min(a.chunks, split * per_split), s_end = min(a.chunks, s_begin + per_split);
  const int per_run = (s_end - s_begin + RUNS - 1) / RUNS;
  const int c_begin = min(s_end, s_begin + run * per_run),
            c_end = active ? min(s_end, c_begin + per_run) : c_begin;

  /* This tile's chunks are a group's tiles apart (layout.h). */
  const long long w_stride = active ? nvfp4_w_group_tiles(tile, a.w_tiles) * NVFP4_TILE_BYTES : 0;
  const uint8_t *wp = a.w + expert * a.w_expert_bytes +
                      (active ? nvfp4_w_tile_offset(tile, 0, a.w_tiles, a.chunks) : 0) + lane * 16;
  const uint8_t *sp = a.sf + expert * a.sf_expert_bytes + (long long)(tile / 8) * a.sf_atoms * NVFP4_SF_ATOM +
                      (16 * (tile & 1) + g) * 16 + ((tile % 8) >> 1) * 4 + t;
  /* Token rows past the count read the first row instead: token columns of an MMA never
   * mix, and the epilogue skips them. Routed, the pair list names the rows (pair_of
   * repeats the tile's first pair past the count). */
  const TI *xp[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = nt * 8 + g;
    const int xr = routed ? pair_of[tok] / a.x_div : tok < count ? tok : 0;
    xp[nt] = static_cast<const TI *>(a.x) + (long long)xr * a.k + 16 * t;
  }

  float acc[2][NT][4];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        acc[b][nt][i] = 0.0f;

  /* Chunk c's loads: the lane's codes, its two block scales, its tokens' 16 activations
   * (zero past K, where the codes are zero padding: no 0 x inf). */
  auto load_w = [&](int c, uint4 &q, uint32_t &lo, uint32_t &hi) {
    q = __ldcs(reinterpret_cast<const uint4 *>(wp + c * w_stride));
    lo = __ldg(sp + (long long)c * NVFP4_SF_ATOM);
    hi = __ldg(sp + (long long)c * NVFP4_SF_ATOM + 128);
  };
  auto load_x = [&](int c, uint4(&xv)[NT][XU]) {
    const bool in_k = c * NVFP4_CHUNK_K + 16 * t < a.k;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int v = 0; v < XU; ++v) {
        const uint4 *p =
            reinterpret_cast<const uint4 *>(xp[nt] + (in_k ? (long long)c * NVFP4_CHUNK_K : 0)) + v;
        const uint4 x = __ldg(p);
        xv[nt][v] = in_k ? x : make_uint4(0, 0, 0, 0);
      }
  };
  auto compute = [&](const uint4 &q, uint32_t lo, uint32_t hi, const uint4(&xv)[NT][XU]) {
    uint32_t s_lo, s_hi, frag[4][4];
    block_scales<BF16>(lo, hi, s_lo, s_hi);
    dequant<BF16>(q.x, s_lo, s_hi, frag[0]);
    dequant<BF16>(q.y, s_lo, s_hi, frag[1]);
    dequant<BF16>(q.z, s_lo, s_hi, frag[2]);
    dequant<BF16>(q.w, s_lo, s_hi, frag[3]);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      uint32_t b[8];
      b_from<TI>(xv[nt], b);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        mma<BF16>(acc[j & 1][nt], frag[j], b[2 * j], b[2 * j + 1]);
    }
  };

  /* Whole batches: every load of the batch before any decode; then the rest one by one. The first
   * batch's weights are on their way before the wait for the kernel before. */
  int c0 = c_begin;
  bool waited = routed;
  for (; c0 + U <= c_end; c0 += U) {
    uint4 q[U], xv[U][NT][XU];
    uint32_t lo[U], hi[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      load_w(c0 + u, q[u], lo[u], hi[u]);
    if (!waited) {
      asm volatile("griddepcontrol.wait;\n" ::: "memory");
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      load_x(c0 + u, xv[u]);
#pragma unroll
    for (int u = 0; u < U; ++u)
      compute(q[u], lo[u], hi[u], xv[u]);
  }
  if (!waited)
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
  for (; c0 < c_end; ++c0) {
    uint4 q, xv[NT][XU];
    uint32_t lo, hi;
    load_w(c0, q, lo, hi);
    load_x(c0, xv);
    compute(q, lo, hi, xv);
  }

  /* Row g / g + 8, tokens 2t / 2t + 1 of each token group: into this warp's partial tile. */
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = nt * 8 + 2 * t;
    red[warp][g][tok] = acc[0][nt][0] + acc[1][nt][0];
    red[warp][g][tok + 1] = acc[0][nt][1] + acc[1][nt][1];
    red[warp][g + 8][tok] = acc[0][nt][2] + acc[1][nt][2];
    red[warp][g + 8][tok + 1] = acc[0][nt][3] + acc[1][nt][3];
  }
  if (a.splits > 1)
    cluster.sync();
  else
    __syncthreads();
  const float out_scale = a.alpha[expert] * (BF16 ? 0x1p63f : 128.0f);
  constexpr int total = MT * R * 16;
  const int per = (total + a.splits - 1) / a.splits;
  const int e_end = min(total, (split + 1) * per);
  for (int e = split * per + (int)threadIdx.x; e < e_end; e += kStreamWarps * 32) {
    const int tok = e / (R * 16), rr = e % (R * 16), n = rb * R * 16 + rr;
    if (tok >= count || n >= a.n)
      continue;
    float v = 0.0f;
    for (int q = 0; q < a.splits; ++q) {
      const float(*part)[16][MT + 1] = a.splits > 1 ? cluster.map_shared_rank(red, q) : red;
#pragma unroll
      for (int r = 0; r < RUNS; ++r)
        v += part[r * R + rr / 16][rr % 16][tok];
    }
    v *= out_scale;
    if (a.bias)
      v += load_f(a.bias, a.bias_dtype, (long long)expert * a.n + n);
    const long long yi = (long long)(routed ? pair_of[tok] : tok) * a.n + n;
    if (a.y_pairs)
      a.y_pairs[yi] = v;
    else
      store_f(a.y, a.y_dtype, yi, v);
  }
  if (a.splits > 1)
    cluster.sync(); /* the others may still read our partial tile */
}

/* ---- the wgmma kernel (sm_90a) ------------------------------------------------------------------ */

/*
 * y^T = W x^T on Hopper's warpgroup MMA. The weight tile words are wgmma's register-sourced A
 * operand as they are (per warp the A fragment is mma.m16n8k16's), dequantised exactly to
 * bf16 (or f16) in registers between the shared-memory load and the wgmma; the activations,
 * staged by stage_x_kernel into the order layout.h describes, are the B operand through a
 * shared-memory descriptor. A block is one producer warpgroup, whose one thread issues bulk
 * copies (cp.async.bulk, completing on an mbarrier per stage) of a few 64-K chunks' weight
 * tiles, scale atoms and activations into a ring of NS stages (WgSmem), and two consumer
 * warpgroups, each RWG x 64 weight rows by MT tokens; setmaxnreg moves registers from the
 * producer to the consumers. A consumer decodes chunk s + 1's fragments while the tensor
 * cores run chunk s (two fragment buffers), and frees a stage once the wgmma that read it
 * has completed. The K split across a cluster and the epilogue (alpha, bias, the output
 * dtype) are the ring kernel's: partial tiles through distributed shared memory in rank
 * order, the same bits every time. Routed MoE (a.tiles set): blockIdx.x is a token tile of
 * moe_align_kernel's list, whose activations stage_x_kernel gathered into the staged tile of
 * the same index; the block reads that tile's expert and writes the rows of its pairs.
 * Two variants of the same pipeline: FP8 (opt-in FP8 activations: e4m3 staged activations, the
 * decoded weights rounded to e4m3, k32 MMAs; layout.h, "FP8 activations") and MX (MXFP4 weights:
 * tile-major code units and their e8m0 scale bytes copied tile by tile, each scale folded into the
 * bf16 fragment by two exact multiplies; layout.h, "MXFP4 weights on the wgmma kernel").
 */
/*
 * wgmma with the A fragment in registers (4 registers a thread) and B through a shared-memory
 * descriptor, f32 accumulators d[N / 2] (accumulating: scale-d 1), B K-major: m64nNk16 on bf16
 * or f16 operands, m64nNk32 on e4m3 ones (FP8 activations; no transpose immediate there). The
 * operand list is fixed per N, so WGMMA_WIDTH writes one struct per N from its list.
 */
enum WgType { kWgBf16, kWgF16, kWgE4m3 };
template <int N, int T> struct Wgmma;
#define WGMMA_ASM(INSTR, OPERANDS, IMM, ...)                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned." INSTR " " OPERANDS    \
               ", p, 1, 1" IMM ";\n}\n"                                                                      \
               : __VA_ARGS__                                                                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc))
#define WGMMA_WIDTH(N, OPERANDS, ...)                                                                        \
  template <int T> struct Wgmma<N, T> {                                                                      \
    static __device__ __forceinline__ void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) {   \
      if constexpr (T == kWgBf16)                                                                            \
        WGMMA_ASM("m64n" #N "k16.f32.bf16.bf16", OPERANDS, ", 0", __VA_ARGS__);                              \
      else if constexpr (T == kWgF16)                                                                        \
        WGMMA_ASM("m64n" #N "k16.f32.f16.f16", OPERANDS, ", 0", __VA_ARGS__);                                \
      else                                                                                                   \
        WGMMA_ASM("m64n" #N "k32.f32.e4m3.e4m3", OPERANDS, "", __VA_ARGS__);                                 \
    }                                                                                                        \
  };
WGMMA_WIDTH(8, "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]))
WGMMA_WIDTH(16, "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12", "+f"(d[0]), "+f"(d[1]),
            "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]))
WGMMA_WIDTH(
    32, "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20",
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]))
WGMMA_WIDTH(64,
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
            "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36",
            "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
            "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
            "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
            "+f"(d[29]), "+f"(d[30]), "+f"(d[31]))
WGMMA_WIDTH(128,
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
            "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
            "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
            "%59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68",
            "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
            "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
            "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
            "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
            "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
            "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
            "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
            "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
            "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]))
WGMMA_WIDTH(
    256,
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
    "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "
    "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "
    "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, "
    "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, "
    "%102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, "
    "%119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132",
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]),
    "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
    "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]),
    "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]),
    "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]))
#undef WGMMA_WIDTH
#undef WGMMA_ASM

constexpr int kWgThreads = 384; /* producer warpgroup + two consumer warpgroups */

struct WgArgs {
  GemmArgs g;          /* weights, scales, alpha, bias, y, n, k, chunks, splits, expert */
  const uint8_t *x;    /* staged activations (layout.h), tiles of MT tokens */
  int multicast;       /* row blocks of a cluster sharing each activation tile (1: none; splits 1 then) */
  const float *x_amax; /* FP8 activations: max |x| of each staged token row (its scale: / 448) */
};

/*
 * Shared memory of the wgmma kernel: a ring of NS stages of G chunks each, a stage holding
 * per 128-row group the G chunks' weight tiles (G x 8 x 512 bytes, as layout.h has them for
 * a full group) and scale atoms (G x 512), then the G chunks' staged activations. A stage is
 * 2 x RWG + 1 bulk copies: few and large, since each copy costs the copy engine a fixed
 * time (on the H200 a ring of 512-byte copies ran at ~75 ns per copy). G: the most chunks
 * (1, 2 or 4) that keep a stage within 48 KB. The reduction tile reuses the ring.
 */
template <int MT, int RWG, int XB = 2> struct WgSmem { /* XB: bytes per staged activation */
  static constexpr int ROWS = 128 * RWG;               /* weight rows per block */
  static constexpr int CHUNK_BYTES = RWG * (8 * NVFP4_TILE_BYTES + NVFP4_SF_ATOM) + MT * NVFP4_CHUNK_K * XB;
  static constexpr int G = 4 * CHUNK_BYTES <= 48 * 1024 ? 4 : 2 * CHUNK_BYTES <= 48 * 1024 ? 2 : 1;
  static constexpr int W_GROUP = G * 8 * NVFP4_TILE_BYTES; /* one group's weights in a stage */
  static constexpr int SF_GROUP = G * NVFP4_SF_ATOM;
  static constexpr int X_CHUNK = MT * NVFP4_CHUNK_K * XB;
  static constexpr int SF_OFF = RWG * W_GROUP, X_OFF = SF_OFF + RWG * SF_GROUP; /* weights at 0 */
  static constexpr int STAGE = X_OFF + G * X_CHUNK;
  static constexpr int NS = (200 * 1024 / STAGE) < 8 ? (200 * 1024 / STAGE) : 8;
  static constexpr int RED_STRIDE = ROWS + 4; /* f32 words per token of the reduction tile */
  static constexpr int RED_BYTES = MT * RED_STRIDE * 4;
  static constexpr int BYTES = NS * STAGE > RED_BYTES ? NS *STAGE : RED_BYTES;
  static_assert(NS >= 3, "at least three stages");
};

/* sm_90a device code only (the compute_90 PTX pass has no wgmma nor setmaxnreg). */
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t *bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
  asm volatile("{\n"
               ".reg .pred done;\n"
               "wait_%=:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               "@!done bra wait_%=;\n"
               "}\n" ::"r"(smem_addr(bar)),
               "r"(parity)
               : "memory");
}
/* bytes (a multiple of 16) from global src to shared dst, completing on bar. */
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

/* The same bytes into every block of the cluster whose rank's bit is set in `mask`, at dst's offset in
 * each, completing on the barrier at bar's offset in each. */
__device__ __forceinline__ void bulk_copy_multicast(void *dst, const void *src, uint32_t bytes, uint64_t *bar,
                                                    uint16_t mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], "
      "%2, [%3], %4;\n" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "h"(mask)
      : "memory");
}
/* Arrives on the barrier at bar's offset in the shared memory of the cluster's block `rank`. */
__device__ __forceinline__ void mbar_arrive_at(uint64_t *bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

/* The B descriptor of k-step j of a staged chunk at smem x: no swizzle, leading (K) byte
 * offset 16 * MT between the step's two core matrices, stride 128 bytes between 8-token
 * groups (layout.h). */
template <int MT> __device__ __forceinline__ uint64_t x_desc(const unsigned char *x, int j) {
  const uint32_t addr = smem_addr(x + j * 32 * MT);
  return (uint64_t)((addr & 0x3ffff) >> 4) | ((uint64_t)((16 * MT) >> 4) << 16) |
         ((uint64_t)(128 >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void acc_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+f"(d[i])::"memory");
}

/* Two f16x2 pairs (elements e 0/1 and e 2/3 of a row) as four e4m3 bytes, the first lowest
 * (round to nearest even, saturating; the values are at most 6 x 448 x 2^-7 = 21). */
__device__ __forceinline__ uint32_t e4m3_quad(uint32_t lo, uint32_t hi) {
  __half2_raw l, h;
  l.x = (unsigned short)(lo & 0xffffu), l.y = (unsigned short)(lo >> 16);
  h.x = (unsigned short)(hi & 0xffffu), h.y = (unsigned short)(hi >> 16);
  return (uint32_t)__nv_cvt_halfraw2_to_fp8x2(l, __NV_SATFINITE, __NV_E4M3) |
         (uint32_t)__nv_cvt_halfraw2_to_fp8x2(h, __NV_SATFINITE, __NV_E4M3) << 16;
}

/* The e4m3 A fragment of one k32 step from tile words w0 and w1 (layout.h: a0 / a1 rows g / g + 8
 * from w0, a2 / a3 from w1), with the f16 block scales of rows g (s_lo) and g + 8 (s_hi). */
__device__ __forceinline__ void e4m3_fragment(uint32_t w0, uint32_t w1, uint32_t s_lo, uint32_t s_hi,
                                              uint32_t (&a)[4]) {
  uint32_t h[4];
  dequant<false>(w0, s_lo, s_hi, h); /* pairs: row g e 0/1, row g + 8 e 0/1, row g e 2/3, row g + 8 e 2/3 */
  a[0] = e4m3_quad(h[0], h[2]);
  a[1] = e4m3_quad(h[1], h[3]);
  dequant<false>(w1, s_lo, s_hi, h);
  a[2] = e4m3_quad(h[0], h[2]);
  a[3] = e4m3_quad(h[1], h[3]);
}

/* The bf16 A fragment of one k-step from an MXFP4 tile word q, with the e8m0 scales of rows g (e_lo) and
 * g + 8 (e_hi) of the step's block: each decoded pair times the scale's two factors (layout.h,
 * mxfp4_wg_scale), code x 2^(e - 130) exactly. */
__device__ __forceinline__ void dequant_mx(uint32_t q, uint32_t e_lo, uint32_t e_hi, uint32_t (&a)[4]) {
  uint32_t lo1, lo2, hi1, hi2;
  mxfp4_wg_scale(e_lo, &lo1, &lo2);
  mxfp4_wg_scale(e_hi, &hi1, &hi2);
  a[0] = hmul2<true>(hmul2<true>(nvfp4_pair_bf16(q, 0), lo1), lo2); /* row g,     k 2t, 2t+1 */
  a[1] = hmul2<true>(hmul2<true>(nvfp4_pair_bf16(q, 1), hi1), hi2); /* row g + 8 */
  a[2] = hmul2<true>(hmul2<true>(nvfp4_pair_bf16(q, 2), lo1), lo2); /* row g,     k 2t+8, 2t+9 */
  a[3] = hmul2<true>(hmul2<true>(nvfp4_pair_bf16(q, 3), hi1), hi2); /* row g + 8 */
}

#endif

template <int MT, int RWG, bool BF16, bool FP8 = false, bool MX = false>
__global__ void __launch_bounds__(kWgThreads, 1) nvfp4_wgmma_kernel(const WgArgs wa) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgSmem<MT, RWG, FP8 ? 1 : 2>;
  const GemmArgs &a = wa.g;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[L::NS], empty[L::NS];

  cg::cluster_group cluster = cg::this_cluster();
  /* A cluster is either a K split (its blocks share the row block) or `mc` row blocks sharing the
   * activations, each block copying 1 / mc of every stage's into all of them. */
  const int mc = wa.multicast, split = a.splits > 1 ? (int)cluster.block_rank() : 0;
  const unsigned mc_rank = mc > 1 ? cluster.block_rank() : 0;
  const int per_split = (a.chunks + a.splits - 1) / a.splits;
  const int c_begin = min(a.chunks, split * per_split), c_end = min(a.chunks, c_begin + per_split);
  const int chunks = c_end - c_begin, stages = (chunks + L::G - 1) / L::G;
  const int rb = blockIdx.y, token_tile = blockIdx.x;
  const int wg = threadIdx.x / 128;
  /* Routed: moe_align_kernel finished before stage_x_kernel started, so the tile list is
   * readable even before griddepcontrol.wait. */
  int expert = a.expert, start = 0, count = min(MT, a.m - token_tile * MT);
  if (a.tiles) {
    if (token_tile >= *a.num_tiles)
      return; /* the whole cluster leaves: its blocks share blockIdx.x */
    const int4 tl = a.tiles[token_tile];
    expert = tl.x, start = tl.y, count = tl.z;
  }

  if (threadIdx.x == 0) {
    for (int s = 0; s < L::NS; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8 * mc); /* one arrival per consumer warp of every block it shares with */
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (mc > 1)
    cluster.sync(); /* the others' barriers are ready before anything lands in or arrives on them */
  else
    __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n"); /* 128 x 40 + 256 x 232 <= 64 K */
    if (threadIdx.x == 0) {
      const uint8_t *x_tile = wa.x + (long long)token_tile * a.chunks * L::X_CHUNK;
      /* Chunks c0 .. c0 + n - 1 of the tile into a stage (multicast: this block's part of them into
       * every block of the cluster; each block's barrier expects all of them). */
      auto copy_x = [&](unsigned char *dst, int c0, int n, uint64_t *bar) {
        const uint8_t *src = x_tile + (long long)c0 * L::X_CHUNK;
        const uint32_t bytes = (uint32_t)(n * L::X_CHUNK);
        if (mc == 1) {
          bulk_copy(dst, src, bytes, bar);
        } else {
          const uint32_t part = bytes / (uint32_t)mc; /* X_CHUNK is a multiple of 16 x 4 */
          bulk_copy_multicast(dst + mc_rank * part, src + mc_rank * part, part, bar,
                              (uint16_t)((1u << mc) - 1));
        }
      };
      /* The weights of the first NS stages go first: they do not depend on stage_x_kernel,
       * which may still be running (programmatic dependent launch); then the activations. */
      const int early = min(stages, L::NS);
      for (int s = 0; s < stages; ++s) {
        if (s == early) {
          asm volatile("griddepcontrol.wait;\n" ::: "memory");
          for (int e = 0; e < early; ++e) {
            const int c0 = c_begin + e * L::G, n = min(L::G, c_end - c0);
            copy_x(smem + e * L::STAGE + L::X_OFF, c0, n, &full[e]);
          }
        }
        const int slot = s % L::NS, c0 = c_begin + s * L::G, n = min(L::G, c_end - c0);
        if (s >= L::NS)
          mbar_wait(&empty[slot], (uint32_t)((s / L::NS - 1) & 1));
        unsigned char *st = smem + slot * L::STAGE;
        uint32_t bytes = (uint32_t)(n * L::X_CHUNK);
        for (int gi = 0; gi < RWG; ++gi) {
          const int group = rb * RWG + gi, tiles = min(8, a.w_tiles - group * 8);
          if (tiles > 0)
            bytes += (uint32_t)(n * (MX ? tiles * (MXFP4_UNIT_BYTES + MXFP4_UNIT_SCALES)
                                        : tiles * NVFP4_TILE_BYTES + NVFP4_SF_ATOM));
        }
        mbar_expect_tx(&full[slot], bytes);
        for (int gi = 0; gi < RWG; ++gi) {
          const int group = rb * RWG + gi, tiles = min(8, a.w_tiles - group * 8);
          if (tiles <= 0)
            continue;
          if constexpr (MX) { /* unit (tile, chunk) at tile * chunks + chunk: each tile's n chunks in a row */
            for (int tt = 0; tt < tiles; ++tt) {
              const long long unit = (long long)(group * 8 + tt) * a.chunks + c0;
              bulk_copy(st + gi * L::W_GROUP + tt * L::G * MXFP4_UNIT_BYTES,
                        a.w + expert * a.w_expert_bytes + unit * MXFP4_UNIT_BYTES,
                        (uint32_t)(n * MXFP4_UNIT_BYTES), &full[slot]);
              bulk_copy(st + L::SF_OFF + gi * L::SF_GROUP + tt * L::G * MXFP4_UNIT_SCALES,
                        a.sf + expert * a.sf_expert_bytes + unit * MXFP4_UNIT_SCALES,
                        (uint32_t)(n * MXFP4_UNIT_SCALES), &full[slot]);
            }
            continue;
          }
          /* A full group's chunks are contiguous at 8 x 512 bytes a chunk, as in the stage. */
          const uint8_t *w = a.w + expert * a.w_expert_bytes +
                             nvfp4_w_tile_offset((long long)group * 8, c0, a.w_tiles, a.chunks);
          unsigned char *dst = st + gi * L::W_GROUP;
          if (tiles == 8)
            bulk_copy(dst, w, (uint32_t)(n * 8 * NVFP4_TILE_BYTES), &full[slot]);
          else
            for (int c = 0; c < n; ++c)
              bulk_copy(dst + c * 8 * NVFP4_TILE_BYTES, w + (long long)c * tiles * NVFP4_TILE_BYTES,
                        (uint32_t)(tiles * NVFP4_TILE_BYTES), &full[slot]);
          bulk_copy(st + L::SF_OFF + gi * L::SF_GROUP,
                    a.sf + expert * a.sf_expert_bytes + ((long long)group * a.sf_atoms + c0) * NVFP4_SF_ATOM,
                    (uint32_t)(n * NVFP4_SF_ATOM), &full[slot]);
        }
        if (s >= early)
          copy_x(st + L::X_OFF, c0, n, &full[slot]);
      }
      if (stages == early) { /* all stages were early */
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
        for (int e = 0; e < early; ++e) {
          const int c0 = c_begin + e * L::G, n = min(L::G, c_end - c0);
          copy_x(smem + e * L::STAGE + L::X_OFF, c0, n, &full[e]);
        }
      }
    }
    if (a.splits > 1) { /* the consumers' two cluster barriers */
      cluster.sync();
      cluster.sync();
    } else if (mc > 1) { /* their last */
      cluster.sync();
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int cwg = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  /* This warp's tile in each 128-row group (rows 16 tib .. of the group) and its scales'
   * lane offset in the atom: row 16 tib + g at (r % 32) * 16 + ((r / 32) % 4) * 4 + column t. */
  const int tib = cwg * 4 + warp;
  const int sf_lane = (16 * (tib & 1) + g) * 16 + (tib >> 1) * 4 + t;

  float acc[RWG][MT / 2];
#pragma unroll
  for (int r = 0; r < RWG; ++r)
#pragma unroll
    for (int i = 0; i < MT / 2; ++i)
      acc[r][i] = 0.0f;
  constexpr int KS = FP8 ? 2 : 4; /* k-steps of a chunk: k16 on 16-bit operands, k32 on e4m3 */
  uint32_t frag[2][RWG][KS][4];

  /* Chunk i of the split (stage i / G, its chunk i % G): decode into fragment buffer B,
   * issue 4 x RWG wgmmas, then wait for chunk i - 1's; at a stage's first chunk the
   * previous stage is then read in full and goes back to the producer. */
  auto step = [&](int i, auto buf) {
    constexpr int B = decltype(buf)::value;
    const int stage = i / L::G, slot = stage % L::NS, ci = i % L::G;
    if (ci == 0)
      mbar_wait(&full[slot], (uint32_t)((stage / L::NS) & 1));
    const unsigned char *st = smem + slot * L::STAGE;
#pragma unroll
    for (int r = 0; r < RWG; ++r) {
      if constexpr (MX) {
        /* The lane's 16 code bytes and four scale bytes (rows g, g + 8 of blocks 0, 1) of unit (tib, ci). */
        const int unit = tib * L::G + ci;
        const uint4 q =
            *reinterpret_cast<const uint4 *>(st + r * L::W_GROUP + unit * MXFP4_UNIT_BYTES + lane * 16);
        const uint32_t e = *reinterpret_cast<const uint32_t *>(st + L::SF_OFF + r * L::SF_GROUP +
                                                               unit * MXFP4_UNIT_SCALES + g * 4);
        dequant_mx(q.x, e & 0xffu, (e >> 8) & 0xffu, frag[B][r][0]);
        dequant_mx(q.y, e & 0xffu, (e >> 8) & 0xffu, frag[B][r][1]);
        dequant_mx(q.z, (e >> 16) & 0xffu, e >> 24, frag[B][r][2]);
        dequant_mx(q.w, (e >> 16) & 0xffu, e >> 24, frag[B][r][3]);
        continue;
      }
      const uint4 q = *reinterpret_cast<const uint4 *>(st + r * L::W_GROUP +
                                                       (ci * 8 + tib) * NVFP4_TILE_BYTES + lane * 16);
      const unsigned char *sf = st + L::SF_OFF + r * L::SF_GROUP + ci * NVFP4_SF_ATOM + sf_lane;
      uint32_t s_lo, s_hi;
      if constexpr (FP8) {
        /* The f16 decode (code x scale x 2^-7, exact), rounded to e4m3: words 2s and 2s + 1
         * give k-step s (layout.h, nvfp4_x8_k). */
        block_scales<false>(sf[0], sf[128], s_lo, s_hi);
        e4m3_fragment(q.x, q.y, s_lo, s_hi, frag[B][r][0]);
        e4m3_fragment(q.z, q.w, s_lo, s_hi, frag[B][r][1]);
      } else {
        block_scales<BF16>(sf[0], sf[128], s_lo, s_hi);
        dequant<BF16>(q.x, s_lo, s_hi, frag[B][r][0]);
        dequant<BF16>(q.y, s_lo, s_hi, frag[B][r][1]);
        dequant<BF16>(q.z, s_lo, s_hi, frag[B][r][2]);
        dequant<BF16>(q.w, s_lo, s_hi, frag[B][r][3]);
      }
    }
    const unsigned char *xs = st + L::X_OFF + ci * L::X_CHUNK;
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < KS; ++j) {
      const uint64_t desc = x_desc<MT>(xs, j);
#pragma unroll
      for (int r = 0; r < RWG; ++r)
        Wgmma<MT, FP8 ? kWgE4m3 : BF16 ? kWgBf16 : kWgF16>::run(acc[r], frag[B][r][j], desc);
    }
    wgmma_commit();
    wgmma_wait<1>();
    if (ci == 0 && stage > 0 && lane == 0) {
      if (mc == 1)
        mbar_arrive(&empty[(stage - 1) % L::NS]);
      else /* every block's producer writes into this block's stage: each waits for it */
        for (int q = 0; q < mc; ++q)
          mbar_arrive_at(&empty[(stage - 1) % L::NS], (uint32_t)q);
    }
  };
  int i = 0;
  for (; i + 1 < chunks; i += 2) {
    step(i, std::integral_constant<int, 0>{});
    step(i + 1, std::integral_constant<int, 1>{});
  }
  if (i < chunks)
    step(i, std::integral_constant<int, 0>{});
  wgmma_wait<0>();
#pragma unroll
  for (int r = 0; r < RWG; ++r)
    acc_fence(acc[r]);
  asm volatile("bar.sync 1, 256;\n" ::: "memory"); /* both consumers are done with the ring */

  /* D fragment: d[4i + 0, 1] row g, tokens 8i + 2t, +1; d[4i + 2, 3] row g + 8. */
  float *red = reinterpret_cast<float *>(smem);
#pragma unroll
  for (int r = 0; r < RWG; ++r) {
    const int row = r * 128 + tib * 16 + g;
#pragma unroll
    for (int n8 = 0; n8 < MT / 8; ++n8) {
      const int tok = 8 * n8 + 2 * t;
      red[tok * L::RED_STRIDE + row] = acc[r][4 * n8];
      red[(tok + 1) * L::RED_STRIDE + row] = acc[r][4 * n8 + 1];
      red[tok * L::RED_STRIDE + row + 8] = acc[r][4 * n8 + 2];
      red[(tok + 1) * L::RED_STRIDE + row + 8] = acc[r][4 * n8 + 3];
    }
  }
  if (a.splits > 1)
    cluster.sync();
  else
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
  /* 2^63 (bf16) or 2^7 (f16, e4m3) undoes the decode's bias; FP8: times the token's scale. */
  const float out_scale = MX ? 8.0f : a.alpha[expert] * (BF16 && !FP8 ? 0x1p63f : 128.0f);
  constexpr int total = MT * L::ROWS;
  const int per = (total + a.splits - 1) / a.splits;
  const int e_end = min(total, (split + 1) * per);
  for (int e = split * per + (int)threadIdx.x - 128; e < e_end; e += 256) {
    const int tok = e / L::ROWS, row = e % L::ROWS, n = rb * L::ROWS + row;
    if (tok >= count || n >= a.n)
      continue;
    float v = 0.0f;
    for (int q = 0; q < a.splits; ++q)
      v += (a.splits > 1 ? cluster.map_shared_rank(red, q) : red)[tok * L::RED_STRIDE + row];
    v *= out_scale;
    if constexpr (FP8)
      v *= wa.x_amax[token_tile * MT + tok] / 448.0f;
    if (a.bias)
      v += load_f(a.bias, a.bias_dtype, (long long)expert * a.n + n);
    const long long yi =
        (long long)(a.tiles ? __ldg(a.pairs + start + tok) : token_tile * MT + tok) * a.n + n;
    if (a.y_pairs)
      a.y_pairs[yi] = v;
    else
      store_f(a.y, a.y_dtype, yi, v);
  }
  if (a.splits > 1 || mc > 1)
    cluster.sync(); /* the others may still read our partial tile, or arrive on our barriers */
#else
  __trap(); /* built without sm_90a: the plan never picks this kernel there */
#endif
}

/*
 * Stages x [m, k] for the wgmma kernel (layout.h): one thread per (token, 64-K chunk) reads
 * the token's 64 activations (zero past m and k), rounds f32 to bf16, and writes them as
 * the 8 runs of 8 that steps j = 0..3, h = 0..1 take: run (j, h) holds 32-bit pairs
 * 8p + 2j + h, p = 0..3, of the chunk. `rows` staged token rows (m rounded up to mt), or,
 * routed (tiles set), the rows of max-tiles token tiles of moe_align_kernel's list: row
 * i * mt + r gathers x row pairs[tiles[i].y + r] / x_div (zero past the tile's count);
 * tiles past the device-side count are skipped (the wgmma kernel never reads them).
 */
struct StageRoute {
  const int4 *tiles; /* NULL: plain */
  const int *num_tiles, *pairs;
  int x_div;
};

template <typename TI, typename TO, bool MX = false>
__global__ void stage_x_kernel(const TI *x, int m, int k, int chunks, int mt, long long rows, long long items,
                               StageRoute route, TO *xs) {
  /* The wgmma kernel after this one may start now: it waits for this grid before it reads xs. */
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int tiles_now = route.tiles ? *route.num_tiles : 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < items;
       i += (long long)gridDim.x * blockDim.x) {
    const int token = (int)(i % rows), c = (int)(i / rows);
    long long src = token < m ? token : -1;
    if (route.tiles) {
      const int tile = token / mt, r = token % mt;
      if (tile >= tiles_now)
        continue;
      const int4 tl = route.tiles[tile];
      src = r < tl.z ? route.pairs[tl.y + r] / route.x_div : -1;
    }
    uint32_t w[32];
    const bool row_ok = src >= 0;
#pragma unroll
    for (int v = 0; v < 8; ++v) { /* 8 elements (4 pairs) at k = 64c + 8v */
      const int kk = c * NVFP4_CHUNK_K + 8 * v;
      const bool ok = row_ok && kk < k; /* k % 16 == 0: a run of 8 is all in or all out */
      if constexpr (sizeof(TI) == 2) {
        const uint4 u = ok ? *reinterpret_cast<const uint4 *>(x + src * k + kk) : make_uint4(0, 0, 0, 0);
        w[4 * v] = u.x, w[4 * v + 1] = u.y, w[4 * v + 2] = u.z, w[4 * v + 3] = u.w;
      } else {
        float4 f0 = make_float4(0, 0, 0, 0), f1 = f0;
        if (ok) {
          f0 = *reinterpret_cast<const float4 *>(x + src * k + kk);
          f1 = *reinterpret_cast<const float4 *>(x + src * k + kk + 4);
        }
        w[4 * v] = bits_of(__floats2bfloat162_rn(f0.x, f0.y));
        w[4 * v + 1] = bits_of(__floats2bfloat162_rn(f0.z, f0.w));
        w[4 * v + 2] = bits_of(__floats2bfloat162_rn(f1.x, f1.y));
        w[4 * v + 3] = bits_of(__floats2bfloat162_rn(f1.z, f1.w));
      }
    }
    /* Element (token, 64c + 16p + 4j + 2h) heads run (j, h) at nvfp4_x_offset; for MXFP4 pair p of run
     * (j, h) is k = 32 (j / 2) + 8p + 4 (j % 2) + 2h (layout.h, mxfp4_wg_x_offset). */
    TO *base = xs + (MX ? mxfp4_wg_x_offset(token, (long long)c * NVFP4_CHUNK_K, chunks, mt)
                        : nvfp4_x_offset(token, (long long)c * NVFP4_CHUNK_K, chunks, mt));
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 run =
            MX ? make_uint4(w[16 * (j / 2) + 2 * (j % 2) + h], w[16 * (j / 2) + 4 + 2 * (j % 2) + h],
                            w[16 * (j / 2) + 8 + 2 * (j % 2) + h], w[16 * (j / 2) + 12 + 2 * (j % 2) + h])
               : make_uint4(w[2 * j + h], w[8 + 2 * j + h], w[16 + 2 * j + h], w[24 + 2 * j + h]);
        *reinterpret_cast<uint4 *>(base + (2 * j + h) * 8 * mt) = run;
      }
  }
}

/*
 * Facts of the current device that a launch needs (its SM count, whether it runs the sm_90a
 * wgmma kernel, an instantiation's shared-memory opt-in and occupancy) are looked up once per
 * device ordinal and kept in that ordinal's atomic slot: the GPUs of one process may differ (an
 * H100 beside an H200, a device that is not 9.0), a function attribute is set per device, and
 * launches come from any thread. A slot holds 0 until known; threads that race to fill it store
 * the same value. cudaGetDevice's ordinal is below cudaGetDeviceCount(); an ordinal past the
 * slots (more devices than any host has) is looked up at every call.
 */
constexpr int kCachedDevices = 64;
typedef std::atomic<int> DeviceSlots[kCachedDevices];

/* slots' value for the current device, from look_up(ordinal) the first time: a value > 0, or 0
 * when the lookup failed (nothing is kept then; the next call asks again). */
/*
 * FP8 activations (layout.h, "FP8 activations"): token_amax_kernel writes max |x| of each of
 * `rows` staged token rows (0 past m; routed, of the row staged_source names), one warp a row;
 * stage_x8_kernel then writes every
 * (row, 64-K chunk) as e4m3 bytes of x * (448 / amax) (0 where amax is 0), rounded to nearest
 * even and saturating, in the staged FP8 order. The wgmma kernel multiplies each token's sums
 * by amax / 448.
 */
template <typename TI> __device__ __forceinline__ float to_f32(TI v) {
  if constexpr (std::is_same<TI, float>::value)
    return v;
  else if constexpr (std::is_same<TI, __half>::value)
    return __half2float(v);
  else
    return __bfloat162float(v);
}

/* The x row staged row `row` takes (tiles of mt rows): plain, the row itself below m; routed, the tile's
 * pair's token (moe_align_kernel's list; -1 past its count). -2: a routed tile past the device-side
 * count, which the wgmma kernel never reads (nothing is written for it). */
__device__ __forceinline__ long long staged_source(long long row, int m, int mt, const StageRoute &route,
                                                   int tiles_now) {
  if (!route.tiles)
    return row < m ? row : -1;
  const int tile = (int)(row / mt), r = (int)(row % mt);
  if (tile >= tiles_now)
    return -2;
  const int4 tl = route.tiles[tile];
  return r < tl.z ? route.pairs[tl.y + r] / route.x_div : -1;
}

template <typename TI>
__global__ void token_amax_kernel(const TI *x, int m, int k, int mt, long long rows, StageRoute route,
                                  float *amax) {
  const int lane = threadIdx.x % 32, tiles_now = route.tiles ? *route.num_tiles : 0;
  const long long warps = (long long)gridDim.x * blockDim.x / 32;
  for (long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32; row < rows; row += warps) {
    const long long src = staged_source(row, m, mt, route, tiles_now);
    if (src == -2)
      continue;
    float a = 0.0f;
    if (src >= 0)
      for (int i = lane; i < k; i += 32)
        a = fmaxf(a, fabsf(to_f32(x[src * k + i])));
#pragma unroll
    for (int o = 16; o > 0; o /= 2)
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    if (lane == 0)
      amax[row] = a;
  }
}

template <typename TI>
__global__ void stage_x8_kernel(const TI *x, int m, int k, int chunks, int mt, long long rows,
                                long long items, StageRoute route, const float *amax, uint8_t *xs) {
  /* The wgmma kernel after this one may start now: it waits for this grid before it reads xs. */
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int tiles_now = route.tiles ? *route.num_tiles : 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < items;
       i += (long long)gridDim.x * blockDim.x) {
    const long long token = i % rows, src = staged_source(token, m, mt, route, tiles_now);
    const int c = (int)(i / rows);
    if (src == -2)
      continue;
    const float inv = src >= 0 && amax[token] > 0.0f ? 448.0f / amax[token] : 0.0f;
    float v[NVFP4_CHUNK_K];
#pragma unroll
    for (int e = 0; e < NVFP4_CHUNK_K; ++e) {
      const int kk = c * NVFP4_CHUNK_K + e;
      v[e] = src >= 0 && kk < k ? to_f32(x[src * k + kk]) * inv : 0.0f;
    }
    uint8_t *base = xs + nvfp4_x8_offset(token, (long long)c * NVFP4_CHUNK_K, chunks, mt);
#pragma unroll
    for (int sq = 0; sq < 4; ++sq) { /* run (s, q): logical columns 16q .. 16q + 15 of step s */
      uint32_t w[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const int k0 = nvfp4_x8_k(sq / 2, 16 * (sq % 2) + 4 * t); /* then k0 + 1 .. k0 + 3 */
        w[t] =
            (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(v[k0], v[k0 + 1]), __NV_SATFINITE, __NV_E4M3) |
            (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(v[k0 + 2], v[k0 + 3]), __NV_SATFINITE, __NV_E4M3)
                << 16;
      }
      *reinterpret_cast<uint4 *>(base + sq * 16 * mt) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

template <typename LookUp> int per_device(DeviceSlots &slots, LookUp look_up) {
  int dev = -1;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kCachedDevices)
    return look_up(dev);
  int value = slots[dev].load(std::memory_order_acquire);
  if (value == 0 && (value = look_up(dev)) > 0)
    slots[dev].store(value, std::memory_order_release);
  return value;
}

/* Opts `kernel` into `bytes` of dynamic shared memory on the current device, once per device
 * (`done`: the kernel's own slots). */
template <typename Kernel> cudaError_t opt_in_smem(DeviceSlots &done, Kernel kernel, int bytes) {
  cudaError_t err = cudaSuccess;
  per_device(done, [&](int) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    return err == cudaSuccess ? 1 : 0;
  });
  return err;
}

/* The kernel's shared memory limit, set once per instantiation and device. */
template <class S, typename TI> cudaError_t prepare_kernel() {
  static DeviceSlots configured;
  return opt_in_smem(configured, nvfp4_gemm_kernel<S, TI>, Smem<S, TI>::BYTES);
}

/* Blocks of the instantiation that fit on one SM of the current device at once. */
template <class S, typename TI> int resident_blocks() {
  static DeviceSlots blocks;
  int n = per_device(blocks, [](int) {
    int b = 0;
    if (prepare_kernel<S, TI>() != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, nvfp4_gemm_kernel<S, TI>, S::THREADS,
                                                      Smem<S, TI>::BYTES) != cudaSuccess)
      return 0;
    return b > 0 ? b : 0;
  });
  return n > 0 ? n : 1;
}

/* Launches kernel(a) on grid x a.splits blocks, the splits of each grid point forming one
 * thread-block cluster along z. */
template <typename Args>
cudaError_t launch_cluster(void (*kernel)(const Args), const Args &args, int splits, dim3 grid, int threads,
                           size_t smem, cudaStream_t stream, bool early = false, int cluster_y = 1) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid.x, grid.y, (unsigned)splits);
  cfg.blockDim = dim3((unsigned)threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = (unsigned)cluster_y;
  attr[0].val.clusterDim.z = (unsigned)splits;
  /* early: may start before the previous kernel on the stream ends (it waits for it with
   * griddepcontrol.wait before reading what that kernel writes). */
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = early ? 2 : 1;
  return cudaLaunchKernelEx(&cfg, kernel, args);
}

template <class S, typename TI>
cudaError_t launch_gemm(const GemmArgs &a, int grid_x, int grid_y, cudaStream_t stream) {
  cudaError_t err = prepare_kernel<S, TI>();
  if (err != cudaSuccess)
    return err;
  return launch_cluster(nvfp4_gemm_kernel<S, TI>, a, a.splits, dim3((unsigned)grid_x, (unsigned)grid_y),
                        S::THREADS, Smem<S, TI>::BYTES, stream);
}

/* Calls f(Shape{}, TI{}) with the instantiation a plan and an activation dtype select. */
template <typename TI, int MT, int RT, class F> cudaError_t visit_depth(bool shallow, F &&f) {
  constexpr int NS = depth_for(MT);
  return shallow ? f(Shape<MT, RT, NS / 2>{}, TI{}) : f(Shape<MT, RT, NS>{}, TI{});
}

template <typename TI, class F> cudaError_t visit_shape(const struct nvfp4_tuning &plan, F &&f) {
  const bool shallow = plan.depth < depth_for(plan.tile_m);
  switch (plan.tile_m) {
  case 8: return visit_depth<TI, 8, 1>(shallow, f);
  case 16: return visit_depth<TI, 16, 1>(shallow, f);
  case 32: return visit_depth<TI, 32, 2>(shallow, f);
  default: return visit_depth<TI, 64, 2>(shallow, f);
  }
}

template <class F> cudaError_t visit(const struct nvfp4_tuning &plan, enum qkeep_dtype x_dtype, F &&f) {
  switch (x_dtype) {
  case QKEEP_DTYPE_BF16: return visit_shape<__nv_bfloat16>(plan, f);
  case QKEEP_DTYPE_F16: return visit_shape<__half>(plan, f);
  case QKEEP_DTYPE_F32: return visit_shape<float>(plan, f);
  default: return cudaErrorInvalidValue;
  }
}

cudaError_t dispatch(const struct nvfp4_tuning &plan, enum qkeep_dtype x_dtype, const GemmArgs &a, int grid_x,
                     int grid_y, cudaStream_t stream) {
  return visit(plan, x_dtype, [&](auto shape, auto ti) {
    return launch_gemm<decltype(shape), decltype(ti)>(a, grid_x, grid_y, stream);
  });
}

/* early: with programmatic dependent launch (all but the benches' plan.late). */
template <typename TI, int MT, int R, int U, int BPS>
cudaError_t launch_stream(const GemmArgs &a, dim3 grid, cudaStream_t stream, bool early) {
  return launch_cluster(nvfp4_stream_kernel<TI, MT, R, U, BPS>, a, a.splits, grid, kStreamWarps * 32, 0,
                        stream, early);
}

template <typename TI, int MT, int R>
cudaError_t stream_unroll(const struct nvfp4_tuning &plan, const GemmArgs &a, dim3 grid, cudaStream_t st) {
  if (plan.unroll == 8)
    return launch_stream<TI, MT, R, 8, 1>(a, grid, st, !plan.late);
  return plan.depth == 3 ? launch_stream<TI, MT, R, 4, 3>(a, grid, st, !plan.late)
                         : launch_stream<TI, MT, R, 4, 2>(a, grid, st, !plan.late);
}

template <typename TI, int MT>
cudaError_t stream_rows(const struct nvfp4_tuning &plan, const GemmArgs &a, dim3 grid, cudaStream_t st) {
  switch (plan.rows) {
  case 1: return stream_unroll<TI, MT, 1>(plan, a, grid, st);
  case 2: return stream_unroll<TI, MT, 2>(plan, a, grid, st);
  default: return stream_unroll<TI, MT, 4>(plan, a, grid, st);
  }
}

template <typename TI>
cudaError_t stream_tokens(const struct nvfp4_tuning &plan, const GemmArgs &a, dim3 grid, cudaStream_t st) {
  return plan.tile_m == 8 ? stream_rows<TI, 8>(plan, a, grid, st) : stream_rows<TI, 16>(plan, a, grid, st);
}

cudaError_t dispatch_stream(const struct nvfp4_tuning &plan, enum qkeep_dtype x_dtype, const GemmArgs &a,
                            dim3 grid, cudaStream_t st) {
  switch (x_dtype) {
  case QKEEP_DTYPE_BF16: return stream_tokens<__nv_bfloat16>(plan, a, grid, st);
  case QKEEP_DTYPE_F16: return stream_tokens<__half>(plan, a, grid, st);
  case QKEEP_DTYPE_F32: return stream_tokens<float>(plan, a, grid, st);
  default: return cudaErrorInvalidValue;
  }
}

template <int MT, int RWG, bool BF16, bool FP8 = false, bool MX = false>
cudaError_t launch_wgmma(const WgArgs &wa, int grid_x, int grid_y, cudaStream_t st) {
  static DeviceSlots configured;
  constexpr int xb = FP8 ? 1 : 2; /* bytes per staged activation */
  constexpr int bytes = WgSmem<MT, RWG, xb>::BYTES;
  cudaError_t err = opt_in_smem(configured, nvfp4_wgmma_kernel<MT, RWG, BF16, FP8, MX>, bytes);
  if (err != cudaSuccess)
    return err;
  return launch_cluster(nvfp4_wgmma_kernel<MT, RWG, BF16, FP8, MX>, wa, wa.g.splits,
                        dim3((unsigned)grid_x, (unsigned)grid_y), kWgThreads, bytes, st, true, wa.multicast);
}

/* The variants (FP8 activations, or MXFP4 weights with bf16 activations): one 64-row MMA tile per consumer
 * warpgroup, token tiles of 32 to 256 (their plans never give another). */
template <bool FP8, bool MX>
cudaError_t wgmma_variant_shape(const struct nvfp4_tuning &plan, const WgArgs &wa, int grid_x, int grid_y,
                                cudaStream_t st) {
  switch (plan.tile_m) {
  case 32: return launch_wgmma<32, 1, true, FP8, MX>(wa, grid_x, grid_y, st);
  case 64: return launch_wgmma<64, 1, true, FP8, MX>(wa, grid_x, grid_y, st);
  case 128: return launch_wgmma<128, 1, true, FP8, MX>(wa, grid_x, grid_y, st);
  case 256: return launch_wgmma<256, 1, true, FP8, MX>(wa, grid_x, grid_y, st);
  default: return cudaErrorInvalidValue;
  }
}

template <bool BF16>
cudaError_t wgmma_shape(const struct nvfp4_tuning &plan, const WgArgs &wa, int grid_x, int grid_y,
                        cudaStream_t st) {
  if (plan.rows == 2)
    switch (plan.tile_m) {
    case 8: return launch_wgmma<8, 2, BF16>(wa, grid_x, grid_y, st);
    case 16: return launch_wgmma<16, 2, BF16>(wa, grid_x, grid_y, st);
    case 32: return launch_wgmma<32, 2, BF16>(wa, grid_x, grid_y, st);
    case 64: return launch_wgmma<64, 2, BF16>(wa, grid_x, grid_y, st);
    default: return launch_wgmma<128, 2, BF16>(wa, grid_x, grid_y, st);
    }
  switch (plan.tile_m) {
  case 8: return launch_wgmma<8, 1, BF16>(wa, grid_x, grid_y, st);
  case 16: return launch_wgmma<16, 1, BF16>(wa, grid_x, grid_y, st);
  case 32: return launch_wgmma<32, 1, BF16>(wa, grid_x, grid_y, st);
  case 64: return launch_wgmma<64, 1, BF16>(wa, grid_x, grid_y, st);
  case 128: return launch_wgmma<128, 1, BF16>(wa, grid_x, grid_y, st);
  default: return launch_wgmma<256, 1, BF16>(wa, grid_x, grid_y, st);
  }
}

int grid_for(long long items, int threads);

/* n bytes of scratch: from the caller's workspace, or (ws NULL) stream-ordered, *owned set. */
cudaError_t take_scratch(struct gpu_scratch *ws, size_t n, cudaStream_t st, void **out, bool *owned) {
  *owned = ws == nullptr;
  if (ws) {
    *out = gpu_scratch_take(ws, n);
    return *out ? cudaSuccess : cudaErrorMemoryAllocation;
  }
  return cudaMallocAsync(out, n, st);
}

cudaError_t give_scratch(void *p, bool owned, cudaStream_t st) {
  return p && owned ? cudaFreeAsync(p, st) : cudaSuccess;
}

/* The staged activations of the wgmma kernel: grid_x token tiles of the plan's tile_m rows (FP8: a
 * byte each, then each row's max |x|). */
size_t wgmma_x_bytes(const struct nvfp4_tuning &plan, long long grid_x, int64_t k) {
  const size_t elems = (size_t)nvfp4_x_elems(grid_x * plan.tile_m, k, plan.tile_m);
  return plan.fp8 ? elems + sizeof(float) * (size_t)(grid_x * plan.tile_m) : elems * 2;
}

/* FP8 activations: each row's max |x| into amax, then x's e4m3 bytes into x8 (plain rows only). */
template <typename TI>
cudaError_t stage_fp8_as(const TI *x, int m, const GemmArgs &a, int mt, long long rows, long long items,
                         const StageRoute &route, float *amax, uint8_t *x8, cudaStream_t st) {
  token_amax_kernel<TI><<<grid_for(rows * 32, 256), 256, 0, st>>>(x, m, a.k, mt, rows, route, amax);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return err;
  stage_x8_kernel<TI>
      <<<grid_for(items, 256), 256, 0, st>>>(x, m, a.k, a.chunks, mt, rows, items, route, amax, x8);
  return cudaGetLastError();
}

cudaError_t stage_fp8(const void *x, enum qkeep_dtype x_dtype, int m, const GemmArgs &a, int mt,
                      long long rows, long long items, const StageRoute &route, float *amax, uint8_t *x8,
                      cudaStream_t st) {
  switch (x_dtype) {
  case QKEEP_DTYPE_F16:
    return stage_fp8_as(static_cast<const __half *>(x), m, a, mt, rows, items, route, amax, x8, st);
  case QKEEP_DTYPE_F32:
    return stage_fp8_as(static_cast<const float *>(x), m, a, mt, rows, items, route, amax, x8, st);
  default:
    return stage_fp8_as(static_cast<const __nv_bfloat16 *>(x), m, a, mt, rows, items, route, amax, x8, st);
  }
}

/* Stages x into scratch, runs the wgmma kernel, gives the scratch back. Plain:
 * a.m tokens; routed (a.tiles set): `routed_tiles` token tiles at most (the grid). */
cudaError_t run_wgmma(const struct nvfp4_tuning &plan, const GemmArgs &a, const void *x,
                      enum qkeep_dtype x_dtype, struct gpu_scratch *ws, cudaStream_t st,
                      long long routed_tiles = 0, bool mx = false) {
  const int mt = plan.tile_m;
  const long long grid_x = a.tiles ? routed_tiles : (a.m + mt - 1) / mt,
                  rows_of_n = (a.n + 128 * plan.rows - 1) / (128 * plan.rows);
  /* A cluster of mc row blocks: the grid rounded up to whole clusters (a block past the last row
   * copies its share of the activations and writes nothing). */
  const int mc = plan.multicast > 1 ? plan.multicast : 1;
  const long long grid_y = (rows_of_n + mc - 1) / mc * mc;
  if (grid_y > 65535 || grid_x > INT32_MAX || grid_x < 1 || (mc > 1 && a.splits > 1) ||
      mc > NVFP4_WGMMA_MULTICAST_MAX)
    return cudaErrorInvalidValue;
  const long long rows = grid_x * mt, items = rows * (long long)a.chunks;
  const StageRoute route = {a.tiles, a.num_tiles, a.pairs, a.x_div};
  const int m = a.tiles ? 0 : a.m;
  void *xs = nullptr;
  bool owned;
  cudaError_t err = take_scratch(ws, wgmma_x_bytes(plan, grid_x, a.k), st, &xs, &owned);
  if (err != cudaSuccess)
    return err;
  const int blocks = grid_for(items, 256);
  if (plan.fp8) { /* e4m3 activations, each staged row's max |x| after them */
    uint8_t *x8 = static_cast<uint8_t *>(xs);
    float *amax = reinterpret_cast<float *>(x8 + (size_t)nvfp4_x_elems(rows, a.k, mt));
    err = stage_fp8(x, x_dtype, m, a, mt, rows, items, route, amax, x8, st);
    if (err == cudaSuccess) {
      WgArgs wa = {a, x8, mc, amax};
      err = wgmma_variant_shape<true, false>(plan, wa, (int)grid_x, (int)grid_y, st);
    }
    cudaError_t free_err = give_scratch(xs, owned, st);
    return err != cudaSuccess ? err : free_err;
  }
  if (mx) { /* MXFP4 codes and scales (bf16 or f32 activations) */
    if (x_dtype == QKEEP_DTYPE_F16) {
      (void)give_scratch(xs, owned, st);
      return cudaErrorInvalidValue;
    }
    if (x_dtype == QKEEP_DTYPE_F32)
      stage_x_kernel<float, __nv_bfloat16, true>
          <<<blocks, 256, 0, st>>>(static_cast<const float *>(x), m, a.k, a.chunks, mt, rows, items, route,
                                   static_cast<__nv_bfloat16 *>(xs));
    else
      stage_x_kernel<__nv_bfloat16, __nv_bfloat16, true>
          <<<blocks, 256, 0, st>>>(static_cast<const __nv_bfloat16 *>(x), m, a.k, a.chunks, mt, rows, items,
                                   route, static_cast<__nv_bfloat16 *>(xs));
    err = cudaGetLastError();
    if (err == cudaSuccess) {
      WgArgs wa = {a, static_cast<const uint8_t *>(xs), mc, nullptr};
      err = wgmma_variant_shape<false, true>(plan, wa, (int)grid_x, (int)grid_y, st);
    }
    cudaError_t free_err = give_scratch(xs, owned, st);
    return err != cudaSuccess ? err : free_err;
  }
  switch (x_dtype) {
  case QKEEP_DTYPE_F16:
    stage_x_kernel<__half, __half><<<blocks, 256, 0, st>>>(static_cast<const __half *>(x), m, a.k, a.chunks,
                                                           mt, rows, items, route, static_cast<__half *>(xs));
    break;
  case QKEEP_DTYPE_F32:
    stage_x_kernel<float, __nv_bfloat16><<<blocks, 256, 0, st>>>(static_cast<const float *>(x), m, a.k,
                                                                 a.chunks, mt, rows, items, route,
                                                                 static_cast<__nv_bfloat16 *>(xs));
    break;
  default:
    stage_x_kernel<__nv_bfloat16, __nv_bfloat16>
        <<<blocks, 256, 0, st>>>(static_cast<const __nv_bfloat16 *>(x), m, a.k, a.chunks, mt, rows, items,
                                 route, static_cast<__nv_bfloat16 *>(xs));
    break;
  }
  err = cudaGetLastError();
  if (err == cudaSuccess) {
    WgArgs wa = {a, static_cast<const uint8_t *>(xs), mc, nullptr};
    err = x_dtype == QKEEP_DTYPE_F16 ? wgmma_shape<false>(plan, wa, (int)grid_x, (int)grid_y, st)
                                     : wgmma_shape<true>(plan, wa, (int)grid_x, (int)grid_y, st);
  }
  cudaError_t free_err = give_scratch(xs, owned, st);
  return err != cudaSuccess ? err : free_err;
}

/* The wgmma kernel is sm_90a code: it runs on compute capability 9.0 alone (of the current device). */
bool wgmma_ok(void) {
  static DeviceSlots sm90; /* 1: no, 2: yes */
  return per_device(sm90, [](int dev) {
           int major = 0, minor = 0;
           if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
               cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
             return 0;
           return major == 9 && minor == 0 ? 2 : 1;
         }) == 2;
}

int resident_per_sm(const struct nvfp4_tuning &plan, enum qkeep_dtype x_dtype) {
  int blocks = 1;
  visit(plan, x_dtype, [&](auto shape, auto ti) {
    blocks = resident_blocks<decltype(shape), decltype(ti)>();
    return cudaSuccess;
  });
  return blocks;
}

/* Multiprocessors of the current device (132, an H100 SXM's, when CUDA cannot say). */
int sm_count(void) {
  static DeviceSlots sms;
  int n = per_device(sms, [](int dev) {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      return 0;
    return count > 0 ? count : 0;
  });
  return n > 0 ? n : 132;
}

int pick_tile_m(int64_t tokens_per_tile, int forced) {
  if (forced == 8 || forced == 16 || forced == 32 || forced == 64)
    return forced;
  return tokens_per_tile <= 8 ? 8 : tokens_per_tile <= 16 ? 16 : tokens_per_tile <= 32 ? 32 : 64;
}

/* The K split (cluster size): as many blocks as fit on the GPU at once (`resident` per SM)
 * without a second, partial wave; at least two chunks per split; at most a portable
 * cluster. */
int pick_split(int64_t blocks, int64_t chunks, int resident, int forced) {
  int cap = nvfp4_clamp(chunks, 1, kMaxSplit);
  if (forced > 0)
    return nvfp4_clamp(forced, 1, cap);
  int64_t want = blocks > 0 ? (int64_t)resident * sm_count() / blocks : 1;
  return nvfp4_clamp(want, 1, nvfp4_clamp(chunks / 2, 1, cap));
}

bool dtype_ok(enum qkeep_dtype d) {
  return d == QKEEP_DTYPE_F32 || d == QKEEP_DTYPE_F16 || d == QKEEP_DTYPE_BF16;
}

GemmArgs gemm_args(const struct nvfp4_weights *wt) {
  GemmArgs a = {};
  a.w = static_cast<const uint8_t *>(wt->w);
  a.sf = static_cast<const uint8_t *>(wt->sf);
  a.alpha = wt->alpha;
  a.bias = wt->bias;
  a.bias_dtype = wt->bias_dtype;
  a.n = (int)wt->n;
  a.k = (int)wt->k;
  a.chunks = (int)nvfp4_w_chunks(wt->k);
  a.sf_atoms = (int)(nvfp4_sf_cols(wt->k / NVFP4_BLOCK) / NVFP4_SF_COLS);
  a.w_tiles = (int)(nvfp4_w_rows(wt->n) / NVFP4_TILE_ROWS);
  a.w_expert_bytes = nvfp4_w_bytes(wt->n, wt->k);
  a.sf_expert_bytes = nvfp4_sf_bytes(wt->n, wt->k / NVFP4_BLOCK);
  a.x_div = 1;
  return a;
}

/* ---- routed MoE: sort (token, slot) pairs by expert, and combine ------------------------------ */

/* One block: counts pairs per expert, lays the experts' pair lists out back to back
 * (sorted), and cuts each list into tiles of at most tile_m pairs. */
__global__ void moe_align_kernel(const int32_t *ids, int pairs, int experts, int tile_m, int *sorted,
                                 int4 *tiles, int *num_tiles) {
  extern __shared__ int shm[];
  int *count = shm, *offset = shm + experts, *tile_off = shm + 2 * experts, *cursor = shm + 3 * experts;
  for (int e = threadIdx.x; e < experts; e += blockDim.x)
    count[e] = cursor[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < experts)
      atomicAdd(&count[e], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) { /* one warp scans: each lane a run of experts */
    const int lane = threadIdx.x, run = (experts + 31) / 32, e0 = lane * run, e1 = min(experts, e0 + run);
    int pairs_run = 0, tiles_run = 0;
    for (int e = e0; e < e1; ++e)
      pairs_run += count[e], tiles_run += (count[e] + tile_m - 1) / tile_m;
    int pairs_inc = pairs_run, tiles_inc = tiles_run;
    for (int d = 1; d < 32; d <<= 1) {
      const int pv = __shfl_up_sync(0xffffffffu, pairs_inc, d),
                tv = __shfl_up_sync(0xffffffffu, tiles_inc, d);
      if (lane >= d)
        pairs_inc += pv, tiles_inc += tv;
    }
    int po = pairs_inc - pairs_run, to = tiles_inc - tiles_run;
    for (int e = e0; e < e1; ++e) {
      offset[e] = po, tile_off[e] = to;
      po += count[e], to += (count[e] + tile_m - 1) / tile_m;
    }
    if (lane == 31)
      *num_tiles = tiles_inc;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < experts)
      sorted[offset[e] + atomicAdd(&cursor[e], 1)] = p;
  }
  for (int e = threadIdx.x; e < experts; e += blockDim.x)
    for (int i = 0; i * tile_m < count[e]; ++i)
      tiles[tile_off[e] + i] = make_int4(e, offset[e] + i * tile_m, min(tile_m, count[e] - i * tile_m), 0);
}

/* y[t] = sum over slots s of topk_weights[t, s] * rows[t * topk + s], skipped slots left out. */
__global__ void moe_combine_kernel(const float *rows, const int32_t *ids, const float *weights, int topk,
                                   int experts, int n, void *y, int y_dtype) {
  const int token = blockIdx.x, col = blockIdx.y * blockDim.x + threadIdx.x;
  if (col >= n)
    return;
  float v = 0.0f;
  for (int s = 0; s < topk; ++s) {
    const long long pair = (long long)token * topk + s;
    const int e = ids[pair];
    if (e >= 0 && e < experts)
      v += weights[pair] * rows[pair * n + col];
  }
  store_f(y, y_dtype, (long long)token * n + col, v);
}

/* ---- PWAL transforms --------------------------------------------------------------------------- */

/*
 * The PWAL transforms run at the speed of a device copy: a block of 128 threads writes one 512-byte
 * unit of the kernel layout (a weight tile x chunk, or a scale atom), a thread one 32-bit word, from
 * reads that fill the sectors they touch; the unit's place is worked out once a thread in 32-bit
 * arithmetic (the index math of layout.h per code or per byte, in 64 bits, ran at a few percent of a
 * copy). Experts along grid y.
 */
constexpr int kTransformThreads = 256; /* two units a block */

__global__ void __launch_bounds__(kTransformThreads)
    tile_weights_kernel(const uint8_t *src, uint8_t *dst, long long experts, long long rows, long long k) {
  /* A thread per lane of a unit (layout.h: lane 4g + t, codes k = 16t .. 16t + 15 of rows g and g + 8 of
   * the tile): two 8-byte reads, four words, one 16-byte store. */
  const unsigned chunks = (unsigned)nvfp4_w_chunks(k), tiles = (unsigned)(nvfp4_w_rows(rows) / 16);
  const unsigned units = tiles * chunks, row_bytes = (unsigned)(k / 2), lane = threadIdx.x % 32;
  const unsigned g = lane / 4, t = lane % 4;
  for (long long e = blockIdx.y; e < experts; e += gridDim.y) {
    const uint8_t *s = src + e * rows * (long long)row_bytes;
    uint4 *d = reinterpret_cast<uint4 *>(dst) + e * (long long)units * 32;
    for (unsigned u = blockIdx.x * (kTransformThreads / 32) + threadIdx.x / 32; u < units;
         u += gridDim.x * (kTransformThreads / 32)) {
      const unsigned group = u / (8 * chunks), in_group = u - group * 8 * chunks;
      const unsigned group_tiles = min(8u, tiles - group * 8);
      const unsigned tile = group * 8 + in_group % group_tiles, chunk = in_group / group_tiles;
      const unsigned r = tile * 16 + g, byte = chunk * 32 + 8 * t; /* k/2 is a multiple of 8: all in or out */
      uint2 lo = make_uint2(0, 0), hi = lo;
      if (byte < row_bytes) {
        if (r < rows)
          lo = *reinterpret_cast<const uint2 *>(s + (size_t)r * row_bytes + byte);
        if (r + 8 < rows)
          hi = *reinterpret_cast<const uint2 *>(s + (size_t)(r + 8) * row_bytes + byte);
      }
      d[(size_t)u * 32 + lane] =
          make_uint4(nvfp4_w_word(lo.x & 0xffffu, hi.x & 0xffffu), nvfp4_w_word(lo.x >> 16, hi.x >> 16),
                     nvfp4_w_word(lo.y & 0xffffu, hi.y & 0xffffu), nvfp4_w_word(lo.y >> 16, hi.y >> 16));
    }
  }
}

__global__ void __launch_bounds__(kTransformThreads)
    swizzle_scales_kernel(const uint8_t *src, uint8_t *dst, long long experts, long long rows,
                          long long cols) {
  const unsigned per_row = (unsigned)(nvfp4_sf_cols(cols) / 4),
                 units = (unsigned)(nvfp4_sf_rows(rows) / 128) * per_row;
  const unsigned word = threadIdx.x % 128, aligned = cols % 4 == 0;
  for (long long e = blockIdx.y; e < experts; e += gridDim.y) {
    const uint8_t *s = src + e * rows * cols;
    uint32_t *d = reinterpret_cast<uint32_t *>(dst) + e * (long long)units * 128;
    for (unsigned u = blockIdx.x * (kTransformThreads / 128) + threadIdx.x / 128; u < units;
         u += gridDim.x * (kTransformThreads / 128)) {
      /* Word w of an atom holds row 32 (w % 4) + w / 4 of its 128, columns 4 (u % per_row) + 0..3. */
      const unsigned r = (u / per_row) * 128 + (word % 4) * 32 + word / 4, c = (u % per_row) * 4;
      uint32_t v = 0;
      if (r < rows && aligned) {
        v = *reinterpret_cast<const uint32_t *>(s + (size_t)r * cols + c); /* c < cols: cols % 4 == 0 */
      } else if (r < rows) {
        for (unsigned i = 0; i < 4 && c + i < cols; i++)
          v |= (uint32_t)s[(size_t)r * cols + c + i] << (8 * i);
      }
      d[(size_t)u * 128 + word] = v;
    }
  }
}

/*
 * The same transforms in place. Both permute bytes only within a 128-row group when nothing is padded
 * (weights: rows % 16 == 0 and K % 64 == 0; scales: rows % 128 == 0 and cols % 4 == 0), so a group read
 * whole into shared memory can be written back over itself: one pass over the bytes, and no second
 * tensor to hold the result. A group larger than one block's share (K above about 2,000 for weights)
 * is spread over a thread-block cluster of up to 8 blocks, each reading `slice` bytes of it and writing
 * its share of the group's units from the cluster's shared memory (distributed shared memory).
 */
template <bool kScales>
__global__ void __launch_bounds__(kTransformThreads)
    transform_in_place_kernel(uint8_t *data, long long experts, unsigned rows, unsigned k, unsigned slice) {
  extern __shared__ uint4 group_bytes[];
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned parts = cluster.num_blocks(), part = cluster.block_rank(), group = blockIdx.x / parts;
  /* k is the scales' columns for kScales: a row of them is k bytes, and an atom group 128 rows. */
  const unsigned row_bytes = kScales ? k : k / 2;
  const unsigned group_tiles = kScales ? 8u : min(8u, rows / 16 - group * 8);
  const unsigned group_rows = group_tiles * 16, units = kScales ? k / 4 : group_tiles * (k / 64);
  const unsigned bytes = group_rows * row_bytes, from = min(bytes, part * slice),
                 to = min(bytes, from + slice);
  const unsigned word = threadIdx.x % 128, first = units * part / parts, last = units * (part + 1) / parts;
  const uint8_t *mine = reinterpret_cast<const uint8_t *>(group_bytes);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  /* The slice comes in by one bulk copy (the copy engine keeps all of it in flight, where the threads'
   * own 16-byte loads kept a few per thread). */
  __shared__ __align__(8) uint64_t loaded;
  uint32_t phase = 0;
  if (threadIdx.x == 0) {
    mbar_init(&loaded, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
#endif
  for (long long e = blockIdx.y; e < experts; e += gridDim.y) {
    uint8_t *base = data + ((size_t)e * rows + (size_t)group * 128) * row_bytes;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (to > from) {
      if (threadIdx.x == 0) {
        /* the last group's reads of this shared memory (generic) before the copy's writes (async) */
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        mbar_expect_tx(&loaded, to - from);
        bulk_copy(group_bytes, base + from, to - from, &loaded);
      }
      mbar_wait(&loaded, phase);
      phase ^= 1;
    }
#else
    for (unsigned i = from / 16 + threadIdx.x; i < to / 16; i += blockDim.x)
      group_bytes[i - from / 16] = reinterpret_cast<const uint4 *>(base)[i];
#endif
    cluster.sync(); /* the whole group is in the cluster's shared memory before any of it is overwritten */
    if constexpr (kScales) { /* a thread per 32-bit word: four scales of one row */
      for (unsigned u = first + threadIdx.x / 128; u < last; u += kTransformThreads / 128) {
        const unsigned at = nvfp4_sf_group_read(u, word, row_bytes), owner = at / slice;
        const uint8_t *p = owner == part ? mine : cluster.map_shared_rank(mine, owner);
        reinterpret_cast<uint32_t *>(base)[(size_t)u * 128 + word] =
            *reinterpret_cast<const uint32_t *>(p + (at - owner * slice));
      }
    } else { /* a thread per lane of a unit: its four words from two 8-byte reads, one 16-byte store */
      const unsigned lane = threadIdx.x % 32;
      for (unsigned u = first + threadIdx.x / 32; u < last; u += kTransformThreads / 32) {
        unsigned lo_at, hi_at; /* multiples of 8, and a slice of 16: neither read crosses a slice */
        nvfp4_w_lane_reads(u, lane, group_tiles, row_bytes, &lo_at, &hi_at);
        const unsigned lo_owner = lo_at / slice, hi_owner = hi_at / slice;
        const uint8_t *lo_p = lo_owner == part ? mine : cluster.map_shared_rank(mine, lo_owner);
        const uint8_t *hi_p = hi_owner == part ? mine : cluster.map_shared_rank(mine, hi_owner);
        const uint2 lo = *reinterpret_cast<const uint2 *>(lo_p + (lo_at - lo_owner * slice));
        const uint2 hi = *reinterpret_cast<const uint2 *>(hi_p + (hi_at - hi_owner * slice));
        reinterpret_cast<uint4 *>(base)[(size_t)u * 32 + lane] =
            make_uint4(nvfp4_w_word(lo.x & 0xffffu, hi.x & 0xffffu), nvfp4_w_word(lo.x >> 16, hi.x >> 16),
                       nvfp4_w_word(lo.y & 0xffffu, hi.y & 0xffffu), nvfp4_w_word(lo.y >> 16, hi.y >> 16));
      }
    }
    cluster.sync(); /* no block leaves, or reads its next group, while another still reads its bytes */
  }
}

/* alpha[e] = the merged global scale, or for compressed-tensors the inverse of its encode factor (0 stays 0).
 */
__global__ void alpha_kernel(const float *scale, float *alpha, long long experts, int invert) {
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < experts;
       e += (long long)gridDim.x * blockDim.x) {
    const float v = scale[e];
    alpha[e] = invert ? (v == 0.0f ? 0.0f : 1.0f / v) : v;
  }
}

/* ---- unquantized layers ----------------------------------------------------------------------- */

template <typename T> __host__ __device__ constexpr int dtype_of() {
  return std::is_same<T, float>::value    ? QKEEP_DTYPE_F32
         : std::is_same<T, __half>::value ? QKEEP_DTYPE_F16
                                          : QKEEP_DTYPE_BF16;
}

/* One warp per output row, lanes striding K; tokens along grid y. */
template <typename TW>
__global__ void dense_kernel(const TW *w, const void *bias, int bias_dtype, int n, int k, int m,
                             const void *x, int x_dtype, void *y, int y_dtype) {
  const int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (row >= n)
    return;
  for (int tok = blockIdx.y; tok < m; tok += gridDim.y) {
    float acc = 0.0f;
    for (int i = lane; i < k; i += 32)
      acc += load_f(w, dtype_of<TW>(), (long long)row * k + i) * load_f(x, x_dtype, (long long)tok * k + i);
    for (int d = 16; d > 0; d >>= 1)
      acc += __shfl_xor_sync(0xffffffffu, acc, d);
    if (lane == 0)
      store_f(y, y_dtype, (long long)tok * n + row, acc + (bias ? load_f(bias, bias_dtype, row) : 0.0f));
  }
}

/* The grid of a transform whose blocks take `per_block` units at a time: units along x (grid-stride past
 * 65535 * 8 blocks' worth), experts along y. */
static dim3 transform_grid(long long units, long long experts, long long per_block) {
  const long long x = (units + per_block - 1) / per_block;
  return dim3((unsigned)(x < 1           ? 1
                         : x > 65535 * 8 ? 65535 * 8
                                         : x),
              (unsigned)(experts > 65535 ? 65535 : experts));
}

int grid_for(long long items, int threads) {
  long long blocks = (items + threads - 1) / threads;
  return (int)(blocks < 1 ? 1 : blocks > 65535 * 8 ? 65535 * 8 : blocks);
}

} // namespace

/* ---- launchers ------------------------------------------------------------------------------------ */

extern "C" int nvfp4_tile_weights_gpu(const void *src, void *dst, int64_t experts, int64_t rows, int64_t k,
                                      void *stream) {
  if (k % NVFP4_BLOCK || experts < 1 || rows < 1)
    return cudaErrorInvalidValue;
  const long long units = nvfp4_w_bytes(rows, k) / NVFP4_TILE_BYTES;
  if (units > INT32_MAX || rows > INT32_MAX || k > INT32_MAX)
    return cudaErrorInvalidValue;
  /* 8-byte reads: a param's storage starts an allocation and each of its rows is a multiple of 8 bytes */
  if ((uintptr_t)src % 8)
    return cudaErrorMisalignedAddress;
  tile_weights_kernel<<<transform_grid(units, experts, kTransformThreads / 32), kTransformThreads, 0,
                        (cudaStream_t)stream>>>(static_cast<const uint8_t *>(src),
                                                static_cast<uint8_t *>(dst), experts, rows, k);
  return cudaGetLastError();
}

extern "C" int nvfp4_swizzle_scales_gpu(const void *src, void *dst, int64_t experts, int64_t rows,
                                        int64_t cols, void *stream) {
  if (experts < 1 || rows < 1 || cols < 1)
    return cudaErrorInvalidValue;
  const long long units = nvfp4_sf_bytes(rows, cols) / NVFP4_SF_ATOM;
  if (units > INT32_MAX || rows > INT32_MAX || cols > INT32_MAX)
    return cudaErrorInvalidValue;
  swizzle_scales_kernel<<<transform_grid(units, experts, kTransformThreads / 128), kTransformThreads, 0,
                          (cudaStream_t)stream>>>(static_cast<const uint8_t *>(src),
                                                  static_cast<uint8_t *>(dst), experts, rows, cols);
  return cudaGetLastError();
}

/* One launch of transform_in_place_kernel over groups x experts, bytes_per_group the largest group. */
template <bool kScales>
static int launch_in_place(void *data, int64_t experts, int64_t rows, int64_t k, long long groups,
                           long long bytes_per_group, void *stream) {
  if (experts < 1 || rows < 1 || k < 1)
    return cudaErrorInvalidValue;
  if (rows > INT32_MAX || k > INT32_MAX)
    return cudaErrorNotSupported;
  int64_t parts, slice;
  if (nvfp4_in_place_split(bytes_per_group, &parts, &slice) || groups * parts > INT32_MAX)
    return cudaErrorNotSupported;
  void (*kernel)(uint8_t *, long long, unsigned, unsigned, unsigned) = transform_in_place_kernel<kScales>;
  static DeviceSlots configured; /* opted into the largest slice once per device */
  cudaError_t err = opt_in_smem(configured, kernel, (int)NVFP4_IN_PLACE_MAX_SLICE);
  if (err != cudaSuccess)
    return err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)(groups * parts), (unsigned)(experts > 65535 ? 65535 : experts));
  cfg.blockDim = dim3(kTransformThreads);
  cfg.dynamicSmemBytes = (size_t)slice;
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = (unsigned)parts;
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<uint8_t *>(data), (long long)experts, (unsigned)rows,
                            (unsigned)k, (unsigned)slice);
}

extern "C" int nvfp4_tile_weights_in_place_gpu(void *data, int64_t experts, int64_t rows, int64_t k,
                                               void *stream) {
  if (rows % NVFP4_TILE_ROWS || k % NVFP4_CHUNK_K)
    return experts < 1 || rows < 1 || k < 1 ? cudaErrorInvalidValue : cudaErrorNotSupported;
  const long long tiles = rows / NVFP4_TILE_ROWS, group_rows = tiles < 8 ? rows : 8 * NVFP4_TILE_ROWS;
  return launch_in_place<false>(data, experts, rows, k, (tiles + 7) / 8, group_rows * (k / 2), stream);
}

extern "C" int nvfp4_swizzle_scales_in_place_gpu(void *data, int64_t experts, int64_t rows, int64_t cols,
                                                 void *stream) {
  if (rows % NVFP4_SF_ROWS || cols % NVFP4_SF_COLS)
    return experts < 1 || rows < 1 || cols < 1 ? cudaErrorInvalidValue : cudaErrorNotSupported;
  return launch_in_place<true>(data, experts, rows, cols, rows / NVFP4_SF_ROWS, NVFP4_SF_ROWS * cols, stream);
}

extern "C" int nvfp4_alpha_gpu(const float *scale, float *alpha, int64_t experts, int invert, void *stream) {
  if (experts < 1)
    return cudaErrorInvalidValue;
  alpha_kernel<<<grid_for(experts, 128), 128, 0, (cudaStream_t)stream>>>(scale, alpha, experts, invert);
  return cudaGetLastError();
}

/* One block per chunk: 16-byte loads and stores where source and destination share their alignment
 * (a head and tail of single bytes around them), single bytes otherwise. */
__global__ void copy_chunks_kernel(const nvfp4_copy_chunk *table) {
  const nvfp4_copy_chunk c = table[blockIdx.x];
  const uintptr_t d = (uintptr_t)c.dst, s = (uintptr_t)c.src;
  size_t head = c.bytes, body = 0;
  if (((d ^ s) & 15) == 0) {
    head = (16 - (d & 15)) & 15;
    head = head < c.bytes ? head : c.bytes;
    body = (c.bytes - head) / 16;
  }
  for (size_t i = threadIdx.x; i < head; i += blockDim.x)
    c.dst[i] = c.src[i];
  const uint4 *from = reinterpret_cast<const uint4 *>(c.src + head);
  uint4 *to = reinterpret_cast<uint4 *>(c.dst + head);
  for (size_t i = threadIdx.x; i < body; i += blockDim.x)
    to[i] = from[i];
  for (size_t i = head + body * 16 + threadIdx.x; i < c.bytes; i += blockDim.x)
    c.dst[i] = c.src[i];
}

extern "C" int nvfp4_copy_chunks_gpu(const nvfp4_copy_chunk *table, size_t n, void *stream) {
  if (!n)
    return cudaSuccess;
  if (n > 0x7fffffffu)
    return cudaErrorInvalidValue;
  copy_chunks_kernel<<<(unsigned)n, 256, 0, (cudaStream_t)stream>>>(table);
  return cudaGetLastError();
}

/* The size of one value under `rule` (enum qkeep_value_rule): 1, 2 or 4 bytes. */
__device__ __forceinline__ unsigned rule_size(unsigned rule) {
  return rule == QKEEP_RULE_F32_FINITE                                     ? 4
         : rule == QKEEP_RULE_BF16_FINITE || rule == QKEEP_RULE_F16_FINITE ? 2
                                                                           : 1;
}

/* Whether one value v (its rule_size low bytes) breaks `rule`. */
__device__ __forceinline__ bool bad_value(unsigned v, unsigned rule) {
  switch (rule) {
  case QKEEP_RULE_E4M3_SCALE: return (v & 0x7fu) == 0x7fu || v > 0x80u;
  case QKEEP_RULE_E8M0_SCALE: return v == 0xffu;
  case QKEEP_RULE_BF16_FINITE: return (v & 0x7f80u) == 0x7f80u;
  case QKEEP_RULE_F16_FINITE: return (v & 0x7c00u) == 0x7c00u;
  default: return (v & 0x7f800000u) == 0x7f800000u;
  }
}

/* Whether any value of the aligned 4-byte word w breaks `rule` (the byte rules four at a time). */
__device__ __forceinline__ bool bad_word(unsigned w, unsigned rule) {
  switch (rule) {
  case QKEEP_RULE_E4M3_SCALE:
    return (__vcmpeq4(w & 0x7f7f7f7fu, 0x7f7f7f7fu) | __vcmpgtu4(w, 0x80808080u)) != 0;
  case QKEEP_RULE_E8M0_SCALE: return __vcmpeq4(w, 0xffffffffu) != 0;
  case QKEEP_RULE_BF16_FINITE:
  case QKEEP_RULE_F16_FINITE: return bad_value(w & 0xffffu, rule) || bad_value(w >> 16, rule);
  default: return bad_value(w, rule);
  }
}

/* Value i of p (size bytes), assembled from single bytes: p need not be aligned. */
__device__ __forceinline__ unsigned value_at(const unsigned char *p, size_t i, unsigned size) {
  unsigned v = 0;
  for (unsigned b = 0; b < size; b++)
    v |= (unsigned)p[i * size + b] << (8 * b);
  return v;
}

/* One block per chunk: 16-byte loads of its aligned body, single values around it (all values one byte
 * at a time where the chunk is not aligned to its value size); a block whose range cannot lower the answer
 * any more returns at once. */
__global__ void check_chunks_kernel(const nvfp4_check_chunk *table, unsigned long long *first_bad) {
  const nvfp4_check_chunk c = table[blockIdx.x];
  __shared__ bool settled; /* read once for the block: every thread must reach __syncthreads_or below */
  if (threadIdx.x == 0)
    settled = c.range >= *reinterpret_cast<volatile unsigned long long *>(first_bad);
  __syncthreads();
  if (settled)
    return;
  const unsigned size = rule_size(c.rule);
  const uintptr_t a = (uintptr_t)c.at;
  bool bad = false;
  if (a % size) {
    for (size_t i = threadIdx.x; i < c.bytes / size; i += blockDim.x)
      bad |= bad_value(value_at(c.at, i, size), c.rule);
  } else {
    size_t head = (16 - (a & 15)) & 15;
    head = head < c.bytes ? head : c.bytes;
    const size_t body = (c.bytes - head) / 16, tail = head + body * 16;
    for (size_t i = threadIdx.x; i < head / size; i += blockDim.x)
      bad |= bad_value(value_at(c.at, i, size), c.rule);
    const uint4 *v = reinterpret_cast<const uint4 *>(c.at + head);
    for (size_t i = threadIdx.x; i < body; i += blockDim.x) {
      uint4 w = v[i];
      bad |= bad_word(w.x, c.rule) || bad_word(w.y, c.rule) || bad_word(w.z, c.rule) || bad_word(w.w, c.rule);
    }
    for (size_t i = threadIdx.x; i < (c.bytes - tail) / size; i += blockDim.x)
      bad |= bad_value(value_at(c.at + tail, i, size), c.rule);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0)
    atomicMin(first_bad, (unsigned long long)c.range);
}

extern "C" int nvfp4_check_chunks_gpu(const nvfp4_check_chunk *table, size_t n, unsigned long long *first_bad,
                                      void *stream) {
  if (!n)
    return cudaSuccess;
  if (n > 0x7fffffffu)
    return cudaErrorInvalidValue;
  check_chunks_kernel<<<(unsigned)n, 256, 0, (cudaStream_t)stream>>>(table, first_bad);
  return cudaGetLastError();
}

extern "C" void nvfp4_gemm_plan(int64_t m, int64_t n, int64_t k, enum qkeep_dtype x_dtype,
                                const struct nvfp4_tuning *tune, struct nvfp4_tuning *out) {
  const int kernel = tune ? tune->kernel : NVFP4_KERNEL_AUTO;
  const bool forced_wide = tune && tune->tile_m > 16;
  if (m <= 16 && (kernel == NVFP4_KERNEL_STREAM || (kernel == NVFP4_KERNEL_AUTO && !forced_wide))) {
    nvfp4_stream_plan(m, n, k, sm_count(), tune, out);
    return;
  }
  if ((kernel == NVFP4_KERNEL_WGMMA || kernel == NVFP4_KERNEL_AUTO) && wgmma_ok()) {
    nvfp4_wgmma_plan(m, n, k, sm_count(), tune, out);
    return;
  }
  out->kernel = NVFP4_KERNEL_RING;
  out->rows = out->unroll = 0;
  out->multicast = 1;
  out->fp8 = 0;
  out->tile_m = pick_tile_m(m, tune ? tune->tile_m : 0);
  out->depth = tune ? tune->depth : 0;
  int64_t blocks = (m + out->tile_m - 1) / out->tile_m * ((n + kRowsPerBlock - 1) / kRowsPerBlock);
  out->split_k =
      pick_split(blocks, nvfp4_w_chunks(k), resident_per_sm(*out, x_dtype), tune ? tune->split_k : 0);
}

extern "C" int nvfp4_gemm_run(const struct nvfp4_weights *wt, int32_t expert, int64_t m, const void *x,
                              enum qkeep_dtype x_dtype, void *y, enum qkeep_dtype y_dtype,
                              const struct nvfp4_tuning *tune, struct gpu_scratch *ws, void *stream) {
  if (!dtype_ok(x_dtype) || !dtype_ok(y_dtype) || expert < 0 || expert >= wt->experts ||
      wt->k % NVFP4_BLOCK || ((uintptr_t)x & 15) || m > INT32_MAX || wt->n > INT32_MAX || wt->k > INT32_MAX)
    return cudaErrorInvalidValue;
  if (m == 0)
    return cudaSuccess;
  struct nvfp4_tuning plan;
  nvfp4_gemm_plan(m, wt->n, wt->k, x_dtype, tune, &plan);
  plan.late = tune && tune->late; /* the plan leaves it: a launch property, not a shape */
  GemmArgs a = gemm_args(wt);
  a.x = x, a.y = y, a.y_dtype = y_dtype, a.m = (int)m, a.expert = expert, a.splits = plan.split_k;
  cudaError_t err;
  if (plan.kernel == NVFP4_KERNEL_WGMMA) {
    err = run_wgmma(plan, a, x, x_dtype, ws, (cudaStream_t)stream);
  } else if (plan.kernel == NVFP4_KERNEL_STREAM) {
    const int64_t blocks = (a.w_tiles + plan.rows - 1) / plan.rows;
    if (blocks > INT32_MAX)
      return cudaErrorInvalidValue;
    err = dispatch_stream(plan, x_dtype, a, dim3((unsigned)blocks), (cudaStream_t)stream);
  } else {
    int grid_x = (int)((m + plan.tile_m - 1) / plan.tile_m),
        grid_y = (int)((wt->n + kRowsPerBlock - 1) / kRowsPerBlock);
    if (grid_y > 65535)
      return cudaErrorInvalidValue;
    err = dispatch(plan, x_dtype, a, grid_x, grid_y, (cudaStream_t)stream);
  }
  return err != cudaSuccess ? err : cudaGetLastError();
}

static void moe_shape(const struct nvfp4_weights *wt, int pairs, const struct nvfp4_tuning *tune,
                      struct nvfp4_tuning *plan, int *max_tiles);

/*
 * A routed launch on the plan's kernel: tiles and sorted pairs by moe_align_kernel (unless the streaming
 * kernel routes its own blocks), the GEMM into y (w13) or into f32 rows per pair that moe_combine_kernel
 * sums into y (w2, combine). `a` holds the weights' arguments (NVFP4; MXFP4 with mx, on the wgmma
 * kernel only) of `experts` experts.
 */
static cudaError_t moe_launch(GemmArgs a, int experts, struct nvfp4_tuning plan, int max_tiles, int64_t m,
                              int32_t topk, const int32_t *topk_ids, const float *topk_weights, bool combine,
                              const void *x, enum qkeep_dtype x_dtype, void *y, enum qkeep_dtype y_dtype,
                              const struct nvfp4_tuning *tune, struct gpu_scratch *ws, cudaStream_t st,
                              bool mx) {
  const int pairs = (int)(m * topk), tile_m = plan.tile_m, n = a.n;
  const int grid_y = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t stream_blocks = plan.kernel == NVFP4_KERNEL_STREAM
                                    ? (nvfp4_w_rows(n) / NVFP4_TILE_ROWS + plan.rows - 1) / plan.rows
                                    : 0;
  if (grid_y > 65535 || stream_blocks > 65535 || (mx && plan.kernel != NVFP4_KERNEL_WGMMA))
    return cudaErrorInvalidValue;

  /* Scratch, stream-ordered: tiles, the sorted pairs, the tile count, and for w2 the f32
   * rows that the combine adds up. */
  size_t tiles_bytes = sizeof(int4) * (size_t)max_tiles, sorted_bytes = sizeof(int) * ((size_t)pairs + 4);
  size_t rows_bytes = combine ? sizeof(float) * (size_t)pairs * (size_t)n : 0;
  char *scratch = nullptr;
  bool owned;
  cudaError_t err = take_scratch(ws, tiles_bytes + sorted_bytes + rows_bytes, st,
                                 reinterpret_cast<void **>(&scratch), &owned);
  if (err != cudaSuccess)
    return err;
  int4 *tiles = reinterpret_cast<int4 *>(scratch);
  int *sorted = reinterpret_cast<int *>(scratch + tiles_bytes), *num_tiles = sorted + pairs;
  float *rows = combine ? reinterpret_cast<float *>(scratch + tiles_bytes + sorted_bytes) : nullptr;

  /* Few pairs on the streaming kernel: each block routes itself (no kernel before it to wait for). */
  const int route = tune ? tune->route : NVFP4_ROUTE_AUTO;
  const bool self_routed = plan.kernel == NVFP4_KERNEL_STREAM && route != NVFP4_ROUTE_ALIGN &&
                           pairs <= (route == NVFP4_ROUTE_SELF ? kRouteMaxPairs : kRouteAutoPairs);
  if (!self_routed)
    moe_align_kernel<<<1, 1024, 4 * sizeof(int) * (size_t)experts, st>>>(topk_ids, pairs, experts, tile_m,
                                                                         sorted, tiles, num_tiles);
  err = cudaGetLastError();
  if (err == cudaSuccess) {
    plan.late = tune && tune->late; /* the plan leaves it: a launch property, not a shape */
    a.x = x, a.y = y, a.y_dtype = y_dtype, a.y_pairs = rows;
    a.tiles = tiles, a.num_tiles = num_tiles, a.pairs = sorted, a.x_div = combine ? 1 : topk;
    if (self_routed)
      a.tiles = nullptr, a.route_ids = topk_ids, a.route_pairs = pairs, a.route_experts = experts;
    if (plan.kernel == NVFP4_KERNEL_STREAM) {
      a.splits = plan.split_k;
      err = dispatch_stream(plan, x_dtype, a, dim3((unsigned)max_tiles, (unsigned)stream_blocks), st);
    } else if (plan.kernel == NVFP4_KERNEL_WGMMA) {
      a.splits = plan.split_k;
      err = run_wgmma(plan, a, x, x_dtype, ws, st, max_tiles, mx);
    } else {
      /* Most tiles a step can have is one per expert hit; size the split for that. */
      int64_t est_blocks = (int64_t)min(pairs, experts) * grid_y;
      plan.split_k =
          pick_split(est_blocks, a.chunks, resident_per_sm(plan, x_dtype), tune ? tune->split_k : 0);
      a.splits = plan.split_k;
      err = dispatch(plan, x_dtype, a, max_tiles, grid_y, st);
    }
    if (err == cudaSuccess)
      err = cudaGetLastError();
  }
  if (err == cudaSuccess && combine) {
    dim3 grid((unsigned)m, (unsigned)((n + 255) / 256));
    moe_combine_kernel<<<grid, 256, 0, st>>>(rows, topk_ids, topk_weights, topk, experts, n, y, y_dtype);
    err = cudaGetLastError();
  }
  cudaError_t free_err = give_scratch(scratch, owned, st);
  return err != cudaSuccess ? err : free_err;
}

extern "C" int nvfp4_moe_run(const struct nvfp4_weights *wt, int64_t m, int32_t topk, const int32_t *topk_ids,
                             const float *topk_weights, bool combine, const void *x, enum qkeep_dtype x_dtype,
                             void *y, enum qkeep_dtype y_dtype, const struct nvfp4_tuning *tune,
                             struct gpu_scratch *ws, void *stream) {
  if (!dtype_ok(x_dtype) || !dtype_ok(y_dtype) || topk < 1 || !topk_ids || (combine && !topk_weights) ||
      wt->experts < 1 || wt->experts > kMaxMoeExperts || wt->k % NVFP4_BLOCK || ((uintptr_t)x & 15) ||
      m * topk > INT32_MAX / 2 || wt->n > INT32_MAX || wt->k > INT32_MAX)
    return cudaErrorInvalidValue;
  const int pairs = (int)(m * topk);
  if (pairs == 0)
    return cudaSuccess;
  struct nvfp4_tuning plan;
  int max_tiles;
  moe_shape(wt, pairs, tune, &plan, &max_tiles);
  return moe_launch(gemm_args(wt), (int)wt->experts, plan, max_tiles, m, topk, topk_ids, topk_weights,
                    combine, x, x_dtype, y, y_dtype, tune, ws, (cudaStream_t)stream, false);
}

/* The plan of a routed launch, as nvfp4_moe_run makes it, and its tile bound. */
static void moe_shape(const struct nvfp4_weights *wt, int pairs, const struct nvfp4_tuning *tune,
                      struct nvfp4_tuning *plan, int *max_tiles) {
  nvfp4_moe_plan(pairs, (int)wt->experts, wt->n, wt->k, sm_count(), wgmma_ok(), tune, plan);
  *max_tiles = min(pairs, (pairs + plan->tile_m - 1) / plan->tile_m + (int)wt->experts);
}

/* The same for MXFP4 on the wgmma kernel, whose MXFP4 shapes take token tiles of 32 to 256. */
static void mx_moe_shape(const struct mxfp4_weights *wt, int pairs, struct nvfp4_tuning *plan,
                         int *max_tiles) {
  struct nvfp4_tuning on_wgmma = {};
  on_wgmma.kernel = NVFP4_KERNEL_WGMMA;
  nvfp4_moe_plan(pairs, (int)wt->experts, wt->n, wt->k, sm_count(), true, &on_wgmma, plan);
  if (plan->tile_m < 32) {
    on_wgmma.tile_m = 32;
    nvfp4_moe_plan(pairs, (int)wt->experts, wt->n, wt->k, sm_count(), true, &on_wgmma, plan);
  }
  *max_tiles = min(pairs, (pairs + plan->tile_m - 1) / plan->tile_m + (int)wt->experts);
}

extern "C" size_t nvfp4_gemm_workspace(const struct nvfp4_weights *wt, int64_t m, enum qkeep_dtype x_dtype,
                                       const struct nvfp4_tuning *tune) {
  if (m <= 0 || m > INT32_MAX)
    return 0;
  struct nvfp4_tuning plan;
  nvfp4_gemm_plan(m, wt->n, wt->k, x_dtype, tune, &plan);
  if (plan.kernel != NVFP4_KERNEL_WGMMA)
    return 0;
  return gpu_scratch_round(wgmma_x_bytes(plan, (m + plan.tile_m - 1) / plan.tile_m, wt->k));
}

/* ---- MXFP4 on the wgmma kernel ---------------------------------------------------------------- */

namespace {

/* The tiled MXFP4 codes and scales of wt (plugins/gpu/mxfp4_layout.h) as the wgmma kernel's arguments. */
GemmArgs mx_args(const struct mxfp4_weights *wt) {
  GemmArgs a = {};
  a.w = static_cast<const uint8_t *>(wt->codes);
  a.sf = static_cast<const uint8_t *>(wt->scales);
  a.bias = wt->bias;
  a.bias_dtype = wt->bias_dtype;
  a.n = (int)wt->n;
  a.k = (int)wt->k;
  a.chunks = (int)mxfp4_chunks(wt->k);
  a.w_tiles = (int)mxfp4_tiles(wt->n);
  a.w_expert_bytes = mxfp4_code_bytes(wt->n, wt->k);
  a.sf_expert_bytes = mxfp4_scale_bytes(wt->n, wt->k);
  a.x_div = 1;
  return a;
}

} // namespace

extern "C" bool mxfp4_wgmma_applies(int64_t m, enum qkeep_dtype x_dtype, int split_k) {
  return m >= MXFP4_WGMMA_MIN_M && m <= INT32_MAX && x_dtype != QKEEP_DTYPE_F16 && split_k <= 0 && wgmma_ok();
}

extern "C" size_t mxfp4_wgmma_workspace(const struct mxfp4_weights *wt, int64_t m) {
  struct nvfp4_tuning plan;
  nvfp4_wgmma_plan(m, wt->n, wt->k, sm_count(), nullptr, &plan);
  return gpu_scratch_round(wgmma_x_bytes(plan, (m + plan.tile_m - 1) / plan.tile_m, wt->k));
}

extern "C" int mxfp4_wgmma_run(const struct mxfp4_weights *wt, int32_t expert, int64_t m, const void *x,
                               enum qkeep_dtype x_dtype, void *y, enum qkeep_dtype y_dtype,
                               struct gpu_scratch *ws, void *stream) {
  if (!dtype_ok(x_dtype) || !dtype_ok(y_dtype) || x_dtype == QKEEP_DTYPE_F16 || expert < 0 ||
      expert >= wt->experts || wt->k % MXFP4_BLOCK || ((uintptr_t)x & 15) || m > INT32_MAX ||
      wt->n > INT32_MAX || wt->k > INT32_MAX)
    return cudaErrorInvalidValue;
  if (m <= 0)
    return m < 0 ? cudaErrorInvalidValue : cudaSuccess;
  struct nvfp4_tuning plan;
  nvfp4_wgmma_plan(m, wt->n, wt->k, sm_count(), nullptr, &plan);
  GemmArgs a = mx_args(wt);
  a.x = x, a.y = y, a.y_dtype = y_dtype, a.m = (int)m, a.expert = expert, a.splits = plan.split_k;
  cudaError_t err = run_wgmma(plan, a, x, x_dtype, ws, (cudaStream_t)stream, 0, true);
  return err != cudaSuccess ? err : cudaGetLastError();
}

extern "C" bool mxfp4_wgmma_moe_applies(int64_t m, int32_t topk, enum qkeep_dtype x_dtype) {
  return m > 0 && topk > 0 && m * topk <= INT32_MAX / 2 && x_dtype != QKEEP_DTYPE_F16 && wgmma_ok();
}

extern "C" size_t mxfp4_wgmma_moe_workspace(const struct mxfp4_weights *wt, int64_t m, int32_t topk,
                                            bool combine) {
  if (m <= 0 || topk < 1 || m * topk > INT32_MAX / 2 || wt->experts < 1 || wt->experts > kMaxMoeExperts)
    return 0;
  const int pairs = (int)(m * topk);
  struct nvfp4_tuning plan;
  int max_tiles;
  mx_moe_shape(wt, pairs, &plan, &max_tiles);
  size_t bytes = sizeof(int4) * (size_t)max_tiles + sizeof(int) * ((size_t)pairs + 4) +
                 (combine ? sizeof(float) * (size_t)pairs * (size_t)wt->n : 0);
  return gpu_scratch_round(bytes) + gpu_scratch_round(wgmma_x_bytes(plan, max_tiles, wt->k));
}

extern "C" int mxfp4_wgmma_moe_run(const struct mxfp4_weights *wt, int64_t m, int32_t topk,
                                   const int32_t *topk_ids, const float *topk_weights, bool combine,
                                   const void *x, enum qkeep_dtype x_dtype, void *y, enum qkeep_dtype y_dtype,
                                   struct gpu_scratch *ws, void *stream) {
  if (!dtype_ok(x_dtype) || !dtype_ok(y_dtype) || x_dtype == QKEEP_DTYPE_F16 || topk < 1 || !topk_ids ||
      (combine && !topk_weights) || wt->experts < 1 || wt->experts > kMaxMoeExperts || wt->k % MXFP4_BLOCK ||
      ((uintptr_t)x & 15) || m < 0 || m * topk > INT32_MAX / 2 || wt->n > INT32_MAX || wt->k > INT32_MAX)
    return cudaErrorInvalidValue;
  const int pairs = (int)(m * topk);
  if (pairs == 0)
    return cudaSuccess;
  struct nvfp4_tuning plan;
  int max_tiles;
  mx_moe_shape(wt, pairs, &plan, &max_tiles);
  return moe_launch(mx_args(wt), (int)wt->experts, plan, max_tiles, m, topk, topk_ids, topk_weights, combine,
                    x, x_dtype, y, y_dtype, nullptr, ws, (cudaStream_t)stream, true);
}

extern "C" size_t nvfp4_moe_workspace(const struct nvfp4_weights *wt, int64_t m, int32_t topk, bool combine,
                                      enum qkeep_dtype x_dtype, const struct nvfp4_tuning *tune) {
  (void)x_dtype;
  if (m <= 0 || topk < 1 || m * topk > INT32_MAX / 2 || wt->experts < 1 || wt->experts > kMaxMoeExperts)
    return 0;
  const int pairs = (int)(m * topk);
  struct nvfp4_tuning plan;
  int max_tiles;
  moe_shape(wt, pairs, tune, &plan, &max_tiles);
  size_t bytes = sizeof(int4) * (size_t)max_tiles + sizeof(int) * ((size_t)pairs + 4) +
                 (combine ? sizeof(float) * (size_t)pairs * (size_t)wt->n : 0);
  size_t total = gpu_scratch_round(bytes);
  if (plan.kernel == NVFP4_KERNEL_WGMMA)
    total += gpu_scratch_round(wgmma_x_bytes(plan, max_tiles, wt->k));
  return total;
}

extern "C" int dense_gemm_run(const void *w, enum qkeep_dtype w_dtype, const void *bias,
                              enum qkeep_dtype bias_dtype, int64_t n, int64_t k, int64_t m, const void *x,
                              enum qkeep_dtype x_dtype, void *y, enum qkeep_dtype y_dtype, void *stream) {
  if (!dtype_ok(w_dtype) || !dtype_ok(x_dtype) || !dtype_ok(y_dtype) || (bias && !dtype_ok(bias_dtype)) ||
      n > INT32_MAX / 32 || k > INT32_MAX || m > INT32_MAX)
    return cudaErrorInvalidValue;
  if (m == 0 || n == 0)
    return cudaSuccess;
  dim3 grid((unsigned)((n * 32 + 255) / 256), (unsigned)(m < 65535 ? m : 65535));
  cudaStream_t st = (cudaStream_t)stream;
  switch (w_dtype) {
  case QKEEP_DTYPE_F32:
    dense_kernel<float><<<grid, 256, 0, st>>>(static_cast<const float *>(w), bias, bias_dtype, (int)n, (int)k,
                                              (int)m, x, x_dtype, y, y_dtype);
    break;
  case QKEEP_DTYPE_F16:
    dense_kernel<__half><<<grid, 256, 0, st>>>(static_cast<const __half *>(w), bias, bias_dtype, (int)n,
                                               (int)k, (int)m, x, x_dtype, y, y_dtype);
    break;
  default:
    dense_kernel<__nv_bfloat16><<<grid, 256, 0, st>>>(static_cast<const __nv_bfloat16 *>(w), bias, bias_dtype,
                                                      (int)n, (int)k, (int)m, x, x_dtype, y, y_dtype);
    break;
  }
  return cudaGetLastError();
}
