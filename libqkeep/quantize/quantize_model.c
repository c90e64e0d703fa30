/*
 * quantize_model.c: `qkeep quantize`. Reads an unquantized checkpoint (a
 * .safetensors file or a Hugging Face directory) and writes a checkpoint
 * directory in one scheme's real tensor names and config files, so that
 * qkeep, vLLM and the original tools read it the same way. The numerics are
 * libqkeep/quantize/quantize.c's; this file decides what is quantized, groups fused
 * shards so they share one global scale (as ModelOpt does), and writes.
 *
 * Linear layers are the 2-D float `weight`s of modules other than
 * embeddings, the lm_head (left unquantized, as exporters do by default) and
 * MoE routers (`mlp.gate`). Everything else is copied unchanged.
 *
 * How it runs (qkeep.h states the memory bound):
 *   plan    from the input's header alone: every output tensor (name, spec),
 *           the shard it goes to and its offset there (st_writer_layout, so
 *           the files are those st_writer_write would write), and the units
 *           of work. Every shape error is found here, before a byte is read.
 *   open    each shard file is created and its header written; constant
 *           tensors (input scales, weight_shape) go in at once.
 *   stream  the calling thread reads one unit after another while the pool's
 *           threads (and the caller, when it waits) quantize row blocks of
 *           the units in flight; the thread that finishes a unit writes its
 *           tensors with pwrite at their offsets and frees it. Tensors copied
 *           unchanged go through in chunks on the calling thread.
 *   finish  shards renamed into place, the index and config files written.
 * Row blocks are whole multiples of 8 rows (int4 packs 8 rows into a word of
 * zero points), and each writes only its own bytes, so the output does not
 * depend on which thread ran which block. Errors are kept per block and per
 * unit and the first in input order wins, as a single thread would report it.
 */
#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "quantize/plan.h"
#include "quantize/quant.h"
#include "scheme/scheme.h"

#define COPY_CHUNK ((size_t)8 << 20)      /* tensors copied unchanged go through a buffer this large */
#define BLOCK_ELEMENTS ((int64_t)1 << 18) /* a row block's f32 scratch: 1 MiB */
#define MAX_OUTPUTS 4                     /* tensors one quantized weight writes */
#define MAX_MEMBERS 3                     /* weights of one NVFP4 fusion group */
/* Inner loops run in pieces of a constant length: compilers that vectorize only loops whose
 * count they know (GCC's -O2 cost model) vectorize those. */
#define VECTOR_RUN 64

/* An appended option, or 0 / NULL when the caller's struct is older. */
#define OPTION(opt, field)                                                                                   \
  ((opt)->size >= offsetof(struct qkeep_quantize_options, field) + sizeof(opt)->field ? (opt)->field : 0)

/* "FMT" formatted into a new string; NULL when out of memory. */
static char *strfmt(const char *fmt, ...) PRINTF_LIKE(1, 2);
static char *strfmt(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *s = NULL;
  if (qk_vasprintf(&s, fmt, ap) < 0)
    s = NULL;
  va_end(ap);
  return s;
}

/* Writes all n bytes at offset; 0, or -1 with errno. */
static int pwrite_full(int fd, const void *data, size_t n, uint64_t offset) {
  const char *p = data;
  while (n > 0) {
    ssize_t w = pwrite(fd, p, n < ((size_t)1 << 30) ? n : ((size_t)1 << 30), (off_t)offset);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0) {
      if (w == 0)
        errno = EIO;
      return -1;
    }
    p += w;
    n -= (size_t)w;
    offset += (uint64_t)w;
  }
  return 0;
}

/* jansson's setters fail quietly (out of memory, or a NULL value from a constructor that failed): these
 * note it in *ok, so that a config built with them is whole or refused, never written with a key
 * missing. The value's reference is taken either way. */
static void jset(bool *ok, json_t *object, const char *key, json_t *value) {
  if (json_object_set_new(object, key, value) != 0)
    *ok = false;
}

static void jappend(bool *ok, json_t *array, json_t *value) {
  if (json_array_append_new(array, value) != 0)
    *ok = false;
}

/* ---- the plan ------------------------------------------------------------------------ */

/* One tensor of the output. */
struct out_tensor {
  char *name;
  struct qkeep_spec spec;
  size_t nbytes;
  int shard;
  uint64_t offset;                /* in its shard file */
  const struct ckpt_tensor *from; /* the input it copies or quantizes; NULL: a kv-cache scale */
  bool copied;                    /* from is copied unchanged */
  bool constant;                  /* its bytes are known at plan time: value */
  unsigned char value[16];        /* a constant's bytes (at most 16) */
};

enum unit_kind { UNIT_COPY, UNIT_QUANT };

/* A weight being quantized and its outputs. */
struct member {
  const struct ckpt_tensor *in; /* NULL in a plan kept past its checkpoint (quant_plan_new) */
  char *module;                 /* its name less ".weight" */
  const char *input;            /* the input tensor's name (in's, or the plan's own copy) */
  int dtype;                    /* the input's enum qkeep_dtype (F32, F16 or BF16) */
  int64_t n, k;
  size_t out[MAX_OUTPUTS]; /* plan indices of its outputs, in the scheme's order (below) */
  int n_out;
  /* while in flight */
  void *raw;              /* the input bytes */
  void *buf[MAX_OUTPUTS]; /* bytes of out[i] (NULL for constants) */
  void *tmp[2];           /* AWQ: GPTQ's qweight and qzeros; ct-int4: f32 scales */
  int64_t block_rows, first_block, n_blocks;
};

/* Errors found by one row block: `finite` (a NaN or Inf) comes first in a single
 * thread's order, then `other` (a scale out of range), then the lowest block. */
struct block_result {
  int finite_rc, other_rc;
  char *finite_msg, *other_msg;
  float amax;
};

struct unit {
  enum unit_kind kind;
  size_t index; /* order in the input */
  struct member m[MAX_MEMBERS];
  int n_members;
  const struct ckpt_tensor *copy_in; /* UNIT_COPY: the tensor */
  size_t copy_out;                   /* UNIT_COPY: its output */
  int64_t in_bytes, bytes;           /* input bytes; every byte it holds while in flight */
  int64_t n_tensors;                 /* input tensors it covers */
  /* while in flight, under the pool's lock */
  int stage, n_stages;
  int64_t n_blocks, next_block, blocks_left;
  struct block_result *results;
  float group_amax;
  struct unit *next_active;
  struct quant_job *job; /* a load's unit (quant_pool_start): its caller takes it when done; NULL offline */
};

struct quantizer {
  const struct ckpt *ck;
  const struct qkeep_quantize_options *opt;
  const struct scheme *sch;
  const char *out_dir;  /* where the files are written: the staging directory beside user_dir */
  const char *user_dir; /* the output directory the caller named, which errors name */
  bool ct, nvfp4, mxfp4, int8, gptq, awq, ct_int4;
  int64_t group; /* int4 group size */
  struct out_tensor *outs;
  size_t n_outs, cap_outs;
  struct unit *units;
  size_t n_units, cap_units;
  int n_shards;
  int *fds;
  char **tmp_paths;
  char **shard_labels;      /* each shard's final path under user_dir, for errors */
  int64_t written;          /* output bytes, under the lock once streaming */
  int64_t scratch_elements; /* f32 scratch per thread: the largest row block */
  json_t *input_config;     /* the input's config.json, read before any work; NULL when it has none */
  int threads;
};

static int add_out(struct quantizer *q, char *name, const struct qkeep_spec *spec, size_t *index) {
  if (!name)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  size_t nbytes;
  if (!spec_bytes_checked(spec, &nbytes)) {
    int rc = set_error(QKEEP_E_INVAL, "tensor '%s': its shape is too large", name);
    free(name);
    return rc;
  }
  int rc = grow_array((void **)&q->outs, &q->cap_outs, q->n_outs + 1, sizeof *q->outs);
  if (rc) {
    free(name);
    return rc;
  }
  q->outs[q->n_outs] = (struct out_tensor){.name = name, .spec = *spec, .nbytes = nbytes};
  if (index)
    *index = q->n_outs;
  q->n_outs++;
  return 0;
}

/* An f32 scalar known now, as [] (ModelOpt) or [1] (compressed-tensors). */
static int add_const_f32(struct quantizer *q, char *name, float value, bool rank1, size_t *index) {
  struct qkeep_spec s = {.dtype = QKEEP_DTYPE_F32, .ndim = rank1 ? 1 : 0, .shape = {1}};
  size_t i;
  int rc = add_out(q, name, &s, &i);
  if (!rc) {
    q->outs[i].constant = true;
    memcpy(q->outs[i].value, &value, sizeof value);
    if (index)
      *index = i;
  }
  return rc;
}

/* Whether the tensor is the weight of a linear layer that the scheme quantizes. */
static bool quantizable(const struct ckpt_tensor *t) {
  const char *name = t->t->name;
  size_t len = strlen(name);
  if (len < 7 || strcmp(name + len - 7, ".weight") != 0 || t->t->ndim != 2 || t->t->dtype < 0 ||
      !(DT_FLOAT & (1u << t->t->dtype)))
    return false;
  /* the module's last component: between the previous dot (if any) and ".weight" */
  const char *end = name + len - 7, *last = end;
  while (last > name && last[-1] != '.')
    last--;
  size_t n = (size_t)(end - last);
  bool embed = false;
  for (const char *p = last; p + 5 <= end && !embed; p++)
    embed = strncmp(p, "embed", 5) == 0;
#define IS(word) (n == sizeof word - 1 && strncmp(last, word, n) == 0)
  return !embed && !IS("lm_head") && !IS("gate") && !IS("router") && !IS("wte");
#undef IS
}

/*
 * A fusion group is found by name; its members share one global scale, so each must be a 2-D
 * float weight as t is. Quantizing t and copying an odd sibling unchanged would write a group
 * that no loader takes (fused shards share one scheme), so the group is refused, naming the
 * member and why. Returns n, or QKEEP_E_FORMAT.
 */
static int check_fusion_group(const struct ckpt_tensor *t, const struct ckpt_tensor *const *group, int n) {
  for (int g = 0; g < n; g++) {
    const struct st_tensor *m = group[g]->t;
    if (quantizable(group[g]))
      continue;
    int ndim = m->full_shape ? m->full_ndim : m->ndim;
    if (ndim != 2)
      return set_error(QKEEP_E_FORMAT,
                       "%s: tensor '%s': %d dimension%s, but it is in a fusion group with '%s' (one "
                       "global scale for the group): every member must be a 2-D float weight",
                       group[g]->file->path, m->name, ndim, ndim == 1 ? "" : "s", t->t->name);
    return set_error(QKEEP_E_FORMAT,
                     "%s: tensor '%s': dtype %s, but it is in a fusion group with '%s' (one global "
                     "scale for the group): every member must be a 2-D float weight (F32, F16, BF16)",
                     group[g]->file->path, m->name, m->dtype_name, t->t->name);
  }
  return n;
}

/*
 * Modules whose weights share one NVFP4 global scale: fused shards under one
 * parent (q/k/v, gate/up), and each expert's gate/up. `group` gets the
 * tensors of the group containing t, in the rule's order; returns the count
 * (1: t alone), or a negative QKEEP_E_NOMEM or QKEEP_E_FORMAT (a member that is not a 2-D
 * float weight).
 */
static int fusion_group(const struct ckpt *ck, const struct ckpt_tensor *t,
                        const struct ckpt_tensor *group[MAX_MEMBERS]) {
  static const char *const rules[][MAX_MEMBERS + 1] = {
      {"q_proj", "k_proj", "v_proj", NULL}, {"gate_proj", "up_proj", NULL}, {"w1", "w3", NULL}};
  const char *name = t->t->name;
  size_t module_len = strlen(name) - 7;
  const char *member = name + module_len;
  while (member > name && member[-1] != '.')
    member--;
  size_t member_len = (size_t)(name + module_len - member),
         parent_len = member > name ? (size_t)(member - name - 1) : 0;
  for (size_t r = 0; r < sizeof rules / sizeof rules[0]; r++) {
    int n = 0, mine = -1;
    for (int m = 0; m < MAX_MEMBERS && rules[r][m]; m++) {
      char *candidate = strfmt("%.*s.%s.weight", (int)parent_len, name, rules[r][m]);
      if (!candidate)
        return set_error(QKEEP_E_NOMEM, "out of memory");
      const struct ckpt_tensor *c = ckpt_find(ck, candidate);
      free(candidate);
      if (!c)
        break;
      if (strlen(rules[r][m]) == member_len && strncmp(rules[r][m], member, member_len) == 0)
        mine = n;
      group[n++] = c;
    }
    if (mine >= 0 && n >= 2 && rules[r][n] == NULL)
      return check_fusion_group(t, group, n);
  }
  group[0] = t;
  return 1;
}

