/*
 * bench_int8.c: the cpu-onednn int8 linear layer (what apply runs: dynamic
 * per-token activation quantisation, the packed s8 GEMM, the epilogue)
 * against oneDNN f32 with packed weights, PyTorch's int8 dynamic-quantized
 * linear (bench/peer_torch.py, run with /usr/bin/python3) and a memory
 * bandwidth ceiling, at M = 1, 16, 128, 512 for K x N = 4096 x 4096,
 * 4096 x 14336 and 14336 x 4096. One JSON object per line.
 *
 * Weights are out of cache, as in decode: each side cycles through enough
 * copies of its weights to exceed twice the last-level cache. qkeep and the
 * f32 peer run interleaved in this process on the same activations; the
 * torch peer runs right after, in its own process. Times are medians of
 * `runs` timed calls after warm-up. The ceiling is the weight bytes over the
 * copy bandwidth measured here with the same threads (memcpy, bytes read
 * plus written, as docs/PERFORMANCE.md measures it): streaming weights only
 * reads, so a kernel can come in under it (ceiling_ratio < 1).
 *
 *   bench_int8 [THREADS]     (default: $QKEEP_BENCH_THREADS, else every online CPU;
 *                             $QKEEP_BENCH_PYTHON: the torch peer's interpreter, default /usr/bin/python3)
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <oneapi/dnnl/dnnl.h>

#define BENCH_NAME "bench_int8"
#include "benchutil.h"
#include "testutil.h"

/* ---- the torch peer ------------------------------------------------------------------------- */

struct torch_row {
  int64_t m;
  double us;
};

/* Runs bench/peer_torch.py for one shape; fills rows (us < 0 where missing) and the reason it was skipped. */
static void torch_peer(int64_t k, int64_t n, const int64_t *ms, int n_ms, int threads, size_t min_bytes,
                       double *us, char *skipped, size_t skipped_len) {
  for (int i = 0; i < n_ms; i++)
    us[i] = -1;
  skipped[0] = 0;
  char cmd[4096], list[64] = "";
  for (int i = 0; i < n_ms; i++)
    snprintf(list + strlen(list), sizeof list - strlen(list), "%s%lld", i ? "," : "", (long long)ms[i]);
  /* Debian's python3-torch lives under /usr/bin/python3; QKEEP_BENCH_PYTHON names another interpreter. */
  const char *python = getenv("QKEEP_BENCH_PYTHON");
  snprintf(cmd, sizeof cmd,
           "'%s' '%s/bench/peer_torch.py' --k %lld --n %lld --ms %s --threads %d --min-bytes %zu 2>&1",
           python && *python ? python : "/usr/bin/python3", tu_srcdir(), (long long)k, (long long)n, list,
           threads, min_bytes);
  FILE *p = popen(cmd, "r");
  if (!p) {
    snprintf(skipped, skipped_len, "cannot run %s", python && *python ? python : "/usr/bin/python3");
    return;
  }
  char line[2048];
  while (fgets(line, sizeof line, p)) {
    const char *s = strstr(line, "\"skipped\": \"");
    long long m;
    double t;
    const char *mm = strstr(line, "\"M\": "), *tt = strstr(line, "\"torch_us\": ");
    if (s) {
      snprintf(skipped, skipped_len, "%s", s + 12);
      char *end = strchr(skipped, '"');
      if (end)
        *end = 0;
    } else if (mm && tt && sscanf(mm + 5, "%lld", &m) == 1 && sscanf(tt + 12, "%lf", &t) == 1) {
      for (int i = 0; i < n_ms; i++)
        if (ms[i] == m)
          us[i] = t;
    }
  }
  int rc = pclose(p);
  if (rc != 0 && !skipped[0])
    snprintf(skipped, skipped_len, "bench/peer_torch.py exited with status %d", rc);
}

/* ---- one shape -------------------------------------------------------------------------------- */

struct timed {
  struct point p;
  struct side *q;
};

