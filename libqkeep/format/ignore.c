/*
 * ignore.c: a quantization config's module names and patterns, compiled for matching (see
 * checkpoint.h: quant_config_match_ignore): the ignore list, GPTQModel's `dynamic` rules and
 * ModelOpt MIXED_PRECISION's quantized_layers.
 *
 * Ignore entries come in three kinds, matched as the exporters that write them do:
 * - plain names ("lm_head", "model.layers.0.mlp"): an entry covers a module
 *   when it is a dot-bounded run of the module's components (the module, a
 *   dot-suffix, a parent or a parent's suffix). All plain entries sit in one
 *   hash set, and a module of k components is k(k+1)/2 lookups, whatever the
 *   length of the list (ModelOpt lists every excluded module, thousands of
 *   them for an MoE model). quantized_layers are matched the same way;
 * - "re:PATTERN": compressed-tensors' rule, Python's re.match(PATTERN, name):
 *   anchored at the start of the module name, not at its end. Compiled once,
 *   matched by the config's one regex engine (pattern.h), with its limits per
 *   match and per load;
 * - shell globs (an entry with * ? or [, as gpt-oss and ModelOpt write them):
 *   fnmatch on the module or a parent, in full. These are few and are tried in
 *   turn.
 * GPTQ `dynamic` rules are compiled once by the same engine, and each module's first matching rule
 * is remembered, so that the several questions assembly asks of one module match it once.
 */
#include <assert.h>
#include <fnmatch.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "format/checkpoint.h"
#include "format/pattern.h"

struct regex_entry {
  char *what; /* "FILE: KEY.PATH: ignore entry 're:...'", for a match-time error */
  struct pattern *code;
};

struct ignore_matcher {
  struct name_index all;   /* every entry (for de-duplication); keys borrowed from qc->ignore */
  struct name_index plain; /* plain entries */
  struct regex_entry *regex;
  size_t n_regex, cap_regex;
  const char **globs;
  size_t n_globs, cap_globs;
  struct pattern_engine *engine; /* every pattern's limits, and the load's budget */
  struct regex_entry *rules;     /* GPTQ dynamic rules, in qc->dynamic's order */
  size_t n_rules, cap_rules;
  struct name_index rule_of; /* module -> its first rule + 1 (0: none), for modules matched already */
  char **matched;            /* rule_of's names (owned) */
  size_t n_matched, cap_matched;
  struct name_index quantized; /* MIXED_PRECISION's quantized_layers; keys borrowed from qc->quantized */
};

