/*
 * assemble.c: from a checkpoint's tensor names to the model's layers.
 *
 * Tensors group into modules by name prefix. Then: per-expert modules
 * (<P>.experts.<e>.<proj>) stack into one MoE layer <P> (w13 = gate + up, w2 =
 * down); a gpt-oss pre-stacked module becomes an MoE layer as it is; members
 * of a fusion rule under one parent (q/k/v, gate/up) become one fused linear
 * layer; every other module is a linear layer of the config's scheme (or
 * unquantized when ignored or plain float), or, when it is not a linear at
 * all (norms), a layer whose params are its tensors as they are. Each
 * attention block gets a kv-scales layer (placeholders where the checkpoint
 * has no scales), and a tied lm_head shares the embedding's param.
 * Layers are created in name order, so any sharding of the same tensors gives
 * the same model.
 */
#include <assert.h>
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

/* One tensor's place: module prefix and local name. */
struct entry {
  const char *name; /* the full tensor name */
  size_t prefix_len;
  const char *local;
  const struct ckpt_tensor *t;
};

enum spec_kind { SPEC_LINEAR, SPEC_MOE, SPEC_GPTOSS_MOE, SPEC_PLAIN, SPEC_KV, SPEC_TIED };

/* A layer to create, gathered before any is created so they can be made in name order. */
struct layer_spec {
  enum spec_kind kind;
  char *name;
  const struct scheme *sch;
  const struct module **modules; /* linear: shards; MoE: w13 (E x 2) then w2 (E) */
  int shards, experts;
  const struct module *module;     /* plain, gpt-oss */
  const struct ckpt_tensor *kv[5]; /* k, v, kv, q, prob scales */
};

struct assembly {
  qkeep_model *model;
  const struct ckpt *ck;
  struct entry *entries;
  size_t n_entries;
  struct module *modules;
  size_t n_modules;
  bool *used;
  struct layer_spec *specs;
  size_t n_specs, cap_specs;
  struct entry *kv; /* sorted by attention block, then scale name */
  size_t n_kv;
  struct name_index module_index;   /* modules[i].name -> i */
  struct name_index kv_spec_index;  /* a SPEC_KV spec's name -> its position in specs */
  struct name_index kv_group_index; /* "<block>.attn" -> position of the block's first kv entry */
  char **kv_group_names;            /* the keys of kv_group_index (owned) */
  size_t n_kv_groups;
};

static const char *const kv_names[5] = {"k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale"};

static int kv_index(const char *local) {
  for (int i = 0; i < 5; i++)
    if (strcmp(local, kv_names[i]) == 0)
      return i;
  return -1;
}

static int by_prefix_then_local(const void *a, const void *b) {
  const struct entry *x = a, *y = b;
  size_t n = x->prefix_len < y->prefix_len ? x->prefix_len : y->prefix_len;
  int c = strncmp(x->name, y->name, n);
  if (c)
    return c;
  if (x->prefix_len != y->prefix_len)
    return x->prefix_len < y->prefix_len ? -1 : 1;
  return strcmp(x->local, y->local);
}

/* For the kv entries: by block and scale name, then by full name so that a duplicate reads the same way
 * every run. */
static int by_block_then_name(const void *a, const void *b) {
  int c = by_prefix_then_local(a, b);
  return c ? c : strcmp(((const struct entry *)a)->name, ((const struct entry *)b)->name);
}

/* A malloc'd formatted name, or NULL (with the error set) when out of memory. */
static char *PRINTF_LIKE(1, 2) name_printf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *s = NULL;
  int n = qk_vasprintf(&s, fmt, ap);
  va_end(ap);
  if (n < 0) {
    set_error(QKEEP_E_NOMEM, "out of memory");
    return NULL;
  }
  return s;
}

static const char *last_component(const char *name) {
  const char *dot = strrchr(name, '.');
  return dot ? dot + 1 : name;
}

/* The start of the last component of name's first len characters. */
static const char *last_component_n(const char *name, size_t len) {
  const char *p = name + len;
  while (p > name && p[-1] != '.')
    p--;
  return p;
}

/* Whether [start, end) is exactly `word`. */
static bool proj_is(const char *start, const char *end, const char *word) {
  return (size_t)(end - start) == strlen(word) && strncmp(start, word, strlen(word)) == 0;
}

