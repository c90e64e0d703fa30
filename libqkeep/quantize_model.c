/*
 * quantize_model.c: `qkeep quantize`. Reads an unquantized checkpoint (a
 * .safetensors file or a Hugging Face directory) and writes a checkpoint
 * directory in one scheme's real tensor names and config files, so that
 * qkeep, vLLM and the original tools read it the same way. The numerics are
 * libqkeep/quantize.c's; this file decides what is quantized, groups fused
 * shards so they share one global scale (as ModelOpt does), and writes.
 *
 * Linear layers are the 2-D float `weight`s of modules other than
 * embeddings, the lm_head (left unquantized, as exporters do by default) and
 * MoE routers (`mlp.gate`). Everything else is copied unchanged.
 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "quant.h"
#include "scheme.h"

/* The output being written: shards of at most max_shard_bytes. */
struct output {
  const char *dir;
  int64_t max_shard_bytes;
  struct st_writer *w;
  int64_t shard_bytes;
  int n_shards;
  json_t *weight_map; /* tensor -> temporary shard number */
};

static int out_flush(struct output *o) {
  if (!o->w || !o->shard_bytes)
    return 0;
  char path[4096];
  snprintf(path, sizeof path, "%s/shard-%05d.tmp", o->dir, o->n_shards);
  int rc = st_writer_write(o->w, path);
  st_writer_free(o->w);
  o->w = NULL;
  o->shard_bytes = 0;
  o->n_shards++;
  return rc;
}

/* Adds one output tensor, starting a new shard when this one would overflow. */
static int out_add(struct output *o, const char *name, const struct qkeep_spec *spec, const void *data) {
  int64_t bytes = (int64_t)qkeep_spec_bytes(spec);
  int rc = 0;
  if (o->w && o->max_shard_bytes > 0 && o->shard_bytes > 0 && o->shard_bytes + bytes > o->max_shard_bytes)
    rc = out_flush(o);
  if (!rc && !o->w)
    rc = st_writer_new(&o->w);
  if (!rc)
    rc = st_writer_add(o->w, name, spec, data);
  if (!rc) {
    o->shard_bytes += bytes;
    json_object_set_new(o->weight_map, name, json_integer(o->n_shards));
  }
  return rc;
}

/* Renames the temporary shards to their final names and writes the index when sharded. */
static int out_finish(struct output *o) {
  int rc = out_flush(o);
  char from[4096], to[4096];
  for (int s = 0; s < o->n_shards && !rc; s++) {
    snprintf(from, sizeof from, "%s/shard-%05d.tmp", o->dir, s);
    if (o->n_shards == 1)
      snprintf(to, sizeof to, "%s/model.safetensors", o->dir);
    else
      snprintf(to, sizeof to, "%s/model-%05d-of-%05d.safetensors", o->dir, s + 1, o->n_shards);
    if (rename(from, to) != 0)
      rc = set_error(QKEEP_E_IO, "%s: cannot rename to %s: %s", from, to, strerror(errno));
  }
  if (rc || o->n_shards < 2)
    return rc;
  json_t *index = json_object(), *map = json_object(), *meta = json_object();
  const char *key;
  json_t *value;
  json_object_foreach(o->weight_map, key, value) {
    char shard[64];
    snprintf(shard, sizeof shard, "model-%05d-of-%05d.safetensors", (int)json_integer_value(value) + 1,
             o->n_shards);
    json_object_set_new(map, key, json_string(shard));
  }
  json_object_set_new(meta, "format", json_string("pt"));
  json_object_set_new(index, "metadata", meta);
  json_object_set_new(index, "weight_map", map);
  snprintf(to, sizeof to, "%s/model.safetensors.index.json", o->dir);
  if (json_dump_file(index, to, JSON_INDENT(2) | JSON_SORT_KEYS) != 0)
    rc = set_error(QKEEP_E_IO, "%s: cannot write", to);
  json_decref(index);
  return rc;
}

/* ---- reading the input ------------------------------------------------------------ */

/* A tensor of the input as f32 (malloc'd). */
static int read_f32(const struct ckpt *ck, const struct ckpt_tensor *t, float **out) {
  size_t n = (size_t)(t->t->nbytes / qkeep_dtype_size((enum qkeep_dtype)t->t->dtype));
  void *raw = malloc(t->t->nbytes ? t->t->nbytes : 1);
  float *f = malloc(n ? n * sizeof *f : 1);
  int rc =
      raw && f ? ckpt_read(ck, t, raw) : set_error(QKEEP_E_NOMEM, "out of memory reading %s", t->t->name);
  for (size_t i = 0; !rc && i < n; i++)
    f[i] = qk_load_float(raw, t->t->dtype, i);
  free(raw);
  if (rc) {
    free(f);
    return rc;
  }
  *out = f;
  return 0;
}

