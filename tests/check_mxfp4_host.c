/*
 * check_mxfp4_host.c: the MXFP4 PWAL of the GPU backends (plugins/gpu/mxfp4_pwal.c) run on
 * the host twins of its transforms, in CI, through the test plugin `test-mxfp4`
 * (tests/plugins/mxfp4_host.c) in the chain `test-mxfp4, reference`, for the layout of
 * each wave (32: cuda-nvfp4; 64: rocm-mxfp4), on the shipped compressed-tensors example
 * and on a gpt-oss checkpoint with biases:
 *   - every mxfp4 layer lands on test-mxfp4; the census is clean (missing 0, C1 0, C2 0,
 *     released 0, nothing retired) and every checkpoint name resolves;
 *   - the repacked bytes read back through the layout give the reference's outputs;
 *   - codes and scales were repacked in their own storage where the tiles are no larger
 *     (and are exactly mxfp4_layout.c's transform of the checkpoint bytes);
 *   - reload W0 -> W1 equals a cold start on W1 byte for byte with every storage address
 *     unchanged, and a second PWAL on transformed bytes is refused naming the tensor.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "mxfp4.h"
#include "mxfp4_fixture.h"
#include "testutil.h"

static char *dir;
static qkeep_plugin *mx, *ref;
static const char *const waves[] = {"32", "64"};

static void setup(void) {
  dir = tu_tmpdir("mxfp4-host");
  ck_assert_ptr_nonnull(dir);
}

static void teardown(void) {
  tu_rmtree(dir);
  free(dir);
}

static char *example(const char *name) {
  char *examples = tu_path(tu_builddir(), "examples"), *path = tu_path(examples, name);
  free(examples);
  return path;
}

static qkeep_model *load(const char *path, bool chain) {
  qkeep_plugin *plugins[] = {mx, ref};
  qkeep_model *m;
  ck_assert_int_eq(chain ? qkeep_model_new_chain(plugins, 2, &m) : qkeep_model_new(ref, &m), 0);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

static void set_wave(int i) {
  const struct qkeep_backend *be = qkeep_plugin_backend(mx);
  ck_assert_int_eq(be->configure(be, "wave", waves[i]), 0);
}

static int check_error(void *user, const struct qkeep_layer_error *e) {
  int *count = user;
  ++*count;
  ck_assert_msg(e->max_rel <= 1e-5, "%s[%d] matrix %d: relative error %g", e->layer, e->expert,
                (int)e->matrix, e->max_rel);
  return 0;
}

/* Every mxfp4 layer on test-mxfp4, the census clean, the outputs the reference's. */
static void assert_loaded(qkeep_model *m, qkeep_model *r) {
  size_t owned = 0;
  for (size_t i = 0; i < qkeep_model_layer_count(m); i++) {
    const qkeep_layer *l = qkeep_model_layer(m, i);
    struct qkeep_layer_info info = {.size = sizeof info};
    ck_assert_int_eq(qkeep_layer_get_info(l, &info), 0);
    bool mx_layer = strcmp(info.scheme, "mxfp4") == 0;
    ck_assert_str_eq(qkeep_layer_backend(l), mx_layer ? "test-mxfp4" : "reference");
    owned += mx_layer;
  }
  ck_assert_uint_gt(owned, 0);
  struct qkeep_census c = tu_assert_census_clean(m);
  ck_assert_int_eq(c.retired, 0);
  int compared = 0;
  ck_assert_msg(qkeep_compare(m, r, 5, 9, check_error, &compared) == 0, "%s", qkeep_errmsg());
  ck_assert_int_gt(compared, 0);
}

/* The storage addresses of a model, in iteration order. */
struct addresses {
  const void **data;
  size_t n, cap;
};

static int remember(void *user, const char *layer, const char *name, const void *data, size_t capacity) {
  (void)layer, (void)name, (void)capacity;
  struct addresses *a = user;
  if (a->n == a->cap) {
    a->cap = a->cap ? 2 * a->cap : 256;
    a->data = realloc(a->data, a->cap * sizeof *a->data);
    ck_assert_ptr_nonnull(a->data);
  }
  a->data[a->n++] = data;
  return 0;
}

static void assert_reload_in_place(const char *w0, const char *w1) {
  qkeep_model *m = load(w0, true), *cold = load(w1, true);
  struct qkeep_digest d0, d1, d;
  ck_assert_int_eq(qkeep_digest(m, &d0), 0);
  ck_assert_int_eq(qkeep_digest(cold, &d1), 0);
  ck_assert(!(d0.hi == d1.hi && d0.lo == d1.lo));
  struct addresses before = {0}, after = {0};
  ck_assert_int_eq(qkeep_foreach_storage(m, remember, &before), 0);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(qkeep_foreach_storage(m, remember, &after), 0);
  ck_assert_uint_eq(before.n, after.n);
  for (size_t i = 0; i < before.n; i++)
    ck_assert_ptr_eq(before.data[i], after.data[i]);
  ck_assert_int_eq(qkeep_digest(m, &d), 0);
  ck_assert_msg(d.hi == d1.hi && d.lo == d1.lo, "reload differs from a cold start");
  struct qkeep_census c = tu_assert_census_clean(m);
  ck_assert_int_eq(c.retired, 0);
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(qkeep_digest(m, &d), 0);
  ck_assert(d.hi == d0.hi && d.lo == d0.lo);
  free(before.data), free(after.data);
  qkeep_model_free(m);
  qkeep_model_free(cold);
}

