/*
 * check_sizes.c: sizes a checkpoint states that no kernel can run, and names no fixed buffer
 * can hold.
 *
 * One linear (N = 48, K = 256: no N-derived dimension equals a K-derived one in any scheme) is
 * quantized into every scheme once. Each case rewrites its tensors:
 *   - N = 0 or K = 0 in every scheme, on the reference backend and on cpu-onednn: the load
 *     fails with QKEEP_E_FORMAT naming the file, the module and the dimension, nothing stays
 *     loaded, and the same model then loads the good checkpoint (a division by N or K crashed
 *     the core, the reference kernel and oneDNN);
 *   - a packed dimension whose element count does not fit in 64 bits (signed overflow);
 *   - a static activation scale of 0 (kernels divide by it), and scales whose reciprocal or
 *     product with the codes they multiply overflows float;
 *   - the forward check and the kernels called with a row count whose f32 size wraps;
 *   - a NaN in one output element fails the forward check, whichever element it is;
 *   - expert index LONG_MAX, MoE prefixes of 600 and 5000 characters, and two attention
 *     blocks whose names agree in their first 600 characters.
 */
#include <check.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkutil.h"
#include "ckptutil.h"
#include "private.h"
#include "testutil.h"

#define N_ROWS 48
#define K_COLS 256
#define GROUP 32
#define MODULE "model.layers.0.mlp.down_proj"

enum variant { V_UNQUANTIZED, V_W8A8, V_MODELOPT, V_CT_NVFP4, V_MXFP4, V_GPTQ, V_AWQ, V_CT_INT4, V_COUNT };

static const struct {
  const char *name;
  struct qkeep_quantize_options opts; /* scheme NULL: the unquantized source itself */
} variants[V_COUNT] = {
    [V_UNQUANTIZED] = {"unquantized", {.scheme = NULL}},
    [V_W8A8] = {"w8a8-int8", {.scheme = "w8a8-int8", .static_input = true, .activation_amax = 4}},
    [V_MODELOPT] = {"modelopt-nvfp4", {.scheme = "modelopt-nvfp4", .activation_amax = 4}},
    [V_CT_NVFP4] = {"ct-nvfp4", {.scheme = "ct-nvfp4", .activation_amax = 4}},
    [V_MXFP4] = {"mxfp4", {.scheme = "mxfp4"}},
    [V_GPTQ] = {"gptq-int4", {.scheme = "gptq-int4", .group_size = GROUP}},
    [V_AWQ] = {"awq-int4", {.scheme = "awq-int4", .group_size = GROUP}},
    [V_CT_INT4] = {"ct-int4", {.scheme = "ct-int4", .group_size = GROUP}},
};

static char *inputs, *variant_dir[V_COUNT];
static char inputs_error[1024];

static int add_bf16(struct st_writer *w, uint64_t *rng, const char *name, int64_t rows, int64_t cols) {
  struct qkeep_spec spec = {.dtype = QKEEP_DTYPE_BF16, .ndim = cols ? 2 : 1, .shape = {rows, cols}};
  size_t n = (size_t)rows * (size_t)(cols ? cols : 1);
  uint16_t *v = malloc((n ? n : 1) * sizeof *v);
  if (!v)
    return QKEEP_E_NOMEM;
  for (size_t i = 0; i < n; i++)
    v[i] = qk_f32_to_bf16(cols ? tu_randf(rng) * 0.125f : 1.0f);
  int rc = st_writer_add(w, name, &spec, v);
  free(v);
  return rc;
}

/* Unchecked fixture: the source (a directory with one file) and its quantized variants. */
static void build_inputs(void) {
  inputs = tu_tmpdir("sizes-inputs");
  char *src = inputs ? tu_path(inputs, "unquantized") : NULL;
  char *file = src && mkdir(src, 0755) == 0 ? tu_path(src, "model.safetensors") : NULL;
  uint64_t rng = 3;
  struct st_writer *w = NULL;
  int rc = file ? st_writer_new(&w) : QKEEP_E_IO;
  if (!rc)
    rc = add_bf16(w, &rng, MODULE ".weight", N_ROWS, K_COLS);
  if (!rc)
    rc = add_bf16(w, &rng, "model.norm.weight", K_COLS, 0);
  if (!rc)
    rc = st_writer_write(w, file);
  st_writer_free(w);
  variant_dir[V_UNQUANTIZED] = src;
  for (int v = 1; v < V_COUNT && !rc; v++) {
    variant_dir[v] = tu_path(inputs, variants[v].name);
    struct qkeep_quantize_options o = variants[v].opts;
    o.size = sizeof o;
    rc = qkeep_quantize(file, variant_dir[v], &o);
  }
  if (rc)
    snprintf(inputs_error, sizeof inputs_error, "building the inputs: %s", qkeep_errmsg());
  free(file);
}

static void free_inputs(void) {
  if (inputs)
    tu_rmtree(inputs);
  for (int v = 0; v < V_COUNT; v++)
    free(variant_dir[v]);
  free(inputs);
}

static char *dir;

