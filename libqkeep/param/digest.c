/*
 * digest.c: a 128-bit XXH3 hash of every registered tensor, used to prove
 * that a reload is byte-identical to a cold start. Each layer contributes
 * its name, then each registered name in sorted order with its kind (param
 * or buffer), dtype, shape and the bytes of its current view.
 */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "param/param.h"

#define STAGING_BYTES ((size_t)4 << 20)

static int by_name(const void *a, const void *b) {
  const struct name_entry *const *x = a, *const *y = b;
  return strcmp((*x)->name, (*y)->name);
}

static int hash_tensor(XXH3_state_t *st, const struct device *dev, const char *name, bool is_buffer,
                       const struct tensor *t, const qkeep_param *p, unsigned char *staging) {
  int32_t header[2 + QKEEP_MAX_DIMS] = {is_buffer, (int32_t)t->spec.dtype};
  int64_t shape[QKEEP_MAX_DIMS] = {0};
  memcpy(shape, t->spec.shape, sizeof(int64_t) * (size_t)t->spec.ndim);
  XXH3_128bits_update(st, name, strlen(name) + 1);
  XXH3_128bits_update(st, header, sizeof header);
  XXH3_128bits_update(st, &t->spec.ndim, sizeof t->spec.ndim);
  XXH3_128bits_update(st, shape, sizeof shape);
  if (p && p->full_shape) /* a shape too large for a spec: its own dims too */
    XXH3_128bits_update(st, p->full_shape, sizeof *p->full_shape * (size_t)p->full_ndim);
  size_t bytes = t->storage ? qkeep_spec_bytes(&t->spec) : 0;
  const char *src = tensor_ptr(t);
  if (dev->ops == host_device()->ops) { /* host memory: hashed where it is */
    if (bytes)
      XXH3_128bits_update(st, src, bytes);
    return 0;
  }
  for (size_t done = 0; done < bytes;) {
    size_t n = bytes - done < STAGING_BYTES ? bytes - done : STAGING_BYTES;
    int rc = dev_d2h(dev, staging, src + done, n);
    if (rc)
      return add_error_context(rc, "digest of %s", name);
    XXH3_128bits_update(st, staging, n);
    done += n;
  }
  return 0;
}

/* Hashes one layer into st: its name, then each registered name in sorted order (*sorted: scratch). */
static int hash_layer(XXH3_state_t *st, const qkeep_layer *layer, unsigned char *staging,
                      const struct name_entry ***sorted) {
  XXH3_128bits_update(st, layer->name, strlen(layer->name) + 1);
  free(*sorted);
  *sorted = malloc((layer->n_names ? layer->n_names : 1) * sizeof **sorted);
  if (!*sorted)
    return set_error(QKEEP_E_NOMEM, "out of memory for the digest");
  for (size_t i = 0; i < layer->n_names; i++)
    (*sorted)[i] = &layer->names[i];
  qsort(*sorted, layer->n_names, sizeof **sorted, by_name);
  int rc = 0;
  for (size_t i = 0; i < layer->n_names && !rc; i++) {
    const struct name_entry *e = (*sorted)[i];
    const struct tensor *t = e->param ? &e->param->view : &e->buffer->view;
    rc = hash_tensor(st, layer_device(layer), e->name, e->buffer != NULL, t, e->param, staging);
  }
  return rc;
}

/* The digest of layers[0, n). */
static int digest_layers(qkeep_layer *const *layers, size_t n, struct qkeep_digest *out) {
  XXH3_state_t *st = XXH3_createState();
  unsigned char *staging = malloc(STAGING_BYTES);
  const struct name_entry **sorted = NULL;
  int rc = (st && staging) ? 0 : set_error(QKEEP_E_NOMEM, "out of memory for the digest");
  if (!rc)
    XXH3_128bits_reset(st);
  for (size_t l = 0; l < n && !rc; l++)
    rc = hash_layer(st, layers[l], staging, &sorted);
  if (!rc) {
    XXH128_hash_t h = XXH3_128bits_digest(st);
    out->hi = h.high64;
    out->lo = h.low64;
  }
  free(sorted);
  free(staging);
  XXH3_freeState(st);
  return rc;
}

int qkeep_digest(const qkeep_model *model, struct qkeep_digest *out) {
  if (!model || !out)
    return set_error(QKEEP_E_INVAL, "digest: NULL argument");
  return digest_layers(model->layers, model->n_layers, out);
}

void qkeep_digest_hex(const struct qkeep_digest *d, char out[33]) {
  snprintf(out, 33, "%016llx%016llx", (unsigned long long)d->hi, (unsigned long long)d->lo);
}
