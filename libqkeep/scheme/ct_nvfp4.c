/*
 * scheme/ct_nvfp4.c: NVFP4 as compressed-tensors writes it (nvfp4-pack-quantized):
 * weight_packed, weight_scale, and global scales stored as encode factors
 * (2688/amax), the inverse of ModelOpt's. Normalisation aliases
 * weight_packed as weight (one object, two names) and merges the global
 * scales by max of the stored values, as vLLM does; kernels invert them.
 */
#include "scheme/scheme.h"

static const struct param_template ct_params[] = {
    {"weight_packed", DT(U8), 2, {D_N, D_K_2}, F_ROWS, false, false, false, false, 0},
    {"weight_scale", DT(F8_E4M3), 2, {D_N, D_K_16}, F_ROWS, false, true, false, false, 0},
    {"weight_global_scale", DT(F32), 0, {D_ONE}, F_SLOT, false, true, false, true, 2688},
    {"input_global_scale", DT(F32), 0, {D_ONE}, F_SLOT, true, true, true, true, 2688},
    {"bias", DT_FLOAT, 1, {D_N}, F_ROWS, true, false, false, false, 0},
};

static int ct_dims(const struct module *m, const struct quant_config *qc, int64_t *n, int64_t *k,
                   int64_t *g) {
  (void)qc;
  return nvfp4_dims(m, "weight_packed", n, k, g);
}

static int ct_normalize_matrix(qkeep_layer *layer, const char *prefix) {
  char src[64], dst[64], name[64];
  int rc = qkeep_move(layer, prefixed(src, sizeof src, prefix, "weight_packed"),
                      prefixed(dst, sizeof dst, prefix, "weight"));
  if (!rc)
    rc = merge_shard_scales_max(layer, prefixed(name, sizeof name, prefix, "weight_global_scale"));
  if (!rc)
    rc = merge_shard_scales_max(layer, prefixed(name, sizeof name, prefix, "input_global_scale"));
  return rc;
}

static int ct_normalize(qkeep_layer *layer) { return for_each_matrix(layer, ct_normalize_matrix); }

const struct scheme scheme_ct_nvfp4 = {
    .name = "ct-nvfp4",
    .params = ct_params,
    .n_params = sizeof ct_params / sizeof ct_params[0],
    .dims = ct_dims,
    .normalize = ct_normalize,
};
