"""Statistics of a trace directory: SketchDLC's phases and overheads, adapted to allreduce.

``analyze(path)`` returns one JSON-serialisable dict; ``format_table(result)`` renders it for a
terminal. Every quantity is defined in docs/trace.md; in short, for rank r and iteration (step) s
with window W = (end of iteration s−1, end of iteration s]:

* C, computation: the union of the rank's forward/backward/compute spans in W; a rank that records
  none has C = W minus its wait and update spans.
* M, communication: the union over the rank's allreduce requests of [posted, completed] in W, where
  completed is the last frame of that request in this rank's proxy traces (else the worker's
  "complete" event, else the end of the matching "wait" span).
* P1 = |C \\ M| (compute only), P2 = |C ∩ M| (overlap), P3 = |M \\ C| (communication only);
  overlap ratio = P2 / (P1 + P2 + P3), which is SketchDLC's P2 / (P1 + P3) because SketchDLC's
  phase 3 includes the overlap; hidden = P2 / (P2 + P3), the share of communication hidden.
* update = |update spans ∩ W|, wait = |wait spans ∩ W|.
* sync (per step): mean over the step's collectives of (last rank's post − first rank's post).
* per lane / per connection: payload bytes over busy time; imbalance = max / min.

All times are aligned to rank 0's clock with each file's ``clock_offset_ns``. Integer nanoseconds
throughout, so a synthetic trace gives exact results.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from fasthorovod.trace import format as fmt

Interval = Tuple[int, int]


# -- interval sets (sorted, disjoint, half-open [a, b)) -----------------------------------------------

def merge(intervals: Iterable[Interval]) -> List[Interval]:
    out: List[List[int]] = []
    for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def measure(s: Sequence[Interval]) -> int:
    return sum(b - a for a, b in s)


def intersect(x: Sequence[Interval], y: Sequence[Interval]) -> List[Interval]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x: Sequence[Interval], y: Sequence[Interval]) -> List[Interval]:
    out = []
    j = 0
    for a, b in x:
        cur = a
        while j < len(y) and y[j][1] <= cur:
            j += 1
        k = j
        while k < len(y) and y[k][0] < b:
            if y[k][0] > cur:
                out.append((cur, y[k][0]))
            cur = max(cur, y[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def clip(s: Sequence[Interval], a: int, b: int) -> List[Interval]:
    return intersect(s, [(a, b)])


# -- loading ------------------------------------------------------------------------------------------

class _Event:
    __slots__ = ("kind", "name", "t0", "t1", "step", "fields")

    def __init__(self, kind, name, t0, t1, step, fields):
        self.kind, self.name, self.t0, self.t1, self.step, self.fields = kind, name, t0, t1, step, fields


def _worker_events(trace: fmt.TraceDir) -> Dict[int, List[_Event]]:
    out: Dict[int, List[_Event]] = {}
    for rank, parts in trace.workers.items():
        events = []
        for part in parts:
            off = part.offset_ns
            for e in part.events:
                t0 = int(e["t"]) + off
                t1 = t0 + int(e.get("d", 0))
                fields = {k: v for k, v in e.items() if k not in ("k", "n", "t", "d", "step")}
                events.append(_Event(e.get("k", ""), e.get("n", ""), t0, t1, e.get("step"), fields))
        events.sort(key=lambda e: (e.t0, e.t1))
        out[rank] = events
    return out


def _proxy_records(trace: fmt.TraceDir, warnings: List[str]):
    """All records, times aligned, plus per-record ring forward latency (NaN where not a dependent send)."""
    import numpy as np

    arrays, latencies = [], []
    for (rank, lane), parts in sorted(trace.proxies.items()):
        for part in parts:
            rec = part.records.copy()
            if part.truncated_bytes:
                warnings.append(f"{part.path}: {part.truncated_bytes} bytes of a partial record ignored")
            if part.meta.get("dropped"):
                warnings.append(f"{part.path}: {part.meta['dropped']} records dropped (buffer full)")
            if "closed_ns" not in part.meta:
                warnings.append(f"{part.path}: not closed cleanly (proxy killed?); records up to the last flush")
            if len(rec) and not np.array_equal(rec["id"], np.arange(len(rec), dtype=rec["id"].dtype)):
                warnings.append(f"{part.path}: record ids are not 0..n-1; dependency ids ignored")
                dep_ok = False
            else:
                dep_ok = True
            lat = np.full(len(rec), np.nan)
            if dep_ok and len(rec):
                dep = (rec["dep_type"] == fmt.DEP_ON_RECEIVE) & (rec["dep_id"] >= 0) & (rec["dep_id"] < len(rec))
                idx = rec["dep_id"][dep]
                lat[dep] = (rec["ready_ns"][dep] - rec["end_ns"][idx]).astype(float)
            off = part.offset_ns
            for col in ("ready_ns", "start_ns", "end_ns"):
                rec[col] += off
            arrays.append(rec)
            latencies.append(lat)
    if not arrays:
        return np.zeros(0, dtype=fmt.record_dtype()), np.zeros(0)
    return np.concatenate(arrays), np.concatenate(latencies)


# -- statistics -------------------------------------------------------------------------------------

def _stats(values: Sequence[float]) -> dict:
    vals = sorted(v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)))
    if not vals:
        return {"count": 0}

    def pct(p):
        return vals[min(len(vals) - 1, int(round(p * (len(vals) - 1))))]

    return {"count": len(vals), "mean": sum(vals) / len(vals), "min": vals[0], "p50": pct(0.5), "p99": pct(0.99),
            "max": vals[-1]}


def _histogram(sizes: Iterable[int]) -> List[dict]:
    """log2 bins: [0, 1) for empty messages, then [2^k, 2^(k+1))."""
    counts: Dict[int, int] = defaultdict(int)
    for n in sizes:
        counts[-1 if n <= 0 else int(n).bit_length() - 1] += 1
    return [{"lo": 0 if k < 0 else 1 << k, "hi": 1 if k < 0 else 1 << (k + 1), "count": c}
            for k, c in sorted(counts.items())]


def _ratio(values: Sequence[float]) -> Optional[float]:
    vals = [v for v in values if v and v > 0]
    return max(vals) / min(vals) if vals else None


def _collective_spans(rec, rank: int):
    """{key: (first ready, last end, payload bytes sent)} per collective of `rank` (key: request, else seq)."""
    import numpy as np

    # Records of rank r are those its own proxies wrote: src == r for sends, dst == r for receives.
    own_sends = (rec["src"] == rank) & (rec["direction"] == fmt.SEND)
    mine = rec[own_sends | (rec["dst"] == rank) & (rec["direction"] == fmt.RECV)]
    out = {}
    if not len(mine):
        return out
    keys = np.where(mine["request"] != np.uint64(fmt.NO_REQUEST), mine["request"].astype(np.int64),
                    -1 - mine["seq"].astype(np.int64))
    order = np.argsort(keys, kind="stable")
    keys, mine = keys[order], mine[order]
    uniq, first = np.unique(keys, return_index=True)
    begins = np.minimum.reduceat(np.minimum(mine["ready_ns"], mine["start_ns"]), first)
    ends = np.maximum.reduceat(mine["end_ns"], first)
    sent = np.add.reduceat(np.where(mine["direction"] == fmt.SEND, mine["bytes"], 0).astype(np.int64), first)
    for k, b, e, s in zip(uniq.tolist(), begins.tolist(), ends.tolist(), sent.tolist()):
        out[k] = (b, e, s)
    return out


def _occurrences(events: List[_Event], kind: str) -> Dict[Tuple[str, int], _Event]:
    seen: Dict[str, int] = defaultdict(int)
    out = {}
    for e in events:
        if e.kind == kind:
            out[(e.name, seen[e.name])] = e
            seen[e.name] += 1
    return out


def _windows(events: List[_Event]) -> Dict[int, Interval]:
    """Iteration windows of one rank: step s ends at the last end of its events, starts where s−1 ended."""
    ends: Dict[int, int] = {}
    starts: Dict[int, int] = {}
    for e in events:
        if e.step is None:
            continue
        s = int(e.step)
        ends[s] = max(ends.get(s, e.t1), e.t1)
        starts[s] = min(starts.get(s, e.t0), e.t0)
    windows, prev_end = {}, None
    for s in sorted(ends):
        start = prev_end if prev_end is not None and prev_end <= ends[s] else starts[s]
        windows[s] = (start, ends[s])
        prev_end = ends[s]
    return windows


class Loaded:
    """A trace directory read into memory with every time aligned to rank 0's clock."""

    def __init__(self, path: str) -> None:
        import numpy as np

        self.path = path
        self.trace = fmt.load_trace_dir(path)
        self.warnings: List[str] = []
        for parts in self.trace.workers.values():
            for part in parts:
                if not part.complete:
                    self.warnings.append(f"{part.path}: not stopped cleanly; events up to the last flush")
        self.events = _worker_events(self.trace)
        self.records, self.forward_latency = _proxy_records(self.trace, self.warnings)
        times = [e.t0 for evs in self.events.values() for e in evs]
        if len(self.records):
            times.append(int(np.minimum(self.records["ready_ns"], self.records["start_ns"]).min()))
        self.origin = min(times) if times else 0
        sizes = {p.meta.get("size") for parts in self.trace.workers.values() for p in parts}
        sizes |= {p.meta.get("size") for parts in self.trace.proxies.values() for p in parts}
        sizes.discard(None)
        self.size = max(sizes) if sizes else len(self.trace.ranks)
        self._collectives: Dict[int, dict] = {}

    def collectives(self, rank: int) -> dict:
        if rank not in self._collectives:
            self._collectives[rank] = _collective_spans(self.records, rank) if len(self.records) else {}
        return self._collectives[rank]

    def requests(self, rank: int) -> List[Tuple[Tuple[str, int], _Event, Optional[int]]]:
        """(key, request event, completion time or None) for every request of `rank`, in post order.

        key = (name, occurrence of that name on this rank): the same allreduce on every rank.
        Completion: the last frame of the request in this rank's proxy records, else the matching
        "complete" event, else the end of the matching "wait" span.
        """
        evs = self.events.get(rank, [])
        collectives = self.collectives(rank)
        completes, waits = _occurrences(evs, fmt.COMPLETE), _occurrences(evs, fmt.WAIT)
        out = []
        for key, e in _occurrences(evs, fmt.REQUEST).items():
            done = None
            matched = [collectives[i] for i in (e.fields.get("requests") or []) if i in collectives]
            if matched:
                done = max(m[1] for m in matched)
            elif key in completes:
                done = completes[key].t0
            elif key in waits:
                done = waits[key].t1
            out.append((key, e, None if done is None else max(done, e.t0)))
        return out


