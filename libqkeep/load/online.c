/*
 * online.c: online quantization. A model with quantize options (qkeep_model_set_quantize) loads an
 * unquantized checkpoint as the checkpoint `qkeep quantize` would write from it with those options,
 * byte for byte, without that checkpoint ever existing:
 *
 *   plan     the offline quantizer plans the output from the input's header (quantize/plan.h):
 *            every output tensor, the units of work, the config files. A checkpoint that no file
 *            holds is described from them (ckpt_describe) and assembled as any checkpoint is, so
 *            layers, schemes, owners (the chain's first fit) and tensor-parallel cuts are those of
 *            the quantized checkpoint.
 *   sources  each layer's sources of quantized tensors become derived sources (where a made tensor
 *            lands), and the unquantized tensors they are made from become the layer's sources, each
 *            with a param of state QKEEP_PARAM_QUANTIZED (registered through the model's index,
 *            no storage). Tensors copied unchanged stay sources as they were.
 *   load     per layer, unit by unit (a weight, or an NVFP4 fusion group sharing a global scale):
 *            the members' unquantized bytes are read from the provider (a checkpoint, buffers or a
 *            sync's bucket), quantized on the host (quant_pool_start), and each made tensor lands
 *            through the ordinary load_source, as the tensor of a checkpoint would. The pipe keeps
 *            the next unit in the load's order (into the next layer too) read and quantizing on the
 *            load's pool of threads while the load lands this one and runs the layer's PWAL.
 *            Memory: two units' input and output bytes. Where the layer's owner quantizes on its
 *            device (the backend's quantize slot, ABI 1.5, asked as the unit enters the pipe;
 *            load/online_device.c), the unit is not read here: its bytes go to the device instead
 *            and only what follows from the amax (online_unit_finish) is made on the host.
 *
 * Cold start, reload, rollback and sync all load layers through load_layer_sources, so each of them
 * quantizes the same way.
 */
#include <assert.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/formats.h"
#include "load/online.h"
#include "quantize/plan.h"

/* ---- planning ------------------------------------------------------------------------------ */

static int by_unit(const void *a, const void *b) {
  const struct derived *x = a, *y = b;
  if (x->unit != y->unit)
    return x->unit < y->unit ? -1 : 1;
  return x->order < y->order ? -1 : x->order > y->order;
}

static int by_order(const void *a, const void *b) {
  const struct derived *x = a, *y = b;
  return x->order < y->order ? -1 : x->order > y->order;
}

/* A quantized-on-load param for member m of unit u, and its source in the layer. */
static int add_member_source(qkeep_layer *layer, const struct quant_plan *plan, size_t u, int m,
                             struct source *sources, size_t *n_sources, size_t *at) {
  struct quant_member qm;
  quant_plan_member(plan, u, m, &qm);
  struct qkeep_spec spec = {.dtype = qm.dtype, .ndim = 2, .shape = {qm.n, qm.k}};
  int rc = grow_array((void **)&layer->online_params, &layer->cap_online_params, layer->n_online_params + 1,
                      sizeof *layer->online_params);
  qkeep_param *p = rc ? NULL : calloc(1, sizeof *p);
  char *name = p ? xstrdup(qm.input) : NULL;
  if (p) {
    p->checkpoint_name = xstrdup(qm.input);
    p->runtime_name = xstrdup(qm.input);
  }
  if (!p || !name || !p->checkpoint_name || !p->runtime_name) {
    if (p)
      free(p->checkpoint_name), free(p->runtime_name);
    free(p), free(name);
    return rc ? rc : set_error(QKEEP_E_NOMEM, "out of memory");
  }
  p->layer = layer;
  p->state = QKEEP_PARAM_QUANTIZED;
  p->create_spec = spec;
  p->create_bytes = qm.nbytes;
  p->view.spec = spec; /* no storage: a view of nothing */
  layer->online_params[layer->n_online_params++] = p;
  struct source s = {.checkpoint_name = name,
                     .param = p,
                     .rows = 1,
                     .row_bytes = qm.nbytes,
                     .dst_stride = qm.nbytes,
                     .spec = spec,
                     .online = true,
                     .unit = u,
                     .member = m};
  *at = (*n_sources)++;
  sources[*at] = s;
  return 0;
}

/*
 * One layer: sources of made tensors become derived sources, ordered by unit (units in the order
 * their first source had, so that a fused param's first shard, which a compare-only source of
 * another shard checks against, lands first), and each unit's members become sources.
 */
