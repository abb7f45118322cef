#!/usr/bin/env bash
# One device call that spends a short GPU lease in priority order (sessions get 15 minutes of device time, one
# command at most 10): the CUDA tests, the before/after step (gpu-ab), the PyTorch step, the 2.5B model's FLOPs
# utilisation, the kernel profile (gpu-profile), GPT-2 124M's offload rows, and training on 2 ranks — each
# under its own limit and all under one deadline, so the parts that do not fit are named as not run instead of
# cutting the call off. Every part's output goes to a file under OUT (the device tool returns only the last
# 12 000 characters printed), packed at the end into at most 8 files. On the build machine first:
#   scripts/gpu-check.sh --bundle .gpu [&& scripts/gpu-ab.sh --bundle .gpu-ab --base REV]
# then on the GPU machine, carrying .gpu and, if made, .gpu-ab's own files (.gpu-ab/strata_base, base.txt,
# new.txt: both bundles whole are over the 64 MiB a call carries; the rest of .gpu-ab is .gpu's, linked here):
#   scripts/gpu-session.sh --out $OUT [--deadline SECONDS]   (default 540)
set -uo pipefail
cd "$(dirname "$0")/.."

out="" deadline=540
valid="valid: --out DIR, --deadline SECONDS"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out|--deadline) [[ $# -ge 2 ]] || { echo "gpu-session.sh: '$1' needs a value ($valid)" >&2; exit 2; } ;;&
    --out) out="$2"; shift 2 ;;
    --deadline) deadline="$2"; shift 2 ;;
    *) echo "gpu-session.sh: unknown option '$1' ($valid)" >&2; exit 2 ;;
  esac
done
[[ -n $out ]] || { echo "gpu-session.sh: say --out DIR ($valid)" >&2; exit 2; }
[[ $deadline =~ ^[0-9]+$ ]] || { echo "gpu-session.sh: --deadline $deadline: not a whole number of seconds" >&2; exit 2; }
[[ -x .gpu/strata ]] || { echo "gpu-session.sh: no .gpu bundle here (scripts/gpu-check.sh --bundle .gpu)" >&2; exit 2; }
mkdir -p "$out/runs"
source scripts/gpu_bundle.sh
bundle_library_path .gpu
end=$((SECONDS + deadline))
declare -a rows
finish() {
  echo; printf '%-44s %s\n' part result
  printf '%s\n' "${rows[@]}"
  printf '%s\n' "${rows[@]}" >"$out/runs/summary.txt"
  bundle_pack_out "$out/runs"
}
trap finish EXIT

