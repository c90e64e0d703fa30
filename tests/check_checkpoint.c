/*
 * check_checkpoint.c: checkpoint sources (libqkeep/format/checkpoint.c) and the
 * quantization configs they declare (libqkeep/format/quant_config.c).
 *
 * Checkpoints are real directories: shards written with st_writer, index and
 * config files written as text. A tensor's spec and bytes follow from its
 * name, so every read can be checked without a table. Every rejection must
 * name the file and, where there is one, the tensor or key.
 */
#include <check.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkutil.h"
#include "private.h"
#include "testutil.h"

/* The current test's scratch directory (fixture). */
static char *dir;

static void setup(void) {
  dir = tu_tmpdir("checkpoint");
  ck_assert_ptr_nonnull(dir);
}

static void teardown(void) {
  tu_rmtree(dir);
  free(dir);
  dir = NULL;
}

/* ---- helpers ----------------------------------------------------------------------- */

/* JSON written with single quotes, which read better inside C strings; malloc'd. */
static char *jq(const char *s) {
  char *d = strdup(s);
  ck_assert_ptr_nonnull(d);
  for (char *p = d; *p; p++)
    if (*p == '\'')
      *p = '"';
  return d;
}

/* Writes dir/file with the text (single quotes turned into double quotes). */
static void put_json(const char *file, const char *text) {
  char *path = tu_path(dir, file), *json = jq(text);
  ck_assert_int_eq(tu_write_file(path, json, strlen(json)), 0);
  free(json);
  free(path);
}

static uint64_t name_hash(const char *s) {
  uint64_t h = 1469598103934665603ULL;
  for (; *s; s++)
    h = (h ^ (unsigned char)*s) * 1099511628211ULL;
  return h;
}

/* The spec a test tensor of this name has: one of several dtypes, rank 0 to 2. */
static struct qkeep_spec spec_for(const char *name) {
  static const enum qkeep_dtype dtypes[] = {QKEEP_DTYPE_F32, QKEEP_DTYPE_BF16,    QKEEP_DTYPE_U8,
                                            QKEEP_DTYPE_I8,  QKEEP_DTYPE_F8_E4M3, QKEEP_DTYPE_I32};
  uint64_t h = name_hash(name);
  struct qkeep_spec s = {.dtype = dtypes[h % 6], .ndim = (int)((h >> 8) % 3)};
  for (int i = 0; i < s.ndim; i++)
    s.shape[i] = 1 + (int64_t)((h >> (16 + 4 * i)) % 7);
  return s;
}

static void fill_for(const char *name, unsigned char *buf, size_t n) {
  uint64_t state = name_hash(name);
  for (size_t i = 0; i < n; i++)
    buf[i] = (unsigned char)tu_rand(&state);
}

/* Writes dir/file holding the named tensors (NULL-terminated list). */
static void put_shard(const char *file, const char *const *names) {
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  for (; *names; names++) {
    struct qkeep_spec spec = spec_for(*names);
    size_t n = qkeep_spec_bytes(&spec);
    unsigned char *data = malloc(n ? n : 1);
    ck_assert_ptr_nonnull(data);
    fill_for(*names, data, n);
    ck_assert_int_eq(st_writer_add(w, *names, &spec, data), 0);
    free(data);
  }
  char *path = tu_path(dir, file);
  ck_assert_msg(st_writer_write(w, path) == 0, "%s", qkeep_errmsg());
  free(path);
  st_writer_free(w);
}

/* Checks that a tensor of the checkpoint has the spec and bytes its name implies. */
static void check_tensor(const struct ckpt *c, const char *name, const char *shard) {
  const struct ckpt_tensor *t = ckpt_find(c, name);
  ck_assert_msg(t != NULL, "tensor %s not found", name);
  ck_assert_str_eq(t->t->name, name);
  struct qkeep_spec spec = spec_for(name);
  ck_assert_int_eq(t->t->dtype, (int)spec.dtype);
  ck_assert_int_eq(t->t->ndim, spec.ndim);
  for (int i = 0; i < spec.ndim; i++)
    ck_assert_int_eq(t->t->shape[i], spec.shape[i]);
  size_t n = qkeep_spec_bytes(&spec);
  ck_assert_uint_eq(t->t->nbytes, n);
  unsigned char *want = malloc(n + 1), *got = malloc(n + 1);
  ck_assert_ptr_nonnull(want);
  ck_assert_ptr_nonnull(got);
  fill_for(name, want, n);
  ck_assert_msg(ckpt_read(c, t, got) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(memcmp(want, got, n) == 0, "tensor %s: bytes differ", name);
  free(want);
  free(got);
  if (shard) {
    const char *base = strrchr(t->file->path, '/');
    ck_assert_str_eq(base ? base + 1 : t->file->path, shard);
  }
}

/* Asserts that the current error detail contains every string of the NULL-terminated list. */
static void expect_msg(const char *first, ...) {
  const char *msg = qkeep_errmsg();
  va_list ap;
  va_start(ap, first);
  for (const char *s = first; s; s = va_arg(ap, const char *))
    ck_assert_msg(strstr(msg, s) != NULL, "message \"%s\" lacks \"%s\"", msg, s);
  va_end(ap);
}

/* Opens dir (or dir/file) expecting failure with `code`. */
static void expect_open_fails(const char *file, int code) {
  char *path = file ? tu_path(dir, file) : strdup(dir);
  struct ckpt *c = (struct ckpt *)1;
  int rc = ckpt_open(path, &c);
  ck_assert_msg(rc == code, "ckpt_open: %d (%s), expected %d", rc, qkeep_errmsg(), code);
  ck_assert_ptr_null(c);
  free(path);
}

static struct ckpt *open_ok(const char *file) {
  char *path = file ? tu_path(dir, file) : strdup(dir);
  struct ckpt *c = NULL;
  ck_assert_msg(ckpt_open(path, &c) == 0, "ckpt_open %s: %s", path, qkeep_errmsg());
  ck_assert_ptr_nonnull(c);
  free(path);
  return c;
}

/* Parses config.json / hf_quant_config.json texts (single-quoted; NULL for absent) expecting failure. */
static void expect_parse_fails(const char *cfg, const char *hf, int code) {
  char *c = cfg ? jq(cfg) : NULL, *h = hf ? jq(hf) : NULL;
  struct quant_config qc;
  int rc = quant_config_parse(c, h, "ckdir", &qc);
  ck_assert_msg(rc == code, "quant_config_parse: %d (%s), expected %d", rc, qkeep_errmsg(), code);
  ck_assert_int_eq(qc.method, QM_NONE);
  ck_assert_uint_eq(qc.n_ignore, 0);
  quant_config_free(&qc);
  free(c);
  free(h);
}

static void parse_ok(const char *cfg, const char *hf, struct quant_config *qc) {
  char *c = cfg ? jq(cfg) : NULL, *h = hf ? jq(hf) : NULL;
  ck_assert_msg(quant_config_parse(c, h, "ckdir", qc) == 0, "%s", qkeep_errmsg());
  free(c);
  free(h);
}

static const char *const small_model[] = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                                          NULL};

/* A ModelOpt NVFP4 config.json quantization_config as convert_hf_config.py writes it. */
#define MODELOPT_CFG(algo, extra)                                                                            \
  "{'architectures': ['LlamaForCausalLM'], 'quantization_config': {'quant_method': 'modelopt', "             \
  "'quant_algo': '" algo "', 'config_groups': {'group_0': {'weights': {'dynamic': false, 'num_bits': 4, "    \
  "'type': 'float', 'group_size': "                                                                          \
  "16}, 'input_activations': {'dynamic': false, 'num_bits': 4, 'type': 'float', 'group_size': 16}, "         \
  "'targets': "                                                                                              \
  "['Linear']}}, 'ignore': ['lm_head', 'model.layers.0.mlp.gate']" extra "}}"
#define MODELOPT_HF(algo, kv, group)                                                                         \
  "{'producer': {'name': 'modelopt', 'version': '0.29.0'}, 'quantization': {'quant_algo': '" algo            \
  "', 'kv_cache_quant_algo': " kv ", 'group_size': " group                                                   \
  ", 'exclude_modules': ['lm_head', 're:.*self_attn.*']}}"

/* ---- opening checkpoints ---------------------------------------------------------------- */

