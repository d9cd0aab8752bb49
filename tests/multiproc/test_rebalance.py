"""Lane rebalancing against a real slowdown: a job in a private network namespace whose lanes are
shaped by tc, one lane slowed mid-run (also while a rank is in hvd.join()). Needs root and tc."""
import os

import pytest

from tests.multiproc.harness import Lanes, ring_allreduce_bytes, run_job
from tests.netns import skip_unless_usable

pytestmark = [pytest.mark.slow, skip_unless_usable(("ip", "tc"), "fhvdrbprobe")]


def test_a_halved_lane_loses_share_and_the_collectives_recover_also_during_join(private_netns):
    env = {"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_SOCKETS_PER_LANE": "1"}
    env.pop("FASTHOROVOD_REBALANCE_EVERY", None)
    assert "FASTHOROVOD_REBALANCE_EVERY" not in os.environ, "the test is of the default"
    # 100 steady allreduces of 4 MiB, 5 + 10 of 16 MiB, and 10 more of 16 MiB while rank 1 is
    # joined (its lanes contribute zeros): on both ranks, every lane carries its share of each
    sizes = [4 << 20] * 100 + [16 << 20] * 25
    result = run_job(2, "lane_slowdown", "--count", "100", env=env, timeout=240,
                     wrap=["ip", "netns", "exec", private_netns],
                     proxied=Lanes(min_bytes=ring_allreduce_bytes(2, *sizes), min_collectives=len(sizes)))
    assert result.stdout.count("lane slowdown ok") == 2, result.stdout[-3000:]
    print(result.stdout[-2500:])
