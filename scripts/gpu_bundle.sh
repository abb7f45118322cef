# gpu_bundle.sh — sourced by gpu-check.sh and gpu-ab.sh: what a bundle of binaries carried to a GPU machine needs.
# The device tool carries at most 64 MiB a call (the tracked tree, untracked files and the carried bundle
# together) and brings back at most 8 files from $OUT: hence the compressed libraries, bundle_fits and
# bundle_pack_out.

# bundle_libs DIR BIN...: copy the shared libraries BIN needs beyond glibc, the compiler runtime and CUDA's own
# (which the GPU machine has) into DIR/lib; those over 4 MiB gzipped (libdnnl: 39.6 MB, 11.3 gzipped), which
# bundle_library_path unpacks.
bundle_libs() {
  local dir=$1 lib; shift
  mkdir -p "$dir/lib"
  for bin in "$@"; do
    ldd "$bin" | awk '/=> \//{print $3}' |
      grep -v -E '/(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so|/libcu|/libnv|/libnccl' |
      xargs -r -I{} cp -L {} "$dir/lib/"
  done
  for lib in "$dir"/lib/*; do
    if [[ -f $lib && $lib != *.gz && $(stat -c %s "$lib") -gt 4194304 ]]; then gzip -9 -f "$lib"; fi
  done
}

# bundle_fits DIR: whether DIR and the repository's tracked files stay under 60 MiB (the tool's 64, less room
# for untracked files); says by how much they do not.
bundle_fits() {
  local dir=$1 tree bytes limit=$((60 * 1048576))
  tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
  bytes=$(du -sb "$dir" | cut -f1)
  if ((tree + bytes > limit)); then
    echo "$dir: $((bytes / 1048576)) MiB, with the tracked tree's $((tree / 1048576)) MiB over the 60 MiB a device" \
         "call can carry" >&2
    return 1
  fi
}

# bundle_library_path DIR: put DIR/lib (its gzipped libraries unpacked to a temporary folder) and CUDA's
# libraries on LD_LIBRARY_PATH — the toolkit's, else the ones a PyTorch install carries in its nvidia/…/lib
# folders (cuBLAS, cudart, NCCL: NCCL, 218 MB, is too big to carry in a bundle; cuDNN and the NVRTC its
# runtime-compiled engines need, for STRATA_ATTENTION=cudnn).
bundle_library_path() {
  local extra="$1/lib" d gz unpacked
  if compgen -G "$1/lib/*.gz" >/dev/null; then
    unpacked=$(mktemp -d "${TMPDIR:-/tmp}/strata-bundle-lib.XXXXXX")
    for gz in "$1"/lib/*.gz; do gunzip -c "$gz" >"$unpacked/$(basename "${gz%.gz}")"; done
    extra="$unpacked:$extra"
  fi
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do [[ -d $d ]] && extra="$extra:$d"; done
  if d=$(python3 - 2>/dev/null <<'PY'
import glob, os, site
roots = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
dirs = []
for root in roots:
    for lib in sorted(glob.glob(os.path.join(root, "nvidia", "**", "lib", "lib*.so*"), recursive=True)):
        name, where = os.path.basename(lib), os.path.dirname(lib)
        if name.startswith(("libcublas", "libcudart", "libnccl", "libcudnn", "libnvrtc")) and where not in dirs:
            dirs.append(where)
print(":".join(dirs))
PY
  ); then
    [[ -n $d ]] && extra="$extra:$d"
  fi
  export LD_LIBRARY_PATH="$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# bundle_pack_out DIR: DIR's files as one DIR.tgz beside it, and DIR removed (for --pack: the device tool brings
# back at most 8 files).
bundle_pack_out() {
  local dir=$1
  [[ -d $dir ]] || return 0
  if tar czf "$dir.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"; then
    rm -rf "$dir"
    echo "(logs packed into $dir.tgz)"
  fi
}

# bundle_require DIR FILE...: DIR is a bundle holding FILE... (else says which is missing and what to do).
bundle_require() {
  local dir=$1 f; shift
  [[ -d $dir ]] || { echo "$dir: no such bundle (was it carried to this machine?)" >&2; return 1; }
  for f in "$@"; do
    [[ -e $dir/$f ]] || { echo "$dir: has no $f: not a bundle of this script (make it with --bundle)" >&2; return 1; }
  done
}
