/*
 * check_gpu_online.c: online quantization on the GPU (cuda-nvfp4's quantize slot, ABI 1.5), for
 * NVFP4 in both namings and MXFP4 (`make check-gpu`; exits 77 without a device).
 *
 *   - The kernels against the host quantizer, bit for bit: a checkpoint of random weights (BF16,
 *     F16 and F32; fusion groups and lone weights) with subnormals, zeros and all-zero tensors,
 *     exact rounding ties, magnitudes up to the dtype's largest, and an amax too small for an NVFP4
 *     global scale, planned as qkeep quantize plans it; every unit run through the slot on device
 *     buffers (16-byte aligned, and for one of the checkpoints shifted off that alignment) and
 *     through quant_plan_run on the host, and every output compared (codes, block
 *     scales, and the global scales the core derives from the slot's amax). A NaN or an Inf is
 *     refused with its member and element, and no output byte changes.
 *   - Through the core: an online load of examples/tiny, an online reload of W1 into W0 and a
 *     one-rank sync from bf16 buckets (in host and in GPU memory) equal their offline twins
 *     (qkeep quantize, then a cold load on cuda-nvfp4): every registered tensor byte for byte and
 *     the digest, storage pointers unchanged, and every unit quantized by the GPU.
 *
 * cuda-nvfp4's slot is on by default (key quantize_on_device); with the key false it declines every
 * unit and the host quantizes them, to the same bytes.
 *
 * A failure names the scheme, the tensor (or unit member and output), and the first differing byte.
 */
#include <math.h>
#include <string.h>

#include "gpu_testutil.h"
#include "online_testutil.h"

static qkeep_plugin *gpu, *ref;

static const char *const fp4[] = {"modelopt-nvfp4", "ct-nvfp4", "mxfp4"};

/* ---- device memory through the plugin's own memory ops ---- */

static const struct qkeep_backend *be(void) { return gpu->be; }

static void *dev_alloc_copy(const void *host, size_t n) {
  void *d;
  ck_assert_msg(be()->memory->alloc(be(), n ? n : 1, &d) == 0, "%s", qkeep_errmsg());
  if (host && n)
    ck_assert_msg(be()->memory->copy_h2d(be(), d, host, n) == 0, "%s", qkeep_errmsg());
  return d;
}

/* A bucket's device memory, freed once the device is done with it (the sync may still read it until its
 * copies and kernels are). */
static void release_bucket(void *on_device) {
  ck_assert_int_eq(be()->memory->sync(be()), 0);
  be()->memory->free(be(), on_device);
}
static const struct bucket_memory gpu_buckets = {dev_alloc_copy, release_bucket};

static void to_host(void *host, const void *dev, size_t n) {
  ck_assert_msg(be()->memory->copy_d2h(be(), host, dev, n) == 0, "%s", qkeep_errmsg());
}

/* The index of the first byte where a and b differ, or n. */
static size_t first_difference(const unsigned char *a, const unsigned char *b, size_t n) {
  size_t i = 0;
  while (i < n && a[i] == b[i])
    i++;
  return i;
}

/* ---- random weights with the cases that matter ---- */

/* One value's bits in dtype: sign, biased exponent and mantissa fields. */
static uint32_t bits_of(enum qkeep_dtype dtype, uint32_t sign, uint32_t exp, uint32_t man) {
  switch (dtype) {
  case QKEEP_DTYPE_F32: return sign << 31 | exp << 23 | (man & 0x7fffffu);
  case QKEEP_DTYPE_F16: return sign << 15 | exp << 10 | (man & 0x3ffu);
  default: return sign << 15 | exp << 7 | (man & 0x7fu);
  }
}

static void put(void *data, enum qkeep_dtype dtype, int64_t i, uint32_t bits) {
  if (dtype == QKEEP_DTYPE_F32)
    ((uint32_t *)data)[i] = bits;
  else
    ((uint16_t *)data)[i] = (uint16_t)bits;
}

/* A value of the dtype from a float that it holds exactly (ties and their scales: small significands). */
static uint32_t exact_bits(enum qkeep_dtype dtype, float v) {
  uint32_t b;
  memcpy(&b, &v, sizeof b);
  if (dtype == QKEEP_DTYPE_F32)
    return b;
  if (dtype == QKEEP_DTYPE_BF16) {
    ck_assert_msg((b & 0xffffu) == 0, "%g is no bf16", (double)v);
    return b >> 16;
  }
  uint16_t h = qkeep_f32_to_f16(v);
  ck_assert_msg(qkeep_f16_to_f32(h) == v, "%g is no f16", (double)v);
  return h;
}

