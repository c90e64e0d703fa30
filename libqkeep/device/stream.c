/*
 * stream.c: checkpoint bytes to a device through pinned host memory, read by many threads.
 *
 * A layer's device-bound tensors are cut into pieces of at most `piece` bytes, and consecutive
 * small pieces are packed into groups that share one slot (a layer's scales and norms take one
 * slot, not one each). Reader threads pread each group's pieces from their file (or copy them
 * from host bytes the provider holds) into a free slot of a ring of pinned memory (the
 * backend's host_alloc, ABI 1.2); the calling thread, in piece order, starts each piece's
 * asynchronous copy to the device as soon as its group is read, one copy for a run of pieces
 * whose device bytes follow each other (the experts of a stacked param). So the reads run in
 * parallel with each other and with the copies, every call into the backend stays on the
 * calling thread (the readers touch only files and host memory), and the layer's copies have
 * all been started, in order, before its PWAL runs on the same stream. An item with a check
 * (a scale: its values) has each piece checked by its reader in the slot, so bad bytes never
 * reach the device and nothing is read back to check them.
 * A slot is free again once its copies are done: with ABI 1.3's copy fences the calling thread
 * frees each slot whose fence has passed (between pieces; and while it waits for a read with the
 * readers out of work, it waits for the oldest copy's fence, so they do not idle behind copies
 * done), and when none is free waits for the oldest copy alone; without fences it waits for the
 * whole device (sync), which frees every slot. The next layer's pieces (stream_items' `then`) take
 * the slots that free once each of this layer's has one, so a layer's last reads and copies overlap
 * the next layer's first: the readers do not wait for the layer's end. Before a wait that drains the stream (a device-quantized unit's amax read back),
 * stream_drain_reading lets the readers read the next bytes into each slot as it frees. The ring
 * and its reader threads live as long as the model's owner: every reload reuses them.
 *
 * The ring's shape is the model's (struct qkeep_load_options, read when the ring is made; the
 * defaults below, docs/PERFORMANCE.md). With a logger at QKEEP_LOG_DEBUG, the end of each load
 * logs where the calling thread waited.
 */
#include <assert.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "device/stream.h"

/* 32 slots of 2 MiB, and a reader per core: one thread copies page cache at about 8 GB/s, and on
 * an H200 host a ring of 1-4 MiB pieces and 32-112 MiB fed the host-to-device copies at 48-52
 * GB/s where 16 slots of 512 KiB and 4 readers gave 14-18 GB/s (docs/PERFORMANCE.md). */
#define DEFAULT_PIECE ((size_t)2 << 20)
#define DEFAULT_SLOTS 32
#define MAX_SLOTS 128
#define DEFAULT_READERS 16
#define MAX_READERS 64
#define MIN_PIECE ((size_t)4096)
#define MAX_PIECE ((size_t)64 << 20)
/* Where a packed piece starts in its slot: its device copy then starts on an aligned host address. */
#define PACK_ALIGN ((size_t)256)

struct piece {
  struct provided t;
  const unsigned char *on_host; /* the provider's host bytes, or NULL: read from its file */
  size_t at, n;                 /* the range of the tensor */
  size_t item;                  /* which item of the batch */
  size_t group;                 /* the group whose slot holds it */
  size_t off;                   /* where its bytes start in that slot */
  char *dst;                    /* device memory for byte `at` (set when it is copied) */
  const void *alloc;            /* its item's allocation (set when it is copied) */
  unsigned char *mirror;        /* host memory for byte `at`, or NULL */
  /* its item's check and its context (stream_item) */
  int (*check)(const void *check_ctx, const struct provided *t, size_t at, const void *bytes, size_t n);
  const void *check_ctx;
  int slot;
  bool done; /* read into the slot (or failed) */
  int rc;
  char *msg; /* the reader's error message (its thread's) */
};

/* Consecutive pieces that share a slot: read by one reader, the slot free again after the last one's copy. */
struct group {
  size_t first, end; /* its pieces */
};

enum slot_state { SLOT_FREE, SLOT_READING, SLOT_COPYING };

/* Items being streamed or read ahead, cut into pieces packed into groups: the readers take groups
 * [taken, submitted); a group is submitted once it has a slot. */
