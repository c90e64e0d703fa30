/*
 * onednn.h: private declarations of the cpu-onednn backend (plugins/cpu/onednn).
 * backend.c holds the table the core sees (init, configure, probe, supports,
 * PWAL, apply, cleanup); kernels.c holds everything that talks to oneDNN 2.6
 * (primitives per M class, packing, activation quantisation, the epilogue).
 *
 * The int8 path in one paragraph. Weights stay symmetric s8 exactly as the
 * checkpoint holds them, reordered into the layout the matmul primitive asks
 * for (format_tag_any) inside the weight param's own storage. Activations
 * are quantised here to u8 with a zero point (per token when dynamic), and
 * oneDNN computes the plain integer product C = u8 x s8 into s32, with no
 * scales or zero points in the primitive: so one primitive per shape and M
 * class serves every layer and expert of that shape, stays on the packed
 * brgemm path (2.6 drops to gemm:jit with runtime scales), and never depends
 * on weight values (a reload keeps it). The epilogue then applies, exactly in
 * int32 before one float rounding,
 *
 *   y[m, n] = a[m] * s_w[n] * (C[m, n] - zp[m] * azp_adj[n]) + bias[n]
 *
 * with azp_adj[n] = sum_k q_w[n, k] (int32, CUTLASS's folding; vLLM's CPU
 * path folds s_w in and subtracts in float). A symmetric activation is the
 * case zp = 128 (or 64), so one formula serves sym and asym, static and
 * dynamic.
 *
 * Without VNNI, oneDNN 2.6 multiplies u8 x s8 with vpmaddubsw, whose int16
 * pair sums saturate for full-range operands and give wrong results. u8
 * activations of at most 7 bits (0..127) with any s8 weight cannot saturate
 * (2 * 127 * 128 < 32768), so on such CPUs activations are quantised to 7
 * bits (or the scheme is refused: config key int8_without_vnni).
 */
#ifndef QKEEP_ONEDNN_H
#define QKEEP_ONEDNN_H

#include <oneapi/dnnl/dnnl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "qkeep/qkeep_backend.h"

/* What w8a8-int8 does on a CPU whose int8 products saturate (no VNNI). */
enum od_without_vnni {
  OD_WITHOUT_VNNI_7BIT,   /* quantise activations to 7 bits: exact integer products, coarser activations */
  OD_WITHOUT_VNNI_REFUSE, /* refuse the scheme */
};

/* The backend instance: the table first, so the core's pointer is ours. */
struct od_backend {
  struct qkeep_backend be;
  const struct qkeep_host *host;
  dnnl_engine_t engine;
  dnnl_cpu_isa_t isa; /* oneDNN's effective ISA (after QKEEP_ONEDNN_MAX_ISA) */
  bool vnni;          /* full-range u8 x s8 products are exact on this ISA */
  bool bf16;          /* oneDNN has a bf16 matmul on this ISA */
  int threads;        /* config `threads`; 0: OpenMP's default */
  enum od_without_vnni without_vnni;
  char isa_name[32];
};

/*
 * M classes: a primitive per weight matrix is built (on first use) for 1, 16,
 * 64, 128 and 256 rows, since oneDNN 2.6 keeps its packed kernels only for a
 * fixed M (a runtime M falls back to gemm:jit). A call runs its rows in
 * chunks of 256, and the rest padded up to the smallest class that holds
 * them, except that 129..191 rows run as 128 plus the rest rather than
 * padded to 256 (padding is nearly free while the weights' bytes dominate,
 * i.e. up to ~128 rows, and not beyond).
 */
#define OD_CLASSES 5
#define OD_CHUNK_ROWS 256

/* What the matmul computes in. */
enum od_compute {
  OD_INT8, /* u8 activations x s8 weights -> s32, then the epilogue above */
  OD_F32,  /* f32 x f32 -> f32 */
  OD_BF16, /* bf16 x bf16 -> f32 (activations rounded to bf16) */
};

/* Where the matrix's kernel weights live. */
enum od_store {
  OD_IN_WEIGHT, /* packed, in the weight param's own storage (replace) */
  OD_PLAIN,     /* unpacked: the kernel reads the checkpoint [N, K] as is (a tied lm_head) */
  OD_BUFFER,    /* packed, in the kernel buffer "weight_packed" (a tied lm_head oneDNN cannot read as is) */
};

/* One cached primitive of an M class, with its memory objects (handles set per call). */
struct od_prim {
  dnnl_primitive_t prim;
  dnnl_memory_t src, wei, dst;
};

