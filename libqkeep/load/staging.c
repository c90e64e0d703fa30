/*
 * staging.c: a load's host staging (one tensor's bytes, and a second buffer to compare a
 * compare-only source with), and the stream to the device being loaded, which the staging holds:
 * the owner's, made at its first streamed load, or one made for this load alone; and the device
 * buffer of a unit quantized on the device (load/online_device.c).
 */
#include <stdlib.h>

#include "load/load.h"

int staging_free(struct staging *s) {
  if (s->device_units)
    log_msg(QKEEP_LOG_DEBUG,
            "qkeep online: %zu units quantized on the device: %.2f ms staging them, %.2f ms in "
            "the quantize slot",
            s->device_units, s->device_stage_s * 1e3, s->device_quantize_s * 1e3);
  s->device_units = 0, s->device_stage_s = s->device_quantize_s = 0;
  int rc = stream_end(s->stream);
  online_pipe_free(s->online);
  s->online = NULL;
  if (s->own_stream)
    stream_free(s->stream);
  s->stream = NULL;
  s->own_stream = false;
  if (s->unit_src) { /* after the kernels that read it (sync), as every storage is freed */
    int synced = dev_sync(s->unit_src_dev);
    rc = rc ? rc : synced;
    dev_free(s->unit_src_dev, s->unit_src);
  }
  s->unit_src = NULL, s->unit_src_cap = 0, s->unit_src_dev = NULL;
  free(s->data);
  free(s->compare);
  s->data = s->compare = NULL;
  s->cap = 0;
  return rc;
}

/* The stream to dev in the staging: its owner's (made once), else one for this load, shaped by the
 * model's options. One to another device is ended first. */
int staging_stream(struct staging *s, const struct device *dev, const struct qkeep_load_options *options) {
  if (s->stream && stream_device(s->stream) == dev)
    return 0;
  int rc = stream_end(s->stream);
  if (s->own_stream)
    stream_free(s->stream);
  s->stream = NULL;
  s->own_stream = !dev->stream;
  struct stream **slot = dev->stream ? dev->stream : &s->stream;
  if (!rc && !*slot)
    rc = stream_new(dev, options, slot);
  if (!rc)
    s->stream = *slot;
  return rc;
}

/* Host bytes staging holds now (the peak the model reports). */
size_t staging_bytes(const struct staging *s) {
  return 2 * s->cap + stream_bytes(s->stream) + (size_t)online_pipe_bytes(s->online);
}

int staging_reserve(struct staging *s, size_t bytes) {
  if (bytes <= s->cap)
    return 0;
  unsigned char *d = realloc(s->data, bytes), *c;
  if (d)
    s->data = d;
  c = d ? realloc(s->compare, bytes) : NULL;
  if (c)
    s->compare = c;
  if (!d || !c)
    return set_error(QKEEP_E_NOMEM, "out of memory staging %zu bytes", bytes);
  s->cap = bytes;
  return 0;
}

const qkeep_param *scale_to_check(const struct staging *st, const struct source *src) {
  return src->param->scale && !src->compare_only && !st->scales_checked ? src->param : NULL;
}
