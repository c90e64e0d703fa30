/*
 * check_online_device.c: online quantization on a device (the backend's quantize slot, ABI 1.5,
 * libqkeep/load/online_device.c), without a GPU. The device is a fake in host memory whose
 * copy_h2d_async only queues its copy (tests/plugins/async_queue.h: the queue runs at sync, at any
 * other memory op, or up to a fence waited on), and whose quantize slot runs the host quantizer
 * (quantize/quant.h) on the bytes the core staged, after the queued copies, as a kernel on the
 * copies' stream would. So the core's staging, ordering, placement and fallback are what is tested:
 *
 *   - NVFP4 (both namings) and MXFP4: an online load, a reload W0 -> W1 and a sync of bf16 buckets
 *     equal their offline twins (qkeep quantize, then a cold start) byte for byte, pointers
 *     unchanged by the reload, with every unit quantized by the slot;
 *   - at most one unit's sources are on the device at a time, in one buffer, freed by the end of
 *     the load;
 *   - a backend that declines (at the query, or once the bytes are staged), a table of ABI 1.4
 *     (no slot) and a scheme the slot does not take (w8a8-int8) give the same bytes the host way;
 *   - a NaN is refused with the host path's error (tensor, element, row, column), and a device
 *     error fails the load naming the backend, with nothing left of the model.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "fake_async_device.h"
#include "online_testutil.h"
#include "private.h"
#include "testutil.h"

/* ---- what the fake's quantize slot does, and what it saw ---- */

enum mode { TAKE, DECLINE, DECLINE_LATE, FAIL };

static struct {
  enum mode mode;
  int queries, units;    /* queries answered; units quantized */
  size_t largest_unit;   /* the most bytes one unit's staged sources took (256-aligned, as staged) */
  size_t largest_buffer; /* the largest device buffer sources were staged in */
  void *staging[64];     /* the live buffers sources were staged in (freed ones leave) */
  int n_staging;
  int n_buffers;  /* buffers sources were staged in */
  int bad_member; /* the last refusal's */
  int64_t bad_element;
  int value_checks;  /* find_bad_values calls */
  size_t checked;    /* bytes they checked */
  size_t d2h_bytes;  /* bytes copied from the device to the host */
  bool from_buckets; /* sources may lie in a sync's device buckets: not staged, not tracked */
} fk;

/* ---- the fake device: host memory, queued copies, allocations tracked ---- */

#define MAX_ALLOCS 16384
static struct {
  void *p;
  size_t bytes;
} allocs[MAX_ALLOCS];
static size_t n_allocs;

/* The live allocation holding p, or -1. */
static long alloc_of(const void *p) {
  for (size_t i = 0; i < n_allocs; i++)
    if ((const char *)p >= (char *)allocs[i].p && (const char *)p < (char *)allocs[i].p + allocs[i].bytes)
      return (long)i;
  return -1;
}

static int f_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  (void)be, flush();
  ck_assert_uint_lt(n_allocs, MAX_ALLOCS);
  if (!(*out = calloc(1, bytes ? bytes : 1)))
    return QKEEP_E_NOMEM;
  allocs[n_allocs].p = *out, allocs[n_allocs++].bytes = bytes ? bytes : 1;
  return 0;
}
static void f_free(const struct qkeep_backend *be, void *p) {
  (void)be, flush();
  for (int i = 0; i < fk.n_staging; i++)
    if (fk.staging[i] == p)
      fk.staging[i] = fk.staging[--fk.n_staging];
  long i = p ? alloc_of(p) : -1;
  if (i >= 0)
    allocs[i] = allocs[--n_allocs];
  free(p);
}
static int f_h2d_async(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  (void)be;
  ck_assert(aq_push(&q, dst, src, n));
  return 0;
}

static int f_d2h(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  fk.d2h_bytes += n;
  return f_copy(be, dst, src, n);
}

