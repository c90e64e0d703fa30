/*
 * bench_load.c: a cold start and an in-place reload of a ≥ 4 GB checkpoint into GPU memory, from a
 * warm page cache, against the ceilings of the same machine measured in the same run:
 *   - raw_read: every byte of the checkpoint read by as many threads as the host has cores
 *     (pread of 8 MiB pieces into private buffers): what the host's page cache gives;
 *   - pinned_h2d: the same number of bytes copied host-to-device from pinned memory in 8 MiB
 *     pieces on one stream: what the PCIe link gives;
 *   - safetensors (with QKEEP_BENCH_PYTHON naming a python with torch and safetensors): the
 *     safetensors library's load_file(path, device="cuda:0") of the same file, in a child process
 *     (its CUDA initialisation excluded: timed from the call to the last byte on the device).
 * The model: Llama-3-8B's shapes in ModelOpt NVFP4 (synth_nvfp4.h), LAYERS decoder layers (16 by
 * default: 4.06 GB with the bf16 embeddings and lm_head), on the chain `cuda-nvfp4, reference`
 * (every tensor goes to the GPU). Each round: the raw read, a cold start on W1 (a new model: the
 * staging ring made, every layer read, copied and processed; the CUDA context already made), and
 * a reload of a model holding W0 to W1 and back (each timed). Medians of RUNS rounds after a
 * warm-up round; both files are read once first so that the page cache holds them.
 *
 *   bench_load [LAYERS] [RUNS]
 *   bench_load online [LAYERS] [RUNS]
 *   bench_load online-kernel [LAYERS] [RUNS]   (the online_kernel line alone, for a profiler)
 *
 * With `online`, quantizing on load on the device: the same model unquantized (every linear bf16:
 * about 9.1 GB at 16 layers), loaded with `quantize = modelopt-nvfp4` on the chain `cuda-nvfp4,
 * reference` with cuda-nvfp4's quantize_on_device on (each unit's bf16 staged in device memory and
 * quantized there), against in the same rounds:
 *   - raw_read of the bf16 file by every core (the target: an online cold start within 1.5x of it);
 *   - pinned_h2d of as many bytes (the link every bf16 byte crosses: online_of_h2d is the share of
 *     it the online cold start reaches; where the host reads faster than the link, 1.5x the raw
 *     read can be below this floor);
 *   - the cold start of the same model quantized offline (qkeep_quantize, then a cold load), whose
 *     digest the online model must equal ("identical");
 *   - an online reload of the bf16 file in place;
 * and the quantize slot alone on device buffers (gate_proj and up_proj: one fusion group of two
 * 14336 x 4096 bf16 members, the scan, its read-back and the kernels) against a device-to-device
 * copy of the same bf16 bytes: bytes moved (read + written) per second each, and their ratio
 * (target: at least 0.5).
 *
 * QKEEP_BENCH_RINGS="SLOTS:PIECE:READERS:FENCES,..." measures each ring shape (ring_options.h);
 * without it, the model's defaults. QKEEP_BENCH_TRACE=1 logs the stream's trace of every load.
 * Each line also splits the cold start and the reload (qkeep_model_load_stats, medians): planning and
 * allocating (the pinned ring made there too), the layers' bytes, PWAL, and a reload's validation of
 * W1; reload_layers_of_h2d is the pinned copy's time over the reload's streaming of the layers.
 * One JSON object per line; GB/s are 1e9 bytes per second of checkpoint bytes. The checkpoints go
 * under $TMPDIR (or /tmp), about 2 x 4.1 GB, removed at the end.
 */
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda_check.h"
#include "private.h"
#include "ring_options.h"
#include "synth_nvfp4.h"
#include "testutil.h"

#define PIECE ((size_t)8 << 20)
enum { MAX_RUNS = 32 };

static int fail(const char *what) {
  printf("{\"bench\":\"load\",\"error\":\"%s: %s\"}\n", what, qkeep_errmsg());
  return 1;
}

