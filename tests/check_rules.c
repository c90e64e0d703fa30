/*
 * check_rules.c: every row of the rules table (replace, move, retire,
 * release, add_buffer, the readers), and the census and digest, including
 * planted violations that prove each count can be non-zero.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "checkutil.h"
#include "private.h"
#include "qkeep/qkeep_backend_util.h"

static qkeep_model *model;
static qkeep_layer *layer;

static void setup(void) {
  ck_assert_int_eq(qkeep_model_new(NULL, &model), 0);
  ck_assert_int_eq(
      qkeep_layer_add(model, "model.layers.0.mlp.down_proj", QKEEP_LAYER_LINEAR, "ct-nvfp4", &layer), 0);
}

static void teardown(void) { qkeep_model_free(model); }

static struct qkeep_spec spec1(enum qkeep_dtype dtype, int64_t n) {
  return (struct qkeep_spec){.dtype = dtype, .ndim = 1, .shape = {n}};
}

static qkeep_param *make_param(const char *name, enum qkeep_dtype dtype, int64_t n, unsigned char fill) {
  struct qkeep_spec s = spec1(dtype, n);
  qkeep_param *p;
  ck_assert_int_eq(qkeep_param_create(layer, name, &s, &p), 0);
  memset(p->view.storage->data, fill, qkeep_spec_bytes(&s));
  return p;
}

/* A result tensor filled with one byte value. */
static qkeep_tensor *result(enum qkeep_dtype dtype, int64_t n, unsigned char fill) {
  struct qkeep_spec s = spec1(dtype, n);
  qkeep_tensor *t;
  ck_assert_int_eq(qkeep_tensor_new(layer, &s, &t), 0);
  memset(qkeep_tensor_data(t), fill, qkeep_spec_bytes(&s));
  return t;
}

static struct qkeep_view view(const char *name) {
  struct qkeep_view v = {.size = sizeof v};
  ck_assert_int_eq(qkeep_view_of(layer, name, &v), 0);
  return v;
}

static struct qkeep_census census(void) {
  struct qkeep_census c = {.size = sizeof c};
  ck_assert_int_eq(qkeep_census(model, &c), 0);
  return c;
}

static void assert_clean(const struct qkeep_census *c) {
  ck_assert_int_eq(c->missing, 0);
  ck_assert_int_eq(c->c1, 0);
  ck_assert_int_eq(c->c2, 0);
  ck_assert_int_eq(c->released, 0);
}

START_TEST(create_is_zeroed_exact_and_registered) {
  struct qkeep_spec s = {.dtype = QKEEP_DTYPE_F8_E4M3, .ndim = 2, .shape = {8, 4}};
  qkeep_param *p;
  ck_assert_int_eq(qkeep_param_create(layer, "weight_scale", &s, &p), 0);
  struct qkeep_view v = view("weight_scale");
  ck_assert_uint_eq(v.nbytes, 32);
  ck_assert_uint_eq(v.capacity, 32);
  for (int i = 0; i < 32; i++)
    ck_assert_int_eq(((unsigned char *)v.data)[i], 0);
  ck_assert_ptr_eq(qkeep_param_lookup(layer, "weight_scale"), p);
  ck_assert_str_eq(qkeep_param_runtime_name(p), "weight_scale");
  ck_assert_int_eq(qkeep_param_create(layer, "weight_scale", &s, &p), QKEEP_E_EXISTS);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "model.layers.0.mlp.down_proj"));
  struct qkeep_census c = census();
  ck_assert_int_eq(c.loader_params, 1);
  ck_assert_int_eq(c.registered_same, 1);
  ck_assert_int_eq(c.total_bytes, 32);
  assert_clean(&c);
}
END_TEST

START_TEST(alias_then_replace_through_either_name_updates_both) {
  qkeep_param *p = make_param("weight_packed", QKEEP_DTYPE_U8, 16, 0x11);
  ck_assert_int_eq(qkeep_move(layer, "weight_packed", "weight"), 0);
  ck_assert_ptr_eq(qkeep_param_lookup(layer, "weight"), p);
  ck_assert_ptr_eq(qkeep_param_lookup(layer, "weight_packed"), p);
  ck_assert_str_eq(qkeep_param_runtime_name(p), "weight");
  ck_assert_str_eq(qkeep_param_checkpoint_name(p), "weight_packed");

  ck_assert_int_eq(qkeep_replace(layer, "weight", result(QKEEP_DTYPE_U8, 16, 0x22)), 0);
  ck_assert_int_eq(((unsigned char *)view("weight_packed").data)[15], 0x22);
  ck_assert_int_eq(qkeep_replace(layer, "weight_packed", result(QKEEP_DTYPE_U8, 16, 0x33)), 0);
  ck_assert_int_eq(((unsigned char *)view("weight").data)[0], 0x33);
  ck_assert_ptr_eq(view("weight").data, view("weight_packed").data);

  struct qkeep_census c = census();
  ck_assert_int_eq(c.aliases, 1);
  ck_assert_int_eq(c.loader_params, 1);
  assert_clean(&c);
}
END_TEST

