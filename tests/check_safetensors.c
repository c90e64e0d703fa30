/*
 * check_safetensors.c: the safetensors reader (libqkeep/format/safetensors.c) and writer
 * (libqkeep/format/safetensors_write.c).
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

#include "checkutil.h"
#include "private.h"
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
  ck_assert_msg(rc == code, "st_open returned %d (%s), expected %d; message: %s", rc, qkeep_strerror(rc),
                code, msg);
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
    {" [1]", 0, QKEEP_E_FORMAT, NULL, "'{'"},
    {" \n\t", 0, QKEEP_E_FORMAT, NULL, "'{'"},
    {"{\"w\xff\":" F32_1(0, 4) "}", 4, QKEEP_E_FORMAT, NULL, "UTF-8"},
    {"{\"w\xc0\xaf\":" F32_1(0, 4) "}", 4, QKEEP_E_FORMAT, NULL, "UTF-8"},         /* overlong '/' */
    {"{\"w\xed\xa0\x80\":" F32_1(0, 4) "}", 4, QKEEP_E_FORMAT, NULL, "UTF-8"},     /* surrogate */
    {"{\"w\xf4\x90\x80\x80\":" F32_1(0, 4) "}", 4, QKEEP_E_FORMAT, NULL, "UTF-8"}, /* > U+10FFFF */
    {"{}  \xe2\x82", 0, QKEEP_E_FORMAT, NULL, "UTF-8"},                            /* cut sequence */
    /* NUL in a name: valid JSON and valid safetensors, refused (qkeep's names are C strings) */
    {"{\"a\\u0000b\":" F32_1(0, 4) "}", 4, QKEEP_E_UNSUPPORTED, NULL, "\\u0000"},
    /* duplicate names */
    {"{\"dup\":" F32_1(0, 4) ",\"dup\":" F32_1(4, 8) "}", 8, QKEEP_E_FORMAT, NULL, "\"dup\""},
    {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, QKEEP_E_FORMAT, NULL, "duplicate"},
    /* entries */
    {"{\"w.num\":5}", 0, QKEEP_E_FORMAT, "w.num", "expected an object"},
    {"{\"w.unk\":{\"dtype\":\"F128\",\"shape\":[1],\"data_offsets\":[0,16]}}", 16, QKEEP_E_FORMAT, "w.unk",
     "unknown dtype 'F128'"},
    {"{\"w.lower\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, QKEEP_E_FORMAT, "w.lower",
     "unknown dtype"},
    {"{\"w.dnum\":{\"dtype\":32,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, QKEEP_E_FORMAT, "w.dnum",
     "dtype"},
    {"{\"w.nodt\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, QKEEP_E_FORMAT, "w.nodt",
     "missing key 'dtype'"},
    {"{\"w.nosh\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, QKEEP_E_FORMAT, "w.nosh",
     "missing key 'shape'"},
    {"{\"w.nooff\":{\"dtype\":\"F32\",\"shape\":[1]}}", 0, QKEEP_E_FORMAT, "w.nooff",
     "missing key 'data_offsets'"},
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
    /* a dimension >= 2^63 only in a tensor of no elements, and the product overflowing in order */
    {"{\"w.big\":{\"dtype\":\"F32\",\"shape\":[9223372036854775808],\"data_offsets\":[0,0]}}", 0,
     QKEEP_E_FORMAT, "w.big", "overflow"},
    {"{\"w.bigo\":{\"dtype\":\"U8\",\"shape\":[9223372036854775808,2,0],\"data_offsets\":[0,0]}}", 0,
     QKEEP_E_FORMAT, "w.bigo", "overflow"},
    {"{\"w.big65\":{\"dtype\":\"U8\",\"shape\":[0,18446744073709551616],\"data_offsets\":[0,0]}}", 0,
     QKEEP_E_FORMAT, NULL, "2^64"},
    {"{\"w.bigneg\":{\"dtype\":\"U8\",\"shape\":[0,9223372036854775808,-100000000000000000],"
     "\"data_offsets\":[0,0]}}",
     0, QKEEP_E_FORMAT, NULL, "out of range"},
    {"{\"w.bigoff\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,9223372036854775808]}}", 0,
     QKEEP_E_FORMAT, "w.bigoff", NULL},
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
    {"{\"w.negoff\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4, QKEEP_E_FORMAT,
     "w.negoff", "data_offsets"},
    {"{\"w.realoff\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4.0]}}", 4, QKEEP_E_FORMAT,
     "w.realoff", "data_offsets"},
    {"{\"w.huge\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,18446744073709551616]}}", 4,
     QKEEP_E_FORMAT, NULL, "2^64"},
    /* sizes */
    {"{\"a.weight\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,12]}}", 12, QKEEP_E_FORMAT,
     "a.weight", "data_offsets [0, 12] hold 12 bytes, but F32 [2, 2] needs 16"},
    {"{\"w.scalar\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,0]}}", 0, QKEEP_E_FORMAT, "w.scalar",
     "needs 4"},
    {"{\"w.empty\":{\"dtype\":\"BF16\",\"shape\":[3,0],\"data_offsets\":[0,2]}}", 2, QKEEP_E_FORMAT,
     "w.empty", "needs 0"},
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
    {"{\"w.data\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"z.empty\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[8,8]}}",
     4, QKEEP_E_FORMAT, "w.data", "past the end"},
    {"{\"w\":" F32_1(0, 4) "}", 8, QKEEP_E_FORMAT, NULL, "4 trailing bytes"},
    {"{}", 1, QKEEP_E_FORMAT, NULL, "trailing"},
    /* __metadata__ */
    {"{\"__metadata__\":{\"format\":1}}", 0, QKEEP_E_FORMAT, NULL, "'format'"},
    {"{\"__metadata__\":{\"a\":\"pt\",\"nested\":{}}}", 0, QKEEP_E_FORMAT, NULL, "'nested'"},
    {"{\"__metadata__\":\"pt\"}", 0, QKEEP_E_FORMAT, NULL, "__metadata__"},
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
  char *path =
      put_st("control.safetensors",
             "{\"a\":" F32_1(0, 4) ",\"b\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[4,20]}}", 20);
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