static const char *last_component(const char *s) {
  const char *dot = strrchr(s, '.');
  return dot ? dot + 1 : s;
}

/* Whether the tensor is the weight of a linear layer that the scheme quantizes. */
static bool quantizable(const struct ckpt_tensor *t) {
  const char *name = t->t->name;
  size_t len = strlen(name);
  if (len < 7 || strcmp(name + len - 7, ".weight") != 0 || t->t->ndim != 2 || t->t->dtype < 0 ||
      !(DT_FLOAT & (1u << t->t->dtype)))
    return false;
  char module[512];
  snprintf(module, sizeof module, "%.*s", (int)(len - 7), name);
  const char *last = last_component(module);
  return !strstr(last, "embed") && strcmp(last, "lm_head") != 0 && strcmp(last, "gate") != 0 &&
         strcmp(last, "router") != 0 && strcmp(last, "wte") != 0;
}

/*
 * Modules whose weights share one NVFP4 global scale: fused shards under one
 * parent (q/k/v, gate/up), and each expert's gate/up. `group` gets the weight
 * tensor names of the group containing `name`, in order; returns the count.
 */
static int fusion_group(const struct ckpt *ck, const char *name, const char *group[8]) {
  static const char *const rules[][4] = {
      {"q_proj", "k_proj", "v_proj", NULL}, {"gate_proj", "up_proj", NULL}, {"w1", "w3", NULL}};
  char module[512], parent[512], member[512];
  snprintf(module, sizeof module, "%.*s", (int)(strlen(name) - 7), name);
  snprintf(member, sizeof member, "%s", last_component(module));
  snprintf(parent, sizeof parent, "%.*s", (int)(strlen(module) - strlen(member) - 1), module);
  for (size_t r = 0; r < sizeof rules / sizeof rules[0]; r++) {
    int n = 0, mine = -1;
    for (int m = 0; m < 4 && rules[r][m]; m++) {
      char candidate[700];
      snprintf(candidate, sizeof candidate, "%s.%s.weight", parent, rules[r][m]);
      const struct ckpt_tensor *t = ckpt_find(ck, candidate);
      if (!t)
        break;
      if (strcmp(rules[r][m], member) == 0)
        mine = n;
      group[n++] = t->t->name;
    }
    if (mine >= 0 && n >= 2 && (n == 4 || rules[r][n] == NULL))
      return n;
  }
  group[0] = name;
  return 1;
}

/* ---- per-scheme writers --------------------------------------------------------------- */

struct quantizer {
  const struct ckpt *ck;
  const struct qkeep_quantize_options *opt;
  const struct scheme *sch;
  struct output out;
};

static char *tensor_name(char *buf, size_t len, const char *module, const char *local) {
  snprintf(buf, len, "%s.%s", module, local);
  return buf;
}

/* Writes an f32 scalar as [] (ModelOpt) or [1] (compressed-tensors). */
static int add_scalar(struct quantizer *q, const char *module, const char *local, float value, bool rank1) {
  char name[600];
  struct qkeep_spec s = {.dtype = QKEEP_DTYPE_F32, .ndim = rank1 ? 1 : 0, .shape = {1}};
  return out_add(&q->out, tensor_name(name, sizeof name, module, local), &s, &value);
}

/*
 * NVFP4: the group's weights are quantized as one [sum N, K] matrix so that
 * they share the global scale; then each shard's rows are written under its
 * own name. Static input scales come from the configured activation amax.
 */
