/* cmd_quantize.c: `qkeep quantize IN OUT --scheme S`. */
#include <stdlib.h>
#include <string.h>

#include "cli.h"

const char usage_quantize[] =
    "usage: qkeep quantize IN OUT --scheme S [--group G] [--asym] [--static-input] [--asym-input]\n"
    "                      [--kv-scales] [--activation-amax A] [--shard-bytes N]\n"
    "\n"
    "Writes OUT (a new directory) as a checkpoint in scheme S, with that scheme's real tensor\n"
    "names and config files, from the unquantized checkpoint IN (bf16/f16/f32; a .safetensors\n"
    "file or a Hugging Face directory). Schemes: modelopt-nvfp4, ct-nvfp4, mxfp4, w8a8-int8,\n"
    "gptq-int4, awq-int4, ct-int4 (compressed-tensors pack-quantized W4A16). Linear weights are\n"
    "quantized; embeddings, norms, MoE routers and\n"
    "lm_head are copied. Fused shards (q/k/v, gate/up) share one NVFP4 global scale.\n"
    "  --group G            int4 group size (default 128; at most every linear's K)\n"
    "  --asym               int4 (gptq-int4, awq-int4, ct-int4) with zero points\n"
    "  --static-input       w8a8: static per-tensor input scales (default: dynamic per token)\n"
    "  --asym-input         w8a8: activations with a zero point\n"
    "  --kv-scales          write FP8 k_scale / v_scale for each attention block\n"
    "  --activation-amax A  |x| bound for static scales (no calibration data; default 1)\n"
    "  --shard-bytes N      shard the output at N bytes (model-0000i-of-0000n + index)\n";

int cmd_quantize(const struct options *o) {
  const char *scheme = option_value(o, "scheme"), *group = option_value(o, "group");
  const char *amax = option_value(o, "activation-amax"), *shard = option_value(o, "shard-bytes");
  if (o->n_args != 2 || !scheme) {
    fputs(usage_quantize, stderr);
    return 2;
  }
  struct qkeep_quantize_options q = {
      .size = sizeof q,
      .scheme = scheme,
      .group_size = group ? strtoll(group, NULL, 10) : 0,
      .asym_weights = option_flag(o, "asym"),
      .static_input = option_flag(o, "static-input"),
      .asym_input = option_flag(o, "asym-input"),
      .kv_cache_scales = option_flag(o, "kv-scales"),
      .activation_amax = amax ? strtof(amax, NULL) : 0,
      .max_shard_bytes = shard ? strtoll(shard, NULL, 10) : 0,
  };
  int rc = qkeep_quantize(o->args[0], o->args[1], &q);
  if (rc)
    return fail(rc);
  if (!o->json)
    printf("wrote %s (%s)\n", o->args[1], scheme);
  return 0;
}