enum kind {
  MIXED, /* blocks of: random exponents near 1, zeros, subnormals, the dtype's whole exponent range */
  TIES,  /* every value on an e2m1 rounding bound once divided by its block's decode factor */
  ZERO,  /* all zeros (amax 0) */
  TINY,  /* nonzero, all below 2688 * FLT_MIN: NVFP4 refuses, MXFP4 takes it */
  BAD,   /* MIXED with one NaN or Inf */
};

/* The ties: exact bounds (and the values between) of e2m1 in units of the decode factor. */
static const float tie_units[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.5f,
                                  1.0f,  1.5f,  2.0f,  3.0f,  4.0f, 6.0f, 0.0f, 0.25f};

/*
 * Fills a [n, k] weight. TIES: with the tensor's amax 2688 * 2^P (one element), ModelOpt's
 * weight_scale_2 is 2^P and compressed-tensors' global scale 2^-P, exactly; a block whose amax is
 * 6 * c * 2^P (c an e4m3 value) gets block scale c exactly, so its decode factor is c * 2^P and the
 * values t * c * 2^P land on e2m1's bounds t. For MXFP4 (c 1 or 2) the shared scale is 2^P or
 * 2^(P+1), with the same result.
 */
static void fill(void *data, enum qkeep_dtype dtype, int64_t n, int64_t k, enum kind kind, uint64_t seed) {
  const int P = -3;
  int emax = dtype == QKEEP_DTYPE_F32 ? 254 : dtype == QKEEP_DTYPE_F16 ? 30 : 254;
  int bias = dtype == QKEEP_DTYPE_F16 ? 15 : 127;
  uint64_t s = seed;
  for (int64_t b = 0; b < n * k / 32; b++) {
    int which = (int)(tu_rand(&s) % 5);
    static const float cs[] = {1.0f, 2.0f, 0.5f, 1.5f};
    float c = cs[tu_rand(&s) % 4];
    for (int j = 0; j < 32; j++) {
      int64_t i = 32 * b + j;
      uint32_t sign = (uint32_t)(tu_rand(&s) & 1), man = (uint32_t)tu_rand(&s);
      uint32_t bits = 0;
      switch (kind) {
      case ZERO: bits = bits_of(dtype, sign, 0, 0); break;
      case TINY: /* below 2688 * FLT_MIN (about 3.2e-35) in every dtype: f16 has no such values but 0 */
        bits = dtype == QKEEP_DTYPE_F16 ? 0 : bits_of(dtype, sign, (uint32_t)(tu_rand(&s) % 8), man);
        break;
      case TIES: {
        float t = j % 16 == 0 ? 6.0f : tie_units[tu_rand(&s) % 16]; /* each 16-block has its amax 6c */
        bits = exact_bits(dtype, (sign && j % 16 ? -1.0f : 1.0f) * t * c * ldexpf(1.0f, P));
        break;
      }
      default:
        switch (which) {
        case 0: bits = bits_of(dtype, sign, (uint32_t)(bias - 6 + (int)(tu_rand(&s) % 12)), man); break;
        case 1: bits = bits_of(dtype, sign, 0, j % 3 ? 0 : man); break; /* zeros, some subnormal */
        case 2: bits = bits_of(dtype, sign, 0, man | 1); break;         /* subnormals */
        case 3: bits = bits_of(dtype, sign, (uint32_t)(1 + tu_rand(&s) % (uint64_t)emax), man); break;
        default:
          bits = bits_of(dtype, sign, (uint32_t)(bias + (int)(tu_rand(&s) % 3)), man & ~1u); /* near 1 */
        }
      }
      put(data, dtype, i, bits);
    }
  }
  if (kind == TIES) /* the tensor's amax, 2688 * 2^P */
    put(data, dtype, 1, exact_bits(dtype, 2688.0f * ldexpf(1.0f, P)));
}

/* The weights of the random checkpoint: name, dtype, rows, kind. K is 256 everywhere. */
struct weight {
  const char *name;
  enum qkeep_dtype dtype;
  int64_t n;
  enum kind kind;
};

