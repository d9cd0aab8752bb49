"""Bad input through the public API, strangers at a running job, restart, and a soak run."""
import re

import pytest

from tests.multiproc.harness import Lanes, check_lanes, ring_allreduce_bytes, run_job

pytestmark = pytest.mark.multiproc


def allreduces(np_: int, *sizes: int) -> Lanes:
    return Lanes(min_bytes=ring_allreduce_bytes(np_, *sizes), min_collectives=len(sizes))


def test_bad_input_behaves_like_horovod_or_better(three_ranks_two_proxies):
    # the strided 1000 x 600 float32 tensor (out of place and in place) and the non-finite one of
    # 400,000; the empty and scalar ones are Horovod's (below the threshold)
    job = three_ranks_two_proxies
    assert job.stdout.count("bad input ok") == 3, job.stdout[-2000:]
    check_lanes(job.stdout, allreduces(3, 600_000 * 4, 600_000 * 4, 400_000 * 4), range(3), scenario="bad_input")


def test_strangers_are_turned_away_by_a_running_job(two_ranks_three_proxies):
    job = two_ranks_three_proxies
    # one on each of the three lanes' two ring ports
    assert job.stdout.count("6 strangers turned away, job unaffected") == 2, job.stdout[-2000:]
    check_lanes(job.stdout, allreduces(2, 4 << 20, 4 << 20), range(2), scenario="refused")


def test_shutdown_and_init_again_in_the_same_processes(tmp_path):
    # one allreduce of 500,000 float32 per data plane, over the four planes of the four cycles
    result = run_job(2, "restart", "--cycles", "4", "--sync-dir", str(tmp_path), env={"FASTHOROVOD_NUM_LANES": "2"},
                     proxied=allreduces(2, *[500_000 * 4] * 4))
    assert result.stdout.count("restart ok") == 2, result.stdout[-2000:]
    print(*[line for line in result.stdout.splitlines() if "restart ok" in line], sep="\n")


@pytest.mark.slow
def test_a_tensor_over_2_gib_and_2_to_the_31_elements():
    result = run_job(2, "huge", env={"FASTHOROVOD_NUM_LANES": "2"}, timeout=900)
    assert result.stdout.count("huge ok") == 2, result.stdout[-2000:]


@pytest.mark.slow
def test_soak_random_sizes_dtypes_and_ops():
    """1,000 verified allreduces of 1 B to 4 MiB (log-uniform) across 3 ranks, every one through
    the proxies (threshold 0: each of Horovod's small allreduces costs twice a proxied one here,
    and the optimizer's tests mix both paths); benchmarks/soak.py runs 10,000 up to 64 MiB."""
    result = run_job(3, "soak", "--count", "1000", "--max-bytes", str(4 << 20),
                     env={"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_PROXY_THRESHOLD_BYTES": "0"},
                     timeout=900, proxied=Lanes(min_collectives=1000))
    counts = re.findall(r"SOAK rank \d+: (\d+) allreduces verified, (\d+) mismatches", result.stdout)
    assert counts == [("1000", "0")] * 3, counts  # counted by the workers, the last ones in flight too
