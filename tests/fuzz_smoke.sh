#!/bin/sh
# fuzz_smoke.sh: a short run of each fuzz target (tests/fuzz_*.c) for `make check`.
# Writes the seed corpus (tests/fuzz_seeds: a small model in every scheme, its
# safetensors file and configs, conf/*.ini), then, where configure found a clang
# that links -fsanitize=fuzzer, runs each libFuzzer build (tests/fuzz/) for
# FUZZ_SECONDS (default 4) from those seeds; elsewhere it replays the seeds through
# each target's plain main() (tests/fuzz_replay.c). A crash, a leak or a target's
# own check (an abort) fails the test and prints the input's path and the log.
set -u
b=${QKEEP_TEST_BUILDDIR:-.}
s=${QKEEP_TEST_SRCDIR:-.}
tmp=$(mktemp -d /tmp/qkeep-fuzz.XXXXXX) || exit 1
trap 'rm -rf "$tmp"' EXIT
"$b/tests/fuzz_seeds" "$tmp/seeds" "$s" || { echo "fuzz_smoke: writing the seeds failed"; exit 1; }
fail=0
for t in safetensors configs checkpoint; do
  case $t in
    safetensors) max=4096 ;;
    configs) max=2048 ;;
    *) max=65536 ;;
  esac
  if [ -x "$b/tests/fuzz/fuzz_$t" ]; then
    mkdir "$tmp/corpus-$t"
    if QKEEP_PLUGIN_PATH="$b/tests/fuzz" TMPDIR="$tmp" "$b/tests/fuzz/fuzz_$t" -max_len=$max \
         -max_total_time="${FUZZ_SECONDS:-4}" -rss_limit_mb=2048 -artifact_prefix="$tmp/" \
         "$tmp/corpus-$t" "$tmp/seeds/$t" >"$tmp/$t.log" 2>&1; then
      echo "fuzz_$t: $(grep -E '^Done [0-9]+ runs' "$tmp/$t.log")"
    else
      echo "FAIL: fuzz_$t (libFuzzer); its log:"
      tail -n 60 "$tmp/$t.log"
      fail=1
    fi
  elif ! "$b/tests/fuzz_${t}_replay" "$tmp/seeds/$t"; then
    echo "FAIL: fuzz_$t (seed replay)"
    fail=1
  fi
done
exit $fail
