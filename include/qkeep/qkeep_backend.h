/*
 * qkeep_backend.h: the plugin ABI. A backend is a shared object exporting one
 * symbol, QKEEP_BACKEND_INIT_SYMBOL, that fills in a struct qkeep_backend.
 *
 * Versioning: QKEEP_BACKEND_ABI_MAJOR must match exactly; the core's
 * QKEEP_BACKEND_ABI_MINOR must be at least the minor the backend was built
 * for. Every struct here starts with its size in bytes and grows only by
 * appending; a slot past `size` is treated as absent (NULL).
 *
 * Ownership: objects a backend creates (its qkeep_backend, its per-layer
 * state) are destroyed by that backend (fini, layer_cleanup). Strings passed
 * into a backend are borrowed for the duration of the call.
 *
 * The rules: a backend never rebinds, frees, renames or empties a param itself;
 * it calls the host's rule functions (replace, replace_in_place, move, retire,
 * release, add_buffer), which enforce docs/RULES.md. It may write the bytes of a
 * live param it owns during pwal (a repack inside the param's own storage) and
 * then declares the new view with replace_in_place; a reload restores the
 * checkpoint bytes before pwal runs again.
 *
 * Lifecycle, for one plugin: init; configure (once per [backend.NAME] key, in
 * file order, before any model, possibly again later); probe (once per chain
 * that uses it, and by `qkeep plugins`); then per model: supports_layer (or
 * supports) while a checkpoint is planned; memory ops as params are created and
 * loaded; pwal once per owned layer, after its bytes arrive; apply any number of
 * times; on every reload pwal again per reloaded layer; layer_cleanup once per
 * layer with state when the model is cleared; fini at qkeep_plugin_close, after
 * every model using the plugin is gone. Every slot but `name` is optional.
 *
 * Threads: the core calls a backend only from the thread that called the qkeep
 * function (one call at a time per model; two models may run on two threads).
 * A backend may use worker threads of its own, but calls host functions only
 * from the calling thread: set_error's detail is per thread, and one set from
 * a worker is lost.
 */
#ifndef QKEEP_BACKEND_H
#define QKEEP_BACKEND_H

#include <stdarg.h>

#include "qkeep_types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define QKEEP_BACKEND_ABI_MAJOR 1
#define QKEEP_BACKEND_ABI_MINOR 7
#define QKEEP_BACKEND_INIT_SYMBOL "qkeep_backend_init"

typedef struct qkeep_layer qkeep_layer;   /* opaque: owned by the core */
typedef struct qkeep_tensor qkeep_tensor; /* opaque: a result tensor for replace */

struct qkeep_backend;

/*
 * ABI 1.5: one unit of online quantization, as the core hands it to a backend's `quantize`
 * slot. A unit is one weight, or one NVFP4 fusion group (q/k/v, gate/up, an expert's w1/w3:
 * the members qkeep quantize gives one global scale), of an unquantized checkpoint a model
 * quantizes on load (qkeep_model_set_quantize).
 */
struct qkeep_quant_member {
  size_t size;            /* sizeof(struct qkeep_quant_member) as the core knows it */
  const char *name;       /* the unquantized tensor's checkpoint name (for messages) */
  enum qkeep_dtype dtype; /* of src: QKEEP_DTYPE_F32, F16 or BF16 */
  int64_t n, k;           /* src is [n, k], row-major and contiguous; k a multiple of the block */
  /* The member's unquantized values in the backend's device memory (n * k elements of dtype,
   * aligned to the element only), or NULL in a query (every member's NULL: see `quantize`). */
  const void *src;
  /* Where the outputs go, in the backend's device memory, contiguous, each the exact bytes the
   * checkpoint qkeep quantize writes holds (docs/FORMATS.md, "6. qkeep quantize"): codes
   * n * k / 2 bytes of e2m1 codes, two per byte along the row (element 2i in the low nibble);
   * block_scales n * k / B bytes, row-major [n, k / B] (NVFP4: e4m3fn, B = 16; MXFP4: e8m0,
   * B = 32). These are loader params' own bytes (the checkpoint layout, before PWAL). */
  void *codes;
  void *block_scales;
};