static int convert_layer(qkeep_layer *layer, const struct online_quantize *on) {
  size_t n_old = layer->n_sources, units = 0, n_sources = 0;
  assert(layer->n_derived == 0);
  /* Until the sources are rebuilt below, layer->sources owns every name and derived[] borrows them: a
   * failure before then forgets derived[] (n_derived 0), so that each name is freed once. */
  for (size_t i = 0; i < n_old; i++) {
    size_t out;
    struct quant_output o;
    int rc = 0;
    if (!name_index_get(&on->outputs, layer->sources[i].checkpoint_name, &out))
      rc = set_error(QKEEP_E_FORMAT, "layer %s: source '%s' is no tensor of the quantize plan", layer->name,
                     layer->sources[i].checkpoint_name);
    if (!rc)
      quant_plan_output(on->plan, out, &o);
    if (!rc && o.copied)
      continue;
    if (!rc)
      rc = grow_array((void **)&layer->derived, &layer->cap_derived, layer->n_derived + 1,
                      sizeof *layer->derived);
    if (rc) {
      layer->n_derived = 0;
      return rc;
    }
    layer->derived[layer->n_derived++] =
        (struct derived){.src = layer->sources[i], .output = out, .unit = o.unit};
    units += o.unit != SIZE_MAX ? (size_t)quant_plan_members(on->plan, o.unit) : 0;
  }
  if (!layer->n_derived)
    return 0;
  /* The sort key: the first position of the unit's sources, then the source's own (constants without a
   * unit: their own position alone). Found by sorting by unit first, so the planning stays n log n. */
  size_t nd = layer->n_derived;
  for (size_t d = 0; d < nd; d++)
    layer->derived[d].order = d;
  qsort(layer->derived, nd, sizeof *layer->derived, by_unit);
  for (size_t d = 0, first = 0; d < nd; d++) {
    if (d == 0 || layer->derived[d].unit != layer->derived[d - 1].unit || layer->derived[d].unit == SIZE_MAX)
      first = layer->derived[d].order; /* the smallest position: positions ascend within a unit */
    layer->derived[d].order = first * nd + layer->derived[d].order;
  }
  qsort(layer->derived, layer->n_derived, sizeof *layer->derived, by_order);
  struct source *sources = calloc(n_old + units + 1, sizeof *sources);
  if (!sources) {
    layer->n_derived = 0;
    return set_error(QKEEP_E_NOMEM, "out of memory");
  }
  for (size_t i = 0; i < n_old; i++) {
    size_t out;
    struct quant_output o;
    name_index_get(&on->outputs, layer->sources[i].checkpoint_name, &out);
    quant_plan_output(on->plan, out, &o);
    if (o.copied)
      sources[n_sources++] = layer->sources[i];
  }
  int rc = 0;
  for (size_t d = 0; d < layer->n_derived && !rc; d++) {
    struct derived *x = &layer->derived[d];
    if (x->unit == SIZE_MAX)
      continue;
    if (d > 0 && layer->derived[d - 1].unit == x->unit) { /* the unit's members are sources already */
      memcpy(x->members, layer->derived[d - 1].members, sizeof x->members);
      continue;
    }
    for (int m = 0; m < quant_plan_members(on->plan, x->unit) && !rc; m++)
      rc = add_member_source(layer, on->plan, x->unit, m, sources, &n_sources, &x->members[m]);
  }
  free(layer->sources); /* the names moved: to sources kept, or to derived */
  layer->sources = sources;
  layer->n_sources = n_sources;
  layer->cap_sources = n_old + units + 1;
  return rc;
}

/* Another expert-parallel rank's made tensors: their unquantized inputs are that rank's too. */
static int note_foreign_inputs(qkeep_model *model) {
  const struct online_quantize *on = &model->online;
  size_t n = model->rank.n_foreign;
  int rc = 0;
  for (size_t i = 0; i < n && !rc; i++) {
    size_t out;
    struct quant_output o;
    if (!name_index_get(&on->outputs, model->rank.foreign[i], &out))
      continue;
    quant_plan_output(on->plan, out, &o);
    if (o.unit != SIZE_MAX && o.slot == 0) {
      struct quant_member qm;
      quant_plan_member(on->plan, o.unit, o.member, &qm);
      rc = shard_note_foreign(model, qm.input);
    }
  }
  return rc;
}

