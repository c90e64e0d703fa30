/*
 * check_badckpt.c: the bad-checkpoint catalogue, at model-load level.
 *
 * One small unquantized model is written here and quantized into every
 * scheme with qkeep_quantize, once, before the tests run. Each case copies
 * one of those good checkpoints, breaks exactly one thing (a safetensors
 * header, an index, a config file, a tensor's presence, dtype, shape or
 * values), and checks four things:
 *   (a) qkeep_model_load fails with the code the library documents;
 *   (b) qkeep_errmsg() names the file and, where there is one, the tensor;
 *   (c) the model holds no layer and no byte afterwards;
 *   (d) the same model object then loads a good checkpoint.
 * A control case loads every good checkpoint first, so that each failure is
 * the corruption's and nothing else's.
 */
#include <check.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "rewrite.h"
#include "checkutil.h"
#include "ckptutil.h"
#include "private.h"
#include "testutil.h"

/* The source model: sizes every scheme accepts (NVFP4 K % 16, MXFP4 K % 32, int4 N and K % 8). */
#define HIDDEN 64
#define INTER 128
#define KV 32
#define VOCAB 256
#define EXPERTS 4
#define INT4_GROUP 32
/* embedding, norm, lm_head; per decoder layer: kv scales, two norms, qkv, o, and gate_up + down
 * (layer 0) or an MoE block and its router (layer 1) */
#define LAYER_COUNT 17

#define L0 "model.layers.0."
#define L1 "model.layers.1."

/* ---- the good checkpoints (built once, before the tests) ------------------------------ */

enum variant {
  V_MODELOPT, /* modelopt-nvfp4 with kv-cache scales */
  V_SHARDED,  /* the same, in several shards with an index */
  V_CT_NVFP4,
  V_MXFP4,
  V_W8A8,      /* static symmetric input scales */
  V_W8A8_ASYM, /* static input scales with zero points */
  V_GPTQ,
  V_AWQ,
  V_COUNT
};

static const struct {
  const char *name;
  struct qkeep_quantize_options opts;
} variants[V_COUNT] = {
    [V_MODELOPT] = {"modelopt", {.scheme = "modelopt-nvfp4", .kv_cache_scales = true}},
    [V_SHARDED] = {"sharded",
                   {.scheme = "modelopt-nvfp4", .kv_cache_scales = true, .max_shard_bytes = 24000}},
    [V_CT_NVFP4] = {"ct-nvfp4", {.scheme = "ct-nvfp4"}},
    [V_MXFP4] = {"mxfp4", {.scheme = "mxfp4"}},
    [V_W8A8] = {"w8a8", {.scheme = "w8a8-int8", .static_input = true}},
    [V_W8A8_ASYM] = {"w8a8-asym", {.scheme = "w8a8-int8", .static_input = true, .asym_input = true}},
    [V_GPTQ] = {"gptq", {.scheme = "gptq-int4", .group_size = INT4_GROUP}},
    [V_AWQ] = {"awq", {.scheme = "awq-int4", .group_size = INT4_GROUP}},
};

static char *inputs; /* the directory holding all of them */
static char *source; /* the unquantized model, one .safetensors file */
static char *variant_dir[V_COUNT];
static char inputs_error[1024]; /* why building them failed; "" when they are ready */

/* Adds a bf16 tensor: uniform values in [-1/8, 1/8) for a matrix, ones for a vector (cols 0). */
static int add_source_tensor(struct st_writer *w, uint64_t *rng, const char *name, int64_t rows,
                             int64_t cols) {
  struct qkeep_spec spec = {.dtype = QKEEP_DTYPE_BF16, .ndim = cols ? 2 : 1, .shape = {rows, cols}};
  size_t n = (size_t)rows * (size_t)(cols ? cols : 1);
  uint16_t *values = malloc(n * sizeof *values);
  if (!values)
    return QKEEP_E_NOMEM;
  for (size_t i = 0; i < n; i++)
    values[i] = qk_f32_to_bf16(cols ? tu_randf(rng) * 0.125f : 1.0f);
  int rc = st_writer_add(w, name, &spec, values);
  free(values);
  return rc;
}

/* gate/up/down of layer l: the dense MLP (expert < 0) or one expert of its MoE block. */
static int add_mlp(struct st_writer *w, uint64_t *rng, int l, int expert) {
  static const struct {
    const char *name;
    int64_t rows, cols;
  } mlp[] = {{"gate_proj", INTER, HIDDEN}, {"up_proj", INTER, HIDDEN}, {"down_proj", HIDDEN, INTER}};
  char name[160];
  int rc = 0;
  for (size_t p = 0; p < 3 && !rc; p++) {
    if (expert < 0)
      snprintf(name, sizeof name, "model.layers.%d.mlp.%s.weight", l, mlp[p].name);
    else
      snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", l, expert, mlp[p].name);
    rc = add_source_tensor(w, rng, name, mlp[p].rows, mlp[p].cols);
  }
  return rc;
}

/* Two decoder layers: q/k/v/o and norms in both, a gate/up/down MLP in layer 0, an MoE block in layer 1. */
static int write_source(const char *path) {
  static const struct {
    const char *name;
    int64_t rows, cols;
  } attention[] = {{"self_attn.q_proj", HIDDEN, HIDDEN},
                   {"self_attn.k_proj", KV, HIDDEN},
                   {"self_attn.v_proj", KV, HIDDEN},
                   {"self_attn.o_proj", HIDDEN, HIDDEN}};
  uint64_t rng = 7;
  char name[160];
  struct st_writer *w;
  int rc = st_writer_new(&w);
  if (rc)
    return rc;
  rc = add_source_tensor(w, &rng, "model.embed_tokens.weight", VOCAB, HIDDEN);
  for (int l = 0; l < 2 && !rc; l++) {
    for (size_t i = 0; i < 4 && !rc; i++) {
      snprintf(name, sizeof name, "model.layers.%d.%s.weight", l, attention[i].name);
      rc = add_source_tensor(w, &rng, name, attention[i].rows, attention[i].cols);
    }
    if (l == 0 && !rc)
      rc = add_mlp(w, &rng, l, -1);
    for (int e = 0; l == 1 && e < EXPERTS && !rc; e++)
      rc = add_mlp(w, &rng, l, e);
    snprintf(name, sizeof name, "model.layers.%d.mlp.gate.weight", l); /* the MoE router */
    if (l == 1 && !rc)
      rc = add_source_tensor(w, &rng, name, EXPERTS, HIDDEN);
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
    if (!rc)
      rc = add_source_tensor(w, &rng, name, HIDDEN, 0);
    snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
    if (!rc)
      rc = add_source_tensor(w, &rng, name, HIDDEN, 0);
  }
  if (!rc)
    rc = add_source_tensor(w, &rng, "model.norm.weight", HIDDEN, 0);
  if (!rc)
    rc = add_source_tensor(w, &rng, "lm_head.weight", VOCAB, HIDDEN);
  if (!rc)
    rc = st_writer_write(w, path);
  st_writer_free(w);
  return rc;
}

/* Unchecked fixture (runs once, in the runner's process): no ck_assert here; a failure is recorded. */
static void build_inputs(void) {
  inputs_error[0] = '\0';
  inputs = tu_tmpdir("badckpt-inputs");
  source = inputs ? tu_path(inputs, "source.safetensors") : NULL;
  int rc = source ? write_source(source) : QKEEP_E_NOMEM;
  if (rc) {
    snprintf(inputs_error, sizeof inputs_error, "writing the source model: %s", qkeep_errmsg());
    return;
  }
  for (int v = 0; v < V_COUNT && !rc; v++) {
    variant_dir[v] = tu_path(inputs, variants[v].name);
    struct qkeep_quantize_options opts = variants[v].opts;
    opts.size = sizeof opts;
    if ((rc = qkeep_quantize(source, variant_dir[v], &opts)))
      snprintf(inputs_error, sizeof inputs_error, "quantizing into %s: %s", variants[v].opts.scheme,
               qkeep_errmsg());
  }
}

