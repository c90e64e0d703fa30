/*
 * bench_hostile.c: what hostile names and configs cost, each as a ratio to an ordinary peer of the
 * same size measured in the same run (medians of RUNS, interleaved):
 *   names    inserting and finding N tensor names aimed at the unseeded XXH3 the name index used
 *            (their hashes share the low bits of the table's size, so all had one home slot),
 *            against N ordinary names;
 *   dynamic  a GPTQ config with one `dynamic` rule per layer (94 layers of 128 experts, every module
 *            asked about three times as assembly does), against the same config without rules;
 *   mixed    a ModelOpt MIXED_PRECISION config listing 24,576 quantized layers in both files, parsed
 *            and asked about every module, against a plain NVFP4 config asked the same;
 *   budget   how long 1,000 `re:` ignore entries, each just under the per-match limit, take to be
 *            refused on one module (one run).
 * One JSON object per line.
 *
 *   bench_hostile [RUNS] [NAMES]   (NAMES 6000 by default: aiming each costs about the table's size in
 *                                   hashes, 8192 of them at 6000)
 */
#define XXH_INLINE_ALL
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "private.h"

static void die(const char *what) {
  fprintf(stderr, "bench_hostile: %s: %s\n", what, qkeep_errmsg());
  exit(1);
}

static int by_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, by_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ---- names ------------------------------------------------------------------------------- */

static char **make_names(size_t n, bool aimed) {
  size_t slots = 16;
  while (n > slots / 4 * 3)
    slots *= 2;
  char **names = calloc(n, sizeof *names), buf[96];
  unsigned counter = 0;
  for (size_t i = 0; i < n; i++) {
    if (aimed)
      do
        snprintf(buf, sizeof buf, "model.t%u.weight", counter++);
      while ((XXH3_64bits(buf, strlen(buf)) & (slots - 1)) != 0);
    else
      snprintf(buf, sizeof buf, "model.layers.%zu.mlp.experts.%zu.weight", i / 384, i % 384);
    if (!(names[i] = strdup(buf)))
      die("out of memory");
  }
  return names;
}

static double time_names(char **names, size_t n) {
  double t0 = now_seconds();
  struct name_index ix = {0};
  size_t v;
  for (size_t i = 0; i < n; i++)
    if (name_index_put(&ix, names[i], i, NULL) != 0)
      die("name_index_put");
  for (size_t i = 0; i < n; i++)
    if (!name_index_get(&ix, names[i], &v) || v != i)
      die("name_index_get");
  double t = now_seconds() - t0;
  name_index_clear(&ix);
  return t;
}

/* ---- configs ------------------------------------------------------------------------------ */

enum { LAYERS = 94, EXPERTS = 128, MIXED = 24576 };

static const char *const projs[] = {"gate_proj", "up_proj", "down_proj"};

static char *gptq_config(bool rules) {
  size_t cap = 256 + (size_t)LAYERS * 64;
  char *text = malloc(cap), *at = text;
  at +=
      sprintf(at, "{\"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 4, \"group_size\": 128, "
                  "\"dynamic\": {");
  for (int l = 0; rules && l < LAYERS; l++)
    at += sprintf(at, "%s\"+:model\\\\.layers\\\\.%d\\\\..*\": {\"group_size\": 32}", l ? ", " : "", l);
  sprintf(at, "}}}");
  return text;
}

static double time_dynamic(const char *text) {
  double t0 = now_seconds();
  struct quant_config qc, mod;
  if (quant_config_parse(text, NULL, "bench", &qc) != 0)
    die("quant_config_parse");
  quant_config_budget_for(&qc, (size_t)LAYERS * EXPERTS * 3 * 4);
  char name[96];
  for (int pass = 0; pass < 3; pass++)
    for (int l = 0; l < LAYERS; l++)
      for (int e = 0; e < EXPERTS * 3; e++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s", l, e / 3, projs[e % 3]);
        if (quant_config_for_module(&qc, name, &mod) != 0)
          die("quant_config_for_module");
      }
  quant_config_free(&qc);
  return now_seconds() - t0;
}

/* config.json and hf_quant_config.json, MIXED_PRECISION over MIXED layers or plain NVFP4. */
static void modelopt_configs(bool mixed, char **cfg, char **hf) {
  const char *value = ": {\"quant_algo\": \"NVFP4\", \"group_size\": 16}";
  size_t cap = 512 + (size_t)MIXED * 96;
  char *list = malloc(cap), *at = list;
  *list = '\0';
  for (int i = 0; mixed && i < MIXED; i++)
    at += sprintf(at, "%s\"model.layers.%d.mlp.experts.%d.%s\"%s", i ? ", " : "", i / 384, (i % 384) / 3,
                  projs[i % 3], value);
  const char *algo = mixed ? "MIXED_PRECISION" : "NVFP4";
  *cfg = malloc(cap + 256);
  *hf = malloc(cap + 256);
  sprintf(*cfg, "{\"quantization_config\": {\"quant_method\": \"modelopt\", \"quant_algo\": \"%s\"%s%s%s}}",
          algo, mixed ? ", \"quantized_layers\": {" : "", list, mixed ? "}" : "");
  sprintf(*hf, "{\"producer\": {\"name\": \"modelopt\"}, \"quantization\": {\"quant_algo\": \"%s\"%s%s%s}}",
          algo, mixed ? ", \"quantized_layers\": {" : "", list, mixed ? "}" : "");
  free(list);
}

