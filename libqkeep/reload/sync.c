/*
 * sync.c: weight sync from a trainer. W1 arrives as a stream of packed buckets (names,
 * dtypes, shapes and offsets into one contiguous buffer, the form RL frameworks send);
 * each bucket is validated whole, then every layer whose tensors have all arrived is
 * reloaded in place through the in-memory reload (reload.c), each rank taking its slice
 * (scheme/shard_plan.c). Tensors of a layer that a bucket boundary splits wait, copied, for the rest
 * (its scales checked at their bucket and kept in host memory: from device memory they come to the
 * host once).
 * A failure puts the touched layers back from W0's checkpoint, or leaves the model
 * refusing to run: it never serves a silent mix after a failed sync.
 *
 * Also the sender's plan (every checkpoint tensor once, packed into buckets) and the
 * in-process transport; the NCCL transport is in nccl.c.
 */
#include <stdlib.h>
#include <string.h>

#include "reload/reload.h"

/* One distinct checkpoint name the model loads, and the layers it feeds (a chain of links). */
struct sync_name {
  const char *name; /* the first source's checkpoint_name (the model's) */
  const struct qkeep_spec *spec;
  size_t first_link;
  size_t last_layer; /* while building: the last layer linked (+1), to link each layer once */
  bool received;
  bool scale;               /* it loads into a scale param: its values are checked with the bucket */
  const qkeep_param *param; /* the first param it loads into (what its values must be) */
};
struct sync_link {
  size_t layer, next; /* next: SIZE_MAX ends the chain */
};
/* A tensor kept until its layer completes: its bytes lie in one of the sync's blocks. */
struct pending {
  size_t name; /* into names */
  struct qkeep_named_tensor t;
  size_t block; /* into blocks */
};
/* One allocation holding the tensors one bucket left for later layers (one per device it had them for), or
 * one scale tensor whose values the sync checked, in host memory. */
struct keep_block {
  const struct device *dev; /* NULL: host memory */
  void *data;               /* NULL once every tensor in it is dropped */
  size_t bytes, refs;       /* refs: its pending tensors */
  bool checked;             /* it holds one scale tensor, its values checked (check_waiting_scales) */
};

struct qkeep_sync {
  qkeep_model *model;
  struct model_source w0; /* the checkpoint the model held at begin and its files' identity (rollback) */
  bool failed;
  struct sync_name *names;
  size_t n_names;
  struct name_index name_index; /* names[i].name -> i */
  struct sync_link *links;
  size_t n_links, cap_links;
  size_t *missing;     /* per layer: names still to arrive */
  bool *done;          /* per layer: reloaded from W1 in this sync */
  size_t *layer_names; /* per layer, the names it needs: [layer_first[l], layer_first[l + 1]) */
  size_t *layer_first;
  struct pending *pending;
  size_t n_pending, cap_pending;
  struct name_index pending_index; /* names[pending[i].name].name -> i */
  struct keep_block *blocks;
  size_t n_blocks, cap_blocks;
  struct keep_block spare; /* the last block emptied, kept for the next bucket's (until the sync ends) */
  bool trace;              /* a line per bucket to the logger, at QKEEP_LOG_DEBUG */
};

static void block_free(struct keep_block *k) {
  if (k->data && k->dev)
    dev_free(k->dev, k->data);
  else
    free(k->data);
  k->data = NULL, k->refs = 0;
}

/* An emptied block becomes the spare (the larger of the two stays), so that a sync of layers larger than
 * a bucket allocates its blocks once, not per bucket (fresh memory: a device allocator call, or a page
 * fault per page of host memory). */
static void block_drop(qkeep_sync *s, struct keep_block *k) {
  if (k->data && (!s->spare.data || s->spare.bytes < k->bytes)) {
    block_free(&s->spare);
    s->spare = *k;
    k->data = NULL, k->refs = 0;
  }
  block_free(k);
}

/* Drops a pending tensor: its block goes with its last one. */
static void pending_free(qkeep_sync *s, struct pending *p) {
  struct keep_block *k = &s->blocks[p->block];
  if (k->refs && --k->refs == 0)
    block_drop(s, k);
  p->t.data = NULL;
}

static void sync_free(qkeep_sync *s) {
  model_spares(s->model, false);
  for (size_t i = 0; i < s->n_blocks; i++)
    block_free(&s->blocks[i]);
  block_free(&s->spare);
  free(s->blocks);
  free(s->pending);
  name_index_clear(&s->pending_index);
  name_index_clear(&s->name_index);
  free(s->names), free(s->links), free(s->missing), free(s->done), free(s->layer_names), free(s->layer_first);
  model_source_discard(&s->w0);
  free(s);
}

