/*
 * shard.c: tensor-parallel and expert-parallel loading. A rank plans every layer with its
 * own dims and creates only its slice of each param, in stored units:
 *
 *   column-parallel (q/k/v/gate/up, fused qkv_proj / gate_up_proj: each member cut, then
 *   fused): the dimension carrying N (or N/8 for zero points packed along N) is cut;
 *   row-parallel (o_proj, down_proj, out_proj): the dimension carrying K, K/2, K/8, K/16,
 *   K/32 or K/G is cut (packed codes and block/group scales cut with their blocks);
 *   per-tensor scales (F_SLOT), act-order g_idx of a column cut, weight_shape and a
 *   row-parallel bias are repeated; channelwise scales of a row cut (G = K) are repeated;
 *   MoE with ep_size > 1: whole experts per rank; with TP only: each expert cut as a
 *   linear (w13 by column, w2 by row); everything else is replicated.
 *
 * Every cut dimension must give each rank a multiple of the lcm of its stored units,
 * checked before any param exists. A source's slice is a set of byte runs of the
 * checkpoint tensor; a rank reads only those runs from a file.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "shard.h"

/* ---- the model's place ------------------------------------------------------------------ */

static int size_of(int size) { return size > 1 ? size : 1; }

int qkeep_model_set_parallel(qkeep_model *model, const struct qkeep_parallel *parallel) {
  if (!model || !parallel)
    return set_error(QKEEP_E_INVAL, "qkeep_model_set_parallel: NULL argument");
  if (model->n_layers)
    return set_error(QKEEP_E_STATE,
                     "qkeep_model_set_parallel: the model already holds %zu layers; set the "
                     "parallel place before loading",
                     model->n_layers);
  /* The caller's struct may be older (shorter): read only the size it states; absent fields are 0. */
  struct qkeep_parallel p = {0};
  memcpy(&p, parallel, parallel->size && parallel->size < sizeof p ? parallel->size : sizeof p);
  if (p.tp_size < 0 || p.ep_size < 0 || p.tp_rank < 0 || p.ep_rank < 0 || p.tp_rank >= size_of(p.tp_size) ||
      p.ep_rank >= size_of(p.ep_size))
    return set_error(QKEEP_E_INVAL, "qkeep_model_set_parallel: tp rank %d of %d, ep rank %d of %d", p.tp_rank,
                     p.tp_size, p.ep_rank, p.ep_size);
  p.size = sizeof p;
  model->parallel = p;
  return 0;
}

const char *qkeep_shard_role_name(enum qkeep_shard_role role) {
  switch (role) {
  case QKEEP_SHARD_REPLICATED: return "replicated";
  case QKEEP_SHARD_COLUMN: return "column";
  case QKEEP_SHARD_ROW: return "row";
  case QKEEP_SHARD_EXPERT: return "expert";
  case QKEEP_SHARD_MOE_TP: return "moe-tp";
  }
  return "?";
}