/* Side 0: qkeep's int8 layer; side 1: the f32 peer. */
static double call(void *arg, int s, int c) {
  struct timed *t = arg;
  return s == 0 ? side_run(t->q, c, t->p.m, t->p.x, t->p.y) : f32_run(t->p.f, c);
}

static void bench_shape(qkeep_plugin *plugin, int64_t k, int64_t n, int threads, size_t llc, double copy_bw,
                        const char *probe) {
  static const int64_t ms[] = {1, 16, 128, 512};
  enum { N_MS = sizeof ms / sizeof ms[0] };
  size_t int8_bytes = (size_t)(k * n), f32_bytes = 4 * int8_bytes;
  struct side q = {0};
  int q_copies = copies_for(int8_bytes, llc);
  side_build(&q, plugin, k, n, q_copies, int8_layer);
  float *w = malloc((size_t)(n * k) * sizeof *w);
  uint64_t wrng = 7;
  for (int64_t i = 0; i < n * k; i++)
    w[i] = tu_randf(&wrng) * 0.05f;
  double results[N_MS][2];
  int runs_used[N_MS];
  for (int i = 0; i < N_MS; i++) {
    int64_t m = ms[i];
    float *x = activations(m, k), *y = malloc((size_t)(m * n) * sizeof *y),
          *yf = malloc((size_t)(m * n) * sizeof *yf);
    struct f32_side f;
    int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    f32_build(&f, m, k, n, copies_for(f32_bytes, llc), w, x, yf);
    /* About 2 s per point. */
    struct timed t = {{&f, m, x, y}, &q};
    runs_used[i] =
        time_interleaved(call, &t, 2, q.copies > f.copies ? q.copies : f.copies, 2.0, 201, results[i]);
    omp_set_num_threads(saved);
    f32_free(&f);
    free(x), free(y), free(yf);
  }
  free(w);
  side_free(&q);
  double torch_us[N_MS];
  char skipped[512];
  torch_peer(k, n, ms, N_MS, threads, 2 * llc, torch_us, skipped, sizeof skipped);
  for (int i = 0; i < N_MS; i++) {
    printf("{\"bench\":\"int8_linear\",\"M\":%lld,\"K\":%lld,\"N\":%lld,\"threads\":%d,\"runs\":%d,"
           "\"qkeep_us\":%.1f,\"peer\":\"onednn_f32_packed\",\"peer_us\":%.1f,\"ratio\":%.2f,",
           (long long)ms[i], (long long)k, (long long)n, threads, runs_used[i], results[i][0], results[i][1],
           results[i][1] / results[i][0]);
    if (torch_us[i] > 0)
      printf("\"torch_int8_us\":%.1f,\"torch_ratio\":%.2f,", torch_us[i], torch_us[i] / results[i][0]);
    else
      printf("\"torch_int8_us\":null,\"torch_skipped\":\"%s\",", skipped[0] ? skipped : "no result");
    print_ceiling(int8_bytes, results[i][0], copy_bw, q_copies, llc, probe);
    printf("}\n");
    fflush(stdout);
  }
}

int main(int argc, char **argv) {
  const char *env = getenv("QKEEP_BENCH_THREADS");
  int threads = argc > 1 ? atoi(argv[1]) : env ? atoi(env) : (int)sysconf(_SC_NPROCESSORS_ONLN);
  if (threads < 1)
    threads = 1;
  qkeep_plugin *plugin;
  if (qkeep_plugin_open("cpu-onednn", NULL, &plugin))
    die("opening cpu-onednn");
  char value[16], probe[256];
  snprintf(value, sizeof value, "%d", threads);
  const struct qkeep_backend *be = qkeep_plugin_backend(plugin);
  if (be->configure(be, "threads", value))
    die("threads");
  qkeep_plugin_probe(plugin, probe, sizeof probe);
  size_t llc = llc_bytes();
  double copy_bw = copy_bandwidth(llc, threads);
  static const int64_t shapes[][2] = {{4096, 4096}, {4096, 14336}, {14336, 4096}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
    bench_shape(plugin, shapes[s][0], shapes[s][1], threads, llc, copy_bw, probe);
  qkeep_plugin_close(plugin);
  return 0;
}
