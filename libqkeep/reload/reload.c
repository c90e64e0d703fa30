/*
 * reload.c: layerwise reload W0 -> W1 in place, and direct loads into live
 * params.
 *
 * A reload validates all of W1 first (every tensor the model loads is there
 * with its dtype and shape, its scales are valid, W1 holds nothing the model
 * lacks, its quantization config agrees), so a bad W1 changes nothing. Then,
 * layer by layer, each loader param gets back its checkpoint view over its
 * own storage (C1 guarantees it fits; the data pointer does not move), bytes
 * no source covers are zeroed as a cold start zeroes them, W1's bytes land,
 * and the scheme's normalisation and the backend's PWAL run again - in place,
 * by the replace rule. The result equals a cold start on W1 byte for byte.
 * If applying fails part-way, the layers already changed are reloaded from
 * the checkpoint the model held before (W0), but only from the very files it
 * was read from: each file's identity (device, inode, size, mtime, ctime) was
 * recorded when it was read and must hold before and after the re-read, since
 * W0's files may have changed on disk since (a trainer saving into the same
 * directory) and re-reading them would otherwise give a silent mix. If they
 * changed, or no file holds W0, the model refuses to run until a reload
 * succeeds.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "reload/reload.h"

/* ---- the in-memory provider (named buffers from the caller) -------------------------- */

struct buffers {
  const struct qkeep_named_tensor *tensors;
  size_t n;
  struct name_index index; /* tensors[i].name -> i (the caller's strings, borrowed for the call) */
};

static const struct buffers *buffers_of(const struct provider *p) { return p->ctx; }

static void buf_describe(const struct provider *p, const void *handle, struct provided *out) {
  const struct qkeep_named_tensor *t = handle;
  *out = (struct provided){t->name,
                           (int)t->spec.dtype,
                           qkeep_dtype_name(t->spec.dtype),
                           t->spec.ndim,
                           t->spec.shape,
                           qkeep_spec_bytes(&t->spec),
                           p->what,
                           t,
                           NULL,
                           0,
                           true};
}

static bool buf_find(const struct provider *p, const char *name, struct provided *out) {
  const struct buffers *b = buffers_of(p);
  size_t at;
  bool found = name_index_get(&b->index, name, &at);
  if (found)
    buf_describe(p, &b->tensors[at], out);
  return found;
}

static int buf_read(const struct provider *p, const struct provided *t, void *dst) {
  (void)p;
  const struct qkeep_named_tensor *nt = t->handle;
  if (nt->on_device)
    return set_error(QKEEP_E_INVAL, "%s: device buffer read as host memory", nt->name);
  memcpy(dst, nt->data, t->nbytes);
  return 0;
}

static const void *buf_host(const struct provider *p, const struct provided *t) {
  (void)p;
  const struct qkeep_named_tensor *nt = t->handle;
  return nt->on_device ? NULL : nt->data;
}

static const void *buf_device(const struct provider *p, const struct provided *t) {
  (void)p;
  const struct qkeep_named_tensor *nt = t->handle;
  return nt->on_device ? nt->data : NULL;
}

static size_t buf_count(const struct provider *p) { return buffers_of(p)->n; }
static const char *buf_name_at(const struct provider *p, size_t i) { return buffers_of(p)->tensors[i].name; }

/* ---- validated scales: read once, checked, then loaded from the same bytes ----------------- */

/*
 * A reload from files reads each scale tensor to check its values before
 * anything changes. The bytes it checked are kept (up to SCALE_CACHE_MAX; the
 * rest are read again) and the apply phase loads them from here: NVFP4 has
 * three scale tensors per weight, so reading them twice was most of a reload's
 * cost beyond the raw read, and the file cannot change between the check and
 * the load of a kept tensor.
 */
#define SCALE_CACHE_MAX ((size_t)256 << 20)

struct scale_cache {
  const struct provider *inner; /* the provider validated */
  unsigned char *bytes;         /* every kept tensor, back to back */
  size_t used, cap;
  struct name_index index; /* provided name (borrowed from the provider) -> entry */
  size_t *offset;          /* per entry, into bytes */
  size_t n, cap_entries;
  bool complete; /* every scale tensor is kept (or lives in memory already) */
  /* kept tensors not read yet (entries n - n_pending .. n - 1, in order, pending_bytes in all): read
   * after each layer while they are few bytes, else together, by a few threads, once every layer is
   * checked */
  struct provided *pending;
  size_t n_pending, cap_pending, pending_bytes;
  /* the scale tensors whose values are still to be checked, with their layer and param */
  struct scale_check {
    const qkeep_layer *layer;
    const qkeep_param *param;
    struct provided t;
  } * checks;
  size_t n_checks, cap_checks;
  struct online_value_checks values; /* unquantized sources in files: their values, checked at the end */
};

static bool cached_find(const struct provider *p, const char *name, struct provided *out) {
  const struct scale_cache *c = p->ctx;
  return c->inner->find(c->inner, name, out);
}
static int cached_read(const struct provider *p, const struct provided *t, void *dst) {
  const struct scale_cache *c = p->ctx;
  return c->inner->read(c->inner, t, dst);
}
static const void *cached_host(const struct provider *p, const struct provided *t) {
  const struct scale_cache *c = p->ctx;
  size_t at;
  if (name_index_get(&c->index, t->name, &at))
    return c->bytes + c->offset[at];
  return c->inner->host_bytes ? c->inner->host_bytes(c->inner, t) : NULL;
}
static const void *cached_device(const struct provider *p, const struct provided *t) {
  const struct scale_cache *c = p->ctx;
  return c->inner->device_bytes ? c->inner->device_bytes(c->inner, t) : NULL;
}
static size_t cached_count(const struct provider *p) {
  const struct scale_cache *c = p->ctx;
  return c->inner->count(c->inner);
}
static const char *cached_name_at(const struct provider *p, size_t i) {
  const struct scale_cache *c = p->ctx;
  return c->inner->name_at(c->inner, i);
}

/* A provider that serves the kept scale bytes and passes everything else to the inner one. */
static int cached_read_many(const struct provider *p, const struct provided *ts, size_t n,
                            void *const *dsts) {
  const struct scale_cache *c = p->ctx;
  return c->inner->read_many(c->inner, ts, n, dsts);
}

static int cached_read_range(const struct provider *p, const struct provided *t, size_t offset, size_t n,
                             void *dst) {
  const struct scale_cache *c = p->ctx;
  return c->inner->read_range(c->inner, t, offset, n, dst);
}

static void cached_describe(const struct provider *p, const void *handle, struct provided *out) {
  const struct scale_cache *c = p->ctx;
  c->inner->describe(c->inner, handle, out);
}

static void cached_provider(struct provider *p, struct scale_cache *c) {
  *p = (struct provider){c->inner->what,
                         c,
                         cached_find,
                         cached_read,
                         cached_host,
                         cached_device,
                         cached_count,
                         cached_name_at,
                         c->inner->read_many ? cached_read_many : NULL,
                         c->inner->read_range ? cached_read_range : NULL,
                         c->inner->describe ? cached_describe : NULL,
                         c->inner->describe ? c->inner->pass : 0, /* its find is the inner one's */
                         c->inner->blocks,
                         c->inner->n_blocks};
}

/* The cache's own arrays; its bytes are the model's (reload_scales), kept for the next reload. */
static void scale_cache_free(struct scale_cache *c) {
  online_value_checks_free(&c->values);
  free(c->offset);
  free(c->pending);
  free(c->checks);
  name_index_clear(&c->index);
}

/*
 * Room for the scale tensors of the model, up to SCALE_CACHE_MAX bytes: the model's kept buffer,
 * made larger when it is too small. From 2 MiB on it is aligned to 2 MiB and advised to be in huge
 * pages before its first touch (one fault per 2 MiB where the kernel has them).
 */
