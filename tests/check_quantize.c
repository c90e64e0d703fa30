/*
 * check_quantize.c: qkeep_quantize as a streaming, multi-threaded writer.
 *
 *   - The bytes do not depend on the thread count: every scheme, with and without
 *     sharding (shard boundaries inside the model, fused q/k/v and gate/up split
 *     across shards), at 1, 2 and 5 threads, on tensors whose rows span several row
 *     blocks with a short last one; every file compared byte for byte.
 *   - An independent oracle: the MXFP4 and ModelOpt NVFP4 checkpoints built here in memory
 *     (st_writer_add, the whole-matrix quantizers, NVFP4's fused groups concatenated as
 *     the writer did before streaming) equal the streamed ones byte for byte.
 *   - Memory is bounded: a model of 64 tensors of 1 MiB; the buffers in flight (the
 *     count qkeep_quantize keeps) stay under the bound it states, the bound is a small
 *     fraction of the model, and the process's peak resident memory grows by no more
 *     than the bound (not checked under ASan or valgrind, whose allocators keep freed
 *     memory).
 *   - Errors do not depend on the thread count: a NaN in the last row block of the first
 *     tensor and one in the first block of a later tensor give the first tensor's error
 *     at any thread count, and leave nothing behind.
 *   - st_writer_layout's header and offsets are those of the file st_writer_write writes.
 */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkutil.h"
#include "private.h"
#include "testutil.h"

#define HIDDEN 256
#define KV 64
#define INTER 1056 /* gate/up: 1024 + 32 rows, two row blocks at K = 256; down: K = 1056 */
#define VOCAB 512

/* A bf16 tensor of random weights added to w; nan_at >= 0 plants a NaN there. */
static void add_bf16(struct st_writer *w, const char *name, int64_t n, int64_t k, uint64_t *seed,
                     int64_t nan_at) {
  int64_t count = n * (k ? k : 1);
  uint16_t *v = malloc((size_t)count * 2);
  ck_assert_ptr_nonnull(v);
  /* each tensor and each row of it with its own range (rows grow), so that a scale taken from part of a
   * tensor or of a fused group is not the whole one's */
  float range = 0.05f + 0.05f * (float)(*seed % 7);
  for (int64_t i = 0; i < count; i++)
    v[i] = qkeep_f32_to_bf16(tu_randf(seed) * range * (1.0f + (float)(i / (k ? k : 1)) / (float)n));
  if (nan_at >= 0)
    v[nan_at] = 0x7fc0;
  struct qkeep_spec s = {.dtype = QKEEP_DTYPE_BF16, .ndim = k ? 2 : 1, .shape = {n, k}};
  ck_assert_msg(st_writer_add(w, name, &s, v) == 0, "%s", qkeep_errmsg());
  free(v);
}

/* Two decoder layers (attention and MLP) with norms, an embedding and an lm_head. */
static char *write_model(const char *dir, const char *file) {
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  uint64_t seed = 7;
  add_bf16(w, "model.embed_tokens.weight", VOCAB, HIDDEN, &seed, -1);
  add_bf16(w, "lm_head.weight", VOCAB, HIDDEN, &seed, -1);
  add_bf16(w, "model.norm.weight", HIDDEN, 0, &seed, -1);
  for (int l = 0; l < 2; l++) {
    static const struct {
      const char *name;
      int64_t n, k;
    } t[] = {{"input_layernorm", HIDDEN, 0},       {"self_attn.q_proj", HIDDEN, HIDDEN},
             {"self_attn.k_proj", KV, HIDDEN},     {"self_attn.v_proj", KV, HIDDEN},
             {"self_attn.o_proj", HIDDEN, HIDDEN}, {"mlp.gate_proj", INTER, HIDDEN},
             {"mlp.up_proj", INTER, HIDDEN},       {"mlp.down_proj", HIDDEN, INTER}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
      char name[128];
      snprintf(name, sizeof name, "model.layers.%d.%s.weight", l, t[i].name);
      add_bf16(w, name, t[i].n, t[i].k, &seed, -1);
    }
  }
  char *path = tu_path(dir, file);
  ck_assert_msg(st_writer_write(w, path) == 0, "%s", qkeep_errmsg());
  st_writer_free(w);
  return path;
}