/* Indexes every distinct checkpoint name and, per layer, the names it needs. Linear in sources. */
static int index_names(qkeep_sync *s) {
  qkeep_model *m = s->model;
  size_t total = 0;
  for (size_t l = 0; l < m->n_layers; l++)
    total += m->layers[l]->n_sources;
  s->names = calloc(total ? total : 1, sizeof *s->names);
  s->layer_names = malloc((total ? total : 1) * sizeof *s->layer_names);
  s->layer_first = calloc(m->n_layers + 1, sizeof *s->layer_first);
  s->missing = calloc(m->n_layers ? m->n_layers : 1, sizeof *s->missing);
  s->done = calloc(m->n_layers ? m->n_layers : 1, sizeof *s->done);
  if (!s->names || !s->layer_names || !s->layer_first || !s->missing || !s->done)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  int rc = name_index_reserve(&s->name_index, total);
  size_t n_layer_names = 0;
  for (size_t l = 0; l < m->n_layers && !rc; l++) {
    s->layer_first[l] = n_layer_names;
    for (size_t i = 0; i < m->layers[l]->n_sources && !rc; i++) {
      const struct source *src = &m->layers[l]->sources[i];
      size_t at;
      if (!name_index_get(&s->name_index, src->checkpoint_name, &at)) {
        at = s->n_names++;
        s->names[at] = (struct sync_name){src->checkpoint_name, &src->spec, SIZE_MAX, 0, false,
                                          src->param->scale,    src->param};
        rc = name_index_put(&s->name_index, src->checkpoint_name, at, NULL);
      }
      if (rc || s->names[at].last_layer == l + 1)
        continue; /* this layer needs the name once (a kv_scale feeding k_scale and v_scale) */
      s->names[at].last_layer = l + 1;
      if (!(rc = grow_array((void **)&s->links, &s->cap_links, s->n_links + 1, sizeof *s->links))) {
        s->links[s->n_links] = (struct sync_link){l, s->names[at].first_link};
        s->names[at].first_link = s->n_links++;
        s->layer_names[n_layer_names++] = at;
        s->missing[l]++;
      }
    }
  }
  s->layer_first[m->n_layers] = n_layer_names;
  return rc;
}

