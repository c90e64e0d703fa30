/*
 * qkeep.h: the API for engines. Load a quantized checkpoint into layers,
 * convert it into a backend's kernel layout without losing a loaded param,
 * and audit the result (census, digest).
 *
 * Conventions: functions return 0 or a negative QKEEP_E_* code;
 * qkeep_strerror() names the code and qkeep_errmsg() gives the detail of the
 * calling thread's last failure (which file, tensor, layer or plugin). The
 * library never prints. Strings passed in are copied when kept.
 *
 * Threads: the library keeps no global state beyond the logger (and its level)
 * and the per-thread error detail, so two models (and two configs, two plugin
 * handles) may be used from two threads at once. One model is used from one
 * thread at a time: no forward (qkeep_layer_forward, qkeep_layer_apply_f32)
 * while a load or reload of the same model runs, and no two reloads at once.
 * Models on several threads may share a plugin when its backend keeps its
 * scratch per layer, as the in-tree ones do (cpu-onednn locks a layer's
 * scratch during apply; cuda-nvfp4 runs on the stream it is given); configure
 * a plugin before sharing it.
 */
#ifndef QKEEP_H
#define QKEEP_H

#include <stdbool.h>

#include "qkeep_backend.h"
#include "qkeep_types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct qkeep_config qkeep_config;
typedef struct qkeep_plugin qkeep_plugin;
typedef struct qkeep_model qkeep_model;
typedef struct qkeep_param qkeep_param;

/* ---- basics ------------------------------------------------------------ */

/* The package version, e.g. "0.1.0". Static string. */
QKEEP_API const char *qkeep_version(void);
/* A static, human-readable name for an error code ("invalid argument"). */
QKEEP_API const char *qkeep_strerror(int code);
/* Detail of the calling thread's last failure; "" when none. Valid until the
 * next failing qkeep call on this thread. */
QKEEP_API const char *qkeep_errmsg(void);

/*
 * Routes the library's log lines (warnings from loading, backends' messages, and at
 * QKEEP_LOG_DEBUG the traces of streaming loads and weight syncs) to fn; NULL (the default)
 * drops them. fn is called on the thread that logs, with a line of at most 1023 bytes,
 * borrowed for the call. Process-wide; set it before loading (README, "Logging").
 */
QKEEP_API void qkeep_set_logger(void (*fn)(void *user, enum qkeep_log_level level, const char *msg),
                                void *user);
/*
 * The most verbose level passed to the logger (default QKEEP_LOG_INFO): lines of a higher
 * level are dropped before they are formatted, and the traces that QKEEP_LOG_DEBUG turns on
 * (where a streaming load waited, where each bucket of a sync spent its time) measure
 * nothing while it is lower. Process-wide, like the logger.
 */
QKEEP_API void qkeep_set_log_level(enum qkeep_log_level level);

/* Bytes per element (packed types count their storage element). 0 if invalid or sub-byte. */
QKEEP_API size_t qkeep_dtype_size(enum qkeep_dtype dtype);
/* Bits per element (4 for F4, 6 for F6_*, 8 x the size otherwise), or 0 when invalid.
 * qkeep_dtype_size is 0 for the sub-byte dtypes: use this for them. */
QKEEP_API unsigned qkeep_dtype_bits(enum qkeep_dtype dtype);
/* The safetensors name of a dtype ("F8_E4M3"), or "?" when invalid. */
QKEEP_API const char *qkeep_dtype_name(enum qkeep_dtype dtype);
/* Parses a safetensors dtype name. QKEEP_E_NOTFOUND when unknown. */
QKEEP_API int qkeep_dtype_parse(const char *name, enum qkeep_dtype *out);
/* Elements of a spec (1 for a scalar); bytes = numel * bits / 8 (whole bytes for the sub-byte dtypes'
 * shapes the safetensors format allows). */
QKEEP_API int64_t qkeep_spec_numel(const struct qkeep_spec *spec);
QKEEP_API size_t qkeep_spec_bytes(const struct qkeep_spec *spec);
/* A name for a layer kind ("linear"), or "?" */
QKEEP_API const char *qkeep_layer_kind_name(enum qkeep_layer_kind kind);

/* ---- configuration (INI) ------------------------------------------------- */

/*
 * Reads an INI config: [qkeep] backend, plugin_dir (colon-separated directories); [model]
 * checkpoint, reload_checkpoint, fuse, tp/ep sizes and ranks, quantize and its quantize_* options;
 * [backend.NAME] keys passed to that backend. Unknown sections or keys and bad
 * values fail with QKEEP_E_CONFIG and "file:line: ..." in qkeep_errmsg(); a quantize_* key that the
 * scheme of quantize does not take (qkeep_quantize_option_applies), or one without quantize, fails
 * with QKEEP_E_INVAL and "file:line: [model] KEY does not apply to quantize = SCHEME (...)".
 * On success the caller owns *out (qkeep_config_free).
 */
QKEEP_API int qkeep_config_load(const char *path, qkeep_config **out);
/* Frees a config (NULL is fine). */
QKEEP_API void qkeep_config_free(qkeep_config *cfg);
/* Borrowed strings, NULL when unset. qkeep_config_backend is the first backend of the chain. */
QKEEP_API const char *qkeep_config_backend(const qkeep_config *cfg);
/* [qkeep] backend is an ordered chain ("cuda-nvfp4, cpu-onednn, reference"): how many names it
 * holds (at least 1 in a loaded config), and the i-th (NULL past the end). */
QKEEP_API size_t qkeep_config_backend_count(const qkeep_config *cfg);
QKEEP_API const char *qkeep_config_backend_at(const qkeep_config *cfg, size_t index);
QKEEP_API const char *qkeep_config_plugin_dir(const qkeep_config *cfg);
QKEEP_API const char *qkeep_config_checkpoint(const qkeep_config *cfg);
/* [model] reload_checkpoint: the W1 `qkeep reload` uses by default. */
QKEEP_API const char *qkeep_config_reload_checkpoint(const qkeep_config *cfg);
/* [model] fuse: a fusion map for qkeep_model_set_fusion (checked when the config loads). */
QKEEP_API const char *qkeep_config_fuse(const qkeep_config *cfg);
/* The path the config was read from. */
QKEEP_API const char *qkeep_config_path(const qkeep_config *cfg);

/* ---- plugins --------------------------------------------------------------- */

/* The directory plugins are installed in ($(pkglibdir)). Static string. */
QKEEP_API const char *qkeep_plugin_install_dir(void);

