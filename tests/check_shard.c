/*
 * check_shard.c: tensor- and expert-parallel loading, T = 2, 4 and 8 ranks simulated in
 * one process, for every scheme. Each rank's params must be byte-equal to the matching
 * rows or columns of a one-rank cold load (the oracle cuts the one-rank params itself,
 * from this file's own table of which dimension carries N and K in each checkpoint
 * layout); fused members are cut one by one, then fused. Indivisible dims are refused
 * before anything is allocated; each rank's census is clean and its in-place reload
 * equals a cold sharded load of W1 with no data pointer moved. Weight sync (buckets,
 * in-process transport, NCCL's absence) has its own cases at the end.
 */
#include <check.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <dlfcn.h>

#include "ckptutil.h"
#include "fixture.h"
#include "private.h"
#include "testutil.h"

#define H 64   /* hidden: K of the column-parallel layers */
#define Q 256  /* q_proj N, o_proj K */
#define KV 64  /* k_proj, v_proj N: 8 per rank at T = 8 (zero points pack 8 along N) */
#define I 256  /* dense MLP intermediate */
#define E 8    /* experts */
#define MI 256 /* expert intermediate */
#define VOCAB 64

/* Llama-like: embedding, attention and a dense MLP in layer 0, an MoE block of E experts in layer 1. */
static char *write_source(const char *file, uint64_t seed) {
  struct st_writer *w;
  char name[160];
  ck_assert_int_eq(st_writer_new(&w), 0);
  tu_add_source_f32(w, "model.embed_tokens.weight", VOCAB, H, seed);
  tu_add_source_f32(w, "model.norm.weight", H, 0, seed);
  tu_add_source_f32(w, "lm_head.weight", VOCAB, H, seed);
  tu_add_source_f32(w, "model.layers.0.input_layernorm.weight", H, 0, seed);
  static const char *const proj[] = {"q_proj", "k_proj", "v_proj"};
  for (int p = 0; p < 3; p++) {
    snprintf(name, sizeof name, "model.layers.0.self_attn.%s.weight", proj[p]);
    tu_add_source_f32(w, name, p ? KV : Q, H, seed);
  }
  tu_add_source_f32(w, "model.layers.0.self_attn.o_proj.weight", H, Q, seed);
  tu_add_source_f32(w, "model.layers.0.mlp.gate_proj.weight", I, H, seed);
  tu_add_source_f32(w, "model.layers.0.mlp.up_proj.weight", I, H, seed);
  tu_add_source_f32(w, "model.layers.0.mlp.down_proj.weight", H, I, seed);
  tu_add_source_f32(w, "model.layers.1.mlp.gate.weight", E, H, seed);
  for (int e = 0; e < E; e++) {
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.gate_proj.weight", e);
    tu_add_source_f32(w, name, MI, H, seed);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.up_proj.weight", e);
    tu_add_source_f32(w, name, MI, H, seed);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.down_proj.weight", e);
    tu_add_source_f32(w, name, H, MI, seed);
  }
  char *path = tu_path(dir, file);
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  return path;
}

/* A gpt-oss MXFP4 MoE block (pre-stacked, interleaved gate/up rows): random codes, valid e8m0 scales. */
static char *write_gptoss(const char *name_dir, uint64_t seed) {
  char *d = tu_path(dir, name_dir);
  ck_assert_int_eq(mkdir(d, 0755), 0);
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  static const struct {
    const char *name;
    int64_t rows, cols;
  } mats[2] = {{"gate_up_proj", 2 * MI, H}, {"down_proj", H, MI}};
  uint64_t s = seed;
  for (int m = 0; m < 2; m++) {
    int64_t rows = mats[m].rows, cols = mats[m].cols;
    size_t nb = (size_t)(E * rows * cols / 2), ns = (size_t)(E * rows * cols / 32),
           nbias = (size_t)(E * rows);
    uint8_t *blocks = malloc(nb), *sc = malloc(ns);
    uint16_t *bias = malloc(nbias * 2);
    for (size_t i = 0; i < nb; i++)
      blocks[i] = (uint8_t)tu_rand(&s);
    for (size_t i = 0; i < ns; i++)
      sc[i] = (uint8_t)(120 + tu_rand(&s) % 12);
    for (size_t i = 0; i < nbias; i++)
      bias[i] = (uint16_t)(0x3c00 + tu_rand(&s) % 256);
    tu_add_gptoss_experts(w, "model.layers.0.mlp.experts", mats[m].name, E, rows, cols, blocks, sc, bias);
    free(blocks), free(sc), free(bias);
  }
  tu_add_source_f32(w, "model.layers.0.mlp.router.weight", E, H, seed);
  char *file = tu_path(d, "model.safetensors"), *config = tu_path(d, "config.json");
  ck_assert_int_eq(st_writer_write(w, file), 0);
  st_writer_free(w);
  const char *cfg = "{\"quantization_config\": {\"quant_method\": \"mxfp4\", \"modules_to_not_convert\": "
                    "[\"model.layers.*.mlp.router\"]}}";
  ck_assert_int_eq(tu_write_file(config, cfg, strlen(cfg)), 0);
  free(file), free(config);
  return d;
}

/* The schemes: every scheme_*.c, gpt-oss's pre-stacked MXFP4 MoE and plain bf16 (kv scales with each). */
static const char *const schemes[] = {"unquantized", "modelopt-nvfp4", "ct-nvfp4", "mxfp4",  "w8a8-int8",
                                      "gptq-int4",   "awq-int4",       "ct-int4",  "gpt-oss"};
#define N_SCHEMES (sizeof schemes / sizeof schemes[0])

/* W0 (seed 1) or W1 (seed 2) of a scheme, written under the test's directory. */
static char *checkpoint(const char *scheme, int which) {
  char name[64];
  snprintf(name, sizeof name, "%s-w%d", scheme, which);
  if (strcmp(scheme, "gpt-oss") == 0)
    return write_gptoss(name, (uint64_t)which + 1);
  snprintf(name, sizeof name, "source-w%d.safetensors", which);
  char *source = write_source(name, (uint64_t)which + 1);
  if (strcmp(scheme, "unquantized") == 0)
    return source;
  snprintf(name, sizeof name, "%s-w%d", scheme, which);
  char *path = tu_path(dir, name);
  struct qkeep_quantize_options o = {.size = sizeof o,
                                     .scheme = scheme,
                                     .group_size = 32,
                                     .kv_cache_scales = true,
                                     .static_input = true,
                                     .asym_weights = strcmp(scheme, "ct-int4") == 0,
                                     .activation_amax = 4};
  ck_assert_msg(qkeep_quantize(source, path, &o) == 0, "%s: %s", scheme, qkeep_errmsg());
  free(source);
  return path;
}

/* A host-memory model (no backend, no PWAL: params keep the checkpoint layout) of one rank. */
static qkeep_model *load_rank(const char *path, qkeep_plugin *be, int tp, int ep, int tp_rank, int ep_rank) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(be, &m), 0);
  struct qkeep_parallel p = {
      .size = sizeof p, .tp_size = tp, .tp_rank = tp_rank, .ep_size = ep, .ep_rank = ep_rank};
  ck_assert_int_eq(qkeep_model_set_parallel(m, &p), 0);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s (tp %d/%d, ep %d/%d): %s", path, tp_rank, tp, ep_rank, ep,
                qkeep_errmsg());
  return m;
}

/* ---- the oracle: which dimension of each checkpoint layout carries N and K ---- */

struct layout_dims {
  const char *name; /* a param's local name (after w13_ / w2_) */
  int n_dim, k_dim; /* in the per-matrix tensor (no expert dim); -1: none */
};
static const struct layout_dims layouts[] = {
    {"weight", 0, 1},
    {"weight_packed", 0, 1},
    {"weight_scale", 0, 1},
    {"bias", 0, -1},
    {"qweight", 1, 0},
    {"qzeros", 1, 0},
    {"scales", 1, 0},
    {"g_idx", -1, 0},
    {"weight_zero_point", 0, 1},
    {"weight_g_idx", -1, 0},
    {"weight_shape", -1, -1},
    /* gpt-oss, already stacked [E, ...]: given here without the expert dim */
    {"gate_up_proj_blocks", 0, 1},
    {"gate_up_proj_scales", 0, 1},
    {"gate_up_proj_bias", 0, -1},
    {"down_proj_blocks", 0, 1},
    {"down_proj_scales", 0, 1},
    {"down_proj_bias", 0, -1},
};

static const struct layout_dims *layout_of(const char *local) {
  for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++)
    if (strcmp(layouts[i].name, local) == 0)
      return &layouts[i];
  return NULL; /* scalars and per-shard scales: repeated */
}