START_TEST(move_is_idempotent_and_refuses_another_objects_name) {
  make_param("weight_packed", QKEEP_DTYPE_U8, 4, 1);
  make_param("weight", QKEEP_DTYPE_U8, 4, 2);
  ck_assert_int_eq(qkeep_move(layer, "weight_packed", "weight"), QKEEP_E_EXISTS);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "another object"));
  ck_assert_int_eq(qkeep_move(layer, "weight_packed", "w"), 0);
  ck_assert_int_eq(qkeep_move(layer, "weight_packed", "w"), 0); /* reload re-runs the move */
  ck_assert_int_eq(qkeep_move(layer, "nope", "x"), QKEEP_E_NOTFOUND);
  ck_assert_int_eq(census().aliases, 1);
}
END_TEST

START_TEST(shrink_into_prefix_keeps_data_pointer) {
  make_param("weight_scale_2", QKEEP_DTYPE_F32, 3, 0);
  float shards[3] = {0.5f, 2.0f, 1.0f};
  memcpy(view("weight_scale_2").data, shards, sizeof shards);
  void *before = view("weight_scale_2").data;
  struct qkeep_spec scalar = {.dtype = QKEEP_DTYPE_F32, .ndim = 0};
  qkeep_tensor *t;
  ck_assert_int_eq(qkeep_tensor_new(layer, &scalar, &t), 0);
  *(float *)qkeep_tensor_data(t) = 2.0f;
  ck_assert_int_eq(qkeep_replace(layer, "weight_scale_2", t), 0);
  struct qkeep_view v = view("weight_scale_2");
  ck_assert_ptr_eq(v.data, before);
  ck_assert_int_eq(v.spec.ndim, 0);
  ck_assert_uint_eq(v.nbytes, 4);
  ck_assert_uint_eq(v.capacity, 12);
  ck_assert_float_eq(*(float *)v.data, 2.0f);
  struct qkeep_census c = census();
  assert_clean(&c);
  ck_assert_int_eq(c.kept_bytes, 8); /* the two shard slots past the merged scale */
}
END_TEST

START_TEST(growth_rebinds_keeps_c1_and_rerun_is_in_place) {
  make_param("weight_scale", QKEEP_DTYPE_U8, 4, 7);
  void *before = view("weight_scale").data;
  ck_assert_int_eq(qkeep_replace(layer, "weight_scale", result(QKEEP_DTYPE_U8, 512, 9)), 0);
  struct qkeep_view v = view("weight_scale");
  ck_assert_ptr_ne(v.data, before);
  ck_assert_uint_ge(v.capacity, 512);
  ck_assert_int_eq(((unsigned char *)v.data)[511], 9);
  struct qkeep_census c = census();
  assert_clean(&c);
  /* A second PWAL on the same shapes (a reload) lands in place. */
  ck_assert_int_eq(qkeep_replace(layer, "weight_scale", result(QKEEP_DTYPE_U8, 512, 5)), 0);
  ck_assert_ptr_eq(view("weight_scale").data, v.data);
  ck_assert_int_eq(((unsigned char *)view("weight_scale").data)[0], 5);
}
END_TEST

START_TEST(replace_in_place_changes_only_the_view) {
  make_param("weight", QKEEP_DTYPE_U8, 16, 3);
  void *before = view("weight").data;
  struct qkeep_spec as_i32 = {.dtype = QKEEP_DTYPE_I32, .ndim = 2, .shape = {2, 2}};
  ck_assert_int_eq(qkeep_replace_in_place(layer, "weight", &as_i32), 0);
  struct qkeep_view v = view("weight");
  ck_assert_ptr_eq(v.data, before);
  ck_assert_int_eq(v.spec.dtype, QKEEP_DTYPE_I32);
  struct qkeep_spec too_big = spec1(QKEEP_DTYPE_U8, 17);
  ck_assert_int_eq(qkeep_replace_in_place(layer, "weight", &too_big), QKEEP_E_RULE);
  /* A result allocated elsewhere but computed into the param's own storage also counts as in place. */
  qkeep_param *p = qkeep_param_lookup(layer, "weight");
  qkeep_tensor *t = calloc(1, sizeof *t);
  t->layer = layer;
  t->t.storage = p->view.storage;
  storage_ref(t->t.storage);
  t->t.spec = spec1(QKEEP_DTYPE_U8, 8);
  ck_assert_int_eq(qkeep_replace(layer, "weight", t), 0);
  ck_assert_ptr_eq(view("weight").data, before);
  ck_assert_uint_eq(view("weight").nbytes, 8);
}
END_TEST

