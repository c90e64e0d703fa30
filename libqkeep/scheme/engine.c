/*
 * engine.c: the generic engine behind every checkpoint scheme. From a
 * scheme's templates and a layer's modules (fused shards, experts) it checks
 * every tensor, creates the loader params with exactly the checkpoint's bytes,
 * and records where each tensor lands. Also the normalisation helpers the
 * scheme files share.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "base/formats.h"
#include "scheme/scheme.h"
#include "scheme/shard_plan.h"

const struct ckpt_tensor *module_tensor(const struct module *m, const char *local) {
  for (size_t i = 0; i < m->n; i++)
    if (strcmp(m->local[i], local) == 0)
      return m->tensors[i];
  return NULL;
}

static int64_t eval_dim(enum dim_expr d, int64_t n, int64_t k, int64_t g) {
  switch (d) {
  case D_N: return n;
  case D_K: return k;
  case D_K_2: return k / 2;
  case D_K_8: return k / 8;
  case D_K_16: return k / 16;
  case D_K_32: return k / 32;
  case D_K_G: return g ? k / g : 1;
  case D_N_8: return n / 8;
  case D_ONE: return 1;
  case D_2: return 2;
  case D_16: return 16;
  }
  return 0;
}

static struct qkeep_spec eval_spec(const struct param_template *t, enum qkeep_dtype dtype, int64_t n,
                                   int64_t k, int64_t g) {
  struct qkeep_spec s = {.dtype = dtype, .ndim = t->ndim};
  for (int i = 0; i < t->ndim; i++)
    s.shape[i] = eval_dim(t->dims[i], n, k, g);
  return s;
}

/* The per-layer facts scheme_create gathers before creating anything. */
struct layout {
  const struct scheme *sch;
  const struct module *const *modules;
  int experts; /* 0: a linear layer (no leading expert dim) */
  int shards;
  int64_t shard_n[8];
  int64_t n, k, g;
  /* tensor/expert parallel (shard_plan.c): after shard_plan_matrix the dims above are this rank's,
   * experts [first_expert, +experts) of the modules are its own, and plan says how each
   * checkpoint tensor is cut */
  int first_expert;
  struct shard_plan plan;
};

static const struct module *module_at(const struct layout *L, int e, int s) {
  return L->modules[(size_t)(e + L->first_expert) * (size_t)L->shards + (size_t)s];
}

/* The tensor that carries a module's N and K, for messages: its weight in any family's naming. */
static const struct ckpt_tensor *weight_of(const struct module *m) {
  static const char *const names[] = {"weight", "qweight", "weight_packed"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    const struct ckpt_tensor *t = module_tensor(m, names[i]);
    if (t)
      return t;
  }
  return m->tensors[0];
}

/*
 * A linear (or an MoE expert's matrix) with N = 0 or K = 0 has no weights to load and no product
 * to run; kernels divide by both (and oneDNN rejects empty matrices with a floating-point trap), so
 * every scheme refuses it here, at plan time, before anything is allocated.
 */
static int refuse_empty(const qkeep_layer *layer, const struct module *m, int64_t n, int64_t k) {
  if (n > 0 && k > 0)
    return 0;
  const struct ckpt_tensor *w = weight_of(m);
  return set_error(QKEEP_E_FORMAT,
                   "%s: tensor '%s' (layer %s): N = %lld, K = %lld: a linear layer with a zero dimension is "
                   "refused",
                   w->file->path, w->t->name, layer->name, (long long)n, (long long)k);
}

