/*
 * gpu_testutil.h: the small Llama-shaped source model that the GPU suites
 * (check_gpu_nvfp4, check_gpu_mxfp4) quantize and load: two decoder layers (the
 * first with attention biases and a dense MLP, the second with an MoE block),
 * embedding, norm and lm_head, f32, weights uniform from a seed and each tensor's
 * name. Header-only (static inline): each suite includes it once.
 */
#ifndef QKEEP_TESTS_GPU_TESTUTIL_H
#define QKEEP_TESTS_GPU_TESTUTIL_H

#include <check.h>
#include <stdio.h>
#include <stdlib.h>

#include "checkutil.h"
#include "private.h"
#include "testutil.h"

/* The model's sizes: hidden, k/v rows, MLP intermediate, expert intermediate, experts, vocabulary. */
struct gtu_model {
  int64_t hidden, kv, inter, expert_inter, experts, vocab;
};

/* A [rows, cols] matrix of uniform values in [-scale, scale), from the name and seed (malloc'd). */
static inline float *gtu_random_matrix(const char *name, int64_t rows, int64_t cols, uint64_t seed,
                                       float scale) {
  float *v = malloc((size_t)(rows * cols) * sizeof *v);
  ck_assert_ptr_nonnull(v);
  uint64_t s = seed;
  for (const char *p = name; *p; p++)
    s = s * 31 + (unsigned char)*p;
  for (int64_t i = 0; i < rows * cols; i++)
    v[i] = tu_randf(&s) * scale;
  return v;
}

/* Adds tensor `name`: a random [rows, cols] matrix, or with cols 0 a vector of ones (a norm). */
static inline void gtu_add(struct st_writer *w, const char *name, int64_t rows, int64_t cols, uint64_t seed,
                           float scale) {
  float *v = gtu_random_matrix(name, rows, cols ? cols : 1, seed, scale);
  for (int64_t i = 0; !cols && i < rows; i++)
    v[i] = 1.0f;
  struct qkeep_spec sp = {QKEEP_DTYPE_F32, cols ? 2 : 1, {rows, cols}};
  ck_assert_int_eq(st_writer_add(w, name, &sp, v), 0);
  free(v);
}

/* Adds a bias vector [n] in [-0.5, 0.5). */
static inline void gtu_add_bias(struct st_writer *w, const char *name, int64_t n, uint64_t seed) {
  float *v = malloc((size_t)n * sizeof *v);
  ck_assert_ptr_nonnull(v);
  uint64_t s = seed * 7 + (uint64_t)n;
  for (int64_t i = 0; i < n; i++)
    v[i] = tu_randf(&s) * 0.5f;
  struct qkeep_spec sp = {QKEEP_DTYPE_F32, 1, {n}};
  ck_assert_int_eq(st_writer_add(w, name, &sp, v), 0);
  free(v);
}

/* Writes the model as dir/file (weights from seed); returns the malloc'd path. */
static inline char *gtu_write_source(const char *dir, const char *file, uint64_t seed,
                                     const struct gtu_model *m) {
  struct st_writer *w;
  char name[160];
  const int64_t h = m->hidden;
  ck_assert_int_eq(st_writer_new(&w), 0);
  gtu_add(w, "model.embed_tokens.weight", m->vocab, h, seed, 0.25f);
  gtu_add(w, "lm_head.weight", m->vocab, h, seed, 0.25f);
  gtu_add(w, "model.norm.weight", h, 0, seed, 1);
  static const char *const proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  const int64_t rows[] = {h, m->kv, m->kv, h};
  for (int l = 0; l < 2; l++) {
    for (int p = 0; p < 4; p++) {
      snprintf(name, sizeof name, "model.layers.%d.self_attn.%s.weight", l, proj[p]);
      /* One projection with a large range, so block scales spread widely. */
      gtu_add(w, name, rows[p], h, seed, p == 3 && l == 1 ? 40.0f : 0.25f);
      if (l == 0) {
        snprintf(name, sizeof name, "model.layers.0.self_attn.%s.bias", proj[p]);
        gtu_add_bias(w, name, rows[p], seed + (uint64_t)p);
      }
    }
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
    gtu_add(w, name, h, 0, seed, 1);
  }
  gtu_add(w, "model.layers.0.mlp.gate_proj.weight", m->inter, h, seed, 0.25f);
  gtu_add(w, "model.layers.0.mlp.up_proj.weight", m->inter, h, seed, 0.25f);
  gtu_add(w, "model.layers.0.mlp.down_proj.weight", h, m->inter, seed, 0.25f);
  gtu_add(w, "model.layers.1.mlp.gate.weight", m->experts, h, seed, 0.25f);
  for (int64_t e = 0; e < m->experts; e++) {
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%lld.gate_proj.weight", (long long)e);
    gtu_add(w, name, m->expert_inter, h, seed, 0.25f);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%lld.up_proj.weight", (long long)e);
    gtu_add(w, name, m->expert_inter, h, seed, 0.25f);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%lld.down_proj.weight", (long long)e);
    gtu_add(w, name, h, m->expert_inter, seed, 0.25f);
  }
  char *path = tu_path(dir, file);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  return path;
}

