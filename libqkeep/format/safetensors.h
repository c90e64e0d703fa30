/*
 * format/safetensors.h: reading (safetensors.c) and writing (safetensors_write.c) .safetensors
 * files. Uses base.
 */
#ifndef QKEEP_SAFETENSORS_H
#define QKEEP_SAFETENSORS_H

#include "base/base.h"

/* ---- safetensors (safetensors.c) ------------------------------------------------------ */

/* One tensor of a safetensors file as its header describes it. */
struct st_tensor {
  char *name;
  char dtype_name[16]; /* the header's dtype string, e.g. "F8_E4M3" */
  int dtype;           /* enum qkeep_dtype, or -1 for a valid safetensors dtype qkeep does not use */
  int ndim;
  int64_t shape[QKEEP_MAX_DIMS]; /* the header's shape, or, when it does not fit a qkeep_spec, collapsed */
  /* NULL when the shape fits a qkeep_spec; else the header's own shape (full_ndim dims), kept for
   * validation and the digest. Collapsed: a zero-element tensor is [0]; otherwise the leading dims
   * merge so that the last QKEEP_MAX_DIMS - 1 stay as they are. */
  uint64_t *full_shape;
  int full_ndim;
  uint64_t offset; /* absolute byte offset in the file */
  uint64_t nbytes;
};

/* A file's identity: a rewrite in place (same size) moves the change time, which no user can set
 * back; a new file has another inode. Times at the file system's granularity. */
struct st_identity {
  uint64_t dev, ino, size;
  int64_t mtime_s, mtime_ns, ctime_s, ctime_ns;
};

struct st_file {
  char *path;
  int fd;
  struct st_identity opened; /* as st_open found it, before it read the header */
  uint64_t file_size;
  uint64_t header_len;
  size_t n_tensors;
  struct st_tensor *tensors; /* sorted by name */
  struct name_index index;   /* tensors[i].name -> i */
  size_t n_metadata;
  char **metadata_keys; /* __metadata__, in header order */
  char **metadata_values;
};

/*
 * Opens and validates a .safetensors file strictly (docs/FORMATS.md, 1.1): header
 * length, UTF-8 JSON object, known dtypes, shape x dtype = bytes, offsets
 * contiguous from 0 without gaps or overlaps, no trailing bytes, no duplicate
 * names, __metadata__ values strings. Errors name the path and the tensor.
 * The caller owns *out (st_close).
 */
int st_open(const char *path, struct st_file **out);
void st_close(struct st_file *f);
/* The open file's identity now (fstat); QKEEP_E_IO naming the file. Compare with f->opened: equal
 * means nothing was written to it since st_open (to the file system's time granularity). */
int st_identity_now(const struct st_file *f, struct st_identity *out);
/* The tensor of that name, or NULL; O(1) expected. */
const struct st_tensor *st_find(const struct st_file *f, const char *name);
/* Metadata value for key, or NULL. */
const char *st_metadata(const struct st_file *f, const char *key);
/*
 * Reads a tensor's bytes into dst (nbytes of it) with pread. A file that
 * shrank or changed since st_open gives QKEEP_E_IO naming path and tensor;
 * never a signal.
 */
int st_read(const struct st_file *f, const struct st_tensor *t, void *dst);
/* Reads bytes [offset, offset + n) of the tensor (within it) into dst; the checks and errors are st_read's.
 */
int st_read_range(const struct st_file *f, const struct st_tensor *t, size_t offset, size_t n, void *dst);
/*
 * Reads n tensors of f (tensors[i]'s bytes into dsts[i]), each run of tensors
 * that lie back to back in the file with one preadv; the errors are st_read's.
 */
int st_read_many(const struct st_file *f, const struct st_tensor *const *tensors, void *const *dsts,
                 size_t n);

/* Builds a safetensors file in memory, then writes it. */
struct st_writer;
int st_writer_new(struct st_writer **out);
void st_writer_free(struct st_writer *w);
/* Adds a tensor; data (spec's bytes) is copied. Names must be unique. */
int st_writer_add(struct st_writer *w, const char *name, const struct qkeep_spec *spec, const void *data);
/* Adds a __metadata__ entry (both strings copied). */
int st_writer_set_metadata(struct st_writer *w, const char *key, const char *value);
/*
 * Writes the file like the reference serializer: tensors sorted by descending
 * dtype alignment then name, JSON padded with spaces to a multiple of 8.
 * Writes to a temporary name and renames, so a failure leaves no partial file.
 */
int st_writer_write(struct st_writer *w, const char *path);
/* Adds a tensor's name and spec without bytes, for st_writer_layout (a streaming writer). */
int st_writer_plan(struct st_writer *w, const char *name, const struct qkeep_spec *spec);
/* Where every byte of the file st_writer_write would write goes (the bytes of planned tensors
 * are the caller's to write at their offsets). */
struct st_layout {
  char *header;      /* the head of the file: 8-byte length, JSON, padding */
  size_t header_len; /* bytes of header; the data starts here */
  uint64_t *offsets; /* absolute file offset of each tensor, in the order added */
  uint64_t file_size;
};
int st_writer_layout(const struct st_writer *w, struct st_layout *out);
void st_layout_free(struct st_layout *l);

#endif
