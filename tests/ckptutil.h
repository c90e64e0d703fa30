/*
 * ckptutil.h: Check helpers for suites that rewrite a good checkpoint into a bad one: read every
 * tensor of a .safetensors file into memory, find and change some, write the file again; copy a
 * checkpoint directory; and the seeded tensors of the small unquantized sources they write. Every failure is
 * a Check assertion (these run inside a test), so the callers need no error paths. tests/ckptutil.c; linked
 * by the suites that use it.
 */
#ifndef QKEEP_CKPTUTIL_H
#define QKEEP_CKPTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "qkeep/qkeep_types.h"

struct st_writer;

/* One tensor of a file: its name, dtype and shape, and its nbytes bytes (owned). */
struct tu_tensor {
  char *name;
  struct qkeep_spec spec;
  unsigned char *data;
  size_t nbytes;
};

/* Every tensor of a file, in file order (owned). */
struct tu_tensors {
  struct tu_tensor *items;
  size_t n;
};

/* Every tensor of the .safetensors file `path`. */
struct tu_tensors tu_read_tensors(const char *path);
/* Writes ts to `path` (each tensor with the bytes its spec states, read from its data) and frees
 * every tensor; *ts is left empty. */
void tu_write_tensors(struct tu_tensors *ts, const char *path);
/* The tensor named `name`, or NULL. */
struct tu_tensor *tu_find_tensor(struct tu_tensors *ts, const char *name);
/* Creates the directory `to` and copies every file of `from` (names starting with '.' left out)
 * into it. */
void tu_copy_dir(const char *from, const char *to);

/* The values of a source tensor [rows, cols] ([rows] when cols is 0), from `seed` and the name: a
 * matrix's uniform in [-0.25, 0.25), a vector's (a norm's) all 1 + 0.01 (seed % 7). malloc'd. */
float *tu_source_values(const char *name, int64_t rows, int64_t cols, uint64_t seed);
/* Adds that tensor to w as F32. */
void tu_add_source_f32(struct st_writer *w, const char *name, int64_t rows, int64_t cols, uint64_t seed);

/* Adds gpt-oss's MXFP4 tensors of one expert matrix `name` (gate_up_proj, down_proj) of a block
 * `prefix` ("model.layers.0.mlp.experts"): <name>_blocks U8 [experts, rows, cols / 32, 16],
 * <name>_scales U8 [experts, rows, cols / 32] and <name>_bias BF16 [experts, rows], from those bytes. */
void tu_add_gptoss_experts(struct st_writer *w, const char *prefix, const char *name, int64_t experts,
                           int64_t rows, int64_t cols, const uint8_t *blocks, const uint8_t *scales,
                           const uint16_t *bias);

#endif