START_TEST(test_sharded) {
  static const char *const shard1[] = {"model.layers.0.mlp.down_proj.weight",
                                       "model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight",
                                       NULL};
  static const char *const shard2[] = {"model.layers.1.mlp.down_proj.weight",
                                       "model.layers.0.self_attn.q_proj.weight",
                                       "model.layers.1.input_layernorm.weight", "model.norm.weight", NULL};
  static const char *const shard3[] = {"lm_head.weight", "model.layers.1.self_attn.k_scale", NULL};
  static const char *const *const shards[] = {shard1, shard2, shard3};
  static const char *const files[] = {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                      "model-00003-of-00003.safetensors"};
  for (int s = 0; s < 3; s++)
    put_shard(files[s], shards[s]);
  /* The weight_map in an order that is neither by name nor by shard. */
  put_json("model.safetensors.index.json",
           "{'metadata': {'total_size': 1234}, 'weight_map': {"
           "'model.norm.weight': 'model-00002-of-00003.safetensors', "
           "'lm_head.weight': 'model-00003-of-00003.safetensors', "
           "'model.layers.0.mlp.up_proj.weight': 'model-00001-of-00003.safetensors', "
           "'model.layers.1.self_attn.k_scale': 'model-00003-of-00003.safetensors', "
           "'model.layers.1.mlp.down_proj.weight': 'model-00002-of-00003.safetensors', "
           "'model.embed_tokens.weight': 'model-00001-of-00003.safetensors', "
           "'model.layers.0.self_attn.q_proj.weight': 'model-00002-of-00003.safetensors', "
           "'model.layers.0.mlp.down_proj.weight': 'model-00001-of-00003.safetensors', "
           "'model.layers.1.input_layernorm.weight': 'model-00002-of-00003.safetensors'}}");

  struct ckpt *c = open_ok(NULL);
  ck_assert_uint_eq(c->n_files, 3);
  ck_assert_uint_eq(c->n_tensors, 9);
  ck_assert_str_eq(c->dir, dir);
  ck_assert_int_eq(c->qc.method, QM_NONE);
  ck_assert_str_eq(c->qc.scheme, "unquantized");
  for (size_t i = 1; i < c->n_tensors; i++)
    ck_assert_int_lt(strcmp(c->tensors[i - 1].t->name, c->tensors[i].t->name), 0);
  for (int s = 0; s < 3; s++)
    for (const char *const *n = shards[s]; *n; n++)
      check_tensor(c, *n, files[s]);
  ck_assert_ptr_null(ckpt_find(c, "model.layers.2.mlp.down_proj.weight"));
  ck_assert_ptr_null(ckpt_find(c, ""));
  ckpt_close(c);
}
END_TEST

START_TEST(test_single_in_dir) {
  put_shard("model.safetensors", small_model);
  put_json("config.json", "{'model_type': 'llama', 'tie_word_embeddings': true}");
  char *with_slash = malloc(strlen(dir) + 3);
  ck_assert_ptr_nonnull(with_slash);
  sprintf(with_slash, "%s//", dir);
  struct ckpt *c = NULL;
  ck_assert_msg(ckpt_open(with_slash, &c) == 0, "%s", qkeep_errmsg());
  ck_assert_str_eq(c->path, with_slash);
  ck_assert_str_eq(c->dir, dir);
  ck_assert_uint_eq(c->n_files, 1);
  ck_assert_uint_eq(c->n_tensors, 3);
  ck_assert_int_eq(c->qc.method, QM_NONE);
  ck_assert(c->qc.tie_word_embeddings);
  for (const char *const *n = small_model; *n; n++)
    check_tensor(c, *n, "model.safetensors");
  ckpt_close(c);
  free(with_slash);
}
END_TEST

START_TEST(test_single_file) {
  put_shard("weights.safetensors", small_model);
  /* A config beside a single file is not the file's: a file has no config. */
  put_json("config.json", "{'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': 128}}");
  struct ckpt *c = open_ok("weights.safetensors");
  ck_assert_str_eq(c->dir, dir);
  ck_assert_uint_eq(c->n_files, 1);
  ck_assert_uint_eq(c->n_tensors, 3);
  ck_assert_int_eq(c->qc.method, QM_NONE);
  ck_assert_str_eq(c->qc.scheme, "unquantized");
  ck_assert(!c->qc.tie_word_embeddings);
  ck_assert_uint_eq(c->qc.n_ignore, 0);
  for (const char *const *n = small_model; *n; n++)
    check_tensor(c, *n, "weights.safetensors");
  ckpt_close(c);
}
END_TEST

/* With both present, the index decides which files are the checkpoint. */
START_TEST(test_index_preferred) {
  static const char *const other[] = {"stale.weight", NULL};
  put_shard("model.safetensors", other);
  put_shard("part.safetensors", small_model);
  put_json("model.safetensors.index.json",
           "{'weight_map': {'model.embed_tokens.weight': 'part.safetensors', 'model.norm.weight': "
           "'part.safetensors', 'lm_head.weight': 'part.safetensors'}}");
  struct ckpt *c = open_ok(NULL);
  ck_assert_uint_eq(c->n_tensors, 3);
  ck_assert_ptr_null(ckpt_find(c, "stale.weight"));
  check_tensor(c, "lm_head.weight", "part.safetensors");
  ckpt_close(c);
}
END_TEST

START_TEST(test_modelopt_dirs) {
  put_shard("model.safetensors", small_model);
  /* 0: hf_quant_config.json alone; 1: config.json alone; 2: both, agreeing. */
  if (_i != 1)
    put_json("hf_quant_config.json", MODELOPT_HF("NVFP4", "'FP8'", "16"));
  if (_i != 0)
    put_json("config.json", MODELOPT_CFG("NVFP4", ", 'kv_cache_scheme': null"));
  struct ckpt *c = open_ok(NULL);
  const struct quant_config *qc = &c->qc;
  ck_assert_int_eq(qc->method, QM_MODELOPT_NVFP4);
  ck_assert_str_eq(qc->scheme, "modelopt-nvfp4");
  ck_assert_int_eq(qc->group_size, 16);
  ck_assert_int_eq(qc->kv_cache_fp8, _i != 1);
  ck_assert(quant_config_ignores(qc, "lm_head"));
  ck_assert_int_eq(quant_config_ignores(qc, "model.layers.3.self_attn.q_proj"), _i != 1);
  ck_assert_int_eq(quant_config_ignores(qc, "model.layers.0.mlp.gate"), _i != 0);
  ck_assert(!quant_config_ignores(qc, "model.layers.0.mlp.down_proj"));
  ck_assert_uint_eq(qc->n_ignore, _i == 2 ? 3 : 2); /* lm_head once */
  check_tensor(c, "lm_head.weight", "model.safetensors");
  ckpt_close(c);
}
END_TEST

/* ---- configs ---------------------------------------------------------------------------------- */

struct config_case {
  const char *cfg, *hf;
  enum quant_method method;
  const char *scheme;
  int64_t group_size;
  bool weight_sym, desc_act, gptq_v2, weight_per_tensor, input_dynamic, input_sym, kv_cache_fp8, tie;
  size_t n_ignore;
  const char *ignore0;
};

#define CT_INT8(wstrategy, dynamic, istrategy, isym)                                                         \
  "{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'int-quantized', "               \
  "'quantization_status': 'compressed', 'global_compression_ratio': null, 'kv_cache_scheme': null, "         \
  "'ignore': ['lm_head'], 'config_groups': {'group_0': {'targets': ['Linear'], 'output_activations': null, " \
  "'weights': {'num_bits': 8, 'type': 'int', 'strategy': '" wstrategy                                        \
  "', 'symmetric': true, 'dynamic': false, "                                                                 \
  "'group_size': null, 'actorder': null, 'observer': 'minmax'}, 'input_activations': {'num_bits': 8, "       \
  "'type': "                                                                                                 \
  "'int', 'strategy': '" istrategy "', 'dynamic': " dynamic ", 'symmetric': " isym                           \
  ", 'group_size': null}}}}}"