int online_assemble(qkeep_model *model, const struct ckpt *ck) {
  struct online_quantize *on = &model->online;
  assert(on->set && !on->plan);
  int rc = quant_plan_new(ck, &on->opts, &on->plan);
  if (rc)
    return add_error_context(rc, "quantizing on load to %s", on->opts.scheme);
  size_t n = quant_plan_outputs(on->plan);
  const char **names = malloc((n ? n : 1) * sizeof *names);
  struct qkeep_spec *specs = malloc((n ? n : 1) * sizeof *specs);
  char *config = NULL, *hf = NULL;
  struct ckpt *quantized = NULL;
  rc = names && specs ? name_index_reserve(&on->outputs, n) : set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < n && !rc; i++) {
    struct quant_output o;
    quant_plan_output(on->plan, i, &o);
    names[i] = o.name, specs[i] = o.spec;
    rc = name_index_put(&on->outputs, o.name, i, NULL);
  }
  if (!rc)
    rc = quant_plan_configs(on->plan, &config, &hf);
  if (!rc)
    rc = ckpt_describe(ck->path, ck->dir, names, specs, n, config, hf, &quantized);
  if (!rc)
    rc = assemble_model(model, quantized);
  for (size_t l = 0; l < model->n_layers && !rc; l++)
    rc = convert_layer(model->layers[l], on);
  if (!rc)
    rc = model_reindex_sources(model);
  if (!rc)
    rc = note_foreign_inputs(model);
  ckpt_close(quantized);
  free(config), free(hf), free(names), free(specs);
  return rc;
}

/* ---- the bytes of one unit ------------------------------------------------------------------- */

/* A unit's outputs as a provider (struct online_unit, load.h): host bytes, by name. */
static const void *output_bytes(const struct online_unit *u, const struct quant_output *o) {
  return o->constant ? (const void *)o->value : u->dst[o->member][o->slot];
}

static void uo_describe(const struct provider *p, const void *handle, struct provided *out) {
  const struct online_unit *uo = p->ctx;
  const struct quant_output *o = handle;
  *out = (struct provided){o->name,
                           (int)o->spec.dtype,
                           qkeep_dtype_name(o->spec.dtype),
                           o->spec.ndim,
                           o->spec.shape,
                           o->nbytes,
                           uo->where,
                           o,
                           NULL,
                           0,
                           false};
}

static bool uo_find(const struct provider *p, const char *name, struct provided *out) {
  const struct online_unit *uo = p->ctx;
  for (size_t i = 0; i < uo->n; i++)
    if (strcmp(uo->outs[i].name, name) == 0) {
      uo_describe(p, &uo->outs[i], out);
      return true;
    }
  return false;
}

static const void *uo_host(const struct provider *p, const struct provided *t) {
  return output_bytes(p->ctx, t->handle);
}

static int uo_read(const struct provider *p, const struct provided *t, void *dst) {
  memcpy(dst, uo_host(p, t), t->nbytes);
  return 0;
}

static int uo_read_range(const struct provider *p, const struct provided *t, size_t offset, size_t n,
                         void *dst) {
  memcpy(dst, (const char *)uo_host(p, t) + offset, n);
  return 0;
}

static size_t uo_count(const struct provider *p) { return ((const struct online_unit *)p->ctx)->n; }
static const char *uo_name_at(const struct provider *p, size_t i) {
  return ((const struct online_unit *)p->ctx)->outs[i].name;
}

/* A source's bytes in host memory: the provider's own, else a copy in *held (the caller frees it). The
 * tensor must be there as the source expects (the caller's validation, or this check). */
int online_member_tensor(const qkeep_layer *layer, const struct provider *pv, const struct source *src,
                         struct provided *t) {
  if (!pv->find(pv, src->checkpoint_name, t))
    return set_error(QKEEP_E_NOTFOUND, "%s: tensor '%s' is missing (layer %s)", pv->what,
                     src->checkpoint_name, layer->name);
  if (t->dtype != (int)src->spec.dtype || t->nbytes != qkeep_spec_bytes(&src->spec) || t->ndim != 2 ||
      t->shape[0] != src->spec.shape[0] || t->shape[1] != src->spec.shape[1])
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': %s, the model expects %s [%lld, %lld] (layer %s)",
                     t->where, t->name, t->dtype_name, qkeep_dtype_name(src->spec.dtype),
                     (long long)src->spec.shape[0], (long long)src->spec.shape[1], layer->name);
  return 0;
}

