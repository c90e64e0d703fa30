/*
 * format/checkpoint.h: the format layer (libqkeep/format) holds what is read from disk and how it
 * is named: safetensors (safetensors.h), checkpoints and quant configs (here), fusion rules
 * (fusion.h), the INI config (conf.h) and the provider table (provider.h). Uses base only.
 *
 * Checkpoint sources (libqkeep/format/checkpoint.c, libqkeep/format/quant_config.c).
 * A source is one .safetensors file, or a Hugging Face directory with
 * model.safetensors (or model.safetensors.index.json and its shards),
 * config.json and, for ModelOpt, hf_quant_config.json. Tensors are read one
 * at a time with pread, so a model larger than RAM headroom streams.
 */
#ifndef QKEEP_CHECKPOINT_H
#define QKEEP_CHECKPOINT_H

#include <stdbool.h>

#include "format/safetensors.h"

/* The quantization method a checkpoint declares. */
enum quant_method {
  QM_NONE = 0,       /* unquantized */
  QM_MODELOPT_NVFP4, /* ModelOpt quant_algo NVFP4 */
  QM_CT_NVFP4,       /* compressed-tensors nvfp4-pack-quantized */
  QM_MXFP4,          /* gpt-oss quant_method mxfp4, or compressed-tensors mxfp4-pack-quantized */
  QM_W8A8_INT8,      /* compressed-tensors int-quantized, 8-bit int weights and activations */
  QM_GPTQ_INT4,      /* quant_method gptq, bits 4 */
  QM_AWQ_INT4,       /* quant_method awq, bits 4 (GEMM layout) */
  QM_CT_INT4,        /* compressed-tensors pack-quantized, 4-bit int weights (W4A16, W4A8) */
};

struct ignore_matcher;

struct quant_config {
  enum quant_method method;
  const char *scheme;     /* "modelopt-nvfp4", "ct-nvfp4", "mxfp4", "w8a8-int8", "gptq-int4", "awq-int4",
                             "ct-int4",     "unquantized" */
  int64_t group_size;     /* 16 NVFP4, 32 MXFP4, G for GPTQ/AWQ, 0 per-channel int8 */
  bool weight_sym;        /* GPTQ sym / AWQ !zero_point; int8 weights are symmetric */
  bool desc_act;          /* GPTQ act order (g_idx meaningful); ct-int4 actorder "group" (weight_g_idx) */
  bool gptq_v2;           /* GPTQ checkpoint_format gptq_v2 (qzeros store zero, not zero - 1) */
  bool weight_per_tensor; /* int8 weight strategy "tensor" (else "channel") */
  bool input_dynamic;     /* int8 activations quantised per token at run time (else static input_scale);
                             ct-int4: W4A8 (else W4A16, weight-only) */
  bool input_sym;         /* int8 activations symmetric (else an input_zero_point) */
  bool kv_cache_fp8;      /* the checkpoint carries (or expects) k/v scales */
  bool tie_word_embeddings;
  char **ignore; /* modules left unquantized: exact names, globs, or "re:REGEX" */
  size_t n_ignore;
  struct gptq_rule *dynamic; /* GPTQModel's per-module rules, in the config's order */
  size_t n_dynamic;
  bool mixed;       /* ModelOpt MIXED_PRECISION: only the modules `quantized` names are quantized */
  char **quantized; /* its quantized_layers (all NVFP4), names matched as plain ignore entries are */
  size_t n_quantized;
  struct ignore_matcher *matcher; /* the ignore entries compiled for matching (ignore.c); NULL when none */
};

/* One GPTQ `dynamic` rule: "-:REGEX" excludes matching modules, "+:REGEX" (or a bare REGEX)
 * overrides their group size, symmetry or act order. Python re.match: anchored at the start only. */
struct gptq_rule {
  char *pattern; /* without its "-:" / "+:" */
  bool exclude;
  bool has_group_size, has_sym, has_desc_act;
  int64_t group_size; /* 0: per channel */
  bool sym, desc_act;
};

/* One tensor of the checkpoint and the shard that holds it. */
struct ckpt_tensor {
  const struct st_tensor *t; /* name, dtype, shape, bytes */
  const struct st_file *file;
};

