/*
 * benchutil.h: what the CPU benchmarks share beyond tests/testutil.h: the last-level cache's
 * size, the copy bandwidth peer (the ceiling of a memory-bound kernel) and how many weight
 * copies keep a kernel out of cache. Header-only; the programs that include it build with
 * OpenMP, and each defines die() (print what failed with qkeep_errmsg() and exit).
 */
#ifndef QKEEP_BENCHUTIL_H
#define QKEEP_BENCHUTIL_H

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testutil.h"

static void die(const char *what);

/* The last-level cache in bytes: sysfs (what lscpu shows), else sysconf, else 32 MiB. sysconf's
 * CPUID answer can be the host's under a hypervisor (256 MiB on the 32 MiB test VM). */
static size_t llc_bytes(void) {
  FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
  unsigned long kb = 0;
  int got = f ? fscanf(f, "%luK", &kb) : 0;
  if (f)
    fclose(f);
  if (got == 1 && kb)
    return (size_t)kb << 10;
  long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return v > 0 ? (size_t)v : (size_t)32 << 20;
}

/* Copy bandwidth with `threads` threads over buffers of 4 x LLC: memcpy, bytes read plus written per second.
 */
static double copy_bandwidth(size_t llc, int threads) {
  size_t bytes = 4 * llc;
  unsigned char *a = malloc(bytes), *b = malloc(bytes);
  if (!a || !b)
    die("out of memory for the bandwidth test");
  memset(a, 1, bytes);
  memset(b, 2, bytes);
  double t[9];
  for (int r = 0; r < 9; r++) {
    double t0 = tu_now();
#pragma omp parallel num_threads(threads)
    {
      int n = omp_get_num_threads(), i = omp_get_thread_num();
      size_t part = bytes / (size_t)n, off = part * (size_t)i;
      memcpy(b + off, a + off, i == n - 1 ? bytes - off : part);
    }
    t[r] = tu_now() - t0;
  }
  free(a);
  free(b);
  return 2.0 * (double)bytes / tu_median(t, 9);
}

/* How many copies of `bytes` of weights exceed twice the LLC (at least 2). */
static int copies_for(size_t bytes, size_t llc) {
  size_t c = (2 * llc + bytes - 1) / bytes;
  return c < 2 ? 2 : (int)c;
}

#endif