static int host_bytes_of(const qkeep_layer *layer, const struct provider *pv, const struct source *src,
                         struct provided *t, const void **bytes, void **held) {
  *bytes = NULL, *held = NULL;
  int rc = online_member_tensor(layer, pv, src, t);
  if (rc)
    return rc;
  const void *on_device = pv->device_bytes ? pv->device_bytes(pv, t) : NULL;
  if (!on_device && pv->host_bytes && (*bytes = pv->host_bytes(pv, t)) != NULL)
    return 0;
  if (!(*held = malloc(t->nbytes ? t->nbytes : 1)))
    return set_error(QKEEP_E_NOMEM, "out of memory reading '%s' (%zu bytes)", t->name, t->nbytes);
  rc = on_device ? dev_d2h(layer_device(layer), *held, on_device, t->nbytes) : pv->read(pv, t, *held);
  *bytes = *held;
  return rc;
}

size_t online_unit_end(const qkeep_layer *layer, size_t first) {
  size_t end = first + 1;
  while (end < layer->n_derived && layer->derived[end].unit == layer->derived[first].unit)
    end++;
  return end;
}

/* The unit's outputs as its provider (u->made), once its bytes are made (rc 0); else u is freed and rc
 * returned. */
static int unit_outputs(const qkeep_layer *layer, const struct provider *pv, size_t first, size_t end,
                        struct online_unit *u, int rc) {
  const struct quant_plan *plan = layer->model->online.plan;
  if (!rc && !(u->outs = malloc((end - first) * sizeof *u->outs)))
    rc = set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t d = first; d < end && !rc; d++)
    quant_plan_output(plan, layer->derived[d].output, &u->outs[d - first]);
  u->n = rc ? 0 : end - first;
  u->where = pv->what;
  u->made = (struct provider){pv->what,   u,    uo_find,       uo_read,     uo_host, NULL, uo_count,
                              uo_name_at, NULL, uo_read_range, uo_describe, 0,       NULL, 0};
  if (rc) {
    online_unit_free(u);
    return rc;
  }
  return 0;
}

int online_unit_finish(qkeep_layer *layer, const struct provider *pv, size_t first, size_t end, float amax,
                       struct online_unit *u) {
  const struct quant_plan *plan = layer->model->online.plan;
  size_t unit = layer->derived[first].unit;
  assert(unit != SIZE_MAX && quant_plan_device_scheme(plan));
  int rc = 0;
  *u = (struct online_unit){0};
  for (int m = 0; m < quant_plan_members(plan, unit) && !rc; m++) {
    struct quant_member qm;
    quant_plan_member(plan, unit, m, &qm);
    for (int s = 2; s < qm.n_out && !rc; s++) { /* past the codes and block scales the device wrote */
      struct quant_output o;
      quant_plan_output(plan, qm.out[s], &o);
      if (!o.constant && !(u->dst[m][s] = malloc(o.nbytes ? o.nbytes : 1)))
        rc = set_error(QKEEP_E_NOMEM, "out of memory quantizing '%s'", qm.input);
      u->bytes += o.constant ? 0 : (int64_t)o.nbytes;
    }
  }
  if (!rc)
    rc = quant_plan_finish(plan, unit, amax, (void *const(*)[4])u->dst);
  return unit_outputs(layer, pv, first, end, u, rc);
}

void online_unit_free(struct online_unit *u) {
  free(u->outs);
  u->outs = NULL;
  for (int m = 0; m < 3; m++) {
    free(u->held[m]);
    u->held[m] = NULL;
    for (int s = 0; s < 4; s++) {
      free(u->dst[m][s]);
      u->dst[m][s] = NULL;
    }
  }
}

/* Reads the unit's unquantized members from pv (dtype and shape checked) and makes room for its outputs;
 * u->made serves them once the unit is quantized. */
static int unit_read(qkeep_layer *layer, const struct provider *pv, size_t first, size_t end,
                     struct online_unit *u) {
  const struct quant_plan *plan = layer->model->online.plan;
  const struct derived *d0 = &layer->derived[first];
  size_t unit = d0->unit;
  int members = unit == SIZE_MAX ? 0 : quant_plan_members(plan, unit), rc = 0;
  *u = (struct online_unit){0};
  for (int m = 0; m < members && !rc; m++) {
    struct provided t;
    rc = host_bytes_of(layer, pv, &layer->sources[d0->members[m]], &t, &u->src[m], &u->held[m]);
    struct quant_member qm;
    quant_plan_member(plan, unit, m, &qm);
    for (int s = 0; s < qm.n_out && !rc; s++) {
      struct quant_output o;
      quant_plan_output(plan, qm.out[s], &o);
      if (!o.constant && !(u->dst[m][s] = malloc(o.nbytes ? o.nbytes : 1)))
        rc = set_error(QKEEP_E_NOMEM, "out of memory quantizing '%s'", qm.input);
      u->bytes += o.constant ? 0 : (int64_t)o.nbytes;
    }
    u->bytes += u->held[m] ? (int64_t)t.nbytes : 0;
  }
  return unit_outputs(layer, pv, first, end, u, rc);
}