/* Output indices of one quantized weight, in the order its scheme adds them:
 *   NVFP4     weight | weight_packed, weight_scale, weight_scale_2 | weight_global_scale, input_scale |
 * input_global_scale MXFP4     weight_packed, weight_scale int8      weight, weight_scale [, input_scale [,
 * input_zero_point]] GPTQ      qweight, qzeros, g_idx, scales;  AWQ: qweight, qzeros, scales ct-int4
 * weight_packed, weight_scale, weight_shape [, weight_zero_point] */
struct weight_plan {
  size_t out[MAX_OUTPUTS];
  int n_out;
};

static int plan_add(struct quantizer *q, struct weight_plan *wp, const char *module, const char *local,
                    struct qkeep_spec spec) {
  return add_out(q, strfmt("%s.%s", module, local), &spec, &wp->out[wp->n_out++]);
}

static int plan_const(struct quantizer *q, struct weight_plan *wp, const char *module, const char *local,
                      float value, bool rank1) {
  return add_const_f32(q, strfmt("%s.%s", module, local), value, rank1, &wp->out[wp->n_out++]);
}

/* Checks a weight's shape against the scheme and plans its outputs. */
static int plan_weight(struct quantizer *q, const struct ckpt_tensor *t, const char *module,
                       struct weight_plan *wp) {
  int64_t n = t->t->shape[0], k = t->t->shape[1];
  const char *name = t->t->name;
  float act = q->opt->activation_amax > 0 ? q->opt->activation_amax : 1.0f;
  int rc = 0;
  wp->n_out = 0;
  if (q->nvfp4) {
    const struct ckpt_tensor *group[MAX_MEMBERS];
    int n_group = fusion_group(q->ck, t, group);
    if (n_group < 0)
      return n_group;
    for (int g = 0; g < n_group; g++)
      if (group[g]->t->shape[1] != k)
        return set_error(QKEEP_E_FORMAT, "tensor '%s': K %lld differs from its fused sibling's %lld",
                         group[g]->t->name, (long long)group[g]->t->shape[1], (long long)k);
    if (k % 16)
      return set_error(QKEEP_E_INVAL, "tensor '%s': K = %lld is not a multiple of 16 (NVFP4)", name,
                       (long long)k);
    rc = plan_add(q, wp, module, q->ct ? "weight_packed" : "weight",
                  (struct qkeep_spec){QKEEP_DTYPE_U8, 2, {n, k / 2}});
    if (!rc)
      rc = plan_add(q, wp, module, "weight_scale", (struct qkeep_spec){QKEEP_DTYPE_F8_E4M3, 2, {n, k / 16}});
    if (!rc) /* its value comes with the group's amax */
      rc = plan_add(q, wp, module, q->ct ? "weight_global_scale" : "weight_scale_2",
                    (struct qkeep_spec){.dtype = QKEEP_DTYPE_F32, .ndim = q->ct ? 1 : 0, .shape = {1}});
    if (!rc)
      rc = plan_const(q, wp, module, q->ct ? "input_global_scale" : "input_scale",
                      q->ct ? 2688.0f / act : act / 2688.0f, q->ct);
    return rc;
  }
  if (q->mxfp4) {
    if (k % 32)
      return set_error(QKEEP_E_INVAL, "tensor '%s': K = %lld is not a multiple of 32 (MXFP4)", name,
                       (long long)k);
    rc = plan_add(q, wp, module, "weight_packed", (struct qkeep_spec){QKEEP_DTYPE_U8, 2, {n, k / 2}});
    return rc ? rc
              : plan_add(q, wp, module, "weight_scale", (struct qkeep_spec){QKEEP_DTYPE_U8, 2, {n, k / 32}});
  }
  if (q->int8) {
    rc = plan_add(q, wp, module, "weight", (struct qkeep_spec){QKEEP_DTYPE_I8, 2, {n, k}});
    if (!rc)
      rc = plan_add(q, wp, module, "weight_scale", (struct qkeep_spec){QKEEP_DTYPE_F32, 2, {n, 1}});
    if (!rc && q->opt->static_input) {
      rc = plan_const(q, wp, module, "input_scale", q->opt->asym_input ? 2.0f * act / 255.0f : act / 127.0f,
                      true);
      if (!rc && q->opt->asym_input) { /* zero 0: a symmetric range [-act, act] in the asymmetric form */
        rc = plan_add(q, wp, module, "input_zero_point", (struct qkeep_spec){QKEEP_DTYPE_I32, 1, {1}});
        if (!rc) {
          struct out_tensor *z = &q->outs[wp->out[wp->n_out - 1]];
          z->constant = true;
          memset(z->value, 0, sizeof z->value);
        }
      }
    }
    return rc;
  }
  if (k % 8 || n % 8)
    return set_error(QKEEP_E_INVAL, "tensor '%s': [%lld, %lld] needs N and K multiples of 8 (int4 packing)",
                     name, (long long)n, (long long)k);
  int64_t g = q->group;
  if (q->ct_int4) {
    if (g > k || k % g)
      return set_error(QKEEP_E_INVAL, "module %s: group size %lld does not divide K = %lld (pass --group)",
                       module, (long long)g, (long long)k);
    enum qkeep_dtype scale_dtype = (enum qkeep_dtype)t->t->dtype; /* as compressed-tensors: the weight's */
    rc = plan_add(q, wp, module, "weight_packed", (struct qkeep_spec){QKEEP_DTYPE_I32, 2, {n, k / 8}});
    if (!rc)
      rc = plan_add(q, wp, module, "weight_scale", (struct qkeep_spec){scale_dtype, 2, {n, k / g}});
    if (!rc)
      rc = plan_add(q, wp, module, "weight_shape", (struct qkeep_spec){QKEEP_DTYPE_I64, 1, {2}});
    if (!rc) {
      struct out_tensor *shape = &q->outs[wp->out[wp->n_out - 1]];
      int64_t dims[2] = {n, k};
      shape->constant = true;
      memcpy(shape->value, dims, sizeof dims);
    }
    if (!rc && q->opt->asym_weights)
      rc = plan_add(q, wp, module, "weight_zero_point",
                    (struct qkeep_spec){QKEEP_DTYPE_I32, 2, {n / 8, k / g}});
    return rc;
  }
  if (g > k) /* one group size serves the whole checkpoint (config.json says it once) */
    return set_error(QKEEP_E_INVAL,
                     "module %s: K = %lld is smaller than the group size %lld; pass --group %lld or less",
                     module, (long long)k, (long long)g, (long long)k);
  if (k % g)
    return set_error(QKEEP_E_INVAL, "module %s: group size %lld does not divide K = %lld", module,
                     (long long)g, (long long)k);
  if (q->awq) {
    rc = plan_add(q, wp, module, "qweight", (struct qkeep_spec){QKEEP_DTYPE_I32, 2, {k, n / 8}});
    if (!rc)
      rc = plan_add(q, wp, module, "qzeros", (struct qkeep_spec){QKEEP_DTYPE_I32, 2, {k / g, n / 8}});
  } else {
    rc = plan_add(q, wp, module, "qweight", (struct qkeep_spec){QKEEP_DTYPE_I32, 2, {k / 8, n}});
    if (!rc)
      rc = plan_add(q, wp, module, "qzeros", (struct qkeep_spec){QKEEP_DTYPE_I32, 2, {k / g, n / 8}});
    if (!rc)
      rc = plan_add(q, wp, module, "g_idx", (struct qkeep_spec){QKEEP_DTYPE_I32, 1, {k}});
  }
  return rc ? rc : plan_add(q, wp, module, "scales", (struct qkeep_spec){QKEEP_DTYPE_F16, 2, {k / g, n}});
}

/* Plans a tensor copied unchanged. */
static int plan_copy(struct quantizer *q, const struct ckpt_tensor *t, size_t *index) {
  if (t->t->dtype < 0)
    return set_error(QKEEP_E_UNSUPPORTED, "%s: tensor '%s': dtype %s is not supported", t->file->path,
                     t->t->name, t->t->dtype_name);
  if (t->t->full_shape) /* the writer's specs hold 6 dims below 2^63: copying would change the shape */
    return set_error(QKEEP_E_UNSUPPORTED,
                     "%s: tensor '%s': a shape of %d dimensions (or one >= 2^63) cannot "
                     "be written by qkeep quantize",
                     t->file->path, t->t->name, t->t->full_ndim);
  struct qkeep_spec s = {.dtype = (enum qkeep_dtype)t->t->dtype, .ndim = t->t->ndim};
  memcpy(s.shape, t->t->shape, sizeof s.shape);
  return add_out(q, xstrdup(t->t->name), &s, index);
}

/* Synthetic FP8 kv-cache scales for each attention block (no calibration data here). */
static int plan_kv_scales(struct quantizer *q) {
  static const char suffix[] = ".k_proj.weight";
  float scale = (q->opt->activation_amax > 0 ? q->opt->activation_amax : 1.0f) / 448.0f;
  for (size_t i = 0; i < q->ck->n_tensors; i++) {
    const char *name = q->ck->tensors[i].t->name;
    size_t len = strlen(name);
    if (len < sizeof suffix || strcmp(name + len - (sizeof suffix - 1), suffix) != 0)
      continue;
    int rc = add_const_f32(q, strfmt("%.*s.k_scale", (int)(len - 7), name), scale, false, NULL);
    if (!rc)
      rc = add_const_f32(q, strfmt("%.*s.v_proj.v_scale", (int)(len - sizeof suffix + 1), name), scale, false,
                         NULL);
    if (rc)
      return rc;
  }
  return 0;
}

/* Bytes a member holds while in flight: its input, its outputs, and the temporaries. */
static int64_t member_bytes(const struct quantizer *q, const struct member *m, const struct weight_plan *wp) {
  int64_t bytes = (int64_t)m->in->t->nbytes;
  for (int i = 0; i < wp->n_out; i++)
    if (!q->outs[wp->out[i]].constant)
      bytes += (int64_t)q->outs[wp->out[i]].nbytes;
  if (q->awq) /* GPTQ's qweight and qzeros before the repack */
    bytes += m->n * m->k / 2 + m->n * m->k / q->group / 2;
  if (q->ct_int4) /* f32 scales */
    bytes += m->n * (m->k / q->group) * 4;
  return bytes;
}

static int add_unit(struct quantizer *q, struct unit **out) {
  int rc = grow_array((void **)&q->units, &q->cap_units, q->n_units + 1, sizeof *q->units);
  if (rc)
    return rc;
  *out = &q->units[q->n_units];
  **out = (struct unit){.index = q->n_units};
  q->n_units++;
  return 0;
}

/* What writes an output tensor, for messages. */
static char *output_origin(const struct out_tensor *o) {
  if (!o->from)
    return strfmt("a kv-cache scale of qkeep quantize");
  return o->copied ? strfmt("the input's tensor '%s' (copied)", o->from->t->name)
                   : strfmt("quantizing '%s'", o->from->t->name);
}

/*
 * Every output name once, across all shards: an input tensor named as one that quantizing another
 * writes (`a.q_proj.weight_scale` beside `a.q_proj.weight`) is refused before anything is written.
 * The shards' writers see one shard each, so two copies in two shards would pass them.
 */
static int check_unique_outputs(const struct quantizer *q) {
  struct name_index seen = {0};
  int rc = name_index_reserve(&seen, q->n_outs);
  for (size_t i = 0; i < q->n_outs && !rc; i++) {
    size_t first;
    rc = name_index_put(&seen, q->outs[i].name, i, &first);
    if (rc == QKEEP_E_EXISTS) {
      char *a = output_origin(&q->outs[first]), *b = output_origin(&q->outs[i]);
      rc = a && b ? set_error(QKEEP_E_FORMAT,
                              "%s: output tensor '%s' would be written twice, by %s and by %s; rename or "
                              "remove the input tensor",
                              q->ck->path, q->outs[i].name, a, b)
                  : set_error(QKEEP_E_NOMEM, "out of memory");
      free(a);
      free(b);
    }
  }
  name_index_clear(&seen);
  return rc;
}

