/*
 * rewrite.h: a checkpoint file rewritten in place (same size) in the middle of a load, from the
 * load's progress callback, as a trainer saving into the directory would: for the suites that
 * check that qkeep notices (check_badckpt, check_reload). Header-only.
 */
#ifndef QKEEP_TESTS_REWRITE_H
#define QKEEP_TESTS_REWRITE_H

#include <check.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "private.h"

/* Waits (sleeping, no assertion on time) until the clock has left the second of the file's change
 * time: a write from then on gives the file another change time at any file system's granularity. */
static inline void wait_past_change_time(const char *path) {
  struct stat sb;
  ck_assert_int_eq(stat(path, &sb), 0);
  for (struct timespec now = {0};
       clock_gettime(CLOCK_REALTIME, &now) == 0 && now.tv_sec <= sb.st_ctim.tv_sec;)
    nanosleep(&(struct timespec){0, 20 * 1000 * 1000}, NULL);
}

/* A tensor's bytes rewritten in place (each XOR 1: a bf16 1.0 stays finite; size kept) by the
 * progress callback, after the first layer: a trainer saving into the directory mid-load. */
struct rewrite {
  char *path;
  bool armed;
  uint64_t at, n;
};

static inline struct rewrite rewrite_of(const char *path, const char *tensor) {
  struct st_file *f;
  ck_assert_msg(st_open(path, &f) == 0, "%s", qkeep_errmsg());
  const struct st_tensor *t = st_find(f, tensor);
  ck_assert_msg(t != NULL, "%s has no '%s'", path, tensor);
  struct rewrite r = {strdup(path), true, t->offset, t->nbytes};
  st_close(f);
  wait_past_change_time(path);
  return r;
}

static inline void rewrite_after_first_layer(void *user, size_t done, size_t total, const char *layer) {
  struct rewrite *r = user;
  (void)total;
  (void)layer;
  if (!r->armed || done != 1)
    return;
  r->armed = false;
  unsigned char *bytes = malloc(r->n);
  int fd = open(r->path, O_RDWR);
  ck_assert(bytes && fd >= 0);
  ck_assert_int_eq(pread(fd, bytes, r->n, (off_t)r->at), (ssize_t)r->n);
  for (uint64_t i = 0; i < r->n; i++)
    bytes[i] ^= 1;
  ck_assert_int_eq(pwrite(fd, bytes, r->n, (off_t)r->at), (ssize_t)r->n);
  close(fd);
  free(bytes);
}

#endif