int qkeep_sync_begin(qkeep_model *model, qkeep_sync **out) {
  if (!model || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_sync_begin: NULL argument");
  if (!model->n_layers)
    return set_error(QKEEP_E_STATE, "qkeep_sync_begin: the model holds no layers (load a checkpoint first)");
  if (model->poisoned)
    return set_error(QKEEP_E_STATE,
                     "qkeep_sync_begin: a failed reload left a mix of weights; a full reload from "
                     "a checkpoint is needed first");
  qkeep_sync *s = calloc(1, sizeof *s);
  if (!s)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  s->model = model;
  /* The memory of a transformed result stays from one bucket's reload to the next (each reload would
   * free it at its end and allocate it again: on a GPU an allocator call and a free that waits). */
  model_spares(model, true);
  s->trace = log_enabled(QKEEP_LOG_DEBUG);
  int rc = model_source_copy(model, &s->w0);
  if (!rc)
    rc = index_names(s);
  if (rc) {
    sync_free(s);
    return rc;
  }
  *out = s;
  return 0;
}

/* ---- failure: never a silent mix ---- */

static bool touched_any(const qkeep_sync *s) {
  for (size_t l = 0; l < s->model->n_layers; l++)
    if (s->done[l])
      return true;
  return false;
}

/*
 * Puts W0 back by a full reload from the very files the model held at begin, as a reload's own
 * rollback does: they must still have the identity recorded when the model read them (device,
 * inode, size, modification and change times) before the reload, for the files the reload
 * itself opened (it records them before reading), and after it read them. Otherwise the bytes
 * reloaded may be another W0 (a trainer saving into the same directory): the source is dropped
 * and the caller poisons the model.
 */
static int put_back_w0(qkeep_sync *s) {
  qkeep_model *m = s->model;
  const struct model_source *w0 = &s->w0;
  if (!w0->path)
    return set_error(QKEEP_E_STATE, "no checkpoint holds the previous weights");
  struct ckpt *ck;
  int rc = ckpt_open(w0->path, &ck);
  if (rc)
    return rc;
  if ((rc = source_matches(w0, ck)))
    add_error_context(rc, "%s no longer holds the model's previous weights", w0->path);
  if (!rc)
    rc = qkeep_model_reload(m, w0->path, 0);
  if (!rc && (m->source.n != w0->n || (w0->n && memcmp(m->source.ids, w0->ids, w0->n * sizeof *w0->ids))))
    rc = set_error(QKEEP_E_STATE, "%s was replaced while the rollback opened it", w0->path);
  if (!rc && (rc = source_matches(w0, ck)))
    add_error_context(rc, "%s changed while the rollback read it", w0->path);
  ckpt_close(ck);
  if (rc)
    (void)model_set_source(m, NULL, NULL); /* what was reloaded matches no file the model may trust */
  return rc;
}

/* Marks the sync failed and puts the model back to W0 (or poisons it); returns rc with the reason. */
static int fail(qkeep_sync *s, int rc) {
  s->failed = true;
  if (!touched_any(s) && !s->model->poisoned)
    return rc; /* nothing of W1 landed: the model is W0 as it was */
  char *why = xstrdup(qkeep_errmsg());
  int back = put_back_w0(s);
  if (back == 0) {
    set_error(rc, "%s; the sync was rolled back to %s (the same unchanged files)", why ? why : "",
              s->w0.path);
  } else {
    char *how = xstrdup(qkeep_errmsg());
    s->model->poisoned = true;
    set_error(rc, "%s; rollback impossible (%s): the model refuses to run until a reload succeeds",
              why ? why : "", how ? how : "");
    free(how);
  }
  free(why);
  return rc;
}

/* ---- one bucket ---- */

struct extent {
  size_t offset, end, index;
};
static int by_offset(const void *a, const void *b) {
  const struct extent *x = a, *y = b;
  return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Everything about the bucket that can be checked without changing the model. *names_of[i]: the
 * model's name index of tensor i, or SIZE_MAX for another rank's tensor. */
static int validate_bucket(const qkeep_sync *s, const struct qkeep_bucket *b, size_t *name_of) {
  struct name_index seen = {0};
  struct extent *ext = malloc((b->n ? b->n : 1) * sizeof *ext);
  int rc = ext ? name_index_reserve(&seen, b->n) : set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < b->n && !rc; i++) {
    const struct qkeep_bucket_tensor *t = &b->tensors[i];
    size_t bytes, at;
    if (!t->name || (unsigned)t->spec.dtype >= QKEEP_DTYPE_COUNT || !spec_bytes_checked(&t->spec, &bytes))
      rc = set_error(QKEEP_E_INVAL, "bucket tensor %zu ('%s'): no name or a bad spec", i,
                     t->name ? t->name : "(null)");
    else if (t->offset > b->nbytes || bytes > b->nbytes - t->offset)
      rc = set_error(QKEEP_E_INVAL, "bucket tensor '%s': %zu bytes at %zu pass the bucket's end (%zu bytes)",
                     t->name, bytes, t->offset, b->nbytes);
    else if ((rc = name_index_put(&seen, t->name, i, NULL)) == QKEEP_E_EXISTS)
      rc = set_error(QKEEP_E_INVAL, "bucket: '%s' given twice", t->name);
    if (rc)
      break;
    ext[i] = (struct extent){t->offset, t->offset + bytes, i};
    name_of[i] = SIZE_MAX;
    if (!name_index_get(&s->name_index, t->name, &at)) {
      if (!shard_is_foreign(s->model, t->name))
        rc = set_error(QKEEP_E_NOTFOUND, "bucket tensor '%s' is not part of this model", t->name);
      continue;
    }
    char a[96], w[96];
    if (s->names[at].received)
      rc = set_error(QKEEP_E_INVAL, "bucket tensor '%s' was sent before in this sync", t->name);
    else if (!spec_equal(&t->spec, s->names[at].spec))
      rc = set_error(QKEEP_E_FORMAT, "bucket tensor '%s': %s %s, the model expects %s %s", t->name,
                     qkeep_dtype_name(t->spec.dtype), spec_shape_str(&t->spec, a, sizeof a),
                     qkeep_dtype_name(s->names[at].spec->dtype),
                     spec_shape_str(s->names[at].spec, w, sizeof w));
    name_of[i] = at;
  }
  if (!rc && b->n > 1) {
    /* In offset order, a tensor overlaps an earlier one exactly when it starts before the furthest
     * end so far; neighbours alone are not enough (a zero-length tensor between two that overlap
     * overlaps neither). Zero-length tensors overlap nothing. */
    qsort(ext, b->n, sizeof *ext, by_offset);
    const struct extent *furthest = NULL;
    for (size_t i = 0; i < b->n && !rc; i++) {
      if (ext[i].end == ext[i].offset)
        continue;
      if (furthest && ext[i].offset < furthest->end)
        rc = set_error(QKEEP_E_INVAL, "bucket tensors '%s' and '%s' overlap",
                       b->tensors[furthest->index].name, b->tensors[ext[i].index].name);
      else if (!furthest || ext[i].end > furthest->end)
        furthest = &ext[i];
    }
  }
  free(ext);
  name_index_clear(&seen);
  return rc;
}

/* A layer can be reloaded now: all its names arrived, and every other layer they feed is ready too. */
static bool ready(const qkeep_sync *s, size_t l) {
  if (s->done[l] || s->missing[l])
    return false;
  for (size_t i = s->layer_first[l]; i < s->layer_first[l + 1]; i++)
    for (size_t k = s->names[s->layer_names[i]].first_link; k != SIZE_MAX; k = s->links[k].next)
      if (s->missing[s->links[k].layer])
        return false;
  return true;
}

/* Where bucket b holds name `at`'s bytes: the device of the first layer it feeds, or NULL for host memory. */
static const struct device *bucket_device(const qkeep_sync *s, const struct qkeep_bucket *b, size_t at) {
  return b->on_device ? layer_device(s->model->layers[s->links[s->names[at].first_link].layer]) : NULL;
}

/* A block of at least `bytes` in dev's memory (NULL: host memory) at s->blocks[*at]: the spare when it
 * fits, else new. */
static int take_block(qkeep_sync *s, const struct device *dev, size_t bytes, size_t *at) {
  struct keep_block blk = {dev, NULL, bytes, 0, false};
  int rc = grow_array((void **)&s->blocks, &s->cap_blocks, s->n_blocks + 1, sizeof *s->blocks);
  if (!rc && s->spare.data && s->spare.dev == dev && s->spare.bytes >= bytes) {
    blk = s->spare, blk.refs = 0, blk.checked = false;
    s->spare = (struct keep_block){0};
  } else if (!rc) {
    rc = dev ? dev_alloc(dev, bytes ? bytes : 1, &blk.data)
             : ((blk.data = malloc(bytes ? bytes : 1)) ? 0 : set_error(QKEEP_E_NOMEM, "out of memory"));
  }
  if (!rc)
    s->blocks[ *at = s->n_blocks++] = blk;
  return rc;
}

/* Bucket tensor t (name index at), copied to `data` in block `block`, waits for its layer. */
static int add_pending(qkeep_sync *s, size_t at, const struct qkeep_bucket_tensor *t, const void *data,
                       size_t block, bool on_device) {
  int rc = grow_array((void **)&s->pending, &s->cap_pending, s->n_pending + 1, sizeof *s->pending);
  if (!rc)
    rc = name_index_put(&s->pending_index, s->names[at].name, s->n_pending, NULL);
  if (!rc) {
    s->pending[s->n_pending++] = (struct pending){at, {s->names[at].name, t->spec, data, on_device}, block};
    s->blocks[block].refs++;
  }
  return rc;
}

/*
 * Keeps a copy of the bucket's tensors whose layers wait for tensors still to come. Those in a device's
 * memory go to one block per device: the span they cover in the bucket in one copy when they lie close
 * together (qkeep's plan sends a layer in one run: the ones waiting are the bucket's last), else each at
 * its 256-byte aligned place in turn; one device allocation per bucket, not one per tensor (each an
 * allocator call, and a free that waits for the device: a DeepSeek-class MoE layer larger than a bucket
 * leaves thousands). Those in host memory get an allocation each, which malloc recycles. Scale tensors
 * are kept already (check_waiting_scales).
 */
static int keep_waiting(qkeep_sync *s, const struct qkeep_bucket *b, const size_t *name_of) {
  size_t n = 0, *which = malloc((b->n ? b->n : 1) * sizeof *which);
  const struct device **dev_of = malloc((b->n ? b->n : 1) * sizeof *dev_of);
  int rc = which && dev_of ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < b->n && !rc; i++)
    if (name_of[i] != SIZE_MAX && s->names[name_of[i]].last_layer != SIZE_MAX &&
        !s->names[name_of[i]].scale) {
      size_t at = name_of[i];
      dev_of[n] = bucket_device(s, b, at);
      which[n++] = i;
    }
  const char *from = (const char *)b->data;
  for (size_t k = 0, blk; k < n && !rc && !b->on_device; k++) { /* host memory: one allocation each */
    const struct qkeep_bucket_tensor *t = &b->tensors[which[k]];
    size_t bytes = qkeep_spec_bytes(&t->spec);
    if (!(rc = take_block(s, NULL, bytes, &blk))) {
      memcpy(s->blocks[blk].data, from + t->offset, bytes);
      if ((rc = add_pending(s, name_of[which[k]], t, s->blocks[blk].data, blk, false)))
        block_drop(s, &s->blocks[blk]);
    }
  }
  for (size_t first = 0; first < n && !rc && b->on_device; first++) {
    const struct device *dev = dev_of[first];
    bool seen = false; /* its group done already (the common case: one device, one group) */
    for (size_t k = first; k-- > 0 && !seen;)
      seen = dev_of[k] == dev;
    if (seen)
      continue;
    size_t lo = SIZE_MAX, hi = 0, packed = 0, blk;
    for (size_t k = first; k < n; k++)
      if (dev_of[k] == dev) {
        const struct qkeep_bucket_tensor *t = &b->tensors[which[k]];
        size_t bytes = qkeep_spec_bytes(&t->spec);
        lo = t->offset < lo ? t->offset : lo;
        hi = t->offset + bytes > hi ? t->offset + bytes : hi;
        packed = ((packed + 255) & ~(size_t)255) + bytes;
      }
    bool span = hi - lo <= 2 * packed + ((size_t)64 << 10);
    if ((rc = take_block(s, dev, span ? hi - lo : packed, &blk)))
      break;
    char *data = s->blocks[blk].data;
    if (span)
      rc = dev_d2d(dev, data, from + lo, hi - lo);
    for (size_t k = first, end = 0; k < n && !rc; k++) {
      if (dev_of[k] != dev)
        continue;
      const struct qkeep_bucket_tensor *t = &b->tensors[which[k]];
      size_t bytes = qkeep_spec_bytes(&t->spec), place = span ? t->offset - lo : (end + 255) & ~(size_t)255;
      if (!span)
        rc = dev_d2d(dev, data + place, from + t->offset, bytes);
      end = place + bytes;
      if (!rc)
        rc = add_pending(s, name_of[which[k]], t, data + place, blk, true);
    }
    if (!s->blocks[blk].refs)
      block_drop(s, &s->blocks[blk]);
  }
  free(which), free(dev_of);
  return rc;
}

