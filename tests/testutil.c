/* testutil.c: helpers shared by the Check suites. */
#include "testutil.h"

#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "qkeep/qkeep.h"

/* Every suite links this file (an archive member the linker always pulls in), so the
 * sanitizer hook for programs that run oneDNN's threads rides along; see the file. */
#include "../build-aux-src/asan_options.c"

const char *tu_srcdir(void) {
  const char *s = getenv("QKEEP_TEST_SRCDIR");
  return s ? s : ".";
}

const char *tu_builddir(void) {
  const char *s = getenv("QKEEP_TEST_BUILDDIR");
  return s ? s : ".";
}

char *tu_path(const char *dir, const char *file) {
  size_t n = strlen(dir) + strlen(file) + 2;
  char *p = malloc(n);
  if (p)
    snprintf(p, n, "%s/%s", dir, file);
  return p;
}

char *tu_tmpdir(const char *name) {
  static int counter;
  char buf[4096];
  snprintf(buf, sizeof buf, "%s/tests", tu_builddir());
  mkdir(buf, 0755);
  snprintf(buf, sizeof buf, "%s/tests/tmp", tu_builddir());
  mkdir(buf, 0755);
  snprintf(buf, sizeof buf, "%s/tests/tmp/%s-%ld-%d", tu_builddir(), name, (long)getpid(), counter++);
  tu_rmtree(buf);
  if (mkdir(buf, 0755) != 0 && errno != EEXIST)
    return NULL;
  return strdup(buf);
}

int tu_write_file(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f)
    return -1;
  size_t w = n ? fwrite(data, 1, n, f) : 0;
  int rc = fclose(f);
  return (w == n && rc == 0) ? 0 : -1;
}

void *tu_read_file(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f)
    return NULL;
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)len + 1);
  if (buf && fread(buf, 1, (size_t)len, f) != (size_t)len) {
    free(buf);
    buf = NULL;
  }
  fclose(f);
  if (buf) {
    buf[len] = 0;
    *n = (size_t)len;
  }
  return buf;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(path);
}

void tu_rmtree(const char *path) { nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

uint64_t tu_rand(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

float tu_randf(uint64_t *state) { return (float)((tu_rand(state) >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }

double tu_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int by_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

double tu_median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, by_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

long long tu_status_bytes(const char *field) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long long kb = -1;
  size_t n = strlen(field);
  while (f && fgets(line, sizeof line, f))
    if (strncmp(line, field, n) == 0 && line[n] == ':')
      kb = atoll(line + n + 1);
  if (f)
    fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}

void tu_fill_bytes(uint8_t *p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++)
    p[i] = (uint8_t)(tu_rand(&seed) >> 56);
}

static void log_line(void *user, enum qkeep_log_level level, const char *msg) {
  (void)user;
  static const char *const names[] = {"error", "warning", "info", "debug"};
  fprintf(stderr, "qkeep: %s: %s\n", (unsigned)level <= QKEEP_LOG_DEBUG ? names[level] : "log", msg);
}

void tu_log_to_stderr(int max_level) {
  qkeep_set_log_level((enum qkeep_log_level)max_level);
  qkeep_set_logger(log_line, NULL);
}
