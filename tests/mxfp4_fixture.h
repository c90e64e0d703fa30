/*
 * mxfp4_fixture.h: a gpt-oss MXFP4 checkpoint for the MXFP4 suites (check_gpu_mxfp4,
 * check_mxfp4_host), written through the core's own quantizer (quant_mxfp4) and safetensors
 * writer: pre-stacked experts, bf16 biases, an unquantized router.
 */
#ifndef QKEEP_TESTS_MXFP4_FIXTURE_H
#define QKEEP_TESTS_MXFP4_FIXTURE_H

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "gpu_testutil.h"
#include "private.h"
#include "testutil.h"

/* gpt-oss's pre-stacked MXFP4 experts (gate_up_proj_blocks [E, 2I, H/32, 16] ...) with bf16 biases and a
 * router, in a directory of its own. Expert e's weights are scaled by 2^(4e - 4), so the e8m0 scales
 * of the three experts span a wide range. */
static inline char *mxfp4_write_gptoss(const char *dir, const char *name, uint64_t seed) {
  enum { GE = 3, GI = 96, GH = 160 }; /* 2 GI = 192 rows; K = GH = 160 (not a multiple of 64) */
  char *d = tu_path(dir, name);
  ck_assert_int_eq(mkdir(d, 0755), 0);
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  static const struct {
    const char *name;
    int64_t rows, cols;
  } mats[2] = {{"gate_up_proj", 2 * GI, GH}, {"down_proj", GH, GI}};
  for (int m = 0; m < 2; m++) {
    int64_t rows = mats[m].rows, cols = mats[m].cols;
    uint8_t *blocks = malloc((size_t)(GE * rows * cols / 2)), *sc = malloc((size_t)(GE * rows * cols / 32));
    uint16_t *bias = malloc((size_t)(GE * rows) * 2);
    for (int e = 0; e < GE; e++) {
      char tag[64];
      snprintf(tag, sizeof tag, "%s.%d", mats[m].name, e);
      float *v = gtu_random_matrix(tag, rows, cols, seed, ldexpf(1.0f, 4 * e - 4));
      ck_assert_int_eq(quant_mxfp4(v, rows, cols, blocks + e * rows * cols / 2, sc + e * rows * cols / 32),
                       0);
      free(v);
      for (int64_t r = 0; r < rows; r++)
        bias[e * rows + r] = qk_f32_to_bf16(0.01f * (float)((r + e + (int64_t)seed) % 7));
    }
    char tensor[128];
    struct qkeep_spec bs = {QKEEP_DTYPE_U8, 4, {GE, rows, cols / 32, 16}},
                      ss = {QKEEP_DTYPE_U8, 3, {GE, rows, cols / 32}}, bb = {QKEEP_DTYPE_BF16, 2, {GE, rows}};
    snprintf(tensor, sizeof tensor, "model.layers.0.mlp.experts.%s_blocks", mats[m].name);
    ck_assert_int_eq(st_writer_add(w, tensor, &bs, blocks), 0);
    snprintf(tensor, sizeof tensor, "model.layers.0.mlp.experts.%s_scales", mats[m].name);
    ck_assert_int_eq(st_writer_add(w, tensor, &ss, sc), 0);
    snprintf(tensor, sizeof tensor, "model.layers.0.mlp.experts.%s_bias", mats[m].name);
    ck_assert_int_eq(st_writer_add(w, tensor, &bb, bias), 0);
    free(blocks), free(sc), free(bias);
  }
  float *router = gtu_random_matrix("router", GE, GH, seed, 0.25f);
  struct qkeep_spec rs = {QKEEP_DTYPE_F32, 2, {GE, GH}};
  ck_assert_int_eq(st_writer_add(w, "model.layers.0.mlp.router.weight", &rs, router), 0);
  free(router);
  char *file = tu_path(d, "model.safetensors"), *config = tu_path(d, "config.json");
  ck_assert_int_eq(st_writer_write(w, file), 0);
  st_writer_free(w);
  const char *cfg = "{\"quantization_config\": {\"quant_method\": \"mxfp4\", \"modules_to_not_convert\": "
                    "[\"model.layers.*.mlp.router\"]}}";
  ck_assert_int_eq(tu_write_file(config, cfg, strlen(cfg)), 0);
  free(file), free(config);
  return d;
}

#endif
