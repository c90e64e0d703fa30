/*
 * backend.c: the `rocm-mxfp4` backend. MXFP4 (`mxfp4`: gpt-oss `*_blocks` /
 * `*_scales` / `*_bias` and compressed-tensors mxfp4-pack-quantized) linear and MoE
 * layers on AMD gfx942 (MI300), which has no FP4 hardware: the shared kernels of
 * plugins/gpu (decode e2m1 in vector code, bf16/f16 MFMA, the e8m0 scale applied to
 * each scale block's f32 accumulators), built for gfx942 by clang-19 (mxfp4.hip).
 *
 * Params live in device memory (hipMalloc). PWAL (plugins/gpu/mxfp4_pwal.c) repacks
 * codes and scales into the wave-64 layout inside their own storage; nothing is
 * retired or released, so a reload is in place. The HIP runtime is dlopened at run
 * time (hip.c): no AMD GPU, no runtime or a device other than gfx942 all load the
 * plugin and make its probe say why. Other layers go to the next backend of the chain.
 *
 * No AMD GPU was available where this was written: the plugin, its code object and
 * its host paths are built and tested in CI; its device paths never ran (README).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mxfp4.h"
#include "qkeep/qkeep_backend_util.h"
#include "rocm.h"

/* Events behind the copy fences, reused round robin (a reused one stands for a later fence). */
#define FENCE_EVENTS 64

struct rocm_backend {
  struct qkeep_backend be; /* first, so the core's pointer is ours */
  const struct qkeep_host *host;
  struct qkeep_memory_ops memory;
  int device;
  int split_k;       /* 0: automatic */
  bool pwal_on_host; /* the layout transforms through mxfp4_layout.c */
  struct rocm_kernels kernels;
  /* Copy fences (ABI 1.3): fence f is an event recorded in fence_event[f % FENCE_EVENTS]. */
  pthread_mutex_t fence_mu;
  uint64_t fences; /* tokens handed out */
  hipEvent_t fence_event[FENCE_EVENTS];
};

static struct rocm_backend *backend_of(const struct qkeep_backend *be) { return (struct rocm_backend *)be; }

static int hip_error(const struct rocm_backend *r, hipError_t err, const char *what) {
  const char *why;
  const struct hip_api *hip = rocm_hip(&why); /* loaded: an error came from it */
  (void)hip->GetLastError();                  /* clear it, so that the next call starts clean */
  return r->host->set_error(err == hipErrorOutOfMemory ? QKEEP_E_NOMEM : QKEEP_E_DEVICE,
                            "rocm-mxfp4: %s: %s (%s)", what, hip->GetErrorString(err),
                            hip->GetErrorName(err));
}

/* The runtime, the configured device current on this thread, its kernels loaded. */
static int use_device(struct rocm_backend *r, const struct hip_api **out) {
  const char *why;
  const struct hip_api *hip = rocm_hip(&why);
  if (!hip)
    return r->host->set_error(QKEEP_E_NODEV, "rocm-mxfp4: %s", why);
  int current = -1;
  hipError_t err = hip->GetDevice(&current);
  if (err == hipSuccess && current != r->device)
    err = hip->SetDevice(r->device);
  if (err != hipSuccess)
    return hip_error(r, err, "selecting the device");
  const char *what = "";
  if ((err = rocm_kernels_load(&r->kernels, &what)) != hipSuccess)
    return hip_error(r, err, what);
  rocm_set_current_kernels(&r->kernels);
  *out = hip;
  return 0;
}

/* ---- memory ops ------------------------------------------------------------------------------- */

/* Device memory, or page-locked host memory (copies from it run asynchronously on the DMA engines);
 * every allocation gets its own address, a zero-byte one too. */
static int allocate(const struct qkeep_backend *be, size_t bytes, bool pinned_host, void **out) {
  struct rocm_backend *r = backend_of(be);
  const struct hip_api *hip;
  int rc = use_device(r, &hip);
  if (rc)
    return rc;
  hipError_t err =
      pinned_host ? hip->HostMalloc(out, bytes ? bytes : 1, 0) : hip->Malloc(out, bytes ? bytes : 1);
  if (err != hipSuccess) {
    *out = NULL;
    return hip_error(r, err, pinned_host ? "hipHostMalloc" : "hipMalloc");
  }
  return 0;
}

static int mem_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  return allocate(be, bytes, false, out);
}

static void mem_free(const struct qkeep_backend *be, void *ptr) {
  const struct hip_api *hip;
  if (ptr && use_device(backend_of(be), &hip) == 0)
    (void)hip->Free(ptr);
}

