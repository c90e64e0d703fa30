/*
 * backend.c: the `cuda-nvfp4` backend. NVFP4 (ModelOpt and compressed-tensors
 * namings) linear and MoE layers on NVIDIA GPUs of compute capability 9.0 and
 * later, through a weight-only FP4 GEMM (kernels.cu); unquantized linear
 * layers through a plain kernel, so that a whole checkpoint loads.
 *
 * Params live in GPU memory (cudaMalloc; never managed memory). PWAL, per
 * NVFP4 matrix (a linear layer, or an MoE layer's stacked w13 and w2):
 *   weight        repacked into fragment tiles (layout.h) inside its own
 *                 storage; rebound only when padding (rows to 16, K to 64)
 *                 makes the tiles larger than the checkpoint bytes;
 *   weight_scale  128x4-swizzled the same way (rows to 128, columns to 4);
 *   alpha         a buffer: the decode global scale the kernel's epilogue
 *                 multiplies by (ModelOpt weight_scale_2; compressed-tensors
 *                 1 / weight_global_scale, 0 for an all-zero tensor);
 *   weight_scale_2 / weight_global_scale   retired (consumed into alpha);
 *   input_scale / input_global_scale       retired (the kernel is weight-only:
 *                 activations stay bf16/f16, so vLLM's W4A4 alpha factor
 *                 input_scale x weight_scale_2 reduces to weight_scale_2).
 * Each transform reads the checkpoint-format bytes, which reload restores
 * before it calls PWAL again, so a reload gives the bytes of a cold start and
 * replace copies into the same storage (no pointer moves). The per-layer state
 * only caches the device pointers PWAL leaves.
 *
 * `mxfp4` layers (gpt-oss and compressed-tensors) run on the MXFP4 kernels shared
 * with rocm-mxfp4 (plugins/gpu: mxfp4_pwal.c repacks, mxfp4.cu launches).
 *
 * A model that quantizes on load (NVFP4 either naming, MXFP4) has its bf16/f16/f32 weights
 * quantized here (the quantize slot, quantize.cu) into the loader params, byte for byte what
 * the core's host quantizer would have copied in.
 */
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <float.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cuda_nvfp4.h"
#include "layout.h"
#include "mxfp4.h"
#include "qkeep/qkeep_backend_util.h"

/* Events behind the copy fences, reused round robin (a reused one stands for a later fence). */
#define FENCE_EVENTS 64
/* Chunk tables of batched copies and checks, used round robin: a batch waits only for the upload of the
 * table used COPY_TABLES batches before, not for the device work queued behind the last one (a layer's
 * load would wait for the previous layer's PWAL). */
#define COPY_TABLES 4

/* One chunk table in pinned host memory and on the device, grown as needed, and the event behind its
 * last upload. */
struct copy_table {
  void *host, *dev;
  size_t cap; /* bytes each holds */
  cudaEvent_t uploaded;
  bool pending; /* uploaded set: an upload was recorded */
};

struct cuda_backend {
  struct qkeep_backend be; /* first, so the core's pointer is ours */
  const struct qkeep_host *host;
  struct qkeep_memory_ops memory;
  int device;
  struct nvfp4_tuning tuning; /* 0: automatic */
  bool pwal_on_host;          /* run the layout transforms with layout.c instead of on the GPU */
  bool pwal_in_place;         /* on the GPU in the param's own memory where the shape allows (pwal = in-place,
                               * the default) */
  bool quantize_on_device;    /* the quantize slot takes units (key quantize_on_device; else declines) */
  /* Copy fences (ABI 1.3): fence f is an event recorded in fence_event[f % FENCE_EVENTS]. */
  pthread_mutex_t fence_mu;
  uint64_t fences; /* tokens handed out */
  cudaEvent_t fence_event[FENCE_EVENTS];
  /* Batched copies and byte checks (ABI 1.5, 1.6): their chunk tables, the one to use next, and the
   * check's answer in device memory (all under copy_mu). */
  pthread_mutex_t copy_mu;
  struct copy_table tables[COPY_TABLES];
  unsigned next_table;
  unsigned long long *check_first; /* device memory: the lowest range with a bad byte (all ones: none) */
  /* The quantize slot's scan results (device memory, one struct fp4_quant_scan per member), made at its
   * first use; one unit at a time. */
  pthread_mutex_t quant_mu;
  void *quant_scan;
};

/* What apply needs of a layer, cached by PWAL (pointers do not move between PWALs). */
struct layer_state {
  bool dense, moe, mxfp4;
  struct mxfp4_layer mx;         /* mxfp4 layers */
  struct nvfp4_weights nvfp4[2]; /* linear: [0]; MoE: [QKEEP_MOE_W13], [QKEEP_MOE_W2] */
  const void *w, *bias;          /* dense */
  enum qkeep_dtype w_dtype, bias_dtype;
  int64_t n, k;
};

static struct cuda_backend *backend_of(const struct qkeep_backend *be) { return (struct cuda_backend *)be; }

static int cuda_error(const struct cuda_backend *c, cudaError_t err, const char *what) {
  (void)cudaGetLastError(); /* clear a non-sticky error so that the next call starts clean */
  /* No GPU, or none this driver can use: what the probe would have said, not an allocation failure. */
  bool no_device = err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver ||
                   err == cudaErrorInvalidDevice || err == cudaErrorDevicesUnavailable;
  return c->host->set_error(err == cudaErrorMemoryAllocation ? QKEEP_E_NOMEM
                            : no_device                      ? QKEEP_E_NODEV
                                                             : QKEEP_E_DEVICE,
                            "cuda-nvfp4: %s: %s%s (%s)", what, no_device ? "no device: " : "",
                            cudaGetErrorString(err), cudaGetErrorName(err));
}

/* Makes the configured device current for this thread. */
static int use_device(const struct cuda_backend *c) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != c->device)
    err = cudaSetDevice(c->device);
  return err == cudaSuccess ? 0 : cuda_error(c, err, "selecting the device");
}

/* ---- memory ops ------------------------------------------------------------------------------- */

static int mem_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  const struct cuda_backend *c = backend_of(be);
  int rc = use_device(c);
  if (rc)
    return rc;
  /* Every storage gets its own address, even an empty one. */
  cudaError_t err = cudaMalloc(out, bytes ? bytes : 1);
  if (err != cudaSuccess) {
    *out = NULL;
    return cuda_error(c, err, "cudaMalloc");
  }
  return 0;
}

static void mem_free(const struct qkeep_backend *be, void *ptr) {
  if (ptr && use_device(backend_of(be)) == 0)
    (void)cudaFree(ptr);
}

static int copy(const struct qkeep_backend *be, void *dst, const void *src, size_t n,
                enum cudaMemcpyKind kind) {
  const struct cuda_backend *c = backend_of(be);
  int rc = use_device(c);
  if (rc || !n)
    return rc;
  cudaError_t err = cudaMemcpy(dst, src, n, kind);
  return err == cudaSuccess ? 0 : cuda_error(c, err, "cudaMemcpy");
}

static int mem_h2d(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  return copy(be, dst, src, n, cudaMemcpyHostToDevice);
}

static int mem_d2h(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  return copy(be, dst, src, n, cudaMemcpyDeviceToHost);
}

/* memmove semantics: overlapping ranges go through a temporary (cudaMemcpy does not allow them). */
static int mem_d2d(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  const char *d = dst, *s = src;
  if (!n || d == s)
    return 0;
  if (!(d < s + n && s < d + n))
    return copy(be, dst, src, n, cudaMemcpyDeviceToDevice);
  void *tmp;
  int rc = mem_alloc(be, n, &tmp);
  if (!rc)
    rc = copy(be, tmp, src, n, cudaMemcpyDeviceToDevice);
  if (!rc)
    rc = copy(be, dst, tmp, n, cudaMemcpyDeviceToDevice);
  mem_free(be, tmp);
  return rc;
}

static int mem_fill(const struct qkeep_backend *be, void *dst, int byte, size_t n) {
  const struct cuda_backend *c = backend_of(be);
  int rc = use_device(c);
  if (rc || !n)
    return rc;
  cudaError_t err = cudaMemset(dst, byte, n);
  return err == cudaSuccess ? 0 : cuda_error(c, err, "cudaMemset");
}

/*
 * Page-locked host memory: copies from it run on the copy engine, without the driver's staging.
 * Ordinary pages registered with the driver (cudaHostRegister pinned 4 GiB in 0.1-0.2 s on an
 * H200 host where cudaHostAlloc took 2.5 s), or cudaHostAlloc's where registering is refused; a
 * header page before the bytes says which. From 2 MiB on, the pages are asked to be huge ones
 * (aligned and advised before they are first touched): registering a 64 MiB staging ring of 4 KiB
 * pages took 27 ms of an H100 host's 139 ms cold start, each page faulted, pinned and mapped alone.
 */
