/*
 * safetensors_write.c: builds a safetensors file in memory and writes it the
 * way the reference serializer (huggingface/safetensors) does, so that a file qkeep
 * writes is byte for byte the file huggingface/safetensors would write for the
 * same tensors and metadata:
 *
 *   - tensors sorted by descending dtype alignment (the order of the
 *     reference's Dtype enum, which is ordered by element size), then by name;
 *   - a compact JSON header, "__metadata__" first, escaped like serde_json;
 *   - the header padded with spaces to a multiple of 8, so the data buffer,
 *     and with it every tensor, is aligned to its element size.
 *
 * The file is written under a temporary name and renamed into place, so a
 * failure never leaves a partial file at the destination.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "format/safetensors.h"

/* The reference reader rejects longer headers (MAX_HEADER_SIZE). */
#define ST_MAX_HEADER_LEN 100000000ULL
#define ST_WRITE_CHUNK ((size_t)1 << 30)

struct st_writer_tensor {
  char *name;
  struct qkeep_spec spec;
  size_t nbytes;
  void *data;   /* owned copy; NULL when nbytes is 0 or the tensor was planned */
  bool planned; /* added by st_writer_plan: a spec without bytes (st_writer_layout only) */
};

struct st_writer_meta {
  char *key;
  char *value;
};

struct st_writer {
  struct st_writer_tensor *tensors; /* in the order added */
  size_t n_tensors, cap_tensors;
  struct name_index index;         /* tensors[i].name -> i */
  struct st_writer_meta *metadata; /* in the order first set */
  size_t n_metadata, cap_metadata;
};

/*
 * Position of a qkeep dtype in the reference's Dtype enum (BOOL, F4, F6_E2M3,
 * F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, I16,
 * U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64). The serializer sorts by
 * this rank, descending; it grows with the element size.
 */
static int reference_rank(enum qkeep_dtype dtype) {
  switch (dtype) {
  case QKEEP_DTYPE_BOOL: return 0;
  case QKEEP_DTYPE_F4: return 1;
  case QKEEP_DTYPE_F6_E2M3: return 2;
  case QKEEP_DTYPE_F6_E3M2: return 3;
  case QKEEP_DTYPE_U8: return 4;
  case QKEEP_DTYPE_I8: return 5;
  case QKEEP_DTYPE_F8_E5M2: return 6;
  case QKEEP_DTYPE_F8_E4M3: return 7;
  case QKEEP_DTYPE_F8_E8M0: return 8;
  case QKEEP_DTYPE_F8_E4M3FNUZ: return 9;
  case QKEEP_DTYPE_F8_E5M2FNUZ: return 10;
  case QKEEP_DTYPE_I16: return 11;
  case QKEEP_DTYPE_U16: return 12;
  case QKEEP_DTYPE_F16: return 13;
  case QKEEP_DTYPE_BF16: return 14;
  case QKEEP_DTYPE_I32: return 15;
  case QKEEP_DTYPE_U32: return 16;
  case QKEEP_DTYPE_F32: return 17;
  case QKEEP_DTYPE_C64: return 18;
  case QKEEP_DTYPE_F64: return 19;
  case QKEEP_DTYPE_I64: return 20;
  case QKEEP_DTYPE_U64: return 21;
  case QKEEP_DTYPE_COUNT: break;
  }
  assert(!"unreachable: dtype validated by st_writer_add");
  return -1;
}