static bool ends_with(const char *s, const char *suffix) {
  size_t a = strlen(s), b = strlen(suffix);
  return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* Whether a layer is column- or row-parallel, by its Llama name (the test's own list). */
static int dense_role(const char *layer) {
  static const char *const column[] = {".qkv_proj", ".gate_up_proj", ".q_proj", ".k_proj", ".v_proj"};
  static const char *const row[] = {".o_proj", ".down_proj"};
  for (size_t i = 0; i < 5; i++)
    if (ends_with(layer, column[i]))
      return 'c';
  for (size_t i = 0; i < 2; i++)
    if (ends_with(layer, row[i]))
      return 'r';
  return 0;
}

/* A range along the cut dimension, in elements of it. */
struct range {
  int64_t start, len;
};

/* The bytes of full (spec f) restricted along dim d to ranges[0..n), in order. */
static unsigned char *cut_bytes(const unsigned char *full, const struct qkeep_spec *f, int d,
                                const struct range *ranges, int n, size_t *out_bytes) {
  size_t inner = qkeep_dtype_size(f->dtype), outer = 1, total = 0;
  for (int i = d + 1; i < f->ndim; i++)
    inner *= (size_t)f->shape[i];
  for (int i = 0; i < d; i++)
    outer *= (size_t)f->shape[i];
  for (int r = 0; r < n; r++)
    total += (size_t)ranges[r].len;
  unsigned char *out = malloc(outer * total * inner + 1), *at = out;
  for (size_t o = 0; o < outer; o++)
    for (int r = 0; r < n; r++) {
      size_t row = (size_t)f->shape[d] * inner;
      memcpy(at, full + o * row + (size_t)ranges[r].start * inner, (size_t)ranges[r].len * inner);
      at += (size_t)ranges[r].len * inner;
    }
  *out_bytes = outer * total * inner;
  return out;
}

/*
 * Checks one param of a rank against the one-rank param: cut `role` ('c' by N per fused
 * member, 'r' by K, 'e' by experts, 0 none) over `ranks`.
 */
static void check_param(const qkeep_layer *full_layer, const qkeep_param *fp, const qkeep_param *rp, int role,
                        int ranks, int rank) {
  const char *local = fp->checkpoint_name;
  bool moe = full_layer->kind == QKEEP_LAYER_MOE, gptoss = strstr(local, "_proj_") != NULL;
  if (strncmp(local, "w13_", 4) == 0 || strncmp(local, "w2_", 3) == 0)
    local = strchr(local, '_') + 1;
  const struct layout_dims *ld = layout_of(local);
  const struct qkeep_spec *f = &fp->view.spec, *r = &rp->view.spec;
  int lead = moe ? 1 : 0, d = -1;
  struct range ranges[8];
  int n_ranges = 1;
  if (role == 'e') {
    d = 0;
    ranges[0] = (struct range){f->shape[0] / ranks * rank, f->shape[0] / ranks};
  } else if (role == 'c' && ld && ld->n_dim >= 0) {
    d = ld->n_dim + lead;
    /* Members of a fused param: its N rows split as the layer's shard_n (in units of this dim). */
    int shards =
        full_layer->dims.shards > 1 && !(moe && strncmp(fp->checkpoint_name, "w2_", 3) == 0) && !gptoss
            ? full_layer->dims.shards
            : 1;
    int64_t before = 0, n_total = full_layer->dims.n;
    n_ranges = shards;
    for (int s = 0; s < shards; s++) {
      int64_t member = shards > 1 ? f->shape[d] * full_layer->dims.shard_n[s] / n_total : f->shape[d];
      ranges[s] = (struct range){before + member / ranks * rank, member / ranks};
      before += member;
    }
  } else if (role == 'r' && ld && ld->k_dim >= 0 && f->shape[ld->k_dim + lead] > 1) {
    d = ld->k_dim + lead; /* a K/G of 1 (channelwise scales) is repeated */
    ranges[0] = (struct range){f->shape[d] / ranks * rank, f->shape[d] / ranks};
  }
  size_t fbytes = qkeep_spec_bytes(f), rbytes = qkeep_spec_bytes(r);
  const unsigned char *fb = tensor_ptr(&fp->view), *rb = tensor_ptr(&rp->view);
  if (d < 0) { /* repeated: the whole param */
    ck_assert_msg(spec_equal(f, r), "%s.%s: repeated, but shaped differently", full_layer->name,
                  fp->checkpoint_name);
    ck_assert_msg(memcmp(fb, rb, fbytes) == 0, "%s.%s (rank %d of %d): repeated bytes differ",
                  full_layer->name, fp->checkpoint_name, rank, ranks);
    return;
  }
  size_t want_bytes;
  unsigned char *want = cut_bytes(fb, f, d, ranges, n_ranges, &want_bytes);
  struct qkeep_spec ws = *f;
  ws.shape[d] = 0;
  for (int i = 0; i < n_ranges; i++)
    ws.shape[d] += ranges[i].len;
  char a[96], b[96];
  ck_assert_msg(spec_equal(&ws, r), "%s.%s (rank %d of %d): shape %s, expected %s", full_layer->name,
                fp->checkpoint_name, rank, ranks, spec_shape_str(r, a, sizeof a),
                spec_shape_str(&ws, b, sizeof b));
  ck_assert_uint_eq(want_bytes, rbytes);
  ck_assert_msg(memcmp(want, rb, rbytes) == 0,
                "%s.%s (rank %d of %d): bytes are not the cut of the one-rank "
                "param",
                full_layer->name, fp->checkpoint_name, rank, ranks);
  free(want);
}

/* Every param of every layer of a rank against the one-rank model. Returns how many were cut. */
static int check_rank(qkeep_model *full, qkeep_model *m, int tp, int ep, int tp_rank, int ep_rank) {
  int cut = 0;
  ck_assert_uint_eq(qkeep_model_layer_count(full), qkeep_model_layer_count(m));
  for (size_t l = 0; l < qkeep_model_layer_count(full); l++) {
    qkeep_layer *fl = qkeep_model_layer(full, l), *rl = qkeep_model_layer(m, l);
    ck_assert_str_eq(fl->name, rl->name);
    int role = 0, ranks = 1, rank = 0;
    if (fl->kind == QKEEP_LAYER_MOE && ep > 1)
      role = 'e', ranks = ep, rank = ep_rank;
    else if (tp > 1 && (fl->kind == QKEEP_LAYER_LINEAR || fl->kind == QKEEP_LAYER_MOE))
      role = fl->kind == QKEEP_LAYER_MOE ? 'm' : dense_role(fl->name), ranks = tp, rank = tp_rank;
    struct qkeep_layer_shard sh = {.size = sizeof sh};
    ck_assert_int_eq(qkeep_layer_get_shard(rl, &sh), 0);
    ck_assert_int_eq(sh.ranks, role ? ranks : 1);
    ck_assert_int_eq(sh.n, fl->dims.n);
    ck_assert_int_eq(sh.k, fl->dims.k);
    ck_assert_uint_eq(fl->n_params, rl->n_params);
    for (size_t i = 0; i < fl->n_params; i++) {
      const qkeep_param *fp = fl->params[i], *rp = rl->params[i];
      ck_assert_str_eq(fp->checkpoint_name, rp->checkpoint_name);
      int prole = role;
      if (role == 'm') /* MoE under TP: w13 (gpt-oss gate_up) by column, w2 (down) by row */
        prole = strncmp(fp->checkpoint_name, "w2_", 3) == 0 || strncmp(fp->checkpoint_name, "down_", 5) == 0
                    ? 'r'
                    : 'c';
      check_param(fl, fp, rp, prole, ranks, rank);
      cut += !spec_equal(&fp->view.spec, &rp->view.spec);
    }
    if (role == 'c' || (role == 'm' && !(fl->dims.flags & QKEEP_LAYER_F_INTERLEAVED_W13)))
      ck_assert_int_eq(rl->dims.n * ranks, fl->dims.n);
    if (role == 'r')
      ck_assert_int_eq(rl->dims.k * ranks, fl->dims.k);
    if (role == 'e')
      ck_assert_int_eq(rl->dims.experts * ranks, fl->dims.experts);
  }
  return cut;
}

/*
 * Whether rank r of t is checked: every rank, or under a memory checker (valgrind, ASan) the first and
 * the last, whose slices start and end each cut; the ranks between run the same code at other offsets.
 * Plain make check checks every rank.
 */
static bool rank_checked(int r, int t) { return !tu_under_memcheck() || r == 0 || r == t - 1; }

START_TEST(every_rank_holds_its_rows_and_columns_of_a_one_rank_load) {
  const char *scheme = schemes[_i];
  char *w0 = checkpoint(scheme, 0);
  qkeep_model *full = load_rank(w0, NULL, 1, 1, 0, 0);
  static const int sizes[] = {2, 4, 8};
  for (int si = 0; si < 3; si++)
    for (int ep_mode = 0; ep_mode < 2; ep_mode++) { /* MoE cut by TP, then by EP */
      int t = sizes[si], ep = ep_mode ? t : 1;
      for (int r = 0; r < t; r++) {
        if (!rank_checked(r, t))
          continue;
        qkeep_model *m = load_rank(w0, NULL, t, ep, r, ep_mode ? r : 0);
        ck_assert_msg(check_rank(full, m, t, ep, r, ep_mode ? r : 0) > 0, "%s: nothing was cut", scheme);
        qkeep_model_free(m);
      }
    }
  qkeep_model_free(full);
  free(w0);
}
END_TEST

/* The load fails with the numbers, and nothing was ever allocated (the peak stays 0). */
static void refused(const char *path, int tp, int ep, int rank, const char *const *words) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(NULL, &m), 0);
  struct qkeep_parallel p = {.size = sizeof p,
                             .tp_size = tp,
                             .tp_rank = tp > 1 ? rank : 0,
                             .ep_size = ep,
                             .ep_rank = ep > 1 ? rank : 0};
  ck_assert_int_eq(qkeep_model_set_parallel(m, &p), 0);
  ck_assert_int_eq(qkeep_model_load(m, path), QKEEP_E_UNSUPPORTED);
  for (; *words; words++)
    ck_assert_msg(strstr(qkeep_errmsg(), *words), "'%s' not in: %s", *words, qkeep_errmsg());
  struct qkeep_memory_stats ms = {.size = sizeof ms};
  ck_assert_int_eq(qkeep_model_memory(m, &ms, false), 0);
  ck_assert_int_eq(ms.storage_peak, 0);
  ck_assert_uint_eq(qkeep_model_layer_count(m), 0);
  qkeep_model_free(m);
}

START_TEST(indivisible_dims_are_refused_with_the_layer_and_numbers_before_any_allocation) {
  char *gptq = checkpoint("gptq-int4", 0), *nvfp4 = checkpoint("modelopt-nvfp4", 0);
  /* down_proj K = 256 over 16 ranks is 16 per rank: not whole groups of 32 (layers plan in name order) */
  refused(
      gptq, 16, 1, 3,
      (const char *const[]){"mlp.down_proj", "row-parallel over 16 ranks", "K is 256", "scales 32", NULL});
  /* a lone k_proj, N = 64 over 16 ranks, is 4 per rank: not whole qzeros words of 8 */
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  tu_add_source_f32(w, "model.layers.0.self_attn.k_proj.weight", KV, H, 1);
  char *lone = tu_path(dir, "lone.safetensors"), *lone_gptq = tu_path(dir, "lone-gptq");
  ck_assert_int_eq(st_writer_write(w, lone), 0);
  st_writer_free(w);
  struct qkeep_quantize_options o = {.size = sizeof o, .scheme = "gptq-int4", .group_size = 32};
  ck_assert_msg(qkeep_quantize(lone, lone_gptq, &o) == 0, "%s", qkeep_errmsg());
  refused(lone_gptq, 16, 1, 0,
          (const char *const[]){"k_proj", "column-parallel over 16 ranks", "N is 64", "qzeros 8", NULL});
  free(lone), free(lone_gptq);
  /* 8 experts over 3 ranks */
  refused(nvfp4, 1, 3, 1,
          (const char *const[]){"model.layers.1.mlp.experts", "8 experts do not divide", NULL});
  /* NVFP4 blocks of 16: down_proj K = 256 over 32 ranks is 8 */
  refused(nvfp4, 32, 1, 5, (const char *const[]){"down_proj", "K is 256", "weight_scale 16", NULL});
  /* ranks outside the group, and a model already loaded */
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(NULL, &m), 0);
  struct qkeep_parallel bad = {.size = sizeof bad, .tp_size = 2, .tp_rank = 2};
  ck_assert_int_eq(qkeep_model_set_parallel(m, &bad), QKEEP_E_INVAL);
  bad = (struct qkeep_parallel){.size = sizeof bad, .ep_size = 4, .ep_rank = -1};
  ck_assert_int_eq(qkeep_model_set_parallel(m, &bad), QKEEP_E_INVAL);
  ck_assert_int_eq(qkeep_model_load(m, nvfp4), 0);
  struct qkeep_parallel ok = {.size = sizeof ok, .tp_size = 2};
  ck_assert_int_eq(qkeep_model_set_parallel(m, &ok), QKEEP_E_STATE);
  qkeep_model_free(m);
  free(gptq), free(nvfp4);
}
END_TEST

/* test-async (a device in host memory whose copies run only at sync, as a GPU's do) takes the
 * unquantized linear layers: a rank's slices go to it through shard_plan.c, never the streamed whole-tensor
 * path, and land right; its reload equals a cold sharded load in place. */
static qkeep_model *load_chain_rank(const char *path, qkeep_plugin *const *chain, size_t n, int t, int r) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new_chain(chain, n, &m), 0);
  struct qkeep_parallel p = {.size = sizeof p, .tp_size = t, .tp_rank = r, .ep_size = t, .ep_rank = r};
  ck_assert_int_eq(qkeep_model_set_parallel(m, &p), 0);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s", qkeep_errmsg());
  return m;
}

START_TEST(a_device_with_async_copies_loads_each_rank_slice) {
  qkeep_plugin *async;
  ck_assert_msg(qkeep_plugin_open("test-async", NULL, &async) == 0, "%s", qkeep_errmsg());
  qkeep_plugin *chain[] = {async, plugin};
  char *w0 = checkpoint("unquantized", 0), *w1 = checkpoint("unquantized", 1);
  qkeep_model *full = load_chain_rank(w0, chain, 2, 1, 0);
  ck_assert_str_eq(qkeep_layer_backend(qkeep_model_find_layer(full, "model.layers.0.mlp.down_proj")),
                   "test-async");
  for (int t = 2; t <= 4; t *= 2)
    for (int r = 0; r < t; r++) {
      qkeep_model *m = load_chain_rank(w0, chain, 2, t, r), *cold = load_chain_rank(w1, chain, 2, t, r);
      check_rank(full, m, t, t, r, r);
      struct tu_storages before = {0}, after = {0}, cold_bytes = {0};
      tu_snapshot(m, &before);
      tu_snapshot(cold, &cold_bytes);
      ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
      tu_snapshot(m, &after);
      tu_assert_in_place_and_equal(&before, &after, &cold_bytes);
      tu_release_snapshot(&before), tu_release_snapshot(&after), tu_release_snapshot(&cold_bytes);
      qkeep_model_free(m), qkeep_model_free(cold);
    }
  qkeep_model_free(full);
  qkeep_plugin_close(async);
  free(w0), free(w1);
}
END_TEST

static struct qkeep_digest digest_of(qkeep_model *m) {
  struct qkeep_digest d;
  ck_assert_int_eq(qkeep_digest(m, &d), 0);
  return d;
}

START_TEST(each_rank_reloads_in_place_equal_to_a_cold_sharded_load_of_w1) {
  const char *scheme = schemes[_i];
  char *w0 = checkpoint(scheme, 0), *w1 = checkpoint(scheme, 1);
  static const int sizes[] = {2, 8};
  for (int si = 0; si < 2; si++)
    for (int r = 0; r < sizes[si]; r++) {
      if (!rank_checked(r, sizes[si]))
        continue;
      int t = sizes[si], ep = si ? t : 1; /* T = 8 with the MoE expert-parallel */
      qkeep_model *m = load_rank(w0, plugin, t, ep, r, ep > 1 ? r : 0);
      qkeep_model *cold = load_rank(w1, plugin, t, ep, r, ep > 1 ? r : 0);
      tu_assert_census_clean(m);
      tu_assert_census_clean(cold);
      struct tu_storages before = {0}, after = {0}, cold_bytes = {0};
      tu_snapshot(m, &before);
      tu_snapshot(cold, &cold_bytes);
      struct qkeep_digest d1 = digest_of(cold);
      ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s rank %d of %d: %s", scheme, r, t, qkeep_errmsg());
      struct qkeep_digest d = digest_of(m);
      ck_assert(d.hi == d1.hi && d.lo == d1.lo);
      tu_snapshot(m, &after);
      tu_assert_in_place_and_equal(&before, &after, &cold_bytes);
      tu_assert_census_clean(m);
      tu_release_snapshot(&before), tu_release_snapshot(&after), tu_release_snapshot(&cold_bytes);
      qkeep_model_free(m);
      qkeep_model_free(cold);
    }
  free(w0), free(w1);
}
END_TEST

