/*
 * safetensors.c: the strict safetensors reader (docs/FORMATS.md, "1.1 safetensors").
 *
 * st_open reads the 8-byte header length and the JSON header with pread,
 * checks every rule the reference reader checks, plus two it leaves loose
 * (duplicate names, unknown keys in a tensor entry: refused on purpose, since
 * either lets one file mean two things), and keeps the tensor table sorted by
 * name. What the reference accepts is accepted: whitespace before the header's
 * '{' (writers pad to page-align the data), any rank, "__metadata__": null,
 * dimensions up to 2^64 - 1 in a zero-element tensor. st_read fetches one
 * tensor's bytes on demand.
 *
 * The file is never mapped: a checkpoint that shrinks while it is open must
 * give an error naming the file and tensor, never SIGBUS.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "format/safetensors.h"

/* The reference reader's MAX_HEADER_SIZE. */
#define ST_MAX_HEADER_LEN 100000000ULL
/* Largest single pread; Linux transfers at most about 2 GiB per call anyway. */
#define ST_READ_CHUNK ((size_t)1 << 30)

/* Every dtype string of the reference's Dtype enum, with its size in bits. */
static const struct st_dtype {
  const char *name;
  unsigned bits;
} st_dtypes[] = {
    {"BOOL", 8},    {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6},     {"U8", 8},          {"I8", 8},
    {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8}, {"I16", 16},
    {"U16", 16},    {"F16", 16},    {"BF16", 16},   {"I32", 32},        {"U32", 32},        {"F32", 32},
    {"C64", 64},    {"F64", 64},    {"I64", 64},    {"U64", 64},
};

/* The table entry for a dtype string (case-sensitive, like the reference), or NULL. */
static const struct st_dtype *dtype_lookup(const char *name) {
  for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
    if (strcmp(name, st_dtypes[i].name) == 0)
      return &st_dtypes[i];
  return NULL;
}

/* ---- error helpers ---------------------------------------------------------------- */

/* Sets "PATH: detail" and returns code. */
static int PRINTF_LIKE(3, 4) file_error(int code, const struct st_file *f, const char *fmt, ...) {
  char detail[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  return set_error(code, "%s: %s", f->path, detail);
}

/* Sets "PATH: tensor 'NAME': detail" and returns code. */
static int PRINTF_LIKE(4, 5)
    tensor_error(int code, const struct st_file *f, const char *name, const char *fmt, ...) {
  char detail[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  return set_error(code, "%s: tensor '%s': %s", f->path, name, detail);
}

static const char *dims_str(const uint64_t *dims, size_t ndim, char *buf, size_t len);

/* "[3, 4]" for a tensor's shape as the header gives it, into buf. */
static const char *shape_str(const struct st_tensor *t, char *buf, size_t len) {
  if (t->full_shape)
    return dims_str(t->full_shape, (size_t)t->full_ndim, buf, len);
  struct qkeep_spec spec = {.ndim = t->ndim};
  memcpy(spec.shape, t->shape, sizeof spec.shape);
  return spec_shape_str(&spec, buf, len);
}

/* "[3, 4]" for a header's own dims (any rank, any u64), into buf. */
static const char *dims_str(const uint64_t *dims, size_t ndim, char *buf, size_t len) {
  size_t at = (size_t)snprintf(buf, len, "[");
  for (size_t i = 0; i < ndim && at < len; i++)
    at += (size_t)snprintf(buf + at, len - at, "%s%llu", i ? ", " : "", (unsigned long long)dims[i]);
  if (at < len)
    snprintf(buf + at, len - at, "]");
  return buf;
}

/* ---- low-level I/O ------------------------------------------------------------------ */

/*
 * Reads up to n bytes at offset, retrying on EINTR and short reads. Stores the
 * bytes read in *got (fewer than n only at end of file) and returns 0, or the
 * errno of a failed read.
 */
static int pread_full(int fd, void *dst, size_t n, uint64_t offset, size_t *got) {
  size_t done = 0;
  while (done < n) {
    size_t want = n - done < ST_READ_CHUNK ? n - done : ST_READ_CHUNK;
    ssize_t r = pread(fd, (char *)dst + done, want, (off_t)(offset + done));
    if (r < 0) {
      if (errno == EINTR)
        continue;
      *got = done;
      return errno;
    }
    if (r == 0)
      break;
    done += (size_t)r;
  }
  *got = done;
  return 0;
}

/*
 * Strict UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing above
 * U+10FFFF. On failure stores the offset of the first bad sequence in *bad_at.
 */
static bool utf8_valid(const unsigned char *s, size_t n, size_t *bad_at) {
  size_t i = 0;
  while (i < n) {
    unsigned c = s[i];
    size_t len;
    uint32_t cp, min;
    if (c < 0x80) {
      i++;
      continue;
    }
    if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      goto bad;
    }
    if (n - i < len)
      goto bad;
    for (size_t k = 1; k < len; k++) {
      if ((s[i + k] & 0xC0) != 0x80)
        goto bad;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      goto bad;
    i += len;
  }
  return true;
bad:
  *bad_at = i;
  return false;
}

/* ---- opening ---------------------------------------------------------------------- */

static struct st_identity identity_of(const struct stat *sb) {
  return (struct st_identity){(uint64_t)sb->st_dev, (uint64_t)sb->st_ino, (uint64_t)sb->st_size,
                              sb->st_mtim.tv_sec,   sb->st_mtim.tv_nsec,  sb->st_ctim.tv_sec,
                              sb->st_ctim.tv_nsec};
}

/* Opens f->path read-only and records its size and identity. */
static int open_file(struct st_file *f) {
  struct stat sb;
  int fd = open_regular(f->path, &sb);
  if (fd == OPEN_NOT_REGULAR)
    return file_error(QKEEP_E_IO, f, "not a regular file (%s)", file_kind(sb.st_mode));
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT || err == ENOTDIR)
      return file_error(QKEEP_E_NOTFOUND, f, "no such file");
    return file_error(error_from_errno(err), f, "cannot open: %s", strerror(err));
  }
  f->fd = fd;
  f->file_size = (uint64_t)sb.st_size;
  f->opened = identity_of(&sb);
  return 0;
}

