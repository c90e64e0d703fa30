/*
 * layer.c: layers, their params and buffers, the name table, and the
 * checkpoint sources that load into them.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "param/param.h"

static bool valid_spec(const struct qkeep_spec *spec) {
  size_t bytes;
  return spec_bytes_checked(spec, &bytes);
}

int qkeep_layer_get_info(const qkeep_layer *layer, struct qkeep_layer_info *out) {
  if (!layer || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_layer_get_info: NULL argument");
  struct qkeep_layer_info info = layer->dims;
  info.size = sizeof info;
  copy_sized(out, &info, sizeof info);
  return 0;
}

int qkeep_layer_set_dims(qkeep_layer *layer, const struct qkeep_layer_info *info) {
  if (!layer || !info || info->shards < 1 || info->shards > 8)
    return set_error(QKEEP_E_INVAL, "qkeep_layer_set_dims: invalid dims");
  bool gemm = layer->kind == QKEEP_LAYER_LINEAR || layer->kind == QKEEP_LAYER_MOE;
  if (info->n < 0 || info->k < 0 || info->experts < 0 || info->group_size < 0 ||
      (gemm && (info->n == 0 || info->k == 0)) || (layer->kind == QKEEP_LAYER_MOE && info->experts == 0))
    return set_error(
        QKEEP_E_INVAL,
        "qkeep_layer_set_dims: %s: N = %lld, K = %lld, %lld experts, group %lld: a %s layer needs "
        "N, K%s > 0",
        layer->name, (long long)info->n, (long long)info->k, (long long)info->experts,
        (long long)info->group_size, qkeep_layer_kind_name(layer->kind),
        layer->kind == QKEEP_LAYER_MOE ? " and experts" : "");
  layer->dims.n = info->n;
  layer->dims.k = info->k;
  layer->dims.experts = info->experts;
  layer->dims.group_size = info->group_size;
  layer->dims.shards = info->shards;
  memcpy(layer->dims.shard_n, info->shard_n, sizeof layer->dims.shard_n);
  return 0;
}

struct name_entry *layer_find_name(const qkeep_layer *layer, const char *name) {
  size_t i;
  return name_index_get(&layer->name_index, name, &i) ? &layer->names[i] : NULL;
}

int layer_register(qkeep_layer *layer, const char *name, qkeep_param *param, struct buffer *buffer) {
  if (!param == !buffer)
    return set_error(QKEEP_E_INVAL, "layer_register: exactly one of param and buffer");
  if (layer_find_name(layer, name))
    return set_error(QKEEP_E_EXISTS, "%s: name '%s' is already registered", layer->name, name);
  int rc = grow_array((void **)&layer->names, &layer->cap_names, layer->n_names + 1, sizeof *layer->names);
  if (rc)
    return rc;
  char *copy = xstrdup(name);
  if (!copy)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  if ((rc = name_index_put(&layer->name_index, copy, layer->n_names, NULL)) != 0) {
    free(copy);
    return rc;
  }
  layer->names[layer->n_names++] = (struct name_entry){copy, param, buffer};
  return 0;
}

const struct qkeep_backend *layer_backend(const qkeep_layer *layer) {
  return layer->owner ? layer->owner->dev.be : NULL;
}

const struct device *layer_device(const qkeep_layer *layer) {
  return layer->owner ? &layer->owner->dev : host_device();
}

int layer_param_check(const qkeep_layer *layer, const char *name, const struct qkeep_spec *spec) {
  if (!layer || !name || !*name || !spec || !valid_spec(spec))
    return set_error(QKEEP_E_INVAL, "qkeep_param_create: invalid argument for '%s'", name ? name : "(null)");
  if (layer_find_name(layer, name))
    return set_error(QKEEP_E_EXISTS, "%s: param '%s' already exists", layer->name, name);
  return 0;
}

int layer_param_create(qkeep_layer *layer, const char *name, const struct qkeep_spec *spec,
                       qkeep_param **out) {
  int rc = layer_param_check(layer, name, spec);
  if (rc)
    return rc;
  rc = grow_array((void **)&layer->params, &layer->cap_params, layer->n_params + 1, sizeof *layer->params);
  if (rc)
    return rc;
  qkeep_param *p = calloc(1, sizeof *p);
  if (!p)
    return set_error(QKEEP_E_NOMEM, "out of memory for param '%s'", name);
  p->layer = layer;
  p->checkpoint_name = xstrdup(name);
  p->runtime_name = xstrdup(name);
  p->create_spec = *spec;
  p->create_bytes = qkeep_spec_bytes(spec);
  p->view.spec = *spec;
  if (!p->checkpoint_name || !p->runtime_name)
    rc = set_error(QKEEP_E_NOMEM, "out of memory for param '%s'", name);
  /* A planned layer (no owner yet) gets its storage when the model is materialised. */
  if (!rc && layer->owner)
    rc = storage_new(layer_device(layer), p->create_bytes, &p->view.storage);
  if (!rc)
    rc = layer_register(layer, name, p, NULL);
  if (rc) {
    storage_unref(p->view.storage);
    free(p->checkpoint_name);
    free(p->runtime_name);
    free(p);
    return add_error_context(rc, "%s.%s", layer->name, name);
  }
  layer->params[layer->n_params++] = p;
  if (out)
    *out = p;
  return 0;
}

