#!/bin/sh
# check.sh QKEEP W0 W1: runs the skeleton backend in the chain `skeleton, reference` with the
# qkeep command QKEEP: `run` on W0 (a w8a8-int8 checkpoint: census clean, the skeleton owns
# its int8 linear layers, every layer within tolerance of the reference backend), then
# `reload` W0 -> W1 (byte-identical to a cold start on W1, no data pointer moved, census
# unchanged). $QKEEP_PLUGIN_DIR, when set, is where the reference backend lives (a staged
# install); otherwise the installed qkeep's own plugin directory is searched.
set -eu
qkeep=$1 w0=$2 w1=$3
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/skeleton.ini" <<INI
[qkeep]
backend = skeleton, reference
plugin_dir = $here${QKEEP_PLUGIN_DIR:+:$QKEEP_PLUGIN_DIR}
[backend.skeleton]
verify = true
INI
fail() { echo "check.sh: $*" >&2; exit 1; }
"$qkeep" -c "$tmp/skeleton.ini" run "$w0" --json >"$tmp/run.json" || fail "qkeep run failed"
grep -q '"missing":0,"c1":0,"c2":0' "$tmp/run.json" || fail "census not clean"
grep -q '"released":0,' "$tmp/run.json" || fail "a param was released"
grep -q '"backend":"skeleton","scheme":"w8a8-int8"' "$tmp/run.json" || fail "the skeleton ran no layer"
"$qkeep" -c "$tmp/skeleton.ini" reload "$w0" "$w1" --json >"$tmp/reload.json" || fail "qkeep reload failed"
grep -q '"identical":true' "$tmp/reload.json" || fail "reload differs from a cold start"
grep -q '"moved":0,' "$tmp/reload.json" || fail "a data pointer moved"
grep -q '"census_unchanged":true' "$tmp/reload.json" || fail "the census changed"
echo "check.sh: skeleton ran and reloaded $w0 -> $w1 in the chain skeleton, reference"
