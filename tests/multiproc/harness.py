"""Runs a test worker as real Horovod ranks: horovodrun --gloo, a timeout, kill-all on failure.

Each job runs in its own session; if it exceeds its timeout the launcher's process group is
killed (a proxy, alone in its process group, exits when its worker dies) and the test fails with
the captured output. After every job the harness checks that
no process of the job is left, and that /dev/shm holds nothing named after its workers (FastHorovod's
shared memory has no names at all; the check guards against any coming back).

A test says which path its collectives take with ``proxied=``: a :class:`Lanes` (or True) for the
proxies, False for Horovod's. Every rank's worker then prints its lanes' counters
(tests/workers/lanes.py) and the harness checks them on every rank (:func:`check_lanes`): a
result that is right but came through Horovod fails a test that claims the proxies.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
import threading
from typing import Callable, Dict, Iterable, Optional, Sequence, Set, Union

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


# -- the path a job claims ------------------------------------------------------------------------------

LANES_LINE = re.compile(r"FASTHOROVOD_LANES (\{.*\})")  # tests/workers/lanes.py


def ring_allreduce_bytes(ranks: int, *sizes: int) -> int:
    """What each rank's lanes send (and receive) at least for allreduces of `sizes` bytes among
    `ranks`: 2(n-1)/n of each. A lane's shard of s elements splits into n chunks; the ring sends
    all but two of them (tests/multiproc/test_trace.py ring_sent_elements), which falls short of
    2(n-1)/n s by less than 2 elements, and every frame also counts its 128-byte header, so the
    counters never fall below this bound."""
    return sum(2 * (ranks - 1) * b // ranks for b in sizes)


def ring_allgather_bytes(ranks: int, *sizes: int) -> int:
    """What each rank's lanes send at least for ring allgathers of rows of `sizes` bytes (one
    rank's contribution) among `ranks`: every other rank's row, once (headers on top)."""
    return sum((ranks - 1) * b for b in sizes)


@dataclasses.dataclass(frozen=True)
class Lanes:
    """The proxy path a job claims, checked on every rank from its lanes' counters (all the data
    planes the rank ran, summed lane by lane): every lane ran at least `min_collectives`
    collectives and, over TCP, sent and received something; all lanes together sent and received
    at least `min_bytes` (frame headers included: :func:`ring_allreduce_bytes` gives a bound).

    ``tcp=False``: the hierarchical allreduce on one host, which reduces through shared memory and
    runs no ring, so the lanes move no byte over TCP (checked) and only `min_collectives` tells.
    `ranks`: how many ranks end the job (an elastic job's final size), ``None`` for np.
    ``mesh=True``: the alltoall, whose bytes the lanes count apart (``mesh_bytes_*``: its mesh's
    sockets, not the rings'); its lanes share each block by how fast each drains, so one lane may
    carry nothing: only their sum is bounded there."""
    min_bytes: int = 1
    min_collectives: int = 1
    tcp: bool = True
    ranks: Optional[int] = None
    mesh: bool = False


Claim = Union[None, bool, Lanes]


def lane_reports(out: str, scenario: Optional[str] = None) -> Dict[int, list]:
    """rank -> its data planes, from the workers' FASTHOROVOD_LANES lines (one per rank): the job's
    whole lines, or with `scenario` the lines of that scenario of a job that ran several."""
    reports: Dict[int, list] = {}
    for match in LANES_LINE.finditer(out):
        report = json.loads(match.group(1))
        if report.get("scenario") != scenario:
            continue
        assert report["rank"] not in reports, f"rank {report['rank']} reported its lanes twice"
        reports[report["rank"]] = report["planes"]
    return reports


def check_lanes(out: str, claim: Claim, ranks: Iterable[int], scenario: Optional[str] = None) -> None:
    """Asserts the claimed path on each of `ranks` from the job's output `out`: a :class:`Lanes`
    (True: ``Lanes()``) for the proxies, False for Horovod's (no proxies, or lanes that ran
    nothing). A rank without its line fails: the claim is proved on every rank or not at all.
    `scenario`: the claim of one scenario of a job that ran several (:func:`run_scenarios`)."""
    if claim is None:
        return
    reports = lane_reports(out, scenario)
    missing = sorted(set(ranks) - set(reports))
    what = f"for scenario {scenario} " if scenario else ""
    assert not missing, f"ranks {missing} printed no lane counters {what}(tests/workers/lanes.py)\n{out[-3000:]}"
    for rank in sorted(set(ranks)):
        planes = reports[rank]
        if claim is False:
            moved = [lane for plane in planes for lane in plane["lanes"]
                     if lane["collectives"] or lane["bytes_sent"] or lane["bytes_received"]]
            assert not moved, f"rank {rank}: a Horovod-path job whose lanes carried collectives: {planes}"
            continue
        lanes = claim if isinstance(claim, Lanes) else Lanes()
        assert planes, f"rank {rank}: no proxies ran in a job that claims the proxy path"
        sent, received = ("mesh_bytes_sent", "mesh_bytes_received") if lanes.mesh else ("bytes_sent", "bytes_received")
        total = {key: [0] * max(len(plane["lanes"]) for plane in planes)
                 for key in ("bytes_sent", "bytes_received", "collectives")}
        for plane in planes:
            for j, lane in enumerate(plane["lanes"]):
                for key, counter in (("bytes_sent", sent), ("bytes_received", received), ("collectives", "collectives")):
                    total[key][j] += lane.get(counter, 0)
        summary = f"{what}rank {rank}: lanes sent {total['bytes_sent']} B, received {total['bytes_received']} B, " \
                  f"ran {total['collectives']} collectives"
        assert all(c >= lanes.min_collectives for c in total["collectives"]), \
            f"{summary}; every lane must run at least {lanes.min_collectives}"
        if lanes.tcp:
            if not lanes.mesh:
                assert all(total["bytes_sent"]) and all(total["bytes_received"]), f"{summary}; every lane must move bytes"
            for key in ("bytes_sent", "bytes_received"):
                assert sum(total[key]) >= lanes.min_bytes, f"{summary}; at least {lanes.min_bytes} B expected"
        else:
            assert not any(total["bytes_sent"]) and not any(total["bytes_received"]), \
                f"{summary}; on one host the hierarchical allreduce moves nothing over TCP"


def run_job(np: int, *worker_args: str, env: Optional[Dict[str, str]] = None, timeout: float = 240,
            expect_success: bool = True, launcher_args: Sequence[str] = (),
            worker: Path = WORKER, wrap: Sequence[str] = (),
            launcher: Sequence[str] = (str(HOROVODRUN), "--gloo"), proxied: Claim = None) -> subprocess.CompletedProcess:
    """`wrap` goes before the launcher (for example ``ip netns exec NAME``); `launcher` replaces
    ``horovodrun --gloo`` (for example ``fasthorovodrun --emulate-cloud SPEC``). `proxied`: the path
    the job's collectives take, checked on every rank once the job has succeeded (:func:`check_lanes`;
    ``None``: the test claims none)."""
    cmd = [*wrap, *launcher, "-np", str(np), *launcher_args, sys.executable, str(worker), *worker_args]
    full_env = dict(os.environ)
    full_env.setdefault("FASTHOROVOD_TIMEOUT_SECONDS", "60")
    # Every rank of these jobs runs on this one host, where the unset threshold would be 8 MiB
    # (fasthorovod/proxy/plan.py); the tests are written against the across-hosts default of 1 MiB.
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
    if expect_success:
        ranks = proxied.ranks if isinstance(proxied, Lanes) and proxied.ranks is not None else np
        check_lanes(out, proxied, range(ranks))
    return result


def run_scenarios(np: int, scenarios: Sequence[str], *worker_args: str, **job_args) -> subprocess.CompletedProcess:
    """One job that runs `scenarios` one after another in the same world (worker.py's
    ``SCENARIO,SCENARIO``), for tests that need the same world and settings: the launch, the
    imports and the proxies' start-up are paid once. Each test then checks its own scenario's
    output and its path, ``check_lanes(job.stdout, claim, range(np), scenario=NAME)``, from the
    lanes' counters of that scenario alone. The job itself claims no path (``proxied=None``)."""
    return run_job(np, ",".join(scenarios), *worker_args, **job_args)


def run_concurrently(jobs: Dict[str, Callable[[], object]]) -> Dict[str, tuple]:
    """Runs the jobs (name -> a function that runs one) at the same time, for jobs that spend most
    of their time waiting (for a timeout, a dying process, Horovod's elastic driver) rather than
    computing. Returns name -> (what it returned, None) or (None, the exception it raised), so
    that each test sharing them reports its own job's failure."""
    def run(name):
        try:
            return jobs[name](), None
        except Exception as exc:
            return None, exc

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return dict(zip(jobs, pool.map(run, jobs)))