struct qkeep_quant_unit {
  size_t size;        /* sizeof(struct qkeep_quant_unit) as the core knows it */
  const char *scheme; /* "modelopt-nvfp4", "ct-nvfp4" or "mxfp4" (ABI 1.5; others may follow) */
  int n_members;      /* 1 to 3 */
  const struct qkeep_quant_member *members; /* n_members entries, member_size bytes apart */
  size_t member_size;
  /* Set by the backend. amax: max |x| over every value of every member (0 when all are zero), on
   * success and on an NVFP4 refusal for a small amax. bad_member, bad_element: on a refusal for
   * a NaN or an Inf, the first one in member order, then row-major order within the member
   * (element = row * k + column); bad_member -1 otherwise. */
  float amax;
  int bad_member;
  int64_t bad_element;
};

/* Log levels for host->log. */
enum qkeep_log_level { QKEEP_LOG_ERROR = 0, QKEEP_LOG_WARN = 1, QKEEP_LOG_INFO = 2, QKEEP_LOG_DEBUG = 3 };

/*
 * The current view of a param or buffer, as a kernel sees it. `data` is a
 * pointer in the backend's device memory (host memory for CPU backends).
 */
struct qkeep_view {
  size_t size;     /* sizeof(struct qkeep_view) as the caller knows it */
  void *data;      /* first byte of the view */
  size_t nbytes;   /* bytes of the view: numel * dtype size */
  size_t capacity; /* bytes of storage from `data` to its end */
  struct qkeep_spec spec;
  enum qkeep_param_state state;
};

/* A layer's scheme and dimensions, as the checkpoint defined them. */
struct qkeep_layer_info {
  size_t size;
  const char *name;   /* e.g. "model.layers.0.self_attn.qkv_proj" */
  const char *scheme; /* e.g. "unquantized", "w8a8-int8" */
  enum qkeep_layer_kind kind;
  int64_t n;          /* output features (sum over fused shards) */
  int64_t k;          /* input features */
  int64_t experts;    /* 0 unless kind is MOE */
  int64_t group_size; /* 0 when the scheme has no groups */
  int shards;         /* fused logical shards (1 when unfused) */
  int64_t shard_n[8]; /* output features of each shard */
  uint32_t flags;     /* QKEEP_LAYER_F_* */
  /* ABI 1.1: */
  int32_t weight_dtype; /* enum qkeep_dtype of the layer's first loader param as the checkpoint holds it
                           (weight, weight_packed, qweight, w13_weight...); -1 when it has none */
};

/* One range of a batched device-to-device copy (copy_d2d_batch, ABI 1.5). */
struct qkeep_copy_range {
  void *dst;       /* device memory */
  const void *src; /* device memory */
  size_t bytes;
};

/*
 * What makes a value invalid (find_bad_values, ABI 1.6): the rules a cold start applies to the scales it
 * reads (docs/RELIABILITY.md, "What is validated at load", the bytes) and to the unquantized weights it
 * quantizes on load. A range holds whole values of the rule's size, little-endian, at any address.
 */
enum qkeep_value_rule {
  QKEEP_RULE_E4M3_SCALE = 1,  /* bytes, FP8 e4m3 scales: NaN (low seven bits all ones), negative (not -0) */
  QKEEP_RULE_E8M0_SCALE = 2,  /* bytes, e8m0 exponents (MXFP4 scales, also stored as u8): 0xff, the NaN */
  QKEEP_RULE_BF16_FINITE = 3, /* 2-byte bf16: NaN or infinite (exponent all ones) */
  QKEEP_RULE_F16_FINITE = 4,  /* 2-byte f16: NaN or infinite */
  QKEEP_RULE_F32_FINITE = 5,  /* 4-byte f32: NaN or infinite */
};

