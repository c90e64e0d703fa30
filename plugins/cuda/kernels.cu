/*
 * kernels.cu: the cuda-nvfp4 kernels and their extern "C" launchers
 * (contracts in cuda_nvfp4.h, layouts in layout.h).
 *
 * The W4A16 GEMM (Hopper has no FP4 tensor cores): y^T = W x^T with the
 * weight as the A operand of mma.m16n8k16, loaded straight from global memory
 * into registers in its fragment-tiled layout, dequantised there (two bit
 * operations per pair of codes, one multiply by the e4m3 block scale) and
 * multiplied with bf16 (or f16) activations staged in shared memory by
 * cp.async. A block covers 128 output rows (one 128x4 scale atom per 64-K
 * chunk) and up to 64 tokens; the K range is split across a thread-block
 * cluster of up to 8 blocks whose partial sums are added through distributed
 * shared memory in a fixed order, so a launch is one kernel, needs no
 * workspace and gives the same bits every time. Weight loads run P chunks
 * ahead of the math.
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

#include <stdint.h>
#include <type_traits>

#include "cuda_nvfp4.h"
#include "layout.h"

namespace cg = cooperative_groups;

namespace {

constexpr int kRowsPerBlock = 128;              /* 8 tiles of 16 rows: one scale atom */
constexpr int kRedStride = kRowsPerBlock + 4;   /* f32 words per token of the reduction tile */
constexpr int kMaxSplit = 8;                    /* portable cluster size */
constexpr int kMaxMoeExperts = 2048;

/* A block shape: MT tokens, RT 16-row tiles per warp (8 / RT warps), P chunks per stage. */
template <int MT_, int RT_, int P_>
struct Shape {
  static constexpr int MT = MT_;
  static constexpr int RT = RT_;
  static constexpr int WARPS = 8 / RT_;
  static constexpr int THREADS = WARPS * 32;
  static constexpr int NT = MT_ / 8;
  static constexpr int P = P_;
};
using Shape8 = Shape<8, 1, 8>;
using Shape16 = Shape<16, 1, 8>;
using Shape32 = Shape<32, 2, 4>;
using Shape64 = Shape<64, 2, 4>;

struct GemmArgs {
  const uint8_t *w;       /* tiled weights of expert 0 */
  const uint8_t *sf;      /* swizzled scales of expert 0 */
  const float *alpha;     /* [experts] */
  const void *bias;       /* [experts, n] or NULL */
  int bias_dtype;
  const void *x;
  void *y;
  float *y_pairs;         /* routed w2: f32 rows per (token, slot) instead of y */
  int y_dtype;
  int m;                  /* plain: tokens */
  int n, k;
  int chunks;             /* 64-K chunks per row */
  int sf_atoms;           /* scale atoms per 128-row block (padded scale columns / 4) */
  int w_tiles;            /* 16-row tiles per expert */
  long long w_expert_bytes, sf_expert_bytes;
  int expert;             /* plain mode */
  const int4 *tiles;      /* routed: {expert, first sorted slot, slots} per token tile */
  const int *num_tiles;
  const int *pairs;       /* routed: token * topk + slot, sorted by expert */
  int x_div;              /* routed: x row = pair / x_div */
  int splits;
};

/* ---- small device helpers ------------------------------------------------------------------- */

__device__ __forceinline__ uint4 ld_stream(const void *p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool ok) {
  uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem);
  int bytes = ok ? 16 : 0; /* 0: zero-fill */
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
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

template <bool BF16>
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  if constexpr (BF16)
    return bits_of(__hmul2(*reinterpret_cast<__nv_bfloat162 *>(&a), *reinterpret_cast<__nv_bfloat162 *>(&b)));
  else
    return bits_of(__hmul2(*reinterpret_cast<__half2 *>(&a), *reinterpret_cast<__half2 *>(&b)));
}

