/*
 * check_exporters.c: the checkpoints real exporters wrote, scaled down. Each case builds
 * one published layout with this file's own writer (tensor names, dtypes, shapes, config
 * files, file names and index as the exporter writes them; docs/FORMATS.md says which
 * exporter and version), with random codes and scales, and checks, on the reference backend
 * and on every other backend here that runs the scheme:
 *   - it loads; census missing 0, C1 0, C2 0; every checkpoint name resolves;
 *   - every linear layer (and MoE expert) agrees with an independent dequantisation of the
 *     bytes written (decoders of this file, not libqkeep's);
 *   - a reload W0 -> W1 in place equals a cold start on W1: digest, every storage's bytes
 *     and address, and the forward check against W1.
 * Layouts qkeep does not load are refused, naming the module and what is wrong.
 */
#include <check.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "private.h"
#include "fixture.h"
#include "testutil.h"

#define H 128     /* hidden: K of attention and gate/up */
#define KV 64     /* k/v rows */
#define INTER 256 /* MLP intermediate: K of down_proj */
#define VOCAB 64
#define EXPERTS 2
#define E_INTER 128

/* ---- independent decoders (docs/FORMATS.md, 1-3), deliberately not libqkeep's ---------------- */

static float bf16_value(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static float f16_value(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  float v = e == 0 ? ldexpf((float)m, -24) : ldexpf((float)(m | 1024), e - 25);
  return (h & 0x8000) ? -v : v;
}

static float e2m1_value(int code) {
  static const float mag[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  return (code & 8) ? -mag[code & 7] : mag[code & 7];
}

static float e4m3_value(uint8_t b) {
  int e = (b >> 3) & 15, m = b & 7;
  float v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
  return (b & 0x80) ? -v : v;
}

static int nib(uint32_t word, int j) { return (int)((word >> (4 * j)) & 15); }

/* ---- the fixture writer -------------------------------------------------------------- */

/* One module's dequantised weight, kept for the forward check. */
struct oracle {
  char *module;
  int64_t n, k;
  float *w;
};

/* A checkpoint being written: tensors for up to four files, and the oracles of its modules. */
struct fx {
  struct st_writer *w[4];
  int file; /* where fx_put adds */
  uint64_t seed;
  struct oracle *oracles;
  int n_oracles;
};

static void fx_init(struct fx *f, uint64_t seed) {
  memset(f, 0, sizeof *f);
  f->seed = seed;
  for (int i = 0; i < 4; i++)
    ck_assert_int_eq(st_writer_new(&f->w[i]), 0);
}

static void fx_free(struct fx *f) {
  for (int i = 0; i < 4; i++)
    st_writer_free(f->w[i]);
  for (int i = 0; i < f->n_oracles; i++) {
    free(f->oracles[i].module);
    free(f->oracles[i].w);
  }
  free(f->oracles);
}

static uint32_t fx_rand(struct fx *f) { return (uint32_t)tu_rand(&f->seed); }

static void fx_put(struct fx *f, const char *name, enum qkeep_dtype dt, int ndim, const int64_t *shape,
                   const void *data) {
  struct qkeep_spec s = {.dtype = dt, .ndim = ndim};
  for (int i = 0; i < ndim; i++)
    s.shape[i] = shape[i];
  ck_assert_msg(st_writer_add(f->w[f->file], name, &s, data) == 0, "%s: %s", name, qkeep_errmsg());
}

static void fx_oracle(struct fx *f, const char *module, int64_t n, int64_t k, float *w) {
  f->oracles = realloc(f->oracles, sizeof *f->oracles * (size_t)(f->n_oracles + 1));
  f->oracles[f->n_oracles++] = (struct oracle){strdup(module), n, k, w};
}

static const struct oracle *fx_find(const struct fx *f, const char *module) {
  for (int i = 0; i < f->n_oracles; i++)
    if (strcmp(f->oracles[i].module, module) == 0)
      return &f->oracles[i];
  return NULL;
}

static char *tname(const char *module, const char *local) {
  static char buf[4][256];
  static int at;
  at = (at + 1) % 4;
  snprintf(buf[at], sizeof buf[at], "%s.%s", module, local);
  return buf[at];
}

/* A bf16 value in [-0.25, 0.25) (random bits of a float rounded by truncation: exact in bf16). */
static uint16_t fx_bf16(struct fx *f) {
  float v = ((float)(fx_rand(f) % 2048) - 1024.0f) / 4096.0f;
  uint32_t u;
  memcpy(&u, &v, 4);
  return (uint16_t)(u >> 16);
}

/* A positive 16-bit scale (bf16 or f16) near 0.01, and its value. */
static uint16_t fx_scale16(struct fx *f, bool f16, float *value) {
  uint16_t b = f16 ? (uint16_t)(0x2000 + fx_rand(f) % 0x400) : (uint16_t)(0x3c00 + fx_rand(f) % 0x80);
  *value = f16 ? f16_value(b) : bf16_value(b);
  return b;
}

/* ---- per-family module writers --------------------------------------------------------- */

/* An unquantized bf16 linear weight [n, k]. */
static void put_bf16(struct fx *f, const char *module, int64_t n, int64_t k) {
  uint16_t *b = malloc((size_t)(n * k) * 2);
  float *w = malloc((size_t)(n * k) * sizeof *w);
  for (int64_t i = 0; i < n * k; i++) {
    b[i] = fx_bf16(f);
    w[i] = bf16_value(b[i]);
  }
  fx_put(f, tname(module, "weight"), QKEEP_DTYPE_BF16, 2, (int64_t[]){n, k}, b);
  free(b);
  fx_oracle(f, module, n, k, w);
}

/* A plain 1-D bf16 tensor (a norm). */
static void put_norm(struct fx *f, const char *name, int64_t n) {
  uint16_t *b = malloc((size_t)n * 2);
  for (int64_t i = 0; i < n; i++)
    b[i] = fx_bf16(f);
  fx_put(f, name, QKEEP_DTYPE_BF16, 1, (int64_t[]){n}, b);
  free(b);
}

struct int4_opts {
  int64_t g;      /* group size; 0 per channel */
  bool asym;      /* zero points */
  bool act_order; /* a permuted g_idx */
  bool v2;        /* GPTQ v2 zeros */
};

/* A g_idx for K rows and `groups` groups: k / G, or (act order) a shuffled assignment. */
static int32_t *make_g_idx(struct fx *f, int64_t k, int64_t g, bool act_order) {
  int32_t *gi = malloc((size_t)k * 4);
  for (int64_t i = 0; i < k; i++)
    gi[i] = (int32_t)(i / g);
  for (int64_t i = k - 1; act_order && i > 0; i--) {
    int64_t j = fx_rand(f) % (uint32_t)(i + 1);
    int32_t t = gi[i];
    gi[i] = gi[j];
    gi[j] = t;
  }
  return gi;
}

/* GPTQ (AutoGPTQ, GPTQModel): qweight i32 [K/8, N] along K, qzeros [K/G, N/8] v1 (zero - 1), f16 scales
 * [K/G, N], g_idx [K]. */
static void put_gptq(struct fx *f, const char *module, int64_t n, int64_t k, const struct int4_opts *o,
                     const int32_t *shared_g_idx) {
  int64_t g = o->g ? o->g : k, groups = k / g;
  int32_t *qw = malloc((size_t)(k / 8 * n) * 4), *qz = malloc((size_t)(groups * n / 8) * 4);
  uint16_t *sc = malloc((size_t)(groups * n) * 2);
  float *sv = malloc((size_t)(groups * n) * sizeof *sv), *w = malloc((size_t)(n * k) * sizeof *w);
  int32_t *gi = shared_g_idx ? NULL : make_g_idx(f, k, g, o->act_order);
  const int32_t *g_idx = shared_g_idx ? shared_g_idx : gi;
  for (int64_t i = 0; i < k / 8 * n; i++)
    qw[i] = (int32_t)fx_rand(f);
  for (int64_t i = 0; i < groups * n / 8; i++)
    qz[i] = o->asym ? (int32_t)fx_rand(f) : (o->v2 ? (int32_t)0x88888888u : 0x77777777);
  for (int64_t i = 0; i < groups * n; i++)
    sc[i] = fx_scale16(f, true, &sv[i]);
  for (int64_t c = 0; c < n; c++)
    for (int64_t r = 0; r < k; r++) {
      int gr = g_idx[r], q = nib((uint32_t)qw[(r / 8) * n + c], (int)(r % 8));
      int z = nib((uint32_t)qz[gr * (n / 8) + c / 8], (int)(c % 8));
      z = o->v2 ? z : (z + 1) & 15;
      w[c * k + r] = (float)(q - z) * sv[gr * n + c];
    }
  fx_put(f, tname(module, "qweight"), QKEEP_DTYPE_I32, 2, (int64_t[]){k / 8, n}, qw);
  fx_put(f, tname(module, "qzeros"), QKEEP_DTYPE_I32, 2, (int64_t[]){groups, n / 8}, qz);
  fx_put(f, tname(module, "scales"), QKEEP_DTYPE_F16, 2, (int64_t[]){groups, n}, sc);
  fx_put(f, tname(module, "g_idx"), QKEEP_DTYPE_I32, 1, (int64_t[]){k}, g_idx);
  fx_oracle(f, module, n, k, w);
  free(qw), free(qz), free(sc), free(sv), free(gi);
}

/* AWQ GEMM (AutoAWQ): qweight i32 [K, N/8] along N in the order {0,2,4,6,1,3,5,7}, real zeros the same way,
 * f16 scales [K/G, N]; no g_idx. */
static void put_awq(struct fx *f, const char *module, int64_t n, int64_t k, const struct int4_opts *o) {
  static const int order[8] = {0, 2, 4, 6, 1, 3, 5, 7}; /* nibble i holds column order[i] */
  int64_t g = o->g, groups = k / g;
  int32_t *qw = malloc((size_t)(k * n / 8) * 4), *qz = malloc((size_t)(groups * n / 8) * 4);
  uint16_t *sc = malloc((size_t)(groups * n) * 2);
  float *sv = malloc((size_t)(groups * n) * sizeof *sv), *w = malloc((size_t)(n * k) * sizeof *w);
  for (int64_t i = 0; i < k * n / 8; i++)
    qw[i] = (int32_t)fx_rand(f);
  for (int64_t i = 0; i < groups * n / 8; i++)
    qz[i] = o->asym ? (int32_t)fx_rand(f) : (int32_t)0x88888888u;
  for (int64_t i = 0; i < groups * n; i++)
    sc[i] = fx_scale16(f, true, &sv[i]);
  for (int64_t r = 0; r < k; r++)
    for (int j = 0; j < 8; j++)
      for (int64_t c8 = 0; c8 < n / 8; c8++) {
        int64_t c = c8 * 8 + order[j];
        int q = nib((uint32_t)qw[r * (n / 8) + c8], j), z = nib((uint32_t)qz[(r / g) * (n / 8) + c8], j);
        w[c * k + r] = (float)(q - z) * sv[(r / g) * n + c];
      }
  fx_put(f, tname(module, "qweight"), QKEEP_DTYPE_I32, 2, (int64_t[]){k, n / 8}, qw);
  fx_put(f, tname(module, "qzeros"), QKEEP_DTYPE_I32, 2, (int64_t[]){groups, n / 8}, qz);
  fx_put(f, tname(module, "scales"), QKEEP_DTYPE_F16, 2, (int64_t[]){groups, n}, sc);
  fx_oracle(f, module, n, k, w);
  free(qw), free(qz), free(sc), free(sv);
}

static int64_t ct_shape_delta; /* a broken weight_shape for the refusal test */

/* compressed-tensors pack-quantized int4: weight_packed i32 [N, K/8] (code + 8), bf16 weight_scale [N, K/G],
 * weight_shape i64 [2], weight_zero_point i32 [N/8, K/G] packed along N, weight_g_idx [K]. */
static void put_ct_int4(struct fx *f, const char *module, int64_t n, int64_t k, const struct int4_opts *o,
                        const int32_t *shared_g_idx) {
  int64_t g = o->g ? o->g : k, groups = k / g;
  int32_t *wp = malloc((size_t)(n * k / 8) * 4), *zp = malloc((size_t)(n / 8 * groups) * 4 + 4);
  uint16_t *sc = malloc((size_t)(n * groups) * 2);
  float *sv = malloc((size_t)(n * groups) * sizeof *sv), *w = malloc((size_t)(n * k) * sizeof *w);
  int32_t *gi = o->act_order && !shared_g_idx ? make_g_idx(f, k, g, true) : NULL;
  const int32_t *g_idx = shared_g_idx ? shared_g_idx : gi;
  for (int64_t i = 0; i < n * k / 8; i++)
    wp[i] = (int32_t)fx_rand(f);
  for (int64_t i = 0; i < n / 8 * groups; i++)
    zp[i] = (int32_t)fx_rand(f);
  for (int64_t i = 0; i < n * groups; i++)
    sc[i] = fx_scale16(f, false, &sv[i]);
  for (int64_t r = 0; r < n; r++)
    for (int64_t c = 0; c < k; c++) {
      int64_t gr = g_idx ? g_idx[c] : c / g;
      int q = nib((uint32_t)wp[r * (k / 8) + c / 8], (int)(c % 8)) - 8;
      int z = o->asym ? nib((uint32_t)zp[(r / 8) * groups + gr], (int)(r % 8)) - 8 : 0;
      w[r * k + c] = (float)(q - z) * sv[r * groups + gr];
    }
  int64_t shape[2] = {n, k + ct_shape_delta};
  fx_put(f, tname(module, "weight_packed"), QKEEP_DTYPE_I32, 2, (int64_t[]){n, k / 8}, wp);
  fx_put(f, tname(module, "weight_scale"), QKEEP_DTYPE_BF16, 2, (int64_t[]){n, groups}, sc);
  fx_put(f, tname(module, "weight_shape"), QKEEP_DTYPE_I64, 1, (int64_t[]){2}, shape);
  if (o->asym)
    fx_put(f, tname(module, "weight_zero_point"), QKEEP_DTYPE_I32, 2, (int64_t[]){n / 8, groups}, zp);
  if (g_idx)
    fx_put(f, tname(module, "weight_g_idx"), QKEEP_DTYPE_I32, 1, (int64_t[]){k}, g_idx);
  fx_oracle(f, module, n, k, w);
  free(wp), free(zp), free(sc), free(sv), free(gi);
}

struct int8_opts {
  bool per_tensor;   /* weight_scale [1] (else per channel [N, 1]) */
  bool static_input; /* input_scale [1] */
  bool asym_input;   /* input_zero_point i8 [1] */
};

/* compressed-tensors int-quantized W8A8: weight i8 [N, K]; every scale in the model's dtype (bf16). */
static void put_w8a8(struct fx *f, const char *module, int64_t n, int64_t k, const struct int8_opts *o) {
  int8_t *q = malloc((size_t)(n * k));
  int64_t n_scales = o->per_tensor ? 1 : n;
  uint16_t *sc = malloc((size_t)n_scales * 2);
  float *sv = malloc((size_t)n_scales * sizeof *sv), *w = malloc((size_t)(n * k) * sizeof *w);
  for (int64_t i = 0; i < n * k; i++)
    q[i] = (int8_t)((int)(fx_rand(f) % 255) - 127);
  for (int64_t i = 0; i < n_scales; i++)
    sc[i] = fx_scale16(f, false, &sv[i]);
  for (int64_t i = 0; i < n * k; i++)
    w[i] = (float)q[i] * sv[o->per_tensor ? 0 : i / k];
  fx_put(f, tname(module, "weight"), QKEEP_DTYPE_I8, 2, (int64_t[]){n, k}, q);
  if (o->per_tensor)
    fx_put(f, tname(module, "weight_scale"), QKEEP_DTYPE_BF16, 1, (int64_t[]){1}, sc);
  else
    fx_put(f, tname(module, "weight_scale"), QKEEP_DTYPE_BF16, 2, (int64_t[]){n, 1}, sc);
  if (o->static_input) {
    uint16_t in = 0x3c01; /* ~ 1/127: |x| <= 1 */
    fx_put(f, tname(module, "input_scale"), QKEEP_DTYPE_BF16, 1, (int64_t[]){1}, &in);
    if (o->asym_input) {
      int8_t zp = 0;
      fx_put(f, tname(module, "input_zero_point"), QKEEP_DTYPE_I8, 1, (int64_t[]){1}, &zp);
    }
  }
  fx_oracle(f, module, n, k, w);
  free(q), free(sc), free(sv);
}

/* ModelOpt NVFP4: weight u8 [N, K/2] (low nibble = even k), e4m3 weight_scale [N, K/16], f32 []
 * weight_scale_2 and input_scale (equal across a fused group, as ModelOpt syncs them). */
static void put_modelopt_nvfp4(struct fx *f, const char *module, int64_t n, int64_t k) {
  uint8_t *codes = malloc((size_t)(n * k / 2)), *bs = malloc((size_t)(n * k / 16));
  float *w = malloc((size_t)(n * k) * sizeof *w), ws2 = 0.0125f, in = 0.004f;
  for (int64_t i = 0; i < n * k / 2; i++)
    codes[i] = (uint8_t)fx_rand(f);
  for (int64_t i = 0; i < n * k / 16; i++)
    bs[i] = (uint8_t)(0x30 + fx_rand(f) % 0x20); /* 0.25 .. 3.75 */
  for (int64_t r = 0; r < n; r++)
    for (int64_t c = 0; c < k; c++) {
      uint8_t b = codes[r * (k / 2) + c / 2];
      w[r * k + c] = e2m1_value((c & 1) ? b >> 4 : b & 15) * (e4m3_value(bs[r * (k / 16) + c / 16]) * ws2);
    }
  fx_put(f, tname(module, "weight"), QKEEP_DTYPE_U8, 2, (int64_t[]){n, k / 2}, codes);
  fx_put(f, tname(module, "weight_scale"), QKEEP_DTYPE_F8_E4M3, 2, (int64_t[]){n, k / 16}, bs);
  fx_put(f, tname(module, "weight_scale_2"), QKEEP_DTYPE_F32, 0, NULL, &ws2);
  fx_put(f, tname(module, "input_scale"), QKEEP_DTYPE_F32, 0, NULL, &in);
  fx_oracle(f, module, n, k, w);
  free(codes), free(bs);
}

/* ---- the model: a one-layer Llama (or Qwen3-MoE), each linear written by `linear` -------------- */

typedef void (*linear_fn)(struct fx *f, const char *module, int64_t n, int64_t k, const void *opts);

struct layout {
  linear_fn linear;
  const void *opts;
  bool moe;        /* layer 0's MLP is a 2-expert MoE block (router unquantized) */
  bool fp8_kv;     /* ModelOpt k_proj.k_scale / v_proj.v_scale, f32 [] */
  bool ct_kv_bf16; /* compressed-tensors self_attn.k_scale / v_scale, bf16 [1] */
  bool ct_kv_2024; /* compressed-tensors 2024: k_proj.output_scale / v_proj.output_scale, bf16 [1] */
  /* Which modules stay bf16 (an exporter's exclusions), by name substring; NULL: lm_head only. */
  const char *const *bf16_modules;
};

static bool stays_bf16(const struct layout *L, const char *module) {
  if (strstr(module, "lm_head") || strstr(module, "mlp.gate") == module + strlen(module) - 8)
    return true;
  for (const char *const *p = L->bf16_modules; p && *p; p++)
    if (strstr(module, *p))
      return true;
  return false;
}

static void put_linear(struct fx *f, const struct layout *L, const char *module, int64_t n, int64_t k) {
  if (stays_bf16(L, module))
    put_bf16(f, module, n, k);
  else
    L->linear(f, module, n, k, L->opts);
}

static void put_model(struct fx *f, const struct layout *L) {
  put_bf16(f, "model.embed_tokens", VOCAB, H);
  put_norm(f, "model.norm.weight", H);
  put_norm(f, "model.layers.0.input_layernorm.weight", H);
  put_linear(f, L, "model.layers.0.self_attn.q_proj", H, H);
  put_linear(f, L, "model.layers.0.self_attn.k_proj", KV, H);
  put_linear(f, L, "model.layers.0.self_attn.v_proj", KV, H);
  put_linear(f, L, "model.layers.0.self_attn.o_proj", H, H);
  if (L->moe) {
    put_bf16(f, "model.layers.0.mlp.gate", EXPERTS, H);
    char m[128];
    for (int e = 0; e < EXPERTS; e++) {
      snprintf(m, sizeof m, "model.layers.0.mlp.experts.%d.gate_proj", e);
      put_linear(f, L, m, E_INTER, H);
      snprintf(m, sizeof m, "model.layers.0.mlp.experts.%d.up_proj", e);
      put_linear(f, L, m, E_INTER, H);
      snprintf(m, sizeof m, "model.layers.0.mlp.experts.%d.down_proj", e);
      put_linear(f, L, m, H, E_INTER);
    }
  } else {
    put_linear(f, L, "model.layers.0.mlp.gate_proj", INTER, H);
    put_linear(f, L, "model.layers.0.mlp.up_proj", INTER, H);
    put_linear(f, L, "model.layers.0.mlp.down_proj", H, INTER);
  }
  put_bf16(f, "lm_head", VOCAB, H);
  float kv = 0.05f;
  uint16_t kv16 = 0x3d4d; /* ~0.05 in bf16 */
  if (L->fp8_kv) {
    fx_put(f, "model.layers.0.self_attn.k_proj.k_scale", QKEEP_DTYPE_F32, 0, NULL, &kv);
    fx_put(f, "model.layers.0.self_attn.v_proj.v_scale", QKEEP_DTYPE_F32, 0, NULL, &kv);
  }
  if (L->ct_kv_bf16) {
    fx_put(f, "model.layers.0.self_attn.k_scale", QKEEP_DTYPE_BF16, 1, (int64_t[]){1}, &kv16);
    fx_put(f, "model.layers.0.self_attn.v_scale", QKEEP_DTYPE_BF16, 1, (int64_t[]){1}, &kv16);
  }
  if (L->ct_kv_2024) {
    fx_put(f, "model.layers.0.self_attn.k_proj.output_scale", QKEEP_DTYPE_BF16, 1, (int64_t[]){1}, &kv16);
    fx_put(f, "model.layers.0.self_attn.v_proj.output_scale", QKEEP_DTYPE_BF16, 1, (int64_t[]){1}, &kv16);
  }
}

/* Writes dir/file with the JSON text (single quotes for double). */
static void put_json(const char *d, const char *file, const char *text) {
  char *path = tu_path(d, file), *copy = strdup(text);
  for (char *p = copy; *p; p++)
    if (*p == '\'')
      *p = '"';
  ck_assert_int_eq(tu_write_file(path, copy, strlen(copy)), 0);
  free(copy);
  free(path);
}

/* Writes the fixture's files into a new directory: file 0 alone as `single`, or files 0..n-1 as
 * model-0000i-of-0000n.safetensors (`zero_based`: gpt-oss's 00000-of-(n-1)) with an index. */
static char *fx_write(struct fx *f, const char *name, const char *single, int n_files, bool zero_based) {
  static int serial; /* a test may write several checkpoints of one name */
  char unique[96];
  snprintf(unique, sizeof unique, "%s-%d", name, serial++);
  char *d = tu_path(dir, unique);
  ck_assert_int_eq(mkdir(d, 0755), 0);
  if (single) {
    char *path = tu_path(d, single);
    ck_assert_int_eq(st_writer_write(f->w[0], path), 0);
    free(path);
    return d;
  }
  /* the index: every tensor of each file under that file's name */
  size_t cap = 1 << 16, len = 0;
  char *index = malloc(cap);
  len += (size_t)snprintf(index + len, cap - len, "{'metadata': {'total_size': 0}, 'weight_map': {");
  bool first = true;
  for (int i = 0; i < n_files; i++) {
    char file[64];
    snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", zero_based ? i : i + 1,
             zero_based ? n_files - 1 : n_files);
    char *path = tu_path(d, file);
    ck_assert_int_eq(st_writer_write(f->w[i], path), 0);
    struct st_file *sf;
    ck_assert_int_eq(st_open(path, &sf), 0);
    for (size_t t = 0; t < sf->n_tensors; t++) {
      len += (size_t)snprintf(index + len, cap - len, "%s'%s': '%s'", first ? "" : ", ", sf->tensors[t].name,
                              file);
      first = false;
      ck_assert_uint_lt(len, cap);
    }
    st_close(sf);
    free(path);
  }
  snprintf(index + len, cap - len, "}}");
  put_json(d, "model.safetensors.index.json", index);
  free(index);
  return d;
}

/* ---- the checks ---------------------------------------------------------------------------- */

/* W [n, k] of a model layer (or MoE expert matrix) from the fixture's oracles, shards stacked. */
static float *expected_weight(const struct fx *f, const char *layer, int expert, bool w2, int64_t *n,
                              int64_t *k) {
  static const char *const fused[][4] = {{"qkv_proj", "q_proj", "k_proj", "v_proj"},
                                         {"gate_up_proj", "gate_proj", "up_proj", NULL}};
  const char *parts[3] = {NULL};
  char names[3][200];
  int n_parts = 0;
  const char *last = strrchr(layer, '.') ? strrchr(layer, '.') + 1 : layer;
  size_t parent = (size_t)(last - layer);
  if (expert >= 0) {
    snprintf(names[0], sizeof names[0], "%s.%d.%s", layer, expert, w2 ? "down_proj" : "gate_proj");
    snprintf(names[1], sizeof names[1], "%s.%d.up_proj", layer, expert);
    n_parts = w2 ? 1 : 2;
  } else {
    for (size_t r = 0; r < 2 && !n_parts; r++)
      if (strcmp(last, fused[r][0]) == 0)
        for (int m = 1; m < 4 && fused[r][m]; m++)
          snprintf(names[n_parts++], sizeof names[0], "%.*s%s", (int)parent, layer, fused[r][m]);
    if (!n_parts)
      snprintf(names[n_parts++], sizeof names[0], "%s", layer);
  }
  *n = 0;
  *k = 0;
  for (int i = 0; i < n_parts; i++) {
    const struct oracle *o = fx_find(f, names[i]);
    ck_assert_msg(o != NULL, "no oracle for %s", names[i]);
    parts[i] = names[i];
    *n += o->n;
    *k = o->k;
  }
  float *w = malloc((size_t)(*n * *k) * sizeof *w);
  int64_t row = 0;
  for (int i = 0; i < n_parts; i++) {
    const struct oracle *o = fx_find(f, parts[i]);
    memcpy(w + row * *k, o->w, (size_t)(o->n * o->k) * sizeof *w);
    row += o->n;
  }
  return w;
}

/* max |y - x W^T| / max |x W^T| over 3 rows of x in [-1, 1). */
static double apply_error(qkeep_layer *layer, const float *w, int64_t n, int64_t k, int expert, bool w2) {
  enum { M = 3 };
  float *x = malloc((size_t)(M * k) * sizeof *x), *y = malloc((size_t)(M * n) * sizeof *y);
  uint64_t s = 7;
  for (int64_t i = 0; i < M * k; i++)
    x[i] = tu_randf(&s);
  int rc = expert < 0
               ? qkeep_layer_apply_f32(layer, M, x, y)
               : qkeep_layer_apply_expert_f32(layer, expert, w2 ? QKEEP_MOE_W2 : QKEEP_MOE_W13, M, x, y);
  ck_assert_msg(rc == 0, "%s: %s", layer->name, qkeep_errmsg());
  double err = 0, top = 0;
  for (int r = 0; r < M; r++)
    for (int64_t c = 0; c < n; c++) {
      double want = 0;
      for (int64_t j = 0; j < k; j++)
        want += (double)x[r * k + j] * w[c * k + j];
      err = fmax(err, fabs(y[r * n + c] - want));
      top = fmax(top, fabs(want));
    }
  free(x);
  free(y);
  return top > 0 ? err / top : err;
}

/* Every linear layer and MoE expert against the oracles; returns how many matrices were checked. */
static int check_forward(qkeep_model *m, const struct fx *f, double tol) {
  int checked = 0;
  for (size_t l = 0; l < qkeep_model_layer_count(m); l++) {
    qkeep_layer *layer = qkeep_model_layer(m, l);
    int experts = layer->kind == QKEEP_LAYER_MOE ? (int)layer->dims.experts : 0;
    if (layer->kind != QKEEP_LAYER_LINEAR && !experts)
      continue;
    for (int e = experts ? 0 : -1; e < (experts ? experts : 0); e++)
      for (int w2 = 0; w2 < (experts ? 2 : 1); w2++) {
        int64_t n, k;
        float *w = expected_weight(f, layer->name, e, w2, &n, &k);
        double err = apply_error(layer, w, n, k, e, w2);
        ck_assert_msg(err <= tol, "%s (expert %d%s): relative error %g against the oracle", layer->name, e,
                      w2 ? ", w2" : "", err);
        free(w);
        checked++;
      }
  }
  return checked;
}

/* Every checkpoint tensor resolves to a param of the model. */
static void check_names(qkeep_model *m, const char *path) {
  struct ckpt *ck;
  ck_assert_int_eq(ckpt_open(path, &ck), 0);
  for (size_t i = 0; i < ck->n_tensors; i++)
    ck_assert_msg(qkeep_model_lookup(m, ck->tensors[i].t->name, NULL) != NULL, "%s does not resolve",
                  ck->tensors[i].t->name);
  ckpt_close(ck);
}

/* A model on p, with the reference behind it in a chain: a backend that takes only its own
 * layers (cpu-zentorch runs the int4 ones) passes the rest down, as in the default config. */
static qkeep_model *load_on(qkeep_plugin *p, const char *path) {
  qkeep_model *m;
  qkeep_plugin *chain[] = {p, plugin};
  bool alone = strcmp(qkeep_plugin_backend(p)->name, "reference") == 0; /* the reference takes every layer */
  int rc = alone ? qkeep_model_new(p, &m) : qkeep_model_new_chain(chain, 2, &m);
  ck_assert_msg(rc == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

static bool digest_eq(qkeep_model *a, qkeep_model *b) {
  struct qkeep_digest x, y;
  ck_assert_int_eq(qkeep_digest(a, &x), 0);
  ck_assert_int_eq(qkeep_digest(b, &y), 0);
  return x.hi == y.hi && x.lo == y.lo;
}

/*
 * The whole proof for one layout on one backend: W0 loads clean and agrees with its oracles;
 * a reload to W1 is in place and equals a cold start on W1, which agrees with W1's oracles.
 */
static void check_layout_on(qkeep_plugin *p, const char *w0, const struct fx *f0, const char *w1,
                            const struct fx *f1, double tol) {
  qkeep_model *m = load_on(p, w0), *cold = load_on(p, w1);
  tu_assert_census_clean(m);
  check_names(m, w0);
  ck_assert_int_gt(check_forward(m, f0, tol), 0);
  ck_assert(!digest_eq(m, cold));
  struct tu_storages before = {0}, after = {0}, cold_bytes = {0};
  tu_snapshot(m, &before);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "reload: %s", qkeep_errmsg());
  tu_snapshot(m, &after);
  tu_snapshot(cold, &cold_bytes);
  tu_assert_in_place_and_equal(&before, &after, &cold_bytes);
  ck_assert(digest_eq(m, cold));
  tu_assert_census_clean(m);
  check_forward(m, f1, tol);
  tu_release_snapshot(&before);
  tu_release_snapshot(&after);
  tu_release_snapshot(&cold_bytes);
  qkeep_model_free(m);
  qkeep_model_free(cold);
}

/* Another backend by name, or NULL when it is not built or not usable here. */
static qkeep_plugin *other_backend(const char *name) {
  qkeep_plugin *p = NULL;
  char why[256];
  if (qkeep_plugin_open(name, NULL, &p) != 0)
    return NULL;
  if (qkeep_plugin_probe(p, why, sizeof why) != 0) { /* built, but its device is not here */
    qkeep_plugin_close(p);
    return NULL;
  }
  return p;
}

/* The reference quantising w8a8 activations as an int8 kernel does (`activations = int8`). */
static qkeep_plugin *reference_int8(void) {
  qkeep_plugin *p;
  ck_assert_int_eq(qkeep_plugin_open("reference", NULL, &p), 0);
  const struct qkeep_backend *be = qkeep_plugin_backend(p);
  ck_assert_msg(be->configure(be, "activations", "int8") == 0, "%s", qkeep_errmsg());
  return p;
}

/* A layout's two checkpoints: the same files with other random values. */
typedef void (*configs_fn)(const char *d);
struct pair {
  struct fx f0, f1;
  char *w0, *w1;
};

static void write_pair(struct pair *pr, const struct layout *L, configs_fn configs, const char *single,
                       int n_files) {
  for (int i = 0; i < 2; i++) {
    struct fx *f = i ? &pr->f1 : &pr->f0;
    fx_init(f, 1000 + (uint64_t)i);
    /* shards: the attention in file 0, the rest spread over the others */
    put_model(f, L);
    if (n_files > 1) { /* rewrite with a split: MLP and lm_head in the second file */
      fx_free(f);
      fx_init(f, 1000 + (uint64_t)i);
      put_bf16(f, "model.embed_tokens", VOCAB, H);
      put_norm(f, "model.norm.weight", H);
      put_norm(f, "model.layers.0.input_layernorm.weight", H);
      put_linear(f, L, "model.layers.0.self_attn.q_proj", H, H);
      put_linear(f, L, "model.layers.0.self_attn.k_proj", KV, H);
      f->file = 1;
      put_linear(f, L, "model.layers.0.self_attn.v_proj", KV, H);
      put_linear(f, L, "model.layers.0.self_attn.o_proj", H, H);
      put_linear(f, L, "model.layers.0.mlp.gate_proj", INTER, H);
      put_linear(f, L, "model.layers.0.mlp.up_proj", INTER, H);
      put_linear(f, L, "model.layers.0.mlp.down_proj", H, INTER);
      put_bf16(f, "lm_head", VOCAB, H);
    }
    char name[16];
    snprintf(name, sizeof name, "w%d", i);
    char *d = fx_write(f, name, single, n_files, false);
    if (configs)
      configs(d);
    if (i)
      pr->w1 = d;
    else
      pr->w0 = d;
  }
}

static void free_pair(struct pair *pr) {
  fx_free(&pr->f0);
  fx_free(&pr->f1);
  free(pr->w0);
  free(pr->w1);
}

/* The layout on the reference and on `other` (when built), with the scheme of a layer asserted. */
static void run_layout(const struct layout *L, configs_fn configs, const char *single, int n_files,
                       const char *layer, const char *scheme, const char *other) {
  struct pair pr;
  write_pair(&pr, L, configs, single, n_files);
  qkeep_model *m = load(pr.w0);
  qkeep_layer *l = qkeep_model_find_layer(m, layer);
  ck_assert_msg(l != NULL, "no layer %s", layer);
  ck_assert_str_eq(l->scheme, scheme);
  qkeep_model_free(m);
  check_layout_on(plugin, pr.w0, &pr.f0, pr.w1, &pr.f1, 1e-5);
  qkeep_plugin *o = other ? other_backend(other) : NULL;
  if (o) {
    check_layout_on(o, pr.w0, &pr.f0, pr.w1, &pr.f1, 0.05);
    qkeep_plugin_close(o);
  }
  if (strcmp(scheme, "w8a8-int8") == 0) { /* the static input scales (bf16 here) enter the GEMM */
    qkeep_plugin *q = reference_int8();
    check_layout_on(q, pr.w0, &pr.f0, pr.w1, &pr.f1, 0.05);
    qkeep_plugin_close(q);
  }
  free_pair(&pr);
}

/* A load that must fail with `code`, naming every given word. */
static void expect_refused(const char *path, int code, ...) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(plugin, &m), 0);
  int rc = qkeep_model_load(m, path);
  ck_assert_msg(rc == code, "load returned %d (%s), expected %d: %s", rc, qkeep_strerror(rc), code,
                qkeep_errmsg());
  va_list ap;
  va_start(ap, code);
  for (const char *w; (w = va_arg(ap, const char *)) != NULL;)
    ck_assert_msg(strstr(qkeep_errmsg(), w) != NULL, "'%s' not in: %s", w, qkeep_errmsg());
  va_end(ap);
  ck_assert_uint_eq(qkeep_model_layer_count(m), 0);
  qkeep_model_free(m);
}