/*
 * Loads the backend NAME from the file "backend-NAME.so", searched in each
 * directory of $QKEEP_PLUGIN_PATH (colon-separated), then `plugin_dir` (may be
 * NULL), then the install directory. Checks the ABI (major exact, minor
 * floor) before anything else runs, then calls the backend's init. Failures
 * name the path, dlerror() and both ABI versions. The caller owns *out.
 */
QKEEP_API int qkeep_plugin_open(const char *name, const char *plugin_dir, qkeep_plugin **out);
/* Like qkeep_plugin_open for an explicit file path. */
QKEEP_API int qkeep_plugin_open_path(const char *path, qkeep_plugin **out);
/* Applies the config's [backend.NAME] keys through backend->configure, after checking each
 * against the keys the backend declares (name, type, values), when it declares them.
 * Errors carry the config's file:line and, for an unknown key, the backend's list. */
QKEEP_API int qkeep_plugin_configure(qkeep_plugin *plugin, const qkeep_config *cfg);
/*
 * Calls fn for each key the backend declares, in its order (a copy; strings borrowed from
 * the plugin). QKEEP_E_NOTFOUND when it declares none (configure alone judges its keys);
 * stops on and returns fn's non-zero value.
 */
QKEEP_API int qkeep_plugin_keys(const qkeep_plugin *plugin,
                                int (*fn)(void *user, const struct qkeep_backend_key *key), void *user);
/* Opens the config's first backend (the head of its chain), from its plugin_dir, and configures it. */
QKEEP_API int qkeep_plugin_open_config(const qkeep_config *cfg, qkeep_plugin **out);
/*
 * Opens and configures every backend of the config's chain, in order, into a new array
 * of *n plugins (the caller frees it with qkeep_plugins_close). A backend whose device
 * is absent still opens (the model skips it); a plugin that is not found, fails to load
 * or refuses its keys fails the call with the config's file:line, and nothing stays open.
 */
QKEEP_API int qkeep_plugins_open_config(const qkeep_config *cfg, qkeep_plugin ***plugins, size_t *n);
/* Closes every plugin of such an array and frees it (NULL is fine). */
QKEEP_API void qkeep_plugins_close(qkeep_plugin **plugins, size_t n);
/* Asks the backend whether its device is present: 0, or QKEEP_E_NODEV with
 * a message in msg (always NUL-terminated). */
QKEEP_API int qkeep_plugin_probe(qkeep_plugin *plugin, char *msg, size_t msg_len);
/* Calls backend fini and dlclose. Models using the plugin must be freed first. */
QKEEP_API void qkeep_plugin_close(qkeep_plugin *plugin);
/* The backend's name, the file it came from, and its table; valid until close. */
QKEEP_API const char *qkeep_plugin_name(const qkeep_plugin *plugin);
QKEEP_API const char *qkeep_plugin_path(const qkeep_plugin *plugin);
QKEEP_API const struct qkeep_backend *qkeep_plugin_backend(const qkeep_plugin *plugin);

/*
 * Calls fn for every "backend-*.so" file in the plugin search path (as
 * qkeep_plugin_open searches it), with the base name of the backend.
 */
QKEEP_API int qkeep_plugin_scan(const char *plugin_dir,
                                int (*fn)(void *user, const char *name, const char *path), void *user);

/* ---- model and layers -------------------------------------------------------- */

/*
 * A new, empty model whose params live in `plugin`'s device memory, with
 * plugin's PWAL and kernels; `plugin` NULL means host memory and no PWAL.
 * The plugin must outlive the model. The caller owns *out.
 */
QKEEP_API int qkeep_model_new(qkeep_plugin *plugin, qkeep_model **out);
/*
 * A new, empty model over an ordered chain of backends: each layer of a loaded checkpoint
 * goes to the first backend whose probe succeeded and whose supports_layer (or, for ABI
 * 1.0 plugins, supports) accepts it, and its params live in that backend's memory. Each
 * plugin is probed here; one whose device is absent is skipped with one warning line
 * (qkeep_model_backend_info keeps why). n 0 is a host-memory model without PWAL, as
 * qkeep_model_new(NULL). The same backend twice is QKEEP_E_INVAL. The plugins must
 * outlive the model; the array itself is not kept.
 */
QKEEP_API int qkeep_model_new_chain(qkeep_plugin *const *plugins, size_t n, qkeep_model **out);

/* One link of a model's chain, as qkeep_model_backend_info reports it. */
struct qkeep_chain_info {
  size_t size;
  const char *name;          /* the backend's name ("host" for a model without plugins) */
  bool usable;               /* its probe found the device */
  const char *probe_message; /* why not, when not usable; borrowed from the model */
  size_t layers;             /* layers it owns now */
};
/* Links in the chain (1 for a model without plugins). */
QKEEP_API size_t qkeep_model_backend_count(const qkeep_model *model);
/* Fills *out for link `index`; out->size says how much the caller knows (0: all). */
QKEEP_API int qkeep_model_backend_info(const qkeep_model *model, size_t index, struct qkeep_chain_info *out);
QKEEP_API void qkeep_model_free(qkeep_model *model);

/*
 * Cold start: reads the checkpoint (a .safetensors file or a Hugging Face directory),
 * plans every layer, gives each its owner from the model's chain (QKEEP_E_UNSUPPORTED,
 * before anything is allocated, when no backend takes a layer: the message names the
 * layer, its scheme and each backend's reason), creates every loader param with exactly
 * its checkpoint bytes in its owner's memory (zero where no tensor writes; a param its
 * tensors write whole is not zeroed first), streams the tensors in, then per layer runs
 * the scheme's normalisation and the owner's PWAL. The model must be empty.
 * On failure the model is left empty and the error names the file, tensor and layer.
 */
QKEEP_API int qkeep_model_load(qkeep_model *model, const char *checkpoint);

/* Where a cold start spent its time, and how many checkpoint bytes it read. */
struct qkeep_load_stats {
  size_t size;
  double open_seconds; /* opening the checkpoint and creating every layer and param (a reload: opening W1) */
  double read_seconds; /* streaming tensors into params */
  double pwal_seconds; /* scheme normalisation and the backend's PWAL */
  int64_t checkpoint_bytes;
  double validate_seconds; /* a reload: checking all of W1 before anything changes (0 for a load) */
};
/* The stats of the model's last successful load. */
QKEEP_API int qkeep_model_load_stats(const qkeep_model *model, struct qkeep_load_stats *out);
/* Memory the model holds in storages (its device), and the peaks since the last reset:
 * the extra memory a load or reload needs is storage_peak - storage_bytes + staging_peak. */
