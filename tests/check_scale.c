/*
 * check_scale.c: name resolution at the tensor counts of MoE models. Every
 * lookup the core answers by hash (checkpoint tensors, layers, params,
 * checkpoint names) is compared with a plain scan over the same tables, the
 * answer the core gave before it had an index; a reload at many tensors equals
 * a cold start; the census counts every param. No timings: speed is
 * bench/bench_scale's business.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define XXH_INLINE_ALL /* the unseeded hash the index used before, to aim names at it */
#include <xxhash.h>

#include "checkutil.h"
#include "private.h"
#include "synth_moe.h"
#include "testutil.h"

/* 14 decoder layers of 128 experts: 21,801 tensors. */
#define LAYERS 14
#define EXPERTS 128

static char *dir;

static void setup(void) { ck_assert((dir = tu_tmpdir("scale")) != NULL); }
static void teardown(void) {
  tu_rmtree(dir);
  free(dir);
}

static char *write_ckpt(const char *name, int layers, int shards, uint64_t seed) {
  char *path = tu_path(dir, name);
  ck_assert(mkdir(path, 0755) == 0);
  ck_assert_msg(synth_moe_write(path, layers, EXPERTS, shards, seed) == 0, "%s", qkeep_errmsg());
  return path;
}

/* ---- the index itself ------------------------------------------------------------------- */

START_TEST(name_index_finds_what_was_put_and_nothing_else) {
  enum { N = 50000 };
  struct name_index ix = {0};
  char **names = malloc(N * sizeof *names);
  ck_assert(names);
  for (size_t i = 0; i < N; i++) {
    ck_assert(asprintf(&names[i], "model.layers.%zu.mlp.experts.%zu.up_proj.weight", i / 512, i % 512) > 0);
    ck_assert_int_eq(name_index_put(&ix, names[i], i, NULL), 0);
  }
  ck_assert_uint_eq(ix.count, N);
  size_t v, existing = 0;
  for (size_t i = 0; i < N; i++) {
    ck_assert(name_index_get(&ix, names[i], &v));
    ck_assert_uint_eq(v, i);
  }
  /* A second put of a name keeps the first value and says where it is. */
  ck_assert_int_eq(name_index_put(&ix, names[7], 99, &existing), QKEEP_E_EXISTS);
  ck_assert_uint_eq(existing, 7);
  ck_assert_int_eq(name_index_set(&ix, names[7], 99), 0);
  ck_assert(name_index_get(&ix, names[7], &v) && v == 99);
  ck_assert_uint_eq(ix.count, N);
  /* Lookups by length: a prefix of a name is not the name; a name inside a longer string is. */
  ck_assert(!name_index_find(&ix, names[3], strlen(names[3]) - 1, &v));
  char *longer = NULL;
  ck_assert(asprintf(&longer, "%s.extra", names[3]) > 0);
  ck_assert(name_index_find(&ix, longer, strlen(names[3]), &v) && v == 3);
  ck_assert(!name_index_get(&ix, "model.layers.0.mlp", &v));
  ck_assert(!name_index_get(&ix, "", &v));
  name_index_clear(&ix);
  ck_assert(!name_index_get(&ix, names[0], &v));
  for (size_t i = 0; i < N; i++)
    free(names[i]);
  free(names);
  free(longer);
}
END_TEST

/* ---- lookups against scans ---------------------------------------------------------------- */

/*
 * What qkeep_model_lookup answered before it had an index (a scan of every layer's sources: the first in
 * layer order), computed without one: every source sorted by name, then by its place in the scan.
 */
struct scan_entry {
  const char *name;
  size_t order;
  qkeep_layer *layer;
  qkeep_param *param;
};

static int by_name_then_order(const void *a, const void *b) {
  const struct scan_entry *x = a, *y = b;
  int c = strcmp(x->name, y->name);
  return c ? c : (x->order > y->order) - (x->order < y->order);
}

