/*
 * mxfp4_host.c: the test plugin `test-mxfp4` (tests/plugins/.libs/backend-test-mxfp4.so):
 * the MXFP4 PWAL that cuda-nvfp4 and rocm-mxfp4 share (plugins/gpu/mxfp4_pwal.c) with its
 * host twins (mxfp4_layout.c), in host memory, for the layout of either wave (key `wave`,
 * 32 or 64), so that CI checks on any machine what the GPU backends' PWAL leaves: the census,
 * the checkpoint names, a byte-identical reload in place. Its apply reads the tiled codes
 * and scales back through the layout's index math (no kernel), so a forward check against
 * the reference proves the repacked bytes hold the checkpoint's values. mxfp4 linear and
 * MoE layers only; every other layer goes on down the chain.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mxfp4.h"
#include "qkeep/qkeep_backend_util.h"

struct host_backend {
  struct qkeep_backend be; /* first, so the core's pointer is ours */
  const struct qkeep_host *host;
  struct qkeep_memory_ops memory;
  int wave;
};

static int mem_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  (void)be;
  *out = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
  return *out ? 0 : QKEEP_E_NOMEM;
}
static void mem_free(const struct qkeep_backend *be, void *p) {
  (void)be;
  free(p);
}
static int mem_copy(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  (void)be;
  if (n)
    memmove(dst, src, n);
  return 0;
}
static int mem_fill(const struct qkeep_backend *be, void *dst, int byte, size_t n) {
  (void)be;
  memset(dst, byte, n);
  return 0;
}
static int mem_sync(const struct qkeep_backend *be) {
  (void)be;
  return 0;
}

static const struct qkeep_backend_key host_keys[] = {
    {"wave", QKEEP_KEY_ENUM, "32|64", "64", "the layout of which build: 32 (CUDA) or 64 (HIP)"}};

static int host_configure(const struct qkeep_backend *be, const char *key, const char *value) {
  struct host_backend *h = (struct host_backend *)be;
  if (strcmp(key, "wave") == 0 && (strcmp(value, "32") == 0 || strcmp(value, "64") == 0)) {
    h->wave = atoi(value);
    return 0;
  }
  return h->host->set_error(QKEEP_E_CONFIG, "test-mxfp4: %s = '%s': expected wave = 32 or 64", key, value);
}

static int host_supports(const struct qkeep_backend *be, const char *scheme, enum qkeep_layer_kind kind) {
  (void)be;
  return strcmp(scheme, "mxfp4") == 0 && (kind == QKEEP_LAYER_LINEAR || kind == QKEEP_LAYER_MOE);
}

static int host_supports_layer(const struct qkeep_backend *be, const struct qkeep_layer_info *info,
                               char *reason, size_t reason_len) {
  if (host_supports(be, info->scheme, info->kind))
    return 1;
  snprintf(reason, reason_len, "mxfp4 linear and MoE layers only");
  return 0;
}

static int host_pwal(const struct qkeep_backend *be, qkeep_layer *layer) {
  struct host_backend *h = (struct host_backend *)be;
  struct qkeep_layer_info info = {.size = sizeof info};
  int rc = h->host->layer_info(layer, &info);
  if (rc || !host_supports(be, info.scheme, info.kind))
    return rc;
  struct mxfp4_layer *st = h->host->get_state(layer);
  if (!st) {
    if (!(st = calloc(1, sizeof *st)))
      return h->host->set_error(QKEEP_E_NOMEM, "test-mxfp4: out of memory");
    h->host->set_state(layer, st);
  }
  const struct mxfp4_device dev = {h->host, be, "test-mxfp4", h->wave, true, NULL, NULL};
  return mxfp4_pwal(&dev, layer, &info, st);
}

static float bias_at(const struct mxfp4_weights *w, int64_t e, int64_t r) {
  if (!w->bias)
    return 0.0f;
  int64_t i = e * w->n + r;
  switch (w->bias_dtype) {
  case QKEEP_DTYPE_F32: return ((const float *)w->bias)[i];
  case QKEEP_DTYPE_BF16: return qkeep_bf16_to_f32(((const uint16_t *)w->bias)[i]);
  default: return qkeep_f16_to_f32(((const uint16_t *)w->bias)[i]);
  }
}