/* ---- the ranks compute the layer: row-parallel outputs sum to the one-rank output, column-parallel
 * outputs are its columns (fused members cut one by one) ---- */

static float max_abs(const float *v, size_t n) {
  float m = 0;
  for (size_t i = 0; i < n; i++)
    m = fabsf(v[i]) > m ? fabsf(v[i]) : m;
  return m;
}

/* One layer of the one-rank model against the same layer of each rank's model. */
static void check_forward_layer(qkeep_model *full, qkeep_model *const *ranks, const char *layer_name, int t) {
  enum { M = 3 };
  qkeep_layer *fl = qkeep_model_find_layer(full, layer_name);
  ck_assert_ptr_nonnull(fl);
  int64_t n = fl->dims.n, k = fl->dims.k;
  int role = dense_role(layer_name);
  float *x = malloc(sizeof *x * (size_t)(M * k)), *y = malloc(sizeof *y * (size_t)(M * n)),
        *sum = calloc((size_t)(M * n), sizeof *sum), *xr = malloc(sizeof *x * (size_t)(M * k)),
        *yr = malloc(sizeof *y * (size_t)(M * n));
  uint64_t seed = 7;
  for (int64_t i = 0; i < M * k; i++)
    x[i] = tu_randf(&seed);
  ck_assert_msg(qkeep_layer_apply_f32(fl, M, x, y) == 0, "%s", qkeep_errmsg());
  float tol = 1e-4f * max_abs(y, (size_t)(M * n)) + 1e-6f;
  for (int r = 0; r < t; r++) {
    qkeep_layer *rl = qkeep_model_find_layer(ranks[r], layer_name);
    int64_t kr = rl->dims.k, nr = rl->dims.n;
    for (int64_t i = 0; i < M; i++)
      memcpy(xr + i * kr, x + i * k + (role == 'r' ? r * kr : 0), sizeof *x * (size_t)kr);
    ck_assert_msg(qkeep_layer_apply_f32(rl, M, xr, yr) == 0, "%s rank %d: %s", layer_name, r, qkeep_errmsg());
    if (role == 'r') {
      for (int64_t i = 0; i < M * n; i++)
        sum[i] += yr[i];
    } else { /* rank r's column j of member s is column before_s + r n_s/T + j of the one-rank output */
      for (int64_t i = 0; i < M; i++) {
        int64_t before = 0, local = 0;
        for (int sh = 0; sh < fl->dims.shards; sh++) {
          int64_t ns = fl->dims.shard_n[sh], part = ns / t;
          for (int64_t j = 0; j < part; j++)
            ck_assert_msg(fabsf(yr[i * nr + local + j] - y[i * n + before + r * part + j]) <= tol,
                          "%s rank %d: column %lld differs", layer_name, r, (long long)(local + j));
          before += ns, local += part;
        }
      }
    }
  }
  for (int64_t i = 0; role == 'r' && i < M * n; i++)
    ck_assert_msg(fabsf(sum[i] - y[i]) <= tol,
                  "%s: the ranks' outputs do not sum to the one-rank output (%g vs %g)", layer_name,
                  (double)sum[i], (double)y[i]);
  free(x), free(y), free(sum), free(xr), free(yr);
}

/* The layers (NULL-terminated) of T ranks on the reference backend against the one-rank model. */
static void check_forward(const char *path, const char *const *layers, int t) {
  qkeep_model *full = load_rank(path, plugin, 1, 1, 0, 0), *ranks[8];
  for (int r = 0; r < t; r++)
    ranks[r] = load_rank(path, plugin, t, 1, r, 0);
  for (; *layers; layers++)
    check_forward_layer(full, ranks, *layers, t);
  for (int r = 0; r < t; r++)
    qkeep_model_free(ranks[r]);
  qkeep_model_free(full);
}

START_TEST(the_ranks_compute_what_the_one_rank_layer_computes) {
  const char *scheme = schemes[_i];
  if (strcmp(scheme, "gpt-oss") == 0)
    return; /* no dense layer */
  char *w0 = checkpoint(scheme, 0);
  static const char *const layers[] = {"model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj",
                                       "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj",
                                       NULL};
  for (int t = 2; t <= 8; t *= 2)
    check_forward(w0, layers, t);
  free(w0);
}
END_TEST

/* Channelwise int4 scales (one group of the whole K) on a row cut: repeated, and each rank's group is its
 * own K, so its partial output is still right. */
START_TEST(channelwise_scales_of_a_row_cut_are_repeated) {
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  tu_add_source_f32(w, "model.layers.0.self_attn.o_proj.weight", H, Q, 3);
  char *src = tu_path(dir, "channel.safetensors"), *q = tu_path(dir, "channel-ct");
  ck_assert_int_eq(st_writer_write(w, src), 0);
  st_writer_free(w);
  struct qkeep_quantize_options o = {
      .size = sizeof o, .scheme = "ct-int4", .group_size = Q, .asym_weights = true};
  ck_assert_msg(qkeep_quantize(src, q, &o) == 0, "%s", qkeep_errmsg());
  qkeep_model *full = load_rank(q, NULL, 1, 1, 0, 0);
  for (int r = 0; r < 4; r++) {
    qkeep_model *m = load_rank(q, NULL, 4, 1, r, 0);
    qkeep_layer *rl = qkeep_model_find_layer(m, "model.layers.0.self_attn.o_proj");
    ck_assert_int_eq(rl->dims.group_size, Q / 4);
    ck_assert_int_eq(qkeep_param_lookup(rl, "weight_scale")->view.spec.shape[1], 1);
    check_rank(full, m, 4, 1, r, 0);
    qkeep_model_free(m);
  }
  qkeep_model_free(full);
  check_forward(q, (const char *const[]){"model.layers.0.self_attn.o_proj", NULL}, 4);
  free(src), free(q);
}
END_TEST

START_TEST(the_config_gives_the_parallel_place) {
  char *ini = tu_path(dir, "tp.ini");
  const char *text =
      "[qkeep]\nbackend = reference\n[model]\ntp_size = 4\ntp_rank = 3\nep_size = 2\nep_rank = 1\n";
  ck_assert_int_eq(tu_write_file(ini, text, strlen(text)), 0);
  qkeep_config *cfg;
  ck_assert_msg(qkeep_config_load(ini, &cfg) == 0, "%s", qkeep_errmsg());
  struct qkeep_parallel p = {.size = sizeof p};
  ck_assert_int_eq(qkeep_config_parallel(cfg, &p), 0);
  ck_assert_int_eq(p.tp_size, 4);
  ck_assert_int_eq(p.tp_rank, 3);
  ck_assert_int_eq(p.ep_size, 2);
  ck_assert_int_eq(p.ep_rank, 1);
  qkeep_config_free(cfg);
  static const char *const bad[][2] = {
      {"tp_size = 0\n", "tp.ini:4: [model] tp_size: '0' is not a size"},
      {"tp_rank = x\n", "tp.ini:4: [model] tp_rank: 'x' is not a rank"},
      {"ep_size = 2\nep_size = 2\n", "tp.ini:5: [model] duplicate key 'ep_size'"},
      {"tp_size = -2\n", "tp.ini:4: [model] tp_size: '-2'"}};
  for (size_t i = 0; i < 4; i++) {
    char body[256];
    snprintf(body, sizeof body, "[qkeep]\nbackend = reference\n[model]\n%s", bad[i][0]);
    ck_assert_int_eq(tu_write_file(ini, body, strlen(body)), 0);
    ck_assert_int_eq(qkeep_config_load(ini, &cfg), QKEEP_E_CONFIG);
    ck_assert_msg(strstr(qkeep_errmsg(), bad[i][1]), "%s", qkeep_errmsg());
  }
  free(ini);
}
END_TEST

/* ---- weight sync: W1 as packed buckets, per rank ---- */

/* The sender: W1's tensors packed into its plan's buckets (read from the checkpoint by name). */
struct sender {
  struct qkeep_sync_entry *plan;
  size_t n, n_buckets;
  unsigned char **buf;
  size_t *bytes;
  struct qkeep_bucket_tensor **tensors;
  size_t *count;
};

static void sender_open(struct sender *sd, const char *w1, size_t bucket_bytes) {
  qkeep_model *full = load_rank(w1, NULL, 1, 1, 0, 0);
  ck_assert_int_eq(qkeep_sync_plan(full, bucket_bytes, &sd->plan, &sd->n, &sd->n_buckets), 0);
  ck_assert_uint_ge(sd->n_buckets, 2); /* small buckets: several of them */
  /* Every checkpoint name the model loads, each once (an alias, a tensor feeding two params, once). */
  ck_assert_uint_eq(sd->n, full->index.sources.count);
  struct name_index seen = {0};
  for (size_t i = 0; i < sd->n; i++) {
    ck_assert_ptr_nonnull(qkeep_model_lookup(full, sd->plan[i].tensor.name, NULL));
    ck_assert_int_eq(name_index_put(&seen, sd->plan[i].tensor.name, i, NULL), 0);
  }
  name_index_clear(&seen);
  /* A layer's tensors are one run of the plan; the run spans two buckets only if the layer (its
   * tensors, 256-byte aligned) is larger than a bucket. */
  for (size_t i = 0, start = 0; i < sd->n; i++) {
    qkeep_layer *li, *ln = NULL;
    ck_assert_ptr_nonnull(qkeep_model_lookup(full, sd->plan[i].tensor.name, &li));
    if (i + 1 < sd->n)
      qkeep_model_lookup(full, sd->plan[i + 1].tensor.name, &ln);
    if (ln == li)
      continue;
    size_t layer_bytes = 0;
    for (size_t k = start; k <= i; k++)
      layer_bytes = ((layer_bytes + 255) & ~(size_t)255) + qkeep_spec_bytes(&sd->plan[k].tensor.spec);
    ck_assert_msg(sd->plan[start].bucket == sd->plan[i].bucket || layer_bytes > bucket_bytes,
                  "layer %s (%zu bytes) is split across buckets of %zu", li->name, layer_bytes, bucket_bytes);
    start = i + 1;
  }
  sd->buf = calloc(sd->n_buckets, sizeof *sd->buf);
  sd->bytes = calloc(sd->n_buckets, sizeof *sd->bytes);
  sd->tensors = calloc(sd->n_buckets, sizeof *sd->tensors);
  sd->count = calloc(sd->n_buckets, sizeof *sd->count);
  for (size_t i = 0; i < sd->n; i++) {
    size_t b = sd->plan[i].bucket,
           end = sd->plan[i].tensor.offset + qkeep_spec_bytes(&sd->plan[i].tensor.spec);
    if (end > sd->bytes[b])
      sd->bytes[b] = end;
    sd->count[b]++;
  }
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(w1, &ck), 0);
  size_t *filled = calloc(sd->n_buckets, sizeof *filled);
  for (size_t b = 0; b < sd->n_buckets; b++) {
    sd->buf[b] = calloc(1, sd->bytes[b] + 1);
    sd->tensors[b] = calloc(sd->count[b], sizeof **sd->tensors);
  }
  for (size_t i = 0; i < sd->n; i++) {
    size_t b = sd->plan[i].bucket;
    const struct ckpt_tensor *t = ckpt_find(ck, sd->plan[i].tensor.name);
    ck_assert_ptr_nonnull(t);
    ck_assert_int_eq(ckpt_read(ck, t, sd->buf[b] + sd->plan[i].tensor.offset), 0);
    sd->tensors[b][filled[b]] = sd->plan[i].tensor;
    sd->tensors[b][filled[b]].name = t->t->name; /* the plan's names are the one-rank model's */
    filled[b]++;
  }
  free(filled);
  /* keep the checkpoint's names alive: copy them */
  for (size_t b = 0; b < sd->n_buckets; b++)
    for (size_t i = 0; i < sd->count[b]; i++)
      sd->tensors[b][i].name = strdup(sd->tensors[b][i].name);
  ckpt_close(ck);
  qkeep_model_free(full);
}

static void sender_close(struct sender *sd) {
  for (size_t b = 0; b < sd->n_buckets; b++) {
    for (size_t i = 0; i < sd->count[b]; i++)
      free((char *)sd->tensors[b][i].name);
    free(sd->buf[b]), free(sd->tensors[b]);
  }
  free(sd->buf), free(sd->bytes), free(sd->tensors), free(sd->count);
  qkeep_sync_plan_free(sd->plan);
}

static struct qkeep_bucket bucket_of(const struct sender *sd, size_t b, void *data) {
  return (struct qkeep_bucket){
      sizeof(struct qkeep_bucket), sd->tensors[b], sd->count[b], data, sd->bytes[b], false};
}

/* T ranks synced from the trainer (endpoint 0) through `tr` (T + 1 endpoints); each rank then equals a
 * cold sharded load of W1, in place. */
