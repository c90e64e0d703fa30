/*
 * scheme/unquantized.c: bf16 / f16 / f32 linear layers. weight [N, K] and an
 * optional bias [N]; fused shards stack along N. Nothing to normalise.
 */
#include <string.h>

#include "scheme/scheme.h"

static const struct param_template unquantized_params[] = {
    {"weight", DT_FLOAT, 2, {D_N, D_K}, F_ROWS, false, false, false, false, 0},
    {"bias", DT_FLOAT, 1, {D_N}, F_ROWS, true, false, false, false, 0},
};

static int unquantized_dims(const struct module *m, const struct quant_config *qc, int64_t *n, int64_t *k,
                            int64_t *g) {
  (void)qc;
  const struct ckpt_tensor *w = module_tensor(m, "weight");
  if (!w || w->t->ndim != 2 || w->t->dtype < 0 || !(DT_FLOAT & (1u << w->t->dtype)))
    return set_error(QKEEP_E_NOTFOUND, "no float 2-D weight");
  for (size_t i = 0; i < m->n; i++)
    if (strcmp(m->local[i], "weight") != 0 && strcmp(m->local[i], "bias") != 0)
      return set_error(QKEEP_E_NOTFOUND, "extra tensor '%s'", m->local[i]);
  *n = w->t->shape[0];
  *k = w->t->shape[1];
  *g = 0;
  return 0;
}

const struct scheme scheme_unquantized = {
    .name = "unquantized",
    .params = unquantized_params,
    .n_params = sizeof unquantized_params / sizeof unquantized_params[0],
    .dims = unquantized_dims,
};
