/*
 * load.c: the cold-start path, and the pieces reload shares with it. The
 * checkpoint is opened (file or directory), every layer and loader param is
 * created (all names, dtypes and shapes checked before a byte is read), then
 * layer by layer the bytes stream in (each scale checked in host memory on its
 * way to the device: check_scales), the scheme normalises and the backend runs
 * its PWAL, so the extra memory at any time is one tensor's staging.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/numeric.h"
#include "load/load.h"

/* check_source's lookup and checks. */
static int check_found(const qkeep_layer *layer, const struct provider *pv, const struct source *src,
                       struct provided *t) {
  if (!pv->find(pv, src->checkpoint_name, t))
    return set_error(QKEEP_E_NOTFOUND, "%s: tensor '%s' is missing (layer %s)", pv->what,
                     src->checkpoint_name, layer->name);
  struct qkeep_spec got = {.dtype = (enum qkeep_dtype)t->dtype, .ndim = t->ndim};
  memcpy(got.shape, t->shape, sizeof(int64_t) * (size_t)(t->ndim > 0 ? t->ndim : 0));
  if (t->dtype < 0 || !spec_equal(&got, &src->spec) || t->nbytes != qkeep_spec_bytes(&src->spec)) {
    char a[SHAPE_STR_LEN], b[SHAPE_STR_LEN];
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': %s %s, the model expects %s %s (layer %s)", t->where,
                     t->name, t->dtype_name, spec_shape_str(&got, a, sizeof a),
                     qkeep_dtype_name(src->spec.dtype), spec_shape_str(&src->spec, b, sizeof b), layer->name);
  }
  /* A shape too large for a spec is compared whole: two shapes may collapse alike. */
  const qkeep_param *p = src->param;
  bool same = !t->full_shape && !p->full_shape;
  if (!same && t->full_shape && p->full_shape && t->full_ndim == p->full_ndim)
    same = memcmp(t->full_shape, p->full_shape, sizeof *t->full_shape * (size_t)t->full_ndim) == 0;
  if (!same && t->spec_only && !t->full_shape)
    same = true; /* buffers give the param's collapsed spec, checked above */
  if (!same)
    return set_error(QKEEP_E_FORMAT,
                     "%s: tensor '%s': its shape (rank %d) differs from the model's (rank %d) (layer %s)",
                     t->where, t->name, t->full_shape ? t->full_ndim : t->ndim,
                     p->full_shape ? p->full_ndim : p->create_spec.ndim, layer->name);
  return 0;
}

int check_source(const qkeep_layer *layer, const struct provider *pv, struct source *src,
                 struct provided *t) {
  if (pv->pass && src->found_pass == pv->pass) {
    pv->describe(pv, src->found, t);
    return 0;
  }
  int rc = check_found(layer, pv, src, t);
  if (!rc && pv->pass)
    src->found = t->handle, src->found_pass = pv->pass;
  return rc;
}

/* A compare-only source: the provider's bytes must equal what an earlier shard loaded. */
static int compare_source(const struct device *dev, const struct provider *pv, const struct provided *t,
                          const void *on_device, const void *on_host, const char *dst, struct staging *st) {
  int rc = staging_reserve(st, t->nbytes);
  if (!rc && on_device)
    rc = dev_d2h(dev, st->data, on_device, t->nbytes);
  else if (!rc && on_host)
    memcpy(st->data, on_host, t->nbytes);
  else if (!rc)
    rc = pv->read(pv, t, st->data);
  if (!rc)
    rc = dev_d2h(dev, st->compare, dst, t->nbytes);
  if (!rc && memcmp(st->compare, st->data, t->nbytes) != 0)
    rc = set_error(QKEEP_E_FORMAT, "%s: tensor '%s' differs from the fused shard loaded before it", t->where,
                   t->name);
  return rc;
}

/* The host mirror of the source's bytes, for a small scale param (per-tensor and per-shard scales, not block
 * scales: up to MIRROR_MAX bytes) whose normalisation would otherwise read them back from the device; made
 * zeroed, as the bytes no source covers are. NULL: none. */
static unsigned char *source_mirror(const struct source *src) {
  qkeep_param *p = src->param;
  if (p->scale && p->create_bytes <= MIRROR_MAX && !p->mirror && p->create_bytes)
    p->mirror = calloc(1, p->create_bytes); /* none: normalisation reads the device */
  return p->mirror ? p->mirror + src->dst_offset : NULL;
}

