/*
 * load.c: the cold-start path. The checkpoint is opened (file or directory),
 * every layer and loader param is created (all names, dtypes and shapes
 * checked before a byte is read), then layer by layer the bytes stream in,
 * the scheme normalises and the backend runs its PWAL, so the extra memory
 * at any time is one tensor's staging.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <math.h>

#include "numeric.h"

#include "scheme.h"

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Host staging for one tensor, grown as needed and reused. */
struct staging {
  unsigned char *data, *compare;
  size_t cap;
};

static int staging_reserve(struct staging *s, size_t bytes) {
  if (bytes <= s->cap)
    return 0;
  unsigned char *d = realloc(s->data, bytes), *c;
  if (d)
    s->data = d;
  c = d ? realloc(s->compare, bytes) : NULL;
  if (c)
    s->compare = c;
  if (!d || !c)
    return set_error(QKEEP_E_NOMEM, "out of memory staging %zu bytes", bytes);
  s->cap = bytes;
  return 0;
}

/* Lands one checkpoint tensor in its param as the source describes. */
static int load_source(qkeep_layer *layer, const struct ckpt *ck, struct source *src, struct staging *st) {
  const struct device *dev = &layer->model->dev;
  const struct ckpt_tensor *ct = ckpt_find(ck, src->checkpoint_name);
  if (!ct)
    return set_error(QKEEP_E_NOTFOUND, "%s: tensor '%s' is missing (layer %s)", ck->path, src->checkpoint_name,
                     layer->name);
  struct qkeep_spec got = {.dtype = (enum qkeep_dtype)ct->t->dtype, .ndim = ct->t->ndim};
  memcpy(got.shape, ct->t->shape, sizeof got.shape);
  if (ct->t->dtype < 0 || !spec_equal(&got, &src->spec)) {
    char a[96], b[96];
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': %s %s, the model expects %s %s (layer %s)", ct->file->path,
                     ct->t->name, ct->t->dtype_name, spec_shape_str(&got, a, sizeof a),
                     qkeep_dtype_name(src->spec.dtype), spec_shape_str(&src->spec, b, sizeof b), layer->name);
  }
  size_t bytes = (size_t)ct->t->nbytes;
  char *dst = (char *)src->param->view.storage->data + src->dst_offset;
  bool direct = dev->ops == host_device()->ops && src->rows == 1 && !src->compare_only;
  int rc = direct ? ckpt_read(ck, ct, dst) : staging_reserve(st, bytes);
  if (!rc && !direct)
    rc = ckpt_read(ck, ct, st->data);
  if (!rc && src->compare_only) {
    rc = dev_d2h(dev, st->compare, dst, bytes);
    if (!rc && memcmp(st->compare, st->data, bytes) != 0)
      rc = set_error(QKEEP_E_FORMAT, "%s: tensor '%s' differs from the fused shard loaded before it (layer %s)",
                     ct->file->path, ct->t->name, layer->name);
  } else if (!rc && !direct) {
    for (size_t r = 0; r < src->rows && !rc; r++)
      rc = dev_h2d(dev, dst + r * src->dst_stride, st->data + r * src->row_bytes, src->row_bytes);
  }
  if (rc)
    return add_error_context(rc, "layer %s", layer->name);
  src->loaded = true;
  return 0;
}

int load_layer_sources(qkeep_layer *layer, const struct ckpt *ck, struct staging *st) {
  for (size_t i = 0; i < layer->n_sources; i++) {
    int rc = load_source(layer, ck, &layer->sources[i], st);
    if (rc)
      return rc;
  }
  return 0;
}