static void setup(void) {
  ck_assert_msg(inputs_error[0] == '\0', "%s", inputs_error);
  dir = tu_tmpdir("sizes");
  ck_assert_ptr_nonnull(dir);
}

static void teardown(void) {
  tu_rmtree(dir);
  free(dir);
}

/* ---- tensors of a checkpoint, rewritten ------------------------------------------------------ */

/* dir/<name>: a copy of variant v's directory (every file). */
static char *copy_variant(enum variant v, const char *name) {
  char *to = tu_path(dir, name);
  tu_copy_dir(variant_dir[v], to);
  return to;
}

static bool in_module(const char *name) { return strncmp(name, MODULE ".", strlen(MODULE ".")) == 0; }

static struct tu_tensor *find(struct tu_tensors *ts, const char *local) {
  for (size_t i = 0; i < ts->n; i++)
    if (in_module(ts->items[i].name) && strcmp(ts->items[i].name + strlen(MODULE "."), local) == 0)
      return &ts->items[i];
  return NULL;
}

/* Whether a dimension of a tensor of the linear derives from N (48, N/8) or from K (K, K/2, K/8,
 * K/16, K/32 = K/G); no value is both, so each dimension is one or the other. */
static bool from_n(int64_t d) { return d == N_ROWS || d == N_ROWS / 8; }
static bool from_k(int64_t d) {
  return d == K_COLS || d == K_COLS / 2 || d == K_COLS / 8 || d == K_COLS / 16 || d == K_COLS / 32;
}

/* The variant's checkpoint with the linear's N (which = 'N') or K (which = 'K') set to 0 in every
 * tensor that carries it; its data then has no bytes (compressed-tensors' weight_shape states it). */
static char *zero_dim(enum variant v, char which) {
  char name[64];
  snprintf(name, sizeof name, "%s-%c0", variants[v].name, which);
  char *ck = copy_variant(v, name), *file = tu_path(ck, "model.safetensors");
  struct tu_tensors ts = tu_read_tensors(file);
  int changed = 0;
  for (size_t i = 0; i < ts.n; i++) {
    struct tu_tensor *it = &ts.items[i];
    if (!in_module(it->name))
      continue;
    if (strcmp(it->name, MODULE ".weight_shape") == 0) {
      int64_t shape[2] = {which == 'N' ? 0 : N_ROWS, which == 'K' ? 0 : K_COLS};
      memcpy(it->data, shape, sizeof shape);
      continue;
    }
    for (int d = 0; d < it->spec.ndim; d++)
      if ((which == 'N' && from_n(it->spec.shape[d])) || (which == 'K' && from_k(it->spec.shape[d]))) {
        it->spec.shape[d] = 0;
        changed++;
      }
  }
  ck_assert_int_gt(changed, 0);
  tu_write_tensors(&ts, file);
  free(file);
  return ck;
}

/* ---- the checks -------------------------------------------------------------------------------- */

/* Loading `bad` into a new model of `backend` fails with code, naming the checkpoint, the module and
 * every needle; nothing stays loaded (census empty); the same model then loads `good` when set. */
static void expect_refused(const char *backend, const char *bad, int code, const char *good,
                           const char *needle) {
  qkeep_plugin *plugin;
  ck_assert_msg(qkeep_plugin_open(backend, NULL, &plugin) == 0, "%s", qkeep_errmsg());
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  int rc = qkeep_model_load(m, bad);
  char msg[4096];
  snprintf(msg, sizeof msg, "%s", qkeep_errmsg());
  ck_assert_msg(rc == code, "%s on %s: returned %d (%s), expected %d; message: %s", bad, backend, rc,
                qkeep_strerror(rc), code, msg);
  ck_assert_msg(strstr(msg, bad) != NULL, "the message does not name the checkpoint: %s", msg);
  ck_assert_msg(strstr(msg, MODULE) != NULL, "the message does not name the module: %s", msg);
  ck_assert_msg(!needle || strstr(msg, needle) != NULL, "'%s' is not in the message: %s", needle, msg);
  struct qkeep_census c = {.size = sizeof c};
  ck_assert_int_eq(qkeep_census(m, &c), 0);
  ck_assert_int_eq(c.loader_params, 0);
  ck_assert_int_eq(c.total_bytes, 0);
  if (good) {
    ck_assert_msg(qkeep_model_load(m, good) == 0, "%s: %s", good, qkeep_errmsg());
    tu_assert_census_clean(m);
  }
  qkeep_model_free(m);
  qkeep_plugin_close(plugin);
}

/* The schemes cpu-onednn runs (the others it refuses as a whole model, so nothing to load after). */
static bool onednn_takes(enum variant v) { return v == V_UNQUANTIZED || v == V_W8A8; }

static bool have_onednn(void) {
  qkeep_plugin *p;
  if (qkeep_plugin_open("cpu-onednn", NULL, &p) != 0)
    return false;
  qkeep_plugin_close(p);
  return true;
}