/* Reads N/K/G from every module and checks that they agree. */
static int gather_dims(const qkeep_layer *layer, struct layout *L, const struct quant_config *qc) {
  int experts = L->experts ? L->experts : 1;
  for (int e = 0; e < experts; e++)
    for (int s = 0; s < L->shards; s++) {
      const struct module *m = module_at(L, e, s);
      int64_t n, k, g = 0;
      int rc = L->sch->dims(m, qc, &n, &k, &g);
      if (rc == QKEEP_E_NOTFOUND)
        return set_error(QKEEP_E_FORMAT, "module %s: tensors do not match scheme %s (%s)", m->name,
                         L->sch->name, qkeep_errmsg());
      if (!rc)
        rc = refuse_empty(layer, m, n, k);
      if (rc)
        return rc;
      if (e == 0 && s == 0) {
        L->k = k;
        L->g = g;
      } else if (k != L->k || g != L->g) {
        return set_error(
            QKEEP_E_FORMAT, "module %s: K %lld / group %lld differ from %s's K %lld / group %lld", m->name,
            (long long)k, (long long)g, module_at(L, 0, 0)->name, (long long)L->k, (long long)L->g);
      }
      if (e == 0)
        L->shard_n[s] = n;
      else if (n != L->shard_n[s])
        return set_error(QKEEP_E_FORMAT, "module %s: N %lld differs from expert 0's %lld", m->name,
                         (long long)n, (long long)L->shard_n[s]);
    }
  L->n = 0;
  for (int s = 0; s < L->shards; s++)
    if (!dim_add(L->n, L->shard_n[s], &L->n))
      return set_error(QKEEP_E_FORMAT, "layer %s: the N of its %d fused shards add up past 64 bits",
                       layer->name, L->shards);
  return 0;
}

/* Checks one checkpoint tensor against its template for shard N n_s; sets *dtype. */
static int check_tensor(const struct layout *L, const struct param_template *t, const struct ckpt_tensor *ct,
                        int64_t n_s, enum qkeep_dtype *dtype) {
  const struct st_tensor *st = ct->t;
  char want[SHAPE_STR_LEN], got[SHAPE_STR_LEN];
  if (st->dtype < 0 || !(t->dtypes & (1u << st->dtype))) {
    char expected[QKEEP_DTYPE_COUNT * 16] = ""; /* every dtype name, " or " between */
    for (int d = 0; d < QKEEP_DTYPE_COUNT; d++)
      if (t->dtypes & (1u << d))
        snprintf(expected + strlen(expected), sizeof expected - strlen(expected), "%s%s",
                 expected[0] ? " or " : "", qkeep_dtype_name((enum qkeep_dtype)d));
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': dtype %s in checkpoint, expected %s (scheme %s)",
                     ct->file->path, st->name, st->dtype_name, expected, L->sch->name);
  }
  *dtype = (enum qkeep_dtype)st->dtype;
  struct qkeep_spec got_spec = {.dtype = *dtype, .ndim = st->ndim};
  memcpy(got_spec.shape, st->shape, sizeof got_spec.shape);
  if (t->fuse == F_SLOT) {
    if (st->ndim == 0 || (st->ndim == 1 && st->shape[0] == 1))
      return 0;
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': shape %s, expected a scalar ([] or [1])",
                     ct->file->path, st->name, spec_shape_str(&got_spec, got, sizeof got));
  }
  struct qkeep_spec want_spec = eval_spec(t, *dtype, n_s, L->k, L->g);
  if (!spec_equal(&want_spec, &got_spec))
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': shape %s, expected %s (N %lld, K %lld, group %lld)",
                     ct->file->path, st->name, spec_shape_str(&got_spec, got, sizeof got),
                     spec_shape_str(&want_spec, want, sizeof want), (long long)n_s, (long long)L->k,
                     (long long)L->g);
  return 0;
}

/* The spec of the layer's param for template t (all shards, all experts). */
static struct qkeep_spec param_spec(const struct layout *L, const struct param_template *t,
                                    enum qkeep_dtype dtype, const struct ckpt_tensor *first) {
  struct qkeep_spec s;
  if (t->fuse == F_SLOT) {
    s = (struct qkeep_spec){.dtype = dtype, .ndim = 0};
    if (L->shards > 1)
      s.shape[s.ndim++] = L->shards;
    else if (!L->experts) { /* unfused: exactly the checkpoint's own shape ([] or [1]) */
      s.ndim = first->t->ndim;
      s.shape[0] = 1;
    }
  } else if (t->fuse == F_SHARED) {
    s = eval_spec(t, dtype, L->shard_n[0], L->k, L->g);
  } else if (t->fuse == F_STACKED) {
    s = eval_spec(t, dtype, L->shard_n[0], L->k, L->g);
    if (L->shards > 1) {
      memmove(s.shape + 1, s.shape, sizeof(int64_t) * (size_t)s.ndim);
      s.shape[0] = L->shards;
      s.ndim++;
    }
  } else {
    s = eval_spec(t, dtype, L->n, L->k, L->g);
  }
  if (L->experts) {
    memmove(s.shape + 1, s.shape, sizeof(int64_t) * (size_t)s.ndim);
    s.shape[0] = L->experts;
    s.ndim++;
  }
  return s;
}

