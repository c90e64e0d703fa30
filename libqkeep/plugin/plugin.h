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

/* The host table handed to every backend. */
const struct qkeep_host *host_table(void);

#endif
