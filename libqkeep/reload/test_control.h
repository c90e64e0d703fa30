/*
 * reload/test_control.h: the one way tests reach into the core's behaviour, as SQLite's
 * sqlite3_test_control(op, ...): fault injection and switches that no engine should touch.
 * Private: not installed, and not exported from libqkeep.so (hidden like every symbol outside
 * the qkeep_ API); the suites link the core statically (libqkeep_core.la) and include it through
 * private.h. In the reload layer, the highest its ops reach (reload, and plugin and model below).
 */
#ifndef QKEEP_TEST_CONTROL_H
#define QKEEP_TEST_CONTROL_H

#include "reload/reload.h"

/* The ops, each with the exact types of its arguments (they are read with va_arg: cast them). */
enum qkeep_testctrl {
  /*
   * (qkeep_model *model, long layer, int code): every later reload of `model` (a checkpoint,
   * buffers or a sync's bucket) fails with `code` (a QKEEP_E_* code) when it reaches layer
   * index `layer`, before touching it, as a failed read would; the rollback that follows runs
   * without the fault. layer -1 disarms it. QKEEP_E_INVAL for a NULL model, a layer below -1
   * or a code that is not negative.
   */
  QKEEP_TESTCTRL_RELOAD_FAULT = 1,
  /*
   * (size_t bytes): a reload reads W1's kept scale tensors for validation on up to four threads
   * once they add up to `bytes`; 0 puts back the default, 256 KiB. Process-wide. Tests lower
   * it to reach the threaded path with small models.
   */
  QKEEP_TESTCTRL_THREADED_SCALE_BYTES = 2,
  /*
   * (int on): plugins opened from now on stay mapped after qkeep_plugin_close (RTLD_NODELETE),
   * so that a leak report from a plugin's static constructors (valgrind, ASan) keeps its
   * symbols. Process-wide; plugins already open keep how they were opened.
   */
  QKEEP_TESTCTRL_PLUGIN_NODELETE = 3,
};

/* Runs one op: 0, or QKEEP_E_INVAL (with the detail in qkeep_errmsg) for an unknown op or a bad
 * argument. Like every call on a model, one that takes a model runs while no other call on it
 * does; the process-wide ones may run at any time. */
int qkeep__test_control(int op, ...);

#endif
