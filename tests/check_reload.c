/*
 * check_reload.c: layerwise reload W0 -> W1 for every scheme, on every backend this
 * build has whose device is present (each in the chain "backend, reference"; the
 * reference alone first): equal to a cold start on W1 (digest, and every storage
 * byte, padding included), no data pointer moves, W0 -> W1 -> W0 returns to
 * W0, a bad W1 changes nothing, a fault at any layer rolls back, in-memory
 * tensors, partial updates, and direct loads into live params.
 */
#include <check.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckptutil.h"
#include "fixture.h"
#include "private.h"
#include "rewrite.h"
#include "testutil.h"

#define H 64
#define I 128

/* An unquantized model (fused attention and MLP, an MoE block) with weights from `seed`, and when kv_name
 * is not NULL a kv-cache scale of that local name (k_scale, v_scale, kv_scale) in its attention block. */
static char *write_source_kv(const char *file, uint64_t seed, const char *kv_name, float kv) {
  struct st_writer *w;
  char name[160];
  ck_assert_int_eq(st_writer_new(&w), 0);
  tu_add_source_f32(w, "model.embed_tokens.weight", 96, H, seed);
  tu_add_source_f32(w, "model.norm.weight", H, 0, seed);
  tu_add_source_f32(w, "lm_head.weight", 96, H, seed);
  static const char *const proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  for (int p = 0; p < 4; p++) {
    snprintf(name, sizeof name, "model.layers.0.self_attn.%s.weight", proj[p]);
    tu_add_source_f32(w, name, p == 1 || p == 2 ? 32 : H, H, seed);
  }
  tu_add_source_f32(w, "model.layers.0.mlp.gate_proj.weight", I, H, seed);
  tu_add_source_f32(w, "model.layers.0.mlp.up_proj.weight", I, H, seed);
  tu_add_source_f32(w, "model.layers.0.mlp.down_proj.weight", H, I, seed);
  tu_add_source_f32(w, "model.layers.1.mlp.gate.weight", 2, H, seed);
  for (int e = 0; e < 2; e++) {
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.gate_proj.weight", e);
    tu_add_source_f32(w, name, H, H, seed);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.up_proj.weight", e);
    tu_add_source_f32(w, name, H, H, seed);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.down_proj.weight", e);
    tu_add_source_f32(w, name, H, H, seed);
  }
  if (kv_name) {
    struct qkeep_spec scalar = {QKEEP_DTYPE_F32, 0, {0}};
    snprintf(name, sizeof name, "model.layers.0.self_attn.%s", kv_name);
    ck_assert_int_eq(st_writer_add(w, name, &scalar, &kv), 0);
  }
  char *path = tu_path(dir, file);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  return path;
}

static char *write_source(const char *file, uint64_t seed) { return write_source_kv(file, seed, NULL, 0); }

static char *quantize_opts(const char *source, const char *scheme, const char *out, int64_t shard_bytes,
                           bool asym, bool asym_input) {
  char *path = tu_path(dir, out);
  struct qkeep_quantize_options o = {.size = sizeof o,
                                     .static_input = asym_input,
                                     .asym_input = asym_input,
                                     .scheme = scheme,
                                     .group_size = 32,
                                     .kv_cache_scales = true,
                                     .activation_amax = 4,
                                     .max_shard_bytes = shard_bytes,
                                     .asym_weights = asym};
  ck_assert_msg(qkeep_quantize(source, path, &o) == 0, "%s: %s", scheme, qkeep_errmsg());
  return path;
}

static char *quantize(const char *source, const char *scheme, const char *out, int64_t shard_bytes,
                      bool asym) {
  return quantize_opts(source, scheme, out, shard_bytes, asym, false);
}

static struct qkeep_digest digest(qkeep_model *m) {
  struct qkeep_digest d;
  ck_assert_int_eq(qkeep_digest(m, &d), 0);
  return d;
}

static bool same(struct qkeep_digest a, struct qkeep_digest b) { return a.hi == b.hi && a.lo == b.lo; }

static const char *const schemes[] = {"modelopt-nvfp4", "ct-nvfp4", "mxfp4",  "w8a8-int8",
                                      "gptq-int4",      "awq-int4", "ct-int4"};

START_TEST(reload_equals_cold_start_in_place) {
  const char *scheme = schemes[_i];
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, scheme, "q0", 0, false), *w1 = quantize(s1, scheme, "q1", 0, false);
  char *w1_sharded = quantize(s1, scheme, "q1s", 9000, false);
  qkeep_model *m = load(w0), *cold = load(w1);
  struct qkeep_digest d0 = digest(m), d1 = digest(cold);
  ck_assert(!same(d0, d1));
  struct tu_storages before = {0}, after = {0}, cold_bytes = {0};
  tu_snapshot(m, &before);
  tu_snapshot(cold, &cold_bytes);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same(digest(m), d1));
  tu_snapshot(m, &after);
  tu_assert_in_place_and_equal(&before, &after, &cold_bytes);
  tu_assert_census_clean(m);
  /* Back to W0, and from a W1 sharded differently. */
  ck_assert_int_eq(qkeep_model_reload(m, w0, 0), 0);
  ck_assert(same(digest(m), d0));
  ck_assert_msg(qkeep_model_reload(m, w1_sharded, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same(digest(m), d1));
  tu_release_snapshot(&after);
  tu_snapshot(m, &after);
  tu_assert_in_place_and_equal(&before, &after, &cold_bytes);
  /* The kernels run on the reloaded weights exactly as on the cold start's. */
  float x[H], y0[H + 64], y1[H + 64];
  for (int i = 0; i < H; i++)
    x[i] = (float)i / H - 0.5f;
  ck_assert_int_eq(
      qkeep_layer_apply_f32(qkeep_model_find_layer(m, "model.layers.0.self_attn.qkv_proj"), 1, x, y0), 0);
  ck_assert_int_eq(
      qkeep_layer_apply_f32(qkeep_model_find_layer(cold, "model.layers.0.self_attn.qkv_proj"), 1, x, y1), 0);
  ck_assert_int_eq(memcmp(y0, y1, sizeof(float) * (H + 64)), 0);
  tu_release_snapshot(&before);
  tu_release_snapshot(&after);
  tu_release_snapshot(&cold_bytes);
  qkeep_model_free(m);
  qkeep_model_free(cold);
  free(s0), free(s1), free(w0), free(w1), free(w1_sharded);
}
END_TEST

