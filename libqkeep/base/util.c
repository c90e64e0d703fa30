/* util.c: small helpers shared by the core's files. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/base.h"
#include "qkeep/qkeep_backend_util.h"

char *xstrdup(const char *s) {
  if (!s)
    return NULL;
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d)
    memcpy(d, s, n);
  return d;
}

/* Makes room for `need` elements; doubles the capacity so appends are amortised O(1). */
int grow_array(void **array, size_t *cap, size_t need, size_t elem_size) {
  if (need <= *cap)
    return 0;
  size_t n = *cap ? *cap : 8;
  while (n < need)
    n *= 2;
  void *p = realloc(*array, n * elem_size);
  if (!p)
    return set_error(QKEEP_E_NOMEM, "out of memory growing a table to %zu entries", n);
  *array = p;
  *cap = n;
  return 0;
}

bool spec_equal(const struct qkeep_spec *a, const struct qkeep_spec *b) { return qkeep_be_spec_equal(a, b); }

const char *spec_shape_str(const struct qkeep_spec *spec, char *buf, size_t len) {
  size_t used = 0;
  used += (size_t)snprintf(buf, len, "[");
  for (int i = 0; i < spec->ndim && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, "%s%lld", i ? ", " : "", (long long)spec->shape[i]);
  if (used < len)
    snprintf(buf + used, len - used, "]");
  return buf;
}

void copy_sized(void *out, const void *in, size_t in_size) {
  size_t want;
  memcpy(&want, out, sizeof want);
  if (!want || want > in_size)
    want = in_size;
  memcpy(out, in, want);
  memcpy(out, &want, sizeof want);
}

const char *json_kind(const void *json_value) {
  switch (json_typeof((const json_t *)json_value)) {
  case JSON_OBJECT: return "an object";
  case JSON_ARRAY: return "an array";
  case JSON_STRING: return "a string";
  case JSON_INTEGER: return "an integer";
  case JSON_REAL: return "a real number";
  case JSON_TRUE:
  case JSON_FALSE: return "a boolean";
  case JSON_NULL: return "null";
  }
  return "?";
}

bool spec_bytes_checked(const struct qkeep_spec *spec, size_t *bytes) {
  if ((unsigned)spec->dtype >= QKEEP_DTYPE_COUNT || spec->ndim < 0 || spec->ndim > QKEEP_MAX_DIMS)
    return false;
  size_t bits = qkeep_dtype_bits(spec->dtype); /* sub-byte dtypes (F4, F6) round up to whole bytes */
  for (int i = 0; i < spec->ndim; i++)
    if (spec->shape[i] < 0 || __builtin_mul_overflow(bits, (size_t)spec->shape[i], &bits))
      return false;
  if (bits > SIZE_MAX - 7)
    return false;
  *bytes = (bits + 7) / 8;
  return true;
}

bool dim_mul(int64_t a, int64_t b, int64_t *out) {
  int64_t r;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r))
    return false;
  *out = r;
  return true;
}

bool dim_add(int64_t a, int64_t b, int64_t *out) {
  int64_t r;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r))
    return false;
  *out = r;
  return true;
}

bool size_mul(size_t a, size_t b, size_t *out) {
  size_t r;
  if (__builtin_mul_overflow(a, b, &r))
    return false;
  *out = r;
  return true;
}

bool f32_matrix_bytes(int64_t rows, int64_t cols, size_t *bytes) {
  int64_t elements;
  return dim_mul(rows, cols, &elements) && (uint64_t)elements <= SIZE_MAX &&
         size_mul((size_t)elements, sizeof(float), bytes);
}

/*
 * jansson 2.14 drops a character when its token buffer cannot grow (load.c's lex_save ignores
 * strbuffer_append_byte's failure), so a parse can succeed with a key or a number cut short. To
 * tell, the core wraps jansson's allocator once (json_set_alloc_funcs, chained to whatever was
 * installed before, so an application's own functions keep serving every block) and a failed
 * allocation during a parse marks this thread's parse as out of memory. The library's destructor
 * puts the previous functions back when they are still ours (a dlclose must not leave jansson
 * calling into unmapped code).
 */
