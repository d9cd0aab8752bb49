"""The trace files: names, layouts and readers (docs/trace.md is the reference).

A trace directory holds, per rank R,

* ``rank<R>.worker.jsonl`` — the worker's events (fasthorovod.trace.capture): line 1 is a metadata
  object (``"kind": "worker"``), every further line one event::

      {"k": KIND, "n": NAME, "t": T_NS}                 an instant
      {"k": KIND, "n": NAME, "t": T_NS, "d": DUR_NS}    a span [t, t + d)
      ... plus the event's fields (e.g. "step", "bytes", "requests")

  and a last line ``{"k": "_end", "t": ..., "events": N, "dropped": 0}`` when the trace was stopped
  cleanly;
* ``rank<R>.lane<J>.bin`` per proxy lane J — the proxies' per-frame records, written by the C++
  ``TraceRecorder`` (csrc/trace/recorder.h): a 4096-byte header (magic ``FHVTRACE``, uint32
  version, uint32 header size, JSON metadata padded with spaces) followed by 104-byte
  little-endian records (``RECORD_DTYPE``).

A restarted proxy or a second ``start_trace`` into the same directory never overwrites: it writes
``….p1.bin``/``….worker.p1.jsonl`` and so on; the reader merges the parts of one rank and lane.
All times are CLOCK_MONOTONIC nanoseconds of the writing host; adding the file's
``clock_offset_ns`` gives rank 0's clock.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

MAGIC = b"FHVTRACE"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
FRAME_HEADER_BYTES = 128  # bytes of the ring's frame header on the wire; records count payload only

# Event kinds the analysis understands (any other kind is kept and shown, but not interpreted).
FORWARD, BACKWARD, COMPUTE = "forward", "backward", "compute"  # spans: computation
COMPUTE_KINDS = (FORWARD, BACKWARD, COMPUTE)
GRAD_READY = "grad_ready"  # instant: a bucket's gradients are all accumulated
REQUEST = "request"        # instant: an allreduce was posted (fields: bytes, requests, proxied, handle)
COMPLETE = "complete"      # instant: the worker saw an allreduce complete
WAIT = "wait"              # span: the worker blocked waiting for communication
UPDATE = "update"          # span: the optimizer's parameter update
END = "_end"               # last line of a cleanly stopped worker file

# TraceDirection / TraceOp / TraceDep of csrc/trace/recorder.h
SEND, RECV = 0, 1
OP_ALLREDUCE, OP_ALLGATHER, OP_ABORT, OP_REDUCESCATTER = 1, 2, 3, 4
DEP_NONE, DEP_ON_REQUEST, DEP_ON_RECEIVE, DEP_ON_PEER_SEND = 0, 1, 2, 3
NO_REQUEST = (1 << 64) - 1
FLAG_ZERO_FILL = 1

RECORD_FIELDS = [  # (name, numpy type): the MessageRecord layout, 104 bytes
    ("id", "<u8"), ("dep_id", "<i8"), ("seq", "<u8"), ("request", "<u8"), ("name_hash", "<u8"),
    ("bytes", "<u8"), ("shard_bytes", "<u8"), ("ready_ns", "<i8"), ("start_ns", "<i8"), ("end_ns", "<i8"),
    ("src", "<u4"), ("dst", "<u4"), ("step", "<u4"), ("segment", "<u4"), ("lane", "<u2"), ("socket", "<u2"),
    ("direction", "u1"), ("op", "u1"), ("dep_type", "u1"), ("flags", "u1"),
]
RECORD_BYTES = 104


def record_dtype():
    import numpy as np

    dt = np.dtype(RECORD_FIELDS)
    assert dt.itemsize == RECORD_BYTES, dt.itemsize
    return dt


def worker_file_name(rank: int, part: int = 0) -> str:
    return f"rank{rank}.worker.jsonl" if part == 0 else f"rank{rank}.worker.p{part}.jsonl"


def proxy_file_name(rank: int, lane: int, part: int = 0) -> str:
    return f"rank{rank}.lane{lane}.bin" if part == 0 else f"rank{rank}.lane{lane}.p{part}.bin"


_WORKER_RE = re.compile(r"^rank(\d+)\.worker(?:\.p(\d+))?\.jsonl$")
_PROXY_RE = re.compile(r"^rank(\d+)\.lane(\d+)(?:\.p(\d+))?\.bin$")


class TraceFormatError(ValueError):
    """A trace file is not in the format described in docs/trace.md."""


@dataclass
class ProxyFile:
    path: str
    meta: dict
    records: object  # numpy structured array of RECORD_DTYPE
    truncated_bytes: int = 0  # a partial record at the end (the writer died mid-write)

    @property
    def rank(self) -> int:
        return int(self.meta["rank"])

    @property
    def lane(self) -> int:
        return int(self.meta["lane"])

    @property
    def offset_ns(self) -> int:
        return int(self.meta.get("clock_offset_ns", 0))


@dataclass
class WorkerFile:
    path: str
    meta: dict
    events: List[dict]
    complete: bool  # ended with the "_end" line

    @property
    def rank(self) -> int:
        return int(self.meta["rank"])

    @property
    def offset_ns(self) -> int:
        return int(self.meta.get("clock_offset_ns", 0))


@dataclass
class TraceDir:
    path: str
    workers: Dict[int, List[WorkerFile]] = field(default_factory=dict)            # rank -> parts
    proxies: Dict[Tuple[int, int], List[ProxyFile]] = field(default_factory=dict)  # (rank, lane) -> parts

    @property
    def ranks(self) -> List[int]:
        return sorted(set(self.workers) | {r for r, _ in self.proxies})

    @property
    def lanes(self) -> List[int]:
        return sorted({j for _, j in self.proxies})


def read_proxy_file(path: str) -> ProxyFile:
    import numpy as np

    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 16 or data[:8] != MAGIC:
        raise TraceFormatError(f"{path}: not a FastHorovod proxy trace (bad magic)")
    version = int.from_bytes(data[8:12], "little")
    header = int.from_bytes(data[12:16], "little")
    if version != FORMAT_VERSION:
        raise TraceFormatError(f"{path}: format version {version}, this reader knows {FORMAT_VERSION}")
    if header < 16 or len(data) < header:
        raise TraceFormatError(f"{path}: truncated header")
    try:
        meta = json.loads(data[16:header].decode("utf-8"))
    except ValueError as e:
        raise TraceFormatError(f"{path}: bad metadata: {e}") from None
    if meta.get("record_bytes", RECORD_BYTES) != RECORD_BYTES:
        raise TraceFormatError(f"{path}: record size {meta.get('record_bytes')} != {RECORD_BYTES}")
    body = len(data) - header
    n = body // RECORD_BYTES
    records = np.frombuffer(data, dtype=record_dtype(), count=n, offset=header).copy()
    return ProxyFile(path, meta, records, body - n * RECORD_BYTES)


def read_worker_file(path: str) -> WorkerFile:
    events: List[dict] = []
    meta = None
    complete = False
    with open(path, "r", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                if number == 1:
                    raise TraceFormatError(f"{path}: line 1 is not the metadata object") from None
                break  # a partial last line from a process that died mid-write
            if meta is None:
                if obj.get("kind") != "worker":
                    raise TraceFormatError(f"{path}: line 1 is not worker metadata")
                meta = obj
            elif obj.get("k") == END:
                complete = True
            else:
                events.append(obj)
    if meta is None:
        raise TraceFormatError(f"{path}: empty")
    return WorkerFile(path, meta, events, complete)


def load_trace_dir(path: str) -> TraceDir:
    """Reads every trace file in `path` (parts of one rank/lane sorted by part number)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"trace directory {path!r} does not exist")
    trace = TraceDir(path)
    workers: Dict[int, List[Tuple[int, WorkerFile]]] = {}
    proxies: Dict[Tuple[int, int], List[Tuple[int, ProxyFile]]] = {}
    for full in sorted(glob.glob(os.path.join(path, "rank*"))):
        name = os.path.basename(full)
        m = _WORKER_RE.match(name)
        if m:
            workers.setdefault(int(m.group(1)), []).append((int(m.group(2) or 0), read_worker_file(full)))
            continue
        m = _PROXY_RE.match(name)
        if m:
            pf = read_proxy_file(full)
            proxies.setdefault((int(m.group(1)), int(m.group(2))), []).append((int(m.group(3) or 0), pf))
    trace.workers = {r: [w for _, w in sorted(parts, key=lambda x: x[0])] for r, parts in workers.items()}
    trace.proxies = {k: [p for _, p in sorted(parts, key=lambda x: x[0])] for k, parts in proxies.items()}
    if not trace.workers and not trace.proxies:
        raise TraceFormatError(f"{path}: no trace files (rank<R>.worker.jsonl, rank<R>.lane<J>.bin)")
    return trace
