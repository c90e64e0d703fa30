/* check_config.c: the INI config reader (libqkeep/format/config.c). */
#include <check.h>
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
  tmpdir = tu_tmpdir("config");
  ck_assert_ptr_nonnull(tmpdir);
}

static void teardown(void) {
  tu_rmtree(tmpdir);
  free(tmpdir);
  tmpdir = NULL;
}

/* Writes text to tmpdir/name; returns the malloc'd path. */
static char *write_config(const char *name, const char *text) {
  char *path = tu_path(tmpdir, name);
  ck_assert_ptr_nonnull(path);
  ck_assert_int_eq(tu_write_file(path, text, strlen(text)), 0);
  return path;
}

/* Loads text, which must fail with code, and an error starting "PATH:LINE: " that contains fragment. */
static void expect_error(const char *text, int code, int line, const char *fragment) {
  char *path = write_config("bad.ini", text);
  qkeep_config *cfg = (qkeep_config *)(uintptr_t)1;
  int rc = qkeep_config_load(path, &cfg);
  const char *msg = qkeep_errmsg();
  char prefix[4200];
  snprintf(prefix, sizeof prefix, "%s:%d: ", path, line);
  ck_assert_msg(rc == code, "rc %d, expected %d; errmsg: %s", rc, code, msg);
  ck_assert_ptr_null(cfg);
  ck_assert_msg(strncmp(msg, prefix, strlen(prefix)) == 0, "errmsg '%s' should start with '%s'", msg, prefix);
  ck_assert_msg(strstr(msg, fragment) != NULL, "errmsg '%s' should contain '%s'", msg, fragment);
  free(path);
}

START_TEST(test_good_file) {
  char *path = write_config("qkeep.ini", "; a comment\n"
                                         "# another\n"
                                         "[qkeep]\n"
                                         "backend = cpu-onednn   ; inline comment\n"
                                         "plugin_dir = plugins\n"
                                         "\n"
                                         "[model]\n"
                                         "checkpoint = ../ckpt/tiny\n"
                                         "[backend.cpu-onednn]\n"
                                         "threads = 2\n"
                                         "isa=avx512_core_vnni\n"
                                         "[backend.reference]\n"
                                         "[backend.cpu-onednn]\n"
                                         "  pack : yes\n");
  qkeep_config *cfg = NULL;
  ck_assert_msg(qkeep_config_load(path, &cfg) == 0, "%s", qkeep_errmsg());
  ck_assert_str_eq(qkeep_config_path(cfg), path);
  ck_assert_str_eq(qkeep_config_backend(cfg), "cpu-onednn");
  ck_assert_int_eq(cfg->backend_line, 4);

  char *plugins = tu_path(tmpdir, "plugins"), *ckpt = tu_path(tmpdir, "../ckpt/tiny");
  ck_assert_str_eq(qkeep_config_plugin_dir(cfg), plugins);
  ck_assert_str_eq(qkeep_config_checkpoint(cfg), ckpt);

  const struct config_backend_section *sec = config_section(cfg, "cpu-onednn");
  ck_assert_ptr_nonnull(sec);
  ck_assert_str_eq(sec->name, "cpu-onednn");
  ck_assert_uint_eq(sec->n_options, 3);
  ck_assert_str_eq(sec->options[0].key, "threads");
  ck_assert_str_eq(sec->options[0].value, "2");
  ck_assert_int_eq(sec->options[0].line, 10);
  ck_assert_str_eq(sec->options[1].key, "isa");
  ck_assert_str_eq(sec->options[1].value, "avx512_core_vnni");
  ck_assert_int_eq(sec->options[1].line, 11);
  ck_assert_str_eq(sec->options[2].key, "pack"); /* first key of a section may be indented */
  ck_assert_str_eq(sec->options[2].value, "yes");
  ck_assert_int_eq(sec->options[2].line, 14);

  sec = config_section(cfg, "reference"); /* present, without keys */
  ck_assert_ptr_nonnull(sec);
  ck_assert_uint_eq(sec->n_options, 0);
  ck_assert_ptr_null(config_section(cfg, "cuda-nvfp4"));

  qkeep_config_free(cfg);
  free(plugins);
  free(ckpt);
  free(path);
}
END_TEST

