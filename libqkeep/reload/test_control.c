/*
 * reload/test_control.c: qkeep__test_control, the tests' one way into the core's switches
 * (test_control.h). Each op sets state that its own layer keeps and reads.
 */
#include <stdarg.h>

#include "reload/test_control.h"

static int reload_fault(qkeep_model *model, long layer, int code) {
  if (!model || layer < -1 || (layer >= 0 && code >= 0))
    return set_error(QKEEP_E_INVAL, "qkeep__test_control(RELOAD_FAULT): model %p, layer %ld, code %d",
                     (void *)model, layer, code);
  model->fault = (struct reload_fault){.layer = layer, .code = layer < 0 ? 0 : code};
  return 0;
}

int qkeep__test_control(int op, ...) {
  va_list ap;
  va_start(ap, op);
  int rc = 0;
  switch (op) {
  case QKEEP_TESTCTRL_RELOAD_FAULT: {
    qkeep_model *model = va_arg(ap, qkeep_model *);
    long layer = va_arg(ap, long);
    int code = va_arg(ap, int);
    rc = reload_fault(model, layer, code);
    break;
  }
  case QKEEP_TESTCTRL_THREADED_SCALE_BYTES: reload_set_threaded_scale_bytes(va_arg(ap, size_t)); break;
  case QKEEP_TESTCTRL_PLUGIN_NODELETE: plugin_set_nodelete(va_arg(ap, int) != 0); break;
  default: rc = set_error(QKEEP_E_INVAL, "qkeep__test_control: unknown op %d", op);
  }
  va_end(ap);
  return rc;
}
