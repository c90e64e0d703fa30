/*
 * cmd_reload.c: `qkeep reload W0 W1`. Cold start on W0, reload W1 in place,
 * and compare with a separate cold start on W1: digests, every kernel data
 * pointer, the census; with the times of each and of a raw read of W1.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"

const char usage_reload[] =
    "usage: qkeep [-c CONFIG] reload [W0 W1] [--json]\n"
    "\n"
    "Loads W0 with the configured backend, reloads W1 into the same model in place, then\n"
    "loads W1 into a second model, and checks that the reload equals the cold start byte\n"
    "for byte (digest), that no param or buffer data pointer moved, and that the census is\n"
    "unchanged. Prints the times of the cold starts, the reload and a raw read of W1.\n"
    "Default W0 and W1: the config's [model] checkpoint and reload_checkpoint.\n"
    "Exits 1 when any check fails.\n";

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct pointers {
  const void **data;
  size_t n, cap;
};

static int remember(void *user, const char *name, bool is_buffer, const struct qkeep_view *v) {
  (void)name, (void)is_buffer;
  struct pointers *p = user;
  if (p->n == p->cap) {
    size_t cap = p->cap ? 2 * p->cap : 256;
    const void **grown = realloc(p->data, cap * sizeof *grown);
    if (!grown)
      return QKEEP_E_NOMEM;
    p->data = grown;
    p->cap = cap;
  }
  p->data[p->n++] = v->data;
  return 0;
}

/* Every registered name's data pointer, in model order. */
static int snapshot(qkeep_model *m, struct pointers *p) {
  p->n = 0;
  for (size_t i = 0; i < qkeep_model_layer_count(m); i++) {
    int rc = qkeep_foreach_name(qkeep_model_layer(m, i), remember, p);
    if (rc)
      return rc;
  }
  return 0;
}

static bool same_census(const struct qkeep_census *a, const struct qkeep_census *b) {
  return a->loader_params == b->loader_params && a->registered_same == b->registered_same &&
         a->missing == b->missing && a->c1 == b->c1 && a->c2 == b->c2 && a->aliases == b->aliases &&
         a->retired == b->retired && a->released == b->released && a->total_bytes == b->total_bytes;
}

