/*
 * rules.c: the only code that changes a param after creation. Implements the
 * table of docs/RULES.md: replace, move, retire, release, add_buffer, and
 * the readers kernels and offloaders use.
 *
 * Invariants kept here: a param always views offset 0 of its own storage;
 * its storage capacity never drops below its checkpoint bytes (C1) unless
 * released; distinct objects never share a storage (C2) - an alias is one
 * object under two names.
 */
#include <stdlib.h>
#include <string.h>

#include "param/param.h"

/* The param registered under name, or an error naming layer and name. */
static int find_param(qkeep_layer *layer, const char *name, const char *op, qkeep_param **out) {
  if (!layer || !name)
    return set_error(QKEEP_E_INVAL, "%s: NULL layer or name", op);
  struct name_entry *e = layer_find_name(layer, name);
  if (!e)
    return set_error(QKEEP_E_NOTFOUND, "%s: %s has no param '%s'", op, layer->name, name);
  if (!e->param)
    return set_error(QKEEP_E_INVAL, "%s: %s.%s is a kernel buffer, not a param", op, layer->name, name);
  *out = e->param;
  return 0;
}

/* A result tensor of spec on the layer's device, zero-filled or (fill false) not. */
static int tensor_make(qkeep_layer *layer, const struct qkeep_spec *spec, bool fill, qkeep_tensor **out) {
  size_t bytes;
  if (!layer || !spec || !out || !spec_bytes_checked(spec, &bytes))
    return set_error(QKEEP_E_INVAL,
                     "%s: %s: invalid spec (a bad dtype or rank, a negative "
                     "dimension, or more bytes than memory has)",
                     fill ? "qkeep_tensor_new" : "tensor_new_unfilled", layer ? layer->name : "(null)");
  qkeep_tensor *t = calloc(1, sizeof *t);
  if (!t)
    return set_error(QKEEP_E_NOMEM, "out of memory for a result tensor");
  t->layer = layer;
  t->t.spec = *spec;
  int rc = storage_new_result(layer_device(layer), bytes, fill, &t->t.storage);
  if (rc) {
    free(t);
    return add_error_context(rc, "%s: result tensor", layer->name);
  }
  *out = t;
  return 0;
}

int qkeep_tensor_new(qkeep_layer *layer, const struct qkeep_spec *spec, qkeep_tensor **out) {
  return tensor_make(layer, spec, true, out);
}

int tensor_new_unfilled(qkeep_layer *layer, const struct qkeep_spec *spec, qkeep_tensor **out) {
  return tensor_make(layer, spec, false, out);
}

void *qkeep_tensor_data(qkeep_tensor *tensor) { return tensor ? tensor_ptr(&tensor->t) : NULL; }

void qkeep_tensor_free(qkeep_tensor *tensor) {
  if (!tensor)
    return;
  storage_unref(tensor->t.storage);
  free(tensor);
}

int qkeep_replace(qkeep_layer *layer, const char *name, qkeep_tensor *result) {
  qkeep_param *p = NULL;
  int rc = find_param(layer, name, "replace", &p);
  if (!rc && !result)
    rc = set_error(QKEEP_E_INVAL, "replace: %s.%s: NULL result", layer->name, name);
  if (!rc && result->layer != layer)
    rc = set_error(QKEEP_E_INVAL, "replace: %s.%s: result belongs to another layer", layer->name, name);
  if (!rc && p->state == QKEEP_PARAM_RELEASED)
    rc = set_error(QKEEP_E_STATE, "replace: %s.%s was released (%s)", layer->name, name, p->release_reason);
  if (rc) {
    qkeep_tensor_free(result);
    return rc;
  }
  size_t bytes = qkeep_spec_bytes(&result->t.spec);
  struct storage *own = p->view.storage;
  if (result->t.storage == own) {
    /* The result was computed in the param's own storage: only the view changes. */
    rc = result->t.offset == 0
             ? 0
             : set_error(QKEEP_E_RULE, "replace: %s.%s: result not at the start of its storage", layer->name,
                         name);
  } else if (bytes <= own->capacity) {
    rc = dev_d2d(layer_device(layer), own->data, tensor_ptr(&result->t), bytes);
  } else if (result->t.storage->held == result->t.storage->capacity) {
    /* Larger than the param's storage: rebind to the result's storage, which keeps C1. */
    storage_ref(result->t.storage);
    result->t.storage->result = false; /* a param's now: never a spare */
    storage_unref(own);
    p->view.storage = result->t.storage;
  } else {
    /* The result sits in a larger spare: the param gets memory of its own size, not the spare. */
    struct storage *fit;
    rc = storage_new(layer_device(layer), result->t.storage->capacity, &fit);
    if (!rc && (rc = dev_d2d(layer_device(layer), fit->data, result->t.storage->data, bytes)))
      storage_unref(fit);
    if (!rc) {
      storage_unref(own);
      p->view.storage = fit;
    }
  }
  if (!rc) {
    p->view.spec = result->t.spec;
    p->transformed = true;
  }
  qkeep_tensor_free(result);
  return rc ? add_error_context(rc, "replace %s.%s", layer->name, name) : 0;
}