int st_identity_now(const struct st_file *f, struct st_identity *out) {
  struct stat sb;
  if (fstat(f->fd, &sb) != 0)
    return file_error(QKEEP_E_IO, f, "cannot stat: %s", strerror(errno));
  *out = identity_of(&sb);
  return 0;
}

/*
 * Reads the header length and the header bytes into *out (malloc'd, N bytes
 * plus a NUL the parser does not need). Checks the length against the file
 * size and the 100 MB limit, the UTF-8 encoding and the leading '{'.
 */
static int read_header(struct st_file *f, char **out) {
  unsigned char len_le[8];
  size_t got;
  int err;

  *out = NULL;
  if (f->file_size < 8)
    return file_error(QKEEP_E_FORMAT, f, "file is %llu bytes, too short for the 8-byte header length",
                      (unsigned long long)f->file_size);
  if ((err = pread_full(f->fd, len_le, 8, 0, &got)) != 0)
    return file_error(QKEEP_E_IO, f, "cannot read the header length: %s", strerror(err));
  if (got < 8)
    return file_error(QKEEP_E_IO, f, "unexpected end of file reading the header length");

  uint64_t n = 0;
  for (int i = 7; i >= 0; i--)
    n = (n << 8) | len_le[i];
  f->header_len = n;
  if (n > ST_MAX_HEADER_LEN)
    return file_error(QKEEP_E_FORMAT, f, "header length %llu exceeds the limit of %llu bytes",
                      (unsigned long long)n, ST_MAX_HEADER_LEN);
  if (n > f->file_size - 8)
    return file_error(QKEEP_E_FORMAT, f, "header length %llu runs past the end of the file (%llu bytes)",
                      (unsigned long long)n, (unsigned long long)f->file_size);
  if (n == 0)
    return file_error(QKEEP_E_FORMAT, f, "header is empty, expected a JSON object starting with '{'");

  char *header = malloc((size_t)n + 1);
  if (!header)
    return file_error(QKEEP_E_NOMEM, f, "out of memory for a %llu-byte header", (unsigned long long)n);
  err = pread_full(f->fd, header, (size_t)n, 8, &got);
  if (err != 0 || got < n) {
    free(header);
    if (err)
      return file_error(QKEEP_E_IO, f, "cannot read the header: %s", strerror(err));
    return file_error(QKEEP_E_IO, f, "unexpected end of file reading the header");
  }
  header[n] = '\0';

  size_t bad_at;
  if (!utf8_valid((const unsigned char *)header, (size_t)n, &bad_at)) {
    unsigned bad_byte = (unsigned char)header[bad_at];
    free(header);
    return file_error(QKEEP_E_FORMAT, f, "header is not valid UTF-8 (bad byte 0x%02x at header offset %zu)",
                      bad_byte, bad_at);
  }
  /* JSON text holds no raw NUL (a string escapes it as \u0000), and jansson would read one as the end
   * of a value's text. */
  const char *nul = memchr(header, '\0', (size_t)n);
  if (nul) {
    size_t at = (size_t)(nul - header);
    free(header);
    return file_error(QKEEP_E_FORMAT, f, "header holds a NUL byte at header offset %zu, not JSON text", at);
  }
  /* JSON whitespace may come first (the reference accepts it: writers pad the header to page-align
   * the data); then the object. */
  size_t lead = strspn(header, " \t\n\r");
  if (header[lead] != '{') {
    free(header);
    return file_error(QKEEP_E_FORMAT, f, "header does not begin with '{' (after any whitespace)");
  }
  *out = header;
  return 0;
}

