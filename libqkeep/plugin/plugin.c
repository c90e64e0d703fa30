/*
 * plugin.c: finds, loads and checks backend plugins (docs/ABI.md, "Versions", "Finding plugins").
 *
 * The backend NAME lives in "backend-NAME.so", searched in each directory of
 * $QKEEP_PLUGIN_PATH, then the caller's plugin_dir, then the install
 * directory; the first file found is the one loaded, and scan lists what open
 * would load. A plugin is checked right after its init returns and before
 * anything else of it runs: ABI major (exact) and minor (floor), table size,
 * name. A plugin that fails a check gets its fini (when its table has one)
 * and is closed. Every loading error names the file, dlerror() where there is
 * one, and both ABI versions.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif

#include "plugin/plugin.h"
#include "qkeep/qkeep_backend_util.h"
#include "qkeep_dirs.h" /* QKEEP_PLUGIN_DIR, the plugin install directory: written by make */

#define PLUGIN_PREFIX "backend-"
#define PLUGIN_SUFFIX ".so"

/* The table must reach up to and including fini, the last slot of ABI 1.0. */
#define BACKEND_MIN_SIZE (offsetof(struct qkeep_backend, fini) + sizeof(((struct qkeep_backend *)0)->fini))
/* Enough of the table to read its ABI version. */
#define BACKEND_HEADER_SIZE (offsetof(struct qkeep_backend, abi_minor) + sizeof(uint32_t))

const char *qkeep_plugin_install_dir(void) { return QKEEP_PLUGIN_DIR; }

/* ---- search path ------------------------------------------------------------------- */

bool environment_untrusted(void) {
#if defined(__linux__) && defined(AT_SECURE)
  return getauxval(AT_SECURE) != 0;
#else
  return getuid() != geteuid() || getgid() != getegid();
#endif
}

/* A growable list of strings: the search path's directories, a directory's backend names. */
struct strlist {
  char **items;
  size_t n, cap;
};

static void strlist_free(struct strlist *sp) {
  for (size_t i = 0; i < sp->n; i++)
    free(sp->items[i]);
  free(sp->items);
  sp->items = NULL;
  sp->n = sp->cap = 0;
}

/* Appends the first len bytes of s; an empty string is skipped. */
static int strlist_add(struct strlist *sp, const char *s, size_t len) {
  if (len == 0)
    return 0;
  int rc = grow_array((void **)&sp->items, &sp->cap, sp->n + 1, sizeof *sp->items);
  if (rc)
    return rc;
  char *copy = malloc(len + 1);
  if (!copy)
    return set_error(QKEEP_E_NOMEM, "out of memory building the plugin search path");
  memcpy(copy, s, len);
  copy[len] = '\0';
  sp->items[sp->n++] = copy;
  return 0;
}

/* Built per call (not cached): tests and engines may change $QKEEP_PLUGIN_PATH between loads. */
static int search_path_build(const char *plugin_dir, struct strlist *sp) {
  int rc = 0;
  memset(sp, 0, sizeof *sp);
  const char *env = environment_untrusted() ? NULL : getenv("QKEEP_PLUGIN_PATH");
  /* An empty entry is skipped, not read as the current directory: too easy to get by accident. */
  while (env && *env && !rc) {
    const char *colon = strchr(env, ':');
    size_t len = colon ? (size_t)(colon - env) : strlen(env);
    rc = strlist_add(sp, env, len);
    env = colon ? colon + 1 : NULL;
  }
  /* plugin_dir may list several directories, colon-separated, like the environment. */
  while (!rc && plugin_dir && *plugin_dir) {
    const char *colon = strchr(plugin_dir, ':');
    size_t len = colon ? (size_t)(colon - plugin_dir) : strlen(plugin_dir);
    if (len)
      rc = strlist_add(sp, plugin_dir, len);
    plugin_dir = colon ? colon + 1 : NULL;
  }
  if (!rc)
    rc = strlist_add(sp, QKEEP_PLUGIN_DIR, strlen(QKEEP_PLUGIN_DIR));
  if (rc)
    strlist_free(sp);
  return rc;
}

