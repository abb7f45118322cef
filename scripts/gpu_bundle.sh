# gpu_bundle.sh — sourced by gpu-check.sh and gpu-ab.sh: what a bundle of binaries carried to a GPU machine needs.

# bundle_libs DIR BIN...: copy the shared libraries BIN needs beyond glibc, the compiler runtime and CUDA's own
# (which the GPU machine has) into DIR/lib.
bundle_libs() {
  local dir=$1; shift
  mkdir -p "$dir/lib"
  for bin in "$@"; do
    ldd "$bin" | awk '/=> \//{print $3}' |
      grep -v -E '/(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so|/libcu|/libnv|/libnccl' |
      xargs -r -I{} cp -L {} "$dir/lib/"
  done
}

# bundle_library_path DIR: put DIR/lib and CUDA's libraries on LD_LIBRARY_PATH — the toolkit's, else the ones
# a PyTorch install carries (cuBLAS; NCCL, 218 MB, is too big to carry in a bundle).
bundle_library_path() {
  local extra="$1/lib" d py
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do [[ -d $d ]] && extra="$extra:$d"; done
  for py in cublas nccl; do
    if d=$(python3 -c "import nvidia.$py, os; print(os.path.join(os.path.dirname(nvidia.$py.__file__), 'lib'))" \
        2>/dev/null); then
      extra="$extra:$d"
    fi
  done
  export LD_LIBRARY_PATH="$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