/* One range of device memory for find_bad_values (ABI 1.6): `bytes` a multiple of the rule's value size. */
struct qkeep_value_range {
  const void *at; /* device memory */
  size_t bytes;
  int rule; /* enum qkeep_value_rule */
};

/*
 * Memory operations for the backend's device. The core uses them for all of
 * its own work on params (zero-fill, replace into a prefix, digest, staging
 * checkpoint bytes). Each returns 0 or a negative QKEEP_E_* code. copy_d2d
 * must allow overlapping ranges (memmove semantics).
 */
struct qkeep_memory_ops {
  size_t size;
  int (*alloc)(const struct qkeep_backend *be, size_t bytes, void **out);
  void (*free)(const struct qkeep_backend *be, void *ptr);
  int (*copy_h2d)(const struct qkeep_backend *be, void *dst, const void *src, size_t n);
  int (*copy_d2h)(const struct qkeep_backend *be, void *dst, const void *src, size_t n);
  int (*copy_d2d)(const struct qkeep_backend *be, void *dst, const void *src, size_t n);
  int (*fill)(const struct qkeep_backend *be, void *dst, int byte, size_t n);
  /* Waits until every operation the backend started on the device has completed
   * (copy_h2d_async's copies included) and reports the first error among them. */
  int (*sync)(const struct qkeep_backend *be);
  /*
   * ABI 1.2, optional (the core uses the three together or not at all; a table that ends
   * at sync, or leaves one NULL, stages through pageable memory and copy_h2d):
   * host_alloc returns host memory the device copies from fastest (page-locked); the core
   * uses it only as staging for checkpoint bytes bound for the device, a few MiB of it per
   * load or reload, and gives it back through host_free (after sync) before that load or
   * reload returns. copy_h2d_async starts copying n bytes from memory host_alloc returned
   * into device memory and may return before the copy is done: every later memory op, PWAL
   * and apply of the backend must see the copied bytes (one stream, or ordered after it),
   * and the core neither changes nor frees src until sync has returned.
   */
  int (*host_alloc)(const struct qkeep_backend *be, size_t bytes, void **out);
  void (*host_free)(const struct qkeep_backend *be, void *ptr);
  int (*copy_h2d_async)(const struct qkeep_backend *be, void *dst, const void *src, size_t n);
  /*
   * ABI 1.3, optional (used with the 1.2 slots, and only when both are set; without them
   * the core reuses staging memory only after sync). copy_fence stores in *fence a token
   * standing for every copy_h2d_async started before the call; tokens only increase.
   * copy_fence_wait tells whether those copies have completed: 0 when they have (after
   * waiting for them when `block` is nonzero), 1 when `block` is 0 and it cannot tell yet,
   * or a negative QKEEP_E_* code. It should not wait for later copies or kernels (that is
   * its point: the core refills one staging piece while the device still copies the others
   * and runs the layer's PWAL) but may, e.g. when a later fence reused the backend's record
   * of an old one; 0 always means the token's copies are done. A token the backend never
   * returned is QKEEP_E_INVAL. Two models on two threads may call both at once.
   */
  int (*copy_fence)(const struct qkeep_backend *be, uint64_t *fence);
  int (*copy_fence_wait)(const struct qkeep_backend *be, uint64_t fence, int block);
  /*
   * ABI 1.5, optional (without it the core calls copy_d2d once per range). Copies n ranges of
   * device memory to device memory, as n copy_d2d calls in order would, in one go (cuda-nvfp4: one
   * kernel driven by a table of the ranges): a reload or weight sync from a bucket already in device
   * memory lands a layer's thousands of small tensors (the experts of a MoE layer) with one call
   * instead of one each. The core guarantees: no range's dst overlaps another range's dst or any
   * range's src, bytes > 0, and `ranges` (host memory) is read only during the call. Like
   * copy_d2d it may return before the copies are done, provided every later memory op, PWAL and
   * apply of the backend sees the bytes (one stream). 0 or a negative QKEEP_E_* code.
   */
  int (*copy_d2d_batch)(const struct qkeep_backend *be, const struct qkeep_copy_range *ranges, size_t n);
  /*
   * ABI 1.6, optional (without it the core copies device-resident values to the host to check them).
   * Tells whether any value of n ranges of device memory breaks its range's rule (enum
   * qkeep_value_rule): *first is the index of the lowest such range, or n when every value is valid. A
   * weight sync checks a bucket's block scales, and the unquantized weights a model quantizing on load
   * takes, where they lie (cuda-nvfp4: one kernel over a table of the ranges) instead of bringing them
   * to the host; the core names the bad element itself, from a host copy of the range found. The check
   * sees every copy and kernel the backend queued before the call, and the answer is final when the
   * call returns. `ranges` (host memory) is read only during the call; a range may have 0 bytes; an
   * unknown rule, or bytes not a multiple of its value size, is QKEEP_E_INVAL. 0 or a negative
   * QKEEP_E_* code.
   */
  int (*find_bad_values)(const struct qkeep_backend *be, const struct qkeep_value_range *ranges, size_t n,
                         size_t *first);
};

