"""A ring chain's wait between two of its frames, measured from frame traces (2026-12-03).

What the traces of FastHorovod allreduces on 4 and 5 emulated hosts show (lab/scale.md, "The
wait"): the proxy queues a chain's next frame 10–50 µs after the previous one arrived and writes
its first byte 10–30 µs later, so the wait is not the scheduler's. It is the time from the frame's
first byte written to its first byte read by the next rank: bytes queued ahead of it on its socket.
The lane gives a frame to the socket with the least *unsent* bytes (SIOCOUTQNSD); bytes that TCP
has sent but the network still holds (the emulated cloud's per-flow shaper) do not count, so a frame
often lands behind another chain's frame and waits for it, first in first out. With one chain per
lane (a chunk of one segment) there is no other chain to wait behind.

The model's wait of a chain, per ring step (``model.chain_wait``)::

    W = alpha + RTT/2 + min(q · frame, Q) / c      (the second term only when a lane runs more than one chain)

c one flow's rate, Q the most bytes the network holds for one flow ahead of a frame. This module
reads the traces (``rank<R>.lane<J>.bin``, docs/trace.md) and fits q, Q and the waits' coefficient
of variation, which ``calibrate`` then fixes (alpha and t0 are
fitted on the timing data, as before, and the fitted alpha is the part the traces do not see)."""
from __future__ import annotations

import collections
import math
import statistics
from typing import Dict, List, Optional


def frame_waits(trace_dir: str) -> List[Dict]:
    """One row per frame that both its sender and its receiver recorded: payload bytes, chains of its
    lane at that step (segments of the step's chunk), and the delay from the sender's first byte
    written to the receiver's first byte read (seconds)."""
    from fasthorovod.trace import format as fmt

    trace = fmt.load_trace_dir(trace_dir)
    sends, recvs = {}, {}
    segments = collections.defaultdict(int)
    for parts in trace.proxies.values():
        for pf in parts:
            off = pf.offset_ns
            for r in pf.records:
                key = (int(r["src"]), int(r["seq"]), int(r["lane"]), int(r["step"]), int(r["segment"]))
                if int(r["op"]) not in (fmt.OP_ALLREDUCE, 0):
                    continue
                if int(r["direction"]) == fmt.SEND:
                    sends[key] = (int(r["start_ns"]) + off, int(r["bytes"]))
                    step = key[:4]
                    segments[step] = max(segments[step], key[4] + 1)
                else:
                    recvs[key] = int(r["start_ns"]) + off
    rows = []
    for key, (start, nbytes) in sends.items():
        got = recvs.get(key)
        if got is None:
            continue
        rows.append({"bytes": nbytes, "chains_per_lane": segments[key[:4]], "delay_s": (got - start) * 1e-9})
    return rows


def fit_waits(rows: List[Dict], flow_Bps: float) -> Optional[Dict]:
    """Least squares of delay = a + min(q · frame, Q) / flow_Bps for frames of lanes with more than one
    chain (a alone otherwise): q the frames queued ahead on the socket, Q the most bytes the network
    holds for one flow ahead of a frame (q and Q on grids, a ≥ 0 by least squares at each). Returns
    a, q, Q (None: no cap found), the waits' coefficient of variation about the fit
    (sqrt(mean((delay / fitted − 1)²))), the mean delays with one and with several chains per lane, and
    the frame count."""
    import numpy as np

    if len(rows) < 10:
        return None
    several = np.array([r["chains_per_lane"] > 1 for r in rows])
    f = np.array([float(r["bytes"]) for r in rows])
    y = np.array([r["delay_s"] for r in rows])
    flow = np.array([float(r.get("flow_Bps") or flow_Bps) for r in rows])  # each cloud's flow rate
    best = None
    for Q in [None] + [float(2 ** (k / 2)) * 1024 for k in range(8, 23)]:  # 16 KiB .. 2 MiB, and no cap
        for q in np.arange(0.0, 2.001, 0.025):
            x = np.where(several, (q * f if Q is None else np.minimum(q * f, Q)) / flow, 0.0)
            a = max(0.0, float(np.mean(y - x)))
            err = float(np.sum((a + x - y) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, a, float(q), Q)
    _, a, q, Q = best
    x = np.where(several, (q * f if Q is None else np.minimum(q * f, Q)) / flow, 0.0)
    fitted = a + x
    ok = fitted > 0
    cv = float(np.sqrt(np.mean((y[ok] / fitted[ok] - 1.0) ** 2))) if ok.any() else 1.0
    means = {}
    cv_one = None
    if (~several).any():
        means["one chain"] = float(y[~several].mean())
        cv_one = float(y[~several].std() / y[~several].mean()) if y[~several].mean() > 0 else None
    if several.any():
        means["several chains"] = float(y[several].mean())
    return {"a_s": a, "q": q, "queue_bytes": Q, "cv": cv, "cv_one_chain": cv_one, "frames": int(len(rows)),
            "mean_delay_s": means,
            "flow_Bps": flow_Bps}
