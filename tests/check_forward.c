/*
 * check_forward.c: the engine forward (qkeep_layer_forward) on the CPU backends, against the
 * forward check's path (qkeep_layer_apply_f32) as the oracle:
 *   - every linear layer of every example, on the chains "reference", "cpu-onednn, reference"
 *     and "cpu-zentorch, reference": f32 in and out equals apply_f32 bit for bit; bf16 and f16
 *     activations (in, and out) equal apply_f32 on the same rounded inputs, the outputs rounded
 *     the same way;
 *   - after qkeep_model_reload to W1, the same calls on the same buffers equal a cold W1
 *     model's bit for bit (the CPU backends are deterministic at a fixed thread count);
 *   - routed MoE (topk > 0) on a synthetic NVFP4 MoE checkpoint equals the sum the test builds
 *     from one-expert applies, skipped slots included, before and after a reload;
 *   - the refusals: dtype pairs, kinds without a forward, a short workspace, bad MoE fields.
 * Under valgrind and the sanitizers (tu_under_memcheck) the first layer of each backend, scheme, kind and
 * shape in a test stands for the others, in the same example and in the later ones (plain make check runs
 * every layer of every example on every chain).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkutil.h"
#include "qkeep/qkeep_backend_util.h"
#include "synth_moe.h"
#include "testutil.h"

static qkeep_plugin *ref, *onednn, *zentorch;
static const char *const schemes[] = {"",        "w8a8-int8", "gptq-int4",      "awq-int4",
                                      "ct-int4", "ct-nvfp4",  "modelopt-nvfp4", "mxfp4"};
#define N_SCHEMES (int)(sizeof schemes / sizeof schemes[0])
#define N_CHAINS 3

static char *example(bool w1, const char *scheme) {
  char name[64];
  snprintf(name, sizeof name, "tiny%s%s%s", w1 ? "-w1" : "", *scheme ? "-" : "", scheme);
  char *examples = tu_path(tu_builddir(), "examples"), *path = tu_path(examples, name);
  free(examples);
  return path;
}

/* Chain i: reference alone, or a CPU backend in front of it; NULL when that plugin is not built. */
static qkeep_model *load_chain(int chain, const char *path) {
  qkeep_plugin *front = chain == 1 ? onednn : chain == 2 ? zentorch : NULL;
  if (chain && !front)
    return NULL;
  qkeep_plugin *plugins[] = {front, ref};
  qkeep_model *m;
  ck_assert_int_eq(chain ? qkeep_model_new_chain(plugins, 2, &m) : qkeep_model_new_chain(&ref, 1, &m), 0);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

/* An aligned scratch of n bytes (at least 1), zeroed. */
static void *aligned(size_t n) {
  size_t bytes = (n + 255) / 256 * 256 + 256;
  void *p = aligned_alloc(256, bytes);
  ck_assert_ptr_nonnull(p);
  memset(p, 0, bytes);
  return p;
}

/* Runs a forward with a workspace of exactly the size qkeep_layer_workspace gives. */
static int forward(qkeep_layer *layer, struct qkeep_forward_args *a) {
  size_t need = 0;
  int rc = qkeep_layer_workspace(layer, a, &need);
  if (rc)
    return rc;
  a->workspace = need ? aligned(need) : NULL;
  a->workspace_bytes = need;
  rc = qkeep_layer_forward(layer, a);
  free(a->workspace);
  a->workspace = NULL;
  return rc;
}

static void to_half(const float *x, size_t n, enum qkeep_dtype dt, uint16_t *out) {
  for (size_t i = 0; i < n; i++)
    out[i] = dt == QKEEP_DTYPE_BF16 ? qkeep_f32_to_bf16(x[i]) : qkeep_f32_to_f16(x[i]);
}

static void from_half(const uint16_t *h, size_t n, enum qkeep_dtype dt, float *out) {
  for (size_t i = 0; i < n; i++)
    out[i] = dt == QKEEP_DTYPE_BF16 ? qkeep_bf16_to_f32(h[i]) : qkeep_f16_to_f32(h[i]);
}

static void random_x(float *x, size_t n, uint64_t seed) {
  uint64_t st = seed;
  for (size_t i = 0; i < n; i++)
    x[i] = tu_randf(&st) * 2.0f - 1.0f;
}

/* The layers a test has checked under a memory checker: each one's backend, scheme, kind and shape. */
struct seen {
  char key[64][160];
  int n;
};

/*
 * Whether layer i of the model is checked: every layer, or under a memory checker the first of each
 * backend, scheme, kind and shape that this test meets (`seen`: across its iterations, which share one
 * process there, CK_FORK=no). The same kernel on the same shape again finds no memory error that the
 * first did not: cpu-onednn's bf16 lm_head, the same in all eight examples, took 6 s of valgrind each time.
 */
static bool checked(qkeep_model *model, size_t i, struct seen *seen) {
  if (!tu_under_memcheck())
    return true;
  qkeep_layer *layer = qkeep_model_layer(model, i);
  struct qkeep_layer_info info = {.size = sizeof info};
  ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
  char key[160];
  snprintf(key, sizeof key, "%s %s %d %lld %lld %d %lld %u", qkeep_layer_backend(layer), info.scheme,
           (int)info.kind, (long long)info.n, (long long)info.k, (int)info.weight_dtype,
           (long long)info.group_size, (unsigned)info.flags);
  for (int j = 0; j < seen->n; j++)
    if (strcmp(seen->key[j], key) == 0)
      return false;
  ck_assert_int_lt(seen->n, 64);
  snprintf(seen->key[seen->n++], sizeof seen->key[0], "%s", key);
  return true;
}

/* Every linear layer: f32 bit for bit; bf16 and f16 in (and out) as apply_f32 on rounded inputs. */
static void check_linear(qkeep_layer *layer, int64_t m) {
  struct qkeep_layer_info info = {.size = sizeof info};
  ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
  size_t nx = (size_t)(m * info.k), ny = (size_t)(m * info.n);
  float *x = aligned(nx * 4), *xr = aligned(nx * 4), *want = aligned(ny * 4), *got = aligned(ny * 4);
  uint16_t *xh = aligned(nx * 2), *yh = aligned(ny * 2), *wanth = aligned(ny * 2);
  random_x(x, nx, 7 + (uint64_t)info.n);
  ck_assert_msg(qkeep_layer_apply_f32(layer, m, x, want) == 0, "%s", qkeep_errmsg());
  struct qkeep_forward_args a = {
      .size = sizeof a, .m = m, .x = x, .x_dtype = QKEEP_DTYPE_F32, .y = got, .y_dtype = QKEEP_DTYPE_F32};
  ck_assert_msg(forward(layer, &a) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(memcmp(want, got, ny * 4) == 0, "%s: f32 forward differs from apply_f32", info.name);
  static const enum qkeep_dtype halves[] = {QKEEP_DTYPE_BF16, QKEEP_DTYPE_F16};
  for (int h = 0; h < 2; h++) {
    enum qkeep_dtype dt = halves[h];
    to_half(x, nx, dt, xh);
    from_half(xh, nx, dt, xr);
    ck_assert_msg(qkeep_layer_apply_f32(layer, m, xr, want) == 0, "%s", qkeep_errmsg());
    a = (struct qkeep_forward_args){
        .size = sizeof a, .m = m, .x = xh, .x_dtype = dt, .y = got, .y_dtype = QKEEP_DTYPE_F32};
    ck_assert_msg(forward(layer, &a) == 0, "%s", qkeep_errmsg());
    ck_assert_msg(memcmp(want, got, ny * 4) == 0, "%s: %s in, f32 out differs from apply_f32", info.name,
                  qkeep_dtype_name(dt));
    a.y = yh, a.y_dtype = dt;
    ck_assert_msg(forward(layer, &a) == 0, "%s", qkeep_errmsg());
    to_half(want, ny, dt, wanth);
    ck_assert_msg(memcmp(wanth, yh, ny * 2) == 0, "%s: %s in and out differs from apply_f32", info.name,
                  qkeep_dtype_name(dt));
  }
  free(x), free(xr), free(want), free(got), free(xh), free(yh), free(wanth);
}

START_TEST(forward_equals_apply_on_every_example) {
  static struct seen seen;
  int scheme = _i / N_CHAINS, chain = _i % N_CHAINS;
  char *path = example(false, schemes[scheme]);
  qkeep_model *model = load_chain(chain, path);
  free(path);
  if (!model)
    return;
  size_t linears = 0;
  for (size_t i = 0; i < qkeep_model_layer_count(model); i++) {
    qkeep_layer *layer = qkeep_model_layer(model, i);
    struct qkeep_layer_device dev = {.size = sizeof dev};
    ck_assert_int_eq(qkeep_layer_device(layer, &dev), 0);
    ck_assert_int_eq(dev.type, QKEEP_DEVICE_HOST);
    ck_assert(!dev.graph_safe);
    struct qkeep_layer_info info = {.size = sizeof info};
    ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
    ck_assert_int_eq(dev.forward, info.kind == QKEEP_LAYER_LINEAR || info.kind == QKEEP_LAYER_MOE);
    if (info.kind != QKEEP_LAYER_LINEAR)
      continue;
    linears++;
    if (checked(model, i, &seen))
      check_linear(layer, 3);
  }
  ck_assert_uint_gt(linears, 0);
  qkeep_model_free(model);
}
END_TEST

/* y of every linear layer picked in `run` for x (f32 out from bf16 in, and f32 in and out), into
 * ys[2 * layer + j]. */
static void run_all(qkeep_model *model, const bool *run, float *x, uint16_t *xh, float **ys) {
  for (size_t i = 0, n = qkeep_model_layer_count(model); i < n; i++) {
    qkeep_layer *layer = qkeep_model_layer(model, i);
    struct qkeep_layer_info info = {.size = sizeof info};
    ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
    if (info.kind != QKEEP_LAYER_LINEAR || !run[i])
      continue;
    for (int j = 0; j < 2; j++) {
      struct qkeep_forward_args a = {.size = sizeof a,
                                     .m = 2,
                                     .x = j ? (void *)xh : (void *)x,
                                     .x_dtype = j ? QKEEP_DTYPE_BF16 : QKEEP_DTYPE_F32,
                                     .y = ys[2 * i + j],
                                     .y_dtype = QKEEP_DTYPE_F32};
      ck_assert_msg(forward(layer, &a) == 0, "%s: %s", info.name, qkeep_errmsg());
    }
  }
}

START_TEST(forward_after_reload_equals_a_cold_w1) {
  static struct seen seen;
  int scheme = _i / N_CHAINS, chain = _i % N_CHAINS;
  char *w0 = example(false, schemes[scheme]), *w1 = example(true, schemes[scheme]);
  qkeep_model *model = load_chain(chain, w0);
  if (!model) {
    free(w0), free(w1);
    return;
  }
  qkeep_model *cold = load_chain(chain, w1);
  size_t n = qkeep_model_layer_count(model), widest = 1, picked = 0;
  ck_assert_uint_eq(n, qkeep_model_layer_count(cold));
  bool *run = calloc(n, sizeof *run);
  ck_assert_ptr_nonnull(run);
  for (size_t i = 0; i < n; i++) {
    struct qkeep_layer_info info = {.size = sizeof info};
    ck_assert_int_eq(qkeep_layer_get_info(qkeep_model_layer(model, i), &info), 0);
    /* picked once: the three models run the same layers */
    picked += run[i] = info.kind == QKEEP_LAYER_LINEAR && checked(model, i, &seen);
    widest = (size_t)(info.k > info.n ? info.k : info.n) > widest
                 ? (size_t)(info.k > info.n ? info.k : info.n)
                 : widest;
  }
  float *x = aligned(2 * widest * 4);
  uint16_t *xh = aligned(2 * widest * 2);
  random_x(x, 2 * widest, 99);
  to_half(x, 2 * widest, QKEEP_DTYPE_BF16, xh);
  float **before = calloc(2 * n, sizeof *before), **after = calloc(2 * n, sizeof *after),
        **want = calloc(2 * n, sizeof *want);
  for (size_t i = 0; i < 2 * n; i++)
    before[i] = aligned(2 * widest * 4), after[i] = aligned(2 * widest * 4),
    want[i] = aligned(2 * widest * 4);
  run_all(model, run, x, xh, before);
  ck_assert_msg(qkeep_model_reload(model, w1, 0) == 0, "%s", qkeep_errmsg());
  run_all(model, run, x, xh, after);
  run_all(cold, run, x, xh, want);
  size_t changed = 0;
  for (size_t i = 0; i < 2 * n; i++) {
    ck_assert_msg(memcmp(after[i], want[i], 2 * widest * 4) == 0, "layer %zu: reload forward != cold W1",
                  i / 2);
    changed += memcmp(before[i], after[i], 2 * widest * 4) != 0;
  }
  if (picked) /* (none under a memory checker when an earlier example ran all of this one's layers) */
    ck_assert_uint_gt(changed, 0); /* W1 is not W0 */
  for (size_t i = 0; i < 2 * n; i++)
    free(before[i]), free(after[i]), free(want[i]);
  free(before), free(after), free(want), free(run), free(x), free(xh), free(w0), free(w1);
  qkeep_model_free(model);
  qkeep_model_free(cold);
}
END_TEST

START_TEST(forward_refusals_name_the_layer) {
  char *path = example(false, "w8a8-int8");
  qkeep_model *model = load_chain(0, path);
  free(path);
  qkeep_layer *linear = NULL, *other = NULL;
  for (size_t i = 0; i < qkeep_model_layer_count(model); i++) {
    struct qkeep_layer_info info = {.size = sizeof info};
    qkeep_layer *l = qkeep_model_layer(model, i);
    ck_assert_int_eq(qkeep_layer_get_info(l, &info), 0);
    if (info.kind == QKEEP_LAYER_LINEAR && !linear)
      linear = l;
    if ((info.kind == QKEEP_LAYER_EMBEDDING || info.kind == QKEEP_LAYER_OTHER) && !other)
      other = l;
  }
  ck_assert_ptr_nonnull(linear);
  ck_assert_ptr_nonnull(other);
  struct qkeep_layer_info info = {.size = sizeof info};
  ck_assert_int_eq(qkeep_layer_get_info(linear, &info), 0);
  float *x = aligned((size_t)info.k * 4), *y = aligned((size_t)info.n * 4);
  struct qkeep_forward_args a = {
      .size = sizeof a, .m = 1, .x = x, .x_dtype = QKEEP_DTYPE_BF16, .y = y, .y_dtype = QKEEP_DTYPE_F16};
  ck_assert_int_eq(qkeep_layer_forward(linear, &a), QKEEP_E_UNSUPPORTED); /* y neither f32 nor x's dtype */
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), info.name));
  a.x_dtype = QKEEP_DTYPE_I8, a.y_dtype = QKEEP_DTYPE_F32;
  ck_assert_int_eq(qkeep_layer_forward(linear, &a), QKEEP_E_UNSUPPORTED);
  a.x_dtype = QKEEP_DTYPE_BF16;
  size_t need = 0;
  ck_assert_int_eq(qkeep_layer_workspace(linear, &a, &need), 0);
  ck_assert_uint_gt(need, 0); /* the reference stages bf16 as f32 */
  a.workspace = aligned(need), a.workspace_bytes = need - 1;
  ck_assert_int_eq(qkeep_layer_forward(linear, &a), QKEEP_E_INVAL);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "workspace"));
  a.workspace_bytes = need;
  ck_assert_msg(qkeep_layer_forward(linear, &a) == 0, "%s", qkeep_errmsg());
  a.m = -1;
  ck_assert_int_eq(qkeep_layer_forward(linear, &a), QKEEP_E_INVAL);
  a.m = 1, a.x = (const char *)x + 2;
  ck_assert_int_eq(qkeep_layer_forward(linear, &a), QKEEP_E_INVAL); /* not 16-byte aligned */
  a.x = x, a.topk = 2;
  ck_assert_int_eq(qkeep_layer_forward(linear, &a), QKEEP_E_INVAL); /* routing on a linear layer */
  a.topk = 0, a.size = 8;
  ck_assert_int_eq(qkeep_layer_forward(linear, &a), QKEEP_E_INVAL);
  a.size = sizeof a;
  ck_assert_int_eq(qkeep_layer_forward(other, &a), QKEEP_E_UNSUPPORTED);
  struct qkeep_layer_device dev = {.size = sizeof dev};
  ck_assert_int_eq(qkeep_layer_device(other, &dev), 0);
  ck_assert(!dev.forward);
  free(a.workspace), free(x), free(y);
  qkeep_model_free(model);
}
END_TEST