/* Why the element is not a valid scale, or NULL. */
static const char *bad_scale(enum qkeep_dtype dtype, const unsigned char *p) {
  float v;
  switch (dtype) {
  case QKEEP_DTYPE_F8_E4M3:
    if ((*p & 0x7f) == 0x7f)
      return "NaN";
    return (*p & 0x80) && (*p & 0x7f) ? "negative" : NULL;
  case QKEEP_DTYPE_F8_E8M0:
  case QKEEP_DTYPE_U8: return *p == 0xff ? "NaN (e8m0 0xff)" : NULL;
  case QKEEP_DTYPE_F32: memcpy(&v, p, 4); break;
  case QKEEP_DTYPE_F16:
  case QKEEP_DTYPE_BF16: {
    uint16_t h;
    memcpy(&h, p, 2);
    v = dtype == QKEEP_DTYPE_F16 ? qk_f16_to_f32(h) : qk_bf16_to_f32(h);
    break;
  }
  default: return NULL;
  }
  return v != v ? "NaN" : isinf(v) ? "infinite" : v < 0 ? "negative" : NULL;
}

/* The checkpoint tensor (and its element) that loaded byte `offset` of param p. */
static void locate(const qkeep_layer *layer, const qkeep_param *p, size_t offset, const char **name, size_t *elem) {
  size_t esize = qkeep_dtype_size(p->create_spec.dtype);
  *name = p->checkpoint_name;
  *elem = offset / esize;
  for (size_t i = 0; i < layer->n_sources; i++) {
    const struct source *s = &layer->sources[i];
    if (s->param != p || s->compare_only || offset < s->dst_offset)
      continue;
    size_t rel = offset - s->dst_offset, row = rel / s->dst_stride, col = rel % s->dst_stride;
    if (row < s->rows && col < s->row_bytes) {
      *name = s->checkpoint_name;
      *elem = (row * s->row_bytes + col) / esize;
      return;
    }
  }
}

int validate_scales(qkeep_layer *layer) {
  for (size_t i = 0; i < layer->n_params; i++) {
    qkeep_param *p = layer->params[i];
    if (!p->scale || !p->view.storage)
      continue;
    size_t bytes = p->create_bytes, esize = qkeep_dtype_size(p->create_spec.dtype);
    unsigned char *host = malloc(bytes ? bytes : 1);
    if (!host)
      return set_error(QKEEP_E_NOMEM, "out of memory");
    int rc = dev_d2h(&layer->model->dev, host, p->view.storage->data, bytes);
    for (size_t off = 0; !rc && off < bytes; off += esize) {
      const char *why = bad_scale(p->create_spec.dtype, host + off);
      if (why) {
        const char *name;
        size_t elem;
        locate(layer, p, off, &name, &elem);
        rc = set_error(QKEEP_E_FORMAT, "tensor '%s': element %zu is %s (scales must be finite and non-negative; layer %s)",
                       name, elem, why, layer->name);
      }
    }
    free(host);
    if (rc)
      return rc;
  }
  return 0;
}

int finish_layer(qkeep_layer *layer) {
  int rc = layer->scheme_ops && layer->scheme_ops->normalize ? layer->scheme_ops->normalize(layer) : 0;
  if (rc)
    return add_error_context(rc, "layer %s: %s normalisation", layer->name, layer->scheme);
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
  struct ckpt *ck;
  struct staging st = {0};
  double t0 = now_seconds();
  int rc = ckpt_open(checkpoint, &ck);
  if (rc)
    return rc;
  rc = assemble_model(model, ck);
  double t1 = now_seconds(), t_read = 0, t_pwal = 0;
  for (size_t i = 0; i < model->n_layers && !rc; i++) {
    double a = now_seconds();
    rc = load_layer_sources(model->layers[i], ck, &st);
    double b = now_seconds();
    if (!rc)
      rc = validate_scales(model->layers[i]);
    if (!rc)
      rc = finish_layer(model->layers[i]);
    t_read += b - a;
    t_pwal += now_seconds() - b;
    if (model->progress)
      model->progress(model->progress_user, i + 1, model->n_layers, model->layers[i]->name);
  }
  if (!rc)
    rc = dev_sync(&model->dev);
  if (rc) {
    model_clear(model); /* nothing half-loaded stays behind */
  } else {
    model->stats = (struct qkeep_load_stats){sizeof model->stats, t1 - t0, t_read, t_pwal, 0};
    for (size_t f = 0; f < ck->n_files; f++)
      model->stats.checkpoint_bytes += (int64_t)ck->files[f]->file_size;
  }
  free(st.data);
  free(st.compare);
  ckpt_close(ck);
  return rc;
}