/* Records where each module's tensor for template t lands in param p (the rank's slice of it when
 * the layer is cut: shard_plan.c). */
static int add_sources(qkeep_layer *layer, const struct layout *L, const struct param_template *t,
                       qkeep_param *p) {
  int experts = L->experts ? L->experts : 1;
  size_t esize = qkeep_dtype_size(p->create_spec.dtype);
  size_t per_expert = p->create_bytes / (size_t)experts;
  for (int e = 0; e < experts; e++) {
    int64_t n_before = 0;
    for (int s = 0; s < L->shards; s++) {
      const struct ckpt_tensor *ct = module_tensor(module_at(L, e, s), t->name);
      struct qkeep_spec cs = {.dtype = (enum qkeep_dtype)ct->t->dtype, .ndim = ct->t->ndim};
      memcpy(cs.shape, ct->t->shape, sizeof cs.shape);
      struct slice cut;
      const struct slice *sl = shard_slice(&L->plan, t, &cs, &cut) ? &cut : NULL;
      size_t bytes = sl ? sl->rows * sl->row_bytes : qkeep_spec_bytes(&cs), base = (size_t)e * per_expert;
      int rc = 0;
      if (t->fuse == F_ROWS) {
        /* the rows before this shard (N of them, or N/8 for zero points packed along N), each of one_row */
        struct qkeep_spec one_row = eval_spec(t, cs.dtype, 1, L->k, L->g);
        one_row.shape[0] = 1;
        int64_t rows_before = eval_dim(t->dims[0], n_before, L->k, L->g);
        rc = layer_add_source_slice(layer, ct->t->name, p,
                                    base + (size_t)rows_before * qkeep_spec_bytes(&one_row), 1, bytes, bytes,
                                    false, &cs, sl);
      } else if (t->fuse == F_STACKED) {
        rc = layer_add_source_slice(layer, ct->t->name, p, base + (size_t)s * bytes, 1, bytes, bytes, false,
                                    &cs, sl);
      } else if (t->fuse == F_COLS) {
        int64_t cols = eval_dim(t->dims[t->ndim - 1], L->shard_n[s], L->k, L->g);
        int64_t total = eval_dim(t->dims[t->ndim - 1], L->n, L->k, L->g);
        int64_t col_before = eval_dim(t->dims[t->ndim - 1], n_before, L->k, L->g);
        size_t rows = bytes / ((size_t)cols * esize);
        rc = layer_add_source_slice(layer, ct->t->name, p, base + (size_t)col_before * esize, rows,
                                    (size_t)cols * esize, (size_t)total * esize, false, &cs, sl);
      } else if (t->fuse == F_SLOT) {
        rc = layer_add_source(layer, ct->t->name, p, base + (size_t)s * esize, &cs);
      } else { /* F_SHARED: shard 0 loads, the others must repeat it */
        rc = layer_add_source_slice(layer, ct->t->name, p, base, 1, bytes, bytes, s > 0, &cs, sl);
      }
      if (rc)
        return rc;
      n_before += L->shard_n[s];
    }
  }
  return 0;
}

/* A tensor no template names would be silently dropped: refuse it. */
static int check_known_tensors(const qkeep_layer *layer, const struct layout *L,
                               const struct param_template *params, size_t n_params) {
  int experts = L->experts ? L->experts : 1;
  for (int i = 0; i < experts * L->shards; i++)
    for (size_t j = 0; j < L->modules[i]->n; j++) {
      size_t t = 0;
      while (t < n_params && strcmp(params[t].name, L->modules[i]->local[j]) != 0)
        t++;
      if (t == n_params)
        return set_error(QKEEP_E_FORMAT, "%s: tensor '%s' is not part of scheme %s (layer %s)",
                         L->modules[i]->tensors[j]->file->path, L->modules[i]->tensors[j]->t->name,
                         L->sch->name, layer->name);
    }
  return 0;
}

/* Every tensor of every template in every shard and expert: present (unless optional in all),
 * the template's dtype and shape, one dtype across shards. Runs before anything is created. */