static const struct config_case config_cases[] = {
    /* no quantization */
    {"{'model_type': 'llama'}", NULL, QM_NONE, "unquantized", 0, .n_ignore = 0},
    {NULL, NULL, QM_NONE, "unquantized", 0, .tie = false},
    {"{'quantization_config': null, 'tie_word_embeddings': true}", NULL, QM_NONE, "unquantized", 0,
     .tie = true},
    /* compressed-tensors NVFP4, as llm-compressor writes it */
    {"{'tie_word_embeddings': false, 'quantization_config': {'quant_method': 'compressed-tensors', 'format': "
     "'nvfp4-pack-quantized', 'config_groups': {'group_0': {'targets': ['Linear'], 'weights': {'num_bits': "
     "4, "
     "'type': 'float', 'strategy': 'tensor_group', 'group_size': 16, 'symmetric': true, 'dynamic': false}, "
     "'input_activations': {'num_bits': 4, 'type': 'float', 'strategy': 'tensor_group', 'group_size': 16, "
     "'dynamic': 'local'}}}, 'ignore': ['lm_head', 're:.*mlp.gate$'], 'kv_cache_scheme': {'num_bits': 8, "
     "'type': "
     "'float', 'strategy': 'tensor', 'dynamic': false, 'symmetric': true}}}",
     NULL, QM_CT_NVFP4, "ct-nvfp4", 16, .kv_cache_fp8 = true, .n_ignore = 2, .ignore0 = "lm_head"},
    /* compressed-tensors MXFP4, format named by the group under a mixed-precision top level */
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'mixed-precision', "
     "'config_groups': {'group_0': {'format': 'mxfp4-pack-quantized', 'weights': {'num_bits': 4, 'type': "
     "'float', 'group_size': 32}}}, 'ignore': ['lm_head']}}",
     NULL, QM_MXFP4, "mxfp4", 32, .n_ignore = 1, .ignore0 = "lm_head"},
    /* compressed-tensors W8A8 int8, the four activation schemes */
    {CT_INT8("channel", "false", "tensor", "true"), NULL, QM_W8A8_INT8, "w8a8-int8", 0, .weight_sym = true,
     .input_sym = true, .n_ignore = 1, .ignore0 = "lm_head"},
    {CT_INT8("tensor", "false", "tensor", "false"), NULL, QM_W8A8_INT8, "w8a8-int8", 0, .weight_sym = true,
     .weight_per_tensor = true, .n_ignore = 1, .ignore0 = "lm_head"},
    {CT_INT8("channel", "true", "token", "true"), NULL, QM_W8A8_INT8, "w8a8-int8", 0, .weight_sym = true,
     .input_dynamic = true, .input_sym = true, .n_ignore = 1, .ignore0 = "lm_head"},
    {CT_INT8("channel", "true", "token", "false"), NULL, QM_W8A8_INT8, "w8a8-int8", 0, .weight_sym = true,
     .input_dynamic = true, .n_ignore = 1, .ignore0 = "lm_head"},
    /* gpt-oss */
    {"{'tie_word_embeddings': false, 'quantization_config': {'quant_method': 'mxfp4', "
     "'modules_to_not_convert': "
     "['model.layers.*.self_attn', 'model.layers.*.mlp.router', 'model.embed_tokens', 'lm_head']}}",
     NULL, QM_MXFP4, "mxfp4", 32, .n_ignore = 4, .ignore0 = "model.layers.*.self_attn"},
    /* GPTQ: symmetric, asymmetric with act order, per channel, v2 */
    {"{'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': 128, 'desc_act': false, "
     "'sym': "
     "true, 'damp_percent': 0.01, 'true_sequential': true, 'static_groups': false}}",
     NULL, QM_GPTQ_INT4, "gptq-int4", 128, .weight_sym = true},
    {"{'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': 32, 'desc_act': true, 'sym': "
     "false, 'checkpoint_format': 'gptq'}}",
     NULL, QM_GPTQ_INT4, "gptq-int4", 32, .desc_act = true},
    {"{'quantization_config': {'quant_method': 'GPTQ', 'bits': 4, 'group_size': -1, 'desc_act': true, 'sym': "
     "true}}",
     NULL, QM_GPTQ_INT4, "gptq-int4", 0, .weight_sym = true, .desc_act = true},
    {"{'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': 128, 'desc_act': false, "
     "'sym': "
     "true, 'checkpoint_format': 'gptq_v2', 'dynamic': {}}}",
     NULL, QM_GPTQ_INT4, "gptq-int4", 128, .weight_sym = true, .gptq_v2 = true},
    /* AWQ as transformers writes it, then as AutoAWQ names the keys */
    {"{'quantization_config': {'quant_method': 'awq', 'bits': 4, 'group_size': 128, 'zero_point': true, "
     "'version': 'gemm', 'modules_to_not_convert': ['visual']}}",
     NULL, QM_AWQ_INT4, "awq-int4", 128, .weight_sym = false, .n_ignore = 1, .ignore0 = "visual"},
    {"{'quantization_config': {'quant_method': 'awq', 'w_bit': 4, 'q_group_size': 64, 'zero_point': false, "
     "'version': 'GEMM'}}",
     NULL, QM_AWQ_INT4, "awq-int4", 64, .weight_sym = true},
    /* ModelOpt through config.json, KV cache by kv_cache_quant_algo; older embedding of the hf object */
    {MODELOPT_CFG("NVFP4", ", 'kv_cache_quant_algo': 'FP8'"), NULL, QM_MODELOPT_NVFP4, "modelopt-nvfp4", 16,
     .kv_cache_fp8 = true, .n_ignore = 2, .ignore0 = "lm_head"},
    {"{'quantization_config': {'quant_method': 'modelopt', 'quantization': {'quant_algo': 'NVFP4', "
     "'kv_cache_quant_algo': null, 'exclude_modules': ['lm_head']}}}",
     NULL, QM_MODELOPT_NVFP4, "modelopt-nvfp4", 16, .n_ignore = 1, .ignore0 = "lm_head"},
    /* both files, agreeing; hf_quant_config with no group_size means 16 */
    {MODELOPT_CFG("NVFP4", ""), MODELOPT_HF("NVFP4", "null", "null"), QM_MODELOPT_NVFP4, "modelopt-nvfp4", 16,
     .n_ignore = 3, .ignore0 = "lm_head"},
};

START_TEST(test_config_forms) {
  const struct config_case *k = &config_cases[_i];
  struct quant_config qc;
  parse_ok(k->cfg, k->hf, &qc);
  ck_assert_int_eq(qc.method, k->method);
  ck_assert_str_eq(qc.scheme, k->scheme);
  ck_assert_int_eq(qc.group_size, k->group_size);
  ck_assert_int_eq(qc.weight_sym, k->weight_sym);
  ck_assert_int_eq(qc.desc_act, k->desc_act);
  ck_assert_int_eq(qc.gptq_v2, k->gptq_v2);
  ck_assert_int_eq(qc.weight_per_tensor, k->weight_per_tensor);
  ck_assert_int_eq(qc.input_dynamic, k->input_dynamic);
  ck_assert_int_eq(qc.input_sym, k->input_sym);
  ck_assert_int_eq(qc.kv_cache_fp8, k->kv_cache_fp8);
  ck_assert_int_eq(qc.tie_word_embeddings, k->tie);
  ck_assert_uint_eq(qc.n_ignore, k->n_ignore);
  if (k->ignore0)
    ck_assert_str_eq(qc.ignore[0], k->ignore0);
  quant_config_free(&qc);
  quant_config_free(&qc); /* twice is harmless */
  ck_assert_int_eq(qc.method, QM_NONE);
}
END_TEST

/* ---- the ignore list ------------------------------------------------------------------------ */

START_TEST(test_ignores) {
  struct quant_config qc;
  parse_ok("{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'nvfp4-pack-quantized', "
           "'ignore': ['lm_head', 'model.layers.0.mlp', 're:.*\\\\.mlp\\\\.gate$', 're:model[.]visual.*', "
           "'model.layers.*.self_attn', 'model.layers.1?.post_norm']}}",
           NULL, &qc);
  ck_assert_uint_eq(qc.n_ignore, 6);
  /* exact and dot-suffix */
  ck_assert(quant_config_ignores(&qc, "lm_head"));
  ck_assert(quant_config_ignores(&qc, "model.lm_head"));
  ck_assert(!quant_config_ignores(&qc, "model.lm_head_extra"));
  ck_assert(!quant_config_ignores(&qc, "xlm_head"));
  /* parent */
  ck_assert(quant_config_ignores(&qc, "model.layers.0.mlp"));
  ck_assert(quant_config_ignores(&qc, "model.layers.0.mlp.down_proj"));
  ck_assert(quant_config_ignores(&qc, "model.layers.0.mlp.experts.3.up_proj"));
  ck_assert(!quant_config_ignores(&qc, "model.layers.0.mlp_extra.down_proj"));
  ck_assert(!quant_config_ignores(&qc, "model.layers.10.mlp.down_proj"));
  ck_assert(!quant_config_ignores(&qc, "model.layers.1.mlp.down_proj"));
  /* regex, matched in full (or on a parent) */
  ck_assert(quant_config_ignores(&qc, "model.layers.5.mlp.gate"));
  ck_assert(!quant_config_ignores(&qc, "model.layers.5.mlp.gate_up_proj"));
  ck_assert(quant_config_ignores(&qc, "model.visual.blocks.0.attn.qkv"));
  ck_assert(!quant_config_ignores(&qc, "language.model.visual"));
  /* glob (gpt-oss modules_to_not_convert), a parent of the layer */
  ck_assert(quant_config_ignores(&qc, "model.layers.7.self_attn.q_proj"));
  ck_assert(quant_config_ignores(&qc, "model.layers.12.post_norm"));
  ck_assert(!quant_config_ignores(&qc, "model.layers.2.post_norm"));
  ck_assert(!quant_config_ignores(&qc, "model.layers.7.mlp.down_proj"));
  quant_config_free(&qc);

  struct quant_config none = {.method = QM_NONE, .scheme = "unquantized"};
  ck_assert(!quant_config_ignores(&none, "lm_head"));
}
END_TEST

