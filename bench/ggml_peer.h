/*
 * ggml_peer.h: ggml's Q4_0 matrix product (the int4 format llama.cpp runs on CPUs) as a peer of
 * bench_int4, loaded at run time with dlopen so that the benchmark builds without ggml. Only the
 * entry points called here are declared, from ggml's public C API (ggml.h, ggml-alloc.h,
 * ggml-backend.h, ggml-cpu.h of ggml 0.21); every handle stays opaque (void *), and the one
 * struct passed by value, ggml_init's parameters, is mirrored below.
 *
 * The peer builds, per shape, `copies` Q4_0 weight tensors [N rows of K] in a ggml buffer and,
 * per M, one graph per copy: y = ggml_mul_mat(w, x) with x f32 [M, K] and y f32 [M, N], computed
 * by ggml's CPU backend with the benchmark's thread count (ggml quantises x to Q8_0 itself, as in
 * llama.cpp). Two buffers are offered: the CPU backend's plain one (Q4_0 as stored in GGUF) and,
 * where ggml offers it for the shape, its "CPU_REPACK" extra buffer (Q4_0 interleaved 8 rows at
 * a time on AVX2 and up, what llama.cpp picks by default for Q4_0 weights on the CPU).
 *
 * Header-only, for bench_int4 (which defines BENCH_NAME and includes benchutil.h first).
 */
#ifndef QKEEP_GGML_PEER_H
#define QKEEP_GGML_PEER_H

#include <dlfcn.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "benchutil.h"

/* ggml's enum ggml_type values used here (ggml.h); stable since GGUF v1. */
#define GGML_PEER_F32 0
#define GGML_PEER_Q4_0 2
/* A Q4_0 block: an f16 scale d, then 16 bytes of codes; element j < 16 is the low nibble of byte
 * j, element j + 16 its high nibble; value (code - 8) * d. */
#define Q4_0_BLOCK 32
#define Q4_0_BYTES 18

/* struct ggml_init_params (ggml.h), passed by value to ggml_init. */
struct ggml_peer_init_params {
  size_t mem_size;
  void *mem_buffer;
  bool no_alloc;
};

/* The entry points, by ggml's names (without the prefix); all from libggml-cpu.so's dependency tree. */
struct ggml_peer_api {
  void *(*init)(struct ggml_peer_init_params params);
  void (*free)(void *ctx);
  size_t (*tensor_overhead)(void);
  size_t (*graph_overhead)(void);
  size_t (*row_size)(int type, int64_t ne);
  void *(*new_tensor_2d)(void *ctx, int type, int64_t ne0, int64_t ne1);
  void *(*mul_mat)(void *ctx, void *a, void *b);
  void *(*new_graph)(void *ctx);
  void (*build_forward_expand)(void *graph, void *tensor);
  const char *(*version)(void);
  const char *(*commit)(void);
  void *(*backend_cpu_init)(void);
  void (*backend_cpu_set_n_threads)(void *backend, int n_threads);
  void (*backend_free)(void *backend);
  int (*backend_graph_compute)(void *backend, void *graph);
  void *(*backend_cpu_buffer_type)(void);
  void *(*backend_cpu_reg)(void);
  void *(*backend_reg_dev_get)(void *reg, size_t index);
  void *(*backend_reg_get_proc_address)(void *reg, const char *name);
  const char *(*backend_buft_name)(void *buft);
  void *(*backend_alloc_ctx_tensors_from_buft)(void *ctx, void *buft);
  void (*backend_buffer_free)(void *buffer);
  void (*backend_tensor_set)(void *tensor, const void *data, size_t offset, size_t size);
  void (*backend_tensor_get)(const void *tensor, void *data, size_t offset, size_t size);
};

struct ggml_peer {
  void *lib;
  struct ggml_peer_api api;
  void *backend;
  void *plain_buft, *repack_buft; /* repack_buft: NULL where ggml offers none */
  int threads;
  char version[64];
};

