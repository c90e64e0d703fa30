/*
 * forward.c: running a layer's kernel. qkeep_layer_forward is the engine's call: it checks
 * the arguments on the host, asks the owner how much workspace it needs, and hands the
 * caller's buffers, stream and workspace to the backend's apply; it allocates, copies and
 * waits for nothing, so it can be captured in a CUDA graph. qkeep_layer_apply_f32 is the
 * forward check's: host f32 in and out, the core moving the data and the workspace.
 */
#include <stddef.h>
#include <string.h>

#include "model/model.h"
#include "qkeep/qkeep_backend_util.h"

/* The owner's flags (0 for a backend built before ABI 1.4 and for a host model). */
static uint32_t owner_flags(const struct qkeep_backend *be) {
  return be && QKEEP_HAS_SLOT(be, struct qkeep_backend, flags) ? be->flags : 0;
}

static bool activation_dtype(enum qkeep_dtype dt) {
  return dt == QKEEP_DTYPE_F32 || dt == QKEEP_DTYPE_BF16 || dt == QKEEP_DTYPE_F16;
}

static const char *forward_dtype_name(enum qkeep_dtype dt) {
  const char *name = qkeep_dtype_name(dt);
  return name ? name : "unknown";
}

/*
 * Checks what the backend cannot check alone (kind, owner, dtypes, the MoE fields) and fills
 * the apply arguments; `pointers` also checks x, y and the routing arrays. The detail names
 * the layer; the caller adds the call's name.
 */
static int forward_args(qkeep_layer *layer, const struct qkeep_forward_args *f, bool pointers,
                        struct qkeep_apply_args *a, const struct qkeep_backend **be_out) {
  if (!layer || !f || f->size < offsetof(struct qkeep_forward_args, workspace_bytes) + sizeof(size_t))
    return set_error(QKEEP_E_INVAL, "%s: NULL argument, or args->size %zu too small (set it to sizeof)",
                     layer ? layer->name : "layer", f ? f->size : (size_t)0);
  const struct qkeep_backend *be = layer_backend(layer);
  bool moe = layer->kind == QKEEP_LAYER_MOE;
  if (layer->kind != QKEEP_LAYER_LINEAR && !moe)
    return set_error(QKEEP_E_UNSUPPORTED, "%s: a %s layer has no forward", layer->name,
                     qkeep_layer_kind_name(layer->kind));
  if (!be || !be->apply)
    return set_error(QKEEP_E_UNSUPPORTED, "%s: its owner (%s) has no kernels", layer->name,
                     be ? be->name : "host memory");
  if (layer->model->poisoned)
    return set_error(QKEEP_E_STATE, "%s: a reload failed and could not roll back; reload before running",
                     layer->name);
  if (f->m < 0 || f->topk < 0)
    return set_error(QKEEP_E_INVAL, "%s: m %lld, topk %d", layer->name, (long long)f->m, (int)f->topk);
  if (!activation_dtype(f->x_dtype) || (f->y_dtype != QKEEP_DTYPE_F32 && f->y_dtype != f->x_dtype))
    return set_error(QKEEP_E_UNSUPPORTED,
                     "%s: x %s, y %s: x must be F32, BF16 or F16 and y F32 or x's dtype", layer->name,
                     forward_dtype_name(f->x_dtype), forward_dtype_name(f->y_dtype));
  if (pointers && f->m > 0 && (!f->x || !f->y))
    return set_error(QKEEP_E_INVAL, "%s: x or y is NULL", layer->name);
  if (pointers && ((uintptr_t)f->x & 15))
    return set_error(QKEEP_E_INVAL, "%s: x is not 16-byte aligned", layer->name);
  if (moe) {
    if (f->matrix != QKEEP_MOE_W13 && f->matrix != QKEEP_MOE_W2)
      return set_error(QKEEP_E_INVAL, "%s: MoE matrix %d (W13 or W2)", layer->name, (int)f->matrix);
    if (f->topk == 0 && (f->expert < 0 || f->expert >= layer->dims.experts))
      return set_error(QKEEP_E_INVAL, "%s: expert %d of %lld", layer->name, (int)f->expert,
                       (long long)layer->dims.experts);
    if (f->topk > 0 && !(owner_flags(be) & QKEEP_BACKEND_F_ROUTED_MOE))
      return set_error(QKEEP_E_UNSUPPORTED, "%s: backend %s does not run routed MoE (topk %d)", layer->name,
                       be->name, (int)f->topk);
    if (f->topk > layer->dims.experts)
      return set_error(QKEEP_E_INVAL, "%s: topk %d of %lld experts", layer->name, (int)f->topk,
                       (long long)layer->dims.experts);
    if (pointers && f->topk > 0 && f->m > 0 &&
        (!f->topk_ids || (f->matrix == QKEEP_MOE_W2 && !f->topk_weights)))
      return set_error(QKEEP_E_INVAL, "%s: routed MoE needs topk_ids%s", layer->name,
                       f->matrix == QKEEP_MOE_W2 ? " and topk_weights" : "");
  } else if (f->topk > 0) {
    return set_error(QKEEP_E_INVAL, "%s: topk %d on a linear layer", layer->name, (int)f->topk);
  }
  *a = (struct qkeep_apply_args){.size = sizeof *a,
                                 .m = f->m,
                                 .x = f->x,
                                 .x_dtype = f->x_dtype,
                                 .y = f->y,
                                 .y_dtype = f->y_dtype,
                                 .expert = moe && f->topk == 0 ? f->expert : 0,
                                 .matrix = moe ? f->matrix : QKEEP_MOE_W13,
                                 .topk = f->topk,
                                 .topk_ids = f->topk_ids,
                                 .topk_weights = f->topk_weights,
                                 .stream = f->stream,
                                 .workspace = f->workspace,
                                 .workspace_bytes = f->workspace_bytes};
  *be_out = be;
  return 0;
}

