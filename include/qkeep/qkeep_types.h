/*
 * qkeep_types.h: the plain types shared by the engine API (qkeep.h) and the
 * plugin ABI (qkeep_backend.h): error codes, dtypes, layer kinds, tensor specs.
 *
 * Every struct that crosses the plugin ABI starts with its size in bytes and
 * grows only by appending fields; a reader treats a field past `size` as absent.
 */
#ifndef QKEEP_TYPES_H
#define QKEEP_TYPES_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define QKEEP_API __attribute__((visibility("default")))
#else
#define QKEEP_API
#endif

/* Error codes: 0 is success, every failure is negative. Numbers are never reused. */
enum qkeep_error {
  QKEEP_OK = 0,
  QKEEP_E_INVAL = -1,        /* bad argument or malformed input */
  QKEEP_E_NOMEM = -2,        /* out of host or device memory */
  QKEEP_E_IO = -3,           /* a read or write failed */
  QKEEP_E_FORMAT = -4,       /* a file does not follow its format */
  QKEEP_E_NOTFOUND = -5,     /* a name, file or symbol does not exist */
  QKEEP_E_EXISTS = -6,       /* a name is already taken by another object */
  QKEEP_E_ABI = -7,          /* plugin ABI version mismatch */
  QKEEP_E_PLUGIN = -8,       /* a plugin could not be loaded or initialised */
  QKEEP_E_NODEV = -9,        /* the backend's device is not present */
  QKEEP_E_UNSUPPORTED = -10, /* valid request this backend or scheme cannot do */
  QKEEP_E_DEVICE = -11,      /* a device operation failed */
  QKEEP_E_RULE = -12,        /* the request would break a lifecycle rule */
  QKEEP_E_CONFIG = -13,      /* the configuration file is wrong */
  QKEEP_E_STATE = -14,       /* the object is not in a state that allows this */
  /* Appended: a file operation's failure by its errno (EACCES/EPERM, EROFS, ENOSPC/EDQUOT), and a
   * run stopped by its caller (qkeep_quantize_options.cancel). */
  QKEEP_E_PERMISSION = -15,  /* permission denied */
  QKEEP_E_READONLY = -16,    /* read-only file system */
  QKEEP_E_NOSPACE = -17,     /* no space left on the device (or over quota) */
  QKEEP_E_INTERRUPTED = -18, /* stopped by the caller before it finished; nothing was left behind */
};

/*
 * Element types: every dtype of the safetensors format. The schemes' packed
 * e2m1 (FP4) lives in U8, two codes per byte, as the exporters write it; the
 * values from BOOL on were appended in ABI 1.x (numbers never change) and
 * load as plain tensors. F4 and F6_* are sub-byte: a spec's bytes are
 * numel x bits / 8 (qkeep_dtype_bits).
 */
enum qkeep_dtype {
  QKEEP_DTYPE_F32 = 0,
  QKEEP_DTYPE_F16 = 1,
  QKEEP_DTYPE_BF16 = 2,
  QKEEP_DTYPE_F8_E4M3 = 3,
  QKEEP_DTYPE_F8_E8M0 = 4,
  QKEEP_DTYPE_U8 = 5,
  QKEEP_DTYPE_I8 = 6,
  QKEEP_DTYPE_I32 = 7,
  QKEEP_DTYPE_I64 = 8,
  QKEEP_DTYPE_BOOL = 9,
  QKEEP_DTYPE_F4 = 10,      /* e2m1, 4 bits per element (safetensors' logical shape) */
  QKEEP_DTYPE_F6_E2M3 = 11, /* 6 bits per element */
  QKEEP_DTYPE_F6_E3M2 = 12, /* 6 bits per element */
  QKEEP_DTYPE_F8_E5M2 = 13,
  QKEEP_DTYPE_F8_E4M3FNUZ = 14, /* the FP8 of AMD MI300 checkpoints */
  QKEEP_DTYPE_F8_E5M2FNUZ = 15,
  QKEEP_DTYPE_I16 = 16,
  QKEEP_DTYPE_U16 = 17,
  QKEEP_DTYPE_U32 = 18,
  QKEEP_DTYPE_U64 = 19,
  QKEEP_DTYPE_F64 = 20,
  QKEEP_DTYPE_C64 = 21, /* two f32 */
  QKEEP_DTYPE_COUNT
};

/* What a layer computes. */
enum qkeep_layer_kind {
  QKEEP_LAYER_LINEAR = 0,    /* y = x W^T (+ bias) */
  QKEEP_LAYER_EMBEDDING = 1, /* a row lookup table; not applied as a GEMM */
  QKEEP_LAYER_MOE = 2,       /* stacked experts w13 / w2 */
  QKEEP_LAYER_KV_SCALES = 3, /* attention k/v scales */
  QKEEP_LAYER_OTHER = 4,     /* norms and anything a kernel reads as-is */
  QKEEP_LAYER_KIND_COUNT
};

/* Where a layer's memory lives, so that an engine (or DLPack) can name the device of its
 * params and activations. OTHER: a device whose backend does not say (built before ABI 1.4). */
enum qkeep_device_type {
  QKEEP_DEVICE_HOST = 0, /* host memory: the CPU backends */
  QKEEP_DEVICE_CUDA = 1, /* an NVIDIA GPU; the index is the CUDA device ordinal */
  QKEEP_DEVICE_ROCM = 2, /* an AMD GPU; the index is the HIP device ordinal */
  QKEEP_DEVICE_OTHER = 3
};

/* Layer flags (struct qkeep_layer_info.flags): what the scheme's config implies. */
#define QKEEP_LAYER_F_WEIGHT_SYM (1u << 0)        /* int weights without zero points */
#define QKEEP_LAYER_F_ACT_ORDER (1u << 1)         /* GPTQ desc_act: g_idx is a permutation */
#define QKEEP_LAYER_F_GPTQ_V2 (1u << 2)           /* qzeros store zero, not zero - 1 */
#define QKEEP_LAYER_F_INPUT_DYNAMIC (1u << 3)     /* activations quantised per token at run time */
#define QKEEP_LAYER_F_INPUT_ASYM (1u << 4)        /* activations carry a zero point */
#define QKEEP_LAYER_F_WEIGHT_PER_TENSOR (1u << 5) /* one weight scale per (fused) shard */
#define QKEEP_LAYER_F_TIED (1u << 6)              /* the weight is another layer's param (tied embedding) */
#define QKEEP_LAYER_F_INTERLEAVED_W13 (1u << 7)   /* MoE w13 rows alternate gate, up (gpt-oss) */

#define QKEEP_MAX_DIMS 6

/* A tensor's type and shape: contiguous, row-major. A rank-0 spec is a scalar. */
struct qkeep_spec {
  enum qkeep_dtype dtype;
  int ndim;
  int64_t shape[QKEEP_MAX_DIMS];
};

/* Lifecycle state of a param. */
enum qkeep_param_state {
  QKEEP_PARAM_LIVE = 0,     /* read by a kernel */
  QKEEP_PARAM_RETIRED = 1,  /* bytes kept, read by no kernel */
  QKEEP_PARAM_RELEASED = 2, /* storage emptied, with a reason (census shows it) */
  /* An unquantized checkpoint tensor of a model that quantizes on load (qkeep_model_set_quantize): its
   * name is registered and loads, but no storage is kept; its bytes land quantized in the layer's
   * kernel params. */
  QKEEP_PARAM_QUANTIZED = 3,
};

#ifdef __cplusplus
}
#endif
#endif