static int count_live(void *user, const char *name, const struct qkeep_view *v) {
  (void)v;
  char *seen = user;
  strcat(seen, name);
  strcat(seen, ";");
  return 0;
}

START_TEST(retire_hides_from_kernels_but_keeps_bytes) {
  make_param("weight", QKEEP_DTYPE_U8, 8, 1);
  make_param("input_scale", QKEEP_DTYPE_F32, 1, 0x3f);
  ck_assert_int_eq(qkeep_retire(layer, "input_scale"), 0);
  ck_assert_ptr_null(qkeep_get_live_param(layer, "input_scale"));
  ck_assert_ptr_nonnull(qkeep_get_live_param(layer, "weight"));
  ck_assert_ptr_nonnull(qkeep_param_lookup(layer, "input_scale"));
  char seen[256] = "";
  ck_assert_int_eq(qkeep_kernel_params(layer, count_live, seen), 0);
  ck_assert_str_eq(seen, "weight;");
  struct qkeep_view v = view("input_scale");
  ck_assert_int_eq(v.state, QKEEP_PARAM_RETIRED);
  ck_assert_uint_eq(v.nbytes, 4);
  ck_assert_int_eq(((unsigned char *)v.data)[3], 0x3f);
  struct qkeep_census c = census();
  ck_assert_int_eq(c.retired, 1);
  ck_assert_int_eq(c.retired_bytes, 4);
  ck_assert_int_eq(c.kept_bytes, 4);
  assert_clean(&c);
}
END_TEST

START_TEST(release_shows_in_census_with_reason) {
  make_param("weight", QKEEP_DTYPE_U8, 64, 1);
  make_param("weight_scale", QKEEP_DTYPE_U8, 8, 1);
  ck_assert_int_eq(qkeep_release(layer, "weight", ""), QKEEP_E_INVAL);
  ck_assert_int_eq(qkeep_release(layer, "weight", "opaque kernel copy"), 0);
  ck_assert_ptr_null(qkeep_get_live_param(layer, "weight"));
  struct qkeep_view v = view("weight");
  ck_assert_int_eq(v.state, QKEEP_PARAM_RELEASED);
  ck_assert_uint_eq(v.capacity, 0);
  ck_assert_int_eq(qkeep_replace(layer, "weight", result(QKEEP_DTYPE_U8, 64, 0)), QKEEP_E_STATE);
  ck_assert_int_eq(qkeep_retire(layer, "weight"), QKEEP_E_STATE);
  struct qkeep_census c = census();
  ck_assert_int_eq(c.released, 1);
  ck_assert_int_eq(c.released_bytes, 64);
  ck_assert_int_eq(c.reasons, 1);
  ck_assert_str_eq(c.reason[0], "opaque kernel copy");
  ck_assert_int_eq(c.c1, 0); /* released is reported on its own line, not as C1 */
  ck_assert_int_eq(c.missing, 0);
}
END_TEST

START_TEST(add_buffer_reuses_same_name_and_size) {
  make_param("weight", QKEEP_DTYPE_U8, 8, 1);
  struct qkeep_spec alpha = {.dtype = QKEEP_DTYPE_F32, .ndim = 0};
  struct qkeep_view a = {.size = sizeof a}, b = {.size = sizeof b};
  ck_assert_int_eq(qkeep_add_buffer(layer, "alpha", &alpha, &a), 0);
  *(float *)a.data = 3.0f;
  ck_assert_int_eq(qkeep_add_buffer(layer, "alpha", &alpha, &b), 0);
  ck_assert_ptr_eq(a.data, b.data);
  ck_assert_float_eq(*(float *)b.data, 3.0f);
  ck_assert_int_eq(qkeep_add_buffer(layer, "weight", &alpha, &b), QKEEP_E_EXISTS);
  struct qkeep_spec bigger = spec1(QKEEP_DTYPE_F32, 4);
  ck_assert_int_eq(qkeep_add_buffer(layer, "alpha", &bigger, &b), 0);
  ck_assert_uint_eq(b.capacity, 16);
  ck_assert_int_eq(qkeep_replace(layer, "alpha", result(QKEEP_DTYPE_U8, 1, 0)), QKEEP_E_INVAL);
  struct qkeep_census c = census();
  ck_assert_int_eq(c.buffers, 1);
  ck_assert_int_eq(c.loader_params, 1);
  ck_assert_int_eq(c.total_bytes, 8 + 16);
  assert_clean(&c);
}
END_TEST

