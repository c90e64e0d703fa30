/*
 * mxfp4_plan.c: how an MXFP4 GEMM launch covers its product (struct
 * mxfp4_plan), plain arithmetic shared by both launchers and tested in CI.
 */
#include "mxfp4.h"
#include "mxfp4_args.h"

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

size_t mxfp4_stage_bytes(int tokens, int stage) {
  return (size_t)tokens * (size_t)(stage * MXFP4_CHUNK_K + MXFP4_X_PAD) * 2;
}

void mxfp4_plan_gemm(int64_t m, int64_t n, int64_t k, int wave, int units, int split_k,
                     struct mxfp4_plan *out) {
  int tokens = wave == 32 ? 8 : 16;
  while (tokens < MXFP4_MAX_TOKENS && tokens < m)
    tokens *= 2;
  out->tokens = tokens;
  out->stage = tokens <= 16 ? 8 : 4;
  out->waves = wave == 32 ? 8 : 4;
  out->grid_x = ceil_div(mxfp4_tiles(n), out->waves);
  out->grid_y = ceil_div(m, tokens);
  int64_t chunks = mxfp4_chunks(k), stages = ceil_div(chunks, out->stage);
  int64_t split;
  if (split_k > 0) {
    split = split_k < stages ? split_k : stages;
  } else {
    int64_t most = stages / 2 < MXFP4_MAX_SPLIT ? stages / 2 : MXFP4_MAX_SPLIT; /* two stages a split */
    int64_t blocks = out->grid_x * out->grid_y;
    split = ceil_div(2 * (int64_t)(units > 0 ? units : 1), blocks);
    /* The partial sums (written and read once each) stay within a quarter of the weight bytes. */
    int64_t weight_bytes = mxfp4_code_bytes(n, k) + mxfp4_scale_bytes(n, k);
    int64_t cheap = weight_bytes / (32 * m * n);
    if (split > cheap)
      split = cheap;
    if (split > most)
      split = most;
    if (split < 1)
      split = 1;
  }
  /* Whole stages per split; rounding up may leave fewer splits than asked. */
  out->chunks_per_split = ceil_div(ceil_div(chunks, split), out->stage) * out->stage;
  out->split = (int)ceil_div(chunks, out->chunks_per_split);
}
