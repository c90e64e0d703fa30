/*
 * main.c: the qkeep command.
 *
 *   qkeep [-c CONFIG] [--json] [--debug] COMMAND [ARGS]
 *     version            the library version and plugin ABI
 *     plugins            the backends found, their ABI and probe result
 *     census [CKPT]      load CKPT (default: the config's checkpoint) and count it against the rules
 *     run [CKPT]         load, census, forward check of every layer against the reference
 *     reload [W0 W1]     reload in place and compare with a cold start
 *     quantize IN OUT    write a quantized checkpoint
 *
 * Exit status: 0 success, 1 failure (or rule violations found by census), 2 usage.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "qkeep_dirs.h" /* QKEEP_PKGDATADIR, QKEEP_BUILD_DIR: written by make */

static const char usage_main[] =
    "usage: qkeep [-c CONFIG] [--json] [--debug] COMMAND [ARGS]\n"
    "\n"
    "Loads quantized checkpoints into a backend's kernel layout without losing a loaded param.\n"
    "\n"
    "commands:\n"
    "  version        print the library version and the plugin ABI\n"
    "  plugins        list the backends found, their ABI versions and whether their device is present\n"
    "  census [CKPT]  load a checkpoint with the configured backend and count it against the rules\n"
    "  run [CKPT]     load, census, and check every layer against the reference backend (the main job)\n"
    "  reload [W0 W1] cold start W0, reload W1 in place, compare with a cold start on W1\n"
    "  quantize IN OUT --scheme S   write a quantized checkpoint directory from an unquantized one\n"
    "\n"
    "options:\n"
    "  -c, --config FILE  the INI config (default: $QKEEP_CONFIG; the build tree's conf/qkeep.ini for a\n"
    "                     qkeep run from its build tree; else " QKEEP_PKGDATADIR "/qkeep.ini)\n"
    "  --json             machine-readable output\n"
    "  --debug            also print the library's debug lines on stderr (the stream's and sync's traces)\n"
    "  -h, --help         help (also after a command)\n";

static const char usage_version[] =
    "usage: qkeep version [--json]\n\nPrints the library version and plugin ABI.\n";
static const char usage_plugins[] =
    "usage: qkeep [-c CONFIG] plugins [--verbose] [--json]\n"
    "\n"
    "Lists every backend-*.so in $QKEEP_PLUGIN_PATH, the config's plugin_dir and the install\n"
    "directory, with its ABI version and probe result (is its device present?). --verbose adds\n"
    "each backend's description and the [backend.NAME] keys it declares (type, values, default).\n";
static const char usage_census[] =
    "usage: qkeep [-c CONFIG] census [CKPT] [--json]\n"
    "\n"
    "Loads CKPT (a .safetensors file; default: [model] checkpoint of the config) with the\n"
    "configured backend, runs its post-load pass, and prints the census: loader params,\n"
    "missing, C1 and C2 violations, aliases, retired, released, kept bytes, and the digest.\n"
    "Exits 1 when a rule is violated (missing, C1 or C2 non-zero).\n";

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

int fail(int code) {
  fflush(stdout); /* what was printed before the error comes first */
  const char *detail = qkeep_errmsg();
  fprintf(stderr, "qkeep: %s%s%s\n", qkeep_strerror(code), *detail ? ": " : "", detail);
  return 1;
}

/* Options that take a value, and flags, as "--name" (values also as "--name=value"). */
static const char *const value_options[] = {"scheme",    "group", "activation-amax", "shard-bytes", "rows",
                                            "tolerance", "seed",  "threads"};
static const char *const flag_options[] = {"asym", "static-input", "asym-input", "kv-scales", "verbose"};

static int parse_args(int argc, char **argv, struct options *o) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "-c") == 0 || strcmp(a, "--config") == 0) {
      if (++i >= argc) {
        fprintf(stderr, "qkeep: %s needs a file\n", a);
        return 2;
      }
      o->config_path = argv[i];
    } else if (strcmp(a, "--json") == 0) {
      o->json = true;
    } else if (strcmp(a, "--debug") == 0) {
      o->debug = true;
    } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      o->help = true;
    } else if (a[0] == '-' && a[1] == '-') {
      const char *eq = strchr(a, '=');
      size_t len = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
      bool known = false;
      for (size_t v = 0; v < sizeof value_options / sizeof value_options[0] && !known; v++)
        if (strlen(value_options[v]) == len && strncmp(a + 2, value_options[v], len) == 0) {
          const char *value = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
          if (!value) {
            fprintf(stderr, "qkeep: %s needs a value\n", a);
            return 2;
          }
          o->values[v] = value;
          known = true;
        }
      for (size_t f = 0; f < sizeof flag_options / sizeof flag_options[0] && !known; f++)
        if (!eq && strcmp(a + 2, flag_options[f]) == 0)
          o->flags |= 1u << f, known = true;
      if (!known) {
        fprintf(stderr, "qkeep: unknown option '%s' (try qkeep --help)\n", a);
        return 2;
      }
    } else if (a[0] == '-' && a[1]) {
      fprintf(stderr, "qkeep: unknown option '%s'\n", a);
      return 2;
    } else if (!o->command) {
      o->command = a;
    } else if (o->n_args < 8) {
      o->args[o->n_args++] = a;
    } else {
      fprintf(stderr, "qkeep: too many arguments\n");
      return 2;
    }
  }
  return 0;
}

