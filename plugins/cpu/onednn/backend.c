/*
 * backend.c: the `cpu-onednn` backend's table: init and fini, configure,
 * probe, supports, PWAL under the rules, apply, and per-layer cleanup.
 *
 * Schemes: w8a8-int8 (per-channel or per-tensor weight scales; activations
 * dynamic per token or static, symmetric or asymmetric) and unquantized (f32,
 * bf16; f16 is converted to f32), for linear and MoE layers. What PWAL leaves
 * behind, per weight matrix ("" for a linear layer, "w13_" and "w2_" for MoE):
 *
 *   weight                 the packed weights as 1-D [bytes / element] ([E, ...]
 *                          for MoE) in the kernel's dtype, replaced into the
 *                          param's own storage; rebound (larger) only when the
 *                          packed layout pads N or K past it (not multiples of
 *                          64 on AVX-512) or 16-bit weights run as f32
 *   azp_adj                int8: buffer i32 [E?, N], sum_k q_w[n, k]
 *   weight_scale_channel   int8: buffer f32 [E?, N] when the checkpoint's
 *                          scales are not f32 per channel (per tensor, per
 *                          fused shard, or 16-bit); weight_scale is then
 *                          retired, its bytes kept for a reload
 *   weight_packed          a tied lm_head in a dtype oneDNN cannot read as is
 *                          (f16; bf16 without AVX-512): buffer, packed f32
 *
 * A tied lm_head is never repacked: its weight is the embedding's param,
 * which the embedding reads as rows. It runs unpacked, straight from the
 * embedding's [N, K] storage.
 *
 * Config ([backend.cpu-onednn]): threads = N (OpenMP threads for PWAL and
 * apply; default OpenMP's), int8_without_vnni = 7bit | refuse (onednn.h).
 * Environment: QKEEP_ONEDNN_MAX_ISA=avx2 (or another oneDNN ISA name) lowers
 * oneDNN's ISA before it generates code, e.g. to simulate a CPU without VNNI.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "onednn.h"
#include "qkeep/qkeep_backend_util.h"

static struct od_backend *od_of(const struct qkeep_backend *be) { return (struct od_backend *)be; }

/* "<prefix><name>" into buf. */
static const char *pname(char *buf, size_t len, const struct od_matrix *mt, const char *name) {
  snprintf(buf, len, "%s%s", mt->prefix, name);
  return buf;
}

/* ---- configuration and probing ----------------------------------------------------------- */

static bool int8_refused(const struct od_backend *b) {
  return !b->vnni && b->without_vnni == OD_WITHOUT_VNNI_REFUSE;
}

static int refusal(const struct od_backend *b, const char *layer) {
  return b->host->set_error(QKEEP_E_UNSUPPORTED,
                            "%s: cpu-onednn refuses w8a8-int8 on this CPU: oneDNN's ISA is %s, without "
                            "AVX-512 VNNI, where oneDNN 2.6 sums u8 x s8 products in saturating int16 and "
                            "gives wrong results for full-range int8 (int8_without_vnni = refuse; set it to "
                            "7bit to run with 7-bit activations, or use the reference backend)",
                            layer, b->isa_name);
}

static int onednn_probe(const struct qkeep_backend *be, char *msg, size_t msg_len) {
  const struct od_backend *b = od_of(be);
  const dnnl_version_t *v = dnnl_version();
  if (msg_len)
    snprintf(msg, msg_len, "oneDNN %d.%d.%d on %s; w8a8-int8: %s; bf16: %s", v->major, v->minor, v->patch,
             b->isa_name,
             b->vnni           ? "VNNI, 8-bit activations"
             : int8_refused(b) ? "refused (no VNNI; int8_without_vnni = refuse)"
                               : "no VNNI, 7-bit activations (int8_without_vnni = 7bit)",
             b->bf16 ? "native" : "converted to f32");
  return 0;
}

