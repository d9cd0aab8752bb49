"""Measurements for calibrate and validate: unit costs on this machine, and the repository's own
benchmark drivers (benchmarks/allreduce.py, benchmarks/train.py) on emulated clouds.

Every job also records the CPU other processes took meanwhile (``background_cores``): the
machine's busy time from /proc/stat, less softirq, less what this job used, over the job's wall
time. What the job used is its process tree's (children's rusage) plus that of the processes in
other network namespaces that are not in that tree: the ranks and proxies that Horovod's launcher
started over ssh on the emulated hosts are children of the hosts' sshd, not of the job (sampled
from /proc while the job runs; :class:`_CloudCpu`). The model gets it as
``Cluster.background_cores``, because on a shared 2-core machine another engineer's build is part
of the measurement."""
from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

import psutil

MiB = 1 << 20


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def benchmark_script(name: str) -> str:
    path = os.path.join(repo_root(), "benchmarks", name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: calibrate and validate run the repository's benchmarks "
                                "(use a source checkout)")
    return path


def _proc_stat():
    """(busy, softirq) seconds of the whole machine since boot: busy is user, nice, system, irq
    and softirq (not idle, iowait or steal)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq, t.softirq


def _net_namespace(pid: int) -> Optional[int]:
    """The inode of `pid`'s network namespace, None once it is gone. Read from /proc directly:
    psutil does not report namespaces."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


class _CloudCpu(threading.Thread):
    """CPU seconds, while it runs, of the processes in network namespaces other than this one's
    that do not descend from this process: an emulated cloud's ranks and proxies launched over ssh.
    Sampled every `period` seconds (psutil); a process seen first after the start counts from
    zero, one that existed before from its first sample. Another emulated cloud running at the same
    time (another engineer's job) would be counted as this job's too."""

    def __init__(self, period: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.stop = threading.Event()
        self._ns = _net_namespace(os.getpid())
        self._seen: Dict[Tuple[int, float], Tuple[float, float]] = {}  # (pid, start) -> (first, last)
        self._first = True

    @staticmethod
    def _stat(process: psutil.Process) -> Optional[Tuple[int, float, float]]:
        """(parent pid, user + system CPU seconds, start time) of `process`; None once it is gone."""
        try:
            with process.oneshot():
                times = process.cpu_times()
                return process.ppid(), times.user + times.system, process.create_time()
        except psutil.Error:
            return None

    def _descends_from_us(self, pid: int, parents: Dict[int, int]) -> bool:
        me = os.getpid()
        for _ in range(64):
            if pid == me:
                return True
            pid = parents.get(pid, 0)
            if pid <= 1:
                return False
        return False

    def sample(self) -> None:
        parents, usage = {}, {}
        for process in psutil.process_iter():
            pid = process.pid
            stat = self._stat(process)
            if stat is None:
                continue
            parents[pid] = stat[0]
            namespace = _net_namespace(pid)
            if namespace is None or namespace == self._ns:
                continue
            usage[pid] = stat
        for pid, (_, used, start) in usage.items():
            if self._descends_from_us(pid, parents):
                continue  # counted by the children's rusage
            key = (pid, start)
            first = self._seen.get(key, (used if self._first else 0.0, 0.0))[0]
            self._seen[key] = (first, used)
        self._first = False

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.period)

    def seconds(self) -> float:
        return sum(last - first for first, last in self._seen.values())


def run_measured(argv: List[str], timeout: float, env: Optional[dict] = None) -> Dict:
    """Runs a driver; returns its exit status, wall seconds and the other processes' CPU."""
    busy0, soft0 = _proc_stat()
    ch0 = os.times()
    cloud = _CloudCpu()
    cloud.sample()  # the baseline of what already runs elsewhere
    cloud.start()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, timeout=timeout, env=dict(os.environ, **(env or {})),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        rc, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    wall = time.monotonic() - t0
    cloud.stop.set()
    cloud.join()
    busy1, soft1 = _proc_stat()
    ch1 = os.times()
    ours = ((ch1.children_user - ch0.children_user) + (ch1.children_system - ch0.children_system)
            + (ch1.user - ch0.user) + (ch1.system - ch0.system) + cloud.seconds())
    other = max(0.0, (busy1 - busy0) - (soft1 - soft0) - ours) / max(wall, 1e-9)
    return {"rc": rc, "seconds": wall, "background_cores": other, "job_cores": ours / max(wall, 1e-9),
            "softirq_cores": (soft1 - soft0) / max(wall, 1e-9), "tail": out.splitlines()[-15:]}


def launcher(spec: str) -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "fasthorovodrun")
    if not os.path.exists(exe):
        exe = "fasthorovodrun"
    return f"{exe} --emulate-cloud {spec}"


def allreduce_job(spec: str, sizes: List[int], backends: str = "horovod,fasthorovod", iters: int = 3,
                  warmup: int = 1, timeout: float = 400, threshold: int = 64 << 10, ceiling: bool = False,
                  rounds: int = 1, trace_root: Optional[str] = None) -> Dict:
    """benchmarks/allreduce.py on one emulated cloud (one rank per host), with the raw-TCP ring
    ceiling first if `ceiling`, `rounds` times (separate jobs: new connections, new ports; each
    size's time is the median of the rounds' medians). Returns the driver's JSON with this job's
    background CPU and wall time."""
    from fasthorovod.netem.spec import parse_spec

    hosts = parse_spec(spec).hosts
    with tempfile.TemporaryDirectory(prefix="fhvd-sim-") as tmp:
        out = os.path.join(tmp, "allreduce.json")
        argv = [sys.executable, benchmark_script("allreduce.py"), "--launcher-prefix", launcher(spec),
                "--np", str(hosts), "--backends", backends, "--sizes", ",".join(str(s) for s in sizes),
                "--iters", str(iters), "--warmup", str(warmup), "--proxy-threshold", str(threshold),
                "--timeout", str(timeout), "--rounds", str(rounds), "--out", out] + (["--ceiling"] if ceiling else []) \
            + (["--trace-root", trace_root] if trace_root else [])
        meas = run_measured(argv, (timeout * 2 + 60) * rounds, env={"PYTHONPATH": _pythonpath()})
        doc = json.load(open(out)) if os.path.exists(out) else None
    return {"spec": spec, "hosts": hosts, "argv": shlex.join(argv), "measure": meas, "report": doc}