static void free_inputs(void) {
  if (inputs)
    tu_rmtree(inputs);
  for (int v = 0; v < V_COUNT; v++) {
    free(variant_dir[v]);
    variant_dir[v] = NULL;
  }
  free(source);
  free(inputs);
  source = inputs = NULL;
}

/* ---- the per-test fixture ------------------------------------------------------------------ */

static qkeep_plugin *plugin;
static char *dir; /* this test's scratch directory */

static void setup(void) {
  ck_assert_msg(inputs_error[0] == '\0' && inputs, "the good checkpoints could not be built: %s",
                inputs_error);
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &plugin) == 0, "%s", qkeep_errmsg());
  dir = tu_tmpdir("badckpt");
  ck_assert_ptr_nonnull(dir);
}

static void teardown(void) {
  qkeep_plugin_close(plugin);
  plugin = NULL;
  if (dir)
    tu_rmtree(dir);
  free(dir);
  dir = NULL;
}

/* ---- the four checks ------------------------------------------------------------------------- */

/*
 * Loads the bad checkpoint `path` into `model` (empty): the load must fail with `code`,
 * the message must contain `path` and every needle, and nothing may stay loaded. Then the
 * same model must load `good`.
 */
static void expect_bad_into(qkeep_model *model, const char *path, int code, const char *good,
                            va_list needles) {
  int rc = qkeep_model_load(model, path);
  char msg[2048];
  snprintf(msg, sizeof msg, "%s", qkeep_errmsg());
  ck_assert_msg(rc == code, "load of %s returned %d (%s), expected %d (%s); message: %s", path, rc,
                qkeep_strerror(rc), code, qkeep_strerror(code), msg);
  ck_assert_msg(strstr(msg, path) != NULL, "the message does not name the checkpoint '%s': %s", path, msg);
  for (const char *needle = va_arg(needles, const char *); needle; needle = va_arg(needles, const char *))
    ck_assert_msg(strstr(msg, needle) != NULL, "'%s' is not in the message: %s", needle, msg);

  ck_assert_uint_eq(qkeep_model_layer_count(model), 0);
  ck_assert_ptr_null(qkeep_model_layer(model, 0));
  struct qkeep_census census = {.size = sizeof census};
  ck_assert_int_eq(qkeep_census(model, &census), 0);
  ck_assert_int_eq(census.loader_params, 0);
  ck_assert_int_eq(census.total_bytes, 0);

  rc = qkeep_model_load(model, good);
  ck_assert_msg(rc == 0, "the good checkpoint %s did not load after the failure: %s", good, qkeep_errmsg());
  ck_assert_uint_eq(qkeep_model_layer_count(model), LAYER_COUNT);
}

/* The same with needles as arguments (NULL-terminated), for a model the caller set up. */
static void __attribute__((sentinel))
expect_bad_in(qkeep_model *model, const char *path, int code, const char *good, ...) {
  va_list needles;
  va_start(needles, good);
  expect_bad_into(model, path, code, good, needles);
  va_end(needles);
}

/* The same with a fresh model of the reference backend. */
static void __attribute__((sentinel)) expect_bad(const char *path, int code, const char *good, ...) {
  qkeep_model *model;
  ck_assert_int_eq(qkeep_model_new(plugin, &model), 0);
  va_list needles;
  va_start(needles, good);
  expect_bad_into(model, path, code, good, needles);
  va_end(needles);
  qkeep_model_free(model);
}

/* ---- files ------------------------------------------------------------------------------------ */

static char *in_dir(const char *file) {
  char *p = tu_path(dir, file);
  ck_assert_ptr_nonnull(p);
  return p;
}

static void put_file(const char *path, const void *data, size_t n) {
  ck_assert_msg(tu_write_file(path, data, n) == 0, "cannot write %s", path);
}

/* The checkpoint directory of a variant, copied to dir/<variant name>; returns its path (malloc'd). */
static char *copy_variant(enum variant v) {
  char *to = in_dir(variants[v].name);
  tu_copy_dir(variant_dir[v], to);
  return to;
}

static void remove_file(const char *ckpt, const char *file) {
  char *p = tu_path(ckpt, file);
  ck_assert_msg(unlink(p) == 0, "cannot remove %s", p);
  free(p);
}

/* JSON written with single quotes, which read better inside C strings: the text with ' as " (malloc'd). */
static char *dq(const char *single_quoted) {
  char *text = strdup(single_quoted);
  ck_assert_ptr_nonnull(text);
  for (char *c = text; *c; c++)
    if (*c == '\'')
      *c = '"';
  return text;
}

static void put_json(const char *ckpt, const char *file, const char *single_quoted) {
  char *text = dq(single_quoted), *p = tu_path(ckpt, file);
  put_file(p, text, strlen(text));
  free(text);
  free(p);
}

static json_t *load_json(const char *ckpt, const char *file) {
  char *p = tu_path(ckpt, file);
  json_error_t err;
  json_t *root = json_load_file(p, 0, &err);
  ck_assert_msg(root != NULL, "%s: %s", p, err.text);
  free(p);
  return root;
}

/* Writes root to ckpt/file and drops the reference. */
static void store_json(const char *ckpt, const char *file, json_t *root) {
  char *p = tu_path(ckpt, file);
  ck_assert_int_eq(json_dump_file(root, p, JSON_INDENT(2)), 0);
  json_decref(root);
  free(p);
}

/* Sets config.json's quantization_config.<key> (value stolen). */
static void set_quant_key(const char *ckpt, const char *key, json_t *value) {
  json_t *cfg = load_json(ckpt, "config.json");
  json_t *qc = json_object_get(cfg, "quantization_config");
  ck_assert_ptr_nonnull(qc);
  ck_assert_int_eq(json_object_set_new(qc, key, value), 0);
  store_json(ckpt, "config.json", cfg);
}

/* Replaces config.json's whole quantization_config with the (single-quoted) JSON text. */
static void set_quant_config(const char *ckpt, const char *single_quoted) {
  char *text = dq(single_quoted);
  json_error_t err;
  json_t *qc = json_loads(text, 0, &err);
  ck_assert_msg(qc != NULL, "%s: %s", text, err.text);
  free(text);
  json_t *cfg = load_json(ckpt, "config.json");
  ck_assert_int_eq(json_object_set_new(cfg, "quantization_config", qc), 0);
  store_json(ckpt, "config.json", cfg);
}

/* ---- tensors: read every tensor of a file, change some, write the file again ------------------- */

/* The tensors of ckpt/model.safetensors. */
static struct tu_tensors weights_of(const char *ckpt) {
  char *p = tu_path(ckpt, "model.safetensors");
  struct tu_tensors ts = tu_read_tensors(p);
  free(p);
  return ts;
}

static void save_weights(struct tu_tensors *ts, const char *ckpt) {
  char *p = tu_path(ckpt, "model.safetensors");
  tu_write_tensors(ts, p);
  free(p);
}

static struct tu_tensor *get(struct tu_tensors *ts, const char *name) {
  struct tu_tensor *it = tu_find_tensor(ts, name);
  ck_assert_msg(it != NULL, "the good checkpoint has no tensor '%s'", name);
  return it;
}

/* Removes the tensor `name`, or with `prefix` every tensor starting with it; at least one must go. */
static void drop_matching(struct tu_tensors *ts, const char *name, bool prefix) {
  size_t kept = 0, before = ts->n;
  for (size_t i = 0; i < ts->n; i++) {
    const char *t = ts->items[i].name;
    if (prefix ? strncmp(t, name, strlen(name)) == 0 : strcmp(t, name) == 0) {
      free(ts->items[i].name);
      free(ts->items[i].data);
    } else {
      ts->items[kept++] = ts->items[i];
    }
  }
  ts->n = kept;
  ck_assert_msg(kept < before, "the good checkpoint has no tensor '%s%s'", name, prefix ? "*" : "");
}