/* Drops the pending copies whose layers are all done (the index is rebuilt over the rest). */
static int drop_pending(qkeep_sync *s) {
  size_t kept = 0;
  int rc = 0;
  name_index_clear(&s->pending_index);
  for (size_t i = 0; i < s->n_pending; i++) {
    bool needed = false;
    for (size_t k = s->names[s->pending[i].name].first_link; k != SIZE_MAX && !needed; k = s->links[k].next)
      needed = !s->done[s->links[k].layer];
    if (!needed) {
      pending_free(s, &s->pending[i]);
      continue;
    }
    s->pending[kept] = s->pending[i];
    if (!rc)
      rc = name_index_put(&s->pending_index, s->names[s->pending[kept].name].name, kept, NULL);
    kept++;
  }
  s->n_pending = kept;
  return rc;
}

/*
 * Checks the values of the bucket's scale tensors that must wait for their layer, before this bucket changes
 * anything, and keeps the bytes it checked for that layer: in host memory, a block each, marked checked. From
 * device memory the check's copy to the host (one per run of them: check_device_scales) is their one trip
 * there; the reload that completes their layer neither copies them back nor checks them again, and fills
 * the mirror of a small one from them.
 */
static int check_waiting_scales(qkeep_sync *s, const struct qkeep_bucket *b, const size_t *name_of) {
  struct scale_item *items = malloc((b->n ? b->n : 1) * sizeof *items);
  if (!items)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  size_t n = 0, blk;
  int rc = 0;
  for (size_t i = 0; i < b->n && !rc; i++) {
    size_t k = name_of[i];
    if (k == SIZE_MAX || s->names[k].last_layer == SIZE_MAX || !s->names[k].scale)
      continue;
    const struct qkeep_bucket_tensor *t = &b->tensors[i];
    size_t bytes = qkeep_spec_bytes(&t->spec);
    if ((rc = take_block(s, NULL, bytes, &blk)))
      break;
    s->blocks[blk].checked = true;
    if ((rc = add_pending(s, k, t, s->blocks[blk].data, blk, false))) {
      block_drop(s, &s->blocks[blk]);
      break;
    }
    struct provided p = {.name = t->name, .dtype = (int)t->spec.dtype, .nbytes = bytes, .where = "bucket"};
    items[n++] = (struct scale_item){bucket_device(s, b, k),
                                     (const char *)b->data + t->offset,
                                     b->on_device ? b->data : NULL,
                                     p,
                                     s->names[k].param,
                                     s->blocks[blk].data};
  }
  if (!rc)
    rc = check_device_scales(items, n);
  free(items);
  return rc;
}