int load_source(qkeep_layer *layer, const struct provider *pv, struct source *src, struct staging *st) {
  const struct device *dev = layer_device(layer);
  struct provided t;
  int rc = check_source(layer, pv, src, &t);
  if (rc)
    return rc;
  struct mem_stats *mem = &layer->model->mem;
  char *dst = (char *)src->param->view.storage->data + src->dst_offset;
  if (!src->compare_only)
    src->param->mirror_valid = false; /* its bytes change here, not through the stream */
  const void *on_device = pv->device_bytes ? pv->device_bytes(pv, &t) : NULL;
  const void *on_host = on_device || !pv->host_bytes ? NULL : pv->host_bytes(pv, &t);
  if (src->slice.rows) { /* a tensor-parallel rank's part of the tensor (load/slice.c) */
    rc = shard_load_slice(layer, pv, src, &t, on_device, on_host, st);
  } else if (src->compare_only) {
    rc = compare_source(dev, pv, &t, on_device, on_host, dst, st);
  } else if (!on_device && !on_host && dev->ops == host_device()->ops && src->rows == 1) {
    rc = pv->read(pv, &t, dst); /* straight into the param: no staging */
    if (!rc && scale_to_check(st, src))
      rc = check_scales(src->param, &t, 0, dst, t.nbytes);
  } else {
    const unsigned char *from = on_device ? on_device : on_host;
    if (!from && !(rc = staging_reserve(st, t.nbytes)) && !(rc = pv->read(pv, &t, st->data)))
      from = st->data;
    /* Host bytes are checked before they go to the device. Device bytes come only from in-memory buffers,
     * whose scales the reload's validation checked from their one copy to the host. */
    assert(!on_device || !scale_to_check(st, src));
    if (!rc && !on_device && scale_to_check(st, src))
      rc = check_scales(src->param, &t, 0, from, t.nbytes);
    for (size_t r = 0; !rc && r < src->rows; r++) {
      char *to = dst + r * src->dst_stride;
      const unsigned char *row = from + r * src->row_bytes;
      rc = on_device ? dev_d2d(dev, to, row, src->row_bytes) : dev_h2d(dev, to, row, src->row_bytes);
    }
    /* A small scale's host bytes fill its mirror too, so normalisation need not read them back: those staged
     * here, or for device bytes the host copy the provider holds (the one validation checked). */
    const void *host_copy = rc || src->rows != 1 ? NULL
                            : !on_device         ? from
                            : pv->host_bytes     ? pv->host_bytes(pv, &t)
                                                 : NULL;
    unsigned char *mirror = host_copy ? source_mirror(src) : NULL;
    if (mirror)
      memcpy(mirror, host_copy, t.nbytes), src->mirrored = true;
  }
  /* Staging is two buffers of its capacity (data, and compare for shared shards). */
  if ((int64_t)staging_bytes(st) > mem->staging_peak)
    mem->staging_peak = (int64_t)staging_bytes(st);
  if (rc)
    return add_error_context(rc, "layer %s", layer->name);
  src->loaded = true;
  return 0;
}

/* True when the source's bytes can go from the provider's file straight into its param: host memory,
 * one contiguous run, written (not compared), and no copy of them in memory already. */
static bool reads_direct(const qkeep_layer *layer, const struct provider *pv, const struct source *src,
                         const struct provided *t) {
  return pv->read_many && layer_device(layer)->ops == host_device()->ops && src->rows == 1 && !src->online &&
         !src->compare_only && !src->slice.rows && !(pv->device_bytes && pv->device_bytes(pv, t)) &&
         !(pv->host_bytes && pv->host_bytes(pv, t));
}

/*
 * Reads every source that can land straight in its param as one batch
 * (pv->read_many: runs of adjacent tensors in one syscall each), marking them
 * loaded (a scale once its values are checked where they landed); the rest are
 * left to load_source.
 */
