#!/usr/bin/env bash
# Fuzzes each parser of files Strata reads (tests/fuzz/*_fuzz.cpp) with libFuzzer, under ASan and UBSan.
#   scripts/fuzz.sh [--seconds N] [--build DIR] [--jobs N] [TARGET...]
# Builds the fuzz build (clang, STRATA_FUZZ=ON: the parsers alone, under a minute) in DIR (default
# build-fuzz), then runs every target (or those named) for N seconds (default 600) from its checked-in corpus,
# tests/fuzz/corpus/<target>/, N targets at a time (default: one per core). New inputs go to
# DIR/corpus/<target>/, never into the repository. A crash fails the script with a non-zero exit; the input is
# saved as DIR/crashes/<target>-crash-* and printed: fix the parser, then check the input in under
# tests/fuzz/corpus/<target>/ so the replay test keeps it fixed. Prints each target's executions per second.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=600 build=build-fuzz jobs=$(nproc)
targets=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option '$1'" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if [[ ${#targets[@]} -eq 0 ]]; then
  for f in tests/fuzz/*_fuzz.cpp; do f=${f##*/}; targets+=("${f%_fuzz.cpp}"); done
fi

command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ is missing (scripts/install_deps.sh installs it)" >&2; exit 2; }
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  CC=clang CXX=clang++ cmake -S . -B "$build" -DSTRATA_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$build" -j"$jobs" --target $(printf 'fuzz_%s ' "${targets[@]}") >/dev/null

mkdir -p "$build/crashes"
# One target: its log in DIR/fuzz_<target>.log, its summary line (or crash report) in DIR/fuzz_<target>.out.
fuzz_one() {
  local t=$1 seeds=tests/fuzz/corpus/$1 log="$build/fuzz_$1.log" out="$build/fuzz_$1.out"
  mkdir -p "$build/corpus/$t"
  # -rss_limit_mb: a parser that allocates what the input claims (a header's sizes) is a bug too.
  if ! "$build/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
       -artifact_prefix="$build/crashes/$t-" "$build/corpus/$t" "$seeds" >"$log" 2>&1; then
    { echo "fuzz.sh: $t crashed; the input and the report:"
      grep -E "^(==|SUMMARY|artifact_prefix|Test unit written)" "$log" | head -20; } >"$out"
    return 1
  fi
  local execs rate
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  echo "fuzz $t: ${execs:-?} inputs in ${seconds} s (${rate:-?}/s), no crash" >"$out"
}

for t in "${targets[@]}"; do
  [[ -d tests/fuzz/corpus/$t ]] || { echo "fuzz.sh: no corpus tests/fuzz/corpus/$t" >&2; exit 2; }
done
failed=0
for ((i = 0; i < ${#targets[@]}; i += jobs)); do
  pids=()
  for t in "${targets[@]:i:jobs}"; do
    fuzz_one "$t" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  for t in "${targets[@]:i:jobs}"; do
    if grep -q crashed "$build/fuzz_$t.out"; then cat "$build/fuzz_$t.out" >&2; else cat "$build/fuzz_$t.out"; fi
  done
done
exit $failed