/* The two e4m3 block scales in the low 16 bits of `two` (row g, row g + 8) as 16-bit
 * pairs, times the power of two that undoes nvfp4_fp4x2_biased's bias (2^63 of 2^126 for
 * bf16, 2^7 of 2^14 for f16; the epilogue undoes the rest). */
template <bool BF16>
__device__ __forceinline__ void block_scales(uint32_t two, uint32_t &s_lo, uint32_t &s_hi) {
  __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xffff), __NV_E4M3);
  float2 f = __half22float2(*reinterpret_cast<__half2 *>(&raw));
  if constexpr (BF16) {
    s_lo = bits_of(__float2bfloat162_rn(f.x * 0x1p63f));
    s_hi = bits_of(__float2bfloat162_rn(f.y * 0x1p63f));
  } else {
    s_lo = bits_of(__float2half2_rn(f.x * 128.0f));
    s_hi = bits_of(__float2half2_rn(f.y * 128.0f));
  }
}

/* The A fragment of one k-step from word q of a lane's tile bytes (layout.h). */
template <bool BF16>
__device__ __forceinline__ void dequant(uint32_t q, uint32_t s_lo, uint32_t s_hi, uint32_t (&a)[4]) {
  constexpr int sh = BF16 ? NVFP4_SHIFT_BF16 : NVFP4_SHIFT_F16;
  a[0] = hmul2<BF16>(nvfp4_fp4x2_biased(q, sh), s_lo);       /* row g,     k 2t, 2t+1 */
  a[1] = hmul2<BF16>(nvfp4_fp4x2_biased(q << 4, sh), s_hi);  /* row g + 8, k 2t, 2t+1 */
  a[2] = hmul2<BF16>(nvfp4_fp4x2_biased(q << 8, sh), s_lo);  /* row g,     k 2t+8, 2t+9 */
  a[3] = hmul2<BF16>(nvfp4_fp4x2_biased(q << 12, sh), s_hi); /* row g + 8, k 2t+8, 2t+9 */
}

/* The B fragments of one chunk: a lane's 16 consecutive activations of one token (k =
 * 16t .. 16t + 15 of the chunk) as 8 registers, b[2j], b[2j+1] for k-step j. */
template <typename TI>
__device__ __forceinline__ void load_b(const unsigned char *p, uint32_t (&b)[8]) {
  if constexpr (sizeof(TI) == 2) {
    uint4 v0 = *reinterpret_cast<const uint4 *>(p), v1 = *reinterpret_cast<const uint4 *>(p + 16);
    b[0] = v0.x, b[1] = v0.y, b[2] = v0.z, b[3] = v0.w, b[4] = v1.x, b[5] = v1.y, b[6] = v1.z, b[7] = v1.w;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float4 v = reinterpret_cast<const float4 *>(p)[i];
      b[2 * i] = bits_of(__floats2bfloat162_rn(v.x, v.y));
      b[2 * i + 1] = bits_of(__floats2bfloat162_rn(v.z, v.w));
    }
  }
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

template <class S, typename TI>
struct Smem {
  static constexpr int SK = S::P * NVFP4_CHUNK_K;                 /* K per stage */
  static constexpr int ROW_BYTES = SK * (int)sizeof(TI) + 16;     /* +16: no bank conflicts */
  static constexpr int STAGE_BYTES = S::MT * ROW_BYTES;
  static constexpr int UNITS = SK * (int)sizeof(TI) / 16;         /* 16-byte copies per token */
  static constexpr int RED_BYTES = S::MT * kRedStride * 4;
  static constexpr int BYTES = 2 * STAGE_BYTES > RED_BYTES ? 2 * STAGE_BYTES : RED_BYTES;
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
  const int stages = (c_end - c_begin + S::P - 1) / S::P;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int rb = blockIdx.y;
  const uint8_t *sf_block = a.sf + expert * a.sf_expert_bytes + (long long)rb * a.sf_atoms * NVFP4_SF_ATOM;
  const uint8_t *w_tile[S::RT];
  int sf_lane[S::RT];
  bool active[S::RT];
#pragma unroll
  for (int rt = 0; rt < S::RT; ++rt) {
    const int tib = warp * S::RT + rt, tile = rb * 8 + tib; /* tile in block, tile in matrix */
    active[rt] = tile < a.w_tiles;
    w_tile[rt] = a.w + expert * a.w_expert_bytes + (long long)tile * a.chunks * NVFP4_TILE_BYTES + lane * 16;
    /* row 16 * tib + g of the atom: (r % 32) * 16 + ((r / 32) % 4) * 4 + column t */
    sf_lane[rt] = (16 * (tib & 1) + g) * 16 + (tib >> 1) * 4 + t;
  }

