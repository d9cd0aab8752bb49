"""Horovod elastic with the drop-in: real `horovodrun` elastic jobs on loopback.

Each job is launched by Horovod's own horovodrun with a host-discovery script that prints a file;
the job rewrites that file mid-training (tests/workers/elastic_worker.py), so the world shrinks
(graceful removal: HostsUpdatedInterrupt) or grows (a new worker). A proxy killed on purpose is a
failure on the proxy path (HorovodInternalError, restore, reset with the same world). Every rank
must end with identical weights, every data plane must have carried collectives through its
lanes (the proxies are re-formed after each reset), and nothing may be left behind (the harness
checks processes and shared memory after every job).
"""
import dataclasses
import importlib.util
import re
import stat

import pytest

from tests.multiproc.harness import REPO, Lanes, check_lanes, ring_allreduce_bytes, run_concurrently, run_job
from tests.netns import skip_unless_usable
from tests.test_runner import _leftovers

netem = skip_unless_usable(("ip", "tc", "ssh", "ssh-keygen", "/usr/sbin/sshd"), "fhvdelastic")

pytestmark = [pytest.mark.multiproc]

WORKER = REPO / "tests" / "workers" / "elastic_worker.py"
LINE = re.compile(r"ELASTIC rank (\d+) size (\d+) batch (\d+) digest (\w+) planes (\[.*\])")


# The mlp's 640 x 1024 float32 weight: the gradient above the proxies' threshold
WEIGHT_BYTES = 640 * 1024 * 4


