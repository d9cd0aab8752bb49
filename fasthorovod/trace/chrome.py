"""Chrome trace export (chrome://tracing, https://ui.perfetto.dev) of a trace directory.

One process per rank (pid = rank, named "rank R (host)"), with these threads (tracks):

* tid 0 "worker": the worker's spans (forward, backward, compute, wait, update, ...) as complete
  events and its instants (grad_ready, request, complete, ...);
* tid 1 "allreduce": each request from posted to completed, as an async span (they overlap);
* tid 1000 + 64·lane + 2·socket + direction, "lane J send" / "lane J recv" (with ".S" for socket S
  when a lane has several sockets): one complete event per frame, named "s<step>.<segment>",
  with its bytes, collective, request and dependency in args.

Timestamps are microseconds since the earliest event of the trace, on rank 0's clock.
"""
from __future__ import annotations

import json
from typing import List

from fasthorovod.trace import format as fmt
from fasthorovod.trace.analyze import Loaded

WORKER_TID, REQUEST_TID = 0, 1


def lane_tid(lane: int, socket: int, direction: int) -> int:
    return 1000 + 64 * lane + 2 * socket + direction


def lane_track_name(lane: int, socket: int, direction: int, sockets: int) -> str:
    side = "send" if direction == fmt.SEND else "recv"
    return f"lane {lane} {side}" if sockets <= 1 else f"lane {lane}.{socket} {side}"


def chrome_events(loaded: Loaded) -> List[dict]:
    origin = loaded.origin

    def us(t: int) -> float:
        return (t - origin) / 1e3

    events: List[dict] = []
    hosts = {}
    for rank, parts in loaded.trace.workers.items():
        hosts[rank] = parts[0].meta.get("host", "")
    for (rank, _), parts in loaded.trace.proxies.items():
        hosts.setdefault(rank, parts[0].meta.get("host", ""))
    for rank in loaded.trace.ranks:
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank} ({hosts.get(rank, '')})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})

    for rank, evs in loaded.events.items():
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": WORKER_TID, "args": {"name": "worker"}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": REQUEST_TID,
                       "args": {"name": "allreduce"}})
        for e in evs:
            args = dict(e.fields)
            if e.step is not None:
                args["step"] = e.step
            name = e.kind if not e.name else f"{e.kind} {e.name}"
            if e.t1 > e.t0:
                events.append({"ph": "X", "name": name, "cat": e.kind, "pid": rank, "tid": WORKER_TID,
                               "ts": us(e.t0), "dur": (e.t1 - e.t0) / 1e3, "args": args})
            else:
                events.append({"ph": "i", "s": "t", "name": name, "cat": e.kind, "pid": rank, "tid": WORKER_TID,
                               "ts": us(e.t0), "args": args})
        for n, (key, e, done) in enumerate(loaded.requests(rank)):
            if done is None:
                continue
            ident = f"r{rank}.{n}"
            common = {"name": e.name or "allreduce", "cat": "allreduce", "pid": rank, "tid": REQUEST_TID, "id": ident}
            events.append({**common, "ph": "b", "ts": us(e.t0), "args": {"bytes": e.fields.get("bytes"),
                                                                          "step": e.step, "occurrence": key[1]}})
            events.append({**common, "ph": "e", "ts": us(done)})

    rec = loaded.records
    if len(rec):
        sockets = {}
        for (rank, lane), parts in loaded.trace.proxies.items():
            sockets[(rank, lane)] = 1
        owner = [int(s) if d == fmt.SEND else int(t) for s, t, d in
                 zip(rec["src"].tolist(), rec["dst"].tolist(), rec["direction"].tolist())]
        for i, o in enumerate(owner):
            key = (o, int(rec["lane"][i]))
            sockets[key] = max(sockets.get(key, 1), int(rec["socket"][i]) + 1)
        named = set()
        cols = {c: rec[c].tolist() for c in ("lane", "socket", "direction", "start_ns", "end_ns", "step", "segment",
                                              "bytes", "seq", "request", "dep_type", "dep_id", "op", "src", "dst",
                                              "ready_ns")}
        for i, o in enumerate(owner):
            lane, sock, d = cols["lane"][i], cols["socket"][i], cols["direction"][i]
            tid = lane_tid(lane, sock, d)
            if (o, tid) not in named:
                named.add((o, tid))
                events.append({"ph": "M", "name": "thread_name", "pid": o, "tid": tid,
                               "args": {"name": lane_track_name(lane, sock, d, sockets.get((o, lane), 1))}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": o, "tid": tid,
                               "args": {"sort_index": tid}})
            request = cols["request"][i]
            args = {"bytes": cols["bytes"][i], "seq": cols["seq"][i], "src": cols["src"][i], "dst": cols["dst"][i],
                    "request": None if request == fmt.NO_REQUEST else request, "dep_type": cols["dep_type"][i],
                    "dep_id": cols["dep_id"][i], "queued_us": (cols["start_ns"][i] - cols["ready_ns"][i]) / 1e3}
            name = "abort" if cols["op"][i] == fmt.OP_ABORT else f"s{cols['step'][i]}.{cols['segment'][i]}"
            events.append({"ph": "X", "name": name, "cat": "frame", "pid": o, "tid": tid, "ts": us(cols["start_ns"][i]),
                           "dur": max(cols["end_ns"][i] - cols["start_ns"][i], 0) / 1e3, "args": args})
    return events


def write_chrome(loaded: Loaded, path: str) -> int:
    """Writes the Chrome trace JSON to `path`; returns the number of events."""
    events = chrome_events(loaded)
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"source": "fasthorovod-trace", "trace_dir": loaded.path, "origin_ns": loaded.origin}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return len(events)