/* y [m, n] = x [m, k] W_e^T + bias, W read back from the tiles (f32 x and y only). */
static void gemm(const struct mxfp4_weights *w, int wave, int64_t e, int64_t m, const float *x, float *y) {
  static const float e2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  const uint8_t *codes = (const uint8_t *)w->codes + e * mxfp4_code_bytes(w->n, w->k);
  const uint8_t *scales = (const uint8_t *)w->scales + e * mxfp4_scale_bytes(w->n, w->k);
  int64_t chunks = mxfp4_chunks(w->k);
  float *row = malloc(sizeof(float) * (size_t)w->k);
  for (int64_t r = 0; row && r < w->n; r++) {
    for (int64_t k = 0; k < w->k; k++) {
      int slot;
      uint32_t word;
      memcpy(&word, codes + 4 * mxfp4_w_position(r, k, chunks, wave, &slot), 4);
      row[k] = e2m1[mxfp4_w_get(word, slot, wave)] *
               qkeep_e8m0_to_f32(scales[mxfp4_s_offset(r, k / 32, chunks, wave)]);
    }
    for (int64_t t = 0; t < m; t++) {
      float acc = 0.0f;
      for (int64_t k = 0; k < w->k; k++)
        acc += row[k] * x[t * w->k + k];
      y[t * w->n + r] = acc + bias_at(w, e, r);
    }
  }
  free(row);
}

static int host_apply(const struct qkeep_backend *be, qkeep_layer *layer, const struct qkeep_apply_args *a) {
  struct host_backend *h = (struct host_backend *)be;
  const struct mxfp4_layer *st = h->host->get_state(layer);
  if (!st)
    return h->host->set_error(QKEEP_E_STATE, "test-mxfp4: apply before PWAL");
  if (a->x_dtype != QKEEP_DTYPE_F32 || a->y_dtype != QKEEP_DTYPE_F32 ||
      (a->size >= sizeof *a && a->topk > 0) || (st->moe && (unsigned)a->matrix > QKEEP_MOE_W2))
    return h->host->set_error(QKEEP_E_INVAL, "test-mxfp4: f32 activations, one expert at a time");
  const struct mxfp4_weights *w = &st->w[st->moe ? a->matrix : 0];
  int64_t e = st->moe ? a->expert : 0;
  if (e < 0 || e >= w->experts)
    return h->host->set_error(QKEEP_E_INVAL, "test-mxfp4: expert %lld", (long long)e);
  gemm(w, h->wave, e, a->m, a->x, a->y);
  return 0;
}

static void host_cleanup(const struct qkeep_backend *be, qkeep_layer *layer, void *state) {
  (void)be, (void)layer;
  free(state);
}

static void host_fini(const struct qkeep_backend *be) { free((void *)be); }

QKEEP_BACKEND_EXPORT int qkeep_backend_init(const struct qkeep_host *host, const struct qkeep_backend **out) {
  if (!host || host->abi_major != QKEEP_BACKEND_ABI_MAJOR)
    return QKEEP_E_ABI;
  struct host_backend *h = calloc(1, sizeof *h);
  if (!h)
    return QKEEP_E_NOMEM;
  h->host = host;
  h->wave = 64;
  h->memory = (struct qkeep_memory_ops){.size = sizeof h->memory,
                                        .alloc = mem_alloc,
                                        .free = mem_free,
                                        .copy_h2d = mem_copy,
                                        .copy_d2h = mem_copy,
                                        .copy_d2d = mem_copy,
                                        .fill = mem_fill,
                                        .sync = mem_sync};
  h->be = (struct qkeep_backend){.size = sizeof h->be,
                                 .abi_major = QKEEP_BACKEND_ABI_MAJOR,
                                 .abi_minor = 0,
                                 .name = "test-mxfp4",
                                 .description = "the shared MXFP4 PWAL with its host twins, in host memory",
                                 .configure = host_configure,
                                 .memory = &h->memory,
                                 .supports = host_supports,
                                 .pwal = host_pwal,
                                 .apply = host_apply,
                                 .layer_cleanup = host_cleanup,
                                 .fini = host_fini,
                                 .supports_layer = host_supports_layer,
                                 .keys = host_keys,
                                 .n_keys = 1,
                                 .key_size = sizeof host_keys[0]};
  *out = &h->be;
  return 0;
}
