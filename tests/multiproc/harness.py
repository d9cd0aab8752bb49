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
from typing import Dict, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "worker.py"
HOROVODRUN = Path(sys.executable).parent / "horovodrun"


def leftovers() -> Dict[str, list]:
    shm = [n for n in os.listdir("/dev/shm") if n.startswith("fasthorovod.")]
    procs = subprocess.run(["pgrep", "-f", "fasthorovod[.]proxy"], capture_output=True, text=True).stdout.split()
    return {"shm": shm, "proxies": procs}


def run_job(np: int, *worker_args: str, env: Optional[Dict[str, str]] = None, timeout: float = 240,
            expect_success: bool = True, launcher_args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    cmd = [str(HOROVODRUN), "--gloo", "-np", str(np), *launcher_args, sys.executable, str(WORKER), *worker_args]
    full_env = dict(os.environ)
    full_env.setdefault("FASTHOROVOD_TIMEOUT_SECONDS", "60")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True, cwd=REPO)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"job timed out after {timeout} s: {' '.join(worker_args)}\n{out[-6000:]}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if expect_success and proc.returncode != 0:
        raise AssertionError(f"job failed (rc {proc.returncode}): {' '.join(worker_args)}\n{out[-8000:]}")
    deadline = time.monotonic() + 10
    while any(leftovers().values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = leftovers()
    assert not any(left.values()), f"job left resources behind: {left}\n{out[-3000:]}"
    return result
