/*
 * quant_config.c: the quantization a checkpoint declares, read from
 * config.json's quantization_config and ModelOpt's hf_quant_config.json
 * (docs/FORMATS.md, "2. Which scheme" and "3. Schemes").
 *
 * Every key qkeep relies on is type-checked, and a value it cannot honour
 * fails with QKEEP_E_UNSUPPORTED naming it, rather than loading bytes under a
 * guessed layout. Keys that only steer calibration or kernel choice
 * (observer, targets, producer, quantization_status) are not read.
 *
 * Messages name the file and the key path: "DIR/config.json:
 * quantization_config.group_size is a string, expected an integer".
 */
#include <assert.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "format/checkpoint.h"

#define NVFP4_GROUP 16
#define MXFP4_GROUP 32

/*
 * Where a JSON object sits, for messages: the file and the key path inside it, as a chain of
 * keys up to the file's top ("quantization_config" <- "config_groups" <- "group_0" <- "weights").
 * The path is spelled out only when a message needs it, at any length.
 */
struct origin {
  const char *file;            /* "DIR/config.json" */
  const struct origin *parent; /* the object this one is a member of; NULL at the top */
  const char *key;             /* its key there; "" for the file's top object */
};

/* A key one level down (a struct of its own so that call sites read as before). */
struct sub_origin {
  struct origin o;
};

/* The dotted key path of o, malloc'd (NULL when out of memory). */
static char *origin_path(const struct origin *o) {
  size_t len = 0, keys = 0;
  for (const struct origin *p = o; p; p = p->parent)
    if (p->key[0]) {
      len += strlen(p->key);
      keys++;
    }
  len += keys ? keys - 1 : 0;
  char *s = malloc(len + 1);
  if (!s)
    return NULL;
  s[len] = '\0';
  size_t at = len;
  for (const struct origin *p = o; p; p = p->parent) {
    size_t n = strlen(p->key);
    if (!n)
      continue;
    at -= n;
    memcpy(s + at, p->key, n);
    if (at)
      s[--at] = '.';
  }
  return s;
}

