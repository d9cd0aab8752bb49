"""The DLC trace: the C++ recorder's files, worker capture, exact statistics of a synthetic trace, the CLI.

The synthetic trace is written with the real writers (the C++ TraceRecorder through its binding,
the worker Tracer), so the file formats are exercised end to end. Two ranks, two lanes, two
iterations; rank 1's clock runs 5 ms behind rank 0's (offset +5 ms in its files), so every
expected value below also checks the clock alignment. Times in ms on rank 0's clock:

  rank 0, each iteration (shifted by 100 ms per step):
    forward [0, 30), backward [30, 70); request A at 50, request B at 70; A's frames end at 80,
    B's at 90; wait A [70, 80), wait B [80, 90); update [90, 100)
    -> C = [0, 70), M = [50, 90): P1 = 50, P2 = 20, P3 = 20, wait 20, update 10, iteration 100
  rank 1: backward until 75, requests at 55 and 75, same completions, wait [75, 90)
    -> C = [0, 75), M = [55, 90): P1 = 55, P2 = 20, P3 = 15, wait 15
  sync: every allreduce is posted 5 ms later on rank 1 -> 5 ms; rank 1 is the straggler.
  frames: per collective, rank and lane, step 0 (send [T−2D, T−D), receive [T−2D, T−D−L)) and
    step 1 (send ready/start at T−D, end T; receive [T−D, T)), T = completion, L = 0.25 ms ring
    forward latency, D = 1 ms on lane 0 and 2 ms on lane 1, 1000 payload bytes per frame.
"""
import json
import os
import subprocess
import sys

import pytest

import fasthorovod_testing
from fasthorovod import _C
from fasthorovod.trace import analyze as an
from fasthorovod.trace import capture
from fasthorovod.trace import format as fmt

MS = 1_000_000
OFFSET = {0: 0, 1: 5 * MS}  # aligned = local + offset
POSTS = {0: {"A": 50, "B": 70}, 1: {"A": 55, "B": 75}}
DONE = {"A": 80, "B": 90}
LANE_D = {0: 1 * MS, 1: 2 * MS}
LAT = MS // 4
FRAME = 1000


def write_synthetic(d, steps=2, lane_early=(0, 0)):
    """`lane_early[j]`: lane j's frames all end that many ns before the collective's end T."""
    for rank in (0, 1):
        off = OFFSET[rank]
        tr = capture.Tracer(str(d), rank, 2, clock_offset_ns=off, clock_method="given")
        loc = lambda ms: ms * MS - off  # noqa: E731  (aligned ms -> this rank's local ns)
        for s in range(steps):
            b = 100 * s
            backward_end = POSTS[rank]["B"]
            tr.complete("forward", "", loc(b), loc(b + 30), step=s)
            tr.complete("backward", "", loc(b + 30), loc(b + backward_end), step=s)
            for q, name in enumerate(("A", "B")):
                tr.event("grad_ready", name, t_ns=loc(b + POSTS[rank][name]), step=s, bucket=q)
                tr.event("request", name, t_ns=loc(b + POSTS[rank][name]), step=s, bytes=4 * FRAME,
                         requests=[2 * s + q], proxied=True)
            tr.complete("wait", "A", loc(b + backward_end), loc(b + 80), step=s)
            tr.complete("wait", "B", loc(b + 80), loc(b + 90), step=s)
            tr.complete("update", "", loc(b + 90), loc(b + 100), step=s)
        tr.close()
        for lane in (0, 1):
            rec = _C.TraceRecorder()
            rec.open(str(d), rank, lane, clock_offset_ns=off, size=2)
            D = LANE_D[lane]
            peer = 1 - rank
            for s in range(steps):
                for q, name in enumerate(("A", "B")):
                    T = (100 * s + DONE[name]) * MS - off - lane_early[lane]
                    common = dict(seq=2 * s + q, request=2 * s + q, name_hash=7, shard_bytes=2 * FRAME, lane=lane)
                    rec.record(src=rank, dst=peer, direction=fmt.SEND, bytes=FRAME, start_ns=T - 2 * D,
                               end_ns=T - D, step=0, dep_type=fmt.DEP_ON_REQUEST, **common)
                    rid = rec.record(src=peer, dst=rank, direction=fmt.RECV, bytes=FRAME, start_ns=T - 2 * D,
                                     end_ns=T - D - LAT, step=0, dep_type=fmt.DEP_ON_PEER_SEND, **common)
                    rec.record(src=rank, dst=peer, direction=fmt.SEND, bytes=FRAME, ready_ns=T - D, start_ns=T - D,
                               end_ns=T, step=1, dep_type=fmt.DEP_ON_RECEIVE, dep_id=rid, **common)
                    rec.record(src=peer, dst=rank, direction=fmt.RECV, bytes=FRAME, start_ns=T - D, end_ns=T,
                               step=1, dep_type=fmt.DEP_ON_PEER_SEND, **common)
            rec.close()