static int write_nvfp4(struct quantizer *q, const char *const *group, int n_group, int mine, int64_t k) {
  bool ct = strcmp(q->sch->name, "ct-nvfp4") == 0;
  int64_t rows = 0, before = 0, n_mine = 0;
  float *w = NULL;
  int rc = 0;
  for (int g = 0; g < n_group && !rc; g++) {
    const struct ckpt_tensor *t = ckpt_find(q->ck, group[g]);
    float *part;
    if (t->t->shape[1] != k)
      return set_error(QKEEP_E_FORMAT, "tensor '%s': K %lld differs from its fused sibling's %lld",
                       t->t->name, (long long)t->t->shape[1], (long long)k);
    rc = read_f32(q->ck, t, &part);
    if (rc)
      break;
    float *grown = realloc(w, (size_t)((rows + t->t->shape[0]) * k) * sizeof *w);
    if (!grown) {
      free(part);
      rc = set_error(QKEEP_E_NOMEM, "out of memory");
      break;
    }
    w = grown;
    memcpy(w + rows * k, part, (size_t)(t->t->shape[0] * k) * sizeof *w);
    free(part);
    if (g == mine) {
      before = rows;
      n_mine = t->t->shape[0];
    }
    rows += t->t->shape[0];
  }
  uint8_t *packed = rc ? NULL : malloc((size_t)(rows * k / 2));
  uint8_t *scales = rc ? NULL : malloc((size_t)(rows * k / 16));
  float global = 0;
  if (!rc && (!packed || !scales))
    rc = set_error(QKEEP_E_NOMEM, "out of memory");
  if (!rc && (rc = quant_nvfp4(w, rows, k, ct, packed, scales, &global)))
    add_error_context(rc, "tensor '%s'", group[mine]);
  char module[512], name[600];
  snprintf(module, sizeof module, "%.*s", (int)(strlen(group[mine]) - 7), group[mine]);
  struct qkeep_spec ws = {QKEEP_DTYPE_U8, 2, {n_mine, k / 2}},
                    ss = {QKEEP_DTYPE_F8_E4M3, 2, {n_mine, k / 16}};
  if (!rc)
    rc = out_add(&q->out, tensor_name(name, sizeof name, module, ct ? "weight_packed" : "weight"), &ws,
                 packed + before * k / 2);
  if (!rc)
    rc = out_add(&q->out, tensor_name(name, sizeof name, module, "weight_scale"), &ss,
                 scales + before * k / 16);
  float act = q->opt->activation_amax > 0 ? q->opt->activation_amax : 1.0f;
  if (!rc)
    rc = add_scalar(q, module, ct ? "weight_global_scale" : "weight_scale_2", global, ct);
  if (!rc)
    rc = add_scalar(q, module, ct ? "input_global_scale" : "input_scale", ct ? 2688.0f / act : act / 2688.0f,
                    ct);
  free(w);
  free(packed);
  free(scales);
  return rc;
}

static int write_mxfp4(struct quantizer *q, const char *module, const float *w, int64_t n, int64_t k) {
  uint8_t *packed = malloc((size_t)(n * k / 2)), *scales = malloc((size_t)(n * k / 32));
  char name[600];
  int rc =
      packed && scales ? quant_mxfp4(w, n, k, packed, scales) : set_error(QKEEP_E_NOMEM, "out of memory");
  struct qkeep_spec ws = {QKEEP_DTYPE_U8, 2, {n, k / 2}}, ss = {QKEEP_DTYPE_U8, 2, {n, k / 32}};
  if (!rc)
    rc = out_add(&q->out, tensor_name(name, sizeof name, module, "weight_packed"), &ws, packed);
  if (!rc)
    rc = out_add(&q->out, tensor_name(name, sizeof name, module, "weight_scale"), &ss, scales);
  free(packed);
  free(scales);
  return rc;
}

static int write_int8(struct quantizer *q, const char *module, const float *w, int64_t n, int64_t k) {
  int8_t *qw = malloc((size_t)(n * k));
  float *scales = malloc((size_t)n * sizeof *scales);
  char name[600];
  int rc = qw && scales ? quant_int8_channel(w, n, k, qw, scales) : set_error(QKEEP_E_NOMEM, "out of memory");
  struct qkeep_spec ws = {QKEEP_DTYPE_I8, 2, {n, k}}, ss = {QKEEP_DTYPE_F32, 2, {n, 1}};
  if (!rc)
    rc = out_add(&q->out, tensor_name(name, sizeof name, module, "weight"), &ws, qw);
  if (!rc)
    rc = out_add(&q->out, tensor_name(name, sizeof name, module, "weight_scale"), &ss, scales);
  if (!rc && q->opt->static_input) {
    float act = q->opt->activation_amax > 0 ? q->opt->activation_amax : 1.0f;
    rc = add_scalar(q, module, "input_scale", q->opt->asym_input ? 2.0f * act / 255.0f : act / 127.0f, true);
    if (!rc && q->opt->asym_input) {
      int32_t zp = 0; /* a symmetric range [-act, act] in the asymmetric form */
      struct qkeep_spec zs = {QKEEP_DTYPE_I32, 1, {1}};
      rc = out_add(&q->out, tensor_name(name, sizeof name, module, "input_zero_point"), &zs, &zp);
    }
  }
  free(qw);
  free(scales);
  return rc;
}