def analyze(path, skip: int = 0) -> dict:
    """Reads the trace directory `path` (or a Loaded) and computes every statistic (module doc).

    `skip`: leading iterations (warm-up) left out of the summary; they stay in `iterations`.
    """
    import numpy as np

    loaded = path if isinstance(path, Loaded) else Loaded(path)
    trace, events, rec, origin = loaded.trace, loaded.events, loaded.records, loaded.origin
    warnings = list(loaded.warnings)
    clocks = {}
    for rank, parts in trace.workers.items():
        m = parts[0].meta
        clocks[rank] = {"offset_ns": m.get("clock_offset_ns", 0), "error_ns": m.get("clock_error_ns", 0),
                        "method": m.get("clock_method", "none"), "host": m.get("host")}

    # -- per rank and iteration ---------------------------------------------------------------------
    iterations = []
    posts: Dict[Tuple[str, int], Dict[int, Tuple[int, int]]] = defaultdict(dict)  # key -> rank -> (post, step)
    for rank in trace.ranks:
        evs = events.get(rank, [])
        if not evs:
            continue
        spans = lambda kinds: merge((e.t0, e.t1) for e in evs if e.kind in kinds)  # noqa: E731
        compute_spans = spans(fmt.COMPUTE_KINDS)
        wait_spans, update_spans = spans((fmt.WAIT,)), spans((fmt.UPDATE,))
        has_compute = bool(compute_spans)
        requests = loaded.requests(rank)
        in_flight: List[Interval] = []
        done_by_step: Dict[int, List[int]] = defaultdict(list)
        bytes_by_step: Dict[int, int] = defaultdict(int)
        unmatched = 0
        for key, e, done in requests:
            if e.step is None:
                continue
            step = int(e.step)
            posts[key][rank] = (e.t0, step)
            bytes_by_step[step] += int(e.fields.get("bytes", 0) or 0)
            if done is None:
                unmatched += 1
                continue
            in_flight.append((e.t0, done))
            done_by_step[step].append(done)
        if unmatched:
            warnings.append(f"rank {rank}: {unmatched} requests without a completion (no proxy records, "
                            f"'complete' or 'wait' event with the same name)")
        # Communication in flight, whichever iteration posted it (delayed SGD overlaps iterations).
        comm = merge(in_flight) if requests else merge((b, e) for b, e, _ in loaded.collectives(rank).values())
        for step, (ws, we) in sorted(_windows(evs).items()):
            if has_compute:
                c = clip(compute_spans, ws, we)
            else:
                c = subtract([(ws, we)], merge(list(clip(wait_spans, ws, we)) + list(clip(update_spans, ws, we))))
            m = clip(comm, ws, we)
            u = clip(update_spans, ws, we)
            w = clip(wait_spans, ws, we)
            p2 = measure(intersect(c, m))
            p1 = measure(c) - p2
            p3 = measure(m) - p2
            busy = measure(merge(list(c) + list(m) + list(u)))
            dones = done_by_step.get(step, [])
            iterations.append({
                "rank": rank, "step": step, "start_s": (ws - origin) / 1e9, "iteration_s": (we - ws) / 1e9,
                "compute_s": measure(c) / 1e9, "comm_s": measure(m) / 1e9,
                "p1_s": p1 / 1e9, "p2_s": p2 / 1e9, "p3_s": p3 / 1e9,
                "overlap_ratio": p2 / (p1 + p2 + p3) if p1 + p2 + p3 else None,
                "hidden_comm_ratio": p2 / (p2 + p3) if p2 + p3 else None,
                "update_s": measure(u) / 1e9, "wait_s": measure(w) / 1e9, "other_s": (we - ws - busy) / 1e9,
                "completion_spread_s": (max(dones) - min(dones)) / 1e9 if dones else None,
                "bytes": bytes_by_step.get(step, 0), "compute_from": "spans" if has_compute else "window",
            })

    # -- synchronization: arrival spread of each collective over ranks --------------------------------
    sync_by_step: Dict[int, List[int]] = defaultdict(list)
    last_by_step: Dict[int, Tuple[int, int]] = {}
    stragglers: Dict[int, int] = defaultdict(int)
    collectives_synced = 0
    for key, by_rank in posts.items():
        if len(by_rank) < 2:
            continue
        times = {r: t for r, (t, _) in by_rank.items()}
        step = min(s for _, s in by_rank.values())
        skew = max(times.values()) - min(times.values())
        sync_by_step[step].append(skew)
        last = max(times.values())
        if step not in last_by_step or last > last_by_step[step][0]:
            last_by_step[step] = (last, skew)
        stragglers[max(times, key=times.get)] += 1
        collectives_synced += 1
    sync_source = "requests"
    if not posts and len(rec):  # proxy traces only: arrival = when each rank's lane started the collective
        sync_source = "proxy"
        starts: Dict[Tuple[int, int], Dict[int, int]] = defaultdict(dict)
        for r in trace.ranks:
            mine = rec[(rec["src"] == r) & (rec["direction"] == fmt.SEND)]
            for lane in np.unique(mine["lane"]).tolist():
                lm = mine[mine["lane"] == lane]
                for seq in np.unique(lm["seq"]).tolist():
                    starts[(lane, seq)][r] = int(lm["ready_ns"][lm["seq"] == seq].min())
        for key, times in starts.items():
            if len(times) >= 2:
                sync_by_step[0].append(max(times.values()) - min(times.values()))
                stragglers[max(times, key=times.get)] += 1
                collectives_synced += 1

    # -- per step over ranks, and the summary --------------------------------------------------------
    metric_keys = ["iteration_s", "compute_s", "comm_s", "p1_s", "p2_s", "p3_s", "update_s", "wait_s", "other_s"]
    per_step = []
    for step in sorted({it["step"] for it in iterations}):
        rows = [it for it in iterations if it["step"] == step]
        agg = {"step": step, "ranks": len(rows)}
        for k in metric_keys:
            agg[k] = sum(r[k] for r in rows) / len(rows)
        agg["iteration_max_s"] = max(r["iteration_s"] for r in rows)
        p1, p2, p3 = agg["p1_s"], agg["p2_s"], agg["p3_s"]
        agg["overlap_ratio"] = p2 / (p1 + p2 + p3) if p1 + p2 + p3 else None
        agg["hidden_comm_ratio"] = p2 / (p2 + p3) if p2 + p3 else None
        skews = sync_by_step.get(step, [])
        agg["sync_s"] = sum(skews) / len(skews) / 1e9 if skews else None
        agg["sync_last_s"] = last_by_step[step][1] / 1e9 if step in last_by_step else None
        agg["bytes"] = sum(r["bytes"] for r in rows)
        per_step.append(agg)
    kept = per_step[skip:]
    summary: dict = {"steps": len(kept), "skipped": min(skip, len(per_step))}
    if kept:
        for k in metric_keys + ["iteration_max_s"]:
            summary[k] = sum(r[k] for r in kept) / len(kept)
        p1, p2, p3 = summary["p1_s"], summary["p2_s"], summary["p3_s"]
        summary["overlap_ratio"] = p2 / (p1 + p2 + p3) if p1 + p2 + p3 else None
        summary["hidden_comm_ratio"] = p2 / (p2 + p3) if p2 + p3 else None
        syncs = [r["sync_s"] for r in kept if r["sync_s"] is not None]
        summary["sync_s"] = sum(syncs) / len(syncs) if syncs else None
        summary["bytes_per_step"] = sum(r["bytes"] for r in kept) / len(kept)
    elif sync_by_step:
        skews = [s for v in sync_by_step.values() for s in v]
        summary["sync_s"] = sum(skews) / len(skews) / 1e9

    result = {
        "trace_dir": loaded.path, "size": loaded.size, "ranks": trace.ranks, "lanes": trace.lanes, "origin_ns": origin,
        "clocks": clocks, "iterations": iterations, "per_step": per_step, "summary": summary,
        "sync": {"source": sync_source, "collectives": collectives_synced,
                 "straggler_counts": {str(r): c for r, c in sorted(stragglers.items())}},
        "request_sizes": _histogram(int(e.fields.get("bytes", 0) or 0) for evs in events.values() for e in evs
                                    if e.kind == fmt.REQUEST),
    }
    result.update(_proxy_statistics(rec, loaded.forward_latency, trace))
    result["warnings"] = warnings
    return result


