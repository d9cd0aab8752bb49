#!/usr/bin/env bash
# Installs everything FastHorovod needs on a fresh Debian 12 machine of this kind, into a
# project-local virtualenv (.venv). Idempotent: the second run only checks and takes seconds.
#
#   apt:   OpenMPI (libopenmpi-dev, openmpi-bin), libssl-dev (libcrypto: the handshakes' HMAC),
#          iperf3 (to check the emulated network),
#          openssh-server and openssh-client (sshd on the emulated hosts, so horovodrun reaches them
#          over ssh; Debian's policy-rc.d in containers keeps the machine's own sshd from starting,
#          and nothing here enables it)
#   venv:  torch==2.13.0 (CPU build), numpy, psutil, pytest, mpi4py, pybind11, matplotlib, build
#   horovod 0.28.1 built from its sdist with PyTorch + Gloo + MPI by scripts/install_horovod.sh (as
#          C++17); the wheel is cached in $FASTHOROVOD_WHEEL_CACHE (default
#          ~/.cache/fasthorovod/wheels) so later installs take seconds
#   fasthorovod itself (pip install -e ., which builds fasthorovod._C with CMake)
#
# FASTHOROVOD_VENV (default .venv) and FASTHOROVOD_TORCH_PACKAGES (default torch==2.13.0, pinned
# releases, "name==version" each) build another environment the same way: `make setup-torchvision`
# makes .venv-torchvision with torch 2.14.1 and torchvision 0.29.1 for Horovod's own examples
# (the PyPI torchvision does not import beside the CPU build of torch 2.13).
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

# Is each "name==version" of the torch packages installed at that version (a local "+cpu" aside)?
pinned() {
  "$py" - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    try:
        got = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if want and got.split("+")[0] != want:
        sys.exit(1)
EOF
}
read -r -a torch_packages <<<"${FASTHOROVOD_TORCH_PACKAGES:-torch==2.13.0}"
pinned "${torch_packages[@]}" || { log "pip install ${torch_packages[*]}"; pip install "${torch_packages[@]}"; }
missing=()
for mod in numpy psutil pytest pybind11 matplotlib cloudpickle yaml packaging sklearn build; do
  have "$mod" || missing+=("$mod")
done
if ((${#missing[@]})); then
  log "pip install ${missing[*]}"
  pip install numpy psutil pytest "pybind11>=2.11" matplotlib cloudpickle pyyaml packaging scikit-learn build
fi
have mpi4py || { log "pip install mpi4py (builds against OpenMPI)"; pip install mpi4py; }

# --- horovod 0.28.1 (PyTorch + Gloo + MPI), built as C++17 once and cached as a wheel --------------
PYTHON="$py" FASTHOROVOD_WHEEL_CACHE="$cache" CXX=/usr/bin/c++ CMAKE=/usr/bin/cmake \
  "$root/scripts/install_horovod.sh"

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
