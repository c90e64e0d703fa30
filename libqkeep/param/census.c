/*
 * census.c: counts a model against the lifecycle rules (docs/RULES.md):
 * loader params still registered as the same object, C1 (capacity never
 * below checkpoint bytes), C2 (no two objects share bytes), aliases,
 * retired and released params, and the bytes no kernel reads.
 */
#include <stdlib.h>
#include <string.h>

#include "param/param.h"

/* One object's byte range in one device's memory, for the C2 sweep. */
struct range {
  uintptr_t device; /* addresses of two devices of a chain may coincide: compare within one */
  uintptr_t begin, end;
  const void *object;
};

static int by_begin(const void *a, const void *b) {
  const struct range *x = a, *y = b;
  if (x->device != y->device)
    return x->device < y->device ? -1 : 1;
  return x->begin < y->begin ? -1 : x->begin > y->begin;
}

static int add_range(struct range **ranges, size_t *n, size_t *cap, const struct storage *s,
                     const void *object) {
  if (!s || !s->capacity)
    return 0;
  int rc = grow_array((void **)ranges, cap, *n + 1, sizeof **ranges);
  if (!rc)
    (*ranges)[(*n)++] =
        (struct range){(uintptr_t)s->dev->ops, (uintptr_t)s->data, (uintptr_t)s->data + s->capacity, object};
  return rc;
}

/* One stable counting pass of the LSD sort: by the byte of `key` at `shift`; false when every range has the
 * same byte there (nothing to do). */
static bool radix_pass(const struct range *from, struct range *to, size_t n, bool device, int shift) {
  size_t count[257] = {0};
#define RANGE_BYTE(x) ((unsigned)(((device ? (x).device : (x).begin) >> shift) & 0xff))
  for (size_t i = 0; i < n; i++)
    count[RANGE_BYTE(from[i]) + 1]++;
  if (count[RANGE_BYTE(from[0]) + 1] == n)
    return false;
  for (int b = 0; b < 256; b++)
    count[b + 1] += count[b];
  for (size_t i = 0; i < n; i++)
    to[count[RANGE_BYTE(from[i])]++] = from[i];
#undef RANGE_BYTE
  return true;
}

/*
 * Sorts the ranges by device, then begin: an LSD radix sort (bytes of begin,
 * then of device, each pass stable), linear in n where qsort's n log n was
 * most of a census of 10^5 params; small inputs go to qsort.
 */
static int sort_ranges(struct range *r, size_t n) {
  if (n < 256) {
    if (n > 1) /* qsort needs a non-NULL base even for 0 elements (an empty model has none) */
      qsort(r, n, sizeof *r, by_begin);
    return 0;
  }
  struct range *tmp = malloc(n * sizeof *tmp), *from = r, *to = tmp;
  if (!tmp)
    return set_error(QKEEP_E_NOMEM, "out of memory for the census");
  for (int key = 0; key < 2; key++)
    for (int shift = 0; shift < 64; shift += 8)
      if (radix_pass(from, to, n, key == 1, shift)) {
        struct range *t = from;
        from = to, to = t;
      }
  if (from != r)
    memcpy(r, from, n * sizeof *r);
  free(tmp);
  return 0;
}

/* Pairs of distinct objects whose byte ranges overlap (sorted by sort_ranges; one sweep). */
static int64_t count_overlaps(struct range *r, size_t n) {
  int64_t pairs = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = i + 1; j < n && r[j].device == r[i].device && r[j].begin < r[i].end; j++)
      if (r[j].object != r[i].object)
        pairs++;
  return pairs;
}

static void note_reason(struct qkeep_census *c, const char *reason) {
  for (int i = 0; i < c->reasons; i++)
    if (strcmp(c->reason[i], reason) == 0)
      return;
  if (c->reasons < QKEEP_CENSUS_MAX_REASONS)
    c->reason[c->reasons++] = reason;
}

int qkeep_census(const qkeep_model *model, struct qkeep_census *out) {
  if (!model || !out)
    return set_error(QKEEP_E_INVAL, "census: NULL argument");
  struct qkeep_census c = {.size = sizeof c};
  struct range *ranges = NULL;
  size_t n_ranges = 0, cap_ranges = 0;
  int rc = 0;
  for (size_t l = 0; l < model->n_layers && !rc; l++) {
    const qkeep_layer *layer = model->layers[l];
    int64_t param_names = 0;
    for (size_t i = 0; i < layer->n_names; i++)
      param_names += layer->names[i].param != NULL;
    c.aliases += param_names - (int64_t)layer->n_params;
    for (size_t i = 0; i < layer->n_params && !rc; i++) {
      const qkeep_param *p = layer->params[i];
      const struct storage *s = p->view.storage;
      c.loader_params++;
      struct name_entry *e = layer_find_name(layer, p->checkpoint_name);
      c.registered_same += e && e->param == p;
      if (p->state == QKEEP_PARAM_RELEASED) {
        c.released++;
        c.released_bytes += (int64_t)p->create_bytes;
        note_reason(&c, p->release_reason);
        continue;
      }
      if (!s || s->capacity < p->create_bytes)
        c.c1++;
      if (!s)
        continue;
      if (p->state == QKEEP_PARAM_RETIRED) {
        c.retired++;
        c.retired_bytes += (int64_t)s->capacity;
        c.kept_bytes += (int64_t)s->capacity;
      } else {
        c.kept_bytes += (int64_t)(s->capacity - qkeep_spec_bytes(&p->view.spec));
      }
      rc = add_range(&ranges, &n_ranges, &cap_ranges, s, p);
    }
    for (size_t i = 0; i < layer->n_online_params; i++) { /* no storage: nothing kept, nothing shared */
      c.quantized_on_load++;
      c.quantized_on_load_bytes += (int64_t)layer->online_params[i]->create_bytes;
    }
    for (size_t i = 0; i < layer->n_buffers && !rc; i++) {
      c.buffers++;
      rc = add_range(&ranges, &n_ranges, &cap_ranges, layer->buffers[i]->view.storage, layer->buffers[i]);
    }
  }
  if (!rc)
    rc = sort_ranges(ranges, n_ranges);
  if (!rc) {
    c.missing = c.loader_params - c.registered_same;
    c.c2 = count_overlaps(ranges, n_ranges);
    /* Distinct storages: equal ranges belong to one storage (C2 already counted the sharing). */
    for (size_t i = 0; i < n_ranges; i++)
      if (i == 0 || ranges[i].begin != ranges[i - 1].begin)
        c.total_bytes += (int64_t)(ranges[i].end - ranges[i].begin);
    c.kept_share = c.total_bytes ? (double)c.kept_bytes / (double)c.total_bytes : 0.0;
    copy_sized(out, &c, sizeof c);
  }
  free(ranges);
  return rc;
}
