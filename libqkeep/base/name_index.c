/*
 * name_index.c: the core's hash table from a name to a position in the
 * caller's array (see base/base.h).
 *
 * Why not uthash or hsearch_r: uthash links its elements by address (each
 * element embeds prev/next pointers), but the core's tables are arrays that
 * grow by realloc (names, sources, tensors), so every pointer would go stale
 * on growth; and its 56-byte handle per element is a third of the budget a
 * 10^6-tensor header may take in memory. glibc's hsearch_r has a fixed size
 * chosen at creation and no way to look up a name that is not NUL-terminated
 * (a dot-bounded part of a module name). Here a slot is 16 bytes (the borrowed
 * name, 32 bits of its XXH3 hash, the value), the table is linear-probed and
 * at most three quarters full, so a lookup is O(1) expected and a miss costs
 * a probe or two, almost never a string comparison.
 *
 * Hash flooding: the names come from files someone else wrote (a checkpoint's
 * tensor names). With a fixed hash, names chosen to share their low bits all
 * land in one run of slots, and every insertion walks the whole run: 100k such
 * names took 55 s against 1.2 s. So each index hashes with a seed of its own,
 * derived from a per-process secret (getrandom) and a counter, which a file
 * cannot know; and no name sits more than PROBE_LIMIT slots from its home: an
 * insertion that would go further rebuilds the table with a new seed (and twice
 * the slots), so a lookup never probes more than the longest displacement the
 * table holds. Nothing depends on the seed but the slots' order, and no caller
 * walks the slots: digests, errors and orders come from the callers' arrays.
 */
#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "base/base.h"

#define MIN_SLOTS 16
#define PROBE_LIMIT 64

static uint64_t process_secret;
static pthread_once_t secret_once = PTHREAD_ONCE_INIT;
static atomic_uint_fast64_t seeds_made;

static void make_secret(void) {
  uint64_t secret = 0;
  if (getrandom(&secret, sizeof secret, GRND_NONBLOCK) != (ssize_t)sizeof secret) {
    /* no entropy yet (early boot): what differs between processes and runs */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t mix[4] = {(uint64_t)ts.tv_sec, (uint64_t)ts.tv_nsec, (uint64_t)getpid(),
                       (uint64_t)(uintptr_t)&mix};
    secret = XXH3_64bits(mix, sizeof mix);
  }
  process_secret = secret;
}

/* A seed no other index of this process has, and no file can predict. */
static uint64_t new_seed(void) {
  pthread_once(&secret_once, make_secret);
  uint64_t n = atomic_fetch_add(&seeds_made, 1);
  return XXH3_64bits_withSeed(&n, sizeof n, process_secret);
}

uint64_t name_index_seed(const struct name_index *ix) { return ix->seed; }

static uint32_t hash_name(const struct name_index *ix, const char *name, size_t len) {
  return (uint32_t)XXH3_64bits_withSeed(name, len, ix->seed);
}

/* True when slot s holds exactly the len bytes of name. */
static bool slot_is(const struct name_slot *s, uint32_t hash, const char *name, size_t len) {
  return s->hash == hash && strncmp(s->name, name, len) == 0 && s->name[len] == '\0';
}

/* How far slot `at` lies from the home of hash h, in a table of cap slots. */
static size_t displacement(uint32_t h, size_t at, size_t cap) { return (at - (h & (cap - 1))) & (cap - 1); }

/* Places every slot of the table into `slots` (cap of them, empty) under ix->seed; false when one would
 * sit more than `limit` slots from its home. *longest gets the longest displacement. */
static bool place_all(const struct name_index *ix, struct name_slot *slots, size_t cap, size_t limit,
                      size_t *longest) {
  *longest = 0;
  for (size_t i = 0; i < ix->cap; i++) {
    const struct name_slot *s = &ix->slots[i];
    if (!s->name)
      continue;
    uint32_t h = hash_name(ix, s->name, strlen(s->name));
    size_t at = h & (cap - 1), d = 0;
    for (; slots[at].name; at = (at + 1) & (cap - 1))
      d++;
    if (d > limit)
      return false;
    if (d > *longest)
      *longest = d;
    slots[at] = (struct name_slot){s->name, h, s->value};
  }
  return true;
}

/* Rebuilds the table with `cap` slots (a power of two) under a new seed, with other seeds and more
 * slots while some name would sit past PROBE_LIMIT. A few tries at most: no file can aim at a seed it
 * does not know; after them every name is kept, however far (lookups probe as far as the longest). */
