/*
 * check_stream.c: the device stream (libqkeep/device/stream.c) on a fake asynchronous device.
 *
 * The device lives in host memory, but copy_h2d_async only queues its copy: the queue runs at
 * sync, at any other memory op, or, up to a fence, when that fence is waited on (a non-blocking
 * wait says "not yet" every other time). So a core that refills a slot before its copy is done,
 * or writes into a slot a reader is filling, leaves other bytes at the destination than the
 * source had. The provider's reads can be held at a gate, so a test can hold every slot in the
 * reading state while it puts.
 */
#include <check.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkutil.h"
#include "fake_async_device.h"
#include "private.h"

/* ---- the fake device ---- */

static int f_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  (void)be, flush();
  return (*out = calloc(1, bytes ? bytes : 1)) ? 0 : QKEEP_E_NOMEM;
}
static void f_free(const struct qkeep_backend *be, void *p) { (void)be, flush(), free(p); }
static size_t h2d_calls; /* copy_h2d_async calls since the last reset_device */
static int f_h2d_async(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  (void)be;
  h2d_calls++;
  ck_assert(aq_push(&q, dst, src, n));
  return 0;
}

static const struct qkeep_memory_ops fenced_ops = {
    .size = sizeof(struct qkeep_memory_ops),
    .alloc = f_alloc,
    .free = f_free,
    .copy_h2d = f_copy,
    .copy_d2h = f_copy,
    .copy_d2d = f_copy,
    .fill = f_fill,
    .sync = f_sync,
    .host_alloc = f_host_alloc,
    .host_free = f_host_free,
    .copy_h2d_async = f_h2d_async,
    .copy_fence = f_fence,
    .copy_fence_wait = f_fence_wait,
};

/* The same device as an ABI 1.2 backend sees it: the table ends before the fences. */
static struct qkeep_memory_ops unfenced_ops;

static void device_for(struct device *dev, struct qkeep_backend *be, bool with_fences) {
  unfenced_ops = fenced_ops;
  unfenced_ops.size = offsetof(struct qkeep_memory_ops, copy_fence);
  *be = (struct qkeep_backend){
      .size = sizeof *be, .name = "fake", .memory = with_fences ? &fenced_ops : &unfenced_ops};
  device_init(dev, be);
}

/* ---- the provider: tensor bytes are a pattern of their offset; reads can wait at a gate ---- */

static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static bool gate_open = true;

static unsigned char pattern(size_t at) { return (unsigned char)(at * 131u + (at >> 9) + 7u); }

/* Where tensor `name` starts in the pattern: 0 for "t", 1000 * k for "s<k>" and "u<k>" (each small tensor
 * its own bytes, so one landing in another's place shows). */
static size_t seed_of(const char *name) { return name[0] == 't' ? 0 : 1000 * strtoul(name + 1, NULL, 10); }

/* Bytes read of the tensors whose names start with each letter. */
static _Atomic size_t read_of[128];

static int p_read_range(const struct provider *p, const struct provided *t, size_t offset, size_t n,
                        void *dst) {
  (void)p;
  size_t seed = seed_of(t->name);
  read_of[(unsigned char)t->name[0] & 127] += n;
  pthread_mutex_lock(&gate_mu);
  while (!gate_open)
    pthread_cond_wait(&gate_cv, &gate_mu);
  pthread_mutex_unlock(&gate_mu);
  for (size_t i = 0; i < n; i++)
    ((unsigned char *)dst)[i] = pattern(seed + offset + i);
  return 0;
}

static void set_gate(bool open) {
  pthread_mutex_lock(&gate_mu);
  gate_open = open;
  pthread_cond_broadcast(&gate_cv);
  pthread_mutex_unlock(&gate_mu);
}

static const struct provider prov = {.what = "pattern", .read_range = p_read_range};

static struct stream_item item(size_t nbytes, char *dst) {
  return (struct stream_item){.t = {.name = "t", .nbytes = nbytes, .where = "pattern", .handle = &prov},
                              .dst = dst};
}

/* A ring of `slots` slots of `piece` bytes, read by three threads. */
static struct qkeep_load_options ring(int slots, size_t piece) {
  return (struct qkeep_load_options){.size = sizeof(struct qkeep_load_options),
                                     .stream_slots = slots,
                                     .stream_piece = piece,
                                     .stream_readers = 3};
}