/* Copies __metadata__ (an object of strings, or null) into f, in header order. */
static int parse_metadata(struct st_file *f, json_t *meta) {
  if (json_is_null(meta)) /* the reference's Option: null is no metadata */
    return 0;
  if (!json_is_object(meta))
    return file_error(QKEEP_E_FORMAT, f, "__metadata__ is %s, expected an object of strings",
                      json_kind(meta));
  size_t n = json_object_size(meta);
  if (n == 0)
    return 0;
  f->metadata_keys = calloc(n, sizeof *f->metadata_keys);
  f->metadata_values = calloc(n, sizeof *f->metadata_values);
  if (!f->metadata_keys || !f->metadata_values)
    return file_error(QKEEP_E_NOMEM, f, "out of memory for %zu __metadata__ entries", n);

  const char *key;
  json_t *value;
  json_object_foreach(meta, key, value) {
    if (!json_is_string(value))
      return file_error(QKEEP_E_FORMAT, f, "__metadata__ value of '%s' is %s, expected a string", key,
                        json_kind(value));
    size_t i = f->n_metadata++;
    f->metadata_keys[i] = xstrdup(key);
    f->metadata_values[i] = xstrdup(json_string_value(value));
    if (!f->metadata_keys[i] || !f->metadata_values[i])
      return file_error(QKEEP_E_NOMEM, f, "out of memory copying __metadata__");
  }
  return 0;
}

/* Fills t's dtype from the entry's "dtype" string; *bits gets its size. */
static int parse_dtype(const struct st_file *f, struct st_tensor *t, const json_t *v, unsigned *bits) {
  if (!json_is_string(v))
    return tensor_error(QKEEP_E_FORMAT, f, t->name, "dtype is %s, expected a string", json_kind(v));
  const char *name = json_string_value(v);
  const struct st_dtype *dt = dtype_lookup(name);
  if (!dt)
    return tensor_error(QKEEP_E_FORMAT, f, t->name, "unknown dtype '%s'", name);
  assert(strlen(dt->name) < sizeof t->dtype_name);
  strcpy(t->dtype_name, dt->name);
  enum qkeep_dtype qd;
  t->dtype = qkeep_dtype_parse(dt->name, &qd) == 0 ? (int)qd : -1;
  assert(t->dtype >= 0 && qkeep_dtype_bits(qd) == dt->bits);
  *bits = dt->bits;
  return 0;
}

/*
 * Integers jansson cannot hold (above INT64_MAX) reach it as markers (see
 * mark_big_integers): -(BIG_MARK + i) stands for big->values[i].
 */
#define BIG_MARK 100000000000000000LL
struct big_ints {
  uint64_t *values;
  size_t n, cap;
};

/* The value of a JSON integer that must be >= 0: 1 and *out, 0 for a negative one. */
static int nonneg_int(const json_t *v, const struct big_ints *big, uint64_t *out) {
  json_int_t i = json_integer_value(v);
  if (i >= 0) {
    *out = (uint64_t)i;
    return 1;
  }
  if (big && i <= -BIG_MARK && (uint64_t)(-(i + BIG_MARK)) < big->n) {
    *out = big->values[-(i + BIG_MARK)];
    return 1;
  }
  return 0;
}

/*
 * Fills t's shape from the entry's "shape": integers from 0 to 2^64 - 1, any
 * number of them. A shape that does not fit a qkeep_spec (more than
 * QKEEP_MAX_DIMS dimensions, or one >= 2^63) is kept whole in t->full_shape,
 * and t->shape gets the collapsed form once the element count is known
 * (collapse_shape).
 */
static int parse_shape(const struct st_file *f, struct st_tensor *t, const json_t *v,
                       const struct big_ints *big, uint64_t **dims, size_t *ndim) {
  if (!json_is_array(v))
    return tensor_error(QKEEP_E_FORMAT, f, t->name, "shape is %s, expected an array of integers",
                        json_kind(v));
  *ndim = json_array_size(v);
  if (!(*dims = malloc((*ndim ? *ndim : 1) * sizeof **dims)))
    return tensor_error(QKEEP_E_NOMEM, f, t->name, "out of memory for %zu dimensions", *ndim);
  for (size_t i = 0; i < *ndim; i++) {
    const json_t *dim = json_array_get(v, i);
    if (json_is_integer(dim) && !nonneg_int(dim, big, &(*dims)[i]))
      return tensor_error(QKEEP_E_FORMAT, f, t->name, "shape dimension %zu is %lld, expected an integer >= 0",
                          i, (long long)json_integer_value(dim));
    if (!json_is_integer(dim))
      return tensor_error(QKEEP_E_FORMAT, f, t->name, "shape dimension %zu is %s, expected an integer >= 0",
                          i, json_kind(dim));
  }
  return 0;
}

