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
  const void *src[3]; /* by member: the unquantized bytes (the provider's own, or held) */
  void *dst[3][4];    /* by member and slot: the quantized bytes */
  void *held[3];      /* the members' unquantized bytes, when the provider had no host copy */
  int64_t bytes;      /* host bytes it holds */
};
/* The end of the run of derived sources that starts at `first` (one unit: one quantization). */
size_t online_unit_end(const qkeep_layer *layer, size_t first);

/*
 * The units a load has in flight: the one the load lands now and the next one in its order, read and
 * quantizing on a pool of threads that lives as long as the pipe (the load), so that reading the next
 * unit's unquantized bytes, landing the last one's quantized bytes and the layer's PWAL all overlap the
 * quantization. At most two units' bytes are held, never a whole layer or model. NULL: none yet (made
 * at the first take).
 */
struct online_pipe;
/*
 * The layer's unit that starts at derived source `first`, made: read from pv (its members' dtype and
 * shape checked) and quantized (load/online.c). The next unit is read and started first: the layer's
 * next one, or the first unit of the next layer in order[0 .. n_order) (the layers the load goes
 * through from the same provider, in order, `layer` among them; NULL: none) that has one. An error of
 * a unit read ahead is reported at its turn (the failed unit is then freed). *out stays the pipe's
 * until online_pipe_done.
 */
int online_pipe_take(struct online_pipe **pipe, qkeep_layer *layer, size_t first, const struct provider *pv,
                     qkeep_layer *const *order, size_t n_order, struct online_unit **out);
/* Frees the unit online_pipe_take gave (landed, or given up on). */
void online_pipe_done(struct online_pipe *pipe);
/* Host bytes the pipe's units hold now. */
int64_t online_pipe_bytes(const struct online_pipe *pipe);
/* Waits for every unit still quantizing, frees them and stops the threads; the error detail is left as
 * it was. NULL: nothing. */
void online_pipe_free(struct online_pipe *pipe);
/* Checks an unquantized source's values in pv (every one finite) before anything changes: QKEEP_E_FORMAT
 * naming the tensor, element, row, column and layer. */
int online_check_values(const qkeep_layer *layer, const struct provider *pv, struct source *src);

#endif
