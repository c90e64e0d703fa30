/*
 * load/online.h: online quantization (load/online.c): a model planned from an unquantized checkpoint
 * as the checkpoint qkeep quantize would write from it, and the tensors it makes on load, one unit at
 * a time. load.c lands them (online.c uses nothing of it). Uses model, quantize and the layers below.
 */
#ifndef QKEEP_ONLINE_H
#define QKEEP_ONLINE_H

#include "model/model.h"
#include "quantize/plan.h"

/* Plans the model (empty, with quantize options set) for the unquantized checkpoint ck as the checkpoint
 * qkeep quantize would write from it: the plan is kept in model->online, layers are assembled from it, and
 * each layer's made tensors become derived sources of its unquantized sources. Nothing is allocated. */
int online_assemble(qkeep_model *model, const struct ckpt *ck);

/* One unit's made tensors (a weight, or an NVFP4 fusion group), in host memory, and a provider that
 * serves them by name (made) for load_source. */
struct online_unit {
  struct provider made;
  const char *where;
  struct quant_output *outs; /* the plan's outputs of the layer's derived sources [first, end) */
  size_t n;
  void *dst[3][4]; /* by member and slot: the quantized bytes */
  void *held[3];   /* the members' unquantized bytes, when the provider had no host copy */
  int64_t bytes;   /* host bytes it holds */
};
/* The provider's tensor of an unquantized source (a unit's member), checked against it (found, dtype, 2-D
 * shape, bytes): QKEEP_E_NOTFOUND or QKEEP_E_FORMAT naming the tensor and the layer. */
int online_member_tensor(const qkeep_layer *layer, const struct provider *pv, const struct source *src,
                         struct provided *t);
/* The end of the run of derived sources that starts at `first` (one unit: one quantization). */
size_t online_unit_end(const qkeep_layer *layer, size_t first);
/* Reads the unit's unquantized members from pv (their dtype and shape checked), quantizes them on the
 * host (quant_plan_run) into u; the layer's derived sources [first, end) then land from u->made. */
int online_unit_make(qkeep_layer *layer, const struct provider *pv, size_t first, size_t end,
                     struct online_unit *u);
/* The rest of a unit whose codes and block scales the layer's owner wrote on its device (its quantize
 * slot): the outputs that follow from the members' amax (quant_plan_finish) are made in u, and the
 * constants served; the device-written ones are in u->made too, but must not be landed from it (their
 * dst is NULL). */
int online_unit_finish(qkeep_layer *layer, const struct provider *pv, size_t first, size_t end, float amax,
                       struct online_unit *u);
void online_unit_free(struct online_unit *u);
/* Checks an unquantized source's values in pv (every one finite) before anything changes: QKEEP_E_FORMAT
 * naming the tensor, element, row, column and layer. */
int online_check_values(const qkeep_layer *layer, const struct provider *pv, struct source *src);

#endif
