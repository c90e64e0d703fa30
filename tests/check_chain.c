/*
 * check_chain.c: models whose layers run on different backends of a chain. Each layer goes
 * to the first backend that takes it; the census, the per-layer owner report, the forward
 * check and a reload (byte-identical to a cold start, no pointer moved) hold across owners;
 * a layer no backend takes fails the load before anything is allocated; an ABI 1.0 plugin
 * still takes part; a tied lm_head stays with its embedding.
 *
 * Chain members: test-picky (ABI 1.1, takes the unquantized linear layers named by its
 * `take` key), test-legacy (an ABI 1.0 table), test-nodev (no device), cpu-onednn when
 * built, and reference; cpu-zentorch, when built, answers the ABI 1.0 check with the others.
 */
#include <check.h>
#include <dirent.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckptutil.h"
#include "fixture.h"
#include "private.h"
#include "testutil.h"

#define H 64
#define I 128

static void add(struct st_writer *w, const char *name, enum qkeep_dtype dtype, int64_t rows, int64_t cols,
                uint64_t seed) {
  size_t n = (size_t)(rows * (cols ? cols : 1));
  float *v = tu_source_values(name, rows, cols, seed);
  uint16_t *h = malloc(n * sizeof *h);
  for (size_t i = 0; i < n; i++) {
    uint32_t bits;
    memcpy(&bits, &v[i], sizeof bits);
    h[i] = (uint16_t)(bits >> 16); /* bf16 by truncation: exact enough for test weights */
  }
  struct qkeep_spec sp = {dtype, cols ? 2 : 1, {rows, cols}};
  ck_assert_int_eq(st_writer_add(w, name, &sp, dtype == QKEEP_DTYPE_F32 ? (const void *)v : (const void *)h),
                   0);
  free(v);
  free(h);
}

/* An unquantized model: embedding, norm, attention and MLP (fused when loaded), an MoE block
 * with its router, and an lm_head (absent when tied). Weights from `seed`. */
static char *write_source(const char *file, uint64_t seed, bool tied, enum qkeep_dtype lm_head_dtype) {
  struct st_writer *w;
  char name[160];
  const enum qkeep_dtype bf16 = QKEEP_DTYPE_BF16;
  ck_assert_int_eq(st_writer_new(&w), 0);
  add(w, "model.embed_tokens.weight", bf16, 96, H, seed);
  add(w, "model.norm.weight", bf16, H, 0, seed);
  if (!tied)
    add(w, "lm_head.weight", lm_head_dtype, 96, H, seed);
  static const char *const proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  for (int p = 0; p < 4; p++) {
    snprintf(name, sizeof name, "model.layers.0.self_attn.%s.weight", proj[p]);
    add(w, name, bf16, p == 1 || p == 2 ? 32 : H, H, seed);
  }
  add(w, "model.layers.0.mlp.gate_proj.weight", bf16, I, H, seed);
  add(w, "model.layers.0.mlp.up_proj.weight", bf16, I, H, seed);
  add(w, "model.layers.0.mlp.down_proj.weight", bf16, H, I, seed);
  add(w, "model.layers.1.mlp.gate.weight", bf16, 2, H, seed);
  for (int e = 0; e < 2; e++) {
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.gate_proj.weight", e);
    add(w, name, bf16, H, H, seed);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.up_proj.weight", e);
    add(w, name, bf16, H, H, seed);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.down_proj.weight", e);
    add(w, name, bf16, H, H, seed);
  }
  char *path;
  if (tied) { /* a directory: config.json says the lm_head is the embedding */
    char *sub = tu_path(dir, file);
    ck_assert_int_eq(mkdir(sub, 0755), 0);
    char *cfg = tu_path(sub, "config.json");
    const char *text = "{\"model_type\": \"llama\", \"tie_word_embeddings\": true}";
    ck_assert_int_eq(tu_write_file(cfg, text, strlen(text)), 0);
    free(cfg);
    path = tu_path(sub, "model.safetensors");
    ck_assert_int_eq(st_writer_write(w, path), 0);
    free(path);
    path = sub;
  } else {
    path = tu_path(dir, file);
    ck_assert_int_eq(st_writer_write(w, path), 0);
  }
  st_writer_free(w);
  return path;
}

static char *quantize(const char *source, const char *scheme, const char *out) {
  char *path = tu_path(dir, out);
  struct qkeep_quantize_options o = {
      .size = sizeof o, .scheme = scheme, .group_size = 32, .kv_cache_scales = true, .activation_amax = 4};
  ck_assert_msg(qkeep_quantize(source, path, &o) == 0, "%s: %s", scheme, qkeep_errmsg());
  return path;
}

/* ---- the chain's plugins ---------------------------------------------------------------------- */

static qkeep_plugin *picky, *legacy, *nodev, *onednn, *zentorch; /* NULL where not built */

static void chain_setup(void) {
  fixture_name = "chain";
  setup();
  ck_assert_msg(qkeep_plugin_open("test-picky", NULL, &picky) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_plugin_open("test-legacy", NULL, &legacy) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_plugin_open("test-nodev", NULL, &nodev) == 0, "%s", qkeep_errmsg());
  if (qkeep_plugin_open("cpu-onednn", NULL, &onednn) != 0)
    onednn = NULL;
  if (qkeep_plugin_open("cpu-zentorch", NULL, &zentorch) != 0)
    zentorch = NULL;
}

static void chain_teardown(void) {
  qkeep_plugin_close(picky);
  qkeep_plugin_close(legacy);
  qkeep_plugin_close(nodev);
  qkeep_plugin_close(onednn);
  qkeep_plugin_close(zentorch);
  picky = legacy = nodev = onednn = zentorch = NULL;
  teardown();
}

static void take(const char *value) {
  const struct qkeep_backend *be = qkeep_plugin_backend(picky);
  ck_assert_int_eq(be->configure(be, "take", value), 0);
}

