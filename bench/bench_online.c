/*
 * bench_online.c: online quantization (qkeep_model_set_quantize) against the offline path. Writes a
 * synthetic bf16 checkpoint of a Llama-shaped model (hidden 1024, MLP 2816, GQA 4:1, vocab 8000, as
 * many decoder layers as reach SIZE_MB) into a fresh temporary directory, then for w8a8-int8 and
 * gptq-int4, in each of RUNS runs (after a warm-up), interleaved:
 *   quantize   qkeep_quantize of the checkpoint into a directory (the offline quantizer);
 *   cold       a cold start of that directory on the configured default chain;
 *   online     a cold start of the bf16 checkpoint quantizing on load, same chain and options;
 *   reload     the online model reloaded from the bf16 checkpoint (quantized in place), and the cold
 *              start's model reloaded from qkeep quantize's output (what a loop that quantizes each new
 *              checkpoint offline reloads).
 * Every online model's digest is checked against the offline one's (identical: true). Per scheme
 * the medians, the online load's input rate against the offline quantizer's, the ratio of
 * quantize + cold start to the online load (> 1: quantizing on load is the faster way to a running
 * model), and its inverse as the target for the online path is stated: online_over_quantize_and_cold,
 * the online load's time over the offline quantizer's plus a cold start of its output (target: at
 * most 1.5), the median of each run's own ratio (the three timed back to back, so a slow moment of a
 * shared machine weighs on both sides of one ratio); and for a reload,
 * online_reload_over_quantize_and_reload, the online reload's time over the offline quantizer's plus the
 * reload of its output, likewise. One JSON object per line. The temporary directory is removed at the end.
 *
 *   bench_online [SIZE_MB [RUNS [THREADS]]]      defaults: 96 7 (every online core)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "private.h"
#include "testutil.h"

#define HIDDEN 1024
#define MLP 2816
#define KV 256
#define VOCAB 8000
#define MAX_RUNS 16

static const char *const schemes[] = {"w8a8-int8", "gptq-int4"};
#define N_SCHEMES (sizeof schemes / sizeof schemes[0])

static void die(const char *what) {
  fprintf(stderr, "bench_online: %s: %s\n", what, qkeep_errmsg());
  exit(1);
}

static void add(struct st_writer *w, const char *name, int64_t n, int64_t k, uint64_t *seed) {
  size_t count = (size_t)(n * (k ? k : 1));
  uint16_t *v = malloc(count * 2);
  if (!v)
    die("out of memory");
  for (size_t i = 0; i < count; i++)
    v[i] = qkeep_f32_to_bf16(tu_randf(seed) * 0.05f);
  struct qkeep_spec s = {.dtype = QKEEP_DTYPE_BF16, .ndim = k ? 2 : 1, .shape = {n, k}};
  if (st_writer_add(w, name, &s, v))
    die(name);
  free(v);
}

/* The model: as many decoder layers as fit size bytes (at least one). */
static int64_t write_model(const char *path, int64_t size) {
  struct st_writer *w;
  if (st_writer_new(&w))
    die("st_writer_new");
  uint64_t seed = 1;
  int64_t per_layer = 2 * (2 * HIDDEN * HIDDEN + 2 * KV * HIDDEN + 3 * MLP * HIDDEN + 2 * HIDDEN);
  int64_t layers = (size - 4 * VOCAB * HIDDEN) / per_layer, bytes = 4 * VOCAB * HIDDEN + 2 * HIDDEN;
  layers = layers < 1 ? 1 : layers;
  char name[128];
  add(w, "model.embed_tokens.weight", VOCAB, HIDDEN, &seed);
  add(w, "lm_head.weight", VOCAB, HIDDEN, &seed);
  add(w, "model.norm.weight", HIDDEN, 0, &seed);
  for (int64_t l = 0; l < layers; l++) {
    static const struct {
      const char *name;
      int64_t n, k;
    } t[] = {{"self_attn.q_proj", HIDDEN, HIDDEN},   {"self_attn.k_proj", KV, HIDDEN},
             {"self_attn.v_proj", KV, HIDDEN},       {"self_attn.o_proj", HIDDEN, HIDDEN},
             {"mlp.gate_proj", MLP, HIDDEN},         {"mlp.up_proj", MLP, HIDDEN},
             {"mlp.down_proj", HIDDEN, MLP},         {"input_layernorm", HIDDEN, 0},
             {"post_attention_layernorm", HIDDEN, 0}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
      snprintf(name, sizeof name, "model.layers.%lld.%s.weight", (long long)l, t[i].name);
      add(w, name, t[i].n, t[i].k, &seed);
    }
    bytes += per_layer;
  }
  if (st_writer_write(w, path))
    die(path);
  st_writer_free(w);
  return bytes;
}

struct plugins {
  qkeep_plugin **plugins;
  size_t n;
};