static int copy(const struct qkeep_backend *be, void *dst, const void *src, size_t n, hipMemcpyKind kind) {
  struct rocm_backend *r = backend_of(be);
  const struct hip_api *hip;
  int rc = use_device(r, &hip);
  if (rc || !n)
    return rc;
  hipError_t err = hip->Memcpy(dst, src, n, kind);
  return err == hipSuccess ? 0 : hip_error(r, err, "hipMemcpy");
}

static int mem_h2d(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  return copy(be, dst, src, n, hipMemcpyHostToDevice);
}

static int mem_d2h(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  return copy(be, dst, src, n, hipMemcpyDeviceToHost);
}

/* memmove semantics: overlapping ranges go through a temporary. */
static int mem_d2d(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  const char *d = dst, *s = src;
  if (!n || d == s)
    return 0;
  if (!(d < s + n && s < d + n))
    return copy(be, dst, src, n, hipMemcpyDeviceToDevice);
  void *tmp;
  int rc = mem_alloc(be, n, &tmp);
  if (!rc)
    rc = copy(be, tmp, src, n, hipMemcpyDeviceToDevice);
  if (!rc)
    rc = copy(be, dst, tmp, n, hipMemcpyDeviceToDevice);
  mem_free(be, tmp);
  return rc;
}

static int mem_fill(const struct qkeep_backend *be, void *dst, int byte, size_t n) {
  struct rocm_backend *r = backend_of(be);
  const struct hip_api *hip;
  int rc = use_device(r, &hip);
  if (rc || !n)
    return rc;
  hipError_t err = hip->Memset(dst, byte, n);
  return err == hipSuccess ? 0 : hip_error(r, err, "hipMemset");
}

static int mem_sync(const struct qkeep_backend *be) {
  struct rocm_backend *r = backend_of(be);
  const struct hip_api *hip;
  int rc = use_device(r, &hip);
  if (rc)
    return rc;
  hipError_t err = hip->DeviceSynchronize();
  return err == hipSuccess ? 0 : hip_error(r, err, "hipDeviceSynchronize");
}

static int mem_host_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  return allocate(be, bytes, true, out);
}

static void mem_host_free(const struct qkeep_backend *be, void *ptr) {
  (void)be;
  const char *why;
  const struct hip_api *hip = rocm_hip(&why);
  if (ptr && hip)
    (void)hip->HostFree(ptr);
}

/* On the null stream, which every other copy, fill and kernel launch of the backend uses. */
static int mem_h2d_async(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  struct rocm_backend *r = backend_of(be);
  const struct hip_api *hip;
  int rc = use_device(r, &hip);
  if (rc || !n)
    return rc;
  hipError_t err = hip->MemcpyAsync(dst, src, n, hipMemcpyHostToDevice, 0);
  return err == hipSuccess ? 0 : hip_error(r, err, "hipMemcpyAsync");
}

/* A fence after every copy started so far on the null stream: an event recorded there. */
static int mem_copy_fence(const struct qkeep_backend *be, uint64_t *fence) {
  struct rocm_backend *r = backend_of(be);
  const struct hip_api *hip;
  int rc = use_device(r, &hip);
  if (rc)
    return rc;
  pthread_mutex_lock(&r->fence_mu);
  uint64_t f = r->fences;
  hipEvent_t *ev = &r->fence_event[f % FENCE_EVENTS];
  hipError_t err = *ev ? hipSuccess : hip->EventCreateWithFlags(ev, hipEventDisableTiming);
  if (err == hipSuccess)
    err = hip->EventRecord(*ev, 0);
  if (err == hipSuccess)
    r->fences++;
  pthread_mutex_unlock(&r->fence_mu);
  if (err != hipSuccess)
    return hip_error(r, err, "recording a copy fence");
  *fence = f;
  return 0;
}

/* Waits for (or asks about) the fence's event; if a later fence reused it, that one's point. */
static int mem_copy_fence_wait(const struct qkeep_backend *be, uint64_t fence, int block) {
  struct rocm_backend *r = backend_of(be);
  const struct hip_api *hip;
  int rc = use_device(r, &hip);
  if (rc)
    return rc;
  pthread_mutex_lock(&r->fence_mu);
  bool known = fence < r->fences;
  hipEvent_t ev = r->fence_event[fence % FENCE_EVENTS];
  pthread_mutex_unlock(&r->fence_mu);
  if (!known)
    return r->host->set_error(QKEEP_E_INVAL, "rocm-mxfp4: copy fence %llu was never recorded",
                              (unsigned long long)fence);
  hipError_t err = block ? hip->EventSynchronize(ev) : hip->EventQuery(ev);
  if (err == hipErrorNotReady)
    return 1;
  return err == hipSuccess ? 0 : hip_error(r, err, "waiting for a copy fence");
}

