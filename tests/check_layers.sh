#!/bin/sh
# check_layers.sh: the core's dependencies run one way, from the API down to the base.
#
# The core's folders are layers, lowest first:
#   base format device param scheme quantize plugin model load reload
# A file may use its own layer and those below it, never one above: checked on the
# #include lines of every core source and header, and on the symbols each object file
# takes from the others (nm), so a call through a declaration written by hand is caught
# too. Within the core no two files may use each other, directly or round a longer
# circle (the symbol graph must peel down to nothing, sinks first). No core file includes
# private.h (the tests' header of everything).
#
# Usage: check_layers.sh [SRCDIR [BUILDDIR]]; defaults from QKEEP_TEST_SRCDIR and
# QKEEP_TEST_BUILDDIR (set by make check), else the current directory.
set -u
src=${1:-${QKEEP_TEST_SRCDIR:-.}}
build=${2:-${QKEEP_TEST_BUILDDIR:-.}}
# The sanitizer build (make distcheck) has the same sources and the same symbols between them: its run
# would only repeat plain make check's.
[ "${QKEEP_TEST_SANITIZED:-}" = yes ] && { echo "check_layers.sh: skipped in the sanitizer build"; exit 77; }
layers="base format device param scheme quantize plugin model load reload"
NM=${NM:-nm}
fail=0

rank() { # the position of layer $1 in $layers, or nothing
  i=0
  for l in $layers; do
    [ "$l" = "$1" ] && { echo $i; return; }
    i=$((i + 1))
  done
}

# ---- includes ----
for dir in $layers; do
  r=$(rank "$dir")
  for f in "$src"/libqkeep/"$dir"/*.[ch]; do
    [ -e "$f" ] || continue
    sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f" | while read -r inc; do
      case "$inc" in
        private.h) echo "FAIL: ${f#"$src"/} includes private.h (tests only)"; echo x >&3 ;;
        */*)
          l=${inc%%/*}
          [ "$l" = qkeep ] && continue
          lr=$(rank "$l")
          if [ -z "$lr" ]; then
            echo "FAIL: ${f#"$src"/} includes $inc, which is in no layer"; echo x >&3
          elif [ "$lr" -gt "$r" ]; then
            echo "FAIL: ${f#"$src"/} ($dir) includes $inc ($l is above $dir)"; echo x >&3
          fi ;;
        config.h | qkeep_dirs.h) ;; # generated: configure's, and make's installation directories
        *) echo "FAIL: ${f#"$src"/} includes \"$inc\" (name a layer: \"LAYER/$inc\")"; echo x >&3 ;;
      esac
    done
  done
done 3>"${TMPDIR:-/tmp}/check_layers.$$"
[ -s "${TMPDIR:-/tmp}/check_layers.$$" ] && fail=1
rm -f "${TMPDIR:-/tmp}/check_layers.$$"

# ---- symbols ----
objs=$(find "$build/libqkeep" -path '*/.libs/libqkeep_core_la-*.o' 2>/dev/null | sort)
[ -n "$objs" ] || objs=$(find "$build/libqkeep" -name 'libqkeep_core_la-*.o' 2>/dev/null | sort)
if [ -z "$objs" ]; then
  echo "check_layers: no object files of the core under $build/libqkeep (build it first)"
  exit 99
fi
n=$(echo "$objs" | wc -l)
[ "$n" -ge 40 ] || { echo "FAIL: only $n object files of the core found"; exit 1; }
for o in $objs; do
  d=$(dirname "$o"); d=${d%/.libs}; layer=${d##*/}
  f=$(basename "$o" .o); f=${f#libqkeep_core_la-}
  $NM "$o" | awk -v n="$layer/$f" '$1 == "U" { print "U", n, $2 } NF == 3 && $2 ~ /^[TDBRC]$/ { print "D", n, $3 }'
done | awk -v layers="$layers" '
  BEGIN { nl = split(layers, L, " "); for (i = 1; i <= nl; i++) R[L[i]] = i }
  $1 == "D" { def[$3] = $2; next }
  { use[++nu] = $2 " " $3 }
  END {
    bad = 0
    for (i = 1; i <= nu; i++) {
      split(use[i], u, " ")
      if (!(u[2] in def) || def[u[2]] == u[1]) continue
      from = u[1]; to = def[u[2]]
      split(from, a, "/"); split(to, b, "/")
      if (R[b[1]] > R[a[1]]) {
        printf "FAIL: %s (%s) uses %s of %s (%s is above %s)\n", from, a[1], u[2], to, b[1], a[1]
        bad = 1
      }
      if (!((from, to) in edge)) { edge[from, to] = 1; out[from]++; nodes[from] = nodes[to] = 1 }
    }
    # Peel sinks (a file that uses no remaining file) and sources (one no remaining file uses):
    # what stays lies on a circle, or between two.
    for (k in edge) { split(k, e, SUBSEP); in_[e[2]]++ }
    do {
      removed = 0
      for (x in nodes) if (!out[x] || !in_[x]) {
        delete nodes[x]; removed = 1
        for (k in edge) {
          split(k, e, SUBSEP)
          if (e[1] == x || e[2] == x) { delete edge[k]; out[e[1]]--; in_[e[2]]-- }
        }
      }
    } while (removed)
    left = ""
    for (x in nodes) left = left " " x
    if (left != "") { print "FAIL: files on a circle of uses:" left; bad = 1 }
    exit bad
  }' || fail=1

[ $fail -eq 0 ] && echo "check_layers: $n objects; includes and symbols run one way ($layers)"
exit $fail
