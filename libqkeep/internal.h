/*
 * internal.h: the core's private structures and helpers. Not installed.
 * Everything here is hidden from libqkeep's exported symbols; the test
 * suites link the core as a convenience library to reach it.
 */
#ifndef QKEEP_INTERNAL_H
#define QKEEP_INTERNAL_H

#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>

#include "qkeep.h"

#if defined(__GNUC__)
#define PRINTF_LIKE(a, b) __attribute__((format(printf, a, b)))
#else
#define PRINTF_LIKE(a, b)
#endif

/* ---- errors and logging (error.c) ------------------------------------------ */

/* Records the calling thread's error detail and returns `code`. */
int set_error(int code, const char *fmt, ...) PRINTF_LIKE(2, 3);
int set_error_v(int code, const char *fmt, va_list ap);
/* Changes whenever this thread's detail is set: tells whether a call (a backend's) left one. */
unsigned long error_generation(void);
/* Prefixes the current detail with more context ("layer x: " + detail). */
int add_error_context(int code, const char *fmt, ...) PRINTF_LIKE(2, 3);
void log_msg(enum qkeep_log_level level, const char *fmt, ...) PRINTF_LIKE(2, 3);
void log_msg_v(enum qkeep_log_level level, const char *fmt, va_list ap);

/* ---- small utilities (util.c) ---------------------------------------------- */

char *xstrdup(const char *s); /* NULL on NULL or no memory */
/* asprintf/vasprintf: *out malloc'd and the length, or NULL and -1 when out of memory (never
 * glibc's, whose failure path writes past its buffer; see util.c). */
int qk_asprintf(char **out, const char *fmt, ...) PRINTF_LIKE(2, 3);
int qk_vasprintf(char **out, const char *fmt, va_list ap);
double now_seconds(void);     /* monotonic, for the load stats */
int grow_array(void **array, size_t *cap, size_t need, size_t elem_size);
bool spec_equal(const struct qkeep_spec *a, const struct qkeep_spec *b);
/* The bytes of a spec, false when its dtype, rank or a dimension is invalid or the product
 * does not fit in size_t (so no size ever wraps to a small number). */
bool spec_bytes_checked(const struct qkeep_spec *spec, size_t *bytes);
/* Checked size arithmetic, the one place the core multiplies or adds dimensions, counts and
 * byte sizes that came from a file or a caller: false (and *out untouched) when an operand is
 * negative or the result does not fit, so no product ever wraps or overflows a signed type. */
bool dim_mul(int64_t a, int64_t b, int64_t *out);
bool dim_add(int64_t a, int64_t b, int64_t *out);
bool size_mul(size_t a, size_t b, size_t *out);
/* The bytes of a rows x cols f32 matrix, false when negative or too large for size_t. */
bool f32_matrix_bytes(int64_t rows, int64_t cols, size_t *bytes);
/*
 * Copies a size-prefixed struct out through the ABI: `out` starts with the caller's
 * size_t size (0 means "mine"); copies min(that, in_size) bytes of `in` and stores the
 * size copied, so older callers get a prefix and newer ones see what is absent.
 */
void copy_sized(void *out, const void *in, size_t in_size);
/* "an integer", "a string"...: what a JSON value is, for messages (a json_t *). */
const char *json_kind(const void *json_value);
/* Room for any spec's shape string: QKEEP_MAX_DIMS dimensions of up to 20 digits, ", " between. */
#define SHAPE_STR_LEN (2 + QKEEP_MAX_DIMS * 22 + 1)
/* "[3, 4]" into buf (SHAPE_STR_LEN bytes hold any); returns buf. */
const char *spec_shape_str(const struct qkeep_spec *spec, char *buf, size_t len);

/* ---- name index (name_index.c) ------------------------------------------------------ */

/*
 * A hash table from a name to a value below 2^32 (a position in the caller's
 * array), O(1) expected per operation. Names are borrowed, not copied: each
 * must stay valid and unchanged while the index holds it (the malloc'd name of
 * an entry, which stays put when the caller's array of entries grows). A
 * zero-initialised struct is an empty index; name_index_clear frees it.
 */
struct name_slot {
  const char *name; /* NULL: empty */
  uint32_t hash;
  uint32_t value;
};
struct name_index {
  struct name_slot *slots;
  size_t cap, count;
};
/* Adds name -> value. A name already present keeps its value, which goes to *existing
 * (when non-NULL), and QKEEP_E_EXISTS is returned without an error detail (the caller sets
 * one that says what the name is); QKEEP_E_NOMEM with a detail. */