int qkeep_replace_in_place(qkeep_layer *layer, const char *name, const struct qkeep_spec *spec) {
  qkeep_param *p = NULL;
  int rc = find_param(layer, name, "replace_in_place", &p);
  if (rc)
    return rc;
  if (!spec || spec->ndim < 0 || spec->ndim > QKEEP_MAX_DIMS || (unsigned)spec->dtype >= QKEEP_DTYPE_COUNT)
    return set_error(QKEEP_E_INVAL, "replace_in_place: %s.%s: invalid spec", layer->name, name);
  if (p->state == QKEEP_PARAM_RELEASED)
    return set_error(QKEEP_E_STATE, "replace_in_place: %s.%s was released", layer->name, name);
  if (qkeep_spec_bytes(spec) > p->view.storage->capacity)
    return set_error(QKEEP_E_RULE, "replace_in_place: %s.%s: %zu bytes do not fit its %zu-byte storage",
                     layer->name, name, qkeep_spec_bytes(spec), p->view.storage->capacity);
  p->view.spec = *spec;
  p->transformed = true;
  return 0;
}

int qkeep_move(qkeep_layer *layer, const char *src, const char *dst) {
  qkeep_param *p = NULL;
  int rc = find_param(layer, src, "move", &p);
  if (rc)
    return rc;
  if (!dst || !*dst)
    return set_error(QKEEP_E_INVAL, "move: %s.%s: empty destination name", layer->name, src);
  struct name_entry *e = layer_find_name(layer, dst);
  if (e && e->param != p)
    return set_error(QKEEP_E_EXISTS, "move: %s.%s -> '%s': that name belongs to another object", layer->name,
                     src, dst);
  if (!e && (rc = layer_register(layer, dst, p, NULL)))
    return rc;
  char *runtime = xstrdup(dst);
  if (!runtime)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  free(p->runtime_name);
  p->runtime_name = runtime;
  return 0;
}

int qkeep_retire(qkeep_layer *layer, const char *name) {
  qkeep_param *p = NULL;
  int rc = find_param(layer, name, "retire", &p);
  if (rc)
    return rc;
  if (p->state == QKEEP_PARAM_RELEASED)
    return set_error(QKEEP_E_STATE, "retire: %s.%s was released", layer->name, name);
  p->state = QKEEP_PARAM_RETIRED;
  return 0;
}

int qkeep_release(qkeep_layer *layer, const char *name, const char *reason) {
  qkeep_param *p = NULL;
  int rc = find_param(layer, name, "release", &p);
  if (rc)
    return rc;
  if (!reason || !*reason)
    return set_error(QKEEP_E_INVAL, "release: %s.%s: a reason is required", layer->name, name);
  char *copy = xstrdup(reason);
  if (!copy)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  free(p->release_reason);
  p->release_reason = copy;
  storage_unref(p->view.storage);
  p->view.storage = NULL;
  p->state = QKEEP_PARAM_RELEASED;
  return 0;
}

int qkeep_add_buffer(qkeep_layer *layer, const char *name, const struct qkeep_spec *spec,
                     struct qkeep_view *out) {
  size_t bytes;
  if (!layer || !name || !*name || !spec)
    return set_error(QKEEP_E_INVAL, "add_buffer: invalid argument");
  if (!spec_bytes_checked(spec, &bytes))
    return set_error(QKEEP_E_INVAL,
                     "add_buffer %s.%s: invalid spec (a bad dtype or rank, a negative "
                     "dimension, or more bytes than memory has)",
                     layer->name, name);
  struct name_entry *e = layer_find_name(layer, name);
  if (e && e->param)
    return set_error(QKEEP_E_EXISTS, "add_buffer: %s.%s is a param", layer->name, name);
  if (e) {
    struct buffer *b = e->buffer;
    if (b->view.storage->capacity != bytes) {
      /* Same name, new size: only a changed layer shape gets here; give it fresh memory. */
      struct storage *s;
      int rc = storage_new(layer_device(layer), bytes, &s);
      if (rc)
        return add_error_context(rc, "add_buffer %s.%s", layer->name, name);
      storage_unref(b->view.storage);
      b->view.storage = s;
    }
    b->view.spec = *spec;
    if (out)
      tensor_to_view(&b->view, QKEEP_PARAM_LIVE, out);
    return 0;
  }
  int rc =
      grow_array((void **)&layer->buffers, &layer->cap_buffers, layer->n_buffers + 1, sizeof *layer->buffers);
  if (rc)
    return rc;
  struct buffer *b = calloc(1, sizeof *b);
  if (!b)
    return set_error(QKEEP_E_NOMEM, "out of memory for buffer %s.%s", layer->name, name);
  b->name = xstrdup(name);
  b->view.spec = *spec;
  rc = b->name ? storage_new(layer_device(layer), bytes, &b->view.storage)
               : set_error(QKEEP_E_NOMEM, "out of memory");
  if (!rc)
    rc = layer_register(layer, name, NULL, b);
  if (rc) {
    storage_unref(b->view.storage);
    free(b->name);
    free(b);
    return add_error_context(rc, "add_buffer %s.%s", layer->name, name);
  }
  layer->buffers[layer->n_buffers++] = b;
  if (out)
    tensor_to_view(&b->view, QKEEP_PARAM_LIVE, out);
  return 0;
}