static int check_templates(const qkeep_layer *layer, const struct layout *L,
                           const struct param_template *params, size_t n_params) {
  int experts = L->experts ? L->experts : 1;
  for (size_t i = 0; i < n_params; i++) {
    const struct param_template *t = &params[i];
    int present = 0;
    for (int e = 0; e < experts; e++)
      for (int s = 0; s < L->shards; s++)
        present += module_tensor(module_at(L, e, s), t->name) != NULL;
    if (present == 0 && t->optional)
      continue;
    for (int e = 0; e < experts; e++)
      for (int s = 0; s < L->shards; s++) {
        const struct module *m = module_at(L, e, s);
        const struct ckpt_tensor *ct = module_tensor(m, t->name);
        enum qkeep_dtype dtype;
        if (!ct)
          return set_error(QKEEP_E_FORMAT, "checkpoint has no tensor '%s.%s' (scheme %s, layer %s)", m->name,
                           t->name, L->sch->name, layer->name);
        int rc = check_tensor(L, t, ct, L->shard_n[s], &dtype);
        if (rc)
          return rc;
        if (ct->t->dtype != module_tensor(module_at(L, 0, 0), t->name)->t->dtype)
          return set_error(QKEEP_E_FORMAT, "tensor '%s': dtype %s differs from the other shards'",
                           ct->t->name, ct->t->dtype_name);
      }
  }
  return 0;
}

/* One loader param per template the checkpoint has, named prefix + template, with its sources. */
static int create_params(qkeep_layer *layer, const struct layout *L, const struct param_template *params,
                         size_t n_params, const char *prefix) {
  int rc = 0;
  for (size_t i = 0; i < n_params && !rc; i++) {
    const struct param_template *t = &params[i];
    const struct ckpt_tensor *first = module_tensor(module_at(L, 0, 0), t->name);
    if (!first)
      continue;
    char name[128]; /* a fixed prefix ("", "w13_", "w2_") and a template name of the code's own */
    snprintf(name, sizeof name, "%s%s", prefix, t->name);
    struct qkeep_spec spec = param_spec(L, t, (enum qkeep_dtype)first->t->dtype, first);
    qkeep_param *p;
    rc = layer_param_create(layer, name, &spec, &p);
    if (!rc) {
      p->scale = t->scale;
      p->rule =
          (struct scale_rule){.positive = t->positive, .inverted = t->inverted, .code_max = t->code_max};
      rc = add_sources(layer, L, t, p);
    }
  }
  return rc;
}

int scheme_create(qkeep_layer *layer, const struct scheme *sch, const struct quant_config *qc,
                  const char *prefix, const struct module *const *modules, int n_experts, int n_shards) {
  if (n_shards < 1 || n_shards > 8 || n_experts < 0)
    return set_error(QKEEP_E_INVAL, "%s: %d shards, %d experts", layer->name, n_shards, n_experts);
  struct layout L = {.sch = sch, .modules = modules, .experts = n_experts, .shards = n_shards};
  size_t n_params = sch->n_params;
  const struct param_template *params = sch->templates_for ? sch->templates_for(qc, &n_params) : sch->params;
  int rc = gather_dims(layer, &L, qc);
  if (rc)
    return rc;
  if (qc && qc->group_size > 0 && L.g > 0 && L.g != qc->group_size && strcmp(sch->name, "unquantized") != 0)
    return set_error(QKEEP_E_FORMAT, "layer %s: tensors imply group size %lld, the config says %lld",
                     layer->name, (long long)L.g, (long long)qc->group_size);
  if ((rc = check_known_tensors(layer, &L, params, n_params)) ||
      (rc = check_templates(layer, &L, params, n_params)))
    return rc;
  /* Tensor/expert parallel: the rank's dims from here on (shard_plan.c; unchanged on one rank). */
  uint32_t present = 0;
  for (size_t i = 0; i < n_params && i < 32; i++)
    present |= module_tensor(module_at(&L, 0, 0), params[i].name) ? 1u << i : 0;
  if ((rc = shard_plan_matrix(layer, prefix, params, n_params, present, sch->flags ? sch->flags(qc) : 0,
                              n_shards, L.shard_n, &L.n, &L.k, &L.g, &L.experts, &L.first_expert, &L.plan)) ||
      (rc = create_params(layer, &L, params, n_params, prefix)))
    return rc;
  /* Experts of other EP ranks: their tensors are known, not loaded (a W1 may hold them). */
  for (int e = 0; e < n_experts && !rc; e++)
    for (int s = 0; s < n_shards && (e < L.first_expert || e >= L.first_expert + L.experts) && !rc; s++)
      for (size_t j = 0; j < modules[(size_t)e * (size_t)n_shards + (size_t)s]->n && !rc; j++)
        rc = shard_note_foreign(layer->model,
                                modules[(size_t)e * (size_t)n_shards + (size_t)s]->tensors[j]->t->name);
  if (rc)
    return rc;
  /* An MoE layer's dims are w13's ([2I, H], shards gate and up); w2 is [H, I]. */
  if (strcmp(prefix, "w2_") != 0) {
    layer->dims.n = L.n;
    layer->dims.k = L.k;
    layer->dims.group_size = L.g;
    layer->dims.experts = L.experts;
    layer->dims.shards = n_shards;
    memcpy(layer->dims.shard_n, L.shard_n, sizeof L.shard_n);
  }
  layer->dims.flags |= sch->flags ? sch->flags(qc) : 0;
  return 0;
}