/* Sets "FILE: PATH.KEY DETAIL" (key may be NULL) and returns code. */
static int PRINTF_LIKE(4, 5)
    key_error(int code, const struct origin *o, const char *key, const char *fmt, ...) {
  char detail[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  char *path = origin_path(o);
  const char *dot = path && path[0] && key ? "." : "";
  set_error(code, "%s: %s%s%s %s", o->file, path ? path : "", dot, key ? key : "", detail);
  free(path);
  return code;
}

/* The origin of obj[key], so that messages about nested keys give their full path. */
static void descend(struct sub_origin *sub, const struct origin *o, const char *key) {
  sub->o = (struct origin){o->file, o, key}; /* key: a literal or a key of the parsed tree */
}

/*
 * Typed getters. Each returns 1 when the key holds a value of the right type
 * (stored in *out), 0 when it is absent or null (Python writes None for
 * "not set"), or QKEEP_E_FORMAT naming the key when the type is wrong.
 */
#define TYPED_GETTER(NAME, CTYPE, IS_TYPE, EXPECTED, VALUE)                                                  \
  static int NAME(const struct origin *o, const json_t *obj, const char *key, CTYPE *out) {                  \
    const json_t *v = json_object_get(obj, key);                                                             \
    if (!v || json_is_null(v))                                                                               \
      return 0;                                                                                              \
    if (!IS_TYPE(v))                                                                                         \
      return key_error(QKEEP_E_FORMAT, o, key, "is %s, expected " EXPECTED, json_kind(v));                   \
    *out = VALUE(v);                                                                                         \
    return 1;                                                                                                \
  }

#define INT_VALUE(v) ((int64_t)json_integer_value(v))
#define SAME_VALUE(v) (v)
TYPED_GETTER(get_int, int64_t, json_is_integer, "an integer", INT_VALUE)
TYPED_GETTER(get_bool, bool, json_is_boolean, "true or false", json_is_true)
TYPED_GETTER(get_string, const char *, json_is_string, "a string", json_string_value)
TYPED_GETTER(get_object, const json_t *, json_is_object, "an object", SAME_VALUE)
#undef TYPED_GETTER
#undef INT_VALUE
#undef SAME_VALUE

/* Parses JSON text that must be an object; the caller owns *out. */
static int parse_object(const char *file, const char *text, json_t **out) {
  json_t *root;
  int line, column, position;
  char why[160];
  int parsed = json_parse(text, strlen(text), 0, &root, &line, &column, &position, why);
  if (parsed == QKEEP_E_NOMEM)
    return set_error(parsed, "%s: out of memory parsing JSON", file);
  if (parsed)
    return set_error(QKEEP_E_FORMAT, "%s: invalid JSON at line %d, column %d: %s", file, line, column, why);
  if (!json_is_object(root)) {
    int rc = set_error(QKEEP_E_FORMAT, "%s: the top level is %s, expected an object", file, json_kind(root));
    json_decref(root);
    return rc;
  }
  *out = root;
  return 0;
}

/* ---- the ignore list --------------------------------------------------------------- */

static bool has_prefix(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

/*
 * Appends the module names of obj[key] (an array of strings) to the ignore
 * list (ignore.c), skipping ones already there. Regexes are compiled here so
 * that a broken one fails at open, not silently at match time.
 */
static int add_ignores(struct quant_config *qc, size_t *cap, const struct origin *o, const json_t *obj,
                       const char *key) {
  const json_t *list = json_object_get(obj, key);
  if (!list || json_is_null(list))
    return 0;
  if (!json_is_array(list))
    return key_error(QKEEP_E_FORMAT, o, key, "is %s, expected an array of module names", json_kind(list));
  struct sub_origin where;
  descend(&where, o, key);
  char *where_text = NULL, *where_path = origin_path(&where.o);
  int printed = where_path ? qk_asprintf(&where_text, "%s: %s", o->file, where_path) : -1;
  free(where_path);
  if (printed < 0)
    return set_error(QKEEP_E_NOMEM, "%s: out of memory", o->file);
  size_t i;
  json_t *item;
  int rc = 0;
  json_array_foreach(list, i, item) {
    if (!json_is_string(item)) {
      rc = key_error(QKEEP_E_FORMAT, o, key, "entry %zu is %s, expected a string", i, json_kind(item));
      break;
    }
    char why[512];
    const char *name = json_string_value(item);
    rc = ignore_add(qc, cap, name, where_text, why, sizeof why);
    if (rc == QKEEP_E_FORMAT)
      rc = key_error(rc, o, key, "entry '%s' is not a valid regular expression: %s", name, why);
    if (rc)
      break;
  }
  free(where_text);
  return rc;
}

/* The first GPTQ `dynamic` rule matching the module in *rule, or NULL. */
static int first_rule(const struct quant_config *qc, const char *module, const struct gptq_rule **rule) {
  size_t at;
  int rc = dynamic_rule_first(qc, module, &at);
  *rule = !rc && at != SIZE_MAX ? &qc->dynamic[at] : NULL;
  return rc;
}

/*
 * A module is left unquantized when a GPTQ `dynamic` "-:" rule matches it
 * first, when a MIXED_PRECISION config's quantized_layers do not name it, or
 * when its ignore list covers it (ignore.c).
 */
int quant_config_match_ignore(const struct quant_config *qc, const char *module, bool *ignored) {
  const struct gptq_rule *rule;
  *ignored = false;
  int rc = first_rule(qc, module, &rule);
  if (rc)
    return rc;
  *ignored = true;
  if (rule && rule->exclude)
    return 0;
  if (qc->mixed && !quantized_covers(qc, module)) /* MIXED_PRECISION: only where quantized_layers says */
    return 0;
  return ignore_list_match(qc, module, ignored);
}

bool quant_config_ignores(const struct quant_config *qc, const char *module) {
  bool ignored;
  return quant_config_match_ignore(qc, module, &ignored) == 0 && ignored;
}

/* ---- GPTQ dynamic rules ---------------------------------------------------------------- */

int quant_config_for_module(const struct quant_config *qc, const char *module, struct quant_config *out) {
  *out = *qc;
  const struct gptq_rule *r;
  int rc = first_rule(qc, module, &r);
  if (rc || !r || r->exclude)
    return rc;
  if (r->has_group_size)
    out->group_size = r->group_size;
  if (r->has_sym)
    out->weight_sym = r->sym;
  if (r->has_desc_act)
    out->desc_act = r->desc_act;
  return 0;
}

/* One "+:" rule's overrides: bits must stay 4; group_size, sym, desc_act as the config keys. */
static int gptq_rule_values(const struct origin *o, const json_t *v, struct gptq_rule *r) {
  if (!json_is_object(v))
    return key_error(QKEEP_E_FORMAT, o, NULL, "is %s, expected an object of overrides", json_kind(v));
  int64_t bits = 4, group = 0;
  int rc = get_int(o, v, "bits", &bits);
  if (rc < 0)
    return rc;
  if (bits != 4)
    return key_error(QKEEP_E_UNSUPPORTED, o, "bits",
                     "%lld: a module with other than 4-bit weights is not supported (gptq-int4 only)",
                     (long long)bits);
  if ((rc = get_int(o, v, "group_size", &group)) < 0)
    return rc;
  if (rc == 1 && group != -1 && group <= 0)
    return key_error(QKEEP_E_FORMAT, o, "group_size", "%lld is not a group size", (long long)group);
  r->has_group_size = rc == 1;
  r->group_size = group == -1 ? 0 : group;
  if ((rc = get_bool(o, v, "sym", &r->sym)) < 0)
    return rc;
  r->has_sym = rc == 1;
  if ((rc = get_bool(o, v, "desc_act", &r->desc_act)) < 0)
    return rc;
  r->has_desc_act = rc == 1;
  return 0;
}

/* GPTQModel's `dynamic`: {"-:REGEX": {...}, "+:REGEX": {...}, "REGEX": {...}}, in order. */
static int gptq_dynamic(const struct origin *o, const json_t *dynamic, struct quant_config *qc) {
  struct sub_origin od;
  descend(&od, o, "dynamic");
  size_t cap = 0;
  char *where = NULL, *path = origin_path(&od.o);
  if (!path || qk_asprintf(&where, "%s: %s", o->file, path) < 0) {
    free(path);
    return set_error(QKEEP_E_NOMEM, "%s: out of memory", o->file);
  }
  free(path);
  const char *key;
  json_t *v;
  int rc = 0;
  json_object_foreach((json_t *)dynamic, key, v) {
    struct gptq_rule r = {0};
    r.exclude = has_prefix(key, "-:");
    const char *pattern = r.exclude || has_prefix(key, "+:") ? key + 2 : key;
    struct sub_origin orule;
    descend(&orule, &od.o, key);
    rc = r.exclude ? 0 : gptq_rule_values(&orule.o, v, &r); /* a "-:" rule's value is ignored */
    if (!rc)
      rc = grow_array((void **)&qc->dynamic, &cap, qc->n_dynamic + 1, sizeof *qc->dynamic);
    if (!rc && !(r.pattern = xstrdup(pattern)))
      rc = set_error(QKEEP_E_NOMEM, "out of memory");
    char why[256];
    if (!rc && (rc = dynamic_rule_add(qc, pattern, where, why, sizeof why)) == QKEEP_E_FORMAT)
      rc =
          key_error(QKEEP_E_FORMAT, &od.o, NULL, "rule '%s' is not a valid regular expression: %s", key, why);
    if (rc) {
      free(r.pattern);
      break;
    }
    qc->dynamic[qc->n_dynamic++] = r;
  }
  free(where);
  return rc;
}

/* ---- ModelOpt ----------------------------------------------------------------------- */

/* The fields ModelOpt states in both files, before they are compared. */
struct modelopt_decl {
  const char *quant_algo;
  int64_t group_size; /* NVFP4_GROUP unless stated */
  bool kv_cache_fp8;
  const json_t *quantized_layers; /* MIXED_PRECISION: {"<layer>": {"quant_algo", "group_size"}, ...} */
  /* where quant_algo was found, for messages: a copy of its origin, whose parents (the file's top
   * or config.json's quantization_config) live in parse_modelopt's callers */
  struct origin at;
};

static void decl_at(struct modelopt_decl *d, const struct origin *o) { d->at = *o; }

/* NVFP4 with its one group size; every other algorithm the exporter writes is a different layout. */
/*
 * MIXED_PRECISION's quantized_layers, each {"quant_algo": "NVFP4", "group_size": 16}, into
 * qc->quantized (merged across both files). Any other algorithm in the list is a layout qkeep
 * does not read: refused, naming the layer.
 */
static int modelopt_mixed(const struct modelopt_decl *d, struct quant_config *qc) {
  const struct origin at = d->at;
  if (!d->quantized_layers)
    return key_error(QKEEP_E_FORMAT, &at, "quantized_layers", "is missing (quant_algo MIXED_PRECISION)");
  struct sub_origin ol;
  descend(&ol, &at, "quantized_layers");
  size_t cap = qc->n_quantized;
  const char *layer;
  json_t *v;
  json_object_foreach((json_t *)d->quantized_layers, layer, v) {
    struct sub_origin oe;
    descend(&oe, &ol.o, layer);
    const char *algo = NULL;
    int64_t group = NVFP4_GROUP;
    if (!json_is_object(v))
      return key_error(QKEEP_E_FORMAT, &ol.o, layer, "is %s, expected an object", json_kind(v));
    int rc = get_string(&oe.o, v, "quant_algo", &algo);
    if (rc == 0)
      rc = key_error(QKEEP_E_FORMAT, &oe.o, "quant_algo", "is missing");
    if (rc < 0 || (rc = get_int(&oe.o, v, "group_size", &group)) < 0)
      return rc;
    if (strcasecmp(algo, "NVFP4") != 0)
      return key_error(QKEEP_E_UNSUPPORTED, &oe.o, "quant_algo",
                       "'%s' is not supported (qkeep reads the NVFP4 layers of a MIXED_PRECISION export)",
                       algo);
    if (group != NVFP4_GROUP)
      return key_error(QKEEP_E_FORMAT, &oe.o, "group_size", "%lld, NVFP4 needs %d", (long long)group,
                       NVFP4_GROUP);
    if ((rc = quantized_add(qc, &cap, layer)) != 0)
      return rc;
  }
  qc->mixed = true;
  return 0;
}

static int modelopt_check(const struct modelopt_decl *d) {
  const struct origin *o = &d->at;
  if (strcasecmp(d->quant_algo, "MIXED_PRECISION") == 0 && d->quantized_layers)
    return 0; /* each listed layer's algorithm is checked by modelopt_mixed */
  if (strcasecmp(d->quant_algo, "NVFP4") != 0)
    return key_error(QKEEP_E_UNSUPPORTED, o, "quant_algo",
                     "'%s' is not supported (qkeep reads ModelOpt NVFP4)", d->quant_algo);
  if (d->group_size != NVFP4_GROUP)
    return key_error(QKEEP_E_FORMAT, o, "group_size", "%lld, NVFP4 needs %d", (long long)d->group_size,
                     NVFP4_GROUP);
  return 0;
}

/* kv_cache_quant_algo: null (none) or "FP8"; the k/v scale tensors exist only for FP8. */
static int modelopt_kv_algo(const struct origin *o, const json_t *obj, bool *kv_fp8) {
  const char *kv = NULL;
  int rc = get_string(o, obj, "kv_cache_quant_algo", &kv);
  if (rc <= 0)
    return rc;
  if (strcasecmp(kv, "FP8") != 0)
    return key_error(QKEEP_E_UNSUPPORTED, o, "kv_cache_quant_algo", "'%s' is not supported (only FP8)", kv);
  *kv_fp8 = true;
  return 0;
}

/*
 * config.json's kv_cache_scheme: null, the dict compressed-tensors writes (ModelOpt from
 * 4c611e47a: {"dynamic": false, "num_bits": 8, "type": "float"}), or the algorithm as a string,
 * as ModelOpt 0.31-0.33 write "FP8" and later releases still write any algorithm but FP8. As
 * vLLM does, a string names the algorithm: only FP8 has k/v scales qkeep reads.
 */
static int modelopt_kv_scheme(const struct origin *o, const json_t *obj, bool *kv_fp8) {
  const json_t *kv = json_object_get(obj, "kv_cache_scheme");
  if (!kv || json_is_null(kv))
    return 0;
  if (json_is_object(kv)) {
    *kv_fp8 = true;
    return 0;
  }
  if (!json_is_string(kv))
    return key_error(QKEEP_E_FORMAT, o, "kv_cache_scheme", "is %s, expected an object or a string",
                     json_kind(kv));
  if (strcasecmp(json_string_value(kv), "FP8") != 0)
    return key_error(QKEEP_E_UNSUPPORTED, o, "kv_cache_scheme", "'%s' is not supported (only FP8)",
                     json_string_value(kv));
  *kv_fp8 = true;
  return 0;
}

/*
 * The "quantization" object of hf_quant_config.json ({"producer": {...},
 * "quantization": {quant_algo, kv_cache_quant_algo, group_size,
 * exclude_modules}}); `top` names the object that holds it (the file's top
 * level, or an older config.json's quantization_config).
 */
static int modelopt_read_hf(const struct origin *top, const json_t *holder, struct quant_config *qc,
                            size_t *cap, struct modelopt_decl *d) {
  const json_t *q = NULL;
  int rc = get_object(top, holder, "quantization", &q);
  if (rc < 0)
    return rc;
  if (rc == 0)
    return key_error(QKEEP_E_FORMAT, top, "quantization", "is missing");
  struct sub_origin o;
  descend(&o, top, "quantization");
  if ((rc = get_string(&o.o, q, "quant_algo", &d->quant_algo)) < 0)
    return rc;
  if (rc == 0)
    return key_error(QKEEP_E_FORMAT, &o.o, "quant_algo", "is missing");
  if ((rc = get_int(&o.o, q, "group_size", &d->group_size)) < 0)
    return rc;
  if ((rc = modelopt_kv_algo(&o.o, q, &d->kv_cache_fp8)) < 0)
    return rc;
  if ((rc = get_object(&o.o, q, "quantized_layers", &d->quantized_layers)) < 0)
    return rc;
  decl_at(d, &o.o);
  return add_ignores(qc, cap, &o.o, q, "exclude_modules");
}

/* The group size config.json states: top-level group_size, or each config_groups.*.weights.group_size. */
static int modelopt_cfg_group_size(const struct origin *o, const json_t *qcfg, int64_t *group_size) {
  int rc = get_int(o, qcfg, "group_size", group_size);
  if (rc != 0)
    return rc < 0 ? rc : 0;
  const json_t *groups = NULL;
  if ((rc = get_object(o, qcfg, "config_groups", &groups)) <= 0)
    return rc;
  struct sub_origin og;
  descend(&og, o, "config_groups");
  const char *name;
  json_t *group;
  json_object_foreach((json_t *)groups, name, group) {
    struct sub_origin ogn, ow;
    descend(&ogn, &og.o, name);
    if (!json_is_object(group))
      return key_error(QKEEP_E_FORMAT, &og.o, name, "is %s, expected an object", json_kind(group));
    const json_t *weights = NULL;
    if ((rc = get_object(&ogn.o, group, "weights", &weights)) < 0)
      return rc;
    if (rc == 0)
      continue;
    descend(&ow, &ogn.o, "weights");
    int64_t g = 0;
    if ((rc = get_int(&ow.o, weights, "group_size", &g)) < 0)
      return rc;
    if (rc == 1 && g != NVFP4_GROUP)
      return key_error(QKEEP_E_FORMAT, &ow.o, "group_size", "%lld, NVFP4 needs %d", (long long)g,
                       NVFP4_GROUP);
  }
  return 0;
}

/*
 * config.json's quantization_config {"quant_method": "modelopt", "quant_algo",
 * "ignore", "kv_cache_scheme" or "kv_cache_quant_algo", "config_groups"}, or
 * an older export that embeds hf_quant_config's "quantization" object.
 */
static int modelopt_read_config(const struct origin *o, const json_t *qcfg, struct quant_config *qc,
                                size_t *cap, struct modelopt_decl *d) {
  if (json_object_get(qcfg, "quantization") && !json_object_get(qcfg, "quant_algo"))
    return modelopt_read_hf(o, qcfg, qc, cap, d);
  int rc;
  if ((rc = get_string(o, qcfg, "quant_algo", &d->quant_algo)) < 0)
    return rc;
  if (rc == 0)
    return key_error(QKEEP_E_FORMAT, o, "quant_algo", "is missing");
  if ((rc = modelopt_cfg_group_size(o, qcfg, &d->group_size)) < 0)
    return rc;
  if ((rc = modelopt_kv_algo(o, qcfg, &d->kv_cache_fp8)) < 0)
    return rc;
  if ((rc = modelopt_kv_scheme(o, qcfg, &d->kv_cache_fp8)) < 0)
    return rc;
  if ((rc = get_object(o, qcfg, "quantized_layers", &d->quantized_layers)) < 0)
    return rc;
  decl_at(d, o);
  if ((rc = add_ignores(qc, cap, o, qcfg, "ignore")) != 0)
    return rc;
  return add_ignores(qc, cap, o, qcfg, "exclude_modules");
}

static void set_modelopt(struct quant_config *qc, bool kv_cache_fp8) {
  qc->method = QM_MODELOPT_NVFP4;
  qc->scheme = "modelopt-nvfp4";
  qc->group_size = NVFP4_GROUP;
  qc->kv_cache_fp8 = kv_cache_fp8;
}

/* ---- compressed-tensors -------------------------------------------------------------- */

/* What one config group of an int-quantized checkpoint says, reduced to the fields qkeep keeps. */
struct int8_group {
  bool weight_per_tensor;
  bool input_dynamic;
  bool input_sym;
};

/* Checks a quantization args object's num_bits and type ("int" or "float"). */
static int ct_args_kind(const struct origin *o, const json_t *args, const char *format, int64_t bits,
                        const char *type) {
  int64_t num_bits = 0;
  const char *t = NULL;
  int rc;
  if ((rc = get_int(o, args, "num_bits", &num_bits)) < 0)
    return rc;
  if (rc == 1 && num_bits != bits)
    return key_error(QKEEP_E_UNSUPPORTED, o, "num_bits",
                     "%lld is not supported with format '%s' (needs %lld)", (long long)num_bits, format,
                     (long long)bits);
  if ((rc = get_string(o, args, "type", &t)) < 0)
    return rc;
  if (rc == 1 && strcmp(t, type) != 0)
    return key_error(QKEEP_E_UNSUPPORTED, o, "type", "'%s' is not supported with format '%s' (needs '%s')", t,
                     format, type);
  return 0;
}

/* int-quantized weights: 8-bit symmetric int, per channel or per tensor, static. */
static int ct_int8_weights(const struct origin *o, const json_t *w, const char *format,
                           struct int8_group *g) {
  int rc = ct_args_kind(o, w, format, 8, "int");
  if (rc != 0)
    return rc;
  const char *strategy = NULL;
  if ((rc = get_string(o, w, "strategy", &strategy)) < 0)
    return rc;
  if (rc == 0)
    return key_error(QKEEP_E_FORMAT, o, "strategy", "is missing");
  if (strcmp(strategy, "tensor") == 0)
    g->weight_per_tensor = true;
  else if (strcmp(strategy, "channel") != 0)
    return key_error(QKEEP_E_UNSUPPORTED, o, "strategy",
                     "'%s' is not supported for int8 weights (channel, tensor)", strategy);
  bool sym = true, dynamic = false;
  if ((rc = get_bool(o, w, "symmetric", &sym)) < 0)
    return rc;
  if (!sym)
    return key_error(QKEEP_E_UNSUPPORTED, o, "symmetric", "false: asymmetric int8 weights are not supported");
  if ((rc = get_bool(o, w, "dynamic", &dynamic)) < 0)
    return rc;
  if (dynamic)
    return key_error(QKEEP_E_UNSUPPORTED, o, "dynamic", "true: int8 weights must be stored quantized");
  return 0;
}

/* int-quantized activations: 8-bit int, dynamic per token or static per tensor, either symmetry. */
static int ct_int8_inputs(const struct origin *o, const json_t *a, const char *format, struct int8_group *g) {
  int rc = ct_args_kind(o, a, format, 8, "int");
  if (rc != 0)
    return rc;
  const char *strategy = NULL;
  if ((rc = get_string(o, a, "strategy", &strategy)) < 0)
    return rc;
  if (rc == 0)
    return key_error(QKEEP_E_FORMAT, o, "strategy", "is missing");
  g->input_dynamic = false;
  g->input_sym = true;
  if ((rc = get_bool(o, a, "dynamic", &g->input_dynamic)) < 0)
    return rc;
  if ((rc = get_bool(o, a, "symmetric", &g->input_sym)) < 0)
    return rc;
  /* vLLM's W8A8 int8 has exactly these two activation schemes (_is_dynamic_token_w8a8,
   * _is_static_tensor_w8a8). */
  const char *needs = g->input_dynamic ? "token" : "tensor";
  if (strcmp(strategy, needs) != 0)
    return key_error(QKEEP_E_UNSUPPORTED, o, "strategy", "'%s' with dynamic %s is not supported (needs '%s')",
                     strategy, g->input_dynamic ? "true" : "false", needs);
  return 0;
}

static int ct_int8_group(const struct origin *o, const json_t *group, const char *format,
                         struct int8_group *g) {
  const json_t *w = NULL, *a = NULL;
  int rc = get_object(o, group, "weights", &w);
  if (rc < 0)
    return rc;
  if (rc == 0)
    return key_error(QKEEP_E_FORMAT, o, "weights", "is missing");
  struct sub_origin ow, oa;
  descend(&ow, o, "weights");
  if ((rc = ct_int8_weights(&ow.o, w, format, g)) != 0)
    return rc;
  if ((rc = get_object(o, group, "input_activations", &a)) < 0)
    return rc;
  if (rc == 0)
    return key_error(QKEEP_E_UNSUPPORTED, o, "input_activations",
                     "is missing: int8 weight-only (W8A16) is not supported");
  descend(&oa, o, "input_activations");
  return ct_int8_inputs(&oa.o, a, format, g);
}

/* The fixed group size a packed-FP4 format needs, checked against every config group's weights. */
static int ct_fp4_groups(const struct origin *og, const json_t *groups, const char *format,
                         int64_t group_size) {
  const char *name;
  json_t *group;
  json_object_foreach((json_t *)groups, name, group) {
    struct sub_origin ogn, ow;
    descend(&ogn, og, name);
    if (!json_is_object(group))
      return key_error(QKEEP_E_FORMAT, og, name, "is %s, expected an object", json_kind(group));
    const json_t *w = NULL;
    int rc = get_object(&ogn.o, group, "weights", &w);
    if (rc < 0)
      return rc;
    if (rc == 0)
      continue; /* a group without weights says nothing about their layout */
    descend(&ow, &ogn.o, "weights");
    if ((rc = ct_args_kind(&ow.o, w, format, 4, "float")) != 0)
      return rc;
    int64_t g = 0;
    if ((rc = get_int(&ow.o, w, "group_size", &g)) < 0)
      return rc;
    if (rc == 1 && g != group_size)
      return key_error(QKEEP_E_FORMAT, &ow.o, "group_size", "%lld, %s needs %lld", (long long)g,
                       group_size == NVFP4_GROUP ? "NVFP4" : "MXFP4", (long long)group_size);
  }
  return 0;
}

/* What a pack-quantized config group says about its int4 weights and activations. */
struct int4_group {
  int64_t group_size; /* 0: per channel */
  bool sym, act_order, w4a8;
};

/* actorder: null / false / "weight" / "static" store no g_idx; "group" (or true) stores weight_g_idx. */
static int ct_actorder(const struct origin *o, const json_t *w, bool *act_order) {
  const json_t *v = json_object_get(w, "actorder");
  *act_order = false;
  if (!v || json_is_null(v) || json_is_false(v))
    return 0;
  if (json_is_true(v) || (json_is_string(v) && strcmp(json_string_value(v), "group") == 0)) {
    *act_order = true;
    return 0;
  }
  if (json_is_string(v) &&
      (strcmp(json_string_value(v), "weight") == 0 || strcmp(json_string_value(v), "static") == 0))
    return 0;
  return key_error(QKEEP_E_UNSUPPORTED, o, "actorder", "%s is not supported (null, group, weight, static)",
                   json_is_string(v) ? json_string_value(v) : json_kind(v));
}

/* pack-quantized weights: 4-bit int, per group or per channel, either symmetry, stored quantized. */
static int ct_int4_weights(const struct origin *o, const json_t *w, const char *format,
                           struct int4_group *g) {
  int64_t bits = 0;
  int rc = get_int(o, w, "num_bits", &bits);
  if (rc < 0)
    return rc;
  if (rc == 1 && bits != 4)
    return key_error(QKEEP_E_UNSUPPORTED, o, "num_bits",
                     "%lld is not supported with format '%s' (only 4-bit int, W4A16 / W4A8)", (long long)bits,
                     format);
  if ((rc = ct_args_kind(o, w, format, 4, "int")) != 0)
    return rc;
  const char *strategy = NULL;
  if ((rc = get_string(o, w, "strategy", &strategy)) < 0)
    return rc;
  if (rc == 0)
    return key_error(QKEEP_E_FORMAT, o, "strategy", "is missing");
  g->group_size = 0;
  if (strcmp(strategy, "group") == 0) {
    if ((rc = get_int(o, w, "group_size", &g->group_size)) < 0)
      return rc;
    if (rc == 0 || g->group_size <= 0)
      return key_error(QKEEP_E_FORMAT, o, "group_size", "must be a positive integer for strategy 'group'");
  } else if (strcmp(strategy, "channel") != 0) {
    return key_error(QKEEP_E_UNSUPPORTED, o, "strategy",
                     "'%s' is not supported for int4 weights (group, channel)", strategy);
  }
  bool dynamic = false;
  g->sym = true;
  if ((rc = get_bool(o, w, "symmetric", &g->sym)) < 0)
    return rc;
  if ((rc = get_bool(o, w, "dynamic", &dynamic)) < 0)
    return rc;
  if (dynamic)
    return key_error(QKEEP_E_UNSUPPORTED, o, "dynamic", "true: int4 weights must be stored quantized");
  return ct_actorder(o, w, &g->act_order);
}

/* input_activations: none (W4A16) or int8 dynamic per token (W4A8). */
static int ct_int4_inputs(const struct origin *o, const json_t *a, const char *format, struct int4_group *g) {
  struct int8_group act = {0};
  int rc = ct_int8_inputs(o, a, format, &act);
  if (rc != 0)
    return rc;
  if (!act.input_dynamic || !act.input_sym)
    return key_error(QKEEP_E_UNSUPPORTED, o, "dynamic",
                     "int4 weights with static or asymmetric int8 activations are not supported (W4A8 is "
                     "dynamic, symmetric, per token)");
  g->w4a8 = true;
  return 0;
}

/* Every config group of a pack-quantized checkpoint must describe one int4 layout. */
static int ct_int4(const struct origin *og, const json_t *groups, const char *format,
                   struct quant_config *qc) {
  const char *first = NULL, *name;
  struct int4_group want = {0};
  json_t *group;
  json_object_foreach((json_t *)groups, name, group) {
    struct sub_origin ogn, ow, oa;
    descend(&ogn, og, name);
    if (!json_is_object(group))
      return key_error(QKEEP_E_FORMAT, og, name, "is %s, expected an object", json_kind(group));
    const json_t *w = NULL, *a = NULL;
    int rc = get_object(&ogn.o, group, "weights", &w);
    if (rc < 0)
      return rc;
    if (rc == 0)
      return key_error(QKEEP_E_FORMAT, &ogn.o, "weights", "is missing");
    struct int4_group g = {0};
    descend(&ow, &ogn.o, "weights");
    if ((rc = ct_int4_weights(&ow.o, w, format, &g)) != 0)
      return rc;
    if ((rc = get_object(&ogn.o, group, "input_activations", &a)) < 0)
      return rc;
    descend(&oa, &ogn.o, "input_activations");
    if (rc == 1 && (rc = ct_int4_inputs(&oa.o, a, format, &g)) != 0)
      return rc;
    if (!first) {
      first = name;
      want = g;
    } else if (g.group_size != want.group_size || g.sym != want.sym || g.act_order != want.act_order ||
               g.w4a8 != want.w4a8) {
      return key_error(QKEEP_E_UNSUPPORTED, og, NULL,
                       "'%s' and '%s' differ in group size, symmetry, actorder or activations; one int4 "
                       "layout per checkpoint is supported",
                       first, name);
    }
  }
  if (!first)
    return key_error(QKEEP_E_FORMAT, og, NULL, "is empty");
  qc->method = QM_CT_INT4;
  qc->scheme = "ct-int4";
  qc->group_size = want.group_size;
  qc->weight_sym = want.sym;
  qc->desc_act = want.act_order;
  qc->input_dynamic = want.w4a8;
  return 0;
}

/* The int8 fields all config groups agree on; groups that differ cannot be one scheme. */
static int ct_int8(const struct origin *og, const json_t *groups, const char *format,
                   struct quant_config *qc) {
  const char *first = NULL;
  struct int8_group want = {0};
  const char *name;
  json_t *group;
  json_object_foreach((json_t *)groups, name, group) {
    struct sub_origin ogn;
    descend(&ogn, og, name);
    if (!json_is_object(group))
      return key_error(QKEEP_E_FORMAT, og, name, "is %s, expected an object", json_kind(group));
    struct int8_group g = {0};
    int rc = ct_int8_group(&ogn.o, group, format, &g);
    if (rc != 0)
      return rc;
    if (!first) {
      first = name;
      want = g;
    } else if (g.weight_per_tensor != want.weight_per_tensor || g.input_dynamic != want.input_dynamic ||
               g.input_sym != want.input_sym) {
      return key_error(
          QKEEP_E_UNSUPPORTED, og, NULL,
          "'%s' and '%s' differ in weight strategy or activation scheme; one scheme per checkpoint is "
          "supported",
          first, name);
    }
  }
  if (!first)
    return key_error(QKEEP_E_FORMAT, og, NULL, "is empty");
  qc->method = QM_W8A8_INT8;
  qc->scheme = "w8a8-int8";
  qc->group_size = 0;
  qc->weight_sym = true;
  qc->weight_per_tensor = want.weight_per_tensor;
  qc->input_dynamic = want.input_dynamic;
  qc->input_sym = want.input_sym;
  return 0;
}

/*
 * The checkpoint's format: the top-level "format", or, when that is absent
 * or "mixed-precision", the one format every config group names.
 */
static int ct_format(const struct origin *o, const json_t *qcfg, const json_t *groups, const char **format) {
  int rc = get_string(o, qcfg, "format", format);
  if (rc < 0)
    return rc;
  if (rc == 1 && strcmp(*format, "mixed-precision") != 0)
    return 0;
  const char *found = NULL, *found_in = NULL;
  if (groups) {
    struct sub_origin og;
    descend(&og, o, "config_groups");
    const char *name;
    json_t *group;
    json_object_foreach((json_t *)groups, name, group) {
      struct sub_origin ogn;
      descend(&ogn, &og.o, name);
      if (!json_is_object(group))
        return key_error(QKEEP_E_FORMAT, &og.o, name, "is %s, expected an object", json_kind(group));
      const char *f = NULL;
      if ((rc = get_string(&ogn.o, group, "format", &f)) < 0)
        return rc;
      if (rc == 0)
        continue;
      if (found && strcmp(found, f) != 0)
        return key_error(QKEEP_E_UNSUPPORTED, &og.o, NULL,
                         "mix formats ('%s' in %s, '%s' in %s); one format per checkpoint is supported",
                         found, found_in, f, name);
      found = f;
      found_in = name;
    }
  }
  if (!found)
    return key_error(QKEEP_E_FORMAT, o, "format", "is missing");
  *format = found;
  return 0;
}

static int ct_parse(const struct origin *o, const json_t *qcfg, struct quant_config *qc, size_t *cap) {
  const json_t *groups = NULL, *kv = NULL;
  const char *format = NULL;
  int rc = get_object(o, qcfg, "config_groups", &groups);
  if (rc < 0)
    return rc;
  if ((rc = ct_format(o, qcfg, groups, &format)) != 0)
    return rc;
  struct sub_origin og;
  descend(&og, o, "config_groups");

  if (strcmp(format, "nvfp4-pack-quantized") == 0) {
    if (groups && (rc = ct_fp4_groups(&og.o, groups, format, NVFP4_GROUP)) != 0)
      return rc;
    qc->method = QM_CT_NVFP4;
    qc->scheme = "ct-nvfp4";
    qc->group_size = NVFP4_GROUP;
  } else if (strcmp(format, "mxfp4-pack-quantized") == 0) {
    if (groups && (rc = ct_fp4_groups(&og.o, groups, format, MXFP4_GROUP)) != 0)
      return rc;
    qc->method = QM_MXFP4;
    qc->scheme = "mxfp4";
    qc->group_size = MXFP4_GROUP;
  } else if (strcmp(format, "int-quantized") == 0 || strcmp(format, "naive-quantized") == 0) {
    if (!groups)
      return key_error(QKEEP_E_FORMAT, o, "config_groups", "is missing (format '%s' needs it)", format);
    if ((rc = ct_int8(&og.o, groups, format, qc)) != 0)
      return rc;
  } else if (strcmp(format, "pack-quantized") == 0) {
    if (!groups)
      return key_error(QKEEP_E_FORMAT, o, "config_groups", "is missing (format '%s' needs it)", format);
    if ((rc = ct_int4(&og.o, groups, format, qc)) != 0)
      return rc;
  } else {
    return key_error(QKEEP_E_UNSUPPORTED, o, "format",
                     "'%s' is not supported (compressed-tensors formats read: nvfp4-pack-quantized, "
                     "mxfp4-pack-quantized, int-quantized, naive-quantized, pack-quantized)",
                     format);
  }

  if ((rc = get_object(o, qcfg, "kv_cache_scheme", &kv)) < 0)
    return rc;
  qc->kv_cache_fp8 = rc == 1;
  return add_ignores(qc, cap, o, qcfg, "ignore");
}

/* ---- gpt-oss, GPTQ, AWQ ------------------------------------------------------------- */

static int gpt_oss_parse(const struct origin *o, const json_t *qcfg, struct quant_config *qc, size_t *cap) {
  qc->method = QM_MXFP4;
  qc->scheme = "mxfp4";
  qc->group_size = MXFP4_GROUP;
  return add_ignores(qc, cap, o, qcfg, "modules_to_not_convert");
}

/* First key of `keys` that is present (AutoAWQ writes w_bit / q_group_size, transformers bits / group_size).
 */
static int get_int_alias(const struct origin *o, const json_t *obj, const char *const keys[2], int64_t *out,
                         const char **which) {
  for (int i = 0; i < 2; i++) {
    int rc = get_int(o, obj, keys[i], out);
    if (rc != 0) {
      *which = keys[i];
      return rc;
    }
  }
  *which = keys[1];
  return 0;
}

/* bits (must be 4) and group_size (-1 per channel, stored as 0; else positive) of GPTQ and AWQ. */
static int int4_bits_group(const struct origin *o, const json_t *qcfg, const char *method,
                           struct quant_config *qc) {
  static const char *const bits_keys[2] = {"w_bit", "bits"};
  static const char *const group_keys[2] = {"q_group_size", "group_size"};
  int64_t bits = 0, group = 0;
  const char *key;
  int rc = get_int_alias(o, qcfg, bits_keys, &bits, &key);
  if (rc < 0)
    return rc;
  if (rc == 0)
    return key_error(QKEEP_E_FORMAT, o, key, "is missing");
  if (bits != 4)
    return key_error(QKEEP_E_UNSUPPORTED, o, key, "%lld is not supported for %s (only 4)", (long long)bits,
                     method);
  if ((rc = get_int_alias(o, qcfg, group_keys, &group, &key)) < 0)
    return rc;
  if (rc == 0)
    return key_error(QKEEP_E_FORMAT, o, key, "is missing");
  if (group == -1)
    group = 0;
  else if (group <= 0)
    return key_error(QKEEP_E_FORMAT, o, key, "%lld is not a group size (positive, or -1 for per channel)",
                     (long long)group);
  qc->group_size = group;
  return 0;
}

static int gptq_parse(const struct origin *o, const json_t *qcfg, struct quant_config *qc, size_t *cap) {
  int rc = int4_bits_group(o, qcfg, "gptq", qc);
  if (rc != 0)
    return rc;
  qc->weight_sym = true;
  qc->desc_act = false;
  if ((rc = get_bool(o, qcfg, "sym", &qc->weight_sym)) < 0)
    return rc;
  if ((rc = get_bool(o, qcfg, "desc_act", &qc->desc_act)) < 0)
    return rc;
  const char *fmt = NULL;
  if ((rc = get_string(o, qcfg, "checkpoint_format", &fmt)) < 0)
    return rc;
  if (rc == 1 && strcmp(fmt, "gptq_v2") == 0)
    qc->gptq_v2 = true;
  else if (rc == 1 && strcmp(fmt, "gptq") != 0)
    return key_error(QKEEP_E_UNSUPPORTED, o, "checkpoint_format", "'%s' is not supported (gptq, gptq_v2)",
                     fmt);
  /* GPTQModel's per-module rules: "-:" leaves modules unquantized, "+:" changes their layout. */
  const json_t *dynamic = NULL;
  if ((rc = get_object(o, qcfg, "dynamic", &dynamic)) < 0)
    return rc;
  if (rc == 1 && (rc = gptq_dynamic(o, dynamic, qc)) != 0)
    return rc;
  qc->method = QM_GPTQ_INT4;
  qc->scheme = "gptq-int4";
  return add_ignores(qc, cap, o, qcfg, "modules_to_not_convert");
}

static int awq_parse(const struct origin *o, const json_t *qcfg, struct quant_config *qc, size_t *cap) {
  int rc = int4_bits_group(o, qcfg, "awq", qc);
  if (rc != 0)
    return rc;
  bool zero_point = true; /* AutoAWQ's default */
  if ((rc = get_bool(o, qcfg, "zero_point", &zero_point)) < 0)
    return rc;
  qc->weight_sym = !zero_point;
  const char *version = NULL;
  if ((rc = get_string(o, qcfg, "version", &version)) < 0)
    return rc;
  if (rc == 1 && strcasecmp(version, "gemm") != 0)
    return key_error(QKEEP_E_UNSUPPORTED, o, "version", "'%s' is not supported (only the GEMM layout)",
                     version);
  qc->method = QM_AWQ_INT4;
  qc->scheme = "awq-int4";
  return add_ignores(qc, cap, o, qcfg, "modules_to_not_convert");
}

/* ---- the two files together ------------------------------------------------------------ */

/* Owned file names for messages: "WHERE/config.json", or the bare name when where is NULL or "". */
static char *file_name(const char *where, const char *file) {
  if (!where || !where[0])
    return xstrdup(file);
  size_t n = strlen(where) + strlen(file) + 2;
  char *p = malloc(n);
  if (p)
    snprintf(p, n, "%s/%s", where, file);
  return p;
}

static bool is_modelopt(const char *method) {
  return strcasecmp(method, "modelopt") == 0 || strcasecmp(method, "modelopt_fp4") == 0;
}

/* config.json's quantization_config for a method other than ModelOpt. */
static int parse_method(const struct origin *o, const char *method, const json_t *qcfg,
                        struct quant_config *qc, size_t *cap) {
  if (strcasecmp(method, "compressed-tensors") == 0)
    return ct_parse(o, qcfg, qc, cap);
  if (strcasecmp(method, "mxfp4") == 0)
    return gpt_oss_parse(o, qcfg, qc, cap);
  if (strcasecmp(method, "gptq") == 0)
    return gptq_parse(o, qcfg, qc, cap);
  if (strcasecmp(method, "awq") == 0)
    return awq_parse(o, qcfg, qc, cap);
  return key_error(
      QKEEP_E_UNSUPPORTED, o, "quant_method",
      "'%s' is not supported (qkeep reads modelopt, compressed-tensors, mxfp4, gptq and awq: the "
      "schemes modelopt-nvfp4, ct-nvfp4, mxfp4, w8a8-int8, gptq-int4, awq-int4, ct-int4)",
      method);
}

/*
 * ModelOpt from either file or both. When both declare it they must name the
 * same quant_algo (compared before either is judged, so that a contradiction
 * reads as one); the ignore lists are merged, and an FP8 KV cache declared in
 * either counts.
 */
static int parse_modelopt(const struct origin *cfg_o, const json_t *qcfg, const char *hf_file,
                          const json_t *hf_root, struct quant_config *qc, size_t *cap) {
  struct modelopt_decl from_hf = {.group_size = NVFP4_GROUP}, from_cfg = {.group_size = NVFP4_GROUP};
  struct origin hf_top = {hf_file, NULL, ""};
  int rc;
  if (hf_root && (rc = modelopt_read_hf(&hf_top, hf_root, qc, cap, &from_hf)) != 0)
    return rc;
  if (qcfg && (rc = modelopt_read_config(cfg_o, qcfg, qc, cap, &from_cfg)) != 0)
    return rc;
  if (hf_root && qcfg && strcasecmp(from_hf.quant_algo, from_cfg.quant_algo) != 0) {
    char *hf_path = origin_path(&from_hf.at), *cfg_path = origin_path(&from_cfg.at);
    rc = set_error(
        QKEEP_E_FORMAT,
        "%s says %s.quant_algo '%s' but %s says %s.quant_algo '%s'; the two files contradict each other",
        hf_file, hf_path ? hf_path : "", from_hf.quant_algo, cfg_o->file, cfg_path ? cfg_path : "",
        from_cfg.quant_algo);
    free(hf_path);
    free(cfg_path);
    return rc;
  }
  if (hf_root && (rc = modelopt_check(&from_hf)) != 0)
    return rc;
  if (qcfg && (rc = modelopt_check(&from_cfg)) != 0)
    return rc;
  bool mixed = strcasecmp((hf_root ? &from_hf : &from_cfg)->quant_algo, "MIXED_PRECISION") == 0;
  if (mixed && hf_root && (rc = modelopt_mixed(&from_hf, qc)) != 0)
    return rc;
  if (mixed && qcfg && (from_cfg.quantized_layers || !hf_root) && (rc = modelopt_mixed(&from_cfg, qc)) != 0)
    return rc;
  set_modelopt(qc, from_hf.kv_cache_fp8 || from_cfg.kv_cache_fp8);
  return 0;
}

/* Everything of config.json that is not the quantization itself: tie_word_embeddings. */
static int parse_model_fields(const char *cfg_file, const json_t *cfg_root, struct quant_config *qc) {
  struct origin top = {cfg_file, NULL, ""};
  int rc = get_bool(&top, cfg_root, "tie_word_embeddings", &qc->tie_word_embeddings);
  return rc < 0 ? rc : 0;
}

/*
 * config.json's quantization_config, or NULL. Older compressed-tensors
 * checkpoints call it compression_config (vLLM reads both); *key says which.
 */
static int find_quant_config(const char *cfg_file, const json_t *cfg_root, const json_t **qcfg,
                             const char **key) {
  static const char *const keys[] = {"quantization_config", "compression_config"};
  struct origin top = {cfg_file, NULL, ""};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
    int rc = get_object(&top, cfg_root, keys[i], qcfg);
    if (rc != 0) {
      *key = keys[i];
      return rc < 0 ? rc : 0;
    }
  }
  *qcfg = NULL;
  return 0;
}

/*
 * ModelOpt 0.31-0.33 write config.json's quantization_config without quant_method (vLLM PR
 * #19815): 0.33 says "quant_library": "modelopt", 0.31 only has the hf_quant_config.json beside
 * it, or a "producer" named modelopt. Returns 1 when qcfg is such an export, 0 when not.
 */
static int modelopt_without_method(const struct origin *o, const json_t *qcfg, bool has_hf_quant) {
  const char *library = NULL, *producer_name = NULL;
  const json_t *producer = NULL;
  int rc = get_string(o, qcfg, "quant_library", &library);
  if (rc < 0)
    return rc;
  if (rc == 1 && strcasecmp(library, "modelopt") == 0)
    return 1;
  if (rc == 1)
    return key_error(QKEEP_E_UNSUPPORTED, o, "quant_library", "'%s' is not supported (modelopt)", library);
  if ((rc = get_object(o, qcfg, "producer", &producer)) < 0)
    return rc;
  if (rc == 1) {
    struct sub_origin op;
    descend(&op, o, "producer");
    if ((rc = get_string(&op.o, producer, "name", &producer_name)) < 0)
      return rc;
  }
  bool named = producer_name && strcasecmp(producer_name, "modelopt") == 0;
  return (named || has_hf_quant) && json_object_get(qcfg, "quant_algo") ? 1 : 0;
}

/* With both files parsed (either may be NULL), works out and checks the one declaration. */
static int parse_roots(const char *cfg_file, const json_t *cfg_root, const char *hf_file,
                       const json_t *hf_root, struct quant_config *qc, size_t *cap) {
  const json_t *qcfg = NULL;
  const char *key = "quantization_config";
  int rc;
  if (cfg_root) {
    if ((rc = parse_model_fields(cfg_file, cfg_root, qc)) != 0)
      return rc;
    if ((rc = find_quant_config(cfg_file, cfg_root, &qcfg, &key)) != 0)
      return rc;
  }
  struct origin o = {cfg_file, NULL, key};
  const char *method = NULL;
  if (qcfg) {
    if ((rc = get_string(&o, qcfg, "quant_method", &method)) < 0)
      return rc;
    if (rc == 0 && (rc = modelopt_without_method(&o, qcfg, hf_root != NULL)) < 0)
      return rc;
    if (!method && rc == 1)
      method = "modelopt";
    else if (!method)
      return key_error(QKEEP_E_FORMAT, &o, "quant_method", "is missing");
  }
  if (hf_root && method && !is_modelopt(method))
    return set_error(
        QKEEP_E_FORMAT,
        "%s declares ModelOpt quantization but %s says %s.quant_method '%s'; the two files contradict "
        "each other",
        hf_file, cfg_file, key, method);
  if (hf_root || (method && is_modelopt(method)))
    return parse_modelopt(&o, qcfg, hf_file, hf_root, qc, cap);
  if (method)
    return parse_method(&o, method, qcfg, qc, cap);
  return 0; /* unquantized */
}

/*
 * Parses the two texts (see checkpoint.h). `where` is the directory both
 * files live in; messages name "WHERE/config.json" and
 * "WHERE/hf_quant_config.json". On failure *out is left unquantized with an
 * empty ignore list (safe to free) and the message names the file and key.
 */
int quant_config_parse(const char *config_json, const char *hf_quant_json, const char *where,
                       struct quant_config *out) {
  assert(out);
  *out = (struct quant_config){.method = QM_NONE, .scheme = "unquantized"};
  struct quant_config qc = *out;
  size_t cap = 0;
  json_t *cfg_root = NULL, *hf_root = NULL;
  char *cfg_file = file_name(where, "config.json");
  char *hf_file = file_name(where, "hf_quant_config.json");
  int rc = 0;
  if (!cfg_file || !hf_file)
    rc = set_error(QKEEP_E_NOMEM, "%s: out of memory", where ? where : "quantization config");
  if (rc == 0 && config_json)
    rc = parse_object(cfg_file, config_json, &cfg_root);
  if (rc == 0 && hf_quant_json)
    rc = parse_object(hf_file, hf_quant_json, &hf_root);
  if (rc == 0)
    rc = parse_roots(cfg_file, cfg_root, hf_file, hf_root, &qc, &cap);
  json_decref(cfg_root);
  json_decref(hf_root);
  free(cfg_file);
  free(hf_file);
  if (rc != 0) {
    quant_config_free(&qc);
    return rc;
  }
  *out = qc;
  return 0;
}

/* AutoAWQ's own keys, which GPTQ configs never carry. */
static bool has_awq_keys(const json_t *obj) {
  static const char *const keys[] = {"zero_point", "version", "w_bit", "q_group_size"};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
    if (json_object_get(obj, keys[i]))
      return true;
  return false;
}

/*
 * A standalone GPTQ or AWQ config file (see checkpoint.h). Its method is its
 * quant_method when it states one (AutoGPTQ from 0.7, GPTQModel, some AWQ repos);
 * else AWQ when it carries AutoAWQ's keys (zero_point, version, w_bit,
 * q_group_size: AutoAWQ before 0.1.6 wrote quant_config.json with only these);
 * else GPTQ (AutoGPTQ before 0.7 and optimum write bits, group_size, desc_act, sym).
 * On failure qc is left as it was.
 */
int quant_config_parse_standalone(const char *text, const char *where, const char *file,
                                  struct quant_config *qc) {
  assert(text && file && qc && qc->method == QM_NONE);
  char *path = file_name(where, file);
  if (!path)
    return set_error(QKEEP_E_NOMEM, "%s: out of memory", file);
  json_t *root = NULL;
  struct quant_config parsed = *qc;
  size_t cap = parsed.n_ignore;
  int rc = parse_object(path, text, &root);
  struct origin o = {path, NULL, ""};
  const char *method = NULL;
  if (!rc && (rc = get_string(&o, root, "quant_method", &method)) > 0)
    rc = 0;
  if (!rc && !method)
    method = has_awq_keys(root) ? "awq" : "gptq";
  if (!rc && strcasecmp(method, "gptq") == 0)
    rc = gptq_parse(&o, root, &parsed, &cap);
  else if (!rc && strcasecmp(method, "awq") == 0)
    rc = awq_parse(&o, root, &parsed, &cap);
  else if (!rc)
    rc = key_error(QKEEP_E_UNSUPPORTED, &o, "quant_method", "'%s' is not supported in %s (gptq, awq)", method,
                   file);
  json_decref(root);
  free(path);
  if (rc) {
    for (size_t i = qc->n_ignore; i < parsed.n_ignore; i++)
      free(parsed.ignore[i]);
    qc->ignore = parsed.ignore; /* perhaps grown, holding only qc's entries again */
    for (size_t i = qc->n_dynamic; i < parsed.n_dynamic; i++)
      free(parsed.dynamic[i].pattern);
    qc->dynamic = parsed.dynamic;
    if (parsed.matcher != qc->matcher) /* made by this parse: it holds nothing of qc's */
      ignore_matcher_free(parsed.matcher);
    return rc;
  }
  *qc = parsed;
  return 0;
}

/* Frees the ignore list and leaves qc unquantized; safe to call twice. */
void quant_config_free(struct quant_config *qc) {
  if (!qc)
    return;
  for (size_t i = 0; i < qc->n_ignore; i++)
    free(qc->ignore[i]);
  free(qc->ignore);
  for (size_t i = 0; i < qc->n_dynamic; i++)
    free(qc->dynamic[i].pattern);
  free(qc->dynamic);
  for (size_t i = 0; i < qc->n_quantized; i++)
    free(qc->quantized[i]);
  free(qc->quantized);
  ignore_matcher_free(qc->matcher);
  *qc = (struct quant_config){.method = QM_NONE, .scheme = "unquantized"};
}