static void gptq_fn(struct fx *f, const char *m, int64_t n, int64_t k, const void *o) {
  put_gptq(f, m, n, k, o, NULL);
}
static void awq_fn(struct fx *f, const char *m, int64_t n, int64_t k, const void *o) {
  put_awq(f, m, n, k, o);
}
static void ct_int4_fn(struct fx *f, const char *m, int64_t n, int64_t k, const void *o) {
  put_ct_int4(f, m, n, k, o, NULL);
}
static void w8a8_fn(struct fx *f, const char *m, int64_t n, int64_t k, const void *o) {
  put_w8a8(f, m, n, k, o);
}
static void nvfp4_fn(struct fx *f, const char *m, int64_t n, int64_t k, const void *o) {
  (void)o;
  put_modelopt_nvfp4(f, m, n, k);
}

/* ---- 1. GPTQ / AWQ configs outside config.json ---------------------------------------------- */

static const struct int4_opts gptq_128 = {.g = 128};

/* AutoGPTQ before 0.7 (2589b7e): quantize_config.json only, one gptq_model-4bit-128g.safetensors, no index.
 */
static void autogptq_06_configs(const char *d) {
  put_json(d, "config.json", "{'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'}");
  put_json(d, "quantize_config.json",
           "{'bits': 4, 'group_size': 128, 'damp_percent': 0.01, 'desc_act': false, 'static_groups': false, "
           "'sym': true, 'true_sequential': true, 'model_name_or_path': null, 'model_file_base_name': null}");
}

