/*
 * check_gpu_graph.c: the engine loop on the GPU (`make check-gpu`; exits 77 without a device).
 * For NVFP4 (ModelOpt and compressed-tensors naming) and MXFP4 models with dense and MoE
 * layers, written by qkeep's quantizer from two f32 sources (W0, W1):
 *   - every forward-able layer of the model (linear at m 4 bf16 and m 64 f32, one MoE expert,
 *     routed MoE W13 and W2) is captured with qkeep_layer_forward into one CUDA graph under
 *     cudaStreamCaptureModeGlobal (a forbidden call inside fails the capture), and the graph
 *     holds kernel and memset nodes only: nothing allocated, freed, copied or waited for;
 *   - the graph replayed after qkeep_model_reload(W1) gives outputs bit for bit equal to a
 *     graph captured on a cold W1 model, and different from W0's;
 *   - the same after a reload back to W0 and a weight sync (one rank, host buckets) to W1;
 *   - all of it again with cuda-nvfp4's FP8 activations on (ModelOpt NVFP4).
 */
#include <check.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_testutil.h"
#include "qkeep/qkeep_backend_util.h"

/* Multiples of 32 (MXFP4's block) and of 16 (NVFP4's) */
#define H 256
#define KV 64
#define I 384
#define E_I 128
#define EXPERTS 4
#define VOCAB 100
enum { TOPK = 2, TOKENS = 5 };

static qkeep_plugin *gpu, *ref;
static char *dir;