/* ---- the pipe: units in flight --------------------------------------------------------------- */

/* A unit read and quantizing (or failed: rc, its detail in msg, reported at its turn). */
struct flight {
  qkeep_layer *layer;
  size_t first, end;
  const struct provider *pv;
  struct online_unit u;
  struct quant_job *job; /* NULL: nothing to quantize (constants only), on the device, or failed */
  bool device;           /* the layer's owner quantizes it on its device: not read here */
  int rc;
  char *msg;
};

struct online_pipe {
  struct quant_pool *pool;
  const struct quant_plan *plan;
  struct flight f[2]; /* a ring, in load order from f[head]: the unit taken next (each unit's provider
                       * `made` points into its flight, so flights never move) */
  int head, n;
  size_t at;             /* where in the load's order the last layer taken was found */
  online_query_fn query; /* the take's: whether the layer's owner quantizes a unit itself (NULL: never) */
};

static void flight_drop(struct online_pipe *pipe, struct flight *f) {
  quant_pool_discard(pipe->pool, f->job); /* the workers are done with its bytes before they go */
  online_unit_free(&f->u);
  free(f->msg);
  *f = (struct flight){0};
}

/* Reads the unit [first, ...) of layer and starts quantizing it, into f, unless the layer's owner takes it
 * (its device quantizes it: nothing read). A failure is kept in f. */
static void flight_launch(struct online_pipe *pipe, struct flight *f, qkeep_layer *layer, size_t first,
                          const struct provider *pv) {
  *f = (struct flight){.layer = layer, .first = first, .end = online_unit_end(layer, first), .pv = pv};
  size_t unit = layer->derived[first].unit;
  int taken = pipe->query ? pipe->query(layer, f->first, f->end) : 0;
  f->device = taken == 1;
  f->rc = taken < 0 ? taken : f->device ? 0 : unit_read(layer, pv, f->first, f->end, &f->u);
  if (!f->rc && !f->device && unit != SIZE_MAX)
    f->rc = quant_pool_start(pipe->pool, unit, f->u.src, (void *const(*)[4])f->u.dst, &f->job);
  if (f->rc)
    f->msg = xstrdup(qkeep_errmsg());
}

bool online_pipe_next(struct online_pipe *pipe, qkeep_layer *layer, size_t end, qkeep_layer *const *order,
                      size_t n_order, qkeep_layer **next, size_t *first, size_t *between) {
  *between = 0;
  if (end < layer->n_derived) {
    *next = layer, *first = end;
    return true;
  }
  size_t at = pipe->at < n_order && order[pipe->at] == layer ? pipe->at : n_order;
  for (size_t i = 0; i < n_order && at == n_order; i++)
    if (order[i] == layer)
      at = i;
  pipe->at = at;
  for (size_t i = at + 1; i < n_order; i++)
    if (order[i]->n_derived) {
      *next = order[i], *first = 0, *between = i - at - 1;
      return true;
    }
  return false;
}

int online_pipe_take(struct online_pipe **pipep, qkeep_layer *layer, size_t first, const struct provider *pv,
                     qkeep_layer *const *order, size_t n_order, online_query_fn query,
                     struct online_unit **out) {
  struct online_pipe *pipe = *pipep;
  *out = NULL;
  if (!pipe) {
    if (!(pipe = calloc(1, sizeof *pipe)))
      return set_error(QKEEP_E_NOMEM, "out of memory");
    pipe->plan = layer->model->online.plan;
    int rc = quant_pool_new(pipe->plan, &pipe->pool);
    if (rc) {
      free(pipe);
      return rc;
    }
    *pipep = pipe;
  }
  assert(pipe->plan == layer->model->online.plan);
  pipe->query = query;
  /* A unit read ahead for another turn than this one (the load went another way): given up on. */
  const struct flight *head = &pipe->f[pipe->head];
  if (pipe->n && (head->layer != layer || head->first != first || head->pv != pv))
    while (pipe->n)
      online_pipe_done(pipe);
  if (!pipe->n)
    flight_launch(pipe, &pipe->f[(pipe->head + pipe->n++) % 2], layer, first, pv);
  struct flight *f = &pipe->f[pipe->head];
  /* The next unit is read now, while f quantizes on the pool. */
  qkeep_layer *next;
  size_t next_first, between;
  if (pipe->n == 1 && online_pipe_next(pipe, layer, f->end, order, n_order, &next, &next_first, &between))
    flight_launch(pipe, &pipe->f[(pipe->head + pipe->n++) % 2], next, next_first, pv);
  int rc = f->rc ? set_error(f->rc, "%s", f->msg ? f->msg : qkeep_strerror(f->rc))
                 : quant_pool_wait(pipe->pool, f->job);
  f->job = NULL; /* waited for */
  if (rc) {
    online_pipe_done(pipe);
    return rc;
  }
  *out = f->device ? NULL : &f->u;
  return 0;
}