static void sync_ranks(const char *w0, const char *w1, int t, struct qkeep_transport **tr,
                       size_t bucket_bytes) {
  struct sender sd = {0};
  sender_open(&sd, w1, bucket_bytes);
  qkeep_model *m[8], *cold[8];
  qkeep_sync *sy[8];
  struct tu_storages before[8] = {{0}}, after = {0}, cold_bytes = {0};
  for (int r = 0; r < t; r++) {
    m[r] = load_rank(w0, plugin, t, t, r, r);
    cold[r] = load_rank(w1, plugin, t, t, r, r);
    tu_snapshot(m[r], &before[r]);
    ck_assert_int_eq(qkeep_sync_begin(m[r], &sy[r]), 0);
  }
  for (size_t b = 0; b < sd.n_buckets; b++) {
    ck_assert_int_eq(tr[0]->broadcast(tr[0]->ctx, sd.buf[b], sd.bytes[b], 0), 0); /* the trainer sends */
    for (int r = 0; r < t; r++) {
      unsigned char *rx = malloc(sd.bytes[b] + 1);
      struct qkeep_bucket bk = bucket_of(&sd, b, rx);
      ck_assert_msg(qkeep_sync_receive(sy[r], tr[r + 1], 0, &bk) == 0, "rank %d, bucket %zu: %s", r, b,
                    qkeep_errmsg());
      memset(rx, 0xa5, sd.bytes[b]); /* the bucket is the caller's again: nothing may read it later */
      free(rx);
    }
  }
  for (int r = 0; r < t; r++) {
    ck_assert_msg(qkeep_sync_end(sy[r]) == 0, "rank %d: %s", r, qkeep_errmsg());
    struct qkeep_digest a, c;
    ck_assert_int_eq(qkeep_digest(m[r], &a), 0);
    ck_assert_int_eq(qkeep_digest(cold[r], &c), 0);
    ck_assert_msg(a.hi == c.hi && a.lo == c.lo, "rank %d: the synced model differs from a cold load of W1",
                  r);
    tu_snapshot(m[r], &after);
    tu_snapshot(cold[r], &cold_bytes);
    tu_assert_in_place_and_equal(&before[r], &after, &cold_bytes);
    tu_assert_census_clean(m[r]);
    tu_release_snapshot(&before[r]);
    qkeep_model_free(m[r]);
    qkeep_model_free(cold[r]);
  }
  tu_release_snapshot(&after), tu_release_snapshot(&cold_bytes);
  sender_close(&sd);
}

START_TEST(a_sync_of_w1_buckets_equals_a_cold_sharded_load_on_every_rank) {
  const char *scheme = schemes[_i];
  char *w0 = checkpoint(scheme, 0), *w1 = checkpoint(scheme, 1);
  struct qkeep_transport *tr[3];
  ck_assert_int_eq(qkeep_transport_inprocess(3, tr), 0);
  sync_ranks(w0, w1, 2, tr, 48 << 10);
  for (int i = 0; i < 3; i++)
    tr[i]->close(tr[i]->ctx);
  free(w0), free(w1);
}
END_TEST

static struct qkeep_digest digest_now(qkeep_model *m) {
  struct qkeep_digest d;
  ck_assert_int_eq(qkeep_digest(m, &d), 0);
  return d;
}
static bool same_digest(struct qkeep_digest a, struct qkeep_digest b) { return a.hi == b.hi && a.lo == b.lo; }

/* The failure cases' setting: modelopt-nvfp4 W0 and W1, W1's plan in 48 KiB buckets, rank 1 of 2 (TP and
 * EP) holding W0, and W0's digest. */
struct sync_case {
  char *w0, *w1;
  struct sender sd;
  qkeep_model *m;
  struct qkeep_digest d0;
};
static void sync_case_open(struct sync_case *c) {
  *c = (struct sync_case){.w0 = checkpoint("modelopt-nvfp4", 0), .w1 = checkpoint("modelopt-nvfp4", 1)};
  sender_open(&c->sd, c->w1, 48 << 10);
  c->m = load_rank(c->w0, plugin, 2, 2, 1, 1);
  c->d0 = digest_now(c->m);
}
static void sync_case_close(struct sync_case *c) {
  qkeep_model_free(c->m);
  sender_close(&c->sd);
  free(c->w0), free(c->w1);
}

/* The model refuses to run (a failed sync or reload left it without a trusted W0), or runs. */
static void assert_runs(qkeep_model *m, int want) {
  float x[H] = {0}, y[4 * Q];
  qkeep_layer *qkv = qkeep_model_find_layer(m, "model.layers.0.self_attn.qkv_proj");
  ck_assert_int_eq(qkeep_layer_apply_f32(qkv, 1, x, y), want);
}

START_TEST(a_bad_bucket_fails_the_sync_and_puts_w0_back) {
  struct sync_case c;
  sync_case_open(&c);
  qkeep_sync *sy;
  /* 1. a wrong shape in the second bucket: the first bucket's layers are put back */
  struct qkeep_bucket_tensor *zero_between = NULL; /* fault 5's tensors */
  for (int fault = 0; fault < 6; fault++) {
    ck_assert_int_eq(qkeep_sync_begin(c.m, &sy), 0);
    struct qkeep_bucket b0 = bucket_of(&c.sd, 0, c.sd.buf[0]);
    ck_assert_msg(qkeep_sync_bucket(sy, &b0) == 0, "%s", qkeep_errmsg());
    struct qkeep_bucket_tensor *t = &c.sd.tensors[1][0], saved = *t;
    struct qkeep_bucket b1 = bucket_of(&c.sd, 1, c.sd.buf[1]);
    int want = QKEEP_E_FORMAT;
    const char *words = "the model expects";
    unsigned char *scale = NULL, scale_saved = 0;
    if (fault == 0)
      t->spec.shape[0]++;
    else if (fault == 1)
      t->name = "model.layers.0.no_such.weight", want = QKEEP_E_NOTFOUND, words = "not part of this model";
    else if (fault == 2)
      t->offset = c.sd.tensors[1][1].offset, want = QKEEP_E_INVAL, words = "overlap";
    else if (fault == 3)
      b1.nbytes = t->offset, want = QKEEP_E_INVAL, words = "pass the bucket's end";
    else if (fault == 5) {
      /* the second tensor moved into the first, and a zero-length tensor (another rank's, whose spec
       * this rank does not know) between them in offset order: neighbours in offset order never overlap */
      size_t n = c.sd.count[1];
      ck_assert_uint_ge(n, 2);
      zero_between = malloc((n + 1) * sizeof *zero_between);
      ck_assert_ptr_nonnull(zero_between);
      memcpy(zero_between, c.sd.tensors[1], n * sizeof *zero_between);
      size_t first_bytes;
      ck_assert(spec_bytes_checked(&zero_between[0].spec, &first_bytes));
      ck_assert_uint_ge(first_bytes, 3);
      ck_assert_uint_gt(zero_between[1].offset, zero_between[0].offset);
      zero_between[1].offset = zero_between[0].offset + 2;
      const char *foreign = NULL; /* rank 0's expert, not in this bucket */
      static const char *const others[] = {"model.layers.1.mlp.experts.0.gate_proj.weight",
                                           "model.layers.1.mlp.experts.1.gate_proj.weight"};
      for (size_t o = 0; o < 2 && !foreign; o++) {
        foreign = others[o];
        for (size_t i = 0; i < n; i++)
          foreign = strcmp(zero_between[i].name, others[o]) == 0 ? NULL : foreign;
      }
      ck_assert_ptr_nonnull(foreign);
      zero_between[n] = (struct qkeep_bucket_tensor){
          foreign, {.dtype = QKEEP_DTYPE_U8, .ndim = 1, .shape = {0}}, zero_between[0].offset + 1};
      b1.tensors = zero_between, b1.n = n + 1, want = QKEEP_E_INVAL, words = "overlap";
    } else { /* a NaN block scale (e4m3 0x7f) in the first scale tensor of the bucket */
      for (size_t i = 0; i < c.sd.count[1] && !scale; i++)
        if (ends_with(c.sd.tensors[1][i].name, ".weight_scale"))
          scale = c.sd.buf[1] + c.sd.tensors[1][i].offset;
      ck_assert_ptr_nonnull(scale);
      scale_saved = *scale, *scale = 0x7f, words = "NaN";
    }
    ck_assert_int_eq(qkeep_sync_bucket(sy, &b1), want);
    ck_assert_msg(strstr(qkeep_errmsg(), words) && strstr(qkeep_errmsg(), "rolled back"), "%s",
                  qkeep_errmsg());
    ck_assert(same_digest(digest_now(c.m), c.d0));
    ck_assert_int_eq(qkeep_sync_bucket(sy, &b1), QKEEP_E_STATE); /* a failed sync takes nothing more */
    ck_assert_int_eq(qkeep_sync_end(sy), QKEEP_E_STATE);
    *t = saved;
    if (scale)
      *scale = scale_saved;
    free(zero_between);
    zero_between = NULL;
  }
  /* 2. ending early: the missing tensor is named, W0 put back */
  ck_assert_int_eq(qkeep_sync_begin(c.m, &sy), 0);
  struct qkeep_bucket b0 = bucket_of(&c.sd, 0, c.sd.buf[0]);
  ck_assert_int_eq(qkeep_sync_bucket(sy, &b0), 0);
  ck_assert_int_eq(qkeep_sync_end(sy), QKEEP_E_NOTFOUND);
  bool named = false; /* one of the second bucket's tensors, quoted */
  for (size_t i = 0; i < c.sd.count[1] && !named; i++) {
    char quoted[256];
    snprintf(quoted, sizeof quoted, "'%s'", c.sd.tensors[1][i].name);
    named = strstr(qkeep_errmsg(), quoted) != NULL;
  }
  ck_assert_msg(named, "%s", qkeep_errmsg());
  ck_assert(same_digest(digest_now(c.m), c.d0));
  /* 3. a tensor sent twice */
  ck_assert_int_eq(qkeep_sync_begin(c.m, &sy), 0);
  ck_assert_int_eq(qkeep_sync_bucket(sy, &b0), 0);
  ck_assert_int_eq(qkeep_sync_bucket(sy, &b0), QKEEP_E_INVAL);
  ck_assert(same_digest(digest_now(c.m), c.d0));
  qkeep_sync_abort(sy);
  /* 4. after a good sync no file holds the weights: a failed one then leaves the model refusing to run,
   * until a reload from a checkpoint */
  ck_assert_int_eq(qkeep_sync_begin(c.m, &sy), 0);
  for (size_t b = 0; b < c.sd.n_buckets; b++) {
    struct qkeep_bucket bk = bucket_of(&c.sd, b, c.sd.buf[b]);
    ck_assert_int_eq(qkeep_sync_bucket(sy, &bk), 0);
  }
  ck_assert_int_eq(qkeep_sync_end(sy), 0);
  ck_assert_int_eq(qkeep_sync_begin(c.m, &sy), 0);
  ck_assert_int_eq(qkeep_sync_bucket(sy, &b0), 0);
  qkeep_sync_abort(sy);
  assert_runs(c.m, QKEEP_E_STATE);
  ck_assert_int_eq(qkeep_sync_begin(c.m, &sy), QKEEP_E_STATE);
  ck_assert_int_eq(qkeep_model_reload(c.m, c.w0, 0), 0);
  ck_assert(same_digest(digest_now(c.m), c.d0));
  sync_case_close(&c);
}
END_TEST

/* The device-to-host copies (each one's source and size) and the allocations of one device, counted by
 * wrapping its ops while a test needs them (count_begin .. count_end). */
