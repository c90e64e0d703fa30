/*
 * make_tiny.c: writes the small unquantized example model, deterministically:
 * an embedding, DECODER_LAYERS decoder layers (q/k/v/o projections, two
 * norms, and a gate/up/down MLP, or in the last layer an MoE block of EXPERTS
 * experts with a router), a final norm and an lm_head. About 5 MB in bf16; with DIVISOR, every
 * width but the experts' count divided by it (the same tensors, 1/DIVISOR^2 of the bytes: a test
 * that runs a load thousands of times, check_oom, takes 4).
 *
 *   make_tiny OUT.safetensors [SEED] [bf16|f16|f32] [DIVISOR]
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "private.h"
#include "testutil.h"

#define EXPERTS 4
#define DECODER_LAYERS 3

/* The widths (make_tiny's DIVISOR divides them). */
static int64_t hidden = 256, kv = 128, inter = 512, moe_inter = 256, vocab = 1024;

static enum qkeep_dtype out_dtype = QKEEP_DTYPE_BF16;

/* Adds one tensor of uniform values in [-scale, scale) (or all `fill` when scale is 0). */
static int add(struct st_writer *w, uint64_t *rng, const char *name, int64_t rows, int64_t cols, float scale,
               float fill) {
  struct qkeep_spec spec = {.dtype = out_dtype, .ndim = cols ? 2 : 1, .shape = {rows, cols}};
  size_t n = (size_t)rows * (size_t)(cols ? cols : 1);
  unsigned char *buf = malloc(n * 4);
  if (!buf)
    return QKEEP_E_NOMEM;
  for (size_t i = 0; i < n; i++) {
    float v = scale ? tu_randf(rng) * scale : fill;
    if (out_dtype == QKEEP_DTYPE_F32)
      memcpy(buf + 4 * i, &v, 4);
    else {
      uint16_t h = out_dtype == QKEEP_DTYPE_BF16 ? qk_f32_to_bf16(v) : qk_f32_to_f16(v);
      memcpy(buf + 2 * i, &h, 2);
    }
  }
  int rc = st_writer_add(w, name, &spec, buf);
  free(buf);
  return rc;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: make_tiny OUT.safetensors [SEED] [bf16|f16|f32]\n");
    return 2;
  }
  uint64_t rng = argc > 2 ? strtoull(argv[2], NULL, 10) : 1;
  if (argc > 3)
    out_dtype = strcmp(argv[3], "f32") == 0   ? QKEEP_DTYPE_F32
                : strcmp(argv[3], "f16") == 0 ? QKEEP_DTYPE_F16
                                              : QKEEP_DTYPE_BF16;
  int64_t divisor = argc > 4 ? strtoll(argv[4], NULL, 10) : 1;
  if (divisor < 1 || divisor > 16 || 256 % divisor) {
    fprintf(stderr, "make_tiny: DIVISOR %s: 1, 2, 4, 8 or 16\n", argv[4]);
    return 2;
  }
  hidden /= divisor, kv /= divisor, inter /= divisor, moe_inter /= divisor, vocab /= divisor;
  struct st_writer *w;
  int rc = st_writer_new(&w);
  char name[128];
  if (!rc)
    rc = add(w, &rng, "model.embed_tokens.weight", vocab, hidden, 1.0f, 0);
  for (int l = 0; l < DECODER_LAYERS && !rc; l++) {
    const struct {
      const char *name;
      int64_t rows, cols;
    } linears[] = {
        {"self_attn.q_proj", hidden, hidden}, {"self_attn.k_proj", kv, hidden},
        {"self_attn.v_proj", kv, hidden},     {"self_attn.o_proj", hidden, hidden},
        {"mlp.gate_proj", inter, hidden},     {"mlp.up_proj", inter, hidden},
        {"mlp.down_proj", hidden, inter},
    };
    bool moe = l == DECODER_LAYERS - 1;
    for (size_t i = 0; i < (moe ? 4 : sizeof linears / sizeof linears[0]) && !rc; i++) {
      snprintf(name, sizeof name, "model.layers.%d.%s.weight", l, linears[i].name);
      rc = add(w, &rng, name, linears[i].rows, linears[i].cols, 0.125f, 0);
    }
    static const char *const projections[] = {"gate_proj", "up_proj", "down_proj"};
    for (int e = 0; moe && e < EXPERTS && !rc; e++)
      for (int p = 0; p < 3 && !rc; p++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", l, e, projections[p]);
        rc = p < 2 ? add(w, &rng, name, moe_inter, hidden, 0.125f, 0)
                   : add(w, &rng, name, hidden, moe_inter, 0.125f, 0);
      }
    snprintf(name, sizeof name, "model.layers.%d.mlp.gate.weight", l);
    if (moe && !rc)
      rc = add(w, &rng, name, EXPERTS, hidden, 0.125f, 0);
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
    if (!rc)
      rc = add(w, &rng, name, hidden, 0, 0, 1.0f);
    snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
    if (!rc)
      rc = add(w, &rng, name, hidden, 0, 0, 1.0f);
  }
  if (!rc)
    rc = add(w, &rng, "model.norm.weight", hidden, 0, 0, 1.0f);
  if (!rc)
    rc = add(w, &rng, "lm_head.weight", vocab, hidden, 0.125f, 0);
  if (!rc)
    rc = st_writer_set_metadata(w, "format", "pt");
  if (!rc)
    rc = st_writer_write(w, argv[1]);
  st_writer_free(w);
  if (rc) {
    fprintf(stderr, "make_tiny: %s: %s\n", qkeep_strerror(rc), qkeep_errmsg());
    return 1;
  }
  return 0;
}
