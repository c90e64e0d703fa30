/*
 * scheme/ct_int4.c: 4-bit int weights as compressed-tensors writes them
 * (format pack-quantized: the W4A16 / W4A8 "*-quantized.w4a16" family, GPTQ or
 * RTN). weight_packed i32 [N, K/8]: eight codes per word along K, element j at
 * bits 4j, each stored as q + 8 (q in [-8, 7]); weight_scale [N, K/G] in the
 * model's dtype (G = K per channel); weight_shape i64 [2] = [N, K];
 * weight_zero_point i32 [N/8, K/G], packed the same way along N, only when
 * asymmetric; weight_g_idx i32 [K] only for actorder "group". w = (code -
 * zero code) x scale, zero code 8 when symmetric. Fused shards stack along N;
 * weight_shape is kept per shard ([S, 2]) and checked against the layer's dims
 * after loading, then retired with its bytes, as no kernel reads it.
 */
#include <stdlib.h>
#include <string.h>

#include "scheme/scheme.h"
#include "scheme/shard_plan.h"

static const struct param_template ct_int4_params[] = {
    {"weight_packed", DT(I32), 2, {D_N, D_K_8}, F_ROWS, false, false, false, false, 0},
    {"weight_scale", DT_FLOAT, 2, {D_N, D_K_G}, F_ROWS, false, true, false, false, 15},
    {"weight_shape", DT(I64), 1, {D_2}, F_STACKED, false, false, false, false, 0},
    {"weight_zero_point", DT(I32), 2, {D_N_8, D_K_G}, F_ROWS, true, false, false, false, 0},
    {"weight_g_idx", DT(I32), 1, {D_K}, F_SHARED, true, false, false, false, 0},
    {"bias", DT_FLOAT, 1, {D_N}, F_ROWS, true, false, false, false, 0},
};

/* N and K from weight_packed [N, K/8], G from weight_scale [N, K/G]; the optional tensors as the config says.
 */
static int ct_int4_dims(const struct module *m, const struct quant_config *qc, int64_t *n, int64_t *k,
                        int64_t *g) {
  const struct ckpt_tensor *w = module_tensor(m, "weight_packed"), *s = module_tensor(m, "weight_scale");
  if (!w || !s || w->t->dtype != QKEEP_DTYPE_I32)
    return set_error(QKEEP_E_NOTFOUND, "no int32 weight_packed and weight_scale");
  if (w->t->ndim != 2 || s->t->ndim != 2 || s->t->shape[0] != w->t->shape[0] || s->t->shape[1] < 1)
    return set_error(QKEEP_E_FORMAT,
                     "%s: tensor '%s': expected weight_packed [N, K/8] with weight_scale [N, K/G]",
                     w->file->path, w->t->name);
  *n = w->t->shape[0];
  int rc = packed_dim(w, 1, 8, k);
  if (rc)
    return rc;
  if (*k % s->t->shape[1])
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': %lld groups do not divide K = %lld", s->file->path,
                     s->t->name, (long long)s->t->shape[1], (long long)*k);
  *g = *k / s->t->shape[1];
  if (qc && qc->method == QM_CT_INT4 && (qc->group_size ? qc->group_size : *k) != *g)
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': group size %lld, the config says %s%lld",
                     s->file->path, s->t->name, (long long)*g, qc->group_size ? "" : "per channel, K = ",
                     (long long)(qc->group_size ? qc->group_size : *k));
  bool sym = !qc || qc->weight_sym, act_order = qc && qc->desc_act;
  const struct ckpt_tensor *zp = module_tensor(m, "weight_zero_point"),
                           *gi = module_tensor(m, "weight_g_idx");
  if (!sym && !zp)
    return set_error(QKEEP_E_FORMAT, "checkpoint has no tensor '%s.weight_zero_point' (asymmetric weights)",
                     m->name);
  if (sym && zp)
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': zero points in a symmetric checkpoint", zp->file->path,
                     zp->t->name);
  if (act_order != (gi != NULL))
    return set_error(QKEEP_E_FORMAT, "module %s: %s (the config's actorder is %s)", m->name,
                     gi ? "weight_g_idx is present" : "weight_g_idx is missing",
                     act_order ? "group" : "not group");
  if (zp && *n % 8)
    return set_error(QKEEP_E_FORMAT, "module %s: N = %lld is not a multiple of 8 (packed zero points)",
                     m->name, (long long)*n);
  return 0;
}

