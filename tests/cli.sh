#!/bin/sh
# cli.sh: the qkeep command end to end: version, plugins, census (table and
# JSON) on a checkpoint written by make_tiny, help, and its error paths.
set -u
build=${QKEEP_TEST_BUILDDIR:-.}
qkeep="$build/cli/qkeep"
# Where cli/qkeep is libtool's wrapper script, the program it runs, with the library path it sets: the
# wrapper is a shell and a sed for each of the 230 calls here, half this test's CPU time.
if [ -x "$build/cli/.libs/qkeep" ] && grep -q 'libtool' "$qkeep" 2>/dev/null; then
  qkeep="$build/cli/.libs/qkeep"
  LD_LIBRARY_PATH="$build/libqkeep/.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
fi
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
check "a rank outside its group is refused with its line" contains "$tmp/out" "tpbad.ini:5: \[model\] tp_rank = 2: out of range"
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


# ---- the command line parses one way ----
# extra positional arguments are usage errors, with the command's usage line
for args in "run A B" "reload W0 W1 extra" "plugins extra" "version extra" "census A B" "quantize A B C --scheme mxfp4"; do
  # shellcheck disable=SC2086 # the words on purpose
  "$qkeep" -c "$tmp/qkeep.ini" $args >"$tmp/out" 2>&1; rc=$?
  check "'$args' is a usage error" test $rc -eq 2
  check "'$args' names the extra argument" grep -q "unexpected argument" "$tmp/out"
  check "'$args' shows the usage line" grep -q "^usage: qkeep" "$tmp/out"
done
"$qkeep" -c "$tmp/qkeep.ini" run --scheme mxfp4 "$tmp/w0" >"$tmp/out" 2>&1
check "an option of another command is refused" test $? -eq 2
check "... naming the command it belongs to" contains "$tmp/out" "--scheme is an option of quantize, not of run"
# every form of an option with a value: --opt=V, --opt V, -oV, -o V
"$qkeep" -c "$tmp/qkeep.ini" census "$tmp/tiny.safetensors" --json >"$tmp/ref.json" 2>/dev/null
for form in "-c $tmp/qkeep.ini" "-c$tmp/qkeep.ini" "--config=$tmp/qkeep.ini" "--config $tmp/qkeep.ini"; do
  # shellcheck disable=SC2086
  "$qkeep" $form census "$tmp/tiny.safetensors" --json >"$tmp/doc" 2>"$tmp/err"
  check "'${form%%/*}...' is read" test "$("$jsonget" digest <"$tmp/doc")" = "$("$jsonget" digest <"$tmp/ref.json")"
done
for form in "--rows=2" "--rows 2" "-r2" "-r 2"; do
  # shellcheck disable=SC2086
  "$qkeep" -c "$tmp/qkeep.ini" run "$tmp/w0" $form --json >"$tmp/doc" 2>/dev/null
  check "run $form" test "$("$jsonget" layers 0 m <"$tmp/doc")" = 2
done
for form in "--scheme=mxfp4" "-smxfp4" "-s mxfp4"; do
  rm -rf "$tmp/form"
  # shellcheck disable=SC2086
  "$qkeep" quantize "$tmp/tiny.safetensors" "$tmp/form" $form --kv-scales >/dev/null 2>&1
  check "quantize $form" cmp -s "$tmp/form/model.safetensors" "$tmp/t1/model.safetensors"