@pytest.fixture
def synthetic(tmp_path):
    d = tmp_path / "trace"
    write_synthetic(d)
    return d


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


# -- the C++ recorder -------------------------------------------------------------------------------

def test_recorder_selftest_writes_every_record(tmp_path):
    out = fasthorovod_testing._trace_selftest(str(tmp_path), 10_001, rank=3, lane=2, size=4)
    assert out["records"] == 10_001 and out["dropped"] == 0
    assert os.path.basename(out["path"]) == "rank3.lane2.bin"
    pf = fmt.read_proxy_file(out["path"])
    assert pf.meta["kind"] == "proxy" and pf.meta["rank"] == 3 and pf.meta["lane"] == 2 and pf.meta["size"] == 4
    assert pf.meta["records"] == 10_001 and pf.meta["dropped"] == 0 and pf.meta["selftest"] is True
    assert pf.meta["pid"] == os.getpid() and pf.meta["host"] and pf.meta["clock"] == "CLOCK_MONOTONIC"
    r = pf.records
    assert len(r) == 10_001 and pf.truncated_bytes == 0
    assert (r["id"] == range(10_001)).all()
    assert set(r["direction"].tolist()) == {fmt.SEND, fmt.RECV}
    assert (r["bytes"] == 1 << 16).all() and (r["lane"] == 2).all()
    # Every dependent send points at a receive of the same segment one step earlier.
    dep = r[r["dep_type"] == fmt.DEP_ON_RECEIVE]
    assert len(dep) > 0
    target = r[dep["dep_id"]]
    assert (target["direction"] == fmt.RECV).all()
    assert (target["segment"] == dep["segment"]).all() and (target["step"] + 1 == dep["step"]).all()
    assert (target["seq"] == dep["seq"]).all()
    assert out["ns_per_record"] < 20_000  # generous: shared CI cores; the real cost is ~50 ns


def test_recorder_never_overwrites_and_counts_drops(tmp_path):
    a = fasthorovod_testing._trace_selftest(str(tmp_path), 10)
    b = fasthorovod_testing._trace_selftest(str(tmp_path), 10)
    assert os.path.basename(a["path"]) == "rank0.lane0.bin" and os.path.basename(b["path"]) == "rank0.lane0.p1.bin"
    # A 64-record ring that is flushed only every 10 s overflows: the surplus is dropped and counted.
    c = fasthorovod_testing._trace_selftest(str(tmp_path / "small"), 1000, capacity=64, flush_interval_ms=10_000)
    assert c["records"] == 64 and c["dropped"] == 1000 - 64
    pf = fmt.read_proxy_file(c["path"])
    assert len(pf.records) == 64 and pf.meta["dropped"] == 936
    rec = _C.TraceRecorder()
    assert rec.record(src=0, dst=1, direction=0, bytes=1, start_ns=0, end_ns=1) == -1  # not open: ignored
    with pytest.raises(ValueError):
        rec.open("", 0, 0)


def test_reader_ignores_a_partial_last_record(tmp_path):
    out = fasthorovod_testing._trace_selftest(str(tmp_path), 5)
    with open(out["path"], "ab") as f:
        f.write(b"\x01" * 40)
    pf = fmt.read_proxy_file(out["path"])
    assert len(pf.records) == 5 and pf.truncated_bytes == 40
    with open(tmp_path / "rank9.lane0.bin", "wb") as f:
        f.write(b"garbage" * 10)
    with pytest.raises(fmt.TraceFormatError):
        fmt.read_proxy_file(str(tmp_path / "rank9.lane0.bin"))


# -- worker capture ---------------------------------------------------------------------------------

