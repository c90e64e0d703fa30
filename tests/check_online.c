/*
 * check_online.c: online quantization (qkeep_model_set_quantize). The oracle is the offline path:
 * qkeep_quantize with the same options into a directory, then a cold start of it.
 *
 *   - Every scheme qkeep quantize writes, on every CPU chain that runs it (the configured default,
 *     reference alone, cpu-onednn and cpu-zentorch where they take the scheme): an online load of
 *     examples/tiny equals quantize-then-load: digest, census (all but the new class), every
 *     registered tensor of every layer byte for byte, and each layer's backend.
 *   - F32 and F16 sources, and a source sharded over two files with an index, equally.
 *   - Every unquantized checkpoint name resolves (state QKEEP_PARAM_QUANTIZED for those quantized),
 *     and the census counts them in their own class, with no rule broken.
 *   - Reload W0 -> W1 (examples/tiny-w1) equals a cold online start on W1, with every storage's
 *     address unchanged; a sync of the bf16 buckets qkeep_sync_plan plans equals it too.
 *   - Tensor parallel: each rank of TP = 2 equals that rank of the offline output.
 *   - A NaN or an Inf in the source is refused before anything changes (the digest stays); a direct
 *     load of one member of a fusion group is refused naming the group; of a lone weight it equals
 *     the cold start's layer.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../bench/synth_nvfp4.h"
#include "checkutil.h"
#include "online_testutil.h"
#include "private.h"
#include "testutil.h"

static const char *const schemes[] = {"modelopt-nvfp4", "ct-nvfp4",  "mxfp4",
                                      "w8a8-int8",      "gptq-int4", "awq-int4"};
#define N_SCHEMES (sizeof schemes / sizeof schemes[0])

/* A chain of backends by name; *n gets how many opened (a backend not built is left out). */
static void open_chain(const char *const *names, size_t count, qkeep_plugin **out, size_t *n) {
  *n = 0;
  for (size_t i = 0; i < count; i++)
    if (qkeep_plugin_open(names[i], NULL, &out[*n]) == 0)
      (*n)++;
}

static void close_chain(qkeep_plugin **p, size_t n) {
  for (size_t i = 0; i < n; i++)
    qkeep_plugin_close(p[i]);
}

/* The configured default chain (conf/qkeep.ini of the build tree). */
static int open_default(qkeep_plugin ***plugins, size_t *n) {
  char *conf = tu_path(tu_builddir(), "conf/qkeep.ini");
  qkeep_config *cfg;
  ck_assert_msg(qkeep_config_load(conf, &cfg) == 0, "%s", qkeep_errmsg());
  int rc = qkeep_plugins_open_config(cfg, plugins, n);
  ck_assert_msg(rc == 0, "%s", qkeep_errmsg());
  qkeep_config_free(cfg);
  free(conf);
  return rc;
}