done
# -- ends the options: a checkpoint named --json
cp "$tmp/tiny.safetensors" "$tmp/--json"
(cd "$tmp" && "$qkeep" -c qkeep.ini census -- --json) >"$tmp/out" 2>&1
check "-- ends the options" test $? -eq 0
check "... and --json after it is a file" line_is "$tmp/out" "missing" 0
# --version: version, ABI, plugin directory and config
"$qkeep" --version >"$tmp/out" 2>&1
check "--version exits 0" test $? -eq 0
check "--version gives the ABI" contains "$tmp/out" "plugin ABI $abi"
check "--version gives the plugin directory" grep -q "^plugin dir: /" "$tmp/out"
check "--version gives the default config" grep -q "^config: .*qkeep.ini" "$tmp/out"
"$qkeep" --version -c "$tmp/qkeep.ini" >"$tmp/out" 2>&1
check "--version gives the config -c names" contains "$tmp/out" "config: $tmp/qkeep.ini"
# help: qkeep help, help COMMAND, --help with every command's flags, the environment, exit codes
"$qkeep" help >"$tmp/help" 2>&1; check "help exits 0" test $? -eq 0
"$qkeep" --help >"$tmp/out" 2>&1; check "--help is help" cmp -s "$tmp/out" "$tmp/help"
for word in "run \[CKPT\]" "census \[CKPT\]" "reload \[W0 W1\]" "quantize IN OUT" "plugins" "--scheme S" "--group G" \
  "--asym" "--static-input" "--asym-input" "--kv-scales" "--activation-amax A" "--shard-bytes N" "--threads N" "--force" \
  "--rows M" "--tolerance T" "--seed S" "--verbose" "--config FILE" "--json" "--debug" "--version" \
  QKEEP_PLUGIN_PATH QKEEP_NCCL_LIBRARY QKEEP_CONFIG "exit status" "128+N"; do
  check "--help lists $word" grep -q -- "$word" "$tmp/help"
done
for cmd in run census reload quantize plugins version help; do
  "$qkeep" help $cmd >"$tmp/out" 2>&1
  check "help $cmd" test $? -eq 0
  "$qkeep" $cmd --help >"$tmp/out2" 2>&1
  check "help $cmd is $cmd --help" cmp -s "$tmp/out" "$tmp/out2"
done
"$qkeep" help frobnicate >"$tmp/out" 2>&1; check "help of an unknown command is a usage error" test $? -eq 2
"$qkeep" census --help >"$tmp/out" 2>&1
check "census --help does not ask for a .safetensors file" sh -c "! grep -q 'CKPT (a .safetensors file' '$tmp/out'"
check "census --help takes directories" contains "$tmp/out" "directory"

# ---- --json: one valid UTF-8 document, success or failure ----
"$qkeep" -c "$tmp/qkeep.ini" --json run "$tmp/nope" >"$tmp/doc" 2>/dev/null
check "--json failure is one document" "$jsonget" <"$tmp/doc"
check "--json failure says ok false" test "$("$jsonget" ok <"$tmp/doc")" = false
check "--json failure has the error code" test "$("$jsonget" error code <"$tmp/doc")" = not_found
check "--json failure has the message" grep -q "nope" "$tmp/doc"
for args in "frobnicate" "run A B" "--bogus run" "quantize A B --scheme mxfp4 --asym" "run --rows 0"; do
  # shellcheck disable=SC2086
  "$qkeep" -c "$tmp/qkeep.ini" --json $args >"$tmp/doc" 2>/dev/null
  check "--json '$args' is one failure document" test "$("$jsonget" error code <"$tmp/doc")" = usage
done
"$qkeep" -c "$tmp/qkeep.ini" run "$tmp/w0" --json >"$tmp/doc" 2>/dev/null
check "--json success says ok true" test "$("$jsonget" ok <"$tmp/doc")" = true
check "run --json: backends at the top" test "$("$jsonget" backends 0 name <"$tmp/doc")" = reference
check "run --json: owners at the top" test "$("$jsonget" owners 0 backend <"$tmp/doc")" = reference
for cmd in "census $tmp/tiny.safetensors" "reload $tmp/w0 $tmp/w1" plugins version "help run"; do
  # shellcheck disable=SC2086
  "$qkeep" -c "$tmp/qkeep.ini" --json $cmd >"$tmp/doc" 2>/dev/null
  check "--json ${cmd%% *} says ok true" test "$("$jsonget" ok <"$tmp/doc")" = true