def _proxy_statistics(rec, fwd_latency, trace: fmt.TraceDir) -> dict:
    import numpy as np

    out: dict = {"frames": int(len(rec))}
    if not len(rec):
        out.update({"message_sizes": [], "rank_lanes": [], "lane_stats": [], "lane_imbalance": None,
                    "connections": [], "connection_imbalance": None, "collective_lane_skew": None,
                    "lane_finish_spread_s": {"count": 0}, "lane_finish_spread_share": {"count": 0},
                    "ring_forward_latency_s": {"count": 0}})
        return out
    data = rec[rec["op"] != fmt.OP_ABORT]
    sends = data[data["direction"] == fmt.SEND]
    recvs = data[data["direction"] == fmt.RECV]
    out["message_sizes"] = _histogram(sends["bytes"].tolist())
    out["message_bytes"] = {"min": int(sends["bytes"].min()) if len(sends) else 0,
                            "max": int(sends["bytes"].max()) if len(sends) else 0}

    # Per (rank, lane): bytes and busy time (union of the lane's collectives on that rank).
    rank_lanes = []
    lane_bytes: Dict[int, int] = defaultdict(int)
    lane_busy: Dict[int, int] = defaultdict(int)
    lane_frames: Dict[int, int] = defaultdict(int)
    for (rank, lane) in sorted(trace.proxies):
        s = sends[(sends["src"] == rank) & (sends["lane"] == lane)]
        r = recvs[(recvs["dst"] == rank) & (recvs["lane"] == lane)]
        both = np.concatenate([s, r])
        busy = 0
        if len(both):
            order = np.argsort(both["seq"], kind="stable")
            b = both[order]
            uniq, first = np.unique(b["seq"], return_index=True)
            begins = np.minimum.reduceat(np.minimum(b["ready_ns"], b["start_ns"]), first)
            ends = np.maximum.reduceat(b["end_ns"], first)
            busy = measure(merge(zip(begins.tolist(), ends.tolist())))
        sent = int(s["bytes"].sum())
        rank_lanes.append({"rank": rank, "lane": lane, "bytes_sent": sent, "bytes_received": int(r["bytes"].sum()),
                           "frames_sent": int(len(s)), "frames_received": int(len(r)),
                           "wire_bytes_sent": sent + fmt.FRAME_HEADER_BYTES * int(len(s)),
                           "collectives": int(len(np.unique(both["seq"]))) if len(both) else 0,
                           "busy_s": busy / 1e9, "throughput_Bps": sent / (busy / 1e9) if busy else None})
        lane_bytes[lane] += sent
        lane_busy[lane] += busy
        lane_frames[lane] += int(len(s))
    out["rank_lanes"] = rank_lanes
    lanes = [{"lane": j, "bytes_sent": lane_bytes[j], "frames_sent": lane_frames[j], "busy_s": lane_busy[j] / 1e9,
              "throughput_Bps": lane_bytes[j] / (lane_busy[j] / 1e9) if lane_busy[j] else None}
             for j in sorted(lane_bytes)]
    out["lane_stats"] = lanes
    out["lane_imbalance"] = _ratio([l["throughput_Bps"] for l in lanes])

    # A striped collective ends with its slowest lane: per (rank, collective), max/min lane duration.
    skews, slowest = [], defaultdict(int)
    key = np.where(data["request"] != np.uint64(fmt.NO_REQUEST), data["request"].astype(np.int64),
                   -1 - data["seq"].astype(np.int64))
    owner = np.where(data["direction"] == fmt.SEND, data["src"], data["dst"]).astype(np.int64)
    groups: Dict[Tuple[int, int], Dict[int, List[int]]] = defaultdict(dict)
    if len(data):
        order = np.lexsort((data["lane"], key, owner))
        d, k, o = data[order], key[order], owner[order]
        ident = np.stack([o, k, d["lane"].astype(np.int64)], axis=1)
        change = np.ones(len(d), dtype=bool)
        change[1:] = np.any(ident[1:] != ident[:-1], axis=1)
        first = np.flatnonzero(change)
        begins = np.minimum.reduceat(np.minimum(d["ready_ns"], d["start_ns"]), first)
        ends = np.maximum.reduceat(d["end_ns"], first)
        for (ow, kk, ln), b, e in zip(ident[first].tolist(), begins.tolist(), ends.tolist()):
            groups[(ow, kk)][ln] = (b, e)
    # ... and its lanes finish apart: from the first lane's last frame to the last lane's, the link
    # carries fewer lanes (their flows behind their per-flow caps) than the collective started with.
    spreads, spread_shares = [], []
    for lanes_span in groups.values():
        if len(lanes_span) >= 2:
            durations = {ln: e - b for ln, (b, e) in lanes_span.items()}
            if min(durations.values()) > 0:
                skews.append(max(durations.values()) / min(durations.values()))
            slowest[max(durations, key=durations.get)] += 1
            ends_ = [e for _, e in lanes_span.values()]
            whole = max(ends_) - min(b for b, _ in lanes_span.values())
            spreads.append((max(ends_) - min(ends_)) / 1e9)
            if whole > 0:
                spread_shares.append((max(ends_) - min(ends_)) / whole)
    out["collective_lane_skew"] = _stats(skews)
    out["slowest_lane_counts"] = {str(j): c for j, c in sorted(slowest.items())}
    out["lane_finish_spread_s"] = _stats(spreads)
    out["lane_finish_spread_share"] = _stats(spread_shares)

    # Per connection (src -> dst, lane, socket): a frame is in flight from its send's first byte to
    # its receive's last byte (only one side when only one side was traced).
    conn_intervals: Dict[Tuple[int, int, int, int], List[Interval]] = defaultdict(list)
    conn_bytes: Dict[Tuple[int, int, int, int], int] = defaultdict(int)
    both = np.concatenate([sends, recvs])
    order = np.lexsort((both["direction"], both["segment"], both["step"], both["seq"], both["lane"], both["dst"],
                        both["src"]))
    b = both[order]
    ident = np.stack([b["src"].astype(np.int64), b["dst"].astype(np.int64), b["lane"].astype(np.int64),
                      b["seq"].astype(np.int64), b["step"].astype(np.int64), b["segment"].astype(np.int64)], axis=1)
    same_next = np.zeros(len(b), dtype=bool)
    if len(b) > 1:
        same_next[:-1] = np.all(ident[1:] == ident[:-1], axis=1) & (b["direction"][:-1] == fmt.SEND) \
            & (b["direction"][1:] == fmt.RECV)
    i = 0
    n = len(b)
    src_l, dst_l, lane_l = b["src"].tolist(), b["dst"].tolist(), b["lane"].tolist()
    sock_l, dir_l, byt_l = b["socket"].tolist(), b["direction"].tolist(), b["bytes"].tolist()
    st_l, en_l = b["start_ns"].tolist(), b["end_ns"].tolist()
    same_l = same_next.tolist()
    while i < n:
        k = (src_l[i], dst_l[i], lane_l[i], sock_l[i])
        if same_l[i]:
            conn_intervals[k].append((st_l[i], en_l[i + 1]))
            conn_bytes[k] += byt_l[i]
            i += 2
            continue
        conn_intervals[k].append((st_l[i], en_l[i]))
        conn_bytes[k] += byt_l[i]
        i += 1
    conns = []
    for k in sorted(conn_intervals):
        active = measure(merge(conn_intervals[k]))
        conns.append({"src": k[0], "dst": k[1], "lane": k[2], "socket": k[3], "bytes": conn_bytes[k],
                      "active_s": active / 1e9, "throughput_Bps": conn_bytes[k] / (active / 1e9) if active else None})
    out["connections"] = conns
    out["connection_imbalance"] = _ratio([c["throughput_Bps"] for c in conns])
    lat = fwd_latency[~np.isnan(fwd_latency)] / 1e9
    out["ring_forward_latency_s"] = _stats(lat.tolist())
    return out


