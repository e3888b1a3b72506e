#!/usr/bin/env bash
# Configures and builds shardmuon into build/ (or $SHARDMUON_BUILD_DIR). CUDA and NCCL are
# built when nvcc is found (CUDA architecture $SHARDMUON_CUDA_ARCH, default 90 for the
# H100/H200); extra arguments go to CMake.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build_dir="${SHARDMUON_BUILD_DIR:-$root/build}"

cuda_flags=(-DSHARDMUON_WITH_CUDA=OFF)
if command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="$PATH:/usr/local/cuda/bin"
  cuda_flags=(-DSHARDMUON_WITH_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${SHARDMUON_CUDA_ARCH:-90}")
fi

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
mkdir -p "$build_dir"
cmake -S "$root" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DSHARDMUON_WARNINGS_AS_ERRORS=ON "${cuda_flags[@]}" "$@" >"$build_dir/configure.log" 2>&1 ||
  { cat "$build_dir/configure.log"; exit 1; }
cmake --build "$build_dir" --parallel "$(nproc)"