static int onednn_configure(const struct qkeep_backend *be, const char *key, const char *value) {
  struct od_backend *b = od_of(be);
  if (strcmp(key, "threads") == 0)
    return qkeep_be_int_key(b->host, key, value, 1, 4096, &b->threads);
  if (strcmp(key, "int8_without_vnni") == 0) {
    if (strcmp(value, "7bit") == 0)
      b->without_vnni = OD_WITHOUT_VNNI_7BIT;
    else if (strcmp(value, "refuse") == 0)
      b->without_vnni = OD_WITHOUT_VNNI_REFUSE;
    else
      return b->host->set_error(QKEEP_E_CONFIG, "int8_without_vnni = '%s': expected 7bit or refuse", value);
    return 0;
  }
  return b->host->set_error(QKEEP_E_CONFIG, "unknown key '%s' (cpu-onednn takes threads, int8_without_vnni)",
                            key);
}

static const struct qkeep_backend_key onednn_keys[] = {
    {"threads", QKEEP_KEY_INT, "1..4096", "all online cores",
     "worker threads for oneDNN and the int8 kernels"},
    {"int8_without_vnni", QKEEP_KEY_ENUM, "7bit|refuse", "7bit",
     "without AVX-512 VNNI: exact 7-bit activations (7bit), or leave w8a8-int8 layers to the next backend"},
};

/* Linear and MoE layers of w8a8-int8 and unquantized f32/bf16/f16; every other kind lives in host memory. */
static int onednn_supports_layer(const struct qkeep_backend *be, const struct qkeep_layer_info *info,
                                 char *reason, size_t reason_len) {
  const struct od_backend *b = od_of(be);
  if (info->kind != QKEEP_LAYER_LINEAR && info->kind != QKEEP_LAYER_MOE)
    return 1;
  if (strcmp(info->scheme, "unquantized") == 0)
    return 1;
  if (strcmp(info->scheme, "w8a8-int8") != 0) {
    snprintf(reason, reason_len, "runs w8a8-int8 and unquantized layers, not %s", info->scheme);
    return 0;
  }
  if (int8_refused(b)) {
    snprintf(reason, reason_len,
             "w8a8-int8 refused: no AVX-512 VNNI on this CPU, where oneDNN 2.6 int8 products saturate "
             "(int8_without_vnni = refuse)");
    return 0;
  }
  return 1;
}

/* The ABI 1.0 form, for cores that do not know supports_layer. */
static int onednn_supports(const struct qkeep_backend *be, const char *scheme, enum qkeep_layer_kind kind) {
  struct qkeep_layer_info info = {.size = sizeof info, .scheme = scheme, .kind = kind, .weight_dtype = -1};
  char reason[256];
  return onednn_supports_layer(be, &info, reason, sizeof reason);
}

/* ---- PWAL ----------------------------------------------------------------------------------- */

/* The param's view, which must be live and hold exactly the checkpoint's [E?, N, K] of a dtype in `dtypes`.
 */
static int checkpoint_weight(const struct od_backend *b, qkeep_layer *layer,
                             const struct qkeep_layer_info *info, const struct od_matrix *mt, uint32_t dtypes,
                             struct qkeep_view *w) {
  char name[64];
  w->size = sizeof *w;
  int rc = b->host->view(layer, pname(name, sizeof name, mt, "weight"), w);
  if (rc)
    return rc;
  bool moe = info->kind == QKEEP_LAYER_MOE;
  const struct qkeep_spec *s = &w->spec;
  bool ok = w->state == QKEEP_PARAM_LIVE && (dtypes & (1u << s->dtype)) && s->ndim == (moe ? 3 : 2) &&
            (!moe || s->shape[0] == mt->experts) && s->shape[moe] == mt->n && s->shape[moe + 1] == mt->k;
  if (!ok)
    return b->host->set_error(
        QKEEP_E_STATE,
        "%s.%s: not the checkpoint's [%s%lld, %lld] weights (ndim %d, state %d): PWAL runs on "
        "a freshly loaded or reloaded layer",
        info->name, name, moe ? "E, " : "", (long long)mt->n, (long long)mt->k, s->ndim, (int)w->state);
  return 0;
}