/* ---- raw read: every core, 8 MiB preads ---- */

struct raw_read {
  int fd;
  size_t size;
  atomic_size_t next;
  atomic_int failed;
};

static void *raw_reader(void *arg) {
  struct raw_read *r = arg;
  char *buf = malloc(PIECE);
  for (size_t at; buf && (at = atomic_fetch_add(&r->next, PIECE)) < r->size;) {
    size_t n = r->size - at < PIECE ? r->size - at : PIECE;
    if (pread(r->fd, buf, n, (off_t)at) != (ssize_t)n)
      atomic_store(&r->failed, 1);
  }
  if (!buf)
    atomic_store(&r->failed, 1);
  free(buf);
  return NULL;
}

/* Seconds to read the file with `threads` threads (< 0 on a failure). */
static double raw_read(const char *path, int threads) {
  struct raw_read r = {.fd = open(path, O_RDONLY)};
  struct stat st;
  if (r.fd < 0 || fstat(r.fd, &st))
    return -1;
  r.size = (size_t)st.st_size;
  pthread_t t[64];
  threads = threads > 64 ? 64 : threads;
  double t0 = now_seconds();
  int started = 0;
  while (started < threads && pthread_create(&t[started], NULL, raw_reader, &r) == 0)
    started++;
  for (int i = 0; i < started; i++)
    pthread_join(t[i], NULL);
  double s = now_seconds() - t0;
  close(r.fd);
  return started && !atomic_load(&r.failed) ? s : -1;
}

/* ---- pinned host-to-device ceiling ---- */

static double pinned_h2d(size_t bytes) {
  const size_t ring = (size_t)64 << 20, room = (size_t)1 << 30;
  void *host, *dev;
  cudaStream_t stream;
  cudaEvent_t start, stop;
  CUDA_OK(cudaHostAlloc(&host, ring, cudaHostAllocDefault));
  memset(host, 1, ring);
  CUDA_OK(cudaMalloc(&dev, room));
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  CUDA_OK(cudaEventRecord(start, stream));
  for (size_t at = 0; at < bytes; at += PIECE) {
    size_t n = bytes - at < PIECE ? bytes - at : PIECE;
    CUDA_OK(cudaMemcpyAsync((char *)dev + at % room, (char *)host + at % ring, n, cudaMemcpyHostToDevice,
                            stream));
  }
  CUDA_OK(cudaEventRecord(stop, stream));
  CUDA_OK(cudaEventSynchronize(stop));
  float ms;
  CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  CUDA_OK(cudaStreamDestroy(stream));
  CUDA_OK(cudaFree(dev));
  CUDA_OK(cudaFreeHost(host));
  return ms / 1000.0;
}

/* ---- the safetensors library, in a child python ---- */

static void safetensors_peer(const char *python, const char *file, double bytes, int runs) {
  char cmd[4096];
  snprintf(
      cmd, sizeof cmd,
      "%s -c 'import sys, time, torch\n"
      "from safetensors.torch import load_file\n"
      "torch.zeros(1, device=\"cuda:0\"); torch.cuda.synchronize()\n"
      "for r in range(%d):\n"
      "    t = time.perf_counter(); d = load_file(sys.argv[1], device=\"cuda:0\"); torch.cuda.synchronize()\n"
      "    print(time.perf_counter() - t); del d; torch.cuda.empty_cache()\n' '%s' 2>/dev/null",
      python, runs + 1, file);
  FILE *p = popen(cmd, "r");
  double v[MAX_RUNS + 1];
  int n = 0;
  while (p && n <= runs && fscanf(p, "%lf", &v[n]) == 1)
    n++;
  int status = p ? pclose(p) : -1;
  if (n < 2 || status != 0) {
    printf("{\"bench\":\"load_peer\",\"peer\":\"safetensors_load_file_cuda\",\"skipped\":\"%s did not run it "
           "(torch, safetensors and a GPU needed)\"}\n",
           python);
    return;
  }
  double s = tu_median(v + 1, n - 1); /* the first is a warm-up */
  printf("{\"bench\":\"load_peer\",\"peer\":\"safetensors_load_file_cuda\",\"bytes\":%.0f,\"s\":%.4f,"
         "\"gbps\":%.2f,\"runs\":%d}\n",
         bytes, s, bytes / s / 1e9, n - 1);
}

