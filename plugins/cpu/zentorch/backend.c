/*
 * backend.c: the `cpu-zentorch` backend's table: init and fini, configure, probe,
 * supports_layer, PWAL under the rules, apply, and per-layer cleanup.
 *
 * Schemes: gptq-int4 (v1 and v2 zero points, symmetric and asymmetric, act order through
 * g_idx), awq-int4 (GEMM layout) and ct-int4 (compressed-tensors pack-quantized: weight_packed,
 * weight_scale, weight_zero_point and weight_g_idx play the parts of qweight, scales, qzeros and
 * g_idx below; weight_scale is transposed to [groups, N] in its own storage, f32 allowed), linear
 * and MoE layers, on x86 CPUs with AVX2, FMA and F16C at least. It is a chain member: it takes
 * its int4 layers and passes every other layer (unquantized, other schemes, embeddings, norms,
 * kv scales) down the chain with a reason.
 *
 * What PWAL leaves behind, per weight matrix ("" for a linear layer, "w13_" and "w2_" for
 * MoE); every byte stays in its own param (zentorch.h describes the layouts):
 *
 *   qweight  the blocked zentorch codes, u4 or s4, as int32 [E?, K N / 8], replaced into
 *            its own storage (same bytes count, so always in place)
 *   scales   as loaded: [E?, groups, N] is the zentorch scale layout already (ct-int4:
 *            transposed from [E?, N, groups] in place)
 *   qzeros   asymmetric: the zentorch zero points [E?, groups, N/8], replaced in place;
 *            symmetric (the config says so, or every zero point is 8): retired, its bytes kept
 *   g_idx    act order: the K permutation int32 [E?, K], replaced in place (no act order:
 *            the scheme retires it)
 *   bias     as loaded
 *
 * No buffer, no cache: apply reads every operand through host->view on each call, and the
 * layer state holds only dims and flags, rebuilt by every PWAL, so a reload (same storage,
 * same addresses, new bytes) leaves nothing stale.
 *
 * Config ([backend.cpu-zentorch]): mode = w4a16 | da8w4 (default w4a16), threads = N
 * (OpenMP threads; default OpenMP's), isa = auto | avx2 | avx512 | avx512_vnni | amx (the
 * highest the kernels may use; default auto, the CPU's best; amx: da8w4 from ZT_AMX_MIN_ROWS
 * rows on AMX-INT8 tiles where the CPU has them and Linux grants the process their state).
 * Environment: QKEEP_ZENTORCH_MAX_ISA (the same names) lowers the ISA for the whole process,
 * e.g. to run the AVX2 path on an AVX-512 machine.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "zentorch.h"

static struct zt_backend *zt_of(const struct qkeep_backend *be) { return (struct zt_backend *)be; }

static const char *const isa_names[ZT_ISA_COUNT] = {"none", "avx2", "avx512", "avx512_vnni", "amx"};

/* ---- configuration and probing ------------------------------------------------------------------ */

/*
 * Whether this process may use the AMX tile registers: Linux hands their 8 KiB of state out
 * per process, on request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); an AMX
 * instruction without it raises SIGILL. The grant holds for every thread, present and future.
 */
static bool amx_granted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
  enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}

static enum zt_isa cpu_isa(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
    return ZT_ISA_NONE;
  /* F16C has no __builtin_cpu_supports name in every gcc; every AVX2 CPU with FMA has it. */
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
    return ZT_ISA_AVX2;
  if (!__builtin_cpu_supports("avx512vnni"))
    return ZT_ISA_AVX512;
  if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && amx_granted())
    return ZT_ISA_AMX;
  return ZT_ISA_AVX512_VNNI;
}

static int isa_of_name(const char *name, enum zt_isa *out) {
  for (int i = ZT_ISA_AVX2; i < ZT_ISA_COUNT; i++)
    if (strcmp(name, isa_names[i]) == 0) {
      *out = (enum zt_isa)i;
      return 0;
    }
  return -1;
}

static int zentorch_probe(const struct qkeep_backend *be, char *msg, size_t msg_len) {
  const struct zt_backend *b = zt_of(be);
  if (b->isa == ZT_ISA_NONE) {
    snprintf(msg, msg_len, "cpu-zentorch needs an x86 CPU with AVX2 and FMA; this one has neither");
    return QKEEP_E_NODEV;
  }
  char amx[64];
  snprintf(amx, sizeof amx, "tdpbsud tiles from %d rows, vpdpbusd below", ZT_AMX_MIN_ROWS);
  snprintf(msg, msg_len, "int4 kernels on %s (CPU: %s), mode %s, %s", isa_names[b->isa],
           isa_names[b->cpu_isa], b->mode == ZT_DA8W4 ? "da8w4" : "w4a16",
           b->isa == ZT_ISA_AMX           ? amx
           : b->isa == ZT_ISA_AVX512_VNNI ? "vpdpbusd"
                                          : "vpmaddubsw + vpmaddwd");
  return 0;
}

