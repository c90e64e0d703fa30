/*
 * async_queue.h: an asynchronous device's copy queue, for the test devices in host memory
 * (test-async, and check_stream's fake device). A copy started is only queued; copies
 * complete in order, all of them at sync (or any other memory op), or up to a fence when
 * that fence is waited on, and a non-blocking wait says "not yet" every other time without
 * completing anything, as a busy device would. So a core that reuses staging memory before
 * its copy is done loads other bytes than it staged. Header-only (static inline).
 */
#ifndef QKEEP_TESTS_ASYNC_QUEUE_H
#define QKEEP_TESTS_ASYNC_QUEUE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct async_queue {
  struct async_copy {
    void *dst;
    const void *src;
    size_t n;
  } * copies; /* started and not yet done, oldest first */
  size_t queued, cap;
  size_t flushed;     /* copies done (copies[0] is copy number `flushed`) */
  uint64_t *fence_at; /* per fence token: the copies started before it */
  size_t fences, fence_cap;
  unsigned asks; /* non-blocking waits so far */
};

/* Completes the oldest `count` queued copies, in order. */
static inline void aq_complete(struct async_queue *q, size_t count) {
  for (size_t i = 0; i < count; i++)
    memcpy(q->copies[i].dst, q->copies[i].src, q->copies[i].n);
  if (q->queued > count) /* an empty queue may have no array yet */
    memmove(q->copies, q->copies + count, (q->queued - count) * sizeof *q->copies);
  q->queued -= count, q->flushed += count;
}

/* Completes every queued copy (sync, or any memory op that runs after them). */
static inline void aq_flush(struct async_queue *q) { aq_complete(q, q->queued); }

/* Queues a copy; false when out of memory. */
static inline bool aq_push(struct async_queue *q, void *dst, const void *src, size_t n) {
  if (q->queued == q->cap) {
    size_t cap = q->cap ? 2 * q->cap : 64;
    struct async_copy *c = realloc(q->copies, cap * sizeof *c);
    if (!c)
      return false;
    q->copies = c, q->cap = cap;
  }
  q->copies[q->queued++] = (struct async_copy){dst, src, n};
  return true;
}

/* A fence after every copy queued so far; false when out of memory. */
static inline bool aq_fence(struct async_queue *q, uint64_t *fence) {
  if (q->fences == q->fence_cap) {
    size_t cap = q->fence_cap ? 2 * q->fence_cap : 64;
    uint64_t *f = realloc(q->fence_at, cap * sizeof *f);
    if (!f)
      return false;
    q->fence_at = f, q->fence_cap = cap;
  }
  q->fence_at[q->fences] = q->flushed + q->queued;
  *fence = q->fences++;
  return true;
}

/* copy_fence_wait's answer for a fence aq_fence returned: 0 done (after completing the copies
 * before it when blocking), 1 not yet (only when not blocking). The caller checks the token. */
static inline int aq_fence_wait(struct async_queue *q, uint64_t fence, bool block) {
  uint64_t before = q->fence_at[fence];
  if (before <= q->flushed)
    return 0;
  if (!block && q->asks++ % 2 == 0)
    return 1;
  aq_complete(q, (size_t)(before - q->flushed));
  return 0;
}

/* Whether a queued copy still reads from [p, p + bytes). */
static inline bool aq_reads(const struct async_queue *q, const void *p, size_t bytes) {
  for (size_t i = 0; i < q->queued; i++)
    if ((const char *)q->copies[i].src >= (const char *)p &&
        (const char *)q->copies[i].src < (const char *)p + bytes)
      return true;
  return false;
}

static inline void aq_free(struct async_queue *q) {
  free(q->copies), free(q->fence_at);
  *q = (struct async_queue){0};
}

#endif
