/* synth_moe.c: see synth_moe.h. */
#include "synth_moe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "private.h"
#include "testutil.h"

enum { HIDDEN = 32, KV_DIM = 16, EXPERT_INTER = 16, VOCAB = 64 };

/* NVFP4 linear: 4 tensors; per layer 4 attention linears, 4 norms, the router, 3 per expert. */
size_t synth_moe_tensors(int layers, int experts) {
  return 3 + (size_t)layers * (4 * 4 + 4 + 1 + (size_t)experts * 3 * 4);
}

static void fill(unsigned char *buf, size_t n, uint64_t *seed, unsigned char mask) {
  for (size_t i = 0; i < n; i++)
    buf[i] = (unsigned char)(tu_rand(seed) & mask);
}

static int add(struct st_writer *w, const char *name, enum qkeep_dtype dtype, int ndim, int64_t d0,
               int64_t d1, const void *data) {
  struct qkeep_spec spec = {dtype, ndim, {d0, d1}};
  return st_writer_add(w, name, &spec, data);
}

/* weight u8 [n, k/2], weight_scale e4m3 [n, k/16] (non-negative, not NaN), the two f32 scalars. */
static int add_nvfp4(struct st_writer *w, const char *module, int64_t n, int64_t k, uint64_t *seed,
                     unsigned char *buf) {
  char *name = NULL;
  int rc = 0;
  float scalar;
  static const char *const locals[] = {"weight", "weight_scale", "weight_scale_2", "input_scale"};
  for (int t = 0; t < 4 && !rc; t++) {
    free(name);
    if (asprintf(&name, "%s.%s", module, locals[t]) < 0) {
      name = NULL;
      return set_error(QKEEP_E_NOMEM, "out of memory");
    }
    switch (t) {
    case 0:
      fill(buf, (size_t)(n * k / 2), seed, 0xff);
      rc = add(w, name, QKEEP_DTYPE_U8, 2, n, k / 2, buf);
      break;
    case 1:
      fill(buf, (size_t)(n * k / 16), seed, 0x3f);
      rc = add(w, name, QKEEP_DTYPE_F8_E4M3, 2, n, k / 16, buf);
      break;
    default:
      scalar = 0.5f + (float)(tu_rand(seed) % 1000) / 1000.0f;
      rc = add(w, name, QKEEP_DTYPE_F32, 0, 0, 0, &scalar);
    }
  }
  free(name);
  return rc;
}

static int add_bf16(struct st_writer *w, const char *name, int ndim, int64_t d0, int64_t d1,
                    unsigned char *buf) {
  size_t n = (size_t)d0 * (size_t)(ndim > 1 ? d1 : 1);
  for (size_t i = 0; i < n; i++) {
    buf[2 * i] = 0;
    buf[2 * i + 1] = 0x3f; /* bf16 0.5 */
  }
  return add(w, name, QKEEP_DTYPE_BF16, ndim, d0, d1, buf);
}

static int write_configs(const char *dir) {
  static const char config[] =
      "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"tie_word_embeddings\": false, "
      "\"quantization_config\": {\"quant_method\": \"modelopt\", \"quant_algo\": \"NVFP4\", \"group_size\": "
      "16, "
      "\"ignore\": [\"lm_head\", \"model.layers.*.mlp.gate\"]}}\n";
  static const char hf[] =
      "{\"producer\": {\"name\": \"modelopt\", \"version\": \"synthetic\"}, \"quantization\": "
      "{\"quant_algo\": \"NVFP4\", \"kv_cache_quant_algo\": null, \"group_size\": 16, "
      "\"exclude_modules\": [\"lm_head\", \"model.layers.*.mlp.gate\"]}}\n";
  char *c = tu_path(dir, "config.json"), *h = tu_path(dir, "hf_quant_config.json");
  int rc = tu_write_file(c, config, strlen(config)) || tu_write_file(h, hf, strlen(hf));
  free(c);
  free(h);
  return rc ? set_error(QKEEP_E_IO, "%s: cannot write the configs", dir) : 0;
}