/* The type of a configuration key a backend declares (ABI 1.1). */
enum qkeep_key_type {
  QKEEP_KEY_STRING = 0, /* any non-empty text */
  QKEEP_KEY_INT = 1,    /* a decimal integer, within `values` "MIN..MAX" when given */
  QKEEP_KEY_BOOL = 2,   /* true/false, yes/no, on/off, 1/0 */
  QKEEP_KEY_ENUM = 3,   /* one of `values`, '|'-separated ("auto|ring|stream") */
};

/*
 * One [backend.NAME] key a backend takes, as it declares it in its table (keys, n_keys,
 * key_size). The core checks every configured key against the list before it calls
 * configure: an unknown key, a value of the wrong type, out of range or not among the
 * values is refused with the config's file:line and the backend's list of keys, and
 * `qkeep plugins --verbose` prints the list. configure still receives the text and may
 * refuse a value for reasons of its own. Strings are the backend's and must live until fini.
 */
struct qkeep_backend_key {
  const char *name;          /* e.g. "threads" */
  enum qkeep_key_type type;  /* how the core checks the value */
  const char *values;        /* ENUM: the values; INT: "MIN..MAX" or NULL; else NULL */
  const char *default_value; /* what an absent key means, as text ("all cores", "auto") */
  const char *help;          /* one line */
};

/* Which matrix of an MoE expert apply multiplies with. */
enum qkeep_moe_matrix { QKEEP_MOE_W13 = 0, QKEEP_MOE_W2 = 1 };

/*
 * Arguments of apply: y[M, N] = x[M, K] W^T for a linear layer. x and y live
 * in the backend's device memory, row-major, in the dtypes given. For an MoE
 * layer, W is expert `expert`'s w13 ([2I, H]: gate rows then up rows) or w2
 * ([H, I]) as `matrix` says, so each expert GEMM can be checked alone.
 */
struct qkeep_apply_args {
  size_t size;
  int64_t m;
  const void *x;
  enum qkeep_dtype x_dtype;
  void *y;
  enum qkeep_dtype y_dtype;
  int32_t expert;
  enum qkeep_moe_matrix matrix;
  /*
   * Routed MoE over all experts, when topk > 0 (backends that do it; `expert` is then
   * ignored): W13 takes x [m, H] to y [m * topk, 2I], one row per (token, slot); W2
   * combines x [m * topk, I] into y [m, H], the router-weighted sum over slots.
   */
  int32_t topk;
  const int32_t *topk_ids;   /* [m, topk] expert per (token, slot), device memory */
  const float *topk_weights; /* [m, topk] router weights, device memory (W2 only) */
  void *stream;              /* the device stream to run on (cudaStream_t); NULL: the default */
  /*
   * ABI 1.4: scratch the caller owns, in the backend's memory, at least the bytes the
   * backend's workspace slot asked for these arguments (256-byte aligned). A backend with a
   * workspace slot takes all its scratch from here and allocates nothing while it applies.
   * NULL (it asked for none, or an older caller): a backend that needs scratch may then
   * allocate it itself, as before ABI 1.4; qkeep_layer_forward never passes NULL to a
   * backend that asked for scratch.
   */
  void *workspace;
  size_t workspace_bytes;
};