/* Every file of two directories, by name, byte for byte. */
static void assert_same_dirs(const char *a, const char *b, const char *what) {
  DIR *d = opendir(a);
  ck_assert_ptr_nonnull(d);
  int files = 0;
  for (struct dirent *e; (e = readdir(d));) {
    if (e->d_name[0] == '.')
      continue;
    char *pa = tu_path(a, e->d_name), *pb = tu_path(b, e->d_name);
    size_t na, nb;
    void *x = tu_read_file(pa, &na), *y = tu_read_file(pb, &nb);
    ck_assert_msg(x && y, "%s: %s missing", what, e->d_name);
    ck_assert_msg(na == nb && memcmp(x, y, na) == 0, "%s: %s differs", what, e->d_name);
    free(x);
    free(y);
    free(pa);
    free(pb);
    files++;
  }
  closedir(d);
  /* and nothing more in b */
  d = opendir(b);
  for (struct dirent *e; (e = readdir(d));)
    files -= e->d_name[0] != '.';
  closedir(d);
  ck_assert_msg(files == 0, "%s: the directories hold different files", what);
}

static struct qkeep_quantize_options options(const char *scheme, int threads, int64_t shard_bytes) {
  return (struct qkeep_quantize_options){.size = sizeof(struct qkeep_quantize_options),
                                         .scheme = scheme,
                                         .group_size = 32,
                                         .asym_weights = strcmp(scheme, "ct-int4") == 0,
                                         .static_input = true,
                                         .asym_input = true,
                                         .kv_cache_scales = true,
                                         .activation_amax = 3,
                                         .max_shard_bytes = shard_bytes,
                                         .threads = threads};
}

static const char *const all_schemes[] = {"modelopt-nvfp4", "ct-nvfp4", "mxfp4",  "w8a8-int8",
                                          "gptq-int4",      "awq-int4", "ct-int4"};

START_TEST(every_thread_count_writes_the_same_bytes) {
  const char *scheme = all_schemes[_i];
  char *dir = tu_tmpdir("threads");
  char *model = write_model(dir, "model.safetensors");
  static const int64_t shards[] = {0, 300000}; /* unsharded, then about 8 shards */
  for (size_t s = 0; s < 2; s++) {
    char *one = NULL;
    static const int threads[] = {1, 2, 5};
    for (size_t t = 0; t < 3; t++) {
      /* Under a memory checker 1 and 5 threads: 2 runs the code of 5 with fewer workers (plain make check
       * runs all three). */
      if (tu_under_memcheck() && threads[t] == 2)
        continue;
      char name[64];
      snprintf(name, sizeof name, "out-%zu-%d", s, threads[t]);
      char *out = tu_path(dir, name);
      struct qkeep_quantize_progress sum = {.size = sizeof sum};
      struct qkeep_quantize_options o = options(scheme, threads[t], shards[s]);
      o.summary = &sum;
      ck_assert_msg(qkeep_quantize(model, out, &o) == 0, "%s, %d threads: %s", scheme, threads[t],
                    qkeep_errmsg());
      ck_assert_int_eq(sum.threads, threads[t]);
      ck_assert_int_eq(sum.tensors_done, sum.tensors_total);
      char *index = tu_path(out, "model.safetensors.index.json");
      ck_assert_int_eq(access(index, F_OK) == 0, shards[s] > 0); /* sharded only when asked */
      free(index);
      if (!one)
        one = out;
      else {
        char what[96];
        snprintf(what, sizeof what, "%s, shards %lld, 1 vs %d threads", scheme, (long long)shards[s],
                 threads[t]);
        assert_same_dirs(one, out, what);
        free(out);
      }
    }
    free(one);
  }
  free(model);
  tu_rmtree(dir);
  free(dir);
}
END_TEST

/* A linear weight's f32 values (bf16 in the file). */
static float *read_f32(const struct ckpt *ck, const char *name, int64_t *n, int64_t *k) {
  const struct ckpt_tensor *t = ckpt_find(ck, name);
  ck_assert_ptr_nonnull(t);
  *n = t->t->shape[0];
  *k = t->t->shape[1];
  uint16_t *raw = malloc(t->t->nbytes);
  float *f = malloc((size_t)(*n * *k) * sizeof *f);
  ck_assert_int_eq(ckpt_read(ck, t, raw), 0);
  for (int64_t e = 0; e < *n * *k; e++)
    f[e] = qkeep_bf16_to_f32(raw[e]);
  free(raw);
  return f;
}

/* NVFP4 the way it was written before streaming: the fused group (q/k/v or gate/up) as one matrix, rows in
 * the group's order, quantized whole; then this member's rows. */
