/*
 * bench_forward.c: what a decode or prefill step's linears cost through the engine forward.
 * A model qkeep loads (synthetic ModelOpt NVFP4, real names and shapes, see synth_nvfp4.h) on the
 * chain `cuda-nvfp4, reference`; every linear of a decoder layer (the attention projections and
 * the MLP, as qkeep's layers group them) and, for the MoE model, the routed experts (W13 then W2,
 * top-8 of 128 with random distinct ids per token) run through qkeep_layer_forward on bf16
 * activations, captured in one CUDA graph; against cuBLAS bf16 (cublasGemmEx) on the same shapes
 * in the same run, also captured. Models:
 *   llama3-8b      Llama-3-8B's decoder layer (q, k, v 4096 -> 4096/1024/1024, o 4096 -> 4096,
 *                  gate, up 4096 -> 14336, down 14336 -> 4096), 2 layers (250 MB of NVFP4);
 *   qwen3-30b-a3b  Qwen3-30B-A3B's experts (128 x (gate, up 2048 -> 768; down 768 -> 2048)),
 *                  4 layers (the attention layers too: their linears are not timed here).
 * The graph runs the layers in order, so a layer's weights are out of L2 when it comes again
 * (the model exceeds the H200's L2); time per decoder layer = graph time / (passes x layers),
 * median of 7 graph runs, after a warm-up. The MoE peer is cuBLAS's batched GEMM over the experts
 * the step hits, each with as many rows as the busiest expert (the padded form; the gather of the
 * rows and the weighted sum are not in the peer's time, so the peer is favoured). The ceiling is
 * the NVFP4 bytes the step must read (codes + block scales of the linears or of the experts hit)
 * over the device copy's read + write bandwidth, which the bench measures first.
 *
 *   bench_forward [MODEL|all] [M,...]          (default: all 1,16,64,256)
 *
 * One JSON object per line:
 *   {"bench":"d2d_copy", ...}
 *   {"bench":"forward_linear","model":..,"layer":"self_attn.qkv_proj","M":..,"N":..,"K":..,
 *    "qkeep_us":..,"peer":"cublas_bf16","peer_us":..,"ratio":..}   (ratio > 1: qkeep faster)
 *   {"bench":"forward_step","model":..,"M":..,"calls":..,"qkeep_us":..,"peer_us":..,"ratio":..,
 *    "ceiling_us":..,"of_ceiling":..}   the sum over one decoder layer
 * Writes the checkpoints under $TMPDIR (or /tmp) and removes them at the end. Needs a CUDA device
 * and the cuda-nvfp4 plugin (QKEEP_PLUGIN_PATH, as make bench-gpu sets it); without a device it
 * prints a "skipped" line and exits 0.
 */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cuda_check.h"
#include "private.h"
#include "synth_nvfp4.h"
#include "testutil.h"

enum { RUNS = 7, MIN_LAUNCHES = 200, TOPK = 8 };

#define BLAS_OK(call)                                                                                        \
  do {                                                                                                       \
    cublasStatus_t s_ = (call);                                                                              \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                       \
      fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #call, (int)s_);                  \
      exit(1);                                                                                               \
    }                                                                                                        \
  } while (0)

static cudaStream_t stream;
static cublasHandle_t blas;

static void *dev_zeros(size_t bytes) {
  void *p;
  CUDA_OK(cudaMalloc(&p, bytes ? bytes : 1));
  CUDA_OK(cudaMemsetAsync(p, 0, bytes ? bytes : 1, stream));
  return p;
}

/* bf16 values uniform in [-1, 1) (bf16 weights for the peer, activations), from the seed. */
static void *dev_random_bf16(size_t n, uint64_t seed) {
  uint16_t *h = malloc(n * 2);
  if (!h)
    exit(1);
  for (size_t i = 0; i < n; i++)
    h[i] = qkeep_f32_to_bf16(tu_randf(&seed) * 2.0f - 1.0f);
  void *d = dev_zeros(n * 2);
  CUDA_OK(cudaMemcpy(d, h, n * 2, cudaMemcpyHostToDevice));
  free(h);
  return d;
}

