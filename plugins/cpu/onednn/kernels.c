/*
 * kernels.c: the oneDNN side of the cpu-onednn backend: the engine and its
 * ISA, the weights' packed layout and the reorder into it, one matmul
 * primitive per weight matrix and M class, activation quantisation, and the
 * epilogue. onednn.h explains the int8 arithmetic.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl_debug.h>

#include "onednn.h"
#include "qkeep/qkeep_backend_util.h"

int od_fail(const struct od_backend *b, int code, dnnl_status_t status, const char *what) {
  if (status == dnnl_out_of_memory) /* an allocation failure inside oneDNN is the caller's NOMEM */
    code = QKEEP_E_NOMEM;
  return b->host->set_error(code, "cpu-onednn: %s: oneDNN status %s", what, dnnl_status2str(status));
}

/* ---- engine and ISA -------------------------------------------------------------------- */

static const struct {
  const char *name;
  dnnl_cpu_isa_t isa;
} isa_names[] = {
    {"all", dnnl_cpu_isa_all},
    {"sse41", dnnl_cpu_isa_sse41},
    {"avx", dnnl_cpu_isa_avx},
    {"avx2", dnnl_cpu_isa_avx2},
    {"avx2_vnni", dnnl_cpu_isa_avx2_vnni},
    {"avx512_core", dnnl_cpu_isa_avx512_core},
    {"avx512_core_vnni", dnnl_cpu_isa_avx512_core_vnni},
    {"avx512_core_bf16", dnnl_cpu_isa_avx512_core_bf16},
    {"avx512_core_amx", dnnl_cpu_isa_avx512_core_amx},
};

static const char *isa_name(dnnl_cpu_isa_t isa) {
  for (size_t i = 0; i < sizeof isa_names / sizeof isa_names[0]; i++)
    if (isa_names[i].isa == isa)
      return isa_names[i].name;
  return "other";
}

/* dnnl_data_type_t of a qkeep dtype (the ones a matmul here reads). */
static dnnl_data_type_t dnnl_type(enum qkeep_dtype d) {
  switch (d) {
  case QKEEP_DTYPE_F32: return dnnl_f32;
  case QKEEP_DTYPE_BF16: return dnnl_bf16;
  case QKEEP_DTYPE_F16: return dnnl_f16;
  case QKEEP_DTYPE_I8: return dnnl_s8;
  case QKEEP_DTYPE_U8: return dnnl_u8;
  case QKEEP_DTYPE_I32: return dnnl_s32;
  default: return dnnl_data_type_undef;
  }
}

static const char *dtype_name(enum qkeep_dtype d) {
  static const char *const names[QKEEP_DTYPE_COUNT] = {"F32", "F16", "BF16", "F8_E4M3", "F8_E8M0",
                                                       "U8",  "I8",  "I32",  "I64"};
  return (unsigned)d < QKEEP_DTYPE_COUNT ? names[d] : "?";
}

/* Source, weight and destination types of each compute kind. */
static void compute_types(enum od_compute c, dnnl_data_type_t *src, dnnl_data_type_t *wei,
                          dnnl_data_type_t *dst) {
  *src = c == OD_INT8 ? dnnl_u8 : c == OD_BF16 ? dnnl_bf16 : dnnl_f32;
  *wei = c == OD_INT8 ? dnnl_s8 : c == OD_BF16 ? dnnl_bf16 : dnnl_f32;
  *dst = c == OD_INT8 ? dnnl_s32 : dnnl_f32;
}

/* A matmul primitive descriptor for rows x k times the weights described by wmd (NULL: any layout). */
/* The matmul of rows x k activations and the weights described by wmd (NULL: any layout). */
static dnnl_status_t matmul_desc(enum od_compute c, int64_t rows, int64_t k, int64_t n,
                                 const dnnl_memory_desc_t *wmd, dnnl_matmul_desc_t *md) {
  dnnl_data_type_t sdt, wdt, ddt;
  compute_types(c, &sdt, &wdt, &ddt);
  dnnl_memory_desc_t src, wei, dst;
  dnnl_status_t s = dnnl_memory_desc_init_by_tag(&src, 2, (dnnl_dims_t){rows, k}, sdt, dnnl_ab);
  if (s == dnnl_success)
    s = dnnl_memory_desc_init_by_tag(&dst, 2, (dnnl_dims_t){rows, n}, ddt, dnnl_ab);
  if (s == dnnl_success && wmd)
    wei = *wmd;
  else if (s == dnnl_success)
    s = dnnl_memory_desc_init_by_tag(&wei, 2, (dnnl_dims_t){k, n}, wdt, dnnl_format_tag_any);
  return s == dnnl_success ? dnnl_matmul_desc_init(md, &src, &wei, NULL, &dst) : s;
}