START_TEST(test_minimal_and_absolute) {
  char *path =
      write_config("min.ini", "[qkeep]\nbackend=reference\n[model]\ncheckpoint = /data/m.safetensors\n");
  qkeep_config *cfg = NULL;
  ck_assert_msg(qkeep_config_load(path, &cfg) == 0, "%s", qkeep_errmsg());
  ck_assert_str_eq(qkeep_config_backend(cfg), "reference");
  ck_assert_ptr_null(qkeep_config_plugin_dir(cfg));
  ck_assert_str_eq(qkeep_config_checkpoint(cfg), "/data/m.safetensors");
  ck_assert_uint_eq(cfg->n_sections, 0);
  qkeep_config_free(cfg);
  free(path);
}
END_TEST

/* Windows line endings, a byte order mark and no final newline are all fine. */
START_TEST(test_crlf_bom) {
  char *path =
      write_config("crlf.ini", "\xEF\xBB\xBF[qkeep]\r\nbackend = reference\r\n[backend.reference]\r\nk = v");
  qkeep_config *cfg = NULL;
  ck_assert_msg(qkeep_config_load(path, &cfg) == 0, "%s", qkeep_errmsg());
  ck_assert_str_eq(qkeep_config_backend(cfg), "reference");
  const struct config_backend_section *sec = config_section(cfg, "reference");
  ck_assert_ptr_nonnull(sec);
  ck_assert_uint_eq(sec->n_options, 1);
  ck_assert_str_eq(sec->options[0].value, "v");
  ck_assert_int_eq(sec->options[0].line, 4);
  qkeep_config_free(cfg);
  free(path);
}
END_TEST

/* A config named without a directory resolves relative paths against the current directory. */
START_TEST(test_relative_config_path) {
  char *cwd = getcwd(NULL, 0);
  ck_assert_ptr_nonnull(cwd);
  char *path =
      write_config("here.ini", "[qkeep]\nbackend = reference\nplugin_dir = p\n[model]\ncheckpoint = c\n");
  ck_assert_int_eq(chdir(tmpdir), 0);
  qkeep_config *cfg = NULL;
  int rc = qkeep_config_load("here.ini", &cfg);
  ck_assert_int_eq(chdir(cwd), 0);
  ck_assert_msg(rc == 0, "%s", qkeep_errmsg());
  ck_assert_str_eq(qkeep_config_path(cfg), "here.ini");
  ck_assert_str_eq(qkeep_config_plugin_dir(cfg), "p");
  ck_assert_str_eq(qkeep_config_checkpoint(cfg), "c");
  qkeep_config_free(cfg);
  free(path);
  free(cwd);
}
END_TEST

START_TEST(test_unknown_section) {
  expect_error("[qkeep]\nbackend = reference\n\n[modle]\ncheckpoint = x\n", QKEEP_E_CONFIG, 4,
               "unknown section [modle]");
  /* caught even when the section has no keys (inih calls no handler for it) */
  expect_error("[qkeep]\nbackend = reference\n[extra]\n", QKEEP_E_CONFIG, 3, "unknown section [extra]");
  expect_error("[qkeep]\nbackend = reference\n[backend.Bad]\n", QKEEP_E_CONFIG, 3, "invalid backend name");
  expect_error("[qkeep]\nbackend = reference\n[backend.]\n", QKEEP_E_CONFIG, 3, "invalid backend name");
}
END_TEST

START_TEST(test_unknown_key) {
  expect_error("[qkeep]\nbackend = reference\nplugindir = /x\n", QKEEP_E_CONFIG, 3,
               "[qkeep] unknown key 'plugindir'");
  expect_error("[qkeep]\nbackend = reference\n[model]\ncheckpoint = a\npath = b\n", QKEEP_E_CONFIG, 5,
               "[model] unknown key 'path'");
  expect_error("backend = reference\n[qkeep]\n", QKEEP_E_CONFIG, 1, "outside any section");
}
END_TEST

START_TEST(test_bad_value) {
  expect_error("[qkeep]\nbackend = CPU!\n", QKEEP_E_CONFIG, 2, "invalid name 'CPU!'");
  expect_error("[qkeep]\nbackend = reference\nplugin_dir =\n", QKEEP_E_CONFIG, 3,
               "[qkeep] plugin_dir: empty value");
  expect_error("[qkeep]\nbackend = reference\n[model]\ncheckpoint =   ; nothing\n", QKEEP_E_CONFIG, 4,
               "[model] checkpoint: empty value");
  expect_error("[qkeep]\nbackend = reference\n[backend.reference]\nthreads =\n", QKEEP_E_CONFIG, 4,
               "[backend.reference] threads: empty value");
  expect_error("[qkeep]\nbackend = reference\n[backend.reference]\n= 3\n", QKEEP_E_CONFIG, 4, "missing key");
}
END_TEST