static qkeep_model *load_model(qkeep_plugin *const *chain, size_t n, const char *path,
                               const struct qkeep_quantize_options *online, int tp, int rank) {
  qkeep_model *m;
  ck_assert_msg(qkeep_model_new_chain(chain, n, &m) == 0, "%s", qkeep_errmsg());
  if (tp > 1) {
    struct qkeep_parallel p = {.size = sizeof p, .tp_size = tp, .tp_rank = rank};
    ck_assert_int_eq(qkeep_model_set_parallel(m, &p), 0);
  }
  if (online)
    ck_assert_msg(qkeep_model_set_quantize(m, online) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

static struct qkeep_digest digest_of(const qkeep_model *m) {
  struct qkeep_digest d;
  ck_assert_msg(qkeep_digest(m, &d) == 0, "%s", qkeep_errmsg());
  return d;
}

static bool same_digest(struct qkeep_digest a, struct qkeep_digest b) { return a.hi == b.hi && a.lo == b.lo; }

/* Every registered tensor of layer a, byte for byte in layer b (host memory: CPU backends). */
struct compare_ctx {
  const qkeep_layer *other;
  const char *layer;
  int compared;
};

static int compare_name(void *user, const char *name, bool is_buffer, const struct qkeep_view *v) {
  struct compare_ctx *c = user;
  struct qkeep_view w = {.size = sizeof w};
  ck_assert_msg(qkeep_view_of(c->other, name, &w) == 0, "%s.%s missing offline", c->layer, name);
  ck_assert_msg(v->nbytes == w.nbytes && v->spec.dtype == w.spec.dtype && v->spec.ndim == w.spec.ndim,
                "%s.%s (%s): %zu bytes online, %zu offline", c->layer, name, is_buffer ? "buffer" : "param",
                v->nbytes, w.nbytes);
  ck_assert_msg(v->nbytes == 0 || memcmp(v->data, w.data, v->nbytes) == 0, "%s.%s: bytes differ", c->layer,
                name);
  c->compared++;
  return 0;
}

/* online: loaded with quantize options; oracle: the model it must equal (offline_oracle: a cold start
 * of qkeep_quantize's output, which has no param quantized on load; else an online model too). */
static void assert_same(const qkeep_model *online, const qkeep_model *oracle, bool offline_oracle,
                        const char *what) {
  size_t n = qkeep_model_layer_count(online);
  ck_assert_uint_eq(n, qkeep_model_layer_count(oracle));
  for (size_t l = 0; l < n; l++) {
    qkeep_layer *x = qkeep_model_layer(online, l), *y = qkeep_model_layer(oracle, l);
    struct qkeep_layer_info ix = {.size = sizeof ix}, iy = {.size = sizeof iy};
    qkeep_layer_get_info(x, &ix), qkeep_layer_get_info(y, &iy);
    ck_assert_str_eq(ix.name, iy.name);
    ck_assert_str_eq(ix.scheme, iy.scheme);
    const char *bx = qkeep_layer_backend(x), *by = qkeep_layer_backend(y);
    ck_assert_msg((!bx && !by) || (bx && by && strcmp(bx, by) == 0), "%s: %s: backends differ", what,
                  ix.name);
    struct compare_ctx c = {y, ix.name, 0};
    ck_assert_int_eq(qkeep_foreach_name(x, compare_name, &c), 0);
  }
  ck_assert_msg(same_digest(digest_of(online), digest_of(oracle)), "%s: digests differ", what);
  struct qkeep_census a = {.size = sizeof a}, b = {.size = sizeof b};
  ck_assert_int_eq(qkeep_census(online, &a), 0);
  ck_assert_int_eq(qkeep_census(oracle, &b), 0);
  ck_assert_msg(a.quantized_on_load > 0 && a.quantized_on_load_bytes > 0 &&
                    (offline_oracle ? b.quantized_on_load == 0 : b.quantized_on_load == a.quantized_on_load),
                "%s: quantized on load %lld online, %lld in the oracle", what, (long long)a.quantized_on_load,
                (long long)b.quantized_on_load);
  if (offline_oracle)
    a.quantized_on_load = a.quantized_on_load_bytes = 0;
  for (int i = 0; i < a.reasons; i++)
    a.reason[i] = b.reason[i]; /* borrowed strings of each model */
  ck_assert_msg(memcmp(&a, &b, sizeof a) == 0, "%s: census differs", what);
  ck_assert_int_eq(a.missing, 0);
  ck_assert_int_eq(a.c1, 0);
  ck_assert_int_eq(a.c2, 0);
}

static void assert_same_model(const qkeep_model *online, const qkeep_model *offline, const char *what) {
  assert_same(online, offline, true, what);
}

/* qkeep_quantize of `in` with opts into a fresh directory (the caller frees and removes it). */
static char *quantize_to_dir(const char *in, const struct qkeep_quantize_options *opts) {
  char *tmp = tu_tmpdir("online");
  char *out = tu_path(tmp, opts->scheme);
  ck_assert_msg(qkeep_quantize(in, out, opts) == 0, "%s", qkeep_errmsg());
  free(tmp);
  return out;
}

static void remove_dir(char *out) {
  char *slash = strrchr(out, '/');
  *slash = '\0';
  tu_rmtree(out);
  free(out);
}

/* Whether a layer of `scheme` in m runs on the backend `name`. */
static bool runs_scheme_on(const qkeep_model *m, const char *name, const char *scheme) {
  for (size_t l = 0; l < qkeep_model_layer_count(m); l++) {
    qkeep_layer *layer = qkeep_model_layer(m, l);
    struct qkeep_layer_info info = {.size = sizeof info};
    ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
    const char *backend = qkeep_layer_backend(layer);
    if (backend && strcmp(backend, name) == 0 && strcmp(info.scheme, scheme) == 0)
      return true;
  }
  return false;
}

/*
 * Online against offline for every scheme on one chain; schemes no backend of it takes are skipped. Returns
 * how many schemes the chain loads. With `front_only`, under a memory checker (valgrind, ASan) a scheme whose
 * layers the chain's first backend leaves to the next is loaded but not compared: the online load would run
 * the reference's code, which the chain of the reference alone compares (plain make check compares it here).
 */
static int compare_on_chain(qkeep_plugin *const *chain, size_t n, const char *label, bool front_only) {
  char *tiny = example("tiny");
  int loaded = 0;
  for (size_t s = 0; s < N_SCHEMES; s++) {
    struct qkeep_quantize_options o = options_for(schemes[s]);
    char *offline_dir = quantize_to_dir(tiny, &o);
    qkeep_model *offline;
    ck_assert_int_eq(qkeep_model_new_chain(chain, n, &offline), 0);
    if (qkeep_model_load(offline, offline_dir) != 0) { /* the chain does not run this scheme */
      qkeep_model_free(offline);
      remove_dir(offline_dir);
      continue;
    }
    loaded++;
    if (front_only && tu_under_memcheck() &&
        !runs_scheme_on(offline, qkeep_plugin_name(chain[0]), schemes[s])) {
      qkeep_model_free(offline);
      remove_dir(offline_dir);
      continue;
    }
    qkeep_model *online = load_model(chain, n, tiny, &o, 1, 0);
    char what[160];
    snprintf(what, sizeof what, "%s on %s", schemes[s], label);
    assert_same_model(online, offline, what);
    qkeep_model_free(online);
    qkeep_model_free(offline);
    remove_dir(offline_dir);
  }
  free(tiny);
  return loaded;
}

START_TEST(every_scheme_online_equals_quantize_then_load_on_the_default_chain) {
  qkeep_plugin **chain;
  size_t n;
  open_default(&chain, &n);
  ck_assert_int_eq(compare_on_chain(chain, n, "the default chain", false), (int)N_SCHEMES);
  qkeep_plugins_close(chain, n);
}
END_TEST

START_TEST(every_scheme_online_equals_quantize_then_load_on_reference_and_cpu_chains) {
  static const char *const chains[][2] = {
      {"reference", NULL}, {"cpu-onednn", "reference"}, {"cpu-zentorch", "reference"}};
  for (size_t c = 0; c < 3; c++) {
    qkeep_plugin *chain[2];
    size_t n;
    open_chain(chains[c], chains[c][1] ? 2 : 1, chain, &n);
    if (n == 0)
      continue; /* not built */
    int loaded = compare_on_chain(chain, n, chains[c][0], c > 0);
    ck_assert_int_eq(loaded, (int)N_SCHEMES); /* reference runs every scheme at the end of each chain */
    close_chain(chain, n);
  }
}
END_TEST

/* The GPU benches' synthetic models (bench/synth_nvfp4.h), cut small, with the vocabulary below the
 * largest linear as bench_forward lowers it (the writer's scratch was once sized by the embeddings
 * alone, and bench_forward overran it): the bf16 model loads online as quantize-then-load, and the
 * NVFP4 model loads cold with every linear the writer wrote. */
START_TEST(the_benches_synthetic_models_load_and_their_bf16_form_loads_online_as_its_twin) {
  const struct shape small[] = {
      {"llama-small", 128, 128, 32, 384, 0, 0, 8, 2, false},
      {"qwen-moe-small", 64, 128, 32, 0, 4, 96, 8, 2, true},
  };
  qkeep_plugin *ref;
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &ref) == 0, "%s", qkeep_errmsg());
  struct qkeep_quantize_options o = options_for("modelopt-nvfp4");
  for (size_t i = 0; i < sizeof small / sizeof small[0]; i++) {
    char *tmp = tu_tmpdir("online-synth"), *bf16 = tu_path(tmp, "bf16"), *fp4 = tu_path(tmp, "nvfp4");
    ck_assert_int_eq(mkdir(bf16, 0755), 0);
    ck_assert_int_eq(mkdir(fp4, 0755), 0);
    ck_assert_msg(write_checkpoint(&small[i], bf16, 5, true) == 0, "%s", qkeep_errmsg());
    ck_assert_msg(write_model(&small[i], fp4, 5) == 0, "%s", qkeep_errmsg());
    qkeep_model *online = load_model(&ref, 1, bf16, &o, 1, 0);
    char *twin_dir = quantize_to_dir(bf16, &o);
    qkeep_model *twin = load_model(&ref, 1, twin_dir, NULL, 1, 0);
    assert_same_model(online, twin, small[i].name);
    qkeep_model *cold = load_model(&ref, 1, fp4, NULL, 1, 0);
    struct qkeep_census c = {.size = sizeof c};
    ck_assert_int_eq(qkeep_census(cold, &c), 0);
    ck_assert_msg(c.missing == 0, "%s: %lld tensors missing", small[i].name, (long long)c.missing);
    ck_assert_uint_eq(qkeep_model_layer_count(cold), qkeep_model_layer_count(twin));
    qkeep_model_free(cold);
    qkeep_model_free(twin);
    qkeep_model_free(online);
    remove_dir(twin_dir);
    tu_rmtree(tmp);
    free(tmp), free(bf16), free(fp4);
  }
  qkeep_plugin_close(ref);
}
END_TEST

START_TEST(every_unquantized_name_resolves_and_keeps_no_bytes) {
  qkeep_plugin *ref;
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &ref) == 0, "%s", qkeep_errmsg());
  char *tiny = example("tiny");
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(tiny, &ck), 0);
  for (size_t s = 0; s < N_SCHEMES; s++) {
    struct qkeep_quantize_options o = options_for(schemes[s]);
    qkeep_model *m = load_model(&ref, 1, tiny, &o, 1, 0);
    int64_t quantized = 0, bytes = 0;
    for (size_t i = 0; i < ck->n_tensors; i++) {
      qkeep_layer *layer = NULL;
      qkeep_param *p = qkeep_model_lookup(m, ck->tensors[i].t->name, &layer);
      ck_assert_msg(p && layer, "%s: '%s' does not resolve", schemes[s], ck->tensors[i].t->name);
      if (qkeep_param_state(p) == QKEEP_PARAM_QUANTIZED) {
        struct qkeep_view v = {.size = sizeof v};
        ck_assert_int_eq(qkeep_param_view(p, &v), 0);
        ck_assert_uint_eq(v.nbytes, 0);
        ck_assert_uint_eq(v.capacity, 0);
        ck_assert_str_eq(qkeep_param_checkpoint_name(p), ck->tensors[i].t->name);
        quantized++;
        bytes += (int64_t)ck->tensors[i].t->nbytes;
      }
    }
    struct qkeep_census c = {.size = sizeof c};
    ck_assert_int_eq(qkeep_census(m, &c), 0);
    /* every linear but the lm_head: 3 layers x 7, plus 3 more per expert beyond the first MLP's */
    ck_assert_int_eq(quantized, 3 * 4 + 2 * 3 + 4 * 3);
    ck_assert_int_eq(c.quantized_on_load, quantized);
    ck_assert_int_eq(c.quantized_on_load_bytes, bytes);
    ck_assert_int_eq(c.missing + c.c1 + c.c2 + c.released, 0);
    qkeep_model_free(m);
  }
  ckpt_close(ck);
  free(tiny);
  qkeep_plugin_close(ref);
}
END_TEST