static json_malloc_t json_next_malloc;
static json_free_t json_next_free;
static _Thread_local bool json_alloc_failed;
static pthread_once_t json_wrap_once = PTHREAD_ONCE_INIT;

static void *json_watched_malloc(size_t n) {
  void *p = json_next_malloc(n);
  if (!p)
    json_alloc_failed = true;
  return p;
}

static void json_forward_free(void *p) { json_next_free(p); }

static void json_wrap_allocator(void) {
  json_get_alloc_funcs(&json_next_malloc, &json_next_free);
  json_set_alloc_funcs(json_watched_malloc, json_forward_free);
}

__attribute__((destructor)) static void json_unwrap_allocator(void) {
  json_malloc_t m;
  json_free_t f;
  json_get_alloc_funcs(&m, &f);
  if (m == json_watched_malloc && json_next_malloc)
    json_set_alloc_funcs(json_next_malloc, json_next_free);
}

json_t *json_loadb_watched(const char *text, size_t len, size_t flags, void *error, bool *alloc_failed) {
  json_error_t *err = error;
  pthread_once(&json_wrap_once, json_wrap_allocator);
  json_alloc_failed = false;
  json_t *root = json_loadb(text, len, flags, err);
  *alloc_failed = json_alloc_failed || (!root && json_error_code(err) == json_error_out_of_memory);
  if (*alloc_failed) {
    json_decref(root);
    return NULL;
  }
  return root;
}

char *json_dumps_watched(const json_t *json, size_t flags) {
  pthread_once(&json_wrap_once, json_wrap_allocator);
  json_alloc_failed = false;
  char *text = json_dumps(json, flags);
  if (json_alloc_failed) {
    free(text);
    return NULL;
  }
  return text;
}

int json_parse(const char *text, size_t len, size_t flags, json_t **out, int *line, int *column,
               int *position, char *why) {
  json_error_t err;
  bool no_memory;
  if ((*out = json_loadb_watched(text, len, flags, &err, &no_memory)))
    return 0;
  if (no_memory)
    return QKEEP_E_NOMEM;
  *line = err.line;
  *column = err.column;
  *position = err.position;
  snprintf(why, 160, "%s", err.text);
  return QKEEP_E_FORMAT;
}

double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/*
 * vasprintf with the length measured first and the buffer allocated once, exactly: glibc 2.36's
 * vasprintf, when its final realloc fails, returns its work buffer full to the last byte and writes
 * the terminating NUL one past it (the allocation-failure tests found it under ASan).
 */
int qk_vasprintf(char **out, const char *fmt, va_list ap) {
  va_list again;
  va_copy(again, ap);
  int n = vsnprintf(NULL, 0, fmt, ap);
  char *s = n < 0 ? NULL : malloc((size_t)n + 1);
  if (s && vsnprintf(s, (size_t)n + 1, fmt, again) != n) {
    free(s);
    s = NULL;
  }
  va_end(again);
  *out = s;
  return s ? n : -1;
}

int qk_asprintf(char **out, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = qk_vasprintf(out, fmt, ap);
  va_end(ap);
  return n;
}

int open_regular(const char *path, struct stat *st) {
  int fd;
  do /* O_NONBLOCK: opening a FIFO for reading waits for a writer, forever if none comes */
    fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  while (fd < 0 && errno == EINTR);
  if (fd < 0)
    return -1;
  int flags;
  if (fstat(fd, st) != 0 || (flags = fcntl(fd, F_GETFL)) < 0) {
    int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  if (!S_ISREG(st->st_mode)) {
    close(fd);
    return OPEN_NOT_REGULAR;
  }
  if (fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) { /* reads of a regular file never wait anyway */
    int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

const char *file_kind(unsigned mode) {
  return S_ISFIFO(mode)                   ? "a FIFO"
         : S_ISDIR(mode)                  ? "a directory"
         : S_ISCHR(mode) || S_ISBLK(mode) ? "a device"
         : S_ISSOCK(mode)                 ? "a socket"
         : S_ISREG(mode)                  ? "a regular file"
                                          : "of an unknown kind";
}
