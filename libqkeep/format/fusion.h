/*
 * format/fusion.h: fusion rules: which checkpoint modules load as shards of one fused layer
 * (q/k/v -> qkv_proj, gate/up -> gate_up_proj), and the parser of a `fuse` map
 * (format/fusion.c), shared by the config and the model. Uses base.
 */
#ifndef QKEEP_FUSION_H
#define QKEEP_FUSION_H

#include "base/base.h"

/* A fusion rule: modules <parent>.<member[i]> load as shards of <parent>.<fused>. */
struct fusion_rule {
  char *fused;
  char *members[8];
  int n_members;
};

/*
 * Parses a fuse map ("qkv_proj=q_proj+k_proj+v_proj, gate_up_proj=gate_proj+up_proj", or "none"
 * for no fusion) into *out (n rules, owned by the caller: fusion_rules_free). On an error nothing
 * is returned and the detail names the bad rule: QKEEP_E_INVAL or QKEEP_E_NOMEM.
 */
int fusion_parse(const char *map, struct fusion_rule **out, size_t *n);
/* Frees n rules and the array. */
void fusion_rules_free(struct fusion_rule *rules, size_t n);

#endif