START_TEST(autogptq_quantize_config_json_and_its_file_name) {
  struct layout L = {.linear = gptq_fn, .opts = &gptq_128};
  run_layout(&L, autogptq_06_configs, "gptq_model-4bit-128g.safetensors", 1,
             "model.layers.0.self_attn.qkv_proj", "gptq-int4", NULL);
}
END_TEST

/* AutoAWQ before 0.1.6 (eea08aa): quant_config.json with w_bit / q_group_size / zero_point / "GEMM". */
static void autoawq_015_configs(const char *d) {
  put_json(d, "config.json", "{'architectures': ['LlamaForCausalLM']}");
  put_json(d, "quant_config.json", "{'zero_point': true, 'q_group_size': 64, 'w_bit': 4, 'version': 'GEMM'}");
}

START_TEST(autoawq_quant_config_json) {
  static const struct int4_opts awq = {.g = 64, .asym = true};
  struct layout L = {.linear = awq_fn, .opts = &awq};
  run_layout(&L, autoawq_015_configs, NULL, 2, "model.layers.0.mlp.gate_up_proj", "awq-int4", NULL);
}
END_TEST

/* No config anywhere: GPTQ tensors are never loaded as plain layers. Nor when an ignore list names them. */
START_TEST(quantized_modules_never_load_as_plain_layers) {
  struct layout L = {.linear = gptq_fn, .opts = &gptq_128};
  struct fx f;
  fx_init(&f, 5);
  put_model(&f, &L);
  char *d = fx_write(&f, "noconfig", "model.safetensors", 1, false);
  put_json(d, "config.json", "{'architectures': ['LlamaForCausalLM']}");
  expect_refused(d, QKEEP_E_FORMAT, "module model.layers.0.", "g_idx", "declares no quantization", NULL);
  char *file = tu_path(d, "model.safetensors"); /* the file alone: it carries no config */
  expect_refused(file, QKEEP_E_FORMAT, "declares no quantization", "load its directory", NULL);
  free(file);
  put_json(d, "quantize_config.json",
           "{'bits': 4, 'group_size': 128, 'desc_act': false, 'sym': true, "
           "'modules_to_not_convert': ['model.layers.0.mlp.down_proj']}");
  expect_refused(d, QKEEP_E_FORMAT, "module model.layers.0.mlp.down_proj", "left unquantized", NULL);
  free(d);
  fx_free(&f);
}
END_TEST