/* Sets t->shape (and t->full_shape when needed) from the header's dims; takes dims. */
static void collapse_shape(struct st_tensor *t, uint64_t *dims, size_t ndim, uint64_t numel) {
  bool fits = ndim <= QKEEP_MAX_DIMS;
  for (size_t i = 0; i < ndim && fits; i++)
    fits = dims[i] <= (uint64_t)INT64_MAX;
  if (fits) {
    for (size_t i = 0; i < ndim; i++)
      t->shape[i] = (int64_t)dims[i];
    t->ndim = (int)ndim;
    free(dims);
    return;
  }
  t->full_shape = dims;
  t->full_ndim = (int)ndim;
  if (numel == 0) {
    t->ndim = 1;
    t->shape[0] = 0;
    return;
  }
  /* numel > 0 fits in 61 bits (numel x bits does in 64), so every dim and product does too. */
  size_t lead = ndim - (QKEEP_MAX_DIMS - 1);
  t->ndim = QKEEP_MAX_DIMS;
  t->shape[0] = 1;
  for (size_t i = 0; i < lead; i++)
    t->shape[0] *= (int64_t)dims[i];
  for (size_t i = lead; i < ndim; i++)
    t->shape[1 + i - lead] = (int64_t)dims[i];
}

/* Reads "data_offsets": exactly [begin, end], integers with 0 <= begin <= end. */
static int parse_offsets(const struct st_file *f, const struct st_tensor *t, const json_t *v,
                         const struct big_ints *big, uint64_t *begin, uint64_t *end) {
  if (!json_is_array(v))
    return tensor_error(QKEEP_E_FORMAT, f, t->name, "data_offsets is %s, expected [begin, end]",
                        json_kind(v));
  if (json_array_size(v) != 2)
    return tensor_error(QKEEP_E_FORMAT, f, t->name, "data_offsets is an array of %zu, expected [begin, end]",
                        json_array_size(v));
  static const char *const which[2] = {"begin", "end"};
  uint64_t at[2];
  for (size_t i = 0; i < 2; i++) {
    const json_t *x = json_array_get(v, i);
    if (json_is_integer(x) && !nonneg_int(x, big, &at[i]))
      return tensor_error(QKEEP_E_FORMAT, f, t->name, "data_offsets %s is %lld, expected an integer >= 0",
                          which[i], (long long)json_integer_value(x));
    if (!json_is_integer(x))
      return tensor_error(QKEEP_E_FORMAT, f, t->name, "data_offsets %s is %s, expected an integer >= 0",
                          which[i], json_kind(x));
  }
  *begin = at[0];
  *end = at[1];
  if (*end < *begin)
    return tensor_error(QKEEP_E_FORMAT, f, t->name, "data_offsets [%llu, %llu] end before they begin",
                        (unsigned long long)*begin, (unsigned long long)*end);
  return 0;
}

/*
 * Parses one tensor entry {"dtype", "shape", "data_offsets"} into t (whose
 * name is set) and checks that the offsets hold exactly numel x bits / 8
 * bytes. Sets t->offset to the absolute file offset; contiguity is checked
 * later, over all tensors.
 */
static int parse_tensor(const struct st_file *f, struct st_tensor *t, json_t *entry,
                        const struct big_ints *big) {
  if (!json_is_object(entry))
    return tensor_error(QKEEP_E_FORMAT, f, t->name, "entry is %s, expected an object", json_kind(entry));

  const char *key;
  json_t *value;
  json_object_foreach(entry, key, value) {
    if (strcmp(key, "dtype") != 0 && strcmp(key, "shape") != 0 && strcmp(key, "data_offsets") != 0)
      return tensor_error(QKEEP_E_FORMAT, f, t->name,
                          "unknown key '%s' (expected dtype, shape, data_offsets)", key);
  }
  static const char *const required[] = {"dtype", "shape", "data_offsets"};
  for (size_t i = 0; i < 3; i++)
    if (!json_object_get(entry, required[i]))
      return tensor_error(QKEEP_E_FORMAT, f, t->name, "missing key '%s'", required[i]);

  unsigned bits = 0;
  uint64_t begin = 0, end = 0, *dims = NULL;
  size_t ndim = 0;
  int rc;
  if ((rc = parse_dtype(f, t, json_object_get(entry, "dtype"), &bits)) != 0 ||
      (rc = parse_shape(f, t, json_object_get(entry, "shape"), big, &dims, &ndim)) != 0 ||
      (rc = parse_offsets(f, t, json_object_get(entry, "data_offsets"), big, &begin, &end)) != 0) {
    free(dims);
    return rc;
  }
  assert(bits > 0);

  /* Overflow-checked in the reference's order: the product of the dims, then x bits. */
  char shape[160];
  uint64_t numel = 1, total_bits;
  for (size_t i = 0; i < ndim; i++) {
    if (dims[i] != 0 && numel > UINT64_MAX / dims[i]) {
      rc = tensor_error(QKEEP_E_FORMAT, f, t->name, "shape %s: element count overflows",
                        dims_str(dims, ndim, shape, sizeof shape));
      free(dims);
      return rc;
    }
    numel *= dims[i];
  }
  if (numel > UINT64_MAX / bits) {
    rc = tensor_error(QKEEP_E_FORMAT, f, t->name, "%s %s: size in bits overflows", t->dtype_name,
                      dims_str(dims, ndim, shape, sizeof shape));
    free(dims);
    return rc;
  }
  collapse_shape(t, dims, ndim, numel);
  total_bits = numel * bits;
  if (total_bits % 8 != 0)
    return tensor_error(QKEEP_E_FORMAT, f, t->name, "%s %s is %llu bits, not a whole number of bytes",
                        t->dtype_name, shape_str(t, shape, sizeof shape), (unsigned long long)total_bits);
  if (end - begin != total_bits / 8)
    return tensor_error(
        QKEEP_E_FORMAT, f, t->name, "data_offsets [%llu, %llu] hold %llu bytes, but %s %s needs %llu",
        (unsigned long long)begin, (unsigned long long)end, (unsigned long long)(end - begin), t->dtype_name,
        shape_str(t, shape, sizeof shape), (unsigned long long)(total_bits / 8));
  t->offset = 8 + f->header_len + begin;
  t->nbytes = end - begin;
  return 0;
}