struct ckpt {
  char *path;             /* as given */
  char *dir;              /* the directory (the file's directory for a single file) */
  struct st_file **files; /* shards, sorted by shard name (or the one file) */
  size_t n_files;
  struct ckpt_tensor *tensors; /* every tensor once, sorted by name */
  size_t n_tensors;
  struct name_index index; /* tensors[i] by name, for a sharded checkpoint (one file: its own index) */
  struct quant_config qc;
};

/*
 * Opens a checkpoint. A directory needs model.safetensors.index.json (its
 * weight_map names the shard of every tensor; every shard opens strictly, every
 * mapped tensor must exist in its shard, a tensor in two shards or a shard
 * tensor missing from the map is an error), or a single model.safetensors, or
 * else exactly one *.safetensors file of any name (several without an index:
 * QKEEP_E_FORMAT, ambiguous). config.json (quantization_config,
 * tie_word_embeddings) and hf_quant_config.json are read when present, and
 * GPTQ's quantize_config.json or AWQ's quant_config.json when config.json
 * declares no quantization; a config that contradicts
 * itself (e.g. hf_quant_config NVFP4 but config.json GPTQ) is an error.
 * A single file has no config: qc.method is QM_NONE unless its tensors say
 * otherwise (the caller decides). Errors name the file and the tensor.
 */
int ckpt_open(const char *path, struct ckpt **out);
void ckpt_close(struct ckpt *c);
/* The tensor of that full name, or NULL; O(1) expected. */
const struct ckpt_tensor *ckpt_find(const struct ckpt *c, const char *name);
/*
 * Reads the checkpoint directory's config.json (for a single file, the file's directory's) into
 * *out (malloc'd, NUL-terminated; NULL when there is none) under the rules a directory's own
 * files follow: a symbolic link must stay in the directory's tree (or the hub cache's blobs/),
 * the file must be regular (a FIFO is refused without waiting on it), 16 MiB at most, no NUL
 * byte. Errors name the file (and a link's target): QKEEP_E_FORMAT, QKEEP_E_IO, QKEEP_E_NOMEM.
 */
int ckpt_read_config(const struct ckpt *c, char **out);
/* Reads a tensor's bytes (t->nbytes of them) into dst. */
int ckpt_read(const struct ckpt *c, const struct ckpt_tensor *t, void *dst);
/* Reads bytes [offset, offset + n) of a tensor (a range within it) into dst. */
int ckpt_read_range(const struct ckpt *c, const struct ckpt_tensor *t, size_t offset, size_t n, void *dst);
/* Reads n tensors, ts[i]'s bytes into dsts[i], batched per shard (st_read_many). */
int ckpt_read_many(const struct ckpt *c, const struct ckpt_tensor *const *ts, void *const *dsts, size_t n);

/*
 * A checkpoint that no file holds, for planning a model from what a checkpoint would hold (a load
 * that quantizes on its way: load/online.c): n tensors (names copied, in any order, no two alike)
 * with their specs, and the quantization that config.json's and hf_quant_config.json's texts
 * declare (either may be NULL). Errors and messages name `path`, the config files `dir`. Its
 * tensors cannot be read (ckpt_read fails). Free it with ckpt_close.
 */
int ckpt_describe(const char *path, const char *dir, const char *const *names, const struct qkeep_spec *specs,
                  size_t n, const char *config_json, const char *hf_quant_json, struct ckpt **out);

/* Parses a quantization config: config.json's text (may be NULL) and hf_quant_config.json's
 * (may be NULL). `where` is the directory holding both, so errors read WHERE/config.json
 * (NULL or "": bare file names). */
int quant_config_parse(const char *config_json, const char *hf_quant_json, const char *where,
                       struct quant_config *out);
void quant_config_free(struct quant_config *qc);
/*
 * GPTQ's quantize_config.json (AutoGPTQ before 0.7, optimum) or AWQ's quant_config.json (AutoAWQ
 * before 0.1.6), for a checkpoint whose config.json declares no quantization (qc->method is
 * QM_NONE): parses `text` into qc as a GPTQ or AWQ config. `file` is the bare file name, `where`
 * its directory; messages name "WHERE/FILE" and the key. Unknown quant_method:
 * QKEEP_E_UNSUPPORTED.
 */
int quant_config_parse_standalone(const char *text, const char *where, const char *file,
                                  struct quant_config *qc);
