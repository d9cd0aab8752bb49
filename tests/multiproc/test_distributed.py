"""The "fasthorovod" torch.distributed backend (fasthorovod/distributed) with real ranks on loopback:
each rank a process of tests/workers/c10d_worker.py, rendezvousing through env:// as torchrun's
would (and once under torchrun itself), the threshold at 0 and a flat ring so that every
collective the proxies can take, they take. Each scenario compares with Gloo in the same world and
checks the proxies' lane counters (the worker's own assertion), so a right result that came
through Gloo fails."""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns import unusable_reason

pytestmark = pytest.mark.multiproc

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "c10d_worker.py"
ENV = {"FASTHOROVOD_PROXY_THRESHOLD_BYTES": "0", "FASTHOROVOD_HIERARCHICAL": "0", "FASTHOROVOD_NUM_LANES": "2",
       "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(np_: int, scenario: str, *args: str, timeout: float = 240.0, env: dict = None) -> list:
    """Runs `np_` ranks of the worker's `scenario` (`env` over ENV); returns [(exit status, output)]
    by rank. Killed (the whole process group of each rank, proxies included) after `timeout` seconds."""
    port = _free_port()
    procs = []
    extra = env or {}
    for rank in range(np_):
        env = dict(os.environ, **dict(ENV, **extra), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(np_), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(np_))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), scenario, *args], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return _results(procs, timeout)


def _results(procs, timeout: float) -> list:
    """[(exit status, output)] of `procs` (each started in a session of its own); every one still
    running after `timeout` seconds is killed with its process group."""
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def _all_ok(results, what: str, ranks=None) -> None:
    for rank, (code, out) in enumerate(results):
        if ranks is None or rank in ranks:
            assert code == 0 and f"rank {rank}: {what} ok" in out, f"rank {rank} exited {code}:\n{out[-3000:]}"


@pytest.mark.parametrize("np_", [2, 3])
def test_every_collective_matches_gloo_through_the_proxies(np_):
    _all_ok(launch(np_, "conformance"), "conformance")


def test_ddp_trains_bit_for_bit_as_on_gloo():
    _all_ok(launch(2, "ddp"), "ddp")


@pytest.mark.parametrize("init", ["gloo", "fasthorovod"])
def test_ddp_on_gloo_with_the_hook_trains_bit_for_bit_as_without(init):
    _all_ok(launch(2, "hook", "--init", init), "hook")


def test_fsdp2_trains_bit_for_bit_as_on_gloo():
    _all_ok(launch(2, "fsdp"), "fsdp")


@pytest.mark.parametrize("np_", [2, 3])
def test_all_to_all_single_matches_gloo_on_the_mesh(np_):
    _all_ok(launch(np_, "alltoall"), "alltoall")


@pytest.mark.parametrize("scenario", ["conformance", "alltoall"])
def test_the_hierarchical_layout_matches_gloo_too(scenario):
    # 3 ranks on one host, hierarchical: reduce-scatters and all-gathers run as the hierarchical
    # allreduce of their rows, all_to_all_single on the mesh
    results = launch(3, scenario, "--describe", env={"FASTHOROVOD_HIERARCHICAL": "1"})
    _all_ok(results, scenario)
    assert all('"hierarchical": {' in out for _, out in results), results[0][1][-3000:]


@pytest.mark.parametrize("np_", [2, 3])
def test_functional_collectives_match_gloo_through_the_proxies(np_):
    _all_ok(launch(np_, "functional"), "functional")


def test_mismatched_collectives_fail_by_name():
    _all_ok(launch(2, "mismatch"), "mismatch")


def test_a_collective_without_its_peer_fails_after_the_groups_timeout():
    _all_ok(launch(2, "timeout", "--timeout", "3"), "timeout")


def test_a_dead_rank_fails_the_others_works():
    results = launch(3, "dead_rank")
    assert results[2][0] == 3, results[2][1][-2000:]
    for rank in (0, 1):
        code, out = results[rank]
        assert code == 0 and f"rank {rank}: dead_rank ok" in out, f"rank {rank} exited {code}:\n{out[-3000:]}"


def test_torchrun_launches_it():
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(WORKER), "ddp"],
                          env=dict(os.environ, **ENV), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ddp ok") == 2, proc.stdout[-2000:]


NETNS_UNUSABLE = unusable_reason(("ip", "tc"), "fhvdtrprobe")


@pytest.mark.skipif(NETNS_UNUSABLE is not None, reason=f"emulated network unavailable: {NETNS_UNUSABLE}")
def test_torchrun_on_each_host_of_an_emulated_cloud():
    """torchrun once per host of a two-host emulated cloud (200 Mbit/s per flow), as on a cluster:
    one node each, the c10d rendezvous on host0. The backend sees two hosts (its path probe
    measured the hop between them) and DDP trains as on Gloo, through the proxies."""
    from fasthorovod.netem import EmulatedCloud, run_in_host

    torchrun = Path(sys.executable).parent / "torchrun"
    with EmulatedCloud("2:1gbit:200mbit", prefix="fhvdtr") as cloud:
        master = cloud.hosts[0].address
        procs = [run_in_host(host, [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(i),
                                    "--master-addr", master, "--master-port", "29517", str(WORKER), "ddp",
                                    "--describe"],
                             env=dict(os.environ, **ENV), cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for i, host in enumerate(cloud.hosts)]
        results = _results(procs, 240)
    _all_ok(results, "ddp")
    plan = json.loads(results[0][1].split("rank 0: data plane ", 1)[1].splitlines()[0])
    assert plan["probe"] is not None and plan["sockets_source"] == "probe", plan
    print(f"probe: {plan['sockets_per_lane']} sockets per lane, {plan['probe']['curve_bytes_per_second']}")
