/*
 * online_device.c: online quantization on the layer's device. Where the layer's owner has the
 * quantize slot (ABI 1.5) and takes the unit, a unit of an NVFP4 or MXFP4 plan is quantized there
 * instead of on the host (load/online.c):
 *
 *   query    the slot is asked first, with no bytes: a backend may decline a unit (its scheme,
 *            dtype or shape), which then goes the host way, before anything is read;
 *   stage    the members' unquantized bytes go to one device buffer through the load's pinned ring
 *            (device/stream.c), or straight from the provider when they are in device memory
 *            already (a sync's bucket on the device): at most one unit's sources, reused from unit
 *            to unit and freed with the staging at the end of the load (staging_free);
 *   quantize the backend writes codes and block scales straight into the loader params' own
 *            storage, where load_source would have copied the host quantizer's bytes (checkpoint
 *            layout, before PWAL: the layer's normalisation and PWAL, the census and the digest
 *            see what they see after a host quantization);
 *   finish   the rest follows from the amax the device found (NVFP4's global scales, the
 *            constants: online_unit_finish) and lands through load_source, in the unit's order.
 *
 * A refusal for a NaN or an Inf (or an NVFP4 amax too small), which leaves every output unwritten,
 * is reported by the host path run on the same bytes: the same error, naming the tensor, element,
 * row and column.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "load/load.h"
#include "qkeep/qkeep_backend_util.h"

/* A staged member's start in the unit's device buffer: every member aligned as a device allocation is. */
#define STAGE_ALIGN ((size_t)256)

/* The unit as the slot sees it, and which derived sources the device writes. */
struct device_unit {
  struct qkeep_quant_unit q;
  struct qkeep_quant_member m[3];
  struct provided t[3]; /* the members' tensors in the provider */
  bool written[64];     /* by derived source, from the unit's first: written by the device */
};

/* Whether a derived source can take a device's bytes as they come: the whole tensor, contiguous, written
 * (not compared with an earlier shard), into its param's own storage. */
static bool lands_whole(const struct source *src, size_t nbytes) {
  return src->rows == 1 && !src->slice.rows && !src->compare_only && src->row_bytes == nbytes &&
         src->param->view.storage && src->param->view.storage->data &&
         src->dst_offset + nbytes <= src->param->view.storage->capacity;
}

/* The unit's members and destinations; false when some output of the device's lands otherwise (a
 * tensor-parallel slice, a compare-only shard) or the unit is too large for the table: the host path. */
static bool describe_unit(qkeep_layer *layer, size_t first, size_t end, const char *scheme,
                          struct device_unit *du) {
  const struct quant_plan *plan = layer->model->online.plan;
  size_t unit = layer->derived[first].unit;
  int members = quant_plan_members(plan, unit);
  if (end - first > sizeof du->written / sizeof du->written[0] || members > 3)
    return false;
  memset(du, 0, sizeof *du);
  du->q = (struct qkeep_quant_unit){.size = sizeof du->q,
                                    .scheme = scheme,
                                    .n_members = members,
                                    .members = du->m,
                                    .member_size = sizeof du->m[0],
                                    .bad_member = -1};
  for (int m = 0; m < members; m++) {
    struct quant_member qm;
    quant_plan_member(plan, unit, m, &qm);
    du->m[m] = (struct qkeep_quant_member){
        .size = sizeof du->m[m], .name = qm.input, .dtype = qm.dtype, .n = qm.n, .k = qm.k};
    for (int s = 0; s < 2; s++) { /* codes, block scales */
      size_t d = first;
      while (d < end && layer->derived[d].output != qm.out[s])
        d++;
      struct quant_output o;
      quant_plan_output(plan, qm.out[s], &o);
      if (d == end || !lands_whole(&layer->derived[d].src, o.nbytes))
        return false;
      const struct source *src = &layer->derived[d].src;
      void *dst = (char *)src->param->view.storage->data + src->dst_offset;
      *(s == 0 ? &du->m[m].codes : &du->m[m].block_scales) = dst;
      du->written[d - first] = true;
    }
  }
  return true;
}

/* Makes the staging's device buffer at least `bytes` on dev (one unit's sources). */
static int reserve_unit_source(struct staging *st, const struct device *dev, size_t bytes) {
  if (st->unit_src && st->unit_src_dev == dev && st->unit_src_cap >= bytes)
    return 0;
  int rc = 0;
  if (st->unit_src) { /* a kernel may still read the old one */
    rc = dev_sync(st->unit_src_dev);
    dev_free(st->unit_src_dev, st->unit_src);
    st->unit_src = NULL, st->unit_src_cap = 0, st->unit_src_dev = NULL;
  }
  if (!rc && !(rc = dev_alloc(dev, bytes ? bytes : 1, &st->unit_src)))
    st->unit_src_cap = bytes, st->unit_src_dev = dev;
  return rc;
}

