/*
 * compare.c: the forward check. Runs every linear layer (and every MoE
 * expert's w13 and w2) of a model and of a reference model loaded from the
 * same checkpoint on the same random activations, and reports the largest
 * absolute and relative differences per layer.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

static uint64_t next_random(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/* Runs one GEMM on both layers and fills the error fields of e. */
static int compare_one(qkeep_layer *a, qkeep_layer *b, struct qkeep_layer_error *e, uint64_t *rng) {
  size_t x_bytes, y_bytes;
  if (!f32_matrix_bytes(e->m, e->k, &x_bytes) || !f32_matrix_bytes(e->m, e->n, &y_bytes))
    return set_error(
        QKEEP_E_INVAL,
        "forward check of layer %s: %lld rows of %lld inputs and %lld outputs do not fit in memory", e->layer,
        (long long)e->m, (long long)e->k, (long long)e->n);
  size_t xn = x_bytes / sizeof(float), yn = y_bytes / sizeof(float);
  float *x = malloc(x_bytes ? x_bytes : 1), *ya = malloc(y_bytes ? y_bytes : 1),
        *yb = malloc(y_bytes ? y_bytes : 1);
  int rc = x && ya && yb
               ? 0
               : set_error(QKEEP_E_NOMEM, "out of memory for the forward check of layer %s", e->layer);
  for (size_t i = 0; !rc && i < xn; i++)
    x[i] = (float)((next_random(rng) >> 40) * (2.0 / 16777216.0) - 1.0);
  bool moe = a->kind == QKEEP_LAYER_MOE;
  if (!rc)
    rc = moe ? qkeep_layer_apply_expert_f32(a, e->expert, e->matrix, e->m, x, ya)
             : qkeep_layer_apply_f32(a, e->m, x, ya);
  if (!rc)
    rc = moe ? qkeep_layer_apply_expert_f32(b, e->expert, e->matrix, e->m, x, yb)
             : qkeep_layer_apply_f32(b, e->m, x, yb);
  double max_abs = 0, max_ref = 0;
  for (size_t i = 0; !rc && i < yn; i++) {
    double d = fabs((double)ya[i] - (double)yb[i]);
    /* A NaN (in either output, or Inf - Inf) is the largest error and stays: no later element
     * may overwrite it, or a backend writing NaN would pass the check. */
    if (isnan(d) || d > max_abs)
      max_abs = isnan(max_abs) ? max_abs : d;
    if (fabs((double)yb[i]) > max_ref)
      max_ref = fabs((double)yb[i]);
  }
  e->max_abs = max_abs;
  e->max_rel = max_ref > 0 ? max_abs / max_ref : max_abs;
  free(x);
  free(ya);
  free(yb);
  return rc;
}

int qkeep_compare(qkeep_model *model, qkeep_model *reference, int64_t m, uint64_t seed,
                  int (*fn)(void *user, const struct qkeep_layer_error *e), void *user) {
  if (!model || !reference || m < 1 || !fn)
    return set_error(QKEEP_E_INVAL, "qkeep_compare: invalid argument");
  uint64_t rng = seed;
  for (size_t l = 0; l < model->n_layers; l++) {
    qkeep_layer *a = model->layers[l];
    if (a->kind != QKEEP_LAYER_LINEAR && a->kind != QKEEP_LAYER_MOE)
      continue;
    qkeep_layer *b = qkeep_model_find_layer(reference, a->name);
    if (!b || b->kind != a->kind || b->dims.n != a->dims.n || b->dims.k != a->dims.k)
      return set_error(QKEEP_E_STATE, "forward check: the reference model has no layer %s like the model's",
                       a->name);
    int experts = a->kind == QKEEP_LAYER_MOE ? (int)a->dims.experts : 1;
    for (int x = 0; x < experts; x++)
      for (int mat = 0; mat < (a->kind == QKEEP_LAYER_MOE ? 2 : 1); mat++) {
        struct qkeep_layer_error e = {.size = sizeof e,
                                      .layer = a->name,
                                      .scheme = a->scheme,
                                      .expert = a->kind == QKEEP_LAYER_MOE ? x : -1,
                                      .matrix = (enum qkeep_moe_matrix)mat,
                                      .m = m};
        e.n = mat ? a->dims.k : a->dims.n;
        e.k = mat ? a->dims.n / 2 : a->dims.k;
        int rc = compare_one(a, b, &e, &rng);
        if (!rc)
          rc = fn(user, &e);
        if (rc)
          return rc;
      }
  }
  return 0;
}