/* Resolves `name` from the library or its dependencies into *slot; 0, or -1 naming it in `why`. */
static int ggml_peer_sym(void *lib, const char *name, void *slot, char *why, size_t len) {
  void *p = dlsym(lib, name);
  if (!p) {
    snprintf(why, len, "%s not found", name);
    return -1;
  }
  memcpy(slot, &p, sizeof p);
  return 0;
}

/*
 * Opens ggml from `path`: libggml-cpu.so itself, or a directory holding it directly or in src/
 * (a CMake build tree), lib/ or bin/ (an install prefix). Resolves the API, checks the Q4_0 block
 * size, makes a CPU backend with `threads` threads and finds the repack buffer. 0 on success, with
 * ggml_peer_close to call; -1 with the reason in `why` (nothing left open).
 */
static int ggml_peer_open(struct ggml_peer *g, const char *path, int threads, char *why, size_t len) {
  static const char *const under[] = {"", "/src", "/lib", "/bin"};
  char file[4096];
  struct stat st;
  memset(g, 0, sizeof *g);
  snprintf(file, sizeof file, "%s", path);
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
    for (size_t i = 0; i < sizeof under / sizeof under[0]; i++) {
      snprintf(file, sizeof file, "%s%s/libggml-cpu.so", path, under[i]);
      if (access(file, R_OK) == 0)
        break;
    }
  g->lib = dlopen(file, RTLD_NOW | RTLD_LOCAL);
  if (!g->lib) {
    snprintf(why, len, "dlopen: %s", dlerror());
    return -1;
  }
  struct ggml_peer_api *a = &g->api;
  struct {
    const char *name;
    void *slot;
  } syms[] = {
      {"ggml_init", &a->init},
      {"ggml_free", &a->free},
      {"ggml_tensor_overhead", &a->tensor_overhead},
      {"ggml_graph_overhead", &a->graph_overhead},
      {"ggml_row_size", &a->row_size},
      {"ggml_new_tensor_2d", &a->new_tensor_2d},
      {"ggml_mul_mat", &a->mul_mat},
      {"ggml_new_graph", &a->new_graph},
      {"ggml_build_forward_expand", &a->build_forward_expand},
      {"ggml_version", &a->version},
      {"ggml_commit", &a->commit},
      {"ggml_backend_cpu_init", &a->backend_cpu_init},
      {"ggml_backend_cpu_set_n_threads", &a->backend_cpu_set_n_threads},
      {"ggml_backend_free", &a->backend_free},
      {"ggml_backend_graph_compute", &a->backend_graph_compute},
      {"ggml_backend_cpu_buffer_type", &a->backend_cpu_buffer_type},
      {"ggml_backend_cpu_reg", &a->backend_cpu_reg},
      {"ggml_backend_reg_dev_get", &a->backend_reg_dev_get},
      {"ggml_backend_reg_get_proc_address", &a->backend_reg_get_proc_address},
      {"ggml_backend_buft_name", &a->backend_buft_name},
      {"ggml_backend_alloc_ctx_tensors_from_buft", &a->backend_alloc_ctx_tensors_from_buft},
      {"ggml_backend_buffer_free", &a->backend_buffer_free},
      {"ggml_backend_tensor_set", &a->backend_tensor_set},
      {"ggml_backend_tensor_get", &a->backend_tensor_get},
  };
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++)
    if (ggml_peer_sym(g->lib, syms[i].name, syms[i].slot, why, len))
      goto fail;
  /* The block layout the reference below decodes; a ggml that changed it is not this peer. */
  if (a->row_size(GGML_PEER_Q4_0, 4 * Q4_0_BLOCK) != 4 * Q4_0_BYTES) {
    snprintf(why, len, "Q4_0 is %zu bytes per 128 weights, expected %d",
             a->row_size(GGML_PEER_Q4_0, 4 * Q4_0_BLOCK), 4 * Q4_0_BYTES);
    goto fail;
  }
  g->backend = a->backend_cpu_init();
  if (!g->backend) {
    snprintf(why, len, "ggml_backend_cpu_init failed");
    goto fail;
  }
  a->backend_cpu_set_n_threads(g->backend, threads);
  g->threads = threads;
  g->plain_buft = a->backend_cpu_buffer_type();
  /* ggml_backend_dev_get_extra_bufts (ggml-backend.h): a NULL-terminated list of buffer types. */
  void *reg = a->backend_cpu_reg();
  void **(*extra)(void *dev) = NULL;
  void *fn = a->backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
  memcpy(&extra, &fn, sizeof fn);
  for (void **b = extra ? extra(a->backend_reg_dev_get(reg, 0)) : NULL; b && *b; b++)
    if (strcmp(a->backend_buft_name(*b), "CPU_REPACK") == 0)
      g->repack_buft = *b;
  snprintf(g->version, sizeof g->version, "%s (%s)", a->version(), a->commit());
  return 0;