/* "re:" entries match as compressed-tensors' Python re.match: anchored at the start of the module name,
 * free at its end, and on the module's own name (no parent rule, unlike plain entries and globs). */
START_TEST(test_ignore_regex_is_re_match) {
  struct quant_config qc;
  parse_ok("{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'nvfp4-pack-quantized', "
           "'ignore': ['re:model\\\\.layers\\\\.1\\\\.', 're:.*mlp$', 're:(?:vision|audio)_tower']}}",
           NULL, &qc);
  ck_assert_uint_eq(qc.n_ignore, 3);
  /* a prefix of the name is enough (POSIX ^(...)$ needed all of it) */
  ck_assert(quant_config_ignores(&qc, "model.layers.1.mlp.down_proj"));
  ck_assert(quant_config_ignores(&qc, "model.layers.1.self_attn.q_proj"));
  ck_assert(!quant_config_ignores(&qc, "model.layers.10.mlp.down_proj"));
  /* anchored at the start: a match further in does not count */
  ck_assert(!quant_config_ignores(&qc, "language_model.model.layers.1.mlp.down_proj"));
  ck_assert(!quant_config_ignores(&qc, "model.vision_tower.blocks.0"));
  ck_assert(quant_config_ignores(&qc, "audio_tower.blocks.0.attn"));
  /* $ is the end of the module's own name: its children are not ignored through it */
  ck_assert(quant_config_ignores(&qc, "model.layers.3.mlp"));
  ck_assert(!quant_config_ignores(&qc, "model.layers.3.mlp.down_proj"));
  quant_config_free(&qc);
}
END_TEST

/* A pattern that backtracks catastrophically stops at PCRE2's match limit with an error naming the file,
 * key, entry and module (milliseconds; a backtracking POSIX engine takes minutes on this). */
START_TEST(test_ignore_catastrophic_regex_fails_clearly) {
  struct quant_config qc;
  parse_ok("{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'nvfp4-pack-quantized', "
           "'ignore': ['lm_head', 're:(a|aa)+$', 're:(x+x+)+y']}}",
           NULL, &qc);
  bool ignored = true;
  ck_assert_int_eq(quant_config_match_ignore(&qc, "model.layers.0.mlp", &ignored), 0);
  ck_assert(!ignored);
  ck_assert_int_eq(quant_config_match_ignore(&qc, "aaaa", &ignored), 0);
  ck_assert(ignored);
  const char *bad = "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx.y_proj";
  ck_assert_int_eq(quant_config_match_ignore(&qc, bad, &ignored), QKEEP_E_FORMAT);
  ck_assert(!ignored);
  const char *msg = qkeep_errmsg();
  ck_assert_msg(strstr(msg, "ckdir/config.json") && strstr(msg, "quantization_config.ignore") &&
                    strstr(msg, "'re:(x+x+)+y'") && strstr(msg, bad) && strstr(msg, "backtrack"),
                "%s", msg);
  ck_assert(!quant_config_ignores(&qc, bad)); /* the boolean form counts an error as not ignored */
  quant_config_free(&qc);
}
END_TEST

/* A backstop, not a measure: from here on the test process may spend at most `seconds` more CPU time
 * (SIGXCPU ends it, and the test fails, where an unbounded match would run for minutes). Not under
 * valgrind, whose CPU time is many times a plain run's. Returns the previous limit, for cpu_unlimit. */
static struct rlimit cpu_limit(int seconds) {
  struct rlimit was;
  ck_assert_int_eq(getrlimit(RLIMIT_CPU, &was), 0);
  const char *preload = getenv("LD_PRELOAD");
  if (preload && strstr(preload, "vgpreload"))
    return was;
  struct rusage ru;
  ck_assert_int_eq(getrusage(RUSAGE_SELF, &ru), 0);
  rlim_t now = (rlim_t)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + 1;
  struct rlimit lim = {now + (rlim_t)seconds, was.rlim_max};
  if (was.rlim_max != RLIM_INFINITY && lim.rlim_cur > was.rlim_max)
    lim.rlim_cur = was.rlim_max;
  ck_assert_int_eq(setrlimit(RLIMIT_CPU, &lim), 0);
  return was;
}

static void cpu_unlimit(struct rlimit was) { ck_assert_int_eq(setrlimit(RLIMIT_CPU, &was), 0); }

/* A config text (double quotes) with `n` ignore entries or dynamic rules made by `entry(i)`; malloc'd. */
static char *config_with(const char *head, const char *tail, int n, const char *fmt, const char *value) {
  size_t cap = strlen(head) + strlen(tail) + (size_t)n * (strlen(fmt) + strlen(value) + 32) + 1;
  char *text = malloc(cap), *at = text;
  ck_assert_ptr_nonnull(text);
  at += sprintf(at, "%s", head);
  for (int i = 0; i < n; i++) {
    at += sprintf(at, i ? ", " : "");
    at += sprintf(at, fmt, i);
    at += sprintf(at, "%s", value);
  }
  sprintf(at, "%s", tail);
  return text;
}

/* 1,000 "re:" entries, each just under the per-match limit on this module (2^19 steps): each match was
 * limited, the load was not (over a minute per module). The load's budget stops it with an error that
 * names the entry, the module and the budget. The entries differ only by a comment, so none is merged. */
