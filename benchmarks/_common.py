"""Plumbing shared by the benchmark drivers (allreduce.py, train.py).

Both scripts run in two roles. The *driver* (what a user starts) runs one job per backend in turn:
it checks that the backend's launcher and Python modules exist (reporting the backend as skipped
with the reason otherwise), starts N copies of the same script in ``--worker`` mode with that
backend's launcher, enforces a timeout (killing the whole process tree), and reads back the JSON
that rank 0 wrote. The *workers* do the measuring.

Backends, as written on the command line (``--backends a,b,c``):

    horovod-gloo (alias horovod)  horovodrun --gloo, ``import horovod.torch as hvd``
    horovod-mpi                   mpirun over TCP (see ``mpi_transport_args``), horovod.torch
                                  (either with a '+hierarchical' suffix: HOROVOD_HIERARCHICAL_ALLREDUCE=1)
    fasthorovod[:K[xS]]           horovodrun --gloo, ``import fasthorovod.torch as hvd``,
                                  FASTHOROVOD_NUM_LANES=K and FASTHOROVOD_SOCKETS_PER_LANE=S
                                  (each only when given: plain ``fasthorovod`` sets neither and
                                  runs FastHorovod's defaults; with '@DIR' also under their
                                  former names, which an earlier checkout reads);
                                  a '+trace' suffix also records its DLC trace (--trace-root),
                                  a '+flat' suffix sets FASTHOROVOD_HIERARCHICAL=0 (one ring
                                  through every rank even with several ranks per host),
                                  a '+norehash' suffix sets FASTHOROVOD_REHASH=0 (slow flows
                                  keep their connections), '+bf16' FastHorovod's
                                  Compression.bf16 (bfloat16 on the wire),
                                  an '@DIR' suffix runs the checkout DIR instead of this one
    torch-gloo[:D]                N processes started here, torch.distributed gloo (env://);
                                  with D, Gloo's several-device workaround: the interface
                                  named D times in GLOO_SOCKET_IFNAME
    torch-fasthorovod             the same processes on FastHorovod's torch.distributed backend
                                  (``import fasthorovod.distributed``; its defaults)
    mpi4py[:K]                    mpirun over TCP with btl_tcp_links=K (default 1), mpi4py

Each backend's command line is built by one function (``horovod_launch``, ``mpi_launch``,
``torch_launch``). A *launcher prefix* -- any horovodrun-compatible command, e.g.
``fasthorovodrun --emulate-cloud 4:1gbit:200mbit`` -- replaces horovodrun, mpirun and the local
spawning for every backend, so that the same benchmark runs on an emulated network.
"""
import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import psutil

# --------------------------------------------------------------------------------------------
# Sizes

