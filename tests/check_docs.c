/*
 * check_docs.c: docs/SCHEMES.md cannot drift from the code. For every scheme (and its
 * variants) a model is quantized with dims chosen so that every dimension expression has
 * its own value, loaded on the reference backend (whose PWAL changes nothing), and the
 * params its fused q/k/v linear layer and its MoE layer hold after fusion and normalisation
 * (every registered name: dtype, shape in N, K, G, S, E, H, I, state, alias) are rendered
 * as table rows. Each must equal the rows between the doc's markers
 * `<!-- params: SCHEME VARIANT KIND -->` and `<!-- end -->`, no more and no fewer.
 * With QKEEP_WRITE_SCHEMES=FILE set, the rows are written there instead (to draft the doc).
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "private.h"
#include "testutil.h"

/* H, I, G, E and the fused shards of q/k/v: every expression below has a distinct value. */
#define H 256   /* hidden: q, o, experts' K */
#define KV 64   /* k and v rows */
#define I 192   /* expert intermediate */
#define MLP 320 /* dense MLP intermediate */
#define E 5     /* experts */
#define G 64    /* int4 group */
#define VOCAB 100

static char *dir;
static qkeep_plugin *ref;
static FILE *draft;

static void add(struct st_writer *w, const char *name, int64_t rows, int64_t cols, uint64_t seed) {
  size_t n = (size_t)(rows * (cols ? cols : 1));
  float *v = malloc(n * sizeof *v);
  for (size_t i = 0; i < n; i++)
    v[i] = cols ? tu_randf(&seed) * 0.25f : 1.0f;
  struct qkeep_spec sp = {QKEEP_DTYPE_F32, cols ? 2 : 1, {rows, cols}};
  ck_assert_int_eq(st_writer_add(w, name, &sp, v), 0);
  free(v);
}

static char *write_source(void) {
  struct st_writer *w;
  char name[160];
  ck_assert_int_eq(st_writer_new(&w), 0);
  add(w, "model.embed_tokens.weight", VOCAB, H, 1);
  add(w, "model.norm.weight", H, 0, 2);
  add(w, "lm_head.weight", VOCAB, H, 3);
  static const char *const proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  for (int p = 0; p < 4; p++) {
    snprintf(name, sizeof name, "model.layers.0.self_attn.%s.weight", proj[p]);
    add(w, name, p == 1 || p == 2 ? KV : H, H, 10 + (uint64_t)p);
  }
  add(w, "model.layers.0.mlp.gate_proj.weight", MLP, H, 20);
  add(w, "model.layers.0.mlp.up_proj.weight", MLP, H, 21);
  add(w, "model.layers.0.mlp.down_proj.weight", H, MLP, 22);
  add(w, "model.layers.1.mlp.gate.weight", E, H, 30);
  for (int e = 0; e < E; e++) {
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.gate_proj.weight", e);
    add(w, name, I, H, 40 + (uint64_t)e);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.up_proj.weight", e);
    add(w, name, I, H, 50 + (uint64_t)e);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.down_proj.weight", e);
    add(w, name, H, I, 60 + (uint64_t)e);
  }
  char *path = tu_path(dir, "source.safetensors");
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  return path;
}

/* One scheme as the doc documents it. */
struct variant {
  const char *scheme, *name; /* name: the doc's word for the variant ("-" for none) */
  bool static_input, asym_input, asym_weights;
};

static const struct variant variants[] = {
    {"unquantized", "-", false, false, false},     {"modelopt-nvfp4", "-", false, false, false},
    {"ct-nvfp4", "-", false, false, false},        {"mxfp4", "-", false, false, false},
    {"w8a8-int8", "dynamic", false, false, false}, {"w8a8-int8", "static-asym", true, true, false},
    {"gptq-int4", "sym", false, false, false},     {"gptq-int4", "asym", false, false, true},
    {"awq-int4", "asym", false, false, true},      {"ct-int4", "sym", false, false, false},
    {"ct-int4", "asym", false, false, true},
};

