#!/bin/sh
# install.sh: an installed qkeep works with no other step, wherever it is installed.
#
# The distributed sources (make distdir) are configured for a prefix P1, built and installed,
# then reconfigured in the same tree for P2 and installed with no make clean between, as a
# user who installs a tree built before. Each installed qkeep is then run while the build tree
# and the other prefix are moved away, so that it can only start with what its own prefix
# holds: `qkeep version`, `qkeep plugins`, `qkeep run` and `qkeep reload` with the installed
# default config (the installed examples, the installed plugins), `qkeep run` with an installed
# example config; and no file of P2 names P1 (no path baked into an object that the
# reconfigure left stale, no RUNPATH of the other prefix), and no config names the build tree.
# The man page is installed, and `make uninstall` leaves no file behind.
#
# The tree is built with the reference backend only, without optimisation, in a temporary
# directory. Exits 77 (skip) where no configured build tree is at hand.
set -u
build=${QKEEP_TEST_BUILDDIR:-.}
[ -f "$build/Makefile" ] || { echo "install.sh: no configured build tree at $build"; exit 77; }
# Its inner builds are plain ones whatever the tree under test is: a sanitizer build (make
# distcheck) would run the same test again and find nothing more; plain make check runs it.
[ "${QKEEP_TEST_SANITIZED:-}" = yes ] && { echo "install.sh: skipped in the sanitizer build"; exit 77; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/qkeep-install.XXXXXX") || exit 99
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
# The inner makes are the test's own, not jobs of the make that runs the test suite.
unset MAKEFLAGS MFLAGS MAKELEVEL QKEEP_CONFIG QKEEP_PLUGIN_PATH LD_LIBRARY_PATH

fail() {
  echo "FAIL: $*"
  exit 1
}
# Runs a command, its output kept in $tmp/out; prints that output when it fails.
quiet() {
  "$@" >"$tmp/out" 2>&1 || {
    cat "$tmp/out"
    fail "$*"
  }
}

make -C "$build" distdir distdir="$tmp/src" >"$tmp/out" 2>&1 || {
  cat "$tmp/out"
  echo "install.sh: make distdir failed"
  exit 99
}
chmod -R u+w "$tmp/src" # a copy of a read-only source tree (make distcheck) is read-only too

# The second configure reuses the first one's cache, as `./configure -C` would: the test is about
# what a rebuild for another prefix leaves behind, not the checks, which took half its time.
configure() {
  (cd "$tmp/src" && quiet ./configure --cache-file="$tmp/config.cache" --prefix="$1" --disable-onednn \
    --disable-zentorch --disable-cuda --disable-rocm FUZZ_CC=no CFLAGS=-O0) || exit 1
}
install() {
  (cd "$tmp/src" && quiet make -j2 install) || exit 1
}

# check_prefix P OTHER: P's qkeep, with OTHER and the build tree out of its reach.
check_prefix() {
  p=$1 other=$2
  [ -e "$other" ] && mv "$other" "$other.away"
  mv "$tmp/src" "$tmp/src.away"
  cd / || exit 99
  qkeep=$p/bin/qkeep
  quiet "$qkeep" version
  quiet "$qkeep" plugins
  grep -q '^reference ' "$tmp/out" || { cat "$tmp/out"; fail "$qkeep plugins: no reference backend"; }
  quiet "$qkeep" run
  grep -qF "$p/share/qkeep/examples/tiny-w8a8-int8" "$tmp/out" ||
    { cat "$tmp/out"; fail "$qkeep run: not the installed example"; }
  quiet "$qkeep" reload
  quiet "$qkeep" -c "$p/share/qkeep/reference.ini" run
  grep -qF "$p/share/qkeep/examples/tiny-gptq-int4" "$tmp/out" ||
    { cat "$tmp/out"; fail "$qkeep -c reference.ini run: not the installed example"; }
  for ini in "$p"/share/qkeep/*.ini; do
    ! grep -n '\.libs\|\.\./' "$ini" || fail "$ini names the build tree"
  done
  ! grep -rlF "$other" "$p" || fail "files of $p name $other"
  # (qkeep itself holds the build tree's path, to find that tree's config when it runs from there)
  ! grep -rlF "$tmp/src" "$p" | grep -v "^$p/bin/qkeep\$" || fail "files of $p name the build tree $tmp/src"
  man=$p/share/man/man1/qkeep.1
  [ -f "$man" ] || fail "no man page in $p/share/man/man1"
  grep -qF "$p/share/qkeep/qkeep.ini" "$man" || fail "$man does not name the installed config"
  ! grep -n '@[a-z]*@' "$man" || fail "$man: a placeholder left"
  if command -v groff >/dev/null; then
    warnings=$(groff -man -ww -z "$man" 2>&1)
    [ -z "$warnings" ] || fail "groff on $man: $warnings"
  fi
  mv "$tmp/src.away" "$tmp/src"
  [ -e "$other.away" ] && mv "$other.away" "$other"
  return 0
}

configure "$tmp/p1"
install
check_prefix "$tmp/p1" "$tmp/p2"
echo "PASS: installed to $tmp/p1"

configure "$tmp/p2" # the same tree, built for p1
install
check_prefix "$tmp/p2" "$tmp/p1"
echo "PASS: reconfigured and installed to $tmp/p2"
check_prefix "$tmp/p1" "$tmp/p2"
echo "PASS: $tmp/p1 still runs beside it"

(cd "$tmp/src" && quiet make uninstall) || exit 1
left=$(find "$tmp/p2" -type f)
[ -z "$left" ] || fail "make uninstall left: $left"
echo "PASS: make uninstall removed every file of $tmp/p2"
exit 0
