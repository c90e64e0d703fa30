/*
 * config.c: the INI configuration (README.md, "The config").
 *
 *   [qkeep]          backend = NAME[, NAME...] (required: the chain, in order), plugin_dir = DIR
 *   [model]          checkpoint = PATH, reload_checkpoint = PATH, fuse = MAP
 *   [backend.NAME]   any keys, passed to that backend in file order
 *
 * inih does the key = value splitting; we feed it one physical line at a time
 * through our own reader, which lets us count lines exactly, see section
 * headers even when a section has no keys, and refuse what inih would silently
 * mangle (over-long lines, indented continuation lines). Every error is
 * "PATH:LINE: detail", and the first one wins: it is the one to fix.
 */
#include <errno.h>
#include <fcntl.h>
#include <ini.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "format/conf.h"
#include "format/fusion.h"

enum section_kind { SECTION_NONE, SECTION_QKEEP, SECTION_MODEL, SECTION_BACKEND };

struct parse_state {
  qkeep_config *cfg;
  FILE *file;
  char *line; /* getline buffer */
  size_t line_cap;
  int lineno; /* the physical line the reader last handed to inih */

  enum section_kind section;
  size_t backend_index; /* into cfg->sections when section is SECTION_BACKEND */
  bool key_in_section;  /* a key since the last header: an indented line would continue its value */
  int qkeep_line;       /* line of the first [qkeep] header, 0 when none */
  int plugin_dir_line, checkpoint_line, reload_line, fuse_line;

  int err_code; /* first failure, 0 when none; the detail is already in qkeep_errmsg() */
  int err_line;
};

