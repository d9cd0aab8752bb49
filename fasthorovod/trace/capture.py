"""Worker-side trace capture: training events of one rank, buffered and written off the hot path.

API (the data plane and the optimizer call these; docs/trace.md lists where)::

    from fasthorovod.trace import capture as trace

    trace.start_trace(dir, rank=r, size=n, barrier=hvd.barrier, allgather_object=hvd.allgather_object)
    if trace.tracer is not None:                           # the one check on the hot path when off
        trace.tracer.event("request", name, bytes=nbytes, requests=[seq, ...], proxied=True)
    with trace.span("update"):                             # a span [enter, exit); no-op object when off
        ...
    trace.complete("backward", "", t0_ns, t1_ns)           # a span measured by the caller
    trace.next_step()                                      # the optimizer finished an iteration
    trace.stop_trace()                                     # flush and close (also at exit)

Every event carries the current step (``tracer.step``: 0 at start, +1 per ``next_step()``) unless
it passes its own ``step=``. Times are ``time.monotonic_ns()`` (CLOCK_MONOTONIC, the clock the
proxies' C++ ``NowNs()`` reads too).

Cost: tracing off, ``trace.tracer is None`` (module functions ``event``/``span``/``complete`` do that
check themselves). Tracing on, an event is a clock read and one ``list.append`` of a tuple; a
background thread turns the tuples into JSON lines every ``flush_interval`` seconds, so no
formatting or file I/O happens on the caller's thread. File: ``DIR/rank<R>.worker.jsonl`` (format
in fasthorovod/trace/format.py and docs/trace.md).

Clock alignment (``start_trace`` is collective when ``barrier`` is given: every rank must call it).
Rank r stamps ``a_i = now()`` before and ``b_i = now()`` after each of ``rounds`` barriers, then the
stamps are allgathered. A barrier cannot complete on any rank before every rank has entered it, so
in round i there is an instant M_i with a_0,i ≤ M_i ≤ b_0,i on rank 0's clock and
a_r,i ≤ M_i − θ ≤ b_r,i on rank r's, where θ is rank r's offset (rank-0 time = local time + θ).
Hence θ ∈ [a_0,i − b_r,i, b_0,i − a_r,i] for every round. The estimate is the midpoint of the
intersection of these intervals, its half-width the error bound (NTP's reasoning with a barrier as
the exchanged message). If the intervals do not intersect (clock drift during the rounds), the
round with the narrowest interval is used. Rank 0 is the reference (offset 0, method "reference").
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

from fasthorovod.config import _text as _config_text
from fasthorovod.trace.format import END, worker_file_name

ENV_TRACE_DIR = "FASTHOROVOD_TRACE_DIR"

now_ns = time.monotonic_ns

tracer: Optional["Tracer"] = None  # the active tracer; None while tracing is off
_lock = threading.Lock()


def trace_dir_from_env(env=None) -> Optional[str]:
    """FASTHOROVOD_TRACE_DIR (declared as ``Config.trace_dir``), or None when unset or blank."""
    return _config_text(os.environ if env is None else env, "TRACE_DIR")


def clock_domain() -> str:
    """An id shared exactly by the processes that read the same CLOCK_MONOTONIC: the kernel's boot id
    (all processes of one host), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return "boot:" + f.read().strip()
    except OSError:
        return "host:" + socket.gethostname()


def estimate_clock_offset(rank: int, barrier: Callable[[], object], allgather_object: Callable,
                          rounds: int = 8, same_host_is_exact: bool = True) -> Tuple[int, int, str]:
    """(offset_ns, error_ns, method) of this rank's CLOCK_MONOTONIC against rank 0's (see module doc).

    Collective: every rank calls it with the same `rounds`. Ranks in rank 0's clock domain (same
    kernel) get exactly 0 ("same-host", unless `same_host_is_exact` is False: tests of the
    estimator); the others intersect the bounds of every round of every rank of their domain (they
    share one clock), which tightens the estimate.
    """
    stamps: List[Tuple[int, int]] = []
    for _ in range(rounds):
        a = now_ns()
        barrier()
        b = now_ns()
        stamps.append((a, b))
    everyone = allgather_object((clock_domain(), stamps))
    if rank == 0:
        return 0, 0, "reference"
    domain = everyone[rank][0]
    if domain == everyone[0][0] and same_host_is_exact:
        return 0, 0, "same-host"
    peers = [st for dom, st in everyone if dom == domain]
    return offset_from_stamps([everyone[0][1]] * len(peers), peers)