static int zentorch_configure(const struct qkeep_backend *be, const char *key, const char *value) {
  struct zt_backend *b = zt_of(be);
  if (strcmp(key, "threads") == 0)
    return qkeep_be_int_key(b->host, key, value, 1, 4096, &b->threads);
  if (strcmp(key, "mode") == 0) {
    if (strcmp(value, "w4a16") == 0)
      b->mode = ZT_W4A16;
    else if (strcmp(value, "da8w4") == 0)
      b->mode = ZT_DA8W4;
    else
      return b->host->set_error(QKEEP_E_CONFIG, "mode = '%s': expected w4a16 or da8w4", value);
    return 0;
  }
  if (strcmp(key, "isa") == 0) {
    enum zt_isa isa = b->cpu_isa;
    if (strcmp(value, "auto") != 0 && isa_of_name(value, &isa))
      return b->host->set_error(QKEEP_E_CONFIG, "isa = '%s': expected auto, avx2, avx512, avx512_vnni or amx",
                                value);
    if (isa > b->cpu_isa)
      return b->host->set_error(QKEEP_E_CONFIG, "isa = '%s': this CPU has %s at most", value,
                                isa_names[b->cpu_isa]);
    const char *env = getenv("QKEEP_ZENTORCH_MAX_ISA");
    enum zt_isa cap = b->cpu_isa;
    if (env && !isa_of_name(env, &cap) && isa > cap)
      isa = cap;
    b->isa = isa;
    return 0;
  }
  return b->host->set_error(QKEEP_E_CONFIG, "unknown key '%s' (cpu-zentorch takes mode, threads, isa)", key);
}

static const struct qkeep_backend_key zentorch_keys[] = {
    {"mode", QKEEP_KEY_ENUM, "w4a16|da8w4", "w4a16",
     "f32/bf16 activations (w4a16), or activations quantised per token to int8 with int32 accumulation "
     "(da8w4)"},
    {"threads", QKEEP_KEY_INT, "1..4096", "all online cores", "OpenMP threads of the int4 kernels"},
    {"isa", QKEEP_KEY_ENUM, "auto|avx2|avx512|avx512_vnni|amx", "auto",
     "the highest instruction set the kernels use (lower ones force a slower path; QKEEP_ZENTORCH_MAX_ISA "
     "too)"},
};

static bool int4_scheme(const char *scheme) {
  return strcmp(scheme, "gptq-int4") == 0 || strcmp(scheme, "awq-int4") == 0 ||
         strcmp(scheme, "ct-int4") == 0;
}

/* Linear and MoE layers of gptq-int4 and awq-int4 whose dims fit the layout; nothing else. */
static int zentorch_supports_layer(const struct qkeep_backend *be, const struct qkeep_layer_info *info,
                                   char *reason, size_t reason_len) {
  (void)be;
  if (info->kind != QKEEP_LAYER_LINEAR && info->kind != QKEEP_LAYER_MOE) {
    snprintf(reason, reason_len, "runs int4 linear and MoE layers only (gptq-int4, awq-int4, ct-int4)");
    return 0;
  }
  if (!int4_scheme(info->scheme)) {
    snprintf(reason, reason_len, "runs gptq-int4, awq-int4 and ct-int4 layers, not %s", info->scheme);
    return 0;
  }
  bool moe = info->kind == QKEEP_LAYER_MOE;
  int64_t ks[2] = {info->k, moe ? info->n / 2 : info->k};
  for (int i = 0; i < 2; i++) {
    int64_t g = info->group_size ? info->group_size : ks[i];
    if (ks[i] % 8 || info->n % 8 || g % 8 || (g > 0 && ks[i] % g)) {
      snprintf(reason, reason_len, "K %lld, N %lld, group %lld: needs K, N and the group size multiples of 8",
               (long long)ks[i], (long long)info->n, (long long)g);
      return 0;
    }
  }
  return 1;
}

/* The ABI 1.0 form, for cores that do not know supports_layer. */
static int zentorch_supports(const struct qkeep_backend *be, const char *scheme, enum qkeep_layer_kind kind) {
  (void)be;
  return (kind == QKEEP_LAYER_LINEAR || kind == QKEEP_LAYER_MOE) && int4_scheme(scheme);
}

/* ---- PWAL ------------------------------------------------------------------------------------------- */

static const char *pname(char *buf, size_t len, const struct zt_matrix *mt, const char *name) {
  snprintf(buf, len, "%s%s", mt->prefix, name);
  return buf;
}

