#!/usr/bin/env bash
# The CUDA-tensor checks in one go, for a GPU machine: two ranks on this host run
# scripts/cuda_check.py (allreduce, broadcast and optimizer steps of CUDA tensors through the
# proxies, each against Horovod's result for the same values). Needs a CUDA build of torch in the
# interpreter $PYTHON (default .venv/bin/python) and Horovod next to it (make setup).
#   scripts/cuda_check.sh          the checks on cuda (prints "skipped" where torch sees no GPU)
#   scripts/cuda_check.sh cpu      the same checks on CPU tensors (runs anywhere)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export FASTHOROVOD_PROXY_THRESHOLD_BYTES=0 FASTHOROVOD_NUM_LANES=2 FASTHOROVOD_TIMEOUT_SECONDS=60
exec timeout 600 "$(dirname "$PYTHON")/horovodrun" --gloo -np 2 "$PYTHON" scripts/cuda_check.py --device "${1:-cuda}"
