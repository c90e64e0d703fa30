/*
 * bench_sync.c: weight sync over NCCL, trainer rank 0 -> inference rank 1 (two processes,
 * GPU 0 and GPU 1), against a raw NCCL broadcast of the same buckets in the same run.
 * Models (synthetic ModelOpt NVFP4, real tensor names and shapes, layers cut down):
 *   llama3-8b-4l    Llama-3-8B: hidden 4096, 32 x 128 q heads, 8 kv heads, intermediate 14336,
 *                   vocab 128256, 4 decoder layers;
 *   qwen3-30b-a3b-4l Qwen3-30B-A3B: hidden 2048, 32 x 128 q heads, 4 kv heads, q/k norms,
 *                   128 experts of intermediate 768, vocab 151936, 4 decoder layers.
 * Rank 0 stages W1's buckets (qkeep_sync_plan, 1 GiB each by default) in its device memory;
 * rank 1 holds W0 on cuda-nvfp4 and receives each bucket into one device buffer, then
 * qkeep_sync_bucket reloads its layers in place. Per run: the raw broadcast of every bucket
 * (then a device sync), and the sync (broadcast + in-place reload); medians of RUNS runs,
 * interleaved. Afterwards rank 1's digest must equal a cold load of W1 and no data pointer
 * may have moved. Peak extra device memory: the lowest free memory cuMemGetInfo saw after
 * each bucket, against the free memory before the sync (the receive buffer excluded).
 *
 * With one CUDA device it runs one process that is trainer and inference rank at once: each
 * bucket goes through NCCL with one rank (in place) into the sync, and the peer is a device
 * copy of the same buckets (the floor of a receive on one GPU). Needs the cuda-nvfp4 plugin
 * and libnccl.so.2 (QKEEP_NCCL_LIBRARY or LD_LIBRARY_PATH, e.g. PyTorch's nvidia/nccl/lib);
 * with a CUDA device but no libnccl it prints a "skipped" line and exits 0.
 *
 *   bench_sync [MODEL|all] [RUNS] [BUCKET_MB] [BACKEND]
 *
 * BACKEND reference or test-async (a test plugin of `make check`: a device in host memory whose
 * copies run at sync, as a GPU's do) runs the same sync path on the CPU, in one process: the
 * trainer's buckets go through the in-process transport into the receiver's buffer, host
 * buckets for reference, device buckets for test-async; the peer is the in-process broadcast of
 * the same buckets (a memcpy). Without a CUDA device and no BACKEND given, BACKEND is reference.
 * The CPU path needs about 3 x the model's bytes of memory (W0, the staged buckets and the cold
 * W1 load for the digest): about 8 GB for the Qwen3-shaped model. One JSON object per line
 * ("peer": "nccl_broadcast" with two ranks, "device_copy" with one, "inprocess_broadcast" on the
 * CPU). QKEEP_BENCH_TRACE=1 logs where each bucket's time goes (a line per bucket on stderr);
 * QKEEP_BENCH_PWAL sets cuda-nvfp4's key pwal (in-place, the default: the layout transforms in the
 * param's own memory where the shape allows; gpu: into a new tensor, copied back).
 *
 * NVLink multicast stays off: the bench sets NCCL_NVLS_ENABLE=0 in its own environment before any
 * NCCL call (qkeep leaves NCCL's configuration to its caller), as a host whose GPUs are shared
 * requires (a program using multicast there can put the host's shared GPUs out of service).
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "private.h"
#include "synth_nvfp4.h"
#include "testutil.h"

/* ---- the CUDA driver, dlopened (device count and free memory only) ---- */

static int (*cu_init)(unsigned);
static int (*cu_device_count)(int *);
static int (*cu_mem_info)(size_t *, size_t *);

static int cuda_devices(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  void *a = h ? dlsym(h, "cuInit") : NULL, *b = h ? dlsym(h, "cuDeviceGetCount") : NULL,
       *c = h ? dlsym(h, "cuMemGetInfo_v2") : NULL;
  if (!a || !b)
    return 0;
  memcpy(&cu_init, &a, sizeof a);
  memcpy(&cu_device_count, &b, sizeof b);
  if (c)
    memcpy(&cu_mem_info, &c, sizeof c);
  int n = 0;
  return cu_init(0) == 0 && cu_device_count(&n) == 0 ? n : 0;
}

static int64_t free_device_bytes(void) {
  size_t free_b = 0, total = 0;
  return cu_mem_info && cu_mem_info(&free_b, &total) == 0 ? (int64_t)free_b : -1;
}

