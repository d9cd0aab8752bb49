"""The hierarchical allreduce (docs/hierarchical.md): several ranks per host reduce
inside the host through shared memory and run one ring across hosts per local rank.

- On loopback every rank is on one host (H = 1, L = np): shared memory only. Exact results over
  sizes x dtypes x ops (worker.py matrix), the allgathers and reduce-scatters (run as sums),
  alltoalls (on the mesh), broadcast, join and a mismatch, and proxies SIGKILLed or stopped at random points: every rank raises the exact class,
  nothing is left behind (harness.py checks after every job).
- On the emulated cloud (root, namespaces, sshd): 1, 2 and 3 ranks per host, exact; a proxy killed
  on one host makes the ranks of every host raise.
"""
import sys
from pathlib import Path

import pytest

from tests.multiproc.harness import (REPO, Lanes, check_lanes, ring_allreduce_bytes, run_concurrently, run_job,
                                     run_scenarios)
from tests.multiproc.test_broadcast import exact_broadcasts
from tests.multiproc.test_dataplane import alltoall_sent, matrix_allreduces
from tests.netns import skip_unless_usable
from tests.workers.scatter_cases import allgather_cases, reducescatter_cases

pytestmark = [pytest.mark.multiproc]
FASTHOROVODRUN = str(Path(sys.executable).parent / "fasthorovodrun")
FAULT = REPO / "tests" / "workers" / "fault_worker.py"
BROADCAST = REPO / "tests" / "workers" / "broadcast_worker.py"
NEGOTIATION = REPO / "tests" / "workers" / "negotiation_worker.py"
ON = {"FASTHOROVOD_HIERARCHICAL": "1", "FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_PROXY_THRESHOLD_BYTES": "0"}
netem = skip_unless_usable(("ip", "tc", "ssh", "ssh-keygen", "/usr/sbin/sshd"), "fhvdhierprobe")


def in_shared_memory(collectives: int) -> Lanes:
    """One host: every lane of every rank runs each collective (its shard, reduced through shared
    memory), and no byte crosses TCP (the lanes' byte counters count only the ring's frames)."""
    return Lanes(min_bytes=0, min_collectives=collectives, tcp=False)