/* The attention block a kv scale belongs to: <attn>.k_proj.k_scale and <attn>.k_scale both give <attn>. */
static size_t attention_prefix_len(const char *name, size_t prefix_len) {
  static const char *const projections[] = {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj"};
  size_t start = prefix_len; /* of the module's last component */
  while (start > 0 && name[start - 1] != '.')
    start--;
  for (size_t i = 0; i < 5 && start > 0; i++)
    if (prefix_len - start == strlen(projections[i]) &&
        !strncmp(name + start, projections[i], prefix_len - start))
      return start - 1;
  return prefix_len;
}

/* Sorts the kv entries by attention block and indexes each block's first entry under "<block>.attn". */
static int index_kv_groups(struct assembly *a) {
  if (a->n_kv > 1)
    qsort(a->kv, a->n_kv, sizeof *a->kv, by_block_then_name);
  if (a->n_kv && !(a->kv_group_names = calloc(a->n_kv, sizeof *a->kv_group_names)))
    return set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t k = 0; k < a->n_kv; k++) {
    const struct entry *e = &a->kv[k], *prev = k ? &a->kv[k - 1] : NULL;
    if (prev && prev->prefix_len == e->prefix_len && !strncmp(prev->name, e->name, e->prefix_len))
      continue;
    char *name = name_printf("%.*s.attn", (int)e->prefix_len, e->name);
    if (!name)
      return QKEEP_E_NOMEM;
    a->kv_group_names[a->n_kv_groups++] = name;
    int rc = name_index_put(&a->kv_group_index, name, k, NULL);
    assert(rc != QKEEP_E_EXISTS); /* sorted by block: each block starts once */
    if (rc)
      return rc;
  }
  return 0;
}

/* Splits names into entries (kv scales aside), sorts them and forms modules. */
static int build_modules(struct assembly *a) {
  const struct ckpt *ck = a->ck;
  a->entries = calloc(ck->n_tensors ? ck->n_tensors : 1, sizeof *a->entries);
  a->kv = calloc(ck->n_tensors ? ck->n_tensors : 1, sizeof *a->kv);
  if (!a->entries || !a->kv)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < ck->n_tensors; i++) {
    const struct ckpt_tensor *t = &ck->tensors[i];
    const char *dot = strrchr(t->t->name, '.');
    bool bare = !dot || dot == t->t->name || !dot[1];
    /* No module prefix ("logit_scale", "x."): a plain tensor of the model, its own module and param. */
    struct entry e = bare ? (struct entry){t->t->name, strlen(t->t->name), t->t->name, t}
                          : (struct entry){t->t->name, (size_t)(dot - t->t->name), dot + 1, t};
    /* compressed-tensors before PR #133 (2024) named the kv-cache scales k_proj.output_scale and
     * v_proj.output_scale; vLLM's get_cache_scale maps them to the attention's k/v scales. */
    if (!bare && strcmp(e.local, "output_scale") == 0) {
      const char *proj = last_component_n(e.name, e.prefix_len);
      if (proj_is(proj, e.name + e.prefix_len, "k_proj"))
        e.local = "k_scale";
      else if (proj_is(proj, e.name + e.prefix_len, "v_proj"))
        e.local = "v_scale";
    }
    if (!bare && kv_index(e.local) >= 0) {
      e.prefix_len = attention_prefix_len(e.name, e.prefix_len);
      a->kv[a->n_kv++] = e;
    } else {
      a->entries[a->n_entries++] = e;
    }
  }
  qsort(a->entries, a->n_entries, sizeof *a->entries, by_prefix_then_local);
  a->modules = calloc(a->n_entries ? a->n_entries : 1, sizeof *a->modules);
  if (!a->modules)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < a->n_entries;) {
    size_t j = i + 1;
    while (j < a->n_entries && a->entries[j].prefix_len == a->entries[i].prefix_len &&
           strncmp(a->entries[j].name, a->entries[i].name, a->entries[i].prefix_len) == 0)
      j++;
    struct module *m = &a->modules[a->n_modules++];
    m->name = strndup(a->entries[i].name, a->entries[i].prefix_len);
    m->n = j - i;
    m->tensors = calloc(m->n, sizeof *m->tensors);
    m->local = calloc(m->n, sizeof *m->local);
    if (!m->name || !m->tensors || !m->local)
      return set_error(QKEEP_E_NOMEM, "out of memory");
    for (size_t k = i; k < j; k++) {
      m->tensors[k - i] = a->entries[k].t;
      m->local[k - i] = a->entries[k].local;
    }
    i = j;
  }
  a->used = calloc(a->n_modules ? a->n_modules : 1, sizeof *a->used);
  if (!a->used)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  int rc = name_index_reserve(&a->module_index, a->n_modules);
  for (size_t i = 0; i < a->n_modules && !rc; i++)
    rc = name_index_put(&a->module_index, a->modules[i].name, i, NULL);
  assert(rc != QKEEP_E_EXISTS); /* one module per distinct prefix */
  return rc ? rc : index_kv_groups(a);
}

/* The module of that name, or NULL. */
static struct module *find_module(const struct assembly *a, const char *name) {
  size_t at;
  return name_index_get(&a->module_index, name, &at) ? &a->modules[at] : NULL;
}

static struct layer_spec *new_spec(struct assembly *a, enum spec_kind kind, const char *name) {
  if (grow_array((void **)&a->specs, &a->cap_specs, a->n_specs + 1, sizeof *a->specs))
    return NULL;
  struct layer_spec *s = &a->specs[a->n_specs];
  *s = (struct layer_spec){.kind = kind, .name = xstrdup(name)};
  if (!s->name) {
    set_error(QKEEP_E_NOMEM, "out of memory");
    return NULL;
  }
  a->n_specs++;
  return s;
}