/*
 * What the core offers a backend. Every function returns 0 or a negative
 * QKEEP_E_* code unless noted. `name` arguments are a layer's param or buffer
 * names (runtime or checkpoint), e.g. "weight_scale".
 */
struct qkeep_host {
  size_t size;
  uint32_t abi_major;
  uint32_t abi_minor;
  const char *version; /* the core's package version */

  /* Logging through the engine's logger; any thread. */
  void (*log)(enum qkeep_log_level level, const char *fmt, ...);
  /* Records the detail of an error for the caller (the calling thread's); returns `code`.
   * The core prefixes where it happened (layer, backend, file). */
  int (*set_error)(int code, const char *fmt, ...);

  /* ---- readers (no effect on the layer) ---- */

  /* The layer's name, scheme, kind and dims; out->size says how much the caller knows. */
  int (*layer_info)(const qkeep_layer *layer, struct qkeep_layer_info *out);
  /* The view of a param (live, retired or released) or a buffer, by checkpoint, runtime or
   * alias name. QKEEP_E_NOTFOUND when no such name is registered. */
  int (*view)(const qkeep_layer *layer, const char *name, struct qkeep_view *out);
  /* The view of a live param or of a buffer (buffers are always live); QKEEP_E_NOTFOUND for
   * an unknown name and for a retired or released param. */
  int (*get_live)(const qkeep_layer *layer, const char *name, struct qkeep_view *out);
  /* Calls fn once per live param, under its runtime name, in creation order; stops on and
   * returns fn's non-zero value. Buffers are not listed. */
  int (*kernel_params)(const qkeep_layer *layer,
                       int (*fn)(void *user, const char *name, const struct qkeep_view *v), void *user);
  /* The backend's private state for a layer (NULL until set). It survives reloads: pwal
   * finds its own earlier state there, and layer_cleanup frees it. */
  void *(*get_state)(const qkeep_layer *layer);
  void (*set_state)(qkeep_layer *layer, void *state);

  /* ---- result tensors, for replace ---- */

  /* A new zero-filled tensor of spec in the memory of the layer's owner. Either consumed by
   * replace or freed with tensor_free. */
  int (*tensor_new)(qkeep_layer *layer, const struct qkeep_spec *spec, qkeep_tensor **out);
  void *(*tensor_data)(qkeep_tensor *t);
  void (*tensor_free)(qkeep_tensor *t);

  /* ---- the rules (docs/RULES.md); during pwal, on layers the backend owns ---- */

  /* The param keeps its object and names and gets result's contents: copied into the
   * prefix of its own storage when they fit (no pointer moves), else the param is rebound
   * to result's larger storage. Always consumes result. QKEEP_E_STATE for a released param. */
  int (*replace)(qkeep_layer *layer, const char *name, qkeep_tensor *result);
  /* The backend already wrote the new contents into the prefix of the param's own storage:
   * only the view changes to spec. QKEEP_E_RULE when spec does not fit the capacity. */
  int (*replace_in_place)(qkeep_layer *layer, const char *name, const struct qkeep_spec *spec);
  /* Registers the param under src also as dst and makes dst its runtime name (one object,
   * two names). A no-op when dst names it already; QKEEP_E_EXISTS when dst names another. */
  int (*move)(qkeep_layer *layer, const char *src, const char *dst);
  /* Object and bytes stay; no kernel reads it (get_live and kernel_params skip it). A
   * reload makes it live again before pwal. */
  int (*retire)(qkeep_layer *layer, const char *name);
  /* Empties the param's storage; the census shows the reason. Only where a kernel's copy is
   * opaque and keeping the source would double memory; reload gives it new storage. */
  int (*release)(qkeep_layer *layer, const char *name, const char *reason);
  /* A kernel-only buffer in the owner's memory (zero-filled when new). When a buffer of that
   * name and byte size exists it is returned as it is (same storage): a pwal run again by a
   * reload reuses it in place. QKEEP_E_EXISTS when the name is a param's. */
  int (*add_buffer)(qkeep_layer *layer, const char *name, const struct qkeep_spec *spec,
                    struct qkeep_view *out);

