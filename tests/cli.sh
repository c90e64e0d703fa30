#!/bin/sh
# cli.sh: the qkeep command end to end: version, plugins, census (table and
# JSON) on a checkpoint written by make_tiny, help, and its error paths.
set -u
build=${QKEEP_TEST_BUILDDIR:-.}
qkeep="$build/cli/qkeep"
tmp="$build/tests/tmp/cli-$$"
rm -rf "$tmp" && mkdir -p "$tmp"
fails=0
pass=0

check() { # check NAME CONDITION-COMMAND...
  name=$1; shift
  if "$@"; then pass=$((pass + 1)); else fails=$((fails + 1)); echo "FAIL: $name"; fi
}
contains() { grep -q -- "$2" "$1"; }
line_is() { grep -Eq "^  $2 +$3\$" "$1"; }

"$build/tests/make_tiny" "$tmp/tiny.safetensors" 1 bf16 || { echo "FAIL: make_tiny"; exit 1; }
cat >"$tmp/qkeep.ini" <<INI
[qkeep]
backend = reference
[model]
checkpoint = tiny.safetensors
INI

"$qkeep" version >"$tmp/out" 2>&1; check "version exits 0" test $? -eq 0
abi=$(sed -n 's/^backend_abi=//p' "$build/qkeep.pc")
check "version text" grep -Eq '^qkeep [0-9.]+ \(plugin ABI [0-9]+\.[0-9]+\)$' "$tmp/out"
check "qkeep.pc exports the ABI the core has" contains "$tmp/out" "plugin ABI $abi)"
check "qkeep-backend.pc exports it too" grep -qx "backend_abi=$abi" "$build/qkeep-backend.pc"
"$qkeep" --debug version >"$tmp/out" 2>&1; check "--debug is a main option" test $? -eq 0

"$qkeep" -c "$tmp/qkeep.ini" plugins >"$tmp/out" 2>&1; check "plugins exits 0" test $? -eq 0
check "plugins lists reference" contains "$tmp/out" "reference"
check "plugins shows the ABI mismatch" contains "$tmp/out" "test-major"
"$qkeep" -c "$tmp/qkeep.ini" plugins --json >"$tmp/out" 2>&1
check "plugins --json" contains "$tmp/out" '"name":"reference"'

# census on the config's checkpoint (relative to the config file)
"$qkeep" -c "$tmp/qkeep.ini" census >"$tmp/out" 2>&1; rc=$?
cat "$tmp/out"
check "census exits 0" test $rc -eq 0
check "census missing 0" line_is "$tmp/out" "missing" 0
check "census C1 0" line_is "$tmp/out" "C1 violations" 0
check "census C2 0" line_is "$tmp/out" "C2 overlaps" 0
check "census released 0" line_is "$tmp/out" "released" 0
check "census loader params" line_is "$tmp/out" "loader params" 28
check "census layers" line_is "$tmp/out" "layers" 24