static void drop(struct tu_tensors *ts, const char *name) { drop_matching(ts, name, false); }

/* Drops a whole module: every tensor named "<module>.*". */
static void drop_module(struct tu_tensors *ts, const char *module) {
  char prefix[256];
  snprintf(prefix, sizeof prefix, "%s.", module);
  drop_matching(ts, prefix, true);
}

/* Renames every tensor whose name starts with `from` to start with `to` instead. */
static void rename_prefix(struct tu_tensors *ts, const char *from, const char *to) {
  int renamed = 0;
  for (size_t i = 0; i < ts->n; i++) {
    char *name = ts->items[i].name;
    if (strncmp(name, from, strlen(from)) != 0)
      continue;
    size_t n = strlen(to) + strlen(name) - strlen(from) + 1;
    char *renamed_name = malloc(n);
    ck_assert_ptr_nonnull(renamed_name);
    snprintf(renamed_name, n, "%s%s", to, name + strlen(from));
    free(name);
    ts->items[i].name = renamed_name;
    renamed++;
  }
  ck_assert_int_gt(renamed, 0);
}

/* Sets (adds or replaces) a tensor of that spec, every byte `fill`. */
static void put(struct tu_tensors *ts, const char *name, struct qkeep_spec spec, unsigned char fill) {
  struct tu_tensor *it = tu_find_tensor(ts, name);
  if (!it) {
    struct tu_tensor *grown = realloc(ts->items, (ts->n + 1) * sizeof *ts->items);
    ck_assert_ptr_nonnull(grown);
    ts->items = grown;
    it = &ts->items[ts->n++];
    *it = (struct tu_tensor){.name = strdup(name)};
  } else {
    free(it->data);
  }
  it->spec = spec;
  it->nbytes = qkeep_spec_bytes(&spec);
  it->data = malloc(it->nbytes ? it->nbytes : 1);
  ck_assert(it->name && it->data);
  memset(it->data, fill, it->nbytes);
}

static struct qkeep_spec spec2(enum qkeep_dtype dtype, int64_t d0, int64_t d1) {
  return (struct qkeep_spec){.dtype = dtype, .ndim = 2, .shape = {d0, d1}};
}

static void set_f32(struct tu_tensors *ts, const char *name, size_t index, float value) {
  struct tu_tensor *it = get(ts, name);
  ck_assert_int_eq(it->spec.dtype, QKEEP_DTYPE_F32);
  ck_assert_uint_lt(index * 4, it->nbytes);
  memcpy(it->data + index * 4, &value, 4);
}

static void set_u16(struct tu_tensors *ts, const char *name, size_t index, uint16_t value) {
  struct tu_tensor *it = get(ts, name);
  ck_assert_uint_eq(qkeep_dtype_size(it->spec.dtype), 2);
  ck_assert_uint_lt(index * 2, it->nbytes);
  memcpy(it->data + index * 2, &value, 2);
}

static void set_byte(struct tu_tensors *ts, const char *name, size_t index, unsigned char value) {
  struct tu_tensor *it = get(ts, name);
  ck_assert_uint_eq(qkeep_dtype_size(it->spec.dtype), 1);
  ck_assert_uint_lt(index, it->nbytes);
  it->data[index] = value;
}

/* ---- raw safetensors bytes ------------------------------------------------------------------------ */

static uint64_t get_le64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--)
    v = (v << 8) | p[i];
  return v;
}

static void put_le64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (unsigned char)(v >> (8 * i));
}

/*
 * Writes dir/bad.safetensors: an 8-byte length field, the header (single-quoted JSON, see dq), then
 * data_bytes bytes of 0x3c.
 */
static char *raw_file_len(uint64_t length_field, const char *single_quoted, size_t data_bytes) {
  char *header = dq(single_quoted);
  size_t hn = strlen(header), n = 8 + hn + data_bytes;
  unsigned char *buf = malloc(n);
  ck_assert_ptr_nonnull(buf);
  put_le64(buf, length_field);
  memcpy(buf + 8, header, hn);
  memset(buf + 8 + hn, 0x3c, data_bytes);
  char *path = in_dir("bad.safetensors");
  put_file(path, buf, n);
  free(buf);
  free(header);
  return path;
}

static char *raw_file(const char *header, size_t data_bytes) {
  return raw_file_len(strlen(header), header, data_bytes);
}

/* The source model's bytes (malloc'd), for cases that change a few of them. */
static unsigned char *source_bytes(size_t *n) {
  unsigned char *b = tu_read_file(source, n);
  ck_assert_ptr_nonnull(b);
  return b;
}

/* ---- safetensors structure ------------------------------------------------------------------------- */

START_TEST(st_file_too_short) {
  char *p = in_dir("bad.safetensors");
  put_file(p, "{}\0\0", 4);
  expect_bad(p, QKEEP_E_FORMAT, source, "too short", NULL);
  free(p);
}
END_TEST

START_TEST(st_header_length_past_end) {
  size_t n;
  unsigned char *b = source_bytes(&n);
  put_le64(b, n); /* header bytes past the end of the file */
  char *p = in_dir("bad.safetensors");
  put_file(p, b, n);
  expect_bad(p, QKEEP_E_FORMAT, source, "runs past the end of the file", NULL);
  free(b);
  free(p);
}
END_TEST

START_TEST(st_header_length_cuts_json) {
  size_t n;
  unsigned char *b = source_bytes(&n);
  put_le64(b, get_le64(b) - 8); /* padding is under 8 spaces: the closing brace is cut */
  char *p = in_dir("bad.safetensors");
  put_file(p, b, n);
  expect_bad(p, QKEEP_E_FORMAT, source, "not valid JSON", NULL);
  free(b);
  free(p);
}
END_TEST

START_TEST(st_header_over_limit) {
  char *p = raw_file_len(100000001, "{}", 16);
  expect_bad(p, QKEEP_E_FORMAT, source, "exceeds the limit", NULL);
  free(p);
}
END_TEST

START_TEST(st_header_empty) {
  char *p = raw_file_len(0, "", 8);
  expect_bad(p, QKEEP_E_FORMAT, source, "header is empty", NULL);
  free(p);
}
END_TEST

/* A header the format forbids (single quotes for double) over `bytes` of data: what the message says. */
static const struct {
  const char *header;
  size_t bytes;
  const char *needles[3]; /* the unused ones NULL */
} bad_headers[] = {
    /* header not object */
    {"[1, 2]  ", 0, {"does not begin with '{'"}},
    /* header invalid json */
    {"{'model.norm.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]", 8, {"not valid JSON"}},
    /* name not utf8 */
    {"{'model.norm.w\xff': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]}}",
     8,
     {"not valid UTF-8", "0xff"}},
    /* duplicate names */
    {"{'model.norm.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]},"
     " 'model.norm.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [8, 16]}}",
     16,
     {"duplicate"}},
    /* unknown dtype */
    {"{'model.norm.weight': {'dtype': 'F7', 'shape': [2], 'data_offsets': [0, 8]}}",
     8,
     {"'model.norm.weight'", "unknown dtype 'F7'"}},
    /* shape times dtype is not bytes */
    {"{'model.norm.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 12]}}",
     12,
     {"'model.norm.weight'", "hold 12 bytes", "needs 8"}},
    /* offsets overlap */
    {"{'model.a.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]},"
     " 'model.b.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [4, 12]}}",
     12,
     {"'model.b.weight'", "an overlap"}},
    /* offsets gap */
    {"{'model.a.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]},"
     " 'model.b.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [12, 20]}}",
     20,
     {"'model.b.weight'", "a gap"}},
    /* offsets not from zero */
    {"{'model.a.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [4, 12]}}",
     12,
     {"'model.a.weight'", "must start at 0"}},
    /* offsets out of bounds */
    {"{'model.a.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]},"
     " 'model.b.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [8, 16]}}",
     12,
     {"'model.b.weight'", "run past the end of the file"}},
    /* offsets reversed */
    {"{'model.a.weight': {'dtype': 'F32', 'shape': [0], 'data_offsets': [8, 0]}}",
     8,
     {"'model.a.weight'", "end before they begin"}},
    /* negative dimension */
    {"{'model.norm.weight': {'dtype': 'F32', 'shape': [-2], 'data_offsets': [0, 8]}}",
     8,
     {"'model.norm.weight'", "is -2"}},
    /* unknown entry key */
    {"{'model.norm.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8],"
     " 'offsets': [0, 8]}}",
     8,
     {"'model.norm.weight'", "unknown key 'offsets'"}},
    /* metadata not string */
    {"{'__metadata__': {'format': 1},"
     " 'model.norm.weight': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]}}",
     8,
     {"__metadata__ value of 'format'"}},
};

