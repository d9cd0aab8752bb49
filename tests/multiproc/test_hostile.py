"""A rank that holds the job token but sends hostile negotiation frames: every honest
rank raises a FastHorovodError naming that rank and the field, within the timeout, without a crash
and without allocating what the frames claim (tests/workers/hostile_worker.py). The ring's frames
and the coordinator's run orders get the same treatment in the C++ tests (tests/cpp/test_hostile.cc)."""
import re

import pytest

from tests.multiproc.harness import REPO, run_job

pytestmark = [pytest.mark.multiproc]
HOSTILE = str(REPO / "tests" / "workers" / "hostile_worker.py")


def test_hostile_member_frames_fail_every_honest_rank_within_the_timeout():
    variants = "length,count,weights,truncated,random"
    result = run_job(3, "--variants", variants, worker=HOSTILE, timeout=300,
                     env={"FASTHOROVOD_NUM_LANES": "2", "FASTHOROVOD_TIMEOUT_SECONDS": "5"})
    lines = re.findall(r"HOSTILE .*", result.stdout)
    assert len(lines) == 6 and lines[-1] == "HOSTILE done: 5 variants", result.stdout[-4000:]
    print("\n".join(lines))
