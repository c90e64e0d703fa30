/*
 * format/provider.h: where tensor bytes come from (format/provider.c): a checkpoint's files or the
 * caller's named buffers, behind one table of functions, so that cold start, reload and sync read
 * through the same path. Uses base and the checkpoint reader.
 */
#ifndef QKEEP_PROVIDER_H
#define QKEEP_PROVIDER_H

#include "format/checkpoint.h"

/* One tensor a provider holds. */
struct provided {
  const char *name;
  int dtype; /* enum qkeep_dtype, or -1 for one qkeep does not use */
  const char *dtype_name;
  int ndim;
  const int64_t *shape;
  size_t nbytes;
  const char *where; /* the file (or "in-memory buffers") for errors */
  const void *handle;
  const uint64_t *full_shape; /* the file's own shape when it does not fit a spec (st_tensor), else NULL */
  int full_ndim;
  bool spec_only; /* in-memory buffers: a spec is all they can say, so a collapsed one stands for the full */
};

/* One allocation: [data, data + bytes). */
struct mem_block {
  const void *data;
  size_t bytes;
  bool checked; /* the values of every scale tensor in it were checked already (a sync's kept copies) */
};

/*
 * Where tensor bytes come from: a checkpoint (files) or the caller's named
 * buffers (host or device memory). Cold start and reload use the same path.
 */
struct provider {
  const char *what; /* the checkpoint path, or "in-memory buffers" */
  const void *ctx;
  /* Fills *out for the named tensor; false when the provider has no such tensor. */
  bool (*find)(const struct provider *p, const char *name, struct provided *out);
  /* Copies the tensor's bytes into host memory at dst. */
  int (*read)(const struct provider *p, const struct provided *t, void *dst);
  /* The tensor's bytes in host memory without a copy, or NULL (then read is used). */
  const void *(*host_bytes)(const struct provider *p, const struct provided *t);
  /* The tensor's bytes in the memory of the layer that takes it (on_device tensors), or NULL. */
  const void *(*device_bytes)(const struct provider *p, const struct provided *t);
  /* Every tensor name, for checking that the provider holds nothing the model lacks. */
  size_t (*count)(const struct provider *p);
  const char *(*name_at)(const struct provider *p, size_t i);
  /* (optional) Copies n tensors into host memory, ts[i] to dsts[i], in one batch. */
  int (*read_many)(const struct provider *p, const struct provided *ts, size_t n, void *const *dsts);
  /* (optional) Copies bytes [offset, offset + n) of the tensor (a range within it) into host memory. */
  int (*read_range)(const struct provider *p, const struct provided *t, size_t offset, size_t n, void *dst);
  /* (optional, with pass) Fills *out for the tensor whose handle find gave, without looking its name up. */
  void (*describe)(const struct provider *p, const void *handle, struct provided *out);
  /* Nonzero: this provider's number, unique for the process (provider_pass), under which check_source
   * remembers each source's tensor, so the load's later steps find it without a lookup; 0: nothing is
   * remembered. Two providers share one only when find gives the same answers for both. */
  uint64_t pass;
  /* (device buffers) Allocations each holding many of the provider's tensors: a copy may span several
   * tensors within one. NULL, 0: none known. */
  const struct mem_block *blocks;
  size_t n_blocks;
};

/* A number no provider had before (from 1 up, never reused). Thread safe. */
uint64_t provider_pass(void);

/* A provider over an open checkpoint. */
void ckpt_provider(struct provider *p, const struct ckpt *ck);

#endif