/* Rewrites a checkpoint's model.safetensors with one tensor changed by `edit`. */
typedef void (*edit_fn)(struct st_writer *w, const struct st_tensor *t, void *bytes);

static char *rewrite(const char *src_dir, const char *out, edit_fn edit) {
  char *d = tu_path(dir, out);
  ck_assert_int_eq(mkdir(d, 0755), 0);
  char *in = tu_path(src_dir, "model.safetensors"), *cfg_in = tu_path(src_dir, "config.json");
  char *path = tu_path(d, "model.safetensors"), *cfg_out = tu_path(d, "config.json");
  struct st_file *f;
  struct st_writer *w;
  ck_assert_int_eq(st_open(in, &f), 0);
  ck_assert_int_eq(st_writer_new(&w), 0);
  for (size_t i = 0; i < f->n_tensors; i++) {
    const struct st_tensor *t = &f->tensors[i];
    void *bytes = malloc(t->nbytes + 1);
    ck_assert_int_eq(st_read(f, t, bytes), 0);
    edit(w, t, bytes);
    free(bytes);
  }
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  st_close(f);
  size_t n;
  void *cfg = tu_read_file(cfg_in, &n);
  ck_assert_int_eq(tu_write_file(cfg_out, cfg, n), 0);
  free(cfg), free(in), free(cfg_in), free(path), free(cfg_out);
  return d;
}

static void add_as_is(struct st_writer *w, const struct st_tensor *t, void *bytes) {
  struct qkeep_spec s = {(enum qkeep_dtype)t->dtype, t->ndim, {0}};
  memcpy(s.shape, t->shape, sizeof s.shape);
  ck_assert_int_eq(st_writer_add(w, t->name, &s, bytes), 0);
}

static bool is(const struct st_tensor *t, const char *name) { return strcmp(t->name, name) == 0; }

static void drop_scale(struct st_writer *w, const struct st_tensor *t, void *bytes) {
  if (!is(t, "model.layers.0.mlp.down_proj.weight_scale"))
    add_as_is(w, t, bytes);
}
static void nan_scale(struct st_writer *w, const struct st_tensor *t, void *bytes) {
  if (is(t, "model.layers.0.self_attn.v_proj.weight_scale_2")) {
    uint32_t nan = 0x7fc00000u;
    memcpy(bytes, &nan, 4);
  }
  add_as_is(w, t, bytes);
}
static void extra_tensor(struct st_writer *w, const struct st_tensor *t, void *bytes) {
  add_as_is(w, t, bytes);
  if (is(t, "model.norm.weight")) {
    struct qkeep_spec s = {QKEEP_DTYPE_F32, 1, {H}};
    ck_assert_int_eq(st_writer_add(w, "model.final_norm.weight", &s, bytes), 0);
  }
}
static void wrong_shape(struct st_writer *w, const struct st_tensor *t, void *bytes) {
  if (is(t, "model.layers.0.self_attn.o_proj.weight")) {
    struct qkeep_spec s = {QKEEP_DTYPE_U8, 2, {H / 2, H}}; /* same bytes, transposed shape */
    ck_assert_int_eq(st_writer_add(w, t->name, &s, bytes), 0);
    return;
  }
  add_as_is(w, t, bytes);
}

static bool ends_with(const char *s, const char *tail) {
  size_t n = strlen(s), m = strlen(tail);
  return n >= m && strcmp(s + n - m, tail) == 0;
}

/* compressed-tensors' w8a8 asymmetric activations store input_zero_point as I8. */
static void zero_points_as_i8(struct st_writer *w, const struct st_tensor *t, void *bytes) {
  if (ends_with(t->name, ".input_zero_point") && t->dtype == QKEEP_DTYPE_I32) {
    size_t n = t->nbytes / 4;
    int8_t *narrow = malloc(n ? n : 1);
    for (size_t i = 0; i < n; i++) {
      int32_t v;
      memcpy(&v, (char *)bytes + 4 * i, 4);
      ck_assert(v >= -128 && v <= 127);
      narrow[i] = (int8_t)v;
    }
    struct qkeep_spec s = {QKEEP_DTYPE_I8, t->ndim, {0}};
    memcpy(s.shape, t->shape, sizeof s.shape);
    ck_assert_int_eq(st_writer_add(w, t->name, &s, narrow), 0);
    free(narrow);
    return;
  }
  add_as_is(w, t, bytes);
}

/* I8 input zero points on fused layers (q/k/v, gate/up, experts). The shard merge read
 * 4 bytes per 1-byte shard, so a valid checkpoint was refused with heap bytes in the message. They load,
 * run as the I32 ones do, and reload. */