#define HOST_HEADER ((size_t)4096)
#define HOST_HUGE ((size_t)2 << 20)
struct host_header {
  bool registered; /* malloc'd and registered (else from cudaHostAlloc) */
};

/*
 * Faults in pages [p, p + bytes) before they are registered, by several threads: a page's first touch
 * is the kernel zeroing it, one page after another in a single thread otherwise (cudaHostRegister's),
 * and on a 2-vCPU VM 112 MiB of huge pages took 12 ms to fault in from one thread against 6.3 ms from
 * two. Each thread takes a whole number of huge pages; where a thread cannot start, the caller
 * touches its share. The bytes are unspecified afterwards, as malloc's.
 */
#define PREFAULT_MIN ((size_t)16 << 20) /* below this, one thread */
#define PREFAULT_THREADS 8
struct prefault {
  char *p;
  size_t bytes;
};

static void *prefault_run(void *arg) {
  const struct prefault *f = arg;
  for (size_t i = 0; i < f->bytes; i += 4096)
    ((volatile char *)f->p)[i] = 0;
  return NULL;
}

static void prefault(char *p, size_t bytes) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  size_t threads = cpus > 1 ? (size_t)cpus : 1;
  if (threads > PREFAULT_THREADS)
    threads = PREFAULT_THREADS;
  if (bytes < PREFAULT_MIN || threads < 2)
    return; /* cudaHostRegister faults them in */
  const size_t share = (bytes / threads + HOST_HUGE - 1) / HOST_HUGE * HOST_HUGE;
  struct prefault part[PREFAULT_THREADS];
  pthread_t tid[PREFAULT_THREADS];
  bool started[PREFAULT_THREADS] = {false};
  for (size_t t = 0; t < threads; t++) {
    size_t from = t * share < bytes ? t * share : bytes;
    part[t] = (struct prefault){p + from, from + share < bytes ? share : bytes - from};
    started[t] = t > 0 && pthread_create(&tid[t], NULL, prefault_run, &part[t]) == 0;
  }
  prefault_run(&part[0]);
  for (size_t t = 1; t < threads; t++) {
    if (started[t])
      (void)pthread_join(tid[t], NULL);
    else
      prefault_run(&part[t]);
  }
}

static int mem_host_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  const struct cuda_backend *c = backend_of(be);
  int rc = use_device(c);
  *out = NULL;
  if (rc)
    return rc;
  if (bytes > SIZE_MAX - HOST_HEADER)
    return c->host->set_error(QKEEP_E_NOMEM, "cuda-nvfp4: %zu bytes of pinned host memory", bytes);
  size_t total = HOST_HEADER + (bytes ? bytes : 1);
  void *base = NULL;
  bool huge = total >= HOST_HUGE && total <= SIZE_MAX - HOST_HUGE;
  if (huge)
    total = (total + HOST_HUGE - 1) / HOST_HUGE * HOST_HUGE;
  bool registered = posix_memalign(&base, huge ? HOST_HUGE : HOST_HEADER, total) == 0;
#ifdef MADV_HUGEPAGE
  if (registered && huge)
    (void)madvise(base, total, MADV_HUGEPAGE); /* advice: 4 KiB pages where the kernel has none */
#endif
  if (registered && huge)
    prefault(base, total);
  if (registered && cudaHostRegister(base, total, cudaHostRegisterDefault) != cudaSuccess) {
    (void)cudaGetLastError(); /* not sticky: the fallback below */
    free(base);
    base = NULL, registered = false;
  }
  if (!registered) {
    cudaError_t err = cudaHostAlloc(&base, total, cudaHostAllocDefault);
    if (err != cudaSuccess)
      return cuda_error(c, err, "cudaHostAlloc");
  }
  ((struct host_header *)base)->registered = registered;
  *out = (char *)base + HOST_HEADER;
  return 0;
}

static void mem_host_free(const struct qkeep_backend *be, void *ptr) {
  (void)be;
  if (!ptr)
    return;
  char *base = (char *)ptr - HOST_HEADER;
  if (((struct host_header *)base)->registered) {
    (void)cudaHostUnregister(base);
    free(base);
  } else {
    (void)cudaFreeHost(base);
  }
}

/* On the legacy default stream, which every other copy, fill and kernel of the backend uses: the
 * bytes are there for whatever runs next; the host waits for them in mem_sync. */
static int mem_h2d_async(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  const struct cuda_backend *c = backend_of(be);
  int rc = use_device(c);
  if (rc || !n)
    return rc;
  cudaError_t err = cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, 0);
  return err == cudaSuccess ? 0 : cuda_error(c, err, "cudaMemcpyAsync");
}

/* A fence after every copy started so far on the legacy stream: an event recorded there. */
static int mem_copy_fence(const struct qkeep_backend *be, uint64_t *fence) {
  struct cuda_backend *c = backend_of(be);
  int rc = use_device(c);
  if (rc)
    return rc;
  pthread_mutex_lock(&c->fence_mu);
  uint64_t f = c->fences;
  cudaEvent_t *ev = &c->fence_event[f % FENCE_EVENTS];
  cudaError_t err = *ev ? cudaSuccess : cudaEventCreateWithFlags(ev, cudaEventDisableTiming);
  if (err == cudaSuccess)
    err = cudaEventRecord(*ev, 0);
  if (err == cudaSuccess)
    c->fences++;
  pthread_mutex_unlock(&c->fence_mu);
  if (err != cudaSuccess)
    return cuda_error(c, err, "recording a copy fence");
  *fence = f;
  return 0;
}

/* Waits for (or asks about) the fence's event; if a later fence reused it, that one's point. */
static int mem_copy_fence_wait(const struct qkeep_backend *be, uint64_t fence, int block) {
  struct cuda_backend *c = backend_of(be);
  int rc = use_device(c);
  if (rc)
    return rc;
  pthread_mutex_lock(&c->fence_mu);
  bool known = fence < c->fences;
  cudaEvent_t ev = c->fence_event[fence % FENCE_EVENTS];
  pthread_mutex_unlock(&c->fence_mu);
  if (!known)
    return c->host->set_error(QKEEP_E_INVAL, "cuda-nvfp4: copy fence %llu was never recorded",
                              (unsigned long long)fence);
  cudaError_t err = block ? cudaEventSynchronize(ev) : cudaEventQuery(ev);
  if (err == cudaErrorNotReady)
    return 1;
  return err == cudaSuccess ? 0 : cuda_error(c, err, "waiting for a copy fence");
}

static int mem_sync(const struct qkeep_backend *be) {
  const struct cuda_backend *c = backend_of(be);
  int rc = use_device(c);
  if (rc)
    return rc;
  cudaError_t err = cudaDeviceSynchronize();
  return err == cudaSuccess ? 0 : cuda_error(c, err, "cudaDeviceSynchronize");
}

/*
 * The next chunk table of a batched copy or check, with room for `bytes` in pinned host memory to fill
 * once the event recorded behind its last upload has passed (*t; under copy_mu). cudaSuccess or the
 * error, with *what saying which step failed.
 */
static cudaError_t table_reserve(struct cuda_backend *c, size_t bytes, struct copy_table **t,
                                 const char **what) {
  struct copy_table *tb = &c->tables[c->next_table];
  cudaError_t err = cudaSuccess;
  c->next_table = (c->next_table + 1) % COPY_TABLES;
  *t = tb;
  *what = "waiting for an earlier chunk table";
  if (!tb->uploaded && (err = cudaEventCreateWithFlags(&tb->uploaded, cudaEventDisableTiming)) != cudaSuccess)
    *what = "cudaEventCreate (chunk table)", tb->uploaded = NULL;
  else if (tb->pending)
    err = cudaEventSynchronize(tb->uploaded);
  if (err == cudaSuccess && bytes > tb->cap) {
    size_t want = bytes > 2 * tb->cap ? bytes : 2 * tb->cap;
    void *h = NULL, *d = NULL;
    *what = "allocating the chunk table";
    if ((err = cudaHostAlloc(&h, want, cudaHostAllocDefault)) == cudaSuccess &&
        (err = cudaMalloc(&d, want)) == cudaSuccess) {
      (void)cudaFreeHost(tb->host);
      (void)cudaFree(tb->dev); /* after the kernels that read it: cudaFree waits for the device */
      tb->host = h, tb->dev = d, tb->cap = want;
    } else {
      (void)cudaFreeHost(h);
    }
  }
  return err;
}

/* Uploads the table's first `bytes` behind what the legacy stream runs, and records its event behind it
 * (under copy_mu). The kernel that reads it goes behind it on the same stream, and so before the table's
 * next upload. */
static cudaError_t table_upload(struct copy_table *t, size_t bytes, const char **what) {
  *what = "cudaMemcpyAsync (chunk table)";
  cudaError_t err = cudaMemcpyAsync(t->dev, t->host, bytes, cudaMemcpyHostToDevice, 0);
  if (err == cudaSuccess && (err = cudaEventRecord(t->uploaded, 0)) != cudaSuccess)
    *what = "cudaEventRecord (chunk table)";
  t->pending |= err == cudaSuccess;
  return err;
}