  /* Weights and scales of chunk c into queue slot `slot` (a constant after unrolling). */
  uint4 wq[S::P][S::RT];
  uint32_t sq[S::P][S::RT];
#define NVFP4_FETCH(slot, c)                                                                                   \
  _Pragma("unroll") for (int rt = 0; rt < S::RT; ++rt) {                                                      \
    wq[slot][rt] = make_uint4(0, 0, 0, 0), sq[slot][rt] = 0;                                                   \
    if (active[rt] && (c) < c_end) {                                                                           \
      wq[slot][rt] = ld_stream(w_tile[rt] + (long long)(c)*NVFP4_TILE_BYTES);                                  \
      const uint8_t *sp = sf_block + (long long)(c)*NVFP4_SF_ATOM + sf_lane[rt];                              \
      sq[slot][rt] = (uint32_t)__ldg(sp) | (uint32_t)__ldg(sp + 128) << 8;                                     \
    }                                                                                                          \
  }

  /* Activations of stage `stage` (S::P chunks, all tokens) into buffer `buf`; zero past K. */
  auto load_x = [&](int buf, int stage) {
    unsigned char *dst = smem + buf * L::STAGE_BYTES;
    const int k0 = (c_begin + stage * S::P) * NVFP4_CHUNK_K;
    for (int u = threadIdx.x; u < S::MT * L::UNITS; u += S::THREADS) {
      const int i = u / L::UNITS, j = u % L::UNITS, kk = k0 + j * (16 / (int)sizeof(TI)), xr = x_row[i];
      const bool ok = xr >= 0 && kk < a.k;
      const TI *src = static_cast<const TI *>(a.x) + (ok ? (long long)xr * a.k + kk : 0);
      cp_async16(dst + i * L::ROW_BYTES + j * 16, src, ok);
    }
  };

#pragma unroll
  for (int p = 0; p < S::P; ++p)
    NVFP4_FETCH(p, c_begin + p)
  if (stages > 0) {
    load_x(0, 0);
    cp_async_commit();
  }
  float acc[S::RT][S::NT][4];
#pragma unroll
  for (int rt = 0; rt < S::RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < S::NT; ++nt)
      acc[rt][nt][0] = acc[rt][nt][1] = acc[rt][nt][2] = acc[rt][nt][3] = 0.0f;