START_TEST(i8_input_zero_points_on_fused_layers) {
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize_opts(s0, "w8a8-int8", "q0", 0, false, true),
       *w1 = quantize_opts(s1, "w8a8-int8", "q1", 0, false, true);
  char *n0 = rewrite(w0, "n0", zero_points_as_i8), *n1 = rewrite(w1, "n1", zero_points_as_i8);
  qkeep_model *wide = load(w0), *narrow = load(n0), *cold1 = load(n1);
  ck_assert_ptr_nonnull(qkeep_model_lookup(narrow, "model.layers.0.self_attn.k_proj.input_zero_point", NULL));
  tu_assert_census_clean(narrow);
  float x[H], ya[2 * I], yb[2 * I]; /* gate_up's N is the widest */
  for (int i = 0; i < H; i++)
    x[i] = (float)(i % 9) / 4 - 1.0f;
  static const char *const fused[] = {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"};
  for (int f = 0; f < 2; f++) {
    qkeep_layer *a = qkeep_model_find_layer(wide, fused[f]), *b = qkeep_model_find_layer(narrow, fused[f]);
    ck_assert_ptr_nonnull(b);
    ck_assert_int_eq(qkeep_layer_apply_f32(a, 1, x, ya), 0);
    ck_assert_int_eq(qkeep_layer_apply_f32(b, 1, x, yb), 0);
    ck_assert_msg(memcmp(ya, yb, sizeof(float) * (size_t)a->dims.n) == 0, "%s", fused[f]);
  }
  ck_assert_msg(qkeep_model_reload(narrow, n1, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same(digest(narrow), digest(cold1)));
  qkeep_model_free(wide);
  qkeep_model_free(narrow);
  qkeep_model_free(cold1);
  free(s0), free(s1), free(w0), free(w1), free(n0), free(n1);
}
END_TEST

START_TEST(bad_w1_changes_nothing) {
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, "modelopt-nvfp4", "q0", 0, false),
       *w1 = quantize(s1, "modelopt-nvfp4", "q1", 0, false);
  char *gptq = quantize(s1, "gptq-int4", "g1", 0, false);
  struct {
    char *path;
    int code;
    const char *needle;
  } bad[] = {
      {rewrite(w1, "missing", drop_scale), QKEEP_E_NOTFOUND, "down_proj.weight_scale"},
      {rewrite(w1, "nan", nan_scale), QKEEP_E_FORMAT, "v_proj.weight_scale_2"},
      {rewrite(w1, "extra", extra_tensor), QKEEP_E_NOTFOUND, "model.final_norm.weight"},
      {rewrite(w1, "shape", wrong_shape), QKEEP_E_FORMAT, "o_proj.weight"},
      {gptq, QKEEP_E_NOTFOUND, "missing"},
      {tu_path(dir, "absent"), QKEEP_E_NOTFOUND, "absent"},
  };
  qkeep_model *m = load(w0);
  struct qkeep_digest d0 = digest(m);
  struct tu_storages before = {0}, after = {0};
  tu_snapshot(m, &before);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ck_assert_int_eq(qkeep_model_reload(m, bad[i].path, 0), bad[i].code);
    ck_assert_msg(strstr(qkeep_errmsg(), bad[i].needle), "case %zu: '%s' not in '%s'", i, bad[i].needle,
                  qkeep_errmsg());
    ck_assert(same(digest(m), d0));
    tu_snapshot(m, &after);
    tu_assert_in_place_and_equal(&before, &after, &before);
    tu_release_snapshot(&after);
    free(bad[i].path);
  }
  float x[H] = {0}, y[H];
  ck_assert_int_eq(
      qkeep_layer_apply_f32(qkeep_model_find_layer(m, "model.layers.0.self_attn.o_proj"), 1, x, y), 0);
  /* An asymmetric GPTQ W1 for a symmetric GPTQ model: the config differs. */
  char *g0 = quantize(s0, "gptq-int4", "g0", 0, false), *g1a = quantize(s1, "gptq-int4", "g1a", 0, true);
  qkeep_model *g = load(g0);
  ck_assert_int_eq(qkeep_model_reload(g, g1a, 0), QKEEP_E_FORMAT);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "quantization config"));
  /* The same W1 by its bare model.safetensors: no config there, as a cold start on that path finds
   * none; it used to reload unchecked and discard the zero points. */
  char *g1a_file = tu_path(g1a, "model.safetensors");
  struct qkeep_digest dg = digest(g);
  ck_assert_int_eq(qkeep_model_reload(g, g1a_file, 0), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), "declares no quantization"), "%s", qkeep_errmsg());
  ck_assert(same(digest(g), dg));
  qkeep_model *bare;
  ck_assert_int_eq(qkeep_model_new(plugin, &bare), 0);
  ck_assert_int_ne(qkeep_model_load(bare, g1a_file), 0); /* what a cold start says of that path */
  qkeep_model_free(bare);
  free(g1a_file);
  /* Unquantized bare files carry all they need: those reload as they cold-start. */
  qkeep_model *u = load(s0), *u1 = load(s1);
  ck_assert_msg(qkeep_model_reload(u, s1, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same(digest(u), digest(u1)));
  qkeep_model_free(u);
  qkeep_model_free(u1);
  tu_release_snapshot(&before);
  qkeep_model_free(m);
  qkeep_model_free(g);
  free(s0), free(s1), free(w0), free(w1), free(g0), free(g1a);
}
END_TEST

START_TEST(fault_at_every_layer_rolls_back) {
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, "ct-nvfp4", "q0", 0, false), *w1 = quantize(s1, "ct-nvfp4", "q1", 0, false);
  qkeep_model *m = load(w0), *cold = load(w1);
  struct qkeep_digest d0 = digest(m), d1 = digest(cold);
  struct tu_storages before = {0}, after = {0};
  tu_snapshot(m, &before);
  for (size_t l = 0; l < qkeep_model_layer_count(m); l++) {
    inject_fault(m, (long)l, QKEEP_E_IO);
    ck_assert_int_eq(qkeep_model_reload(m, w1, 0), QKEEP_E_IO);
    ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "rolled back"));
    ck_assert_msg(same(digest(m), d0), "fault at layer %zu left a mix", l);
    tu_snapshot(m, &after);
    tu_assert_in_place_and_equal(&before, &after, &before);
    tu_release_snapshot(&after);
  }
  inject_fault(m, -1, 0);
  ck_assert_int_eq(qkeep_model_reload(m, w1, 0), 0);
  ck_assert(same(digest(m), d1));
  tu_release_snapshot(&before);
  qkeep_model_free(m);
  qkeep_model_free(cold);
  free(s0), free(s1), free(w0), free(w1);
}
END_TEST