START_TEST(test_duplicate_key) {
  expect_error("[qkeep]\nbackend = reference\n[model]\n[qkeep]\nbackend = cpu-onednn\n", QKEEP_E_CONFIG, 5,
               "duplicate key 'backend' (first set on line 2)");
  expect_error("[qkeep]\nbackend = reference\n[backend.reference]\na = 1\nb = 2\n\na = 3\n", QKEEP_E_CONFIG,
               7, "[backend.reference] duplicate key 'a' (first set on line 4)");
  /* a key indented under another would be glued to its value by inih: refused */
  expect_error("[qkeep]\nbackend = reference\n[backend.reference]\na = 1\n  b = 2\n", QKEEP_E_CONFIG, 5,
               "multi-line values are not supported");
}
END_TEST

START_TEST(test_missing_backend) {
  /* [qkeep] present without backend: its header's line */
  expect_error("; config\n[qkeep]\nplugin_dir = /x\n[model]\ncheckpoint = y\n", QKEEP_E_CONFIG, 2,
               "[qkeep] has no backend");
  /* no [qkeep] at all: the last line */
  expect_error("[model]\ncheckpoint = y\n\n", QKEEP_E_CONFIG, 3, "missing [qkeep] section");
  expect_error("", QKEEP_E_CONFIG, 0, "missing [qkeep] section");
}
END_TEST

START_TEST(test_syntax_error) {
  expect_error("[qkeep]\nbackend = reference\nthis line has no equals sign\n", QKEEP_E_CONFIG, 3,
               "syntax error");
  expect_error("[qkeep\nbackend = reference\n", QKEEP_E_CONFIG, 1, "syntax error");
  /* the first error in the file is the one reported, whichever kind it is */
  expect_error("[qkeep]\nbackend = reference\noops\n[nope]\n", QKEEP_E_CONFIG, 3, "syntax error");
  expect_error("[qkeep]\nbackend = reference\n[nope]\noops\n", QKEEP_E_CONFIG, 3, "unknown section [nope]");
  expect_error("[qkeep]\nbackend = reference\nbogus = 1\noops\n", QKEEP_E_CONFIG, 3, "unknown key 'bogus'");
}
END_TEST

/* inih's line buffer would split a long line in two: refuse it, with its line. */
/* Lines longer than inih's buffer (long paths) are read whole, as inih reads a short one. */
START_TEST(test_long_line) {
  size_t long_len = 5000;
  char *dirname = malloc(long_len + 1);
  memset(dirname, 'a', long_len);
  dirname[long_len] = '\0';
  size_t cap = 4 * long_len + 512;
  char *text = malloc(cap);
  snprintf(text, cap,
           "[qkeep]\nbackend = reference\n; %s\n[model]\ncheckpoint = /%s/m ; a comment\n"
           "[backend.reference]\nactivations: %s\n",
           dirname, dirname, dirname);
  char *path = write_config("long.ini", text);
  qkeep_config *cfg = NULL;
  ck_assert_msg(qkeep_config_load(path, &cfg) == 0, "%s", qkeep_errmsg());
  ck_assert_uint_eq(strlen(qkeep_config_checkpoint(cfg)), long_len + 3);
  ck_assert_int_eq(strncmp(qkeep_config_checkpoint(cfg) + 1, dirname, long_len), 0);
  ck_assert_str_eq(qkeep_config_checkpoint(cfg) + long_len + 1, "/m");
  const struct config_backend_section *sec = config_section(cfg, "reference");
  ck_assert_ptr_nonnull(sec);
  ck_assert_str_eq(sec->options[0].key, "activations");
  ck_assert_str_eq(sec->options[0].value, dirname);
  ck_assert_int_eq(sec->options[0].line, 7);
  qkeep_config_free(cfg);
  free(path);
  /* a long line still follows the rules: a header that long, or no '=', is an error with its line */
  snprintf(text, cap, "[qkeep]\nbackend = reference\n[backend.%s]\n", dirname);
  expect_error(text, QKEEP_E_CONFIG, 3, "section header too long");
  snprintf(text, cap, "[qkeep]\nbackend = reference\n[model]\n%s\n", dirname);
  expect_error(text, QKEEP_E_CONFIG, 4, "syntax error");
  snprintf(text, cap, "[qkeep]\nbackend = reference\n[model]\ncheckpoint = a\ncheckpoint = /%s\n", dirname);
  expect_error(text, QKEEP_E_CONFIG, 5, "duplicate key 'checkpoint'");
  free(text);
  free(dirname);
}
END_TEST

