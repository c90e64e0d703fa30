/*
 * bench_scale.c: cost per tensor at the tensor counts of real MoE models.
 * Writes synthetic ModelOpt NVFP4 checkpoints with Qwen3-MoE naming at toy
 * dimensions (128 experts per layer; 6, 48 and 192 decoder layers: about
 * 9k, 75k and 300k tensors, 75k being Qwen3-30B-A3B's count) and measures,
 * interleaved in each of RUNS runs (every size in every run), through the
 * configured backend:
 *   raw_read   opening W1 and reading every tensor's bytes (qkeep_checkpoint_read_all),
 *   cold       a cold start on W1 (open, assemble, load, PWAL),
 *   reload     an in-place reload W0 -> W1 as qkeep_model_reload runs it, validation included,
 *   census     qkeep_census of the loaded model;
 * medians after a warm-up, per tensor, and as ratios to the raw read, plus whether the
 * digest after the reload equals the cold start's. Then the header's memory:
 * the resident bytes ckpt_open adds (peak and kept) against the header's size.
 * Then how long a load takes to fail on a catastrophic ignore regex, and
 * last, one checkpoint of 10^6 tensors in 4 shards: its headers' memory, a
 * cold start and a census once (QKEEP_BENCH_MILLION=0 skips it). One JSON
 * object per line.
 *
 *   bench_scale [BACKEND] [RUNS] [LAYERS...]
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "private.h"
#include "synth_moe.h"
#include "testutil.h"

#define EXPERTS 128

static int make_dir(const char *path) { return mkdir(path, 0755); }

static int fail(const char *what) {
  fprintf(stderr, "bench_scale: %s: %s\n", what, qkeep_errmsg());
  return 1;
}

/* Resets VmHWM to the current RSS (Linux >= 4.0); false when the kernel refuses. */
static bool reset_peak(void) {
  FILE *f = fopen("/proc/self/clear_refs", "w");
  bool ok = f && fputs("5", f) >= 0;
  if (f)
    ok = fclose(f) == 0 && ok;
  return ok;
}

/* The header bytes of every .safetensors file of the checkpoint directory. */
static uint64_t header_bytes(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *e;
  uint64_t total = 0;
  while (d && (e = readdir(d))) {
    size_t len = strlen(e->d_name);
    if (len < 12 || strcmp(e->d_name + len - 12, ".safetensors") != 0)
      continue;
    char *path = tu_path(dir, e->d_name);
    FILE *f = fopen(path, "rb");
    unsigned char le[8] = {0};
    uint64_t n = 0;
    if (f && fread(le, 1, 8, f) == 8)
      for (int i = 7; i >= 0; i--)
        n = (n << 8) | le[i];
    if (f)
      fclose(f);
    free(path);
    total += n;
  }
  if (d)
    closedir(d);
  return total;
}

/* In a fresh process (this program, run as `bench_scale --header-memory DIR`), so that no freed
 * heap of earlier work hides the growth: the resident bytes opening the checkpoint adds, at its
 * peak and once it is open. Prints "PEAK KEPT". */
static int header_memory_child(const char *dir) {
  struct ckpt *ck;
  bool peak_ok = reset_peak();
  long long before = tu_status_bytes("VmRSS");
  if (ckpt_open(dir, &ck))
    return fail("opening the checkpoint");
  long long after = tu_status_bytes("VmRSS"), hwm = tu_status_bytes("VmHWM");
  printf("%lld %lld\n", peak_ok ? hwm - before : -1, after - before);
  ckpt_close(ck);
  return 0;
}

static int header_memory(const char *dir, long long *peak, long long *kept) {
  char *cmd = NULL;
  if (asprintf(&cmd, "/proc/%d/exe --header-memory '%s'", (int)getpid(), dir) < 0)
    return fail("out of memory");
  FILE *p = popen(cmd, "r");
  free(cmd);
  int got = p ? fscanf(p, "%lld %lld", peak, kept) : 0;
  if (p && pclose(p) == 0 && got == 2)
    return 0;
  fprintf(stderr, "bench_scale: measuring the header's memory failed\n");
  return 1;
}

static int load(qkeep_plugin *plugin, const char *dir, qkeep_model **out) {
  if (qkeep_model_new(plugin, out))
    return fail("a new model");
  if (qkeep_model_load(*out, dir))
    return fail("cold start");
  return 0;
}