#define HUGE_PAGE ((size_t)2 << 20)
static int scale_cache_reserve(struct scale_cache *c, qkeep_model *model) {
  size_t total = 0;
  for (size_t l = 0; l < model->n_layers; l++)
    for (size_t i = 0; i < model->layers[l]->n_sources; i++)
      if (model->layers[l]->sources[i].param->scale)
        total += qkeep_spec_bytes(&model->layers[l]->sources[i].spec);
  c->cap = total < SCALE_CACHE_MAX ? total : SCALE_CACHE_MAX;
  c->complete = true;
  struct kept_scales *kept = &model->reload_scales;
  if (c->cap > kept->cap) {
    free(kept->bytes);
    kept->cap = 0;
    size_t huge = (c->cap + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    kept->bytes = c->cap >= HUGE_PAGE ? aligned_alloc(HUGE_PAGE, huge) : malloc(c->cap);
    if (!kept->bytes)
      return set_error(QKEEP_E_NOMEM, "out of memory for %zu bytes of scales", c->cap);
    kept->cap = c->cap >= HUGE_PAGE ? huge : c->cap;
#ifdef MADV_HUGEPAGE
    if (c->cap >= HUGE_PAGE)
      (void)madvise(kept->bytes, huge, MADV_HUGEPAGE); /* advice only: 4 KiB pages where refused */
#endif
  }
  c->bytes = kept->bytes;
  return 0;
}

/* True when the provider holds the tensor in memory already (nothing to keep: validation and apply
 * see the same bytes). */
static bool in_memory(const struct provider *pv, const struct provided *t) {
  return (pv->device_bytes && pv->device_bytes(pv, t)) || (pv->host_bytes && pv->host_bytes(pv, t));
}

/* A new entry for t: its name indexed, its room (*dst) at the end of the bytes, which the caller checked
 * has room. */
static int add_entry(struct scale_cache *c, const struct provided *t, unsigned char **dst) {
  int rc = grow_array((void **)&c->offset, &c->cap_entries, c->n + 1, sizeof *c->offset);
  if (!rc && !(rc = name_index_put(&c->index, t->name, c->n, NULL))) {
    c->offset[c->n++] = c->used;
    *dst = c->bytes + c->used;
    c->used += t->nbytes;
  }
  return rc;
}

/*
 * Keeps room in the cache for scale tensor t while it has room, to be read by read_kept; one in
 * memory already, or kept already (a kv_scale feeding k and v), is skipped.
 */
static int keep_scale(struct scale_cache *c, const struct provided *t) {
  size_t seen;
  if (in_memory(c->inner, t) || name_index_get(&c->index, t->name, &seen))
    return 0;
  if (c->cap - c->used < t->nbytes) {
    c->complete = false; /* no room: read again by the apply, and checked again as it loads */
    return 0;
  }
  unsigned char *dst;
  int rc = grow_array((void **)&c->pending, &c->cap_pending, c->n_pending + 1, sizeof *c->pending);
  if (!rc && !(rc = add_entry(c, t, &dst))) {
    c->pending[c->n_pending++] = *t;
    c->pending_bytes += t->nbytes;
  }
  return rc;
}

/*
 * Room in the cache for a host copy of scale tensor t, which lives in device memory (*dst, or NULL when
 * there is no room or it has one already): a small scale's checked bytes, kept so that the apply fills its
 * param's host mirror from them instead of reading the device again.
 */
static int keep_host_copy(struct scale_cache *c, const struct provided *t, unsigned char **dst) {
  size_t seen;
  *dst = NULL;
  if (name_index_get(&c->index, t->name, &seen) || c->cap - c->used < t->nbytes)
    return 0;
  return add_entry(c, t, dst);
}

/* Threads that read the kept scales (most of a validation's time is their reads), when they add
 * up to at least threaded_scale_bytes: each takes a contiguous share of them in file order, so the
 * provider's read_many still reads each run of adjacent tensors in one call. */
#define SCALE_READERS 16
#define THREADED_SCALE_BYTES ((size_t)256 << 10)
static _Atomic size_t threaded_scale_bytes = THREADED_SCALE_BYTES;

void reload_set_threaded_scale_bytes(size_t bytes) {
  atomic_store_explicit(&threaded_scale_bytes, bytes ? bytes : THREADED_SCALE_BYTES, memory_order_relaxed);
}

static size_t threaded_scales_from(void) {
  return atomic_load_explicit(&threaded_scale_bytes, memory_order_relaxed);
}

/* How many threads take `total` bytes of scales: one below threaded_scale_bytes, else one per core, at
 * most SCALE_READERS. */
static int scale_shares(size_t total) {
  long cores = total < threaded_scales_from() ? 1 : sysconf(_SC_NPROCESSORS_ONLN); /* sysconf reads /sys */
  return cores < 2 ? 1 : cores > SCALE_READERS ? SCALE_READERS : (int)cores;
}

/* Cuts items [0, n), bytes(ctx, i) each and `total` in all, into `shares` runs of about equal bytes, in
 * order: run k is [from[k], from[k + 1]). */
static void cut_shares(size_t n, size_t total, int shares, size_t (*bytes)(const void *ctx, size_t i),
                       const void *ctx, size_t from[SCALE_READERS + 1]) {
  size_t to = 0, done = 0;
  from[0] = 0;
  for (int k = 0; k < shares; k++) {
    size_t goal = total * (size_t)(k + 1) / (size_t)shares;
    while (to < n && (k == shares - 1 || done < goal))
      done += bytes(ctx, to++);
    from[k + 1] = to;
  }
}

/* Runs fn on each share's argument (args, `size` bytes apart) on threads, this thread taking the first
 * and any a thread could not take; returns when every share has run. */
static void run_shares(int shares, void *(*fn)(void *), void *args, size_t size) {
  pthread_t tid[SCALE_READERS];
  bool started[SCALE_READERS] = {false};
  for (int k = 1; k < shares; k++)
    started[k] = pthread_create(&tid[k], NULL, fn, (char *)args + (size_t)k * size) == 0;
  for (int k = 0; k < shares; k++)
    if (!started[k])
      fn((char *)args + (size_t)k * size);
  for (int k = 1; k < shares; k++)
    if (started[k])
      pthread_join(tid[k], NULL);
}

/*
 * One reader's share of the kept scales: tensors ts[0 .. n) into dsts, read in batches of about
 * CHECKED_BATCH bytes, each batch's values checked right after its read, while they are in the cache
 * (a second pass over a large model's scales came from memory again and cost as much as the read).
 * After a bad value the share still reads every tensor, and checks no more: the ordered check that then
 * names the first bad scale runs in shares of its own, and one of them may start among this share's later
 * tensors, which must hold this reload's bytes (not the last reload's, nor memory never written).
 */
#define CHECKED_BATCH ((size_t)1 << 20)
struct kept_share {
  const struct provider *pv;
  const struct provided *ts;
  void *const *dsts;
  size_t n;
  const struct scale_cache *cache;
  const size_t *first_check, *which; /* tensor i's checks: which[first_check[i] .. first_check[i + 1]) */
  int rc;
  bool bad;  /* a value failed its check (named by the ordered check after) */
  char *msg; /* the failure's message (set in the share's thread) */
};

static int read_share(struct kept_share *sh) {
  const struct provider *pv = sh->pv;
  int rc = 0;
  for (size_t i = 0, end; i < sh->n && !rc; i = end) {
    size_t bytes = sh->ts[i].nbytes;
    for (end = i + 1; end < sh->n && bytes + sh->ts[end].nbytes <= CHECKED_BATCH; end++)
      bytes += sh->ts[end].nbytes;
    if (pv->read_many)
      rc = pv->read_many(pv, sh->ts + i, end - i, sh->dsts + i);
    for (size_t j = i; j < end && !rc && !pv->read_many; j++)
      rc = pv->read(pv, &sh->ts[j], sh->dsts[j]);
    for (size_t j = i; j < end && !rc && !sh->bad; j++)
      for (size_t c = sh->first_check[j]; c < sh->first_check[j + 1] && !sh->bad; c++) {
        const struct scale_check *ck = &sh->cache->checks[sh->which[c]];
        sh->bad = bad_scales((enum qkeep_dtype)ck->t.dtype, sh->dsts[j],
                             ck->t.nbytes / qkeep_dtype_size((enum qkeep_dtype)ck->t.dtype), &ck->param->rule,
                             &(size_t){0}) != NULL;
      }
  }
  if (rc && !(sh->msg = xstrdup(qkeep_errmsg())))
    rc = QKEEP_E_NOMEM;
  return sh->rc = rc;
}

static void *read_share_thread(void *arg) {
  read_share(arg);
  return NULL;
}

/* Reads every kept tensor not read yet, in up to SCALE_READERS shares at once (one per core). */
static size_t pending_bytes(const void *ctx, size_t i) {
  return ((const struct scale_cache *)ctx)->pending[i].nbytes;
}

/*
 * Reads every kept tensor not read yet (entries first .. first + n_pending of the cache), in up to
 * SCALE_READERS shares at once (one per core), and checks on the way the listed checks whose bytes they
 * are (*fused: true for check i when it was among them; *bad: when one of those failed).
 */
static int read_kept(struct scale_cache *c, bool *fused, bool *bad) {
  size_t n = c->n_pending, total = 0, first = c->n - n;
  c->n_pending = 0;
  c->pending_bytes = 0;
  *bad = false;
  if (!n)
    return 0;
  size_t checks = c->n_checks ? c->n_checks : 1;
  void **dsts = malloc(n * sizeof *dsts);
  size_t *first_check = calloc(n + 2, sizeof *first_check), *which = malloc(checks * sizeof *which),
         *of = malloc(checks * sizeof *of); /* per check: its pending tensor, or n */
  if (!dsts || !first_check || !which || !of) {
    free(dsts), free(first_check), free(which), free(of);
    return set_error(QKEEP_E_NOMEM, "out of memory");
  }
  for (size_t i = 0; i < n; i++) {
    dsts[i] = c->bytes + c->offset[first + i];
    total += c->pending[i].nbytes;
  }
  /* The checks of each pending tensor, in list order (a counting sort: linear in checks). */
  for (size_t i = 0; i < c->n_checks; i++) {
    size_t at;
    of[i] = n;
    if (name_index_get(&c->index, c->checks[i].t.name, &at) && at >= first && at - first < n)
      of[i] = at - first, first_check[at - first + 2]++;
  }
  for (size_t p = 0; p < n; p++)
    first_check[p + 2] += first_check[p + 1];
  for (size_t i = 0; i < c->n_checks; i++)
    if ((fused[i] = of[i] < n))
      which[first_check[of[i] + 1]++] = i;
  free(of);
  int shares = scale_shares(total);
  size_t from[SCALE_READERS + 1];
  cut_shares(n, total, shares, pending_bytes, c, from);
  struct kept_share sh[SCALE_READERS];
  for (int k = 0; k < shares; k++)
    sh[k] = (struct kept_share){.pv = c->inner,
                                .ts = c->pending + from[k],
                                .dsts = dsts + from[k],
                                .n = from[k + 1] - from[k],
                                .cache = c,
                                .first_check = first_check + from[k],
                                .which = which};
  run_shares(shares, read_share_thread, sh, sizeof sh[0]);
  int rc = 0;
  for (int k = 0; k < shares; k++) {
    if (sh[k].rc && !rc)
      rc = set_error(sh[k].rc, "%s", sh[k].msg ? sh[k].msg : "read failed");
    *bad |= sh[k].bad;
    free(sh[k].msg);
  }
  free(dsts), free(first_check), free(which);
  return rc;
}

/*
 * Host bytes of a provided tensor to check: in place when the provider holds
 * them in host memory or the cache kept them, else read (or copied from the
 * device) into *scratch (malloc'd, the caller frees).
 */
static int scale_bytes(const struct scale_cache *c, const struct device *dev, const struct provided *t,
                       const unsigned char **out, unsigned char **scratch) {
  const struct provider *pv = c->inner;
  const void *on_device = pv->device_bytes ? pv->device_bytes(pv, t) : NULL;
  const void *on_host = pv->host_bytes ? pv->host_bytes(pv, t) : NULL;
  size_t at;
  if (on_host || (!on_device && name_index_get(&c->index, t->name, &at))) {
    *out = on_host ? on_host : c->bytes + c->offset[at];
    return 0;
  }
  if (!(*scratch = malloc(t->nbytes ? t->nbytes : 1)))
    return set_error(QKEEP_E_NOMEM, "out of memory");
  *out = *scratch;
  return on_device ? dev_d2h(dev, *scratch, on_device, t->nbytes) : pv->read(pv, t, *scratch);
}

/* ---- validation: nothing changes until all of W1 is known good ------------------------- */

/* A scale tensor's values must be valid before anything is written. */
static int check_scale_values(const qkeep_layer *layer, const qkeep_param *p, const struct scale_cache *c,
                              const struct provided *t) {
  const unsigned char *bytes = NULL;
  unsigned char *scratch = NULL;
  int rc = scale_bytes(c, layer_device(layer), t, &bytes, &scratch);
  if (!rc)
    rc = check_scales(p, t, 0, bytes, t->nbytes);
  free(scratch);
  return rc;
}

/*
 * Device-resident scales (a weight sync's bucket in device memory) are copied to the host to be
 * checked: one copy per run of them close together in device memory instead of one per tensor (a
 * Qwen3-MoE layer has over a thousand, each copy a round trip to the device). Two tensors share a
 * copy when the gap between them is at most DEVICE_RUN_GAP bytes or the tensor bytes of the run so
 * far, so the bytes copied stay below twice the scales' plus DEVICE_RUN_GAP per run. Only tensors known
 * to lie in one allocation (a block: the sync's bucket) share a copy; should the device still refuse
 * one, its tensors are copied one by one.
 */
#define DEVICE_RUN_GAP ((size_t)4096)
/* A run ends before it passes this many bytes (one tensor larger is a run of its own): the host buffer
 * stays one size, reused and warm in cache, rather than a fresh allocation of a bucket's scales. */
#define DEVICE_RUN_MAX ((size_t)4 << 20)

static int by_device_address(const void *a, const void *b) {
  const struct scale_item *x = a, *y = b;
  if (x->dev != y->dev)
    return (uintptr_t)x->dev < (uintptr_t)y->dev ? -1 : 1;
  if (x->block != y->block)
    return (uintptr_t)x->block < (uintptr_t)y->block ? -1 : 1;
  return (uintptr_t)x->at < (uintptr_t)y->at ? -1 : (uintptr_t)x->at > (uintptr_t)y->at;
}

/* Items [first, last) from one copy of their run (`host`, of the run's bytes, malloc'd as needed), or each
 * from its own copy when the device refuses the run's. */
static int check_run(const struct scale_item *items, size_t first, size_t last, uintptr_t start, size_t bytes,
                     unsigned char **host, size_t *cap) {
  if (bytes > *cap) {
    unsigned char *grown = realloc(*host, bytes);
    if (!grown)
      return set_error(QKEEP_E_NOMEM, "out of memory for %zu bytes of device scales", bytes);
    *host = grown, *cap = bytes;
  }
  bool one_copy = last - first > 1 && dev_d2h(items[first].dev, *host, (const void *)start, bytes) == 0;
  int rc = 0;
  for (size_t k = first; k < last && !rc; k++) {
    const struct scale_item *it = &items[k];
    if (!one_copy && (rc = dev_d2h(it->dev, *host, it->at, it->t.nbytes)) != 0)
      break;
    const unsigned char *checked = *host + (one_copy ? (uintptr_t)it->at - start : 0);
    if (!(rc = check_scales(it->param, &it->t, 0, checked, it->t.nbytes)) && it->keep)
      memcpy(it->keep, checked, it->t.nbytes);
  }
  return rc;
}

/* The device rule that checks the whole of a scale param's byte values (what bad_scales refuses of its
 * dtype under its rule), or 0 when the check needs more than bytes (a float dtype, a scale divided by). */
static int byte_rule(const struct scale_item *it) {
  bool divided = it->param->rule.positive || it->param->rule.inverted;
  switch (it->t.dtype) {
  case QKEEP_DTYPE_F8_E4M3: return divided ? 0 : QKEEP_RULE_E4M3_SCALE;
  case QKEEP_DTYPE_F8_E8M0:
  case QKEEP_DTYPE_U8: return QKEEP_RULE_E8M0_SCALE;
  default: return 0;
  }
}

/*
 * Checks on their device, with the backend's find_bad_values (ABI 1.6), the items whose check is a byte
 * rule and whose bytes need not come to the host (no `keep`): one call per device for all of them (items
 * sorted by device). Those found valid are removed from items (*n shrinks, the order kept); when a device
 * finds a bad byte, its items all stay, for the host path to name the tensor and element.
 */
static int check_on_devices(struct scale_item *items, size_t *n) {
  struct qkeep_value_range *ranges = malloc((*n ? *n : 1) * sizeof *ranges);
  size_t *which = malloc((*n ? *n : 1) * sizeof *which), kept = 0;
  int rc = ranges && which ? 0 : set_error(QKEEP_E_NOMEM, "out of memory for the check of %zu scales", *n);
  for (size_t first = 0, last; first < *n && !rc; first = last) {
    const struct device *dev = items[first].dev;
    for (last = first + 1; last < *n && items[last].dev == dev; last++)
      ;
    if (!dev || !memory_ops_find_bad_values(dev->ops))
      continue;
    size_t m = 0, bad;
    for (size_t j = first; j < last; j++)
      if (!items[j].keep && byte_rule(&items[j])) {
        ranges[m] = (struct qkeep_value_range){items[j].at, items[j].t.nbytes, byte_rule(&items[j])};
        which[m++] = j;
      }
    if (m && !(rc = dev_find_bad_values(dev, ranges, m, &bad)) && bad == m)
      for (size_t k = 0; k < m; k++)
        items[which[k]].at = NULL; /* valid: dropped below */
  }
  for (size_t i = 0; i < *n && !rc; i++)
    if (items[i].at)
      items[kept++] = items[i];
  if (!rc)
    *n = kept;
  free(ranges), free(which);
  return rc;
}

/* Where the scales of many tensors are gathered (check_gathered): DEVICE_RUN_MAX bytes of device memory,
 * the device's owner's (made once, freed with the model) or, for a device without an owner, this check's. */
struct gather {
  const struct device *dev;
  void *scratch;
  struct qkeep_copy_range *ranges;
  size_t cap_ranges;
};

static void gather_free(struct gather *g) {
  if (g->scratch && !g->dev->gather)
    dev_free(g->dev, g->scratch);
  free(g->ranges);
}

/* Makes g's scratch the device's. */
static int gather_on(struct gather *g, const struct device *dev) {
  if (g->scratch && g->dev == dev)
    return 0;
  if (g->scratch && !g->dev->gather)
    dev_free(g->dev, g->scratch);
  g->dev = dev, g->scratch = dev->gather ? *dev->gather : NULL;
  int rc = g->scratch ? 0 : dev_alloc(dev, DEVICE_RUN_MAX, &g->scratch);
  if (!rc && dev->gather)
    *dev->gather = g->scratch;
  if (rc)
    g->scratch = NULL;
  return rc;
}

/* Whether a device gathers scattered scales by a batched copy (ABI 1.5's copy_d2d_batch). */
static bool gathers(const struct device *dev) {
  const struct qkeep_memory_ops *ops = dev->ops;
  return ops->size >= offsetof(struct qkeep_memory_ops, copy_d2d_batch) + sizeof(ops->copy_d2d_batch) &&
         ops->copy_d2d_batch;
}

/* A gathered item's room: its bytes, rounded up to 16 (each item starts aligned for any dtype). */
static size_t gathered_bytes(const struct scale_item *it) { return (it->t.nbytes + 15) & ~(size_t)15; }

/*
 * Items [first, last) of one device (their gathered_bytes at most DEVICE_RUN_MAX in all): gathered into
 * one device buffer by one batched copy, brought to the host by one copy, checked there. A layer's
 * per-tensor scales lie among its block scales (a MoE layer's hundreds of them, one between each
 * expert's): one trip to the host instead of one per run.
 */
static int check_gathered(struct gather *g, const struct scale_item *items, size_t first, size_t last,
                          unsigned char **host, size_t *cap) {
  const struct device *dev = items[first].dev;
  int rc = gather_on(g, dev);
  if (rc || (rc = grow_array((void **)&g->ranges, &g->cap_ranges, last - first, sizeof *g->ranges)))
    return rc;
  if (*cap < DEVICE_RUN_MAX) {
    unsigned char *grown = realloc(*host, DEVICE_RUN_MAX);
    if (!grown)
      return set_error(QKEEP_E_NOMEM, "out of memory for %zu bytes of device scales", DEVICE_RUN_MAX);
    *host = grown, *cap = DEVICE_RUN_MAX;
  }
  size_t at = 0, n = 0;
  for (size_t k = first; k < last; at += gathered_bytes(&items[k]), k++)
    if (items[k].t.nbytes)
      g->ranges[n++] = (struct qkeep_copy_range){(char *)g->scratch + at, items[k].at, items[k].t.nbytes};
  if (!(rc = dev_d2d_batch(dev, g->ranges, n)))
    rc = dev_d2h(dev, *host, g->scratch, at);
  at = 0;
  for (size_t k = first; k < last && !rc; at += gathered_bytes(&items[k]), k++) {
    const struct scale_item *it = &items[k];
    if (!(rc = check_scales(it->param, &it->t, 0, *host + at, it->t.nbytes)) && it->keep)
      memcpy(it->keep, *host + at, it->t.nbytes);
  }
  return rc;
}

int check_device_scales(struct scale_item *items, size_t n) {
  qsort(items, n, sizeof *items, by_device_address);
  int on_devices = check_on_devices(items, &n);
  if (on_devices)
    return on_devices;
  unsigned char *host = NULL;
  size_t cap = 0;
  struct gather g = {0};
  int rc = 0;
  for (size_t first = 0, last; first < n && !rc; first = last) {
    const struct scale_item *it = &items[first];
    if (!it->dev) { /* in host memory: checked where it is */
      if (!(rc = check_scales(it->param, &it->t, 0, it->at, it->t.nbytes)) && it->keep)
        memcpy(it->keep, it->at, it->t.nbytes);
      last = first + 1;
      continue;
    }
    if (gathers(it->dev)) {
      size_t bytes = 0;
      for (last = first;
           last < n && items[last].dev == it->dev && bytes + gathered_bytes(&items[last]) <= DEVICE_RUN_MAX;
           last++)
        bytes += gathered_bytes(&items[last]);
      if (last - first > 1) {
        rc = check_gathered(&g, items, first, last, &host, &cap);
        continue;
      }
      last = first + 1; /* one alone (or larger than a gather): its own copy */
      rc = check_run(items, first, last, (uintptr_t)it->at, it->t.nbytes, &host, &cap);
      continue;
    }
    uintptr_t start = (uintptr_t)it->at, end = start + it->t.nbytes;
    size_t tensor_bytes = it->t.nbytes;
    for (last = first + 1;
         last < n && it->block && items[last].dev == it->dev && items[last].block == it->block; last++) {
      uintptr_t at = (uintptr_t)items[last].at;
      size_t gap = at > end ? (size_t)(at - end) : 0;
      if ((gap > DEVICE_RUN_GAP && gap > tensor_bytes) || at + items[last].t.nbytes - start > DEVICE_RUN_MAX)
        break;
      if (at + items[last].t.nbytes > end)
        end = at + items[last].t.nbytes;
      tensor_bytes += items[last].t.nbytes;
    }
    rc = check_run(items, first, last, start, (size_t)(end - start), &host, &cap);
  }
  gather_free(&g);
  free(host);
  return rc;
}

/* The layer's scheme flags W1's config implies must be the model's (sym, act order, ...). */
static int check_config(const qkeep_layer *layer, const struct quant_config *qc, const char *where) {
  const struct scheme *sch = layer->scheme_ops;
  if (!qc || !sch || sch == &scheme_unquantized || sch == &scheme_kv_scales)
    return 0;
  /* As at a cold start, quantized tensors need a config that declares them: a bare .safetensors file has
   * none. */
  if (qc->method == QM_NONE)
    return set_error(QKEEP_E_FORMAT,
                     "%s: the checkpoint declares no quantization (no quantization config found; a bare "
                     ".safetensors file has none, reload its directory), layer %s of the model is %s",
                     where, layer->name, layer->scheme);
  if (strcmp(qc->scheme, layer->scheme) != 0)
    return set_error(QKEEP_E_FORMAT, "%s: the checkpoint is %s, layer %s of the model is %s", where,
                     qc->scheme, layer->name, layer->scheme);
  uint32_t mask = QKEEP_LAYER_F_WEIGHT_SYM | QKEEP_LAYER_F_ACT_ORDER | QKEEP_LAYER_F_GPTQ_V2 |
                  QKEEP_LAYER_F_INPUT_DYNAMIC | QKEEP_LAYER_F_INPUT_ASYM | QKEEP_LAYER_F_WEIGHT_PER_TENSOR;
  /* GPTQ `dynamic` rules may give this layer's modules their own layout: judge it by its first module. */
  struct quant_config module_qc = *qc;
  if (layer->n_sources && qc->n_dynamic) {
    const char *name = layer->sources[0].checkpoint_name, *dot = strrchr(name, '.');
    char *module = dot ? strndup(name, (size_t)(dot - name)) : NULL;
    int rc = module ? quant_config_for_module(qc, module, &module_qc) : 0;
    free(module);
    if (rc)
      return rc;
  }
  uint32_t want = sch->flags ? sch->flags(&module_qc) & mask : 0;
  if ((layer->dims.flags & mask) != want)
    return set_error(QKEEP_E_FORMAT,
                     "%s: its quantization config (flags 0x%x) differs from the model's (0x%x) at %s", where,
                     want, layer->dims.flags & mask, layer->name);
  return 0;
}

/* The provider's block holding the n bytes at `at`, or NULL. */
static const struct mem_block *block_of(const struct provider *pv, const void *at, size_t n) {
  uintptr_t a = (uintptr_t)at;
  for (size_t i = 0; at && i < pv->n_blocks; i++) {
    uintptr_t lo = (uintptr_t)pv->blocks[i].data;
    if (a >= lo && n <= pv->blocks[i].bytes && a - lo <= pv->blocks[i].bytes - n)
      return &pv->blocks[i];
  }
  return NULL;
}

/* A share of the listed scales checked in host memory by one thread: checks [from, to) of the cache's list
 * (those in device memory or in a checked block skipped); the first that fails, and its message. */
struct check_share {
  const struct scale_cache *cache;
  const size_t *which;
  size_t n;
  size_t failed; /* index into which, or n */
  int rc;
  char *msg;
};

static void *check_share_thread(void *arg) {
  struct check_share *sh = arg;
  sh->failed = sh->n;
  for (size_t i = 0; i < sh->n; i++) {
    const struct scale_check *ck = &sh->cache->checks[sh->which[i]];
    int rc = check_scale_values(ck->layer, ck->param, sh->cache, &ck->t);
    if (rc) {
      sh->failed = i, sh->rc = rc;
      if (!(sh->msg = xstrdup(qkeep_errmsg())))
        sh->rc = QKEEP_E_NOMEM;
      break;
    }
  }
  return NULL;
}

/*
 * Checks the listed scales `which` (indexes into the cache's list, in its order) in host memory: on up to
 * SCALE_READERS threads in shares of about equal bytes when they add up to threaded_scale_bytes (one
 * thread checks a 4 GB NVFP4 model's 250 MB of block scales in about 40 ms), else here. The error is the
 * first failing scale's in list order, whatever thread found it.
 */
struct listed {
  const struct scale_cache *cache;
  const size_t *which;
};
static size_t listed_bytes(const void *ctx, size_t i) {
  const struct listed *l = ctx;
  return l->cache->checks[l->which[i]].t.nbytes;
}

static int check_on_host(const struct scale_cache *cache, const size_t *which, size_t n) {
  size_t total = 0;
  for (size_t i = 0; i < n; i++)
    total += cache->checks[which[i]].t.nbytes;
  int shares = scale_shares(total);
  size_t from[SCALE_READERS + 1];
  cut_shares(n, total, shares, listed_bytes, &(struct listed){cache, which}, from);
  struct check_share sh[SCALE_READERS];
  for (int k = 0; k < shares; k++)
    sh[k] = (struct check_share){cache, which + from[k], from[k + 1] - from[k], 0, 0, NULL};
  run_shares(shares, check_share_thread, sh, sizeof sh[0]);
  int rc = 0;
  for (int k = 0; k < shares; k++) {
    if (sh[k].rc && !rc) /* shares are in list order: the first share that failed has the first failure */
      rc = set_error(sh[k].rc, "%s", sh[k].msg ? sh[k].msg : "out of memory");
    free(sh[k].msg);
  }
  return rc;
}

/* Reads the kept scales not read yet and checks the values of every listed scale tensor (those read now as
 * they are read; those in device memory in runs: check_device_scales; none in a block its sender checked
 * already). When a value read now is bad, every host check runs again in list order, so that the error names
 * the first bad scale in that order, as the checks in one pass would. */
static int check_listed_scales(struct scale_cache *cache) {
  const struct provider *pv = cache->inner;
  struct scale_item *on_device = pv->device_bytes ? malloc((cache->n_checks + 1) * sizeof *on_device) : NULL;
  size_t *on_host_checks = malloc((cache->n_checks + 1) * sizeof *on_host_checks);
  bool *fused = calloc(cache->n_checks + 1, sizeof *fused), bad = false;
  size_t n = 0, n_host = 0;
  int rc = (!pv->device_bytes || on_device) && on_host_checks && fused
               ? read_kept(cache, fused, &bad)
               : set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < cache->n_checks && !rc; i++) {
    const struct scale_check *ck = &cache->checks[i];
    if (fused[i] && !bad) /* checked as it was read, and good */
      continue;
    const void *at = on_device ? pv->device_bytes(pv, &ck->t) : NULL;
    const void *on_host = !at && pv->host_bytes ? pv->host_bytes(pv, &ck->t) : NULL;
    const struct mem_block *block = block_of(pv, at ? at : on_host, ck->t.nbytes);
    unsigned char *keep = NULL;
    if (block && block->checked)
      continue;
    if (at && ck->param->create_bytes <= MIRROR_MAX && (rc = keep_host_copy(cache, &ck->t, &keep)) != 0)
      break;
    if (at)
      on_device[n++] = (struct scale_item){
          layer_device(ck->layer), at, block ? block->data : NULL, ck->t, ck->param, keep};
    else
      on_host_checks[n_host++] = i;
  }
  if (!rc && n_host)
    rc = check_on_host(cache, on_host_checks, n_host);
  if (!rc && n)
    rc = check_device_scales(on_device, n);
  free(on_device);
  free(on_host_checks);
  free(fused);
  cache->n_checks = 0;
  return rc;
}