/* ---- 2. compressed-tensors scales in the model's dtype -------------------------------------- */

static void ct_w8a8_static_configs(const char *d) {
  put_json(d, "config.json",
           "{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'int-quantized', "
           "'quantization_status': 'frozen', 'config_groups': {'group_0': {'targets': ['Linear'], 'weights': "
           "{'num_bits': 8, 'type': 'int', 'symmetric': true, 'strategy': 'tensor', 'dynamic': false, "
           "'observer': 'minmax'}, 'input_activations': {'num_bits': 8, 'type': 'int', 'symmetric': true, "
           "'strategy': 'tensor', 'dynamic': false}}}, 'ignore': ['lm_head', 're:.*mlp.gate$'], "
           "'kv_cache_scheme': {'num_bits': 8, 'type': 'float', 'strategy': 'tensor', 'dynamic': false, "
           "'symmetric': true}}}");
}

START_TEST(ct_w8a8_static_bf16_scales_and_kv_scales) {
  static const struct int8_opts o = {.per_tensor = true, .static_input = true};
  struct layout L = {.linear = w8a8_fn, .opts = &o, .ct_kv_bf16 = true};
  run_layout(&L, ct_w8a8_static_configs, "model.safetensors", 1, "model.layers.0.self_attn.qkv_proj",
             "w8a8-int8", "cpu-onednn");
  /* the bytes stay as loaded: a bf16 [1] kv scale is still bf16 [1] */
  struct fx f;
  fx_init(&f, 9);
  put_model(&f, &L);
  char *d = fx_write(&f, "kv", "model.safetensors", 1, false);
  ct_w8a8_static_configs(d);
  qkeep_model *m = load(d);
  qkeep_layer *kv;
  qkeep_param *k = qkeep_model_lookup(m, "model.layers.0.self_attn.k_scale", &kv);
  ck_assert_ptr_nonnull(k);
  struct qkeep_view v = {.size = sizeof v};
  ck_assert_int_eq(qkeep_param_view(k, &v), 0);
  ck_assert_int_eq(v.spec.dtype, QKEEP_DTYPE_BF16);
  ck_assert_uint_eq(*(const uint16_t *)v.data, 0x3d4d);
  qkeep_model_free(m);
  free(d);
  fx_free(&f);
}
END_TEST

