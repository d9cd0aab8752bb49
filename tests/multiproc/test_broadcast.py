"""Broadcasts through the proxies with real ranks: bit-exact for every dtype and value (NaN
payloads, signalling NaNs, -0.0, infinities), root != 0, in place and out of place, async handles,
the same bytes as Horovod's; broadcast_parameters / broadcast_optimizer_state / broadcast_object on
the proxies; Horovod's errors unchanged, and ranks that disagree fail cleanly instead of hanging."""
import pytest

from tests.multiproc.harness import REPO, Lanes, ring_allreduce_bytes, run_job

pytestmark = [pytest.mark.multiproc]
WORKER = REPO / "tests" / "workers" / "broadcast_worker.py"
ENV = {"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_TIMEOUT_SECONDS": "30"}
THRESHOLD = 1 << 20  # the harness's FASTHOROVOD_PROXY_THRESHOLD_BYTES
WIDTHS = (4, 8, 2, 1, 1, 2, 4, 8)  # broadcast_worker.py's DTYPES


def broadcasts(np_: int, *sizes: int) -> Lanes:
    """Broadcasts run as ring allreduces (ProxyGroup.broadcast): 2(n-1)/n of each on every rank."""
    return Lanes(min_bytes=ring_allreduce_bytes(np_, *sizes), min_collectives=len(sizes))


def exact_broadcasts(np_: int) -> Lanes:
    """broadcast_worker.py's exact scenario: per root (0 and size-1) and dtype, four broadcasts
    (out of place, async, in place, async in place) of threshold/width + 13 elements, and one
    broadcast of a shared-memory tensor."""
    sizes = [THRESHOLD + 13 * width for width in WIDTHS for _ in range(4)] * 2 + [THRESHOLD + 20]
    return broadcasts(np_, *sizes)


@pytest.mark.parametrize("np_", [2, 3])
def test_broadcasts_are_bit_exact_through_the_proxies(np_):
    result = run_job(np_, "exact", worker=WORKER, env=ENV, timeout=300, proxied=exact_broadcasts(np_))
    assert result.stdout.count("exact ok") == np_, result.stdout[-3000:]


def test_broadcast_functions_and_gradient_match_horovod():
    # at least: the 2 MiB weight of broadcast_parameters, the 2 MiB object, the 1 MiB + 12 B tensor
    # whose gradient is checked (the optimizer state's broadcast is checked by the worker)
    result = run_job(3, "functions", worker=WORKER, env=ENV, timeout=300,
                     proxied=broadcasts(3, 2 << 20, 2 << 20, (1 << 20) + 12))
    assert result.stdout.count("functions ok") == 3, result.stdout[-3000:]


def test_broadcast_errors_are_horovods_and_disagreements_fail_cleanly():
    # the broadcasts that succeed ("twice", "after.mismatch", "after.join"), 262,145 float32 each;
    # the mismatched ones never reach the lanes
    result = run_job(2, "errors", worker=WORKER, env=ENV, timeout=300, proxied=broadcasts(2, *[(THRESHOLD + 4)] * 3))
    assert result.stdout.count("errors ok") == 2, result.stdout[-3000:]
