/*
 * device/stream.h: streaming tensor bytes from a provider to device memory through a pinned
 * ring of slots, read by threads and copied asynchronously (device/stream.c). Uses base, the
 * provider and the device.
 */
#ifndef QKEEP_STREAM_H
#define QKEEP_STREAM_H

#include "device/device.h"
#include "format/provider.h"

/* ---- streaming to a device (stream.c) ---- */

/* A pinned ring, reader threads and the device they feed (see stream.c). */
struct stream;
/* One tensor for the device: from the provider's file, or from host bytes it holds. */
struct stream_item {
  struct provided t;
  const unsigned char *on_host; /* NULL: read from the provider's file (read_range) */
  char *dst;                    /* its device memory */
  /* The device allocation dst lies in (its param's storage), or NULL: one copy may take pieces of two
   * items only when both name the same allocation (a copy may not span two: CUDA refuses it even when
   * they happen to lie side by side). Like dst, not needed to read ahead. */
  const void *alloc;
  unsigned char *mirror; /* NULL, or host memory that gets a copy of the bytes too */
  /* (optional) Checks a piece of the tensor in host memory before it is copied: its n bytes from byte `at`
   * (whole elements of t's dtype), with check_ctx. Called by a reader thread; 0, or an error (its message
   * set) that fails stream_items with that piece not copied. */
  int (*check)(const void *check_ctx, const struct provided *t, size_t at, const void *bytes, size_t n);
  const void *check_ctx;
};
/* QKEEP_E_INVAL naming the first field of the stream's shape out of its range ("stream_slots = 1:
 * expected 2 to 128"), else 0. */
int stream_options_check(const struct qkeep_load_options *options);
/* A stream to dev (its ops pass memory_ops_async) shaped by options (checked; NULL: the defaults):
 * the ring from its host_alloc; readers start with the first stream_items or stream_prefetch. */
int stream_new(const struct device *dev, const struct qkeep_load_options *options, struct stream **out);
/* The end of a load: waits for the copies (stream_wait); the ring and the reader threads stay for the
 * next load. */
int stream_end(struct stream *s);
/* stream_end, then stops the readers and frees the ring. */
void stream_free(struct stream *s);
const struct device *stream_device(const struct stream *s);
/* Pinned bytes the stream holds (0 for NULL). */
size_t stream_bytes(const struct stream *s);
/*
 * Streams the items' bytes to their device memory: read in parallel into the ring, copied by
 * copy_h2d_async in order. On return every copy has been started (not necessarily finished:
 * later work on the device's stream sees the bytes; stream_wait waits for them). On a read or
 * copy error, or a piece its item's check refuses (checked by the reader that read it, so its
 * bytes are never copied), nothing further is started and the first error is returned, with its
 * message. `then` (NULL, or n_then items: the next layer's, their dst not needed) are read into
 * the slots that free once every piece of `items` has one, so the readers never idle between two
 * calls; they go on being read after a successful return, as if stream_prefetch had been called.
 */
int stream_items(struct stream *s, const struct provider *pv, const struct stream_item *items,
                 size_t n_items, const struct stream_item *then, size_t n_then);
/*
 * Starts reading the items ahead (their dst and mirror are not needed yet, nor looked at) into
 * free slots, and returns at once; a stream_items call with the same items (tensors and order)
 * then continues from what was read. Best effort: returns 0 even when it could not start.
 */
int stream_prefetch(struct stream *s, const struct provider *pv, const struct stream_item *items,
                    size_t n_items);
/* Waits until every copy the stream started has finished (dev_sync), freeing their slots. */
int stream_wait(struct stream *s);
/*
 * Waits until every copy the stream started has finished, as stream_wait does, while the readers
 * read `items` ahead (as stream_prefetch) into each slot as soon as its copy is done: the device
 * then finds the next bytes in pinned memory after a wait that drains the stream (a quantize slot
 * reading back what it found). Without copy fences it does nothing and returns 0: the next wait
 * drains the stream as before. Returns 0, or the fence's error.
 */
int stream_drain_reading(struct stream *s, const struct provider *pv, const struct stream_item *items,
                         size_t n_items);
/* Whether a load is streaming through s now (its readers run): puts are then waited for by its end. */
bool stream_active(const struct stream *s);
/* Copies n bytes of host memory to device memory at dst, after the copies started before it:
 * through a slot without waiting for the device (small puts share one slot), or, larger than a
 * slot or with every slot being read ahead, by a plain copy after a wait. src may change once it
 * returns. */
int stream_put(struct stream *s, void *dst, const void *src, size_t n);

#endif
