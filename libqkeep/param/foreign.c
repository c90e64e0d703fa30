/*
 * foreign.c: the checkpoint tensors other ranks load (experts of other expert-parallel ranks), kept
 * by name so that a W1 holding them is not refused as unknown.
 */
#include <stdlib.h>

#include "param/param.h"

int shard_note_foreign(qkeep_model *model, const char *name) {
  char *copy = xstrdup(name);
  int rc = copy ? grow_array((void **)&model->rank.foreign, &model->rank.cap_foreign,
                             model->rank.n_foreign + 1, sizeof *model->rank.foreign)
                : set_error(QKEEP_E_NOMEM, "out of memory");
  if (!rc &&
      (rc = name_index_put(&model->rank.foreign_index, copy, model->rank.n_foreign, NULL)) == QKEEP_E_EXISTS)
    rc = 0, free(copy), copy = NULL;
  else if (rc)
    free(copy), copy = NULL;
  if (copy)
    model->rank.foreign[model->rank.n_foreign++] = copy;
  return rc;
}

bool shard_is_foreign(const qkeep_model *model, const char *name) {
  size_t at;
  return model->rank.n_foreign && name_index_get(&model->rank.foreign_index, name, &at);
}

void shard_clear(qkeep_model *model) {
  name_index_clear(&model->rank.foreign_index);
  for (size_t i = 0; i < model->rank.n_foreign; i++)
    free(model->rank.foreign[i]);
  free(model->rank.foreign);
  model->rank.foreign = NULL;
  model->rank.n_foreign = model->rank.cap_foreign = 0;
}