int qkeep_layer_get_shard(const qkeep_layer *layer, struct qkeep_layer_shard *out) {
  if (!layer || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_layer_get_shard: NULL argument");
  struct qkeep_layer_shard s = layer->shard;
  if (s.ranks == 0) { /* never planned by a cut (plain, kv-scales, tied, or an unsharded model) */
    s = (struct qkeep_layer_shard){.role = QKEEP_SHARD_REPLICATED,
                                   .ranks = 1,
                                   .n = layer->dims.n,
                                   .k = layer->dims.k,
                                   .experts = layer->dims.experts};
    memcpy(s.shard_n, layer->dims.shard_n, sizeof s.shard_n);
  }
  s.size = sizeof s;
  copy_sized(out, &s, sizeof s);
  return 0;
}

int shard_note_foreign(qkeep_model *model, const char *name) {
  char *copy = xstrdup(name);
  int rc = copy ? grow_array((void **)&model->foreign, &model->cap_foreign, model->n_foreign + 1,
                             sizeof *model->foreign)
                : set_error(QKEEP_E_NOMEM, "out of memory");
  if (!rc && (rc = name_index_put(&model->foreign_index, copy, model->n_foreign, NULL)) == QKEEP_E_EXISTS)
    rc = 0, free(copy), copy = NULL;
  else if (rc)
    free(copy), copy = NULL;
  if (copy)
    model->foreign[model->n_foreign++] = copy;
  return rc;
}

bool shard_is_foreign(const qkeep_model *model, const char *name) {
  size_t at;
  return model->n_foreign && name_index_get(&model->foreign_index, name, &at);
}

void shard_clear(qkeep_model *model) {
  name_index_clear(&model->foreign_index);
  for (size_t i = 0; i < model->n_foreign; i++)
    free(model->foreign[i]);
  free(model->foreign);
  model->foreign = NULL;
  model->n_foreign = model->cap_foreign = 0;
}

/* ---- planning ------------------------------------------------------------------------------ */

static const char *last_part(const char *name) {
  const char *dot = strrchr(name, '.');
  return dot ? dot + 1 : name;
}

static bool name_in(const char *name, const char *const *set) {
  for (; *set; set++)
    if (strcmp(name, *set) == 0)
      return true;
  return false;
}

/* A linear layer's role, by its last name component (vLLM's Llama/Qwen/Mixtral names). */
static enum qkeep_shard_role linear_role(const char *layer_name) {
  static const char *const column[] = {"q_proj",  "k_proj",       "v_proj", "qkv_proj", "gate_proj",
                                       "up_proj", "gate_up_proj", "w1",     "w3",       NULL};
  static const char *const row[] = {"o_proj", "down_proj", "out_proj", "w2", NULL};
  const char *last = last_part(layer_name);
  return name_in(last, column) ? QKEEP_SHARD_COLUMN
         : name_in(last, row)  ? QKEEP_SHARD_ROW
                               : QKEEP_SHARD_REPLICATED;
}

/* Elements of the full dimension per stored element of template dim d (the pack factor or the
 * block), and whether d carries N or K. */
static int64_t unit_of(enum dim_expr d, int64_t g, bool *carries_n, bool *carries_k) {
  *carries_n = d == D_N || d == D_N_8;
  *carries_k = d == D_K || d == D_K_2 || d == D_K_8 || d == D_K_16 || d == D_K_32 || d == D_K_G;
  switch (d) {
  case D_N_8:
  case D_K_8: return 8;
  case D_K_2: return 2;
  case D_K_16: return 16;
  case D_K_32: return 32;
  case D_K_G: return g > 0 ? g : 1;
  default: return 1;
  }
}

static int64_t gcd64(int64_t a, int64_t b) {
  while (b) {
    int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}
static int64_t lcm64(int64_t a, int64_t b) { return a / gcd64(a, b) * b; }

/* The dimension of template t that a cut divides, or -1 (repeated). */
static int cut_dim(const struct shard_plan *plan, const struct param_template *t, int64_t g) {
  if (t->fuse == F_SLOT || t->fuse == F_STACKED || plan->cut == CUT_NONE || plan->cut == CUT_EXPERTS)
    return -1;
  if (plan->cut == CUT_N && t->fuse == F_SHARED)
    return -1; /* a per-K tensor every fused shard repeats (g_idx): not cut by N */
  for (int i = 0; i < t->ndim; i++) {
    bool on_n, on_k;
    unit_of(t->dims[i], g, &on_n, &on_k);
    if (plan->cut == CUT_N && on_n)
      return i;
    if (plan->cut == CUT_K && on_k && !(t->dims[i] == D_K_G && plan->repeat_groups))
      return i;
  }
  return -1;
}

/* The role of one matrix of the layer, and the rank group it is cut over. */
static enum shard_cut matrix_cut(const qkeep_layer *layer, const char *prefix, int *ranks, int *rank,
                                 enum qkeep_shard_role *role) {
  const struct qkeep_parallel *p = &layer->model->parallel;
  int tp = size_of(p->tp_size), ep = size_of(p->ep_size);
  *ranks = 1;
  *rank = 0;
  *role = QKEEP_SHARD_REPLICATED;
  if (layer->kind == QKEEP_LAYER_MOE) {
    if (ep > 1) {
      *ranks = ep, *rank = p->ep_rank, *role = QKEEP_SHARD_EXPERT;
      return CUT_EXPERTS;
    }
    if (tp > 1) {
      *ranks = tp, *rank = p->tp_rank, *role = QKEEP_SHARD_MOE_TP;
      return strcmp(prefix, "w2_") == 0 ? CUT_K : CUT_N;
    }
    return CUT_NONE;
  }
  if (layer->kind != QKEEP_LAYER_LINEAR || tp < 2)
    return CUT_NONE;
  *role = linear_role(layer->name);
  if (*role == QKEEP_SHARD_REPLICATED)
    return CUT_NONE;
  *ranks = tp, *rank = p->tp_rank;
  return *role == QKEEP_SHARD_COLUMN ? CUT_N : CUT_K;
}

/* Appends "name unit" to the units list of a refusal. */
static void note_unit(char *buf, size_t len, const char *name, int64_t unit) {
  size_t at = strlen(buf);
  if (at < len)
    snprintf(buf + at, len - at, "%s%s %lld", at ? ", " : "", name, (long long)unit);
}

/* Checks that `full` splits into `ranks` parts of whole units of every cut template. */
static int check_divides(const char *prefix, const struct shard_plan *plan,
                         const struct param_template *params, size_t n_params, uint32_t present, int64_t g,
                         const char *what, int64_t full) {
  int64_t unit = 1;
  char units[256] = "";
  for (size_t i = 0; i < n_params; i++) {
    int d = (present >> i) & 1u ? cut_dim(plan, &params[i], g) : -1;
    if (d < 0)
      continue;
    bool on_n, on_k;
    int64_t u = unit_of(params[i].dims[d], g, &on_n, &on_k);
    unit = lcm64(unit, u);
    note_unit(units, sizeof units, params[i].name, u);
  }
  if (full % ((int64_t)plan->ranks * unit) == 0)
    return 0;
  return set_error(QKEEP_E_UNSUPPORTED,
                   "%s%s over %d ranks: %s is %lld, not a multiple of %d x %lld (each rank's part "
                   "must be whole stored units: lcm of %s)",
                   prefix, plan->cut == CUT_N ? "column-parallel" : "row-parallel", plan->ranks, what,
                   (long long)full, plan->ranks, (long long)unit, units[0] ? units : "1");
}

int shard_plan_matrix(qkeep_layer *layer, const char *prefix, const struct param_template *params,
                      size_t n_params, uint32_t present, uint32_t flags, int shards, int64_t *shard_n,
                      int64_t *n, int64_t *k, int64_t *g, int *experts, int *first_expert,
                      struct shard_plan *plan) {
  enum qkeep_shard_role role;
  *plan = (struct shard_plan){.cut = CUT_NONE};
  plan->cut = matrix_cut(layer, prefix, &plan->ranks, &plan->rank, &role);
  bool w2 = strcmp(prefix, "w2_") == 0;
  if (!w2) {
    struct qkeep_layer_shard *s = &layer->shard;
    *s = (struct qkeep_layer_shard){.size = sizeof *s,
                                    .role = role,
                                    .ranks = plan->ranks,
                                    .rank = plan->rank,
                                    .n = *n,
                                    .k = *k,
                                    .experts = *experts};
    memcpy(s->shard_n, shard_n, sizeof(int64_t) * (size_t)shards);
  }
  *first_expert = 0;
  int rc = 0;
  switch (plan->cut) {
  case CUT_NONE: return 0;
  case CUT_EXPERTS:
    if (*experts % plan->ranks)
      return set_error(QKEEP_E_UNSUPPORTED, "expert-parallel over %d ranks: %d experts do not divide",
                       plan->ranks, *experts);
    *experts /= plan->ranks;
    *first_expert = plan->rank * *experts;
    if (!w2)
      layer->shard.first_expert = *first_expert;
    return 0;
  case CUT_N:
    for (int s = 0; s < shards && !rc; s++) {
      char what[64];
      snprintf(what, sizeof what, shards > 1 ? "N of fused shard %d" : "N", s);
      rc = check_divides(prefix, plan, params, n_params, present, *g, what, shard_n[s]);
    }
    if (rc)
      return rc;
    *n = 0;
    for (int s = 0; s < shards; s++)
      *n += shard_n[s] /= plan->ranks;
    return 0;
  case CUT_K:
    for (size_t i = 0; i < n_params; i++)
      if (((present >> i) & 1u) && params[i].fuse == F_SHARED && params[i].dims[0] == D_K &&
          ((flags & QKEEP_LAYER_F_ACT_ORDER) || strcmp(params[i].name, "g_idx") != 0))
        return set_error(QKEEP_E_UNSUPPORTED,
                         "row-parallel over %d ranks with act order (%s%s): each rank would need "
                         "the whole scales, which no backend reads beyond its own K yet",
                         plan->ranks, prefix, params[i].name);
    plan->repeat_groups = *g > 0 && *g == *k; /* channelwise: one group of the whole row */
    if ((rc = check_divides(prefix, plan, params, n_params, present, *g, "K", *k)))
      return rc;
    *k /= plan->ranks;
    if (plan->repeat_groups)
      *g = *k;
    return 0;
  }
  return 0;
}

bool shard_slice_dim(const struct qkeep_spec *cs, int dim, int ranks, int rank, struct slice *out) {
  if (dim < 0 || dim >= cs->ndim || ranks < 2)
    return false;
  struct qkeep_spec tail = {.dtype = cs->dtype, .ndim = cs->ndim - dim - 1};
  memcpy(tail.shape, cs->shape + dim + 1, sizeof(int64_t) * (size_t)tail.ndim);
  size_t inner = qkeep_spec_bytes(&tail), outer = 1;
  for (int i = 0; i < dim; i++)
    outer *= (size_t)cs->shape[i];
  size_t len = (size_t)(cs->shape[dim] / ranks);
  *out = (struct slice){.offset = (size_t)rank * len * inner,
                        .rows = outer,
                        .row_bytes = len * inner,
                        .stride = (size_t)cs->shape[dim] * inner};
  return true;
}

bool shard_slice(const struct shard_plan *plan, const struct param_template *t, const struct qkeep_spec *cs,
                 struct slice *out) {
  /* The template's dims here are evaluated on the checkpoint tensor itself (its G is irrelevant:
   * cut_dim only asks which dimension carries N or K). */
  return shard_slice_dim(cs, cut_dim(plan, t, 0), plan->ranks, plan->rank, out);
}

/* ---- gpt-oss pre-stacked MXFP4 MoE ------------------------------------------------------- */

int shard_gptoss_tensor(qkeep_layer *layer, const char *local, const struct qkeep_spec *full,
                        struct qkeep_spec *spec, struct slice *slice, bool *sliced) {
  const struct qkeep_parallel *p = &layer->model->parallel;
  int tp = size_of(p->tp_size), ep = size_of(p->ep_size), ranks = 1, rank = 0, dim = -1;
  int64_t unit = 1;
  *spec = *full;
  *sliced = false;
  if (ep > 1) {
    ranks = ep, rank = p->ep_rank, dim = 0;
  } else if (tp > 1) {
    ranks = tp, rank = p->tp_rank;
    bool gate_up = strncmp(local, "gate_up_proj", 12) == 0, blocks = strstr(local, "_bias") == NULL;
    if (gate_up) /* rows alternate gate, up: a rank's intermediate slice is a run of 2 I / T rows */
      dim = 1, unit = 2;
    else if (blocks) /* down_proj blocks [E, H, I/32, 16] and scales [E, H, I/32]: cut by blocks of 32 */
      dim = 2, unit = 1;
  }
  if (dim < 0)
    return 0;
  if (full->shape[dim] % ((int64_t)ranks * unit))
    return set_error(QKEEP_E_UNSUPPORTED,
                     "%s over %d ranks: %s dimension %d is %lld, not a multiple of %d x %lld",
                     ep > 1 ? "expert-parallel" : "tensor-parallel", ranks, local, dim,
                     (long long)full->shape[dim], ranks, (long long)unit);
  spec->shape[dim] /= ranks;
  *sliced = shard_slice_dim(full, dim, ranks, rank, slice);
  return 0;
}

void shard_gptoss_dims(qkeep_layer *layer, int64_t experts, int64_t n, int64_t k, int64_t inter) {
  const struct qkeep_parallel *p = &layer->model->parallel;
  int tp = size_of(p->tp_size), ep = size_of(p->ep_size);
  struct qkeep_layer_shard *s = &layer->shard;
  *s = (struct qkeep_layer_shard){.size = sizeof *s,
                                  .role = QKEEP_SHARD_REPLICATED,
                                  .ranks = 1,
                                  .n = n,
                                  .k = k,
                                  .experts = experts,
                                  .shard_n = {inter, inter}};
  if (ep > 1) {
    s->role = QKEEP_SHARD_EXPERT, s->ranks = ep, s->rank = p->ep_rank;
    s->first_expert = experts / ep * p->ep_rank;
    layer->dims.experts = experts / ep;
  } else if (tp > 1) {
    s->role = QKEEP_SHARD_MOE_TP, s->ranks = tp, s->rank = p->tp_rank;
    layer->dims.n = n / tp;
    layer->dims.shard_n[0] = layer->dims.shard_n[1] = inter / tp;
  }
}

/* ---- full dims ------------------------------------------------------------------------------ */

int64_t shard_full_k(const qkeep_layer *layer) { return layer->shard.ranks ? layer->shard.k : layer->dims.k; }
int64_t shard_full_n(const qkeep_layer *layer) { return layer->shard.ranks ? layer->shard.n : layer->dims.n; }
int64_t shard_full_shard_n(const qkeep_layer *layer, int shard) {
  return layer->shard.ranks ? layer->shard.shard_n[shard] : layer->dims.shard_n[shard];
}

/* ---- loading a slice ------------------------------------------------------------------------- */

/* Byte runs: rows of row_bytes, the first at offset, stride apart. */
struct runs {
  size_t offset, rows, row_bytes, stride;
};

/* One piece of a walk over two layouts of the same bytes: n bytes at offset `to` of one, `from` of the
 * other. */
typedef int (*piece_fn)(void *ctx, size_t to, size_t from, size_t n);

/* Calls fn on the pieces of the `from` runs and the `to` runs, in order, stopping at its first error; both
 * cover the same number of bytes. Pieces: at most from.rows + to.rows calls. */
static int walk_runs(const struct runs *to, const struct runs *from, piece_fn fn, void *ctx) {
  size_t fi = 0, fo = 0, ti = 0, to_at = 0;
  int rc = 0;
  assert(from->rows * from->row_bytes == to->rows * to->row_bytes);
  while (!rc && fi < from->rows && ti < to->rows) {
    size_t n = from->row_bytes - fo < to->row_bytes - to_at ? from->row_bytes - fo : to->row_bytes - to_at;
    rc = fn(ctx, to->offset + ti * to->stride + to_at, from->offset + fi * from->stride + fo, n);
    fo += n, to_at += n;
    if (fo == from->row_bytes)
      fi++, fo = 0;
    if (to_at == to->row_bytes)
      ti++, to_at = 0;
  }
  return rc;
}

enum copy_kind { COPY_H2D, COPY_D2D, COPY_D2H, COPY_HOST };
struct runs_copy {
  const struct device *dev;
  enum copy_kind kind;
  char *tb;
  const char *fb;
};

static int copy_piece(void *ctx, size_t to, size_t from, size_t n) {
  const struct runs_copy *c = ctx;
  char *d = c->tb + to;
  const char *s = c->fb + from;
  switch (c->kind) {
  case COPY_H2D: return dev_h2d(c->dev, d, s, n);
  case COPY_D2D: return dev_d2d(c->dev, d, s, n);
  case COPY_D2H: return dev_d2h(c->dev, d, s, n);
  case COPY_HOST: memcpy(d, s, n); return 0;
  }
  return 0;
}

/* Copies the bytes of `from` runs (base fb) to `to` runs (base tb) in order; both cover the same
 * number of bytes. */
static int copy_runs(const struct device *dev, enum copy_kind kind, char *tb, const struct runs *to,
                     const char *fb, const struct runs *from) {
  return walk_runs(to, from, copy_piece, &(struct runs_copy){dev, kind, tb, fb});
}

/* A scale slice in host memory, to check: its bytes lie as `in` runs from base, and are the tensor's `from`
 * runs (element numbers in messages count from the tensor's start). */
struct runs_check {
  const qkeep_param *param;
  const struct provided *t;
  const char *base;
};

static int check_piece(void *ctx, size_t in, size_t from, size_t n) {
  const struct runs_check *c = ctx;
  return check_scales(c->param, c->t, from, c->base + in, n);
}

/* Checks the slice's bytes in host memory (laid out as `in` runs from base) when the load checks the
 * source's values (scale_to_check). */
static int check_runs(const struct staging *st, const struct source *src, const struct provided *t,
                      const char *base, const struct runs *in, const struct runs *from) {
  if (!scale_to_check(st, src))
    return 0;
  return walk_runs(in, from, check_piece, &(struct runs_check){src->param, t, base});
}

/* The slice's bytes from a provider without them in memory: each run read from the file, into
 * `to` runs of host memory at base. */
static int read_runs(const struct provider *pv, const struct provided *t, const struct runs *from, char *base,
                     const struct runs *to) {
  if (!pv->read_range)
    return set_error(QKEEP_E_UNSUPPORTED, "%s: tensor '%s': the source cannot read part of a tensor",
                     pv->what, t->name);
  /* Adjacent runs (a cut of the leading dimension) are one read. */
  if (from->rows == 1 || from->stride == from->row_bytes) {
    if (to->rows == 1 || to->stride == to->row_bytes)
      return pv->read_range(pv, t, from->offset, from->rows * from->row_bytes, base + to->offset);
  }
  assert(to->row_bytes == from->row_bytes || to->rows == 1);
  int rc = 0;
  for (size_t r = 0; r < from->rows && !rc; r++) {
    size_t at = to->rows == 1 ? to->offset + r * from->row_bytes : to->offset + r * to->stride;
    rc = pv->read_range(pv, t, from->offset + r * from->stride, from->row_bytes, base + at);
  }
  return rc;
}

int shard_load_slice(qkeep_layer *layer, const struct provider *pv, const struct source *src,
                     const struct provided *t, const void *on_device, const void *on_host,
                     struct staging *st) {
  const struct device *dev = layer_device(layer);
  const struct slice *sl = &src->slice;
  const struct runs from = {sl->offset, sl->rows, sl->row_bytes, sl->stride};
  const struct runs dst = {src->dst_offset, src->rows, src->row_bytes, src->dst_stride};
  size_t bytes = sl->rows * sl->row_bytes;
  const struct runs packed = {0, 1, bytes, bytes};
  char *param = (char *)src->param->view.storage->data;
  int rc;
  if (src->compare_only) { /* the slice must equal what an earlier shard loaded there */
    if ((rc = staging_reserve(st, bytes)))
      return rc;
    if (on_device || on_host)
      rc = copy_runs(dev, on_device ? COPY_D2H : COPY_HOST, (char *)st->data, &packed,
                     on_device ? on_device : on_host, &from);
    else
      rc = read_runs(pv, t, &from, (char *)st->data, &packed);
    if (!rc)
      rc = copy_runs(dev, COPY_D2H, (char *)st->compare, &packed, param, &dst);
    if (!rc && memcmp(st->data, st->compare, bytes) != 0)
      rc = set_error(QKEEP_E_FORMAT, "%s: tensor '%s' differs from the fused shard loaded before it",
                     t->where, t->name);
    return rc;
  }
  /* A scale's host bytes are checked before they go to the device (device bytes: see load_source). */
  assert(!on_device || !scale_to_check(st, src));
  if (on_device)
    return copy_runs(dev, COPY_D2D, param, &dst, on_device, &from);
  if (on_host) {
    rc = check_runs(st, src, t, on_host, &from, &from);
    return rc ? rc : copy_runs(dev, COPY_H2D, param, &dst, on_host, &from);
  }
  /* From a file: straight into a host param when its rows are those of the slice (or one run),
   * else through staging of the slice's bytes (never the whole tensor). */
  bool host = dev->ops == host_device()->ops;
  if (host && (dst.rows == 1 || dst.stride == dst.row_bytes || dst.row_bytes == from.row_bytes)) {
    const struct runs *in =
        dst.rows == 1 || dst.stride == dst.row_bytes ? &(struct runs){dst.offset, 1, bytes, bytes} : &dst;
    rc = read_runs(pv, t, &from, param, in);
    return rc ? rc : check_runs(st, src, t, param, in, &from);
  }
  if ((rc = staging_reserve(st, bytes)) || (rc = read_runs(pv, t, &from, (char *)st->data, &packed)) ||
      (rc = check_runs(st, src, t, (const char *)st->data, &packed, &from)))
    return rc;
  return copy_runs(dev, COPY_H2D, param, &dst, (const char *)st->data, &packed);
}
