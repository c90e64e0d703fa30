/* ckptutil.c: reading, changing and writing the tensors of a checkpoint in a Check test (ckptutil.h). */
#include "ckptutil.h"

#include <check.h>
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkutil.h"
#include "private.h"
#include "testutil.h"

struct tu_tensors tu_read_tensors(const char *path) {
  struct st_file *f;
  ck_assert_msg(st_open(path, &f) == 0, "%s", qkeep_errmsg());
  struct tu_tensors ts = {calloc(f->n_tensors ? f->n_tensors : 1, sizeof(struct tu_tensor)), f->n_tensors};
  ck_assert_ptr_nonnull(ts.items);
  for (size_t i = 0; i < f->n_tensors; i++) {
    const struct st_tensor *t = &f->tensors[i];
    struct tu_tensor *it = &ts.items[i];
    ck_assert_int_ge(t->dtype, 0);
    it->name = strdup(t->name);
    it->spec = (struct qkeep_spec){.dtype = (enum qkeep_dtype)t->dtype, .ndim = t->ndim};
    memcpy(it->spec.shape, t->shape, sizeof it->spec.shape);
    it->nbytes = (size_t)t->nbytes;
    it->data = malloc(it->nbytes ? it->nbytes : 1);
    ck_assert(it->name && it->data);
    ck_assert_int_eq(st_read(f, t, it->data), 0);
  }
  st_close(f);
  return ts;
}

void tu_write_tensors(struct tu_tensors *ts, const char *path) {
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  for (size_t i = 0; i < ts->n; i++) {
    ck_assert_msg(st_writer_add(w, ts->items[i].name, &ts->items[i].spec, ts->items[i].data) == 0, "%s",
                  qkeep_errmsg());
    free(ts->items[i].name);
    free(ts->items[i].data);
  }
  ck_assert_msg(st_writer_write(w, path) == 0, "%s", qkeep_errmsg());
  st_writer_free(w);
  free(ts->items);
  *ts = (struct tu_tensors){0};
}

struct tu_tensor *tu_find_tensor(struct tu_tensors *ts, const char *name) {
  for (size_t i = 0; i < ts->n; i++)
    if (strcmp(ts->items[i].name, name) == 0)
      return &ts->items[i];
  return NULL;
}

void tu_copy_dir(const char *from, const char *to) {
  ck_assert_msg(mkdir(to, 0755) == 0, "cannot create %s", to);
  DIR *d = opendir(from);
  ck_assert_msg(d != NULL, "cannot open %s", from);
  for (struct dirent *e; (e = readdir(d));) {
    if (e->d_name[0] == '.')
      continue;
    char *src = tu_path(from, e->d_name), *dst = tu_path(to, e->d_name);
    size_t n;
    void *data = tu_read_file(src, &n);
    ck_assert_msg(data != NULL, "cannot read %s", src);
    ck_assert_msg(tu_write_file(dst, data, n) == 0, "cannot write %s", dst);
    free(data);
    free(src);
    free(dst);
  }
  closedir(d);
}

float *tu_source_values(const char *name, int64_t rows, int64_t cols, uint64_t seed) {
  size_t n = (size_t)(rows * (cols ? cols : 1));
  float *v = malloc((n ? n : 1) * sizeof *v);
  ck_assert_ptr_nonnull(v);
  uint64_t s = seed;
  for (const char *p = name; *p; p++)
    s = s * 31 + (unsigned char)*p;
  for (size_t i = 0; i < n; i++)
    v[i] = cols ? tu_randf(&s) * 0.25f : 1.0f + 0.01f * (float)(seed % 7);
  return v;
}

void tu_add_source_f32(struct st_writer *w, const char *name, int64_t rows, int64_t cols, uint64_t seed) {
  float *v = tu_source_values(name, rows, cols, seed);
  struct qkeep_spec sp = {QKEEP_DTYPE_F32, cols ? 2 : 1, {rows, cols}};
  ck_assert_msg(st_writer_add(w, name, &sp, v) == 0, "%s", qkeep_errmsg());
  free(v);
}

void tu_add_gptoss_experts(struct st_writer *w, const char *prefix, const char *name, int64_t experts,
                           int64_t rows, int64_t cols, const uint8_t *blocks, const uint8_t *scales,
                           const uint16_t *bias) {
  static const char *const suffix[3] = {"blocks", "scales", "bias"};
  const struct qkeep_spec spec[3] = {{QKEEP_DTYPE_U8, 4, {experts, rows, cols / 32, 16}},
                                     {QKEEP_DTYPE_U8, 3, {experts, rows, cols / 32}},
                                     {QKEEP_DTYPE_BF16, 2, {experts, rows}}};
  const void *data[3] = {blocks, scales, bias};
  for (int i = 0; i < 3; i++) {
    char *tensor;
    ck_assert_int_ge(qk_asprintf(&tensor, "%s.%s_%s", prefix, name, suffix[i]), 0);
    ck_assert_msg(st_writer_add(w, tensor, &spec[i], data[i]) == 0, "%s", qkeep_errmsg());
    free(tensor);
  }
}
