/*
 * plugin/plugin.h: backend plugins (plugin/plugin.c: dlopen, the ABI handshake, probes, keys)
 * and the host table handed to them (plugin/host.c: logging, errors and the core's rules).
 * Uses base, format (the config) and param (the rules the host table exposes).
 */
#ifndef QKEEP_PLUGIN_H
#define QKEEP_PLUGIN_H

#include "format/conf.h"
#include "param/param.h"

struct qkeep_plugin {
  char *path;
  void *handle; /* dlopen */
  const struct qkeep_backend *be;
  bool probed;  /* the chain probes a plugin once, however many models use it */
  int probe_rc; /* the first probe's result */
  char probe_msg[512];
};

/* The plugin's probe result, probing it on first use (a failure is logged once, as a warning). */
int plugin_probe_once(qkeep_plugin *plugin, const char **msg);

/* Trust in code the core dlopens: plugins and libnccl take the same checks (README, "Environment"). */
/* Whether the process runs set-id (AT_SECURE): library paths from the environment are then
 * ignored, as ld.so ignores LD_LIBRARY_PATH. */
bool environment_untrusted(void);
/* 0 when the code at path may be loaded, checked as ssh checks a key: the file the path resolves
 * to (realpath), every directory above it up to /, and, when path is a symbolic link, every
 * directory above the link, are owned by root or the caller and writable by nobody else (no group
 * or other write bit; a directory may have them with the sticky bit, as /tmp). Otherwise
 * QKEEP_E_PLUGIN naming the path, `what` it is ("plugin"), the offending file or directory and why. */
int check_trusted(const char *path, const char *what);
/* Plugins opened from now on stay mapped after their close (RTLD_NODELETE): a switch of
 * qkeep__test_control (reload/test_control.h) alone. */
void plugin_set_nodelete(bool on);

/* The host table handed to every backend. */
const struct qkeep_host *host_table(void);

#endif