START_TEST(reload_w0_to_w1_equals_a_cold_online_w1_and_moves_no_pointer) {
  qkeep_plugin **chain;
  size_t n;
  open_default(&chain, &n);
  char *tiny = example("tiny"), *w1 = example("tiny-w1");
  for (size_t s = 0; s < N_SCHEMES; s++) {
    struct qkeep_quantize_options o = options_for(schemes[s]);
    qkeep_model *m = load_model(chain, n, tiny, &o, 1, 0), *cold = load_model(chain, n, w1, &o, 1, 0);
    struct addresses *before = calloc(1, sizeof *before), *after = calloc(1, sizeof *after);
    ck_assert_int_eq(qkeep_foreach_storage(m, note_address, before), 0);
    ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s: %s", schemes[s], qkeep_errmsg());
    ck_assert_int_eq(qkeep_foreach_storage(m, note_address, after), 0);
    ck_assert_uint_eq(before->n, after->n);
    ck_assert_msg(memcmp(before->at, after->at, before->n * sizeof *before->at) == 0, "%s: a pointer moved",
                  schemes[s]);
    assert_same(m, cold, false, schemes[s]);
    /* and back: W0 again equals the cold W0 (not under a memory checker: the same reload again, with the
     * other weights; plain make check runs it) */
    if (!tu_under_memcheck()) {
      ck_assert_msg(qkeep_model_reload(m, tiny, 0) == 0, "%s", qkeep_errmsg());
      qkeep_model *cold0 = load_model(chain, n, tiny, &o, 1, 0);
      ck_assert(same_digest(digest_of(m), digest_of(cold0)));
      qkeep_model_free(cold0);
    }
    free(before), free(after);
    qkeep_model_free(cold);
    qkeep_model_free(m);
  }
  free(tiny), free(w1);
  qkeep_plugins_close(chain, n);
}
END_TEST

START_TEST(tensor_parallel_ranks_equal_the_ranks_of_the_offline_output) {
  qkeep_plugin *ref;
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &ref) == 0, "%s", qkeep_errmsg());
  char *tiny = example("tiny");
  for (size_t s = 0; s < N_SCHEMES; s++) {
    struct qkeep_quantize_options o = options_for(schemes[s]);
    o.group_size = 64; /* K / 2 = 128 per rank of a row-parallel layer: whole groups on each */
    char *offline_dir = quantize_to_dir(tiny, &o);
    for (int rank = 0; rank < 2; rank++) {
      qkeep_model *online = load_model(&ref, 1, tiny, &o, 2, rank);
      qkeep_model *offline = load_model(&ref, 1, offline_dir, NULL, 2, rank);
      assert_same_model(online, offline, schemes[s]);
      qkeep_model_free(online);
      qkeep_model_free(offline);
    }
    remove_dir(offline_dir);
  }
  free(tiny);
  qkeep_plugin_close(ref);
}
END_TEST

START_TEST(a_sync_of_bf16_buckets_equals_a_cold_online_w1) {
  qkeep_plugin **chain;
  size_t n;
  open_default(&chain, &n);
  char *tiny = example("tiny"), *w1 = example("tiny-w1");
  for (size_t s = 0; s < N_SCHEMES; s++) {
    struct qkeep_quantize_options o = options_for(schemes[s]);
    qkeep_model *m = load_model(chain, n, tiny, &o, 1, 0), *cold = load_model(chain, n, w1, &o, 1, 0);
    struct qkeep_sync_entry *e;
    size_t entries, buckets;
    ck_assert_int_eq(qkeep_sync_plan(m, 1 << 20, &e, &entries, &buckets), 0);
    bool bf16 = false;
    for (size_t i = 0; i < entries; i++)
      bf16 |= strcmp(e[i].tensor.name, "model.layers.0.self_attn.q_proj.weight") == 0 &&
              e[i].tensor.spec.dtype == QKEEP_DTYPE_BF16;
    ck_assert_msg(bf16, "%s: the plan has no bf16 q_proj", schemes[s]);
    qkeep_sync_plan_free(e);
    /* 300 KiB buckets: layers larger than a bucket wait for their rest */
    ck_assert_msg(sync_from_buckets(m, w1, 300 << 10, NULL) == 0, "%s: %s", schemes[s], qkeep_errmsg());
    assert_same(m, cold, false, schemes[s]);
    qkeep_model_free(cold);
    qkeep_model_free(m);
  }
  free(tiny), free(w1);
  qkeep_plugins_close(chain, n);
}
END_TEST

/* tiny-w1 with `bits` at element 5 of `tensor`, as one file (its path; the caller removes its directory). */
static char *w1_with(const char *tensor, uint16_t bits) {
  return example_as("tiny-w1", QKEEP_DTYPE_BF16, tensor, 5, bits, true);
}

START_TEST(nan_or_inf_in_the_source_is_refused_before_anything_changes) {
  qkeep_plugin **chain;
  size_t n;
  open_default(&chain, &n);
  char *tiny = example("tiny");
  static const uint16_t bad[] = {0x7fc0, 0x7f80, 0xff80}; /* NaN, +Inf, -Inf */
  static const char *const where[] = {"model.layers.2.self_attn.v_proj.weight",
                                      "model.layers.2.mlp.experts.3.up_proj.weight",
                                      "model.layers.1.mlp.down_proj.weight"};
  for (size_t s = 0; s < N_SCHEMES; s++) {
    struct qkeep_quantize_options o = options_for(schemes[s]);
    qkeep_model *m = load_model(chain, n, tiny, &o, 1, 0);
    struct qkeep_digest d0 = digest_of(m);
    for (int b = 0; b < 3; b++) {
      char *path = w1_with(where[b], bad[b]);
      ck_assert_int_eq(qkeep_model_reload(m, path, 0), QKEEP_E_FORMAT);
      ck_assert_msg(strstr(qkeep_errmsg(), where[b]) && strstr(qkeep_errmsg(), "element 5"), "%s",
                    qkeep_errmsg());
      ck_assert(same_digest(d0, digest_of(m)));
      /* and from buffers: the same refusal */
      struct ckpt *ck;
      ck_assert_int_eq(ckpt_open(path, &ck), 0);
      const struct ckpt_tensor *t = ckpt_find(ck, where[b]);
      void *data = malloc(t->t->nbytes);
      ck_assert_int_eq(ckpt_read(ck, t, data), 0);
      struct qkeep_named_tensor nt = {
          where[b], {QKEEP_DTYPE_BF16, 2, {t->t->shape[0], t->t->shape[1]}}, data, false};
      ck_assert_int_ne(qkeep_model_reload_tensors(m, &nt, 1, QKEEP_RELOAD_PARTIAL), 0);
      ck_assert(same_digest(d0, digest_of(m)));
      free(data);
      ckpt_close(ck);
      char *slash = strrchr(path, '/');
      *slash = '\0';
      tu_rmtree(path);
      free(path);
    }
    qkeep_model_free(m);
  }
  free(tiny);
  qkeep_plugins_close(chain, n);
}
END_TEST

