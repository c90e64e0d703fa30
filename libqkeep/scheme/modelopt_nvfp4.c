/*
 * scheme/modelopt_nvfp4.c: NVFP4 as ModelOpt exports it (docs/FORMATS.md, "modelopt-nvfp4").
 * weight u8 [N, K/2] (packed e2m1), weight_scale e4m3 [N, K/16] (linear,
 * not swizzled), weight_scale_2 f32 (= amax/2688, a decode factor) and
 * input_scale f32 per fused shard. Normalisation merges the per-shard global
 * scales by max into the prefix ([S] -> [], MoE [E, 2] -> [E]), as vLLM does.
 */
#include "scheme/scheme.h"

static const struct param_template modelopt_params[] = {
    {"weight", DT(U8), 2, {D_N, D_K_2}, F_ROWS, false, false, false, false, 0},
    {"weight_scale", DT(F8_E4M3), 2, {D_N, D_K_16}, F_ROWS, false, true, false, false, 0},
    {"weight_scale_2", DT(F32), 0, {D_ONE}, F_SLOT, false, true, false, false, 2688},
    {"input_scale", DT(F32), 0, {D_ONE}, F_SLOT, true, true, true, false, 2688},
    {"bias", DT_FLOAT, 1, {D_N}, F_ROWS, true, false, false, false, 0},
};

static int modelopt_dims(const struct module *m, const struct quant_config *qc, int64_t *n, int64_t *k,
                         int64_t *g) {
  (void)qc;
  return nvfp4_dims(m, "weight", n, k, g);
}

static int modelopt_merge(qkeep_layer *layer, const char *prefix) {
  char name[64];
  int rc = merge_shard_scales_max(layer, prefixed(name, sizeof name, prefix, "weight_scale_2"));
  return rc ? rc : merge_shard_scales_max(layer, prefixed(name, sizeof name, prefix, "input_scale"));
}

static int modelopt_normalize(qkeep_layer *layer) { return for_each_matrix(layer, modelopt_merge); }

const struct scheme scheme_modelopt_nvfp4 = {
    .name = "modelopt-nvfp4",
    .params = modelopt_params,
    .n_params = sizeof modelopt_params / sizeof modelopt_params[0],
    .dims = modelopt_dims,
    .normalize = modelopt_normalize,
};