"$qkeep" -c "$tmp/qkeep.ini" census "$tmp/tiny.safetensors" --json >"$tmp/json" 2>&1
check "census --json" contains "$tmp/json" '"missing":0,"c1":0,"c2":0'
digest1=$(sed 's/.*"digest":"\([0-9a-f]*\)".*/\1/' "$tmp/json")
"$build/tests/make_tiny" "$tmp/other.safetensors" 2 bf16
"$qkeep" -c "$tmp/qkeep.ini" census "$tmp/other.safetensors" --json >"$tmp/json2" 2>&1
digest2=$(sed 's/.*"digest":"\([0-9a-f]*\)".*/\1/' "$tmp/json2")
check "digest is 32 hex" test ${#digest1} -eq 32
check "digests differ for different weights" test "$digest1" != "$digest2"
"$qkeep" -c "$tmp/qkeep.ini" census "$tmp/tiny.safetensors" --json >"$tmp/json3" 2>&1
check "digest is deterministic" test "$digest1" = "$(sed 's/.*"digest":"\([0-9a-f]*\)".*/\1/' "$tmp/json3")"

"$qkeep" census --help >"$tmp/out" 2>&1; check "census --help" contains "$tmp/out" "usage: qkeep"
"$qkeep" plugins --help >"$tmp/out" 2>&1; check "plugins --help" contains "$tmp/out" "usage: qkeep"
"$qkeep" --help >"$tmp/out" 2>&1; check "--help" contains "$tmp/out" "commands:"

"$qkeep" -c "$tmp/qkeep.ini" census "$tmp/absent.safetensors" >"$tmp/out" 2>&1; rc=$?
check "missing checkpoint fails" test $rc -eq 1
check "missing checkpoint is named" contains "$tmp/out" "absent.safetensors"

printf '[qkeep]\nbackend = nonexistent\n' >"$tmp/bad.ini"
"$qkeep" -c "$tmp/bad.ini" census "$tmp/tiny.safetensors" >"$tmp/out" 2>&1; rc=$?
check "missing plugin fails" test $rc -eq 1
check "missing plugin names config line" contains "$tmp/out" "bad.ini:2"

"$qkeep" frobnicate >"$tmp/out" 2>&1; check "unknown command is a usage error" test $? -eq 2

# the fusion map from the config
printf '[qkeep]\nbackend = reference\n[model]\nfuse = none\n' >"$tmp/nofuse.ini"
"$qkeep" -c "$tmp/nofuse.ini" census "$tmp/tiny.safetensors" >"$tmp/out" 2>&1
check "fuse = none keeps q/k/v apart" line_is "$tmp/out" "layers" 32
printf '[qkeep]\nbackend = reference\n[model]\nfuse = qkv=q_proj\n' >"$tmp/badfuse.ini"
"$qkeep" -c "$tmp/badfuse.ini" census "$tmp/tiny.safetensors" >"$tmp/out" 2>&1
check "a bad fuse map is a config error with its line" contains "$tmp/out" "badfuse.ini:4"

# tensor and expert parallel from the config: rank 1 of 2 loads its slice, runs and checks it
printf '[qkeep]\nbackend = reference\n[model]\ntp_size = 2\ntp_rank = 1\nep_size = 2\nep_rank = 1\n' >"$tmp/tp.ini"
"$qkeep" -c "$tmp/tp.ini" census "$tmp/tiny.safetensors" >"$tmp/out" 2>&1
check "tp rank 1 of 2: census exits 0" test $? -eq 0
check "tp rank 1 of 2: census missing 0" line_is "$tmp/out" "missing" 0
"$qkeep" -c "$tmp/tp.ini" run "$tmp/tiny.safetensors" >"$tmp/out" 2>&1
check "tp rank 1 of 2: run checks its layers" test $? -eq 0
printf '[qkeep]\nbackend = reference\n[model]\ntp_size = 2\ntp_rank = 2\n' >"$tmp/tpbad.ini"
"$qkeep" -c "$tmp/tpbad.ini" census "$tmp/tiny.safetensors" >"$tmp/out" 2>&1
check "a rank outside its group is refused" contains "$tmp/out" "tp rank 2 of 2"
printf '[qkeep]\nbackend = reference\n[model]\ntp_size = 0\n' >"$tmp/tpzero.ini"
"$qkeep" -c "$tmp/tpzero.ini" census "$tmp/tiny.safetensors" >"$tmp/out" 2>&1
check "tp_size 0 is a config error with its line" contains "$tmp/out" "tpzero.ini:4"

# quantize, run (the main job) and reload, on a model written here
"$qkeep" quantize "$tmp/tiny.safetensors" "$tmp/w0" --scheme modelopt-nvfp4 --kv-scales >"$tmp/out" 2>&1
check "quantize exits 0" test $? -eq 0
"$qkeep" quantize "$tmp/other.safetensors" "$tmp/w1" --scheme modelopt-nvfp4 --kv-scales --shard-bytes 1000000 >/dev/null 2>&1
check "quantize shards" test -f "$tmp/w1/model.safetensors.index.json"
"$qkeep" quantize "$tmp/tiny.safetensors" "$tmp/w0" --scheme modelopt-nvfp4 >"$tmp/out" 2>&1
check "quantize refuses an existing output" test $? -eq 1
"$qkeep" quantize "$tmp/tiny.safetensors" "$tmp/bad" >"$tmp/out" 2>&1
check "quantize needs --scheme" test $? -eq 2
"$qkeep" quantize "$tmp/tiny.safetensors" "$tmp/bad" --scheme mxfp4 --threads 0 >"$tmp/out" 2>&1
check "quantize refuses --threads 0" test $? -eq 2
"$qkeep" --json quantize "$tmp/tiny.safetensors" "$tmp/t1" --scheme mxfp4 --kv-scales --threads 1 >"$tmp/q1.json" 2>&1
"$qkeep" quantize "$tmp/tiny.safetensors" "$tmp/t3" --scheme mxfp4 --kv-scales --threads 3 >/dev/null 2>"$tmp/q3.err"
check "quantize writes the same bytes at 1 and 3 threads" cmp -s "$tmp/t1/model.safetensors" "$tmp/t3/model.safetensors"
check "quantize is silent off a terminal" test ! -s "$tmp/q3.err"
if command -v script >/dev/null 2>&1; then # util-linux's script gives it a terminal
  script -qec "'$qkeep' quantize '$tmp/tiny.safetensors' '$tmp/tty' --scheme mxfp4" /dev/null >"$tmp/tty.out" 2>&1
  check "quantize shows progress on a terminal" grep -Eq "[0-9]+/[0-9]+ tensors, .* MB/s, ETA" "$tmp/tty.out"
fi
check "quantize --json sums up" test "$("$build/tests/jsonget" threads <"$tmp/q1.json")" = 1
check "quantize --json counts the bytes written" test "$("$build/tests/jsonget" output_bytes <"$tmp/q1.json")" = \
  "$(stat -c %s "$tmp/t1/model.safetensors")"
# a bad option value is refused naming the option (it became the default), and nothing is written
for bad in "--activation-amax nan" "--activation-amax -1" "--activation-amax 1e39" "--shard-bytes -5" \
  "--shard-bytes 12x" "--group 0" "--group many"; do
  "$qkeep" quantize "$tmp/tiny.safetensors" "$tmp/badopt" --scheme gptq-int4 $bad >"$tmp/out" 2>&1
  check "quantize refuses $bad" test $? -eq 2
  check "quantize names ${bad%% *} in its refusal" contains "$tmp/out" "${bad%% *} ${bad#* }:"
  check "quantize $bad writes nothing" test ! -e "$tmp/badopt"
done
"$qkeep" run --rows 4x >"$tmp/out" 2>&1
check "run refuses --rows 4x" test $? -eq 2
"$qkeep" -c "$tmp/qkeep.ini" run "$tmp/w0" >"$tmp/out" 2>&1; rc=$?
check "run exits 0" test $rc -eq 0
# the reference against itself: exactly 0 (the default-config runs below compare other backends)
check "run checks every GEMM" grep -Eq "^[1-9][0-9]* GEMMs checked, largest relative error 0 \(tolerance" "$tmp/out"
check "run prints the census" line_is "$tmp/out" "missing" 0
check "run prints times" contains "$tmp/out" "normalise+PWAL"
"$qkeep" -c "$tmp/qkeep.ini" run "$tmp/w0" --json >"$tmp/out" 2>/dev/null
check "run --json" contains "$tmp/out" '"max_rel":0,"tolerance"'
# --json before or after the command: one JSON document on stdout, census and owners in it
jsonget="$build/tests/jsonget"
for form in "run --json" "--json run"; do
  # shellcheck disable=SC2086 # the form is two words on purpose
  "$qkeep" -c "$tmp/qkeep.ini" $form "$tmp/w0" >"$tmp/doc" 2>/dev/null
  check "$form is one JSON document" "$jsonget" <"$tmp/doc"
  check "$form carries the census" test "$("$jsonget" census missing <"$tmp/doc")" = 0
  check "$form names each layer's backend" test "$("$jsonget" census owners 0 backend <"$tmp/doc")" = reference
  check "$form counts per backend" test "$("$jsonget" census backends 0 layers <"$tmp/doc")" = 24
done
for cmd in census plugins version; do
  "$qkeep" -c "$tmp/qkeep.ini" --json $cmd >"$tmp/doc" 2>/dev/null
  check "--json $cmd is one JSON document" "$jsonget" <"$tmp/doc"
done
"$qkeep" -c "$tmp/qkeep.ini" --json reload "$tmp/w0" "$tmp/w1" >"$tmp/doc" 2>/dev/null
check "--json reload is one JSON document" "$jsonget" <"$tmp/doc"
check "reload --json names each layer's backend" test "$("$jsonget" owners 0 backend <"$tmp/doc")" = reference
"$qkeep" -c "$tmp/qkeep.ini" reload "$tmp/w0" "$tmp/w1" >"$tmp/out" 2>&1; rc=$?
cat "$tmp/out"
check "reload exits 0" test $rc -eq 0
check "reload digests identical" contains "$tmp/out" "identical"
check "reload pointers unchanged" grep -Eq "data pointers +([0-9]+) of \\1 unchanged" "$tmp/out"
"$qkeep" -c "$tmp/qkeep.ini" reload "$tmp/w0" "$tmp/tiny.safetensors" >"$tmp/out" 2>&1
check "reload of another scheme fails" test $? -eq 1
check "reload says what W1 lacks" contains "$tmp/out" "the model expects"
"$qkeep" reload --help >"$tmp/out" 2>&1; check "reload --help" contains "$tmp/out" "usage: qkeep"
"$qkeep" run --help >"$tmp/out" 2>&1; check "run --help" contains "$tmp/out" "usage: qkeep"
"$qkeep" quantize --help >"$tmp/out" 2>&1; check "quantize --help" contains "$tmp/out" "usage: qkeep"

# The default config (conf/qkeep.ini of the build tree, every backend configure built, in a
# chain) runs and reloads every shipped example of every scheme, GPU or not.
default="$build/conf/qkeep.ini"
for ex in "$build"/examples/tiny-*/; do
  ex=${ex%/}
  case $ex in */tiny-w1*) continue ;; esac
  scheme=${ex##*/tiny-}
  "$qkeep" -c "$default" run "$ex" >"$tmp/out" 2>&1
  check "default config runs $scheme" test $? -eq 0
  "$qkeep" -c "$default" reload "$ex" "$build/examples/tiny-w1-$scheme" >"$tmp/out" 2>&1
  check "default config reloads $scheme" test $? -eq 0
  check "$scheme reload identical" contains "$tmp/out" "identical"
done
# The oracle quantising activations as an int8 kernel does: a strict check of cpu-onednn's int8 path
if [ -f "$build/plugins/cpu/.libs/backend-cpu-onednn.so" ]; then
  levels=int8
  "$qkeep" -c "$default" plugins 2>/dev/null | grep -q '7-bit' && levels=int8-7bit
  printf '[qkeep]\nbackend = cpu-onednn, reference\nplugin_dir = %s\n[backend.reference]\nactivations = %s\n' \
    "$build/plugins/cpu/.libs" "$levels" >"$tmp/int8.ini"
  # the largest relative error over the w8a8-int8 GEMMs of a run --json (unquantized ones run in bf16)
  worst_int8() { tr '{' '\n' <"$1" | grep '"scheme":"w8a8-int8"' | sed 's/.*"max_rel":\([^,}]*\).*/\1/' |
    awk 'BEGIN { w = 0 } { if ($1 + 0 > w) w = $1 + 0 } END { print w }'; }
  "$qkeep" -c "$tmp/int8.ini" run "$build/examples/tiny-w8a8-int8" --json >"$tmp/doc" 2>/dev/null
  check "cpu-onednn matches the int8 oracle to 1e-5" awk -v w="$(worst_int8 "$tmp/doc")" 'BEGIN { exit !(w < 1e-5) }'
  "$qkeep" -c "$default" run "$build/examples/tiny-w8a8-int8" --json >"$tmp/doc" 2>/dev/null
  check "the float oracle differs from an int8 pipeline" awk -v w="$(worst_int8 "$tmp/doc")" 'BEGIN { exit !(w > 1e-3) }'
fi
# No config (and so no plugin) comes from the current directory: a qkeep run from its build
# tree takes the build tree's conf/qkeep.ini, whatever ./conf/qkeep.ini says
mkdir -p "$tmp/hostile/conf"
printf '[qkeep]\nbackend = hostile\nplugin_dir = .\n[model]\ncheckpoint = hostile.safetensors\n' \
  >"$tmp/hostile/conf/qkeep.ini"
(cd "$tmp/hostile" && env -u QKEEP_CONFIG "$qkeep" census) >"$tmp/out" 2>&1
check "the current directory's config is not read" test $? -eq 0
check "the build tree's config is read instead" contains "$tmp/out" "tiny-w8a8-int8"
# `qkeep plugins` with the default config lists every backend the build made, with its probe
"$qkeep" -c "$default" plugins >"$tmp/out" 2>&1
for so in "$build"/plugins/*/.libs/backend-*.so; do
  name=${so##*/backend-}; name=${name%.so}
  check "default plugins lists $name" grep -Eq "^$name +ABI [0-9.]+ +(device ok|no device)" "$tmp/out"
