/*
 * storage.c: device memory (a backend's memory ops, or host memory) and the
 * refcounted storage that params and buffers view.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "device/device.h"

/*
 * 64-byte alignment suits every SIMD kernel a CPU backend may run over the bytes. From 2 MiB on, the
 * whole pages of an allocation are faulted in writable at once (MADV_POPULATE_WRITE, Linux 5.14; advice
 * only: nothing changes where it is refused): everything allocated here is written soon after (a param
 * its load writes whole, a result tensor, a buffer), and one call costs less than a fault per 4 KiB
 * page inside the load's copies (a 219 MB model's cold start on two cores: 79 against 85 ms, medians of six
 * alternating rounds).
 */
#define HOST_POPULATE_FROM ((size_t)2 << 20)
static int host_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  (void)be;
  size_t rounded = (bytes + 63) & ~(size_t)63;
  *out = aligned_alloc(64, rounded ? rounded : 64);
  if (!*out)
    return QKEEP_E_NOMEM;
#ifdef MADV_POPULATE_WRITE
  if (rounded >= HOST_POPULATE_FROM) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), first = ((uintptr_t)*out + page - 1) & ~(page - 1),
              end = ((uintptr_t)*out + rounded) & ~(page - 1);
    if (end > first)
      (void)madvise((void *)first, end - first, MADV_POPULATE_WRITE);
  }
#endif
  return 0;
}
static void host_free(const struct qkeep_backend *be, void *ptr) {
  (void)be;
  free(ptr);
}
static int host_copy(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  (void)be;
  if (n)
    memmove(dst, src, n);
  return 0;
}
static int host_fill(const struct qkeep_backend *be, void *dst, int byte, size_t n) {
  (void)be;
  if (n)
    memset(dst, byte, n);
  return 0;
}
static int host_sync(const struct qkeep_backend *be) {
  (void)be;
  return 0;
}

static const struct qkeep_memory_ops host_ops = {
    .size = sizeof(struct qkeep_memory_ops),
    .alloc = host_alloc,
    .free = host_free,
    .copy_h2d = host_copy,
    .copy_d2h = host_copy,
    .copy_d2d = host_copy,
    .fill = host_fill,
    .sync = host_sync,
};

static const struct device host_dev = {NULL, &host_ops, NULL, NULL, NULL, NULL};

const struct device *host_device(void) { return &host_dev; }

bool memory_ops_complete(const struct qkeep_memory_ops *ops) {
  return ops && ops->size >= offsetof(struct qkeep_memory_ops, sync) + sizeof(ops->sync) && ops->alloc &&
         ops->free && ops->copy_h2d && ops->copy_d2h && ops->copy_d2d && ops->fill && ops->sync;
}

bool memory_ops_async(const struct qkeep_memory_ops *ops) {
  return ops &&
         ops->size >= offsetof(struct qkeep_memory_ops, copy_h2d_async) + sizeof(ops->copy_h2d_async) &&
         ops->host_alloc && ops->host_free && ops->copy_h2d_async;
}

bool memory_ops_fences(const struct qkeep_memory_ops *ops) {
  return memory_ops_async(ops) &&
         ops->size >= offsetof(struct qkeep_memory_ops, copy_fence_wait) + sizeof(ops->copy_fence_wait) &&
         ops->copy_fence && ops->copy_fence_wait;
}

void device_init(struct device *dev, const struct qkeep_backend *be) {
  dev->be = be;
  dev->ops = (be && memory_ops_complete(be->memory)) ? be->memory : &host_ops;
  dev->stats = NULL;
  dev->spare = NULL;
  dev->stream = NULL;
  dev->gather = NULL;
}