/* Sizes that do not fit in size_t are refused, never wrapped to a small buffer. */
START_TEST(sizes_that_wrap_are_refused) {
  struct qkeep_spec huge = {.dtype = QKEEP_DTYPE_F32, .ndim = 2, .shape = {INT64_C(1) << 62, 8}};
  struct qkeep_view v = {.size = sizeof v};
  ck_assert_int_eq(qkeep_add_buffer(layer, "workspace", &huge, &v), QKEEP_E_INVAL);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "workspace"));
  qkeep_tensor *t = NULL;
  ck_assert_int_eq(qkeep_tensor_new(layer, &huge, &t), QKEEP_E_INVAL);
  ck_assert_ptr_null(t);
  ck_assert_int_eq(qkeep_param_create(layer, "weight", &huge, NULL), QKEEP_E_INVAL);
  struct qkeep_spec negative = {.dtype = QKEEP_DTYPE_U8, .ndim = 1, .shape = {-4}};
  ck_assert_int_eq(qkeep_add_buffer(layer, "workspace", &negative, &v), QKEEP_E_INVAL);
  struct qkeep_census c = census();
  ck_assert_int_eq(c.buffers, 0);
  ck_assert_int_eq(c.loader_params, 0);
}
END_TEST

/* The installed backend header sizes every dtype as the core does, sub-byte ones included. */
START_TEST(backend_util_header_agrees_with_the_core) {
  for (int d = 0; d < QKEEP_DTYPE_COUNT; d++) {
    ck_assert_msg(qkeep_be_dtype_bits((enum qkeep_dtype)d) == qkeep_dtype_bits((enum qkeep_dtype)d), "%s",
                  qkeep_dtype_name((enum qkeep_dtype)d));
    ck_assert_uint_eq(qkeep_be_dtype_size((enum qkeep_dtype)d), qkeep_dtype_size((enum qkeep_dtype)d));
    struct qkeep_spec sp = {(enum qkeep_dtype)d, 2, {3, 5}};
    size_t checked = 0;
    ck_assert(spec_bytes_checked(&sp, &checked));
    ck_assert_uint_eq(qkeep_be_spec_bytes(&sp), qkeep_spec_bytes(&sp));
    ck_assert_uint_eq(checked, qkeep_spec_bytes(&sp));
  }
  struct qkeep_spec f4 = {QKEEP_DTYPE_F4, 1, {3}};
  ck_assert_uint_eq(qkeep_be_spec_bytes(&f4), 2); /* 12 bits round up to 2 bytes */
}
END_TEST

/* A fusion rule that names a member twice would load one checkpoint tensor into two shards. */
START_TEST(fusion_rule_with_a_repeated_member_is_refused) {
  ck_assert_int_eq(qkeep_model_set_fusion(model, "qkv_proj=q_proj+q_proj+k_proj"), QKEEP_E_INVAL);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "member 'q_proj' is named twice"));
  ck_assert_int_eq(qkeep_model_set_fusion(model, "qkv_proj=q_proj+k_proj+v_proj"), 0);
}
END_TEST

/* host->get_live, which backends read with: live params and buffers, not retired params. */
START_TEST(host_get_live_finds_buffers_and_live_params_only) {
  const struct qkeep_host *host = host_table();
  make_param("weight", QKEEP_DTYPE_U8, 8, 1);
  make_param("input_scale", QKEEP_DTYPE_F32, 1, 0);
  struct qkeep_spec alpha = {.dtype = QKEEP_DTYPE_F32, .ndim = 0};
  struct qkeep_view b = {.size = sizeof b}, v = {.size = sizeof v};
  ck_assert_int_eq(qkeep_add_buffer(layer, "alpha", &alpha, &b), 0);
  ck_assert_int_eq(host->get_live(layer, "alpha", &v), 0); /* a buffer is live */
  ck_assert_ptr_eq(v.data, b.data);
  ck_assert_int_eq(host->get_live(layer, "weight", &v), 0);
  ck_assert_int_eq(qkeep_retire(layer, "input_scale"), 0);
  ck_assert_int_eq(host->get_live(layer, "input_scale", &v), QKEEP_E_NOTFOUND);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "retired or released"));
  ck_assert_int_eq(host->get_live(layer, "nothing", &v), QKEEP_E_NOTFOUND);
}
END_TEST

