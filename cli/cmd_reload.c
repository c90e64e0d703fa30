/*
 * cmd_reload.c: `qkeep reload W0 W1`. Cold start on W0, reload W1 in place,
 * and compare with a separate cold start on W1: digests, every kernel data
 * pointer, the census; with the times of each and of a raw read of W1.
 */
#include <stdlib.h>
#include <string.h>

#include "cli.h"

const char usage_reload[] =
    "usage: qkeep [-c CONFIG] reload [W0 W1] [--json]\n"
    "\n"
    "Loads W0 with the configured backend, reloads W1 into the same model in place, then\n"
    "loads W1 into a second model, and checks that the reload equals the cold start byte\n"
    "for byte (digest), that no param or buffer data pointer moved, and that the census is\n"
    "unchanged. Prints the times of the cold starts, the reload and a raw read of W1.\n"
    "Default W0 and W1: the config's [model] checkpoint and reload_checkpoint.\n"
    "Exits 1 when any check fails.\n"
    "--quantize S (with qkeep quantize's options) takes unquantized W0 and W1 and quantizes both on\n"
    "load into scheme S: the reload quantizes W1 in place into the kept kernel params, and must equal\n"
    "a cold start on W1 quantized the same way.\n";

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

/* Everything one reload check holds. */
struct reload_run {
  const struct options *o;
  qkeep_config *cfg;
  struct chain chain;
  qkeep_model *model, *cold;
  const char *w0, *w1;
  struct pointers before, after;
  struct qkeep_census c0, c1, cc; /* W0 cold, after the reload, W1 cold */
  struct qkeep_digest d_reload, d_cold;
  double t_cold0, t_reload, t_cold1, t_raw;
  int64_t raw_bytes;
};

/* Cold start on W0 with its census and pointers, then the reload of W1 with the same after it. */
static int reload_in_place(struct reload_run *r) {
  double t0 = cli_now();
  int rc = new_model(r->cfg, r->chain.plugins, r->chain.n, &r->model);
  if (!rc)
    rc = qkeep_model_load(r->model, r->w0);
  r->t_cold0 = cli_now() - t0;
  if (!rc)
    rc = qkeep_census(r->model, &r->c0);
  if (!rc)
    rc = snapshot(r->model, &r->before);
  double t1 = cli_now();
  if (!rc)
    rc = qkeep_model_reload(r->model, r->w1, 0);
  r->t_reload = cli_now() - t1;
  if (!rc)
    rc = snapshot(r->model, &r->after);
  if (!rc)
    rc = qkeep_census(r->model, &r->c1);
  if (!rc)
    rc = qkeep_digest(r->model, &r->d_reload);
  return rc;
}

/* The yardsticks: a separate cold start on W1 (census, digest) and a raw read of W1. */
static int cold_start_w1(struct reload_run *r) {
  double t2 = cli_now();
  int rc = new_model(r->cfg, r->chain.plugins, r->chain.n, &r->cold);
  if (!rc)
    rc = qkeep_model_load(r->cold, r->w1);
  r->t_cold1 = cli_now() - t2;
  if (!rc)
    rc = qkeep_census(r->cold, &r->cc);
  if (!rc)
    rc = qkeep_digest(r->cold, &r->d_cold);
  if (!rc)
    rc = qkeep_checkpoint_read_all(r->w1, &r->raw_bytes, &r->t_raw);
  return rc;
}