/* A one-layer MLP of bf16 weights large enough that a reload's check reads each in several 8 MiB pieces
 * (2048 x 3072: 12 MiB), with NaNs at the given elements of gate_proj and up_proj (SIZE_MAX: none). */
static char *big_mlp(const char *dir, const char *name, size_t gate_nan, size_t up_nan) {
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  static const char *const proj[] = {"gate_proj", "up_proj", "down_proj"};
  const size_t nan_at[] = {gate_nan, up_nan, SIZE_MAX};
  const int64_t rows = 3072, cols = 2048;
  uint16_t *v = malloc((size_t)(rows * cols) * 2);
  uint64_t seed = 5;
  for (int p = 0; p < 3; p++) {
    for (size_t i = 0; i < (size_t)(rows * cols); i++)
      v[i] = qkeep_f32_to_bf16(tu_randf(&seed) * 0.05f);
    if (nan_at[p] != SIZE_MAX)
      v[nan_at[p]] = 0x7fc0;
    char t[96];
    snprintf(t, sizeof t, "model.layers.0.mlp.%s.weight", proj[p]);
    struct qkeep_spec spec = {
        .dtype = QKEEP_DTYPE_BF16, .ndim = 2, .shape = {p < 2 ? rows : cols, p < 2 ? cols : rows}};
    ck_assert_int_eq(st_writer_add(w, t, &spec, v), 0);
  }
  char *path = tu_path(dir, name);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  free(v);
  return path;
}

/* A reload's check reads large weights in pieces on several threads: a NaN deep in the second piece of
 * a weight is found and named, and with NaNs in two weights the first of them (in the layer's order) is
 * the one named, as a check tensor by tensor names it; W0 is kept each time. */
START_TEST(a_nan_deep_in_a_large_weight_is_found_by_the_threaded_check) {
  qkeep_plugin **chain;
  size_t n;
  open_default(&chain, &n);
  char *dir = tu_tmpdir("online-big");
  char *w0 = big_mlp(dir, "w0.safetensors", SIZE_MAX, SIZE_MAX);
  size_t deep = ((size_t)8 << 20) / 2 + 12345; /* an element in the second 8 MiB piece */
  char *up_bad = big_mlp(dir, "up.safetensors", SIZE_MAX, deep);
  char *both_bad = big_mlp(dir, "both.safetensors", 3 * 2048 + 7, 100);
  struct qkeep_quantize_options o = options_for("w8a8-int8");
  qkeep_model *m = load_model(chain, n, w0, &o, 1, 0);
  struct qkeep_digest d0 = digest_of(m);
  char where[64];
  snprintf(where, sizeof where, "element %zu ", deep);
  ck_assert_int_eq(qkeep_model_reload(m, up_bad, 0), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), "mlp.up_proj.weight") && strstr(qkeep_errmsg(), where), "%s",
                qkeep_errmsg());
  ck_assert(same_digest(d0, digest_of(m)));
  ck_assert_int_eq(qkeep_model_reload(m, both_bad, 0), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), "mlp.gate_proj.weight") && strstr(qkeep_errmsg(), "element 6151 "),
                "%s", qkeep_errmsg());
  ck_assert(same_digest(d0, digest_of(m)));
  ck_assert_int_eq(qkeep_model_reload(m, w0, 0), 0);
  ck_assert(same_digest(d0, digest_of(m)));
  qkeep_model_free(m);
  tu_rmtree(dir);
  free(dir), free(w0), free(up_bad), free(both_bad);
  qkeep_plugins_close(chain, n);
}
END_TEST

/* Every registered tensor of a model (every layer's names): its address and bytes. */
struct snapshot {
  size_t n, cap;
  struct {
    char *name;
    const void *data;
    void *bytes;
    size_t nbytes;
  } * t;
};

static int snap_name(void *user, const char *name, bool is_buffer, const struct qkeep_view *v) {
  (void)is_buffer;
  struct snapshot *s = user;
  if (s->n == s->cap) {
    s->cap = s->cap ? 2 * s->cap : 64;
    s->t = realloc(s->t, s->cap * sizeof *s->t);
    ck_assert_ptr_nonnull(s->t);
  }
  s->t[s->n].name = strdup(name);
  s->t[s->n].data = v->data;
  s->t[s->n].nbytes = v->nbytes;
  s->t[s->n].bytes = malloc(v->nbytes ? v->nbytes : 1);
  memcpy(s->t[s->n].bytes, v->data, v->nbytes);
  s->n++;
  return 0;
}

static void snapshot_take(const qkeep_model *m, struct snapshot *s) {
  *s = (struct snapshot){0};
  for (size_t l = 0; l < qkeep_model_layer_count(m); l++)
    ck_assert_int_eq(qkeep_foreach_name(qkeep_model_layer(m, l), snap_name, s), 0);
}

static void snapshot_free(struct snapshot *s) {
  for (size_t i = 0; i < s->n; i++)
    free(s->t[i].name), free(s->t[i].bytes);
  free(s->t);
}

/* The same tensors at the same addresses with the same bytes. */
static void assert_unchanged(const struct snapshot *a, const struct snapshot *b, const char *what) {
  ck_assert_uint_eq(a->n, b->n);
  for (size_t i = 0; i < a->n; i++) {
    ck_assert_str_eq(a->t[i].name, b->t[i].name);
    ck_assert_msg(a->t[i].data == b->t[i].data, "%s: %s moved", what, a->t[i].name);
    ck_assert_msg(a->t[i].nbytes == b->t[i].nbytes &&
                      memcmp(a->t[i].bytes, b->t[i].bytes, a->t[i].nbytes) == 0,
                  "%s: %s changed", what, a->t[i].name);
  }
}

/* The unquantized tensor whose unit a load quantizes last: the last member of the last unit of the last
 * layer that quantizes on load. */
static const char *last_quantized(const qkeep_model *m) {
  for (size_t l = m->n_layers; l-- > 0;) {
    const qkeep_layer *layer = m->layers[l];
    if (!layer->n_derived)
      continue;
    const struct derived *d = &layer->derived[layer->n_derived - 1];
    ck_assert(d->unit != SIZE_MAX);
    int members = quant_plan_members(m->online.plan, d->unit);
    return layer->sources[d->members[members - 1]].checkpoint_name;
  }
  ck_abort_msg("no layer quantizes on load");
  return NULL;
}

/* Every tensor of a checkpoint as named host buffers (the caller frees the data and the array). */
static struct qkeep_named_tensor *buffers_of(const char *path, size_t *n) {
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(path, &ck), 0);
  struct qkeep_named_tensor *ts = calloc(ck->n_tensors, sizeof *ts);
  for (size_t i = 0; i < ck->n_tensors; i++) {
    const struct st_tensor *t = ck->tensors[i].t;
    void *data = malloc(t->nbytes ? t->nbytes : 1);
    ck_assert_int_eq(ckpt_read(ck, &ck->tensors[i], data), 0);
    struct qkeep_spec spec = {.dtype = (enum qkeep_dtype)t->dtype, .ndim = t->ndim};
    memcpy(spec.shape, t->shape, sizeof spec.shape);
    ts[i] = (struct qkeep_named_tensor){strdup(t->name), spec, data, false};
  }
  *n = ck->n_tensors;
  ckpt_close(ck);
  return ts;
}

