#!/usr/bin/env bash
# Everything that needs a GPU, in one command: build (or take a prebuilt bundle), run the CUDA tests, the GPU
# benchmarks (`strata bench step` plain and with offload, `strata bench kernels`, and the PyTorch GPT-2 step it is
# judged against where PyTorch with CUDA is installed), and print a short table. Run on a machine with an NVIDIA
# GPU, the CUDA toolkit and Strata's build dependencies:
#   scripts/gpu-check.sh                      build into build-gpu/ and check
#   scripts/gpu-check.sh --bundle DIR         (on a build machine, no GPU needed) copy the CUDA test binaries,
#                                             build/strata and the shared libraries they need beyond libc/CUDA
#                                             into DIR
#   scripts/gpu-check.sh --from-bundle DIR    check with a bundle made by --bundle (for GPU machines that lack
#                                             the build dependencies)
# Options: --out DIR (logs and JUnit XML; default gpu-check-out/), --pack (the logs as one DIR.tgz: the device
# tool brings back at most 8 files), --sanitize (also run the tests under compute-sanitizer memcheck), --no-tests,
# --no-bench, --no-ranks (leave out the CUDA tests, the benchmarks, the runs of several ranks), --budget SECONDS
# (default 540: a part that would start later is listed as not run, so one device call of 600 s still prints
# the table). Every run has its own time limit, so a hang costs that run, not the call.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_bundle.sh

mode=build bundle="" out=gpu-check-out sanitize=0 pack=0 run_tests=1 bench=1 ranks=1 budget=540
valid="valid: --bundle DIR, --from-bundle DIR, --out DIR, --pack, --sanitize, --no-tests, --no-bench, --no-ranks, --budget S"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bundle|--from-bundle|--out|--budget)
      [[ $# -ge 2 ]] || { echo "gpu-check.sh: '$1' needs a value ($valid)" >&2; exit 2; } ;;&
    --bundle) mode=bundle bundle="$2"; shift 2 ;;
    --from-bundle) mode=from-bundle bundle="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --budget) budget="$2"; shift 2 ;;
    --pack) pack=1; shift ;;
    --sanitize) sanitize=1; shift ;;
    --no-tests) run_tests=0; shift ;;
    --no-bench) bench=0; shift ;;
    --no-ranks) ranks=0; shift ;;
    *) echo "gpu-check.sh: unknown option '$1' ($valid)" >&2; exit 2 ;;
  esac
done
[[ $budget =~ ^[0-9]+$ ]] || { echo "gpu-check.sh: --budget $budget: not a whole number of seconds" >&2; exit 2; }

tests=(kernels/kernels_cuda_test kernels/kernels_device_test engine/train/engine_gpu_train_test comm/comm_nccl_test
       comm/comm_nccl_plane_test)  # under build*/tests/

if [[ $mode == bundle || $mode == build ]]; then
  build=build-gpu
  [[ $mode == bundle ]] && build=build
  make build BUILD=$build >/dev/null
  for t in "${tests[@]}"; do [[ -x $build/tests/$t ]] || { echo "gpu-check.sh: $build has no tests/$t: was CUDA found at configure time?" >&2; exit 1; }; done
fi