  /* ---- ABI 1.7 ---- */

  /* As tensor_new, but the bytes are left as they are (not zero-filled): for a result the
   * backend writes whole before replace consumes it (a layout transform), which saves a pass
   * over the result's memory. Absent in older cores (QKEEP_HAS_SLOT): use tensor_new. */
  int (*tensor_new_unfilled)(qkeep_layer *layer, const struct qkeep_spec *spec, qkeep_tensor **out);
};

/*
 * A backend's table, filled in by its init function. The core never writes
 * to it. Backends that need instance data embed this struct at the start of
 * a larger one.
 */
struct qkeep_backend {
  size_t size;
  uint32_t abi_major; /* QKEEP_BACKEND_ABI_MAJOR the backend was built with */
  uint32_t abi_minor; /* the lowest core ABI minor it needs */
  const char *name;   /* required, e.g. "reference": the name configs select it by (a-z, 0-9, '-', '_') */
  const char *description;

  /*
   * (optional; absent: the device is assumed present) 0 when the device is present;
   * QKEEP_E_NODEV, with a one-line message in msg (msg_len > 0), when not. A chain probes
   * each plugin once and skips it for good when this fails. No side effects beyond that.
   */
  int (*probe)(const struct qkeep_backend *be, char *msg, size_t msg_len);
  /*
   * (optional; absent: every key is refused) Applies one [backend.NAME] key; QKEEP_E_CONFIG
   * (with set_error) for an unknown key or a bad value. Called in file order before any
   * model uses the backend; an engine may call it again between models. With declared keys
   * (keys, below) the core has already checked the name and the value's type.
   */
  int (*configure)(const struct qkeep_backend *be, const char *key, const char *value);
  /* (optional) The memory of the backend's device, for every param and buffer of the layers
   * it owns. NULL, or a table short of any slot: host memory (aligned to 64 bytes). */
  const struct qkeep_memory_ops *memory;
  /*
   * (optional) 1 when the backend runs this scheme for this kind of layer, else 0. The
   * ABI 1.0 form of supports_layer: a backend without supports_layer is asked this for its
   * linear and MoE layers only, and owns every other layer that reaches it in the chain;
   * absent too, it owns every layer that reaches it.
   */
  int (*supports)(const struct qkeep_backend *be, const char *scheme, enum qkeep_layer_kind kind);
  /*
   * (optional; absent: params stay as loaded) The post-load pass of one layer the backend
   * owns, under the rules. Called after the layer's bytes are loaded and its scales checked
   * and the scheme normalised it (docs/SCHEMES.md lists the params it sees), once per layer
   * at a cold start, and again for each layer a reload updates, after the core has given
   * every loader param its checkpoint view and state back (live) and loaded the new bytes:
   * so it must produce the same result from the restored checkpoint layout whatever it did
   * before. Its state from the last run is still set (get_state); buffers it added are still
   * there (add_buffer returns them). On failure (a negative code with set_error) the load
   * fails and the model is cleared, or the reload rolls back; layer_cleanup still runs.
   */
  int (*pwal)(const struct qkeep_backend *be, qkeep_layer *layer);
  /*
   * (optional; absent: the layer cannot be run) Runs the kernel of a layer the backend owns:
   * y = x W^T, or one MoE expert's matrix, or a routed MoE (qkeep_apply_args). x and y are
   * in the backend's memory; x F32, BF16 or F16, y F32 or x's dtype (QKEEP_E_UNSUPPORTED with
   * set_error for any other pair, or for a kind or routing it does not run). A device backend
   * enqueues on args->stream and may return before the work is done (whoever waits syncs the
   * stream). Reads only live params, buffers, its PWAL state and args->workspace. Called on
   * the engine's thread (qkeep_layer_forward) or the core's; never during a load or reload of
   * the same model. With QKEEP_BACKEND_F_GRAPH_SAFE, what that flag promises.
   */
  int (*apply)(const struct qkeep_backend *be, qkeep_layer *layer, const struct qkeep_apply_args *args);
  /* (optional) Frees the state set with host->set_state, once per layer that has state, when
   * the model is cleared (qkeep_model_free, a failed load); never on reload. The layer's
   * params are still readable. */
  void (*layer_cleanup)(const struct qkeep_backend *be, qkeep_layer *layer, void *state);
  /* (optional) Destroys the backend; nothing of it is used afterwards. Called by
   * qkeep_plugin_close, and when the core rejects the table init returned. */
  void (*fini)(const struct qkeep_backend *be);