# -- rendering ------------------------------------------------------------------------------------------

def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.3f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _rate(v) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"


def format_table(result: dict, per_rank: bool = False) -> str:
    lines = [f"FastHorovod trace {result['trace_dir']}: {len(result['ranks'])} ranks (size {result['size']}), "
             f"{len(result['lanes'])} proxy lanes, {len(result['per_step'])} iterations, {result['frames']} frames"]
    for r, c in sorted(result["clocks"].items()):
        lines.append(f"  clock rank {r}: offset {c['offset_ns'] / 1e3:+.1f} us ± {c['error_ns'] / 1e3:.1f} us "
                     f"({c['method']}, {c['host']})")
    head = (f"{'step':>6} {'iter_ms':>9} {'comp_ms':>9} {'comm_ms':>9} {'P1_ms':>9} {'P2_ms':>9} {'P3_ms':>9} "
            f"{'overlap':>8} {'hidden':>7} {'update_ms':>9} {'wait_ms':>9} {'sync_ms':>9} {'MiB':>9}")
    if result["per_step"]:
        lines += ["", "Per iteration (mean over ranks; sync over ranks):", head]
        for r in result["per_step"]:
            lines.append(f"{r['step']:>6} {_ms(r['iteration_s']):>9} {_ms(r['compute_s']):>9} {_ms(r['comm_s']):>9} "
                         f"{_ms(r['p1_s']):>9} {_ms(r['p2_s']):>9} {_ms(r['p3_s']):>9} {_pct(r['overlap_ratio']):>8} "
                         f"{_pct(r['hidden_comm_ratio']):>7} {_ms(r['update_s']):>9} {_ms(r['wait_s']):>9} "
                         f"{_ms(r['sync_s']):>9} {r['bytes'] / 2**20:>9.2f}")
        s = result["summary"]
        if s.get("steps"):
            lines.append(f"{'mean':>6} {_ms(s['iteration_s']):>9} {_ms(s['compute_s']):>9} {_ms(s['comm_s']):>9} "
                         f"{_ms(s['p1_s']):>9} {_ms(s['p2_s']):>9} {_ms(s['p3_s']):>9} {_pct(s['overlap_ratio']):>8} "
                         f"{_pct(s['hidden_comm_ratio']):>7} {_ms(s['update_s']):>9} {_ms(s['wait_s']):>9} "
                         f"{_ms(s.get('sync_s')):>9} {s['bytes_per_step'] / 2**20:>9.2f}")
            lines.append(f"  (summary over {s['steps']} iterations, {s['skipped']} skipped as warm-up)")
    if per_rank and result["iterations"]:
        lines += ["", "Per rank and iteration:", "  rank " + head]
        for r in result["iterations"]:
            lines.append(f"  {r['rank']:>4} {r['step']:>6} {_ms(r['iteration_s']):>9} {_ms(r['compute_s']):>9} "
                         f"{_ms(r['comm_s']):>9} {_ms(r['p1_s']):>9} {_ms(r['p2_s']):>9} {_ms(r['p3_s']):>9} "
                         f"{_pct(r['overlap_ratio']):>8} {_pct(r['hidden_comm_ratio']):>7} {_ms(r['update_s']):>9} "
                         f"{_ms(r['wait_s']):>9} {'':>9} {r['bytes'] / 2**20:>9.2f}")
    sync = result["sync"]
    if sync["collectives"]:
        lines += ["", f"Synchronization: {sync['collectives']} collectives seen on >= 2 ranks ({sync['source']}); "
                      f"last to arrive: " + ", ".join(f"rank {r} x{c}" for r, c in sync["straggler_counts"].items())]
    if result["request_sizes"]:
        lines += ["", "Allreduce request sizes:"]
        lines += [f"  [{_size(b['lo']):>10}, {_size(b['hi']):>10})  {b['count']}" for b in result["request_sizes"]]
    if result["frames"]:
        mb = result["message_bytes"]
        lines += ["", f"Frame payload sizes (sends; {_size(mb['min'])} .. {_size(mb['max'])}):"]
        lines += [f"  [{_size(b['lo']):>10}, {_size(b['hi']):>10})  {b['count']}" for b in result["message_sizes"]]
        lines += ["", f"{'lane':>6} {'MiB sent':>10} {'frames':>8} {'busy_s':>9} {'MB/s':>9}"]
        for l in result["lane_stats"]:
            lines.append(f"{l['lane']:>6} {l['bytes_sent'] / 2**20:>10.2f} {l['frames_sent']:>8} {l['busy_s']:>9.4f} "
                         f"{_rate(l['throughput_Bps']):>9}")
        imb = result["lane_imbalance"]
        lines.append(f"  lane imbalance (max/min throughput): {'-' if imb is None else f'{imb:.2f}'}")
        skew = result["collective_lane_skew"]
        if skew.get("count"):
            slowest = ", ".join(f"lane {j} x{c}" for j, c in result["slowest_lane_counts"].items())
            lines.append(f"  per collective, slowest/fastest lane time: median {skew['p50']:.2f}, "
                         f"max {skew['max']:.2f}; slowest lane: {slowest}")
            spread, share = result["lane_finish_spread_s"], result["lane_finish_spread_share"]
            if spread.get("count") and share.get("count"):
                lines.append(f"  per collective, first to last lane finished: median {spread['p50'] * 1e3:.1f} ms "
                             f"({share['p50']:.1%} of the collective), max {spread['max'] * 1e3:.1f} ms "
                             f"({share['max']:.1%})")
        lines += ["", f"{'src->dst':>9} {'lane':>5} {'sock':>5} {'MiB':>10} {'active_s':>9} {'MB/s':>9}"]
        for c in result["connections"]:
            lines.append(f"{str(c['src']) + '->' + str(c['dst']):>9} {c['lane']:>5} {c['socket']:>5} "
                         f"{c['bytes'] / 2**20:>10.2f} {c['active_s']:>9.4f} {_rate(c['throughput_Bps']):>9}")
        imb = result["connection_imbalance"]
        lines.append(f"  connection imbalance (max/min throughput): {'-' if imb is None else f'{imb:.2f}'}")
        fl = result["ring_forward_latency_s"]
        if fl.get("count"):
            lines.append(f"  ring forward latency (receive end -> dependent send ready): "
                         f"mean {fl['mean'] * 1e6:.1f} us, "
                         f"p50 {fl['p50'] * 1e6:.1f} us, p99 {fl['p99'] * 1e6:.1f} us ({fl['count']} sends)")
    for w in result["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
