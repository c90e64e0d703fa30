/* dtype.c: element types, their sizes and safetensors names. */
#include <string.h>

#include "internal.h"

static const struct {
  const char *name;
  size_t size;
} dtypes[QKEEP_DTYPE_COUNT] = {
    [QKEEP_DTYPE_F32] = {"F32", 4},         [QKEEP_DTYPE_F16] = {"F16", 2},
    [QKEEP_DTYPE_BF16] = {"BF16", 2},       [QKEEP_DTYPE_F8_E4M3] = {"F8_E4M3", 1},
    [QKEEP_DTYPE_F8_E8M0] = {"F8_E8M0", 1}, [QKEEP_DTYPE_U8] = {"U8", 1},
    [QKEEP_DTYPE_I8] = {"I8", 1},           [QKEEP_DTYPE_I32] = {"I32", 4},
    [QKEEP_DTYPE_I64] = {"I64", 8},
};

size_t qkeep_dtype_size(enum qkeep_dtype dtype) {
  return (unsigned)dtype < QKEEP_DTYPE_COUNT ? dtypes[dtype].size : 0;
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

size_t qkeep_spec_bytes(const struct qkeep_spec *spec) {
  return (size_t)qkeep_spec_numel(spec) * qkeep_dtype_size(spec->dtype);
}

const char *qkeep_layer_kind_name(enum qkeep_layer_kind kind) {
  static const char *names[QKEEP_LAYER_KIND_COUNT] = {"linear", "embedding", "moe", "kv-scales", "other"};
  return (unsigned)kind < QKEEP_LAYER_KIND_COUNT ? names[kind] : "?";
}

const char *qkeep_version(void) { return PACKAGE_VERSION; }
