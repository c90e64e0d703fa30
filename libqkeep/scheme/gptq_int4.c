/*
 * scheme/gptq_int4.c: GPTQ int4 (AutoGPTQ / GPTQModel layout). qweight i32
 * [K/8, N] (8 k's per word, lowest k in the lowest nibble), scales f16
 * [K/G, N], qzeros i32 [K/G, N/8] (packed along N; v1 stores zero - 1),
 * g_idx i32 [K]. Fused shards sit side by side along N. Symmetric
 * checkpoints' zero points (always 8) and a trivial g_idx (no act order) are
 * retired with their bytes: no kernel reads them.
 */
#include "scheme/scheme.h"

static const struct param_template gptq_params[] = {
    {"qweight", DT(I32), 2, {D_K_8, D_N}, F_COLS, false, false, false, false, 0},
    {"qzeros", DT(I32), 2, {D_K_G, D_N_8}, F_COLS, false, false, false, false, 0},
    {"scales", DT(F16) | DT(BF16), 2, {D_K_G, D_N}, F_COLS, false, true, false, false, 15},
    {"g_idx", DT(I32), 1, {D_K}, F_SHARED, true, false, false, false, 0},
    {"bias", DT_FLOAT, 1, {D_N}, F_ROWS, true, false, false, false, 0},
};

/* Reads N, K and G from qweight [K/8, N] and scales [K/G, N]. */
int int4_group_dims(const struct module *m, const struct ckpt_tensor *scales, int64_t n, int64_t k,
                    const struct quant_config *qc, int64_t *g) {
  if (scales->t->ndim != 2 || scales->t->shape[0] < 1 || k % scales->t->shape[0])
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': %lld groups do not divide K = %lld",
                     scales->file->path, scales->t->name, (long long)scales->t->shape[0], (long long)k);
  *g = k / scales->t->shape[0];
  if (n % 8)
    return set_error(QKEEP_E_FORMAT, "module %s: N = %lld is not a multiple of 8 (packed zero points)",
                     m->name, (long long)n);
  if (qc && qc->group_size > 0 && *g != qc->group_size)
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': group size %lld, the config says %lld",
                     scales->file->path, scales->t->name, (long long)*g, (long long)qc->group_size);
  if (qc && qc->group_size == 0 && *g != k && qc->method != QM_NONE)
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': %lld groups, the config says one group per channel",
                     scales->file->path, scales->t->name, (long long)scales->t->shape[0]);
  return 0;
}

static int gptq_dims(const struct module *m, const struct quant_config *qc, int64_t *n, int64_t *k,
                     int64_t *g) {
  const struct ckpt_tensor *w = module_tensor(m, "qweight"), *s = module_tensor(m, "scales");
  if (!w || !s)
    return set_error(QKEEP_E_NOTFOUND, "no qweight and scales");
  if (w->t->ndim != 2)
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': expected qweight [K/8, N]", w->file->path, w->t->name);
  *n = w->t->shape[1];
  int rc = packed_dim(w, 0, 8, k);
  return rc ? rc : int4_group_dims(m, s, *n, *k, qc, g);
}

static int gptq_retire_unread(qkeep_layer *layer, const char *prefix) {
  char qzeros[64], g_idx[64];
  int rc = 0;
  prefixed(qzeros, sizeof qzeros, prefix, "qzeros");
  prefixed(g_idx, sizeof g_idx, prefix, "g_idx");
  if (layer->dims.flags & QKEEP_LAYER_F_WEIGHT_SYM)
    rc = qkeep_retire(layer, qzeros);
  if (!rc && !(layer->dims.flags & QKEEP_LAYER_F_ACT_ORDER) && qkeep_param_lookup(layer, g_idx))
    rc = qkeep_retire(layer, g_idx);
  if (!rc && (layer->dims.flags & QKEEP_LAYER_F_ACT_ORDER)) /* kernels index scales with it */
    rc = check_group_index(layer, g_idx, layer->dims.group_size);
  return rc;
}

static int gptq_normalize(qkeep_layer *layer) { return for_each_matrix(layer, gptq_retire_unread); }

static uint32_t gptq_flags(const struct quant_config *qc) {
  uint32_t f = 0;
  if (qc && qc->weight_sym)
    f |= QKEEP_LAYER_F_WEIGHT_SYM;
  if (qc && qc->desc_act)
    f |= QKEEP_LAYER_F_ACT_ORDER;
  if (qc && qc->gptq_v2)
    f |= QKEEP_LAYER_F_GPTQ_V2;
  return f;
}

const struct scheme scheme_gptq_int4 = {
    .name = "gptq-int4",
    .params = gptq_params,
    .n_params = sizeof gptq_params / sizeof gptq_params[0],
    .dims = gptq_dims,
    .normalize = gptq_normalize,
    .flags = gptq_flags,
};