static const struct qkeep_memory_ops *counted_ops;
static struct qkeep_memory_ops counting;
static size_t d2h_copies, allocations, cap_d2h;
static const qkeep_model *param_model; /* count_begin's: d2d copies into its params are counted */
static size_t d2d_into_params, batches, batch_ranges, checks, checked_ranges;
static struct d2h_copy {
  const char *src;
  size_t n;
} * d2h;
static int counting_d2h(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  if (d2h_copies == cap_d2h) {
    cap_d2h = cap_d2h ? 2 * cap_d2h : 256;
    ck_assert_ptr_nonnull(d2h = realloc(d2h, cap_d2h * sizeof *d2h));
  }
  d2h[d2h_copies++] = (struct d2h_copy){src, n};
  return counted_ops->copy_d2h(be, dst, src, n);
}
static bool in_params(const qkeep_model *m, const char *at, size_t n, bool scales_only);
static int counting_d2d(const struct qkeep_backend *be, void *dst, const void *src, size_t n) {
  d2d_into_params += param_model && in_params(param_model, dst, n, false);
  return counted_ops->copy_d2d(be, dst, src, n);
}
static int counting_batch(const struct qkeep_backend *be, const struct qkeep_copy_range *r, size_t n) {
  if (!param_model || (n && in_params(param_model, r[0].dst, r[0].bytes, false))) /* not a gather of scales */
    batches++, batch_ranges += n;
  return counted_ops->copy_d2d_batch(be, r, n);
}
static int counting_check(const struct qkeep_backend *be, const struct qkeep_value_range *r, size_t n,
                          size_t *first) {
  checks++, checked_ranges += n;
  return counted_ops->find_bad_values(be, r, n, first);
}
static int counting_alloc(const struct qkeep_backend *be, size_t bytes, void **out) {
  allocations++;
  return counted_ops->alloc(be, bytes, out);
}
static struct device *count_begin(const struct device *d) {
  struct device *dev = (struct device *)(uintptr_t)d;
  counted_ops = dev->ops;
  counting = *dev->ops;
  counting.copy_d2h = counting_d2h;
  counting.alloc = counting_alloc;
  counting.copy_d2d = counting_d2d;
  counting.copy_d2d_batch = dev->ops->copy_d2d_batch ? counting_batch : NULL;
  counting.find_bad_values = dev->ops->find_bad_values ? counting_check : NULL;
  dev->ops = &counting;
  d2h_copies = allocations = d2d_into_params = batches = batch_ranges = checks = checked_ranges = 0;
  return dev;
}
static void count_end(struct device *dev) {
  dev->ops = counted_ops;
  param_model = NULL;
  free(d2h), d2h = NULL, cap_d2h = 0;
}

/* Whether [at, at + n) lies in the storage of one of the model's params (a scale param's: scales_only). */
static bool in_params(const qkeep_model *m, const char *at, size_t n, bool scales_only) {
  for (size_t l = 0; l < m->n_layers; l++)
    for (size_t i = 0; i < m->layers[l]->n_params; i++) {
      const qkeep_param *p = m->layers[l]->params[i];
      const char *lo = p->view.storage ? p->view.storage->data : NULL;
      if (lo && (p->scale || !scales_only) && at >= lo && n <= p->view.storage->capacity &&
          (size_t)(at - lo) <= p->view.storage->capacity - n)
        return true;
    }
  return false;
}

/* The counted device-to-host copies from m's scale params. */
static size_t scale_copies(const qkeep_model *m) {
  size_t k = 0;
  for (size_t i = 0; i < d2h_copies; i++)
    k += in_params(m, d2h[i].src, d2h[i].n, true);
  return k;
}

/* The bucket path a GPU takes, on test-async (device memory whose copies run at sync): buckets in
 * device memory, small enough that boundaries fall inside the MoE block's expert tensors, so the
 * split layer's tensors wait as device copies and its scales are checked from device memory; the
 * synced model equals a cold load of W1 in place. What waits is kept in one allocation per bucket,
 * and the scales are copied to the host in runs: a few copies per bucket, not one per tensor, and
 * a waiting scale's copy is the one its layer loads from (none is copied back from the kept blocks). */
START_TEST(a_sync_of_device_buckets_splitting_the_experts_equals_a_cold_load) {
  qkeep_plugin *async;
  ck_assert_msg(qkeep_plugin_open("test-async", NULL, &async) == 0, "%s", qkeep_errmsg());
  char *w0 = checkpoint("modelopt-nvfp4", 0), *w1 = checkpoint("modelopt-nvfp4", 1);
  struct sender sd = {0};
  sender_open(&sd, w1, 16 << 10);
  qkeep_model *m = load_chain_rank(w0, &async, 1, 1, 0), *cold = load_chain_rank(w1, &async, 1, 1, 0);
  qkeep_layer *moe = qkeep_model_find_layer(m, "model.layers.1.mlp.experts");
  ck_assert_str_eq(qkeep_layer_backend(moe), "test-async");
  size_t split = 0; /* buckets holding some but not all of the experts' tensors */
  for (size_t b = 0; b < sd.n_buckets; b++) {
    size_t experts = 0;
    for (size_t i = 0; i < sd.count[b]; i++)
      experts += strstr(sd.tensors[b][i].name, ".mlp.experts.") != NULL;
    split += experts && experts < 3 * 4 * E;
  }
  ck_assert_uint_ge(split, 2);
  /* The tensors that wait: those of a layer in a bucket before the one its last tensor comes in. */
  size_t *last_bucket = calloc(m->n_layers, sizeof *last_bucket), waiting = 0;
  for (int pass = 0; pass < 2; pass++)
    for (size_t b = 0; b < sd.n_buckets; b++)
      for (size_t i = 0; i < sd.count[b]; i++) {
        const struct source_ref *ref = model_find_source(m, sd.tensors[b][i].name);
        size_t l = 0;
        while (m->layers[l] != ref->layer)
          l++;
        if (pass == 0)
          last_bucket[l] = b;
        else
          waiting += b < last_bucket[l];
      }
  free(last_bucket);
  struct device *dev = count_begin(layer_device(moe));
  size_t sync_allocations = 0, scales = 0, from_kept = 0;
  struct tu_storages before = {0}, after = {0}, cold_bytes = {0};
  tu_snapshot(m, &before);
  qkeep_sync *sy;
  ck_assert_int_eq(qkeep_sync_begin(m, &sy), 0);
  for (size_t b = 0; b < sd.n_buckets; b++) {
    void *rx;
    ck_assert_int_eq(dev_alloc(dev, sd.bytes[b], &rx), 0);
    ck_assert_int_eq(dev_h2d(dev, rx, sd.buf[b], sd.bytes[b]), 0);
    struct qkeep_bucket bk = bucket_of(&sd, b, rx);
    bk.on_device = true;
    size_t allocated = allocations, copied = d2h_copies;
    ck_assert_msg(qkeep_sync_bucket(sy, &bk) == 0, "bucket %zu: %s", b, qkeep_errmsg());
    sync_allocations += allocations - allocated;
    for (size_t k = copied; k < d2h_copies; k++) { /* from this bucket, the model's params, or elsewhere */
      const char *at = d2h[k].src, *lo = rx;
      bool in_bucket = at >= lo && d2h[k].n <= sd.bytes[b] && (size_t)(at - lo) <= sd.bytes[b] - d2h[k].n;
      bool gathered = false; /* scales gathered on the device first (copied from the bucket, once) */
      for (size_t o = 0; o < m->chain.n_owners; o++)
        gathered |= at == m->chain.owners[o].gather;
      from_kept += !in_bucket && !gathered && !in_params(m, at, d2h[k].n, false);
    }
    for (size_t i = 0; i < sd.count[b]; i++) {
      const struct source_ref *ref = model_find_source(m, sd.tensors[b][i].name);
      scales += ref->layer->sources[ref->source].param->scale;
    }
    ck_assert_int_eq(dev_fill(dev, rx, 0xa5, sd.bytes[b]), 0); /* the caller's again */
    ck_assert_int_eq(dev_sync(dev), 0);
    dev_free(dev, rx);
  }
  ck_assert_msg(qkeep_sync_end(sy) == 0, "%s", qkeep_errmsg());
  size_t copies = d2h_copies;
  count_end(dev);
  ck_assert_msg(sync_allocations <= sd.n_buckets && sync_allocations < waiting,
                "%zu device allocations in %zu buckets for %zu tensors that wait", sync_allocations,
                sd.n_buckets, waiting);
  ck_assert_msg(copies < scales / 4, "%zu device-to-host copies for %zu scale tensors", copies, scales);
  /* A waiting scale crosses to the host once, at its bucket (checked there, then kept in host memory): none
   * is read back from what the sync kept in device memory. */
  ck_assert_msg(from_kept == 0, "%zu device-to-host copies from the kept blocks", from_kept);
  ck_assert(same_digest(digest_now(m), digest_now(cold)));
  tu_snapshot(m, &after);
  tu_snapshot(cold, &cold_bytes);
  tu_assert_in_place_and_equal(&before, &after, &cold_bytes);
  tu_release_snapshot(&before), tu_release_snapshot(&after), tu_release_snapshot(&cold_bytes);
  qkeep_model_free(m), qkeep_model_free(cold);
  sender_close(&sd);
  qkeep_plugin_close(async);
  free(w0), free(w1);
}
END_TEST

/* Syncs every bucket of sd from device memory of dev into m, bucket `bad` (SIZE_MAX: none) with the byte at
 * bad_at set to 0x7f (a NaN e4m3 scale); the first failure's code, or 0 after qkeep_sync_end. */
static int sync_from_device(qkeep_model *m, const struct device *dev, struct sender *sd, size_t bad,
                            size_t bad_at) {
  qkeep_sync *sy;
  ck_assert_int_eq(qkeep_sync_begin(m, &sy), 0);
  int rc = 0;
  for (size_t b = 0; b < sd->n_buckets && !rc; b++) {
    void *rx;
    ck_assert_int_eq(dev_alloc(dev, sd->bytes[b], &rx), 0);
    ck_assert_int_eq(dev_h2d(dev, rx, sd->buf[b], sd->bytes[b]), 0);
    if (b == bad)
      ck_assert_int_eq(dev_fill(dev, (char *)rx + bad_at, 0x7f, 1), 0);
    struct qkeep_bucket bk = bucket_of(sd, b, rx);
    bk.on_device = true;
    rc = qkeep_sync_bucket(sy, &bk);
    dev_free(dev, rx);
  }
  if (rc)
    qkeep_sync_abort(sy);
  return rc ? rc : qkeep_sync_end(sy);
}

/* Buckets large enough that the fixture's plan splits no layer, small enough for two. */
#define BUCKET_NO_SPLIT (256 << 10)

/* W0 (modelopt-nvfp4) on test-async alone, W1's buckets planned (no layer split) and a cold W1 to compare. */
struct async_case {
  qkeep_plugin *async;
  char *w0, *w1;
  struct sender sd;
  qkeep_model *m, *cold;
};
static void async_case_open(struct async_case *c) {
  *c = (struct async_case){0};
  ck_assert_msg(qkeep_plugin_open("test-async", NULL, &c->async) == 0, "%s", qkeep_errmsg());
  c->w0 = checkpoint("modelopt-nvfp4", 0), c->w1 = checkpoint("modelopt-nvfp4", 1);
  sender_open(&c->sd, c->w1, BUCKET_NO_SPLIT);
  c->m = load_chain_rank(c->w0, &c->async, 1, 1, 0), c->cold = load_chain_rank(c->w1, &c->async, 1, 1, 0);
}
static void async_case_close(struct async_case *c) {
  qkeep_model_free(c->m), qkeep_model_free(c->cold);
  sender_close(&c->sd);
  qkeep_plugin_close(c->async);
  free(c->w0), free(c->w1);
}

/* From a bucket in device memory, a layer's block scales are checked where they lie, by the device's
 * find_bad_values (ABI 1.6: one call per layer, no block scale copied to the host); without the slot
 * (_i == 1) its scale tensors (which the plan puts first) are copied to the host for their check in a few
 * runs, not one copy per tensor. Either way a NaN in the middle of such a run still fails the sync naming
 * its tensor and element, and W0 is put back. */
START_TEST(device_bucket_scales_are_checked_from_a_few_copies) {
  struct async_case c;
  async_case_open(&c);
  qkeep_model *m = c.m, *cold = c.cold;
  struct sender *sdp = &c.sd;
  struct qkeep_digest d0 = digest_now(m);
  /* The plan: no layer split across buckets (so none waits, copied, for the rest), each layer's scales
   * first. A weight_scale with scales on both sides in its bucket gets the NaN. */
  size_t scales = 0, block_scales = 0, layers_with_scales = 0, bad = SIZE_MAX, bad_at = 0;
  const char *bad_name = NULL;
  const qkeep_layer *last = NULL;
  size_t last_bucket = 0;
  for (size_t b = 0; b < sdp->n_buckets; b++)
    for (size_t i = 0; i < sdp->count[b]; i++) {
      const struct source_ref *ref = model_find_source(m, sdp->tensors[b][i].name);
      ck_assert_ptr_nonnull(ref);
      ck_assert_msg(ref->layer != last || b == last_bucket, "layer %s is split", ref->layer->name);
      bool scale = ref->layer->sources[ref->source].param->scale;
      scales += scale;
      block_scales += scale && sdp->tensors[b][i].spec.dtype == QKEEP_DTYPE_F8_E4M3;
      layers_with_scales += scale && ref->layer != last;
      last = ref->layer, last_bucket = b;
      bool between_scales = i > 0 && i + 1 < sdp->count[b];
      for (int d = -1; d <= 1 && between_scales; d++) {
        const struct source_ref *r = model_find_source(m, sdp->tensors[b][(size_t)((ptrdiff_t)i + d)].name);
        between_scales = r->layer->sources[r->source].param->scale;
      }
      if (between_scales && !bad_name && ends_with(sdp->tensors[b][i].name, ".weight_scale"))
        bad = b, bad_at = sdp->tensors[b][i].offset + 1, bad_name = sdp->tensors[b][i].name;
    }
  ck_assert_ptr_nonnull(bad_name);
  struct device *dev = count_begin(layer_device(qkeep_model_find_layer(m, "model.layers.1.mlp.experts")));
  if (_i == 1)
    counting.find_bad_values = NULL;
  ck_assert_msg(sync_from_device(m, dev, sdp, SIZE_MAX, 0) == 0, "%s", qkeep_errmsg());
  size_t copies = d2h_copies, device_checks = checks, device_ranges = checked_ranges;
  ck_assert(same_digest(digest_now(m), digest_now(cold)));
  ck_assert_int_eq(qkeep_model_reload(m, c.w0, 0), 0);
  ck_assert_int_eq(sync_from_device(m, dev, sdp, bad, bad_at), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), bad_name) && strstr(qkeep_errmsg(), "element 1 is NaN"), "%s",
                qkeep_errmsg());
  ck_assert(same_digest(digest_now(m), d0));
  count_end(dev);
  /* One copy per layer, for the checks (was one per scale tensor); normalisation, which merges the fused
   * q/k/v and gate/up per-tensor scales, reads the host copies the checks kept, not the device */
  ck_assert_msg(copies <= layers_with_scales, "%zu device-to-host copies for %zu scale tensors in %zu layers",
                copies, scales, layers_with_scales);
  if (_i == 0) /* every e4m3 block scale checked on the device, a layer's at once */
    ck_assert_msg(device_ranges == block_scales && device_checks >= 1 && device_checks <= layers_with_scales,
                  "%zu device checks of %zu ranges for %zu block scale tensors in %zu layers", device_checks,
                  device_ranges, block_scales, layers_with_scales);
  else
    ck_assert_msg(device_checks == 0, "%zu device checks without the slot", device_checks);
  async_case_close(&c);
}
END_TEST