/* ABI 1.6: the finite-value rules (all a model quantizing on load asks of this device), after the queue. */
static int f_find_bad_values(const struct qkeep_backend *be, const struct qkeep_value_range *r, size_t n,
                             size_t *first) {
  (void)be, flush();
  fk.value_checks++;
  for (size_t i = 0; i < n; i++) {
    ck_assert_msg(r[i].rule == QKEEP_RULE_BF16_FINITE && r[i].bytes % 2 == 0, "rule %d, %zu bytes", r[i].rule,
                  r[i].bytes);
    ck_assert_msg(alloc_of(r[i].at) >= 0, "a range in no device allocation");
    fk.checked += r[i].bytes;
    const unsigned char *p = r[i].at;
    for (size_t j = 0; j < r[i].bytes; j += 2)
      if ((p[j + 1] & 0x7f) == 0x7f && (p[j] & 0x80)) {
        *first = i;
        return 0;
      }
  }
  *first = n;
  return 0;
}

/* Not const: a test cuts its size to find_bad_values' offset to be a device of ABI 1.5. */
static struct qkeep_memory_ops fake_ops = {
    .size = sizeof(struct qkeep_memory_ops),
    .alloc = f_alloc,
    .free = f_free,
    .copy_h2d = f_copy,
    .copy_d2h = f_d2h,
    .copy_d2d = f_copy,
    .fill = f_fill,
    .sync = f_sync,
    .host_alloc = f_host_alloc,
    .host_free = f_host_free,
    .copy_h2d_async = f_h2d_async,
    .copy_fence = f_fence,
    .copy_fence_wait = f_fence_wait,
    .find_bad_values = f_find_bad_values,
};

/* ---- the quantize slot: the host quantizer on the staged bytes ---- */

static void fake_reset(enum mode mode) {
  memset(&fk, 0, sizeof fk);
  fk.mode = mode;
  fk.bad_member = -1;
}

/* The member's values as f32 (malloc'd). */
static float *values_of(const struct qkeep_quant_member *m) {
  size_t count = (size_t)(m->n * m->k);
  float *w = malloc((count ? count : 1) * sizeof *w);
  ck_assert_ptr_nonnull(w);
  for (size_t i = 0; i < count; i++)
    w[i] = qk_load_float(m->src, m->dtype, i);
  return w;
}

/* Where the member's sources were staged: one live device buffer per unit, the same for every member
 * staged, and no earlier buffer alive beside it. */
static void note_staging(const struct qkeep_quant_unit *u) {
  if (fk.from_buckets)
    return;
  long a = alloc_of(u->members[0].src);
  ck_assert_msg(a >= 0, "%s: its values are in no device allocation", u->members[0].name);
  size_t bytes = 0;
  for (int m = 0; m < u->n_members; m++) {
    ck_assert_msg(alloc_of(u->members[m].src) == a, "%s: members staged in two buffers", u->members[m].name);
    bytes += ((size_t)(u->members[m].n * u->members[m].k) * qkeep_dtype_size(u->members[m].dtype) + 255) /
             256 * 256;
  }
  fk.largest_unit = bytes > fk.largest_unit ? bytes : fk.largest_unit;
  fk.largest_buffer = allocs[a].bytes > fk.largest_buffer ? allocs[a].bytes : fk.largest_buffer;
  bool known = false;
  for (int i = 0; i < fk.n_staging; i++)
    known |= fk.staging[i] == allocs[a].p;
  if (!known) {
    ck_assert_int_lt(fk.n_staging, 64);
    fk.staging[fk.n_staging++] = allocs[a].p;
    fk.n_buffers++;
  }
  ck_assert_msg(fk.n_staging == 1, "%d units' staging buffers on the device at once", fk.n_staging);
}

