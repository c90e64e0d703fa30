/* cli.h: pieces of the qkeep command shared between its files. */
#ifndef QKEEP_CLI_H
#define QKEEP_CLI_H

#include <stdbool.h>
#include <stdio.h>

#include "qkeep/qkeep.h"

/* The parsed command line. values[i] belongs to the i-th value option of main.c. */
struct options {
  const char *config_path;
  bool json;
  bool debug; /* --debug: the library's debug lines on stderr */
  bool help;
  const char *command;
  const char *args[8];
  int n_args;
  const char *values[8];
  unsigned flags;
};

/* The value of --name, or NULL. */
const char *option_value(const struct options *o, const char *name);
/*
 * --name's value as a whole decimal integer in [min, max] or a finite float >= min (NULL text:
 * *out untouched). 0, or 2 after printing "qkeep: COMMAND: --name VALUE: why" (a usage error): no
 * option value is ever replaced by a default behind the user's back.
 */
int option_int(const struct options *o, const char *name, long long min, long long max, long long *out);
int option_float(const struct options *o, const char *name, double min, double *out);
/* Whether the flag --name was given. */
bool option_flag(const struct options *o, const char *name);
/* Loads the config: -c, $QKEEP_CONFIG, the build tree's (a qkeep run from its build tree), then the
 * installed default; never the current directory's. */
int load_config(const struct options *o, qkeep_config **cfg);
/* The config's backend chain, opened and configured (qkeep_plugins_open_config). */
struct chain {
  qkeep_plugin **plugins;
  size_t n;
};
int open_chain(const qkeep_config *cfg, struct chain *out);
void close_chain(struct chain *c);
/* A new model on a chain of n plugins with the config's fusion map ([model] fuse) applied. */
int new_model(const qkeep_config *cfg, qkeep_plugin *const *plugins, size_t n, qkeep_model **out);
/* Monotonic seconds, for the times the commands print. */
double cli_now(void);
/* Prints "qkeep: <error>: <detail>" to stderr; returns 1. */
int fail(int code);

int cmd_run(const struct options *o);
int cmd_quantize(const struct options *o);
int cmd_reload(const struct options *o);
extern const char usage_run[], usage_quantize[], usage_reload[];

/*
 * Prints a census as an aligned table followed by the backends and each layer's owner, or
 * as one JSON object (no newline) with "backends" and "owners" members, to out.
 */
void report_census(FILE *out, const char *checkpoint, const qkeep_model *model, const struct qkeep_census *c,
                   const struct qkeep_digest *d, bool json);
/* The same as two JSON members, "backends":[...],"owners":[...] (no braces around them). */
void owners_json(FILE *out, const qkeep_model *model);
/* The chain's links with the layers each owns, then every layer with its owner, as a table. */
void report_owners(FILE *out, const qkeep_model *model);
/* Writes s as a JSON string literal (with quotes). */
void print_json_string(FILE *out, const char *s);
/* "1.5 MiB" style size into buf. */
const char *human_bytes(double bytes, char *buf, size_t len);

#endif