static int count_cb(void *user, const char *l, const char *n, const void *d, size_t cap) {
  (void)l, (void)n, (void)d, (void)cap;
  ++*(int *)user;
  return 0;
}

static int count_names(void *user, const char *name, bool is_buffer, const struct qkeep_view *v) {
  (void)name, (void)is_buffer, (void)v;
  ++*(int *)user;
  return 0;
}

START_TEST(storage_iteration_yields_an_alias_once) {
  make_param("weight_packed", QKEEP_DTYPE_U8, 8, 1);
  make_param("weight_scale", QKEEP_DTYPE_U8, 4, 1);
  ck_assert_int_eq(qkeep_move(layer, "weight_packed", "weight"), 0);
  struct qkeep_spec alpha = {.dtype = QKEEP_DTYPE_F32, .ndim = 0};
  ck_assert_int_eq(qkeep_add_buffer(layer, "alpha", &alpha, NULL), 0);
  int storages = 0, names = 0;
  ck_assert_int_eq(qkeep_foreach_storage(model, count_cb, &storages), 0);
  ck_assert_int_eq(qkeep_foreach_name(layer, count_names, &names), 0);
  ck_assert_int_eq(storages, 3);
  ck_assert_int_eq(names, 4);
  char seen[256] = "";
  ck_assert_int_eq(qkeep_kernel_params(layer, count_live, seen), 0);
  ck_assert_str_eq(seen, "weight;weight_scale;"); /* once, under the runtime name */
}
END_TEST

START_TEST(census_catches_planted_c1) {
  qkeep_param *p = make_param("weight", QKEEP_DTYPE_U8, 64, 1);
  /* A backend that rebinds the storage itself to something smaller breaks C1. */
  struct storage *small;
  ck_assert_int_eq(storage_new(host_device(), 16, &small), 0);
  storage_unref(p->view.storage);
  p->view.storage = small;
  p->view.spec = spec1(QKEEP_DTYPE_U8, 16);
  struct qkeep_census c = census();
  ck_assert_int_eq(c.c1, 1);
  ck_assert_int_eq(c.c2, 0);
  ck_assert_int_eq(c.missing, 0);
}
END_TEST

START_TEST(census_catches_planted_c2) {
  qkeep_param *a = make_param("weight", QKEEP_DTYPE_U8, 64, 1);
  qkeep_param *b = make_param("weight_t", QKEEP_DTYPE_U8, 64, 1);
  /* Two distinct objects sharing one storage (vLLM's nn.Parameter(old.data) rename). */
  storage_unref(b->view.storage);
  b->view.storage = a->view.storage;
  storage_ref(a->view.storage);
  struct qkeep_census c = census();
  ck_assert_int_eq(c.c2, 1);
  ck_assert_int_eq(c.c1, 0);
  ck_assert_int_eq(c.total_bytes, 64);
}
END_TEST

START_TEST(census_catches_planted_missing) {
  qkeep_param *p = make_param("input_scale", QKEEP_DTYPE_F32, 1, 0);
  make_param("weight", QKEEP_DTYPE_U8, 8, 0);
  /* A backend that re-registers the name onto a new object (vLLM's rebind) loses the loaded one. */
  struct name_entry *e = layer_find_name(layer, "input_scale");
  e->param = qkeep_param_lookup(layer, "weight");
  struct qkeep_census c = census();
  ck_assert_int_eq(c.missing, 1);
  ck_assert_int_eq(c.registered_same, 1);
  ck_assert_int_eq(c.aliases, 0);
  e->param = p;
  ck_assert_int_eq(census().missing, 0);
}
END_TEST

static void digest_of(qkeep_model *m, struct qkeep_digest *d) { ck_assert_int_eq(qkeep_digest(m, d), 0); }

START_TEST(digest_tracks_bytes_dtype_shape_and_names) {
  make_param("weight", QKEEP_DTYPE_U8, 8, 1);
  struct qkeep_digest d0, d1, d2, d3;
  digest_of(model, &d0);
  digest_of(model, &d1);
  ck_assert(d0.hi == d1.hi && d0.lo == d1.lo);
  ((unsigned char *)view("weight").data)[7] ^= 1;
  digest_of(model, &d2);
  ck_assert(d2.hi != d0.hi || d2.lo != d0.lo);
  ((unsigned char *)view("weight").data)[7] ^= 1;
  struct qkeep_spec as_i8 = spec1(QKEEP_DTYPE_I8, 8);
  ck_assert_int_eq(qkeep_replace_in_place(layer, "weight", &as_i8), 0);
  digest_of(model, &d3);
  ck_assert(d3.hi != d0.hi || d3.lo != d0.lo);
  struct qkeep_spec back = spec1(QKEEP_DTYPE_U8, 8);
  ck_assert_int_eq(qkeep_replace_in_place(layer, "weight", &back), 0);
  digest_of(model, &d3);
  ck_assert(d3.hi == d0.hi && d3.lo == d0.lo);
  ck_assert_int_eq(qkeep_move(layer, "weight", "w"), 0); /* a new registered name changes it */
  digest_of(model, &d3);
  ck_assert(d3.hi != d0.hi || d3.lo != d0.lo);
  char hex[33];
  qkeep_digest_hex(&d0, hex);
  ck_assert_uint_eq(strlen(hex), 32);
}
END_TEST