/*
 * jansson keeps integers in 64 signed bits, so a dimension >= 2^63 (which the
 * reference reads as a u64: valid in a zero-element tensor) makes it fail with
 * a numeric overflow. This rewrites, in `text` (a copy of the header), every
 * unsigned integer literal above INT64_MAX outside strings as the marker
 * -(BIG_MARK + i), padded with spaces to the literal's length (the literal has
 * 19 digits or more, the marker 19 characters), and records its value. A
 * literal above 2^64 - 1, or a negative one that could be read as a marker,
 * is QKEEP_E_FORMAT. Every marker is therefore one of ours.
 */
static int mark_big_integers(const struct st_file *f, char *text, size_t n, struct big_ints *big) {
  bool in_string = false;
  for (size_t i = 0; i < n; i++) {
    char c = text[i];
    if (in_string) {
      if (c == '\\')
        i++;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
      continue;
    }
    bool negative = c == '-';
    if (!negative && !(c >= '0' && c <= '9'))
      continue;
    size_t start = i, end = i + negative;
    while (end < n && text[end] >= '0' && text[end] <= '9')
      end++;
    size_t digits = end - start - negative;
    i = end - 1;
    if (end < n && (text[end] == '.' || text[end] == 'e' || text[end] == 'E'))
      continue; /* a real: jansson holds it (as a double) and the checks refuse it where it sits */
    if (negative && digits >= 18)
      return file_error(QKEEP_E_FORMAT, f, "header integer at offset %zu is out of range", start);
    if (negative || digits < 19)
      continue;
    errno = 0;
    char *stop;
    unsigned long long v = strtoull(text + start, &stop, 10);
    if (errno == ERANGE || digits > 20)
      return file_error(QKEEP_E_FORMAT, f, "header integer at offset %zu is larger than 2^64 - 1", start);
    if (v <= (unsigned long long)INT64_MAX)
      continue;
    int rc = grow_array((void **)&big->values, &big->cap, big->n + 1, sizeof *big->values);
    if (rc)
      return rc;
    char marker[24];
    int len = snprintf(marker, sizeof marker, "%lld", -(BIG_MARK + (long long)big->n));
    if ((size_t)len > end - start)
      return file_error(QKEEP_E_FORMAT, f, "header has too many integers above 2^63 - 1");
    memset(text + start, ' ', end - start);
    memcpy(text + start, marker, (size_t)len);
    big->values[big->n++] = v;
  }
  return 0;
}

/*
 * jansson's parse of one entry's value. An integer above INT64_MAX (a u64
 * dimension or offset the reference accepts) overflows jansson: then the
 * entry is parsed again from a copy with such literals as markers (see
 * mark_big_integers), whose values go to *big.
 */
static int parse_value(struct st_file *f, const struct json_scan *h, const struct json_member *m,
                       struct big_ints *big, json_t **out) {
  json_error_t jerr;
  big->n = 0;
  bool no_memory;
  *out = json_loadb_watched(h->text + m->value_at, m->value_len, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES,
                            &jerr, &no_memory);
  if (no_memory)
    return file_error(QKEEP_E_NOMEM, f, "out of memory parsing the header");
  if (!*out && json_error_code(&jerr) == json_error_numeric_overflow) {
    /* The value's every byte, a NUL among them included (strndup would stop there, short of value_len). */
    char *copy = malloc(m->value_len + 1);
    if (!copy)
      return file_error(QKEEP_E_NOMEM, f, "out of memory for a copy of a header entry");
    memcpy(copy, h->text + m->value_at, m->value_len);
    copy[m->value_len] = '\0';
    int rc = mark_big_integers(f, copy, m->value_len, big);
    if (!rc)
      *out =
          json_loadb_watched(copy, m->value_len, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &jerr, &no_memory);
    free(copy);
    if (rc)
      return rc;
    if (no_memory)
      return file_error(QKEEP_E_NOMEM, f, "out of memory parsing the header");
  }
  if (*out)
    return 0;
  if (json_error_code(&jerr) == json_error_out_of_memory)
    return file_error(QKEEP_E_NOMEM, f, "out of memory parsing the header");
  return json_scan_error(h, m->value_at + (size_t)(jerr.position > 0 ? jerr.position : 0), jerr.text);
}