START_TEST(test_ignore_regexes_share_one_budget_per_load) {
  char *text = config_with("{\"quantization_config\": {\"quant_method\": \"compressed-tensors\", "
                           "\"format\": \"nvfp4-pack-quantized\", \"ignore\": [",
                           "]}}", 1000, "\"re:(?:x+x+)+y(?#%d)\"", "");
  struct quant_config qc;
  ck_assert_msg(quant_config_parse(text, NULL, "ckdir", &qc) == 0, "%s", qkeep_errmsg());
  ck_assert_uint_eq(qc.n_ignore, 1000);
  struct rlimit was = cpu_limit(5);
  bool ignored = true;
  const char *module = "xxxxxxxxxxxxxxxxxxx.y_proj"; /* 19 x: 524,288 steps per entry */
  ck_assert_int_eq(quant_config_match_ignore(&qc, module, &ignored), QKEEP_E_FORMAT);
  cpu_unlimit(was);
  ck_assert(!ignored);
  const char *msg = qkeep_errmsg();
  ck_assert_msg(strstr(msg, "ckdir/config.json") && strstr(msg, "quantization_config.ignore") &&
                    strstr(msg, "re:(?:x+x+)+y(?#") && strstr(msg, module) && strstr(msg, "budget"),
                "%s", msg);
  ck_assert_uint_le(quant_config_regex_steps(&qc), PATTERN_BUDGET_BASE);
  /* a few such entries stay within it, and match as before */
  quant_config_free(&qc);
  free(text);
  text = config_with("{\"quantization_config\": {\"quant_method\": \"compressed-tensors\", "
                     "\"format\": \"nvfp4-pack-quantized\", \"ignore\": [",
                     ", \"re:x+\\\\.y\"]}}", 3, "\"re:(?:x+x+)+y(?#%d)\"", "");
  ck_assert_msg(quant_config_parse(text, NULL, "ckdir", &qc) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(quant_config_match_ignore(&qc, module, &ignored), 0);
  ck_assert(ignored);
  quant_config_free(&qc);
  free(text);
}
END_TEST

/* GPTQModel `dynamic` rules were POSIX regexes without a limit, recompiled for every question: 30 rules
 * with back-references kept a census of the tiny example running past a minute. They are PCRE2 now,
 * compiled once, under the per-match limits and the load's budget: refused within the budget, naming a
 * rule and the module. */
START_TEST(test_dynamic_rules_with_back_references_are_bounded) {
  char *text =
      config_with("{\"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 4, "
                  "\"group_size\": 128, \"dynamic\": {",
                  "}}}", 30, "\"+:(.*)(.*)(.*)(.*)\\\\4\\\\3\\\\2\\\\1x(?#%d)\"", ": {\"group_size\": 32}");
  struct quant_config qc, mod;
  ck_assert_msg(quant_config_parse(text, NULL, "ckdir", &qc) == 0, "%s", qkeep_errmsg());
  ck_assert_uint_eq(qc.n_dynamic, 30);
  struct rlimit was = cpu_limit(5);
  int rc = 0;
  char name[96];
  for (int i = 0; i < 1000 && !rc; i++) {
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.down_proj", i / 8, i % 8);
    rc = quant_config_for_module(&qc, name, &mod);
  }
  cpu_unlimit(was);
  ck_assert_int_eq(rc, QKEEP_E_FORMAT);
  const char *msg = qkeep_errmsg();
  ck_assert_msg(strstr(msg, "ckdir/config.json") && strstr(msg, "quantization_config.dynamic") &&
                    strstr(msg, "rule '(.*)(.*)") && strstr(msg, name) && strstr(msg, "budget"),
                "%s", msg);
  quant_config_free(&qc);
  free(text);
}
END_TEST

/* 94 ordinary per-layer rules over 94 layers of 128 experts (36,096 modules), each module asked about
 * three times as assembly does: every rule compiled once, each module matched once (the later questions
 * are lookups: no step is charged for them), and each module gets its layer's rule. */
START_TEST(test_many_ordinary_dynamic_rules_match_each_module_once) {
  enum { LAYERS = 94 };
  /* Under a memory checker 8 experts a layer: the same 94 rules and the same lookups on a sixteenth of the
   * modules (plain make check asks about all 36,096). */
  const int experts = tu_under_memcheck() ? 8 : 128;
  char *text = config_with("{\"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 4, "
                           "\"group_size\": 128, \"dynamic\": {",
                           "}}}", LAYERS, "\"+:model\\\\.layers\\\\.%d\\\\..*\"", ": {\"group_size\": 32}");
  struct quant_config qc, mod;
  ck_assert_msg(quant_config_parse(text, NULL, "ckdir", &qc) == 0, "%s", qkeep_errmsg());
  quant_config_budget_for(&qc, (size_t)LAYERS * experts * 3 * 4);
  char name[96];
  uint64_t after_first = 0;
  for (int pass = 0; pass < 3; pass++) {
    for (int l = 0; l < LAYERS; l++)
      for (int e = 0; e < experts * 3; e++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s", l, e / 3,
                 (const char *[]){"gate_proj", "up_proj", "down_proj"}[e % 3]);
        ck_assert_msg(quant_config_for_module(&qc, name, &mod) == 0, "%s", qkeep_errmsg());
        ck_assert_int_eq(mod.group_size, 32);
      }
    if (pass == 0)
      after_first = quant_config_regex_steps(&qc);
  }
  ck_assert_uint_eq(quant_config_regex_steps(&qc), after_first);
  ck_assert(quant_config_for_module(&qc, "lm_head", &mod) == 0 && mod.group_size == 128);
  quant_config_free(&qc);
  free(text);
}
END_TEST

/* ModelOpt MIXED_PRECISION with 24,576 quantized_layers, listed in both files: the list was deduplicated
 * and scanned per module entry by entry (52 s against 1.1 s for the same modules as plain NVFP4). It is a
 * hash set now, matched at dot boundaries as before; the CPU backstop fails a quadratic regression. */
START_TEST(test_mixed_precision_long_quantized_layers) {
  /* Under a memory checker 1,536 layers (four of 384): the same hash set and lookups on a sixteenth of
   * the list (plain make check lists all 24,576, where the CPU backstop catches a quadratic match). */
  const int n_listed = tu_under_memcheck() ? 1536 : 24576;
  const char *value = ": {\"quant_algo\": \"NVFP4\", \"group_size\": 16}";
  char *list = malloc((size_t)n_listed * (64 + strlen(value))), *at = list;
  ck_assert_ptr_nonnull(list);
  for (int i = 0; i < n_listed; i++)
    at += sprintf(at, "%s\"model.layers.%d.mlp.experts.%d.%s\"%s", i ? ", " : "", i / 384, (i % 384) / 3,
                  (const char *[]){"gate_proj", "up_proj", "down_proj"}[i % 3], value);
  size_t n = strlen(list) + 512;
  char *cfg = malloc(n), *hf = malloc(n);
  ck_assert_ptr_nonnull(cfg);
  ck_assert_ptr_nonnull(hf);
  snprintf(cfg, n,
           "{\"quantization_config\": {\"quant_method\": \"modelopt\", \"quant_algo\": \"MIXED_PRECISION\", "
           "\"quantized_layers\": {%s}}}",
           list);
  snprintf(hf, n,
           "{\"producer\": {\"name\": \"modelopt\"}, \"quantization\": {\"quant_algo\": \"MIXED_PRECISION\", "
           "\"quantized_layers\": {%s}}}",
           list);
  struct rlimit was = cpu_limit(5);
  struct quant_config qc;
  ck_assert_msg(quant_config_parse(cfg, hf, "ckdir", &qc) == 0, "%s", qkeep_errmsg());
  ck_assert_uint_eq(qc.n_quantized, n_listed);
  char name[96];
  for (int i = 0; i < n_listed; i++) {
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s", i / 384, (i % 384) / 3,
             (const char *[]){"gate_proj", "up_proj", "down_proj"}[i % 3]);
    ck_assert_msg(!quant_config_ignores(&qc, name), "%s", name);
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.other_proj", i / 384, (i % 384) / 3);
    ck_assert_msg(quant_config_ignores(&qc, name), "%s", name);
  }
  cpu_unlimit(was);
  ck_assert(quant_config_ignores(&qc, "model.layers.64.mlp.experts.0.gate_proj")); /* past the list */
  ck_assert(quant_config_ignores(&qc, "lm_head"));
  quant_config_free(&qc);
  free(cfg), free(hf), free(list);
}
END_TEST

/* A long plain list (ModelOpt lists every excluded module) matches entry by entry, with repeats merged. */
START_TEST(test_ignore_long_plain_list) {
  enum { N = 20000 };
  size_t cap = 0;
  struct quant_config qc = {.method = QM_CT_NVFP4, .scheme = "ct-nvfp4"};
  char why[256], name[96];
  for (int round = 0; round < 2; round++) /* every entry twice: the second adds nothing */
    for (int i = 0; i < N; i++) {
      snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.down_proj", i / 128, i % 128);
      ck_assert_int_eq(ignore_add(&qc, &cap, name, "cfg: ignore", why, sizeof why), 0);
    }
  ck_assert_uint_eq(qc.n_ignore, N);
  ck_assert(quant_config_ignores(&qc, "model.layers.0.mlp.experts.0.down_proj"));
  ck_assert(quant_config_ignores(&qc, "model.layers.156.mlp.experts.31.down_proj"));
  ck_assert(!quant_config_ignores(&qc, "model.layers.156.mlp.experts.32.down_proj"));
  ck_assert(!quant_config_ignores(&qc, "model.layers.0.mlp.experts.0.up_proj"));
  ck_assert(!quant_config_ignores(&qc, "model.layers.0.mlp.experts.0.down"));
  /* a parent entry covers its children; a dot-suffix entry the modules it ends */
  ck_assert_int_eq(ignore_add(&qc, &cap, "model.layers.200.mlp", "cfg: ignore", why, sizeof why), 0);
  ck_assert_int_eq(ignore_add(&qc, &cap, "shared_expert", "cfg: ignore", why, sizeof why), 0);
  ck_assert(quant_config_ignores(&qc, "model.layers.200.mlp.experts.5.gate_proj"));
  ck_assert(quant_config_ignores(&qc, "model.layers.7.mlp.shared_expert"));
  ck_assert(quant_config_ignores(&qc, "model.layers.7.mlp.shared_expert.up_proj"));
  ck_assert(!quant_config_ignores(&qc, "model.layers.7.mlp.shared_expert_gate"));
  /* a regex that does not compile adds nothing and says why */
  ck_assert_int_eq(ignore_add(&qc, &cap, "re:(unclosed", "cfg: ignore", why, sizeof why), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(why, "offset"), "%s", why);
  ck_assert_uint_eq(qc.n_ignore, N + 2);
  quant_config_free(&qc);
}
END_TEST

/* ---- rejected checkpoints ------------------------------------------------------------------- */

/* Two shards, a and b, and an index text for them (single quotes). */
static void put_two_shards(const char *index) {
  static const char *const a[] = {"x.weight", "y.weight", NULL};
  static const char *const b[] = {"z.weight", NULL};
  put_shard("a.safetensors", a);
  put_shard("b.safetensors", b);
  put_json("model.safetensors.index.json", index);
}