/* Whether a member's tensor t, not in device memory, can go through the pinned ring: the provider holds
 * its bytes in host memory or reads ranges of it. *item: its stream item (dst not set). */
static bool ring_item(const struct provider *pv, const struct provided *t, struct stream_item *item) {
  *item = (struct stream_item){.t = *t, .on_host = pv->host_bytes ? pv->host_bytes(pv, t) : NULL};
  return item->on_host || pv->read_range;
}

/* Puts every member's unquantized bytes on the device: src of each member set. */
static int stage_sources(qkeep_layer *layer, const struct provider *pv, struct device_unit *du,
                         struct staging *st) {
  const struct device *dev = layer_device(layer);
  size_t bytes = 0, at[3] = {0};
  const void *on_device[3] = {0};
  for (int m = 0; m < du->q.n_members; m++) {
    on_device[m] = pv->device_bytes ? pv->device_bytes(pv, &du->t[m]) : NULL;
    if (on_device[m])
      continue;
    at[m] = bytes;
    bytes += (du->t[m].nbytes + STAGE_ALIGN - 1) / STAGE_ALIGN * STAGE_ALIGN;
  }
  int rc = bytes ? reserve_unit_source(st, dev, bytes) : 0;
  struct stream_item items[3];
  size_t n_items = 0;
  bool async = memory_ops_async(dev->ops);
  for (int m = 0; m < du->q.n_members && !rc; m++) {
    if (on_device[m]) {
      du->m[m].src = on_device[m];
      continue;
    }
    char *dst = (char *)st->unit_src + at[m];
    du->m[m].src = dst;
    struct stream_item it;
    if (ring_item(pv, &du->t[m], &it) && async) { /* through the pinned ring */
      it.dst = dst;
      items[n_items++] = it;
      continue;
    }
    const void *from = it.on_host;
    if (!from && !(rc = staging_reserve(st, du->t[m].nbytes)) && !(rc = pv->read(pv, &du->t[m], st->data)))
      from = st->data;
    if (!rc)
      rc = dev_h2d(dev, dst, from, du->t[m].nbytes);
  }
  if (!rc && n_items)
    rc = staging_stream(st, dev, &layer->model->load_options);
  if (!rc && n_items)
    rc = stream_items(st->stream, pv, items, n_items, NULL, 0);
  return rc;
}

static struct device_unit *slot_unit(qkeep_layer *layer, size_t first, size_t end,
                                     const struct qkeep_backend **be, int *rc);

/*
 * While the unit's copies finish (the quantize slot waits for them before it reads back what it
 * found), the readers read the next unit's unquantized bytes in the load's order (this layer's
 * next, or the next layer's first: each linear is a layer of its own, and q/k/v's is followed by
 * o_proj's, gate/up's by down_proj's) into the ring, as
 * stage_sources will stream them: its copies then start as soon as this unit's kernels are queued.
 * Only a head start: anything that keeps the next unit from being described is found again when
 * its turn comes.
 */
static int read_next_unit_ahead(qkeep_layer *this_layer, const struct provider *pv, size_t this_end,
                                struct staging *st) {
  qkeep_layer *layer;
  size_t first, between;
  /* Not past a layer in between (a norm): its own bytes would take the stream's one read ahead. */
  if (!st->stream || !st->online ||
      !online_pipe_next(st->online, this_layer, this_end, st->order, st->n_order, &layer, &first, &between) ||
      between || layer_device(layer) != stream_device(st->stream) ||
      !memory_ops_async(layer_device(layer)->ops))
    return 0;
  size_t end = online_unit_end(layer, first);
  const struct qkeep_backend *be;
  int rc;
  struct device_unit *du = slot_unit(layer, first, end, &be, &rc);
  if (!du)
    return 0;
  struct stream_item items[3];
  size_t n = 0;
  const struct derived *d0 = &layer->derived[first];
  for (int m = 0; m < du->q.n_members; m++) {
    struct provided t;
    if (online_member_tensor(layer, pv, &layer->sources[d0->members[m]], &t)) {
      n = 0;
      break;
    }
    if (!(pv->device_bytes && pv->device_bytes(pv, &t)) && ring_item(pv, &t, &items[n]))
      n++; /* as stage_sources streams it */
  }
  free(du);
  return stream_drain_reading(st->stream, pv, items, n);
}