struct batch {
  const struct provider *pv;
  struct piece *pieces;
  size_t n_pieces;
  struct group *groups;
  size_t n_groups, submitted, taken;
  struct stream_item *items; /* the batch's items (their dst unknown while reading ahead) */
  size_t n_items;
};

/* Small puts (stream_put) of at most this many bytes share the last slot, the arena. */
#define SMALL_PUT ((size_t)4 << 10)

/* Where the calling thread waited: measured during a load only while the debug log listens. */
struct stream_trace {
  bool on;
  size_t pieces, copies, bytes, fence_waits, syncs;
  size_t early_groups; /* groups handed to the readers while the calling thread waited for a read */
  size_t read_bytes;   /* bytes the readers read (more than `bytes` copied: a read ahead given up on) */
  size_t drains;       /* stream_drain_reading calls that read something ahead */
  double read_wait, slot_wait, reading; /* seconds: for a read, for a slot; the readers' own time */
  double drain_wait;                    /* seconds in stream_drain_reading */
  /* While the calling thread waits for a read: the ring's state, summed over its looks (groups being
   * read, read and waiting for the piece before them, handed over and not yet taken; slots copying, free). */
  size_t looks;
  double in_read, ready, queued, copying, idle_slots;
  size_t read_ms[6];         /* groups read in < 0.25, 0.5, 1, 2, 4 ms, and longer */
  double read_max, copy_time; /* seconds: the longest read; copy started to slot freed, summed */
  size_t copy_freed;          /* slots freed after a copy (copy_time's count) */
  double copy_max;
};

struct stream {
  const struct device *dev;
  bool fences;      /* the device has ABI 1.3's copy fences */
  size_t piece;     /* bytes per slot */
  int slots, arena; /* slots in the ring; the arena is the last one */
  int want_readers;
  unsigned char *ring; /* slots * piece pinned bytes */
  enum slot_state slot[MAX_SLOTS];
  uint64_t fence[MAX_SLOTS]; /* a COPYING slot's copies are done once this fence has passed */
  double copy_at[MAX_SLOTS]; /* when a COPYING slot's last copy started (trace only) */
  pthread_t readers[MAX_READERS];
  int n_readers; /* started at the first load, stopped by stream_free: every reload reuses them */
  double made_s; /* seconds stream_new took to make the ring, until the first load's trace reports it */
  bool active;   /* a load streams through it now (from its first stream_items or read ahead to stream_end) */
  pthread_mutex_t mu;
  pthread_cond_t work, done;
  bool quit;
  size_t arena_used; /* bytes of the arena slot holding small puts (it is SLOT_COPYING when > 0) */
  /* The batch being streamed or read ahead, and the one read once each of its groups has a slot (the
   * next layer's, given to stream_items): readers take the first's groups before the second's. */
  struct batch cur, ahead;
  struct stream_trace trace;
};

static unsigned char *slot_room(const struct stream *s, int slot) {
  return s->ring + (size_t)slot * s->piece;
}

/* Reads the piece into its slot and runs its item's check there, before any copy of it: here, in a
 * reader thread, so the checks run beside the reads and copies. */
static void read_piece(const struct stream *s, const struct provider *pv, struct piece *p) {
  unsigned char *room = slot_room(s, p->slot) + p->off;
  if (p->on_host)
    memcpy(room, p->on_host + p->at, p->n);
  else
    p->rc = pv->read_range(pv, &p->t, p->at, p->n, room);
  if (!p->rc && p->check)
    p->rc = p->check(p->check_ctx, &p->t, p->at, room, p->n);
  if (p->rc && !(p->msg = xstrdup(qkeep_errmsg())))
    p->rc = QKEEP_E_NOMEM;
}

/* The batch whose next group a reader takes, or NULL when none waits. Called with s->mu held. */
static struct batch *to_read(struct stream *s) {
  return s->cur.taken < s->cur.submitted ? &s->cur : s->ahead.taken < s->ahead.submitted ? &s->ahead : NULL;
}