struct qkeep_memory_stats {
  size_t size;
  int64_t storage_bytes;    /* params, buffers and live result tensors, now */
  int64_t storage_peak;     /* the most at any time */
  int64_t staging_peak;     /* host staging for tensors that cannot land directly */
  int64_t pinned_bytes;     /* page-locked host memory kept for streaming to the model's devices (slots x
                               piece of qkeep_load_options, 64 MiB by default, per device backend with
                               asynchronous copies, from its first load to the model's free or a new
                               shape); counted in staging_peak too */
  int64_t kept_scale_bytes; /* host memory kept from the first reload from files to the model's free for
                               the scales a reload checks before it changes anything (at most 256 MiB; the
                               scales beyond are read twice) */
};
/* Fills *out; with reset_peaks, the peaks restart from the current bytes. */
QKEEP_API int qkeep_model_memory(qkeep_model *model, struct qkeep_memory_stats *out, bool reset_peaks);
/* Calls fn after each layer of a load (for a progress line). fn NULL: none. */
QKEEP_API void qkeep_model_set_progress(qkeep_model *model,
                                        void (*fn)(void *user, size_t done, size_t total, const char *layer),
                                        void *user);
/*
 * How loads stream bytes to a device backend with asynchronous copies (ABI 1.2): reader threads
 * fill a ring of pinned host slots from the checkpoint while the calling thread starts each
 * slot's copy to the device (docs/ABI.md, "Copy fences"). For measurements and tuning: the
 * defaults are the shape docs/PERFORMANCE.md measured best. A field that is 0, or lies past
 * `size`, takes its default.
 */
struct qkeep_load_options {
  size_t size;           /* sizeof(struct qkeep_load_options) as the caller knows it (0: all of it) */
  int stream_slots;      /* pinned slots in the ring, 2 to 128 (one holds small copies); 0: 32 */
  size_t stream_piece;   /* bytes per slot, 4096 to 64 MiB; 0: 2 MiB. Small tensors share a slot */
  int stream_readers;    /* reader threads, 1 to 64; 0: one per online core, at most 16 */
  bool stream_no_fences; /* true: ignore the backend's copy fences (ABI 1.3) and wait for the whole
                            device when no slot is free, as with a 1.2 backend; false: use them */
};
/*
 * Sets how the model's later loads, reloads and syncs stream to its device backends. The
 * options are copied (the struct stays the caller's); only the first options->size bytes are
 * read. A ring an earlier load made with another shape is freed here (pinned_bytes drops) and
 * the next load makes it anew; call it between loads, not while one of the model runs.
 * QKEEP_E_INVAL for a NULL argument, or a field out of its range, naming the field, its value
 * and the range ("stream_slots = 1: expected 2 to 128"); the model's options are then unchanged.
 */
QKEEP_API int qkeep_model_set_load_options(qkeep_model *model, const struct qkeep_load_options *options);
/*
 * Sets the fusion map before a load: "qkv_proj=q_proj+k_proj+v_proj,gate_up_proj=gate_proj+up_proj"
 * (the default), or "none". Up to 8 members per rule. QKEEP_E_INVAL on a malformed spec.
 */
QKEEP_API int qkeep_model_set_fusion(qkeep_model *model, const char *spec);

/* ---- tensor and expert parallelism (one rank's slice) ----------------------------- */

/*
 * Where this process sits in a tensor-parallel (TP) and expert-parallel (EP) group. A
 * size of 0 or 1 means no cut. With tp_size T, column-parallel layers (q/k/v/gate/up and
 * their fused qkv_proj / gate_up_proj) keep N/T output rows of every fused member (each
 * member cut, then fused), row-parallel layers (o_proj, down_proj, out_proj) keep K/T
 * input columns; everything else (embeddings, lm_head, norms, routers, kv scales) is
 * replicated whole. With ep_size E, an MoE layer keeps experts [ep_rank * X/E, +X/E)
 * whole; with ep_size 1 and tp_size T each expert is cut as a linear (w13 column-, w2
 * row-parallel). Cuts are in stored units: packed codes, block/group scales and zero
 * points each cut with their blocks; per-tensor scales, act-order g_idx of a column cut
 * and row-parallel bias are repeated (the engine adds a row-parallel bias once, after its
 * all-reduce, as vLLM's rank 0 does). docs/SHARDING.md has the rules per scheme.
 */
struct qkeep_parallel {
  size_t size; /* sizeof(struct qkeep_parallel) as the caller knows it (0: all of it) */
  int tp_size, tp_rank;
  int ep_size, ep_rank;
};
/*
 * Sets the model's place before a load: every load and reload after it creates and reads
 * only this rank's slice. Each cut dimension must split into whole stored units: for
 * every rank a multiple of lcm(pack factor, block or group size) - the backend's own tile
 * is its supports answer on the rank's dims - or the load fails before anything is
 * allocated (QKEEP_E_UNSUPPORTED naming the layer, the dimension and the numbers).
 * QKEEP_E_INVAL for a rank outside its size; QKEEP_E_STATE when the model holds layers.
 */
QKEEP_API int qkeep_model_set_parallel(qkeep_model *model, const struct qkeep_parallel *parallel);
/* [model] tp_size, tp_rank, ep_size, ep_rank of a config (all 0 when absent). */
QKEEP_API int qkeep_config_parallel(const qkeep_config *cfg, struct qkeep_parallel *out);

/* How a layer is cut across ranks. */
enum qkeep_shard_role {
  QKEEP_SHARD_REPLICATED = 0, /* every rank holds it whole */
  QKEEP_SHARD_COLUMN = 1,     /* output rows N cut (per fused member) */
  QKEEP_SHARD_ROW = 2,        /* input columns K cut */
  QKEEP_SHARD_EXPERT = 3,     /* MoE: whole experts per EP rank */
  QKEEP_SHARD_MOE_TP = 4,     /* MoE: every expert cut, w13 by column and w2 by row */
};
/* A layer's cut: its role, the group it is cut over, and the full (unsharded) dims;
 * qkeep_layer_get_info gives the rank's own. */
struct qkeep_layer_shard {
  size_t size;
  enum qkeep_shard_role role;
  int ranks, rank;      /* 1 and 0 for a replicated layer */
  int64_t n, k;         /* full N (sum over fused shards) and K */
  int64_t shard_n[8];   /* full N of each fused shard */
  int64_t experts;      /* full expert count (0 unless MoE) */
  int64_t first_expert; /* the first expert this rank holds (EXPERT role) */
};
/* Fills *out (out->size: what the caller knows, 0 for all). */
QKEEP_API int qkeep_layer_get_shard(const qkeep_layer *layer, struct qkeep_layer_shard *out);
/* A name for a role ("column"), or "?". */
QKEEP_API const char *qkeep_shard_role_name(enum qkeep_shard_role role);
/* The param a full checkpoint name loads into (and its layer), or NULL: after PWAL every
 * checkpoint name still resolves to the same object. A name that loads into two places
 * resolves to the first in layer order. O(1) expected (a hash of every checkpoint name). */
