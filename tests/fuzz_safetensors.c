// clang-format off
/*
 * fuzz_safetensors.c: libFuzzer target for the safetensors reader. Not built
 * by default. Build it from the source root with one line:
 *
 *   clang -std=c11 -D_GNU_SOURCE -g -O1 -fsanitize=fuzzer,address,undefined -I libqkeep -I . -DPACKAGE_VERSION='"fuzz"' tests/fuzz_safetensors.c libqkeep/format/safetensors.c libqkeep/base/util.c libqkeep/base/error.c libqkeep/base/dtype.c libqkeep/base/name_index.c libqkeep/base/json_scan.c $(pkg-config --cflags --libs jansson libxxhash) -o fuzz_safetensors
 *
 * then run `./fuzz_safetensors -max_len=4096 CORPUS_DIR` (any small
 * .safetensors files make a good seed corpus).
 *
 * Each input is written to a temporary file, opened with st_open and, when
 * that succeeds, every tensor is read with st_read and compared with the
 * input. Rejecting an input is fine; crashing, leaking or reading out of
 * bounds is not.
 */
// clang-format on
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "private.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* One temporary file per process, rewritten for every input and removed at exit. */
static char tmp_path[64];

static void remove_tmp(void) {
  if (tmp_path[0])
    unlink(tmp_path);
}

/* Replaces the temporary file's contents with the input; 0 on success. */
static int write_input(const uint8_t *data, size_t size) {
  if (!tmp_path[0]) {
    const char *tmpdir = getenv("TMPDIR");
    snprintf(tmp_path, sizeof tmp_path, "%s/qkeep-fuzz-st-XXXXXX",
             tmpdir && strlen(tmpdir) < 32 ? tmpdir : "/tmp");
    int fd = mkstemp(tmp_path);
    if (fd < 0) {
      perror("mkstemp");
      abort();
    }
    close(fd);
    atexit(remove_tmp);
  }
  FILE *f = fopen(tmp_path, "wb");
  if (!f)
    return -1;
  size_t written = size ? fwrite(data, 1, size, f) : 0;
  return (fclose(f) == 0 && written == size) ? 0 : -1;
}

/* Opens the input as a safetensors file and reads every tensor it declares. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (write_input(data, size) != 0)
    abort();
  struct st_file *f = NULL;
  if (st_open(tmp_path, &f) != 0) {
    if (f != NULL || qkeep_errmsg()[0] == '\0')
      abort(); /* a failure must leave *out NULL and explain itself */
    return 0;
  }
  for (size_t i = 0; i < f->n_tensors; i++) {
    const struct st_tensor *t = &f->tensors[i];
    /* A valid file holds every tensor's bytes, so nbytes is bounded by the input size. */
    if (t->nbytes > size || t->offset + t->nbytes > size || st_find(f, t->name) != t)
      abort();
    void *buf = malloc(t->nbytes ? t->nbytes : 1);
    if (!buf)
      abort();
    if (st_read(f, t, buf) != 0 || memcmp(buf, data + t->offset, t->nbytes) != 0)
      abort();
    free(buf);
  }
  for (size_t i = 0; i < f->n_metadata; i++)
    if (st_metadata(f, f->metadata_keys[i]) == NULL)
      abort();
  st_close(f);
  return 0;
}