/* From buckets in device memory, a layer's tensors land in its params through one batched copy (ABI
 * 1.5's copy_d2d_batch: a MoE layer's expert tensors are thousands of ranges), not one copy each; with a
 * backend that lacks the slot (_i == 1) the core copies range by range, and both give W1's bytes. */
START_TEST(device_bucket_tensors_land_in_one_batch_per_layer) {
  struct async_case c;
  async_case_open(&c);
  qkeep_model *m = c.m, *cold = c.cold;
  struct sender *sdp = &c.sd;
  size_t tensors = 0;
  for (size_t b = 0; b < sdp->n_buckets; b++)
    tensors += sdp->count[b];
  struct device *dev = count_begin(layer_device(qkeep_model_find_layer(m, "model.layers.1.mlp.experts")));
  if (_i == 1)
    counting.copy_d2d_batch = NULL;
  param_model = m;
  ck_assert_msg(sync_from_device(m, dev, sdp, SIZE_MAX, 0) == 0, "%s", qkeep_errmsg());
  size_t singles = d2d_into_params, calls = batches, ranges = batch_ranges;
  count_end(dev);
  ck_assert(same_digest(digest_now(m), digest_now(cold)));
  if (_i == 0) {
    /* a layer of one tensor (a norm) makes one plain copy, as does normalisation for a merged scale */
    ck_assert_msg(calls <= m->n_layers && singles <= tensors / 8 && ranges + singles >= tensors,
                  "%zu single copies and %zu batches of %zu ranges for %zu tensors in %zu layers", singles,
                  calls, ranges, tensors, m->n_layers);
  } else {
    ck_assert_msg(singles >= tensors / 2 && calls == 0, "%zu single copies, %zu batches", singles, calls);
  }
  async_case_close(&c);
}
END_TEST

/* A model of rank r of t (TP and EP) on test-async alone, loaded from path while its device-to-host copies
 * are counted (count_end after). */
static qkeep_model *load_async_counted(qkeep_plugin *async, const char *path, int t, int r,
                                       struct device **dev) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new_chain(&async, 1, &m), 0);
  struct qkeep_parallel p = {.size = sizeof p, .tp_size = t, .tp_rank = r, .ep_size = t, .ep_rank = r};
  ck_assert_int_eq(qkeep_model_set_parallel(m, &p), 0);
  *dev = count_begin(&m->chain.owners[0].dev);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

/* A cold load on a device with asynchronous copies checks each scale's bytes on the host as they stream
 * to the device (whole tensors, and each rank's slices), and a reload from files checks them before
 * anything changes: neither copies a scale back from the device to check it (a check after the upload
 * read every scale param back, once per layer). */
START_TEST(a_load_on_an_async_device_copies_no_scale_back_to_check_it) {
  static const char *const quantized[] = {"modelopt-nvfp4", "ct-nvfp4",  "mxfp4",
                                          "w8a8-int8",      "gptq-int4", "gpt-oss"};
  qkeep_plugin *async;
  ck_assert_msg(qkeep_plugin_open("test-async", NULL, &async) == 0, "%s", qkeep_errmsg());
  for (size_t i = 0; i < sizeof quantized / sizeof quantized[0]; i++) {
    char *w0 = checkpoint(quantized[i], 0), *w1 = checkpoint(quantized[i], 1);
    for (int t = 1; t <= 2; t++) {
      struct device *dev;
      qkeep_model *m = load_async_counted(async, w0, t, t - 1, &dev);
      size_t load_scales = scale_copies(m);
      d2h_copies = 0;
      ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s: %s", quantized[i], qkeep_errmsg());
      size_t reload_scales = scale_copies(m);
      count_end(dev);
      ck_assert_msg(load_scales == 0 && reload_scales == 0,
                    "%s, rank %d of %d: %zu scale copies to the host in the load, %zu in the reload",
                    quantized[i], t - 1, t, load_scales, reload_scales);
      qkeep_model *cold = load_chain_rank(w1, &async, 1, t, t - 1);
      ck_assert(same_digest(digest_now(m), digest_now(cold)));
      qkeep_model_free(m), qkeep_model_free(cold);
    }
    free(w0), free(w1);
  }
  qkeep_plugin_close(async);
}
END_TEST

/* Syncs every bucket of sd from host memory into m, bucket `bad` (SIZE_MAX: none) with the byte at bad_at set
 * to 0x7f (a NaN e4m3 scale); the first failure's code, or 0 after qkeep_sync_end. */
static int sync_from_host(qkeep_model *m, struct sender *sd, size_t bad, size_t bad_at) {
  qkeep_sync *sy;
  ck_assert_int_eq(qkeep_sync_begin(m, &sy), 0);
  int rc = 0;
  for (size_t b = 0; b < sd->n_buckets && !rc; b++) {
    unsigned char *rx = malloc(sd->bytes[b] + 1);
    memcpy(rx, sd->buf[b], sd->bytes[b]);
    if (b == bad)
      rx[bad_at] = 0x7f;
    struct qkeep_bucket bk = bucket_of(sd, b, rx);
    rc = qkeep_sync_bucket(sy, &bk);
    free(rx);
  }
  if (rc)
    qkeep_sync_abort(sy);
  return rc ? rc : qkeep_sync_end(sy);
}

/* One check of scale values serves every path, on host bytes before they reach the device: a NaN block scale
 * in W1 (element 5 of the third expert's up_proj, a fused shard's tensor) is refused in the same words by a
 * cold load streamed to test-async and one read into host memory (and a tensor-parallel rank's slice names
 * the element of the checkpoint's tensor), by a reload from files and by syncs from host and from device
 * buckets, whole or split. Nothing changes: the loads leave no layer, the reload leaves W0, the syncs put W0
 * back. */
START_TEST(a_bad_scale_is_refused_in_the_same_words_on_every_path) {
  static const char *const bad_name = "model.layers.1.mlp.experts.2.up_proj.weight_scale";
  static const char *const words =
      "tensor 'model.layers.1.mlp.experts.2.up_proj.weight_scale': element 5 is NaN (scales must be finite "
      "and non-negative";
  qkeep_plugin *async;
  ck_assert_msg(qkeep_plugin_open("test-async", NULL, &async) == 0, "%s", qkeep_errmsg());
  char *w0 = checkpoint("modelopt-nvfp4", 0), *w1 = checkpoint("modelopt-nvfp4", 1);
  struct sender sd = {0};
  /* W1's good bytes in memory, in buckets that split no layer and in buckets that split the experts */
  sender_open(&sd, w1, BUCKET_NO_SPLIT);
  struct sender split = {0};
  sender_open(&split, w1, 16 << 10);
  size_t bad = SIZE_MAX, bad_at = 0;
  for (size_t b = 0; b < sd.n_buckets; b++)
    for (size_t i = 0; i < sd.count[b]; i++)
      if (strcmp(sd.tensors[b][i].name, bad_name) == 0)
        bad = b, bad_at = sd.tensors[b][i].offset + 5;
  ck_assert_uint_ne(bad, SIZE_MAX);
  /* W1's file gets the NaN */
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(w1, &ck), 0);
  const struct ckpt_tensor *t = ckpt_find(ck, bad_name);
  ck_assert_ptr_nonnull(t);
  int fd = open(t->file->path, O_WRONLY);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(pwrite(fd, &(unsigned char){0x7f}, 1, (off_t)t->t->offset + 5), 1);
  /* and element 513, row 128 of [MI, H / 16]: the first row of rank 1's half under TP 2 */
  ck_assert_int_eq(t->t->shape[0] * t->t->shape[1], MI * H / 16);
  ck_assert_int_eq(pwrite(fd, &(unsigned char){0x7f}, 1, (off_t)t->t->offset + MI / 2 * H / 16 + 1), 1);
  close(fd);
  ckpt_close(ck);
  /* cold loads: streamed to the async device, and read into host memory (the reference backend) */
  qkeep_plugin *owners[] = {async, plugin};
  for (int o = 0; o < 2; o++) {
    qkeep_model *c;
    ck_assert_int_eq(qkeep_model_new(owners[o], &c), 0);
    ck_assert_int_eq(qkeep_model_load(c, w1), QKEEP_E_FORMAT);
    ck_assert_msg(strstr(qkeep_errmsg(), words) && strstr(qkeep_errmsg(), w1) &&
                      strstr(qkeep_errmsg(), "layer model.layers.1.mlp.experts"),
                  "%s", qkeep_errmsg());
    ck_assert_uint_eq(qkeep_model_layer_count(c), 0);
    qkeep_model_free(c);
    /* rank 1 of TP 2 loads its half of the rows only, and names the element in the checkpoint's tensor */
    ck_assert_int_eq(qkeep_model_new(owners[o], &c), 0);
    struct qkeep_parallel tp = {.size = sizeof tp, .tp_size = 2, .tp_rank = 1, .ep_size = 1};
    ck_assert_int_eq(qkeep_model_set_parallel(c, &tp), 0);
    ck_assert_int_eq(qkeep_model_load(c, w1), QKEEP_E_FORMAT);
    ck_assert_msg(strstr(qkeep_errmsg(), bad_name) && strstr(qkeep_errmsg(), "': element 513 is NaN (scales"),
                  "%s", qkeep_errmsg());
    ck_assert_uint_eq(qkeep_model_layer_count(c), 0);
    qkeep_model_free(c);
  }
  /* a reload from the file, then syncs from host and from device buckets: W0 stays, or is put back */
  qkeep_model *m = load_chain_rank(w0, &async, 1, 1, 0);
  struct qkeep_digest d0 = digest_now(m);
  ck_assert_int_eq(qkeep_model_reload(m, w1, 0), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), words) && strstr(qkeep_errmsg(), w1), "%s", qkeep_errmsg());
  ck_assert(same_digest(digest_now(m), d0));
  ck_assert_int_eq(sync_from_host(m, &sd, bad, bad_at), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), words), "%s", qkeep_errmsg());
  ck_assert(same_digest(digest_now(m), d0));
  const struct device *dev = layer_device(qkeep_model_find_layer(m, "model.layers.1.mlp.experts"));
  ck_assert_int_eq(sync_from_device(m, dev, &sd, bad, bad_at), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), words), "%s", qkeep_errmsg());
  ck_assert(same_digest(digest_now(m), d0));
  /* buckets that split the experts: the bad tensor waits, kept, for the rest of its layer, and the bucket it
   * came in fails (from device memory, the check's one copy to the host is what waits) */
  size_t split_bad = SIZE_MAX, split_at = 0, last_moe = 0;
  for (size_t b = 0; b < split.n_buckets; b++)
    for (size_t i = 0; i < split.count[b]; i++) {
      if (strstr(split.tensors[b][i].name, ".mlp.experts."))
        last_moe = b;
      if (strcmp(split.tensors[b][i].name, bad_name) == 0)
        split_bad = b, split_at = split.tensors[b][i].offset + 5;
    }
  ck_assert_uint_lt(split_bad, last_moe);
  ck_assert_int_eq(sync_from_host(m, &split, split_bad, split_at), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), words), "%s", qkeep_errmsg());
  ck_assert(same_digest(digest_now(m), d0));
  ck_assert_int_eq(sync_from_device(m, dev, &split, split_bad, split_at), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), words), "%s", qkeep_errmsg());
  ck_assert(same_digest(digest_now(m), d0));
  sender_close(&split);
  /* the control: the same buckets without the NaN sync */
  ck_assert_msg(sync_from_host(m, &sd, SIZE_MAX, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(sync_from_device(m, dev, &sd, SIZE_MAX, 0) == 0, "%s", qkeep_errmsg());
  qkeep_model_free(m);
  sender_close(&sd);
  qkeep_plugin_close(async);
  free(w0), free(w1);
}
END_TEST

/* Rewrites one byte of a file in place and puts its modification time back, so that only its change
 * time (which no call can set) tells; waits first until the clock that stamps files has moved past
 * the change time it has. */
static void rewrite_byte_keeping_mtime(const char *file, off_t at) {
  struct stat before, after;
  ck_assert_int_eq(stat(file, &before), 0);
  struct timespec now;
  do {
    nanosleep(&(struct timespec){0, 1000000}, NULL);
    clock_gettime(CLOCK_REALTIME_COARSE, &now);
  } while (now.tv_sec < before.st_ctim.tv_sec ||
           (now.tv_sec == before.st_ctim.tv_sec && now.tv_nsec <= before.st_ctim.tv_nsec));
  int fd = open(file, O_RDWR);
  ck_assert_int_ge(fd, 0);
  unsigned char b;
  ck_assert_int_eq(pread(fd, &b, 1, at), 1);
  b ^= 0x11;
  ck_assert_int_eq(pwrite(fd, &b, 1, at), 1);
  ck_assert_int_eq(close(fd), 0);
  ck_assert_int_eq(utimensat(AT_FDCWD, file, (struct timespec[2]){before.st_atim, before.st_mtim}, 0), 0);
  ck_assert_int_eq(stat(file, &after), 0);
  ck_assert(after.st_ino == before.st_ino && after.st_size == before.st_size &&
            after.st_mtim.tv_sec == before.st_mtim.tv_sec && after.st_mtim.tv_nsec == before.st_mtim.tv_nsec);
}

/* A sync that fails midway puts W0 back only from the very files the model read W0 from, as a reload's
 * rollback does: after one byte of W0's file changed in place (its modification time put back), the
 * rollback refuses and the model is poisoned, where a re-read would have given it another W0. */
START_TEST(a_failed_sync_rolls_back_only_from_the_files_w0_was_read_from) {
  struct sync_case c;
  sync_case_open(&c);
  /* the last byte of q_proj's codes: in this rank's rows (rank 1 of 2 holds the second half) */
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(c.w0, &ck), 0);
  const struct ckpt_tensor *q = ckpt_find(ck, "model.layers.0.self_attn.q_proj.weight");
  ck_assert_ptr_nonnull(q);
  char *file = strdup(q->file->path);
  off_t at = (off_t)(q->t->offset + q->t->nbytes - 1);
  ckpt_close(ck);
  qkeep_sync *sy;
  ck_assert_int_eq(qkeep_sync_begin(c.m, &sy), 0);
  struct qkeep_bucket b0 = bucket_of(&c.sd, 0, c.sd.buf[0]);
  ck_assert_msg(qkeep_sync_bucket(sy, &b0) == 0, "%s", qkeep_errmsg());
  ck_assert(!same_digest(digest_now(c.m), c.d0)); /* layers of W1 landed */
  rewrite_byte_keeping_mtime(file, at);
  struct qkeep_bucket_tensor saved = c.sd.tensors[1][0];
  c.sd.tensors[1][0].spec.shape[0]++; /* the second bucket fails its validation */
  struct qkeep_bucket b1 = bucket_of(&c.sd, 1, c.sd.buf[1]);
  ck_assert_int_eq(qkeep_sync_bucket(sy, &b1), QKEEP_E_FORMAT);
  c.sd.tensors[1][0] = saved;
  ck_assert_msg(strstr(qkeep_errmsg(), "rollback impossible") &&
                    strstr(qkeep_errmsg(), "changed since the model read it") && strstr(qkeep_errmsg(), file),
                "%s", qkeep_errmsg());
  ck_assert_int_eq(qkeep_sync_end(sy), QKEEP_E_STATE);
  assert_runs(c.m, QKEEP_E_STATE); /* poisoned */
  ck_assert_int_eq(qkeep_sync_begin(c.m, &sy), QKEEP_E_STATE);
  /* What a re-read would have given: the changed file's bytes, not W0's (the byte is this rank's). */
  qkeep_model *changed = load_rank(c.w0, plugin, 2, 2, 1, 1);
  struct qkeep_digest dc = digest_now(changed);
  ck_assert(!same_digest(dc, c.d0));
  ck_assert_msg(qkeep_model_reload(c.m, c.w0, 0) == 0, "%s", qkeep_errmsg()); /* a reload clears it */
  ck_assert(same_digest(digest_now(c.m), dc));
  assert_runs(c.m, 0);
  qkeep_model_free(changed);
  sync_case_close(&c);
  free(file);
}
END_TEST

