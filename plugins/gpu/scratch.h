/*
 * scratch.h: the caller's workspace of one GPU launch (qkeep_apply_args.workspace), shared by
 * the CUDA and HIP launchers. A launcher takes its pieces in order, each 256-byte aligned, so
 * the bytes a launch needs are the sum of its pieces rounded up to 256 (gpu_scratch_round):
 * the backend's workspace slot adds them up the same way. Taking never allocates; a launcher
 * given no workspace (ws NULL: the benchmarks and tools) allocates stream-ordered instead.
 */
#ifndef QKEEP_GPU_SCRATCH_H
#define QKEEP_GPU_SCRATCH_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct gpu_scratch {
  char *base;   /* 256-byte aligned */
  size_t bytes; /* what the caller gave */
  size_t used;  /* what the launch took so far */
};

static inline size_t gpu_scratch_round(size_t n) { return (n + 255) & ~(size_t)255; }

/* The next n bytes of ws, or NULL when they do not fit (the workspace was sized for other arguments). */
static inline void *gpu_scratch_take(struct gpu_scratch *ws, size_t n) {
  if (!ws->base || n > ws->bytes || ws->used > ws->bytes - n)
    return NULL;
  void *p = ws->base + ws->used;
  ws->used += gpu_scratch_round(n);
  if (ws->used > ws->bytes)
    ws->used = ws->bytes;
  return p;
}

#ifdef __cplusplus
}
#endif
#endif