/* Backend names go into file names (backend-NAME.so), so keep them to a safe alphabet. */
static bool valid_backend_name(const char *s) {
  if (!*s)
    return false;
  for (; *s; s++)
    if (!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') || *s == '_' || *s == '-'))
      return false;
  return true;
}

static bool is_blank(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f' || c == '\v';
}

static int parse_fail(struct parse_state *st, int code, const char *fmt, ...) PRINTF_LIKE(3, 4);

/* Records the first error of the parse as "PATH:LINE: detail"; later ones are dropped. */
static int parse_fail(struct parse_state *st, int code, const char *fmt, ...) {
  char detail[1024];
  va_list ap;
  if (st->err_code)
    return st->err_code;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  st->err_code = code;
  st->err_line = st->lineno;
  return set_error(code, "%s:%d: %s", st->cfg->path, st->lineno, detail);
}

/* A path from the file, resolved against the config file's directory when relative. */
static char *resolve_path(const char *config_path, const char *value) {
  const char *slash = strrchr(config_path, '/');
  if (value[0] == '/' || !slash)
    return xstrdup(value);
  size_t dir_len = (size_t)(slash - config_path) + 1; /* keeps the '/' */
  size_t n = dir_len + strlen(value) + 1;
  char *p = malloc(n);
  if (p) {
    memcpy(p, config_path, dir_len);
    memcpy(p + dir_len, value, n - dir_len);
  }
  return p;
}

/* A colon-separated list of paths, each resolved like resolve_path. */
static char *resolve_path_list(const char *config_path, const char *value) {
  char *out = xstrdup("");
  for (const char *p = value; out && *p;) {
    size_t len = strcspn(p, ":");
    char *entry = strndup(p, len), *resolved = entry ? resolve_path(config_path, entry) : NULL;
    char *joined = resolved ? malloc(strlen(out) + strlen(resolved) + 2) : NULL;
    if (joined)
      sprintf(joined, "%s%s%s", out, *out ? ":" : "", resolved);
    free(entry);
    free(resolved);
    free(out);
    out = joined;
    p += len + (p[len] == ':');
  }
  return out;
}

static struct config_backend_section *find_section(const qkeep_config *cfg, const char *name, size_t *index) {
  for (size_t i = 0; i < cfg->n_sections; i++)
    if (strcmp(cfg->sections[i].name, name) == 0) {
      if (index)
        *index = i;
      return &cfg->sections[i];
    }
  return NULL;
}

const struct config_backend_section *config_section(const qkeep_config *cfg, const char *backend) {
  if (!cfg || !backend)
    return NULL;
  return find_section(cfg, backend, NULL);
}

/* [backend.NAME] may appear more than once; its keys then go to one section. */
static int open_backend_section(struct parse_state *st, const char *name) {
  qkeep_config *cfg = st->cfg;
  if (find_section(cfg, name, &st->backend_index))
    return 0;
  int rc =
      grow_array((void **)&cfg->sections, &cfg->cap_sections, cfg->n_sections + 1, sizeof *cfg->sections);
  if (rc)
    return parse_fail(st, rc, "out of memory");
  struct config_backend_section *sec = &cfg->sections[cfg->n_sections];
  memset(sec, 0, sizeof *sec);
  if (!(sec->name = xstrdup(name)))
    return parse_fail(st, QKEEP_E_NOMEM, "out of memory");
  sec->line = st->lineno;
  st->backend_index = cfg->n_sections++;
  return 0;
}

/* Enters the section of a "[name]" header. */
static int enter_section(struct parse_state *st, const char *name) {
  st->key_in_section = false;
  if (strcmp(name, "qkeep") == 0) {
    st->section = SECTION_QKEEP;
    if (!st->qkeep_line)
      st->qkeep_line = st->lineno;
    return 0;
  }
  if (strcmp(name, "model") == 0) {
    st->section = SECTION_MODEL;
    return 0;
  }
  if (strncmp(name, "backend.", 8) == 0) {
    if (!valid_backend_name(name + 8))
      return parse_fail(st, QKEEP_E_CONFIG,
                        "invalid backend name in section [%s] (use a-z, 0-9, '-' and '_')", name);
    st->section = SECTION_BACKEND;
    return open_backend_section(st, name + 8);
  }
  return parse_fail(st, QKEEP_E_CONFIG, "unknown section [%s] (expected [qkeep], [model] or [backend.NAME])",
                    name);
}

/*
 * Looks at one physical line before inih does. Catches what inih would accept
 * but get wrong for us: an indented line after a key (inih appends it to that
 * key as a continuation, even when it looks like "key = value" or a header),
 * and section headers (inih calls no handler for a section without keys).
 * Lines inih rejects outright are left to it.
 */
static int inspect_line(struct parse_state *st, char *text) {
  char *start = text;
  while (is_blank(*start))
    start++;
  if (!*start || *start == ';' || *start == '#')
    return 0;
  if (start > text && st->key_in_section)
    return parse_fail(st, QKEEP_E_CONFIG,
                      "indented line would continue the previous value; multi-line values are not supported");
  if (*start != '[') {
    st->key_in_section = true;
    return 0;
  }
  /* The header ends at the first ']'; what follows it is ignored, as inih does. */
  char *end = strchr(start + 1, ']');
  if (!end)
    return 0; /* inih reports the syntax error */
  *end = '\0';
  int rc = enter_section(st, start + 1);
  *end = ']';
  return rc;
}

static int handle_pair_at(struct parse_state *st, const char *key, const char *value);

/*
 * A line longer than inih's buffer, read as inih reads one: a comment or blank line is nothing;
 * "key = value" (or "key: value") has its key and value trimmed and an inline comment (';'
 * after a blank) cut. A section header that long is refused: no section name is.
 */
static int long_pair(struct parse_state *st, char *text) {
  char *p = text;
  while (is_blank(*p))
    p++;
  size_t len = strlen(p);
  while (len && (is_blank(p[len - 1]) || p[len - 1] == '\n' || p[len - 1] == '\r'))
    p[--len] = '\0';
  if (!*p || *p == ';' || *p == '#')
    return 0;
  if (*p == '[')
    return parse_fail(st, QKEEP_E_CONFIG, "section header too long (%zu characters)", len);
  char *delim = p + strcspn(p, "=:");
  if (!*delim)
    return parse_fail(st, QKEEP_E_CONFIG, "syntax error (expected [section], key = value or a comment)");
  *delim = '\0';
  for (size_t k = strlen(p); k && is_blank(p[k - 1]);)
    p[--k] = '\0';
  char *value = delim + 1;
  while (is_blank(*value))
    value++;
  for (char *c = value; *c; c++)
    if (*c == ';' && c > value && is_blank(c[-1])) {
      *c = '\0';
      break;
    }
  for (size_t k = strlen(value); k && is_blank(value[k - 1]);)
    value[--k] = '\0';
  handle_pair_at(st, p, value);
  return st->err_code;
}

/*
 * inih's fgets-style reader. Hands over exactly one physical line per call, so
 * st->lineno is the line inih is on, and stops at the first error we found.
 */
static char *read_line(char *buf, int buf_len, void *user) {
  struct parse_state *st = user;
  if (st->err_code)
    return NULL;
  errno = 0;
  ssize_t n = getline(&st->line, &st->line_cap, st->file);
  if (n < 0) {
    if (ferror(st->file)) {
      const char *why = errno ? strerror(errno) : "read error";
      st->err_code = set_error(QKEEP_E_IO, "%s: cannot read config: %s", st->cfg->path, why);
      st->err_line = st->lineno + 1;
    }
    return NULL;
  }
  st->lineno++;
  char *text = st->line;
  if (st->lineno == 1 && strncmp(text, "\xEF\xBB\xBF", 3) == 0) { /* UTF-8 byte order mark */
    text += 3;
    n -= 3;
  }
  if (strlen(text) != (size_t)n) {
    parse_fail(st, QKEEP_E_CONFIG, "line contains a NUL byte");
    return NULL;
  }
  if (inspect_line(st, text))
    return NULL;
  /* inih's line buffer holds buf_len - 1 characters and would split a longer line in two
   * (long paths are common): we read such a key = value ourselves and hand inih a blank line. */
  if (buf_len < 2 || n > buf_len - 2) {
    if (long_pair(st, text) || buf_len < 2)
      return NULL;
    strcpy(buf, "\n");
    return buf;
  }
  memcpy(buf, text, (size_t)n + 1);
  return buf;
}

/* Sets a [qkeep] or [model] value once; a second assignment is an error, not an override. */
static int set_once(struct parse_state *st, const char *section, const char *key, int *line, char **field,
                    char *value) {
  if (!value)
    return parse_fail(st, QKEEP_E_NOMEM, "out of memory");
  if (*line) {
    free(value);
    return parse_fail(st, QKEEP_E_CONFIG, "[%s] duplicate key '%s' (first set on line %d)", section, key,
                      *line);
  }
  *field = value;
  *line = st->lineno;
  return 0;
}

/* "a, b, c": the chain's names, each valid and given once. */
static int parse_chain(struct parse_state *st, const char *value) {
  qkeep_config *cfg = st->cfg;
  size_t cap = 0;
  for (const char *p = value;;) {
    p += strspn(p, " \t");
    size_t n = strcspn(p, ",");
    size_t trimmed = n;
    while (trimmed && (p[trimmed - 1] == ' ' || p[trimmed - 1] == '\t'))
      trimmed--;
    char *name = strndup(p, trimmed);
    if (!name)
      return set_error(QKEEP_E_NOMEM, "%s: out of memory parsing the config", cfg->path);
    int rc = valid_backend_name(name)
                 ? 0
                 : parse_fail(st, QKEEP_E_CONFIG,
                              "[qkeep] backend: invalid name '%s' in '%s' (a comma-separated list of names "
                              "of a-z, 0-9, '-' and '_')",
                              name, value);
    for (size_t i = 0; !rc && i < cfg->n_backends; i++)
      if (strcmp(cfg->backends[i], name) == 0)
        rc = parse_fail(st, QKEEP_E_CONFIG, "[qkeep] backend: '%s' is named twice in the chain", name);
    if (!rc)
      rc = grow_array((void **)&cfg->backends, &cap, cfg->n_backends + 1, sizeof *cfg->backends);
    if (rc) {
      free(name);
      return rc;
    }
    cfg->backends[cfg->n_backends++] = name;
    if (!p[n])
      return 0;
    p += n + 1;
  }
}

static int handle_qkeep(struct parse_state *st, const char *key, const char *value) {
  qkeep_config *cfg = st->cfg;
  if (strcmp(key, "backend") == 0) {
    if (cfg->backend_line)
      return parse_fail(st, QKEEP_E_CONFIG, "[qkeep] duplicate key 'backend' (first set on line %d)",
                        cfg->backend_line);
    cfg->backend_line = st->lineno;
    int rc = parse_chain(st, value);
    if (!rc)
      cfg->backend = cfg->backends[0];
    return rc;
  }
  if (strcmp(key, "plugin_dir") == 0) {
    size_t len = strlen(value);
    if (value[0] == ':' || value[len - 1] == ':' || strstr(value, "::"))
      return parse_fail(st, QKEEP_E_CONFIG,
                        "[qkeep] plugin_dir: empty entry in '%s' (entries are separated by ':'; write . for "
                        "the config's own directory)",
                        value);
    return set_once(st, "qkeep", key, &st->plugin_dir_line, &cfg->plugin_dir,
                    resolve_path_list(cfg->path, value));
  }
  return parse_fail(st, QKEEP_E_CONFIG, "[qkeep] unknown key '%s' (expected backend or plugin_dir)", key);
}

/* "true" / "false" (also 1 / 0, yes / no) into *out; false when it is neither. */
static bool parse_bool(const char *value, bool *out) {
  static const char *const yes[] = {"true", "1", "yes"}, *const no[] = {"false", "0", "no"};
  for (int i = 0; i < 3; i++)
    if (strcmp(value, yes[i]) == 0 || strcmp(value, no[i]) == 0) {
      *out = strcmp(value, yes[i]) == 0;
      return true;
    }
  return false;
}

/* [model] quantize and its options (what `qkeep quantize` takes), by cfg->quantize_line's index; and each
 * option's name as qkeep_quantize_option_applies knows it (the qkeep command's flag, less its dashes). */
static const char *const quantize_keys[8] = {"quantize",
                                             "quantize_group",
                                             "quantize_asym",
                                             "quantize_static_input",
                                             "quantize_asym_input",
                                             "quantize_kv_scales",
                                             "quantize_activation_amax",
                                             "quantize_threads"};
static const char *const quantize_options[8] = {
    NULL, "group", "asym", "static-input", "asym-input", "kv-scales", "activation-amax", "threads"};

/* [model] quantize and its options; 1 when the key is none of them. */
static int handle_quantize(struct parse_state *st, const char *key, const char *value) {
  const char *const *keys = quantize_keys;
  static const char *const schemes[] = {"modelopt-nvfp4", "ct-nvfp4", "mxfp4",  "w8a8-int8",
                                        "gptq-int4",      "awq-int4", "ct-int4"};
  qkeep_config *cfg = st->cfg;
  struct qkeep_quantize_options *q = &cfg->quantize;
  int i = 0;
  while (i < 8 && strcmp(key, keys[i]) != 0)
    i++;
  if (i == 8)
    return 1;
  if (cfg->quantize_line[i])
    return parse_fail(st, QKEEP_E_CONFIG, "[model] duplicate key '%s' (first set on line %d)", key,
                      cfg->quantize_line[i]);
  cfg->quantize_line[i] = st->lineno;
  q->size = sizeof *q;
  char *end = NULL;
  bool ok = true;
  switch (i) {
  case 0: {
    size_t s = 0;
    while (s < sizeof schemes / sizeof schemes[0] && strcmp(value, schemes[s]) != 0)
      s++;
    if (s == sizeof schemes / sizeof schemes[0])
      return parse_fail(st, QKEEP_E_CONFIG,
                        "[model] quantize: unknown scheme '%s' (expected modelopt-nvfp4, ct-nvfp4, mxfp4, "
                        "w8a8-int8, gptq-int4, awq-int4 or ct-int4)",
                        value);
    if (!(cfg->quantize_scheme = xstrdup(value)))
      return parse_fail(st, QKEEP_E_NOMEM, "out of memory");
    q->scheme = cfg->quantize_scheme;
    return 0;
  }
  case 1:
  case 7: {
    long v = strtol(value, &end, 10);
    ok = *value && !*end && v >= (i == 1 ? 1 : 0) && v <= (i == 1 ? INT32_MAX : 1024);
    if (ok && i == 1)
      q->group_size = v;
    else if (ok)
      q->threads = (int)v;
    if (!ok)
      return parse_fail(st, QKEEP_E_CONFIG, "[model] %s: '%s' is not %s", key, value,
                        i == 1 ? "a group size from 1 to 2147483647"
                               : "a thread count from 0 (every core) to 1024");
    return 0;
  }
  case 6: {
    float v = strtof(value, &end);
    if (!*value || *end || !(v > 0) || v > 3.0e38f)
      return parse_fail(st, QKEEP_E_CONFIG, "[model] %s: '%s' is not a finite number > 0", key, value);
    q->activation_amax = v;
    return 0;
  }
  default: {
    bool *fields[] = {&q->asym_weights, &q->static_input, &q->asym_input, &q->kv_cache_scales};
    if (!parse_bool(value, fields[i - 2]))
      return parse_fail(st, QKEEP_E_CONFIG, "[model] %s: '%s' is not true or false", key, value);
    return 0;
  }
  }
}

static int handle_model(struct parse_state *st, const char *key, const char *value) {
  qkeep_config *cfg = st->cfg;
  if (strcmp(key, "checkpoint") == 0)
    return set_once(st, "model", key, &st->checkpoint_line, &cfg->checkpoint, resolve_path(cfg->path, value));
  if (strcmp(key, "reload_checkpoint") == 0)
    return set_once(st, "model", key, &st->reload_line, &cfg->reload_checkpoint,
                    resolve_path(cfg->path, value));
  if (strcmp(key, "fuse") == 0) {
    /* Checked now, so a bad map is a config error with its line. */
    struct fusion_rule *rules;
    size_t n;
    int rc = fusion_parse(value, &rules, &n);
    if (!rc)
      fusion_rules_free(rules, n);
    if (rc)
      return parse_fail(st, QKEEP_E_CONFIG, "[model] fuse: %s", qkeep_errmsg());
    return set_once(st, "model", key, &st->fuse_line, &cfg->fuse, xstrdup(value));
  }
  static const char *const parallel_keys[4] = {"tp_size", "tp_rank", "ep_size", "ep_rank"};
  for (int i = 0; i < 4; i++) {
    if (strcmp(key, parallel_keys[i]) != 0)
      continue;
    int *fields[4] = {&cfg->parallel.tp_size, &cfg->parallel.tp_rank, &cfg->parallel.ep_size,
                      &cfg->parallel.ep_rank};
    char *end;
    long v = strtol(value, &end, 10);
    if (*value == '\0' || *end != '\0' || v < 0 || v > 65536 || (i % 2 == 0 && v == 0))
      return parse_fail(st, QKEEP_E_CONFIG, "[model] %s: '%s' is not %s", key, value,
                        i % 2 == 0 ? "a size from 1 to 65536" : "a rank from 0 to 65535");
    if (cfg->parallel_line[i])
      return parse_fail(st, QKEEP_E_CONFIG, "[model] duplicate key '%s' (first set on line %d)", key,
                        cfg->parallel_line[i]);
    *fields[i] = (int)v;
    cfg->parallel_line[i] = st->lineno;
    return 0;
  }
  int handled = handle_quantize(st, key, value);
  if (handled != 1)
    return handled;
  return parse_fail(
      st, QKEEP_E_CONFIG,
      "[model] unknown key '%s' (expected checkpoint, reload_checkpoint, fuse, tp_size, tp_rank, "
      "ep_size, ep_rank, quantize, quantize_group, quantize_asym, quantize_static_input, "
      "quantize_asym_input, quantize_kv_scales, quantize_activation_amax or quantize_threads)",
      key);
}

/* Backend keys are the backend's business; we only keep them, in order, with their lines. */
static int handle_backend(struct parse_state *st, const char *key, const char *value) {
  struct config_backend_section *sec = &st->cfg->sections[st->backend_index];
  for (size_t i = 0; i < sec->n_options; i++)
    if (strcmp(sec->options[i].key, key) == 0)
      return parse_fail(st, QKEEP_E_CONFIG, "[backend.%s] duplicate key '%s' (first set on line %d)",
                        sec->name, key, sec->options[i].line);
  int rc = grow_array((void **)&sec->options, &sec->cap_options, sec->n_options + 1, sizeof *sec->options);
  if (rc)
    return parse_fail(st, rc, "out of memory");
  struct config_option *opt = &sec->options[sec->n_options];
  opt->key = xstrdup(key);
  opt->value = xstrdup(value);
  opt->line = st->lineno;
  if (!opt->key || !opt->value) {
    free(opt->key);
    free(opt->value);
    return parse_fail(st, QKEEP_E_NOMEM, "out of memory");
  }
  sec->n_options++;
  return 0;
}

/* inih's callback: returns nonzero to go on. The section comes from our reader, which saw the header. */
#if INI_HANDLER_LINENO
static int handle_pair(void *user, const char *section, const char *key, const char *value, int lineno) {
  (void)lineno; /* equals st->lineno: the reader hands over one physical line per call */
#else
static int handle_pair(void *user, const char *section, const char *key, const char *value) {
#endif
  struct parse_state *st = user;
  (void)section;
  if (st->err_code)
    return 0;
  if (st->section == SECTION_NONE)
    return !parse_fail(st, QKEEP_E_CONFIG,
                       "key '%s' outside any section (put it under [qkeep], [model] or [backend.NAME])", key);
  if (!*key)
    return !parse_fail(st, QKEEP_E_CONFIG, "missing key before '='");
  if (!value || !*value) {
    const char *backend = st->section == SECTION_BACKEND ? st->cfg->sections[st->backend_index].name : NULL;
    return !parse_fail(st, QKEEP_E_CONFIG, "[%s%s] %s: empty value",
                       backend ? "backend." : (st->section == SECTION_QKEEP ? "qkeep" : "model"),
                       backend ? backend : "", key);
  }
  switch (st->section) {
  case SECTION_QKEEP: return !handle_qkeep(st, key, value);
  case SECTION_MODEL: return !handle_model(st, key, value);
  case SECTION_BACKEND: return !handle_backend(st, key, value);
  case SECTION_NONE: break;
  }
  return 0;
}

/* handle_pair for a line read without inih (long_pair). */
static int handle_pair_at(struct parse_state *st, const char *key, const char *value) {
#if INI_HANDLER_LINENO
  return handle_pair(st, NULL, key, value, st->lineno);
#else
  return handle_pair(st, NULL, key, value);
#endif
}

/* Edit distance of a and b, capped: enough to tell a misspelt backend name. */
static size_t edit_distance(const char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b);
  if (la > 64 || lb > 64)
    return 64;
  size_t row[65];
  for (size_t j = 0; j <= lb; j++)
    row[j] = j;
  for (size_t i = 1; i <= la; i++) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= lb; j++) {
      size_t up = row[j], best = diag + (a[i - 1] != b[j - 1]);
      best = up + 1 < best ? up + 1 : best;
      best = row[j - 1] + 1 < best ? row[j - 1] + 1 : best;
      row[j] = best;
      diag = up;
    }
  }
  return row[lb];
}