/*
 * The first tensor of m that only a quantized layer carries, or NULL: packed
 * codes and their scales or zero points in any family's naming (GPTQ/AWQ,
 * compressed-tensors, ModelOpt, gpt-oss blocks). Such a module loaded as a
 * plain layer would run on garbage, so it never is.
 */
static const char *quantized_tensor(const struct module *m) {
  static const char *const names[] = {
      "qweight",      "qzeros",           "weight_packed",  "weight_shape",        "weight_zero_point",
      "weight_g_idx", "weight_scale",     "weight_scale_2", "weight_global_scale", "input_global_scale",
      "input_scale",  "input_zero_point", "g_idx"};
  for (size_t i = 0; i < m->n; i++) {
    size_t len = strlen(m->local[i]);
    if (len > 7 && strcmp(m->local[i] + len - 7, "_blocks") == 0)
      return m->local[i];
    for (size_t j = 0; j < sizeof names / sizeof names[0]; j++)
      if (strcmp(m->local[i], names[j]) == 0)
        return m->local[i];
  }
  return NULL;
}

/* The refusal for a module with quantized tensors that would load as a plain layer. */
static int refuse_plain(const struct assembly *a, const struct module *m, const char *layer_name,
                        const char *local) {
  const struct quant_config *qc = &a->ck->qc;
  if (qc->method == QM_NONE)
    return set_error(QKEEP_E_FORMAT,
                     "%s: module %s carries quantized tensors ('%s.%s') but the checkpoint declares no "
                     "quantization (no quantization_config in config.json, no hf_quant_config.json, "
                     "quantize_config.json or quant_config.json%s); refusing to load it as a plain layer",
                     a->ck->path, m->name, m->name, local,
                     a->ck->n_files == 1 && strcmp(a->ck->files[0]->path, a->ck->path) == 0
                         ? ": a bare .safetensors file has no config, load its directory"
                         : "");
  if (quant_config_ignores(qc, layer_name) || quant_config_ignores(qc, m->name))
    return set_error(QKEEP_E_FORMAT,
                     "%s: module %s is left unquantized by the config (its ignore list, a GPTQ dynamic '-:' "
                     "rule, or MIXED_PRECISION's quantized_layers) but carries quantized tensors ('%s.%s'); "
                     "refusing to load it as a plain layer",
                     a->ck->path, m->name, m->name, local);
  return set_error(QKEEP_E_FORMAT,
                   "%s: module %s carries quantized tensors ('%s.%s') that are not scheme %s's; refusing "
                   "to load it as a plain layer",
                   a->ck->path, m->name, m->name, local, qc->scheme);
}

/*
 * The scheme a module loads with: the config's, unless the module is ignored
 * or is a plain float linear (a router, an excluded lm_head); NULL when it is
 * no linear at all (norms). A module carrying some of a quantized scheme's
 * tensors but not all of them is an error, not a silent fallback, and so is
 * one carrying any quantized tensors that would become a plain layer.
 */
static int resolve_scheme(const struct assembly *a, const struct module *m, const char *layer_name,
                          const struct scheme **out) {
  struct quant_config module_qc;
  *out = NULL;
  int ignore_rc = quant_config_for_module(&a->ck->qc, m->name, &module_qc);
  if (ignore_rc)
    return ignore_rc;
  const struct quant_config *qc = &module_qc;
  int64_t n, k, g;
  bool ignored = false;
  ignore_rc = qc->method == QM_NONE ? 0 : quant_config_match_ignore(qc, layer_name, &ignored);
  if (!ignore_rc && !ignored && qc->method != QM_NONE)
    ignore_rc = quant_config_match_ignore(qc, m->name, &ignored);
  if (ignore_rc)
    return ignore_rc;
  if (qc->method != QM_NONE && !ignored) {
    const struct scheme *sch = scheme_by_name(qc->scheme);
    if (!sch)
      return set_error(QKEEP_E_UNSUPPORTED, "%s: no scheme '%s'", a->ck->path, qc->scheme);
    int rc = sch->dims(m, qc, &n, &k, &g);
    if (rc == 0) {
      *out = sch;
      return 0;
    }
    if (rc != QKEEP_E_NOTFOUND)
      return rc;
    char why[512];
    snprintf(why, sizeof why, "%s", qkeep_errmsg()); /* what the scheme found missing */
    if (scheme_unquantized.dims(m, qc, &n, &k, &g) == 0) {
      *out = &scheme_unquantized;
      return 0;
    }
    /* The scheme's own tensors (other than weight and bias), or a non-float 2-D weight, mean a
     * quantized module with parts missing. */
    size_t n_params = sch->n_params;
    const struct param_template *params =
        sch->templates_for ? sch->templates_for(qc, &n_params) : sch->params;
    for (size_t i = 0; i < m->n; i++) {
      bool own = false;
      for (size_t t = 0; t < n_params; t++)
        own |= strcmp(m->local[i], params[t].name) == 0 && strcmp(params[t].name, "bias") != 0 &&
               strcmp(params[t].name, "weight") != 0;
      const struct st_tensor *st = m->tensors[i]->t;
      own |= strcmp(m->local[i], "weight") == 0 && st->ndim == 2 &&
             (st->dtype < 0 || !(DT_FLOAT & (1u << st->dtype)));
      if (own)
        return set_error(QKEEP_E_FORMAT, "%s: module %s has '%s' but not the other tensors of scheme %s (%s)",
                         m->tensors[i]->file->path, m->name, m->local[i], sch->name, why);
    }
    const char *q = quantized_tensor(m);
    return q ? refuse_plain(a, m, layer_name, q) : 0;
  }
  if (scheme_unquantized.dims(m, qc, &n, &k, &g) == 0) {
    *out = &scheme_unquantized;
    return 0;
  }
  const char *q = quantized_tensor(m);
  return q ? refuse_plain(a, m, layer_name, q) : 0;
}