/* _i: the row of bad_headers. */
START_TEST(st_bad_header_is_refused) {
  char *p = raw_file(bad_headers[_i].header, bad_headers[_i].bytes);
  const char *const *needles = bad_headers[_i].needles;
  expect_bad(p, QKEEP_E_FORMAT, source, needles[0], needles[1], needles[2], NULL);
  free(p);
}
END_TEST

START_TEST(st_trailing_bytes) {
  size_t n;
  unsigned char *b = source_bytes(&n), *longer = calloc(n + 3, 1);
  ck_assert_ptr_nonnull(longer);
  memcpy(longer, b, n);
  char *p = in_dir("bad.safetensors");
  put_file(p, longer, n + 3);
  expect_bad(p, QKEEP_E_FORMAT, source, "3 trailing bytes", NULL);
  free(longer);
  free(b);
  free(p);
}
END_TEST

START_TEST(st_truncated) {
  size_t n;
  unsigned char *b = source_bytes(&n);
  char *p = in_dir("bad.safetensors");
  put_file(p, b, n - 100);
  expect_bad(p, QKEEP_E_FORMAT, source, "tensor '", "run past the end of the file", NULL);
  free(b);
  free(p);
}
END_TEST

/* ---- checkpoint files and directories -------------------------------------------------------------- */

START_TEST(ckpt_path_missing) {
  char *p = in_dir("absent");
  expect_bad(p, QKEEP_E_NOTFOUND, variant_dir[V_MODELOPT], "no such file", NULL);
  free(p);
}
END_TEST

START_TEST(ckpt_dir_without_weights) {
  char *ck = copy_variant(V_GPTQ);
  remove_file(ck, "model.safetensors");
  expect_bad(ck, QKEEP_E_NOTFOUND, variant_dir[V_GPTQ], "model.safetensors.index.json", NULL);
  free(ck);
}
END_TEST

START_TEST(ckpt_path_is_a_fifo) {
  char *p = in_dir("fifo");
  ck_assert_int_eq(mkfifo(p, 0600), 0);
  expect_bad(p, QKEEP_E_IO, variant_dir[V_MODELOPT], "neither a regular file nor a directory", NULL);
  free(p);
}
END_TEST

/* Variant v's checkpoint with `file` replaced by a directory of that name: refused, naming the file. */
static void expect_file_made_a_directory_refused(enum variant v, const char *file) {
  char *ck = copy_variant(v), *path = tu_path(ck, file);
  remove_file(ck, file);
  ck_assert_int_eq(mkdir(path, 0755), 0);
  expect_bad(ck, QKEEP_E_IO, variant_dir[v], file, "not a regular file", NULL);
  free(path);
  free(ck);
}

START_TEST(ckpt_weights_not_a_regular_file) {
  expect_file_made_a_directory_refused(V_MXFP4, "model.safetensors");
}
END_TEST

START_TEST(ckpt_config_not_a_regular_file) { expect_file_made_a_directory_refused(V_AWQ, "config.json"); }
END_TEST

/* The checkpoint shrinks after the first layer has loaded: the next read fails, nothing stays. */
struct shrink {
  char *path;
  bool armed;
};

static void shrink_after_first_layer(void *user, size_t done, size_t total, const char *layer) {
  struct shrink *s = user;
  (void)total;
  (void)layer;
  if (s->armed && done == 1) {
    s->armed = false;
    ck_assert_int_eq(truncate(s->path, 4096), 0);
  }
}

START_TEST(ckpt_file_shrinks_during_load) {
  char *ck = copy_variant(V_MODELOPT);
  struct shrink s = {tu_path(ck, "model.safetensors"), true};
  qkeep_model *model;
  ck_assert_int_eq(qkeep_model_new(plugin, &model), 0);
  qkeep_model_set_progress(model, shrink_after_first_layer, &s);
  expect_bad_in(model, ck, QKEEP_E_IO, variant_dir[V_MODELOPT], "model.safetensors", "tensor '",
                "changed size", NULL);
  qkeep_model_free(model);
  free(s.path);
  free(ck);
}
END_TEST

/* W0's weight file written in place (same size) while the cold start reads it: the load would hold a
 * mix of old and new bytes that no file holds (and a later rollback would re-read the new ones as
 * "unchanged"). The file's identity is taken at the open and checked after the reads: refused,
 * naming the file. */
START_TEST(ckpt_file_rewritten_in_place_during_load) {
  char *ck = copy_variant(V_MODELOPT), *file = tu_path(ck, "model.safetensors");
  struct rewrite r = rewrite_of(file, "model.norm.weight");
  qkeep_model *model;
  ck_assert_int_eq(qkeep_model_new(plugin, &model), 0);
  qkeep_model_set_progress(model, rewrite_after_first_layer, &r);
  expect_bad_in(model, ck, QKEEP_E_IO, variant_dir[V_MODELOPT], file, "changed", "the load read a mix", NULL);
  ck_assert(!r.armed); /* the rewrite happened during the load */
  qkeep_model_free(model);
  free(r.path);
  free(file);
  free(ck);
}
END_TEST

/* ---- shards and the index ------------------------------------------------------------------------- */

/* The shard the index names for a tensor (malloc'd). */
static char *shard_of(const char *ck, const char *tensor) {
  json_t *index = load_json(ck, "model.safetensors.index.json");
  const char *shard = json_string_value(json_object_get(json_object_get(index, "weight_map"), tensor));
  ck_assert_msg(shard != NULL, "the index has no '%s'", tensor);
  char *copy = strdup(shard);
  json_decref(index);
  return copy;
}

/* A shard other than `other`, from the index (malloc'd). */
static char *another_shard(const char *ck, const char *other) {
  json_t *index = load_json(ck, "model.safetensors.index.json");
  const char *key, *found = NULL;
  json_t *value;
  json_object_foreach(json_object_get(index, "weight_map"), key, value) {
    if (strcmp(json_string_value(value), other) != 0)
      found = json_string_value(value);
  }
  ck_assert_msg(found != NULL, "the checkpoint has one shard only");
  char *copy = strdup(found);
  json_decref(index);
  return copy;
}

#define SHARDED_TENSOR L0 "mlp.down_proj.weight"

START_TEST(shard_file_missing) {
  char *ck = copy_variant(V_SHARDED), *shard = shard_of(ck, SHARDED_TENSOR);
  remove_file(ck, shard);
  expect_bad(ck, QKEEP_E_NOTFOUND, variant_dir[V_SHARDED], "model.safetensors.index.json", shard,
             "no such file", NULL);
  free(shard);
  free(ck);
}
END_TEST

START_TEST(shard_file_truncated) {
  char *ck = copy_variant(V_SHARDED), *shard = shard_of(ck, SHARDED_TENSOR), *p = tu_path(ck, shard);
  size_t n;
  unsigned char *b = tu_read_file(p, &n);
  ck_assert_ptr_nonnull(b);
  put_file(p, b, n - 10);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_SHARDED], "model.safetensors.index.json", shard,
             "run past the end of the file", NULL);
  free(b);
  free(p);
  free(shard);
  free(ck);
}
END_TEST