static void add_nvfp4_oracle(struct st_writer *w, const struct ckpt *ck, const char *name) {
  static const char *const groups[][3] = {{"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj", NULL}};
  size_t len = strlen(name);
  const char *member = name + len - 7;
  while (member[-1] != '.')
    member--;
  int parent_len = (int)(member - name - 1), n_group = 1, mine = 0;
  char group[3][160];
  snprintf(group[0], sizeof group[0], "%s", name);
  for (int r = 0; r < 2; r++)
    for (int m = 0; m < 3 && groups[r][m]; m++)
      if (strncmp(member, groups[r][m], strlen(groups[r][m])) == 0 && member[strlen(groups[r][m])] == '.') {
        n_group = 0;
        for (int x = 0; x < 3 && groups[r][x]; x++) {
          snprintf(group[x], sizeof group[x], "%.*s.%s.weight", parent_len, name, groups[r][x]);
          n_group++;
        }
        mine = m;
      }
  int64_t rows = 0, k = 0, before = 0, n_mine = 0;
  float *all = NULL;
  for (int g = 0; g < n_group; g++) {
    int64_t n;
    float *f = read_f32(ck, group[g], &n, &k);
    all = realloc(all, (size_t)((rows + n) * k) * sizeof *all);
    memcpy(all + rows * k, f, (size_t)(n * k) * sizeof *f);
    free(f);
    if (g == mine) {
      before = rows;
      n_mine = n;
    }
    rows += n;
  }
  uint8_t *packed = malloc((size_t)(rows * k / 2)), *scales = malloc((size_t)(rows * k / 16));
  float global, input = 1.0f / 2688.0f;
  ck_assert_int_eq(quant_nvfp4(all, rows, k, false, packed, scales, &global), 0);
  char out[200];
  struct qkeep_spec ps = {QKEEP_DTYPE_U8, 2, {n_mine, k / 2}},
                    ss = {QKEEP_DTYPE_F8_E4M3, 2, {n_mine, k / 16}}, scalar = {QKEEP_DTYPE_F32, 0, {0}};
  snprintf(out, sizeof out, "%.*s.weight", (int)(len - 7), name);
  ck_assert_int_eq(st_writer_add(w, out, &ps, packed + before * k / 2), 0);
  snprintf(out, sizeof out, "%.*s.weight_scale", (int)(len - 7), name);
  ck_assert_int_eq(st_writer_add(w, out, &ss, scales + before * k / 16), 0);
  snprintf(out, sizeof out, "%.*s.weight_scale_2", (int)(len - 7), name);
  ck_assert_int_eq(st_writer_add(w, out, &scalar, &global), 0);
  snprintf(out, sizeof out, "%.*s.input_scale", (int)(len - 7), name);
  ck_assert_int_eq(st_writer_add(w, out, &scalar, &input), 0);
  free(all);
  free(packed);
  free(scales);
}

static void add_mxfp4_oracle(struct st_writer *w, const struct ckpt *ck, const char *name) {
  int64_t n, k;
  float *f = read_f32(ck, name, &n, &k);
  uint8_t *packed = malloc((size_t)(n * k / 2)), *scales = malloc((size_t)(n * k / 32));
  ck_assert_int_eq(quant_mxfp4(f, n, k, packed, scales), 0);
  char out[200];
  size_t len = strlen(name);
  struct qkeep_spec ps = {QKEEP_DTYPE_U8, 2, {n, k / 2}}, ss = {QKEEP_DTYPE_U8, 2, {n, k / 32}};
  snprintf(out, sizeof out, "%.*s.weight_packed", (int)(len - 7), name);
  ck_assert_int_eq(st_writer_add(w, out, &ps, packed), 0);
  snprintf(out, sizeof out, "%.*s.weight_scale", (int)(len - 7), name);
  ck_assert_int_eq(st_writer_add(w, out, &ss, scales), 0);
  free(f);
  free(packed);
  free(scales);
}

/* The checkpoint built here, in memory, from whole-matrix quantization (st_writer_write's layout, the
 * quantizers' bytes, the scheme's names): the oracle of the streamed file, for MXFP4 and for ModelOpt NVFP4
 * with its fused groups sharing one global scale. */
