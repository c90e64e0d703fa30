/*
 * check_docs.c: docs/SCHEMES.md cannot drift from the code. For every scheme (and its
 * variants) a model is quantized with dims chosen so that every dimension expression has
 * its own value, loaded on the reference backend (whose PWAL changes nothing), and the
 * params its fused q/k/v linear layer and its MoE layer hold after fusion and normalisation
 * (every registered name: dtype, shape in N, K, G, S, E, H, I, state, alias) are rendered
 * as table rows. Each must equal the rows between the doc's markers
 * `<!-- params: SCHEME VARIANT KIND -->` and `<!-- end -->`, no more and no fewer.
 * With QKEEP_WRITE_SCHEMES=FILE set, the rows are written there instead (to draft the doc).
 *
 * The core's sources (every .c and .h under libqkeep/, at any depth) cannot drift from README
 * either: each environment variable they read (getenv("NAME") with a literal name, the only form
 * allowed) must be listed in README's "Environment" section, and they never print (no stderr,
 * stdout, printf, puts, perror...) nor change the caller's environment (setenv, putenv...).
 *
 * The docs (README.md, every .md of docs/, the man page) speak to users: no word about how the work on
 * the project was organised (an issue, a session, the lead, a path of the machines it ran on),
 * and every NAME.md they or a source cite is a file of the repository (there is no DESIGN.md).
 */
#include <check.h>
#include <ctype.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkutil.h"
#include "private.h"
#include "testutil.h"

/* H, I, G, E and the fused shards of q/k/v: every expression below has a distinct value. */
#define H 256   /* hidden: q, o, experts' K */
#define KV 64   /* k and v rows */
#define I 192   /* expert intermediate */
#define MLP 320 /* dense MLP intermediate */
#define E 5     /* experts */
#define G 64    /* int4 group */
#define VOCAB 100

static char *dir;
static qkeep_plugin *ref;
static FILE *draft;

static void add(struct st_writer *w, const char *name, int64_t rows, int64_t cols, uint64_t seed) {
  size_t n = (size_t)(rows * (cols ? cols : 1));
  float *v = malloc(n * sizeof *v);
  for (size_t i = 0; i < n; i++)
    v[i] = cols ? tu_randf(&seed) * 0.25f : 1.0f;
  struct qkeep_spec sp = {QKEEP_DTYPE_F32, cols ? 2 : 1, {rows, cols}};
  ck_assert_int_eq(st_writer_add(w, name, &sp, v), 0);
  free(v);
}

static char *write_source(void) {
  struct st_writer *w;
  char name[160];
  ck_assert_int_eq(st_writer_new(&w), 0);
  add(w, "model.embed_tokens.weight", VOCAB, H, 1);
  add(w, "model.norm.weight", H, 0, 2);
  add(w, "lm_head.weight", VOCAB, H, 3);
  static const char *const proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  for (int p = 0; p < 4; p++) {
    snprintf(name, sizeof name, "model.layers.0.self_attn.%s.weight", proj[p]);
    add(w, name, p == 1 || p == 2 ? KV : H, H, 10 + (uint64_t)p);
  }
  add(w, "model.layers.0.mlp.gate_proj.weight", MLP, H, 20);
  add(w, "model.layers.0.mlp.up_proj.weight", MLP, H, 21);
  add(w, "model.layers.0.mlp.down_proj.weight", H, MLP, 22);
  add(w, "model.layers.1.mlp.gate.weight", E, H, 30);
  for (int e = 0; e < E; e++) {
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.gate_proj.weight", e);
    add(w, name, I, H, 40 + (uint64_t)e);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.up_proj.weight", e);
    add(w, name, I, H, 50 + (uint64_t)e);
    snprintf(name, sizeof name, "model.layers.1.mlp.experts.%d.down_proj.weight", e);
    add(w, name, H, I, 60 + (uint64_t)e);
  }
  char *path = tu_path(dir, "source.safetensors");
  ck_assert_int_eq(st_writer_write(w, path), 0);
  st_writer_free(w);
  return path;
}

