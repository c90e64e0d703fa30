/*
 * registry.c: the schemes by name. Above every scheme file (it names them all) and used by the
 * model's assembly and the quantizer; no scheme file uses it.
 */
#include <string.h>

#include "scheme/scheme.h"

const struct scheme *scheme_by_name(const char *name) {
  static const struct scheme *const all[] = {&scheme_unquantized, &scheme_modelopt_nvfp4, &scheme_ct_nvfp4,
                                             &scheme_mxfp4,       &scheme_w8a8_int8,      &scheme_gptq_int4,
                                             &scheme_awq_int4,    &scheme_ct_int4};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (strcmp(all[i]->name, name) == 0)
      return all[i];
  return NULL;
}