/* dir + "/" + PLUGIN_PREFIX name PLUGIN_SUFFIX, malloc'd. */
static char *plugin_file(const char *dir, const char *name) {
  size_t dir_len = strlen(dir);
  const char *sep = dir_len && dir[dir_len - 1] == '/' ? "" : "/";
  size_t n = dir_len + strlen(sep) + strlen(PLUGIN_PREFIX) + strlen(name) + strlen(PLUGIN_SUFFIX) + 1;
  char *path = malloc(n);
  if (path)
    snprintf(path, n, "%s%s%s%s%s", dir, sep, PLUGIN_PREFIX, name, PLUGIN_SUFFIX);
  return path;
}

/* The same alphabet as the config's backend names; a name becomes part of a file name. */
/* Whether s[0, n) is a backend name: a-z, 0-9, '-' and '_', at least one. */
static bool valid_name_n(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '_' || s[i] == '-'))
      return false;
  return n > 0;
}

static bool valid_name(const char *s) { return s && valid_name_n(s, strlen(s)); }

static bool is_regular_file(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* ---- loading and checking ---------------------------------------------------------------- */

/*
 * For valgrind and ASan runs (qkeep__test_control's QKEEP_TESTCTRL_PLUGIN_NODELETE): dlclose
 * leaves the plugin mapped, so a leak in a plugin's static constructors (the HIP runtime has
 * one) keeps its symbols and can be suppressed.
 */
static atomic_bool plugins_nodelete;

void plugin_set_nodelete(bool on) { atomic_store(&plugins_nodelete, on); }

static int dlopen_flags(void) {
  int flags = RTLD_NOW | RTLD_LOCAL;
  if (atomic_load(&plugins_nodelete))
    flags |= RTLD_NODELETE;
  return flags;
}

/* Calls fini only in a table whose layout the core knows: its major is ours and it reaches fini.
 * A plugin of another major is closed without a call into it (its table may be anything). */
static void backend_fini(const struct qkeep_backend *be) {
  if (be && be->size >= BACKEND_MIN_SIZE && be->abi_major == QKEEP_BACKEND_ABI_MAJOR && be->fini)
    be->fini(be);
}

/*
 * Checks a table that init returned, before the core uses any of it. The
 * version is compared before the size so that a plugin for another ABI
 * major is reported as such, whatever its table looks like.
 */
static int check_backend(const char *path, const struct qkeep_backend *be, const char *want_name) {
  if (be->size < BACKEND_HEADER_SIZE)
    return set_error(QKEEP_E_ABI,
                     "%s: backend table is %zu bytes, too small to hold its ABI version (core ABI %d.%d)",
                     path, be->size, QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR);
  unsigned major = be->abi_major, minor = be->abi_minor;
  if (major != QKEEP_BACKEND_ABI_MAJOR)
    return set_error(QKEEP_E_ABI,
                     "%s: plugin ABI major differs from the core's (core ABI %d.%d, plugin ABI %u.%u)", path,
                     QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR, major, minor);
  if (minor > QKEEP_BACKEND_ABI_MINOR)
    return set_error(QKEEP_E_ABI, "%s: plugin needs a newer core (core ABI %d.%d, plugin ABI %u.%u)", path,
                     QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR, major, minor);
  if (be->size < BACKEND_MIN_SIZE)
    return set_error(
        QKEEP_E_ABI,
        "%s: backend table is %zu bytes, ABI %d.%d needs at least %zu (core ABI %d.%d, plugin ABI %u.%u)",
        path, be->size, QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR, BACKEND_MIN_SIZE,
        QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR, major, minor);
  if (be->memory && !memory_ops_complete(be->memory))
    return set_error(
        QKEEP_E_ABI,
        "%s: backend's memory table (%zu bytes) lacks a slot the core calls (alloc, free, the three "
        "copies, fill and sync; %zu bytes; core ABI %d.%d, plugin ABI %u.%u): refused rather than "
        "giving a device backend host memory",
        path, be->memory->size, sizeof(struct qkeep_memory_ops), QKEEP_BACKEND_ABI_MAJOR,
        QKEEP_BACKEND_ABI_MINOR, major, minor);
  if (!valid_name(be->name))
    return set_error(QKEEP_E_PLUGIN, "%s: backend has no valid name (core ABI %d.%d, plugin ABI %u.%u)", path,
                     QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR, major, minor);
  if (want_name && strcmp(be->name, want_name) != 0)
    return set_error(QKEEP_E_PLUGIN,
                     "%s: file holds backend '%s', expected '%s' (core ABI %d.%d, plugin ABI %u.%u)", path,
                     be->name, want_name, QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR, major, minor);
  return 0;
}

/*
 * Around a call into a backend: clears the detail so that we can tell whether
 * the backend left one, and puts the caller's last error back when the call
 * succeeds (qkeep_errmsg() stays valid until the next *failing* call).
 */
struct saved_error {
  char text[2048];
};

static void error_save(struct saved_error *saved) {
  snprintf(saved->text, sizeof saved->text, "%s", qkeep_errmsg());
  set_error(QKEEP_OK, "%s", "");
}

static void error_restore(const struct saved_error *saved) { set_error(QKEEP_OK, "%s", saved->text); }

/* The code an init failure is reported with: the backend's own when it is one of ours. */
static int init_error_code(int rc) {
  /* QKEEP_E_INTERRUPTED is the last code this core knows. */
  return rc < 0 && rc >= QKEEP_E_INTERRUPTED ? rc : QKEEP_E_PLUGIN;
}

/*
 * One entry of a trusted path: owned by root or the caller, and writable by no one else. A
 * directory others may write is accepted only with the sticky bit and owned by root or the caller
 * (as /tmp): no one else can then rename or remove what the caller put there. `real` is a resolved
 * path (no link in it); `path` is the name asked for, which every message starts with.
 */
static int check_entry(const char *path, const char *what, const char *real, bool dir) {
  struct stat sb;
  const char *kind = dir ? "directory" : "file";
  if (stat(real, &sb) != 0)
    return set_error(QKEEP_E_PLUGIN, "%s: cannot check %s %s %s: %s", path, what, kind, real,
                     strerror(errno));
  bool own = sb.st_uid == 0 || sb.st_uid == geteuid();
  if (!own)
    return set_error(QKEEP_E_PLUGIN,
                     "%s: refused: %s %s is owned by uid %u, neither root nor the caller (uid %u)", path,
                     kind, real, (unsigned)sb.st_uid, (unsigned)geteuid());
  if ((sb.st_mode & (S_IWGRP | S_IWOTH)) && !(dir && (sb.st_mode & S_ISVTX)))
    return set_error(
        QKEEP_E_PLUGIN, "%s: refused: %s %s is writable by %s (mode %03o): anyone could replace the code",
        path, kind, real, sb.st_mode & S_IWOTH ? "others" : "its group", (unsigned)(sb.st_mode & 0777));
  return 0;
}

/* check_entry on every directory from `real` (resolved) up to /. */
static int check_dirs_up(const char *path, const char *what, const char *real) {
  char *dir = xstrdup(real);
  if (!dir)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  int rc = 0;
  for (;;) {
    if ((rc = check_entry(path, what, dir, true)) != 0 || strcmp(dir, "/") == 0)
      break;
    char *slash = strrchr(dir, '/');
    if (!slash)
      break; /* realpath's answers are absolute: not reached */
    slash == dir ? (void)(dir[1] = '\0') : (void)(*slash = '\0');
  }
  free(dir);
  return rc;
}

/* The resolved directory that holds the name `path` (its last component not followed), malloc'd. */
static char *real_parent(const char *path) {
  char *dir = xstrdup(path);
  if (!dir)
    return NULL;
  char *slash = strrchr(dir, '/');
  if (slash)
    slash == dir ? (void)(dir[1] = '\0') : (void)(*slash = '\0');
  char *real = realpath(slash ? dir : ".", NULL);
  free(dir);
  return real;
}

int check_trusted(const char *path, const char *what) {
  /* As ssh checks a key: the file the name resolves to, and every directory above it up to /, so
   * that neither a link into a directory anyone may write nor such a parent lets code in. */
  char *real = realpath(path, NULL), *parent = NULL;
  if (!real)
    return set_error(QKEEP_E_PLUGIN, "%s: cannot check %s file: %s", path, what, strerror(errno));
  int rc = check_entry(path, what, real, false);
  if (!rc && !(parent = real_parent(real)))
    rc = set_error(QKEEP_E_PLUGIN, "%s: cannot check %s directory: %s", path, what, strerror(errno));
  if (!rc)
    rc = check_dirs_up(path, what, parent);
  free(parent);
  parent = NULL;
  /* A link: whoever may write the directories holding the link may point it elsewhere. */
  struct stat lsb;
  if (!rc && lstat(path, &lsb) == 0 && S_ISLNK(lsb.st_mode)) {
    if (!(parent = real_parent(path)))
      rc = set_error(QKEEP_E_PLUGIN, "%s: cannot check %s directory: %s", path, what, strerror(errno));
    else
      rc = check_dirs_up(path, what, parent);
  }
  free(parent);
  free(real);
  return rc;
}

/* Loads the file at path; want_name, when set, is the name the backend must have. */
static int load_plugin(const char *path, const char *want_name, qkeep_plugin **out) {
  int trusted = check_trusted(path, "plugin");
  if (trusted)
    return trusted;
  dlerror(); /* drop a stale message */
  void *handle = dlopen(path, dlopen_flags());
  if (!handle) {
    const char *why = dlerror();
    return set_error(QKEEP_E_PLUGIN, "%s: cannot load plugin: %s (core ABI %d.%d)", path,
                     why ? why : "unknown dlopen error", QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR);
  }
  void *sym = dlsym(handle, QKEEP_BACKEND_INIT_SYMBOL);
  if (!sym) {
    const char *why = dlerror();
    set_error(QKEEP_E_PLUGIN, "%s: not a qkeep backend, no symbol %s: %s (core ABI %d.%d)", path,
              QKEEP_BACKEND_INIT_SYMBOL, why ? why : "symbol is NULL", QKEEP_BACKEND_ABI_MAJOR,
              QKEEP_BACKEND_ABI_MINOR);
    dlclose(handle);
    return QKEEP_E_PLUGIN;
  }
  /* POSIX makes dlsym's object pointer a function pointer; memcpy says so without an ISO C cast. */
  qkeep_backend_init_fn init;
  _Static_assert(sizeof init == sizeof sym, "function and object pointers differ in size");
  memcpy(&init, &sym, sizeof init);
  const struct qkeep_backend *be = NULL;
  struct saved_error saved;
  error_save(&saved);
  int rc = init(host_table(), &be);
  if (rc != 0) {
    /* The backend's own detail (host->set_error) stays; we prefix where it came from. */
    rc = add_error_context(init_error_code(rc), "%s: backend init failed (core ABI %d.%d)", path,
                           QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR);
    dlclose(handle);
    return rc;
  }
  if (!be) {
    dlclose(handle);
    return set_error(QKEEP_E_PLUGIN, "%s: backend init returned no table (core ABI %d.%d)", path,
                     QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR);
  }
  rc = check_backend(path, be, want_name);
  qkeep_plugin *plugin = rc ? NULL : calloc(1, sizeof *plugin);
  if (!rc && (!plugin || !(plugin->path = xstrdup(path)))) {
    free(plugin);
    plugin = NULL;
    rc = set_error(QKEEP_E_NOMEM, "%s: out of memory", path);
  }
  if (rc) {
    backend_fini(be);
    dlclose(handle);
    return rc;
  }
  plugin->handle = handle;
  plugin->be = be;
  *out = plugin;
  error_restore(&saved);
  return 0;
}

int qkeep_plugin_open_path(const char *path, qkeep_plugin **out) {
  if (!path || !*path || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_plugin_open_path: path and out must be given");
  *out = NULL;
  return load_plugin(path, NULL, out);
}

/* The not-found error lists every file the search looked at. */
static int not_found_error(const char *name, const struct strlist *sp) {
  char *tried = NULL;
  size_t tried_len = 0;
  FILE *list = open_memstream(&tried, &tried_len); /* as long as the search path is */
  for (size_t i = 0; list && i < sp->n; i++) {
    char *file = plugin_file(sp->items[i], name);
    fprintf(list, "%s%s", i ? ", " : "", file ? file : sp->items[i]);
    free(file);
  }
  bool listed = list && fclose(list) == 0 && tried;
  int rc =
      set_error(QKEEP_E_NOTFOUND, PLUGIN_PREFIX "%s" PLUGIN_SUFFIX " not found (core ABI %d.%d); tried %s",
                name, QKEEP_BACKEND_ABI_MAJOR, QKEEP_BACKEND_ABI_MINOR,
                listed ? tried : "(the search path; out of memory listing it)");
  free(tried);
  return rc;
}

int qkeep_plugin_open(const char *name, const char *plugin_dir, qkeep_plugin **out) {
  if (!out)
    return set_error(QKEEP_E_INVAL, "qkeep_plugin_open: out must not be NULL");
  *out = NULL;
  if (!valid_name(name))
    return set_error(QKEEP_E_INVAL, "invalid backend name '%s' (use a-z, 0-9, '-' and '_')",
                     name ? name : "(null)");
  struct strlist sp;
  int rc = search_path_build(plugin_dir, &sp);
  if (rc)
    return rc;
  bool found = false;
  for (size_t i = 0; i < sp.n && !found && !rc; i++) {
    char *path = plugin_file(sp.items[i], name);
    if (!path) {
      rc = set_error(QKEEP_E_NOMEM, "out of memory");
      break;
    }
    /* The first file found is the plugin, even if it fails to load: falling
     * through to another copy would hide the broken one. */
    found = is_regular_file(path);
    if (found)
      rc = load_plugin(path, name, out);
    free(path);
  }
  if (!found && !rc)
    rc = not_found_error(name, &sp);
  strlist_free(&sp);
  return rc;
}

void qkeep_plugin_close(qkeep_plugin *plugin) {
  if (!plugin)
    return;
  backend_fini(plugin->be);
  if (plugin->handle)
    dlclose(plugin->handle);
  free(plugin->path);
  free(plugin);
}

const char *qkeep_plugin_name(const qkeep_plugin *plugin) { return plugin ? plugin->be->name : NULL; }
const char *qkeep_plugin_path(const qkeep_plugin *plugin) { return plugin ? plugin->path : NULL; }
const struct qkeep_backend *qkeep_plugin_backend(const qkeep_plugin *plugin) {
  return plugin ? plugin->be : NULL;
}

/* ---- configure, probe --------------------------------------------------------------------- */

/* The backend's declared keys, or NULL when it declares none (ABI 1.0, or keys unset). */
static const struct qkeep_backend_key *declared_keys(const struct qkeep_backend *be, size_t *n,
                                                     size_t *stride) {
  if (!QKEEP_HAS_SLOT(be, struct qkeep_backend, keys) ||
      be->size < offsetof(struct qkeep_backend, key_size) + sizeof be->key_size)
    return NULL;
  *n = be->n_keys;
  *stride = be->key_size;
  /* An entry must reach `help`, the last field ABI 1.1 defines. */
  return *stride >= offsetof(struct qkeep_backend_key, help) + sizeof(const char *) ? be->keys : NULL;
}

static const struct qkeep_backend_key *key_at(const struct qkeep_backend_key *keys, size_t stride, size_t i) {
  return (const struct qkeep_backend_key *)(const void *)((const char *)keys + i * stride);
}

/* "threads, int8_without_vnni" (malloc'd), for messages. */
static char *key_list(const struct qkeep_backend_key *keys, size_t n, size_t stride) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  if (!f)
    return NULL;
  for (size_t i = 0; i < n; i++)
    fprintf(f, "%s%s", i ? ", " : "", key_at(keys, stride, i)->name);
  if (!n)
    fputs("none", f);
  fclose(f);
  return text;
}

/* Whether `value` is one of the '|'-separated `values`. */
static bool among(const char *values, const char *value) {
  size_t n = strlen(value);
  for (const char *p = values; p && *p;) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len == n && strncmp(p, value, n) == 0)
      return true;
    p = bar ? bar + 1 : NULL;
  }
  return false;
}