#define CUDA_OK(call)                                                                                        \
  do {                                                                                                       \
    cudaError_t e_ = (call);                                                                                 \
    ck_assert_msg(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                               \
  } while (0)

static void setup(void) {
  dir = tu_tmpdir("gpu-graph");
  ck_assert_ptr_nonnull(dir);
}

static void teardown(void) {
  tu_rmtree(dir);
  free(dir);
}

/* One captured call: the arguments and the device buffers they point at. */
struct call {
  qkeep_layer *layer;
  struct qkeep_forward_args a;
  size_t y_bytes;
  void *buffers[5];
};

/* A model's captured forward. */
struct run {
  struct call *calls;
  size_t n, cap;
  cudaStream_t stream;
  cudaGraphExec_t exec;
};

static void *device_copy(const void *host, size_t bytes) {
  void *d;
  CUDA_OK(cudaMalloc(&d, bytes ? bytes : 1));
  if (bytes)
    CUDA_OK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
  return d;
}

/* x of rows x cols in dtype, uniform from the seed, on the device. */
static void *device_x(int64_t rows, int64_t cols, enum qkeep_dtype dt, uint64_t seed) {
  size_t n = (size_t)(rows * cols), es = dt == QKEEP_DTYPE_F32 ? 4 : 2;
  unsigned char *h = malloc(n * es);
  uint64_t s = seed;
  for (size_t i = 0; i < n; i++) {
    float v = tu_randf(&s) * 2.0f - 1.0f;
    if (dt == QKEEP_DTYPE_F32)
      memcpy(h + 4 * i, &v, 4);
    else {
      uint16_t b = qkeep_f32_to_bf16(v);
      memcpy(h + 2 * i, &b, 2);
    }
  }
  void *d = device_copy(h, n * es);
  free(h);
  return d;
}

static void add_call(struct run *r, qkeep_layer *layer, struct qkeep_forward_args a, int64_t y_rows,
                     int64_t y_cols, void *extra0, void *extra1) {
  if (r->n == r->cap) {
    r->cap = r->cap ? 2 * r->cap : 16;
    r->calls = realloc(r->calls, r->cap * sizeof *r->calls);
    ck_assert_ptr_nonnull(r->calls);
  }
  struct call *c = &r->calls[r->n++];
  memset(c, 0, sizeof *c);
  c->layer = layer;
  c->y_bytes = (size_t)(y_rows * y_cols) * (a.y_dtype == QKEEP_DTYPE_F32 ? 4 : 2);
  CUDA_OK(cudaMalloc(&a.y, c->y_bytes));
  CUDA_OK(cudaMemset(a.y, 0, c->y_bytes));
  size_t need = 0;
  ck_assert_msg(qkeep_layer_workspace(layer, &a, &need) == 0, "%s", qkeep_errmsg());
  if (need)
    CUDA_OK(cudaMalloc(&a.workspace, need));
  a.workspace_bytes = need;
  a.stream = r->stream;
  c->a = a;
  c->buffers[0] = (void *)a.x, c->buffers[1] = a.y, c->buffers[2] = a.workspace;
  c->buffers[3] = extra0, c->buffers[4] = extra1;
}

/* Every forward of the model's GPU layers, with inputs from fixed seeds (the same for every model). */
static void build(qkeep_model *m, struct run *r, size_t *routed) {
  memset(r, 0, sizeof *r);
  CUDA_OK(cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking));
  for (size_t i = 0; i < qkeep_model_layer_count(m); i++) {
    qkeep_layer *l = qkeep_model_layer(m, i);
    struct qkeep_layer_device dev = {.size = sizeof dev};
    struct qkeep_layer_info info = {.size = sizeof info};
    ck_assert_int_eq(qkeep_layer_device(l, &dev), 0);
    ck_assert_int_eq(qkeep_layer_get_info(l, &info), 0);
    if (!dev.forward || dev.type != QKEEP_DEVICE_CUDA)
      continue;
    ck_assert_msg(dev.graph_safe, "%s: cuda-nvfp4 should be graph-safe", info.name);
    uint64_t seed = 1000 + i;
    if (info.kind == QKEEP_LAYER_LINEAR) {
      struct qkeep_forward_args a = {
          .size = sizeof a, .m = 4, .x_dtype = QKEEP_DTYPE_BF16, .y_dtype = QKEEP_DTYPE_BF16};
      a.x = device_x(4, info.k, a.x_dtype, seed);
      add_call(r, l, a, 4, info.n, NULL, NULL);
      a = (struct qkeep_forward_args){
          .size = sizeof a, .m = 64, .x_dtype = QKEEP_DTYPE_F32, .y_dtype = QKEEP_DTYPE_F32};
      a.x = device_x(64, info.k, a.x_dtype, seed + 7);
      add_call(r, l, a, 64, info.n, NULL, NULL);
      continue;
    }
    ck_assert(dev.routed);
    const int64_t tokens = TOKENS, hidden = info.k, inter = info.n / 2, e = info.experts;
    int32_t ids[TOKENS * TOPK];
    float weights[TOKENS * TOPK];
    for (int64_t p = 0; p < tokens * TOPK; p++)
      ids[p] = (int32_t)((p * 3 + p / TOPK) % e), weights[p] = 0.25f + 0.5f * (float)(p % TOPK);
    void *d_ids = device_copy(ids, sizeof ids), *d_weights = device_copy(weights, sizeof weights);
    struct qkeep_forward_args a = {.size = sizeof a,
                                   .m = tokens,
                                   .x_dtype = QKEEP_DTYPE_BF16,
                                   .y_dtype = QKEEP_DTYPE_BF16,
                                   .matrix = QKEEP_MOE_W13,
                                   .topk = TOPK,
                                   .topk_ids = d_ids};
    a.x = device_x(tokens, hidden, a.x_dtype, seed);
    add_call(r, l, a, tokens * TOPK, 2 * inter, d_ids, d_weights);
    a = (struct qkeep_forward_args){.size = sizeof a,
                                    .m = tokens,
                                    .x_dtype = QKEEP_DTYPE_BF16,
                                    .y_dtype = QKEEP_DTYPE_F32,
                                    .matrix = QKEEP_MOE_W2,
                                    .topk = TOPK,
                                    .topk_ids = d_ids,
                                    .topk_weights = d_weights};
    a.x = device_x(tokens * TOPK, inter, a.x_dtype, seed + 1);
    add_call(r, l, a, tokens, hidden, NULL, NULL);
    a = (struct qkeep_forward_args){.size = sizeof a,
                                    .m = 3,
                                    .x_dtype = QKEEP_DTYPE_F32,
                                    .y_dtype = QKEEP_DTYPE_F32,
                                    .expert = (int32_t)(e - 1),
                                    .matrix = QKEEP_MOE_W13};
    a.x = device_x(3, hidden, a.x_dtype, seed + 2);
    add_call(r, l, a, 3, 2 * inter, NULL, NULL);
    ++*routed;
  }
  ck_assert_uint_gt(r->n, 0);
}