void online_pipe_done(struct online_pipe *pipe) {
  assert(pipe && pipe->n > 0);
  flight_drop(pipe, &pipe->f[pipe->head]);
  pipe->head = (pipe->head + 1) % 2;
  pipe->n--;
}

int64_t online_pipe_bytes(const struct online_pipe *pipe) {
  int64_t bytes = 0;
  for (int i = 0; pipe && i < pipe->n; i++)
    bytes += pipe->f[(pipe->head + i) % 2].u.bytes;
  return bytes;
}

int online_unit_make(struct online_pipe *pipe, qkeep_layer *layer, const struct provider *pv, size_t first,
                     size_t end, struct online_unit *u) {
  size_t unit = layer->derived[first].unit;
  struct quant_job *job = NULL;
  int rc = unit_read(layer, pv, first, end, u);
  if (!rc && unit != SIZE_MAX &&
      !(rc = quant_pool_start(pipe->pool, unit, u->src, (void *const(*)[4])u->dst, &job)))
    rc = quant_pool_wait(pipe->pool, job);
  if (rc)
    online_unit_free(u);
  return rc;
}

void online_pipe_free(struct online_pipe *pipe) {
  if (!pipe)
    return;
  while (pipe->n)
    online_pipe_done(pipe);
  quant_pool_free(pipe->pool);
  free(pipe);
}

/* ---- validation ---------------------------------------------------------------------------- */

/* Elements tested together before the one at fault is looked for: a loop of a constant count, which
 * compilers vectorize. */
#define CHECK_RUN 64

/* The first of n elements (bf16, f16 or f32) that is a NaN or an Inf, or n. Their exponent bits are all
 * set, so the magnitude's bits are at least those of infinity: an integer compare, no conversion. */
static size_t first_not_finite(const void *bytes, enum qkeep_dtype dtype, size_t n) {
  size_t i = 0;
  if (dtype == QKEEP_DTYPE_F32) {
    const uint32_t *v = bytes;
    for (; i + CHECK_RUN <= n; i += CHECK_RUN) {
      unsigned any = 0;
      for (int j = 0; j < CHECK_RUN; j++)
        any |= (v[i + j] & 0x7fffffffu) >= 0x7f800000u;
      if (any)
        break;
    }
    for (; i < n; i++)
      if ((v[i] & 0x7fffffffu) >= 0x7f800000u)
        return i;
    return n;
  }
  if (dtype == QKEEP_DTYPE_BF16 || dtype == QKEEP_DTYPE_F16) {
    const uint16_t *v = bytes;
    uint16_t inf = dtype == QKEEP_DTYPE_BF16 ? 0x7f80 : 0x7c00;
    for (; i + CHECK_RUN <= n; i += CHECK_RUN) {
      unsigned any = 0;
      for (int j = 0; j < CHECK_RUN; j++)
        any |= (uint16_t)(v[i + j] & 0x7fffu) >= inf;
      if (any)
        break;
    }
    for (; i < n; i++)
      if ((uint16_t)(v[i] & 0x7fffu) >= inf)
        return i;
    return n;
  }
  for (; i < n; i++) /* no other dtype is quantized on load; kept general */
    if (!isfinite(qk_load_float(bytes, dtype, i)))
      return i;
  return n;
}

/* The ABI 1.6 rule that refuses a non-finite value of dtype, or 0. */
static int finite_rule(int dtype) {
  switch (dtype) {
  case QKEEP_DTYPE_BF16: return QKEEP_RULE_BF16_FINITE;
  case QKEEP_DTYPE_F16: return QKEEP_RULE_F16_FINITE;
  case QKEEP_DTYPE_F32: return QKEEP_RULE_F32_FINITE;
  default: return 0;
  }
}

/*
 * The host check of unquantized sources in files (a model's, listed): pieces of CHECK_PIECE bytes read and
 * scanned by up to CHECK_READERS threads (a 14336 x 4096 bf16 weight is 117 MB; one thread reads page cache
 * at about 8 GB/s). Each finds whether its piece holds a non-finite value; the lowest such tensor is then
 * checked again by online_check_values, which names the element.
 */