/* The live view of `name`, of dtype `dtype` (or -1: f16/bf16) and exactly `numel` elements. */
static int operand_view(const struct zt_backend *b, qkeep_layer *layer, const char *layer_name,
                        const char *name, int dtype, int64_t numel, struct qkeep_view *v) {
  v->size = sizeof *v;
  int rc = b->host->view(layer, name, v);
  if (rc)
    return rc;
  bool dtype_ok = dtype >= 0 ? v->spec.dtype == (enum qkeep_dtype)dtype
                             : v->spec.dtype == QKEEP_DTYPE_F16 || v->spec.dtype == QKEEP_DTYPE_BF16 ||
                                   v->spec.dtype == QKEEP_DTYPE_F32;
  if (v->state != QKEEP_PARAM_LIVE || !dtype_ok || qkeep_be_spec_numel(&v->spec) != numel)
    return b->host->set_error(
        QKEEP_E_STATE, "%s.%s: state %d, dtype %d, %lld elements; cpu-zentorch expects a live %s of %lld",
        layer_name, name, (int)v->state, (int)v->spec.dtype, (long long)qkeep_be_spec_numel(&v->spec),
        dtype >= 0 ? "int32 tensor" : "f16/bf16/f32 tensor", (long long)numel);
  return 0;
}

static struct qkeep_spec spec_of(enum qkeep_dtype dt, int64_t experts, bool moe, int64_t a, int64_t b) {
  struct qkeep_spec s = {.dtype = dt};
  int d = 0;
  if (moe)
    s.shape[d++] = experts;
  s.shape[d++] = a;
  if (b > 0)
    s.shape[d++] = b;
  s.ndim = d;
  return s;
}

/* Replaces `name` by a copy of `n` bytes at `data`, shaped `spec` (same bytes: in place). */
static int replace_with(const struct zt_backend *b, qkeep_layer *layer, const char *name,
                        const struct qkeep_spec *spec, const void *data, size_t n) {
  qkeep_tensor *t;
  int rc = b->host->tensor_new(layer, spec, &t);
  if (rc)
    return rc;
  memcpy(b->host->tensor_data(t), data, n);
  return b->host->replace(layer, name, t);
}

/* Zero points: repacked into the zentorch layout, or the matrix is symmetric after all (every zero 8). */
static int pwal_zeros(struct zt_backend *b, qkeep_layer *layer, const struct qkeep_layer_info *info,
                      struct zt_matrix *mt, enum zt_source src, bool moe) {
  char name[64];
  struct qkeep_view zv;
  int64_t count = mt->experts * mt->groups * (mt->n / 8);
  int rc = operand_view(b, layer, info->name, pname(name, sizeof name, mt, mt->zeros_name), QKEEP_DTYPE_I32,
                        count, &zv);
  if (rc)
    return rc;
  int32_t *zeros = malloc((size_t)count * sizeof *zeros);
  if (!zeros)
    return b->host->set_error(QKEEP_E_NOMEM, "%s: out of memory repacking %s", info->name, name);
  int64_t per_expert = mt->groups * (mt->n / 8);
  if (src == ZT_CT)
    for (int64_t e = 0; e < mt->experts; e++)
      zt_repack_ct_zeros((const int32_t *)zv.data + e * per_expert, mt->n, mt->groups,
                         zeros + e * per_expert);
  else {
    memcpy(zeros, zv.data, (size_t)count * sizeof *zeros);
    zt_repack_zeros(src, (info->flags & QKEEP_LAYER_F_GPTQ_V2) != 0, zeros, mt->n, mt->experts * mt->groups);
  }
  bool all_eight = true;
  for (int64_t i = 0; i < count && all_eight; i++)
    all_eight = (uint32_t)zeros[i] == 0x88888888u;
  if (all_eight) {
    mt->sym = true;
    rc = b->host->retire(layer, name);
  } else {
    struct qkeep_spec s = spec_of(QKEEP_DTYPE_I32, mt->experts, moe, mt->groups, mt->n / 8);
    rc = replace_with(b, layer, name, &s, zeros, (size_t)count * sizeof *zeros);
  }
  free(zeros);
  return rc;
}

/* Act order: g_idx of every expert into its permutation, replaced into g_idx's storage; *perm keeps a copy.
 */
static int pwal_act_order(struct zt_backend *b, qkeep_layer *layer, const struct qkeep_layer_info *info,
                          const struct zt_matrix *mt, bool moe, int32_t **perm) {
  char name[64];
  struct qkeep_view gv;
  int64_t count = mt->experts * mt->k;
  int rc = operand_view(b, layer, info->name, pname(name, sizeof name, mt, mt->g_idx_name), QKEEP_DTYPE_I32,
                        count, &gv);
  if (rc)
    return rc;
  if (!(*perm = malloc((size_t)count * sizeof **perm)))
    return b->host->set_error(QKEEP_E_NOMEM, "%s: out of memory for the act-order permutation", info->name);
  for (int64_t e = 0; e < mt->experts; e++) {
    int64_t bad = 0;
    if (zt_act_order_perm((const int32_t *)gv.data + e * mt->k, mt->k, mt->groups, *perm + e * mt->k, &bad))
      return b->host->set_error(
          QKEEP_E_FORMAT,
          "%s.%s (expert %lld): act order needs every group index in [0, %lld) and %lld rows "
          "per group; row or group %lld breaks that",
          info->name, name, (long long)e, (long long)mt->groups, (long long)(mt->k / mt->groups),
          (long long)bad);
  }
  struct qkeep_spec s = spec_of(QKEEP_DTYPE_I32, mt->experts, moe, mt->k, 0);
  return replace_with(b, layer, name, &s, *perm, (size_t)count * sizeof **perm);
}