def ceiling_Bps(job: Dict) -> Optional[float]:
    """The raw-TCP ring ceiling of an allreduce job (bytes/s per host), None if not measured."""
    ceil = (job.get("report") or {}).get("ceiling") or {}
    return ceil["mean_gbps"] * 1e9 / 8 if ceil.get("status") == "ok" and ceil.get("mean_gbps") else None


def train_job(spec: str, np: int, model: str, backends: str, steps: int, warmup: int, trace_root: str,
              timeout: float = 600) -> Dict:
    with tempfile.TemporaryDirectory(prefix="fhvd-sim-") as tmp:
        out = os.path.join(tmp, "train.json")
        argv = [sys.executable, benchmark_script("train.py"), "--launcher-prefix", launcher(spec), "--np", str(np),
                "--model", model, "--backends", backends, "--steps", str(steps), "--warmup-steps", str(warmup),
                "--compute-steps", "0", "--trace-root", trace_root, "--timeout", str(timeout), "--out", out]
        meas = run_measured(argv, timeout * 2 + 60, env={"PYTHONPATH": _pythonpath()})
        doc = json.load(open(out)) if os.path.exists(out) else None
    return {"spec": spec, "np": np, "argv": shlex.join(argv), "measure": meas, "report": doc}


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (repo_root(), os.environ.get("PYTHONPATH")) if p)


def cloud_jobs(spec: str, backends: str, sizes: List[int], rounds: int = 1, ceiling: bool = False,
               **kw) -> List[Dict]:
    """The jobs of one cloud: Horovod once (with the ceiling if asked), FastHorovod `rounds` times
    (its speed depends on the ports its connections got: lab/scale.md)."""
    names = [b.strip() for b in backends.split(",") if b.strip()]
    hvd = [b for b in names if b.startswith("horovod")]
    fh = [b for b in names if not b.startswith("horovod")]
    jobs = []
    if hvd:
        jobs.append(allreduce_job(spec, sizes, ",".join(hvd), ceiling=ceiling, **kw))
    if fh:
        jobs.append(allreduce_job(spec, sizes, ",".join(fh), ceiling=ceiling and not hvd, rounds=rounds, **kw))
    return jobs


def observations(job: Dict) -> List[Dict]:
    """Flat rows (backend, hosts, bytes, seconds, k, S, probe 1-flow rate) from an allreduce job.

    A backend run for several rounds is several jobs, each with its own probe, and the probe does not
    always choose the same sockets per lane (on 6:1gbit:200mbit, 4 x 2 in most jobs, 4 x 4 or 4 x 8 in
    others). The rounds are grouped by the data plane they ran: one row per plane and size, whose
    seconds are the median of that plane's rounds (``rounds``: how many), so that every row is
    predicted with the plane that was measured."""
    rows = []
    doc = job.get("report") or {}
    for entry in doc.get("backends", []):
        if entry.get("status") != "ok":
            continue
        result = entry["result"]
        rounds = [e.get("result") or {} for e in entry.get("rounds") or []] or [result]
        # each round's own plane where every size kept its rounds' medians; else the first round's
        by_round = all(len(r.get("round_medians_s") or ()) == len(rounds) for r in result["results"])
        planes = [(rounds[i] if by_round else rounds[0]).get("data_plane") or result.get("data_plane") or {}
                  for i in range(len(rounds))]
        groups: Dict[tuple, List[int]] = {}  # (k, S) -> indices of the rounds that ran it, in order
        for i, plane in enumerate(planes):
            groups.setdefault((plane.get("lanes"), plane.get("sockets_per_lane")), []).append(i)
        for (k, S), members in groups.items():
            plane = planes[members[0]]
            curve = ((plane.get("probe") or {}).get("curve_bytes_per_second") or {})
            one_flow = curve.get("1", curve.get(1))
            for r in result["results"]:
                per_round = r.get("round_medians_s") or [r["median_s"]]
                members_s = [per_round[i] for i in members] if len(per_round) == len(rounds) else per_round
                seconds = float(statistics.median(members_s))
                rows.append({"spec": job["spec"], "hosts": job["hosts"], "backend": entry["backend"],
                             "bytes": r["bytes"], "seconds": seconds,
                             "busbw_gbps": r["busbw_gbps"] * r["median_s"] / seconds,
                             "round_seconds": members_s, "rounds": len(members_s), "k": k, "S": S,
                             "background_cores": job["measure"]["background_cores"],
                             "probe_one_flow_Bps": float(one_flow) if one_flow else None,
                             "probe_curve_Bps": {str(f): float(v) for f, v in curve.items()} or None,
                             "ceiling_Bps": ceiling_Bps(job)})
    return rows


def unit_costs() -> Dict[str, float]:
    """CPU-seconds per byte of a float32 reduce (the proxies' own kernel), a memcpy and loopback TCP
    (send + receive), each the best of three, thread CPU time (the placement model's measurement)."""
    from lab.placement import measure_unit_costs

    costs = measure_unit_costs(shard_bytes=16 * MiB, socket_bytes=64 * MiB)
    return {name: costs[name] for name in ("reduce", "copy", "socket")}