/* The layer's position in its model. */
static size_t layer_position(const qkeep_layer *layer) {
  size_t at = 0;
  bool found = name_index_get(&layer->model->index.layers, layer->name, &at);
  assert(found && layer->model->layers[at] == layer);
  (void)found;
  return at;
}

/*
 * Records that the layer's next source (not yet appended, at n_sources) loads the
 * checkpoint tensor `name` (the source's own copy, which the index borrows). A name
 * that loads into several places (one kv_scale feeding k_scale and v_scale) resolves to
 * its first source in layer order, as a scan of the layers would find it.
 */
static int index_source(qkeep_layer *layer, const char *name) {
  qkeep_model *m = layer->model;
  int rc = grow_array((void **)&m->index.source_refs, &m->index.cap_source_refs, m->index.n_source_refs + 1,
                      sizeof *m->index.source_refs);
  if (rc)
    return rc;
  size_t ref = m->index.n_source_refs, existing;
  rc = name_index_put(&m->index.sources, name, ref, &existing);
  if (rc == QKEEP_E_EXISTS) {
    if (layer_position(m->index.source_refs[existing].layer) <= layer_position(layer))
      return 0; /* an earlier source (same or earlier layer) keeps the name */
    rc = name_index_set(&m->index.sources, name, ref);
  }
  if (rc)
    return rc;
  m->index.source_refs[m->index.n_source_refs++] = (struct source_ref){layer, layer->n_sources};
  return 0;
}

int model_reindex_sources(qkeep_model *model) {
  struct model_index *ix = &model->index;
  name_index_clear(&ix->sources);
  ix->n_source_refs = 0;
  int rc = 0;
  for (size_t l = 0; l < model->n_layers && !rc; l++) {
    qkeep_layer *layer = model->layers[l];
    for (size_t i = 0; i < layer->n_sources && !rc; i++) {
      rc = grow_array((void **)&ix->source_refs, &ix->cap_source_refs, ix->n_source_refs + 1,
                      sizeof *ix->source_refs);
      if (!rc && (rc = name_index_put(&ix->sources, layer->sources[i].checkpoint_name, ix->n_source_refs,
                                      NULL)) == QKEEP_E_EXISTS)
        rc = 0; /* layers in order: the first source keeps the name */
      else if (!rc)
        ix->source_refs[ix->n_source_refs++] = (struct source_ref){layer, i};
    }
  }
  return rc;
}