START_TEST(test_missing_shard) {
  put_two_shards("{'weight_map': {'x.weight': 'a.safetensors', 'y.weight': 'a.safetensors', 'z.weight': "
                 "'b.safetensors', 'w.weight': 'gone.safetensors'}}");
  expect_open_fails(NULL, QKEEP_E_NOTFOUND);
  expect_msg("model.safetensors.index.json", "gone.safetensors", NULL);
}
END_TEST

START_TEST(test_tensor_absent_from_shard) {
  put_two_shards("{'weight_map': {'x.weight': 'a.safetensors', 'y.weight': 'b.safetensors', 'z.weight': "
                 "'b.safetensors'}}");
  expect_open_fails(NULL, QKEEP_E_FORMAT);
  expect_msg("model.safetensors.index.json", "'y.weight'", "'b.safetensors'", NULL);
}
END_TEST

/* c.safetensors holds y.weight as well as the shard the map names for it. */
START_TEST(test_tensor_in_two_shards) {
  static const char *const c[] = {"y.weight", "v.weight", NULL};
  put_shard("c.safetensors", c);
  put_two_shards("{'weight_map': {'x.weight': 'a.safetensors', 'y.weight': 'a.safetensors', 'z.weight': "
                 "'b.safetensors', 'v.weight': 'c.safetensors'}}");
  expect_open_fails(NULL, QKEEP_E_FORMAT);
  expect_msg("model.safetensors.index.json", "'y.weight'", "two shards", "'a.safetensors'", "'c.safetensors'",
             NULL);
}
END_TEST

START_TEST(test_shard_tensor_unmapped) {
  put_two_shards("{'weight_map': {'x.weight': 'a.safetensors', 'z.weight': 'b.safetensors'}}");
  expect_open_fails(NULL, QKEEP_E_FORMAT);
  expect_msg("model.safetensors.index.json", "'y.weight'", "'a.safetensors'", "weight_map", NULL);
}
END_TEST

START_TEST(test_bad_shard_names) {
  static const char *const names[] = {"../a.safetensors", "sub/a.safetensors", "a..safetensors", ""};
  char index[256];
  snprintf(index, sizeof index, "{'weight_map': {'x.weight': 'a.safetensors', 'y.weight': '%s'}}", names[_i]);
  put_two_shards(index);
  expect_open_fails(NULL, QKEEP_E_FORMAT);
  expect_msg("model.safetensors.index.json", "'y.weight'", names[_i], NULL);
}
END_TEST

START_TEST(test_bad_index) {
  static const char *const texts[] = {
      "{'weight_map': {'x.weight': 'a.safetensors',}}", /* invalid JSON */
      "{'metadata': {'total_size': 12}}",               /* no weight_map */
      "{'weight_map': ['a.safetensors']}",
      "{'weight_map': {}}",
      "{'weight_map': {'x.weight': 7}}",
      "['weight_map']",
      "{'weight_map': {'x.weight': 'a.safetensors', 'x.weight': 'b.safetensors'}}", /* duplicate key */
      "",
  };
  static const char *const why[] = {"invalid JSON", "no weight_map", "weight_map", "empty",
                                    "'x.weight'",   "top level",     "duplicate",  "invalid JSON"};
  put_two_shards(texts[_i]);
  expect_open_fails(NULL, QKEEP_E_FORMAT);
  expect_msg("model.safetensors.index.json", why[_i], NULL);
}
END_TEST

START_TEST(test_empty_dir) {
  expect_open_fails(NULL, QKEEP_E_NOTFOUND);
  expect_msg(dir, "model.safetensors", NULL);
  put_json("config.json", "{}");
  expect_open_fails(NULL, QKEEP_E_NOTFOUND);
  expect_open_fails("no-such.safetensors", QKEEP_E_NOTFOUND);
  expect_msg("no-such.safetensors", NULL);
}
END_TEST

/* A broken shard's own error comes through with the index named in front. */
START_TEST(test_corrupt_shard) {
  put_two_shards("{'weight_map': {'x.weight': 'a.safetensors', 'y.weight': 'a.safetensors', 'z.weight': "
                 "'b.safetensors'}}");
  char *path = tu_path(dir, "b.safetensors");
  /* A header length of 100 in a 10-byte file. */
  ck_assert_int_eq(tu_write_file(path, "\x64\0\0\0\0\0\0\0{}", 10), 0);
  free(path);
  expect_open_fails(NULL, QKEEP_E_FORMAT);
  expect_msg("model.safetensors.index.json", "b.safetensors", NULL);
}
END_TEST

/* ---- rejected configs ----------------------------------------------------------------------- */

/* Configs through a checkpoint directory: the message names the real file. */
START_TEST(test_config_errors_in_dir) {
  put_shard("model.safetensors", small_model);
  switch (_i) {
  case 0: /* hf_quant_config says NVFP4, config.json says GPTQ */
    put_json("hf_quant_config.json", MODELOPT_HF("NVFP4", "null", "16"));
    put_json("config.json",
             "{'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': 128}}");
    expect_open_fails(NULL, QKEEP_E_FORMAT);
    expect_msg("hf_quant_config.json", "config.json", "'gptq'", "contradict", NULL);
    break;
  case 1: /* both ModelOpt, different algorithms */
    put_json("hf_quant_config.json", MODELOPT_HF("NVFP4", "null", "16"));
    put_json("config.json", MODELOPT_CFG("FP8", ""));
    expect_open_fails(NULL, QKEEP_E_FORMAT);
    expect_msg("hf_quant_config.json", "config.json", "'NVFP4'", "'FP8'", NULL);
    break;
  case 2:
    put_json("config.json",
             "{'quantization_config': {'quant_method': 'bitsandbytes', 'load_in_4bit': true}}");
    expect_open_fails(NULL, QKEEP_E_UNSUPPORTED);
    expect_msg("config.json", "quant_method", "'bitsandbytes'", NULL);
    break;
  case 3:
    put_json("hf_quant_config.json", MODELOPT_HF("NVFP4", "null", "32"));
    expect_open_fails(NULL, QKEEP_E_FORMAT);
    expect_msg("hf_quant_config.json", "group_size 32, NVFP4 needs 16", NULL);
    break;
  case 4:
    put_json(
        "config.json",
        "{'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': '128', 'sym': true}}");
    expect_open_fails(NULL, QKEEP_E_FORMAT);
    expect_msg("config.json", "quantization_config.group_size", "a string", NULL);
    break;
  case 5:
    put_json("config.json", "{'quantization_config': ");
    expect_open_fails(NULL, QKEEP_E_FORMAT);
    expect_msg("config.json", "invalid JSON", NULL);
    break;
  case 6:
    put_json("hf_quant_config.json", "{'producer': {'name': 'modelopt'}}");
    expect_open_fails(NULL, QKEEP_E_FORMAT);
    expect_msg("hf_quant_config.json", "quantization", "missing", NULL);
    break;
  }
}
END_TEST

struct config_error {
  const char *cfg, *hf;
  int code;
  const char *why1, *why2;
};

