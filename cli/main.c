/*
 * main.c: the qkeep command: its options, help, and the small commands.
 *
 *   qkeep [OPTIONS] COMMAND [ARGS] [OPTIONS]
 *     version            the library version, plugin ABI, plugin directory and default config
 *     plugins            the backends found, their ABI and probe result
 *     census [CKPT]      load CKPT (default: the config's checkpoint) and count it against the rules
 *     run [CKPT]         load, census, forward check of every layer against the reference
 *     reload [W0 W1]     reload in place and compare with a cold start
 *     quantize IN OUT    write a quantized checkpoint
 *     help [COMMAND]     the help of qkeep or of one command
 *
 * Options parse one way everywhere (getopt_long's forms): --opt=VALUE, --opt VALUE, -oVALUE and
 * -o VALUE for every option with a value; options go before or after the command; "--" ends them.
 * An option of another command, or an argument more than the command takes, is a usage error.
 *
 * Exit status: 0 success, 1 failure (or rule violations found), 2 usage, 128+N killed by signal N.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "qkeep_dirs.h" /* QKEEP_PKGDATADIR, QKEEP_BUILD_DIR: written by make */

/* Commands, as bits of the option table's "applies to" masks. */
enum {
  C_VERSION = 1 << 0,
  C_PLUGINS = 1 << 1,
  C_CENSUS = 1 << 2,
  C_RUN = 1 << 3,
  C_RELOAD = 1 << 4,
  C_QUANTIZE = 1 << 5,
  C_HELP = 1 << 6,
  C_ALL = 0x7f,
  C_ONLINE = C_RUN | C_CENSUS | C_RELOAD, /* the commands that load: --quantize and its options */
};

/* --quantize S and its options for this run (cmd_quantize.c reads them); set: given. */
static struct qkeep_quantize_options cli_quantize;
static bool cli_quantize_set;

/* Every option: long name, short letter (0: none), whether it takes a value, the commands it
 * applies to, the value's name and a line of help. The order is the help's. */
static const struct option_def {
  const char *name;
  char letter;
  bool value;
  unsigned commands;
  const char *metavar, *help;
} option_defs[] = {
    {"config", 'c', true, C_ALL, "FILE", "the INI config (default: see qkeep --version)"},
    {"json", 0, false, C_ALL, NULL, "one JSON document on stdout, on success and on failure"},
    {"debug", 0, false, C_ALL, NULL, "also print the library's debug lines on stderr"},
    {"help", 'h', false, C_ALL, NULL, "this help, or a command's (qkeep help COMMAND)"},
    {"version", 'V', false, C_ALL, NULL, "version, plugin ABI, plugin directory, default config"},
    {"verbose", 0, false, C_PLUGINS, NULL, "each backend's description and declared keys"},
    {"rows", 'r', true, C_RUN, "M", "rows of random activations per check (default 4)"},
    {"tolerance", 'T', true, C_RUN, "T", "largest relative error allowed (default 0.05)"},
    {"seed", 'S', true, C_RUN, "S", "seed of the random activations (default 1)"},
    {"scheme", 's', true, C_QUANTIZE, "S",
     "modelopt-nvfp4, ct-nvfp4, mxfp4, w8a8-int8, gptq-int4, awq-int4, ct-int4"},
    {"quantize", 0, true, C_ONLINE, "S",
     "quantize an unquantized checkpoint on load into S (qkeep quantize's options apply)"},
    {"group", 'g', true, C_QUANTIZE | C_ONLINE, "G", "int4 group size (default 128)"},
    {"asym", 0, false, C_QUANTIZE | C_ONLINE, NULL, "int4 with zero points (gptq-int4, awq-int4, ct-int4)"},
    {"static-input", 0, false, C_QUANTIZE | C_ONLINE, NULL, "w8a8-int8: static per-tensor input scales"},
    {"asym-input", 0, false, C_QUANTIZE | C_ONLINE, NULL, "w8a8-int8: activations with a zero point"},
    {"kv-scales", 0, false, C_QUANTIZE | C_ONLINE, NULL,
     "write FP8 k_scale / v_scale for each attention block"},
    {"activation-amax", 'a', true, C_QUANTIZE | C_ONLINE, "A",
     "|x| bound for static input scales (default 1)"},
    {"shard-bytes", 'b', true, C_QUANTIZE, "N", "shard the output at N bytes"},
    {"threads", 't', true, C_QUANTIZE | C_ONLINE, "N", "threads (default: every online core)"},
    {"force", 'f', false, C_QUANTIZE, NULL, "replace an existing OUT (only once the new one is whole)"},
};
#define N_OPTION_DEFS (sizeof option_defs / sizeof option_defs[0])
_Static_assert(N_OPTION_DEFS <= MAX_OPTIONS, "struct options holds MAX_OPTIONS values");