done
# a path that is not UTF-8: the document stays valid UTF-8 (U+FFFD for each bad byte)
bad=$(printf '%s/bad\377name' "$tmp")
cp "$tmp/tiny.safetensors" "$bad"
"$qkeep" -c "$tmp/qkeep.ini" --json census "$bad" >"$tmp/doc" 2>/dev/null
check "--json with a non-UTF-8 path is one document" "$jsonget" <"$tmp/doc"
check "--json writes the bad byte as U+FFFD" contains "$tmp/doc" 'bad\\ufffdname'
"$qkeep" -c "$tmp/qkeep.ini" --json census "$bad.absent" >"$tmp/doc" 2>/dev/null
check "--json failure with a non-UTF-8 path is one document" "$jsonget" error message <"$tmp/doc"
# NaN weights: the relative error is NaN, written as null, and the run fails
cp "$tmp/tiny.safetensors" "$tmp/nan.safetensors"
hdr=$(od -An -tu4 -N4 "$tmp/nan.safetensors" | tr -d ' ')
size=$(stat -c %s "$tmp/nan.safetensors")
head -c $((size - 8 - hdr)) /dev/zero | tr '\000' '\377' | # every weight 0xffff: a bf16 NaN
  dd of="$tmp/nan.safetensors" bs=65536 seek=$((8 + hdr)) oflag=seek_bytes conv=notrunc status=none
"$qkeep" -c "$tmp/qkeep.ini" --json run "$tmp/nan.safetensors" >"$tmp/doc" 2>/dev/null
check "a NaN run fails" test "$("$jsonget" ok <"$tmp/doc")" = false
check "NaN is null in JSON" test "$("$jsonget" max_rel <"$tmp/doc")" = null