static const struct config_error config_errors[] = {
    {"{'quantization_config': {'quant_method': 'gptq', 'bits': 8, 'group_size': 128}}", NULL,
     QKEEP_E_UNSUPPORTED, "quantization_config.bits", "8"},
    {"{'quantization_config': {'quant_method': 'gptq', 'bits': 4}}", NULL, QKEEP_E_FORMAT, "group_size",
     "missing"},
    {"{'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': 0}}", NULL, QKEEP_E_FORMAT,
     "group_size", "0"},
    {"{'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': 128, 'desc_act': 'yes'}}",
     NULL, QKEEP_E_FORMAT, "desc_act", "a string"},
    {"{'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': 128, 'checkpoint_format': "
     "'marlin'}}",
     NULL, QKEEP_E_UNSUPPORTED, "checkpoint_format", "'marlin'"},
    {"{'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': 128, 'dynamic': {'+:.*mlp': "
     "{'bits': 8}}}}",
     NULL, QKEEP_E_UNSUPPORTED, "dynamic.+:.*mlp.bits", "8"},
    {"{'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': 128, 'dynamic': {'-:(': "
     "{}}}}",
     NULL, QKEEP_E_FORMAT, "dynamic", "'-:('"},
    {"{'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': 128, 'dynamic': {'+:x': 3}}}",
     NULL, QKEEP_E_FORMAT, "dynamic.+:x", "an object"},
    {"{'quantization_config': {'quant_method': 'awq', 'bits': 4, 'group_size': 128, 'version': 'gemv'}}",
     NULL, QKEEP_E_UNSUPPORTED, "version", "'gemv'"},
    {"{'quantization_config': {'quant_method': 'awq', 'bits': 4, 'group_size': 128, 'zero_point': 1}}", NULL,
     QKEEP_E_FORMAT, "zero_point", "an integer"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'pack-quantized'}}", NULL,
     QKEEP_E_FORMAT, "config_groups", "missing"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'pack-quantized', "
     "'config_groups': "
     "{'group_0': {'weights': {'num_bits': 8, 'type': 'int', 'strategy': 'group', 'group_size': 128}}}}}",
     NULL, QKEEP_E_UNSUPPORTED, "num_bits", "only 4-bit"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'pack-quantized', "
     "'config_groups': "
     "{'group_0': {'weights': {'num_bits': 4, 'type': 'int', 'strategy': 'tensor'}}}}}",
     NULL, QKEEP_E_UNSUPPORTED, "strategy", "'tensor'"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'pack-quantized', "
     "'config_groups': "
     "{'group_0': {'weights': {'num_bits': 4, 'type': 'int', 'strategy': 'group', 'group_size': 128}, "
     "'input_activations': {'num_bits': 8, 'type': 'int', 'strategy': 'tensor', 'dynamic': false}}}}}",
     NULL, QKEEP_E_UNSUPPORTED, "input_activations", "static"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'float-quantized'}}", NULL,
     QKEEP_E_UNSUPPORTED, "format", "'float-quantized'"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors'}}", NULL, QKEEP_E_FORMAT, "format",
     "missing"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'nvfp4-pack-quantized', "
     "'config_groups': {'g': {'weights': {'num_bits': 4, 'type': 'float', 'group_size': 32}}}}}",
     NULL, QKEEP_E_FORMAT, "config_groups.g.weights.group_size", "32, NVFP4 needs 16"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'int-quantized', "
     "'config_groups': {'a': {'weights': {'num_bits': 8, 'type': 'int', 'strategy': 'channel', 'symmetric': "
     "true}, 'input_activations': {'num_bits': 8, 'type': 'int', 'strategy': 'token', 'dynamic': true}}, "
     "'b': {'weights': {'num_bits': 8, 'type': 'int', 'strategy': 'tensor', 'symmetric': true}, "
     "'input_activations': {'num_bits': 8, 'type': 'int', 'strategy': 'token', 'dynamic': true}}}}}",
     NULL, QKEEP_E_UNSUPPORTED, "'a' and 'b'", "differ"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'int-quantized', "
     "'config_groups': {'a': {'weights': {'num_bits': 8, 'type': 'int', 'strategy': 'channel', 'symmetric': "
     "false}, 'input_activations': {'num_bits': 8, 'type': 'int', 'strategy': 'token', 'dynamic': true}}}}}",
     NULL, QKEEP_E_UNSUPPORTED, "weights.symmetric", "asymmetric"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'int-quantized', "
     "'config_groups': {'a': {'weights': {'num_bits': 8, 'type': 'int', 'strategy': 'channel'}}}}}",
     NULL, QKEEP_E_UNSUPPORTED, "input_activations", "W8A16"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'int-quantized', "
     "'config_groups': {'a': {'weights': {'num_bits': 8, 'type': 'int', 'strategy': 'channel'}, "
     "'input_activations': {'num_bits': 8, 'type': 'int', 'strategy': 'tensor', 'dynamic': true}}}}}",
     NULL, QKEEP_E_UNSUPPORTED, "input_activations.strategy", "'tensor'"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'int-quantized', "
     "'config_groups': {'a': {'weights': {'num_bits': '8', 'type': 'int', 'strategy': 'channel'}}}}}",
     NULL, QKEEP_E_FORMAT, "config_groups.a.weights.num_bits", "a string"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'mixed-precision', "
     "'config_groups': {'a': {'format': 'nvfp4-pack-quantized'}, 'b': {'format': 'int-quantized'}}}}",
     NULL, QKEEP_E_UNSUPPORTED, "mix formats", "'int-quantized'"},
    {"{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'nvfp4-pack-quantized', "
     "'ignore': ['re:(unclosed']}}",
     NULL, QKEEP_E_FORMAT, "quantization_config.ignore", "re:(unclosed"},
    {"{'quantization_config': {'quant_method': 'mxfp4', 'modules_to_not_convert': 'lm_head'}}", NULL,
     QKEEP_E_FORMAT, "modules_to_not_convert", "array"},
    {"{'quantization_config': {'quant_method': 'mxfp4', 'modules_to_not_convert': ['lm_head', 3]}}", NULL,
     QKEEP_E_FORMAT, "modules_to_not_convert", "entry 1"},
    {"{'quantization_config': {'bits': 4}}", NULL, QKEEP_E_FORMAT, "quant_method", "missing"},
    {"{'quantization_config': {'quant_method': 4}}", NULL, QKEEP_E_FORMAT, "quant_method", "an integer"},
    {"{'quantization_config': 'gptq'}", NULL, QKEEP_E_FORMAT, "quantization_config", "a string"},
    {"{'tie_word_embeddings': 'true'}", NULL, QKEEP_E_FORMAT, "tie_word_embeddings", "a string"},
    {"[1, 2]", NULL, QKEEP_E_FORMAT, "ckdir/config.json", "top level"},
    {NULL, MODELOPT_HF("FP8", "null", "16"), QKEEP_E_UNSUPPORTED, "quantization.quant_algo", "'FP8'"},
    {NULL, MODELOPT_HF("NVFP4", "'NVFP4'", "16"), QKEEP_E_UNSUPPORTED, "kv_cache_quant_algo", "'NVFP4'"},
    {NULL, MODELOPT_HF("NVFP4", "null", "'16'"), QKEEP_E_FORMAT, "quantization.group_size", "a string"},
    {NULL, "{'quantization': {'group_size': 16}}", QKEEP_E_FORMAT, "quant_algo", "missing"},
    {MODELOPT_CFG("MIXED_PRECISION", ""), NULL, QKEEP_E_UNSUPPORTED, "quantization_config.quant_algo",
     "'MIXED_PRECISION'"},
    {"{'quantization_config': {'quant_method': 'modelopt', 'quant_algo': 'NVFP4', 'config_groups': {'g': "
     "{'weights': {'group_size': 32}}}}}",
     NULL, QKEEP_E_FORMAT, "group_size", "32, NVFP4 needs 16"},
    {"{'quantization_config': {'quant_method': 'awq', 'bits': 4, 'group_size': 128}}",
     MODELOPT_HF("NVFP4", "null", "16"), QKEEP_E_FORMAT, "ckdir/hf_quant_config.json", "ckdir/config.json"},
};

START_TEST(test_config_errors) {
  const struct config_error *k = &config_errors[_i];
  expect_parse_fails(k->cfg, k->hf, k->code);
  expect_msg(k->cfg && !k->hf ? "ckdir/config.json" : "ckdir/hf_quant_config.json", k->why1, k->why2, NULL);
}
END_TEST

/* ---- suite --------------------------------------------------------------------------------- */

/* ---- symbolic links ------------------------------------------------------------------ */

/* mkdir -p of dir/sub; returns the malloc'd path. */
static char *subdir(const char *sub) {
  char *path = tu_path(dir, sub);
  for (char *p = path + strlen(dir) + 1; *p; p++)
    if (*p == '/') {
      *p = '\0';
      mkdir(path, 0755);
      *p = '/';
    }
  mkdir(path, 0755);
  return path;
}

static void link_at(const char *target, const char *sub, const char *file) {
  char *d = tu_path(dir, sub), *path = tu_path(d, file);
  ck_assert_int_eq(symlink(target, path), 0);
  free(d);
  free(path);
}

static void put_text(const char *sub, const char *file, const char *text) {
  char *d = tu_path(dir, sub), *path = tu_path(d, file);
  ck_assert_int_eq(tu_write_file(path, text, strlen(text)), 0);
  free(d);
  free(path);
}

static const char *const link_tensors[] = {"model.a.weight", "model.b.weight", NULL};

/* A checkpoint directory's links are followed only inside its own tree (or into the hub
 * cache's blobs/). Outside, they were followed and the errors quoted the target's bytes: a secret file's
 * first 8 bytes printed as a header length, `near 'root'` from /etc/passwd. */