/* ---- a mock device: params must live in the backend's memory, through its ops ---- */

static int allocs, frees, copies;

static int mock_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  (void)be;
  allocs++;
  *out = malloc(bytes ? bytes : 1);
  return *out ? 0 : QKEEP_E_NOMEM;
}
static void mock_free(const struct qkeep_backend *be, void *p) {
  (void)be;
  frees++;
  free(p);
}
static int mock_copy(const struct qkeep_backend *be, void *d, const void *s, size_t n) {
  (void)be;
  copies++;
  memmove(d, s, n);
  return 0;
}
static int mock_fill(const struct qkeep_backend *be, void *d, int v, size_t n) {
  (void)be;
  memset(d, v, n);
  return 0;
}
static int mock_failing_fill(const struct qkeep_backend *be, void *d, int v, size_t n) {
  (void)be, (void)d, (void)v, (void)n;
  return QKEEP_E_DEVICE;
}
static int mock_sync(const struct qkeep_backend *be) {
  (void)be;
  return 0;
}

/* A backend whose memory ops are the mocks above: params, results and spares live in its memory. */
struct mock_device {
  struct qkeep_memory_ops ops;
  struct qkeep_backend be;
  struct qkeep_plugin plugin;
};
static void mock_device_init(struct mock_device *d) {
  d->ops = (struct qkeep_memory_ops){.size = sizeof d->ops,
                                     .alloc = mock_alloc,
                                     .free = mock_free,
                                     .copy_h2d = mock_copy,
                                     .copy_d2h = mock_copy,
                                     .copy_d2d = mock_copy,
                                     .fill = mock_fill,
                                     .sync = mock_sync};
  d->be = (struct qkeep_backend){.size = sizeof d->be, .name = "mock", .memory = &d->ops};
  d->plugin = (struct qkeep_plugin){.path = "mock", .be = &d->be};
}

/* A result of spec filled with 0xab and freed, which during a load leaves its memory as the spare. */
static void *spare_of(qkeep_layer *l, const struct qkeep_spec *spec) {
  qkeep_tensor *t;
  ck_assert_int_eq(qkeep_tensor_new(l, spec, &t), 0);
  void *data = qkeep_tensor_data(t);
  memset(data, 0xab, qkeep_spec_bytes(spec));
  qkeep_tensor_free(t);
  return data;
}

START_TEST(params_live_in_the_backends_memory) {
  struct mock_device dev;
  mock_device_init(&dev);
  qkeep_model *m;
  qkeep_layer *l;
  allocs = frees = copies = 0;
  ck_assert_int_eq(qkeep_model_new(&dev.plugin, &m), 0);
  ck_assert_int_eq(qkeep_layer_add(m, "x", QKEEP_LAYER_LINEAR, NULL, &l), 0);
  struct qkeep_spec s = spec1(QKEEP_DTYPE_U8, 32);
  ck_assert_int_eq(qkeep_param_create(l, "weight", &s, NULL), 0);
  ck_assert_int_eq(allocs, 1);
  qkeep_tensor *t;
  ck_assert_int_eq(qkeep_tensor_new(l, &s, &t), 0);
  ck_assert_int_eq(qkeep_replace(l, "weight", t), 0);
  ck_assert_int_ge(copies, 1); /* the prefix copy went through copy_d2d */
  struct qkeep_digest d;
  ck_assert_int_eq(qkeep_digest(m, &d), 0);
  qkeep_model_free(m);
  ck_assert_int_eq(allocs, frees);

  /* A device error surfaces with context, and nothing leaks. */
  dev.ops.fill = mock_failing_fill;
  ck_assert_int_eq(qkeep_model_new(&dev.plugin, &m), 0);
  ck_assert_int_eq(qkeep_layer_add(m, "y", QKEEP_LAYER_LINEAR, NULL, &l), 0);
  ck_assert_int_eq(qkeep_param_create(l, "weight", &s, NULL), QKEEP_E_DEVICE);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "y.weight"));
  ck_assert_ptr_null(qkeep_param_lookup(l, "weight"));
  qkeep_model_free(m);
  ck_assert_int_eq(allocs, frees);
}
END_TEST