  for (int s = 0; s < stages; ++s) {
    if (s + 1 < stages) {
      load_x((s + 1) & 1, s + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const unsigned char *xs = smem + (s & 1) * L::STAGE_BYTES + g * L::ROW_BYTES + 16 * t * (int)sizeof(TI);
#pragma unroll
    for (int p = 0; p < S::P; ++p) {
      const int c = c_begin + s * S::P + p;
      if (c < c_end) {
        uint32_t frag[S::RT][4][4];
#pragma unroll
        for (int rt = 0; rt < S::RT; ++rt) {
          uint32_t s_lo, s_hi;
          block_scales<BF16>(sq[p][rt], s_lo, s_hi);
          dequant<BF16>(wq[p][rt].x, s_lo, s_hi, frag[rt][0]);
          dequant<BF16>(wq[p][rt].y, s_lo, s_hi, frag[rt][1]);
          dequant<BF16>(wq[p][rt].z, s_lo, s_hi, frag[rt][2]);
          dequant<BF16>(wq[p][rt].w, s_lo, s_hi, frag[rt][3]);
        }
        NVFP4_FETCH(p, c + S::P)
#pragma unroll
        for (int nt = 0; nt < S::NT; ++nt) {
          uint32_t b[8];
          load_b<TI>(xs + nt * 8 * L::ROW_BYTES + p * NVFP4_CHUNK_K * (int)sizeof(TI), b);
#pragma unroll
          for (int rt = 0; rt < S::RT; ++rt)
            if (active[rt]) {
#pragma unroll
              for (int j = 0; j < 4; ++j)
                mma<BF16>(acc[rt][nt], frag[rt][j], b[2 * j], b[2 * j + 1]);
            }
        }
      }
    }
    __syncthreads();
  }
#undef NVFP4_FETCH

  /* Partial tile [token][row] into shared memory, then each block of the cluster adds up
   * 1/splits of it over all blocks, in rank order, and writes it out. */
  float *red = reinterpret_cast<float *>(smem);
#pragma unroll
  for (int rt = 0; rt < S::RT; ++rt) {
    const int row = (warp * S::RT + rt) * 16 + g;
#pragma unroll
    for (int nt = 0; nt < S::NT; ++nt) {
      const int tok = nt * 8 + 2 * t;
      red[tok * kRedStride + row] = acc[rt][nt][0];
      red[(tok + 1) * kRedStride + row] = acc[rt][nt][1];
      red[tok * kRedStride + row + 8] = acc[rt][nt][2];
      red[(tok + 1) * kRedStride + row + 8] = acc[rt][nt][3];
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

template <class S, typename TI>
cudaError_t launch_gemm(const GemmArgs &a, int grid_x, int grid_y, cudaStream_t stream) {
  using L = Smem<S, TI>;
  static bool configured = false; /* benign race: every thread sets the same value */
  if (!configured) {
    cudaError_t err = cudaFuncSetAttribute(nvfp4_gemm_kernel<S, TI>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           L::BYTES);
    if (err != cudaSuccess)
      return err;
    configured = true;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)grid_x, (unsigned)grid_y, (unsigned)a.splits);
  cfg.blockDim = dim3(S::THREADS);
  cfg.dynamicSmemBytes = L::BYTES;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = (unsigned)a.splits;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, nvfp4_gemm_kernel<S, TI>, a);
}

template <typename TI>
cudaError_t launch_shape(int tile_m, const GemmArgs &a, int grid_x, int grid_y, cudaStream_t stream) {
  switch (tile_m) {
  case 8: return launch_gemm<Shape8, TI>(a, grid_x, grid_y, stream);
  case 16: return launch_gemm<Shape16, TI>(a, grid_x, grid_y, stream);
  case 32: return launch_gemm<Shape32, TI>(a, grid_x, grid_y, stream);
  default: return launch_gemm<Shape64, TI>(a, grid_x, grid_y, stream);
  }
}

cudaError_t dispatch(int tile_m, enum qkeep_dtype x_dtype, const GemmArgs &a, int grid_x, int grid_y,
                     cudaStream_t stream) {
  switch (x_dtype) {
  case QKEEP_DTYPE_BF16: return launch_shape<__nv_bfloat16>(tile_m, a, grid_x, grid_y, stream);
  case QKEEP_DTYPE_F16: return launch_shape<__half>(tile_m, a, grid_x, grid_y, stream);
  case QKEEP_DTYPE_F32: return launch_shape<float>(tile_m, a, grid_x, grid_y, stream);
  default: return cudaErrorInvalidValue;
  }
}

int sm_count(void) {
  static int count = 0;
  if (!count) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || count <= 0)
      count = 132;
  }
  return count;
}

int clamp_int(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

int pick_tile_m(int64_t tokens_per_tile, int forced) {
  if (forced == 8 || forced == 16 || forced == 32 || forced == 64)
    return forced;
  return tokens_per_tile <= 8 ? 8 : tokens_per_tile <= 16 ? 16 : tokens_per_tile <= 32 ? 32 : 64;
}

/* Enough blocks for two per SM, at least two chunks per split, at most a portable cluster. */
int pick_split(int64_t blocks, int64_t chunks, int forced) {
  if (forced > 0)
    return clamp_int(forced, 1, clamp_int((int)(chunks < kMaxSplit ? chunks : kMaxSplit), 1, kMaxSplit));
  int most = clamp_int((int)(chunks / 2), 1, kMaxSplit);
  int64_t want = (2 * (int64_t)sm_count() + blocks - 1) / (blocks > 0 ? blocks : 1);
  return clamp_int((int)want, 1, most);
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
      const int pv = __shfl_up_sync(0xffffffffu, pairs_inc, d), tv = __shfl_up_sync(0xffffffffu, tiles_inc, d);
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

/* One thread per 32-bit word of the tiled output; each nibble gathered from the checkpoint bytes. */
__global__ void tile_weights_kernel(const uint8_t *src, uint8_t *dst, long long experts, long long rows, long long k) {
  const long long chunks = nvfp4_w_chunks(k), per = nvfp4_w_bytes(rows, k), words = experts * per / 4;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < words;
       i += (long long)gridDim.x * blockDim.x) {
    const long long e = i * 4 / per, off = i * 4 % per;
    const uint8_t *s = src + e * rows * (k / 2);
    uint32_t word = 0;
    for (int b = 0; b < 4; ++b)
      for (int high = 0; high < 2; ++high) {
        int64_t r, kk;
        nvfp4_w_source(off + b, high, chunks, &r, &kk);
        if (r < rows && kk < k) {
          const uint32_t byte = s[r * (k / 2) + kk / 2];
          word |= ((kk & 1) ? byte >> 4 : byte & 0xf) << (8 * b + 4 * high);
        }
      }
    reinterpret_cast<uint32_t *>(dst)[i] = word;
  }
}

__global__ void swizzle_scales_kernel(const uint8_t *src, uint8_t *dst, long long experts, long long rows,
                                      long long cols) {
  const long long cols_padded = nvfp4_sf_cols(cols), per = nvfp4_sf_bytes(rows, cols), total = experts * per;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long e = i / per;
    int64_t r, c;
    nvfp4_sf_source(i % per, cols_padded, &r, &c);
    dst[i] = r < rows && c < cols ? src[(e * rows + r) * cols + c] : 0;
  }
}

/* ---- unquantized layers ----------------------------------------------------------------------- */

template <typename T>
__host__ __device__ constexpr int dtype_of() {
  return std::is_same<T, float>::value ? QKEEP_DTYPE_F32 : std::is_same<T, __half>::value ? QKEEP_DTYPE_F16 : QKEEP_DTYPE_BF16;
}

/* One warp per output row, lanes striding K; tokens along grid y. */
template <typename TW>
__global__ void dense_kernel(const TW *w, const void *bias, int bias_dtype, int n, int k, int m, const void *x,
                             int x_dtype, void *y, int y_dtype) {
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
  long long words = experts * nvfp4_w_bytes(rows, k) / 4;
  tile_weights_kernel<<<grid_for(words, 256), 256, 0, (cudaStream_t)stream>>>(
      static_cast<const uint8_t *>(src), static_cast<uint8_t *>(dst), experts, rows, k);
  return cudaGetLastError();
}

extern "C" int nvfp4_swizzle_scales_gpu(const void *src, void *dst, int64_t experts, int64_t rows, int64_t cols,
                                        void *stream) {
  if (experts < 1 || rows < 1 || cols < 1)
    return cudaErrorInvalidValue;
  long long bytes = experts * nvfp4_sf_bytes(rows, cols);
  swizzle_scales_kernel<<<grid_for(bytes, 256), 256, 0, (cudaStream_t)stream>>>(
      static_cast<const uint8_t *>(src), static_cast<uint8_t *>(dst), experts, rows, cols);
  return cudaGetLastError();
}

extern "C" void nvfp4_gemm_plan(int64_t m, int64_t n, int64_t k, const struct nvfp4_tuning *tune,
                                struct nvfp4_tuning *out) {
  out->tile_m = pick_tile_m(m, tune ? tune->tile_m : 0);
  int64_t blocks = (m + out->tile_m - 1) / out->tile_m * ((n + kRowsPerBlock - 1) / kRowsPerBlock);
  out->split_k = pick_split(blocks, nvfp4_w_chunks(k), tune ? tune->split_k : 0);
}

extern "C" int nvfp4_gemm_run(const struct nvfp4_weights *wt, int32_t expert, int64_t m, const void *x,
                              enum qkeep_dtype x_dtype, void *y, enum qkeep_dtype y_dtype,
                              const struct nvfp4_tuning *tune, void *stream) {
  if (!dtype_ok(x_dtype) || !dtype_ok(y_dtype) || expert < 0 || expert >= wt->experts || wt->k % NVFP4_BLOCK ||
      ((uintptr_t)x & 15) || m > INT32_MAX || wt->n > INT32_MAX || wt->k > INT32_MAX)
    return cudaErrorInvalidValue;
  if (m == 0)
    return cudaSuccess;
  struct nvfp4_tuning plan;
  nvfp4_gemm_plan(m, wt->n, wt->k, tune, &plan);
  GemmArgs a = gemm_args(wt);
  a.x = x, a.y = y, a.y_dtype = y_dtype, a.m = (int)m, a.expert = expert, a.splits = plan.split_k;
  int grid_x = (int)((m + plan.tile_m - 1) / plan.tile_m), grid_y = (int)((wt->n + kRowsPerBlock - 1) / kRowsPerBlock);
  if (grid_y > 65535)
    return cudaErrorInvalidValue;
  cudaError_t err = dispatch(plan.tile_m, x_dtype, a, grid_x, grid_y, (cudaStream_t)stream);
  return err != cudaSuccess ? err : cudaGetLastError();
}

extern "C" int nvfp4_moe_run(const struct nvfp4_weights *wt, int64_t m, int32_t topk, const int32_t *topk_ids,
                             const float *topk_weights, bool combine, const void *x, enum qkeep_dtype x_dtype,
                             void *y, enum qkeep_dtype y_dtype, const struct nvfp4_tuning *tune, void *stream) {
  if (!dtype_ok(x_dtype) || !dtype_ok(y_dtype) || topk < 1 || !topk_ids || (combine && !topk_weights) ||
      wt->experts < 1 || wt->experts > kMaxMoeExperts || wt->k % NVFP4_BLOCK || ((uintptr_t)x & 15) ||
      m * topk > INT32_MAX / 2 || wt->n > INT32_MAX || wt->k > INT32_MAX)
    return cudaErrorInvalidValue;
  const int pairs = (int)(m * topk), experts = (int)wt->experts;
  if (pairs == 0)
    return cudaSuccess;
  cudaStream_t st = (cudaStream_t)stream;
  const int tile_m = pick_tile_m((pairs + experts - 1) / experts, tune ? tune->tile_m : 0);
  const int max_tiles = min(pairs, (pairs + tile_m - 1) / tile_m + experts);
  const int grid_y = (int)((wt->n + kRowsPerBlock - 1) / kRowsPerBlock);
  if (grid_y > 65535)
    return cudaErrorInvalidValue;

  /* Scratch, stream-ordered: tiles, the sorted pairs, the tile count, and for w2 the f32
   * rows that the combine adds up. */
  size_t tiles_bytes = sizeof(int4) * (size_t)max_tiles, sorted_bytes = sizeof(int) * ((size_t)pairs + 4);
  size_t rows_bytes = combine ? sizeof(float) * (size_t)pairs * (size_t)wt->n : 0;
  char *scratch = nullptr;
  cudaError_t err = cudaMallocAsync(reinterpret_cast<void **>(&scratch), tiles_bytes + sorted_bytes + rows_bytes, st);
  if (err != cudaSuccess)
    return err;
  int4 *tiles = reinterpret_cast<int4 *>(scratch);
  int *sorted = reinterpret_cast<int *>(scratch + tiles_bytes), *num_tiles = sorted + pairs;
  float *rows = combine ? reinterpret_cast<float *>(scratch + tiles_bytes + sorted_bytes) : nullptr;

  moe_align_kernel<<<1, 1024, 4 * sizeof(int) * (size_t)experts, st>>>(topk_ids, pairs, experts, tile_m, sorted,
                                                                       tiles, num_tiles);
  err = cudaGetLastError();
  if (err == cudaSuccess) {
    GemmArgs a = gemm_args(wt);
    a.x = x, a.y = y, a.y_dtype = y_dtype, a.y_pairs = rows;
    a.tiles = tiles, a.num_tiles = num_tiles, a.pairs = sorted, a.x_div = combine ? 1 : topk;
    /* Most tiles a step can have is one per expert hit; size the split for that. */
    int64_t est_blocks = (int64_t)min(pairs, experts) * grid_y;
    a.splits = pick_split(est_blocks, nvfp4_w_chunks(wt->k), tune ? tune->split_k : 0);
    err = dispatch(tile_m, x_dtype, a, max_tiles, grid_y, st);
  }
  if (err == cudaSuccess && combine) {
    dim3 grid((unsigned)m, (unsigned)((wt->n + 255) / 256));
    moe_combine_kernel<<<grid, 256, 0, st>>>(rows, topk_ids, topk_weights, topk, experts, (int)wt->n, y, y_dtype);
    err = cudaGetLastError();
  }
  cudaError_t free_err = cudaFreeAsync(scratch, st);
  return err != cudaSuccess ? err : free_err;
}

extern "C" int dense_gemm_run(const void *w, enum qkeep_dtype w_dtype, const void *bias, enum qkeep_dtype bias_dtype,
                              int64_t n, int64_t k, int64_t m, const void *x, enum qkeep_dtype x_dtype, void *y,
                              enum qkeep_dtype y_dtype, void *stream) {
  if (!dtype_ok(w_dtype) || !dtype_ok(x_dtype) || !dtype_ok(y_dtype) || (bias && !dtype_ok(bias_dtype)) ||
      n > INT32_MAX / 32 || k > INT32_MAX || m > INT32_MAX)
    return cudaErrorInvalidValue;
  if (m == 0 || n == 0)
    return cudaSuccess;
  dim3 grid((unsigned)((n * 32 + 255) / 256), (unsigned)(m < 65535 ? m : 65535));
  cudaStream_t st = (cudaStream_t)stream;
  switch (w_dtype) {
  case QKEEP_DTYPE_F32:
    dense_kernel<float><<<grid, 256, 0, st>>>(static_cast<const float *>(w), bias, bias_dtype, (int)n, (int)k, (int)m,
                                              x, x_dtype, y, y_dtype);
    break;
  case QKEEP_DTYPE_F16:
    dense_kernel<__half><<<grid, 256, 0, st>>>(static_cast<const __half *>(w), bias, bias_dtype, (int)n, (int)k,
                                               (int)m, x, x_dtype, y, y_dtype);
    break;
  default:
    dense_kernel<__nv_bfloat16><<<grid, 256, 0, st>>>(static_cast<const __nv_bfloat16 *>(w), bias, bias_dtype,
                                                      (int)n, (int)k, (int)m, x, x_dtype, y, y_dtype);
    break;
  }
  return cudaGetLastError();
}
