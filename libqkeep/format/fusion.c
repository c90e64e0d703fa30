/*
 * fusion.c: the parser of a fuse map, "FUSED=MEMBER+MEMBER..." rules separated by commas or
 * spaces ("none": no fusion). The config checks a [model] fuse key with it (so a bad map is a
 * config error with its line) and the model installs the rules it returns.
 */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "format/fusion.h"

/* A module or fused name: letters, digits, '_' and '-'; no dots. */
static bool valid_member(const char *s, size_t n) {
  if (!n)
    return false;
  for (size_t i = 0; i < n; i++)
    if (!(isalnum((unsigned char)s[i]) || s[i] == '_' || s[i] == '-'))
      return false;
  return true;
}

/* Parses one "fused=a+b+c" rule of length n into r. */
static int parse_rule(const char *s, size_t n, struct fusion_rule *r) {
  const char *eq = memchr(s, '=', n);
  if (!eq || !valid_member(s, (size_t)(eq - s)))
    return set_error(QKEEP_E_INVAL, "fusion rule '%.*s': expected FUSED=MEMBER+MEMBER...", (int)n, s);
  r->fused = strndup(s, (size_t)(eq - s));
  const char *p = eq + 1, *end = s + n;
  while (p <= end) {
    const char *plus = memchr(p, '+', (size_t)(end - p));
    const char *stop = plus ? plus : end;
    if (r->n_members == 8 || !valid_member(p, (size_t)(stop - p)))
      return set_error(QKEEP_E_INVAL, "fusion rule '%.*s': bad or too many members (at most 8)", (int)n, s);
    for (int m = 0; m < r->n_members; m++)
      if (strlen(r->members[m]) == (size_t)(stop - p) && strncmp(r->members[m], p, (size_t)(stop - p)) == 0)
        return set_error(QKEEP_E_INVAL, "fusion rule '%.*s': member '%.*s' is named twice", (int)n, s,
                         (int)(stop - p), p);
    r->members[r->n_members++] = strndup(p, (size_t)(stop - p));
    p = stop + 1;
  }
  if (r->n_members < 2)
    return set_error(QKEEP_E_INVAL, "fusion rule '%.*s': a fusion needs two members or more", (int)n, s);
  return 0;
}

void fusion_rules_free(struct fusion_rule *rules, size_t n) {
  for (size_t i = 0; i < n; i++) {
    free(rules[i].fused);
    for (int m = 0; m < rules[i].n_members; m++)
      free(rules[i].members[m]);
  }
  free(rules);
}

int fusion_parse(const char *map, struct fusion_rule **out, size_t *n_out) {
  struct fusion_rule *rules = NULL;
  size_t n = 0, cap = 0;
  int rc = 0;
  if (strcmp(map, "none") != 0) {
    for (const char *p = map; *p && !rc;) {
      size_t len = strcspn(p, ", ");
      if (len) {
        rc = grow_array((void **)&rules, &cap, n + 1, sizeof *rules);
        if (!rc) {
          memset(&rules[n], 0, sizeof *rules);
          rc = parse_rule(p, len, &rules[n++]);
        }
      }
      p += len + (p[len] != 0);
    }
  }
  if (rc) {
    fusion_rules_free(rules, n);
    return rc;
  }
  *out = rules;
  *n_out = n;
  return 0;
}
