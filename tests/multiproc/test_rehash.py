"""Re-hashing a slow flow, with the defaults, against a real per-flow slowdown: a job in a private
network namespace whose flows are shaped by tc by their source ports. Needs root and tc."""
import os

import pytest

from tests.multiproc.harness import Lanes, ring_allreduce_bytes, run_job
from tests.netns import skip_unless_usable

pytestmark = [skip_unless_usable(("ip", "tc"), "fhvdrhprobe")]


def test_a_flow_slower_than_its_siblings_is_replaced_by_a_new_connection(private_netns):
    env = {"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_SOCKETS_PER_LANE": "2"}
    assert "FASTHOROVOD_REHASH" not in os.environ, "the test is of the default"
    sizes = [16 << 20] * 12
    result = run_job(2, "flow_slowdown", "--count", str(len(sizes)), env=env, timeout=240,
                     wrap=["ip", "netns", "exec", private_netns],
                     proxied=Lanes(min_bytes=ring_allreduce_bytes(2, *sizes), min_collectives=len(sizes)))
    assert result.stdout.count("flow slowdown ok") == 2, result.stdout[-3000:]
    print("\n".join(line for line in result.stdout.splitlines() if "replaced" in line))
