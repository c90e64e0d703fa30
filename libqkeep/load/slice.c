/*
 * slice.c: landing a tensor-parallel rank's part of a checkpoint tensor in its param: only the
 * slice's byte runs are read from a file (pread of row ranges, a strided slice row by row, never
 * the whole tensor), copied from host or device buffers run by run.
 */
#include <assert.h>
#include <string.h>

#include "load/load.h"

/* ---- loading a slice ------------------------------------------------------------------------- */

/* Byte runs: rows of row_bytes, the first at offset, stride apart. */
struct runs {
  size_t offset, rows, row_bytes, stride;
};

/* One piece of a walk over two layouts of the same bytes: n bytes at offset `to` of one, `from` of the
 * other. */
typedef int (*piece_fn)(void *ctx, size_t to, size_t from, size_t n);

/* Calls fn on the pieces of the `from` runs and the `to` runs, in order, stopping at its first error; both
 * cover the same number of bytes. Pieces: at most from.rows + to.rows calls. */
static int walk_runs(const struct runs *to, const struct runs *from, piece_fn fn, void *ctx) {
  size_t fi = 0, fo = 0, ti = 0, to_at = 0;
  int rc = 0;
  assert(from->rows * from->row_bytes == to->rows * to->row_bytes);
  while (!rc && fi < from->rows && ti < to->rows) {
    size_t n = from->row_bytes - fo < to->row_bytes - to_at ? from->row_bytes - fo : to->row_bytes - to_at;
    rc = fn(ctx, to->offset + ti * to->stride + to_at, from->offset + fi * from->stride + fo, n);
    fo += n, to_at += n;
    if (fo == from->row_bytes)
      fi++, fo = 0;
    if (to_at == to->row_bytes)
      ti++, to_at = 0;
  }
  return rc;
}

enum copy_kind { COPY_H2D, COPY_D2D, COPY_D2H, COPY_HOST };
struct runs_copy {
  const struct device *dev;
  enum copy_kind kind;
  char *tb;
  const char *fb;
};

static int copy_piece(void *ctx, size_t to, size_t from, size_t n) {
  const struct runs_copy *c = ctx;
  char *d = c->tb + to;
  const char *s = c->fb + from;
  switch (c->kind) {
  case COPY_H2D: return dev_h2d(c->dev, d, s, n);
  case COPY_D2D: return dev_d2d(c->dev, d, s, n);
  case COPY_D2H: return dev_d2h(c->dev, d, s, n);
  case COPY_HOST: memcpy(d, s, n); return 0;
  }
  return 0;
}

/* Copies the bytes of `from` runs (base fb) to `to` runs (base tb) in order; both cover the same
 * number of bytes. */
static int copy_runs(const struct device *dev, enum copy_kind kind, char *tb, const struct runs *to,
                     const char *fb, const struct runs *from) {
  return walk_runs(to, from, copy_piece, &(struct runs_copy){dev, kind, tb, fb});
}

/* A scale slice in host memory, to check: its bytes lie as `in` runs from base, and are the tensor's `from`
 * runs (element numbers in messages count from the tensor's start). */
struct runs_check {
  const qkeep_param *param;
  const struct provided *t;
  const char *base;
};

static int check_piece(void *ctx, size_t in, size_t from, size_t n) {
  const struct runs_check *c = ctx;
  return check_scales(c->param, c->t, from, c->base + in, n);
}

/* Checks the slice's bytes in host memory (laid out as `in` runs from base) when the load checks the
 * source's values (scale_to_check). */
static int check_runs(const struct staging *st, const struct source *src, const struct provided *t,
                      const char *base, const struct runs *in, const struct runs *from) {
  if (!scale_to_check(st, src))
    return 0;
  return walk_runs(in, from, check_piece, &(struct runs_check){src->param, t, base});
}

/* The slice's bytes from a provider without them in memory: each run read from the file, into
 * `to` runs of host memory at base. */