/* One weight matrix: a linear layer's, or an MoE layer's w13 or w2 (each expert alike). */
struct od_matrix {
  char prefix[8];  /* "", "w13_" or "w2_" */
  int64_t n, k;    /* y[M, n] = x[M, k] W^T */
  int64_t experts; /* 1 for a linear layer */
  enum od_compute compute;
  enum od_store store;
  dnnl_memory_desc_t wmd; /* the weights' layout, the same for every class */
  size_t wbytes;          /* bytes of one expert's weights in that layout */
  bool scales_in_buffer; /* int8: f32 scales per channel in "<prefix>weight_scale_channel" (else the param) */
  struct od_prim cls[OD_CLASSES];
};

/*
 * A layer's private state (host->set_state), freed by layer_cleanup. Apply
 * holds `lock`: the scratch and the primitives' memory objects are shared.
 */
struct od_layer {
  pthread_mutex_t lock;
  dnnl_stream_t stream;
  int n_mat;
  struct od_matrix mat[2];
  uint32_t flags; /* QKEEP_LAYER_F_* */
  void *src;      /* scratch: one chunk of activations in the kernel's dtype */
  size_t src_cap;
  void *dst; /* scratch: one padded chunk of output */
  size_t dst_cap;
};

/* Per-row activation quantisation of one int8 chunk (kernels.c). */
struct od_act {
  bool dynamic, asym;
  int levels;          /* the largest u8 code: 255, or 127 without VNNI */
  float static_scale;  /* static: the checkpoint's input_scale */
  int32_t static_zero; /* static asymmetric: the checkpoint's s8 zero point */
};

/* Everything one int8 or float apply reads, resolved from the layer's params and buffers. */
struct od_operands {
  const void *weights;    /* this expert's weights in the matrix's layout */
  const float *scale;     /* int8: s_w per channel, f32 [n] */
  const int32_t *azp_adj; /* int8: sum_k q_w[n, k], [n] */
  const void *bias;       /* NULL, or [n] of bias_dtype */
  enum qkeep_dtype bias_dtype;
  struct od_act act;
};

/* ---- kernels.c ------------------------------------------------------------------------ */

/*
 * Applies QKEEP_ONEDNN_MAX_ISA (when set) through dnnl_set_max_cpu_isa,
 * creates the CPU engine and records the effective ISA, whether it has VNNI
 * and whether oneDNN has a bf16 matmul on it. 0, QKEEP_E_CONFIG for an
 * unknown ISA name, QKEEP_E_PLUGIN when oneDNN cannot apply the limit (it has
 * generated code in this process already) or has no engine.
 */
int od_engine_init(struct od_backend *b);
/* Destroys the engine. */
void od_engine_fini(struct od_backend *b);

/* The OpenMP thread count for b's work: sets it for the calling thread and
 * returns the previous value, which od_threads_end restores. */
int od_threads_begin(const struct od_backend *b);
void od_threads_end(const struct od_backend *b, int saved);

/*
 * Fills mt->wmd and mt->wbytes: the layout oneDNN's matmul prefers for the
 * weights at M = 1 (format_tag_any), or plain [N, K] (oneDNN's {K, N} "ba")
 * when `plain`; and builds the M = 1 primitive. mt->n, k, compute must be set.
 * QKEEP_E_UNSUPPORTED when oneDNN has no such matmul on this CPU.
 */
int od_matrix_prepare(struct od_backend *b, struct od_matrix *mt, enum qkeep_dtype weight_dtype, bool plain);

/*
 * Reorders one expert's plain weights `plain` ([N, K] row-major of `dtype`:
 * s8 for int8, f32, bf16 or f16 for float, converted to the compute dtype on
 * the way) into `packed` (mt->wbytes, layout mt->wmd). Padding bytes are
 * written as oneDNN writes them, so the result is a function of the weights
 * alone (a reload repacks byte for byte).
 */
int od_pack(struct od_backend *b, dnnl_stream_t stream, const struct od_matrix *mt, enum qkeep_dtype dtype,
            const void *plain, void *packed);

/* Destroys every primitive and memory object of the matrix (the layout stays). */
void od_matrix_release(struct od_matrix *mt);

/*
 * y[m, mt->n] = x[m, mt->k] W^T for one matrix: chunks of rows through the
 * class primitives (built on first use), activations quantised (int8) or
 * converted (bf16) into st's scratch, then the epilogue (scales, zero-point
 * correction, bias). x and y are host f32. Caller holds st->lock.
 */
int od_apply(struct od_backend *b, struct od_layer *st, struct od_matrix *mt, const struct od_operands *op,
             int64_t m, const float *x, float *y);

/* Frees a layer state's scratch, primitives and stream (not the struct). */
void od_layer_release(struct od_layer *st);

/* Error detail from a oneDNN status: sets the host error and returns the code (QKEEP_E_NOMEM for
 * dnnl_out_of_memory, whatever code the caller gave). */
int od_fail(const struct od_backend *b, int code, dnnl_status_t status, const char *what);

#endif
