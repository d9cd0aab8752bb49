"""One 2-rank job through the proxies: the multi-process smoke test of ``make test-fast``.

Float64 allreduces of 2.4 MB and 560 kB, two in flight, five rounds, exact on every rank, and every
rank's lanes carry at least the ring's share of them (the harness checks the lanes' own counters).
"""
from tests.multiproc.harness import Lanes, ring_allreduce_bytes, run_job

ROUNDS = 5


def test_two_ranks_allreduce_exactly_through_the_proxies():
    sizes = [(300_001 + i) * 8 for i in range(ROUNDS)] + [70_000 * 8] * ROUNDS
    result = run_job(2, "salted", "--seed", "7", "--count", str(ROUNDS), timeout=180,
                     env={"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_PROXY_THRESHOLD_BYTES": str(256 << 10)},
                     proxied=Lanes(min_bytes=ring_allreduce_bytes(2, *sizes), min_collectives=2 * ROUNDS))
    assert result.stdout.count("salted job 7 ok") == 2, result.stdout[-3000:]