/* _i: variant * 2 + (0: N = 0, 1: K = 0). */
START_TEST(zero_sized_linear_is_refused_in_every_scheme) {
  enum variant v = (enum variant)(_i / 2);
  char which = _i % 2 ? 'K' : 'N';
  char *ck = zero_dim(v, which);
  char needle[16];
  snprintf(needle, sizeof needle, "%c = 0", which);
  /* The int4 schemes find K = 0 when they divide it into groups: the message says K = 0 there too,
   * except compressed-tensors', which finds an empty weight_scale first. */
  bool says_dim = !(v == V_CT_INT4 && which == 'K');
  expect_refused("reference", ck, QKEEP_E_FORMAT, variant_dir[v], says_dim ? needle : NULL);
  if (have_onednn())
    expect_refused("cpu-onednn", ck, QKEEP_E_FORMAT, onednn_takes(v) ? variant_dir[v] : NULL,
                   says_dim ? needle : NULL);
  free(ck);
}
END_TEST

/* A BF16 [0, 2^60] weight has no bytes, so the file is valid; the layer is refused (the forward
 * check sized its buffers from m * K, which wrapped to 0). */
START_TEST(empty_weight_with_huge_other_dimension_is_refused) {
  char *ck = copy_variant(V_UNQUANTIZED, "huge"), *file = tu_path(ck, "model.safetensors");
  struct tu_tensors ts = tu_read_tensors(file);
  struct tu_tensor *w = find(&ts, "weight");
  ck_assert_ptr_nonnull(w);
  w->spec.shape[0] = 0;
  w->spec.shape[1] = (int64_t)1 << 60;
  tu_write_tensors(&ts, file);
  expect_refused("reference", ck, QKEEP_E_FORMAT, variant_dir[V_UNQUANTIZED], "K = 1152921504606846976");
  if (have_onednn())
    expect_refused("cpu-onednn", ck, QKEEP_E_FORMAT, variant_dir[V_UNQUANTIZED], "N = 0");
  free(file);
  free(ck);
}
END_TEST

/* Rewrites the header of a safetensors file so that tensor `name` has shape [d0, d1] (our writer
 * refuses a shape whose partial products pass its limit, even when another dimension is 0). */
static void set_header_shape(const char *file, const char *name, int64_t d0, int64_t d1) {
  size_t n;
  unsigned char *bytes = tu_read_file(file, &n);
  ck_assert_ptr_nonnull(bytes);
  uint64_t len = 0;
  for (int i = 7; i >= 0; i--)
    len = len << 8 | bytes[i];
  json_error_t err;
  json_t *root = json_loadb((const char *)bytes + 8, (size_t)len, 0, &err);
  ck_assert_ptr_nonnull(root);
  json_t *t = json_object_get(root, name);
  ck_assert_ptr_nonnull(t);
  json_object_set_new(t, "shape", json_pack("[II]", (json_int_t)d0, (json_int_t)d1));
  char *header = json_dumps(root, JSON_COMPACT);
  size_t hlen = strlen(header), data = n - 8 - (size_t)len;
  unsigned char *out = malloc(8 + hlen + data);
  ck_assert_ptr_nonnull(out);
  for (int i = 0; i < 8; i++)
    out[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
  memcpy(out + 8, header, hlen);
  memcpy(out + 8 + hlen, bytes + 8 + len, data);
  ck_assert_int_eq(tu_write_file(file, out, 8 + hlen + data), 0);
  free(out);
  free(header);
  json_decref(root);
  free(bytes);
}

/* The packed weight of each packed scheme with the dimension that multiplies into N or K at
 * 2^62 + 1 (times 2 or 8 overflows int64) and the other at 0 (no bytes). */
START_TEST(packed_dimension_past_64_bits_is_refused) {
  static const struct {
    enum variant v;
    const char *weight;
    int packed_axis;
  } cases[] = {{V_MODELOPT, "weight", 1},     {V_CT_NVFP4, "weight_packed", 1},
               {V_MXFP4, "weight_packed", 1}, {V_GPTQ, "qweight", 0},
               {V_AWQ, "qweight", 1},         {V_CT_INT4, "weight_packed", 1}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    char name[64];
    snprintf(name, sizeof name, "%s-overflow", variants[cases[c].v].name);
    char *ck = copy_variant(cases[c].v, name), *file = tu_path(ck, "model.safetensors");
    struct tu_tensors ts = tu_read_tensors(file);
    struct tu_tensor *w = find(&ts, cases[c].weight);
    ck_assert_ptr_nonnull(w);
    char *weight = strdup(w->name);
    w->spec.shape[0] = w->spec.shape[1] = 0;
    tu_write_tensors(&ts, file);
    int64_t huge = ((int64_t)1 << 62) + 1;
    set_header_shape(file, weight, cases[c].packed_axis ? 0 : huge, cases[c].packed_axis ? huge : 0);
    free(weight);
    expect_refused("reference", ck, QKEEP_E_FORMAT, NULL, cases[c].weight);
    free(file);
    free(ck);
  }
}
END_TEST

/* A reload of bad checkpoint `ck` into a reference model of `good` is refused (QKEEP_E_FORMAT, the
 * message holding `needle`) and changes nothing (the digest). */
static void reload_refused_unchanged(const char *good, const char *ck, const char *needle) {
  qkeep_plugin *plugin;
  ck_assert_int_eq(qkeep_plugin_open("reference", NULL, &plugin), 0);
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  ck_assert_int_eq(qkeep_model_load(m, good), 0);
  struct qkeep_digest before, after;
  ck_assert_int_eq(qkeep_digest(m, &before), 0);
  ck_assert_int_eq(qkeep_model_reload(m, ck, 0), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), needle) != NULL, "%s", qkeep_errmsg());
  ck_assert_int_eq(qkeep_digest(m, &after), 0);
  ck_assert_mem_eq(&before, &after, sizeof before);
  qkeep_model_free(m);
  qkeep_plugin_close(plugin);
}
/* A static activation scale of 0 divides the activations: refused naming the tensor, at load and
 * by a reload of the same bytes. Non-zero scales of the same checkpoints load (the control). */
