/*
 * stream.c: checkpoint bytes to a device through pinned host memory, read by a few threads.
 *
 * A layer's device-bound tensors are cut into pieces of at most PIECE bytes. Reader threads
 * pread each piece from its file (or copy it from host bytes the provider holds) into a free
 * slot of a ring of pinned memory (the backend's host_alloc, ABI 1.2); the calling thread, in
 * piece order, starts each slot's asynchronous copy to the device as soon as its read is done.
 * So the reads run in parallel with each other and with the copies, every call into the
 * backend stays on the calling thread (the readers touch only files and host memory), and the
 * layer's copies have all been started, in order, before its PWAL runs on the same stream.
 * When no slot is free, the calling thread waits for the device (sync), which frees every slot
 * whose copy was started. The ring lives as long as the model's owner (page-locking 8 MiB costs
 * about 3-4 ms, as much as a reload of a few layers); the readers only while a load runs.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

/* A piece's read takes about 0.15 ms (page cache to memory at ~7 GB/s) and its copy 25 us:
 * pieces this size keep the device's wait for the last copy short. */
#define PIECE ((size_t)1 << 20)
#define SLOTS 8
#define MAX_READERS 4

struct piece {
  struct provided t;
  const unsigned char *on_host; /* the provider's host bytes, or NULL: read from its file */
  size_t at, n;                 /* the range of the tensor */
  size_t item;                  /* which item of the batch */
  char *dst;                    /* device memory for byte `at` (set when it is copied) */
  unsigned char *mirror;        /* host memory for byte `at`, or NULL */
  int slot;
  bool done; /* read into the slot (or failed) */
  int rc;
  char *msg; /* the reader's error message (its thread's) */
};

enum slot_state { SLOT_FREE, SLOT_READING, SLOT_COPYING };

/* The last slot also takes small puts (stream_put), packed, until a wait frees it. */
#define ARENA (SLOTS - 1)
#define SMALL_PUT ((size_t)4 << 10)

struct stream {
  const struct device *dev;
  unsigned char *ring; /* SLOTS * PIECE pinned bytes */
  enum slot_state slot[SLOTS];
  pthread_t readers[MAX_READERS];
  int n_readers;
  pthread_mutex_t mu;
  pthread_cond_t work, done;
  bool quit;
  size_t arena_used; /* bytes of the arena slot holding small puts (it is SLOT_COPYING when > 0) */
  /* the batch being streamed or read ahead (readers take pieces [taken, submitted)) */
  const struct provider *pv;
  struct piece *pieces;
  size_t n_pieces, submitted, taken;
  struct stream_item *items; /* the batch's items (their dst unknown while reading ahead) */
  size_t n_items;
};

static void read_piece(const struct stream *s, struct piece *p) {
  unsigned char *room = s->ring + (size_t)p->slot * PIECE;
  if (p->on_host) {
    memcpy(room, p->on_host + p->at, p->n);
    return;
  }
  p->rc = s->pv->read_range(s->pv, &p->t, p->at, p->n, room);
  if (p->rc && !(p->msg = xstrdup(qkeep_errmsg())))
    p->rc = QKEEP_E_NOMEM;
}

static void *reader(void *arg) {
  struct stream *s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->quit && s->taken == s->submitted)
      pthread_cond_wait(&s->work, &s->mu);
    if (s->quit)
      break;
    struct piece *p = &s->pieces[s->taken++];
    pthread_mutex_unlock(&s->mu);
    read_piece(s, p);
    pthread_mutex_lock(&s->mu);
    p->done = true;
    pthread_cond_broadcast(&s->done);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* Readers: one per online core up to MAX_READERS (the calling thread issues the copies). */
static int reader_count(void) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  return cores < 1 ? 1 : cores > MAX_READERS ? MAX_READERS : (int)cores;
}

static void batch_drop(struct stream *s);

int stream_end(struct stream *s) {
  if (!s)
    return 0;
  batch_drop(s); /* a read ahead the load did not use (it failed, or the next layer went elsewhere) */
  int rc = stream_wait(s);
  pthread_mutex_lock(&s->mu);
  s->quit = true;
  pthread_cond_broadcast(&s->work);
  pthread_mutex_unlock(&s->mu);
  for (int i = 0; i < s->n_readers; i++)
    pthread_join(s->readers[i], NULL);
  s->n_readers = 0;
  s->quit = false;
  return rc;
}

