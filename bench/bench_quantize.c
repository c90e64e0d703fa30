/*
 * bench_quantize.c: `qkeep quantize` against the disk. Writes a synthetic bf16
 * checkpoint of a Llama-shaped model (hidden 2048, MLP 5632, GQA 4:1, vocab 32000,
 * as many decoder layers as reach SIZE_MB) into a fresh temporary directory, then
 * measures, in each of RUNS runs (after a warm-up run), interleaved:
 *   raw        a raw read + write of the same bytes: the checkpoint read in 8 MiB
 *              chunks (pread) and written to a new file (pwrite), on one thread,
 *              as cp does; the file is removed at once;
 *   quantize   qkeep_quantize into each scheme (modelopt-nvfp4, mxfp4, w8a8-int8,
 *              gptq-int4, ct-int4), at 1 thread and at every thread count given
 *              (default: 1 and every online core); each output removed at once.
 * Rates are input bytes per second; cpu_s is the process's CPU time (user + system, every
 * thread) for the same work, which tells what a loaded machine's wall clock cannot. Per run the ratio to that
 * run's raw rate; at the end the medians, the ratio of the medians and the speed-up over 1 thread, the peak
 * buffer bytes qkeep_quantize reports against the model's size, and the process's peak resident memory. One
 * JSON object per line; lscpu's model first. The temporary directory is removed at the end.
 *
 *   bench_quantize [SIZE_MB [RUNS [THREADS...]]]      defaults: 1100 3 (1 and all)
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "private.h"
#include "testutil.h"

#define HIDDEN 2048
#define MLP 5632
#define KV 512
#define VOCAB 32000
#define CHUNK ((size_t)8 << 20)
#define MAX_RUNS 16
#define MAX_THREADS 8

static const char *const schemes[] = {"modelopt-nvfp4", "mxfp4", "w8a8-int8", "gptq-int4", "ct-int4"};
#define N_SCHEMES (sizeof schemes / sizeof schemes[0])

static void die(const char *what) {
  fprintf(stderr, "bench_quantize: %s: %s\n", what, errno ? strerror(errno) : qkeep_errmsg());
  exit(1);
}

static char *join(const char *dir, const char *name) {
  char *s;
  if (asprintf(&s, "%s/%s", dir, name) < 0)
    die("out of memory");
  return s;
}

static void pwrite_all(int fd, const void *data, size_t n, off_t at) {
  const char *p = data;
  while (n) {
    ssize_t w = pwrite(fd, p, n, at);
    if (w <= 0)
      die("write");
    p += w;
    n -= (size_t)w;
    at += w;
  }
}

/* A tensor of the synthetic model. */
static void plan(struct st_writer *w, const char *name, int64_t rows, int64_t cols, int64_t *bytes) {
  struct qkeep_spec s = {.dtype = QKEEP_DTYPE_BF16, .ndim = cols ? 2 : 1, .shape = {rows, cols}};
  if (st_writer_plan(w, name, &s))
    die(name);
  *bytes += rows * (cols ? cols : 1) * 2;
}

/* Writes the checkpoint (streamed: one chunk of random bf16 weights in memory at a time); returns its bytes.
 */