/* The whole plan: outputs in the order the scheme writes them, then units in input order. */
static int plan(struct quantizer *q) {
  const struct ckpt *ck = q->ck;
  struct weight_plan *wps = calloc(ck->n_tensors ? ck->n_tensors : 1, sizeof *wps);
  size_t *copy_of = calloc(ck->n_tensors ? ck->n_tensors : 1, sizeof *copy_of);
  bool *claimed = calloc(ck->n_tensors ? ck->n_tensors : 1, sizeof *claimed);
  int rc = wps && copy_of && claimed ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < ck->n_tensors && !rc; i++) {
    const struct ckpt_tensor *t = &ck->tensors[i];
    if (!quantizable(t)) {
      rc = plan_copy(q, t, &copy_of[i]);
      if (!rc)
        q->outs[copy_of[i]].from = t, q->outs[copy_of[i]].copied = true;
      continue;
    }
    char *module = strfmt("%.*s", (int)(strlen(t->t->name) - 7), t->t->name);
    rc = module ? plan_weight(q, t, module, &wps[i]) : set_error(QKEEP_E_NOMEM, "out of memory");
    for (int o = 0; o < wps[i].n_out && !rc; o++)
      q->outs[wps[i].out[o]].from = t;
    if (rc && rc != QKEEP_E_NOMEM)
      add_error_context(rc, "quantizing '%s'", t->t->name);
    free(module);
  }
  if (!rc && q->opt->kv_cache_scales)
    rc = plan_kv_scales(q);
  if (!rc)
    rc = check_unique_outputs(q);
  for (size_t i = 0; i < ck->n_tensors && !rc; i++) {
    const struct ckpt_tensor *t = &ck->tensors[i];
    struct unit *u;
    if (claimed[i] || (rc = add_unit(q, &u)))
      continue;
    if (!quantizable(t)) {
      u->kind = UNIT_COPY;
      u->copy_in = t;
      u->copy_out = copy_of[i];
      u->in_bytes = (int64_t)t->t->nbytes;
      u->n_tensors = 1;
      continue;
    }
    const struct ckpt_tensor *group[MAX_MEMBERS] = {t};
    int n_group = q->nvfp4 ? fusion_group(ck, t, group) : 1;
    if (n_group < 0) {
      rc = n_group;
      break;
    }
    u->kind = UNIT_QUANT;
    for (int g = 0; g < n_group && !rc; g++) {
      size_t at = (size_t)(group[g] - ck->tensors);
      struct member *m = &u->m[u->n_members++];
      *m = (struct member){.in = group[g],
                           .input = group[g]->t->name,
                           .dtype = group[g]->t->dtype,
                           .n = group[g]->t->shape[0],
                           .k = group[g]->t->shape[1]};
      m->module = strfmt("%.*s", (int)(strlen(group[g]->t->name) - 7), group[g]->t->name);
      if (!m->module)
        rc = set_error(QKEEP_E_NOMEM, "out of memory");
      /* row blocks: whole 8-row groups (int4 packs 8 rows into one word of zero points), about
       * BLOCK_ELEMENTS elements each */
      int64_t rows = m->k > 0 ? BLOCK_ELEMENTS / m->k / 8 * 8 : m->n;
      m->block_rows = rows < 8 ? 8 : rows;
      if (m->block_rows * m->k > q->scratch_elements)
        q->scratch_elements = m->block_rows * m->k;
      memcpy(m->out, wps[at].out, sizeof m->out);
      m->n_out = wps[at].n_out;
      claimed[at] = true;
      u->in_bytes += (int64_t)group[g]->t->nbytes;
      u->bytes += member_bytes(q, m, &wps[at]);
      u->n_tensors++;
    }
  }
  free(wps);
  free(copy_of);
  free(claimed);
  return rc;
}

/* ---- shards ---------------------------------------------------------------------------- */

/* Assigns outputs to shards in plan order (a new shard when the next tensor would overflow
 * max_shard_bytes), lays each out as st_writer_write would, creates the files under temporary
 * names and writes their headers and constant tensors. */
static int open_shards(struct quantizer *q) {
  int64_t max = q->opt->max_shard_bytes, shard_bytes = 0;
  int shard = 0;
  for (size_t i = 0; i < q->n_outs; i++) {
    int64_t bytes = (int64_t)q->outs[i].nbytes;
    if (max > 0 && shard_bytes > 0 && shard_bytes + bytes > max) {
      shard++;
      shard_bytes = 0;
    }
    q->outs[i].shard = shard;
    shard_bytes += bytes;
  }
  q->n_shards = q->n_outs ? shard + 1 : 0;
  q->fds = malloc((size_t)(q->n_shards ? q->n_shards : 1) * sizeof *q->fds);
  q->tmp_paths = calloc((size_t)(q->n_shards ? q->n_shards : 1), sizeof *q->tmp_paths);
  q->shard_labels = calloc((size_t)(q->n_shards ? q->n_shards : 1), sizeof *q->shard_labels);
  for (int s = 0; s < q->n_shards && q->fds; s++) /* before any return: quantizer_free closes what is >= 0 */
    q->fds[s] = -1;
  if (!q->fds || !q->tmp_paths || !q->shard_labels)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  int rc = 0;
  size_t first = 0;
  for (int s = 0; s < q->n_shards && !rc; s++) {
    size_t end = first;
    while (end < q->n_outs && q->outs[end].shard == s)
      end++;
    struct st_writer *w = NULL;
    struct st_layout layout = {0};
    rc = st_writer_new(&w);
    for (size_t i = first; i < end && !rc; i++)
      rc = st_writer_plan(w, q->outs[i].name, &q->outs[i].spec);
    if (!rc)
      rc = st_writer_layout(w, &layout);
    st_writer_free(w);
    if (!rc && !(q->tmp_paths[s] = strfmt("%s/shard-%05d.tmp", q->out_dir, s)))
      rc = set_error(QKEEP_E_NOMEM, "out of memory");
    if (!rc && !(q->shard_labels[s] = q->n_shards == 1 ? strfmt("%s/model.safetensors", q->user_dir)
                                                       : strfmt("%s/model-%05d-of-%05d.safetensors",
                                                                q->user_dir, s + 1, q->n_shards)))
      rc = set_error(QKEEP_E_NOMEM, "out of memory");
    if (!rc && (q->fds[s] = open(q->tmp_paths[s], O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)) < 0)
      rc = set_error(error_from_errno(errno), "%s: cannot create: %s", q->shard_labels[s], strerror(errno));
    /* The file's full size now, so that a full disk shows here rather than half-way. */
    if (!rc && ftruncate(q->fds[s], (off_t)layout.file_size) != 0)
      rc = set_error(error_from_errno(errno), "%s: cannot size to %llu bytes: %s", q->shard_labels[s],
                     (unsigned long long)layout.file_size, strerror(errno));
    if (!rc && pwrite_full(q->fds[s], layout.header, layout.header_len, 0) != 0)
      rc = set_error(error_from_errno(errno), "%s: cannot write the header: %s", q->shard_labels[s],
                     strerror(errno));
    for (size_t i = first; i < end && !rc; i++) {
      q->outs[i].offset = layout.offsets[i - first];
      if (q->outs[i].constant &&
          pwrite_full(q->fds[s], q->outs[i].value, q->outs[i].nbytes, q->outs[i].offset))
        rc = set_error(error_from_errno(errno), "%s: cannot write '%s': %s", q->shard_labels[s],
                       q->outs[i].name, strerror(errno));
      else if (q->outs[i].constant)
        q->written += (int64_t)q->outs[i].nbytes;
    }
    q->written += (int64_t)layout.header_len;
    st_layout_free(&layout);
    first = end;
  }
  return rc;
}

/* Writes one output tensor's bytes at its offset; the error names the file and tensor. */
static int write_out(struct quantizer *q, size_t index, const void *data) {
  const struct out_tensor *o = &q->outs[index];
  if (o->nbytes && pwrite_full(q->fds[o->shard], data, o->nbytes, o->offset) != 0)
    return set_error(error_from_errno(errno), "%s: cannot write '%s': %s", q->shard_labels[o->shard], o->name,
                     strerror(errno));
  return 0;
}

static int shard_name(const struct quantizer *q, int s, char **out) {
  *out = q->n_shards == 1 ? strfmt("%s/model.safetensors", q->out_dir)
                          : strfmt("%s/model-%05d-of-%05d.safetensors", q->out_dir, s + 1, q->n_shards);
  return *out ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
}

/* Closes the shards, renames them to their final names and writes the index when sharded. */
static int finish_shards(struct quantizer *q) {
  int rc = 0;
  for (int s = 0; s < q->n_shards; s++) {
    if (close(q->fds[s]) != 0 && !rc)
      rc = set_error(error_from_errno(errno), "%s: %s", q->shard_labels[s], strerror(errno));
    q->fds[s] = -1;
  }
  for (int s = 0; s < q->n_shards && !rc; s++) {
    char *to;
    if ((rc = shard_name(q, s, &to)))
      break;
    if (rename(q->tmp_paths[s], to) != 0)
      rc = set_error(error_from_errno(errno), "%s: cannot rename into place: %s", q->shard_labels[s],
                     strerror(errno));
    free(to);
  }
  if (rc || q->n_shards < 2)
    return rc;
  json_t *index = json_object(), *map = json_object(), *meta = json_object();
  bool ok = index != NULL;
  for (size_t i = 0; i < q->n_outs && ok; i++) {
    char *file = strfmt("model-%05d-of-%05d.safetensors", q->outs[i].shard + 1, q->n_shards);
    jset(&ok, map, q->outs[i].name, file ? json_string(file) : NULL);
    free(file);
  }
  jset(&ok, meta, "format", json_string("pt"));
  jset(&ok, index, "metadata", meta);
  jset(&ok, index, "weight_map", map);
  char *path = ok ? strfmt("%s/model.safetensors.index.json", q->out_dir) : NULL;
  if (!path)
    rc = set_error(QKEEP_E_NOMEM, "out of memory");
  else if (json_dump_file(index, path, JSON_INDENT(2) | JSON_SORT_KEYS) != 0)
    rc = set_error(error_from_errno(errno), "%s/model.safetensors.index.json: cannot write: %s", q->user_dir,
                   strerror(errno));
  free(path);
  json_decref(index);
  return rc;
}

/* ---- units ----------------------------------------------------------------------------- */

/* Rows of f32 from a member's input bytes. */
static void to_f32(const struct member *m, int64_t row0, int64_t rows, float *restrict dst) {
  int64_t count = rows * m->k, first = row0 * m->k;
  switch ((enum qkeep_dtype)m->dtype) {
  case QKEEP_DTYPE_F32: memcpy(dst, (const float *)m->raw + first, (size_t)count * sizeof *dst); break;
  case QKEEP_DTYPE_BF16: { /* bf16 is the top half of an f32 */
    const uint16_t *restrict src = (const uint16_t *)m->raw + first;
    int64_t i = 0;
    for (; i + VECTOR_RUN <= count; i += VECTOR_RUN)
      for (int j = 0; j < VECTOR_RUN; j++) {
        uint32_t bits = (uint32_t)src[i + j] << 16;
        memcpy(&dst[i + j], &bits, sizeof bits);
      }
    for (; i < count; i++) {
      uint32_t bits = (uint32_t)src[i] << 16;
      memcpy(&dst[i], &bits, sizeof bits);
    }
    break;
  }
  default:
    for (int64_t i = 0; i < count; i++)
      dst[i] = qk_load_float(m->raw, m->dtype, (size_t)(first + i));
  }
}

/*
 * The rows' amax, and whether they are all finite, from the input's bits: for finite
 * values the magnitude's bits order as the magnitudes do, so an integer max (a vector
 * loop, no conversion) gives quant_check_rows's amax exactly. False when a NaN or Inf
 * is there (quant_check_rows then names it).
 */
static bool raw_amax(const struct member *m, int64_t row0, int64_t rows, float *amax) {
  int64_t count = rows * m->k, first = row0 * m->k;
  switch ((enum qkeep_dtype)m->dtype) {
  case QKEEP_DTYPE_BF16:
  case QKEEP_DTYPE_F16: {
    const uint16_t *src = (const uint16_t *)m->raw + first;
    int16_t top = 0; /* magnitudes fit int16: a signed max, which SSE2 has */
    int64_t i = 0;
    for (; i + VECTOR_RUN <= count; i += VECTOR_RUN)
      for (int j = 0; j < VECTOR_RUN; j++) {
        int16_t a = (int16_t)(src[i + j] & 0x7fffu);
        top = a > top ? a : top;
      }
    for (; i < count; i++) {
      int16_t a = (int16_t)(src[i] & 0x7fffu);
      top = a > top ? a : top;
    }
    bool bf16 = m->dtype == QKEEP_DTYPE_BF16;
    if (top >= (bf16 ? 0x7f80 : 0x7c00)) /* the exponent all ones */
      return false;
    *amax = bf16 ? qk_bf16_to_f32((uint16_t)top) : qk_f16_to_f32((uint16_t)top);
    return true;
  }
  default: {
    const uint32_t *src = (const uint32_t *)m->raw + first; /* f32, as malloc'd bytes */
    uint32_t top = 0;
    for (int64_t i = 0; i < count; i++) {
      uint32_t a = src[i] & 0x7fffffffu;
      top = a > top ? a : top;
    }
    if (top >= 0x7f800000u)
      return false;
    memcpy(amax, &top, sizeof *amax);
    return true;
  }
  }
}

