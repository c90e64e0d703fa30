/*
 * test_backend.c: one source, six test plugins (Makefile.am builds it once per
 * VARIANT_* into tests/plugins/.libs/backend-test-<variant>.so). Each variant
 * is a backend that is fine except for the one thing the loader must catch:
 *
 *   GOOD      loads; probe finds its device; configure takes threads = N > 0
 *   NOSYM     exports no qkeep_backend_init
 *   MAJOR     reports ABI major + 1
 *   MINOR     needs ABI minor + 1 (a newer core)
 *   INITFAIL  init fails with its own detail through host->set_error
 *   NODEV     probe says its device is absent ("no test device")
 *
 * init allocates the table, so a loader that forgets fini on a failure path
 * shows up as a leak under valgrind and ASan.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "qkeep_backend.h"

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
#else
#error "define one VARIANT_* (see Makefile.am)"
#endif

struct test_backend {
  struct qkeep_backend be; /* first, so the core's pointer is ours */
  const struct qkeep_host *host;
  long threads;
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
  (void)be;
#if defined(VARIANT_NODEV)
  put_msg(msg, msg_len, "no test device");
  return QKEEP_E_NODEV;
#else
  put_msg(msg, msg_len, "test device ready");
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
  return strcmp(scheme, "unquantized") == 0 && kind == QKEEP_LAYER_LINEAR;
}

/* Leaves params as loaded: the loader tests need no conversion. */
static int test_pwal(const struct qkeep_backend *be, qkeep_layer *layer) {
  (void)be;
  (void)layer;
  return 0;
}

static void test_fini(const struct qkeep_backend *be) { free((void *)(uintptr_t)be); }
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
  struct test_backend *tb = calloc(1, sizeof *tb);
  if (!tb)
    return host->set_error(QKEEP_E_NOMEM, TEST_NAME ": out of memory");
  tb->host = host;
  tb->threads = 1;
  tb->be = (struct qkeep_backend) {
    .size = sizeof(struct qkeep_backend), .abi_major = QKEEP_BACKEND_ABI_MAJOR,
    .abi_minor = QKEEP_BACKEND_ABI_MINOR, .name = TEST_NAME,
    .description = "loader test plugin (" TEST_NAME ")", .probe = test_probe,
#if defined(VARIANT_GOOD)
    .configure = test_configure,
#endif
    .supports = test_supports, .pwal = test_pwal, .fini = test_fini,
  };
#if defined(VARIANT_MAJOR)
  tb->be.abi_major = QKEEP_BACKEND_ABI_MAJOR + 1;
#elif defined(VARIANT_MINOR)
  tb->be.abi_minor = QKEEP_BACKEND_ABI_MINOR + 1;
#endif
  *out = &tb->be;
  return 0;
#endif
}