/* After a successful sync the model equals no file: a reload that then fails midway has nothing to roll
 * back to (W0's files are not its previous weights) and leaves the model refusing to run. */
START_TEST(a_reload_failing_after_a_sync_does_not_roll_back_to_w0) {
  struct sync_case c;
  sync_case_open(&c);
  qkeep_sync *sy;
  ck_assert_int_eq(qkeep_sync_begin(c.m, &sy), 0);
  for (size_t b = 0; b < c.sd.n_buckets; b++) {
    struct qkeep_bucket bk = bucket_of(&c.sd, b, c.sd.buf[b]);
    ck_assert_msg(qkeep_sync_bucket(sy, &bk) == 0, "%s", qkeep_errmsg());
  }
  ck_assert_msg(qkeep_sync_end(sy) == 0, "%s", qkeep_errmsg());
  ck_assert_ptr_null(c.m->source.path);
  ck_assert_uint_gt(c.m->n_layers, 3);
  inject_fault(c.m, 3, QKEEP_E_IO); /* the reload fails at its fourth layer */
  ck_assert_int_eq(qkeep_model_reload(c.m, c.w0, 0), QKEEP_E_IO);
  inject_fault(c.m, -1, 0);
  ck_assert_msg(strstr(qkeep_errmsg(), "rollback impossible") &&
                    strstr(qkeep_errmsg(), "no checkpoint holds"),
                "%s", qkeep_errmsg());
  assert_runs(c.m, QKEEP_E_STATE);
  ck_assert_msg(qkeep_model_reload(c.m, c.w0, 0) == 0, "%s", qkeep_errmsg());
  ck_assert(same_digest(digest_now(c.m), c.d0));
  sync_case_close(&c);
}
END_TEST

/* A tied lm_head (the embedding's param under a second layer): the plan sends the embedding once and
 * nothing for lm_head, and the sync still equals a cold load of W1. */
static char *write_tied(const char *name_dir, uint64_t seed) {
  char *d = tu_path(dir, name_dir), *file = tu_path(d, "model.safetensors"),
       *config = tu_path(d, "config.json");
  ck_assert_int_eq(mkdir(d, 0755), 0);
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  tu_add_source_f32(w, "model.embed_tokens.weight", VOCAB, H, seed);
  tu_add_source_f32(w, "model.norm.weight", H, 0, seed);
  tu_add_source_f32(w, "model.layers.0.self_attn.q_proj.weight", Q, H, seed);
  tu_add_source_f32(w, "model.layers.0.self_attn.k_proj.weight", KV, H, seed);
  tu_add_source_f32(w, "model.layers.0.self_attn.v_proj.weight", KV, H, seed);
  tu_add_source_f32(w, "model.layers.0.self_attn.o_proj.weight", H, Q, seed);
  ck_assert_int_eq(st_writer_write(w, file), 0);
  st_writer_free(w);
  const char *cfg = "{\"tie_word_embeddings\": true}";
  ck_assert_int_eq(tu_write_file(config, cfg, strlen(cfg)), 0);
  free(file), free(config);
  return d;
}

START_TEST(a_tied_lm_head_is_sent_once_as_the_embedding) {
  char *w0 = write_tied("tied-w0", 1), *w1 = write_tied("tied-w1", 2);
  qkeep_model *full = load_rank(w1, NULL, 1, 1, 0, 0);
  qkeep_layer *head = qkeep_model_find_layer(full, "lm_head"),
              *embed = qkeep_model_find_layer(full, "model.embed_tokens");
  ck_assert_ptr_nonnull(head);
  ck_assert_ptr_eq(qkeep_param_lookup(head, "weight"), qkeep_param_lookup(embed, "weight")); /* one object */
  struct qkeep_sync_entry *plan;
  size_t n, nb, embeds = 0;
  ck_assert_int_eq(qkeep_sync_plan(full, 1 << 20, &plan, &n, &nb), 0);
  for (size_t i = 0; i < n; i++) {
    ck_assert_msg(strncmp(plan[i].tensor.name, "lm_head", 7) != 0, "lm_head sent: %s", plan[i].tensor.name);
    embeds += strcmp(plan[i].tensor.name, "model.embed_tokens.weight") == 0;
  }
  ck_assert_uint_eq(embeds, 1);
  qkeep_sync_plan_free(plan);
  qkeep_model_free(full);
  struct qkeep_transport *tr[3];
  ck_assert_int_eq(qkeep_transport_inprocess(3, tr), 0);
  sync_ranks(w0, w1, 2, tr, 16 << 10);
  for (int i = 0; i < 3; i++)
    tr[i]->close(tr[i]->ctx);
  free(w0), free(w1);
}
END_TEST

START_TEST(sync_refuses_what_it_cannot_do) {
  char *w = checkpoint("w8a8-int8", 0);
  qkeep_model *empty, *ep_rank = load_rank(w, NULL, 2, 2, 0, 0);
  ck_assert_int_eq(qkeep_model_new(NULL, &empty), 0);
  qkeep_sync *sy;
  ck_assert_int_eq(qkeep_sync_begin(empty, &sy), QKEEP_E_STATE); /* nothing loaded */
  ck_assert_int_eq(qkeep_sync_begin(NULL, &sy), QKEEP_E_INVAL);
  struct qkeep_sync_entry *plan;
  size_t n, nb;
  /* an EP rank does not know the other ranks' experts: plan from a one-rank or TP model */
  ck_assert_int_eq(qkeep_sync_plan(ep_rank, 1 << 20, &plan, &n, &nb), QKEEP_E_STATE);
  ck_assert_int_eq(qkeep_sync_plan(ep_rank, 0, &plan, &n, &nb), QKEEP_E_INVAL);
  ck_assert_int_eq(qkeep_sync_begin(ep_rank, &sy), 0);
  ck_assert_int_eq(qkeep_sync_bucket(sy, NULL), QKEEP_E_INVAL);
  struct qkeep_bucket none = {.size = sizeof none};
  ck_assert_int_eq(qkeep_sync_bucket(sy, &none), 0);      /* an empty bucket changes nothing */
  ck_assert_int_eq(qkeep_sync_end(sy), QKEEP_E_NOTFOUND); /* nothing arrived: named, nothing to put back */
  ck_assert_int_eq(qkeep_sync_end(NULL), 0);
  qkeep_sync_abort(NULL);
  struct qkeep_transport *tr[2];
  ck_assert_int_eq(qkeep_transport_inprocess(0, tr), QKEEP_E_INVAL);
  ck_assert_int_eq(qkeep_transport_inprocess(2, tr), 0);
  unsigned char a[4] = {1, 2, 3, 4}, b[4] = {0};
  ck_assert_int_eq(tr[1]->broadcast(tr[1]->ctx, b, 4, 0), QKEEP_E_STATE); /* nothing published yet */
  ck_assert_int_eq(tr[0]->broadcast(tr[0]->ctx, a, 4, 0), 0);
  ck_assert_int_eq(tr[1]->broadcast(tr[1]->ctx, b, 3, 0), QKEEP_E_STATE); /* another size */
  ck_assert_int_eq(tr[1]->broadcast(tr[1]->ctx, b, 4, 0), 0);
  ck_assert_mem_eq(a, b, 4);
  ck_assert_int_eq(tr[1]->broadcast(tr[1]->ctx, b, 4, 2), QKEEP_E_INVAL);
  tr[0]->close(tr[0]->ctx), tr[1]->close(tr[1]->ctx);
  qkeep_model_free(empty), qkeep_model_free(ep_rank);
  free(w);
}
END_TEST

/* The fake libnccl's record of NCCL_NVLS_ENABLE as its last ncclCommInitRank saw it. */
static const char *nvls_seen(const char *lib) {
  void *h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
  ck_assert_ptr_nonnull(h);
  const char *(*nvls)(void);
  void *sym = dlsym(h, "fake_nccl_nvls");
  memcpy(&nvls, &sym, sizeof sym);
  const char *seen = nvls();
  dlclose(h);
  return seen;
}