/* A dimension as the doc writes it: the expression of the layer's dims that has this value. */
static const char *symbol(int64_t v, bool moe, int shards) {
  static const struct {
    int64_t value;
    const char *name;
    bool moe; /* false: for the linear layer (q/k/v: N = H + 2 KV, K = H) */
  } symbols[] = {
      {H + 2 * KV, "N", false},
      {(H + 2 * KV) / 8, "N/8", false},
      {H, "K", false},
      {H / 2, "K/2", false},
      {H / 8, "K/8", false},
      {H / 16, "K/16", false},
      {H / 32, "K/32", false},
      {H / G, "K/G", false},
      {2 * I, "2I", true},
      {I, "I", true},
      {2 * I / 8, "2I/8", true},
      {I / 2, "I/2", true},
      {I / 8, "I/8", true},
      {I / 16, "I/16", true},
      {I / 32, "I/32", true},
      {I / G, "I/G", true},
      {H, "H", true},
      {H / 2, "H/2", true},
      {H / 8, "H/8", true},
      {H / 16, "H/16", true},
      {H / 32, "H/32", true},
      {H / G, "H/G", true},
      {E, "E", true},
  };
  if (v == shards && shards > 1) /* q/k/v: 3; an MoE layer's w13: gate and up */
    return "S";
  if (v == 1)
    return "1";
  for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++)
    if (symbols[i].moe == moe && symbols[i].value == v)
      return symbols[i].name;
  static char number[32];
  snprintf(number, sizeof number, "%lld?", (long long)v); /* no expression: shows as a failure */
  return number;
}

struct rows {
  char **row;
  size_t n, cap;
  const qkeep_layer *layer;
  bool moe;
  int shards;
};

static int add_row(void *user, const char *name, bool is_buffer, const struct qkeep_view *v) {
  struct rows *r = user;
  char shape[128] = "[";
  size_t len = strlen(name);
  bool shape_pairs =
      len >= 12 && strcmp(name + len - 12, "weight_shape") == 0; /* ct-int4's [.., 2] = [N, K] */
  for (int d = 0; d < v->spec.ndim; d++)
    snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "%s%s", d ? ", " : "",
             shape_pairs && d == v->spec.ndim - 1 && v->spec.shape[d] == 2
                 ? "2"
                 : symbol(v->spec.shape[d], r->moe, r->shards));
  strcat(shape, "]");
  qkeep_param *p = is_buffer ? NULL : qkeep_param_lookup(r->layer, name);
  const char *origin = p ? qkeep_param_checkpoint_name(p) : NULL;
  char what[160];
  snprintf(what, sizeof what, "%s%s%s%s",
           is_buffer                      ? "buffer"
           : v->state == QKEEP_PARAM_LIVE ? "live"
                                          : "retired",
           origin && strcmp(origin, name) ? ", alias of `" : "", origin && strcmp(origin, name) ? origin : "",
           origin && strcmp(origin, name) ? "`" : "");
  char line[512];
  snprintf(line, sizeof line, "| `%s` | %s | %s | %s |", name, qkeep_dtype_name(v->spec.dtype), shape, what);
  if (r->n == r->cap) {
    r->cap = r->cap ? 2 * r->cap : 16;
    r->row = realloc(r->row, r->cap * sizeof *r->row);
  }
  r->row[r->n++] = strdup(line);
  return 0;
}