static struct scan_entry *scan_sources(const qkeep_model *m, size_t *n) {
  size_t total = 0;
  for (size_t l = 0; l < m->n_layers; l++)
    total += m->layers[l]->n_sources;
  struct scan_entry *e = malloc((total ? total : 1) * sizeof *e);
  ck_assert_ptr_nonnull(e);
  *n = 0;
  for (size_t l = 0; l < m->n_layers; l++)
    for (size_t i = 0; i < m->layers[l]->n_sources; i++, (*n)++)
      e[*n] = (struct scan_entry){m->layers[l]->sources[i].checkpoint_name, *n, m->layers[l],
                                  m->layers[l]->sources[i].param};
  qsort(e, *n, sizeof *e, by_name_then_order);
  return e;
}

/* The first source of that name in scan order, or NULL. */
static const struct scan_entry *scan_lookup(const struct scan_entry *e, size_t n, const char *name) {
  size_t lo = 0, hi = n;
  while (lo < hi) { /* the lowest position whose name is >= name */
    size_t mid = (lo + hi) / 2;
    if (strcmp(e[mid].name, name) < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < n && strcmp(e[lo].name, name) == 0 ? &e[lo] : NULL;
}

/* Hash flooding: names chosen so that the unseeded XXH3 the index used puts them all at one home slot
 * (their hashes share 11 low bits) made every insertion walk one run of slots: 100k such names took 55 s.
 * Each index now has a seed of its own and no name sits more than 64 slots from its home, so the same
 * names spread out; every one is still found, and nothing else is. */
START_TEST(names_aimed_at_an_unseeded_hash_do_not_pile_up) {
  enum { BITS = 11 };
  /* Under a memory checker 200 names: finding each takes 2,048 hashes on average, most of the test's time
   * there, and the index does the same with fewer (plain make check puts all 1,500 in one run). */
  const size_t n_names = tu_under_memcheck() ? 200 : 1500;
  char **names = calloc(n_names, sizeof *names), buf[32];
  ck_assert_ptr_nonnull(names);
  unsigned counter = 0;
  for (size_t i = 0; i < n_names; i++) {
    do
      snprintf(buf, sizeof buf, "model.t%u.weight", counter++);
    while ((XXH3_64bits(buf, strlen(buf)) & ((1u << BITS) - 1)) != 0);
    ck_assert_ptr_nonnull(names[i] = strdup(buf));
  }
  struct name_index ix = {0}, other = {0};
  for (size_t i = 0; i < n_names; i++)
    ck_assert_int_eq(name_index_put(&ix, names[i], i, NULL), 0);
  ck_assert_uint_eq(ix.count, n_names);
  ck_assert_msg(name_index_longest_probe(&ix) <= 64, "a name sits %zu slots from its home",
                name_index_longest_probe(&ix));
  size_t v;
  for (size_t i = 0; i < n_names; i++)
    ck_assert(name_index_get(&ix, names[i], &v) && v == i);
  ck_assert(!name_index_get(&ix, "model.t0.bias", &v));
  size_t existing;
  ck_assert_int_eq(name_index_put(&ix, names[n_names - 1], 7, &existing), QKEEP_E_EXISTS);
  ck_assert_uint_eq(existing, n_names - 1);
  /* each index its own seed */
  ck_assert_int_eq(name_index_put(&other, names[0], 0, NULL), 0);
  ck_assert(name_index_seed(&ix) != name_index_seed(&other));
  ck_assert(name_index_get(&other, names[0], &v) && v == 0);
  ck_assert(!name_index_get(&other, names[1], &v));
  name_index_clear(&ix);
  name_index_clear(&other);
  for (size_t i = 0; i < n_names; i++)
    free(names[i]);
  free(names);
}
END_TEST

/* The limit itself: names that share one home slot under the index's own seed fill slots 0 .. 64 from
 * it; the next one found slot 65 empty and was put there, past the limit (a name 65 slots from its home
 * failed the test above about once in 60 runs). It now rebuilds the table instead. */
START_TEST(the_name_after_a_full_run_of_the_probe_limit_rebuilds_the_table) {
  enum { LIMIT = 64, NAMES = LIMIT + 2 };
  struct name_index ix = {0};
  ck_assert_int_eq(name_index_reserve(&ix, 4096), 0); /* room: no growth while the names go in */
  const uint64_t seed = name_index_seed(&ix);
  const size_t cap = ix.cap;
  char *names[NAMES], buf[32];
  unsigned counter = 0;
  for (int i = 0; i < NAMES; i++) {
    do
      snprintf(buf, sizeof buf, "model.h%u.weight", counter++);
    while (((uint32_t)XXH3_64bits_withSeed(buf, strlen(buf), seed) & (cap - 1)) != 0);
    ck_assert_ptr_nonnull(names[i] = strdup(buf));
  }
  for (int i = 0; i < NAMES - 1; i++)
    ck_assert_int_eq(name_index_put(&ix, names[i], (size_t)i, NULL), 0);
  ck_assert_uint_eq(name_index_seed(&ix), seed); /* 0 .. 64 from home: within the limit, no rebuild */
  ck_assert_uint_eq(name_index_longest_probe(&ix), LIMIT);
  ck_assert_int_eq(name_index_put(&ix, names[NAMES - 1], NAMES - 1, NULL), 0);
  ck_assert_msg(name_index_longest_probe(&ix) <= LIMIT, "a name sits %zu slots from its home",
                name_index_longest_probe(&ix));
  ck_assert(name_index_seed(&ix) != seed);
  size_t v;
  for (int i = 0; i < NAMES; i++)
    ck_assert(name_index_get(&ix, names[i], &v) && v == (size_t)i);
  name_index_clear(&ix);
  for (int i = 0; i < NAMES; i++)
    free(names[i]);
}
END_TEST

START_TEST(lookups_at_tens_of_thousands_of_tensors_match_a_scan) {
  char *path = write_ckpt("w0", LAYERS, 1, 1);
  struct ckpt *ck;
  ck_assert_msg(ckpt_open(path, &ck) == 0, "%s", qkeep_errmsg());
  ck_assert_uint_eq(ck->n_tensors, synth_moe_tensors(LAYERS, EXPERTS));
  ck_assert_uint_gt(ck->n_tensors, 20000);
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(NULL, &m), 0);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s", qkeep_errmsg());

  /* Every checkpoint tensor: the table entry of that name, and the param (and layer) a scan finds. */
  size_t n_scan;
  struct scan_entry *scan = scan_sources(m, &n_scan);
  for (size_t i = 0; i < ck->n_tensors; i++) {
    const char *name = ck->tensors[i].t->name;
    ck_assert_ptr_eq(ckpt_find(ck, name), &ck->tensors[i]);
    ck_assert_ptr_eq(st_find(ck->files[0], name), ck->tensors[i].t);
    qkeep_layer *got_layer = NULL;
    const struct scan_entry *want = scan_lookup(scan, n_scan, name);
    ck_assert_msg(want != NULL, "%s loads nowhere", name);
    ck_assert_ptr_eq(qkeep_model_lookup(m, name, &got_layer), want->param);
    ck_assert_ptr_eq(got_layer, want->layer);
  }
  free(scan);
  /* Every layer by name, every registered name of every layer. */
  size_t names = 0;
  for (size_t l = 0; l < m->n_layers; l++) {
    qkeep_layer *layer = m->layers[l];
    ck_assert_ptr_eq(qkeep_model_find_layer(m, layer->name), layer);
    for (size_t i = 0; i < layer->n_names; i++, names++) {
      ck_assert_ptr_eq(layer_find_name(layer, layer->names[i].name), &layer->names[i]);
      ck_assert_ptr_eq(qkeep_param_lookup(layer, layer->names[i].name), layer->names[i].param);
    }
    ck_assert_ptr_null(qkeep_param_lookup(layer, "no_such_param"));
  }
  ck_assert_uint_gt(names, m->n_layers);
  /* Names that are not there, or only a prefix of one. */
  qkeep_layer *none = NULL;
  ck_assert_ptr_null(qkeep_model_lookup(m, "model.layers.0.mlp.experts.0.gate_proj", &none));
  ck_assert_ptr_null(qkeep_model_lookup(m, "model.layers.0.mlp.experts.0.gate_proj.weight_scale_3", &none));
  ck_assert_ptr_null(none);
  ck_assert_ptr_null(qkeep_model_find_layer(m, "model.layers.0.mlp"));
  ck_assert_ptr_null(ckpt_find(ck, "model.layers.0.mlp.experts.0.gate_proj"));
  ck_assert_ptr_nonnull(qkeep_model_find_layer(m, "model.layers.13.mlp.experts"));

  /* The census counts every loader param, each registered as the same object. */
  struct qkeep_census c = tu_assert_census_clean(m);
  size_t params = 0;
  for (size_t l = 0; l < m->n_layers; l++)
    params += m->layers[l]->n_params;
  ck_assert_int_eq(c.loader_params, (int64_t)params);
  ck_assert_uint_gt(params, 256); /* enough ranges for the census's radix sort */
  /* A planted overlap among them is found: the last layer's first param shares the first one's storage. */
  qkeep_param *a = m->layers[0]->params[0], *b = m->layers[m->n_layers - 1]->params[0];
  struct storage *saved = b->view.storage;
  storage_ref(a->view.storage);
  b->view.storage = a->view.storage;
  struct qkeep_census planted = {.size = sizeof planted};
  ck_assert_int_eq(qkeep_census(m, &planted), 0);
  ck_assert_int_eq(planted.c2, 1);
  storage_unref(b->view.storage);
  b->view.storage = saved;
  ck_assert_int_eq(tu_assert_census_clean(m).c2, 0);
  qkeep_model_free(m);
  ckpt_close(ck);
  free(path);
}
END_TEST

/* A name that loads into two places resolves to its first, as a scan of the layers finds it. */
START_TEST(a_name_in_two_layers_resolves_to_the_first_layer) {
  qkeep_model *m;
  qkeep_layer *a, *b;
  qkeep_param *pa, *pb;
  struct qkeep_spec spec = {QKEEP_DTYPE_F32, 1, {4}};
  ck_assert_int_eq(qkeep_model_new(NULL, &m), 0);
  ck_assert_int_eq(qkeep_layer_add(m, "a", QKEEP_LAYER_OTHER, NULL, &a), 0);
  ck_assert_int_eq(qkeep_layer_add(m, "b", QKEEP_LAYER_OTHER, NULL, &b), 0);
  ck_assert_int_eq(qkeep_param_create(a, "w", &spec, &pa), 0);
  ck_assert_int_eq(qkeep_param_create(b, "w", &spec, &pb), 0);
  /* b's source first, then a's: the earlier layer wins, whatever the order of adding. */
  ck_assert_int_eq(layer_add_source(b, "shared.w", pb, 0, &spec), 0);
  ck_assert_int_eq(layer_add_source(a, "shared.w", pa, 0, &spec), 0);
  ck_assert_int_eq(layer_add_source(b, "b.w", pb, 0, &spec), 0);
  qkeep_layer *got;
  ck_assert_ptr_eq(qkeep_model_lookup(m, "shared.w", &got), pa);
  ck_assert_ptr_eq(got, a);
  ck_assert_ptr_eq(qkeep_model_lookup(m, "b.w", &got), pb);
  ck_assert_ptr_eq(got, b);
  ck_assert_int_eq(qkeep_layer_add(m, "a", QKEEP_LAYER_OTHER, NULL, NULL), QKEEP_E_EXISTS);
  ck_assert_ptr_eq(qkeep_model_find_layer(m, "b"), b);
  qkeep_model_free(m);
}
END_TEST

/* ---- reload at many tensors -------------------------------------------------------------- */

START_TEST(a_reload_at_thousands_of_tensors_equals_a_cold_start) {
  /* W1 in three shards: its tensors resolve through the checkpoint's own index. */
  char *w0 = write_ckpt("r0", 4, 1, 1), *w1 = write_ckpt("r1", 4, 3, 2);
  struct ckpt *ck;
  ck_assert_msg(ckpt_open(w1, &ck) == 0, "%s", qkeep_errmsg());
  ck_assert_uint_eq(ck->n_files, 3);
  for (size_t i = 0; i < ck->n_tensors; i++)
    ck_assert_ptr_eq(ckpt_find(ck, ck->tensors[i].t->name), &ck->tensors[i]);
  ck_assert_ptr_null(ckpt_find(ck, "model.layers.4.mlp.gate.weight"));
  ckpt_close(ck);
  qkeep_model *reloaded, *cold;
  ck_assert_int_eq(qkeep_model_new(NULL, &reloaded), 0);
  ck_assert_int_eq(qkeep_model_new(NULL, &cold), 0);
  ck_assert_msg(qkeep_model_load(reloaded, w0) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_model_load(cold, w1) == 0, "%s", qkeep_errmsg());
  struct qkeep_digest d0, d1, d;
  ck_assert_int_eq(qkeep_digest(reloaded, &d0), 0);
  ck_assert_int_eq(qkeep_digest(cold, &d1), 0);
  ck_assert(d0.hi != d1.hi || d0.lo != d1.lo);
  ck_assert_msg(qkeep_model_reload(reloaded, w1, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_int_eq(qkeep_digest(reloaded, &d), 0);
  ck_assert(d.hi == d1.hi && d.lo == d1.lo);
  tu_assert_census_clean(reloaded);
  qkeep_model_free(reloaded);
  qkeep_model_free(cold);
  free(w0);
  free(w1);
}
END_TEST

/* ---- a catastrophic ignore pattern ----------------------------------------------------------- */

START_TEST(a_catastrophic_ignore_pattern_fails_the_load_clearly) {
  char *path = write_ckpt("regex", 1, 1, 1);
  /* (.+.+)+_q$ backtracks exponentially on every module name that has a 'q' (q_proj) but does not end
   * in "_q": PCRE2 stops it at the match limit. */
  static const char hf[] = "{\"producer\": {\"name\": \"modelopt\"}, \"quantization\": {\"quant_algo\": "
                           "\"NVFP4\", \"group_size\": 16, \"exclude_modules\": [\"lm_head\", "
                           "\"re:(.+.+)+_q$\"]}}";
  char *file = tu_path(path, "hf_quant_config.json"), *cfg = tu_path(path, "config.json");
  ck_assert_int_eq(tu_write_file(file, hf, strlen(hf)), 0);
  ck_assert_int_eq(remove(cfg), 0);
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(NULL, &m), 0);
  ck_assert_int_eq(qkeep_model_load(m, path), QKEEP_E_FORMAT);
  const char *msg = qkeep_errmsg();
  ck_assert_msg(strstr(msg, "hf_quant_config.json") && strstr(msg, "exclude_modules") &&
                    strstr(msg, "'re:(.+.+)+_q$'") && strstr(msg, "q_proj") && strstr(msg, "backtrack"),
                "%s", msg);
  ck_assert_uint_eq(qkeep_model_layer_count(m), 0); /* nothing half-assembled stays */
  qkeep_model_free(m);
  free(file);
  free(cfg);
  free(path);
}
END_TEST

static Suite *scale_suite(void) {
  Suite *s = suite_create("scale");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 600);
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, name_index_finds_what_was_put_and_nothing_else);
  tcase_add_test(tc, names_aimed_at_an_unseeded_hash_do_not_pile_up);
  tcase_add_test(tc, the_name_after_a_full_run_of_the_probe_limit_rebuilds_the_table);
  tcase_add_test(tc, lookups_at_tens_of_thousands_of_tensors_match_a_scan);
  tcase_add_test(tc, a_name_in_two_layers_resolves_to_the_first_layer);
  tcase_add_test(tc, a_reload_at_thousands_of_tensors_equals_a_cold_start);
  tcase_add_test(tc, a_catastrophic_ignore_pattern_fails_the_load_clearly);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run_suite(scale_suite(), CK_NORMAL); }