/* Allocates a member's output and temporary buffers. */
static int member_alloc(const struct quantizer *q, struct member *m) {
  for (int i = 0; i < m->n_out; i++) {
    const struct out_tensor *o = &q->outs[m->out[i]];
    /* calloc: AWQ's repack ORs nibbles into its words */
    if (!o->constant && !(m->buf[i] = calloc(o->nbytes ? o->nbytes : 1, 1)))
      return set_error(QKEEP_E_NOMEM, "out of memory for '%s' (%zu bytes)", o->name, o->nbytes);
  }
  size_t groups = q->group ? (size_t)(m->k / q->group) : 0;
  if (q->awq && (!(m->tmp[0] = malloc((size_t)(m->n * m->k / 2) + 1)) ||
                 !(m->tmp[1] = malloc(groups * (size_t)m->n / 2 + 1))))
    return set_error(QKEEP_E_NOMEM, "out of memory");
  if (q->ct_int4 && !(m->tmp[0] = malloc(groups * (size_t)m->n * sizeof(float) + 1)))
    return set_error(QKEEP_E_NOMEM, "out of memory");
  return 0;
}

static void member_release(struct member *m) {
  free(m->raw);
  m->raw = NULL;
  for (int i = 0; i < MAX_OUTPUTS; i++) {
    free(m->buf[i]);
    m->buf[i] = NULL;
  }
  for (int i = 0; i < 2; i++) {
    free(m->tmp[i]);
    m->tmp[i] = NULL;
  }
}

/* Keeps the calling thread's error detail in a block's slot. */
static void keep_error(int rc, int *slot_rc, char **slot_msg) {
  *slot_rc = rc;
  *slot_msg = xstrdup(qkeep_errmsg());
}

/* AWQ: rows [r0, r0 + rows) of GPTQ's words repacked into AWQ's [K, N/8] and [K/G, N/8]
 * words, columns in AWQ's nibble order; the rows are whole words there (r0 % 8 == 0). */
static void awq_repack(const struct quantizer *q, struct member *m, int64_t r0, int64_t rows) {
  int64_t n = m->n, k = m->k, g = q->group;
  const int32_t *qweight = m->tmp[0], *qzeros = m->tmp[1];
  int32_t *awq_w = m->buf[0], *awq_z = m->buf[1];
  bool sym = !q->opt->asym_weights;
  for (int64_t kk = 0; kk < k; kk++)
    for (int64_t c = r0; c < r0 + rows; c++) {
      uint32_t v = (uint32_t)qk_nibble(qweight[(kk / 8) * n + c], (int)(kk % 8));
      awq_w[kk * (n / 8) + c / 8] |= (int32_t)(v << (4 * qkeep_awq_nibble(c % 8)));
    }
  for (int64_t gr = 0; gr < k / g; gr++)
    for (int64_t c = r0; c < r0 + rows; c++) {
      uint32_t z = (uint32_t)(sym ? 8 : qk_gptq_zero(qzeros, n, gr, c, 0));
      awq_z[gr * (n / 8) + c / 8] |= (int32_t)((z & 0xf) << (4 * qkeep_awq_nibble(c % 8)));
    }
}

/* ct-int4: rows of f32 scales stored in the weight's dtype (f16 must not overflow). */
static int ct_scales(const struct quantizer *q, struct member *m, int64_t r0, int64_t rows) {
  int64_t groups = m->k / q->group;
  const float *scales = (const float *)m->tmp[0] + r0 * groups;
  enum qkeep_dtype dtype = q->outs[m->out[1]].spec.dtype;
  if (dtype == QKEEP_DTYPE_F32) {
    memcpy((float *)m->buf[1] + r0 * groups, scales, (size_t)(rows * groups) * sizeof *scales);
    return 0;
  }
  uint16_t *half = (uint16_t *)m->buf[1] + r0 * groups;
  for (int64_t i = 0; i < rows * groups; i++) {
    half[i] = dtype == QKEEP_DTYPE_F16 ? qk_f32_to_f16(scales[i]) : qk_f32_to_bf16(scales[i]);
    if (dtype == QKEEP_DTYPE_F16 && isinf(qk_f16_to_f32(half[i])))
      return set_error(QKEEP_E_INVAL, "module %s: scale %g overflows float16", m->module, (double)scales[i]);
  }
  return 0;
}

/* Rows of one member through the scheme's quantizer, into its buffers. */
static int quantize_rows(const struct quantizer *q, const struct unit *u, struct member *m, int64_t r0,
                         int64_t rows, const float *w) {
  int64_t k = m->k, g = q->group;
  if (q->nvfp4) {
    quant_nvfp4_rows(w, rows, k, q->ct, u->group_amax, (uint8_t *)m->buf[0] + r0 * k / 2,
                     (uint8_t *)m->buf[1] + r0 * k / 16);
    return 0;
  }
  if (q->mxfp4) {
    quant_mxfp4_rows(w, rows, k, (uint8_t *)m->buf[0] + r0 * k / 2, (uint8_t *)m->buf[1] + r0 * k / 32);
    return 0;
  }
  if (q->int8)
    return quant_int8_rows(w, r0, rows, k, (int8_t *)m->buf[0] + r0 * k, (float *)m->buf[1] + r0);
  bool sym = !q->opt->asym_weights;
  if (q->ct_int4) {
    int64_t groups = k / g;
    quant_ct_int4_rows(w, rows, k, g, sym, (int32_t *)m->buf[0] + r0 * (k / 8),
                       (float *)m->tmp[0] + r0 * groups, sym ? NULL : (int32_t *)m->buf[3] + r0 / 8 * groups);
    return ct_scales(q, m, r0, rows);
  }
  int32_t *qweight = q->awq ? m->tmp[0] : m->buf[0], *qzeros = q->awq ? m->tmp[1] : m->buf[1];
  uint16_t *scales = m->buf[q->awq ? 2 : 3];
  int rc = quant_gptq_int4_rows(w, r0, rows, m->n, k, g, sym, qweight, scales, qzeros);
  if (!rc && q->awq)
    awq_repack(q, m, r0, rows);
  return rc;
}

/* Which member and rows block b of a unit covers. */
static struct member *block_rows(struct unit *u, int64_t b, int64_t *r0, int64_t *rows) {
  struct member *m = &u->m[0];
  while (b >= m->first_block + m->n_blocks)
    m++;
  *r0 = (b - m->first_block) * m->block_rows;
  *rows = m->n - *r0 < m->block_rows ? m->n - *r0 : m->block_rows;
  return m;
}

/* Runs block b of the unit's current stage: NVFP4's first stage checks and takes the amax; the
 * last stage quantizes (checking first when there is no earlier stage). */
static void run_block(const struct quantizer *q, struct unit *u, int stage, int64_t b, float *scratch) {
  int64_t r0, rows;
  struct member *m = block_rows(u, b, &r0, &rows);
  struct block_result *res = &u->results[b];
  bool check = stage == 0, last = stage == u->n_stages - 1;
  int rc;
  if (check && !raw_amax(m, r0, rows, &res->amax)) {
    to_f32(m, r0, rows, scratch);
    rc = quant_check_rows(scratch, r0, rows, m->k, &res->amax);
    assert(rc);
    keep_error(rc, &res->finite_rc, &res->finite_msg);
    return;
  }
  if (!last)
    return;
  to_f32(m, r0, rows, scratch);
  if ((rc = quantize_rows(q, u, m, r0, rows, scratch)))
    keep_error(rc, &res->other_rc, &res->other_msg);
}

/* The first error of a stage, in a single thread's order, as the calling thread's detail; 0 if none.
 * Frees the messages. */
static int stage_error(struct unit *u) {
  int rc = 0;
  int64_t at = -1;
  for (int64_t b = 0; b < u->n_blocks && at < 0; b++)
    if (u->results[b].finite_rc)
      at = b;
  if (at >= 0) {
    rc =
        set_error(u->results[at].finite_rc, "%s", u->results[at].finite_msg ? u->results[at].finite_msg : "");
  } else {
    for (int64_t b = 0; b < u->n_blocks && at < 0; b++)
      if (u->results[b].other_rc)
        at = b;
    if (at >= 0)
      rc = set_error(u->results[at].other_rc, "%s", u->results[at].other_msg ? u->results[at].other_msg : "");
  }
  if (rc) {
    int64_t r0, rows;
    struct member *m = block_rows(u, at, &r0, &rows);
    add_error_context(rc, "quantizing '%s'", m->input);
  }
  for (int64_t b = 0; b < u->n_blocks; b++) {
    free(u->results[b].finite_msg);
    free(u->results[b].other_msg);
    u->results[b] = (struct block_result){.amax = u->results[b].amax};
  }
  return rc;
}

/* After the last block of a stage: the next stage's set-up, or the unit's outputs written.
 * Returns 1 when another stage follows, 0 when the unit is done, or an error. */
static int stage_done(struct quantizer *q, struct unit *u) {
  int rc = stage_error(u);
  if (rc)
    return rc;
  if (u->stage + 1 < u->n_stages) { /* NVFP4: the group's amax, then its global scale */
    float amax = 0.0f;
    for (int64_t b = 0; b < u->n_blocks; b++)
      amax = u->results[b].amax > amax ? u->results[b].amax : amax;
    float global;
    if ((rc = quant_nvfp4_global(amax, q->ct, &global)))
      return add_error_context(rc, "quantizing '%s'", u->m[0].input);
    u->group_amax = amax;
    return 1;
  }
  for (int i = 0; i < u->n_members && !rc; i++) {
    struct member *m = &u->m[i];
    if (q->nvfp4) {
      float global;
      quant_nvfp4_global(u->group_amax, q->ct, &global);
      memcpy(m->buf[2], &global, sizeof global);
    }
    if (q->gptq && !q->awq)
      for (int64_t kk = 0; kk < m->k; kk++)
        ((int32_t *)m->buf[2])[kk] = (int32_t)(kk / q->group);
    for (int o = 0; o < m->n_out && !rc && q->fds; o++) /* a plan run online writes no file */
      if (!q->outs[m->out[o]].constant)
        rc = write_out(q, m->out[o], m->buf[o]);
  }
  return rc;
}

/* ---- the pool ----------------------------------------------------------------------------- */

/*
 * Work shared by the threads: units in flight (in input order), each with blocks to hand out. The
 * offline quantizer's stream and a load's quant_pool (below) run on it alike; the two differ only
 * in what happens to a unit once its last stage ends (written and freed here, or handed back to the
 * load that started it: unit->job).
 */
struct pool {
  struct quantizer *q;
  pthread_mutex_t lock;
  pthread_cond_t wake; /* a block is ready, a unit finished, or stop */
  struct unit *active, *active_tail;
  int64_t in_flight_bytes, budget, peak_bytes;
  int64_t tensors_done, bytes_done;
  size_t first_failed; /* the lowest failed unit's index (q->n_units: none) */
  int failed_rc;
  char *failed_msg;
  bool stop;
  pthread_t *threads; /* the workers (pool_start) */
  int started;
};

/* A unit a load started (quant_pool_start): its own copy of the plan's unit, and how it ended. */
struct quant_job {
  struct unit u;
  bool done; /* under the pool's lock */
  int rc;
  char *msg; /* the detail of rc, from the thread that ended the unit */
};

/* Records a unit's failure (the calling thread's detail); the lowest unit's wins. Under the lock. */
static void note_failure(struct pool *p, size_t index, int rc) {
  if (index >= p->first_failed)
    return;
  free(p->failed_msg);
  p->failed_msg = xstrdup(qkeep_errmsg());
  p->failed_rc = rc;
  p->first_failed = index;
}

/* Takes a block of the first active unit that has one; false when none. Under the lock. */
static bool take_block(struct pool *p, struct unit **u, int *stage, int64_t *b) {
  for (struct unit *x = p->active; x; x = x->next_active)
    if (x->next_block < x->n_blocks) {
      *u = x;
      *stage = x->stage;
      *b = x->next_block++;
      return true;
    }
  return false;
}

/* Takes a unit off the active list. Under the lock. */
static void pool_unlink(struct pool *p, struct unit *u) {
  struct unit **link = &p->active, *prev = NULL;
  while (*link != u) {
    prev = *link;
    link = &(*link)->next_active;
  }
  *link = u->next_active;
  if (p->active_tail == u)
    p->active_tail = prev;
}

/* Appends a unit whose blocks are ready to the active list and wakes the workers. Under the lock. */
static void pool_append(struct pool *p, struct unit *u) {
  u->next_active = NULL;
  if (p->active_tail)
    p->active_tail->next_active = u;
  else
    p->active = u;
  p->active_tail = u;
  pthread_cond_broadcast(&p->wake);
}

