/*
 * check_safetensors.c: the safetensors reader (core/safetensors.c) and writer
 * (core/safetensors_write.c).
 *
 * Malformed files are built here byte by byte, never with the writer, so a
 * bug shared by reader and writer cannot hide itself. Every rejection must
 * also say why: the message has to name the file, the tensor where there is
 * one, and a word for the broken rule.
 */
#include <check.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "testutil.h"

/* The current test's scratch directory (fixture). */
static char *dir;

static void setup(void) {
  dir = tu_tmpdir("safetensors");
  ck_assert_ptr_nonnull(dir);
}

static void teardown(void) {
  tu_rmtree(dir);
  free(dir);
  dir = NULL;
}

/* ---- helpers ----------------------------------------------------------------------- */

/* Writes n raw bytes to dir/file; returns the malloc'd path. */
static char *put_raw(const char *file, const void *bytes, size_t n) {
  char *path = tu_path(dir, file);
  ck_assert_ptr_nonnull(path);
  ck_assert_int_eq(tu_write_file(path, bytes, n), 0);
  return path;
}

/*
 * Writes a safetensors file by hand: the 8-byte little-endian length of
 * header (header_len bytes), the header, then data_len bytes of a counting
 * pattern. Returns the malloc'd path.
 */
static char *put_st_n(const char *file, const char *header, size_t header_len, size_t data_len) {
  size_t n = 8 + header_len + data_len;
  unsigned char *buf = malloc(n);
  ck_assert_ptr_nonnull(buf);
  for (int i = 0; i < 8; i++)
    buf[i] = (unsigned char)((uint64_t)header_len >> (8 * i));
  memcpy(buf + 8, header, header_len);
  for (size_t i = 0; i < data_len; i++)
    buf[8 + header_len + i] = (unsigned char)(i * 7 + 1);
  char *path = put_raw(file, buf, n);
  free(buf);
  return path;
}

static char *put_st(const char *file, const char *header, size_t data_len) {
  return put_st_n(file, header, strlen(header), data_len);
}

/* Writes the 8-byte length field alone, followed by `extra` bytes. */
static char *put_len(const char *file, uint64_t header_len, size_t extra) {
  unsigned char buf[64] = {0};
  ck_assert_uint_le(extra, sizeof buf - 8);
  for (int i = 0; i < 8; i++)
    buf[i] = (unsigned char)(header_len >> (8 * i));
  memset(buf + 8, ' ', extra);
  if (extra > 0)
    buf[8] = '{';
  return put_raw(file, buf, 8 + extra);
}

/*
 * st_open(path) must fail with `code`, leave *out NULL, and leave a message
 * naming the path, `tensor` (quoted, when not NULL) and `word` (when not NULL).
 */
static void expect_open_error(const char *path, int code, const char *tensor, const char *word) {
  struct st_file *f = (struct st_file *)&f; /* must be reset to NULL */
  int rc = st_open(path, &f);
  const char *msg = qkeep_errmsg();
  ck_assert_msg(rc == code, "st_open returned %d (%s), expected %d; message: %s", rc, qkeep_strerror(rc), code,
                msg);
  ck_assert_ptr_null(f);
  ck_assert_msg(strstr(msg, path) != NULL, "message does not name the file: %s", msg);
  if (tensor) {
    char quoted[256];
    snprintf(quoted, sizeof quoted, "'%s'", tensor);
    ck_assert_msg(strstr(msg, quoted) != NULL, "message does not name tensor %s: %s", quoted, msg);
  }
  if (word)
    ck_assert_msg(strstr(msg, word) != NULL, "message lacks \"%s\": %s", word, msg);
}

static struct st_file *open_ok(const char *path) {
  struct st_file *f = NULL;
  int rc = st_open(path, &f);
  ck_assert_msg(rc == 0, "st_open(%s) failed: %s: %s", path, qkeep_strerror(rc), qkeep_errmsg());
  ck_assert_ptr_nonnull(f);
  return f;
}