/* Strict UTF-8 (RFC 3629), so that every name we write can be read back. */
static bool utf8_valid(const char *str) {
  const unsigned char *s = (const unsigned char *)str;
  while (*s) {
    unsigned c = *s;
    size_t len;
    uint32_t cp, min;
    if (c < 0x80) {
      s++;
      continue;
    }
    if ((c & 0xE0) == 0xC0)
      len = 2, cp = c & 0x1F, min = 0x80;
    else if ((c & 0xF0) == 0xE0)
      len = 3, cp = c & 0x0F, min = 0x800;
    else if ((c & 0xF8) == 0xF0)
      len = 4, cp = c & 0x07, min = 0x10000;
    else
      return false;
    for (size_t k = 1; k < len; k++) {
      if ((s[k] & 0xC0) != 0x80) /* also stops at the NUL */
        return false;
      cp = (cp << 6) | (s[k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    s += len;
  }
  return true;
}

/*
 * A new, empty writer in *out, owned by the caller (st_writer_free).
 * QKEEP_E_NOMEM when out of memory.
 */
int st_writer_new(struct st_writer **out) {
  assert(out);
  *out = calloc(1, sizeof **out);
  return *out ? 0 : set_error(QKEEP_E_NOMEM, "out of memory for a safetensors writer");
}

/* Frees the writer and every copy it holds; NULL is a no-op. */
void st_writer_free(struct st_writer *w) {
  if (!w)
    return;
  for (size_t i = 0; i < w->n_tensors; i++) {
    free(w->tensors[i].name);
    free(w->tensors[i].data);
  }
  free(w->tensors);
  name_index_clear(&w->index);
  for (size_t i = 0; i < w->n_metadata; i++) {
    free(w->metadata[i].key);
    free(w->metadata[i].value);
  }
  free(w->metadata);
  free(w);
}

/* Checks a spec and stores its byte size in *nbytes; QKEEP_E_INVAL naming the tensor otherwise. */
static int check_spec(const char *name, const struct qkeep_spec *spec, size_t *nbytes) {
  if (!spec)
    return set_error(QKEEP_E_INVAL, "tensor '%s': no spec given", name);
  if ((unsigned)spec->dtype >= QKEEP_DTYPE_COUNT)
    return set_error(QKEEP_E_INVAL, "tensor '%s': invalid dtype %d", name, (int)spec->dtype);
  if (spec->ndim < 0 || spec->ndim > QKEEP_MAX_DIMS)
    return set_error(QKEEP_E_INVAL, "tensor '%s': %d dimensions, expected 0 to %d", name, spec->ndim,
                     QKEEP_MAX_DIMS);
  /* Bytes must fit size_t and int64 (qkeep_spec_numel), whichever is smaller. */
  const uint64_t limit = SIZE_MAX < INT64_MAX ? (uint64_t)SIZE_MAX : (uint64_t)INT64_MAX;
  uint64_t bits = qkeep_dtype_bits(spec->dtype);
  char shape[160];
  for (int i = 0; i < spec->ndim; i++) {
    if (spec->shape[i] < 0)
      return set_error(QKEEP_E_INVAL, "tensor '%s': negative dimension %lld", name,
                       (long long)spec->shape[i]);
    uint64_t dim = (uint64_t)spec->shape[i];
    if (dim != 0 && bits > limit / dim) /* bits stay below the byte limit: no overflow */
      return set_error(QKEEP_E_INVAL, "tensor '%s': %s %s is too large", name, qkeep_dtype_name(spec->dtype),
                       spec_shape_str(spec, shape, sizeof shape));
    bits *= dim;
  }
  if (bits % 8) /* F4 / F6 with an element count that ends inside a byte */
    return set_error(QKEEP_E_INVAL, "tensor '%s': %s %s is not a whole number of bytes", name,
                     qkeep_dtype_name(spec->dtype), spec_shape_str(spec, shape, sizeof shape));
  *nbytes = (size_t)(bits / 8);
  return 0;
}

/*
 * Adds tensor `name` with spec's dtype and shape; copies the name, and
 * spec's bytes from data (which may be NULL when that is 0 bytes).
 * QKEEP_E_INVAL for a NULL or non-UTF-8 name, the reserved "__metadata__", an
 * invalid spec or missing data; QKEEP_E_EXISTS when the name was already
 * added; QKEEP_E_NOMEM. On error the writer is unchanged.
 */
static int add_tensor(struct st_writer *w, const char *name, const struct qkeep_spec *spec, const void *data,
                      bool planned) {
  assert(w);
  if (!name)
    return set_error(QKEEP_E_INVAL, "st_writer_add: no tensor name given");
  if (!utf8_valid(name))
    return set_error(QKEEP_E_INVAL, "tensor name '%s' is not valid UTF-8", name);
  if (strcmp(name, "__metadata__") == 0)
    return set_error(QKEEP_E_INVAL, "'__metadata__' is reserved and cannot name a tensor");
  size_t nbytes = 0;
  int rc = check_spec(name, spec, &nbytes);
  if (rc != 0)
    return rc;
  if (nbytes > 0 && !data && !planned)
    return set_error(QKEEP_E_INVAL, "tensor '%s': no data for %zu bytes", name, nbytes);
  size_t seen;
  if (name_index_get(&w->index, name, &seen))
    return set_error(QKEEP_E_EXISTS, "tensor '%s' was already added", name);

  if ((rc = grow_array((void **)&w->tensors, &w->cap_tensors, w->n_tensors + 1, sizeof *w->tensors)) != 0)
    return rc;
  struct st_writer_tensor t = {.name = xstrdup(name), .spec = *spec, .nbytes = nbytes, .planned = planned};
  if (nbytes > 0 && !planned && (t.data = malloc(nbytes)) != NULL)
    memcpy(t.data, data, nbytes);
  if (!t.name || (nbytes > 0 && !planned && !t.data)) {
    free(t.name);
    free(t.data);
    return set_error(QKEEP_E_NOMEM, "tensor '%s': out of memory copying %zu bytes", name, nbytes);
  }
  if ((rc = name_index_put(&w->index, t.name, w->n_tensors, NULL)) != 0) {
    free(t.name);
    free(t.data);
    return rc;
  }
  w->tensors[w->n_tensors++] = t;
  return 0;
}

int st_writer_add(struct st_writer *w, const char *name, const struct qkeep_spec *spec, const void *data) {
  return add_tensor(w, name, spec, data, false);
}

/*
 * Adds tensor `name` with spec's dtype and shape but no bytes: the file's layout
 * (st_writer_layout) counts it, and the caller writes its bytes at the offset
 * the layout gives. A writer holding a planned tensor cannot st_writer_write.
 * Errors as st_writer_add; on error the writer is unchanged.
 */
int st_writer_plan(struct st_writer *w, const char *name, const struct qkeep_spec *spec) {
  return add_tensor(w, name, spec, NULL, true);
}

/*
 * Sets __metadata__[key] = value, copying both. Setting a key again replaces
 * its value and keeps its place. QKEEP_E_INVAL for NULL or non-UTF-8 strings,
 * QKEEP_E_NOMEM. On error the writer is unchanged.
 */
int st_writer_set_metadata(struct st_writer *w, const char *key, const char *value) {
  assert(w);
  if (!key || !value)
    return set_error(QKEEP_E_INVAL, "st_writer_set_metadata: NULL key or value");
  if (!utf8_valid(key) || !utf8_valid(value))
    return set_error(QKEEP_E_INVAL, "__metadata__ entry '%s' is not valid UTF-8", key);

  char *value_copy = xstrdup(value);
  if (!value_copy)
    return set_error(QKEEP_E_NOMEM, "out of memory copying __metadata__ '%s'", key);
  for (size_t i = 0; i < w->n_metadata; i++)
    if (strcmp(w->metadata[i].key, key) == 0) {
      free(w->metadata[i].value);
      w->metadata[i].value = value_copy;
      return 0;
    }
  char *key_copy = xstrdup(key);
  int rc = key_copy ? 0 : set_error(QKEEP_E_NOMEM, "out of memory copying __metadata__ '%s'", key);
  if (rc == 0)
    rc = grow_array((void **)&w->metadata, &w->cap_metadata, w->n_metadata + 1, sizeof *w->metadata);
  if (rc != 0) {
    free(key_copy);
    free(value_copy);
    return rc;
  }
  w->metadata[w->n_metadata++] = (struct st_writer_meta){key_copy, value_copy};
  return 0;
}

/* ---- the header ---------------------------------------------------------------------- */

/* A growing byte string; `failed` latches an allocation failure. */
struct strbuf {
  char *data;
  size_t len, cap;
  bool failed;
};

static void sb_append(struct strbuf *sb, const char *s, size_t n) {
  if (sb->failed)
    return;
  if (sb->len + n > sb->cap) {
    size_t cap = sb->cap ? sb->cap : 256;
    while (cap < sb->len + n)
      cap *= 2;
    char *p = realloc(sb->data, cap);
    if (!p) {
      sb->failed = true;
      return;
    }
    sb->data = p;
    sb->cap = cap;
  }
  memcpy(sb->data + sb->len, s, n);
  sb->len += n;
}

static void sb_puts(struct strbuf *sb, const char *s) { sb_append(sb, s, strlen(s)); }

static void sb_u64(struct strbuf *sb, uint64_t v) {
  char buf[24];
  int n = snprintf(buf, sizeof buf, "%llu", (unsigned long long)v);
  sb_append(sb, buf, (size_t)n);
}

/* A JSON string literal escaped as serde_json escapes it: only '"', '\' and control characters. */
static void sb_json_string(struct strbuf *sb, const char *s) {
  static const char hex[] = "0123456789abcdef";
  sb_append(sb, "\"", 1);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    switch (*p) {
    case '"': sb_append(sb, "\\\"", 2); break;
    case '\\': sb_append(sb, "\\\\", 2); break;
    case '\b': sb_append(sb, "\\b", 2); break;
    case '\f': sb_append(sb, "\\f", 2); break;
    case '\n': sb_append(sb, "\\n", 2); break;
    case '\r': sb_append(sb, "\\r", 2); break;
    case '\t': sb_append(sb, "\\t", 2); break;
    default:
      if (*p < 0x20) {
        char esc[6] = {'\\', 'u', '0', '0', hex[*p >> 4], hex[*p & 0xF]};
        sb_append(sb, esc, sizeof esc);
      } else {
        sb_append(sb, (const char *)p, 1);
      }
    }
  }
  sb_append(sb, "\"", 1);
}

/* Reference order: descending dtype rank, then name (bytewise). */
static int by_alignment_then_name(const void *a, const void *b) {
  const struct st_writer_tensor *x = *(const struct st_writer_tensor *const *)a;
  const struct st_writer_tensor *y = *(const struct st_writer_tensor *const *)b;
  int rx = reference_rank(x->spec.dtype), ry = reference_rank(y->spec.dtype);
  if (rx != ry)
    return rx > ry ? -1 : 1;
  return strcmp(x->name, y->name);
}

/*
 * Builds the padded header for the tensors in `order` into *sb: the JSON
 * object with offsets laid out back to back, then spaces up to a multiple of
 * 8. QKEEP_E_NOMEM, or QKEEP_E_INVAL when the header would exceed the limit
 * readers enforce.
 */
static int build_header(const struct st_writer *w, struct st_writer_tensor *const *order, struct strbuf *sb) {
  sb_puts(sb, "{");
  if (w->n_metadata > 0) {
    sb_puts(sb, "\"__metadata__\":{");
    for (size_t i = 0; i < w->n_metadata; i++) {
      if (i > 0)
        sb_puts(sb, ",");
      sb_json_string(sb, w->metadata[i].key);
      sb_puts(sb, ":");
      sb_json_string(sb, w->metadata[i].value);
    }
    sb_puts(sb, "}");
  }
  uint64_t offset = 0;
  for (size_t i = 0; i < w->n_tensors; i++) {
    const struct st_writer_tensor *t = order[i];
    if (i > 0 || w->n_metadata > 0)
      sb_puts(sb, ",");
    sb_json_string(sb, t->name);
    sb_puts(sb, ":{\"dtype\":\"");
    sb_puts(sb, qkeep_dtype_name(t->spec.dtype));
    sb_puts(sb, "\",\"shape\":[");
    for (int d = 0; d < t->spec.ndim; d++) {
      if (d > 0)
        sb_puts(sb, ",");
      sb_u64(sb, (uint64_t)t->spec.shape[d]);
    }
    sb_puts(sb, "],\"data_offsets\":[");
    sb_u64(sb, offset);
    sb_puts(sb, ",");
    sb_u64(sb, offset + t->nbytes);
    sb_puts(sb, "]}");
    offset += t->nbytes;
  }
  sb_puts(sb, "}");
  while (!sb->failed && sb->len % 8 != 0)
    sb_puts(sb, " ");
  if (sb->failed)
    return set_error(QKEEP_E_NOMEM, "out of memory building a safetensors header");
  if (sb->len > ST_MAX_HEADER_LEN)
    return set_error(QKEEP_E_INVAL, "the safetensors header would be %zu bytes, over the %llu-byte limit",
                     sb->len, ST_MAX_HEADER_LEN);
  return 0;
}

/* ---- writing -------------------------------------------------------------------------- */

/* Writes all n bytes, retrying on EINTR and short writes; 0 or an errno. */
static int write_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t r = write(fd, p, n < ST_WRITE_CHUNK ? n : ST_WRITE_CHUNK);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return errno;
    }
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

/*
 * Writes length, header and tensor data to tmp_path (created or truncated);
 * 0 or an errno. Removes tmp_path again when writing fails.
 */
static int write_file(const char *tmp_path, const struct strbuf *header,
                      struct st_writer_tensor *const *order, size_t n_tensors) {
  int fd;
  do
    fd = open(tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  while (fd < 0 && errno == EINTR);
  if (fd < 0)
    return errno;

  unsigned char len_le[8];
  for (int i = 0; i < 8; i++)
    len_le[i] = (unsigned char)((uint64_t)header->len >> (8 * i));
  int err = write_all(fd, len_le, sizeof len_le);
  if (!err)
    err = write_all(fd, header->data, header->len);
  for (size_t i = 0; i < n_tensors && !err; i++)
    err = write_all(fd, order[i]->data, order[i]->nbytes);
  if (close(fd) != 0 && !err)
    err = errno;
  if (err)
    unlink(tmp_path);
  return err;
}

/*
 * The layout of the file st_writer_write would write for w, without writing it:
 * out->header is the whole head of the file (the 8-byte little-endian length,
 * then the padded JSON), out->offsets[i] the absolute file offset of the i-th
 * tensor added (planned or not), out->file_size the file's size. The caller
 * owns out (st_layout_free). QKEEP_E_NOMEM, QKEEP_E_INVAL (header too large).
 */
int st_writer_layout(const struct st_writer *w, struct st_layout *out) {
  assert(w && out);
  *out = (struct st_layout){0};
  struct st_writer_tensor **order = NULL;
  struct strbuf json = {0};
  int rc = 0;
  size_t n = w->n_tensors;
  if (n > 0 && (!(order = malloc(n * sizeof *order)) || !(out->offsets = malloc(n * sizeof *out->offsets))))
    rc = set_error(QKEEP_E_NOMEM, "out of memory laying out a safetensors file");
  if (rc == 0) {
    for (size_t i = 0; i < n; i++)
      order[i] = &w->tensors[i];
    if (n > 1)
      qsort(order, n, sizeof *order, by_alignment_then_name);
    rc = build_header(w, order, &json);
  }
  if (rc == 0 && !(out->header = malloc(json.len + 8)))
    rc = set_error(QKEEP_E_NOMEM, "out of memory laying out a safetensors file");
  if (rc == 0) {
    for (int i = 0; i < 8; i++)
      out->header[i] = (char)(unsigned char)((uint64_t)json.len >> (8 * i));
    memcpy(out->header + 8, json.data, json.len);
    out->header_len = json.len + 8;
    uint64_t offset = out->header_len;
    for (size_t i = 0; i < n; i++) {
      out->offsets[order[i] - w->tensors] = offset;
      offset += order[i]->nbytes;
    }
    out->file_size = offset;
  }
  free(json.data);
  free(order);
  if (rc != 0)
    st_layout_free(out);
  return rc;
}

/* Frees what st_writer_layout allocated; a zeroed layout is a no-op. */
void st_layout_free(struct st_layout *l) {
  if (!l)
    return;
  free(l->header);
  free(l->offsets);
  *l = (struct st_layout){0};
}

/*
 * Writes every tensor and the metadata to `path` in the reference layout. The
 * bytes go to "PATH.tmp-PID" first, which is renamed over PATH; on any error
 * the temporary file is removed and PATH is left as it was. QKEEP_E_IO naming
 * the path, QKEEP_E_NOMEM, QKEEP_E_INVAL (header too large). The writer is
 * unchanged and can be written again.
 */
int st_writer_write(struct st_writer *w, const char *path) {
  assert(w);
  if (!path)
    return set_error(QKEEP_E_INVAL, "st_writer_write: no path given");
  for (size_t i = 0; i < w->n_tensors; i++)
    if (w->tensors[i].planned)
      return set_error(QKEEP_E_INVAL, "%s: tensor '%s' was planned without bytes (st_writer_plan)", path,
                       w->tensors[i].name);

  struct st_writer_tensor **order = NULL;
  struct strbuf header = {0};
  char *tmp_path = NULL;
  int rc = 0;

  if (w->n_tensors > 0 && !(order = malloc(w->n_tensors * sizeof *order)))
    rc = set_error(QKEEP_E_NOMEM, "%s: out of memory", path);
  if (rc == 0) {
    for (size_t i = 0; i < w->n_tensors; i++)
      order[i] = &w->tensors[i];
    if (w->n_tensors > 1)
      qsort(order, w->n_tensors, sizeof *order, by_alignment_then_name);
    rc = build_header(w, order, &header);
    if (rc != 0)
      rc = add_error_context(rc, "%s", path);
  }
  if (rc == 0) {
    size_t len = strlen(path) + 32;
    if ((tmp_path = malloc(len)) != NULL)
      snprintf(tmp_path, len, "%s.tmp-%ld", path, (long)getpid());
    else
      rc = set_error(QKEEP_E_NOMEM, "%s: out of memory", path);
  }
  if (rc == 0) {
    int err = write_file(tmp_path, &header, order, w->n_tensors);
    if (err != 0) {
      rc = set_error(QKEEP_E_IO, "%s: cannot write %s: %s", path, tmp_path, strerror(err));
    } else if (rename(tmp_path, path) != 0) {
      err = errno;
      unlink(tmp_path);
      rc = set_error(QKEEP_E_IO, "%s: cannot rename %s into place: %s", path, tmp_path, strerror(err));
    }
  }
  free(tmp_path);
  free(header.data);
  free(order);
  return rc;
}