/* RedHatAI/Qwen3-30B-A3B-quantized.w8a8's form with static asymmetric activations (tinyllama-w8a8's). */
static void ct_w8a8_moe_configs(const char *d) {
  put_json(
      d, "config.json",
      "{'quantization_config': {'quant_method': 'compressed-tensors', 'format': 'int-quantized', "
      "'config_groups': {'group_0': {'targets': ['Linear'], 'weights': {'num_bits': 8, 'type': 'int', "
      "'symmetric': true, 'strategy': 'channel', 'dynamic': false}, 'input_activations': {'num_bits': 8, "
      "'type': 'int', 'symmetric': false, 'strategy': 'tensor', 'dynamic': false}}}, 'ignore': "
      "['lm_head', 're:.*mlp.gate$']}}");
}

/* The MoE form with static activations: each expert's gate/up input scales merge in the scheme. */
START_TEST(ct_w8a8_moe_static_input_scales_merge_per_expert) {
  static const struct int8_opts o = {.static_input = true, .asym_input = true};
  struct layout L = {.linear = w8a8_fn, .opts = &o, .moe = true};
  run_layout(&L, ct_w8a8_moe_configs, "model.safetensors", 1, "model.layers.0.mlp.experts", "w8a8-int8",
             NULL);
  struct fx f;
  fx_init(&f, 3);
  put_model(&f, &L);
  char *d = fx_write(&f, "moe", "model.safetensors", 1, false);
  ct_w8a8_moe_configs(d);
  qkeep_model *m = load(d);
  qkeep_layer *moe = qkeep_model_find_layer(m, "model.layers.0.mlp.experts");
  struct qkeep_view v = {.size = sizeof v};
  ck_assert_int_eq(qkeep_param_view(qkeep_param_lookup(moe, "w13_input_scale"), &v), 0);
  ck_assert_int_eq(v.spec.ndim, 1); /* [E, 2] -> [E] */
  ck_assert_int_eq(v.spec.shape[0], EXPERTS);
  ck_assert_int_eq(qkeep_param_view(qkeep_param_lookup(moe, "w13_input_zero_point"), &v), 0);
  ck_assert_int_eq(v.spec.ndim, 1);
  tu_assert_census_clean(m);
  qkeep_model_free(m);
  qkeep_plugin *o2 = other_backend("cpu-onednn");
  if (o2) {
    qkeep_model *mo = load_on(o2, d);
    tu_assert_census_clean(mo);
    ck_assert_int_gt(check_forward(mo, &f, 0.05), 0);
    qkeep_model_free(mo);
    qkeep_plugin_close(o2);
  }
  free(d);
  fx_free(&f);
}
END_TEST