START_TEST(index_names_tensor_its_shard_lacks) {
  char *ck = copy_variant(V_SHARDED), *shard = shard_of(ck, SHARDED_TENSOR);
  json_t *index = load_json(ck, "model.safetensors.index.json");
  json_object_set_new(json_object_get(index, "weight_map"), L0 "mlp.down_proj.bias", json_string(shard));
  store_json(ck, "model.safetensors.index.json", index);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_SHARDED], "model.safetensors.index.json",
             "'" L0 "mlp.down_proj.bias'", "does not contain it", NULL);
  free(shard);
  free(ck);
}
END_TEST

START_TEST(shard_tensor_missing_from_index) {
  char *ck = copy_variant(V_SHARDED);
  json_t *index = load_json(ck, "model.safetensors.index.json");
  ck_assert_int_eq(json_object_del(json_object_get(index, "weight_map"), SHARDED_TENSOR), 0);
  store_json(ck, "model.safetensors.index.json", index);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_SHARDED], "model.safetensors.index.json",
             "'" SHARDED_TENSOR "'", "missing from the weight_map", NULL);
  free(ck);
}
END_TEST

START_TEST(tensor_in_two_shards) {
  char *ck = copy_variant(V_SHARDED), *home = shard_of(ck, SHARDED_TENSOR), *other = another_shard(ck, home);
  char *home_path = tu_path(ck, home), *other_path = tu_path(ck, other);
  struct tu_tensors from = tu_read_tensors(home_path), to = tu_read_tensors(other_path);
  struct tu_tensor *t = get(&from, SHARDED_TENSOR);
  put(&to, SHARDED_TENSOR, t->spec, 0);
  memcpy(get(&to, SHARDED_TENSOR)->data, t->data, t->nbytes);
  tu_write_tensors(&to, other_path);
  tu_write_tensors(&from, home_path);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_SHARDED], "model.safetensors.index.json",
             "'" SHARDED_TENSOR "'", "in two shards", NULL);
  free(home_path);
  free(other_path);
  free(home);
  free(other);
  free(ck);
}
END_TEST

START_TEST(index_shard_outside_directory) {
  char *ck = copy_variant(V_SHARDED);
  json_t *index = load_json(ck, "model.safetensors.index.json");
  json_object_set_new(json_object_get(index, "weight_map"), SHARDED_TENSOR,
                      json_string("../model.safetensors"));
  store_json(ck, "model.safetensors.index.json", index);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_SHARDED], "model.safetensors.index.json",
             "'" SHARDED_TENSOR "'", "'../model.safetensors'", NULL);
  free(ck);
}
END_TEST

START_TEST(index_invalid_json) {
  char *ck = copy_variant(V_SHARDED);
  put_json(ck, "model.safetensors.index.json",
           "{'weight_map': {'a.weight': 'model-00001-of-00002.safetensors'");
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_SHARDED], "model.safetensors.index.json", "invalid JSON",
             NULL);
  free(ck);
}
END_TEST

START_TEST(index_without_weight_map) {
  char *ck = copy_variant(V_SHARDED);
  put_json(ck, "model.safetensors.index.json", "{'metadata': {'format': 'pt'}}");
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_SHARDED], "model.safetensors.index.json", "no weight_map",
             NULL);
  free(ck);
}
END_TEST

/* ---- config.json and hf_quant_config.json ------------------------------------------------------- */

START_TEST(config_invalid_json) {
  char *ck = copy_variant(V_GPTQ);
  put_json(ck, "config.json", "{'quantization_config': {'quant_method': 'gptq',");
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_GPTQ], "config.json", "invalid JSON", NULL);
  free(ck);
}
END_TEST

START_TEST(config_gptq_contradicts_hf_quant_nvfp4) {
  char *ck = copy_variant(V_MODELOPT);
  set_quant_config(ck,
                   "{'quant_method': 'gptq', 'bits': 4, 'group_size': 32, 'sym': true, 'desc_act': false}");
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_MODELOPT], "hf_quant_config.json", "config.json", "'gptq'",
             "contradict", NULL);
  free(ck);
}
END_TEST

/* One key of config.json's quantization_config set to a value (JSON text) that contradicts the
 * tensors or hf_quant_config.json, or that qkeep does not run; the code and what the message says. */
static const struct {
  enum variant v;
  const char *key, *value;
  int code;
  const char *needles[4]; /* the unused ones NULL */
} bad_quant_keys[] = {
    /* config quant algo contradicts hf quant */
    {V_MODELOPT,
     "quant_algo",
     "\"FP8\"",
     QKEEP_E_FORMAT,
     {"hf_quant_config.json", "quant_algo 'FP8'", "contradict"}},
    /* config quant method unsupported */
    {V_GPTQ, "quant_method", "\"bitsandbytes\"", QKEEP_E_UNSUPPORTED, {"config.json", "'bitsandbytes'"}},
    /* config gptq bits 8 */
    {V_GPTQ, "bits", "8", QKEEP_E_UNSUPPORTED, {"config.json", "bits 8"}},
    /* config ct format unsupported */
    {V_CT_NVFP4, "format", "\"pack-quantized\"", QKEEP_E_UNSUPPORTED, {"config.json", "'pack-quantized'"}},
    /* gptq config group larger than scales */
    {V_GPTQ,
     "group_size",
     "64",
     QKEEP_E_FORMAT,
     {"model.safetensors", ".scales'", "group size 32", "the config says 64"}},
    /* gptq config group smaller than scales */
    {V_GPTQ,
     "group_size",
     "16",
     QKEEP_E_FORMAT,
     {"model.safetensors", ".scales'", "group size 32", "the config says 16"}},
    /* a value of the wrong JSON type, for each type a key takes */
    {V_GPTQ, "bits", "\"4\"", QKEEP_E_FORMAT, {"config.json", "bits is a string, expected an integer"}},
    {V_GPTQ, "sym", "1", QKEEP_E_FORMAT, {"config.json", "sym is an integer, expected true or false"}},
    {V_CT_NVFP4, "format", "4", QKEEP_E_FORMAT, {"config.json", "format is an integer, expected a string"}},
    {V_CT_NVFP4,
     "config_groups",
     "[]",
     QKEEP_E_FORMAT,
     {"config.json", "config_groups is an array, expected an object"}},
};

/* _i: the row of bad_quant_keys. */
START_TEST(bad_quantization_config_key_is_refused) {
  enum variant v = bad_quant_keys[_i].v;
  char *ck = copy_variant(v);
  json_error_t err;
  json_t *value = json_loads(bad_quant_keys[_i].value, JSON_DECODE_ANY, &err);
  ck_assert_msg(value != NULL, "%s: %s", bad_quant_keys[_i].value, err.text);
  set_quant_key(ck, bad_quant_keys[_i].key, value);
  const char *const *needles = bad_quant_keys[_i].needles;
  expect_bad(ck, bad_quant_keys[_i].code, variant_dir[v], needles[0], needles[1], needles[2], needles[3],
             NULL);
  free(ck);
}
END_TEST

START_TEST(hf_quant_algo_unsupported) {
  char *ck = copy_variant(V_MODELOPT);
  set_quant_key(ck, "quant_algo", json_string("W4A8_AWQ"));
  put_json(ck, "hf_quant_config.json", "{'quantization': {'quant_algo': 'W4A8_AWQ', 'group_size': 16}}");
  expect_bad(ck, QKEEP_E_UNSUPPORTED, variant_dir[V_MODELOPT], "hf_quant_config.json", "'W4A8_AWQ'", NULL);
  free(ck);
}
END_TEST

START_TEST(hf_quant_group_size_not_16) {
  char *ck = copy_variant(V_MODELOPT);
  json_t *hf = load_json(ck, "hf_quant_config.json");
  json_object_set_new(json_object_get(hf, "quantization"), "group_size", json_integer(32));
  store_json(ck, "hf_quant_config.json", hf);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_MODELOPT], "hf_quant_config.json", "group_size 32", NULL);
  free(ck);
}
END_TEST

