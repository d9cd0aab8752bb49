#!/usr/bin/env bash
# Installs Horovod 0.28.1 with PyTorch and Gloo (and MPI where OpenMPI is installed) into the Python
# environment of $PYTHON (default: python3 on PATH), which must already have torch.
#
#   scripts/install_horovod.sh                    # into the active environment
#   PYTHON=/path/to/venv/bin/python scripts/install_horovod.sh
#
# Horovod 0.28.1 is the last release and ships as an sdist only. Its CMake forces -std=c++14, but
# torch >= 2.1's headers need C++17 (>= 2.14: C++20), so the build runs with a compiler shim that
# appends that -std last (it wins). Needs a C++ compiler and cmake (Debian: g++ cmake; libopenmpi-dev for MPI). The
# wheel is built once per torch release (about 7 minutes on 2 cores; Horovod's extension links
# against torch's C++ ABI) and kept in $FASTHOROVOD_WHEEL_CACHE/torch-<version> (default
# ~/.cache/fasthorovod/wheels), so later installs take seconds. Idempotent: does nothing when
# horovod.torch already imports.
set -euo pipefail

py=${PYTHON:-python3}
cache=${FASTHOROVOD_WHEEL_CACHE:-$HOME/.cache/fasthorovod/wheels}
log() { printf '[horovod] %s\n' "$*" >&2; }

"$py" -c "import horovod.torch" >/dev/null 2>&1 && { log "horovod.torch already imports"; exit 0; }
# What the build depends on, in one look at torch: its release (the cache key), the C++ standard its
# headers need (C++17 from 2.1, C++20 from 2.14; Horovod asks for C++14) and whether it is a CUDA build.
facts=$("$py" -c "import torch; v = torch.__version__; print(v, 'c++20' if tuple(map(int, v.split('+')[0].split('.')[:2])) >= (2, 14) else 'c++17', torch.version.cuda is not None)" 2>/dev/null) \
  || { log "install torch first: $py -m pip install torch"; exit 1; }
read -r torch_version std torch_cuda <<<"$facts"

cache=$cache/torch-$torch_version
mkdir -p "$cache"
wheel=$(ls "$cache"/horovod-0.28.1-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  log "building horovod 0.28.1 (about 7 minutes on 2 cores; cached in $cache afterwards)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  printf '#!/bin/sh\nexec %s "$@" -std=%s\n' "${CXX:-c++}" "$std" >"$work/cxx"
  chmod +x "$work/cxx"
  cuda=()
  if [ "$torch_cuda" = True ]; then
    # A CUDA build of torch makes Horovod build its CUDA operations, with CUDA_STANDARD 11 for
    # its kernels, which a CUDA 13 toolkit's headers reject: the toolkit is seen through a
    # directory whose nvcc compiles in the host compiler's standard instead. $CUDA_HOME
    # (default /usr/local/cuda) must hold the toolkit; kernels for HOROVOD_BUILD_CUDA_CC_LIST
    # (default 80,90).
    toolkit=${CUDA_HOME:-/usr/local/cuda}
    [ -x "$toolkit/bin/nvcc" ] || { log "torch is a CUDA build: Horovod needs a CUDA toolkit in CUDA_HOME ($toolkit)"; exit 1; }
    mkdir -p "$work/cuda/bin"
    for entry in "$toolkit"/*; do [ "$(basename "$entry")" = bin ] || ln -s "$entry" "$work/cuda/"; done
    for tool in "$toolkit"/bin/*; do ln -s "$tool" "$work/cuda/bin/"; done
    rm "$work/cuda/bin/nvcc"
    # (its host compiler is the shim above, so both sides of nvcc speak $std)
    printf '#!/bin/sh\nfor a; do shift; case "$a" in -std=*) ;; *) set -- "$@" "$a";; esac; done\nexec %s "$@" -std=%s\n' \
      "$toolkit/bin/nvcc" "$std" >"$work/cuda/bin/nvcc"
    chmod +x "$work/cuda/bin/nvcc"
    cuda=(HOROVOD_CUDA_HOME="$work/cuda" CMAKE_LIBRARY_PATH="$toolkit/lib64"
          HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-80,90}")
    log "torch is a CUDA build: Horovod's CUDA operations too, with the toolkit in $toolkit"
  fi
  mpi=HOROVOD_WITHOUT_MPI
  command -v mpicxx >/dev/null 2>&1 && mpi=HOROVOD_WITH_MPI
  # A pip-installed cmake 4 rejects the old cmake_minimum_required of Horovod's bundled
  # third-party code: the system's cmake goes first on PATH.
  cmake=${CMAKE:-$(command -v /usr/bin/cmake || command -v cmake)}
  # env, not a plain prefix: a variable's name that comes from $mpi is not an assignment to bash.
  env PATH="$(dirname "$py"):$(dirname "$cmake"):$PATH" CXX="$work/cxx" CMAKE="$cmake" "$mpi=1" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j"$(nproc)" ${cuda[@]+"${cuda[@]}"} \
    "$py" -m pip --disable-pip-version-check -q wheel --no-build-isolation --no-cache-dir \
    --no-deps -w "$work" horovod==0.28.1
  mv "$work"/horovod-0.28.1-*.whl "$cache"/
  wheel=$(ls "$cache"/horovod-0.28.1-*.whl | head -n1)
fi
log "installing $(basename "$wheel")"
"$py" -m pip --disable-pip-version-check -q install "$wheel"
"$py" -c "import horovod.torch" || { log "horovod.torch does not import after the install"; exit 1; }
