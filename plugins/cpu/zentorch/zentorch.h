/*
 * zentorch.h: private declarations of the cpu-zentorch backend (plugins/cpu/zentorch).
 * backend.c holds the table the core sees (init, configure, probe, supports_layer, PWAL,
 * apply, cleanup); repack.c the layout transforms PWAL runs (pure functions, also linked
 * by tests/check_zentorch.c); act.c the activation preparation apply runs; kernels_avx2.c
 * and kernels_avx512.c the GEMM kernels, one file per instruction set.
 *
 * The layout in one paragraph. The zentorch layout of an int4 matrix y = x W^T (W [N, K])
 * holds the codes along K in int32 words, element i of a word at bits 4i: word (kw, n) of
 * an int32 [K/8, N] view holds k = 8kw..8kw+7 of column n. Codes are u4 when the layer has
 * zero points and s4 without them, where the s4 word is the u4 word XOR 0x88888888 (code
 * q - 8 in two's complement). Scales are [groups, N] (GPTQ and AWQ store them so already),
 * zero points u4 packed along N as [groups, N/8] int32 words, column n in nibble n % 8,
 * holding the zero itself (GPTQ v1's zero - 1 and AWQ's column order undone).
 *
 * The kernels read a blocked form of that layout: columns in blocks of ZT_BLOCK_N (64),
 * each block's [K/8, width] words contiguous (width = 64, or N % 64 for the last block),
 * so a block is one forward stream of memory. Block b starts at word 64 b (K/8); word
 * (kw, c) of it is at 64 b (K/8) + kw * width + c. PWAL writes this form into qweight's
 * own storage, as a 1-D int32 view of the same K N / 8 words ([E, K N / 8] for MoE).
 *
 * Act order (GPTQ desc_act): the repack sorts K by g_idx (stable), so each group's rows
 * are contiguous and row i of the repacked matrix is checkpoint row perm[i]; perm is kept
 * in g_idx's own storage (int32 [K], replaced in place) and apply gathers x[perm[i]].
 *
 * Zero points: the per-group correction. With u4 codes q, zero z and scale s,
 *   y[m, n] = sum_g s[g, n] (sum_{k in g} x[m, k] q[k, n] - z[g, n] sum_{k in g} x[m, k])
 * so the kernel accumulates the code products of a group, then subtracts z[g, n] times the
 * group's activation sum (computed once per row and group by act.c) before scaling: exact
 * in int32 for da8w4. z is 8 for symmetric layers (the s4 codes XOR 8 are u4 again); for
 * asymmetric ones it is read from qzeros, which PWAL repacks in place into the zero-point
 * layout above. The correction thus lives in the zero-point param under the rules: 4 bits
 * per group and column, where a precomputed f32 correction buffer (-s z) would hold 8 times
 * the bytes and cost the M = 1 stream about 6 % more traffic.
 *
 * Modes: w4a16 multiplies f32 activations (bf16 ones are widened) with the codes converted
 * to f32; da8w4 quantises each activation row to int8 (act.c: a = amax / 127, q =
 * rint(x * (127 / amax)) clamped to +-127, rounding half to even) and multiplies u4 codes
 * by s8 activations in int32: vpdpbusd with AVX-512 VNNI, vpmaddubsw + vpmaddwd without it
 * (u4 x s8 pair sums are at most 2 * 15 * 127, so the int16 step cannot saturate).
 *
 * AMX (da8w4 from ZT_AMX_MIN_ROWS rows): tdpbsud multiplies tiles of 16 rows of s8 activations
 * by u8 codes in its "VNNI" B layout, a row per 4 k holding 4 bytes per column. The two layouts
 * above meet it without a shuffle: a row of B is the lo (k 0,2,4,6) or hi (k 1,3,5,7) nibbles of
 * 16 columns' words, which is what the decoded group buffer of the AVX-512 path holds, and a
 * row of A is 64 bytes of xq, whose k order within each 8 is the same (run() copies xq into K
 * slices, `xq_tiles`, so that a tile's 16 rows are one contiguous KiB rather than 16 lines K bytes
 * apart, which share one L1 set when K is a multiple of 4096). The int32 tile sums of a
 * group are the VNNI path's sums exactly, and the f32 steps after them the same, so AMX output
 * equals the AVX-512 VNNI output bit for bit.
 */
