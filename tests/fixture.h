/*
 * fixture.h: the Check fixture the loading suites share (check_load, check_schemes,
 * check_reload): a fresh directory and the reference backend per test, and loading a
 * checkpoint into a new model with the failure's detail in the assertion.
 */
#ifndef QKEEP_FIXTURE_H
#define QKEEP_FIXTURE_H

#include <check.h>
#include <stdlib.h>

#include "checkutil.h"
#include "qkeep.h"
#include "testutil.h"

static char *dir;            /* the test's own directory under tests/tmp */
static qkeep_plugin *plugin; /* the reference backend */
static const char *fixture_name = "suite";

static inline void setup(void) {
  dir = tu_tmpdir(fixture_name);
  ck_assert_ptr_nonnull(dir);
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &plugin) == 0, "%s", qkeep_errmsg());
}

static inline void teardown(void) {
  qkeep_plugin_close(plugin);
  tu_rmtree(dir);
  free(dir);
}

/* A new model on the reference backend holding the checkpoint at path. */
static inline qkeep_model *load(const char *path) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

#endif