/*
 * Every source of the layer is in the provider as the model expects; its scales get room in the cache
 * and are listed for the check of their values.
 *
 * A source quantized on load is read whole here for its values (a NaN or an Inf cannot be quantized),
 * and read again when applying quantizes it: two reads, kept on purpose. One read would find the NaN
 * only while applying, after earlier layers changed, and then only a rollback could give W0 back. A
 * rollback re-reads W0 from its files, so it cannot promise W0: W0 may come from no file (buffers, a
 * sync, a direct load, a partial reload), and its files may be rewritten in place while the reload runs
 * (a trainer saving into the same directory), which the rollback detects and can only answer by
 * poisoning the model. Keeping what one read made until the end instead (the unquantized or the
 * quantized bytes of every layer) would hold a model's worth of memory where a load holds two units.
 * So a bad value is refused here, before anything changes, whatever W0 came from. (What only the
 * quantized bytes show, such as an int8 scale that f32's largest weight makes overflow, is found as they
 * land, as a cold start finds it, and rolled back from there.)
 */
static int validate_sources(const qkeep_layer *layer, struct scale_cache *cache) {
  const struct provider *pv = cache->inner;
  struct provided t;
  int rc = 0;
  for (size_t i = 0; i < layer->n_sources && !rc; i++) {
    const qkeep_param *p = layer->sources[i].param;
    if ((rc = check_source(layer, pv, &layer->sources[i], &t)) || !p->scale)
      continue;
    rc = grow_array((void **)&cache->checks, &cache->cap_checks, cache->n_checks + 1, sizeof *cache->checks);
    if (!rc) {
      cache->checks[cache->n_checks++] = (struct scale_check){layer, p, t};
      rc = keep_scale(cache, &t);
    }
  }
  /* a NaN cannot be quantized: values in files are checked for the whole model at the end, in one pass */
  return rc ? rc : online_check_layer_values(layer, pv, &cache->values);
}