/*
 * Every [backend.NAME] names a backend of the chain, or reference (the oracle `qkeep run` checks
 * against, configured from its section): keys for a backend that never runs would be ignored, and a
 * misspelt name would hide its keys. The error has the header's line and the close name, if any.
 */
static int check_sections(struct parse_state *st) {
  const qkeep_config *cfg = st->cfg;
  for (size_t i = 0; i < cfg->n_sections; i++) {
    const char *name = cfg->sections[i].name;
    bool known = strcmp(name, "reference") == 0;
    const char *close = NULL;
    size_t best = 3; /* at most 2 edits away */
    for (size_t b = 0; b < cfg->n_backends && !known; b++) {
      known = strcmp(cfg->backends[b], name) == 0;
      size_t d = edit_distance(cfg->backends[b], name);
      if (d < best)
        best = d, close = cfg->backends[b];
    }
    if (known)
      continue;
    st->lineno = cfg->sections[i].line;
    if (close)
      return parse_fail(st, QKEEP_E_CONFIG,
                        "[backend.%s]: no backend '%s' in the chain (did you mean [backend.%s]?)", name, name,
                        close);
    return parse_fail(st, QKEEP_E_CONFIG,
                      "[backend.%s]: backend '%s' is not in the chain (line %d: backend = ...), so its keys "
                      "would never be used",
                      name, name, cfg->backend_line);
  }
  return 0;
}