/* A spec [E, count] for MoE, [count] for a linear layer. */
static struct qkeep_spec per_expert_spec(const struct od_matrix *mt, bool moe, enum qkeep_dtype dtype,
                                         int64_t count) {
  struct qkeep_spec s = {.dtype = dtype, .ndim = moe ? 2 : 1};
  s.shape[0] = moe ? mt->experts : count;
  s.shape[1] = moe ? count : 0;
  return s;
}

/* The sum of the k int8 values at w. SSE2 (every x86-64): each byte biased to unsigned (x ^ 0x80 = x + 128),
 * summed 16 at a time by _mm_sad_epu8 into two 64-bit lanes, the bias taken off at the end; the compiler does
 * not vectorise the widening sum at -O2, and a reload of w8a8 weights spent a fifth of its PWAL here. */
static int32_t row_sum(const int8_t *w, int64_t k) {
  int64_t sum = 0, i = 0;
#if defined(__SSE2__)
  const __m128i bias = _mm_set1_epi8((char)0x80), zero = _mm_setzero_si128();
  __m128i acc = zero;
  for (; i + 16 <= k; i += 16)
    acc = _mm_add_epi64(acc,
                        _mm_sad_epu8(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(w + i)), bias), zero));
  int64_t lanes[2];
  _mm_storeu_si128((__m128i *)lanes, acc);
  sum = lanes[0] + lanes[1] - 128 * i;
#endif
  for (; i < k; i++)
    sum += w[i];
  return (int32_t)sum;
}

/* azp_adj[e, n] = sum_k q_w[e, n, k]: the zero-point correction, from the plain weights. */
static int int8_colsums(const struct od_backend *b, qkeep_layer *layer, bool moe, const struct od_matrix *mt,
                        const int8_t *w) {
  char name[64];
  struct qkeep_spec spec = per_expert_spec(mt, moe, QKEEP_DTYPE_I32, mt->n);
  struct qkeep_view adj = {.size = sizeof adj};
  int rc = b->host->add_buffer(layer, pname(name, sizeof name, mt, "azp_adj"), &spec, &adj);
  if (rc)
    return rc;
  int32_t *out = adj.data;
  for (int64_t r = 0; r < mt->experts * mt->n; r++)
    out[r] = row_sum(w + r * mt->k, mt->k);
  return 0;
}

/*
 * The int8 weight scales as f32 per channel. Per-channel f32 [E?, N, 1] is read
 * as is. Anything else (one per fused shard [S] / [E, S], one per tensor [],
 * [1] / [E], or 16-bit per channel) is expanded into the buffer
 * weight_scale_channel and weight_scale retired: its checkpoint bytes stay,
 * for a reload to restore and expand again.
 */
static int int8_scales(const struct od_backend *b, qkeep_layer *layer, const struct qkeep_layer_info *info,
                       struct od_matrix *mt) {
  char name[64];
  struct qkeep_view s = {.size = sizeof s};
  int rc = b->host->view(layer, pname(name, sizeof name, mt, "weight_scale"), &s);
  if (rc)
    return rc;
  bool moe = info->kind == QKEEP_LAYER_MOE, w2 = moe && strcmp(mt->prefix, "w2_") == 0;
  int64_t count = qkeep_be_spec_numel(&s.spec) / mt->experts;
  int shards = w2 ? 1 : info->shards;
  if (s.state != QKEEP_PARAM_LIVE || !qkeep_be_dtype_size(s.spec.dtype) || s.spec.dtype > QKEEP_DTYPE_BF16 ||
      qkeep_be_spec_numel(&s.spec) % mt->experts || (count != mt->n && count != shards && count != 1))
    return b->host->set_error(QKEEP_E_FORMAT,
                              "%s.%s: %lld scales per matrix, expected %lld (per channel), %d or 1",
                              info->name, name, (long long)count, (long long)mt->n, shards);
  mt->scales_in_buffer = !(count == mt->n && s.spec.dtype == QKEEP_DTYPE_F32);
  if (!mt->scales_in_buffer)
    return 0;
  struct qkeep_spec spec = per_expert_spec(mt, moe, QKEEP_DTYPE_F32, mt->n);
  struct qkeep_view out = {.size = sizeof out};
  char buf_name[64];
  if ((rc = b->host->add_buffer(layer, pname(buf_name, sizeof buf_name, mt, "weight_scale_channel"), &spec,
                                &out)))
    return rc;
  float *channel = out.data;
  for (int64_t e = 0; e < mt->experts; e++) {
    int shard = 0;
    int64_t shard_end = w2 ? mt->n : info->shard_n[0];
    for (int64_t r = 0; r < mt->n; r++) {
      while (r >= shard_end && shard + 1 < shards)
        shard_end += info->shard_n[++shard];
      int64_t idx = count == mt->n ? r : count > 1 ? shard : 0;
      channel[e * mt->n + r] = qkeep_load_float(s.data, s.spec.dtype, (size_t)(e * count + idx));
    }
  }
  return b->host->retire(layer, name);
}

