/*
 * test_backend.c: one source, six test plugins (Makefile.am builds it once per
 * VARIANT_* into tests/plugins/.libs/backend-test-<variant>.so). Each variant
 * is a backend that is fine except for the one thing the loader must catch:
 *
 *   GOOD      loads; probe finds its device; configure takes threads = N > 0
 *   NOSYM     exports no qkeep_backend_init
 *   MAJOR     reports ABI major + 1; its table is static and its fini aborts: the core must
 *             never call into a table of another major
 *   MINOR     needs ABI minor + 1 (a newer core)
 *   INITFAIL  init fails with its own detail through host->set_error
 *   NODEV     probe says its device is absent ("no test device")
 *   SHORTMEM  its memory table stops before sync: the core must refuse it, not fall back to host
 *             memory (a GPU kernel would get host pointers)
 *   PICKY     a chain member (ABI 1.1 supports_layer): owns only the unquantized F32/BF16
 *             linear layers whose name contains its `take` key (every one when unset,
 *             none with take = -), refusing the rest with a reason; a real f32 kernel
 *   LEGACY    built against ABI 1.0: its table ends at fini, supports() says unquantized
 *             linear only, so the core gives it every other kind of layer; the same kernel
 *   ASYNC     every layer, LEGACY's kernel, on a device in host memory with ABI 1.2's pinned
 *             staging: copy_h2d_async only queues the copy, and the queue runs when sync (or
 *             any other memory op) is called, so a core that refills or frees a staging chunk
 *             before sync loads wrong bytes (caught by the digest) or aborts here; ABI 1.3's
 *             copy fences complete only the copies before the fence waited on, and a
 *             non-blocking wait says "not yet" every other time
 *
 * init allocates the table, so a loader that forgets fini on a failure path
 * shows up as a leak under valgrind and ASan.
 */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#if defined(__has_include)
#if __has_include(<valgrind/memcheck.h>)
#include <valgrind/memcheck.h>
#endif
#endif
#ifndef VALGRIND_MAKE_MEM_NOACCESS /* without valgrind's header: nothing to tell it */
#define VALGRIND_MAKE_MEM_NOACCESS(at, bytes) 0
#define VALGRIND_MAKE_MEM_DEFINED(at, bytes) 0
#endif

#include "async_queue.h"
/* The include name from before the public headers had a folder: still valid through
 * `pkg-config --cflags qkeep-backend` (CI builds test-legacy out of tree against an install). */
#include <qkeep_backend.h>
#include <qkeep_backend_util.h>

#if defined(VARIANT_GOOD)
#define TEST_NAME "test-good"
#elif defined(VARIANT_NOSYM)
#define TEST_NAME "test-nosym"
#elif defined(VARIANT_MAJOR)
#define TEST_NAME "test-major"
#elif defined(VARIANT_MINOR)
#define TEST_NAME "test-minor"
#elif defined(VARIANT_INITFAIL)
#define TEST_NAME "test-initfail"
#elif defined(VARIANT_NODEV)
#define TEST_NAME "test-nodev"
#elif defined(VARIANT_SHORTMEM)
#define TEST_NAME "test-shortmem"
#elif defined(VARIANT_PICKY)
#define TEST_NAME "test-picky"
#elif defined(VARIANT_LEGACY)
#define TEST_NAME "test-legacy"
#elif defined(VARIANT_ASYNC)
#define TEST_NAME "test-async"
#else
#error "define one VARIANT_* (see Makefile.am)"
#endif

struct test_backend {
  struct qkeep_backend be; /* first, so the core's pointer is ours */
  const struct qkeep_host *host;
  long threads;
  char take[128];           /* PICKY: the name part a layer must contain ("" takes all, "-" none) */
  struct async_queue queue; /* ASYNC: its device's copies (async_queue.h) */
};

#if !defined(VARIANT_INITFAIL) /* INITFAIL never builds a table */