/* ---- 3. ModelOpt 0.31 and 0.33 -------------------------------------------------------------- */

static const char hf_quant_nvfp4[] =
    "{'producer': {'name': 'modelopt', 'version': '0.31.0'}, 'quantization': {'quant_algo': 'NVFP4', "
    "'kv_cache_quant_algo': 'FP8', 'group_size': 16, 'exclude_modules': ['lm_head']}}";

static void modelopt_031_configs(const char *d) {
  put_json(d, "hf_quant_config.json", hf_quant_nvfp4);
  put_json(d, "config.json",
           "{'architectures': ['LlamaForCausalLM'], 'quantization_config': {'ignore': ['lm_head'], "
           "'quant_algo': 'NVFP4', 'kv_cache_scheme': 'FP8', 'producer': {'name': 'modelopt', 'version': "
           "'0.31.0'}}}");
}

static void modelopt_033_configs(const char *d) {
  put_json(d, "hf_quant_config.json", hf_quant_nvfp4);
  put_json(d, "config.json",
           "{'quantization_config': {'config_groups': {'group_0': {'input_activations': {'dynamic': false, "
           "'num_bits': 4, 'type': 'float', 'group_size': 16}, 'weights': {'dynamic': false, 'num_bits': 4, "
           "'type': 'float', 'group_size': 16}}}, 'ignore': ['lm_head'], 'quant_algo': 'NVFP4', "
           "'kv_cache_scheme': 'FP8', 'producer': {'name': 'modelopt', 'version': '0.33.0'}, "
           "'quant_library': 'modelopt'}}");
}

START_TEST(modelopt_031_without_quant_method) {
  struct layout L = {.linear = nvfp4_fn, .fp8_kv = true};
  run_layout(&L, modelopt_031_configs, NULL, 2, "model.layers.0.self_attn.qkv_proj", "modelopt-nvfp4",
             "cuda-nvfp4");
}
END_TEST

START_TEST(modelopt_033_quant_library_and_string_kv_scheme) {
  struct layout L = {.linear = nvfp4_fn, .fp8_kv = true};
  run_layout(&L, modelopt_033_configs, "model.safetensors", 1, "model.layers.0.mlp.gate_up_proj",
             "modelopt-nvfp4", "cuda-nvfp4");
}
END_TEST

/* ---- 4. compressed-tensors pack-quantized ---------------------------------------------------- */

static void ct_int4_configs_for(const char *d, const char *weights, const char *activations) {
  char text[2048];
  snprintf(text, sizeof text,
           "{'quantization_config': {'config_groups': {'group_0': {'format': 'pack-quantized', "
           "'input_activations': %s, 'output_activations': null, 'targets': ['Linear'], 'weights': %s}}, "
           "'format': 'pack-quantized', 'global_compression_ratio': null, 'ignore': ['lm_head', "
           "'re:.*mlp.gate$'], 'kv_cache_scheme': null, 'quant_method': 'compressed-tensors', "
           "'quantization_status': 'compressed', 'sparsity_config': {}, 'transform_config': {}, 'version': "
           "'0.13.1'}}",
           activations, weights);
  put_json(d, "config.json", text);
}

static void w4a16_g128(const char *d) {
  ct_int4_configs_for(d,
                      "{'actorder': null, 'block_structure': null, 'dynamic': false, 'group_size': 128, "
                      "'num_bits': 4, 'observer': 'memoryless_minmax', 'observer_kwargs': {}, 'scale_dtype': "
                      "null, 'strategy': 'group', 'symmetric': true, 'type': 'int', 'zp_dtype': null}",
                      "null");
}
static void w4a16_asym_g64(const char *d) {
  ct_int4_configs_for(d,
                      "{'actorder': null, 'dynamic': false, 'group_size': 64, 'num_bits': 4, 'strategy': "
                      "'group', 'symmetric': false, 'type': 'int'}",
                      "null");
}
static void w4a16_actorder(const char *d) {
  ct_int4_configs_for(d,
                      "{'actorder': 'group', 'dynamic': false, 'group_size': 32, 'num_bits': 4, 'strategy': "
                      "'group', 'symmetric': true, 'type': 'int'}",
                      "null");
}
static void w4a8_channel(const char *d) {
  ct_int4_configs_for(
      d,
      "{'actorder': null, 'dynamic': false, 'num_bits': 4, 'strategy': 'channel', "
      "'symmetric': true, 'type': 'int'}",
      "{'num_bits': 8, 'type': 'int', 'strategy': 'token', 'dynamic': true, 'symmetric': true}");
}

START_TEST(ct_pack_quantized_w4a16_sharded) {
  static const struct int4_opts o = {.g = 128};
  struct layout L = {.linear = ct_int4_fn, .opts = &o};
  run_layout(&L, w4a16_g128, NULL, 2, "model.layers.0.self_attn.qkv_proj", "ct-int4", "cpu-zentorch");
}
END_TEST

START_TEST(ct_pack_quantized_asymmetric_moe) {
  static const struct int4_opts o = {.g = 64, .asym = true};
  struct layout L = {.linear = ct_int4_fn, .opts = &o, .moe = true};
  run_layout(&L, w4a16_asym_g64, "model.safetensors", 1, "model.layers.0.mlp.experts", "ct-int4",
             "cpu-zentorch");
}
END_TEST

/* actorder "group": weight_g_idx per module, one permutation shared by each fused group as GPTQ computes it.
 */