static int cmd_version(const struct options *o);
static int cmd_plugins(const struct options *o);
static int cmd_census(const struct options *o);
static int cmd_help(const struct options *o);

extern const char usage_version[], usage_plugins[], usage_census[], usage_help[];

/* Every command: name, its bit, how many positional arguments it takes, its one-line synopsis for
 * the main help, and its help. */
static const struct command_def {
  const char *name;
  unsigned bit;
  int max_args;
  int (*run)(const struct options *);
  const char *synopsis, *summary, *usage;
} commands[] = {
    {"run", C_RUN, 1, cmd_run, "run [CKPT]",
     "the main job: load, census, check every layer against the reference backend", usage_run},
    {"census", C_CENSUS, 1, cmd_census, "census [CKPT]", "load a checkpoint and count it against the rules",
     usage_census},
    {"reload", C_RELOAD, 2, cmd_reload, "reload [W0 W1]",
     "cold start W0, reload W1 in place, compare with a cold start on W1", usage_reload},
    {"quantize", C_QUANTIZE, 2, cmd_quantize, "quantize IN OUT --scheme S",
     "write a quantized checkpoint directory from an unquantized one", usage_quantize},
    {"plugins", C_PLUGINS, 0, cmd_plugins, "plugins", "the backends found, their ABI and device probe",
     usage_plugins},
    {"version", C_VERSION, 0, cmd_version, "version", "version, plugin ABI, plugin directory, config",
     usage_version},
    {"help", C_HELP, 1, cmd_help, "help [COMMAND]", "this help, or one command's", usage_help},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

const char usage_version[] = "usage: qkeep version [--json]\n"
                             "\n"
                             "Prints the library version, the backend (plugin) ABI it speaks, the directory\n"
                             "plugins are installed in, and the config qkeep reads when -c is not given.\n"
                             "qkeep --version prints the same.\n";
const char usage_plugins[] =
    "usage: qkeep [-c CONFIG] plugins [--verbose] [--json]\n"
    "\n"
    "Lists every backend-*.so in $QKEEP_PLUGIN_PATH, the config's plugin_dir and the install\n"
    "directory, with its ABI version and probe result (is its device present?). --verbose adds\n"
    "each backend's description and the [backend.NAME] keys it declares (type, values, default).\n";
const char usage_census[] =
    "usage: qkeep [-c CONFIG] census [CKPT] [--json]\n"
    "\n"
    "Loads CKPT (default: [model] checkpoint of the config) with the configured backend chain,\n"
    "runs its post-load pass, and prints the census: loader params, missing, C1 and C2\n"
    "violations, aliases, retired, released, kept bytes, and the digest. CKPT is a .safetensors\n"
    "file, a checkpoint directory (one file or shards with model.safetensors.index.json), or a\n"
    "Hugging Face hub cache repository (models--ORG--NAME, read at refs/main).\n"
    "Exits 1 when a rule is violated (missing, C1 or C2 non-zero).\n"
    "\n"
    "--quantize S loads an unquantized CKPT (BF16, F16, F32) quantized on load into scheme S, with\n"
    "qkeep quantize's options (--group, --asym, --static-input, --asym-input, --kv-scales,\n"
    "--activation-amax, --threads): the same model as qkeep quantize then a load; the census then\n"
    "counts the unquantized tensors as quantized on load (0 bytes kept). [model] quantize = S in\n"
    "the config does the same.\n";
const char usage_help[] = "usage: qkeep help [COMMAND]\n"
                          "\n"
                          "Prints the help of qkeep (every command, option, environment variable and\n"
                          "exit status), or the help of one command.\n";

/* Warnings and errors; with --debug (user non-NULL), debug lines too. */
static void log_to_stderr(void *user, enum qkeep_log_level level, const char *msg) {
  static const char *names[] = {"error", "warning", "info", "debug"};
  if (level <= QKEEP_LOG_WARN || (user && level == QKEEP_LOG_DEBUG))
    fprintf(stderr, "qkeep: %s: %s\n", names[level], msg);
}

double cli_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- failures and the JSON document ------------------------------------------------- */

static bool document_printed; /* stdout has its one JSON document */

void json_begin(FILE *out, bool ok, const char *code, const char *message) {
  document_printed = true;
  fprintf(out, "{\"ok\":%s", ok ? "true" : "false");
  if (ok)
    return;
  fprintf(out, ",\"error\":{\"code\":");
  print_json_string(out, code);
  fprintf(out, ",\"message\":");
  print_json_string(out, message);
  fputc('}', out);
}

void print_json_number(FILE *out, double v) {
  if (isfinite(v))
    fprintf(out, "%.6g", v);
  else
    fputs("null", out);
}

const char *error_code_name(int code) {
  switch (code) {
  case QKEEP_E_INVAL: return "invalid_argument";
  case QKEEP_E_NOMEM: return "out_of_memory";
  case QKEEP_E_IO: return "io_error";
  case QKEEP_E_FORMAT: return "malformed_file";
  case QKEEP_E_NOTFOUND: return "not_found";
  case QKEEP_E_EXISTS: return "already_exists";
  case QKEEP_E_ABI: return "abi_mismatch";
  case QKEEP_E_PLUGIN: return "plugin_failed";
  case QKEEP_E_NODEV: return "no_device";
  case QKEEP_E_UNSUPPORTED: return "unsupported";
  case QKEEP_E_DEVICE: return "device_error";
  case QKEEP_E_RULE: return "rule_violated";
  case QKEEP_E_CONFIG: return "config_error";
  case QKEEP_E_STATE: return "invalid_state";
  case QKEEP_E_PERMISSION: return "permission_denied";
  case QKEEP_E_READONLY: return "read_only_file_system";
  case QKEEP_E_NOSPACE: return "no_space";
  case QKEEP_E_INTERRUPTED: return "interrupted";
  default: return "error";
  }
}

static int report_failure_v(bool json, int status, const char *code, const char *fmt, va_list ap) {
  fflush(stdout); /* what was printed before the error comes first */
  char *message = NULL;
  if (vasprintf(&message, fmt, ap) < 0)
    message = NULL;
  fprintf(stderr, "qkeep: %s\n", message ? message : fmt);
  if (json && !document_printed) {
    json_begin(stdout, false, code, message ? message : fmt);
    fputs("}\n", stdout);
    fflush(stdout);
  }
  free(message);
  return status;
}

int report_failure(const struct options *o, int status, const char *code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  report_failure_v(o->json, status, code, fmt, ap);
  va_end(ap);
  return status;
}

int fail(const struct options *o, int code) {
  const char *detail = qkeep_errmsg();
  return report_failure(o, 1, error_code_name(code), "%s%s%s", qkeep_strerror(code), *detail ? ": " : "",
                        detail);
}

/* A usage error: the message, then the command's usage line (its first line) on stderr. */
static int usage_error(bool json, const char *usage, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int usage_error(bool json, const char *usage, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  report_failure_v(json, 2, "usage", fmt, ap);
  va_end(ap);
  const char *end = strchr(usage, '\n');
  fprintf(stderr, "%.*s\n(qkeep help%s for more)\n", end ? (int)(end - usage) : (int)strlen(usage), usage,
          strncmp(usage, "usage: qkeep [OPTIONS] COMMAND", 30) == 0 ? "" : " COMMAND");
  return 2;
}

/* ---- options ------------------------------------------------------------------------- */

static const struct command_def *find_command(const char *name) {
  for (size_t i = 0; i < N_COMMANDS; i++)
    if (strcmp(commands[i].name, name) == 0)
      return &commands[i];
  return NULL;
}

static const char usage_line[] = "usage: qkeep [OPTIONS] COMMAND [ARGS]\n";

/* Stores option d (given as `spelled`) with its value; 2 when it needs a value and has none. */
static int set_option(struct options *o, size_t d, const char *spelled, const char *value) {
  const struct option_def *def = &option_defs[d];
  if (def->value && !value)
    return usage_error(o->json, usage_line, "%s needs a value (%s)", spelled, def->metavar);
  if (!def->value && value)
    return usage_error(o->json, usage_line, "%s takes no value", spelled);
  if (def->value)
    o->values[d] = value;
  else
    o->flags |= 1ull << d;
  if (strcmp(def->name, "config") == 0)
    o->config_path = value;
  else if (strcmp(def->name, "json") == 0)
    o->json = true;
  else if (strcmp(def->name, "debug") == 0)
    o->debug = true;
  else if (strcmp(def->name, "help") == 0)
    o->help = true;
  return 0;
}

/* One argument that starts with '-' (not "-" or "--"): a long or short option, taking its value
 * from the same argument or the next (*i advances past it). */
static int parse_option(struct options *o, int argc, char **argv, int *i) {
  const char *a = argv[*i];
  if (a[1] == '-') {
    const char *eq = strchr(a, '=');
    size_t len = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
    for (size_t d = 0; d < N_OPTION_DEFS; d++) {
      if (strlen(option_defs[d].name) != len || strncmp(a + 2, option_defs[d].name, len) != 0)
        continue;
      const char *value = eq ? eq + 1 : NULL;
      if (!eq && option_defs[d].value && *i + 1 < argc)
        value = argv[++*i];
      return set_option(o, d, a, value);
    }
    return usage_error(o->json, usage_line, "unknown option '%s'", a);
  }
  for (size_t d = 0; d < N_OPTION_DEFS; d++) {
    if (!option_defs[d].letter || option_defs[d].letter != a[1])
      continue;
    const char *value = NULL;
    if (option_defs[d].value)
      value = a[2] ? a + 2 : *i + 1 < argc ? argv[++*i] : NULL;
    else if (a[2])
      return usage_error(o->json, usage_line, "'%s': -%c takes no value", a, a[1]);
    return set_option(o, d, a, value);
  }
  return usage_error(o->json, usage_line, "unknown option '%s'", a);
}

/* The command line into o; 0, or 2 after a usage error. o->args points into a new array. */
static int parse_args(int argc, char **argv, struct options *o) {
  bool options_end = false;
  for (int i = 1; i < argc && strcmp(argv[i], "--") != 0;
       i++) /* failures before --json is read are JSON too */
    o->json |= strcmp(argv[i], "--json") == 0;
  o->args = calloc((size_t)argc, sizeof *o->args);
  if (!o->args)
    return report_failure(o, 1, "out_of_memory", "out of memory");
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!options_end && strcmp(a, "--") == 0) {
      options_end = true;
    } else if (!options_end && a[0] == '-' && a[1]) {
      int rc = parse_option(o, argc, argv, &i);
      if (rc)
        return rc;
    } else if (!o->command) {
      o->command = a;
    } else {
      o->args[o->n_args++] = a;
    }
  }
  return 0;
}