  /* ---- ABI 1.1 ---- */

  /*
   * (optional) Whether the backend takes this layer: 1 to own it, 0 to pass it down the
   * chain, with a short reason written to `reason` (reason_len > 0, NUL-terminated by the
   * core), e.g. "scheme gptq-int4 is not run here" or "K 100 is not a multiple of 64".
   * Called for every layer of every kind (linear, MoE, embedding, kv scales, norms and
   * other plain tensors) after the checkpoint is planned and before any param of the
   * model is created or any byte read, so `info` carries the scheme, kind, dims, flags and
   * weight dtype only; no param exists yet. May be called several times per layer and for
   * layers that end up elsewhere; must not keep `info`. A backend that owns a layer gets
   * its params in its memory and its pwal, apply and layer_cleanup calls. When absent, the
   * core uses `supports` as described there. A backend that takes norms and embeddings
   * (device backends should: an engine reads them from device memory) says so here.
   */
  int (*supports_layer)(const struct qkeep_backend *be, const struct qkeep_layer_info *info, char *reason,
                        size_t reason_len);

  /*
   * (optional) The [backend.NAME] keys the backend takes: n_keys entries of key_size bytes
   * each (sizeof(struct qkeep_backend_key) as the backend was built; the core reads only the
   * fields it knows). keys NULL: undeclared, and configure alone judges every key. A backend
   * that takes no key declares an empty list: keys non-NULL, n_keys 0.
   */
  const struct qkeep_backend_key *keys;
  size_t n_keys;
  size_t key_size;

  /* ---- ABI 1.4 ---- */

  /*
   * (optional; absent: apply needs no workspace) The bytes of scratch apply needs for these
   * arguments (m, dtypes, expert or matrix, topk; the pointers and the stream are not read),
   * into *bytes; 0 for none. The same arguments always give the same answer, and a smaller m
   * never needs more. The core calls it on the engine's thread before a forward (the caller
   * passes a workspace at least that large) and before its own applies (it allocates the
   * workspace with the memory ops). QKEEP_E_UNSUPPORTED, with set_error, for arguments apply
   * would refuse.
   */
  int (*workspace)(const struct qkeep_backend *be, qkeep_layer *layer, const struct qkeep_apply_args *args,
                   size_t *bytes);
  /*
   * (optional; absent: host memory when `memory` is NULL, else QKEEP_DEVICE_OTHER) The device
   * whose memory the backend's params and activations live in: its type and ordinal.
   */
  int (*device)(const struct qkeep_backend *be, enum qkeep_device_type *type, int *index);
  /* QKEEP_BACKEND_F_* bits (0 before ABI 1.4). */
  uint32_t flags;

  /* ---- ABI 1.5 ---- */

