/*
 * ignore.c: a quantization config's ignore list, compiled for matching
 * (see checkpoint.h: quant_config_match_ignore).
 *
 * Three kinds of entry, matched as the exporters that write them do:
 * - plain names ("lm_head", "model.layers.0.mlp"): an entry covers a module
 *   when it is a dot-bounded run of the module's components (the module, a
 *   dot-suffix, a parent or a parent's suffix). All plain entries sit in one
 *   hash set, and a module of k components is k(k+1)/2 lookups, whatever the
 *   length of the list (ModelOpt lists every excluded module, thousands of
 *   them for an MoE model);
 * - "re:PATTERN": compressed-tensors' rule, Python's re.match(PATTERN, name):
 *   anchored at the start of the module name, not at its end. PCRE2 (its
 *   syntax covers what these lists use) with a match limit, so a pattern that
 *   backtracks catastrophically fails with an error naming it within
 *   milliseconds instead of hanging a load;
 * - shell globs (an entry with * ? or [, as gpt-oss and ModelOpt write them):
 *   fnmatch on the module or a parent, in full. These are few and are tried in
 *   turn.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <assert.h>
#include <fnmatch.h>
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>

#include "format/checkpoint.h"

/* Backtracking steps (and nesting depth) one match of a module name may take. A real ignore
 * pattern on a module name of ~100 characters needs a few thousand; a catastrophic one reaches
 * the limit in milliseconds. */
#define REGEX_MATCH_LIMIT 1000000u
#define REGEX_DEPTH_LIMIT 10000u

struct regex_entry {
  const char *entry; /* "re:...", borrowed from qc->ignore */
  char *where;       /* "FILE: KEY.PATH", for a match-time error */
  pcre2_code *code;
};

struct ignore_matcher {
  struct name_index all;   /* every entry (for de-duplication); keys borrowed from qc->ignore */
  struct name_index plain; /* plain entries */
  struct regex_entry *regex;
  size_t n_regex, cap_regex;
  const char **globs;
  size_t n_globs, cap_globs;
  pcre2_match_context *limits;
};

static bool has_prefix(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

/* Only globs need fnmatch: module names never contain these characters. */
static bool is_glob(const char *entry) { return strpbrk(entry, "*?[") != NULL; }

void ignore_matcher_free(struct ignore_matcher *m) {
  if (!m)
    return;
  name_index_clear(&m->all);
  name_index_clear(&m->plain);
  for (size_t i = 0; i < m->n_regex; i++) {
    pcre2_code_free(m->regex[i].code);
    free(m->regex[i].where);
  }
  free(m->regex);
  free(m->globs);
  pcre2_match_context_free(m->limits);
  free(m);
}

static int new_matcher(struct ignore_matcher **out) {
  struct ignore_matcher *m = calloc(1, sizeof *m);
  if (m && !(m->limits = pcre2_match_context_create(NULL))) {
    free(m);
    m = NULL;
  }
  if (!m)
    return set_error(QKEEP_E_NOMEM, "out of memory for an ignore list");
  pcre2_set_match_limit(m->limits, REGEX_MATCH_LIMIT);
  pcre2_set_depth_limit(m->limits, REGEX_DEPTH_LIMIT);
  *out = m;
  return 0;
}

/* Compiles PATTERN (UTF-8, Unicode classes, as Python's str patterns are); why gets PCRE2's reason. */
static pcre2_code *compile(const char *pattern, char *why, size_t why_len) {
  int err;
  PCRE2_SIZE at;
  pcre2_code *code =
      pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err, &at, NULL);
  if (!code) {
    PCRE2_UCHAR msg[256];
    if (pcre2_get_error_message(err, msg, sizeof msg) < 0)
      snprintf((char *)msg, sizeof msg, "PCRE2 error %d", err);
    snprintf(why, why_len, "%s at offset %zu", (const char *)msg, (size_t)at);
  }
  return code;
}

/* Records the compiled "re:" entry (entry borrowed from qc->ignore). */
static int add_regex(struct ignore_matcher *m, const char *entry, const char *where, char *why,
                     size_t why_len) {
  pcre2_code *code = compile(entry + 3, why, why_len);
  if (!code)
    return QKEEP_E_FORMAT;
  int rc = grow_array((void **)&m->regex, &m->cap_regex, m->n_regex + 1, sizeof *m->regex);
  char *where_copy = rc ? NULL : xstrdup(where);
  if (!rc && !where_copy)
    rc = set_error(QKEEP_E_NOMEM, "out of memory");
  if (rc) {
    pcre2_code_free(code);
    return rc;
  }
  m->regex[m->n_regex++] = (struct regex_entry){entry, where_copy, code};
  return 0;
}

