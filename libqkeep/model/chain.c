/*
 * chain.c: which backend of a model's chain owns each layer (docs/ABI.md, "The backend chain").
 *
 * A model holds an ordered chain of backends. Each layer goes to the first link whose
 * probe found its device and whose backend accepts the layer: supports_layer (ABI 1.1)
 * for every kind of layer, or for ABI 1.0 plugins supports(scheme, kind) for linear and
 * MoE layers (those plugins own every other layer that reaches them, as when a model had
 * one backend). The layer's params then live in that backend's memory. A checkpoint's
 * layers are all planned before any is given an owner, and owners are all chosen before
 * any param is allocated, so a layer that no backend takes fails the load before a byte
 * is read or allocated. A tied lm_head shares its embedding's weight param, so both go
 * to the first link that accepts both.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "qkeep/qkeep_backend_util.h"

/* supports_layer is past the end of an ABI 1.0 table. */
#define HAS_SUPPORTS_LAYER(be)                                                                               \
  ((be)->size >= offsetof(struct qkeep_backend, supports_layer) + sizeof((be)->supports_layer) &&            \
   (be)->supports_layer)

/* What a backend is asked about a layer: its dims, kind, scheme and weight dtype. */
static void layer_query(const qkeep_layer *layer, struct qkeep_layer_info *info) {
  *info = layer->dims;
  info->size = sizeof *info;
  info->name = layer->name;
  info->scheme = layer->scheme;
  info->kind = layer->kind;
  /* The first registered name is the first param created (the weight), or a tied layer's shared one. */
  const qkeep_param *first = layer->n_names ? layer->names[0].param : NULL;
  info->weight_dtype = first ? (int32_t)first->create_spec.dtype : layer->first_dtype;
}

/* Whether link o takes the layer; when not, why (NUL-terminated, at most len bytes). */
static bool accepts(const struct owner *o, const struct qkeep_layer_info *info, char *why, size_t len) {
  why[0] = '\0';
  if (o->probe_rc) {
    snprintf(why, len, "no device (%s)", o->probe_msg[0] ? o->probe_msg : qkeep_strerror(o->probe_rc));
    return false;
  }
  const struct qkeep_backend *be = o->plugin ? o->plugin->be : NULL;
  if (!be)
    return true; /* a host-memory model without backends keeps every layer */
  if (QKEEP_HAS_SLOT(be, struct qkeep_backend, supports_layer)) { /* past an ABI 1.0 table */
    int yes = be->supports_layer(be, info, why, len);
    why[len - 1] = '\0';
    if (yes == 1)
      return true;
    if (!why[0])
      snprintf(why, len, "refuses it (gave no reason)");
    return false;
  }
  if ((info->kind != QKEEP_LAYER_LINEAR && info->kind != QKEEP_LAYER_MOE) || !be->supports ||
      be->supports(be, info->scheme, info->kind))
    return true;
  snprintf(why, len, "does not run scheme %s for %s layers", info->scheme, qkeep_layer_kind_name(info->kind));
  return false;
}

/* The first link that takes every layer of group[0..n) (a layer, or an embedding and its tied
 * lm_head); SIZE_MAX when none does, with each link's reason appended to `reasons`. */
static size_t choose(const qkeep_model *model, qkeep_layer *const *group, size_t n, FILE *reasons) {
  char why[512];
  for (size_t i = 0; i < model->chain.n_owners; i++) {
    const struct owner *o = &model->chain.owners[i];
    bool all = true;
    for (size_t g = 0; g < n && all; g++) {
      struct qkeep_layer_info info;
      layer_query(group[g], &info);
      all = accepts(o, &info, why, sizeof why);
      if (!all && reasons)
        fprintf(reasons, "%s%s: %s%s%s", i ? "; " : "", o->plugin ? qkeep_plugin_name(o->plugin) : "host",
                why, n > 1 ? " (for " : "", n > 1 ? group[g]->name : "");
      if (!all && reasons && n > 1)
        fputc(')', reasons);
    }
    if (all)
      return i;
  }
  return SIZE_MAX;
}

/* Sets the owner of a layer, counting it for reports. */
static void set_owner(qkeep_layer *layer, size_t link) {
  layer->owner = &layer->model->chain.owners[link];
  layer->model->chain.owners[link].layers++;
}

/* The error for a group no link takes, with every backend's reason. */
static int refused(qkeep_layer *const *group, size_t n, const char *where) {
  const qkeep_model *model = group[0]->model;
  char *text = NULL;
  size_t len = 0;
  FILE *reasons = open_memstream(&text, &len);
  if (!reasons)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  choose(model, group, n, reasons);
  fclose(reasons);
  const qkeep_layer *l = group[0];
  int rc = set_error(QKEEP_E_UNSUPPORTED,
                     "%s%slayer %s (scheme %s, %s, N %lld, K %lld%s%s): no backend of the chain takes it: %s",
                     where ? where : "", where ? ": " : "", l->name, l->scheme,
                     qkeep_layer_kind_name(l->kind), (long long)l->dims.n, (long long)l->dims.k,
                     n > 1 ? ", tied with " : "", n > 1 ? group[1]->name : "", text ? text : "");
  free(text);
  return rc;
}

int chain_assign_layer(qkeep_layer *layer, enum qkeep_dtype first_dtype) {
  layer->first_dtype = (int32_t)first_dtype; /* the param being created is not registered yet */
  size_t link = choose(layer->model, &layer, 1, NULL);
  int rc = link == SIZE_MAX ? refused(&layer, 1, NULL) : 0;
  layer->first_dtype = -1;
  if (!rc)
    set_owner(layer, link);
  return rc;
}

/* The layer that owns a tied layer's shared weight (its embedding), or NULL. */
static qkeep_layer *tied_partner(const qkeep_layer *layer) {
  if (!(layer->dims.flags & QKEEP_LAYER_F_TIED) || !layer->n_names || !layer->names[0].param)
    return NULL;
  qkeep_layer *owner = layer->names[0].param->layer;
  return owner != layer ? owner : NULL;
}

int chain_assign(qkeep_model *model, const char *where) {
  /* An embedding shared with a tied lm_head is decided together with it. */
  qkeep_layer **tied_with = calloc(model->n_layers ? model->n_layers : 1, sizeof *tied_with);
  if (!tied_with)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  int rc = 0;
  for (size_t i = 0; i < model->n_layers; i++) {
    qkeep_layer *partner = tied_partner(model->layers[i]);
    for (size_t j = 0; partner && j < model->n_layers; j++)
      if (model->layers[j] == partner)
        tied_with[j] = model->layers[i];
  }
  for (size_t i = 0; i < model->n_layers && !rc; i++) {
    qkeep_layer *layer = model->layers[i];
    if (tied_partner(layer))
      continue; /* goes with its embedding */
    qkeep_layer *group[2] = {layer, tied_with[i]};
    size_t n = tied_with[i] ? 2 : 1;
    size_t link = choose(model, group, n, NULL);
    if (link == SIZE_MAX) {
      rc = refused(group, n, where);
      break;
    }
    set_owner(layer, link);
    if (tied_with[i])
      set_owner(tied_with[i], link);
  }
  free(tied_with);
  return rc;
}
