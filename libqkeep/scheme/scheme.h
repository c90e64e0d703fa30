/*
 * scheme/scheme.h: the scheme layer (libqkeep/scheme): one file per checkpoint scheme, the engine
 * they share, tensor/expert-parallel planning (shard_plan.c) and the registry by name
 * (registry.c, above every scheme file; no scheme file uses it). Uses base, format, device and
 * param; nothing here chooses backends or reads files.
 *
 * A scheme describes, as a table of templates,
 * the loader params one linear layer (or one MoE expert projection) has in
 * the checkpoint, with each dimension an expression of the layer's N, K and
 * group size G. The generic engine (libqkeep/scheme/engine.c) turns a layer's modules
 * (one per fused shard, per expert) into loader params and sources; each
 * scheme file adds only its templates, how to read N/K/G from a module's
 * tensors, and its normalisation under the rules.
 */
#ifndef QKEEP_SCHEME_H
#define QKEEP_SCHEME_H

#include "device/stream.h"
#include "format/checkpoint.h"
#include "param/param.h"

/* A dimension as a function of the shard's N, the layer's K and group size G. */
enum dim_expr { D_N, D_K, D_K_2, D_K_8, D_K_16, D_K_32, D_K_G, D_N_8, D_ONE, D_2, D_16 };

/* How the shards of a fused layer (q/k/v, gate/up) share one param. */
enum fuse_mode {
  F_ROWS,    /* dim 0 carries N (or N/8): shard s occupies rows [sum N_<s, +N_s) (divided by 8) */
  F_COLS,    /* the last dim carries N (or N/8): shards side by side in every row */
  F_SLOT,    /* one scalar per shard: the param holds [S]; checkpoint shape [] or [1] */
  F_SHARED,  /* the same tensor for every shard: loaded from shard 0, the others must equal it */
  F_STACKED, /* one small tensor per shard (weight_shape [2]): the param holds [S, ...] when fused */
};

#define DT(d) (1u << QKEEP_DTYPE_##d)
#define DT_FLOAT (DT(F32) | DT(F16) | DT(BF16))

struct param_template {
  const char *name; /* local checkpoint name, e.g. "weight_scale_2" */
  uint32_t dtypes;  /* accepted checkpoint dtypes, a mask of DT(...) */
  int ndim;
  enum dim_expr dims[4];
  enum fuse_mode fuse;
  bool optional;  /* absent in some checkpoints (e.g. a static input_scale) */
  bool scale;     /* values must be finite and non-negative (checked after loading) */
  bool positive;  /* a static activation scale: zero is refused too (kernels divide by it or by
                   * its reciprocal; ModelOpt and compressed-tensors never export one), and so is a
                   * value whose reciprocal overflows */
  bool inverted;  /* stored as an encode factor that kernels invert (struct scale_rule) */
  float code_max; /* the largest code its decode factor multiplies (struct scale_rule); 0: none */
};

/* One checkpoint module: tensors sharing a name prefix. */
struct module {
  char *name; /* e.g. "model.layers.0.self_attn.q_proj" */
  const struct ckpt_tensor **tensors;
  const char **local; /* the name after "<module>." */
  size_t n;
};

/* The tensor of a module with that local name, or NULL. */
const struct ckpt_tensor *module_tensor(const struct module *m, const char *local);

struct scheme {
  const char *name;
  const struct param_template *params;
  size_t n_params;
  /* When set, picks the template table from the config (e.g. per-channel or per-tensor scales). */
  const struct param_template *(*templates_for)(const struct quant_config *qc, size_t *n);
  /* Reads N, K and G of one module from its tensors; QKEEP_E_NOTFOUND when the module
   * does not carry this scheme's tensors, QKEEP_E_FORMAT when they disagree. */
  int (*dims)(const struct module *m, const struct quant_config *qc, int64_t *n, int64_t *k, int64_t *g);
  /* After all bytes arrived, before the backend's PWAL; NULL: nothing to do. Runs again on reload. */
  int (*normalize)(qkeep_layer *layer);
  /* Layer flags (QKEEP_LAYER_F_*) the config implies. */
  uint32_t (*flags)(const struct quant_config *qc);
};

