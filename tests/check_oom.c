/*
 * check_oom.c: every allocation of census, run and reload, failed in turn.
 *
 * failmalloc.c replaces the process's allocator. Each body (census: load + census + digest;
 * run: load the model and a reference model + the forward check; reload: W0 -> W1 in place) is
 * run once to count its allocation calls T, then again for N = 1..T with the N-th call failing.
 * Every run must end in one of two ways:
 *   - success with the result of the unfailed run (digest, forward-check errors): a failure that
 *     the code absorbed is fine only when nothing changed;
 *   - QKEEP_E_NOMEM with a message, the model empty (a failed load) or, for reload, its digest
 *     that of W0 (nothing half-changed);
 * and every block allocated during it is freed (fm_live() as before; LeakSanitizer and valgrind
 * check the same at exit). Every N on the reference backend (its online loads and reloads too, which
 * quantize on a pool of threads) and on the chain test-async,
 * reference (a device whose memory and pinned staging the plugin allocates, so device allocations
 * fail too; census and reload); cpu-onednn (threads = 1) a stride of N (QKEEP_OOM_STRIDE, default T / 150),
 * with oneDNN's own allocations left alone (see allocations_fail_cleanly_on_cpu_onednn). To rerun one case:
 * QKEEP_OOM_BACKEND=reference|test-async|cpu-onednn QKEEP_OOM_BODY=census|run| reload QKEEP_OOM_FIRST=N
 * QKEEP_OOM_STRIDE=10000000 CK_FORK=no, with FAILMALLOC_TRACE=1 for the failing call's stack.
 */
#include <check.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkutil.h"
#include "failmalloc.h"
#include "qkeep/qkeep.h"
#include "testutil.h"

static char *w0, *w1;

static void setup(void) {
  w0 = tu_path(tu_builddir(), "examples/tiny-w8a8-int8");
  w1 = tu_path(tu_builddir(), "examples/tiny-w1-w8a8-int8");
  ck_assert(w0 && w1);
}

static void teardown(void) {
  free(w0);
  free(w1);
}

/* What one run of a body produced, to compare with the unfailed run. */
struct outcome {
  int rc;
  char msg[512];
  struct qkeep_digest digest;
  double max_abs; /* run: the sum of every layer's largest difference */
  int layers;     /* run: layers checked */
  bool model_empty_after_failure;
};

struct body {
  const char *name;
  void (*fn)(struct body *b, struct outcome *o, bool armed, long n);
  qkeep_plugin *chain[2], *reference; /* the model's chain (n_chain links) and the reference */
  size_t n_chain;
  const char *w0, *w1;
  /* reload: the model, loaded with W0 outside the failing region, and its digest */
  struct qkeep_digest w0_digest;
  const struct qkeep_quantize_options *online; /* (NULL: none) the model quantizes on load */
};

static int new_model(const struct body *b, qkeep_model **m) {
  int rc = qkeep_model_new_chain(b->chain, b->n_chain, m);
  if (!rc && b->online && (rc = qkeep_model_set_quantize(*m, b->online)) != 0) {
    qkeep_model_free(*m);
    *m = NULL;
  }
  return rc;
}

static void record_error(struct outcome *o, int rc) {
  o->rc = rc;
  snprintf(o->msg, sizeof o->msg, "%s", qkeep_errmsg());
}

/* Load + census + digest. A failed load must leave the model empty. */
static void census_body(struct body *b, struct outcome *o, bool armed, long n) {
  qkeep_model *m = NULL;
  if (armed)
    fm_arm(n);
  int rc = new_model(b, &m);
  if (!rc && (rc = qkeep_model_load(m, b->w0)))
    o->model_empty_after_failure = qkeep_model_layer_count(m) == 0;
  struct qkeep_census c = {.size = sizeof c};
  if (!rc)
    rc = qkeep_census(m, &c);
  if (!rc)
    rc = qkeep_digest(m, &o->digest);
  if (armed)
    fm_disarm();
  record_error(o, rc);
  qkeep_model_free(m);
}

static int sum_errors(void *user, const struct qkeep_layer_error *e) {
  struct outcome *o = user;
  o->max_abs += e->max_abs;
  o->layers++;
  return 0;
}

/* Two loads (the model on the backend under test, the reference) + the forward check. */
static void run_body(struct body *b, struct outcome *o, bool armed, long n) {
  qkeep_model *m = NULL, *r = NULL;
  if (armed)
    fm_arm(n);
  int rc = new_model(b, &m);
  if (!rc)
    rc = qkeep_model_new(b->reference, &r);
  if (!rc && (rc = qkeep_model_load(m, b->w0)))
    o->model_empty_after_failure = qkeep_model_layer_count(m) == 0;
  if (!rc && (rc = qkeep_model_load(r, b->w0)))
    o->model_empty_after_failure = qkeep_model_layer_count(r) == 0;
  if (!rc)
    rc = qkeep_compare(m, r, 4, 7, sum_errors, o);
  if (armed)
    fm_disarm();
  record_error(o, rc);
  qkeep_model_free(m);
  qkeep_model_free(r);
}