/* One scheme as the doc documents it. */
struct variant {
  const char *scheme, *name; /* name: the doc's word for the variant ("-" for none) */
  bool static_input, asym_input, asym_weights;
};

static const struct variant variants[] = {
    {"unquantized", "-", false, false, false},     {"modelopt-nvfp4", "-", false, false, false},
    {"ct-nvfp4", "-", false, false, false},        {"mxfp4", "-", false, false, false},
    {"w8a8-int8", "dynamic", false, false, false}, {"w8a8-int8", "static-asym", true, true, false},
    {"gptq-int4", "sym", false, false, false},     {"gptq-int4", "asym", false, false, true},
    {"awq-int4", "asym", false, false, true},      {"ct-int4", "sym", false, false, false},
    {"ct-int4", "asym", false, false, true},
};

/* A dimension as the doc writes it: the expression of the layer's dims that has this value. */
static const char *symbol(int64_t v, bool moe, int shards) {
  static const struct {
    int64_t value;
    const char *name;
    bool moe; /* false: for the linear layer (q/k/v: N = H + 2 KV, K = H) */
  } symbols[] = {
      {H + 2 * KV, "N", false},
      {(H + 2 * KV) / 8, "N/8", false},
      {H, "K", false},
      {H / 2, "K/2", false},
      {H / 8, "K/8", false},
      {H / 16, "K/16", false},
      {H / 32, "K/32", false},
      {H / G, "K/G", false},
      {2 * I, "2I", true},
      {I, "I", true},
      {2 * I / 8, "2I/8", true},
      {I / 2, "I/2", true},
      {I / 8, "I/8", true},
      {I / 16, "I/16", true},
      {I / 32, "I/32", true},
      {I / G, "I/G", true},
      {H, "H", true},
      {H / 2, "H/2", true},
      {H / 8, "H/8", true},
      {H / 16, "H/16", true},
      {H / 32, "H/32", true},
      {H / G, "H/G", true},
      {E, "E", true},
  };
  if (v == shards && shards > 1) /* q/k/v: 3; an MoE layer's w13: gate and up */
    return "S";
  if (v == 1)
    return "1";
  for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++)
    if (symbols[i].moe == moe && symbols[i].value == v)
      return symbols[i].name;
  static char number[32];
  snprintf(number, sizeof number, "%lld?", (long long)v); /* no expression: shows as a failure */
  return number;
}

struct rows {
  char **row;
  size_t n, cap;
  const qkeep_layer *layer;
  bool moe;
  int shards;
};

static int add_row(void *user, const char *name, bool is_buffer, const struct qkeep_view *v) {
  struct rows *r = user;
  char shape[128] = "[";
  size_t len = strlen(name);
  bool shape_pairs =
      len >= 12 && strcmp(name + len - 12, "weight_shape") == 0; /* ct-int4's [.., 2] = [N, K] */
  for (int d = 0; d < v->spec.ndim; d++)
    snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "%s%s", d ? ", " : "",
             shape_pairs && d == v->spec.ndim - 1 && v->spec.shape[d] == 2
                 ? "2"
                 : symbol(v->spec.shape[d], r->moe, r->shards));
  strcat(shape, "]");
  qkeep_param *p = is_buffer ? NULL : qkeep_param_lookup(r->layer, name);
  const char *origin = p ? qkeep_param_checkpoint_name(p) : NULL;
  char what[160];
  snprintf(what, sizeof what, "%s%s%s%s",
           is_buffer                      ? "buffer"
           : v->state == QKEEP_PARAM_LIVE ? "live"
                                          : "retired",
           origin && strcmp(origin, name) ? ", alias of `" : "", origin && strcmp(origin, name) ? origin : "",
           origin && strcmp(origin, name) ? "`" : "");
  char line[512];
  snprintf(line, sizeof line, "| `%s` | %s | %s | %s |", name, qkeep_dtype_name(v->spec.dtype), shape, what);
  if (r->n == r->cap) {
    r->cap = r->cap ? 2 * r->cap : 16;
    r->row = realloc(r->row, r->cap * sizeof *r->row);
  }
  r->row[r->n++] = strdup(line);
  return 0;
}