QKEEP_API qkeep_param *qkeep_model_lookup(const qkeep_model *model, const char *checkpoint_name,
                                          qkeep_layer **layer);

/* Layers in model order (name order for a loaded checkpoint); NULL past the end or for an
 * unknown name (found by hash, O(1) expected). Layers belong to the model. */
QKEEP_API size_t qkeep_model_layer_count(const qkeep_model *model);
QKEEP_API qkeep_layer *qkeep_model_layer(const qkeep_model *model, size_t index);
QKEEP_API qkeep_layer *qkeep_model_find_layer(const qkeep_model *model, const char *name);

/*
 * Adds an empty layer (engines that build layers by hand, and tests). The
 * name must be new. The layer belongs to the model.
 */
QKEEP_API int qkeep_layer_add(qkeep_model *model, const char *name, enum qkeep_layer_kind kind,
                              const char *scheme, qkeep_layer **out);
/* The layer's name, scheme, kind and dims; out->size says how much the caller knows
 * (0: all of it). The strings are borrowed from the layer. */
QKEEP_API int qkeep_layer_get_info(const qkeep_layer *layer, struct qkeep_layer_info *out);
/* The name of the backend that owns the layer (runs its PWAL and kernel, holds its params),
 * or NULL for a host-only model or a hand-built layer that has no param yet. */
QKEEP_API const char *qkeep_layer_backend(const qkeep_layer *layer);
/* Sets the dims of a hand-built layer (info->name and scheme are ignored). QKEEP_E_INVAL for a
 * negative dimension, or a linear or MoE layer with N = 0 or K = 0 (an MoE with no experts): no
 * kernel can run one, as a checkpoint's loader refuses it. */
QKEEP_API int qkeep_layer_set_dims(qkeep_layer *layer, const struct qkeep_layer_info *info);

/*
 * Creates a loader param: storage of exactly spec's bytes in the memory of the layer's
 * owner, zero-filled, registered under `name` (its checkpoint name, and initial runtime
 * name). The census counts it as a loader param. A hand-built layer gets its owner from
 * the chain at its first param, from the scheme, kind and dims set so far
 * (QKEEP_E_UNSUPPORTED, with each backend's reason, when no backend takes it).
 */
QKEEP_API int qkeep_param_create(qkeep_layer *layer, const char *name, const struct qkeep_spec *spec,
                                 qkeep_param **out);
/* The param registered under name (checkpoint or runtime name), or NULL. */
QKEEP_API qkeep_param *qkeep_param_lookup(const qkeep_layer *layer, const char *name);
QKEEP_API const char *qkeep_param_checkpoint_name(const qkeep_param *param);
QKEEP_API const char *qkeep_param_runtime_name(const qkeep_param *param);
QKEEP_API enum qkeep_param_state qkeep_param_state(const qkeep_param *param);
QKEEP_API int qkeep_param_view(const qkeep_param *param, struct qkeep_view *out);
/* The spec the param was created with (what reload restores). */
QKEEP_API const struct qkeep_spec *qkeep_param_create_spec(const qkeep_param *param);

/* ---- the rules (also in struct qkeep_host for backends) ------------------------ */

/* A result tensor on the layer's device; freed by qkeep_tensor_free or consumed by replace. */
QKEEP_API int qkeep_tensor_new(qkeep_layer *layer, const struct qkeep_spec *spec, qkeep_tensor **out);
QKEEP_API void *qkeep_tensor_data(qkeep_tensor *tensor);
QKEEP_API void qkeep_tensor_free(qkeep_tensor *tensor);

/*
 * Replaces param `name`'s contents with `result`, keeping the object. If the
 * result fits the param's storage capacity it is copied into a prefix of it
 * (data pointer unchanged); otherwise the param is rebound to the result's
 * storage, which is larger, so C1 still holds. Always consumes `result`.
 * QKEEP_E_STATE for a released param.
 */
QKEEP_API int qkeep_replace(qkeep_layer *layer, const char *name, qkeep_tensor *result);
/* The result already sits in the prefix of the param's own storage: only the
 * view changes to `spec`. QKEEP_E_RULE if spec does not fit the capacity. */
QKEEP_API int qkeep_replace_in_place(qkeep_layer *layer, const char *name, const struct qkeep_spec *spec);
/* Registers the object under `src` also as `dst` and makes dst its runtime
 * name. A no-op if dst already names it; QKEEP_E_EXISTS if dst names another. */
QKEEP_API int qkeep_move(qkeep_layer *layer, const char *src, const char *dst);
/* Keeps object and bytes; no kernel reads it any more. */
QKEEP_API int qkeep_retire(qkeep_layer *layer, const char *name);
/* Empties the storage; the census reports the reason. Use only where a
 * kernel's copy is opaque and keeping the source would double memory. */
QKEEP_API int qkeep_release(qkeep_layer *layer, const char *name, const char *reason);
/* A kernel-only buffer; returns the existing one (same storage) when a buffer
 * of that name and byte size exists. A new buffer is zero-filled. */
QKEEP_API int qkeep_add_buffer(qkeep_layer *layer, const char *name, const struct qkeep_spec *spec,
                               struct qkeep_view *out);
/* View of a param or buffer by name, whatever its state. */
QKEEP_API int qkeep_view_of(const qkeep_layer *layer, const char *name, struct qkeep_view *out);
/* The live param under name, or NULL when absent, retired or released. */
QKEEP_API qkeep_param *qkeep_get_live_param(const qkeep_layer *layer, const char *name);
/* Every live param once, under its runtime name. Stops when fn returns non-zero (returned). */
QKEEP_API int qkeep_kernel_params(const qkeep_layer *layer,
                                  int (*fn)(void *user, const char *name, const struct qkeep_view *v),
                                  void *user);
/* Every registered name (an alias once per name); is_buffer tells buffers apart. */
QKEEP_API int qkeep_foreach_name(const qkeep_layer *layer,
                                 int (*fn)(void *user, const char *name, bool is_buffer,
                                           const struct qkeep_view *v),
                                 void *user);
/* Every distinct storage of the model once (params and buffers): its device
 * address, capacity and one name that uses it. */
QKEEP_API int qkeep_foreach_storage(const qkeep_model *model,
                                    int (*fn)(void *user, const char *layer, const char *name,
                                              const void *data, size_t capacity),
                                    void *user);

/* ---- reload ------------------------------------------------------------------------ */

/* Reload only the layers the new weights have tensors for (the others keep theirs). */
#define QKEEP_RELOAD_PARTIAL 1u