/* The stream's shape load_chain gives each model (all zero: the defaults; see use_ring). */
static struct qkeep_load_options ring_shape;

static qkeep_model *load_chain(qkeep_plugin *const *chain, size_t n, const char *path) {
  qkeep_model *m;
  ck_assert_msg(qkeep_model_new_chain(chain, n, &m) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_model_set_load_options(m, &ring_shape) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

static const char *owner(const qkeep_model *m, const char *layer) {
  const qkeep_layer *l = qkeep_model_find_layer(m, layer);
  ck_assert_msg(l != NULL, "no layer %s", layer);
  const char *name = qkeep_layer_backend(l);
  ck_assert_msg(name != NULL, "layer %s has no owner", layer);
  return name;
}

/* The link counts add up to the layers, and each equals the layers that name it as owner. */
static void assert_counts_match(const qkeep_model *m) {
  size_t total = 0;
  for (size_t i = 0; i < qkeep_model_backend_count(m); i++) {
    struct qkeep_chain_info b = {.size = sizeof b};
    ck_assert_int_eq(qkeep_model_backend_info(m, i, &b), 0);
    size_t owned = 0;
    for (size_t l = 0; l < qkeep_model_layer_count(m); l++) {
      const char *o = qkeep_layer_backend(qkeep_model_layer(m, l));
      owned += o && strcmp(o, b.name) == 0;
    }
    ck_assert_uint_eq(owned, b.layers);
    total += b.layers;
  }
  ck_assert_uint_eq(total, qkeep_model_layer_count(m));
}

static int check_error(void *user, const struct qkeep_layer_error *e) {
  double tolerance = *(const double *)user;
  ck_assert_msg(e->max_rel <= tolerance, "%s[%d]: relative error %g over %g", e->layer, e->expert, e->max_rel,
                tolerance);
  return 0;
}

/* Every GEMM of m against a reference-only cold start of the same checkpoint. */
static void forward_check(qkeep_model *m, const char *path, double tolerance) {
  qkeep_model *ref = load(path);
  ck_assert_msg(qkeep_compare(m, ref, 3, 7, check_error, &tolerance) == 0, "%s", qkeep_errmsg());
  qkeep_model_free(ref);
}

static int d2h(void *dst, const void *src, size_t n) {
  memcpy(dst, src, n);
  return 0;
}

/* Reload W0 -> W1 on the chain equals a cold start on W1 there, storage by storage, in place. */
static void reload_in_place(qkeep_plugin *const *chain, size_t n, const char *w0, const char *w1) {
  qkeep_model *m = load_chain(chain, n, w0), *cold = load_chain(chain, n, w1);
  struct tu_storages before = {.to_host = d2h}, after = {.to_host = d2h}, want = {.to_host = d2h};
  tu_snapshot(m, &before);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  tu_snapshot(m, &after);
  tu_snapshot(cold, &want);
  tu_assert_in_place_and_equal(&before, &after, &want);
  struct qkeep_digest a, b;
  ck_assert_int_eq(qkeep_digest(m, &a), 0);
  ck_assert_int_eq(qkeep_digest(cold, &b), 0);
  ck_assert(a.hi == b.hi && a.lo == b.lo);
  for (size_t l = 0; l < qkeep_model_layer_count(m); l++) /* the same owners as a cold start */
    ck_assert_str_eq(qkeep_layer_backend(qkeep_model_layer(m, l)),
                     qkeep_layer_backend(qkeep_model_layer(cold, l)));
  tu_assert_census_clean(m);
  tu_release_snapshot(&before);
  tu_release_snapshot(&after);
  tu_release_snapshot(&want);
  qkeep_model_free(m);
  qkeep_model_free(cold);
}

/* ---- tests -------------------------------------------------------------------------------------- */

START_TEST(each_layer_runs_on_the_first_backend_that_takes_it) {
  char *src = write_source("w0.safetensors", 1, false, QKEEP_DTYPE_BF16);
  char *src1 = write_source("w1.safetensors", 2, false, QKEEP_DTYPE_BF16);
  char *w0 = quantize(src, "w8a8-int8", "w0-int8"), *w1 = quantize(src1, "w8a8-int8", "w1-int8");
  take("lm_head");
  qkeep_plugin *chain[] = {picky, onednn ? onednn : plugin, plugin};
  size_t n = onednn ? 3 : 2;
  qkeep_model *m = load_chain(chain, n, w0);
  const char *second = onednn ? "cpu-onednn" : "reference";
  ck_assert_str_eq(owner(m, "lm_head"), "test-picky");                /* named by take */
  ck_assert_str_eq(owner(m, "model.layers.1.mlp.gate"), second);      /* unquantized, not named */
  ck_assert_str_eq(owner(m, "model.layers.0.mlp.down_proj"), second); /* w8a8 */
  ck_assert_str_eq(owner(m, "model.layers.1.mlp.experts"), second);
  /* test-picky refuses what is not linear; the next link takes norms and embeddings */
  ck_assert_str_eq(owner(m, "model.norm"), second);
  ck_assert_str_eq(owner(m, "model.embed_tokens"), second);
  assert_counts_match(m);
  struct qkeep_chain_info b = {.size = sizeof b};
  ck_assert_int_eq(qkeep_model_backend_info(m, 0, &b), 0);
  ck_assert_str_eq(b.name, "test-picky");
  ck_assert(b.usable);
  ck_assert_uint_eq(b.layers, 1);
  tu_assert_census_clean(m);
  forward_check(m, w0, 0.05);
  qkeep_model_free(m);
  reload_in_place(chain, n, w0, w1);
  free(src), free(src1), free(w0), free(w1);
}
END_TEST

/* NVFP4 layers fall through to the reference while the unquantized ones stay on cpu-onednn. */
START_TEST(nvfp4_on_the_reference_and_the_rest_on_onednn) {
  if (!onednn)
    return; /* cpu-onednn is not built here; the other tests cover the chain */
  char *src = write_source("w0.safetensors", 3, false, QKEEP_DTYPE_BF16);
  char *src1 = write_source("w1.safetensors", 4, false, QKEEP_DTYPE_BF16);
  char *w0 = quantize(src, "modelopt-nvfp4", "w0-nvfp4"), *w1 = quantize(src1, "modelopt-nvfp4", "w1-nvfp4");
  qkeep_plugin *chain[] = {onednn, plugin};
  qkeep_model *m = load_chain(chain, 2, w0);
  ck_assert_str_eq(owner(m, "model.layers.0.self_attn.qkv_proj"), "reference");
  ck_assert_str_eq(owner(m, "model.layers.1.mlp.experts"), "reference");
  ck_assert_str_eq(owner(m, "lm_head"), "cpu-onednn");
  ck_assert_str_eq(owner(m, "model.layers.1.mlp.gate"), "cpu-onednn");
  assert_counts_match(m);
  tu_assert_census_clean(m);
  forward_check(m, w0, 0.05);
  qkeep_model_free(m);
  reload_in_place(chain, 2, w0, w1);
  /* in-memory weights (RL sync) across owners: every tensor of W1 as named host buffers */
  m = load_chain(chain, 2, w0);
  qkeep_model *cold = load_chain(chain, 2, w1);
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(w1, &ck), 0);
  struct qkeep_named_tensor *t = calloc(ck->n_tensors, sizeof *t);
  for (size_t i = 0; i < ck->n_tensors; i++) {
    const struct st_tensor *st = ck->tensors[i].t;
    void *bytes = malloc(st->nbytes ? st->nbytes : 1);
    ck_assert_int_eq(ckpt_read(ck, &ck->tensors[i], bytes), 0);
    t[i] = (struct qkeep_named_tensor){.name = st->name, .data = bytes};
    t[i].spec = (struct qkeep_spec){(enum qkeep_dtype)st->dtype, st->ndim, {0}};
    memcpy(t[i].spec.shape, st->shape, sizeof t[i].spec.shape);
  }
  ck_assert_msg(qkeep_model_reload_tensors(m, t, ck->n_tensors, 0) == 0, "%s", qkeep_errmsg());
  struct qkeep_digest a, b;
  ck_assert_int_eq(qkeep_digest(m, &a), 0);
  ck_assert_int_eq(qkeep_digest(cold, &b), 0);
  ck_assert(a.hi == b.hi && a.lo == b.lo);
  for (size_t i = 0; i < ck->n_tensors; i++)
    free((void *)t[i].data);
  free(t);
  ckpt_close(ck);
  qkeep_model_free(m);
  qkeep_model_free(cold);
  free(src), free(src1), free(w0), free(w1);
}
END_TEST

START_TEST(an_abi_1_0_plugin_takes_part_in_a_chain) {
  const struct qkeep_backend *be = qkeep_plugin_backend(legacy);
  ck_assert_uint_eq(be->size, offsetof(struct qkeep_backend, fini) + sizeof be->fini);
  ck_assert_uint_eq(be->abi_minor, 0);
  char *src = write_source("w0.safetensors", 5, false, QKEEP_DTYPE_BF16);
  char *src1 = write_source("w1.safetensors", 6, false, QKEEP_DTYPE_BF16);
  char *w0 = quantize(src, "ct-nvfp4", "w0-ct"), *w1 = quantize(src1, "ct-nvfp4", "w1-ct");
  qkeep_plugin *chain[] = {legacy, plugin};
  qkeep_model *m = load_chain(chain, 2, w0);
  /* supports() says no to NVFP4 linear and MoE layers; every other layer is its, as in ABI 1.0 */
  ck_assert_str_eq(owner(m, "model.layers.0.mlp.gate_up_proj"), "reference");
  ck_assert_str_eq(owner(m, "model.layers.1.mlp.experts"), "reference");
  ck_assert_str_eq(owner(m, "lm_head"), "test-legacy");
  ck_assert_str_eq(owner(m, "model.norm"), "test-legacy");
  ck_assert_str_eq(owner(m, "model.layers.0.self_attn.attn"), "test-legacy"); /* kv scales */
  assert_counts_match(m);
  tu_assert_census_clean(m);
  forward_check(m, w0, 1e-5); /* test-legacy's f32 kernel against the reference's */
  qkeep_model_free(m);
  reload_in_place(chain, 2, w0, w1);
  free(src), free(src1), free(w0), free(w1);
}
END_TEST

/* A checkpoint whose linear weight spans several pinned staging chunks (4 MiB each). */
static char *write_large(const char *file, uint64_t seed) {
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  add(w, "model.norm.weight", QKEEP_DTYPE_BF16, 2048, 0, seed);
  add(w, "model.layers.0.mlp.down_proj.weight", QKEEP_DTYPE_F32, 1536, 2048, seed); /* 12 MiB */
  char *path = tu_path(dir, file);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  return path;
}

/* Two linears of 12 MiB each: the second is larger than what a read ahead takes (7 slots of 1 MiB). */
static char *write_two_large(const char *file, uint64_t seed) {
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  add(w, "model.layers.0.mlp.down_proj.weight", QKEEP_DTYPE_F32, 1536, 2048, seed);
  add(w, "model.layers.0.self_attn.o_proj.weight", QKEEP_DTYPE_F32, 1536, 2048, seed);
  char *path = tu_path(dir, file);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  return path;
}

static void assert_digest(qkeep_model *m, const char *path) {
  qkeep_model *ref = load(path);
  struct qkeep_digest a, b;
  ck_assert_int_eq(qkeep_digest(m, &a), 0);
  ck_assert_int_eq(qkeep_digest(ref, &b), 0);
  ck_assert_msg(a.hi == b.hi && a.lo == b.lo, "the device holds other bytes than the reference loaded");
  qkeep_model_free(ref);
}

/* Truncates the file named by user after the first layer arrived (once). */
static void shrink_after_first(void *user, size_t done, size_t total, const char *layer) {
  (void)total, (void)layer;
  if (done == 1)
    ck_assert_int_eq(truncate(user, 4096), 0);
}

/* The stream's ring for loop index i: 0 the default (32 slots of 2 MiB, readers per core); 1 three
 * slots of 4 KiB and three readers, so that every tensor wraps the ring many times and each piece
 * waits for a copy fence (test-async completes only the copies before the fence waited on). Returns
 * the ring's bytes. */
static long long use_ring(int i) {
  if (i == 0) {
    ring_shape = (struct qkeep_load_options){0};
    return 64 << 20;
  }
  ring_shape = (struct qkeep_load_options){
      .size = sizeof ring_shape, .stream_slots = 3, .stream_piece = 4096, .stream_readers = 3};
  return 3 * 4096;
}

/* test-async completes its copies only at sync or a copy fence: a chunk refilled or freed before the
 * core waits for its copy shows up as other bytes than a reference load holds (or an abort in
 * host_free). */
START_TEST(a_device_with_async_copies_loads_through_pinned_chunks) {
  long long ring = use_ring(_i);
  qkeep_plugin *async;
  ck_assert_msg(qkeep_plugin_open("test-async", NULL, &async) == 0, "%s", qkeep_errmsg());
  char *w0 = write_large("large-w0.safetensors", 11), *w1 = write_large("large-w1.safetensors", 12);
  qkeep_plugin *chain[] = {async};
  qkeep_model *m = load_chain(chain, 1, w0);
  ck_assert_str_eq(owner(m, "model.layers.0.mlp.down_proj"), "test-async");
  struct qkeep_memory_stats mem = {.size = sizeof mem};
  ck_assert_int_eq(qkeep_model_memory(m, &mem, true), 0);
  ck_assert_int_ge(mem.staging_peak, ring);              /* the pinned ring */
  ck_assert_int_eq(mem.pinned_bytes, ring);              /* kept for the next load */
  ck_assert_int_lt(mem.staging_peak, ring + (12 << 20)); /* not the whole 12 MiB tensor as well */
  assert_digest(m, w0);
  forward_check(m, w0, 1e-5);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  assert_digest(m, w1);
  ck_assert_int_eq(qkeep_model_memory(m, &mem, false), 0);
  ck_assert_int_lt(mem.staging_peak, ring + (12 << 20));
  /* W0 again from host buffers (RL weight sync): copied into the pinned chunks, then to the device */
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(w0, &ck), 0);
  struct qkeep_named_tensor ts[2];
  void *bytes[2];
  ck_assert_uint_eq(ck->n_tensors, 2);
  for (size_t i = 0; i < 2; i++) {
    const struct st_tensor *t = ck->tensors[i].t;
    bytes[i] = malloc((size_t)t->nbytes);
    ck_assert_int_eq(ckpt_read(ck, &ck->tensors[i], bytes[i]), 0);
    ts[i] = (struct qkeep_named_tensor){.name = t->name, .data = bytes[i], .on_device = false};
    ts[i].spec = (struct qkeep_spec){.dtype = (enum qkeep_dtype)t->dtype, .ndim = t->ndim};
    memcpy(ts[i].spec.shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
  }
  ck_assert_msg(qkeep_model_reload_tensors(m, ts, 2, 0) == 0, "%s", qkeep_errmsg());
  assert_digest(m, w0);
  /* A read that fails in a reader thread fails the load with the reader's message (the file shrinks
   * once the first layer is in, with the second read ahead only in part). */
  char *w2 = write_two_large("large-w2.safetensors", 13);
  qkeep_model *c;
  ck_assert_int_eq(qkeep_model_new_chain(chain, 1, &c), 0);
  /* a ring far smaller than the second layer, whatever the default: it cannot all be read ahead before
   * the file shrinks (the default 64 MiB ring once read all of it, and the load failed later, on the
   * file's changed identity) */
  struct qkeep_load_options small = {
      .size = sizeof small, .stream_slots = 3, .stream_piece = 4096, .stream_readers = 3};
  ck_assert_int_eq(qkeep_model_set_load_options(c, &small), 0);
  qkeep_model_set_progress(c, shrink_after_first, w2);
  ck_assert_int_eq(qkeep_model_load(c, w2), QKEEP_E_IO);
  ck_assert_msg(strstr(qkeep_errmsg(), "tensor 'model.") && strstr(qkeep_errmsg(), "large-w2"), "%s",
                qkeep_errmsg());
  ck_assert_uint_eq(qkeep_model_layer_count(c), 0);
  qkeep_model_free(c);
  free(w2);
  ckpt_close(ck);
  free(bytes[0]), free(bytes[1]);
  qkeep_model_free(m);
  reload_in_place(chain, 1, w0, w1);
  qkeep_plugin_close(async);
  free(w0), free(w1);
  use_ring(0);
}
END_TEST

/* The ring's bytes the model keeps for its next load. */
static int64_t pinned(qkeep_model *m) {
  struct qkeep_memory_stats mem = {.size = sizeof mem};
  ck_assert_int_eq(qkeep_model_memory(m, &mem, false), 0);
  return mem.pinned_bytes;
}

/* A stream shape out of range is refused when it is set, naming the field, and the model keeps the
 * shape it had; a shorter (older) struct is read only as far as its size; a new shape frees the ring
 * of the old one, and the next load makes it anew. */
/* The threads of this process now (/proc/self/task). */
static int threads_now(void) {
  DIR *d = opendir("/proc/self/task");
  int n = 0;
  for (struct dirent *e; d && (e = readdir(d));)
    n += e->d_name[0] != '.';
  if (d)
    closedir(d);
  return n;
}

/* The stream's reader threads start with the model's first load, serve every reload after it (none
 * started or left behind per load), and stop when the model is freed. */
START_TEST(the_readers_serve_every_reload_and_stop_with_the_model) {
  use_ring(1); /* three readers */
  qkeep_plugin *async;
  ck_assert_msg(qkeep_plugin_open("test-async", NULL, &async) == 0, "%s", qkeep_errmsg());
  char *w0 = write_large("large-w0.safetensors", 11), *w1 = write_large("large-w1.safetensors", 12);
  qkeep_plugin *chain[] = {async};
  int before = threads_now();
  ck_assert_int_gt(before, 0);
  qkeep_model *m = load_chain(chain, 1, w0);
  ck_assert_int_eq(threads_now(), before + 3);
  for (int i = 0; i < 3; i++) {
    ck_assert_msg(qkeep_model_reload(m, i % 2 ? w0 : w1, 0) == 0, "%s", qkeep_errmsg());
    ck_assert_int_eq(threads_now(), before + 3);
  }
  assert_digest(m, w1);
  qkeep_model_free(m);
  ck_assert_int_eq(threads_now(), before);
  qkeep_plugin_close(async);
  free(w0), free(w1);
}
END_TEST

START_TEST(load_options_are_checked_field_by_field_and_take_effect_at_the_next_load) {
  qkeep_plugin *async;
  ck_assert_msg(qkeep_plugin_open("test-async", NULL, &async) == 0, "%s", qkeep_errmsg());
  char *w0 = write_large("large-w0.safetensors", 11);
  qkeep_plugin *chain[] = {async};
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new_chain(chain, 1, &m), 0);
  struct qkeep_load_options good = {
      .size = sizeof good, .stream_slots = 3, .stream_piece = 4096, .stream_readers = 3};
  ck_assert_msg(qkeep_model_set_load_options(m, &good) == 0, "%s", qkeep_errmsg());
  static const struct {
    struct qkeep_load_options o;
    const char *says;
  } bad[] = {
      {{.stream_slots = 1}, "stream_slots = 1: expected 2 to 128"},
      {{.stream_slots = 129}, "stream_slots = 129"},
      {{.stream_slots = -2}, "stream_slots = -2"},
      {{.stream_piece = 4095}, "stream_piece = 4095: expected 4096 to 67108864 bytes"},
      {{.stream_piece = ((size_t)64 << 20) + 1}, "stream_piece = 67108865"},
      {{.stream_readers = -1}, "stream_readers = -1: expected 1 to 64"},
      {{.stream_readers = 65}, "stream_readers = 65"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct qkeep_load_options o = bad[i].o;
    o.size = sizeof o;
    ck_assert_int_eq(qkeep_model_set_load_options(m, &o), QKEEP_E_INVAL);
    ck_assert_msg(strstr(qkeep_errmsg(), bad[i].says), "%s", qkeep_errmsg());
  }
  ck_assert_int_eq(qkeep_model_set_load_options(m, NULL), QKEEP_E_INVAL);
  ck_assert_int_eq(qkeep_model_set_load_options(NULL, &good), QKEEP_E_INVAL);
  ck_assert_msg(qkeep_model_load(m, w0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(pinned(m), 3 * 4096); /* the good shape still holds */
  assert_digest(m, w0);
  /* The same shape again keeps the ring; a caller that knows only stream_slots sets 4 slots, and
   * what lies past its size (a bad piece here) is not read: the piece is the default. */
  ck_assert_int_eq(qkeep_model_set_load_options(m, &good), 0);
  ck_assert_int_eq(pinned(m), 3 * 4096);
  struct qkeep_load_options older = {
      .size = offsetof(struct qkeep_load_options, stream_piece), .stream_slots = 4, .stream_piece = 1};
  ck_assert_msg(qkeep_model_set_load_options(m, &older) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(pinned(m), 0); /* the 3-slot ring is gone */
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(pinned(m), 4 * (2 << 20));
  assert_digest(m, w0);
  qkeep_model_free(m);
  qkeep_plugin_close(async);
  free(w0);
}
END_TEST

/* Lines the logger got, by kind. */
struct log_seen {
  int stream_lines, other_debug;
  enum qkeep_log_level stream_level;
  char stream_line[2048];
};

static void keep_log(void *user, enum qkeep_log_level level, const char *msg) {
  struct log_seen *seen = user;
  if (strncmp(msg, "qkeep stream: ", 14) == 0) {
    seen->stream_lines++, seen->stream_level = level;
    snprintf(seen->stream_line, sizeof seen->stream_line, "%s", msg);
  } else if (level == QKEEP_LOG_DEBUG) {
    seen->other_debug++;
  }
}

/* The stream's trace goes to the logger at QKEEP_LOG_DEBUG, one line per load, and only when the
 * level asks for it (the library never prints). */
START_TEST(a_streaming_load_logs_its_trace_at_debug_level) {
  qkeep_plugin *async;
  ck_assert_msg(qkeep_plugin_open("test-async", NULL, &async) == 0, "%s", qkeep_errmsg());
  char *w0 = write_large("large-w0.safetensors", 11);
  struct log_seen seen = {0};
  qkeep_set_logger(keep_log, &seen);
  use_ring(1);
  qkeep_plugin *chain[] = {async};
  qkeep_model *m = load_chain(chain, 1, w0); /* the default level: no trace */
  ck_assert_int_eq(seen.stream_lines, 0);
  qkeep_set_log_level(QKEEP_LOG_DEBUG);
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(seen.stream_lines, 1);
  ck_assert_int_eq(seen.stream_level, QKEEP_LOG_DEBUG);
  ck_assert_msg(strstr(seen.stream_line, "pieces") && strstr(seen.stream_line, "3 slots of 4096 bytes") &&
                    strstr(seen.stream_line, "fences on") && strstr(seen.stream_line, "groups read in") &&
                    !strchr(seen.stream_line, '\n'),
                "%s", seen.stream_line);
  /* Without the backend's fences the ring waits for the whole device instead (and still loads W0). */
  struct qkeep_load_options no_fences = ring_shape;
  no_fences.stream_no_fences = true;
  ck_assert_int_eq(qkeep_model_set_load_options(m, &no_fences), 0);
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(seen.stream_lines, 2);
  ck_assert_msg(strstr(seen.stream_line, "fences off") && !strstr(seen.stream_line, " 0 syncs"), "%s",
                seen.stream_line);
  assert_digest(m, w0);
  qkeep_set_log_level(QKEEP_LOG_INFO);
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(seen.stream_lines, 2);
  qkeep_set_logger(NULL, NULL);
  use_ring(0);
  qkeep_model_free(m);
  qkeep_plugin_close(async);
  free(w0);
}
END_TEST

/* Quantized layers with fused shards on the async device: the shard scales merge from the host
 * mirror of what streamed (no device wait), and the bytes equal a reference load's, cold and after
 * a reload. */
START_TEST(quantized_layers_normalise_on_an_async_device) {
  use_ring(_i);
  qkeep_plugin *async;
  ck_assert_msg(qkeep_plugin_open("test-async", NULL, &async) == 0, "%s", qkeep_errmsg());
  char *src = write_source("w0.safetensors", 21, false, QKEEP_DTYPE_BF16);
  char *src1 = write_source("w1.safetensors", 22, false, QKEEP_DTYPE_BF16);
  static const char *const schemes[] = {"modelopt-nvfp4", "ct-nvfp4", "w8a8-int8", "gptq-int4"};
  for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++) {
    char o0[64], o1[64];
    snprintf(o0, sizeof o0, "async-%s-w0", schemes[i]);
    snprintf(o1, sizeof o1, "async-%s-w1", schemes[i]);
    char *w0 = quantize(src, schemes[i], o0), *w1 = quantize(src1, schemes[i], o1);
    qkeep_plugin *chain[] = {async};
    qkeep_model *m = load_chain(chain, 1, w0);
    ck_assert_str_eq(owner(m, "model.layers.0.self_attn.qkv_proj"), "test-async");
    assert_digest(m, w0);
    tu_assert_census_clean(m);
    ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s: %s", schemes[i], qkeep_errmsg());
    assert_digest(m, w1);
    qkeep_model_free(m);
    free(w0), free(w1);
  }
  qkeep_plugin_close(async);
  free(src), free(src1);
  use_ring(0);
}
END_TEST

START_TEST(a_layer_no_backend_takes_fails_before_any_allocation) {
  char *src = write_source("w0.safetensors", 7, false, QKEEP_DTYPE_BF16);
  take("-");
  qkeep_plugin *chain[] = {nodev, picky};
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new_chain(chain, 2, &m), 0);
  ck_assert_int_eq(qkeep_model_load(m, src), QKEEP_E_UNSUPPORTED);
  const char *msg = qkeep_errmsg();
  /* the layer, its scheme, and each backend's reason, in chain order */
  ck_assert_msg(strstr(msg, src) && strstr(msg, "layer ") && strstr(msg, "scheme unquantized") &&
                    strstr(msg, "test-nodev: no device (no test device)") && strstr(msg, "test-picky: "),
                "%s", msg);
  ck_assert(strstr(msg, "test-nodev") < strstr(msg, "test-picky"));
  ck_assert_uint_eq(qkeep_model_layer_count(m), 0); /* nothing half loaded */
  struct qkeep_memory_stats mem = {.size = sizeof mem};
  ck_assert_int_eq(qkeep_model_memory(m, &mem, false), 0);
  ck_assert_int_eq(mem.storage_peak, 0); /* not a byte was allocated */
  ck_assert_int_eq(mem.storage_bytes, 0);
  /* the model is usable afterwards: with take unset the same chain loads */
  take("");
  qkeep_model_free(m);
  qkeep_plugin *chain2[] = {nodev, picky, plugin};
  m = load_chain(chain2, 3, src);
  ck_assert_str_eq(owner(m, "lm_head"), "test-picky");
  struct qkeep_chain_info b = {.size = sizeof b};
  ck_assert_int_eq(qkeep_model_backend_info(m, 0, &b), 0);
  ck_assert(!b.usable);
  ck_assert_str_eq(b.probe_message, "no test device");
  ck_assert_uint_eq(b.layers, 0);
  qkeep_model_free(m);
  free(src);
}
END_TEST

START_TEST(the_weight_dtype_reaches_supports_layer) {
  char *src = write_source("w0.safetensors", 8, false, QKEEP_DTYPE_F16);
  take("");
  qkeep_plugin *chain[] = {picky, plugin};
  qkeep_model *m = load_chain(chain, 2, src);
  ck_assert_str_eq(owner(m, "lm_head"), "reference"); /* F16: test-picky says no */
  ck_assert_str_eq(owner(m, "model.layers.1.mlp.gate"), "test-picky");
  qkeep_model_free(m);
  free(src);
}
END_TEST

START_TEST(a_tied_lm_head_stays_with_its_embedding) {
  char *src = write_source("tied", 9, true, QKEEP_DTYPE_BF16);
  take("");
  qkeep_plugin *chain[] = {legacy, plugin};
  /* test-legacy takes embeddings (ABI 1.0 rule) and unquantized linears: both go there */
  qkeep_model *m = load_chain(chain, 2, src);
  ck_assert_str_eq(owner(m, "model.embed_tokens"), "test-legacy");
  ck_assert_str_eq(owner(m, "lm_head"), "test-legacy");
  tu_assert_census_clean(m);
  qkeep_model_free(m);
  /* test-picky takes the lm_head but never an embedding: the pair goes down the chain together */
  qkeep_plugin *chain2[] = {picky, plugin};
  m = load_chain(chain2, 2, src);
  ck_assert_str_eq(owner(m, "model.embed_tokens"), "reference");
  ck_assert_str_eq(owner(m, "lm_head"), "reference");
  ck_assert_str_eq(owner(m, "model.layers.1.mlp.gate"), "test-picky");
  struct qkeep_census c = tu_assert_census_clean(m);
  ck_assert_int_ge(c.aliases, 0);
  qkeep_model_free(m);
  /* alone, test-picky cannot hold the pair: the error names the tied layer too */
  qkeep_plugin *alone[] = {picky};
  ck_assert_int_eq(qkeep_model_new_chain(alone, 1, &m), 0);
  ck_assert_int_eq(qkeep_model_load(m, src), QKEEP_E_UNSUPPORTED);
  ck_assert_msg(strstr(qkeep_errmsg(), "tied with lm_head"), "%s", qkeep_errmsg());
  qkeep_model_free(m);
  free(src);
}
END_TEST

START_TEST(a_hand_built_layer_gets_its_owner_at_its_first_param) {
  take("mine");
  qkeep_plugin *chain[] = {picky, plugin};
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new_chain(chain, 2, &m), 0);
  qkeep_layer *a, *b;
  ck_assert_int_eq(qkeep_layer_add(m, "mine", QKEEP_LAYER_LINEAR, "unquantized", &a), 0);
  ck_assert_int_eq(qkeep_layer_add(m, "theirs", QKEEP_LAYER_LINEAR, "unquantized", &b), 0);
  ck_assert_ptr_null(qkeep_layer_backend(a)); /* no param yet: no owner */
  struct qkeep_layer_info dims = {.size = sizeof dims, .n = 4, .k = 8, .shards = 1};
  ck_assert_int_eq(qkeep_layer_set_dims(a, &dims), 0);
  ck_assert_int_eq(qkeep_layer_set_dims(b, &dims), 0);
  struct qkeep_spec w = {QKEEP_DTYPE_F32, 2, {4, 8}};
  ck_assert_int_eq(qkeep_param_create(a, "weight", &w, NULL), 0);
  ck_assert_int_eq(qkeep_param_create(b, "weight", &w, NULL), 0);
  ck_assert_str_eq(qkeep_layer_backend(a), "test-picky");
  ck_assert_str_eq(qkeep_layer_backend(b), "reference");
  qkeep_model_free(m);
  /* a chain with no taker for the layer refuses its first param */
  qkeep_plugin *alone[] = {picky};
  ck_assert_int_eq(qkeep_model_new_chain(alone, 1, &m), 0);
  ck_assert_int_eq(qkeep_layer_add(m, "theirs", QKEEP_LAYER_LINEAR, "unquantized", &b), 0);
  ck_assert_int_eq(qkeep_layer_set_dims(b, &dims), 0);
  ck_assert_int_eq(qkeep_param_create(b, "weight", &w, NULL), QKEEP_E_UNSUPPORTED);
  ck_assert_msg(strstr(qkeep_errmsg(), "test-picky: take = mine does not name it"), "%s", qkeep_errmsg());
  qkeep_model_free(m);
}
END_TEST

START_TEST(a_chain_names_each_backend_once) {
  qkeep_plugin *chain[] = {picky, plugin, picky};
  qkeep_model *m = NULL;
  ck_assert_int_eq(qkeep_model_new_chain(chain, 3, &m), QKEEP_E_INVAL);
  ck_assert_ptr_null(m);
  ck_assert_msg(strstr(qkeep_errmsg(), "test-picky is in the chain twice"), "%s", qkeep_errmsg());
  ck_assert_int_eq(qkeep_model_new_chain(NULL, 0, &m), 0); /* no plugin: a host-memory model */
  ck_assert_uint_eq(qkeep_model_backend_count(m), 1);
  qkeep_model_free(m);
}
END_TEST

/*
 * The other direction: an in-tree backend also loads in an ABI 1.0 core, which never reads
 * past fini. It asks for minor 0 and its supports() gives supports_layer's verdict on the
 * linear and MoE layers such a core asks about.
 */
START_TEST(in_tree_backends_also_serve_an_abi_1_0_core) {
  static const char *const schemes[] = {"unquantized", "modelopt-nvfp4", "ct-nvfp4", "mxfp4",
                                        "w8a8-int8",   "gptq-int4",      "awq-int4"};
  qkeep_plugin *backends[] = {plugin, onednn, zentorch};
  for (size_t b = 0; b < 3; b++) {
    if (!backends[b])
      continue;
    const struct qkeep_backend *be = qkeep_plugin_backend(backends[b]);
    ck_assert_uint_eq(be->abi_minor, 0);
    ck_assert_ptr_nonnull(be->supports);
    ck_assert_ptr_nonnull(be->supports_layer);
    for (size_t s = 0; s < sizeof schemes / sizeof schemes[0]; s++)
      for (int kind = QKEEP_LAYER_LINEAR; kind <= QKEEP_LAYER_MOE; kind += QKEEP_LAYER_MOE) {
        struct qkeep_layer_info info = {.size = sizeof info,
                                        .name = "model.layers.0.mlp.down_proj",
                                        .scheme = schemes[s],
                                        .kind = (enum qkeep_layer_kind)kind,
                                        .n = 64,
                                        .k = 64,
                                        .shards = 1,
                                        .weight_dtype = -1};
        char reason[256] = "";
        int layer_verdict = be->supports_layer(be, &info, reason, sizeof reason);
        ck_assert_msg(layer_verdict == be->supports(be, schemes[s], info.kind), "%s: %s %d", be->name,
                      schemes[s], kind);
        ck_assert_msg(layer_verdict || reason[0], "%s refuses %s without a reason", be->name, schemes[s]);
      }
  }
}
END_TEST

/*
 * A backend's two answers held together: what supports_layer accepts, its PWAL must take. cpu-onednn
 * accepted w8a8-int8 layers with K > 65,536 that its PWAL refused, so `cpu-onednn, reference` failed a
 * load the reference alone takes. For every in-tree CPU backend and layers of edge dims (K = 1, odd K,
 * K past 65,536, N = 1, a group that does not divide K), quantized by qkeep_quantize: the chain
 * [backend, reference] loads whatever the reference alone loads, and the layer goes to the backend
 * exactly when its supports_layer says yes.
 */
START_TEST(supports_layer_and_pwal_agree_on_edge_dims) {
  static const struct {
    const char *scheme;
    int64_t n, k, group;
  } cases[] = {
      {"unquantized", 1, 1, 0},     {"unquantized", 3, 33, 0},    {"unquantized", 2, 65600, 0},
      {"w8a8-int8", 1, 1, 0},       {"w8a8-int8", 1, 3, 0},       {"w8a8-int8", 3, 33, 0},
      {"w8a8-int8", 2, 65536, 0},   {"w8a8-int8", 2, 65600, 0},   {"gptq-int4", 8, 64, 32},
      {"gptq-int4", 8, 48, 32},     {"gptq-int4", 1, 64, 32},     {"gptq-int4", 8, 65600, 32},
      {"awq-int4", 8, 64, 32},      {"awq-int4", 8, 40, 16},      {"ct-int4", 8, 48, 32},
      {"modelopt-nvfp4", 1, 16, 0}, {"modelopt-nvfp4", 3, 48, 0}, {"mxfp4", 1, 32, 0},
  };
  qkeep_plugin *backends[] = {plugin, onednn, zentorch};
  const char *layer_name = "model.layers.0.mlp.down_proj";
  int checked = 0;
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    char file[64], out[64];
    snprintf(file, sizeof file, "edge%zu.safetensors", c);
    snprintf(out, sizeof out, "edge%zu", c);
    struct st_writer *w;
    ck_assert_int_eq(st_writer_new(&w), 0);
    add(w, "model.layers.0.mlp.down_proj.weight", QKEEP_DTYPE_BF16, cases[c].n, cases[c].k, c + 1);
    char *src = tu_path(dir, file), *path = NULL;
    ck_assert_int_eq(st_writer_write(w, src), 0);
    st_writer_free(w);
    if (strcmp(cases[c].scheme, "unquantized") == 0) {
      path = strdup(src);
    } else {
      path = tu_path(dir, out);
      struct qkeep_quantize_options o = {
          .size = sizeof o, .scheme = cases[c].scheme, .group_size = cases[c].group, .activation_amax = 4};
      if (qkeep_quantize(src, path, &o) != 0) { /* dims the writer itself refuses: no checkpoint to hold */
        free(src), free(path);
        continue;
      }
    }
    qkeep_model *alone;
    ck_assert_int_eq(qkeep_model_new(plugin, &alone), 0);
    if (qkeep_model_load(alone, path) != 0) { /* refused by the core (scheme checks): no layer to ask about */
      qkeep_model_free(alone);
      free(src), free(path);
      continue;
    }
    struct qkeep_layer_info info = {.size = sizeof info};
    ck_assert_int_eq(qkeep_layer_get_info(qkeep_model_find_layer(alone, layer_name), &info), 0);
    for (size_t b = 0; b < sizeof backends / sizeof backends[0]; b++) {
      if (!backends[b])
        continue;
      const struct qkeep_backend *be = qkeep_plugin_backend(backends[b]);
      char reason[256] = "";
      int verdict = be->supports_layer(be, &info, reason, sizeof reason);
      qkeep_plugin *chain[] = {backends[b], plugin};
      qkeep_model *m;
      ck_assert_int_eq(qkeep_model_new_chain(chain, b ? 2 : 1, &m), 0);
      int rc = qkeep_model_load(m, path);
      ck_assert_msg(rc == 0,
                    "%s %s N %lld K %lld group %lld: supports_layer says %d (%s) but the load fails: %s",
                    be->name, cases[c].scheme, (long long)cases[c].n, (long long)cases[c].k,
                    (long long)cases[c].group, verdict, reason, qkeep_errmsg());
      ck_assert_msg(strcmp(owner(m, layer_name), verdict ? be->name : "reference") == 0,
                    "%s %s N %lld K %lld: owner %s, supports_layer %d", be->name, cases[c].scheme,
                    (long long)cases[c].n, (long long)cases[c].k, owner(m, layer_name), verdict);
      qkeep_model_free(m);
      checked++;
    }
    qkeep_model_free(alone);
    free(src), free(path);
  }
  ck_assert_int_ge(checked, 10);
}
END_TEST