START_TEST(config_tie_word_embeddings_not_boolean) {
  char *ck = copy_variant(V_AWQ);
  json_t *cfg = load_json(ck, "config.json");
  json_object_set_new(cfg, "tie_word_embeddings", json_string("yes"));
  store_json(ck, "config.json", cfg);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_AWQ], "config.json", "tie_word_embeddings is a string", NULL);
  free(ck);
}
END_TEST

/* tie_word_embeddings with a w8a8-quantized embedding and no lm_head: the tied lm_head would run the
 * embedding's int8 codes as an unquantized weight (all-zero logits on both sides of the forward check).
 * Refused, naming the embedding and its scheme. */
START_TEST(config_tie_word_embeddings_over_a_quantized_embedding) {
  char *ck = copy_variant(V_W8A8);
  struct tu_tensors ts = weights_of(ck);
  drop(&ts, "model.embed_tokens.weight");
  drop_module(&ts, "lm_head");
  rename_prefix(&ts, L0 "self_attn.o_proj.",
                "model.embed_tokens."); /* I8 weight, weight_scale, input_scale */
  save_weights(&ts, ck);
  json_t *cfg = load_json(ck, "config.json");
  json_object_set_new(cfg, "tie_word_embeddings", json_true());
  store_json(ck, "config.json", cfg);
  expect_bad(ck, QKEEP_E_UNSUPPORTED, variant_dir[V_W8A8], "tie_word_embeddings", "model.embed_tokens",
             "w8a8-int8", NULL);
  free(ck);
}
END_TEST

/* tie_word_embeddings with an lm_head of the checkpoint's own: transformers and vLLM ignore the tensor
 * and tie lm_head to the embedding, qkeep loaded it untied. The contradiction is refused, naming the
 * tensor; without the tensor the same checkpoint loads, tied. */
START_TEST(config_tie_word_embeddings_beside_an_lm_head) {
  char *ck = copy_variant(V_AWQ);
  json_t *cfg = load_json(ck, "config.json");
  json_object_set_new(cfg, "tie_word_embeddings", json_true());
  store_json(ck, "config.json", cfg);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_AWQ], "config.json", "tie_word_embeddings", "'lm_head.weight'",
             NULL);
  struct tu_tensors ts = weights_of(ck);
  drop_module(&ts, "lm_head");
  save_weights(&ts, ck);
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  ck_assert_msg(qkeep_model_load(m, ck) == 0, "%s", qkeep_errmsg());
  const qkeep_layer *lm_head = qkeep_model_find_layer(m, "lm_head");
  ck_assert_ptr_nonnull(lm_head);
  struct qkeep_layer_info info = {.size = sizeof info};
  ck_assert_int_eq(qkeep_layer_get_info(lm_head, &info), 0);
  ck_assert(info.flags & QKEEP_LAYER_F_TIED);
  qkeep_model_free(m);
  free(ck);
}
END_TEST

/* config.json says GPTQ, the tensors are ModelOpt NVFP4. */
START_TEST(config_gptq_tensors_nvfp4) {
  char *ck = copy_variant(V_MODELOPT);
  remove_file(ck, "hf_quant_config.json");
  set_quant_config(ck,
                   "{'quant_method': 'gptq', 'bits': 4, 'group_size': 32, 'sym': true, 'desc_act': false}");
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_MODELOPT], "model.safetensors", "has 'weight'",
             "scheme gptq-int4", NULL);
  free(ck);
}
END_TEST

/* config.json says ModelOpt, the tensors carry compressed-tensors names. */
START_TEST(config_modelopt_tensors_compressed_tensors) {
  char *ck = copy_variant(V_CT_NVFP4);
  set_quant_config(
      ck, "{'quant_method': 'modelopt', 'quant_algo': 'NVFP4', 'group_size': 16, 'ignore': ['lm_head']}");
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_CT_NVFP4], "model.safetensors", "has 'weight_scale'",
             "scheme modelopt-nvfp4", NULL);
  free(ck);
}
END_TEST

/* ---- a scheme's tensors: missing, extra, wrong dtype or shape ------------------------------------ */

/*
 * A scheme's tensor dropped, or put (added or replaced, every byte `fill`) with a spec the scheme
 * or the kv-cache scales do not take; what the message says. Each dtype of fused shards is one the
 * scheme accepts, but the shards must agree.
 */
static const struct {
  enum variant v;
  enum { DROP, PUT } edit;
  const char *tensor;
  struct qkeep_spec spec; /* PUT */
  unsigned char fill;     /* PUT */
  const char *needles[4]; /* the unused ones NULL */
} bad_tensors[] = {
    /* modelopt missing weight scale */
    {V_MODELOPT,
     DROP,
     L0 "mlp.down_proj.weight_scale",
     {0},
     0,
     {"model.safetensors", L0 "mlp.down_proj", "weight_scale", "scheme modelopt-nvfp4"}},
    /* gptq missing qzeros */
    {V_GPTQ, DROP, L0 "self_attn.q_proj.qzeros", {0}, 0, {"'" L0 "self_attn.q_proj.qzeros'", "gptq-int4"}},
    /* w8a8 missing weight scale */
    {V_W8A8,
     DROP,
     L0 "self_attn.o_proj.weight_scale",
     {0},
     0,
     {"model.safetensors", L0 "self_attn.o_proj", "weight_scale", "scheme w8a8-int8"}},
    /* w8a8 missing static input scale */
    {V_W8A8,
     DROP,
     L0 "self_attn.o_proj.input_scale",
     {0},
     0,
     {"model.safetensors", "'" L0 "self_attn.o_proj.input_scale'", "static activations"}},
    /* w8a8 extra tensor in module */
    {V_W8A8,
     PUT,
     L0 "self_attn.q_proj.weight_zero_point",
     {QKEEP_DTYPE_I8, 2, {HIDDEN, 1}},
     0,
     {"model.safetensors", "'" L0 "self_attn.q_proj.weight_zero_point'", "not part of scheme w8a8-int8"}},
    /* modelopt weight scale f32 */
    {V_MODELOPT,
     PUT,
     L0 "self_attn.o_proj.weight_scale",
     {QKEEP_DTYPE_F32, 2, {HIDDEN, HIDDEN / 16}},
     0,
     {"model.safetensors", "'" L0 "self_attn.o_proj.weight_scale'",
      "dtype F32 in checkpoint, expected F8_E4M3"}},
    /* gptq scales i32 */
    {V_GPTQ,
     PUT,
     L0 "self_attn.o_proj.scales",
     {QKEEP_DTYPE_I32, 2, {HIDDEN / INT4_GROUP, HIDDEN}},
     0,
     {"model.safetensors", "'" L0 "self_attn.o_proj.scales'", "dtype I32", "F16"}},
    /* mxfp4 weight scale i8 */
    {V_MXFP4,
     PUT,
     L0 "self_attn.o_proj.weight_scale",
     {QKEEP_DTYPE_I8, 2, {HIDDEN, HIDDEN / 32}},
     0,
     {"model.safetensors", "'" L0 "self_attn.o_proj.weight_scale'", "dtype I8"}},
    /* fused shards differ in dtype */
    {V_W8A8,
     PUT,
     L0 "self_attn.k_proj.weight_scale",
     {QKEEP_DTYPE_BF16, 2, {KV, 1}},
     0,
     {"'" L0 "self_attn.k_proj.weight_scale'", "BF16"}},
    /* modelopt weight scale wrong shape */
    {V_MODELOPT,
     PUT,
     L0 "self_attn.o_proj.weight_scale",
     {QKEEP_DTYPE_F8_E4M3, 2, {HIDDEN, HIDDEN / 8}},
     0x38,
     {"model.safetensors", "'" L0 "self_attn.o_proj.weight_scale'", "shape [64, 8], expected [64, 4]"}},
    /* modelopt input scale not scalar */
    {V_MODELOPT,
     PUT,
     L0 "self_attn.o_proj.input_scale",
     {QKEEP_DTYPE_F32, 1, {2}},
     0,
     {"model.safetensors", "'" L0 "self_attn.o_proj.input_scale'", "expected a scalar"}},
    /* awq qzeros wrong shape */
    {V_AWQ,
     PUT,
     L0 "self_attn.o_proj.qzeros",
     {QKEEP_DTYPE_I32, 2, {HIDDEN / INT4_GROUP, HIDDEN / 4}},
     0,
     {"model.safetensors", "'" L0 "self_attn.o_proj.qzeros'", "shape [2, 16], expected [2, 8]"}},
    /* gptq groups do not divide k */
    {V_GPTQ,
     PUT,
     L0 "self_attn.o_proj.scales",
     {QKEEP_DTYPE_F16, 2, {3, HIDDEN}},
     0,
     {"model.safetensors", "'" L0 "self_attn.o_proj.scales'", "3 groups do not divide K = 64"}},
    /* modelopt bias wrong shape */
    {V_MODELOPT,
     PUT,
     L0 "self_attn.o_proj.bias",
     {QKEEP_DTYPE_BF16, 1, {HIDDEN - 1}},
     0,
     {"model.safetensors", "'" L0 "self_attn.o_proj.bias'", "shape [63], expected [64]"}},
    /* a fused name that the checkpoint also carries as a module of its own */
    {V_MODELOPT,
     PUT,
     L0 "self_attn.qkv_proj.weight",
     {QKEEP_DTYPE_BF16, 2, {HIDDEN + 2 * KV, HIDDEN}},
     0,
     {"two layers would be named " L0 "self_attn.qkv_proj"}},
    /* kv scale not a scalar */
    {V_MODELOPT,
     PUT,
     L0 "self_attn.k_proj.k_scale",
     {QKEEP_DTYPE_F32, 1, {2}},
     0,
     {"model.safetensors", "'" L0 "self_attn.k_proj.k_scale'", "expected a scalar kv-cache scale"}},
    /* an integer kv scale (BF16 and F16 ones load: compressed-tensors writes the model's dtype) */
    {V_MODELOPT,
     PUT,
     L1 "self_attn.v_proj.v_scale",
     {.dtype = QKEEP_DTYPE_I32},
     0,
     {"model.safetensors", "'" L1 "self_attn.v_proj.v_scale'", "I32"}},
    /* two k scales for one block */
    {V_MODELOPT,
     PUT,
     L0 "self_attn.k_scale",
     {.dtype = QKEEP_DTYPE_F32},
     0,
     {"two k_scale tensors", "'" L0 "self_attn.k_scale'", "'" L0 "self_attn.k_proj.k_scale'"}},
};