def test_capture_is_a_no_op_when_off(tmp_path):
    assert capture.tracer is None
    capture.event("request", "x", bytes=1)
    with capture.span("update") as sp:
        sp.set(x=1)
    capture.complete("compute", "", 0, 1)
    assert capture.next_step() == 0
    assert capture.stop_trace() is None
    assert capture.trace_dir_from_env({}) is None and capture.trace_dir_from_env({"FASTHOROVOD_TRACE_DIR": " "}) is None
    assert capture.trace_dir_from_env({"FASTHOROVOD_TRACE_DIR": "/x"}) == "/x"


def test_capture_writes_events_with_steps(tmp_path):
    t = capture.start_trace(str(tmp_path), rank=2, size=4, flush_interval=0.01)
    try:
        assert capture.tracer is t and t.path.endswith("rank2.worker.jsonl")
        capture.event("request", "b0", bytes=10, requests=[0])
        with capture.span("update") as sp:
            sp.set(lr=0.1)
        assert capture.next_step() == 1
        capture.event("grad_ready", "b0")
        capture.event("request", "b0", step=7)  # an explicit step wins
    finally:
        path = capture.stop_trace()
    assert capture.tracer is None
    wf = fmt.read_worker_file(path)
    assert wf.complete and wf.meta["rank"] == 2 and wf.meta["size"] == 4 and wf.meta["clock_method"] == "none"
    kinds = [(e["k"], e["n"], e["step"]) for e in wf.events]
    assert kinds == [("request", "b0", 0), ("update", "", 0), ("grad_ready", "b0", 1), ("request", "b0", 7)]
    assert wf.events[0]["bytes"] == 10 and wf.events[0]["requests"] == [0]
    assert wf.events[1]["d"] >= 0 and wf.events[1]["lr"] == 0.1
    # A second trace into the same directory becomes part 1, never overwriting part 0.
    capture.start_trace(str(tmp_path), rank=2, size=4)
    assert capture.stop_trace().endswith("rank2.worker.p1.jsonl")


def test_clock_offset_from_barrier_stamps():
    # Rank 1's clock reads 1000 less than rank 0's; each barrier completes 40..60 after entry.
    ref = [(100, 160), (300, 350), (500, 545)]
    mine = [(a - 1000 + 5, b - 1000 - 3) for a, b in ref]
    offset, error, method = capture.offset_from_stamps(ref, mine)
    # bounds per round [a0 - br, b0 - ar]: [943, 1055], [953, 1045], [958, 1040] -> 999 ± 41
    assert method == "barrier-bounds" and (offset, error) == (999, 41)
    assert capture.offset_from_stamps(ref, ref)[0] == 0
    # Two ranks sharing one clock pool their rounds: the intersection is tighter than either alone.
    other = [(a - 1000 - 20, b - 1000 + 30) for a, b in ref]
    pooled = capture.offset_from_stamps([ref, ref], [mine, other])
    assert pooled[2] == "barrier-bounds" and abs(pooled[0] - 1000) <= pooled[1] <= 41

    calls = []
    here = capture.clock_domain()
    est = lambda rank, everyone: capture.estimate_clock_offset(  # noqa: E731
        rank, lambda: calls.append(1), lambda mine: everyone(mine), rounds=3)
    assert est(0, lambda mine: [mine, mine]) == (0, 0, "reference") and len(calls) == 3
    assert est(1, lambda mine: [mine, mine]) == (0, 0, "same-host")
    # Rank 1 on another host whose clock reads 1000 less than rank 0's.
    far = est(1, lambda _: [(here, ref), ("boot:elsewhere", [(a - 1000 + 5, b - 1000 - 3) for a, b in ref])])
    assert far == (999, 41, "barrier-bounds")


# -- statistics of the synthetic trace --------------------------------------------------------------