#define K 256
static const struct weight weights[] = {
    /* BF16: a q/k/v group and a gate/up group of mixed blocks, a lone weight */
    {"model.layers.0.self_attn.q_proj.weight", QKEEP_DTYPE_BF16, 96, MIXED},
    {"model.layers.0.self_attn.k_proj.weight", QKEEP_DTYPE_BF16, 32, MIXED},
    {"model.layers.0.self_attn.v_proj.weight", QKEEP_DTYPE_BF16, 48, MIXED},
    {"model.layers.0.self_attn.o_proj.weight", QKEEP_DTYPE_BF16, 64, MIXED},
    {"model.layers.0.mlp.gate_proj.weight", QKEEP_DTYPE_BF16, 80, TIES},
    {"model.layers.0.mlp.up_proj.weight", QKEEP_DTYPE_BF16, 80, TIES},
    {"model.layers.0.mlp.down_proj.weight", QKEEP_DTYPE_BF16, 16, ZERO},
    /* F16 */
    {"model.layers.1.self_attn.q_proj.weight", QKEEP_DTYPE_F16, 64, MIXED},
    {"model.layers.1.self_attn.k_proj.weight", QKEEP_DTYPE_F16, 32, TIES},
    {"model.layers.1.self_attn.v_proj.weight", QKEEP_DTYPE_F16, 32, MIXED},
    {"model.layers.1.self_attn.o_proj.weight", QKEEP_DTYPE_F16, 48, TIES},
    /* F32 */
    {"model.layers.2.self_attn.o_proj.weight", QKEEP_DTYPE_F32, 64, MIXED},
    {"model.layers.2.mlp.down_proj.weight", QKEEP_DTYPE_F32, 32, TINY},
    {"model.layers.2.mlp.gate_proj.weight", QKEEP_DTYPE_F32, 16, TIES},
    {"model.layers.2.mlp.up_proj.weight", QKEEP_DTYPE_F32, 16, MIXED},
    /* a NaN in k (member 1) at element 300, an Inf in v at element 5: k's is the first */
    {"model.layers.3.self_attn.q_proj.weight", QKEEP_DTYPE_BF16, 32, MIXED},
    {"model.layers.3.self_attn.k_proj.weight", QKEEP_DTYPE_BF16, 32, BAD},
    {"model.layers.3.self_attn.v_proj.weight", QKEEP_DTYPE_BF16, 32, BAD},
    {"model.layers.4.mlp.down_proj.weight", QKEEP_DTYPE_BF16, 16, TINY},
};
#define N_WEIGHTS (sizeof weights / sizeof weights[0])

/* Writes the random checkpoint into dir (model.safetensors); returns its path. */
static char *write_random(const char *dir, uint64_t seed) {
  struct st_writer *w;
  ck_assert_int_eq(st_writer_new(&w), 0);
  for (size_t i = 0; i < N_WEIGHTS; i++) {
    const struct weight *x = &weights[i];
    size_t bytes = (size_t)(x->n * K) * qkeep_dtype_size(x->dtype);
    void *data = calloc(1, bytes);
    fill(data, x->dtype, x->n, K, x->kind, seed + i * 7919);
    if (x->kind == BAD) {
      bool k = strstr(x->name, "k_proj") != NULL;
      put(data, x->dtype, k ? 300 : 5, k ? 0x7fc1u : 0x7f80u); /* NaN in k, +Inf in v */
    }
    struct qkeep_spec spec = {x->dtype, 2, {x->n, K}};
    ck_assert_int_eq(st_writer_add(w, x->name, &spec, data), 0);
    free(data);
  }
  char *path = tu_path(dir, "model.safetensors");
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  return path;
}

/* ---- the kernels against quant_plan_run ---- */

/* One unit on both sides: the host's outputs (quant_plan_run) and the slot's, compared. */
/* shifted: every source one element and every output one byte past a 16-byte boundary (the kernels'
 * element-by-element loads and byte stores), else where the allocation starts (their vector paths). */