/* oneDNN's first (preferred) implementation of that matmul. */
static dnnl_status_t matmul_pd(const struct od_backend *b, enum od_compute c, int64_t rows, int64_t k,
                               int64_t n, const dnnl_memory_desc_t *wmd, dnnl_primitive_desc_t *pd) {
  dnnl_matmul_desc_t md;
  dnnl_status_t s = matmul_desc(c, rows, k, n, wmd, &md);
  return s == dnnl_success ? dnnl_primitive_desc_create(pd, &md, NULL, b->engine, NULL) : s;
}

static const char *impl_of(const_dnnl_primitive_desc_t pd) {
  const char *impl = NULL;
  return dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success && impl ? impl
                                                                                                   : "";
}

/*
 * oneDNN 2.6 runs int8 on AMX wherever the CPU has it, also for one row, where
 * a 16-row tile does one row's work; its AVX-512 VNNI brgemm takes the same
 * packed layout and streams the weights faster. Measured on the device's
 * Xeon (AMX), 4096 x 4096 s8 weights out of cache, M = 1: 710 us vs 1054 us
 * with 2 threads, 181 vs 232 us with 16 (4096 x 14336: 2.41 vs 4.01 ms and
 * 583 vs 738 us); from M = 16 on AMX is faster (1085 vs 1333 us). So the
 * one-row class swaps an AMX choice for the VNNI one when it exists.
 */
static void prefer_vnni_for_one_row(const struct od_backend *b, const struct od_matrix *mt,
                                    dnnl_primitive_desc_t *pd) {
  dnnl_matmul_desc_t md;
  dnnl_primitive_desc_iterator_t it = NULL;
  if (!strstr(impl_of(*pd), "amx") ||
      matmul_desc(mt->compute, 1, mt->k, mt->n, &mt->wmd, &md) != dnnl_success ||
      dnnl_primitive_desc_iterator_create(&it, &md, NULL, b->engine, NULL) != dnnl_success)
    return;
  do {
    dnnl_primitive_desc_t alt = dnnl_primitive_desc_iterator_fetch(it);
    if (!alt)
      break;
    const dnnl_memory_desc_t *w = dnnl_primitive_desc_query_md(alt, dnnl_query_weights_md, 0);
    if (strstr(impl_of(alt), "avx512_core_vnni") && w && dnnl_memory_desc_equal(w, &mt->wmd)) {
      dnnl_primitive_desc_destroy(*pd);
      *pd = alt;
      break;
    }
    dnnl_primitive_desc_destroy(alt);
  } while (dnnl_primitive_desc_iterator_next(it) == dnnl_success);
  dnnl_primitive_desc_iterator_destroy(it);
}

int od_engine_init(struct od_backend *b) {
  const char *limit = getenv("QKEEP_ONEDNN_MAX_ISA");
  if (limit && *limit) {
    size_t i = 0, n = sizeof isa_names / sizeof isa_names[0];
    while (i < n && strcmp(isa_names[i].name, limit) != 0)
      i++;
    if (i == n)
      return b->host->set_error(
          QKEEP_E_CONFIG,
          "cpu-onednn: QKEEP_ONEDNN_MAX_ISA=%s: unknown ISA (all, sse41, avx, avx2, "
          "avx2_vnni, avx512_core, avx512_core_vnni, avx512_core_bf16, avx512_core_amx)",
          limit);
    dnnl_status_t s = dnnl_set_max_cpu_isa(isa_names[i].isa);
    /* The limit can be set once, before oneDNN generates code; an earlier instance may have set it already.
     */
    if (s != dnnl_success && isa_names[i].isa != dnnl_cpu_isa_all &&
        (dnnl_get_effective_cpu_isa() & ~isa_names[i].isa) != 0)
      return b->host->set_error(
          QKEEP_E_PLUGIN,
          "cpu-onednn: QKEEP_ONEDNN_MAX_ISA=%s: oneDNN cannot lower its ISA (%s): it has "
          "generated code in this process already",
          limit, dnnl_status2str(s));
  }
  dnnl_status_t s = dnnl_engine_create(&b->engine, dnnl_cpu, 0);
  if (s != dnnl_success)
    return od_fail(b, QKEEP_E_PLUGIN, s, "creating the CPU engine");
  b->isa = dnnl_get_effective_cpu_isa();
  snprintf(b->isa_name, sizeof b->isa_name, "%s", isa_name(b->isa));
  /* Only AVX-512 VNNI is known exact here; avx2_vnni is not verified, so it takes the 7-bit path too. */
  b->vnni = (b->isa & dnnl_cpu_isa_avx512_core_vnni) == dnnl_cpu_isa_avx512_core_vnni;
  dnnl_primitive_desc_t pd = NULL;
  b->bf16 = matmul_pd(b, OD_BF16, 1, 64, 64, NULL, &pd) == dnnl_success;
  if (pd)
    dnnl_primitive_desc_destroy(pd);
  return 0;
}

void od_engine_fini(struct od_backend *b) {
  if (b->engine)
    dnnl_engine_destroy(b->engine);
  b->engine = NULL;
}

