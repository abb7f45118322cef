#!/usr/bin/env bash
# Strata vs PyTorch 1.13 (CPU, both cores) on the same GPT-2 training step, or (--family llama) the same tied
# Llama's (6 layers, width 384, 6 heads over 2 key/value heads, SwiGLU 1024), side by side in one run.
# Alternates the two ROUNDS times (the machine is shared and noisy; ratios hold, absolute times do not) and
# prints each result and the ratio of the medians.
#   scripts/bench_step_vs_torch.sh [--family gpt2|llama] [--precision fp32|bf16] [--rounds N] [extra `strata bench step` flags]
# Needs PyTorch: scripts/install_deps.sh --torch
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-build/strata}
PRECISION=fp32
ROUNDS=3
FAMILY=gpt2
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --precision) PRECISION=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --family) FAMILY=$2; shift 2 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
[[ -x "$STRATA" ]] || { echo "bench_step_vs_torch.sh: $STRATA not built; run make build" >&2; exit 2; }
/usr/bin/python3 -c "import torch" 2>/dev/null || { echo "bench_step_vs_torch.sh: PyTorch missing; run scripts/install_deps.sh --torch" >&2; exit 2; }
THREADS=$(nproc)
export OMP_NUM_THREADS=$THREADS
MODEL=(--family "$FAMILY" --layers 6 --heads 6 --width 384 --vocab 50257 --context 256 --batch 4)
[[ $FAMILY == llama ]] && MODEL+=(--kv-heads 2 --intermediate 1024)
s_all=(); t_all=()
for r in $(seq "$ROUNDS"); do
  s=$("$STRATA" bench step "${MODEL[@]}" --precision "$PRECISION" --steps 5 --warmup 1 --json "${EXTRA[@]}")
  t=$(/usr/bin/python3 scripts/bench_step_torch.py "${MODEL[@]}" --precision "$PRECISION" --steps 5 --warmup 1 \
        --threads "$THREADS" 2>/dev/null)
  echo "round $r strata:  $s"
  echo "round $r pytorch: $t"
  s_all+=("$(echo "$s" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])')")
  t_all+=("$(echo "$t" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])')")
done
/usr/bin/python3 - "${s_all[*]}" "${t_all[*]}" "$PRECISION" "$FAMILY" <<'PY'
import statistics, sys
s = [float(v) for v in sys.argv[1].split()]
t = [float(v) for v in sys.argv[2].split()]
ms, mt = statistics.median(s), statistics.median(t)
model = "Llama 6L/384w/6h over 2 KV heads, SwiGLU 1024, tied" if sys.argv[4] == "llama" else "GPT-2 6L/384w/6h"
print(f"{model}, T=256, B=4, vocab 50257, {sys.argv[3]}: strata {ms:.0f} tok/s, pytorch {mt:.0f} tok/s, "
      f"ratio {ms / mt:.2f}x (medians of {len(s)} alternating rounds)")
PY