/* Checks a value against its declared type; NULL when good, else why (static text or `buf`). */
static const char *bad_value(const struct qkeep_backend_key *k, const char *value, char *buf, size_t len) {
  switch (k->type) {
  case QKEEP_KEY_INT: {
    char *end;
    errno = 0;
    long long v = strtoll(value, &end, 10);
    if (errno || end == value || *end)
      return "expected an integer";
    long long lo, hi;
    if (k->values && sscanf(k->values, "%lld..%lld", &lo, &hi) == 2 && (v < lo || v > hi)) {
      snprintf(buf, len, "out of range %s", k->values);
      return buf;
    }
    return NULL;
  }
  case QKEEP_KEY_BOOL: return among("true|false|yes|no|on|off|1|0", value) ? NULL : "expected true or false";
  case QKEEP_KEY_ENUM:
    if (among(k->values, value))
      return NULL;
    snprintf(buf, len, "expected one of %s", k->values ? k->values : "(none declared)");
    return buf;
  case QKEEP_KEY_STRING: return NULL;
  }
  return "of an unknown key type";
}

/* The declared-keys check of one option; 0 when the backend declares none. */
static int check_declared(const struct qkeep_backend *be, const qkeep_config *cfg,
                          const struct config_backend_section *sec, const struct config_option *opt) {
  size_t n = 0, stride = 0;
  const struct qkeep_backend_key *keys = declared_keys(be, &n, &stride);
  if (!keys)
    return 0;
  for (size_t i = 0; i < n; i++) {
    const struct qkeep_backend_key *k = key_at(keys, stride, i);
    if (!k->name || strcmp(k->name, opt->key) != 0)
      continue;
    char buf[160];
    const char *why = bad_value(k, opt->value, buf, sizeof buf);
    return why ? set_error(QKEEP_E_CONFIG, "%s:%d: [backend.%s] %s = '%s': %s", cfg->path, opt->line,
                           sec->name, opt->key, opt->value, why)
               : 0;
  }
  char *list = key_list(keys, n, stride);
  int rc = set_error(QKEEP_E_CONFIG, "%s:%d: [backend.%s] unknown key '%s' (%s takes: %s)", cfg->path,
                     opt->line, sec->name, opt->key, be->name, list ? list : "?");
  free(list);
  return rc;
}

