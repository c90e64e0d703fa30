/*
 * failmalloc.h: allocation-failure injection for the tests that link failmalloc.c.
 *
 * failmalloc.c defines malloc, calloc, realloc, free, posix_memalign, aligned_alloc, memalign,
 * strdup and strndup in the test program itself, so every allocation of the process goes
 * through it (the core, the plugins it dlopens, jansson, PCRE2, libstdc++'s operator new in
 * oneDNN); each forwards to the next definition (glibc's, or the sanitizer runtime's).
 * Armed with fm_arm(n), the n-th allocation call from then on fails (returns NULL with ENOMEM),
 * once; every other call succeeds. fm_live() counts the blocks allocated and not yet freed,
 * so a test can tell a leak on a failure path without LeakSanitizer or valgrind.
 */
#ifndef QKEEP_FAILMALLOC_H
#define QKEEP_FAILMALLOC_H

#include <stdbool.h>

/* Fails the n-th allocation call from now (n >= 1); 0 disarms. Resets the call count. Every
 * thread's calls count, except under AddressSanitizer, where only the calling thread's do (see
 * failmalloc.c). */
void fm_arm(long n);
/* Disarms; returns the allocation calls made since the last fm_arm. */
long fm_disarm(void);
/* Allocation calls made directly from a shared object whose path contains one of these
 * (NULL-terminated, borrowed; NULL: none) are neither counted nor failed: a third-party library
 * that aborts on allocation failure (libstdc++'s operator new under oneDNN's C API, libgomp)
 * is measured apart from the code that must handle it. */
void fm_exempt(const char *const *objects);
/* Whether the armed failure has happened. */
bool fm_failed(void);
/* Blocks allocated through failmalloc and not freed. */
long fm_live(void);

#endif