static int64_t write_model(const char *path, int64_t target) {
  struct st_writer *w;
  if (st_writer_new(&w))
    die("writer");
  int64_t bytes = 0;
  plan(w, "model.embed_tokens.weight", VOCAB, HIDDEN, &bytes);
  plan(w, "lm_head.weight", VOCAB, HIDDEN, &bytes);
  plan(w, "model.norm.weight", HIDDEN, 0, &bytes);
  static const struct {
    const char *name;
    int64_t rows, cols;
  } layer[] = {{"input_layernorm", HIDDEN, 0},       {"post_attention_layernorm", HIDDEN, 0},
               {"self_attn.q_proj", HIDDEN, HIDDEN}, {"self_attn.k_proj", KV, HIDDEN},
               {"self_attn.v_proj", KV, HIDDEN},     {"self_attn.o_proj", HIDDEN, HIDDEN},
               {"mlp.gate_proj", MLP, HIDDEN},       {"mlp.up_proj", MLP, HIDDEN},
               {"mlp.down_proj", HIDDEN, MLP}};
  for (int l = 0; l < 1 || bytes < target; l++)
    for (size_t i = 0; i < sizeof layer / sizeof layer[0]; i++) {
      char *name;
      if (asprintf(&name, "model.layers.%d.%s.weight", l, layer[i].name) < 0)
        die("out of memory");
      plan(w, name, layer[i].rows, layer[i].cols, &bytes);
      free(name);
    }
  struct st_layout lay;
  if (st_writer_layout(w, &lay))
    die("layout");
  st_writer_free(w);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0)
    die(path);
  pwrite_all(fd, lay.header, lay.header_len, 0);
  uint16_t *buf = malloc(CHUNK);
  uint64_t state = 17;
  if (!buf)
    die("out of memory");
  for (uint64_t at = lay.header_len; at < lay.file_size; at += CHUNK) {
    size_t n = lay.file_size - at < CHUNK ? (size_t)(lay.file_size - at) : CHUNK;
    for (size_t i = 0; i < n / 2; i++) { /* weights of about +-0.05, as bf16 */
      float v = tu_randf(&state) * 0.05f;
      uint32_t bits;
      memcpy(&bits, &v, sizeof bits);
      buf[i] = (uint16_t)(bits >> 16);
    }
    pwrite_all(fd, buf, n, (off_t)at);
  }
  free(buf);
  /* on disk before the runs, so that its write-back does not fall into them */
  if (fsync(fd) || close(fd))
    die(path);
  int64_t size = (int64_t)lay.file_size;
  st_layout_free(&lay);
  return size;
}

/* CPU seconds of the process so far, every thread's, user and system. */
static double cpu_seconds(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_sec +
         1e-6 * (double)ru.ru_stime.tv_usec;
}