static void unit_release(struct unit *u) {
  for (int i = 0; i < u->n_members; i++)
    member_release(&u->m[i]);
  free(u->results);
  u->results = NULL;
}

/* Runs one block (lock held on entry and on return); the thread that ends a stage moves the unit on. */
static void work_one(struct pool *p, struct unit *u, int stage, int64_t b, float *scratch) {
  pthread_mutex_unlock(&p->lock);
  run_block(p->q, u, stage, b, scratch);
  pthread_mutex_lock(&p->lock);
  if (--u->blocks_left > 0)
    return;
  pthread_mutex_unlock(&p->lock);
  int rc = stage_done(p->q, u);
  pthread_mutex_lock(&p->lock);
  if (rc == 1) { /* the next stage's blocks */
    u->stage++;
    u->next_block = 0;
    u->blocks_left = u->n_blocks;
    pthread_cond_broadcast(&p->wake);
    return;
  }
  if (u->job) { /* a load's unit: off the active list, and back to the thread that waits for it */
    pool_unlink(p, u);
    u->job->rc = rc < 0 ? rc : 0;
    u->job->msg = rc < 0 ? xstrdup(qkeep_errmsg()) : NULL;
    u->job->done = true;
    pthread_cond_broadcast(&p->wake);
    return;
  }
  if (rc)
    note_failure(p, u->index, rc);
  /* counted before it leaves the active list: the driver's final report follows an empty list */
  if (!rc) {
    p->tensors_done += u->n_tensors;
    p->bytes_done += u->in_bytes;
    for (int i = 0; i < u->n_members; i++)
      for (int o = 0; o < u->m[i].n_out; o++)
        if (!p->q->outs[u->m[i].out[o]].constant)
          p->q->written += (int64_t)p->q->outs[u->m[i].out[o]].nbytes;
  }
  pool_unlink(p, u);
  pthread_mutex_unlock(&p->lock);
  unit_release(u);
  pthread_mutex_lock(&p->lock);
  p->in_flight_bytes -= u->bytes;
  pthread_cond_broadcast(&p->wake);
}

static void *worker(void *arg) {
  struct pool *p = arg;
  float *scratch = malloc((size_t)p->q->scratch_elements * sizeof *scratch + 1);
  pthread_mutex_lock(&p->lock);
  while (!p->stop) {
    struct unit *u;
    int stage;
    int64_t b;
    if (scratch && take_block(p, &u, &stage, &b))
      work_one(p, u, stage, b, scratch);
    else
      pthread_cond_wait(&p->wake, &p->lock);
  }
  pthread_mutex_unlock(&p->lock);
  free(scratch);
  return NULL;
}

/* The lock, and up to `workers` threads running worker(); fewer when the system gives fewer (the same
 * bytes, later: the thread that waits works on blocks too). */
static int pool_start(struct pool *p, int workers) {
  p->threads = calloc((size_t)(workers > 0 ? workers : 1), sizeof *p->threads);
  if (!p->threads)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  pthread_mutex_init(&p->lock, NULL);
  pthread_cond_init(&p->wake, NULL);
  for (p->started = 0; p->started < workers; p->started++)
    if (pthread_create(&p->threads[p->started], NULL, worker, p) != 0)
      break;
  return 0;
}

/* Stops and joins the workers (every unit ended or taken off first), then frees the pool's own parts. */
static void pool_stop(struct pool *p) {
  pthread_mutex_lock(&p->lock);
  assert(!p->active);
  p->stop = true;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->lock);
  for (int i = 0; i < p->started; i++)
    pthread_join(p->threads[i], NULL);
  pthread_cond_destroy(&p->wake);
  pthread_mutex_destroy(&p->lock);
  free(p->threads);
  p->threads = NULL;
  p->started = 0;
}

/* ---- the calling thread: reading, copying, progress -------------------------------------------- */

/* Whether the caller asked the run to stop (its cancel callback). Calling thread only. */
static bool cancelled(const struct quantizer *q) {
  int (*cancel)(void *) = OPTION(q->opt, cancel);
  return cancel && cancel(OPTION(q->opt, cancel_user)) != 0;
}

static int interrupted(const struct quantizer *q) {
  return set_error(QKEEP_E_INTERRUPTED, "%s: stopped before it was written whole; nothing was left behind",
                   q->user_dir);
}

struct driver {
  struct pool *p;
  float *scratch;
  unsigned char *chunk; /* for copies */
  double start, last_report;
  int64_t bytes_total;
  int threads;
};

static void report(struct driver *d, bool final, struct qkeep_quantize_progress *out) {
  struct pool *p = d->p;
  const struct qkeep_quantize_options *opt = p->q->opt;
  struct qkeep_quantize_progress pr = {
      .size = sizeof pr,
      .tensors_done = p->tensors_done,
      .tensors_total = (int64_t)p->q->ck->n_tensors,
      .bytes_done = p->bytes_done,
      .bytes_written = p->q->written,
      .seconds = now_seconds() - d->start,
      .threads = d->threads,
      .peak_buffer_bytes = p->peak_bytes,
      .buffer_bound = p->budget + (int64_t)d->threads * p->q->scratch_elements * 4 + (int64_t)COPY_CHUNK,
  };
  pr.bytes_total = d->bytes_total;
  if (out)
    copy_sized(out, &pr, sizeof pr);
  void (*progress)(void *, const struct qkeep_quantize_progress *) = OPTION(opt, progress);
  if (progress && (final || pr.seconds - d->last_report >= 0.1)) {
    d->last_report = pr.seconds;
    pthread_mutex_unlock(&p->lock); /* the callback may take its time */
    progress(OPTION(opt, progress_user), &pr);
    pthread_mutex_lock(&p->lock);
  }
}

/* Waits (working on blocks meanwhile) until `ready` holds. Lock held. */
static void help_until(struct driver *d, bool (*ready)(struct pool *p, int64_t arg), int64_t arg) {
  struct pool *p = d->p;
  while (!ready(p, arg)) {
    struct unit *u;
    int stage;
    int64_t b;
    if (take_block(p, &u, &stage, &b)) {
      work_one(p, u, stage, b, d->scratch);
    } else {
      struct timespec until;
      clock_gettime(CLOCK_REALTIME, &until);
      until.tv_nsec += 100 * 1000 * 1000;
      if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
      }
      pthread_cond_timedwait(&p->wake, &p->lock, &until);
    }
    if (p->first_failed != 0 && cancelled(p->q))
      note_failure(p, 0, interrupted(p->q)); /* no more units start; those in flight end */
    report(d, false, NULL);
  }
}

static bool room_for(struct pool *p, int64_t bytes) {
  return p->first_failed < p->q->n_units || p->in_flight_bytes == 0 ||
         p->in_flight_bytes + bytes <= p->budget;
}

static bool all_done(struct pool *p, int64_t unused) {
  (void)unused;
  return p->active == NULL;
}

/* Reads n bytes of a tensor from byte `at` of its data, with st_read's messages for a short file. */
static int read_part(const struct ckpt_tensor *t, uint64_t at, void *dst, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = pread(t->file->fd, (char *)dst + got, n - got, (off_t)(t->t->offset + at + got));
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return set_error(QKEEP_E_IO, "%s: tensor '%s': read failed at byte %llu: %s", t->file->path, t->t->name,
                       (unsigned long long)(t->t->offset + at + got), strerror(errno));
    if (r == 0)
      return set_error(QKEEP_E_IO,
                       "%s: tensor '%s': unexpected end of file at byte %llu (did the file shrink?)",
                       t->file->path, t->t->name, (unsigned long long)(t->t->offset + at + got));
    got += (size_t)r;
  }
  return 0;
}

/* A tensor copied unchanged, through the chunk buffer, on the calling thread (lock not held). */
static int copy_unit(struct driver *d, const struct unit *u, const struct ckpt_tensor *t) {
  struct quantizer *q = d->p->q;
  const struct out_tensor *o = &q->outs[u->copy_out];
  if (t->t->nbytes <= COPY_CHUNK) { /* st_read's checks (file size) */
    int rc = ckpt_read(q->ck, t, d->chunk);
    return rc ? rc : write_out(q, u->copy_out, d->chunk);
  }
  for (uint64_t at = 0; at < t->t->nbytes; at += COPY_CHUNK) {
    size_t n = t->t->nbytes - at < COPY_CHUNK ? (size_t)(t->t->nbytes - at) : COPY_CHUNK;
    int rc = read_part(t, at, d->chunk, n);
    if (!rc && pwrite_full(q->fds[o->shard], d->chunk, n, o->offset + at) != 0)
      rc = set_error(error_from_errno(errno), "%s: cannot write '%s': %s", q->shard_labels[o->shard], o->name,
                     strerror(errno));
    if (!rc && cancelled(q))
      rc = interrupted(q);
    if (rc)
      return rc;
  }
  return 0;
}

/* Reads a unit's inputs and sets up its blocks (lock not held). */
static int start_unit(struct quantizer *q, struct unit *u) {
  int64_t blocks = 0;
  for (int i = 0; i < u->n_members; i++) {
    struct member *m = &u->m[i];
    int rc = member_alloc(q, m);
    if (!rc && !(m->raw = malloc(m->in->t->nbytes ? m->in->t->nbytes : 1)))
      rc = set_error(QKEEP_E_NOMEM, "out of memory reading '%s'", m->in->t->name);
    if (!rc)
      rc = ckpt_read(q->ck, m->in, m->raw);
    if (rc)
      return rc;
    m->first_block = blocks;
    m->n_blocks = m->n > 0 ? (m->n + m->block_rows - 1) / m->block_rows : 0;
    blocks += m->n_blocks;
  }
  u->n_stages = q->nvfp4 ? 2 : 1;
  u->stage = 0;
  u->n_blocks = blocks;
  u->next_block = 0;
  u->blocks_left = blocks;
  if (!(u->results = calloc(blocks ? (size_t)blocks : 1, sizeof *u->results)))
    return set_error(QKEEP_E_NOMEM, "out of memory");
  return 0;
}

/* Streams every unit: reads on this thread, quantizes on all, writes as each unit ends. */
static int stream(struct quantizer *q, int threads, struct qkeep_quantize_progress *summary) {
  struct pool p = {.q = q, .first_failed = q->n_units};
  struct driver d = {.p = &p, .start = now_seconds(), .threads = threads};
  for (size_t i = 0; i < q->n_units; i++) /* two of the largest unit in flight */
    p.budget = q->units[i].bytes > p.budget ? q->units[i].bytes : p.budget;
  p.budget *= 2;
  for (size_t i = 0; i < q->ck->n_tensors; i++)
    d.bytes_total += (int64_t)q->ck->tensors[i].t->nbytes;
  d.scratch = malloc((size_t)q->scratch_elements * sizeof *d.scratch + 1);
  d.chunk = malloc(COPY_CHUNK);
  if (!d.scratch || !d.chunk || pool_start(&p, threads - 1)) {
    free(d.scratch);
    free(d.chunk);
    return set_error(QKEEP_E_NOMEM, "out of memory");
  }
  d.threads = p.started + 1;
  pthread_mutex_lock(&p.lock);
  for (size_t i = 0; i < q->n_units && p.first_failed == q->n_units; i++) {
    struct unit *u = &q->units[i];
    if (cancelled(q)) {
      note_failure(&p, 0, interrupted(q)); /* index 0: reported before any other failure */
      break;
    }
    if (u->kind == UNIT_COPY) {
      pthread_mutex_unlock(&p.lock);
      int rc = copy_unit(&d, u, u->copy_in);
      pthread_mutex_lock(&p.lock);
      if (rc)
        note_failure(&p, u->index, rc);
      else {
        p.tensors_done++;
        p.bytes_done += u->in_bytes;
        q->written += u->in_bytes;
      }
      report(&d, false, NULL);
      continue;
    }
    help_until(&d, room_for, u->bytes);
    if (p.first_failed < q->n_units)
      break;
    p.in_flight_bytes += u->bytes;
    p.peak_bytes = p.in_flight_bytes > p.peak_bytes ? p.in_flight_bytes : p.peak_bytes;
    pthread_mutex_unlock(&p.lock);
    int rc = start_unit(q, u);
    while (!rc && u->n_blocks == 0 && (rc = stage_done(q, u)) == 1) /* no rows: every stage at once */
      u->stage++;
    pthread_mutex_lock(&p.lock);
    if (rc || u->n_blocks == 0) { /* failed, or done already */
      if (rc)
        note_failure(&p, u->index, rc);
      else {
        p.tensors_done += u->n_tensors;
        p.bytes_done += u->in_bytes;
      }
      pthread_mutex_unlock(&p.lock);
      unit_release(u);
      pthread_mutex_lock(&p.lock);
      p.in_flight_bytes -= u->bytes;
      continue;
    }
    pool_append(&p, u);
  }
  help_until(&d, all_done, 0);
  report(&d, true, summary);
  pthread_mutex_unlock(&p.lock);
  pool_stop(&p);
  int rc = 0;
  if (p.first_failed < q->n_units)
    rc = set_error(p.failed_rc, "%s", p.failed_msg ? p.failed_msg : qkeep_strerror(p.failed_rc));
  free(p.failed_msg);
  free(d.scratch);
  free(d.chunk);
  return rc;
}
/* ---- config files ------------------------------------------------------------------------ */