/* Whether two modules load with the same per-module config (GPTQ `dynamic` overrides), in *same. */
static int same_module_config(const struct assembly *a, const struct module *x, const struct module *y,
                              bool *same) {
  struct quant_config cx, cy;
  int rc = quant_config_for_module(&a->ck->qc, x->name, &cx);
  if (!rc)
    rc = quant_config_for_module(&a->ck->qc, y->name, &cy);
  *same =
      !rc && cx.group_size == cy.group_size && cx.weight_sym == cy.weight_sym && cx.desc_act == cy.desc_act;
  return rc;
}

/* "<P>.experts.<e>.<proj>": sets *prefix_len (of <P>.experts), *expert and *proj (0 gate, 1 up, 2 down). */
static bool parse_expert(const char *name, size_t *prefix_len, long *expert, int *proj) {
  const char *p = strstr(name, ".experts.");
  while (p) {
    const char *num = p + 9;
    char *end;
    if (isdigit((unsigned char)*num)) {
      long e = strtol(num, &end, 10);
      if (*end == '.' && !strchr(end + 1, '.')) {
        const char *role = end + 1;
        static const char *const roles[3][2] = {{"gate_proj", "w1"}, {"up_proj", "w3"}, {"down_proj", "w2"}};
        for (int r = 0; r < 3; r++)
          if (strcmp(role, roles[r][0]) == 0 || strcmp(role, roles[r][1]) == 0) {
            *prefix_len = (size_t)(p - name) + 8;
            *expert = e;
            *proj = r;
            return true;
          }
      }
    }
    p = strstr(p + 1, ".experts.");
  }
  return false;
}

/* The most experts one MoE block may stack. */
#define MAX_EXPERTS 4096

/* Collects the per-expert modules of MoE blocks into MoE specs. */
static int plan_moe(struct assembly *a) {
  for (size_t i = 0; i < a->n_modules; i++) {
    size_t plen;
    long e;
    int proj;
    if (a->used[i] || !parse_expert(a->modules[i].name, &plen, &e, &proj))
      continue;
    const char *first = a->modules[i].name;
    long experts = 0;
    /* The block's modules all begin "<P>.experts.", so in name order they follow module i
     * together (i is the first: an earlier one would have planned the block). */
    for (size_t j = i; j < a->n_modules && strncmp(a->modules[j].name, first, plen + 1) == 0; j++) {
      size_t pl;
      long ej;
      int pj;
      if (!parse_expert(a->modules[j].name, &pl, &ej, &pj) || pl != plen)
        continue;
      if (ej >= MAX_EXPERTS) /* before any arithmetic on it: strtol gives up to LONG_MAX */
        return set_error(QKEEP_E_FORMAT,
                         "%s: MoE block %.*s: expert index %ld (module %s), at most %d experts", a->ck->path,
                         (int)plen, first, ej, a->modules[j].name, MAX_EXPERTS);
      if (ej + 1 > experts)
        experts = ej + 1;
    }
    char *block_name = strndup(first, plen);
    struct layer_spec *s = block_name ? new_spec(a, SPEC_MOE, block_name) : NULL;
    free(block_name);
    if (!s)
      return set_error(QKEEP_E_NOMEM, "out of memory");
    const char *block = s->name;
    s->experts = (int)experts;
    s->modules = calloc((size_t)experts * 3, sizeof *s->modules);
    if (!s->modules)
      return set_error(QKEEP_E_NOMEM, "out of memory");
    static const char *const roles[3][2] = {{"gate_proj", "w1"}, {"up_proj", "w3"}, {"down_proj", "w2"}};
    for (long x = 0; x < experts; x++)
      for (int r = 0; r < 3; r++) {
        struct module *m = NULL;
        for (int alt = 0; alt < 2 && !m; alt++) {
          char *name = name_printf("%s.%ld.%s", block, x, roles[r][alt]);
          if (!name)
            return QKEEP_E_NOMEM;
          m = find_module(a, name);
          free(name);
        }
        if (!m)
          return set_error(QKEEP_E_FORMAT, "%s: MoE block %s: expert %ld has no %s (experts 0..%ld expected)",
                           a->ck->path, block, x, roles[r][0], experts - 1);
        a->used[m - a->modules] = true;
        /* w13 modules expert-major with gate then up; w2 after all of them. */
        if (r < 2)
          s->modules[x * 2 + r] = m;
        else
          s->modules[experts * 2 + x] = m;
      }
    for (long x = 1; x < experts * 3; x++) {
      bool same;
      int rc = same_module_config(a, s->modules[0], s->modules[x], &same);
      if (rc)
        return rc;
      if (!same)
        return set_error(QKEEP_E_UNSUPPORTED,
                         "%s: MoE block %s: GPTQ dynamic rules give %s and %s different group sizes or "
                         "symmetry; one layout per stacked MoE layer is supported",
                         a->ck->path, block, s->modules[0]->name, s->modules[x]->name);
    }
    int rc = resolve_scheme(a, s->modules[0], block, &s->sch);
    if (rc)
      return rc;
    if (!s->sch)
      return set_error(QKEEP_E_FORMAT, "%s: MoE block %s: expert tensors are not a linear of any scheme",
                       a->ck->path, block);
  }
  return 0;
}