static void reset_device(void) {
  aq_free(&q);
  h2d_calls = 0;
}

/* n small tensors "<prefix><k>" of `bytes` each, tensor k at dst + k * stride, or nowhere yet when dst is
 * NULL (names from `names`). */
static struct stream_item *small_items(size_t n, size_t bytes, char *dst, size_t stride, char prefix,
                                       char (*names)[16]) {
  struct stream_item *it = calloc(n, sizeof *it);
  for (size_t k = 0; k < n; k++) {
    snprintf(names[k], sizeof names[k], "%c%u", prefix, (unsigned)k); /* at most 11 bytes */
    it[k] = item(bytes, dst ? dst + k * stride : NULL); /* NULL: read ahead, no place yet */
    it[k].alloc = dst; /* one allocation */
    it[k].t.name = names[k];
  }
  return it;
}

/* A fresh fake device (with or without fences) and a stream to it through `slots` slots of `piece` bytes. */
static struct stream *open_stream(struct device *dev, struct qkeep_backend *be, int slots, size_t piece,
                                  bool fences) {
  reset_device();
  struct qkeep_load_options shape = ring(slots, piece);
  device_for(dev, be, fences);
  struct stream *s;
  ck_assert_msg(stream_new(dev, &shape, &s) == 0, "%s", qkeep_errmsg());
  return s;
}

/* Whether tensor k of small_items landed (or, not `landed`, is still zero); its name's number is k + first.
 */
static void assert_small_from(const char *dst, size_t first, size_t k, size_t bytes, size_t stride,
                              bool landed) {
  for (size_t i = 0; i < bytes; i++)
    ck_assert_msg((unsigned char)dst[k * stride + i] == (landed ? pattern(1000 * (k + first) + i) : 0),
                  "tensor %zu byte %zu", k + first, i);
}
static void assert_small(const char *dst, size_t k, size_t bytes, size_t stride, bool landed) {
  assert_small_from(dst, 0, k, bytes, stride, landed);
}