/* During a load, a freed result's memory serves the next result (zero-filled again) instead of a
 * free and an alloc; a param never keeps a spare larger than itself; ending the load frees it. */
START_TEST(results_reuse_a_spare_during_a_load) {
  struct mock_device dev;
  mock_device_init(&dev);
  qkeep_model *m;
  qkeep_layer *l;
  allocs = frees = copies = 0;
  ck_assert_int_eq(qkeep_model_new(&dev.plugin, &m), 0);
  ck_assert_int_eq(qkeep_layer_add(m, "x", QKEEP_LAYER_LINEAR, NULL, &l), 0);
  struct qkeep_spec small = spec1(QKEEP_DTYPE_U8, 16), big = spec1(QKEEP_DTYPE_U8, 1000),
                    mid = spec1(QKEEP_DTYPE_U8, 500);
  ck_assert_int_eq(qkeep_param_create(l, "weight", &small, NULL), 0);
  struct qkeep_memory_stats now = {.size = sizeof now};
  ck_assert_int_eq(qkeep_model_memory(m, &now, false), 0);
  ck_assert_int_eq(now.storage_bytes, 16);
  model_spares(m, true);
  void *first = spare_of(l, &big);
  qkeep_tensor *t;
  int allocated = allocs;
  ck_assert_int_eq(qkeep_tensor_new(l, &mid, &t), 0);
  ck_assert_ptr_eq(qkeep_tensor_data(t), first); /* the spare, not a new allocation */
  ck_assert_int_eq(allocs, allocated);
  for (size_t i = 0; i < 500; i++)
    ck_assert_uint_eq(((unsigned char *)qkeep_tensor_data(t))[i], 0); /* zero-filled as promised */
  ((unsigned char *)qkeep_tensor_data(t))[7] = 7;
  /* 500 bytes do not fit the 16-byte weight: it is rebound, to memory of its own size */
  ck_assert_int_eq(qkeep_replace(l, "weight", t), 0);
  struct qkeep_view v = {.size = sizeof v};
  ck_assert_int_eq(qkeep_view_of(l, "weight", &v), 0);
  ck_assert_ptr_ne(v.data, first);
  ck_assert_uint_eq(v.capacity, 500);
  ck_assert_uint_eq(((const unsigned char *)v.data)[7], 7);
  ck_assert_int_eq(qkeep_model_memory(m, &now, false), 0);
  ck_assert_int_eq(now.storage_bytes, 500 + 1000); /* the weight, and the spare the device still holds */
  /* Spares nest (a weight sync keeps one across the reloads of its buckets): an inner end keeps it. */
  model_spares(m, true);
  model_spares(m, false);
  ck_assert_int_eq(qkeep_model_memory(m, &now, false), 0);
  ck_assert_int_eq(now.storage_bytes, 500 + 1000);
  ck_assert_int_eq(qkeep_tensor_new(l, &mid, &t), 0);
  ck_assert_ptr_eq(qkeep_tensor_data(t), first); /* still the spare */
  qkeep_tensor_free(t);
  model_spares(m, false);
  ck_assert_int_eq(qkeep_model_memory(m, &now, false), 0);
  ck_assert_int_eq(now.storage_bytes, 500);
  ck_assert_int_eq(frees, allocs - 1); /* only the weight is left */
  /* Outside a load, a freed result's memory goes back at once. */
  ck_assert_int_eq(qkeep_tensor_new(l, &mid, &t), 0);
  qkeep_tensor_free(t);
  ck_assert_int_eq(frees, allocs - 1);
  qkeep_model_free(m);
  ck_assert_int_eq(allocs, frees);
}
END_TEST

/* The host's unfilled result (ABI 1.7) skips the zero-fill: from the spare it keeps the bytes the spare
 * had, and written whole it lands in the param as a filled one does; outside a load it is fresh memory. */
