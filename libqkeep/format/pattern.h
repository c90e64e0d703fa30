/*
 * format/pattern.h: the one regex engine for the patterns a checkpoint supplies (compressed-tensors'
 * "re:" ignore entries, GPTQModel's `dynamic` rules). PCRE2, whose syntax is close to Python's re (what
 * the exporters use), compiled once per pattern, with three limits:
 *
 * - per match: PATTERN_MATCH_LIMIT backtracking steps, a nesting depth and a heap limit, so that one
 *   pattern that backtracks catastrophically fails within milliseconds, naming itself and the module;
 * - per load: a budget of steps shared by every match of one quantization config (one load or reload),
 *   PATTERN_BUDGET_BASE plus PATTERN_BUDGET_PER_TENSOR for each tensor of the checkpoint, so that many
 *   patterns each just under the per-match limit cannot add up to minutes either. The regex work of a
 *   load is thus linear in the checkpoint's size, whatever the config holds;
 * - per pattern: PATTERN_MAX_LENGTH bytes.
 *
 * A match is charged the steps it may have taken: it runs first with a small limit and only a match
 * that needs more runs again with a 16 times larger one, and so on up to the per-match limit, each run
 * charged its limit (an ordinary match costs PATTERN_FIRST_RUNG; a hostile one about 1.07 times the
 * steps it really took).
 */
#ifndef QKEEP_PATTERN_H
#define QKEEP_PATTERN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PATTERN_MATCH_LIMIT 1048576u
#define PATTERN_DEPTH_LIMIT 10000u
#define PATTERN_HEAP_LIMIT_KIB 16384u
#define PATTERN_FIRST_RUNG 256u
#define PATTERN_MAX_LENGTH 65536u
#define PATTERN_BUDGET_BASE ((uint64_t)64 << 20)
#define PATTERN_BUDGET_PER_TENSOR 4096u

struct pattern_engine;
struct pattern;

/* A new engine with the base budget. QKEEP_E_NOMEM (with a detail). */
int pattern_engine_new(struct pattern_engine **out);
/* Frees the engine (NULL is fine). Patterns compiled with it are freed by the caller first. */
void pattern_engine_free(struct pattern_engine *e);
/* Sets the budget for a checkpoint of n_tensors tensors (base + per tensor), whatever was spent. */
void pattern_engine_budget_for(struct pattern_engine *e, size_t n_tensors);
/* Steps charged so far (tests, benches). */
uint64_t pattern_engine_spent(const struct pattern_engine *e);

/*
 * Compiles `pattern` (UTF-8, Unicode classes, as Python's str patterns are) into *out. A pattern
 * that does not compile or is longer than PATTERN_MAX_LENGTH is QKEEP_E_FORMAT with the reason in
 * `why` and no error detail set (the caller names the key); QKEEP_E_NOMEM.
 */
int pattern_compile(const char *pattern, struct pattern **out, char *why, size_t why_len);
void pattern_free(struct pattern *p);

/*
 * Python's re.match(pattern, subject): *hit when the pattern matches a prefix of subject (anchored
 * at its start, free at its end). `what` names the pattern for an error ("FILE: KEY: ignore entry
 * 're:X'"). When the per-match limits or the load's budget run out: QKEEP_E_FORMAT naming `what`,
 * the subject and the limit; QKEEP_E_NOMEM. Not for concurrent use on one engine.
 */
int pattern_match(struct pattern_engine *e, const struct pattern *p, const char *subject, const char *what,
                  bool *hit);

#endif
