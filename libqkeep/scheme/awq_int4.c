/*
 * scheme/awq_int4.c: AWQ int4, GEMM layout (AutoAWQ). qweight i32 [K, N/8]
 * packed along N in AWQ's order (nibble i holds column {0,2,4,6,1,3,5,7}[i]),
 * qzeros i32 [K/G, N/8] the same way (zeros stored as they are), scales f16
 * [K/G, N]. Without zero points (zero_point false) qzeros are retired.
 */
#include "scheme/scheme.h"

static const struct param_template awq_params[] = {
    {"qweight", DT(I32), 2, {D_K, D_N_8}, F_COLS, false, false, false, false, 0},
    {"qzeros", DT(I32), 2, {D_K_G, D_N_8}, F_COLS, false, false, false, false, 0},
    {"scales", DT(F16) | DT(BF16), 2, {D_K_G, D_N}, F_COLS, false, true, false, false, 15},
    {"bias", DT_FLOAT, 1, {D_N}, F_ROWS, true, false, false, false, 0},
};

static int awq_dims(const struct module *m, const struct quant_config *qc, int64_t *n, int64_t *k,
                    int64_t *g) {
  const struct ckpt_tensor *w = module_tensor(m, "qweight"), *s = module_tensor(m, "scales");
  if (!w || !s)
    return set_error(QKEEP_E_NOTFOUND, "no qweight and scales");
  int64_t packed_n = 0;
  if (w->t->ndim != 2 || s->t->ndim != 2 || packed_dim(w, 1, 8, &packed_n) || s->t->shape[1] != packed_n)
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': expected qweight [K, N/8] with scales [K/G, N]",
                     w->file->path, w->t->name);
  *k = w->t->shape[0];
  *n = s->t->shape[1];
  return int4_group_dims(m, s, *n, *k, qc, g);
}

static int awq_retire_zeros(qkeep_layer *layer, const char *prefix) {
  char qzeros[64];
  return (layer->dims.flags & QKEEP_LAYER_F_WEIGHT_SYM)
             ? qkeep_retire(layer, prefixed(qzeros, sizeof qzeros, prefix, "qzeros"))
             : 0;
}

static int awq_normalize(qkeep_layer *layer) { return for_each_matrix(layer, awq_retire_zeros); }

static uint32_t awq_flags(const struct quant_config *qc) {
  return qc && qc->weight_sym ? QKEEP_LAYER_F_WEIGHT_SYM : 0;
}

const struct scheme scheme_awq_int4 = {
    .name = "awq-int4",
    .params = awq_params,
    .n_params = sizeof awq_params / sizeof awq_params[0],
    .dims = awq_dims,
    .normalize = awq_normalize,
    .flags = awq_flags,
};