/* ---- normalisation helpers ---------------------------------------------------------- */

/* Reads a float param's checkpoint view (F32, F16 or BF16) to host memory as f32 (malloc'd): exact. */
static int read_f32(qkeep_layer *layer, qkeep_param *p, float **out, size_t *count) {
  size_t bytes = qkeep_spec_bytes(&p->view.spec), n = (size_t)qkeep_spec_numel(&p->view.spec);
  unsigned char *raw = malloc(bytes ? bytes : 1);
  float *v = malloc((n ? n : 1) * sizeof *v);
  /* The host mirror of what was loaded, when the param still holds exactly that: no device wait. */
  bool mirrored = p->mirror_valid && !p->transformed && p->view.offset == 0 && bytes == p->create_bytes &&
                  spec_equal(&p->view.spec, &p->create_spec);
  int rc = !raw || !v ? set_error(QKEEP_E_NOMEM, "out of memory")
           : mirrored ? (memcpy(raw, p->mirror, bytes), 0)
                      : dev_d2h(layer_device(layer), raw, tensor_ptr(&p->view), bytes);
  for (size_t i = 0; !rc && i < n; i++)
    v[i] = qk_load_float(raw, p->view.spec.dtype, i);
  free(raw);
  if (rc) {
    free(v);
    return rc;
  }
  *out = v;
  *count = n;
  return 0;
}

/* Writes host floats as the param's new contents, in spec's dtype (F32, F16 or BF16; the values
 * must be exact in it), through the replace rule. */
static int replace_f32(qkeep_layer *layer, const char *name, const struct qkeep_spec *spec,
                       const float *values) {
  qkeep_tensor *t = NULL; /* qkeep_tensor_new leaves it unset when it fails */
  int rc = qkeep_tensor_new(layer, spec, &t);
  size_t n = (size_t)qkeep_spec_numel(spec);
  uint16_t *half = spec->dtype == QKEEP_DTYPE_F32 ? NULL : malloc((n ? n : 1) * sizeof *half);
  if (!rc && spec->dtype != QKEEP_DTYPE_F32 && !half)
    rc = set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; !rc && half && i < n; i++)
    half[i] = spec->dtype == QKEEP_DTYPE_F16 ? qk_f32_to_f16(values[i]) : qk_f32_to_bf16(values[i]);
  /* During a streamed load, through the stream: a plain copy from pageable memory would wait for
   * the layer's copies first. */
  const struct device *dev = layer_device(layer);
  struct stream *s = dev->stream ? *dev->stream : NULL;
  const void *from = half ? (const void *)half : values;
  size_t bytes = qkeep_spec_bytes(spec);
  if (!rc)
    rc = stream_active(s) ? stream_put(s, qkeep_tensor_data(t), from, bytes)
                          : dev_h2d(dev, qkeep_tensor_data(t), from, bytes);
  free(half);
  if (rc) {
    qkeep_tensor_free(t);
    return rc;
  }
  return qkeep_replace(layer, name, t);
}

/* Shards per expert (or per layer) of a per-shard param [S] / [E, S]; 1 when it has no shard dim. */
static int shards_of(const qkeep_layer *layer, const struct qkeep_spec *cs) {
  int slot_dim = layer->dims.experts ? 1 : 0;
  return cs->ndim == slot_dim + 1 ? (int)cs->shape[slot_dim] : 1;
}