START_TEST(zero_static_input_scale_is_refused) {
  static const struct {
    enum variant v;
    const char *scale;
  } cases[] = {{V_W8A8, "input_scale"}, {V_MODELOPT, "input_scale"}, {V_CT_NVFP4, "input_global_scale"}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    char name[64];
    snprintf(name, sizeof name, "%s-zero-scale", variants[cases[c].v].name);
    char *ck = copy_variant(cases[c].v, name), *file = tu_path(ck, "model.safetensors");
    struct tu_tensors ts = tu_read_tensors(file);
    struct tu_tensor *s = find(&ts, cases[c].scale);
    ck_assert_msg(s != NULL, "%s has no %s", variants[cases[c].v].name, cases[c].scale);
    size_t esize = qkeep_dtype_size(s->spec.dtype);
    memset(s->data, 0, esize); /* +0.0 in every float dtype */
    tu_write_tensors(&ts, file);
    char needle[160];
    snprintf(needle, sizeof needle, "'" MODULE ".%s': element 0 is zero", cases[c].scale);
    expect_refused("reference", ck, QKEEP_E_FORMAT, variant_dir[cases[c].v], needle);
    if (cases[c].v == V_W8A8 && have_onednn())
      expect_refused("cpu-onednn", ck, QKEEP_E_FORMAT, variant_dir[cases[c].v], needle);
    reload_refused_unchanged(variant_dir[cases[c].v], ck, "element 0 is zero");
    free(file);
    free(ck);
  }
}
END_TEST

/* A scale whose reciprocal (kernels divide by it or invert it) or whose product with the largest code
 * it multiplies (FP4 6 times E4M3 448 for a global scale, int8 127, int4 15) overflows float decodes to
 * Inf or garbage: refused naming the tensor and the element, at load and by a reload. */