int ignore_add(struct quant_config *qc, size_t *cap, const char *entry, const char *where, char *why,
               size_t why_len) {
  why[0] = '\0';
  int rc = qc->matcher ? 0 : new_matcher(&qc->matcher);
  struct ignore_matcher *m = qc->matcher;
  size_t seen;
  if (rc || name_index_get(&m->all, entry, &seen))
    return rc; /* ModelOpt repeats its exclude_modules in both files: the union is what both mean */
  if (has_prefix(entry, "re:")) {
    /* Compiled before anything is recorded, so that a broken pattern fails the parse, not a match. */
    pcre2_code *check = compile(entry + 3, why, why_len);
    if (!check)
      return QKEEP_E_FORMAT;
    pcre2_code_free(check);
  }
  if ((rc = grow_array((void **)&qc->ignore, cap, qc->n_ignore + 1, sizeof *qc->ignore)) != 0)
    return rc;
  char *copy = xstrdup(entry);
  if (!copy)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  if ((rc = name_index_put(&m->all, copy, qc->n_ignore, NULL)) != 0) {
    free(copy);
    return rc;
  }
  qc->ignore[qc->n_ignore++] = copy;
  if (has_prefix(copy, "re:"))
    return add_regex(m, copy, where, why, why_len);
  if (is_glob(copy)) {
    rc = grow_array((void **)&m->globs, &m->cap_globs, m->n_globs + 1, sizeof *m->globs);
    if (!rc)
      m->globs[m->n_globs++] = copy;
    return rc;
  }
  return name_index_put(&m->plain, copy, qc->n_ignore - 1, NULL); /* new: `all` had no such entry */
}

/*
 * A plain entry covers the module when it equals a run of whole components:
 * it starts at the beginning or after a dot and ends at the end or before a
 * dot. Every such run is one hash lookup.
 */
static bool plain_covers(const struct name_index *plain, const char *module) {
  size_t seen;
  if (!plain->count)
    return false;
  if (!module[0])
    return name_index_find(plain, module, 0, &seen);
  for (const char *start = module; start; start = strchr(start, '.')) {
    if (*start == '.')
      start++;
    for (const char *end = start;; end++)
      if (*end == '.' || *end == '\0') {
        if (end > start && name_index_find(plain, start, (size_t)(end - start), &seen))
          return true;
        if (!*end)
          break;
      }
  }
  return false;
}

/* fnmatch on the module and on each parent ("a.b.c", "a.b", "a"). FNM_NOESCAPE: Python's
 * fnmatch (what ModelOpt and transformers use) has no backslash escapes. */
static int glob_covers(const char *glob, const char *module, bool *hit) {
  char *name = xstrdup(module);
  if (!name)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  *hit = fnmatch(glob, name, FNM_NOESCAPE) == 0;
  for (size_t i = strlen(name); i > 0 && !*hit; i--)
    if (name[i - 1] == '.') {
      name[i - 1] = '\0';
      *hit = fnmatch(glob, name, FNM_NOESCAPE) == 0;
    }
  free(name);
  return 0;
}

/* re.match: anchored at the start of the module name, free at its end. */
static int regex_covers(const struct ignore_matcher *m, const struct regex_entry *re, const char *module,
                        pcre2_match_data *md, bool *hit) {
  int r = pcre2_match(re->code, (PCRE2_SPTR)module, PCRE2_ZERO_TERMINATED, 0, PCRE2_ANCHORED, md, m->limits);
  *hit = r >= 0;
  if (r >= 0 || r == PCRE2_ERROR_NOMATCH)
    return 0;
  if (r == PCRE2_ERROR_NOMEMORY)
    return set_error(QKEEP_E_NOMEM, "out of memory matching ignore entry '%s'", re->entry);
  PCRE2_UCHAR msg[256];
  if (pcre2_get_error_message(r, msg, sizeof msg) < 0)
    snprintf((char *)msg, sizeof msg, "PCRE2 error %d", r);
  if (r == PCRE2_ERROR_MATCHLIMIT || r == PCRE2_ERROR_DEPTHLIMIT || r == PCRE2_ERROR_HEAPLIMIT)
    return set_error(QKEEP_E_FORMAT,
                     "%s: ignore entry '%s' gave up on module '%s': %s (over %u backtracking steps; the "
                     "pattern backtracks catastrophically, e.g. a nested repeat such as (a+)+, so write it "
                     "without nested or overlapping repeats)",
                     re->where, re->entry, module, (const char *)msg, REGEX_MATCH_LIMIT);
  return set_error(QKEEP_E_FORMAT, "%s: ignore entry '%s' failed on module '%s': %s", re->where, re->entry,
                   module, (const char *)msg);
}

int ignore_list_match(const struct quant_config *qc, const char *module, bool *ignored) {
  assert(qc && module && ignored);
  const struct ignore_matcher *m = qc->matcher;
  *ignored = false;
  assert(m || qc->n_ignore == 0); /* entries come only through ignore_add */
  if (!m)
    return 0;
  if (plain_covers(&m->plain, module)) {
    *ignored = true;
    return 0;
  }
  int rc = 0;
  for (size_t i = 0; i < m->n_globs && !rc && !*ignored; i++)
    rc = glob_covers(m->globs[i], module, ignored);
  if (rc || *ignored || !m->n_regex)
    return rc;
  pcre2_match_data *md = pcre2_match_data_create(1, NULL);
  if (!md)
    return set_error(QKEEP_E_NOMEM, "out of memory matching the ignore list");
  for (size_t i = 0; i < m->n_regex && !rc && !*ignored; i++)
    rc = regex_covers(m, &m->regex[i], module, md, ignored);
  pcre2_match_data_free(md);
  return rc;
}