static void *reader(void *arg) {
  struct stream *s = arg;
  struct batch *b;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->quit && !(b = to_read(s)))
      pthread_cond_wait(&s->work, &s->mu);
    if (s->quit)
      break;
    /* the batch may become the current one meanwhile (stream_items): its arrays stay where they are */
    const struct group g = b->groups[b->taken++];
    struct piece *pieces = b->pieces;
    const struct provider *pv = b->pv;
    pthread_mutex_unlock(&s->mu);
    double t = s->trace.on ? now_seconds() : 0;
    for (size_t i = g.first; i < g.end; i++)
      read_piece(s, pv, &pieces[i]);
    pthread_mutex_lock(&s->mu);
    if (s->trace.on) {
      double d = now_seconds() - t;
      s->trace.reading += d;
      s->trace.read_max = d > s->trace.read_max ? d : s->trace.read_max;
      int bin = 0;
      for (double lim = 0.25e-3; bin < 5 && d >= lim; lim *= 2)
        bin++;
      s->trace.read_ms[bin]++;
    }
    for (size_t i = g.first; i < g.end; i++)
      pieces[i].done = true, s->trace.read_bytes += s->trace.on ? pieces[i].n : 0;
    pthread_cond_broadcast(&s->done);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

int stream_options_check(const struct qkeep_load_options *o) {
  if (o->stream_slots && (o->stream_slots < 2 || o->stream_slots > MAX_SLOTS))
    return set_error(QKEEP_E_INVAL, "stream_slots = %d: expected 2 to %d (0: %d)", o->stream_slots, MAX_SLOTS,
                     DEFAULT_SLOTS);
  if (o->stream_piece && (o->stream_piece < MIN_PIECE || o->stream_piece > MAX_PIECE))
    return set_error(QKEEP_E_INVAL, "stream_piece = %zu: expected %zu to %zu bytes (0: %zu)", o->stream_piece,
                     MIN_PIECE, MAX_PIECE, DEFAULT_PIECE);
  if (o->stream_readers && (o->stream_readers < 1 || o->stream_readers > MAX_READERS))
    return set_error(QKEEP_E_INVAL, "stream_readers = %d: expected 1 to %d (0: one per core, at most %d)",
                     o->stream_readers, MAX_READERS, DEFAULT_READERS);
  return 0;
}

static void batch_drop(struct stream *s);

static void trace_log(struct stream *s) {
  struct stream_trace *t = &s->trace;
  double k = t->looks ? (double)t->looks : 1;
  if (t->on && t->pieces)
    log_msg(
        QKEEP_LOG_DEBUG,
        "qkeep stream: %zu pieces in %zu copies, %.1f MB (%zu bytes copied, %zu read); waited %.2f ms for "
        "reads, %.2f ms for slots (%zu fence waits, %zu syncs, %zu groups read while waiting), %.2f ms "
        "draining (%zu drains reading ahead); readers busy %.2f ms (%d readers, %d slots of %zu bytes, "
        "fences %s; the ring made in %.2f ms for this load); while waiting for a read (%zu looks) on average %.1f groups being read, %.1f read and "
        "waiting, %.1f not yet taken, %.1f slots copying, %.1f free; groups read in <0.25/0.5/1/2/4/more ms: "
        "%zu/%zu/%zu/%zu/%zu/%zu, longest %.2f ms; a slot freed %.3f ms after its copy started (mean of %zu, "
        "longest %.2f ms)",
        t->pieces, t->copies, t->bytes / 1e6, t->bytes, t->read_bytes, t->read_wait * 1e3, t->slot_wait * 1e3,
        t->fence_waits, t->syncs, t->early_groups, t->drain_wait * 1e3, t->drains, t->reading * 1e3,
        s->n_readers, s->slots, s->piece, s->fences ? "on" : "off", s->made_s * 1e3, t->looks, t->in_read / k, t->ready / k,
        t->queued / k, t->copying / k, t->idle_slots / k, t->read_ms[0], t->read_ms[1], t->read_ms[2],
        t->read_ms[3], t->read_ms[4], t->read_ms[5], t->read_max * 1e3,
        t->copy_freed ? t->copy_time / (double)t->copy_freed * 1e3 : 0.0, t->copy_freed, t->copy_max * 1e3);
  *t = (struct stream_trace){0};
  s->made_s = 0;
}