/* gpt-oss: <P>.experts with gate_up_proj_blocks and the rest, already stacked. */
static int plan_gptoss(struct assembly *a) {
  for (size_t i = 0; i < a->n_modules; i++) {
    if (a->used[i] || !module_tensor(&a->modules[i], "gate_up_proj_blocks"))
      continue;
    struct layer_spec *s = new_spec(a, SPEC_GPTOSS_MOE, a->modules[i].name);
    if (!s)
      return QKEEP_E_NOMEM;
    s->module = &a->modules[i];
    s->sch = &scheme_mxfp4;
    a->used[i] = true;
  }
  return 0;
}

static const struct fusion_rule default_rules[] = {
    {"qkv_proj", {"q_proj", "k_proj", "v_proj"}, 3},
    {"gate_up_proj", {"gate_proj", "up_proj"}, 2},
};

/* Fused linear layers where every member of a rule exists under one parent with one scheme. */
static int plan_fusion(struct assembly *a) {
  const struct fusion_rule *rules = a->model->fusion_set ? a->model->fusion : default_rules;
  size_t n_rules = a->model->fusion_set ? a->model->n_fusion : sizeof default_rules / sizeof default_rules[0];
  for (size_t i = 0; i < a->n_modules; i++) {
    const char *member = last_component(a->modules[i].name);
    if (a->used[i] || member == a->modules[i].name)
      continue;
    size_t parent_len = (size_t)(member - a->modules[i].name) - 1;
    for (size_t r = 0; r < n_rules; r++) {
      if (strcmp(member, rules[r].members[0]) != 0)
        continue;
      const struct module *mods[8];
      const struct scheme *sch = NULL;
      bool complete = true;
      for (int m = 0; m < rules[r].n_members && complete; m++) {
        char *name = name_printf("%.*s.%s", (int)parent_len, a->modules[i].name, rules[r].members[m]);
        if (!name)
          return QKEEP_E_NOMEM;
        mods[m] = find_module(a, name);
        free(name);
        const struct scheme *ms = NULL;
        int rc = mods[m] ? resolve_scheme(a, mods[m], mods[m]->name, &ms) : 0;
        bool same = true;
        if (!rc && mods[m] && m > 0 && ms && ms == sch)
          rc = same_module_config(a, mods[0], mods[m], &same);
        if (rc)
          return rc;
        complete = mods[m] && !a->used[mods[m] - a->modules] && ms && (m == 0 || (ms == sch && same));
        sch = ms;
      }
      if (!complete)
        continue;
      char *name = name_printf("%.*s.%s", (int)parent_len, a->modules[i].name, rules[r].fused);
      struct layer_spec *s = name ? new_spec(a, SPEC_LINEAR, name) : NULL;
      free(name);
      if (!s || !(s->modules = calloc((size_t)rules[r].n_members, sizeof *s->modules)))
        return set_error(QKEEP_E_NOMEM, "out of memory");
      s->sch = sch;
      s->shards = rules[r].n_members;
      for (int m = 0; m < rules[r].n_members; m++) {
        s->modules[m] = mods[m];
        a->used[mods[m] - a->modules] = true;
      }
      break;
    }
  }
  return 0;
}

