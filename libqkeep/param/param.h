/*
 * param/param.h: the objects the rules act on: params, buffers, layers with their name tables
 * and checkpoint sources, the chain's links (owners) and the model that holds them (the struct;
 * its operations live above, in model/). The rules themselves are in param/rules.c, the census
 * in param/census.c, the digest in param/digest.c. Uses base, format and device.
 */
#ifndef QKEEP_PARAM_H
#define QKEEP_PARAM_H

#include "device/device.h"
#include "format/fusion.h"
#include "format/provider.h"

/* A replace result handed out by qkeep_tensor_new. */
struct qkeep_tensor {
  qkeep_layer *layer;
  struct tensor t;
};

/* The host's tensor_new_unfilled (ABI 1.7): qkeep_tensor_new without the zero-fill (rules.c). */
int tensor_new_unfilled(qkeep_layer *layer, const struct qkeep_spec *spec, qkeep_tensor **out);

/* ---- params, buffers and layers (layer.c); the model's struct (model.c) --------------- */

/*
 * What a scale param's values must be besides finite and non-negative, from its scheme's template
 * (all zero: nothing more). The kernels' arithmetic must not overflow on any value the check lets
 * through: a scale divided by needs a finite reciprocal, and the factor a code is multiplied by (the
 * scale, or its reciprocal when the checkpoint stores the encode factor) times the largest code
 * magnitude must be finite. Every bound is met by a scale derived from a finite amax.
 */
struct scale_rule {
  bool positive;  /* kernels divide by it (a static activation scale): non-zero, finite reciprocal */
  bool inverted;  /* stored as an encode factor (compressed-tensors' global scales): kernels invert it */
  float code_max; /* the largest code magnitude its decode factor multiplies; 0: not bounded here */
};

struct qkeep_param {
  qkeep_layer *layer;
  char *checkpoint_name; /* the name it was created under */
  char *runtime_name;    /* the name kernels know it by (move changes it) */
  enum qkeep_param_state state;
  struct qkeep_spec create_spec; /* what the checkpoint defined; reload restores it */
  size_t create_bytes;
  struct tensor view;
  char *release_reason;
  bool scale;             /* a scale: every value must be finite and non-negative */
  struct scale_rule rule; /* and what more (a scale only) */
  bool transformed;       /* replaced since its bytes were loaded: no longer the checkpoint layout */
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
  /* A tensor-parallel rank's part of the checkpoint tensor (load/slice.c): slice.rows runs of
   * slice.row_bytes, the first slice.offset bytes into the tensor, slice.stride apart, landing
   * as rows x row_bytes above. slice.rows 0: the whole tensor. */
  struct slice {
    size_t offset, rows, row_bytes, stride;
  } slice;
  /* The provider's tensor for this source (its handle) as check_source found it under provider pass
   * found_pass (0: none yet). */
  const void *found;
  uint64_t found_pass;
  /* Online quantization (load/online.c): an unquantized tensor that lands quantized. param is its
   * quantized-on-load param (no storage); member `member` of the plan's unit `unit` is made from it,
   * whose outputs land through the layer's derived sources. */
  bool online;
  size_t unit;
  int member;
};

/* A tensor the checkpoint does not hold, made on load from its unquantized sources (online
 * quantization): where it lands (src: param and layout, as a checkpoint tensor's source) and which
 * output of the plan it is (unit SIZE_MAX: a constant such as a kv-cache scale). */
struct derived {
  struct source src;
  size_t output, unit;
  size_t members[3]; /* the layer's sources of the unit's members (by member), once planned */
  size_t order;      /* while planning: the sort key (the unit's first source, then its own) */
};

struct scheme;
struct ckpt;
struct quant_plan;

/* A model that quantizes unquantized checkpoints on load (qkeep_model_set_quantize; load/online.c). */
struct online_quantize {
  bool set;                           /* the options below apply to the next load */
  struct qkeep_quantize_options opts; /* copied; scheme points at `scheme` */
  char *scheme;
  struct quant_plan *plan;   /* the loaded model's plan (NULL: the model does not quantize on load) */
  struct name_index outputs; /* the plan's output names -> index */
  int64_t device_units; /* units the owners' quantize slots took, over the model's life (tests read it) */
};

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
  /* How a tensor/expert-parallel model cut this layer (scheme/shard_plan.c): the role and the full,
   * unsharded dims; role QKEEP_SHARD_REPLICATED with ranks 1 when the model is not sharded. */
  struct qkeep_layer_shard shard;
  /* Online quantization (load/online.c): the quantized tensors made on load (by unit), and the
   * quantized-on-load params of its unquantized sources (owned, not in params or names). */
  struct derived *derived;
  size_t n_derived, cap_derived;
  qkeep_param **online_params;
  size_t n_online_params, cap_online_params;
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
  void *gather;          /* dev.gather points here: device memory a check of scales gathers into, made at
                            the first such check (reload/reload.c), freed with the model */
  int probe_rc;          /* 0: usable; otherwise the probe's code, and the link takes no layer */
  char *probe_msg;       /* why the probe failed ("" when it did not) */
  size_t layers;         /* layers it owns (for reports) */
};

/* Where a checkpoint name loads: layer and position in its sources. */
struct source_ref {
  qkeep_layer *layer;
  size_t source;
};

/* The backend chain: its links in order. Never resized: storages point at their link's device. */
struct chain {
  struct owner *owners;
  size_t n_owners;
};

/* What the model's bytes equal now (a rollback re-reads it): the checkpoint and the identity of
 * each of its files as opened, before the model read it, and checked again after (model/model.c:
 * model_source_*): a rollback re-reads W0 only if it is still that file. path NULL: none. */