START_TEST(streamed_file_equals_one_built_in_memory) {
  const char *scheme = _i == 0 ? "mxfp4" : "modelopt-nvfp4";
  char *dir = tu_tmpdir("oracle");
  char *model = write_model(dir, "model.safetensors");
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(model, &ck), 0);
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  for (size_t i = 0; i < ck->n_tensors; i++) {
    const struct st_tensor *t = ck->tensors[i].t;
    size_t len = strlen(t->name);
    bool linear = t->ndim == 2 && strstr(t->name, "layers.") && strcmp(t->name + len - 7, ".weight") == 0;
    if (linear && _i == 0)
      add_mxfp4_oracle(w, ck, t->name);
    else if (linear)
      add_nvfp4_oracle(w, ck, t->name);
    else {
      void *raw = malloc(t->nbytes);
      ck_assert_int_eq(ckpt_read(ck, &ck->tensors[i], raw), 0);
      struct qkeep_spec s = {
          .dtype = (enum qkeep_dtype)t->dtype, .ndim = t->ndim, .shape = {t->shape[0], t->shape[1]}};
      ck_assert_int_eq(st_writer_add(w, t->name, &s, raw), 0);
      free(raw);
    }
  }
  char *expected = tu_path(dir, "expected.safetensors"), *out = tu_path(dir, "out");
  ck_assert_int_eq(st_writer_write(w, expected), 0);
  st_writer_free(w);
  ckpt_close(ck);
  struct qkeep_quantize_options o = {.size = sizeof o, .scheme = scheme, .threads = 3};
  ck_assert_msg(qkeep_quantize(model, out, &o) == 0, "%s", qkeep_errmsg());
  char *got = tu_path(out, "model.safetensors");
  size_t na, nb;
  void *a = tu_read_file(expected, &na), *b = tu_read_file(got, &nb);
  ck_assert(a && b);
  ck_assert_msg(na == nb && memcmp(a, b, na) == 0, "the streamed %s file differs from the in-memory one",
                scheme);
  free(a);
  free(b);
  free(got);
  free(expected);
  free(out);
  free(model);
  tu_rmtree(dir);
  free(dir);
}
END_TEST

/* ASan's allocator keeps freed memory in quarantine (and TSan's shadows it), so resident memory says
 * nothing there. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
static const bool under_asan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
static const bool under_asan = true;
#else
static const bool under_asan = false;
#endif
#else
static const bool under_asan = false;
#endif

START_TEST(memory_stays_under_the_stated_bound) {
  char *dir = tu_tmpdir("memory");
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  uint64_t seed = 3;
  int tensors = tu_under_valgrind() ? 16 : 64; /* 1 MiB each */
  for (int i = 0; i < tensors; i++) {
    char name[96];
    snprintf(name, sizeof name, "model.layers.%d.mlp.down_proj.weight", i);
    add_bf16(w, name, 256, 2048, &seed, -1);
  }
  char *model = tu_path(dir, "model.safetensors"), *out = tu_path(dir, "out");
  ck_assert_int_eq(st_writer_write(w, model), 0);
  st_writer_free(w);
  int64_t model_bytes = (int64_t)tensors << 20;
  struct qkeep_quantize_progress sum = {.size = sizeof sum};
  struct qkeep_quantize_options o = {.size = sizeof o, .scheme = "w8a8-int8", .threads = 2, .summary = &sum};
  FILE *clear = fopen("/proc/self/clear_refs", "w"); /* VmHWM back to VmRSS */
  bool peak_reset = clear && fputs("5", clear) >= 0;
  if (clear)
    peak_reset = fclose(clear) == 0 && peak_reset;
  long long rss_before = tu_status_bytes("VmRSS");
  ck_assert_msg(qkeep_quantize(model, out, &o) == 0, "%s", qkeep_errmsg());
  long long hwm = tu_status_bytes("VmHWM");
  /* the count: one unit is 1 MiB of bf16 in, 0.5 MiB of int8 and 1 KiB of scales out */
  int64_t unit = (1 << 20) + (1 << 19) + 256 * 4;
  ck_assert_int_gt(sum.peak_buffer_bytes, 0);
  ck_assert_int_le(sum.peak_buffer_bytes, 2 * unit);
  ck_assert_int_le(sum.buffer_bound, 2 * unit + 2 * (1 << 20) + (8 << 20));
  if (!tu_under_valgrind())
    ck_assert_int_le(sum.buffer_bound * 4, model_bytes); /* a small part of the model */
  if (!under_asan && peak_reset && rss_before > 0 && hwm > 0 && !tu_under_valgrind())
    ck_assert_msg(hwm - rss_before <= sum.buffer_bound + (4 << 20),
                  "peak RSS grew by %lld bytes, over the bound %lld (+4 MiB); the model is %lld bytes",
                  hwm - rss_before, (long long)sum.buffer_bound, (long long)model_bytes);
  free(model);
  free(out);
  tu_rmtree(dir);
  free(dir);
}
END_TEST