/* Found by fuzz_safetensors: a NUL byte after a literal above INT64_MAX in one entry's value. The
 * re-parse of that value copied it with strndup, which stops at the NUL, then scanned the whole
 * length of the value (a heap over-read: ASan, valgrind), and jansson took the NUL as the end of the
 * text, so the file opened. A raw NUL is no JSON: refused wherever it is. */
START_TEST(test_nul_after_big_integer) {
  static const char header[] = "{\"w\":{\"dtype\":\"U8\",\"shape\":[0,9223372036854775808\0],"
                               "\"data_offsets\":[0,0]}}";
  char *path = put_st_n("nul.safetensors", header, sizeof header - 1, 0);
  expect_open_error(path, QKEEP_E_FORMAT, NULL, NULL);
  free(path);
  static const char trailing[] = "{\"w\":[18446744073709551615,\"\0";
  path = put_st_n("nul2.safetensors", trailing, sizeof trailing - 1, 0);
  expect_open_error(path, QKEEP_E_FORMAT, NULL, NULL);
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
 * Entries out of name order and out of offset order, the sub-byte and 64-bit
 * dtypes, a scalar, empty tensors at the start, middle and end, metadata, and
 * padding after the object.
 */
START_TEST(test_handbuilt_valid) {
  static const char header[] = "{\"z.f64\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[8,24]},"
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
      {"z.f64", "F64", QKEEP_DTYPE_F64, 1, 2, 8, 16},    {"a.scalar", "F32", QKEEP_DTYPE_F32, 0, 0, 0, 4},
      {"m.empty", "I64", QKEEP_DTYPE_I64, 2, 0, 4, 0},   {"b.bf16", "BF16", QKEEP_DTYPE_BF16, 2, 1, 4, 4},
      {"e.end", "U8", QKEEP_DTYPE_U8, 1, 0, 30, 0},      {"f.fp4", "F4", QKEEP_DTYPE_F4, 2, 2, 24, 2},
      {"g.bool", "BOOL", QKEEP_DTYPE_BOOL, 1, 4, 26, 4},
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

/*
 * What huggingface/safetensors' own reader accepts (tensor.rs at 24b0b28): spaces and newlines
 * before the '{' (writers pad the header to page-align the data), more than six dimensions,
 * "__metadata__": null, and a tensor of no elements with a dimension >= 2^63. The rank-8 and
 * huge shapes come back whole in full_shape, with a collapsed qkeep shape beside them.
 */
START_TEST(test_reference_accepts) {
  static const char header[] =
      "  \n\t {\"__metadata__\":null,"
      "\"r.rank8\":{\"dtype\":\"U8\",\"shape\":[2,1,3,1,1,2,1,2],\"data_offsets\":[0,24]},"
      "\"z.huge\":{\"dtype\":\"F32\",\"shape\":[0,18446744073709551615],\"data_offsets\":[24,24]},"
      "\"z.huge2\":{\"dtype\":\"BF16\",\"shape\":[9223372036854775808,0],\"data_offsets\":[24,24]},"
      "\"a.rank7\":{\"dtype\":\"F16\",\"shape\":[1,1,1,1,1,1,2],\"data_offsets\":[24,28]}}";
  char *path = put_st("accepts.safetensors", header, 28);
  struct st_file *f = open_ok(path);
  ck_assert_uint_eq(f->n_tensors, 4);
  ck_assert_uint_eq(f->n_metadata, 0);

  const struct st_tensor *t = st_find(f, "r.rank8");
  ck_assert_ptr_nonnull(t);
  ck_assert_int_eq(t->full_ndim, 8);
  static const uint64_t rank8[8] = {2, 1, 3, 1, 1, 2, 1, 2};
  ck_assert_mem_eq(t->full_shape, rank8, sizeof rank8);
  /* collapsed: the leading dims merge so that the last five stay */
  static const int64_t collapsed8[6] = {6, 1, 1, 2, 1, 2};
  ck_assert_int_eq(t->ndim, 6);
  ck_assert_mem_eq(t->shape, collapsed8, sizeof collapsed8);
  ck_assert_uint_eq(t->nbytes, 24);

  t = st_find(f, "a.rank7");
  ck_assert_int_eq(t->full_ndim, 7);
  ck_assert_int_eq(t->ndim, 6);
  ck_assert_int_eq(t->shape[0], 1);
  ck_assert_int_eq(t->shape[5], 2);
  ck_assert_uint_eq(t->nbytes, 4);

  t = st_find(f, "z.huge");
  ck_assert_int_eq(t->full_ndim, 2);
  ck_assert_uint_eq(t->full_shape[1], UINT64_MAX);
  ck_assert_int_eq(t->ndim, 1); /* no elements: [0] */
  ck_assert_int_eq(t->shape[0], 0);
  ck_assert_uint_eq(t->nbytes, 0);
  t = st_find(f, "z.huge2");
  ck_assert_uint_eq(t->full_shape[0], 9223372036854775808ULL);
  ck_assert_uint_eq(t->nbytes, 0);
  st_close(f);
  free(path);

  /* a plain shape keeps no full_shape */
  path =
      put_st("plain.safetensors", "{\"a.b\":{\"dtype\":\"U8\",\"shape\":[2,3],\"data_offsets\":[0,6]}}", 6);
  f = open_ok(path);
  ck_assert_ptr_null(f->tensors[0].full_shape);
  st_close(f);
  free(path);
}
END_TEST

/*
 * Names with escapes: each decodes to its bytes ("a\u0041b" is "aAb", "a\\u0000b" the eight
 * characters a, \, u, 0, 0, 0, 0, b), but the escape \u0000 (a NUL character, which the reference
 * reader accepts) is refused as unsupported, naming the file and the place: qkeep's names are C
 * strings, so "a\u0000b" would stand for "a" (here a second tensor's name).
 */
START_TEST(test_nul_in_a_name_is_refused_other_escapes_load) {
  char *path =
      put_st("escapes.safetensors", "{\"a\\u0041b\":" F32_1(0, 4) ",\"a\\\\u0000b\":" F32_1(4, 8) "}", 8);
  struct st_file *f = open_ok(path);
  ck_assert_ptr_nonnull(st_find(f, "aAb"));
  ck_assert_ptr_nonnull(st_find(f, "a\\u0000b"));
  st_close(f);
  free(path);
  path = put_st("nul.safetensors", "{\"a\":" F32_1(0, 4) ",\n\"a\\u0000b\":" F32_1(4, 8) "}", 8);
  expect_open_error(path, QKEEP_E_UNSUPPORTED, NULL, "line 2, column 1 holds the escape \\u0000");
  free(path);
}
END_TEST

START_TEST(test_handbuilt_no_tensors) {
  char *path = put_st("empty.safetensors", "{}      ", 0);
  struct st_file *f = open_ok(path);
  ck_assert_uint_eq(f->n_tensors, 0);
  ck_assert_uint_eq(f->n_metadata, 0);
  ck_assert_ptr_null(st_find(f, "a"));
  st_close(f);
  free(path);

  path = put_st("meta-only.safetensors", "{\"__metadata__\":{}}", 0);
  f = open_ok(path);
  ck_assert_uint_eq(f->n_tensors, 0);
  ck_assert_uint_eq(f->n_metadata, 0);
  st_close(f);
  free(path);
}
END_TEST

/* Padding after the object: spaces as the reference writes, and any JSON whitespace as its reader accepts. */
START_TEST(test_handbuilt_padding) {
  static const char *const headers[] = {
      "{\"w\":" F32_1(0, 4) "}",
      "{\"w\":" F32_1(0, 4) "}       ",
      "{\"w\":" F32_1(0, 4) "}\n",
      "{ \"w\" :\n\t" F32_1(0, 4) " } \r\n",
  };
  for (size_t i = 0; i < sizeof headers / sizeof headers[0]; i++) {
    char *path = put_st("pad.safetensors", headers[i], 4);
    struct st_file *f = open_ok(path);
    const struct st_tensor *t = st_find(f, "w");
    ck_assert_ptr_nonnull(t);
    ck_assert_uint_eq(t->offset, 8 + strlen(headers[i]));
    st_close(f);
    free(path);
  }
}
END_TEST

/* ---- truncation and I/O after open ---------------------------------------------------- */

START_TEST(test_truncated_after_open) {
  float big[1024], small[16];
  for (int i = 0; i < 1024; i++)
    big[i] = (float)i;
  for (int i = 0; i < 16; i++)
    small[i] = -(float)i;
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  struct qkeep_spec spec_big = spec_of(QKEEP_DTYPE_F32, 1, (int64_t[]){1024});
  struct qkeep_spec spec_small = spec_of(QKEEP_DTYPE_F32, 2, (int64_t[]){4, 4});
  ck_assert_int_eq(st_writer_add(w, "w.big", &spec_big, big), 0);
  ck_assert_int_eq(st_writer_add(w, "w.small", &spec_small, small), 0);
  char *path = tu_path(dir, "trunc.safetensors");
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);

  struct st_file *f = open_ok(path);
  const struct st_tensor *tb = st_find(f, "w.big"), *ts = st_find(f, "w.small");
  ck_assert_ptr_nonnull(tb);
  ck_assert_ptr_nonnull(ts);
  ck_assert_uint_lt(tb->offset, ts->offset); /* same dtype: name order */
  float out[1024];
  ck_assert_int_eq(st_read(f, ts, out), 0);
  ck_assert_mem_eq(out, small, sizeof small);

  ck_assert_int_eq(truncate(path, (off_t)f->file_size - 10), 0);
  ck_assert_int_eq(st_read(f, ts, out), QKEEP_E_IO);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), path));
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "'w.small'"));
  ck_assert_int_eq(st_read(f, tb, out), QKEEP_E_IO); /* intact bytes, but the file changed */
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "'w.big'"));

  ck_assert_int_eq(truncate(path, 0), 0);
  ck_assert_int_eq(st_read(f, tb, out), QKEEP_E_IO);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), path));

  ck_assert_int_eq(truncate(path, (off_t)f->file_size + 100), 0); /* grown: changed as well */
  ck_assert_int_eq(st_read(f, tb, out), QKEEP_E_IO);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "changed size"));

  ck_assert_int_eq(truncate(path, (off_t)f->file_size), 0); /* same size again: readable (zeros) */
  ck_assert_int_eq(st_read(f, ts, out), 0);
  st_close(f);
  free(path);
}
END_TEST