/*
 * Decides which layers W1 updates (all of them, or with QKEEP_RELOAD_PARTIAL those it
 * has tensors for) and checks every tensor they load. Changes nothing.
 */
static int validate(qkeep_model *model, struct scale_cache *cache, const struct quant_config *qc,
                    unsigned flags, bool *selected) {
  const struct provider *pv = cache->inner;
  size_t chosen = 0;
  for (size_t l = 0; l < model->n_layers; l++) {
    qkeep_layer *layer = model->layers[l];
    size_t present = 0;
    struct provided t;
    /* Only a partial reload skips layers W1 has nothing for (a full one checks every source below). */
    for (size_t i = 0; i < layer->n_sources && (flags & QKEEP_RELOAD_PARTIAL) && !present; i++)
      present += pv->find(pv, layer->sources[i].checkpoint_name, &t);
    selected[l] = false;
    if (present == 0 && (flags & QKEEP_RELOAD_PARTIAL))
      continue;
    int rc = validate_sources(layer, cache);
    if (!rc)
      rc = check_config(layer, qc, pv->what);
    /* A few kilobytes of scales are read now, one batch per layer, while their names are hot; a layer's
     * megabytes (the scales of a large model) wait for the threaded read at the end. */
    if (!rc && cache->pending_bytes < threaded_scales_from())
      rc = check_listed_scales(cache);
    if (rc)
      return rc;
    selected[l] = true;
    chosen++;
  }
  /* Every checkpoint name of the model was found in W1 (above): when every layer was checked and W1 holds
   * as many distinct names as the model loads, the two sets are equal and nothing is left over. */
  size_t n = pv->count(pv);
  if (chosen == model->n_layers && n == model->index.sources.count)
    n = 0;
  for (size_t i = 0; i < n; i++) {
    const char *name = pv->name_at(pv, i);
    if (!qkeep_model_lookup(model, name, NULL) &&
        !shard_is_foreign(model, name)) /* another rank's: param/foreign.c */
      return set_error(QKEEP_E_NOTFOUND, "%s: tensor '%s' is not part of this model", pv->what, name);
  }
  if (!chosen)
    return set_error(QKEEP_E_NOTFOUND, "%s: holds no tensor of this model", pv->what);
  /* Every name and shape holds: now the values of the scales left, read all at once, and of the
   * unquantized weights quantized on load. */
  int rc = check_listed_scales(cache);
  return rc ? rc : online_value_checks_run(&cache->values, pv);
}