/* _i: the row of bad_tensors. */
START_TEST(bad_tensor_is_refused_naming_it) {
  enum variant v = bad_tensors[_i].v;
  char *ck = copy_variant(v);
  struct tu_tensors ts = weights_of(ck);
  if (bad_tensors[_i].edit == DROP)
    drop(&ts, bad_tensors[_i].tensor);
  else
    put(&ts, bad_tensors[_i].tensor, bad_tensors[_i].spec, bad_tensors[_i].fill);
  save_weights(&ts, ck);
  const char *const *needles = bad_tensors[_i].needles;
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[v], needles[0], needles[1], needles[2], needles[3], NULL);
  free(ck);
}
END_TEST

START_TEST(moe_expert_missing_up_proj) {
  char *ck = copy_variant(V_MODELOPT);
  struct tu_tensors ts = weights_of(ck);
  drop_module(&ts, L1 "mlp.experts.2.up_proj");
  save_weights(&ts, ck);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_MODELOPT], L1 "mlp.experts", "expert 2 has no up_proj", NULL);
  free(ck);
}
END_TEST

START_TEST(moe_expert_index_too_large) {
  char *ck = copy_variant(V_MXFP4);
  struct tu_tensors ts = weights_of(ck);
  rename_prefix(&ts, L1 "mlp.experts.3.", L1 "mlp.experts.5000.");
  save_weights(&ts, ck);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_MXFP4], L1 "mlp.experts", "expert index 5000", NULL);
  free(ck);
}
END_TEST

/* k_proj quantized over K = 32 while q_proj and v_proj have K = 64: one fused layer cannot hold both. */
START_TEST(fused_qkv_shards_differ_in_k) {
  char *ck = copy_variant(V_MODELOPT);
  struct tu_tensors ts = weights_of(ck);
  put(&ts, L0 "self_attn.k_proj.weight", spec2(QKEEP_DTYPE_U8, KV, 32 / 2), 0);
  put(&ts, L0 "self_attn.k_proj.weight_scale", spec2(QKEEP_DTYPE_F8_E4M3, KV, 32 / 16), 0x38);
  save_weights(&ts, ck);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_MODELOPT], L0 "self_attn.k_proj", "K 32", NULL);
  free(ck);
}
END_TEST

/* Act order: every fused shard must carry the same permutation. */
START_TEST(gptq_act_order_g_idx_differs) {
  char *ck = copy_variant(V_GPTQ);
  set_quant_key(ck, "desc_act", json_true());
  struct tu_tensors ts = weights_of(ck);
  struct tu_tensor *g_idx = get(&ts, L0 "self_attn.k_proj.g_idx");
  int32_t first, last;
  memcpy(&first, g_idx->data, 4);
  memcpy(&last, g_idx->data + g_idx->nbytes - 4, 4);
  ck_assert_int_ne(first, last);
  memcpy(g_idx->data, &last, 4); /* rows 0 and K-1 swap groups */
  memcpy(g_idx->data + g_idx->nbytes - 4, &first, 4);
  save_weights(&ts, ck);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_GPTQ], "model.safetensors", "'" L0 "self_attn.k_proj.g_idx'",
             "differs from the fused shard", NULL);
  free(ck);
}
END_TEST

/* Act order: a group index outside the matrix's groups (10^8, or one past the last) would have
 * the kernels read scales out of bounds; the load refuses it, naming the tensor. */
START_TEST(gptq_act_order_g_idx_out_of_range) {
  static const int32_t bad[] = {100000000, -1, 0 /* set to the group count below */};
  for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
    char *ck = copy_variant(V_GPTQ);
    set_quant_key(ck, "desc_act", json_true());
    struct tu_tensors ts = weights_of(ck);
    const struct tu_tensor *scales = get(&ts, L0 "mlp.down_proj.scales");
    int32_t value = b == 2 ? (int32_t)scales->spec.shape[0] : bad[b]; /* one past the last group */
    struct tu_tensor *g_idx = get(&ts, L0 "mlp.down_proj.g_idx");
    memcpy(g_idx->data + 4, &value, 4);
    save_weights(&ts, ck);
    expect_bad(ck, QKEEP_E_FORMAT, variant_dir[V_GPTQ], "'" L0 "mlp.down_proj.g_idx'", "outside the", NULL);
    tu_rmtree(ck); /* the next value gets a fresh copy under the same name */
    free(ck);
  }
}
END_TEST

/* Static int8 activations with a zero point: fused shards must share it. */
START_TEST(w8a8_fused_zero_points_differ) {
  char *ck = copy_variant(V_W8A8_ASYM);
  struct tu_tensors ts = weights_of(ck);
  struct tu_tensor *zp = get(&ts, L0 "self_attn.k_proj.input_zero_point");
  ck_assert_int_eq(zp->spec.dtype, QKEEP_DTYPE_I32);
  int32_t three = 3;
  memcpy(zp->data, &three, 4);
  save_weights(&ts, ck);
  expect_bad(ck, QKEEP_E_UNSUPPORTED, variant_dir[V_W8A8_ASYM], L0 "self_attn.qkv_proj", "input_zero_point",
             "different values", NULL);
  free(ck);
}
END_TEST