/* Copies text into msg, truncated and always terminated. */
static void put_msg(char *msg, size_t msg_len, const char *text) {
  if (!msg_len)
    return;
  size_t n = strlen(text);
  if (n >= msg_len)
    n = msg_len - 1;
  memcpy(msg, text, n);
  msg[n] = '\0';
}

static int test_probe(const struct qkeep_backend *be, char *msg, size_t msg_len) {
#if defined(VARIANT_NODEV)
  (void)be;
  put_msg(msg, msg_len, "no test device");
  return QKEEP_E_NODEV;
#else
  /* The configured thread count shows here, so a test can see that configure took effect. */
  char text[64];
  snprintf(text, sizeof text, "test device ready (threads %ld)", ((const struct test_backend *)be)->threads);
  put_msg(msg, msg_len, text);
  return 0;
#endif
}

#if defined(VARIANT_GOOD)
static int test_configure(const struct qkeep_backend *be, const char *key, const char *value) {
  const struct qkeep_host *host = ((const struct test_backend *)be)->host;
  if (strcmp(key, "threads") != 0)
    return host->set_error(QKEEP_E_CONFIG, "unknown key '%s' (" TEST_NAME " takes threads)", key);
  char *end;
  errno = 0;
  long threads = strtol(value, &end, 10);
  if (errno || end == value || *end || threads <= 0)
    return host->set_error(QKEEP_E_CONFIG, "threads must be a positive integer, not '%s'", value);
  /* configure takes a const table; the instance behind it is ours to change. */
  ((struct test_backend *)(void *)(uintptr_t)be)->threads = threads;
  return 0;
}
#endif

static int test_supports(const struct qkeep_backend *be, const char *scheme, enum qkeep_layer_kind kind) {
  (void)be;
#if defined(VARIANT_ASYNC)
  (void)scheme, (void)kind;
  return 1; /* every layer, so quantized ones normalise in its memory too (its kernel runs f32/bf16 only) */
#else
  return strcmp(scheme, "unquantized") == 0 && kind == QKEEP_LAYER_LINEAR;
#endif
}

#if defined(VARIANT_PICKY) || defined(VARIANT_LEGACY) || defined(VARIANT_ASYNC)
#if defined(VARIANT_PICKY)
static int test_configure(const struct qkeep_backend *be, const char *key, const char *value) {
  struct test_backend *tb = (struct test_backend *)(void *)(uintptr_t)be;
  if (strcmp(key, "take") != 0)
    return 0; /* the core checked the others against picky_keys */
  if (strlen(value) >= sizeof tb->take)
    return tb->host->set_error(QKEEP_E_CONFIG, "take: value too long");
  strcpy(tb->take, value);
  return 0;
}

/* take steers the chain tests; level, mode and strict exist to test the core's type checks. */
static const struct qkeep_backend_key picky_keys[] = {
    {"take", QKEEP_KEY_STRING, NULL, "(every layer)",
     "take the unquantized linear layers whose name holds this"},
    {"level", QKEEP_KEY_INT, "1..8", "1", "an integer key"},
    {"mode", QKEEP_KEY_ENUM, "fast|exact", "exact", "an enumerated key"},
    {"strict", QKEEP_KEY_BOOL, NULL, "false", "a boolean key"},
};

static int test_supports_layer(const struct qkeep_backend *be, const struct qkeep_layer_info *info,
                               char *reason, size_t reason_len) {
  const struct test_backend *tb = (const struct test_backend *)be;
  if (!test_supports(be, info->scheme, info->kind)) {
    snprintf(reason, reason_len, "takes unquantized linear layers only, not %s", info->scheme);
    return 0;
  }
  if (info->weight_dtype != QKEEP_DTYPE_F32 && info->weight_dtype != QKEEP_DTYPE_BF16) {
    snprintf(reason, reason_len, "weight dtype %d is neither F32 nor BF16", info->weight_dtype);
    return 0;
  }
  if (strcmp(tb->take, "-") == 0 || (tb->take[0] && !strstr(info->name, tb->take))) {
    snprintf(reason, reason_len, "take = %s does not name it", tb->take);
    return 0;
  }
  return 1;
}
#endif