/* ---- the writer ------------------------------------------------------------------------ */

struct rt_tensor {
  char name[64];
  struct qkeep_spec spec;
  size_t nbytes;
  void *data;
};

/*
 * Every qkeep dtype in two shapes, a scalar, empty tensors, six dimensions and
 * names that need escaping; metadata likewise. Everything must come back
 * exactly, and the file must have the reference layout.
 */
START_TEST(test_round_trip) {
  struct rt_tensor ts[2 * QKEEP_DTYPE_COUNT + 4];
  size_t n = 0;
  for (int d = 0; d < QKEEP_DTYPE_COUNT; d++) {
    snprintf(ts[n].name, sizeof ts[n].name, "model.layers.%d.%s.weight", d,
             qkeep_dtype_name((enum qkeep_dtype)d));
    ts[n++].spec = spec_of((enum qkeep_dtype)d, 2, (int64_t[]){3, 8}); /* whole bytes for F4 and F6 too */
    snprintf(ts[n].name, sizeof ts[n].name, "model.layers.%d.%s.bias", d,
             qkeep_dtype_name((enum qkeep_dtype)d));
    ts[n++].spec = spec_of((enum qkeep_dtype)d, 1, (int64_t[]){4});
  }
  snprintf(ts[n].name, sizeof ts[n].name, "scalar");
  ts[n++].spec = spec_of(QKEEP_DTYPE_F32, 0, NULL);
  snprintf(ts[n].name, sizeof ts[n].name, "empty.i32");
  ts[n++].spec = spec_of(QKEEP_DTYPE_I32, 2, (int64_t[]){4, 0});
  snprintf(ts[n].name, sizeof ts[n].name, "empty.bf16");
  ts[n++].spec = spec_of(QKEEP_DTYPE_BF16, 1, (int64_t[]){0});
  snprintf(ts[n].name, sizeof ts[n].name, "we\"ird\\name\n\t\x01\x1f/\xc3\xa9\xe2\x82\xac");
  ts[n++].spec = spec_of(QKEEP_DTYPE_F16, 6, (int64_t[]){1, 2, 1, 3, 1, 2});
  ck_assert_uint_eq(n, sizeof ts / sizeof ts[0]);

  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  size_t data_total = 0;
  for (size_t i = 0; i < n; i++) {
    ts[i].nbytes = qkeep_spec_bytes(&ts[i].spec);
    ts[i].data = pattern(ts[i].nbytes, i + 1);
    data_total += ts[i].nbytes;
    ck_assert_int_eq(st_writer_add(w, ts[i].name, &ts[i].spec, ts[i].nbytes ? ts[i].data : NULL), 0);
  }
  ck_assert_int_eq(st_writer_set_metadata(w, "format", "pt"), 0);
  ck_assert_int_eq(st_writer_set_metadata(w, "quant \"method\"\\", "nvfp4\n\t\x01\xc3\xa9"), 0);
  char *path = tu_path(dir, "rt.safetensors");
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);

  /* The raw layout. */
  size_t file_len;
  unsigned char *bytes = tu_read_file(path, &file_len);
  ck_assert_ptr_nonnull(bytes);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; i--)
    header_len = (header_len << 8) | bytes[i];
  ck_assert_uint_eq(header_len % 8, 0);
  ck_assert_uint_eq(file_len, 8 + header_len + data_total);
  const char *header = (const char *)bytes + 8;
  ck_assert_int_eq(strncmp(header, "{\"__metadata__\":{\"format\":\"pt\",", 31), 0);
  size_t close_at = (size_t)header_len;
  while (close_at > 0 && header[close_at - 1] == ' ')
    close_at--;
  ck_assert_int_eq(header[close_at - 1], '}');
  ck_assert_uint_lt(header_len - close_at, 8);
  /* serde_json's escapes */
  ck_assert_ptr_nonnull(memmem(header, header_len, "\"we\\\"ird\\\\name\\n\\t\\u0001\\u001f/\xc3\xa9", 33));

  /* Everything reads back. */
  struct st_file *f = open_ok(path);
  ck_assert_uint_eq(f->header_len, header_len);
  ck_assert_uint_eq(f->n_tensors, n);
  for (size_t i = 0; i < n; i++) {
    const struct st_tensor *t = st_find(f, ts[i].name);
    ck_assert_msg(t != NULL, "tensor %s not found", ts[i].name);
    ck_assert_int_eq(t->dtype, (int)ts[i].spec.dtype);
    ck_assert_str_eq(t->dtype_name, qkeep_dtype_name(ts[i].spec.dtype));
    ck_assert_int_eq(t->ndim, ts[i].spec.ndim);
    for (int d = 0; d < t->ndim; d++)
      ck_assert_int_eq(t->shape[d], ts[i].spec.shape[d]);
    ck_assert_uint_eq(t->nbytes, ts[i].nbytes);
    /* alignment: each tensor starts at a multiple of its element size, counted from the data buffer */
    size_t align = qkeep_dtype_size(ts[i].spec.dtype) ? qkeep_dtype_size(ts[i].spec.dtype) : 1;
    ck_assert_uint_eq((t->offset - 8 - header_len) % align, 0);
    void *back = malloc(t->nbytes + 1);
    ck_assert_int_eq(st_read(f, t, back), 0);
    ck_assert_mem_eq(back, ts[i].data, t->nbytes);
    ck_assert_mem_eq(bytes + t->offset, ts[i].data, t->nbytes);
    free(back);
  }
  ck_assert_uint_eq(f->n_metadata, 2);
  ck_assert_str_eq(f->metadata_keys[0], "format");
  ck_assert_str_eq(f->metadata_keys[1], "quant \"method\"\\");
  ck_assert_str_eq(st_metadata(f, "format"), "pt");
  ck_assert_str_eq(st_metadata(f, "quant \"method\"\\"), "nvfp4\n\t\x01\xc3\xa9");
  st_close(f);
  for (size_t i = 0; i < n; i++)
    free(ts[i].data);
  free(bytes);
  free(path);
}
END_TEST