int stream_end(struct stream *s) {
  if (!s)
    return 0;
  batch_drop(s); /* a read ahead the load did not use (it failed, or the next layer went elsewhere) */
  int rc = stream_wait(s);
  trace_log(s);
  s->active = false;
  return rc;
}

/* Stops the reader threads (they wait for the next load between loads). */
static void stop_readers(struct stream *s) {
  pthread_mutex_lock(&s->mu);
  s->quit = true;
  pthread_cond_broadcast(&s->work);
  pthread_mutex_unlock(&s->mu);
  for (int i = 0; i < s->n_readers; i++)
    pthread_join(s->readers[i], NULL);
  s->n_readers = 0;
  s->quit = false;
}

void stream_free(struct stream *s) {
  if (!s)
    return;
  (void)stream_end(s);
  stop_readers(s);
  pthread_cond_destroy(&s->work);
  pthread_cond_destroy(&s->done);
  pthread_mutex_destroy(&s->mu);
  dev_host_free(s->dev, s->ring);
  free(s);
}

int stream_new(const struct device *dev, const struct qkeep_load_options *options, struct stream **out) {
  const struct qkeep_load_options none = {.size = sizeof none}, *o = options ? options : &none;
  assert(stream_options_check(o) == 0); /* checked when the model took them */
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  struct stream *s = calloc(1, sizeof *s);
  if (!s)
    return set_error(QKEEP_E_NOMEM, "out of memory for the device stream");
  s->dev = dev;
  s->fences = memory_ops_fences(dev->ops) && !o->stream_no_fences;
  s->slots = o->stream_slots ? o->stream_slots : DEFAULT_SLOTS;
  s->arena = s->slots - 1;
  s->piece = o->stream_piece ? o->stream_piece : DEFAULT_PIECE;
  s->want_readers = o->stream_readers         ? o->stream_readers
                    : cores < 1               ? 1
                    : cores > DEFAULT_READERS ? DEFAULT_READERS
                                              : (int)cores;
  double t = now_seconds();
  int rc = dev_host_alloc(dev, (size_t)s->slots * s->piece, (void **)&s->ring);
  s->made_s = now_seconds() - t;
  if (rc) {
    free(s);
    return rc;
  }
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->work, NULL);
  pthread_condattr_t monotonic; /* wait_for_read's timeouts */
  pthread_condattr_init(&monotonic);
  pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC);
  pthread_cond_init(&s->done, &monotonic);
  pthread_condattr_destroy(&monotonic);
  *out = s;
  return 0;
}

/* A load begins streaming: the readers start if none runs yet (the model's first load). */
static int begin_load(struct stream *s) {
  if (s->active)
    return 0;
  s->trace.on = log_enabled(QKEEP_LOG_DEBUG); /* measured while the debug log listens */
  while (s->n_readers < s->want_readers && pthread_create(&s->readers[s->n_readers], NULL, reader, s) == 0)
    s->n_readers++;
  if (!s->n_readers)
    return set_error(QKEEP_E_NOMEM, "cannot start a reader thread for the device stream");
  s->active = true;
  return 0;
}

const struct device *stream_device(const struct stream *s) { return s->dev; }

size_t stream_bytes(const struct stream *s) { return s ? (size_t)s->slots * s->piece : 0; }

int stream_wait(struct stream *s) {
  bool copying = false;
  for (int i = 0; i < s->slots; i++)
    if (s->slot[i] == SLOT_COPYING)
      copying = true, s->slot[i] = SLOT_FREE;
  s->arena_used = 0;
  if (copying)
    s->trace.syncs++;
  return copying ? dev_sync(s->dev) : 0;
}

bool stream_active(const struct stream *s) { return s && s->active; }

static void slot_freed(struct stream *s, int i) {
  if (s->trace.on && s->slot[i] == SLOT_COPYING && s->copy_at[i] > 0) {
    double d = now_seconds() - s->copy_at[i];
    s->trace.copy_time += d, s->trace.copy_freed++;
    s->trace.copy_max = d > s->trace.copy_max ? d : s->trace.copy_max;
    s->copy_at[i] = 0;
  }
  s->slot[i] = SLOT_FREE;
  if (i == s->arena)
    s->arena_used = 0;
}

