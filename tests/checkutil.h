/*
 * checkutil.h: Check helpers every suite shares: ck_assert without the location records that
 * nothing reads when the suites do not fork, running a suite to an exit status, the
 * clean census that every backend must show, snapshots of every storage of a model (address,
 * capacity and all bytes, padding included) to tell "in place and equal to a cold start" from
 * anything else, an asserted malloc, and the refusals of a whole-number configure key.
 * Header-only: libtestutil also serves the benchmarks, which do not link Check.
 */
#ifndef QKEEP_CHECKUTIL_H
#define QKEEP_CHECKUTIL_H

#include <check.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qkeep/qkeep.h"
#include "qkeep/qkeep_backend.h"

/*
 * Every passing ck_assert tells the runner where the test got to (_mark_point: one write(2)
 * to the runner's message file), so that a test that dies in its forked child is reported
 * "after" its last assertion. Without fork (CK_FORK=no, as check-valgrind runs the suites) a
 * test that dies takes the runner with it, and nothing reads those records; yet a suite that
 * asserts inside its exhaustive loops writes millions of them (check_stream, check_zentorch,
 * check_cuda_layout: 1.9 to 2.7 million each), and under valgrind those writes were most of
 * its time (check-valgrind: 595 s of CPU with them, 215 s without). So ck_assert_msg, which
 * every ck_assert_* expands to, records the point only when CK_FORK is not "no" (Check's own
 * default). A failing assertion reports its file and line as before; a suite that forks whatever
 * CK_FORK says (check_docs) reports a crash under CK_FORK=no at its test's START_TEST line.
 */
static inline bool tu_records_mark_points(void) {
  static _Atomic int records = -1; /* asserts may run on several threads */
  if (records < 0) {
    const char *fork_status = getenv("CK_FORK");
    records = !(fork_status && strcmp(fork_status, "no") == 0);
  }
  return records;
}

static inline void tu_mark_point(const char *file, int line) {
  if (tu_records_mark_points())
    _mark_point(file, line);
}

