"""The DLC trace from real ranks (horovodrun --gloo): clock alignment, and byte totals of the proxies'
frame records against what was allreduced."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fasthorovod.proxy.core import hash64
from fasthorovod.trace import analyze as an
from fasthorovod.trace import format as fmt
from tests.multiproc.harness import run_job

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).resolve().parents[1] / "workers" / "trace_worker.py"


def ring_sent_elements(shard: int, size: int, rank: int) -> int:
    """Elements rank `rank` sends for a shard of `shard` elements: every chunk but chunk rank+1 in the
    reduce-scatter, every chunk but rank+2 in the allgather (= 2(n-1)/n of the shard when it splits
    evenly)."""
    chunk = lambda c: (c + 1) * shard // size - c * shard // size  # noqa: E731
    return 2 * shard - chunk((rank + 1) % size) - chunk((rank + 2) % size)


def test_worker_traces_of_two_ranks_share_one_clock(tmp_path):
    d = tmp_path / "trace"
    run_job(2, "clock", "--dir", str(d), worker=WORKER, env={"FASTHOROVOD_NUM_LANES": "0"}, timeout=180,
            proxied=False)
    files = sorted(os.listdir(d))
    assert files == ["rank0.worker.jsonl", "rank1.worker.jsonl"], files
    for rank in (0, 1):
        wf = fmt.read_worker_file(str(d / f"rank{rank}.worker.jsonl"))
        assert wf.complete and wf.meta["rank"] == rank and wf.meta["size"] == 2
        # One host: CLOCK_MONOTONIC is shared, so the offset is exactly 0 ...
        assert wf.meta["clock_method"] == ("reference" if rank == 0 else "same-host"), wf.meta
        assert wf.meta["clock_offset_ns"] == 0 and wf.meta["clock_error_ns"] == 0
        # ... and the barrier estimator (used across hosts) must bracket that true 0.
        offset, error, method = wf.meta["barrier_estimate"]
        assert method == ("reference" if rank == 0 else "barrier-bounds"), wf.meta
        assert abs(offset) <= error + 1 and error < 100_000_000, wf.meta
        kinds = [e["k"] for e in wf.events]
        assert kinds.count("compute") == 3 and kinds.count("update") == 3
        assert [e["k"] for e in wf.events if e["n"] == "g"] == ["request", "wait"] * 3
    r = an.analyze(str(d))
    assert not r["warnings"], r["warnings"]
    assert len(r["per_step"]) == 3 and all(s["ranks"] == 2 for s in r["per_step"])
    for it in r["iterations"]:
        assert it["compute_s"] > 0.004 and it["update_s"] > 0.0009 and it["comm_s"] > 0
    assert r["sync"]["collectives"] >= 3  # "g" x3 (+ the allreduces themselves once mpi_ops is traced)


def test_two_rank_trace_byte_totals_match_what_was_allreduced(tmp_path, np_=2):
    d = tmp_path / "trace"
    run_job(np_, "allreduce", "--dir", str(d), worker=WORKER, timeout=240,
            env={"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_TRACE_DIR": str(d),
                 "FASTHOROVOD_SEGMENT_BYTES": "65536", "FASTHOROVOD_PROXY_THRESHOLD_BYTES": "0",
                 "FASTHOROVOD_BUCKET_BYTES": "40000"},
            proxied=True)  # the frame records below are checked against the counters byte for byte
    manifests = {r: json.loads((d / f"manifest.rank{r}.json").read_text()) for r in range(np_)}
    size, lanes = manifests[0]["size"], manifests[0]["lanes"]
    expected = {f"rank{r}.worker.jsonl" for r in range(size)} | \
        {f"rank{r}.lane{j}.bin" for r in range(size) for j in range(lanes)}
    assert expected <= set(os.listdir(d)), sorted(os.listdir(d))
    trace = fmt.load_trace_dir(str(d))
    for (rank, lane), parts in trace.proxies.items():
        assert len(parts) == 1, f"one proxy trace per lane expected: {[p.path for p in parts]}"
        pf = parts[0]
        assert pf.meta["rank"] == rank and pf.meta["lane"] == lane and pf.meta["size"] == size
        assert pf.meta["records"] == len(pf.records) and pf.meta["dropped"] == 0 and pf.truncated_bytes == 0, pf.meta
    for rank, parts in trace.workers.items():
        assert len(parts) == 1 and parts[0].complete, "hvd.shutdown() must stop the worker trace"

    shards = {}  # (rank, tensor, collective) -> sum of its lanes' shard bytes
    for rank in range(size):
        man = manifests[rank]
        requests = [e for e in trace.workers[rank][0].events if e["k"] == fmt.REQUEST]
        for lane in range(lanes):
            rec = trace.proxies[(rank, lane)][0].records
            sends = rec[(rec["direction"] == fmt.SEND) & (rec["src"] == rank)]
            recvs = rec[(rec["direction"] == fmt.RECV) & (rec["dst"] == rank)]
            assert len(sends) + len(recvs) == len(rec), "a lane records only its own frames"
            assert (sends["dst"] == (rank + 1) % size).all() and (recvs["src"] == (rank - 1) % size).all()
            # Every frame is recorded: payload + one 128-byte header per frame = the proxy's own counters.
            stats = man["lane_stats"][lane]
            assert int(sends["bytes"].sum()) + fmt.FRAME_HEADER_BYTES * len(sends) == stats["bytes_sent"]
            assert int(recvs["bytes"].sum()) + fmt.FRAME_HEADER_BYTES * len(recvs) == stats["bytes_received"]
            assert len(set(sends["seq"].tolist())) == stats["collectives"]
            for t in man["tensors"]:
                mine = sends[sends["name_hash"] == hash64(t["name"])]
                theirs = recvs[recvs["name_hash"] == hash64(t["name"])]
                seqs = sorted(set(mine["seq"].tolist()))
                assert len(seqs) == t["repeats"], (t, seqs)
                for seq in seqs:
                    # The ring sends (and receives) 2(n-1)/n of the lane's shard per allreduce.
                    shard = int(mine["shard_bytes"][mine["seq"] == seq][0])
                    want = ring_sent_elements(shard // t["itemsize"], size, rank) * t["itemsize"]
                    assert int(mine["bytes"][mine["seq"] == seq].sum()) == want, (t, lane, seq)
                    want_in = ring_sent_elements(shard // t["itemsize"], size, (rank - 1) % size) * t["itemsize"]
                    assert int(theirs["bytes"][theirs["seq"] == seq].sum()) == want_in, (t, lane, seq)
                    shards[(rank, t["name"], seq)] = shards.get((rank, t["name"], seq), 0) + shard
                # Records name the worker's request numbers, as its request events do.
                posted = {q for e in requests if e["n"] == t["name"] for q in e.get("requests", [])}
                assert set(mine["request"].tolist()) == posted, (t["name"], posted)
            # Each dependent send waited for the receive of the same segment one step earlier.
            dep = sends[sends["dep_type"] == fmt.DEP_ON_RECEIVE]
            assert len(dep) > 0
            target = rec[dep["dep_id"]]
            assert (target["direction"] == fmt.RECV).all() and (target["segment"] == dep["segment"]).all()
            assert (target["step"] + 1 == dep["step"]).all() and (target["seq"] == dep["seq"]).all()
            assert (dep["ready_ns"] >= target["end_ns"]).all()
    # The lanes' shards of every collective add up to the tensor that was allreduced.
    sizes = {t["name"]: t["count"] * t["itemsize"] for t in manifests[0]["tensors"]}
    assert len(shards) == size * sum(t["repeats"] for t in manifests[0]["tensors"])
    assert all(total == sizes[name] for (_, name, _), total in shards.items()), shards

    for rank in range(size):
        # The optimizer's steps: forward (module hooks), backward (gradient hooks), update, in order.
        events = trace.workers[rank][0].events
        spans = {k: [e for e in events if e["k"] == k] for k in ("forward", "backward", "update")}
        assert len(spans["forward"]) == len(spans["backward"]) == len(spans["update"]) == 4, \
            {k: len(v) for k, v in spans.items()}
        for f, b, u in zip(spans["forward"], spans["backward"], spans["update"]):
            assert f["step"] == b["step"] == u["step"]
            assert f["t"] + f["d"] <= b["t"] <= b["t"] + b["d"] <= u["t"], (f, b, u)
    r = an.analyze(str(d))
    assert not r["warnings"], r["warnings"]
    assert {(x["rank"], x["lane"]) for x in r["rank_lanes"]} == {(a, b) for a in range(size) for b in range(lanes)}
    assert len(r["connections"]) == size * lanes
    steps = {it["step"] for it in r["iterations"]}
    assert len(steps) >= 4, "the optimizer's steps must be traced (update spans, next_step)"
    assert all(it["update_s"] > 0 for it in r["iterations"] if it["step"] > 0)
    png, chrome = d.parent / "t.png", d.parent / "t.json"
    out = subprocess.run([sys.executable, "-m", "fasthorovod.trace", "analyze", str(d), "--plot", str(png),
                          "--chrome", str(chrome)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert png.stat().st_size > 10_000 and json.loads(chrome.read_text())["traceEvents"]