/* Entries of dir other than "." and "..". */
static int entries(const char *dir) {
  DIR *d = opendir(dir);
  ck_assert_ptr_nonnull(d);
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
  closedir(d);
  return n;
}

/* Stops after `after` polls. */
static int cancel_after(void *user) {
  int *polls = user;
  return --*polls < 0;
}

/* The output appears whole or not at all: a cancelled run (at its first poll or later) leaves no
 * file, staging directory or parent it made; an existing output is refused, replaced only when asked
 * and only when it holds nothing but an output; missing parents are made. */
START_TEST(the_output_appears_whole_or_not_at_all) {
  char *dir = tu_tmpdir("publish");
  char *model = write_model(dir, "model.safetensors");
  char *parent = tu_path(dir, "new"), *out = tu_path(dir, "new/deeper/out");
  for (int after = 0; after < 4; after++) {
    int polls = after;
    struct qkeep_quantize_options o = options("w8a8-int8", 2, 300000);
    o.cancel = cancel_after;
    o.cancel_user = &polls;
    ck_assert_int_eq(qkeep_quantize(model, out, &o), QKEEP_E_INTERRUPTED);
    ck_assert_msg(strstr(qkeep_errmsg(), out) != NULL, "%s", qkeep_errmsg());
    ck_assert_int_ne(access(parent, F_OK), 0);
    ck_assert_int_eq(entries(dir), 1); /* the model alone */
  }
  struct qkeep_quantize_options o = options("w8a8-int8", 2, 0);
  ck_assert_msg(qkeep_quantize(model, out, &o) == 0, "%s", qkeep_errmsg());
  char *file = tu_path(out, "model.safetensors");
  size_t len;
  char *first = tu_read_file(file, &len);
  ck_assert_ptr_nonnull(first);
  ck_assert_int_eq(qkeep_quantize(model, out, &o), QKEEP_E_EXISTS);
  o = options("mxfp4", 1, 0);
  o.replace_existing = true;
  ck_assert_msg(qkeep_quantize(model, out, &o) == 0, "%s", qkeep_errmsg());
  size_t len2;
  char *second = tu_read_file(file, &len2);
  ck_assert(len2 != len || memcmp(first, second, len) != 0); /* the mxfp4 output now */
  char *deeper = tu_path(dir, "new/deeper");
  ck_assert_int_eq(entries(deeper), 1); /* no staging directory beside it */
  free(deeper);
  char *notes = tu_path(out, "notes.txt");
  ck_assert_int_eq(tu_write_file(notes, "x", 1), 0);
  ck_assert_int_eq(qkeep_quantize(model, out, &o), QKEEP_E_EXISTS);
  ck_assert_msg(strstr(qkeep_errmsg(), "notes.txt"), "%s", qkeep_errmsg());
  ck_assert_int_eq(access(notes, F_OK), 0);
  ck_assert_int_eq(
      qkeep_quantize(model, out, &(struct qkeep_quantize_options){.size = sizeof o, .scheme = "fp8"}),
      QKEEP_E_UNSUPPORTED);
  ck_assert_msg(strstr(qkeep_errmsg(), "mxfp4"), "%s", qkeep_errmsg());
  free(first);
  free(second);
  free(notes);
  free(file);
  free(out);
  free(parent);
  free(model);
  tu_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(the_first_error_wins_at_any_thread_count) {
  char *dir = tu_tmpdir("errors");
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  uint64_t seed = 5;
  /* sorted: layers.0 before layers.1; layers.0's NaN is in its last row block (row 1040), layers.1's in its
   * first (row 0) */
  add_bf16(w, "model.layers.0.mlp.gate_proj.weight", INTER, HIDDEN, &seed, 1040 * HIDDEN + 17);
  add_bf16(w, "model.layers.1.mlp.gate_proj.weight", INTER, HIDDEN, &seed, 3);
  char *model = tu_path(dir, "model.safetensors");
  ck_assert_int_eq(st_writer_write(w, model), 0);
  st_writer_free(w);
  for (size_t s = 0; s < sizeof all_schemes / sizeof all_schemes[0]; s++)
    for (int threads = 1; threads <= 4; threads += 3) {
      char *out = tu_path(dir, "out");
      struct qkeep_quantize_options o = options(all_schemes[s], threads, 0);
      ck_assert_int_eq(qkeep_quantize(model, out, &o), QKEEP_E_INVAL);
      const char *msg = qkeep_errmsg();
      ck_assert_msg(strstr(msg, "'model.layers.0.mlp.gate_proj.weight'") &&
                        strstr(msg, "row 1040, column 17") && strstr(msg, "NaN"),
                    "%s, %d threads: %s", all_schemes[s], threads, msg);
      ck_assert_int_ne(access(out, F_OK), 0); /* nothing left */
      free(out);
    }
  free(model);
  tu_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(layout_is_the_written_file) {
  char *dir = tu_tmpdir("layout");
  struct st_writer *full, *planned;
  ck_assert_int_eq(st_writer_new(&full), 0);
  ck_assert_int_eq(st_writer_new(&planned), 0);
  static const struct qkeep_spec specs[] = {{QKEEP_DTYPE_U8, 1, {5}},         {QKEEP_DTYPE_F32, 2, {3, 2}},
                                            {QKEEP_DTYPE_BF16, 1, {7}},       {QKEEP_DTYPE_I64, 0, {0}},
                                            {QKEEP_DTYPE_F8_E4M3, 2, {2, 3}}, {QKEEP_DTYPE_U8, 1, {0}}};
  static const char *const names[] = {"z.codes", "b.scale", "a.weight", "c.shape", "d.block", "e.empty"};
  unsigned char bytes[64];
  for (int i = 0; i < 64; i++)
    bytes[i] = (unsigned char)(i * 37 + 1);
  for (int i = 0; i < 6; i++) {
    ck_assert_int_eq(st_writer_add(full, names[i], &specs[i], bytes), 0);
    ck_assert_int_eq(st_writer_plan(planned, names[i], &specs[i]), 0);
  }
  ck_assert_int_eq(st_writer_plan(planned, names[0], &specs[0]), QKEEP_E_EXISTS);
  char *path = tu_path(dir, "full.safetensors");
  ck_assert_int_eq(st_writer_write(full, path), 0);
  ck_assert_int_eq(st_writer_write(planned, path), QKEEP_E_INVAL); /* no bytes to write */
  struct st_layout lay;
  ck_assert_int_eq(st_writer_layout(planned, &lay), 0);
  size_t n;
  unsigned char *file = tu_read_file(path, &n);
  ck_assert_ptr_nonnull(file);
  ck_assert_uint_eq(lay.file_size, n);
  ck_assert_mem_eq(file, lay.header, lay.header_len);
  for (int i = 0; i < 6; i++) {
    size_t nbytes;
    ck_assert(spec_bytes_checked(&specs[i], &nbytes));
    ck_assert_uint_le(lay.offsets[i] + nbytes, n);
    if (nbytes)
      ck_assert_mem_eq(file + lay.offsets[i], bytes, nbytes);
  }
  free(file);
  st_layout_free(&lay);
  st_writer_free(full);
  st_writer_free(planned);
  free(path);
  tu_rmtree(dir);
  free(dir);
}
END_TEST

/* The NVFP4 quantizer's own e4m3 decode (no libm) against the shared one, bit for bit. */
START_TEST(e4m3_values_are_the_decoders) {
  for (int b = 0; b < 256; b++) {
    if ((b & 0x7f) == 0x7f)
      continue; /* NaN */
    float mine = quant_e4m3_value((uint8_t)b), theirs = qkeep_e4m3_to_f32((uint8_t)b);
    ck_assert_msg(memcmp(&mine, &theirs, sizeof mine) == 0, "byte 0x%02x: %g, expected %g", b, (double)mine,
                  (double)theirs);
  }
}
END_TEST

/* `quantize DIR/model.safetensors` read DIR/config.json with json_load_file: a FIFO there hung it
 * after all the work, and a link to a file outside DIR had that file's keys copied into the output's
 * config.json. It is read first, under the directory's own rules (links stay inside its tree, regular
 * files only); alarm() makes a hang fail. */
START_TEST(the_input_config_json_follows_the_directorys_rules) {
  char *dir = tu_tmpdir("inconfig");
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  uint64_t seed = 3;
  add_bf16(w, "model.layers.0.mlp.down_proj.weight", 64, 64, &seed, -1);
  char *in_dir = tu_path(dir, "in"), *outside = tu_path(dir, "outside.json");
  ck_assert_int_eq(mkdir(in_dir, 0755), 0);
  char *model = tu_path(in_dir, "model.safetensors"), *config = tu_path(in_dir, "config.json"),
       *inner = tu_path(in_dir, "real.json"), *out = tu_path(dir, "out"),
       *out_config = tu_path(out, "config.json");
  ck_assert_int_eq(st_writer_write(w, model), 0);
  st_writer_free(w);
  static const char secret[] = "{\"secret_token\": \"hunter2\"}";
  ck_assert_int_eq(tu_write_file(outside, secret, strlen(secret)), 0);
  struct qkeep_quantize_options o = options("w8a8-int8", 1, 0);
  alarm(60);
  /* a FIFO */
  ck_assert_int_eq(mkfifo(config, 0644), 0);
  ck_assert_int_eq(qkeep_quantize(model, out, &o), QKEEP_E_IO);
  ck_assert_msg(strstr(qkeep_errmsg(), config) && strstr(qkeep_errmsg(), "FIFO"), "%s", qkeep_errmsg());
  ck_assert_int_ne(access(out, F_OK), 0);
  /* a link out of the directory */
  ck_assert_int_eq(unlink(config), 0);
  ck_assert_int_eq(symlink("../outside.json", config), 0);
  ck_assert_int_eq(qkeep_quantize(model, out, &o), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), "symbolic link") && strstr(qkeep_errmsg(), "config.json"), "%s",
                qkeep_errmsg());
  ck_assert_int_ne(access(out, F_OK), 0);
  /* a link inside it is followed, and its keys carried over */
  static const char own[] = "{\"model_type\": \"llama\", \"marker\": 7}";
  ck_assert_int_eq(tu_write_file(inner, own, strlen(own)), 0);
  ck_assert_int_eq(unlink(config), 0);
  ck_assert_int_eq(symlink("real.json", config), 0);
  ck_assert_msg(qkeep_quantize(model, out, &o) == 0, "%s", qkeep_errmsg());
  alarm(0);
  size_t n;
  char *text = tu_read_file(out_config, &n);
  ck_assert_ptr_nonnull(text);
  text = realloc(text, n + 1);
  text[n] = '\0';
  ck_assert_msg(strstr(text, "\"marker\": 7") && strstr(text, "quantization_config") &&
                    !strstr(text, "hunter2"),
                "%s", text);
  free(text);
  free(model), free(config), free(inner), free(out), free(out_config), free(in_dir), free(outside);
  tu_rmtree(dir);
  free(dir);
}
END_TEST