/* Reloads the layers ts complete, from the bucket and the kept blocks (known allocations: their scales are
 * checked in runs). */
static int reload_layers(qkeep_sync *s, const struct qkeep_bucket *b, const struct qkeep_named_tensor *ts,
                         size_t n) {
  struct mem_block *blocks = malloc((s->n_blocks + 1) * sizeof *blocks);
  if (!blocks)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  size_t m = 0;
  blocks[m++] = (struct mem_block){b->data, b->nbytes, false};
  for (size_t i = 0; i < s->n_blocks; i++)
    if (s->blocks[i].data)
      blocks[m++] = (struct mem_block){s->blocks[i].data, s->blocks[i].bytes, s->blocks[i].checked};
  int rc = reload_tensors_in(s->model, ts, n, QKEEP_RELOAD_PARTIAL, blocks, m);
  free(blocks);
  return rc;
}

/* Reloads the ready layers from the bucket and the pending copies; keeps what must wait. */
static int apply_bucket(qkeep_sync *s, const struct qkeep_bucket *b, const size_t *name_of) {
  qkeep_model *m = s->model;
  for (size_t i = 0; i < b->n; i++)
    if (name_of[i] != SIZE_MAX) {
      s->names[name_of[i]].received = true;
      for (size_t k = s->names[name_of[i]].first_link; k != SIZE_MAX; k = s->links[k].next)
        s->missing[s->links[k].layer]--;
    }
  /* Where each received name's bytes are now: the bucket (tensor index + 1) or pending. */
  size_t *in_bucket = calloc(s->n_names ? s->n_names : 1, sizeof *in_bucket);
  bool *now = calloc(m->n_layers ? m->n_layers : 1, sizeof *now);
  struct qkeep_named_tensor *ts = malloc((b->n + s->n_pending + 1) * sizeof *ts);
  int rc = in_bucket && now && ts ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < b->n && !rc; i++)
    if (name_of[i] != SIZE_MAX)
      in_bucket[name_of[i]] = i + 1;
  size_t n = 0;
  for (size_t l = 0; l < m->n_layers && !rc; l++) {
    if (!(now[l] = ready(s, l)))
      continue;
    for (size_t j = s->layer_first[l]; j < s->layer_first[l + 1]; j++) {
      size_t at = s->layer_names[j], p;
      if (s->names[at].last_layer == SIZE_MAX)
        continue; /* given already for another layer of this reload */
      s->names[at].last_layer = SIZE_MAX;
      if (in_bucket[at]) {
        const struct qkeep_bucket_tensor *t = &b->tensors[in_bucket[at] - 1];
        ts[n++] = (struct qkeep_named_tensor){s->names[at].name, t->spec, (const char *)b->data + t->offset,
                                              b->on_device};
      } else if (name_index_get(&s->pending_index, s->names[at].name, &p)) {
        ts[n++] = s->pending[p].t;
      }
    }
  }
  /* Their scales are checked (and kept) now, before this bucket changes anything; a layer reloaded now has
   * its scales checked by the reload's own validation, so none is checked twice. */
  double t0 = now_seconds();
  size_t scales_kept = s->n_pending;
  if (!rc)
    rc = check_waiting_scales(s, b, name_of);
  scales_kept = s->n_pending - scales_kept;
  double t1 = now_seconds();
  if (!rc && n)
    rc = reload_layers(s, b, ts, n);
  double t2 = now_seconds();
  for (size_t l = 0; l < m->n_layers && !rc; l++)
    s->done[l] |= now[l];
  /* The copies the reloaded layers waited for go first (their block becomes the spare the next one
   * takes), then the tensors of layers that must wait are copied: the bucket is the caller's after
   * this call. */
  if (!rc)
    rc = drop_pending(s);
  size_t kept = s->n_pending - scales_kept; /* the waiting scales are pending already */
  if (!rc)
    rc = keep_waiting(s, b, name_of);
  if (!rc && s->trace) {
    const struct qkeep_load_stats *st = &m->stats;
    double reload = t2 - t1, v = n ? st->validate_seconds : 0, r = n ? st->read_seconds : 0,
           p = n ? st->pwal_seconds : 0, copies = now_seconds() - t2;
    log_msg(QKEEP_LOG_DEBUG,
            "qkeep sync: bucket of %zu tensors, %zu bytes: %zu kept for later layers (%.2f ms: their checks "
            "%.2f, copies %.2f), %zu reloaded in %.2f ms (validate %.2f, load %.2f, normalise + PWAL %.2f, "
            "other %.2f)",
            b->n, b->nbytes, s->n_pending - kept, (t1 - t0 + copies) * 1e3, (t1 - t0) * 1e3, copies * 1e3, n,
            reload * 1e3, v * 1e3, r * 1e3, p * 1e3, (reload - v - r - p) * 1e3);
  }
  free(in_bucket), free(now), free(ts);
  return rc;
}

