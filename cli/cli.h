/* cli.h: pieces of the qkeep command shared between its files. */
#ifndef QKEEP_CLI_H
#define QKEEP_CLI_H

#include <stdbool.h>
#include <stdio.h>

#include "qkeep/qkeep.h"

#define MAX_OPTIONS 32 /* entries of main.c's option table */

/* The parsed command line. values[i] and the bit 1 << i of flags belong to the i-th entry of main.c's
 * option table. */
struct options {
  const char *config_path;
  bool json;
  bool debug; /* --debug: the library's debug lines on stderr */
  bool help;
  const char *command;
  const char **args; /* the positional arguments after the command (into argv) */
  int n_args;
  const char *values[MAX_OPTIONS];
  unsigned long long flags;
};

/* The value of --name, or NULL. */
const char *option_value(const struct options *o, const char *name);
/*
 * --name's value as a whole decimal integer in [min, max] or a finite float >= min (NULL text:
 * *out untouched). 0, or 2 after reporting "qkeep: COMMAND: --name VALUE: why" (a usage error): no
 * option value is ever replaced by a default behind the user's back.
 */
int option_int(const struct options *o, const char *name, long long min, long long max, long long *out);
int option_float(const struct options *o, const char *name, double min, double *out);
/* Whether the flag --name was given. */
bool option_flag(const struct options *o, const char *name);
/* Loads the config: -c, $QKEEP_CONFIG, the build tree's (a qkeep run from its build tree), then the
 * installed default; never the current directory's. */
int load_config(const struct options *o, qkeep_config **cfg);
/* The config qkeep reads when -c is not given, and where that choice comes from (static strings). */
const char *default_config_path(const char **source);
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

/*
 * Failures, printed once. report_failure prints "qkeep: MESSAGE" on stderr and, with --json and no
 * document printed yet, the one document {"ok": false, "error": {"code": CODE, "message": MESSAGE}}
 * on stdout; it returns status (the exit status: 1 failure, 2 usage). fail() does that for a library
 * error (its code's name, qkeep_strerror and qkeep_errmsg), with status 1.
 */
int report_failure(const struct options *o, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int fail(const struct options *o, int code);
/* The stable name of a QKEEP_E_* code in JSON errors ("not_found", "permission_denied", ...). */
const char *error_code_name(int code);
/*
 * Starts the one JSON document of a command on out: {"ok":true, or {"ok":false,"error":{...} for a
 * command that found what it checks failing (code and message say what). Members follow, each
 * written with a leading comma; the caller closes the brace.
 */
void json_begin(FILE *out, bool ok, const char *code, const char *message);
/* A double as JSON: %.6g, or null when it is NaN or infinite. */
void print_json_number(FILE *out, double v);

/* --quantize S and its options (group, asym, static-input, asym-input, kv-scales, activation-amax,
 * threads) of a command that loads, into *q: 0; 1 when --quantize is not given (then none of its
 * options may be); 2 after a usage error (an option that does not apply to S). */
int online_options(const struct options *o, struct qkeep_quantize_options *q);

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
/* The census's JSON members (no braces around them), each after a comma unless first. */
void census_members_json(FILE *out, bool first, const char *checkpoint, const qkeep_model *model,
                         const struct qkeep_census *c, const struct qkeep_digest *d);
/* The same as two JSON members, "backends":[...],"owners":[...] (no braces around them). */
void owners_json(FILE *out, const qkeep_model *model);
/* The chain's links with the layers each owns, then every layer with its owner, as a table. */
void report_owners(FILE *out, const qkeep_model *model);
/*
 * Writes s as a JSON string literal (with quotes). Bytes that are not valid UTF-8 (a path's raw
 * bytes, say) are written as U+FFFD, one per byte, so the document is always valid UTF-8.
 */
void print_json_string(FILE *out, const char *s);
/* "1.5 MiB" style size into buf. */
const char *human_bytes(double bytes, char *buf, size_t len);

#endif