int dev_alloc(const struct device *dev, size_t bytes, void **out) {
  unsigned long before = error_generation();
  int rc = dev->ops->alloc(dev->be, bytes, out);
  if (rc && error_generation() != before) /* the backend said why (no device, out of memory): keep it */
    return add_error_context(rc, "cannot allocate %zu bytes of device memory", bytes);
  if (rc)
    return set_error(rc, "cannot allocate %zu bytes of device memory", bytes);
  return 0;
}
void dev_free(const struct device *dev, void *ptr) {
  if (ptr)
    dev->ops->free(dev->be, ptr);
}
int dev_h2d(const struct device *dev, void *dst, const void *src, size_t n) {
  int rc = n ? dev->ops->copy_h2d(dev->be, dst, src, n) : 0;
  return rc ? set_error(rc, "host-to-device copy of %zu bytes failed", n) : 0;
}
int dev_d2h(const struct device *dev, void *dst, const void *src, size_t n) {
  int rc = n ? dev->ops->copy_d2h(dev->be, dst, src, n) : 0;
  return rc ? set_error(rc, "device-to-host copy of %zu bytes failed", n) : 0;
}
int dev_d2d(const struct device *dev, void *dst, const void *src, size_t n) {
  int rc = (n && dst != src) ? dev->ops->copy_d2d(dev->be, dst, src, n) : 0;
  return rc ? set_error(rc, "device-to-device copy of %zu bytes failed", n) : 0;
}
int dev_d2d_batch(const struct device *dev, const struct qkeep_copy_range *ranges, size_t n) {
  const struct qkeep_memory_ops *ops = dev->ops;
  bool batch = ops->size >= offsetof(struct qkeep_memory_ops, copy_d2d_batch) + sizeof(ops->copy_d2d_batch) &&
               ops->copy_d2d_batch;
  if (!batch || n < 2) {
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++)
      rc = dev_d2d(dev, ranges[i].dst, ranges[i].src, ranges[i].bytes);
    return rc;
  }
  int rc = ops->copy_d2d_batch(dev->be, ranges, n);
  return rc ? set_error(rc, "batched device-to-device copy of %zu ranges failed", n) : 0;
}
bool memory_ops_find_bad_values(const struct qkeep_memory_ops *ops) {
  return ops &&
         ops->size >= offsetof(struct qkeep_memory_ops, find_bad_values) + sizeof(ops->find_bad_values) &&
         ops->find_bad_values;
}
int dev_find_bad_values(const struct device *dev, const struct qkeep_value_range *ranges, size_t n,
                        size_t *first) {
  *first = n;
  int rc = n ? dev->ops->find_bad_values(dev->be, ranges, n, first) : 0;
  if (rc)
    return set_error(rc, "the device's check of %zu scale ranges failed", n);
  if (*first > n)
    return set_error(QKEEP_E_DEVICE, "the device's check of %zu scale ranges answered range %zu", n, *first);
  return 0;
}
int dev_fill(const struct device *dev, void *dst, int byte, size_t n) {
  int rc = n ? dev->ops->fill(dev->be, dst, byte, n) : 0;
  return rc ? set_error(rc, "device fill of %zu bytes failed", n) : 0;
}
int dev_host_alloc(const struct device *dev, size_t bytes, void **out) {
  int rc = dev->ops->host_alloc(dev->be, bytes, out);
  if (rc)
    *out = NULL;
  return rc ? set_error(rc, "cannot allocate %zu bytes of pinned host memory", bytes) : 0;
}
void dev_host_free(const struct device *dev, void *ptr) {
  if (ptr)
    dev->ops->host_free(dev->be, ptr);
}
int dev_h2d_async(const struct device *dev, void *dst, const void *src, size_t n) {
  int rc = n ? dev->ops->copy_h2d_async(dev->be, dst, src, n) : 0;
  return rc ? set_error(rc, "asynchronous host-to-device copy of %zu bytes failed", n) : 0;
}
int dev_fence(const struct device *dev, uint64_t *fence) {
  int rc = dev->ops->copy_fence(dev->be, fence);
  return rc ? set_error(rc, "recording a copy fence failed") : 0;
}
int dev_fence_wait(const struct device *dev, uint64_t fence, bool block) {
  int rc = dev->ops->copy_fence_wait(dev->be, fence, block);
  return rc < 0 ? set_error(rc, "waiting for copy fence %llu failed", (unsigned long long)fence) : rc;
}
int dev_sync(const struct device *dev) {
  int rc = dev->ops->sync(dev->be);
  return rc ? set_error(rc, "device synchronisation failed") : 0;
}

