/* cli.h: pieces of the qkeep command shared between its files. */
#ifndef QKEEP_CLI_H
#define QKEEP_CLI_H

#include <stdbool.h>
#include <stdio.h>

#include "qkeep.h"

/* Prints a census as an aligned table, or one JSON object, to out. */
void report_census(FILE *out, const char *checkpoint, const char *backend, size_t layers,
                   const struct qkeep_census *c, const struct qkeep_digest *d, bool json);
/* Writes s as a JSON string literal (with quotes). */
void json_string(FILE *out, const char *s);
/* "1.5 MiB" style size into buf. */
const char *human_bytes(double bytes, char *buf, size_t len);

#endif
