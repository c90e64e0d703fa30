/*
 * check_zentorch_amx.c: cpu-zentorch's AMX da8w4 kernel on any CPU with AVX-512 VNNI.
 *
 * This program builds plugins/cpu/zentorch/kernels_avx512.c with ZT_AMX_EMULATE, which
 * replaces the six tile instructions the AMX kernel uses (ldtilecfg, tilezero, tileloadd,
 * tilestored, tdpbsud, tilerelease) by a software model of them as the Intel SDM defines them
 * (aborting on a shape the hardware would fault on). Everything else, the addressing of the
 * activation and code tiles, the tile shapes per group size, the passes, the zero padding of
 * the activations and the f32 steps after each group, is the plugin's code. The oracle is the
 * AVX-512 VNNI kernel of the same file (itself checked against the reference backend by
 * check_zentorch): zentorch.h promises the two equal bit for bit.
 *
 * Shapes: group sizes 8, 32, 96 (tile steps of 48 bytes), 128 and a whole-K group; N a
 * multiple of 64, N with a narrow last block (104, 200) and N below 32; 16 to 130 rows (the
 * VNNI hand-over below ZT_AMX_MIN_ROWS, passes of 64, a last tile pair partly past m, the
 * activations in K slices as run() packs them); symmetric (s4 codes,
 * zero 8) and asymmetric layers; f16, bf16 and f32 scales; whole calls and run()'s split of
 * 64-row chunks by single blocks.
 *
 * On a CPU with AMX the real instructions run in check_zentorch (isa = amx) against the
 * reference backend. Without AVX-512 VNNI this program exits 77 (skipped).
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "zentorch.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
  rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
  return (uint32_t)(rng_state >> 16);
}
static float rnd_float(void) { return (float)(rnd() % 20001) / 10000.0f - 1.0f; }

/* A scale of dtype dt (f32, bf16 or f16) in scales[i]: a positive normal number near 2^-6. */
static void put_scale(void *scales, enum qkeep_dtype dt, int64_t i) {
  float v = (0.5f + (float)(rnd() % 1000) / 1000.0f) / 64.0f;
  if (dt == QKEEP_DTYPE_F32) {
    ((float *)scales)[i] = v;
  } else if (dt == QKEEP_DTYPE_BF16) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    ((uint16_t *)scales)[i] = (uint16_t)(bits >> 16);
  } else { /* f16: exponent 15 - 7 .. 15 - 6, a random mantissa */
    ((uint16_t *)scales)[i] = (uint16_t)(((8 + rnd() % 2) << 10) | (rnd() & 0x3ff));
  }
}

struct shape {
  int64_t n, k, groups;
};
static const struct shape shapes[] = {
    {64, 256, 32}, /* groups of 8: tile steps of 8 bytes */
    {104, 256, 8}, /* groups of 32, a 40-column last block */
    {200, 384, 4}, /* groups of 96: steps of 48 bytes, an 8-column last block */
    {128, 512, 4}, /* groups of 128 */
    {24, 192, 1},  /* one group of 192 (steps of 64), one block narrower than a tile pair */
};
/* Below ZT_AMX_MIN_ROWS (32) a call runs the VNNI kernel: 16 and 31 check that hand-over. */
static const int64_t row_counts[] = {16, 31, 32, 33, 63, 64, 100, 130};

/* One GEMM's operands, random, with xq padded as run() pads it for the AMX kernel. */
struct operands {
  struct zt_gemm g;
  int32_t *codes, *zeros, *xq, *xsum;
  int8_t *xq_tiles;
  float *xscale, *y_amx, *y_vnni, *x;
  void *scales;
};

static void operands_make(struct operands *o, const struct shape *sh, int64_t m, bool sym,
                          enum qkeep_dtype scale_dtype) {
  int64_t n = sh->n, k = sh->k, groups = sh->groups;
  int64_t padded = (m + ZT_AMX_PAD_ROWS - 1) / ZT_AMX_PAD_ROWS * ZT_AMX_PAD_ROWS;
  memset(o, 0, sizeof *o);
  o->codes = malloc((size_t)(k / 8 * n) * sizeof *o->codes);
  o->scales = malloc((size_t)(groups * n) * 4);
  o->zeros = sym ? NULL : malloc((size_t)(groups * (n / 8)) * sizeof *o->zeros);
  o->x = malloc((size_t)(m * k) * sizeof *o->x);
  o->xq = malloc((size_t)(m * k / 4) * sizeof *o->xq);
  o->xq_tiles = calloc((size_t)(padded * k), 1);
  o->xsum = malloc((size_t)(m * groups) * sizeof *o->xsum);
  o->xscale = malloc((size_t)m * sizeof *o->xscale);
  o->y_amx = malloc((size_t)(m * n) * sizeof *o->y_amx);
  o->y_vnni = malloc((size_t)(m * n) * sizeof *o->y_vnni);
  ck_assert(o->codes && o->scales && (sym || o->zeros) && o->x && o->xq && o->xq_tiles && o->xsum &&
            o->xscale && o->y_amx && o->y_vnni);
  for (int64_t i = 0; i < k / 8 * n; i++)
    o->codes[i] = (int32_t)rnd();
  for (int64_t i = 0; i < groups * n; i++)
    put_scale(o->scales, scale_dtype, i);
  if (!sym)
    for (int64_t i = 0; i < groups * (n / 8); i++)
      o->zeros[i] = (int32_t)rnd();
  for (int64_t r = 0; r < m; r++) {
    for (int64_t i = 0; i < k; i++)
      o->x[r * k + i] = r % 7 == 3 ? 0.0f : rnd_float() * (float)(1 + r % 5); /* a zero row too */
    zt_quantise_row(o->x + r * k, k, groups, o->xq + r * (k / 4), o->xsum + r * groups, o->xscale + r);
    zt_amx_pack_row(o->xq + r * (k / 4), k, zt_amx_kstep(k / groups), padded, r, o->xq_tiles);
  }
  o->g = (struct zt_gemm){.m = m,
                          .n = n,
                          .k = k,
                          .groups = groups,
                          .codes = o->codes,
                          .scales = o->scales,
                          .scale_dtype = scale_dtype,
                          .zeros = o->zeros,
                          .xq = o->xq,
                          .xq_tiles = o->xq_tiles,
                          .xq_rows = padded,
                          .xsum = o->xsum,
                          .xscale = o->xscale};
}

