"""Runs a test worker as real Horovod ranks: horovodrun --gloo, a timeout, kill-all on failure.

Each job runs in its own process group; if it exceeds its timeout the whole group (launcher,
ranks and their proxies) is killed and the test fails with the captured output. After every job
the harness checks that no proxy process and no FastHorovod shared-memory segment is left.
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

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "worker.py"
HOROVODRUN = Path(sys.executable).parent / "horovodrun"


def session_pids(sid: int) -> Set[int]:
    """Live processes of session `sid` (the job's launcher, its ranks and their proxies)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.add(int(entry))
            except OSError:
                pass
    return pids


def leftovers(sid: int, job_pids: Set[int]) -> Dict[str, list]:
    """What the job left: its processes still alive, shm segments named after its workers' pids.

    Only this job's resources count, so that jobs of other runs on the same machine do not
    make a test fail (segment names embed the worker's pid: /fasthorovod.<token>.<rank>.<pid>.*).
    """
    shm = [n for n in os.listdir("/dev/shm")
           if n.startswith("fasthorovod.") and any(f".{pid}." in n for pid in job_pids)]
    return {"shm": shm, "processes": sorted(session_pids(sid))}


class _PidSampler(threading.Thread):
    """Remembers every pid seen in the job's session while it runs."""

    def __init__(self, sid: int) -> None:
        super().__init__(daemon=True)
        self.sid, self.pids, self.done = sid, set(), threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.pids |= session_pids(self.sid)


def run_job(np: int, *worker_args: str, env: Optional[Dict[str, str]] = None, timeout: float = 240,
            expect_success: bool = True, launcher_args: Sequence[str] = (),
            worker: Path = WORKER) -> subprocess.CompletedProcess:
    cmd = [str(HOROVODRUN), "--gloo", "-np", str(np), *launcher_args, sys.executable, str(worker), *worker_args]
    full_env = dict(os.environ)
    full_env.setdefault("FASTHOROVOD_TIMEOUT_SECONDS", "60")
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
    while any(leftovers(proc.pid, sampler.pids).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = leftovers(proc.pid, sampler.pids)
    assert not any(left.values()), f"job left resources behind: {left}\n{out[-3000:]}"
    return result