/* compressed-tensors weight_scale [E?, N, groups] transposed into [E?, groups, N], in its own storage. */
static int pwal_ct_scales(const struct zt_backend *b, qkeep_layer *layer, const struct zt_matrix *mt,
                          bool moe, const struct qkeep_view *sv) {
  size_t es = qkeep_be_dtype_size(sv->spec.dtype);
  struct qkeep_spec s = spec_of(sv->spec.dtype, mt->experts, moe, mt->groups, mt->n);
  qkeep_tensor *t;
  int rc = b->host->tensor_new(layer, &s, &t);
  if (rc)
    return rc;
  unsigned char *out = b->host->tensor_data(t);
  const unsigned char *in = sv->data;
  for (int64_t e = 0; e < mt->experts; e++)
    for (int64_t col = 0; col < mt->n; col++)
      for (int64_t g = 0; g < mt->groups; g++)
        memcpy(out + ((size_t)((e * mt->groups + g) * mt->n + col)) * es,
               in + ((size_t)((e * mt->n + col) * mt->groups + g)) * es, es);
  char name[64];
  return b->host->replace(layer, pname(name, sizeof name, mt, mt->scales_name), t);
}

static int pwal_matrix(struct zt_backend *b, qkeep_layer *layer, const struct qkeep_layer_info *info,
                       struct zt_matrix *mt) {
  bool moe = info->kind == QKEEP_LAYER_MOE;
  enum zt_source src = mt->src;
  char name[64];
  struct qkeep_view qv, sv;
  int64_t words = mt->k / 8 * mt->n;
  int rc = operand_view(b, layer, info->name, pname(name, sizeof name, mt, mt->codes_name), QKEEP_DTYPE_I32,
                        mt->experts * words, &qv);
  if (rc)
    return rc;
  sv.size = sizeof sv;
  if ((rc = b->host->view(layer, pname(name, sizeof name, mt, mt->scales_name), &sv)))
    return rc;
  mt->groups = qkeep_be_spec_numel(&sv.spec) / mt->experts / mt->n;
  if (mt->groups < 1 || mt->k % mt->groups || (mt->k / mt->groups) % 8)
    return b->host->set_error(QKEEP_E_UNSUPPORTED,
                              "%s.%s: %lld groups over K = %lld: needs groups of a multiple of 8", info->name,
                              name, (long long)mt->groups, (long long)mt->k);
  if ((rc = operand_view(b, layer, info->name, name, -1, mt->experts * mt->groups * mt->n, &sv)))
    return rc;
  mt->scale_dtype = sv.spec.dtype;
  mt->sym = (info->flags & QKEEP_LAYER_F_WEIGHT_SYM) != 0;
  mt->act_order = src != ZT_AWQ && (info->flags & QKEEP_LAYER_F_ACT_ORDER);
  if (src == ZT_CT && (rc = pwal_ct_scales(b, layer, mt, moe, &sv)))
    return rc;
  if (!mt->sym && (rc = pwal_zeros(b, layer, info, mt, src, moe)))
    return rc;
  int32_t *perm = NULL, *plain = NULL;
  if (mt->act_order && (rc = pwal_act_order(b, layer, info, mt, moe, &perm))) {
    free(perm);
    return rc;
  }
  qkeep_tensor *t = NULL;
  struct qkeep_spec s = spec_of(QKEEP_DTYPE_I32, mt->experts, moe, words, 0);
  if (!(plain = malloc((size_t)words * sizeof *plain)))
    rc = b->host->set_error(QKEEP_E_NOMEM, "%s: out of memory repacking qweight", info->name);
  if (!rc)
    rc = b->host->tensor_new(layer, &s, &t);
  if (!rc) {
    int32_t *blocked = b->host->tensor_data(t);
    for (int64_t e = 0; e < mt->experts; e++) {
      zt_repack_codes(src, (const int32_t *)qv.data + e * words, mt->n, mt->k, perm ? perm + e * mt->k : NULL,
                      mt->sym, plain);
      zt_block_codes(plain, mt->n, mt->k, blocked + e * words);
    }
    rc = b->host->replace(layer, pname(name, sizeof name, mt, mt->codes_name), t);
  }
  free(plain);
  free(perm);
  return rc;
}