int qkeep_view_of(const qkeep_layer *layer, const char *name, struct qkeep_view *out) {
  if (!layer || !name || !out)
    return set_error(QKEEP_E_INVAL, "view: NULL argument");
  struct name_entry *e = layer_find_name(layer, name);
  if (!e)
    return set_error(QKEEP_E_NOTFOUND, "%s has no param or buffer '%s'", layer->name, name);
  if (e->param)
    tensor_to_view(&e->param->view, e->param->state, out);
  else
    tensor_to_view(&e->buffer->view, QKEEP_PARAM_LIVE, out);
  return 0;
}

qkeep_param *qkeep_get_live_param(const qkeep_layer *layer, const char *name) {
  qkeep_param *p = qkeep_param_lookup(layer, name);
  return p && p->state == QKEEP_PARAM_LIVE ? p : NULL;
}

int qkeep_kernel_params(const qkeep_layer *layer,
                        int (*fn)(void *user, const char *name, const struct qkeep_view *v), void *user) {
  if (!layer || !fn)
    return set_error(QKEEP_E_INVAL, "kernel_params: NULL argument");
  for (size_t i = 0; i < layer->n_params; i++) {
    const qkeep_param *p = layer->params[i];
    if (p->state != QKEEP_PARAM_LIVE)
      continue;
    struct qkeep_view v = {.size = sizeof v};
    tensor_to_view(&p->view, p->state, &v);
    int rc = fn(user, p->runtime_name, &v);
    if (rc)
      return rc;
  }
  return 0;
}

int qkeep_foreach_name(const qkeep_layer *layer,
                       int (*fn)(void *user, const char *name, bool is_buffer, const struct qkeep_view *v),
                       void *user) {
  if (!layer || !fn)
    return set_error(QKEEP_E_INVAL, "foreach_name: NULL argument");
  for (size_t i = 0; i < layer->n_names; i++) {
    const struct name_entry *e = &layer->names[i];
    struct qkeep_view v = {.size = sizeof v};
    if (e->param)
      tensor_to_view(&e->param->view, e->param->state, &v);
    else
      tensor_to_view(&e->buffer->view, QKEEP_PARAM_LIVE, &v);
    int rc = fn(user, e->name, e->buffer != NULL, &v);
    if (rc)
      return rc;
  }
  return 0;
}

struct storage_use {
  const struct storage *storage;
  const char *layer;
  const char *name;
  size_t order;
};

static int by_storage(const void *a, const void *b) {
  const struct storage_use *x = a, *y = b;
  if (x->storage != y->storage)
    return (uintptr_t)x->storage < (uintptr_t)y->storage ? -1 : 1;
  return x->order < y->order ? -1 : x->order > y->order;
}

static int by_order(const void *a, const void *b) {
  const struct storage_use *x = a, *y = b;
  return x->order < y->order ? -1 : x->order > y->order;
}

int qkeep_foreach_storage(const qkeep_model *model,
                          int (*fn)(void *user, const char *layer, const char *name, const void *data,
                                    size_t capacity),
                          void *user) {
  if (!model || !fn)
    return set_error(QKEEP_E_INVAL, "foreach_storage: NULL argument");
  size_t n = 0, cap = 0;
  struct storage_use *uses = NULL;
  int rc = 0;
  for (size_t l = 0; l < model->n_layers && !rc; l++) {
    const qkeep_layer *layer = model->layers[l];
    for (size_t i = 0; i < layer->n_names && !rc; i++) {
      const struct name_entry *e = &layer->names[i];
      const struct storage *s = e->param ? e->param->view.storage : e->buffer->view.storage;
      if (!s)
        continue;
      rc = grow_array((void **)&uses, &cap, n + 1, sizeof *uses);
      if (!rc)
        uses[n] = (struct storage_use){s, layer->name, e->name, n}, n++;
    }
  }
  if (!rc && n) {
    /* Dedupe by storage, keeping each one's first name, then report in model order. */
    qsort(uses, n, sizeof *uses, by_storage);
    size_t kept = 0;
    for (size_t i = 0; i < n; i++)
      if (i == 0 || uses[i].storage != uses[i - 1].storage)
        uses[kept++] = uses[i];
    qsort(uses, kept, sizeof *uses, by_order);
    for (size_t i = 0; i < kept && !rc; i++)
      rc = fn(user, uses[i].layer, uses[i].name, uses[i].storage->data, uses[i].storage->capacity);
  }
  free(uses);
  return rc;
}