static void ct_int4_actorder_fn(struct fx *f, const char *m, int64_t n, int64_t k, const void *o) {
  static int32_t *shared;
  static int64_t shared_k;
  static char parent[160];
  const char *last = strrchr(m, '.');
  bool second = strstr(m, "k_proj") || strstr(m, "v_proj") || strstr(m, "up_proj");
  if (!second || !shared || shared_k != k || strncmp(parent, m, (size_t)(last - m)) != 0) {
    free(shared);
    shared = make_g_idx(f, k, ((const struct int4_opts *)o)->g, true);
    shared_k = k;
    snprintf(parent, sizeof parent, "%.*s", (int)(last - m), m);
  }
  put_ct_int4(f, m, n, k, o, shared);
}

START_TEST(ct_pack_quantized_actorder_group) {
  static const struct int4_opts o = {.g = 32, .act_order = true};
  struct layout L = {.linear = ct_int4_actorder_fn, .opts = &o};
  run_layout(&L, w4a16_actorder, "model.safetensors", 1, "model.layers.0.self_attn.qkv_proj", "ct-int4",
             "cpu-zentorch");
}
END_TEST

START_TEST(ct_pack_quantized_w4a8_channelwise) {
  static const struct int4_opts o = {.g = 0};
  struct layout L = {.linear = ct_int4_fn, .opts = &o};
  run_layout(&L, w4a8_channel, "model.safetensors", 1, "model.layers.0.self_attn.o_proj", "ct-int4", NULL);
}
END_TEST

/* Refusals: zero points missing for an asymmetric config; a weight_shape that disagrees with the tensors. */
START_TEST(ct_pack_quantized_refusals) {
  static const struct int4_opts sym = {.g = 64};
  struct layout L = {.linear = ct_int4_fn, .opts = &sym};
  struct fx f;
  fx_init(&f, 11);
  put_model(&f, &L);
  char *d = fx_write(&f, "nozp", "model.safetensors", 1, false);
  w4a16_asym_g64(d);
  expect_refused(d, QKEEP_E_FORMAT, "weight_zero_point", "asymmetric", NULL);
  free(d);
  fx_free(&f);
  /* weight_shape [N, K - 3]: a K that is not a multiple of 8 (padded codes), or a broken file */
  fx_init(&f, 12);
  ct_shape_delta = -3;
  put_model(&f, &L);
  ct_shape_delta = 0;
  d = fx_write(&f, "shape", "model.safetensors", 1, false);
  ct_int4_configs_for(
      d, "{'dynamic': false, 'group_size': 64, 'num_bits': 4, 'strategy': 'group', 'type': 'int'}", "null");
  expect_refused(d, QKEEP_E_FORMAT, "weight_shape [128, 253]", "packed tensors are [128, 256]", NULL);
  free(d);
  fx_free(&f);
}
END_TEST

/* ---- 5. GPTQModel dynamic rules ------------------------------------------------------------------ */

/* -: keeps attention bf16; +: gives down_proj group 64. */
static void gptq_dynamic_fn(struct fx *f, const char *m, int64_t n, int64_t k, const void *o) {
  struct int4_opts local = *(const struct int4_opts *)o;
  if (strstr(m, "down_proj"))
    local.g = 64;
  put_gptq(f, m, n, k, &local, NULL);
}

static void gptqmodel_dynamic_configs(const char *d) {
  put_json(
      d, "config.json",
      "{'quantization_config': {'bits': 4, 'dynamic': {'-:.*\\\\.self_attn\\\\..*': {}, "
      "'+:.*\\\\.down_proj': {'group_size': 64, 'desc_act': false}}, 'group_size': 128, 'desc_act': false, "
      "'sym': true, 'lm_head': false, 'method': 'gptq', 'quant_method': 'gptq', 'format': 'gptq', "
      "'checkpoint_format': 'gptq', 'pack_dtype': 'int32', 'meta': {'quantizer': ['gptqmodel:4.0']}}}");
}

START_TEST(gptqmodel_dynamic_rules) {
  static const char *const attention[] = {"self_attn", NULL};
  struct layout L = {.linear = gptq_dynamic_fn, .opts = &gptq_128, .bf16_modules = attention};
  run_layout(&L, gptqmodel_dynamic_configs, "model.safetensors", 1, "model.layers.0.mlp.down_proj",
             "gptq-int4", NULL);
  struct pair pr;
  write_pair(&pr, &L, gptqmodel_dynamic_configs, "model.safetensors", 1);
  qkeep_model *m = load(pr.w0);
  ck_assert_str_eq(qkeep_model_find_layer(m, "model.layers.0.self_attn.qkv_proj")->scheme, "unquantized");
  ck_assert_int_eq(qkeep_model_find_layer(m, "model.layers.0.mlp.down_proj")->dims.group_size, 64);
  ck_assert_int_eq(qkeep_model_find_layer(m, "model.layers.0.mlp.gate_up_proj")->dims.group_size, 128);
  qkeep_model_free(m);
  free_pair(&pr);
}
END_TEST

/* ---- 6. file names ---------------------------------------------------------------------------- */

START_TEST(one_file_of_any_name_or_an_ambiguous_directory) {
  struct layout L = {.linear = nvfp4_fn};
  struct fx f;
  fx_init(&f, 21);
  put_model(&f, &L);
  char *d = fx_write(&f, "named", "llama-nvfp4.safetensors", 1, false);
  put_json(d, "hf_quant_config.json", hf_quant_nvfp4);
  qkeep_model *m = load(d);
  tu_assert_census_clean(m);
  qkeep_model_free(m);
  /* a second file and no index: which holds the model is not written anywhere */
  char *other = tu_path(d, "consolidated.safetensors"), *first = tu_path(d, "llama-nvfp4.safetensors");
  size_t n;
  void *bytes = tu_read_file(first, &n);
  ck_assert_int_eq(tu_write_file(other, bytes, n), 0);
  expect_refused(d, QKEEP_E_FORMAT, "ambiguous", "consolidated.safetensors", "llama-nvfp4.safetensors", NULL);
  free(bytes), free(other), free(first), free(d);
  fx_free(&f);
}
END_TEST

/* ---- 7. 2024 compressed-tensors kv names ------------------------------------------------------ */

static void ct_2024_configs(const char *d) {
  put_json(d, "config.json",
           "{'compression_config': {'quant_method': 'compressed-tensors', 'format': 'int-quantized', "
           "'quantization_status': 'frozen', 'config_groups': {'group_0': {'targets': ['Linear'], "
           "'weights': {'num_bits': 8, 'type': 'int', 'symmetric': true, 'strategy': 'channel', 'dynamic': "
           "false}, 'input_activations': {'num_bits': 8, 'type': 'int', 'symmetric': true, 'strategy': "
           "'token', 'dynamic': true}}}, 'ignore': ['lm_head'], 'kv_cache_scheme': {'num_bits': 8, 'type': "
           "'float', 'strategy': 'tensor', 'dynamic': false, 'symmetric': true}, 'sparsity_config': null, "
           "'version': '0.5.0'}}");
}

START_TEST(ct_2024_output_scale_kv_names) {
  static const struct int8_opts o = {0};
  struct layout L = {.linear = w8a8_fn, .opts = &o, .ct_kv_2024 = true};
  run_layout(&L, ct_2024_configs, "model.safetensors", 1, "model.layers.0.self_attn.qkv_proj", "w8a8-int8",
             "cpu-onednn");
  struct pair pr;
  write_pair(&pr, &L, ct_2024_configs, "model.safetensors", 1);
  qkeep_model *m = load(pr.w0);
  qkeep_layer *kv = NULL;
  qkeep_param *k = qkeep_model_lookup(m, "model.layers.0.self_attn.k_proj.output_scale", &kv);
  ck_assert_ptr_nonnull(k);
  ck_assert_str_eq(kv->name, "model.layers.0.self_attn.attn");
  ck_assert_str_eq(qkeep_param_checkpoint_name(k), "k_scale");
  ck_assert_ptr_eq(qkeep_model_lookup(m, "model.layers.0.self_attn.v_proj.output_scale", NULL),
                   qkeep_param_lookup(kv, "v_scale"));
  qkeep_model_free(m);
  free_pair(&pr);
}
END_TEST

/* ---- 8. ModelOpt MIXED_PRECISION -------------------------------------------------------------- */

static void modelopt_mixed_configs(const char *d) {
  put_json(d, "hf_quant_config.json",
           "{'producer': {'name': 'modelopt', 'version': '0.37.0'}, 'quantization': {'quant_algo': "
           "'MIXED_PRECISION', 'kv_cache_quant_algo': null, 'quantized_layers': {'layers.0.mlp.gate_proj': "
           "{'quant_algo': 'NVFP4', 'group_size': 16}, 'layers.0.mlp.up_proj': {'quant_algo': 'NVFP4', "
           "'group_size': 16}, 'layers.0.mlp.down_proj': {'quant_algo': 'NVFP4', 'group_size': 16}}, "
           "'exclude_modules': ['lm_head', 'layers.0.self_attn*']}}");
}