/* ---- probe, configure, supports ----------------------------------------------------------------- */

/* Usable when the runtime loads, the device exists and the gfx942 code object loads on it (a
 * device of another architecture refuses it). */
static int rocm_probe(const struct qkeep_backend *be, char *msg, size_t msg_len) {
  struct rocm_backend *r = backend_of(be);
  char dummy[1];
  if (!msg_len)
    msg = dummy, msg_len = sizeof dummy;
  const char *why;
  const struct hip_api *hip = rocm_hip(&why);
  if (!hip) {
    snprintf(msg, msg_len, "no device: %s", why);
    return QKEEP_E_NODEV;
  }
  int count = 0;
  hipError_t err = hip->GetDeviceCount(&count);
  if (err != hipSuccess || count == 0) {
    snprintf(msg, msg_len, "no device: no AMD GPU (%s)",
             err != hipSuccess ? hip->GetErrorName(err) : "0 devices");
    (void)hip->GetLastError();
    return QKEEP_E_NODEV;
  }
  if (r->device >= count) {
    snprintf(msg, msg_len, "no device: HIP device %d requested, %d present", r->device, count);
    return QKEEP_E_NODEV;
  }
  const char *what = "hipSetDevice";
  err = hip->SetDevice(r->device);
  if (err == hipSuccess)
    err = rocm_kernels_load(&r->kernels, &what);
  if (err != hipSuccess) {
    snprintf(msg, msg_len, "no device: HIP device %d cannot run the gfx942 code object: %s: %s", r->device,
             what, hip->GetErrorName(err));
    (void)hip->GetLastError();
    return QKEEP_E_NODEV;
  }
  snprintf(msg, msg_len, "HIP device %d: gfx942 code object loaded, %d compute units", r->device,
           r->kernels.compute_units);
  return 0;
}

static const struct qkeep_backend_key rocm_keys[] = {
    {"device", QKEEP_KEY_INT, "0..1023", "0", "HIP device index"},
    {"split_k", QKEEP_KEY_ENUM, "auto|1|2|3|4|5|6|7|8", "auto", "K split of the MXFP4 GEMM"},
    {"pwal", QKEEP_KEY_ENUM, "gpu|host", "gpu", "where the layout transforms run (host: their CPU twins)"},
};

static int rocm_configure(const struct qkeep_backend *be, const char *key, const char *value) {
  struct rocm_backend *r = backend_of(be);
  char *end;
  long v = strtol(value, &end, 10);
  bool number = end != value && !*end;
  if (strcmp(key, "device") == 0) {
    if (!number || v < 0 || v > 1023)
      return r->host->set_error(QKEEP_E_CONFIG, "device = '%s': expected a HIP device index", value);
    r->device = (int)v;
    r->kernels.module = NULL; /* loaded again on the new device */
  } else if (strcmp(key, "split_k") == 0) {
    if (strcmp(value, "auto") != 0 && (!number || v < 1 || v > MXFP4_MAX_SPLIT))
      return r->host->set_error(QKEEP_E_CONFIG, "split_k = '%s': expected auto or 1 to 8", value);
    r->split_k = number ? (int)v : 0;
  } else if (strcmp(key, "pwal") == 0) {
    if (strcmp(value, "gpu") != 0 && strcmp(value, "host") != 0)
      return r->host->set_error(QKEEP_E_CONFIG, "pwal = '%s': expected gpu or host", value);
    r->pwal_on_host = value[0] == 'h';
  } else {
    return r->host->set_error(QKEEP_E_CONFIG, "unknown key '%s' (rocm-mxfp4 takes device, split_k, pwal)",
                              key);
  }
  return 0;
}

static int rocm_supports(const struct qkeep_backend *be, const char *scheme, enum qkeep_layer_kind kind) {
  (void)be;
  return strcmp(scheme, "mxfp4") == 0 && (kind == QKEEP_LAYER_LINEAR || kind == QKEEP_LAYER_MOE);
}

static int rocm_supports_layer(const struct qkeep_backend *be, const struct qkeep_layer_info *info,
                               char *reason, size_t reason_len) {
  if (rocm_supports(be, info->scheme, info->kind))
    return 1;
  snprintf(reason, reason_len, "runs MXFP4 linear and MoE layers only, not %s (%s)", info->name,
           info->scheme);
  return 0;
}

