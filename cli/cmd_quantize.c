/* cmd_quantize.c: `qkeep quantize IN OUT --scheme S`. */
#include <errno.h>
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

const char usage_quantize[] =
    "usage: qkeep quantize IN OUT --scheme S [--group G] [--asym] [--static-input] [--asym-input]\n"
    "                      [--kv-scales] [--activation-amax A] [--shard-bytes N] [--threads N]\n"
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
    "  --shard-bytes N      shard the output at N bytes (model-0000i-of-0000n + index)\n"
    "  --threads N          threads (default: every online core); the bytes do not depend on it\n"
    "Streams: memory stays under twice the largest tensor (or fused q/k/v, gate/up group) plus\n"
    "small buffers, whatever the model's size. A progress line on a terminal (stderr); --json\n"
    "prints a summary (tensors, bytes, seconds, rate, threads, peak buffer bytes).\n";

/* The progress line, redrawn in place on a terminal. */
static void show_progress(void *user, const struct qkeep_quantize_progress *p) {
  (void)user;
  char done[32], total[32];
  double rate = p->seconds > 0 ? (double)p->bytes_done / p->seconds : 0;
  double eta = rate > 0 ? (double)(p->bytes_total - p->bytes_done) / rate : 0;
  fprintf(stderr, "\r%lld/%lld tensors, %s of %s, %.0f MB/s, ETA %.0f s   ", (long long)p->tensors_done,
          (long long)p->tensors_total, human_bytes((double)p->bytes_done, done, sizeof done),
          human_bytes((double)p->bytes_total, total, sizeof total), rate / 1e6, eta);
  if (p->tensors_done == p->tensors_total)
    fputc('\n', stderr);
}

/* A whole non-negative number that fits an int64, or -1. */
static long long parse_count(const char *s) {
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  return errno || end == s || *end || v < 0 ? -1 : v;
}

int cmd_quantize(const struct options *o) {
  const char *scheme = option_value(o, "scheme");
  if (o->n_args != 2 || !scheme) {
    fputs(usage_quantize, stderr);
    return 2;
  }
  long long group = 0, shard = 0;
  double amax = 0;
  /* the library refuses these too; here the message names the option as the user typed it */
  if (option_int(o, "group", 1, INT32_MAX, &group) || option_float(o, "activation-amax", 0, &amax) ||
      option_int(o, "shard-bytes", 1, INT64_MAX, &shard))
    return 2;
  if (amax > FLT_MAX || (amax > 0 && amax < FLT_MIN)) {
    fprintf(stderr, "qkeep: quantize: --activation-amax %s: out of the float range\n",
            option_value(o, "activation-amax"));
    return 2;
  }
  const char *threads = option_value(o, "threads");
  long long n_threads = threads ? parse_count(threads) : 0;
  if (n_threads < 0 || n_threads > 4096 || (threads && n_threads == 0)) {
    fprintf(stderr, "qkeep: --threads %s: expected a number of threads from 1 to 4096\n", threads);
    return 2;
  }
  struct qkeep_quantize_progress summary = {.size = sizeof summary};
  struct qkeep_quantize_options q = {
      .size = sizeof q,
      .scheme = scheme,
      .group_size = group,
      .asym_weights = option_flag(o, "asym"),
      .static_input = option_flag(o, "static-input"),
      .asym_input = option_flag(o, "asym-input"),
      .kv_cache_scales = option_flag(o, "kv-scales"),
      .activation_amax = (float)amax,
      .max_shard_bytes = shard,
      .threads = (int)n_threads,
      .progress = isatty(STDERR_FILENO) && !o->json ? show_progress : NULL,
      .summary = &summary,
  };
  int rc = qkeep_quantize(o->args[0], o->args[1], &q);
  if (rc)
    return fail(rc);
  double rate = summary.seconds > 0 ? (double)summary.bytes_total / summary.seconds : 0;
  if (!o->json) {
    printf("wrote %s (%s)\n", o->args[1], scheme);
    return 0;
  }
  printf("{\"output\":");
  print_json_string(stdout, o->args[1]);
  printf(",\"scheme\":");
  print_json_string(stdout, scheme);
  printf(",\"tensors\":%lld,\"input_bytes\":%lld,\"output_bytes\":%lld,\"seconds\":%.3f,"
         "\"input_bytes_per_s\":%.0f,\"threads\":%d,\"peak_buffer_bytes\":%lld,\"buffer_bound\":%lld}\n",
         (long long)summary.tensors_total, (long long)summary.bytes_total, (long long)summary.bytes_written,
         summary.seconds, rate, summary.threads, (long long)summary.peak_buffer_bytes,
         (long long)summary.buffer_bound);
  return 0;
}
