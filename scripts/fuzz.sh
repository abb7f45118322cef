#!/usr/bin/env bash
# Fuzzes each parser of files Strata reads (tests/fuzz/*_fuzz.cpp) with libFuzzer, under ASan and UBSan.
#   scripts/fuzz.sh [--seconds N] [--build DIR] [--jobs N] [TARGET...]
# Builds the fuzz build (clang, STRATA_FUZZ=ON: the parsers alone, under a minute) in DIR (default
# build-fuzz), then runs every target (or those named) for N seconds (default 600) from its checked-in corpus,
# tests/fuzz/corpus/<target>/. New inputs go to DIR/corpus/<target>/, never into the repository. A crash stops
# the script with a non-zero exit; the input is saved as DIR/crashes/<target>-crash-* and printed: fix the
# parser, then check the input in under tests/fuzz/corpus/<target>/ so the replay test keeps it fixed.
# Prints each target's executions per second.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=600 build=build-fuzz jobs=$(nproc)
targets=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option '$1'" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[[ ${#targets[@]} -gt 0 ]] || targets=(safetensors config state token_shard)

command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ is missing (scripts/install_deps.sh installs it)" >&2; exit 2; }
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  CC=clang CXX=clang++ cmake -S . -B "$build" -DSTRATA_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$build" -j"$jobs" --target $(printf 'fuzz_%s ' "${targets[@]}") >/dev/null

mkdir -p "$build/crashes"
for t in "${targets[@]}"; do
  seeds=tests/fuzz/corpus/$t
  [[ -d "$seeds" ]] || { echo "fuzz.sh: no corpus $seeds" >&2; exit 2; }
  mkdir -p "$build/corpus/$t"
  log="$build/fuzz_$t.log"
  # -rss_limit_mb: a parser that allocates what the input claims (a header's sizes) is a bug too.
  if ! "$build/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
       -artifact_prefix="$build/crashes/$t-" "$build/corpus/$t" "$seeds" >"$log" 2>&1; then
    echo "fuzz.sh: $t crashed; the input and the report:" >&2
    grep -E "^(==|SUMMARY|artifact_prefix|Test unit written)" "$log" | head -20 >&2
    exit 1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  echo "fuzz $t: ${execs:-?} inputs in ${seconds} s (${rate:-?}/s), no crash"
done