START_TEST(scales_whose_reciprocal_or_product_overflows_are_refused) {
  static const struct {
    enum variant v;
    const char *scale;
    size_t element;
    float value;
    const char *why;
  } cases[] = {
      {V_W8A8, "input_scale", 0, 1e-45f, "reciprocal"},
      {V_MODELOPT, "input_scale", 0, 1e-45f, "reciprocal"},
      {V_CT_NVFP4, "input_global_scale", 0, 1e-45f, "reciprocal"},
      {V_CT_NVFP4, "weight_global_scale", 0, 1e-45f, "reciprocal"},
      {V_CT_NVFP4, "weight_global_scale", 0, 0.0f, "zero"}, /* inverted: 1/0 */
      {V_MODELOPT, "weight_scale_2", 0, 3e38f, "overflows"},
      {V_MODELOPT, "input_scale", 0, 3e38f, "overflows"},
      {V_W8A8, "weight_scale", 5, 3e36f, "overflows"},
      {V_CT_INT4, "weight_scale", 7, 3e37f, "overflows"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    char name[64];
    snprintf(name, sizeof name, "%s-scale-%zu", variants[cases[c].v].name, c);
    char *ck = copy_variant(cases[c].v, name), *file = tu_path(ck, "model.safetensors");
    struct tu_tensors ts = tu_read_tensors(file);
    struct tu_tensor *s = find(&ts, cases[c].scale);
    ck_assert_msg(s != NULL, "%s has no %s", variants[cases[c].v].name, cases[c].scale);
    unsigned char *at = (unsigned char *)s->data + cases[c].element * qkeep_dtype_size(s->spec.dtype);
    if (s->spec.dtype == QKEEP_DTYPE_F32)
      memcpy(at, &cases[c].value, 4);
    else {
      ck_assert_int_eq(s->spec.dtype, QKEEP_DTYPE_BF16);
      uint16_t h = qk_f32_to_bf16(cases[c].value);
      memcpy(at, &h, 2);
    }
    tu_write_tensors(&ts, file);
    char needle[160];
    snprintf(needle, sizeof needle, "'" MODULE ".%s': element %zu is", cases[c].scale, cases[c].element);
    expect_refused("reference", ck, QKEEP_E_FORMAT, variant_dir[cases[c].v], needle);
    expect_refused("reference", ck, QKEEP_E_FORMAT, NULL, cases[c].why);
    if (cases[c].v == V_W8A8 && have_onednn())
      expect_refused("cpu-onednn", ck, QKEEP_E_FORMAT, variant_dir[cases[c].v], needle);
    reload_refused_unchanged(variant_dir[cases[c].v], ck, needle);
    free(file);
    free(ck);
  }
}
END_TEST

static int count_layers(void *user, const struct qkeep_layer_error *e) {
  (void)e;
  ++*(int *)user;
  return 0;
}

static int keep_worst(void *user, const struct qkeep_layer_error *e) {
  *(struct qkeep_layer_error *)user = *e;
  return 0;
}

/* A model whose output is NaN at one element and exact elsewhere: the forward check reports a NaN
 * error (no tolerance passes it), wherever the NaN is, in the model's output or the reference's. An
 * element after the NaN used to overwrite its difference. The NaN comes from a weight: row r of the
 * weight NaN at one column makes output column r NaN in every row of activations. */
START_TEST(a_nan_in_one_output_fails_the_forward_check) {
  qkeep_plugin *plugin;
  ck_assert_int_eq(qkeep_plugin_open("reference", NULL, &plugin), 0);
  static const int64_t rows[] = {0, 3, 7};
  float w[8 * 16];
  uint64_t rng = 9;
  for (int i = 0; i < 8 * 16; i++)
    w[i] = tu_randf(&rng);
  struct qkeep_spec spec = {.dtype = QKEEP_DTYPE_F32, .ndim = 2, .shape = {8, 16}};
  char *clean = tu_path(dir, "clean.safetensors"), *poisoned = tu_path(dir, "nan.safetensors");
  struct st_writer *sw;
  ck_assert_int_eq(st_writer_new(&sw), 0);
  ck_assert_int_eq(st_writer_add(sw, MODULE ".weight", &spec, w), 0);
  ck_assert_int_eq(st_writer_write(sw, clean), 0);
  st_writer_free(sw);
  qkeep_model *ref;
  ck_assert_int_eq(qkeep_model_new(plugin, &ref), 0);
  ck_assert_msg(qkeep_model_load(ref, clean) == 0, "%s", qkeep_errmsg());
  for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
    float bad[8 * 16];
    memcpy(bad, w, sizeof bad);
    bad[rows[r] * 16 + 5] = NAN;
    ck_assert_int_eq(st_writer_new(&sw), 0);
    ck_assert_int_eq(st_writer_add(sw, MODULE ".weight", &spec, bad), 0);
    ck_assert_int_eq(st_writer_write(sw, poisoned), 0);
    st_writer_free(sw);
    qkeep_model *m;
    ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
    ck_assert_msg(qkeep_model_load(m, poisoned) == 0, "%s", qkeep_errmsg());
    for (int side = 0; side < 2; side++) /* the NaN in the model's output, then in the reference's */
      for (int64_t mrows = 1; mrows <= 2; mrows++) {
        struct qkeep_layer_error e = {.max_abs = 0};
        ck_assert_int_eq(qkeep_compare(side ? ref : m, side ? m : ref, mrows, 1, keep_worst, &e), 0);
        ck_assert_msg(isnan(e.max_abs) && isnan(e.max_rel),
                      "NaN at output column %lld, %s side, %lld rows: max_abs %g, max_rel %g",
                      (long long)rows[r], side ? "reference" : "model", (long long)mrows, e.max_abs,
                      e.max_rel);
      }
    /* the control: the same model against itself */
    struct qkeep_layer_error e = {.max_abs = 1};
    ck_assert_int_eq(qkeep_compare(ref, ref, 2, 1, keep_worst, &e), 0);
    ck_assert(e.max_abs == 0 && e.max_rel == 0);
    qkeep_model_free(m);
  }
  qkeep_model_free(ref);
  free(clean);
  free(poisoned);
  qkeep_plugin_close(plugin);
}
END_TEST

/* m rows whose f32 size wraps size_t: refused before any buffer is sized from it. */
START_TEST(row_counts_whose_size_wraps_are_refused) {
  qkeep_plugin *plugin;
  ck_assert_int_eq(qkeep_plugin_open("reference", NULL, &plugin), 0);
  qkeep_model *a, *b;
  ck_assert_int_eq(qkeep_model_new(plugin, &a), 0);
  ck_assert_int_eq(qkeep_model_new(plugin, &b), 0);
  ck_assert_int_eq(qkeep_model_load(a, variant_dir[V_W8A8]), 0);
  ck_assert_int_eq(qkeep_model_load(b, variant_dir[V_W8A8]), 0);
  int layers = 0;
  ck_assert_int_eq(qkeep_compare(a, b, 4, 1, count_layers, &layers), 0); /* the control */
  ck_assert_int_eq(layers, 1);
  /* 2^62 rows of K = 256 floats: m * K * 4 = 2^72, 0 modulo 2^64 */
  int64_t m = (int64_t)1 << 62;
  ck_assert_int_eq(qkeep_compare(a, b, m, 1, count_layers, &layers), QKEEP_E_INVAL);
  ck_assert_msg(strstr(qkeep_errmsg(), MODULE) != NULL, "%s", qkeep_errmsg());
  qkeep_layer *l = qkeep_model_find_layer(a, MODULE);
  ck_assert_ptr_nonnull(l);
  float x[4] = {0}, y[4] = {0}; /* far too small: the call must refuse before touching them */
  ck_assert_int_eq(qkeep_layer_apply_f32(l, m, x, y), QKEEP_E_INVAL);
  ck_assert_int_eq(qkeep_layer_apply_f32(l, INT64_MAX, x, y), QKEEP_E_INVAL);
  qkeep_model_free(a);
  qkeep_model_free(b);
  qkeep_plugin_close(plugin);
}
END_TEST

