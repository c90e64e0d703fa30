/*
 * device/device.h: memory on one device (host memory, or a backend's through its memory ops),
 * refcounted storage on it, and the tensor view over a storage (libqkeep/device/storage.c).
 * Uses base.
 */
#ifndef QKEEP_DEVICE_H
#define QKEEP_DEVICE_H

#include "base/base.h"

/* ---- devices and storage (storage.c) ------------------------------------------- */

/* Bytes held in storages (params, buffers, result tensors) and host staging. */
struct mem_stats {
  int64_t storage_bytes, storage_peak, staging_peak;
};

/*
 * The memory of the last result tensor a load or reload freed on a device, kept for the next
 * one: PWAL makes a result per transform, and a device allocator's alloc and free (cudaFree
 * waits for the device) cost more than the transform. Only while `on` (a load or reload).
 */
struct spare {
  bool on;
  int users;    /* spare_begin calls not yet ended: a weight sync keeps it across its reloads */
  void *data;   /* NULL: none kept */
  size_t bytes; /* its allocation */
};

/* Memory of one device: a backend's ops, or host memory when be is NULL. */
struct device {
  const struct qkeep_backend *be;
  const struct qkeep_memory_ops *ops;
  struct mem_stats *stats; /* the owning model's counters; NULL for the shared host device */
  struct spare *spare;     /* the owner's; NULL for the shared host device */
  struct stream **stream;  /* the owner's stream to it, made at its first streamed load; NULL likewise */
  void **gather;           /* the owner's scratch for gathering scales (reload/reload.c); NULL likewise */
};

/* The host device (memcpy-based ops). */
const struct device *host_device(void);
/* Whether a backend's memory table provides every slot the core calls (plugin.c refuses a
 * table that is set but short, so a device backend never gets host pointers). */
bool memory_ops_complete(const struct qkeep_memory_ops *ops);
/* Whether the table has ABI 1.2's pinned staging and asynchronous copy (all three slots). */
bool memory_ops_async(const struct qkeep_memory_ops *ops);
/* A device for a backend: its memory ops when it has them, else host memory. */
void device_init(struct device *dev, const struct qkeep_backend *be);

int dev_alloc(const struct device *dev, size_t bytes, void **out);
void dev_free(const struct device *dev, void *ptr);
int dev_h2d(const struct device *dev, void *dst, const void *src, size_t n);
int dev_d2h(const struct device *dev, void *dst, const void *src, size_t n);
int dev_d2d(const struct device *dev, void *dst, const void *src, size_t n);
int dev_fill(const struct device *dev, void *dst, int byte, size_t n);
int dev_sync(const struct device *dev);
/* Whether ops also have ABI 1.3's copy fences (copy_fence, copy_fence_wait). */
bool memory_ops_fences(const struct qkeep_memory_ops *ops);
/* ABI 1.3 slots; only for a device whose ops pass memory_ops_fences. dev_fence_wait returns 0
 * when the fence's copies are done, 1 when block is false and they are not yet, or an error. */
int dev_fence(const struct device *dev, uint64_t *fence);
int dev_fence_wait(const struct device *dev, uint64_t fence, bool block);
/* Copies n device ranges to device memory (no dst overlapping another range): with the backend's
 * copy_d2d_batch (ABI 1.5) in one call, else one dev_d2d each. */
int dev_d2d_batch(const struct device *dev, const struct qkeep_copy_range *ranges, size_t n);
/* Whether ops have ABI 1.6's find_bad_values. */
bool memory_ops_find_bad_values(const struct qkeep_memory_ops *ops);
/* find_bad_values (only for a device whose ops pass memory_ops_find_bad_values): *first the lowest range
 * with a byte its rule refuses, or n. */
int dev_find_bad_values(const struct device *dev, const struct qkeep_value_range *ranges, size_t n,
                        size_t *first);
/* ABI 1.2 slots; only for a device whose ops pass memory_ops_async. */
int dev_host_alloc(const struct device *dev, size_t bytes, void **out);
void dev_host_free(const struct device *dev, void *ptr);
int dev_h2d_async(const struct device *dev, void *dst, const void *src, size_t n);

/* Refcounted memory on one device. capacity 0 means empty (data NULL). */
struct storage {
  int refs;
  void *data;
  size_t capacity; /* the bytes it offers */
  size_t held;     /* the bytes allocated (more than capacity when it reuses a larger spare) */
  bool result;     /* a result tensor's: its memory may go to the device's spare */
  const struct device *dev;
};

/* A new zero-filled storage with one reference. */
int storage_new(const struct device *dev, size_t bytes, struct storage **out);
/* The same, its bytes left as the allocator gave them: for a param its load writes whole
 * (layer_find_covered), which zeroing would only write twice. */
int storage_new_unfilled(const struct device *dev, size_t bytes, struct storage **out);
/* The same for a result tensor: it may reuse (and, freed, refill) the device's spare. fill false
 * leaves its bytes as they are (its maker writes them all). */
int storage_new_result(const struct device *dev, size_t bytes, bool fill, struct storage **out);
/* Starts or ends keeping a spare on dev; they nest, and the last end frees the one kept. */
void spare_begin(const struct device *dev);
void spare_end(const struct device *dev);
void storage_ref(struct storage *s);
void storage_unref(struct storage *s);

/* A contiguous row-major view into a storage. */
struct tensor {
  struct storage *storage; /* counted reference; NULL for an empty tensor */
  size_t offset;
  struct qkeep_spec spec;
};

static inline void *tensor_ptr(const struct tensor *t) {
  return t->storage && t->storage->data ? (char *)t->storage->data + t->offset : NULL;
}
static inline size_t tensor_capacity(const struct tensor *t) {
  return t->storage ? t->storage->capacity - t->offset : 0;
}
/* Fills a qkeep_view from a tensor and state. */
void tensor_to_view(const struct tensor *t, enum qkeep_param_state state, struct qkeep_view *out);

#endif