static int cmp_offset(const void *a, const void *b) {
  const struct st_tensor *x = *(const struct st_tensor *const *)a, *y = *(const struct st_tensor *const *)b;
  return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/*
 * The on-disk order is the reference serializer's: dtypes by descending rank
 * in its Dtype enum (I64 > F32 > I32 > BF16 > F16 > F8_E8M0 > F8_E4M3 > I8 >
 * U8), then names. "a.i32" comes after the F32 tensors although its name sorts
 * first, as in the reference.
 */
START_TEST(test_writer_order) {
  static const struct {
    const char *name;
    enum qkeep_dtype dtype;
  } added[] = {
      {"u8", QKEEP_DTYPE_U8},     {"f32.z", QKEEP_DTYPE_F32},    {"i64", QKEEP_DTYPE_I64},
      {"f32.a", QKEEP_DTYPE_F32}, {"a.i32", QKEEP_DTYPE_I32},    {"bf16", QKEEP_DTYPE_BF16},
      {"f16", QKEEP_DTYPE_F16},   {"e8m0", QKEEP_DTYPE_F8_E8M0}, {"e4m3", QKEEP_DTYPE_F8_E4M3},
      {"i8", QKEEP_DTYPE_I8},
  };
  static const char *const expected[] = {"i64", "f32.a", "f32.z", "a.i32", "bf16",
                                         "f16", "e8m0",  "e4m3",  "i8",    "u8"};
  enum { N = sizeof added / sizeof added[0] };

  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  unsigned char data[3 * 8] = {0};
  for (size_t i = 0; i < N; i++) {
    /* 3 elements each, so that nothing after the first tensor is aligned by chance */
    struct qkeep_spec spec = spec_of(added[i].dtype, 1, (int64_t[]){3});
    ck_assert_int_eq(st_writer_add(w, added[i].name, &spec, data), 0);
  }
  char *path = tu_path(dir, "order.safetensors");
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);

  struct st_file *f = open_ok(path);
  const struct st_tensor *by_offset[N];
  ck_assert_uint_eq(f->n_tensors, N);
  for (size_t i = 0; i < N; i++)
    by_offset[i] = &f->tensors[i];
  qsort(by_offset, N, sizeof by_offset[0], cmp_offset);
  for (size_t i = 0; i < N; i++) {
    ck_assert_str_eq(by_offset[i]->name, expected[i]);
    if (i > 0)
      ck_assert_uint_ge(qkeep_dtype_size(by_offset[i - 1]->dtype), qkeep_dtype_size(by_offset[i]->dtype));
  }
  ck_assert_uint_eq(by_offset[0]->offset, 8 + f->header_len);

  /* The header lists them in the same order. */
  size_t len;
  char *bytes = tu_read_file(path, &len);
  ck_assert_ptr_nonnull(bytes);
  const char *prev = bytes + 8;
  for (size_t i = 0; i < N; i++) {
    char key[32];
    snprintf(key, sizeof key, "\"%s\":{", expected[i]);
    const char *at = strstr(bytes + 8, key);
    ck_assert_ptr_nonnull(at);
    ck_assert(at > prev);
    prev = at;
  }
  free(bytes);
  st_close(f);
  free(path);
}
END_TEST

