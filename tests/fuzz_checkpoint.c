// clang-format off
/*
 * fuzz_checkpoint.c: libFuzzer target for the whole load of a checkpoint
 * directory: the files, model assembly (fusion, MoE, kv scales, tied
 * embeddings), each scheme's checks and normalisation, the reference
 * backend's PWAL, the census, the forward check and a reload of the same
 * checkpoint. Build it from the source root after ./configure (for config.h),
 * with the reference backend built the same way beside it:
 *
 *   F='-std=c11 -D_GNU_SOURCE -g -O1 -fsanitize=address,undefined -I libqkeep -I . -DPACKAGE_VERSION="fuzz" -DQKEEP_PLUGIN_DIR="/nonexistent"'
 *   clang $F -fsanitize=fuzzer-no-link -shared -fPIC plugins/cpu/reference.c -lm -o DIR/backend-reference.so
 *   clang $F -fsanitize=fuzzer tests/fuzz_checkpoint.c libqkeep/[a-z]*.c $(pkg-config --cflags --libs jansson inih libxxhash libpcre2-8) -ldl -lm -o fuzz_checkpoint
 *
 * then `QKEEP_PLUGIN_PATH=DIR ./fuzz_checkpoint -max_len=65536 CORPUS_DIR`; tests/fuzz_seeds
 * writes a seed corpus (a small model in every scheme). tests/fuzz_smoke.sh does all of it.
 *
 * Input: two little-endian 16-bit lengths, then config.json (that many bytes; none when
 * 0), hf_quant_config.json (likewise), and the rest is model.safetensors. Rejecting an
 * input is fine. Not fine, besides crashes, leaks and out-of-bounds access: a failure
 * without a message, a checkpoint that loads once but not twice or to another digest, a
 * census that is not clean, a forward check that differs between two loads on the same
 * backend, and a reload of the very checkpoint that loaded being refused or changing the
 * digest (cold start and reload must accept the same tensors).
 */
// clang-format on
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "qkeep/qkeep.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char tmp_dir[64];
static char path_cfg[96], path_hf[96], path_st[96];
static qkeep_plugin *reference;

static void remove_tmp(void) {
  unlink(path_cfg);
  unlink(path_hf);
  unlink(path_st);
  rmdir(tmp_dir);
  qkeep_plugin_close(reference);
}

static void init_once(void) {
  if (tmp_dir[0])
    return;
  const char *tmpdir = getenv("TMPDIR");
  snprintf(tmp_dir, sizeof tmp_dir, "%s/qkeep-fuzz-ck-XXXXXX",
           tmpdir && strlen(tmpdir) < 32 ? tmpdir : "/tmp");
  if (!mkdtemp(tmp_dir)) {
    perror("mkdtemp");
    abort();
  }
  snprintf(path_cfg, sizeof path_cfg, "%s/config.json", tmp_dir);
  snprintf(path_hf, sizeof path_hf, "%s/hf_quant_config.json", tmp_dir);
  snprintf(path_st, sizeof path_st, "%s/model.safetensors", tmp_dir);
  if (qkeep_plugin_open("reference", NULL, &reference) != 0) {
    fprintf(stderr, "fuzz_checkpoint: %s (set QKEEP_PLUGIN_PATH to the reference backend's directory)\n",
            qkeep_errmsg());
    abort();
  }
  atexit(remove_tmp);
}

/* Writes the file, or removes it when n is 0 (absent). */
static void put(const char *path, const uint8_t *bytes, size_t n, bool always) {
  unlink(path);
  if (!n && !always)
    return;
  FILE *f = fopen(path, "wb");
  if (!f || (n && fwrite(bytes, 1, n, f) != n) || fclose(f) != 0)
    abort();
}

static bool same(struct qkeep_digest a, struct qkeep_digest b) { return a.hi == b.hi && a.lo == b.lo; }

/* A failed call must say why. */
static void explained(int rc) {
  if (rc != 0 && qkeep_errmsg()[0] == '\0')
    abort();
}

static int record(void *user, const struct qkeep_layer_error *e) {
  double *worst = user;
  /* Both models run the reference backend on the same bytes: the outputs agree exactly (NaN too). */
  if (!(e->max_abs == 0) && !(e->max_abs != e->max_abs))
    abort();
  *worst = e->max_abs;
  return 0;
}

static qkeep_model *load(void) {
  qkeep_model *m;
  if (qkeep_model_new(reference, &m) != 0)
    abort();
  int rc = qkeep_model_load(m, tmp_dir);
  explained(rc);
  if (rc) {
    if (qkeep_model_layer_count(m) != 0)
      abort(); /* nothing half-loaded stays behind */
    qkeep_model_free(m);
    return NULL;
  }
  return m;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  init_once();
  if (size < 4)
    return 0;
  size_t n_cfg = (size_t)data[0] | (size_t)data[1] << 8, n_hf = (size_t)data[2] | (size_t)data[3] << 8;
  data += 4, size -= 4;
  if (n_cfg > size || n_hf > size - n_cfg)
    return 0;
  put(path_cfg, data, n_cfg, false);
  put(path_hf, data + n_cfg, n_hf, false);
  put(path_st, data + n_cfg + n_hf, size - n_cfg - n_hf, true);

  qkeep_model *m = load();
  if (!m)
    return 0;
  qkeep_model *again = load();
  if (!again)
    abort(); /* loaded once, refused the second time */
  struct qkeep_digest d, d2;
  struct qkeep_census c;
  if (qkeep_digest(m, &d) || qkeep_digest(again, &d2) || !same(d, d2))
    abort();
  c.size = sizeof c;
  if (qkeep_census(m, &c) || c.missing || c.c1 || c.c2)
    abort();
  double worst = 0;
  int rc = qkeep_compare(m, again, 2, 7, record, &worst);
  explained(rc);
  /* The same checkpoint as a reload: every tensor the cold start took, and nothing else. */
  rc = qkeep_model_reload(m, tmp_dir, 0);
  if (rc) {
    fprintf(stderr, "fuzz_checkpoint: the cold start took it, the reload refused it: %s\n", qkeep_errmsg());
    abort();
  }
  if (qkeep_digest(m, &d2) || !same(d, d2))
    abort();
  qkeep_model_free(again);
  qkeep_model_free(m);
  return 0;
}
