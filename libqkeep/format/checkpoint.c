/*
 * checkpoint.c: a checkpoint as one table of tensors, whatever files hold it
 * (see checkpoint.h).
 *
 * A sharded directory is trusted only as far as its files agree: the index's
 * weight_map and the shards' own headers must describe the same set of
 * tensors, each in exactly one shard, before anything is loaded. The JSON
 * files are read whole, with a size cap, since a config is small and an
 * index large only in proportion to the tensor count.
 *
 * Symbolic links: a file a directory names (configs, index, shards, the weights) may be a
 * link only to a file inside the same directory tree, or, in the Hugging Face hub cache's
 * layout (<repo>/snapshots/<revision>/FILE -> ../../blobs/<hash>), into the repository's
 * blobs/ directory. Anything else is refused before it is opened: a checkpoint someone else
 * wrote could otherwise make qkeep read (and quote in its errors) any file the caller can
 * read. A path the caller names itself is the caller's choice and is followed.
 */
#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "format/checkpoint.h"

#define INDEX_NAME "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"
#define CONFIG_NAME "config.json"
#define HF_QUANT_NAME "hf_quant_config.json"

/* config.json and hf_quant_config.json are a few KiB; 16 MiB is far past any real one. */
#define CONFIG_MAX_BYTES ((size_t)16 << 20)
/* An index lists every tensor (about 100 bytes each): 256 MiB covers over two million. */
#define INDEX_MAX_BYTES ((size_t)256 << 20)

/* ---- files --------------------------------------------------------------------------- */

static char *join_path(const char *dir, const char *file) {
  size_t n = strlen(dir) + strlen(file) + 2;
  char *p = malloc(n);
  if (p)
    snprintf(p, n, "%s/%s", dir, file);
  return p;
}

/* The directory part of a file path, without trailing slashes ("." when there is none). */
static char *dir_of(const char *path) {
  const char *slash = strrchr(path, '/');
  if (!slash)
    return xstrdup(".");
  while (slash > path && slash[-1] == '/')
    slash--;
  size_t n = slash == path ? 1 : (size_t)(slash - path);
  char *d = malloc(n + 1);
  if (d) {
    memcpy(d, path, n);
    d[n] = '\0';
  }
  return d;
}

/* A copy of a directory path without its trailing slashes, so that joined names read cleanly. */
static char *dir_clean(const char *path) {
  size_t n = strlen(path);
  while (n > 1 && path[n - 1] == '/')
    n--;
  char *d = malloc(n + 1);
  if (d) {
    memcpy(d, path, n);
    d[n] = '\0';
  }
  return d;
}

/* 1 when path exists, 0 when it does not, or QKEEP_E_IO when stat fails otherwise. */
static int exists(const char *path) {
  struct stat st;
  if (stat(path, &st) == 0)
    return 1;
  if (errno == ENOENT || errno == ENOTDIR)
    return 0;
  return set_error(error_from_errno(errno), "%s: cannot stat: %s", path, strerror(errno));
}

static int read_all(int fd, const char *path, char *buf, size_t n) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = read(fd, buf + done, n - done);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return set_error(QKEEP_E_IO, "%s: read failed: %s", path, strerror(errno));
    if (r == 0)
      return set_error(QKEEP_E_IO, "%s: file shrank while being read (%zu of %zu bytes)", path, done, n);
    done += (size_t)r;
  }
  return 0;
}

/*
 * Reads a whole text file into a malloc'd, NUL-terminated buffer (*out).
 * A missing file gives *out NULL and 0 when `optional`, QKEEP_E_NOTFOUND
 * otherwise. NUL bytes are refused: JSON text cannot hold them raw, and the
 * parsers take C strings.
 */
static int read_text(const char *path, size_t max_bytes, bool optional, char **out) {
  *out = NULL;
  struct stat st;
  int fd = open_regular(path, &st);
  if (fd == OPEN_NOT_REGULAR)
    return set_error(QKEEP_E_IO, "%s: not a regular file (%s)", path, file_kind(st.st_mode));
  if (fd < 0) {
    if (errno == ENOENT && optional)
      return 0;
    if (errno == ENOENT)
      return set_error(QKEEP_E_NOTFOUND, "%s: no such file", path);
    return set_error(error_from_errno(errno), "%s: cannot open: %s", path, strerror(errno));
  }
  int rc = 0;
  char *buf = NULL;
  if ((uint64_t)st.st_size > max_bytes)
    rc = set_error(QKEEP_E_FORMAT, "%s: %lld bytes, larger than the %zu MiB a JSON file may have", path,
                   (long long)st.st_size, max_bytes >> 20);
  else if (!(buf = malloc((size_t)st.st_size + 1)))
    rc = set_error(QKEEP_E_NOMEM, "%s: out of memory for %lld bytes", path, (long long)st.st_size);
  else
    rc = read_all(fd, path, buf, (size_t)st.st_size);
  close(fd);
  if (rc == 0) {
    buf[st.st_size] = '\0';
    if (memchr(buf, '\0', (size_t)st.st_size))
      rc = set_error(QKEEP_E_FORMAT, "%s: contains a NUL byte, not JSON text", path);
  }
  if (rc != 0) {
    free(buf);
    return rc;
  }
  *out = buf;
  return 0;
}