/* bf16 0x3c3c (about 0.0115) everywhere: the peer's weights and inputs (cuBLAS's time does not
 * depend on the values; gigabytes of host-made random numbers would). */
static void *dev_filled_bf16(size_t n) {
  void *d;
  CUDA_OK(cudaMalloc(&d, n ? n * 2 : 1));
  CUDA_OK(cudaMemsetAsync(d, 0x3c, n * 2, stream));
  return d;
}

static void *dev_copy(const void *h, size_t bytes) {
  void *d = dev_zeros(bytes);
  CUDA_OK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
  return d;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* One unit of work the graph repeats: `launch(ctx, pass)` enqueues it on `stream`. */
typedef void (*launch_fn)(void *ctx);

/* Microseconds per pass: passes of launch(ctx) captured in one graph (at least MIN_LAUNCHES
 * units, `units` per pass), the median of RUNS graph runs after a warm-up. */
static double time_graph(launch_fn launch, void *ctx, int units) {
  int passes = (MIN_LAUNCHES + units - 1) / units;
  launch(ctx); /* warm-up outside the graph: lazy module loads, cuBLAS's heuristics */
  CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int p = 0; p < passes; p++)
    launch(ctx);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, stream));
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  double runs[RUNS];
  for (int r = 0; r < RUNS; r++) {
    float ms;
    CUDA_OK(cudaEventRecord(start, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaEventRecord(stop, stream));
    CUDA_OK(cudaEventSynchronize(stop));
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    runs[r] = 1000.0 * ms / passes;
  }
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  qsort(runs, RUNS, sizeof runs[0], cmp_double);
  return runs[RUNS / 2];
}

/* Device copy bandwidth, read + write bytes per second. */
static double copy_bandwidth(void) {
  size_t bytes = (size_t)1 << 30;
  void *a = dev_zeros(bytes), *b = dev_zeros(bytes);
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  double runs[RUNS];
  for (int r = -1; r < RUNS; r++) {
    float ms;
    CUDA_OK(cudaEventRecord(start, stream));
    CUDA_OK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream));
    CUDA_OK(cudaEventRecord(stop, stream));
    CUDA_OK(cudaEventSynchronize(stop));
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    if (r >= 0)
      runs[r] = 2.0 * (double)bytes / (ms / 1000.0);
  }
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  CUDA_OK(cudaFree(a));
  CUDA_OK(cudaFree(b));
  qsort(runs, RUNS, sizeof runs[0], cmp_double);
  printf("{\"bench\":\"d2d_copy\",\"bytes\":%zu,\"gbps\":%.1f,\"runs\":%d}\n", bytes, runs[RUNS / 2] / 1e9,
         RUNS);
  return runs[RUNS / 2];
}

/* ---- the calls of one step ---- */

/* One qkeep forward and the cuBLAS GEMMs that stand for it. */
struct call {
  qkeep_layer *layer;
  struct qkeep_forward_args a;
  int64_t n, k;                  /* the GEMM's shape (per expert for MoE) */
  int64_t peer_m;                /* rows of each peer GEMM (MoE: the busiest expert's) */
  int peer_batch;                /* 1 for a linear; the experts hit for MoE */
  void *peer_w;                  /* a linear's bf16 weight [n, k] */
  const void **peer_a, **peer_b; /* MoE: device arrays of weight and activation pointers */
  void **peer_c;
  void *peer_x, *peer_y;
  double read_bytes; /* NVFP4 bytes the call must read */
};

struct step {
  struct call *calls;
  size_t n;
  int layers; /* decoder layers the calls cover */
};