int od_threads_begin(const struct od_backend *b) {
  int saved = omp_get_max_threads();
  if (b->threads > 0)
    omp_set_num_threads(b->threads);
  return saved;
}

void od_threads_end(const struct od_backend *b, int saved) {
  if (b->threads > 0)
    omp_set_num_threads(saved);
}

/* ---- primitives per M class ------------------------------------------------------------ */

static const int64_t class_rows[OD_CLASSES] = {1, 16, 64, 128, OD_CHUNK_ROWS};

/* The rows of the next chunk of `left` rows, and the class that runs it (onednn.h). */
static int64_t next_chunk(int64_t left, int *cls) {
  int c = 0;
  while (c + 1 < OD_CLASSES && class_rows[c] < left)
    c++;
  if (left > class_rows[c]) { /* more than the largest class */
    *cls = c;
    return class_rows[c];
  }
  if (c == OD_CLASSES - 1 && left * 4 < class_rows[c] * 3) { /* 129..191: 128 now, the rest next */
    *cls = c - 1;
    return class_rows[c - 1];
  }
  *cls = c;
  return left;
}

/* Builds class c's primitive and its memory objects from pd (consumed). */
static int prim_build(struct od_backend *b, struct od_matrix *mt, int c, dnnl_primitive_desc_t pd) {
  struct od_prim *p = &mt->cls[c];
  dnnl_status_t s = dnnl_primitive_create(&p->prim, pd);
  const dnnl_memory_desc_t *src = dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0);
  const dnnl_memory_desc_t *dst = dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0);
  if (s == dnnl_success)
    s = dnnl_memory_create(&p->src, src, b->engine, DNNL_MEMORY_NONE);
  if (s == dnnl_success)
    s = dnnl_memory_create(&p->wei, &mt->wmd, b->engine, DNNL_MEMORY_NONE);
  if (s == dnnl_success)
    s = dnnl_memory_create(&p->dst, dst, b->engine, DNNL_MEMORY_NONE);
  dnnl_primitive_desc_destroy(pd);
  if (s != dnnl_success) {
    char what[96];
    snprintf(what, sizeof what, "building the %lld-row matmul for %lldx%lld weights",
             (long long)class_rows[c], (long long)mt->n, (long long)mt->k);
    return od_fail(b, QKEEP_E_DEVICE, s, what);
  }
  return 0;
}

/* Class c's primitive, built on first use with the weights' layout fixed at PWAL. */
static int prim_get(struct od_backend *b, struct od_matrix *mt, int c, struct od_prim **out) {
  if (!mt->cls[c].prim) {
    dnnl_primitive_desc_t pd = NULL;
    dnnl_status_t s = matmul_pd(b, mt->compute, class_rows[c], mt->k, mt->n, &mt->wmd, &pd);
    if (s != dnnl_success)
      return od_fail(b, QKEEP_E_UNSUPPORTED, s, "a matmul with the packed weights' layout");
    if (class_rows[c] == 1 && mt->compute == OD_INT8)
      prefer_vnni_for_one_row(b, mt, &pd);
    int rc = prim_build(b, mt, c, pd);
    if (rc)
      return rc;
  }
  *out = &mt->cls[c];
  return 0;
}

void od_matrix_release(struct od_matrix *mt) {
  for (int c = 0; c < OD_CLASSES; c++) {
    struct od_prim *p = &mt->cls[c];
    if (p->prim)
      dnnl_primitive_destroy(p->prim);
    if (p->src)
      dnnl_memory_destroy(p->src);
    if (p->wei)
      dnnl_memory_destroy(p->wei);
    if (p->dst)
      dnnl_memory_destroy(p->dst);
    *p = (struct od_prim){0};
  }
}

/* A row-major layout with no blocking: what format_tag_any gives where oneDNN has no packed kernel. */
static bool is_plain(const dnnl_memory_desc_t *md) {
  return md->format_kind == dnnl_blocked && md->format_desc.blocking.inner_nblks == 0 && md->extra.flags == 0;
}

/*
 * Where oneDNN prefers a plain layout (no packed kernel on this ISA: gemm:jit
 * on AVX2), its choice between the two plain orders is a default, not a
 * tuning: it picks {K, N} "ab", a transpose of the checkpoint. The same
 * implementation also takes the checkpoint's own order "ba" and runs it
 * faster (AVX2, 2 threads, 4096 x 4096: int8 M = 1 1.5 ms vs 2.5 ms, M = 16
 * 2.3 vs 4.4 ms; f32 M = 128 37 vs 59 ms), so the weights keep that order.
 * Packed (blocked) preferences are always taken as given.
 */
