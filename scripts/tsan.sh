#!/usr/bin/env bash
# ThreadSanitizer over Strata's own threads: the offload, storage and comm tests and the offloaded training test.
#   scripts/tsan.sh [--build DIR]
# Builds those test binaries with -fsanitize=thread, no CUDA (DIR, default build-tsan), then runs each pinned to
# one CPU, two at a time: TBB, which is not built with ThreadSanitizer, then runs its parallel loops on the
# calling thread, so its hand-offs between workers are not reported as races, while the copy engine's queues,
# the offloaded optimizer's worker, the coordinator's collectives thread and the NVMe queues still run on
# threads of their own. The MPI tests' ranks take tests/comm/tsan_openmpi.supp: Open MPI's own lock order, and
# its progress of one thread's requests from another's calls. Prints each binary's result; exits non-zero on any
# report or failure. Logs: DIR/tsan_<binary>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
build=build-tsan
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "tsan.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
single=(offload/offload_test offload/offload_coordinator_test offload/offload_optimizer_swap_test
        storage/storage_io_test storage/storage_swap_test storage/storage_test
        engine/train/engine_offload_train_test)
ranks=("4 comm/comm_mpi_test" "2 comm/comm_zero3_coordinator_test" "2 comm/comm_dp_train_test"
       "2 comm/comm_zero3_save_test")
targets=("${single[@]##*/}")
for r in "${ranks[@]}"; do targets+=("${r##*/}"); done
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DSTRATA_SANITIZE=thread -DSTRATA_CUDA=OFF >/dev/null || exit 1
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}" >/dev/null || exit 1

export TSAN_OPTIONS="halt_on_error=0 second_deadlock_stack=1 suppressions=$PWD/tests/comm/tsan_openmpi.supp"
# One binary on CPU `cpu`: its result line; non-zero on a report or a failure.
run() {
  local cpu=$1 name=$2; shift 2
  local log="$build/tsan_$name.log"
  timeout 1800 taskset -c "$cpu" "$@" >"$log" 2>&1
  local rc=$? reports
  reports=$(grep -c 'WARNING: ThreadSanitizer' "$log")
  echo "tsan $name: exit $rc, $reports report(s)"
  [[ $rc -eq 0 && $reports -eq 0 ]]
}
lane() {  # cpu, then binaries: "path" or "ranks path"
  local cpu=$1 failed=0; shift
  for spec in "$@"; do
    set -- $spec
    if [[ $# -eq 2 ]]; then
      run "$cpu" "${2##*/}" mpiexec --bind-to none -n "$1" --oversubscribe --allow-run-as-root "$build/tests/$2" || failed=1
    else
      run "$cpu" "${1##*/}" "$build/tests/$1" || failed=1
    fi
  done
  return $failed
}
cpus=$(nproc)
lane 0 "${single[@]:0:4}" "${ranks[@]:0:2}" & a=$!
lane $((cpus > 1 ? 1 : 0)) "${single[@]:4}" "${ranks[@]:2}" & b=$!
wait $a; ra=$?
wait $b; rb=$?
[[ $ra -eq 0 && $rb -eq 0 ]] && echo "tsan: every binary clean" || { echo "tsan: reports or failures above" >&2; exit 1; }