/* Compares the file at path with n expected bytes. */
static void expect_file_bytes(const char *path, const void *expected, size_t n) {
  size_t len;
  unsigned char *bytes = tu_read_file(path, &len);
  ck_assert_ptr_nonnull(bytes);
  ck_assert_uint_eq(len, n);
  ck_assert_mem_eq(bytes, expected, n);
  free(bytes);
}

/* The byte strings of the reference serializer's own unit tests (safetensors/src/tensor.rs). */
START_TEST(test_writer_matches_reference_bytes) {
  const float values[6] = {0, 1, 2, 3, 4, 5};
  static const char f32_data[24] = "\0\0\0\0\0\0\x80\x3f\0\0\0\x40\0\0\x40\x40\0\0\x80\x40\0\0\xa0\x40";
  ck_assert_mem_eq(values, f32_data, 24); /* little-endian host */
  char *path = tu_path(dir, "ref.safetensors");
  struct st_writer *w;

  /* test_serialization: 64-byte header, no padding needed */
  static const char serialization[8 + 64 + 24] =
      "\x40\0\0\0\0\0\0\0"
      "{\"attn.0\":{\"dtype\":\"F32\",\"shape\":[1,2,3],\"data_offsets\":[0,24]}}"
      "\0\0\0\0\0\0\x80\x3f\0\0\0\x40\0\0\x40\x40\0\0\x80\x40\0\0\xa0\x40";
  ck_assert_int_eq(st_writer_new(&w), 0);
  struct qkeep_spec spec = spec_of(QKEEP_DTYPE_F32, 3, (int64_t[]){1, 2, 3});
  ck_assert_int_eq(st_writer_add(w, "attn.0", &spec, values), 0);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  expect_file_bytes(path, serialization, sizeof serialization);

  /* test_serialization_forced_alignement: 65 bytes of JSON padded with 7 spaces */
  static const char forced[8 + 72 + 24] =
      "\x48\0\0\0\0\0\0\0"
      "{\"attn0\":{\"dtype\":\"F32\",\"shape\":[1,1,2,3],\"data_offsets\":[0,24]}}       "
      "\0\0\0\0\0\0\x80\x3f\0\0\0\x40\0\0\x40\x40\0\0\x80\x40\0\0\xa0\x40";
  ck_assert_int_eq(st_writer_new(&w), 0);
  spec = spec_of(QKEEP_DTYPE_F32, 4, (int64_t[]){1, 1, 2, 3});
  ck_assert_int_eq(st_writer_add(w, "attn0", &spec, values), 0);
  ck_assert_int_eq(st_writer_write(w, path), 0); /* over the previous file */
  st_writer_free(w);
  expect_file_bytes(path, forced, sizeof forced);

  /* test_empty, without and with metadata */
  ck_assert_int_eq(st_writer_new(&w), 0);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  expect_file_bytes(path, "\x08\0\0\0\0\0\0\0{}      ", 16);
  ck_assert_int_eq(st_writer_set_metadata(w, "framework", "pt"), 0);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  expect_file_bytes(path, "\x28\0\0\0\0\0\0\0{\"__metadata__\":{\"framework\":\"pt\"}}     ", 48);
  st_writer_free(w);
  free(path);
}
END_TEST