/* ---- qkeep ---- */

static int model_new(qkeep_plugin **plugins, size_t n, const struct qkeep_load_options *o,
                     qkeep_model **out) {
  int rc = qkeep_model_new_chain(plugins, n, out);
  if (!rc && (rc = qkeep_model_set_load_options(*out, o)))
    qkeep_model_free(*out);
  return rc;
}

static int bench_ring(qkeep_plugin **plugins, size_t n_plugins, const char *spec, const char *w0,
                      const char *w1, const char *file1, double bytes, int runs, int cores, double h2d_s) {
  char label[64];
  struct qkeep_load_options o = ring_options(spec, label, sizeof label);
  double raw[MAX_RUNS], cold[MAX_RUNS], reload[MAX_RUNS], paired[MAX_RUNS];
  /* where each went (qkeep_model_load_stats): the cold start's planning and allocation, layers' bytes and
   * PWAL; the second reload's validation, layers' bytes and PWAL */
  double c_plan[MAX_RUNS], c_layers[MAX_RUNS], c_pwal[MAX_RUNS], r_check[MAX_RUNS], r_layers[MAX_RUNS],
      r_pwal[MAX_RUNS];
  struct qkeep_load_stats cs = {.size = sizeof cs}, rs = {.size = sizeof rs};
  qkeep_model *held;
  if (model_new(plugins, n_plugins, &o, &held) || qkeep_model_load(held, w0))
    return fail("loading W0");
  const char *target[2] = {w1, w0};
  for (int r = -1; r < runs; r++) { /* round -1: the warm-up */
    double t_raw = raw_read(file1, cores);
    qkeep_model *m;
    double t0 = now_seconds();
    if (model_new(plugins, n_plugins, &o, &m) || qkeep_model_load(m, w1))
      return fail("cold start");
    double t_cold = now_seconds() - t0;
    (void)qkeep_model_load_stats(m, &cs);
    qkeep_model_free(m);
    double t_reload = 0;
    for (int k = 0; k < 2; k++) {
      t0 = now_seconds();
      if (qkeep_model_reload(held, target[k], 0))
        return fail("reload");
      t_reload += (now_seconds() - t0) / 2;
    }
    (void)qkeep_model_load_stats(held, &rs);
    if (t_raw < 0)
      return fail("raw read");
    if (r >= 0) {
      raw[r] = t_raw, cold[r] = t_cold, reload[r] = t_reload, paired[r] = t_reload / t_cold;
      c_plan[r] = cs.open_seconds, c_layers[r] = cs.read_seconds, c_pwal[r] = cs.pwal_seconds;
      r_check[r] = rs.validate_seconds, r_layers[r] = rs.read_seconds, r_pwal[r] = rs.pwal_seconds;
    }
  }
  struct qkeep_memory_stats mem = {.size = sizeof mem};
  (void)qkeep_model_memory(held, &mem, false);
  qkeep_model_free(held);
  double s_raw = tu_median(raw, runs), s_cold = tu_median(cold, runs), s_reload = tu_median(reload, runs);
  printf("{\"bench\":\"load\",\"model\":\"llama3-8b-nvfp4\",\"bytes\":%.0f,\"ring\":\"%s\","
         "\"cold_s\":%.4f,\"cold_gbps\":%.2f,\"reload_s\":%.4f,\"reload_gbps\":%.2f,"
         "\"reload_over_cold\":%.3f,\"reload_over_cold_paired\":%.3f,"
         "\"raw_read_s\":%.4f,\"raw_read_gbps\":%.2f,\"raw_read_threads\":%d,\"pinned_h2d_gbps\":%.2f,"
         "\"cold_of_h2d\":%.3f,\"reload_of_h2d\":%.3f,\"pinned_bytes\":%lld,\"runs\":%d,"
         "\"cold_plan_s\":%.4f,\"cold_layers_s\":%.4f,\"cold_pwal_s\":%.4f,\"reload_validate_s\":%.4f,"
         "\"reload_layers_s\":%.4f,\"reload_pwal_s\":%.4f,\"reload_layers_of_h2d\":%.3f}\n",
         bytes, label, s_cold, bytes / s_cold / 1e9, s_reload, bytes / s_reload / 1e9, s_reload / s_cold,
         tu_median(paired, runs), s_raw, bytes / s_raw / 1e9, cores, bytes / h2d_s / 1e9, h2d_s / s_cold,
         h2d_s / s_reload, (long long)mem.pinned_bytes, runs, tu_median(c_plan, runs), tu_median(c_layers, runs),
         tu_median(c_pwal, runs), tu_median(r_check, runs), tu_median(r_layers, runs), tu_median(r_pwal, runs),
         h2d_s / tu_median(r_layers, runs));
  fflush(stdout);
  return 0;
}

