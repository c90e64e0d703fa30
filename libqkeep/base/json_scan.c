/*
 * json_scan.c: the members of a large JSON object one at a time (see
 * base/base.h). A safetensors header or a sharded index lists every tensor of
 * a checkpoint; as one jansson tree, 10^6 entries took over ten times their
 * bytes and most of a load's time in allocation. Here a scan finds where each
 * key and value begins and ends, and jansson parses one value at a time
 * (a key only when it holds escapes), so what is accepted as JSON is still
 * jansson's verdict, value by value, while the scan checks the object's own
 * punctuation.
 */
#include <assert.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* The line and column of text[at]. */
static void json_scan_where(const struct json_scan *s, size_t at, int *line, int *column) {
  *line = 1, *column = 1;
  for (size_t i = 0; i < at && i < s->len; i++, ++*column)
    if (s->text[i] == '\n')
      ++*line, *column = 0;
}

int json_scan_error(const struct json_scan *s, size_t at, const char *why) {
  int line, column;
  json_scan_where(s, at, &line, &column);
  return set_error(QKEEP_E_FORMAT, "%s: %s (line %d, column %d)", s->what, why, line, column);
}

static void skip_space(struct json_scan *s) {
  while (s->pos < s->len && is_space(s->text[s->pos]))
    s->pos++;
}

/* Past the string starting at s->pos ('"'); *escaped tells whether it holds a backslash. */
static int scan_string(struct json_scan *s, bool *escaped) {
  size_t start = s->pos++;
  *escaped = false;
  for (; s->pos < s->len; s->pos++) {
    unsigned char c = (unsigned char)s->text[s->pos];
    if (c == '"') {
      s->pos++;
      return 0;
    }
    if (c < 0x20)
      return json_scan_error(s, s->pos, "control character in a string");
    if (c == '\\') {
      *escaped = true;
      s->pos++;
    }
  }
  return json_scan_error(s, start, "unterminated string");
}

int json_scan_open(struct json_scan *s) {
  skip_space(s);
  if (s->pos >= s->len || s->text[s->pos] != '{')
    return json_scan_error(s, s->pos, "expected '{'");
  s->pos++;
  s->first = true;
  return 0;
}

int json_scan_member(struct json_scan *s, struct json_member *m) {
  skip_space(s);
  if (s->pos < s->len && s->text[s->pos] == '}' && s->first) {
    s->pos++;
    m->more = false;
    return 0;
  }
  if (!s->first) {
    if (s->pos < s->len && s->text[s->pos] == '}') {
      s->pos++;
      m->more = false;
      return 0;
    }
    if (s->pos >= s->len || s->text[s->pos] != ',')
      return json_scan_error(s, s->pos, "expected ',' or '}'");
    s->pos++;
    skip_space(s);
  }
  s->first = false;
  m->more = true;
  m->key_at = s->pos;
  if (s->pos >= s->len || s->text[s->pos] != '"')
    return json_scan_error(s, s->pos, "expected a string key");
  int rc = scan_string(s, &m->key_escaped);
  if (rc)
    return rc;
  m->key_len = s->pos - m->key_at;
  skip_space(s);
  if (s->pos >= s->len || s->text[s->pos] != ':')
    return json_scan_error(s, s->pos, "expected ':' after a key");
  s->pos++;
  skip_space(s);
  m->value_at = s->pos;
  return 0;
}

int json_scan_value(struct json_scan *s, struct json_member *m) {
  size_t start = s->pos, depth = 0;
  bool escaped;
  m->value_escaped = false;
  while (s->pos < s->len) {
    char c = s->text[s->pos];
    if (c == '"') {
      int rc = scan_string(s, &escaped);
      if (rc)
        return rc;
      m->value_escaped |= escaped;
      if (depth == 0)
        break;
      continue;
    }
    if (c == '{' || c == '[') {
      depth++;
    } else if (c == '}' || c == ']') {
      if (depth == 0)
        break; /* the end of the enclosing object: a scalar ends here */
      if (--depth == 0) {
        s->pos++;
        break;
      }
    } else if (depth == 0 && (c == ',' || is_space(c) || c == '\0')) {
      break;
    }
    s->pos++;
  }
  if (depth || s->pos == start)
    return json_scan_error(s, start, depth ? "an object or array is not closed" : "a value is missing");
  m->value_len = s->pos - start;
  return 0;
}

int json_scan_end(struct json_scan *s) {
  skip_space(s);
  if (s->pos < s->len)
    return json_scan_error(s, s->pos, "end of file expected after the object");
  return 0;
}

int json_scan_parse(const struct json_scan *s, size_t at, size_t n, json_t **out) {
  int line, column, position;
  char why[160];
  int rc = json_parse(s->text + at, n, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, out, &line, &column,
                      &position, why);
  if (rc == QKEEP_E_NOMEM)
    return set_error(QKEEP_E_NOMEM, "%s: out of memory parsing JSON", s->what);
  return rc ? json_scan_error(s, at + (size_t)(position > 0 ? position : 0), why) : 0;
}

int json_scan_string(const struct json_scan *s, size_t at, size_t n, bool escaped, char **out) {
  assert(n >= 2 && s->text[at] == '"' && s->text[at + n - 1] == '"');
  if (!escaped) {
    *out = strndup(s->text + at + 1, n - 2); /* no escapes: the bytes are the string */
  } else {
    json_t *v;
    int line, column, position;
    char why[160];
    /* JSON_ALLOW_NUL: a NUL is valid JSON; it is refused below for what it is, not as a syntax error */
    int rc =
        json_parse(s->text + at, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, &v, &line, &column, &position, why);
    if (rc == QKEEP_E_NOMEM)
      return set_error(QKEEP_E_NOMEM, "%s: out of memory parsing JSON", s->what);
    if (rc)
      return json_scan_error(s, at + (size_t)(position > 0 ? position : 0), why);
    const char *text = json_string_value(v);
    if (strlen(text) != json_string_length(v)) {
      json_decref(v);
      json_scan_where(s, at, &line, &column);
      return set_error(QKEEP_E_UNSUPPORTED,
                       "%s: the string at line %d, column %d holds the escape \\u0000 (a NUL character): "
                       "qkeep takes names as C strings, which end at a NUL, so this name would stand for "
                       "another; valid safetensors, refused by qkeep",
                       s->file ? s->file : s->what, line, column);
    }
    *out = xstrdup(text);
    json_decref(v);
  }
  return *out ? 0 : set_error(QKEEP_E_NOMEM, "%s: out of memory", s->what);
}
