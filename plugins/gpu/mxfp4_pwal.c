/*
 * mxfp4_pwal.c: PWAL of `mxfp4` linear and MoE layers into the kernel layout
 * of mxfp4_layout.h, shared by cuda-nvfp4 (wave 32) and rocm-mxfp4 (wave 64).
 *
 * Per matrix set (a linear layer; an MoE layer's stacked w13 and w2):
 *   weight        e2m1 codes [E?, rows, K/2] -> tiled units, through replace:
 *                 in their own storage when the tiles are no larger (rows % 16
 *                 == 0 and K % 64 == 0), rebound when padding makes them larger;
 *   weight_scale  e8m0 scales [E?, rows, K/32] -> tiled the same way (dtype kept:
 *                 U8 or F8_E8M0, as the checkpoint had it);
 *   bias          untouched (the kernel adds it in f32).
 * Nothing is retired or released: every param stays live. Each transform reads
 * the checkpoint-format bytes, which reload restores before PWAL runs again, so a
 * reload is in place and gives the bytes of a cold start.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mxfp4.h"
#include "qkeep/qkeep_backend_util.h"

/* One matrix set: names are prefix + local name. */
struct matrix {
  const struct mxfp4_device *d;
  qkeep_layer *layer;
  const char *layer_name;
  const char *prefix;       /* "", "w13_", "w2_" */
  int64_t rows, k, experts; /* experts 0: a linear layer (no leading dimension) */
};

static struct qkeep_spec stacked(enum qkeep_dtype dtype, int64_t experts, int ndim, const int64_t *shape) {
  struct qkeep_spec s = {.dtype = dtype, .ndim = 0};
  if (experts)
    s.shape[s.ndim++] = experts;
  for (int i = 0; i < ndim; i++)
    s.shape[s.ndim++] = shape[i];
  return s;
}

/* The CPU path: device -> host, the twins per expert, host -> device. */
static int tile_on_host(const struct matrix *m, bool scales, const void *src, void *dst) {
  const struct qkeep_backend *be = m->d->be;
  int64_t experts = m->experts ? m->experts : 1;
  size_t in_bytes = (size_t)(scales ? m->rows * (m->k / MXFP4_BLOCK) : m->rows * m->k / 2);
  size_t out_bytes = (size_t)(scales ? mxfp4_scale_bytes(m->rows, m->k) : mxfp4_code_bytes(m->rows, m->k));
  uint8_t *in = malloc(in_bytes * (size_t)experts + 1), *out = malloc(out_bytes * (size_t)experts + 1);
  int rc = in && out ? 0
                     : m->d->host->set_error(QKEEP_E_NOMEM, "%s: %s: out of host memory", m->d->backend_name,
                                             m->layer_name);
  if (!rc)
    rc = be->memory->copy_d2h(be, in, src, in_bytes * (size_t)experts);
  for (int64_t e = 0; !rc && e < experts; e++) {
    if (scales)
      mxfp4_tile_scales(in + (size_t)e * in_bytes, m->rows, m->k, m->d->wave, out + (size_t)e * out_bytes);
    else
      mxfp4_tile_codes(in + (size_t)e * in_bytes, m->rows, m->k, m->d->wave, out + (size_t)e * out_bytes);
  }
  if (!rc)
    rc = be->memory->copy_h2d(be, dst, out, out_bytes * (size_t)experts);
  free(in);
  free(out);
  return rc;
}

/* Rewrites {prefix}weight (scales false) or {prefix}weight_scale from the checkpoint layout into the
 * kernel's through a result tensor and replace; *data is the param's data pointer afterwards. */