/* Options of another command, and more arguments than the command takes, are usage errors. */
static int check_args(const struct options *o, const struct command_def *cmd) {
  for (size_t d = 0; d < N_OPTION_DEFS; d++) {
    bool given = option_defs[d].value ? o->values[d] != NULL : (o->flags >> d) & 1;
    if (given && !(option_defs[d].commands & cmd->bit)) {
      const char *owner = "another command";
      for (size_t c = 0; c < N_COMMANDS; c++)
        if ((option_defs[d].commands & commands[c].bit) && option_defs[d].commands != C_ALL)
          owner = commands[c].name;
      return usage_error(o->json, cmd->usage, "%s: --%s is an option of %s, not of %s", cmd->name,
                         option_defs[d].name, owner, cmd->name);
    }
  }
  if (o->n_args > cmd->max_args)
    return usage_error(o->json, cmd->usage, "%s: unexpected argument '%s' (%s takes %s)", cmd->name,
                       o->args[cmd->max_args], cmd->name,
                       cmd->max_args == 0   ? "none"
                       : cmd->max_args == 1 ? "at most one"
                                            : "at most two");
  return 0;
}

static ssize_t option_index(const char *name) {
  for (size_t d = 0; d < N_OPTION_DEFS; d++)
    if (strcmp(option_defs[d].name, name) == 0)
      return (ssize_t)d;
  return -1;
}

