"""Runs a test worker as real Horovod ranks: horovodrun --gloo, a timeout, kill-all on failure.

Each job runs in its own session; if it exceeds its timeout the launcher's process group is
killed (a proxy, alone in its process group, exits when its worker dies) and the test fails with
the captured output. After every job the harness checks that
no process of the job is left, and that /dev/shm holds nothing named after its workers (FastHorovod's
shared memory has no names at all since issue 15; the check guards against any coming back).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
import threading
from typing import Dict, Optional, Sequence, Set

import psutil

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "worker.py"
HOROVODRUN = Path(sys.executable).parent / "horovodrun"


def descendants(pid: int) -> Set[int]:
    """The job's processes: the launcher's descendants (ranks, their proxies). Horovod's launcher
    starts ranks in process groups of their own, so the tree, not the session, is what counts."""
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def alive(pids: Set[int]) -> list:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return sorted(out)


def leftovers(job_pids: Set[int]) -> Dict[str, list]:
    """What the job left: its processes still alive, /dev/shm names that mention its workers' pids.

    Only this job's resources count, so that jobs of other runs on the same machine do not make a
    test fail (the shared-memory names of earlier versions embedded the worker's pid).
    """
    shm = [n for n in os.listdir("/dev/shm")
           if n.startswith("fasthorovod.") and any(f".{pid}." in n for pid in job_pids)]
    return {"shm": shm, "processes": alive(job_pids)}


class _PidSampler(threading.Thread):
    """Remembers every process seen in the job's tree while it runs (orphans included)."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.pids, self.done = root, set(), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            self.pids |= descendants(self.root)


def run_job(np: int, *worker_args: str, env: Optional[Dict[str, str]] = None, timeout: float = 240,
            expect_success: bool = True, launcher_args: Sequence[str] = (),
            worker: Path = WORKER, wrap: Sequence[str] = (),
            launcher: Sequence[str] = (str(HOROVODRUN), "--gloo")) -> subprocess.CompletedProcess:
    """`wrap` goes before the launcher (for example ``ip netns exec NAME``); `launcher` replaces
    ``horovodrun --gloo`` (for example ``fasthorovodrun --emulate-cloud SPEC``)."""
    cmd = [*wrap, *launcher, "-np", str(np), *launcher_args, sys.executable, str(worker), *worker_args]
    full_env = dict(os.environ)
    full_env.setdefault("FASTHOROVOD_TIMEOUT_SECONDS", "60")
    # Every rank of these jobs runs on this one host, where the unset threshold would be 8 MiB
    # (Config.for_topology); the tests are written against the across-hosts default of 1 MiB.
    full_env.setdefault("FASTHOROVOD_PROXY_THRESHOLD_BYTES", str(1 << 20))
    # ... and against the flat ring through every rank, whose TCP lanes (frames, traces, sockets,
    # rebalancing, hostile peers) they exercise; on one host the hierarchical allreduce would carry
    # everything through shared memory instead. tests/multiproc/test_hierarchical.py tests that.
    full_env.setdefault("FASTHOROVOD_HIERARCHICAL", "0")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True, cwd=REPO)
    sampler = _PidSampler(proc.pid)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"job timed out after {timeout} s: {' '.join(worker_args)}\n{out[-6000:]}")
    finally:
        sampler.done.set()
        sampler.join()
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if expect_success and proc.returncode != 0:
        raise AssertionError(f"job failed (rc {proc.returncode}): {' '.join(worker_args)}\n{out[-8000:]}")
    deadline = time.monotonic() + 10
    while any(leftovers(sampler.pids).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = leftovers(sampler.pids)
    assert not any(left.values()), f"job left resources behind: {left}\n{out[-3000:]}"
    return result