int layer_add_source_strided(qkeep_layer *layer, const char *checkpoint_name, qkeep_param *param,
                             size_t dst_offset, size_t rows, size_t row_bytes, size_t dst_stride,
                             bool compare_only, const struct qkeep_spec *spec) {
  return layer_add_source_slice(layer, checkpoint_name, param, dst_offset, rows, row_bytes, dst_stride,
                                compare_only, spec, NULL);
}

int layer_add_source_slice(qkeep_layer *layer, const char *checkpoint_name, qkeep_param *param,
                           size_t dst_offset, size_t rows, size_t row_bytes, size_t dst_stride,
                           bool compare_only, const struct qkeep_spec *spec, const struct slice *slice) {
  size_t end = rows ? dst_offset + (rows - 1) * dst_stride + row_bytes : dst_offset;
  size_t lands = slice ? slice->rows * slice->row_bytes : qkeep_spec_bytes(spec);
  bool slice_fits = !slice || (slice->rows && (slice->rows == 1 || slice->stride >= slice->row_bytes) &&
                               slice->offset + (slice->rows - 1) * slice->stride + slice->row_bytes <=
                                   qkeep_spec_bytes(spec));
  if (rows * row_bytes != lands || !slice_fits || end > param->create_bytes ||
      (rows > 1 && dst_stride < row_bytes))
    return set_error(QKEEP_E_INVAL, "%s: source '%s' (%zu bytes at %zu) does not fit param '%s' (%zu bytes)",
                     layer->name, checkpoint_name, qkeep_spec_bytes(spec), dst_offset, param->checkpoint_name,
                     param->create_bytes);
  int rc =
      grow_array((void **)&layer->sources, &layer->cap_sources, layer->n_sources + 1, sizeof *layer->sources);
  if (rc)
    return rc;
  char *copy = xstrdup(checkpoint_name);
  if (!copy)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  if ((rc = index_source(layer, copy)) != 0) {
    free(copy);
    return rc;
  }
  layer->sources[layer->n_sources++] =
      (struct source){copy,  param, dst_offset,   rows, row_bytes, dst_stride, compare_only, *spec,
                      false, false, {0, 0, 0, 0}, NULL, 0,         false,      SIZE_MAX,     0};
  if (slice)
    layer->sources[layer->n_sources - 1].slice = *slice;
  return 0;
}

int layer_add_source(qkeep_layer *layer, const char *checkpoint_name, qkeep_param *param, size_t dst_offset,
                     const struct qkeep_spec *spec) {
  size_t bytes = qkeep_spec_bytes(spec);
  return layer_add_source_strided(layer, checkpoint_name, param, dst_offset, 1, bytes, bytes, false, spec);
}

qkeep_param *qkeep_param_lookup(const qkeep_layer *layer, const char *name) {
  if (!layer || !name)
    return NULL;
  struct name_entry *e = layer_find_name(layer, name);
  return e ? e->param : NULL;
}

const char *qkeep_param_checkpoint_name(const qkeep_param *param) { return param->checkpoint_name; }
const char *qkeep_param_runtime_name(const qkeep_param *param) { return param->runtime_name; }
enum qkeep_param_state qkeep_param_state(const qkeep_param *param) { return param->state; }
const struct qkeep_spec *qkeep_param_create_spec(const qkeep_param *param) { return &param->create_spec; }