/* A model of one plugin loaded from path (with a fusion setting, or NULL for the default). */
static inline qkeep_model *gtu_load(qkeep_plugin *plugin, const char *path, const char *fusion) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  if (fusion)
    ck_assert_int_eq(qkeep_model_set_fusion(m, fusion), 0);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

static inline struct qkeep_digest gtu_digest(qkeep_model *m) {
  struct qkeep_digest d;
  ck_assert_int_eq(qkeep_digest(m, &d), 0);
  return d;
}

/* The worst layer of a forward check (qkeep_compare's callback state). */
struct gtu_worst {
  double max_rel;
  char where[200];
  int layers;
};

static inline int gtu_record(void *user, const struct qkeep_layer_error *e) {
  struct gtu_worst *w = user;
  w->layers++;
  if (!(e->max_rel <= w->max_rel)) { /* NaN counts as the worst */
    w->max_rel = e->max_rel;
    snprintf(w->where, sizeof w->where, "%s expert %d matrix %d m %lld n %lld k %lld", e->layer, e->expert,
             (int)e->matrix, (long long)e->m, (long long)e->n, (long long)e->k);
  }
  return 0;
}

/* Every layer of m agrees with the reference model r on `tokens` random tokens within tolerance. */
static inline void gtu_assert_agrees(qkeep_model *m, qkeep_model *r, int64_t tokens, const char *what,
                                     double tolerance) {
  struct gtu_worst w = {0};
  ck_assert_msg(qkeep_compare(m, r, tokens, 42 + (uint64_t)tokens, gtu_record, &w) == 0, "%s",
                qkeep_errmsg());
  ck_assert_int_gt(w.layers, 0);
  ck_assert_msg(w.max_rel <= tolerance, "%s, m %lld: max relative error %g at %s", what, (long long)tokens,
                w.max_rel, w.where);
}

/*
 * The main of a GPU suite: opens the build tree's cuda-nvfp4 plugin into *gpu (its probe's answer
 * printed; no device: SKIP, exit 77) and the reference backend into *ref, runs the suite in this
 * process (CUDA does not survive fork()), closes both. Returns the exit status.
 */
static inline int gtu_main(const char *prog, Suite *(*suite)(void), qkeep_plugin **gpu, qkeep_plugin **ref) {
  char *libs = tu_path(tu_builddir(), "plugins/cuda/.libs"), *path = tu_path(libs, "backend-cuda-nvfp4.so"),
       msg[256] = "";
  free(libs);
  int rc = qkeep_plugin_open_path(path, gpu);
  free(path);
  if (rc) {
    fprintf(stderr, "%s: cannot open the cuda-nvfp4 plugin: %s\n", prog, qkeep_errmsg());
    return 1;
  }
  if ((rc = qkeep_plugin_probe(*gpu, msg, sizeof msg))) { /* no device, no test: 77 is automake's SKIP */
    printf("SKIP: %s: %s\n", prog, msg);
    qkeep_plugin_close(*gpu);
    return rc == QKEEP_E_NODEV ? 77 : 1;
  }
  printf("%s: %s\n", prog, msg);
  if (qkeep_plugin_open("reference", NULL, ref)) {
    fprintf(stderr, "%s: %s\n", prog, qkeep_errmsg());
    qkeep_plugin_close(*gpu);
    return 1;
  }
  SRunner *sr = srunner_create(suite());
  srunner_set_fork_status(sr, CK_NOFORK);
  srunner_run_all(sr, CK_VERBOSE);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  qkeep_plugin_close(*ref);
  qkeep_plugin_close(*gpu);
  return failed ? 1 : 0;
}

#endif