const char *option_value(const struct options *o, const char *name) {
  ssize_t d = option_index(name);
  return d >= 0 ? o->values[d] : NULL;
}

bool option_flag(const struct options *o, const char *name) {
  ssize_t d = option_index(name);
  return d >= 0 && ((o->flags >> d) & 1);
}

int option_int(const struct options *o, const char *name, long long min, long long max, long long *out) {
  const char *text = option_value(o, name);
  if (!text)
    return 0;
  char *end;
  errno = 0;
  long long v = strtoll(text, &end, 10);
  if (end == text || *end || errno || v < min || v > max)
    return report_failure(o, 2, "usage", "%s: --%s %s: expected a whole number from %lld to %lld", o->command,
                          name, text, min, max);
  *out = v;
  return 0;
}

int option_float(const struct options *o, const char *name, double min, double *out) {
  const char *text = option_value(o, name);
  if (!text)
    return 0;
  char *end;
  errno = 0;
  double v = strtod(text, &end);
  if (end == text || *end || errno || !isfinite(v) || v < min)
    return report_failure(o, 2, "usage", "%s: --%s %s: expected a finite number >= %g", o->command, name,
                          text, min);
  *out = v;
  return 0;
}

/* ---- help ---------------------------------------------------------------------------- */

/* "-x, --name VALUE" or "    --name VALUE" into buf. */
static const char *spell_option(const struct option_def *d, char *buf, size_t len) {
  char letter[8] = "    ";
  if (d->letter)
    snprintf(letter, sizeof letter, "-%c, ", d->letter);
  snprintf(buf, len, "%s--%s%s%s", letter, d->name, d->value ? " " : "", d->value ? d->metavar : "");
  return buf;
}