/* ---- applying -------------------------------------------------------------------------------- */

/*
 * Gives every loader param of the layer its checkpoint view back, over its own
 * storage (a released one gets new storage), live, with the bytes no source
 * covers zeroed as in a cold start (a param its sources write whole is not:
 * layer_find_covered, the cold start's rule).
 */
static int restore_layer(qkeep_layer *layer) {
  bool *covered = malloc((layer->n_params ? layer->n_params : 1) * sizeof *covered);
  int rc = covered ? layer_find_covered(layer, covered) : set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < layer->n_params && !rc; i++) {
    qkeep_param *p = layer->params[i];
    if (!p->view.storage) {
      rc = (covered[i] ? storage_new_unfilled : storage_new)(layer_device(layer), p->create_bytes,
                                                             &p->view.storage);
    } else if (!covered[i]) {
      rc = dev_fill(layer_device(layer), p->view.storage->data, 0, p->create_bytes);
    }
    if (rc) {
      rc = add_error_context(rc, "restoring %s.%s", layer->name, p->checkpoint_name);
      break;
    }
    p->view.offset = 0;
    p->view.spec = p->create_spec;
    p->state = QKEEP_PARAM_LIVE;
    p->transformed = false;
    free(p->release_reason);
    p->release_reason = NULL;
  }
  free(covered);
  return rc;
}