static void buffers_free(struct qkeep_named_tensor *ts, size_t n) {
  for (size_t i = 0; i < n; i++)
    free((char *)ts[i].name), free((void *)ts[i].data);
  free(ts);
}

START_TEST(a_nan_in_the_last_quantized_tensor_of_w1_leaves_every_kernel_tensor_of_w0) {
  qkeep_plugin **chain;
  size_t n;
  open_default(&chain, &n);
  char *tiny = example("tiny");
  for (size_t s = 0; s < N_SCHEMES; s++) {
    struct qkeep_quantize_options o = options_for(schemes[s]);
    char *offline_dir = quantize_to_dir(tiny, &o);
    qkeep_model *m = load_model(chain, n, tiny, &o, 1, 0),
                *offline = load_model(chain, n, offline_dir, NULL, 1, 0);
    const char *last = last_quantized(m);
    char *path = w1_with(last, 0x7fc0);
    struct snapshot before, after;
    snapshot_take(m, &before);
    /* from the file, and from buffers holding every tensor of it (a full reload) */
    for (int from = 0; from < 2; from++) {
      int rc;
      if (from == 0) {
        rc = qkeep_model_reload(m, path, 0);
      } else {
        size_t count;
        struct qkeep_named_tensor *ts = buffers_of(path, &count);
        rc = qkeep_model_reload_tensors(m, ts, count, 0);
        buffers_free(ts, count);
      }
      ck_assert_msg(rc != 0, "%s: a NaN in %s was taken", schemes[s], last);
      ck_assert_msg(strstr(qkeep_errmsg(), last) && strstr(qkeep_errmsg(), "NaN"), "%s: %s", schemes[s],
                    qkeep_errmsg());
      snapshot_take(m, &after);
      assert_unchanged(&before, &after, schemes[s]);
      snapshot_free(&after);
      assert_same_model(m, offline, schemes[s]); /* still W0 as quantize-then-load gives it */
    }
    snapshot_free(&before);
    char *slash = strrchr(path, '/');
    *slash = '\0';
    tu_rmtree(path);
    free(path);
    qkeep_model_free(offline);
    qkeep_model_free(m);
    remove_dir(offline_dir);
  }
  free(tiny);
  qkeep_plugins_close(chain, n);
}
END_TEST

/* A cold start quantizes the next unit while one lands, into the next layer too: a NaN there is reported at
 * its turn, naming it, and the model is left empty. */
START_TEST(a_nan_in_a_unit_read_ahead_fails_the_cold_start_naming_it) {
  qkeep_plugin **chain;
  size_t n;
  open_default(&chain, &n);
  char *tiny = example("tiny");
  /* the first unit of a layer after one that quantizes on load (read while that one lands), and the last */
  static const char *const where[] = {"model.layers.1.self_attn.q_proj.weight",
                                      "model.layers.2.mlp.experts.3.down_proj.weight"};
  for (size_t s = 0; s < N_SCHEMES; s++) {
    struct qkeep_quantize_options o = options_for(schemes[s]);
    for (int b = 0; b < 2; b++) {
      char *path = w1_with(where[b], 0x7f80);
      qkeep_model *m;
      ck_assert_int_eq(qkeep_model_new_chain(chain, n, &m), 0);
      ck_assert_int_eq(qkeep_model_set_quantize(m, &o), 0);
      ck_assert_int_ne(qkeep_model_load(m, path), 0);
      ck_assert_msg(strstr(qkeep_errmsg(), where[b]) && strstr(qkeep_errmsg(), "element 5"), "%s: %s",
                    schemes[s], qkeep_errmsg());
      ck_assert_uint_eq(qkeep_model_layer_count(m), 0);
      qkeep_model_free(m);
      char *slash = strrchr(path, '/');
      *slash = '\0';
      tu_rmtree(path);
      free(path);
    }
  }
  free(tiny);
  qkeep_plugins_close(chain, n);
}
END_TEST

/* The bytes do not depend on the threads quantizing: one (the load's own, no pool thread) and more than the
 * cores give quantize-then-load's. */
START_TEST(one_thread_and_more_threads_than_cores_load_as_quantize_then_load) {
  qkeep_plugin *ref;
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &ref) == 0, "%s", qkeep_errmsg());
  char *tiny = example("tiny");
  for (size_t s = 0; s < N_SCHEMES; s++) {
    struct qkeep_quantize_options o = options_for(schemes[s]);
    char *offline_dir = quantize_to_dir(tiny, &o);
    qkeep_model *offline = load_model(&ref, 1, offline_dir, NULL, 1, 0);
    static const int threads[] = {1, 5};
    for (int t = 0; t < 2; t++) {
      o.threads = threads[t];
      qkeep_model *online = load_model(&ref, 1, tiny, &o, 1, 0);
      assert_same_model(online, offline, schemes[s]);
      qkeep_model_free(online);
    }
    qkeep_model_free(offline);
    remove_dir(offline_dir);
  }
  free(tiny);
  qkeep_plugin_close(ref);
}
END_TEST

START_TEST(direct_loads_of_a_lone_weight_quantize_and_of_a_group_member_are_refused) {
  qkeep_plugin **chain;
  size_t n;
  open_default(&chain, &n);
  char *tiny = example("tiny"), *w1 = example("tiny-w1");
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(w1, &ck), 0);
  for (size_t s = 0; s < N_SCHEMES; s++) {
    struct qkeep_quantize_options o = options_for(schemes[s]);
    qkeep_model *m = load_model(chain, n, tiny, &o, 1, 0), *cold = load_model(chain, n, w1, &o, 1, 0);
    const char *lone = "model.layers.1.self_attn.o_proj.weight",
               *member = "model.layers.1.self_attn.k_proj.weight";
    for (int which = 0; which < 2; which++) {
      const struct ckpt_tensor *t = ckpt_find(ck, which ? member : lone);
      void *data = malloc(t->t->nbytes);
      ck_assert_int_eq(ckpt_read(ck, t, data), 0);
      struct qkeep_named_tensor nt = {
          t->t->name, {QKEEP_DTYPE_BF16, 2, {t->t->shape[0], t->t->shape[1]}}, data, false};
      int rc = qkeep_model_load_tensor(m, &nt);
      if (which) {
        ck_assert_int_eq(rc, QKEEP_E_UNSUPPORTED);
        ck_assert_msg(strstr(qkeep_errmsg(), "q_proj.weight"), "%s", qkeep_errmsg());
      } else {
        ck_assert_msg(rc == 0, "%s: %s", schemes[s], qkeep_errmsg());
      }
      free(data);
    }
    qkeep_layer *x = qkeep_model_find_layer(m, "model.layers.1.self_attn.o_proj"),
                *y = qkeep_model_find_layer(cold, "model.layers.1.self_attn.o_proj");
    struct compare_ctx c = {y, "o_proj", 0};
    ck_assert_int_eq(qkeep_foreach_name(x, compare_name, &c), 0);
    ck_assert_int_gt(c.compared, 0);
    qkeep_model_free(cold);
    qkeep_model_free(m);
  }
  ckpt_close(ck);
  free(tiny), free(w1);
  qkeep_plugins_close(chain, n);
}
END_TEST

