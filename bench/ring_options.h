/*
 * ring_options.h: the device staging ring's shape from a bench's QKEEP_BENCH_RINGS field
 * ("SLOTS:PIECE:READERS:FENCES", struct qkeep_load_options), for bench_reload and bench_load.
 * Header-only.
 */
#ifndef QKEEP_BENCH_RING_OPTIONS_H
#define QKEEP_BENCH_RING_OPTIONS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qkeep/qkeep.h"

/* The stream's shape from one "SLOTS:PIECE:READERS:FENCES" field of QKEEP_BENCH_RINGS (NULL: the
 * defaults), and its label. The model checks the values (qkeep_model_set_load_options). */
static struct qkeep_load_options ring_options(const char *spec, char *label, size_t label_len) {
  struct qkeep_load_options o = {.size = sizeof o};
  const char *p = spec;
  for (int i = 0; i < 4 && p; i++) {
    size_t n = strcspn(p, ":,");
    char v[32] = "";
    if (n && n < sizeof v)
      memcpy(v, p, n), v[n] = 0;
    if (*v && i == 0)
      o.stream_slots = atoi(v);
    else if (*v && i == 1)
      o.stream_piece = (size_t)strtoull(v, NULL, 10);
    else if (*v && i == 2)
      o.stream_readers = atoi(v);
    else if (*v && i == 3)
      o.stream_no_fences = strcmp(v, "0") == 0;
    p = p[n] == ':' ? p + n + 1 : NULL;
  }
  snprintf(label, label_len, "%.*s", spec ? (int)strcspn(spec, ",") : 7, spec ? spec : "default");
  return o;
}

#endif