/* ---- names: no fixed buffer ------------------------------------------------------------------- */

/* A prefix of len characters: "p" + "xxx..." (dots every 50, so it is a module path). */
static char *long_prefix(size_t len, char last) {
  char *p = malloc(len + 1);
  ck_assert_ptr_nonnull(p);
  for (size_t i = 0; i < len; i++)
    p[i] = i % 50 == 49 ? '.' : 'a' + (char)(i % 26);
  p[0] = 'p';
  p[len - 1] = last;
  p[len] = '\0';
  return p;
}

static char *cat3(const char *a, const char *b, const char *c) {
  size_t n = strlen(a) + strlen(b) + strlen(c) + 1;
  char *s = malloc(n);
  ck_assert_ptr_nonnull(s);
  snprintf(s, n, "%s%s%s", a, b, c);
  return s;
}

static void add_named(struct st_writer *w, uint64_t *rng, const char *a, const char *b, const char *c,
                      int64_t rows, int64_t cols) {
  char *name = cat3(a, b, c);
  ck_assert_int_eq(add_bf16(w, rng, name, rows, cols), 0);
  free(name);
}

/*
 * Under a prefix of `len` characters: an MoE block of 2 experts, and two attention blocks that
 * differ only in the character after the prefix, each with q/k/v/o and its own k_scale. Every
 * layer must be there, every tensor must resolve to its own param, and the forward check runs.
 */