START_TEST(set_quantize_refuses_what_a_load_cannot_take) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(NULL, &m), 0);
  struct qkeep_quantize_options o = options_for("gptq-int4");
  o.max_shard_bytes = 1 << 20;
  ck_assert_int_eq(qkeep_model_set_quantize(m, &o), QKEEP_E_INVAL);
  ck_assert_msg(strstr(qkeep_errmsg(), "max_shard_bytes"), "%s", qkeep_errmsg());
  o = options_for("fp8");
  ck_assert_int_eq(qkeep_model_set_quantize(m, &o), QKEEP_E_UNSUPPORTED);
  o = options_for("gptq-int4");
  o.group_size = -1;
  ck_assert_int_eq(qkeep_model_set_quantize(m, &o), QKEEP_E_INVAL);
  o = options_for("gptq-int4");
  ck_assert_int_eq(qkeep_model_set_quantize(m, &o), 0);
  char *q = example("tiny-gptq-int4"), *tiny = example("tiny");
  ck_assert_int_eq(qkeep_model_load(m, q), QKEEP_E_INVAL); /* already quantized */
  ck_assert_msg(strstr(qkeep_errmsg(), "already quantized"), "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_model_load(m, tiny) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(qkeep_model_set_quantize(m, NULL), QKEEP_E_STATE);
  qkeep_model_free(m);
  free(q), free(tiny);
}
END_TEST

/* examples/tiny rewritten: every tensor in `dtype` (F32 or F16), in `shards` files with an index when
 * shards > 1 (tensors dealt round-robin). The directory; the caller removes it. */
static char *tiny_as(enum qkeep_dtype dtype, int shards) {
  char *tiny = example("tiny");
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(tiny, &ck), 0);
  char *dir = tu_tmpdir("online-src");
  struct st_writer *w[2];
  for (int f = 0; f < shards; f++)
    ck_assert_int_eq(st_writer_new(&w[f]), 0);
  FILE *index = NULL;
  if (shards > 1) {
    char *path = tu_path(dir, "model.safetensors.index.json");
    index = fopen(path, "w");
    ck_assert_ptr_nonnull(index);
    fprintf(index, "{\"metadata\": {}, \"weight_map\": {");
    free(path);
  }
  for (size_t i = 0; i < ck->n_tensors; i++) {
    const struct st_tensor *t = ck->tensors[i].t;
    size_t n = t->nbytes / 2;
    uint16_t *bf16 = malloc(t->nbytes);
    float *f32 = malloc(n * 4);
    uint16_t *f16 = malloc(n * 2);
    ck_assert_int_eq(ckpt_read(ck, &ck->tensors[i], bf16), 0);
    for (size_t e = 0; e < n; e++) {
      f32[e] = qkeep_bf16_to_f32(bf16[e]);
      f16[e] = qkeep_f32_to_f16(f32[e]);
    }
    struct qkeep_spec spec = {.dtype = dtype, .ndim = t->ndim};
    memcpy(spec.shape, t->shape, sizeof spec.shape);
    int f = (int)(i % (size_t)shards);
    ck_assert_int_eq(
        st_writer_add(w[f], t->name, &spec, dtype == QKEEP_DTYPE_F32 ? (void *)f32 : (void *)f16), 0);
    if (index)
      fprintf(index, "%s\"%s\": \"model-%05d-of-%05d.safetensors\"", i ? ", " : "", t->name, f + 1, shards);
    free(bf16), free(f32), free(f16);
  }
  if (index) {
    fprintf(index, "}}\n");
    fclose(index);
  }
  for (int f = 0; f < shards; f++) {
    char name[64];
    snprintf(name, sizeof name, shards > 1 ? "model-%05d-of-%05d.safetensors" : "model.safetensors", f + 1,
             shards);
    char *path = tu_path(dir, name);
    ck_assert_int_eq(st_writer_write(w[f], path), 0);
    st_writer_free(w[f]);
    free(path);
  }
  ckpt_close(ck);
  free(tiny);
  return dir;
}

START_TEST(f32_f16_and_sharded_sources_load_online_as_quantize_then_load) {
  qkeep_plugin **chain;
  size_t n;
  open_default(&chain, &n);
  const struct {
    enum qkeep_dtype dtype;
    int shards;
  } sources[] = {{QKEEP_DTYPE_F32, 1}, {QKEEP_DTYPE_F16, 2}};
  for (size_t k = 0; k < 2; k++) {
    char *src = tiny_as(sources[k].dtype, sources[k].shards);
    for (size_t s = 0; s < N_SCHEMES; s++) {
      /* Under a memory checker each scheme from one of the two sources, alternately: a source's dtype
       * and shards are read by the same code whatever the scheme (plain make check runs every pair). */
      if (tu_under_memcheck() && s % 2 != k)
        continue;
      struct qkeep_quantize_options o = options_for(schemes[s]);
      char *offline_dir = quantize_to_dir(src, &o);
      qkeep_model *offline = load_model(chain, n, offline_dir, NULL, 1, 0),
                  *online = load_model(chain, n, src, &o, 1, 0);
      assert_same_model(online, offline, schemes[s]);
      qkeep_model_free(online);
      qkeep_model_free(offline);
      remove_dir(offline_dir);
    }
    tu_rmtree(src);
    free(src);
  }
  qkeep_plugins_close(chain, n);
}
END_TEST

/* The made tensors of unit u (of layer, from derived source `first`) equal the offline output's (ck). */
static void assert_unit_is_offline(const qkeep_layer *layer, size_t first, const struct online_unit *u,
                                   const struct ckpt *ck) {
  size_t end = online_unit_end(layer, first);
  ck_assert_uint_eq(u->n, end - first);
  for (size_t d = first; d < end; d++) {
    struct quant_output o;
    quant_plan_output(layer->model->online.plan, layer->derived[d].output, &o);
    struct provided t;
    ck_assert_msg(u->made.find(&u->made, o.name, &t), "%s: the unit made no '%s'", layer->name, o.name);
    const struct ckpt_tensor *want = ckpt_find(ck, o.name);
    ck_assert_ptr_nonnull(want);
    void *bytes = malloc(want->t->nbytes ? want->t->nbytes : 1);
    ck_assert_int_eq(ckpt_read(ck, want, bytes), 0);
    ck_assert_uint_eq(t.nbytes, want->t->nbytes);
    ck_assert_msg(memcmp(u->made.host_bytes(&u->made, &t), bytes, t.nbytes) == 0, "%s: bytes differ", o.name);
    free(bytes);
  }
}

/* A checkpoint provider that notes the name of every tensor it reads (the tests run one at a time). */
static struct provider counted_inner;
static const char *counted[64];
static size_t n_counted;

static int counted_read(const struct provider *p, const struct provided *t, void *dst) {
  (void)p;
  ck_assert_uint_lt(n_counted, 64);
  counted[n_counted++] = t->name;
  return counted_inner.read(&counted_inner, t, dst);
}

/* The pipe read ahead into the next layer, and the load then asked for another one (its order not the
 * pipe's): the unit read ahead is given up on and the one asked for is made, as qkeep quantize writes it,
 * each tensor read once. */