/* Every command with its options, the environment and the exit statuses. */
static void print_main_help(FILE *out) {
  char spelled[64];
  fprintf(out, "usage: qkeep [OPTIONS] COMMAND [ARGS] [OPTIONS]\n"
               "\n"
               "Loads quantized checkpoints into a backend's kernel layout without losing a loaded param.\n"
               "\ncommands:\n");
  for (size_t c = 0; c < N_COMMANDS; c++) {
    fprintf(out, "  %-28s %s\n", commands[c].synopsis, commands[c].summary);
    for (size_t d = 0; d < N_OPTION_DEFS; d++)
      if ((option_defs[d].commands & commands[c].bit) && option_defs[d].commands != C_ALL)
        fprintf(out, "      %-24s %s\n", spell_option(&option_defs[d], spelled, sizeof spelled),
                option_defs[d].help);
  }
  fprintf(out, "\noptions of every command:\n");
  for (size_t d = 0; d < N_OPTION_DEFS; d++)
    if (option_defs[d].commands == C_ALL)
      fprintf(out, "  %-28s %s\n", spell_option(&option_defs[d], spelled, sizeof spelled),
              option_defs[d].help);
  fprintf(out, "Options go before or after the command; --opt=VALUE, --opt VALUE, -oVALUE and -o VALUE are\n"
               "the same; -- ends the options (a file named --json).\n"
               "\nenvironment:\n"
               "  QKEEP_CONFIG        the config when -c is not given\n"
               "  QKEEP_PLUGIN_PATH   colon-separated directories searched for backend-NAME.so first\n"
               "  QKEEP_NCCL_LIBRARY  the libnccl the NCCL weight-sync transport loads\n"
               "(all three are ignored in a set-id process)\n"
               "\nexit status:\n"
               "  0       success\n"
               "  1       failure, or a check found what it checks failing (rule violations, tolerance)\n"
               "  2       usage error (unknown option or command, missing or extra argument, bad value)\n"
               "  128+N   killed by signal N (an interrupted quantize leaves nothing behind)\n");
}

/* A help text on stdout; with --json, as the document's "help" member. */
static int print_help(const struct options *o, const char *text) {
  if (!o->json) {
    fputs(text, stdout);
    return 0;
  }
  json_begin(stdout, true, NULL, NULL);
  printf(",\"help\":");
  print_json_string(stdout, text);
  printf("}\n");
  return 0;
}