static int load_direct(qkeep_layer *layer, const struct provider *pv, const struct staging *st) {
  size_t n = 0, count = layer->n_sources ? layer->n_sources : 1;
  struct provided *ts = malloc(count * sizeof *ts);
  void **dsts = malloc(count * sizeof *dsts);
  size_t *which = malloc(count * sizeof *which);
  int rc = ts && dsts && which ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < layer->n_sources && !rc; i++) {
    struct source *src = &layer->sources[i];
    if ((rc = check_source(layer, pv, src, &ts[n])) == 0 && reads_direct(layer, pv, src, &ts[n])) {
      dsts[n] = (char *)src->param->view.storage->data + src->dst_offset;
      which[n++] = i;
    }
  }
  if (!rc)
    rc = pv->read_many(pv, ts, n, dsts);
  for (size_t k = 0; k < n && !rc; k++) { /* in host memory already: checked where they landed */
    struct source *src = &layer->sources[which[k]];
    if (scale_to_check(st, src))
      rc = check_scales(src->param, &ts[k], 0, dsts[k], ts[k].nbytes);
    src->loaded = !rc;
  }
  free(ts);
  free(dsts);
  free(which);
  return rc ? add_error_context(rc, "layer %s", layer->name) : 0;
}

/* A streamed scale's check (stream_item): a piece's values, for the param that is its context. */
static int check_piece(const void *param, const struct provided *t, size_t at, const void *bytes, size_t n) {
  return check_scales(param, t, at, bytes, n);
}

/*
 * The sources of the layer that stream to its device: written (not compared), one contiguous run,
 * not in device memory already, from a file (read_range) or host bytes. A scale the load checks gets
 * the stream's check; with `place`, each item's dst (and, for a small scale param, a host mirror) is
 * set. which[] gets their source indices.
 */
static int streamed_sources(qkeep_layer *layer, const struct provider *pv, const struct staging *st,
                            bool place, struct stream_item *items, size_t *which, size_t *n_out) {
  size_t n = 0;
  int rc = 0;
  for (size_t i = 0; i < layer->n_sources && !rc; i++) {
    struct source *src = &layer->sources[i];
    struct stream_item *it = &items[n];
    if (src->online || src->compare_only || src->rows != 1 || src->slice.rows ||
        (rc = check_source(layer, pv, src, &it->t)))
      continue; /* a tensor-parallel slice (slice.rows) loads through load/slice.c */
    if (pv->device_bytes && pv->device_bytes(pv, &it->t))
      continue;
    it->on_host = pv->host_bytes ? pv->host_bytes(pv, &it->t) : NULL;
    if (!it->on_host && !pv->read_range)
      continue;
    it->dst = NULL, it->mirror = NULL, it->alloc = NULL;
    it->check = scale_to_check(st, src) ? check_piece : NULL, it->check_ctx = src->param;
    if (place) {
      it->dst = (char *)src->param->view.storage->data + src->dst_offset;
      it->alloc = src->param->view.storage->data;
      it->mirror = source_mirror(src);
    }
    which[n++] = i;
  }
  *n_out = n;
  return rc;
}

/*
 * Streams every source that goes to a device with asynchronous copies as one contiguous
 * run (written, not compared; not in device memory already) through the staging's stream,
 * marking them loaded; the rest are left to load_source.
 */
static int load_streamed(qkeep_layer *layer, const struct provider *pv, struct staging *st) {
  const struct device *dev = layer_device(layer);
  size_t n = 0, count = layer->n_sources ? layer->n_sources : 1;
  struct stream_item *items = malloc(count * sizeof *items);
  size_t *which = malloc(count * sizeof *which);
  int rc = items && which ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
  if (!rc)
    rc = streamed_sources(layer, pv, st, true, items, which, &n);
  if (!rc && n)
    rc = staging_stream(st, dev, &layer->model->load_options);
  /* The next layer's bytes are read as this one's last pieces are (one it streams from the same
   * provider to the same device, and not quantized on load: its units read their own ahead). */
  qkeep_layer *next = st->ahead;
  size_t n_next = 0, next_count = next ? (next->n_sources ? next->n_sources : 1) : 0;
  struct stream_item *then = next && !layer->n_derived && !next->n_derived && layer_device(next) == dev
                                 ? malloc(next_count * sizeof *then)
                                 : NULL;
  size_t *then_which = then ? malloc(next_count * sizeof *then_which) : NULL;
  if (!rc && n && then_which && streamed_sources(next, pv, st, false, then, then_which, &n_next))
    n_next = 0; /* only a head start: the next layer finds the error itself */
  if (!rc && n)
    rc = stream_items(st->stream, pv, items, n, then_which ? then : NULL, n_next);
  st->read_ahead = !rc && n && n_next ? next : NULL;
  free(then);
  free(then_which);
  for (size_t k = 0; k < n && !rc; k++)
    layer->sources[which[k]].loaded = true, layer->sources[which[k]].mirrored = items[k].mirror != NULL;
  struct mem_stats *mem = &layer->model->mem;
  if ((int64_t)staging_bytes(st) > mem->staging_peak)
    mem->staging_peak = (int64_t)staging_bytes(st);
  free(items);
  free(which);
  return rc ? add_error_context(rc, "layer %s", layer->name) : 0;
}