START_TEST(modelopt_mixed_precision_quantized_layers) {
  static const char *const attention[] = {"self_attn", NULL};
  struct layout L = {.linear = nvfp4_fn, .bf16_modules = attention};
  run_layout(&L, modelopt_mixed_configs, "model.safetensors", 1, "model.layers.0.mlp.gate_up_proj",
             "modelopt-nvfp4", NULL);
  struct pair pr;
  write_pair(&pr, &L, modelopt_mixed_configs, "model.safetensors", 1);
  qkeep_model *m = load(pr.w0);
  ck_assert_str_eq(qkeep_model_find_layer(m, "model.layers.0.self_attn.qkv_proj")->scheme, "unquantized");
  qkeep_model_free(m);
  /* an FP8 layer in the list is refused by name */
  put_json(pr.w0, "hf_quant_config.json",
           "{'producer': {'name': 'modelopt'}, 'quantization': {'quant_algo': 'MIXED_PRECISION', "
           "'quantized_layers': {'layers.0.mlp.down_proj': {'quant_algo': 'FP8'}}}}");
  expect_refused(pr.w0, QKEEP_E_UNSUPPORTED, "layers.0.mlp.down_proj", "'FP8'", NULL);
  free_pair(&pr);
}
END_TEST

/* ---- 9 and 10. safetensors files the reference accepts; plain tensors of every dtype ----------- */

/* A plain-tensor checkpoint written by hand: leading whitespace, "__metadata__": null, a rank-8 tensor,
 * an empty tensor with a dimension of 2^64 - 1, a name without a module prefix, and one tensor of
 * every dtype the format defines. */
static char *write_odd_file(const char *file, unsigned seed) {
  char header[8192];
  size_t at = 0, data = 0;
  at += (size_t)snprintf(header + at, sizeof header - at,
                         "   \n{\"__metadata__\":null,"
                         "\"model.rope.rank8\":{\"dtype\":\"BF16\",\"shape\":[2,1,2,1,1,2,1,2],"
                         "\"data_offsets\":[0,32]},"
                         "\"model.empty.huge\":{\"dtype\":\"F32\",\"shape\":[0,18446744073709551615],"
                         "\"data_offsets\":[32,32]},"
                         "\"logit_scale\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[32,36]}");
  data = 36;
  for (int d = 0; d < QKEEP_DTYPE_COUNT; d++) {
    size_t bytes = (size_t)qkeep_dtype_bits((enum qkeep_dtype)d) * 8 / 8; /* 8 elements */
    at += (size_t)snprintf(
        header + at, sizeof header - at,
        ",\"model.plain.%s\":{\"dtype\":\"%s\",\"shape\":[2,4],\"data_offsets\":[%zu,%zu]}",
        qkeep_dtype_name((enum qkeep_dtype)d), qkeep_dtype_name((enum qkeep_dtype)d), data, data + bytes);
    data += bytes;
  }
  at += (size_t)snprintf(header + at, sizeof header - at, "}");
  unsigned char *buf = malloc(8 + at + data);
  for (int i = 0; i < 8; i++)
    buf[i] = (unsigned char)((uint64_t)at >> (8 * i));
  memcpy(buf + 8, header, at);
  uint64_t s = seed;
  for (size_t i = 0; i < data; i++)
    buf[8 + at + i] = (unsigned char)tu_rand(&s);
  char *path = tu_path(dir, file);
  ck_assert_int_eq(tu_write_file(path, buf, 8 + at + data), 0);
  free(buf);
  return path;
}

START_TEST(files_the_reference_accepts_and_every_dtype_load_and_reload) {
  char *w0 = write_odd_file("odd0.safetensors", 1), *w1 = write_odd_file("odd1.safetensors", 2);
  qkeep_model *m = load(w0), *cold = load(w1);
  tu_assert_census_clean(m);
  check_names(m, w0);
  for (int d = 0; d < QKEEP_DTYPE_COUNT; d++) {
    char name[64];
    snprintf(name, sizeof name, "model.plain.%s", qkeep_dtype_name((enum qkeep_dtype)d));
    qkeep_param *p = qkeep_model_lookup(m, name, NULL);
    ck_assert_msg(p != NULL, "%s", name);
    ck_assert_int_eq(qkeep_param_create_spec(p)->dtype, d);
  }
  /* the rank-8 tensor: a collapsed spec, the whole shape kept */
  qkeep_param *r8 = qkeep_model_lookup(m, "model.rope.rank8", NULL);
  ck_assert_int_eq(qkeep_param_create_spec(r8)->ndim, 6);
  ck_assert_int_eq(r8->full_ndim, 8);
  ck_assert(!digest_eq(m, cold));
  struct tu_storages before = {0}, after = {0}, cold_bytes = {0};
  tu_snapshot(m, &before);
  ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s", qkeep_errmsg());
  tu_snapshot(m, &after);
  tu_snapshot(cold, &cold_bytes);
  tu_assert_in_place_and_equal(&before, &after, &cold_bytes);
  ck_assert(digest_eq(m, cold));
  tu_release_snapshot(&before);
  tu_release_snapshot(&after);
  tu_release_snapshot(&cold_bytes);
  qkeep_model_free(m);
  qkeep_model_free(cold);
  free(w0);
  free(w1);
}
END_TEST

/* A W1 whose rank-8 tensor has another shape that collapses alike is refused before anything changes. */
START_TEST(reload_compares_the_whole_shape) {
  char *w0 = write_odd_file("a.safetensors", 1);
  static const char header[] = "{\"model.rope.rank8\":{\"dtype\":\"BF16\",\"shape\":[4,1,1,1,1,2,1,2],"
                               "\"data_offsets\":[0,32]}}";
  qkeep_model *m = load(w0);
  struct qkeep_digest d0;
  ck_assert_int_eq(qkeep_digest(m, &d0), 0);
  size_t n = sizeof header - 1;
  unsigned char *buf = calloc(1, 8 + n + 32);
  buf[0] = (unsigned char)n;
  memcpy(buf + 8, header, n);
  char *w1 = tu_path(dir, "b.safetensors");
  ck_assert_int_eq(tu_write_file(w1, buf, 8 + n + 32), 0);
  ck_assert_int_eq(qkeep_model_reload(m, w1, QKEEP_RELOAD_PARTIAL), QKEEP_E_FORMAT);
  ck_assert_msg(strstr(qkeep_errmsg(), "model.rope.rank8") && strstr(qkeep_errmsg(), "rank 8"), "%s",
                qkeep_errmsg());
  struct qkeep_digest d1;
  ck_assert_int_eq(qkeep_digest(m, &d1), 0);
  ck_assert(d0.hi == d1.hi && d0.lo == d1.lo);
  qkeep_model_free(m);
  free(buf), free(w0), free(w1);
}
END_TEST

int main(void) {
  fixture_name = "exporters";
  Suite *s = suite_create("exporters");
  TCase *tc = tcase_create("exporters");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, autogptq_quantize_config_json_and_its_file_name);
  tcase_add_test(tc, autoawq_quant_config_json);
  tcase_add_test(tc, quantized_modules_never_load_as_plain_layers);
  tcase_add_test(tc, ct_w8a8_static_bf16_scales_and_kv_scales);
  tcase_add_test(tc, ct_w8a8_moe_static_input_scales_merge_per_expert);
  tcase_add_test(tc, modelopt_031_without_quant_method);
  tcase_add_test(tc, modelopt_033_quant_library_and_string_kv_scheme);
  tcase_add_test(tc, ct_pack_quantized_w4a16_sharded);
  tcase_add_test(tc, ct_pack_quantized_asymmetric_moe);
  tcase_add_test(tc, ct_pack_quantized_actorder_group);
  tcase_add_test(tc, ct_pack_quantized_w4a8_channelwise);
  tcase_add_test(tc, ct_pack_quantized_refusals);
  tcase_add_test(tc, gptqmodel_dynamic_rules);
  tcase_add_test(tc, one_file_of_any_name_or_an_ambiguous_directory);
  tcase_add_test(tc, ct_2024_output_scale_kv_names);
  tcase_add_test(tc, modelopt_mixed_precision_quantized_layers);
  tcase_add_test(tc, files_the_reference_accepts_and_every_dtype_load_and_reload);
  tcase_add_test(tc, reload_compares_the_whole_shape);
  suite_add_tcase(s, tc);
  return tu_run_suite(s, CK_NORMAL);
}
