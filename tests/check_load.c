/*
 * check_load.c: the whole flow on unquantized checkpoints through the
 * reference backend: load, census, checkpoint names resolving, apply against
 * an oracle computed here from the written values, digests, and failures that
 * leave nothing half-loaded.
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fixture.h"
#include "private.h"
#include "testutil.h"

#define N 24
#define K 40

/* Source values of the test weights, exactly representable in every float dtype. */
static float weight_value(uint64_t seed, int64_t i) {
  uint64_t s = seed * 1000003u + (uint64_t)i;
  return (float)((int)(tu_rand(&s) % 33) - 16) / 64.0f;
}

static void encode(enum qkeep_dtype dtype, const float *src, void *dst, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (dtype == QKEEP_DTYPE_F32)
      ((float *)dst)[i] = src[i];
    else if (dtype == QKEEP_DTYPE_BF16)
      ((uint16_t *)dst)[i] = qk_f32_to_bf16(src[i]);
    else
      ((uint16_t *)dst)[i] = qk_f32_to_f16(src[i]);
  }
}

/* Writes a checkpoint with linear layers a (with bias) and b, a norm, and an embedding. */
static char *write_ckpt(const char *file, enum qkeep_dtype dtype, uint64_t seed) {
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  float wv[N * K], bv[N];
  unsigned char buf[N * K * 4];
  for (int i = 0; i < N * K; i++)
    wv[i] = weight_value(seed, i);
  for (int i = 0; i < N; i++)
    bv[i] = weight_value(seed + 7, i);
  struct qkeep_spec ws = {dtype, 2, {N, K}}, bs = {dtype, 1, {N}};
  encode(dtype, wv, buf, N * K);
  ck_assert_int_eq(st_writer_add(w, "model.layers.0.mlp.a_proj.weight", &ws, buf), 0);
  ck_assert_int_eq(st_writer_add(w, "model.layers.0.mlp.b_proj.weight", &ws, buf), 0);
  encode(dtype, bv, buf, N);
  ck_assert_int_eq(st_writer_add(w, "model.layers.0.mlp.a_proj.bias", &bs, buf), 0);
  ck_assert_int_eq(st_writer_add(w, "model.norm.weight", &bs, buf), 0);
  encode(dtype, wv, buf, N * K);
  ck_assert_int_eq(st_writer_add(w, "model.embed_tokens.weight", &ws, buf), 0);
  char *path = tu_path(dir, file);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  return path;
}

static void check_dtype(enum qkeep_dtype dtype) {
  char *path = write_ckpt("m.safetensors", dtype, 3);
  qkeep_model *m = load(path);
  ck_assert_uint_eq(qkeep_model_layer_count(m), 4);
  struct qkeep_census c = tu_assert_census_clean(m);
  ck_assert_int_eq(c.loader_params, 5);
  ck_assert_int_eq(c.total_bytes, (int64_t)(3 * N * K + 2 * N) * (int64_t)qkeep_dtype_size(dtype));

  /* Every checkpoint name resolves to its param, and the bytes are the checkpoint's. */
  qkeep_layer *a = qkeep_model_find_layer(m, "model.layers.0.mlp.a_proj");
  ck_assert_ptr_nonnull(a);
  qkeep_layer *found;
  ck_assert_ptr_eq(qkeep_model_lookup(m, "model.layers.0.mlp.a_proj.bias", &found),
                   qkeep_param_lookup(a, "bias"));
  ck_assert_ptr_eq(found, a);
  struct qkeep_layer_info info = {.size = sizeof info};
  ck_assert_int_eq(qkeep_layer_get_info(a, &info), 0);
  ck_assert_int_eq(info.kind, QKEEP_LAYER_LINEAR);
  ck_assert_int_eq(info.n, N);
  ck_assert_int_eq(info.k, K);
  ck_assert_int_eq(qkeep_model_find_layer(m, "model.embed_tokens")->kind, QKEEP_LAYER_EMBEDDING);
  ck_assert_int_eq(qkeep_model_find_layer(m, "model.norm")->kind, QKEEP_LAYER_OTHER);

  /* apply against y = x W^T + b computed here from the source values. */
  enum { M = 3 };
  float x[M * K], y[M * N];
  uint64_t rng = 99;
  for (int i = 0; i < M * K; i++)
    x[i] = tu_randf(&rng);
  ck_assert_msg(qkeep_layer_apply_f32(a, M, x, y) == 0, "%s", qkeep_errmsg());
  for (int r = 0; r < M; r++)
    for (int n = 0; n < N; n++) {
      double ref = weight_value(3 + 7, n);
      for (int k = 0; k < K; k++)
        ref += (double)x[r * K + k] * weight_value(3, n * K + k);
      ck_assert_double_eq_tol(y[r * N + n], ref, 1e-5);
    }
  ck_assert_int_eq(qkeep_layer_apply_f32(qkeep_model_find_layer(m, "model.norm"), 1, x, y),
                   QKEEP_E_UNSUPPORTED);
  qkeep_model_free(m);
  free(path);
}