/* One "key": value entry of the header: the metadata, or a tensor appended to f (its name to f->index). */
static int parse_entry(struct st_file *f, const struct json_scan *h, const struct json_member *m, size_t *cap,
                       bool *seen_metadata, struct big_ints *big) {
  char *name = NULL;
  json_t *value = NULL;
  int rc = json_scan_string(h, m->key_at, m->key_len, m->key_escaped, &name);
  if (!rc)
    rc = parse_value(f, h, m, big, &value);
  if (!rc && strcmp(name, "__metadata__") == 0) {
    rc = *seen_metadata ? json_scan_error(h, m->key_at, "duplicate object key \"__metadata__\"")
                        : parse_metadata(f, value);
    *seen_metadata = true;
    free(name);
    json_decref(value);
    return rc;
  }
  if (!rc && !*name) /* a param is found by its name: an unnamed one could never be loaded or looked up */
    rc = file_error(QKEEP_E_FORMAT, f,
                    "a tensor named \"\" (header byte %zu): every tensor needs a name, the one a model "
                    "finds it by",
                    m->key_at);
  if (!rc)
    rc = grow_array((void **)&f->tensors, cap, f->n_tensors + 1, sizeof *f->tensors);
  if (!rc && (rc = name_index_put(&f->index, name, f->n_tensors, NULL)) == QKEEP_E_EXISTS) {
    char *why = NULL;
    rc = qk_asprintf(&why, "duplicate object key \"%s\"", name) < 0
             ? file_error(QKEEP_E_NOMEM, f, "out of memory")
             : json_scan_error(h, m->key_at, why);
    free(why);
  }
  if (rc) {
    free(name);
    json_decref(value);
    return rc;
  }
  struct st_tensor *t = &f->tensors[f->n_tensors++];
  memset(t, 0, sizeof *t);
  t->name = name;
  rc = parse_tensor(f, t, value, big->n ? big : NULL);
  json_decref(value);
  return rc;
}

/* Parses the header JSON into f's tensors and metadata (not yet sorted or laid out). */
static int parse_header(struct st_file *f, const char *header) {
  char *what = NULL;
  if (qk_asprintf(&what, "%s: header is not valid JSON", f->path) < 0)
    return file_error(QKEEP_E_NOMEM, f, "out of memory");
  struct json_scan h = {.text = header, .len = (size_t)f->header_len, .what = what, .file = f->path};
  struct json_member m = {.more = true};
  size_t cap = 0;
  bool seen_metadata = false;
  struct big_ints big = {0};
  int rc = json_scan_open(&h);
  while (!rc && !(rc = json_scan_member(&h, &m)) && m.more)
    if (!(rc = json_scan_value(&h, &m)))
      rc = parse_entry(f, &h, &m, &cap, &seen_metadata, &big);
  if (!rc)
    rc = json_scan_end(&h);
  free(what);
  free(big.values);
  return rc;
}

/* qsort order for the layout check: by offset, then size (empty tensors first), then name. */
static int by_offset(const void *a, const void *b) {
  const struct st_tensor *x = a, *y = b;
  if (x->offset != y->offset)
    return x->offset < y->offset ? -1 : 1;
  if (x->nbytes != y->nbytes)
    return x->nbytes < y->nbytes ? -1 : 1;
  return strcmp(x->name, y->name);
}

/* qsort order of the final table, which st_find searches: bytewise by name. */
static int by_name(const void *a, const void *b) {
  return strcmp(((const struct st_tensor *)a)->name, ((const struct st_tensor *)b)->name);
}

/* Points the name index (built by the parse, which refused duplicates) at the sorted table. */
static int index_tensors(struct st_file *f) {
  int rc = 0;
  for (size_t i = 0; i < f->n_tensors && !rc; i++)
    rc = name_index_set(&f->index, f->tensors[i].name, i); /* every name is there: no growth */
  return rc;
}

/*
 * Checks the data layout: sorted by offset, each tensor begins where the
 * previous one ends, starting at 0 (no gaps, no overlaps), and the last one
 * ends exactly at the end of the file. Leaves the tensors sorted by name.
 */