static qkeep_model *load(const struct plugins *c, const char *path,
                         const struct qkeep_quantize_options *online) {
  qkeep_model *m;
  if (qkeep_model_new_chain(c->plugins, c->n, &m) || (online && qkeep_model_set_quantize(m, online)) ||
      qkeep_model_load(m, path))
    die(path);
  return m;
}

static double median(double *v, int n) { return tu_median(v, n); }

int main(int argc, char **argv) {
  int64_t size_mb = argc > 1 ? atoll(argv[1]) : 96;
  int runs = argc > 2 ? atoi(argv[2]) : 7, threads = argc > 3 ? atoi(argv[3]) : 0;
  if (size_mb < 1 || runs < 1 || runs > MAX_RUNS || threads < 0) {
    fprintf(stderr, "usage: bench_online [SIZE_MB [RUNS (1-16) [THREADS]]]\n");
    return 2;
  }
  char *conf = tu_path(tu_builddir(), "conf/qkeep.ini");
  qkeep_config *cfg;
  struct plugins chain;
  if (qkeep_config_load(conf, &cfg) || qkeep_plugins_open_config(cfg, &chain.plugins, &chain.n))
    die(conf);
  const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
  char *dir = tu_path(base, "qkeep-bench-online-XXXXXX");
  if (!mkdtemp(dir))
    die("a temporary directory");
  char *model = tu_path(dir, "model.safetensors"), *out = tu_path(dir, "out");
  int64_t bytes = write_model(model, size_mb << 20);
  printf("{\"bench\":\"online_input\",\"bytes\":%lld,\"online_cores\":%ld}\n", (long long)bytes,
         sysconf(_SC_NPROCESSORS_ONLN));
  fflush(stdout);
  for (size_t s = 0; s < N_SCHEMES; s++) {
    struct qkeep_quantize_options o = {.size = sizeof o, .scheme = schemes[s], .threads = threads};
    double quantize[MAX_RUNS], cold[MAX_RUNS], online[MAX_RUNS], over[MAX_RUNS];
    double online_reload[MAX_RUNS], cold_reload[MAX_RUNS], reload_over[MAX_RUNS];
    bool identical = true;
    for (int r = -1; r < runs; r++) { /* run -1: the warm-up */
      double t0 = tu_now();
      if (qkeep_quantize(model, out, &o))
        die("qkeep_quantize");
      double t1 = tu_now();
      qkeep_model *offline = load(&chain, out, NULL);
      double t2 = tu_now();
      qkeep_model *on = load(&chain, model, &o);
      double t3 = tu_now();
      struct qkeep_digest a, b;
      if (qkeep_digest(offline, &a) || qkeep_digest(on, &b))
        die("qkeep_digest");
      identical &= a.hi == b.hi && a.lo == b.lo;
      double t4 = tu_now();
      if (qkeep_model_reload(on, model, 0))
        die("the online reload");
      double t5 = tu_now();
      if (qkeep_model_reload(offline, out, 0))
        die("the reload of qkeep quantize's output");
      double t6 = tu_now();
      if (qkeep_digest(offline, &a) || qkeep_digest(on, &b))
        die("qkeep_digest");
      identical &= a.hi == b.hi && a.lo == b.lo;
      qkeep_model_free(offline);
      qkeep_model_free(on);
      tu_rmtree(out);
      if (r >= 0) {
        quantize[r] = t1 - t0, cold[r] = t2 - t1, online[r] = t3 - t2, over[r] = online[r] / (t2 - t0);
        online_reload[r] = t5 - t4, cold_reload[r] = t6 - t5;
        reload_over[r] = online_reload[r] / (quantize[r] + cold_reload[r]);
      }
    }
    double q = median(quantize, runs), c = median(cold, runs), n = median(online, runs);
    double nr = median(online_reload, runs), cr = median(cold_reload, runs);
    printf("{\"bench\":\"online\",\"scheme\":\"%s\",\"bytes\":%lld,\"runs\":%d,\"quantize_s\":%.4f,"
           "\"cold_s\":%.4f,\"online_s\":%.4f,\"quantize_mb_per_s\":%.1f,\"online_mb_per_s\":%.1f,"
           "\"online_vs_quantize\":%.3f,\"online_vs_quantize_then_load\":%.3f,"
           "\"online_over_quantize_and_cold\":%.3f,\"online_reload_s\":%.4f,\"cold_reload_s\":%.4f,"
           "\"online_reload_over_quantize_and_reload\":%.3f,\"identical\":%s}\n",
           schemes[s], (long long)bytes, runs, q, c, n, (double)bytes / q / 1e6, (double)bytes / n / 1e6,
           q / n, (q + c) / n, median(over, runs), nr, cr, median(reload_over, runs),
           identical ? "true" : "false");
    fflush(stdout);
  }
  tu_rmtree(dir);
  free(model), free(out), free(dir), free(conf);
  qkeep_plugins_close(chain.plugins, chain.n);
  qkeep_config_free(cfg);
  return 0;
}