/* One weight element as f32 (F32 or BF16, all this kernel is given). */
static float weight_at(const struct qkeep_view *w, size_t i) {
  if (w->spec.dtype == QKEEP_DTYPE_F32)
    return ((const float *)w->data)[i];
  uint32_t bits = (uint32_t)((const uint16_t *)w->data)[i] << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* y = x W^T (+ bias) in f32, reading the weight as loaded (PWAL leaves it). */
static int test_apply(const struct qkeep_backend *be, qkeep_layer *layer, const struct qkeep_apply_args *a) {
  const struct qkeep_host *host = ((const struct test_backend *)be)->host;
  struct qkeep_layer_info info = {.size = sizeof info};
  struct qkeep_view w = {.size = sizeof w}, b = {.size = sizeof b};
  int rc = host->layer_info(layer, &info);
  if (!rc)
    rc = host->get_live(layer, "weight", &w);
  if (rc || info.kind != QKEEP_LAYER_LINEAR || a->x_dtype != QKEEP_DTYPE_F32 ||
      a->y_dtype != QKEEP_DTYPE_F32 || (w.spec.dtype != QKEEP_DTYPE_F32 && w.spec.dtype != QKEEP_DTYPE_BF16))
    return host->set_error(QKEEP_E_UNSUPPORTED, TEST_NAME ": %s: not an f32/bf16 linear layer", info.name);
  bool bias = host->get_live(layer, "bias", &b) == 0;
  const float *x = a->x;
  float *y = a->y;
  for (int64_t m = 0; m < a->m; m++)
    for (int64_t n = 0; n < info.n; n++) {
      float acc = bias ? weight_at(&b, (size_t)n) : 0.0f;
      for (int64_t k = 0; k < info.k; k++)
        acc += x[m * info.k + k] * weight_at(&w, (size_t)(n * info.k + k));
      y[m * info.n + n] = acc;
    }
  return 0;
}
#endif

#if defined(VARIANT_ASYNC)
static struct test_backend *async_of(const struct qkeep_backend *be) {
  return (struct test_backend *)(void *)(uintptr_t)be; /* the instance behind the const table is ours */
}

/* Completes every queued copy. */
static void async_flush(const struct qkeep_backend *be) { aq_flush(&async_of(be)->queue); }

/* The live allocations of the device (every instance's), so that a copy that spans two of them, which a
 * GPU refuses even when they lie side by side, stops the test (abort) as it fails there. */
static pthread_mutex_t allocs_mu = PTHREAD_MUTEX_INITIALIZER;
static struct alloc_range {
  const char *at;
  size_t bytes;
} * allocs;
static size_t n_allocs, cap_allocs;

/* Whether [dst, dst + n) lies inside one live allocation. */
static bool in_one_alloc(const void *dst, size_t n) {
  const char *d = dst;
  bool ok = false;
  pthread_mutex_lock(&allocs_mu);
  for (size_t i = 0; i < n_allocs && !ok; i++)
    ok = d >= allocs[i].at && n <= allocs[i].bytes && (size_t)(d - allocs[i].at) <= allocs[i].bytes - n;
  pthread_mutex_unlock(&allocs_mu);
  return ok;
}

/* Device memory comes from one arena, first fit, each allocation 256-byte aligned (as cudaMalloc's
 * are) right after the live one before it, so that two allocations often lie side by side, as they
 * do on a GPU; a freed allocation's pages go back to the system. allocs is kept in address order.
 * Under valgrind only the live allocations are addressable: a read or write past one is reported, and
 * memcheck's leak search, which scans every addressable byte for pointers, skips the rest of the
 * 4 GiB (scanning it whole held tens of GiB with transparent huge pages on). */
#define ARENA_BYTES ((size_t)4 << 30)
static char *arena;

/* Where a new allocation of `bytes` goes (its index in allocs and its offset), or false when none fits. */
static bool arena_fit(size_t bytes, size_t *index, size_t *offset) {
  if (!arena) {
    void *p =
        mmap(NULL, ARENA_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      return false;
    arena = p;
    (void)VALGRIND_MAKE_MEM_NOACCESS(arena, ARENA_BYTES);
  }
  size_t end = 0; /* of the live allocation before the gap looked at */
  for (size_t i = 0; i <= n_allocs; i++) {
    size_t at = (end + 255) & ~(size_t)255,
           limit = i < n_allocs ? (size_t)(allocs[i].at - arena) : ARENA_BYTES;
    if (at <= limit && bytes <= limit - at) {
      *index = i, *offset = at;
      return true;
    }
    if (i < n_allocs)
      end = (size_t)(allocs[i].at - arena) + allocs[i].bytes;
  }
  return false;
}

/* Every op below runs after the queued copies, as on one stream. */
static int async_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  async_flush(be);
  bytes = bytes ? bytes : 1;
  size_t index, offset;
  pthread_mutex_lock(&allocs_mu);
  if (n_allocs == cap_allocs) {
    size_t want = cap_allocs ? 2 * cap_allocs : 64;
    struct alloc_range *more = realloc(allocs, want * sizeof *more);
    if (!more) {
      pthread_mutex_unlock(&allocs_mu);
      return QKEEP_E_NOMEM;
    }
    allocs = more, cap_allocs = want;
  }
  if (!arena_fit(bytes, &index, &offset)) {
    pthread_mutex_unlock(&allocs_mu);
    return QKEEP_E_NOMEM;
  }
  memmove(&allocs[index + 1], &allocs[index], (n_allocs - index) * sizeof *allocs);
  allocs[index] = (struct alloc_range){arena + offset, bytes};
  n_allocs++;
  pthread_mutex_unlock(&allocs_mu);
  /* Like cudaMalloc's, a new allocation's bytes are whatever they are, never promised zero: 0xa5 here, so
   * that a byte a load or a transform leaves unwritten shows in the digests the tests compare, and under
   * valgrind undefined, so that reading one is reported where it happens. */
  *out = arena + offset;
  (void)VALGRIND_MAKE_MEM_DEFINED(*out, bytes);
  memset(*out, 0xa5, bytes);
  (void)VALGRIND_MAKE_MEM_UNDEFINED(*out, bytes);
  return 0;
}
static void async_free(const struct qkeep_backend *be, void *ptr) {
  async_flush(be);
  pthread_mutex_lock(&allocs_mu);
  for (size_t i = 0; i < n_allocs; i++)
    if (allocs[i].at == ptr) {
      uintptr_t start = (uintptr_t)ptr, stop = start + allocs[i].bytes;
      uintptr_t lo = (start + 4095) & ~(uintptr_t)4095, hi = stop & ~(uintptr_t)4095;
      /* Cleared, so that an allocation is zero: a small range in place (its pages stay, and a load
       * that frees and allocates the same bytes thousands of times, as check_oom's do, takes no page
       * fault: they were half of check_oom's time); a large one's whole pages back to the system
       * (zero when touched again), its edges cleared. */
      if (hi > lo && allocs[i].bytes >= ((size_t)64 << 20)) {
        memset(ptr, 0, lo - start);
        memset((void *)hi, 0, stop - hi);
        (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
      } else {
        memset(ptr, 0, allocs[i].bytes);
      }
      (void)VALGRIND_MAKE_MEM_NOACCESS(ptr, allocs[i].bytes);
      memmove(&allocs[i], &allocs[i + 1], (n_allocs - i - 1) * sizeof *allocs);
      n_allocs--;
      break;
    }
  if (!n_allocs)
    free(allocs), allocs = NULL, cap_allocs = 0;
  pthread_mutex_unlock(&allocs_mu);
}
static int async_copy(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  async_flush(be);
  memmove(dst, src, n);
  return 0;
}
/* ABI 1.5: the ranges in order, after the queued copies, as one call. */
static int async_copy_batch(const struct qkeep_backend *be, const struct qkeep_copy_range *ranges, size_t n) {
  async_flush(be);
  for (size_t i = 0; i < n; i++)
    memmove(ranges[i].dst, ranges[i].src, ranges[i].bytes);
  return 0;
}
/* ABI 1.6: the ranges' values against their rules, after the queued copies (as a device kernel would). */
static int async_find_bad_values(const struct qkeep_backend *be, const struct qkeep_value_range *ranges,
                                 size_t n, size_t *first) {
  async_flush(be);
  for (size_t i = 0; i < n; i++) {
    const unsigned char *p = ranges[i].at;
    size_t size = qkeep_be_value_size(ranges[i].rule);
    if (!size || ranges[i].bytes % size)
      return async_of(be)->host->set_error(QKEEP_E_INVAL, "test-async: find_bad_values: rule %d, %zu bytes",
                                           ranges[i].rule, ranges[i].bytes);
    for (size_t j = 0; j < ranges[i].bytes; j += size)
      if (qkeep_be_bad_value(p + j, ranges[i].rule)) {
        *first = i;
        return 0;
      }
  }
  *first = n;
  return 0;
}
static int async_fill(const struct qkeep_backend *be, void *dst, int byte, size_t n) {
  async_flush(be);
  memset(dst, byte, n);
  return 0;
}
static int async_sync(const struct qkeep_backend *be) {
  async_flush(be);
  return 0;
}
/* "Pinned" memory: its size sits in the 64 bytes before the pointer handed out. */
static int async_host_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  (void)be;
  char *p = malloc(64 + bytes);
  if (!p)
    return QKEEP_E_NOMEM;
  memcpy(p, &bytes, sizeof bytes);
  *out = p + 64;
  return 0;
}
/* Freeing staging that a queued copy still reads is the core's bug: stop here. */
static void async_host_free(const struct qkeep_backend *be, void *ptr) {
  struct test_backend *tb = async_of(be);
  char *base = (char *)ptr - 64;
  size_t bytes;
  memcpy(&bytes, base, sizeof bytes);
  if (aq_reads(&tb->queue, ptr, bytes))
    abort();
  free(base);
}
static int async_h2d(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  if (!in_one_alloc(dst, n))
    abort(); /* a copy across two allocations: a GPU refuses it */
  return aq_push(&async_of(be)->queue, dst, src, n) ? 0 : QKEEP_E_NOMEM;
}

/* ABI 1.3: a fence remembers how many copies were started before it. */
static int async_fence(const struct qkeep_backend *be, uint64_t *fence) {
  return aq_fence(&async_of(be)->queue, fence) ? 0 : QKEEP_E_NOMEM;
}

/* Completes the copies before the fence only (later ones stay queued, so a core that refills a piece
 * whose fence it did not wait for loads wrong bytes); a non-blocking ask says "not yet" every other
 * time without completing anything, as a busy device would. */
static int async_fence_wait(const struct qkeep_backend *be, uint64_t fence, int block) {
  struct test_backend *tb = async_of(be);
  if (fence >= tb->queue.fences)
    return tb->host->set_error(QKEEP_E_INVAL, "test-async: fence %llu was never recorded",
                               (unsigned long long)fence);
  return aq_fence_wait(&tb->queue, fence, block);
}

static const struct qkeep_memory_ops async_ops = {
    .size = sizeof(struct qkeep_memory_ops),
    .alloc = async_alloc,
    .free = async_free,
    .copy_h2d = async_copy,
    .copy_d2h = async_copy,
    .copy_d2d = async_copy,
    .fill = async_fill,
    .sync = async_sync,
    .host_alloc = async_host_alloc,
    .host_free = async_host_free,
    .copy_h2d_async = async_h2d,
    .copy_fence = async_fence,
    .copy_fence_wait = async_fence_wait,
    .copy_d2d_batch = async_copy_batch,
    .find_bad_values = async_find_bad_values,
};
#endif

/* Leaves params as loaded: the loader tests need no conversion. */
static int test_pwal(const struct qkeep_backend *be, qkeep_layer *layer) {
  (void)be;
  (void)layer;
  return 0;
}

#if defined(VARIANT_MAJOR)
static void test_fini(const struct qkeep_backend *be) {
  (void)be;
  abort(); /* a core that calls this read a slot of a table whose layout it does not know */
}
#else
static void test_fini(const struct qkeep_backend *be) {
  struct test_backend *tb = (struct test_backend *)(void *)(uintptr_t)be;
  aq_free(&tb->queue);
  free(tb);
}
#endif
#endif

#if defined(VARIANT_NOSYM)
#define INIT_FUNCTION qkeep_backend_init_missing /* close, but not the name the loader looks up */
#else
#define INIT_FUNCTION qkeep_backend_init
#endif

QKEEP_BACKEND_EXPORT int INIT_FUNCTION(const struct qkeep_host *host, const struct qkeep_backend **out);

QKEEP_BACKEND_EXPORT int INIT_FUNCTION(const struct qkeep_host *host, const struct qkeep_backend **out) {
  if (!host || host->size < sizeof *host || host->abi_major != QKEEP_BACKEND_ABI_MAJOR)
    return QKEEP_E_ABI;
#if defined(VARIANT_INITFAIL)
  (void)out;
  return host->set_error(QKEEP_E_PLUGIN, "test-initfail: simulated init failure");
#else
#if defined(VARIANT_MAJOR)
  static struct test_backend table; /* nothing to free: the core must not call fini */
  struct test_backend *tb = &table;
#else
  struct test_backend *tb = calloc(1, sizeof *tb);
#endif
  if (!tb)
    return host->set_error(QKEEP_E_NOMEM, TEST_NAME ": out of memory");
  tb->host = host;
  tb->threads = 1;
  tb->be = (struct qkeep_backend) {
    .size = sizeof(struct qkeep_backend), .abi_major = QKEEP_BACKEND_ABI_MAJOR,
    .abi_minor = QKEEP_BACKEND_ABI_MINOR, .name = TEST_NAME,
    .description = "loader test plugin (" TEST_NAME ")", .probe = test_probe,
#if defined(VARIANT_GOOD) || defined(VARIANT_PICKY)
    .configure = test_configure,
#endif
#if defined(VARIANT_PICKY) || defined(VARIANT_LEGACY) || defined(VARIANT_ASYNC)
    .apply = test_apply,
#endif
#if defined(VARIANT_PICKY)
    .supports_layer = test_supports_layer, .keys = picky_keys,
    .n_keys = sizeof picky_keys / sizeof picky_keys[0], .key_size = sizeof picky_keys[0],
#endif
    .supports = test_supports, .pwal = test_pwal, .fini = test_fini,
  };
#if defined(VARIANT_SHORTMEM)
  static const struct qkeep_memory_ops short_ops = {.size = offsetof(struct qkeep_memory_ops, sync)};
  tb->be.memory = &short_ops;
#endif
#if defined(VARIANT_ASYNC)
  tb->be.memory = &async_ops;
  tb->be.abi_minor = 2;
#endif
#if defined(VARIANT_LEGACY)
  /* What a plugin compiled against ABI 1.0 hands over: a table that ends at fini. */
  tb->be.size = offsetof(struct qkeep_backend, fini) + sizeof tb->be.fini;
  tb->be.abi_minor = 0;
#endif
#if defined(VARIANT_MAJOR)
  tb->be.abi_major = QKEEP_BACKEND_ABI_MAJOR + 1;
#elif defined(VARIANT_MINOR)
  tb->be.abi_minor = QKEEP_BACKEND_ABI_MINOR + 1;
#endif
  *out = &tb->be;
  return 0;
#endif
}