static int by_string(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The rows the doc holds between `<!-- params: KEY -->` and `<!-- end -->`, sorted. */
static struct rows doc_rows(const char *doc, const char *key) {
  struct rows r = {0};
  char marker[160];
  snprintf(marker, sizeof marker, "<!-- params: %s -->", key);
  const char *at = strstr(doc, marker);
  ck_assert_msg(at != NULL, "docs/SCHEMES.md has no section %s", marker);
  at += strlen(marker);
  const char *end = strstr(at, "<!-- end -->");
  ck_assert_ptr_nonnull(end);
  while (at < end) {
    const char *nl = memchr(at, '\n', (size_t)(end - at));
    size_t len = nl ? (size_t)(nl - at) : (size_t)(end - at);
    if (len && at[0] == '|' && strncmp(at, "| param", 7) != 0 && strncmp(at, "|---", 4) != 0) {
      if (r.n == r.cap) {
        r.cap = r.cap ? 2 * r.cap : 16;
        r.row = realloc(r.row, r.cap * sizeof *r.row);
      }
      r.row[r.n++] = strndup(at, len);
    }
    at += len + 1;
  }
  qsort(r.row, r.n, sizeof *r.row, by_string);
  return r;
}

static void free_rows(struct rows *r) {
  for (size_t i = 0; i < r->n; i++)
    free(r->row[i]);
  free(r->row);
}

static void check_layer(const char *doc, const struct variant *v, qkeep_model *m, const char *layer_name,
                        const char *kind) {
  qkeep_layer *layer = qkeep_model_find_layer(m, layer_name);
  ck_assert_ptr_nonnull(layer);
  struct qkeep_layer_info info = {.size = sizeof info};
  ck_assert_int_eq(qkeep_layer_get_info(layer, &info), 0);
  struct rows got = {.layer = layer, .moe = info.kind == QKEEP_LAYER_MOE, .shards = info.shards};
  ck_assert_int_eq(qkeep_foreach_name(layer, add_row, &got), 0);
  qsort(got.row, got.n, sizeof *got.row, by_string);
  char key[128];
  snprintf(key, sizeof key, "%s %s %s", v->scheme, v->name, kind);
  if (draft) {
    fprintf(draft, "<!-- params: %s -->\n| param | dtype | shape | state |\n|---|---|---|---|\n", key);
    for (size_t i = 0; i < got.n; i++)
      fprintf(draft, "%s\n", got.row[i]);
    fprintf(draft, "<!-- end -->\n\n");
  } else {
    struct rows want = doc_rows(doc, key);
    for (size_t i = 0; i < got.n || i < want.n; i++)
      ck_assert_msg(i < got.n && i < want.n && strcmp(got.row[i], want.row[i]) == 0,
                    "%s: the model has %s, docs/SCHEMES.md says %s", key,
                    i < got.n ? got.row[i] : "(nothing)", i < want.n ? want.row[i] : "(nothing)");
    free_rows(&want);
  }
  free_rows(&got);
}

START_TEST(schemes_md_lists_what_a_backend_receives) {
  char *docs = tu_path(tu_srcdir(), "docs"), *path = tu_path(docs, "SCHEMES.md");
  size_t n = 0;
  char *doc = draft ? NULL : tu_read_file(path, &n);
  ck_assert_msg(draft || doc, "cannot read %s", path);
  if (doc)
    doc = realloc(doc, n + 1), doc[n] = 0;
  char *source = write_source();
  for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
    const struct variant *v = &variants[i];
    char out[96];
    snprintf(out, sizeof out, "q-%zu", i);
    char *q = strcmp(v->scheme, "unquantized") ? tu_path(dir, out) : strdup(source);
    if (strcmp(v->scheme, "unquantized")) {
      struct qkeep_quantize_options o = {.size = sizeof o,
                                         .scheme = v->scheme,
                                         .group_size = G,
                                         .static_input = v->static_input,
                                         .asym_input = v->asym_input,
                                         .asym_weights = v->asym_weights,
                                         .kv_cache_scales = true,
                                         .activation_amax = 4};
      ck_assert_msg(qkeep_quantize(source, q, &o) == 0, "%s: %s", v->scheme, qkeep_errmsg());
    }
    qkeep_model *m;
    ck_assert_int_eq(qkeep_model_new(ref, &m), 0);
    ck_assert_msg(qkeep_model_load(m, q) == 0, "%s: %s", q, qkeep_errmsg());
    check_layer(doc, v, m, "model.layers.0.self_attn.qkv_proj", "linear");
    check_layer(doc, v, m, "model.layers.1.mlp.experts", "moe");
    if (strcmp(v->scheme, "modelopt-nvfp4") == 0)
      check_layer(doc, v, m, "model.layers.0.self_attn.attn", "kv-scales");
    qkeep_model_free(m);
    free(q);
  }
  free(source);
  free(doc);
  free(path);
  free(docs);
}
END_TEST