/*
 * Layerwise reload W0 -> W1 in place: validates all of W1 first (every tensor the
 * model loads, with its dtype, shape and valid scale values; nothing W1 holds is
 * unknown to the model; a directory's quantization config agrees), so a bad W1
 * changes nothing and returns the reason. Then per layer: each loader param gets its
 * checkpoint view back over its own storage, W1's bytes land, normalisation and the
 * backend's PWAL run again in place. The result equals a cold start on W1 byte for
 * byte (qkeep_digest) and no kernel data pointer moves. W1 may be sharded differently.
 * If applying fails part-way, the touched layers are reloaded from the checkpoint the
 * model held (W0) and the error returned; if that is impossible, the model refuses to
 * run (QKEEP_E_STATE) until a reload succeeds: it never serves a silent mix.
 */
QKEEP_API int qkeep_model_reload(qkeep_model *model, const char *checkpoint, unsigned flags);

/* A named tensor in the caller's memory: host, or when on_device the memory of the backend that
 * owns the layer it loads into (qkeep_layer_backend). */
struct qkeep_named_tensor {
  const char *name; /* checkpoint name, e.g. "model.layers.0.mlp.down_proj.weight_scale" */
  struct qkeep_spec spec;
  const void *data;
  bool on_device;
};

/*
 * The same reload from named buffers (RL weight sync: no files). The buffers are
 * borrowed for the call. After it, no checkpoint holds the model's weights, so a later
 * failed reload cannot roll back (the model then refuses to run until one succeeds).
 */
QKEEP_API int qkeep_model_reload_tensors(qkeep_model *model, const struct qkeep_named_tensor *tensors,
                                         size_t n, unsigned flags);

/*
 * Direct load: writes one checkpoint tensor's bytes into the live param it loads into,
 * when that param still holds the checkpoint layout (neither PWAL nor normalisation
 * transformed it, it is live, not a shard shared by fused layers). Otherwise
 * QKEEP_E_STATE, pointing to qkeep_model_reload.
 */
QKEEP_API int qkeep_model_load_tensor(qkeep_model *model, const struct qkeep_named_tensor *tensor);

/* Reads every tensor of a checkpoint once (the floor for any load): bytes and seconds. */
QKEEP_API int qkeep_checkpoint_read_all(const char *path, int64_t *bytes, double *seconds);

/* ---- weight sync: W1 as a stream of packed buckets (RL trainers) --------------------- */

/* One full (unsharded) checkpoint tensor in a bucket, `offset` bytes into its buffer. */
struct qkeep_bucket_tensor {
  const char *name; /* checkpoint name */
  struct qkeep_spec spec;
  size_t offset;
};
/* A bucket as the trainers send it: tensors packed back to back (or at any offsets that do
 * not overlap) in one contiguous buffer, host memory or, when on_device, the memory of the
 * backend that owns the layers the tensors load into. */
struct qkeep_bucket {
  size_t size; /* sizeof(struct qkeep_bucket) as the caller knows it (0: all of it) */
  const struct qkeep_bucket_tensor *tensors;
  size_t n;
  const void *data;
  size_t nbytes;
  bool on_device;
};

typedef struct qkeep_sync qkeep_sync;

/*
 * Starts a weight sync of the model (this rank) to W1. The model must hold a loaded
 * checkpoint. The caller owns *out: finish it with qkeep_sync_end (or qkeep_sync_abort).
 */
QKEEP_API int qkeep_sync_begin(qkeep_model *model, qkeep_sync **out);
/*
 * Takes one bucket. First it validates all of it, changing nothing on failure: names unique
 * and checkpoint names of the model (or of another expert-parallel rank's experts, which
 * this rank skips), not sent before in this sync, dtypes and shapes the model's (full,
 * unsharded), extents inside the buffer and not overlapping. Then every layer whose
 * tensors have all arrived is reloaded in place from them (each rank takes its slice), as
 * qkeep_model_reload_tensors does: scales checked first, normalisation and PWAL again, no
 * data pointer moved. Tensors of layers still waiting for later buckets are copied (host
 * memory, or the bucket's device) until their layer completes, so the extra memory is one
 * bucket plus the tensors of the layers a bucket boundary splits. The bucket is borrowed for
 * the call. Any failure fails the sync: the layers it touched are put back from the
 * checkpoint the model held before the sync (W0) when there is one and its files are still
 * the very files the model read (their identity recorded then: device, inode, size,
 * modification and change times), else the model refuses to run until a reload succeeds;
 * later calls return QKEEP_E_STATE. Between begin and end the layers synced so far hold W1;
 * after a successful sync no file holds the model's weights (a later failed reload cannot
 * roll back to W0).
 */
QKEEP_API int qkeep_sync_bucket(qkeep_sync *sync, const struct qkeep_bucket *bucket);
/*
 * Ends the sync and frees it. 0 when every tensor of the model arrived: the model then
 * equals a cold (sharded) start on W1. Otherwise QKEEP_E_NOTFOUND naming the first missing
 * tensor, and the model is put back (or refuses to run) as above. NULL is fine.
 */
QKEEP_API int qkeep_sync_end(qkeep_sync *sync);
/* Abandons a sync: its layers are put back as on failure; frees it. NULL is fine. */
QKEEP_API void qkeep_sync_abort(qkeep_sync *sync);

/*
 * The sender's plan: every checkpoint tensor the model loads, each once (a tensor that
 * feeds two params, e.g. one kv_scale for k and v, is sent once; a tied lm_head sends
 * nothing of its own), in layer order, each layer's scale tensors before its other tensors
 * (a receiver checks the scales first, and copies them from a device bucket as one run),
 * packed into buckets of at most bucket_bytes (a tensor larger than that gets a bucket of its
 * own), offsets aligned to 256 bytes; a layer that fits a bucket starts a new one rather than
 * straddle two (the receiver would keep a copy of its first part until the rest arrived). Built
 * from a model loaded with the full (one-rank) layout or any rank: shapes are the full ones.
 * *out (n entries, malloc'd; free with qkeep_sync_plan_free) holds name (borrowed from the
 * model), spec, offset and the bucket index; *n_buckets the count.
 */
struct qkeep_sync_entry {
  struct qkeep_bucket_tensor tensor;
  size_t bucket;
};
QKEEP_API int qkeep_sync_plan(const qkeep_model *model, size_t bucket_bytes, struct qkeep_sync_entry **out,
                              size_t *n, size_t *n_buckets);
QKEEP_API void qkeep_sync_plan_free(struct qkeep_sync_entry *entries);

/*
 * A broadcast transport: moves a bucket's bytes from the trainer rank to every rank.
 * broadcast(ctx, buf, nbytes, root): on rank `root` buf holds the bytes, on the others they
 * land there; 0 or a negative QKEEP_E_* with qkeep_errmsg set. close frees ctx.
 */
