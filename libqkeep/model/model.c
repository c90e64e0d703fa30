/*
 * model.c: a model's layers, its chain and devices, and checkpoint-name lookup
 * (forward.c runs a layer's kernel).
 */
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "model/model.h"
#include "quantize/plan.h"

/* Probes one link (once per plugin); a link whose device is absent takes no layer. */
static int probe_owner(struct owner *o) {
  const char *msg = "";
  o->probe_rc = o->plugin ? plugin_probe_once(o->plugin, &msg) : 0;
  o->probe_msg = xstrdup(o->probe_rc ? msg : "");
  return o->probe_msg ? 0 : set_error(QKEEP_E_NOMEM, "out of memory for a model");
}

int qkeep_model_new_chain(qkeep_plugin *const *plugins, size_t n, qkeep_model **out) {
  if (!out || (n && !plugins))
    return set_error(QKEEP_E_INVAL, "qkeep_model_new_chain: NULL argument");
  *out = NULL;
  for (size_t i = 0; i < n; i++) {
    if (!plugins[i])
      return set_error(QKEEP_E_INVAL, "qkeep_model_new_chain: plugin %zu is NULL", i);
    for (size_t j = 0; j < i; j++)
      if (plugins[j] == plugins[i] ||
          strcmp(qkeep_plugin_name(plugins[j]), qkeep_plugin_name(plugins[i])) == 0)
        return set_error(QKEEP_E_INVAL, "qkeep_model_new_chain: backend %s is in the chain twice",
                         qkeep_plugin_name(plugins[i]));
  }
  qkeep_model *m = calloc(1, sizeof *m);
  if (m)
    m->chain.owners = calloc(n ? n : 1, sizeof *m->chain.owners);
  if (!m || !m->chain.owners) {
    free(m);
    return set_error(QKEEP_E_NOMEM, "out of memory for a model");
  }
  m->chain.n_owners = n ? n : 1; /* no plugin: one host-memory link */
  m->load_options.size = sizeof m->load_options;
  m->fault.layer = -1;
  int rc = 0;
  for (size_t i = 0; i < m->chain.n_owners && !rc; i++) {
    struct owner *o = &m->chain.owners[i];
    o->plugin = n ? plugins[i] : NULL;
    device_init(&o->dev, o->plugin ? o->plugin->be : NULL);
    o->dev.stats = &m->mem;
    o->dev.spare = &o->spare;
    o->dev.stream = &o->stream;
    o->dev.gather = &o->gather;
    rc = probe_owner(o);
  }
  if (rc) {
    qkeep_model_free(m);
    return rc;
  }
  *out = m;
  return 0;
}

int qkeep_model_new(qkeep_plugin *plugin, qkeep_model **out) {
  return qkeep_model_new_chain(plugin ? &plugin : NULL, plugin ? 1 : 0, out);
}

int model_sync(const qkeep_model *model) {
  for (size_t i = 0; i < model->chain.n_owners; i++)
    if (model->chain.owners[i].layers) {
      int rc = dev_sync(&model->chain.owners[i].dev);
      if (rc)
        return rc;
    }
  return 0;
}

void model_spares(qkeep_model *model, bool on) {
  for (size_t i = 0; i < model->chain.n_owners; i++)
    (on ? spare_begin : spare_end)(&model->chain.owners[i].dev);
}