/* Every module not taken yet: a linear of its scheme, or a plain layer. */
static int plan_rest(struct assembly *a) {
  for (size_t i = 0; i < a->n_modules; i++) {
    if (a->used[i])
      continue;
    const struct scheme *sch;
    int rc = resolve_scheme(a, &a->modules[i], a->modules[i].name, &sch);
    if (rc)
      return rc;
    struct layer_spec *s = new_spec(a, sch ? SPEC_LINEAR : SPEC_PLAIN, a->modules[i].name);
    if (!s)
      return QKEEP_E_NOMEM;
    s->sch = sch;
    s->module = &a->modules[i];
    s->shards = 1;
    if (sch && !(s->modules = calloc(1, sizeof *s->modules)))
      return set_error(QKEEP_E_NOMEM, "out of memory");
    if (sch)
      s->modules[0] = &a->modules[i];
    a->used[i] = true;
  }
  return 0;
}

/* One kv-scales layer per attention block: blocks with q/k/v projections or scale tensors. */
static int plan_kv(struct assembly *a) {
  static const char *const attention_members[] = {"q_proj", "k_proj", "v_proj", "qkv_proj"};
  for (size_t i = 0; i < a->n_modules + a->n_kv; i++) {
    size_t plen;
    const char *base;
    if (i < a->n_modules) {
      const char *last = last_component(a->modules[i].name);
      bool member = false;
      for (size_t m = 0; m < 4; m++)
        member |= strcmp(last, attention_members[m]) == 0;
      if (!member || last == a->modules[i].name)
        continue;
      base = a->modules[i].name;
      plen = (size_t)(last - base) - 1;
    } else {
      base = a->kv[i - a->n_modules].name;
      plen = a->kv[i - a->n_modules].prefix_len;
    }
    char *name = name_printf("%.*s.attn", (int)plen, base);
    size_t first;
    if (!name)
      return QKEEP_E_NOMEM;
    if (name_index_get(&a->kv_spec_index, name, &first)) {
      free(name);
      continue;
    }
    struct layer_spec *s = new_spec(a, SPEC_KV, name);
    free(name);
    int rc = s ? name_index_put(&a->kv_spec_index, s->name, (size_t)(s - a->specs), NULL) : QKEEP_E_NOMEM;
    if (rc)
      return rc;
    bool scales = name_index_get(&a->kv_group_index, s->name, &first);
    for (size_t k = first; scales && k < a->n_kv; k++) {
      if (a->kv[k].prefix_len != plen || strncmp(a->kv[k].name, base, plen) != 0)
        break; /* the block's entries are contiguous (index_kv_groups sorted them) */
      int idx = kv_index(a->kv[k].local);
      if (s->kv[idx])
        return set_error(QKEEP_E_FORMAT, "%s: attention block %.*s has two %s tensors ('%s', '%s')",
                         a->ck->path, (int)plen, base, kv_names[idx], s->kv[idx]->t->name, a->kv[k].name);
      s->kv[idx] = a->kv[k].t;
    }
    /* vLLM reads a bare kv_scale as the older name of both k_scale and v_scale: beside either, two
     * namings claim the same scale, and no exporter writes both. */
    if (s->kv[2] && (s->kv[0] || s->kv[1]))
      return set_error(QKEEP_E_FORMAT,
                       "%s: attention block %.*s has '%s' and '%s': kv_scale is the older name of both the k "
                       "and the v scale, so one checkpoint holds one naming or the other",
                       a->ck->path, (int)plen, base, s->kv[2]->t->name,
                       (s->kv[0] ? s->kv[0] : s->kv[1])->t->name);
  }
  return 0;
}

/* The first tensor of a spec's module (its weight when it has one), for messages. */
static const char *spec_tensor_name(const struct layer_spec *s) {
  const struct module *m = s->modules && s->modules[0] ? s->modules[0] : s->module;
  if (!m || !m->n)
    return s->name;
  const struct ckpt_tensor *w = module_tensor(m, "weight");
  return (w ? w : m->tensors[0])->t->name;
}

/*
 * A tied lm_head: the config says so and there is an embedding. The checkpoint must then hold no
 * lm_head of its own: transformers and vLLM would ignore such a tensor and tie lm_head to the
 * embedding, so loading it untied would run another matrix than theirs; qkeep refuses the
 * contradiction. The embedding must be unquantized: the tied layer shares its weight param alone,
 * and would run a quantized embedding's codes as plain weights.
 */