int qkeep_plugin_configure(qkeep_plugin *plugin, const qkeep_config *cfg) {
  if (!plugin || !cfg)
    return set_error(QKEEP_E_INVAL, "qkeep_plugin_configure: plugin and config must not be NULL");
  const struct qkeep_backend *be = plugin->be;
  const struct config_backend_section *sec = config_section(cfg, be->name);
  if (!sec)
    return 0;
  struct saved_error saved;
  error_save(&saved);
  for (size_t i = 0; i < sec->n_options; i++) {
    const struct config_option *opt = &sec->options[i];
    int rc = check_declared(be, cfg, sec, opt);
    if (rc)
      return rc;
    if (!be->configure)
      return set_error(QKEEP_E_CONFIG, "%s:%d: [backend.%s] %s: backend '%s' takes no options", cfg->path,
                       opt->line, sec->name, opt->key, be->name);
    set_error(QKEEP_OK, "%s", "");
    rc = be->configure(be, opt->key, opt->value);
    if (rc != 0)
      return add_error_context(rc < 0 ? rc : QKEEP_E_CONFIG, "%s:%d: [backend.%s] %s", cfg->path, opt->line,
                               sec->name, opt->key);
  }
  error_restore(&saved);
  return 0;
}

int qkeep_plugin_keys(const qkeep_plugin *plugin, int (*fn)(void *user, const struct qkeep_backend_key *key),
                      void *user) {
  if (!plugin || !fn)
    return set_error(QKEEP_E_INVAL, "qkeep_plugin_keys: NULL argument");
  size_t n = 0, stride = 0;
  const struct qkeep_backend_key *keys = declared_keys(plugin->be, &n, &stride);
  if (!keys)
    return QKEEP_E_NOTFOUND;
  for (size_t i = 0; i < n; i++) {
    struct qkeep_backend_key k = {0};
    memcpy(&k, key_at(keys, stride, i), stride < sizeof k ? stride : sizeof k);
    int rc = fn(user, &k);
    if (rc)
      return rc;
  }
  return 0;
}