int qkeep_sync_bucket(qkeep_sync *s, const struct qkeep_bucket *bucket) {
  if (!s || !bucket || (!bucket->tensors && bucket->n) || (!bucket->data && bucket->nbytes))
    return set_error(QKEEP_E_INVAL, "qkeep_sync_bucket: NULL argument");
  if (s->failed)
    return set_error(QKEEP_E_STATE, "qkeep_sync_bucket: the sync failed before; start a new one");
  /* The caller's struct may be older (shorter): read only the size it states; absent fields are 0. */
  struct qkeep_bucket b = {0};
  memcpy(&b, bucket, bucket->size && bucket->size < sizeof b ? bucket->size : sizeof b);
  size_t *name_of = malloc((b.n ? b.n : 1) * sizeof *name_of);
  int rc = name_of ? validate_bucket(s, &b, name_of) : set_error(QKEEP_E_NOMEM, "out of memory");
  if (!rc)
    rc = apply_bucket(s, &b, name_of);
  free(name_of);
  return rc ? fail(s, rc) : 0;
}

int qkeep_sync_end(qkeep_sync *s) {
  if (!s)
    return 0;
  int rc = s->failed ? set_error(QKEEP_E_STATE, "qkeep_sync_end: the sync failed") : 0;
  for (size_t i = 0; i < s->n_names && !rc; i++)
    if (!s->names[i].received)
      rc = fail(s, set_error(QKEEP_E_NOTFOUND, "sync ended without tensor '%s'", s->names[i].name));
  for (size_t l = 0; l < s->model->n_layers && !rc; l++)
    if (!s->done[l])
      rc = fail(s,
                set_error(QKEEP_E_STATE, "sync ended with layer %s not reloaded", s->model->layers[l]->name));
  if (!rc) /* the model is W1 from buckets: no file holds it, so a later rollback has nothing to read */
    (void)model_set_source(s->model, NULL, NULL); /* no allocation: cannot fail */
  sync_free(s);
  return rc;
}

