/*
 * model/model.h: the model's operations (model/model.c), its provenance for rollbacks, the
 * backend chain that chooses each layer's owner (model/chain.c), and the assembly of a
 * checkpoint's layers (model/assemble.c). Uses base, format, device, param, scheme and plugin.
 */
#ifndef QKEEP_MODEL_H
#define QKEEP_MODEL_H

#include "plugin/plugin.h"
#include "scheme/scheme.h"

void model_clear(qkeep_model *model);

/* ---- the model's state (model.c) ------------------------------------------------------ */

/* Records the checkpoint the model's bytes now equal (NULL: none). */
/* The checkpoint whose bytes the model holds now (NULL: none), and the identity of each of its
 * files as st_open found it, before any byte was read (ck: the open checkpoint, or NULL with path
 * NULL), for the load itself and a rollback to check after their reads.
 * model_source_prepare does the part that can fail (copies), model_source_take installs a
 * prepared one and cannot fail (a reload prepares before W1 changes anything), and
 * model_source_discard frees one not taken. */
int model_source_prepare(const char *path, const struct ckpt *ck, struct model_source *out);
void model_source_take(qkeep_model *model, struct model_source *src);
void model_source_discard(struct model_source *src);
int model_set_source(qkeep_model *model, const char *path, const struct ckpt *ck);
/* Whether ck's files are the ones the model's source had when it was loaded (same count, device,
 * inode, size, modification and change times); else QKEEP_E_STATE naming the first that differs. */
int model_source_unchanged(const qkeep_model *model, const struct ckpt *ck);
/* The same against a recorded source (its path and file identities), e.g. one kept by a sync. */
int source_matches(const struct model_source *src, const struct ckpt *ck);
/* After the reads of a load or reload: ck's files are still the ones src recorded as opened, or
 * QKEEP_E_IO "<file> changed since ...; <what> read a mix of its old and new bytes". */
int source_read_whole(const struct model_source *src, const struct ckpt *ck, const char *what);
/* A copy of the model's source as it stands (path NULL when it has none); QKEEP_E_NOMEM. */
int model_source_copy(const qkeep_model *model, struct model_source *out);
/* Synchronises every device of the model's chain. */
int model_sync(const qkeep_model *model);
/* Starts (on) or ends every owner's spare result memory: on for the layer loop of a load or reload. */
void model_spares(qkeep_model *model, bool on);

/*
 * Gives every layer of a freshly assembled model its owner: the first usable link
 * whose backend accepts the layer (a tied lm_head goes with the embedding it shares,
 * and that link must accept both). Nothing is allocated (model_materialise does that
 * next), so a layer no link accepts fails the whole model, with each backend's reason,
 * before any allocation. `where` (the checkpoint path) prefixes errors.
 */
int chain_assign(qkeep_model *model, const char *where);
/* Chooses the owner of a hand-built layer (qkeep_layer_add) when its first param, of
 * dtype first_dtype, is created. */
int chain_assign_layer(qkeep_layer *layer, enum qkeep_dtype first_dtype);

/* Builds the model's layers from a checkpoint (model/assemble.c): modules, MoE stacking,
 * fusion, kv-scales layers, tied embeddings; every layer's loader params and sources. */
int assemble_model(qkeep_model *model, const struct ckpt *ck);
/* Gives every planned param (one with no storage yet) zero-filled storage in its layer's owner's
 * memory: the third step of a load, after assemble_model (plan) and chain_assign (owners). */
int model_materialise(qkeep_model *model);

#endif
