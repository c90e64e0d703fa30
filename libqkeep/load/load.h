/*
 * load/load.h: loading a layer's sources from a provider (load/load.c): host staging, the stream
 * to the layer's device, the checks of each tensor against its source and of scale values, and
 * the end of a layer's load (normalisation, then the backend's PWAL). Uses every layer below:
 * base, format, device, param, scheme, plugin, model.
 */
#ifndef QKEEP_LOAD_H
#define QKEEP_LOAD_H

#include "device/stream.h"
#include "load/online.h"
#include "model/model.h"
#include "scheme/shard_plan.h"

/* Host staging for one tensor, grown as needed; and the stream to the device being loaded. */
struct staging {
  unsigned char *data, *compare;
  size_t cap;
  struct stream *stream; /* NULL until a layer of a device with asynchronous copies loads */
  /* The layer loaded after this one from the same provider, or NULL: its bytes are read into the ring
   * while this layer's last ones are (its dst not touched before its own turn). */
  qkeep_layer *ahead;
  /* The layer whose bytes the stream reads ahead now, given by the last streamed layer (NULL: none):
   * load_read_ahead has nothing to add for it. */
  const qkeep_layer *read_ahead;
  bool own_stream;       /* made for this load (a device with no owner to keep it), freed with it */
  /* The provider's scale values were checked already (a reload's validation of W1): the load does not
   * check them again. False: it checks each scale in host memory on its way (check_scales). */
  bool scales_checked;
  /* Online quantization: the units in flight (made at the first layer that quantizes on load, freed with
   * the staging), and the layers this load goes through from the same provider, in order (NULL: only
   * the one being loaded), so that the next layer's first unit is read and quantized ahead. */
  struct online_pipe *online;
  qkeep_layer *const *order;
  size_t n_order;
  /* Online quantization on a device (load/online_device.c): one unit's unquantized bytes in the device's
   * memory, reused by the next unit (grown when it is larger), freed by staging_free. */
  void *unit_src;
  size_t unit_src_cap;
  const struct device *unit_src_dev;
  /* Where those units' time went (seconds), measured while the debug log listens; staging_free logs it. */
  size_t device_units;
  double device_stage_s, device_quantize_s;
};
/* Ends the stream (its copies waited for) and the online units in flight, then frees the rest; returns the
 * wait's error. */
int staging_free(struct staging *s);
/* Makes the staging's stream the one to dev, shaped by options (the model's): its owner's (made
 * once), else one for this load; a stream to another device is ended first. */
int staging_stream(struct staging *s, const struct device *dev, const struct qkeep_load_options *options);
/* Host bytes the staging holds now (the peak the model reports). */
size_t staging_bytes(const struct staging *s);
/* Grows both staging buffers to at least `bytes`. */
int staging_reserve(struct staging *s, size_t bytes);

/* Lands one tensor in its param as the source describes (checked against the source first); a scale's
 * host bytes are checked (check_scales) before they go to the device. */
int load_source(qkeep_layer *layer, const struct provider *pv, struct source *src, struct staging *st);
/* The param whose values the load checks the source's bytes against: a scale, written (not compared with
 * an earlier shard's), when the staging's provider was not checked already (scales_checked); else NULL. */
const qkeep_param *scale_to_check(const struct staging *st, const struct source *src);
/* Starts reading the next layer's device-bound bytes into the stream's free slots (when it goes to
 * the device being streamed to, and the current layer did not hand them to the stream already:
 * staging's read_ahead), so they arrive while the current layer's PWAL runs. Best effort. */
void load_read_ahead(qkeep_layer *next, const struct provider *pv, struct staging *st);
/* Loads every source of a layer from the provider (strided and compare-only ones too). */
int load_layer_sources(qkeep_layer *layer, const struct provider *pv, struct staging *st);
/* Checks that the provider's tensor matches what the source expects (name found, dtype, shape) and fills
 * *out. Once it held for a provider with a pass, it is remembered in src: for the same pass, later calls
 * describe the same tensor without the lookup or the checks. */
int check_source(const qkeep_layer *layer, const struct provider *pv, struct source *src,
                 struct provided *out);
/* Largest scale param that keeps a host mirror of its bytes (load.c). */
#define MIRROR_MAX 256

/*
 * The unit online_device_query took, quantized on the layer's device: its sources staged there (at most
 * one unit's, in the staging's device buffer), codes and block scales written into their params by the
 * backend, and u made with the rest (online_unit_finish); *written (malloc'd, by derived source from
 * first) then tells which sources the device wrote: those are not landed from u. *written NULL (rc 0):
 * the backend declined once the bytes were staged, nothing was written, and the host path
 * (online_unit_make) is to quantize the unit. A NaN or an Inf is refused with the host quantizer's
 * error.
 */
int online_unit_device(qkeep_layer *layer, const struct provider *pv, size_t first, size_t end,
                       struct staging *st, struct online_unit *u, bool **written);

/* Normalisation then the backend's PWAL, once a layer has all its bytes. */
int finish_layer(qkeep_layer *layer);

/* Lands a sliced source (src->slice.rows > 0) of provided tensor t in its param, or compares it
 * for a compare-only one, reading only the slice from a file (pread of row ranges; a strided
 * slice row by row, never the whole tensor); a scale's slice is checked in host memory before it
 * goes to the device (scale_to_check). on_device / on_host: the provider's bytes. */
int shard_load_slice(qkeep_layer *layer, const struct provider *pv, const struct source *src,
                     const struct provided *t, const void *on_device, const void *on_host,
                     struct staging *st);

#endif