def run_elastic(tmp_path, start: int, end: int, *worker_args: str, timeout: float = 240, proxied: Lanes = Lanes()):
    """`proxied`: what every rank of the final world (ranks 0..end-1) carried through its lanes,
    over all its data planes."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost:{start}\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    result = run_job(start, "--sizes", f"{start},{end}", "--hosts-file", str(hosts), "--resize-to", f"localhost:{end}",
                     *worker_args,
                     worker=WORKER, timeout=timeout,
                     launcher_args=["--network-interfaces", "lo", "--min-np", str(min(start, end)),
                                    "--max-np", str(max(start, end)), "--host-discovery-script", str(script)],
                     env={"FASTHOROVOD_TIMEOUT_SECONDS": "30"}, proxied=dataclasses.replace(proxied, ranks=end))
    lines = [LINE.search(line) for line in result.stdout.splitlines()]
    finals = {int(m.group(1)): m for m in lines if m}
    assert sorted(finals) == list(range(end)), f"expected ranks 0..{end - 1} to finish:\n{result.stdout[-4000:]}"
    assert {m.group(2) for m in finals.values()} == {str(end)}
    assert len({m.group(4) for m in finals.values()}) == 1, "ranks end with different weights"
    return {rank: eval(m.group(5)) for rank, m in finals.items()}, result.stdout  # noqa: S307 (our own output)


def assert_every_plane_carried_collectives(planes):
    for rank, entries in planes.items():
        assert entries, f"rank {rank} never had proxies"
        for epoch, size, collectives in entries:
            assert collectives > 0, f"rank {rank}: the data plane of init #{epoch} (size {size}) carried nothing"


@pytest.mark.parametrize("algorithm", ["ssgd", "cd-sgd"])
def test_a_graceful_removal_shrinks_the_job_and_the_proxies_follow(tmp_path, algorithm):
    # SSGD: every rank of the final world averaged the weight's gradient through its lanes in at
    # least the --after (8) batches after the last resize; the delayed policies: every lane moved bytes
    proxied = Lanes(min_bytes=ring_allreduce_bytes(2, *[WEIGHT_BYTES] * 8)) if algorithm == "ssgd" else Lanes()
    planes, out = run_elastic(tmp_path, 3, 2, "--algorithm", algorithm, proxied=proxied)
    assert_every_plane_carried_collectives(planes)
    for rank in (0, 1):  # the survivors formed proxies twice: for 3 ranks, then for 2
        assert [size for _, size, _ in planes[rank]] == [3, 2], planes


@pytest.mark.parametrize("algorithm", ["ssd-sgd"])
def test_an_added_slot_grows_the_job_and_the_new_worker_starts_its_proxies(tmp_path, algorithm):
    planes, out = run_elastic(tmp_path, 2, 3, "--algorithm", algorithm)
    assert_every_plane_carried_collectives(planes)
    for rank in (0, 1):
        assert [size for _, size, _ in planes[rank]] == [2, 3], planes
    assert [size for _, size, _ in planes[2]] == [3], planes


def test_a_killed_proxy_is_recovered_by_a_reset_and_training_goes_on(tmp_path):
    # rank 1 kills one of its proxies at batch 4; the job later shrinks as in the first test
    planes, out = run_elastic(tmp_path, 3, 2, "--kill-proxy-at", "4", "--resize-at", "9",
                              proxied=Lanes(min_bytes=ring_allreduce_bytes(2, *[WEIGHT_BYTES] * 8)))
    assert "killed proxy" in out
    assert_every_plane_carried_collectives(planes)
    for rank in (0, 1):  # 3 ranks, 3 ranks again after the failure, then 2
        assert [size for _, size, _ in planes[rank]] == [3, 3, 2], planes


# -- spot preemption on the emulated cloud, over ssh ----------------------------------------------------

def _elastic_benchmark():
    spec = importlib.util.spec_from_file_location("_benchmarks_elastic", REPO / "benchmarks" / "elastic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PREEMPTED = ("ssgd", "cd-sgd")
PREEMPTION_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def preemptions(tmp_path_factory):
    """Both algorithms' preemption jobs, run at the same time on two emulated clouds: each spends
    most of its time waiting (for the lost peer's timeout, for Horovod's elastic driver to re-form
    the world, for the host to come back), not computing. {algorithm: (job log, error or None)}."""
    bench = _elastic_benchmark()
    logs = {algorithm: tmp_path_factory.mktemp(f"preempt-{algorithm}") / "job.log" for algorithm in PREEMPTED}

    def job(algorithm):
        return lambda: bench.preemption_run("fasthorovod", "4:1gbit:200mbit", 4, model="mlp", algorithm=algorithm,
                                            timeout_s=PREEMPTION_TIMEOUT_S, job_timeout=600, log_path=logs[algorithm])

    results = run_concurrently({algorithm: job(algorithm) for algorithm in PREEMPTED})
    return {algorithm: (logs[algorithm].read_text() if logs[algorithm].exists() else "", results[algorithm][1])
            for algorithm in PREEMPTED}


@netem
@pytest.mark.netem
@pytest.mark.parametrize("algorithm", PREEMPTED)
@pytest.mark.slow
def test_a_preempted_host_is_survived_and_the_job_grows_back_when_it_returns(preemptions, algorithm):
    """4 emulated hosts, ranks started by Horovod's horovodrun over ssh (fasthorovodrun
    --emulate-cloud, elastic with the cloud's discovery script). After 4 steps one host is
    preempted abruptly (link cut, its processes killed): the survivors raise within the timeout,
    restore, re-form Horovod and the proxies for 3, and train; the host comes back and the job
    grows to 4 again. Every rank ends with the same weights; every data plane carried collectives;
    the cloud leaves nothing behind."""
    text, error = preemptions[algorithm]
    assert error is None, f"{error}\n{text[-4000:]}"
    bench = _elastic_benchmark()
    sizes = [size for size, _, _ in bench._log_steps(text)]
    assert sizes[0] == 4 and 3 in sizes and sizes[-1] == 4, sizes
    finals = LINE.findall(text)
    assert sorted(int(f[0]) for f in finals) == [0, 1, 2, 3], text[-4000:]
    assert len({f[3] for f in finals}) == 1, "ranks end with different weights"
    survivors = {int(f[0]): eval(f[4]) for f in finals if len(eval(f[4])) == 3}  # noqa: S307 (our own output)
    assert len(survivors) == 3, finals  # three processes saw 4, 3 and 4 ranks; the new one only 4
    assert_every_plane_carried_collectives(survivors)
    # every rank of the final world, the returned host's too: SSGD averaged the weight's gradient
    # through its lanes in at least the last 4 steps (preemption_run's after=4) among 4 ranks
    check_lanes(text, Lanes(min_bytes=ring_allreduce_bytes(4, *[WEIGHT_BYTES] * 4)) if algorithm == "ssgd" else Lanes(),
                range(4))
    failed = [float(t) for t in re.findall(r"FAILED rank \d+ batch \d+ time ([\d.]+)", text)]
    assert failed, "no survivor saw the failure in a step"
    last_before = max(t for size, _, t in bench._log_steps(text) if size == 4 and t < min(failed))
    assert max(failed) - last_before < PREEMPTION_TIMEOUT_S + 10, (last_before, failed)  # raised within the timeout
    assert "emulated cloud" in text and "--host-discovery-script" in text
    cloud_id = re.search(r"emulated cloud ([0-9a-f]{6}) ", text).group(1)
    assert _leftovers(cloud_id) == []