/*
 * Static asymmetric activations: the zero points must be s8 values (the
 * int32 correction zp * azp_adj is bounded by that). The scheme's
 * normalisation has already merged the fused shards' (and an MoE expert's
 * gate/up) zero points into one per matrix and expert.
 */
static int int8_static_zero_points(const struct od_backend *b, qkeep_layer *layer,
                                   const struct qkeep_layer_info *info, const struct od_matrix *mt) {
  char name[64];
  struct qkeep_view z = {.size = sizeof z};
  if (b->host->view(layer, pname(name, sizeof name, mt, "input_zero_point"), &z) != 0)
    return 0;
  if (qkeep_be_spec_numel(&z.spec) != mt->experts)
    return b->host->set_error(QKEEP_E_FORMAT, "%s.%s: %lld zero points, expected one per expert (merged)",
                              info->name, name, (long long)qkeep_be_spec_numel(&z.spec));
  for (int64_t i = 0; i < mt->experts; i++) {
    int32_t zi = z.spec.dtype == QKEEP_DTYPE_I8 ? ((const int8_t *)z.data)[i] : ((const int32_t *)z.data)[i];
    if (zi < -128 || zi > 127)
      return b->host->set_error(QKEEP_E_FORMAT, "%s.%s: zero point %d is not an int8 value", info->name, name,
                                zi);
  }
  return 0;
}

/*
 * Packs every expert's weight (plain_bytes each, of dtype dt, from the checkpoint view at `from`)
 * into one result of `spec`, then replaces the weight with it: into the param's own storage when
 * it fits, so a reload packs in place.
 */
static int pack_and_replace(struct od_backend *b, qkeep_layer *layer, struct od_layer *st,
                            struct od_matrix *mt, enum qkeep_dtype dt, const void *from, size_t plain_bytes,
                            const struct qkeep_spec *spec) {
  qkeep_tensor *t;
  int rc = b->host->tensor_new(layer, spec, &t);
  if (rc)
    return rc;
  unsigned char *packed = b->host->tensor_data(t);
  for (int64_t e = 0; !rc && e < mt->experts; e++)
    rc = od_pack(b, st->stream, mt, dt, (const unsigned char *)from + (size_t)e * plain_bytes,
                 packed + (size_t)e * mt->wbytes);
  if (rc) {
    b->host->tensor_free(t);
    return rc;
  }
  char name[64];
  return b->host->replace(layer, pname(name, sizeof name, mt, "weight"), t);
}