static struct qkeep_spec spec_of(enum qkeep_dtype dtype, int ndim, const int64_t *shape) {
  struct qkeep_spec spec = {.dtype = dtype, .ndim = ndim};
  for (int i = 0; i < ndim; i++)
    spec.shape[i] = shape[i];
  return spec;
}

/* Deterministic bytes for a tensor, different per seed. */
static void *pattern(size_t n, uint64_t seed) {
  unsigned char *p = malloc(n ? n : 1);
  ck_assert_ptr_nonnull(p);
  for (size_t i = 0; i < n; i++)
    p[i] = (unsigned char)tu_rand(&seed);
  return p;
}

/* ---- the catalogue of malformed headers ------------------------------------------------ */

struct bad_header {
  const char *header; /* the JSON header, written with its own length */
  size_t data_len;    /* bytes after the header */
  int code;
  const char *tensor; /* must be named in the message, or NULL */
  const char *word;   /* must appear in the message */
};

#define F32_1(off0, off1) "{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[" #off0 "," #off1 "]}"

static const struct bad_header bad_headers[] = {
    /* not JSON, not an object, not UTF-8 */
    {"", 0, QKEEP_E_FORMAT, NULL, "empty"},
    {"{\"w\": {\"dtype\": \"F32\"", 0, QKEEP_E_FORMAT, NULL, "JSON"},
    {"{} x", 0, QKEEP_E_FORMAT, NULL, "JSON"},
    {"{\"w\":" F32_1(0, 4) "}{}", 4, QKEEP_E_FORMAT, NULL, "JSON"},
    {"[1, 2]", 0, QKEEP_E_FORMAT, NULL, "'{'"},
    {"\"w\"", 0, QKEEP_E_FORMAT, NULL, "'{'"},
    {" {}", 0, QKEEP_E_FORMAT, NULL, "'{'"},
    {"{\"w\xff\":" F32_1(0, 4) "}", 4, QKEEP_E_FORMAT, NULL, "UTF-8"},
    {"{\"w\xc0\xaf\":" F32_1(0, 4) "}", 4, QKEEP_E_FORMAT, NULL, "UTF-8"},     /* overlong '/' */
    {"{\"w\xed\xa0\x80\":" F32_1(0, 4) "}", 4, QKEEP_E_FORMAT, NULL, "UTF-8"}, /* surrogate */
    {"{\"w\xf4\x90\x80\x80\":" F32_1(0, 4) "}", 4, QKEEP_E_FORMAT, NULL, "UTF-8"}, /* > U+10FFFF */
    {"{}  \xe2\x82", 0, QKEEP_E_FORMAT, NULL, "UTF-8"},                              /* cut sequence */
    {"{\"a\\u0000b\":" F32_1(0, 4) "}", 4, QKEEP_E_FORMAT, NULL, "JSON"},            /* NUL in a name */
    /* duplicate names */
    {"{\"dup\":" F32_1(0, 4) ",\"dup\":" F32_1(4, 8) "}", 8, QKEEP_E_FORMAT, NULL, "\"dup\""},
    {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, QKEEP_E_FORMAT, NULL, "duplicate"},
    /* entries */
    {"{\"w.num\":5}", 0, QKEEP_E_FORMAT, "w.num", "not"},
    {"{\"w.unk\":{\"dtype\":\"F128\",\"shape\":[1],\"data_offsets\":[0,16]}}", 16, QKEEP_E_FORMAT, "w.unk",
     "unknown dtype 'F128'"},
    {"{\"w.lower\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, QKEEP_E_FORMAT, "w.lower",
     "unknown dtype"},
    {"{\"w.dnum\":{\"dtype\":32,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, QKEEP_E_FORMAT, "w.dnum", "dtype"},
    {"{\"w.nodt\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, QKEEP_E_FORMAT, "w.nodt", "missing key 'dtype'"},
    {"{\"w.nosh\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, QKEEP_E_FORMAT, "w.nosh",
     "missing key 'shape'"},
    {"{\"w.nooff\":{\"dtype\":\"F32\",\"shape\":[1]}}", 0, QKEEP_E_FORMAT, "w.nooff", "missing key 'data_offsets'"},
    {"{\"w.extra\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"foo\":1}}", 4, QKEEP_E_FORMAT,
     "w.extra", "unknown key 'foo'"},
    /* shapes */
    {"{\"w.neg\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, QKEEP_E_FORMAT, "w.neg",
     "shape"},
    {"{\"w.real\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4, QKEEP_E_FORMAT, "w.real",
     "shape"},
    {"{\"w.str\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8, QKEEP_E_FORMAT, "w.str",
     "shape"},
    {"{\"w.shnum\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", 4, QKEEP_E_FORMAT, "w.shnum",
     "shape"},
    {"{\"w.7d\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, QKEEP_E_FORMAT, "w.7d",
     "dimensions"},
    {"{\"w.ovf\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,0]}}", 0,
     QKEEP_E_FORMAT, "w.ovf", "overflow"},
    {"{\"w.bovf\":{\"dtype\":\"U64\",\"shape\":[4611686018427387904],\"data_offsets\":[0,0]}}", 0,
     QKEEP_E_FORMAT, "w.bovf", "overflow"},
    /* data_offsets */
    {"{\"w.one\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, QKEEP_E_FORMAT, "w.one",
     "data_offsets"},
    {"{\"w.three\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 4, QKEEP_E_FORMAT, "w.three",
     "data_offsets"},
    {"{\"w.obj\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{\"b\":0}}}", 4, QKEEP_E_FORMAT, "w.obj",
     "data_offsets"},
    {"{\"w.back\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4, QKEEP_E_FORMAT, "w.back",
     "end before"},
    {"{\"w.negoff\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4, QKEEP_E_FORMAT, "w.negoff",
     "data_offsets"},
    {"{\"w.realoff\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4.0]}}", 4, QKEEP_E_FORMAT,
     "w.realoff", "data_offsets"},
    {"{\"w.huge\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,18446744073709551616]}}", 4,
     QKEEP_E_FORMAT, NULL, "JSON"},
    /* sizes */
    {"{\"a.weight\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,12]}}", 12, QKEEP_E_FORMAT,
     "a.weight", "data_offsets [0, 12] hold 12 bytes, but F32 [2, 2] needs 16"},
    {"{\"w.scalar\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,0]}}", 0, QKEEP_E_FORMAT, "w.scalar",
     "needs 4"},
    {"{\"w.empty\":{\"dtype\":\"BF16\",\"shape\":[3,0],\"data_offsets\":[0,2]}}", 2, QKEEP_E_FORMAT, "w.empty",
     "needs 0"},
    {"{\"w.f4\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}}", 2, QKEEP_E_FORMAT, "w.f4",
     "whole number of bytes"},
    {"{\"w.f6\":{\"dtype\":\"F6_E2M3\",\"shape\":[2,3],\"data_offsets\":[0,5]}}", 5, QKEEP_E_FORMAT, "w.f6",
     "whole number of bytes"},
    /* layout */
    {"{\"a\":" F32_1(0, 4) ",\"b\":" F32_1(8, 12) "}", 12, QKEEP_E_FORMAT, "b", "gap"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
     12, QKEEP_E_FORMAT, "b", "overlap"},
    {"{\"a\":" F32_1(0, 4) ",\"b\":" F32_1(0, 4) "}", 4, QKEEP_E_FORMAT, "b", "overlap"},
    {"{\"w.late\":" F32_1(4, 8) "}", 8, QKEEP_E_FORMAT, "w.late", "start at 0"},
    {"{\"w.oob\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8, QKEEP_E_FORMAT, "w.oob",
     "past the end"},
    {"{\"a\":" F32_1(0, 4) ",\"w.last\":" F32_1(4, 8) "}", 7, QKEEP_E_FORMAT, "w.last", "past the end"},
    {"{\"w\":" F32_1(0, 4) "}", 8, QKEEP_E_FORMAT, NULL, "4 trailing bytes"},
    {"{}", 1, QKEEP_E_FORMAT, NULL, "trailing"},
    /* __metadata__ */
    {"{\"__metadata__\":{\"format\":1}}", 0, QKEEP_E_FORMAT, NULL, "'format'"},
    {"{\"__metadata__\":{\"a\":\"pt\",\"nested\":{}}}", 0, QKEEP_E_FORMAT, NULL, "'nested'"},
    {"{\"__metadata__\":\"pt\"}", 0, QKEEP_E_FORMAT, NULL, "__metadata__"},
    {"{\"__metadata__\":null}", 0, QKEEP_E_FORMAT, NULL, "__metadata__"},
};

#define N_BAD_HEADERS ((int)(sizeof bad_headers / sizeof bad_headers[0]))

START_TEST(test_bad_header) {
  const struct bad_header *c = &bad_headers[_i];
  char file[64];
  snprintf(file, sizeof file, "bad-%02d.safetensors", _i);
  char *path = put_st(file, c->header, c->data_len);
  expect_open_error(path, c->code, c->tensor, c->word);
  free(path);
}
END_TEST

/* The catalogue's file builder makes valid files when asked, so each case fails for its defect alone. */
START_TEST(test_builder_control) {
  char *path = put_st("control.safetensors",
                      "{\"a\":" F32_1(0, 4) ",\"b\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[4,20]}}",
                      20);
  struct st_file *f = open_ok(path);
  ck_assert_uint_eq(f->n_tensors, 2);
  st_close(f);
  free(path);
}
END_TEST

START_TEST(test_file_too_short) {
  for (size_t n = 0; n < 8; n++) {
    char *path = put_raw("short.safetensors", "\x02\0\0\0\0\0\0", n);
    expect_open_error(path, QKEEP_E_FORMAT, NULL, "too short");
    free(path);
  }
}
END_TEST

START_TEST(test_header_too_large) {
  char *path = put_len("big.safetensors", 100000001ULL, 40);
  expect_open_error(path, QKEEP_E_FORMAT, NULL, "100000000");
  free(path);
  path = put_len("huge.safetensors", UINT64_MAX, 40); /* 8 + N would wrap */
  expect_open_error(path, QKEEP_E_FORMAT, NULL, "limit");
  free(path);
}
END_TEST

START_TEST(test_header_past_eof) {
  char *path = put_len("eof.safetensors", 100, 20);
  expect_open_error(path, QKEEP_E_FORMAT, NULL, "past the end");
  free(path);
  path = put_len("eof1.safetensors", 21, 20);
  expect_open_error(path, QKEEP_E_FORMAT, NULL, "past the end");
  free(path);
}
END_TEST

START_TEST(test_missing_file) {
  char *path = tu_path(dir, "nope.safetensors");
  expect_open_error(path, QKEEP_E_NOTFOUND, NULL, "no such file");
  free(path);
  path = tu_path(dir, "no-dir/nope.safetensors");
  expect_open_error(path, QKEEP_E_NOTFOUND, NULL, NULL);
  free(path);
}
END_TEST

START_TEST(test_not_a_regular_file) { expect_open_error(dir, QKEEP_E_IO, NULL, "regular"); }
END_TEST

/* ---- valid files built by hand ------------------------------------------------------- */

/*
 * Entries out of name order and out of offset order, dtypes qkeep has no enum
 * for, a scalar, empty tensors at the start, middle and end, metadata, and
 * padding after the object.
 */
START_TEST(test_handbuilt_valid) {
  static const char header[] =
      "{\"z.f64\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[8,24]},"
      "\"__metadata__\":{\"format\":\"pt\",\"a\":\"\\u00e9\\n\"},"
      "\"a.scalar\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
      "\"m.empty\":{\"dtype\":\"I64\",\"shape\":[0,5],\"data_offsets\":[4,4]},"
      "\"b.bf16\":{\"dtype\":\"BF16\",\"shape\":[1,2],\"data_offsets\":[4,8]},"
      "\"e.end\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[30,30]},"
      "\"f.fp4\":{\"dtype\":\"F4\",\"shape\":[2,2],\"data_offsets\":[24,26]},"
      "\"g.bool\":{\"dtype\":\"BOOL\",\"shape\":[4],\"data_offsets\":[26,30]}}   ";
  const size_t header_len = sizeof header - 1;
  char *path = put_st("good.safetensors", header, 30);
  size_t file_len;
  unsigned char *bytes = tu_read_file(path, &file_len);
  ck_assert_ptr_nonnull(bytes);
  const unsigned char *data = bytes + 8 + header_len;

  struct st_file *f = open_ok(path);
  ck_assert_uint_eq(f->header_len, header_len);
  ck_assert_uint_eq(f->file_size, file_len);
  ck_assert_uint_eq(f->n_tensors, 7);
  for (size_t i = 1; i < f->n_tensors; i++)
    ck_assert_str_lt(f->tensors[i - 1].name, f->tensors[i].name);

  static const struct {
    const char *name, *dtype_name;
    int dtype, ndim;
    int64_t shape0;
    uint64_t begin, nbytes;
  } want[] = {
      {"z.f64", "F64", -1, 1, 2, 8, 16},
      {"a.scalar", "F32", QKEEP_DTYPE_F32, 0, 0, 0, 4},
      {"m.empty", "I64", QKEEP_DTYPE_I64, 2, 0, 4, 0},
      {"b.bf16", "BF16", QKEEP_DTYPE_BF16, 2, 1, 4, 4},
      {"e.end", "U8", QKEEP_DTYPE_U8, 1, 0, 30, 0},
      {"f.fp4", "F4", -1, 2, 2, 24, 2},
      {"g.bool", "BOOL", -1, 1, 4, 26, 4},
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const struct st_tensor *t = st_find(f, want[i].name);
    ck_assert_msg(t != NULL, "tensor %s not found", want[i].name);
    ck_assert_str_eq(t->name, want[i].name);
    ck_assert_str_eq(t->dtype_name, want[i].dtype_name);
    ck_assert_int_eq(t->dtype, want[i].dtype);
    ck_assert_int_eq(t->ndim, want[i].ndim);
    if (t->ndim > 0)
      ck_assert_int_eq(t->shape[0], want[i].shape0);
    ck_assert_uint_eq(t->offset, 8 + header_len + want[i].begin);
    ck_assert_uint_eq(t->nbytes, want[i].nbytes);
    unsigned char buf[32];
    memset(buf, 0xEE, sizeof buf);
    ck_assert_int_eq(st_read(f, t, t->nbytes ? buf : NULL), 0);
    ck_assert_mem_eq(buf, data + want[i].begin, t->nbytes);
  }
  ck_assert_ptr_null(st_find(f, "nope"));
  ck_assert_ptr_null(st_find(f, ""));
  ck_assert_ptr_null(st_find(f, "__metadata__"));

  ck_assert_uint_eq(f->n_metadata, 2);
  ck_assert_str_eq(f->metadata_keys[0], "format");
  ck_assert_str_eq(f->metadata_keys[1], "a");
  ck_assert_str_eq(st_metadata(f, "format"), "pt");
  ck_assert_str_eq(st_metadata(f, "a"), "\xc3\xa9\n");
  ck_assert_ptr_null(st_metadata(f, "missing"));
  st_close(f);
  free(bytes);
  free(path);
}
END_TEST