/* GPTQ int4, written as GPTQ (v1) or repacked into AWQ's GEMM layout. */
static int write_int4(struct quantizer *q, const char *module, const float *w, int64_t n, int64_t k) {
  bool awq = strcmp(q->sch->name, "awq-int4") == 0, sym = !q->opt->asym_weights;
  int64_t g = q->opt->group_size > 0 ? q->opt->group_size : 128;
  if (g > k) /* one group size serves the whole checkpoint (config.json says it once) */
    return set_error(QKEEP_E_INVAL,
                     "module %s: K = %lld is smaller than the group size %lld; pass --group %lld or less",
                     module, (long long)k, (long long)g, (long long)k);
  if (k % g)
    return set_error(QKEEP_E_INVAL, "module %s: group size %lld does not divide K = %lld", module,
                     (long long)g, (long long)k);
  int32_t *qweight = malloc((size_t)(k / 8 * n) * 4), *qzeros = malloc((size_t)(k / g * n / 8) * 4);
  int32_t *g_idx = malloc((size_t)k * 4), *awq_w = NULL, *awq_z = NULL;
  uint16_t *scales = malloc((size_t)(k / g * n) * 2);
  char name[600];
  int rc = qweight && qzeros && g_idx && scales
               ? quant_gptq_int4(w, n, k, g, sym, qweight, scales, qzeros, g_idx)
               : set_error(QKEEP_E_NOMEM, "out of memory");
  if (rc)
    add_error_context(rc, "module %s", module);
  struct qkeep_spec sc = {QKEEP_DTYPE_F16, 2, {k / g, n}};
  if (!rc && awq) {
    /* AWQ: qweight [K, N/8] and qzeros [K/G, N/8], columns in AWQ's nibble order, zeros as they are. */
    awq_w = calloc((size_t)(k * n / 8), 4);
    awq_z = calloc((size_t)(k / g * n / 8), 4);
    if (!awq_w || !awq_z)
      rc = set_error(QKEEP_E_NOMEM, "out of memory");
    for (int64_t kk = 0; !rc && kk < k; kk++)
      for (int64_t c = 0; c < n; c++) {
        uint32_t v = (uint32_t)qk_nibble(qweight[(kk / 8) * n + c], (int)(kk % 8));
        awq_w[kk * (n / 8) + c / 8] |= (int32_t)(v << (4 * qkeep_awq_nibble(c % 8)));
      }
    for (int64_t gr = 0; !rc && gr < k / g; gr++)
      for (int64_t c = 0; c < n; c++) {
        uint32_t z = (uint32_t)(sym ? 8 : qk_gptq_zero(qzeros, n, gr, c, 0));
        awq_z[gr * (n / 8) + c / 8] |= (int32_t)((z & 0xf) << (4 * qkeep_awq_nibble(c % 8)));
      }
    struct qkeep_spec qs = {QKEEP_DTYPE_I32, 2, {k, n / 8}}, zs = {QKEEP_DTYPE_I32, 2, {k / g, n / 8}};
    if (!rc)
      rc = out_add(&q->out, tensor_name(name, sizeof name, module, "qweight"), &qs, awq_w);
    if (!rc)
      rc = out_add(&q->out, tensor_name(name, sizeof name, module, "qzeros"), &zs, awq_z);
  } else if (!rc) {
    struct qkeep_spec qs = {QKEEP_DTYPE_I32, 2, {k / 8, n}}, zs = {QKEEP_DTYPE_I32, 2, {k / g, n / 8}},
                      gs = {QKEEP_DTYPE_I32, 1, {k}};
    rc = out_add(&q->out, tensor_name(name, sizeof name, module, "qweight"), &qs, qweight);
    if (!rc)
      rc = out_add(&q->out, tensor_name(name, sizeof name, module, "qzeros"), &zs, qzeros);
    if (!rc)
      rc = out_add(&q->out, tensor_name(name, sizeof name, module, "g_idx"), &gs, g_idx);
  }
  if (!rc)
    rc = out_add(&q->out, tensor_name(name, sizeof name, module, "scales"), &sc, scales);
  free(qweight);
  free(qzeros);
  free(g_idx);
  free(scales);
  free(awq_w);
  free(awq_z);
  return rc;
}

