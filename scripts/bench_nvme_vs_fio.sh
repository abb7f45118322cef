#!/usr/bin/env bash
# Strata's NVMe tier vs fio on the same directory, pattern and file size, side by side in one run.
# fio: io_uring engine, direct=1, 1 MiB blocks, queue depth 32, one job. Strata: `strata bench nvme` with the same
# settings, both the raw engine and the checksummed swap store. Alternates the two ROUNDS times (the machine is
# shared and noisy; ratios hold, absolute figures do not) and prints each result and the ratio of the medians.
# --fio-fixed gives fio registered buffers and files (--fixedbufs=1 --registerfiles=1), as Strata's engine uses.
#   scripts/bench_nvme_vs_fio.sh [--dir DIR] [--size 1G] [--rounds 3] [--fio-fixed]
# Needs fio: scripts/install_deps.sh --bench
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-build/strata}
DIR=.
SIZE=1G
ROUNDS=3
FIO_FIXED=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) DIR=$2; shift 2 ;;
    --size) SIZE=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --fio-fixed) FIO_FIXED=(--fixedbufs=1 --registerfiles=1); shift ;;
    *) echo "bench_nvme_vs_fio.sh: unknown option '$1' (valid: --dir, --size, --rounds, --fio-fixed)" >&2; exit 2 ;;
  esac
done
[[ -x "$STRATA" ]] || { echo "bench_nvme_vs_fio.sh: $STRATA not built; run make build" >&2; exit 2; }
command -v fio >/dev/null || { echo "bench_nvme_vs_fio.sh: fio missing; run scripts/install_deps.sh --bench" >&2; exit 2; }
mkdir -p "$DIR"
FIO_FILE="$DIR/strata-fio-$$.dat"
trap 'rm -f "$FIO_FILE"' EXIT
RESULTS=$(mktemp)
trap 'rm -f "$FIO_FILE" "$RESULTS"' EXIT

# Both tools read back the file they have just written with O_DIRECT, after a syncfs, so reads see the same
# on-disk layout. (A fio read job on a fresh file would lay it out with buffered writes first, a different file
# to read; that measured 20-30% faster reads on this VM's disk than either tool reading its own direct writes.)
fio_run() {  # fio_run RW -> MiB/s
  [[ $1 == read ]] && sync -f "$FIO_FILE"
  fio --name=strata-vs-fio --filename="$FIO_FILE" --ioengine=io_uring "${FIO_FIXED[@]}" --direct=1 --bs=1M --iodepth=32 \
      --size="$SIZE" --rw="$1" --numjobs=1 --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; k=sys.argv[1]; print(j[k]["bw_bytes"]/2**20)' \
      "$([[ $1 == read ]] && echo read || echo write)"
}

for r in $(seq "$ROUNDS"); do
  rm -f "$FIO_FILE"
  for rw in write read; do
    v=$(fio_run "$rw")
    echo "round $r fio     seq_$rw: $v MiB/s"
    echo "fio engine seq_$rw $v" >>"$RESULTS"
  done
  rm -f "$FIO_FILE"
  "$STRATA" bench nvme --dir "$DIR" --size "$SIZE" --pattern seq_write,seq_read --block-size 1M --queue-depth 32 \
      --threads 1 --engine io_uring --json |
    python3 -c '
import json, sys
for line in sys.stdin:
    p = json.loads(line)
    print("strata", p["layer"], p["pattern"], p["mib_per_s"])' |
    while read -r who layer pattern v; do
      echo "round $r strata  $pattern ($layer): $v MiB/s"
      echo "$who $layer $pattern $v" >>"$RESULTS"
    done
done

python3 - "$RESULTS" "$SIZE" "${FIO_FIXED:+, fio with fixed buffers and files}" <<'PY'
import collections, statistics, sys
vals = collections.defaultdict(list)
for line in open(sys.argv[1]):
    who, layer, pattern, v = line.split()
    vals[(who, layer, pattern)].append(float(v))
print(f"\n{sys.argv[2]} per pattern, 1 MiB blocks, queue depth 32, O_DIRECT, io_uring{sys.argv[3]}; medians of {len(vals[('fio','engine','seq_read')])} alternating rounds")
for pattern in ("seq_write", "seq_read"):
    fio = statistics.median(vals[("fio", "engine", pattern)])
    for layer in ("engine", "store"):
        s = statistics.median(vals[("strata", layer, pattern)])
        print(f"{pattern:10s} strata {layer:6s} {s:9.1f} MiB/s   fio {fio:9.1f} MiB/s   ratio {s / fio:.3f}")
PY
