/*
 * provider.c: the provider over an open checkpoint (its files, read with pread), and the pass
 * numbers that tell one provider's answers from another's.
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "format/provider.h"

uint64_t provider_pass(void) {
  static atomic_uint_fast64_t next = 1;
  return (uint64_t)atomic_fetch_add(&next, 1);
}

/* ---- the checkpoint provider ---- */

static void ck_describe(const struct provider *p, const void *handle, struct provided *out) {
  (void)p;
  const struct ckpt_tensor *t = handle;
  *out = (struct provided){
      t->t->name,    t->t->dtype, t->t->dtype_name, t->t->ndim,      t->t->shape, (size_t)t->t->nbytes,
      t->file->path, t,           t->t->full_shape, t->t->full_ndim, false};
}

static bool ck_find(const struct provider *p, const char *name, struct provided *out) {
  const struct ckpt_tensor *t = ckpt_find(p->ctx, name);
  if (t)
    ck_describe(p, t, out);
  return t != NULL;
}
static int ck_read(const struct provider *p, const struct provided *t, void *dst) {
  return ckpt_read(p->ctx, t->handle, dst);
}
static size_t ck_count(const struct provider *p) { return ((const struct ckpt *)p->ctx)->n_tensors; }
static const char *ck_name_at(const struct provider *p, size_t i) {
  return ((const struct ckpt *)p->ctx)->tensors[i].t->name;
}

static int ck_read_many(const struct provider *p, const struct provided *ts, size_t n, void *const *dsts) {
  const struct ckpt_tensor **cts = malloc((n ? n : 1) * sizeof *cts);
  if (!cts)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < n; i++)
    cts[i] = ts[i].handle;
  int rc = ckpt_read_many(p->ctx, cts, dsts, n);
  free(cts);
  return rc;
}

static int ck_read_range(const struct provider *p, const struct provided *t, size_t offset, size_t n,
                         void *dst) {
  return ckpt_read_range(p->ctx, t->handle, offset, n, dst);
}

void ckpt_provider(struct provider *p, const struct ckpt *ck) {
  *p = (struct provider){ck->path, ck,         ck_find,      ck_read,       NULL,        NULL,
                         ck_count, ck_name_at, ck_read_many, ck_read_range, ck_describe, provider_pass(),
                         NULL,     0};
}
