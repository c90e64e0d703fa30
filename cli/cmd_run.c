/*
 * cmd_run.c: `qkeep run`, the main job. Loads a checkpoint with the
 * configured backend (PWAL included), prints the census, then checks every
 * linear layer and MoE expert against the reference backend on random
 * activations, with the time of each phase.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

const char usage_run[] =
    "usage: qkeep [-c CONFIG] run [CKPT] [--rows M] [--tolerance T] [--seed S] [--json]\n"
    "\n"
    "The main job. Loads CKPT (a .safetensors file or a Hugging Face directory; default: the\n"
    "config's [model] checkpoint) with the configured backend, runs its post-load pass, prints\n"
    "the census, then runs every linear layer and MoE expert (w13 and w2) on M rows (default 4)\n"
    "of random activations with both the backend and the reference backend, and prints the\n"
    "largest absolute and relative error per layer, and the time of each phase.\n"
    "  -r, --rows M        rows of random activations per check (default 4, at most 4096)\n"
    "  -T, --tolerance T   largest relative error allowed (default 0.05)\n"
    "  -S, --seed S        seed of the random activations (default 1)\n"
    "Exits 1 when a rule is violated or a layer's relative error exceeds T; --json then prints\n"
    "the results with \"ok\": false.\n"
    "--quantize S (with qkeep quantize's options) quantizes an unquantized CKPT on load into scheme S,\n"
    "as [model] quantize = S does.\n";

static void progress(void *user, size_t done, size_t total, const char *layer) {
  (void)user;
  fprintf(stderr, "\r  loading %zu/%zu %-60.60s\033[K%s", done, total, layer,
          done == total ? "\r\033[K" : "");
}

struct check {
  const qkeep_model *model;
  FILE *out; /* stdout, or (JSON) a buffer that becomes the document's "layers" once all went well */
  bool json;
  double tolerance, worst;
  int layers, over;
};

static int print_error(void *user, const struct qkeep_layer_error *e) {
  struct check *c = user;
  const char *backend = qkeep_layer_backend(qkeep_model_find_layer(c->model, e->layer));
  backend = backend ? backend : "host";
  bool over = !(e->max_rel <= c->tolerance);
  c->over += over;
  if (e->max_rel > c->worst || e->max_rel != e->max_rel)
    c->worst = e->max_rel;
  c->layers++;
  if (c->json) {
    fprintf(c->out, "%s{\"layer\":", c->layers > 1 ? "," : "");
    print_json_string(c->out, e->layer);
    fprintf(c->out, ",\"backend\":");
    print_json_string(c->out, backend);
    fprintf(
        c->out,
        ",\"scheme\":\"%s\",\"expert\":%d,\"matrix\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"max_abs\":",
        e->scheme, e->expert, e->matrix == QKEEP_MOE_W2 ? "w2" : "w13", (long long)e->m, (long long)e->n,
        (long long)e->k);
    print_json_number(c->out, e->max_abs);
    fprintf(c->out, ",\"max_rel\":");
    print_json_number(c->out, e->max_rel);
    fputc('}', c->out);
    return 0;
  }
  char expert[40] = ""; /* "[E].w13": an int and a fixed word */
  if (e->expert >= 0)
    snprintf(expert, sizeof expert, "[%d].%s", e->expert, e->matrix == QKEEP_MOE_W2 ? "w2" : "w13");
  int width = 48 - (int)(strlen(e->layer) + strlen(expert)); /* the layer name whole, however long */
  printf("  %s%s%*s %-15s %-12s %5lldx%-5lld %10.3g %10.3g%s\n", e->layer, expert, width > 0 ? width : 0, "",
         e->scheme, backend, (long long)e->n, (long long)e->k, e->max_abs, e->max_rel,
         over ? "  TOO LARGE" : "");
  return 0;
}

/* Loads ckpt into a new model on a chain of plugins. */
static int load(const qkeep_config *cfg, qkeep_plugin *const *plugins, size_t n, const char *ckpt,
                bool show_progress, qkeep_model **out) {
  int rc = new_model(cfg, plugins, n, out);
  if (!rc && show_progress)
    qkeep_model_set_progress(*out, progress, NULL);
  if (!rc)
    rc = qkeep_model_load(*out, ckpt);
  return rc;
}

/* Everything one run holds, and when each phase ended. */
struct run {
  const struct options *o;
  qkeep_config *cfg;
  struct chain chain;
  qkeep_plugin *ref_plugin;
  qkeep_model *model, *ref;
  const char *ckpt;
  int64_t rows;
  uint64_t seed;
  struct qkeep_census census;
  struct qkeep_digest digest;
  struct check check;
  char *layers_json; /* the "layers" array of a JSON document, collected by the check */
  size_t layers_json_len;
  double t0, t_plugin, t_load, t_census, t_ref, t_check;
};

/* --rows, --tolerance, --seed; 2 (usage) when out of range. */
static int parse_run_options(struct run *r) {
  long long rows = 4, seed = 1;
  double tolerance = 0.05;
  if (option_int(r->o, "rows", 1, 4096, &rows) || option_float(r->o, "tolerance", 0, &tolerance) ||
      option_int(r->o, "seed", 0, INT64_MAX, &seed))
    return 2;
  r->rows = rows;
  r->seed = (uint64_t)seed;
  r->check = (struct check){.json = r->o->json, .tolerance = tolerance, .out = stdout};
  return 0;
}