START_TEST(test_nul_byte) {
  char *path = tu_path(tmpdir, "nul.ini");
  static const char text[] = "[qkeep]\nbackend = ref\0erence\n";
  ck_assert_int_eq(tu_write_file(path, text, sizeof text - 1), 0);
  qkeep_config *cfg = NULL;
  ck_assert_int_eq(qkeep_config_load(path, &cfg), QKEEP_E_CONFIG);
  char prefix[4200];
  snprintf(prefix, sizeof prefix, "%s:2: ", path);
  ck_assert_msg(strncmp(qkeep_errmsg(), prefix, strlen(prefix)) == 0, "%s", qkeep_errmsg());
  free(path);
}
END_TEST

START_TEST(test_missing_file) {
  char *path = tu_path(tmpdir, "absent.ini");
  qkeep_config *cfg = NULL;
  ck_assert_int_eq(qkeep_config_load(path, &cfg), QKEEP_E_NOTFOUND);
  ck_assert_ptr_null(cfg);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), path));
  free(path);

  /* a directory opens but cannot be read */
  ck_assert_int_eq(qkeep_config_load(tmpdir, &cfg), QKEEP_E_IO);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), tmpdir));

  ck_assert_int_eq(qkeep_config_load(NULL, &cfg), QKEEP_E_INVAL);
}
END_TEST

START_TEST(test_backend_chain) {
  char *path = write_config("chain.ini", "[qkeep]\nbackend = test-good,  reference ,test-nodev ; a chain\n");
  qkeep_config *cfg;
  ck_assert_msg(qkeep_config_load(path, &cfg) == 0, "%s", qkeep_errmsg());
  ck_assert_uint_eq(qkeep_config_backend_count(cfg), 3);
  ck_assert_str_eq(qkeep_config_backend_at(cfg, 0), "test-good");
  ck_assert_str_eq(qkeep_config_backend_at(cfg, 1), "reference");
  ck_assert_str_eq(qkeep_config_backend_at(cfg, 2), "test-nodev");
  ck_assert_ptr_null(qkeep_config_backend_at(cfg, 3));
  ck_assert_str_eq(qkeep_config_backend(cfg), "test-good"); /* the head of the chain */
  /* every backend opens, in order; a device that is absent is the model's business, not this call's */
  qkeep_plugin **plugins;
  size_t n;
  ck_assert_msg(qkeep_plugins_open_config(cfg, &plugins, &n) == 0, "%s", qkeep_errmsg());
  ck_assert_uint_eq(n, 3);
  ck_assert_str_eq(qkeep_plugin_name(plugins[2]), "test-nodev");
  qkeep_plugins_close(plugins, n);
  qkeep_config_free(cfg);
  free(path);
  /* one missing plugin fails the whole chain with the config's line and its position */
  path = write_config("missing.ini", "[qkeep]\nbackend = reference, nonexistent\n");
  ck_assert_int_eq(qkeep_config_load(path, &cfg), 0);
  plugins = (qkeep_plugin **)(uintptr_t)1;
  ck_assert_int_eq(qkeep_plugins_open_config(cfg, &plugins, &n), QKEEP_E_NOTFOUND);
  ck_assert_ptr_null(plugins);
  ck_assert_uint_eq(n, 0);
  ck_assert_msg(strstr(qkeep_errmsg(), "missing.ini:2: backend 'nonexistent' (chain position 2)"), "%s",
                qkeep_errmsg());
  qkeep_config_free(cfg);
  free(path);
  /* a backend's keys are checked when its chain opens, with the key's line */
  path =
      write_config("keys.ini", "[qkeep]\nbackend = reference, test-good\n[backend.test-good]\nthreads = 0\n");
  ck_assert_int_eq(qkeep_config_load(path, &cfg), 0);
  ck_assert_int_eq(qkeep_plugins_open_config(cfg, &plugins, &n), QKEEP_E_CONFIG);
  ck_assert_msg(strstr(qkeep_errmsg(), "keys.ini:4: [backend.test-good] threads"), "%s", qkeep_errmsg());
  qkeep_config_free(cfg);
  free(path);
  expect_error("[qkeep]\nbackend = reference, reference\n", QKEEP_E_CONFIG, 2,
               "'reference' is named twice in the chain");
  expect_error("[qkeep]\nbackend = reference,,cpu-onednn\n", QKEEP_E_CONFIG, 2, "invalid name ''");
  expect_error("[qkeep]\nbackend = reference,\n", QKEEP_E_CONFIG, 2, "invalid name ''");
  expect_error("[qkeep]\nbackend = reference, Bad\n", QKEEP_E_CONFIG, 2, "invalid name 'Bad'");
}
END_TEST