static int check_layout(struct st_file *f) {
  const uint64_t base = 8 + f->header_len;
  uint64_t expected = 0; /* relative to the data buffer */
  if (f->n_tensors > 1)
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, by_offset);
  for (size_t i = 0; i < f->n_tensors; i++) {
    const struct st_tensor *t = &f->tensors[i];
    uint64_t begin = t->offset - base, end = begin + t->nbytes;
    if (begin != expected) {
      if (i == 0)
        return tensor_error(
            QKEEP_E_FORMAT, f, t->name,
            "data_offsets [%llu, %llu]: the first tensor must start at 0, the data buffer has a gap",
            (unsigned long long)begin, (unsigned long long)end);
      return tensor_error(
          QKEEP_E_FORMAT, f, t->name,
          "data_offsets [%llu, %llu] begin at %llu, but the previous tensor '%s' ends at %llu (%s)",
          (unsigned long long)begin, (unsigned long long)end, (unsigned long long)begin,
          f->tensors[i - 1].name, (unsigned long long)expected, begin > expected ? "a gap" : "an overlap");
    }
    expected = end;
  }

  uint64_t data_size = f->file_size - base;
  if (expected > data_size) {
    /* Blame the last tensor that holds bytes, not an empty one sitting at its end. */
    const struct st_tensor *last = &f->tensors[f->n_tensors - 1];
    while (last->nbytes == 0)
      last--;
    return tensor_error(
        QKEEP_E_FORMAT, f, last->name,
        "data_offsets [%llu, %llu] run past the end of the file (the data buffer holds %llu bytes)",
        (unsigned long long)(last->offset - base), (unsigned long long)expected,
        (unsigned long long)data_size);
  }
  if (expected < data_size)
    return file_error(QKEEP_E_FORMAT, f,
                      "%llu trailing bytes after the tensor data (the data ends at byte %llu of %llu)",
                      (unsigned long long)(data_size - expected), (unsigned long long)(base + expected),
                      (unsigned long long)f->file_size);

  if (f->n_tensors > 1)
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, by_name);
  return index_tensors(f);
}

/*
 * Opens and validates path (see format/safetensors.h). On success *out is the caller's
 * (st_close); on failure *out is NULL, nothing stays open or allocated, and
 * the message names the path and, where there is one, the tensor:
 * QKEEP_E_NOTFOUND (no such file), QKEEP_E_IO (cannot open or read, not a
 * regular file), QKEEP_E_FORMAT (any rule of docs/FORMATS.md, 1.1), QKEEP_E_NOMEM.
 */
int st_open(const char *path, struct st_file **out) {
  assert(out);
  *out = NULL;
  if (!path)
    return set_error(QKEEP_E_INVAL, "st_open: no path given");

  struct st_file *f = calloc(1, sizeof *f);
  if (!f)
    return set_error(QKEEP_E_NOMEM, "%s: out of memory", path);
  f->fd = -1;
  if (!(f->path = xstrdup(path))) {
    free(f);
    return set_error(QKEEP_E_NOMEM, "%s: out of memory", path);
  }

  char *header = NULL;
  int rc = open_file(f);
  if (rc == 0)
    rc = read_header(f, &header);
  if (rc == 0)
    rc = parse_header(f, header);
  free(header);
  if (rc == 0)
    rc = check_layout(f);
  if (rc != 0) {
    st_close(f);
    return rc;
  }
  *out = f;
  return 0;
}

/* Closes the file and frees everything st_open allocated; NULL is a no-op. */
void st_close(struct st_file *f) {
  if (!f)
    return;
  if (f->fd >= 0)
    close(f->fd);
  for (size_t i = 0; i < f->n_tensors; i++) {
    free(f->tensors[i].name);
    free(f->tensors[i].full_shape);
  }
  free(f->tensors);
  name_index_clear(&f->index);
  for (size_t i = 0; i < f->n_metadata; i++) {
    free(f->metadata_keys[i]);
    free(f->metadata_values[i]);
  }
  free(f->metadata_keys);
  free(f->metadata_values);
  free(f->path);
  free(f);
}

/* A hash lookup in the file's name index. The result is borrowed from f. */
const struct st_tensor *st_find(const struct st_file *f, const char *name) {
  size_t at;
  if (!f || !name || !name_index_get(&f->index, name, &at))
    return NULL;
  return &f->tensors[at];
}

/* The value is borrowed from f. */
const char *st_metadata(const struct st_file *f, const char *key) {
  if (!f || !key)
    return NULL;
  for (size_t i = 0; i < f->n_metadata; i++)
    if (strcmp(f->metadata_keys[i], key) == 0)
      return f->metadata_values[i];
  return NULL;
}

/*
 * Copies t's nbytes into dst. t must come from f. Before reading, checks with
 * fstat that the file still has the size st_open validated; a read that hits
 * end of file anyway (the file shrank in between) is QKEEP_E_IO as well.
 * A tensor of 0 bytes reads nothing (dst may be NULL).
 */
int st_read(const struct st_file *f, const struct st_tensor *t, void *dst) {
  assert(f && t && t >= f->tensors && t < f->tensors + f->n_tensors);
  if (t->nbytes > SIZE_MAX)
    return tensor_error(QKEEP_E_NOMEM, f, t->name, "%llu bytes do not fit in memory",
                        (unsigned long long)t->nbytes);
  return st_read_range(f, t, 0, (size_t)t->nbytes, dst);
}