static void prefer_checkpoint_order(struct od_backend *b, struct od_matrix *mt, dnnl_primitive_desc_t *pd) {
  dnnl_data_type_t sdt, wdt, ddt;
  compute_types(mt->compute, &sdt, &wdt, &ddt);
  dnnl_memory_desc_t ba;
  dnnl_primitive_desc_t alt = NULL;
  const char *impl = NULL, *alt_impl = NULL;
  if (dnnl_memory_desc_init_by_tag(&ba, 2, (dnnl_dims_t){mt->k, mt->n}, wdt, dnnl_ba) != dnnl_success ||
      matmul_pd(b, mt->compute, 1, mt->k, mt->n, &ba, &alt) != dnnl_success)
    return;
  dnnl_primitive_desc_query(*pd, dnnl_query_impl_info_str, 0, &impl);
  dnnl_primitive_desc_query(alt, dnnl_query_impl_info_str, 0, &alt_impl);
  if (impl && alt_impl && strcmp(impl, alt_impl) == 0) {
    dnnl_primitive_desc_destroy(*pd);
    *pd = alt;
    mt->wmd = ba;
  } else {
    dnnl_primitive_desc_destroy(alt);
  }
}

int od_matrix_prepare(struct od_backend *b, struct od_matrix *mt, enum qkeep_dtype weight_dtype, bool plain) {
  od_matrix_release(mt);
  dnnl_memory_desc_t plain_md;
  dnnl_status_t s = dnnl_success;
  if (plain)
    s = dnnl_memory_desc_init_by_tag(&plain_md, 2, (dnnl_dims_t){mt->k, mt->n}, dnnl_type(weight_dtype),
                                     dnnl_ba);
  dnnl_primitive_desc_t pd = NULL;
  if (s == dnnl_success)
    s = matmul_pd(b, mt->compute, 1, mt->k, mt->n, plain ? &plain_md : NULL, &pd);
  if (s != dnnl_success) {
    char what[128];
    snprintf(what, sizeof what, "no %s matmul for %lldx%lld %s weights on %s", dtype_name(weight_dtype),
             (long long)mt->n, (long long)mt->k, plain ? "plain" : "packed", b->isa_name);
    return od_fail(b, QKEEP_E_UNSUPPORTED, s, what);
  }
  mt->wmd = *dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
  if (!plain && is_plain(&mt->wmd))
    prefer_checkpoint_order(b, mt, &pd);
  mt->wbytes = dnnl_memory_desc_get_size(&mt->wmd);
  if (mt->compute == OD_INT8)
    prefer_vnni_for_one_row(b, mt, &pd);
  return prim_build(b, mt, 0, pd);
}

int od_pack(struct od_backend *b, dnnl_stream_t stream, const struct od_matrix *mt, enum qkeep_dtype dtype,
            const void *plain, void *packed) {
  dnnl_memory_desc_t from_md;
  dnnl_primitive_desc_t pd = NULL;
  dnnl_primitive_t reorder = NULL;
  dnnl_memory_t from = NULL, to = NULL;
  /* The checkpoint's W [N, K] row-major is the matmul's {K, N} weights in "ba" order. */
  dnnl_status_t s =
      dnnl_memory_desc_init_by_tag(&from_md, 2, (dnnl_dims_t){mt->k, mt->n}, dnnl_type(dtype), dnnl_ba);
  if (s == dnnl_success)
    s = dnnl_reorder_primitive_desc_create(&pd, &from_md, b->engine, &mt->wmd, b->engine, NULL);
  if (s == dnnl_success)
    s = dnnl_primitive_create(&reorder, pd);
  if (s == dnnl_success)
    s = dnnl_memory_create(&from, &from_md, b->engine, (void *)plain);
  if (s == dnnl_success)
    s = dnnl_memory_create(&to, &mt->wmd, b->engine, packed);
  if (s == dnnl_success)
    s = dnnl_primitive_execute(reorder, stream, 2,
                               (dnnl_exec_arg_t[]){{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}});
  if (s == dnnl_success)
    s = dnnl_stream_wait(stream);
  if (from)
    dnnl_memory_destroy(from);
  if (to)
    dnnl_memory_destroy(to);
  if (reorder)
    dnnl_primitive_destroy(reorder);
  if (pd)
    dnnl_primitive_desc_destroy(pd);
  return s == dnnl_success ? 0 : od_fail(b, QKEEP_E_DEVICE, s, "reordering weights into the packed layout");
}

/* ---- activations ----------------------------------------------------------------------- */

/*
 * Round to nearest even of |v| <= 2^22 under the default rounding mode: adding
 * 1.5 * 2^23 leaves no fraction bits. Unlike nearbyintf (a libm call on
 * baseline x86-64) it vectorises. Callers clamp v first.
 */
static inline float round_even(float v) {
  const float magic = 12582912.0f;
  return (v + magic) - magic;
}

/*
 * min(0, x) and max(0, x) over a row. Eight independent lanes instead of a
 * reduction, so compilers vectorise it without fast-math (a float max
 * reduction needs it); NaN is skipped.
 */