START_TEST(a_unit_read_ahead_for_another_turn_is_given_up_on) {
  qkeep_plugin *ref;
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &ref) == 0, "%s", qkeep_errmsg());
  char *tiny = example("tiny");
  struct qkeep_quantize_options o = options_for("w8a8-int8");
  char *offline_dir = quantize_to_dir(tiny, &o);
  qkeep_model *m = load_model(&ref, 1, tiny, &o, 1, 0);
  qkeep_layer *quantizing[3];
  size_t n = 0;
  for (size_t l = 0; l < m->n_layers && n < 3; l++) /* layers whose first unit quantizes (not constants) */
    if (m->layers[l]->n_derived && m->layers[l]->derived[0].unit != SIZE_MAX)
      quantizing[n++] = m->layers[l];
  ck_assert_uint_eq(n, 3);
  struct ckpt *in, *out;
  ck_assert_int_eq(ckpt_open(tiny, &in), 0);
  ck_assert_int_eq(ckpt_open(offline_dir, &out), 0);
  struct provider pv;
  ckpt_provider(&counted_inner, in);
  pv = counted_inner;
  pv.read = counted_read;
  n_counted = 0;
  struct online_pipe *pipe = NULL;
  struct online_unit *u;
  /* the first layer's last unit: the second layer's first is read ahead */
  size_t last = 0;
  for (size_t first = 0; first < quantizing[0]->n_derived; first = online_unit_end(quantizing[0], first))
    last = first;
  ck_assert_msg(online_pipe_take(&pipe, quantizing[0], last, &pv, m->layers, m->n_layers, NULL, &u) == 0,
                "%s", qkeep_errmsg());
  assert_unit_is_offline(quantizing[0], last, u, out);
  online_pipe_done(pipe);
  ck_assert_int_gt(online_pipe_bytes(pipe), 0); /* the one read ahead */
  /* then the third layer, not the second */
  ck_assert_msg(online_pipe_take(&pipe, quantizing[2], 0, &pv, m->layers, m->n_layers, NULL, &u) == 0, "%s",
                qkeep_errmsg());
  assert_unit_is_offline(quantizing[2], 0, u, out);
  online_pipe_done(pipe);
  online_pipe_free(pipe);
  ck_assert_uint_ge(n_counted, 4); /* A's last unit, B's first (given up on), C's first and the one after */
  for (size_t i = 0; i < n_counted; i++)
    for (size_t j = 0; j < i; j++)
      ck_assert_msg(strcmp(counted[i], counted[j]) != 0, "'%s' was read twice", counted[i]);
  ckpt_close(in);
  ckpt_close(out);
  qkeep_model_free(m);
  remove_dir(offline_dir);
  free(tiny);
  qkeep_plugin_close(ref);
}
END_TEST

/* Whether two outputs of qkeep quantize hold the same files with the same bytes (the files it writes). */
static bool same_output(const char *a, const char *b) {
  static const char *const files[] = {"model.safetensors", "config.json", "hf_quant_config.json"};
  for (size_t f = 0; f < 3; f++) {
    char *pa = tu_path(a, files[f]), *pb = tu_path(b, files[f]);
    size_t na = 0, nb = 0;
    void *x = tu_read_file(pa, &na), *y = tu_read_file(pb, &nb);
    bool same = (!x && !y) || (x && y && na == nb && memcmp(x, y, na) == 0);
    free(x), free(y), free(pa), free(pb);
    if (!same)
      return false;
  }
  return true;
}

/* A config of [model] quantize = scheme (none: NULL) and one more key; its path (the caller frees it and
 * removes its directory). */
static char *config_with(const char *scheme, const char *key, const char *value) {
  char *dir = tu_tmpdir("online-ini");
  char *path = tu_path(dir, "q.ini");
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fprintf(f, "[qkeep]\nbackend = reference\n[model]\n");
  if (scheme)
    fprintf(f, "quantize = %s\n", scheme);
  fprintf(f, "%s = %s\n", key, value);
  fclose(f);
  free(dir);
  return path;
}

/*
 * A [model] quantize_* key the scheme does not take is refused (QKEEP_E_INVAL naming the file, the key and
 * the scheme), and one it takes is accepted. The oracle is qkeep quantize itself, which ignores an option its
 * scheme does not use: a key must be taken exactly when its option changes the bytes quantize writes
 * (threads, which never does, is taken by every scheme). Without quantize = SCHEME every such key is refused.
 */
START_TEST(config_quantize_keys_a_scheme_does_not_take_are_refused) {
  static const char *const all[] = {"modelopt-nvfp4", "ct-nvfp4", "mxfp4",  "w8a8-int8",
                                    "gptq-int4",      "awq-int4", "ct-int4"};
  static const struct {
    const char *key, *value;
  } keys[] = {{"quantize_group", "64"},          {"quantize_asym", "true"},
              {"quantize_static_input", "true"}, {"quantize_asym_input", "true"},
              {"quantize_kv_scales", "true"},    {"quantize_activation_amax", "4"},
              {"quantize_threads", "1"}};
  char *tiny = example("tiny");
  for (size_t s = 0; s < sizeof all / sizeof all[0]; s++) {
    struct qkeep_quantize_options base = {.size = sizeof base, .scheme = all[s], .threads = 2};
    char *plain = quantize_to_dir(tiny, &base);
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
      struct qkeep_quantize_options o = base;
      switch (k) {
      case 0: o.group_size = 64; break;
      case 1: o.asym_weights = true; break;
      case 2: o.static_input = true; break;
      case 3: o.asym_input = true; break;
      case 4: o.kv_cache_scales = true; break;
      case 5: o.activation_amax = 4.0f; break;
      default: o.threads = 1;
      }
      char *with = quantize_to_dir(tiny, &o);
      bool takes = k == 6 || !same_output(plain, with);
      remove_dir(with);
      char *path = config_with(all[s], keys[k].key, keys[k].value);
      qkeep_config *cfg = NULL;
      int rc = qkeep_config_load(path, &cfg);
      if (takes) {
        ck_assert_msg(rc == 0, "%s with %s: %s", all[s], keys[k].key, qkeep_errmsg());
        struct qkeep_quantize_options got = {.size = sizeof got};
        ck_assert_int_eq(qkeep_config_quantize(cfg, &got), 0);
        ck_assert_str_eq(got.scheme, all[s]);
      } else {
        ck_assert_msg(rc == QKEEP_E_INVAL, "%s with %s: %d (%s)", all[s], keys[k].key, rc, qkeep_errmsg());
        ck_assert_msg(strstr(qkeep_errmsg(), path) && strstr(qkeep_errmsg(), ":5:") &&
                          strstr(qkeep_errmsg(), keys[k].key) && strstr(qkeep_errmsg(), all[s]),
                      "%s", qkeep_errmsg());
      }
      qkeep_config_free(cfg);
      char *slash = strrchr(path, '/');
      *slash = '\0';
      tu_rmtree(path);
      free(path);
    }
    remove_dir(plain);
  }
  for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) { /* no scheme: nothing would read the key */
    char *path = config_with(NULL, keys[k].key, keys[k].value);
    qkeep_config *cfg = NULL;
    ck_assert_int_eq(qkeep_config_load(path, &cfg), QKEEP_E_INVAL);
    ck_assert_msg(strstr(qkeep_errmsg(), path) && strstr(qkeep_errmsg(), keys[k].key) &&
                      strstr(qkeep_errmsg(), "needs quantize"),
                  "%s", qkeep_errmsg());
    char *slash = strrchr(path, '/');
    *slash = '\0';
    tu_rmtree(path);
    free(path);
  }
  free(tiny);
}
END_TEST