static int pwal_int8(struct od_backend *b, qkeep_layer *layer, const struct qkeep_layer_info *info,
                     struct od_layer *st, struct od_matrix *mt) {
  struct qkeep_view w;
  bool moe = info->kind == QKEEP_LAYER_MOE;
  int rc = checkpoint_weight(b, layer, info, mt, 1u << QKEEP_DTYPE_I8, &w);
  if (rc)
    return rc;
  /* |sum (u - zp) q_w| <= 255 * 128 * K must fit the s32 accumulator. */
  if (mt->k > 65536)
    return b->host->set_error(QKEEP_E_UNSUPPORTED, "%s: K = %lld: int8 accumulation in s32 needs K <= 65536",
                              info->name, (long long)mt->k);
  mt->compute = OD_INT8;
  mt->store = OD_IN_WEIGHT;
  if ((rc = od_matrix_prepare(b, mt, QKEEP_DTYPE_I8, false)) ||
      (rc = int8_colsums(b, layer, moe, mt, w.data)) || (rc = int8_scales(b, layer, info, mt)) ||
      (rc = int8_static_zero_points(b, layer, info, mt)))
    return rc;
  struct qkeep_spec spec = per_expert_spec(mt, moe, QKEEP_DTYPE_I8, (int64_t)mt->wbytes);
  return pack_and_replace(b, layer, st, mt, QKEEP_DTYPE_I8, w.data, (size_t)(mt->n * mt->k), &spec);
}

static int pwal_float(struct od_backend *b, qkeep_layer *layer, const struct qkeep_layer_info *info,
                      struct od_layer *st, struct od_matrix *mt) {
  struct qkeep_view w;
  bool moe = info->kind == QKEEP_LAYER_MOE, tied = (info->flags & QKEEP_LAYER_F_TIED) != 0;
  uint32_t floats = (1u << QKEEP_DTYPE_F32) | (1u << QKEEP_DTYPE_BF16) | (1u << QKEEP_DTYPE_F16);
  int rc = checkpoint_weight(b, layer, info, mt, floats, &w);
  if (rc)
    return rc;
  enum qkeep_dtype dt = w.spec.dtype;
  /* bf16 runs natively where oneDNN has a bf16 matmul; f16 (and bf16 elsewhere) is converted to f32. */
  mt->compute = dt == QKEEP_DTYPE_BF16 && b->bf16 ? OD_BF16 : OD_F32;
  bool native = dt == (mt->compute == OD_BF16 ? QKEEP_DTYPE_BF16 : QKEEP_DTYPE_F32);
  if (tied && native) {
    /* The embedding's param, which the embedding reads as rows: never repacked. */
    mt->store = OD_PLAIN;
    return od_matrix_prepare(b, mt, dt, true);
  }
  if ((rc = od_matrix_prepare(b, mt, dt, false)))
    return rc;
  enum qkeep_dtype kernel_dt = mt->compute == OD_BF16 ? QKEEP_DTYPE_BF16 : QKEEP_DTYPE_F32;
  struct qkeep_spec spec =
      per_expert_spec(mt, moe, kernel_dt, (int64_t)(mt->wbytes / qkeep_be_dtype_size(kernel_dt)));
  size_t plain_bytes = (size_t)(mt->n * mt->k) * qkeep_be_dtype_size(dt);
  if (tied) {
    struct qkeep_view buf = {.size = sizeof buf};
    mt->store = OD_BUFFER;
    rc = b->host->add_buffer(layer, "weight_packed", &spec, &buf);
    return rc ? rc : od_pack(b, st->stream, mt, dt, w.data, buf.data);
  }
  mt->store = OD_IN_WEIGHT;
  return pack_and_replace(b, layer, st, mt, dt, w.data, plain_bytes, &spec);
}

/* The layer's state, created on the first PWAL; a later PWAL (reload) frees its primitives. */
static int layer_state(struct od_backend *b, qkeep_layer *layer, struct od_layer **out) {
  struct od_layer *st = b->host->get_state(layer);
  if (!st) {
    st = calloc(1, sizeof *st);
    if (!st)
      return b->host->set_error(QKEEP_E_NOMEM, "cpu-onednn: out of memory for layer state");
    pthread_mutex_init(&st->lock, NULL);
    b->host->set_state(layer, st);
  }
  for (int i = 0; i < 2; i++) {
    od_matrix_release(&st->mat[i]);
    st->mat[i] = (struct od_matrix){0};
  }
  dnnl_status_t s =
      st->stream ? dnnl_success : dnnl_stream_create(&st->stream, b->engine, dnnl_stream_default_flags);
  if (s != dnnl_success)
    return od_fail(b, QKEEP_E_DEVICE, s, "creating a stream");
  *out = st;
  return 0;
}

