/*
 * format/conf.h: the INI configuration (format/config.c): the backend chain, the model's
 * checkpoint and parallel place, each backend's keys. Uses base and the fusion rules.
 */
#ifndef QKEEP_CONF_H
#define QKEEP_CONF_H

#include "base/base.h"

/* ---- config (config.c) ------------------------------------------------------------ */

struct config_option {
  char *key;
  char *value;
  int line;
};

struct qkeep_config {
  char *path;
  char **backends; /* [qkeep] backend: the chain, in order (at least one name) */
  size_t n_backends;
  const char *backend; /* backends[0] */
  int backend_line;
  char *plugin_dir;
  char *checkpoint;
  char *reload_checkpoint;
  char *fuse;
  struct qkeep_parallel parallel; /* [model] tp_size, tp_rank, ep_size, ep_rank */
  int parallel_line[4];
  /* [model] quantize = SCHEME and its quantize_* options (online quantization; scheme NULL: none) */
  char *quantize_scheme;
  struct qkeep_quantize_options quantize;
  int quantize_line[8];
  /* [backend.NAME] sections: every key, in file order */
  struct config_backend_section {
    char *name;
    int line; /* of its first header */
    struct config_option *options;
    size_t n_options, cap_options;
  } * sections;
  size_t n_sections, cap_sections;
};

/* The options of [backend.NAME], or NULL when the file has no such section. */
const struct config_backend_section *config_section(const qkeep_config *cfg, const char *backend);

#endif