int name_index_put(struct name_index *ix, const char *name, size_t value, size_t *existing);
/* Adds name -> value, or gives a name already present this value instead. */
int name_index_set(struct name_index *ix, const char *name, size_t value);
/* Makes room for n names without growing again. */
int name_index_reserve(struct name_index *ix, size_t n);
/* The value of the first len bytes of name (no NUL needed there), or false. */
bool name_index_find(const struct name_index *ix, const char *name, size_t len, size_t *value);
/* The value of a NUL-terminated name, or false. */
bool name_index_get(const struct name_index *ix, const char *name, size_t *value);
/* Frees the table; the index is empty (and reusable) afterwards. */
void name_index_clear(struct name_index *ix);

/* ---- large JSON objects, one member at a time (json_scan.c) ------------------------ */

/*
 * A scan over a JSON object's members: json_scan_open, then json_scan_member
 * for each (stops with more false at the closing brace) with json_scan_value
 * to step over its value, then json_scan_end. Values (and keys with escapes)
 * are parsed by jansson one at a time with json_scan_parse / json_scan_string.
 * Errors are QKEEP_E_FORMAT "WHAT: WHY (line L, column C)".
 */
struct json_scan {
  const char *text;
  size_t len, pos;
  const char *what; /* the message prefix, e.g. "PATH: header is not valid JSON" */
  bool first;
};
struct json_member {
  bool more;              /* false: the object ended */
  size_t key_at, key_len; /* the key's text, quotes included */
  bool key_escaped;
  size_t value_at, value_len; /* set by json_scan_value */
  bool value_escaped;         /* a string value (or one inside it) holds a backslash */
};
int json_scan_open(struct json_scan *s);
int json_scan_member(struct json_scan *s, struct json_member *m);
int json_scan_value(struct json_scan *s, struct json_member *m);
int json_scan_end(struct json_scan *s);
struct json_t;
/*
 * jansson's json_loadb with its allocation failures told apart from invalid text (jansson reports
 * some as syntax errors, and survives others with a damaged result; see util.c). 0 (*out the
 * caller's), QKEEP_E_NOMEM (no detail set), or QKEEP_E_FORMAT with *line, *column, *position
 * and why (a buffer of at least 160 bytes) describing the text's error.
 */
int json_parse(const char *text, size_t len, size_t flags, struct json_t **out, int *line, int *column,
               int *position, char *why);
/* json_loadb (err a json_error_t *), NULL with *no_memory set when jansson could not allocate during
 * it, even where it still returned a (then damaged, and freed) result; see util.c. */
struct json_t *json_loadb_watched(const char *text, size_t len, size_t flags, void *err, bool *no_memory);
/* jansson's parse of text[at, at + n) (a json_t *, the caller's); its errors placed in the whole text. */
int json_scan_parse(const struct json_scan *s, size_t at, size_t n, struct json_t **out);
/* The JSON string at text[at, at + n) (quotes included), decoded, malloc'd. */
int json_scan_string(const struct json_scan *s, size_t at, size_t n, bool escaped, char **out);
int json_scan_error(const struct json_scan *s, size_t at, const char *why);

/* ---- devices and storage (storage.c) ------------------------------------------- */

/* Bytes held in storages (params, buffers, result tensors) and host staging. */
struct mem_stats {
  int64_t storage_bytes, storage_peak, staging_peak;
};

/*
 * The memory of the last result tensor a load or reload freed on a device, kept for the next
 * one: PWAL makes a result per transform, and a device allocator's alloc and free (cudaFree
 * waits for the device) cost more than the transform. Only while `on` (a load or reload).
 */
struct spare {
  bool on;
  void *data;   /* NULL: none kept */
  size_t bytes; /* its allocation */
};

/* Memory of one device: a backend's ops, or host memory when be is NULL. */
struct device {
  const struct qkeep_backend *be;
  const struct qkeep_memory_ops *ops;
  struct mem_stats *stats; /* the owning model's counters; NULL for the shared host device */
  struct spare *spare;     /* the owner's; NULL for the shared host device */
  struct stream **stream;  /* the owner's stream to it, made at its first streamed load; NULL likewise */
};

/* The host device (memcpy-based ops). */
const struct device *host_device(void);
/* Whether a backend's memory table provides every slot the core calls (plugin.c refuses a
 * table that is set but short, so a device backend never gets host pointers). */
