/*
 * fuzz_seeds.c: writes the seed corpora of the three fuzz targets from a small model of the
 * examples' shape (an embedding, one decoder layer with q/k/v/o, norms and a gate/up/down MLP,
 * one MoE layer of two experts with a router, a final norm, an lm_head; hidden 32), quantized
 * by qkeep_quantize into every scheme with kv-cache scales, as the examples are:
 *
 *   fuzz_seeds OUTDIR [SRCDIR]
 *
 * OUTDIR/checkpoint/SCHEME: the fuzz_checkpoint input of each checkpoint (see
 * fuzz_checkpoint.c); OUTDIR/safetensors/SCHEME: its model.safetensors;
 * OUTDIR/configs/: each config.json (a 1 byte, the text, a NUL, hf_quant_config.json) and,
 * with SRCDIR, each .ini file of conf/ (a 0 byte, the text). Deterministic.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "private.h"
#include "testutil.h"

#define H 32
#define KVH 16
#define INTER 64
#define VOCAB 48

static int add(struct st_writer *w, uint64_t *rng, const char *name, int64_t rows, int64_t cols) {
  struct qkeep_spec spec = {.dtype = QKEEP_DTYPE_BF16, .ndim = cols ? 2 : 1, .shape = {rows, cols}};
  size_t n = (size_t)rows * (size_t)(cols ? cols : 1);
  uint16_t *v = malloc(n * sizeof *v);
  if (!v)
    return QKEEP_E_NOMEM;
  for (size_t i = 0; i < n; i++)
    v[i] = qk_f32_to_bf16(cols ? tu_randf(rng) * 0.5f : 1.0f);
  int rc = st_writer_add(w, name, &spec, v);
  free(v);
  return rc;
}

static int write_source(const char *path) {
  struct st_writer *w;
  uint64_t rng = 11;
  char name[128];
  int rc = st_writer_new(&w);
  if (rc)
    return rc;
  rc = add(w, &rng, "model.embed_tokens.weight", VOCAB, H);
  rc = rc ? rc : add(w, &rng, "model.norm.weight", H, 0);
  rc = rc ? rc : add(w, &rng, "lm_head.weight", VOCAB, H);
  static const char *const attn[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  for (int l = 0; l < 2 && !rc; l++) {
    for (int p = 0; p < 4 && !rc; p++) {
      snprintf(name, sizeof name, "model.layers.%d.self_attn.%s.weight", l, attn[p]);
      rc = add(w, &rng, name, p == 1 || p == 2 ? KVH : H, H);
    }
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
    rc = rc ? rc : add(w, &rng, name, H, 0);
  }
  rc = rc ? rc : add(w, &rng, "model.layers.0.mlp.gate_proj.weight", INTER, H);
  rc = rc ? rc : add(w, &rng, "model.layers.0.mlp.up_proj.weight", INTER, H);
  rc = rc ? rc : add(w, &rng, "model.layers.0.mlp.down_proj.weight", H, INTER);
  rc = rc ? rc : add(w, &rng, "model.layers.1.mlp.gate.weight", 2, H);
  for (int e = 0; e < 2 && !rc; e++) {
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.gate_proj.weight", e);
    rc = add(w, &rng, name, H, H);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.up_proj.weight", e);
    rc = rc ? rc : add(w, &rng, name, H, H);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.down_proj.weight", e);
    rc = rc ? rc : add(w, &rng, name, H, H);
  }
  rc = rc ? rc : st_writer_write(w, path);
  st_writer_free(w);
  return rc;
}

/* A file's bytes (NULL and 0 when it does not exist). */
static void *slurp(const char *dir, const char *file, size_t *n) {
  char *path = tu_path(dir, file);
  void *bytes = tu_read_file(path, n);
  free(path);
  if (!bytes)
    *n = 0;
  return bytes;
}

static int put(const char *dir, const char *sub, const char *name, const void *a, size_t na, const void *b,
               size_t nb, const void *c, size_t nc, const void *d, size_t nd) {
  char *where = tu_path(dir, sub);
  mkdir(where, 0755);
  char *path = tu_path(where, name);
  unsigned char *all = malloc(na + nb + nc + nd + 1);
  int rc = all ? 0 : QKEEP_E_NOMEM;
  if (!rc) {
    const void *parts[4] = {a, b, c, d};
    size_t lens[4] = {na, nb, nc, nd}, at = 0;
    for (int i = 0; i < 4; i++) {
      if (lens[i]) /* an absent part is (NULL, 0): memcpy may not be given NULL */
        memcpy(all + at, parts[i], lens[i]);
      at += lens[i];
    }
    rc = tu_write_file(path, all, na + nb + nc + nd);
  }
  free(all);
  free(path);
  free(where);
  return rc;
}