/* ---- one rank ---- */

struct rank_ctx {
  int rank, ranks, runs; /* ranks 1: one process is trainer and inference rank (one GPU) */
  size_t bucket_bytes;
  const char *w0, *w1, *dir;
  int id_pipe[2];
  const char *model_name;
  const char *backend; /* NULL: cuda-nvfp4 on GPU `rank`, NCCL; else a CPU backend, in-process transport */
  const char *pwal;    /* cuda-nvfp4's key pwal (QKEEP_BENCH_PWAL; in-place by default) */
};

/* Bucket memory where the receiver's layers are: the device's (cuda-nvfp4, test-async) or the host's. */
static int buf_alloc(const struct device *dev, bool on_device, size_t bytes, void **out) {
  if (on_device)
    return dev_alloc(dev, bytes ? bytes : 1, out);
  return (*out = malloc(bytes ? bytes : 1)) ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
}
static int buf_put(const struct device *dev, bool on_device, void *dst, const void *src, size_t bytes) {
  if (on_device)
    return dev_h2d(dev, dst, src, bytes);
  memcpy(dst, src, bytes);
  return 0;
}
static void buf_free(const struct device *dev, bool on_device, void *p) {
  if (on_device)
    dev_free(dev, p);
  else
    free(p);
}

static int fail_json(const struct rank_ctx *c, const char *what) {
  printf("{\"bench\":\"sync\",\"model\":\"%s\",\"rank\":%d,\"error\":\"%s: %s\"}\n", c->model_name, c->rank,
         what, qkeep_errmsg());
  fflush(stdout);
  return 1;
}

static int remember(void *user, const char *layer, const char *name, const void *data, size_t capacity) {
  (void)layer, (void)name, (void)capacity;
  struct {
    const void **p;
    size_t n, cap;
  } *v = user;
  if (v->n == v->cap) {
    v->cap = v->cap ? 2 * v->cap : 256;
    v->p = realloc(v->p, v->cap * sizeof *v->p);
  }
  v->p[v->n++] = data;
  return 0;
}

static double median(double *v, int n) { return tu_median(v, n); }