/*
 * Sets *ignored when the module (a layer name such as "model.layers.0.mlp.down_proj" or
 * "lm_head") is left unquantized: a GPTQ `dynamic` "-:" rule matches it first, a
 * MIXED_PRECISION config's quantized_layers do not name it (or a parent, at dot boundaries),
 * or it is in the ignore list: a plain entry matches at dot boundaries the module, a suffix of
 * it ("lm_head" ignores "model.lm_head"), a parent ("model.layers.0.mlp" ignores its
 * down_proj) or a parent's suffix (one hash lookup per run of components, whatever the list's
 * length); "re:REGEX" matches as compressed-tensors' Python re.match does, anchored at the
 * start of the module name but not at its end (PCRE2 syntax); an entry with *, ? or [ is a
 * glob (fnmatch) on the module or a parent, in full. A regex that exceeds its limits (one match's
 * steps, or the load's budget: format/pattern.h) is QKEEP_E_FORMAT naming the file, key, entry and
 * module, within milliseconds; QKEEP_E_NOMEM. Not for concurrent use (the budget and the rules'
 * memo are shared by every match of the config).
 */
int quant_config_match_ignore(const struct quant_config *qc, const char *module, bool *ignored);
/* quant_config_match_ignore's answer, with an error counted as not ignored (tests, fuzzing). */
bool quant_config_ignores(const struct quant_config *qc, const char *module);
/* The config a module loads with: *qc with the first GPTQ `dynamic` "+:" rule that matches
 * the module applied (group size, sym, desc_act); *qc itself when none does. out shares qc's
 * lists (do not free it). A "-:" match is an ignore (quant_config_ignores). A rule whose match
 * exceeds the regex limits: QKEEP_E_FORMAT naming the rule and module (*out is *qc then). */
int quant_config_for_module(const struct quant_config *qc, const char *module, struct quant_config *out);

/*
 * Adds one entry to qc's ignore list (copied) unless it is already there, and
 * compiles it for matching; `where` ("FILE: KEY.PATH") is kept for match-time
 * errors. A "re:" entry that does not compile is QKEEP_E_FORMAT with PCRE2's
 * reason in `why` and no error detail set (the caller names the key); nothing
 * is added then. QKEEP_E_NOMEM. ignore_matcher_free (through
 * quant_config_free) frees what it compiled.
 */
int ignore_add(struct quant_config *qc, size_t *cap, const char *entry, const char *where, char *why,
               size_t why_len);
void ignore_matcher_free(struct ignore_matcher *m);
/*
 * Compiles one GPTQ `dynamic` rule's pattern (without its "-:" / "+:") as the rule that
 * qc->dynamic[qc->n_dynamic] will hold (the caller appends it next); `where` ("FILE: KEY.PATH")
 * is kept for match-time errors. A pattern that does not compile is QKEEP_E_FORMAT with the
 * reason in `why` and no error detail set; QKEEP_E_NOMEM.
 */
int dynamic_rule_add(struct quant_config *qc, const char *pattern, const char *where, char *why,
                     size_t why_len);
/*
 * The index in qc->dynamic of the first rule matching the module (Python re.match), or SIZE_MAX
 * in *rule. Each module is matched once; later questions about it are one lookup. A match that
 * exceeds the regex limits (pattern.h): QKEEP_E_FORMAT naming the file, key, rule and module.
 */
int dynamic_rule_first(const struct quant_config *qc, const char *module, size_t *rule);
/* Appends a MIXED_PRECISION quantized layer to qc->quantized (copied) unless already there. */
int quantized_add(struct quant_config *qc, size_t *cap, const char *layer);
/* Whether quantized_layers name the module, or a parent, at dot boundaries (one lookup per run of
 * components, whatever the list's length). */
bool quantized_covers(const struct quant_config *qc, const char *module);
/* Sets the regex budget of one load (format/pattern.h) for a checkpoint of n_tensors tensors. */
void quant_config_budget_for(struct quant_config *qc, size_t n_tensors);
/* The regex steps charged to qc's budget so far (tests, benches). */
uint64_t quant_config_regex_steps(const struct quant_config *qc);
/* The ignore list alone (no GPTQ or MIXED_PRECISION rule): quant_config_match_ignore's last step. */
int ignore_list_match(const struct quant_config *qc, const char *module, bool *ignored);

#endif