/* ---- the core's sources: documented environment, no printing -------------------------------- */

/* What a scan of sources found: the environment variables read, and each problem as "file:line: why". */
struct scan {
  char **names, **problems;
  size_t n_names, n_problems, files;
};

static void push(char ***list, size_t *n, char *item) {
  *list = realloc(*list, (*n + 1) * sizeof **list);
  (*list)[(*n)++] = item;
}

static void problem(struct scan *sc, const char *file, const char *text, size_t at, const char *why,
                    const char *what) {
  size_t line = 1;
  for (size_t i = 0; i < at; i++)
    line += text[i] == '\n';
  char *p = NULL;
  ck_assert_int_ge(asprintf(&p, "%s:%zu: %s %s", file, line, why, what), 0);
  push(&sc->problems, &sc->n_problems, p);
}

/* text with its comments and the insides of its string and character literals blanked (the quotes
 * and the offsets stay), so that only code is left to look at. */
static char *code_only(const char *text, size_t n) {
  char *code = malloc(n + 1);
  memcpy(code, text, n + 1);
  for (size_t i = 0; i < n; i++) {
    if (code[i] == '/' && code[i + 1] == '*') {
      size_t j = i + 2;
      while (j < n && !(code[j] == '*' && code[j + 1] == '/'))
        j++;
      for (size_t k = i; k < j + 2 && k < n; k++)
        code[k] = code[k] == '\n' ? '\n' : ' ';
      i = j + 1;
    } else if (code[i] == '/' && code[i + 1] == '/') {
      while (i < n && code[i] != '\n')
        code[i++] = ' ';
    } else if (code[i] == '"' || code[i] == '\'') {
      char quote = code[i];
      size_t j = i + 1;
      for (; j < n && code[j] != quote && code[j] != '\n'; j++)
        if (code[j] == '\\')
          code[j++] = ' ', code[j] = code[j] == '\n' ? '\n' : ' ';
        else
          code[j] = ' ';
      i = j;
    }
  }
  return code;
}

static bool among_words(const char *word, size_t len, const char *const *words) {
  for (; *words; words++)
    if (strlen(*words) == len && strncmp(*words, word, len) == 0)
      return true;
  return false;
}

