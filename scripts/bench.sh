#!/usr/bin/env bash
# The README's main job (make bench): FastHorovod against Horovod on an emulated public-cloud
# network (4 hosts, 1 Gbit/s links, 200 Mbit/s per TCP flow) — an allreduce sweep at the headline
# sizes and AlexNet training — or, where network namespaces are not permitted, the same on
# loopback, where there is no per-flow cap and the ratio is therefore smaller.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
out=${BENCH_OUT:-results}
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export FASTHOROVOD_SOCKETS_PER_PROXY=${FASTHOROVOD_SOCKETS_PER_PROXY:-2}

probe=fhvd-probe-$$
if ip netns add "$probe" 2>/dev/null; then
  ip netns del "$probe"
  prefix=(--launcher-prefix ".venv/bin/fasthorovodrun --emulate-cloud ${BENCH_CLOUD:-4:1gbit:200mbit}")
  echo "== emulated cloud ${BENCH_CLOUD:-4:1gbit:200mbit} (per-flow cap), 4 ranks"
else
  prefix=()
  echo "== loopback, 4 ranks: network namespaces are not permitted here (needs root/CAP_NET_ADMIN),"
  echo "   so there is no per-flow cap and FastHorovod's advantage is much smaller than on a cloud"
fi

$py benchmarks/allreduce.py "${prefix[@]}" --np 4 --backends horovod-gloo,fasthorovod:4 \
  --sizes 16MiB,64MiB --iters 5 --warmup 2 --out "$out/allreduce.json" --plot "$out/allreduce.png"
$py benchmarks/train.py "${prefix[@]}" --np 4 --model alexnet --image-size 224 --batch-size 16 \
  --steps 3 --warmup-steps 1 --compute-steps 1 --backends horovod,fasthorovod:4,fasthorovod:4:ssd-sgd \
  --out "$out/train.json" --plot "$out/train.png"
echo "results: $out/allreduce.json $out/allreduce.png $out/train.json $out/train.png"