START_TEST(loads_f32) { check_dtype(QKEEP_DTYPE_F32); }
END_TEST
START_TEST(loads_bf16) { check_dtype(QKEEP_DTYPE_BF16); }
END_TEST
START_TEST(loads_f16) { check_dtype(QKEEP_DTYPE_F16); }
END_TEST

START_TEST(digest_is_stable_and_tracks_content) {
  char *p1 = write_ckpt("a.safetensors", QKEEP_DTYPE_BF16, 1);
  char *p2 = write_ckpt("b.safetensors", QKEEP_DTYPE_BF16, 2);
  qkeep_model *m1 = load(p1), *m1b = load(p1), *m2 = load(p2);
  struct qkeep_digest d1, d1b, d2;
  ck_assert_int_eq(qkeep_digest(m1, &d1), 0);
  ck_assert_int_eq(qkeep_digest(m1b, &d1b), 0);
  ck_assert_int_eq(qkeep_digest(m2, &d2), 0);
  ck_assert(d1.hi == d1b.hi && d1.lo == d1b.lo);
  ck_assert(d1.hi != d2.hi || d1.lo != d2.lo);
  qkeep_model_free(m1);
  qkeep_model_free(m1b);
  qkeep_model_free(m2);
  free(p1);
  free(p2);
}
END_TEST

START_TEST(host_only_model_loads_without_a_backend) {
  char *path = write_ckpt("h.safetensors", QKEEP_DTYPE_F32, 5);
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(NULL, &m), 0);
  ck_assert_int_eq(qkeep_model_load(m, path), 0);
  ck_assert_int_eq(qkeep_model_load(m, path), QKEEP_E_STATE);
  float x[K] = {0}, y[N];
  ck_assert_int_eq(qkeep_layer_apply_f32(qkeep_model_layer(m, 0), 1, x, y), QKEEP_E_UNSUPPORTED);
  qkeep_model_free(m);
  free(path);
}
END_TEST

/* A failed load leaves the model empty and the error names the file and tensor. */
static void expect_failure(const char *path, int code, const char *needle) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  ck_assert_int_eq(qkeep_model_load(m, path), code);
  ck_assert_msg(strstr(qkeep_errmsg(), needle) != NULL, "'%s' not in '%s'", needle, qkeep_errmsg());
  ck_assert_uint_eq(qkeep_model_layer_count(m), 0);
  qkeep_model_free(m);
}

START_TEST(failures_leave_nothing_half_loaded) {
  char *missing = tu_path(dir, "absent.safetensors");
  expect_failure(missing, QKEEP_E_NOTFOUND, "absent.safetensors");

  struct st_writer *w;
  unsigned char bytes[N * K * 4] = {0};
  struct qkeep_spec short_bias = {QKEEP_DTYPE_F32, 1, {N - 1}};
  struct qkeep_spec f32 = {QKEEP_DTYPE_F32, 2, {N, K}};
  ck_assert_int_eq(st_writer_new(&w), 0);
  ck_assert_int_eq(st_writer_add(w, "model.a.weight", &f32, bytes), 0);
  ck_assert_int_eq(st_writer_add(w, "model.b.weight", &f32, bytes), 0);
  ck_assert_int_eq(st_writer_add(w, "model.b.bias", &short_bias, bytes), 0);
  char *bad = tu_path(dir, "int.safetensors");
  ck_assert_int_eq(st_writer_write(w, bad), 0);
  st_writer_free(w);
  expect_failure(bad, QKEEP_E_FORMAT, "model.b.bias");

  ck_assert_int_eq(st_writer_new(&w), 0);
  ck_assert_int_eq(st_writer_add(w, "toplevel", &f32, bytes), 0);
  char *noprefix = tu_path(dir, "noprefix.safetensors");
  ck_assert_int_eq(st_writer_write(w, noprefix), 0);
  st_writer_free(w);
  /* A name without a module prefix is a plain tensor of the model, not a malformed file. */
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  ck_assert_msg(qkeep_model_load(m, noprefix) == 0, "%s", qkeep_errmsg());
  ck_assert_ptr_nonnull(qkeep_model_lookup(m, "toplevel", NULL));
  qkeep_model_free(m);
  free(missing);
  free(bad);
  free(noprefix);
}
END_TEST