/*
 * ABI 1.5: the ranges cut into chunks of at most NVFP4_COPY_CHUNK bytes, their table written into
 * pinned host memory and copied to the device, and one kernel that copies every chunk, all on the
 * legacy stream behind what came before (table_reserve, table_upload).
 */
static int mem_copy_batch(const struct qkeep_backend *be, const struct qkeep_copy_range *ranges, size_t n) {
  struct cuda_backend *c = backend_of(be);
  int rc = use_device(c);
  if (rc)
    return rc;
  size_t chunks = 0;
  for (size_t i = 0; i < n; i++)
    chunks += (ranges[i].bytes + NVFP4_COPY_CHUNK - 1) / NVFP4_COPY_CHUNK;
  if (!chunks)
    return 0;
  const size_t bytes = chunks * sizeof(struct nvfp4_copy_chunk);
  const char *what;
  struct copy_table *t;
  pthread_mutex_lock(&c->copy_mu);
  cudaError_t err = table_reserve(c, bytes, &t, &what);
  if (err == cudaSuccess) {
    struct nvfp4_copy_chunk *table = t->host;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
      for (size_t at = 0; at < ranges[i].bytes; at += NVFP4_COPY_CHUNK) {
        size_t left = ranges[i].bytes - at;
        table[k++] = (struct nvfp4_copy_chunk){(char *)ranges[i].dst + at, (const char *)ranges[i].src + at,
                                               left < NVFP4_COPY_CHUNK ? left : NVFP4_COPY_CHUNK};
      }
    err = table_upload(t, bytes, &what);
  }
  if (err == cudaSuccess) {
    what = "copying chunks";
    err = (cudaError_t)nvfp4_copy_chunks_gpu(t->dev, chunks, NULL);
  }
  pthread_mutex_unlock(&c->copy_mu);
  return err == cudaSuccess ? 0 : cuda_error(c, err, what);
}

/*
 * ABI 1.6: the ranges cut into chunks as mem_copy_batch cuts them (a multiple of 4 bytes: no value
 * spans two chunks), one kernel that checks every chunk
 * and keeps the lowest range index with a bad byte (atomicMin), and one read of that index, which waits
 * for the kernel (and for everything queued before it).
 */
static int mem_find_bad_values(const struct qkeep_backend *be, const struct qkeep_value_range *ranges,
                               size_t n, size_t *first) {
  struct cuda_backend *c = backend_of(be);
  size_t chunks = 0;
  *first = n;
  for (size_t i = 0; i < n; i++) {
    size_t size = qkeep_be_value_size(ranges[i].rule);
    if (!size || ranges[i].bytes % size)
      return c->host->set_error(QKEEP_E_INVAL,
                                "cuda-nvfp4: find_bad_values: range %zu has rule %d and %zu bytes", i,
                                ranges[i].rule, ranges[i].bytes);
    chunks += (ranges[i].bytes + NVFP4_COPY_CHUNK - 1) / NVFP4_COPY_CHUNK;
  }
  if (n > UINT32_MAX)
    return c->host->set_error(QKEEP_E_INVAL, "cuda-nvfp4: find_bad_values: %zu ranges", n);
  int rc = chunks ? use_device(c) : 0;
  if (rc || !chunks)
    return rc;
  const size_t bytes = chunks * sizeof(struct nvfp4_check_chunk);
  const char *what = "allocating the check's answer";
  struct copy_table *t = NULL;
  unsigned long long found = ~0ull;
  pthread_mutex_lock(&c->copy_mu);
  cudaError_t err = c->check_first ? cudaSuccess : cudaMalloc((void **)&c->check_first, sizeof found);
  if (err == cudaSuccess)
    err = table_reserve(c, bytes, &t, &what);
  if (err == cudaSuccess) {
    struct nvfp4_check_chunk *table = t->host;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
      for (size_t at = 0; at < ranges[i].bytes; at += NVFP4_COPY_CHUNK) {
        size_t left = ranges[i].bytes - at;
        table[k++] = (struct nvfp4_check_chunk){(const unsigned char *)ranges[i].at + at, (uint32_t)i,
                                                (uint32_t)ranges[i].rule,
                                                left < NVFP4_COPY_CHUNK ? left : NVFP4_COPY_CHUNK};
      }
    if ((err = cudaMemsetAsync(c->check_first, 0xff, sizeof found, 0)) != cudaSuccess)
      what = "cudaMemsetAsync (the check's answer)";
    else
      err = table_upload(t, bytes, &what);
  }
  if (err == cudaSuccess) {
    what = "checking bytes";
    err = (cudaError_t)nvfp4_check_chunks_gpu(t->dev, chunks, c->check_first, NULL);
  }
  if (err == cudaSuccess &&
      (err = cudaMemcpy(&found, c->check_first, sizeof found, cudaMemcpyDeviceToHost)) != cudaSuccess)
    what = "reading the check's answer";
  pthread_mutex_unlock(&c->copy_mu);
  if (err != cudaSuccess)
    return cuda_error(c, err, what);
  *first = found < n ? (size_t)found : n;
  return 0;
}

/* ---- probe, configure, supports ----------------------------------------------------------------- */

/* Whether the NVIDIA kernel driver shows: a /dev/nvidia* node, or /proc/driver/nvidia. Without
 * either, the runtime's own error ("driver version is insufficient") names the wrong cause. */
static bool nvidia_driver_present(void) {
  if (access("/proc/driver/nvidia", F_OK) == 0)
    return true;
  DIR *dev = opendir("/dev");
  bool found = false;
  for (struct dirent *e; dev && !found && (e = readdir(dev));)
    found = strncmp(e->d_name, "nvidia", 6) == 0;
  if (dev)
    closedir(dev);
  return found;
}

static int cuda_probe(const struct qkeep_backend *be, char *msg, size_t msg_len) {
  const struct cuda_backend *c = backend_of(be);
  char dummy[1];
  if (!msg_len)
    msg = dummy, msg_len = sizeof dummy;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess && !nvidia_driver_present()) {
    snprintf(msg, msg_len, "no NVIDIA driver or device (/dev/nvidia* and /proc/driver/nvidia absent)");
    (void)cudaGetLastError();
    return QKEEP_E_NODEV;
  }
  if (err != cudaSuccess) {
    snprintf(msg, msg_len, "no usable CUDA device: %s (%s)", cudaGetErrorString(err), cudaGetErrorName(err));
    (void)cudaGetLastError();
    return QKEEP_E_NODEV;
  }
  if (c->device >= count) {
    snprintf(msg, msg_len, "CUDA device %d requested, %d present", c->device, count);
    return QKEEP_E_NODEV;
  }
  struct cudaDeviceProp prop;
  err = cudaGetDeviceProperties(&prop, c->device);
  if (err != cudaSuccess) {
    snprintf(msg, msg_len, "CUDA device %d: %s", c->device, cudaGetErrorString(err));
    (void)cudaGetLastError();
    return QKEEP_E_NODEV;
  }
  if (prop.major < 9) {
    snprintf(
        msg, msg_len,
        "CUDA device %d (%s) has compute capability %d.%d; the kernels need 9.0 or later (built for sm_90a "
        "plus compute_90 PTX)",
        c->device, prop.name, prop.major, prop.minor);
    return QKEEP_E_NODEV;
  }
  snprintf(msg, msg_len, "CUDA device %d: %s, compute capability %d.%d, %d SMs, %.1f GiB", c->device,
           prop.name, prop.major, prop.minor, prop.multiProcessorCount,
           (double)prop.totalGlobalMem / (1024.0 * 1024 * 1024));
  return 0;
}

/* A decimal in [lo, hi], or "auto" (0) when allow_auto. */
static bool parse_int(const char *s, int lo, int hi, bool allow_auto, int *out) {
  if (allow_auto && strcmp(s, "auto") == 0) {
    *out = 0;
    return true;
  }
  char *end;
  long v = strtol(s, &end, 10);
  if (end == s || *end || v < lo || v > hi)
    return false;
  *out = (int)v;
  return true;
}