struct model_source {
  char *path;
  struct st_identity *ids;
  size_t n;
};

/* This rank's tensor/expert-parallel place (model/parallel.c; zero: one rank), and the checkpoint
 * tensors other ranks load (experts of other EP ranks), which a W1 may hold (param/foreign.c). */
struct rank_slice {
  struct qkeep_parallel parallel;
  char **foreign;
  size_t n_foreign, cap_foreign;
  struct name_index foreign_index;
};

/* Name lookups over the layers: layer name -> position in layers, and every checkpoint name -> its
 * first source in layer order (what qkeep_model_lookup finds), O(1) expected. */
struct model_index {
  struct name_index layers;  /* layer name -> position in model->layers */
  struct name_index sources; /* checkpoint name -> position in source_refs */
  struct source_ref *source_refs;
  size_t n_source_refs, cap_source_refs;
};

/* A model: its layers, and one member for each other thing it keeps. */
struct qkeep_model {
  qkeep_layer **layers;
  size_t n_layers, cap_layers;
  struct model_index index;
  struct chain chain;
  struct fusion_rule *fusion; /* NULL until set: the default q/k/v and gate/up rules */
  size_t n_fusion;
  bool fusion_set;
  struct rank_slice rank;
  struct model_source source;
  bool poisoned; /* a failed reload could not roll back: kernels refuse until a reload succeeds */
  void (*progress)(void *user, size_t done, size_t total, const char *layer);
  void *progress_user;
  struct qkeep_load_stats stats;
  struct mem_stats mem;
  /* The stream's shape (qkeep_model_set_load_options; zero fields: the defaults). */
  struct qkeep_load_options load_options;
  struct online_quantize online;
  /* Host memory for the scales a reload from files checks (reload/reload.c), kept from the first
   * reload that keeps any to the model's free: a fresh buffer's first touch, a page fault per
   * 4 KiB page, cost more than reading the scales into it. */
  struct kept_scales {
    unsigned char *bytes;
    size_t cap;
  } reload_scales;
  /* Set only through qkeep__test_control (reload/test_control.c): its reloads fail with `code` when
   * they reach layer index `layer` (-1: none). */
  struct reload_fault {
    long layer;
    int code;
  } fault;
};

/* The entry registered under name, or NULL; O(1) expected. */
struct name_entry *layer_find_name(const qkeep_layer *layer, const char *name);
/* The first source (in layer order) that loads checkpoint tensor `name`, or NULL; O(1) expected. */
const struct source_ref *model_find_source(const qkeep_model *model, const char *name);
/* Checks a new param's name and spec against the layer (QKEEP_E_INVAL, QKEEP_E_EXISTS). */
int layer_param_check(const qkeep_layer *layer, const char *name, const struct qkeep_spec *spec);
/*
 * Creates loader param `name` of the layer (the body of qkeep_param_create without choosing an
 * owner): zero-filled storage in the owner's memory when the layer has an owner, none while it is
 * planned (model_materialise gives it storage once the chain has chosen owners).
 */
int layer_param_create(qkeep_layer *layer, const char *name, const struct qkeep_spec *spec,
                       qkeep_param **out);
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
/*
 * For each of the layer's params (covered[i] for layer->params[i]): whether the sources that write it
 * (its checkpoint tensors and the tensors made on load, compare-only ones aside) write each of its bytes
 * exactly once, so that loading them leaves nothing of what the memory held before. Only provable
 * layouts count: runs that follow one another from the first byte to the last, or fused shards side by
 * side in every row (a common row count and stride). Anything else is not covered (and gets zeroed
 * before it loads). O(S log S) in the layer's S sources. QKEEP_E_NOMEM.
 */
int layer_find_covered(const qkeep_layer *layer, bool *covered);
void layer_destroy(qkeep_layer *layer);
/* Drops every layer (backend state first), leaving the model empty. */

/* Rebuilds the model's index of checkpoint names from every layer's sources (after a layer's sources
 * change: online quantization's planning). */
int model_reindex_sources(qkeep_model *model);

/* ---- tensor/expert parallel bookkeeping (param/foreign.c) ---- */

/* Records a checkpoint tensor that another rank loads (so a W1 holding it is not refused). */
int shard_note_foreign(qkeep_model *model, const char *name);
/* Whether the name is such a tensor; O(1) expected. */
bool shard_is_foreign(const qkeep_model *model, const char *name);
/* Forgets them (model_clear). */
void shard_clear(qkeep_model *model);

/* ---- scale values: one check, on host bytes before they reach a device (param/scales.c) ---- */

/* Why the bytes (n elements of dtype) are not valid scales under rule ("NaN", ...) and the first bad
 * index, or NULL. */
const char *bad_scales(enum qkeep_dtype dtype, const unsigned char *bytes, size_t n,
                       const struct scale_rule *rule, size_t *index);
/*
 * The one check of scale values, on every path (load, reload, sync): `bytes` (host memory) are the n bytes
 * of scale tensor t from its byte `first` on, bound for param p (what its values must be). 0, or
 * QKEEP_E_FORMAT "<t->where>: tensor '<t->name>': element <i> is <why> (<rule>)", i counted from the
 * tensor's start; a value that overflows the kernels' arithmetic is printed ("element 0 is 1.4013e-45:
 * its reciprocal overflows float"). Thread safe (the stream's readers call it).
 */
int check_scales(const qkeep_param *p, const struct provided *t, size_t first, const void *bytes, size_t n);

/* The backend table of the layer's owner, or NULL (host-only, or not yet chosen). */
const struct qkeep_backend *layer_backend(const qkeep_layer *layer);
/* The memory the layer's params live in (the host's while no owner is chosen). */
const struct device *layer_device(const qkeep_layer *layer);

#endif
