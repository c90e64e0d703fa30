/*
 * scheme_unquantized.c: bf16 / f16 / f32 checkpoints. Each tensor of a layer
 * becomes a loader param of the same name, dtype and shape. A 2-D `weight`
 * makes the layer a linear layer [N, K] (an embedding when the layer name
 * says so); anything else (norms, biases alone) is kept as-is for kernels.
 */
#include <string.h>

#include "internal.h"

static bool float_dtype(int dtype) {
  return dtype == QKEEP_DTYPE_F32 || dtype == QKEEP_DTYPE_F16 || dtype == QKEEP_DTYPE_BF16;
}

static bool is_embedding_name(const char *layer) {
  const char *last = strrchr(layer, '.');
  last = last ? last + 1 : layer;
  return strstr(last, "embed") != NULL || strcmp(last, "wte") == 0;
}

static int unquantized_create(qkeep_layer *layer, const struct st_tensor *const *tensors, const char *const *local,
                              size_t n) {
  const struct st_tensor *weight = NULL, *bias = NULL;
  for (size_t i = 0; i < n; i++) {
    const struct st_tensor *t = tensors[i];
    if (t->dtype < 0)
      return set_error(QKEEP_E_UNSUPPORTED, "tensor '%s': dtype %s is not supported by qkeep", t->name,
                       t->dtype_name);
    struct qkeep_spec spec = {.dtype = (enum qkeep_dtype)t->dtype, .ndim = t->ndim};
    memcpy(spec.shape, t->shape, sizeof spec.shape);
    qkeep_param *p;
    int rc = qkeep_param_create(layer, local[i], &spec, &p);
    if (!rc)
      rc = layer_add_source(layer, t->name, p, 0, &spec);
    if (rc)
      return rc;
    if (strcmp(local[i], "weight") == 0)
      weight = t;
    else if (strcmp(local[i], "bias") == 0)
      bias = t;
  }
  if (!weight || weight->ndim != 2)
    return 0;
  if (!float_dtype(weight->dtype))
    return set_error(QKEEP_E_FORMAT, "tensor '%s': dtype %s, expected BF16, F16 or F32 for an unquantized weight",
                     weight->name, weight->dtype_name);
  if (bias && (bias->ndim != 1 || bias->shape[0] != weight->shape[0] || !float_dtype(bias->dtype)))
    return set_error(QKEEP_E_FORMAT, "tensor '%s': expected a float bias of shape [%lld]", bias->name,
                     (long long)weight->shape[0]);
  layer->kind = is_embedding_name(layer->name) ? QKEEP_LAYER_EMBEDDING : QKEEP_LAYER_LINEAR;
  layer->dims.kind = layer->kind;
  layer->dims.n = weight->shape[0];
  layer->dims.k = weight->shape[1];
  layer->dims.shards = 1;
  layer->dims.shard_n[0] = weight->shape[0];
  return 0;
}

const struct scheme scheme_unquantized = {
    .name = "unquantized",
    .create = unquantized_create,
    .normalize = NULL,
};