bool memory_ops_complete(const struct qkeep_memory_ops *ops);
/* Whether the table has ABI 1.2's pinned staging and asynchronous copy (all three slots). */
bool memory_ops_async(const struct qkeep_memory_ops *ops);
/* A device for a backend: its memory ops when it has them, else host memory. */
void device_init(struct device *dev, const struct qkeep_backend *be);

int dev_alloc(const struct device *dev, size_t bytes, void **out);
void dev_free(const struct device *dev, void *ptr);
int dev_h2d(const struct device *dev, void *dst, const void *src, size_t n);
int dev_d2h(const struct device *dev, void *dst, const void *src, size_t n);
int dev_d2d(const struct device *dev, void *dst, const void *src, size_t n);
int dev_fill(const struct device *dev, void *dst, int byte, size_t n);
int dev_sync(const struct device *dev);
/* A reload reads W1's scale tensors for validation in shares on up to four threads when they add up
 * to at least this many bytes (256 KiB; tests lower it to reach the threaded path with small models). */
extern size_t reload_threaded_scale_bytes;
/* Whether ops also have ABI 1.3's copy fences (copy_fence, copy_fence_wait). */
bool memory_ops_fences(const struct qkeep_memory_ops *ops);
/* ABI 1.3 slots; only for a device whose ops pass memory_ops_fences. dev_fence_wait returns 0
 * when the fence's copies are done, 1 when block is false and they are not yet, or an error. */
int dev_fence(const struct device *dev, uint64_t *fence);
int dev_fence_wait(const struct device *dev, uint64_t fence, bool block);
/* ABI 1.2 slots; only for a device whose ops pass memory_ops_async. */
int dev_host_alloc(const struct device *dev, size_t bytes, void **out);
void dev_host_free(const struct device *dev, void *ptr);
int dev_h2d_async(const struct device *dev, void *dst, const void *src, size_t n);

/* Refcounted memory on one device. capacity 0 means empty (data NULL). */
struct storage {
  int refs;
  void *data;
  size_t capacity; /* the bytes it offers */
  size_t held;     /* the bytes allocated (more than capacity when it reuses a larger spare) */
  bool result;     /* a result tensor's: its memory may go to the device's spare */
  const struct device *dev;
};

/* A new zero-filled storage with one reference. */
int storage_new(const struct device *dev, size_t bytes, struct storage **out);
/* The same for a result tensor: it may reuse (and, freed, refill) the device's spare. */
int storage_new_result(const struct device *dev, size_t bytes, struct storage **out);
/* Starts or ends keeping a spare on dev; ending frees the one kept. */
void spare_begin(const struct device *dev);
void spare_end(const struct device *dev);
void storage_ref(struct storage *s);
void storage_unref(struct storage *s);

/* A contiguous row-major view into a storage. */
struct tensor {
  struct storage *storage; /* counted reference; NULL for an empty tensor */
  size_t offset;
  struct qkeep_spec spec;
};

static inline void *tensor_ptr(const struct tensor *t) {
  return t->storage && t->storage->data ? (char *)t->storage->data + t->offset : NULL;
}
static inline size_t tensor_capacity(const struct tensor *t) {
  return t->storage ? t->storage->capacity - t->offset : 0;
}
/* Fills a qkeep_view from a tensor and state. */
void tensor_to_view(const struct tensor *t, enum qkeep_param_state state, struct qkeep_view *out);

/* A replace result handed out by qkeep_tensor_new. */
struct qkeep_tensor {
  qkeep_layer *layer;
  struct tensor t;
};

/* ---- params, buffers and layers (layer.c); the model's struct (model.c) --------------- */

struct qkeep_param {
  qkeep_layer *layer;
  char *checkpoint_name; /* the name it was created under */
  char *runtime_name;    /* the name kernels know it by (move changes it) */
  enum qkeep_param_state state;
  struct qkeep_spec create_spec; /* what the checkpoint defined; reload restores it */
  size_t create_bytes;
  struct tensor view;
  char *release_reason;
  bool scale;       /* a scale: every value must be finite and non-negative */
  bool positive;    /* a static activation scale: and non-zero */
  bool transformed; /* replaced since its bytes were loaded: no longer the checkpoint layout */
  /* A host copy of a small scale param's loaded bytes (create_bytes of them), taken as they streamed
   * to a device, so normalisation reads them without waiting for the device; valid while the param
   * holds exactly what its sources loaded (mirror_valid, not transformed). */
  unsigned char *mirror;
  bool mirror_valid;
  /* NULL, or the checkpoint's shape when it does not fit a qkeep_spec (rank > QKEEP_MAX_DIMS or a
   * dimension >= 2^63): create_spec is then the collapsed shape (struct st_tensor), and this full
   * one is what a reload must match and what the digest hashes. Owned. */
  uint64_t *full_shape;
  int full_ndim;
};

