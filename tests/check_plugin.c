/*
 * check_plugin.c: the plugin loader (libqkeep/plugin/plugin.c) against the test plugins
 * of tests/plugins/test_backend.c, found through $QKEEP_PLUGIN_PATH (set by
 * make check).
 */
#include <check.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkutil.h"
#include "private.h"
#include "testutil.h"

static char *tmpdir;

static void setup(void) {
  tmpdir = tu_tmpdir("plugin");
  ck_assert_ptr_nonnull(tmpdir);
}

static void teardown(void) {
  tu_rmtree(tmpdir);
  free(tmpdir);
  tmpdir = NULL;
}

static char core_abi[32], plugin_abi_major[32], plugin_abi_minor[32];

static void abi_strings(void) {
  snprintf(core_abi, sizeof core_abi, "core ABI %d.%d", QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR);
  snprintf(plugin_abi_major, sizeof plugin_abi_major, "plugin ABI %d.%d", QKEEP_BACKEND_ABI_MAJOR + 1,
           QKEEP_BACKEND_ABI_MINOR);
  snprintf(plugin_abi_minor, sizeof plugin_abi_minor, "plugin ABI %d.%d", QKEEP_BACKEND_ABI_MAJOR,
           QKEEP_BACKEND_ABI_MINOR + 1);
}

#define ASSERT_HAS(msg, part)                                                                                \
  ck_assert_msg(strstr((msg), (part)) != NULL, "'%s' should contain '%s'", (msg), (part))

