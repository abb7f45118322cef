#!/usr/bin/env bash
# Before and after a GPU change, side by side in one call on the GPU machine: the CUDA kernel tests of the new
# build, then `strata bench step` (GPT-2 124M, bf16) of the baseline and the new binary alternating, and both
# `strata bench kernels` tables with the per-op times next to each other.
#   scripts/gpu-ab.sh --bundle DIR [--base REV]   (build machine) build this tree and REV (default: HEAD, so a
#                                                 change not yet committed is measured against its parent
#                                                 state) and put both binaries, the kernel tests and the
#                                                 shared libraries they need into DIR (keep it under 64 MiB)
#   scripts/gpu-ab.sh --from-bundle DIR [--rounds N] [--out DIR] [--pack] [--no-tests]   (GPU machine) measure;
#                                                 N rounds (default 2); --pack: the logs as one DIR.tgz (the device
#                                                 tool brings back at most 8 files); --no-tests: leave out the
#                                                 kernel tests (when gpu-check.sh runs them in the same call)
# The baseline is built in a git worktree under build-ab/ (the first time: a full build). Each run on the GPU
# machine has a time limit (a hang in a new kernel fails that run, not the whole call).
set -euo pipefail

die() { echo "gpu-ab.sh: $*" >&2; exit 2; }
mode="" bundle="" base=HEAD rounds=2 out=gpu-ab-out pack=0 run_tests=1
while [[ $# -gt 0 ]]; do
  valid="valid: --bundle DIR, --from-bundle DIR, --base REV, --rounds N, --out DIR, --pack, --no-tests"
  if [[ $1 == --pack ]]; then pack=1; shift; continue; fi
  if [[ $1 == --no-tests ]]; then run_tests=0; shift; continue; fi
  [[ $1 == -* && $# -ge 2 ]] || die "'$1' needs a value ($valid)"
  case "$1" in
    --bundle) mode=bundle bundle="$2"; shift 2 ;;
    --from-bundle) mode=from-bundle bundle="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) die "unknown option '$1' ($valid)" ;;
  esac
done
[[ -n $mode ]] || die "say --bundle DIR (build machine) or --from-bundle DIR (GPU machine)"
[[ -n $bundle && -n $out ]] || die "an empty DIR"
[[ $rounds =~ ^[1-9][0-9]*$ ]] || die "--rounds $rounds: not a positive whole number"
bundle=$(realpath -m -- "$bundle") out=$(realpath -m -- "$out")  # the caller's relative paths, canonical
cd "$(dirname "$0")/.."
source scripts/gpu_bundle.sh
root=$(realpath .)
# --bundle empties DIR: never the repository, a build directory, or anything holding them.
if [[ $mode == bundle ]] &&
   [[ $bundle == / || $bundle == "$root" || $bundle == "$root"/build* || $root == "$bundle"/* ]]; then
  die "--bundle $bundle: not a directory to empty (give a new one, e.g. .gpu)"
fi

if [[ $mode == bundle ]]; then
  rev=$(git rev-parse --verify -q "$base^{commit}") || die "--base $base: no such commit"
  make build BUILD=build >/dev/null
  cmake --build build --target kernels_cuda_test -j"$(nproc)" >/dev/null
  tree=build-ab/tree
  if [[ ! -d $tree ]]; then
    git worktree add --detach "$tree" "$rev" >/dev/null
  else
    git -C "$tree" checkout -q --detach "$rev"
  fi
  make -C "$tree" build BUILD=build >/dev/null
  rm -rf "$bundle" && mkdir -p "$bundle/lib"
  cp build/strata "$bundle/strata_new"
  cp "$tree/build/strata" "$bundle/strata_base"
  cp build/tests/kernels/kernels_cuda_test "$bundle/"
  bundle_libs "$bundle" "$bundle/strata_new" "$bundle/kernels_cuda_test"
  git -C "$tree" log -1 --format='%h %s' >"$bundle/base.txt"
  {
    git log -1 --format='%h %s'
    [[ -z $(git status --porcelain) ]] || echo "(and uncommitted changes)"
  } >"$bundle/new.txt"
  bundle_fits "$bundle" || die "bundle too big to carry"
  echo "gpu-ab.sh: bundle in $bundle ($(du -sh "$bundle" | cut -f1)): base $(cat "$bundle/base.txt")"
  exit 0
fi

bundle_require "$bundle" strata_base strata_new kernels_cuda_test base.txt || exit 2
bundle_library_path "$bundle"
mkdir -p "$out"
[[ $pack == 1 ]] && trap 'bundle_pack_out "$out"' EXIT
echo "base: $(cat "$bundle/base.txt" 2>/dev/null)"; echo "new:  $(cat "$bundle/new.txt" 2>/dev/null)"
status=0
if ((run_tests == 0)); then
  echo "kernels_cuda_test: not run (--no-tests)"
elif timeout -k 10 300 "$bundle/kernels_cuda_test" >"$out/kernels_cuda_test.log" 2>&1; then
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\{0,1\}, listed below.*/\1/p' "$out/kernels_cuda_test.log")
  echo "kernels_cuda_test (new): ok${skipped:+, but $skipped skipped: no GPU?}"
else
  status=1; echo "kernels_cuda_test (new): FAILED"
  grep -E -B2 -A12 'Failure|^\[  FAILED' "$out/kernels_cuda_test.log" | head -60 ||
    tail -20 "$out/kernels_cuda_test.log"
fi
step=(bench step --device cuda --precision bf16 --layers 12 --heads 12 --width 768 --vocab 50257 --context 1024
      --batch 8 --steps 10 --warmup 2 --json)
echo; echo "== bench step, GPT-2 124M B=8 T=1024 bf16, alternating (ms/step, loss)"
for ((r = 1; r <= rounds; ++r)); do
  for v in base new; do
    if ! timeout -k 10 180 "$bundle/strata_$v" "${step[@]}" 2>"$out/step_$v.log" >"$out/step_${v}_$r.json"; then
      status=1; echo "$v: bench step failed or ran past 180 s:"; tail -5 "$out/step_$v.log"; continue
    fi
    # A loss that is not finite comes as null: printed, and a failure.
    python3 -c 'import json, math, sys; d = json.load(open(sys.argv[1])); loss = d.get("loss")
ok = isinstance(loss, (int, float)) and math.isfinite(loss)
print("%-5s %8.3f ms  loss %s" % (sys.argv[2], d["step_ms"], "%.9g" % loss if ok else "%s (not finite)" % loss))
sys.exit(0 if ok else 1)' "$out/step_${v}_$r.json" "$v" ||
      { status=1; head -c 300 "$out/step_${v}_$r.json"; echo; }
  done
done
echo; echo "== bench kernels: ms per call, base -> new"
for v in base new; do
  timeout -k 10 180 "$bundle/strata_$v" bench kernels >"$out/kernels_$v.txt" 2>&1 ||
    { status=1; echo "$v: bench kernels failed or ran past 180 s:"; tail -20 "$out/kernels_$v.txt"; }
done
python3 - "$out/kernels_base.txt" "$out/kernels_new.txt" <<'PY' || status=1
import sys
def ops(path):
    rows = {}
    for line in open(path):
        f = line.split()
        if len(f) >= 7 and f[-6].isdigit():
            try:
                rows[" ".join(f[:-6])] = float(f[-5])
            except ValueError:
                pass
    return rows
base, new = ops(sys.argv[1]), ops(sys.argv[2])
for name, b in base.items():
    n = new.get(name)
    if n is not None:
        print(f"{name:20} {b:8.3f} -> {n:8.3f}   x{b / n:5.2f}" if n > 0 else f"{name:20} {b:8.3f} -> {n:8.3f}")
for name, n in new.items():  # rows only the new binary has (e.g. the attention's other implementation)
    if name not in base:
        print(f"{name:20} {'':8} -> {n:8.3f}   (new only)")
for path in sys.argv[1:]:
    print([l.strip() for l in open(path) if l.startswith("one step")][-1:])
PY
exit $status