/*
 * Frees the slots whose copies are done: with fences, each copying slot, oldest first, whose
 * fence has passed (a later fence covers more copies, so the first one still pending ends the
 * look); when `block` and none was free, waits for the oldest alone. Without fences only a
 * blocking call frees anything (stream_wait).
 */
static int reclaim(struct stream *s, bool block) {
  if (!s->fences)
    return block ? stream_wait(s) : 0;
  bool freed = false;
  for (;;) {
    int oldest = -1;
    for (int i = 0; i < s->slots; i++)
      if (s->slot[i] == SLOT_COPYING && (oldest < 0 || s->fence[i] < s->fence[oldest]))
        oldest = i;
    if (oldest < 0)
      return 0;
    bool wait = block && !freed;
    int rc = dev_fence_wait(s->dev, s->fence[oldest], wait);
    if (rc < 0)
      return rc;
    if (rc > 0)
      return 0; /* still copying (only when not waiting) */
    if (wait)
      s->trace.fence_waits++;
    slot_freed(s, oldest);
    freed = true;
  }
}

/* Marks slot i as copying, its copy (just started) covered by a new fence. */
static int slot_copying(struct stream *s, int i) {
  s->slot[i] = SLOT_COPYING;
  s->copy_at[i] = s->trace.on ? now_seconds() : 0;
  return s->fences ? dev_fence(s->dev, &s->fence[i]) : 0;
}

/* A free slot for a piece (the arena is kept for stream_put). */
static int free_slot(const struct stream *s) {
  for (int i = 0; i < s->slots; i++)
    if (i != s->arena && s->slot[i] == SLOT_FREE)
      return i;
  return -1;
}

int stream_put(struct stream *s, void *dst, const void *src, size_t n) {
  int slot = -1, rc = 0;
  size_t at = 0;
  if (n <= SMALL_PUT && n <= s->piece) {
    if (s->arena_used + n > s->piece) { /* the arena is full: wait for its copies alone */
      rc = s->fences && s->slot[s->arena] == SLOT_COPYING ? dev_fence_wait(s->dev, s->fence[s->arena], true)
                                                          : stream_wait(s);
      if (rc)
        return rc;
      slot_freed(s, s->arena);
    }
    slot = s->arena, at = s->arena_used;
  } else if (n <= s->piece && (slot = free_slot(s)) < 0) {
    if ((rc = reclaim(s, true)))
      return rc;
    slot = free_slot(s); /* still none when a read ahead holds every slot */
  }
  if (slot < 0) { /* larger than a slot, or every slot being read ahead: a plain copy after the others */
    rc = stream_wait(s);
    return rc ? rc : dev_h2d(s->dev, dst, src, n);
  }
  unsigned char *room = slot_room(s, slot) + at;
  memcpy(room, src, n);
  if ((rc = dev_h2d_async(s->dev, dst, room, n)))
    return rc;
  if (slot == s->arena)
    s->arena_used = at + ((n + 63) & ~(size_t)63);
  return slot_copying(s, slot);
}

/* The bytes of each of the item's pieces: whole elements when it has a check (each is checked alone). */
static size_t piece_bytes(const struct stream_item *it, size_t piece) {
  return it->check ? piece - piece % qkeep_dtype_size((enum qkeep_dtype)it->t.dtype) : piece;
}

/* The pieces of the items, in order (NULL and an error when out of memory). */
static struct piece *cut(const struct stream_item *items, size_t n_items, size_t piece, size_t *n_pieces) {
  size_t n = 0;
  for (size_t i = 0; i < n_items; i++) {
    size_t step = piece_bytes(&items[i], piece);
    n += items[i].t.nbytes ? (items[i].t.nbytes + step - 1) / step : 0;
  }
  struct piece *p = calloc(n ? n : 1, sizeof *p);
  if (!p) {
    set_error(QKEEP_E_NOMEM, "out of memory for %zu pieces", n);
    return NULL;
  }
  size_t k = 0;
  for (size_t i = 0; i < n_items; i++) {
    size_t step = piece_bytes(&items[i], piece);
    for (size_t at = 0; at < items[i].t.nbytes; at += step, k++)
      p[k] = (struct piece){.t = items[i].t,
                            .on_host = items[i].on_host,
                            .item = i,
                            .at = at,
                            .n = items[i].t.nbytes - at < step ? items[i].t.nbytes - at : step,
                            .check = items[i].check,
                            .check_ctx = items[i].check_ctx};
  }
  *n_pieces = n;
  return p;
}