#undef ck_assert_msg
#define ck_assert_msg(expr, ...)                                                                             \
  ((expr) ? tu_mark_point(__FILE__, __LINE__)                                                                \
          : _ck_assert_failed(__FILE__, __LINE__, "Assertion '" #expr "' failed", ##__VA_ARGS__))

/*
 * Whether the suite runs under valgrind (its preload library is in LD_PRELOAD), where a test whose
 * loops repeat the same code on more data (every layer of a model, not one of each shape) may
 * run fewer of them: valgrind looks for memory errors, which the same code on the same shapes
 * shows once, at 30-50 times a plain run's CPU time. Plain make check runs them all.
 */
static inline bool tu_under_valgrind(void) {
  const char *p = getenv("LD_PRELOAD");
  return p && strstr(p, "vgpreload");
}

/*
 * Whether the suite is built with AddressSanitizer (--enable-sanitizers, the make distcheck pass), where
 * each test costs several times a plain run's CPU time for the same reason as under valgrind.
 */
static inline bool tu_under_sanitizer(void) {
#if defined(__SANITIZE_ADDRESS__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  return true;
#else
  return false;
#endif
#else
  return false;
#endif
}

/*
 * Whether a memory checker watches the suite (valgrind, or ASan and UBSan): a test may then run the
 * same code on the same shapes once, not again for each repetition; plain make check runs them all.
 */
static inline bool tu_under_memcheck(void) { return tu_under_valgrind() || tu_under_sanitizer(); }

/* malloc(n) (at least one byte), asserted. */
static inline void *tu_xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  ck_assert_ptr_nonnull(p);
  return p;
}

/* Runs suite s (the runner takes it) with `mode` output; EXIT_SUCCESS when nothing failed. */
static inline int tu_run_suite(Suite *s, enum print_output mode) {
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, mode);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

/* The census every backend must show: missing 0, C1 0, C2 0, released 0, and every loader
 * param registered as the same object. Returns the census for further checks. */
static inline struct qkeep_census tu_assert_census_clean(qkeep_model *m) {
  struct qkeep_census c = {.size = sizeof c};
  ck_assert_msg(qkeep_census(m, &c) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(c.missing, 0);
  ck_assert_int_eq(c.c1, 0);
  ck_assert_int_eq(c.c2, 0);
  ck_assert_int_eq(c.released, 0);
  ck_assert_int_eq(c.loader_params, c.registered_same);
  return c;
}

/* Every storage of a model in model order: address, capacity and a host copy of its bytes. */
struct tu_storages {
  const void **data;
  size_t *capacity;
  unsigned char **bytes;
  int n, cap;
  /* Copies n bytes of a storage to the host (NULL: memcpy, for host-memory backends). */
  int (*to_host)(void *dst, const void *src, size_t n);
};

static inline int tu_remember_storage(void *user, const char *layer, const char *name, const void *data,
                                      size_t capacity) {
  (void)layer, (void)name;
  struct tu_storages *s = user;
  if (s->n == s->cap) {
    s->cap = s->cap ? 2 * s->cap : 64;
    s->data = realloc(s->data, sizeof *s->data * (size_t)s->cap);
    s->capacity = realloc(s->capacity, sizeof *s->capacity * (size_t)s->cap);
    s->bytes = realloc(s->bytes, sizeof *s->bytes * (size_t)s->cap);
    ck_assert(s->data && s->capacity && s->bytes);
  }
  s->data[s->n] = data;
  s->capacity[s->n] = capacity;
  s->bytes[s->n] = malloc(capacity + 1);
  ck_assert_ptr_nonnull(s->bytes[s->n]);
  if (s->to_host)
    ck_assert_int_eq(s->to_host(s->bytes[s->n], data, capacity), 0);
  else
    memcpy(s->bytes[s->n], data, capacity);
  s->n++;
  return 0;
}

/* Fills s (its to_host set or NULL) with the storages of m, replacing what it held. */
static inline void tu_snapshot(qkeep_model *m, struct tu_storages *s) {
  for (int i = 0; i < s->n; i++)
    free(s->bytes[i]);
  s->n = 0;
  ck_assert_int_eq(qkeep_foreach_storage(m, tu_remember_storage, s), 0);
}

/* Frees what a snapshot holds; s may be snapshot again. */
static inline void tu_release_snapshot(struct tu_storages *s) {
  for (int i = 0; i < s->n; i++)
    free(s->bytes[i]);
  free(s->data), free(s->capacity), free(s->bytes);
  s->data = NULL, s->capacity = NULL, s->bytes = NULL;
  s->n = s->cap = 0;
}

/* The same addresses as `before`, and bytes equal to `cold`'s, storage by storage. */
static inline void tu_assert_in_place_and_equal(const struct tu_storages *before,
                                                const struct tu_storages *after,
                                                const struct tu_storages *cold) {
  ck_assert_int_eq(before->n, after->n);
  ck_assert_int_eq(after->n, cold->n);
  for (int i = 0; i < after->n; i++) {
    ck_assert_ptr_eq(before->data[i], after->data[i]); /* no storage moved */
    ck_assert_uint_eq(after->capacity[i], cold->capacity[i]);
    ck_assert_msg(memcmp(after->bytes[i], cold->bytes[i], cold->capacity[i]) == 0,
                  "storage %d differs from a cold start (padding included)", i);
  }
}

/* `be` takes key = lo and key = hi, and refuses every other way a whole number from lo to hi can be
 * wrong with "KEY = 'VALUE': expected a whole number from LO to HI"; the key is left at lo. */
static inline void tu_assert_int_key(const struct qkeep_backend *be, const char *key, long lo, long hi) {
  char below[32], above[32];
  snprintf(below, sizeof below, "%ld", lo - 1);
  snprintf(above, sizeof above, "%ld", hi + 1);
  const char *const bad[] = {below, above, "2x", "", "two", " "};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ck_assert_int_eq(be->configure(be, key, bad[i]), QKEEP_E_CONFIG);
    char want[160];
    snprintf(want, sizeof want, "%s = '%s': expected a whole number from %ld to %ld", key, bad[i], lo, hi);
    ck_assert_str_eq(qkeep_errmsg(), want);
  }
  char value[32];
  snprintf(value, sizeof value, "%ld", hi);
  ck_assert_int_eq(be->configure(be, key, value), 0);
  snprintf(value, sizeof value, "%ld", lo);
  ck_assert_int_eq(be->configure(be, key, value), 0);
}

#endif