  /*
   * (optional; absent, or declining: the core quantizes the unit on the host and copies the
   * bytes in, as before ABI 1.5) Quantizes one unit of online quantization on the backend's
   * device, from values the core has staged there, into the loader params' device memory.
   *
   * What the core guarantees: `layer` is a layer the backend owns (NULL when the caller is not a
   * load: a test or tool with buffers of its own); the unit's scheme is the model's quantize
   * scheme; every member's src, codes and block_scales are device memory of this backend, the
   * outputs do not overlap each other or any src, and src holds the member's values once every
   * copy_h2d_async started before the call has completed (the backend orders its work after
   * them: one stream, or an explicit wait). At most one unit's sources are staged at a time.
   * A query is a call with every src NULL, made before anything is staged: return 0 to take such
   * a unit, 1 to decline it; nothing is read or written.
   *
   * What the backend does: the outputs get exactly the bytes `qkeep quantize` writes for these
   * values (same IEEE float32 arithmetic, rounding, ties, saturation and zero rules as
   * libqkeep/quantize/quantize.c; docs/FORMATS.md "6. qkeep quantize"), so that a load is byte-
   * identical to quantize-then-load. Every member's values are read first: a NaN or an Inf
   * anywhere refuses the whole unit before any output byte is written. NVFP4 fusion groups share
   * one global scale, from the amax of ALL the unit's members: ModelOpt's weight_scale_2 =
   * amax / 2688 and compressed-tensors' weight_global_scale = 2688 / amax (float32 divisions),
   * from which every block scale of every member derives; amax 0 gives codes 0 and every block
   * scale 1.0 (0x38, ModelOpt) or 0.125 (0x20, compressed-tensors). The backend writes codes and
   * block scales only: the core writes the global scales (from unit->amax) and the constants.
   * Its writes are ordered before any later memory op, copy, pwal and apply of the backend, as
   * copy_h2d_async's are; it may return before they are done (the core's sync waits).
   *
   * Returns 0 (done; unit->amax set), 1 (declined: nothing written; the core quantizes this unit
   * on the host), QKEEP_E_INVAL with bad_member and bad_element set for a NaN or an Inf, or with
   * amax set and bad_member -1 for an NVFP4 amax below 2688 * FLT_MIN (its global scale would be
   * subnormal) -- nothing written in either case, and the core then reports the host's error,
   * naming the tensor, row and column -- or another negative QKEEP_E_* code with set_error (the
   * load fails, or the reload rolls back).
   */
  int (*quantize)(const struct qkeep_backend *be, qkeep_layer *layer, struct qkeep_quant_unit *unit);
};

/*
 * The backend's apply may be captured in a CUDA (or HIP) graph: given the workspace it asked
 * for, it allocates nothing, frees nothing, synchronises nothing, copies nothing to or from
 * the host and enqueues its work on args->stream only; everything its kernels read is a live
 * param, a buffer, state set at PWAL or the workspace, and a reload or sync refreshes them at
 * the same addresses, so a graph captured before a reload computes with the new weights.
 */
#define QKEEP_BACKEND_F_GRAPH_SAFE (1u << 0)
/* apply runs routed MoE (args->topk > 0) for the MoE layers the backend owns. */
#define QKEEP_BACKEND_F_ROUTED_MOE (1u << 1)

/*
 * The one exported entry point. `host` stays valid until fini. Returns 0 and
 * sets *out, or a negative QKEEP_E_* code (detail through host->set_error).
 */
typedef int (*qkeep_backend_init_fn)(const struct qkeep_host *host, const struct qkeep_backend **out);

#define QKEEP_BACKEND_EXPORT __attribute__((visibility("default")))

/* The prototype every backend defines (and exports with QKEEP_BACKEND_EXPORT). */
QKEEP_BACKEND_EXPORT int qkeep_backend_init(const struct qkeep_host *host, const struct qkeep_backend **out);

#ifdef __cplusplus
}
#endif
#endif