/* The layer's owner's quantize slot, when the plan's scheme is one a device may quantize; else NULL. */
static const struct qkeep_backend *quantizing_backend(qkeep_layer *layer, size_t first, const char **scheme) {
  const struct qkeep_backend *be = layer_backend(layer);
  *scheme = quant_plan_device_scheme(layer->model->online.plan);
  if (!be || !QKEEP_HAS_SLOT(be, struct qkeep_backend, quantize) || !*scheme ||
      layer->derived[first].unit == SIZE_MAX)
    return NULL;
  return be;
}

/* The unit [first, end) as the layer's owner's quantize slot sees it (*be that backend), in a new
 * device_unit; NULL when the owner has no slot for the plan's scheme or the unit has a shape the slot
 * does not take (*rc 0), or when out of memory (*rc the error). */
static struct device_unit *slot_unit(qkeep_layer *layer, size_t first, size_t end,
                                     const struct qkeep_backend **be, int *rc) {
  const char *scheme;
  *rc = 0;
  if (!(*be = quantizing_backend(layer, first, &scheme)))
    return NULL;
  struct device_unit *du = malloc(sizeof *du);
  if (!du) {
    *rc = set_error(QKEEP_E_NOMEM, "out of memory");
    return NULL;
  }
  if (!describe_unit(layer, first, end, scheme, du)) {
    free(du);
    return NULL;
  }
  return du;
}

int online_device_query(qkeep_layer *layer, size_t first, size_t end) {
  const struct qkeep_backend *be;
  int rc;
  struct device_unit *du = slot_unit(layer, first, end, &be, &rc);
  if (!du)
    return rc;
  int taken = be->quantize(be, layer, &du->q);
  if (taken < 0)
    taken = add_error_context(taken, "backend %s: asked whether it quantizes '%s'", be->name, du->m[0].name);
  free(du);
  return taken < 0 ? taken : taken == 0;
}

int online_unit_device(qkeep_layer *layer, const struct provider *pv, size_t first, size_t end,
                       struct staging *st, struct online_unit *u, bool **written) {
  *written = NULL;
  const struct qkeep_backend *be;
  int rc;
  struct device_unit *du = slot_unit(layer, first, end, &be, &rc); /* as it was when the query took it */
  if (!du)
    return rc;
  du->q.amax = 0.0f, du->q.bad_member = -1, du->q.bad_element = 0;
  const struct derived *d0 = &layer->derived[first];
  for (int m = 0; m < du->q.n_members && !rc; m++)
    rc = online_member_tensor(layer, pv, &layer->sources[d0->members[m]], &du->t[m]);
  bool trace = log_enabled(QKEEP_LOG_DEBUG);
  double t0 = trace ? now_seconds() : 0;
  if (!rc)
    rc = stage_sources(layer, pv, du, st);
  if (!rc)
    rc = read_next_unit_ahead(layer, pv, end, st);
  double t1 = trace ? now_seconds() : 0;
  int done = rc ? rc : be->quantize(be, layer, &du->q);
  if (trace)
    st->device_units++, st->device_stage_s += t1 - t0, st->device_quantize_s += now_seconds() - t1;
  if (!rc && done == QKEEP_E_INVAL) {
    /* A NaN, an Inf or a tiny amax: nothing was written. The host path on the same bytes reports it as
     * quant_plan_run does (tensor, element, row, column); that it accepts them is the backend's fault. */
    struct online_unit host;
    rc = online_unit_make(st->online, layer, pv, first, end, &host);
    if (!rc) {
      online_unit_free(&host);
      rc = set_error(QKEEP_E_DEVICE,
                     "backend %s refused to quantize '%s' (member %d, element %lld) where the host "
                     "quantizer found nothing wrong",
                     be->name, du->m[0].name, du->q.bad_member, (long long)du->q.bad_element);
    }
  } else if (!rc && done < 0) {
    rc = add_error_context(done, "backend %s: quantizing '%s'", be->name, du->m[0].name);
  }
  if (!rc && done == 0)
    rc = online_unit_finish(layer, pv, first, end, du->q.amax, u);
  if (!rc && done == 0 && !(*written = malloc((end - first) * sizeof **written))) {
    online_unit_free(u);
    rc = set_error(QKEEP_E_NOMEM, "out of memory");
  }
  if (*written) {
    memcpy(*written, du->written, (end - first) * sizeof **written);
    layer->model->online.device_units++;
  }
  free(du);
  return rc; /* done == 1 after staging: declined late, the host path reads the bytes again */
}