static bool same_digest(const struct qkeep_digest *a, const struct qkeep_digest *b) {
  return a->hi == b->hi && a->lo == b->lo;
}

struct times {
  double raw[16], cold[16], reload[16], census[16];
  /* the parts of each, from qkeep_model_load_stats */
  double cold_open[16], cold_read[16], cold_pwal[16];
  double reload_open[16], reload_validate[16], reload_read[16], reload_pwal[16];
};

/* One run of the four measurements; *equal is cleared when a reload's digest differs from the cold start's.
 */
static int run_once(qkeep_plugin *plugin, const char *w0, const char *w1, qkeep_model *reloaded,
                    struct times *t, int r, bool *equal, int64_t *bytes) {
  double seconds, t0;
  if (qkeep_checkpoint_read_all(w1, bytes, &seconds))
    return fail("raw read");
  t->raw[r] = seconds;

  qkeep_model *cold;
  t0 = tu_now();
  if (load(plugin, w1, &cold))
    return 1;
  t->cold[r] = tu_now() - t0;
  struct qkeep_load_stats st = {.size = sizeof st};
  qkeep_model_load_stats(cold, &st);
  t->cold_open[r] = st.open_seconds, t->cold_read[r] = st.read_seconds, t->cold_pwal[r] = st.pwal_seconds;
  /* A census of a small model takes microseconds: repeat it for 50 ms at least, and divide. */
  struct qkeep_census census;
  int reps = 0;
  t0 = tu_now();
  do
    if (qkeep_census(cold, &census))
      return fail("census");
  while (++reps < 100000 && tu_now() - t0 < 0.05);
  t->census[r] = (tu_now() - t0) / reps;
  struct qkeep_digest d_cold, d_reload;
  if (qkeep_digest(cold, &d_cold))
    return fail("digest");
  qkeep_model_free(cold);

  t0 = tu_now();
  if (qkeep_model_reload(reloaded, w1, 0))
    return fail("reload W0 -> W1");
  t->reload[r] = tu_now() - t0;
  qkeep_model_load_stats(reloaded, &st);
  t->reload_open[r] = st.open_seconds, t->reload_validate[r] = st.validate_seconds;
  t->reload_read[r] = st.read_seconds, t->reload_pwal[r] = st.pwal_seconds;
  if (qkeep_digest(reloaded, &d_reload))
    return fail("digest");
  *equal = *equal && same_digest(&d_cold, &d_reload);
  if (qkeep_model_reload(reloaded, w0, 0)) /* back to W0 for the next run, untimed */
    return fail("reload W1 -> W0");
  return 0;
}

static double per_tensor_us(double seconds, size_t tensors) { return seconds * 1e6 / (double)tensors; }

/* One checkpoint size: its two checkpoints, the model that reloads between them, and its measurements. */
struct size_state {
  int layers;
  char *w0, *w1;
  size_t tensors;
  double write_s;
  qkeep_model *reloaded;
  struct times t;
  bool equal;
  int64_t bytes;
};

static int size_setup(qkeep_plugin *plugin, const char *tmp, struct size_state *z) {
  char name[64];
  snprintf(name, sizeof name, "w0-%d", z->layers);
  z->w0 = tu_path(tmp, name);
  snprintf(name, sizeof name, "w1-%d", z->layers);
  z->w1 = tu_path(tmp, name);
  z->tensors = synth_moe_tensors(z->layers, EXPERTS);
  z->equal = true;
  double t0 = tu_now();
  if (make_dir(z->w0) || make_dir(z->w1) || synth_moe_write(z->w0, z->layers, EXPERTS, 1, 1) ||
      synth_moe_write(z->w1, z->layers, EXPERTS, 1, 2))
    return fail("writing the checkpoints");
  z->write_s = tu_now() - t0;
  return load(plugin, z->w0, &z->reloaded);
}

static void size_free(struct size_state *z) {
  qkeep_model_free(z->reloaded);
  if (z->w0)
    tu_rmtree(z->w0);
  if (z->w1)
    tu_rmtree(z->w1);
  free(z->w0);
  free(z->w1);
}