struct buffer {
  char *name;
  struct tensor view;
};

/* One registered name: a param (possibly under an alias) or a buffer. */
struct name_entry {
  char *name;
  qkeep_param *param;
  struct buffer *buffer;
};

/*
 * Where one checkpoint tensor lands: the param, and the byte layout inside it.
 * Contiguous sources (a whole param, a shard's rows, an expert's slice, a
 * scale slot) have rows = 1. A fused param whose last dim carries N (GPTQ's
 * qweight [K/8, N]) takes each shard as `rows` runs of `row_bytes`, `dst_stride`
 * apart. A compare_only source (a tensor every shard repeats, e.g. g_idx) must
 * equal what an earlier source loaded.
 */
struct source {
  char *checkpoint_name; /* full name in the checkpoint */
  qkeep_param *param;
  size_t dst_offset;
  size_t rows, row_bytes, dst_stride;
  bool compare_only;
  struct qkeep_spec spec; /* what the checkpoint must hold */
  bool loaded;
  bool mirrored; /* its bytes went to its param's host mirror too (load.c) */
  /* A tensor-parallel rank's part of the checkpoint tensor (shard.c): slice.rows runs of
   * slice.row_bytes, the first slice.offset bytes into the tensor, slice.stride apart, landing
   * as rows x row_bytes above. slice.rows 0: the whole tensor. */
  struct slice {
    size_t offset, rows, row_bytes, stride;
  } slice;
  /* The provider's tensor for this source (its handle) as check_source found it under provider pass
   * found_pass (0: none yet). */
  const void *found;
  uint64_t found_pass;
};

struct scheme;
struct ckpt;

struct qkeep_layer {
  qkeep_model *model;
  const struct scheme *scheme_ops; /* normalisation; NULL for layers kept as loaded */
  char *name;
  char *scheme;
  enum qkeep_layer_kind kind;
  struct qkeep_layer_info dims; /* name and scheme point at the fields above */

  qkeep_param **params; /* owned, in creation order */
  size_t n_params, cap_params;
  struct buffer **buffers; /* owned */
  size_t n_buffers, cap_buffers;
  struct name_entry *names; /* registration table */
  size_t n_names, cap_names;
  struct name_index name_index; /* names[i].name -> i */
  struct source *sources;       /* checkpoint tensors that load into this layer */
  size_t n_sources, cap_sources;

  void *state; /* the backend's, freed by its layer_cleanup */
  /* The chain link that runs the layer and whose memory holds its params; NULL while a
   * checkpoint's layers are being planned (params get no storage until owners are chosen). */
  const struct owner *owner;
  int32_t first_dtype; /* while a hand-built layer's owner is chosen: its first param's dtype (else -1) */
  /* How a tensor/expert-parallel model cut this layer (shard.c): the role and the full,
   * unsharded dims; role QKEEP_SHARD_REPLICATED with ranks 1 when the model is not sharded. */
  struct qkeep_layer_shard shard;
};

/* A fusion rule: modules <parent>.<member[i]> load as shards of <parent>.<fused>. */
struct fusion_rule {
  char *fused;
  char *members[8];
  int n_members;
};

/*
 * One backend of a model's chain: its plugin, the memory its layers' params live in, and
 * whether its probe found the device. A model without plugins has one link with no
 * plugin (host memory, no PWAL). Links never move: storages point at their device.
 */
struct owner {
  qkeep_plugin *plugin; /* NULL: host memory, no PWAL, no kernels */
  struct device dev;
  struct spare spare;    /* dev.spare points here */
  struct stream *stream; /* dev.stream points here; freed with the model */
  int probe_rc;          /* 0: usable; otherwise the probe's code, and the link takes no layer */
  char *probe_msg;       /* why the probe failed ("" when it did not) */
  size_t layers;         /* layers it owns (for reports) */
};

/* Where a checkpoint name loads: layer and position in its sources. */
struct source_ref {
  qkeep_layer *layer;
  size_t source;
};

/* A file as it was when the model read it: a rollback re-reads W0 only if it is still that file. */
struct file_id {
  uint64_t dev, ino, size;
  int64_t mtime_s, mtime_ns, ctime_s, ctime_ns;
};