/* What `qkeep plugins --verbose` lists; the core checks names and values against it first. */
static const struct qkeep_backend_key cuda_keys[] = {
    {"device", QKEEP_KEY_INT, "0..1023", "0", "CUDA device index"},
    {"kernel", QKEEP_KEY_ENUM, "auto|ring|stream|wgmma", "auto",
     "auto: stream for M <= 16 (routed MoE: 16 tokens per expert), wgmma above on compute capability 9.0, "
     "ring elsewhere; MXFP4 runs its mma.sync kernel but where wgmma is asked for (from 32 tokens, and "
     "routed "
     "MoE, on 9.0)"},
    {"tile_m", QKEEP_KEY_ENUM, "auto|8|16|32|64|128|256", "auto",
     "tokens per block: ring 8, 16, 32 or 64; wgmma 8 to 256"},
    {"split_k", QKEEP_KEY_ENUM, "auto|1|2|3|4|5|6|7|8", "auto", "K split across a thread-block cluster"},
    {"depth", QKEEP_KEY_ENUM, "auto|1|2|3|4|5|6|7|8", "auto",
     "ring kernel: pipeline depth; stream kernel: 3 caps registers for 3 blocks per SM"},
    {"rows", QKEEP_KEY_ENUM, "auto|1|2|4", "auto",
     "stream kernel: 16-row weight tiles per block; wgmma: 64-row MMA tiles per consumer warpgroup (1 or 2)"},
    {"unroll", QKEEP_KEY_ENUM, "auto|4|8", "auto", "stream kernel: 64-K chunks loaded per batch"},
    {"multicast", QKEEP_KEY_ENUM, "auto|1|2|4", "auto",
     "wgmma kernel without a K split: row blocks of a cluster that share each activation tile "
     "(auto: 1; 2 and 4 ran slower on the H200)"},
    {"route", QKEEP_KEY_ENUM, "auto|align|self", "auto",
     "routed MoE on the stream kernel: auto (each block finds its token tile up to 32 token-expert pairs, "
     "else a sorting kernel first), align (always the sorting kernel) or self (each block, up to 256 pairs)"},
    {"pwal", QKEEP_KEY_ENUM, "in-place|gpu|host", "in-place",
     "where the layout transforms run: in-place (on the GPU in the param's own memory where the shape "
     "allows, else as gpu), gpu (into a new tensor, copied back), host (their CPU twins)"},
    {"fp8_activations", QKEEP_KEY_BOOL, NULL, "false",
     "NVFP4 GEMMs of 64 tokens or more (and routed MoE on the wgmma kernel) on compute capability 9.0: "
     "activations quantized to "
     "FP8 e4m3 per token (scale max |x| / 448) and the decoded weights rounded to e4m3, on the FP8 tensor "
     "cores: approximate (docs/PERFORMANCE.md has its error); false: W4A16, exact"},
    {"quantize_on_device", QKEEP_KEY_BOOL, NULL, "true",
     "online quantization (NVFP4, MXFP4) on the GPU, bit for bit the host quantizer's bytes (false: every "
     "unit is quantized on the host and its bytes copied over)"},
};

static int cuda_configure(const struct qkeep_backend *be, const char *key, const char *value) {
  struct cuda_backend *c = backend_of(be);
  int v;
  if (strcmp(key, "device") == 0) {
    if (!parse_int(value, 0, 1023, false, &v))
      return c->host->set_error(QKEEP_E_CONFIG, "device = '%s': expected a CUDA device index", value);
    c->device = v;
  } else if (strcmp(key, "tile_m") == 0) {
    if (!parse_int(value, 8, 256, true, &v) ||
        (v && v != 8 && v != 16 && v != 32 && v != 64 && v != 128 && v != 256))
      return c->host->set_error(QKEEP_E_CONFIG, "tile_m = '%s': expected auto, 8, 16, 32, 64, 128 or 256",
                                value);
    c->tuning.tile_m = v;
  } else if (strcmp(key, "split_k") == 0) {
    if (!parse_int(value, 1, 8, true, &v))
      return c->host->set_error(QKEEP_E_CONFIG, "split_k = '%s': expected auto or 1 to 8", value);
    c->tuning.split_k = v;
  } else if (strcmp(key, "depth") == 0) {
    if (!parse_int(value, 1, 8, true, &v))
      return c->host->set_error(QKEEP_E_CONFIG, "depth = '%s': expected auto or 1 to 8", value);
    c->tuning.depth = v;
  } else if (strcmp(key, "kernel") == 0) {
    if (strcmp(value, "auto") == 0)
      c->tuning.kernel = NVFP4_KERNEL_AUTO;
    else if (strcmp(value, "ring") == 0)
      c->tuning.kernel = NVFP4_KERNEL_RING;
    else if (strcmp(value, "stream") == 0)
      c->tuning.kernel = NVFP4_KERNEL_STREAM;
    else if (strcmp(value, "wgmma") == 0)
      c->tuning.kernel = NVFP4_KERNEL_WGMMA;
    else
      return c->host->set_error(QKEEP_E_CONFIG, "kernel = '%s': expected auto, ring, stream or wgmma", value);
  } else if (strcmp(key, "rows") == 0) {
    if (!parse_int(value, 1, 4, true, &v) || v == 3)
      return c->host->set_error(QKEEP_E_CONFIG, "rows = '%s': expected auto, 1, 2 or 4", value);
    c->tuning.rows = v;
  } else if (strcmp(key, "multicast") == 0) {
    if (!parse_int(value, 1, 4, true, &v) || v == 3)
      return c->host->set_error(QKEEP_E_CONFIG, "multicast = '%s': expected auto, 1, 2 or 4", value);
    c->tuning.multicast = v;
  } else if (strcmp(key, "unroll") == 0) {
    if (!parse_int(value, 4, 8, true, &v) || (v && v != 4 && v != 8))
      return c->host->set_error(QKEEP_E_CONFIG, "unroll = '%s': expected auto, 4 or 8", value);
    c->tuning.unroll = v;
  } else if (strcmp(key, "route") == 0) {
    if (strcmp(value, "auto") == 0)
      c->tuning.route = NVFP4_ROUTE_AUTO;
    else if (strcmp(value, "align") == 0)
      c->tuning.route = NVFP4_ROUTE_ALIGN;
    else if (strcmp(value, "self") == 0)
      c->tuning.route = NVFP4_ROUTE_SELF;
    else
      return c->host->set_error(QKEEP_E_CONFIG, "route = '%s': expected auto, align or self", value);
  } else if (strcmp(key, "pwal") == 0) {
    if (strcmp(value, "gpu") != 0 && strcmp(value, "in-place") != 0 && strcmp(value, "host") != 0)
      return c->host->set_error(QKEEP_E_CONFIG, "pwal = '%s': expected gpu, in-place or host", value);
    c->pwal_on_host = value[0] == 'h';
    c->pwal_in_place = value[0] == 'i';
  } else if (strcmp(key, "quantize_on_device") == 0 || strcmp(key, "fp8_activations") == 0) {
    static const char *const yes[] = {"true", "yes", "on", "1"}, *const no[] = {"false", "no", "off", "0"};
    int found = -1;
    for (int i = 0; i < 4 && found < 0; i++)
      found = strcmp(value, yes[i]) == 0 ? 1 : strcmp(value, no[i]) == 0 ? 0 : -1;
    if (found < 0)
      return c->host->set_error(QKEEP_E_CONFIG, "%s = '%s': expected true or false", key, value);
    if (key[0] == 'q')
      c->quantize_on_device = found == 1;
    else
      c->tuning.fp8 = found == 1;
  } else {
    return c->host->set_error(QKEEP_E_CONFIG,
                              "unknown key '%s' (cuda-nvfp4 takes device, kernel, tile_m, split_k, depth, "
                              "rows, unroll, multicast, route, pwal, fp8_activations, quantize_on_device)",
                              key);
  }
  return 0;
}

static bool is_nvfp4(const char *scheme) {
  return strcmp(scheme, "modelopt-nvfp4") == 0 || strcmp(scheme, "ct-nvfp4") == 0;
}

static int cuda_supports(const struct qkeep_backend *be, const char *scheme, enum qkeep_layer_kind kind) {
  (void)be;
  if (is_nvfp4(scheme) || strcmp(scheme, "mxfp4") == 0)
    return kind == QKEEP_LAYER_LINEAR || kind == QKEEP_LAYER_MOE;
  return strcmp(scheme, "unquantized") == 0 && kind == QKEEP_LAYER_LINEAR;
}

/* Linear and MoE layers by scheme; every other kind (norms, embeddings, kv scales) lives on the GPU. */
static int cuda_supports_layer(const struct qkeep_backend *be, const struct qkeep_layer_info *info,
                               char *reason, size_t reason_len) {
  if (info->kind != QKEEP_LAYER_LINEAR && info->kind != QKEEP_LAYER_MOE)
    return 1;
  if (cuda_supports(be, info->scheme, info->kind))
    return 1;
  snprintf(reason, reason_len,
           "runs NVFP4 and MXFP4 linear and MoE layers and unquantized linear ones, not %s %s", info->scheme,
           info->kind == QKEEP_LAYER_MOE ? "MoE" : "linear");
  return 0;
}

/* ---- PWAL ---------------------------------------------------------------------------------------- */

/* A spec with an optional leading expert dimension. */
static struct qkeep_spec stacked(enum qkeep_dtype dtype, int64_t experts, int ndim, const int64_t *shape) {
  struct qkeep_spec s = {.dtype = dtype, .ndim = 0};
  if (experts)
    s.shape[s.ndim++] = experts;
  for (int i = 0; i < ndim; i++)
    s.shape[s.ndim++] = shape[i];
  return s;
}