/* A rank below its group's size (1 when not set), the error on the rank's line. */
static int check_ranks(struct parse_state *st) {
  const qkeep_config *cfg = st->cfg;
  static const char *const names[2][2] = {{"tp_size", "tp_rank"}, {"ep_size", "ep_rank"}};
  const int sizes[2] = {cfg->parallel.tp_size, cfg->parallel.ep_size};
  const int ranks[2] = {cfg->parallel.tp_rank, cfg->parallel.ep_rank};
  for (int g = 0; g < 2; g++) {
    int size = sizes[g] > 0 ? sizes[g] : 1;
    if (!cfg->parallel_line[2 * g + 1] || ranks[g] < size)
      continue;
    st->lineno = cfg->parallel_line[2 * g + 1];
    return parse_fail(st, QKEEP_E_CONFIG, "[model] %s = %d: out of range for %s = %d (ranks 0 to %d)",
                      names[g][1], ranks[g], names[g][0], size, size - 1);
  }
  return 0;
}

/* The quantize_* keys against the scheme of [model] quantize: each must apply to it
 * (qkeep_quantize_option_applies, the table the qkeep command's flags are checked by too), and none comes
 * without it. QKEEP_E_INVAL on the line of the first key (in file order) that does not. */
static int check_quantize_keys(struct parse_state *st) {
  qkeep_config *cfg = st->cfg;
  const struct qkeep_quantize_options *q = &cfg->quantize;
  const char *const *options = quantize_options;
  int first = 0;
  const char *why = NULL;
  for (int i = 1; i < 8; i++) {
    const char *because = NULL;
    if (!cfg->quantize_line[i] || (first && cfg->quantize_line[i] > cfg->quantize_line[first]))
      continue;
    if (cfg->quantize_scheme &&
        qkeep_quantize_option_applies(cfg->quantize_scheme, options[i], q, &because) == 0)
      continue;
    first = i, why = because;
  }
  if (!first)
    return 0;
  st->lineno = cfg->quantize_line[first];
  if (!cfg->quantize_scheme)
    return parse_fail(st, QKEEP_E_INVAL,
                      "[model] %s needs quantize = SCHEME (it is an option of quantizing on load)",
                      quantize_keys[first]);
  return parse_fail(st, QKEEP_E_INVAL, "[model] %s does not apply to quantize = %s (%s)",
                    quantize_keys[first], cfg->quantize_scheme, why ? why : "");
}