static int transform(const struct matrix *m, bool scales, const void **data) {
  const struct qkeep_host *host = m->d->host;
  const char *local = scales ? "weight_scale" : "weight";
  size_t len = strlen(m->prefix) + strlen(local) + 1;
  char *name = malloc(len);
  if (!name)
    return host->set_error(QKEEP_E_NOMEM, "%s: out of host memory", m->d->backend_name);
  snprintf(name, len, "%s%s", m->prefix, local);
  struct qkeep_view v = {.size = sizeof v};
  int rc = host->view(m->layer, name, &v);
  enum qkeep_dtype dtype = scales ? v.spec.dtype : QKEEP_DTYPE_U8;
  int64_t ckpt_shape[2] = {m->rows, scales ? m->k / MXFP4_BLOCK : m->k / 2};
  int64_t kernel_shape[3] = {mxfp4_tiles(m->rows), mxfp4_chunks(m->k),
                             scales ? MXFP4_UNIT_SCALES : MXFP4_UNIT_BYTES};
  struct qkeep_spec want = stacked(dtype, m->experts, 2, ckpt_shape);
  struct qkeep_spec kernel = stacked(dtype, m->experts, 3, kernel_shape);
  if (!rc && scales && dtype != QKEEP_DTYPE_U8 && dtype != QKEEP_DTYPE_F8_E8M0)
    rc = host->set_error(QKEEP_E_FORMAT, "%s: %s.%s: dtype %d, expected U8 or F8_E8M0 scales",
                         m->d->backend_name, m->layer_name, name, (int)dtype);
  if (!rc && !qkeep_be_spec_equal(&v.spec, &want))
    rc = host->set_error(
        qkeep_be_spec_equal(&v.spec, &kernel) ? QKEEP_E_STATE : QKEEP_E_FORMAT,
        "%s: %s.%s is not in its checkpoint layout (%s); PWAL transforms checkpoint bytes only, "
        "and reload restores them before it runs again",
        m->d->backend_name, m->layer_name, name,
        qkeep_be_spec_equal(&v.spec, &kernel) ? "already transformed" : "other shape");
  qkeep_tensor *result = NULL;
  if (!rc)
    rc = host->tensor_new(m->layer, &kernel, &result);
  if (!rc) {
    void *dst = host->tensor_data(result);
    int64_t experts = m->experts ? m->experts : 1;
    if (m->d->on_host || !m->d->tile_gpu)
      rc = tile_on_host(m, scales, v.data, dst);
    else
      rc = m->d->tile_gpu(m->d->ctx, scales, v.data, dst, experts, m->rows, m->k);
    if (rc)
      host->tensor_free(result);
    else
      rc = host->replace(m->layer, name, result); /* same stream as the transform: it finishes first */
  }
  struct qkeep_view after = {.size = sizeof after};
  if (!rc)
    rc = host->view(m->layer, name, &after);
  *data = after.data;
  free(name);
  return rc;
}

/* The bias of the matrix set, when live. */
static void find_bias(const struct matrix *m, struct mxfp4_weights *w) {
  size_t len = strlen(m->prefix) + sizeof "bias";
  char *name = malloc(len);
  struct qkeep_view v = {.size = sizeof v};
  w->bias = NULL;
  if (!name)
    return;
  snprintf(name, len, "%sbias", m->prefix);
  if (m->d->host->view(m->layer, name, &v) == 0 && v.state == QKEEP_PARAM_LIVE)
    w->bias = v.data, w->bias_dtype = v.spec.dtype;
  free(name);
}

static int pwal_matrix(const struct matrix *m, struct mxfp4_weights *out) {
  *out = (struct mxfp4_weights){.n = m->rows, .k = m->k, .experts = m->experts ? m->experts : 1};
  if (m->k % MXFP4_BLOCK || m->k < MXFP4_BLOCK || m->rows < 1)
    return m->d->host->set_error(QKEEP_E_FORMAT, "%s: %s%s: K = %lld is not a positive multiple of 32",
                                 m->d->backend_name, m->layer_name, m->prefix, (long long)m->k);
  int rc = transform(m, false, &out->codes);
  if (!rc)
    rc = transform(m, true, &out->scales);
  if (!rc)
    find_bias(m, out);
  return rc;
}

int mxfp4_pwal(const struct mxfp4_device *d, qkeep_layer *layer, const struct qkeep_layer_info *info,
               struct mxfp4_layer *out) {
  out->moe = info->kind == QKEEP_LAYER_MOE;
  if (out->moe) {
    struct matrix w13 = {d, layer, info->name, "w13_", info->n, info->k, info->experts};
    struct matrix w2 = {d, layer, info->name, "w2_", info->k, info->n / 2, info->experts};
    int rc = pwal_matrix(&w13, &out->w[QKEEP_MOE_W13]);
    return rc ? rc : pwal_matrix(&w2, &out->w[QKEEP_MOE_W2]);
  }
  struct matrix linear = {d, layer, info->name, "", info->n, info->k, 0};
  return pwal_matrix(&linear, &out->w[0]);
}