static int cmd_help(const struct options *o) {
  if (!o->n_args) {
    char *text = NULL;
    size_t len = 0;
    FILE *out = open_memstream(&text, &len);
    if (!out)
      return fail(o, QKEEP_E_NOMEM);
    print_main_help(out);
    fclose(out);
    print_help(o, text);
    free(text);
    return 0;
  }
  const struct command_def *cmd = find_command(o->args[0]);
  if (!cmd)
    return usage_error(o->json, usage_help, "help: unknown command '%s'", o->args[0]);
  return print_help(o, cmd->usage);
}

/* ---- config and chain ---------------------------------------------------------------- */

/*
 * The build tree's default config when this qkeep is the one built there (its executable lies
 * under the build directory), or NULL. Never the current directory's: running qkeep in an
 * untrusted directory must not load its config, and with it its plugins.
 */
static const char *build_tree_config(void) {
#if defined(QKEEP_BUILD_DIR) && defined(__linux__)
  char *exe = realpath("/proc/self/exe", NULL); /* malloc'd, as long as the path is */
  size_t dir_len = strlen(QKEEP_BUILD_DIR);
  bool in_tree =
      exe && strlen(exe) > dir_len && strncmp(exe, QKEEP_BUILD_DIR, dir_len) == 0 && exe[dir_len] == '/';
  free(exe);
  if (in_tree)
    return QKEEP_BUILD_DIR "/conf/qkeep.ini";
#endif
  return NULL;
}

const char *default_config_path(const char **source) {
  const char *path = NULL;
  if (getuid() == geteuid() && getgid() == getegid()) /* not when set-id */
    path = getenv("QKEEP_CONFIG");
  if (path && *path) {
    *source = "$QKEEP_CONFIG";
    return path;
  }
  if ((path = build_tree_config())) {
    *source = "the build tree's";
    return path;
  }
  *source = "installed";
  return QKEEP_PKGDATADIR "/qkeep.ini";
}

/* The config to use: -c, $QKEEP_CONFIG, the build tree's (for a qkeep run from it), then the
 * installed default. */
int load_config(const struct options *o, qkeep_config **cfg) {
  const char *source;
  return qkeep_config_load(o->config_path ? o->config_path : default_config_path(&source), cfg);
}

int open_chain(const qkeep_config *cfg, struct chain *out) {
  *out = (struct chain){0};
  return qkeep_plugins_open_config(cfg, &out->plugins, &out->n);
}

void close_chain(struct chain *c) {
  qkeep_plugins_close(c->plugins, c->n);
  *c = (struct chain){0};
}

int new_model(const qkeep_config *cfg, qkeep_plugin *const *plugins, size_t n, qkeep_model **out) {
  int rc = qkeep_model_new_chain(plugins, n, out);
  const char *fuse = cfg ? qkeep_config_fuse(cfg) : NULL;
  if (!rc && fuse)
    rc = qkeep_model_set_fusion(*out, fuse);
  struct qkeep_parallel parallel = {.size = sizeof parallel};
  if (!rc && cfg && !(rc = qkeep_config_parallel(cfg, &parallel)))
    rc = qkeep_model_set_parallel(*out, &parallel); /* [model] tp_size, tp_rank, ep_size, ep_rank */
  /* --quantize S, else the config's [model] quantize: the load quantizes an unquantized checkpoint */
  struct qkeep_quantize_options q = {.size = sizeof q};
  if (!rc && cli_quantize_set)
    rc = qkeep_model_set_quantize(*out, &cli_quantize);
  else if (!rc && cfg && qkeep_config_quantize(cfg, &q) == 0)
    rc = qkeep_model_set_quantize(*out, &q);
  if (rc && *out) {
    qkeep_model_free(*out);
    *out = NULL;
  }
  return rc;
}

/* ---- version and plugins ------------------------------------------------------------- */

static int cmd_version(const struct options *o) {
  const char *source, *config = o->config_path ? o->config_path : default_config_path(&source);
  if (o->config_path)
    source = "-c";
  if (o->json) {
    json_begin(stdout, true, NULL, NULL);
    printf(",\"version\":\"%s\",\"backend_abi\":\"%d.%d\",\"plugin_dir\":", qkeep_version(),
           QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR);
    print_json_string(stdout, qkeep_plugin_install_dir());
    printf(",\"config\":");
    print_json_string(stdout, config);
    printf(",\"config_source\":");
    print_json_string(stdout, source);
    printf("}\n");
  } else {
    printf("qkeep %s (plugin ABI %d.%d)\nplugin dir: %s\nconfig: %s (%s)\n", qkeep_version(),
           QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR, qkeep_plugin_install_dir(), config, source);
  }
  return 0;
}