static int zentorch_pwal(const struct qkeep_backend *be, qkeep_layer *layer) {
  struct zt_backend *b = zt_of(be);
  struct qkeep_layer_info info = {.size = sizeof info};
  int rc = b->host->layer_info(layer, &info);
  if (rc)
    return rc;
  if (info.kind != QKEEP_LAYER_LINEAR && info.kind != QKEEP_LAYER_MOE)
    return 0; /* only an ABI 1.0 core hands it such a layer: host memory, read as loaded */
  if (!int4_scheme(info.scheme))
    return b->host->set_error(QKEEP_E_UNSUPPORTED, "%s: cpu-zentorch has no kernel for scheme %s (kind %d)",
                              info.name, info.scheme, (int)info.kind);
  struct zt_layer *st = b->host->get_state(layer);
  if (!st) {
    if (!(st = calloc(1, sizeof *st)))
      return b->host->set_error(QKEEP_E_NOMEM, "%s: cpu-zentorch: out of memory for layer state", info.name);
    b->host->set_state(layer, st);
  }
  bool moe = info.kind == QKEEP_LAYER_MOE;
  *st = (struct zt_layer){.n_mat = moe ? 2 : 1};
  st->mat[0] = (struct zt_matrix){.n = info.n, .k = info.k, .experts = moe ? info.experts : 1};
  snprintf(st->mat[0].prefix, sizeof st->mat[0].prefix, "%s", moe ? "w13_" : "");
  if (moe) {
    st->mat[1] = (struct zt_matrix){.n = info.k, .k = info.n / 2, .experts = info.experts};
    snprintf(st->mat[1].prefix, sizeof st->mat[1].prefix, "w2_");
  }
  bool ct = strcmp(info.scheme, "ct-int4") == 0;
  for (int i = 0; i < st->n_mat; i++) {
    struct zt_matrix *mt = &st->mat[i];
    mt->src = ct ? ZT_CT : info.scheme[0] == 'a' ? ZT_AWQ : ZT_GPTQ;
    mt->codes_name = ct ? "weight_packed" : "qweight";
    mt->scales_name = ct ? "weight_scale" : "scales";
    mt->zeros_name = ct ? "weight_zero_point" : "qzeros";
    mt->g_idx_name = ct ? "weight_g_idx" : "g_idx";
  }
  for (int i = 0; !rc && i < st->n_mat; i++)
    rc = pwal_matrix(b, layer, &info, &st->mat[i]);
  if (rc)
    st->n_mat = 0; /* apply refuses a layer whose PWAL failed */
  return rc;
}

/* ---- apply -------------------------------------------------------------------------------------------- */

typedef void (*zt_kernel)(const struct zt_gemm *g, int64_t m0, int64_t m1, int64_t b0, int64_t b1);

static zt_kernel kernel_for(enum zt_isa isa, enum zt_mode mode) {
  if (mode == ZT_W4A16)
    return isa >= ZT_ISA_AVX512 ? zt_w4a16_avx512 : zt_w4a16_avx2;
  return isa == ZT_ISA_AMX           ? zt_da8w4_amx
         : isa == ZT_ISA_AVX512_VNNI ? zt_da8w4_avx512_vnni
         : isa == ZT_ISA_AVX512      ? zt_da8w4_avx512
                                     : zt_da8w4_avx2;
}

/* The operands of expert e of matrix mt, read from the layer's params now (nothing is cached). */
static int resolve(const struct zt_backend *b, qkeep_layer *layer, const struct qkeep_layer_info *info,
                   const struct zt_matrix *mt, int64_t e, struct zt_gemm *g, const int32_t **perm,
                   const void **bias, enum qkeep_dtype *bias_dtype) {
  char name[64];
  struct qkeep_view v;
  int64_t words = mt->k / 8 * mt->n;
  int rc = operand_view(b, layer, info->name, pname(name, sizeof name, mt, mt->codes_name), QKEEP_DTYPE_I32,
                        mt->experts * words, &v);
  if (rc)
    return rc;
  g->codes = (const int32_t *)v.data + e * words;
  if ((rc = operand_view(b, layer, info->name, pname(name, sizeof name, mt, mt->scales_name), -1,
                         mt->experts * mt->groups * mt->n, &v)))
    return rc;
  if (v.spec.dtype != mt->scale_dtype)
    return b->host->set_error(QKEEP_E_STATE, "%s.%s: dtype changed since PWAL", info->name, name);
  g->scales =
      (const unsigned char *)v.data + (size_t)(e * mt->groups * mt->n) * qkeep_be_dtype_size(v.spec.dtype);
  g->zeros = NULL;
  if (!mt->sym) {
    if ((rc = operand_view(b, layer, info->name, pname(name, sizeof name, mt, mt->zeros_name),
                           QKEEP_DTYPE_I32, mt->experts * mt->groups * (mt->n / 8), &v)))
      return rc;
    g->zeros = (const int32_t *)v.data + e * mt->groups * (mt->n / 8);
  }
  *perm = NULL;
  if (mt->act_order) {
    if ((rc = operand_view(b, layer, info->name, pname(name, sizeof name, mt, mt->g_idx_name),
                           QKEEP_DTYPE_I32, mt->experts * mt->k, &v)))
      return rc;
    *perm = (const int32_t *)v.data + e * mt->k;
  }
  *bias = NULL;
  v.size = sizeof v;
  if (b->host->view(layer, pname(name, sizeof name, mt, "bias"), &v) == 0 && v.state == QKEEP_PARAM_LIVE) {
    size_t es = qkeep_be_dtype_size(v.spec.dtype);
    if (v.nbytes < (size_t)(mt->experts * mt->n) * es)
      return b->host->set_error(QKEEP_E_STATE, "%s.%s: %zu bytes, expected %lld per expert", info->name, name,
                                v.nbytes, (long long)mt->n);
    *bias = (const unsigned char *)v.data + (size_t)(e * mt->n) * es;
    *bias_dtype = v.spec.dtype;
  }
  g->m = 0;
  g->n = mt->n;
  g->k = mt->k;
  g->groups = mt->groups;
  g->scale_dtype = mt->scale_dtype;
  return 0;
}

