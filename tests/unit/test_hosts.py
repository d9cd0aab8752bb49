"""Where the ranks are (fasthorovod/proxy/hosts.py): hosts, local ranks, the ring across hosts and
whether the hierarchical allreduce applies."""
from fasthorovod.proxy import hosts


def test_hosts_in_order_of_their_lowest_rank_and_local_ranks_in_rank_order():
    addresses = ["10.0.0.2", "10.0.0.1", "10.0.0.2", "10.0.0.1"]
    layout = hosts.layout(addresses, 3)
    assert layout.hosts == [[0, 2], [1, 3]]
    assert (layout.host_index, layout.local_rank, layout.local_size, layout.num_hosts) == (1, 1, 2, 2)
    assert layout.why_flat() is None
    assert layout.describe() == "2 hosts x 2 ranks"


def test_the_ring_across_hosts_joins_the_same_local_rank_of_every_host():
    addresses = [f"h{r // 3}" for r in range(9)]  # 3 hosts x 3 ranks, blocks
    nexts = [hosts.layout(addresses, r).ring_next() for r in range(9)]
    assert nexts == [3, 4, 5, 6, 7, 8, 0, 1, 2]
    # every local rank's ring is one cycle through the hosts
    for start in range(3):
        seen, r = [], start
        for _ in range(3):
            seen.append(r)
            r = nexts[r]
        assert r == start and len({hosts.layout(addresses, x).host_index for x in seen}) == 3


def test_one_host_is_a_ring_of_one():
    layout = hosts.layout(["a"] * 4, 2)
    assert (layout.num_hosts, layout.local_rank, layout.ring_next()) == (1, 2, 2)
    assert layout.why_flat() is None


def test_when_it_does_not_apply_it_says_why():
    assert "different numbers of ranks (1, 2)" in hosts.layout(["a", "a", "b"], 0).why_flat()
    assert "one rank" in hosts.layout(["a", "b", "c"], 0).why_flat()
    many = hosts.layout(["a"] * (hosts.MAX_LOCAL_RANKS + 1), 0)
    assert f"more than the {hosts.MAX_LOCAL_RANKS}" in many.why_flat()
