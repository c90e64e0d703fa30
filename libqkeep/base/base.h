/*
 * base/base.h: the bottom layer of the core (libqkeep/base): error detail and logging, small
 * utilities (checked arithmetic, strings, growth), the name index and the streaming JSON scanner.
 * It uses only the public types (qkeep/qkeep.h) and the C library; every other layer may use it.
 * Not installed; hidden from libqkeep's exported symbols.
 */
#ifndef QKEEP_BASE_H
#define QKEEP_BASE_H

#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>

#include "qkeep/qkeep.h"

#if defined(__GNUC__)
#define PRINTF_LIKE(a, b) __attribute__((format(printf, a, b)))
#else
#define PRINTF_LIKE(a, b)
#endif

/* ---- errors and logging (error.c) ------------------------------------------ */

/* Records the calling thread's error detail and returns `code`. */
int set_error(int code, const char *fmt, ...) PRINTF_LIKE(2, 3);
int set_error_v(int code, const char *fmt, va_list ap);
/* The QKEEP_E_* code for a failed file operation's errno: not found, permission denied, read-only
 * file system, no space, exists, out of memory; QKEEP_E_IO for the rest. */
int error_from_errno(int err);
/* Changes whenever this thread's detail is set: tells whether a call (a backend's) left one. */
unsigned long error_generation(void);
/* Prefixes the current detail with more context ("layer x: " + detail). */
int add_error_context(int code, const char *fmt, ...) PRINTF_LIKE(2, 3);
/* Whether a line of this level reaches a logger (one is set, and the level is at most
 * qkeep_set_log_level's): a trace checks it before it measures or formats anything. */
bool log_enabled(enum qkeep_log_level level);
/* A line to the logger; dropped before formatting when !log_enabled(level). */
void log_msg(enum qkeep_log_level level, const char *fmt, ...) PRINTF_LIKE(2, 3);
void log_msg_v(enum qkeep_log_level level, const char *fmt, va_list ap);

/* ---- small utilities (util.c) ---------------------------------------------- */

char *xstrdup(const char *s); /* NULL on NULL or no memory */
/* asprintf/vasprintf: *out malloc'd and the length, or NULL and -1 when out of memory (never
 * glibc's, whose failure path writes past its buffer; see util.c). */
int qk_asprintf(char **out, const char *fmt, ...) PRINTF_LIKE(2, 3);
int qk_vasprintf(char **out, const char *fmt, va_list ap);
double now_seconds(void); /* monotonic, for the load stats */
struct stat;
/* open_regular's answer for a path that opened but is no regular file (a FIFO, a device, a directory). */
#define OPEN_NOT_REGULAR (-2)
/*
 * Opens path read-only (close-on-exec) without waiting: a FIFO or a device in a file's place
 * (opening a FIFO for reading blocks until a writer comes) is opened non-blocking, found by
 * fstat and closed. Returns the descriptor of a regular file, blocking again, with *st filled;
 * OPEN_NOT_REGULAR for any other kind of file (*st filled, nothing left open); -1 with errno
 * when open, fstat or fcntl fails. Sets no error detail: the caller names the file.
 */
int open_regular(const char *path, struct stat *st);
/* "a FIFO", "a directory", "a device", ... for a stat st_mode, for messages. */
const char *file_kind(unsigned mode);
int grow_array(void **array, size_t *cap, size_t need, size_t elem_size);
bool spec_equal(const struct qkeep_spec *a, const struct qkeep_spec *b);
/* The bytes of a spec, false when its dtype, rank or a dimension is invalid or the product
 * does not fit in size_t (so no size ever wraps to a small number). */
bool spec_bytes_checked(const struct qkeep_spec *spec, size_t *bytes);
/* Checked size arithmetic, the one place the core multiplies or adds dimensions, counts and
 * byte sizes that came from a file or a caller: false (and *out untouched) when an operand is
 * negative or the result does not fit, so no product ever wraps or overflows a signed type. */
bool dim_mul(int64_t a, int64_t b, int64_t *out);
bool dim_add(int64_t a, int64_t b, int64_t *out);
bool size_mul(size_t a, size_t b, size_t *out);
/* The bytes of a rows x cols f32 matrix, false when negative or too large for size_t. */
bool f32_matrix_bytes(int64_t rows, int64_t cols, size_t *bytes);
/*
 * Copies a size-prefixed struct out through the ABI: `out` starts with the caller's
 * size_t size (0 means "mine"); copies min(that, in_size) bytes of `in` and stores the
 * size copied, so older callers get a prefix and newer ones see what is absent.
 */
void copy_sized(void *out, const void *in, size_t in_size);
/* "an integer", "a string"...: what a JSON value is, for messages (a json_t *). */
const char *json_kind(const void *json_value);
/* Room for any spec's shape string: QKEEP_MAX_DIMS dimensions of up to 20 digits, ", " between. */
#define SHAPE_STR_LEN (2 + QKEEP_MAX_DIMS * 22 + 1)
/* "[3, 4]" into buf (SHAPE_STR_LEN bytes hold any); returns buf. */
const char *spec_shape_str(const struct qkeep_spec *spec, char *buf, size_t len);

