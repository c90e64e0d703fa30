/*
 * host.c: the table of core services every backend receives at init. It
 * points at the same functions engines call (the rules, the readers), so a
 * backend needs no link against libqkeep.
 */
#include <stdarg.h>

#include "plugin/plugin.h"

static void host_log(enum qkeep_log_level level, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  log_msg_v(level, fmt, ap);
  va_end(ap);
}

static int host_set_error(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_error_v(code, fmt, ap);
  va_end(ap);
  return code;
}

/* A live param or a buffer (buffers are always live: kernels read them). */
static int host_get_live(const qkeep_layer *layer, const char *name, struct qkeep_view *out) {
  const struct name_entry *e = layer && name && out ? layer_find_name(layer, name) : NULL;
  if (e && e->buffer) {
    tensor_to_view(&e->buffer->view, QKEEP_PARAM_LIVE, out);
    return 0;
  }
  if (!e || e->param->state != QKEEP_PARAM_LIVE)
    return set_error(QKEEP_E_NOTFOUND, "%s has no live param or buffer '%s'%s",
                     layer ? layer->name : "(null)", name ? name : "(null)",
                     e ? " (it is retired or released)" : "");
  tensor_to_view(&e->param->view, e->param->state, out);
  return 0;
}

static void *host_get_state(const qkeep_layer *layer) { return layer->state; }
static void host_set_state(qkeep_layer *layer, void *state) { layer->state = state; }

static const struct qkeep_host host = {
    .size = sizeof(struct qkeep_host),
    .abi_major = QKEEP_BACKEND_ABI_MAJOR,
    .abi_minor = QKEEP_BACKEND_ABI_MINOR,
    .version = PACKAGE_VERSION,
    .log = host_log,
    .set_error = host_set_error,
    .layer_info = qkeep_layer_get_info,
    .view = qkeep_view_of,
    .get_live = host_get_live,
    .kernel_params = qkeep_kernel_params,
    .get_state = host_get_state,
    .set_state = host_set_state,
    .tensor_new = qkeep_tensor_new,
    .tensor_data = qkeep_tensor_data,
    .tensor_free = qkeep_tensor_free,
    .replace = qkeep_replace,
    .replace_in_place = qkeep_replace_in_place,
    .move = qkeep_move,
    .retire = qkeep_retire,
    .release = qkeep_release,
    .add_buffer = qkeep_add_buffer,
    .tensor_new_unfilled = tensor_new_unfilled,
};

const struct qkeep_host *host_table(void) { return &host; }