static int read_runs(const struct provider *pv, const struct provided *t, const struct runs *from, char *base,
                     const struct runs *to) {
  if (!pv->read_range)
    return set_error(QKEEP_E_UNSUPPORTED, "%s: tensor '%s': the source cannot read part of a tensor",
                     pv->what, t->name);
  /* Adjacent runs (a cut of the leading dimension) are one read. */
  if (from->rows == 1 || from->stride == from->row_bytes) {
    if (to->rows == 1 || to->stride == to->row_bytes)
      return pv->read_range(pv, t, from->offset, from->rows * from->row_bytes, base + to->offset);
  }
  assert(to->row_bytes == from->row_bytes || to->rows == 1);
  int rc = 0;
  for (size_t r = 0; r < from->rows && !rc; r++) {
    size_t at = to->rows == 1 ? to->offset + r * from->row_bytes : to->offset + r * to->stride;
    rc = pv->read_range(pv, t, from->offset + r * from->stride, from->row_bytes, base + at);
  }
  return rc;
}

int shard_load_slice(qkeep_layer *layer, const struct provider *pv, const struct source *src,
                     const struct provided *t, const void *on_device, const void *on_host,
                     struct staging *st) {
  const struct device *dev = layer_device(layer);
  const struct slice *sl = &src->slice;
  const struct runs from = {sl->offset, sl->rows, sl->row_bytes, sl->stride};
  const struct runs dst = {src->dst_offset, src->rows, src->row_bytes, src->dst_stride};
  size_t bytes = sl->rows * sl->row_bytes;
  const struct runs packed = {0, 1, bytes, bytes};
  char *param = (char *)src->param->view.storage->data;
  int rc;
  if (src->compare_only) { /* the slice must equal what an earlier shard loaded there */
    if ((rc = staging_reserve(st, bytes)))
      return rc;
    if (on_device || on_host)
      rc = copy_runs(dev, on_device ? COPY_D2H : COPY_HOST, (char *)st->data, &packed,
                     on_device ? on_device : on_host, &from);
    else
      rc = read_runs(pv, t, &from, (char *)st->data, &packed);
    if (!rc)
      rc = copy_runs(dev, COPY_D2H, (char *)st->compare, &packed, param, &dst);
    if (!rc && memcmp(st->data, st->compare, bytes) != 0)
      rc = set_error(QKEEP_E_FORMAT, "%s: tensor '%s' differs from the fused shard loaded before it",
                     t->where, t->name);
    return rc;
  }
  /* A scale's host bytes are checked before they go to the device (device bytes: see load_source). */
  assert(!on_device || !scale_to_check(st, src));
  if (on_device)
    return copy_runs(dev, COPY_D2D, param, &dst, on_device, &from);
  if (on_host) {
    rc = check_runs(st, src, t, on_host, &from, &from);
    return rc ? rc : copy_runs(dev, COPY_H2D, param, &dst, on_host, &from);
  }
  /* From a file: straight into a host param when its rows are those of the slice (or one run),
   * else through staging of the slice's bytes (never the whole tensor). */
  bool host = dev->ops == host_device()->ops;
  if (host && (dst.rows == 1 || dst.stride == dst.row_bytes || dst.row_bytes == from.row_bytes)) {
    const struct runs *in =
        dst.rows == 1 || dst.stride == dst.row_bytes ? &(struct runs){dst.offset, 1, bytes, bytes} : &dst;
    rc = read_runs(pv, t, &from, param, in);
    return rc ? rc : check_runs(st, src, t, param, in, &from);
  }
  if ((rc = staging_reserve(st, bytes)) || (rc = read_runs(pv, t, &from, (char *)st->data, &packed)) ||
      (rc = check_runs(st, src, t, (const char *)st->data, &packed, &from)))
    return rc;
  return copy_runs(dev, COPY_H2D, param, &dst, (const char *)st->data, &packed);
}