def offset_from_stamps(ref: Sequence, mine: Sequence) -> Tuple[int, int, str]:
    """Offset θ (rank-0 time = local + θ) and its error bound from per-round (enter, exit) stamps.

    `ref` and `mine` are rank 0's and this rank's [(enter, exit), ...]; or lists of such lists
    (several ranks that share one clock, each paired with rank 0's stamps).
    """
    if ref and isinstance(ref[0][0], (list, tuple)):
        pairs = [(r, m) for rs, ms in zip(ref, mine) for r, m in zip(rs, ms)]
    else:
        pairs = list(zip(ref, mine))
    bounds = [(a0 - br, b0 - ar) for (a0, b0), (ar, br) in pairs]
    lo = max(b[0] for b in bounds)
    hi = min(b[1] for b in bounds)
    if lo <= hi:
        return (lo + hi) // 2, (hi - lo + 1) // 2, "barrier-bounds"
    lo, hi = min(bounds, key=lambda b: b[1] - b[0])
    return (lo + hi) // 2, (hi - lo + 1) // 2, "barrier-narrowest"


class _NullSpan:
    """What ``span()`` returns while tracing is off."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set(self, **fields) -> None:
        pass


_NULL_SPAN = _NullSpan()


class _Span:
    __slots__ = ("_tracer", "_kind", "_name", "_fields", "_t0", "_step")

    def __init__(self, tracer: "Tracer", kind: str, name: str, fields: dict) -> None:
        self._tracer, self._kind, self._name, self._fields = tracer, kind, name, fields
        self._t0 = 0
        self._step = tracer.step

    def __enter__(self):
        self._t0 = now_ns()
        return self

    def __exit__(self, *exc):
        t1 = now_ns()
        self._tracer._buffer.append((self._kind, self._name, self._t0, t1 - self._t0, self._fields, self._step))
        return False

    def set(self, **fields) -> None:
        """Adds fields to the span (e.g. a result known only inside it)."""
        self._fields.update(fields)


class Tracer:
    """One rank's worker trace file and its background writer. Use start_trace()/stop_trace()."""

    def __init__(self, directory: str, rank: int, size: int, clock_offset_ns: int = 0, clock_error_ns: int = 0,
                 clock_method: str = "none", flush_interval: float = 0.5, metadata: Optional[dict] = None) -> None:
        os.makedirs(directory, exist_ok=True)
        self.rank, self.size = rank, size
        self.clock_offset_ns = clock_offset_ns
        self.step = 0
        self._buffer: list = []
        self._quoted: dict = {}  # JSON-quoted kinds and names (they repeat every iteration)
        self._written = 0
        self._flush_interval = flush_interval
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        part = 0
        while True:
            path = os.path.join(directory, worker_file_name(rank, part))
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                break
            except FileExistsError:
                part += 1
        self.path = path
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        meta = {"format": "fasthorovod-trace", "version": 1, "kind": "worker", "rank": rank, "size": size,
                "host": socket.gethostname(), "pid": os.getpid(), "clock": "CLOCK_MONOTONIC",
                "clock_offset_ns": clock_offset_ns, "clock_error_ns": clock_error_ns, "clock_method": clock_method,
                "started_ns": now_ns(), "started_unix_ns": time.time_ns(), "part": part}
        meta.update(metadata or {})
        self._file.write(json.dumps(meta) + "\n")
        self._file.flush()
        self._thread = threading.Thread(target=self._flush_loop, name="fasthorovod-trace", daemon=True)
        self._thread.start()

    # -- recording (any thread) ---------------------------------------------------------------------

    def event(self, kind: str, name: str = "", *, t_ns: Optional[int] = None, **fields) -> None:
        """An instant event, now (or at `t_ns`, monotonic ns)."""
        self._buffer.append((kind, name, now_ns() if t_ns is None else t_ns, None, fields, self.step))

    def span(self, kind: str, name: str = "", **fields) -> _Span:
        """A context manager recording the span [enter, exit)."""
        return _Span(self, kind, name, fields)

    def complete(self, kind: str, name: str, t0_ns: int, t1_ns: int, **fields) -> None:
        """A span measured by the caller (monotonic ns)."""
        self._buffer.append((kind, name, t0_ns, t1_ns - t0_ns, fields, self.step))

    def next_step(self) -> int:
        self.step += 1
        return self.step

    # -- writing (background thread, and stop) ------------------------------------------------------

    def _flush_loop(self) -> None:
        while not self._stop.wait(self._flush_interval):
            self.flush()

    def flush(self) -> None:
        with self._write_lock:
            if self._file.closed:
                return
            n = len(self._buffer)
            if n == 0:
                return
            items = self._buffer[:n]
            del self._buffer[:n]  # appends racing with this stay in the list (one GIL-atomic operation)
            lines = []
            quoted = self._quoted
            for kind, name, t, dur, fields, step in items:
                k = quoted.get(kind) or quoted.setdefault(kind, json.dumps(kind))
                nm = quoted.get(name) or quoted.setdefault(name, json.dumps(name))
                head = f'{{"k": {k}, "n": {nm}, "t": {t}' if dur is None else \
                    f'{{"k": {k}, "n": {nm}, "t": {t}, "d": {dur}'
                if "step" not in fields:
                    head += f', "step": {step}'
                lines.append(head + (", " + json.dumps(fields, default=str)[1:] if fields else "}"))
                if len(quoted) > 100_000:
                    quoted.clear()
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
            self._written += len(lines)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.flush()
        with self._write_lock:
            if not self._file.closed:
                self._file.write(json.dumps({"k": END, "t": now_ns(), "events": self._written, "dropped": 0}) + "\n")
                self._file.close()