/*
 * compressed-tensors pack-quantized int4: weight_packed, weight_scale in the model's dtype (as
 * compressed-tensors creates scales: the source weight's dtype), weight_shape, and
 * weight_zero_point when asymmetric.
 */
static int write_ct_int4(struct quantizer *q, const char *module, const float *w, int64_t n, int64_t k,
                         enum qkeep_dtype model_dtype) {
  bool sym = !q->opt->asym_weights;
  int64_t g = q->opt->group_size > 0 ? q->opt->group_size : 128;
  if (g > k || k % g)
    return set_error(QKEEP_E_INVAL, "module %s: group size %lld does not divide K = %lld (pass --group)",
                     module, (long long)g, (long long)k);
  int64_t groups = k / g;
  int32_t *packed = malloc((size_t)(n * k / 8) * 4 + 1),
          *zeros = sym ? NULL : malloc((size_t)(n / 8 * groups) * 4 + 1);
  float *scales = malloc((size_t)(n * groups) * sizeof *scales + 1);
  uint16_t *half = model_dtype == QKEEP_DTYPE_F32 ? NULL : malloc((size_t)(n * groups) * 2 + 1);
  char name[600];
  int rc = packed && scales && (sym || zeros) && (model_dtype == QKEEP_DTYPE_F32 || half)
               ? quant_ct_int4(w, n, k, g, sym, packed, scales, zeros)
               : set_error(QKEEP_E_NOMEM, "out of memory");
  for (int64_t i = 0; !rc && half && i < n * groups; i++) {
    half[i] = model_dtype == QKEEP_DTYPE_F16 ? qk_f32_to_f16(scales[i]) : qk_f32_to_bf16(scales[i]);
    if (model_dtype == QKEEP_DTYPE_F16 && isinf(qk_f16_to_f32(half[i])))
      rc = set_error(QKEEP_E_INVAL, "module %s: scale %g overflows float16", module, (double)scales[i]);
  }
  int64_t shape[2] = {n, k};
  struct qkeep_spec ps = {QKEEP_DTYPE_I32, 2, {n, k / 8}}, ss = {model_dtype, 2, {n, groups}},
                    shs = {QKEEP_DTYPE_I64, 1, {2}}, zs = {QKEEP_DTYPE_I32, 2, {n / 8, groups}};
  if (!rc)
    rc = out_add(&q->out, tensor_name(name, sizeof name, module, "weight_packed"), &ps, packed);
  if (!rc)
    rc = out_add(&q->out, tensor_name(name, sizeof name, module, "weight_scale"), &ss,
                 half ? (const void *)half : scales);
  if (!rc)
    rc = out_add(&q->out, tensor_name(name, sizeof name, module, "weight_shape"), &shs, shape);
  if (!rc && !sym)
    rc = out_add(&q->out, tensor_name(name, sizeof name, module, "weight_zero_point"), &zs, zeros);
  free(packed);
  free(zeros);
  free(scales);
  free(half);
  return rc;
}

/* Quantizes one linear weight tensor (and writes everything its scheme adds). */
static int quantize_weight(struct quantizer *q, const struct ckpt_tensor *t) {
  int64_t n = t->t->shape[0], k = t->t->shape[1];
  char module[512];
  snprintf(module, sizeof module, "%.*s", (int)(strlen(t->t->name) - 7), t->t->name);
  const char *s = q->sch->name;
  if (strstr(s, "nvfp4")) {
    const char *group[8];
    int n_group = fusion_group(q->ck, t->t->name, group), mine = 0;
    while (strcmp(group[mine], t->t->name) != 0)
      mine++;
    if (k % 16)
      return set_error(QKEEP_E_INVAL, "tensor '%s': K = %lld is not a multiple of 16 (NVFP4)", t->t->name,
                       (long long)k);
    return write_nvfp4(q, group, n_group, mine, k);
  }
  float *w;
  int rc = read_f32(q->ck, t, &w);
  if (rc)
    return rc;
  if (strcmp(s, "mxfp4") == 0)
    rc = k % 32 ? set_error(QKEEP_E_INVAL, "tensor '%s': K = %lld is not a multiple of 32 (MXFP4)",
                            t->t->name, (long long)k)
                : write_mxfp4(q, module, w, n, k);
  else if (strcmp(s, "w8a8-int8") == 0)
    rc = write_int8(q, module, w, n, k);
  else if (strcmp(s, "ct-int4") == 0 && (k % 8 || n % 8))
    rc = set_error(QKEEP_E_INVAL, "tensor '%s': [%lld, %lld] needs N and K multiples of 8 (int4 packing)",
                   t->t->name, (long long)n, (long long)k);
  else if (strcmp(s, "ct-int4") == 0)
    rc = write_ct_int4(q, module, w, n, k, (enum qkeep_dtype)t->t->dtype);
  else if (k % 8 || n % 8)
    rc = set_error(QKEEP_E_INVAL, "tensor '%s': [%lld, %lld] needs N and K multiples of 8 (int4 packing)",
                   t->t->name, (long long)n, (long long)k);
  else
    rc = write_int4(q, module, w, n, k);
  free(w);
  if (rc)
    add_error_context(rc, "quantizing '%s'", t->t->name);
  return rc;
}

