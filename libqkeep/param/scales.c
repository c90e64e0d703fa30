/*
 * scales.c: what a valid scale value is, and the one check of scale values that every path
 * runs: a cold start as the bytes are read or staged (device/stream.c, load/load.c, load/slice.c), a reload's
 * validation of W1 before anything changes (reload/reload.c), a weight sync's check of each bucket
 * (reload/sync.c). The check always reads host memory, before the bytes reach a device: bytes that
 * live in device memory (a sync's bucket) come to the host once, and that copy is what is
 * checked, and what fills a small param's host mirror (reload/reload.c).
 */
#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "base/numeric.h"
#include "param/param.h"

/* Why a finite, non-negative value breaks the kernels' arithmetic (struct scale_rule). */
static const char reciprocal_overflows[] = "its reciprocal overflows float";
static const char product_overflows[] = "its decode factor times the largest code overflows float";

/* What a scale param's values must be, for messages. */
static const char *scale_rule_text(const struct scale_rule *rule, char *buf, size_t len) {
  if (rule->positive || rule->inverted)
    snprintf(buf, len, "%s must be finite and positive, with a finite reciprocal",
             rule->positive ? "a static activation scale" : "a global scale stored as an encode factor");
  else
    snprintf(buf, len, "scales must be finite and non-negative");
  if (rule->code_max > 0) {
    size_t at = strlen(buf);
    snprintf(buf + at, len - at, ", and %s times the largest code (%g) finite",
             rule->inverted ? "the reciprocal" : "the value", (double)rule->code_max);
  }
  return buf;
}

/* A float scale's value as f32 (F32, F16, BF16: exact). */
static float scale_value(enum qkeep_dtype dtype, const unsigned char *p) {
  float v;
  uint16_t h;
  if (dtype == QKEEP_DTYPE_F32) {
    memcpy(&v, p, 4);
    return v;
  }
  memcpy(&h, p, 2);
  return dtype == QKEEP_DTYPE_F16 ? qk_f16_to_f32(h) : qk_bf16_to_f32(h);
}

/* Why the element is not a valid scale, or NULL. */
static const char *bad_scale(enum qkeep_dtype dtype, const unsigned char *p, const struct scale_rule *rule) {
  bool divided = rule->positive || rule->inverted;
  switch (dtype) {
  case QKEEP_DTYPE_F8_E4M3:
    if ((*p & 0x7f) == 0x7f)
      return "NaN";
    if (divided && !(*p & 0x7f))
      return "zero";
    return (*p & 0x80) && (*p & 0x7f) ? "negative" : NULL;
  case QKEEP_DTYPE_F8_E8M0:
  case QKEEP_DTYPE_U8: return *p == 0xff ? "NaN (e8m0 0xff)" : NULL;
  case QKEEP_DTYPE_F32:
  case QKEEP_DTYPE_F16:
  case QKEEP_DTYPE_BF16: break;
  default: return NULL;
  }
  float v = scale_value(dtype, p);
  if (v != v)
    return "NaN";
  if (isinf(v))
    return "infinite";
  if (v < 0)
    return "negative";
  if (v == 0)
    return divided ? "zero" : NULL;
  /* in f32, as the kernels compute: the reciprocal of a value below 2^-128 is infinite */
  float reciprocal = 1.0f / v, factor = rule->inverted ? reciprocal : v;
  if (divided && isinf(reciprocal))
    return reciprocal_overflows;
  if (rule->code_max > 0 && isinf(factor * rule->code_max))
    return product_overflows;
  return NULL;
}

/* Sixteen bytes as one vector (GCC's and clang's vector extension; SSE2 on any x86-64, NEON on arm64). */
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

/*
 * Whether any of the n one-byte scales is bad, 32 at a time (two 16-byte vectors a step): e4m3 is bad when
 * its low seven bits are all ones (NaN) or it is negative and not -0 (a byte above 0x80, which is
 * x ^ 0x80 above 0 as a signed byte); e8m0 when it is 0xff. About twice the speed of eight bytes a word,
 * so that checking a reload's scales costs less than reading them.
 */
static bool any_bad_bytes(enum qkeep_dtype dtype, const unsigned char *bytes, size_t n) {
  const u8x16 zero = {0}, low7 = zero + 0x7f, sign = zero + 0x80, ff = zero + 0xff;
  u8x16 bad0 = zero, bad1 = zero;
  size_t i = 0;
  if (dtype == QKEEP_DTYPE_F8_E4M3) {
    for (; i + 32 <= n; i += 32) {
      u8x16 x, y;
      memcpy(&x, bytes + i, 16);
      memcpy(&y, bytes + i + 16, 16);
      bad0 |= (u8x16)((x & low7) == low7) | (u8x16)((i8x16)(x ^ sign) > (i8x16)zero);
      bad1 |= (u8x16)((y & low7) == low7) | (u8x16)((i8x16)(y ^ sign) > (i8x16)zero);
    }
  } else {
    for (; i + 32 <= n; i += 32) {
      u8x16 x, y;
      memcpy(&x, bytes + i, 16);
      memcpy(&y, bytes + i + 16, 16);
      bad0 |= (u8x16)(x == ff);
      bad1 |= (u8x16)(y == ff);
    }
  }
  uint64_t words[2];
  bad0 |= bad1;
  memcpy(words, &bad0, sizeof words);
  bool bad = (words[0] | words[1]) != 0;
  for (; i < n && !bad; i++)
    bad = dtype == QKEEP_DTYPE_F8_E4M3 ? (bytes[i] & 0x7f) == 0x7f || bytes[i] > 0x80 : bytes[i] == 0xff;
  return bad;
}

const char *bad_scales(enum qkeep_dtype dtype, const unsigned char *bytes, size_t n,
                       const struct scale_rule *rule, size_t *index) {
  if (!rule->positive && !rule->inverted &&
      (dtype == QKEEP_DTYPE_F8_E4M3 || dtype == QKEEP_DTYPE_F8_E8M0 || dtype == QKEEP_DTYPE_U8) &&
      !any_bad_bytes(dtype, bytes, n))
    return NULL; /* the common case, at memory speed; the loop below names the first bad one */
  size_t esize = qkeep_dtype_size(dtype);
  for (size_t i = 0; i < n; i++) {
    const char *why = bad_scale(dtype, bytes + i * esize, rule);
    if (why) {
      *index = i;
      return why;
    }
  }
  return NULL;
}

int check_scales(const qkeep_param *p, const struct provided *t, size_t first, const void *bytes, size_t n) {
  enum qkeep_dtype dtype = (enum qkeep_dtype)t->dtype;
  size_t esize = qkeep_dtype_size(dtype), bad;
  assert(p->scale && esize && first % esize == 0 && n % esize == 0);
  const char *why = bad_scales(dtype, bytes, n / esize, &p->rule, &bad);
  if (!why)
    return 0;
  char rule[256];
  scale_rule_text(&p->rule, rule, sizeof rule);
  if (why == reciprocal_overflows || why == product_overflows) /* the value, which is finite */
    return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': element %zu is %g: %s (%s)", t->where, t->name,
                     first / esize + bad,
                     (double)scale_value(dtype, (const unsigned char *)bytes + bad * esize), why, rule);
  return set_error(QKEEP_E_FORMAT, "%s: tensor '%s': element %zu is %s (%s)", t->where, t->name,
                   first / esize + bad, why, rule);
}
