/*
 * fixture.h: the Check fixture the loading suites share (check_load, check_schemes,
 * check_reload): a fresh directory and the reference backend per test, and loading a
 * checkpoint into a new model with the failure's detail in the assertion. A suite that
 * sets fixture_backend runs load() on the chain "fixture_backend, reference" (the
 * backend takes the layers it accepts, the reference the rest); fixture_backends()
 * lists the backends this build has whose probe finds their device.
 */
#ifndef QKEEP_FIXTURE_H
#define QKEEP_FIXTURE_H

#include <check.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "qkeep/qkeep.h"
#include "reload/test_control.h"
#include "testutil.h"

static char *dir;            /* the test's own directory under tests/tmp */
static qkeep_plugin *plugin; /* the reference backend */
static const char *fixture_name = "suite";
static const char *fixture_backend;  /* NULL or "reference": the reference alone */
static qkeep_plugin *fixture_plugin; /* fixture_backend's plugin, while a test runs */
static char *fixture_backend_dir;    /* searched after QKEEP_PLUGIN_PATH (NULL: none) */

static inline void setup(void) {
  dir = tu_tmpdir(fixture_name);
  ck_assert_ptr_nonnull(dir);
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &plugin) == 0, "%s", qkeep_errmsg());
  fixture_plugin = NULL;
  if (fixture_backend && strcmp(fixture_backend, "reference") != 0)
    ck_assert_msg(qkeep_plugin_open(fixture_backend, fixture_backend_dir, &fixture_plugin) == 0, "%s",
                  qkeep_errmsg());
}

static inline void teardown(void) {
  qkeep_plugin_close(fixture_plugin);
  qkeep_plugin_close(plugin);
  tu_rmtree(dir);
  free(dir);
}

/* A new model on the fixture's chain (the reference backend alone by default) holding the checkpoint. */
static inline qkeep_model *load(const char *path) {
  qkeep_model *m;
  qkeep_plugin *chain[2] = {fixture_plugin, plugin};
  if (fixture_plugin)
    ck_assert_int_eq(qkeep_model_new_chain(chain, 2, &m), 0);
  else
    ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

/* Arms (layer >= 0) or disarms (layer -1) a fault at a layer of m's reloads (test_control.h). */
static inline void inject_fault(qkeep_model *m, long layer, int code) {
  ck_assert_msg(qkeep__test_control(QKEEP_TESTCTRL_RELOAD_FAULT, m, layer, code) == 0, "%s", qkeep_errmsg());
}

/* Whether this build has the backend and its probe finds the device (else why not, on stderr). */
static inline bool fixture_backend_usable(const char *name) {
  qkeep_plugin *p;
  char why[256] = "";
  if (qkeep_plugin_open(name, fixture_backend_dir, &p) != 0) {
    fprintf(stderr, "%s: skipped, not built here (%s)\n", name, qkeep_errmsg());
    return false;
  }
  int rc = qkeep_plugin_probe(p, why, sizeof why);
  qkeep_plugin_close(p);
  if (rc)
    fprintf(stderr, "%s: skipped, its probe says: %s\n", name, why);
  return rc == 0;
}

#endif