/* A fusion group (q/k/v, gate/up, w1/w3) whose members are not all 2-D float weights: the group is found
 * by name, and each member's dtype and rank are checked before any of its bytes are read. Every NVFP4
 * scheme refuses, naming the odd member; nothing is left behind. */
START_TEST(a_fusion_member_that_is_no_float_matrix_is_refused) {
  static const struct {
    const char *odd;     /* the odd member's name */
    struct qkeep_spec s; /* and its spec */
    const char *why;
  } cases[] = {
      {"model.layers.0.mlp.up_proj.weight", {QKEEP_DTYPE_U8, 2, {16, 16}}, "dtype U8"},
      {"model.layers.0.mlp.up_proj.weight", {QKEEP_DTYPE_I32, 2, {16, 16}}, "dtype I32"},
      {"model.layers.0.mlp.up_proj.weight", {QKEEP_DTYPE_BF16, 3, {16, 16, 1}}, "3 dimensions"},
      {"model.layers.0.self_attn.k_proj.weight", {QKEEP_DTYPE_I8, 2, {16, 16}}, "dtype I8"},
      {"model.layers.0.mlp.experts.0.w3.weight", {QKEEP_DTYPE_BF16, 1, {256}}, "1 dimension"},
  };
  static const char *const nvfp4[] = {"modelopt-nvfp4", "ct-nvfp4"};
  char *dir = tu_tmpdir("fusion-odd");
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    struct st_writer *w;
    ck_assert_int_eq(st_writer_new(&w), 0);
    uint64_t seed = 11;
    /* the odd member's siblings, 2-D bf16 [16, 16] */
    static const char *const siblings[] = {
        "model.layers.0.mlp.gate_proj.weight",    "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.experts.0.w1.weight",
        "model.layers.0.mlp.experts.0.w3.weight"};
    for (size_t i = 0; i < sizeof siblings / sizeof siblings[0]; i++)
      if (strcmp(siblings[i], cases[c].odd) != 0)
        add_bf16(w, siblings[i], 16, 16, &seed, -1);
    size_t nbytes;
    ck_assert(spec_bytes_checked(&cases[c].s, &nbytes));
    unsigned char *bytes = calloc(nbytes, 1);
    ck_assert_int_eq(st_writer_add(w, cases[c].odd, &cases[c].s, bytes), 0);
    free(bytes);
    char *model = tu_path(dir, "model.safetensors");
    ck_assert_int_eq(st_writer_write(w, model), 0);
    st_writer_free(w);
    for (size_t s = 0; s < 2; s++)
      for (int threads = 1; threads <= 3; threads += 2) {
        char *out = tu_path(dir, "out");
        struct qkeep_quantize_options o = options(nvfp4[s], threads, s ? 600 : 0);
        ck_assert_int_eq(qkeep_quantize(model, out, &o), QKEEP_E_FORMAT);
        const char *msg = qkeep_errmsg();
        char *quoted = tu_path("", cases[c].odd); /* "/name": the name follows a quote in the message */
        quoted[0] = '\'';
        ck_assert_msg(strstr(msg, quoted) && strstr(msg, cases[c].why) && strstr(msg, "fusion group"),
                      "%s, %s: %s", nvfp4[s], cases[c].odd, msg);
        free(quoted);
        ck_assert_int_ne(access(out, F_OK), 0); /* nothing left */
        free(out);
      }
    free(model);
  }
  tu_rmtree(dir);
  free(dir);
}
END_TEST

