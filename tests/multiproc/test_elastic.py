"""Horovod elastic with the drop-in (issue 14): real `horovodrun` elastic jobs on loopback.

Each job is launched by Horovod's own horovodrun with a host-discovery script that prints a file;
the job rewrites that file mid-training (tests/workers/elastic_worker.py), so the world shrinks
(graceful removal: HostsUpdatedInterrupt) or grows (a new worker). A proxy killed on purpose is a
failure on the proxy path (HorovodInternalError, restore, reset with the same world). Every rank
must end with identical weights, every data plane must have carried collectives through its
lanes (the proxies are re-formed after each reset), and nothing may be left behind (the harness
checks processes and shared memory after every job).
"""
import re
import stat

import pytest

from tests.multiproc.harness import REPO, run_job

pytestmark = [pytest.mark.multiproc]

WORKER = REPO / "tests" / "workers" / "elastic_worker.py"
LINE = re.compile(r"ELASTIC rank (\d+) size (\d+) batch (\d+) digest (\w+) planes (\[.*\])")


def run_elastic(tmp_path, start: int, end: int, *worker_args: str, timeout: float = 240):
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost:{start}\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    result = run_job(start, "--hosts-file", str(hosts), "--resize-to", f"localhost:{end}", *worker_args,
                     worker=WORKER, timeout=timeout,
                     launcher_args=["--network-interfaces", "lo", "--min-np", str(min(start, end)),
                                    "--max-np", str(max(start, end)), "--host-discovery-script", str(script)],
                     env={"FASTHOROVOD_TIMEOUT_SECONDS": "30"})
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
    planes, out = run_elastic(tmp_path, 3, 2, "--algorithm", algorithm)
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
    planes, out = run_elastic(tmp_path, 3, 2, "--kill-proxy-at", "4", "--resize-at", "9")
    assert "killed proxy" in out
    assert_every_plane_carried_collectives(planes)
    for rank in (0, 1):  # 3 ranks, 3 ranks again after the failure, then 2
        assert [size for _, size, _ in planes[rank]] == [3, 3, 2], planes