enum transform { TILE_WEIGHTS, SWIZZLE_SCALES };

/* One NVFP4 matrix set being transformed: names are prefix + local name. */
struct matrix {
  struct cuda_backend *c;
  qkeep_layer *layer;
  const char *layer_name;
  const char *prefix;       /* "", "w13_", "w2_" */
  int64_t rows, k, experts; /* experts 0: a linear layer (no leading dimension) */
};

static const char *full_name(const struct matrix *m, const char *local, char *buf, size_t len) {
  snprintf(buf, len, "%s%s", m->prefix, local);
  return buf;
}

/* The CPU path of a transform: device -> host, layout.c per expert, host -> device. */
static int transform_on_host(const struct matrix *m, enum transform tr, const void *src, void *dst) {
  int64_t experts = m->experts ? m->experts : 1, cols = m->k / NVFP4_BLOCK;
  size_t in_bytes = (size_t)(tr == TILE_WEIGHTS ? m->rows * m->k / 2 : m->rows * cols);
  size_t out_bytes =
      (size_t)(tr == TILE_WEIGHTS ? nvfp4_w_bytes(m->rows, m->k) : nvfp4_sf_bytes(m->rows, cols));
  uint8_t *in = malloc(in_bytes * (size_t)experts + 1), *out = malloc(out_bytes * (size_t)experts + 1);
  int rc = in && out
               ? 0
               : m->c->host->set_error(QKEEP_E_NOMEM, "cuda-nvfp4: %s: out of host memory", m->layer_name);
  if (!rc)
    rc = mem_d2h(&m->c->be, in, src, in_bytes * (size_t)experts);
  for (int64_t e = 0; !rc && e < experts; e++) {
    if (tr == TILE_WEIGHTS)
      nvfp4_tile_weights(in + (size_t)e * in_bytes, m->rows, m->k, out + (size_t)e * out_bytes);
    else
      nvfp4_swizzle_scales(in + (size_t)e * in_bytes, m->rows, cols, out + (size_t)e * out_bytes);
  }
  if (!rc)
    rc = mem_h2d(&m->c->be, dst, out, out_bytes * (size_t)experts);
  free(in);
  free(out);
  return rc;
}

/*
 * With pwal = in-place, the transform in the param's own storage (a cluster of blocks holds each 128-row
 * group in shared memory while it writes it back), where its kernel layout is exactly as large as the
 * checkpoint's: one pass over the bytes and no result tensor, nor the copy back into the param that
 * replace makes. 0 when done (the view declared with replace_in_place), 1 when not asked for or the shape
 * does not allow it (nothing changed), else the error.
 */
static int in_place(const struct matrix *m, const char *name, enum transform tr, const struct qkeep_view *v,
                    int64_t experts, int64_t cols, const struct qkeep_spec *kernel) {
  if (!m->c->pwal_in_place || qkeep_be_spec_bytes(kernel) != v->nbytes)
    return 1;
  int err = tr == TILE_WEIGHTS ? nvfp4_tile_weights_in_place_gpu(v->data, experts, m->rows, m->k, NULL)
                               : nvfp4_swizzle_scales_in_place_gpu(v->data, experts, m->rows, cols, NULL);
  if (err == cudaErrorNotSupported)
    return 1;
  if (err)
    return cuda_error(m->c, (cudaError_t)err,
                      tr == TILE_WEIGHTS ? "tiling weights in place" : "swizzling scales in place");
  return m->c->host->replace_in_place(m->layer, name, kernel);
}

/*
 * Rewrites param `local` (weight or weight_scale) from its checkpoint layout into the kernel's:
 * in its own storage (in_place, when asked for and the layout is exactly as large), else through a
 * result tensor and replace (copied back into the param's storage when it fits, rebound when
 * padding makes it larger). *data is the param's data pointer afterwards.
 */
static int transform(const struct matrix *m, const char *local, enum transform tr, const void **data) {
  const struct qkeep_host *host = m->c->host;
  char name[64];
  full_name(m, local, name, sizeof name);
  struct qkeep_view v = {.size = sizeof v};
  int rc = host->view(m->layer, name, &v);
  if (rc)
    return rc;
  int64_t cols = m->k / NVFP4_BLOCK;
  int64_t ckpt_shape[2] = {m->rows, tr == TILE_WEIGHTS ? m->k / 2 : cols};
  int64_t kernel_shape[3] = {nvfp4_w_rows(m->rows) / NVFP4_TILE_ROWS, nvfp4_w_chunks(m->k), NVFP4_TILE_BYTES};
  if (tr == SWIZZLE_SCALES) {
    kernel_shape[0] = nvfp4_sf_rows(m->rows) / NVFP4_SF_ROWS;
    kernel_shape[1] = nvfp4_sf_cols(cols) / NVFP4_SF_COLS;
    kernel_shape[2] = NVFP4_SF_ATOM;
  }
  enum qkeep_dtype dtype = tr == TILE_WEIGHTS ? QKEEP_DTYPE_U8 : QKEEP_DTYPE_F8_E4M3;
  struct qkeep_spec want = stacked(dtype, m->experts, 2, ckpt_shape);
  struct qkeep_spec kernel = stacked(dtype, m->experts, 3, kernel_shape);
  if (!qkeep_be_spec_equal(&v.spec, &want))
    return host->set_error(
        qkeep_be_spec_equal(&v.spec, &kernel) ? QKEEP_E_STATE : QKEEP_E_FORMAT,
        "cuda-nvfp4: %s.%s is not in its checkpoint layout (%s); PWAL transforms checkpoint "
        "bytes only, and reload restores them before it runs again",
        m->layer_name, name, qkeep_be_spec_equal(&v.spec, &kernel) ? "already transformed" : "other shape");
  int64_t experts = m->experts ? m->experts : 1;
  int rc_in_place = in_place(m, name, tr, &v, experts, cols, &kernel);
  if (rc_in_place <= 0) {
    *data = v.data;
    return rc_in_place;
  }
  /* The GPU transforms write every byte of the result, padding included: no zero-fill first (ABI 1.7). */
  qkeep_tensor *result;
  const bool unfilled = !m->c->pwal_on_host && QKEEP_HAS_SLOT(host, struct qkeep_host, tensor_new_unfilled);
  if ((rc = (unfilled ? host->tensor_new_unfilled : host->tensor_new)(m->layer, &kernel, &result)))
    return rc;
  void *dst = host->tensor_data(result);
  if (m->c->pwal_on_host) {
    rc = transform_on_host(m, tr, v.data, dst);
  } else {
    int err = tr == TILE_WEIGHTS ? nvfp4_tile_weights_gpu(v.data, dst, experts, m->rows, m->k, NULL)
                                 : nvfp4_swizzle_scales_gpu(v.data, dst, experts, m->rows, cols, NULL);
    if (err)
      rc = cuda_error(m->c, (cudaError_t)err, tr == TILE_WEIGHTS ? "tiling weights" : "swizzling scales");
  }
  if (rc) {
    host->tensor_free(result);
    return rc;
  }
  /* Same stream as the copy replace makes: the transform finishes first. */
  if ((rc = host->replace(m->layer, name, result)))
    return rc;
  struct qkeep_view after = {.size = sizeof after};
  rc = host->view(m->layer, name, &after);
  *data = after.data;
  return rc;
}

/* The alpha buffer ([experts] or []) from the merged global scale param, which is retired. */
static int make_alpha(const struct matrix *m, bool ct, const float **alpha) {
  const struct qkeep_host *host = m->c->host;
  char name[64], buffer[64];
  full_name(m, ct ? "weight_global_scale" : "weight_scale_2", name, sizeof name);
  int64_t experts = m->experts ? m->experts : 1;
  struct qkeep_view v = {.size = sizeof v};
  int rc = host->view(m->layer, name, &v);
  if (rc)
    return rc;
  if (v.spec.dtype != QKEEP_DTYPE_F32 || v.nbytes != sizeof(float) * (size_t)experts)
    return host->set_error(QKEEP_E_FORMAT,
                           "cuda-nvfp4: %s.%s: expected %lld merged f32 scale(s), have %zu bytes",
                           m->layer_name, name, (long long)experts, v.nbytes);
  struct qkeep_spec spec = {.dtype = QKEEP_DTYPE_F32, .ndim = m->experts ? 1 : 0, .shape = {m->experts}};
  struct qkeep_view b = {.size = sizeof b};
  rc = host->add_buffer(m->layer, full_name(m, "alpha", buffer, sizeof buffer), &spec, &b);
  /* On the device, queued behind the loads (no wait for them). compressed-tensors stores the encode
   * factor 2688/amax, inverted here; 0 marks an all-zero tensor. */
  if (!rc) {
    int err = nvfp4_alpha_gpu(v.data, b.data, experts, ct, NULL);
    if (err)
      rc = cuda_error(m->c, (cudaError_t)err, "computing alpha");
  }
  if (!rc)
    rc = host->retire(m->layer, name);
  *alpha = b.data;
  return rc;
}