/* Copies every file of checkpoint directory `from` over the same names in `to` (a trainer saving its
 * new weights into the directory the model was loaded from). */
static void overwrite_dir(const char *from, const char *to) {
  static const char *const files[] = {"model.safetensors", "config.json"};
  for (size_t i = 0; i < 2; i++) {
    char *src = tu_path(from, files[i]), *dst = tu_path(to, files[i]);
    size_t n;
    void *bytes = tu_read_file(src, &n);
    ck_assert_ptr_nonnull(bytes);
    ck_assert_int_eq(tu_write_file(dst, bytes, n), 0);
    free(bytes), free(src), free(dst);
  }
}

/* W0's files change on disk after the cold start, then a reload fails late: re-reading W0 would give a
 * mix that claims to be W0. The rollback re-reads only the very files the model read (same inode,
 * size and times), so the model refuses to run, and says so. */
START_TEST(rollback_after_w0_changed_on_disk_refuses_to_run) {
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2),
       *s2 = write_source("w2.safetensors", 3);
  char *w0 = quantize(s0, "w8a8-int8", "q0", 0, false), *w1 = quantize(s1, "w8a8-int8", "q1", 0, false),
       *w2 = quantize(s2, "w8a8-int8", "q2", 0, false);
  qkeep_model *m = load(w0);
  struct qkeep_digest d0 = digest(m);
  size_t n_layers = qkeep_model_layer_count(m);
  /* Unchanged files: a late fault rolls back to exactly W0. */
  inject_fault(m, (long)n_layers - 1, QKEEP_E_IO);
  ck_assert_int_eq(qkeep_model_reload(m, w1, 0), QKEEP_E_IO);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "rolled back"));
  ck_assert(same(digest(m), d0));
  /* Now W0's directory holds other weights of the same shapes. */
  overwrite_dir(w2, w0);
  ck_assert_int_eq(qkeep_model_reload(m, w1, 0), QKEEP_E_IO);
  const char *msg = qkeep_errmsg();
  ck_assert_msg(strstr(msg, "refuses to run") && !strstr(msg, "rolled back to"), "%s", msg);
  ck_assert_msg(strstr(msg, "changed since"), "%s", msg);
  float x[H] = {0}, y[H];
  qkeep_layer *o = qkeep_model_find_layer(m, "model.layers.0.self_attn.o_proj");
  ck_assert_int_eq(qkeep_layer_apply_f32(o, 1, x, y), QKEEP_E_STATE);
  /* A full reload that succeeds makes it run again, equal to a cold start. */
  inject_fault(m, -1, 0);
  ck_assert_int_eq(qkeep_model_reload(m, w1, 0), 0);
  qkeep_model *cold = load(w1);
  ck_assert(same(digest(m), digest(cold)));
  ck_assert_int_eq(qkeep_layer_apply_f32(o, 1, x, y), 0);
  qkeep_model_free(cold);
  qkeep_model_free(m);
  free(s0), free(s1), free(s2), free(w0), free(w1), free(w2);
}
END_TEST

/* The quietest change: one byte of W0's weights rewritten in place, size kept and the modification
 * time set back; only the change time (which no user can set) tells. */
START_TEST(rollback_sees_an_in_place_rewrite_that_keeps_size_and_mtime) {
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, "w8a8-int8", "q0", 0, false), *w1 = quantize(s1, "w8a8-int8", "q1", 0, false);
  qkeep_model *m = load(w0);
  char *file = tu_path(w0, "model.safetensors");
  struct stat before;
  ck_assert_int_eq(stat(file, &before), 0);
  int fd = open(file, O_WRONLY);
  ck_assert_int_ge(fd, 0);
  unsigned char b = 0x5a;
  ck_assert_int_eq(pwrite(fd, &b, 1, (off_t)before.st_size - 1), 1); /* the last byte of the last tensor */
  close(fd);
  struct timespec times[2] = {before.st_atim, before.st_mtim};
  ck_assert_int_eq(utimensat(AT_FDCWD, file, times, 0), 0);
  inject_fault(m, (long)qkeep_model_layer_count(m) - 1, QKEEP_E_IO);
  ck_assert_int_eq(qkeep_model_reload(m, w1, 0), QKEEP_E_IO);
  const char *msg = qkeep_errmsg();
  ck_assert_msg(strstr(msg, "refuses to run") && strstr(msg, "changed since the model read it"), "%s", msg);
  inject_fault(m, -1, 0);
  qkeep_model_free(m);
  free(file), free(s0), free(s1), free(w0), free(w1);
}
END_TEST

/* W0's weights replaced by a FIFO after the cold start: the rollback's open blocked forever waiting
 * for a writer. It is refused at once (the model then refuses to run); alarm() makes a regression fail
 * instead of hanging. */
START_TEST(rollback_to_a_w0_that_became_a_fifo_does_not_wait) {
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, "w8a8-int8", "q0", 0, false), *w1 = quantize(s1, "w8a8-int8", "q1", 0, false);
  qkeep_model *m = load(w0);
  char *file = tu_path(w0, "model.safetensors");
  ck_assert_int_eq(unlink(file), 0);
  ck_assert_int_eq(mkfifo(file, 0644), 0);
  alarm(20);
  inject_fault(m, (long)qkeep_model_layer_count(m) - 1, QKEEP_E_IO);
  ck_assert_int_eq(qkeep_model_reload(m, w1, 0), QKEEP_E_IO);
  alarm(0);
  const char *msg = qkeep_errmsg();
  ck_assert_msg(strstr(msg, "refuses to run") && strstr(msg, "not a regular file") && strstr(msg, file), "%s",
                msg);
  inject_fault(m, -1, 0);
  qkeep_model_free(m);
  free(file), free(s0), free(s1), free(w0), free(w1);
}
END_TEST

