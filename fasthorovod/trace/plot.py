"""One PNG of a trace: a timeline of a few iterations plus histograms (matplotlib, Agg backend).

Top: per rank, rows for computation (green), allreduces in flight from post to completion (blue),
waits (red) and updates (orange), then one row per proxy lane with its frames (sends dark in the
lower half of the row, receives light in the upper half). Bottom: frame payload sizes (log2 bins),
throughput per lane, and per iteration the mean P1 / P2 / P3 / update / other times.
"""
from __future__ import annotations

from typing import Optional, Tuple

from fasthorovod.trace import format as fmt
from fasthorovod.trace.analyze import Loaded, _windows, clip, merge, subtract


def _window(loaded: Loaded, result: dict, first_step: int, steps: int) -> Tuple[int, int]:
    rows = [it for it in result["iterations"] if first_step <= it["step"] < first_step + steps]
    if rows:
        a = min(it["start_s"] for it in rows)
        b = max(it["start_s"] + it["iteration_s"] for it in rows)
        return loaded.origin + int(a * 1e9), loaded.origin + int(b * 1e9)
    ends = [e.t1 for evs in loaded.events.values() for e in evs]
    if len(loaded.records):
        ends.append(int(loaded.records["end_ns"].max()))
    return loaded.origin, max(ends) if ends else loaded.origin + 1


def plot(loaded: Loaded, result: dict, path: str, first_step: Optional[int] = None, steps: int = 3) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if first_step is None:
        first_step = result["per_step"][min(result["summary"].get("skipped", 0), len(result["per_step"]) - 1)]["step"] \
            if result["per_step"] else 0
    t0, t1 = _window(loaded, result, first_step, steps)
    ranks, lanes = loaded.trace.ranks, loaded.trace.lanes
    rows_per_rank = 3 + len(lanes)
    fig = plt.figure(figsize=(14, 4 + 0.32 * rows_per_rank * len(ranks)))
    grid = fig.add_gridspec(2, 3, height_ratios=[max(2.0, 0.32 * rows_per_rank * len(ranks)), 3.0])
    ax = fig.add_subplot(grid[0, :])
    ms = lambda t: (t - t0) / 1e6  # noqa: E731
    labels, y = [], 0

    def bars(intervals, row, color, lo=0.1, height=0.8):
        spans = [(ms(a), ms(b) - ms(a)) for a, b in clip(merge(intervals), t0, t1)]
        if spans:
            ax.broken_barh(spans, (row + lo, height), facecolors=color, linewidth=0)

    rec = loaded.records
    for rank in ranks:
        evs = loaded.events.get(rank, [])
        compute = merge((e.t0, e.t1) for e in evs if e.kind in fmt.COMPUTE_KINDS)
        waits = merge((e.t0, e.t1) for e in evs if e.kind == fmt.WAIT)
        updates = merge((e.t0, e.t1) for e in evs if e.kind == fmt.UPDATE)
        if not compute and evs:
            compute = subtract(merge(_windows(evs).values()), merge(list(waits) + list(updates)))
        base = y
        bars(compute, base, "tab:green")
        bars([(e.t0, done) for _, e, done in loaded.requests(rank) if done is not None], base + 1, "tab:blue")
        bars(waits, base + 2, "tab:red")
        bars(updates, base + 2, "tab:orange")
        labels += [f"r{rank} compute", f"r{rank} allreduce", f"r{rank} wait/update"]
        for i, lane in enumerate(lanes):
            row = base + 3 + i
            if len(rec):
                s = rec[(rec["src"] == rank) & (rec["direction"] == fmt.SEND) & (rec["lane"] == lane)]
                r = rec[(rec["dst"] == rank) & (rec["direction"] == fmt.RECV) & (rec["lane"] == lane)]
                bars(zip(s["start_ns"].tolist(), s["end_ns"].tolist()), row, "tab:purple", 0.1, 0.4)
                bars(zip(r["start_ns"].tolist(), r["end_ns"].tolist()), row, "plum", 0.5, 0.4)
            labels.append(f"r{rank} lane {lane}")
        y = base + rows_per_rank
    ax.set_yticks([i + 0.5 for i in range(len(labels))])
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylim(len(labels), 0)
    ax.set_xlim(0, max(ms(t1), 1e-6))
    ax.set_xlabel(f"ms (rank 0 clock) from iteration {first_step}")
    ax.set_title(f"{loaded.path}: {len(ranks)} ranks, {len(lanes)} lanes — compute (green), allreduce in flight "
                 "(blue), wait (red), update (orange), frames sent (purple) / received (plum)", fontsize=9)
    ax.grid(axis="x", alpha=0.3)

    hx = fig.add_subplot(grid[1, 0])
    sizes = result.get("message_sizes") or result.get("request_sizes") or []
    if sizes:
        hx.bar(range(len(sizes)), [b["count"] for b in sizes], color="tab:purple")
        hx.set_xticks(range(len(sizes)))
        hx.set_xticklabels([_short(b["lo"]) for b in sizes], rotation=60, fontsize=7)
    hx.set_title("frame payload sizes (log2 bins)" if result.get("message_sizes") else "allreduce sizes", fontsize=9)
    hx.set_ylabel("count")

    lx = fig.add_subplot(grid[1, 1])
    lane_stats = result.get("lane_stats") or []
    if lane_stats:
        lx.bar([str(l["lane"]) for l in lane_stats], [(l["throughput_Bps"] or 0) / 1e6 for l in lane_stats],
               color="tab:blue")
    imb = result.get("lane_imbalance")
    lx.set_title(f"throughput per lane (MB/s), max/min {imb:.2f}" if imb else "throughput per lane (MB/s)", fontsize=9)
    lx.set_xlabel("lane")

    px = fig.add_subplot(grid[1, 2])
    per_step = (result.get("per_step") or [])[result["summary"].get("skipped", 0):]
    if per_step:
        xs = [str(r["step"]) for r in per_step]
        bottom = [0.0] * len(per_step)
        for key, color, label in (("p1_s", "tab:green", "P1 compute only"), ("p2_s", "tab:cyan", "P2 overlap"),
                                  ("p3_s", "tab:blue", "P3 comm only"), ("update_s", "tab:orange", "update"),
                                  ("other_s", "lightgray", "other")):
            vals = [max(r[key], 0.0) * 1e3 for r in per_step]
            px.bar(xs, vals, bottom=bottom, color=color, label=label)
            bottom = [a + b for a, b in zip(bottom, vals)]
        px.set_ylim(0, max(bottom) * 1.4 if max(bottom) > 0 else 1)
        px.legend(fontsize=7, ncol=3, loc="upper center")
        if len(xs) > 20:
            px.set_xticks(range(0, len(xs), max(1, len(xs) // 10)))
    px.set_title("per iteration after warm-up (ms, mean over ranks)", fontsize=9)
    px.set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(n: int) -> str:
    for unit in ("", "K", "M", "G"):
        if n < 1024:
            return f"{n}{unit}"
        n //= 1024
    return f"{n}T"