START_TEST(test_links_leaving_the_directory_are_refused) {
  static const char secret[] = "SECRET!!root:x:0:0:root:/root:/bin/bash\n";
  free(subdir("outside"));
  put_text("outside", "passwd", secret);
  char number[32];
  uint64_t len = 0;
  for (int i = 7; i >= 0; i--)
    len = len << 8 | (unsigned char)secret[i];
  snprintf(number, sizeof number, "%llu", (unsigned long long)len);
  /* config.json, model.safetensors, a shard and an index, each a link to the secret file. */
  static const char *const cases[][2] = {{"c1", "config.json"},
                                         {"c2", "model.safetensors"},
                                         {"c3", "model.safetensors.index.json"},
                                         {"c4", "hf_quant_config.json"},
                                         {"c5", "only.safetensors"}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *d = subdir(cases[i][0]);
    if (strcmp(cases[i][1], "model.safetensors") != 0 && strcmp(cases[i][1], "only.safetensors") != 0) {
      char *rel = tu_path(cases[i][0], "model.safetensors");
      put_shard(rel, link_tensors);
      free(rel);
    }
    link_at("../outside/passwd", cases[i][0], cases[i][1]);
    struct ckpt *c = (struct ckpt *)1;
    ck_assert_int_eq(ckpt_open(d, &c), QKEEP_E_FORMAT);
    ck_assert_ptr_null(c);
    const char *msg = qkeep_errmsg();
    ck_assert_msg(strstr(msg, "symbolic link") && strstr(msg, cases[i][1]), "%s: %s", cases[i][1], msg);
    ck_assert_msg(!strstr(msg, "root") && !strstr(msg, "SECRET") && !strstr(msg, number), "%s quotes it: %s",
                  cases[i][1], msg);
    free(d);
  }
  /* A shard named by an index. */
  char *d = subdir("c6");
  put_text(
      "c6", "model.safetensors.index.json",
      "{\"weight_map\": {\"model.a.weight\": \"s.safetensors\", \"model.b.weight\": \"s.safetensors\"}}");
  link_at("../outside/passwd", "c6", "s.safetensors");
  struct ckpt *c;
  ck_assert_int_eq(ckpt_open(d, &c), QKEEP_E_FORMAT);
  expect_msg("symbolic link", "s.safetensors", NULL);
  ck_assert(!strstr(qkeep_errmsg(), number));
  free(d);
}
END_TEST

/* Links inside the tree, and the hub cache's snapshots/<rev>/FILE -> ../../blobs/<hash>, load. */
START_TEST(test_links_inside_and_hub_cache_layout_load) {
  free(subdir("in"));
  put_shard("in/weights.bin", link_tensors);
  link_at("weights.bin", "in", "model.safetensors");
  char *d = tu_path(dir, "in");
  struct ckpt *c;
  ck_assert_msg(ckpt_open(d, &c) == 0, "%s", qkeep_errmsg());
  check_tensor(c, "model.a.weight", "model.safetensors");
  ckpt_close(c);
  free(d);
  free(subdir("hub/models--org--m/blobs"));
  free(subdir("hub/models--org--m/snapshots/0123abcd"));
  put_shard("hub/models--org--m/blobs/4f2e", link_tensors);
  put_text("hub/models--org--m/blobs", "9a01", "{\"model_type\": \"llama\"}");
  link_at("../../blobs/4f2e", "hub/models--org--m/snapshots/0123abcd", "model.safetensors");
  link_at("../../blobs/9a01", "hub/models--org--m/snapshots/0123abcd", "config.json");
  d = tu_path(dir, "hub/models--org--m/snapshots/0123abcd");
  ck_assert_msg(ckpt_open(d, &c) == 0, "%s", qkeep_errmsg());
  check_tensor(c, "model.b.weight", NULL);
  ckpt_close(c);
  /* ... but not past blobs/: a snapshot's link to the repository's other files is refused. */
  put_text("hub/models--org--m", "notes", "{}");
  link_at("../../notes", "hub/models--org--m/snapshots/0123abcd", "hf_quant_config.json");
  ck_assert_int_eq(ckpt_open(d, &c), QKEEP_E_FORMAT);
  expect_msg("symbolic link", "hf_quant_config.json", NULL);
  free(d);
  /* A bare path the caller names is followed wherever it points. */
  put_shard("elsewhere.safetensors", link_tensors);
  free(subdir("named"));
  link_at("../elsewhere.safetensors", "named", "x.safetensors");
  d = tu_path(dir, "named/x.safetensors");
  ck_assert_msg(ckpt_open(d, &c) == 0, "%s", qkeep_errmsg());
  ckpt_close(c);
  free(d);
}
END_TEST

/* A FIFO in a file's place blocked open(2) forever (opening a FIFO for reading waits for a writer):
 * config.json, hf_quant_config.json, the weights, an index's shard. Each is refused at once, naming
 * the file; alarm() turns a regression into a failure instead of a hang. */
START_TEST(test_fifo_in_the_directory_is_refused_without_waiting) {
  static const char *const cases[][2] = {{"f1", "config.json"},
                                         {"f2", "hf_quant_config.json"},
                                         {"f3", "model.safetensors"},
                                         {"f4", "s.safetensors"},
                                         {"f5", "model.safetensors.index.json"}};
  alarm(20);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *d = subdir(cases[i][0]);
    if (strcmp(cases[i][1], "model.safetensors") != 0) {
      char *rel = tu_path(cases[i][0], "model.safetensors");
      put_shard(rel, link_tensors);
      free(rel);
    }
    if (strcmp(cases[i][1], "s.safetensors") == 0)
      put_text(cases[i][0], "model.safetensors.index.json",
               "{\"weight_map\": {\"model.a.weight\": \"s.safetensors\", \"model.b.weight\": "
               "\"s.safetensors\"}}");
    char *fifo = tu_path(d, cases[i][1]);
    ck_assert_int_eq(mkfifo(fifo, 0644), 0);
    struct ckpt *c = (struct ckpt *)1;
    int rc = ckpt_open(d, &c);
    ck_assert_msg(rc == QKEEP_E_IO, "%s: %d (%s)", cases[i][1], rc, qkeep_errmsg());
    ck_assert_ptr_null(c);
    expect_msg(fifo, "not a regular file", "FIFO", NULL);
    free(fifo);
    free(d);
  }
  /* The file named directly: stat says FIFO, refused before any open. */
  char *fifo = tu_path(dir, "named.safetensors");
  ck_assert_int_eq(mkfifo(fifo, 0644), 0);
  struct ckpt *c = (struct ckpt *)1;
  ck_assert_int_ne(ckpt_open(fifo, &c), 0);
  ck_assert_ptr_null(c);
  expect_msg("named.safetensors", NULL);
  free(fifo);
  alarm(0);
}
END_TEST

static Suite *checkpoint_suite(void) {
  Suite *s = suite_create("checkpoint");
  TCase *tc = tcase_create("open");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, test_sharded);
  tcase_add_test(tc, test_single_in_dir);
  tcase_add_test(tc, test_single_file);
  tcase_add_test(tc, test_index_preferred);
  tcase_add_loop_test(tc, test_modelopt_dirs, 0, 3);
  suite_add_tcase(s, tc);

  tc = tcase_create("config");
  tcase_add_loop_test(tc, test_config_forms, 0, (int)(sizeof config_cases / sizeof config_cases[0]));
  tcase_add_test(tc, test_ignores);
  tcase_add_test(tc, test_ignore_regex_is_re_match);
  tcase_add_test(tc, test_ignore_catastrophic_regex_fails_clearly);
  tcase_add_test(tc, test_ignore_long_plain_list);
  tcase_add_test(tc, test_ignore_regexes_share_one_budget_per_load);
  tcase_add_test(tc, test_dynamic_rules_with_back_references_are_bounded);
  tcase_add_test(tc, test_many_ordinary_dynamic_rules_match_each_module_once);
  tcase_add_test(tc, test_mixed_precision_long_quantized_layers);
  suite_add_tcase(s, tc);

  tc = tcase_create("errors");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, test_missing_shard);
  tcase_add_test(tc, test_tensor_absent_from_shard);
  tcase_add_test(tc, test_tensor_in_two_shards);
  tcase_add_test(tc, test_shard_tensor_unmapped);
  tcase_add_loop_test(tc, test_bad_shard_names, 0, 4);
  tcase_add_loop_test(tc, test_bad_index, 0, 8);
  tcase_add_test(tc, test_empty_dir);
  tcase_add_test(tc, test_corrupt_shard);
  tcase_add_loop_test(tc, test_config_errors_in_dir, 0, 7);
  tcase_add_loop_test(tc, test_config_errors, 0, (int)(sizeof config_errors / sizeof config_errors[0]));
  suite_add_tcase(s, tc);

  tc = tcase_create("links");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, test_links_leaving_the_directory_are_refused);
  tcase_add_test(tc, test_links_inside_and_hub_cache_layout_load);
  tcase_add_test(tc, test_fifo_in_the_directory_is_refused_without_waiting);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run_suite(checkpoint_suite(), CK_NORMAL); }