/* A pack-quantized config group as llm-compressor's W4A16 preset writes it (actorder null, no activations).
 */
static json_t *ct_int4_group(const struct quantizer *q, bool *ok) {
  json_t *weights = json_object(), *group = json_object(), *targets = json_array();
  jset(ok, weights, "num_bits", json_integer(4));
  jset(ok, weights, "type", json_string("int"));
  jset(ok, weights, "symmetric", json_boolean(!q->opt->asym_weights));
  jset(ok, weights, "strategy", json_string("group"));
  jset(ok, weights, "group_size", json_integer(q->opt->group_size > 0 ? q->opt->group_size : 128));
  jset(ok, weights, "dynamic", json_false());
  jset(ok, weights, "actorder", json_null());
  jset(ok, weights, "observer", json_string("minmax"));
  jappend(ok, targets, json_string("Linear"));
  jset(ok, group, "format", json_string("pack-quantized"));
  jset(ok, group, "input_activations", json_null());
  jset(ok, group, "output_activations", json_null());
  jset(ok, group, "targets", targets);
  jset(ok, group, "weights", weights);
  return group;
}

static json_t *ct_group(const struct quantizer *q, bool nvfp4, bool *ok) {
  json_t *weights = json_object(), *group = json_object(), *targets = json_array();
  jset(ok, weights, "num_bits", json_integer(nvfp4 || strcmp(q->sch->name, "mxfp4") == 0 ? 4 : 8));
  jset(ok, weights, "type", json_string(strcmp(q->sch->name, "w8a8-int8") == 0 ? "int" : "float"));
  jset(ok, weights, "symmetric", json_true());
  jset(ok, weights, "dynamic", json_false());
  if (strcmp(q->sch->name, "w8a8-int8") == 0) {
    jset(ok, weights, "strategy", json_string("channel"));
    json_t *in = json_object();
    jset(ok, in, "num_bits", json_integer(8));
    jset(ok, in, "type", json_string("int"));
    jset(ok, in, "strategy", json_string(q->opt->static_input ? "tensor" : "token"));
    jset(ok, in, "dynamic", json_boolean(!q->opt->static_input));
    jset(ok, in, "symmetric", json_boolean(!q->opt->asym_input));
    jset(ok, group, "input_activations", in);
  } else {
    jset(ok, weights, "strategy", json_string(nvfp4 ? "tensor_group" : "group"));
    jset(ok, weights, "group_size", json_integer(nvfp4 ? 16 : 32));
    if (nvfp4) {
      json_t *in = json_deep_copy(weights);
      jset(ok, in, "dynamic", json_string("local"));
      jset(ok, group, "input_activations", in);
    }
  }
  jappend(ok, targets, json_string("Linear"));
  jset(ok, group, "targets", targets);
  jset(ok, group, "weights", weights);
  return group;
}

/* config.json's quantization_config for the scheme (and hf_quant_config.json for ModelOpt). */
static json_t *quantization_config(const struct quantizer *q, json_t **hf_quant, bool *ok) {
  const char *s = q->sch->name;
  json_t *qc = json_object(), *ignore = json_array();
  jappend(ok, ignore, json_string("lm_head"));
  *hf_quant = NULL;
  if (strcmp(s, "modelopt-nvfp4") == 0) {
    jset(ok, qc, "quant_method", json_string("modelopt"));
    jset(ok, qc, "quant_algo", json_string("NVFP4"));
    jset(ok, qc, "group_size", json_integer(16));
    jset(ok, qc, "ignore", json_deep_copy(ignore));
    json_t *h = json_object(), *producer = json_object(), *quant = json_object();
    jset(ok, producer, "name", json_string("modelopt"));
    jset(ok, producer, "version", json_string("qkeep-" PACKAGE_VERSION));
    jset(ok, quant, "quant_algo", json_string("NVFP4"));
    jset(ok, quant, "kv_cache_quant_algo", q->opt->kv_cache_scales ? json_string("FP8") : json_null());
    jset(ok, quant, "group_size", json_integer(16));
    jset(ok, quant, "exclude_modules", json_deep_copy(ignore));
    jset(ok, h, "producer", producer);
    jset(ok, h, "quantization", quant);
    *hf_quant = h;
  } else if (strcmp(s, "gptq-int4") == 0 || strcmp(s, "awq-int4") == 0) {
    bool awq = s[0] == 'a';
    jset(ok, qc, "quant_method", json_string(awq ? "awq" : "gptq"));
    jset(ok, qc, "bits", json_integer(4));
    jset(ok, qc, "group_size", json_integer(q->opt->group_size > 0 ? q->opt->group_size : 128));
    if (awq) {
      jset(ok, qc, "zero_point", json_boolean(q->opt->asym_weights));
      jset(ok, qc, "version", json_string("gemm"));
    } else {
      jset(ok, qc, "desc_act", json_false());
      jset(ok, qc, "sym", json_boolean(!q->opt->asym_weights));
      jset(ok, qc, "checkpoint_format", json_string("gptq"));
    }
  } else {
    bool nvfp4 = strcmp(s, "ct-nvfp4") == 0, int4 = strcmp(s, "ct-int4") == 0;
    const char *format = nvfp4                     ? "nvfp4-pack-quantized"
                         : strcmp(s, "mxfp4") == 0 ? "mxfp4-pack-quantized"
                         : int4                    ? "pack-quantized"
                                                   : "int-quantized";
    json_t *groups = json_object();
    jset(ok, groups, "group_0", int4 ? ct_int4_group(q, ok) : ct_group(q, nvfp4, ok));
    jset(ok, qc, "quantization_status", json_string("compressed"));
    jset(ok, qc, "quant_method", json_string("compressed-tensors"));
    jset(ok, qc, "format", json_string(format));
    jset(ok, qc, "config_groups", groups);
    jset(ok, qc, "ignore", json_deep_copy(ignore));
  }
  if (q->opt->kv_cache_scales && strcmp(s, "modelopt-nvfp4") != 0) {
    json_t *kv = json_object();
    jset(ok, kv, "num_bits", json_integer(8));
    jset(ok, kv, "type", json_string("float"));
    jset(ok, kv, "dynamic", json_false());
    jset(ok, qc, "kv_cache_scheme", kv);
  }
  json_decref(ignore);
  return qc;
}

/*
 * The input's config.json, read up front (so that a file that cannot be read fails before any
 * work) and under the checkpoint directory's rules (ckpt_read_config): a link out of the
 * directory is refused, never copied into the output. A config.json that is no JSON object is
 * not carried over (the output gets a config.json of its own).
 */
static int read_input_config(struct quantizer *q) {
  char *text;
  int rc = ckpt_read_config(q->ck, &text);
  if (rc || !text)
    return rc;
  json_t *config = NULL;
  int line, column, position;
  char why[160];
  rc = json_parse(text, strlen(text), 0, &config, &line, &column, &position, why);
  free(text);
  if (rc == QKEEP_E_NOMEM)
    return set_error(rc, "%s/config.json: out of memory parsing JSON", q->ck->dir);
  if (!rc && json_is_object(config))
    q->input_config = config;
  else
    json_decref(config);
  return 0;
}

/* config.json: the input's (when it has one) with quantization_config set; NULL when out of memory. */
static json_t *output_config(const struct quantizer *q, json_t **hf) {
  json_t *config = q->input_config ? json_deep_copy(q->input_config) : json_object();
  bool ok = config != NULL;
  *hf = NULL;
  if (config)
    jset(&ok, config, "quantization_config", quantization_config(q, hf, &ok));
  if (ok)
    return config;
  json_decref(config);
  json_decref(*hf);
  *hf = NULL;
  return NULL;
}

static int write_configs(struct quantizer *q) {
  char *path;
  json_t *hf = NULL;
  json_t *config = output_config(q, &hf);
  if (!config)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  int rc = 0;
  if (!(path = strfmt("%s/config.json", q->out_dir)))
    rc = set_error(QKEEP_E_NOMEM, "out of memory");
  else if (json_dump_file(config, path, JSON_INDENT(2)))
    rc = set_error(error_from_errno(errno), "%s/config.json: cannot write: %s", q->user_dir, strerror(errno));
  free(path);
  json_decref(config);
  if (!rc && hf) {
    if (!(path = strfmt("%s/hf_quant_config.json", q->out_dir)))
      rc = set_error(QKEEP_E_NOMEM, "out of memory");
    else if (json_dump_file(hf, path, JSON_INDENT(2)))
      rc = set_error(error_from_errno(errno), "%s/hf_quant_config.json: cannot write: %s", q->user_dir,
                     strerror(errno));
    free(path);
  }
  json_decref(hf);
  return rc;
}

static void unlink_fmt(const char *fmt, ...) PRINTF_LIKE(1, 2);
static void unlink_fmt(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *path = NULL;
  if (qk_vasprintf(&path, fmt, ap) >= 0) {
    unlink(path);
    free(path);
  }
  va_end(ap);
}