/* Runs inih over the open file; returns 0 or the first error, its detail set. */
static int parse_file(struct parse_state *st) {
  int bad_line = ini_parse_stream(read_line, st, handle_pair, st);
  if (bad_line == -2 && !st->err_code)
    return set_error(QKEEP_E_NOMEM, "%s: out of memory parsing the config", st->cfg->path);
  /* inih reports the first line it rejected; a syntax error before our first error wins. */
  if (bad_line > 0 && (!st->err_code || bad_line < st->err_line)) {
    st->lineno = bad_line;
    st->err_code = 0;
    return parse_fail(st, QKEEP_E_CONFIG, "syntax error (expected [section], key = value or a comment)");
  }
  if (st->err_code)
    return st->err_code;
  if (!st->cfg->backend) {
    if (st->qkeep_line) {
      st->lineno = st->qkeep_line;
      return parse_fail(st, QKEEP_E_CONFIG, "[qkeep] has no backend (add backend = NAME)");
    }
    /* No [qkeep] at all: point at the end of the file. */
    return parse_fail(st, QKEEP_E_CONFIG, "missing [qkeep] section with backend = NAME");
  }
  int rc = check_sections(st);
  if (!rc)
    rc = check_ranks(st);
  return rc ? rc : check_quantize_keys(st);
}