START_TEST(the_nccl_transport_dlopens_libnccl_and_says_why_not) {
  unsetenv("NCCL_NVLS_ENABLE");
  unsigned char id[128];
  ck_assert_int_eq(qkeep_nccl_unique_id("/nonexistent/libnccl.so.2", id), QKEEP_E_NOTFOUND);
  ck_assert_msg(strstr(qkeep_errmsg(), "cannot load /nonexistent/libnccl.so.2"), "%s", qkeep_errmsg());
  /* NCCL's configuration is the caller's: the library never sets NCCL_NVLS_ENABLE (or anything
   * else) in the caller's environment, and NCCL sees the environment the caller left. */
  char *lib = tu_path(tu_builddir(), "tests/plugins/.libs/libnccl-fake.so");
  ck_assert_msg(qkeep_nccl_unique_id(lib, id) == 0, "%s", qkeep_errmsg());
  struct qkeep_transport *one;
  ck_assert_msg(qkeep_transport_nccl(lib, 1, 0, id, &one) == 0, "%s", qkeep_errmsg());
  ck_assert_ptr_null(getenv("NCCL_NVLS_ENABLE"));
  ck_assert_str_eq(nvls_seen(lib), "unset");
  one->close(one->ctx);
  free(lib);
  ck_assert_int_eq(qkeep_nccl_unique_id("libm.so.6", id), QKEEP_E_PLUGIN);
  ck_assert_msg(strstr(qkeep_errmsg(), "has no ncclGetUniqueId"), "%s", qkeep_errmsg());
  struct qkeep_transport *t;
  ck_assert_int_eq(qkeep_transport_nccl("/nonexistent/libnccl.so.2", 2, 0, id, &t), QKEEP_E_NOTFOUND);
  ck_assert_int_eq(qkeep_transport_nccl(NULL, 2, 2, id, &t), QKEEP_E_INVAL);
}
END_TEST

/* The NCCL transport's own code (dlopen, entry points, unique id, communicators, broadcast) over a
 * stand-in libnccl that copies host memory: a sync through it equals a cold sharded load. */
START_TEST(a_sync_through_the_nccl_transport_over_a_stand_in_libnccl) {
  char *lib = tu_path(tu_builddir(), "tests/plugins/.libs/libnccl-fake.so");
  char *w0 = checkpoint("gptq-int4", 0), *w1 = checkpoint("gptq-int4", 1);
  /* NVLink multicast off, as an engine on a host with shared GPUs keeps it: the caller's setting,
   * before its first NCCL call, is what NCCL sees. */
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  unsigned char id[128];
  ck_assert_msg(qkeep_nccl_unique_id(lib, id) == 0, "%s", qkeep_errmsg());
  struct qkeep_transport *tr[3];
  for (int r = 0; r < 3; r++)
    ck_assert_msg(qkeep_transport_nccl(lib, 3, r, id, &tr[r]) == 0, "%s", qkeep_errmsg());
  ck_assert_str_eq(tr[0]->name, "nccl");
  ck_assert_str_eq(nvls_seen(lib), "0"); /* NVLink multicast off when the communicators started */
  ck_assert_int_eq(tr[1]->broadcast(tr[1]->ctx, id, 8, 5), QKEEP_E_INVAL);
  sync_ranks(w0, w1, 2, tr, 64 << 10);
  for (int r = 0; r < 3; r++)
    tr[r]->close(tr[r]->ctx);
  unsetenv("NCCL_NVLS_ENABLE");
  free(lib), free(w0), free(w1);
}
END_TEST

/* libnccl is code the core runs: a file the caller or $QKEEP_NCCL_LIBRARY names is trusted only as a
 * plugin's is (it and its directory owned by root or the caller, writable by no one else), or refused
 * before it is loaded, naming the path (a 0666 library of another user in a 0777 directory would
 * otherwise run its constructors in the caller's process). */
START_TEST(an_nccl_library_others_could_replace_is_refused) {
  char *fake = tu_path(tu_builddir(), "tests/plugins/.libs/libnccl-fake.so"), *sub = tu_path(dir, "nccl");
  ck_assert_int_eq(mkdir(sub, 0755), 0);
  char *lib = tu_path(sub, "libnccl.so.2");
  size_t n;
  void *bytes = tu_read_file(fake, &n);
  ck_assert_ptr_nonnull(bytes);
  ck_assert_int_eq(tu_write_file(lib, bytes, n), 0);
  free(bytes);
  unsigned char id[128];
  struct qkeep_transport *t;
  static const mode_t open_to_others[] = {0666, 0757, 0775};
  for (size_t i = 0; i < sizeof open_to_others / sizeof open_to_others[0]; i++) {
    ck_assert_int_eq(chmod(lib, open_to_others[i]), 0);
    ck_assert_int_eq(qkeep_nccl_unique_id(lib, id), QKEEP_E_PLUGIN);
    ck_assert_msg(strstr(qkeep_errmsg(), lib) && strstr(qkeep_errmsg(), "refused") &&
                      strstr(qkeep_errmsg(), "writable by"),
                  "%s", qkeep_errmsg());
    ck_assert_int_eq(qkeep_transport_nccl(lib, 1, 0, id, &t), QKEEP_E_PLUGIN);
    setenv("QKEEP_NCCL_LIBRARY", lib, 1); /* the same file named by the environment */
    ck_assert_int_eq(qkeep_nccl_unique_id(NULL, id), QKEEP_E_PLUGIN);
    ck_assert_msg(strstr(qkeep_errmsg(), "QKEEP_NCCL_LIBRARY") && strstr(qkeep_errmsg(), lib), "%s",
                  qkeep_errmsg());
    ck_assert_int_eq(qkeep_transport_nccl(NULL, 1, 0, id, &t), QKEEP_E_PLUGIN);
    unsetenv("QKEEP_NCCL_LIBRARY");
  }
  ck_assert_int_eq(chmod(lib, 0755), 0);
  ck_assert_int_eq(chmod(sub, 0777), 0); /* the directory: the file could be swapped */
  ck_assert_int_eq(qkeep_nccl_unique_id(lib, id), QKEEP_E_PLUGIN);
  ck_assert_msg(strstr(qkeep_errmsg(), lib) && strstr(qkeep_errmsg(), "directory"), "%s", qkeep_errmsg());
  ck_assert_int_eq(chmod(sub, 0755), 0);
  if (geteuid() == 0) { /* only root can give a file away */
    ck_assert_int_eq(chown(lib, 4321, (gid_t)-1), 0);
    ck_assert_int_eq(qkeep_nccl_unique_id(lib, id), QKEEP_E_PLUGIN);
    ck_assert_msg(strstr(qkeep_errmsg(), lib) && strstr(qkeep_errmsg(), "owned by uid 4321"), "%s",
                  qkeep_errmsg());
    ck_assert_int_eq(chown(lib, geteuid(), (gid_t)-1), 0);
  }
  /* Trusted again: it loads, from the caller's path and from the environment's. */
  ck_assert_msg(qkeep_nccl_unique_id(lib, id) == 0, "%s", qkeep_errmsg());
  setenv("QKEEP_NCCL_LIBRARY", lib, 1);
  ck_assert_msg(qkeep_transport_nccl(NULL, 1, 0, id, &t) == 0, "%s", qkeep_errmsg());
  unsetenv("QKEEP_NCCL_LIBRARY");
  t->close(t->ctx);
  free(fake), free(sub), free(lib);
}
END_TEST

static void count_sync_lines(void *user, enum qkeep_log_level level, const char *msg) {
  if (level == QKEEP_LOG_DEBUG && strncmp(msg, "qkeep sync: bucket of ", 22) == 0)
    ++*(int *)user;
}

/* Where each bucket's time goes is a debug line to the logger (never stderr), one per bucket, and
 * nothing at the default level. */
START_TEST(a_sync_logs_a_line_per_bucket_at_debug_level) {
  struct sync_case c;
  sync_case_open(&c);
  int lines = 0;
  qkeep_set_logger(count_sync_lines, &lines);
  for (int pass = 0; pass < 2; pass++) {
    qkeep_set_log_level(pass ? QKEEP_LOG_DEBUG : QKEEP_LOG_INFO);
    qkeep_sync *sy;
    ck_assert_int_eq(qkeep_sync_begin(c.m, &sy), 0);
    for (size_t b = 0; b < c.sd.n_buckets; b++) {
      struct qkeep_bucket bk = bucket_of(&c.sd, b, c.sd.buf[b]);
      ck_assert_msg(qkeep_sync_bucket(sy, &bk) == 0, "%s", qkeep_errmsg());
    }
    ck_assert_msg(qkeep_sync_end(sy) == 0, "%s", qkeep_errmsg());
    ck_assert_int_eq(lines, pass ? (int)c.sd.n_buckets : 0);
  }
  ck_assert_uint_gt(c.sd.n_buckets, 1);
  qkeep_set_logger(NULL, NULL);
  qkeep_set_log_level(QKEEP_LOG_INFO);
  sync_case_close(&c);
}
END_TEST

/* NCCL leaves its own threads running in the library (ncclGetUniqueId's bootstrap root waits for the
 * ranks; the stand-in starts one too): libnccl must stay loaded once opened. Unloading it after the
 * unique id, or after a communicator, crashed a later run in the same process. */
START_TEST(libnccl_stays_loaded_while_the_threads_it_started_run) {
  char *lib = tu_path(tu_builddir(), "tests/plugins/.libs/libnccl-fake.so");
  unsigned char id[128];
  ck_assert_msg(qkeep_nccl_unique_id(lib, id) == 0, "%s", qkeep_errmsg());
  void *h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
  ck_assert_msg(h != NULL, "libnccl was unloaded while the bootstrap root thread it started runs");
  dlclose(h);
  struct qkeep_transport *tr[2];
  for (int r = 0; r < 2; r++)
    ck_assert_msg(qkeep_transport_nccl(lib, 2, r, id, &tr[r]) == 0, "%s", qkeep_errmsg());
  for (int r = 0; r < 2; r++)
    tr[r]->close(tr[r]->ctx);
  h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
  ck_assert_msg(h != NULL, "libnccl was unloaded when its last communicator closed");
  dlclose(h);
  free(lib);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("shard");
  TCase *tc = tcase_create("shard");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 600);
  tcase_add_loop_test(tc, every_rank_holds_its_rows_and_columns_of_a_one_rank_load, 0, N_SCHEMES);
  tcase_add_test(tc, indivisible_dims_are_refused_with_the_layer_and_numbers_before_any_allocation);
  tcase_add_loop_test(tc, the_ranks_compute_what_the_one_rank_layer_computes, 0, N_SCHEMES);
  tcase_add_test(tc, channelwise_scales_of_a_row_cut_are_repeated);
  tcase_add_test(tc, the_config_gives_the_parallel_place);
  tcase_add_loop_test(tc, each_rank_reloads_in_place_equal_to_a_cold_sharded_load_of_w1, 0, N_SCHEMES);
  tcase_add_test(tc, a_device_with_async_copies_loads_each_rank_slice);
  tcase_add_loop_test(tc, a_sync_of_w1_buckets_equals_a_cold_sharded_load_on_every_rank, 0, N_SCHEMES);
  tcase_add_test(tc, a_bad_bucket_fails_the_sync_and_puts_w0_back);
  tcase_add_test(tc, a_sync_of_device_buckets_splitting_the_experts_equals_a_cold_load);
  tcase_add_loop_test(tc, device_bucket_scales_are_checked_from_a_few_copies, 0, 2);
  tcase_add_loop_test(tc, device_bucket_tensors_land_in_one_batch_per_layer, 0, 2);
  tcase_add_test(tc, a_load_on_an_async_device_copies_no_scale_back_to_check_it);
  tcase_add_test(tc, a_bad_scale_is_refused_in_the_same_words_on_every_path);
  tcase_add_test(tc, a_failed_sync_rolls_back_only_from_the_files_w0_was_read_from);
  tcase_add_test(tc, a_reload_failing_after_a_sync_does_not_roll_back_to_w0);
  tcase_add_test(tc, a_tied_lm_head_is_sent_once_as_the_embedding);
  tcase_add_test(tc, sync_refuses_what_it_cannot_do);
  tcase_add_test(tc, the_nccl_transport_dlopens_libnccl_and_says_why_not);
  tcase_add_test(tc, a_sync_through_the_nccl_transport_over_a_stand_in_libnccl);
  tcase_add_test(tc, libnccl_stays_loaded_while_the_threads_it_started_run);
  tcase_add_test(tc, an_nccl_library_others_could_replace_is_refused);
  tcase_add_test(tc, a_sync_logs_a_line_per_bucket_at_debug_level);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  fixture_name = "shard";
  return tu_run_suite(suite(), CK_NORMAL);
}
