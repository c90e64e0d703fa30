/*
 * scheme/kv.c: kv-cache scales. Every attention block has k_scale and
 * v_scale (scalars: F32 [] from ModelOpt, [1] in the model's dtype from
 * compressed-tensors, kept as loaded); a checkpoint without them gets f32 placeholders, which
 * normalisation sets as vLLM does: 1.0 when neither was loaded, the loaded
 * one's value for the other when only one was. Loaded bytes are never changed.
 */
#include "base/formats.h"
#include "scheme/scheme.h"

/* A loaded scale's value as f32 (it may be F32, BF16 or F16: exact either way). */
static int read_scalar(qkeep_layer *layer, const char *name, float *out) {
  qkeep_param *p = qkeep_param_lookup(layer, name);
  unsigned char raw[4];
  int rc = dev_d2h(layer_device(layer), raw, tensor_ptr(&p->view), qkeep_dtype_size(p->view.spec.dtype));
  if (!rc)
    *out = qk_load_float(raw, p->view.spec.dtype, 0);
  return rc;
}

static int kv_normalize(qkeep_layer *layer) {
  bool k = param_was_loaded(layer, "k_scale"), v = param_was_loaded(layer, "v_scale");
  float value = 1.0f;
  int rc = 0;
  if (k && v)
    return 0;
  if (k || v)
    rc = read_scalar(layer, k ? "k_scale" : "v_scale", &value);
  if (!rc && !k)
    rc = fill_f32(layer, "k_scale", value);
  if (!rc && !v)
    rc = fill_f32(layer, "v_scale", value);
  return rc;
}

const struct scheme scheme_kv_scales = {
    .name = "kv-scales",
    .normalize = kv_normalize,
};