void stream_free(struct stream *s) {
  if (!s)
    return;
  (void)stream_end(s);
  pthread_cond_destroy(&s->work);
  pthread_cond_destroy(&s->done);
  pthread_mutex_destroy(&s->mu);
  dev_host_free(s->dev, s->ring);
  free(s);
}

int stream_new(const struct device *dev, struct stream **out) {
  struct stream *s = calloc(1, sizeof *s);
  if (!s)
    return set_error(QKEEP_E_NOMEM, "out of memory for the device stream");
  s->dev = dev;
  int rc = dev_host_alloc(dev, SLOTS * PIECE, (void **)&s->ring);
  if (rc) {
    free(s);
    return rc;
  }
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->work, NULL);
  pthread_cond_init(&s->done, NULL);
  *out = s;
  return 0;
}

/* The readers, when none runs (the first layer of a load). */
static int start_readers(struct stream *s) {
  for (int n = reader_count(); s->n_readers < n; s->n_readers++)
    if (pthread_create(&s->readers[s->n_readers], NULL, reader, s) != 0)
      break;
  return s->n_readers ? 0 : set_error(QKEEP_E_NOMEM, "cannot start a reader thread for the device stream");
}

const struct device *stream_device(const struct stream *s) { return s->dev; }

size_t stream_bytes(const struct stream *s) { return s ? SLOTS * PIECE : 0; }

int stream_wait(struct stream *s) {
  bool copying = false;
  for (int i = 0; i < SLOTS; i++)
    if (s->slot[i] == SLOT_COPYING)
      copying = true, s->slot[i] = SLOT_FREE;
  s->arena_used = 0;
  return copying ? dev_sync(s->dev) : 0;
}

bool stream_active(const struct stream *s) { return s && s->n_readers > 0; }

int stream_put(struct stream *s, void *dst, const void *src, size_t n) {
  if (n > PIECE)
    return set_error(QKEEP_E_INVAL, "stream_put: %zu bytes exceed a slot", n);
  int slot = n <= SMALL_PUT && s->slot[ARENA] != SLOT_READING ? ARENA : -1;
  size_t at = slot == ARENA ? s->arena_used : 0;
  if (slot == ARENA && at + n > PIECE)
    slot = -1; /* the arena is full: a wait empties it */
  if (slot < 0) {
    int rc = stream_wait(s);
    if (rc)
      return rc;
    slot = n <= SMALL_PUT ? ARENA : 0, at = 0;
  }
  unsigned char *room = s->ring + (size_t)slot * PIECE + at;
  memcpy(room, src, n);
  int rc = dev_h2d_async(s->dev, dst, room, n);
  if (rc)
    return rc;
  s->slot[slot] = SLOT_COPYING;
  if (slot == ARENA)
    s->arena_used = at + ((n + 63) & ~(size_t)63);
  return 0;
}

/* A free slot for a piece (the arena is kept for stream_put). */
static int free_slot(const struct stream *s) {
  for (int i = 0; i < SLOTS; i++)
    if (i != ARENA && s->slot[i] == SLOT_FREE)
      return i;
  return -1;
}

/* The pieces of the items, in order (NULL and an error when out of memory). */
static struct piece *cut(const struct stream_item *items, size_t n_items, size_t *n_pieces) {
  size_t n = 0;
  for (size_t i = 0; i < n_items; i++)
    n += items[i].t.nbytes ? (items[i].t.nbytes + PIECE - 1) / PIECE : 0;
  struct piece *p = calloc(n ? n : 1, sizeof *p);
  if (!p) {
    set_error(QKEEP_E_NOMEM, "out of memory for %zu pieces", n);
    return NULL;
  }
  size_t k = 0;
  for (size_t i = 0; i < n_items; i++)
    for (size_t at = 0; at < items[i].t.nbytes; at += PIECE, k++)
      p[k] = (struct piece){.t = items[i].t,
                            .on_host = items[i].on_host,
                            .item = i,
                            .at = at,
                            .n = items[i].t.nbytes - at < PIECE ? items[i].t.nbytes - at : PIECE};
  *n_pieces = n;
  return p;
}

/* Makes the items the stream's batch (nothing submitted yet). */
static int batch_begin(struct stream *s, const struct provider *pv, const struct stream_item *items,
                       size_t n_items) {
  size_t n = 0;
  struct piece *pieces = cut(items, n_items, &n);
  struct stream_item *copy = malloc((n_items ? n_items : 1) * sizeof *copy);
  if (!pieces || !copy) {
    free(pieces);
    free(copy);
    return set_error(QKEEP_E_NOMEM, "out of memory for the device stream's batch");
  }
  memcpy(copy, items, n_items * sizeof *copy);
  pthread_mutex_lock(&s->mu);
  s->pv = pv, s->pieces = pieces, s->n_pieces = n, s->submitted = s->taken = 0;
  pthread_mutex_unlock(&s->mu);
  s->items = copy, s->n_items = n_items;
  return 0;
}