/* W1's weight file written in place (same size) while the reload reads it: the reload would leave a
 * mix of W1's old and new bytes. W1's identity is taken at the open and checked after the reads: the
 * reload fails naming the file and the model is W0 again; a reload of the file as it now stands
 * succeeds. */
START_TEST(w1_rewritten_in_place_during_the_reload_rolls_back) {
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, "w8a8-int8", "q0", 0, false), *w1 = quantize(s1, "w8a8-int8", "q1", 0, false);
  qkeep_model *m = load(w0);
  struct qkeep_digest d0 = digest(m);
  char *file = tu_path(w1, "model.safetensors");
  struct rewrite r = rewrite_of(file, "model.norm.weight");
  qkeep_model_set_progress(m, rewrite_after_first_layer, &r);
  ck_assert_int_eq(qkeep_model_reload(m, w1, 0), QKEEP_E_IO);
  const char *msg = qkeep_errmsg();
  ck_assert_msg(strstr(msg, file) && strstr(msg, "the reload read a mix") && strstr(msg, "rolled back to"),
                "%s", msg);
  ck_assert(!r.armed);
  ck_assert(same(digest(m), d0));
  qkeep_model_set_progress(m, NULL, NULL);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  qkeep_model *cold = load(w1);
  ck_assert(same(digest(m), digest(cold)));
  qkeep_model_free(cold);
  qkeep_model_free(m);
  free(r.path), free(file), free(s0), free(s1), free(w0), free(w1);
}
END_TEST

/* Every tensor of a checkpoint in host buffers. */
struct tensors {
  struct ckpt *ck;
  struct qkeep_named_tensor *t;
  size_t n;
};

static void read_tensors(const char *path, struct tensors *out, bool on_device) {
  ck_assert_int_eq(ckpt_open(path, &out->ck), 0);
  out->n = out->ck->n_tensors;
  out->t = calloc(out->n, sizeof *out->t);
  for (size_t i = 0; i < out->n; i++) {
    const struct ckpt_tensor *ct = &out->ck->tensors[i];
    void *bytes = malloc(ct->t->nbytes + 1);
    ck_assert_int_eq(ckpt_read(out->ck, ct, bytes), 0);
    out->t[i] = (struct qkeep_named_tensor){
        ct->t->name, {(enum qkeep_dtype)ct->t->dtype, ct->t->ndim, {0}}, bytes, on_device};
    memcpy(out->t[i].spec.shape, ct->t->shape, sizeof out->t[i].spec.shape);
  }
}

static void free_tensors(struct tensors *t) {
  for (size_t i = 0; i < t->n; i++)
    free((void *)t->t[i].data);
  free(t->t);
  ckpt_close(t->ck);
}

START_TEST(reload_from_memory_buffers) {
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, "w8a8-int8", "q0", 0, false), *w1 = quantize(s1, "w8a8-int8", "q1", 0, false);
  qkeep_model *m = load(w0), *cold = load(w1);
  struct qkeep_digest d0 = digest(m), d1 = digest(cold);
  struct tensors t1, t0;
  read_tensors(w1, &t1, false);
  read_tensors(w0, &t0, true); /* "device" memory: the host for the reference backend */
  ck_assert_msg(qkeep_model_reload_tensors(m, t1.t, t1.n, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same(digest(m), d1));
  ck_assert_int_eq(qkeep_model_reload_tensors(m, t0.t, t0.n, 0), 0);
  ck_assert(same(digest(m), d0));
  /* Duplicate names are refused before anything changes. */
  struct qkeep_named_tensor dup[2] = {t1.t[0], t1.t[0]};
  ck_assert_int_eq(qkeep_model_reload_tensors(m, dup, 2, QKEEP_RELOAD_PARTIAL), QKEEP_E_INVAL);
  ck_assert(same(digest(m), d0));
  /* After a buffer reload no file holds the weights: a fault cannot roll back, so the model refuses to run.
   */
  inject_fault(m, 3, QKEEP_E_DEVICE);
  ck_assert_int_eq(qkeep_model_reload_tensors(m, t1.t, t1.n, 0), QKEEP_E_DEVICE);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "refuses to run"));
  float x[H] = {0}, y[H];
  qkeep_layer *o = qkeep_model_find_layer(m, "model.layers.0.self_attn.o_proj");
  ck_assert_int_eq(qkeep_layer_apply_f32(o, 1, x, y), QKEEP_E_STATE);
  ck_assert_int_eq(qkeep_model_reload_tensors(m, t1.t, 1, QKEEP_RELOAD_PARTIAL), QKEEP_E_STATE);
  inject_fault(m, -1, 0);
  ck_assert_int_eq(qkeep_model_reload_tensors(m, t1.t, t1.n, 0), 0);
  ck_assert_int_eq(qkeep_layer_apply_f32(o, 1, x, y), 0);
  ck_assert(same(digest(m), d1));
  free_tensors(&t0);
  free_tensors(&t1);
  qkeep_model_free(m);
  qkeep_model_free(cold);
  free(s0), free(s1), free(w0), free(w1);
}
END_TEST