if [[ $mode == bundle ]]; then
  root=$(realpath .) bundle=$(realpath -m -- "$bundle")
  # --bundle empties DIR: never the repository, a build directory, or anything holding them.
  if [[ $bundle == / || $bundle == "$root" || $bundle == "$root"/build* || $root == "$bundle"/* ]]; then
    echo "gpu-check.sh: --bundle $bundle: not a directory to empty (give a new one, e.g. .gpu)" >&2; exit 2
  fi
  rm -rf "$bundle" && mkdir -p "$bundle/lib"
  for bin in "${tests[@]/#/build/tests/}" build/strata; do cp "$bin" "$bundle/"; done
  bundle_libs "$bundle" "${tests[@]/#/build/tests/}" build/strata
  # The demo's token shards (3.7 MB train, 0.4 MB validation; the bundle must stay under 64 MiB), which the
  # runs of several ranks on the GPU train on (data/ is not part of the tree).
  if [[ -f data/sotu/sotu_train_000000.bin && -f data/sotu/sotu_val_000000.bin ]]; then
    mkdir -p "$bundle/data" && cp data/sotu/sotu_{train,val}_000000.bin "$bundle/data/"
  fi
  bundle_fits "$bundle" || exit 1
  echo "gpu-check.sh: bundle in $bundle ($(du -sh "$bundle" | cut -f1)): ${tests[*]}"
  exit 0
fi

bin_dir=build-gpu/tests strata=build-gpu/strata
if [[ $mode == from-bundle ]]; then
  bundle_require "$bundle" strata "${tests[@]##*/}" || exit 2
  bin_dir="$bundle" strata="$bundle/strata"
  bundle_library_path "$bundle"
fi

mkdir -p "$out"
status=0
declare -a rows
# The table, however the script ends (a failed command under set -e included), then the packed logs.
finish() {
  echo
  printf '%-28s %-7s %6s %6s %7s\n' test result passed failed skipped
  [[ ${#rows[@]} -eq 0 ]] || printf '%s\n' "${rows[@]}"
  [[ $pack == 1 ]] && bundle_pack_out "$out"
  return 0
}
trap finish EXIT
# Whether a part may start: false (and a row saying so) once the budget's seconds have passed.
in_budget() {
  ((SECONDS < budget)) && return 0
  rows+=("$(printf '%-28s %-7s %s' "$1" "not run" "time budget ($budget s) spent")")
  return 1
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt" || true

for path in "${tests[@]}"; do
  [[ $run_tests == 1 ]] || break
  t=$(basename "$path")
  [[ $mode == from-bundle ]] && path=$t
  if missing=$(ldd "$bin_dir/$path" 2>/dev/null | grep 'not found'); then
    rows+=("$(printf '%-28s %-7s %s' "$t" "not run" "missing: $(echo "$missing" | awk '{print $1}' | tr '\n' ' ')")")
    continue
  fi
  in_budget "$t" || continue
  rc=0
  timeout -k 10 300 "$bin_dir/$path" --gtest_output=xml:"$out/$t.xml" >"$out/$t.log" 2>&1 || rc=$?
  if ((rc == 0)); then r=ok; else r=FAILED; status=1; fi
  ((rc == 124 || rc == 137)) && echo "$t: ran past 300 s"
  passed=$(grep -c '^\[       OK \]' "$out/$t.log" || true)
  failed=$(grep -c '^\[  FAILED  \] [A-Za-z]' "$out/$t.log" || true)
  skipped=$(grep -c '^\[  SKIPPED \] [A-Za-z]' "$out/$t.log" || true)
  rows+=("$(printf '%-28s %-7s %6s %6s %7s' "$t" "$r" "$passed" "$failed" "$skipped")")
  [[ $r == ok ]] || grep -E -B2 -A12 'Failure|^\[  FAILED' "$out/$t.log" | head -80 || tail -20 "$out/$t.log"
  if [[ $sanitize == 1 ]] && command -v compute-sanitizer >/dev/null; then
    if in_budget "$t memcheck" && timeout -k 10 540 compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$bin_dir/$path" >"$out/$t.memcheck.log" 2>&1; then
      rows+=("$(printf '%-28s %-7s' "$t memcheck" ok)")
    else
      rows+=("$(printf '%-28s %-7s' "$t memcheck" FAILED)"); status=1
      tail -40 "$out/$t.memcheck.log"
    fi
  fi
done

# run_limited SECONDS NAME CMD...: CMD under a time limit; false (saying so) when it fails or runs past it.
run_limited() {
  local limit=$1 name=$2 rc=0; shift 2
  timeout -k 10 "$limit" "$@" || rc=$?
  ((rc == 124 || rc == 137)) && echo "$name: ran past $limit s" >&2
  return $rc
}
if [[ $bench == 1 ]] && in_budget "bench step"; then
  echo; echo "== strata bench step --device cuda (GPT-2 124M, B=8, T=1024, bf16 matmuls)"
  run_limited 180 "bench step" "$strata" bench step --device cuda --precision bf16 --layers 12 --heads 12 --width 768 --vocab 50257 \
    --context 1024 --batch 8 --steps 10 --warmup 2 --json 2>"$out/bench_step.log" | tee "$out/bench_step.jsonl" ||
    { status=1; tail -20 "$out/bench_step.log"; }
  # Offload on the GPU (issue 4's overlap ratio, issue 6's model FLOPs utilisation): one JSON line each.
  gpt2_124m=(--device cuda --precision bf16 --layers 12 --heads 12 --width 768 --vocab 50257 --context 1024 --batch 8)
  for placement in "cpu cpu" "nvme nvme"; do
    set -- $placement
    in_budget "bench offload $1 $2" || continue
    echo; echo "== strata bench step, GPT-2 124M, parameters on $1, optimizer on $2 (step / max(compute, disk, Adam))"
    run_limited 240 "bench offload" "$strata" bench step "${gpt2_124m[@]}" --offload-param "$1" --offload-optimizer "$2" --steps 6 --warmup 2 \
      --rounds 2 --json 2>"$out/bench_offload_$1_$2.log" | tee "$out/bench_offload_$1_$2.jsonl" ||
      { status=1; tail -20 "$out/bench_offload_$1_$2.log"; }
  done
  # ZeRO-Offload (optimizer in host memory) with and without updates started during backward into spare
  # buffers (offload_optimizer.speculative_sub_groups): --grad-clip 0, since the bench's random batches would
  # clip every step, and a step after one that clipped does not speculate.
  for spares in 0 1000; do
    in_budget "bench offload none cpu, $spares spares" || continue
    echo; echo "== strata bench step, GPT-2 124M, optimizer on cpu, no clipping, --speculative-sub-groups $spares"
    run_limited 240 "bench offload" "$strata" bench step "${gpt2_124m[@]}" --offload-optimizer cpu --grad-clip 0 \
      --speculative-sub-groups $spares --steps 6 --warmup 2 --rounds 2 --json \
      2>"$out/bench_offload_spec_$spares.log" | tee "$out/bench_offload_spec_$spares.jsonl" ||
      { status=1; tail -20 "$out/bench_offload_spec_$spares.log"; }
  done
  # A unit's CPU Adam can only overlap the compute between its last micro-batch's backward and the next step's
  # forward of it (about one micro-batch), so the step is about compute + (Adam - one micro-batch). Runs are
  # BxA: A micro-batches of B sequences a step. 8x4: micro-batches of 8 (the GEMMs at N = 8192 rows, and one
  # micro-batch's compute about as long as the 2.5B parameters' CPU Adam); 8x8: 64K tokens a step; 2x32: many
  # small ones; "s": unclipped, with every sub-group's update started during the last backward (spare buffers:
  # 30 GB more host memory), which overlaps the Adam of all but the first units with that backward.
  for run in 8x4s 8x8s 8x4 2x32 2x8s; do
    mb=${run%%x*} rest=${run#*x}
    accum=${rest%s}
    in_budget "bench 2.5B MFU, $run" || continue
    spec=()
    [[ $rest == *s ]] && spec=(--grad-clip 0 --speculative-sub-groups 1000)
    echo; echo "== strata bench step, GPT-2 2.5B (48 layers, width 2048), optimizer on the CPU, $accum micro-batches" \
      "of B=$mb a step ${spec[*]}: model FLOPs utilisation"
    run_limited 240 "bench 2.5B" "$strata" bench step --device cuda --precision bf16 --layers 48 --heads 32 --width 2048 \
      --context 1024 --batch "$mb" --grad-accum "$accum" --steps 2 --warmup 1 --offload-optimizer cpu "${spec[@]}" --json \
      2>"$out/bench_mfu_$run.log" | tee "$out/bench_mfu_$run.jsonl" || { status=1; tail -20 "$out/bench_mfu_$run.log"; }
  done
  if in_budget "bench kernels"; then
    echo; echo "== strata bench kernels (GPT-2 124M shapes, bf16 matmuls)"
    run_limited 120 "bench kernels" "$strata" bench kernels | tee "$out/bench_kernels.txt" || status=1
    run_limited 120 "bench kernels" "$strata" bench kernels --json >"$out/bench_kernels.jsonl" 2>&1 || status=1
  fi
  if ! in_budget "PyTorch step"; then
    :
  elif python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo; echo "== PyTorch GPT-2 124M training step (torch.compile, fused attention, bf16 autocast, fused AdamW)"
    run_limited 240 "PyTorch step" env PYTHONUNBUFFERED=1 python3 scripts/bench_step_torch.py --device cuda --compile --sdpa --precision bf16 \
      --layers 12 --heads 12 --width 768 --context 1024 --batch 8 --steps 10 --warmup 3 \
      2>"$out/torch.log" | tee "$out/torch.jsonl" || { status=1; tail -20 "$out/torch.log"; }
  else
    echo "(PyTorch with CUDA not installed here: the PyTorch peer is not run)"
  fi
fi

# Several ranks sharing the GPU (NCCL refuses two ranks on one device, so parallel.distributed_backend "auto"
# stages their collectives on device buffers through host memory over MPI: comm/staged_communicator.h): data
# parallelism with ZeRO 0-3, tensor and pipeline parallelism (ZeRO-3 also with every shard on NVMe), each against
# the single process on the same GPU with the same global batch. The same sums in another association: the
# losses agree to about 1e-5 relative, not bitwise.
data_dir=data/sotu
[[ $mode == from-bundle ]] && data_dir="$bundle/data"
if [[ $ranks == 0 ]]; then
  :
elif ! in_budget "train on 2 ranks, one GPU"; then
  :
elif ! command -v mpiexec >/dev/null; then
  rows+=("$(printf '%-28s %-7s %s' "train on 2 ranks, one GPU" "not run" "no mpiexec here")")
elif [[ ! -f $data_dir/sotu_train_000000.bin || ! -f $data_dir/sotu_val_000000.bin ]]; then
  rows+=("$(printf '%-28s %-7s %s' "train on 2 ranks, one GPU" "not run" "no token shards in $data_dir (make data)")")
else
  mpi=(mpiexec -np 2)
  mpiexec --version 2>&1 | grep -q -E "Open ?MPI|OpenRTE|open-mpi" && mpi+=(--oversubscribe --allow-run-as-root)
  cat >"$out/multi.json" <<JSON
{"model": {"n_layer": 4, "n_head": 4, "n_embd": 256, "vocab_size": 50257, "block_size": 128},
 "data": {"train": "$data_dir/sotu_train_000000.bin", "val": "$data_dir/sotu_val_000000.bin"},
 "training": {"batch_size": 4, "seq_len": 128, "grad_accum_steps": 2, "max_steps": 8, "lr": 0.001, "warmup_steps": 2,
              "val_every": 8, "val_batches": 2, "checkpoint_every": 0, "keep_checkpoints": 1, "seed": 1337},
 "compute": {"device": "cuda", "matmul_precision": "fp32"}}
JSON
  ckpt=$(mktemp -d)  # checkpoints stay out of $out, which holds logs only
  final_loss() { sed -n 's/.*final loss \([0-9.]*\).*/\1/p' "$1" | tail -1; }
  echo; echo "== strata train on 2 ranks sharing the GPU (collectives staged through host memory)"
  for one in 2 4; do
    run_limited 180 "train one process" "$strata" train --config "$out/multi.json" \
      --set training.grad_accum_steps=$one --checkpoint-dir "$ckpt/one$one" >"$out/multi_one$one.log" 2>&1 ||
      { status=1; tail -20 "$out/multi_one$one.log"; }
  done
  # ZeRO-3 with parameter, optimizer and gradient shards on NVMe: gathers from and reduce-scatters to pinned
  # memory through the staging, the gradient shards read, added to and written back per micro-batch.
  z=zero_optimization
  nvme3="$z.stage=3 $z.offload_param.device=nvme $z.offload_param.nvme_path=$ckpt/swap"
  nvme3+=" $z.offload_optimizer.device=nvme $z.offload_optimizer.nvme_path=$ckpt/swap memory.gradients=nvme"
  for run in "dp_zero0 4 $z.stage=0" "dp_zero1 4 $z.stage=1" "dp_zero2 4 $z.stage=2" "dp_zero3 4 $z.stage=3" \
             "dp_zero3_nvme 4 $nvme3" "tp 2 parallel.tensor_parallel_size=2" "pp 2 parallel.pipeline_parallel_size=2"; do
    set -- $run
    in_budget "train 2 ranks: $1" || continue
    sets=()
    for kv in "${@:3}"; do sets+=(--set "$kv"); done
    if run_limited 180 "train 2 ranks: $1" "${mpi[@]}" "$strata" train --config "$out/multi.json" "${sets[@]}" \
        --checkpoint-dir "$ckpt/$1" >"$out/multi_$1.log" 2>&1; then
      got=$(final_loss "$out/multi_$1.log") want=$(final_loss "$out/multi_one$2.log")
      ok=$(python3 -c "import sys; g, w = float(sys.argv[1]), float(sys.argv[2]); print('ok' if abs(g - w) <= 1e-4 * abs(w) else 'FAILED')" "$got" "$want" 2>/dev/null || echo FAILED)
      [[ $ok == ok ]] || status=1
      rows+=("$(printf '%-28s %-7s loss %s, one process %s' "train 2 ranks: $1" "$ok" "$got" "$want")")
    else
      status=1
      rows+=("$(printf '%-28s %-7s' "train 2 ranks: $1" FAILED)")
      tail -20 "$out/multi_$1.log"
    fi
  done
  rm -rf "$ckpt"
  # The ranks share the GPU, so parallel.distributed_backend "auto" must have staged (NCCL refuses them), saying
  # why, and "nccl" must fail at start, naming the ranks (not hang).
  if [[ -f $out/multi_dp_zero0.log ]]; then
    if grep -q "ranks 0 and 1 share" "$out/multi_dp_zero0.log"; then r=ok; else r=FAILED; status=1; fi
    rows+=("$(printf '%-28s %-7s %s' "2 ranks, one GPU: staged" "$r" "auto saw the shared GPU")")
  fi
  refused=$(mktemp -d)
  if ! in_budget "2 ranks, one GPU: nccl"; then
    :
  elif timeout 120 "${mpi[@]}" "$strata" train --config "$out/multi.json" --set parallel.distributed_backend=nccl \
      --set training.max_steps=1 --checkpoint-dir "$refused" >"$out/multi_nccl.log" 2>&1; then
    r=FAILED
  elif grep -q 'distributed_backend "nccl" for group .*share' "$out/multi_nccl.log"; then
    r=ok
  else
    r=FAILED
  fi
  [[ $r == ok ]] || { status=1; tail -20 "$out/multi_nccl.log"; }
  rows+=("$(printf '%-28s %-7s %s' "2 ranks, one GPU: nccl" "$r" "refused at start, naming the shared GPU")")
  rm -rf "$refused"
  if [[ $bench == 1 ]] && in_budget "bench comm"; then
    echo; echo "== strata bench comm, 2 ranks sharing the GPU (GPU buffers staged through host memory over MPI)"
    run_limited 180 "bench comm" "${mpi[@]}" "$strata" bench comm --device cuda --max-bytes 256M 2>"$out/bench_comm.log" |
      tee "$out/bench_comm.txt" || { status=1; tail -20 "$out/bench_comm.log"; }
  fi
fi

exit $status  # finish() prints the table