/* The routed result the test builds from one-expert applies (f32), skipped slots left out. */
static void routed_oracle(qkeep_layer *layer, bool w2, int64_t m, int32_t topk, const int32_t *ids,
                          const float *weights, const float *x, int64_t in, int64_t out, int64_t experts,
                          float *y) {
  float *row = aligned((size_t)out * 4);
  for (int64_t t = 0; t < m; t++) {
    if (w2)
      memset(y + t * out, 0, (size_t)out * 4);
    for (int32_t s = 0; s < topk; s++) {
      int32_t e = ids[t * topk + s];
      if (e < 0 || e >= experts)
        continue;
      const float *xr = x + (w2 ? t * topk + s : t) * in;
      ck_assert_msg(qkeep_layer_apply_expert_f32(layer, e, w2 ? QKEEP_MOE_W2 : QKEEP_MOE_W13, 1, xr, row) ==
                        0,
                    "%s", qkeep_errmsg());
      if (!w2) {
        memcpy(y + (t * topk + s) * out, row, (size_t)out * 4);
        continue;
      }
      for (int64_t j = 0; j < out; j++)
        y[t * out + j] += weights[t * topk + s] * row[j];
    }
  }
  free(row);
}

/* Both matrices of the first MoE layer, routed: m 3 tokens, topk 2, one slot skipped. */
static void check_routed(qkeep_model *model, float **results) {
  qkeep_layer *layer = NULL;
  struct qkeep_layer_info info = {.size = sizeof info};
  for (size_t i = 0; i < qkeep_model_layer_count(model) && !layer; i++) {
    ck_assert_int_eq(qkeep_layer_get_info(qkeep_model_layer(model, i), &info), 0);
    if (info.kind == QKEEP_LAYER_MOE)
      layer = qkeep_model_layer(model, i);
  }
  ck_assert_ptr_nonnull(layer);
  struct qkeep_layer_device dev = {.size = sizeof dev};
  ck_assert_int_eq(qkeep_layer_device(layer, &dev), 0);
  ck_assert(dev.forward && dev.routed);
  const int64_t m = 3, e = info.experts, hidden = info.k, inter = info.n / 2;
  const int32_t topk = 2;
  int32_t ids[6] = {1, 0, (int32_t)(e - 1), 1, -1, 2 % (int32_t)e};
  float weights[6] = {0.75f, 0.25f, 0.5f, 0.5f, 0.9f, 0.1f};
  for (int w2 = 0; w2 < 2; w2++) {
    int64_t in = w2 ? inter : hidden, out = w2 ? hidden : 2 * inter, rows_in = w2 ? m * topk : m,
            rows_out = w2 ? m : m * topk;
    float *x = aligned((size_t)(rows_in * in) * 4), *want = aligned((size_t)(rows_out * out) * 4);
    uint16_t *xh = aligned((size_t)(rows_in * in) * 2);
    float *xr = aligned((size_t)(rows_in * in) * 4);
    random_x(x, (size_t)(rows_in * in), 5 + (uint64_t)w2);
    to_half(x, (size_t)(rows_in * in), QKEEP_DTYPE_BF16, xh);
    from_half(xh, (size_t)(rows_in * in), QKEEP_DTYPE_BF16, xr);
    routed_oracle(layer, w2, m, topk, ids, weights, xr, in, out, e, want);
    float *got = results[w2];
    memset(got, 0, (size_t)(rows_out * out) * 4);
    struct qkeep_forward_args a = {.size = sizeof a,
                                   .m = m,
                                   .x = xh,
                                   .x_dtype = QKEEP_DTYPE_BF16,
                                   .y = got,
                                   .y_dtype = QKEEP_DTYPE_F32,
                                   .matrix = w2 ? QKEEP_MOE_W2 : QKEEP_MOE_W13,
                                   .topk = topk,
                                   .topk_ids = ids,
                                   .topk_weights = weights};
    ck_assert_msg(forward(layer, &a) == 0, "%s", qkeep_errmsg());
    for (int64_t i = 0; i < rows_out * out; i++)
      ck_assert_msg(got[i] == want[i], "%s %s routed [%lld]: %g != %g", info.name, w2 ? "w2" : "w13",
                    (long long)i, got[i], want[i]);
    a.topk_weights = w2 ? NULL : weights;
    if (w2)
      ck_assert_int_eq(qkeep_layer_forward(layer, &a), QKEEP_E_INVAL); /* W2 needs the router weights */
    free(x), free(want), free(xh), free(xr);
  }
}