#define CHECK_PIECE ((size_t)8 << 20)
#define CHECK_READERS 16

struct value_check {
  const struct provider *pv;
  const struct provided *t; /* the tensors */
  size_t n;
  const size_t *first_piece; /* [n + 1]: tensor k has pieces first_piece[k] .. first_piece[k + 1] - 1 */
  atomic_size_t next;        /* the next piece to take */
  atomic_size_t bad;         /* the lowest tensor with a non-finite value found so far (n: none) */
  pthread_mutex_t mu;
  int rc;
  char *msg; /* the first failure's message (set in its thread) */
};

static void check_pieces(struct value_check *c) {
  unsigned char *buf = NULL;
  size_t pieces = c->first_piece[c->n];
  for (size_t p; (p = atomic_fetch_add(&c->next, 1)) < pieces;) {
    size_t k = 0, lo = 0, hi = c->n; /* the tensor of piece p: first_piece[k] <= p < first_piece[k + 1] */
    while (lo < hi) {
      size_t mid = (lo + hi) / 2;
      if (c->first_piece[mid + 1] <= p)
        lo = mid + 1;
      else
        hi = mid;
    }
    k = lo;
    if (k >= atomic_load(&c->bad))
      continue; /* a lower tensor is bad already: this one's answer does not matter */
    const struct provided *t = &c->t[k];
    size_t at = (p - c->first_piece[k]) * CHECK_PIECE,
           len = t->nbytes - at < CHECK_PIECE ? t->nbytes - at : CHECK_PIECE;
    const unsigned char *bytes = c->pv->host_bytes ? c->pv->host_bytes(c->pv, t) : NULL;
    int rc = 0;
    if (bytes)
      bytes += at;
    else if (!buf && !(buf = malloc(CHECK_PIECE)))
      rc = QKEEP_E_NOMEM;
    else
      rc = c->pv->read_range(c->pv, t, at, len, buf), bytes = buf;
    size_t esize = qkeep_dtype_size(t->dtype);
    if (!rc && first_not_finite(bytes, (enum qkeep_dtype)t->dtype, len / esize) < len / esize) {
      size_t was = atomic_load(&c->bad);
      while (k < was && !atomic_compare_exchange_weak(&c->bad, &was, k))
        ;
    }
    if (rc) {
      pthread_mutex_lock(&c->mu);
      if (!c->rc)
        c->rc = rc, c->msg = rc == QKEEP_E_NOMEM ? NULL : xstrdup(qkeep_errmsg());
      pthread_mutex_unlock(&c->mu);
      atomic_store(&c->next, pieces); /* the others stop */
    }
  }
  free(buf);
}

static void *check_pieces_thread(void *arg) {
  check_pieces(arg);
  return NULL;
}

/* online_check_values for n sources in files (srcs, of layers[i]), their tensors t, on threads. */
static int check_on_threads(const qkeep_layer *const *layers, const struct provider *pv,
                            struct source *const *srcs, const struct provided *t, size_t n) {
  size_t *first_piece = malloc((n + 1) * sizeof *first_piece);
  if (!first_piece)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  first_piece[0] = 0;
  for (size_t k = 0; k < n; k++)
    first_piece[k + 1] = first_piece[k] + (t[k].nbytes + CHECK_PIECE - 1) / CHECK_PIECE;
  struct value_check c = {.pv = pv, .t = t, .n = n, .first_piece = first_piece};
  atomic_init(&c.next, 0);
  atomic_init(&c.bad, n);
  pthread_mutex_init(&c.mu, NULL);
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  size_t threads = cores < 1 ? 1 : cores > CHECK_READERS ? CHECK_READERS : (size_t)cores;
  threads = threads > first_piece[n] ? first_piece[n] : threads;
  pthread_t tid[CHECK_READERS];
  size_t started = 0;
  while (started + 1 < threads && pthread_create(&tid[started], NULL, check_pieces_thread, &c) == 0)
    started++;
  check_pieces(&c); /* this thread takes pieces too (all of them when no thread started) */
  for (size_t i = 0; i < started; i++)
    pthread_join(tid[i], NULL);
  pthread_mutex_destroy(&c.mu);
  free(first_piece);
  int rc =
      c.rc ? (c.msg ? set_error(c.rc, "%s", c.msg) : set_error(c.rc, "out of memory checking values")) : 0;
  free(c.msg);
  size_t bad = atomic_load(&c.bad);
  if (!rc && bad < n && !(rc = online_check_values(layers[bad], pv, srcs[bad]))) /* names the element */
    rc = set_error(QKEEP_E_IO,
                   "%s: tensor '%s' (layer %s) changed while it was read: a non-finite value in one "
                   "read was gone in the next",
                   t[bad].where, t[bad].name, layers[bad]->name);
  return rc;
}

