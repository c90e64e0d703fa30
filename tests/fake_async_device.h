/*
 * fake_async_device.h: the memory ops a test's fake asynchronous device shares (check_stream,
 * check_online_device). The device lives in host memory; copy_h2d_async only queues its copy in
 * `q` (plugins/async_queue.h): the queue runs at sync, at any other memory op, or, up to a fence,
 * when that fence is waited on. A test adds its own alloc, free and copy_h2d_async (what it counts
 * or tracks) and builds its table from these. Header-only.
 */
#ifndef QKEEP_FAKE_ASYNC_DEVICE_H
#define QKEEP_FAKE_ASYNC_DEVICE_H

#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "plugins/async_queue.h"
#include "private.h"

static struct async_queue q;

/* Runs every queued copy. */
static inline void flush(void) { aq_flush(&q); }

static inline int f_copy(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  (void)be, flush();
  memmove(dst, src, n);
  return 0;
}
static inline int f_fill(const struct qkeep_backend *be, void *dst, int byte, size_t n) {
  (void)be, flush();
  memset(dst, byte, n);
  return 0;
}
static inline int f_sync(const struct qkeep_backend *be) { return (void)be, flush(), 0; }
static inline int f_host_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  (void)be;
  return (*out = malloc(bytes ? bytes : 1)) ? 0 : QKEEP_E_NOMEM;
}
static inline void f_host_free(const struct qkeep_backend *be, void *p) {
  (void)be;
  ck_assert_uint_eq(q.queued, 0); /* the core syncs before it frees its staging */
  free(p);
}
static inline int f_fence(const struct qkeep_backend *be, uint64_t *fence) {
  (void)be;
  ck_assert(aq_fence(&q, fence));
  return 0;
}
static inline int f_fence_wait(const struct qkeep_backend *be, uint64_t fence, int block) {
  (void)be;
  ck_assert_uint_lt(fence, q.fences);
  return aq_fence_wait(&q, fence, block);
}

#endif