/* The file backend-NAME.so in the first $QKEEP_PLUGIN_PATH directory that has it; malloc'd. */
static char *test_plugin_file(const char *name) {
  const char *env = getenv("QKEEP_PLUGIN_PATH");
  ck_assert_msg(env != NULL, "QKEEP_PLUGIN_PATH must name the test plugins' directory");
  char *dirs = strdup(env), *save = NULL, file[256];
  snprintf(file, sizeof file, "backend-%s.so", name);
  for (char *dir = strtok_r(dirs, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
    char *path = tu_path(dir, file);
    struct stat sb;
    if (stat(path, &sb) == 0) {
      free(dirs);
      return path;
    }
    free(path);
  }
  free(dirs);
  ck_abort_msg("%s not found in QKEEP_PLUGIN_PATH=%s", file, env);
  return NULL;
}

/* Copies test plugin `name` to tmpdir as backend-AS.so; returns the new path. */
static char *copy_plugin(const char *name, const char *as) {
  char *src = test_plugin_file(name), file[256];
  snprintf(file, sizeof file, "backend-%s.so", as);
  char *dst = tu_path(tmpdir, file);
  size_t n;
  void *bytes = tu_read_file(src, &n);
  ck_assert_ptr_nonnull(bytes);
  ck_assert_int_eq(tu_write_file(dst, bytes, n), 0);
  free(bytes);
  free(src);
  return dst;
}

/* Opens `name`, which must fail with code; returns a copy of the error detail. */
static char *open_fails(const char *name, const char *plugin_dir, int code) {
  qkeep_plugin *p = (qkeep_plugin *)(uintptr_t)1;
  int rc = qkeep_plugin_open(name, plugin_dir, &p);
  ck_assert_msg(rc == code, "open %s: rc %d, expected %d (%s)", name, rc, code, qkeep_errmsg());
  ck_assert_ptr_null(p);
  return strdup(qkeep_errmsg());
}

START_TEST(test_good) {
  qkeep_plugin *p = NULL;
  ck_assert_msg(qkeep_plugin_open("test-good", NULL, &p) == 0, "%s", qkeep_errmsg());
  char *file = test_plugin_file("test-good");
  ck_assert_str_eq(qkeep_plugin_name(p), "test-good");
  ck_assert_str_eq(qkeep_plugin_path(p), file);
  const struct qkeep_backend *be = qkeep_plugin_backend(p);
  ck_assert_ptr_nonnull(be);
  ck_assert_str_eq(be->name, "test-good");
  ck_assert_uint_eq(be->abi_major, QKEEP_BACKEND_ABI_MAJOR);
  ck_assert_uint_ge(be->size, sizeof(struct qkeep_backend));
  ck_assert_ptr_nonnull(be->configure);

  char msg[64] = "junk";
  ck_assert_int_eq(qkeep_plugin_probe(p, msg, sizeof msg), 0);
  ck_assert_str_eq(msg, "test device ready (threads 1)");
  qkeep_plugin_close(p);
  qkeep_plugin_close(NULL);
  free(file);
}
END_TEST

START_TEST(test_open_path) {
  char *file = test_plugin_file("test-good");
  qkeep_plugin *p = NULL;
  ck_assert_msg(qkeep_plugin_open_path(file, &p) == 0, "%s", qkeep_errmsg());
  ck_assert_str_eq(qkeep_plugin_name(p), "test-good");
  ck_assert_str_eq(qkeep_plugin_path(p), file);
  qkeep_plugin_close(p);

  /* a success leaves the last failure's detail alone */
  free(open_fails("test-absent", NULL, QKEEP_E_NOTFOUND));
  char *before = strdup(qkeep_errmsg());
  ck_assert_msg(qkeep_plugin_open_path(file, &p) == 0, "%s", qkeep_errmsg());
  ck_assert_str_eq(qkeep_errmsg(), before);
  qkeep_plugin_close(p);
  free(before);

  /* open_path takes the backend under whatever file name it has */
  char *copy = copy_plugin("test-good", "renamed");
  ck_assert_msg(qkeep_plugin_open_path(copy, &p) == 0, "%s", qkeep_errmsg());
  ck_assert_str_eq(qkeep_plugin_name(p), "test-good");
  qkeep_plugin_close(p);
  free(copy);
  free(file);
}
END_TEST

/* Not found: the message lists every file tried, in search order. */
START_TEST(test_missing_file) {
  char *msg = open_fails("test-absent", tmpdir, QKEEP_E_NOTFOUND);
  char *dirs = strdup(getenv("QKEEP_PLUGIN_PATH")), *save = NULL; /* main() made sure it is set */
  const char *last = msg;
  for (char *dir = strtok_r(dirs, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
    char *path = tu_path(dir, "backend-test-absent.so");
    const char *at = strstr(last, path);
    ck_assert_msg(at != NULL, "'%s' should list '%s' after the previous directory", msg, path);
    last = at;
    free(path);
  }
  char *mine = tu_path(tmpdir, "backend-test-absent.so");
  char *installed = tu_path(qkeep_plugin_install_dir(), "backend-test-absent.so");
  ck_assert_ptr_nonnull(strstr(last, mine));
  ck_assert_ptr_nonnull(strstr(strstr(last, mine), installed));
  ASSERT_HAS(msg, "backend-test-absent.so not found");
  ASSERT_HAS(msg, core_abi);
  free(installed);
  free(mine);
  free(dirs);
  free(msg);
}
END_TEST

START_TEST(test_missing_symbol) {
  char *file = test_plugin_file("test-nosym");
  char *msg = open_fails("test-nosym", NULL, QKEEP_E_PLUGIN);
  ASSERT_HAS(msg, file);
  ASSERT_HAS(msg, QKEEP_BACKEND_INIT_SYMBOL);
  ASSERT_HAS(msg, "undefined symbol"); /* dlerror()'s words */
  ASSERT_HAS(msg, core_abi);
  free(msg);
  free(file);
}
END_TEST

START_TEST(test_not_a_library) {
  char *file = tu_path(tmpdir, "backend-junk.so");
  ck_assert_int_eq(tu_write_file(file, "not an ELF file\n", 16), 0);
  char *msg = open_fails("junk", tmpdir, QKEEP_E_PLUGIN);
  ASSERT_HAS(msg, file);
  ASSERT_HAS(msg, "cannot load plugin: ");
  ASSERT_HAS(msg, core_abi);
  /* dlerror() text follows; it names the file itself */
  const char *why = strstr(msg, "cannot load plugin: ") + strlen("cannot load plugin: ");
  ck_assert_msg(strncmp(why, file, strlen(file)) == 0, "dlerror text missing in '%s'", msg);
  free(msg);
  free(file);
}
END_TEST

START_TEST(test_abi_major) {
  char *file = test_plugin_file("test-major");
  char *msg = open_fails("test-major", NULL, QKEEP_E_ABI);
  ASSERT_HAS(msg, file);
  ASSERT_HAS(msg, core_abi);
  ASSERT_HAS(msg, plugin_abi_major);
  free(msg);
  free(file);
}
END_TEST

/* Code from a file or directory that someone else could write is never loaded. */
START_TEST(test_untrusted_plugin_refused) {
  char *src = test_plugin_file("test-good"), *sub = tu_path(tmpdir, "plugins");
  ck_assert_int_eq(mkdir(sub, 0755), 0);
  char *copy = tu_path(sub, "backend-test-good.so");
  size_t n;
  void *bytes = tu_read_file(src, &n);
  ck_assert_ptr_nonnull(bytes);
  ck_assert_int_eq(tu_write_file(copy, bytes, n), 0);
  free(bytes);
  qkeep_plugin *p = NULL;
  ck_assert_int_eq(chmod(copy, 0755), 0);
  ck_assert_msg(qkeep_plugin_open_path(copy, &p) == 0, "%s", qkeep_errmsg()); /* trusted: loads */
  qkeep_plugin_close(p);
  ck_assert_int_eq(chmod(copy, 0757), 0);
  ck_assert_int_eq(qkeep_plugin_open_path(copy, &p), QKEEP_E_PLUGIN);
  ASSERT_HAS(qkeep_errmsg(), copy);
  ASSERT_HAS(qkeep_errmsg(), "file");
  ASSERT_HAS(qkeep_errmsg(), "writable by others");
  ck_assert_int_eq(chmod(copy, 0775), 0);
  ck_assert_int_eq(qkeep_plugin_open_path(copy, &p), QKEEP_E_PLUGIN);
  ASSERT_HAS(qkeep_errmsg(), "writable by its group");
  ck_assert_int_eq(chmod(copy, 0755), 0);
  ck_assert_int_eq(chmod(sub, 0777), 0); /* the directory: the file could be swapped */
  ck_assert_int_eq(qkeep_plugin_open_path(copy, &p), QKEEP_E_PLUGIN);
  ASSERT_HAS(qkeep_errmsg(), "directory");
  ck_assert_int_eq(chmod(sub, 0755), 0);
  if (geteuid() == 0) { /* only root can give a file away */
    ck_assert_int_eq(chown(copy, 4321, (gid_t)-1), 0);
    ck_assert_int_eq(qkeep_plugin_open_path(copy, &p), QKEEP_E_PLUGIN);
    ASSERT_HAS(qkeep_errmsg(), "owned by uid 4321");
  }
  free(copy);
  free(sub);
  free(src);
}
END_TEST

/* The check looked at the link's directory and the file, not the real file's directory nor any parent:
 * a plugin linked from a trusted directory into one anyone may write, or sitting in a trusted directory
 * under one anyone may write, loaded. Now the resolved file and every directory above it (and above the
 * link) are checked, as ssh checks a key; a sticky directory owned by root or the caller passes. */
START_TEST(test_plugin_trust_follows_links_and_checks_every_parent) {
  char *src = test_plugin_file("test-good"), *top = realpath(tmpdir, NULL); /* messages name resolved paths */
  ck_assert_ptr_nonnull(top);
  char *open_dir = tu_path(top, "open"), *safe = tu_path(top, "safe");
  char *nested = tu_path(open_dir, "nested"), *link_path = tu_path(safe, "backend-test-good.so");
  char *real = tu_path(nested, "backend-test-good.so");
  free(top);
  ck_assert_int_eq(mkdir(open_dir, 0755), 0);
  ck_assert_int_eq(mkdir(nested, 0755), 0);
  ck_assert_int_eq(mkdir(safe, 0755), 0);
  size_t n;
  void *bytes = tu_read_file(src, &n);
  ck_assert_ptr_nonnull(bytes);
  ck_assert_int_eq(tu_write_file(real, bytes, n), 0);
  free(bytes);
  ck_assert_int_eq(chmod(real, 0755), 0);
  ck_assert_int_eq(symlink(real, link_path), 0);
  qkeep_plugin *p = NULL;
  /* all trusted: loads through the link and directly */
  ck_assert_msg(qkeep_plugin_open_path(link_path, &p) == 0, "%s", qkeep_errmsg());
  qkeep_plugin_close(p);
  /* the real file's directory writable by all: refused through the link */
  ck_assert_int_eq(chmod(nested, 0777), 0);
  ck_assert_int_eq(qkeep_plugin_open_path(link_path, &p), QKEEP_E_PLUGIN);
  ASSERT_HAS(qkeep_errmsg(), link_path);
  ASSERT_HAS(qkeep_errmsg(), nested);
  ASSERT_HAS(qkeep_errmsg(), "writable by others");
  ck_assert_int_eq(chmod(nested, 0755), 0);
  /* a parent writable by its group: refused, directly and through the link, naming the parent */
  ck_assert_int_eq(chmod(open_dir, 0775), 0);
  ck_assert_int_eq(qkeep_plugin_open_path(real, &p), QKEEP_E_PLUGIN);
  ASSERT_HAS(qkeep_errmsg(), open_dir);
  ASSERT_HAS(qkeep_errmsg(), "writable by its group");
  ck_assert_int_eq(qkeep_plugin_open_path(link_path, &p), QKEEP_E_PLUGIN);
  ASSERT_HAS(qkeep_errmsg(), open_dir);
  /* ... unless it is sticky and owned by root or the caller, as /tmp is */
  ck_assert_int_eq(chmod(open_dir, 01777), 0);
  ck_assert_msg(qkeep_plugin_open_path(link_path, &p) == 0, "%s", qkeep_errmsg());
  qkeep_plugin_close(p);
  ck_assert_int_eq(chmod(open_dir, 0755), 0);
  /* the link's own directory writable by all: the link could be pointed elsewhere */
  ck_assert_int_eq(chmod(safe, 0777), 0);
  ck_assert_int_eq(qkeep_plugin_open_path(link_path, &p), QKEEP_E_PLUGIN);
  ASSERT_HAS(qkeep_errmsg(), safe);
  ck_assert_int_eq(chmod(safe, 0755), 0);
  if (geteuid() == 0) { /* a parent someone else owns (only root can give one away) */
    ck_assert_int_eq(chown(open_dir, 4321, (gid_t)-1), 0);
    ck_assert_int_eq(qkeep_plugin_open_path(link_path, &p), QKEEP_E_PLUGIN);
    ASSERT_HAS(qkeep_errmsg(), "owned by uid 4321");
    ASSERT_HAS(qkeep_errmsg(), open_dir);
    ck_assert_int_eq(chown(open_dir, 0, (gid_t)-1), 0);
  }
  free(src), free(open_dir), free(safe), free(nested), free(link_path), free(real);
}
END_TEST

/* A memory table that is set but short is refused at load, naming it. */
START_TEST(test_short_memory_table) {
  char *msg = open_fails("test-shortmem", NULL, QKEEP_E_ABI);
  ASSERT_HAS(msg, "memory table");
  ASSERT_HAS(msg, "lacks a slot");
  free(msg);
}
END_TEST

START_TEST(test_abi_minor) {
  char *file = test_plugin_file("test-minor");
  char *msg = open_fails("test-minor", NULL, QKEEP_E_ABI);
  ASSERT_HAS(msg, file);
  ASSERT_HAS(msg, core_abi);
  ASSERT_HAS(msg, plugin_abi_minor);
  ASSERT_HAS(msg, "newer core");
  free(msg);
  free(file);
}
END_TEST

START_TEST(test_init_failure) {
  char *file = test_plugin_file("test-initfail");
  char *msg = open_fails("test-initfail", NULL, QKEEP_E_PLUGIN);
  ASSERT_HAS(msg, file);
  ASSERT_HAS(msg, core_abi);
  ASSERT_HAS(msg, "test-initfail: simulated init failure");
  free(msg);
  free(file);
}
END_TEST

/* A file whose backend has another name than its file name says: refused, and fini runs. */
START_TEST(test_name_mismatch) {
  char *file = copy_plugin("test-good", "other");
  char *msg = open_fails("other", tmpdir, QKEEP_E_PLUGIN);
  ASSERT_HAS(msg, file);
  ASSERT_HAS(msg, "'test-good', expected 'other'");
  ASSERT_HAS(msg, core_abi);
  free(msg);
  free(file);
}
END_TEST

START_TEST(test_invalid_name) {
  free(open_fails("../etc/x", NULL, QKEEP_E_INVAL));
  free(open_fails("", NULL, QKEEP_E_INVAL));
  free(open_fails(NULL, NULL, QKEEP_E_INVAL));
  free(open_fails("Test-Good", NULL, QKEEP_E_INVAL));
  ck_assert_int_eq(qkeep_plugin_open("test-good", NULL, NULL), QKEEP_E_INVAL);
  qkeep_plugin *p;
  ck_assert_int_eq(qkeep_plugin_open_path(NULL, &p), QKEEP_E_INVAL);
}
END_TEST

START_TEST(test_probe_nodev) {
  qkeep_plugin *p = NULL;
  ck_assert_msg(qkeep_plugin_open("test-nodev", NULL, &p) == 0, "%s", qkeep_errmsg());
  char msg[64];
  ck_assert_int_eq(qkeep_plugin_probe(p, msg, sizeof msg), QKEEP_E_NODEV);
  ck_assert_str_eq(msg, "no test device");
  ASSERT_HAS(qkeep_errmsg(), "no test device");
  ASSERT_HAS(qkeep_errmsg(), "test-nodev");

  /* a short buffer still ends in NUL; no buffer at all is allowed */
  char small[4] = "xxx";
  ck_assert_int_eq(qkeep_plugin_probe(p, small, sizeof small), QKEEP_E_NODEV);
  ck_assert_str_eq(small, "no ");
  ck_assert_int_eq(qkeep_plugin_probe(p, NULL, 0), QKEEP_E_NODEV);
  ASSERT_HAS(qkeep_errmsg(), "no test device");
  qkeep_plugin_close(p);
}
END_TEST

/* Writes a config naming `backend` with the given [backend.X] body; returns its path. */
static char *write_config(const char *backend, const char *section_body) {
  char text[1024];
  snprintf(text, sizeof text, "[qkeep]\nbackend = %s\n[backend.%s]\n%s", backend, backend, section_body);
  char *path = tu_path(tmpdir, "qkeep.ini");
  ck_assert_int_eq(tu_write_file(path, text, strlen(text)), 0);
  return path;
}

static qkeep_config *load_config(const char *path) {
  qkeep_config *cfg = NULL;
  ck_assert_msg(qkeep_config_load(path, &cfg) == 0, "%s", qkeep_errmsg());
  return cfg;
}

/* Opens the config's plugin, which must fail with code and "PATH:LINE: " + fragment. */
static void open_config_fails(const char *path, int code, int line, const char *fragment) {
  qkeep_config *cfg = load_config(path);
  qkeep_plugin *p = (qkeep_plugin *)(uintptr_t)1;
  int rc = qkeep_plugin_open_config(cfg, &p);
  const char *msg = qkeep_errmsg();
  char prefix[4200];
  snprintf(prefix, sizeof prefix, "%s:%d: ", path, line);
  ck_assert_msg(rc == code, "rc %d, expected %d (%s)", rc, code, msg);
  ck_assert_ptr_null(p);
  ck_assert_msg(strncmp(msg, prefix, strlen(prefix)) == 0, "'%s' should start with '%s'", msg, prefix);
  ASSERT_HAS(msg, fragment);
  qkeep_config_free(cfg);
}

START_TEST(test_configure_good) {
  char *path = write_config("test-good", "threads = 4\n");
  qkeep_config *cfg = load_config(path);
  qkeep_plugin *p = NULL;
  ck_assert_msg(qkeep_plugin_open_config(cfg, &p) == 0, "%s", qkeep_errmsg());
  ck_assert_str_eq(qkeep_plugin_name(p), "test-good");
  char msg[128];
  ck_assert_int_eq(qkeep_plugin_probe(p, msg, sizeof msg), 0);
  ck_assert_str_eq(msg, "test device ready (threads 4)"); /* the value reached the backend */
  ck_assert_int_eq(qkeep_plugin_configure(p, cfg), 0);    /* again: still fine */
  qkeep_plugin_close(p);
  qkeep_config_free(cfg);
  free(path);

  /* a config without the plugin's section configures nothing */
  path = tu_path(tmpdir, "bare.ini");
  ck_assert_int_eq(tu_write_file(path, "[qkeep]\nbackend = test-nodev\n", 29), 0);
  cfg = load_config(path);
  ck_assert_msg(qkeep_plugin_open_config(cfg, &p) == 0, "%s", qkeep_errmsg());
  qkeep_plugin_close(p);
  qkeep_config_free(cfg);
  free(path);
}
END_TEST

START_TEST(test_configure_unknown_key) {
  char *path = write_config("test-good", "threads = 2\n\ncolour = red\n");
  open_config_fails(path, QKEEP_E_CONFIG, 6, "[backend.test-good] colour: unknown key 'colour'");
  free(path);
}
END_TEST

START_TEST(test_configure_bad_value) {
  char *path = write_config("test-good", "threads = -2\n");
  open_config_fails(path, QKEEP_E_CONFIG, 4,
                    "[backend.test-good] threads: threads must be a positive integer");
  free(path);
}
END_TEST

/* Keys a backend declares are checked by the core, with the backend's list when unknown. */
START_TEST(test_configure_declared_keys) {
  char *path = write_config("test-picky", "take = lm_head\nlevel = 8\nmode = fast\nstrict = yes\n");
  qkeep_config *cfg = load_config(path);
  qkeep_plugin *p = NULL;
  ck_assert_msg(qkeep_plugin_open_config(cfg, &p) == 0, "%s", qkeep_errmsg());
  qkeep_plugin_close(p);
  qkeep_config_free(cfg);
  free(path);
  static const struct {
    const char *text;
    int line;
    const char *fragment;
  } bad[] = {
      {"colour = red\n", 4,
       "[backend.test-picky] unknown key 'colour' (test-picky takes: take, level, mode, strict)"},
      {"level = 9\n", 4, "[backend.test-picky] level = '9': out of range 1..8"},
      {"level = two\n", 4, "level = 'two': expected an integer"},
      {"level = 3x\n", 4, "level = '3x': expected an integer"},
      {"mode = slow\n", 4, "mode = 'slow': expected one of fast|exact"},
      {"mode = fas\n", 4, "mode = 'fas': expected one of fast|exact"},
      {"strict = maybe\n", 4, "strict = 'maybe': expected true or false"},
      {"take = x\nlevel = 0\n", 5, "level = '0': out of range 1..8"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    path = write_config("test-picky", bad[i].text);
    open_config_fails(path, QKEEP_E_CONFIG, bad[i].line, bad[i].fragment);
    free(path);
  }
  /* the reference declares its one key */
  path = write_config("reference", "threads = 2\n");
  open_config_fails(path, QKEEP_E_CONFIG, 4, "unknown key 'threads' (reference takes: activations)");
  free(path);
  path = write_config("reference", "activations = int4\n");
  open_config_fails(path, QKEEP_E_CONFIG, 4, "activations = 'int4': expected one of float|int8|int8-7bit");
  free(path);
}
END_TEST

/* The declared keys, as qkeep plugins --verbose lists them; undeclared ones are NOTFOUND. */
static int count_key(void *user, const struct qkeep_backend_key *k) {
  ck_assert_ptr_nonnull(k->name);
  ck_assert_ptr_nonnull(k->help);
  (*(int *)user)++;
  return 0;
}

START_TEST(test_declared_key_listing) {
  qkeep_plugin *p = NULL;
  int n = 0;
  ck_assert_int_eq(qkeep_plugin_open("test-picky", NULL, &p), 0);
  ck_assert_int_eq(qkeep_plugin_keys(p, count_key, &n), 0);
  ck_assert_int_eq(n, 4);
  qkeep_plugin_close(p);
  ck_assert_int_eq(qkeep_plugin_open("test-good", NULL, &p), 0);
  ck_assert_int_eq(qkeep_plugin_keys(p, count_key, &n), QKEEP_E_NOTFOUND);
  qkeep_plugin_close(p);
}
END_TEST

/* A backend without configure cannot take options. */
START_TEST(test_configure_no_hook) {
  char *path = write_config("test-nodev", "x = 1\n");
  open_config_fails(path, QKEEP_E_CONFIG, 4, "[backend.test-nodev] x: backend 'test-nodev' takes no options");
  free(path);
}
END_TEST

/* Options of another backend's section (of the chain) are not passed to this one. */
START_TEST(test_configure_other_section) {
  char *path = tu_path(tmpdir, "two.ini");
  const char *text =
      "[qkeep]\nbackend = test-good, test-nodev\n[backend.test-good]\nthreads = 3\n[backend.test-"
      "nodev]\nx = 1\n";
  ck_assert_int_eq(tu_write_file(path, text, strlen(text)), 0);
  qkeep_config *cfg = load_config(path);
  qkeep_plugin *p = NULL;
  ck_assert_msg(qkeep_plugin_open_config(cfg, &p) == 0, "%s", qkeep_errmsg());
  qkeep_plugin_close(p);
  qkeep_config_free(cfg);
  free(path);
}
END_TEST

START_TEST(test_open_config_missing_plugin) {
  char *path = write_config("test-absent", "");
  open_config_fails(path, QKEEP_E_NOTFOUND, 2, "backend 'test-absent': backend-test-absent.so not found");
  free(path);
  path = write_config("test-major", "");
  open_config_fails(path, QKEEP_E_ABI, 2, plugin_abi_major);
  free(path);
}
END_TEST

struct scan_result {
  int n;
  char names[64][64];
  char paths[64][512];
};

static int collect(void *user, const char *name, const char *path) {
  struct scan_result *r = user;
  ck_assert_int_lt(r->n, 64);
  snprintf(r->names[r->n], sizeof r->names[0], "%s", name);
  snprintf(r->paths[r->n], sizeof r->paths[0], "%s", path);
  r->n++;
  return 0;
}

static int find_name(const struct scan_result *r, const char *name) {
  for (int i = 0; i < r->n; i++)
    if (strcmp(r->names[i], name) == 0)
      return i;
  return -1;
}

static size_t dir_len(const char *path) { return (size_t)(strrchr(path, '/') - path); }

START_TEST(test_scan) {
  static struct scan_result r;
  memset(&r, 0, sizeof r);
  ck_assert_int_eq(qkeep_plugin_scan(NULL, collect, &r), 0);
  static const char *const variants[] = {"test-good",  "test-nosym",    "test-major",
                                         "test-minor", "test-initfail", "test-nodev"};
  for (size_t i = 0; i < sizeof variants / sizeof *variants; i++) {
    int at = find_name(&r, variants[i]);
    ck_assert_msg(at >= 0, "scan missed %s", variants[i]);
    char *file = test_plugin_file(variants[i]);
    ck_assert_str_eq(r.paths[at], file);
    free(file);
  }
  for (int i = 0; i < r.n; i++) {
    ck_assert_int_eq(find_name(&r, r.names[i]), i); /* each name once */
    /* sorted within a directory */
    if (i > 0 && dir_len(r.paths[i]) == dir_len(r.paths[i - 1]) &&
        strncmp(r.paths[i], r.paths[i - 1], dir_len(r.paths[i])) == 0)
      ck_assert_msg(strcmp(r.names[i - 1], r.names[i]) < 0, "%s before %s", r.names[i - 1], r.names[i]);
  }
}
END_TEST

/* A name in two directories is listed once, from the directory open would use. */
START_TEST(test_scan_first_wins) {
  char *dup = copy_plugin("test-good", "test-good");
  char *extra = copy_plugin("test-good", "zz-extra");
  char *junk[] = {tu_path(tmpdir, "backend-.so"), tu_path(tmpdir, "backend-UPPER.so"),
                  tu_path(tmpdir, "other.so"), tu_path(tmpdir, "backend-x.so.1")};
  for (size_t i = 0; i < 4; i++) {
    ck_assert_int_eq(tu_write_file(junk[i], "x", 1), 0);
    free(junk[i]);
  }
  char *subdir = tu_path(tmpdir, "backend-dir.so");
  ck_assert_int_eq(mkdir(subdir, 0755), 0);

  static struct scan_result r;
  memset(&r, 0, sizeof r);
  ck_assert_int_eq(qkeep_plugin_scan(tmpdir, collect, &r), 0);
  int good = find_name(&r, "test-good"), zz = find_name(&r, "zz-extra");
  ck_assert_int_ge(good, 0);
  ck_assert_int_ge(zz, 0);
  ck_assert_str_ne(r.paths[good], dup);
  ck_assert_str_eq(r.paths[zz], extra);
  ck_assert_int_lt(good, zz); /* $QKEEP_PLUGIN_PATH first */
  ck_assert_int_eq(find_name(&r, "UPPER"), -1);
  ck_assert_int_eq(find_name(&r, "dir"), -1);
  ck_assert_int_eq(find_name(&r, ""), -1);
  for (int i = 0; i < r.n; i++)
    ck_assert_int_eq(find_name(&r, r.names[i]), i);

  ck_assert_int_eq(qkeep_plugin_scan(tmpdir, NULL, NULL), QKEEP_E_INVAL);
  free(subdir);
  free(extra);
  free(dup);
}
END_TEST

static int stop_at_first(void *user, const char *name, const char *path) {
  (void)name;
  (void)path;
  ++*(int *)user;
  return 42;
}

START_TEST(test_scan_stops) {
  int calls = 0;
  ck_assert_int_eq(qkeep_plugin_scan(NULL, stop_at_first, &calls), 42);
  ck_assert_int_eq(calls, 1);
}
END_TEST

/* Opens name and copies the file it came from into path (empty on failure). */
static int opened_from(const char *name, const char *plugin_dir, char *path, size_t len) {
  qkeep_plugin *p = NULL;
  int rc = qkeep_plugin_open(name, plugin_dir, &p);
  snprintf(path, len, "%s", rc == 0 ? qkeep_plugin_path(p) : "");
  qkeep_plugin_close(p);
  return rc;
}

/* $QKEEP_PLUGIN_PATH comes before plugin_dir; without it, plugin_dir is used. */
START_TEST(test_plugin_path_precedence) {
  char *copy = copy_plugin("test-good", "test-good");
  char *env_file = test_plugin_file("test-good");
  char path[3][1024];
  ck_assert_msg(opened_from("test-good", tmpdir, path[0], sizeof path[0]) == 0, "%s", qkeep_errmsg());
  ck_assert_str_eq(path[0], env_file);

  /* change the environment, then restore it before asserting (CK_FORK=no runs share it) */
  char *saved = strdup(getenv("QKEEP_PLUGIN_PATH"));
  char *empty = tu_path(tmpdir, "empty");
  ck_assert_int_eq(mkdir(empty, 0755), 0);
  setenv("QKEEP_PLUGIN_PATH", empty, 1);
  int rc_empty = opened_from("test-good", tmpdir, path[1], sizeof path[1]);
  unsetenv("QKEEP_PLUGIN_PATH");
  int rc_unset = opened_from("test-good", tmpdir, path[2], sizeof path[2]);
  int rc_nodev = opened_from("test-nodev", tmpdir, path[0], sizeof path[0]);
  setenv("QKEEP_PLUGIN_PATH", saved, 1);

  ck_assert_int_eq(rc_empty, 0);
  ck_assert_str_eq(path[1], copy);
  ck_assert_int_eq(rc_unset, 0);
  ck_assert_str_eq(path[2], copy);
  ck_assert_int_eq(rc_nodev, QKEEP_E_NOTFOUND); /* test-nodev lives only in $QKEEP_PLUGIN_PATH */
  free(empty);
  free(saved);
  free(env_file);
  free(copy);
}
END_TEST

START_TEST(test_install_dir) {
  const char *dir = qkeep_plugin_install_dir();
  ck_assert_ptr_nonnull(dir);
  ck_assert_int_eq(dir[0], '/');
}
END_TEST

/* Through the test control, plugins opened from then on stay mapped after their close (valgrind and
 * ASan runs keep a plugin's symbols for their leak reports); by default a close unmaps the plugin. Run
 * last: the plugin it keeps stays in the process. */
START_TEST(test_control_keeps_closed_plugins_mapped) {
  char *file = test_plugin_file("test-good");
  qkeep_plugin *p;
  ck_assert_msg(qkeep_plugin_open("test-good", NULL, &p) == 0, "%s", qkeep_errmsg());
  qkeep_plugin_close(p);
  ck_assert_ptr_null(dlopen(file, RTLD_NOW | RTLD_NOLOAD));
  ck_assert_int_eq(qkeep__test_control(QKEEP_TESTCTRL_PLUGIN_NODELETE, 1), 0);
  ck_assert_msg(qkeep_plugin_open("test-good", NULL, &p) == 0, "%s", qkeep_errmsg());
  qkeep_plugin_close(p);
  void *h = dlopen(file, RTLD_NOW | RTLD_NOLOAD);
  ck_assert_msg(h != NULL, "%s was unmapped at its close", file);
  dlclose(h);
  ck_assert_int_eq(qkeep__test_control(QKEEP_TESTCTRL_PLUGIN_NODELETE, 0), 0);
  free(file);
}
END_TEST

/* An unknown op, or a fault no reload could raise, is refused with what was wrong. */
START_TEST(test_control_refuses_what_it_cannot_do) {
  ck_assert_int_eq(qkeep__test_control(999), QKEEP_E_INVAL);
  ASSERT_HAS(qkeep_errmsg(), "unknown op 999");
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(NULL, &m), 0);
  ck_assert_int_eq(qkeep__test_control(QKEEP_TESTCTRL_RELOAD_FAULT, (qkeep_model *)NULL, 0L, QKEEP_E_IO),
                   QKEEP_E_INVAL);
  ck_assert_int_eq(qkeep__test_control(QKEEP_TESTCTRL_RELOAD_FAULT, m, 0L, 0), QKEEP_E_INVAL);
  ASSERT_HAS(qkeep_errmsg(), "RELOAD_FAULT");
  ck_assert_int_eq(qkeep__test_control(QKEEP_TESTCTRL_RELOAD_FAULT, m, -2L, QKEEP_E_IO), QKEEP_E_INVAL);
  ck_assert_int_eq(qkeep__test_control(QKEEP_TESTCTRL_RELOAD_FAULT, m, 0L, QKEEP_E_IO), 0);
  ck_assert_int_eq(qkeep__test_control(QKEEP_TESTCTRL_RELOAD_FAULT, m, -1L, 0), 0);
  qkeep_model_free(m);
}
END_TEST

static Suite *plugin_suite(void) {
  Suite *s = suite_create("plugin");
  TCase *tc = tcase_create("load");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, test_good);
  tcase_add_test(tc, test_open_path);
  tcase_add_test(tc, test_missing_file);
  tcase_add_test(tc, test_missing_symbol);
  tcase_add_test(tc, test_not_a_library);
  tcase_add_test(tc, test_abi_major);
  tcase_add_test(tc, test_abi_minor);
  tcase_add_test(tc, test_untrusted_plugin_refused);
  tcase_add_test(tc, test_plugin_trust_follows_links_and_checks_every_parent);
  tcase_add_test(tc, test_short_memory_table);
  tcase_add_test(tc, test_init_failure);
  tcase_add_test(tc, test_name_mismatch);
  tcase_add_test(tc, test_invalid_name);
  tcase_add_test(tc, test_probe_nodev);
  tcase_add_test(tc, test_install_dir);
  suite_add_tcase(s, tc);

  tc = tcase_create("config");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, test_configure_good);
  tcase_add_test(tc, test_configure_unknown_key);
  tcase_add_test(tc, test_configure_bad_value);
  tcase_add_test(tc, test_configure_no_hook);
  tcase_add_test(tc, test_configure_declared_keys);
  tcase_add_test(tc, test_declared_key_listing);
  tcase_add_test(tc, test_configure_other_section);
  tcase_add_test(tc, test_open_config_missing_plugin);
  suite_add_tcase(s, tc);

  tc = tcase_create("search");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, test_scan);
  tcase_add_test(tc, test_scan_first_wins);
  tcase_add_test(tc, test_scan_stops);
  tcase_add_test(tc, test_plugin_path_precedence);
  suite_add_tcase(s, tc);

  tc = tcase_create("test control"); /* last: it leaves a plugin mapped */
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, test_control_refuses_what_it_cannot_do);
  tcase_add_test(tc, test_control_keeps_closed_plugins_mapped);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  /* make check sets QKEEP_PLUGIN_PATH; run by hand, look for the test plugins in the build tree. */
  if (!getenv("QKEEP_PLUGIN_PATH")) {
    char *dir = tu_path(tu_builddir(), "tests/plugins/.libs");
    setenv("QKEEP_PLUGIN_PATH", dir, 1);
    free(dir);
  }
  abi_strings();
  return tu_run_suite(plugin_suite(), CK_NORMAL);
}