static int fake_quantize(const struct qkeep_backend *be, qkeep_layer *layer, struct qkeep_quant_unit *u) {
  (void)be;
  ck_assert_ptr_nonnull(layer);
  ck_assert_int_ge(u->n_members, 1);
  ck_assert_int_le(u->n_members, 3);
  bool mx = strcmp(u->scheme, "mxfp4") == 0, ct = strcmp(u->scheme, "ct-nvfp4") == 0;
  ck_assert(mx || ct || strcmp(u->scheme, "modelopt-nvfp4") == 0);
  if (!u->members[0].src) { /* a query: nothing staged yet */
    for (int m = 0; m < u->n_members; m++)
      ck_assert_ptr_null(u->members[m].src);
    fk.queries++;
    return fk.mode == DECLINE ? 1 : 0;
  }
  flush(); /* the kernel runs after the staging copies, as on their stream */
  note_staging(u);
  if (fk.mode == DECLINE_LATE)
    return 1;
  if (fk.mode == FAIL)
    return set_error(QKEEP_E_DEVICE, "fake: the device fell over");
  float *w[3] = {0}, amax = 0.0f;
  int rc = 0;
  for (int m = 0; m < u->n_members && !rc; m++) {
    const struct qkeep_quant_member *x = &u->members[m];
    float a = 0.0f; /* quant_check_rows sets it only for finite rows */
    w[m] = values_of(x);
    if ((rc = quant_check_rows(w[m], 0, x->n, x->k, &a)) != 0) {
      for (int64_t i = 0; i < x->n * x->k; i++)
        if (!isfinite(w[m][i])) {
          u->bad_member = fk.bad_member = m, u->bad_element = fk.bad_element = i;
          break;
        }
    }
    amax = a > amax ? a : amax;
  }
  float global;
  if (!rc && !mx)
    rc = quant_nvfp4_global(amax, ct, &global);
  for (int m = 0; m < u->n_members && !rc; m++) {
    const struct qkeep_quant_member *x = &u->members[m];
    if (mx)
      quant_mxfp4_rows(w[m], x->n, x->k, x->codes, x->block_scales);
    else
      quant_nvfp4_rows(w[m], x->n, x->k, ct, amax, x->codes, x->block_scales);
  }
  for (int m = 0; m < 3; m++)
    free(w[m]);
  u->amax = amax;
  fk.units += !rc;
  return rc ? QKEEP_E_INVAL : 0;
}

static struct qkeep_backend fake_be;
static qkeep_plugin fake_plugin;
static char fake_path[] = "fake";

/* The fake as a chain of one; `slot`: a table of ABI 1.5 (else it ends where 1.4's did). */
static qkeep_plugin *fake(bool slot) {
  fake_be = (struct qkeep_backend){.size = slot ? sizeof fake_be : offsetof(struct qkeep_backend, quantize),
                                   .name = "fake",
                                   .memory = &fake_ops,
                                   .quantize = fake_quantize};
  fake_plugin = (qkeep_plugin){.path = fake_path, .be = &fake_be};
  return &fake_plugin;
}

/* ---- models ---- */

static const char *const fp4[] = {"modelopt-nvfp4", "ct-nvfp4", "mxfp4"};