static int onednn_pwal(const struct qkeep_backend *be, qkeep_layer *layer) {
  struct od_backend *b = od_of(be);
  struct qkeep_layer_info info = {.size = sizeof info};
  int rc = b->host->layer_info(layer, &info);
  if (rc)
    return rc;
  if (info.kind != QKEEP_LAYER_LINEAR && info.kind != QKEEP_LAYER_MOE)
    return 0; /* embeddings, norms, kv scales: read as loaded */
  bool int8 = strcmp(info.scheme, "w8a8-int8") == 0, moe = info.kind == QKEEP_LAYER_MOE;
  if (!int8 && strcmp(info.scheme, "unquantized") != 0)
    return b->host->set_error(QKEEP_E_UNSUPPORTED, "%s: cpu-onednn has no kernel for scheme %s", info.name,
                              info.scheme);
  if (int8 && int8_refused(b))
    return refusal(b, info.name);
  struct od_layer *st = NULL;
  if ((rc = layer_state(b, layer, &st)))
    return rc;
  st->flags = info.flags;
  st->n_mat = moe ? 2 : 1;
  st->mat[0] = (struct od_matrix){.n = info.n, .k = info.k, .experts = moe ? info.experts : 1};
  snprintf(st->mat[0].prefix, sizeof st->mat[0].prefix, "%s", moe ? "w13_" : "");
  if (moe) {
    st->mat[1] = (struct od_matrix){.n = info.k, .k = info.n / 2, .experts = info.experts};
    snprintf(st->mat[1].prefix, sizeof st->mat[1].prefix, "w2_");
  }
  int saved = od_threads_begin(b);
  for (int i = 0; !rc && i < st->n_mat; i++)
    rc = int8 ? pwal_int8(b, layer, &info, st, &st->mat[i]) : pwal_float(b, layer, &info, st, &st->mat[i]);
  od_threads_end(b, saved);
  return rc;
}

/* ---- apply ---------------------------------------------------------------------------------- */

/* A live param or buffer's data at element `offset` of `elem` bytes, checked to hold `count` more. */
static int operand(const struct od_backend *b, qkeep_layer *layer, const struct qkeep_layer_info *info,
                   const char *name, size_t offset, size_t count, size_t elem, struct qkeep_view *v,
                   const void **out) {
  v->size = sizeof *v;
  int rc = b->host->view(layer, name, v);
  if (rc)
    return rc;
  if (v->state != QKEEP_PARAM_LIVE || (offset + count) * elem > v->nbytes)
    return b->host->set_error(QKEEP_E_STATE, "%s.%s: %zu bytes (state %d), the kernel reads %zu", info->name,
                              name, v->nbytes, (int)v->state, (offset + count) * elem);
  *out = (const unsigned char *)v->data + offset * elem;
  return 0;
}

/* Static activations: the expert's input scale (merged over fused shards by the scheme; F32, or the
 * model's BF16 / F16, widened exactly) and its zero point. */
static int static_act(const struct od_backend *b, qkeep_layer *layer, const struct qkeep_layer_info *info,
                      const struct od_matrix *mt, int64_t expert, struct od_act *act) {
  char name[64];
  struct qkeep_view v = {.size = sizeof v};
  int rc = b->host->view(layer, pname(name, sizeof name, mt, "input_scale"), &v);
  if (rc)
    return rc;
  if (v.spec.dtype > QKEEP_DTYPE_BF16 || qkeep_be_spec_numel(&v.spec) != mt->experts)
    return b->host->set_error(QKEEP_E_FORMAT, "%s.%s: expected one float input scale per expert (merged)",
                              info->name, name);
  act->static_scale = qkeep_load_float(v.data, v.spec.dtype, (size_t)expert);
  act->static_zero = 0;
  if (act->asym && b->host->view(layer, pname(name, sizeof name, mt, "input_zero_point"), &v) == 0) {
    int64_t at = expert * (qkeep_be_spec_numel(&v.spec) / mt->experts);
    act->static_zero =
        v.spec.dtype == QKEEP_DTYPE_I8 ? ((const int8_t *)v.data)[at] : ((const int32_t *)v.data)[at];
  }
  return 0;
}