# part LIMIT NAME CMD...: CMD under min(LIMIT, what is left) seconds, its output in runs/NAME.log.
part() {
  local limit=$1 name=$2 left rc=0; shift 2
  left=$((end - SECONDS))
  if ((left < 20)); then rows+=("$(printf '%-44s %s' "$name" "not run: deadline")"); return; fi
  ((limit < left)) || limit=$left
  echo "== $name (limit ${limit} s, at ${SECONDS} s)"
  timeout -k 5 "$limit" "$@" >"$out/runs/$name.log" 2>&1 || rc=$?
  local what=ok
  ((rc == 0)) || what="FAILED (rc $rc$( ((rc == 124 || rc == 137)) && echo ", past ${limit} s"))"
  rows+=("$(printf '%-44s %s' "$name" "$what, ${SECONDS} s")")
  tail -3 "$out/runs/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/runs/gpu.txt"
# Where cuDNN is on this machine and which version, for the fused-attention route (issue 6 allows cuDNN's, chosen
# at run time): the bundle cannot carry it, so it would be loaded from here.
timeout 30 python3 - >"$out/runs/cudnn.txt" 2>&1 <<'PY'
import ctypes, glob, os, subprocess
found = []
try:
    import nvidia.cudnn
    found += glob.glob(os.path.join(list(nvidia.cudnn.__path__)[0], "lib", "libcudnn.so*"))
except Exception as e:
    print("no nvidia.cudnn package:", e)
try:
    import torch
    found += glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudnn.so*"))
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
except Exception as e:
    print("torch:", e)
found += glob.glob("/usr/local/cuda*/lib64/libcudnn.so*") + glob.glob("/usr/lib/x86_64-linux-gnu/libcudnn.so*")
for path in sorted(set(found)):
    try:
        print(path, "version", ctypes.CDLL(path).cudnnGetVersion())
    except OSError as e:
        print(path, "does not load:", e)
print(subprocess.run(["sh", "-c", "ldconfig -p | grep -i cudnn"], capture_output=True, text=True).stdout or
      "ldconfig: no cudnn")
# The numbers cudnn_attention.cpp assumes for 9.21's fused forward and band mask (from third-party copies of newer
# headers): what this cuDNN's own header says.
import re
headers = []
for lib in sorted(set(found)):
    headers += glob.glob(os.path.join(os.path.dirname(lib), "..", "include", "cudnn_graph*.h"))
for header in headers[:1]:
    print("in", os.path.realpath(header) + ":")
    for line in open(header):
        if re.search(r"SDPA_FWD_(SUBGRAPH|SOFTMAX|DESCRIPTOR)|DIAGONAL_BAND_MASK|OPERATION_SOFTMAX", line):
            print(" ", line.strip())
PY
part 120 cuda-tests scripts/gpu-check.sh --from-bundle .gpu --out "$out/gc" --no-bench --no-ranks --pack
# This GPU as cuDNN describes it (kernels_cuda_test CudnnAttentionGraphs prints it): committed under
# tests/fixtures/cudnn/, it lets machines without the GPU have cuDNN choose engines for the attention's graphs.
tar xzf "$out/gc.tgz" -O --wildcards '*kernels_cuda_test.log' 2>/dev/null | grep '^cuDNN device properties' \
  >"$out/runs/cudnn-device-properties.txt" || echo "no cuDNN device properties printed" >"$out/runs/cudnn-device-properties.txt"
if [[ -x .gpu-ab/strata_base ]]; then
  [[ -e .gpu-ab/strata_new ]] || ln -s ../.gpu/strata .gpu-ab/strata_new
  [[ -e .gpu-ab/kernels_cuda_test ]] || ln -s ../.gpu/kernels_cuda_test .gpu-ab/kernels_cuda_test
  [[ -e .gpu-ab/lib ]] || ln -s ../.gpu/lib .gpu-ab/lib
  part 90 ab scripts/gpu-ab.sh --from-bundle .gpu-ab --no-tests --out "$out/ab" --pack
fi
S=.gpu/strata
g124=(--device cuda --precision bf16 --layers 12 --heads 12 --width 768 --vocab 50257 --context 1024 --batch 8)
g25=(--device cuda --precision bf16 --layers 48 --heads 32 --width 2048 --context 1024 --steps 2 --warmup 1
     --offload-optimizer cpu --json)
# Issue 6's two speed targets first: the step against PyTorch's in the same call, then the 2.5B model's
# utilisation with micro-batches of 8 (GEMMs at N = 8192, and a micro-batch's compute about as long as the CPU
# Adam it has to hide), unclipped with every sub-group's update started during the last backward, at 4 and 8
# micro-batches a step (32K and 64K tokens), then at 4 without the early updates, for what they buy.
part 120 pytorch env PYTHONUNBUFFERED=1 python3 scripts/bench_step_torch.py --device cuda --compile --sdpa \
  --precision bf16 --layers 12 --heads 12 --width 768 --context 1024 --batch 8 --steps 10 --warmup 3
# cuDNN's fused attention against the flash kernels (the step alternating, and bench kernels): attention is the
# largest lever left on the step (5.3 of 24 ms at about a fifth of its bound on 2026-11-28).
# Both of its backward forms: deterministic (dP through a B·NH·T² workspace) and accumulating dQ with atomics.
part 170 cudnn-attention scripts/gpu-variants.sh --strata .gpu/strata STRATA_ATTENTION=cudnn \
  "STRATA_ATTENTION=cudnn STRATA_CUDNN_DETERMINISTIC=0"
# And training steps through it against the CPU backend's (head size 16: cuDNN's, not the flash kernels').
part 60 cudnn-train env STRATA_ATTENTION=cudnn .gpu/engine_gpu_train_test
# The weights' bf16 working copies (on by default since 2026-11-28) against every linear rounding its own weight,
# alternating: by arithmetic about 1.5% of GPT-2 124M's step (one rounding pass over the weights a step, where
# the forward and the backward each made one).
part 60 working-copies bash -c 'S=$1; shift; for i in 1 2; do for f in "" --no-working-copies; do
  echo "round $i: ${f:-with working copies}"; "$S" bench step "$@" --steps 10 --warmup 2 $f 2>&1 | tail -2; done; done' \
  _ "$S" "${g124[@]}"
spares=(--grad-clip 0 --speculative-sub-groups 1000)
# offload_optimizer.ratio (2026-11-28): the first units' optimizer state kept on the device, so the updates the
# next forward waits for first (the embedding's, 31% of GPT-2 124M) run as CUDA kernels; GPT-2 124M with the
# optimizer in host memory and spares, all offloaded against 0.6 (54.3 ms a step all offloaded on 2026-11-28).
part 60 ratio-124m bash -c 'S=$1; shift; for r in 1 0.6; do echo "offload ratio $r"
  "$S" bench step "$@" --offload-optimizer cpu --grad-clip 0 --speculative-sub-groups 1000 --offload-ratio $r \
    --steps 6 --warmup 2 2>&1 | tail -6; done' _ "$S" "${g124[@]}"
part 200 mfu-2.5b-8x4-spares "$S" bench step "${g25[@]}" --batch 8 --grad-accum 4 "${spares[@]}"
# The same with the first 30% of the parameters' optimizer state on the device: about the share of the CPU Adam
# (494 ms on 2026-11-24) that the last backward cannot hide.
part 200 mfu-2.5b-8x4-ratio "$S" bench step "${g25[@]}" --batch 8 --grad-accum 4 "${spares[@]}" --offload-ratio 0.7
part 240 mfu-2.5b-8x8-spares "$S" bench step "${g25[@]}" --batch 8 --grad-accum 8 "${spares[@]}"
# Where the 2.5B model's compute goes (31.5% of the GEMM rate at B=2 on 2026-11-24, against the 40% to reach):
# its layers' kernels at B=8 without offload, 4 layers of them (ncu times every kernel one at a time).
part 120 profile-2.5b scripts/gpu-profile.sh --strata .gpu/strata --out "$out/runs/profile-2.5b" -- --device cuda \
  --precision bf16 --layers 4 --heads 32 --width 2048 --vocab 50257 --context 1024 --batch 8 --steps 1 --warmup 0
part 90 profile scripts/gpu-profile.sh --strata .gpu/strata --out "$out/runs/profile"
# The flash kernels run at about a fifth of their roofline (5.3 of GPT-2 124M's 24 ms on 2026-11-28): what
# stalls them (ncu's warp-state, pipe and occupancy sections), before any rewrite.
part 60 flash-details scripts/gpu-profile.sh --strata .gpu/strata --out "$out/runs/flash" --details flash
# The experimental settings against the defaults: the flash kernels built for more blocks a multiprocessor, and
# cuBLASLt's candidates timed per problem (scripts/gpu-variants.sh).
part 150 variants scripts/gpu-variants.sh --strata .gpu/strata STRATA_FLASH_OCCUPANCY=high STRATA_MATMUL_AUTOTUNE=1
part 200 mfu-2.5b-8x4 "$S" bench step "${g25[@]}" --batch 8 --grad-accum 4
part 200 mfu-2.5b-2x32 "$S" bench step "${g25[@]}" --batch 2 --grad-accum 32
part 60 offload-nvme "$S" bench step "${g124[@]}" --offload-param nvme --offload-optimizer nvme --steps 6 --warmup 2 --json
part 45 offload-cpu "$S" bench step "${g124[@]}" --offload-param cpu --offload-optimizer cpu --steps 6 --warmup 2 --rounds 2 --json
for s in 0 1000; do
  part 45 "optimizer-cpu-spares-$s" "$S" bench step "${g124[@]}" --offload-optimizer cpu --grad-clip 0 \
    --speculative-sub-groups $s --steps 6 --warmup 2 --rounds 2 --json
done
part 150 ranks scripts/gpu-check.sh --from-bundle .gpu --out "$out/gr" --no-tests --no-bench --pack