/* Truncates the checkpoint to its first `keep` bytes once the first layer is in (after the open, while
 * the load or reload is reading). */
struct truncation {
  const char *path;
  size_t keep;
  int calls;
};

static void truncate_after_first_layer(void *user, size_t done, size_t total, const char *layer) {
  struct truncation *t = user;
  (void)total, (void)layer;
  if (done == 1 && t->calls++ == 0)
    ck_assert_int_eq(truncate(t->path, (off_t)t->keep), 0);
}

/* The file shrinks after the open, while layers are being read: the load fails naming the file and
 * keeps nothing; a reload fails the same way and rolls back to W0. (This test used to truncate before
 * opening, so the open itself refused the file and nothing after it ran.) */
START_TEST(bytes_changed_after_open_fail_cleanly) {
  char *path = write_ckpt("t.safetensors", QKEEP_DTYPE_F32, 4);
  size_t n;
  unsigned char *data = tu_read_file(path, &n);
  ck_assert_ptr_nonnull(data);
  uint64_t header = 0;
  for (int i = 7; i >= 0; i--)
    header = header << 8 | data[i];
  struct truncation t = {path, (size_t)(8 + header + 4), 0};
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  qkeep_model_set_progress(m, truncate_after_first_layer, &t);
  ck_assert_int_eq(qkeep_model_load(m, path), QKEEP_E_IO);
  ck_assert_int_eq(t.calls, 1); /* the truncation happened mid-load, after the open */
  ck_assert_msg(strstr(qkeep_errmsg(), "t.safetensors"), "%s", qkeep_errmsg());
  ck_assert_uint_eq(qkeep_model_layer_count(m), 0);
  qkeep_model_free(m);

  /* A reload: W1 shrinks while it is being applied. */
  ck_assert_int_eq(tu_write_file(path, data, n), 0);
  char *w0 = write_ckpt("w0.safetensors", QKEEP_DTYPE_F32, 5);
  m = load(w0);
  struct qkeep_digest d0, now;
  ck_assert_int_eq(qkeep_digest(m, &d0), 0);
  t.calls = 0;
  qkeep_model_set_progress(m, truncate_after_first_layer, &t);
  ck_assert_int_eq(qkeep_model_reload(m, path, 0), QKEEP_E_IO);
  ck_assert_int_ge(t.calls, 1); /* and once more for the rollback's first layer: truncated once */
  ck_assert_msg(strstr(qkeep_errmsg(), "t.safetensors") && strstr(qkeep_errmsg(), "rolled back"), "%s",
                qkeep_errmsg());
  ck_assert_int_eq(qkeep_digest(m, &now), 0);
  ck_assert(now.hi == d0.hi && now.lo == d0.lo);
  qkeep_model_free(m);
  free(data);
  free(path);
  free(w0);
}
END_TEST

/* What a one-byte scale is, by the formats' definitions (the oracle for bad_scales' word-wide scan). */
static bool byte_is_bad(enum qkeep_dtype dtype, unsigned b) {
  if (dtype == QKEEP_DTYPE_F8_E4M3)
    return (b & 0x7f) == 0x7f || ((b & 0x80) && (b & 0x7f)); /* NaN, or negative and not -0 */
  return b == 0xff;                                          /* e8m0's NaN */
}

/* Every byte value at every position of runs of 1..40 good bytes and of runs around the scan's 32-byte
 * steps (the vector body, its tail, two steps): found, and the first one named. */