extern const struct scheme scheme_unquantized;
extern const struct scheme scheme_modelopt_nvfp4;
extern const struct scheme scheme_ct_nvfp4;
extern const struct scheme scheme_mxfp4;
extern const struct scheme scheme_w8a8_int8;
extern const struct scheme scheme_gptq_int4;
extern const struct scheme scheme_awq_int4;
extern const struct scheme scheme_ct_int4;
extern const struct scheme scheme_kv_scales;

/* The scheme of that name, or NULL. */
const struct scheme *scheme_by_name(const char *name);

/*
 * Creates the loader params of a linear or MoE layer from its modules:
 * shards[s] for s < n_shards (fused members in order), and for MoE
 * n_experts x n_shards modules (expert-major; the MoE's w13 has 2 shards,
 * w2 one) under the param name prefix `prefix` ("" for linear, "w13_" /
 * "w2_" for MoE). Every tensor is checked against its template (dtype,
 * shape with the shard's N, the layer's K and G) before any param exists.
 */
int scheme_create(qkeep_layer *layer, const struct scheme *sch, const struct quant_config *qc,
                  const char *prefix, const struct module *const *modules, int n_experts, int n_shards);

/* Creates a gpt-oss pre-stacked MXFP4 MoE layer (gate_up_proj_blocks, ... of one module). */
int mxfp4_create_gptoss_moe(qkeep_layer *layer, const struct module *m);

/* G from int4 scales [K/G, N], checked against N % 8 and the config (GPTQ and AWQ). */
int int4_group_dims(const struct module *m, const struct ckpt_tensor *scales, int64_t n, int64_t k,
                    const struct quant_config *qc, int64_t *g);

/* N and K of an NVFP4 module from its packed weight (named weight_name) and e4m3 block scales. */
/* Dimension `axis` of t times `per_unit` (the elements one stored unit packs: 8 int4 codes in an
 * i32, 2 FP4 codes in a byte, 32 MXFP4 elements per block) into *out; QKEEP_E_FORMAT naming the
 * file and tensor when the product does not fit in 64 bits. */
int packed_dim(const struct ckpt_tensor *t, int axis, int64_t per_unit, int64_t *out);
int nvfp4_dims(const struct module *m, const char *weight_name, int64_t *n, int64_t *k, int64_t *g);

/* ---- normalisation helpers shared by the scheme files (libqkeep/scheme/engine.c) ---- */

/* Merges a per-shard scale param [S] (or [E, S]) by max into [] (or [E]), in the prefix and in
 * its own dtype (F32, F16 or BF16: the max is one of the loaded values, so it is exact there;
 * kernels widen 16-bit scales to f32 as they read them), warning when the shards disagree.
 * Only a param still in its checkpoint view is merged (reload restores that view before
 * loading), so a second call changes nothing. */
int merge_shard_scales_max(qkeep_layer *layer, const char *name);
/* The same for an I8 / I32 per-shard value that must agree across shards (a zero point):
 * [S] -> [], [E, S] -> [E], each expert's first shard, in place; QKEEP_E_UNSUPPORTED naming
 * the param when the shards differ. */
int merge_shard_equal_int(qkeep_layer *layer, const char *name);
/* Calls fn(layer, prefix) for "" on a linear layer, for "w13_" and "w2_" on an MoE layer. */
int for_each_matrix(qkeep_layer *layer, int (*fn)(qkeep_layer *layer, const char *prefix));
/* Whether any checkpoint source landed in the param (false for a placeholder). */
bool param_was_loaded(const qkeep_layer *layer, const char *name);
/* "<prefix><name>" into buf. */
const char *prefixed(char *buf, size_t len, const char *prefix, const char *name);
/*
 * An act-order group index (GPTQ g_idx, compressed-tensors weight_g_idx: I32 [K] or [E, K]) must
 * name a group of its matrix: every value in [0, K / group_size). A kernel indexes scales with it,
 * so a value outside (10^8, or one past the last group) is QKEEP_E_FORMAT naming the checkpoint
 * tensor, the element and the range. A param that is absent or retired is not read: 0.
 */
int check_group_index(qkeep_layer *layer, const char *name, int64_t group_size);
/* Writes `value` into a f32 param that the checkpoint did not provide (a placeholder). */
int fill_f32(qkeep_layer *layer, const char *name, float value);

#endif
