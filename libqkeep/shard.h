/*
 * shard.h: tensor- and expert-parallel cuts (libqkeep/shard.c). A sharded model's
 * layers are planned with the rank's own dims: the scheme engine asks shard_plan_matrix
 * how one matrix is cut (and whether it divides into whole stored units for every rank)
 * and shard_slice which part of each checkpoint tensor the rank reads; load_source reads
 * a sliced source through shard_load_slice. Not installed.
 */
#ifndef QKEEP_SHARD_H
#define QKEEP_SHARD_H

#include "scheme.h"

/* How one matrix of a layer is cut for this rank. */
enum shard_cut { CUT_NONE, CUT_N, CUT_K, CUT_EXPERTS };

struct shard_plan {
  enum shard_cut cut;
  int ranks, rank;
  /* CUT_K of channelwise scales (G = K): one group per row on every rank, so K/G stays 1 and
   * the scales are repeated, not cut. */
  bool repeat_groups;
};

/*
 * Plans one matrix of a layer ("" for a linear, "w13_" or "w2_" for an MoE layer) from the
 * model's parallel place, its name and kind: decides the cut, checks that every template the
 * checkpoint carries (bit i of `present` for params[i]) splits into whole stored units on
 * every rank (lcm of the pack factor and the block or group size of each cut dimension)
 * and refuses (QKEEP_E_UNSUPPORTED) naming the layer, the dimension and the numbers
 * otherwise; then turns the full dims (*n, shard_n[], *k, *g, *experts) into the rank's,
 * with *first_expert the first expert it holds. Runs before any param exists. For every
 * matrix but w2 it records the layer's role and full dims in layer->shard.
 */
int shard_plan_matrix(qkeep_layer *layer, const char *prefix, const struct param_template *params,
                      size_t n_params, uint32_t present, uint32_t flags, int shards, int64_t *shard_n,
                      int64_t *n, int64_t *k, int64_t *g, int *experts, int *first_expert,
                      struct shard_plan *plan);

/* The part of a checkpoint tensor (template t, full spec cs) the rank reads, as byte runs;
 * false when it reads the tensor whole (a repeated or uncut tensor). */
bool shard_slice(const struct shard_plan *plan, const struct param_template *t, const struct qkeep_spec *cs,
                 struct slice *out);

/* The same for a tensor cut along dimension `dim` into `ranks` equal parts; false when dim is
 * negative. The caller has checked that the dimension divides. */
bool shard_slice_dim(const struct qkeep_spec *cs, int dim, int ranks, int rank, struct slice *out);

/* The rank's cut of a pre-stacked gpt-oss MXFP4 MoE tensor of the layer (EP: dim 0, TP: the
 * interleaved gate/up rows or the down input): its spec and slice. Refuses dims that do not
 * divide, naming the tensor. */
int shard_gptoss_tensor(qkeep_layer *layer, const char *local, const struct qkeep_spec *full,
                        struct qkeep_spec *spec, struct slice *slice, bool *sliced);
/* Records the gpt-oss MoE layer's full dims and role once its tensors are planned. */
void shard_gptoss_dims(qkeep_layer *layer, int64_t experts, int64_t n, int64_t k, int64_t inter);

/* Full (unsharded) dims of a layer for checks of values the checkpoint states (weight_shape). */
int64_t shard_full_k(const qkeep_layer *layer);
int64_t shard_full_n(const qkeep_layer *layer);
int64_t shard_full_shard_n(const qkeep_layer *layer, int shard);

/* Lands a sliced source (src->slice.rows > 0) of provided tensor t in its param, or compares it
 * for a compare-only one, reading only the slice from a file (pread of row ranges; a strided
 * slice row by row, never the whole tensor); a scale's slice is checked in host memory before it
 * goes to the device (scale_to_check). on_device / on_host: the provider's bytes. */
int shard_load_slice(qkeep_layer *layer, const struct provider *pv, const struct source *src,
                     const struct provided *t, const void *on_device, const void *on_host,
                     struct staging *st);

#endif