done
"$qkeep" -c "$default" plugins --verbose >"$tmp/out" 2>&1
check "plugins --verbose lists declared keys" grep -Eq "^  keys:" "$tmp/out"
"$qkeep" -c "$default" plugins --verbose --json >"$tmp/doc" 2>/dev/null
check "plugins --verbose --json carries the keys" "$jsonget" plugins 0 keys <"$tmp/doc"
# ... and checkpoints that qkeep quantize writes from f32 and f16 sources, in every scheme
for dtype in f32 f16; do
  "$build/tests/make_tiny" "$tmp/src-$dtype.safetensors" 3 $dtype
  "$build/tests/make_tiny" "$tmp/src1-$dtype.safetensors" 4 $dtype
  for scheme in w8a8-int8 modelopt-nvfp4 ct-nvfp4 mxfp4 gptq-int4 awq-int4 ct-int4; do
    "$qkeep" quantize "$tmp/src-$dtype.safetensors" "$tmp/q-$dtype-$scheme" --scheme $scheme --kv-scales >/dev/null 2>&1
    "$qkeep" quantize "$tmp/src1-$dtype.safetensors" "$tmp/q1-$dtype-$scheme" --scheme $scheme --kv-scales >/dev/null 2>&1
    "$qkeep" -c "$default" run "$tmp/q-$dtype-$scheme" >"$tmp/out" 2>&1
    check "default config runs $scheme from $dtype" test $? -eq 0
    "$qkeep" -c "$default" reload "$tmp/q-$dtype-$scheme" "$tmp/q1-$dtype-$scheme" >"$tmp/out" 2>&1
    check "default config reloads $scheme from $dtype" test $? -eq 0
  done
done

rm -rf "$tmp"
echo "cli.sh: $pass passed, $fails failed"
test $fails -eq 0
