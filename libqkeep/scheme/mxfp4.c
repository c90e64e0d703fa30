/*
 * scheme/mxfp4.c: OCP MXFP4 (e2m1 elements, e8m0 scales per 32 along K).
 * Two namings: compressed-tensors (weight_packed u8 [N, K/2], weight_scale
 * [N, K/32]; per-expert for MoE), aliased as weight; and gpt-oss's pre-stacked
 * MoE blocks (gate_up_proj_blocks [E, 2I, H/32, 16], *_scales, *_bias), aliased
 * as w13_weight / w2_weight with a [E, rows, K/2] view of the same bytes.
 */
#include <string.h>

#include "scheme/scheme.h"
#include "scheme/shard_plan.h"

static const struct param_template mxfp4_params[] = {
    {"weight_packed", DT(U8), 2, {D_N, D_K_2}, F_ROWS, false, false, false, false, 0},
    {"weight_scale", DT(U8) | DT(F8_E8M0), 2, {D_N, D_K_32}, F_ROWS, false, true, false, false, 0},
    {"bias", DT_FLOAT, 1, {D_N}, F_ROWS, true, false, false, false, 0},
};

static int mxfp4_dims(const struct module *m, const struct quant_config *qc, int64_t *n, int64_t *k,
                      int64_t *g) {
  (void)qc;
  const struct ckpt_tensor *w = module_tensor(m, "weight_packed"), *s = module_tensor(m, "weight_scale");
  if (!w || !s)
    return set_error(QKEEP_E_NOTFOUND, "no weight_packed and weight_scale");
  if (w->t->ndim != 2)
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': expected a 2-D packed weight", w->file->path,
                     w->t->name);
  *n = w->t->shape[0];
  *g = 32;
  int rc = packed_dim(w, 1, 2, k);
  if (rc)
    return rc;
  if (*k % 32)
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': K = %lld is not a multiple of the MXFP4 block 32",
                     w->file->path, w->t->name, (long long)*k);
  return 0;
}

/* gpt-oss names, checkpoint name -> runtime name. */
static const struct {
  const char *checkpoint, *runtime;
} gptoss_names[] = {
    {"gate_up_proj_blocks", "w13_weight"},   {"gate_up_proj_scales", "w13_weight_scale"},
    {"gate_up_proj_bias", "w13_bias"},       {"down_proj_blocks", "w2_weight"},
    {"down_proj_scales", "w2_weight_scale"}, {"down_proj_bias", "w2_bias"},
};

static int alias_matrix(qkeep_layer *layer, const char *prefix) {
  char src[64], dst[64];
  if (layer->kind == QKEEP_LAYER_MOE && qkeep_param_lookup(layer, "gate_up_proj_blocks")) {
    if (strcmp(prefix, "w2_") == 0)
      return 0; /* both matrices done on the w13 pass */
    for (size_t i = 0; i < sizeof gptoss_names / sizeof gptoss_names[0]; i++) {
      qkeep_param *p = qkeep_param_lookup(layer, gptoss_names[i].checkpoint);
      if (!p)
        continue;
      int rc = qkeep_move(layer, gptoss_names[i].checkpoint, gptoss_names[i].runtime);
      if (!rc && strstr(gptoss_names[i].checkpoint, "_blocks")) {
        /* [E, rows, K/32, 16] and [E, rows, K/2] are the same bytes. */
        struct qkeep_spec packed = p->create_spec;
        packed.ndim = 3;
        packed.shape[2] = p->create_spec.shape[2] * 16;
        rc = qkeep_replace_in_place(layer, gptoss_names[i].runtime, &packed);
      }
      if (rc)
        return rc;
    }
    return 0;
  }
  return qkeep_move(layer, prefixed(src, sizeof src, prefix, "weight_packed"),
                    prefixed(dst, sizeof dst, prefix, "weight"));
}

static int mxfp4_normalize(qkeep_layer *layer) { return for_each_matrix(layer, alias_matrix); }

const struct scheme scheme_mxfp4 = {
    .name = "mxfp4",
    .params = mxfp4_params,
    .n_params = sizeof mxfp4_params / sizeof mxfp4_params[0],
    .dims = mxfp4_dims,
    .normalize = mxfp4_normalize,
};

/* Checks one gpt-oss tensor's dtype and shape. */
static int expect(const struct ckpt_tensor *ct, uint32_t dtypes, int ndim, const int64_t *shape) {
  const struct st_tensor *t = ct->t;
  bool ok = t->dtype >= 0 && (dtypes & (1u << t->dtype)) && t->ndim == ndim;
  for (int i = 0; ok && i < ndim; i++)
    ok = t->shape[i] == shape[i];
  if (ok)
    return 0;
  struct qkeep_spec want = {.dtype = QKEEP_DTYPE_U8, .ndim = ndim},
                    got = {.dtype = QKEEP_DTYPE_U8, .ndim = t->ndim};
  char w[SHAPE_STR_LEN], g[SHAPE_STR_LEN];
  memcpy(want.shape, shape, sizeof(int64_t) * (size_t)ndim);
  memcpy(got.shape, t->shape, sizeof got.shape);
  return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': %s %s, expected %s (gpt-oss MXFP4 MoE)", ct->file->path,
                   t->name, t->dtype_name, spec_shape_str(&got, g, sizeof g),
                   spec_shape_str(&want, w, sizeof w));
}