/* Resolves what the kernel of matrix mt, expert e, reads. */
static int operands(const struct od_backend *b, qkeep_layer *layer, const struct qkeep_layer_info *info,
                    const struct od_layer *st, const struct od_matrix *mt, int64_t e,
                    struct od_operands *op) {
  char name[64];
  struct qkeep_view v;
  const void *p;
  *op = (struct od_operands){0};
  bool plain = mt->store == OD_PLAIN;
  const char *weights = mt->store == OD_BUFFER ? "weight_packed" : pname(name, sizeof name, mt, "weight");
  int rc = operand(b, layer, info, weights, plain ? 0 : (size_t)e, 1,
                   plain ? (size_t)(mt->n * mt->k) : mt->wbytes, &v, &op->weights);
  if (rc)
    return rc;
  if (plain && v.nbytes != (size_t)(mt->n * mt->k) * (mt->compute == OD_BF16 ? 2 : 4))
    return b->host->set_error(QKEEP_E_STATE, "%s.weight: the tied weight changed dtype since PWAL",
                              info->name);
  v.size = sizeof v;
  if (b->host->view(layer, pname(name, sizeof name, mt, "bias"), &v) == 0 && v.state == QKEEP_PARAM_LIVE) {
    size_t es = qkeep_be_dtype_size(v.spec.dtype);
    if ((rc = operand(b, layer, info, name, (size_t)(e * mt->n), (size_t)mt->n, es, &v, &op->bias)))
      return rc;
    op->bias_dtype = v.spec.dtype;
  }
  if (mt->compute != OD_INT8)
    return 0;
  const char *scales =
      pname(name, sizeof name, mt, mt->scales_in_buffer ? "weight_scale_channel" : "weight_scale");
  if ((rc = operand(b, layer, info, scales, (size_t)(e * mt->n), (size_t)mt->n, sizeof(float), &v, &p)))
    return rc;
  op->scale = p;
  if ((rc = operand(b, layer, info, pname(name, sizeof name, mt, "azp_adj"), (size_t)(e * mt->n),
                    (size_t)mt->n, sizeof(int32_t), &v, &p)))
    return rc;
  op->azp_adj = p;
  op->act = (struct od_act){.dynamic = (st->flags & QKEEP_LAYER_F_INPUT_DYNAMIC) != 0,
                            .asym = (st->flags & QKEEP_LAYER_F_INPUT_ASYM) != 0,
                            .levels = b->vnni ? 255 : 127};
  return op->act.dynamic ? 0 : static_act(b, layer, info, mt, e, &op->act);
}

/* What the f32 kernel of one apply needs besides its arguments. */
struct od_call {
  struct od_backend *b;
  qkeep_layer *layer;
  const struct qkeep_layer_info *info;
  struct od_layer *st;
};

/* One matrix in f32 through oneDNN (qkeep_be_f32_kernel). */
static int onednn_kernel(void *user, int32_t expert, enum qkeep_moe_matrix matrix, int64_t m, const float *x,
                         float *y) {
  const struct od_call *call = user;
  struct od_layer *st = call->st;
  struct od_matrix *mt = &st->mat[st->n_mat == 2 && matrix == QKEEP_MOE_W2];
  if (expert < 0 || expert >= mt->experts)
    return call->b->host->set_error(QKEEP_E_INVAL, "%s: expert %lld of %lld", call->info->name,
                                    (long long)expert, (long long)mt->experts);
  struct od_operands op;
  int rc = operands(call->b, call->layer, call->info, st, mt, expert, &op);
  if (rc)
    return rc;
  pthread_mutex_lock(&st->lock);
  rc = od_apply(call->b, st, mt, &op, m, x, y);
  pthread_mutex_unlock(&st->lock);
  return rc;
}