START_TEST(partial_update_of_chosen_layers) {
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, "gptq-int4", "q0", 0, false), *w1 = quantize(s1, "gptq-int4", "q1", 0, false);
  qkeep_model *m = load(w0), *cold1 = load(w1), *cold0 = load(w0);
  struct tensors t1;
  read_tensors(w1, &t1, false);
  /* Only o_proj's tensors. */
  struct qkeep_named_tensor chosen[8];
  size_t n = 0;
  for (size_t i = 0; i < t1.n; i++)
    if (strstr(t1.t[i].name, "layers.0.self_attn.o_proj."))
      chosen[n++] = t1.t[i];
  ck_assert_uint_ge(n, 3);
  struct qkeep_digest d0 = digest(m);
  ck_assert_int_eq(qkeep_model_reload_tensors(m, chosen, n, 0),
                   QKEEP_E_NOTFOUND); /* a full reload needs all */
  ck_assert(same(digest(m), d0));
  ck_assert_msg(qkeep_model_reload_tensors(m, chosen, n, QKEEP_RELOAD_PARTIAL) == 0, "%s", qkeep_errmsg());
  /* o_proj now as W1's, every other layer as W0's. */
  float x[H], ya[H], yb[H];
  for (int i = 0; i < H; i++)
    x[i] = (float)(i % 5) - 2.0f;
  for (size_t l = 0; l < qkeep_model_layer_count(m); l++) {
    qkeep_layer *a = qkeep_model_layer(m, l);
    if (a->kind != QKEEP_LAYER_LINEAR || a->dims.k != H || a->dims.n > H)
      continue;
    bool updated = strcmp(a->name, "model.layers.0.self_attn.o_proj") == 0;
    qkeep_layer *b = qkeep_model_find_layer(updated ? cold1 : cold0, a->name);
    ck_assert_int_eq(qkeep_layer_apply_f32(a, 1, x, ya), 0);
    ck_assert_int_eq(qkeep_layer_apply_f32(b, 1, x, yb), 0);
    ck_assert_msg(memcmp(ya, yb, sizeof(float) * (size_t)a->dims.n) == 0, "%s", a->name);
  }
  free_tensors(&t1);
  qkeep_model_free(m);
  qkeep_model_free(cold0);
  qkeep_model_free(cold1);
  free(s0), free(s1), free(w0), free(w1);
}
END_TEST

START_TEST(direct_load_into_live_params) {
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, "modelopt-nvfp4", "q0", 0, false),
       *w1 = quantize(s1, "modelopt-nvfp4", "q1", 0, false);
  qkeep_model *m = load(w0), *cold = load(w1);
  struct tensors t1;
  read_tensors(w1, &t1, false);
  const struct qkeep_named_tensor *find = NULL;
  /* o_proj's weight and block scales keep the checkpoint layout on the reference backend. */
  static const char *const direct[] = {"model.layers.0.self_attn.o_proj.weight",
                                       "model.layers.0.self_attn.o_proj.weight_scale",
                                       "model.layers.0.self_attn.o_proj.weight_scale_2"};
  for (size_t d = 0; d < 3; d++) {
    for (size_t i = 0; i < t1.n; i++)
      if (strcmp(t1.t[i].name, direct[d]) == 0)
        find = &t1.t[i];
    ck_assert_msg(qkeep_model_load_tensor(m, find) == 0, "%s: %s", direct[d], qkeep_errmsg());
  }
  float x[H], ya[H], yb[H];
  for (int i = 0; i < H; i++)
    x[i] = (float)i / H;
  ck_assert_int_eq(
      qkeep_layer_apply_f32(qkeep_model_find_layer(m, "model.layers.0.self_attn.o_proj"), 1, x, ya), 0);
  ck_assert_int_eq(
      qkeep_layer_apply_f32(qkeep_model_find_layer(cold, "model.layers.0.self_attn.o_proj"), 1, x, yb), 0);
  ck_assert_int_eq(memcmp(ya, yb, sizeof ya), 0);
  /* The fused qkv's global scale was merged by normalisation: refused, pointing to reload. */
  for (size_t i = 0; i < t1.n; i++)
    if (strcmp(t1.t[i].name, "model.layers.0.self_attn.k_proj.weight_scale_2") == 0)
      find = &t1.t[i];
  ck_assert_int_eq(qkeep_model_load_tensor(m, find), QKEEP_E_STATE);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "qkeep_model_reload"));
  struct qkeep_named_tensor unknown = {"model.nothing.weight", {QKEEP_DTYPE_F32, 1, {1}}, x, false};
  ck_assert_int_eq(qkeep_model_load_tensor(m, &unknown), QKEEP_E_NOTFOUND);
  free_tensors(&t1);
  qkeep_model_free(m);
  qkeep_model_free(cold);
  free(s0), free(s1), free(w0), free(w1);
}
END_TEST

/* A kv-cache scale loaded directly: the placeholder derived from it (v from k, or both from a single
 * kv_scale) follows, as a cold start on the same tensors derives it. Each used to keep the old value. */
START_TEST(direct_load_of_a_kv_scale_updates_what_derives_from_it) {
  static const char *const names[] = {"k_scale", "v_scale", "kv_scale"};
  for (size_t i = 0; i < 3; i++) {
    char f0[32], f1[32], full[96];
    snprintf(f0, sizeof f0, "kv0-%zu.safetensors", i);
    snprintf(f1, sizeof f1, "kv1-%zu.safetensors", i);
    snprintf(full, sizeof full, "model.layers.0.self_attn.%s", names[i]);
    char *p0 = write_source_kv(f0, 1, names[i], 0.5f), *p1 = write_source_kv(f1, 1, names[i], 3.0f);
    qkeep_model *m = load(p0), *cold = load(p1);
    ck_assert(!same(digest(m), digest(cold)));
    float value = 3.0f;
    struct qkeep_named_tensor t = {full, {QKEEP_DTYPE_F32, 0, {0}}, &value, false};
    ck_assert_msg(qkeep_model_load_tensor(m, &t) == 0, "%s: %s", full, qkeep_errmsg());
    ck_assert_msg(same(digest(m), digest(cold)), "%s: differs from a cold start after a direct load", full);
    qkeep_model_free(m);
    qkeep_model_free(cold);
    free(p0), free(p1);
  }
}
END_TEST

