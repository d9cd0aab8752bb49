"""The harness's path claims (harness.check_lanes) on made-up worker output: no ranks are started.

A claim must fail when one rank's line is missing, when a lane moved nothing (but the alltoall's
mesh, whose lanes share each block), when the bytes fall short of the bound, and when a Horovod-path job's lanes carried anything."""
import json

import pytest

from tests.multiproc.harness import Lanes, check_lanes, ring_allgather_bytes, ring_allreduce_bytes


def line(rank: int, *planes) -> str:
    """A worker's FASTHOROVOD_LANES line as Horovod's launcher relays it; each plane a list of
    (bytes_sent, bytes_received, collectives) per lane."""
    report = {"rank": rank, "planes": [
        {"rank": rank, "size": 2, "lanes": [{"bytes_sent": s, "bytes_received": r, "collectives": c}
                                            for s, r, c in lanes]} for lanes in planes]}
    return f"[{rank}]<stdout>:FASTHOROVOD_LANES {json.dumps(report)}"


def out(*lines: str) -> str:
    return "\n".join(("[0]<stdout>:rank 0: ok",) + lines + ("",))


GOOD = out(line(0, [(600, 600, 2), (500, 500, 2)]), line(1, [(600, 600, 2), (500, 500, 2)]))


def test_the_ring_bounds():
    assert ring_allreduce_bytes(2, 100) == 100 and ring_allreduce_bytes(4, 100, 8) == 150 + 12
    assert ring_allgather_bytes(3, 10, 1) == 22


def test_a_proxied_claim_holds_on_every_rank():
    check_lanes(GOOD, Lanes(min_bytes=1100, min_collectives=2), range(2))
    check_lanes(GOOD, True, range(2))
    check_lanes("no lines at all", None, range(2))  # no claim, nothing checked


@pytest.mark.parametrize("text, claim, message", [
    (out(line(0, [(600, 600, 2), (500, 500, 2)])), True, r"ranks \[1\] printed no lane counters"),
    (out(line(0, [(600, 600, 2), (0, 0, 2)]), line(1, [(600, 600, 2), (5, 5, 2)])), True, "every lane must move"),
    (GOOD, Lanes(min_bytes=1101), "at least 1101 B"),
    (GOOD, Lanes(min_collectives=3), "at least 3"),
    (out(line(0), line(1)), True, "no proxies ran"),
    (GOOD, Lanes(tcp=False), "moves nothing over TCP"),
    (GOOD, Lanes(mesh=True), "at least 1 B"),  # the rings' bytes are not the mesh's
    (out(line(0, [(0, 0, 0)]), line(1, [(0, 0, 1)])), False, "rank 1: a Horovod-path job"),
    (GOOD + line(1, [(1, 1, 1)]), True, "rank 1 reported its lanes twice"),
])
def test_a_claim_that_does_not_hold_fails(text, claim, message):
    with pytest.raises(AssertionError, match=message):
        check_lanes(text, claim, range(2))


def test_a_mesh_claim_counts_the_alltoall_mesh_bytes():
    def mesh_line(rank):
        lane = {"bytes_sent": 0, "bytes_received": 0, "collectives": 2, "mesh_bytes_sent": 700,
                "mesh_bytes_received": 650}
        return f"[{rank}]<stdout>:FASTHOROVOD_LANES " + json.dumps(
            {"rank": rank, "planes": [{"rank": rank, "size": 2, "lanes": [lane, lane]}]})
    text = out(mesh_line(0), mesh_line(1))
    check_lanes(text, Lanes(min_bytes=1300, min_collectives=2, mesh=True), range(2))
    with pytest.raises(AssertionError, match="at least 1301 B"):
        check_lanes(text, Lanes(min_bytes=1301, mesh=True), range(2))
    with pytest.raises(AssertionError, match="every lane must move"):
        check_lanes(text, True, range(2))  # a ring claim: the rings moved nothing


def test_the_planes_of_a_rank_add_up_lane_by_lane():
    # a restarted data plane: the first carried lane 0 only, the second lane 1 only
    text = out(line(0, [(700, 700, 1), (0, 0, 0)], [(0, 0, 0), (400, 400, 1)]),
               line(1, [(700, 700, 1), (0, 0, 0)], [(0, 0, 0), (400, 400, 1)]))
    check_lanes(text, Lanes(min_bytes=1100), range(2))
    check_lanes(out(line(0), line(1, [(0, 0, 0)])), False, range(2))  # no proxies, idle lanes: Horovod's path
    check_lanes(out(line(0, [(0, 0, 3)]), line(1, [(0, 0, 3)])), Lanes(min_collectives=3, tcp=False), range(2))


def scenario_line(rank: int, scenario: str, *planes) -> str:
    report = json.loads(line(rank, *planes).split("FASTHOROVOD_LANES ", 1)[1])
    return f"[{rank}]<stdout>:FASTHOROVOD_LANES {json.dumps(dict(report, scenario=scenario))}"


def test_a_shared_job_checks_each_scenario_on_its_own_lines():
    # "a" moved 1100 B, "b" nothing; the job's whole lines hold both
    text = out(scenario_line(0, "a", [(600, 600, 1), (500, 500, 1)]), scenario_line(1, "a", [(600, 600, 1), (500, 500, 1)]),
               scenario_line(0, "b", [(0, 0, 0), (0, 0, 0)]), scenario_line(1, "b", [(0, 0, 0), (0, 0, 0)]),
               line(0, [(600, 600, 1), (500, 500, 1)]), line(1, [(600, 600, 1), (500, 500, 1)]))
    check_lanes(text, Lanes(min_bytes=1100), range(2), scenario="a")
    check_lanes(text, False, range(2), scenario="b")
    check_lanes(text, Lanes(min_bytes=1100), range(2))
    with pytest.raises(AssertionError, match="for scenario b .*every lane must run at least 1"):
        check_lanes(text, True, range(2), scenario="b")
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] printed no lane counters for scenario c"):
        check_lanes(text, True, range(2), scenario="c")


def test_lanes_since_counts_what_each_plane_did_in_between():
    import sys

    from tests.multiproc.harness import REPO
    sys.path.insert(0, str(REPO / "tests" / "workers"))
    try:
        import lanes
    finally:
        sys.path.remove(str(REPO / "tests" / "workers"))

    def plane(*counters):
        return {"rank": 0, "size": 2, "lanes": [dict(zip(lanes.COUNTERS, c)) for c in counters]}
    before = [plane((100, 100, 1, 0, 0))]
    after = [plane((300, 250, 3, 70, 60)), plane((40, 40, 1, 0, 0))]  # the first plane closed, a second started
    assert lanes.since(before, after) == [plane((200, 150, 2, 70, 60)), plane((40, 40, 1, 0, 0))]