def test_synthetic_trace_gives_exact_statistics(synthetic):
    r = an.analyze(str(synthetic))
    assert r["ranks"] == [0, 1] and r["lanes"] == [0, 1] and r["size"] == 2 and not r["warnings"], r["warnings"]
    rows = {(it["rank"], it["step"]): it for it in r["iterations"]}
    assert len(rows) == 4
    expect = {0: dict(p1=50, p2=20, p3=20, wait=20, compute=70, comm=40),
              1: dict(p1=55, p2=20, p3=15, wait=15, compute=75, comm=35)}
    for (rank, step), it in rows.items():
        e = expect[rank]
        assert it["start_s"] == approx(step * 0.1) and it["iteration_s"] == approx(0.1)
        assert it["p1_s"] == approx(e["p1"] / 1e3) and it["p2_s"] == approx(e["p2"] / 1e3)
        assert it["p3_s"] == approx(e["p3"] / 1e3) and it["wait_s"] == approx(e["wait"] / 1e3)
        assert it["compute_s"] == approx(e["compute"] / 1e3) and it["comm_s"] == approx(e["comm"] / 1e3)
        assert it["update_s"] == approx(0.01) and it["other_s"] == approx(0.0)
        assert it["overlap_ratio"] == approx(20 / 90) and it["hidden_comm_ratio"] == approx(20 / e["comm"])
        assert it["completion_spread_s"] == approx(0.01) and it["bytes"] == 8000
        assert it["compute_from"] == "spans"
    for agg in r["per_step"]:
        assert agg["p1_s"] == approx(0.0525) and agg["p2_s"] == approx(0.02) and agg["p3_s"] == approx(0.0175)
        assert agg["sync_s"] == approx(0.005) and agg["sync_last_s"] == approx(0.005)
        assert agg["overlap_ratio"] == approx(0.02 / 0.09) and agg["bytes"] == 16000
    s = r["summary"]
    assert s["steps"] == 2 and s["iteration_s"] == approx(0.1) and s["sync_s"] == approx(0.005)
    assert s["update_s"] == approx(0.01) and s["wait_s"] == approx(0.0175)
    assert r["sync"]["collectives"] == 4 and r["sync"]["straggler_counts"] == {"1": 4}
    assert an.analyze(str(synthetic), skip=1)["summary"]["steps"] == 1

    # Frames: 2 ranks x 2 lanes x 4 collectives x 2 sends of 1000 bytes.
    assert r["frames"] == 64
    assert r["message_sizes"] == [{"lo": 512, "hi": 1024, "count": 32}]
    assert r["request_sizes"] == [{"lo": 2048, "hi": 4096, "count": 8}]  # 8 requests of 4000 bytes
    for rl in r["rank_lanes"]:
        d = LANE_D[rl["lane"]]
        assert rl["bytes_sent"] == 4 * 2 * FRAME == rl["bytes_received"] and rl["frames_sent"] == 8
        assert rl["wire_bytes_sent"] == 8000 + 8 * fmt.FRAME_HEADER_BYTES and rl["collectives"] == 4
        assert rl["busy_s"] == approx(4 * 2 * d / 1e9)
        assert rl["throughput_Bps"] == approx(2 * FRAME / (2 * d / 1e9))
    lanes = {l["lane"]: l for l in r["lane_stats"]}
    assert lanes[0]["throughput_Bps"] == approx(1e6) and lanes[1]["throughput_Bps"] == approx(5e5)
    assert r["lane_imbalance"] == approx(2.0)
    assert r["collective_lane_skew"]["count"] == 8 and r["collective_lane_skew"]["mean"] == approx(2.0)
    assert r["slowest_lane_counts"] == {"1": 8}
    spread, share = r["lane_finish_spread_s"], r["lane_finish_spread_share"]
    assert spread["count"] == 8 and spread["max"] == 0.0 and share["max"] == 0.0  # the lanes end together
    assert len(r["connections"]) == 4  # 0->1 and 1->0 on each lane, one socket
    for c in r["connections"]:
        d = LANE_D[c["lane"]]
        active = 4 * (2 * d - LAT)  # per collective: step 0 in flight [T-2D, T-D-L), step 1 [T-D, T)
        assert c["bytes"] == 8000 and c["active_s"] == approx(active / 1e9)
        assert c["throughput_Bps"] == approx(8000 / (active / 1e9))
    assert r["connection_imbalance"] == approx((8000 / (4 * (2 * MS - LAT))) / (8000 / (4 * (4 * MS - LAT))))
    fl = r["ring_forward_latency_s"]
    assert fl["count"] == 16 and fl["mean"] == approx(LAT / 1e9) and fl["max"] == approx(LAT / 1e9)
    json.dumps(r)  # serialisable
    table = an.format_table(r, per_rank=True)
    assert "overlap" in table and "lane imbalance (max/min throughput): 2.00" in table


