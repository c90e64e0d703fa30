/*
 * scheme/w8a8_int8.c: int8 weights and activations (compressed-tensors
 * int-quantized). weight i8 [N, K]; weight_scale per channel [N, 1] or per
 * tensor (one per fused shard, kept as [S] for the kernel to expand); static
 * activations add input_scale (and input_zero_point when asymmetric), merged
 * across fused shards and, for MoE, across each expert's gate/up slots (scale
 * by max, zero point must agree): [S] -> [], [E, 2] -> [E]. compressed-tensors
 * writes every scale in the model's dtype (BF16 / F16, [1] per tensor), so all
 * three accept F32, F16 and BF16, kept as loaded; kernels widen them.
 */
#include "scheme/scheme.h"

static const struct param_template channel_params[] = {
    {"weight", DT(I8), 2, {D_N, D_K}, F_ROWS, false, false, false, false, 0},
    {"weight_scale", DT_FLOAT, 2, {D_N, D_ONE}, F_ROWS, false, true, false, false, 127},
    {"input_scale", DT_FLOAT, 0, {D_ONE}, F_SLOT, true, true, true, false, 255},
    {"input_zero_point", DT(I32) | DT(I8), 0, {D_ONE}, F_SLOT, true, false, false, false, 0},
    {"bias", DT_FLOAT, 1, {D_N}, F_ROWS, true, false, false, false, 0},
};

static const struct param_template tensor_params[] = {
    {"weight", DT(I8), 2, {D_N, D_K}, F_ROWS, false, false, false, false, 0},
    {"weight_scale", DT_FLOAT, 0, {D_ONE}, F_SLOT, false, true, false, false, 127},
    {"input_scale", DT_FLOAT, 0, {D_ONE}, F_SLOT, true, true, true, false, 255},
    {"input_zero_point", DT(I32) | DT(I8), 0, {D_ONE}, F_SLOT, true, false, false, false, 0},
    {"bias", DT_FLOAT, 1, {D_N}, F_ROWS, true, false, false, false, 0},
};

static const struct param_template *w8a8_templates(const struct quant_config *qc, size_t *n) {
  if (qc && qc->weight_per_tensor) {
    *n = sizeof tensor_params / sizeof tensor_params[0];
    return tensor_params;
  }
  *n = sizeof channel_params / sizeof channel_params[0];
  return channel_params;
}

static int w8a8_dims(const struct module *m, const struct quant_config *qc, int64_t *n, int64_t *k,
                     int64_t *g) {
  const struct ckpt_tensor *w = module_tensor(m, "weight"), *s = module_tensor(m, "weight_scale");
  if (!w || !s || w->t->dtype != QKEEP_DTYPE_I8)
    return set_error(QKEEP_E_NOTFOUND, "no int8 weight and weight_scale");
  if (w->t->ndim != 2)
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': expected a 2-D int8 weight", w->file->path,
                     w->t->name);
  if (qc && !qc->input_dynamic && !module_tensor(m, "input_scale"))
    return set_error(QKEEP_E_FORMAT, "%s: checkpoint has no tensor '%s.input_scale' (static activations)",
                     w->file->path, m->name);
  *n = w->t->shape[0];
  *k = w->t->shape[1];
  *g = 0;
  return 0;
}

/* Per matrix (w13_ and w2_ of an MoE, whose experts' gate/up slots merge like q/k/v's). */
static int w8a8_merge(qkeep_layer *layer, const char *prefix) {
  char name[64];
  int rc = merge_shard_scales_max(layer, prefixed(name, sizeof name, prefix, "input_scale"));
  return rc ? rc : merge_shard_equal_int(layer, prefixed(name, sizeof name, prefix, "input_zero_point"));
}

static int w8a8_normalize(qkeep_layer *layer) { return for_each_matrix(layer, w8a8_merge); }

static uint32_t w8a8_flags(const struct quant_config *qc) {
  uint32_t f = QKEEP_LAYER_F_WEIGHT_SYM;
  if (qc && qc->input_dynamic)
    f |= QKEEP_LAYER_F_INPUT_DYNAMIC;
  if (qc && !qc->input_sym)
    f |= QKEEP_LAYER_F_INPUT_ASYM;
  if (qc && qc->weight_per_tensor)
    f |= QKEEP_LAYER_F_WEIGHT_PER_TENSOR;
  return f;
}

const struct scheme scheme_w8a8_int8 = {
    .name = "w8a8-int8",
    .params = channel_params,
    .n_params = sizeof channel_params / sizeof channel_params[0],
    .templates_for = w8a8_templates,
    .dims = w8a8_dims,
    .normalize = w8a8_normalize,
    .flags = w8a8_flags,
};