/* Copies a tensor unchanged. */
static int copy_tensor(struct quantizer *q, const struct ckpt_tensor *t) {
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
  void *data = malloc(t->t->nbytes ? t->t->nbytes : 1);
  int rc = data ? ckpt_read(q->ck, t, data) : set_error(QKEEP_E_NOMEM, "out of memory");
  if (!rc)
    rc = out_add(&q->out, t->t->name, &s, data);
  free(data);
  return rc;
}

/* Synthetic FP8 kv-cache scales for each attention block (no calibration data here). */
static int add_kv_scales(struct quantizer *q) {
  for (size_t i = 0; i < q->ck->n_tensors; i++) {
    const char *name = q->ck->tensors[i].t->name;
    size_t len = strlen(name);
    static const char suffix[] = ".k_proj.weight";
    if (len < sizeof suffix || strcmp(name + len - (sizeof suffix - 1), suffix) != 0)
      continue;
    char module[512];
    snprintf(module, sizeof module, "%.*s", (int)(len - 7), name);
    float scale = (q->opt->activation_amax > 0 ? q->opt->activation_amax : 1.0f) / 448.0f;
    int rc = add_scalar(q, module, "k_scale", scale, false);
    if (!rc) {
      snprintf(module, sizeof module, "%.*s.v_proj", (int)(len - sizeof suffix + 1), name);
      rc = add_scalar(q, module, "v_scale", scale, false);
    }
    if (rc)
      return rc;
  }
  return 0;
}

/* ---- config files ------------------------------------------------------------------------ */

/* A pack-quantized config group as llm-compressor's W4A16 preset writes it (actorder null, no activations).
 */
static json_t *ct_int4_group(const struct quantizer *q) {
  json_t *weights = json_object(), *group = json_object(), *targets = json_array();
  json_object_set_new(weights, "num_bits", json_integer(4));
  json_object_set_new(weights, "type", json_string("int"));
  json_object_set_new(weights, "symmetric", json_boolean(!q->opt->asym_weights));
  json_object_set_new(weights, "strategy", json_string("group"));
  json_object_set_new(weights, "group_size", json_integer(q->opt->group_size > 0 ? q->opt->group_size : 128));
  json_object_set_new(weights, "dynamic", json_false());
  json_object_set_new(weights, "actorder", json_null());
  json_object_set_new(weights, "observer", json_string("minmax"));
  json_array_append_new(targets, json_string("Linear"));
  json_object_set_new(group, "format", json_string("pack-quantized"));
  json_object_set_new(group, "input_activations", json_null());
  json_object_set_new(group, "output_activations", json_null());
  json_object_set_new(group, "targets", targets);
  json_object_set_new(group, "weights", weights);
  return group;
}