def _load_units():
    """This checkout's fasthorovod/units.py, loaded from its file rather than imported: the workers
    of a backend ``fasthorovod@DIR`` import another checkout's package first, which may predate it."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fasthorovod", "units.py")
    spec = importlib.util.spec_from_file_location("_benchmarks_fasthorovod_units", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_units = _load_units()
# '64KiB' -> 65536 for argparse (an ArgumentTypeError names the bad text): a bare number is bytes,
# KiB/MiB/GiB are 1024^n, kB/MB/GB 1000^n, a bare K/M/G is refused as ambiguous.
parse_size = _units.bytes_argument
format_size = _units.format_bytes  # 65536 -> '64KiB' (exact binary units only, else plain bytes)


# --------------------------------------------------------------------------------------------
# Backends

KINDS = ("horovod-gloo", "horovod-mpi", "fasthorovod", "torch-gloo", "torch-fasthorovod", "mpi4py")
# torch.distributed kinds and the c10d backend each names
TORCH_BACKENDS = {"torch-gloo": "gloo", "torch-fasthorovod": "fasthorovod"}
# The lane settings' former names (fasthorovod/config.py ALIASES, not imported: see _load_units). A
# backend 'fasthorovod@DIR' sets them too, for a checkout from before the lanes were named.
FORMER_NAMES = {"FASTHOROVOD_NUM_LANES": "FASTHOROVOD_NUM_PROXIES",
                "FASTHOROVOD_SOCKETS_PER_LANE": "FASTHOROVOD_SOCKETS_PER_PROXY"}
_ALIASES = {"horovod": "horovod-gloo"}
# Kinds whose spec takes a count after a colon: lanes per worker, TCP links per peer, or Gloo devices.
_COUNTED = ("fasthorovod", "mpi4py", "torch-gloo")
# The module a Horovod-API worker imports as ``hvd``.
HVD_MODULES = {"horovod-gloo": "horovod.torch", "horovod-mpi": "horovod.torch",
               "fasthorovod": "fasthorovod.torch"}


@dataclass(frozen=True)
class Backend:
    spec: str              # as written by the user; the label in tables, JSON and plots
    kind: str              # one of KINDS
    count: int = None      # fasthorovod: proxies per worker; mpi4py: btl_tcp_links; torch-gloo: devices
    algorithm: str = None  # train.py only: the DistributedOptimizer algorithm (fasthorovod)
    trace: bool = False    # fasthorovod: record the DLC trace (spec suffix '+trace'; docs/trace.md)
    source: str = None     # fasthorovod: another checkout to run (spec suffix '@DIR', built in place)
    sockets: int = None    # fasthorovod: TCP connections per lane (spec 'fasthorovod:KxS')
    flat: bool = False     # fasthorovod: FASTHOROVOD_HIERARCHICAL=0 (spec suffix '+flat')
    hierarchical: bool = False  # horovod-*: HOROVOD_HIERARCHICAL_ALLREDUCE=1 (suffix '+hierarchical')
    compression: str = None  # horovod-*, fasthorovod: "fp16" (suffix '+fp16'), fasthorovod also "bf16"
    norehash: bool = False  # fasthorovod: FASTHOROVOD_REHASH=0 (suffix '+norehash')


def parse_backend(spec, kinds=KINDS, with_algorithm=False):
    """Parse 'kind[:count[xsockets]][:algorithm][+trace][+fp16][@DIR]' (xsockets, algorithm, +trace and
    @DIR only for fasthorovod; algorithm only if with_algorithm; +fp16, Horovod's Compression.fp16,
    for horovod and fasthorovod; +bf16, FastHorovod's Compression.bf16, for fasthorovod). 'fasthorovod:4x2' is 4 proxies with 2
    TCP connections each; plain 'fasthorovod' sets neither (FastHorovod's defaults), and so do
    'fasthorovod:ssd-sgd' and 'fasthorovod::ssd-sgd' (defaults, one algorithm). @DIR runs the fasthorovod of another
    checkout (its extension built in place: ``setup.py build_ext --inplace``), so that two versions
    can be measured in one invocation, interleaved by --rounds."""
    body = spec.strip()
    source = None
    if "@" in body:
        body, source = body.split("@", 1)
        source = os.path.abspath(source)
        if not os.path.isfile(os.path.join(source, "fasthorovod", "__init__.py")):
            raise ValueError(f"backend {spec!r}: {source} is not a fasthorovod checkout")
    body, *suffixes = body.split("+")
    unknown = set(suffixes) - {"trace", "flat", "hierarchical", "fp16", "bf16", "norehash"}
    if unknown:
        raise ValueError(f"backend {spec!r}: unknown suffix '+{sorted(unknown)[0]}' "
                         "(+trace, +flat, +hierarchical, +fp16, +bf16, +norehash)")
    trace, flat, hierarchical = ("trace" in suffixes), ("flat" in suffixes), ("hierarchical" in suffixes)
    compressions = [c for c in ("fp16", "bf16") if c in suffixes]
    if len(compressions) > 1:
        raise ValueError(f"backend {spec!r}: one compression at most (+fp16 or +bf16)")
    compression = compressions[0] if compressions else None
    parts = body.split(":")
    kind = _ALIASES.get(parts[0], parts[0])
    if kind not in kinds:
        raise ValueError(f"unknown backend {spec!r}; choose from {', '.join(kinds)}")
    if (with_algorithm and kind == "fasthorovod" and len(parts) == 2 and parts[1]
            and not parts[1][0].isdigit()):
        parts.insert(1, "")  # 'fasthorovod:ssd-sgd': FastHorovod's defaults, one algorithm
    if kind == "fasthorovod" and len(parts) == 3 and parts[1] == "" and parts[2]:
        parts[1] = None  # 'fasthorovod::ssd-sgd' is the same
    max_parts = 1 + (kind in _COUNTED) + (with_algorithm and kind == "fasthorovod")
    if len(parts) > max_parts:
        raise ValueError(f"backend {spec!r} has too many ':' fields")
    count = sockets = None
    if len(parts) > 1 and parts[1] is not None:
        match = re.fullmatch(r"(\d+)(?:x(\d+))?", parts[1])
        if not match or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
            raise ValueError(f"backend {spec!r}: the count after ':' must be a positive integer"
                             + (" (fasthorovod: K or KxS, lanes x sockets per lane)"
                                if kind == "fasthorovod" else ""))
        count = int(match.group(1))
        if match.group(2) is not None:
            if kind != "fasthorovod":
                raise ValueError(f"backend {spec!r}: only fasthorovod backends take sockets per lane (KxS)")
            sockets = int(match.group(2))
    algorithm = parts[2] if len(parts) > 2 else None
    if trace and kind != "fasthorovod":
        raise ValueError(f"backend {spec!r}: only fasthorovod backends can be traced (+trace)")
    if source and kind != "fasthorovod":
        raise ValueError(f"backend {spec!r}: only fasthorovod backends take a checkout (@DIR)")
    if flat and kind != "fasthorovod":
        raise ValueError(f"backend {spec!r}: only fasthorovod backends take +flat")
    norehash = "norehash" in suffixes
    if norehash and kind != "fasthorovod":
        raise ValueError(f"backend {spec!r}: only fasthorovod backends take +norehash")
    if hierarchical and kind not in ("horovod-gloo", "horovod-mpi"):
        raise ValueError(f"backend {spec!r}: only horovod backends take +hierarchical "
                         "(FastHorovod's is on by default; +flat turns it off)")
    if compression == "fp16" and kind not in HVD_MODULES:
        raise ValueError(f"backend {spec!r}: only horovod and fasthorovod backends take +fp16 (Compression.fp16)")
    if compression == "bf16" and kind != "fasthorovod":
        raise ValueError(f"backend {spec!r}: only fasthorovod backends take +bf16 (Compression.bf16, FastHorovod's)")
    return Backend(spec.strip(), kind, count, algorithm, trace, source, sockets, flat, hierarchical, compression,
                   norehash)


def parse_backends(text, kinds=KINDS, with_algorithm=False):
    return [parse_backend(spec, kinds, with_algorithm) for spec in text.split(",") if spec.strip()]


# Each probe runs in a fresh interpreter, so a broken build (e.g. an extension that fails to load)
# shows up as the import error it raises, not as a crash of the driver.
_PROBES = {
    "horovod-gloo": "import horovod.torch as h; assert h.gloo_built(), 'no Gloo in Horovod'",
    "horovod-mpi": "import horovod.torch as h; assert h.mpi_built(), 'no MPI in Horovod'",
    "fasthorovod": "import fasthorovod.torch",
    "torch-gloo": ("import torch.distributed as d; "
                   "assert d.is_available() and d.is_gloo_available(), 'torch built without gloo'"),
    "torch-fasthorovod": "import fasthorovod.distributed",
    "mpi4py": "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI",
}
_DEFAULT_LAUNCHERS = {"horovod-gloo": "horovodrun", "fasthorovod": "horovodrun",
                      "horovod-mpi": "mpirun", "mpi4py": "mpirun", "torch-gloo": None, "torch-fasthorovod": None}


def find_executable(name):
    """Look in this interpreter's bin directory first (an un-activated virtualenv), then PATH."""
    here = os.path.dirname(sys.executable)
    return shutil.which(name, path=os.pathsep.join([here, os.environ.get("PATH", "")]))


def unavailable_reason(backend, launcher_prefix=None):
    """None when the backend can run here, else a one-line reason."""
    launcher = launcher_prefix[0] if launcher_prefix else _DEFAULT_LAUNCHERS[backend.kind]
    if launcher and not find_executable(launcher):
        return f"launcher {launcher!r} not found"
    # -P: like the workers (started as scripts), do not import from the current directory.
    code = _PROBES[backend.kind]
    if backend.source:
        code += (f"; import fasthorovod; assert fasthorovod.__file__.startswith({backend.source!r}), "
                 f"'imports ' + fasthorovod.__file__ + ', not the checkout {backend.source}'")
    try:
        probe = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300,
                               env=job_env(backend_env(backend)))
    except subprocess.TimeoutExpired:
        return "import check did not finish in 300 s"
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"]
        return f"import check failed: {lines[-1]}"
    return None


_AVAILABILITY = {}


def unavailable_reason_once(backend, launcher_prefix=None):
    """``unavailable_reason``, checked once per backend and launcher in this driver: drivers that
    start the same backend many times (--rounds, repeat_train.py, sweep.py) pay for one import
    check, not one per job."""
    key = (backend, tuple(launcher_prefix or ()))
    if key not in _AVAILABILITY:
        _AVAILABILITY[key] = unavailable_reason(backend, launcher_prefix)
    return _AVAILABILITY[key]


# --------------------------------------------------------------------------------------------
# Launch commands: one function per backend family.


@dataclass
class Process:
    argv: list
    env: dict = field(default_factory=dict)  # added to the driver's environment


def trace_dir(backend, trace_root):
    """Where a '+trace' backend records its DLC trace: TRACE_ROOT/<spec with ':' and '+' as '_'>."""
    return os.path.join(os.path.abspath(trace_root), re.sub(r"[^A-Za-z0-9.-]", "_", backend.spec))


def job_env(*layers, environ=None):
    """This process's environment (or `environ`) with each of `layers` over it in turn; a lane
    variable set by a layer also replaces what was there under its former name (FORMER_NAMES),
    which FastHorovod would otherwise read as a second, conflicting value."""
    env = dict(os.environ if environ is None else environ)
    for layer in layers:
        for variable in layer:
            if variable in FORMER_NAMES and FORMER_NAMES[variable] not in layer:
                env.pop(FORMER_NAMES[variable], None)
        env.update(layer)
    return env


def backend_env(backend, proxy_threshold=None, trace_root="traces"):
    """Environment a backend's workers need besides the launcher's own."""
    env = {}
    if backend.trace:
        env["FASTHOROVOD_TRACE_DIR"] = trace_dir(backend, trace_root)
    if backend.kind == "fasthorovod":
        if backend.source:  # workers and their proxies import the other checkout's package first
            env["PYTHONPATH"] = os.pathsep.join(p for p in (backend.source, os.environ.get("PYTHONPATH")) if p)
        lanes = {"FASTHOROVOD_NUM_LANES": backend.count, "FASTHOROVOD_SOCKETS_PER_LANE": backend.sockets}
        for variable, value in lanes.items():
            if value is not None:
                env[variable] = str(value)
                if backend.source:
                    env[FORMER_NAMES[variable]] = str(value)
        if proxy_threshold is not None:
            env["FASTHOROVOD_PROXY_THRESHOLD_BYTES"] = str(proxy_threshold)
        if backend.flat:
            env["FASTHOROVOD_HIERARCHICAL"] = "0"
        if backend.norehash:
            env["FASTHOROVOD_REHASH"] = "0"
    if backend.hierarchical:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
    return env


def horovod_launch(backend, np, worker, launcher_prefix=None):
    """horovod-gloo and fasthorovod: ``horovodrun --gloo -np N worker...``."""
    launcher = launcher_prefix or [find_executable("horovodrun") or "horovodrun"]
    return [Process(launcher + ["--gloo", "-np", str(np)] + worker)]


def mpi_transport_args(links):
    """mpirun arguments that make Open MPI move every byte over TCP, even between ranks on one host.

    ``pml ob1`` selects the BTL-based messaging layer (UCX, another PML, would use shared memory on
    its own); ``btl tcp,self`` leaves out vader, the shared-memory BTL, so on-host peers talk TCP;
    ``btl_tcp_links`` asks for that many TCP connections per peer pair. (Checked with
    ``--mca btl_base_verbose``: only tcp and self initialise.)
    """
    return ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_links", str(links)]


def _mpi_args_for_horovodrun(links):
    """The same transport through a horovodrun-compatible launcher's ``--mpi-args``.

    horovodrun already puts ``-mca pml ob1 -mca btl ^openib`` on its mpirun line, and Open MPI
    rejects a parameter given twice, so ``btl tcp,self`` cannot be added there. Instead the BTLs
    that would outrank tcp (exclusivity 100) for a peer get exclusivity 0: vader (shared memory,
    65536) and ofi (libfabric, 65486; re-enabled by ``^openib`` where the system configuration
    excluded it). ob1 then sends to every other rank over TCP.
    """
    return (f"--mca btl_vader_exclusivity 0 --mca btl_ofi_exclusivity 0 "
            f"--mca btl_tcp_links {links}")


def mpi_launch(backend, np, worker, launcher_prefix=None):
    """horovod-mpi and mpi4py: ``mpirun -np N <TCP only> worker...``."""
    links = backend.count or 1
    if links > 1 and launcher_prefix and "--emulate-cloud" in launcher_prefix:
        print(f"warning: {backend.spec}: Open MPI 4.1's btl_tcp_links > 1 hangs here on messages of "
              "1 MiB and more between hosts with distinct addresses (measured on the emulated cloud; "
              "on loopback it works); the fix for its multi-link connection setup, "
              "open-mpi/ompi#4247, was never merged. Expect this backend to time out.",
              file=sys.stderr, flush=True)
    if launcher_prefix:
        return [Process(launcher_prefix + ["--mpi", "-np", str(np),
                                           "--mpi-args", _mpi_args_for_horovodrun(links)] + worker)]
    mpirun = [find_executable("mpirun") or "mpirun", "-np", str(np), "--oversubscribe",
              "--bind-to", "none"]
    return [Process(mpirun + mpi_transport_args(links) + worker)]


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torch_launch(backend, np, worker, launcher_prefix=None):
    """torch-gloo, torch-fasthorovod: N local processes with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (env://).

    Through a launcher prefix the ranks are started by it (``--gloo``); they take their rank from
    HOROVOD_RANK and meet through a file store (torch removes it when the last rank leaves), which
    works across the network namespaces of one host.
    """
    if launcher_prefix:
        store = os.path.join(tempfile.gettempdir(), f"torch-gloo-store-{uuid.uuid4().hex}")
        return [Process(launcher_prefix + ["--gloo", "-np", str(np)] + worker
                        + ["--rendezvous", f"file://{store}"])]
    port = str(free_port())
    return [Process(worker + ["--rendezvous", "env://"],
                    {"RANK": str(rank), "WORLD_SIZE": str(np), "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": port})
            for rank in range(np)]


LAUNCHES = {"horovod-gloo": horovod_launch, "fasthorovod": horovod_launch,
            "horovod-mpi": mpi_launch, "mpi4py": mpi_launch, "torch-gloo": torch_launch,
            "torch-fasthorovod": torch_launch}


def build_launch(backend, np, worker, launcher_prefix=None):
    """The processes the driver starts for one job of ``backend``; ``worker`` is the rank's argv."""
    if launcher_prefix:
        first, rest = launcher_prefix[0], launcher_prefix[1:]
        launcher_prefix = [find_executable(first) or first] + rest
    return LAUNCHES[backend.kind](backend, np, worker, launcher_prefix)


# --------------------------------------------------------------------------------------------
# Running a job: stream its output, keep a tail for the report, never hang.


@dataclass
class JobResult:
    returncode: int
    timed_out: bool
    seconds: float
    tail: list


def kill_tree(pid, grace=5.0):
    """SIGTERM a job's process, its descendants and its process group; SIGKILL what is left.

    The job was started as its own session, so its process group id is ``pid``. Signalling the
    group reaches descendants orphaned after ``pid`` exited; walking the tree reaches those that
    moved to a group of their own.
    """
    try:
        root = psutil.Process(pid)
        victims = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        victims = []
    _signal_group(pid, signal.SIGTERM)
    for proc in victims:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _signal_group(pid, signal.SIGKILL)


def _signal_group(pgid, signum):
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _pump(stream, prefix, tail):
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        tail.append(line.rstrip("\n"))
        sys.stderr.write(prefix + line)
        sys.stderr.flush()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def run_job(processes, timeout, extra_env):
    """Start ``processes``; wait for all to exit, for the first failure, or for the timeout.

    On failure or timeout every process tree of the job is killed, and so it is when the driver
    itself is interrupted or terminated (a SIGTERM, e.g. from ``timeout``, becomes SystemExit so
    that the clean-up runs and no job is left running, holding its emulated network). Output is
    echoed to stderr (prefixed by process index when the job has several) and the last lines are
    returned.
    """
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    tail = deque(maxlen=200)
    start = time.monotonic()
    procs, pumps = [], []
    try:
        for index, proc in enumerate(processes):
            env = job_env(extra_env, proc.env)
            popen = subprocess.Popen(proc.argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(popen)
            prefix = f"[{index}] " if len(processes) > 1 else ""
            pump = threading.Thread(target=_pump, args=(popen.stdout, prefix, tail), daemon=True)
            pump.start()
            pumps.append(pump)
        timed_out, returncode = _wait_all(procs, start + timeout)
    finally:
        for popen in procs:
            kill_tree(popen.pid)
        for pump in pumps:
            pump.join(timeout=5)
    return JobResult(returncode, timed_out, time.monotonic() - start, list(tail))


def _wait_all(procs, deadline):
    """(timed_out, returncode): the first non-zero exit status, else 0."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return False, failed[0]
        if all(c == 0 for c in codes):
            return False, 0
        if time.monotonic() > deadline:
            return True, -signal.SIGKILL
        time.sleep(0.2)


# Horovod's Gloo collectives time out after 30 s by default; broadcasting VGG16's 553 MB over one
# 200 Mbit/s flow of the emulated cloud takes longer than that. The job's own timeout still bounds
# every run.
GLOO_TIMEOUT_S = 600


def base_env(threads):
    """Environment for every job: thread count, Horovod's Gloo timeout (unless the caller set one),
    and mpirun's consent to run as root."""
    env = {"OMP_NUM_THREADS": str(threads),
           "HOROVOD_GLOO_TIMEOUT_SECONDS": os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", str(GLOO_TIMEOUT_S))}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


_ERROR_LINE = re.compile(r"\w*(Error|Exception): ")


def first_error(lines):
    """The first line that names an exception: the root cause, before the launcher's own report."""
    return next((line for line in lines if _ERROR_LINE.search(line)), None)


# --------------------------------------------------------------------------------------------
# Interleaved rounds, their spread, and progress


def interleave(plan, rounds):
    """(round, item) of every job in the order they run: the whole plan once per round, rounds one
    after another (A B C A B C ...), so that drift in the machine hits every item alike."""
    return [(number, item) for number in range(1, rounds + 1) for item in plan]


def spread(values):
    """{"median", "min", "max", "n"} of the numbers in ``values`` (None entries left out): the
    figure reported and its spread over rounds; None when there is none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def backend_rounds(rounds):
    """Per backend (its place in every round's list): its first round's entry, every round's entry,
    and the first entry that is not ok (None when all are)."""
    for index, first in enumerate(rounds[0]):
        entries = [r[index] for r in rounds]
        yield first, entries, next((e for e in entries if e["status"] != "ok"), None)


def paired_ratios(numerators, denominators):
    """Round by round a / b (rounds where either is missing or b is 0 left out): ratios of two
    things measured in the same round, whose spread says how far one round's ratio can be from
    another's."""
    return [a / b for a, b in zip(numerators, denominators) if a is not None and b]


def format_spread(stats, digits=2, suffix=""):
    """'0.78 [0.75-0.80]' (median [min-max]); just the median when there is one value; '-' for None."""
    if stats is None:
        return "-"
    text = f"{stats['median']:.{digits}f}{suffix}"
    if stats["n"] > 1:
        text += f" [{stats['min']:.{digits}f}-{stats['max']:.{digits}f}]"
    return text


def clock(seconds):
    """'12:05' (minutes:seconds)."""
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def entry_line(entry, describe):
    """A job's outcome in one line: ``describe(entry)`` when ok, else its status and reason."""
    if entry["status"] != "ok":
        return f"{entry['status']}: {entry['reason']}"
    return describe(entry)


def run_rounds(kind, plan, args, describe, proxy_threshold=None):
    """Run ``plan`` ([(backend, worker argv)]) ``args.rounds`` times, interleaved (``interleave``);
    returns the rounds, each a list of entries in plan order. Prints a line as each job starts (on
    stderr, with the job's own output) and ``round i/R, backend b: <describe(entry)>`` with the
    elapsed time as it ends. With several rounds, '+trace' backends keep each round's trace under
    TRACE_ROOT/roundI."""
    start = time.monotonic()
    rounds = [[] for _ in range(args.rounds)]
    order = interleave(plan, args.rounds)
    trace_root = getattr(args, "trace_root", None) or "traces"
    try:
        with tempfile.TemporaryDirectory(prefix=f"fasthorovod-{kind}-") as scratch:
            for index, (number, (backend, worker)) in enumerate(order, 1):
                if args.rounds > 1:
                    args.trace_root = os.path.join(trace_root, f"round{number}")
                head = f"round {number}/{args.rounds}, backend {backend.spec}"
                print(f"== {head}: job {index}/{len(order)} starts (elapsed {clock(time.monotonic() - start)})",
                      file=sys.stderr, flush=True)
                entry = run_backend(backend, args.np, worker, os.path.join(scratch, f"{index}.json"), args,
                                    proxy_threshold)
                rounds[number - 1].append(entry)
                print(f"{head}: {entry_line(entry, describe)} (job {entry.get('seconds', 0):.0f} s, "
                      f"elapsed {clock(time.monotonic() - start)})", flush=True)
    finally:
        args.trace_root = trace_root
    return rounds


# --------------------------------------------------------------------------------------------
# The raw-TCP ring ceiling: iperf3 between the emulated hosts a job's ranks run on


RING = "tcp-ring"  # the label of the ceiling job in tables and JSON
RING_BACKEND = Backend(RING, "horovod-gloo")  # started like a Horovod job; see ring_worker


def add_ring_arguments(parser):
    parser.add_argument("--ring-flows", type=int, default=None,
                        help="TCP flows each host sends to the next in the ceiling's iperf3 test "
                             "(default: enough to fill the cloud's links through its per-flow caps, "
                             "as netem check --ring: fasthorovod.netem.check.ring_flows)")
    parser.add_argument("--ring-seconds", type=float, default=3.0,
                        help="length of the ceiling's iperf3 test (default: %(default)s)")
    parser.add_argument("--ring-pattern", choices=("ring", "mesh"), default="ring", help=argparse.SUPPRESS)


def ring_worker_argv(script, args):
    """The ceiling job's rank: ``script --worker --backend tcp-ring``; the script's worker hands a
    tcp-ring backend to ``ring_worker``."""
    flows = [] if args.ring_flows is None else ["--ring-flows", str(args.ring_flows)]
    pattern = ["--ring-pattern", "mesh"] if getattr(args, "collective", None) == "alltoall" else []
    return [sys.executable, "-u", os.path.abspath(script), "--worker", "--backend", RING, *flows,
            "--ring-seconds", str(args.ring_seconds), *pattern]


def own_host():
    """This process's emulated host (a ``fasthorovod.netem.Host``) and its cloud's spec: the recorded
    host whose network namespace is this process's (the comparison ``ip netns identify`` makes);
    None outside them."""
    from fasthorovod.netem import list_instances

    mine = os.stat("/proc/self/ns/net")
    for state in list_instances():
        for host in state.hosts:
            try:
                theirs = os.stat(f"/run/netns/{host.name}")
            except OSError:
                continue
            if (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino):
                return host, state.spec
    return None


def ring_worker(args):
    """Every rank reports its emulated host; after Horovod has shut down (so that no rank's
    threads share the CPUs with the test), rank 0 measures the ring between those hosts
    (``fasthorovod.netem.check.measure_ring``: every host sends ``--ring-flows`` flows to the next
    at once, the traffic pattern of a ring allreduce) and writes the goodput each host received.
    For an alltoall (``--ring-pattern mesh``) every host sends to every other host at once instead
    (``measure_mesh``), as many flows in all, spread over the other hosts."""
    import horovod.torch as hvd

    hvd.init()
    try:
        host = own_host()
    except ImportError:  # no fasthorovod.netem here: not an emulated cloud either
        host = None
    hosts = hvd.allgather_object(host)
    rank = hvd.rank()
    spec = hosts[0][1] if hosts[0] is not None else None
    hosts = [h if h is None else h[0] for h in hosts]
    hvd.shutdown()
    if rank != 0:
        return
    outside = [r for r, h in enumerate(hosts) if h is None]
    distinct = list(dict.fromkeys(h for h in hosts if h is not None))  # one per host, in rank order
    if outside:
        result = {"skipped": f"ranks {outside} are not in an emulated cloud's host (the ceiling is "
                             "measured on clouds of fasthorovodrun --emulate-cloud)"}
    elif len(distinct) < 2:
        result = {"skipped": "every rank is on one emulated host: there is no ring to measure"}
    else:
        from fasthorovod.netem import NetemError, parse_spec
        from fasthorovod.netem.check import measure_mesh, measure_ring, ring_flows

        flows = args.ring_flows if args.ring_flows is not None else ring_flows(parse_spec(spec))
        mesh = getattr(args, "ring_pattern", "ring") == "mesh"
        try:
            if mesh:
                flows = -(-flows // (len(distinct) - 1))  # to each other host
                received = measure_mesh(distinct, flows, args.ring_seconds)
            else:
                received = measure_ring(distinct, flows, args.ring_seconds)
        except NetemError as err:
            if "iperf3 not found" not in str(err):
                raise
            result = {"skipped": str(err)}
        else:
            result = {"hosts": [h.name for h in distinct], "addresses": [h.address for h in distinct],
                      "pattern": "mesh" if mesh else "ring", "flows": flows, "seconds": args.ring_seconds,
                      "received_bits_per_s": received,
                      "mean_gbps": statistics.fmean(received) / 1e9, "min_gbps": min(received) / 1e9}
    write_json(args.result_file, result)


def ring_line(entry):
    """One ceiling job's result in a line."""
    result = entry["result"]
    where = "to every other host" if result.get("pattern") == "mesh" else "each to the next host"
    return (f"{result['mean_gbps']:.3f} Gbit/s per host (min {result['min_gbps']:.3f}), "
            f"{result['flows']} flows {where}")


def merge_ring(entries):
    """The ceiling over the rounds: the median of the rounds' mean (and minimum) per-host goodput,
    from the rounds that measured it, with every round's mean and their spread."""
    ok = [e["result"] for e in entries if e["status"] == "ok"]
    if not ok:
        first = entries[0] if entries else {"status": "skipped", "reason": "not measured (--no-ring)"}
        return {"status": first["status"], "reason": first.get("reason"), "rounds": entries}
    return {"status": "ok", "mean_gbps": statistics.median(r["mean_gbps"] for r in ok),
            "min_gbps": statistics.median(r["min_gbps"] for r in ok),
            "round_mean_gbps": [r["mean_gbps"] for r in ok], "rounds_measured": len(ok), "flows": ok[0]["flows"],
            "pattern": ok[0].get("pattern", "ring"),
            "spread": spread([r["mean_gbps"] for r in ok]), "rounds": entries}


def ceiling_line(ceiling):
    """The ceiling over the rounds (``merge_ring``) in a line, or why it was not measured."""
    if ceiling["status"] != "ok":
        return f"raw-TCP ring ceiling: {ceiling['status']}: {ceiling['reason']}"
    rounds = ceiling["rounds_measured"]
    what = ("mesh ceiling ({} job, iperf3, every host to every other at once)" if ceiling.get("pattern") == "mesh"
            else "ring ceiling ({}, iperf3, every host to the next at once)").format(RING)
    return (f"raw-TCP {what}: "
            f"{format_spread(ceiling['spread'], 3)} Gbit/s per host (median [min-max] over "
            f"{rounds} round{'s' if rounds != 1 else ''})")


def round_ceilings(entries):
    """Each round's ceiling (mean Gbit/s per host), None where that round did not measure it."""
    return [e["result"]["mean_gbps"] if e["status"] == "ok" else None for e in entries]


def settings_note(specs, proxy_threshold=None):
    """A line saying which FastHorovod backends run with hand-set FASTHOROVOD_* variables (their
    spec's KxS, the driver's --proxy-threshold) and which with FastHorovod's defaults, and what
    they inherit from this environment; None when no fasthorovod backend is among ``specs``."""
    notes = []
    for spec in dict.fromkeys(specs):
        try:
            backend = parse_backend(spec, with_algorithm=True)
        except ValueError:
            continue
        if backend.kind != "fasthorovod":
            continue
        env = {k: v for k, v in backend_env(backend, proxy_threshold).items()
               if k in ("FASTHOROVOD_NUM_LANES", "FASTHOROVOD_SOCKETS_PER_LANE",
                        "FASTHOROVOD_PROXY_THRESHOLD_BYTES", "FASTHOROVOD_HIERARCHICAL")}
        inherited = {k: v for k, v in inherited_fasthorovod_env().items() if k not in env}
        if env:
            note = f"{spec}: hand-set " + " ".join(f"{k}={v}" for k, v in env.items())
        else:
            note = f"{spec}: FastHorovod's defaults" + ("" if inherited else " (no FASTHOROVOD_* set)")
        if inherited:
            note += ", inheriting " + " ".join(f"{k}={v}" for k, v in inherited.items())
        notes.append(note)
    return "; ".join(notes) or None


def run_backends(kind, backends, args, worker_argv):
    """Runs every backend's job in turn (each writing its result to a scratch file) and returns
    their entries, in order."""
    entries = []
    with tempfile.TemporaryDirectory(prefix=f"fasthorovod-{kind}-") as scratch:
        for index, backend in enumerate(backends):
            result_file = os.path.join(scratch, f"{index}.json")
            entries.append(run_backend(backend, args.np, worker_argv(backend, args), result_file, args,
                                       args.proxy_threshold))
    return entries


def portable_command(argv) -> str:
    """`argv` as a shell line that names no path of this machine: paths inside the repository are
    written relative to it (the benchmarks run from its root), scratch files as $TMPDIR/...."""
    repo, scratch = os.path.dirname(os.path.dirname(os.path.abspath(__file__))), tempfile.gettempdir()
    words = []
    for word in map(str, argv):
        if word.startswith(repo + os.sep):
            word = os.path.relpath(word, repo)
        elif word.startswith(scratch + os.sep):
            word = "$TMPDIR" + word[len(scratch):]
        elif word.startswith("file://" + scratch + os.sep):  # a torch.distributed file store
            word = "file://$TMPDIR" + word[len("file://" + scratch):]
        words.append(word)
    return shlex.join(words)


def run_backend(backend, np, worker, result_file, args, proxy_threshold=None):
    """Run one backend's job and describe the outcome as a JSON-ready dict.

    status is "ok" (with the worker's ``result``), "skipped" (with ``reason``: not available here,
    or the worker declined) or "failed" (with ``reason``, the first ``error`` line of the output
    and its last lines as ``tail``).
    """
    entry = {"backend": backend.spec}
    reason = unavailable_reason_once(backend, args.launcher_prefix)
    if reason:
        return dict(entry, status="skipped", reason=reason)
    processes = build_launch(backend, np, worker + ["--result-file", result_file],
                             args.launcher_prefix)
    entry["commands"] = [portable_command(p.argv) for p in processes]
    entry["env"] = backend_env(backend, proxy_threshold, getattr(args, "trace_root", None) or "traces")
    if backend.trace:
        shutil.rmtree(entry["env"]["FASTHOROVOD_TRACE_DIR"], ignore_errors=True)  # no stale lanes
    print(f"== {backend.spec}: {entry['commands'][0]}", file=sys.stderr, flush=True)
    entry["started_at"] = time.time()  # wall clock, for the workers' own timelines (train.py)
    try:
        job = run_job(processes, args.timeout, dict(base_env(args.threads), **entry["env"]))
    except OSError as err:
        return dict(entry, status="failed", reason=f"could not start the job: {err}")
    entry["ended_at"] = time.time()
    entry["seconds"] = round(job.seconds, 1)
    failure = dict(entry, status="failed", tail=job.tail)
    if job.timed_out:  # what the killed processes printed last is not the cause
        return dict(failure, reason=f"timed out after {args.timeout:g} s")
    failure["error"] = first_error(job.tail)
    if job.returncode != 0:
        return dict(failure, reason=f"exit status {job.returncode}")
    try:
        with open(result_file) as f:
            result = json.load(f)
    except (OSError, ValueError) as err:
        return dict(failure, reason=f"no result from rank 0: {err}")
    if "skipped" in result:
        return dict(entry, status="skipped", reason=result["skipped"])
    return dict(entry, status="ok", result=result)


# --------------------------------------------------------------------------------------------
# Driver options and reports


def default_threads(np):
    """CPU threads per rank: this machine's cores shared among the ranks, at least one."""
    return max(1, len(os.sched_getaffinity(0)) // np)


def add_driver_arguments(parser):
    """Options both drivers share."""
    parser.add_argument("--np", type=int, default=2, help="number of ranks (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds one backend's job may take before it is killed "
                             "(default: %(default)s)")
    parser.add_argument("--threads", type=int,
                        help="torch/OpenMP threads per rank (default: cores / np, at least 1)")
    parser.add_argument("--launcher-prefix", type=shlex.split, metavar="CMD",
                        help="a horovodrun-compatible launcher that starts the ranks of every "
                             "backend instead of horovodrun/mpirun/local spawning, e.g. "
                             "'fasthorovodrun --emulate-cloud 4:1gbit:200mbit'; it receives "
                             "--gloo or --mpi [--mpi-args ...], -np N and the worker command")
    parser.add_argument("--out", help="write the merged results as JSON here")
    parser.add_argument("--plot", help="write a PNG plot here")
    parser.add_argument("--trace-root", default="traces", metavar="DIR",
                        help="a fasthorovod backend written with the suffix '+trace' (e.g. "
                             "fasthorovod:4+trace) records its DLC trace into DIR/<backend> "
                             "(allreduce.py --rounds N: DIR/roundK/<backend>), for 'fasthorovod-trace "
                             "analyze' (default: %(default)s)")


_WORKER_ARGS = ("worker", "backend", "result_file", "rendezvous")


def add_worker_arguments(parser):
    """Options only the driver passes to its workers (hidden from --help)."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)       # this rank's backend spec
    parser.add_argument("--result-file", help=argparse.SUPPRESS)   # where rank 0 writes its JSON
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)    # torch.distributed init_method


def rank_from_env():
    """(rank, size) from whichever launcher started this process."""
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("HOROVOD_RANK", "HOROVOD_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    raise RuntimeError("no RANK, HOROVOD_RANK or OMPI_COMM_WORLD_RANK in the environment")


class TorchWorld:
    """A torch.distributed world for a torch-* backend (TORCH_BACKENDS), with the few calls the
    workers make of Horovod's API: ``rank``, ``size``, ``allgather_object``, ``proxy_group`` (the
    FastHorovod backend's proxies, else None) and ``shutdown``. torch-gloo:D names the interface
    D times in GLOO_SOCKET_IFNAME (the emulated cloud's ranks run on FASTHOROVOD_IFACE, eth0;
    loopback's on lo)."""

    def __init__(self, backend, rendezvous):
        import torch.distributed as dist
        if backend.kind == "torch-fasthorovod":
            import fasthorovod.distributed  # noqa: F401  (registers the backend)
        if backend.count:
            os.environ["GLOO_SOCKET_IFNAME"] = ",".join([os.environ.get("FASTHOROVOD_IFACE") or "lo"] * backend.count)
        self.dist = dist
        self._rank, self._size = rank_from_env()
        dist.init_process_group(TORCH_BACKENDS[backend.kind], init_method=rendezvous, rank=self._rank,
                                world_size=self._size)

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def allgather_object(self, obj):
        out = [None] * self._size
        self.dist.all_gather_object(out, obj)
        return out

    def proxy_group(self):
        return getattr(self.dist.distributed_c10d._get_default_group(), "proxies", None)

    def shutdown(self):
        self.dist.destroy_process_group()


def machine_info():
    """Facts about the machine and software that a result depends on."""
    model = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    versions = {}
    for package in ("torch", "horovod", "fasthorovod", "mpi4py", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "packages": versions,
        "open_mpi": _open_mpi_version(),
    }


def _read_lines(path):
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def _open_mpi_version():
    mpirun = find_executable("mpirun")
    if not mpirun:
        return None
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else None


def inherited_fasthorovod_env():
    """The FASTHOROVOD_* variables of this process's environment, which every job inherits: a
    backend spelled plain ``fasthorovod`` runs FastHorovod's defaults only when this is empty."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("FASTHOROVOD_")}


def warn_inherited_fasthorovod_env():
    """Say on stderr which FASTHOROVOD_* variables every job inherits (they are also in the JSON's
    ``env``); returns them."""
    inherited = inherited_fasthorovod_env()
    if inherited:
        print("warning: every job inherits " + " ".join(f"{k}={v}" for k, v in inherited.items())
              + " from this environment, so no FastHorovod job runs with FastHorovod's defaults "
              "(unset them for that)", file=sys.stderr, flush=True)
    return inherited


def data_plane(hvd):
    """What FastHorovod's data plane ran with (lanes, sockets per lane and where that number came
    from, the start-up probe's curve): rank-local ``hvd.proxy_group().describe()``; None for
    Horovod, without proxies, or for a FastHorovod that cannot describe it."""
    group = getattr(hvd, "proxy_group", lambda: None)()
    describe = getattr(group, "describe", None)
    return describe() if describe is not None else None


def data_plane_label(info):
    """'4x2 (probe)' from a ``data_plane`` record: lanes x sockets per lane (where S came from);
    with the hierarchical allreduce also ', hier 2x2' (hosts x ranks per host); with connections
    the re-hashing policy replaced on rank 0, ', 3 re-hashed'."""
    if not info:
        return "-"
    source = info.get("sockets_source") or "?"
    # (records made before the lanes were named give the variable's former name)
    source = ("set" if source in ("FASTHOROVOD_SOCKETS_PER_LANE", "FASTHOROVOD_SOCKETS_PER_PROXY")
              else source.split(" (")[0])
    hierarchical = info.get("hierarchical")
    where = f", hier {hierarchical['hosts']}x{hierarchical['ranks_per_host']}" if hierarchical else ""
    rehashed = f", {info['rehashes']} re-hashed" if info.get("rehashes") else ""
    return f"{info['lanes']}x{info['sockets_per_lane']} ({source}){where}{rehashed}"


def relevant_env():
    """The HOROVOD_*, FASTHOROVOD_*, OMPI_MCA_* and GLOO_* settings the run inherited."""
    prefixes = ("HOROVOD_", "FASTHOROVOD_", "OMPI_MCA_", "GLOO_")
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}


def report(benchmark, args, entries):
    """The JSON document a driver writes."""
    return {"benchmark": benchmark,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(), "env": relevant_env(),
            "args": {k: v for k, v in vars(args).items() if k not in _WORKER_ARGS},
            "backends": entries}


def write_json(path, obj):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def format_table(headers, rows):
    """Left-aligned first column, right-aligned others, two spaces between columns."""
    cells = [list(map(str, headers))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(parts).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_problems(entries):
    """List skipped and failed backends on stdout, with a failure's first error line."""
    for entry in entries:
        if entry["status"] != "ok":
            print(f"{entry['backend']}: {entry['status']}: {entry['reason']}")
            if entry.get("error"):
                print(f"    {entry['error']}")


def check_extras(args, needs=()):
    """Fails fast — before any job runs — when an optional package of fasthorovod[bench] that this
    run needs is missing (--plot: matplotlib; `needs`: more pip names): one line on stderr with the
    pip command, exit status 1."""
    from fasthorovod.extras import MissingExtraError, require

    program = os.path.basename(sys.argv[0]) or "benchmark"
    wanted = [(package, program) for package in needs]
    if getattr(args, "plot", None):
        wanted.append(("matplotlib", f"{program} --plot"))
    for package, feature in wanted:
        try:
            require(package, "bench", feature)
        except MissingExtraError as e:
            sys.exit(str(e))


def main(parse_args, worker, driver, argv=None, needs=()):
    """The entry point of every benchmark script: ``--worker`` runs one rank, else the driver
    (after check_extras: `needs` are the optional packages the run needs besides --plot's)."""
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    check_extras(args, needs)
    return driver(args)


def save_figure(fig, path):
    """Writes a matplotlib figure to `path` (creating its directory) and closes it."""
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
