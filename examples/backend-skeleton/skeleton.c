/*
 * skeleton.c: a minimal out-of-tree qkeep backend that really loads and reloads, built only
 * against the installed headers (pkg-config qkeep-backend). It shows every step a backend
 * takes, in the order the core calls them:
 *
 *   init            fill a size-prefixed table (ABI 1.1 slots included) and keep the host
 *   keys/configure  declare its one key, `verify` (a bool the core type-checks before
 *                   configure sees it)
 *   supports_layer  take w8a8-int8 linear layers with per-channel weight scales; refuse
 *                   the rest with a reason, so the next backend of the chain runs them
 *   pwal            repack weight i8 [N, K] into K-major [K, N] inside the weight's own
 *                   storage (host->replace: same bytes, so it lands in place and a reload
 *                   never moves it), retire input_scale / input_zero_point (this kernel is
 *                   weight-only: activations stay f32), keep weight_scale as loaded
 *   apply           y = x (W * scale)^T from the repacked codes, in f32
 *
 * Run it in a chain: `backend = skeleton, reference` on a w8a8-int8 checkpoint. The layers
 * it refuses (unquantized, MoE, norms) go to the reference.
 */
#include <qkeep/qkeep_backend.h>
#include <qkeep/qkeep_backend_util.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct skeleton {
  struct qkeep_backend be; /* first: the core's pointer is ours */
  const struct qkeep_host *host;
  bool verify; /* `verify = true`: check every repacked weight against the bytes it came from */
};

static const struct skeleton *sk(const struct qkeep_backend *be) { return (const struct skeleton *)be; }

static const struct qkeep_backend_key skeleton_keys[] = {
    {"verify", QKEEP_KEY_BOOL, NULL, "false", "check every repacked weight against the bytes it came from"},
};

/* The core already checked the key name and that the value is a bool. */
static int skeleton_configure(const struct qkeep_backend *be, const char *key, const char *value) {
  (void)key;
  ((struct skeleton *)(void *)(uintptr_t)be)->verify = strcmp(value, "true") == 0 ||
                                                       strcmp(value, "yes") == 0 ||
                                                       strcmp(value, "on") == 0 || strcmp(value, "1") == 0;
  return 0;
}

static int skeleton_supports_layer(const struct qkeep_backend *be, const struct qkeep_layer_info *info,
                                   char *reason, size_t reason_len) {
  (void)be;
  if (strcmp(info->scheme, "w8a8-int8") != 0 || info->kind != QKEEP_LAYER_LINEAR) {
    snprintf(reason, reason_len, "runs w8a8-int8 linear layers only");
    return 0;
  }
  if (info->flags & QKEEP_LAYER_F_WEIGHT_PER_TENSOR) {
    snprintf(reason, reason_len, "needs per-channel weight scales");
    return 0;
  }
  return 1;
}

/* The ABI 1.0 answer, for a core that predates supports_layer. */
static int skeleton_supports(const struct qkeep_backend *be, const char *scheme, enum qkeep_layer_kind kind) {
  (void)be;
  return strcmp(scheme, "w8a8-int8") == 0 && kind == QKEEP_LAYER_LINEAR;
}

/*
 * The post-load pass. pwal also runs on every reload, after the core has put the checkpoint
 * view back, so it always starts from weight i8 [N, K] as loaded.
 */
static int skeleton_pwal(const struct qkeep_backend *be, qkeep_layer *layer) {
  const struct qkeep_host *host = sk(be)->host;
  struct qkeep_layer_info info = {.size = sizeof info};
  struct qkeep_view w = {.size = sizeof w};
  int rc = host->layer_info(layer, &info);
  if (!rc)
    rc = host->get_live(layer, "weight", &w);
  if (rc)
    return rc;
  struct qkeep_spec loaded = {QKEEP_DTYPE_I8, 2, {info.n, info.k}};
  if (!qkeep_be_spec_equal(&w.spec, &loaded))
    return host->set_error(QKEEP_E_FORMAT, "%s.weight: expected I8 [%lld, %lld] as loaded", info.name,
                           (long long)info.n, (long long)info.k);
  struct qkeep_spec packed = {QKEEP_DTYPE_I8, 2, {info.k, info.n}};
  qkeep_tensor *t;
  if ((rc = host->tensor_new(layer, &packed, &t)))
    return rc;
  const int8_t *from = w.data;
  int8_t *to = host->tensor_data(t);
  uint64_t sum = 0; /* a position-weighted checksum of the codes, for `verify` */
  for (int64_t n = 0; n < info.n; n++)
    for (int64_t k = 0; k < info.k; k++) {
      to[k * info.n + n] = from[n * info.k + k];
      sum += (uint64_t)(uint8_t)from[n * info.k + k] * (uint64_t)(n * info.k + k + 1);
    }
  /* Same byte count: replace copies into the weight's own storage, so its pointer stays. */
  if ((rc = host->replace(layer, "weight", t)))
    return rc;
  if (sk(be)->verify) {
    if ((rc = host->get_live(layer, "weight", &w)))
      return rc;
    const int8_t *got = w.data;
    for (int64_t n = 0; n < info.n; n++)
      for (int64_t k = 0; k < info.k; k++)
        sum -= (uint64_t)(uint8_t)got[k * info.n + n] * (uint64_t)(n * info.k + k + 1);
    if (sum || w.spec.shape[0] != info.k)
      return host->set_error(QKEEP_E_STATE, "%s.weight: the K-major repack does not hold the loaded codes",
                             info.name);
  }
  /* Static activation scales are for int8 activations, which this kernel does not use. */
  static const char *const unused[] = {"input_scale", "input_zero_point"};
  for (size_t i = 0; i < sizeof unused / sizeof unused[0] && !rc; i++) {
    struct qkeep_view v = {.size = sizeof v};
    if (host->get_live(layer, unused[i], &v) == 0)
      rc = host->retire(layer, unused[i]);
  }
  return rc;
}

