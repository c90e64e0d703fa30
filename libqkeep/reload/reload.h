/*
 * reload/reload.h: reload W0 -> W1 in place (reload/reload.c) and what the weight sync
 * (reload/sync.c) shares with it. Uses load and everything below it.
 */
#ifndef QKEEP_RELOAD_H
#define QKEEP_RELOAD_H

#include "load/load.h"

/* A scale tensor whose values are to be checked: t.nbytes at `at` in dev's memory (NULL: host memory). */
struct scale_item {
  const struct device *dev;
  const void *at;
  const void *block; /* the one allocation holding it with other items (copies may span them), or NULL */
  struct provided t; /* its name, dtype, bytes and where it comes from */
  const qkeep_param *param; /* what its values must be */
  unsigned char *keep;      /* NULL, or host memory that gets a copy of the bytes checked */
};
/* Checks the values of n scale tensors with check_scales: those in host memory where they are; those in
 * device memory where they lie when the device has find_bad_values (ABI 1.6), their dtype's rule is one of
 * bytes and no `keep` wants their bytes; the others (and every one on a device that found a bad byte, to
 * name it) from one copy to the host per run of them that lie close together in one block (their one trip
 * to the host: `keep` gets the bytes checked). Sorts items by device, block and address (reload.c). 0, or
 * check_scales' error, or a copy's or the device check's error. */
int check_device_scales(struct scale_item *items, size_t n);
/* qkeep_model_reload_tensors with the allocations the tensors lie in known (a sync's bucket and the
 * blocks of tensors it kept): the scales in one are copied for their check in runs, and those in a block
 * marked checked are not checked again. */
int reload_tensors_in(qkeep_model *model, const struct qkeep_named_tensor *tensors, size_t n, unsigned flags,
                      const struct mem_block *blocks, size_t n_blocks);
/* A reload reads W1's kept scales on several threads from this many bytes on (0: the default, 256
 * KiB): a switch of qkeep__test_control (reload/test_control.h) alone. */
void reload_set_threaded_scale_bytes(size_t bytes);

#endif