int mxfp4_create_gptoss_moe(qkeep_layer *layer, const struct module *m) {
  const struct ckpt_tensor *gu = module_tensor(m, "gate_up_proj_blocks"),
                           *dn = module_tensor(m, "down_proj_blocks");
  if (!gu || !dn || gu->t->ndim != 4 || dn->t->ndim != 4)
    return set_error(QKEEP_E_FORMAT,
                     "module %s: gpt-oss MoE needs 4-D gate_up_proj_blocks and down_proj_blocks", m->name);
  int64_t e = gu->t->shape[0], i2 = gu->t->shape[1], h, inter, twice_inter = -1;
  int rc = packed_dim(gu, 2, 32, &h);
  if (!rc)
    rc = packed_dim(dn, 2, 32, &inter);
  if (rc)
    return rc;
  if (e < 1 || i2 < 1 || h < 1 || inter < 1)
    return set_error(QKEEP_E_FORMAT,
                     "%s: tensor '%s' (layer %s): %lld experts, N %lld, K %lld, down K %lld: a linear with a "
                     "zero dimension is refused",
                     gu->file->path, gu->t->name, layer->name, (long long)e, (long long)i2, (long long)h,
                     (long long)inter);
  const int64_t shapes[6][4] = {{e, i2, h / 32, 16},    {e, i2, h / 32},    {e, i2},
                                {e, h, inter / 32, 16}, {e, h, inter / 32}, {e, h}};
  const uint32_t dtypes[6] = {DT(U8), DT(U8) | DT(F8_E8M0), DT_FLOAT, DT(U8), DT(U8) | DT(F8_E8M0), DT_FLOAT};
  const int ndims[6] = {4, 3, 2, 4, 3, 2};
  if (!dim_mul(inter, 2, &twice_inter) || i2 != twice_inter)
    return set_error(QKEEP_E_FORMAT, "module %s: gate_up rows %lld are not twice the down input %lld",
                     m->name, (long long)i2, (long long)inter);
  for (size_t j = 0; j < m->n; j++) {
    size_t i = 0;
    while (i < 6 && strcmp(m->local[j], gptoss_names[i].checkpoint) != 0)
      i++;
    if (i == 6)
      return set_error(QKEEP_E_FORMAT, "%s: tensor '%s' is not part of a gpt-oss MXFP4 MoE block",
                       m->tensors[j]->file->path, m->tensors[j]->t->name);
    rc = expect(m->tensors[j], dtypes[i], ndims[i], shapes[i]);
    if (rc)
      return rc;
  }
  /* Tensor/expert parallel: each tensor's rank slice, all checked before any param exists (shard_plan.c). */
  for (size_t j = 0; j < m->n; j++) {
    const struct st_tensor *t = m->tensors[j]->t;
    struct qkeep_spec full = {.dtype = (enum qkeep_dtype)t->dtype, .ndim = t->ndim}, spec;
    memcpy(full.shape, t->shape, sizeof full.shape);
    struct slice cut;
    bool sliced;
    rc = shard_gptoss_tensor(layer, m->local[j], &full, &spec, &cut, &sliced);
    if (rc)
      return rc;
  }
  for (size_t j = 0; j < m->n; j++) {
    const struct st_tensor *t = m->tensors[j]->t;
    struct qkeep_spec full = {.dtype = (enum qkeep_dtype)t->dtype, .ndim = t->ndim}, spec;
    memcpy(full.shape, t->shape, sizeof full.shape);
    struct slice cut;
    bool sliced;
    qkeep_param *p;
    size_t bytes;
    rc = shard_gptoss_tensor(layer, m->local[j], &full, &spec, &cut, &sliced);
    if (!rc)
      rc = layer_param_create(layer, m->local[j], &spec, &p);
    if (!rc) {
      p->scale = strstr(m->local[j], "_scales") != NULL;
      bytes = qkeep_spec_bytes(&spec);
      rc = layer_add_source_slice(layer, t->name, p, 0, 1, bytes, bytes, false, &full, sliced ? &cut : NULL);
    }
    if (rc)
      return rc;
  }
  layer->dims.n = i2;
  layer->dims.k = h;
  layer->dims.experts = e;
  layer->dims.group_size = 32;
  layer->dims.shards = 2;
  layer->dims.shard_n[0] = layer->dims.shard_n[1] = inter;
  layer->dims.flags |= QKEEP_LAYER_F_INTERLEAVED_W13;
  shard_gptoss_dims(layer, e, i2, h, inter); /* the rank's dims when cut (shard_plan.c) */
  return 0;
}