fail:
  if (g->backend)
    a->backend_free(g->backend);
  dlclose(g->lib);
  memset(g, 0, sizeof *g);
  return -1;
}

static void ggml_peer_close(struct ggml_peer *g) {
  g->api.backend_free(g->backend);
  dlclose(g->lib);
}

/* ---- weights: Q4_0 blocks made here, copied into ggml tensors ---------------------------------- */

/* n rows of k weights in Q4_0 (k a multiple of 32): random codes, f16 scales in [1e-3, 2e-3), as
 * bench_int4's GPTQ layers. The caller frees. */
static unsigned char *q4_0_blocks(int64_t k, int64_t n, uint64_t *rng) {
  size_t blocks = (size_t)(n * (k / Q4_0_BLOCK));
  unsigned char *q = malloc(blocks * Q4_0_BYTES);
  if (!q)
    die("out of memory for the Q4_0 weights");
  for (size_t b = 0; b < blocks; b++) {
    unsigned char *blk = q + b * Q4_0_BYTES;
    uint16_t d = qk_f32_to_f16(1e-3f * (1.0f + (float)(tu_rand(rng) % 100) / 100.0f));
    memcpy(blk, &d, 2);
    for (int j = 0; j < 16; j++)
      blk[2 + j] = (unsigned char)tu_rand(rng);
  }
  return q;
}

/* The reference: row `r` of x (k values) times the dequantised Q4_0 weights, in double, into
 * y[0 .. n-1]. Decodes the blocks itself, so it shares nothing with ggml but the format. */
static void q4_0_reference(const unsigned char *q, int64_t k, int64_t n, const float *x, double *y) {
  for (int64_t col = 0; col < n; col++) {
    double acc = 0;
    for (int64_t b = 0; b < k / Q4_0_BLOCK; b++) {
      const unsigned char *blk = q + (size_t)(col * (k / Q4_0_BLOCK) + b) * Q4_0_BYTES;
      uint16_t d16;
      memcpy(&d16, blk, 2);
      double d = qk_f16_to_f32(d16), part = 0;
      const float *xb = x + b * Q4_0_BLOCK;
      for (int j = 0; j < 16; j++)
        part += ((blk[2 + j] & 15) - 8) * (double)xb[j] + ((blk[2 + j] >> 4) - 8) * (double)xb[j + 16];
      acc += d * part;
    }
    y[col] = acc;
  }
}

/* `copies` tensors of the same Q4_0 weights `q` (N x K) in one buffer of type `buft`. */
struct ggml_weights {
  void *ctx, *buffer, **tensors;
  int copies;
  int64_t k, n;
};

static void ggml_weights_build(const struct ggml_peer *g, struct ggml_weights *w, void *buft, int64_t k,
                               int64_t n, int copies, const unsigned char *q) {
  const struct ggml_peer_api *a = &g->api;
  struct ggml_peer_init_params ip = {a->tensor_overhead() * (size_t)copies, NULL, true};
  *w = (struct ggml_weights){.ctx = a->init(ip), .copies = copies, .k = k, .n = n};
  w->tensors = calloc((size_t)copies, sizeof *w->tensors);
  if (!w->ctx || !w->tensors)
    die("ggml: weight context");
  for (int c = 0; c < copies; c++)
    w->tensors[c] = a->new_tensor_2d(w->ctx, GGML_PEER_Q4_0, k, n);
  w->buffer = a->backend_alloc_ctx_tensors_from_buft(w->ctx, buft);
  if (!w->buffer)
    die("ggml: allocating the weights");
  /* Through the buffer's set_tensor: the repack buffer interleaves the rows here. */
  size_t bytes = (size_t)n * a->row_size(GGML_PEER_Q4_0, k);
  for (int c = 0; c < copies; c++)
    a->backend_tensor_set(w->tensors[c], q, 0, bytes);
}