static void qkeep_step(void *ctx) {
  struct step *s = ctx;
  for (size_t i = 0; i < s->n; i++)
    QKEEP_OK(qkeep_layer_forward(s->calls[i].layer, &s->calls[i].a));
}

static void peer_call(const struct call *c) {
  const float one = 1.0f, zero = 0.0f;
  if (c->peer_batch == 1 && c->peer_w)
    BLAS_OK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)c->n, (int)c->peer_m, (int)c->k, &one,
                         c->peer_w, CUDA_R_16BF, (int)c->k, c->peer_x, CUDA_R_16BF, (int)c->k, &zero,
                         c->peer_y, CUDA_R_16BF, (int)c->n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  else
    BLAS_OK(cublasGemmBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)c->n, (int)c->peer_m, (int)c->k, &one,
                                (const void *const *)c->peer_a, CUDA_R_16BF, (int)c->k,
                                (const void *const *)c->peer_b, CUDA_R_16BF, (int)c->k, &zero,
                                (void *const *)c->peer_c, CUDA_R_16BF, (int)c->n, c->peer_batch,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

static void peer_step(void *ctx) {
  struct step *s = ctx;
  for (size_t i = 0; i < s->n; i++)
    peer_call(&s->calls[i]);
}

static struct call *push(struct step *s) {
  struct call *c = realloc(s->calls, (s->n + 1) * sizeof *c);
  if (!c)
    exit(1);
  s->calls = c;
  memset(&c[s->n], 0, sizeof c[s->n]);
  return &c[s->n++];
}

static void finish_call(struct call *c, int64_t y_elems) {
  c->a.size = sizeof c->a;
  c->a.x_dtype = c->a.y_dtype = QKEEP_DTYPE_BF16;
  c->a.stream = stream;
  c->a.y = dev_zeros((size_t)y_elems * 2);
  size_t need = 0;
  QKEEP_OK(qkeep_layer_workspace(c->layer, &c->a, &need));
  c->a.workspace = need ? dev_zeros(need) : NULL;
  c->a.workspace_bytes = need;
}

/* Routing for m tokens: TOPK distinct experts each, random; the weights sum to 1 per token. */
static void route(int64_t m, int64_t experts, uint64_t seed, int32_t *ids, float *weights) {
  for (int64_t t = 0; t < m; t++)
    for (int s = 0; s < TOPK; s++) {
      int32_t e;
      bool taken;
      do {
        e = (int32_t)(tu_rand(&seed) % (uint64_t)experts), taken = false;
        for (int j = 0; j < s; j++)
          taken |= ids[t * TOPK + j] == e;
      } while (taken);
      ids[t * TOPK + s] = e, weights[t * TOPK + s] = 1.0f / TOPK;
    }
}

