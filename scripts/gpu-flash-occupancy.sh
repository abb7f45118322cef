#!/usr/bin/env bash
# The flash attention kernels built for more blocks a multiprocessor (STRATA_FLASH_OCCUPANCY=high: registers
# capped, a few dozen bytes spilled; kernels/cuda/flash_attention.h) against the compiler's own choice, in one
# run on the GPU machine: GPT-2 124M's training step alternating default, high, default, high, then `bench
# kernels`' attention rows at GPT-2 124M's and the 2.5B model's shapes under each. Run on the GPU machine:
#   scripts/gpu-flash-occupancy.sh [--strata PATH]   (default build/strata, or .gpu/strata with its libraries)
set -uo pipefail
cd "$(dirname "$0")/.."

strata=""
valid="valid: --strata PATH"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --strata) [[ $# -ge 2 ]] || { echo "gpu-flash-occupancy.sh: '$1' needs a value ($valid)" >&2; exit 2; }
              strata="$2"; shift 2 ;;
    *) echo "gpu-flash-occupancy.sh: unknown option '$1' ($valid)" >&2; exit 2 ;;
  esac
done
if [[ -z $strata ]]; then
  if [[ -x build/strata ]]; then strata=build/strata; else strata=.gpu/strata; fi
fi
[[ -x $strata ]] || { echo "gpu-flash-occupancy.sh: no $strata: build, or say --strata PATH" >&2; exit 2; }
if [[ $strata == .gpu/strata ]]; then
  source scripts/gpu_bundle.sh
  bundle_library_path .gpu
fi

status=0
for o in default high default high; do
  echo "== GPT-2 124M step (B=8, T=1024, bf16), STRATA_FLASH_OCCUPANCY=$o"
  STRATA_FLASH_OCCUPANCY=$o "$strata" bench step --device cuda --precision bf16 --layers 12 --heads 12 --width 768 \
    --vocab 50257 --context 1024 --batch 8 --steps 10 --warmup 2 --json 2>/dev/null | tail -1 || status=1
done
for o in default high; do
  for shape in "12 768" "32 2048"; do
    set -- $shape
    echo "== bench kernels, attention rows, $1 heads of width $2, B=8, T=1024, STRATA_FLASH_OCCUPANCY=$o"
    STRATA_FLASH_OCCUPANCY=$o "$strata" bench kernels --layers 1 --heads "$1" --width "$2" --batch 8 --context 1024 \
      --json 2>/dev/null | grep -i attention || status=1
  done
done
exit $status
