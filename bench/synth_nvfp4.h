/*
 * synth_nvfp4.h: the synthetic ModelOpt NVFP4 checkpoints the GPU benches load (bench_sync,
 * bench_forward): real tensor names and shapes of Llama-3-8B and Qwen3-30B-A3B, layers cut down,
 * codes and e4m3 block scales random from a seed, norms, router and embeddings bf16; or the same
 * model unquantized (every linear's weight bf16, random signs and magnitudes over eight binades), as a
 * trainer would hand it over. Header-only (static functions): one translation unit each.
 */
#ifndef QKEEP_BENCH_SYNTH_NVFP4_H
#define QKEEP_BENCH_SYNTH_NVFP4_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "private.h"
#include "testutil.h"

struct shape {
  const char *name;
  int hidden, q, kv, inter, experts, moe_inter, vocab, layers;
  bool qk_norm;
};
/* Cut to `layers` decoder layers; a bench may lower `vocab` and `layers` in its own copy. */
static const struct shape shapes[] = {
    {"llama3-8b-4l", 4096, 4096, 1024, 14336, 0, 0, 128256, 4, false},
    {"qwen3-30b-a3b-4l", 2048, 4096, 512, 0, 128, 768, 151936, 4, true},
};

static unsigned char *scratch;

static int add(struct st_writer *w, const char *name, enum qkeep_dtype dt, int ndim, int64_t d0, int64_t d1) {
  struct qkeep_spec s = {dt, ndim, {d0, d1}};
  return st_writer_add(w, name, &s, scratch);
}

static void fill(size_t n, uint64_t *seed, unsigned char mask) {
  for (size_t i = 0; i < n; i += 8) {
    uint64_t r = tu_rand(seed);
    for (size_t j = 0; j < 8 && i + j < n; j++)
      scratch[i + j] = (unsigned char)(r >> (8 * j)) & mask;
  }
}

static int add_nvfp4(struct st_writer *w, const char *module, int64_t n, int64_t k, uint64_t *seed) {
  char name[256];
  float scalar = 0.5f + (float)(tu_rand(seed) % 1000) / 1000.0f;
  snprintf(name, sizeof name, "%s.weight", module);
  fill((size_t)(n * k / 2), seed, 0xff);
  int rc = add(w, name, QKEEP_DTYPE_U8, 2, n, k / 2);
  snprintf(name, sizeof name, "%s.weight_scale", module);
  fill((size_t)(n * k / 16), seed, 0x3f); /* e4m3, non-negative, not NaN */
  rc = rc ? rc : add(w, name, QKEEP_DTYPE_F8_E4M3, 2, n, k / 16);
  static const char *const scalars[] = {"weight_scale_2", "input_scale"};
  for (int i = 0; i < 2 && !rc; i++) {
    snprintf(name, sizeof name, "%s.%s", module, scalars[i]);
    memcpy(scratch, &scalar, sizeof scalar);
    rc = add(w, name, QKEEP_DTYPE_F32, 0, 0, 0);
  }
  return rc;
}

/* An unquantized linear: module.weight, bf16 values of random sign in [2^-9, 2^-1) (n * k a multiple of 4).
 */
static int add_bf16_linear(struct st_writer *w, const char *module, int64_t n, int64_t k, uint64_t *seed) {
  char name[256];
  snprintf(name, sizeof name, "%s.weight", module);
  for (size_t i = 0; i < (size_t)(n * k); i += 4) {
    uint64_t r = tu_rand(seed);
    for (size_t j = 0; j < 4; j++) {
      uint16_t v = (uint16_t)(r >> (16 * j));
      scratch[2 * (i + j)] = (unsigned char)v;
      scratch[2 * (i + j) + 1] = (unsigned char)((v & 0x8000u) >> 8 | (0x3b + ((v >> 8) & 3)));
    }
  }
  return add(w, name, QKEEP_DTYPE_BF16, 2, n, k);
}

static int add_bf16(struct st_writer *w, const char *name, int ndim, int64_t d0, int64_t d1, uint64_t *seed) {
  size_t n = (size_t)d0 * (size_t)(ndim > 1 ? d1 : 1);
  for (size_t i = 0; i < n; i++) {
    scratch[2 * i] = (unsigned char)tu_rand(seed);
    scratch[2 * i + 1] = 0x3c; /* bf16 in [2^-7, 2^-6) */
  }
  return add(w, name, QKEEP_DTYPE_BF16, ndim, d0, d1);
}

/* The model's linears as ModelOpt NVFP4, or (bf16) unquantized. */
static int add_linear(struct st_writer *w, const char *module, int64_t n, int64_t k, uint64_t *seed,
                      bool bf16) {
  return bf16 ? add_bf16_linear(w, module, n, k, seed) : add_nvfp4(w, module, n, k, seed);
}

/* Bytes of the checkpoint's largest tensor, bf16 or NVFP4 (the scratch every tensor is made in): the
 * embeddings, or a linear's bf16 weight when a bench lowers `vocab` (bench_forward: 1024 rows). */