/* Counts bytes allocated on the device (a spare stays counted: the device still holds it). */
static void count_held(const struct device *dev, int64_t bytes) {
  if (!dev->stats)
    return;
  dev->stats->storage_bytes += bytes;
  if (dev->stats->storage_bytes > dev->stats->storage_peak)
    dev->stats->storage_peak = dev->stats->storage_bytes;
}

static int storage_make(const struct device *dev, size_t bytes, bool result, bool fill,
                        struct storage **out) {
  struct storage *s = calloc(1, sizeof *s);
  if (!s)
    return set_error(QKEEP_E_NOMEM, "out of memory for a storage");
  s->refs = 1;
  s->dev = dev;
  s->capacity = s->held = bytes;
  s->result = result;
  struct spare *sp = result ? dev->spare : NULL;
  int rc = 0;
  if (sp && sp->on && sp->data && sp->bytes >= bytes) {
    s->data = sp->data, s->held = sp->bytes;
    sp->data = NULL;
  } else {
    /* Every storage has an address, even a zero-byte one, so the census can tell storages apart. */
    rc = dev_alloc(dev, bytes, &s->data);
    if (!rc)
      count_held(dev, (int64_t)bytes);
  }
  if (!rc && fill)
    rc = dev_fill(dev, s->data, 0, bytes);
  if (rc) {
    storage_unref(s);
    return rc;
  }
  *out = s;
  return 0;
}

int storage_new(const struct device *dev, size_t bytes, struct storage **out) {
  return storage_make(dev, bytes, false, true, out);
}

int storage_new_unfilled(const struct device *dev, size_t bytes, struct storage **out) {
  return storage_make(dev, bytes, false, false, out);
}

int storage_new_result(const struct device *dev, size_t bytes, bool fill, struct storage **out) {
  return storage_make(dev, bytes, true, fill, out);
}

void storage_ref(struct storage *s) { s->refs++; }

static void free_held(const struct device *dev, void *data, size_t bytes) {
  count_held(dev, -(int64_t)bytes);
  dev_free(dev, data);
}

/* The larger of a freed result's memory and the spare stays; the other is freed. */
void storage_unref(struct storage *s) {
  if (!s || --s->refs > 0)
    return;
  struct spare *sp = s->result ? s->dev->spare : NULL;
  if (sp && sp->on && s->data && (!sp->data || sp->bytes < s->held)) {
    if (sp->data)
      free_held(s->dev, sp->data, sp->bytes);
    sp->data = s->data, sp->bytes = s->held;
  } else if (s->data) {
    free_held(s->dev, s->data, s->held);
  }
  free(s);
}

void spare_begin(const struct device *dev) {
  if (dev->spare)
    dev->spare->on = true, dev->spare->users++;
}

void spare_end(const struct device *dev) {
  struct spare *sp = dev->spare;
  if (!sp || --sp->users > 0)
    return;
  if (sp->data)
    free_held(dev, sp->data, sp->bytes);
  *sp = (struct spare){0};
}

void tensor_to_view(const struct tensor *t, enum qkeep_param_state state, struct qkeep_view *out) {
  size_t want = out->size ? out->size : sizeof *out;
  struct qkeep_view v = {0};
  v.size = want < sizeof v ? want : sizeof v;
  v.data = tensor_ptr(t);
  v.nbytes = t->storage ? qkeep_spec_bytes(&t->spec) : 0; /* a released param views nothing */
  v.capacity = tensor_capacity(t);
  v.spec = t->spec;
  v.state = state;
  memcpy(out, &v, v.size);
}