int qkeep_param_view(const qkeep_param *param, struct qkeep_view *out) {
  if (!param || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_param_view: NULL argument");
  tensor_to_view(&param->view, param->state, out);
  return 0;
}

void layer_destroy(qkeep_layer *layer) {
  if (!layer)
    return;
  for (size_t i = 0; i < layer->n_params; i++) {
    qkeep_param *p = layer->params[i];
    storage_unref(p->view.storage);
    free(p->checkpoint_name);
    free(p->runtime_name);
    free(p->release_reason);
    free(p->full_shape);
    free(p->mirror);
    free(p);
  }
  for (size_t i = 0; i < layer->n_buffers; i++) {
    storage_unref(layer->buffers[i]->view.storage);
    free(layer->buffers[i]->name);
    free(layer->buffers[i]);
  }
  for (size_t i = 0; i < layer->n_names; i++)
    free(layer->names[i].name);
  for (size_t i = 0; i < layer->n_sources; i++)
    free(layer->sources[i].checkpoint_name);
  for (size_t i = 0; i < layer->n_derived; i++)
    free(layer->derived[i].src.checkpoint_name);
  free(layer->derived);
  for (size_t i = 0; i < layer->n_online_params; i++) {
    free(layer->online_params[i]->checkpoint_name);
    free(layer->online_params[i]->runtime_name);
    free(layer->online_params[i]);
  }
  free(layer->online_params);
  free(layer->params);
  free(layer->buffers);
  name_index_clear(&layer->name_index);
  free(layer->names);
  free(layer->sources);
  free(layer->name);
  free(layer->scheme);
  free(layer);
}

/* ---- which params the load writes whole ------------------------------------------------------- */

/* One source's bytes in its param: `rows` runs of `bytes` from `start`, `stride` apart (rows 1: one run). */
struct extent {
  const qkeep_param *param;
  size_t start, bytes, rows, stride;
};

static int by_param_then_start(const void *a, const void *b) {
  const struct extent *x = a, *y = b;
  if (x->param != y->param)
    return (uintptr_t)x->param < (uintptr_t)y->param ? -1 : 1;
  return x->start < y->start ? -1 : x->start > y->start;
}

static void add_extent(struct extent *e, size_t *n, const struct source *s) {
  if (s->compare_only || s->online || !s->param)
    return; /* writes nothing into its param (an online source lands through derived ones) */
  bool flat = s->rows <= 1 || s->dst_stride == s->row_bytes;
  e[(*n)++] = flat ? (struct extent){s->param, s->dst_offset, s->rows * s->row_bytes, 1, 0}
                   : (struct extent){s->param, s->dst_offset, s->row_bytes, s->rows, s->dst_stride};
}

/*
 * Whether extents e[0 .. n) (one param's, by start) write each of its `bytes` exactly once: flat runs
 * that follow one another from 0 to the end, or runs of a common row count and stride whose columns
 * follow one another from 0 to the stride, rows times the stride being the param.
 */
static bool tiles(const struct extent *e, size_t n, size_t bytes) {
  size_t rows = e[0].rows, stride = e[0].stride, end = 0;
  for (size_t i = 0; i < n; i++) {
    if (e[i].rows != rows || e[i].stride != stride || e[i].start != end)
      return false;
    end += e[i].bytes;
  }
  if (rows == 1)
    return end == bytes;
  return end == stride && rows * stride == bytes; /* rows > 1: end, the row's columns, is one stride */
}

int layer_find_covered(const qkeep_layer *layer, bool *covered) {
  size_t n = 0, cap = layer->n_sources + layer->n_derived;
  struct extent *e = malloc((cap ? cap : 1) * sizeof *e);
  if (!e)
    return set_error(QKEEP_E_NOMEM, "out of memory for the sources of layer %s", layer->name);
  for (size_t i = 0; i < layer->n_sources; i++)
    add_extent(e, &n, &layer->sources[i]);
  for (size_t i = 0; i < layer->n_derived; i++)
    add_extent(e, &n, &layer->derived[i].src);
  qsort(e, n, sizeof *e, by_param_then_start);
  /* Each param's run of extents, found by binary search: n log n in all. */
  for (size_t p = 0; p < layer->n_params; p++) {
    const qkeep_param *param = layer->params[p];
    size_t lo = 0, hi = n;
    while (lo < hi) {
      size_t mid = lo + (hi - lo) / 2;
      if ((uintptr_t)e[mid].param < (uintptr_t)param)
        lo = mid + 1;
      else
        hi = mid;
    }
    size_t end = lo;
    while (end < n && e[end].param == param)
      end++;
    covered[p] = end > lo && param->create_bytes > 0 && tiles(e + lo, end - lo, param->create_bytes);
  }
  free(e);
  return 0;
}