/* Looks at one source file's text (NUL-terminated, n bytes). */
static void scan_text(struct scan *sc, const char *file, const char *text, size_t n) {
  /* Named anywhere: the standard streams, and the environment as a whole. */
  static const char *const streams[] = {"stderr", "stdout", "STDERR_FILENO", "STDOUT_FILENO", NULL};
  static const char *const whole_environment[] = {"environ", "__environ", NULL};
  /* Called: printing to a terminal, and changing the caller's environment. */
  static const char *const prints[] = {"printf",  "vprintf",  "puts",    "putchar",  "perror",
                                       "dprintf", "vdprintf", "psignal", "psiginfo", "warn",
                                       "warnx",   "vwarn",    "vwarnx",  "err",      "errx",
                                       "verr",    "verrx",    "error",   NULL};
  static const char *const changes[] = {"setenv", "putenv", "unsetenv", "clearenv", NULL};
  static const char *const getenvs[] = {"getenv", "secure_getenv", NULL};
  char *code = code_only(text, n);
  for (size_t i = 0; i < n; i++) {
    if (!(isalpha((unsigned char)code[i]) || code[i] == '_') ||
        (i && (isalnum((unsigned char)code[i - 1]) || code[i - 1] == '_')))
      continue;
    size_t len = 0;
    while (isalnum((unsigned char)code[i + len]) || code[i + len] == '_')
      len++;
    size_t after = i + len;
    while (after < n && isspace((unsigned char)code[after]))
      after++;
    char word[64];
    snprintf(word, sizeof word, "%.*s", (int)(len < 63 ? len : 63), code + i);
    bool call = code[after] == '(';
    if (among_words(code + i, len, streams))
      problem(sc, file, text, i, "prints through", word);
    else if (among_words(code + i, len, whole_environment))
      problem(sc, file, text, i, "reads the environment through", word);
    else if (call && among_words(code + i, len, prints))
      problem(sc, file, text, i, "prints with", word);
    else if (call && among_words(code + i, len, changes))
      problem(sc, file, text, i, "changes the caller's environment with", word);
    else if (call && among_words(code + i, len, getenvs)) {
      size_t q = after + 1;
      while (q < n && isspace((unsigned char)code[q]))
        q++;
      const char *end = code[q] == '"' ? strchr(text + q + 1, '"') : NULL;
      if (!end)
        problem(sc, file, text, i, "reads a variable whose name is not a literal with", word);
      else
        push(&sc->names, &sc->n_names, strndup(text + q + 1, (size_t)(end - (text + q + 1))));
    }
    i = after > i ? after - 1 : i;
  }
  free(code);
}

static void scan_dir(struct scan *sc, const char *path) {
  DIR *d = opendir(path);
  ck_assert_msg(d != NULL, "cannot read %s", path);
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.')
      continue;
    char *sub = tu_path(path, e->d_name);
    struct stat sb;
    size_t len = strlen(e->d_name);
    if (stat(sub, &sb) == 0 && S_ISDIR(sb.st_mode))
      scan_dir(sc, sub);
    else if (S_ISREG(sb.st_mode) && len > 2 && e->d_name[len - 2] == '.' &&
             (e->d_name[len - 1] == 'c' || e->d_name[len - 1] == 'h')) {
      size_t n = 0;
      char *text = tu_read_file(sub, &n);
      ck_assert_msg(text != NULL, "cannot read %s", sub);
      text = realloc(text, n + 1), text[n] = 0;
      scan_text(sc, sub, text, n);
      sc->files++;
      free(text);
    }
    free(sub);
  }
  closedir(d);
}

static void scan_free(struct scan *sc) {
  for (size_t i = 0; i < sc->n_names; i++)
    free(sc->names[i]);
  for (size_t i = 0; i < sc->n_problems; i++)
    free(sc->problems[i]);
  free(sc->names), free(sc->problems);
}

/* README's "## Environment" section (malloc'd). */
static char *readme_environment(void) {
  char *path = tu_path(tu_srcdir(), "README.md");
  size_t n = 0;
  char *readme = tu_read_file(path, &n);
  ck_assert_msg(readme != NULL, "cannot read %s", path);
  readme = realloc(readme, n + 1), readme[n] = 0;
  const char *at = strstr(readme, "\n## Environment\n");
  ck_assert_msg(at != NULL, "%s has no \"## Environment\" section", path);
  const char *end = strstr(at + 1, "\n## ");
  char *section = strndup(at, end ? (size_t)(end - at) : strlen(at));
  free(readme), free(path);
  return section;
}

START_TEST(the_core_reads_only_the_environment_readme_documents) {
  struct scan sc = {0};
  char *core = tu_path(tu_srcdir(), "libqkeep");
  scan_dir(&sc, core);
  ck_assert_uint_ge(sc.files, 20); /* the scan found the core */
  char *env = readme_environment();
  ck_assert_msg(strstr(env, "`QKEEP_PLUGIN_PATH`"),
                "README's Environment section lists no QKEEP_PLUGIN_PATH");
  for (size_t i = 0; i < sc.n_names; i++) {
    char quoted[128];
    snprintf(quoted, sizeof quoted, "`%s`", sc.names[i]);
    ck_assert_msg(strstr(env, quoted), "the core reads $%s, which README's Environment section does not list",
                  sc.names[i]);
  }
  ck_assert_uint_ge(sc.n_names, 2); /* QKEEP_PLUGIN_PATH, QKEEP_NCCL_LIBRARY */
  free(env), free(core);
  scan_free(&sc);
}
END_TEST

