/* cmd_quantize.c: `qkeep quantize IN OUT --scheme S`. */
#include <errno.h>
#include <float.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

const char usage_quantize[] =
    "usage: qkeep quantize IN OUT --scheme S [--group G] [--asym] [--static-input] [--asym-input]\n"
    "                      [--kv-scales] [--activation-amax A] [--shard-bytes N] [--threads N] [--force]\n"
    "\n"
    "Writes OUT (a new directory) as a checkpoint in scheme S, with that scheme's real tensor\n"
    "names and config files, from the unquantized checkpoint IN (bf16/f16/f32; a .safetensors\n"
    "file or a Hugging Face directory). Schemes: modelopt-nvfp4, ct-nvfp4, mxfp4, w8a8-int8,\n"
    "gptq-int4, awq-int4, ct-int4 (compressed-tensors pack-quantized W4A16). Linear weights are\n"
    "quantized; embeddings, norms, MoE routers and\n"
    "lm_head are copied. Fused shards (q/k/v, gate/up) share one NVFP4 global scale.\n"
    "  -s, --scheme S             the scheme written\n"
    "  -g, --group G              int4 group size (default 128; at most every linear's K)\n"
    "      --asym                 int4 (gptq-int4, awq-int4, ct-int4) with zero points\n"
    "      --static-input         w8a8-int8: static per-tensor input scales (default: dynamic per token)\n"
    "      --asym-input           w8a8-int8: activations with a zero point\n"
    "      --kv-scales            write FP8 k_scale / v_scale for each attention block\n"
    "  -a, --activation-amax A    |x| bound for static scales (no calibration data; default 1): NVFP4\n"
    "                             input scales, w8a8-int8 with --static-input, --kv-scales\n"
    "  -b, --shard-bytes N        shard the output at N bytes (model-0000i-of-0000n + index)\n"
    "  -t, --threads N            threads (default: every online core); the bytes do not depend on it\n"
    "  -f, --force                replace an existing OUT, once the new output is whole (only a\n"
    "                             directory holding nothing but a checkpoint qkeep quantize writes)\n"
    "A flag that does not apply to the scheme is refused. OUT's missing parent directories are\n"
    "created. OUT appears only when whole: the files are written in a hidden directory beside it\n"
    "and renamed. SIGINT, SIGTERM or SIGHUP stop the run and remove everything it wrote (qkeep\n"
    "then exits 128+N); an error leaves nothing behind either.\n"
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

/*
 * Signals. SIGINT, SIGTERM and SIGHUP during a run only set `caught`; the library polls it through
 * the cancel callback, stops, removes what it wrote (the output directory stays absent), and this
 * command then dies of the same signal (exit 128+N), as if it had not caught it. A signal ignored
 * when qkeep started (nohup, a background job of a script) stays ignored. The library itself
 * installs no handler: what to do on a signal is the program's choice.
 */
static atomic_int caught; /* lock-free, so a handler may set it (C11 7.14.1.1) */
static const int stop_signals[] = {SIGINT, SIGTERM, SIGHUP};

static void on_signal(int sig) { atomic_store(&caught, sig); }

static int stop_requested(void *user) {
  (void)user;
  return atomic_load(&caught);
}

static void catch_signals(void) {
  for (size_t i = 0; i < sizeof stop_signals / sizeof stop_signals[0]; i++) {
    struct sigaction old, sa = {.sa_handler = on_signal, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    if (sigaction(stop_signals[i], NULL, &old) == 0 && old.sa_handler != SIG_IGN)
      sigaction(stop_signals[i], &sa, NULL);
  }
}

/* Dies of the signal caught, with its default action (the shell sees 128+N). */
static void die_of_caught_signal(void) {
  int sig = atomic_load(&caught);
  fflush(stdout);
  signal(sig, SIG_DFL);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  pthread_sigmask(SIG_UNBLOCK, &set, NULL);
  raise(sig);
}

/* The option that names the scheme: --scheme for qkeep quantize, --quantize for the commands that load. */
static const char *scheme_flag(const struct options *o) {
  return strcmp(o->command, "quantize") == 0 ? "--scheme" : "--quantize";
}

/* A flag given for a scheme that does not take it is refused, not ignored (the library's table, which a
 * config's [model] quantize_* keys are checked by too). */
static int check_flags(const struct options *o, const struct qkeep_quantize_options *q) {
  static const char *const flags[] = {"group",           "asym",   "static-input", "asym-input", "kv-scales",
                                      "activation-amax", "threads"};
  for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
    const char *why = NULL;
    if ((option_flag(o, flags[i]) || option_value(o, flags[i])) &&
        qkeep_quantize_option_applies(q->scheme, flags[i], q, &why) == QKEEP_E_INVAL)
      return report_failure(o, 2, "usage", "%s: --%s does not apply to %s %s (%s)", o->command, flags[i],
                            scheme_flag(o), q->scheme, why);
  }
  return 0;
}

