/*
 * skeleton.c: a minimal out-of-tree qkeep backend, built only against the
 * installed headers (pkg-config qkeep). It runs unquantized f32 linear layers
 * with a naive kernel, and shows the shape every backend has: one exported
 * init, a size-prefixed table, PWAL through the host's rule functions.
 */
#include <qkeep_backend.h>
#include <stdlib.h>
#include <string.h>

struct skeleton {
  struct qkeep_backend be;
  const struct qkeep_host *host;
};

static int skeleton_supports(const struct qkeep_backend *be, const char *scheme, enum qkeep_layer_kind kind) {
  (void)be;
  return strcmp(scheme, "unquantized") == 0 && kind == QKEEP_LAYER_LINEAR;
}

/* Nothing to convert: the kernel reads the checkpoint layout. A real backend
 * would repack here and call host->replace(layer, "weight", result). */
static int skeleton_pwal(const struct qkeep_backend *be, qkeep_layer *layer) {
  (void)be;
  (void)layer;
  return 0;
}

static int skeleton_apply(const struct qkeep_backend *be, qkeep_layer *layer,
                          const struct qkeep_apply_args *a) {
  const struct qkeep_host *host = ((const struct skeleton *)be)->host;
  struct qkeep_layer_info info = {.size = sizeof info};
  struct qkeep_view w = {.size = sizeof w};
  int rc = host->layer_info(layer, &info);
  if (!rc)
    rc = host->get_live(layer, "weight", &w);
  if (rc)
    return rc;
  if (w.spec.dtype != QKEEP_DTYPE_F32 || a->x_dtype != QKEEP_DTYPE_F32 || a->y_dtype != QKEEP_DTYPE_F32)
    return host->set_error(QKEEP_E_UNSUPPORTED, "%s: skeleton runs f32 only", info.name);
  const float *x = a->x, *wt = w.data;
  float *y = a->y;
  for (int64_t m = 0; m < a->m; m++)
    for (int64_t n = 0; n < info.n; n++) {
      float acc = 0;
      for (int64_t k = 0; k < info.k; k++)
        acc += x[m * info.k + k] * wt[n * info.k + k];
      y[m * info.n + n] = acc;
    }
  return 0;
}

static void skeleton_fini(const struct qkeep_backend *be) { free((void *)be); }

QKEEP_BACKEND_EXPORT int qkeep_backend_init(const struct qkeep_host *host, const struct qkeep_backend **out) {
  if (!host || host->abi_major != QKEEP_BACKEND_ABI_MAJOR)
    return QKEEP_E_ABI;
  struct skeleton *s = calloc(1, sizeof *s);
  if (!s)
    return QKEEP_E_NOMEM;
  s->host = host;
  s->be = (struct qkeep_backend){
      .size = sizeof(struct qkeep_backend),
      .abi_major = QKEEP_BACKEND_ABI_MAJOR,
      .abi_minor = 0,
      .name = "skeleton",
      .description = "out-of-tree example: naive f32 linear",
      .supports = skeleton_supports,
      .pwal = skeleton_pwal,
      .apply = skeleton_apply,
      .fini = skeleton_fini,
  };
  *out = &s->be;
  return 0;
}