/* Scratch of one apply: activations in kernel order and their da8w4 or w4a16 operands, an f32 output. */
struct scratch {
  float *x, *xsumf, *xscale, *y;
  int32_t *xq, *xsum;
  int8_t *xq_tiles; /* AMX: xq in K slices (zentorch.h) */
};

static void scratch_free(struct scratch *s) {
  free(s->x), free(s->xsumf), free(s->xscale), free(s->y), free(s->xq), free(s->xsum), free(s->xq_tiles);
}

/* Row r of the activations in kernel order (permuted, widened to f32) and its da8w4 or w4a16 operands. */
static void prepare_row(const struct scratch *s, const struct zt_gemm *g, const struct qkeep_apply_args *a,
                        const int32_t *perm, bool own_x, bool da8w4, int64_t r) {
  int64_t k = g->k;
  if (own_x)
    for (int64_t i = 0; i < k; i++)
      s->x[r * k + i] = qkeep_load_float(a->x, a->x_dtype, (size_t)(r * k + (perm ? perm[i] : i)));
  const float *row = g->x + r * k;
  if (da8w4) {
    zt_quantise_row(row, k, g->groups, s->xq + r * (k / 4), s->xsum + r * g->groups, s->xscale + r);
    if (s->xq_tiles)
      zt_amx_pack_row(s->xq + r * (k / 4), k, zt_amx_kstep(k / g->groups), g->xq_rows, r, s->xq_tiles);
  } else
    zt_group_sums(row, k, g->groups, s->xsumf + r * g->groups);
}

/* Bias and the output dtype for rows [m0, m1) of column block blk (the kernel wrote f32 into g->y). */
static void finish_tile(const struct zt_gemm *g, const struct qkeep_apply_args *a, const void *bias,
                        enum qkeep_dtype bias_dtype, bool own_y, int64_t m0, int64_t m1, int64_t blk) {
  int64_t n = g->n, c0 = blk * ZT_BLOCK_N, c1 = c0 + ZT_BLOCK_N < n ? c0 + ZT_BLOCK_N : n;
  for (int64_t r = m0; r < m1; r++)
    for (int64_t j = c0; j < c1; j++) {
      float v = g->y[r * n + j] + (bias ? qkeep_load_float(bias, bias_dtype, (size_t)j) : 0.0f);
      if (own_y)
        ((uint16_t *)a->y)[r * n + j] = qkeep_f32_to_bf16(v);
      else
        g->y[r * n + j] = v;
    }
}

