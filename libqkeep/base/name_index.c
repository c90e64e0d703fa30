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
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "base/base.h"

#define MIN_SLOTS 16

static uint32_t hash_name(const char *name, size_t len) { return (uint32_t)XXH3_64bits(name, len); }

/* True when slot s holds exactly the len bytes of name. */
static bool slot_is(const struct name_slot *s, uint32_t hash, const char *name, size_t len) {
  return s->hash == hash && strncmp(s->name, name, len) == 0 && s->name[len] == '\0';
}

/* Rehashes every slot into a table of `cap` slots (a power of two). */
static int rehash(struct name_index *ix, size_t cap) {
  struct name_slot *slots = calloc(cap, sizeof *slots);
  if (!slots)
    return set_error(QKEEP_E_NOMEM, "out of memory for a name index of %zu slots", cap);
  for (size_t i = 0; i < ix->cap; i++) {
    const struct name_slot *s = &ix->slots[i];
    if (!s->name)
      continue;
    size_t at = s->hash & (cap - 1);
    while (slots[at].name)
      at = (at + 1) & (cap - 1);
    slots[at] = *s;
  }
  free(ix->slots);
  ix->slots = slots;
  ix->cap = cap;
  return 0;
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
  uint32_t hash = hash_name(name, len);
  size_t at = hash & (ix->cap - 1);
  for (; ix->slots[at].name; at = (at + 1) & (ix->cap - 1))
    if (slot_is(&ix->slots[at], hash, name, len)) {
      if (existing)
        *existing = ix->slots[at].value;
      return QKEEP_E_EXISTS; /* no detail: the caller knows what the name is and says so */
    }
  ix->slots[at] = (struct name_slot){name, hash, (uint32_t)value};
  ix->count++;
  return 0;
}

int name_index_set(struct name_index *ix, const char *name, size_t value) {
  if (value > UINT32_MAX)
    return set_error(QKEEP_E_NOMEM, "a name index holds values below 2^32, not %zu", value);
  size_t len = strlen(name);
  uint32_t hash = hash_name(name, len);
  for (size_t at = hash & (ix->cap - 1); ix->count && ix->slots[at].name; at = (at + 1) & (ix->cap - 1))
    if (slot_is(&ix->slots[at], hash, name, len)) {
      ix->slots[at].value = (uint32_t)value; /* present: no growth */
      return 0;
    }
  return name_index_put(ix, name, value, NULL);
}

bool name_index_find(const struct name_index *ix, const char *name, size_t len, size_t *value) {
  if (!ix->count)
    return false;
  uint32_t hash = hash_name(name, len);
  for (size_t at = hash & (ix->cap - 1); ix->slots[at].name; at = (at + 1) & (ix->cap - 1))
    if (slot_is(&ix->slots[at], hash, name, len)) {
      *value = ix->slots[at].value;
      return true;
    }
  return false;
}

bool name_index_get(const struct name_index *ix, const char *name, size_t *value) {
  return name_index_find(ix, name, strlen(name), value);
}

void name_index_clear(struct name_index *ix) {
  free(ix->slots);
  *ix = (struct name_index){0};
}
