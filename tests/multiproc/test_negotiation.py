"""Negotiated collectives with real ranks and proxies: any order, any thread, mismatches that
leave the job working, the stall inspector, and join with several sockets per lane."""
import random
import re

import pytest
import torch

from tests.multiproc.harness import REPO, Lanes, ring_allreduce_bytes, run_job

pytestmark = [pytest.mark.multiproc]
WORKER = str(REPO / "tests" / "workers" / "negotiation_worker.py")
MIB = 1 << 20


def allreduces(np_: int, *sizes: int) -> Lanes:
    """Allreduces of `sizes` bytes through the flat ring: each on every lane of every rank, 2(n-1)/n
    of its bytes sent per rank."""
    return Lanes(min_bytes=ring_allreduce_bytes(np_, *sizes), min_collectives=len(sizes))


def permuted_sizes(count: int, seed: int) -> list:
    """negotiation_worker.py's permuted tensors, in bytes (the same draws as the worker's plan)."""
    plan = random.Random(seed)
    return [plan.choice([1, 2, 4, 8, 16]) * MIB for _ in range(count)]


def join_sizes(scenario: str, np_: int, count: int = 0) -> list:
    """worker.py's join (rank r allreduces at steps 0..r, a joined rank's lanes run the later
    steps with zeros, then one allreduce after the join: 300,000 float32 each) and join_order (two
    allreduces per join, 125 and 4,913 float32)."""
    return [300_000 * 4] * (np_ + 1) if scenario == "join" else [125 * 4, 4913 * 4] * count


@pytest.mark.parametrize("np_, threads", [(3, 1), (4, 1), (3, 4), (4, 2)])
def test_permuted_order_and_threads_give_exact_results(np_, threads):
    result = run_job(np_, "permuted", "--count", "32", "--threads", str(threads), "--seed", str(np_ + threads),
                     worker=WORKER, timeout=600, env={"FASTHOROVOD_NUM_LANES": "2"},
                     proxied=allreduces(np_, *permuted_sizes(32, np_ + threads)))
    assert result.stdout.count("permuted ok") == np_, result.stdout[-3000:]


def test_grouped_allreduces_in_permuted_order():
    # 6 groups of 3 float32 tensors of MIB/4 + g elements, each group fused into one request
    result = run_job(3, "grouped", worker=WORKER, env={"FASTHOROVOD_NUM_LANES": "2"},
                     proxied=allreduces(3, *[3 * 4 * (MIB // 4 + g) for g in range(6)]))
    assert result.stdout.count("grouped ok") == 3, result.stdout[-3000:]


def test_stall_is_reported_with_the_missing_rank():
    result = run_job(2, "stall", "--delay", "2.5", worker=WORKER,
                     env={"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_STALL_CHECK_SECONDS": "1"},
                     proxied=allreduces(2, 4 * MIB))
    warnings = re.findall(r"stall: tensor 'stall\.late' was submitted by ranks \[0\].*waiting for ranks \[1\]",
                          result.stdout)
    assert len(warnings) == 1, result.stdout[-3000:]  # reported once


def test_stall_shutdown_fails_the_tensor_and_the_job_goes_on():
    result = run_job(2, "stall", "--delay", "0", "--shutdown", worker=WORKER,
                     env={"FASTHOROVOD_NUM_LANES": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2"},
                     proxied=allreduces(2, 4 * MIB, 4 * MIB))  # the late one and the one after the failure
    assert "stalled tensor failed" in result.stdout and result.stdout.count("stall ok") == 2, result.stdout[-3000:]


@pytest.mark.parametrize("scenario, args", [("join", ()), ("join_order", ("--count", "20"))])
def test_join_with_two_sockets_per_lane(scenario, args):
    result = run_job(3, scenario, *args, timeout=400,
                     env={"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_SOCKETS_PER_LANE": "2",
                          "FASTHOROVOD_PROXY_THRESHOLD_BYTES": "0"},
                     proxied=allreduces(3, *join_sizes(scenario, 3, *map(int, args[1:]))))
    assert result.returncode == 0


def test_dynamic_forward_and_hook_order_match_horovod_step_by_step(tmp_path):
    """Two ranks, so that each sum has one rounding whatever the order: bit-identical to Horovod."""
    ours, theirs = tmp_path / "fasthorovod.pt", tmp_path / "horovod.pt"
    # each step allreduces the three 512 x 512 float32 weights (1 MiB each, at the threshold)
    result = run_job(2, "dynamic", "--out", str(ours), worker=WORKER,
                     env={"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_BUCKET_BYTES": str(1 << 20)},
                     proxied=allreduces(2, *[MIB] * 3 * 8))
    assert "proxies=True" in result.stdout, result.stdout[-2000:]
    run_job(2, "dynamic", "--out", str(theirs), "--module", "horovod.torch", worker=WORKER, proxied=False)
    a, b = torch.load(ours), torch.load(theirs)
    for step, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"step {step}: max difference {(x - y).abs().max()}"