static void compare_unit(const struct quant_plan *plan, size_t unit, const struct ckpt *ck,
                         const char *scheme, bool shifted, int *refusals) {
  int members = quant_plan_members(plan, unit);
  struct quant_member qm[3];
  void *src[3], *host[3][4] = {{0}}, *dsrc[3], *dout[3][2], *at_src[3], *at_out[3][2];
  struct qkeep_quant_member qmem[3];
  size_t out_bytes[3][2];
  for (int m = 0; m < members; m++) {
    quant_plan_member(plan, unit, m, &qm[m]);
    const struct ckpt_tensor *t = ckpt_find(ck, qm[m].input);
    ck_assert_ptr_nonnull(t);
    src[m] = malloc(qm[m].nbytes);
    ck_assert_int_eq(ckpt_read(ck, t, src[m]), 0);
    for (int s = 0; s < qm[m].n_out; s++) {
      struct quant_output o;
      quant_plan_output(plan, qm[m].out[s], &o);
      host[m][s] = o.constant ? NULL : calloc(1, o.nbytes);
      if (s < 2)
        out_bytes[m][s] = o.nbytes;
    }
    size_t shift = shifted ? (qm[m].dtype == QKEEP_DTYPE_F32 ? 4 : 2) : 0;
    dsrc[m] = dev_alloc_copy(NULL, qm[m].nbytes + shift);
    at_src[m] = (char *)dsrc[m] + shift;
    if (qm[m].nbytes)
      ck_assert_int_eq(be()->memory->copy_h2d(be(), at_src[m], src[m], qm[m].nbytes), 0);
    for (int s = 0; s < 2; s++) { /* outputs start as a pattern: a refusal must leave it */
      unsigned char *pattern = malloc(out_bytes[m][s] + 1);
      memset(pattern, 0xa5, out_bytes[m][s] + 1);
      dout[m][s] = dev_alloc_copy(pattern, out_bytes[m][s] + 1);
      at_out[m][s] = (char *)dout[m][s] + shifted;
      free(pattern);
    }
    qmem[m] = (struct qkeep_quant_member){sizeof qmem[m], qm[m].input, qm[m].dtype,  qm[m].n,
                                          qm[m].k,        at_src[m],   at_out[m][0], at_out[m][1]};
  }
  int host_rc = quant_plan_run(plan, unit, (const void *const *)src, (void *const(*)[4])host);
  char host_msg[512];
  snprintf(host_msg, sizeof host_msg, "%s", qkeep_errmsg());
  struct qkeep_quant_unit u = {sizeof u, scheme, members, qmem, sizeof qmem[0], -1.0f, -2, -2};
  int rc = be()->quantize(be(), NULL, &u);
  ck_assert_int_eq(be()->memory->sync(be()), 0);
  if (host_rc) { /* refused on both sides, for the same element, with nothing written */
    ck_assert_msg(rc == QKEEP_E_INVAL, "%s: '%s': the host refused (%s), the slot returned %d", scheme,
                  qm[0].input, host_msg, rc);
    if (u.bad_member >= 0) {
      char where[64];
      snprintf(where, sizeof where, "element %lld ", (long long)u.bad_element);
      ck_assert_msg(strstr(host_msg, qm[u.bad_member].input) && strstr(host_msg, where),
                    "%s: the slot names member %d element %lld, the host: %s", scheme, u.bad_member,
                    (long long)u.bad_element, host_msg);
    } else {
      ck_assert_msg(strstr(host_msg, "amax"), "%s: the slot refused for the amax, the host: %s", scheme,
                    host_msg);
    }
    for (int m = 0; m < members; m++)
      for (int s = 0; s < 2; s++) {
        unsigned char *got = malloc(out_bytes[m][s]), pattern = 0xa5;
        to_host(got, at_out[m][s], out_bytes[m][s]);
        size_t i = 0;
        while (i < out_bytes[m][s] && got[i] == pattern)
          i++;
        ck_assert_msg(i == out_bytes[m][s], "%s: '%s' output %d: byte %zu written by a refused unit", scheme,
                      qm[m].input, s, i);
        free(got);
      }
    (*refusals)++;
  } else {
    ck_assert_msg(rc == 0, "%s: '%s': the slot returned %d: %s", scheme, qm[0].input, rc, qkeep_errmsg());
    void *global[3][4] = {{0}};
    for (int m = 0; m < members; m++) {
      for (int s = 0; s < 2; s++) {
        unsigned char *got = malloc(out_bytes[m][s]);
        to_host(got, at_out[m][s], out_bytes[m][s]);
        size_t i = first_difference(got, host[m][s], out_bytes[m][s]);
        ck_assert_msg(i == out_bytes[m][s],
                      "%s: '%s' %s%s: byte %zu (row %lld) is 0x%02x on the GPU, 0x%02x on the host", scheme,
                      qm[m].input, s ? "block scales" : "codes", shifted ? " (shifted)" : "", i,
                      (long long)(i / (size_t)(out_bytes[m][s] / (size_t)qm[m].n)),
                      i < out_bytes[m][s] ? got[i] : 0,
                      i < out_bytes[m][s] ? ((unsigned char *)host[m][s])[i] : 0);
        free(got);
      }
      global[m][2] = malloc(4);
    }
    /* the global scales the core derives from the slot's amax */
    ck_assert_int_eq(quant_plan_finish(plan, unit, u.amax, (void *const(*)[4])global), 0);
    for (int m = 0; m < members && strcmp(scheme, "mxfp4") != 0; m++)
      ck_assert_msg(memcmp(global[m][2], host[m][2], 4) == 0,
                    "%s: '%s': global scale %a from the GPU's amax, %a on the host", scheme, qm[m].input,
                    (double)*(float *)global[m][2], (double)*(float *)host[m][2]);
    for (int m = 0; m < members; m++)
      free(global[m][2]);
  }
  for (int m = 0; m < members; m++) {
    free(src[m]);
    for (int s = 0; s < 4; s++)
      free(host[m][s]);
    be()->memory->free(be(), dsrc[m]);
    be()->memory->free(be(), dout[m][0]);
    be()->memory->free(be(), dout[m][1]);
  }
}