/* ---- name index (name_index.c) ------------------------------------------------------ */

/*
 * A hash table from a name to a value below 2^32 (a position in the caller's
 * array), O(1) expected per operation. Names are borrowed, not copied: each
 * must stay valid and unchanged while the index holds it (the malloc'd name of
 * an entry, which stays put when the caller's array of entries grows). A
 * zero-initialised struct is an empty index; name_index_clear frees it.
 */
struct name_slot {
  const char *name; /* NULL: empty */
  uint32_t hash;
  uint32_t value;
};
struct name_index {
  struct name_slot *slots;
  size_t cap, count;
  uint64_t seed;  /* this table's hash seed (name_index.c: against hash flooding) */
  size_t longest; /* the longest distance of a name from its home slot: a lookup's bound */
};
/* Adds name -> value. A name already present keeps its value, which goes to *existing
 * (when non-NULL), and QKEEP_E_EXISTS is returned without an error detail (the caller sets
 * one that says what the name is); QKEEP_E_NOMEM with a detail. */
int name_index_put(struct name_index *ix, const char *name, size_t value, size_t *existing);
/* Adds name -> value, or gives a name already present this value instead. */
int name_index_set(struct name_index *ix, const char *name, size_t value);
/* Makes room for n names without growing again. */
int name_index_reserve(struct name_index *ix, size_t n);
/* The value of the first len bytes of name (no NUL needed there), or false. */
bool name_index_find(const struct name_index *ix, const char *name, size_t len, size_t *value);
/* The value of a NUL-terminated name, or false. */
bool name_index_get(const struct name_index *ix, const char *name, size_t *value);
/* Frees the table; the index is empty (and reusable) afterwards. */
void name_index_clear(struct name_index *ix);
/* The longest distance of a name from its home slot, counted from the slots (tests): at most 64
 * whatever the names, so that no lookup probes further. */
size_t name_index_longest_probe(const struct name_index *ix);
/* The table's hash seed (tests: each index has its own, from a per-process secret). */
uint64_t name_index_seed(const struct name_index *ix);

/* ---- large JSON objects, one member at a time (json_scan.c) ------------------------ */

/*
 * A scan over a JSON object's members: json_scan_open, then json_scan_member
 * for each (stops with more false at the closing brace) with json_scan_value
 * to step over its value, then json_scan_end. Values (and keys with escapes)
 * are parsed by jansson one at a time with json_scan_parse / json_scan_string.
 * Errors are QKEEP_E_FORMAT "WHAT: WHY (line L, column C)".
 */
struct json_scan {
  const char *text;
  size_t len, pos;
  const char *what; /* the message prefix, e.g. "PATH: header is not valid JSON" */
  const char *file; /* the file, for errors in valid JSON (a NUL in a string); NULL: what */
  bool first;
};
struct json_member {
  bool more;              /* false: the object ended */
  size_t key_at, key_len; /* the key's text, quotes included */
  bool key_escaped;
  size_t value_at, value_len; /* set by json_scan_value */
  bool value_escaped;         /* a string value (or one inside it) holds a backslash */
};
int json_scan_open(struct json_scan *s);
int json_scan_member(struct json_scan *s, struct json_member *m);
int json_scan_value(struct json_scan *s, struct json_member *m);
int json_scan_end(struct json_scan *s);
struct json_t;
/*
 * jansson's json_loadb with its allocation failures told apart from invalid text (jansson reports
 * some as syntax errors, and survives others with a damaged result; see util.c). 0 (*out the
 * caller's), QKEEP_E_NOMEM (no detail set), or QKEEP_E_FORMAT with *line, *column, *position
 * and why (a buffer of at least 160 bytes) describing the text's error.
 */
int json_parse(const char *text, size_t len, size_t flags, struct json_t **out, int *line, int *column,
               int *position, char *why);
/* json_loadb (err a json_error_t *), NULL with *no_memory set when jansson could not allocate during
 * it, even where it still returned a (then damaged, and freed) result; see util.c. */
struct json_t *json_loadb_watched(const char *text, size_t len, size_t flags, void *err, bool *no_memory);
/* json_dumps (flags as jansson's), NULL when jansson could not allocate during it: its dump, like its
 * parse, can drop what it failed to append and still return a text (then freed); see util.c. */
char *json_dumps_watched(const struct json_t *json, size_t flags);
/* jansson's parse of text[at, at + n) (a json_t *, the caller's); its errors placed in the whole text. */
int json_scan_parse(const struct json_scan *s, size_t at, size_t n, struct json_t **out);
/* The JSON string at text[at, at + n) (quotes included), decoded, malloc'd. A string holding the
 * escape \u0000 is refused (QKEEP_E_UNSUPPORTED naming s->file and the place): qkeep's names are C
 * strings (its API, name indexes and messages end a name at its first NUL), so "a\u0000b" would
 * stand for "a". */
int json_scan_string(const struct json_scan *s, size_t at, size_t n, bool escaped, char **out);
int json_scan_error(const struct json_scan *s, size_t at, const char *why);

#endif