static void long_names_load(size_t len) {
  char *p = long_prefix(len, 'z');
  struct st_writer *w;
  uint64_t rng = 5;
  ck_assert_int_eq(st_writer_new(&w), 0);
  char e[64];
  for (int x = 0; x < 2; x++) {
    snprintf(e, sizeof e, ".mlp.experts.%d.", x);
    char *base = cat3(p, e, "");
    add_named(w, &rng, base, "gate_proj", ".weight", 32, 64);
    add_named(w, &rng, base, "up_proj", ".weight", 32, 64);
    add_named(w, &rng, base, "down_proj", ".weight", 64, 32);
    free(base);
  }
  static const char *const blocks[2] = {"A.self_attn.", "B.self_attn."};
  for (int b = 0; b < 2; b++) {
    char *base = cat3(p, blocks[b], "");
    add_named(w, &rng, base, "q_proj", ".weight", 64, 64);
    add_named(w, &rng, base, "k_proj", ".weight", 32, 64);
    add_named(w, &rng, base, "v_proj", ".weight", 32, 64);
    add_named(w, &rng, base, "o_proj", ".weight", 64, 64);
    char *scale = cat3(base, "k_scale", "");
    float value = b ? 2.0f : 0.5f;
    struct qkeep_spec s = {.dtype = QKEEP_DTYPE_F32, .ndim = 0};
    ck_assert_int_eq(st_writer_add(w, scale, &s, &value), 0);
    free(scale);
    free(base);
  }
  char *ck = tu_path(dir, "long"), *file = tu_path(ck, "model.safetensors");
  ck_assert_int_eq(mkdir(ck, 0755), 0);
  ck_assert_msg(st_writer_write(w, file) == 0, "%s", qkeep_errmsg());
  st_writer_free(w);

  qkeep_plugin *plugin;
  ck_assert_int_eq(qkeep_plugin_open("reference", NULL, &plugin), 0);
  qkeep_model *m, *r;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  ck_assert_msg(qkeep_model_load(m, ck) == 0, "%s", qkeep_errmsg());
  /* the MoE block, two fused qkv and two o_proj, two kv-scales layers */
  ck_assert_uint_eq(qkeep_model_layer_count(m), 7);
  char *moe = cat3(p, ".mlp.experts", "");
  qkeep_layer *l = qkeep_model_find_layer(m, moe);
  ck_assert_msg(l != NULL, "no MoE layer under the %zu-character prefix", len);
  ck_assert_int_eq(l->kind, QKEEP_LAYER_MOE);
  const qkeep_param *scales[2];
  for (int b = 0; b < 2; b++) {
    char *kv = cat3(p, blocks[b], "attn");
    ck_assert_msg(qkeep_model_find_layer(m, kv) != NULL, "attention block %d's kv-scales layer is missing",
                  b);
    char *scale = cat3(p, blocks[b], "k_scale");
    qkeep_layer *owner = NULL;
    scales[b] = qkeep_model_lookup(m, scale, &owner);
    ck_assert_msg(scales[b] != NULL, "block %d's k_scale does not resolve", b);
    ck_assert_ptr_eq(owner, qkeep_model_find_layer(m, kv));
    free(scale);
    free(kv);
  }
  ck_assert_ptr_ne(scales[0], scales[1]);
  tu_assert_census_clean(m);
  ck_assert_int_eq(qkeep_model_new(plugin, &r), 0);
  ck_assert_int_eq(qkeep_model_load(r, ck), 0);
  int layers = 0;
  ck_assert_msg(qkeep_compare(m, r, 2, 1, count_layers, &layers) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(layers, 2 * 2 + 4); /* 2 experts x (w13, w2), 2 qkv, 2 o_proj */
  qkeep_model_free(r);
  qkeep_model_free(m);
  qkeep_plugin_close(plugin);
  free(moe);
  free(file);
  free(ck);
  free(p);
}

START_TEST(names_of_600_characters_load) { long_names_load(600); }
END_TEST

START_TEST(names_of_5000_characters_load) { long_names_load(5000); }
END_TEST

/* strtol's LONG_MAX as an expert index: refused, before any arithmetic on it. */
START_TEST(expert_index_long_max_is_refused) {
  struct st_writer *w;
  uint64_t rng = 9;
  ck_assert_int_eq(st_writer_new(&w), 0);
  static const char *const roles[] = {"gate_proj", "up_proj", "down_proj"};
  for (int r = 0; r < 3; r++) {
    char name[160];
    snprintf(name, sizeof name, "model.layers.0.mlp.experts.%ld.%s.weight", LONG_MAX, roles[r]);
    ck_assert_int_eq(add_bf16(w, &rng, name, 32, 32), 0);
  }
  char *ck = tu_path(dir, "experts"), *file = tu_path(ck, "model.safetensors");
  ck_assert_int_eq(mkdir(ck, 0755), 0);
  ck_assert_int_eq(st_writer_write(w, file), 0);
  st_writer_free(w);
  qkeep_plugin *plugin;
  ck_assert_int_eq(qkeep_plugin_open("reference", NULL, &plugin), 0);
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  ck_assert_int_eq(qkeep_model_load(m, ck), QKEEP_E_FORMAT);
  char needle[64];
  snprintf(needle, sizeof needle, "expert index %ld", LONG_MAX);
  ck_assert_msg(strstr(qkeep_errmsg(), needle) != NULL, "%s", qkeep_errmsg());
  qkeep_model_free(m);
  qkeep_plugin_close(plugin);
  free(file);
  free(ck);
}
END_TEST

/* The quantizer refuses a weight with a zero dimension (it wrote GPTQ files with N = 0). */
START_TEST(quantizer_refuses_a_zero_sized_weight) {
  static const char *const schemes[] = {"w8a8-int8", "modelopt-nvfp4", "ct-nvfp4", "mxfp4",
                                        "gptq-int4", "awq-int4",       "ct-int4"};
  for (int which = 0; which < 2; which++) {
    struct st_writer *w;
    uint64_t rng = 1;
    ck_assert_int_eq(st_writer_new(&w), 0);
    ck_assert_int_eq(add_bf16(w, &rng, "model.layers.0.mlp.up_proj.weight", 64, 64), 0);
    struct qkeep_spec s = {.dtype = QKEEP_DTYPE_BF16, .ndim = 2, .shape = {which ? 64 : 0, which ? 0 : 64}};
    ck_assert_int_eq(st_writer_add(w, MODULE ".weight", &s, ""), 0);
    char *src = tu_path(dir, which ? "k0.safetensors" : "n0.safetensors");
    ck_assert_int_eq(st_writer_write(w, src), 0);
    st_writer_free(w);
    for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++) {
      char out_name[64];
      snprintf(out_name, sizeof out_name, "q-%d-%s", which, schemes[i]);
      char *out = tu_path(dir, out_name);
      struct qkeep_quantize_options o = {.size = sizeof o, .scheme = schemes[i], .group_size = GROUP};
      ck_assert_msg(qkeep_quantize(src, out, &o) == QKEEP_E_FORMAT, "%s quantized a %s weight", schemes[i],
                    which ? "[64, 0]" : "[0, 64]");
      ck_assert_msg(strstr(qkeep_errmsg(), MODULE ".weight") != NULL, "%s", qkeep_errmsg());
      struct stat st;
      ck_assert_msg(stat(out, &st) != 0, "%s: the failed quantization left %s", schemes[i], out);
      free(out);
    }
    free(src);
  }
}
END_TEST

/* A GPTQ dynamic rule whose key (a regular expression) is 600 characters: the message about its
 * value names the whole key path (it was cut at 512 characters). */
START_TEST(long_config_key_paths_are_named_whole) {
  char *ck = copy_variant(V_GPTQ, "dynamic"), *cfg = tu_path(ck, "config.json");
  json_error_t err;
  json_t *root = json_load_file(cfg, 0, &err);
  ck_assert_ptr_nonnull(root);
  char *pattern = long_prefix(600, 'z');
  char *key = cat3("+:", pattern, "");
  json_t *rules = json_object();
  json_object_set_new(rules, key, json_pack("{s:i}", "bits", 3));
  json_object_set_new(json_object_get(root, "quantization_config"), "dynamic", rules);
  ck_assert_int_eq(json_dump_file(root, cfg, 0), 0);
  json_decref(root);
  char *needle = cat3("quantization_config.dynamic.", key, ".bits");
  qkeep_plugin *plugin;
  ck_assert_int_eq(qkeep_plugin_open("reference", NULL, &plugin), 0);
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  ck_assert_int_eq(qkeep_model_load(m, ck), QKEEP_E_UNSUPPORTED);
  ck_assert_msg(strstr(qkeep_errmsg(), needle) != NULL, "the key path is not whole: %s", qkeep_errmsg());
  qkeep_model_free(m);
  qkeep_plugin_close(plugin);
  free(needle);
  free(key);
  free(pattern);
  free(cfg);
  free(ck);
}
END_TEST