static int write_layer(struct st_writer *w, int l, int experts, uint64_t *seed, unsigned char *buf) {
  static const struct {
    const char *name;
    int64_t n, k;
  } attn[] = {{"q_proj", HIDDEN, HIDDEN},
              {"k_proj", KV_DIM, HIDDEN},
              {"v_proj", KV_DIM, HIDDEN},
              {"o_proj", HIDDEN, HIDDEN}};
  static const char *const norms[] = {"input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                                      "self_attn.k_norm"};
  char name[160]; /* fixed names of this generator, all far shorter */
  int rc = 0;
  for (int i = 0; i < 4 && !rc; i++) {
    snprintf(name, sizeof name, "model.layers.%d.self_attn.%s", l, attn[i].name);
    rc = add_nvfp4(w, name, attn[i].n, attn[i].k, seed, buf);
  }
  for (int i = 0; i < 4 && !rc; i++) {
    snprintf(name, sizeof name, "model.layers.%d.%s.weight", l, norms[i]);
    rc = add_bf16(w, name, 1, i < 2 ? HIDDEN : 8, 0, buf);
  }
  snprintf(name, sizeof name, "model.layers.%d.mlp.gate.weight", l);
  if (!rc)
    rc = add_bf16(w, name, 2, experts, HIDDEN, buf);
  static const char *const proj[] = {"gate_proj", "up_proj", "down_proj"};
  for (int e = 0; e < experts && !rc; e++)
    for (int p = 0; p < 3 && !rc; p++) {
      snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s", l, e, proj[p]);
      rc = p < 2 ? add_nvfp4(w, name, EXPERT_INTER, HIDDEN, seed, buf)
                 : add_nvfp4(w, name, HIDDEN, EXPERT_INTER, seed, buf);
    }
  return rc;
}

/* Writes the tensors of layers [first, last) (and, for shard 0, the embedding, norm and lm_head) to path. */
static int write_shard(const char *path, int shard, int first, int last, int experts, uint64_t *seed) {
  struct st_writer *w;
  int rc = st_writer_new(&w);
  if (rc)
    return rc;
  unsigned char *buf = malloc((size_t)VOCAB * HIDDEN * 2 + (size_t)experts * HIDDEN * 2);
  if (!buf)
    rc = set_error(QKEEP_E_NOMEM, "out of memory");
  if (!rc && shard == 0)
    rc = add_bf16(w, "model.embed_tokens.weight", 2, VOCAB, HIDDEN, buf);
  if (!rc && shard == 0)
    rc = add_bf16(w, "model.norm.weight", 1, HIDDEN, 0, buf);
  if (!rc && shard == 0)
    rc = add_bf16(w, "lm_head.weight", 2, VOCAB, HIDDEN, buf);
  for (int l = first; l < last && !rc; l++)
    rc = write_layer(w, l, experts, seed, buf);
  if (!rc)
    rc = st_writer_write(w, path);
  free(buf);
  st_writer_free(w);
  return rc;
}

/* model.safetensors.index.json: every tensor name of every shard, read back from the shards. */
static int write_index(const char *dir, char *const *shard_names, int shards) {
  char *text = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&text, &len);
  int rc = out ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
  if (out)
    fputs("{\"metadata\": {}, \"weight_map\": {", out);
  bool first = true;
  for (int s = 0; s < shards && !rc; s++) {
    char *path = tu_path(dir, shard_names[s]);
    struct st_file *f;
    rc = st_open(path, &f);
    for (size_t i = 0; !rc && i < f->n_tensors; i++, first = false)
      fprintf(out, "%s\n  \"%s\": \"%s\"", first ? "" : ",", f->tensors[i].name, shard_names[s]);
    if (!rc)
      st_close(f);
    free(path);
  }
  if (out)
    fputs("\n}}\n", out);
  if (out && fclose(out) != 0 && !rc)
    rc = set_error(QKEEP_E_IO, "cannot build the index");
  char *path = tu_path(dir, "model.safetensors.index.json");
  if (!rc && tu_write_file(path, text, len))
    rc = set_error(QKEEP_E_IO, "%s: cannot write", path);
  free(path);
  free(text);
  return rc;
}

int synth_moe_write(const char *dir, int layers, int experts, int shards, uint64_t seed) {
  if (shards < 1)
    shards = 1;
  char **names = calloc((size_t)shards, sizeof *names);
  int rc = names ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
  for (int s = 0; s < shards && !rc; s++) {
    if (shards == 1)
      names[s] = strdup("model.safetensors");
    else if (asprintf(&names[s], "model-%05d-of-%05d.safetensors", s + 1, shards) < 0)
      names[s] = NULL;
    char *path = names[s] ? tu_path(dir, names[s]) : NULL;
    rc = path ? write_shard(path, s, layers * s / shards, layers * (s + 1) / shards, experts, &seed)
              : set_error(QKEEP_E_NOMEM, "out of memory");
    free(path);
  }
  if (!rc && shards > 1)
    rc = write_index(dir, names, shards);
  if (!rc)
    rc = write_configs(dir);
  for (int s = 0; names && s < shards; s++)
    free(names[s]);
  free(names);
  return rc;
}