/* An input tensor whose name is one that quantizing another writes (a.q_proj.weight_scale beside
 * a.q_proj.weight): refused before anything is written, sharded or not, naming both. Sharded, the
 * two used to land in different shards and the command succeeded with a checkpoint qkeep refuses. */
START_TEST(an_input_tensor_named_as_a_generated_one_is_refused) {
  static const struct {
    const char *scheme, *collides;
  } cases[] = {
      {"modelopt-nvfp4", "weight_scale"}, {"ct-nvfp4", "weight_packed"}, {"w8a8-int8", "input_scale"},
      {"gptq-int4", "qweight"},           {"awq-int4", "scales"},        {"ct-int4", "weight_shape"},
      {"mxfp4", "weight_scale"}};
  char *dir = tu_tmpdir("collide");
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    struct st_writer *w;
    ck_assert_int_eq(st_writer_new(&w), 0);
    uint64_t seed = 3;
    add_bf16(w, "a.q_proj.weight", 64, 64, &seed, -1);
    add_bf16(w, "b.norm.weight", 4096, 0, &seed, -1); /* large: sharded, it sits between the two */
    char collides[64];
    snprintf(collides, sizeof collides, "a.q_proj.%s", cases[c].collides);
    add_bf16(w, collides, 4, 0, &seed, -1);
    char *model = tu_path(dir, "model.safetensors");
    ck_assert_int_eq(st_writer_write(w, model), 0);
    st_writer_free(w);
    for (int sharded = 0; sharded < 2; sharded++) {
      char *out = tu_path(dir, "out");
      struct qkeep_quantize_options o = options(cases[c].scheme, 2, sharded ? 1024 : 0);
      int rc = qkeep_quantize(model, out, &o);
      const char *msg = qkeep_errmsg();
      ck_assert_msg(rc == QKEEP_E_FORMAT, "%s, sharded %d: returned %d: %s", cases[c].scheme, sharded, rc,
                    rc ? msg : "");
      char quoted[80];
      snprintf(quoted, sizeof quoted, "'%s'", collides);
      ck_assert_msg(strstr(msg, quoted) && strstr(msg, "'a.q_proj.weight'"), "%s: %s", cases[c].scheme, msg);
      ck_assert_int_ne(access(out, F_OK), 0); /* nothing left */
      free(out);
    }
    free(model);
  }
  tu_rmtree(dir);
  free(dir);
}
END_TEST

static Suite *quantize_suite(void) {
  Suite *s = suite_create("quantize");
  TCase *tc = tcase_create("streaming");
  tcase_set_timeout(tc, 300);
  tcase_add_loop_test(tc, every_thread_count_writes_the_same_bytes, 0,
                      (int)(sizeof all_schemes / sizeof all_schemes[0]));
  tcase_add_loop_test(tc, streamed_file_equals_one_built_in_memory, 0, 2);
  tcase_add_test(tc, memory_stays_under_the_stated_bound);
  tcase_add_test(tc, the_first_error_wins_at_any_thread_count);
  tcase_add_test(tc, the_output_appears_whole_or_not_at_all);
  tcase_add_test(tc, layout_is_the_written_file);
  tcase_add_test(tc, e4m3_values_are_the_decoders);
  tcase_add_test(tc, the_input_config_json_follows_the_directorys_rules);
  tcase_add_test(tc, a_fusion_member_that_is_no_float_matrix_is_refused);
  tcase_add_test(tc, an_input_tensor_named_as_a_generated_one_is_refused);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run_suite(quantize_suite(), CK_NORMAL); }