/* Seconds for a raw read + write of the file (one thread, 8 MiB chunks); the copy is removed. */
static double raw_copy(const char *from, const char *to, double *cpu) {
  char *buf = malloc(CHUNK);
  int in = open(from, O_RDONLY), out = open(to, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (!buf || in < 0 || out < 0)
    die("raw copy");
  double t0 = tu_now(), c0 = cpu_seconds();
  off_t at = 0;
  for (;;) {
    ssize_t r = pread(in, buf, CHUNK, at);
    if (r < 0)
      die("raw read");
    if (r == 0)
      break;
    pwrite_all(out, buf, (size_t)r, at);
    at += r;
  }
  close(out);
  double t = tu_now() - t0;
  *cpu = cpu_seconds() - c0;
  close(in);
  unlink(to);
  free(buf);
  return t;
}

static void remove_dir(const char *dir) {
  static const char *const names[] = {"config.json", "hf_quant_config.json", "model.safetensors"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    char *p = join(dir, names[i]);
    unlink(p);
    free(p);
  }
  rmdir(dir);
}

static double quantize(const char *in, const char *out, const char *scheme, int threads,
                       struct qkeep_quantize_progress *summary, double *cpu) {
  *summary = (struct qkeep_quantize_progress){.size = sizeof *summary};
  struct qkeep_quantize_options o = {
      .size = sizeof o, .scheme = scheme, .threads = threads, .activation_amax = 4, .summary = summary};
  double t0 = tu_now(), c0 = cpu_seconds();
  if (qkeep_quantize(in, out, &o))
    die(scheme);
  double t = tu_now() - t0;
  *cpu = cpu_seconds() - c0;
  remove_dir(out);
  return t;
}

static long long peak_rss(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long long kb = -1;
  while (f && fgets(line, sizeof line, f))
    if (strncmp(line, "VmHWM:", 6) == 0)
      kb = atoll(line + 6);
  if (f)
    fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}

static void print_cpu(int online) {
  FILE *p = popen("lscpu 2>/dev/null | sed -n 's/^Model name: *//p'", "r");
  char model[256] = "unknown";
  if (p && fgets(model, sizeof model, p))
    model[strcspn(model, "\n")] = 0;
  if (p)
    pclose(p);
  printf("{\"bench\":\"quantize_machine\",\"cpu\":\"%s\",\"online_cores\":%d}\n", model, online);
}

int main(int argc, char **argv) {
  int64_t size_mb = argc > 1 ? atoll(argv[1]) : 1100;
  int runs = argc > 2 ? atoi(argv[2]) : 3;
  int online = (int)sysconf(_SC_NPROCESSORS_ONLN), threads[MAX_THREADS] = {1, online},
      n_threads = online > 1 ? 2 : 1;
  if (argc > 3)
    for (n_threads = 0; n_threads < MAX_THREADS && 3 + n_threads < argc; n_threads++)
      threads[n_threads] = atoi(argv[3 + n_threads]);
  if (size_mb < 1 || runs < 1 || runs > MAX_RUNS) {
    fprintf(stderr, "usage: bench_quantize [SIZE_MB [RUNS (1-16) [THREADS...]]]\n");
    return 2;
  }
  print_cpu(online);
  const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
  char *dir = join(base, "qkeep-bench-quantize-XXXXXX");
  if (!mkdtemp(dir))
    die("a temporary directory");
  char *model = join(dir, "model.safetensors"), *copy = join(dir, "raw-copy"), *out = join(dir, "out");
  double t0 = tu_now();
  int64_t bytes = write_model(model, size_mb << 20);
  printf("{\"bench\":\"quantize_input\",\"bytes\":%lld,\"write_s\":%.2f}\n", (long long)bytes, tu_now() - t0);
  fflush(stdout);
  static double raw[MAX_RUNS], raw_cpu[MAX_RUNS], rate[N_SCHEMES][MAX_THREADS][MAX_RUNS],
      cpu[N_SCHEMES][MAX_THREADS][MAX_RUNS];
  int64_t peak[N_SCHEMES] = {0}, bound[N_SCHEMES] = {0};
  for (int r = -1; r < runs; r++) { /* run -1 warms the page cache and is not kept */
    double raw_c, raw_s = raw_copy(model, copy, &raw_c);
    if (r >= 0) {
      raw[r] = (double)bytes / raw_s;
      raw_cpu[r] = raw_c;
    }
    for (size_t s = 0; s < N_SCHEMES; s++)
      for (int t = 0; t < n_threads; t++) {
        struct qkeep_quantize_progress sum;
        double c, sec = quantize(model, out, schemes[s], threads[t], &sum, &c);
        if (r < 0)
          continue;
        rate[s][t][r] = (double)bytes / sec;
        cpu[s][t][r] = c;
        peak[s] = sum.peak_buffer_bytes > peak[s] ? sum.peak_buffer_bytes : peak[s];
        bound[s] = sum.buffer_bound;
        printf(
            "{\"bench\":\"quantize_run\",\"run\":%d,\"scheme\":\"%s\",\"threads\":%d,\"seconds\":%.3f,"
            "\"cpu_s\":%.3f,\"mb_per_s\":%.1f,\"raw_mb_per_s\":%.1f,\"raw_cpu_s\":%.3f,\"ratio_raw\":%.3f}\n",
            r, schemes[s], sum.threads, sec, c, rate[s][t][r] / 1e6, raw[r] / 1e6, raw_cpu[r],
            rate[s][t][r] / raw[r]);
        fflush(stdout);
      }
  }
  double raw_med = tu_median(raw, runs);
  printf("{\"bench\":\"quantize_raw\",\"bytes\":%lld,\"runs\":%d,\"mb_per_s\":%.1f,\"cpu_s\":%.3f}\n",
         (long long)bytes, runs, raw_med / 1e6, tu_median(raw_cpu, runs));
  for (size_t s = 0; s < N_SCHEMES; s++) {
    double one = tu_median(rate[s][0], runs);
    for (int t = 0; t < n_threads; t++) {
      double med = tu_median(rate[s][t], runs);
      printf(
          "{\"bench\":\"quantize\",\"scheme\":\"%s\",\"threads\":%d,\"runs\":%d,\"input_bytes\":%lld,"
          "\"mb_per_s\":%.1f,\"raw_mb_per_s\":%.1f,\"ratio_raw\":%.3f,\"speedup_vs_1\":%.2f,\"cpu_s\":%.3f,"
          "\"peak_buffer_bytes\":%lld,\"buffer_bound\":%lld}\n",
          schemes[s], threads[t], runs, (long long)bytes, med / 1e6, raw_med / 1e6, med / raw_med, med / one,
          tu_median(cpu[s][t], runs), (long long)peak[s], (long long)bound[s]);
    }
  }
  printf("{\"bench\":\"quantize_memory\",\"model_bytes\":%lld,\"peak_rss_bytes\":%lld}\n", (long long)bytes,
         peak_rss());
  if (!getenv("QKEEP_BENCH_KEEP")) {
    unlink(model);
    rmdir(dir);
  }
  free(model);
  free(copy);
  free(out);
  free(dir);
  return 0;
}
