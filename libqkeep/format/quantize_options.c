/*
 * quantize_options.c: which of qkeep quantize's options each scheme takes. A program that takes the
 * options by name refuses one the scheme would not use rather than ignoring it: the qkeep command's
 * flags (--group, --asym, ...) and a config's [model] quantize_* keys are checked by this one table.
 */
#include <string.h>

#include "base/base.h"

/* The options a scheme may not take, with the schemes that take them and why. The rest (kv-scales,
 * threads) apply to every scheme; activation-amax is decided by the other options (below). */
static const struct {
  const char *option, *schemes, *why;
} rules[] = {
    {"group", "gptq-int4 awq-int4 ct-int4",
     "only to gptq-int4, awq-int4 and ct-int4: NVFP4 and MXFP4 blocks are fixed (16, 32); w8a8-int8 is per "
     "channel"},
    {"asym", "gptq-int4 awq-int4 ct-int4",
     "only to gptq-int4, awq-int4 and ct-int4: only int4 weights have zero points"},
    {"static-input", "w8a8-int8",
     "only to w8a8-int8: NVFP4 input scales are always static; MXFP4 and int4 have none"},
    {"asym-input", "w8a8-int8", "only to w8a8-int8: only int8 activations take a zero point"},
};

/* Whether scheme is one of the space-separated words of list. */
static bool in_list(const char *list, const char *scheme) {
  size_t len = strlen(scheme);
  for (const char *at = list; len && (at = strstr(at, scheme)) != NULL; at += len)
    if ((at == list || at[-1] == ' ') && (at[len] == ' ' || at[len] == '\0'))
      return true;
  return false;
}

int qkeep_quantize_option_applies(const char *scheme, const char *option,
                                  const struct qkeep_quantize_options *opts, const char **why) {
  if (why)
    *why = NULL;
  if (!scheme || !option)
    return set_error(QKEEP_E_INVAL, "qkeep_quantize_option_applies: NULL argument");
  const char *not_here = NULL;
  bool known = strcmp(option, "kv-scales") == 0 || strcmp(option, "threads") == 0;
  for (size_t i = 0; i < sizeof rules / sizeof rules[0] && !known; i++)
    if (strcmp(option, rules[i].option) == 0) {
      known = true;
      not_here = in_list(rules[i].schemes, scheme) ? NULL : rules[i].why;
    }
  if (strcmp(option, "activation-amax") == 0) { /* it sets static scales: applies where one is written */
    known = true;
    bool static_scales = strstr(scheme, "nvfp4") != NULL || (opts && opts->kv_cache_scales) ||
                         (strcmp(scheme, "w8a8-int8") == 0 && opts && opts->static_input);
    not_here = static_scales
                   ? NULL
                   : "it sets static scales, and none is written here: NVFP4 input scales, w8a8-int8's "
                     "static input scales, kv-cache scales";
  }
  if (!known)
    return set_error(QKEEP_E_NOTFOUND, "qkeep quantize has no option '%s'", option);
  if (!not_here)
    return 0;
  if (why)
    *why = not_here;
  return set_error(QKEEP_E_INVAL, "option '%s' does not apply to scheme %s (%s)", option, scheme, not_here);
}