START_TEST(one_byte_scales_are_judged_at_every_position) {
  static const enum qkeep_dtype dtypes[] = {QKEEP_DTYPE_F8_E4M3, QKEEP_DTYPE_F8_E8M0, QKEEP_DTYPE_U8};
  static const size_t longer[] = {47, 63, 64, 65, 95, 96, 97};
  unsigned char buf[97];
  for (size_t d = 0; d < 3; d++)
    for (size_t ni = 0; ni < 40 + sizeof longer / sizeof longer[0]; ni++)
      for (size_t n = ni < 40 ? ni + 1 : longer[ni - 40], at = 0; at < n; at++)
        for (unsigned v = 0; v < 256; v++) {
          for (size_t i = 0; i < n; i++)
            buf[i] = (unsigned char)(0x38 + i % 3); /* good in all three */
          buf[at] = (unsigned char)v;
          size_t index = 99;
          const char *why = bad_scales(dtypes[d], buf, n, &(struct scale_rule){0}, &index);
          ck_assert_msg((why != NULL) == byte_is_bad(dtypes[d], v), "dtype %d byte 0x%02x at %zu of %zu",
                        dtypes[d], v, at, n);
          if (why)
            ck_assert_uint_eq(index, at);
        }
}
END_TEST

/* ---- which params a load writes whole (layer_find_covered): they get memory that is not zeroed ---- */

/* One source of the layouts below: rows x row_bytes from dst_offset, dst_stride apart. */
struct piece {
  size_t offset, rows, row_bytes, stride;
  bool compare_only;
};

/* Whether the pieces write each of the param's `bytes` exactly once (the oracle: a count per byte). */
static bool writes_each_byte_once(const struct piece *pc, size_t n, size_t bytes) {
  unsigned char count[256] = {0};
  ck_assert_uint_le(bytes, sizeof count);
  for (size_t i = 0; i < n; i++)
    for (size_t r = 0; r < pc[i].rows && !pc[i].compare_only; r++)
      for (size_t b = 0; b < pc[i].row_bytes; b++)
        count[pc[i].offset + r * pc[i].stride + b]++;
  for (size_t b = 0; b < bytes; b++)
    if (count[b] != 1)
      return false;
  return true;
}

/* layer_find_covered's answer for one param of `bytes` with the pieces as its sources (-1: a piece the layer
 * refuses, which does not fit the param). */
static int covered_by(const struct piece *pc, size_t n, size_t bytes) {
  qkeep_model *m;
  qkeep_layer *l;
  qkeep_param *p;
  ck_assert_int_eq(qkeep_model_new(NULL, &m), 0);
  ck_assert_int_eq(qkeep_layer_add(m, "l", QKEEP_LAYER_LINEAR, NULL, &l), 0);
  struct qkeep_spec spec = {QKEEP_DTYPE_U8, 1, {(int64_t)bytes}};
  ck_assert_int_eq(qkeep_param_create(l, "p", &spec, &p), 0);
  /* a second param, written whole, among the sources: answers stay per param */
  struct qkeep_spec other = {QKEEP_DTYPE_U8, 1, {8}};
  ck_assert_int_eq(qkeep_param_create(l, "q", &other, NULL), 0);
  ck_assert_int_eq(layer_add_source(l, "q.src", qkeep_param_lookup(l, "q"), 0, &other), 0);
  int answer = 0;
  for (size_t i = 0; i < n && answer == 0; i++) {
    char name[32];
    snprintf(name, sizeof name, "src%zu", i);
    struct qkeep_spec s = {QKEEP_DTYPE_U8, 1, {(int64_t)(pc[i].rows * pc[i].row_bytes)}};
    if (layer_add_source_strided(l, name, p, pc[i].offset, pc[i].rows, pc[i].row_bytes, pc[i].stride,
                                 pc[i].compare_only, &s) != 0)
      answer = -1;
  }
  bool covered[2] = {true, false};
  if (answer == 0) {
    ck_assert_int_eq(layer_find_covered(l, covered), 0);
    ck_assert_msg(covered[1], "the whole second param");
    answer = covered[0];
  }
  qkeep_model_free(m);
  return answer;
}

