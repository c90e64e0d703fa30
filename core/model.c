/*
 * model.c: a model's layers, its device, checkpoint-name lookup, and running
 * a layer's kernel through the backend.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int qkeep_model_new(qkeep_plugin *plugin, qkeep_model **out) {
  if (!out)
    return set_error(QKEEP_E_INVAL, "qkeep_model_new: NULL out");
  qkeep_model *m = calloc(1, sizeof *m);
  if (!m)
    return set_error(QKEEP_E_NOMEM, "out of memory for a model");
  m->plugin = plugin;
  device_init(&m->dev, plugin ? plugin->be : NULL);
  *out = m;
  return 0;
}

const struct qkeep_backend *model_backend(const qkeep_model *model) {
  return model->plugin ? model->plugin->be : NULL;
}

void model_clear(qkeep_model *model) {
  const struct qkeep_backend *be = model_backend(model);
  /* Backend state first: its cleanup may still read the layer's params. */
  for (size_t i = 0; i < model->n_layers; i++) {
    qkeep_layer *layer = model->layers[i];
    if (be && be->layer_cleanup && layer->state)
      be->layer_cleanup(be, layer, layer->state);
    layer->state = NULL;
  }
  for (size_t i = 0; i < model->n_layers; i++)
    layer_destroy(model->layers[i]);
  free(model->layers);
  model->layers = NULL;
  model->n_layers = model->cap_layers = 0;
}

void qkeep_model_free(qkeep_model *model) {
  if (!model)
    return;
  model_clear(model);
  free(model);
}

size_t qkeep_model_layer_count(const qkeep_model *model) { return model ? model->n_layers : 0; }

qkeep_layer *qkeep_model_layer(const qkeep_model *model, size_t index) {
  return model && index < model->n_layers ? model->layers[index] : NULL;
}

qkeep_layer *qkeep_model_find_layer(const qkeep_model *model, const char *name) {
  if (!model || !name)
    return NULL;
  for (size_t i = 0; i < model->n_layers; i++)
    if (strcmp(model->layers[i]->name, name) == 0)
      return model->layers[i];
  return NULL;
}

qkeep_param *model_lookup_checkpoint_name(const qkeep_model *model, const char *checkpoint_name,
                                          qkeep_layer **layer_out) {
  for (size_t l = 0; l < model->n_layers; l++) {
    qkeep_layer *layer = model->layers[l];
    for (size_t i = 0; i < layer->n_sources; i++)
      if (strcmp(layer->sources[i].checkpoint_name, checkpoint_name) == 0) {
        if (layer_out)
          *layer_out = layer;
        return layer->sources[i].param;
      }
  }
  return NULL;
}

int qkeep_layer_apply_f32(qkeep_layer *layer, int64_t m, const float *x, float *y) {
  if (!layer || m < 0 || (m && (!x || !y)))
    return set_error(QKEEP_E_INVAL, "apply: invalid argument");
  const struct qkeep_backend *be = model_backend(layer->model);
  if (!be || !be->apply)
    return set_error(QKEEP_E_UNSUPPORTED, "apply %s: the model has no backend with kernels", layer->name);
  if (layer->kind != QKEEP_LAYER_LINEAR)
    return set_error(QKEEP_E_UNSUPPORTED, "apply %s: layer kind %s has no GEMM", layer->name,
                     qkeep_layer_kind_name(layer->kind));
  const struct device *dev = &layer->model->dev;
  size_t x_bytes = (size_t)m * (size_t)layer->dims.k * sizeof(float);
  size_t y_bytes = (size_t)m * (size_t)layer->dims.n * sizeof(float);
  void *dx = NULL, *dy = NULL;
  int rc = dev_alloc(dev, x_bytes, &dx);
  if (!rc)
    rc = dev_alloc(dev, y_bytes, &dy);
  if (!rc)
    rc = dev_h2d(dev, dx, x, x_bytes);
  if (!rc) {
    struct qkeep_apply_args args = {sizeof args, m, dx, QKEEP_DTYPE_F32, dy, QKEEP_DTYPE_F32};
    rc = be->apply(be, layer, &args);
  }
  if (!rc)
    rc = dev_sync(dev);
  if (!rc)
    rc = dev_d2h(dev, y, dy, y_bytes);
  dev_free(dev, dx);
  dev_free(dev, dy);
  return rc ? add_error_context(rc, "apply %s (backend %s)", layer->name, be->name) : 0;
}