def across_hosts(np_: int, per_host: int, sizes: list) -> Lanes:
    """H hosts of L ranks: each rank's lanes run the ring across the H hosts for its 1/L part of
    every collective, 2(H-1)/H of that part (L = 1: the flat ring through every rank). Only
    tensors of 64 KiB and more count towards the bytes, so that every lane's part of each is
    non-empty and its frame headers cover the parts' rounding."""
    hosts = np_ // per_host
    big = [b // per_host for b in sizes if b >= 1 << 16]
    return Lanes(min_bytes=ring_allreduce_bytes(hosts, *big), min_collectives=len(sizes))


@pytest.mark.parametrize("np_", [2, 3])
def test_one_host_exact_over_sizes_dtypes_and_ops(np_):
    result = run_job(np_, "matrix", "--lanes", "2", "--ranks-per-host", str(np_), env=ON,
                     proxied=in_shared_memory(len(matrix_allreduces())))
    for rank in range(np_):
        assert f"rank {rank}: matrix ok" in result.stdout, result.stdout[-3000:]
    assert f"hierarchical allreduce: 1 host x {np_} ranks" in result.stdout


def test_one_host_allgather_broadcast_join():
    # the allgathers of 4 non-empty widths, two each (run as sums); join's 3 steps and the allreduce
    # after it; join_order's two allreduces per join: one job, each scenario's lanes checked
    collectives = {"gather": 8, "join": 4, "join_order": 120}
    job = run_scenarios(3, list(collectives), "--lanes", "2", "--count", "60", env=ON)
    for scenario, count in collectives.items():
        check_lanes(job.stdout, in_shared_memory(count), range(3), scenario=scenario)
    assert job.stdout.count("gather ok") == 3 and job.stdout.count("join order ok over 60 joins") == 3, \
        job.stdout[-3000:]


def test_one_host_reducescatter_allgather_alltoall_match_horovods():
    # worker.py's scenarios, each against Horovod's own collective bit for bit: the reduce-scatters
    # and allgathers of rows run as the hierarchical allreduce of their rows (through shared memory
    # here: no byte over TCP), the alltoalls on the lanes' mesh (over TCP, counted apart)
    scenarios = ("reducescatter", "allgather", "alltoall")
    job = run_scenarios(3, scenarios, "--lanes", "2", env=ON)
    for scenario in scenarios:
        assert job.stdout.count(f"{scenario} ok") == 3, job.stdout[-3000:]
    check_lanes(job.stdout, in_shared_memory(3), range(3), scenario="reducescatter")
    check_lanes(job.stdout, in_shared_memory(3), range(3), scenario="allgather")
    check_lanes(job.stdout, Lanes(min_bytes=alltoall_sent(3), min_collectives=3, mesh=True), range(3),
                scenario="alltoall")
    # The harness's threshold (1 MiB): the worker checks which broadcasts take the proxies.
    result = run_job(3, "exact", worker=BROADCAST, env=dict(ON, FASTHOROVOD_PROXY_THRESHOLD_BYTES="1048576"),
                     timeout=300, proxied=in_shared_memory(exact_broadcasts(3).min_collectives))
    assert result.stdout.count("exact ok") == 3, result.stdout[-3000:]


def test_one_host_negotiated_order_and_mismatch():
    result = run_job(4, "permuted", "--count", "32", "--threads", "2", "--seed", "9", worker=NEGOTIATION,
                     timeout=600, env=ON, proxied=in_shared_memory(32))
    assert result.stdout.count("permuted ok") == 4, result.stdout[-3000:]
    result = run_job(2, "mismatch", "--lanes", "2", "--variant", "dtype", env=ON, proxied=in_shared_memory(1))
    assert result.stdout.count("raised CollectiveMismatchError") == 2, result.stdout[-3000:]


FAULTS = dict(ON, FASTHOROVOD_TIMEOUT_SECONDS="5", FASTHOROVOD_PROXY_THRESHOLD_BYTES="1048576")


@pytest.fixture(scope="module")
def one_host_faults():
    """The two one-host failure jobs, run at the same time (both mostly wait out the timeout):
    {name: (CompletedProcess or None, error or None)}."""
    return run_concurrently({
        "kill": lambda: run_job(3, "kill", "--trials", "6", "--seed", "11", worker=FAULT, env=FAULTS, timeout=600),
        "stop": lambda: run_job(3, "stop", "--trials", "1", "--seed", "3", worker=FAULT, env=FAULTS, timeout=300)})


@pytest.mark.slow
def test_one_host_proxy_killed_at_random_points(one_host_faults):
    result, error = one_host_faults["kill"]
    assert error is None, str(error)
    assert "DETECTION trials=6" in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
def test_one_host_stopped_proxy_times_out(one_host_faults):
    result, error = one_host_faults["stop"]
    assert error is None, str(error)
    assert "DETECTION trials=1" in result.stdout, result.stdout[-3000:]


def _cloud(spec: str):
    return (FASTHOROVODRUN, "--emulate-cloud", spec)


@netem
@pytest.mark.netem
@pytest.mark.parametrize("spec,np_,per_host", [("2:1gbit:200mbit", 2, 1), ("2:1gbit:200mbit", 4, 2),
                                               ("2:1gbit:200mbit", 6, 3), ("3:1gbit:200mbit", 6, 2)])
@pytest.mark.slow
def test_emulated_cloud_exact_with_ranks_per_host(spec, np_, per_host):
    counts, dtypes = "0,7,65537,1000003", "float32,float16,bfloat16,int64,uint8"
    result = run_job(np_, "matrix", "--lanes", "2", "--ranks-per-host", str(per_host),
                     "--counts", counts, "--dtypes", dtypes,
                     launcher=_cloud(spec), timeout=400,
                     env=dict(ON, FASTHOROVOD_HIERARCHICAL="auto"),
                     proxied=across_hosts(np_, per_host, matrix_allreduces(counts, dtypes)))
    for rank in range(np_):
        assert f"rank {rank}: matrix ok" in result.stdout, result.stdout[-3000:]


@netem
@pytest.mark.netem
@pytest.mark.slow
def test_emulated_cloud_reducescatter_allgather_alltoall_match_horovods():
    # 2 hosts x 2 ranks: the rows' hierarchical allreduce crosses the hosts on the rings of the
    # local ranks, and the alltoall's mesh joins each rank to the other on its host and to both on
    # the other host; every result bit for bit against Horovod's own
    scenarios = ("reducescatter", "allgather", "alltoall")
    job = run_scenarios(4, scenarios, "--lanes", "2", launcher=_cloud("2:1gbit:200mbit"), timeout=400,
                        env=dict(ON, FASTHOROVOD_HIERARCHICAL="auto"))
    for scenario in scenarios:
        assert job.stdout.count(f"{scenario} ok") == 4, job.stdout[-3000:]
    assert "hierarchical allreduce: 2 hosts x 2 ranks" in job.stdout, job.stdout[-3000:]
    # the first case of each, rows of every rank summed: a 2-host ring over each local rank's half
    scattered = reducescatter_cases(4)[0][0]
    check_lanes(job.stdout, across_hosts(4, 2, [4 * scattered[0] * scattered[1]]), range(4),
                scenario="reducescatter")
    gathered = max(allgather_cases(4, r)[0][0][0] for r in range(4)) * 4 * 4  # padded rows, float32
    check_lanes(job.stdout, across_hosts(4, 2, [4 * gathered]), range(4), scenario="allgather")
    check_lanes(job.stdout, Lanes(min_bytes=alltoall_sent(4), min_collectives=3, mesh=True), range(4),
                scenario="alltoall")


@netem
@pytest.mark.netem
@pytest.mark.slow
def test_emulated_cloud_proxy_killed_every_host_raises():
    result = run_job(4, "kill", "--trials", "3", "--seed", "5", worker=FAULT, env=FAULTS, timeout=600,
                     launcher=_cloud("2:1gbit:200mbit"))
    assert "DETECTION trials=3" in result.stdout, result.stdout[-3000:]
