/*
 * jsonget.c: reads standard input as exactly one JSON document (trailing text, a second
 * document or none is an error, exit 1) and prints the value at a path of object keys and
 * array indices given as arguments: strings bare, other values as compact JSON. With no
 * path it only checks the document. For tests/cli.sh, which must not depend on python or jq.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
  json_error_t err;
  json_t *doc = json_loadf(stdin, 0, &err); /* 0: anything after the document is an error */
  if (!doc) {
    fprintf(stderr, "jsonget: not one JSON document: %s (line %d)\n", err.text, err.line);
    return 1;
  }
  json_t *v = doc;
  for (int i = 1; i < argc && v; i++) {
    char *end;
    long index = strtol(argv[i], &end, 10);
    v = json_is_array(v) && !*end ? json_array_get(v, (size_t)index) : json_object_get(v, argv[i]);
  }
  if (!v) {
    fprintf(stderr, "jsonget: no such path\n");
    json_decref(doc);
    return 1;
  }
  if (argc > 1) {
    if (json_is_string(v)) {
      puts(json_string_value(v));
    } else {
      char *text = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
      puts(text ? text : "");
      free(text);
    }
  }
  json_decref(doc);
  return 0;
}