static int plan_tied(struct assembly *a) {
  if (!a->ck->qc.tie_word_embeddings)
    return 0;
  const struct layer_spec *embedding = NULL, *lm_head = NULL;
  for (size_t s = 0; s < a->n_specs; s++) {
    if (strcmp(last_component(a->specs[s].name), "lm_head") == 0)
      lm_head = &a->specs[s];
    if (a->specs[s].kind == SPEC_LINEAR && strcmp(last_component(a->specs[s].name), "embed_tokens") == 0)
      embedding = &a->specs[s];
  }
  if (!embedding)
    return 0;
  if (lm_head)
    return set_error(QKEEP_E_FORMAT,
                     "%s/config.json: tie_word_embeddings is true, but the checkpoint holds its own lm_head "
                     "(tensor '%s'): transformers ignores that tensor and ties lm_head to '%s'; qkeep "
                     "refuses the contradiction (remove the tensor, or set tie_word_embeddings to false)",
                     a->ck->dir, spec_tensor_name(lm_head), spec_tensor_name(embedding));
  if (embedding->sch && embedding->sch != &scheme_unquantized)
    return set_error(QKEEP_E_UNSUPPORTED,
                     "%s/config.json: tie_word_embeddings ties lm_head to '%s', which is quantized (scheme "
                     "%s): qkeep ties lm_head only to an unquantized embedding",
                     a->ck->dir, embedding->name, embedding->sch->name);
  struct layer_spec *s = new_spec(a, SPEC_TIED, "lm_head");
  if (!s)
    return QKEEP_E_NOMEM;
  s->module = NULL;
  return (s->modules = calloc(1, sizeof *s->modules)) ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
}

static int by_spec_name(const void *a, const void *b) {
  return strcmp(((const struct layer_spec *)a)->name, ((const struct layer_spec *)b)->name);
}

static bool is_embedding(const char *name) {
  const char *last = last_component(name);
  return strstr(last, "embed") != NULL || strcmp(last, "wte") == 0;
}

/* Params of a plain layer: each tensor as it is. */
static int create_plain(qkeep_layer *layer, const struct module *m) {
  for (size_t i = 0; i < m->n; i++) {
    const struct st_tensor *t = m->tensors[i]->t;
    if (t->dtype < 0)
      return set_error(QKEEP_E_UNSUPPORTED, "%s: tensor '%s': dtype %s is not supported by qkeep",
                       m->tensors[i]->file->path, t->name, t->dtype_name);
    struct qkeep_spec spec = {.dtype = (enum qkeep_dtype)t->dtype, .ndim = t->ndim};
    memcpy(spec.shape, t->shape, sizeof spec.shape);
    qkeep_param *p;
    int rc = layer_param_create(layer, m->local[i], &spec, &p);
    if (!rc && t->full_shape) { /* rank > 6 or a dim >= 2^63: the param keeps the whole shape too */
      size_t bytes = sizeof *t->full_shape * (size_t)t->full_ndim;
      if (!(p->full_shape = malloc(bytes)))
        return set_error(QKEEP_E_NOMEM, "out of memory");
      memcpy(p->full_shape, t->full_shape, bytes);
      p->full_ndim = t->full_ndim;
    }
    if (!rc)
      rc = layer_add_source(layer, t->name, p, 0, &spec);
    if (rc)
      return rc;
  }
  return 0;
}

/* k_scale and v_scale (placeholders when absent), q_scale and prob_scale when present. */
static int create_kv(qkeep_layer *layer, const struct layer_spec *s) {
  for (int i = 0; i < 5; i++) {
    const struct ckpt_tensor *t = s->kv[i] ? s->kv[i] : (i < 2 ? s->kv[2] : NULL);
    if (i == 2 || (!t && i >= 2))
      continue; /* a single kv_scale feeds both k_scale and v_scale */
    struct qkeep_spec spec = {.dtype = QKEEP_DTYPE_F32, .ndim = 0};
    if (t) {
      /* ModelOpt writes F32 []; compressed-tensors the model's dtype, [1] (kept as loaded). */
      bool is_float = t->t->dtype >= 0 && (DT_FLOAT & (1u << t->t->dtype));
      if (!is_float || t->t->ndim > 1 || (t->t->ndim == 1 && t->t->shape[0] != 1))
        return set_error(
            QKEEP_E_FORMAT,
            "%s: tensor '%s': %s, expected a scalar kv-cache scale ([] or [1]; F32, BF16 or F16)",
            t->file->path, t->t->name, t->t->dtype_name);
      spec.dtype = (enum qkeep_dtype)t->t->dtype;
      spec.ndim = t->t->ndim;
      spec.shape[0] = 1;
    }
    qkeep_param *p;
    int rc = layer_param_create(layer, kv_names[i], &spec, &p);
    if (!rc)
      p->scale = true;
    if (!rc && t)
      rc = layer_add_source(layer, t->t->name, p, 0, &spec);
    if (rc)
      return rc;
  }
  return 0;
}

static int create_tied(qkeep_layer *layer) {
  qkeep_layer *embed = NULL;
  for (size_t i = 0; i < layer->model->n_layers && !embed; i++)
    if (strcmp(last_component(layer->model->layers[i]->name), "embed_tokens") == 0)
      embed = layer->model->layers[i];
  qkeep_param *w = embed ? qkeep_param_lookup(embed, "weight") : NULL;
  if (!w)
    return set_error(QKEEP_E_FORMAT, "tied lm_head: no embedding weight");
  int rc = layer_register(layer, "weight", w, NULL);
  if (rc)
    return rc;
  layer->dims = embed->dims;
  layer->dims.name = layer->name;
  layer->dims.scheme = layer->scheme;
  layer->dims.kind = QKEEP_LAYER_LINEAR;
  layer->dims.flags |= QKEEP_LAYER_F_TIED;
  return 0;
}