/* The plugins of the chain a config text (written to ini) names. */
static int open_chain(const char *ini, const char *text, qkeep_config **config, qkeep_plugin ***plugins,
                      size_t *n) {
  return tu_write_file(ini, text, strlen(text)) || qkeep_config_load(ini, config) ||
         qkeep_plugins_open_config(*config, plugins, n);
}

/* ---- online quantization on the device ---- */

/* Seconds of one call of the quantize slot on a fusion group of two n x k bf16 members (median of
 * runs), and of a device copy of the same bf16 bytes; *bytes_moved: what the slot reads and writes. */
static void quantize_slot_timing(const struct qkeep_backend *be, int64_t n, int64_t k, int runs,
                                 double *slot_s, double *copy_s, double *bytes_moved) {
  const size_t src = (size_t)(n * k) * 2, codes = (size_t)(n * k) / 2, scales = (size_t)(n * k) / 16;
  void *d_src[2], *d_codes[2], *d_scales[2], *d_copy;
  uint16_t *host = malloc(src);
  uint64_t seed = 7;
  for (size_t i = 0; host && i < src / 2; i++)
    host[i] = (uint16_t)((tu_rand(&seed) & 0x80ffu) | 0x3c00u);
  if (!host) {
    printf("{\"bench\":\"online_kernel\",\"error\":\"out of memory\"}\n");
    exit(1);
  }
  for (int m = 0; m < 2; m++) {
    CUDA_OK(cudaMalloc(&d_src[m], src));
    CUDA_OK(cudaMalloc(&d_codes[m], codes));
    CUDA_OK(cudaMalloc(&d_scales[m], scales));
    CUDA_OK(cudaMemcpy(d_src[m], host, src, cudaMemcpyHostToDevice));
  }
  CUDA_OK(cudaMalloc(&d_copy, 2 * src));
  static const char *const names[2] = {"mlp.gate_proj.weight", "mlp.up_proj.weight"};
  struct qkeep_quant_member members[2];
  for (int m = 0; m < 2; m++)
    members[m] = (struct qkeep_quant_member){sizeof members[m], names[m],   QKEEP_DTYPE_BF16, n, k,
                                             d_src[m],          d_codes[m], d_scales[m]};
  double slot[MAX_RUNS + 1], copy[MAX_RUNS + 1];
  for (int r = 0; r <= runs; r++) { /* r 0: the warm-up */
    struct qkeep_quant_unit u = {sizeof u, "modelopt-nvfp4", 2, members, sizeof members[0], 0.0f, -1, 0};
    CUDA_OK(cudaDeviceSynchronize());
    double t0 = now_seconds();
    if (be->quantize(be, NULL, &u) != 0) {
      printf("{\"bench\":\"online_kernel\",\"error\":\"the quantize slot: %s\"}\n", qkeep_errmsg());
      exit(1);
    }
    CUDA_OK(cudaDeviceSynchronize());
    double t1 = now_seconds();
    for (int m = 0; m < 2; m++)
      CUDA_OK(cudaMemcpyAsync((char *)d_copy + m * src, d_src[m], src, cudaMemcpyDeviceToDevice, 0));
    CUDA_OK(cudaDeviceSynchronize());
    slot[r] = t1 - t0, copy[r] = now_seconds() - t1;
  }
  *slot_s = tu_median(slot + 1, runs), *copy_s = tu_median(copy + 1, runs);
  *bytes_moved = 2.0 * (double)(src + codes + scales);
  for (int m = 0; m < 2; m++)
    cudaFree(d_src[m]), cudaFree(d_codes[m]), cudaFree(d_scales[m]);
  cudaFree(d_copy);
  free(host);
}