/* What the f32 kernel of one apply needs besides its arguments. */
struct sk_call {
  const struct qkeep_layer_info *info;
  struct qkeep_view w, s, bias;
  bool has_bias;
};

/* y[m, N] = x[m, K] W^T in f32 over the K-major int8 codes (qkeep_be_f32_kernel). */
static int skeleton_kernel(void *user, int32_t expert, enum qkeep_moe_matrix matrix, int64_t rows,
                           const float *x, float *y) {
  (void)expert;
  (void)matrix;
  const struct sk_call *c = user;
  const int8_t *codes = c->w.data; /* [K, N] */
  int64_t n_out = c->info->n, k_in = c->info->k;
  for (int64_t m = 0; m < rows; m++)
    for (int64_t n = 0; n < n_out; n++) {
      float acc = 0;
      for (int64_t k = 0; k < k_in; k++)
        acc += x[m * k_in + k] * (float)codes[k * n_out + n];
      acc *= qkeep_load_float(c->s.data, c->s.spec.dtype, (size_t)n);
      y[m * n_out + n] = acc + (c->has_bias ? qkeep_load_float(c->bias.data, c->bias.spec.dtype, (size_t)n) : 0.0f);
    }
  return 0;
}

/* The workspace the helper's f32 staging needs for bf16 and f16 activations (ABI 1.4). */
static int skeleton_workspace(const struct qkeep_backend *be, qkeep_layer *layer,
                              const struct qkeep_apply_args *a, size_t *bytes) {
  struct qkeep_layer_info info = {.size = sizeof info};
  int rc = sk(be)->host->layer_info(layer, &info);
  if (!rc)
    *bytes = qkeep_be_f32_workspace(a, qkeep_be_dims(&info, a));
  return rc;
}

/* f32, bf16 and f16 activations: qkeep_be_f32_apply stages them as f32 for the kernel. */
static int skeleton_apply(const struct qkeep_backend *be, qkeep_layer *layer,
                          const struct qkeep_apply_args *a) {
  const struct qkeep_host *host = sk(be)->host;
  struct qkeep_layer_info info = {.size = sizeof info};
  struct sk_call call = {.info = &info,
                         .w = {.size = sizeof call.w},
                         .s = {.size = sizeof call.s},
                         .bias = {.size = sizeof call.bias}};
  int rc = host->layer_info(layer, &info);
  if (!rc)
    rc = host->get_live(layer, "weight", &call.w);
  if (!rc)
    rc = host->get_live(layer, "weight_scale", &call.s);
  if (rc)
    return rc;
  call.has_bias = host->get_live(layer, "bias", &call.bias) == 0;
  return qkeep_be_f32_apply(host, &info, a, skeleton_kernel, &call);
}

static void skeleton_fini(const struct qkeep_backend *be) { free((void *)(uintptr_t)be); }

QKEEP_BACKEND_EXPORT int qkeep_backend_init(const struct qkeep_host *host, const struct qkeep_backend **out) {
  if (!host || host->abi_major != QKEEP_BACKEND_ABI_MAJOR)
    return QKEEP_E_ABI;
  struct skeleton *s = calloc(1, sizeof *s);
  if (!s)
    return host->set_error(QKEEP_E_NOMEM, "skeleton: out of memory");
  s->host = host;
  s->be = (struct qkeep_backend){
      .size = sizeof(struct qkeep_backend),
      .abi_major = QKEEP_BACKEND_ABI_MAJOR,
      .abi_minor = 0, /* supports covers a 1.0 core; a 1.1 core uses supports_layer and keys */
      .name = "skeleton",
      .description = "out-of-tree example: w8a8-int8 linear, weight repacked K-major in place, f32 kernel",
      .configure = skeleton_configure,
      .supports = skeleton_supports,
      .pwal = skeleton_pwal,
      .apply = skeleton_apply,
      .fini = skeleton_fini,
      .supports_layer = skeleton_supports_layer,
      .keys = skeleton_keys,
      .n_keys = sizeof skeleton_keys / sizeof skeleton_keys[0],
      .key_size = sizeof skeleton_keys[0],
      .workspace = skeleton_workspace, /* ABI 1.4 slots: an older core ignores them */
  };
  *out = &s->be;
  return 0;
}