int qkeep_plugin_open_config(const qkeep_config *cfg, qkeep_plugin **out) {
  if (!cfg || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_plugin_open_config: config and out must not be NULL");
  *out = NULL;
  qkeep_plugin *plugin;
  int rc = qkeep_plugin_open(cfg->backend, cfg->plugin_dir, &plugin);
  if (rc)
    return add_error_context(rc, "%s:%d: backend '%s'", cfg->path, cfg->backend_line, cfg->backend);
  rc = qkeep_plugin_configure(plugin, cfg);
  if (rc) {
    qkeep_plugin_close(plugin);
    return rc;
  }
  *out = plugin;
  return 0;
}

int qkeep_plugins_open_config(const qkeep_config *cfg, qkeep_plugin ***plugins, size_t *n) {
  if (!cfg || !plugins || !n)
    return set_error(QKEEP_E_INVAL, "qkeep_plugins_open_config: NULL argument");
  *plugins = NULL;
  *n = 0;
  qkeep_plugin **list = calloc(cfg->n_backends ? cfg->n_backends : 1, sizeof *list);
  if (!list)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  int rc = 0;
  for (size_t i = 0; i < cfg->n_backends && !rc; i++) {
    rc = qkeep_plugin_open(cfg->backends[i], cfg->plugin_dir, &list[i]);
    if (rc)
      rc = add_error_context(rc, "%s:%d: backend '%s' (chain position %zu)", cfg->path, cfg->backend_line,
                             cfg->backends[i], i + 1);
    else
      rc = qkeep_plugin_configure(list[i], cfg);
  }
  if (rc) {
    qkeep_plugins_close(list, cfg->n_backends); /* the unopened entries are NULL */
    return rc;
  }
  *plugins = list;
  *n = cfg->n_backends;
  return 0;
}

void qkeep_plugins_close(qkeep_plugin **plugins, size_t n) {
  if (!plugins)
    return;
  for (size_t i = 0; i < n; i++)
    qkeep_plugin_close(plugins[i]);
  free(plugins);
}

int qkeep_plugin_probe(qkeep_plugin *plugin, char *msg, size_t msg_len) {
  char local[512];
  if (!msg || !msg_len) { /* the backend always gets somewhere to write */
    msg = local;
    msg_len = sizeof local;
  }
  msg[0] = '\0';
  if (!plugin)
    return set_error(QKEEP_E_INVAL, "qkeep_plugin_probe: plugin must not be NULL");
  const struct qkeep_backend *be = plugin->be;
  if (!be->probe)
    return 0; /* no probe: the device is assumed present */
  int rc = be->probe(be, msg, msg_len);
  msg[msg_len - 1] = '\0';
  if (rc == 0)
    return 0;
  if (rc > 0)
    rc = QKEEP_E_PLUGIN;
  return set_error(rc, "%s: backend '%s': %s: %s", plugin->path, be->name, qkeep_strerror(rc),
                   msg[0] ? msg : "probe gave no detail");
}

int plugin_probe_once(qkeep_plugin *plugin, const char **msg) {
  if (!plugin->probed) {
    struct saved_error saved;
    error_save(&saved);
    plugin->probe_rc = qkeep_plugin_probe(plugin, plugin->probe_msg, sizeof plugin->probe_msg);
    plugin->probed = true;
    if (plugin->probe_rc)
      log_msg(QKEEP_LOG_WARN, "backend %s skipped: %s", plugin->be->name,
              plugin->probe_msg[0] ? plugin->probe_msg : qkeep_strerror(plugin->probe_rc));
    error_restore(&saved);
  }
  *msg = plugin->probe_msg;
  return plugin->probe_rc;
}

/* ---- scan ------------------------------------------------------------------------------------ */

/* The backend name of a directory entry "backend-NAME.so" (its start and length in entry); false if it
 * is not one. */
static bool entry_backend_name(const char *entry, const char **name, size_t *name_len) {
  size_t len = strlen(entry), pre = strlen(PLUGIN_PREFIX), suf = strlen(PLUGIN_SUFFIX);
  if (len <= pre + suf || strncmp(entry, PLUGIN_PREFIX, pre) != 0 ||
      strcmp(entry + len - suf, PLUGIN_SUFFIX) != 0)
    return false;
  *name = entry + pre;
  *name_len = len - pre - suf;
  return valid_name_n(*name, *name_len);
}

static int compare_names(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The backend names in one directory, sorted. A directory that cannot be read has none. */
static int list_dir(const char *dir, struct strlist *names) {
  memset(names, 0, sizeof *names);
  DIR *d = opendir(dir);
  if (!d)
    return 0;
  int rc = 0;
  struct dirent *ent;
  const char *name;
  size_t name_len;
  while (!rc && (ent = readdir(d)) != NULL)
    if (entry_backend_name(ent->d_name, &name, &name_len))
      rc = strlist_add(names, name, name_len);
  closedir(d);
  if (rc)
    strlist_free(names);
  else if (names->n > 1)
    qsort(names->items, names->n, sizeof *names->items, compare_names);
  return rc;
}

static bool seen_name(const struct strlist *seen, const char *name) {
  for (size_t i = 0; i < seen->n; i++)
    if (strcmp(seen->items[i], name) == 0)
      return true;
  return false;
}

int qkeep_plugin_scan(const char *plugin_dir, int (*fn)(void *user, const char *name, const char *path),
                      void *user) {
  if (!fn)
    return set_error(QKEEP_E_INVAL, "qkeep_plugin_scan: fn must not be NULL");
  struct strlist sp, seen = {0}; /* seen: names already reported */
  int rc = search_path_build(plugin_dir, &sp);
  for (size_t i = 0; !rc && i < sp.n; i++) {
    struct strlist names;
    rc = list_dir(sp.items[i], &names);
    for (size_t j = 0; !rc && j < names.n; j++) {
      const char *name = names.items[j];
      if (seen_name(&seen, name))
        continue; /* an earlier directory has it: open would load that one */
      char *path = plugin_file(sp.items[i], name);
      if (!path) {
        rc = set_error(QKEEP_E_NOMEM, "out of memory");
        break;
      }
      /* Only files count, as for open (a directory named backend-x.so is not a plugin). */
      if (is_regular_file(path)) {
        rc = strlist_add(&seen, name, strlen(name));
        if (!rc)
          rc = fn(user, name, path);
      }
      free(path);
    }
    strlist_free(&names);
  }
  strlist_free(&seen);
  strlist_free(&sp);
  return rc;
}