START_TEST(a_param_is_left_unzeroed_only_when_its_sources_write_it_whole) {
  /* the layouts loads make: one tensor, row shards one after another, column shards side by side in every
   * row (any order of adding them), experts' slices */
  const struct piece whole[] = {{0, 1, 48, 48, false}};
  const struct piece rows[] = {{16, 1, 24, 24, false}, {0, 1, 16, 16, false}, {40, 1, 8, 8, false}};
  const struct piece cols[] = {{4, 6, 8, 16, false}, {0, 6, 4, 16, false}, {12, 6, 4, 16, false}};
  const struct piece experts[] = {{0, 3, 8, 8, false}, {24, 3, 8, 8, false}};
  ck_assert_int_eq(covered_by(whole, 1, 48), 1);
  ck_assert_int_eq(covered_by(rows, 3, 48), 1);
  ck_assert_int_eq(covered_by(cols, 3, 96), 1);
  ck_assert_int_eq(covered_by(experts, 2, 48), 1);
  /* and what leaves bytes as they were, or writes some twice */
  ck_assert_int_eq(covered_by(rows, 2, 48), 0);     /* a shard missing: a gap */
  ck_assert_int_eq(covered_by(cols + 1, 2, 96), 0); /* columns 4..11 of each row */
  ck_assert_int_eq(covered_by(whole, 1, 49), 0);    /* the last byte */
  ck_assert_int_eq(covered_by(whole, 0, 48), 0);    /* no source */
  const struct piece twice[] = {{0, 1, 48, 48, false}, {8, 1, 8, 8, false}};
  ck_assert_int_eq(covered_by(twice, 2, 48), 0);
  const struct piece compared[] = {{0, 1, 24, 24, false}, {24, 1, 24, 24, true}};
  ck_assert_int_eq(covered_by(compared, 2, 48), 0); /* a compare-only source writes nothing */
  /* Random layouts against the byte count: the answer is never "whole" when a byte is written other than
   * once, and tilings (perturbed or not) get exactly the oracle's answer. */
  uint64_t state = 42;
  for (int trial = 0; trial < 4000; trial++) {
    struct piece pc[6];
    size_t n = 0, bytes;
    bool tiling = trial % 2 == 0;
    if (tiling) { /* a tiling of rows x stride, then maybe one change */
      size_t nrows = 1 + tu_rand(&state) % 4, parts = 1 + tu_rand(&state) % 4, stride = 0;
      bool flat = tu_rand(&state) % 2;
      for (size_t i = 0; i < parts; i++) {
        size_t w = 1 + tu_rand(&state) % 8;
        pc[n++] = (struct piece){stride, flat ? 1 : nrows, flat ? w * nrows : w, flat ? w * nrows : 0, false};
        stride += flat ? w * nrows : w;
      }
      for (size_t i = 0; i < n && !flat; i++)
        pc[i].stride = stride;
      bytes = flat ? stride : stride * nrows;
      for (size_t i = n - 1; i > 0; i--) { /* in any order */
        size_t j = tu_rand(&state) % (i + 1);
        struct piece t = pc[i];
        pc[i] = pc[j], pc[j] = t;
      }
      switch (tu_rand(&state) % 6) {
      case 0: pc[0].offset += pc[0].offset + 1 < bytes ? 1 : 0; break;
      case 1: n--; break;
      case 2: pc[n] = pc[0], n++; break;
      case 3: pc[tu_rand(&state) % n].compare_only = true; break;
      default: break;
      }
    } else { /* anything that fits */
      bytes = 1 + tu_rand(&state) % 64;
      n = tu_rand(&state) % 5;
      for (size_t i = 0; i < n; i++) {
        size_t r = 1 + tu_rand(&state) % 3, w = 1 + tu_rand(&state) % 16, st = w + tu_rand(&state) % 8;
        pc[i] = (struct piece){tu_rand(&state) % bytes, r, w, r == 1 ? w : st, tu_rand(&state) % 8 == 0};
      }
    }
    int answer = covered_by(pc, n, bytes);
    if (answer < 0)
      continue; /* a source that does not fit: the layer refused it, as a load would */
    bool once = writes_each_byte_once(pc, n, bytes);
    ck_assert_msg(!answer || once, "trial %d: called whole, but a byte is written other than once", trial);
    if (tiling)
      ck_assert_msg(answer == once, "trial %d: a tiling (%zu sources, %zu bytes) answered %d", trial, n,
                    bytes, answer);
  }
}
END_TEST

static Suite *load_suite(void) {
  Suite *s = suite_create("load");
  TCase *tc = tcase_create("load");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, loads_f32);
  tcase_add_test(tc, loads_bf16);
  tcase_add_test(tc, loads_f16);
  tcase_add_test(tc, digest_is_stable_and_tracks_content);
  tcase_add_test(tc, host_only_model_loads_without_a_backend);
  tcase_add_test(tc, failures_leave_nothing_half_loaded);
  tcase_add_test(tc, bytes_changed_after_open_fail_cleanly);
  tcase_add_test(tc, one_byte_scales_are_judged_at_every_position);
  tcase_add_test(tc, a_param_is_left_unzeroed_only_when_its_sources_write_it_whole);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  fixture_name = "load";
  return tu_run_suite(load_suite(), CK_NORMAL);
}