static int onednn_workspace(const struct qkeep_backend *be, qkeep_layer *layer, const struct qkeep_apply_args *a,
                            size_t *bytes) {
  struct qkeep_layer_info info = {.size = sizeof info};
  int rc = od_of(be)->host->layer_info(layer, &info);
  if (!rc)
    *bytes = qkeep_be_f32_workspace(a, qkeep_be_dims(&info, a));
  return rc;
}

/* f32 kernels; other activation dtypes and routed MoE through qkeep_be_f32_apply's staging. */
static int onednn_apply(const struct qkeep_backend *be, qkeep_layer *layer,
                        const struct qkeep_apply_args *a) {
  struct od_backend *b = od_of(be);
  struct qkeep_layer_info info = {.size = sizeof info};
  int rc = b->host->layer_info(layer, &info);
  if (rc)
    return rc;
  struct od_layer *st = b->host->get_state(layer);
  if (!st || !st->n_mat)
    return b->host->set_error(QKEEP_E_STATE, "%s: cpu-onednn has no kernel for this layer (PWAL did not run)",
                              info.name);
  if (a->m < 0)
    return b->host->set_error(QKEEP_E_INVAL, "%s: m %lld", info.name, (long long)a->m);
  struct od_call call = {b, layer, &info, st};
  return qkeep_be_f32_apply(b->host, &info, a, onednn_kernel, &call);
}

static int onednn_device(const struct qkeep_backend *be, enum qkeep_device_type *type, int *index) {
  (void)be;
  *type = QKEEP_DEVICE_HOST, *index = 0;
  return 0;
}

/* ---- lifetime ----------------------------------------------------------------------------- */

static void onednn_layer_cleanup(const struct qkeep_backend *be, qkeep_layer *layer, void *state) {
  (void)be;
  (void)layer;
  struct od_layer *st = state;
  if (!st)
    return;
  od_layer_release(st);
  pthread_mutex_destroy(&st->lock);
  free(st);
}

static void onednn_fini(const struct qkeep_backend *be) {
  struct od_backend *b = od_of(be);
  od_engine_fini(b);
  free(b);
}

QKEEP_BACKEND_EXPORT int qkeep_backend_init(const struct qkeep_host *host, const struct qkeep_backend **out) {
  if (!host || host->abi_major != QKEEP_BACKEND_ABI_MAJOR)
    return QKEEP_E_ABI;
  struct od_backend *b = calloc(1, sizeof *b);
  if (!b)
    return host->set_error(QKEEP_E_NOMEM, "cpu-onednn: out of memory");
  b->host = host;
  int rc = od_engine_init(b);
  if (rc) {
    od_engine_fini(b);
    free(b);
    return rc;
  }
  b->be = (struct qkeep_backend){
      .size = sizeof(struct qkeep_backend),
      .abi_major = QKEEP_BACKEND_ABI_MAJOR,
      .abi_minor = 0,
      .name = "cpu-onednn",
      .description =
          "oneDNN 2.6 on the host CPU: w8a8-int8 (packed s8 weights in place) and f32/bf16 linear layers",
      .probe = onednn_probe,
      .configure = onednn_configure,
      .memory = NULL,
      .supports = onednn_supports,
      .pwal = onednn_pwal,
      .apply = onednn_apply,
      .layer_cleanup = onednn_layer_cleanup,
      .fini = onednn_fini,
      .supports_layer = onednn_supports_layer,
      .keys = onednn_keys,
      .n_keys = sizeof onednn_keys / sizeof onednn_keys[0],
      .key_size = sizeof onednn_keys[0],
      .workspace = onednn_workspace,
      .device = onednn_device,
      .flags = QKEEP_BACKEND_F_ROUTED_MOE,
  };
  *out = &b->be;
  return 0;
}