/* ---- symbolic links inside a checkpoint directory ---------------------------------------- */

/* Whether the resolved path `target` is `root` itself or below it (both canonical, from realpath). */
static bool below(const char *target, const char *root) {
  size_t n = strlen(root);
  if (n == 1 && root[0] == '/')
    return true;
  return strncmp(target, root, n) == 0 && (target[n] == '/' || target[n] == '\0');
}

/* The hub cache's blobs directory of a snapshot directory (<repo>/snapshots/<rev> -> <repo>/blobs), or
 * NULL when real_dir is not laid out so (or out of memory). */
static char *hub_blobs(const char *real_dir) {
  const char *rev = strrchr(real_dir, '/');
  if (!rev || rev == real_dir)
    return NULL;
  const char *snapshots = rev;
  while (snapshots > real_dir && snapshots[-1] != '/')
    snapshots--;
  if ((size_t)(rev - snapshots) != strlen("snapshots") || strncmp(snapshots, "snapshots", 9) != 0 ||
      snapshots == real_dir + 1)
    return NULL;
  size_t repo_len = (size_t)(snapshots - real_dir) - 1; /* "<repo>" without the slash */
  char *blobs = malloc(repo_len + sizeof "/blobs");
  if (blobs) {
    memcpy(blobs, real_dir, repo_len);
    memcpy(blobs + repo_len, "/blobs", sizeof "/blobs");
  }
  return blobs;
}

/*
 * A file of the checkpoint directory c->dir: when `path` is a symbolic link, its target must lie
 * in the directory's tree or in the hub cache's blobs/ (see the top of this file). 0 for a file
 * that is no link or does not exist (the caller reports a missing one as it always does).
 */
static int check_link(const struct ckpt *c, const char *path) {
  struct stat st;
  if (lstat(path, &st) != 0 || !S_ISLNK(st.st_mode))
    return 0;
  char *target = realpath(path, NULL), *root = realpath(c->dir, NULL), *blobs = NULL;
  int rc = 0;
  if (!target)
    rc = set_error(errno == ENOENT ? QKEEP_E_NOTFOUND : QKEEP_E_IO,
                   "%s: a symbolic link that does not resolve: %s", path, strerror(errno));
  else if (!root)
    rc = set_error(QKEEP_E_IO, "%s: cannot resolve the directory: %s", c->dir, strerror(errno));
  else if (!below(target, root) && !((blobs = hub_blobs(root)) && below(target, blobs)))
    rc = set_error(QKEEP_E_FORMAT,
                   "%s: a symbolic link to %s, outside the checkpoint directory %s (a checkpoint's files "
                   "may link only inside its own tree, or into the hub cache's ../../blobs/)",
                   path, target, root);
  free(target);
  free(root);
  free(blobs);
  return rc;
}

/* read_text for a file of the checkpoint directory, after check_link. */
static int read_dir_text(const struct ckpt *c, const char *path, size_t max_bytes, bool optional,
                         char **out) {
  *out = NULL;
  int rc = check_link(c, path);
  return rc ? rc : read_text(path, max_bytes, optional, out);
}

/* ---- the tensor table -------------------------------------------------------------------- */

static int by_tensor_name(const void *a, const void *b) {
  return strcmp(((const struct ckpt_tensor *)a)->t->name, ((const struct ckpt_tensor *)b)->t->name);
}

