"""Two jobs at once on one host: each draws its own token, so neither can join the
other's rings or negotiation; both run their proxied allreduces exactly, at the same time."""
import threading
import time

import pytest

from tests.multiproc.harness import Lanes, ring_allreduce_bytes, run_job

pytestmark = pytest.mark.multiproc
# worker.py's salted scenario, 25 rounds: float64 allreduces of 300,001 + i and 70,000 elements
SALTED_SIZES = [c * 8 for i in range(25) for c in (300_001 + i, 70_000)]
SALTED = Lanes(min_bytes=ring_allreduce_bytes(2, *SALTED_SIZES), min_collectives=len(SALTED_SIZES))


def test_two_jobs_with_different_tokens_on_one_host_do_not_interfere():
    results, spans, errors = {}, {}, []

    def job(seed):
        start = time.monotonic()
        try:
            results[seed] = run_job(2, "salted", "--seed", str(seed), "--count", "25", timeout=400,
                                    env={"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_PROXY_THRESHOLD_BYTES": "0"},
                                    proxied=SALTED)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
        spans[seed] = (start, time.monotonic())

    threads = [threading.Thread(target=job, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for seed in (1, 2):
        assert results[seed].stdout.count(f"salted job {seed} ok") == 2, results[seed].stdout[-3000:]
    (a0, a1), (b0, b1) = spans[1], spans[2]
    assert min(a1, b1) - max(a0, b0) > 0.5 * min(a1 - a0, b1 - b0), spans  # they really ran together