/* The config, its chain, and the checkpoint loaded onto it; then the census and digest. */
static int load_and_audit(struct run *r) {
  int rc = load_config(r->o, &r->cfg);
  if (!rc)
    rc = open_chain(r->cfg, &r->chain);
  r->ckpt = r->o->n_args ? r->o->args[0] : (r->cfg ? qkeep_config_checkpoint(r->cfg) : NULL);
  if (!rc && !r->ckpt) {
    report_failure(r->o, 2, "usage", "run: no checkpoint given and %s has no [model] checkpoint",
                   qkeep_config_path(r->cfg));
    return -100;
  }
  r->t_plugin = cli_now();
  if (!rc)
    rc = load(r->cfg, r->chain.plugins, r->chain.n, r->ckpt, !r->o->json && isatty(2), &r->model);
  r->t_load = cli_now();
  r->census = (struct qkeep_census){.size = sizeof r->census};
  if (!rc)
    rc = qkeep_census(r->model, &r->census);
  if (!rc)
    rc = qkeep_digest(r->model, &r->digest);
  r->t_census = cli_now();
  return rc;
}

/* The oracle (the reference backend, configured from [backend.reference]), then every GEMM
 * against it; the table goes to stdout, or JSON into a buffer printed once all went well. */
static int forward_check(struct run *r) {
  int rc = qkeep_plugin_open("reference", qkeep_config_plugin_dir(r->cfg), &r->ref_plugin);
  if (!rc) /* activations = int8 there makes a strict check of an int8 pipeline */
    rc = qkeep_plugin_configure(r->ref_plugin, r->cfg);
  if (!rc)
    rc = load(r->cfg, &r->ref_plugin, 1, r->ckpt, false, &r->ref);
  r->t_ref = cli_now();
  if (rc)
    return rc;
  r->check.model = r->model;
  if (r->o->json) {
    r->check.out = open_memstream(&r->layers_json, &r->layers_json_len);
    if (!r->check.out)
      return QKEEP_E_NOMEM;
  } else {
    report_census(stdout, r->ckpt, r->model, &r->census, &r->digest, false);
    printf("forward check against the reference backend (%lld rows of random activations)\n"
           "  %-48s %-15s %-12s %11s %10s %10s\n",
           (long long)r->rows, "layer", "scheme", "backend", "N x K", "max abs", "max rel");
  }
  rc = qkeep_compare(r->model, r->ref, r->rows, r->seed, print_error, &r->check);
  if (r->o->json)
    fclose(r->check.out);
  r->t_check = cli_now();
  return rc;
}

/* The summary and the time of each phase; 1 when a rule is violated or a layer is over tolerance. */
static int report(const struct run *r) {
  struct qkeep_load_stats st = {.size = sizeof st};
  qkeep_model_load_stats(r->model, &st);
  const struct check *c = &r->check;
  const struct qkeep_census *cs = &r->census;
  bool ok = !cs->missing && !cs->c1 && !cs->c2 && !c->over;
  char message[200];
  snprintf(message, sizeof message, "run: %s (missing %lld, C1 %lld, C2 %lld, layers over tolerance %d)",
           c->over ? "check failed" : "rule violations", (long long)cs->missing, (long long)cs->c1,
           (long long)cs->c2, c->over);
  if (r->o->json) {
    /* backends and owners at the top, as for reload; the census object carries them too */
    json_begin(stdout, ok, c->over ? "check_failed" : "rule_violations", message);
    printf(",\"checkpoint\":");
    print_json_string(stdout, r->ckpt);
    printf(",");
    owners_json(stdout, r->model);
    printf(",\"layers\":[%s],\"census\":", r->layers_json ? r->layers_json : "");
    report_census(stdout, r->ckpt, r->model, &r->census, &r->digest, true);
    printf(",\"max_rel\":");
    print_json_number(stdout, c->worst);
    printf(",\"tolerance\":");
    print_json_number(stdout, c->tolerance);
    printf(",\"seconds\":{\"plugin\":%.6f,\"open\":%.6f,\"read\":%.6f,"
           "\"pwal\":%.6f,\"census\":%.6f,\"reference_load\":%.6f,\"check\":%.6f}}\n",
           r->t_plugin - r->t0, st.open_seconds, st.read_seconds, st.pwal_seconds, r->t_census - r->t_load,
           r->t_ref - r->t_census, r->t_check - r->t_ref);
  } else {
    char size[32];
    printf("%d GEMMs checked, largest relative error %.3g (tolerance %g)\n", c->layers, c->worst,
           c->tolerance);
    printf("time: plugin %.1f ms, open %.1f ms, read %.1f ms (%s), normalise+PWAL %.1f ms, census+digest "
           "%.1f ms, reference load %.1f ms, check %.1f ms\n",
           1e3 * (r->t_plugin - r->t0), 1e3 * st.open_seconds, 1e3 * st.read_seconds,
           human_bytes((double)st.checkpoint_bytes, size, sizeof size), 1e3 * st.pwal_seconds,
           1e3 * (r->t_census - r->t_load), 1e3 * (r->t_ref - r->t_census), 1e3 * (r->t_check - r->t_ref));
  }
  if (ok)
    return 0;
  fflush(stdout);
  fprintf(stderr, "qkeep: %s\n", message);
  return 1;
}

int cmd_run(const struct options *o) {
  struct run r = {.o = o, .t0 = cli_now()};
  int rc = parse_run_options(&r);
  if (rc)
    return rc;
  rc = load_and_audit(&r);
  if (!rc)
    rc = forward_check(&r);
  int status = rc == -100 ? 2 : rc ? fail(o, rc) : report(&r);
  free(r.layers_json);
  qkeep_model_free(r.model);
  qkeep_model_free(r.ref);
  close_chain(&r.chain);
  qkeep_plugin_close(r.ref_plugin);
  qkeep_config_free(r.cfg);
  return status;
}