static Suite *chain_suite(void) {
  Suite *s = suite_create("chain");
  TCase *tc = tcase_create("chain");
  tcase_add_checked_fixture(tc, chain_setup, chain_teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, each_layer_runs_on_the_first_backend_that_takes_it);
  tcase_add_test(tc, nvfp4_on_the_reference_and_the_rest_on_onednn);
  tcase_add_test(tc, an_abi_1_0_plugin_takes_part_in_a_chain);
  tcase_add_test(tc, a_layer_no_backend_takes_fails_before_any_allocation);
  tcase_add_loop_test(tc, a_device_with_async_copies_loads_through_pinned_chunks, 0, 2);
  tcase_add_test(tc, load_options_are_checked_field_by_field_and_take_effect_at_the_next_load);
  tcase_add_test(tc, the_readers_serve_every_reload_and_stop_with_the_model);
  tcase_add_test(tc, a_streaming_load_logs_its_trace_at_debug_level);
  tcase_add_loop_test(tc, quantized_layers_normalise_on_an_async_device, 0, 2);
  tcase_add_test(tc, the_weight_dtype_reaches_supports_layer);
  tcase_add_test(tc, a_tied_lm_head_stays_with_its_embedding);
  tcase_add_test(tc, a_hand_built_layer_gets_its_owner_at_its_first_param);
  tcase_add_test(tc, a_chain_names_each_backend_once);
  tcase_add_test(tc, in_tree_backends_also_serve_an_abi_1_0_core);
  tcase_add_test(tc, supports_layer_and_pwal_agree_on_edge_dims);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run_suite(chain_suite(), CK_NORMAL); }