static int run(struct zt_backend *b, const struct qkeep_layer_info *info, struct zt_gemm *g,
               const int32_t *perm, const void *bias, enum qkeep_dtype bias_dtype,
               const struct qkeep_apply_args *a) {
  int64_t m = a->m, n = g->n, k = g->k;
  struct scratch s = {0};
  bool da8w4 = b->mode == ZT_DA8W4, own_x = perm || a->x_dtype != QKEEP_DTYPE_F32,
       own_y = a->y_dtype != QKEEP_DTYPE_F32;
  if (own_x)
    s.x = malloc((size_t)(m * k) * sizeof *s.x);
  if (own_y)
    s.y = malloc((size_t)(m * n) * sizeof *s.y);
  /* AMX: the activations also in K slices of whole tiles, zero rows after m (zentorch.h). */
  bool amx = da8w4 && b->isa == ZT_ISA_AMX && m >= ZT_AMX_MIN_ROWS;
  int64_t xq_rows = (m + ZT_AMX_PAD_ROWS - 1) / ZT_AMX_PAD_ROWS * ZT_AMX_PAD_ROWS;
  if (da8w4) {
    s.xq = malloc((size_t)(m * k / 4) * sizeof *s.xq);
    if (amx)
      s.xq_tiles = calloc((size_t)(xq_rows * k), 1);
    s.xsum = malloc((size_t)(m * g->groups) * sizeof *s.xsum);
    s.xscale = malloc((size_t)m * sizeof *s.xscale);
  } else {
    s.xsumf = malloc((size_t)(m * g->groups) * sizeof *s.xsumf);
  }
  if ((own_x && !s.x) || (own_y && !s.y) || (da8w4 ? !s.xq || !s.xsum || !s.xscale : !s.xsumf) ||
      (amx && !s.xq_tiles)) {
    scratch_free(&s);
    return b->host->set_error(QKEEP_E_NOMEM, "%s: out of memory for %lld rows of activations", info->name,
                              (long long)m);
  }
  const float *x = own_x ? s.x : a->x;
  float *y = own_y ? s.y : a->y;
  g->m = m;
  g->x = x;
  g->xsumf = s.xsumf;
  g->xq = s.xq;
  g->xq_tiles = s.xq_tiles;
  g->xq_rows = xq_rows;
  g->xsum = s.xsum;
  g->xscale = s.xscale;
  g->y = y;
  zt_kernel kernel = kernel_for(b->isa, b->mode);
  int64_t blocks = (n + ZT_BLOCK_N - 1) / ZT_BLOCK_N, chunk = 64, chunks = (m + chunk - 1) / chunk;
  int threads = b->threads > 0 ? b->threads : omp_get_max_threads();
  bool epilogue = bias || own_y;
  /* Few rows: the activations take less time than a barrier, so they are prepared before the
   * one parallel loop; many rows: in parallel, behind one barrier. */
  bool parallel_prep = m >= 16;
  if (!parallel_prep)
    for (int64_t r = 0; r < m; r++)
      prepare_row(&s, g, a, perm, own_x, da8w4, r);
#pragma omp parallel num_threads(threads)
  {
    if (parallel_prep) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < m; r++)
        prepare_row(&s, g, a, perm, own_x, da8w4, r);
    }
#pragma omp for collapse(2) schedule(static)
    for (int64_t c = 0; c < chunks; c++)
      for (int64_t blk = 0; blk < blocks; blk++) {
        int64_t m0 = c * chunk, m1 = (c + 1) * chunk < m ? (c + 1) * chunk : m;
        kernel(g, m0, m1, blk, blk + 1);
        if (epilogue)
          finish_tile(g, a, bias, bias_dtype, own_y, m0, m1, blk);
      }
  }
  scratch_free(&s);
  return 0;
}

/* One matrix with native dtypes (f32 or bf16 in and out). */
static int zentorch_native(struct zt_backend *b, qkeep_layer *layer, const struct qkeep_layer_info *info,
                           const struct zt_layer *st, const struct qkeep_apply_args *a, int32_t expert,
                           enum qkeep_moe_matrix matrix) {
  const struct zt_matrix *mt = &st->mat[st->n_mat == 2 && matrix == QKEEP_MOE_W2];
  if (expert < 0 || expert >= mt->experts)
    return b->host->set_error(QKEEP_E_INVAL, "%s: expert %lld of %lld", info->name, (long long)expert,
                              (long long)mt->experts);
  if (a->m == 0)
    return 0;
  struct zt_gemm g = {0};
  const int32_t *perm = NULL;
  const void *bias = NULL;
  enum qkeep_dtype bias_dtype = QKEEP_DTYPE_F32;
  int rc = resolve(b, layer, info, mt, expert, &g, &perm, &bias, &bias_dtype);
  return rc ? rc : run(b, info, &g, perm, bias, bias_dtype, a);
}

/* What the f32 kernel of one staged apply needs besides its arguments. */
struct zt_call {
  struct zt_backend *b;
  qkeep_layer *layer;
  const struct qkeep_layer_info *info;
  const struct zt_layer *st;
};

/* One matrix in f32 (qkeep_be_f32_kernel), for F16 activations and routed MoE. */
static int zentorch_kernel(void *user, int32_t expert, enum qkeep_moe_matrix matrix, int64_t m, const float *x,
                           float *y) {
  const struct zt_call *c = user;
  struct qkeep_apply_args f32 = {.size = sizeof f32,
                                 .m = m,
                                 .x = x,
                                 .x_dtype = QKEEP_DTYPE_F32,
                                 .y = y,
                                 .y_dtype = QKEEP_DTYPE_F32,
                                 .expert = expert,
                                 .matrix = matrix};
  return zentorch_native(c->b, c->layer, c->info, c->st, &f32, expert, matrix);
}