static bool has_prefix(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

/* Only globs need fnmatch: module names never contain these characters. */
static bool is_glob(const char *entry) { return strpbrk(entry, "*?[") != NULL; }

static void free_entries(struct regex_entry *e, size_t n) {
  for (size_t i = 0; i < n; i++) {
    pattern_free(e[i].code);
    free(e[i].what);
  }
  free(e);
}

void ignore_matcher_free(struct ignore_matcher *m) {
  if (!m)
    return;
  name_index_clear(&m->all);
  name_index_clear(&m->plain);
  free_entries(m->regex, m->n_regex);
  free_entries(m->rules, m->n_rules);
  free(m->globs);
  name_index_clear(&m->rule_of);
  for (size_t i = 0; i < m->n_matched; i++)
    free(m->matched[i]);
  free(m->matched);
  name_index_clear(&m->quantized);
  pattern_engine_free(m->engine);
  free(m);
}

/* qc's matcher, made on first use. */
static int matcher_of(struct quant_config *qc, struct ignore_matcher **out) {
  if (!qc->matcher) {
    struct ignore_matcher *m = calloc(1, sizeof *m);
    if (!m)
      return set_error(QKEEP_E_NOMEM, "out of memory for an ignore list");
    int rc = pattern_engine_new(&m->engine);
    if (rc) {
      free(m);
      return rc;
    }
    qc->matcher = m;
  }
  *out = qc->matcher;
  return 0;
}

void quant_config_budget_for(struct quant_config *qc, size_t n_tensors) {
  if (qc->matcher)
    pattern_engine_budget_for(qc->matcher->engine, n_tensors);
}

uint64_t quant_config_regex_steps(const struct quant_config *qc) {
  return qc->matcher ? pattern_engine_spent(qc->matcher->engine) : 0;
}

/* Appends a compiled pattern with its description (`what`, taken over) to a list. */
static int add_entry(struct regex_entry **list, size_t *n, size_t *cap, struct pattern *code, char *what) {
  int rc = what ? grow_array((void **)list, cap, *n + 1, sizeof **list)
                : set_error(QKEEP_E_NOMEM, "out of memory");
  if (rc) {
    pattern_free(code);
    free(what);
    return rc;
  }
  (*list)[(*n)++] = (struct regex_entry){what, code};
  return 0;
}

/* Records the compiled "re:" entry. */
static int add_regex(struct ignore_matcher *m, const char *entry, const char *where, char *why,
                     size_t why_len) {
  struct pattern *code;
  int rc = pattern_compile(entry + 3, &code, why, why_len);
  if (rc)
    return rc;
  char *what = NULL;
  if (qk_asprintf(&what, "%s: ignore entry '%s'", where, entry) < 0)
    what = NULL;
  return add_entry(&m->regex, &m->n_regex, &m->cap_regex, code, what);
}

int dynamic_rule_add(struct quant_config *qc, const char *pattern, const char *where, char *why,
                     size_t why_len) {
  why[0] = '\0';
  struct ignore_matcher *m = NULL;
  int rc = matcher_of(qc, &m);
  if (rc)
    return rc;
  assert(m->n_rules == qc->n_dynamic);
  struct pattern *code;
  if ((rc = pattern_compile(pattern, &code, why, why_len)) != 0)
    return rc;
  char *what = NULL;
  if (qk_asprintf(&what, "%s: rule '%s'", where, pattern) < 0)
    what = NULL;
  return add_entry(&m->rules, &m->n_rules, &m->cap_rules, code, what);
}

int dynamic_rule_first(const struct quant_config *qc, const char *module, size_t *rule) {
  *rule = SIZE_MAX;
  struct ignore_matcher *m = qc->matcher;
  if (!qc->n_dynamic)
    return 0;
  assert(m && m->n_rules == qc->n_dynamic); /* rules come only through dynamic_rule_add */
  size_t seen;
  if (name_index_get(&m->rule_of, module, &seen)) {
    *rule = seen ? seen - 1 : SIZE_MAX;
    return 0;
  }
  bool hit = false;
  size_t i = 0;
  for (; i < m->n_rules && !hit; i++) {
    int rc = pattern_match(m->engine, m->rules[i].code, module, m->rules[i].what, &hit);
    if (rc)
      return rc;
  }
  if (hit)
    *rule = i - 1;
  /* Remembered, so that the next question about this module matches nothing; a failure to
   * remember costs only time. */
  char *name = xstrdup(module);
  if (name && grow_array((void **)&m->matched, &m->cap_matched, m->n_matched + 1, sizeof *m->matched) == 0 &&
      name_index_put(&m->rule_of, name, hit ? i : 0, NULL) == 0)
    m->matched[m->n_matched++] = name;
  else
    free(name);
  return 0;
}

int quantized_add(struct quant_config *qc, size_t *cap, const char *layer) {
  struct ignore_matcher *m = NULL;
  int rc = matcher_of(qc, &m);
  size_t seen;
  if (rc || name_index_get(&m->quantized, layer, &seen))
    return rc; /* both files may list a layer: the union is what they mean */
  if ((rc = grow_array((void **)&qc->quantized, cap, qc->n_quantized + 1, sizeof *qc->quantized)) != 0)
    return rc;
  char *copy = xstrdup(layer);
  if (!copy)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  if ((rc = name_index_put(&m->quantized, copy, qc->n_quantized, NULL)) != 0) {
    free(copy);
    return rc;
  }
  qc->quantized[qc->n_quantized++] = copy;
  return 0;
}

int ignore_add(struct quant_config *qc, size_t *cap, const char *entry, const char *where, char *why,
               size_t why_len) {
  why[0] = '\0';
  struct ignore_matcher *m = NULL;
  int rc = matcher_of(qc, &m);
  size_t seen;
  if (rc || name_index_get(&m->all, entry, &seen))
    return rc; /* ModelOpt repeats its exclude_modules in both files: the union is what both mean */
  if (has_prefix(entry, "re:")) {
    /* Compiled before anything is recorded, so that a broken pattern fails the parse, not a match. */
    struct pattern *check;
    if ((rc = pattern_compile(entry + 3, &check, why, why_len)) != 0)
      return rc;
    pattern_free(check);
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

bool quantized_covers(const struct quant_config *qc, const char *module) {
  return qc->matcher && plain_covers(&qc->matcher->quantized, module);
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
  for (size_t i = 0; i < m->n_regex && !rc && !*ignored; i++)
    rc = pattern_match(m->engine, m->regex[i].code, module, m->regex[i].what, ignored);
  return rc;
}
