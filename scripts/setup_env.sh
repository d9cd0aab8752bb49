#!/usr/bin/env bash
# Installs everything FastHorovod needs on a fresh Debian 12 machine of this kind, into a
# project-local virtualenv (.venv). Idempotent: the second run only checks and takes seconds.
#
#   apt:   OpenMPI (libopenmpi-dev, openmpi-bin), libssl-dev (libcrypto: the handshakes' HMAC),
#          iperf3 (to check the emulated network),
#          openssh-server and openssh-client (sshd on the emulated hosts, so horovodrun reaches them
#          over ssh; Debian's policy-rc.d in containers keeps the machine's own sshd from starting,
#          and nothing here enables it)
#   venv:  torch==2.13.0 (CPU build), numpy, psutil, pytest, mpi4py, pybind11, matplotlib
#   horovod 0.28.1 built from its sdist with PyTorch + Gloo + MPI; the wheel is cached in
#          $FASTHOROVOD_WHEEL_CACHE (default ~/.cache/fasthorovod/wheels) so later installs take seconds
#   fasthorovod itself (pip install -e ., which builds fasthorovod._C with CMake)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${FASTHOROVOD_VENV:-$root/.venv}
cache=${FASTHOROVOD_WHEEL_CACHE:-$HOME/.cache/fasthorovod/wheels}
py=$venv/bin/python
log() { printf '[setup] %s\n' "$*" >&2; }

# --- system packages --------------------------------------------------------------------------
need_apt=()
for pkg in libopenmpi-dev openmpi-bin libssl-dev iperf3 iproute2 openssh-server openssh-client; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  [ "$(id -u)" = 0 ] || { log "need root to apt-get install ${need_apt[*]}"; exit 1; }
  log "apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# --- virtualenv and Python packages -------------------------------------------------------------
if [ ! -x "$py" ]; then
  log "creating $venv"
  python3 -m venv "$venv"
fi
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }
have() { "$py" -c "import $1" >/dev/null 2>&1; }

have torch || { log "pip install torch==2.13.0"; pip install torch==2.13.0; }
missing=()
for mod in numpy psutil pytest pybind11 matplotlib cloudpickle yaml packaging sklearn; do
  have "$mod" || missing+=("$mod")
done
if ((${#missing[@]})); then
  log "pip install ${missing[*]}"
  pip install numpy psutil pytest "pybind11>=2.11" matplotlib cloudpickle pyyaml packaging scikit-learn
fi
have mpi4py || { log "pip install mpi4py (builds against OpenMPI)"; pip install mpi4py; }

# --- horovod 0.28.1 (PyTorch + Gloo + MPI), built once and cached as a wheel ----------------------
if ! have horovod.torch; then
  mkdir -p "$cache"
  wheel=$(ls "$cache"/horovod-0.28.1-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$wheel" ]; then
    log "building horovod 0.28.1 (about 7 minutes on 2 cores; cached in $cache afterwards)"
    # Horovod's CMake forces -std=c++14 but torch 2.13's headers need C++17: a compiler shim
    # appends -std=c++17 last so it wins.
    shim=$(mktemp -d)/cxx17
    printf '#!/bin/sh\nexec /usr/bin/c++ "$@" -std=c++17\n' >"$shim"
    chmod +x "$shim"
    build=$(mktemp -d)
    PATH="$venv/bin:/usr/bin:$PATH" CXX="$shim" CMAKE=/usr/bin/cmake \
      HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
      HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j2 \
      "$py" -m pip --disable-pip-version-check -q wheel --no-build-isolation --no-cache-dir \
      --no-deps -w "$build" horovod==0.28.1
    mv "$build"/horovod-0.28.1-*.whl "$cache"/
    wheel=$(ls "$cache"/horovod-0.28.1-*.whl | head -n1)
  fi
  log "installing $(basename "$wheel")"
  pip install "$wheel"
fi

# --- fasthorovod itself ---------------------------------------------------------------------------
# Rebuild when any source changed since the last build (the stamp records the newest source).
stamp=$venv/.fasthorovod-build-stamp
newest=$(find "$root/csrc" "$root/CMakeLists.txt" "$root/setup.py" "$root/pyproject.toml" -type f \
         -newer "$stamp" 2>/dev/null | head -n1 || true)
if [ ! -f "$stamp" ] || [ -n "$newest" ] || ! (cd /tmp && "$py" -c "import fasthorovod._C") 2>/dev/null; then
  log "building fasthorovod (pip install -e .)"
  pip install --no-build-isolation -e "$root"
  touch "$stamp"
fi
log "ready: $venv"