def test_lanes_that_finish_apart_are_reported(tmp_path):
    """Lane 1's frames end 3 ms before lane 0's (each collective: lane 0 spans [T-2 ms, T], lane 1
    [T-7 ms, T-3 ms]): the finish spread is 3 ms, 3/7 of the collective's span on each rank."""
    write_synthetic(tmp_path, lane_early=(0, 3 * MS))
    r = an.analyze(str(tmp_path))
    spread, share = r["lane_finish_spread_s"], r["lane_finish_spread_share"]
    assert spread["count"] == 8 and spread["min"] == approx(0.003) and spread["max"] == approx(0.003)
    assert share["p50"] == approx(3 / 7) and share["max"] == approx(3 / 7)
    assert "first to last lane finished: median 3.0 ms (42.9% of the collective)" in an.format_table(r)


def test_compute_defaults_to_the_window_without_compute_spans(tmp_path):
    tr = capture.Tracer(str(tmp_path), 0, 1)
    tr.event("request", "g", t_ns=40 * MS, bytes=100, step=0)
    tr.complete("wait", "g", 60 * MS, 80 * MS, step=0)
    tr.complete("update", "", 80 * MS, 90 * MS, step=0)
    tr.event("marker", "", t_ns=0, step=0)  # the iteration starts at its first event
    tr.close()
    it = an.analyze(str(tmp_path))["iterations"][0]
    # window [0, 90); C = [0, 60); M = [40, 80) (completion: end of the wait for "g")
    assert it["compute_from"] == "window" and it["iteration_s"] == approx(0.09)
    assert it["p1_s"] == approx(0.04) and it["p2_s"] == approx(0.02) and it["p3_s"] == approx(0.02)
    assert it["wait_s"] == approx(0.02) and it["update_s"] == approx(0.01) and it["other_s"] == approx(0.0)


def test_interval_algebra():
    assert an.merge([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    assert an.intersect([(0, 10)], [(2, 3), (5, 12)]) == [(2, 3), (5, 10)]
    assert an.subtract([(0, 10), (20, 30)], [(2, 3), (8, 22), (25, 26)]) == [(0, 2), (3, 8), (22, 25), (26, 30)]
    assert an.measure(an.clip([(0, 10), (20, 30)], 5, 25)) == 10


# -- the CLI ------------------------------------------------------------------------------------------

def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "fasthorovod.trace", *args], capture_output=True, text=True,
                          timeout=240)


def test_cli_produces_table_json_plot_and_chrome(synthetic, tmp_path):
    png, chrome = tmp_path / "t.png", tmp_path / "t.json"
    out = run_cli("analyze", str(synthetic), "--plot", str(png), "--chrome", str(chrome), "--per-rank")
    assert out.returncode == 0, out.stderr
    assert "Per iteration" in out.stdout and "lane imbalance" in out.stdout
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(chrome.read_text())
    events = doc["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    for rank in (0, 1):
        for track in ("worker", "allreduce", "lane 0 send", "lane 0 recv", "lane 1 send", "lane 1 recv"):
            assert (rank, track) in names, (rank, track, names)
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert set(procs) == {0, 1} and procs[0].startswith("rank 0")
    frames = [e for e in events if e.get("cat") == "frame"]
    assert len(frames) == 64 and all(e["ph"] == "X" and e["dur"] >= 0 for e in frames)
    assert min(e["ts"] for e in events if "ts" in e) == 0.0
    asyncs = [e for e in events if e.get("cat") == "allreduce"]
    assert len(asyncs) == 16 and {e["ph"] for e in asyncs} == {"b", "e"}

    js = run_cli("analyze", str(synthetic), "--json", "--skip", "1")
    assert js.returncode == 0, js.stderr
    result = json.loads(js.stdout)
    assert result["summary"]["steps"] == 1 and result["lane_imbalance"] == approx(2.0)


def test_cli_help_and_errors(tmp_path):
    h = run_cli("analyze", "--help")
    assert h.returncode == 0
    for flag in ("--json", "--plot", "--chrome", "--skip", "--per-rank", "overlap"):
        assert flag in h.stdout
    missing = run_cli("analyze", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    empty = run_cli("analyze", str(tmp_path))
    assert empty.returncode == 1 and "no trace files" in empty.stderr


def test_proxy_only_trace_is_analyzed(tmp_path):
    for rank in (0, 1):
        fasthorovod_testing._trace_selftest(str(tmp_path), 64, rank=rank, lane=0, size=2)
    r = an.analyze(str(tmp_path))
    assert r["iterations"] == [] and r["frames"] == 128 and r["sync"]["source"] == "proxy"
    assert {rl["rank"] for rl in r["rank_lanes"]} == {0, 1}
    an.format_table(r)