/* A plugin search path of three 500-character directories: the not-found message lists all three
 * (it was cut at 1536 characters). */
START_TEST(plugin_not_found_lists_a_long_search_path) {
  char *a = long_prefix(500, 'a'), *b = long_prefix(500, 'b'), *c = long_prefix(500, 'c');
  for (char **d = (char *[]){a, b, c, NULL}; *d; d++)
    for (char *p = *d; *p; p++)
      if (*p == '.')
        *p = '/'; /* a deep path rather than dots */
  char *ab = cat3(a, ":/", b), *path = cat3("/", ab, ":/");
  char *full = cat3(path, c, "");
  const char *old = getenv("QKEEP_PLUGIN_PATH");
  char *saved = old ? strdup(old) : NULL;
  setenv("QKEEP_PLUGIN_PATH", full, 1);
  qkeep_plugin *p = NULL;
  int rc = qkeep_plugin_open("nosuchbackend", NULL, &p);
  if (saved)
    setenv("QKEEP_PLUGIN_PATH", saved, 1);
  else
    unsetenv("QKEEP_PLUGIN_PATH");
  ck_assert_int_eq(rc, QKEEP_E_NOTFOUND);
  ck_assert_msg(strstr(qkeep_errmsg(), c) != NULL, "the third directory is not in the message: %s",
                qkeep_errmsg());
  free(saved);
  free(full);
  free(path);
  free(ab);
  free(a);
  free(b);
  free(c);
}
END_TEST

/* A hand-built linear gets the same rule as a loaded one. */
START_TEST(hand_built_layers_with_a_zero_dimension_are_refused) {
  qkeep_plugin *plugin;
  ck_assert_int_eq(qkeep_plugin_open("reference", NULL, &plugin), 0);
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  qkeep_layer *l, *norm;
  ck_assert_int_eq(qkeep_layer_add(m, "hand", QKEEP_LAYER_LINEAR, "unquantized", &l), 0);
  ck_assert_int_eq(qkeep_layer_add(m, "norm", QKEEP_LAYER_OTHER, "unquantized", &norm), 0);
  struct qkeep_layer_info d = {.size = sizeof d, .n = 0, .k = 8, .shards = 1};
  ck_assert_int_eq(qkeep_layer_set_dims(l, &d), QKEEP_E_INVAL);
  ck_assert_msg(strstr(qkeep_errmsg(), "hand: N = 0, K = 8") != NULL, "%s", qkeep_errmsg());
  d.n = 4, d.k = 0;
  ck_assert_int_eq(qkeep_layer_set_dims(l, &d), QKEEP_E_INVAL);
  d.n = -1, d.k = 8;
  ck_assert_int_eq(qkeep_layer_set_dims(norm, &d), QKEEP_E_INVAL);
  d.n = 0, d.k = 0;
  ck_assert_int_eq(qkeep_layer_set_dims(norm, &d), 0); /* not a GEMM: no dims needed */
  d.n = 4, d.k = 8;
  ck_assert_int_eq(qkeep_layer_set_dims(l, &d), 0); /* the control */
  qkeep_model_free(m);
  qkeep_plugin_close(plugin);
}
END_TEST

static Suite *sizes_suite(void) {
  Suite *s = suite_create("sizes");
  TCase *tc = tcase_create("sizes");
  tcase_add_unchecked_fixture(tc, build_inputs, free_inputs);
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, zero_sized_linear_is_refused_in_every_scheme, 0, 2 * V_COUNT);
  tcase_add_test(tc, empty_weight_with_huge_other_dimension_is_refused);
  tcase_add_test(tc, packed_dimension_past_64_bits_is_refused);
  tcase_add_test(tc, zero_static_input_scale_is_refused);
  tcase_add_test(tc, scales_whose_reciprocal_or_product_overflows_are_refused);
  tcase_add_test(tc, row_counts_whose_size_wraps_are_refused);
  tcase_add_test(tc, a_nan_in_one_output_fails_the_forward_check);
  tcase_add_test(tc, names_of_600_characters_load);
  tcase_add_test(tc, names_of_5000_characters_load);
  tcase_add_test(tc, expert_index_long_max_is_refused);
  tcase_add_test(tc, quantizer_refuses_a_zero_sized_weight);
  tcase_add_test(tc, long_config_key_paths_are_named_whole);
  tcase_add_test(tc, hand_built_layers_with_a_zero_dimension_are_refused);
  tcase_add_test(tc, plugin_not_found_lists_a_long_search_path);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run_suite(sizes_suite(), CK_NORMAL); }