/* Whether a reload started changing the layer: what a rollback must give back. */
struct layer_before {
  bool known;
};

/*
 * Restores, loads (checking scale values in host memory on their way, check_scales) and re-runs
 * normalisation and PWAL for each selected layer. scales_checked: every scale byte comes from what
 * validation checked, so the load does not check them again. before (NULL: not kept): each selected
 * layer's digest is taken there first. fault: the fault a test injects at a layer (layer -1: none).
 */
static int apply(qkeep_model *model, const struct provider *pv, const bool *selected, bool scales_checked,
                 struct layer_before *before, struct reload_fault fault, double *t_read, double *t_pwal,
                 double *t_tail) {
  struct staging st = {.scales_checked = scales_checked};
  /* The selected layers, in order: a layer quantized on load reads the next one's first unit ahead. */
  qkeep_layer **order = malloc((model->n_layers ? model->n_layers : 1) * sizeof *order);
  int rc = order ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t l = 0; l < model->n_layers && !rc; l++)
    if (selected[l])
      order[st.n_order++] = model->layers[l];
  st.order = order;
  model_spares(model, true);
  for (size_t l = 0; l < model->n_layers && !rc; l++) {
    if (!selected[l])
      continue;
    qkeep_layer *layer = model->layers[l];
    double a = now_seconds();
    if (before)
      before[l].known = true;
    if ((long)l == fault.layer)
      rc = set_error(fault.code, "injected fault at layer %s", layer->name);
    if (!rc)
      rc = restore_layer(layer);
    size_t next = l + 1;
    while (next < model->n_layers && !selected[next])
      next++;
    st.ahead = next < model->n_layers ? model->layers[next] : NULL;
    if (!rc)
      rc = load_layer_sources(layer, pv, &st);
    double b = now_seconds();
    if (!rc && next < model->n_layers) /* the next layer's bytes come in while this one's PWAL runs */
      load_read_ahead(model->layers[next], pv, &st);
    if (!rc)
      rc = finish_layer(layer);
    *t_read += b - a;
    *t_pwal += now_seconds() - b;
    if (model->progress)
      model->progress(model->progress_user, l + 1, model->n_layers, layer->name);
  }
  double tail = now_seconds();
  if (!rc)
    rc = model_sync(model);
  int staged = staging_free(&st);
  free(order);
  model_spares(model, false);
  *t_tail = now_seconds() - tail;
  return rc ? rc : staged;
}