static void online_kernel(const struct qkeep_backend *be, int runs);

static int bench_online(qkeep_plugin **plugins, size_t n_plugins, const char *bf16, const char *offline,
                        const char *file, double bytes, int runs, int cores) {
  struct qkeep_quantize_options q = {.size = sizeof q, .scheme = "modelopt-nvfp4"};
  double t0 = now_seconds();
  if (qkeep_quantize(bf16, offline, &q))
    return fail("qkeep quantize");
  double quantize_s = now_seconds() - t0;
  double raw[MAX_RUNS], online[MAX_RUNS], cold[MAX_RUNS], reload[MAX_RUNS], over[MAX_RUNS];
  bool identical = true;
  for (int r = -1; r < runs; r++) { /* round -1: the warm-up */
    double t_raw = raw_read(file, cores);
    qkeep_model *on, *off;
    t0 = now_seconds();
    if (qkeep_model_new_chain(plugins, n_plugins, &on) || qkeep_model_set_quantize(on, &q) ||
        qkeep_model_load(on, bf16))
      return fail("online cold start");
    double t1 = now_seconds();
    if (qkeep_model_new_chain(plugins, n_plugins, &off) || qkeep_model_load(off, offline))
      return fail("cold start of the offline twin");
    double t2 = now_seconds();
    if (qkeep_model_reload(on, bf16, 0))
      return fail("online reload");
    double t3 = now_seconds();
    struct qkeep_digest a, b;
    if (qkeep_digest(on, &a) || qkeep_digest(off, &b))
      return fail("digest");
    identical &= a.hi == b.hi && a.lo == b.lo;
    qkeep_model_free(on);
    qkeep_model_free(off);
    if (t_raw < 0)
      return fail("raw read");
    if (r >= 0)
      raw[r] = t_raw, online[r] = t1 - t0, cold[r] = t2 - t1, reload[r] = t3 - t2,
      over[r] = online[r] / t_raw;
  }
  double s_raw = tu_median(raw, runs), s_on = tu_median(online, runs), s_cold = tu_median(cold, runs);
  double s_reload = tu_median(reload, runs), h2d[MAX_RUNS];
  for (int r = 0; r < runs; r++) /* the link's floor: the bf16 bytes must cross it */
    h2d[r] = pinned_h2d((size_t)bytes);
  double s_h2d = tu_median(h2d, runs);
  printf("{\"bench\":\"online_load\",\"model\":\"llama3-8b-bf16\",\"scheme\":\"modelopt-nvfp4\","
         "\"bytes\":%.0f,\"online_s\":%.4f,\"online_gbps\":%.2f,\"online_reload_s\":%.4f,"
         "\"online_reload_gbps\":%.2f,\"raw_read_s\":%.4f,\"raw_read_gbps\":%.2f,\"raw_read_threads\":%d,"
         "\"online_over_raw_read\":%.3f,\"online_over_raw_read_paired\":%.3f,\"offline_cold_s\":%.4f,"
         "\"online_over_offline_cold\":%.3f,\"pinned_h2d_s\":%.4f,\"pinned_h2d_gbps\":%.2f,"
         "\"online_of_h2d\":%.3f,\"quantize_s\":%.3f,\"identical\":%s,\"runs\":%d}\n",
         bytes, s_on, bytes / s_on / 1e9, s_reload, bytes / s_reload / 1e9, s_raw, bytes / s_raw / 1e9, cores,
         s_on / s_raw, tu_median(over, runs), s_cold, s_on / s_cold, s_h2d, bytes / s_h2d / 1e9, s_h2d / s_on,
         quantize_s, identical ? "true" : "false", runs);
  fflush(stdout);
  online_kernel(plugins[0]->be, runs);
  return identical ? 0 : 1;
}