struct qkeep_transport {
  size_t size;
  const char *name; /* "in-process", "nccl" */
  void *ctx;
  int (*broadcast)(void *ctx, void *buf, size_t nbytes, int root);
  void (*close)(void *ctx);
};
/*
 * Receives one bucket through a transport into `buf` (nbytes, in the memory bucket->on_device
 * names; the root's holds the bytes already), then qkeep_sync_bucket with bucket->data = buf.
 */
QKEEP_API int qkeep_sync_receive(qkeep_sync *sync, struct qkeep_transport *transport, int root,
                                 const struct qkeep_bucket *bucket);

/*
 * The in-process transport, for tests and engines whose ranks share one process: `ranks`
 * endpoints (*out[i], i < ranks, one per rank; the caller frees each with its close). The
 * root's broadcast publishes its buffer (borrowed until the root's next call); each other
 * rank's broadcast then copies the published bytes (host memory). Calls are made one after
 * another, the root's first (it is not thread-safe). A non-root call with nothing published,
 * or a size that differs, is QKEEP_E_STATE.
 */
QKEEP_API int qkeep_transport_inprocess(int ranks, struct qkeep_transport **out);

/*
 * NCCL broadcast from the trainer rank: `library` (a path), else $QKEEP_NCCL_LIBRARY (ignored
 * in a set-id process), else libnccl.so.2 through ld.so's search, is dlopened here, so qkeep
 * links no CUDA library. A path must pass the plugins' trust checks (the file and its
 * directory owned by root or the caller, writable by no one else): otherwise QKEEP_E_PLUGIN
 * naming it. NCCL's configuration is the caller's (qkeep never changes the environment):
 * where NVLink multicast must stay off, set NCCL_NVLS_ENABLE=0 before the process's first NCCL
 * call. `unique_id` is the NCCL_UNIQUE_ID_BYTES (128) bytes rank 0 got from
 * qkeep_nccl_unique_id and shared out of band. Buffers are device memory of the current CUDA
 * device (the backend's, made current by the model's load); each broadcast is enqueued on the
 * default stream, and qkeep_sync_receive synchronises the model's devices before it reads the
 * bucket. Once opened, libnccl stays loaded until the process ends (NCCL's
 * own threads and its CUDA runtime's handlers outlive the calls that start them).
 * QKEEP_E_NOTFOUND naming the library and dlerror() when it cannot be loaded,
 * QKEEP_E_DEVICE with NCCL's message when NCCL fails.
 */
QKEEP_API int qkeep_nccl_unique_id(const char *library, unsigned char unique_id[128]);
QKEEP_API int qkeep_transport_nccl(const char *library, int ranks, int rank,
                                   const unsigned char unique_id[128], struct qkeep_transport **out);

/* ---- audit ---------------------------------------------------------------------- */

#define QKEEP_CENSUS_MAX_REASONS 8

struct qkeep_census {
  size_t size;
  int64_t loader_params;   /* params created from the checkpoint */
  int64_t registered_same; /* still registered under their checkpoint name as the same object */
  int64_t missing;         /* loader_params - registered_same */
  int64_t c1;              /* storage capacity below checkpoint bytes (released excluded) */
  int64_t c2;              /* pairs of distinct objects sharing bytes */
  int64_t aliases;         /* extra names of an object */
  int64_t retired;
  int64_t retired_bytes;
  int64_t released;
  int64_t released_bytes;                       /* checkpoint bytes given up */
  int reasons;                                  /* distinct release reasons, up to QKEEP_CENSUS_MAX_REASONS */
  const char *reason[QKEEP_CENSUS_MAX_REASONS]; /* borrowed from the model */
  int64_t buffers;
  int64_t kept_bytes;  /* bytes no kernel reads: retired + slack past live views */
  int64_t total_bytes; /* every distinct storage's capacity */
  double kept_share;   /* kept_bytes / total_bytes */
  /* Appended (0 past the caller's size): unquantized checkpoint tensors quantized on load
   * (qkeep_model_set_quantize): their params (state QKEEP_PARAM_QUANTIZED, registered, 0 bytes kept),
   * and their checkpoint bytes, which land quantized in the kernel params. */
  int64_t quantized_on_load;
  int64_t quantized_on_load_bytes;
};

/* Counts the model against the rules. Never fails on a valid model. */
QKEEP_API int qkeep_census(const qkeep_model *model, struct qkeep_census *out);

/* 128-bit XXH3 digest of every registered tensor of every layer, in layer
 * order and by name: name, dtype, shape and bytes of its current view. */
struct qkeep_digest {
  uint64_t hi, lo;
};
/* Fills *out. Reads every tensor through the device's memory ops (in chunks). */
QKEEP_API int qkeep_digest(const qkeep_model *model, struct qkeep_digest *out);
/* Hex form, 32 characters + NUL. */
QKEEP_API void qkeep_digest_hex(const struct qkeep_digest *d, char out[33]);

/* One GEMM of the forward check: a linear layer, or an MoE expert's w13 or w2. */
struct qkeep_layer_error {
  size_t size;
  const char *layer; /* borrowed from the model */
  const char *scheme;
  int32_t expert; /* MoE: the expert; -1 for a linear layer */
  enum qkeep_moe_matrix matrix;
  int64_t m, n, k;
  double max_abs; /* max |y - y_ref| */
  double max_rel; /* max_abs / max |y_ref| */
};

/*
 * Runs every linear layer and MoE expert matrix of `model` and of `reference`
 * (the same checkpoint, loaded with the reference backend) on the same m rows
 * of uniform random activations in [-1, 1) drawn from `seed`, and calls fn
 * with the differences. Stops and returns fn's non-zero value.
 */
QKEEP_API int qkeep_compare(qkeep_model *model, qkeep_model *reference, int64_t m, uint64_t seed,
                            int (*fn)(void *user, const struct qkeep_layer_error *e), void *user);

/* ---- quantizing checkpoints ------------------------------------------------------ */

/* Where a qkeep_quantize stands (progress callback) or how it went (summary). Input bytes and tensors
 * count every tensor of the input; a tensor is done when its output bytes are written. */
struct qkeep_quantize_progress {
  size_t size;
  int64_t tensors_done, tensors_total;
  int64_t bytes_done, bytes_total; /* input bytes */
  int64_t bytes_written;           /* output bytes, headers included */
  double seconds;                  /* since qkeep_quantize started */
  int threads;                     /* threads used, the calling one included */
  int64_t peak_buffer_bytes;       /* the most bytes its buffers held at once (the memory bound) */
  int64_t buffer_bound;            /* the bound it keeps them under (see qkeep_quantize) */
};