/* The routed W13 and W2 calls of an MoE layer at m tokens, and their padded batched peers. */
static void add_moe(struct step *s, qkeep_layer *l, const struct qkeep_layer_info *info, int64_t m,
                    uint64_t seed) {
  const int64_t e = info->experts, h = info->k, inter = info->n / 2;
  int32_t *ids = malloc((size_t)(m * TOPK) * sizeof *ids);
  float *weights = malloc((size_t)(m * TOPK) * sizeof *weights);
  int64_t *rows = calloc((size_t)e, sizeof *rows), busiest = 0;
  route(m, e, seed, ids, weights);
  for (int64_t i = 0; i < m * TOPK; i++)
    busiest = ++rows[ids[i]] > busiest ? rows[ids[i]] : busiest;
  int hit = 0;
  for (int64_t x = 0; x < e; x++)
    hit += rows[x] > 0;
  void *d_ids = dev_copy(ids, (size_t)(m * TOPK) * sizeof *ids);
  void *d_weights = dev_copy(weights, (size_t)(m * TOPK) * sizeof *weights);
  for (int w = 0; w < 2; w++) {
    struct call *c = push(s);
    c->layer = l;
    c->a.m = m, c->a.topk = TOPK, c->a.topk_ids = d_ids;
    c->a.matrix = w ? QKEEP_MOE_W2 : QKEEP_MOE_W13;
    c->a.topk_weights = w ? d_weights : NULL;
    c->n = w ? h : 2 * inter, c->k = w ? inter : h;
    c->a.x = dev_random_bf16((size_t)((w ? m * TOPK : m) * c->k), seed + 10 + (uint64_t)w);
    finish_call(c, (w ? m : m * TOPK) * c->n);
    c->read_bytes = (double)hit * (double)(c->n * c->k) * (0.5 + 1.0 / 16);
    /* The peer: `hit` GEMMs of busiest x k by n x k, weights of its own (bf16, one per expert hit). */
    c->peer_m = busiest, c->peer_batch = hit;
    const void **a = malloc((size_t)hit * sizeof *a), **b = malloc((size_t)hit * sizeof *b);
    void **cc = malloc((size_t)hit * sizeof *cc);
    c->peer_x = dev_filled_bf16((size_t)(hit * busiest * c->k));
    c->peer_y = dev_zeros((size_t)(hit * busiest * c->n) * 2);
    for (int i = 0; i < hit; i++) {
      a[i] = dev_filled_bf16((size_t)(c->n * c->k));
      b[i] = (const char *)c->peer_x + (size_t)(i * busiest * c->k) * 2;
      cc[i] = (char *)c->peer_y + (size_t)(i * busiest * c->n) * 2;
    }
    c->peer_a = (const void **)dev_copy(a, (size_t)hit * sizeof *a);
    c->peer_b = (const void **)dev_copy(b, (size_t)hit * sizeof *b);
    c->peer_c = (void **)dev_copy(cc, (size_t)hit * sizeof *cc);
    free(a), free(b), free(cc);
  }
  free(ids), free(weights), free(rows);
}

/* The linear calls of every decoder layer of the model (or its MoE calls), at m rows. Layers on
 * the host (embeddings, lm_head, the router) are not part of it. */
static void build(qkeep_model *model, bool moe, int64_t m, struct step *s) {
  memset(s, 0, sizeof *s);
  for (size_t i = 0; i < qkeep_model_layer_count(model); i++) {
    qkeep_layer *l = qkeep_model_layer(model, i);
    struct qkeep_layer_device dev = {.size = sizeof dev};
    struct qkeep_layer_info info = {.size = sizeof info};
    QKEEP_OK(qkeep_layer_device(l, &dev));
    QKEEP_OK(qkeep_layer_get_info(l, &info));
    if (!dev.forward || dev.type != QKEEP_DEVICE_CUDA || strncmp(info.name, "model.layers.", 13) != 0)
      continue;
    if (info.kind == QKEEP_LAYER_MOE) {
      if (moe)
        add_moe(s, l, &info, m, 7 + i);
      continue;
    }
    if (moe)
      continue;
    struct call *c = push(s);
    c->layer = l, c->a.m = m, c->n = info.n, c->k = info.k;
    c->a.x = dev_random_bf16((size_t)(m * info.k), 3 + i);
    finish_call(c, m * info.n);
    c->read_bytes = (double)(info.n * info.k) * (0.5 + 1.0 / 16);
    c->peer_m = m, c->peer_batch = 1;
    c->peer_w = dev_filled_bf16((size_t)(info.n * info.k));
    c->peer_x = (void *)c->a.x;
    c->peer_y = dev_zeros((size_t)(m * info.n) * 2);
  }
  for (size_t i = 0; i < s->n; i++) { /* "model.layers.<i>.": the decoder layers covered */
    int index = atoi(s->calls[i].layer->name + 13);
    s->layers = index + 1 > s->layers ? index + 1 : s->layers;
  }
}