int merge_shard_scales_max(qkeep_layer *layer, const char *name) {
  qkeep_param *p = qkeep_param_lookup(layer, name);
  if (!p)
    return 0; /* an optional scale the checkpoint does not carry */
  int experts = layer->dims.experts ? (int)layer->dims.experts : 1;
  const struct qkeep_spec *cs = &p->create_spec;
  int shards = shards_of(layer, cs);
  if (shards < 2 || !spec_equal(&p->view.spec, cs))
    return 0; /* nothing to merge, or merged already since the bytes were loaded */
  float *v = NULL;
  size_t count;
  int rc = read_f32(layer, p, &v, &count);
  if (rc)
    return rc;
  assert(count == (size_t)experts * (size_t)shards);
  for (int e = 0; e < experts; e++) {
    float m = v[(size_t)e * (size_t)shards];
    for (int s = 1; s < shards; s++) {
      float x = v[(size_t)e * (size_t)shards + (size_t)s];
      if (x != m)
        log_msg(QKEEP_LOG_WARN, "%s.%s: shard scales differ (%g vs %g); merged by max without requantising",
                layer->name, name, (double)m, (double)x);
      if (x > m)
        m = x;
    }
    v[e] = m;
  }
  /* The max is one of the loaded values, so it is exact in the loaded dtype: it stays in it. */
  struct qkeep_spec merged = {
      .dtype = cs->dtype, .ndim = layer->dims.experts ? 1 : 0, .shape = {layer->dims.experts}};
  rc = replace_f32(layer, name, &merged, v);
  free(v);
  return rc;
}

int fill_f32(qkeep_layer *layer, const char *name, float value) {
  qkeep_param *p = qkeep_param_lookup(layer, name);
  if (!p)
    return set_error(QKEEP_E_NOTFOUND, "%s has no param '%s'", layer->name, name);
  size_t count = qkeep_spec_bytes(&p->view.spec) / sizeof(float);
  float *v = malloc((count ? count : 1) * sizeof *v);
  if (!v)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < count; i++)
    v[i] = value;
  int rc = replace_f32(layer, name, &p->view.spec, v);
  free(v);
  return rc;
}

/* Element i of an I8 or I32 buffer. */
static int32_t int_at(const unsigned char *bytes, enum qkeep_dtype dtype, size_t i) {
  if (dtype == QKEEP_DTYPE_I8)
    return (int8_t)bytes[i];
  int32_t v;
  memcpy(&v, bytes + 4 * i, sizeof v);
  return v;
}

int merge_shard_equal_int(qkeep_layer *layer, const char *name) {
  qkeep_param *p = qkeep_param_lookup(layer, name);
  if (!p)
    return 0;
  const struct qkeep_spec *cs = &p->create_spec;
  int shards = shards_of(layer, cs), experts = layer->dims.experts ? (int)layer->dims.experts : 1;
  if (shards < 2 || !spec_equal(&p->view.spec, cs))
    return 0;
  size_t bytes = qkeep_spec_bytes(cs), esize = qkeep_dtype_size(cs->dtype);
  assert(esize == 1 || esize == 4);
  unsigned char *v = malloc(bytes ? bytes : 1);
  int rc = v ? dev_d2h(layer_device(layer), v, tensor_ptr(&p->view), bytes)
             : set_error(QKEEP_E_NOMEM, "out of memory");
  for (int e = 0; !rc && e < experts; e++)
    for (int s = 1; !rc && s < shards; s++) {
      int32_t first = int_at(v, cs->dtype, (size_t)e * (size_t)shards),
              x = int_at(v, cs->dtype, (size_t)(e * shards + s));
      if (x != first)
        rc = set_error(QKEEP_E_UNSUPPORTED, "%s.%s: fused shards%s carry different values (%d vs %d)",
                       layer->name, name, layer->dims.experts ? " of an expert" : "", first, x);
    }
  /* Keep each expert's first shard: move it to slot e, in place (slot e <= e * shards). */
  for (int e = 1; !rc && e < experts; e++)
    memcpy(v + (size_t)e * esize, v + (size_t)e * (size_t)shards * esize, esize);
  if (!rc)
    rc = dev_h2d(layer_device(layer), tensor_ptr(&p->view), v, (size_t)experts * esize);
  free(v);
  struct qkeep_spec merged = {
      .dtype = cs->dtype, .ndim = layer->dims.experts ? 1 : 0, .shape = {layer->dims.experts}};
  return rc ? rc : qkeep_replace_in_place(layer, name, &merged);
}