static void ggml_weights_free(const struct ggml_peer *g, struct ggml_weights *w) {
  g->api.backend_buffer_free(w->buffer);
  g->api.free(w->ctx);
  free(w->tensors);
}

/* ---- one point: x [M, K] and one graph per weight copy ------------------------------------------ */

struct ggml_point {
  void *ctx, *buffer, *x, **graphs, **outs;
  const struct ggml_weights *w;
  int64_t m;
};

/* The graphs y_c = w_c x for every copy of `w`, with x's values copied in from `x` (m x k). */
static void ggml_point_build(const struct ggml_peer *g, struct ggml_point *p, const struct ggml_weights *w,
                             int64_t m, const float *x) {
  const struct ggml_peer_api *a = &g->api;
  size_t objects = a->tensor_overhead() * (size_t)(1 + w->copies) + a->graph_overhead() * (size_t)w->copies;
  struct ggml_peer_init_params ip = {objects, NULL, true};
  *p = (struct ggml_point){.ctx = a->init(ip), .w = w, .m = m};
  p->graphs = calloc((size_t)w->copies, sizeof *p->graphs);
  p->outs = calloc((size_t)w->copies, sizeof *p->outs);
  if (!p->ctx || !p->graphs || !p->outs)
    die("ggml: graph context");
  p->x = a->new_tensor_2d(p->ctx, GGML_PEER_F32, w->k, m);
  for (int c = 0; c < w->copies; c++) {
    p->outs[c] = a->mul_mat(p->ctx, w->tensors[c], p->x);
    p->graphs[c] = a->new_graph(p->ctx);
    a->build_forward_expand(p->graphs[c], p->outs[c]);
  }
  p->buffer = a->backend_alloc_ctx_tensors_from_buft(p->ctx, g->plain_buft);
  if (!p->buffer)
    die("ggml: allocating the activations");
  a->backend_tensor_set(p->x, x, 0, (size_t)(m * w->k) * sizeof *x);
}

/* One product on weight copy c % copies; seconds. */
static double ggml_point_run(const struct ggml_peer *g, struct ggml_point *p, int c) {
  double t0 = tu_now();
  if (g->api.backend_graph_compute(g->backend, p->graphs[c % p->w->copies]) != 0)
    die("ggml: graph compute");
  return tu_now() - t0;
}

/*
 * The largest relative error, over every weight copy, of rows `rows[0 .. nrows-1]` of y against
 * ref (nrows x n, from q4_0_reference): ||y - ref||_2 / ||ref||_2 per row. Each graph must have
 * run at least once.
 */
static double ggml_point_error(const struct ggml_peer *g, const struct ggml_point *p, const int64_t *rows,
                               int nrows, const double *ref) {
  int64_t n = p->w->n;
  float *y = malloc((size_t)n * sizeof *y);
  if (!y)
    die("out of memory for the check");
  double worst = 0;
  for (int c = 0; c < p->w->copies; c++)
    for (int r = 0; r < nrows; r++) {
      g->api.backend_tensor_get(p->outs[c], y, (size_t)(rows[r] * n) * sizeof *y, (size_t)n * sizeof *y);
      double diff = 0, norm = 0;
      for (int64_t i = 0; i < n; i++) {
        double e = y[i] - ref[r * n + i];
        diff += e * e;
        norm += ref[r * n + i] * ref[r * n + i];
      }
      double rel = norm > 0 ? sqrt(diff / norm) : sqrt(diff);
      worst = rel > worst || rel != rel ? rel : worst;
    }
  free(y);
  return worst;
}

static void ggml_point_free(const struct ggml_peer *g, struct ggml_point *p) {
  g->api.backend_buffer_free(p->buffer);
  g->api.free(p->ctx);
  free(p->graphs);
  free(p->outs);
}

#endif