/* Retires the input scale when the checkpoint has one: the weight-only kernel never reads it. */
static int retire_input_scale(const struct matrix *m, bool ct) {
  char name[64];
  full_name(m, ct ? "input_global_scale" : "input_scale", name, sizeof name);
  struct qkeep_view v = {.size = sizeof v};
  if (m->c->host->view(m->layer, name, &v) != 0)
    return 0; /* optional: a weight-only checkpoint has none */
  return m->c->host->retire(m->layer, name);
}

/* The bias of expert-stacked rows, when live. */
static void find_bias(const struct matrix *m, const void **bias, enum qkeep_dtype *dtype) {
  char name[64];
  struct qkeep_view v = {.size = sizeof v};
  *bias = NULL;
  if (m->c->host->view(m->layer, full_name(m, "bias", name, sizeof name), &v) == 0 &&
      v.state == QKEEP_PARAM_LIVE)
    *bias = v.data, *dtype = v.spec.dtype;
}

static int pwal_matrix(const struct matrix *m, bool ct, struct nvfp4_weights *out) {
  *out = (struct nvfp4_weights){.n = m->rows, .k = m->k, .experts = m->experts ? m->experts : 1};
  if (m->k % NVFP4_BLOCK || m->rows < 1)
    return m->c->host->set_error(QKEEP_E_FORMAT, "cuda-nvfp4: %s%s: K = %lld is not a multiple of 16",
                                 m->layer_name, m->prefix, (long long)m->k);
  int rc = transform(m, "weight", TILE_WEIGHTS, &out->w);
  if (!rc)
    rc = transform(m, "weight_scale", SWIZZLE_SCALES, &out->sf);
  if (!rc)
    rc = make_alpha(m, ct, &out->alpha);
  if (!rc)
    rc = retire_input_scale(m, ct);
  if (!rc)
    find_bias(m, &out->bias, &out->bias_dtype);
  return rc;
}

static int pwal_dense(const struct cuda_backend *c, qkeep_layer *layer, const struct qkeep_layer_info *info,
                      struct layer_state *st) {
  struct qkeep_view w = {.size = sizeof w}, b = {.size = sizeof b};
  int rc = c->host->get_live(layer, "weight", &w);
  if (rc)
    return rc;
  if (w.spec.ndim != 2 || w.spec.shape[0] != info->n || w.spec.shape[1] != info->k)
    return c->host->set_error(QKEEP_E_FORMAT, "cuda-nvfp4: %s.weight: expected [%lld, %lld]", info->name,
                              (long long)info->n, (long long)info->k);
  st->dense = true;
  st->w = w.data, st->w_dtype = w.spec.dtype, st->n = info->n, st->k = info->k, st->bias = NULL;
  if (c->host->view(layer, "bias", &b) == 0 && b.state == QKEEP_PARAM_LIVE)
    st->bias = b.data, st->bias_dtype = b.spec.dtype;
  return 0;
}

/* The MXFP4 layout transform on the GPU (mxfp4_pwal.c's tile_gpu). */
static int mxfp4_tile(void *ctx, bool scales, const void *src, void *dst, int64_t experts, int64_t rows,
                      int64_t k) {
  int err = mxfp4_tile_gpu_run(scales, src, dst, experts, rows, k, NULL);
  return err ? cuda_error(ctx, (cudaError_t)err, scales ? "tiling MXFP4 scales" : "tiling MXFP4 codes") : 0;
}

static int pwal_mxfp4(struct cuda_backend *c, qkeep_layer *layer, const struct qkeep_layer_info *info,
                      struct layer_state *st) {
  const struct mxfp4_device dev = {c->host, &c->be, "cuda-nvfp4", 32, c->pwal_on_host, mxfp4_tile, c};
  st->dense = false, st->mxfp4 = true;
  return mxfp4_pwal(&dev, layer, info, &st->mx);
}

static int cuda_pwal(const struct qkeep_backend *be, qkeep_layer *layer) {
  struct cuda_backend *c = backend_of(be);
  const struct qkeep_host *host = c->host;
  struct qkeep_layer_info info = {.size = sizeof info};
  int rc = host->layer_info(layer, &info);
  if (rc || (info.kind != QKEEP_LAYER_LINEAR && info.kind != QKEEP_LAYER_MOE))
    return rc;
  if ((rc = use_device(c)))
    return rc;
  struct layer_state *st = host->get_state(layer);
  if (!st) {
    if (!(st = calloc(1, sizeof *st)))
      return host->set_error(QKEEP_E_NOMEM, "cuda-nvfp4: out of host memory");
    host->set_state(layer, st);
  }
  if (strcmp(info.scheme, "mxfp4") == 0)
    return pwal_mxfp4(c, layer, &info, st);
  if (!is_nvfp4(info.scheme))
    return pwal_dense(c, layer, &info, st);
  bool ct = info.scheme[0] == 'c';
  st->dense = st->mxfp4 = false;
  st->moe = info.kind == QKEEP_LAYER_MOE;
  if (info.kind == QKEEP_LAYER_MOE) {
    struct matrix w13 = {c, layer, info.name, "w13_", info.n, info.k, info.experts};
    struct matrix w2 = {c, layer, info.name, "w2_", info.k, info.n / 2, info.experts};
    rc = pwal_matrix(&w13, ct, &st->nvfp4[QKEEP_MOE_W13]);
    if (!rc)
      rc = pwal_matrix(&w2, ct, &st->nvfp4[QKEEP_MOE_W2]);
  } else {
    struct matrix linear = {c, layer, info.name, "", info.n, info.k, 0};
    rc = pwal_matrix(&linear, ct, &st->nvfp4[0]);
  }
  /* No wait for the device here: the layer's kernels run on the legacy stream behind its copies and
   * before the next layer's, whose reads go on meanwhile; the load waits once at its end (a fault in
   * a kernel shows there). */
  return rc;
}

/* ---- apply ------------------------------------------------------------------------------------ */

/* The arguments' routed-MoE fields, stream and workspace count only when the caller's struct has them. */
static bool has_routing(const struct qkeep_apply_args *a) {
  return a->size >= offsetof(struct qkeep_apply_args, stream) + sizeof a->stream;
}

static bool has_workspace(const struct qkeep_apply_args *a) {
  return a->size >= offsetof(struct qkeep_apply_args, workspace_bytes) + sizeof a->workspace_bytes;
}

/* The matrix of an MoE apply, or QKEEP_E_INVAL. */
static int moe_matrix(const struct cuda_backend *c, const struct qkeep_apply_args *a) {
  if ((unsigned)a->matrix > QKEEP_MOE_W2)
    return c->host->set_error(QKEEP_E_INVAL, "cuda-nvfp4: MoE matrix %d", (int)a->matrix);
  return (int)a->matrix;
}

/* MXFP4 on the wgmma kernel: from MXFP4_WGMMA_AUTO_M tokens with `kernel = auto`, from 32 with `kernel =
 * wgmma`, where it applies (compute capability 9.0, bf16 or f32 activations, no forced K split). */
static bool mx_on_wgmma(const struct cuda_backend *c, const struct qkeep_apply_args *a) {
  bool chosen = c->tuning.kernel == NVFP4_KERNEL_WGMMA ||
                (c->tuning.kernel == NVFP4_KERNEL_AUTO && a->m >= MXFP4_WGMMA_AUTO_M);
  return chosen && mxfp4_wgmma_applies(a->m, a->x_dtype, c->tuning.split_k);
}

/* Routed MXFP4 on the wgmma kernel: with `kernel = wgmma` only (not measured against the mma.sync kernel
 * yet; bf16 or f32 activations, compute capability 9.0). */
static bool mx_routed_on_wgmma(const struct cuda_backend *c, const struct qkeep_apply_args *a) {
  return c->tuning.kernel == NVFP4_KERNEL_WGMMA && mxfp4_wgmma_moe_applies(a->m, a->topk, a->x_dtype);
}

static size_t mx_workspace(const struct cuda_backend *c, const struct mxfp4_weights *wt,
                           const struct qkeep_apply_args *a) {
  return mx_on_wgmma(c, a) ? mxfp4_wgmma_workspace(wt, a->m)
                           : mxfp4_gemm_workspace(wt, a->m, a->x_dtype, c->tuning.split_k, 0);
}

/* The plain GEMM of expert `expert` of an MXFP4 matrix (0 for a linear layer). */
static int mx_gemm(const struct cuda_backend *c, const struct mxfp4_weights *wt, int32_t expert,
                   const struct qkeep_apply_args *a, struct gpu_scratch *ws, void *stream) {
  if (mx_on_wgmma(c, a))
    return mxfp4_wgmma_run(wt, expert, a->m, a->x, a->x_dtype, a->y, a->y_dtype, ws, stream);
  return mxfp4_gemm_run(wt, expert, a->m, a->x, a->x_dtype, a->y, a->y_dtype, c->tuning.split_k, ws, stream);
}