/* Whether a runs on the native f32/bf16 path (else through qkeep_be_f32_apply's staging). */
static bool zentorch_native_args(const struct qkeep_apply_args *a) {
  bool x_ok = a->x_dtype == QKEEP_DTYPE_F32 || a->x_dtype == QKEEP_DTYPE_BF16,
       y_ok = a->y_dtype == QKEEP_DTYPE_F32 || a->y_dtype == QKEEP_DTYPE_BF16;
  return x_ok && y_ok && qkeep_be_topk(a) <= 0;
}

static int zentorch_workspace(const struct qkeep_backend *be, qkeep_layer *layer,
                              const struct qkeep_apply_args *a, size_t *bytes) {
  struct qkeep_layer_info info = {.size = sizeof info};
  int rc = zt_of(be)->host->layer_info(layer, &info);
  if (!rc)
    *bytes = zentorch_native_args(a) ? 0 : qkeep_be_f32_workspace(a, qkeep_be_dims(&info, a));
  return rc;
}

static int zentorch_apply(const struct qkeep_backend *be, qkeep_layer *layer,
                          const struct qkeep_apply_args *a) {
  struct zt_backend *b = zt_of(be);
  struct qkeep_layer_info info = {.size = sizeof info};
  int rc = b->host->layer_info(layer, &info);
  if (rc)
    return rc;
  struct zt_layer *st = b->host->get_state(layer);
  if (!st || !st->n_mat)
    return b->host->set_error(QKEEP_E_STATE,
                              "%s: cpu-zentorch has no kernel for this layer (PWAL did not run)", info.name);
  if (a->size < offsetof(struct qkeep_apply_args, expert) || a->m < 0)
    return b->host->set_error(QKEEP_E_INVAL, "%s: cpu-zentorch: arguments of an ABI 1.0 core, or m < 0",
                              info.name);
  if (!zentorch_native_args(a)) {
    struct zt_call call = {b, layer, &info, st};
    return qkeep_be_f32_apply(b->host, &info, a, zentorch_kernel, &call);
  }
  /* Slots past args->size are absent: expert 0, w13. */
  bool has_expert = a->size >= offsetof(struct qkeep_apply_args, matrix) + sizeof a->matrix;
  return zentorch_native(b, layer, &info, st, a, has_expert ? a->expert : 0,
                         has_expert ? a->matrix : QKEEP_MOE_W13);
}

static int zentorch_device(const struct qkeep_backend *be, enum qkeep_device_type *type, int *index) {
  (void)be;
  *type = QKEEP_DEVICE_HOST, *index = 0;
  return 0;
}

/* ---- lifetime ---------------------------------------------------------------------------------------- */

static void zentorch_layer_cleanup(const struct qkeep_backend *be, qkeep_layer *layer, void *state) {
  (void)be;
  (void)layer;
  free(state);
}

static void zentorch_fini(const struct qkeep_backend *be) { free((void *)be); }

QKEEP_BACKEND_EXPORT int qkeep_backend_init(const struct qkeep_host *host, const struct qkeep_backend **out) {
  if (!host || host->abi_major != QKEEP_BACKEND_ABI_MAJOR)
    return QKEEP_E_ABI;
  struct zt_backend *b = calloc(1, sizeof *b);
  if (!b)
    return host->set_error(QKEEP_E_NOMEM, "cpu-zentorch: out of memory");
  b->host = host;
  b->cpu_isa = b->isa = cpu_isa();
  const char *env = getenv("QKEEP_ZENTORCH_MAX_ISA");
  if (env) {
    enum zt_isa cap;
    if (isa_of_name(env, &cap)) {
      free(b);
      return host->set_error(QKEEP_E_CONFIG,
                             "cpu-zentorch: QKEEP_ZENTORCH_MAX_ISA=%s: expected avx2, avx512, "
                             "avx512_vnni or amx",
                             env);
    }
    if (cap < b->isa)
      b->isa = cap;
  }
  b->be = (struct qkeep_backend){
      .size = sizeof(struct qkeep_backend),
      .abi_major = QKEEP_BACKEND_ABI_MAJOR,
      .abi_minor = 0,
      .name = "cpu-zentorch",
      .description = "int4 GPTQ/AWQ linear and MoE layers on the zentorch layout (w4a16, da8w4; AVX2, "
                     "AVX-512, VNNI, AMX)",
      .probe = zentorch_probe,
      .configure = zentorch_configure,
      .memory = NULL,
      .supports = zentorch_supports,
      .pwal = zentorch_pwal,
      .apply = zentorch_apply,
      .layer_cleanup = zentorch_layer_cleanup,
      .fini = zentorch_fini,
      .supports_layer = zentorch_supports_layer,
      .keys = zentorch_keys,
      .n_keys = sizeof zentorch_keys / sizeof zentorch_keys[0],
      .key_size = sizeof zentorch_keys[0],
      .workspace = zentorch_workspace,
      .device = zentorch_device,
      .flags = QKEEP_BACKEND_F_ROUTED_MOE,
  };
  *out = &b->be;
  return 0;
}
