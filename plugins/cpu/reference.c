/*
 * reference.c: the `reference` backend. Portable C, every scheme qkeep reads;
 * its PWAL leaves params exactly as loaded (under the rules), and apply
 * dequantises to f32 and multiplies with double accumulation. It is the
 * oracle the other backends are tested against, so it favours clarity over
 * speed.
 */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "numeric.h"
#include "qkeep_backend.h"

struct reference {
  struct qkeep_backend be; /* first, so the core's pointer is ours */
  const struct qkeep_host *host;
};

static const struct qkeep_host *host_of(const struct qkeep_backend *be) {
  return ((const struct reference *)be)->host;
}

static int reference_probe(const struct qkeep_backend *be, char *msg, size_t msg_len) {
  (void)be;
  if (msg_len)
    strncpy(msg, "portable C on the host CPU", msg_len - 1), msg[msg_len - 1] = 0;
  return 0;
}

static int reference_configure(const struct qkeep_backend *be, const char *key, const char *value) {
  (void)value;
  return host_of(be)->set_error(QKEEP_E_CONFIG, "unknown key '%s' (the reference backend takes none)", key);
}

static int reference_supports(const struct qkeep_backend *be, const char *scheme, enum qkeep_layer_kind kind) {
  (void)be;
  return strcmp(scheme, "unquantized") == 0 && kind != QKEEP_LAYER_MOE;
}

/* The reference kernel reads the checkpoint layout, so PWAL changes nothing. */
static int reference_pwal(const struct qkeep_backend *be, qkeep_layer *layer) {
  (void)be;
  (void)layer;
  return 0;
}

/* Element i of a float tensor as f32. */
static float load_float(const void *data, enum qkeep_dtype dtype, size_t i) {
  switch (dtype) {
  case QKEEP_DTYPE_F32: return ((const float *)data)[i];
  case QKEEP_DTYPE_F16: return qk_f16_to_f32(((const uint16_t *)data)[i]);
  case QKEEP_DTYPE_BF16: return qk_bf16_to_f32(((const uint16_t *)data)[i]);
  default: return 0.0f;
  }
}

static bool float_dtype(enum qkeep_dtype d) {
  return d == QKEEP_DTYPE_F32 || d == QKEEP_DTYPE_F16 || d == QKEEP_DTYPE_BF16;
}

static int reference_apply(const struct qkeep_backend *be, qkeep_layer *layer, const struct qkeep_apply_args *a) {
  const struct qkeep_host *host = host_of(be);
  struct qkeep_layer_info info = {.size = sizeof info};
  struct qkeep_view w = {.size = sizeof w}, bias = {.size = sizeof bias};
  int rc = host->layer_info(layer, &info);
  if (rc)
    return rc;
  if (a->x_dtype != QKEEP_DTYPE_F32 || a->y_dtype != QKEEP_DTYPE_F32)
    return host->set_error(QKEEP_E_UNSUPPORTED, "%s: the reference kernel takes f32 activations", info.name);
  if ((rc = host->get_live(layer, "weight", &w)))
    return rc;
  if (!float_dtype(w.spec.dtype) || w.spec.ndim != 2 || w.spec.shape[0] != info.n || w.spec.shape[1] != info.k)
    return host->set_error(QKEEP_E_UNSUPPORTED, "%s: weight is not a float [%lld, %lld] tensor", info.name,
                           (long long)info.n, (long long)info.k);
  bool has_bias = host->view(layer, "bias", &bias) == 0 && bias.state == QKEEP_PARAM_LIVE;
  const float *x = a->x;
  float *y = a->y;
  for (int64_t m = 0; m < a->m; m++)
    for (int64_t n = 0; n < info.n; n++) {
      double acc = has_bias ? load_float(bias.data, bias.spec.dtype, (size_t)n) : 0.0;
      for (int64_t k = 0; k < info.k; k++)
        acc += (double)x[m * info.k + k] * load_float(w.data, w.spec.dtype, (size_t)(n * info.k + k));
      y[m * info.n + n] = (float)acc;
    }
  return 0;
}

static void reference_fini(const struct qkeep_backend *be) { free((void *)be); }

QKEEP_BACKEND_EXPORT int qkeep_backend_init(const struct qkeep_host *host, const struct qkeep_backend **out) {
  if (!host || host->abi_major != QKEEP_BACKEND_ABI_MAJOR)
    return QKEEP_E_ABI;
  struct reference *r = calloc(1, sizeof *r);
  if (!r)
    return host->set_error(QKEEP_E_NOMEM, "reference: out of memory");
  r->host = host;
  r->be = (struct qkeep_backend){
      .size = sizeof(struct qkeep_backend),
      .abi_major = QKEEP_BACKEND_ABI_MAJOR,
      .abi_minor = 0,
      .name = "reference",
      .description = "portable C reference kernels (dequantise + f32 GEMM); the test oracle",
      .probe = reference_probe,
      .configure = reference_configure,
      .memory = NULL,
      .supports = reference_supports,
      .pwal = reference_pwal,
      .apply = reference_apply,
      .layer_cleanup = NULL,
      .fini = reference_fini,
  };
  *out = &r->be;
  return 0;
}
