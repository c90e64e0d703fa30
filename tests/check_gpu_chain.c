/*
 * check_gpu_chain.c: the chain `cuda-nvfp4, cpu-onednn, reference` on a GPU (`make check-gpu`;
 * exits 77 without a device). On the shipped examples of every scheme, each layer lands on
 * the first backend that runs it: NVFP4, unquantized linear layers, norms, embeddings and kv
 * scales, and MXFP4 layers, in GPU memory on cuda-nvfp4; w8a8-int8 layers in host memory on
 * cpu-onednn; GPTQ and AWQ layers on the reference. Across those owners: the census is clean, every
 * GEMM agrees with a reference-only load, and a reload W0 -> W1 equals a cold start on W1
 * (digest) with every storage address unchanged.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "testutil.h"

static qkeep_plugin *gpu, *onednn, *ref;

static char *example(const char *name) {
  char *examples = tu_path(tu_builddir(), "examples"), *path = tu_path(examples, name);
  free(examples);
  return path;
}

/* The whole chain (cpu-onednn left out where it is not built), or the reference alone. */
static qkeep_model *load_chain(const char *path, bool whole_chain) {
  qkeep_plugin *chain[] = {gpu, onednn ? onednn : ref, ref};
  qkeep_model *m;
  ck_assert_int_eq(whole_chain ? qkeep_model_new_chain(chain, onednn ? 3 : 2, &m) : qkeep_model_new(ref, &m),
                   0);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

/* The backend the chain must pick for a layer of this scheme and kind. */
static const char *expected_owner(const char *scheme, enum qkeep_layer_kind kind) {
  if (kind != QKEEP_LAYER_LINEAR && kind != QKEEP_LAYER_MOE)
    return "cuda-nvfp4"; /* norms, embeddings, kv scales live on the GPU */
  if (strstr(scheme, "nvfp4") || strcmp(scheme, "mxfp4") == 0 ||
      (strcmp(scheme, "unquantized") == 0 && kind == QKEEP_LAYER_LINEAR))
    return "cuda-nvfp4";
  if (onednn && (strcmp(scheme, "w8a8-int8") == 0 || strcmp(scheme, "unquantized") == 0))
    return "cpu-onednn";
  return "reference";
}

static int check_error(void *user, const struct qkeep_layer_error *e) {
  (void)user;
  ck_assert_msg(e->max_rel <= 0.05, "%s[%d]: relative error %g", e->layer, e->expert, e->max_rel);
  return 0;
}

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

START_TEST(every_scheme_across_gpu_and_host_owners) {
  static const char *const schemes[] = {"modelopt-nvfp4", "ct-nvfp4", "w8a8-int8",
                                        "gptq-int4",      "awq-int4", "mxfp4"};
  const char *scheme = schemes[_i];
  char name[64];
  snprintf(name, sizeof name, "tiny-%s", scheme);
  char *w0 = example(name);
  snprintf(name, sizeof name, "tiny-w1-%s", scheme);
  char *w1 = example(name);
  qkeep_model *m = load_chain(w0, true), *r = load_chain(w0, false);
  size_t on_gpu = 0, on_host = 0;
  for (size_t i = 0; i < qkeep_model_layer_count(m); i++) {
    const qkeep_layer *l = qkeep_model_layer(m, i);
    struct qkeep_layer_info info = {.size = sizeof info};
    ck_assert_int_eq(qkeep_layer_get_info(l, &info), 0);
    const char *want = expected_owner(info.scheme, info.kind);
    ck_assert_msg(strcmp(qkeep_layer_backend(l), want) == 0, "%s (%s): on %s, expected %s", info.name,
                  info.scheme, qkeep_layer_backend(l), want);
    if (strcmp(want, "cuda-nvfp4") == 0)
      on_gpu++;
    else
      on_host++;
  }
  ck_assert_uint_gt(on_gpu, 0);
  if (!strstr(scheme, "fp4"))
    ck_assert_uint_gt(on_host, 0); /* a model whose layers sit in two memories */
  tu_assert_census_clean(m);
  ck_assert_msg(qkeep_compare(m, r, 5, 3, check_error, NULL) == 0, "%s", qkeep_errmsg());
  /* reload in place across both memories, equal to a cold start on W1 */
  struct addresses before = {0}, after = {0};
  ck_assert_int_eq(qkeep_foreach_storage(m, remember, &before), 0);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(qkeep_foreach_storage(m, remember, &after), 0);
  ck_assert_uint_eq(before.n, after.n);
  for (size_t i = 0; i < before.n; i++)
    ck_assert_ptr_eq(before.data[i], after.data[i]);
  qkeep_model *cold = load_chain(w1, true);
  struct qkeep_digest a, b;
  ck_assert_int_eq(qkeep_digest(m, &a), 0);
  ck_assert_int_eq(qkeep_digest(cold, &b), 0);
  ck_assert_msg(a.hi == b.hi && a.lo == b.lo, "%s: reload differs from a cold start", scheme);
  tu_assert_census_clean(m);
  free(before.data);
  free(after.data);
  qkeep_model_free(cold);
  qkeep_model_free(m);
  qkeep_model_free(r);
  free(w0);
  free(w1);
}
END_TEST

int main(void) {
  char *libs = tu_path(tu_builddir(), "plugins/cuda/.libs"), *path = tu_path(libs, "backend-cuda-nvfp4.so");
  char msg[256] = "";
  int rc = qkeep_plugin_open_path(path, &gpu);
  free(libs);
  free(path);
  if (rc) {
    fprintf(stderr, "check_gpu_chain: cannot open the cuda-nvfp4 plugin: %s\n", qkeep_errmsg());
    return 1;
  }
  rc = qkeep_plugin_probe(gpu, msg, sizeof msg);
  if (rc) {
    printf("SKIP: check_gpu_chain: %s\n", msg);
    qkeep_plugin_close(gpu);
    return rc == QKEEP_E_NODEV ? 77 : 1;
  }
  if (qkeep_plugin_open("cpu-onednn", NULL, &onednn) != 0)
    onednn = NULL; /* not built: the chain is cuda-nvfp4, reference */
  if (qkeep_plugin_open("reference", NULL, &ref)) {
    fprintf(stderr, "check_gpu_chain: %s\n", qkeep_errmsg());
    return 1;
  }
  Suite *s = suite_create("gpu-chain");
  TCase *tc = tcase_create("chain");
  tcase_set_timeout(tc, 300);
  tcase_add_loop_test(tc, every_scheme_across_gpu_and_host_owners, 0, 6);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_set_fork_status(sr, CK_NOFORK); /* CUDA does not survive fork() */
  srunner_run_all(sr, CK_VERBOSE);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  qkeep_plugin_close(ref);
  qkeep_plugin_close(onednn);
  qkeep_plugin_close(gpu);
  return failed ? 1 : 0;
}