static int create_layer(struct assembly *a, const struct layer_spec *s) {
  static const enum qkeep_layer_kind kinds[] = {
      [SPEC_LINEAR] = QKEEP_LAYER_LINEAR,  [SPEC_MOE] = QKEEP_LAYER_MOE,
      [SPEC_GPTOSS_MOE] = QKEEP_LAYER_MOE, [SPEC_PLAIN] = QKEEP_LAYER_OTHER,
      [SPEC_KV] = QKEEP_LAYER_KV_SCALES,   [SPEC_TIED] = QKEEP_LAYER_LINEAR};
  enum qkeep_layer_kind kind = kinds[s->kind];
  if (s->kind == SPEC_LINEAR && s->sch == &scheme_unquantized && s->shards == 1 && is_embedding(s->name))
    kind = QKEEP_LAYER_EMBEDDING;
  const char *scheme = s->kind == SPEC_KV ? "kv-scales" : s->sch ? s->sch->name : "unquantized";
  qkeep_layer *layer;
  int rc = qkeep_layer_add(a->model, s->name, kind, scheme, &layer);
  if (rc)
    return rc;
  layer->scheme_ops = s->kind == SPEC_KV ? &scheme_kv_scales : s->sch;
  struct quant_config module_qc = a->ck->qc;
  if ((s->kind == SPEC_LINEAR || s->kind == SPEC_MOE) && s->modules && s->modules[0])
    rc = quant_config_for_module(&a->ck->qc, s->modules[0]->name, &module_qc);
  if (rc)
    return add_error_context(rc, "layer %s", s->name);
  const struct quant_config *qc = &module_qc;
  switch (s->kind) {
  case SPEC_LINEAR: rc = scheme_create(layer, s->sch, qc, "", s->modules, 0, s->shards); break;
  case SPEC_MOE:
    rc = scheme_create(layer, s->sch, qc, "w13_", s->modules, s->experts, 2);
    if (!rc)
      rc = scheme_create(layer, s->sch, qc, "w2_", s->modules + (size_t)s->experts * 2, s->experts, 1);
    break;
  case SPEC_GPTOSS_MOE: rc = mxfp4_create_gptoss_moe(layer, s->module); break;
  case SPEC_PLAIN: rc = create_plain(layer, s->module); break;
  case SPEC_KV: rc = create_kv(layer, s); break;
  case SPEC_TIED: rc = create_tied(layer); break;
  }
  layer->dims.kind = kind;
  return rc ? add_error_context(rc, "layer %s", s->name) : 0;
}

static void assembly_free(struct assembly *a) {
  for (size_t i = 0; i < a->n_modules; i++) {
    free(a->modules[i].name);
    free(a->modules[i].tensors);
    free(a->modules[i].local);
  }
  for (size_t i = 0; i < a->n_specs; i++) {
    free(a->specs[i].name);
    free(a->specs[i].modules);
  }
  free(a->modules);
  free(a->specs);
  free(a->entries);
  free(a->kv);
  free(a->used);
  name_index_clear(&a->module_index);
  name_index_clear(&a->kv_spec_index);
  name_index_clear(&a->kv_group_index);
  for (size_t i = 0; i < a->n_kv_groups; i++)
    free(a->kv_group_names[i]);
  free(a->kv_group_names);
}

int assemble_model(qkeep_model *model, const struct ckpt *ck) {
  struct assembly a = {.model = model, .ck = ck};
  int rc = build_modules(&a);
  if (!rc)
    rc = plan_moe(&a);
  if (!rc)
    rc = plan_gptoss(&a);
  if (!rc)
    rc = plan_fusion(&a);
  if (!rc)
    rc = plan_rest(&a);
  if (!rc)
    rc = plan_kv(&a);
  if (!rc)
    rc = plan_tied(&a);
  if (!rc) {
    qsort(a.specs, a.n_specs, sizeof *a.specs, by_spec_name);
    for (size_t i = 0; i + 1 < a.n_specs && !rc; i++)
      if (strcmp(a.specs[i].name, a.specs[i + 1].name) == 0)
        rc = set_error(QKEEP_E_FORMAT, "%s: two layers would be named %s (a fused name that also exists?)",
                       ck->path, a.specs[i].name);
  }
  /* The tied lm_head sorts before model.*: create it after everything else. */
  for (size_t i = 0; i < a.n_specs && !rc; i++)
    if (a.specs[i].kind != SPEC_TIED)
      rc = create_layer(&a, &a.specs[i]);
  for (size_t i = 0; i < a.n_specs && !rc; i++)
    if (a.specs[i].kind == SPEC_TIED)
      rc = create_layer(&a, &a.specs[i]);
  assembly_free(&a);
  return rc;
}