static int by_string(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Appends one opened shard to c->files; on failure closes it, so the caller never holds it alone. */
static int add_file(struct ckpt *c, struct st_file *f, size_t *cap) {
  int rc = grow_array((void **)&c->files, cap, c->n_files + 1, sizeof *c->files);
  if (rc != 0) {
    st_close(f);
    return rc;
  }
  c->files[c->n_files++] = f;
  return 0;
}

/* A checkpoint of one safetensors file: its table is already sorted by name. */
static int open_single(struct ckpt *c, const char *path) {
  struct st_file *f;
  size_t cap = 0;
  int rc = st_open(path, &f);
  if (rc == 0)
    rc = add_file(c, f, &cap);
  if (rc != 0)
    return rc;
  if (f->n_tensors > 0 && !(c->tensors = calloc(f->n_tensors, sizeof *c->tensors)))
    return set_error(QKEEP_E_NOMEM, "%s: out of memory for %zu tensors", path, f->n_tensors);
  for (size_t i = 0; i < f->n_tensors; i++)
    c->tensors[i] = (struct ckpt_tensor){.t = &f->tensors[i], .file = f};
  c->n_tensors = f->n_tensors;
  return 0;
}

/* ---- the sharded index ------------------------------------------------------------------ */

/*
 * What an index says. Its weight_map is read member by member (json_scan.c),
 * never as one tree: names without escapes are used in place, cut out of the
 * file's text by a NUL over their closing quote.
 */
struct index {
  const char *path;
  char *text; /* the file */
  struct mapped {
    const char *tensor, *shard;
  } * map; /* weight_map, in file order */
  size_t n_map, cap_map;
  struct name_index by_tensor; /* map[i].tensor -> i */
  char **owned;                /* decoded strings that held escapes */
  size_t n_owned, cap_owned;
  const char **shards; /* distinct shard names, sorted (as c->files) */
  size_t n_shards;
};

static void index_free(struct index *ix) {
  free(ix->text);
  free(ix->map);
  name_index_clear(&ix->by_tensor);
  for (size_t i = 0; i < ix->n_owned; i++)
    free(ix->owned[i]);
  free(ix->owned);
  free(ix->shards);
}

/* A shard name must be a plain file in the checkpoint's directory, nothing that escapes it. */
static int check_shard_name(const struct index *ix, const char *tensor, const char *shard) {
  if (!shard[0] || strchr(shard, '/') || strstr(shard, ".."))
    return set_error(
        QKEEP_E_FORMAT,
        "%s: tensor '%s' names shard '%s'; a shard must be a file name in the checkpoint directory "
        "(no '/' or '..')",
        ix->path, tensor, shard);
  return 0;
}

/* The string at text[at, at + n) (quotes included): in place when it has no escapes, else decoded. */
static int index_string(struct index *ix, const struct json_scan *s, size_t at, size_t n, bool escaped,
                        const char **out) {
  if (!escaped) {
    ix->text[at + n - 1] = '\0'; /* over the closing quote, behind the scan */
    *out = ix->text + at + 1;
    return 0;
  }
  char *decoded;
  int rc = grow_array((void **)&ix->owned, &ix->cap_owned, ix->n_owned + 1, sizeof *ix->owned);
  if (!rc)
    rc = json_scan_string(s, at, n, true, &decoded);
  if (!rc)
    *out = ix->owned[ix->n_owned++] = decoded;
  return rc;
}

/* The members of weight_map: tensor -> shard, each tensor once, each shard a plain file name. */
static int read_weight_map(struct index *ix, struct json_scan *s) {
  struct json_member m = {.more = true};
  int rc = json_scan_open(s);
  while (!rc && !(rc = json_scan_member(s, &m)) && m.more) {
    const char *tensor = NULL, *shard = NULL;
    if ((rc = json_scan_value(s, &m)) != 0 ||
        (rc = index_string(ix, s, m.key_at, m.key_len, m.key_escaped, &tensor)) != 0)
      break;
    if (s->text[m.value_at] != '"') {
      json_t *v;
      if ((rc = json_scan_parse(s, m.value_at, m.value_len, &v)) == 0)
        rc = set_error(QKEEP_E_FORMAT, "%s: weight_map entry for tensor '%s' is not a string", ix->path,
                       tensor);
      json_decref(v);
      break;
    }
    if ((rc = index_string(ix, s, m.value_at, m.value_len, m.value_escaped, &shard)) != 0 ||
        (rc = check_shard_name(ix, tensor, shard)) != 0 ||
        (rc = grow_array((void **)&ix->map, &ix->cap_map, ix->n_map + 1, sizeof *ix->map)) != 0)
      break;
    if ((rc = name_index_put(&ix->by_tensor, tensor, ix->n_map, NULL)) == QKEEP_E_EXISTS) {
      char *why = NULL;
      rc = qk_asprintf(&why, "duplicate object key '%s' in weight_map", tensor) < 0
               ? set_error(QKEEP_E_NOMEM, "out of memory")
               : json_scan_error(s, m.key_at, why);
      free(why);
    }
    if (!rc)
      ix->map[ix->n_map++] = (struct mapped){tensor, shard};
  }
  return rc;
}

/* A top-level member other than weight_map must still be valid JSON, and metadata an object (or null). */
static int read_other_member(const struct index *ix, const struct json_scan *s, const struct json_member *m,
                             const char *key) {
  json_t *v;
  int rc = json_scan_parse(s, m->value_at, m->value_len, &v);
  if (!rc && strcmp(key, "metadata") == 0 && !json_is_object(v) && !json_is_null(v))
    rc = set_error(QKEEP_E_FORMAT, "%s: metadata is not an object", ix->path);
  json_decref(v);
  return rc;
}

/* The top level: weight_map (an object), metadata and any other keys once each. */
static int read_top_level(struct index *ix, struct json_scan *s) {
  struct json_member m = {.more = true};
  struct name_index keys = {0};
  char **names = NULL;
  size_t n_names = 0, cap_names = 0;
  bool have_map = false;
  int rc = json_scan_open(s);
  while (!rc && !(rc = json_scan_member(s, &m)) && m.more) {
    char *key = NULL;
    if ((rc = grow_array((void **)&names, &cap_names, n_names + 1, sizeof *names)) != 0 ||
        (rc = json_scan_string(s, m.key_at, m.key_len, m.key_escaped, &key)) != 0)
      break;
    names[n_names++] = key;
    if ((rc = name_index_put(&keys, key, 0, NULL)) == QKEEP_E_EXISTS) {
      rc = json_scan_error(s, m.key_at, "duplicate object key at the top level");
      break;
    }
    if (!rc && strcmp(key, "weight_map") == 0 && s->text[m.value_at] == '{') {
      have_map = true;
      rc = read_weight_map(ix, s);
    } else if (!rc) {
      if (!(rc = json_scan_value(s, &m)))
        rc = read_other_member(ix, s, &m, key);
      if (!rc && strcmp(key, "weight_map") == 0)
        rc = set_error(QKEEP_E_FORMAT, "%s: weight_map is not an object", ix->path);
    }
  }
  if (!rc)
    rc = json_scan_end(s);
  if (!rc && !have_map)
    rc = set_error(QKEEP_E_FORMAT, "%s: no weight_map", ix->path);
  if (!rc && ix->n_map == 0)
    rc = set_error(QKEEP_E_FORMAT, "%s: weight_map is empty", ix->path);
  name_index_clear(&keys);
  for (size_t i = 0; i < n_names; i++)
    free(names[i]);
  free(names);
  return rc;
}

/* A text that does not begin with '{' (after spaces): invalid JSON, or JSON that is not an object. */
static int not_an_object(const struct index *ix) {
  json_t *root;
  int line, column, position;
  char why[160];
  int rc = json_parse(ix->text, strlen(ix->text), JSON_DECODE_ANY, &root, &line, &column, &position, why);
  if (rc == QKEEP_E_NOMEM)
    return set_error(rc, "%s: out of memory parsing JSON", ix->path);
  if (rc)
    return set_error(QKEEP_E_FORMAT, "%s: invalid JSON at line %d, column %d: %s", ix->path, line, column,
                     why);
  json_decref(root);
  return set_error(QKEEP_E_FORMAT, "%s: the top level is not an object", ix->path);
}

/* Reads the index and collects its distinct shard names. */
static int read_index(struct index *ix) {
  int rc = read_text(ix->path, INDEX_MAX_BYTES, false, &ix->text);
  if (rc != 0)
    return rc;
  size_t len = strlen(ix->text), start = strspn(ix->text, " \t\n\r");
  if (start == len || ix->text[start] != '{')
    return not_an_object(ix);
  char *what = NULL;
  if (qk_asprintf(&what, "%s: invalid JSON", ix->path) < 0)
    return set_error(QKEEP_E_NOMEM, "%s: out of memory", ix->path);
  struct json_scan s = {.text = ix->text, .len = len, .pos = start, .what = what, .file = ix->path};
  rc = read_top_level(ix, &s);
  free(what);
  if (rc != 0)
    return rc;

  if (!(ix->shards = malloc(ix->n_map * sizeof *ix->shards)))
    return set_error(QKEEP_E_NOMEM, "%s: out of memory", ix->path);
  for (size_t i = 0; i < ix->n_map; i++)
    ix->shards[ix->n_shards++] = ix->map[i].shard;
  qsort(ix->shards, ix->n_shards, sizeof *ix->shards, by_string);
  size_t distinct = 0;
  for (size_t i = 0; i < ix->n_shards; i++)
    if (distinct == 0 || strcmp(ix->shards[distinct - 1], ix->shards[i]) != 0)
      ix->shards[distinct++] = ix->shards[i];
  ix->n_shards = distinct;
  return 0;
}

static int open_shards(struct ckpt *c, const struct index *ix) {
  size_t cap = 0;
  for (size_t i = 0; i < ix->n_shards; i++) {
    char *path = join_path(c->dir, ix->shards[i]);
    if (!path)
      return set_error(QKEEP_E_NOMEM, "%s: out of memory", ix->path);
    struct st_file *f;
    int rc = check_link(c, path);
    if (!rc)
      rc = st_open(path, &f);
    free(path);
    if (rc != 0)
      return add_error_context(rc, "%s: shard '%s'", ix->path, ix->shards[i]);
    if ((rc = add_file(c, f, &cap)) != 0)
      return rc;
  }
  return 0;
}

/* The index of a shard name in ix->shards (and c->files). */
static size_t shard_index(const struct index *ix, const char *shard) {
  const char **hit = bsearch(&shard, ix->shards, ix->n_shards, sizeof *ix->shards, by_string);
  assert(hit);
  return (size_t)(hit - ix->shards);
}

/*
 * The index and the shards must describe the same tensors: every mapped
 * tensor in the shard the map names, and every shard tensor in the map under
 * its own shard. Together these make the table a bijection with the map.
 */
static int build_table(struct ckpt *c, const struct index *ix) {
  for (size_t i = 0; i < ix->n_map; i++) {
    const struct mapped *e = &ix->map[i];
    if (!st_find(c->files[shard_index(ix, e->shard)], e->tensor))
      return set_error(QKEEP_E_FORMAT,
                       "%s: weight_map puts tensor '%s' in shard '%s', which does not contain it", ix->path,
                       e->tensor, e->shard);
  }
  size_t total = ix->n_map;
  if (!(c->tensors = calloc(total, sizeof *c->tensors)))
    return set_error(QKEEP_E_NOMEM, "%s: out of memory for %zu tensors", ix->path, total);
  for (size_t i = 0; i < c->n_files; i++) {
    const struct st_file *f = c->files[i];
    for (size_t j = 0; j < f->n_tensors; j++) {
      const struct st_tensor *t = &f->tensors[j];
      size_t at;
      if (!name_index_get(&ix->by_tensor, t->name, &at))
        return set_error(QKEEP_E_FORMAT, "%s: tensor '%s' of shard '%s' is missing from the weight_map",
                         ix->path, t->name, ix->shards[i]);
      if (strcmp(ix->map[at].shard, ix->shards[i]) != 0)
        return set_error(QKEEP_E_FORMAT, "%s: tensor '%s' is in two shards, '%s' (as mapped) and '%s'",
                         ix->path, t->name, ix->map[at].shard, ix->shards[i]);
      assert(c->n_tensors < total);
      c->tensors[c->n_tensors++] = (struct ckpt_tensor){.t = t, .file = f};
    }
  }
  assert(c->n_tensors == total);
  qsort(c->tensors, c->n_tensors, sizeof *c->tensors, by_tensor_name);
  int rc = name_index_reserve(&c->index, c->n_tensors);
  for (size_t i = 0; i < c->n_tensors && !rc; i++)
    rc = name_index_put(&c->index, c->tensors[i].t->name, i, NULL);
  assert(rc != QKEEP_E_EXISTS); /* each tensor is in one shard, checked above */
  return rc ? add_error_context(rc, "%s", ix->path) : 0;
}

static int open_index(struct ckpt *c, const char *index_path) {
  struct index ix = {.path = index_path};
  int rc = read_index(&ix);
  if (rc == 0)
    rc = open_shards(c, &ix);
  if (rc == 0)
    rc = build_table(c, &ix);
  index_free(&ix);
  return rc;
}

/* ---- directories ------------------------------------------------------------------------ */

int ckpt_read_config(const struct ckpt *c, char **out) {
  *out = NULL;
  char *path = join_path(c->dir, CONFIG_NAME);
  if (!path)
    return set_error(QKEEP_E_NOMEM, "%s: out of memory", c->dir);
  int rc = read_dir_text(c, path, CONFIG_MAX_BYTES, true, out);
  free(path);
  return rc;
}

/* Reads config.json and hf_quant_config.json when present and parses the quantization they declare. */
static int read_configs(struct ckpt *c) {
  char *cfg_path = join_path(c->dir, CONFIG_NAME), *hf_path = join_path(c->dir, HF_QUANT_NAME);
  char *cfg = NULL, *hf = NULL;
  int rc = 0;
  if (!cfg_path || !hf_path)
    rc = set_error(QKEEP_E_NOMEM, "%s: out of memory", c->dir);
  if (rc == 0)
    rc = read_dir_text(c, cfg_path, CONFIG_MAX_BYTES, true, &cfg);
  if (rc == 0)
    rc = read_dir_text(c, hf_path, CONFIG_MAX_BYTES, true, &hf);
  if (rc == 0)
    rc = quant_config_parse(cfg, hf, c->dir, &c->qc);
  /* GPTQ and AWQ exports that predate config.json's quantization_config keep it in a file of their own. */
  static const char *const standalone[] = {"quantize_config.json", "quant_config.json"};
  for (size_t i = 0; rc == 0 && c->qc.method == QM_NONE && i < 2; i++) {
    char *path = join_path(c->dir, standalone[i]), *text = NULL;
    rc = path ? read_dir_text(c, path, CONFIG_MAX_BYTES, true, &text)
              : set_error(QKEEP_E_NOMEM, "out of memory");
    if (rc == 0 && text)
      rc = quant_config_parse_standalone(text, c->dir, standalone[i], &c->qc);
    free(text);
    free(path);
  }
  free(cfg);
  free(hf);
  free(cfg_path);
  free(hf_path);
  return rc;
}

static bool is_safetensors_name(const char *name) {
  size_t n = strlen(name), ext = strlen(".safetensors");
  return name[0] != '.' && n > ext && strcmp(name + n - ext, ".safetensors") == 0;
}

/*
 * With neither an index nor model.safetensors, the directory's one *.safetensors file (AutoGPTQ
 * writes gptq_model-4bit-128g.safetensors; vLLM globs *.safetensors). Hidden files are not
 * candidates, as Python's glob skips them. Several candidates without an index are refused:
 * which ones belong to the model is not written anywhere, and a stale shard next to the right
 * file would load silently.
 */
static int open_only_file(struct ckpt *c) {
  DIR *d = opendir(c->dir);
  if (!d)
    return set_error(error_from_errno(errno), "%s: cannot list the directory: %s", c->dir, strerror(errno));
  char *first = NULL, *second = NULL;
  size_t count = 0;
  int rc = 0;
  const struct dirent *e;
  while (!rc && (e = readdir(d)) != NULL) {
    if (!is_safetensors_name(e->d_name))
      continue;
    count++;
    char **slot = !first ? &first : !second ? &second : NULL;
    if (slot && !(*slot = xstrdup(e->d_name)))
      rc = set_error(QKEEP_E_NOMEM, "%s: out of memory", c->dir);
  }
  closedir(d);
  if (!rc && count == 0)
    rc = set_error(QKEEP_E_NOTFOUND, "%s: no %s, %s or other *.safetensors file in the directory", c->dir,
                   INDEX_NAME, SINGLE_NAME);
  else if (!rc && count > 1) {
    bool ordered = strcmp(first, second) < 0;
    rc = set_error(QKEEP_E_FORMAT,
                   "%s: %zu *.safetensors files ('%s', '%s'%s) but no %s or %s: which of them hold the "
                   "model is ambiguous; add the index, or keep only the model's file",
                   c->dir, count, ordered ? first : second, ordered ? second : first,
                   count > 2 ? ", ..." : "", INDEX_NAME, SINGLE_NAME);
  } else if (!rc) {
    char *path = join_path(c->dir, first);
    rc = path ? check_link(c, path) : set_error(QKEEP_E_NOMEM, "%s: out of memory", c->dir);
    if (!rc)
      rc = open_single(c, path);
    free(path);
  }
  free(first);
  free(second);
  return rc;
}

/* Opens the index when there is one, else model.safetensors, else the directory's only *.safetensors. */
static int open_weights(struct ckpt *c, const char *index, const char *single) {
  int rc = exists(index);
  if (rc != 0)
    return rc < 0 ? rc : (rc = check_link(c, index)) != 0 ? rc : open_index(c, index);
  if ((rc = exists(single)) != 0)
    return rc < 0 ? rc : (rc = check_link(c, single)) != 0 ? rc : open_single(c, single);
  return open_only_file(c);
}

/* The configs first (cheap, and a bad one should not cost opening every shard), then the weights. */
static int open_dir(struct ckpt *c) {
  if (!(c->dir = dir_clean(c->path)))
    return set_error(QKEEP_E_NOMEM, "%s: out of memory", c->path);
  int rc = read_configs(c);
  if (rc != 0)
    return rc;
  char *index = join_path(c->dir, INDEX_NAME), *single = join_path(c->dir, SINGLE_NAME);
  if (!index || !single)
    rc = set_error(QKEEP_E_NOMEM, "%s: out of memory", c->dir);
  else
    rc = open_weights(c, index, single);
  free(index);
  free(single);
  return rc;
}

/* ---- public ------------------------------------------------------------------------------ */

/*
 * Opens a checkpoint (see checkpoint.h). On failure *out is NULL, nothing is
 * left open, and the message names the file and tensor: QKEEP_E_NOTFOUND (a
 * path or shard that does not exist, a directory without weights),
 * QKEEP_E_FORMAT (a malformed or inconsistent file), QKEEP_E_UNSUPPORTED (a
 * quantization qkeep cannot load), QKEEP_E_IO, QKEEP_E_NOMEM.
 */
static int ckpt_open_at(const char *path, const struct stat *st, struct ckpt **out);

/*
 * A Hugging Face hub cache repository (models--ORG--NAME: refs/main holding a revision, and
 * snapshots/<revision>/) resolves to the snapshot refs/main names, as the hub's own tools read it:
 * *snapshot is that path (malloc'd), or NULL when dir is not such a repository.
 */
static int hub_snapshot(const char *dir, char **snapshot) {
  *snapshot = NULL;
  char *refs = NULL, *snapshots = NULL;
  struct stat st;
  int rc = 0;
  if (qk_asprintf(&refs, "%s/refs/main", dir) < 0 || qk_asprintf(&snapshots, "%s/snapshots", dir) < 0)
    rc = set_error(QKEEP_E_NOMEM, "%s: out of memory", dir);
  bool hub =
      !rc && stat(refs, &st) == 0 && S_ISREG(st.st_mode) && stat(snapshots, &st) == 0 && S_ISDIR(st.st_mode);
  FILE *f = hub ? fopen(refs, "re") : NULL;
  if (hub && !f)
    rc = set_error(error_from_errno(errno), "%s: cannot read: %s", refs, strerror(errno));
  if (f) {
    char rev[256] = "";
    size_t n = fread(rev, 1, sizeof rev - 1, f);
    fclose(f);
    while (n > 0 && (rev[n - 1] == '\n' || rev[n - 1] == '\r' || rev[n - 1] == ' '))
      n--;
    rev[n] = '\0';
    /* a commit hash (40 or 64 hex digits), nothing that could walk out of snapshots/ */
    bool valid = n > 0 && n < sizeof rev - 1 && strspn(rev, "0123456789abcdefABCDEF") == n;
    if (!valid)
      rc = set_error(QKEEP_E_FORMAT, "%s: '%s' is not a revision (a commit hash)", refs, rev);
    else if (qk_asprintf(snapshot, "%s/%s", snapshots, rev) < 0)
      rc = set_error(QKEEP_E_NOMEM, "%s: out of memory", dir);
    else if (stat(*snapshot, &st) != 0 || !S_ISDIR(st.st_mode))
      rc = set_error(QKEEP_E_NOTFOUND, "%s: refs/main names revision %s, but snapshots/%s is absent", dir,
                     rev, rev);
    if (rc) {
      free(*snapshot);
      *snapshot = NULL;
    }
  }
  free(refs);
  free(snapshots);
  return rc;
}

int ckpt_open(const char *path, struct ckpt **out) {
  assert(out);
  *out = NULL;
  if (!path)
    return set_error(QKEEP_E_INVAL, "ckpt_open: no path given");
  struct stat st;
  if (stat(path, &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR)
      return set_error(QKEEP_E_NOTFOUND, "%s: no such file or directory", path);
    return set_error(error_from_errno(errno), "%s: cannot stat: %s", path, strerror(errno));
  }
  char *snapshot = NULL;
  if (S_ISDIR(st.st_mode)) {
    int rc = hub_snapshot(path, &snapshot);
    if (rc)
      return rc;
    if (snapshot && stat(snapshot, &st) != 0) {
      free(snapshot);
      return set_error(error_from_errno(errno), "%s: cannot stat: %s", path, strerror(errno));
    }
  }
  int opened = ckpt_open_at(snapshot ? snapshot : path, &st, out);
  free(snapshot);
  return opened;
}

/* ckpt_open on a path whose stat is st. */
static int ckpt_open_at(const char *path, const struct stat *stp, struct ckpt **out) {
  struct stat st = *stp;
  struct ckpt *c = calloc(1, sizeof *c);
  if (!c)
    return set_error(QKEEP_E_NOMEM, "%s: out of memory", path);
  c->qc = (struct quant_config){.method = QM_NONE, .scheme = "unquantized"};
  int rc = 0;
  if (!(c->path = xstrdup(path)))
    rc = set_error(QKEEP_E_NOMEM, "%s: out of memory", path);
  else if (S_ISDIR(st.st_mode))
    rc = open_dir(c);
  else if (!S_ISREG(st.st_mode))
    rc = set_error(QKEEP_E_IO, "%s: neither a regular file nor a directory", path);
  else if (!(c->dir = dir_of(path)))
    rc = set_error(QKEEP_E_NOMEM, "%s: out of memory", path);
  else
    rc = open_single(c, path);
  if (rc != 0) {
    ckpt_close(c);
    return rc;
  }
  quant_config_budget_for(&c->qc, c->n_tensors);
  *out = c;
  return 0;
}

/* Closes every shard and frees the checkpoint; NULL is a no-op. */
void ckpt_close(struct ckpt *c) {
  if (!c)
    return;
  for (size_t i = 0; i < c->n_files; i++)
    st_close(c->files[i]);
  free(c->files);
  free(c->tensors);
  name_index_clear(&c->index);
  quant_config_free(&c->qc);
  free(c->path);
  free(c->dir);
  free(c);
}

/*
 * The tensor of that full name, or NULL. One file: its own index, whose
 * positions are the table's (open_single copies the file's sorted table in
 * order); sharded: the checkpoint's index.
 */
const struct ckpt_tensor *ckpt_find(const struct ckpt *c, const char *name) {
  if (!c || !name || c->n_tensors == 0)
    return NULL;
  size_t at;
  if (c->n_files == 1) {
    const struct st_tensor *t = st_find(c->files[0], name);
    return t ? &c->tensors[t - c->files[0]->tensors] : NULL;
  }
  return name_index_get(&c->index, name, &at) ? &c->tensors[at] : NULL;
}

/* Reads one tensor's bytes with pread; QKEEP_E_IO names the shard and tensor when the file changed. */
int ckpt_read(const struct ckpt *c, const struct ckpt_tensor *t, void *dst) {
  assert(c && t);
  (void)c;
  return st_read(t->file, t->t, dst);
}

int ckpt_read_range(const struct ckpt *c, const struct ckpt_tensor *t, size_t offset, size_t n, void *dst) {
  assert(c && t);
  (void)c;
  return st_read_range(t->file, t->t, offset, n, dst);
}

/* One shard's part of a batch at a time (a batch is one layer's tensors: one shard, or a few). */
int ckpt_read_many(const struct ckpt *c, const struct ckpt_tensor *const *ts, void *const *dsts, size_t n) {
  assert(c);
  (void)c;
  const struct st_tensor **part = malloc((n ? n : 1) * sizeof *part);
  void **part_dst = malloc((n ? n : 1) * sizeof *part_dst);
  bool *done = calloc(n ? n : 1, sizeof *done);
  int rc = part && part_dst && done ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
  for (size_t i = 0; i < n && !rc; i++) {
    if (done[i])
      continue;
    size_t m = 0;
    for (size_t j = i; j < n; j++)
      if (!done[j] && ts[j]->file == ts[i]->file) {
        part[m] = ts[j]->t;
        part_dst[m++] = dsts[j];
        done[j] = true;
      }
    rc = st_read_many(ts[i]->file, part, part_dst, m);
  }
  free(part);
  free(part_dst);
  free(done);
  return rc;
}

/* ---- a checkpoint described, not read ------------------------------------------------------- */

static int by_st_name(const void *a, const void *b) {
  return strcmp(((const struct st_tensor *)a)->name, ((const struct st_tensor *)b)->name);
}

int ckpt_describe(const char *path, const char *dir, const char *const *names, const struct qkeep_spec *specs,
                  size_t n, const char *config_json, const char *hf_quant_json, struct ckpt **out) {
  *out = NULL;
  struct ckpt *c = calloc(1, sizeof *c);
  struct st_file *f = calloc(1, sizeof *f);
  int rc = c && f ? 0 : set_error(QKEEP_E_NOMEM, "out of memory");
  if (!rc) {
    c->qc = (struct quant_config){.method = QM_NONE, .scheme = "unquantized"};
    f->fd = -1; /* nothing to read: ckpt_read fails on it */
    c->path = xstrdup(path), c->dir = xstrdup(dir), f->path = xstrdup(path);
    f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
    c->tensors = calloc(n ? n : 1, sizeof *c->tensors);
    c->files = calloc(1, sizeof *c->files);
    if (!c->path || !c->dir || !f->path || !f->tensors || !c->tensors || !c->files)
      rc = set_error(QKEEP_E_NOMEM, "out of memory");
  }
  for (size_t i = 0; i < n && !rc; i++) {
    struct st_tensor *t = &f->tensors[i];
    if (!(t->name = xstrdup(names[i]))) {
      rc = set_error(QKEEP_E_NOMEM, "out of memory");
      break;
    }
    f->n_tensors++;
    snprintf(t->dtype_name, sizeof t->dtype_name, "%s", qkeep_dtype_name(specs[i].dtype));
    t->dtype = (int)specs[i].dtype;
    t->ndim = specs[i].ndim;
    memcpy(t->shape, specs[i].shape, sizeof t->shape);
    t->nbytes = qkeep_spec_bytes(&specs[i]);
  }
  if (!rc && n > 1)
    qsort(f->tensors, n, sizeof *f->tensors, by_st_name);
  if (!rc)
    rc = name_index_reserve(&f->index, n);
  for (size_t i = 0; i < n && !rc; i++)
    if ((rc = name_index_put(&f->index, f->tensors[i].name, i, NULL)) == QKEEP_E_EXISTS)
      rc = set_error(QKEEP_E_FORMAT, "%s: tensor '%s' twice", path, f->tensors[i].name);
  if (!rc) {
    c->files[c->n_files++] = f;
    f = NULL;
    for (size_t i = 0; i < n; i++)
      c->tensors[i] = (struct ckpt_tensor){.t = &c->files[0]->tensors[i], .file = c->files[0]};
    c->n_tensors = n;
    rc = quant_config_parse(config_json, hf_quant_json, dir, &c->qc);
  }
  if (f)
    st_close(f);
  if (rc) {
    ckpt_close(c);
    return rc;
  }
  quant_config_budget_for(&c->qc, c->n_tensors);
  *out = c;
  return 0;
}