START_TEST(random_weights_quantize_on_the_gpu_as_on_the_host_bit_for_bit) {
  char *dir = tu_tmpdir("gpu-online-random");
  for (uint64_t seed = 1; seed <= 3; seed++) {
    char *path = write_random(dir, seed * 1000003);
    struct ckpt *ck;
    ck_assert_int_eq(ckpt_open(path, &ck), 0);
    for (size_t s = 0; s < 3; s++) {
      struct qkeep_quantize_options o = options_for(fp4[s]);
      struct quant_plan *plan;
      ck_assert_msg(quant_plan_new(ck, &o, &plan) == 0, "%s", qkeep_errmsg());
      int refusals = 0;
      for (size_t unit = 0; unit < quant_plan_units(plan); unit++)
        compare_unit(plan, unit, ck, fp4[s], seed == 2, &refusals);
      /* NVFP4: the NaN group and the two tiny-amax weights; MXFP4: its k and v (each a unit) */
      ck_assert_msg(refusals == (strcmp(fp4[s], "mxfp4") == 0 ? 2 : 3), "%s: %d units refused", fp4[s],
                    refusals);
      quant_plan_free(plan);
    }
    ckpt_close(ck);
    free(path);
  }
  tu_rmtree(dir);
  free(dir);
}
END_TEST

/* ---- through the core ---- */

static qkeep_model *load_gpu(const char *path, const struct qkeep_quantize_options *online) {
  qkeep_model *m;
  ck_assert_int_eq(qkeep_model_new(gpu, &m), 0);
  if (online)
    ck_assert_msg(qkeep_model_set_quantize(m, online) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_model_load(m, path) == 0, "%s: %s", path, qkeep_errmsg());
  return m;
}

static qkeep_model *load_gpu_cold(void *user, const char *path) {
  (void)user;
  return load_gpu(path, NULL);
}

/* qkeep quantize's output of `in`, loaded cold on the GPU. */
static qkeep_model *offline_twin(const char *in, const struct qkeep_quantize_options *o) {
  return offline_twin_by(in, o, load_gpu_cold, NULL);
}

/* Every registered tensor (GPU memory) equal to the twin's (after PWAL), and the digests. */
static void assert_same(qkeep_model *a, qkeep_model *b, const char *what) {
  assert_twins(a, b, what, to_host);
}

/* Every unit of the plan went to the GPU since `before`. */
static void assert_on_gpu(const qkeep_model *m, int64_t before, const char *what) {
  int64_t units = (int64_t)quant_plan_units(m->online.plan), done = m->online.device_units - before;
  ck_assert_msg(done == units, "%s: %lld of %lld units quantized on the GPU", what, (long long)done,
                (long long)units);
}

START_TEST(an_online_load_on_the_gpu_equals_quantize_then_load) {
  char *tiny = example("tiny");
  for (size_t s = 0; s < 3; s++) {
    struct qkeep_quantize_options o = options_for(fp4[s]);
    qkeep_model *online = load_gpu(tiny, &o), *offline = offline_twin(tiny, &o);
    assert_on_gpu(online, 0, fp4[s]);
    assert_same(online, offline, fp4[s]);
    qkeep_model_free(online);
    qkeep_model_free(offline);
  }
  free(tiny);
}
END_TEST

