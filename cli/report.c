/* report.c: how the qkeep command prints a census, as a table or JSON. */
#include "cli.h"

/* The length of the valid UTF-8 sequence at p (1 to 4), or 0 when the bytes there are not one
 * (a stray continuation, a truncated or overlong sequence, a surrogate, past U+10FFFF). */
static int utf8_sequence(const unsigned char *p) {
  int len = p[0] < 0x80                    ? 1
            : p[0] >= 0xc2 && p[0] <= 0xdf ? 2
            : p[0] >= 0xe0 && p[0] <= 0xef ? 3
            : p[0] >= 0xf0 && p[0] <= 0xf4 ? 4
                                           : 0;
  for (int i = 1; i < len; i++)
    if ((p[i] & 0xc0) != 0x80)
      return 0;
  if ((p[0] == 0xe0 && p[1] < 0xa0) || (p[0] == 0xed && p[1] >= 0xa0) || (p[0] == 0xf0 && p[1] < 0x90) ||
      (p[0] == 0xf4 && p[1] >= 0x90))
    return 0;
  return len;
}

void print_json_string(FILE *out, const char *s) {
  fputc('"', out);
  for (const unsigned char *p = (const unsigned char *)s; *p;) {
    int len = utf8_sequence(p);
    if (!len) {
      fputs("\\ufffd", out);
      p++;
    } else if (*p == '"' || *p == '\\') {
      fprintf(out, "\\%c", *p++);
    } else if (*p < 0x20 || *p == 0x7f) {
      fprintf(out, "\\u%04x", *p++);
    } else {
      fwrite(p, 1, (size_t)len, out);
      p += len;
    }
  }
  fputc('"', out);
}

const char *human_bytes(double bytes, char *buf, size_t len) {
  static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4)
    bytes /= 1024.0, u++;
  snprintf(buf, len, u ? "%.1f %s" : "%.0f %s", bytes, units[u]);
  return buf;
}

/* The chain's links with what each owns, and each layer's owner, as JSON members. */
void owners_json(FILE *out, const qkeep_model *model) {
  fprintf(out, "\"backends\":[");
  for (size_t i = 0; i < qkeep_model_backend_count(model); i++) {
    struct qkeep_chain_info b = {.size = sizeof b};
    qkeep_model_backend_info(model, i, &b);
    fprintf(out, "%s{\"name\":", i ? "," : "");
    print_json_string(out, b.name);
    fprintf(out, ",\"usable\":%s,\"layers\":%zu", b.usable ? "true" : "false", b.layers);
    if (!b.usable) {
      fprintf(out, ",\"probe_message\":");
      print_json_string(out, b.probe_message);
    }
    fputc('}', out);
  }
  fprintf(out, "],\"owners\":[");
  for (size_t i = 0; i < qkeep_model_layer_count(model); i++) {
    const qkeep_layer *layer = qkeep_model_layer(model, i);
    struct qkeep_layer_info info = {.size = sizeof info};
    qkeep_layer_get_info(layer, &info);
    const char *backend = qkeep_layer_backend(layer);
    fprintf(out, "%s{\"layer\":", i ? "," : "");
    print_json_string(out, info.name);
    fprintf(out, ",\"scheme\":");
    print_json_string(out, info.scheme);
    fprintf(out, ",\"kind\":\"%s\",\"backend\":", qkeep_layer_kind_name(info.kind));
    print_json_string(out, backend ? backend : "host");
    fputc('}', out);
  }
  fputc(']', out);
}

void report_owners(FILE *out, const qkeep_model *model) {
  fprintf(out, "backends, in chain order\n");
  for (size_t i = 0; i < qkeep_model_backend_count(model); i++) {
    struct qkeep_chain_info b = {.size = sizeof b};
    qkeep_model_backend_info(model, i, &b);
    if (b.usable)
      fprintf(out, "  %-26s %zu layers\n", b.name, b.layers);
    else
      fprintf(out, "  %-26s skipped: %s\n", b.name, b.probe_message);
  }
  fprintf(out, "layers and their backends\n");
  for (size_t i = 0; i < qkeep_model_layer_count(model); i++) {
    const qkeep_layer *layer = qkeep_model_layer(model, i);
    struct qkeep_layer_info info = {.size = sizeof info};
    qkeep_layer_get_info(layer, &info);
    const char *backend = qkeep_layer_backend(layer);
    fprintf(out, "  %-52s %-15s %-10s %s\n", info.name, info.scheme, qkeep_layer_kind_name(info.kind),
            backend ? backend : "host");
  }
}