struct qkeep_model {
  struct owner *owners; /* the chain, in order; never resized */
  size_t n_owners;
  struct fusion_rule *fusion; /* NULL until set: the default q/k/v and gate/up rules */
  size_t n_fusion;
  bool fusion_set;
  void (*progress)(void *user, size_t done, size_t total, const char *layer);
  void *progress_user;
  struct qkeep_load_stats stats;
  struct mem_stats mem;
  char *source_path;          /* the checkpoint whose bytes the model holds (rollback source), or NULL */
  struct file_id *source_ids; /* each of its files when it was read (model_set_source) */
  size_t n_source_ids;
  bool poisoned;    /* a failed reload could not roll back: kernels refuse until a reload succeeds */
  long fault_layer; /* tests: inject fault_code when a reload reaches this layer index (-1: none) */
  int fault_code;
  struct qkeep_parallel parallel; /* this rank's tensor/expert-parallel place (shard.c); zero: one rank */
  /* Checkpoint tensors other ranks load (experts of other EP ranks): a W1 may hold them (shard.c). */
  char **foreign;
  size_t n_foreign, cap_foreign;
  struct name_index foreign_index;
  bool planning; /* assembling a checkpoint: params are planned, not allocated, until chain_assign */
  qkeep_layer **layers;
  size_t n_layers, cap_layers;
  struct name_index layer_index; /* layer name -> position in layers */
  /* Every checkpoint name -> its first source in layer order (what qkeep_model_lookup finds). */
  struct name_index source_index; /* checkpoint name -> position in source_refs */
  struct source_ref *source_refs;
  size_t n_source_refs, cap_source_refs;
};

/* The entry registered under name, or NULL; O(1) expected. */
struct name_entry *layer_find_name(const qkeep_layer *layer, const char *name);
/* The first source (in layer order) that loads checkpoint tensor `name`, or NULL; O(1) expected. */
const struct source_ref *model_find_source(const qkeep_model *model, const char *name);
/* Registers name for a param or buffer (exactly one non-NULL). */
int layer_register(qkeep_layer *layer, const char *name, qkeep_param *param, struct buffer *buffer);
/* Records that checkpoint tensor `checkpoint_name` loads into param at dst_offset (contiguous). */
int layer_add_source(qkeep_layer *layer, const char *checkpoint_name, qkeep_param *param, size_t dst_offset,
                     const struct qkeep_spec *spec);
/* The general form: rows x row_bytes, dst_stride apart; compare_only checks instead of writing. */
int layer_add_source_strided(qkeep_layer *layer, const char *checkpoint_name, qkeep_param *param,
                             size_t dst_offset, size_t rows, size_t row_bytes, size_t dst_stride,
                             bool compare_only, const struct qkeep_spec *spec);
/* The same for a part of the checkpoint tensor (a tensor-parallel slice; NULL: all of it): the
 * bytes that land (rows x row_bytes) are the slice's. */
int layer_add_source_slice(qkeep_layer *layer, const char *checkpoint_name, qkeep_param *param,
                           size_t dst_offset, size_t rows, size_t row_bytes, size_t dst_stride,
                           bool compare_only, const struct qkeep_spec *spec, const struct slice *slice);
void layer_destroy(qkeep_layer *layer);
/* Drops every layer (backend state first), leaving the model empty. */
void model_clear(qkeep_model *model);

/* ---- tensor/expert parallel bookkeeping (shard.c) ---- */

/* Records a checkpoint tensor that another rank loads (so a W1 holding it is not refused). */
int shard_note_foreign(qkeep_model *model, const char *name);
/* Whether the name is such a tensor; O(1) expected. */
bool shard_is_foreign(const qkeep_model *model, const char *name);
/* Forgets them (model_clear). */
void shard_clear(qkeep_model *model);

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

