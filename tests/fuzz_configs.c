// clang-format off
/*
 * fuzz_configs.c: libFuzzer target for the two text formats qkeep parses besides
 * safetensors headers: the INI config (config.c) and a checkpoint's quantization
 * config (config.json / hf_quant_config.json, quant_config.c). Not built by
 * default. Build it from the source root (after ./configure, for config.h):
 *
 *   clang -std=c11 -D_GNU_SOURCE -g -O1 -fsanitize=fuzzer,address,undefined -I libqkeep -I . -DPACKAGE_VERSION='"fuzz"' -DQKEEP_PLUGIN_DIR='"/nonexistent"' tests/fuzz_configs.c libqkeep/[a-z]*.c $(pkg-config --cflags --libs jansson inih libxxhash libpcre2-8) -ldl -lm -o fuzz_configs
 *
 * then run `./fuzz_configs -max_len=2048 CORPUS_DIR` (the .ini files in conf/ and the
 * examples' config.json files make a good seed corpus).
 *
 * The first byte picks the format: even, the rest is an INI file (written to a
 * temporary file and loaded); odd, the rest is config.json text, and after a
 * NUL byte, if any, hf_quant_config.json text. A parsed quantization config is
 * asked about a few module names. Rejecting an input is fine; crashing,
 * leaking or reading out of bounds is not.
 */
// clang-format on
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "private.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char tmp_path[64];

static void remove_tmp(void) {
  if (tmp_path[0])
    unlink(tmp_path);
}

static void fuzz_ini(const uint8_t *data, size_t size) {
  if (!tmp_path[0]) {
    snprintf(tmp_path, sizeof tmp_path, "/tmp/qkeep-fuzz-ini-XXXXXX");
    int fd = mkstemp(tmp_path);
    if (fd < 0)
      abort();
    close(fd);
    atexit(remove_tmp);
  }
  FILE *f = fopen(tmp_path, "wb");
  if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0)
    abort();
  qkeep_config *cfg = NULL;
  if (qkeep_config_load(tmp_path, &cfg) == 0)
    qkeep_config_free(cfg);
}

static void fuzz_quant_config(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1);
  if (!text)
    abort();
  memcpy(text, data, size);
  text[size] = 0;
  size_t first = strlen(text);
  const char *hf = first < size ? text + first + 1 : NULL;
  struct quant_config qc;
  memset(&qc, 0, sizeof qc);
  if (quant_config_parse(text, hf, "fuzz", &qc) == 0) {
    static const char *const modules[] = {"lm_head", "model.layers.0.self_attn.q_proj",
                                          "model.layers.1.mlp.experts.3.down_proj", "", "model"};
    for (size_t i = 0; i < sizeof modules / sizeof modules[0]; i++)
      (void)quant_config_ignores(&qc, modules[i]);
    quant_config_free(&qc);
  }
  free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  if (data[0] & 1)
    fuzz_quant_config(data + 1, size - 1);
  else
    fuzz_ini(data + 1, size - 1);
  return 0;
}
