/*
 * bench_reload.c: reload W0 -> W1 against a cold start on W1 and a raw read
 * of W1's bytes (the floor for any load), through the configured CPU backend
 * (default: reference), with the peak extra memory a reload needs against
 * the largest layer. One JSON object per line per scheme; medians of RUNS
 * runs after a warm-up, the three measurements interleaved, files in the
 * page cache for all three (the same conditions).
 *
 *   bench_reload [BACKEND] [LAYERS] [RUNS] [SCHEMES]
 *
 * BACKEND heads a chain that ends with the reference backend, so every scheme loads: with
 * cuda-nvfp4 (make bench-gpu) the NVFP4 layers are on the GPU and the reload is a device
 * reload. SCHEMES is a comma-separated subset of w8a8-int8,modelopt-nvfp4,gptq-int4.
 * QKEEP_BENCH_RINGS="SLOTS:PIECE:READERS:FENCES,..." measures each scheme once per device staging
 * ring shape (struct qkeep_load_options: stream_slots, stream_piece in bytes, stream_readers, and
 * FENCES 0 for stream_no_fences; an empty or missing field keeps the default), each with a model
 * loaded anew, and prints the shape in its line. QKEEP_BENCH_TRACE=1 logs the stream's trace of
 * every load (a line on stderr: where the calling thread waited). reload_over_raw_paired is the
 * median of each run's reload over the raw read next to it (steadier than the ratio of the medians
 * when the host's page-cache speed drifts).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "private.h"
#include "ring_options.h"
#include "testutil.h"

/* A Llama-shaped unquantized model: hidden 1024, intermediate 2816, `layers` decoder layers. */
static int write_source(const char *path, int layers, uint64_t seed) {
  enum { HID = 1024, KVD = 256, INTER = 2816, VOCAB = 8192 };
  struct st_writer *w;
  int rc = st_writer_new(&w);
  char name[128];
  float *buf = malloc((size_t)VOCAB * HID * sizeof *buf);
  struct {
    const char *fmt;
    int64_t rows, cols;
  } t[] = {{"model.layers.%d.self_attn.q_proj.weight", HID, HID},
           {"model.layers.%d.self_attn.k_proj.weight", KVD, HID},
           {"model.layers.%d.self_attn.v_proj.weight", KVD, HID},
           {"model.layers.%d.self_attn.o_proj.weight", HID, HID},
           {"model.layers.%d.mlp.gate_proj.weight", INTER, HID},
           {"model.layers.%d.mlp.up_proj.weight", INTER, HID},
           {"model.layers.%d.mlp.down_proj.weight", HID, INTER},
           {"model.layers.%d.input_layernorm.weight", HID, 0}};
  for (int l = -1; l < layers && !rc && buf; l++)
    for (size_t i = 0; i < (l < 0 ? 2 : sizeof t / sizeof t[0]) && !rc; i++) {
      int64_t rows = l < 0 ? VOCAB : t[i].rows, cols = l < 0 ? HID : t[i].cols;
      snprintf(name, sizeof name, l < 0 ? (i ? "lm_head.weight" : "model.embed_tokens.weight") : t[i].fmt, l);
      for (int64_t j = 0; j < rows * (cols ? cols : 1); j++)
        buf[j] = cols ? tu_randf(&seed) * 0.05f : 1.0f;
      struct qkeep_spec s = {QKEEP_DTYPE_F32, cols ? 2 : 1, {rows, cols}};
      rc = st_writer_add(w, name, &s, buf);
    }
  if (!rc)
    rc = st_writer_write(w, path);
  st_writer_free(w);
  free(buf);
  return rc;
}

static int64_t largest_layer(const qkeep_model *m) {
  int64_t best = 0;
  for (size_t l = 0; l < m->n_layers; l++) {
    int64_t bytes = 0;
    for (size_t i = 0; i < m->layers[l]->n_params; i++)
      bytes += (int64_t)m->layers[l]->params[i]->create_bytes;
    if (bytes > best)
      best = bytes;
  }
  return best;
}

static int fail(const char *what) {
  fprintf(stderr, "bench_reload: %s: %s: %s\n", what, qkeep_strerror(-1), qkeep_errmsg());
  return 1;
}