/* A reload's check of W1's values finds a NaN or an Inf wherever it is in the tensor (the first element, one
 * past whole runs of 64, the last) in each source dtype, naming its element; finite values of the largest
 * exponent below infinity's, of either sign, are taken, and the reload then equals a cold online start of
 * the same W1. */
START_TEST(every_non_finite_value_is_found_and_every_finite_one_taken_in_each_dtype) {
  qkeep_plugin *ref;
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &ref) == 0, "%s", qkeep_errmsg());
  const char *tensor = "model.layers.1.mlp.down_proj.weight";
  static const struct {
    enum qkeep_dtype dtype;
    uint32_t nan, inf, ninf, max, nmax;
  } dtypes[] = {
      {QKEEP_DTYPE_BF16, 0x7fc1, 0x7f80, 0xff80, 0x7f00, 0xff00}, /* 2^127: its scale x 127 is finite */
      {QKEEP_DTYPE_F16, 0x7e01, 0x7c00, 0xfc00, 0x7bff, 0xfbff},
      {QKEEP_DTYPE_F32, 0x7fc00001, 0x7f800000, 0xff800000, 0x7f000000, 0xff000000}};
  struct qkeep_quantize_options o = options_for("w8a8-int8");
  for (size_t d = 0; d < 3; d++) {
    char *w0 = example_as("tiny", dtypes[d].dtype, NULL, 0, 0, false);
    qkeep_model *m = load_model(&ref, 1, w0, &o, 1, 0);
    struct qkeep_digest d0 = digest_of(m);
    struct ckpt *ck;
    ck_assert_int_eq(ckpt_open(w0, &ck), 0);
    size_t n = (size_t)(ckpt_find(ck, tensor)->t->nbytes / qkeep_dtype_size(dtypes[d].dtype));
    ckpt_close(ck);
    const size_t where[] = {0, 3 * 64, 3 * 64 + 7, n - 1};
    const uint32_t bad[] = {dtypes[d].nan, dtypes[d].inf, dtypes[d].ninf, dtypes[d].nan};
    for (int b = 0; b < 4; b++) {
      char *w1 = example_as("tiny-w1", dtypes[d].dtype, tensor, where[b], bad[b], true);
      ck_assert_int_eq(qkeep_model_reload(m, w1, 0), QKEEP_E_FORMAT);
      char element[64];
      snprintf(element, sizeof element, "element %zu ", where[b]);
      ck_assert_msg(strstr(qkeep_errmsg(), tensor) && strstr(qkeep_errmsg(), element), "dtype %d, %s: %s",
                    (int)dtypes[d].dtype, element, qkeep_errmsg());
      ck_assert(same_digest(d0, digest_of(m)));
      remove_file_dir(w1);
    }
    for (int b = 0; b < 2; b++) {
      char *w1 = example_as("tiny-w1", dtypes[d].dtype, tensor, b ? n - 1 : 3 * 64,
                            b ? dtypes[d].nmax : dtypes[d].max, true);
      ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "dtype %d: %s", (int)dtypes[d].dtype, qkeep_errmsg());
      qkeep_model *cold = load_model(&ref, 1, w1, &o, 1, 0);
      ck_assert(same_digest(digest_of(cold), digest_of(m)));
      qkeep_model_free(cold);
      remove_file_dir(w1);
    }
    qkeep_model_free(m);
    remove_file_dir(w0);
  }
  qkeep_plugin_close(ref);
}
END_TEST

/*
 * A W1 whose quantized scale a cold start refuses (f32's largest value: its int8 scale times 127 overflows
 * float) is refused by an online reload too, naming the scale: a reload must equal a cold start, and the
 * scales made on load never passed the reload's validation. The model is W0 afterwards, pointers unchanged.
 * The oracle: qkeep quantize of that W1, whose cold start refuses the same scale.
 */
START_TEST(a_made_scale_a_cold_start_refuses_is_refused_by_a_reload) {
  qkeep_plugin *ref;
  ck_assert_msg(qkeep_plugin_open("reference", NULL, &ref) == 0, "%s", qkeep_errmsg());
  const char *tensor = "model.layers.1.mlp.down_proj.weight";
  struct qkeep_quantize_options o = options_for("w8a8-int8");
  char *w1 = example_as("tiny-w1", QKEEP_DTYPE_F32, tensor, 200, 0x7f7fffff, true);
  char *offline_dir = quantize_to_dir(w1, &o);
  qkeep_model *oracle;
  ck_assert_int_eq(qkeep_model_new(ref, &oracle), 0);
  ck_assert_int_eq(qkeep_model_load(oracle, offline_dir), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), "down_proj.weight_scale"), "%s", qkeep_errmsg());
  qkeep_model_free(oracle);
  char *w0 = example_as("tiny", QKEEP_DTYPE_F32, NULL, 0, 0, false);
  qkeep_model *m = load_model(&ref, 1, w0, &o, 1, 0);
  struct snapshot before, after;
  snapshot_take(m, &before);
  ck_assert_int_eq(qkeep_model_reload(m, w1, 0), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), "down_proj.weight_scale"), "%s", qkeep_errmsg());
  snapshot_take(m, &after);
  assert_unchanged(&before, &after, "w8a8-int8");
  snapshot_free(&before), snapshot_free(&after);
  qkeep_model_free(m);
  remove_dir(offline_dir);
  remove_file_dir(w1);
  remove_file_dir(w0);
  qkeep_plugin_close(ref);
}
END_TEST

static Suite *online_suite(void) {
  Suite *s = suite_create("online");
  TCase *tc = tcase_create("online");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, every_scheme_online_equals_quantize_then_load_on_the_default_chain);
  tcase_add_test(tc, every_scheme_online_equals_quantize_then_load_on_reference_and_cpu_chains);
  tcase_add_test(tc, the_benches_synthetic_models_load_and_their_bf16_form_loads_online_as_its_twin);
  tcase_add_test(tc, f32_f16_and_sharded_sources_load_online_as_quantize_then_load);
  tcase_add_test(tc, every_unquantized_name_resolves_and_keeps_no_bytes);
  tcase_add_test(tc, reload_w0_to_w1_equals_a_cold_online_w1_and_moves_no_pointer);
  tcase_add_test(tc, tensor_parallel_ranks_equal_the_ranks_of_the_offline_output);
  tcase_add_test(tc, a_sync_of_bf16_buckets_equals_a_cold_online_w1);
  tcase_add_test(tc, nan_or_inf_in_the_source_is_refused_before_anything_changes);
  tcase_add_test(tc, every_non_finite_value_is_found_and_every_finite_one_taken_in_each_dtype);
  tcase_add_test(tc, a_nan_deep_in_a_large_weight_is_found_by_the_threaded_check);
  tcase_add_test(tc, a_made_scale_a_cold_start_refuses_is_refused_by_a_reload);
  tcase_add_test(tc, a_nan_in_the_last_quantized_tensor_of_w1_leaves_every_kernel_tensor_of_w0);
  tcase_add_test(tc, a_nan_in_a_unit_read_ahead_fails_the_cold_start_naming_it);
  tcase_add_test(tc, one_thread_and_more_threads_than_cores_load_as_quantize_then_load);
  tcase_add_test(tc, a_unit_read_ahead_for_another_turn_is_given_up_on);
  tcase_add_test(tc, direct_loads_of_a_lone_weight_quantize_and_of_a_group_member_are_refused);
  tcase_add_test(tc, set_quantize_refuses_what_a_load_cannot_take);
  tcase_add_test(tc, config_quantize_keys_a_scheme_does_not_take_are_refused);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run_suite(online_suite(), CK_NORMAL); }