int qkeep_config_load(const char *path, qkeep_config **out) {
  if (!path || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_config_load: path and out must not be NULL");
  *out = NULL;
  qkeep_config *cfg = calloc(1, sizeof *cfg);
  if (!cfg || !(cfg->path = xstrdup(path))) {
    free(cfg);
    return set_error(QKEEP_E_NOMEM, "%s: out of memory", path);
  }
  /* Non-blocking, so that a FIFO in the config's place cannot hang the open; then regular files only. */
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  struct stat sb;
  FILE *file = NULL;
  int err = fd < 0 ? errno : fstat(fd, &sb) ? errno : 0;
  if (!err && !S_ISREG(sb.st_mode)) {
    close(fd);
    qkeep_config_free(cfg);
    return set_error(QKEEP_E_IO, "%s: cannot open config: not a regular file", path);
  }
  if (!err && (fcntl(fd, F_SETFL, 0) != 0 || !(file = fdopen(fd, "r"))))
    err = errno;
  if (err) {
    if (fd >= 0 && !file)
      close(fd);
    qkeep_config_free(cfg);
    return set_error(error_from_errno(err), "%s: cannot open config: %s", path, strerror(err));
  }
  struct parse_state st = {.cfg = cfg, .file = file};
  int rc = parse_file(&st);
  free(st.line);
  fclose(file);
  if (rc) {
    qkeep_config_free(cfg);
    return rc;
  }
  *out = cfg;
  return 0;
}

void qkeep_config_free(qkeep_config *cfg) {
  if (!cfg)
    return;
  for (size_t i = 0; i < cfg->n_sections; i++) {
    struct config_backend_section *sec = &cfg->sections[i];
    for (size_t j = 0; j < sec->n_options; j++) {
      free(sec->options[j].key);
      free(sec->options[j].value);
    }
    free(sec->options);
    free(sec->name);
  }
  free(cfg->sections);
  free(cfg->path);
  for (size_t i = 0; i < cfg->n_backends; i++)
    free(cfg->backends[i]);
  free(cfg->backends);
  free(cfg->plugin_dir);
  free(cfg->checkpoint);
  free(cfg->reload_checkpoint);
  free(cfg->fuse);
  free(cfg->quantize_scheme);
  free(cfg);
}

const char *qkeep_config_backend(const qkeep_config *cfg) { return cfg ? cfg->backend : NULL; }
size_t qkeep_config_backend_count(const qkeep_config *cfg) { return cfg ? cfg->n_backends : 0; }
const char *qkeep_config_backend_at(const qkeep_config *cfg, size_t index) {
  return cfg && index < cfg->n_backends ? cfg->backends[index] : NULL;
}
const char *qkeep_config_plugin_dir(const qkeep_config *cfg) { return cfg ? cfg->plugin_dir : NULL; }
const char *qkeep_config_checkpoint(const qkeep_config *cfg) { return cfg ? cfg->checkpoint : NULL; }
const char *qkeep_config_reload_checkpoint(const qkeep_config *cfg) {
  return cfg ? cfg->reload_checkpoint : NULL;
}
const char *qkeep_config_fuse(const qkeep_config *cfg) { return cfg ? cfg->fuse : NULL; }

int qkeep_config_quantize(const qkeep_config *cfg, struct qkeep_quantize_options *out) {
  if (!cfg || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_config_quantize: NULL argument");
  if (!cfg->quantize_scheme)
    return QKEEP_E_NOTFOUND;
  copy_sized(out, &cfg->quantize, sizeof cfg->quantize);
  return 0;
}

int qkeep_config_parallel(const qkeep_config *cfg, struct qkeep_parallel *out) {
  if (!cfg || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_config_parallel: NULL argument");
  struct qkeep_parallel p = cfg->parallel;
  p.size = sizeof p;
  copy_sized(out, &p, sizeof p);
  return 0;
}
const char *qkeep_config_path(const qkeep_config *cfg) { return cfg ? cfg->path : NULL; }