START_TEST(an_online_reload_of_w1_into_w0_equals_w1_quantized_then_loaded) {
  char *tiny = example("tiny"), *w1 = example("tiny-w1");
  for (size_t s = 0; s < 3; s++) {
    struct qkeep_quantize_options o = options_for(fp4[s]);
    qkeep_model *m = load_gpu(tiny, &o);
    struct addresses *before = calloc(1, sizeof *before), *after = calloc(1, sizeof *after);
    ck_assert_int_eq(qkeep_foreach_storage(m, note_address, before), 0);
    int64_t units = m->online.device_units;
    ck_assert_msg(qkeep_model_reload(m, w1, 0) == 0, "%s: %s", fp4[s], qkeep_errmsg());
    assert_on_gpu(m, units, fp4[s]);
    ck_assert_int_eq(qkeep_foreach_storage(m, note_address, after), 0);
    ck_assert_uint_eq(before->n, after->n);
    for (size_t i = 0; i < before->n; i++)
      ck_assert_msg(before->at[i] == after->at[i], "%s: storage %zu moved in the reload", fp4[s], i);
    qkeep_model *twin = offline_twin(w1, &o);
    assert_same(m, twin, fp4[s]);
    free(before), free(after);
    qkeep_model_free(twin);
    qkeep_model_free(m);
  }
  free(tiny), free(w1);
}
END_TEST

START_TEST(a_one_rank_sync_of_bf16_buckets_equals_w1_quantized_then_loaded) {
  char *tiny = example("tiny"), *w1 = example("tiny-w1");
  for (size_t s = 0; s < 3; s++) {
    struct qkeep_quantize_options o = options_for(fp4[s]);
    qkeep_model *twin = offline_twin(w1, &o);
    for (int on_device = 0; on_device < 2; on_device++) {
      char what[96];
      snprintf(what, sizeof what, "%s, buckets in %s memory", fp4[s], on_device ? "GPU" : "host");
      qkeep_model *m = load_gpu(tiny, &o);
      int64_t units = m->online.device_units;
      ck_assert_msg(sync_from_buckets(m, w1, 300 << 10, on_device ? &gpu_buckets : NULL) == 0, "%s: %s", what,
                    qkeep_errmsg());
      assert_on_gpu(m, units, what);
      assert_same(m, twin, what);
      qkeep_model_free(m);
    }
    qkeep_model_free(twin);
  }
  free(tiny), free(w1);
}
END_TEST

/* Sets cuda-nvfp4's key quantize_on_device (true by default). */
static void set_quantize_on_device(const char *value) {
  char *dir = tu_tmpdir("gpu-online"), *ini = tu_path(dir, "gpu.ini");
  char text[160];
  snprintf(text, sizeof text,
           "[qkeep]\nbackend = cuda-nvfp4\n[backend.cuda-nvfp4]\nquantize_on_device = %s\n", value);
  ck_assert_int_eq(tu_write_file(ini, text, strlen(text)), 0);
  qkeep_config *cfg;
  ck_assert_msg(qkeep_config_load(ini, &cfg) == 0, "%s", qkeep_errmsg());
  ck_assert_msg(qkeep_plugin_configure(gpu, cfg) == 0, "%s", qkeep_errmsg());
  qkeep_config_free(cfg);
  tu_rmtree(dir);
  free(ini);
  free(dir);
}

/* With quantize_on_device = false the slot declines every unit: the host quantizes, to the same bytes. */
START_TEST(with_quantize_on_device_false_the_host_quantizes_to_the_same_bytes) {
  char *tiny = example("tiny");
  set_quantize_on_device("false");
  for (size_t s = 0; s < 3; s++) {
    struct qkeep_quantize_options o = options_for(fp4[s]);
    qkeep_model *online = load_gpu(tiny, &o), *offline = offline_twin(tiny, &o);
    ck_assert_msg(online->online.device_units == 0, "%s: %lld units quantized on the GPU with the key false",
                  fp4[s], (long long)online->online.device_units);
    assert_same(online, offline, fp4[s]);
    qkeep_model_free(online);
    qkeep_model_free(offline);
  }
  set_quantize_on_device("true");
  free(tiny);
}
END_TEST

static Suite *online_suite(void) {
  Suite *s = suite_create("gpu-online");
  TCase *tc = tcase_create("gpu-online");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, random_weights_quantize_on_the_gpu_as_on_the_host_bit_for_bit);
  tcase_add_test(tc, an_online_load_on_the_gpu_equals_quantize_then_load);
  tcase_add_test(tc, an_online_reload_of_w1_into_w0_equals_w1_quantized_then_loaded);
  tcase_add_test(tc, a_one_rank_sync_of_bf16_buckets_equals_w1_quantized_then_loaded);
  tcase_add_test(tc, with_quantize_on_device_false_the_host_quantizes_to_the_same_bytes);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return gtu_main("check_gpu_online", online_suite, &gpu, &ref); }
