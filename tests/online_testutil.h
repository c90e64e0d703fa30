/*
 * online_testutil.h: what the online-quantization suites share (check_online, check_online_device,
 * check_gpu_online): the examples and the options they were quantized with, an example rewritten in
 * another dtype or with a planted value, every storage's address, to show a reload moved none, and a
 * weight sync of a model to a checkpoint through the buckets qkeep_sync_plan plans. Header-only.
 */
#ifndef QKEEP_ONLINE_TESTUTIL_H
#define QKEEP_ONLINE_TESTUTIL_H

#include <check.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "private.h"
#include "testutil.h"

/* The path of examples/NAME in the build tree (malloc'd). */
static inline char *example(const char *name) {
  char *dir = tu_path(tu_builddir(), "examples");
  char *p = tu_path(dir, name);
  free(dir);
  return p;
}

/* The options examples/tiny-SCHEME were written with (Makefile.am). */
static inline struct qkeep_quantize_options options_for(const char *scheme) {
  return (struct qkeep_quantize_options){.size = sizeof(struct qkeep_quantize_options),
                                         .scheme = scheme,
                                         .kv_cache_scales = true,
                                         .activation_amax = 4.0f,
                                         .threads = 2};
}

/* examples/NAME with every tensor in dtype (BF16, F16 or F32) and, when planted, element `at` of `tensor`
 * holding the raw bits `bits` of that dtype, as one file (its path; the caller removes its directory). */
static inline char *example_as(const char *name, enum qkeep_dtype dtype, const char *tensor, size_t at,
                               uint32_t bits, bool planted) {
  char *src = example(name);
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(src, &ck), 0);
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  bool found = !planted;
  for (size_t i = 0; i < ck->n_tensors; i++) {
    const struct st_tensor *t = ck->tensors[i].t;
    size_t n = t->nbytes / 2;
    uint16_t *bf16 = malloc(t->nbytes);
    unsigned char *out = malloc(n * 4);
    ck_assert_int_eq(ckpt_read(ck, &ck->tensors[i], bf16), 0);
    size_t size = qkeep_dtype_size(dtype);
    for (size_t e = 0; e < n; e++) {
      float f = qkeep_bf16_to_f32(bf16[e]);
      uint32_t f32;
      memcpy(&f32, &f, 4);
      uint16_t half = dtype == QKEEP_DTYPE_F16 ? qkeep_f32_to_f16(f) : bf16[e];
      if (size == 4)
        memcpy(out + 4 * e, &f32, 4);
      else
        memcpy(out + 2 * e, &half, 2);
    }
    if (planted && strcmp(t->name, tensor) == 0) {
      ck_assert_uint_lt(at, n);
      uint16_t half = (uint16_t)bits;
      memcpy(out + size * at, size == 4 ? (const void *)&bits : (const void *)&half, size);
      found = true;
    }
    struct qkeep_spec spec = {.dtype = dtype, .ndim = t->ndim};
    memcpy(spec.shape, t->shape, sizeof spec.shape);
    ck_assert_int_eq(st_writer_add(w, t->name, &spec, out), 0);
    free(bf16), free(out);
  }
  ck_assert_msg(found, "%s has no '%s'", name, tensor);
  char *dir = tu_tmpdir("online-as");
  char *path = tu_path(dir, "model.safetensors");
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  ckpt_close(ck);
  free(dir), free(src);
  return path;
}

/* Removes the directory of a file example_as wrote, and frees the path. */
static inline void remove_file_dir(char *path) {
  char *slash = strrchr(path, '/');
  *slash = '\0';
  tu_rmtree(path);
  free(path);
}

/* Copies n bytes of device memory to the host (a model in device memory), for assert_twins. */
typedef void (*to_host_fn)(void *host, const void *device, size_t n);

struct twin_ctx {
  const qkeep_layer *other;
  const char *layer, *what;
  to_host_fn to_host; /* NULL: the models' bytes are in host memory */
};

/* A registered tensor equal in bytes and dtype to the twin's, or the first differing byte named. */
static inline int twin_name(void *user, const char *name, bool is_buffer, const struct qkeep_view *v) {
  (void)is_buffer;
  struct twin_ctx *c = user;
  struct qkeep_view w = {.size = sizeof w};
  ck_assert_msg(qkeep_view_of(c->other, name, &w) == 0, "%s: %s.%s missing in the twin", c->what, c->layer,
                name);
  ck_assert_msg(v->nbytes == w.nbytes && v->spec.dtype == w.spec.dtype,
                "%s: %s.%s: %zu bytes of %s, the twin %zu of %s", c->what, c->layer, name, v->nbytes,
                qkeep_dtype_name(v->spec.dtype), w.nbytes, qkeep_dtype_name(w.spec.dtype));
  if (!v->nbytes)
    return 0;
  const unsigned char *x = v->data, *y = w.data;
  unsigned char *a = NULL, *b = NULL;
  if (c->to_host) {
    a = malloc(v->nbytes), b = malloc(v->nbytes);
    ck_assert(a && b);
    c->to_host(a, v->data, v->nbytes), c->to_host(b, w.data, v->nbytes);
    x = a, y = b;
  }
  size_t i = 0;
  while (i < v->nbytes && x[i] == y[i]) /* one assertion below: in a forked test each one is written out */
    i++;
  ck_assert_msg(i == v->nbytes, "%s: %s.%s: byte %zu of %zu is 0x%02x, the twin's 0x%02x", c->what, c->layer,
                name, i, v->nbytes, i < v->nbytes ? x[i] : 0, i < v->nbytes ? y[i] : 0);
  free(a), free(b);
  return 0;
}

