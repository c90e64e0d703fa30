/*
 * failmalloc.c: the allocator interposer behind failmalloc.h.
 *
 * Defined in the test program, these functions come first in symbol lookup, so they replace the
 * allocator for the whole process (glibc supports this; its own internal allocations call them
 * too). Each forwards to the next definition, found with dlsym(RTLD_NEXT): glibc's, or the
 * AddressSanitizer runtime's in a --enable-sanitizers build, so ASan and LSan still see every
 * block. dlsym itself may allocate before the real functions are known: those few requests are
 * served from a static arena and never freed.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "failmalloc.h"

/* The sanitizer runtime calls malloc while it starts, before its shadow memory exists: code here
 * must not be instrumented (an instrumented access would read the missing shadow). */
#define RAW __attribute__((no_sanitize("address", "undefined")))

/* The prototypes of the functions replaced here (some are not in the headers included above). */
void *malloc(size_t n);
void *calloc(size_t count, size_t n);
void *realloc(void *p, size_t n);
void free(void *p);
int posix_memalign(void **out, size_t alignment, size_t n);
void *aligned_alloc(size_t alignment, size_t n);
void *memalign(size_t alignment, size_t n);
char *strdup(const char *s);
char *strndup(const char *s, size_t n);

static void *(*next_malloc)(size_t);
static void *(*next_calloc)(size_t, size_t);
static void *(*next_realloc)(void *, size_t);
static void (*next_free)(void *);
static int (*next_posix_memalign)(void **, size_t, size_t);
static void *(*next_aligned_alloc)(size_t, size_t);
static void *(*next_memalign)(size_t, size_t);

static _Alignas(64) unsigned char arena[1 << 16];
static atomic_size_t arena_used;
static atomic_int resolving;

static atomic_long target; /* the call that fails (1-based since fm_arm); 0: disarmed */
static atomic_long calls;  /* allocation calls since fm_arm */
static atomic_bool failed; /* the armed call has failed */
static atomic_long live;   /* blocks handed out by the next allocator and not freed */

RAW static bool in_arena(const void *p) {
  return (const unsigned char *)p >= arena && (const unsigned char *)p < arena + sizeof arena;
}

RAW static void *arena_alloc(size_t n) {
  size_t rounded = (n + 63) & ~(size_t)63, at = atomic_fetch_add(&arena_used, rounded);
  if (at + rounded > sizeof arena)
    return NULL;
  return arena + at;
}

/* Resolves the next allocator once; true when it is known. */
RAW static bool resolve(void) {
  if (next_free)
    return true;
  if (atomic_exchange(&resolving, 1))
    return false; /* dlsym's own allocations, or a second thread during the first lookup */
  void *sym[7] = {dlsym(RTLD_NEXT, "malloc"),        dlsym(RTLD_NEXT, "calloc"),
                  dlsym(RTLD_NEXT, "realloc"),       dlsym(RTLD_NEXT, "posix_memalign"),
                  dlsym(RTLD_NEXT, "aligned_alloc"), dlsym(RTLD_NEXT, "memalign"),
                  dlsym(RTLD_NEXT, "free")};
  memcpy(&next_malloc, &sym[0], sizeof next_malloc);
  memcpy(&next_calloc, &sym[1], sizeof next_calloc);
  memcpy(&next_realloc, &sym[2], sizeof next_realloc);
  memcpy(&next_posix_memalign, &sym[3], sizeof next_posix_memalign);
  memcpy(&next_aligned_alloc, &sym[4], sizeof next_aligned_alloc);
  memcpy(&next_memalign, &sym[5], sizeof next_memalign);
  memcpy(&next_free, &sym[6], sizeof next_free); /* last: next_free set means all are */
  atomic_store(&resolving, 0);
  return next_free != NULL;
}

static const char *const *exempt;

/* Whether the allocation was called from an exempt object (caller: the return address). */
RAW static bool exempt_caller(const void *caller) {
  Dl_info info;
  if (!exempt || !dladdr(caller, &info) || !info.dli_fname)
    return false;
  for (const char *const *e = exempt; *e; e++)
    if (strstr(info.dli_fname, *e))
      return true;
  return false;
}

/*
 * Under AddressSanitizer only the thread that armed the failure sees it: the runtime starts each
 * new thread with pthread_getattr_np, whose allocation it cannot do without (a failure there is a
 * CHECK failure inside ASan, not the code under test). Without ASan every thread's calls count.
 */
