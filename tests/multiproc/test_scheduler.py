"""The scheduler's policies with real ranks (horovodrun --gloo, 4 ranks, loopback, proxies on).

Workloads: tests/workers/scheduler_worker.py. About 2 minutes on a loaded 2-core machine.
"""
import json

import pytest

from tests.multiproc import harness

pytestmark = pytest.mark.multiproc

WORKER = harness.REPO / "tests" / "workers" / "scheduler_worker.py"
ENV = {"FASTHOROVOD_NUM_LANES": "1", "FASTHOROVOD_PROXY_THRESHOLD_BYTES": "0"}


def test_sync_weights_leaves_every_rank_with_identical_parameters():
    # the worker checks each policy's collectives against its lanes (check_lanes_carried)
    result = harness.run_job(4, "identical", "--algorithms", "od-sgd,ssd-sgd,cd-sgd,local-sgd,ssgd-2bit",
                             env={**ENV, "FASTHOROVOD_NUM_LANES": "2"}, timeout=240, worker=WORKER, proxied=True)
    assert result.stdout.count("identical after sync_weights") == 4 * 5, result.stdout[-3000:]


@pytest.mark.slow
def test_every_variant_converges_within_one_point_of_ssgd_on_digits(tmp_path):
    """30 epochs of a 64-64-10 MLP on scikit-learn's digits (lr 0.05, momentum 0.9, decay x0.1 at
    epoch 20, batch 16 per rank, 20 warm-up steps): test accuracy of each variant within 1
    percentage point of synchronous SGD."""
    out = tmp_path / "digits.json"
    harness.run_job(4, "digits", "--out", str(out), env=ENV, timeout=400, worker=WORKER, proxied=True)
    results = json.loads(out.read_text())
    # every variant's collectives went through rank 0's lanes: 2(n-1)/n of what it allreduced and
    # the 3 other ranks' rows of what it allgathered, per step
    for algorithm, r in results.items():
        least = 2 * 3 / 4 * r["allreduce_bytes_per_step"] + 3 * r["allgather_bytes_per_step"]
        assert r["lane_bytes_per_step"] >= least > 0, (algorithm, r)
    ssgd = results["ssgd"]["accuracy"]
    assert ssgd > 0.95, results
    for algorithm in ("od-sgd", "ssd-sgd", "cd-sgd", "local-sgd"):
        assert abs(results[algorithm]["accuracy"] - ssgd) <= 0.01, (algorithm, results)
    # SSGD + 2-bit is the research's baseline; it is reported, not required to match.
    print({a: round(r["accuracy"] * 100, 2) for a, r in results.items()})
    # SSD-SGD averages once per period of 5 after 20 warm-up steps: ~4.4x fewer bytes than SSGD here.
    payload = {a: r["allreduce_bytes_per_step"] + r["allgather_bytes_per_step"] for a, r in results.items()}
    assert payload["ssd-sgd"] < payload["ssgd"] / 4, payload
    assert results["ssd-sgd"]["lane_bytes_per_step"] < results["ssgd"]["lane_bytes_per_step"] / 4, results