static void operands_free(struct operands *o) {
  free(o->codes), free(o->scales), free(o->zeros), free(o->x), free(o->xq), free(o->xq_tiles), free(o->xsum);
  free(o->xscale);
  free(o->y_amx), free(o->y_vnni);
}

/* y by both kernels (AMX as run() splits it when `chunked`, else in one call), compared bit for bit. */
static void compare(struct operands *o, bool chunked, const char *what) {
  struct zt_gemm g = o->g;
  int64_t m = g.m, n = g.n, blocks = (n + ZT_BLOCK_N - 1) / ZT_BLOCK_N;
  memset(o->y_amx, 0xff, (size_t)(m * n) * sizeof *o->y_amx); /* NaNs where nothing is written */
  memset(o->y_vnni, 0, (size_t)(m * n) * sizeof *o->y_vnni);
  g.y = o->y_vnni;
  zt_da8w4_avx512_vnni(&g, 0, m, 0, blocks);
  g.y = o->y_amx;
  if (chunked) {
    for (int64_t m0 = 0; m0 < m; m0 += 64)
      for (int64_t b = 0; b < blocks; b++)
        zt_da8w4_amx(&g, m0, m0 + 64 < m ? m0 + 64 : m, b, b + 1);
  } else {
    zt_da8w4_amx(&g, 0, m, 0, blocks);
  }
  for (int64_t i = 0; i < m * n; i++)
    if (memcmp(&o->y_amx[i], &o->y_vnni[i], sizeof(float)) != 0)
      ck_abort_msg("%s: y[%lld, %lld] = %.9g (AMX), %.9g (VNNI)", what, (long long)(i / n),
                   (long long)(i % n), (double)o->y_amx[i], (double)o->y_vnni[i]);
}

START_TEST(amx_equals_vnni_bit_for_bit) {
  static const enum qkeep_dtype dts[] = {QKEEP_DTYPE_F16, QKEEP_DTYPE_BF16, QKEEP_DTYPE_F32};
  const struct shape *sh = &shapes[_i];
  int runs = 0;
  for (size_t r = 0; r < sizeof row_counts / sizeof row_counts[0]; r++)
    for (int sym = 0; sym < 2; sym++) {
      struct operands o;
      enum qkeep_dtype dt = dts[(r + (size_t)sym) % 3];
      operands_make(&o, sh, row_counts[r], sym, dt);
      char what[160];
      snprintf(what, sizeof what, "n %lld k %lld groups %lld, %lld rows, %s, scales dtype %d",
               (long long)sh->n, (long long)sh->k, (long long)sh->groups, (long long)row_counts[r],
               sym ? "symmetric" : "asymmetric", (int)dt);
      compare(&o, false, what);
      compare(&o, true, what);
      operands_free(&o);
      runs++;
    }
  ck_assert_int_eq(runs, 2 * (int)(sizeof row_counts / sizeof row_counts[0]));
}
END_TEST

/* The output is not a constant: a different code in one word changes the rows' sums (a kernel that
 * ignored the tiles, or read another group's, would pass the comparison above only by luck). */
START_TEST(amx_output_follows_the_codes) {
  struct operands o;
  operands_make(&o, &shapes[3], 40, true, QKEEP_DTYPE_F32);
  struct zt_gemm g = o.g;
  g.y = o.y_amx;
  zt_da8w4_amx(&g, 0, g.m, 0, 2);
  float before = o.y_amx[5 * g.n + 70];
  /* Column 70 is in block 1 (width 64), column 6 of it; word (kw 3, col 6) of the block. */
  o.codes[zt_blocked_index(g.n, g.k, 3, 70)] ^= (int32_t)0xffffffffu; /* every code q of k 24..31 to 15 - q */
  zt_da8w4_amx(&g, 0, g.m, 0, 2);
  ck_assert_float_ne(o.y_amx[5 * g.n + 70], before);
  operands_free(&o);
}
END_TEST

int main(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq") ||
      !__builtin_cpu_supports("avx512vnni")) {
    fprintf(stderr, "check_zentorch_amx: this CPU has no AVX-512 VNNI, which the emulated kernel needs\n");
    return 77;
  }
  Suite *s = suite_create("zentorch_amx");
  TCase *tc = tcase_create("emulated tiles");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, amx_equals_vnni_bit_for_bit, 0, sizeof shapes / sizeof shapes[0]);
  tcase_add_test(tc, amx_output_follows_the_codes);
  suite_add_tcase(s, tc);
  return tu_run_suite(s, CK_NORMAL);
}
