/*
 * load.c: the cold-start path. Checkpoint tensors are grouped into layers by
 * name, each layer's scheme creates its loader params (validating names,
 * dtypes and shapes before any byte is read), then layer by layer the bytes
 * stream in, the scheme normalises and the backend runs its PWAL.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* A run of checkpoint tensors sharing one layer prefix. */
struct group {
  char *prefix;
  size_t first, count; /* into the name-sorted tensor list */
};

/* Length of the layer prefix of a tensor name: everything before the last '.'. */
static size_t prefix_len(const char *name) {
  const char *dot = strrchr(name, '.');
  return dot ? (size_t)(dot - name) : 0;
}

/*
 * Groups the file's tensors (sorted by name) into layers. Tensors of one layer
 * are adjacent in name order because they share "<prefix>." and differ only
 * after it.
 */
static int group_tensors(const struct st_file *f, struct group **out, size_t *n_out) {
  struct group *groups = NULL;
  size_t n = 0, cap = 0;
  int rc = 0;
  for (size_t i = 0; i < f->n_tensors && !rc; i++) {
    const char *name = f->tensors[i].name;
    size_t plen = prefix_len(name);
    if (plen == 0) {
      rc = set_error(QKEEP_E_FORMAT, "%s: tensor '%s' has no layer prefix (expected '<layer>.<param>')", f->path,
                     name);
      break;
    }
    if (n && strlen(groups[n - 1].prefix) == plen && strncmp(groups[n - 1].prefix, name, plen) == 0) {
      groups[n - 1].count++;
      continue;
    }
    rc = grow_array((void **)&groups, &cap, n + 1, sizeof *groups);
    if (rc)
      break;
    char *prefix = strndup(name, plen);
    if (!prefix) {
      rc = set_error(QKEEP_E_NOMEM, "out of memory");
      break;
    }
    groups[n++] = (struct group){prefix, i, 1};
  }
  if (rc) {
    for (size_t i = 0; i < n; i++)
      free(groups[i].prefix);
    free(groups);
    return rc;
  }
  *out = groups;
  *n_out = n;
  return 0;
}

/* Builds one layer from a group: scheme create, then a backend support check. */
static int build_layer(qkeep_model *model, const struct st_file *f, const struct group *g) {
  const struct scheme *scheme = &scheme_unquantized;
  const struct st_tensor **tensors = calloc(g->count, sizeof *tensors);
  const char **local = calloc(g->count, sizeof *local);
  qkeep_layer *layer = NULL;
  int rc = (tensors && local) ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < g->count && !rc; i++) {
    tensors[i] = &f->tensors[g->first + i];
    local[i] = tensors[i]->name + strlen(g->prefix) + 1;
  }
  if (!rc)
    rc = qkeep_layer_add(model, g->prefix, QKEEP_LAYER_OTHER, scheme->name, &layer);
  if (!rc)
    rc = scheme->create(layer, tensors, local, g->count);
  const struct qkeep_backend *be = model_backend(model);
  if (!rc && be && be->supports && (layer->kind == QKEEP_LAYER_LINEAR || layer->kind == QKEEP_LAYER_MOE) &&
      !be->supports(be, layer->scheme, layer->kind))
    rc = set_error(QKEEP_E_UNSUPPORTED, "%s: layer %s: backend %s does not run scheme %s for %s layers", f->path,
                   layer->name, be->name, layer->scheme, qkeep_layer_kind_name(layer->kind));
  free(tensors);
  free(local);
  return rc;
}

/* Streams every source of a layer into its param, via host staging when the device is not the host. */
static int load_layer_bytes(qkeep_layer *layer, const struct st_file *f) {
  const struct device *dev = &layer->model->dev;
  bool host = dev->ops == host_device()->ops;
  for (size_t i = 0; i < layer->n_sources; i++) {
    struct source *src = &layer->sources[i];
    const struct st_tensor *t = st_find(f, src->checkpoint_name);
    if (!t)
      return set_error(QKEEP_E_NOTFOUND, "%s: tensor '%s' is missing (layer %s)", f->path, src->checkpoint_name,
                       layer->name);
    char *dst = (char *)src->param->view.storage->data + src->dst_offset;
    void *staging = host ? dst : malloc(t->nbytes ? t->nbytes : 1);
    if (!staging)
      return set_error(QKEEP_E_NOMEM, "out of memory staging '%s' (%llu bytes)", t->name,
                       (unsigned long long)t->nbytes);
    int rc = st_read(f, t, staging);
    if (!rc && !host)
      rc = dev_h2d(dev, dst, staging, t->nbytes);
    if (!host)
      free(staging);
    if (rc)
      return add_error_context(rc, "layer %s", layer->name);
    src->loaded = true;
  }
  return 0;
}

/* Normalisation then the backend's PWAL, once a layer has all its bytes. */
static int finish_layer(qkeep_layer *layer) {
  const struct scheme *scheme = &scheme_unquantized;
  int rc = scheme->normalize ? scheme->normalize(layer) : 0;
  if (rc)
    return add_error_context(rc, "layer %s: %s normalisation", layer->name, scheme->name);
  const struct qkeep_backend *be = model_backend(layer->model);
  if (be && be->pwal && (rc = be->pwal(be, layer)))
    return add_error_context(rc, "layer %s: PWAL of backend %s", layer->name, be->name);
  return 0;
}

int qkeep_model_load(qkeep_model *model, const char *checkpoint) {
  if (!model || !checkpoint)
    return set_error(QKEEP_E_INVAL, "qkeep_model_load: NULL argument");
  if (model->n_layers)
    return set_error(QKEEP_E_STATE, "qkeep_model_load: the model already holds %zu layers", model->n_layers);
  struct st_file *f;
  int rc = st_open(checkpoint, &f);
  if (rc)
    return rc;
  struct group *groups = NULL;
  size_t n_groups = 0;
  rc = group_tensors(f, &groups, &n_groups);
  /* Every layer is created (all names, dtypes and shapes checked) before any byte is read. */
  for (size_t i = 0; i < n_groups && !rc; i++)
    rc = build_layer(model, f, &groups[i]);
  for (size_t i = 0; i < model->n_layers && !rc; i++) {
    rc = load_layer_bytes(model->layers[i], f);
    if (!rc)
      rc = finish_layer(model->layers[i]);
  }
  if (rc)
    model_clear(model); /* nothing half-loaded stays behind */
  for (size_t i = 0; i < n_groups; i++)
    free(groups[i].prefix);
  free(groups);
  st_close(f);
  return rc;
}