/* Writes a checkpoint of one attention block `block` (q/k/v/o) and the given scalar kv-cache scales. */
static char *write_attention(const char *file, const char *block, const char *const *scales, size_t n) {
  struct st_writer *w;
  char *name;
  ck_assert_int_eq(st_writer_new(&w), 0);
  static const char *const proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  for (int p = 0; p < 4; p++) {
    ck_assert_int_ne(asprintf(&name, "%s.%s.weight", block, proj[p]), -1);
    tu_add_source_f32(w, name, H, H, 1);
    free(name);
  }
  for (size_t i = 0; i < n; i++) {
    struct qkeep_spec scalar = {QKEEP_DTYPE_F32, 0, {0}};
    float v = 0.25f * (float)(i + 1);
    ck_assert_int_ne(asprintf(&name, "%s.%s", block, scales[i]), -1);
    ck_assert_int_eq(st_writer_add(w, name, &scalar, &v), 0);
    free(name);
  }
  char *path = tu_path(dir, file);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  return path;
}

/* Cold start and reload take the same tensors: what a cold start accepts, a reload of the same
 * checkpoint accepts to the same digest; what no layer takes is an error at both. */
START_TEST(cold_start_and_reload_take_the_same_tensors) {
  /* A kv_scale beside k_scale / v_scale: kv_scale is the older name of both, so the two namings
   * disagree about the same scales. The cold start ignored kv_scale (never read: a NaN passed); the
   * reload refused it. */
  static const char *const both[] = {"k_scale", "v_scale", "kv_scale"};
  static const char *const k_and_kv[] = {"k_scale", "kv_scale"};
  const char *const *sets[] = {both, k_and_kv};
  size_t counts[] = {3, 2};
  for (size_t i = 0; i < 2; i++) {
    char *path = write_attention(i ? "kv2.safetensors" : "kv3.safetensors", "model.layers.0.self_attn",
                                 sets[i], counts[i]);
    qkeep_model *m;
    ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
    ck_assert_int_eq(qkeep_model_load(m, path), QKEEP_E_FORMAT);
    ck_assert_msg(strstr(qkeep_errmsg(), "kv_scale"), "%s", qkeep_errmsg());
    qkeep_model_free(m);
    free(path);
  }
  /* Two attention blocks whose names agree in their first 700 characters: two kv-scales layers, and
   * a reload of the same file takes every tensor. */
  char *a = malloc(800), *b = malloc(800);
  memset(a, 'x', 700);
  strcpy(a + 700, ".a.self_attn");
  memset(b, 'x', 700);
  strcpy(b + 700, ".b.self_attn");
  static const char *const kv[] = {"k_scale", "v_scale"};
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  const char *blocks[] = {a, b};
  for (int k = 0; k < 2; k++)
    for (int s = 0; s < 2; s++) {
      char *name;
      struct qkeep_spec scalar = {QKEEP_DTYPE_F32, 0, {0}};
      float v = 0.5f + (float)(k * 2 + s);
      ck_assert_int_ne(asprintf(&name, "%s.%s", blocks[k], kv[s]), -1);
      ck_assert_int_eq(st_writer_add(w, name, &scalar, &v), 0);
      free(name);
    }
  char *path = tu_path(dir, "long.safetensors");
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  qkeep_model *m = load(path);
  struct qkeep_digest d = digest(m);
  ck_assert_msg(qkeep_model_reload(m, path, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same(digest(m), d));
  for (int k = 0; k < 2; k++)
    for (int s = 0; s < 2; s++) {
      char *name;
      ck_assert_int_ne(asprintf(&name, "%s.%s", blocks[k], kv[s]), -1);
      ck_assert_msg(qkeep_model_lookup(m, name, NULL), "%s is taken by no layer", name);
      free(name);
    }
  qkeep_model_free(m);
  free(path), free(a), free(b);
}
END_TEST

/* W1's scales read in shares by several threads (forced for this small model) validate and land as a
 * single reader's do: the digest after the reload is a cold start's on W1, and a bad scale in the last
 * share is still found before anything changes. */
START_TEST(scales_read_in_shares_by_threads_validate_the_same) {
  ck_assert_int_eq(qkeep__test_control(QKEEP_TESTCTRL_THREADED_SCALE_BYTES, (size_t)1), 0);
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, "modelopt-nvfp4", "nv-w0", 0, false),
       *w1 = quantize(s1, "modelopt-nvfp4", "nv-w1", 0, false);
  qkeep_model *m = load(w0), *cold = load(w1);
  struct qkeep_digest d0 = digest(m), d1 = digest(cold);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same(digest(m), d1));
  /* the last block scale in file order gets a NaN: found before anything changes, W0 stays */
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(w1, &ck), 0);
  const struct ckpt_tensor *last = NULL, *first = NULL;
  for (size_t i = 0; i < ck->n_tensors; i++) {
    const struct st_tensor *t = ck->tensors[i].t;
    if (!strstr(t->name, ".weight_scale") || strstr(t->name, "_2"))
      continue;
    if (!last || t->offset > last->t->offset)
      last = &ck->tensors[i];
    if (!first || t->offset < first->t->offset)
      first = &ck->tensors[i];
  }
  ck_assert_ptr_nonnull(last);
  ck_assert_ptr_ne(first, last);
  char *bad_name = xstrdup(last->t->name);
  int fd = open(last->file->path, O_WRONLY);
  ck_assert_int_ge(fd, 0);
  unsigned char nan8 = 0x7f; /* e4m3 NaN */
  ck_assert_int_eq(pwrite(fd, &nan8, 1, (off_t)last->t->offset), 1);
  close(fd);
  ck_assert_int_eq(qkeep_model_reload(m, w1, 0), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), bad_name), "%s", qkeep_errmsg());
  ck_assert(same(digest(m), d0));
  /* a second bad scale, in the first share: the threads name the scale one thread names (the first in
   * the order validation lists them), whichever share finishes first */
  fd = open(first->file->path, O_WRONLY);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(pwrite(fd, &nan8, 1, (off_t)first->t->offset), 1);
  close(fd);
  ckpt_close(ck);
  ck_assert_int_eq(qkeep_model_reload(m, w1, 0), QKEEP_E_FORMAT);
  char *threaded = xstrdup(qkeep_errmsg());
  ck_assert_int_eq(qkeep__test_control(QKEEP_TESTCTRL_THREADED_SCALE_BYTES, (size_t)0), 0); /* the default */
  ck_assert_int_eq(qkeep_model_reload(m, w1, 0), QKEEP_E_FORMAT);
  ck_assert_str_eq(threaded, qkeep_errmsg());
  ck_assert(same(digest(m), d0));
  free(threaded);
  free(bad_name);
  qkeep_model_free(m), qkeep_model_free(cold);
  free(s0), free(s1), free(w0), free(w1);
}
END_TEST