START_TEST(the_core_never_prints_nor_changes_the_environment) {
  struct scan sc = {0};
  char *core = tu_path(tu_srcdir(), "libqkeep");
  scan_dir(&sc, core);
  ck_assert_uint_ge(sc.files, 20);
  for (size_t i = 0; i < sc.n_problems; i++)
    fprintf(stderr, "%s\n", sc.problems[i]);
  ck_assert_msg(sc.n_problems == 0, "%s (and %zu more)", sc.n_problems ? sc.problems[0] : "",
                sc.n_problems ? sc.n_problems - 1 : 0);
  free(core);
  scan_free(&sc);
}
END_TEST

/* The scan itself: it finds what it is for in planted code, and not in comments, strings or other
 * names (snprintf to a buffer, fprintf to a memstream, a variable named err). */
START_TEST(the_source_scan_finds_planted_prints_and_variables) {
  static const char planted[] =
      "/* fprintf(stderr, ...) in a comment; getenv(\"IN_A_COMMENT\") */\n"
      "static int f(char *buf, FILE *mem, int err) {\n"
      "  snprintf(buf, 8, \"printf(%d)\", err); fprintf(mem, \"stderr\");\n"
      "  const char *a = getenv(\"QKEEP_PLANTED\"), *b = secure_getenv (\"QKEEP_TOO\");\n"
      "  fprintf(stderr, \"x\");\n"
      "  puts(a); setenv(\"NCCL_NVLS_ENABLE\", \"0\", 1);\n"
      "  return getenv(name) != 0 || b; // printf(\"in a comment\")\n"
      "}\n";
  struct scan sc = {0};
  scan_text(&sc, "planted.c", planted, strlen(planted));
  ck_assert_uint_eq(sc.n_names, 2);
  ck_assert_str_eq(sc.names[0], "QKEEP_PLANTED");
  ck_assert_str_eq(sc.names[1], "QKEEP_TOO");
  static const char *const want[] = {"planted.c:5: prints through stderr", "planted.c:6: prints with puts",
                                     "planted.c:6: changes the caller's environment with setenv",
                                     "planted.c:7: reads a variable whose name is not a literal with getenv"};
  ck_assert_uint_eq(sc.n_problems, sizeof want / sizeof want[0]);
  for (size_t i = 0; i < sc.n_problems; i++)
    ck_assert_str_eq(sc.problems[i], want[i]);
  scan_free(&sc);
}
END_TEST

/* ---- the docs speak to users ----------------------------------------------------------------- */

/* Whole words (any case) about how the work was organised, never about the product. */
static const char *const work_words[] = {"issue", "issues", "session", "sessions", NULL};
/* Text (any case) that no doc has a reason to hold. */
static const char *const work_phrases[] = {"the lead", "/work/", "design.md", NULL};

static bool is_name_char(char c) {
  return isalnum((unsigned char)c) || c == '_' || c == '.' || c == '/' || c == '-';
}

/* Whether the NAME.md a doc cites is in the repository: as a path from the top, beside the doc,
 * or, a bare name, at the top or in docs/. */
static bool cited_doc_exists(const char *doc_dir, const char *name) {
  const char *const bases[] = {tu_srcdir(), doc_dir, NULL};
  bool found = false;
  for (size_t b = 0; bases[b] && !found; b++) {
    char *path = tu_path(bases[b], name);
    found = access(path, F_OK) == 0;
    free(path);
  }
  if (!found && !strchr(name, '/')) {
    char *docs = tu_path(tu_srcdir(), "docs");
    char *path = tu_path(docs, name);
    found = access(path, F_OK) == 0;
    free(path), free(docs);
  }
  return found;
}

/* Each NAME.md that text (NUL-terminated, n bytes) cites (the longest run of name characters
 * ending in ".md") must be a file of the repository; doc_dir: the directory of the text's file. */