void model_clear(qkeep_model *model) {
  /* Backend state first: its cleanup may still read the layer's params. */
  for (size_t i = 0; i < model->n_layers; i++) {
    qkeep_layer *layer = model->layers[i];
    const struct qkeep_backend *be = layer_backend(layer);
    if (be && be->layer_cleanup && layer->state)
      be->layer_cleanup(be, layer, layer->state);
    layer->state = NULL;
  }
  for (size_t i = 0; i < model->n_layers; i++)
    layer_destroy(model->layers[i]);
  free(model->layers);
  model->layers = NULL;
  model->n_layers = model->cap_layers = 0;
  for (size_t i = 0; i < model->chain.n_owners; i++)
    model->chain.owners[i].layers = 0;
  name_index_clear(&model->index.layers);
  name_index_clear(&model->index.sources);
  free(model->index.source_refs);
  model->index.source_refs = NULL;
  model->index.n_source_refs = model->index.cap_source_refs = 0;
  shard_clear(model);                  /* other ranks' tensor names (param/foreign.c) */
  quant_plan_free(model->online.plan); /* the options stay for the next load */
  model->online.plan = NULL;
  name_index_clear(&model->online.outputs);
  free(model->reload_scales.bytes); /* sized for the layers that went */
  model->reload_scales = (struct kept_scales){NULL, 0};
}

static void free_fusion(qkeep_model *model) {
  fusion_rules_free(model->fusion, model->n_fusion);
  model->fusion = NULL;
  model->n_fusion = 0;
}

void qkeep_model_free(qkeep_model *model) {
  if (!model)
    return;
  model_clear(model);
  free_fusion(model);
  free(model->online.scheme);
  free(model->source.path);
  free(model->source.ids);
  for (size_t i = 0; i < model->chain.n_owners; i++) {
    stream_free(model->chain.owners[i].stream);
    dev_free(&model->chain.owners[i].dev, model->chain.owners[i].gather);
    free(model->chain.owners[i].probe_msg);
  }
  free(model->chain.owners);
  free(model);
}

int qkeep_model_set_fusion(qkeep_model *model, const char *spec) {
  if (!model || !spec)
    return set_error(QKEEP_E_INVAL, "qkeep_model_set_fusion: NULL argument");
  struct fusion_rule *rules;
  size_t n;
  int rc = fusion_parse(spec, &rules, &n);
  if (rc)
    return rc;
  free_fusion(model);
  model->fusion = rules;
  model->n_fusion = n;
  model->fusion_set = true;
  return 0;
}

/* An option of the caller's struct, or 0 / NULL past its size. */
#define QUANTIZE_OPTION(opt, field)                                                                          \
  ((opt)->size >= offsetof(struct qkeep_quantize_options, field) + sizeof(opt)->field ? (opt)->field : 0)

int qkeep_model_set_quantize(qkeep_model *model, const struct qkeep_quantize_options *options) {
  if (!model)
    return set_error(QKEEP_E_INVAL, "qkeep_model_set_quantize: NULL model");
  if (model->n_layers)
    return set_error(QKEEP_E_STATE,
                     "qkeep_model_set_quantize: the model holds %zu layers (set it before a load)",
                     model->n_layers);
  if (!options) {
    free(model->online.scheme);
    model->online.scheme = NULL;
    model->online.set = false;
    memset(&model->online.opts, 0, sizeof model->online.opts);
    return 0;
  }
  if (!options->scheme)
    return set_error(QKEEP_E_INVAL, "qkeep_model_set_quantize: no scheme");
  /* What only a written checkpoint has: a load writes no files and reports no progress of its own. */
  const char *refused = options->max_shard_bytes                     ? "max_shard_bytes"
                        : QUANTIZE_OPTION(options, replace_existing) ? "replace_existing"
                        : QUANTIZE_OPTION(options, progress)         ? "progress"
                        : QUANTIZE_OPTION(options, summary)          ? "summary"
                        : QUANTIZE_OPTION(options, cancel)           ? "cancel"
                                                                     : NULL;
  if (refused)
    return set_error(QKEEP_E_INVAL,
                     "qkeep_model_set_quantize: '%s' is an option of qkeep_quantize's output; a load that "
                     "quantizes takes scheme, group_size, asym_weights, static_input, asym_input, "
                     "kv_cache_scales, activation_amax and threads",
                     refused);
  struct qkeep_quantize_options copy = {0};
  copy_sized(&copy, options, options->size && options->size < sizeof copy ? options->size : sizeof copy);
  copy.size = sizeof copy;
  int rc = quant_options_check(&copy);
  if (rc)
    return add_error_context(rc, "qkeep_model_set_quantize");
  char *scheme = xstrdup(options->scheme);
  if (!scheme)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  free(model->online.scheme);
  model->online.scheme = scheme;
  copy.scheme = scheme;
  model->online.opts = copy;
  model->online.set = true;
  return 0;
}