def start_trace(directory: str, *, rank: Optional[int] = None, size: Optional[int] = None,
                barrier: Optional[Callable[[], object]] = None, allgather_object: Optional[Callable] = None,
                rounds: int = 8, clock_offset_ns: Optional[int] = None, flush_interval: float = 0.5,
                metadata: Optional[dict] = None) -> Tracer:
    """Starts this rank's worker trace in `directory` and returns the Tracer.

    With `barrier` and `allgather_object` (Horovod's), estimates the clock offset against rank 0
    first — then every rank must call start_trace. Without them the offset is `clock_offset_ns`
    (default 0: right for one host). rank/size default to HOROVOD_RANK/HOROVOD_SIZE, else 0/1.
    A running trace is stopped first. The proxies' traces are started separately, with the
    returned ``tracer.clock_offset_ns`` (ProxyGroup.start_trace).
    """
    global tracer
    if rank is None:
        rank = int(os.environ.get("HOROVOD_RANK", "0"))
    if size is None:
        size = int(os.environ.get("HOROVOD_SIZE", "1"))
    stop_trace()
    error, method = 0, "given" if clock_offset_ns is not None else "none"
    if barrier is not None and allgather_object is not None and size > 1:
        clock_offset_ns, error, method = estimate_clock_offset(rank, barrier, allgather_object, rounds)
    with _lock:
        tracer = Tracer(directory, rank, size, clock_offset_ns or 0, error, method, flush_interval, metadata)
        atexit.register(stop_trace)
        return tracer


def _forget_in_child() -> None:
    """A forked child (e.g. a DataLoader worker) does not write its parent's trace."""
    global tracer
    tracer = None


os.register_at_fork(after_in_child=_forget_in_child)


def stop_trace() -> Optional[str]:
    """Flushes and closes the worker trace; returns its path (None when no trace was running)."""
    global tracer
    with _lock:
        t, tracer = tracer, None
    if t is None:
        return None
    t.close()
    atexit.unregister(stop_trace)
    return t.path


def event(kind: str, name: str = "", *, t_ns: Optional[int] = None, **fields) -> None:
    """An instant event, now or at `t_ns` (no-op while tracing is off)."""
    t = tracer
    if t is not None:
        t.event(kind, name, t_ns=t_ns, **fields)


def span(kind: str, name: str = "", **fields):
    """``with span("update"):`` records the span (no-op object while tracing is off)."""
    t = tracer
    return _NULL_SPAN if t is None else t.span(kind, name, **fields)


def complete(kind: str, name: str, t0_ns: int, t1_ns: int, **fields) -> None:
    """A span measured by the caller (no-op while tracing is off)."""
    t = tracer
    if t is not None:
        t.complete(kind, name, t0_ns, t1_ns, **fields)


def next_step() -> int:
    """Advances the step every later event carries (the optimizer calls it after each update)."""
    t = tracer
    return t.next_step() if t is not None else 0