/* Removes what a failed quantize wrote into its own, new output directory. */
static void remove_output(const struct quantizer *q) {
  static const char *const names[] = {"config.json", "hf_quant_config.json", "model.safetensors",
                                      "model.safetensors.index.json"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    unlink_fmt("%s/%s", q->out_dir, names[i]);
  for (int s = 0; s < q->n_shards; s++) {
    if (q->tmp_paths && q->tmp_paths[s])
      unlink(q->tmp_paths[s]);
    unlink_fmt("%s/model-%05d-of-%05d.safetensors", q->out_dir, s + 1, q->n_shards);
  }
  rmdir(q->out_dir);
}

static void quantizer_free(struct quantizer *q) {
  json_decref(q->input_config);
  for (size_t i = 0; i < q->n_outs; i++)
    free(q->outs[i].name);
  free(q->outs);
  for (size_t i = 0; i < q->n_units; i++) {
    unit_release(&q->units[i]);
    for (int m = 0; m < q->units[i].n_members; m++)
      free(q->units[i].m[m].module);
  }
  free(q->units);
  for (int s = 0; s < q->n_shards; s++) {
    if (q->fds && q->fds[s] >= 0)
      close(q->fds[s]);
    if (q->tmp_paths)
      free(q->tmp_paths[s]);
    if (q->shard_labels)
      free(q->shard_labels[s]);
  }
  free(q->fds);
  free(q->tmp_paths);
  free(q->shard_labels);
}

/* The options, before anything is created: a bad value is an error, never a silent default. */
static int check_options(const struct qkeep_quantize_options *opt) {
  if (opt->group_size < 0 || opt->group_size > INT32_MAX)
    return set_error(QKEEP_E_INVAL, "qkeep_quantize: group size %lld (0 for the default, else 1 to %d)",
                     (long long)opt->group_size, INT32_MAX);
  if (!isfinite(opt->activation_amax) || opt->activation_amax < 0)
    return set_error(QKEEP_E_INVAL,
                     "qkeep_quantize: activation amax %g (0 for the default 1, else finite and > 0)",
                     (double)opt->activation_amax);
  if (opt->max_shard_bytes < 0)
    return set_error(QKEEP_E_INVAL, "qkeep_quantize: shard size %lld bytes (0: one file, else > 0)",
                     (long long)opt->max_shard_bytes);
  return 0;
}

/* Every 2-D float weight loads as a linear layer (quantized or copied); one with a zero dimension
 * would be refused at load, so it is refused here rather than written. */
static int check_input(const struct ckpt *ck) {
  for (size_t i = 0; i < ck->n_tensors; i++) {
    const struct ckpt_tensor *t = &ck->tensors[i];
    size_t len = strlen(t->t->name);
    bool weight = len > 7 && strcmp(t->t->name + len - 7, ".weight") == 0;
    if (weight && t->t->ndim == 2 && t->t->dtype >= 0 && (DT_FLOAT & (1u << t->t->dtype)) &&
        (t->t->shape[0] == 0 || t->t->shape[1] == 0))
      return set_error(QKEEP_E_FORMAT,
                       "%s: tensor '%s': shape [%lld, %lld]: a linear weight with a zero "
                       "dimension cannot be quantized (the load refuses such a layer)",
                       t->file->path, t->t->name, (long long)t->t->shape[0], (long long)t->t->shape[1]);
  }
  return 0;
}

/* ---- the output directory: parents, staging, publishing ------------------------------------- */

/* The names qkeep quantize writes; an existing output is replaced only when it holds nothing else. */
static bool output_name(const char *name) {
  static const char *const names[] = {"config.json", "hf_quant_config.json", "model.safetensors",
                                      "model.safetensors.index.json"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (strcmp(name, names[i]) == 0)
      return true;
  unsigned a, b;
  int end = 0;
  return sscanf(name, "model-%5u-of-%5u.safetensors%n", &a, &b, &end) == 2 && name[end] == '\0';
}

/* Whether out_dir exists (*exists); an existing one is an error unless it may be replaced, which
 * needs a real directory holding only files qkeep quantize writes (never a user's other files). */
static int check_existing(const char *out_dir, bool replace, bool *exists) {
  struct stat st;
  *exists = lstat(out_dir, &st) == 0;
  if (!*exists)
    return errno == ENOENT ? 0
                           : set_error(error_from_errno(errno), "%s: cannot check the output directory: %s",
                                       out_dir, strerror(errno));
  if (!replace)
    return set_error(QKEEP_E_EXISTS,
                     "%s: already exists (the output is a new directory; replacing it must "
                     "be asked for)",
                     out_dir);
  if (!S_ISDIR(st.st_mode))
    return set_error(QKEEP_E_EXISTS, "%s: exists and is not a directory: not replaced", out_dir);
  DIR *dir = opendir(out_dir);
  if (!dir)
    return set_error(error_from_errno(errno), "%s: cannot read: %s", out_dir, strerror(errno));
  int rc = 0;
  for (struct dirent *e; !rc && (e = readdir(dir));)
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0 && !output_name(e->d_name))
      rc = set_error(QKEEP_E_EXISTS, "%s: not replaced: it holds '%s', which qkeep quantize does not write",
                     out_dir, e->d_name);
  closedir(dir);
  return rc;
}

/* Removes every file of a directory that holds only files, then the directory. */
static void remove_tree(const char *path) {
  DIR *dir = opendir(path);
  if (dir) {
    for (struct dirent *e; (e = readdir(dir));)
      if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
        unlink_fmt("%s/%s", path, e->d_name);
    closedir(dir);
  }
  rmdir(path);
}

/* The parent directories of out_dir that do not exist yet are made (as mkdir -p); *made lists
 * those this call made, deepest last, so that a failed run removes them again. */
struct made_dirs {
  char **path;
  size_t n;
};

/* Forgets the list (the directories stay). */
static void remove_made_list(struct made_dirs *made) {
  for (size_t i = 0; i < made->n; i++)
    free(made->path[i]);
  free(made->path);
  made->path = NULL;
  made->n = 0;
}

static void remove_made(struct made_dirs *made) {
  while (made->n > 0) {
    rmdir(made->path[--made->n]);
    free(made->path[made->n]);
  }
  free(made->path);
  made->path = NULL;
}

static int make_parents(const char *out_dir, struct made_dirs *made) {
  char *path = xstrdup(out_dir);
  if (!path)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  int rc = 0;
  for (char *slash = strchr(path + 1, '/'); slash && !rc; slash = strchr(slash + 1, '/')) {
    *slash = '\0';
    if (mkdir(path, 0755) == 0) {
      char **grown = realloc(made->path, (made->n + 1) * sizeof *grown);
      char *copy = grown ? xstrdup(path) : NULL;
      if (grown)
        made->path = grown;
      if (!copy) {
        rmdir(path);
        rc = set_error(QKEEP_E_NOMEM, "out of memory");
      } else {
        made->path[made->n++] = copy;
      }
    } else if (errno != EEXIST) {
      rc = set_error(error_from_errno(errno), "%s: cannot create its parent directory %s: %s", out_dir, path,
                     strerror(errno));
    }
    *slash = '/';
  }
  free(path);
  return rc;
}

/* A new directory beside out_dir (".NAME.qkeep-PID-N", with the umask's mode as out_dir will
 * have) that the output is written in and then renamed from, so that out_dir never holds a partial
 * output. */
static int make_stage(const char *out_dir, char **stage) {
  const char *slash = strrchr(out_dir, '/');
  const char *base = slash ? slash + 1 : out_dir;
  for (unsigned n = 0; n < 1000; n++) {
    if (!(*stage = strfmt("%.*s.%s.qkeep-%ld-%u", (int)(base - out_dir), out_dir, base, (long)getpid(), n)))
      return set_error(QKEEP_E_NOMEM, "out of memory");
    if (mkdir(*stage, 0777) == 0)
      return 0;
    int err = errno;
    free(*stage);
    *stage = NULL;
    if (err != EEXIST)
      return set_error(error_from_errno(err), "%s: cannot create the output directory: %s", out_dir,
                       strerror(err));
  }
  return set_error(QKEEP_E_EXISTS, "%s: no free name for a directory beside it", out_dir);
}

/* Moves the whole output from stage to out_dir: a rename that refuses to replace anything, or, to
 * replace an existing output, one atomic exchange after which the old output is removed. */
static int publish(const char *stage, const char *out_dir, bool replace) {
  unsigned flags = replace ? RENAME_EXCHANGE : RENAME_NOREPLACE;
  if (renameat2(AT_FDCWD, stage, AT_FDCWD, out_dir, flags) == 0) {
    if (replace)
      remove_tree(stage); /* the old output, now under the staging name */
    return 0;
  }
  if (errno == EINVAL || errno == ENOSYS) { /* a file system without renameat2's flags */
    struct stat st;
    if (replace && lstat(out_dir, &st) == 0)
      remove_tree(out_dir); /* checked to hold only an output of ours */
    else if (!replace && lstat(out_dir, &st) == 0)
      errno = EEXIST;
    if (errno != EEXIST && rename(stage, out_dir) == 0)
      return 0;
  }
  if (errno == EEXIST || errno == ENOTEMPTY)
    return set_error(QKEEP_E_EXISTS, "%s: appeared while the output was written; not replaced", out_dir);
  return set_error(error_from_errno(errno), "%s: cannot move the output into place: %s", out_dir,
                   strerror(errno));
}

/* The output directory as named, without trailing slashes; "/" and names ending in "." refused. */
static int output_path(const char *out_dir, char **out) {
  size_t len = strlen(out_dir);
  while (len > 1 && out_dir[len - 1] == '/')
    len--;
  const char *base = out_dir + len;
  while (base > out_dir && base[-1] != '/')
    base--;
  size_t base_len = (size_t)(out_dir + len - base);
  if (len == 0 || base_len == 0 || (base_len == 1 && base[0] == '.') ||
      (base_len == 2 && base[0] == '.' && base[1] == '.'))
    return set_error(QKEEP_E_INVAL, "'%s': not a name for a new output directory", out_dir);
  *out = strfmt("%.*s", (int)len, out_dir);
  return *out ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
}

/* Reads, quantizes and writes into q->out_dir; on failure removes what it wrote there. */
static int quantize_into(struct quantizer *q, const char *in) {
  int rc = 0;
  if (q->ck->qc.method != QM_NONE)
    rc =
        set_error(QKEEP_E_INVAL, "%s: already quantized (%s); qkeep quantize needs an unquantized checkpoint",
                  in, q->ck->qc.scheme);
  if (!rc && strcmp(q->ck->dir, q->user_dir) != 0)
    rc = read_input_config(q);
  if (!rc)
    rc = plan(q);
  if (!rc)
    rc = open_shards(q);
  struct qkeep_quantize_progress *summary = OPTION(q->opt, summary);
  if (!rc)
    rc = stream(q, q->threads, summary);
  if (!rc)
    rc = finish_shards(q);
  if (!rc)
    rc = write_configs(q);
  if (!rc && cancelled(q))
    rc = interrupted(q);
  if (rc)
    remove_output(q); /* nothing half-written stays */
  return rc;
}

/* The scheme's flags and the options' group and threads, into a quantizer with ck, opt and sch set. */
static void setup_quantizer(struct quantizer *q, int threads) {
  const char *s = q->sch->name;
  q->ct = strcmp(s, "ct-nvfp4") == 0;
  q->nvfp4 = strstr(s, "nvfp4") != NULL;
  q->mxfp4 = strcmp(s, "mxfp4") == 0;
  q->int8 = strcmp(s, "w8a8-int8") == 0;
  q->ct_int4 = strcmp(s, "ct-int4") == 0;
  q->awq = strcmp(s, "awq-int4") == 0;
  q->gptq = strcmp(s, "gptq-int4") == 0 || q->awq;
  q->group = q->opt->group_size > 0 ? q->opt->group_size : 128;
  q->scratch_elements = 1;
  q->threads = threads;
}

/* The options' scheme and thread count, checked: a scheme qkeep quantize writes, threads >= 0 (0: every
 * online core). */
static int check_scheme_threads(const struct qkeep_quantize_options *opt, const struct scheme **sch,
                                int *threads) {
  *sch = scheme_by_name(opt->scheme);
  if (!*sch || *sch == &scheme_unquantized)
    return set_error(
        QKEEP_E_UNSUPPORTED,
        "scheme '%s': qkeep quantize writes modelopt-nvfp4, ct-nvfp4, mxfp4, w8a8-int8, gptq-int4, "
        "awq-int4 and ct-int4",
        opt->scheme);
  *threads = OPTION(opt, threads);
  if (*threads < 0)
    return set_error(QKEEP_E_INVAL, "qkeep_quantize: %d threads", *threads);
  if (*threads == 0) {
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    *threads = online > 0 ? (int)(online < 1024 ? online : 1024) : 1;
  }
  return 0;
}

int quant_options_check(const struct qkeep_quantize_options *opts) {
  const struct scheme *sch;
  int threads, rc = check_options(opts);
  return rc ? rc : check_scheme_threads(opts, &sch, &threads);
}

int qkeep_quantize(const char *in, const char *out_dir, const struct qkeep_quantize_options *opt) {
  if (!in || !out_dir || !opt || !opt->scheme)
    return set_error(QKEEP_E_INVAL, "qkeep_quantize: NULL argument");
  int rc = check_options(opt);
  if (rc)
    return rc;
  const struct scheme *sch;
  int threads;
  if ((rc = check_scheme_threads(opt, &sch, &threads)))
    return rc;
  bool replace = OPTION(opt, replace_existing), exists = false;
  char *user_dir = NULL, *stage = NULL;
  struct made_dirs made = {0};
  struct ckpt *ck = NULL;
  rc = output_path(out_dir, &user_dir);
  if (!rc)
    rc = check_existing(user_dir, replace, &exists);
  if (!rc)
    rc = make_parents(user_dir, &made);
  if (!rc)
    rc = make_stage(user_dir, &stage);
  if (!rc)
    rc = ckpt_open(in, &ck);
  if (!rc)
    rc = check_input(ck);
  if (!rc) {
    struct quantizer q = {.ck = ck, .opt = opt, .sch = sch, .out_dir = stage, .user_dir = user_dir};
    setup_quantizer(&q, threads);
    rc = quantize_into(&q, in);
    quantizer_free(&q);
  }
  if (!rc)
    rc = publish(stage, user_dir, exists);
  if (rc && stage)
    remove_tree(stage);
  if (rc)
    remove_made(&made);
  else
    remove_made_list(&made);
  ckpt_close(ck);
  free(stage);
  free(user_dir);
  return rc;
}

/* ---- the plan kept for loads that quantize (quantize/plan.h) ------------------------------------ */

struct quant_plan {
  struct quantizer q; /* q.ck is NULL once planned: nothing points into the checkpoint */
  struct qkeep_quantize_options opts;
  char *scheme;
  size_t *units; /* the quantized units' indices in q.units */
  size_t n_units;
  char **inputs;    /* per output: the input's name (owned), or NULL */
  size_t *out_unit; /* per output: its unit in units[], or SIZE_MAX */
  int *out_member, *out_slot;
  char **member_inputs; /* the members' input names (owned), for their `input` */
  size_t n_member_inputs;
  char *config_json, *hf_json;
};

void quant_plan_free(struct quant_plan *p) {
  if (!p)
    return;
  for (size_t i = 0; i < p->q.n_outs && p->inputs; i++)
    free(p->inputs[i]);
  for (size_t i = 0; i < p->n_member_inputs; i++)
    free(p->member_inputs[i]);
  quantizer_free(&p->q);
  free(p->inputs), free(p->out_unit), free(p->out_member), free(p->out_slot), free(p->member_inputs);
  free(p->units), free(p->scheme), free(p->config_json), free(p->hf_json);
  free(p);
}

/* What outlives the checkpoint: names copied, pointers into it dropped, the config texts made. */
static int plan_detach(struct quant_plan *p) {
  struct quantizer *q = &p->q;
  size_t n = q->n_outs ? q->n_outs : 1, members = 0;
  p->inputs = calloc(n, sizeof *p->inputs);
  p->out_unit = malloc(n * sizeof *p->out_unit);
  p->out_member = calloc(n, sizeof *p->out_member);
  p->out_slot = calloc(n, sizeof *p->out_slot);
  p->units = malloc((q->n_units ? q->n_units : 1) * sizeof *p->units);
  p->member_inputs = calloc((q->n_units ? q->n_units : 1) * MAX_MEMBERS, sizeof *p->member_inputs);
  if (!p->inputs || !p->out_unit || !p->out_member || !p->out_slot || !p->units || !p->member_inputs)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < q->n_outs; i++) {
    p->out_unit[i] = SIZE_MAX;
    if (q->outs[i].from && !(p->inputs[i] = xstrdup(q->outs[i].from->t->name)))
      return set_error(QKEEP_E_NOMEM, "out of memory");
    q->outs[i].from = NULL;
  }
  for (size_t u = 0; u < q->n_units; u++) {
    struct unit *x = &q->units[u];
    if (x->kind != UNIT_QUANT)
      continue;
    for (int m = 0; m < x->n_members; m++) {
      struct member *mb = &x->m[m];
      if (!(p->member_inputs[members] = xstrdup(mb->input)))
        return set_error(QKEEP_E_NOMEM, "out of memory");
      mb->input = p->member_inputs[members++];
      p->n_member_inputs = members;
      mb->in = NULL;
      for (int o = 0; o < mb->n_out; o++)
        p->out_unit[mb->out[o]] = p->n_units, p->out_member[mb->out[o]] = m, p->out_slot[mb->out[o]] = o;
    }
    p->units[p->n_units++] = u;
  }
  json_t *hf = NULL, *config = output_config(q, &hf);
  if (config)
    p->config_json = json_dumps_watched(config, JSON_INDENT(2));
  if (hf)
    p->hf_json = json_dumps_watched(hf, JSON_INDENT(2));
  json_decref(config);
  json_decref(hf);
  q->ck = NULL;
  return p->config_json && (!hf || p->hf_json) ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
}