/*
 * Puts the layers that W1 touched (those with a digest in `before`) back to W0, from the
 * checkpoint W0 came from, and checks that each hashes to its digest from before the reload.
 */
static int roll_back(qkeep_model *model, const struct layer_before *before) {
  if (!model->source.path)
    return set_error(QKEEP_E_STATE, "no checkpoint holds the model's previous weights");
  struct ckpt *ck;
  int rc = ckpt_open(model->source.path, &ck);
  if (rc)
    return rc;
  struct provider pv;
  ckpt_provider(&pv, ck);
  bool *redo = calloc(model->n_layers ? model->n_layers : 1, sizeof *redo);
  if (!redo)
    rc = set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t l = 0; !rc && l < model->n_layers; l++)
    redo[l] = before[l].known;
  double ignore_read = 0, ignore_pwal = 0, ignore_tail = 0;
  const struct reload_fault none = {.layer = -1}; /* an injected fault is for the reload, not its rollback */
  /* W0's files must be the very files the model read (a trainer may have saved into the same
   * directory since), before the re-read and after it: else the re-read would give a mix. */
  if (!rc && (rc = model_source_unchanged(model, ck)))
    add_error_context(rc, "%s no longer holds the model's previous weights", model->source.path);
  if (!rc)
    rc = apply(model, &pv, redo, false, NULL, none, &ignore_read, &ignore_pwal, &ignore_tail);
  if (!rc && (rc = model_source_unchanged(model, ck)))
    add_error_context(rc, "%s changed while the rollback read it", model->source.path);
  free(redo);
  ckpt_close(ck);
  return rc;
}

/* The whole reload, from any provider. `path` is W1's checkpoint (NULL for buffers). */
static int reload(qkeep_model *model, const struct provider *pv, const struct quant_config *qc,
                  unsigned flags, const char *path, const struct ckpt *ck) {
  if (!model->n_layers)
    return set_error(QKEEP_E_STATE, "reload: the model holds no layers (load a checkpoint first)");
  if (model->poisoned && (flags & QKEEP_RELOAD_PARTIAL))
    return set_error(QKEEP_E_STATE,
                     "reload: the model holds a mix of weights after a failed reload; a full reload "
                     "is needed, not a partial one");
  double t_validate = now_seconds();
  bool *selected = calloc(model->n_layers, sizeof *selected);
  struct layer_before *before = calloc(model->n_layers, sizeof *before);
  struct model_source new_source; /* now: once W1 is in, nothing may fail */
  int prepared = model_source_prepare(path, ck, &new_source);
  if (!selected || !before || prepared) {
    free(selected);
    free(before);
    model_source_discard(&new_source);
    return prepared ? prepared : set_error(QKEEP_E_NOMEM, "out of memory");
  }
  struct scale_cache cache = {.inner = pv};
  int rc = scale_cache_reserve(&cache, model);
  if (!rc)
    rc = validate(model, &cache, qc, flags, selected);
  if (rc) {
    scale_cache_free(&cache);
    free(selected);
    free(before);
    model_source_discard(&new_source);
    return rc; /* nothing was touched */
  }
  double t0 = now_seconds(), t_read = 0, t_pwal = 0, t_tail = 0;
  t_validate = t0 - t_validate;
  struct provider validated;
  cached_provider(&validated, &cache);
  rc = apply(model, &validated, selected, cache.complete, before, model->fault, &t_read, &t_pwal, &t_tail);
  scale_cache_free(&cache);
  double t_check = now_seconds();
  /* W1's files must still be the ones opened before the reads: one written in place meanwhile gave
   * a mix of its old and new bytes, which is rolled back as a failed read would be. */
  if (!rc && ck)
    rc = source_read_whole(&new_source, ck, "the reload");
  if (rc) {
    char *why = xstrdup(qkeep_errmsg());
    int back = roll_back(model, before);
    if (back == 0 && model->poisoned) {
      set_error(rc,
                "%s; the layers it touched were rolled back, but the model held a mix after an earlier "
                "failed reload and still refuses to run until a reload succeeds",
                why ? why : "");
    } else if (back == 0) {
      set_error(rc,
                "%s; the model was rolled back to %s (every layer the reload touched has its earlier bytes "
                "again, from the same unchanged files)",
                why ? why : "", model->source.path);
    } else {
      char *how = xstrdup(qkeep_errmsg());
      model->poisoned = true;
      set_error(rc, "%s; rollback impossible (%s): the model refuses to run until a reload succeeds",
                why ? why : "", how ? how : "out of memory");
      free(how);
    }
    free(why);
    free(selected);
    free(before);
    model_source_discard(&new_source);
    return rc;
  }
  log_msg(
      QKEEP_LOG_DEBUG,
      "qkeep reload: %.2f ms: validate %.2f, layers' bytes %.2f, normalise + PWAL %.2f, last copies %.2f, "
      "files checked unchanged %.2f",
      (now_seconds() - t0 + t_validate) * 1e3, t_validate * 1e3, t_read * 1e3, t_pwal * 1e3, t_tail * 1e3,
      (now_seconds() - t_check) * 1e3);
  bool full = !(flags & QKEEP_RELOAD_PARTIAL);
  for (size_t l = 0; l < model->n_layers && full; l++)
    full = selected[l];
  free(selected);
  free(before);
  if (full)
    model->poisoned = false;
  model->stats = (struct qkeep_load_stats){sizeof model->stats,
                                           now_seconds() - t0 - t_read - t_pwal,
                                           t_read,
                                           t_pwal,
                                           model->stats.checkpoint_bytes,
                                           t_validate};
  /* Only a full reload from a file leaves the model equal to a file it can roll back to. */
  if (!full)
    model_source_discard(&new_source); /* a partial reload matches no file: no source */
  model_source_take(model, &new_source);
  return 0;
}

int qkeep_model_reload(qkeep_model *model, const char *checkpoint, unsigned flags) {
  if (!model || !checkpoint)
    return set_error(QKEEP_E_INVAL, "qkeep_model_reload: NULL argument");
  struct ckpt *ck;
  double t_open = now_seconds();
  int rc = ckpt_open(checkpoint, &ck);
  if (rc)
    return rc;
  t_open = now_seconds() - t_open;
  struct provider pv;
  ckpt_provider(&pv, ck);
  /* The config as a cold start finds it: a directory's files; none for a bare .safetensors file. A model
   * that quantizes on load takes unquantized checkpoints, as its cold start did. */
  bool online = model->online.plan && ck->qc.method == QM_NONE;
  rc = reload(model, &pv, online ? NULL : &ck->qc, flags, checkpoint, ck);
  if (!rc) {
    model->stats.open_seconds += t_open;
    model->stats.checkpoint_bytes = 0;
    for (size_t f = 0; f < ck->n_files; f++)
      model->stats.checkpoint_bytes += (int64_t)ck->files[f]->file_size;
  }
  ckpt_close(ck);
  return rc;
}

