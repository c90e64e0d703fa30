/* dtype.c: element types, their sizes and safetensors names. */
#include <string.h>

#include "base/base.h"

static const struct {
  const char *name;
  unsigned bits;
} dtypes[QKEEP_DTYPE_COUNT] = {
    [QKEEP_DTYPE_F32] = {"F32", 32},
    [QKEEP_DTYPE_F16] = {"F16", 16},
    [QKEEP_DTYPE_BF16] = {"BF16", 16},
    [QKEEP_DTYPE_F8_E4M3] = {"F8_E4M3", 8},
    [QKEEP_DTYPE_F8_E8M0] = {"F8_E8M0", 8},
    [QKEEP_DTYPE_U8] = {"U8", 8},
    [QKEEP_DTYPE_I8] = {"I8", 8},
    [QKEEP_DTYPE_I32] = {"I32", 32},
    [QKEEP_DTYPE_I64] = {"I64", 64},
    [QKEEP_DTYPE_BOOL] = {"BOOL", 8},
    [QKEEP_DTYPE_F4] = {"F4", 4},
    [QKEEP_DTYPE_F6_E2M3] = {"F6_E2M3", 6},
    [QKEEP_DTYPE_F6_E3M2] = {"F6_E3M2", 6},
    [QKEEP_DTYPE_F8_E5M2] = {"F8_E5M2", 8},
    [QKEEP_DTYPE_F8_E4M3FNUZ] = {"F8_E4M3FNUZ", 8},
    [QKEEP_DTYPE_F8_E5M2FNUZ] = {"F8_E5M2FNUZ", 8},
    [QKEEP_DTYPE_I16] = {"I16", 16},
    [QKEEP_DTYPE_U16] = {"U16", 16},
    [QKEEP_DTYPE_U32] = {"U32", 32},
    [QKEEP_DTYPE_U64] = {"U64", 64},
    [QKEEP_DTYPE_F64] = {"F64", 64},
    [QKEEP_DTYPE_C64] = {"C64", 64},
};

/* Whole bytes per element; 0 for the sub-byte dtypes (F4, F6_*), whose size only a shape gives. */
size_t qkeep_dtype_size(enum qkeep_dtype dtype) {
  return (unsigned)dtype < QKEEP_DTYPE_COUNT && dtypes[dtype].bits % 8 == 0 ? dtypes[dtype].bits / 8 : 0;
}

unsigned qkeep_dtype_bits(enum qkeep_dtype dtype) {
  return (unsigned)dtype < QKEEP_DTYPE_COUNT ? dtypes[dtype].bits : 0;
}

const char *qkeep_dtype_name(enum qkeep_dtype dtype) {
  return (unsigned)dtype < QKEEP_DTYPE_COUNT ? dtypes[dtype].name : "?";
}

int qkeep_dtype_parse(const char *name, enum qkeep_dtype *out) {
  for (int i = 0; i < QKEEP_DTYPE_COUNT; i++)
    if (strcmp(name, dtypes[i].name) == 0) {
      *out = (enum qkeep_dtype)i;
      return 0;
    }
  return QKEEP_E_NOTFOUND;
}

int64_t qkeep_spec_numel(const struct qkeep_spec *spec) {
  int64_t n = 1;
  for (int i = 0; i < spec->ndim; i++)
    n *= spec->shape[i];
  return n;
}

/* numel x bits / 8, rounded up (the safetensors format allows only whole bytes). */
size_t qkeep_spec_bytes(const struct qkeep_spec *spec) {
  return ((size_t)qkeep_spec_numel(spec) * qkeep_dtype_bits(spec->dtype) + 7) / 8;
}

const char *qkeep_layer_kind_name(enum qkeep_layer_kind kind) {
  static const char *names[QKEEP_LAYER_KIND_COUNT] = {"linear", "embedding", "moe", "kv-scales", "other"};
  return (unsigned)kind < QKEEP_LAYER_KIND_COUNT ? names[kind] : "?";
}

const char *qkeep_version(void) { return PACKAGE_VERSION; }