static void scan_citations(struct scan *sc, const char *file, const char *doc_dir, const char *text,
                           size_t n) {
  for (size_t i = 1; i + 3 <= n; i++) {
    if (strncmp(text + i, ".md", 3) != 0 || isalnum((unsigned char)text[i + 3]) ||
        !isalnum((unsigned char)text[i - 1]))
      continue;
    size_t start = i;
    while (start > 0 && is_name_char(text[start - 1]))
      start--;
    char *name = strndup(text + start, i + 3 - start);
    if (!cited_doc_exists(doc_dir, name))
      problem(sc, file, text, start, "cites a file the repository does not have:", name);
    free(name);
  }
}

/* Looks at one doc's text (NUL-terminated, n bytes); doc_dir: its directory. */
static void scan_prose(struct scan *sc, const char *file, const char *doc_dir, const char *text, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (isalpha((unsigned char)text[i]) && (i == 0 || !isalnum((unsigned char)text[i - 1]))) {
      size_t len = 0;
      while (isalpha((unsigned char)text[i + len]))
        len++;
      char word[32];
      if (len < sizeof word && !isalnum((unsigned char)text[i + len])) {
        for (size_t k = 0; k < len; k++)
          word[k] = (char)tolower((unsigned char)text[i + k]);
        word[len] = 0;
        if (among_words(word, len, work_words))
          problem(sc, file, text, i, "speaks of how the work was organised:", word);
      }
    }
    for (size_t p = 0; work_phrases[p]; p++) {
      size_t len = strlen(work_phrases[p]); /* a whole phrase: "the lead's", not "the leading" */
      if (strncasecmp(text + i, work_phrases[p], len) == 0 && !isalnum((unsigned char)text[i + len]))
        problem(sc, file, text, i, "holds", work_phrases[p]);
    }
  }
  scan_citations(sc, file, doc_dir, text, n);
}

static void scan_prose_file(struct scan *sc, const char *doc_dir, const char *name) {
  char *path = tu_path(doc_dir, name);
  size_t n = 0;
  char *text = tu_read_file(path, &n);
  ck_assert_msg(text != NULL, "cannot read %s", path);
  text = realloc(text, n + 1), text[n] = 0;
  scan_prose(sc, path, doc_dir, text, n);
  sc->files++;
  free(text), free(path);
}

START_TEST(the_docs_speak_to_users) {
  struct scan sc = {0};
  scan_prose_file(&sc, tu_srcdir(), "README.md");
  char *docs = tu_path(tu_srcdir(), "docs");
  DIR *d = opendir(docs);
  ck_assert_msg(d != NULL, "cannot read %s", docs);
  struct dirent *e;
  while ((e = readdir(d))) {
    size_t len = strlen(e->d_name);
    if ((len > 3 && strcmp(e->d_name + len - 3, ".md") == 0) || strcmp(e->d_name, "qkeep.1.in") == 0)
      scan_prose_file(&sc, docs, e->d_name);
  }
  closedir(d);
  ck_assert_uint_ge(sc.files, 8); /* README, the man page and every .md of docs/ */
  for (size_t i = 0; i < sc.n_problems; i++)
    fprintf(stderr, "%s\n", sc.problems[i]);
  ck_assert_msg(sc.n_problems == 0, "%s (and %zu more)", sc.n_problems ? sc.problems[0] : "",
                sc.n_problems ? sc.n_problems - 1 : 0);
  free(docs);
  scan_free(&sc);
}
END_TEST

/* Each source cites only docs the repository has (no DESIGN.md, no notes kept elsewhere). */
static void scan_source_citations(struct scan *sc, const char *path) {
  DIR *d = opendir(path);
  ck_assert_msg(d != NULL, "cannot read %s", path);
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.' ||
        strcmp(e->d_name, "check_docs.c") == 0) /* its planted test names missing docs */
      continue;
    char *sub = tu_path(path, e->d_name);
    struct stat sb;
    size_t len = strlen(e->d_name);
    if (stat(sub, &sb) == 0 && S_ISDIR(sb.st_mode)) {
      scan_source_citations(sc, sub);
    } else if (S_ISREG(sb.st_mode) && len > 2 &&
               (strcmp(e->d_name + len - 2, ".c") == 0 || strcmp(e->d_name + len - 2, ".h") == 0 ||
                (len > 3 && strcmp(e->d_name + len - 3, ".cu") == 0))) {
      size_t n = 0;
      char *text = tu_read_file(sub, &n);
      ck_assert_msg(text != NULL, "cannot read %s", sub);
      text = realloc(text, n + 1), text[n] = 0;
      scan_citations(sc, sub, tu_srcdir(), text, n);
      sc->files++;
      free(text);
    }
    free(sub);
  }
  closedir(d);
}