/* ---- PWAL and apply ---------------------------------------------------------------------------- */

static int tile_on_gpu(void *ctx, bool scales, const void *src, void *dst, int64_t experts, int64_t rows,
                       int64_t k) {
  int err = mxfp4_tile_gpu_run(scales, src, dst, experts, rows, k, NULL);
  return err ? hip_error(ctx, (hipError_t)err, scales ? "tiling MXFP4 scales" : "tiling MXFP4 codes") : 0;
}

static int rocm_pwal(const struct qkeep_backend *be, qkeep_layer *layer) {
  struct rocm_backend *r = backend_of(be);
  const struct qkeep_host *host = r->host;
  struct qkeep_layer_info info = {.size = sizeof info};
  int rc = host->layer_info(layer, &info);
  if (rc || !rocm_supports(be, info.scheme, info.kind))
    return rc;
  const struct hip_api *hip;
  if ((rc = use_device(r, &hip)))
    return rc;
  struct mxfp4_layer *st = host->get_state(layer);
  if (!st) {
    if (!(st = calloc(1, sizeof *st)))
      return host->set_error(QKEEP_E_NOMEM, "rocm-mxfp4: out of host memory");
    host->set_state(layer, st);
  }
  const struct mxfp4_device dev = {host, be, "rocm-mxfp4", 64, r->pwal_on_host, tile_on_gpu, r};
  rc = mxfp4_pwal(&dev, layer, &info, st);
  return rc ? rc : mem_sync(be);
}

/* The arguments' routed-MoE fields, stream and workspace count only when the caller's struct has them. */
static bool has_routing(const struct qkeep_apply_args *a) {
  return a->size >= offsetof(struct qkeep_apply_args, stream) + sizeof a->stream;
}

static bool has_workspace(const struct qkeep_apply_args *a) {
  return a->size >= offsetof(struct qkeep_apply_args, workspace_bytes) + sizeof a->workspace_bytes;
}

/* The workspace one apply takes (the launchers' own arithmetic). */
static int rocm_workspace(const struct qkeep_backend *be, qkeep_layer *layer, const struct qkeep_apply_args *a,
                          size_t *bytes) {
  struct rocm_backend *r = backend_of(be);
  const struct mxfp4_layer *st = r->host->get_state(layer);
  *bytes = 0;
  if (!st)
    return r->host->set_error(QKEEP_E_STATE, "rocm-mxfp4: workspace query before the layer's PWAL");
  const struct hip_api *hip;
  int rc = use_device(r, &hip);
  if (rc || a->m <= 0)
    return rc;
  if (!st->moe) {
    *bytes = mxfp4_gemm_workspace(&st->w[0], a->m, a->x_dtype, r->split_k, 0);
    return 0;
  }
  if ((unsigned)a->matrix > QKEEP_MOE_W2)
    return r->host->set_error(QKEEP_E_INVAL, "rocm-mxfp4: MoE matrix %d", (int)a->matrix);
  const struct mxfp4_weights *wt = &st->w[a->matrix];
  *bytes = has_routing(a) && a->topk > 0
               ? mxfp4_moe_workspace(wt, a->m, a->topk, a->matrix == QKEEP_MOE_W2, a->x_dtype)
               : mxfp4_gemm_workspace(wt, a->m, a->x_dtype, r->split_k, 0);
  return 0;
}

/* Takes its scratch from the caller's workspace (a core older than ABI 1.4: stream-ordered
 * allocation). Not declared graph-safe: HIP graph capture is untested without an AMD GPU. */