void qkeep_sync_abort(qkeep_sync *s) {
  if (!s)
    return;
  if (!s->failed)
    fail(s, set_error(QKEEP_E_STATE, "sync aborted"));
  sync_free(s);
}

int qkeep_sync_receive(qkeep_sync *s, struct qkeep_transport *tr, int root,
                       const struct qkeep_bucket *bucket) {
  if (!s || !tr || !tr->broadcast || !bucket)
    return set_error(QKEEP_E_INVAL, "qkeep_sync_receive: NULL argument");
  if (s->failed)
    return set_error(QKEEP_E_STATE, "qkeep_sync_receive: the sync failed before; start a new one");
  int rc = tr->broadcast(tr->ctx, (void *)bucket->data, bucket->nbytes, root);
  if (!rc && bucket->on_device)
    rc = model_sync(s->model); /* a device transport enqueues on the device: wait before reading */
  if (rc)
    return fail(s, add_error_context(rc, "%s broadcast of a %zu-byte bucket", tr->name, bucket->nbytes));
  return qkeep_sync_bucket(s, bucket);
}

/* ---- the sender's plan ---- */

int qkeep_sync_plan(const qkeep_model *model, size_t bucket_bytes, struct qkeep_sync_entry **out, size_t *n,
                    size_t *n_buckets) {
  if (!model || !out || !n || !n_buckets || !bucket_bytes)
    return set_error(QKEEP_E_INVAL, "qkeep_sync_plan: NULL argument or a bucket of 0 bytes");
  if (model->rank.n_foreign)
    return set_error(QKEEP_E_STATE, "qkeep_sync_plan: an expert-parallel rank does not hold the other ranks' "
                                    "experts; plan from a one-rank (or tensor-parallel) model");
  size_t cap = 0, count = 0, bucket = 0, used = 0;
  struct qkeep_sync_entry *e = NULL;
  int rc = 0;
  for (size_t l = 0; l < model->n_layers && !rc; l++) {
    /* A layer that fits a bucket is not split across two: the receiver would copy the first part
     * until the rest arrived (for a Qwen3-30B-A3B-shaped model, a third of its bytes once more). */
    size_t layer_bytes = 0;
    for (size_t pass = 0; pass < 2 && !rc; pass++) {
      if (pass == 1 && used && ((used + 255) & ~(size_t)255) + layer_bytes > bucket_bytes &&
          layer_bytes <= bucket_bytes)
        bucket++, used = 0;
      /* The layer's scale tensors first, then the rest: the receiver checks the scales' values before
       * anything changes, and from a device bucket it copies them to the host as one run. */
      size_t n_sources = model->layers[l]->n_sources;
      for (size_t k = 0; k < 2 * n_sources && !rc; k++) {
        size_t i = k % n_sources;
        const struct source *src = &model->layers[l]->sources[i];
        if (src->param->scale != (k < n_sources))
          continue; /* scales in the first round, the rest in the second */
        const struct source_ref *first = model_find_source(model, src->checkpoint_name);
        if (!first || first->layer != model->layers[l] || first->source != i)
          continue; /* sent once, with the first source that loads it */
        size_t bytes = qkeep_spec_bytes(&src->spec), at = (used + 255) & ~(size_t)255;
        if (pass == 0) {
          layer_bytes = ((layer_bytes + 255) & ~(size_t)255) + bytes;
          continue;
        }
        if (used && at + bytes > bucket_bytes)
          bucket++, at = 0;
        if (!(rc = grow_array((void **)&e, &cap, count + 1, sizeof *e))) {
          e[count++] = (struct qkeep_sync_entry){{src->checkpoint_name, src->spec, at}, bucket};
          used = at + bytes;
        }
      }
    }
  }
  if (rc) {
    free(e);
    return rc;
  }
  *out = e;
  *n = count;
  *n_buckets = count ? bucket + 1 : 0;
  return 0;
}