/* The online_kernel line: the quantize slot on a gate/up unit against a device copy. */
static void online_kernel(const struct qkeep_backend *be, int runs) {
  double slot_s, copy_s, moved;
  quantize_slot_timing(be, 14336, 4096, 2 * runs + 1, &slot_s, &copy_s, &moved);
  double copy_bytes = 2.0 * 2.0 * 14336.0 * 4096.0 * 2.0; /* read + write of both members' bf16 */
  printf("{\"bench\":\"online_kernel\",\"scheme\":\"modelopt-nvfp4\",\"unit\":\"gate_up 2x14336x4096 "
         "bf16\",\"slot_us\":%.1f,\"slot_gbps\":%.1f,\"d2d_copy_us\":%.1f,\"d2d_copy_gbps\":%.1f,"
         "\"slot_of_copy\":%.3f}\n",
         slot_s * 1e6, moved / slot_s / 1e9, copy_s * 1e6, copy_bytes / copy_s / 1e9,
         (moved / slot_s) / (copy_bytes / copy_s));
  fflush(stdout);
}

static int main_online(int layers, int runs, int cores, bool kernel_only) {
  if (kernel_only) { /* the online_kernel line alone (a profiler's run) */
    char *dir = tu_tmpdir("bench-online-kernel"), *ini = dir ? tu_path(dir, "qkeep.ini") : NULL;
    qkeep_config *config;
    qkeep_plugin **plugins;
    size_t n_plugins;
    if (!ini || open_chain(ini, "[qkeep]\nbackend = cuda-nvfp4\n", &config, &plugins, &n_plugins))
      return fail("plugins");
    online_kernel(plugins[0]->be, runs);
    qkeep_plugins_close(plugins, n_plugins);
    qkeep_config_free(config);
    tu_rmtree(dir);
    free(dir), free(ini);
    return 0;
  }
  char *dir = tu_tmpdir("bench-online-gpu");
  char *bf16 = dir ? tu_path(dir, "bf16") : NULL, *offline = dir ? tu_path(dir, "nvfp4") : NULL;
  char *file = bf16 ? tu_path(bf16, "model.safetensors") : NULL,
       *ini = dir ? tu_path(dir, "qkeep.ini") : NULL;
  struct shape s = shapes[0];
  s.layers = layers;
  if (!file || !ini || mkdir(bf16, 0755) || write_checkpoint(&s, bf16, 1, true))
    return fail("writing the bf16 checkpoint");
  struct stat st;
  if (stat(file, &st) || raw_read(file, cores) < 0)
    return fail("reading the bf16 checkpoint");
  static const char cfg[] = "[qkeep]\nbackend = cuda-nvfp4, reference\n"
                            "[backend.cuda-nvfp4]\nquantize_on_device = true\n";
  qkeep_config *config;
  qkeep_plugin **plugins;
  size_t n_plugins;
  if (open_chain(ini, cfg, &config, &plugins, &n_plugins))
    return fail("plugins");
  int rc = bench_online(plugins, n_plugins, bf16, offline, file, (double)st.st_size, runs, cores);
  qkeep_plugins_close(plugins, n_plugins);
  qkeep_config_free(config);
  tu_rmtree(dir);
  free(dir), free(bf16), free(offline), free(file), free(ini);
  return rc;
}

