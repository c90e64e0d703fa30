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
/* The provider's tensor of an unquantized source (a unit's member), checked against it (found, dtype, 2-D
 * shape, bytes): QKEEP_E_NOTFOUND or QKEEP_E_FORMAT naming the tensor and the layer. */
int online_member_tensor(const qkeep_layer *layer, const struct provider *pv, const struct source *src,
                         struct provided *t);
/* The end of the run of derived sources that starts at `first` (one unit: one quantization). */
size_t online_unit_end(const qkeep_layer *layer, size_t first);

/*
 * Whether the layer's owner quantizes the unit of the layer's derived sources [first, end) on its device
 * (the backend's quantize slot, ABI 1.5, asked with no values; the plan's scheme one a device may
 * quantize, and every output of the device's landing whole in its param): 1 taken, 0 the host path, or
 * the slot's error. Asked once per unit, before anything of the unit is read (the pipe, as the unit enters
 * it; load/online_device.c).
 */
int online_device_query(qkeep_layer *layer, size_t first, size_t end);
/* The type of online_device_query, as the pipe takes it (the pipe's file does not call into the device
 * path's: the load hands it over). */
typedef int (*online_query_fn)(qkeep_layer *layer, size_t first, size_t end);

/*
 * The units a load has in flight: the one the load lands now and the next one in its order, read and
 * quantizing on a pool of threads that lives as long as the pipe (the load), so that reading the next
 * unit's unquantized bytes, landing the last one's quantized bytes and the layer's PWAL all overlap the
 * quantization. At most two units' bytes are held, never a whole layer or model. NULL: none yet (made
 * at the first take).
 */
struct online_pipe;
/* The unit after [first, end) of layer in the load's order: the layer's next, or the first of the next
 * layer in order that makes tensors on load (the pipe keeps where in the order it last looked);
 * *between: the layers in order between the two (0 within one layer). False: none. */
bool online_pipe_next(struct online_pipe *pipe, qkeep_layer *layer, size_t end, qkeep_layer *const *order,
                      size_t n_order, qkeep_layer **next, size_t *first, size_t *between);
/*
 * The layer's unit that starts at derived source `first`, made: read from pv (its members' dtype and
 * shape checked) and quantized (load/online.c). The next unit is read and started first: the layer's
 * next one, or the first unit of the next layer in order[0 .. n_order) (the layers the load goes
 * through from the same provider, in order, `layer` among them; NULL: none) that has one. An error of
 * a unit read ahead is reported at its turn (the failed unit is then freed). *out stays the pipe's
 * until online_pipe_done. A unit the layer's owner quantizes on its device (`query`, asked as the unit
 * enters the pipe: online_device_query, passed by the load, which sits above both files) is not read:
 * *out is NULL (rc 0), and the caller makes it with online_unit_device, then calls online_pipe_done as
 * for any other. query NULL: every unit is read and quantized here.
 */
int online_pipe_take(struct online_pipe **pipe, qkeep_layer *layer, size_t first, const struct provider *pv,
                     qkeep_layer *const *order, size_t n_order, online_query_fn query,
                     struct online_unit **out);
/* Frees the unit online_pipe_take gave (landed, or given up on). */
void online_pipe_done(struct online_pipe *pipe);
/* Host bytes the pipe's units hold now. */
int64_t online_pipe_bytes(const struct online_pipe *pipe);
/* Waits for every unit still quantizing, frees them and stops the threads; the error detail is left as
 * it was. NULL: nothing. */
void online_pipe_free(struct online_pipe *pipe);
/* Reads the unit's unquantized members from pv (their dtype and shape checked), quantizes them on the
 * host (on the pipe's pool, waited for) into u; the layer's derived sources [first, end) then land from
 * u->made. Outside the pipe's order: a unit the device path gives back (declined once staged, or refused
 * for its values). */
int online_unit_make(struct online_pipe *pipe, qkeep_layer *layer, const struct provider *pv, size_t first,
                     size_t end, struct online_unit *u);
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
/* Unquantized sources in files, of many layers, whose values one threaded pass checks: each one's layer,
 * source and tensor, in the order listed. Zero-initialised; online_value_checks_run empties it. */
struct online_value_checks {
  const qkeep_layer **layer;
  struct source **src;
  struct provided *t;
  size_t n, cap;
};
/* online_check_values for every unquantized source of the layer: those pv holds in device memory on a
 * device with find_bad_values (ABI 1.6) in one call there (a bad one then named from a host copy); those
 * in files listed in `later`, for online_value_checks_run; the rest read here. */
int online_check_layer_values(const qkeep_layer *layer, const struct provider *pv,
                              struct online_value_checks *later);
/* Checks every source listed in c by pieces on up to 16 threads (a model's bf16 weights in one pass, not
 * a few pieces per layer): the first bad one in list order named as online_check_values names it. Frees
 * the list, also on an error. */
int online_value_checks_run(struct online_value_checks *c, const struct provider *pv);
void online_value_checks_free(struct online_value_checks *c);

#endif