/*
 * Copies every source whose bytes the provider holds in device memory (a weight sync's bucket) to its
 * param with one batched copy (dev_d2d_batch: one call for a MoE layer's thousands of expert tensors),
 * marking them loaded; a small scale's mirror is filled from the host copy the provider holds, as
 * load_source does. Written sources only (not compared, not a tensor-parallel slice).
 */
static int load_device_batch(qkeep_layer *layer, const struct provider *pv) {
  size_t n = 0, cap = 0;
  struct qkeep_copy_range *ranges = NULL;
  int rc = 0;
  for (size_t i = 0; i < layer->n_sources && !rc; i++) {
    struct source *src = &layer->sources[i];
    struct provided t;
    if (src->loaded || src->online || src->compare_only || src->slice.rows ||
        (rc = check_source(layer, pv, src, &t)))
      continue;
    const unsigned char *from = pv->device_bytes(pv, &t);
    if (!from)
      continue;
    if (n + src->rows > cap) {
      size_t want = 2 * cap > n + src->rows ? 2 * cap : n + src->rows + 64;
      struct qkeep_copy_range *more = realloc(ranges, want * sizeof *more);
      if (!more) {
        rc = set_error(QKEEP_E_NOMEM, "out of memory");
        break;
      }
      ranges = more, cap = want;
    }
    char *dst = (char *)src->param->view.storage->data + src->dst_offset;
    for (size_t r = 0; r < src->rows; r++)
      if (src->row_bytes)
        ranges[n++] =
            (struct qkeep_copy_range){dst + r * src->dst_stride, from + r * src->row_bytes, src->row_bytes};
    src->loaded = true;
    const void *host_copy = src->rows == 1 && pv->host_bytes ? pv->host_bytes(pv, &t) : NULL;
    unsigned char *mirror = host_copy ? source_mirror(src) : NULL;
    if (mirror)
      memcpy(mirror, host_copy, t.nbytes), src->mirrored = true;
  }
  if (!rc && n)
    rc = dev_d2d_batch(layer_device(layer), ranges, n);
  free(ranges);
  return rc ? add_error_context(rc, "layer %s", layer->name) : 0;
}

void load_read_ahead(qkeep_layer *next, const struct provider *pv, struct staging *st) {
  if (!next || next == st->read_ahead || !st->stream || stream_device(st->stream) != layer_device(next))
    return;
  size_t n = 0, count = next->n_sources ? next->n_sources : 1;
  struct stream_item *items = malloc(count * sizeof *items);
  size_t *which = malloc(count * sizeof *which);
  /* none: what is read ahead stays (the next layer's first unit quantized on the device) */
  if (items && which && streamed_sources(next, pv, st, false, items, which, &n) == 0 && n)
    (void)stream_prefetch(st->stream, pv, items, n);
  free(items);
  free(which);
}

/* The layer's tensors made on load (online quantization): per unit, made on the layer's device when its
 * owner takes the unit (load/online_device.c), else on the host from the unquantized sources (the next
 * unit in the load's order quantizing meanwhile: load/online.c's pipe), then landed as any checkpoint
 * tensor is (but those the device wrote in place); the unit's sources count as loaded. */