/* The options into q; 0, or 2 after a usage error. */
static int quantize_options(const struct options *o, struct qkeep_quantize_options *q) {
  long long group = 0, shard = 0;
  double amax = 0;
  /* the library refuses these too; here the message names the option as the user typed it */
  if (option_int(o, "group", 1, INT32_MAX, &group) || option_float(o, "activation-amax", 0, &amax) ||
      option_int(o, "shard-bytes", 1, INT64_MAX, &shard))
    return 2;
  if (amax > FLT_MAX || (amax > 0 && amax < FLT_MIN))
    return report_failure(o, 2, "usage", "%s: --activation-amax %s: out of the float range", o->command,
                          option_value(o, "activation-amax"));
  const char *threads = option_value(o, "threads");
  long long n_threads = threads ? parse_count(threads) : 0;
  if (n_threads < 0 || n_threads > 4096 || (threads && n_threads == 0))
    return report_failure(o, 2, "usage", "%s: --threads %s: expected a number of threads from 1 to 4096",
                          o->command, threads);
  q->group_size = group;
  q->activation_amax = (float)amax;
  q->max_shard_bytes = shard;
  q->threads = (int)n_threads;
  return check_flags(o, q);
}

int online_options(const struct options *o, struct qkeep_quantize_options *q) {
  static const char *const flags[] = {"group",           "asym",   "static-input", "asym-input", "kv-scales",
                                      "activation-amax", "threads"};
  const char *scheme = option_value(o, "quantize");
  if (!scheme) {
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
      if (option_flag(o, flags[i]) || option_value(o, flags[i]))
        return report_failure(o, 2, "usage",
                              "%s: --%s needs --quantize S (it is an option of quantizing on load)",
                              o->command, flags[i]);
    return 1;
  }
  *q = (struct qkeep_quantize_options){
      .size = sizeof *q,
      .scheme = scheme,
      .asym_weights = option_flag(o, "asym"),
      .static_input = option_flag(o, "static-input"),
      .asym_input = option_flag(o, "asym-input"),
      .kv_cache_scales = option_flag(o, "kv-scales"),
  };
  return quantize_options(o, q);
}

int cmd_quantize(const struct options *o) {
  const char *scheme = option_value(o, "scheme");
  if (o->n_args != 2 || !scheme) {
    report_failure(o, 2, "usage", "quantize: %s",
                   o->n_args != 2 ? "give IN and OUT" : "--scheme S is required");
    fputs(usage_quantize, stderr);
    return 2;
  }
  struct qkeep_quantize_progress summary = {.size = sizeof summary};
  struct qkeep_quantize_options q = {
      .size = sizeof q,
      .scheme = scheme,
      .asym_weights = option_flag(o, "asym"),
      .static_input = option_flag(o, "static-input"),
      .asym_input = option_flag(o, "asym-input"),
      .kv_cache_scales = option_flag(o, "kv-scales"),
      .progress = isatty(STDERR_FILENO) && !o->json ? show_progress : NULL,
      .summary = &summary,
      .cancel = stop_requested,
      .replace_existing = option_flag(o, "force"),
  };
  int rc = quantize_options(o, &q);
  if (rc)
    return rc;
  catch_signals();
  rc = qkeep_quantize(o->args[0], o->args[1], &q);
  if (rc && q.progress)
    fputc('\n', stderr); /* after the progress line */
  if (rc == QKEEP_E_INTERRUPTED && atomic_load(&caught)) {
    report_failure(o, 128 + atomic_load(&caught), "interrupted",
                   "quantize: interrupted (%s): everything it wrote is removed; %s is as it was",
                   strsignal(atomic_load(&caught)), o->args[1]);
    die_of_caught_signal();
  }
  if (rc == QKEEP_E_EXISTS && !q.replace_existing) {
    fail(o, rc);
    fprintf(stderr, "qkeep: quantize: --force replaces it once the new output is whole\n");
    return 1;
  }
  if (rc)
    return fail(o, rc);
  double rate = summary.seconds > 0 ? (double)summary.bytes_total / summary.seconds : 0;
  if (!o->json) {
    printf("wrote %s (%s)\n", o->args[1], scheme);
    return 0;
  }
  json_begin(stdout, true, NULL, NULL);
  printf(",\"output\":");
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