void qkeep_sync_plan_free(struct qkeep_sync_entry *entries) { free(entries); }

/* ---- the in-process transport ---- */

struct hub {
  int ranks, open;
  const void *published;
  size_t nbytes;
  bool has;
};
struct endpoint {
  struct hub *hub;
  int rank;
  struct qkeep_transport tr;
};

static int hub_broadcast(void *ctx, void *buf, size_t nbytes, int root) {
  struct endpoint *ep = ctx;
  struct hub *h = ep->hub;
  if (root < 0 || root >= h->ranks)
    return set_error(QKEEP_E_INVAL, "in-process broadcast: root %d of %d ranks", root, h->ranks);
  if (ep->rank == root) {
    h->published = buf, h->nbytes = nbytes, h->has = true;
    return 0;
  }
  if (!h->has || h->nbytes != nbytes)
    return set_error(QKEEP_E_STATE, "in-process broadcast: rank %d receives %zu bytes, the root published %s",
                     ep->rank, nbytes, h->has ? "another size" : "nothing");
  memcpy(buf, h->published, nbytes);
  return 0;
}

static void hub_close(void *ctx) {
  struct endpoint *ep = ctx;
  if (--ep->hub->open == 0)
    free(ep->hub);
  free(ep);
}

int qkeep_transport_inprocess(int ranks, struct qkeep_transport **out) {
  if (ranks < 1 || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_transport_inprocess: %d ranks", ranks);
  struct hub *h = calloc(1, sizeof *h);
  if (!h)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  h->ranks = ranks;
  for (int r = 0; r < ranks; r++) {
    struct endpoint *ep = calloc(1, sizeof *ep);
    if (!ep) {
      for (int k = 0; k < r; k++)
        hub_close(out[k]->ctx);
      if (r == 0)
        free(h);
      return set_error(QKEEP_E_NOMEM, "out of memory");
    }
    *ep = (struct endpoint){h, r, {sizeof ep->tr, "in-process", ep, hub_broadcast, hub_close}};
    h->open++;
    out[r] = &ep->tr;
  }
  return 0;
}