static void row_range(const float *x, int64_t k, float *lo, float *hi) {
  float l8[8] = {0}, h8[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8)
    for (int j = 0; j < 8; j++) {
      l8[j] = x[i + j] < l8[j] ? x[i + j] : l8[j];
      h8[j] = x[i + j] > h8[j] ? x[i + j] : h8[j];
    }
  for (; i < k; i++) {
    l8[0] = x[i] < l8[0] ? x[i] : l8[0];
    h8[0] = x[i] > h8[0] ? x[i] : h8[0];
  }
  for (int j = 1; j < 8; j++) {
    l8[0] = l8[j] < l8[0] ? l8[j] : l8[0];
    h8[0] = h8[j] > h8[0] ? h8[j] : h8[0];
  }
  *lo = l8[0];
  *hi = h8[0];
}

/* Whether this CPU runs AVX2 (the vector forms below are taken only then). */
static bool have_avx2(void) { return __builtin_cpu_supports("avx2"); }

/* u[i] = clamp(rne(x[i] * inv + zp), 0, levels): the multiply and the add rounded apart
 * (no contraction), NaN to 0. */
static void quantize_codes(const float *x, int64_t k, uint8_t *u, float inv, float zp, float levels) {
  for (int64_t i = 0; i < k; i++) {
    float t = x[i] * inv + zp;
    t = t > 0.0f ? t : 0.0f; /* also maps NaN to 0 */
    t = t < levels ? t : levels;
    u[i] = (uint8_t)(int)round_even(t);
  }
}

/* The same, 32 codes a step with AVX2, bit for bit: max(t, 0) gives 0 for NaN as the
 * scalar form does, and the values are whole numbers in 0..255 before the narrowing. */
__attribute__((target("avx2"))) static void quantize_codes_avx2(const float *x, int64_t k, uint8_t *u,
                                                                float inv, float zp, float levels) {
  const __m256 vinv = _mm256_set1_ps(inv), vzp = _mm256_set1_ps(zp), vmax = _mm256_set1_ps(levels),
               zero = _mm256_setzero_ps(), magic = _mm256_set1_ps(12582912.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    __m256i q[4];
    for (int j = 0; j < 4; j++) {
      __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), vinv), vzp);
      t = _mm256_min_ps(_mm256_max_ps(t, zero), vmax);
      t = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
      q[j] = _mm256_cvttps_epi32(t);
    }
    /* 32-bit to 16-bit to 8-bit packs work per 128-bit lane; the permute restores order. */
    __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i b = _mm256_packus_epi16(w01, w23);
    _mm256_storeu_si256((__m256i *)(u + i), _mm256_permutevar8x32_epi32(b, order));
  }
  quantize_codes(x + i, k - i, u + i, inv, zp, levels);
}

/*
 * Quantises one row of k activations to u8 codes u with x ~ a * (u - zp), and
 * returns a and zp. L = act->levels (255, or 127 without VNNI):
 *   dynamic symmetric:  h = (L - 1) / 2, a = max|x| / h, zp = h + 1 (u in 1..L);
 *   dynamic asymmetric: the row's [min, max] widened to hold 0 (so zp is in 0..L and the
 *                       int32 correction cannot overflow), a = (max - min) / L, zp = rne(-min / a);
 *   static:             a = input_scale, zp = 128 + input_zero_point (0 when symmetric);
 *                       7 bits: a = 2 * input_scale, zp = rne((128 + input_zero_point) / 2).
 * Then u = clamp(rne(x / a) + zp, 0, L), with 1 / a as a multiplier. A zero scale
 * (an all-zero row) gives u = zp, so the row contributes nothing.
 */
static void quantize_row(const struct od_act *act, const float *x, int64_t k, uint8_t *u, float *scale,
                         int32_t *zero) {
  const float levels = (float)act->levels;
  float a, zp;
  if (!act->dynamic) {
    float z = act->asym ? (float)act->static_zero + 128.0f : 128.0f;
    a = act->levels == 255 ? act->static_scale : 2.0f * act->static_scale;
    zp = act->levels == 255 ? z : round_even(z * 0.5f);
  } else if (!act->asym) {
    float lo, hi;
    row_range(x, k, &lo, &hi);
    float amax = -lo > hi ? -lo : hi;
    float h = (levels - 1.0f) * 0.5f;
    a = amax / h;
    zp = h + 1.0f;
  } else {
    float lo, hi;
    row_range(x, k, &lo, &hi);
    a = (hi - lo) / levels;
    zp = a > 0.0f ? round_even(-lo / a) : 0.0f;
  }
  float inv = a > 0.0f ? 1.0f / a : 0.0f;
  if (have_avx2())
    quantize_codes_avx2(x, k, u, inv, zp, levels);
  else
    quantize_codes(x, k, u, inv, zp, levels);
  *scale = a;
  *zero = (int32_t)zp;
}

/* ---- apply ------------------------------------------------------------------------------- */

/* Grows a scratch allocation to at least `bytes`. */
static int reserve(const struct od_backend *b, void **buf, size_t *cap, size_t bytes) {
  if (bytes <= *cap)
    return 0;
  void *p = realloc(*buf, bytes);
  if (!p)
    return b->host->set_error(QKEEP_E_NOMEM, "cpu-onednn: out of memory for %zu bytes of scratch", bytes);
  *buf = p;
  *cap = bytes;
  return 0;
}