int quant_plan_new(const struct ckpt *ck, const struct qkeep_quantize_options *opts,
                   struct quant_plan **out) {
  *out = NULL;
  if (!ck || !opts || !opts->scheme)
    return set_error(QKEEP_E_INVAL, "quantize on load: NULL argument or no scheme");
  int rc = check_options(opts);
  const struct scheme *sch = NULL;
  int threads = 1;
  if (!rc)
    rc = check_scheme_threads(opts, &sch, &threads);
  if (!rc && ck->qc.method != QM_NONE)
    rc = set_error(QKEEP_E_INVAL,
                   "%s: already quantized (%s); quantizing on load needs an unquantized checkpoint", ck->path,
                   ck->qc.scheme);
  if (!rc)
    rc = check_input(ck);
  if (rc)
    return rc;
  struct quant_plan *p = calloc(1, sizeof *p);
  if (!p)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  /* The options the plan reads, copied: callbacks and out_dir-only fields are not kept. */
  copy_sized(&p->opts, opts, opts->size ? opts->size : sizeof p->opts);
  p->opts.size = sizeof p->opts;
  p->opts.progress = NULL, p->opts.progress_user = NULL, p->opts.summary = NULL;
  p->opts.cancel = NULL, p->opts.cancel_user = NULL;
  p->opts.threads = threads;
  if (!(p->scheme = xstrdup(opts->scheme))) {
    free(p);
    return set_error(QKEEP_E_NOMEM, "out of memory");
  }
  p->opts.scheme = p->scheme;
  p->q = (struct quantizer){.ck = ck, .opt = &p->opts, .sch = sch, .out_dir = ck->path, .user_dir = ck->path};
  setup_quantizer(&p->q, threads);
  rc = read_input_config(&p->q);
  if (!rc)
    rc = plan(&p->q);
  if (!rc)
    rc = plan_detach(p);
  if (rc) {
    quant_plan_free(p);
    return rc;
  }
  *out = p;
  return 0;
}

size_t quant_plan_outputs(const struct quant_plan *p) { return p->q.n_outs; }

void quant_plan_output(const struct quant_plan *p, size_t index, struct quant_output *out) {
  const struct out_tensor *o = &p->q.outs[index];
  *out = (struct quant_output){
      o->name,     o->spec,  o->nbytes,          p->inputs[index],     o->copied,
      o->constant, o->value, p->out_unit[index], p->out_member[index], p->out_slot[index]};
}

size_t quant_plan_units(const struct quant_plan *p) { return p->n_units; }

int quant_plan_members(const struct quant_plan *p, size_t unit) {
  return p->q.units[p->units[unit]].n_members;
}

void quant_plan_member(const struct quant_plan *p, size_t unit, int member, struct quant_member *out) {
  const struct member *m = &p->q.units[p->units[unit]].m[member];
  size_t elements = (size_t)(m->n * m->k);
  *out = (struct quant_member){m->input,
                               (enum qkeep_dtype)m->dtype,
                               m->n,
                               m->k,
                               elements * qkeep_dtype_size((enum qkeep_dtype)m->dtype),
                               m->n_out,
                               {0}};
  memcpy(out->out, m->out, sizeof out->out);
}

int quant_plan_configs(const struct quant_plan *p, char **config_json, char **hf_quant_json) {
  *config_json = xstrdup(p->config_json);
  *hf_quant_json = p->hf_json ? xstrdup(p->hf_json) : NULL;
  if (*config_json && (!p->hf_json || *hf_quant_json))
    return 0;
  free(*config_json);
  free(*hf_quant_json);
  *config_json = *hf_quant_json = NULL;
  return set_error(QKEEP_E_NOMEM, "out of memory");
}

int quant_plan_threads(const struct quant_plan *p) { return p->q.threads; }

/* ---- a load's pool (quantize/plan.h) ------------------------------------------------------------ */

struct quant_pool {
  const struct quant_plan *plan;
  struct pool p;  /* p.q: the plan's quantizer, which a load's units never change (no file: no write) */
  float *scratch; /* the waiting thread's */
};

int quant_pool_new(const struct quant_plan *plan, struct quant_pool **out) {
  *out = NULL;
  struct quant_pool *qp = calloc(1, sizeof *qp);
  if (qp)
    qp->scratch = malloc((size_t)plan->q.scratch_elements * sizeof *qp->scratch + 1);
  if (!qp || !qp->scratch) {
    free(qp);
    return set_error(QKEEP_E_NOMEM, "out of memory");
  }
  qp->plan = plan;
  qp->p = (struct pool){.q = (struct quantizer *)&plan->q, .first_failed = SIZE_MAX};
  int rc = pool_start(&qp->p, plan->q.threads - 1);
  if (rc) {
    free(qp->scratch);
    free(qp);
    return rc;
  }
  *out = qp;
  return 0;
}

void quant_pool_free(struct quant_pool *qp) {
  if (!qp)
    return;
  pool_stop(&qp->p);
  free(qp->scratch);
  free(qp);
}

/* The temporaries and results of a job's unit (not the caller's src and dst). */
static void job_free(struct quant_job *job) {
  struct unit *u = &job->u;
  for (int i = 0; i < u->n_members; i++)
    free(u->m[i].tmp[0]), free(u->m[i].tmp[1]);
  if (u->results)
    for (int64_t b = 0; b < u->n_blocks; b++)
      free(u->results[b].finite_msg), free(u->results[b].other_msg);
  free(u->results);
  free(job->msg);
  free(job);
}

/* The job's unit set up as start_unit sets up the offline quantizer's: the caller's bytes in, its
 * buffers out (zeroed: AWQ's repack ORs nibbles into its words), the temporaries, the blocks. */
static int job_prepare(const struct quantizer *q, struct quant_job *job, const void *const *src,
                       void *const (*dst)[4]) {
  struct unit *u = &job->u;
  int64_t blocks = 0;
  for (int i = 0; i < u->n_members; i++) {
    struct member *m = &u->m[i];
    m->raw = (void *)src[i];
    m->tmp[0] = m->tmp[1] = NULL;
  }
  for (int i = 0; i < u->n_members; i++) {
    struct member *m = &u->m[i];
    for (int o = 0; o < m->n_out; o++) {
      m->buf[o] = q->outs[m->out[o]].constant ? NULL : dst[i][o];
      if (m->buf[o])
        memset(m->buf[o], 0, q->outs[m->out[o]].nbytes);
    }
    size_t groups = q->group ? (size_t)(m->k / q->group) : 0;
    if (q->awq && (!(m->tmp[0] = calloc((size_t)(m->n * m->k / 2) + 1, 1)) ||
                   !(m->tmp[1] = calloc(groups * (size_t)m->n / 2 + 1, 1))))
      return set_error(QKEEP_E_NOMEM, "out of memory");
    if (q->ct_int4 && !(m->tmp[0] = malloc(groups * (size_t)m->n * sizeof(float) + 1)))
      return set_error(QKEEP_E_NOMEM, "out of memory");
    m->first_block = blocks;
    m->n_blocks = m->n > 0 ? (m->n + m->block_rows - 1) / m->block_rows : 0;
    blocks += m->n_blocks;
  }
  u->n_stages = q->nvfp4 ? 2 : 1;
  u->stage = 0;
  u->n_blocks = blocks;
  u->next_block = 0;
  u->blocks_left = blocks;
  u->job = job;
  if (!(u->results = calloc(blocks ? (size_t)blocks : 1, sizeof *u->results)))
    return set_error(QKEEP_E_NOMEM, "out of memory");
  return 0;
}

int quant_pool_start(struct quant_pool *qp, size_t unit, const void *const *src, void *const (*dst)[4],
                     struct quant_job **out) {
  const struct quantizer *q = &qp->plan->q;
  struct quant_job *job = calloc(1, sizeof *job);
  *out = NULL;
  if (!job)
    return set_error(QKEEP_E_NOMEM, "out of memory");
  job->u = q->units[qp->plan->units[unit]]; /* a copy: the plan is not changed by a run */
  job->u.results = NULL;
  int rc = job_prepare(q, job, src, dst);
  while (!rc && job->u.n_blocks == 0 && (rc = stage_done(qp->p.q, &job->u)) == 1) /* no rows */
    job->u.stage++;
  if (rc || job->u.n_blocks == 0) { /* failed, or done already */
    job->done = true;
    job->rc = rc;
    job->msg = rc ? xstrdup(qkeep_errmsg()) : NULL;
    *out = job;
    return 0;
  }
  pthread_mutex_lock(&qp->p.lock);
  pool_append(&qp->p, &job->u);
  pthread_mutex_unlock(&qp->p.lock);
  *out = job;
  return 0;
}

/* Waits (working on blocks) until the job has ended. */
static void job_wait(struct quant_pool *qp, struct quant_job *job) {
  struct pool *p = &qp->p;
  pthread_mutex_lock(&p->lock);
  while (!job->done) {
    struct unit *u;
    int stage;
    int64_t b;
    if (take_block(p, &u, &stage, &b))
      work_one(p, u, stage, b, qp->scratch);
    else
      pthread_cond_wait(&p->wake, &p->lock);
  }
  pthread_mutex_unlock(&p->lock);
}

int quant_pool_wait(struct quant_pool *qp, struct quant_job *job) {
  if (!job)
    return 0;
  job_wait(qp, job);
  int rc = job->rc;
  if (rc)
    set_error(rc, "%s", job->msg ? job->msg : qkeep_strerror(rc));
  job_free(job);
  return rc;
}

void quant_pool_discard(struct quant_pool *qp, struct quant_job *job) {
  if (!job)
    return;
  job_wait(qp, job);
  job_free(job);
}

int quant_plan_run(const struct quant_plan *p, size_t unit, const void *const *src, void *const (*dst)[4]) {
  struct quant_pool *qp;
  struct quant_job *job = NULL;
  int rc = quant_pool_new(p, &qp);
  if (!rc && !(rc = quant_pool_start(qp, unit, src, dst, &job)))
    rc = quant_pool_wait(qp, job);
  quant_pool_free(qp);
  return rc;
}

const char *quant_plan_device_scheme(const struct quant_plan *p) {
  return p->q.nvfp4 || p->q.mxfp4 ? p->scheme : NULL;
}

int quant_plan_finish(const struct quant_plan *p, size_t unit, float amax, void *const (*dst)[4]) {
  const struct quantizer *q = &p->q;
  const struct unit *u = &q->units[p->units[unit]];
  assert(q->nvfp4 || q->mxfp4);
  if (!q->nvfp4)
    return 0;
  float global; /* as stage_done: the group's amax, then each member's copy of its global scale */
  int rc = quant_nvfp4_global(amax, q->ct, &global);
  if (rc)
    return add_error_context(rc, "quantizing '%s'", u->m[0].input);
  for (int i = 0; i < u->n_members; i++)
    memcpy(dst[i][2], &global, sizeof global);
  return 0;
}