/* The scales a reload from files checks go to host memory the model keeps for the next reload (a
 * fresh buffer each reload cost its page faults); what one reload left there never reaches another:
 * each equals a cold start, after a reload that failed on a scale half-way through too. */
START_TEST(checked_scales_stay_in_memory_the_model_keeps) {
  char *s0 = write_source("w0.safetensors", 1), *s1 = write_source("w1.safetensors", 2);
  char *w0 = quantize(s0, "modelopt-nvfp4", "q0", 0, false),
       *w1 = quantize(s1, "modelopt-nvfp4", "q1", 0, false);
  char *nan = rewrite(w1, "nan", nan_scale);
  qkeep_model *m = load(w0), *cold0 = load(w0), *cold1 = load(w1);
  struct qkeep_memory_stats mem = {.size = sizeof mem};
  ck_assert_int_eq(qkeep_model_memory(m, &mem, false), 0);
  ck_assert_int_eq(mem.kept_scale_bytes, 0); /* a load keeps none */
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same(digest(m), digest(cold1)));
  ck_assert_int_eq(qkeep_model_memory(m, &mem, false), 0);
  int64_t kept = mem.kept_scale_bytes;
  ck_assert_int_gt(kept, 0);
  ck_assert_int_lt(kept, mem.storage_bytes); /* the scales, not the model */
  ck_assert_int_eq(qkeep_model_reload(m, nan, 0), QKEEP_E_FORMAT);
  ck_assert(same(digest(m), digest(cold1)));
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same(digest(m), digest(cold0)));
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same(digest(m), digest(cold1)));
  ck_assert_int_eq(qkeep_model_memory(m, &mem, false), 0);
  ck_assert_int_eq(mem.kept_scale_bytes, kept); /* the same memory, reused */
  qkeep_model_free(m);
  qkeep_model_free(cold0);
  qkeep_model_free(cold1);
  free(s0), free(s1), free(w0), free(w1), free(nan);
}
END_TEST

START_TEST(reload_needs_a_loaded_model) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  char *s0 = write_source("w0.safetensors", 1);
  ck_assert_int_eq(qkeep_model_reload(m, s0, 0), QKEEP_E_STATE);
  qkeep_model_free(m);
  free(s0);
}
END_TEST

static Suite *reload_suite(const char *backend) {
  Suite *s = suite_create(backend);
  TCase *tc = tcase_create("reload");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, reload_equals_cold_start_in_place, 0, (int)(sizeof schemes / sizeof schemes[0]));
  tcase_add_test(tc, bad_w1_changes_nothing);
  tcase_add_test(tc, i8_input_zero_points_on_fused_layers);
  tcase_add_test(tc, fault_at_every_layer_rolls_back);
  tcase_add_test(tc, rollback_after_w0_changed_on_disk_refuses_to_run);
  tcase_add_test(tc, rollback_sees_an_in_place_rewrite_that_keeps_size_and_mtime);
  tcase_add_test(tc, rollback_to_a_w0_that_became_a_fifo_does_not_wait);
  tcase_add_test(tc, w1_rewritten_in_place_during_the_reload_rolls_back);
  tcase_add_test(tc, reload_from_memory_buffers);
  tcase_add_test(tc, partial_update_of_chosen_layers);
  tcase_add_test(tc, direct_load_into_live_params);
  tcase_add_test(tc, scales_read_in_shares_by_threads_validate_the_same);
  tcase_add_test(tc, reload_needs_a_loaded_model);
  tcase_add_test(tc, checked_scales_stay_in_memory_the_model_keeps);
  tcase_add_test(tc, cold_start_and_reload_take_the_same_tensors);
  tcase_add_test(tc, direct_load_of_a_kv_scale_updates_what_derives_from_it);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  fixture_name = "reload";
  /* Every built backend whose device is here, each in the chain "backend, reference". */
  static const char *const backends[] = {"reference", "cpu-onednn", "cpu-zentorch", "cuda-nvfp4"};
  int failed = 0, ran = 0;
  fixture_backend_dir = tu_path(tu_builddir(), "plugins/cuda/.libs"); /* the tests' path lacks it */
  for (size_t b = 0; b < sizeof backends / sizeof backends[0]; b++) {
    if (!fixture_backend_usable(backends[b]))
      continue;
    fixture_backend = backends[b];
    printf("backend %s\n", backends[b]);
    failed |= tu_run_suite(reload_suite(backends[b]), CK_NORMAL) != EXIT_SUCCESS;
    ran++;
  }
  free(fixture_backend_dir);
  return ran && !failed ? EXIT_SUCCESS : EXIT_FAILURE;
}