/* The owner's workspace for a (0 for a backend without the slot). */
static int owner_workspace(const struct qkeep_backend *be, qkeep_layer *layer, const struct qkeep_apply_args *a,
                           size_t *bytes) {
  *bytes = 0;
  return QKEEP_HAS_SLOT(be, struct qkeep_backend, workspace) ? be->workspace(be, layer, a, bytes) : 0;
}

int qkeep_layer_workspace(qkeep_layer *layer, const struct qkeep_forward_args *args, size_t *bytes) {
  struct qkeep_apply_args a;
  const struct qkeep_backend *be = NULL;
  if (!bytes)
    return set_error(QKEEP_E_INVAL, "qkeep_layer_workspace: NULL argument");
  *bytes = 0;
  int rc = forward_args(layer, args, false, &a, &be);
  if (!rc)
    rc = owner_workspace(be, layer, &a, bytes);
  return rc ? add_error_context(rc, "qkeep_layer_workspace") : 0;
}

int qkeep_layer_forward(qkeep_layer *layer, const struct qkeep_forward_args *args) {
  struct qkeep_apply_args a;
  const struct qkeep_backend *be = NULL;
  size_t need = 0;
  int rc = forward_args(layer, args, true, &a, &be);
  if (!rc)
    rc = owner_workspace(be, layer, &a, &need);
  if (!rc && need && (!args->workspace || args->workspace_bytes < need))
    rc = set_error(QKEEP_E_INVAL, "%s: needs %zu bytes of workspace, got %zu (qkeep_layer_workspace)",
                   layer->name, need, args->workspace ? args->workspace_bytes : (size_t)0);
  if (!rc && a.m > 0 && (rc = be->apply(be, layer, &a)))
    rc = add_error_context(rc, "backend %s", be->name);
  return rc ? add_error_context(rc, "qkeep_layer_forward") : 0;
}

int qkeep_layer_device(const qkeep_layer *layer, struct qkeep_layer_device *out) {
  if (!layer || !out || out->size < offsetof(struct qkeep_layer_device, index))
    return set_error(QKEEP_E_INVAL, "qkeep_layer_device: NULL argument or out->size unset");
  const struct qkeep_backend *be = layer_backend(layer);
  struct qkeep_layer_device d = {.size = sizeof d, .type = QKEEP_DEVICE_HOST};
  if (be && QKEEP_HAS_SLOT(be, struct qkeep_backend, device)) {
    int rc = be->device(be, &d.type, &d.index);
    if (rc)
      return add_error_context(rc, "qkeep_layer_device %s (backend %s)", layer->name, be->name);
  } else if (be && be->memory) {
    d.type = QKEEP_DEVICE_OTHER;
  }
  uint32_t flags = owner_flags(be);
  d.forward = (layer->kind == QKEEP_LAYER_LINEAR || layer->kind == QKEEP_LAYER_MOE) && be && be->apply;
  d.graph_safe = d.forward && (flags & QKEEP_BACKEND_F_GRAPH_SAFE);
  d.routed = d.forward && layer->kind == QKEEP_LAYER_MOE && (flags & QKEEP_BACKEND_F_ROUTED_MOE);
  size_t n = out->size < sizeof d ? out->size : sizeof d;
  memcpy((char *)out + sizeof out->size, (const char *)&d + sizeof d.size, n - sizeof d.size);
  return 0;
}

