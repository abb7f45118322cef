#!/usr/bin/env bash
# Where a GPU training step's time goes, kernel by kernel: one `strata bench step` under Nsight Compute (ncu),
# timing every kernel it launches (gpu__time_duration; caches and clocks left as they run, not flushed or
# locked), then a table of the kernels by total time — what `bench kernels` cannot split (an op's permute and
# its flash kernel, a matmul's bf16 rounding passes and its GEMM). With --details REGEX, instead, what limits
# the kernels whose names match REGEX: ncu's throughput, occupancy, warp-stall and pipe sections for their
# first 16 launches (details.txt; of GPT-2 124M's flash kernels: the 12 forwards, then one of each backward
# kernel). Run on the GPU machine:
#   scripts/gpu-profile.sh [--strata PATH] [--out DIR] [--top N] [--details REGEX] [-- BENCH STEP OPTIONS]
# Defaults: build/strata (or .gpu/strata, the gpu-check bundle's, with its libraries), out gpu-profile-out/,
# the 30 heaviest kernels, and GPT-2 124M (B=8, T=1024, bf16) for one step without warm-up. Writes the raw
# CSV (ncu.csv) and the table (kernels.txt) under DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

strata="" out=gpu-profile-out top=30 details=""
valid="valid: --strata PATH, --out DIR, --top N, --details REGEX, -- BENCH STEP OPTIONS"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --strata|--out|--top|--details)
      [[ $# -ge 2 ]] || { echo "gpu-profile.sh: '$1' needs a value ($valid)" >&2; exit 2; } ;;&
    --strata) strata="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --top) top="$2"; shift 2 ;;
    --details) details="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "gpu-profile.sh: unknown option '$1' ($valid)" >&2; exit 2 ;;
  esac
done
[[ $top =~ ^[1-9][0-9]*$ ]] || { echo "gpu-profile.sh: --top $top: not a positive whole number" >&2; exit 2; }
bench=("$@")
[[ ${#bench[@]} -gt 0 ]] || bench=(--device cuda --precision bf16 --layers 12 --heads 12 --width 768 --vocab 50257
                                   --context 1024 --batch 8 --steps 1 --warmup 0)

if [[ -z $strata ]]; then
  if [[ -x build/strata ]]; then
    strata=build/strata
  elif [[ -x .gpu/strata ]]; then
    strata=.gpu/strata
  else
    echo "gpu-profile.sh: no build/strata or .gpu/strata: build, or say --strata PATH" >&2; exit 2
  fi
fi
if [[ $strata == .gpu/strata ]]; then
  source scripts/gpu_bundle.sh
  bundle_library_path .gpu
fi
ncu=$(command -v ncu || true)
for d in /opt/nvidia/nsight-compute/*/ /usr/local/cuda/bin/; do
  [[ -n $ncu ]] && break
  [[ -x ${d}ncu ]] && ncu=${d}ncu
done
[[ -n $ncu ]] || { echo "gpu-profile.sh: ncu (Nsight Compute) not found on PATH or under /opt/nvidia" >&2; exit 2; }

mkdir -p "$out"
if [[ -n $details ]]; then
  echo "== $strata bench step ${bench[*]} under $ncu: what limits the kernels matching '$details'"
  "$ncu" --target-processes all --kernel-name "regex:$details" --launch-count 16 --cache-control none \
    --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats \
    --log-file "$out/details.txt" "$strata" bench step "${bench[@]}" >"$out/bench.txt"
  cat "$out/details.txt"
  exit 0
fi
echo "== $strata bench step ${bench[*]} under $ncu"
"$ncu" --target-processes all --metrics gpu__time_duration.sum --cache-control none --clock-control none \
  --csv --page raw --print-units base --log-file "$out/ncu.csv" "$strata" bench step "${bench[@]}" >"$out/bench.txt"
cat "$out/bench.txt"
python3 - "$out/ncu.csv" "$top" <<'PY' | tee "$out/kernels.txt"
import csv, re, sys
path, top = sys.argv[1], int(sys.argv[2])
rows, header = [], None
with open(path, newline="") as f:
    for rec in csv.reader(f):
        if header is None:
            if rec and rec[0] == "ID":
                header = rec
            continue
        if rec and rec[0].isdigit():
            rows.append(dict(zip(header, rec)))
if not rows:
    sys.exit(f"{path}: no kernel rows (did ncu profile anything?)")
def short(name):
    # "void ns::(anonymous)::kernel<64>(float*, ...)" -> "kernel<64>"; cuBLAS's own names are kept whole.
    name = re.sub(r"\(.*\)$", "", name.replace("(anonymous namespace)::", ""))
    name = re.sub(r"^void ", "", name)
    return name.split("::")[-1][:60]
total, per = 0.0, {}
for r in rows:
    ns = float(r["gpu__time_duration.sum"])
    total += ns
    k = per.setdefault(short(r["Kernel Name"]), [0.0, 0])
    k[0] += ns
    k[1] += 1
print(f"{len(rows)} kernel launches, {total / 1e6:.3f} ms of GPU time in all")
print(f"{'kernel':60} {'calls':>6} {'ms':>9} {'us/call':>9} {'share':>6}")
for name, (ns, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f"{name:60} {n:6d} {ns / 1e6:9.3f} {ns / n / 1e3:9.1f} {100 * ns / total:5.1f}%")
PY