static int rehash(struct name_index *ix, size_t cap) {
  uint64_t old_seed = ix->seed;
  for (int attempt = 0;; attempt++) {
    struct name_slot *slots = calloc(cap, sizeof *slots);
    if (!slots) {
      ix->seed = old_seed;
      return set_error(QKEEP_E_NOMEM, "out of memory for a name index of %zu slots", cap);
    }
    ix->seed = new_seed();
    size_t longest;
    if (place_all(ix, slots, cap, attempt < 8 ? PROBE_LIMIT : SIZE_MAX, &longest)) {
      free(ix->slots);
      ix->slots = slots;
      ix->cap = cap;
      ix->longest = longest;
      return 0;
    }
    free(slots);
    if (attempt % 2 == 1 && cap <= SIZE_MAX / 4 / sizeof *slots)
      cap *= 2;
  }
}

int name_index_reserve(struct name_index *ix, size_t n) {
  if (n > UINT32_MAX)
    return set_error(QKEEP_E_NOMEM, "a name index holds at most %u names, not %zu", UINT32_MAX, n);
  size_t cap = ix->cap ? ix->cap : MIN_SLOTS;
  while (n > cap / 4 * 3)
    cap *= 2;
  return cap == ix->cap ? 0 : rehash(ix, cap);
}

int name_index_put(struct name_index *ix, const char *name, size_t value, size_t *existing) {
  assert(name);
  if (value > UINT32_MAX)
    return set_error(QKEEP_E_NOMEM, "a name index holds values below 2^32, not %zu", value);
  int rc = name_index_reserve(ix, ix->count + 1);
  if (rc)
    return rc;
  size_t len = strlen(name);
  for (;;) {
    uint32_t hash = hash_name(ix, name, len);
    size_t at = hash & (ix->cap - 1), d = 0, limit = ix->longest > PROBE_LIMIT ? ix->longest : PROBE_LIMIT;
    for (; ix->slots[at].name && d <= limit; at = (at + 1) & (ix->cap - 1), d++)
      if (d <= ix->longest && slot_is(&ix->slots[at], hash, name, len)) {
        if (existing)
          *existing = ix->slots[at].value;
        return QKEEP_E_EXISTS; /* no detail: the caller knows what the name is and says so */
      }
    if (ix->slots[at].name || d > limit) { /* a run past the limit: another seed, twice the slots */
      if ((rc = rehash(ix, ix->cap * 2)) != 0)
        return rc;
      continue;
    }
    ix->slots[at] = (struct name_slot){name, hash, (uint32_t)value};
    if (d > ix->longest)
      ix->longest = d;
    ix->count++;
    return 0;
  }
}

/* The slot holding the len bytes of name, or NULL: at most ix->longest + 1 probes. */
static struct name_slot *slot_of(const struct name_index *ix, const char *name, size_t len) {
  if (!ix->count)
    return NULL;
  uint32_t hash = hash_name(ix, name, len);
  size_t at = hash & (ix->cap - 1);
  for (size_t d = 0; d <= ix->longest && ix->slots[at].name; d++, at = (at + 1) & (ix->cap - 1))
    if (slot_is(&ix->slots[at], hash, name, len))
      return &ix->slots[at];
  return NULL;
}

int name_index_set(struct name_index *ix, const char *name, size_t value) {
  if (value > UINT32_MAX)
    return set_error(QKEEP_E_NOMEM, "a name index holds values below 2^32, not %zu", value);
  struct name_slot *s = slot_of(ix, name, strlen(name));
  if (s) {
    s->value = (uint32_t)value; /* present: no growth */
    return 0;
  }
  return name_index_put(ix, name, value, NULL);
}

bool name_index_find(const struct name_index *ix, const char *name, size_t len, size_t *value) {
  const struct name_slot *s = slot_of(ix, name, len);
  if (s)
    *value = s->value;
  return s != NULL;
}

bool name_index_get(const struct name_index *ix, const char *name, size_t *value) {
  return name_index_find(ix, name, strlen(name), value);
}

size_t name_index_longest_probe(const struct name_index *ix) {
  size_t longest = 0;
  for (size_t i = 0; i < ix->cap; i++)
    if (ix->slots[i].name && displacement(ix->slots[i].hash, i, ix->cap) > longest)
      longest = displacement(ix->slots[i].hash, i, ix->cap);
  return longest;
}

void name_index_clear(struct name_index *ix) {
  free(ix->slots);
  *ix = (struct name_index){0};
}