START_TEST(compressed_tensors_example) {
  set_wave(_i);
  char *w0 = example("tiny-mxfp4"), *w1 = example("tiny-w1-mxfp4");
  qkeep_model *m = load(w0, true), *r = load(w0, false);
  assert_loaded(m, r);
  qkeep_model_free(m);
  qkeep_model_free(r);
  assert_reload_in_place(w0, w1);
  free(w0), free(w1);
}
END_TEST

START_TEST(gptoss_checkpoint) {
  set_wave(_i);
  char *w0 = mxfp4_write_gptoss(dir, "g0", 1), *w1 = mxfp4_write_gptoss(dir, "g1", 2);
  qkeep_model *m = load(w0, true), *r = load(w0, false);
  assert_loaded(m, r);
  qkeep_layer *moe = qkeep_model_find_layer(m, "model.layers.0.mlp.experts");
  ck_assert_ptr_nonnull(moe);
  static const char *const names[][2] = {
      {"gate_up_proj_blocks", "w13_weight"},   {"gate_up_proj_scales", "w13_weight_scale"},
      {"gate_up_proj_bias", "w13_bias"},       {"down_proj_blocks", "w2_weight"},
      {"down_proj_scales", "w2_weight_scale"}, {"down_proj_bias", "w2_bias"}};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    ck_assert_ptr_nonnull(qkeep_param_lookup(moe, names[i][0]));
    ck_assert_ptr_eq(qkeep_param_lookup(moe, names[i][0]), qkeep_param_lookup(moe, names[i][1]));
  }
  /* w13: 192 rows x K 160 pads K to 192 (rebound, larger); the bytes are the twin's transform */
  qkeep_layer *rl = qkeep_model_find_layer(r, "model.layers.0.mlp.experts");
  struct qkeep_view have = {.size = sizeof have}, src = {.size = sizeof src};
  ck_assert_int_eq(qkeep_view_of(moe, "w13_weight", &have), 0);
  ck_assert_int_eq(qkeep_view_of(rl, "w13_weight", &src), 0);
  size_t per = (size_t)mxfp4_code_bytes(192, 160);
  ck_assert_uint_eq(have.nbytes, 3 * per);
  uint8_t *want = malloc(per);
  for (int e = 0; e < 3; e++) {
    mxfp4_tile_codes((const uint8_t *)src.data + (size_t)e * 192 * 80, 192, 160, atoi(waves[_i]), want);
    ck_assert_int_eq(memcmp((const uint8_t *)have.data + (size_t)e * per, want, per), 0);
  }
  free(want);
  qkeep_model_free(m);
  qkeep_model_free(r);
  assert_reload_in_place(w0, w1);
  free(w0), free(w1);
}
END_TEST

/* Aligned shapes (rows % 16 == 0, K % 64 == 0) repack inside the checkpoint's own storage. */
START_TEST(aligned_matrices_repack_in_place) {
  set_wave(_i);
  char *w0 = example("tiny-mxfp4");
  qkeep_model *m = load(w0, true);
  size_t in_place = 0;
  for (size_t i = 0; i < qkeep_model_layer_count(m); i++) {
    qkeep_layer *l = (qkeep_layer *)qkeep_model_layer(m, i);
    struct qkeep_layer_info info = {.size = sizeof info};
    ck_assert_int_eq(qkeep_layer_get_info(l, &info), 0);
    if (strcmp(info.scheme, "mxfp4") != 0 || info.kind != QKEEP_LAYER_LINEAR || info.n % 16 || info.k % 64)
      continue;
    struct qkeep_view w = {.size = sizeof w}, s = {.size = sizeof s};
    ck_assert_int_eq(qkeep_view_of(l, "weight", &w), 0);
    ck_assert_int_eq(qkeep_view_of(l, "weight_scale", &s), 0);
    ck_assert_uint_eq(w.nbytes, (size_t)(info.n * info.k / 2));
    ck_assert_uint_eq(w.capacity, w.nbytes);
    ck_assert_uint_eq(s.nbytes, (size_t)(info.n * info.k / 32));
    ck_assert_int_eq(w.spec.ndim, 3); /* [tiles, chunks, 512]: the kernel layout */
    in_place++;
  }
  ck_assert_uint_gt(in_place, 0);
  qkeep_model_free(m);
  free(w0);
}
END_TEST

static Suite *host_suite(void) {
  Suite *s = suite_create("mxfp4_host");
  TCase *tc = tcase_create("host twins");
  tcase_set_timeout(tc, 300);
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_loop_test(tc, compressed_tensors_example, 0, 2);
  tcase_add_loop_test(tc, gptoss_checkpoint, 0, 2);
  tcase_add_loop_test(tc, aligned_matrices_repack_in_place, 0, 2);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  if (qkeep_plugin_open("test-mxfp4", NULL, &mx) || qkeep_plugin_open("reference", NULL, &ref)) {
    fprintf(stderr, "check_mxfp4_host: %s\n", qkeep_errmsg());
    return 1;
  }
  int rc = tu_run_suite(host_suite(), CK_NORMAL);
  qkeep_plugin_close(mx);
  qkeep_plugin_close(ref);
  return rc;
}