int qkeep_model_load_stats(const qkeep_model *model, struct qkeep_load_stats *out) {
  if (!model || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_model_load_stats: NULL argument");
  copy_sized(out, &model->stats, sizeof model->stats);
  return 0;
}

int qkeep_model_set_load_options(qkeep_model *model, const struct qkeep_load_options *options) {
  if (!model || !options)
    return set_error(QKEEP_E_INVAL, "qkeep_model_set_load_options: NULL argument");
  /* The caller's struct may be older (shorter): read only the size it states; absent fields are 0. */
  struct qkeep_load_options o = {0};
  memcpy(&o, options, options->size && options->size < sizeof o ? options->size : sizeof o);
  o.size = sizeof o;
  int rc = stream_options_check(&o);
  if (rc)
    return add_error_context(rc, "qkeep_model_set_load_options");
  const struct qkeep_load_options *was = &model->load_options;
  bool reshaped = o.stream_slots != was->stream_slots || o.stream_piece != was->stream_piece ||
                  o.stream_readers != was->stream_readers || o.stream_no_fences != was->stream_no_fences;
  model->load_options = o;
  /* A ring of another shape goes (its pinned memory with it); the next load that streams makes one
   * of the new shape. */
  for (size_t i = 0; i < model->chain.n_owners && reshaped; i++) {
    stream_free(model->chain.owners[i].stream);
    model->chain.owners[i].stream = NULL;
  }
  return 0;
}

int qkeep_model_memory(qkeep_model *model, struct qkeep_memory_stats *out, bool reset_peaks) {
  if (!model || !out)
    return set_error(QKEEP_E_INVAL, "qkeep_model_memory: NULL argument");
  int64_t pinned = 0;
  for (size_t i = 0; i < model->chain.n_owners; i++)
    pinned += (int64_t)stream_bytes(model->chain.owners[i].stream);
  struct qkeep_memory_stats m = {.size = sizeof m,
                                 .storage_bytes = model->mem.storage_bytes,
                                 .storage_peak = model->mem.storage_peak,
                                 .staging_peak = model->mem.staging_peak,
                                 .pinned_bytes = pinned,
                                 .kept_scale_bytes = (int64_t)model->reload_scales.cap};
  copy_sized(out, &m, sizeof m);
  if (reset_peaks) {
    model->mem.storage_peak = model->mem.storage_bytes;
    model->mem.staging_peak = 0;
  }
  return 0;
}

void qkeep_model_set_progress(qkeep_model *model,
                              void (*fn)(void *user, size_t done, size_t total, const char *layer),
                              void *user) {
  model->progress = fn;
  model->progress_user = user;
}

size_t qkeep_model_layer_count(const qkeep_model *model) { return model ? model->n_layers : 0; }

qkeep_layer *qkeep_model_layer(const qkeep_model *model, size_t index) {
  return model && index < model->n_layers ? model->layers[index] : NULL;
}

qkeep_layer *qkeep_model_find_layer(const qkeep_model *model, const char *name) {
  size_t at;
  if (!model || !name || !name_index_get(&model->index.layers, name, &at))
    return NULL;
  return model->layers[at];
}

const struct source_ref *model_find_source(const qkeep_model *model, const char *name) {
  size_t at;
  return name_index_get(&model->index.sources, name, &at) ? &model->index.source_refs[at] : NULL;
}

int model_source_prepare(const char *path, const struct ckpt *ck, struct model_source *out) {
  *out = (struct model_source){0};
  size_t n = path && ck ? ck->n_files : 0;
  if (path && !(out->path = xstrdup(path)))
    return set_error(QKEEP_E_NOMEM, "out of memory");
  if (n && !(out->ids = malloc(n * sizeof *out->ids))) {
    model_source_discard(out);
    return set_error(QKEEP_E_NOMEM, "out of memory");
  }
  for (size_t f = 0; f < n; f++) /* as opened: before the header or any tensor was read */
    out->ids[f] = ck->files[f]->opened;
  out->n = n;
  return 0;
}

void model_source_take(qkeep_model *model, struct model_source *src) {
  free(model->source.path);
  free(model->source.ids);
  model->source = *src;
  *src = (struct model_source){0};
}

void model_source_discard(struct model_source *src) {
  free(src->path);
  free(src->ids);
  *src = (struct model_source){0};
}

int model_set_source(qkeep_model *model, const char *path, const struct ckpt *ck) {
  struct model_source src;
  int rc = model_source_prepare(path, ck, &src);
  if (!rc)
    model_source_take(model, &src);
  return rc;
}

int model_source_copy(const qkeep_model *model, struct model_source *out) {
  *out = (struct model_source){0};
  if (!model->source.path)
    return 0;
  size_t n = model->source.n;
  out->path = xstrdup(model->source.path);
  out->ids = n ? malloc(n * sizeof *out->ids) : NULL;
  if (!out->path || (n && !out->ids)) {
    model_source_discard(out);
    return set_error(QKEEP_E_NOMEM, "out of memory");
  }
  if (n)
    memcpy(out->ids, model->source.ids, n * sizeof *out->ids);
  out->n = n;
  return 0;
}

int model_source_unchanged(const qkeep_model *model, const struct ckpt *ck) {
  return source_matches(&model->source, ck);
}

int source_matches(const struct model_source *src, const struct ckpt *ck) {
  if (ck->n_files != src->n)
    return set_error(QKEEP_E_STATE, "%s now has %zu weight files, %zu when the model read it", ck->path,
                     ck->n_files, src->n);
  for (size_t f = 0; f < ck->n_files; f++) {
    struct st_identity now;
    int rc = st_identity_now(ck->files[f], &now);
    if (rc)
      return rc;
    if (memcmp(&now, &src->ids[f], sizeof now) != 0)
      return set_error(QKEEP_E_STATE,
                       "%s changed since the model read it (another file, or written to: its inode, size or "
                       "times differ)",
                       ck->files[f]->path);
  }
  return 0;
}

int source_read_whole(const struct model_source *src, const struct ckpt *ck, const char *what) {
  if (!source_matches(src, ck))
    return 0;
  char *why = xstrdup(qkeep_errmsg());
  int rc = set_error(QKEEP_E_IO, "%s; %s read a mix of its old and new bytes and is refused",
                     why ? why : "a weight file changed while it was read", what);
  free(why);
  return rc;
}

int qkeep_layer_add(qkeep_model *model, const char *name, enum qkeep_layer_kind kind, const char *scheme,
                    qkeep_layer **out) {
  if (!model || !name || !*name || (unsigned)kind >= QKEEP_LAYER_KIND_COUNT)
    return set_error(QKEEP_E_INVAL, "qkeep_layer_add: invalid argument");
  if (qkeep_model_find_layer(model, name))
    return set_error(QKEEP_E_EXISTS, "layer '%s' already exists", name);
  int rc =
      grow_array((void **)&model->layers, &model->cap_layers, model->n_layers + 1, sizeof *model->layers);
  if (rc)
    return rc;
  qkeep_layer *layer = calloc(1, sizeof *layer);
  if (!layer)
    return set_error(QKEEP_E_NOMEM, "out of memory for layer '%s'", name);
  layer->model = model;
  layer->kind = kind;
  layer->name = xstrdup(name);
  layer->scheme = xstrdup(scheme ? scheme : "unquantized");
  if (!layer->name || !layer->scheme) {
    layer_destroy(layer);
    return set_error(QKEEP_E_NOMEM, "out of memory for layer '%s'", name);
  }
  layer->dims.size = sizeof layer->dims;
  layer->dims.name = layer->name;
  layer->dims.scheme = layer->scheme;
  layer->dims.kind = kind;
  layer->dims.shards = 1;
  layer->first_dtype = -1;
  if ((rc = name_index_put(&model->index.layers, layer->name, model->n_layers, NULL)) != 0) {
    layer_destroy(layer);
    return rc;
  }
  model->layers[model->n_layers++] = layer;
  if (out)
    *out = layer;
  return 0;
}

const char *qkeep_layer_backend(const qkeep_layer *layer) {
  const struct qkeep_backend *be = layer ? layer_backend(layer) : NULL;
  return be ? be->name : NULL;
}

size_t qkeep_model_backend_count(const qkeep_model *model) { return model ? model->chain.n_owners : 0; }

int qkeep_model_backend_info(const qkeep_model *model, size_t index, struct qkeep_chain_info *out) {
  if (!model || !out || index >= model->chain.n_owners)
    return set_error(QKEEP_E_INVAL, "qkeep_model_backend_info: no link %zu", index);
  const struct owner *o = &model->chain.owners[index];
  struct qkeep_chain_info info = {.size = sizeof info,
                                  .name = o->plugin ? qkeep_plugin_name(o->plugin) : "host",
                                  .usable = o->probe_rc == 0,
                                  .probe_message = o->probe_msg,
                                  .layers = o->layers};
  copy_sized(out, &info, sizeof info);
  return 0;
}

qkeep_param *qkeep_model_lookup(const qkeep_model *model, const char *checkpoint_name,
                                qkeep_layer **layer_out) {
  if (!model || !checkpoint_name)
    return NULL;
  const struct source_ref *ref = model_find_source(model, checkpoint_name);
  if (!ref)
    return NULL;
  if (layer_out)
    *layer_out = ref->layer;
  return ref->layer->sources[ref->source].param;
}

int qkeep_param_create(qkeep_layer *layer, const char *name, const struct qkeep_spec *spec,
                       qkeep_param **out) {
  int rc = layer_param_check(layer, name, spec);
  /* A hand-built layer's owner is chosen at its first param, by that param's dtype. */
  if (!rc && !layer->owner && (rc = chain_assign_layer(layer, spec->dtype)))
    return add_error_context(rc, "%s.%s", layer->name, name);
  return rc ? rc : layer_param_create(layer, name, spec, out);
}

int model_materialise(qkeep_model *model) {
  int rc = 0;
  bool *covered = NULL;
  size_t cap = 0;
  /* Every owner is known: only now does any param get memory. */
  for (size_t i = 0; i < model->n_layers && !rc; i++) {
    qkeep_layer *layer = model->layers[i];
    if (layer->n_params > cap) {
      bool *grown = realloc(covered, layer->n_params * sizeof *covered);
      if (!grown) {
        rc = set_error(QKEEP_E_NOMEM, "out of memory");
        break;
      }
      covered = grown, cap = layer->n_params;
    }
    rc = layer_find_covered(layer, covered);
    /* planned without storage: in the owner's memory, zero-filled unless its sources write all of it */
    for (size_t p = 0; p < layer->n_params && !rc; p++) {
      qkeep_param *param = layer->params[p];
      if (!param->view.storage)
        rc = (covered[p] ? storage_new_unfilled : storage_new)(layer_device(layer), param->create_bytes,
                                                               &param->view.storage);
    }
    if (rc)
      rc = add_error_context(rc, "layer %s (backend %s)", layer->name,
                             layer_backend(layer) ? layer_backend(layer)->name : "host");
  }
  free(covered);
  return rc;
}