static int load_made(qkeep_layer *layer, const struct provider *pv, struct staging *st) {
  int rc = 0;
  /* A reload's validation saw only the unquantized sources, never the scales made from them: those are
   * checked as they land, as a cold start checks them (a cold start of the same W1 refuses what this does).
   */
  bool scales_checked = st->scales_checked;
  st->scales_checked = false;
  for (size_t first = 0, end; first < layer->n_derived && !rc; first = end) {
    end = online_unit_end(layer, first);
    struct online_unit *u, on_device;
    bool *written = NULL;
    if ((rc = online_pipe_take(&st->online, layer, first, pv, st->order, st->n_order, online_device_query,
                               &u)))
      break;
    if (!u) { /* the layer's owner quantizes it on its device; declined once staged: the host's */
      u = &on_device;
      rc = online_unit_device(layer, pv, first, end, st, u, &written);
      if (!rc && !written)
        rc = online_unit_make(st->online, layer, pv, first, end, u);
      if (rc) {
        online_pipe_done(st->online);
        break;
      }
    }
    struct mem_stats *mem = &layer->model->mem;
    int64_t held = (int64_t)staging_bytes(st) + (u == &on_device ? u->bytes : 0);
    if (held > mem->staging_peak)
      mem->staging_peak = held;
    for (size_t d = first; d < end && !rc; d++)
      if (written && written[d - first])
        layer->derived[d].src.loaded = true; /* not mirrored: its param's mirror, if any, is not valid */
      else
        rc = load_source(layer, &u->made, &layer->derived[d].src, st);
    free(written);
    if (u == &on_device)
      online_unit_free(u);
    const struct derived *d0 = &layer->derived[first];
    int members = d0->unit == SIZE_MAX ? 0 : quant_plan_members(layer->model->online.plan, d0->unit);
    for (int m = 0; m < members && !rc; m++)
      layer->sources[d0->members[m]].loaded = true;
    online_pipe_done(st->online);
  }
  st->scales_checked = scales_checked;
  return rc ? add_error_context(rc, "layer %s (quantized on load)", layer->name) : 0;
}

int load_layer_sources(qkeep_layer *layer, const struct provider *pv, struct staging *st) {
  for (size_t i = 0; i < layer->n_sources; i++)
    layer->sources[i].loaded = false, layer->sources[i].mirrored = false;
  for (size_t i = 0; i < layer->n_derived; i++)
    layer->derived[i].src.loaded = false, layer->derived[i].src.mirrored = false;
  for (size_t i = 0; i < layer->n_params; i++)
    layer->params[i]->mirror_valid = false;
  const struct device *dev = layer_device(layer);
  int rc = 0;
  if (pv->read_many && dev->ops == host_device()->ops)
    rc = load_direct(layer, pv, st);
  else if (memory_ops_async(dev->ops))
    rc = load_streamed(layer, pv, st);
  if (!rc && pv->device_bytes && dev->ops != host_device()->ops)
    rc = load_device_batch(layer, pv);
  /* What is compared against an earlier shard goes last, once every shard's copy has started. */
  for (int pass = 0; pass < 2; pass++)
    for (size_t i = 0; i < layer->n_sources && !rc; i++)
      if (!layer->sources[i].loaded && !layer->sources[i].online &&
          layer->sources[i].compare_only == (pass == 1))
        rc = load_source(layer, pv, &layer->sources[i], st);
  /* Tensors quantized on load: made from the unquantized sources, unit by unit (load/online.c). */
  if (!rc && layer->n_derived)
    rc = load_made(layer, pv, st);
  /* A mirror is valid when every source that writes its param filled it too (streamed, or from a host copy).
   */
  for (size_t i = 0; i < layer->n_params && !rc; i++)
    layer->params[i]->mirror_valid = layer->params[i]->mirror != NULL;
  for (size_t i = 0; i < layer->n_sources + layer->n_derived && !rc; i++) {
    const struct source *src =
        i < layer->n_sources ? &layer->sources[i] : &layer->derived[i - layer->n_sources].src;
    if (!src->compare_only && (!src->mirrored || src->rows != 1))
      src->param->mirror_valid = false;
  }
  return rc;
}

int finish_layer(qkeep_layer *layer) {
  int rc = layer->scheme_ops && layer->scheme_ops->normalize ? layer->scheme_ops->normalize(layer) : 0;
  if (rc)
    return add_error_context(rc, "layer %s: %s normalisation", layer->name, layer->scheme);
  const struct qkeep_backend *be = layer_backend(layer);
  if (be && be->pwal && (rc = be->pwal(be, layer)))
    return add_error_context(rc, "layer %s: PWAL of backend %s", layer->name, be->name);
  return 0;
}

/* Every tensor of the checkpoint is a source of some layer: one that no layer takes would be neither read
 * nor checked, and a reload of the same checkpoint would refuse it (it checks W1 against the model's
 * names). Assembly gives every tensor a place, so this holds unless a scheme drops one. */
static int check_all_taken(const qkeep_model *model, const struct ckpt *ck) {
  for (size_t i = 0; i < ck->n_tensors; i++)
    if (!model_find_source(model, ck->tensors[i].t->name) &&
        !shard_is_foreign(model, ck->tensors[i].t->name)) /* another EP rank's expert: param/foreign.c */
      return set_error(QKEEP_E_FORMAT, "%s: tensor '%s' is taken by no layer of the model",
                       ck->tensors[i].file->path, ck->tensors[i].t->name);
  return 0;
}

