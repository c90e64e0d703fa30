/*
 * cmd_run.c: `qkeep run`, the main job. Loads a checkpoint with the
 * configured backend (PWAL included), prints the census, then checks every
 * linear layer and MoE expert against the reference backend on random
 * activations, with the time of each phase.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>
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
    "Exits 1 when a rule is violated or a layer's relative error exceeds T (default 0.05).\n";

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void progress(void *user, size_t done, size_t total, const char *layer) {
  (void)user;
  fprintf(stderr, "\r  loading %zu/%zu %-60.60s\033[K%s", done, total, layer,
          done == total ? "\r\033[K" : "");
}

struct check {
  const qkeep_model *model;
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
    printf("%s{\"layer\":", c->layers > 1 ? "," : "");
    print_json_string(stdout, e->layer);
    printf(",\"backend\":");
    print_json_string(stdout, backend);
    printf(",\"scheme\":\"%s\",\"expert\":%d,\"matrix\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"max_abs\":%"
           ".6g,"
           "\"max_rel\":%.6g}",
           e->scheme, e->expert, e->matrix == QKEEP_MOE_W2 ? "w2" : "w13", (long long)e->m, (long long)e->n,
           (long long)e->k, e->max_abs, e->max_rel);
    return 0;
  }
  char label[160];
  if (e->expert >= 0)
    snprintf(label, sizeof label, "%s[%d].%s", e->layer, e->expert, e->matrix == QKEEP_MOE_W2 ? "w2" : "w13");
  else
    snprintf(label, sizeof label, "%s", e->layer);
  printf("  %-48s %-15s %-12s %5lldx%-5lld %10.3g %10.3g%s\n", label, e->scheme, backend, (long long)e->n,
         (long long)e->k, e->max_abs, e->max_rel, over ? "  TOO LARGE" : "");
  return 0;
}

/* Loads ckpt into a new model of plugin; on failure prints and returns 1. */
static int load(const qkeep_config *cfg, qkeep_plugin *const *plugins, size_t n, const char *ckpt,
                bool show_progress, qkeep_model **out) {
  int rc = new_model(cfg, plugins, n, out);
  if (!rc && show_progress)
    qkeep_model_set_progress(*out, progress, NULL);
  if (!rc)
    rc = qkeep_model_load(*out, ckpt);
  return rc;
}

int cmd_run(const struct options *o) {
  qkeep_config *cfg = NULL;
  struct chain chain = {0};
  qkeep_plugin *ref_plugin = NULL;
  qkeep_model *model = NULL, *ref = NULL;
  const char *rows_s = option_value(o, "rows"), *tol_s = option_value(o, "tolerance"),
             *seed_s = option_value(o, "seed");
  int64_t rows = rows_s ? strtoll(rows_s, NULL, 10) : 4;
  struct check c = {.json = o->json, .tolerance = tol_s ? strtod(tol_s, NULL) : 0.05};
  if (rows < 1 || rows > 4096 || !(c.tolerance >= 0)) {
    fprintf(stderr, "qkeep: run: --rows must be 1..4096 and --tolerance >= 0\n");
    return 2;
  }
  double t0 = now();
  int rc = load_config(o, &cfg);
  if (!rc)
    rc = open_chain(cfg, &chain);
  const char *ckpt = o->n_args ? o->args[0] : (cfg ? qkeep_config_checkpoint(cfg) : NULL);
  if (!rc && !ckpt) {
    fprintf(stderr, "qkeep: run: no checkpoint given and %s has no [model] checkpoint\n",
            qkeep_config_path(cfg));
    rc = -100;
  }
  double t_plugin = now();
  if (!rc)
    rc = load(cfg, chain.plugins, chain.n, ckpt, !o->json && isatty(2), &model);
  double t_load = now();
  struct qkeep_census census = {.size = sizeof census};
  struct qkeep_digest digest;
  if (!rc)
    rc = qkeep_census(model, &census);
  if (!rc)
    rc = qkeep_digest(model, &digest);
  double t_census = now();
  if (!rc)
    rc = qkeep_plugin_open("reference", qkeep_config_plugin_dir(cfg), &ref_plugin);
  if (!rc) /* [backend.reference] applies to the oracle too (activations = int8 for a strict int8 check) */
    rc = qkeep_plugin_configure(ref_plugin, cfg);
  if (!rc)
    rc = load(cfg, &ref_plugin, 1, ckpt, false, &ref);
  double t_ref = now();
  if (!rc) {
    c.model = model;
    if (o->json) {
      printf("{\"layers\":[");
    } else {
      report_census(stdout, ckpt, model, &census, &digest, false);
      printf("forward check against the reference backend (%lld rows of random activations)\n"
             "  %-48s %-15s %-12s %11s %10s %10s\n",
             (long long)rows, "layer", "scheme", "backend", "N x K", "max abs", "max rel");
    }
    rc = qkeep_compare(model, ref, rows, seed_s ? strtoull(seed_s, NULL, 10) : 1, print_error, &c);
  }
  double t_check = now();
  int status = rc == -100 ? 2 : rc ? fail(rc) : 0;
  if (!rc) {
    struct qkeep_load_stats st = {.size = sizeof st};
    qkeep_model_load_stats(model, &st);
    if (o->json) {
      printf("],\"census\":");
      report_census(stdout, ckpt, model, &census, &digest, true);
      printf(",\"max_rel\":%.6g,\"tolerance\":%g,\"seconds\":{\"plugin\":%.6f,\"open\":%.6f,\"read\":%.6f,"
             "\"pwal\":%.6f,\"census\":%.6f,\"reference_load\":%.6f,\"check\":%.6f}}\n",
             c.worst, c.tolerance, t_plugin - t0, st.open_seconds, st.read_seconds, st.pwal_seconds,
             t_census - t_load, t_ref - t_census, t_check - t_ref);
    } else {
      char size[32];
      printf("%d GEMMs checked, largest relative error %.3g (tolerance %g)\n", c.layers, c.worst,
             c.tolerance);
      printf("time: plugin %.1f ms, open %.1f ms, read %.1f ms (%s), normalise+PWAL %.1f ms, census+digest "
             "%.1f ms, "
             "reference load %.1f ms, check %.1f ms\n",
             1e3 * (t_plugin - t0), 1e3 * st.open_seconds, 1e3 * st.read_seconds,
             human_bytes((double)st.checkpoint_bytes, size, sizeof size), 1e3 * st.pwal_seconds,
             1e3 * (t_census - t_load), 1e3 * (t_ref - t_census), 1e3 * (t_check - t_ref));
    }
    if (census.missing || census.c1 || census.c2 || c.over) {
      fprintf(stderr, "qkeep: run: %s (missing %lld, C1 %lld, C2 %lld, layers over tolerance %d)\n",
              c.over ? "check failed" : "rule violations", (long long)census.missing, (long long)census.c1,
              (long long)census.c2, c.over);
      status = 1;
    }
  }
  qkeep_model_free(model);
  qkeep_model_free(ref);
  close_chain(&chain);
  qkeep_plugin_close(ref_plugin);
  qkeep_config_free(cfg);
  return status;
}