/* ---- scale values: finite and non-negative, no NaN code ------------------------------------------- */

/*
 * One element of one scale tensor set to a value the format forbids; the load names the tensor,
 * the element and what is wrong with it. up_proj is the second shard of gate_up_proj (the message
 * names the shard's own tensor and element); v_proj's GPTQ scales sit in every row of the fused
 * [K/G, N] param, after q's and k's columns.
 */
enum scale_width { F32, U16, BYTE };

static const struct {
  enum variant v;
  const char *tensor;
  enum scale_width width;
  size_t index;
  float f32;      /* F32 */
  uint16_t value; /* U16, BYTE */
  const char *why;
} scale_cases[] = {
    {V_MODELOPT, L0 "self_attn.k_proj.weight_scale_2", F32, 0, NAN, 0, "element 0 is NaN"},
    {V_MODELOPT, L0 "self_attn.v_proj.input_scale", F32, 0, INFINITY, 0, "element 0 is infinite"},
    {V_MODELOPT, L1 "mlp.experts.2.down_proj.weight_scale_2", F32, 0, -INFINITY, 0, "element 0 is infinite"},
    {V_W8A8, L0 "self_attn.o_proj.weight_scale", F32, 5, -0.5f, 0, "element 5 is negative"},
    {V_MODELOPT, L0 "mlp.down_proj.weight_scale", BYTE, 7, 0, 0x7f, "element 7 is NaN"},
    {V_MODELOPT, L0 "mlp.up_proj.weight_scale", BYTE, 9, 0, 0xb8, "element 9 is negative"},
    {V_MXFP4, L0 "self_attn.o_proj.weight_scale", BYTE, 3, 0, 0xff, "element 3 is NaN (e8m0 0xff)"},
    {V_GPTQ, L0 "self_attn.v_proj.scales", U16, KV + 1, 0, 0x7e00, "element 33 is NaN"}, /* row 1, col 1 */
    {V_CT_NVFP4, L0 "self_attn.o_proj.weight_global_scale", F32, 0, -1.0f, 0, "element 0 is negative"},
    {V_MODELOPT, L1 "self_attn.k_proj.k_scale", F32, 0, NAN, 0, "element 0 is NaN"},
};

/* _i: the row of scale_cases. */
START_TEST(bad_scale_value_is_refused_naming_tensor_and_element) {
  enum variant v = scale_cases[_i].v;
  const char *tensor = scale_cases[_i].tensor;
  char *ck = copy_variant(v);
  struct tu_tensors ts = weights_of(ck);
  switch (scale_cases[_i].width) {
  case F32: set_f32(&ts, tensor, scale_cases[_i].index, scale_cases[_i].f32); break;
  case U16: set_u16(&ts, tensor, scale_cases[_i].index, scale_cases[_i].value); break;
  case BYTE: set_byte(&ts, tensor, scale_cases[_i].index, (unsigned char)scale_cases[_i].value); break;
  }
  save_weights(&ts, ck);
  char *quoted;
  ck_assert_int_ge(qk_asprintf(&quoted, "'%s'", tensor), 0);
  expect_bad(ck, QKEEP_E_FORMAT, variant_dir[v], quoted, scale_cases[_i].why, NULL);
  free(quoted);
  free(ck);
}
END_TEST

/* ---- the control: every good checkpoint loads ------------------------------------------------------ */

START_TEST(good_checkpoints_load) {
  for (int v = -1; v < V_COUNT; v++) {
    const char *path = v < 0 ? source : variant_dir[v];
    qkeep_model *model;
    ck_assert_int_eq(qkeep_model_new(plugin, &model), 0);
    ck_assert_msg(qkeep_model_load(model, path) == 0, "%s: %s", path, qkeep_errmsg());
    ck_assert_uint_eq(qkeep_model_layer_count(model), LAYER_COUNT);
    struct qkeep_census census = {.size = sizeof census};
    ck_assert_int_eq(qkeep_census(model, &census), 0);
    ck_assert_int_eq(census.missing, 0);
    ck_assert_int_eq(census.c1, 0);
    qkeep_model_free(model);
  }
  char *index = tu_path(variant_dir[V_SHARDED], "model.safetensors.index.json");
  ck_assert_msg(access(index, F_OK) == 0, "the sharded variant has no index");
  free(index);
}
END_TEST

static Suite *badckpt_suite(void) {
  Suite *s = suite_create("badckpt");
  TCase *tc = tcase_create("badckpt");
  tcase_add_unchecked_fixture(tc, build_inputs, free_inputs);
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, good_checkpoints_load);
  /* safetensors structure */
  tcase_add_test(tc, st_file_too_short);
  tcase_add_test(tc, st_header_length_past_end);
  tcase_add_test(tc, st_header_length_cuts_json);
  tcase_add_test(tc, st_header_over_limit);
  tcase_add_test(tc, st_header_empty);
  tcase_add_loop_test(tc, st_bad_header_is_refused, 0, sizeof bad_headers / sizeof bad_headers[0]);
  tcase_add_test(tc, st_trailing_bytes);
  tcase_add_test(tc, st_truncated);
  /* files and directories */
  tcase_add_test(tc, ckpt_path_missing);
  tcase_add_test(tc, ckpt_dir_without_weights);
  tcase_add_test(tc, ckpt_path_is_a_fifo);
  tcase_add_test(tc, ckpt_weights_not_a_regular_file);
  tcase_add_test(tc, ckpt_config_not_a_regular_file);
  tcase_add_test(tc, ckpt_file_shrinks_during_load);
  tcase_add_test(tc, ckpt_file_rewritten_in_place_during_load);
  /* shards and the index */
  tcase_add_test(tc, shard_file_missing);
  tcase_add_test(tc, shard_file_truncated);
  tcase_add_test(tc, index_names_tensor_its_shard_lacks);
  tcase_add_test(tc, shard_tensor_missing_from_index);
  tcase_add_test(tc, tensor_in_two_shards);
  tcase_add_test(tc, index_shard_outside_directory);
  tcase_add_test(tc, index_invalid_json);
  tcase_add_test(tc, index_without_weight_map);
  /* config files */
  tcase_add_test(tc, config_invalid_json);
  tcase_add_test(tc, config_gptq_contradicts_hf_quant_nvfp4);
  tcase_add_loop_test(tc, bad_quantization_config_key_is_refused, 0,
                      sizeof bad_quant_keys / sizeof bad_quant_keys[0]);
  tcase_add_test(tc, hf_quant_algo_unsupported);
  tcase_add_test(tc, hf_quant_group_size_not_16);
  tcase_add_test(tc, config_tie_word_embeddings_not_boolean);
  tcase_add_test(tc, config_tie_word_embeddings_over_a_quantized_embedding);
  tcase_add_test(tc, config_tie_word_embeddings_beside_an_lm_head);
  tcase_add_test(tc, config_gptq_tensors_nvfp4);
  tcase_add_test(tc, config_modelopt_tensors_compressed_tensors);
  /* a scheme's tensors */
  tcase_add_loop_test(tc, bad_tensor_is_refused_naming_it, 0, sizeof bad_tensors / sizeof bad_tensors[0]);
  tcase_add_test(tc, moe_expert_missing_up_proj);
  tcase_add_test(tc, moe_expert_index_too_large);
  tcase_add_test(tc, fused_qkv_shards_differ_in_k);
  tcase_add_test(tc, gptq_act_order_g_idx_differs);
  tcase_add_test(tc, gptq_act_order_g_idx_out_of_range);
  tcase_add_test(tc, w8a8_fused_zero_points_differ);
  /* scale values */
  tcase_add_loop_test(tc, bad_scale_value_is_refused_naming_tensor_and_element, 0,
                      sizeof scale_cases / sizeof scale_cases[0]);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run_suite(badckpt_suite(), CK_NORMAL); }