# ---- quantize: interrupted, replaced, and errors that name the file ----
# st_write FILE HEADER DATA_BYTES: a safetensors file of that JSON header and zero data (sparse)
st_write() {
  hdr=$2
  while [ $((${#hdr} % 8)) -ne 0 ]; do hdr="$hdr "; done
  len=${#hdr} # the header's length as 8 little-endian bytes, in printf's octal escapes
  # shellcheck disable=SC2059
  printf "$(printf '\\%03o\\%03o\\%03o\\000\\000\\000\\000\\000' $((len & 255)) $((len >> 8 & 255)) $((len >> 16 & 255)))" >"$1"
  printf '%s' "$hdr" >>"$1"
  truncate -s $((8 + len + $3)) "$1"
}
# big_input FILE N ROWS COLS: an f32 checkpoint of N zero linear weights (read from the page cache
# without disk), large enough that a quantize on one thread runs for seconds
big_input() {
  n=$2 bytes=$(($3 * $4 * 4)) json='{' i=0
  while [ $i -lt "$n" ]; do
    [ $i -gt 0 ] && json="$json,"
    json="$json\"model.layers.$i.mlp.down_proj.weight\":{\"dtype\":\"F32\",\"shape\":[$3,$4],\"data_offsets\":[$((i * bytes)),$(((i + 1) * bytes))]}"
    i=$((i + 1))
  done
  st_write "$1" "$json}" $((n * bytes))
}
big_input "$tmp/big.safetensors" 8 4096 8192
# interrupt SIG [OPTION]: a quantize of the big input into $tmp/sig gets SIG once its staging
# directory exists; its exit status is in $rc. SIGINT goes through timeout, which forwards it: a background
# job of a script starts with SIGINT ignored, and qkeep keeps a signal ignored at its start ignored.
interrupt() {
  sig=$1
  shift
  if [ "$sig" = INT ]; then
    timeout --preserve-status -s INT 600 "$qkeep" quantize "$tmp/big.safetensors" "$tmp/sig" --scheme w8a8-int8 \
      --threads 1 "$@" >"$tmp/sig.out" 2>&1 &
  else
    "$qkeep" quantize "$tmp/big.safetensors" "$tmp/sig" --scheme w8a8-int8 --threads 1 "$@" >"$tmp/sig.out" 2>&1 &
  fi
  pid=$!
  n=0
  while [ $n -lt 1200 ] && ! ls -d "$tmp"/.sig.qkeep-* >/dev/null 2>&1; do
    sleep 0.05
    n=$((n + 1))
  done
  kill -"$sig" $pid
  wait $pid
  rc=$?
}
for case in INT:130 TERM:143 HUP:129; do
  signame=SIG${case%:*}
  interrupt "${case%:*}"
  check "$signame stops quantize with exit ${case#*:}" test $rc -eq "${case#*:}"
  check "$signame: the output directory is absent" test ! -e "$tmp/sig"
  check "$signame: no staging directory or temporary file is left" test -z "$(ls -A "$tmp" | grep -e qkeep- -e '\.tmp$')"
  check "$signame: says it was interrupted" contains "$tmp/sig.out" "interrupted"
done
"$qkeep" quantize "$tmp/tiny.safetensors" "$tmp/sig" --scheme w8a8-int8 >/dev/null 2>&1
check "a rerun after an interrupted quantize works" test $? -eq 0
check "... and writes the output" test -f "$tmp/sig/model.safetensors"
# an existing output: refused without --force, replaced whole with it, never a directory of other files
cp "$tmp/sig/model.safetensors" "$tmp/sig.before"
"$qkeep" quantize "$tmp/other.safetensors" "$tmp/sig" --scheme w8a8-int8 >"$tmp/out" 2>&1
check "quantize refuses an existing output without --force" test $? -eq 1
check "... says --force replaces it" contains "$tmp/out" "--force"
check "... and leaves it as it was" cmp -s "$tmp/sig/model.safetensors" "$tmp/sig.before"
"$qkeep" quantize "$tmp/other.safetensors" "$tmp/sig" --scheme w8a8-int8 --force >"$tmp/out" 2>&1
check "quantize --force replaces an output" test $? -eq 0
"$qkeep" quantize "$tmp/other.safetensors" "$tmp/sig.fresh" --scheme w8a8-int8 >/dev/null 2>&1
check "... with the new output" cmp -s "$tmp/sig/model.safetensors" "$tmp/sig.fresh/model.safetensors"
check "... leaving no staging directory" test -z "$(ls -A "$tmp" | grep qkeep-)"
interrupt TERM --force
check "an interrupted quantize --force stops" test $rc -eq 143
check "... leaving the existing output as it was" cmp -s "$tmp/sig/model.safetensors" "$tmp/sig.fresh/model.safetensors"
mkdir -p "$tmp/mine" && echo notes >"$tmp/mine/notes.txt"
"$qkeep" quantize "$tmp/tiny.safetensors" "$tmp/mine" --scheme mxfp4 --force >"$tmp/out" 2>&1
check "--force does not replace a directory of other files" test $? -eq 1
check "... names the file it would lose" contains "$tmp/out" "notes.txt"
check "... which stays" test -f "$tmp/mine/notes.txt"
rm -f "$tmp/big.safetensors"
# missing parent directories are made, as mkdir -p
"$qkeep" quantize "$tmp/tiny.safetensors" "$tmp/new/deeper/out" --scheme mxfp4 >"$tmp/out" 2>&1
check "quantize makes missing parent directories" test -f "$tmp/new/deeper/out/model.safetensors"
"$qkeep" quantize "$tmp/absent.safetensors" "$tmp/new2/out" --scheme mxfp4 >"$tmp/out" 2>&1
check "a failed quantize is 'not found' for a missing input" grep -q "^qkeep: not found: .*absent.safetensors" "$tmp/out"
check "... and removes the parents it made" test ! -e "$tmp/new2"
# errors classed by errno, naming the user's path: permission (as nobody when root), read-only and
# full file systems (a tmpfs in a user namespace, where unshare can make one)
as_user() { if [ "$(id -u)" = 0 ]; then setpriv --reuid=65534 --regid=65534 --clear-groups "$@"; else "$@"; fi; }
mkdir -p "$tmp/locked" && chmod 555 "$tmp/locked"
# (only where that user can reach the build tree and the inputs: a clone under a 0700 directory is not)
can_as_user() { as_user "$qkeep" version >/dev/null 2>&1 && as_user test -r "$tmp/tiny.safetensors"; }
if can_as_user; then
  as_user "$qkeep" quantize "$tmp/tiny.safetensors" "$tmp/locked/out" --scheme mxfp4 >"$tmp/out" 2>&1
  check "an unwritable parent is 'permission denied'" grep -q "^qkeep: permission denied: $tmp/locked/out" "$tmp/out"
fi
chmod 755 "$tmp/locked"
if unshare -rm true 2>/dev/null; then
  mkdir -p "$tmp/mnt"
  unshare -rm sh -c "mount -t tmpfs -o ro tmpfs '$tmp/mnt' && '$qkeep' quantize '$tmp/tiny.safetensors' '$tmp/mnt/out' --scheme mxfp4" >"$tmp/out" 2>&1
  check "a read-only file system is named so" grep -q "^qkeep: read-only file system: $tmp/mnt/out" "$tmp/out"
  unshare -rm sh -c "mount -t tmpfs -o size=512k tmpfs '$tmp/mnt' && '$qkeep' quantize '$tmp/tiny.safetensors' '$tmp/mnt/out' --scheme w8a8-int8; ls -A '$tmp/mnt'" >"$tmp/out" 2>&1
  check "a full disk is 'no space left'" grep -q "^qkeep: no space left on device: $tmp/mnt/out/model.safetensors" "$tmp/out"
  check "... naming no temporary file" sh -c "! grep -q -e '\.tmp' -e '\.out\.qkeep-' '$tmp/out'"
  check "... and leaving nothing on it" test "$(tail -n 1 "$tmp/out")" = "$(grep '^qkeep:' "$tmp/out" | tail -n 1)"
fi


# a tensor named "": refused naming the file and saying why
st_write "$tmp/noname.safetensors" '{"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}' 4
"$qkeep" -c "$tmp/qkeep.ini" census "$tmp/noname.safetensors" >"$tmp/out" 2>&1
check "a tensor named \"\" is refused" test $? -eq 1
check "... naming the file and why" grep -q "noname.safetensors: a tensor named \"\" .*every tensor needs a name" "$tmp/out"
# schemes that are not supported list the supported ones
"$qkeep" quantize "$tmp/tiny.safetensors" "$tmp/fp8" --scheme fp8 >"$tmp/out" 2>&1
check "quantize --scheme fp8 is unsupported" grep -q "^qkeep: unsupported: scheme 'fp8'.*modelopt-nvfp4, ct-nvfp4, mxfp4, w8a8-int8" "$tmp/out"
mkdir -p "$tmp/fp8ckpt" && cp "$tmp/tiny.safetensors" "$tmp/fp8ckpt/model.safetensors"
printf '{"quantization_config": {"quant_method": "fp8"}}' >"$tmp/fp8ckpt/config.json"
"$qkeep" -c "$tmp/qkeep.ini" census "$tmp/fp8ckpt" >"$tmp/out" 2>&1
check "an fp8 checkpoint is unsupported, listing what is read" grep -q "'fp8' is not supported (qkeep reads modelopt, compressed-tensors" "$tmp/out"
# config sections for a backend outside the chain: an error with file:line, a close name suggested
printf '[qkeep]\nbackend = reference\n[backend.refrence]\nactivations = int8\n' >"$tmp/typo.ini"
"$qkeep" -c "$tmp/typo.ini" census "$tmp/tiny.safetensors" >"$tmp/out" 2>&1
check "a misspelt backend section is an error" test $? -eq 1
check "... with file:line and the close name" contains "$tmp/out" "typo.ini:3: \[backend.refrence\]: no backend 'refrence' in the chain (did you mean \[backend.reference\]?)"
printf '[qkeep]\nbackend = reference\nplugin_dir = %s:\n' "$build/plugins/cpu/.libs" >"$tmp/emptydir.ini"
"$qkeep" -c "$tmp/emptydir.ini" census "$tmp/tiny.safetensors" >"$tmp/out" 2>&1
check "an empty plugin_dir entry is an error with its line" contains "$tmp/out" "emptydir.ini:3: \[qkeep\] plugin_dir: empty entry"
# a Hugging Face hub cache repository root resolves to the snapshot refs/main names
hub="$tmp/hub/models--org--tiny"
mkdir -p "$hub/refs" "$hub/blobs" "$hub/snapshots/0123abcd"
cp "$tmp/w0/model.safetensors" "$hub/blobs/5f3e"
cp "$tmp/w0/config.json" "$hub/snapshots/0123abcd/config.json"
ln -s ../../blobs/5f3e "$hub/snapshots/0123abcd/model.safetensors"
printf '0123abcd' >"$hub/refs/main"
"$qkeep" -c "$tmp/qkeep.ini" census "$hub" --json >"$tmp/doc" 2>"$tmp/err"
check "a hub cache repository root loads" test "$("$jsonget" ok <"$tmp/doc")" = true
check "... the snapshot of refs/main" test "$("$jsonget" digest <"$tmp/doc")" = \
  "$("$qkeep" -c "$tmp/qkeep.ini" census "$tmp/w0" --json 2>/dev/null | "$jsonget" digest)"
printf 'feed' >"$hub/refs/main"
"$qkeep" -c "$tmp/qkeep.ini" census "$hub" >"$tmp/out" 2>&1
check "a hub repository whose refs/main names no snapshot says so" contains "$tmp/out" "refs/main names revision feed, but snapshots/feed is absent"
# an input that cannot be read is 'permission denied', naming it
cp "$tmp/tiny.safetensors" "$tmp/secret.safetensors" && chmod 600 "$tmp/secret.safetensors"
if [ "$(id -u)" = 0 ] && can_as_user; then
  as_user "$qkeep" -c "$tmp/qkeep.ini" census "$tmp/secret.safetensors" >"$tmp/out" 2>&1
  check "an unreadable checkpoint is 'permission denied'" grep -q "^qkeep: permission denied: $tmp/secret.safetensors" "$tmp/out"
fi

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
# Online quantization: `reload --quantize S` of the bf16 examples is identical to a cold W1, moves no
# pointer, and lands the bytes of the checkpoint qkeep quantize wrote with the same options.
for scheme in modelopt-nvfp4 ct-nvfp4 mxfp4 w8a8-int8 gptq-int4 awq-int4; do
  "$qkeep" -c "$default" reload --quantize "$scheme" --kv-scales -a 4 "$build/examples/tiny" \
    "$build/examples/tiny-w1" >"$tmp/out" 2>&1
  check "reload --quantize $scheme exits 0" test $? -eq 0
  check "reload --quantize $scheme identical to a cold W1" contains "$tmp/out" "identical"
  check "reload --quantize $scheme moves no pointer" grep -Eq "data pointers +([0-9]+) of \\1 unchanged" "$tmp/out"
  "$qkeep" -c "$default" reload --json --quantize "$scheme" --kv-scales -a 4 "$build/examples/tiny" \
    "$build/examples/tiny-w1" >"$tmp/doc" 2>/dev/null
  "$qkeep" -c "$default" census --json "$build/examples/tiny-w1-$scheme" >"$tmp/doc2" 2>/dev/null
  check "reload --quantize $scheme equals quantize-then-load" \
    test "$("$jsonget" digest_reload <"$tmp/doc")" = "$("$jsonget" digest <"$tmp/doc2")"
  "$qkeep" -c "$default" census --json --quantize "$scheme" --kv-scales -a 4 "$build/examples/tiny" >"$tmp/doc" 2>/dev/null
  check "census --quantize $scheme counts the class" test "$("$jsonget" quantized_on_load <"$tmp/doc")" = 30
done
"$qkeep" -c "$default" census --group 64 "$build/examples/tiny" >"$tmp/out" 2>&1
check "--group without --quantize is a usage error" test $? -eq 2
"$qkeep" -c "$default" census --quantize mxfp4 --asym "$build/examples/tiny" >"$tmp/out" 2>&1
check "--asym does not apply to --quantize mxfp4" test $? -eq 2
printf '[qkeep]\nbackend = reference\nplugin_dir = %s\n[model]\ncheckpoint = %s\nquantize = w8a8-int8\nquantize_kv_scales = true\nquantize_activation_amax = 4\n' \
  "$build/plugins/cpu/.libs" "$build/examples/tiny" >"$tmp/online.ini"
"$qkeep" -c "$tmp/online.ini" census --json >"$tmp/doc" 2>/dev/null
printf '[qkeep]\nbackend = reference\nplugin_dir = %s\n' "$build/plugins/cpu/.libs" >"$tmp/plain.ini"
"$qkeep" -c "$tmp/plain.ini" census --json "$build/examples/tiny-w8a8-int8" >"$tmp/doc2" 2>/dev/null
check "[model] quantize loads as the quantized checkpoint" \
  test "$("$jsonget" digest <"$tmp/doc")" = "$("$jsonget" digest <"$tmp/doc2")"
printf '[model]\nquantize = fp8\n' >"$tmp/bad.ini"
"$qkeep" -c "$tmp/bad.ini" census "$build/examples/tiny" >"$tmp/out" 2>&1
check "[model] quantize names the line of an unknown scheme" contains "$tmp/out" "bad.ini:2"
# A quantize_* key the scheme does not take is refused as the flag is (one table in the library).
printf '[qkeep]\nbackend = reference\nplugin_dir = %s\n[model]\nquantize = mxfp4\nquantize_asym = true\n' \
  "$build/plugins/cpu/.libs" >"$tmp/asym.ini"
"$qkeep" -c "$tmp/asym.ini" census "$build/examples/tiny" >"$tmp/out" 2>&1
check "[model] quantize_asym with mxfp4 is refused" test $? -ne 0
check "... on its line, naming the key and the scheme" contains "$tmp/out" \
  "asym.ini:6: \\[model\\] quantize_asym does not apply to quantize = mxfp4 (only to gptq-int4"
"$qkeep" -c "$default" census --quantize mxfp4 --asym "$build/examples/tiny" >"$tmp/out" 2>&1
check "--asym with --quantize mxfp4 names where it applies" contains "$tmp/out" \
  "--asym does not apply to --quantize mxfp4 (only to gptq-int4"
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
# "no device" says what is missing, once (GPU backends built on a machine without that GPU)
"$qkeep" -c "$default" plugins >"$tmp/out" 2>&1
"$qkeep" -c "$default" census "$build/examples/tiny-w8a8-int8" >/dev/null 2>"$tmp/warn"
if [ -f "$build/plugins/cuda/.libs/backend-cuda-nvfp4.so" ] && ! ls /dev/nvidia* >/dev/null 2>&1 && [ ! -e /proc/driver/nvidia ]; then
  check "cuda-nvfp4 without a driver says so" grep -q "^cuda-nvfp4 .*no device: no NVIDIA driver or device (/dev/nvidia\* and /proc/driver/nvidia absent)" "$tmp/out"
  check "... and its skip warning too" grep -q "backend cuda-nvfp4 skipped: no NVIDIA driver or device" "$tmp/warn"
  check "... never 'driver version is insufficient'" sh -c "! grep -q 'insufficient' '$tmp/out' '$tmp/warn'"
fi
if [ -f "$build/plugins/rocm/.libs/backend-rocm-mxfp4.so" ] && [ ! -e /dev/kfd ]; then
  check "rocm-mxfp4 without /dev/kfd says so" grep -q "^rocm-mxfp4 .*no device: no AMD GPU (/dev/kfd absent)" "$tmp/out"
  check "... never 'no device' twice" sh -c "! grep -q 'no device.*no device' '$tmp/out' '$tmp/warn'"
fi
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
# ... and checkpoints that qkeep quantize writes from f32 and f16 sources, in every scheme. In the
# sanitized build each scheme from one of the two (alternating; the source dtype is read by code all
# schemes share): plain make check runs every pair.
parity=0
for dtype in f32 f16; do
  "$build/tests/make_tiny" "$tmp/src-$dtype.safetensors" 3 $dtype
  "$build/tests/make_tiny" "$tmp/src1-$dtype.safetensors" 4 $dtype
  for scheme in w8a8-int8 modelopt-nvfp4 ct-nvfp4 mxfp4 gptq-int4 awq-int4 ct-int4; do
    parity=$((1 - parity))
    [ -n "${QKEEP_TEST_SANITIZED:-}" ] && [ $parity -eq 0 ] && continue
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