/*
 * Packs the pieces into groups, in order: a piece joins the group before it while the slot has
 * room for it (placed PACK_ALIGN bytes apart, or right after a piece of the same item, whose
 * device bytes it then follows). Sets each piece's group and offset; NULL when out of memory.
 */
static struct group *pack(struct piece *p, size_t n, size_t piece, size_t *n_groups) {
  struct group *g = malloc((n ? n : 1) * sizeof *g);
  if (!g) {
    set_error(QKEEP_E_NOMEM, "out of memory for %zu pieces", n);
    return NULL;
  }
  size_t k = 0, used = 0;
  for (size_t i = 0; i < n; i++) {
    size_t at = used;
    if (k && i > 0 && !(p[i - 1].item == p[i].item && p[i - 1].at + p[i - 1].n == p[i].at))
      at = (used + PACK_ALIGN - 1) & ~(PACK_ALIGN - 1);
    if (!k || at + p[i].n > piece) { /* a new group */
      g[k++] = (struct group){.first = i, .end = i};
      at = 0;
    }
    g[k - 1].end = i + 1;
    p[i].group = k - 1, p[i].off = at;
    used = at + p[i].n;
  }
  *n_groups = k;
  return g;
}

/* Makes the items batch b (empty before; nothing submitted yet). */
static int batch_begin(struct stream *s, struct batch *b, const struct provider *pv,
                       const struct stream_item *items, size_t n_items) {
  size_t n = 0, n_groups = 0;
  struct piece *pieces = cut(items, n_items, s->piece, &n);
  struct group *groups = pieces ? pack(pieces, n, s->piece, &n_groups) : NULL;
  struct stream_item *copy = malloc((n_items ? n_items : 1) * sizeof *copy);
  if (!pieces || !groups || !copy) {
    free(pieces);
    free(groups);
    free(copy);
    return set_error(QKEEP_E_NOMEM, "out of memory for the device stream's batch");
  }
  memcpy(copy, items, n_items * sizeof *copy);
  pthread_mutex_lock(&s->mu);
  *b = (struct batch){pv, pieces, n, groups, n_groups, 0, 0, copy, n_items};
  pthread_mutex_unlock(&s->mu);
  return 0;
}

/* Hands groups to the readers while slots are free: the current batch's, then the one read ahead.
 * Called with s->mu held. */
static void batch_submit(struct stream *s) {
  struct batch *both[] = {&s->cur, &s->ahead};
  int slot;
  for (int k = 0; k < 2; k++) {
    struct batch *b = both[k];
    while (b->submitted < b->n_groups && (slot = free_slot(s)) >= 0) {
      const struct group *g = &b->groups[b->submitted];
      for (size_t i = g->first; i < g->end; i++)
        b->pieces[i].slot = slot;
      s->slot[slot] = SLOT_READING;
      b->submitted++;
      pthread_cond_signal(&s->work);
    }
  }
}

/* Frees batch b's arrays (no reader holds a group of it). */
static void batch_clear(struct batch *b) {
  for (size_t i = 0; i < b->n_pieces; i++)
    free(b->pieces[i].msg);
  free(b->pieces);
  free(b->groups);
  free(b->items);
  *b = (struct batch){0};
}

/* Ends both batches: the readers finish what they took, nothing else is read, the slots read and not
 * copied from are free again. */
static void batch_drop(struct stream *s) {
  if (!s->cur.pieces && !s->ahead.pieces)
    return;
  pthread_mutex_lock(&s->mu);
  struct batch *both[] = {&s->cur, &s->ahead};
  for (int n = 0; n < 2; n++) {
    struct batch *b = both[n];
    b->submitted = b->taken;
    for (size_t i = 0; i < b->taken; i++)
      for (size_t k = b->groups[i].first; k < b->groups[i].end; k++)
        while (!b->pieces[k].done)
          pthread_cond_wait(&s->done, &s->mu);
  }
  struct batch cur = s->cur, ahead = s->ahead;
  s->cur = (struct batch){0}, s->ahead = (struct batch){0};
  pthread_mutex_unlock(&s->mu);
  batch_clear(&cur);
  batch_clear(&ahead);
  for (int i = 0; i < s->slots; i++) /* read and never copied */
    if (s->slot[i] == SLOT_READING)
      s->slot[i] = SLOT_FREE;
}

