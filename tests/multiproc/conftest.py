"""Jobs that several tests share: one launched world runs their scenarios one after another
(harness.run_scenarios), and each test checks its own scenario's output and lanes. A launch costs
about 3 s for 2 ranks on this 2-core machine (horovodrun, torch's import per rank, the proxies'
start-up); the scenarios themselves take less than that.

A scenario that fails fails the job, and so every test sharing it, each with the job's output.
Only scenarios that leave the world as they found it share a job (the lane weights that
`rebalance` sets last are left to nobody)."""
import pytest

from tests.multiproc.harness import run_scenarios
from tests.netns import loopback_namespace

MISMATCHES = ("size", "dtype", "op", "prescale")


@pytest.fixture(scope="session")
def three_ranks_two_proxies():
    """3 ranks, 2 proxies of 2 sockets each, 64 KiB segments, the harness's 1 MiB threshold."""
    return run_scenarios(3, ("async", "join", "gather", "reducescatter", "allgather", "alltoall", "lent", "bad_input",
                                 "wire", "rehash", "asleep"), "--inflight", "40",
                         env={"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_SOCKETS_PER_LANE": "2",
                              "FASTHOROVOD_SEGMENT_BYTES": "65536"})


@pytest.fixture(scope="session")
def two_ranks_two_proxies():
    """2 ranks, 2 proxies: one allreduce of 100 MB and the four kinds of mismatch."""
    return run_scenarios(2, ("large", "mismatch"), "--mbytes", "100", "--variant", ",".join(MISMATCHES),
                         env={"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_TIMEOUT_SECONDS": "30"})


@pytest.fixture(scope="session")
def two_ranks_three_proxies():
    """2 ranks, 3 proxies, threshold 0, 64 KiB segments; `rebalance` (which leaves the lane
    weights changed) runs last."""
    return run_scenarios(2, ("gather", "reducescatter", "allgather", "alltoall", "refused", "rebalance"), "--count", "30",
                         env={"FASTHOROVOD_NUM_LANES": "3", "FASTHOROVOD_PROXY_THRESHOLD_BYTES": "0",
                              "FASTHOROVOD_SEGMENT_BYTES": "65536"})


@pytest.fixture
def private_netns():
    """A private network namespace whose loopback (MTU 1500) a test shapes with tc; deleted after."""
    with loopback_namespace("fhvdlo") as name:
        yield name