START_TEST(test_writer_rejects) {
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  float data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  struct qkeep_spec good = spec_of(QKEEP_DTYPE_F32, 2, (int64_t[]){2, 4});
  ck_assert_int_eq(st_writer_add(w, "w", &good, data), 0);

  ck_assert_int_eq(st_writer_add(w, "w", &good, data), QKEEP_E_EXISTS);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "'w'"));
  ck_assert_int_eq(st_writer_add(w, NULL, &good, data), QKEEP_E_INVAL);
  ck_assert_int_eq(st_writer_add(w, "__metadata__", &good, data), QKEEP_E_INVAL);
  ck_assert_int_eq(st_writer_add(w, "bad\xff", &good, data), QKEEP_E_INVAL);
  ck_assert_int_eq(st_writer_add(w, "bad\xed\xa0\x80", &good, data), QKEEP_E_INVAL);
  ck_assert_int_eq(st_writer_add(w, "x.nospec", NULL, data), QKEEP_E_INVAL);
  ck_assert_int_eq(st_writer_add(w, "x.nodata", &good, NULL), QKEEP_E_INVAL);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "'x.nodata'"));

  struct qkeep_spec bad = good;
  bad.dtype = QKEEP_DTYPE_COUNT;
  ck_assert_int_eq(st_writer_add(w, "x.dtype", &bad, data), QKEEP_E_INVAL);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "'x.dtype'"));
  bad.dtype = (enum qkeep_dtype) - 1;
  ck_assert_int_eq(st_writer_add(w, "x.dtype", &bad, data), QKEEP_E_INVAL);
  bad = good;
  bad.ndim = QKEEP_MAX_DIMS + 1;
  ck_assert_int_eq(st_writer_add(w, "x.ndim", &bad, data), QKEEP_E_INVAL);
  bad.ndim = -1;
  ck_assert_int_eq(st_writer_add(w, "x.ndim", &bad, data), QKEEP_E_INVAL);
  bad = good;
  bad.shape[1] = -4;
  ck_assert_int_eq(st_writer_add(w, "x.neg", &bad, data), QKEEP_E_INVAL);
  bad = spec_of(QKEEP_DTYPE_I64, 3, (int64_t[]){INT64_MAX, 2, 0}); /* overflows before the 0 */
  ck_assert_int_eq(st_writer_add(w, "x.huge", &bad, data), QKEEP_E_INVAL);
  bad = spec_of(QKEEP_DTYPE_F32, 1, (int64_t[]){INT64_MAX / 2});
  ck_assert_int_eq(st_writer_add(w, "x.huge", &bad, data), QKEEP_E_INVAL);

  ck_assert_int_eq(st_writer_set_metadata(w, NULL, "v"), QKEEP_E_INVAL);
  ck_assert_int_eq(st_writer_set_metadata(w, "k", NULL), QKEEP_E_INVAL);
  ck_assert_int_eq(st_writer_set_metadata(w, "k", "\xc3"), QKEEP_E_INVAL);

  /* An empty tensor needs no data; "set" replaces a value in place. */
  struct qkeep_spec empty = spec_of(QKEEP_DTYPE_U8, 2, (int64_t[]){0, 3});
  ck_assert_int_eq(st_writer_add(w, "e", &empty, NULL), 0);
  ck_assert_int_eq(st_writer_set_metadata(w, "k", "1"), 0);
  ck_assert_int_eq(st_writer_set_metadata(w, "x", "2"), 0);
  ck_assert_int_eq(st_writer_set_metadata(w, "k", "3"), 0);

  /* The data was copied at add time. */
  data[0] = 99;
  char *path = tu_path(dir, "after-errors.safetensors");
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  struct st_file *f = open_ok(path);
  ck_assert_uint_eq(f->n_tensors, 2);
  float back[8];
  ck_assert_int_eq(st_read(f, st_find(f, "w"), back), 0);
  ck_assert(back[0] == 1.0f && back[7] == 8.0f);
  ck_assert_uint_eq(st_find(f, "e")->nbytes, 0);
  ck_assert_uint_eq(f->n_metadata, 2);
  ck_assert_str_eq(f->metadata_keys[0], "k");
  ck_assert_str_eq(f->metadata_values[0], "3");
  ck_assert_str_eq(f->metadata_keys[1], "x");
  st_close(f);
  free(path);
}
END_TEST