START_TEST(an_unfilled_result_is_not_filled_and_replaces_as_any) {
  struct mock_device dev;
  mock_device_init(&dev);
  const struct qkeep_host *host = host_table();
  ck_assert(QKEEP_HAS_SLOT(host, struct qkeep_host, tensor_new_unfilled));
  qkeep_model *m;
  qkeep_layer *l;
  allocs = frees = 0;
  ck_assert_int_eq(qkeep_model_new(&dev.plugin, &m), 0);
  ck_assert_int_eq(qkeep_layer_add(m, "x", QKEEP_LAYER_LINEAR, NULL, &l), 0);
  struct qkeep_spec w = spec1(QKEEP_DTYPE_U8, 600), big = spec1(QKEEP_DTYPE_U8, 1000),
                    mid = spec1(QKEEP_DTYPE_U8, 500);
  ck_assert_int_eq(qkeep_param_create(l, "weight", &w, NULL), 0);
  model_spares(m, true);
  void *first = spare_of(l, &big);
  qkeep_tensor *t;
  ck_assert_int_eq(host->tensor_new_unfilled(l, &mid, &t), 0);
  unsigned char *bytes = qkeep_tensor_data(t);
  ck_assert_ptr_eq(bytes, first);
  for (size_t i = 0; i < 500; i++)
    ck_assert_uint_eq(bytes[i], 0xab); /* not filled */
  for (size_t i = 0; i < 500; i++)
    bytes[i] = (unsigned char)(i * 7);
  struct qkeep_view before = {.size = sizeof before}, after = {.size = sizeof after};
  ck_assert_int_eq(qkeep_view_of(l, "weight", &before), 0);
  ck_assert_int_eq(qkeep_replace(l, "weight", t), 0); /* 500 bytes fit the 600-byte weight: copied in */
  ck_assert_int_eq(qkeep_view_of(l, "weight", &after), 0);
  ck_assert_ptr_eq(after.data, before.data);
  ck_assert_uint_eq(after.nbytes, 500);
  for (size_t i = 0; i < 500; i++)
    ck_assert_uint_eq(((const unsigned char *)after.data)[i], (unsigned char)(i * 7));
  model_spares(m, false);
  ck_assert_int_eq(host->tensor_new_unfilled(l, &mid, &t), 0); /* outside a load: fresh memory */
  qkeep_tensor_free(t);
  struct qkeep_spec bad = {.dtype = QKEEP_DTYPE_U8, .ndim = 1, .shape = {-1}};
  ck_assert_int_eq(host->tensor_new_unfilled(l, &bad, &t), QKEEP_E_INVAL);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "tensor_new_unfilled"));
  qkeep_model_free(m);
  ck_assert_int_eq(allocs, frees);
}
END_TEST

START_TEST(errors_name_layer_and_param) {
  ck_assert_int_eq(qkeep_retire(layer, "weight_scale"), QKEEP_E_NOTFOUND);
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "model.layers.0.mlp.down_proj"));
  ck_assert_ptr_nonnull(strstr(qkeep_errmsg(), "weight_scale"));
  ck_assert_int_eq(qkeep_layer_add(model, "model.layers.0.mlp.down_proj", QKEEP_LAYER_LINEAR, NULL, NULL),
                   QKEEP_E_EXISTS);
  ck_assert_str_eq(qkeep_strerror(QKEEP_E_RULE), "lifecycle rule violated");
}
END_TEST

static Suite *rules_suite(void) {
  Suite *s = suite_create("rules");
  TCase *tc = tcase_create("rules");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, create_is_zeroed_exact_and_registered);
  tcase_add_test(tc, alias_then_replace_through_either_name_updates_both);
  tcase_add_test(tc, move_is_idempotent_and_refuses_another_objects_name);
  tcase_add_test(tc, shrink_into_prefix_keeps_data_pointer);
  tcase_add_test(tc, growth_rebinds_keeps_c1_and_rerun_is_in_place);
  tcase_add_test(tc, replace_in_place_changes_only_the_view);
  tcase_add_test(tc, an_unfilled_result_is_not_filled_and_replaces_as_any);
  tcase_add_test(tc, retire_hides_from_kernels_but_keeps_bytes);
  tcase_add_test(tc, release_shows_in_census_with_reason);
  tcase_add_test(tc, add_buffer_reuses_same_name_and_size);
  tcase_add_test(tc, host_get_live_finds_buffers_and_live_params_only);
  tcase_add_test(tc, sizes_that_wrap_are_refused);
  tcase_add_test(tc, fusion_rule_with_a_repeated_member_is_refused);
  tcase_add_test(tc, backend_util_header_agrees_with_the_core);
  tcase_add_test(tc, storage_iteration_yields_an_alias_once);
  tcase_add_test(tc, census_catches_planted_c1);
  tcase_add_test(tc, census_catches_planted_c2);
  tcase_add_test(tc, census_catches_planted_missing);
  tcase_add_test(tc, digest_tracks_bytes_dtype_shape_and_names);
  tcase_add_test(tc, params_live_in_the_backends_memory);
  tcase_add_test(tc, results_reuse_a_spare_during_a_load);
  tcase_add_test(tc, errors_name_layer_and_param);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return tu_run_suite(rules_suite(), CK_NORMAL); }