int cmd_reload(const struct options *o) {
  qkeep_config *cfg = NULL;
  struct chain chain = {0};
  qkeep_model *model = NULL, *cold = NULL;
  struct pointers before = {0}, after = {0};
  int rc = load_config(o, &cfg);
  const char *w0 = o->n_args >= 1 ? o->args[0] : qkeep_config_checkpoint(cfg);
  const char *w1 = o->n_args >= 2 ? o->args[1] : qkeep_config_reload_checkpoint(cfg);
  if (!rc && (!w0 || !w1 || o->n_args == 1)) {
    fprintf(stderr, "qkeep: reload: give W0 and W1, or set [model] checkpoint and reload_checkpoint in %s\n",
            qkeep_config_path(cfg));
    qkeep_config_free(cfg);
    return 2;
  }
  if (!rc)
    rc = open_chain(cfg, &chain);
  struct qkeep_census c0 = {.size = sizeof c0}, c1 = {.size = sizeof c1}, cc = {.size = sizeof cc};
  struct qkeep_digest d_reload, d_cold;
  double t0 = now(), t_cold0 = 0, t_reload = 0, t_cold1 = 0, t_raw = 0;
  int64_t raw_bytes = 0;
  if (!rc)
    rc = new_model(cfg, chain.plugins, chain.n, &model);
  if (!rc)
    rc = qkeep_model_load(model, w0);
  t_cold0 = now() - t0;
  if (!rc)
    rc = qkeep_census(model, &c0);
  if (!rc)
    rc = snapshot(model, &before);
  double t1 = now();
  if (!rc)
    rc = qkeep_model_reload(model, w1, 0);
  t_reload = now() - t1;
  if (!rc)
    rc = snapshot(model, &after);
  if (!rc)
    rc = qkeep_census(model, &c1);
  if (!rc)
    rc = qkeep_digest(model, &d_reload);
  double t2 = now();
  if (!rc)
    rc = new_model(cfg, chain.plugins, chain.n, &cold);
  if (!rc)
    rc = qkeep_model_load(cold, w1);
  t_cold1 = now() - t2;
  if (!rc)
    rc = qkeep_census(cold, &cc);
  if (!rc)
    rc = qkeep_digest(cold, &d_cold);
  if (!rc)
    rc = qkeep_checkpoint_read_all(w1, &raw_bytes, &t_raw);
  int status = rc ? fail(rc) : 0;
  if (!rc) {
    size_t moved = before.n != after.n ? before.n : 0;
    for (size_t i = 0; i < before.n && before.n == after.n; i++)
      moved += before.data[i] != after.data[i];
    bool identical = d_reload.hi == d_cold.hi && d_reload.lo == d_cold.lo;
    bool census_ok = same_census(&c0, &c1) && same_census(&c1, &cc) && !c1.missing && !c1.c1 && !c1.c2;
    char h1[33], h2[33], size[32];
    qkeep_digest_hex(&d_reload, h1);
    qkeep_digest_hex(&d_cold, h2);
    if (o->json) {
      printf("{\"w0\":");
      print_json_string(stdout, w0);
      printf(",\"w1\":");
      print_json_string(stdout, w1);
      printf(",");
      owners_json(stdout, model);
      printf(",\"cold_w0_s\":%.6f,\"reload_s\":%.6f,\"cold_w1_s\":%.6f,\"raw_read_w1_s\":%"
             ".6f,"
             "\"w1_bytes\":%lld,\"digest_reload\":\"%s\",\"digest_cold\":\"%s\",\"identical\":%s,"
             "\"pointers\":%zu,"
             "\"moved\":%zu,\"census_unchanged\":%s}\n",
             t_cold0, t_reload, t_cold1, t_raw, (long long)raw_bytes, h1, h2, identical ? "true" : "false",
             before.n, moved, census_ok ? "true" : "false");
    } else {
      printf("reload %s -> %s\n", w0, w1);
      printf("  %-24s %10.2f ms\n", "cold start W0", 1e3 * t_cold0);
      printf("  %-24s %10.2f ms  (%.2fx faster than a cold start)\n", "reload W0 -> W1", 1e3 * t_reload,
             t_reload > 0 ? t_cold1 / t_reload : 0.0);
      printf("  %-24s %10.2f ms  (a separate model)\n", "cold start W1", 1e3 * t_cold1);
      printf("  %-24s %10.2f ms  (%s)\n", "raw read of W1", 1e3 * t_raw,
             human_bytes((double)raw_bytes, size, sizeof size));
      printf("  %-24s %s\n  %-24s %s  %s\n", "digest after reload", h1, "digest of cold W1", h2,
             identical ? "identical" : "DIFFERENT");
      printf("  %-24s %zu of %zu unchanged\n", "data pointers", before.n - moved, before.n);
      printf("  %-24s missing %lld, C1 %lld, C2 %lld, released %lld (%s)\n", "census", (long long)c1.missing,
             (long long)c1.c1, (long long)c1.c2, (long long)c1.released, census_ok ? "unchanged" : "CHANGED");
      report_owners(stdout, model);
    }
    if (!identical || moved || !census_ok) {
      fprintf(stderr, "qkeep: reload: %s%s%s\n", identical ? "" : "digests differ; ",
              moved ? "pointers moved; " : "", census_ok ? "" : "census changed");
      status = 1;
    }
  }
  free(before.data);
  free(after.data);
  qkeep_model_free(model);
  qkeep_model_free(cold);
  close_chain(&chain);
  qkeep_config_free(cfg);
  return status;
}