START_TEST(every_doc_a_source_cites_is_there) {
  struct scan sc = {0};
  static const char *const dirs[] = {"libqkeep", "cli", "plugins", "include", "bench", "tests"};
  for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
    char *path = tu_path(tu_srcdir(), dirs[i]);
    scan_source_citations(&sc, path);
    free(path);
  }
  ck_assert_uint_ge(sc.files, 100);
  for (size_t i = 0; i < sc.n_problems; i++)
    fprintf(stderr, "%s\n", sc.problems[i]);
  ck_assert_msg(sc.n_problems == 0, "%s (and %zu more)", sc.n_problems ? sc.problems[0] : "",
                sc.n_problems ? sc.n_problems - 1 : 0);
  scan_free(&sc);
}
END_TEST

/* The prose scan finds what it is for, and not inside other words or in files that exist. */
START_TEST(the_prose_scan_finds_planted_words_and_citations) {
  static const char planted[] =
      "Measured in the Session of Monday; see issue 27.\n"
      "Tissues, reissued, sessional, the leading one: other words. See docs/ABI.md and README.md.\n"
      "As the lead's run showed (DESIGN.md, \"Config\"); docs/GONE.md.\n";
  struct scan sc = {0};
  scan_prose(&sc, "planted.md", tu_srcdir(), planted, strlen(planted));
  static const char *const want[] = {"planted.md:1: speaks of how the work was organised: session",
                                     "planted.md:1: speaks of how the work was organised: issue",
                                     "planted.md:3: holds the lead",
                                     "planted.md:3: holds design.md",
                                     "planted.md:3: cites a file the repository does not have: DESIGN.md",
                                     "planted.md:3: cites a file the repository does not have: docs/GONE.md"};
  for (size_t i = 0; i < sc.n_problems; i++)
    fprintf(stderr, "%s\n", sc.problems[i]);
  ck_assert_uint_eq(sc.n_problems, sizeof want / sizeof want[0]);
  for (size_t i = 0; i < sc.n_problems; i++)
    ck_assert_str_eq(sc.problems[i], want[i]);
  scan_free(&sc);
}
END_TEST

static void setup(void) {
  dir = tu_tmpdir("docs");
  ck_assert_int_eq(qkeep_plugin_open("reference", NULL, &ref), 0);
}

static void teardown(void) {
  qkeep_plugin_close(ref);
  tu_rmtree(dir);
  free(dir);
}

int main(void) {
  const char *write = getenv("QKEEP_WRITE_SCHEMES");
  if (write && !(draft = fopen(write, "w")))
    return 1;
  Suite *s = suite_create("docs");
  TCase *tc = tcase_create("schemes");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, schemes_md_lists_what_a_backend_receives);
  suite_add_tcase(s, tc);
  TCase *core = tcase_create("core");
  tcase_add_test(core, the_core_reads_only_the_environment_readme_documents);
  tcase_add_test(core, the_core_never_prints_nor_changes_the_environment);
  tcase_add_test(core, the_source_scan_finds_planted_prints_and_variables);
  suite_add_tcase(s, core);
  TCase *prose = tcase_create("prose");
  tcase_add_test(prose, the_docs_speak_to_users);
  tcase_add_test(prose, every_doc_a_source_cites_is_there);
  tcase_add_test(prose, the_prose_scan_finds_planted_words_and_citations);
  suite_add_tcase(s, prose);
  SRunner *sr = srunner_create(s);
  srunner_set_fork_status(sr, draft ? CK_NOFORK : CK_FORK);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  if (draft)
    fclose(draft);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
