#!/usr/bin/env bash
# The CUDA backend's experimental settings against its defaults, each in one run on the GPU machine: GPT-2 124M's
# training step alternating default, setting, default, setting, then `bench kernels` under each (at GPT-2 124M's
# shapes, and for the flash kernels also at the 2.5B model's). The settings (environment variables, off by
# default until measured): STRATA_FLASH_OCCUPANCY=high (the flash kernels built for more blocks a multiprocessor:
# registers capped, some spilled; kernels/cuda/flash_attention.h), STRATA_MATMUL_AUTOTUNE=1 (each GEMM problem
# times cuBLASLt's candidates once and keeps the fastest; kernels/cuda/ops.h) and STRATA_ATTENTION=cudnn (cuDNN's
# fused attention instead of the flash kernels, where STRATA_CUDNN_LIBRARY or the library path finds cuDNN;
# kernels/cuda/cudnn_attention.h; with STRATA_CUDNN_DETERMINISTIC=0 its backward accumulating dQ with atomics).
# A setting may be several variables in one argument ("A=1 B=2"). Run on the GPU machine:
#   scripts/gpu-variants.sh [--strata PATH] [VAR=VALUE ...]   (default build/strata, or .gpu/strata with its
#                                                              libraries; default the settings above)
set -uo pipefail
cd "$(dirname "$0")/.."

strata="" settings=()
valid="valid: --strata PATH, VAR=VALUE"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --strata) [[ $# -ge 2 ]] || { echo "gpu-variants.sh: '$1' needs a value ($valid)" >&2; exit 2; }
              strata="$2"; shift 2 ;;
    STRATA_*=*) settings+=("$1"); shift ;;
    *) echo "gpu-variants.sh: unknown argument '$1' ($valid)" >&2; exit 2 ;;
  esac
done
[[ ${#settings[@]} -gt 0 ]] || settings=(STRATA_ATTENTION=cudnn "STRATA_ATTENTION=cudnn STRATA_CUDNN_DETERMINISTIC=0"
                                         STRATA_FLASH_OCCUPANCY=high STRATA_MATMUL_AUTOTUNE=1)
if [[ -z $strata ]]; then
  if [[ -x build/strata ]]; then strata=build/strata; else strata=.gpu/strata; fi
fi
[[ -x $strata ]] || { echo "gpu-variants.sh: no $strata: build, or say --strata PATH" >&2; exit 2; }
if [[ $strata == .gpu/strata ]]; then
  source scripts/gpu_bundle.sh
  bundle_library_path .gpu
fi

status=0
errs=$(mktemp "${TMPDIR:-/tmp}/gpu-variants.XXXXXX")
trap 'rm -f "$errs"' EXIT
for setting in "${settings[@]}"; do
  : >"$errs"
  for env in "" "$setting" "" "$setting"; do
    echo "== GPT-2 124M step (B=8, T=1024, bf16), ${env:-defaults}"
    env $env "$strata" bench step --device cuda --precision bf16 --layers 12 --heads 12 --width 768 --vocab 50257 \
      --context 1024 --batch 8 --steps 10 --warmup 2 --json 2>>"$errs" | tail -1 || status=1
  done
  shapes=("12 768")
  [[ $setting == STRATA_FLASH_* || $setting == STRATA_ATTENTION=* ]] && shapes+=("32 2048")
  for env in "" "$setting"; do
    for shape in "${shapes[@]}"; do
      set -- $shape
      echo "== bench kernels, $1 heads of width $2, B=8, T=1024, ${env:-defaults}"
      env $env "$strata" bench kernels --layers 1 --heads "$1" --width "$2" --batch 8 --context 1024 --json \
        2>>"$errs" || status=1
    done
  done
  # What the setting's runs logged about it (cuDNN's plans or why it declined, cuBLASLt's choices), once each.
  echo "== logged under $setting"
  grep -E 'cuDNN|cuBLASLt|STRATA_|rror|ailed|bort' "$errs" | sed -E 's/^\[[^]]*\] //' | sort | uniq -c | head -20
done
exit $status