#ifndef QKEEP_ZENTORCH_H
#define QKEEP_ZENTORCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "qkeep/qkeep_backend.h"
#include "qkeep/qkeep_backend_util.h"

#define ZT_BLOCK_N 64

/* Instruction sets, lowest first; a config key or QKEEP_ZENTORCH_MAX_ISA can lower the choice. */
enum zt_isa { ZT_ISA_NONE = 0, ZT_ISA_AVX2, ZT_ISA_AVX512, ZT_ISA_AVX512_VNNI, ZT_ISA_AMX, ZT_ISA_COUNT };

/* AMX: calls with at least ZT_AMX_MIN_ROWS rows run on tiles (fewer: the VNNI kernel), whose
 * activation rows are read ZT_AMX_PAD_ROWS at a time (xq_tiles holds zero rows up to that multiple). */
#define ZT_AMX_MIN_ROWS 32
#define ZT_AMX_PAD_ROWS 32

/* The K bytes of one AMX tile step for groups of gs k (a multiple of 8): the largest multiple of 8
 * up to 64 that divides gs, so that a step never straddles two groups. */
static inline int zt_amx_kstep(int64_t gs) {
  int ks = 64;
  while (gs % ks)
    ks -= 8;
  return ks;
}

/* What the activations are multiplied in. */
enum zt_mode { ZT_W4A16 = 0, ZT_DA8W4 = 1 };

/* The checkpoint layout a matrix comes from. */
enum zt_source { ZT_GPTQ = 0, ZT_AWQ = 1, ZT_CT = 2 /* compressed-tensors pack-quantized (ct-int4) */ };

/* The backend instance: the table first, so the core's pointer is ours. */
struct zt_backend {
  struct qkeep_backend be;
  const struct qkeep_host *host;
  enum zt_isa cpu_isa; /* what the CPU has */
  enum zt_isa isa;     /* what the kernels use: min(cpu_isa, config `isa`, QKEEP_ZENTORCH_MAX_ISA) */
  enum zt_mode mode;
  int threads; /* config `threads`; 0: OpenMP's default */
};

/* One weight matrix of a layer: a linear layer's, or an MoE layer's w13 or w2 (every expert alike). */
struct zt_matrix {
  char prefix[8]; /* "", "w13_" or "w2_" */
  enum zt_source src;
  /* The checkpoint names of its codes, scales, zero points and g_idx (without the prefix). */
  const char *codes_name, *scales_name, *zeros_name, *g_idx_name;
  int64_t n, k;                 /* y[M, n] = x[M, k] W^T */
  int64_t experts;              /* 1 for a linear layer */
  int64_t groups;               /* scale groups along K */
  bool sym;                     /* s4 codes, zero 8; qzeros retired */
  bool act_order;               /* g_idx holds the K permutation */
  enum qkeep_dtype scale_dtype; /* f16, bf16 or f32 (ct-int4 keeps the model's dtype) */
};

/* A layer's private state (host->set_state), rebuilt by every PWAL; holds no pointer into a param. */
struct zt_layer {
  int n_mat;
  struct zt_matrix mat[2];
};

/* ---- repack.c: the layout transforms (pure, no host calls) ------------------------------------ */

/* The s4 word of a u4 word (and back): element-wise q -> q - 8 in two's complement nibbles. */
static inline uint32_t zt_s4_word(uint32_t u4) { return u4 ^ 0x88888888u; }

/*
 * Fills out[k/8 * n] with the zentorch words [K/8, N] of one matrix: from GPTQ qweight
 * [K/8, N] (the same words), AWQ qweight [K, N/8] (packed along N, AWQ's column order) or
 * compressed-tensors weight_packed [N, K/8] (the words transposed; codes already u4 = q + 8),
 * with the rows of K taken in `perm` order when perm is non-NULL (row i = source row
 * perm[i]), as s4 when `s4`. in and out must not overlap.
 */
void zt_repack_codes(enum zt_source src, const int32_t *in, int64_t n, int64_t k, const int32_t *perm,
                     bool s4, int32_t *out);
/* Rewrites zentorch words [K/8, N] (`plain`) into the blocked form described above (`blocked`). */
void zt_block_codes(const int32_t *plain, int64_t n, int64_t k, int32_t *blocked);
/* The index of word (kw, col) in the blocked form. */
int64_t zt_blocked_index(int64_t n, int64_t k, int64_t kw, int64_t col);
/*
 * Zero points [groups, N/8] in place: from GPTQ v1 (zero - 1), GPTQ v2 (the zero) or AWQ
 * (column order {0,2,4,6,1,3,5,7}) into zentorch zero points (the zero, column n in nibble n % 8).
 */