int qkeep_model_load(qkeep_model *model, const char *checkpoint) {
  if (!model || !checkpoint)
    return set_error(QKEEP_E_INVAL, "qkeep_model_load: NULL argument");
  if (model->n_layers)
    return set_error(QKEEP_E_STATE, "qkeep_model_load: the model already holds %zu layers", model->n_layers);
  struct ckpt *ck;
  struct staging st = {0};
  struct provider pv;
  double t0 = now_seconds();
  int rc = ckpt_open(checkpoint, &ck);
  if (rc)
    return rc;
  ckpt_provider(&pv, ck);
  /* Plan (every layer and param from the checkpoint, nothing allocated), choose each layer's owner
   * (the chain), then materialise (every param's storage in its owner's memory). */
  /* A model that quantizes on load plans the checkpoint qkeep quantize would write from this one. */
  rc = model->online.set ? online_assemble(model, ck) : assemble_model(model, ck);
  if (!rc)
    rc = check_all_taken(model, ck);
  if (!rc)
    rc = chain_assign(model, ck->path);
  /* The first layer's bytes are read into its device's ring while every param's memory is allocated
   * (a head start only: a failure here is met again, and reported, when the layer loads). */
  double t_planned = now_seconds();
  const struct device *first = !rc && model->n_layers ? layer_device(model->layers[0]) : NULL;
  if (first && memory_ops_async(first->ops) && !model->layers[0]->n_derived &&
      staging_stream(&st, first, &model->load_options) == 0)
    load_read_ahead(model->layers[0], &pv, &st);
  double t_ring = now_seconds();
  if (!rc)
    rc = model_materialise(model);
  double t1 = now_seconds(), t_read = 0, t_pwal = 0;
  model_spares(model, true);
  st.order = model->layers, st.n_order = model->n_layers; /* every layer, from this checkpoint */
  for (size_t i = 0; i < model->n_layers && !rc; i++) {
    double a = now_seconds();
    st.ahead = i + 1 < model->n_layers ? model->layers[i + 1] : NULL;
    rc = load_layer_sources(model->layers[i], &pv, &st);
    double b = now_seconds();
    if (!rc && i + 1 < model->n_layers) /* the next layer's bytes come in while this one's PWAL runs */
      load_read_ahead(model->layers[i + 1], &pv, &st);
    if (!rc)
      rc = finish_layer(model->layers[i]);
    t_read += b - a;
    t_pwal += now_seconds() - b;
    if (model->progress)
      model->progress(model->progress_user, i + 1, model->n_layers, model->layers[i]->name);
  }
  double t2 = now_seconds();
  if (!rc)
    rc = model_sync(model);
  int staged = staging_free(&st); /* before any storage is freed: no copy may still write to it */
  if (!rc)
    log_msg(QKEEP_LOG_DEBUG,
            "qkeep load: %.2f ms: plan and allocate %.2f (plan %.2f, ring and first read ahead %.2f, "
            "allocate %.2f), layers' bytes %.2f, normalise + PWAL %.2f, last copies %.2f",
            (now_seconds() - t0) * 1e3, (t1 - t0) * 1e3, (t_planned - t0) * 1e3, (t_ring - t_planned) * 1e3,
            (t1 - t_ring) * 1e3, t_read * 1e3, t_pwal * 1e3, (now_seconds() - t2) * 1e3);
  model_spares(model, false);
  if (!rc)
    rc = staged;
  if (!rc)
    rc = model_set_source(model, checkpoint, ck);
  if (!rc) /* a weight file written in place while it was read gave a mix no file holds */
    rc = source_read_whole(&model->source, ck, "the load");
  if (rc) {
    if (!strstr(qkeep_errmsg(), ck->path))
      add_error_context(rc, "%s", ck->path); /* every load error names the checkpoint */
    model_clear(model);                      /* nothing half-loaded stays behind */
  } else {
    model->stats = (struct qkeep_load_stats){sizeof model->stats, t1 - t0, t_read, t_pwal, 0, 0};
    for (size_t f = 0; f < ck->n_files; f++)
      model->stats.checkpoint_bytes += (int64_t)ck->files[f]->file_size;
  }
  ckpt_close(ck);
  return rc;
}
