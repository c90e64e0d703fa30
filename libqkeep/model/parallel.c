/*
 * parallel.c: the model's tensor/expert-parallel place (qkeep_model_set_parallel) and what a
 * layer's cut reports (qkeep_layer_get_shard). How each matrix is cut is planned by the scheme
 * engine (scheme/shard_plan.c); a rank's slice of a tensor is read by load/slice.c.
 */
#include <string.h>

#include "model/model.h"

static int size_of(int size) { return size > 1 ? size : 1; }

int qkeep_model_set_parallel(qkeep_model *model, const struct qkeep_parallel *parallel) {
  if (!model || !parallel)
    return set_error(QKEEP_E_INVAL, "qkeep_model_set_parallel: NULL argument");
  if (model->n_layers)
    return set_error(QKEEP_E_STATE,
                     "qkeep_model_set_parallel: the model already holds %zu layers; set the "
                     "parallel place before loading",
                     model->n_layers);
  /* The caller's struct may be older (shorter): read only the size it states; absent fields are 0. */
  struct qkeep_parallel p = {0};
  memcpy(&p, parallel, parallel->size && parallel->size < sizeof p ? parallel->size : sizeof p);
  if (p.tp_size < 0 || p.ep_size < 0 || p.tp_rank < 0 || p.ep_rank < 0 || p.tp_rank >= size_of(p.tp_size) ||
      p.ep_rank >= size_of(p.ep_size))
    return set_error(QKEEP_E_INVAL, "qkeep_model_set_parallel: tp rank %d of %d, ep rank %d of %d", p.tp_rank,
                     p.tp_size, p.ep_rank, p.ep_size);
  p.size = sizeof p;
  model->rank.parallel = p;
  return 0;
}

const char *qkeep_shard_role_name(enum qkeep_shard_role role) {
  switch (role) {
  case QKEEP_SHARD_REPLICATED: return "replicated";
  case QKEEP_SHARD_COLUMN: return "column";
  case QKEEP_SHARD_ROW: return "row";
  case QKEEP_SHARD_EXPERT: return "expert";
  case QKEEP_SHARD_MOE_TP: return "moe-tp";
  }
  return "?";
}

int qkeep_layer_get_shard(const qkeep_layer *layer, struct qkeep_layer_shard *out) {
  if (!layer || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_layer_get_shard: NULL argument");
  struct qkeep_layer_shard s = layer->shard;
  if (s.ranks == 0) { /* never planned by a cut (plain, kv-scales, tied, or an unsharded model) */
    s = (struct qkeep_layer_shard){.role = QKEEP_SHARD_REPLICATED,
                                   .ranks = 1,
                                   .n = layer->dims.n,
                                   .k = layer->dims.k,
                                   .experts = layer->dims.experts};
    memcpy(s.shard_n, layer->dims.shard_n, sizeof s.shard_n);
  }
  s.size = sizeof s;
  copy_sized(out, &s, sizeof s);
  return 0;
}