int for_each_matrix(qkeep_layer *layer, int (*fn)(qkeep_layer *layer, const char *prefix)) {
  if (layer->kind != QKEEP_LAYER_MOE)
    return fn(layer, "");
  int rc = fn(layer, "w13_");
  return rc ? rc : fn(layer, "w2_");
}

bool param_was_loaded(const qkeep_layer *layer, const char *name) {
  const qkeep_param *p = qkeep_param_lookup(layer, name);
  for (size_t i = 0; p && i < layer->n_sources; i++)
    if (layer->sources[i].param == p && layer->sources[i].loaded)
      return true;
  for (size_t i = 0; p && i < layer->n_derived; i++) /* made on load (online quantization) */
    if (layer->derived[i].src.param == p && layer->derived[i].src.loaded)
      return true;
  return false;
}

const char *prefixed(char *buf, size_t len, const char *prefix, const char *name) {
  snprintf(buf, len, "%s%s", prefix, name);
  return buf;
}

int packed_dim(const struct ckpt_tensor *t, int axis, int64_t per_unit, int64_t *out) {
  assert(axis >= 0 && axis < t->t->ndim);
  if (!dim_mul(t->t->shape[axis], per_unit, out))
    return set_error(QKEEP_E_FORMAT,
                     "%s: tensor '%s': dimension %d (%lld) times %lld elements per stored unit "
                     "does not fit in 64 bits",
                     t->file->path, t->t->name, axis, (long long)t->t->shape[axis], (long long)per_unit);
  return 0;
}

/* N and K from the packed weight; the block scales must be e4m3 [N, K/16]. */
int nvfp4_dims(const struct module *m, const char *weight_name, int64_t *n, int64_t *k, int64_t *g) {
  const struct ckpt_tensor *w = module_tensor(m, weight_name), *s = module_tensor(m, "weight_scale");
  if (!w || !s)
    return set_error(QKEEP_E_NOTFOUND, "no %s and weight_scale", weight_name);
  if (w->t->ndim != 2 || s->t->ndim != 2)
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': expected a 2-D packed weight", w->file->path,
                     w->t->name);
  *n = w->t->shape[0];
  *g = 16;
  int rc = packed_dim(w, 1, 2, k);
  if (rc)
    return rc;
  if (*k % 16)
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': K = %lld is not a multiple of the NVFP4 block 16",
                     w->file->path, w->t->name, (long long)*k);
  return 0;
}

int check_group_index(qkeep_layer *layer, const char *name, int64_t group_size) {
  qkeep_param *p = qkeep_param_lookup(layer, name);
  if (!p || p->state != QKEEP_PARAM_LIVE || p->create_spec.dtype != QKEEP_DTYPE_I32 ||
      p->create_spec.ndim < 1 || group_size <= 0)
    return 0;
  int64_t k = p->create_spec.shape[p->create_spec.ndim - 1], groups = k / group_size;
  size_t count = (size_t)qkeep_spec_numel(&p->create_spec);
  int32_t *v = malloc((count ? count : 1) * sizeof *v);
  int rc = v ? dev_d2h(layer_device(layer), v, tensor_ptr(&p->view), count * sizeof *v)
             : set_error(QKEEP_E_NOMEM, "out of memory");
  const char *tensor = p->checkpoint_name; /* the checkpoint tensor that loaded it, when one did */
  for (size_t i = 0; i < layer->n_sources; i++)
    if (layer->sources[i].param == p && !layer->sources[i].compare_only) {
      tensor = layer->sources[i].checkpoint_name;
      break;
    }
  for (size_t i = 0; !rc && i < count; i++)
    if (v[i] < 0 || v[i] >= groups)
      rc = set_error(QKEEP_E_FORMAT,
                     "tensor '%s' (layer %s): element %zu is %ld, outside the %lld groups of K = %lld (group "
                     "size %lld)",
                     tensor, layer->name, i, (long)v[i], (long long)groups, (long long)k,
                     (long long)group_size);
  free(v);
  return rc;
}