static json_t *ct_group(const struct quantizer *q, bool nvfp4) {
  json_t *weights = json_object(), *group = json_object(), *targets = json_array();
  json_object_set_new(weights, "num_bits", json_integer(nvfp4 || strcmp(q->sch->name, "mxfp4") == 0 ? 4 : 8));
  json_object_set_new(weights, "type", json_string(strcmp(q->sch->name, "w8a8-int8") == 0 ? "int" : "float"));
  json_object_set_new(weights, "symmetric", json_true());
  json_object_set_new(weights, "dynamic", json_false());
  if (strcmp(q->sch->name, "w8a8-int8") == 0) {
    json_object_set_new(weights, "strategy", json_string("channel"));
    json_t *in = json_object();
    json_object_set_new(in, "num_bits", json_integer(8));
    json_object_set_new(in, "type", json_string("int"));
    json_object_set_new(in, "strategy", json_string(q->opt->static_input ? "tensor" : "token"));
    json_object_set_new(in, "dynamic", json_boolean(!q->opt->static_input));
    json_object_set_new(in, "symmetric", json_boolean(!q->opt->asym_input));
    json_object_set_new(group, "input_activations", in);
  } else {
    json_object_set_new(weights, "strategy", json_string(nvfp4 ? "tensor_group" : "group"));
    json_object_set_new(weights, "group_size", json_integer(nvfp4 ? 16 : 32));
    if (nvfp4) {
      json_t *in = json_deep_copy(weights);
      json_object_set_new(in, "dynamic", json_string("local"));
      json_object_set_new(group, "input_activations", in);
    }
  }
  json_array_append_new(targets, json_string("Linear"));
  json_object_set_new(group, "targets", targets);
  json_object_set_new(group, "weights", weights);
  return group;
}

/* config.json's quantization_config for the scheme (and hf_quant_config.json for ModelOpt). */
static json_t *quantization_config(const struct quantizer *q, json_t **hf_quant) {
  const char *s = q->sch->name;
  json_t *qc = json_object(), *ignore = json_array();
  json_array_append_new(ignore, json_string("lm_head"));
  *hf_quant = NULL;
  if (strcmp(s, "modelopt-nvfp4") == 0) {
    json_object_set_new(qc, "quant_method", json_string("modelopt"));
    json_object_set_new(qc, "quant_algo", json_string("NVFP4"));
    json_object_set_new(qc, "group_size", json_integer(16));
    json_object_set_new(qc, "ignore", json_deep_copy(ignore));
    json_t *h = json_object(), *producer = json_object(), *quant = json_object();
    json_object_set_new(producer, "name", json_string("modelopt"));
    json_object_set_new(producer, "version", json_string("qkeep-" PACKAGE_VERSION));
    json_object_set_new(quant, "quant_algo", json_string("NVFP4"));
    json_object_set_new(quant, "kv_cache_quant_algo",
                        q->opt->kv_cache_scales ? json_string("FP8") : json_null());
    json_object_set_new(quant, "group_size", json_integer(16));
    json_object_set_new(quant, "exclude_modules", json_deep_copy(ignore));
    json_object_set_new(h, "producer", producer);
    json_object_set_new(h, "quantization", quant);
    *hf_quant = h;
  } else if (strcmp(s, "gptq-int4") == 0 || strcmp(s, "awq-int4") == 0) {
    bool awq = s[0] == 'a';
    json_object_set_new(qc, "quant_method", json_string(awq ? "awq" : "gptq"));
    json_object_set_new(qc, "bits", json_integer(4));
    json_object_set_new(qc, "group_size", json_integer(q->opt->group_size > 0 ? q->opt->group_size : 128));
    if (awq) {
      json_object_set_new(qc, "zero_point", json_boolean(q->opt->asym_weights));
      json_object_set_new(qc, "version", json_string("gemm"));
    } else {
      json_object_set_new(qc, "desc_act", json_false());
      json_object_set_new(qc, "sym", json_boolean(!q->opt->asym_weights));
      json_object_set_new(qc, "checkpoint_format", json_string("gptq"));
    }
  } else {
    bool nvfp4 = strcmp(s, "ct-nvfp4") == 0, int4 = strcmp(s, "ct-int4") == 0;
    const char *format = nvfp4                     ? "nvfp4-pack-quantized"
                         : strcmp(s, "mxfp4") == 0 ? "mxfp4-pack-quantized"
                         : int4                    ? "pack-quantized"
                                                   : "int-quantized";
    json_t *groups = json_object();
    json_object_set_new(groups, "group_0", int4 ? ct_int4_group(q) : ct_group(q, nvfp4));
    json_object_set_new(qc, "quantization_status", json_string("compressed"));
    json_object_set_new(qc, "quant_method", json_string("compressed-tensors"));
    json_object_set_new(qc, "format", json_string(format));
    json_object_set_new(qc, "config_groups", groups);
    json_object_set_new(qc, "ignore", json_deep_copy(ignore));
  }
  if (q->opt->kv_cache_scales && strcmp(s, "modelopt-nvfp4") != 0) {
    json_t *kv = json_object();
    json_object_set_new(kv, "num_bits", json_integer(8));
    json_object_set_new(kv, "type", json_string("float"));
    json_object_set_new(kv, "dynamic", json_false());
    json_object_set_new(qc, "kv_cache_scheme", kv);
  }
  json_decref(ignore);
  return qc;
}

