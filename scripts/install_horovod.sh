#!/usr/bin/env bash
# Installs Horovod 0.28.1 with PyTorch and Gloo (and MPI where OpenMPI is installed) into the Python
# environment of $PYTHON (default: python3 on PATH), which must already have torch.
#
#   scripts/install_horovod.sh                    # into the active environment
#   PYTHON=/path/to/venv/bin/python scripts/install_horovod.sh
#
# Horovod 0.28.1 is the last release and ships as an sdist only. Its CMake forces -std=c++14, but
# torch >= 2.1's headers need C++17, so the build runs with a compiler shim that appends -std=c++17
# last (it wins). Needs a C++ compiler and cmake (Debian: g++ cmake; libopenmpi-dev for MPI). The
# wheel is built once (about 7 minutes on 2 cores) and kept in $FASTHOROVOD_WHEEL_CACHE (default
# ~/.cache/fasthorovod/wheels), so later installs take seconds. Idempotent: does nothing when
# horovod.torch already imports.
set -euo pipefail

py=${PYTHON:-python3}
cache=${FASTHOROVOD_WHEEL_CACHE:-$HOME/.cache/fasthorovod/wheels}
log() { printf '[horovod] %s\n' "$*" >&2; }

"$py" -c "import horovod.torch" >/dev/null 2>&1 && { log "horovod.torch already imports"; exit 0; }
"$py" -c "import torch" >/dev/null 2>&1 || { log "install torch first: $py -m pip install torch"; exit 1; }

mkdir -p "$cache"
wheel=$(ls "$cache"/horovod-0.28.1-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  log "building horovod 0.28.1 (about 7 minutes on 2 cores; cached in $cache afterwards)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  printf '#!/bin/sh\nexec %s "$@" -std=c++17\n' "${CXX:-c++}" >"$work/cxx17"
  chmod +x "$work/cxx17"
  mpi=HOROVOD_WITHOUT_MPI
  command -v mpicxx >/dev/null 2>&1 && mpi=HOROVOD_WITH_MPI
  # A pip-installed cmake 4 rejects the old cmake_minimum_required of Horovod's bundled
  # third-party code: the system's cmake goes first on PATH.
  cmake=${CMAKE:-$(command -v /usr/bin/cmake || command -v cmake)}
  # env, not a plain prefix: a variable's name that comes from $mpi is not an assignment to bash.
  env PATH="$(dirname "$py"):$(dirname "$cmake"):$PATH" CXX="$work/cxx17" CMAKE="$cmake" "$mpi=1" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j"$(nproc)" \
    "$py" -m pip --disable-pip-version-check -q wheel --no-build-isolation --no-cache-dir \
    --no-deps -w "$work" horovod==0.28.1
  mv "$work"/horovod-0.28.1-*.whl "$cache"/
  wheel=$(ls "$cache"/horovod-0.28.1-*.whl | head -n1)
fi
log "installing $(basename "$wheel")"
"$py" -m pip --disable-pip-version-check -q install "$wheel"
"$py" -c "import horovod.torch" || { log "horovod.torch does not import after the install"; exit 1; }
