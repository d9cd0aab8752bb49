"""Failure injection: a proxy killed or frozen mid-allreduce, and a worker killed.

Every rank must raise the exact exception class of the failure's kind — FastHorovodTimeoutError for
a frozen proxy, ProxyDiedError on the rank whose proxy was killed, FastHorovodError (a peer's
failure) on the others — naming the failed rank and lane where it can be known, within
FASTHOROVOD_TIMEOUT_SECONDS, and nothing — no proxy process, no shared-memory segment —
may be left behind (tests/multiproc/harness.py checks after each job).
"""
import json
import re

import pytest

from tests.multiproc.harness import REPO, run_job

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
FAULT = str(REPO / "tests" / "workers" / "fault_worker.py")


def _run_fault(np_, *args, timeout_s="5", job_timeout=600, expect_success=True):
    return run_job(np_, *args, worker=FAULT, timeout=job_timeout, expect_success=expect_success,
                   env={"FASTHOROVOD_NUM_PROXIES": "2", "FASTHOROVOD_TIMEOUT_SECONDS": timeout_s})


def test_proxy_sigkill_at_random_points_20_trials():
    result = _run_fault(3, "kill", "--trials", "20", "--seed", "7", job_timeout=900)
    assert "DETECTION trials=20" in result.stdout, result.stdout[-3000:]
    print(re.findall(r"DETECTION.*", result.stdout)[0])


def test_proxy_sigstop_is_detected_by_timeout():
    result = _run_fault(3, "stop", "--trials", "2", "--seed", "3")
    assert "DETECTION trials=2" in result.stdout, result.stdout[-3000:]


def test_worker_killed_its_proxies_exit_and_peers_raise(tmp_path):
    out = tmp_path / "result"
    _run_fault(3, "worker", "--out", str(out), expect_success=False)  # the launcher reports the dead rank
    results = {r: json.loads((tmp_path / f"result.rank{r}").read_text()) for r in (0, 2)}
    for rank, res in results.items():
        assert res["error"].startswith("FastHorovodError("), (rank, res)  # exactly: a peer's failure
        assert res["raised_after"] < 5, (rank, res)
        assert res["proxies_gone_after"] is not None and res["proxies_gone_after"] < 5, (rank, res)
    print({r: (round(v["raised_after"], 2), round(v["proxies_gone_after"], 2)) for r, v in results.items()})