/* config.json: the input's (when it has one) with quantization_config set. */
static int write_configs(struct quantizer *q) {
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", q->ck->dir);
  json_t *config = NULL;
  struct stat st;
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode) == 0 && strcmp(q->ck->dir, q->out.dir) != 0) {
    json_error_t err;
    config = json_load_file(path, 0, &err);
    if (!config || !json_is_object(config)) {
      json_decref(config);
      config = NULL;
    }
  }
  if (!config)
    config = json_object();
  json_t *hf = NULL;
  json_object_set_new(config, "quantization_config", quantization_config(q, &hf));
  snprintf(path, sizeof path, "%s/config.json", q->out.dir);
  int rc = json_dump_file(config, path, JSON_INDENT(2)) ? set_error(QKEEP_E_IO, "%s: cannot write", path) : 0;
  json_decref(config);
  if (!rc && hf) {
    snprintf(path, sizeof path, "%s/hf_quant_config.json", q->out.dir);
    rc = json_dump_file(hf, path, JSON_INDENT(2)) ? set_error(QKEEP_E_IO, "%s: cannot write", path) : 0;
  }
  json_decref(hf);
  return rc;
}

/* Removes what a failed quantize wrote into its own, new output directory. */
static void remove_output(const char *dir, int n_shards) {
  char path[4096];
  static const char *const names[] = {"config.json", "hf_quant_config.json", "model.safetensors",
                                      "model.safetensors.index.json"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    snprintf(path, sizeof path, "%s/%s", dir, names[i]);
    unlink(path);
  }
  for (int s = 0; s <= n_shards; s++) {
    snprintf(path, sizeof path, "%s/shard-%05d.tmp", dir, s);
    unlink(path);
    snprintf(path, sizeof path, "%s/model-%05d-of-%05d.safetensors", dir, s + 1, n_shards);
    unlink(path);
  }
  rmdir(dir);
}

int qkeep_quantize(const char *in, const char *out_dir, const struct qkeep_quantize_options *opt) {
  if (!in || !out_dir || !opt || !opt->scheme)
    return set_error(QKEEP_E_INVAL, "qkeep_quantize: NULL argument");
  const struct scheme *sch = scheme_by_name(opt->scheme);
  if (!sch || sch == &scheme_unquantized)
    return set_error(QKEEP_E_INVAL,
                     "unknown scheme '%s' (modelopt-nvfp4, ct-nvfp4, mxfp4, w8a8-int8, gptq-int4, awq-int4, "
                     "ct-int4)",
                     opt->scheme);
  if (mkdir(out_dir, 0755) != 0)
    return set_error(errno == EEXIST ? QKEEP_E_EXISTS : QKEEP_E_IO,
                     "%s: cannot create the output directory: %s", out_dir, strerror(errno));
  struct ckpt *ck;
  int rc = ckpt_open(in, &ck);
  if (rc) {
    rmdir(out_dir);
    return rc;
  }
  struct quantizer q = {.ck = ck, .opt = opt, .sch = sch};
  q.out =
      (struct output){.dir = out_dir, .max_shard_bytes = opt->max_shard_bytes, .weight_map = json_object()};
  if (ck->qc.method != QM_NONE)
    rc =
        set_error(QKEEP_E_INVAL, "%s: already quantized (%s); qkeep quantize needs an unquantized checkpoint",
                  in, ck->qc.scheme);
  for (size_t i = 0; i < ck->n_tensors && !rc; i++)
    rc = quantizable(&ck->tensors[i]) ? quantize_weight(&q, &ck->tensors[i])
                                      : copy_tensor(&q, &ck->tensors[i]);
  if (!rc && opt->kv_cache_scales)
    rc = add_kv_scales(&q);
  if (!rc)
    rc = out_finish(&q.out);
  if (!rc)
    rc = write_configs(&q);
  st_writer_free(q.out.w);
  json_decref(q.out.weight_map);
  if (rc)
    remove_output(out_dir, q.out.n_shards); /* nothing half-written stays */
  ckpt_close(ck);
  return rc;
}