/* Captures every call into one graph under the strictest mode, checks its nodes, instantiates it. */
static void capture(struct run *r) {
  CUDA_OK(cudaStreamBeginCapture(r->stream, cudaStreamCaptureModeGlobal));
  int rc = 0;
  size_t failed = 0;
  for (size_t i = 0; i < r->n && !rc; i++)
    if ((rc = qkeep_layer_forward(r->calls[i].layer, &r->calls[i].a)))
      failed = i;
  cudaGraph_t graph = NULL;
  cudaError_t end = cudaStreamEndCapture(r->stream, &graph);
  ck_assert_msg(rc == 0, "call %zu inside the capture: %s", failed, qkeep_errmsg());
  ck_assert_msg(end == cudaSuccess, "the capture was invalidated: %s", cudaGetErrorString(end));
  size_t nodes = 0;
  CUDA_OK(cudaGraphGetNodes(graph, NULL, &nodes));
  cudaGraphNode_t *list = calloc(nodes, sizeof *list);
  CUDA_OK(cudaGraphGetNodes(graph, list, &nodes));
  for (size_t i = 0; i < nodes; i++) {
    enum cudaGraphNodeType type;
    CUDA_OK(cudaGraphNodeGetType(list[i], &type));
    ck_assert_msg(type == cudaGraphNodeTypeKernel || type == cudaGraphNodeTypeMemset,
                  "graph node %zu of type %d: a forward may launch kernels and memsets only", i, (int)type);
  }
  free(list);
  CUDA_OK(cudaGraphInstantiate(&r->exec, graph, 0));
  CUDA_OK(cudaGraphDestroy(graph));
}

/* Replays the graph and returns every output, concatenated (malloc'd; *bytes its size). */
static unsigned char *replay(struct run *r, size_t *bytes) {
  for (size_t i = 0; i < r->n; i++)
    CUDA_OK(cudaMemsetAsync(r->calls[i].a.y, 0xff, r->calls[i].y_bytes, r->stream));
  CUDA_OK(cudaGraphLaunch(r->exec, r->stream));
  CUDA_OK(cudaStreamSynchronize(r->stream));
  size_t total = 0;
  for (size_t i = 0; i < r->n; i++)
    total += r->calls[i].y_bytes;
  unsigned char *out = malloc(total), *p = out;
  for (size_t i = 0; i < r->n; i++) {
    CUDA_OK(cudaMemcpy(p, r->calls[i].a.y, r->calls[i].y_bytes, cudaMemcpyDeviceToHost));
    p += r->calls[i].y_bytes;
  }
  *bytes = total;
  return out;
}

static void run_free(struct run *r) {
  for (size_t i = 0; i < r->n; i++)
    for (int b = 0; b < 5; b++)
      if (r->calls[i].buffers[b])
        CUDA_OK(cudaFree(r->calls[i].buffers[b]));
  free(r->calls);
  CUDA_OK(cudaGraphExecDestroy(r->exec));
  CUDA_OK(cudaStreamDestroy(r->stream));
}

/* W1 as one host bucket of the model's sync plan, read from the checkpoint by name, then synced. */
static void sync_to(qkeep_model *m, const char *w1) {
  struct qkeep_sync_entry *plan;
  size_t n, n_buckets;
  ck_assert_int_eq(qkeep_sync_plan(m, (size_t)1 << 40, &plan, &n, &n_buckets), 0);
  ck_assert_uint_eq(n_buckets, 1);
  size_t bytes = 0;
  for (size_t i = 0; i < n; i++) {
    size_t end = plan[i].tensor.offset + qkeep_spec_bytes(&plan[i].tensor.spec);
    bytes = end > bytes ? end : bytes;
  }
  unsigned char *buf = calloc(1, bytes + 1);
  struct qkeep_bucket_tensor *tensors = calloc(n, sizeof *tensors);
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(w1, &ck), 0);
  for (size_t i = 0; i < n; i++) {
    const struct ckpt_tensor *t = ckpt_find(ck, plan[i].tensor.name);
    ck_assert_msg(t != NULL, "%s not in %s", plan[i].tensor.name, w1);
    ck_assert_int_eq(ckpt_read(ck, t, buf + plan[i].tensor.offset), 0);
    tensors[i] = plan[i].tensor;
  }
  qkeep_sync *sy;
  ck_assert_int_eq(qkeep_sync_begin(m, &sy), 0);
  struct qkeep_bucket b = {sizeof b, tensors, n, buf, bytes, false};
  ck_assert_msg(qkeep_sync_bucket(sy, &b) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_sync_end(sy) == 0, "%s", qkeep_errmsg());
  ckpt_close(ck);
  free(tensors);
  free(buf);
  qkeep_sync_plan_free(plan);
}