/* Counts the entries of a directory other than . and .. */
static int count_entries(const char *path) {
  DIR *d = opendir(path);
  ck_assert_ptr_nonnull(d);
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, ".."))
      n++;
  closedir(d);
  return n;
}

START_TEST(test_writer_failure_leaves_nothing) {
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  float data[4] = {1, 2, 3, 4};
  struct qkeep_spec spec = spec_of(QKEEP_DTYPE_F32, 1, (int64_t[]){4});
  ck_assert_int_eq(st_writer_add(w, "w", &spec, data), 0);

  /* The directory does not exist: nothing is created. */
  char *path = tu_path(dir, "missing/out.safetensors");
  ck_assert_int_eq(st_writer_write(w, path), QKEEP_E_IO);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), path));
  ck_assert_int_eq(count_entries(dir), 0);
  free(path);

  /* The rename fails (a directory is in the way): the temporary file is removed. */
  path = tu_path(dir, "out.safetensors");
  ck_assert_int_eq(mkdir(path, 0755), 0);
  ck_assert_int_eq(st_writer_write(w, path), QKEEP_E_IO);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), path));
  ck_assert_int_eq(count_entries(dir), 1);
  ck_assert_int_eq(count_entries(path), 0);
  ck_assert_int_eq(rmdir(path), 0);

  /* Replacing an existing file works, and leaves one file. */
  ck_assert_int_eq(tu_write_file(path, "old", 3), 0);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  ck_assert_int_eq(count_entries(dir), 1);
  struct st_file *f = open_ok(path);
  ck_assert_uint_eq(f->n_tensors, 1);
  st_close(f);
  st_writer_free(w);
  free(path);
}
END_TEST