static int rocm_apply(const struct qkeep_backend *be, qkeep_layer *layer,
                      const struct qkeep_apply_args *args) {
  struct rocm_backend *r = backend_of(be);
  const struct mxfp4_layer *st = r->host->get_state(layer);
  if (!st)
    return r->host->set_error(QKEEP_E_STATE, "rocm-mxfp4: apply before the layer's PWAL");
  const struct hip_api *hip;
  int rc = use_device(r, &hip);
  if (rc)
    return rc;
  const struct qkeep_apply_args *ext = has_routing(args) ? args : NULL;
  void *stream = ext ? ext->stream : NULL;
  struct gpu_scratch scratch = {0}, *ws = NULL;
  if (has_workspace(args)) {
    scratch = (struct gpu_scratch){(char *)args->workspace, args->workspace ? args->workspace_bytes : 0, 0};
    ws = &scratch;
  }
  int err;
  if (!st->moe) {
    err = mxfp4_gemm_run(&st->w[0], 0, args->m, args->x, args->x_dtype, args->y, args->y_dtype, r->split_k,
                         ws, stream);
  } else {
    if ((unsigned)args->matrix > QKEEP_MOE_W2)
      return r->host->set_error(QKEEP_E_INVAL, "rocm-mxfp4: MoE matrix %d", (int)args->matrix);
    const struct mxfp4_weights *wt = &st->w[args->matrix];
    if (ext && ext->topk > 0) {
      err = mxfp4_moe_run(wt, args->m, ext->topk, ext->topk_ids, ext->topk_weights, args->matrix == QKEEP_MOE_W2,
                          args->x, args->x_dtype, args->y, args->y_dtype, ws, stream);
    } else {
      if (args->expert < 0 || args->expert >= wt->experts)
        return r->host->set_error(QKEEP_E_INVAL, "rocm-mxfp4: expert %d of %lld", (int)args->expert,
                                  (long long)wt->experts);
      err = mxfp4_gemm_run(wt, args->expert, args->m, args->x, args->x_dtype, args->y, args->y_dtype,
                           r->split_k, ws, stream);
    }
  }
  if (err == hipErrorInvalidValue)
    return r->host->set_error(
        QKEEP_E_INVAL, "rocm-mxfp4: apply: unsupported arguments (x and y must be F32, F16 or BF16 and x "
                       "16-byte aligned; routed MoE needs topk_ids, W2 also topk_weights)");
  if (err == hipErrorOutOfMemory && ws)
    return r->host->set_error(QKEEP_E_INVAL, "rocm-mxfp4: apply: the workspace (%zu bytes) is smaller than "
                                             "the workspace slot asks for these arguments",
                              scratch.bytes);
  return err ? hip_error(r, (hipError_t)err, "apply") : 0;
}

static int rocm_device(const struct qkeep_backend *be, enum qkeep_device_type *type, int *index) {
  *type = QKEEP_DEVICE_ROCM, *index = backend_of(be)->device;
  return 0;
}

static void rocm_layer_cleanup(const struct qkeep_backend *be, qkeep_layer *layer, void *state) {
  (void)be;
  (void)layer;
  free(state);
}

/* The module stays loaded with the runtime (neither survives an unload). */
static void rocm_fini(const struct qkeep_backend *be) {
  struct rocm_backend *r = backend_of(be);
  const char *why;
  const struct hip_api *hip = rocm_hip(&why);
  for (int i = 0; i < FENCE_EVENTS && hip; i++)
    if (r->fence_event[i])
      (void)hip->EventDestroy(r->fence_event[i]);
  pthread_mutex_destroy(&r->fence_mu);
  free(r);
}

QKEEP_BACKEND_EXPORT int qkeep_backend_init(const struct qkeep_host *host, const struct qkeep_backend **out) {
  if (!host || host->abi_major != QKEEP_BACKEND_ABI_MAJOR)
    return QKEEP_E_ABI;
  struct rocm_backend *r = calloc(1, sizeof *r);
  if (!r)
    return host->set_error(QKEEP_E_NOMEM, "rocm-mxfp4: out of memory");
  r->host = host;
  r->memory = (struct qkeep_memory_ops){
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
  };
  pthread_mutex_init(&r->fence_mu, NULL);
  r->be = (struct qkeep_backend){
      .size = sizeof(struct qkeep_backend),
      .abi_major = QKEEP_BACKEND_ABI_MAJOR,
      .abi_minor = 0,
      .name = "rocm-mxfp4",
      .description =
          "MXFP4 (gpt-oss, compressed-tensors) linear and MoE on AMD gfx942 (MI300): e2m1 decoded in "
          "vector code, bf16/f16 MFMA, e8m0 block scales on the accumulators",
      .probe = rocm_probe,
      .configure = rocm_configure,
      .memory = &r->memory,
      .supports = rocm_supports,
      .pwal = rocm_pwal,
      .apply = rocm_apply,
      .layer_cleanup = rocm_layer_cleanup,
      .fini = rocm_fini,
      .supports_layer = rocm_supports_layer,
      .keys = rocm_keys,
      .n_keys = sizeof rocm_keys / sizeof rocm_keys[0],
      .key_size = sizeof rocm_keys[0],
      .workspace = rocm_workspace,
      .device = rocm_device,
      .flags = QKEEP_BACKEND_F_ROUTED_MOE,
  };
  *out = &r->be;
  return 0;
}
