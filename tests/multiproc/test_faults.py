"""Failure injection: a proxy killed or frozen mid-allreduce (or killed mid-alltoall), a worker
killed, and a worker that fails to stage an alltoall's rows.

Every rank must raise the exact exception class of the failure's kind — FastHorovodTimeoutError for
a frozen proxy, ProxyDiedError on the rank whose proxy was killed, FastHorovodError (a peer's
failure) on the others — naming the failed rank and lane where it can be known, within
FASTHOROVOD_TIMEOUT_SECONDS, and nothing — no proxy process, no shared-memory segment —
may be left behind (tests/multiproc/harness.py checks after each job). The five jobs run at the
same time (they spend most of their time waiting for timeouts and for processes to die).
"""
import json
import re

import pytest

from tests.multiproc.harness import REPO, run_concurrently, run_job

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
FAULT = str(REPO / "tests" / "workers" / "fault_worker.py")


def _run_fault(np_, *args, timeout_s="5", job_timeout=600, expect_success=True):
    return run_job(np_, *args, worker=FAULT, timeout=job_timeout, expect_success=expect_success,
                   env={"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_TIMEOUT_SECONDS": timeout_s})


@pytest.fixture(scope="module")
def fault_jobs(tmp_path_factory):
    """The failure jobs, run at the same time: each waits out timeouts and dying processes
    more than it computes. {name: (CompletedProcess or None, error or None, result directory)}."""
    out = tmp_path_factory.mktemp("worker-killed")
    results = run_concurrently({
        "kill": lambda: _run_fault(3, "kill", "--trials", "20", "--seed", "7", job_timeout=900),
        "kill-alltoall": lambda: _run_fault(3, "kill", "--trials", "6", "--seed", "11", "--collective", "alltoall"),
        "stop": lambda: _run_fault(3, "stop", "--trials", "2", "--seed", "3"),
        "stage": lambda: _run_fault(3, "stage"),
        # the launcher reports the dead rank, so the job fails
        "worker": lambda: _run_fault(3, "worker", "--out", str(out / "result"), expect_success=False),
    })
    return {name: (*result, out) for name, result in results.items()}


def _job(fault_jobs, name):
    result, error, out = fault_jobs[name]
    assert error is None, str(error)
    return result, out


def test_proxy_sigkill_at_random_points_20_trials(fault_jobs):
    result, _ = _job(fault_jobs, "kill")
    assert "DETECTION trials=20" in result.stdout, result.stdout[-3000:]
    print(re.findall(r"DETECTION.*", result.stdout)[0])


def test_proxy_sigkill_mid_alltoall_6_trials(fault_jobs):
    # the alltoall's mesh: every rank hears of the dead proxy from the rank it waits for, whatever
    # distance that is (csrc/collectives/alltoall.h, Failure), and names it
    result, _ = _job(fault_jobs, "kill-alltoall")
    assert "DETECTION trials=6" in result.stdout, result.stdout[-3000:]


def test_a_worker_whose_alltoall_staging_fails_fails_every_rank(fault_jobs):
    # staging overlaps the mesh (csrc/collectives/alltoall.h): a worker that cannot copy a block its
    # proxies are waiting for tells them, and every rank fails at once, naming it
    result, _ = _job(fault_jobs, "stage")
    assert "STAGING FAILURE: every rank raised" in result.stdout, result.stdout[-3000:]


def test_proxy_sigstop_is_detected_by_timeout(fault_jobs):
    result, _ = _job(fault_jobs, "stop")
    assert "DETECTION trials=2" in result.stdout, result.stdout[-3000:]


def test_worker_killed_its_proxies_exit_and_peers_raise(fault_jobs):
    _, out = _job(fault_jobs, "worker")
    results = {r: json.loads((out / f"result.rank{r}").read_text()) for r in (0, 2)}
    for rank, res in results.items():
        assert res["error"].startswith("FastHorovodError("), (rank, res)  # exactly: a peer's failure
        # a peer's death closes its sockets, seen at once; 5 s is the job's timeout, which must not
        # be what raised (nor what the proxies waited for before exiting)
        assert res["raised_after"] < 5, (rank, res)
        assert res["proxies_gone_after"] is not None and res["proxies_gone_after"] < 5, (rank, res)
    print({r: (round(v["raised_after"], 2), round(v["proxies_gone_after"], 2)) for r, v in results.items()})