/* Prints the comparison; 1 when the digests differ, a pointer moved or the census changed. */
static int report(const struct reload_run *r) {
  size_t moved = r->before.n != r->after.n ? r->before.n : 0;
  for (size_t i = 0; i < r->before.n && r->before.n == r->after.n; i++)
    moved += r->before.data[i] != r->after.data[i];
  bool identical = r->d_reload.hi == r->d_cold.hi && r->d_reload.lo == r->d_cold.lo;
  const struct qkeep_census *c1 = &r->c1;
  bool census_ok = same_census(&r->c0, c1) && same_census(c1, &r->cc) && !c1->missing && !c1->c1 && !c1->c2;
  char h1[33], h2[33], size[32];
  qkeep_digest_hex(&r->d_reload, h1);
  qkeep_digest_hex(&r->d_cold, h2);
  bool ok = identical && !moved && census_ok;
  char message[160];
  snprintf(message, sizeof message, "reload: %s%s%s", identical ? "" : "digests differ; ",
           moved ? "pointers moved; " : "", census_ok ? "" : "census changed");
  if (r->o->json) {
    json_begin(stdout, ok, "reload_differs", message);
    printf(",\"w0\":");
    print_json_string(stdout, r->w0);
    printf(",\"w1\":");
    print_json_string(stdout, r->w1);
    printf(",");
    owners_json(stdout, r->model);
    printf(
        ",\"cold_w0_s\":%.6f,\"reload_s\":%.6f,\"cold_w1_s\":%.6f,\"raw_read_w1_s\":%.6f,\"w1_bytes\":%lld,"
        "\"digest_reload\":\"%s\",\"digest_cold\":\"%s\",\"identical\":%s,\"pointers\":%zu,\"moved\":%zu,"
        "\"census_unchanged\":%s}\n",
        r->t_cold0, r->t_reload, r->t_cold1, r->t_raw, (long long)r->raw_bytes, h1, h2,
        identical ? "true" : "false", r->before.n, moved, census_ok ? "true" : "false");
  } else {
    printf("reload %s -> %s\n", r->w0, r->w1);
    printf("  %-24s %10.2f ms\n", "cold start W0", 1e3 * r->t_cold0);
    printf("  %-24s %10.2f ms  (%.2fx faster than a cold start)\n", "reload W0 -> W1", 1e3 * r->t_reload,
           r->t_reload > 0 ? r->t_cold1 / r->t_reload : 0.0);
    printf("  %-24s %10.2f ms  (a separate model)\n", "cold start W1", 1e3 * r->t_cold1);
    printf("  %-24s %10.2f ms  (%s)\n", "raw read of W1", 1e3 * r->t_raw,
           human_bytes((double)r->raw_bytes, size, sizeof size));
    printf("  %-24s %s\n  %-24s %s  %s\n", "digest after reload", h1, "digest of cold W1", h2,
           identical ? "identical" : "DIFFERENT");
    printf("  %-24s %zu of %zu unchanged\n", "data pointers", r->before.n - moved, r->before.n);
    printf("  %-24s missing %lld, C1 %lld, C2 %lld, released %lld (%s)\n", "census", (long long)c1->missing,
           (long long)c1->c1, (long long)c1->c2, (long long)c1->released,
           census_ok ? "unchanged" : "CHANGED");
    report_owners(stdout, r->model);
  }
  if (ok)
    return 0;
  fflush(stdout);
  fprintf(stderr, "qkeep: %s\n", message);
  return 1;
}

int cmd_reload(const struct options *o) {
  struct reload_run r = {.o = o};
  r.c0 = r.c1 = r.cc = (struct qkeep_census){.size = sizeof r.c0};
  int rc = load_config(o, &r.cfg);
  r.w0 = o->n_args >= 1 ? o->args[0] : qkeep_config_checkpoint(r.cfg);
  r.w1 = o->n_args >= 2 ? o->args[1] : qkeep_config_reload_checkpoint(r.cfg);
  if (!rc && (!r.w0 || !r.w1 || o->n_args == 1)) {
    report_failure(o, 2, "usage",
                   "reload: give W0 and W1, or set [model] checkpoint and reload_checkpoint in %s",
                   qkeep_config_path(r.cfg));
    qkeep_config_free(r.cfg);
    return 2;
  }
  if (!rc)
    rc = open_chain(r.cfg, &r.chain);
  if (!rc)
    rc = reload_in_place(&r);
  if (!rc)
    rc = cold_start_w1(&r);
  int status = rc ? fail(o, rc) : report(&r);
  free(r.before.data);
  free(r.after.data);
  qkeep_model_free(r.model);
  qkeep_model_free(r.cold);
  close_chain(&r.chain);
  qkeep_config_free(r.cfg);
  return status;
}