/* A FIFO (or a directory) in the config's place is refused at once, never waited on. */
START_TEST(test_config_not_a_regular_file) {
  char *fifo = tu_path(tmpdir, "fifo.ini");
  ck_assert_int_eq(mkfifo(fifo, 0600), 0);
  qkeep_config *cfg = NULL;
  ck_assert_int_eq(qkeep_config_load(fifo, &cfg), QKEEP_E_IO);
  ck_assert_ptr_null(cfg);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "not a regular file"));
  ck_assert_int_eq(qkeep_config_load(tmpdir, &cfg), QKEEP_E_IO);
  free(fifo);
}
END_TEST

START_TEST(test_null_accessors) {
  qkeep_config_free(NULL);
  ck_assert_ptr_null(qkeep_config_backend(NULL));
  ck_assert_uint_eq(qkeep_config_backend_count(NULL), 0);
  ck_assert_ptr_null(qkeep_config_backend_at(NULL, 0));
  ck_assert_ptr_null(qkeep_config_plugin_dir(NULL));
  ck_assert_ptr_null(qkeep_config_checkpoint(NULL));
  ck_assert_ptr_null(qkeep_config_path(NULL));
  ck_assert_ptr_null(config_section(NULL, "x"));
}
END_TEST

/* A section for a backend outside the chain (misspelt, or left over) and a rank outside its group are
 * errors with the line; an empty plugin_dir entry is an error, not the config's own directory. */
START_TEST(test_sections_ranks_dirs) {
  expect_error("[qkeep]\nbackend = cpu-onednn, reference\n[backend.cpu-onedn]\nthreads = 2\n", QKEEP_E_CONFIG,
               3, "no backend 'cpu-onedn' in the chain (did you mean [backend.cpu-onednn]?)");
  expect_error("[backend.cuda-nvfp4]\ndevice = 0\n[qkeep]\nbackend = reference\n", QKEEP_E_CONFIG, 1,
               "backend 'cuda-nvfp4' is not in the chain (line 4");
  expect_error("[qkeep]\nbackend = reference\n[model]\ntp_size = 2\ntp_rank = 2\n", QKEEP_E_CONFIG, 5,
               "tp_rank = 2: out of range for tp_size = 2 (ranks 0 to 1)");
  expect_error("[qkeep]\nbackend = reference\n[model]\nep_rank = 1\n", QKEEP_E_CONFIG, 4,
               "ep_rank = 1: out of range for ep_size = 1");
  expect_error("[qkeep]\nbackend = reference\nplugin_dir = a::b\n", QKEEP_E_CONFIG, 3,
               "empty entry in 'a::b'");
  expect_error("[qkeep]\nbackend = reference\nplugin_dir = a:\n", QKEEP_E_CONFIG, 3, "empty entry");
  expect_error("[qkeep]\nbackend = reference\nplugin_dir = :a\n", QKEEP_E_CONFIG, 3, "empty entry");
  /* the oracle's section is always allowed, the chain's too */
  char *path =
      write_config("oracle.ini", "[qkeep]\nbackend = cpu-onednn\n[backend.reference]\nactivations = int8\n"
                                 "[model]\ntp_size = 2\ntp_rank = 1\n");
  qkeep_config *cfg = NULL;
  ck_assert_msg(qkeep_config_load(path, &cfg) == 0, "%s", qkeep_errmsg());
  qkeep_config_free(cfg);
  free(path);
}
END_TEST

static Suite *config_suite(void) {
  Suite *s = suite_create("config");
  TCase *tc = tcase_create("load");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, test_good_file);
  tcase_add_test(tc, test_minimal_and_absolute);
  tcase_add_test(tc, test_crlf_bom);
  tcase_add_test(tc, test_relative_config_path);
  tcase_add_test(tc, test_unknown_section);
  tcase_add_test(tc, test_unknown_key);
  tcase_add_test(tc, test_bad_value);
  tcase_add_test(tc, test_duplicate_key);
  tcase_add_test(tc, test_missing_backend);
  tcase_add_test(tc, test_syntax_error);
  tcase_add_test(tc, test_long_line);
  tcase_add_test(tc, test_nul_byte);
  tcase_add_test(tc, test_missing_file);
  tcase_add_test(tc, test_backend_chain);
  tcase_add_test(tc, test_config_not_a_regular_file);
  tcase_add_test(tc, test_null_accessors);
  tcase_add_test(tc, test_sections_ranks_dirs);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run_suite(config_suite(), CK_NORMAL); }