struct plugin_listing {
  FILE *out;
  bool json, verbose;
  int count;
};

static const char *key_type_name(enum qkeep_key_type t) {
  static const char *const names[] = {"string", "int", "bool", "enum"};
  return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "?";
}

struct key_listing {
  FILE *out;
  bool json;
  int count;
};

static int print_key(void *user, const struct qkeep_backend_key *k) {
  struct key_listing *l = user;
  FILE *out = l->out;
  if (l->json) {
    fprintf(out, "%s{\"name\":", l->count ? "," : "");
    print_json_string(out, k->name ? k->name : "");
    fprintf(out, ",\"type\":\"%s\",\"values\":", key_type_name(k->type));
    print_json_string(out, k->values ? k->values : "");
    fprintf(out, ",\"default\":");
    print_json_string(out, k->default_value ? k->default_value : "");
    fprintf(out, ",\"help\":");
    print_json_string(out, k->help ? k->help : "");
    fprintf(out, "}");
  } else {
    fprintf(out, "    %-20s %-6s %-22s default %s\n      %s\n", k->name ? k->name : "?",
            key_type_name(k->type), k->values ? k->values : "", k->default_value ? k->default_value : "-",
            k->help ? k->help : "");
  }
  l->count++;
  return 0;
}

/* The keys a backend declares (verbose listings). */
static void list_keys(const struct plugin_listing *l, const qkeep_plugin *plugin) {
  struct key_listing kl = {l->out, l->json, 0};
  fprintf(l->out, l->json ? ",\"keys\":[" : "  keys:\n");
  int rc = qkeep_plugin_keys(plugin, print_key, &kl);
  if (l->json)
    fprintf(l->out, "]%s", rc == QKEEP_E_NOTFOUND ? ",\"keys_declared\":false" : "");
  else if (rc == QKEEP_E_NOTFOUND)
    fprintf(l->out, "    (not declared: the backend checks its own keys)\n");
  else if (!kl.count)
    fprintf(l->out, "    (none)\n");
}

static int list_one(void *user, const char *name, const char *path) {
  struct plugin_listing *l = user;
  FILE *out = l->out;
  qkeep_plugin *plugin = NULL;
  char probe_msg[256] = "";
  int rc = qkeep_plugin_open_path(path, &plugin);
  int probe = rc ? rc : qkeep_plugin_probe(plugin, probe_msg, sizeof probe_msg);
  const struct qkeep_backend *be = plugin ? qkeep_plugin_backend(plugin) : NULL;
  const char *error = rc ? qkeep_errmsg() : "";
  if (l->json) {
    fprintf(out, "%s{\"name\":", l->count ? "," : "");
    print_json_string(out, name);
    fprintf(out, ",\"path\":");
    print_json_string(out, path);
    if (be)
      fprintf(out, ",\"abi\":\"%u.%u\",\"probe\":%s,\"probe_message\":", be->abi_major, be->abi_minor,
              probe == 0 ? "true" : "false");
    else
      fprintf(out, ",\"error\":");
    print_json_string(out, be ? probe_msg : error);
    if (be && l->verbose) {
      fprintf(out, ",\"description\":");
      print_json_string(out, be->description ? be->description : "");
      list_keys(l, plugin);
    }
    fprintf(out, "}");
  } else if (be) {
    fprintf(out, "%-16s ABI %u.%u  %-9s %s\n  %s\n", name, be->abi_major, be->abi_minor,
            probe == 0 ? "device ok" : "no device:", probe_msg, path);
    if (l->verbose) {
      fprintf(out, "  %s\n", be->description ? be->description : "");
      list_keys(l, plugin);
    }
  } else {
    fprintf(out, "%-16s failed to load: %s\n  %s\n", name, error, path);
  }
  l->count++;
  qkeep_plugin_close(plugin);
  return 0;
}