/* The current batch is copied whole: the one read ahead becomes the current one, its reads going on. */
static void batch_next(struct stream *s) {
  pthread_mutex_lock(&s->mu);
  struct batch done = s->cur; /* every group read: no reader holds one */
  s->cur = s->ahead, s->ahead = (struct batch){0};
  pthread_mutex_unlock(&s->mu);
  batch_clear(&done);
}

/* Whether batch b is these items (the same tensors and sources, in order). */
static bool batch_is(const struct batch *b, const struct stream_item *items, size_t n_items) {
  if (!b->pieces || b->n_items != n_items)
    return false;
  for (size_t i = 0; i < n_items; i++)
    if (b->items[i].t.handle != items[i].t.handle || b->items[i].t.nbytes != items[i].t.nbytes ||
        b->items[i].t.name != items[i].t.name || b->items[i].on_host != items[i].on_host ||
        b->items[i].check != items[i].check || b->items[i].check_ctx != items[i].check_ctx)
      return false;
  return true;
}

int stream_prefetch(struct stream *s, const struct provider *pv, const struct stream_item *items,
                    size_t n_items) {
  if (!n_items || begin_load(s))
    return 0; /* reading ahead is only a head start: without it the load reads later */
  if (!batch_is(&s->cur, items, n_items) || s->ahead.pieces) {
    batch_drop(s);
    if (batch_begin(s, &s->cur, pv, items, n_items))
      return 0;
  }
  if (reclaim(s, false) < 0)
    return 0;
  pthread_mutex_lock(&s->mu);
  batch_submit(s);
  pthread_mutex_unlock(&s->mu);
  return 0;
}

/* Whether a slot's copies may still run. */
static bool any_copying(const struct stream *s) {
  for (int i = 0; i < s->slots; i++)
    if (s->slot[i] == SLOT_COPYING)
      return true;
  return false;
}

/*
 * Waits (s->mu held) until a reader finishes a group of the current batch (head: the group of the
 * piece awaited), or, while the readers have nothing to take and copies are in flight, until the
 * oldest copy is done: its slot and every later one done goes back to the readers (the calling
 * thread alone frees slots: fences are the backend's, asked on this thread).
 */
static void wait_for_read(struct stream *s, size_t head) {
  if (s->trace.on) { /* the ring's state now (trace_log) */
    struct stream_trace *t = &s->trace;
    const struct batch *b = &s->cur;
    t->looks++, t->queued += (double)(b->submitted - b->taken + s->ahead.submitted - s->ahead.taken);
    for (size_t g = head; g < b->taken; g++)
      *(b->pieces[b->groups[g].end - 1].done ? &t->ready : &t->in_read) += 1;
    for (int i = 0; i < s->slots; i++)
      if (s->slot[i] == SLOT_COPYING)
        t->copying += 1;
      else if (s->slot[i] == SLOT_FREE)
        t->idle_slots += 1;
  }
  /* The readers have taken every group handed over, so they idle unless a slot frees: wait for the
   * oldest copy (the device's own wait, not a poll), free every slot done by then, hand them more. */
  const struct batch *c = &s->cur, *a = &s->ahead;
  if (s->fences && !to_read(s) && (c->submitted < c->n_groups || a->submitted < a->n_groups) &&
      any_copying(s)) {
    pthread_mutex_unlock(&s->mu);
    int rc = reclaim(s, true); /* an error here is found again by the next reclaim */
    pthread_mutex_lock(&s->mu);
    size_t before = c->submitted + a->submitted;
    if (rc == 0)
      batch_submit(s);
    s->trace.early_groups += c->submitted + a->submitted - before;
    return;
  }
  pthread_cond_wait(&s->done, &s->mu);
}