/*
 * Row loops run on the OpenMP team only when the work is large. A parallel
 * region is not entered at all for small work: even a one-thread region (an
 * `if` clause that is false) re-forms libgomp's team, and on a loaded or
 * virtual machine re-waking the team for the next matmul cost milliseconds
 * per call at M = 1 (measured: median 8 ms instead of 2.4 ms).
 */
#define OD_PARALLEL_MIN 65536

/* The AVX2 form of epilogue_int8_row below, bit for bit (the same operations in the same order,
 * no contraction); returns how many leading elements it did, a multiple of 8. */
__attribute__((target("avx2"))) static int64_t epilogue_int8_avx2(const unsigned char *c, float *y, int64_t n,
                                                                  float a, int32_t zp,
                                                                  const struct od_operands *op,
                                                                  const float *bias) {
  const __m256 va = _mm256_set1_ps(a);
  const __m256i vzp = _mm256_set1_epi32(zp);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256i acc = _mm256_loadu_si256((const __m256i *)(c + (size_t)j * sizeof(int32_t)));
    __m256i adj = _mm256_loadu_si256((const __m256i *)(op->azp_adj + j));
    __m256 d = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc, _mm256_mullo_epi32(vzp, adj)));
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(va, _mm256_loadu_ps(op->scale + j)), d);
    if (bias)
      v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j));
    _mm256_storeu_ps(y + j, v);
  }
  return j;
}

/* One row of the int8 epilogue: y = a * s[j] * (C - zp * adj[j]) + bias[j]. C (s32) may be y itself:
 * each element is read before it is written, through memcpy so no type punning is involved. */
static void epilogue_int8_row(const unsigned char *c, float *y, int64_t n, float a, int32_t zp,
                              const struct od_operands *op, const float *bias) {
  for (int64_t j = have_avx2() ? epilogue_int8_avx2(c, y, n, a, zp, op, bias) : 0; j < n; j++) {
    int32_t acc;
    memcpy(&acc, c + (size_t)j * sizeof acc, sizeof acc);
    float v = (a * op->scale[j]) * (float)(acc - zp * op->azp_adj[j]);
    y[j] = bias ? v + bias[j] : v;
  }
}

static void epilogue_int8(const void *c, float *y, int64_t rows, int64_t n, const float *a, const int32_t *zp,
                          const struct od_operands *op, const float *bias) {
  const unsigned char *cb = c;
  size_t row_bytes = (size_t)n * sizeof(int32_t);
  if (rows * n >= OD_PARALLEL_MIN) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
      epilogue_int8_row(cb + (size_t)r * row_bytes, y + r * n, n, a[r], zp[r], op, bias);
  } else {
    for (int64_t r = 0; r < rows; r++)
      epilogue_int8_row(cb + (size_t)r * row_bytes, y + r * n, n, a[r], zp[r], op, bias);
  }
}

/* y[rows, n] = dst (f32, may be y itself) + bias. */
static void epilogue_float(const float *dst, float *y, int64_t rows, int64_t n, const float *bias) {
  if (!bias) {
    if (dst != y)
      memcpy(y, dst, (size_t)(rows * n) * sizeof *y);
    return;
  }
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < n; j++)
      y[r * n + j] = dst[r * n + j] + bias[j];
}

/* The bias as f32: the param itself, or a converted copy (malloc'd; the caller frees it). */
static int bias_f32(const struct od_backend *b, const struct od_operands *op, int64_t n, const float **out) {
  *out = NULL;
  if (!op->bias)
    return 0;
  if (op->bias_dtype == QKEEP_DTYPE_F32) {
    *out = op->bias;
    return 0;
  }
  float *conv = malloc((size_t)(n ? n : 1) * sizeof *conv);
  if (!conv)
    return b->host->set_error(QKEEP_E_NOMEM, "cpu-onednn: out of memory converting a bias");
  for (int64_t j = 0; j < n; j++)
    conv[j] = qkeep_load_float(op->bias, op->bias_dtype, (size_t)j);
  *out = conv;
  return 0;
}

/* Fills the class-sized source chunk: quantised (int8), converted (bf16) or copied (f32, padded). */
static void fill_source(const struct od_matrix *mt, const struct od_operands *op, const float *x,
                        int64_t rows, int64_t padded, void *src, float *a, int32_t *zp) {
  int64_t k = mt->k;
  if (mt->compute == OD_INT8) {
    uint8_t *u = src;
    if (rows * k >= OD_PARALLEL_MIN) {
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; r++)
        quantize_row(&op->act, x + r * k, k, u + r * k, &a[r], &zp[r]);
    } else {
      for (int64_t r = 0; r < rows; r++)
        quantize_row(&op->act, x + r * k, k, u + r * k, &a[r], &zp[r]);
    }
    memset(u + rows * k, 0, (size_t)((padded - rows) * k));
  } else if (mt->compute == OD_BF16) {
    uint16_t *h = src;
    for (int64_t i = 0; i < rows * k; i++)
      h[i] = qkeep_f32_to_bf16(x[i]);
    memset(h + rows * k, 0, (size_t)((padded - rows) * k) * sizeof *h);
  } else {
    float *f = src;
    memcpy(f, x, (size_t)(rows * k) * sizeof *f);
    memset(f + rows * k, 0, (size_t)((padded - rows) * k) * sizeof *f);
  }
}