static int seed_scheme(const char *out, const char *source, const char *scheme) {
  char *ck = tu_path(out, scheme); /* the checkpoint itself, removed below */
  struct qkeep_quantize_options o = {.size = sizeof o,
                                     .scheme = scheme,
                                     .group_size = 32,
                                     .kv_cache_scales = true,
                                     .static_input = true,
                                     .activation_amax = 4};
  tu_rmtree(ck);
  int rc = 0;
  if (strcmp(scheme, "unquantized") == 0) { /* the source itself, with a plain config.json */
    size_t n;
    void *bytes = tu_read_file(source, &n);
    static const char config[] = "{\"model_type\": \"llama\", \"tie_word_embeddings\": false}\n";
    mkdir(ck, 0755);
    char *st_path = tu_path(ck, "model.safetensors"), *cfg_path = tu_path(ck, "config.json");
    rc = bytes && !tu_write_file(st_path, bytes, n) && !tu_write_file(cfg_path, config, sizeof config - 1)
             ? 0
             : QKEEP_E_IO;
    free(bytes), free(st_path), free(cfg_path);
  } else {
    rc = qkeep_quantize(source, ck, &o);
  }
  size_t n_cfg, n_hf, n_st;
  char *cfg = rc ? NULL : slurp(ck, "config.json", &n_cfg),
       *hf = rc ? NULL : slurp(ck, "hf_quant_config.json", &n_hf);
  unsigned char *st = rc ? NULL : slurp(ck, "model.safetensors", &n_st);
  if (!rc && (!st || n_cfg > 0xffff || n_hf > 0xffff))
    rc = QKEEP_E_FORMAT;
  if (!rc) {
    unsigned char lengths[4] = {(unsigned char)n_cfg, (unsigned char)(n_cfg >> 8), (unsigned char)n_hf,
                                (unsigned char)(n_hf >> 8)};
    rc = put(out, "checkpoint", scheme, lengths, 4, cfg, n_cfg, hf, n_hf, st, n_st);
  }
  if (!rc)
    rc = put(out, "safetensors", scheme, st, n_st, NULL, 0, NULL, 0, NULL, 0);
  if (!rc && cfg)
    rc = put(out, "configs", scheme, "\1", 1, cfg, n_cfg, "", hf ? 1 : 0, hf, n_hf);
  tu_rmtree(ck);
  free(cfg), free(hf), free(st), free(ck);
  if (rc)
    fprintf(stderr, "fuzz_seeds: %s: %s\n", scheme, qkeep_errmsg());
  return rc;
}

/* Each .ini file of conf/ as an INI input of fuzz_configs. */
static int seed_inis(const char *out, const char *srcdir) {
  char *conf = tu_path(srcdir, "conf");
  DIR *d = opendir(conf);
  int rc = 0;
  const struct dirent *e;
  while (d && !rc && (e = readdir(d))) {
    size_t len = strlen(e->d_name), n;
    if (len < 5 || strcmp(e->d_name + len - 4, ".ini") != 0)
      continue;
    void *text = slurp(conf, e->d_name, &n);
    rc = text ? put(out, "configs", e->d_name, "", 1, text, n, NULL, 0, NULL, 0) : 0;
    free(text);
  }
  if (d)
    closedir(d);
  free(conf);
  return rc;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: fuzz_seeds OUTDIR [SRCDIR]\n");
    return 2;
  }
  static const char *const schemes[] = {"unquantized", "w8a8-int8", "modelopt-nvfp4", "ct-nvfp4",
                                        "mxfp4",       "gptq-int4", "awq-int4",       "ct-int4"};
  mkdir(argv[1], 0755);
  char *source = tu_path(argv[1], "source.safetensors");
  int rc = write_source(source);
  for (size_t i = 0; i < sizeof schemes / sizeof schemes[0] && !rc; i++)
    rc = seed_scheme(argv[1], source, schemes[i]);
  if (!rc && argc > 2)
    rc = seed_inis(argv[1], argv[2]);
  remove(source);
  free(source);
  return rc ? 1 : 0;
}