/* Builds the name index of a caller's tensor list, refusing duplicates and bad specs. */
static int index_buffers(struct buffers *b, const struct qkeep_named_tensor *tensors, size_t n) {
  b->tensors = tensors;
  b->n = n;
  int rc = name_index_reserve(&b->index, n);
  for (size_t i = 0; i < n && !rc; i++) {
    const struct qkeep_named_tensor *t = &tensors[i];
    if (!t->name || (!t->data && qkeep_spec_bytes(&t->spec)) ||
        (unsigned)t->spec.dtype >= QKEEP_DTYPE_COUNT || t->spec.ndim < 0 || t->spec.ndim > QKEEP_MAX_DIMS)
      return set_error(QKEEP_E_INVAL, "in-memory tensor %zu ('%s'): missing name or data, or a bad spec", i,
                       t->name ? t->name : "(null)");
    if ((rc = name_index_put(&b->index, t->name, i, NULL)) == QKEEP_E_EXISTS)
      return set_error(QKEEP_E_INVAL, "in-memory tensors: '%s' given twice", t->name);
  }
  return rc;
}

int qkeep_model_reload_tensors(qkeep_model *model, const struct qkeep_named_tensor *tensors, size_t n,
                               unsigned flags) {
  return reload_tensors_in(model, tensors, n, flags, NULL, 0);
}

int reload_tensors_in(qkeep_model *model, const struct qkeep_named_tensor *tensors, size_t n, unsigned flags,
                      const struct mem_block *blocks, size_t n_blocks) {
  if (!model || (!tensors && n))
    return set_error(QKEEP_E_INVAL, "qkeep_model_reload_tensors: NULL argument");
  struct buffers b = {0};
  int rc = index_buffers(&b, tensors, n);
  if (!rc) {
    struct provider pv = {
        "in-memory tensors", &b,   buf_find, buf_read,     buf_host,        buf_device, buf_count,
        buf_name_at,         NULL, NULL,     buf_describe, provider_pass(), blocks,     n_blocks};
    rc = reload(model, &pv, NULL, flags, NULL, NULL);
  }
  name_index_clear(&b.index);
  return rc;
}

/*
 * A direct load of an unquantized tensor of a model that quantizes on load: its layer is reloaded from it
 * alone (validated first, in place, pointers unchanged), which gives the bytes a cold start gives only when
 * the tensor is the layer's one source. A layer made from several (an NVFP4 fusion group sharing a global
 * scale, fused shards, experts, or a tensor copied beside it such as a bias) is refused, naming them: they
 * load together through qkeep_model_reload_tensors with QKEEP_RELOAD_PARTIAL.
 */
static int load_tensor_online(qkeep_model *model, qkeep_layer *layer,
                              const struct qkeep_named_tensor *tensor) {
  for (size_t i = 0; i < layer->n_sources; i++)
    if (strcmp(layer->sources[i].checkpoint_name, tensor->name) != 0)
      return set_error(QKEEP_E_UNSUPPORTED,
                       "load_tensor: '%s' is quantized on load into layer %s together with '%s'%s; load "
                       "them together with qkeep_model_reload_tensors (QKEEP_RELOAD_PARTIAL)",
                       tensor->name, layer->name, layer->sources[i].checkpoint_name,
                       layer->sources[i].online ? " (one unit of the quantize plan: a shared global scale or "
                                                  "a fused param)"
                                                : "");
  return reload_tensors_in(model, tensor, 1, QKEEP_RELOAD_PARTIAL, NULL, 0);
}

int qkeep_model_load_tensor(qkeep_model *model, const struct qkeep_named_tensor *tensor) {
  if (!model || !tensor || !tensor->name)
    return set_error(QKEEP_E_INVAL, "qkeep_model_load_tensor: NULL argument");
  struct buffers b = {0};
  int rc = index_buffers(&b, tensor, 1);
  struct provider pv = {
      "in-memory tensor", &b,   buf_find, buf_read,     buf_host,        buf_device, buf_count,
      buf_name_at,        NULL, NULL,     buf_describe, provider_pass(), NULL,       0};
  qkeep_layer *layer = NULL;
  struct source *src = NULL;
  const struct source_ref *ref = rc ? NULL : model_find_source(model, tensor->name);
  if (ref)
    layer = ref->layer, src = &layer->sources[ref->source];
  if (!rc && !src)
    rc =
        set_error(QKEEP_E_NOTFOUND, "load_tensor: '%s' is not a checkpoint name of this model", tensor->name);
  if (!rc && model->poisoned)
    rc = set_error(QKEEP_E_STATE, "load_tensor: the model needs a full reload after a failed one");
  if (!rc && src->online) { /* quantized on load: the layer is made again from it (docs/RULES.md) */
    name_index_clear(&b.index);
    return load_tensor_online(model, layer, tensor);
  }
  if (!rc && (src->param->transformed || src->param->state != QKEEP_PARAM_LIVE || src->compare_only))
    rc = set_error(
        QKEEP_E_STATE,
        "load_tensor: '%s' lands in %s.%s, which %s; its bytes are not what the kernel reads, so use "
        "qkeep_model_reload to load new weights",
        tensor->name, layer->name, src->param->checkpoint_name,
        src->compare_only                          ? "fused shards share"
        : src->param->transformed                  ? "PWAL or normalisation transformed"
        : src->param->state == QKEEP_PARAM_RETIRED ? "no kernel reads (retired)"
                                                   : "was released");
  struct provided t;
  if (!rc)
    rc = check_source(layer, &pv, src, &t);
  if (!rc && src->param->scale)
    rc = check_scale_values(layer, src->param, &(struct scale_cache){.inner = &pv},
                            &t); /* no room: nothing kept */
  /* Checked above, before anything is written: the load does not check it again. */
  struct staging st = {.scales_checked = true};
  /* Only this tensor: the rest of the layer keeps its bytes. One tensor may feed two params (a single
   * kv_scale is both k_scale and v_scale): every source of that name is written. */
  for (size_t i = 0; !rc && i < layer->n_sources; i++) /* rc first: layer is NULL when the name is unknown */
    if (&layer->sources[i] == src || strcmp(layer->sources[i].checkpoint_name, tensor->name) == 0)
      rc = load_source(layer, &pv, &layer->sources[i], &st);
  /* Kv-cache scales a checkpoint lacks are placeholders derived from those it has (v from k): they
   * follow, as a cold start derives them. Normalisation writes only placeholders there. */
  if (!rc && layer->scheme_ops == &scheme_kv_scales)
    rc = layer->scheme_ops->normalize(layer);
  if (!rc)
    rc = model_sync(model);
  int staged = staging_free(&st);
  if (!rc)
    rc = staged;
  if (!rc)
    rc = model_set_source(model, NULL, NULL); /* no file holds these weights now */
  name_index_clear(&b.index);
  return rc;
}

int qkeep_checkpoint_read_all(const char *path, int64_t *bytes, double *seconds) {
  if (!path || !bytes || !seconds)
    return set_error(QKEEP_E_INVAL, "qkeep_checkpoint_read_all: NULL argument");
  struct ckpt *ck;
  double t0 = now_seconds();
  int rc = ckpt_open(path, &ck);
  if (rc)
    return rc;
  size_t cap = 0;
  unsigned char *buf = NULL;
  *bytes = 0;
  for (size_t i = 0; i < ck->n_tensors && !rc; i++) {
    size_t n = (size_t)ck->tensors[i].t->nbytes;
    if (n > cap) {
      unsigned char *grown = realloc(buf, n);
      if (!grown) {
        rc = set_error(QKEEP_E_NOMEM, "out of memory");
        break;
      }
      buf = grown;
      cap = n;
    }
    rc = ckpt_read(ck, &ck->tensors[i], buf);
    *bytes += (int64_t)n;
  }
  *seconds = now_seconds() - t0;
  free(buf);
  ckpt_close(ck);
  return rc;
}