void zt_repack_zeros(enum zt_source src, bool gptq_v2, int32_t *zeros, int64_t n, int64_t groups);
/* compressed-tensors weight_zero_point [N/8, groups] transposed into zentorch zero points [groups, N/8]. */
void zt_repack_ct_zeros(const int32_t *in, int64_t n, int64_t groups, int32_t *out);
/*
 * The act-order permutation of g_idx [K]: perm[i] = the i-th row of K in order of its group
 * (stable). 0, or -1 when a group index is outside [0, groups) or a group does not hold
 * exactly K / groups rows (*bad then names the first offending row, or group).
 */
int zt_act_order_perm(const int32_t *g_idx, int64_t k, int64_t groups, int32_t *perm, int64_t *bad);

/* ---- act.c and the kernels ----------------------------------------------------------------------- */

/* One GEMM of apply: y[m, n] = x[m, k] W^T for one matrix (one expert), all pointers resolved. */
struct zt_gemm {
  int64_t m, n, k, groups;
  const int32_t *codes; /* blocked zentorch words */
  const void *scales;   /* [groups, n] of scale_dtype */
  enum qkeep_dtype scale_dtype;
  const int32_t *zeros; /* [groups, n/8] zentorch zero points; NULL: every zero is 8 (s4 codes) */
  /* w4a16: */
  const float *x;     /* [m, k], already in kernel row order */
  const float *xsumf; /* [m, groups] sum of x over each group */
  /* da8w4: */
  const int32_t *xq;   /* [m, k/8, 2]: per 8 k's, the s8 codes of k 0,2,4,6 then of k 1,3,5,7 */
  /* AMX: xq's bytes in K slices of ks = zt_amx_kstep(k / groups) bytes, [k / ks][xq_rows][ks]
   * (zt_amx_pack_row), xq_rows a multiple of ZT_AMX_PAD_ROWS with zero rows after m; NULL: none. */
  const int8_t *xq_tiles;
  int64_t xq_rows;
  const int32_t *xsum; /* [m, groups] sum of the s8 codes over each group */
  const float *xscale; /* [m] a, the dequantisation scale of each row */
  float *y;            /* [m, n] f32 */
};

/*
 * Kernel entry points: y for column blocks [b0, b1) (ZT_BLOCK_N columns each) and rows
 * [m0, m1), without bias. Each runs on a CPU with its instruction set only.
 */
void zt_w4a16_avx2(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b0, int64_t b1);
void zt_da8w4_avx2(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b0, int64_t b1);
void zt_w4a16_avx512(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b0, int64_t b1);
void zt_da8w4_avx512(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b0, int64_t b1);
void zt_da8w4_avx512_vnni(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b0, int64_t b1);
/* AMX-INT8 (and AVX-512 VNNI): needs the process's tile grant (backend.c) and xq_tiles (without it, or
 * below ZT_AMX_MIN_ROWS rows, the VNNI kernel runs); m0 a multiple of ZT_AMX_PAD_ROWS. */
void zt_da8w4_amx(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b0, int64_t b1);

/*
 * act.c. zt_quantise_row: one activation row x[k] (already permuted) into the da8w4
 * operands: packed codes xq[k/8 * 2], group sums xsum[groups] and the scale *a. The
 * recipe (the test oracle repeats it): amax = max |x|; amax 0 gives codes 0 and a = 0;
 * else inv = 127 / amax (f32), q = rint(x * inv) (half to even) clamped to [-127, 127],
 * a = amax / 127 (f32).
 */
void zt_quantise_row(const float *x, int64_t k, int64_t groups, int32_t *xq, int32_t *xsum, float *a);
/* Row r of xq (xq_row[k / 4]) into the AMX slices `tiles` ([k / ks][rows][ks] bytes). */
void zt_amx_pack_row(const int32_t *xq_row, int64_t k, int ks, int64_t rows, int64_t r, int8_t *tiles);
/* The f32 group sums of one row x[k] (w4a16's zero-point correction), summed in order. */
void zt_group_sums(const float *x, int64_t k, int64_t groups, float *xsum);

#endif