struct qkeep_quantize_options {
  size_t size;
  const char *scheme;      /* modelopt-nvfp4, ct-nvfp4, mxfp4, w8a8-int8, gptq-int4, awq-int4 */
  int64_t group_size;      /* int4 group (default 128; must not exceed any linear's K) */
  bool asym_weights;       /* int4 with zero points */
  bool static_input;       /* w8a8: static per-tensor input scales (else dynamic per token) */
  bool asym_input;         /* w8a8: activations with a zero point */
  bool kv_cache_scales;    /* write FP8 k_scale / v_scale for each attention block */
  float activation_amax;   /* the |x| bound static scales are derived from (no calibration; default 1) */
  int64_t max_shard_bytes; /* > 0: shard the output (model-0000i-of-0000n + index) */
  /* Appended (read only when size covers them; absent means 0 / NULL): */
  int threads; /* worker threads, the calling thread included; 0: every online core */
  /* (optional) called on the calling thread, about 10 times a second and once at the end */
  void (*progress)(void *user, const struct qkeep_quantize_progress *p);
  void *progress_user;
  struct qkeep_quantize_progress *summary; /* (optional) filled on success (its size set by the caller) */
  /*
   * (optional) Polled on the calling thread between pieces of work (a unit, an 8 MiB chunk of a
   * copied tensor, at least every 0.1 s while waiting); non-zero stops the run, which removes what
   * it wrote and returns QKEEP_E_INTERRUPTED. It must not block or call qkeep. The library installs
   * no signal handler: a program stops a run on SIGINT by a handler that sets a flag this returns.
   */
  int (*cancel)(void *user);
  void *cancel_user;
  /* Replace an existing out_dir, once the new output is whole (one atomic exchange where the file
   * system has it); only a directory that holds nothing but files qkeep quantize writes. */
  bool replace_existing;
};

/*
 * Writes out_dir (a new directory) as a checkpoint of opts->scheme from the
 * unquantized checkpoint `in` (a .safetensors file or a Hugging Face
 * directory), with the scheme's real tensor names, config.json and, for
 * ModelOpt, hf_quant_config.json. Fused shards (q/k/v, gate/up, each expert's
 * gate/up) share one NVFP4 global scale. Deterministic: the same input and
 * options give the same bytes, whatever the number of threads.
 *
 * Output: missing parent directories are created (as mkdir -p). The files are
 * written in a private directory beside out_dir (".NAME.qkeep-XXXXXX") and
 * renamed to out_dir only once whole, so out_dir never holds a partial output,
 * even if the process is killed. An existing out_dir is QKEEP_E_EXISTS unless
 * replace_existing. On failure or cancel nothing is left behind (the staging
 * directory and the parents this call made are removed), and the error is the
 * one a single thread reports (the first failing tensor in the input's name
 * order); file errors are classed by errno (QKEEP_E_NOTFOUND,
 * QKEEP_E_PERMISSION, QKEEP_E_READONLY, QKEEP_E_NOSPACE, else QKEEP_E_IO) and
 * name out_dir's final file, never a temporary one. A scheme it does not write
 * is QKEEP_E_UNSUPPORTED, naming those it does.
 *
 * Streaming: the output's headers are laid out from the input's header before
 * any data is read (every output size follows from the input shapes and the
 * scheme); then each tensor is read, quantized by row blocks on `threads`
 * threads, and written at its offset. A unit of work is one tensor, or one
 * NVFP4 fusion group (q/k/v or gate/up: the tensors that share a global
 * scale). Units stay in memory (input, output and scratch bytes) only while in
 * flight, and at most 2 x the largest unit's bytes are in flight (one unit of
 * any size always is), plus 1 MiB of scratch per thread and an 8 MiB buffer
 * for tensors copied unchanged (copied in chunks): peak memory is that bound,
 * not the model's size (summary->buffer_bound and ->peak_buffer_bytes).
 */
QKEEP_API int qkeep_quantize(const char *in, const char *out_dir, const struct qkeep_quantize_options *opts);

/*
 * Online quantization: the model's later loads take unquantized checkpoints (BF16, F16 or F32; a
 * .safetensors file, shards, a Hugging Face directory) and quantize them on load into options->scheme,
 * with the options qkeep_quantize takes. A load then gives exactly the model (digest, census, every
 * kernel tensor) that qkeep_quantize with the same options followed by a cold start gives, on any chain
 * and any tensor-parallel rank: each layer is planned as the quantized checkpoint would be (its owner
 * chosen by the chain as for that checkpoint), and its tensors are quantized on the host by the offline
 * quantizer's code, on options->threads threads (0: every online core; started once per load), unit by
 * unit (a weight, or an NVFP4 fusion group: q/k/v, gate/up, an expert's w1/w3, whose members share one
 * global scale), then land in the owner's memory; the next unit is read and quantized while one lands
 * and while a layer's PWAL runs, so at most two units' unquantized bytes are held. The unquantized names stay
 * checkpoint names of the model (qkeep_model_lookup gives a param of state QKEEP_PARAM_QUANTIZED, which keeps
 * no bytes); reloads and syncs take them (qkeep_sync_plan plans them) and quantize in place; docs/RULES.md
 * has the rules. options NULL: loads take checkpoints as they are again. The options are copied (only the
 * first options->size bytes read). Call it on an empty model, before a load: QKEEP_E_STATE otherwise.
 * QKEEP_E_INVAL for the fields only a written output has (max_shard_bytes, replace_existing, progress,
 * summary, cancel) or a bad value (as qkeep_quantize); QKEEP_E_UNSUPPORTED for a scheme qkeep quantize
 * does not write. A load of a checkpoint that is already quantized is QKEEP_E_INVAL.
 */
QKEEP_API int qkeep_model_set_quantize(qkeep_model *model, const struct qkeep_quantize_options *options);
/*
 * Whether qkeep quantize's option `option` applies to `scheme`, for a program that takes the options by
 * name and refuses, rather than ignores, one the scheme would not use (the qkeep command's flags and a
 * config's [model] quantize_* keys are checked by this one table). option: "group", "asym",
 * "static-input", "asym-input", "kv-scales", "activation-amax" or "threads" (kv-scales and threads apply
 * to every scheme). opts (NULL: none) are the options given with it: activation-amax sets static
 * scales, so it applies only where one is written (NVFP4's input scales, w8a8-int8 with static_input,
 * kv_cache_scales). 0: it applies. QKEEP_E_INVAL: it does not; *why (when why is not NULL) then points to
 * a static sentence saying where it applies and why. QKEEP_E_NOTFOUND: no such option.
 */
