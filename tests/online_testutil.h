/*
 * online_testutil.h: what the online-quantization suites share (check_online, check_online_device,
 * check_gpu_online): every storage's address, to show a reload moved none, and a weight sync of a
 * model to a checkpoint through the buckets qkeep_sync_plan plans. Header-only.
 */
#ifndef QKEEP_ONLINE_TESTUTIL_H
#define QKEEP_ONLINE_TESTUTIL_H

#include <check.h>
#include <stdbool.h>
#include <stdlib.h>

#include "private.h"

/* Every storage's address, in the model's order (qkeep_foreach_storage with note_address). */
struct addresses {
  const void *at[4096];
  size_t n;
};
static inline int note_address(void *user, const char *layer, const char *name, const void *data,
                               size_t capacity) {
  (void)layer, (void)name, (void)capacity;
  struct addresses *a = user;
  ck_assert_uint_lt(a->n, 4096);
  a->at[a->n++] = data;
  return 0;
}

/* Where a sync's buckets live: host memory (NULL), or device memory that to_device fills from the
 * host bytes and release frees once the bucket's sync returned (after waiting for the device). */
struct bucket_memory {
  void *(*to_device)(const void *data, size_t bytes);
  void (*release)(void *on_device);
};

/* Syncs m to checkpoint w1 through the buckets qkeep_sync_plan plans (bucket_bytes each at most),
 * filled from w1's bytes; the sync's result (aborted after a failed bucket). */
static inline int sync_from_buckets(qkeep_model *m, const char *w1, size_t bucket_bytes,
                                    const struct bucket_memory *mem) {
  struct qkeep_sync_entry *e;
  size_t n, n_buckets;
  ck_assert_msg(qkeep_sync_plan(m, bucket_bytes, &e, &n, &n_buckets) == 0, "%s", qkeep_errmsg());
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(w1, &ck), 0);
  qkeep_sync *sync;
  ck_assert_int_eq(qkeep_sync_begin(m, &sync), 0);
  int rc = 0;
  for (size_t b = 0, first = 0; b < n_buckets && !rc; b++) {
    size_t end = first, bytes = 0;
    while (end < n && e[end].bucket == b) {
      size_t last = e[end].tensor.offset + qkeep_spec_bytes(&e[end].tensor.spec);
      bytes = last > bytes ? last : bytes;
      end++;
    }
    unsigned char *data = calloc(bytes ? bytes : 1, 1);
    struct qkeep_bucket_tensor *ts = calloc(end - first + 1, sizeof *ts);
    for (size_t i = first; i < end; i++) {
      const struct ckpt_tensor *t = ckpt_find(ck, e[i].tensor.name);
      ck_assert_msg(t != NULL, "the plan names '%s', which W1 lacks", e[i].tensor.name);
      ck_assert_int_eq(ckpt_read(ck, t, data + e[i].tensor.offset), 0);
      ts[i - first] = e[i].tensor;
    }
    void *dev = mem ? mem->to_device(data, bytes) : NULL;
    struct qkeep_bucket bucket = {sizeof bucket, ts, end - first, dev ? dev : data, bytes, dev != NULL};
    rc = qkeep_sync_bucket(sync, &bucket);
    if (dev)
      mem->release(dev);
    free(ts), free(data);
    first = end;
  }
  rc = rc ? (qkeep_sync_abort(sync), rc) : qkeep_sync_end(sync);
  ckpt_close(ck);
  qkeep_sync_plan_free(e);
  return rc;
}

#endif