static qkeep_model *load(qkeep_plugin *p, const char *path, const struct qkeep_quantize_options *online) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new_chain(&p, 1, &m), 0);
  if (online)
    ck_assert_msg(qkeep_model_set_quantize(m, online) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

static qkeep_model *load_cold(void *plugin, const char *path) { return load(plugin, path, NULL); }

/* qkeep quantize's output of `in` with o, loaded cold on p. */
static qkeep_model *offline_twin(qkeep_plugin *p, const char *in, const struct qkeep_quantize_options *o) {
  return offline_twin_by(in, o, load_cold, p);
}

/* Every registered tensor of one model byte for byte in the other, and the digests. */
static void assert_same(qkeep_model *a, qkeep_model *b, const char *what) { assert_twins(a, b, what, NULL); }

/* Every unit went to the slot, each staged alone, and no staging buffer outlives the load. */
static void assert_staging_bounded(const char *what) {
  ck_assert_msg(fk.units > 0 && fk.units == fk.queries, "%s: %d units quantized of %d asked", what, fk.units,
                fk.queries);
  ck_assert_msg(fk.largest_buffer <= fk.largest_unit,
                "%s: a staging buffer of %zu bytes, the largest unit %zu", what, fk.largest_buffer,
                fk.largest_unit);
  ck_assert_msg(fk.n_staging == 0, "%s: a staging buffer outlived the load", what);
}

START_TEST(fp4_online_loads_on_the_device_equal_quantize_then_load) {
  char *tiny = example("tiny");
  for (size_t s = 0; s < 3; s++) {
    struct qkeep_quantize_options o = options_for(fp4[s]);
    fake_reset(TAKE);
    qkeep_model *online = load(fake(true), tiny, &o);
    assert_staging_bounded(fp4[s]);
    ck_assert_int_eq(online->online.device_units, fk.units); /* what the GPU suite counts by */
    qkeep_model *offline = offline_twin(fake(true), tiny, &o);
    assert_same(online, offline, fp4[s]);
    qkeep_model_free(online);
    qkeep_model_free(offline);
  }
  free(tiny);
}
END_TEST

/* The stream's trace line of the last load (qkeep_set_logger at QKEEP_LOG_DEBUG). */
static char stream_line[2048];
static void keep_stream_line(void *user, enum qkeep_log_level level, const char *msg) {
  (void)user, (void)level;
  if (strncmp(msg, "qkeep stream: ", 14) == 0)
    snprintf(stream_line, sizeof stream_line, "%s", msg);
}

/* While a unit's copies drain before the slot reads back what it found, the next unit in the load's
 * order (the next layer's: each linear is a layer of its own) is read into the ring, and that read is
 * the one its copies take: the readers read exactly the bytes copied (a read ahead given up on, as when
 * the next layer's own read ahead replaced it, reads more). */
START_TEST(the_next_unit_is_read_while_this_ones_copies_drain_and_that_read_is_used) {
  char *tiny = example("tiny");
  struct qkeep_quantize_options o = options_for("modelopt-nvfp4");
  fake_reset(TAKE);
  stream_line[0] = '\0';
  qkeep_set_logger(keep_stream_line, NULL);
  qkeep_set_log_level(QKEEP_LOG_DEBUG);
  qkeep_model *m = load(fake(true), tiny, &o);
  qkeep_set_log_level(QKEEP_LOG_INFO);
  qkeep_set_logger(NULL, NULL);
  ck_assert_int_gt(fk.units, 2);
  size_t copied = 0, read = 0, drains = 0;
  const char *bytes = strstr(stream_line, " MB ("), *drain = strstr(stream_line, "draining (");
  ck_assert_msg(bytes && drain && sscanf(bytes + 5, "%zu bytes copied, %zu read", &copied, &read) == 2 &&
                    sscanf(drain + 10, "%zu drains", &drains) == 1,
                "%s", stream_line);
  ck_assert_msg(drains > 0 && copied > 0 && read == copied, "%s", stream_line);
  qkeep_model_free(m);
  free(tiny);
}
END_TEST

START_TEST(fp4_reloads_on_the_device_equal_a_cold_w1_and_move_no_pointer) {
  char *tiny = example("tiny"), *w1 = example("tiny-w1");
  for (size_t s = 0; s < 3; s++) {
    struct qkeep_quantize_options o = options_for(fp4[s]);
    fake_reset(TAKE);
    qkeep_model *m = load(fake(true), tiny, &o);
    struct addresses *before = calloc(1, sizeof *before), *after = calloc(1, sizeof *after);
    ck_assert_int_eq(qkeep_foreach_storage(m, note_address, before), 0);
    fake_reset(TAKE);
    ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s: %s", fp4[s], qkeep_errmsg());
    assert_staging_bounded(fp4[s]);
    ck_assert_int_eq(qkeep_foreach_storage(m, note_address, after), 0);
    ck_assert_uint_eq(before->n, after->n);
    for (size_t i = 0; i < before->n; i++)
      ck_assert_msg(before->at[i] == after->at[i], "%s: storage %zu moved", fp4[s], i);
    qkeep_model *cold = offline_twin(fake(true), w1, &o);
    assert_same(m, cold, fp4[s]);
    free(before), free(after);
    qkeep_model_free(cold);
    qkeep_model_free(m);
  }
  free(tiny), free(w1);
}
END_TEST

START_TEST(fp4_syncs_of_bf16_buckets_on_the_device_equal_a_cold_w1) {
  char *tiny = example("tiny"), *w1 = example("tiny-w1");
  for (size_t s = 0; s < 3; s++) {
    struct qkeep_quantize_options o = options_for(fp4[s]);
    fake_reset(TAKE);
    qkeep_model *m = load(fake(true), tiny, &o);
    fake_reset(TAKE);
    ck_assert_msg(sync_from_buckets(m, w1, 300 << 10, NULL) == 0, "%s: %s", fp4[s], qkeep_errmsg());
    assert_staging_bounded(fp4[s]);
    qkeep_model *cold = offline_twin(fake(true), w1, &o);
    assert_same(m, cold, fp4[s]);
    qkeep_model_free(cold);
    qkeep_model_free(m);
  }
  free(tiny), free(w1);
}
END_TEST

/* Bucket memory on the fake device (sync_from_buckets): the caller's, freed once the device is done. */
static void *to_fake_device(const void *host, size_t n) {
  void *d;
  ck_assert_int_eq(f_alloc(NULL, n, &d), 0);
  memcpy(d, host, n);
  return d;
}
static void release_fake(void *d) { f_free(NULL, d); }
static const struct bucket_memory fake_buckets = {to_fake_device, release_fake};

/* A sync of bf16 buckets in device memory checks their values on the device (find_bad_values, ABI 1.6):
 * none of the bf16 crosses to the host, the model equals a cold W1; a NaN in the bucket is refused naming
 * the tensor and element, W0 kept; a device without the slot copies the values to the host to check. */
START_TEST(a_sync_of_device_bf16_buckets_checks_the_values_on_the_device) {
  char *tiny = example("tiny"), *w1 = example("tiny-w1");
  const char *v = "model.layers.1.self_attn.v_proj.weight";
  char *bad_file = example_as("tiny", QKEEP_DTYPE_BF16, v, 1000, 0x7fc0, true);
  for (size_t s = 0; s < 3; s++) {
    struct qkeep_quantize_options o = options_for(fp4[s]);
    for (int slot = 1; slot >= 0; slot--) {
      fake_reset(TAKE);
      qkeep_model *m = load(fake(true), tiny, &o);
      struct qkeep_digest d0;
      ck_assert_int_eq(qkeep_digest(m, &d0), 0);
      fake_reset(TAKE);
      fake_ops.size = slot ? sizeof fake_ops : offsetof(struct qkeep_memory_ops, find_bad_values);
      fk.from_buckets = true;
      ck_assert_int_eq(sync_from_buckets(m, bad_file, 300 << 10, &fake_buckets), QKEEP_E_FORMAT);
      ck_assert_msg(strstr(qkeep_errmsg(), v) && strstr(qkeep_errmsg(), "element 1000"), "%s",
                    qkeep_errmsg());
      struct qkeep_digest d;
      ck_assert_int_eq(qkeep_digest(m, &d), 0);
      ck_assert_msg(d.hi == d0.hi && d.lo == d0.lo, "%s: the refused sync changed the model", fp4[s]);
      fake_reset(TAKE);
      fk.from_buckets = true;
      ck_assert_msg(sync_from_buckets(m, w1, 300 << 10, &fake_buckets) == 0, "%s: %s", fp4[s],
                    qkeep_errmsg());
      if (slot)
        ck_assert_msg(fk.value_checks > 0 && fk.checked > 0 && fk.d2h_bytes < fk.checked / 8,
                      "%s: %d device checks of %zu bytes, %zu bytes copied to the host", fp4[s],
                      fk.value_checks, fk.checked, fk.d2h_bytes);
      else
        ck_assert_msg(fk.value_checks == 0 && fk.d2h_bytes > 0, "%s: %d device checks, %zu bytes to the host",
                      fp4[s], fk.value_checks, fk.d2h_bytes);
      fake_ops.size = sizeof fake_ops;
      qkeep_model *cold = offline_twin(fake(true), w1, &o);
      assert_same(m, cold, fp4[s]);
      qkeep_model_free(cold);
      qkeep_model_free(m);
    }
  }
  remove_file_dir(bad_file);
  free(tiny), free(w1);
}
END_TEST

START_TEST(a_declining_or_older_backend_and_other_schemes_take_the_host_path) {
  char *tiny = example("tiny");
  static const enum mode modes[] = {DECLINE, DECLINE_LATE};
  for (size_t s = 0; s < 3; s++) {
    struct qkeep_quantize_options o = options_for(fp4[s]);
    qkeep_model *offline = offline_twin(fake(true), tiny, &o);
    for (int k = 0; k < 3; k++) { /* declines at the query, declines once staged, has no slot */
      fake_reset(k < 2 ? modes[k] : TAKE);
      qkeep_model *online = load(fake(k < 2), tiny, &o);
      ck_assert_int_eq(fk.units, 0);
      ck_assert_int_eq(fk.queries > 0, k < 2);
      ck_assert_int_eq(fk.n_staging, 0);
      ck_assert_int_eq(fk.n_buffers > 0, k == 1); /* declined late: staged, then freed */
      assert_same(online, offline, fp4[s]);
      qkeep_model_free(online);
    }
    qkeep_model_free(offline);
  }
  struct qkeep_quantize_options o = options_for("w8a8-int8"); /* not a scheme of the slot: never asked */
  fake_reset(TAKE);
  qkeep_model *online = load(fake(true), tiny, &o), *offline = offline_twin(fake(true), tiny, &o);
  ck_assert_int_eq(fk.queries, 0);
  assert_same(online, offline, "w8a8-int8");
  qkeep_model_free(online);
  qkeep_model_free(offline);
  free(tiny);
}
END_TEST

START_TEST(a_nan_is_refused_with_the_host_error_and_a_device_error_fails_the_load) {
  const char *v = "model.layers.1.self_attn.v_proj.weight";
  char *bad = example_as("tiny", QKEEP_DTYPE_BF16, v, 1000, 0x7fc0, true), *tiny = example("tiny");
  for (size_t s = 0; s < 3; s++) {
    struct qkeep_quantize_options o = options_for(fp4[s]);
    char host_msg[1024];
    for (int path = 0; path < 2; path++) { /* the host's refusal, then the device's */
      fake_reset(path ? TAKE : DECLINE);
      qkeep_model *m;
      ck_assert_int_eq(qkeep_model_new_chain((qkeep_plugin *[]){fake(true)}, 1, &m), 0);
      ck_assert_int_eq(qkeep_model_set_quantize(m, &o), 0);
      ck_assert_int_eq(qkeep_model_load(m, bad), QKEEP_E_INVAL);
      ck_assert_uint_eq(qkeep_model_layer_count(m), 0);
      if (!path) {
        snprintf(host_msg, sizeof host_msg, "%s", qkeep_errmsg());
        ck_assert_msg(strstr(host_msg, v) && strstr(host_msg, "element 1000"), "%s", host_msg);
      } else {
        ck_assert_str_eq(qkeep_errmsg(), host_msg);
        /* NVFP4: q, k, v are one unit (v is member 2); MXFP4: v alone */
        ck_assert_int_eq(fk.bad_member, strcmp(fp4[s], "mxfp4") == 0 ? 0 : 2);
        ck_assert_int_eq(fk.bad_element, 1000);
      }
      qkeep_model_free(m);
    }
    fake_reset(FAIL);
    qkeep_model *m;
    ck_assert_int_eq(qkeep_model_new_chain((qkeep_plugin *[]){fake(true)}, 1, &m), 0);
    ck_assert_int_eq(qkeep_model_set_quantize(m, &o), 0);
    ck_assert_int_eq(qkeep_model_load(m, tiny), QKEEP_E_DEVICE);
    ck_assert_msg(strstr(qkeep_errmsg(), "fell over") && strstr(qkeep_errmsg(), "backend fake"), "%s",
                  qkeep_errmsg());
    ck_assert_uint_eq(qkeep_model_layer_count(m), 0);
    qkeep_model_free(m);
    ck_assert_uint_eq(n_allocs, 0); /* nothing left on the device, the staging buffer included */
  }
  remove_file_dir(bad);
  free(tiny);
}
END_TEST

int main(void) {
  Suite *su = suite_create("online_device");
  TCase *tc = tcase_create("online_device");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, fp4_online_loads_on_the_device_equal_quantize_then_load);
  tcase_add_test(tc, the_next_unit_is_read_while_this_ones_copies_drain_and_that_read_is_used);
  tcase_add_test(tc, fp4_reloads_on_the_device_equal_a_cold_w1_and_move_no_pointer);
  tcase_add_test(tc, fp4_syncs_of_bf16_buckets_on_the_device_equal_a_cold_w1);
  tcase_add_test(tc, a_declining_or_older_backend_and_other_schemes_take_the_host_path);
  tcase_add_test(tc, a_sync_of_device_bf16_buckets_checks_the_values_on_the_device);
  tcase_add_test(tc, a_nan_is_refused_with_the_host_error_and_a_device_error_fails_the_load);
  suite_add_tcase(su, tc);
  int rc = tu_run_suite(su, CK_NORMAL);
  aq_free(&q);
  return rc;
}