/* Moves x to the device, runs the backend's kernel with a workspace of its own, and brings y back. */
static int apply_f32(qkeep_layer *layer, int64_t m, int64_t n, int64_t k, const struct qkeep_forward_args *f,
                     const float *x, float *y) {
  struct qkeep_apply_args a;
  const struct qkeep_backend *be = NULL;
  int rc = forward_args(layer, f, false, &a, &be);
  if (rc)
    return add_error_context(rc, "apply");
  const struct device *dev = layer_device(layer);
  size_t x_bytes, y_bytes, ws_bytes = 0;
  if (!f32_matrix_bytes(m, k, &x_bytes) || !f32_matrix_bytes(m, n, &y_bytes))
    return set_error(QKEEP_E_INVAL,
                     "apply %s: %lld rows of %lld inputs and %lld outputs (f32) do not fit in memory",
                     layer->name, (long long)m, (long long)k, (long long)n);
  void *dx = NULL, *dy = NULL, *ws = NULL;
  rc = owner_workspace(be, layer, &a, &ws_bytes);
  if (!rc)
    rc = dev_alloc(dev, x_bytes, &dx);
  if (!rc)
    rc = dev_alloc(dev, y_bytes, &dy);
  if (!rc && ws_bytes)
    rc = dev_alloc(dev, ws_bytes, &ws);
  if (!rc)
    rc = dev_h2d(dev, dx, x, x_bytes);
  if (!rc && m > 0) {
    a.x = dx, a.y = dy, a.workspace = ws, a.workspace_bytes = ws_bytes;
    rc = be->apply(be, layer, &a);
  }
  if (!rc)
    rc = dev_sync(dev);
  if (!rc)
    rc = dev_d2h(dev, y, dy, y_bytes);
  dev_free(dev, dx);
  dev_free(dev, dy);
  dev_free(dev, ws);
  return rc ? add_error_context(rc, "apply %s (backend %s)", layer->name, be->name) : 0;
}

int qkeep_layer_apply_f32(qkeep_layer *layer, int64_t m, const float *x, float *y) {
  if (!layer || m < 0 || (m && (!x || !y)))
    return set_error(QKEEP_E_INVAL, "apply: invalid argument");
  if (layer->kind != QKEEP_LAYER_LINEAR)
    return set_error(QKEEP_E_UNSUPPORTED, "apply %s: layer kind %s has no GEMM", layer->name,
                     qkeep_layer_kind_name(layer->kind));
  struct qkeep_forward_args f = {
      .size = sizeof f, .m = m, .x_dtype = QKEEP_DTYPE_F32, .y_dtype = QKEEP_DTYPE_F32};
  return apply_f32(layer, m, layer->dims.n, layer->dims.k, &f, x, y);
}

int qkeep_layer_apply_expert_f32(qkeep_layer *layer, int32_t expert, enum qkeep_moe_matrix matrix, int64_t m,
                                 const float *x, float *y) {
  if (!layer || m < 0 || (m && (!x || !y)))
    return set_error(QKEEP_E_INVAL, "apply: invalid argument");
  if (layer->kind != QKEEP_LAYER_MOE || expert < 0 || expert >= layer->dims.experts)
    return set_error(QKEEP_E_INVAL, "apply %s: not an MoE layer with expert %d", layer->name, expert);
  int64_t inter = layer->dims.n / 2, hidden = layer->dims.k;
  bool w13 = matrix == QKEEP_MOE_W13;
  struct qkeep_forward_args f = {.size = sizeof f,
                                 .m = m,
                                 .x_dtype = QKEEP_DTYPE_F32,
                                 .y_dtype = QKEEP_DTYPE_F32,
                                 .expert = expert,
                                 .matrix = matrix};
  return apply_f32(layer, m, w13 ? layer->dims.n : hidden, w13 ? hidden : inter, &f, x, y);
}
