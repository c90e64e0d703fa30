/*
 * pattern.c: the regex engine for a checkpoint's patterns, with limits per match and per load
 * (see format/pattern.h).
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"
#include "format/pattern.h"

struct pattern_engine {
  pcre2_match_context *limits;
  pcre2_match_data *md;
  uint64_t budget, spent;
};

struct pattern {
  pcre2_code *code;
};

int pattern_engine_new(struct pattern_engine **out) {
  struct pattern_engine *e = calloc(1, sizeof *e);
  if (e && (!(e->limits = pcre2_match_context_create(NULL)) || !(e->md = pcre2_match_data_create(1, NULL)))) {
    pattern_engine_free(e);
    e = NULL;
  }
  if (!e)
    return set_error(QKEEP_E_NOMEM, "out of memory for a regex engine");
  pcre2_set_depth_limit(e->limits, PATTERN_DEPTH_LIMIT);
  pcre2_set_heap_limit(e->limits, PATTERN_HEAP_LIMIT_KIB);
  e->budget = PATTERN_BUDGET_BASE;
  *out = e;
  return 0;
}

void pattern_engine_free(struct pattern_engine *e) {
  if (!e)
    return;
  pcre2_match_data_free(e->md);
  pcre2_match_context_free(e->limits);
  free(e);
}

void pattern_engine_budget_for(struct pattern_engine *e, size_t n_tensors) {
  uint64_t per = (uint64_t)n_tensors * PATTERN_BUDGET_PER_TENSOR; /* n_tensors < 2^32: no overflow */
  e->budget = PATTERN_BUDGET_BASE + per;
}

uint64_t pattern_engine_spent(const struct pattern_engine *e) { return e->spent; }

int pattern_compile(const char *pattern, struct pattern **out, char *why, size_t why_len) {
  *out = NULL;
  size_t len = strlen(pattern);
  if (len > PATTERN_MAX_LENGTH) {
    snprintf(why, why_len, "%zu bytes, longer than the %u a pattern may have", len, PATTERN_MAX_LENGTH);
    return QKEEP_E_FORMAT;
  }
  struct pattern *p = malloc(sizeof *p);
  if (!p)
    return set_error(QKEEP_E_NOMEM, "out of memory compiling a regex");
  int err;
  PCRE2_SIZE at;
  p->code = pcre2_compile((PCRE2_SPTR)pattern, len, PCRE2_UTF | PCRE2_UCP, &err, &at, NULL);
  if (!p->code) {
    free(p);
    if (err == PCRE2_ERROR_HEAPLIMIT || err == PCRE2_ERROR_NOMEMORY)
      return set_error(QKEEP_E_NOMEM, "out of memory compiling a regex");
    PCRE2_UCHAR msg[256];
    if (pcre2_get_error_message(err, msg, sizeof msg) < 0)
      snprintf((char *)msg, sizeof msg, "PCRE2 error %d", err);
    snprintf(why, why_len, "%s at offset %zu", (const char *)msg, (size_t)at);
    return QKEEP_E_FORMAT;
  }
  *out = p;
  return 0;
}

void pattern_free(struct pattern *p) {
  if (!p)
    return;
  pcre2_code_free(p->code);
  free(p);
}

/* The error for a match that ran out of a limit, or of memory, or failed otherwise. */
static int match_error(int r, const char *subject, const char *what) {
  if (r == PCRE2_ERROR_NOMEMORY)
    return set_error(QKEEP_E_NOMEM, "out of memory matching %s", what);
  PCRE2_UCHAR msg[256];
  if (pcre2_get_error_message(r, msg, sizeof msg) < 0)
    snprintf((char *)msg, sizeof msg, "PCRE2 error %d", r);
  if (r == PCRE2_ERROR_MATCHLIMIT || r == PCRE2_ERROR_DEPTHLIMIT || r == PCRE2_ERROR_HEAPLIMIT)
    return set_error(
        QKEEP_E_FORMAT,
        "%s gave up on module '%s': %s (over %u backtracking steps, %u levels of nesting or %u KiB; "
        "the pattern backtracks catastrophically, e.g. a nested repeat such as (a+)+ or a "
        "back-reference after repeats, so write it without nested or overlapping repeats)",
        what, subject, (const char *)msg, PATTERN_MATCH_LIMIT, PATTERN_DEPTH_LIMIT, PATTERN_HEAP_LIMIT_KIB);
  return set_error(QKEEP_E_FORMAT, "%s failed on module '%s': %s", what, subject, (const char *)msg);
}

int pattern_match(struct pattern_engine *e, const struct pattern *p, const char *subject, const char *what,
                  bool *hit) {
  *hit = false;
  for (uint32_t rung = PATTERN_FIRST_RUNG;; rung *= 16) {
    uint32_t limit = rung < PATTERN_MATCH_LIMIT ? rung : PATTERN_MATCH_LIMIT;
    uint64_t left = e->budget > e->spent ? e->budget - e->spent : 0;
    if (left < limit)
      limit = (uint32_t)left;
    if (limit == 0)
      return set_error(QKEEP_E_FORMAT,
                       "%s, on module '%s': the checkpoint's patterns (its 're:' ignore entries and GPTQ "
                       "dynamic rules) have used up this load's budget of %llu regex steps (%llu, plus %u "
                       "per tensor); a config needs fewer patterns, or patterns that backtrack less",
                       what, subject, (unsigned long long)e->budget, (unsigned long long)PATTERN_BUDGET_BASE,
                       PATTERN_BUDGET_PER_TENSOR);
    pcre2_set_match_limit(e->limits, limit);
    int r =
        pcre2_match(p->code, (PCRE2_SPTR)subject, PCRE2_ZERO_TERMINATED, 0, PCRE2_ANCHORED, e->md, e->limits);
    e->spent += limit;
    if (r >= 0 || r == PCRE2_ERROR_NOMATCH) {
      *hit = r >= 0;
      return 0;
    }
    if (r != PCRE2_ERROR_MATCHLIMIT || limit == PATTERN_MATCH_LIMIT)
      return match_error(r, subject, what);
    /* short of budget: the next round finds none left and says so */
  }
}