static void step_free(struct step *s) {
  for (size_t i = 0; i < s->n; i++) {
    struct call *c = &s->calls[i];
    void *own[] = {c->a.y, c->a.workspace, c->peer_w, c->peer_y};
    for (size_t b = 0; b < sizeof own / sizeof own[0]; b++)
      if (own[b])
        CUDA_OK(cudaFree(own[b]));
    /* x is shared with the linear peer; the MoE peer's x, ids and weight arrays are its own */
    CUDA_OK(cudaFree((void *)c->a.x));
    if (c->peer_a) {
      const void **a = malloc((size_t)c->peer_batch * sizeof *a);
      CUDA_OK(cudaMemcpy(a, c->peer_a, (size_t)c->peer_batch * sizeof *a, cudaMemcpyDeviceToHost));
      for (int e = 0; e < c->peer_batch; e++)
        CUDA_OK(cudaFree((void *)a[e]));
      free(a);
      CUDA_OK(cudaFree(c->peer_a));
      CUDA_OK(cudaFree(c->peer_b));
      CUDA_OK(cudaFree(c->peer_c));
      CUDA_OK(cudaFree(c->peer_x));
      if (c->a.matrix == QKEEP_MOE_W2) { /* the pair's routing, owned once */
        CUDA_OK(cudaFree((void *)c->a.topk_ids));
        CUDA_OK(cudaFree((void *)c->a.topk_weights));
      }
    }
  }
  free(s->calls);
}

/* One call alone, cycling the copies of the same linear in every decoder layer. */
struct same_linear {
  struct step *s;
  const char *suffix;
};
static bool same_suffix(const char *name, const char *suffix) {
  const char *dot = strchr(name + 13, '.');
  return dot && strcmp(dot + 1, suffix) == 0;
}
static void qkeep_linear(void *ctx) {
  struct same_linear *x = ctx;
  for (size_t i = 0; i < x->s->n; i++)
    if (same_suffix(x->s->calls[i].layer->name, x->suffix))
      QKEEP_OK(qkeep_layer_forward(x->s->calls[i].layer, &x->s->calls[i].a));
}
static void peer_linear(void *ctx) {
  struct same_linear *x = ctx;
  for (size_t i = 0; i < x->s->n; i++)
    if (same_suffix(x->s->calls[i].layer->name, x->suffix))
      peer_call(&x->s->calls[i]);
}

static void bench_model(const char *model_name, qkeep_model *model, bool moe, int64_t m, double bandwidth) {
  struct step s;
  build(model, moe, m, &s);
  if (!s.n || !s.layers) {
    printf("{\"bench\":\"forward_step\",\"model\":\"%s\",\"M\":%lld,\"error\":\"no device layer to run\"}\n",
           model_name, (long long)m);
    step_free(&s);
    return;
  }
  double read = 0;
  for (size_t i = 0; i < s.n; i++)
    read += s.calls[i].read_bytes;
  double q[3], p[3];
  for (int r = 0; r < 3; r++) /* interleaved */
    q[r] = time_graph(qkeep_step, &s, (int)s.n), p[r] = time_graph(peer_step, &s, (int)s.n);
  qsort(q, 3, sizeof q[0], cmp_double), qsort(p, 3, sizeof p[0], cmp_double);
  double q_us = q[1] / s.layers, p_us = p[1] / s.layers, ceiling = 1e6 * read / s.layers / bandwidth;
  if (!moe) /* each linear of a layer alone, for where the time goes */
    for (size_t i = 0; i < s.n; i++) {
      const char *name = s.calls[i].layer->name, *suffix = strchr(name + 13, '.') + 1;
      if (atoi(name + 13) != 0)
        continue;
      struct same_linear x = {&s, suffix};
      double lq = time_graph(qkeep_linear, &x, s.layers) / s.layers,
             lp = time_graph(peer_linear, &x, s.layers) / s.layers;
      printf(
          "{\"bench\":\"forward_linear\",\"model\":\"%s\",\"layer\":\"%s\",\"M\":%lld,\"N\":%lld,\"K\":%lld,"
          "\"qkeep_us\":%.2f,\"peer\":\"cublas_bf16\",\"peer_us\":%.2f,\"ratio\":%.2f}\n",
          model_name, suffix, (long long)m, (long long)s.calls[i].n, (long long)s.calls[i].k, lq, lp,
          lp / lq);
    }
  printf(
      "{\"bench\":\"forward_step\",\"model\":\"%s\",\"scheme\":\"modelopt-nvfp4\",\"M\":%lld,\"calls\":%zu,"
      "\"qkeep_us\":%.2f,\"peer\":\"%s\",\"peer_us\":%.2f,\"ratio\":%.2f,\"ceiling_us\":%.2f,"
      "\"of_ceiling\":%.2f,\"layers\":%d,\"runs\":%d,\"method\":\"graph\"}\n",
      model_name, (long long)m, s.n / (size_t)s.layers, q_us,
      moe ? "cublas_bf16_batched_padded" : "cublas_bf16", p_us, p_us / q_us, ceiling, ceiling / q_us,
      s.layers, RUNS);
  fflush(stdout);
  step_free(&s);
}