static int by_string(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The rows the doc holds between `<!-- params: KEY -->` and `<!-- end -->`, sorted. */
static struct rows doc_rows(const char *doc, const char *key) {
  struct rows r = {0};
  char marker[160];
  snprintf(marker, sizeof marker, "<!-- params: %s -->", key);
  const char *at = strstr(doc, marker);
  ck_assert_msg(at != NULL, "docs/SCHEMES.md has no section %s", marker);
  at += strlen(marker);
  const char *end = strstr(at, "<!-- end -->");
  ck_assert_ptr_nonnull(end);
  while (at < end) {
    const char *nl = memchr(at, '\n', (size_t)(end - at));
    size_t len = nl ? (size_t)(nl - at) : (size_t)(end - at);
    if (len && at[0] == '|' && strncmp(at, "| param", 7) != 0 && strncmp(at, "|---", 4) != 0) {
      if (r.n == r.cap) {
        r.cap = r.cap ? 2 * r.cap : 16;
        r.row = realloc(r.row, r.cap * sizeof *r.row);
      }
      r.row[r.n++] = strndup(at, len);
    }
    at += len + 1;
  }
  qsort(r.row, r.n, sizeof *r.row, by_string);
  return r;
}

static void free_rows(struct rows *r) {
  for (size_t i = 0; i < r->n; i++)
    free(r->row[i]);
  free(r->row);
}

static void check_layer(const char *doc, const struct variant *v, qkeep_model *m, const char *layer_name,
                        const char *kind) {
  qkeep_layer *layer = qkeep_model_find_layer(m, layer_name);
  ck_assert_ptr_nonnull(layer);
  struct qkeep_layer_info info = {.size = sizeof info};
  ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
  struct rows got = {.layer = layer, .moe = info.kind == QKEEP_LAYER_MOE, .shards = info.shards};
  ck_assert_int_eq(qkeep_foreach_name(layer, add_row, &got), 0);
  qsort(got.row, got.n, sizeof *got.row, by_string);
  char key[128];
  snprintf(key, sizeof key, "%s %s %s", v->scheme, v->name, kind);
  if (draft) {
    fprintf(draft, "<!-- params: %s -->\n| param | dtype | shape | state |\n|---|---|---|---|\n", key);
    for (size_t i = 0; i < got.n; i++)
      fprintf(draft, "%s\n", got.row[i]);
    fprintf(draft, "<!-- end -->\n\n");
  } else {
    struct rows want = doc_rows(doc, key);
    for (size_t i = 0; i < got.n || i < want.n; i++)
      ck_assert_msg(i < got.n && i < want.n && strcmp(got.row[i], want.row[i]) == 0,
                    "%s: the model has %s, docs/SCHEMES.md says %s", key,
                    i < got.n ? got.row[i] : "(nothing)", i < want.n ? want.row[i] : "(nothing)");
    free_rows(&want);
  }
  free_rows(&got);
}

START_TEST(schemes_md_lists_what_a_backend_receives) {
  char *docs = tu_path(tu_srcdir(), "docs"), *path = tu_path(docs, "SCHEMES.md");
  size_t n = 0;
  char *doc = draft ? NULL : tu_read_file(path, &n);
  ck_assert_msg(draft || doc, "cannot read %s", path);
  if (doc)
    doc = realloc(doc, n + 1), doc[n] = 0;
  char *source = write_source();
  for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
    const struct variant *v = &variants[i];
    char out[96];
    snprintf(out, sizeof out, "q-%zu", i);
    char *q = strcmp(v->scheme, "unquantized") ? tu_path(dir, out) : strdup(source);
    if (strcmp(v->scheme, "unquantized")) {
      struct qkeep_quantize_options o = {.size = sizeof o,
                                         .scheme = v->scheme,
                                         .group_size = G,
                                         .static_input = v->static_input,
                                         .asym_input = v->asym_input,
                                         .asym_weights = v->asym_weights,
                                         .kv_cache_scales = true,
                                         .activation_amax = 4};
      ck_assert_msg(qkeep_quantize(source, q, &o) == 0, "%s: %s", v->scheme, qkeep_errmsg());
    }
    qkeep_model *m;
    ck_assert_int_eq(qkeep_model_new(ref, &m), 0);
    ck_assert_msg(qkeep_model_load(m, q) == 0, "%s: %s", q, qkeep_errmsg());
    check_layer(doc, v, m, "model.layers.0.self_attn.qkv_proj", "linear");
    check_layer(doc, v, m, "model.layers.1.mlp.experts", "moe");
    if (strcmp(v->scheme, "modelopt-nvfp4") == 0)
      check_layer(doc, v, m, "model.layers.0.self_attn.attn", "kv-scales");
    qkeep_model_free(m);
    free(q);
  }
  free(source);
  free(doc);
  free(path);
  free(docs);
}
END_TEST

static void setup(void) {
  dir = tu_tmpdir("docs");
  ck_assert_int_eq(qkeep_plugin_open("reference", NULL, &ref), 0);
}

static void teardown(void) {
  qkeep_plugin_close(ref);
  tu_rmtree(dir);
  free(dir);
}

int main(void) {
  const char *write = getenv("QKEEP_WRITE_SCHEMES");
  if (write && !(draft = fopen(write, "w")))
    return 1;
  Suite *s = suite_create("docs");
  TCase *tc = tcase_create("schemes");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, schemes_md_lists_what_a_backend_receives);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_set_fork_status(sr, draft ? CK_NOFORK : CK_FORK);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  if (draft)
    fclose(draft);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