void online_value_checks_free(struct online_value_checks *c) {
  free(c->layer), free(c->src), free(c->t);
  *c = (struct online_value_checks){0};
}

int online_value_checks_run(struct online_value_checks *c, const struct provider *pv) {
  int rc = c->n ? check_on_threads(c->layer, pv, c->src, c->t, c->n) : 0;
  online_value_checks_free(c);
  return rc;
}

static int list_value_check(struct online_value_checks *c, const qkeep_layer *layer, struct source *src,
                            const struct provided *t) {
  if (c->n == c->cap) {
    size_t want = c->cap ? 2 * c->cap : 64;
    const qkeep_layer **l = realloc(c->layer, want * sizeof *l);
    if (l)
      c->layer = l;
    struct source **s = l ? realloc(c->src, want * sizeof *s) : NULL;
    if (s)
      c->src = s;
    struct provided *p = s ? realloc(c->t, want * sizeof *p) : NULL;
    if (!p)
      return set_error(QKEEP_E_NOMEM, "out of memory");
    c->t = p, c->cap = want;
  }
  c->layer[c->n] = layer, c->src[c->n] = src, c->t[c->n++] = *t;
  return 0;
}

int online_check_layer_values(const qkeep_layer *layer, const struct provider *pv,
                              struct online_value_checks *later) {
  size_t online = 0;
  for (size_t i = 0; i < layer->n_sources; i++)
    online += layer->sources[i].online;
  if (!online)
    return 0; /* a layer (or model) that quantizes nothing on load: no allocation on a reload's path */
  const struct device *dev = layer_device(layer);
  bool on_device = pv->device_bytes && memory_ops_find_bad_values(dev->ops);
  size_t n = 0;
  struct qkeep_value_range *ranges = malloc(online * sizeof *ranges);
  size_t *which = malloc(online * sizeof *which);
  int rc = ranges && which ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < layer->n_sources && !rc; i++) {
    struct source *src = &layer->sources[i];
    struct provided t;
    if (!src->online || (rc = online_member_tensor(layer, pv, src, &t)))
      continue;
    const void *in_device = pv->device_bytes ? pv->device_bytes(pv, &t) : NULL;
    int rule = finite_rule(t.dtype);
    if (in_device && on_device && rule) {
      ranges[n] = (struct qkeep_value_range){in_device, t.nbytes, rule};
      which[n++] = i;
    } else if (!in_device && pv->read_range && rule) {
      rc = list_value_check(later, layer, src, &t);
    } else {
      rc = online_check_values(layer, pv, src);
    }
  }
  size_t bad = n;
  if (!rc && n && !(rc = dev_find_bad_values(dev, ranges, n, &bad)) && bad < n) {
    struct source *src = &layer->sources[which[bad]];
    if (!(rc = online_check_values(layer, pv, src))) /* names the element */
      rc = set_error(QKEEP_E_DEVICE,
                     "backend %s found a NaN or an infinity in '%s' (layer %s) where the host finds none",
                     dev->be ? dev->be->name : "?", src->checkpoint_name, layer->name);
  }
  free(ranges), free(which);
  return rc;
}

int online_check_values(const qkeep_layer *layer, const struct provider *pv, struct source *src) {
  struct provided t;
  const void *bytes;
  void *held;
  int rc = host_bytes_of(layer, pv, src, &t, &bytes, &held);
  size_t n = rc ? 0 : (size_t)qkeep_spec_numel(&src->spec);
  enum qkeep_dtype dtype = src->spec.dtype;
  size_t bad = n ? first_not_finite(bytes, dtype, n) : 0;
  if (bad < n) {
    int64_t k = src->spec.shape[1] ? src->spec.shape[1] : 1;
    float v = qk_load_float(bytes, dtype, bad);
    rc = set_error(
        QKEEP_E_FORMAT,
        "%s: tensor '%s': element %zu (row %lld, column %lld) is %s: it cannot be quantized on load "
        "(layer %s)",
        t.where, t.name, bad, (long long)(bad / (size_t)k), (long long)(bad % (size_t)k),
        isnan(v) ? "NaN"
        : v > 0  ? "+Inf"
                 : "-Inf",
        layer->name);
  }
  free(held);
  return rc;
}