/*
 * Copies bytes [offset, offset + n) of t into dst, with st_read's checks and errors (the
 * byte numbers in them are the file's). The range must lie within the tensor.
 */
int st_read_range(const struct st_file *f, const struct st_tensor *t, size_t offset, size_t n, void *dst) {
  assert(f && t && t >= f->tensors && t < f->tensors + f->n_tensors);
  assert(offset <= t->nbytes && n <= t->nbytes - offset);
  if (n == 0)
    return 0;
  assert(dst);

  struct stat sb;
  if (fstat(f->fd, &sb) != 0)
    return tensor_error(QKEEP_E_IO, f, t->name, "cannot stat: %s", strerror(errno));
  if ((uint64_t)sb.st_size != f->file_size)
    return tensor_error(QKEEP_E_IO, f, t->name,
                        "the file changed size since it was opened (%llu bytes, now %llu)",
                        (unsigned long long)f->file_size, (unsigned long long)sb.st_size);

  size_t got;
  uint64_t at = t->offset + offset;
  int err = pread_full(f->fd, dst, n, at, &got);
  if (err)
    return tensor_error(QKEEP_E_IO, f, t->name, "read failed at byte %llu: %s",
                        (unsigned long long)(at + got), strerror(err));
  if (got < n)
    return tensor_error(QKEEP_E_IO, f, t->name,
                        "unexpected end of file at byte %llu, %llu bytes short (did the file shrink?)",
                        (unsigned long long)(at + got), (unsigned long long)(n - got));
  return 0;
}

/* One tensor of a batch read and where it goes. */
struct read_item {
  const struct st_tensor *t;
  void *dst;
};

static int by_file_offset(const void *a, const void *b) {
  const struct st_tensor *x = ((const struct read_item *)a)->t, *y = ((const struct read_item *)b)->t;
  return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* preadv of the whole run into its destinations; false when it came back short or failed (the caller
 * then reads tensor by tensor, for the exact error). */
static bool read_run(const struct st_file *f, const struct read_item *items, size_t n) {
  struct iovec iov[64];
  size_t done = 0, total = 0;
  assert(n <= sizeof iov / sizeof iov[0]);
  for (size_t i = 0; i < n; i++) {
    iov[i] = (struct iovec){items[i].dst, (size_t)items[i].t->nbytes};
    total += iov[i].iov_len;
  }
  while (done < total) {
    ssize_t r;
    do
      r = preadv(f->fd, iov, (int)n, (off_t)(items[0].t->offset + done));
    while (r < 0 && errno == EINTR);
    if (r == (ssize_t)(total - done))
      return true;
    if (r <= 0 || done > 0)
      return false; /* a second short read: let st_read say what is wrong */
    done += (size_t)r;
    /* Skip the iovecs the first short read filled. */
    size_t skip = (size_t)r, k = 0;
    while (k < n && skip >= iov[k].iov_len)
      skip -= iov[k++].iov_len;
    memmove(iov, iov + k, (n - k) * sizeof *iov);
    n -= k;
    iov[0].iov_base = (char *)iov[0].iov_base + skip;
    iov[0].iov_len -= skip;
  }
  return true;
}

/*
 * Reads n tensors of f, tensors[i] into dsts[i]; tensors that lie back to back
 * in the file are read by one preadv, straight into their destinations (a
 * checkpoint of 10^5 small tensors is mostly syscalls when read one by one).
 * The size check of st_read runs once for the batch; a short or failed read
 * falls back to st_read for that run, whose error names the tensor.
 */
int st_read_many(const struct st_file *f, const struct st_tensor *const *tensors, void *const *dsts,
                 size_t n) {
  if (n == 0)
    return 0;
  struct read_item *items = malloc(n * sizeof *items);
  if (!items)
    return file_error(QKEEP_E_NOMEM, f, "out of memory");
  size_t m = 0;
  for (size_t i = 0; i < n; i++)
    if (tensors[i]->nbytes > 0)
      items[m++] = (struct read_item){tensors[i], dsts[i]};
  qsort(items, m, sizeof *items, by_file_offset);
  struct stat sb;
  int rc = 0;
  if (m && fstat(f->fd, &sb) != 0)
    rc = tensor_error(QKEEP_E_IO, f, items[0].t->name, "cannot stat: %s", strerror(errno));
  else if (m && (uint64_t)sb.st_size != f->file_size)
    rc = tensor_error(QKEEP_E_IO, f, items[0].t->name,
                      "the file changed size since it was opened (%llu bytes, now %llu)",
                      (unsigned long long)f->file_size, (unsigned long long)sb.st_size);
  for (size_t i = 0; i < m && !rc;) {
    size_t j = i + 1;
    while (j < m && j - i < 64 && items[j].t->offset == items[j - 1].t->offset + items[j - 1].t->nbytes)
      j++;
    if (!read_run(f, items + i, j - i))
      for (size_t k = i; k < j && !rc; k++)
        rc = st_read(f, items[k].t, items[k].dst);
    i = j;
  }
  free(items);
  return rc;
}