static int run_rank(struct rank_ctx *c) {
  char cfg_path[512], cfg[320];
  if (!c->backend)
    (void)cuda_devices(); /* this process's CUDA driver: cuMemGetInfo for the peak */
  snprintf(cfg_path, sizeof cfg_path, "%s/rank%d.ini", c->dir, c->rank);
  if (c->backend)
    snprintf(cfg, sizeof cfg, "[qkeep]\nbackend = %s\n", c->backend);
  else
    snprintf(cfg, sizeof cfg,
             "[qkeep]\nbackend = cuda-nvfp4, reference\n[backend.cuda-nvfp4]\ndevice = %d\npwal = %s\n",
             c->rank, c->pwal);
  if (tu_write_file(cfg_path, cfg, strlen(cfg)))
    return fail_json(c, "config");
  qkeep_config *config;
  qkeep_plugin **plugins;
  size_t n_plugins;
  qkeep_model *m;
  if (qkeep_config_load(cfg_path, &config) || qkeep_plugins_open_config(config, &plugins, &n_plugins) ||
      qkeep_model_new_chain(plugins, n_plugins, &m))
    return fail_json(c, "plugins");
  /* Rank 0 is the trainer (it sends W1); the last rank receives. With one rank, both. */
  bool sender = c->rank == 0, receiver = c->rank == c->ranks - 1;
  if (qkeep_model_load(m, receiver ? c->w0 : c->w1))
    return fail_json(c, "load");
  const char *want = c->backend ? c->backend : "cuda-nvfp4";
  bool on_device = strcmp(want, "reference") != 0; /* reference holds host memory: host buckets */
  for (size_t l = 0; l < qkeep_model_layer_count(m); l++) {
    const char *be = qkeep_layer_backend(qkeep_model_layer(m, l));
    if (!be || strcmp(be, want) != 0) {
      set_error(QKEEP_E_UNSUPPORTED, "layer %s is on %s: the bucket's memory needs every layer on %s",
                qkeep_model_layer(m, l)->name, be ? be : "the host", want);
      return fail_json(c, "chain");
    }
  }
  const struct device *dev = layer_device(qkeep_model_layer(m, 0));
  struct qkeep_sync_entry *plan;
  size_t n, n_buckets;
  if (qkeep_sync_plan(m, c->bucket_bytes, &plan, &n, &n_buckets))
    return fail_json(c, "plan");
  size_t *bytes = calloc(n_buckets, sizeof *bytes), *count = calloc(n_buckets, sizeof *count), biggest = 0;
  for (size_t i = 0; i < n; i++) {
    size_t b = plan[i].bucket, end = plan[i].tensor.offset + qkeep_spec_bytes(&plan[i].tensor.spec);
    bytes[b] = end > bytes[b] ? end : bytes[b];
    count[b]++;
  }
  int64_t total = 0;
  for (size_t b = 0; b < n_buckets; b++) {
    total += (int64_t)bytes[b];
    biggest = bytes[b] > biggest ? bytes[b] : biggest;
  }
  struct qkeep_bucket_tensor **tensors = calloc(n_buckets, sizeof *tensors);
  for (size_t b = 0, i = 0; b < n_buckets; b++) {
    tensors[b] = malloc(count[b] * sizeof **tensors);
    for (size_t k = 0; k < count[b]; k++, i++)
      tensors[b][k] = plan[i].tensor;
  }
  /* The unique id goes from rank 0 to rank 1 through the pipe. */
  unsigned char id[128];
  if (!c->backend && sender) {
    if (qkeep_nccl_unique_id(NULL, id) ||
        (c->ranks > 1 && write(c->id_pipe[1], id, sizeof id) != (ssize_t)sizeof id))
      return fail_json(c, "nccl id");
  } else if (!c->backend && read(c->id_pipe[0], id, sizeof id) != (ssize_t)sizeof id) {
    return fail_json(c, "nccl id (rank 0 failed)");
  }
  /* On the CPU the trainer is endpoint 0 of an in-process pair and tr the receiver's endpoint. */
  struct qkeep_transport *tr, *pair[2] = {NULL, NULL};
  if (c->backend ? qkeep_transport_inprocess(2, pair)
                 : qkeep_transport_nccl(NULL, c->ranks, c->rank, id, &tr))
    return fail_json(c, c->backend ? "in-process transport" : "nccl");
  if (c->backend)
    tr = pair[1];
  /* The sender: every bucket staged on its device. A receiver that is not the sender: one receive
   * buffer. One rank: the bucket is received in place, and the peer is a device copy of it. */
  void **dbuf = calloc(n_buckets, sizeof *dbuf), *rx = NULL;
  if (sender) {
    struct ckpt *ck;
    unsigned char *host = malloc(biggest);
    if (ckpt_open(c->w1, &ck))
      return fail_json(c, "open W1");
    for (size_t b = 0, i = 0; b < n_buckets; b++) {
      memset(host, 0, bytes[b]);
      for (size_t k = 0; k < count[b]; k++, i++)
        if (ckpt_read(ck, ckpt_find(ck, plan[i].tensor.name), host + plan[i].tensor.offset))
          return fail_json(c, "read W1");
      if (buf_alloc(dev, on_device, bytes[b], &dbuf[b]) || buf_put(dev, on_device, dbuf[b], host, bytes[b]))
        return fail_json(c, "stage");
    }
    ckpt_close(ck);
    free(host);
  }
  if ((!sender || c->ranks == 1) && buf_alloc(dev, on_device, biggest, &rx))
    return fail_json(c, "receive buffer");
  struct {
    const void **p;
    size_t n, cap;
  } before = {0}, after = {0};
  qkeep_foreach_storage(m, remember, &before);
  double *raw = calloc((size_t)c->runs, sizeof *raw), *syn = calloc((size_t)c->runs, sizeof *syn);
  int64_t free0 = free_device_bytes(), lowest = free0, extra_storage = 0;
  for (int r = 0; r < c->runs; r++) {
    /* raw NCCL broadcast of the same buckets */
    model_sync(m);
    double t0 = tu_now();
    for (size_t b = 0; b < n_buckets; b++)
      if ((c->backend ? pair[0]->broadcast(pair[0]->ctx, dbuf[b], bytes[b], 0) ||
                            tr->broadcast(tr->ctx, rx, bytes[b], 0)
           : c->ranks == 1 ? dev_d2d(dev, rx, dbuf[b], bytes[b])
                           : tr->broadcast(tr->ctx, sender ? dbuf[b] : rx, bytes[b], 0)) ||
          model_sync(m))
        return fail_json(c, "raw broadcast");
    raw[r] = tu_now() - t0;
    /* the sync: broadcast, then the in-place reload of each completed layer */
    qkeep_sync *sy = NULL;
    struct qkeep_memory_stats ms = {.size = sizeof ms};
    qkeep_model_memory(m, &ms, true);
    if (receiver && qkeep_sync_begin(m, &sy))
      return fail_json(c, "sync begin");
    t0 = tu_now();
    for (size_t b = 0; b < n_buckets; b++) {
      /* NCCL with one rank receives in place; the in-process receiver copies into its own buffer. */
      struct qkeep_bucket bk = {sizeof bk, tensors[b], count[b], sender && !c->backend ? dbuf[b] : rx,
                                bytes[b],  on_device};
      if (c->backend && pair[0]->broadcast(pair[0]->ctx, dbuf[b], bytes[b], 0))
        return fail_json(c, "sync (trainer)");
      if (!receiver ? tr->broadcast(tr->ctx, dbuf[b], bytes[b], 0) || model_sync(m)
                    : qkeep_sync_receive(sy, tr, 0, &bk))
        return fail_json(c, "sync");
      int64_t f = free_device_bytes();
      if (f >= 0 && f < lowest)
        lowest = f;
    }
    if (receiver && qkeep_sync_end(sy))
      return fail_json(c, "sync end");
    syn[r] = tu_now() - t0;
    qkeep_model_memory(m, &ms, false);
    if (ms.storage_peak - ms.storage_bytes + ms.staging_peak > extra_storage)
      extra_storage = ms.storage_peak - ms.storage_bytes + ms.staging_peak;
  }
  if (receiver) {
    qkeep_foreach_storage(m, remember, &after);
    size_t moved = before.n == after.n ? 0 : before.n;
    for (size_t i = 0; i < before.n && i < after.n; i++)
      moved += before.p[i] != after.p[i];
    qkeep_model *cold;
    struct qkeep_digest a, b;
    if (qkeep_model_new_chain(plugins, n_plugins, &cold) || qkeep_model_load(cold, c->w1) ||
        qkeep_digest(m, &a) || qkeep_digest(cold, &b))
      return fail_json(c, "cold W1");
    qkeep_model_free(cold);
    double rt = median(raw, c->runs), st = median(syn, c->runs);
    printf("{\"bench\":\"sync\",\"model\":\"%s\",\"ranks\":%d,\"peer\":\"%s\",\"tensors\":%zu,"
           "\"bytes\":%lld,\"buckets\":%zu,\"bucket_bytes\":%zu,\"runs\":%d,\"peer_ms\":%.2f,"
           "\"peer_gbs\":%.2f,\"sync_ms\":%.2f,\"sync_gbs\":%.2f,\"sync_over_peer_bandwidth\":%.3f,"
           "\"peak_extra_device_bytes\":%lld,\"peak_extra_storage_bytes\":%lld,\"largest_bucket\":%zu,"
           "\"digest_equals_cold_w1\":%s,\"pointers_moved\":%zu,\"pwal\":\"%s\"}\n",
           c->model_name, c->ranks,
           c->backend      ? "inprocess_broadcast"
           : c->ranks == 1 ? "device_copy"
                           : "nccl_broadcast",
           n, (long long)total, n_buckets, c->bucket_bytes, c->runs, rt * 1e3, (double)total / rt / 1e9,
           st * 1e3, (double)total / st / 1e9, rt / st, free0 >= 0 ? (long long)(free0 - lowest) : -1LL,
           (long long)extra_storage, biggest, a.hi == b.hi && a.lo == b.lo ? "true" : "false", moved,
           c->backend ? "-" : c->pwal);
    fflush(stdout);
  }
  if (c->backend)
    pair[0]->close(pair[0]->ctx);
  tr->close(tr->ctx);
  for (size_t b = 0; b < n_buckets; b++) {
    if (dbuf[b])
      buf_free(dev, on_device, dbuf[b]);
    free(tensors[b]);
  }
  if (rx)
    buf_free(dev, on_device, rx);
  free(dbuf), free(tensors), free(bytes), free(count), free(raw), free(syn), free(before.p), free(after.p);
  qkeep_sync_plan_free(plan);
  qkeep_model_free(m);
  qkeep_plugins_close(plugins, n_plugins);
  qkeep_config_free(config);
  return 0;
}