static qkeep_model *load(const char *path) {
  qkeep_plugin *chain[] = {gpu, ref};
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new_chain(chain, 2, &m), 0);
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

static char *quantize(const char *source, const char *scheme, const char *out) {
  char *path = tu_path(dir, out);
  struct qkeep_quantize_options o = {.size = sizeof o, .scheme = scheme};
  ck_assert_msg(qkeep_quantize(source, path, &o) == 0, "%s: %s", scheme, qkeep_errmsg());
  return path;
}

/* The last: ModelOpt NVFP4 again with cuda-nvfp4's FP8 activations (its m 64 calls stage x per token
 * in e4m3 inside the graph). */
static const char *const schemes[] = {"modelopt-nvfp4", "ct-nvfp4", "mxfp4", "modelopt-nvfp4"};

static void configure_fp8(bool on) {
  const struct qkeep_backend *be = qkeep_plugin_backend(gpu);
  ck_assert_msg(be->configure(be, "fp8_activations", on ? "true" : "false") == 0, "%s", qkeep_errmsg());
}

START_TEST(a_captured_graph_computes_with_the_reloaded_weights) {
  const char *scheme = schemes[_i];
  configure_fp8(_i == 3);
  static const struct gtu_model shape = {H, KV, I, E_I, EXPERTS, VOCAB};
  char *s0 = gtu_write_source(dir, "w0.safetensors", 1, &shape),
       *s1 = gtu_write_source(dir, "w1.safetensors", 2, &shape);
  char *w0 = quantize(s0, scheme, "q0"), *w1 = quantize(s1, scheme, "q1");
  qkeep_model *m = load(w0), *cold = load(w1);
  struct run live, fresh;
  size_t routed = 0, routed_cold = 0;
  build(m, &live, &routed);
  build(cold, &fresh, &routed_cold);
  ck_assert_uint_gt(routed, 0); /* the MoE layer runs on the GPU, routed */
  capture(&live);
  capture(&fresh);
  size_t n0, n1, nc;
  unsigned char *y0 = replay(&live, &n0), *want = replay(&fresh, &nc);
  ck_assert_uint_eq(n0, nc);
  ck_assert_msg(memcmp(y0, want, n0) != 0, "%s: W0 and W1 give the same outputs", scheme);
  /* a reload from the file, then the same graph */
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  unsigned char *y1 = replay(&live, &n1);
  ck_assert_msg(memcmp(y1, want, n1) == 0, "%s: the graph after a reload differs from a cold W1 graph",
                scheme);
  free(y1);
  /* back to W0 by file, then a one-rank weight sync to W1 */
  ck_assert_msg(qkeep_model_reload(m, w0, 0) == 0, "%s", qkeep_errmsg());
  y1 = replay(&live, &n1);
  ck_assert_msg(memcmp(y1, y0, n1) == 0, "%s: the graph after a reload to W0 differs from W0's", scheme);
  free(y1);
  sync_to(m, w1);
  y1 = replay(&live, &n1);
  ck_assert_msg(memcmp(y1, want, n1) == 0, "%s: the graph after a weight sync differs from a cold W1 graph",
                scheme);
  free(y1), free(y0), free(want);
  run_free(&live);
  run_free(&fresh);
  qkeep_model_free(m);
  qkeep_model_free(cold);
  free(s0), free(s1), free(w0), free(w1);
  configure_fp8(false);
}
END_TEST

static Suite *graph_suite(void) {
  Suite *s = suite_create("gpu_graph");
  TCase *tc = tcase_create("engine loop");
  tcase_set_timeout(tc, 600);
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_loop_test(tc, a_captured_graph_computes_with_the_reloaded_weights, 0, 4);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return gtu_main("check_gpu_graph", graph_suite, &gpu, &ref); }