/* Every piece of a tensor many times the ring's size lands, with or without fences (_i). */
START_TEST(a_tensor_larger_than_the_ring_lands_whole) {
  struct qkeep_backend be;
  struct device dev;
  struct stream *s = open_stream(&dev, &be, 3, 4096, _i == 0);
  size_t n = ((size_t)1 << 20) + 123;
  char *dst = calloc(1, n);
  struct stream_item it = item(n, dst);
  ck_assert_msg(stream_items(s, &prov, &it, 1, NULL, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(stream_wait(s), 0);
  for (size_t i = 0; i < n; i++)
    ck_assert_msg((unsigned char)dst[i] == pattern(i), "byte %zu", i);
  if (_i == 0)
    ck_assert_uint_gt(q.fences, n / 4096); /* a fence per piece */
  stream_free(s);
  free(dst);
}
END_TEST

/* A put while a read ahead holds every slot must not borrow one of them (it once took slot 0
 * whatever its state): the bytes put are the bytes that land. */
START_TEST(a_put_never_takes_a_slot_being_read_ahead) {
  struct qkeep_backend be;
  struct device dev;
  struct stream *s = open_stream(&dev, &be, 3, 16384, _i == 0);
  char *ahead = calloc(1, 65536);
  struct stream_item it = item(65536, NULL);
  set_gate(false); /* the readers stop inside their first reads */
  ck_assert_int_eq(stream_prefetch(s, &prov, &it, 1), 0);
  size_t sizes[] = {8192, 100, 16384, 20000}; /* a slot's worth, a small put, a whole slot, more */
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    char *src = malloc(sizes[k]), *dst = calloc(1, sizes[k]);
    memset(src, 0xA0 + (int)k, sizes[k]);
    ck_assert_msg(stream_put(s, dst, src, sizes[k]) == 0, "%s", qkeep_errmsg());
    memset(src, 0, sizes[k]); /* src may change once the put returns */
    if (k == 0)
      set_gate(true);
    ck_assert_int_eq(stream_wait(s), 0);
    for (size_t i = 0; i < sizes[k]; i++)
      ck_assert_msg((unsigned char)dst[i] == 0xA0 + k, "put %zu byte %zu", k, i);
    free(src), free(dst);
  }
  /* the read ahead still serves the load that asks for the same items */
  it.dst = ahead;
  ck_assert_msg(stream_items(s, &prov, &it, 1, NULL, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(stream_end(s), 0);
  for (size_t i = 0; i < 65536; i++)
    ck_assert_msg((unsigned char)ahead[i] == pattern(i), "byte %zu", i);
  stream_free(s);
  free(ahead);
}
END_TEST

/* An item's check sees each piece in its slot before the copy (in a reader thread): it refuses the piece
 * holding byte `refused_at`, and counts the pieces it saw and those not as expected (another context, not
 * whole f32 elements, not the piece's bytes). */
static size_t refused_at;
static _Atomic size_t unexpected, checked;
static int refuse_one(const void *ctx, const struct provided *t, size_t at, const void *bytes, size_t n) {
  checked++; /* no ck_assert in a reader thread: what is wrong is counted */
  unexpected +=
      ctx != &refused_at || at % 4 != 0 || n % 4 != 0 || ((const unsigned char *)bytes)[0] != pattern(at);
  return refused_at >= at && refused_at < at + n
             ? set_error(QKEEP_E_FORMAT, "%s: the piece at %zu is refused", t->name, at)
             : 0;
}

/* A piece its item's check refuses is never copied, nor is anything after it, and the stream fails with the
 * check's message; the pieces of a checked item hold whole elements of its dtype even when a slot does not
 * (4098-byte slots cut an f32 tensor every 4096 bytes). */
START_TEST(a_piece_its_check_refuses_is_never_copied) {
  struct qkeep_backend be;
  struct device dev;
  struct stream *s = open_stream(&dev, &be, 3, 4098, _i == 0);
  size_t n = 40000;
  char *dst = calloc(1, n);
  struct stream_item it = item(n, dst);
  it.t.dtype = QKEEP_DTYPE_F32, it.check = refuse_one, it.check_ctx = &refused_at;
  refused_at = 5 * 4096 + 100, unexpected = checked = 0;
  ck_assert_int_eq(stream_items(s, &prov, &it, 1, NULL, 0), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), "t: the piece at 20480 is refused"), "%s", qkeep_errmsg());
  ck_assert_int_eq(stream_end(s), 0);
  ck_assert_uint_ge(checked, 6);
  ck_assert_uint_eq(unexpected, 0);
  for (size_t i = 0; i < n; i++)
    ck_assert_msg((unsigned char)dst[i] == (i < 5 * 4096 ? pattern(i) : 0), "byte %zu", i);
  /* with nothing refused, every piece lands */
  refused_at = SIZE_MAX;
  ck_assert_msg(stream_items(s, &prov, &it, 1, NULL, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(stream_wait(s), 0);
  for (size_t i = 0; i < n; i++)
    ck_assert_msg((unsigned char)dst[i] == pattern(i), "byte %zu", i);
  ck_assert_uint_eq(unexpected, 0);
  stream_free(s);
  free(dst);
}
END_TEST

/* Small tensors share slots (200 of 100 bytes through a ring of two 4 KiB slots and the arena), each lands
 * at its own place; stacked ones whose device bytes follow each other (64 experts of 256 bytes) take one
 * copy per slot, not one each. */
START_TEST(small_tensors_share_a_slot_and_adjacent_ones_one_copy) {
  struct qkeep_backend be;
  struct device dev;
  struct stream *s = open_stream(&dev, &be, 3, 4096, _i == 0);
  static char names[200][16];
  size_t n = 200, bytes = 100, stride = 300;
  char *dst = calloc(n, stride);
  struct stream_item *it = small_items(n, bytes, dst, stride, 's', names);
  ck_assert_msg(stream_items(s, &prov, it, n, NULL, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(stream_wait(s), 0);
  for (size_t k = 0; k < n; k++)
    assert_small(dst, k, bytes, stride, true);
  ck_assert_uint_eq(h2d_calls, n); /* apart on the device: a copy each */
  if (_i == 0)
    ck_assert_uint_le(q.fences, n / 16 + 1); /* a fence per slot (16 pieces of 256 bytes), not per piece */
  free(it);
  /* 64 experts of one stacked param: four slots' worth, four copies */
  h2d_calls = 0;
  size_t experts = 64, expert = 256;
  char *stacked = calloc(experts, expert);
  it = small_items(experts, expert, stacked, expert, 's', names);
  ck_assert_msg(stream_items(s, &prov, it, experts, NULL, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(stream_wait(s), 0);
  for (size_t k = 0; k < experts; k++)
    assert_small(stacked, k, expert, expert, true);
  ck_assert_uint_eq(h2d_calls, experts * expert / 4096);
  /* the same bytes in memory of unknown (or different) allocations: a copy each (on CUDA a copy that
   * spans two allocations fails, even side by side) */
  for (size_t k = 0; k < experts; k++)
    it[k].alloc = k % 2 ? NULL : stacked;
  h2d_calls = 0;
  ck_assert_msg(stream_items(s, &prov, it, experts, NULL, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(stream_wait(s), 0);
  ck_assert_uint_eq(h2d_calls, experts);
  stream_free(s);
  free(it);
  free(dst);
  free(stacked);
}
END_TEST

/* Refuses the tensor named "s5" (its piece is never copied). */
static int refuse_s5(const void *ctx, const struct provided *t, size_t at, const void *bytes, size_t n) {
  (void)ctx, (void)at, (void)bytes, (void)n;
  return strcmp(t->name, "s5") == 0 ? set_error(QKEEP_E_FORMAT, "%s: refused", t->name) : 0;
}

/* A tensor refused in a slot whose earlier tensors are being copied: their copies read that slot until
 * they are done, so the next load must not refill it before (the slot was once freed at the failure);
 * the next load's bytes and those copied before the failure both land. */
START_TEST(a_refusal_in_a_shared_slot_keeps_it_until_its_copies_are_done) {
  struct qkeep_backend be;
  struct device dev;
  struct stream *s = open_stream(&dev, &be, 3, 4096, _i == 0);
  static char names[10][16], others[10][16];
  size_t n = 10, bytes = 100, stride = 300;
  char *dst = calloc(n, stride), *dst2 = calloc(n, stride);
  struct stream_item *it = small_items(n, bytes, dst, stride, 's', names);
  for (size_t k = 0; k < n; k++)
    it[k].t.dtype = QKEEP_DTYPE_U8, it[k].check = refuse_s5;
  ck_assert_int_eq(stream_items(s, &prov, it, n, NULL, 0), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), "s5: refused"), "%s", qkeep_errmsg());
  ck_assert_uint_eq(h2d_calls, 5);
  /* the next load at once, into other memory, its tensors other bytes ("u<k>" start where "s<k>" do: the
   * same bytes; so the second set starts at 10) */
  struct stream_item *it2 = small_items(n, bytes, dst2, stride, 'u', others);
  for (size_t k = 0; k < n; k++)
    snprintf(others[k], sizeof others[k], "u%zu", k + 10);
  ck_assert_msg(stream_items(s, &prov, it2, n, NULL, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(stream_wait(s), 0);
  for (size_t k = 0; k < n; k++)
    assert_small(dst, k, bytes, stride, k < 5);
  for (size_t k = 0; k < n; k++)
    assert_small_from(dst2, 10, k, bytes, stride, true);
  stream_free(s);
  free(it), free(it2), free(dst), free(dst2);
}
END_TEST

/* Waits up to two seconds for `bytes` of the tensors named `letter...` to have been read. */
static bool read_reaches(char letter, size_t bytes) {
  for (int i = 0; i < 2000 && read_of[(unsigned char)letter] < bytes; i++)
    usleep(1000);
  return read_of[(unsigned char)letter] >= bytes;
}

/* The next layer's items (stream_items' `then`) are read while this layer's are copied, before the next
 * call asks for them, as far as the slots allow (all of them through 15 slots, the first through the one
 * slot 7 leave), and that call copies what was read: each byte read once, each landing (with and
 * without fences). */
START_TEST(the_next_items_are_read_before_they_are_asked_for_and_once) {
  struct qkeep_backend be;
  struct device dev;
  struct stream *s = open_stream(&dev, &be, _i < 2 ? 16 : 8, 4096, _i % 2 == 0);
  static char names[6][16], next_names[6][16];
  size_t n = 6, bytes = 3000, stride = 3000;
  char *dst = calloc(n, stride), *dst2 = calloc(n, stride);
  struct stream_item *it = small_items(n, bytes, dst, stride, 's', names);
  struct stream_item *then = small_items(n, bytes, NULL, stride, 'u', next_names);
  read_of['s'] = read_of['u'] = 0;
  ck_assert_msg(stream_items(s, &prov, it, n, then, n) == 0, "%s", qkeep_errmsg());
  size_t ahead = _i < 2 ? n * bytes : bytes; /* a slot each */
  ck_assert_msg(read_reaches('u', ahead), "%zu bytes of the next items read", (size_t)read_of['u']);
  struct stream_item *it2 = small_items(n, bytes, dst2, stride, 'u', next_names);
  ck_assert_msg(stream_items(s, &prov, it2, n, NULL, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(stream_end(s), 0);
  for (size_t k = 0; k < n; k++)
    assert_small(dst, k, bytes, stride, true), assert_small(dst2, k, bytes, stride, true);
  ck_assert_uint_eq(read_of['s'], n * bytes);
  ck_assert_uint_eq(read_of['u'], n * bytes);
  stream_free(s);
  free(it), free(then), free(it2), free(dst), free(dst2);
}
END_TEST

/* A failure of this layer's items drops the next layer's read ahead (the next call reads them again and
 * lands them); a piece of the next layer's that its check refuses fails that layer's call, not this one's. */
START_TEST(a_failure_on_either_side_of_a_read_ahead_is_its_own_layers) {
  struct qkeep_backend be;
  struct device dev;
  struct stream *s = open_stream(&dev, &be, 8, 4096, _i == 0);
  static char names[10][16], next_names[10][16];
  size_t n = 10, bytes = 100, stride = 300;
  char *dst = calloc(n, stride), *dst2 = calloc(n, stride);
  struct stream_item *it = small_items(n, bytes, dst, stride, 's', names);
  struct stream_item *then = small_items(n, bytes, NULL, stride, 'u', next_names);
  for (size_t k = 0; k < n; k++)
    it[k].t.dtype = QKEEP_DTYPE_U8, it[k].check = refuse_s5;
  ck_assert_int_eq(stream_items(s, &prov, it, n, then, n), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), "s5: refused"), "%s", qkeep_errmsg());
  struct stream_item *it2 = small_items(n, bytes, dst2, stride, 'u', next_names);
  ck_assert_msg(stream_items(s, &prov, it2, n, NULL, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(stream_wait(s), 0);
  for (size_t k = 0; k < n; k++)
    assert_small(dst2, k, bytes, stride, true);
  /* now the next layer's tensor s5 is refused: this layer's call succeeds, the next one fails */
  memset(dst2, 0, n * stride);
  struct stream_item *then3 = small_items(n, bytes, NULL, stride, 's', names);
  struct stream_item *it3 = small_items(n, bytes, dst2, stride, 's', names);
  for (size_t k = 0; k < n; k++) {
    then3[k].t.dtype = it3[k].t.dtype = QKEEP_DTYPE_U8;
    then3[k].check = it3[k].check = refuse_s5;
  }
  ck_assert_msg(stream_items(s, &prov, it2, n, then3, n) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(stream_items(s, &prov, it3, n, NULL, 0), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), "s5: refused"), "%s", qkeep_errmsg());
  ck_assert_int_eq(stream_end(s), 0);
  for (size_t k = 0; k < 5; k++)
    assert_small(dst2, k, bytes, stride, true);
  stream_free(s);
  free(it), free(then), free(it2), free(it3), free(then3), free(dst), free(dst2);
}
END_TEST

int main(void) {
  Suite *su = suite_create("stream");
  TCase *tc = tcase_create("stream");
  tcase_set_timeout(tc, 60);
  tcase_add_loop_test(tc, a_tensor_larger_than_the_ring_lands_whole, 0, 2);
  tcase_add_loop_test(tc, a_put_never_takes_a_slot_being_read_ahead, 0, 2);
  tcase_add_loop_test(tc, a_piece_its_check_refuses_is_never_copied, 0, 2);
  tcase_add_loop_test(tc, small_tensors_share_a_slot_and_adjacent_ones_one_copy, 0, 2);
  tcase_add_loop_test(tc, a_refusal_in_a_shared_slot_keeps_it_until_its_copies_are_done, 0, 2);
  tcase_add_loop_test(tc, the_next_items_are_read_before_they_are_asked_for_and_once, 0, 4);
  tcase_add_loop_test(tc, a_failure_on_either_side_of_a_read_ahead_is_its_own_layers, 0, 2);
  suite_add_tcase(su, tc);
  SRunner *sr = srunner_create(su);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  reset_device();
  return failed ? 1 : 0;
}