int main(int argc, char **argv) {
  bool kernel_only = argc > 1 && strcmp(argv[1], "online-kernel") == 0;
  bool online = kernel_only || (argc > 1 && strcmp(argv[1], "online") == 0);
  argv += online, argc -= online;
  int layers = argc > 1 ? atoi(argv[1]) : 16, runs = argc > 2 ? atoi(argv[2]) : 3;
  runs = runs < 1 ? 1 : runs > MAX_RUNS ? MAX_RUNS : runs;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
    printf("{\"bench\":\"load\",\"skipped\":\"no CUDA device\"}\n");
    return 0;
  }
  const char *trace = getenv("QKEEP_BENCH_TRACE");
  if (trace && *trace && strcmp(trace, "0") != 0)
    tu_log_to_stderr(QKEEP_LOG_DEBUG);
  CUDA_OK(cudaFree(NULL)); /* the context, outside every timing */
  int cores = (int)sysconf(_SC_NPROCESSORS_ONLN);
  cores = cores < 1 ? 1 : cores;
  if (online)
    return main_online(layers, runs, cores, kernel_only);
  char *dir = tu_tmpdir("bench-load");
  char *w0 = dir ? tu_path(dir, "w0") : NULL, *w1 = dir ? tu_path(dir, "w1") : NULL;
  char *file1 = w1 ? tu_path(w1, "model.safetensors") : NULL,
       *file0 = w0 ? tu_path(w0, "model.safetensors") : NULL;
  struct shape s = shapes[0];
  s.layers = layers;
  if (!file0 || !file1 || mkdir(w0, 0755) || mkdir(w1, 0755) || write_model(&s, w0, 1) ||
      write_model(&s, w1, 2))
    return fail("writing the checkpoints");
  struct stat st;
  if (stat(file1, &st) || raw_read(file0, cores) < 0 || raw_read(file1, cores) < 0)
    return fail("reading the checkpoints");
  double bytes = (double)st.st_size;
  char *ini = tu_path(dir, "qkeep.ini");
  qkeep_config *config;
  qkeep_plugin **plugins;
  size_t n_plugins;
  if (open_chain(ini, "[qkeep]\nbackend = cuda-nvfp4, reference\n", &config, &plugins, &n_plugins))
    return fail("plugins");
  double h2d[MAX_RUNS];
  for (int r = 0; r < runs; r++)
    h2d[r] = pinned_h2d((size_t)bytes);
  double h2d_s = tu_median(h2d, runs);
  printf("{\"bench\":\"load_ceiling\",\"bytes\":%.0f,\"pinned_h2d_s\":%.4f,\"pinned_h2d_gbps\":%.2f,"
         "\"piece\":%zu,\"runs\":%d}\n",
         bytes, h2d_s, bytes / h2d_s / 1e9, PIECE, runs);
  fflush(stdout);
  const char *python = getenv("QKEEP_BENCH_PYTHON");
  if (python && *python)
    safetensors_peer(python, file1, bytes, runs);
  const char *rings = getenv("QKEEP_BENCH_RINGS");
  int rc = 0;
  if (!rings || !*rings)
    rc = bench_ring(plugins, n_plugins, NULL, w0, w1, file1, bytes, runs, cores, h2d_s);
  for (const char *p = rings; p && *p && !rc; p += strcspn(p, ","), p += *p == ',')
    rc = bench_ring(plugins, n_plugins, p, w0, w1, file1, bytes, runs, cores, h2d_s);
  qkeep_plugins_close(plugins, n_plugins);
  qkeep_config_free(config);
  tu_rmtree(dir);
  free(dir), free(w0), free(w1), free(file0), free(file1), free(ini);
  return rc;
}