struct st_file {
  char *path;
  int fd;
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
 * Opens and validates a .safetensors file strictly (formats.md §7): header
 * length, UTF-8 JSON object, known dtypes, shape x dtype = bytes, offsets
 * contiguous from 0 without gaps or overlaps, no trailing bytes, no duplicate
 * names, __metadata__ values strings. Errors name the path and the tensor.
 * The caller owns *out (st_close).
 */
int st_open(const char *path, struct st_file **out);
void st_close(struct st_file *f);
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

/* ---- config (config.c) ------------------------------------------------------------ */

struct config_option {
  char *key;
  char *value;
  int line;
};

struct qkeep_config {
  char *path;
  char **backends; /* [qkeep] backend: the chain, in order (at least one name) */
  size_t n_backends;
  const char *backend; /* backends[0] */
  int backend_line;
  char *plugin_dir;
  char *checkpoint;
  char *reload_checkpoint;
  char *fuse;
  struct qkeep_parallel parallel; /* [model] tp_size, tp_rank, ep_size, ep_rank */
  int parallel_line[4];
  /* [backend.NAME] sections: every key, in file order */
  struct config_backend_section {
    char *name;
    struct config_option *options;
    size_t n_options, cap_options;
  } * sections;
  size_t n_sections, cap_sections;
};

/* The options of [backend.NAME], or NULL when the file has no such section. */
const struct config_backend_section *config_section(const qkeep_config *cfg, const char *backend);

/* ---- plugins (plugin.c) --------------------------------------------------------------- */

struct qkeep_plugin {
  char *path;
  void *handle; /* dlopen */
  const struct qkeep_backend *be;
  bool probed;  /* the chain probes a plugin once, however many models use it */
  int probe_rc; /* the first probe's result */
  char probe_msg[512];
};

/* The plugin's probe result, probing it on first use (a failure is logged once, as a warning). */
int plugin_probe_once(qkeep_plugin *plugin, const char **msg);

/* The host table handed to every backend. */
const struct qkeep_host *host_table(void);

/* ---- loading: providers, staging, sources, the end of a layer's load (load.c) ------------ */

/* One tensor a provider holds. */
struct provided {
  const char *name;
  int dtype; /* enum qkeep_dtype, or -1 for one qkeep does not use */
  const char *dtype_name;
  int ndim;
  const int64_t *shape;
  size_t nbytes;
  const char *where; /* the file (or "in-memory buffers") for errors */
  const void *handle;
  const uint64_t *full_shape; /* the file's own shape when it does not fit a spec (st_tensor), else NULL */
  int full_ndim;
  bool spec_only; /* in-memory buffers: a spec is all they can say, so a collapsed one stands for the full */
};

/* One allocation: [data, data + bytes). */
struct mem_block {
  const void *data;
  size_t bytes;
  bool checked; /* the values of every scale tensor in it were checked already (a sync's kept copies) */
};

/*
 * Where tensor bytes come from: a checkpoint (files) or the caller's named
 * buffers (host or device memory). Cold start and reload use the same path.
 */
struct provider {
  const char *what; /* the checkpoint path, or "in-memory buffers" */
  const void *ctx;
  /* Fills *out for the named tensor; false when the provider has no such tensor. */
  bool (*find)(const struct provider *p, const char *name, struct provided *out);
  /* Copies the tensor's bytes into host memory at dst. */
  int (*read)(const struct provider *p, const struct provided *t, void *dst);
  /* The tensor's bytes in host memory without a copy, or NULL (then read is used). */
  const void *(*host_bytes)(const struct provider *p, const struct provided *t);
  /* The tensor's bytes in the memory of the layer that takes it (on_device tensors), or NULL. */
  const void *(*device_bytes)(const struct provider *p, const struct provided *t);
  /* Every tensor name, for checking that the provider holds nothing the model lacks. */
  size_t (*count)(const struct provider *p);
  const char *(*name_at)(const struct provider *p, size_t i);
  /* (optional) Copies n tensors into host memory, ts[i] to dsts[i], in one batch. */
  int (*read_many)(const struct provider *p, const struct provided *ts, size_t n, void *const *dsts);
  /* (optional) Copies bytes [offset, offset + n) of the tensor (a range within it) into host memory. */
  int (*read_range)(const struct provider *p, const struct provided *t, size_t offset, size_t n, void *dst);
  /* (optional, with pass) Fills *out for the tensor whose handle find gave, without looking its name up. */
  void (*describe)(const struct provider *p, const void *handle, struct provided *out);
  /* Nonzero: this provider's number, unique for the process (provider_pass), under which check_source
   * remembers each source's tensor, so the load's later steps find it without a lookup; 0: nothing is
   * remembered. Two providers share one only when find gives the same answers for both. */
  uint64_t pass;
  /* (device buffers) Allocations each holding many of the provider's tensors: a copy may span several
   * tensors within one. NULL, 0: none known. */
  const struct mem_block *blocks;
  size_t n_blocks;
};

/* A number no provider had before (from 1 up, never reused). Thread safe. */
uint64_t provider_pass(void);

/* A provider over an open checkpoint. */
void ckpt_provider(struct provider *p, const struct ckpt *ck);

/* ---- streaming to a device (stream.c) ---- */

/* A pinned ring, reader threads and the device they feed (see stream.c). */
struct stream;
/* One tensor for the device: from the provider's file, or from host bytes it holds. */
struct stream_item {
  struct provided t;
  const unsigned char *on_host; /* NULL: read from the provider's file (read_range) */
  char *dst;                    /* its device memory */
  unsigned char *mirror;        /* NULL, or host memory that gets a copy of the bytes too */
  /* (optional) Checks a piece of the tensor in host memory before it is copied: its n bytes from byte `at`
   * (whole elements of t's dtype), with check_ctx. Called by a reader thread; 0, or an error (its message
   * set) that fails stream_items with that piece not copied. */
  int (*check)(const void *check_ctx, const struct provided *t, size_t at, const void *bytes, size_t n);
  const void *check_ctx;
};
/* A stream to dev (its ops pass memory_ops_async): the ring from its host_alloc; readers start
 * with the first stream_items. */
int stream_new(const struct device *dev, struct stream **out);
/* The end of a load: waits for the copies (stream_wait) and stops the readers; the ring stays. */
int stream_end(struct stream *s);
/* stream_end, then frees the ring. */
void stream_free(struct stream *s);
const struct device *stream_device(const struct stream *s);
/* Pinned bytes the stream holds (0 for NULL). */
size_t stream_bytes(const struct stream *s);
/*
 * Streams the items' bytes to their device memory: read in parallel into the ring, copied by
 * copy_h2d_async in order. On return every copy has been started (not necessarily finished:
 * later work on the device's stream sees the bytes; stream_wait waits for them). On a read or
 * copy error, or a piece its item's check refuses (checked by the reader that read it, so its
 * bytes are never copied), nothing further is started and the first error is returned, with its
 * message.
 */
int stream_items(struct stream *s, const struct provider *pv, const struct stream_item *items,
                 size_t n_items);
/*
 * Starts reading the items ahead (their dst and mirror are not needed yet, nor looked at) into
 * free slots, and returns at once; a stream_items call with the same items (tensors and order)
 * then continues from what was read. Best effort: returns 0 even when it could not start.
 */
int stream_prefetch(struct stream *s, const struct provider *pv, const struct stream_item *items,
                    size_t n_items);
/* Waits until every copy the stream started has finished (dev_sync), freeing their slots. */
int stream_wait(struct stream *s);
/* Whether a load is streaming through s now (its readers run): puts are then waited for by its end. */
bool stream_active(const struct stream *s);
/* Copies n bytes of host memory to device memory at dst, after the copies started before it:
 * through a slot without waiting for the device (small puts share one slot), or, larger than a
 * slot or with every slot being read ahead, by a plain copy after a wait. src may change once it
 * returns. */
int stream_put(struct stream *s, void *dst, const void *src, size_t n);

/* Host staging for one tensor, grown as needed; and the stream to the device being loaded. */
struct staging {
  unsigned char *data, *compare;
  size_t cap;
  struct stream *stream; /* NULL until a layer of a device with asynchronous copies loads */
  bool own_stream;       /* made for this load (a device with no owner to keep it), freed with it */
  /* The provider's scale values were checked already (a reload's validation of W1): the load does not
   * check them again. False: it checks each scale in host memory on its way (check_scales). */
  bool scales_checked;
};
/* Ends the stream (its copies waited for), then frees the rest; returns the wait's error. */
int staging_free(struct staging *s);
/* Grows both staging buffers to at least `bytes`. */
int staging_reserve(struct staging *s, size_t bytes);

/* Lands one tensor in its param as the source describes (checked against the source first); a scale's
 * host bytes are checked (check_scales) before they go to the device. */
int load_source(qkeep_layer *layer, const struct provider *pv, struct source *src, struct staging *st);
/* The param whose values the load checks the source's bytes against: a scale, written (not compared with
 * an earlier shard's), when the staging's provider was not checked already (scales_checked); else NULL. */
const qkeep_param *scale_to_check(const struct staging *st, const struct source *src);
/* Starts reading the next layer's device-bound bytes into the stream's free slots (when it goes to
 * the device being streamed to), so they arrive while the current layer's PWAL runs. Best effort. */
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

/* ---- scale values: one check, on host bytes before they reach a device (scales.c) ---- */

/* Why the bytes (n elements of dtype) are not valid scales ("NaN", ...) and the first bad index, or NULL. */
const char *bad_scales(enum qkeep_dtype dtype, const unsigned char *bytes, size_t n, bool positive,
                       size_t *index);
/*
 * The one check of scale values, on every path (load, reload, sync): `bytes` (host memory) are the n bytes
 * of scale tensor t from its byte `first` on, bound for param p (what its values must be). 0, or
 * QKEEP_E_FORMAT "<t->where>: tensor '<t->name>': element <i> is <why> (<rule>)", i counted from the
 * tensor's start. Thread safe (the stream's readers call it).
 */
int check_scales(const qkeep_param *p, const struct provided *t, size_t first, const void *bytes, size_t n);
/* A scale tensor whose values are to be checked: t.nbytes at `at` in dev's memory (NULL: host memory). */
struct scale_item {
  const struct device *dev;
  const void *at;
  const void *block; /* the one allocation holding it with other items (copies may span them), or NULL */
  struct provided t; /* its name, dtype, bytes and where it comes from */
  const qkeep_param *param; /* what its values must be */
  unsigned char *keep;      /* NULL, or host memory that gets a copy of the bytes checked */
};
/* Checks the values of n scale tensors with check_scales: those in host memory where they are, those in
 * device memory from one copy to the host per run of them that lie close together in one block (their
 * one trip to the host: `keep` gets the bytes checked). Sorts items by device, block and address (reload.c).
 * 0, or check_scales' error, or a copy's error. */
int check_device_scales(struct scale_item *items, size_t n);
/* qkeep_model_reload_tensors with the allocations the tensors lie in known (a sync's bucket and the
 * blocks of tensors it kept): the scales in one are copied for their check in runs, and those in a block
 * marked checked are not checked again. */
int reload_tensors_in(qkeep_model *model, const struct qkeep_named_tensor *tensors, size_t n, unsigned flags,
                      const struct mem_block *blocks, size_t n_blocks);

/* Normalisation then the backend's PWAL, once a layer has all its bytes. */
int finish_layer(qkeep_layer *layer);

/* ---- the model's state (model.c) ------------------------------------------------------ */

/* Records the checkpoint the model's bytes now equal (NULL: none). */
/* The checkpoint whose bytes the model holds now (NULL: none), and the identity of each of its
 * files as opened (ck: the open checkpoint, or NULL with path NULL), for a rollback to check.
 * model_source_prepare does the part that can fail (copies, fstat), model_source_take installs a
 * prepared one and cannot fail (a reload prepares before W1 changes anything), and
 * model_source_discard frees one not taken. */
struct model_source {
  char *path;
  struct file_id *ids;
  size_t n;
};
int model_source_prepare(const char *path, const struct ckpt *ck, struct model_source *out);
void model_source_take(qkeep_model *model, struct model_source *src);
void model_source_discard(struct model_source *src);
int model_set_source(qkeep_model *model, const char *path, const struct ckpt *ck);
/* Whether ck's files are the ones the model's source had when it was loaded (same count, device,
 * inode, size, modification and change times); else an error naming the first that differs. */
int model_source_unchanged(const qkeep_model *model, const struct ckpt *ck);
/* The same against a recorded source (its path and file identities), e.g. one kept by a sync. */
int source_matches(const struct model_source *src, const struct ckpt *ck);
/* A copy of the model's source as it stands (path NULL when it has none); QKEEP_E_NOMEM. */
int model_source_copy(const qkeep_model *model, struct model_source *out);
/* Synchronises every device of the model's chain. */
int model_sync(const qkeep_model *model);
/* Starts (on) or ends every owner's spare result memory: on for the layer loop of a load or reload. */
void model_spares(qkeep_model *model, bool on);

/* ---- the backend chain (chain.c) ------------------------------------------------------ */

/* The backend table of the layer's owner, or NULL (host-only, or not yet chosen). */
const struct qkeep_backend *layer_backend(const qkeep_layer *layer);
/* The memory the layer's params live in (the host's while no owner is chosen). */
const struct device *layer_device(const qkeep_layer *layer);

/*
 * Gives every layer of a freshly assembled model its owner: the first usable link
 * whose backend accepts the layer (a tied lm_head goes with the embedding it shares,
 * and that link must accept both), then creates every param's storage in the owner's
 * memory. Before any allocation, a layer no link accepts fails the whole model with
 * each backend's reason. `where` (the checkpoint path) prefixes errors.
 */
int chain_assign(qkeep_model *model, const char *where);
/* Chooses the owner of a hand-built layer (qkeep_layer_add) when its first param, of
 * dtype first_dtype, is created. */
int chain_assign_layer(qkeep_layer *layer, enum qkeep_dtype first_dtype);

#endif