const char *option_value(const struct options *o, const char *name) {
  for (size_t v = 0; v < sizeof value_options / sizeof value_options[0]; v++)
    if (strcmp(value_options[v], name) == 0)
      return o->values[v];
  return NULL;
}

int option_int(const struct options *o, const char *name, long long min, long long max, long long *out) {
  const char *text = option_value(o, name);
  if (!text)
    return 0;
  char *end;
  errno = 0;
  long long v = strtoll(text, &end, 10);
  if (end == text || *end || errno || v < min || v > max) {
    fprintf(stderr, "qkeep: %s: --%s %s: expected a whole number from %lld to %lld\n", o->command, name, text,
            min, max);
    return 2;
  }
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
  if (end == text || *end || errno || !isfinite(v) || v < min) {
    fprintf(stderr, "qkeep: %s: --%s %s: expected a finite number >= %g\n", o->command, name, text, min);
    return 2;
  }
  *out = v;
  return 0;
}

bool option_flag(const struct options *o, const char *name) {
  for (size_t f = 0; f < sizeof flag_options / sizeof flag_options[0]; f++)
    if (strcmp(flag_options[f], name) == 0)
      return o->flags & (1u << f);
  return false;
}

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

/* The config to use: -c, $QKEEP_CONFIG, the build tree's (for a qkeep run from it), then the
 * installed default. */
int load_config(const struct options *o, qkeep_config **cfg) {
  const char *path = o->config_path;
  if (!path && getuid() == geteuid() && getgid() == getegid()) /* not when set-id */
    path = getenv("QKEEP_CONFIG");
  if (!path)
    path = build_tree_config();
  if (!path)
    path = QKEEP_PKGDATADIR "/qkeep.ini";
  return qkeep_config_load(path, cfg);
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
  return rc;
}

static int cmd_version(const struct options *o) {
  if (o->json)
    printf("{\"version\":\"%s\",\"backend_abi\":\"%d.%d\"}\n", qkeep_version(), QKEEP_BACKEND_ABI_MAJOR,
           QKEEP_BACKEND_ABI_MINOR);
  else
    printf("qkeep %s (plugin ABI %d.%d)\n", qkeep_version(), QKEEP_BACKEND_ABI_MAJOR,
           QKEEP_BACKEND_ABI_MINOR);
  return 0;
}

struct plugin_listing {
  bool json, verbose;
  int count;
};

static const char *key_type_name(enum qkeep_key_type t) {
  static const char *const names[] = {"string", "int", "bool", "enum"};
  return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "?";
}

struct key_listing {
  bool json;
  int count;
};

static int print_key(void *user, const struct qkeep_backend_key *k) {
  struct key_listing *l = user;
  if (l->json) {
    printf("%s{\"name\":", l->count ? "," : "");
    print_json_string(stdout, k->name ? k->name : "");
    printf(",\"type\":\"%s\",\"values\":", key_type_name(k->type));
    print_json_string(stdout, k->values ? k->values : "");
    printf(",\"default\":");
    print_json_string(stdout, k->default_value ? k->default_value : "");
    printf(",\"help\":");
    print_json_string(stdout, k->help ? k->help : "");
    printf("}");
  } else {
    printf("    %-20s %-6s %-22s default %s\n      %s\n", k->name ? k->name : "?", key_type_name(k->type),
           k->values ? k->values : "", k->default_value ? k->default_value : "-", k->help ? k->help : "");
  }
  l->count++;
  return 0;
}

/* The keys a backend declares (verbose listings). */
static void list_keys(const struct plugin_listing *l, const qkeep_plugin *plugin) {
  struct key_listing kl = {l->json, 0};
  if (l->json)
    printf(",\"keys\":[");
  else
    printf("  keys:\n");
  int rc = qkeep_plugin_keys(plugin, print_key, &kl);
  if (l->json)
    printf("]%s", rc == QKEEP_E_NOTFOUND ? ",\"keys_declared\":false" : "");
  else if (rc == QKEEP_E_NOTFOUND)
    printf("    (not declared: the backend checks its own keys)\n");
  else if (!kl.count)
    printf("    (none)\n");
}