/* weight_shape must say [N_s, K] for every shard (and expert); then no kernel needs it. */
static int check_and_retire_shape(qkeep_layer *layer, const char *prefix) {
  char name[64];
  qkeep_param *p = qkeep_param_lookup(layer, prefixed(name, sizeof name, prefix, "weight_shape"));
  if (!p || p->state == QKEEP_PARAM_RETIRED)
    return 0;
  bool w2 = strcmp(prefix, "w2_") == 0;
  int shards = w2 ? 1 : (int)layer->dims.shards, experts = layer->dims.experts ? (int)layer->dims.experts : 1;
  /* weight_shape states the full matrix: a tensor-parallel rank compares the unsharded dims (shard_plan.c) */
  int64_t k = w2 ? shard_full_n(layer) / 2 : shard_full_k(layer);
  size_t count = (size_t)experts * (size_t)shards * 2;
  if (qkeep_spec_bytes(&p->create_spec) != count * sizeof(int64_t))
    return set_error(QKEEP_E_FORMAT, "%s.%s: %zu bytes for %d experts x %d shards", layer->name, name,
                     qkeep_spec_bytes(&p->create_spec), experts, shards);
  int64_t *stated = malloc(count * sizeof *stated);
  int rc = stated ? dev_d2h(layer_device(layer), stated, tensor_ptr(&p->view), count * sizeof(int64_t))
                  : set_error(QKEEP_E_NOMEM, "out of memory");
  for (int e = 0; !rc && e < experts; e++)
    for (int s = 0; !rc && s < shards; s++) {
      int64_t n = w2 ? shard_full_k(layer) : shard_full_shard_n(layer, s);
      const int64_t *v = stated + ((size_t)e * (size_t)shards + (size_t)s) * 2;
      if (v[0] != n || v[1] != k)
        rc = set_error(QKEEP_E_FORMAT,
                       "%s.%s (expert %d, shard %d): weight_shape [%lld, %lld], but the packed tensors are "
                       "[%lld, %lld] (only K a multiple of 8 is supported)",
                       layer->name, name, e, s, (long long)v[0], (long long)v[1], (long long)n, (long long)k);
    }
  free(stated);
  return rc ? rc : qkeep_retire(layer, name);
}

/* weight_shape checked and retired; an act-order weight_g_idx names groups of its matrix. */
static int ct_int4_matrix(qkeep_layer *layer, const char *prefix) {
  char name[64];
  int rc = check_and_retire_shape(layer, prefix);
  return rc ? rc
            : check_group_index(layer, prefixed(name, sizeof name, prefix, "weight_g_idx"),
                                layer->dims.group_size);
}

static int ct_int4_normalize(qkeep_layer *layer) { return for_each_matrix(layer, ct_int4_matrix); }

static uint32_t ct_int4_flags(const struct quant_config *qc) {
  uint32_t f = 0;
  if (!qc || qc->weight_sym)
    f |= QKEEP_LAYER_F_WEIGHT_SYM;
  if (qc && qc->desc_act)
    f |= QKEEP_LAYER_F_ACT_ORDER;
  if (qc && qc->input_dynamic)
    f |= QKEEP_LAYER_F_INPUT_DYNAMIC;
  return f;
}

const struct scheme scheme_ct_int4 = {
    .name = "ct-int4",
    .params = ct_int4_params,
    .n_params = sizeof ct_int4_params / sizeof ct_int4_params[0],
    .dims = ct_int4_dims,
    .normalize = ct_int4_normalize,
    .flags = ct_int4_flags,
};