int stream_drain_reading(struct stream *s, const struct provider *pv, const struct stream_item *items,
                         size_t n_items) {
  if (!s->fences || !n_items)
    return 0;
  (void)stream_prefetch(s, pv, items, n_items);
  s->trace.drains++;
  while (any_copying(s)) {
    double t = s->trace.on ? now_seconds() : 0;
    int rc = reclaim(s, true); /* the oldest copy, and every later one done by then */
    s->trace.drain_wait += s->trace.on ? now_seconds() - t : 0;
    if (rc < 0)
      return rc;
    pthread_mutex_lock(&s->mu);
    batch_submit(s);
    pthread_mutex_unlock(&s->mu);
  }
  return 0;
}

/* Whether piece q's bytes follow piece p's in the slot and on the device, in one allocation: one copy
 * takes both. */
static bool follows(const struct piece *p, const struct piece *q) {
  return q->group == p->group && q->off == p->off + p->n && q->dst == p->dst + p->n &&
         (q->item == p->item || (p->alloc && q->alloc == p->alloc));
}

int stream_items(struct stream *s, const struct provider *pv, const struct stream_item *items,
                 size_t n_items, const struct stream_item *then, size_t n_then) {
  int rc = begin_load(s);
  if (rc)
    return rc;
  if (!batch_is(&s->cur, items, n_items) || s->ahead.pieces) {
    batch_drop(s);
    if ((rc = batch_begin(s, &s->cur, pv, items, n_items)))
      return rc;
  }
  /* the next items are read once each group of these has a slot (best effort: none when out of memory) */
  if (then && n_then)
    (void)batch_begin(s, &s->ahead, pv, then, n_then);
  struct batch *b = &s->cur;
  /* Where each piece goes is known now (a read ahead did not know it). */
  for (size_t k = 0; k < b->n_pieces; k++) {
    struct piece *p = &b->pieces[k];
    p->dst = items[p->item].dst + p->at;
    p->alloc = items[p->item].alloc;
    p->mirror = items[p->item].mirror ? items[p->item].mirror + p->at : NULL;
  }
  /* Pieces [run, copied) are read and wait for one copy, started when the next one does not follow;
   * `started`: a copy from the slot of piece `copied`'s group has been started. */
  size_t copied = 0, run = 0, n = b->n_pieces;
  bool started = false;
  while (copied < n && !rc) {
    if ((rc = reclaim(s, false)) < 0)
      break;
    pthread_mutex_lock(&s->mu);
    batch_submit(s);
    struct piece *p = &b->pieces[copied];
    if (p->group >= b->submitted) { /* every slot waits on a copy: let the device finish the oldest */
      pthread_mutex_unlock(&s->mu);
      double t = s->trace.on ? now_seconds() : 0;
      rc = reclaim(s, true);
      s->trace.slot_wait += s->trace.on ? now_seconds() - t : 0;
      continue;
    }
    double t = s->trace.on && !p->done ? now_seconds() : 0;
    while (!p->done)
      wait_for_read(s, p->group);
    pthread_mutex_unlock(&s->mu);
    s->trace.read_wait += t ? now_seconds() - t : 0;
    if (p->rc) {
      rc = set_error(p->rc, "%s", p->msg ? p->msg : "read failed");
      break;
    }
    if (p->mirror)
      memcpy(p->mirror, slot_room(s, p->slot) + p->off, p->n);
    s->trace.pieces++, s->trace.bytes += p->n;
    copied++;
    const struct piece *last = &b->pieces[copied - 1];
    if (copied < n && follows(last, &b->pieces[copied]))
      continue;
    const struct piece *head = &b->pieces[run];
    if ((rc = dev_h2d_async(s->dev, head->dst, slot_room(s, head->slot) + head->off,
                            (size_t)(last->dst + last->n - head->dst))))
      break;
    s->trace.copies++;
    run = copied, started = true;
    if (copied == n || b->pieces[copied].group != last->group) { /* the group's last copy is started */
      rc = slot_copying(s, last->slot);
      started = false;
    }
  }
  /* A failure in a group whose earlier pieces are being copied: its slot is free once they are
   * (batch_drop frees the slots read and never copied from). */
  if (rc && started)
    (void)slot_copying(s, b->pieces[run].slot);
  if (rc)
    batch_drop(s); /* the readers finish what they took first */
  else
    batch_next(s); /* the items read ahead go on being read, for the next call */
  return rc;
}