/*
 * The few-row int8 product where oneDNN has no packed kernel (AVX2 without VNNI, weights in
 * the checkpoint's [n, k] order): C[i, j] = sum_k u[i, k] w[j, k], exact in int32. With
 * 7-bit activations (u <= 127), vpmaddubsw's pairs u0 w0 + u1 w1 stay within int16 (at most
 * 2 * 127 * 128), so nothing saturates; vpmaddwd then widens to int32. A tile is TM rows of
 * activations by TN rows of weights, TM * TN accumulators in registers, so each 32-byte
 * load of a weight row serves TM activation rows; the weights are read from memory once
 * per call (2 x 4 tiles: 8 accumulators, no spills at -O2). oneDNN's gemm:jit streams the
 * weights at about half the memory bandwidth at M = 1 and stays 1.2-1.4x behind this up to
 * M = 48; from M = 64 the two are level (docs/PERFORMANCE.md), and oneDNN runs those.
 */
#define OD_DOT_MAX_ROWS 48
#define OD_DOT_TN 4

__attribute__((target("avx2"))) static inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

/* One tile: C[i, j] for i < TM activation rows (u, stride k) and j < TN weight rows (w,
 * stride k); C has row stride ldc. */
#define OD_DOT_TILE(TM, TN)                                                                                  \
  __attribute__((target("avx2"))) static void dot_tile_##TM##x##TN(const uint8_t *u, const int8_t *w,        \
                                                                   int64_t k, int32_t *c, int64_t ldc) {     \
    const __m256i ones = _mm256_set1_epi16(1);                                                               \
    __m256i acc[TM][TN];                                                                                     \
    _Pragma("GCC unroll 16") for (int i = 0; i < TM; i++)                                                    \
        _Pragma("GCC unroll 16") for (int j = 0; j < TN; j++) acc[i][j] = _mm256_setzero_si256();            \
    int64_t q = 0;                                                                                           \
    for (; q + 32 <= k; q += 32) {                                                                           \
      __m256i x[TM];                                                                                         \
      _Pragma("GCC unroll 16") for (int i = 0; i < TM; i++) x[i] =                                           \
          _mm256_loadu_si256((const __m256i *)(u + i * k + q));                                              \
      _Pragma("GCC unroll 16") for (int j = 0; j < TN; j++) {                                                \
        const __m256i b = _mm256_loadu_si256((const __m256i *)(w + j * k + q));                              \
        _Pragma("GCC unroll 16") for (int i = 0; i < TM; i++) acc[i][j] =                                    \
            _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(_mm256_maddubs_epi16(x[i], b), ones));             \
      }                                                                                                      \
    }                                                                                                        \
    _Pragma("GCC unroll 16") for (int i = 0; i < TM; i++)                                                    \
        _Pragma("GCC unroll 16") for (int j = 0; j < TN; j++) {                                              \
      int32_t sum = hsum_epi32(acc[i][j]);                                                                   \
      for (int64_t r = q; r < k; r++)                                                                        \
        sum += (int32_t)u[i * k + r] * w[j * k + r];                                                         \
      c[i * ldc + j] = sum;                                                                                  \
    }                                                                                                        \
  }
OD_DOT_TILE(2, 4)
OD_DOT_TILE(1, 4)
OD_DOT_TILE(2, 1)
OD_DOT_TILE(1, 1)

/* C[rows, n] = u[rows, k] W^T for rows <= OD_DOT_MAX_ROWS; weight-row tiles across threads. */
static void dot_u7s8(const uint8_t *u, int64_t rows, const int8_t *w, int64_t n, int64_t k, int32_t *c) {
  const int64_t tiles = (n + OD_DOT_TN - 1) / OD_DOT_TN;
#pragma omp parallel for schedule(static) if (rows * n * k >= OD_PARALLEL_MIN)
  for (int64_t t = 0; t < tiles; t++) {
    const int64_t j0 = t * OD_DOT_TN;
    const int8_t *wt = w + j0 * k;
    if (j0 + OD_DOT_TN <= n) {
      int64_t i = 0;
      for (; i + 2 <= rows; i += 2)
        dot_tile_2x4(u + i * k, wt, k, c + i * n + j0, n);
      for (; i < rows; i++)
        dot_tile_1x4(u + i * k, wt, k, c + i * n + j0, n);
    } else {
      for (int64_t j = j0; j < n; j++) {
        int64_t i = 0;
        for (; i + 2 <= rows; i += 2)
          dot_tile_2x1(u + i * k, w + j * k, k, c + i * n + j, n);
        for (; i < rows; i++)
          dot_tile_1x1(u + i * k, w + j * k, k, c + i * n + j, n);
      }
    }
  }
}