static double time_mixed(const char *cfg, const char *hf) {
  double t0 = now_seconds();
  struct quant_config qc;
  if (quant_config_parse(cfg, hf, "bench", &qc) != 0)
    die("quant_config_parse");
  char name[96];
  bool ignored;
  for (int i = 0; i < MIXED; i++) {
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s", i / 384, (i % 384) / 3, projs[i % 3]);
    if (quant_config_match_ignore(&qc, name, &ignored) != 0)
      die("quant_config_match_ignore");
  }
  quant_config_free(&qc);
  return now_seconds() - t0;
}

static double time_budget(void) {
  char *text = malloc(64 * 1024), *at = text;
  at += sprintf(at, "{\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": "
                    "\"nvfp4-pack-quantized\", \"ignore\": [");
  for (int i = 0; i < 1000; i++)
    at += sprintf(at, "%s\"re:(?:x+x+)+y(?#%d)\"", i ? ", " : "", i);
  sprintf(at, "]}}");
  struct quant_config qc;
  if (quant_config_parse(text, NULL, "bench", &qc) != 0)
    die("quant_config_parse");
  bool ignored;
  double t0 = now_seconds();
  int rc = quant_config_match_ignore(&qc, "xxxxxxxxxxxxxxxxxxx.y_proj", &ignored);
  double t = now_seconds() - t0;
  if (rc != QKEEP_E_FORMAT)
    die("1,000 hostile entries were not refused");
  quant_config_free(&qc);
  free(text);
  return t;
}

int main(int argc, char **argv) {
  int runs = argc > 1 ? atoi(argv[1]) : 5;
  size_t n = argc > 2 ? (size_t)strtoull(argv[2], NULL, 10) : 6000;
  if (runs < 1 || runs > 1000 || n < 1 || n > 1000000) {
    fprintf(stderr, "usage: bench_hostile [RUNS 1..1000] [NAMES 1..1000000]\n");
    return 2;
  }
  char **ordinary = make_names(n, false), **aimed = make_names(n, true);
  char *with_rules = gptq_config(true), *without = gptq_config(false), *mcfg, *mhf, *pcfg, *phf;
  modelopt_configs(true, &mcfg, &mhf);
  modelopt_configs(false, &pcfg, &phf);
  double *t = calloc((size_t)runs * 6, sizeof *t);
  for (int r = 0; r < runs; r++) {
    t[0 * runs + r] = time_names(aimed, n);
    t[1 * runs + r] = time_names(ordinary, n);
    t[2 * runs + r] = time_dynamic(with_rules);
    t[3 * runs + r] = time_dynamic(without);
    t[4 * runs + r] = time_mixed(mcfg, mhf);
    t[5 * runs + r] = time_mixed(pcfg, phf);
  }
  double m[6];
  for (int i = 0; i < 6; i++)
    m[i] = median(t + i * runs, runs);
  printf("{\"bench\":\"hostile\",\"case\":\"names\",\"names\":%zu,\"aimed_s\":%.4f,\"ordinary_s\":%.4f,"
         "\"ratio\":%.2f,\"runs\":%d}\n",
         n, m[0], m[1], m[0] / m[1], runs);
  printf("{\"bench\":\"hostile\",\"case\":\"dynamic\",\"rules\":%d,\"modules\":%d,\"with_rules_s\":%.4f,"
         "\"without_s\":%.4f,\"ratio\":%.2f,\"runs\":%d}\n",
         LAYERS, LAYERS * EXPERTS * 3, m[2], m[3], m[2] / m[3], runs);
  printf(
      "{\"bench\":\"hostile\",\"case\":\"mixed\",\"quantized_layers\":%d,\"mixed_s\":%.4f,\"plain_s\":%.4f,"
      "\"ratio\":%.2f,\"runs\":%d}\n",
      MIXED, m[4], m[5], m[4] / m[5], runs);
  printf("{\"bench\":\"hostile\",\"case\":\"budget\",\"entries\":1000,\"refused_after_s\":%.4f}\n",
         time_budget());
  for (size_t i = 0; i < n; i++) {
    free(ordinary[i]);
    free(aimed[i]);
  }
  free(ordinary), free(aimed), free(with_rules), free(without), free(mcfg), free(mhf), free(pcfg), free(phf);
  free(t);
  return 0;
}