/* Every registered tensor of every layer of a equal to b's (bytes and dtype), and their digests. */
static inline void assert_twins(qkeep_model *a, qkeep_model *b, const char *what, to_host_fn to_host) {
  size_t n = qkeep_model_layer_count(a);
  ck_assert_uint_eq(n, qkeep_model_layer_count(b));
  for (size_t l = 0; l < n; l++) {
    qkeep_layer *x = qkeep_model_layer(a, l), *y = qkeep_model_layer(b, l);
    struct qkeep_layer_info info = {.size = sizeof info};
    qkeep_layer_get_info(x, &info);
    struct twin_ctx c = {y, info.name, what, to_host};
    ck_assert_int_eq(qkeep_foreach_name(x, twin_name, &c), 0);
  }
  struct qkeep_digest da, db;
  ck_assert_int_eq(qkeep_digest(a, &da), 0);
  ck_assert_int_eq(qkeep_digest(b, &db), 0);
  ck_assert_msg(da.hi == db.hi && da.lo == db.lo, "%s: digests differ", what);
}

/* qkeep quantize's output of `in` with o, in a temporary directory, loaded cold by load(user, path); the
 * directory removed. */
static inline qkeep_model *offline_twin_by(const char *in, const struct qkeep_quantize_options *o,
                                           qkeep_model *(*load)(void *user, const char *path), void *user) {
  char *tmp = tu_tmpdir("online-twin"), *out = tu_path(tmp, o->scheme);
  ck_assert_msg(qkeep_quantize(in, out, o) == 0, "%s", qkeep_errmsg());
  qkeep_model *m = load(user, out);
  tu_rmtree(tmp);
  free(tmp), free(out);
  return m;
}

/* Every storage's address, in the model's order (qkeep_foreach_storage with note_address). */
struct addresses {
  const void *at[4096];
  size_t n;
};
static inline int note_address(void *user, const char *layer, const char *name, const void *data,
                               size_t capacity) {
  (void)layer, (void)name, (void)capacity;
  struct addresses *a = user;
  ck_assert_uint_lt(a->n, 4096);
  a->at[a->n++] = data;
  return 0;
}

/* Where a sync's buckets live: host memory (NULL), or device memory that to_device fills from the
 * host bytes and release frees once the bucket's sync returned (after waiting for the device). */
struct bucket_memory {
  void *(*to_device)(const void *data, size_t bytes);
  void (*release)(void *on_device);
};

/* Syncs m to checkpoint w1 through the buckets qkeep_sync_plan plans (bucket_bytes each at most),
 * filled from w1's bytes; the sync's result (aborted after a failed bucket). */
static inline int sync_from_buckets(qkeep_model *m, const char *w1, size_t bucket_bytes,
                                    const struct bucket_memory *mem) {
  struct qkeep_sync_entry *e;
  size_t n, n_buckets;
  ck_assert_msg(qkeep_sync_plan(m, bucket_bytes, &e, &n, &n_buckets) == 0, "%s", qkeep_errmsg());
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(w1, &ck), 0);
  qkeep_sync *sync;
  ck_assert_int_eq(qkeep_sync_begin(m, &sync), 0);
  int rc = 0;
  for (size_t b = 0, first = 0; b < n_buckets && !rc; b++) {
    size_t end = first, bytes = 0;
    while (end < n && e[end].bucket == b) {
      size_t last = e[end].tensor.offset + qkeep_spec_bytes(&e[end].tensor.spec);
      bytes = last > bytes ? last : bytes;
      end++;
    }
    unsigned char *data = calloc(bytes ? bytes : 1, 1);
    struct qkeep_bucket_tensor *ts = calloc(end - first + 1, sizeof *ts);
    for (size_t i = first; i < end; i++) {
      const struct ckpt_tensor *t = ckpt_find(ck, e[i].tensor.name);
      ck_assert_msg(t != NULL, "the plan names '%s', which W1 lacks", e[i].tensor.name);
      ck_assert_int_eq(ckpt_read(ck, t, data + e[i].tensor.offset), 0);
      ts[i - first] = e[i].tensor;
    }
    void *dev = mem ? mem->to_device(data, bytes) : NULL;
    struct qkeep_bucket bucket = {sizeof bucket, ts, end - first, dev ? dev : data, bytes, dev != NULL};
    rc = qkeep_sync_bucket(sync, &bucket);
    if (dev)
      mem->release(dev);
    free(ts), free(data);
    first = end;
  }
  rc = rc ? (qkeep_sync_abort(sync), rc) : qkeep_sync_end(sync);
  ckpt_close(ck);
  qkeep_sync_plan_free(e);
  return rc;
}

#endif