/* Whether an int8 chunk of `rows` runs dot_u7s8: few rows, 7-bit activations, weights plain in
 * the checkpoint's order ({k, n} with strides {1, k}), and an AVX2 CPU. */
static bool few_rows_dot(const struct od_matrix *mt, const struct od_operands *op, int64_t rows) {
  const dnnl_memory_desc_t *md = &mt->wmd;
  return mt->compute == OD_INT8 && rows <= OD_DOT_MAX_ROWS && op->act.levels == 127 && is_plain(md) &&
         md->format_desc.blocking.strides[0] == 1 && md->format_desc.blocking.strides[1] == mt->k &&
         have_avx2();
}

/* One chunk of rows (at most the class's) through class c's primitive, padded to its rows. */
static int apply_chunk(struct od_backend *b, struct od_layer *st, struct od_matrix *mt,
                       const struct od_operands *op, const float *bias, int c, int64_t rows, const float *x,
                       float *y) {
  /* Few int8 rows without VNNI run dot_u7s8 on exactly `rows`: no primitive, no padding. */
  const bool dot = few_rows_dot(mt, op, rows);
  int64_t padded = dot ? rows : class_rows[c];
  struct od_prim *p = NULL;
  int rc = dot ? 0 : prim_get(b, mt, c, &p);
  if (rc)
    return rc;
  size_t src_elem = mt->compute == OD_INT8 ? 1 : mt->compute == OD_BF16 ? 2 : 4;
  float a[OD_CHUNK_ROWS];
  int32_t zp[OD_CHUNK_ROWS];
  /* f32 rows that fill the class are read in place; everything else goes through scratch. */
  const void *src = x;
  if (mt->compute != OD_F32 || rows != padded) {
    if ((rc = reserve(b, &st->src, &st->src_cap, (size_t)(padded * mt->k) * src_elem)))
      return rc;
    fill_source(mt, op, x, rows, padded, st->src, a, zp);
    src = st->src;
  }
  /* The output is written straight into y when the class fits the rows exactly (s32 and f32 are both 4
   * bytes). */
  void *dst = y;
  if (rows != padded) {
    if ((rc = reserve(b, &st->dst, &st->dst_cap, (size_t)(padded * mt->n) * sizeof(float))))
      return rc;
    dst = st->dst;
  }
  if (dot) {
    int32_t *acc = dst; /* s32 and f32 are both 4 bytes: the epilogue converts in place */
    dot_u7s8(src, rows, op->weights, mt->n, mt->k, acc);
    epilogue_int8(dst, y, rows, mt->n, a, zp, op, bias);
    return 0;
  }
  dnnl_status_t s = dnnl_memory_set_data_handle(p->src, (void *)src);
  if (s == dnnl_success)
    s = dnnl_memory_set_data_handle(p->wei, (void *)op->weights);
  if (s == dnnl_success)
    s = dnnl_memory_set_data_handle(p->dst, dst);
  if (s == dnnl_success)
    s = dnnl_primitive_execute(
        p->prim, st->stream, 3,
        (dnnl_exec_arg_t[]){{DNNL_ARG_SRC, p->src}, {DNNL_ARG_WEIGHTS, p->wei}, {DNNL_ARG_DST, p->dst}});
  if (s == dnnl_success)
    s = dnnl_stream_wait(st->stream);
  if (s != dnnl_success)
    return od_fail(b, QKEEP_E_DEVICE, s, "running the matmul");
  if (mt->compute == OD_INT8)
    epilogue_int8(dst, y, rows, mt->n, a, zp, op, bias);
  else
    epilogue_float(dst, y, rows, mt->n, bias);
  return 0;
}

int od_apply(struct od_backend *b, struct od_layer *st, struct od_matrix *mt, const struct od_operands *op,
             int64_t m, const float *x, float *y) {
  const float *bias = NULL;
  int rc = bias_f32(b, op, mt->n, &bias);
  int saved = od_threads_begin(b);
  for (int64_t r0 = 0, rows; !rc && r0 < m; r0 += rows) {
    int c;
    rows = next_chunk(m - r0, &c);
    rc = apply_chunk(b, st, mt, op, bias, c, rows, x + r0 * mt->k, y + r0 * mt->n);
  }
  od_threads_end(b, saved);
  if (bias && bias != op->bias)
    free((void *)bias);
  return rc;
}

void od_layer_release(struct od_layer *st) {
  for (int i = 0; i < 2; i++)
    od_matrix_release(&st->mat[i]);
  if (st->stream)
    dnnl_stream_destroy(st->stream);
  st->stream = NULL;
  free(st->src);
  free(st->dst);
  st->src = st->dst = NULL;
  st->src_cap = st->dst_cap = 0;
}
