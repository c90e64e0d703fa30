/*
 * fuzz_replay.c: a plain main() for a libFuzzer target, for builds without
 * -fsanitize=fuzzer: runs LLVMFuzzerTestOneInput once on each file named (a
 * directory: on each file in it, in name order), as libFuzzer would on a
 * corpus. A target reports a defect by aborting, so the exit status is 0
 * exactly when every input ran.
 *
 *   fuzz_X_replay FILE|DIR...
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    perror(path);
    return 1;
  }
  size_t cap = 1 << 16, n = 0;
  uint8_t *buf = malloc(cap);
  size_t got;
  while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
    n += got;
    if (n == cap) {
      uint8_t *grown = realloc(buf, cap *= 2);
      if (!grown)
        free(buf);
      buf = grown;
    }
  }
  fclose(f);
  if (!buf) {
    fprintf(stderr, "%s: out of memory\n", path);
    return 1;
  }
  LLVMFuzzerTestOneInput(buf, n);
  free(buf);
  return 0;
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int run_dir(const char *path, size_t *count) {
  DIR *d = opendir(path);
  if (!d) {
    perror(path);
    return 1;
  }
  char **names = NULL;
  size_t n = 0, cap = 0;
  const struct dirent *e;
  int rc = 0;
  while (!rc && (e = readdir(d))) {
    if (e->d_name[0] == '.')
      continue;
    if (n == cap) {
      char **grown = realloc(names, (cap = cap ? 2 * cap : 16) * sizeof *names);
      if (!grown) {
        rc = 1;
        break;
      }
      names = grown;
    }
    size_t len = strlen(path) + strlen(e->d_name) + 2;
    if (!(names[n] = malloc(len))) {
      rc = 1;
      break;
    }
    snprintf(names[n++], len, "%s/%s", path, e->d_name);
  }
  closedir(d);
  if (n)
    qsort(names, n, sizeof *names, by_name);
  for (size_t i = 0; i < n; i++) {
    if (!rc && !(rc = run_file(names[i])))
      ++*count;
    free(names[i]);
  }
  free(names);
  return rc;
}

int main(int argc, char **argv) {
  size_t count = 0;
  int rc = 0;
  for (int i = 1; i < argc && !rc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      perror(argv[i]);
      return 1;
    }
    if (S_ISDIR(st.st_mode))
      rc = run_dir(argv[i], &count);
    else if (!(rc = run_file(argv[i])))
      count++;
  }
  printf("%s: %zu inputs replayed\n", argv[0], count);
  return rc;
}