static _Thread_local bool armed_here;
#if defined(__SANITIZE_ADDRESS__)
#define COUNTS_HERE armed_here
#else
#define COUNTS_HERE true
#endif

/* Whether this allocation call (from caller) is the one that fails. */
RAW static bool fail_now_from(const void *caller) {
  long t = atomic_load(&target);
  if (!t || !COUNTS_HERE || exempt_caller(caller))
    return false;
  long c = atomic_fetch_add(&calls, 1) + 1;
  if (c != t)
    return false;
  atomic_store(&failed, true);
  if (getenv("FAILMALLOC_TRACE")) { /* where the failing call came from, for debugging a case */
    void *frames[32];
    backtrace_symbols_fd(frames, backtrace(frames, 32), STDERR_FILENO);
  }
  return true;
}

RAW static void *counted(void *p) {
  if (p)
    atomic_fetch_add(&live, 1);
  return p;
}

RAW static void *malloc_from(size_t n, const void *caller) {
  if (!resolve())
    return arena_alloc(n);
  if (fail_now_from(caller)) {
    errno = ENOMEM;
    return NULL;
  }
  return counted(next_malloc(n));
}

RAW void *malloc(size_t n) { return malloc_from(n, __builtin_return_address(0)); }

RAW void *calloc(size_t count, size_t n) {
  if (!resolve()) {
    size_t bytes;
    return __builtin_mul_overflow(count, n, &bytes) ? NULL : arena_alloc(bytes); /* static: zeroed */
  }
  if (fail_now_from(__builtin_return_address(0))) {
    errno = ENOMEM;
    return NULL;
  }
  return counted(next_calloc(count, n));
}

RAW void *realloc(void *p, size_t n) {
  if (!resolve() || in_arena(p)) {
    void *q = resolve() ? malloc(n) : arena_alloc(n);
    if (q && p) /* an arena block's size is unknown: copy what fits of the rest of the arena */
      memcpy(q, p,
             n < (size_t)(arena + sizeof arena - (unsigned char *)p)
                 ? n
                 : (size_t)(arena + sizeof arena - (unsigned char *)p));
    return q;
  }
  if (!p)
    return malloc_from(n, __builtin_return_address(0));
  if (n == 0) { /* glibc frees and returns NULL */
    atomic_fetch_sub(&live, 1);
    return next_realloc(p, 0);
  }
  if (fail_now_from(__builtin_return_address(0))) {
    errno = ENOMEM;
    return NULL; /* p is untouched, as realloc promises */
  }
  return next_realloc(p, n);
}

RAW void free(void *p) {
  if (!p || in_arena(p))
    return;
  if (!resolve())
    return; /* cannot happen: a block not from the arena came from the next allocator */
  atomic_fetch_sub(&live, 1);
  next_free(p);
}

RAW int posix_memalign(void **out, size_t alignment, size_t n) {
  if (!resolve())
    return ENOMEM;
  if (fail_now_from(__builtin_return_address(0)))
    return ENOMEM;
  int rc = next_posix_memalign(out, alignment, n);
  if (!rc)
    counted(*out);
  return rc;
}

RAW void *aligned_alloc(size_t alignment, size_t n) {
  if (!resolve())
    return NULL;
  if (fail_now_from(__builtin_return_address(0))) {
    errno = ENOMEM;
    return NULL;
  }
  return counted(next_aligned_alloc(alignment, n));
}

RAW void *memalign(size_t alignment, size_t n) {
  if (!resolve())
    return NULL;
  if (fail_now_from(__builtin_return_address(0))) {
    errno = ENOMEM;
    return NULL;
  }
  return counted(next_memalign(alignment, n));
}

RAW char *strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = malloc_from(n, __builtin_return_address(0));
  if (d)
    memcpy(d, s, n);
  return d;
}

RAW char *strndup(const char *s, size_t n) {
  size_t len = strnlen(s, n);
  char *d = malloc_from(len + 1, __builtin_return_address(0));
  if (d) {
    memcpy(d, s, len);
    d[len] = '\0';
  }
  return d;
}

RAW void fm_arm(long n) {
  armed_here = true;
  atomic_store(&target, 0);
  atomic_store(&calls, 0);
  atomic_store(&failed, false);
  atomic_store(&target, n);
}

RAW void fm_exempt(const char *const *objects) { exempt = objects; }

RAW long fm_disarm(void) {
  atomic_store(&target, 0);
  return atomic_load(&calls);
}

RAW bool fm_failed(void) { return atomic_load(&failed); }

RAW long fm_live(void) { return atomic_load(&live); }