/* The workspace one apply takes (the same arithmetic as the launchers' plans). */
static int cuda_workspace(const struct qkeep_backend *be, qkeep_layer *layer,
                          const struct qkeep_apply_args *a, size_t *bytes) {
  struct cuda_backend *c = backend_of(be);
  const struct layer_state *st = c->host->get_state(layer);
  *bytes = 0;
  if (!st)
    return c->host->set_error(QKEEP_E_STATE, "cuda-nvfp4: workspace query before the layer's PWAL");
  int rc = use_device(c);
  if (rc || st->dense || a->m <= 0)
    return rc;
  bool routed = has_routing(a) && a->topk > 0;
  if (st->mxfp4) {
    if (!st->mx.moe) {
      *bytes = mx_workspace(c, &st->mx.w[0], a);
      return 0;
    }
    int mat = moe_matrix(c, a);
    if (mat < 0)
      return mat;
    const struct mxfp4_weights *wt = &st->mx.w[mat];
    *bytes = !routed ? mx_workspace(c, wt, a)
             : mx_routed_on_wgmma(c, a)
                 ? mxfp4_wgmma_moe_workspace(wt, a->m, a->topk, mat == QKEEP_MOE_W2)
                 : mxfp4_moe_workspace(wt, a->m, a->topk, mat == QKEEP_MOE_W2, a->x_dtype);
    return 0;
  }
  if (!st->moe) {
    *bytes = nvfp4_gemm_workspace(&st->nvfp4[0], a->m, a->x_dtype, &c->tuning);
    return 0;
  }
  int mat = moe_matrix(c, a);
  if (mat < 0)
    return mat;
  const struct nvfp4_weights *wt = &st->nvfp4[mat];
  *bytes = routed ? nvfp4_moe_workspace(wt, a->m, a->topk, mat == QKEEP_MOE_W2, a->x_dtype, &c->tuning)
                  : nvfp4_gemm_workspace(wt, a->m, a->x_dtype, &c->tuning);
  return 0;
}

/* An mxfp4 layer's apply: the linear matrix, one expert, or routed MoE. */
static int apply_mxfp4(const struct cuda_backend *c, const struct layer_state *st,
                       const struct qkeep_apply_args *args, bool routed, struct gpu_scratch *ws,
                       void *stream) {
  if (!st->mx.moe)
    return mx_gemm(c, &st->mx.w[0], 0, args, ws, stream);
  int mat = moe_matrix(c, args);
  if (mat < 0)
    return mat;
  const struct mxfp4_weights *wt = &st->mx.w[mat];
  if (routed && mx_routed_on_wgmma(c, args))
    return mxfp4_wgmma_moe_run(wt, args->m, args->topk, args->topk_ids, args->topk_weights,
                               mat == QKEEP_MOE_W2, args->x, args->x_dtype, args->y, args->y_dtype, ws,
                               stream);
  if (routed)
    return mxfp4_moe_run(wt, args->m, args->topk, args->topk_ids, args->topk_weights, mat == QKEEP_MOE_W2,
                         args->x, args->x_dtype, args->y, args->y_dtype, ws, stream);
  if (args->expert < 0 || args->expert >= wt->experts)
    return c->host->set_error(QKEEP_E_INVAL, "cuda-nvfp4: expert %d of %lld", (int)args->expert,
                              (long long)wt->experts);
  return mx_gemm(c, wt, args->expert, args, ws, stream);
}

/* An NVFP4 layer's apply: the linear matrix, one expert, or routed MoE. */
static int apply_nvfp4(const struct cuda_backend *c, const struct layer_state *st,
                       const struct qkeep_apply_args *args, bool routed, struct gpu_scratch *ws,
                       void *stream) {
  if (!st->moe)
    return nvfp4_gemm_run(&st->nvfp4[0], 0, args->m, args->x, args->x_dtype, args->y, args->y_dtype,
                          &c->tuning, ws, stream);
  int mat = moe_matrix(c, args);
  if (mat < 0)
    return mat;
  const struct nvfp4_weights *wt = &st->nvfp4[mat];
  if (routed)
    return nvfp4_moe_run(wt, args->m, args->topk, args->topk_ids, args->topk_weights, mat == QKEEP_MOE_W2,
                         args->x, args->x_dtype, args->y, args->y_dtype, &c->tuning, ws, stream);
  if (args->expert < 0 || args->expert >= wt->experts)
    return c->host->set_error(QKEEP_E_INVAL, "cuda-nvfp4: expert %d of %lld", (int)args->expert,
                              (long long)wt->experts);
  return nvfp4_gemm_run(wt, args->expert, args->m, args->x, args->x_dtype, args->y, args->y_dtype, &c->tuning,
                        ws, stream);
}

/*
 * Graph-safe: kernels read the params, the PWAL buffers (alpha, swizzled scales, tiled codes:
 * rewritten in place by every PWAL) and the caller's workspace; nothing is allocated, copied to
 * the host or waited for. Without a workspace (a core older than ABI 1.4, or a caller that
 * passes none) the launchers allocate their scratch stream-ordered, as before: not graph-safe.
 */
static int cuda_apply(const struct qkeep_backend *be, qkeep_layer *layer,
                      const struct qkeep_apply_args *args) {
  struct cuda_backend *c = backend_of(be);
  const struct qkeep_host *host = c->host;
  const struct layer_state *st = host->get_state(layer);
  if (!st)
    return host->set_error(QKEEP_E_STATE, "cuda-nvfp4: apply before the layer's PWAL");
  int rc = use_device(c);
  if (rc)
    return rc;
  bool routed = has_routing(args) && args->topk > 0;
  void *stream = has_routing(args) ? args->stream : NULL;
  struct gpu_scratch scratch = {0}, *ws = NULL;
  if (has_workspace(args) && args->workspace) {
    scratch = (struct gpu_scratch){(char *)args->workspace, args->workspace_bytes, 0};
    ws = &scratch;
  }
  int err;
  if (st->dense)
    err = dense_gemm_run(st->w, st->w_dtype, st->bias, st->bias_dtype, st->n, st->k, args->m, args->x,
                         args->x_dtype, args->y, args->y_dtype, stream);
  else
    err = st->mxfp4 ? apply_mxfp4(c, st, args, routed, ws, stream)
                    : apply_nvfp4(c, st, args, routed, ws, stream);
  if (err < 0)
    return err; /* a QKEEP_E_* code, detail set */
  if (err == cudaErrorInvalidValue)
    return host->set_error(
        QKEEP_E_INVAL,
        "cuda-nvfp4: apply: unsupported arguments (x and y must be F32, F16 or BF16 and x "
        "16-byte aligned; routed MoE needs topk_ids, W2 also topk_weights, at most 2048 experts)");
  if (err == cudaErrorMemoryAllocation && ws)
    return host->set_error(QKEEP_E_INVAL,
                           "cuda-nvfp4: apply: the workspace (%zu bytes) is smaller than the "
                           "workspace slot asks for these arguments",
                           scratch.bytes);
  return err ? cuda_error(c, (cudaError_t)err, "apply") : 0;
}

/* ---- online quantization (ABI 1.5) ---------------------------------------------------------------- */

/* The unit's scheme as the kernels know it; false for one they do not run. */
static bool quant_scheme(const char *name, enum fp4_quant_scheme *out) {
  static const struct {
    const char *name;
    enum fp4_quant_scheme scheme;
  } known[] = {{"modelopt-nvfp4", FP4_QUANT_MODELOPT_NVFP4},
               {"ct-nvfp4", FP4_QUANT_CT_NVFP4},
               {"mxfp4", FP4_QUANT_MXFP4}};
  for (size_t i = 0; name && i < sizeof known / sizeof known[0]; i++)
    if (strcmp(name, known[i].name) == 0) {
      *out = known[i].scheme;
      return true;
    }
  return false;
}

/* Member i of the unit (members are member_size bytes apart; the fields read are ABI 1.5's). */
static const struct qkeep_quant_member *quant_member(const struct qkeep_quant_unit *u, int i) {
  return (const struct qkeep_quant_member *)(const void *)((const char *)u->members +
                                                           (size_t)i * u->member_size);
}