static size_t largest_tensor(const struct shape *s) {
  const int64_t dims[][2] = {{s->vocab, s->hidden},     {s->q, s->hidden},        {s->hidden, s->q},
                             {s->inter, s->hidden},     {s->hidden, s->inter},    {s->experts, s->hidden},
                             {s->moe_inter, s->hidden}, {s->hidden, s->moe_inter}};
  size_t most = 0;
  for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
    if ((size_t)(dims[i][0] * dims[i][1]) * 2 > most)
      most = (size_t)(dims[i][0] * dims[i][1]) * 2;
  return most;
}

/* Writes dir/model.safetensors and its configs: ModelOpt NVFP4, or with bf16 every linear unquantized. */
static int write_checkpoint(const struct shape *s, const char *dir, uint64_t seed, bool bf16) {
  struct st_writer *w;
  char name[256];
  int rc = st_writer_new(&w);
  if (!rc && !(scratch = malloc(largest_tensor(s))))
    rc = set_error(QKEEP_E_NOMEM, "out of memory");
  rc = rc ? rc : add_bf16(w, "model.embed_tokens.weight", 2, s->vocab, s->hidden, &seed);
  rc = rc ? rc : add_bf16(w, "lm_head.weight", 2, s->vocab, s->hidden, &seed);
  rc = rc ? rc : add_bf16(w, "model.norm.weight", 1, s->hidden, 0, &seed);
  for (int l = 0; l < s->layers && !rc; l++) {
    static const char *const proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    for (int p = 0; p < 4 && !rc; p++) {
      snprintf(name, sizeof name, "model.layers.%d.self_attn.%s", l, proj[p]);
      rc = add_linear(w, name,
                      p == 0  ? s->q
                      : p < 3 ? s->kv
                              : s->hidden,
                      p == 3 ? s->q : s->hidden, &seed, bf16);
    }
    static const char *const norms[] = {"input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                                        "self_attn.k_norm"};
    for (int n = 0; n < (s->qk_norm ? 4 : 2) && !rc; n++) {
      snprintf(name, sizeof name, "model.layers.%d.%s.weight", l, norms[n]);
      rc = add_bf16(w, name, 1, n < 2 ? s->hidden : 128, 0, &seed);
    }
    static const char *const mlp[] = {"gate_proj", "up_proj", "down_proj"};
    if (!s->experts)
      for (int p = 0; p < 3 && !rc; p++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.%s", l, mlp[p]);
        rc = add_linear(w, name, p < 2 ? s->inter : s->hidden, p < 2 ? s->hidden : s->inter, &seed, bf16);
      }
    if (s->experts && !rc) {
      snprintf(name, sizeof name, "model.layers.%d.mlp.gate.weight", l);
      rc = add_bf16(w, name, 2, s->experts, s->hidden, &seed);
    }
    for (int e = 0; e < s->experts && !rc; e++)
      for (int p = 0; p < 3 && !rc; p++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s", l, e, mlp[p]);
        rc = add_linear(w, name, p < 2 ? s->moe_inter : s->hidden, p < 2 ? s->hidden : s->moe_inter, &seed,
                        bf16);
      }
  }
  char *file = tu_path(dir, "model.safetensors"), *cfg = tu_path(dir, "config.json"),
       *hf = tu_path(dir, "hf_quant_config.json");
  static const char config[] = "{\"tie_word_embeddings\": false, \"quantization_config\": {\"quant_method\": "
                               "\"modelopt\", \"quant_algo\": \"NVFP4\", \"group_size\": 16, \"ignore\": "
                               "[\"lm_head\", \"model.layers.*.mlp.gate\"]}}\n";
  static const char hfq[] =
      "{\"producer\": {\"name\": \"modelopt\", \"version\": \"synthetic\"}, "
      "\"quantization\": {\"quant_algo\": \"NVFP4\", \"kv_cache_quant_algo\": null, "
      "\"group_size\": 16, \"exclude_modules\": [\"lm_head\", \"model.layers.*.mlp.gate\"]}}\n";
  static const char plain[] = "{\"tie_word_embeddings\": false}\n";
  if (!rc)
    rc = st_writer_write(w, file);
  if (!rc && bf16 && tu_write_file(cfg, plain, strlen(plain)))
    rc = set_error(QKEEP_E_IO, "%s: cannot write the config", dir);
  else if (!rc && !bf16 &&
           (tu_write_file(cfg, config, strlen(config)) || tu_write_file(hf, hfq, strlen(hfq))))
    rc = set_error(QKEEP_E_IO, "%s: cannot write the configs", dir);
  st_writer_free(w);
  free(scratch), free(file), free(cfg), free(hf);
  scratch = NULL;
  return rc;
}

/* The ModelOpt NVFP4 checkpoint (write_checkpoint). */
static int write_model(const struct shape *s, const char *dir, uint64_t seed) {
  return write_checkpoint(s, dir, seed, false);
}

#endif