/* The medians of one size; per_tensor gets cold, reload and census per tensor. */
static int size_report(const char *backend, struct size_state *z, int runs, double per_tensor[3]) {
  long long peak = 0, kept = 0;
  int rc = header_memory(z->w1, &peak, &kept);
  if (rc)
    return rc;
  struct times *t = &z->t;
  size_t tensors = z->tensors;
  double raw = tu_median(t->raw, runs), cold = tu_median(t->cold, runs), reload = tu_median(t->reload, runs),
         census = tu_median(t->census, runs);
  uint64_t header = header_bytes(z->w1);
  per_tensor[0] = per_tensor_us(cold, tensors);
  per_tensor[1] = per_tensor_us(reload, tensors);
  per_tensor[2] = per_tensor_us(census, tensors);
  printf("{\"bench\":\"scale\",\"backend\":\"%s\",\"scheme\":\"modelopt-nvfp4\",\"layers\":%d,\"experts\":%d,"
         "\"tensors\":%zu,\"checkpoint_bytes\":%lld,\"runs\":%d,\"write_s\":%.3f,"
         "\"raw_read_s\":%.4f,\"cold_s\":%.4f,\"reload_s\":%.4f,\"census_s\":%.6f,"
         "\"raw_read_us_per_tensor\":%.3f,\"cold_us_per_tensor\":%.3f,\"reload_us_per_tensor\":%.3f,"
         "\"census_us_per_tensor\":%.4f,\"reload_vs_raw\":%.3f,\"cold_vs_raw\":%.3f,\"reload_vs_cold\":%.3f,"
         "\"digest_equal\":%s,\"header_bytes\":%llu,\"header_peak_rss\":%lld,\"header_kept_rss\":%lld,"
         "\"header_peak_vs_bytes\":%.2f,\"cold_open_s\":%.4f,\"cold_read_s\":%.4f,\"cold_pwal_s\":%.4f,"
         "\"reload_open_s\":%.4f,\"reload_validate_s\":%.4f,\"reload_read_s\":%.4f,\"reload_pwal_s\":%.4f}\n",
         backend, z->layers, EXPERTS, tensors, (long long)z->bytes, runs, z->write_s, raw, cold, reload,
         census, per_tensor_us(raw, tensors), per_tensor[0], per_tensor[1], per_tensor[2], reload / raw,
         cold / raw, reload / cold, z->equal ? "true" : "false", (unsigned long long)header, peak, kept,
         header ? (double)peak / (double)header : 0.0, tu_median(t->cold_open, runs),
         tu_median(t->cold_read, runs), tu_median(t->cold_pwal, runs), tu_median(t->reload_open, runs),
         tu_median(t->reload_validate, runs), tu_median(t->reload_read, runs),
         tu_median(t->reload_pwal, runs));
  fflush(stdout);
  return 0;
}

/* 10^6 tensors: the header's memory, one cold start and one census. */
static int bench_million(qkeep_plugin *plugin, const char *backend, const char *tmp) {
  int layers = 651; /* 651 x 1536 + ... = 1.0e6 tensors */
  char *dir = tu_path(tmp, "million");
  size_t tensors = synth_moe_tensors(layers, EXPERTS);
  int rc = make_dir(dir) || synth_moe_write(dir, layers, EXPERTS, 4, 3) ? fail("writing the checkpoint") : 0;
  long long peak = 0, kept = 0;
  if (!rc)
    rc = header_memory(dir, &peak, &kept);
  qkeep_model *m = NULL;
  double t0 = tu_now(), cold = 0, census_s = 0;
  if (!rc && !(rc = load(plugin, dir, &m)))
    cold = tu_now() - t0;
  struct qkeep_census census;
  t0 = tu_now();
  if (!rc && qkeep_census(m, &census))
    rc = fail("census");
  census_s = tu_now() - t0;
  if (!rc) {
    uint64_t header = header_bytes(dir);
    printf("{\"bench\":\"scale_million\",\"backend\":\"%s\",\"layers\":%d,\"experts\":%d,\"tensors\":%zu,"
           "\"cold_s\":%.3f,\"census_s\":%.3f,\"cold_us_per_tensor\":%.3f,\"census_us_per_tensor\":%.3f,"
           "\"census_loader_params\":%lld,\"census_missing\":%lld,\"header_bytes\":%llu,"
           "\"header_peak_rss\":%lld,\"header_kept_rss\":%lld,\"header_peak_vs_bytes\":%.2f,"
           "\"header_kept_vs_bytes\":%.2f}\n",
           backend, layers, EXPERTS, tensors, cold, census_s, per_tensor_us(cold, tensors),
           per_tensor_us(census_s, tensors), (long long)census.loader_params, (long long)census.missing,
           (unsigned long long)header, peak, kept, header ? (double)peak / (double)header : 0.0,
           header ? (double)kept / (double)header : 0.0);
  }
  qkeep_model_free(m);
  tu_rmtree(dir);
  free(dir);
  return rc;
}