QKEEP_API int qkeep_quantize_option_applies(const char *scheme, const char *option,
                                            const struct qkeep_quantize_options *opts, const char **why);
/*
 * [model] quantize = SCHEME of a config, with its options (quantize_group, quantize_asym,
 * quantize_static_input, quantize_asym_input, quantize_kv_scales, quantize_activation_amax,
 * quantize_threads; absent ones 0), into *out (out->size: what the caller knows, 0 for all;
 * scheme borrowed from the config), for qkeep_model_set_quantize. QKEEP_E_NOTFOUND when the
 * config names no scheme (nothing is set).
 */
QKEEP_API int qkeep_config_quantize(const qkeep_config *cfg, struct qkeep_quantize_options *out);

/* ---- the engine forward -------------------------------------------------------- */

/*
 * What qkeep_layer_forward computes. Activations live in the layer's memory (device memory
 * of the device qkeep_layer_device names, host memory for a CPU backend), row-major and
 * contiguous; x 16-byte aligned.
 *   linear:        y[m, N] = x[m, K] W^T (+ bias)
 *   MoE, one expert (topk 0): W13 y[m, 2I] = x[m, H] w13[expert]^T; W2 y[m, H] = x[m, I] w2^T
 *   MoE, routed (topk > 0, `expert` ignored): W13 takes x[m, H] to y[m * topk, 2I], one row
 *     per (token, slot) with the expert topk_ids[t, s]; W2 takes x[m * topk, I] to y[m, H],
 *     the sum over slots of topk_weights[t, s] times the slot's row.
 * x F32, BF16 or F16; y F32 or x's dtype. N, K, H = K and 2I = N as qkeep_layer_get_info
 * gives them.
 */
struct qkeep_forward_args {
  size_t size; /* sizeof(struct qkeep_forward_args): the struct grows by appending */
  int64_t m;   /* rows (tokens); 0 does nothing */
  const void *x;
  enum qkeep_dtype x_dtype;
  void *y;
  enum qkeep_dtype y_dtype;
  int32_t expert;               /* MoE without routing: which expert */
  enum qkeep_moe_matrix matrix; /* MoE: QKEEP_MOE_W13 or QKEEP_MOE_W2 */
  int32_t topk;                 /* MoE: > 0 for routed; 0 otherwise */
  const int32_t *topk_ids;      /* routed: [m, topk] expert ids, in the layer's memory */
  const float *topk_weights;    /* routed W2: [m, topk] router weights, in the layer's memory */
  void *stream;    /* device layers: the cudaStream_t / hipStream_t to run on; NULL: legacy default */
  void *workspace; /* scratch in the layer's memory, >= qkeep_layer_workspace bytes, 256-aligned */
  size_t workspace_bytes;
};

/*
 * Runs a layer's kernel on activations the caller owns: the engine's forward.
 *
 * Thread and stream: any thread, one call at a time per layer's model unless the owner's
 * docs say otherwise; a device layer's work is enqueued on args->stream and the call may
 * return before it is done (the caller synchronises the stream when it needs y). A host
 * layer computes before it returns.
 * What it does not do, for a layer whose owner is graph-safe (qkeep_layer_device's
 * graph_safe): allocate or free memory, synchronise the device or a stream, copy to or from
 * the host, or launch work on another stream; so the call can be captured in a CUDA graph
 * (cudaStreamCaptureModeGlobal). Everything it reads is a live param, backend state made at
 * PWAL, or the workspace.
 * Reloads: never concurrently with qkeep_model_reload, a sync or a load of the same model.
 * After a reload or sync the same call with the same pointers (or the replay of a graph
 * captured before it) computes with the new weights: no param, buffer or PWAL state moves.
 * Errors: QKEEP_E_INVAL (null or misshaped arguments, an expert out of range, a workspace
 * smaller than qkeep_layer_workspace asks, named in the detail); QKEEP_E_UNSUPPORTED (a kind
 * without a forward: embeddings, norms, kv scales; a dtype pair other than those above; an
 * owner without kernels or without routed MoE); QKEEP_E_STATE (a reload failed and could not
 * roll back). A failure inside a kernel launch returns the backend's error; nothing is
 * written to y then, or y is partly written (the caller's buffer, not a param).
 */
QKEEP_API int qkeep_layer_forward(qkeep_layer *layer, const struct qkeep_forward_args *args);

/*
 * The workspace bytes qkeep_layer_forward needs for these arguments (the pointers and the
 * stream are not read) into *bytes; 0 when it needs none. The answer for a given m, dtypes,
 * matrix and topk never changes over the model's life (reloads included), and a smaller m
 * never needs more, so an engine sizes one workspace for its largest batch once. Same errors
 * as qkeep_layer_forward for arguments it would refuse.
 */
QKEEP_API int qkeep_layer_workspace(qkeep_layer *layer, const struct qkeep_forward_args *args, size_t *bytes);

/* Where a layer lives and what its forward promises (qkeep_layer_device). */
struct qkeep_layer_device {
  size_t size;                 /* set by the caller: sizeof(struct qkeep_layer_device) */
  enum qkeep_device_type type; /* of its params' memory (and the activations qkeep_layer_forward takes) */
  int index;                   /* the device ordinal; 0 for host memory */
  bool forward;                /* the layer has a forward: a linear or MoE layer whose owner has kernels */
  bool graph_safe;             /* the owner promises QKEEP_BACKEND_F_GRAPH_SAFE */
  bool routed;                 /* an MoE layer whose owner runs routed MoE (topk > 0) */
};

/* Fills *out (out->size set by the caller; fields past it are not written). QKEEP_E_INVAL for
 * a NULL argument. */
QKEEP_API int qkeep_layer_device(const qkeep_layer *layer, struct qkeep_layer_device *out);

/* ---- kernels, host f32 (the forward check) ------------------------------------------- */

/*
 * y[M, N] = x[M, K] W^T through the backend's kernel for a linear layer; x and
 * y are host f32 arrays, moved to and from the device by the core, which also
 * allocates the workspace and waits for the result: for checks and tools, not for an
 * engine's loop (qkeep_layer_forward).
 */
QKEEP_API int qkeep_layer_apply_f32(qkeep_layer *layer, int64_t m, const float *x, float *y);

/* The same for expert `expert` of an MoE layer: W13 gives y[M, 2I] = x[M, H] w13^T, W2 gives
 * y[M, H] = x[M, I] w2^T. */
QKEEP_API int qkeep_layer_apply_expert_f32(qkeep_layer *layer, int32_t expert, enum qkeep_moe_matrix matrix,
                                           int64_t m, const float *x, float *y);

#ifdef __cplusplus
}
#endif
#endif