/* libnccl can be loaded (in the probe's child). */
static int has_nccl(void) {
  const char *lib = getenv("QKEEP_NCCL_LIBRARY");
  return dlopen(lib && *lib ? lib : "libnccl.so.2", RTLD_NOW) != NULL;
}

/* fn's answer (0..255) from a child process, so that this one loads no CUDA library. */
static int probe(int (*fn)(void)) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0)
    _exit(fn() & 0xff);
  int status = 0;
  return pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) ? WEXITSTATUS(status) : 0;
}
static int probe_devices(void) { return probe(cuda_devices); }

int main(int argc, char **argv) {
  if (setenv("NCCL_NVLS_ENABLE", "0", 1) != 0) { /* before NCCL reads its environment, in every rank */
    perror("bench_sync: NCCL_NVLS_ENABLE");
    return 1;
  }
  const char *trace = getenv("QKEEP_BENCH_TRACE");
  if (trace && *trace && strcmp(trace, "0") != 0)
    tu_log_to_stderr(QKEEP_LOG_DEBUG);
  const char *which = argc > 1 ? argv[1] : "all";
  int runs = argc > 2 ? atoi(argv[2]) : 5;
  size_t bucket_mb = argc > 3 ? (size_t)atoll(argv[3]) : 1024;
  const char *backend = argc > 4 ? argv[4] : NULL, *pwal = getenv("QKEEP_BENCH_PWAL");
  if (backend && strcmp(backend, "reference") != 0 && strcmp(backend, "test-async") != 0) {
    fprintf(stderr, "bench_sync: BACKEND is reference or test-async (the CPU path), not %s\n", backend);
    return 2;
  }
  int gpus = backend ? 0 : probe_devices(), ranks = gpus >= 2 ? 2 : 1;
  if (gpus < 1 && !backend)
    backend = "reference"; /* no CUDA device: the sync path on the CPU */
  /* Checked in a child too: libnccl (a static CUDA runtime inside) is loaded only by the ranks. */
  bool nccl = backend || probe(has_nccl);
  if (!nccl) {
    printf(
        "{\"bench\":\"sync\",\"skipped\":\"no libnccl.so.2 (set QKEEP_NCCL_LIBRARY or LD_LIBRARY_PATH)\"}\n");
    return 0;
  }
  if (backend)
    printf("{\"bench\":\"sync\",\"note\":\"on the CPU (%s): one process, the trainer's buckets through the "
           "in-process transport into the receiver's buffer, against the same broadcast alone\"}\n",
           backend);
  else if (ranks == 1) /* the bucket path on one GPU: NCCL with one rank, against a device copy */
    printf("{\"bench\":\"sync\",\"note\":\"one CUDA device: one rank receives in place through NCCL with one "
           "rank, against a device copy; rank 0 -> rank 1 needs two GPUs\"}\n");
  int failed = 0;
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    if (strcmp(which, "all") != 0 && strcmp(which, shapes[s].name) != 0)
      continue;
    char *dir = tu_tmpdir("bench-sync"), *w0 = tu_path(dir, "w0"), *w1 = tu_path(dir, "w1");
    if (mkdir(w0, 0755) || mkdir(w1, 0755) || write_model(&shapes[s], w0, 1) ||
        write_model(&shapes[s], w1, 2)) {
      printf("{\"bench\":\"sync\",\"model\":\"%s\",\"error\":\"%s\"}\n", shapes[s].name, qkeep_errmsg());
      return 1;
    }
    struct rank_ctx c = {.ranks = ranks,
                         .runs = runs,
                         .bucket_bytes = bucket_mb << 20,
                         .w0 = w0,
                         .w1 = w1,
                         .dir = dir,
                         .model_name = shapes[s].name,
                         .backend = backend,
                         .pwal = pwal && *pwal ? pwal : "in-place"};
    if (pipe(c.id_pipe))
      return 1;
    /* Every rank in a fresh child: the parent never initialises CUDA (a child forked after that could
     * not use it), and no process loads the cuda-nvfp4 plugin or libnccl, each with a static CUDA
     * runtime, a second time after unloading it (a process that did crashed on its second model, on one
     * H200, 2026-12-01). */
    fflush(stdout);
    pid_t child[2] = {-1, -1};
    for (int r = 0; r < ranks; r++)
      if ((child[r] = fork()) == 0) {
        c.rank = r;
        _exit(run_rank(&c));
      }
    for (int r = 0; r < ranks; r++) {
      int status = 0;
      if (child[r] < 0 || waitpid(child[r], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status)) {
        failed = 1;
        if (child[r] > 0 && WIFSIGNALED(status))
          printf("{\"bench\":\"sync\",\"model\":\"%s\",\"rank\":%d,\"error\":\"killed by signal %d\"}\n",
                 shapes[s].name, r, WTERMSIG(status));
      }
    }
    close(c.id_pipe[0]), close(c.id_pipe[1]);
    tu_rmtree(dir);
    free(dir), free(w0), free(w1);
  }
  return failed;
}
