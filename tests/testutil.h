/* testutil.h: helpers shared by the Check suites. */
#ifndef QKEEP_TESTUTIL_H
#define QKEEP_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

/* $QKEEP_TEST_SRCDIR / $QKEEP_TEST_BUILDDIR (set by make check), or "." */
const char *tu_srcdir(void);
const char *tu_builddir(void);
/* A fresh, empty directory builddir/tests/tmp/<name>-<pid>-<n>; malloc'd path. */
char *tu_tmpdir(const char *name);
/* dir + "/" + file, malloc'd. */
char *tu_path(const char *dir, const char *file);
/* Whole-file helpers; 0 on success. tu_read_file returns malloc'd bytes (NULL on failure). */
int tu_write_file(const char *path, const void *data, size_t n);
void *tu_read_file(const char *path, size_t *n);
/* Removes a directory tree (best effort). */
void tu_rmtree(const char *path);
/* Deterministic generator: splitmix64. tu_randf is uniform in [-1, 1). */
uint64_t tu_rand(uint64_t *state);
float tu_randf(uint64_t *state);
/* n bytes from the generator seeded `seed` (the top byte of each draw). */
void tu_fill_bytes(uint8_t *p, size_t n, uint64_t seed);

/* Monotonic seconds, for benchmarks. */
double tu_now(void);
/* The median of v[0..n) (sorts v in place). */
double tu_median(double *v, int n);
/* A field of /proc/self/status in bytes (VmRSS, VmHWM), or -1 when it cannot be read. */
long long tu_status_bytes(const char *field);
/* Routes the library's log lines up to `max_level` (a qkeep_log_level: 3 is QKEEP_LOG_DEBUG, the
 * stream's and the sync's traces) to stderr, "qkeep: LEVEL: line": for benches asked to trace. */
void tu_log_to_stderr(int max_level);

#endif