void census_members_json(FILE *out, bool first, const char *checkpoint, const qkeep_model *model,
                         const struct qkeep_census *c, const struct qkeep_digest *d) {
  char hex[33];
  qkeep_digest_hex(d, hex);
  fprintf(out, "%s\"checkpoint\":", first ? "" : ",");
  print_json_string(out, checkpoint);
  fputc(',', out);
  owners_json(out, model);
  fprintf(out,
          ",\"layers\":%zu,\"loader_params\":%lld,\"registered_same\":%lld,\"missing\":%lld,\"c1\":%lld,"
          "\"c2\":%lld,\"aliases\":%lld,\"retired\":%lld,\"retired_bytes\":%lld,\"released\":%lld,"
          "\"released_bytes\":%lld,\"release_reasons\":[",
          qkeep_model_layer_count(model), (long long)c->loader_params, (long long)c->registered_same,
          (long long)c->missing, (long long)c->c1, (long long)c->c2, (long long)c->aliases,
          (long long)c->retired, (long long)c->retired_bytes, (long long)c->released,
          (long long)c->released_bytes);
  for (int i = 0; i < c->reasons; i++) {
    if (i)
      fputc(',', out);
    print_json_string(out, c->reason[i]);
  }
  fprintf(out,
          "],\"quantized_on_load\":%lld,\"quantized_on_load_bytes\":%lld,\"quantized_on_load_kept_bytes\":0,"
          "\"buffers\":%lld,\"kept_bytes\":%lld,\"total_bytes\":%lld,\"kept_share\":",
          (long long)c->quantized_on_load, (long long)c->quantized_on_load_bytes, (long long)c->buffers,
          (long long)c->kept_bytes, (long long)c->total_bytes);
  print_json_number(out, c->kept_share);
  fprintf(out, ",\"digest\":\"%s\"", hex);
}

void report_census(FILE *out, const char *checkpoint, const qkeep_model *model, const struct qkeep_census *c,
                   const struct qkeep_digest *d, bool json) {
  char hex[33], b1[32], b2[32], b3[32];
  qkeep_digest_hex(d, hex);
  if (json) {
    fputc('{', out);
    census_members_json(out, true, checkpoint, model, c, d);
    fputc('}', out);
    return;
  }
  fprintf(out, "census of %s\n", checkpoint);
  fprintf(out, "  %-26s %lld\n", "layers", (long long)qkeep_model_layer_count(model));
  fprintf(out, "  %-26s %lld\n", "loader params", (long long)c->loader_params);
  fprintf(out, "  %-26s %lld\n", "registered as same object", (long long)c->registered_same);
  fprintf(out, "  %-26s %lld\n", "missing", (long long)c->missing);
  fprintf(out, "  %-26s %lld\n", "C1 violations", (long long)c->c1);
  fprintf(out, "  %-26s %lld\n", "C2 overlaps", (long long)c->c2);
  fprintf(out, "  %-26s %lld\n", "aliases", (long long)c->aliases);
  fprintf(out, "  %-26s %lld (%s)\n", "retired", (long long)c->retired,
          human_bytes((double)c->retired_bytes, b1, sizeof b1));
  fprintf(out, "  %-26s %lld\n", "released", (long long)c->released);
  for (int i = 0; i < c->reasons; i++)
    fprintf(out, "  %-26s %s\n", "  reason", c->reason[i]);
  fprintf(out, "  %-26s %lld (%s quantized, 0 kept)\n", "quantized on load", (long long)c->quantized_on_load,
          human_bytes((double)c->quantized_on_load_bytes, b1, sizeof b1));
  fprintf(out, "  %-26s %lld\n", "buffers", (long long)c->buffers);
  fprintf(out, "  %-26s %s (%.2f%% of %s)\n", "kept beyond kernel needs",
          human_bytes((double)c->kept_bytes, b2, sizeof b2), 100.0 * c->kept_share,
          human_bytes((double)c->total_bytes, b3, sizeof b3));
  fprintf(out, "  %-26s %lld\n", "total bytes", (long long)c->total_bytes);
  fprintf(out, "  %-26s %s\n", "digest", hex);
  report_owners(out, model);
}