/* Scans every member (one wait for all): the unit's amax, and its first NaN or Inf (member, element). */
static int quant_scan(struct cuda_backend *c, const struct fp4_quant_member *m, int n, float *amax,
                      int *bad_member, int64_t *bad_element) {
  struct fp4_quant_scan found[3];
  pthread_mutex_lock(&c->quant_mu);
  cudaError_t err = c->quant_scan ? cudaSuccess : cudaMalloc(&c->quant_scan, sizeof found);
  if (err == cudaSuccess) /* max_bits 0 and first_bad all ones: all ones, then each max_bits cleared */
    err = cudaMemsetAsync(c->quant_scan, 0xff, sizeof found, 0);
  for (int i = 0; i < n && err == cudaSuccess; i++)
    err = cudaMemsetAsync((struct fp4_quant_scan *)c->quant_scan + i, 0, sizeof(uint32_t), 0);
  for (int i = 0; i < n && err == cudaSuccess; i++)
    err = (cudaError_t)fp4_quant_scan_gpu(&m[i], (struct fp4_quant_scan *)c->quant_scan + i, NULL);
  if (err == cudaSuccess) /* on the legacy stream: after the staging copies and the scans */
    err = cudaMemcpy(found, c->quant_scan, sizeof found, cudaMemcpyDeviceToHost);
  pthread_mutex_unlock(&c->quant_mu);
  if (err != cudaSuccess)
    return cuda_error(c, err, "scanning the values to quantize");
  *amax = 0.0f, *bad_member = -1, *bad_element = 0;
  for (int i = 0; i < n; i++) {
    float a;
    memcpy(&a, &found[i].max_bits, sizeof a);
    *amax = a > *amax ? a : *amax;
    if (*bad_member < 0 && found[i].first_bad != ~0ull)
      *bad_member = i, *bad_element = (int64_t)found[i].first_bad;
  }
  return 0;
}

/*
 * The quantize slot: NVFP4 (both namings) and MXFP4 units of F32, F16 or BF16 weights, any shape the
 * scheme takes. The scan first (nothing is written before every value is known to be finite), then
 * the kernels, queued on the legacy stream after the core's staging copies and before PWAL.
 */
static int cuda_quantize(const struct qkeep_backend *be, qkeep_layer *layer, struct qkeep_quant_unit *u) {
  struct cuda_backend *c = backend_of(be);
  (void)layer;
  enum fp4_quant_scheme scheme;
  if (!u || u->size < offsetof(struct qkeep_quant_unit, bad_element) + sizeof u->bad_element ||
      u->member_size < offsetof(struct qkeep_quant_member, block_scales) + sizeof(void *))
    return c->host->set_error(QKEEP_E_INVAL, "cuda-nvfp4: quantize: a unit of an unknown layout");
  if (!c->quantize_on_device || !quant_scheme(u->scheme, &scheme) || u->n_members < 1 || u->n_members > 3)
    return 1; /* off (key quantize_on_device = false): every unit declined, the host's */
  int64_t block = scheme == FP4_QUANT_MXFP4 ? 32 : 16;
  struct fp4_quant_member m[3];
  int staged = 0;
  for (int i = 0; i < u->n_members; i++) {
    const struct qkeep_quant_member *q = quant_member(u, i);
    if ((q->dtype != QKEEP_DTYPE_F32 && q->dtype != QKEEP_DTYPE_F16 && q->dtype != QKEEP_DTYPE_BF16) ||
        q->n < 0 || q->k < 0 || q->k % block || (q->n && q->k > INT64_MAX / q->n))
      return 1;
    m[i] = (struct fp4_quant_member){q->src, q->dtype, q->n, q->k, q->codes, q->block_scales};
    staged += q->src != NULL;
  }
  if (!staged)
    return 0; /* a query: every unit of these schemes and dtypes is taken */
  if (staged < u->n_members)
    return c->host->set_error(QKEEP_E_INVAL, "cuda-nvfp4: quantize '%s': a member without values",
                              quant_member(u, 0)->name);
  int rc = use_device(c);
  if (!rc)
    rc = quant_scan(c, m, u->n_members, &u->amax, &u->bad_member, &u->bad_element);
  if (rc)
    return rc;
  if (u->bad_member >= 0) {
    const struct qkeep_quant_member *q = quant_member(u, u->bad_member);
    return c->host->set_error(
        QKEEP_E_INVAL, "cuda-nvfp4: '%s': element %lld (row %lld, column %lld) is NaN or infinite", q->name,
        (long long)u->bad_element, (long long)(u->bad_element / q->k), (long long)(u->bad_element % q->k));
  }
  /* The host's refusal of a global scale that would be subnormal (2688 * FLT_MIN). */
  if (scheme != FP4_QUANT_MXFP4 && u->amax != 0.0f && u->amax < 2688.0f * FLT_MIN)
    return c->host->set_error(QKEEP_E_INVAL, "cuda-nvfp4: '%s': amax %g is below 2688 * FLT_MIN",
                              quant_member(u, 0)->name, (double)u->amax);
  for (int i = 0; i < u->n_members; i++) {
    cudaError_t err = (cudaError_t)fp4_quant_gpu(&m[i], scheme, u->amax, NULL);
    if (err != cudaSuccess)
      return cuda_error(c, err, "quantizing");
  }
  return 0;
}

static int cuda_device(const struct qkeep_backend *be, enum qkeep_device_type *type, int *index) {
  *type = QKEEP_DEVICE_CUDA, *index = backend_of(be)->device;
  return 0;
}

static void cuda_layer_cleanup(const struct qkeep_backend *be, qkeep_layer *layer, void *state) {
  (void)be;
  (void)layer;
  free(state);
}

static void cuda_fini(const struct qkeep_backend *be) {
  struct cuda_backend *c = backend_of(be);
  for (int i = 0; i < FENCE_EVENTS; i++)
    if (c->fence_event[i])
      (void)cudaEventDestroy(c->fence_event[i]);
  pthread_mutex_destroy(&c->fence_mu);
  bool tables = false;
  for (int i = 0; i < COPY_TABLES; i++)
    tables |= c->tables[i].pending || c->tables[i].cap;
  if (tables)
    (void)cudaDeviceSynchronize(); /* a batched copy may still read its table */
  for (int i = 0; i < COPY_TABLES; i++) {
    if (c->tables[i].cap) {
      (void)cudaFreeHost(c->tables[i].host);
      (void)cudaFree(c->tables[i].dev);
    }
    if (c->tables[i].uploaded)
      (void)cudaEventDestroy(c->tables[i].uploaded);
  }
  if (c->check_first)
    (void)cudaFree(c->check_first);
  pthread_mutex_destroy(&c->copy_mu);
  if (c->quant_scan)
    (void)cudaFree(c->quant_scan);
  pthread_mutex_destroy(&c->quant_mu);
  free(c);
}

QKEEP_BACKEND_EXPORT int qkeep_backend_init(const struct qkeep_host *host, const struct qkeep_backend **out) {
  if (!host || host->abi_major != QKEEP_BACKEND_ABI_MAJOR)
    return QKEEP_E_ABI;
  struct cuda_backend *c = calloc(1, sizeof *c);
  if (!c)
    return host->set_error(QKEEP_E_NOMEM, "cuda-nvfp4: out of memory");
  c->host = host;
  c->quantize_on_device = true;
  c->pwal_in_place = true;
  c->memory = (struct qkeep_memory_ops){
      .size = sizeof(struct qkeep_memory_ops),
      .alloc = mem_alloc,
      .free = mem_free,
      .copy_h2d = mem_h2d,
      .copy_d2h = mem_d2h,
      .copy_d2d = mem_d2d,
      .fill = mem_fill,
      .sync = mem_sync,
      .host_alloc = mem_host_alloc,
      .host_free = mem_host_free,
      .copy_h2d_async = mem_h2d_async,
      .copy_fence = mem_copy_fence,
      .copy_fence_wait = mem_copy_fence_wait,
      .copy_d2d_batch = mem_copy_batch,
      .find_bad_values = mem_find_bad_values,
  };
  pthread_mutex_init(&c->fence_mu, NULL);
  pthread_mutex_init(&c->copy_mu, NULL);
  pthread_mutex_init(&c->quant_mu, NULL);
  c->be = (struct qkeep_backend){
      .size = sizeof(struct qkeep_backend),
      .abi_major = QKEEP_BACKEND_ABI_MAJOR,
      .abi_minor = 0,
      .name = "cuda-nvfp4",
      .description =
          "NVFP4 (ModelOpt, compressed-tensors) linear and MoE on NVIDIA GPUs (sm_90+): weight-only FP4 "
          "GEMM with block scales in the 128x4 swizzle",
      .probe = cuda_probe,
      .configure = cuda_configure,
      .memory = &c->memory,
      .supports = cuda_supports,
      .pwal = cuda_pwal,
      .apply = cuda_apply,
      .layer_cleanup = cuda_layer_cleanup,
      .fini = cuda_fini,
      .supports_layer = cuda_supports_layer,
      .keys = cuda_keys,
      .n_keys = sizeof cuda_keys / sizeof cuda_keys[0],
      .key_size = sizeof cuda_keys[0],
      .workspace = cuda_workspace,
      .device = cuda_device,
      .flags = QKEEP_BACKEND_F_GRAPH_SAFE | QKEEP_BACKEND_F_ROUTED_MOE,
      .quantize = cuda_quantize, /* ABI 1.5: an older core never calls it */
  };
  *out = &c->be;
  return 0;
}