/* Hands pieces to the readers while slots are free. Called with s->mu held. */
static void batch_submit(struct stream *s) {
  int slot;
  while (s->submitted < s->n_pieces && (slot = free_slot(s)) >= 0) {
    s->pieces[s->submitted].slot = slot;
    s->slot[slot] = SLOT_READING;
    s->submitted++;
    pthread_cond_signal(&s->work);
  }
}

/* Ends the batch: the readers finish what they took, nothing else is read, its slots not copied from
 * are free again. */
static void batch_drop(struct stream *s) {
  if (!s->pieces)
    return;
  pthread_mutex_lock(&s->mu);
  s->submitted = s->taken;
  for (size_t i = 0; i < s->taken; i++)
    while (!s->pieces[i].done)
      pthread_cond_wait(&s->done, &s->mu);
  struct piece *pieces = s->pieces;
  size_t n = s->n_pieces;
  s->pieces = NULL, s->n_pieces = s->submitted = s->taken = 0;
  pthread_mutex_unlock(&s->mu);
  for (size_t i = 0; i < n; i++)
    free(pieces[i].msg);
  for (int i = 0; i < SLOTS; i++) /* read and never copied */
    if (s->slot[i] == SLOT_READING)
      s->slot[i] = SLOT_FREE;
  free(pieces);
  free(s->items);
  s->items = NULL, s->n_items = 0;
}

/* Whether the batch read ahead is these items (the same tensors and sources, in order). */
static bool batch_is(const struct stream *s, const struct stream_item *items, size_t n_items) {
  if (!s->pieces || s->n_items != n_items)
    return false;
  for (size_t i = 0; i < n_items; i++)
    if (s->items[i].t.handle != items[i].t.handle || s->items[i].t.nbytes != items[i].t.nbytes ||
        s->items[i].t.name != items[i].t.name || s->items[i].on_host != items[i].on_host)
      return false;
  return true;
}

int stream_prefetch(struct stream *s, const struct provider *pv, const struct stream_item *items,
                    size_t n_items) {
  batch_drop(s);
  if (!n_items || (!s->n_readers && start_readers(s)) || batch_begin(s, pv, items, n_items))
    return 0; /* reading ahead is only a head start: without it the load reads later */
  pthread_mutex_lock(&s->mu);
  batch_submit(s);
  pthread_mutex_unlock(&s->mu);
  return 0;
}

int stream_items(struct stream *s, const struct provider *pv, const struct stream_item *items, size_t n_items) {
  int rc = s->n_readers ? 0 : start_readers(s);
  if (rc)
    return rc;
  if (!batch_is(s, items, n_items)) {
    batch_drop(s);
    if ((rc = batch_begin(s, pv, items, n_items)))
      return rc;
  }
  /* Where each piece goes is known now (a read ahead did not know it). */
  for (size_t k = 0; k < s->n_pieces; k++) {
    struct piece *p = &s->pieces[k];
    p->dst = items[p->item].dst + p->at;
    p->mirror = items[p->item].mirror ? items[p->item].mirror + p->at : NULL;
  }
  size_t copied = 0, n = s->n_pieces;
  while (copied < n && !rc) {
    pthread_mutex_lock(&s->mu);
    batch_submit(s);
    if (copied == s->submitted) { /* every slot waits on a copy: let the device finish them */
      pthread_mutex_unlock(&s->mu);
      rc = stream_wait(s);
      continue;
    }
    struct piece *p = &s->pieces[copied];
    while (!p->done)
      pthread_cond_wait(&s->done, &s->mu);
    pthread_mutex_unlock(&s->mu);
    const unsigned char *room = s->ring + (size_t)p->slot * PIECE;
    if (p->rc)
      rc = set_error(p->rc, "%s", p->msg ? p->msg : "read failed");
    else
      rc = dev_h2d_async(s->dev, p->dst, room, p->n);
    if (!rc && p->mirror)
      memcpy(p->mirror, room, p->n);
    s->slot[p->slot] = rc ? SLOT_FREE : SLOT_COPYING;
    copied++;
  }
  batch_drop(s); /* after a failure, the readers finish what they took first */
  return rc;
}
