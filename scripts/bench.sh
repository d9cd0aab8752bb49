#!/usr/bin/env bash
# The README's main job (make bench): FastHorovod against Horovod on an emulated public-cloud
# network (4 hosts, 1 Gbit/s links, 200 Mbit/s per TCP flow) -- an allreduce sweep at the headline
# sizes with the raw-TCP ring ceiling, and AlexNet training -- or, where network namespaces are not
# permitted, the same on loopback, where there is no per-flow cap and the ratio is therefore smaller.
#
# Budget (about 15 minutes on the 2-core machine of docs/benchmarks.md): every figure is the median of 3 interleaved rounds (A B C A B C ...) with
# its spread (min-max over the rounds):
#   allreduce: 3 rounds x (ring ceiling, horovod, fasthorovod) at 16 and 64 MiB, 1 + 4 iterations
#   train:     3 rounds x (horovod, fasthorovod, fasthorovod:ssd-sgd), AlexNet 224 px, batch 16,
#              1 + 4 steps (Horovod: 1 + 2; its 18 s steps, network-bound, vary by about 1% and
#              were half of the whole run), 2 of them paired with a compute-only step
# FastHorovod runs with its defaults: no FASTHOROVOD_* variable is set (those in the caller's
# environment are removed, and said so). BENCH_ROUNDS, BENCH_STEPS, BENCH_PEER_STEPS and
# BENCH_ITERS override.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
out=${BENCH_OUT:-results}
rounds=${BENCH_ROUNDS:-3}
steps=${BENCH_STEPS:-4}
peer_steps=${BENCH_PEER_STEPS:-2}
compute_steps=$(( steps < 2 ? steps : 2 ))
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

inherited=$(env | grep -o '^FASTHOROVOD_[A-Za-z0-9_]*' || true)
if [ -n "$inherited" ]; then
  echo "== unsetting $(echo $inherited): the headline runs FastHorovod's defaults"
  unset $inherited
fi

probe=fhvd-probe-$$
if ip netns add "$probe" 2>/dev/null; then
  ip netns del "$probe"
  prefix=(--launcher-prefix ".venv/bin/fasthorovodrun --emulate-cloud ${BENCH_CLOUD:-4:1gbit:200mbit}")
  ceiling=(--ceiling)
  echo "== emulated cloud ${BENCH_CLOUD:-4:1gbit:200mbit} (per-flow cap), 4 ranks"
else
  prefix=()
  ceiling=()
  echo "== loopback, 4 ranks: network namespaces are not permitted here (needs root/CAP_NET_ADMIN),"
  echo "   so there is no per-flow cap (and no ring ceiling to measure): the 4 ranks share one host and"
  echo "   FastHorovod reduces through shared memory (docs/hierarchical.md), which says nothing about"
  echo "   how it does on a cloud's network"
fi

start=$SECONDS
echo "== [1/2] allreduce: $rounds rounds x (${ceiling[*]:+ring ceiling, }horovod, fasthorovod) at 16 and 64 MiB"
$py benchmarks/allreduce.py "${prefix[@]}" "${ceiling[@]}" --np 4 --backends horovod-gloo,fasthorovod \
  --proxy-threshold default --sizes 16MiB,64MiB --iters "${BENCH_ITERS:-4}" --warmup 1 --rounds "$rounds" \
  --out "$out/allreduce.json" --plot "$out/allreduce.png"
echo "== [2/2] AlexNet training: $rounds rounds x (horovod, fasthorovod, fasthorovod:ssd-sgd)" \
     "(elapsed $(( (SECONDS - start) / 60 )) min)"
$py benchmarks/train.py "${prefix[@]}" --np 4 --model alexnet --image-size 224 --batch-size 16 \
  --steps "$steps" --peer-steps "$peer_steps" --warmup-steps 1 --compute-steps "$compute_steps" --rounds "$rounds" \
  --backends horovod,fasthorovod,fasthorovod:ssd-sgd --out "$out/train.json" --plot "$out/train.png"
echo "== done in $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
echo "results: $out/allreduce.json $out/allreduce.png $out/train.json $out/train.png"