int main(int argc, char **argv) {
  const char *which = argc > 1 ? argv[1] : "all", *ms = argc > 2 ? argv[2] : "1,16,64,256";
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
    printf("{\"bench\":\"forward_step\",\"skipped\":\"no CUDA device\"}\n");
    return 0;
  }
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  BLAS_OK(cublasCreate(&blas));
  BLAS_OK(cublasSetStream(blas, stream));
  double bandwidth = copy_bandwidth();
  char *dir = tu_tmpdir("bench-forward");
  if (!dir)
    return 1;
  char *ini = tu_path(dir, "qkeep.ini");
  static const char cfg[] = "[qkeep]\nbackend = cuda-nvfp4, reference\n";
  qkeep_config *config;
  qkeep_plugin **plugins;
  size_t n_plugins;
  if (tu_write_file(ini, cfg, strlen(cfg)) || qkeep_config_load(ini, &config) ||
      qkeep_plugins_open_config(config, &plugins, &n_plugins)) {
    printf("{\"bench\":\"forward_step\",\"error\":\"plugins: %s\"}\n", qkeep_errmsg());
    return 1;
  }
  int rc = 0;
  for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0] && !rc; sh++) {
    struct shape s = shapes[sh];
    bool moe = s.experts > 0;
    const char *name = moe ? "qwen3-30b-a3b" : "llama3-8b";
    if (strcmp(which, "all") != 0 && strcmp(which, name) != 0)
      continue;
    s.layers = moe ? 4 : 2, s.vocab = 1024; /* embeddings and lm_head stay on the host: not timed */
    char *path = tu_path(dir, name);
    qkeep_model *model = NULL;
    if (mkdir(path, 0755) || write_model(&s, path, 1) || qkeep_model_new_chain(plugins, n_plugins, &model) ||
        qkeep_model_load(model, path)) {
      printf("{\"bench\":\"forward_step\",\"model\":\"%s\",\"error\":\"%s\"}\n", name, qkeep_errmsg());
      rc = 1;
    }
    for (const char *p = ms; !rc && *p;) {
      int64_t m = strtoll(p, (char **)&p, 10);
      if (m > 0)
        bench_model(name, model, moe, m, bandwidth);
      p += *p == ',';
      if (m <= 0 || (*p && (*p < '0' || *p > '9')))
        break;
    }
    qkeep_model_free(model);
    tu_rmtree(path);
    free(path);
  }
  qkeep_plugins_close(plugins, n_plugins);
  qkeep_config_free(config);
  tu_rmtree(dir);
  free(dir), free(ini);
  BLAS_OK(cublasDestroy(blas));
  CUDA_OK(cudaStreamDestroy(stream));
  return rc;
}