int main(int argc, char **argv) {
  const char *backend = argc > 1 ? argv[1] : "reference";
  int layers = argc > 2 ? atoi(argv[2]) : 4, runs = argc > 3 ? atoi(argv[3]) : 5;
  static const char *const schemes[] = {"w8a8-int8", "modelopt-nvfp4", "gptq-int4"};
  const char *wanted = argc > 4 ? argv[4] : NULL;
  const char *trace = getenv("QKEEP_BENCH_TRACE");
  if (trace && *trace && strcmp(trace, "0") != 0)
    tu_log_to_stderr(QKEEP_LOG_DEBUG);
  char *dir = tu_tmpdir("bench-reload");
  char *s0 = tu_path(dir, "w0.safetensors"), *s1 = tu_path(dir, "w1.safetensors");
  qkeep_plugin *chain[2] = {NULL, NULL};
  size_t n_chain = strcmp(backend, "reference") ? 2 : 1;
  if (!dir || write_source(s0, layers, 1) || write_source(s1, layers, 2))
    return fail("writing the source models");
  if (qkeep_plugin_open(backend, NULL, &chain[0]) ||
      (n_chain == 2 && qkeep_plugin_open("reference", NULL, &chain[1])))
    return fail("opening the backend");
  for (size_t si = 0; si < sizeof schemes / sizeof schemes[0]; si++) {
    if (wanted && !strstr(wanted, schemes[si]))
      continue;
    char q0[64], q1[64];
    snprintf(q0, sizeof q0, "%s-w0", schemes[si]);
    snprintf(q1, sizeof q1, "%s-w1", schemes[si]);
    char *w0 = tu_path(dir, q0), *w1 = tu_path(dir, q1);
    struct qkeep_quantize_options o = {.size = sizeof o, .scheme = schemes[si], .kv_cache_scales = true};
    if (qkeep_quantize(s0, w0, &o) || qkeep_quantize(s1, w1, &o))
      return fail("quantizing");
    const char *rings = getenv("QKEEP_BENCH_RINGS");
    for (const char *ring = rings && *rings ? rings : NULL;; ring = strchr(ring, ',') + 1) {
      char ring_label[64];
      struct qkeep_load_options shape = ring_options(ring, ring_label, sizeof ring_label);
      qkeep_model *m;
      if (qkeep_model_new_chain(chain, n_chain, &m) || qkeep_model_set_load_options(m, &shape) ||
          qkeep_model_load(m, w0))
        return fail("loading W0");
      double cold[64], reload[64], raw[64], paired[64], phase[4][64]; /* phases: open, validate, read, PWAL */
      int64_t raw_bytes = 0, peak_extra = 0;
      for (int r = -1; r < runs && r < 64; r++) { /* r = -1: warm-up */
        qkeep_model *c;
        double t0 = tu_now();
        if (qkeep_model_new_chain(chain, n_chain, &c) || qkeep_model_set_load_options(c, &shape) ||
            qkeep_model_load(c, w1))
          return fail("cold start");
        double t1 = tu_now();
        qkeep_model_free(c);
        struct qkeep_memory_stats mem = {.size = sizeof mem};
        qkeep_model_memory(m, &mem, true);
        double t2 = tu_now();
        if (qkeep_model_reload(m, r % 2 ? w0 : w1, 0))
          return fail("reload");
        double t3 = tu_now();
        struct qkeep_load_stats st = {.size = sizeof st};
        qkeep_model_load_stats(m, &st);
        struct qkeep_memory_stats after = {.size = sizeof after};
        qkeep_model_memory(m, &after, false);
        int64_t extra = after.storage_peak - mem.storage_bytes + after.staging_peak;
        if (extra > peak_extra)
          peak_extra = extra;
        double t_raw;
        if (qkeep_checkpoint_read_all(w1, &raw_bytes, &t_raw))
          return fail("raw read");
        if (r >= 0) {
          cold[r] = t1 - t0;
          reload[r] = t3 - t2;
          raw[r] = t_raw;
          paired[r] = (t3 - t2) / t_raw;
          phase[0][r] = st.open_seconds, phase[1][r] = st.validate_seconds;
          phase[2][r] = st.read_seconds, phase[3][r] = st.pwal_seconds;
        }
      }
      double mc = tu_median(cold, runs), mr = tu_median(reload, runs), mw = tu_median(raw, runs);
      printf("{\"bench\":\"reload\",\"backend\":\"%s\",\"scheme\":\"%s\",\"layers\":%d,\"checkpoint_bytes\":%"
             "lld,"
             "\"runs\":%d,\"cold_ms\":%.2f,\"reload_ms\":%.2f,\"peer\":\"raw_read\",\"raw_read_ms\":%.2f,"
             "\"cold_over_reload\":%.2f,\"reload_over_raw\":%.2f,\"peak_extra_bytes\":%lld,\"largest_layer_"
             "bytes\":%lld,"
             "\"extra_over_largest_layer\":%.3f,\"reload_open_ms\":%.2f,\"reload_validate_ms\":%.2f,"
             "\"reload_read_ms\":%.2f,\"reload_pwal_ms\":%.2f,\"reload_over_raw_paired\":%.2f,\"ring\":\"%"
             "s\"}\n",
             backend, schemes[si], layers, (long long)raw_bytes, runs, 1e3 * mc, 1e3 * mr, 1e3 * mw, mc / mr,
             mr / mw, (long long)peak_extra, (long long)largest_layer(m),
             (double)peak_extra / (double)largest_layer(m), 1e3 * tu_median(phase[0], runs),
             1e3 * tu_median(phase[1], runs), 1e3 * tu_median(phase[2], runs),
             1e3 * tu_median(phase[3], runs), tu_median(paired, runs), ring_label);
      fflush(stdout);
      qkeep_model_free(m);
      if (!ring || !strchr(ring, ','))
        break;
    }
    free(w0);
    free(w1);
  }
  qkeep_plugin_close(chain[0]);
  qkeep_plugin_close(chain[1]);
  tu_rmtree(dir);
  free(dir), free(s0), free(s1);
  return 0;
}