static int cmd_plugins(const struct options *o) {
  qkeep_config *cfg = NULL;
  const char *dir = NULL;
  /* A config is optional here: without one, the environment and install dir are still searched. */
  if (load_config(o, &cfg) == 0)
    dir = qkeep_config_plugin_dir(cfg);
  else if (o->config_path)
    return fail(o, QKEEP_E_CONFIG);
  char *listing = NULL;
  size_t listing_len = 0;
  struct plugin_listing l = {o->json ? open_memstream(&listing, &listing_len) : stdout, o->json,
                             option_flag(o, "verbose"), 0};
  if (!l.out) {
    qkeep_config_free(cfg);
    return fail(o, QKEEP_E_NOMEM);
  }
  if (!o->json)
    printf("core plugin ABI %d.%d\n", QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR);
  int rc = qkeep_plugin_scan(dir, list_one, &l);
  if (o->json)
    fclose(l.out);
  if (!rc && o->json) {
    json_begin(stdout, true, NULL, NULL);
    printf(",\"core_abi\":\"%d.%d\",\"plugins\":[%s]}\n", QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR,
           listing ? listing : "");
  } else if (!rc && !l.count) {
    printf("no plugins found\n");
  }
  free(listing);
  qkeep_config_free(cfg);
  return rc ? fail(o, rc) : 0;
}

/* ---- census -------------------------------------------------------------------------- */

static int cmd_census(const struct options *o) {
  qkeep_config *cfg = NULL;
  struct chain chain = {0};
  qkeep_model *model = NULL;
  int rc = load_config(o, &cfg);
  if (!rc)
    rc = open_chain(cfg, &chain);
  const char *ckpt = o->n_args ? o->args[0] : (cfg ? qkeep_config_checkpoint(cfg) : NULL);
  if (!rc && !ckpt) {
    report_failure(o, 2, "usage", "census: no checkpoint given and %s has no [model] checkpoint",
                   qkeep_config_path(cfg));
    close_chain(&chain);
    qkeep_config_free(cfg);
    return 2;
  }
  if (!rc)
    rc = new_model(cfg, chain.plugins, chain.n, &model);
  if (!rc)
    rc = qkeep_model_load(model, ckpt);
  struct qkeep_census c = {.size = sizeof c};
  struct qkeep_digest d;
  if (!rc)
    rc = qkeep_census(model, &c);
  if (!rc)
    rc = qkeep_digest(model, &d);
  int status = rc ? fail(o, rc) : 0;
  if (!rc) {
    bool ok = !c.missing && !c.c1 && !c.c2;
    char message[160];
    snprintf(message, sizeof message, "census: rule violations (missing %lld, C1 %lld, C2 %lld)",
             (long long)c.missing, (long long)c.c1, (long long)c.c2);
    if (o->json) {
      json_begin(stdout, ok, "rule_violations", message);
      census_members_json(stdout, false, ckpt, model, &c, &d);
      printf("}\n");
    } else {
      report_census(stdout, ckpt, model, &c, &d, false);
    }
    if (!ok) {
      fflush(stdout);
      fprintf(stderr, "qkeep: %s\n", message);
      status = 1;
    }
  }
  qkeep_model_free(model);
  close_chain(&chain);
  qkeep_config_free(cfg);
  return status;
}

/* ---- main ---------------------------------------------------------------------------- */

static int dispatch(struct options *o) {
  if (option_flag(o, "version") && !o->help)
    return cmd_version(o);
  if (!o->command) {
    if (o->help)
      return cmd_help(o);
    return usage_error(o->json, usage_line, "no command given");
  }
  const struct command_def *cmd = find_command(o->command);
  if (!cmd)
    return usage_error(o->json, usage_line, "unknown command '%s'", o->command);
  int rc = check_args(o, cmd);
  if (rc)
    return rc;
  if (o->help) /* qkeep COMMAND --help is qkeep help COMMAND */
    return print_help(o, cmd->usage);
  if (cmd->bit & C_ONLINE) {
    rc = online_options(o, &cli_quantize);
    if (rc == 2)
      return rc;
    cli_quantize_set = rc == 0;
  }
  return cmd->run(o);
}

int main(int argc, char **argv) {
  struct options o = {0};
  int rc = parse_args(argc, argv, &o);
  if (!rc) {
    static bool debug = true;
    qkeep_set_logger(log_to_stderr, o.debug ? &debug : NULL);
    if (o.debug)
      qkeep_set_log_level(QKEEP_LOG_DEBUG);
    rc = dispatch(&o);
  }
  free(o.args);
  return rc;
}
