"""Re-hashing a slow flow, with the defaults, against a real per-flow slowdown: a job in a private
network namespace whose flows are shaped by tc by their source ports; and the start-up warm-up on
the emulated cloud. Needs root and tc (and sshd for the cloud)."""
import os
import sys
from pathlib import Path

import pytest

from tests.multiproc.harness import Lanes, ring_allreduce_bytes, run_job
from tests.netns import skip_unless_usable

pytestmark = [skip_unless_usable(("ip", "tc"), "fhvdrhprobe")]
netem = skip_unless_usable(("ip", "tc", "ssh", "ssh-keygen", "/usr/sbin/sshd"), "fhvdrhwprobe")
FASTHOROVODRUN = str(Path(sys.executable).parent / "fasthorovodrun")


def test_a_flow_slower_than_its_siblings_is_replaced_by_a_new_connection(private_netns):
    env = {"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_SOCKETS_PER_LANE": "2"}
    assert "FASTHOROVOD_REHASH" not in os.environ, "the test is of the default"
    sizes = [16 << 20] * 12
    result = run_job(2, "flow_slowdown", "--count", str(len(sizes)), env=env, timeout=240,
                     wrap=["ip", "netns", "exec", private_netns],
                     proxied=Lanes(min_bytes=ring_allreduce_bytes(2, *sizes), min_collectives=len(sizes)))
    assert result.stdout.count("flow slowdown ok") == 2, result.stdout[-3000:]
    print("\n".join(line for line in result.stdout.splitlines() if "replaced" in line))


@netem
@pytest.mark.netem
def test_start_up_ends_with_the_warm_up_that_lets_the_rule_act_before_the_first_collective():
    # FASTHOROVOD_REHASH_WARM_UP=1 (auto would depend on whether the probe's draw of ports collided):
    # the lanes run the 4 warm-up allreduces before the job's own, and rank 0 says what they did
    result = run_job(2, "large", "--mbytes", "8", timeout=240, env={"FASTHOROVOD_REHASH_WARM_UP": "1"},
                     launcher=(FASTHOROVODRUN, "--emulate-cloud", "2:1gbit:200mbit,buckets=16"),
                     proxied=Lanes(min_bytes=ring_allreduce_bytes(2, 8 << 20), min_collectives=5))
    assert result.stdout.count("large ok") == 2, result.stdout[-3000:]
    said = [line for line in result.stdout.splitlines() if "[fasthorovod] start-up: " in line]
    why = said[0].split("start-up: ", 1)[1] if len(said) == 1 else ""
    # the reason: the setting, or the collisions the probe saw first (16 buckets: likely)
    assert why.startswith(("FASTHOROVOD_REHASH_WARM_UP=1: ", "the probe saw flows collide (")), result.stdout[-3000:]
    assert ": 4 allreduces of 20.0 MiB before the job's first replaced " in why, why
