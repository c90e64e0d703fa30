/*
 * error.c: error codes, the per-thread error detail, and the log sink.
 *
 * The detail lives in thread-local storage, like dlerror(): every public
 * function that fails leaves its "which file, tensor, layer" message there,
 * and the library never prints it itself.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "base/base.h"

#define ERRMSG_MAX 2048

static _Thread_local char errmsg[ERRMSG_MAX];
static _Thread_local unsigned long errmsg_generation; /* how many times this thread set a detail */

static void (*log_fn)(void *user, enum qkeep_log_level level, const char *msg);
static void *log_user;
static enum qkeep_log_level log_level = QKEEP_LOG_INFO; /* lines above it are dropped unformatted */

const char *qkeep_strerror(int code) {
  switch (code) {
  case QKEEP_OK: return "success";
  case QKEEP_E_INVAL: return "invalid argument";
  case QKEEP_E_NOMEM: return "out of memory";
  case QKEEP_E_IO: return "input/output error";
  case QKEEP_E_FORMAT: return "malformed file";
  case QKEEP_E_NOTFOUND: return "not found";
  case QKEEP_E_EXISTS: return "name already taken";
  case QKEEP_E_ABI: return "plugin ABI mismatch";
  case QKEEP_E_PLUGIN: return "plugin failed to load";
  case QKEEP_E_NODEV: return "device not present";
  case QKEEP_E_UNSUPPORTED: return "unsupported";
  case QKEEP_E_DEVICE: return "device error";
  case QKEEP_E_RULE: return "lifecycle rule violated";
  case QKEEP_E_CONFIG: return "configuration error";
  case QKEEP_E_STATE: return "invalid state";
  case QKEEP_E_PERMISSION: return "permission denied";
  case QKEEP_E_READONLY: return "read-only file system";
  case QKEEP_E_NOSPACE: return "no space left on device";
  case QKEEP_E_INTERRUPTED: return "interrupted";
  default: return "unknown error";
  }
}

const char *qkeep_errmsg(void) { return errmsg; }

int error_from_errno(int err) {
  switch (err) {
  case ENOENT:
  case ENOTDIR: return QKEEP_E_NOTFOUND;
  case EACCES:
  case EPERM: return QKEEP_E_PERMISSION;
  case EROFS: return QKEEP_E_READONLY;
  case ENOSPC:
  case EDQUOT: return QKEEP_E_NOSPACE;
  case EEXIST:
  case ENOTEMPTY: return QKEEP_E_EXISTS;
  case ENOMEM: return QKEEP_E_NOMEM;
  default: return QKEEP_E_IO;
  }
}

unsigned long error_generation(void) { return errmsg_generation; }

int set_error_v(int code, const char *fmt, va_list ap) {
  errmsg_generation++;
  vsnprintf(errmsg, sizeof errmsg, fmt, ap);
  return code;
}

int set_error(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_error_v(code, fmt, ap);
  va_end(ap);
  return code;
}

int add_error_context(int code, const char *fmt, ...) {
  char prefix[512], old[ERRMSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  memcpy(old, errmsg, sizeof old);
  errmsg_generation++;
  /* "prefix: detail", a detail longer than the buffer cut: the start carries the context that
   * matters. (Spelled out, not snprintf: gcc at -O1 warns that the cut may happen.) */
  const char *detail = old[0] ? old : qkeep_strerror(code);
  size_t at = strlen(prefix), n = strlen(detail); /* the prefix fits: 512 < ERRMSG_MAX - 2 */
  memcpy(errmsg, prefix, at);
  memcpy(errmsg + at, ": ", 2);
  at += 2;
  n = n < sizeof errmsg - 1 - at ? n : sizeof errmsg - 1 - at;
  memcpy(errmsg + at, detail, n);
  errmsg[at + n] = 0;
  return code;
}

void qkeep_set_logger(void (*fn)(void *user, enum qkeep_log_level level, const char *msg), void *user) {
  log_fn = fn;
  log_user = user;
}

void qkeep_set_log_level(enum qkeep_log_level level) { log_level = level; }

bool log_enabled(enum qkeep_log_level level) { return log_fn && level <= log_level; }

void log_msg_v(enum qkeep_log_level level, const char *fmt, va_list ap) {
  char line[1024];
  if (!log_enabled(level))
    return;
  vsnprintf(line, sizeof line, fmt, ap);
  log_fn(log_user, level, line);
}

void log_msg(enum qkeep_log_level level, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  log_msg_v(level, fmt, ap);
  va_end(ap);
}