static int list_one(void *user, const char *name, const char *path) {
  struct plugin_listing *l = user;
  qkeep_plugin *plugin = NULL;
  char probe_msg[256] = "";
  int rc = qkeep_plugin_open_path(path, &plugin);
  int probe = rc ? rc : qkeep_plugin_probe(plugin, probe_msg, sizeof probe_msg);
  const struct qkeep_backend *be = plugin ? qkeep_plugin_backend(plugin) : NULL;
  const char *error = rc ? qkeep_errmsg() : "";
  if (l->json) {
    printf("%s{\"name\":", l->count ? "," : "");
    print_json_string(stdout, name);
    printf(",\"path\":");
    print_json_string(stdout, path);
    if (be)
      printf(",\"abi\":\"%u.%u\",\"probe\":%s,\"probe_message\":", be->abi_major, be->abi_minor,
             probe == 0 ? "true" : "false");
    else
      printf(",\"error\":");
    print_json_string(stdout, be ? probe_msg : error);
    if (be && l->verbose) {
      printf(",\"description\":");
      print_json_string(stdout, be->description ? be->description : "");
      list_keys(l, plugin);
    }
    printf("}");
  } else if (be) {
    printf("%-16s ABI %u.%u  %-9s %s\n  %s\n", name, be->abi_major, be->abi_minor,
           probe == 0 ? "device ok" : "no device", probe_msg, path);
    if (l->verbose) {
      printf("  %s\n", be->description ? be->description : "");
      list_keys(l, plugin);
    }
  } else {
    printf("%-16s failed to load: %s\n  %s\n", name, error, path);
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
    return fail(QKEEP_E_CONFIG);
  struct plugin_listing l = {o->json, option_flag(o, "verbose"), 0};
  if (o->json)
    printf("{\"core_abi\":\"%d.%d\",\"plugins\":[", QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR);
  else
    printf("core plugin ABI %d.%d\n", QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR);
  int rc = qkeep_plugin_scan(dir, list_one, &l);
  if (o->json)
    printf("]}\n");
  else if (!l.count)
    printf("no plugins found\n");
  qkeep_config_free(cfg);
  return rc ? fail(rc) : 0;
}

static int cmd_census(const struct options *o) {
  qkeep_config *cfg = NULL;
  struct chain chain = {0};
  qkeep_model *model = NULL;
  int rc = load_config(o, &cfg);
  if (!rc)
    rc = open_chain(cfg, &chain);
  const char *ckpt = o->n_args ? o->args[0] : (cfg ? qkeep_config_checkpoint(cfg) : NULL);
  if (!rc && !ckpt) {
    fprintf(stderr, "qkeep: census: no checkpoint given and %s has no [model] checkpoint\n",
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
  int status = rc ? fail(rc) : 0;
  if (!rc) {
    report_census(stdout, ckpt, model, &c, &d, o->json);
    if (o->json)
      putchar('\n');
    if (c.missing || c.c1 || c.c2) {
      fprintf(stderr, "qkeep: census: rule violations (missing %lld, C1 %lld, C2 %lld)\n",
              (long long)c.missing, (long long)c.c1, (long long)c.c2);
      status = 1;
    }
  }
  qkeep_model_free(model);
  close_chain(&chain);
  qkeep_config_free(cfg);
  return status;
}

int main(int argc, char **argv) {
  struct options o = {0};
  int rc = parse_args(argc, argv, &o);
  if (rc)
    return rc;
  static bool debug = true;
  qkeep_set_logger(log_to_stderr, o.debug ? &debug : NULL);
  if (o.debug)
    qkeep_set_log_level(QKEEP_LOG_DEBUG);
  static const struct {
    const char *name;
    int (*run)(const struct options *);
    const char *usage;
  } commands[] = {
      {"version", cmd_version, usage_version},    {"plugins", cmd_plugins, usage_plugins},
      {"census", cmd_census, usage_census},       {"run", cmd_run, usage_run},
      {"quantize", cmd_quantize, usage_quantize}, {"reload", cmd_reload, usage_reload},
  };
  if (!o.command) {
    fputs(usage_main, o.help ? stdout : stderr);
    return o.help ? 0 : 2;
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (strcmp(o.command, commands[i].name) == 0) {
      if (o.help) {
        fputs(commands[i].usage, stdout);
        return 0;
      }
      return commands[i].run(&o);
    }
  fprintf(stderr, "qkeep: unknown command '%s' (try qkeep --help)\n", o.command);
  return 2;
}
