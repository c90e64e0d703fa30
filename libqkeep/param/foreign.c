/*
 * foreign.c: the checkpoint tensors other ranks load (experts of other expert-parallel ranks), kept
 * by name so that a W1 holding them is not refused as unknown.
 */
#include <stdlib.h>

#include "param/param.h"

int shard_note_foreign(qkeep_model *model, const char *name) {
  char *copy = xstrdup(name);
  int rc = copy ? grow_array((void **)&model->foreign, &model->cap_foreign, model->n_foreign + 1,
                             sizeof *model->foreign)
                : set_error(QKEEP_E_NOMEM, "out of memory");
  if (!rc && (rc = name_index_put(&model->foreign_index, copy, model->n_foreign, NULL)) == QKEEP_E_EXISTS)
    rc = 0, free(copy), copy = NULL;
  else if (rc)
    free(copy), copy = NULL;
  if (copy)
    model->foreign[model->n_foreign++] = copy;
  return rc;
}

bool shard_is_foreign(const qkeep_model *model, const char *name) {
  size_t at;
  return model->n_foreign && name_index_get(&model->foreign_index, name, &at);
}

void shard_clear(qkeep_model *model) {
  name_index_clear(&model->foreign_index);
  for (size_t i = 0; i < model->n_foreign; i++)
    free(model->foreign[i]);
  free(model->foreign);
  model->foreign = NULL;
  model->n_foreign = model->cap_foreign = 0;
}