/* A catastrophic ignore pattern (on a 48-layer checkpoint): how long until the load fails, and its message.
 */
static int bench_regex(const char *tmp) {
  char *dir = tu_path(tmp, "regex");
  static const char hf[] = "{\"producer\": {\"name\": \"modelopt\"}, \"quantization\": {\"quant_algo\": "
                           "\"NVFP4\", \"group_size\": 16, \"exclude_modules\": [\"re:(.+.+)+_q$\"]}}";
  char *file = tu_path(dir, "hf_quant_config.json"), *cfg = tu_path(dir, "config.json");
  int rc = make_dir(dir) || synth_moe_write(dir, 48, EXPERTS, 1, 4) ? fail("writing the checkpoint") : 0;
  if (!rc && (tu_write_file(file, hf, strlen(hf)) || remove(cfg)))
    rc = fail("writing the config");
  qkeep_model *m = NULL;
  if (!rc && qkeep_model_new(NULL, &m))
    rc = fail("a new model");
  double t0 = tu_now();
  int load = rc ? 0 : qkeep_model_load(m, dir);
  double seconds = tu_now() - t0;
  if (!rc) {
    printf("{\"bench\":\"scale_regex\",\"pattern\":\"re:(.+.+)+_q$\",\"load_rc\":%d,\"error_s\":%.4f,"
           "\"message\":\"",
           load, seconds);
    for (const char *p = qkeep_errmsg(); *p; p++)
      printf(*p == '"' || *p == '\\' ? "\\%c" : "%c", *p);
    printf("\"}\n");
  }
  qkeep_model_free(m);
  tu_rmtree(dir);
  free(file);
  free(cfg);
  free(dir);
  return rc;
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "--header-memory") == 0)
    return header_memory_child(argv[2]);
  const char *backend = argc > 1 ? argv[1] : "reference";
  int runs = argc > 2 ? atoi(argv[2]) : 3;
  int sizes[16] = {6, 48, 192}, n_sizes = 3;
  if (argc > 3)
    for (n_sizes = 0; n_sizes < 16 && 3 + n_sizes < argc; n_sizes++)
      sizes[n_sizes] = atoi(argv[3 + n_sizes]);
  if (runs < 1 || runs > 16)
    runs = 3;
  const char *million = getenv("QKEEP_BENCH_MILLION");
  char *tmp = tu_tmpdir("bench-scale");
  qkeep_plugin *plugin;
  if (!tmp)
    return fail("a temporary directory");
  if (qkeep_plugin_open(backend, NULL, &plugin))
    return fail("opening the backend");
  double first[3] = {0}, last[3] = {0};
  struct size_state z[16] = {{0}};
  int rc = 0;
  for (int i = 0; i < n_sizes && !rc; i++) {
    z[i].layers = sizes[i];
    rc = size_setup(plugin, tmp, &z[i]);
  }
  /* Every size in every run, so that a change in the machine's load falls on all of them alike; run -1 warms
   * up (its times are overwritten by run 0). */
  for (int r = -1; r < runs && !rc; r++)
    for (int i = 0; i < n_sizes && !rc; i++)
      rc =
          run_once(plugin, z[i].w0, z[i].w1, z[i].reloaded, &z[i].t, r < 0 ? 0 : r, &z[i].equal, &z[i].bytes);
  for (int i = 0; i < n_sizes && !rc; i++)
    rc = size_report(backend, &z[i], runs, i == 0 ? first : last);
  for (int i = 0; i < n_sizes; i++)
    size_free(&z[i]);
  if (!rc && n_sizes > 1)
    printf(
        "{\"bench\":\"scale_growth\",\"backend\":\"%s\",\"from_layers\":%d,\"to_layers\":%d,"
        "\"cold_per_tensor_ratio\":%.3f,\"reload_per_tensor_ratio\":%.3f,\"census_per_tensor_ratio\":%.3f}\n",
        backend, sizes[0], sizes[n_sizes - 1], last[0] / first[0], last[1] / first[1], last[2] / first[2]);
  if (!rc)
    rc = bench_regex(tmp);
  if (!rc && !(million && strcmp(million, "0") == 0))
    rc = bench_million(plugin, backend, tmp);
  qkeep_plugin_close(plugin);
  tu_rmtree(tmp);
  free(tmp);
  return rc;
}