START_TEST(routed_moe_equals_one_expert_applies) {
  char *dir = tu_tmpdir("forward-moe"), *w0 = tu_path(dir, "w0"), *w1 = tu_path(dir, "w1");
  ck_assert_int_eq(mkdir(w0, 0755), 0);
  ck_assert_int_eq(mkdir(w1, 0755), 0);
  ck_assert_msg(synth_moe_write(w0, 1, 4, 1, 1) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(synth_moe_write(w1, 1, 4, 1, 2) == 0, "%s", qkeep_errmsg());
  qkeep_model *model = load_chain(0, w0), *cold = load_chain(0, w1);
  float *first[2], *after[2], *want[2];
  for (int i = 0; i < 2; i++)
    first[i] = aligned(1 << 16), after[i] = aligned(1 << 16), want[i] = aligned(1 << 16);
  check_routed(model, first);
  ck_assert_msg(qkeep_model_reload(model, w1, 0) == 0, "%s", qkeep_errmsg());
  check_routed(model, after);
  check_routed(cold, want);
  for (int i = 0; i < 2; i++) {
    ck_assert(memcmp(after[i], want[i], 1 << 16) == 0);
    ck_assert(memcmp(after[i], first[i], 1 << 16) != 0);
    free(first[i]), free(after[i]), free(want[i]);
  }
  qkeep_model_free(model);
  qkeep_model_free(cold);
  tu_rmtree(dir);
  free(dir), free(w0), free(w1);
}
END_TEST

static Suite *forward_suite(void) {
  Suite *s = suite_create("forward");
  TCase *tc = tcase_create("engine forward");
  tcase_set_timeout(tc, 300);
  tcase_add_loop_test(tc, forward_equals_apply_on_every_example, 0, N_SCHEMES * N_CHAINS);
  tcase_add_loop_test(tc, forward_after_reload_equals_a_cold_w1, 0, N_SCHEMES * N_CHAINS);
  tcase_add_test(tc, forward_refusals_name_the_layer);
  tcase_add_test(tc, routed_moe_equals_one_expert_applies);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  if (qkeep_plugin_open("reference", NULL, &ref)) {
    fprintf(stderr, "check_forward: %s\n", qkeep_errmsg());
    return 1;
  }
  /* The optional CPU backends: their chains are skipped when they are not built. */
  if (qkeep_plugin_open("cpu-onednn", NULL, &onednn))
    onednn = NULL;
  if (qkeep_plugin_open("cpu-zentorch", NULL, &zentorch))
    zentorch = NULL;
  int rc = tu_run_suite(forward_suite(), CK_NORMAL);
  qkeep_plugin_close(ref);
  if (onednn)
    qkeep_plugin_close(onednn);
  if (zentorch)
    qkeep_plugin_close(zentorch);
  return rc;
}