/* ---- the suite -------------------------------------------------------------------------- */

static Suite *safetensors_suite(void) {
  Suite *s = suite_create("safetensors");

  TCase *tc = tcase_create("malformed");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_loop_test(tc, test_bad_header, 0, N_BAD_HEADERS);
  tcase_add_test(tc, test_builder_control);
  tcase_add_test(tc, test_file_too_short);
  tcase_add_test(tc, test_header_too_large);
  tcase_add_test(tc, test_header_past_eof);
  tcase_add_test(tc, test_nul_after_big_integer);
  tcase_add_test(tc, test_missing_file);
  tcase_add_test(tc, test_not_a_regular_file);
  suite_add_tcase(s, tc);

  tc = tcase_create("reader");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, test_handbuilt_valid);
  tcase_add_test(tc, test_reference_accepts);
  tcase_add_test(tc, test_nul_in_a_name_is_refused_other_escapes_load);
  tcase_add_test(tc, test_handbuilt_no_tensors);
  tcase_add_test(tc, test_handbuilt_padding);
  tcase_add_test(tc, test_truncated_after_open);
  suite_add_tcase(s, tc);

  tc = tcase_create("writer");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, test_round_trip);
  tcase_add_test(tc, test_writer_order);
  tcase_add_test(tc, test_writer_matches_reference_bytes);
  tcase_add_test(tc, test_writer_rejects);
  tcase_add_test(tc, test_writer_failure_leaves_nothing);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run_suite(safetensors_suite(), CK_NORMAL); }