/* W0 loaded (not failing), then the reload to W1 under the failure. */
static void reload_body(struct body *b, struct outcome *o, bool armed, long n) {
  qkeep_model *m;
  ck_assert_int_eq(new_model(b, &m), 0);
  ck_assert_msg(qkeep_model_load(m, b->w0) == 0, "%s", qkeep_errmsg());
  if (armed)
    fm_arm(n);
  int rc = qkeep_model_reload(m, b->w1, 0);
  if (armed)
    fm_disarm();
  record_error(o, rc);
  ck_assert_msg(qkeep_digest(m, &o->digest) == 0, "%s", qkeep_errmsg());
  qkeep_model_free(m);
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* An FNV-1a hash of every file of dir (names and bytes, in name order) into *d. */
static void hash_dir(const char *dir, struct qkeep_digest *d) {
  DIR *h = opendir(dir);
  ck_assert_ptr_nonnull(h);
  char *names[64];
  size_t n = 0;
  for (struct dirent *e; (e = readdir(h)) != NULL;)
    if (e->d_name[0] != '.') {
      ck_assert_uint_lt(n, 64);
      names[n++] = strdup(e->d_name);
    }
  closedir(h);
  qsort(names, n, sizeof *names, by_name);
  uint64_t x = 1469598103934665603ULL;
  for (size_t i = 0; i < n; i++) {
    char *path = tu_path(dir, names[i]);
    size_t len = 0;
    unsigned char *bytes = tu_read_file(path, &len);
    ck_assert_ptr_nonnull(bytes);
    for (const char *c = names[i]; *c; c++)
      x = (x ^ (unsigned char)*c) * 1099511628211ULL;
    for (size_t k = 0; k < len; k++)
      x = (x ^ bytes[k]) * 1099511628211ULL;
    free(bytes), free(path), free(names[i]);
  }
  d->hi = x, d->lo = n;
}

/* The process's open file descriptors. */
static int open_fds(void) {
  DIR *h = opendir("/proc/self/fd");
  ck_assert_ptr_nonnull(h);
  int n = 0;
  while (readdir(h))
    n++;
  closedir(h);
  return n;
}

/* qkeep quantize of W0 (unquantized) into a new directory, sharded (the index too) with kv-cache scales:
 * a success writes the unfailed run's bytes (config files included), a failure leaves no directory, and
 * either way every file descriptor it opened is closed and no other one (the process's) is. */
static void quantize_body(struct body *b, struct outcome *o, bool armed, long n) {
  char *dir = tu_tmpdir("oom-quantize"), *out = tu_path(dir, "out");
  int fds = open_fds();
  struct qkeep_quantize_options q = {.size = sizeof q,
                                     .scheme = "w8a8-int8",
                                     .kv_cache_scales = true,
                                     .max_shard_bytes = 20000, /* several shards */
                                     .threads = 2};
  if (armed)
    fm_arm(n);
  int rc = qkeep_quantize(b->w0, out, &q);
  if (armed)
    fm_disarm();
  record_error(o, rc);
  ck_assert_msg(open_fds() == fds,
                "quantize, allocation %ld failed: %d file descriptors open, %d before (%s)", n, open_fds(),
                fds, o->msg);
  if (!rc)
    hash_dir(out, &o->digest);
  else
    o->model_empty_after_failure = access(out, F_OK) != 0;
  tu_rmtree(dir);
  free(out), free(dir);
}

/* Runs the body for N = 1, 1 + stride, ... up to its call count; returns how many N it ran. */
static long fail_each(struct body *b, long stride) {
  const char *only = getenv("QKEEP_OOM_BODY"); /* census, run or reload: one body alone */
  if (only && *only && strcmp(only, b->name) != 0)
    return 0;
  struct outcome good = {0}, o;
  b->fn(b, &good, false, 0); /* warm-up: one-time allocations (caches, thread pools) happen here */
  ck_assert_msg(good.rc == 0, "%s: the unfailed run failed: %s", b->name, good.msg);
  long before = fm_live();
  good = (struct outcome){0};
  b->fn(b, &good, true, 0x7fffffffffffffffL); /* armed past the end: counts the calls */
  long total = fm_disarm();
  ck_assert_int_eq(fm_live(), before);
  ck_assert_int_gt(total, 0);
  if (stride <= 0)
    stride = total / 150 > 0 ? total / 150 : 1;
  long runs = 0, nomem = 0, absorbed = 0;
  const char *first = getenv("QKEEP_OOM_FIRST"); /* to rerun one case: with FAILMALLOC_TRACE=1 */
  for (long n = first && *first ? strtol(first, NULL, 10) : 1; n <= total; n += stride, runs++) {
    o = (struct outcome){0};
    b->fn(b, &o, true, n);
    ck_assert_msg(fm_live() == before, "%s, allocation %ld of %ld failed: %ld blocks leaked (rc %d: %s)",
                  b->name, n, total, fm_live() - before, o.rc, o.msg);
    if (o.rc == 0) {
      /* the failure was absorbed (or the call count shifted past it): the result must be the same */
      ck_assert_msg(memcmp(&o.digest, &good.digest, sizeof o.digest) == 0 || b->fn == run_body,
                    "%s, allocation %ld failed: success with another digest", b->name, n);
      ck_assert_msg(o.layers == good.layers && o.max_abs == good.max_abs,
                    "%s, allocation %ld failed: success with other forward-check results", b->name, n);
      absorbed++;
      continue;
    }
    nomem++;
    ck_assert_msg(o.rc == QKEEP_E_NOMEM,
                  "%s, allocation %ld of %ld failed: %d (%s), expected QKEEP_E_NOMEM: %s", b->name, n, total,
                  o.rc, qkeep_strerror(o.rc), o.msg);
    ck_assert_msg(o.msg[0] != '\0', "%s, allocation %ld failed: no message", b->name, n);
    if (b->fn == reload_body)
      ck_assert_msg(memcmp(&o.digest, &b->w0_digest, sizeof o.digest) == 0,
                    "%s, allocation %ld failed: the model is not W0 any more (%s)", b->name, n, o.msg);
    else
      ck_assert_msg(o.model_empty_after_failure || strstr(o.msg, "forward check") ||
                        strstr(o.msg, "qkeep_model_new") || !strstr(o.msg, "load"),
                    "%s, allocation %ld failed: the failed load left layers behind", b->name, n);
  }
  printf("%s: %ld allocation calls, %ld runs (stride %ld): %ld QKEEP_E_NOMEM, %ld absorbed\n", b->name, total,
         runs, stride, nomem, absorbed);
  return runs;
}

static long stride_from_env(long fallback) {
  const char *s = getenv("QKEEP_OOM_STRIDE");
  return s && *s ? strtol(s, NULL, 10) : fallback;
}

/*
 * The tiny bf16 model with its widths divided by 4 (make_tiny's DIVISOR) in dir/w<seed>: the same
 * tensors and units as examples/tiny, at a sixteenth of the quantisation work, for the bodies that
 * quantize (the online loads and reloads, qkeep_quantize), which run thousands of times.
 */
static char *make_micro(const char *dir, int seed) {
  char name[16];
  snprintf(name, sizeof name, "w%d", seed);
  char *model = tu_path(dir, name), *file = tu_path(model, "model.safetensors"),
       *make_tiny = tu_path(tu_builddir(), "tests/make_tiny");
  ck_assert_int_eq(mkdir(model, 0755), 0);
  size_t n = strlen(make_tiny) + strlen(file) + 32;
  char *cmd = malloc(n);
  ck_assert_ptr_nonnull(cmd);
  snprintf(cmd, n, "'%s' '%s' %d bf16 4", make_tiny, file, seed);
  ck_assert_msg(system(cmd) == 0, "%s failed", cmd);
  free(cmd), free(file), free(make_tiny);
  return model;
}

/* The three bodies on the chain `backend` (then the reference when chained). */
static void run_all(const char *backend, bool chained, long stride) {
  const char *only = getenv("QKEEP_OOM_BACKEND"); /* one chain alone (named by its first link) */
  if (only && *only && strcmp(only, backend) != 0)
    return;
  qkeep_plugin *plugin, *reference;
  ck_assert_msg(qkeep_plugin_open(backend, NULL, &plugin) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(qkeep_plugin_open("reference", NULL, &reference), 0);
  if (strcmp(backend, "cpu-onednn") == 0) {
    char *dir = tu_tmpdir("oom"), *ini = tu_path(dir, "oom.ini");
    const char *text = "[qkeep]\nbackend = cpu-onednn\n[backend.cpu-onednn]\nthreads = 1\n";
    ck_assert_int_eq(tu_write_file(ini, text, strlen(text)), 0);
    qkeep_config *cfg;
    ck_assert_int_eq(qkeep_config_load(ini, &cfg), 0);
    ck_assert_msg(qkeep_plugin_configure(plugin, cfg) == 0, "%s", qkeep_errmsg());
    qkeep_config_free(cfg);
    tu_rmtree(dir);
    free(ini);
    free(dir);
  }
  struct body b = {
      .chain = {plugin, reference}, .n_chain = chained ? 2 : 1, .reference = reference, .w0 = w0, .w1 = w1};
  qkeep_model *m;
  ck_assert_int_eq(new_model(&b, &m), 0);
  ck_assert_msg(qkeep_model_load(m, w0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(qkeep_digest(m, &b.w0_digest), 0);
  qkeep_model_free(m);
  b.name = "census", b.fn = census_body;
  fail_each(&b, stride);
  b.name = "run", b.fn = run_body;
  if (strcmp(backend, "test-async") != 0) /* its kernel is f32/bf16 only, and it owns every layer */
    fail_each(&b, stride);
  b.name = "reload", b.fn = reload_body;
  fail_each(&b, stride);
  if (strcmp(backend, "reference") == 0) {
    /* NVFP4's fused shards merge their global and input scales into new result tensors (a
     * failure there freed an unset pointer); w8a8 with dynamic activations has none to merge. */
    char *nvfp4 = tu_path(tu_builddir(), "examples/tiny-modelopt-nvfp4");
    b.name = "census-nvfp4", b.fn = census_body, b.w0 = nvfp4;
    fail_each(&b, stride);
    free(nvfp4);
    /* Online quantization: the load's pool of threads and its two units in flight (the next one read
     * and quantizing while one lands), on a load and a reload; NVFP4 for a unit of several members and
     * two stages. Two threads, so that a pool thread runs whatever the machine has. */
    char *micro_dir = tu_tmpdir("oom-micro"), *tiny = make_micro(micro_dir, 1),
         *tiny_w1 = make_micro(micro_dir, 2);
    static const char *const online[][3] = {{"w8a8-int8", "census-online-w8a8", "reload-online-w8a8"},
                                            {"modelopt-nvfp4", "census-online-nvfp4", "reload-online-nvfp4"}};
    for (int s = 0; s < 2; s++) {
      struct qkeep_quantize_options q = {.size = sizeof q, .scheme = online[s][0], .threads = 2};
      b.online = &q, b.w0 = tiny, b.w1 = tiny_w1;
      ck_assert_int_eq(new_model(&b, &m), 0);
      ck_assert_msg(qkeep_model_load(m, tiny) == 0, "%s", qkeep_errmsg());
      ck_assert_int_eq(qkeep_digest(m, &b.w0_digest), 0);
      qkeep_model_free(m);
      b.name = online[s][1], b.fn = census_body;
      fail_each(&b, stride);
      b.name = online[s][2], b.fn = reload_body;
      fail_each(&b, stride);
    }
    b.online = NULL;
    b.name = "quantize", b.fn = quantize_body;
    fail_each(&b, stride);
    tu_rmtree(micro_dir);
    free(tiny), free(tiny_w1), free(micro_dir);
  }
  qkeep_plugin_close(plugin);
  qkeep_plugin_close(reference);
}

START_TEST(every_allocation_fails_cleanly_on_the_reference_backend) {
  run_all("reference", false, stride_from_env(1));
}
END_TEST

/* test-async keeps its "device" memory (and pinned staging) in host memory it allocates itself, so
 * its device allocations, those of the staging ring and its reader threads included, fail here like
 * the core's. It owns every layer (the reference is the chain's second link), and runs no int8
 * kernel: census and reload only. */
START_TEST(device_allocations_fail_cleanly_on_a_chain) { run_all("test-async", true, stride_from_env(1)); }
END_TEST

START_TEST(allocations_fail_cleanly_on_cpu_onednn) {
  qkeep_plugin *p;
  if (qkeep_plugin_open("cpu-onednn", NULL, &p) != 0)
    return; /* not built */
  qkeep_plugin_close(p);
  /* oneDNN's C API lets std::bad_alloc escape (terminate) and survives some failures with a
   * state that crashes later (docs/RELIABILITY.md, "oneDNN under allocation failure"): its own
   * allocations, and libgomp's, are not failed here; the plugin's and the core's are. */
  static const char *const third_party[] = {"libdnnl", "libstdc++", "libgomp", NULL};
  if (!getenv("QKEEP_OOM_NO_EXEMPT")) /* set, to see what oneDNN does (docs/RELIABILITY.md) */
    fm_exempt(third_party);
  run_all("cpu-onednn", false, stride_from_env(0));
  fm_exempt(NULL);
}
END_TEST

static Suite *oom_suite(void) {
  Suite *s = suite_create("oom");
  TCase *tc = tcase_create("oom");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 900);
  tcase_add_test(tc, every_allocation_fails_cleanly_on_the_reference_backend);
  tcase_add_test(tc, device_allocations_fail_cleanly_on_a_chain);
  tcase_add_test(tc, allocations_fail_cleanly_on_cpu_onednn);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  setenv("OMP_NUM_THREADS", "1", 1); /* before libgomp loads with the plugin: one allocation order */
  return tu_run_suite(oom_suite(), CK_NORMAL);
}
