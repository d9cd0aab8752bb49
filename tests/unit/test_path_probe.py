"""The worker's end of the path probe (``_C.PathProbe``, csrc/transport/probe.h) over loopback, and
which of the next rank's probe ports its flows go to (fasthorovod/proxy/startup.py)."""
import threading

import pytest

from fasthorovod import _C
from fasthorovod.proxy.startup import probe_ports

TOKEN = b"k" * 16


def quick(max_flows):
    options = _C.ProbeOptions()
    options.max_flows, options.warmup_seconds, options.measure_seconds = max_flows, 0.01, 0.03
    return options


def test_a_probe_listens_on_eight_ports():
    ports = _C.PathProbe("127.0.0.1", TOKEN, 0, 2, 1).ports
    assert len(ports) == len(set(ports)) == 8 and all(p > 0 for p in ports)


def test_the_flows_go_to_as_many_ports_as_the_planned_lanes_listen_on():
    ports = list(range(9000, 9008))
    assert probe_ports(ports, lanes=4) == ports  # two per lane
    assert probe_ports(ports, lanes=2) == ports[:4]
    assert probe_ports(ports, lanes=1) == ports[:2]
    assert probe_ports(ports, lanes=16) == ports  # no more than it has
    assert probe_ports(ports[:1], lanes=4) == ports[:1]


def test_two_ranks_measure_each_others_hop_over_several_ports():
    probes = [_C.PathProbe("127.0.0.1", TOKEN, r, 2, 1) for r in range(2)]
    results, errors = [None, None], []

    def run(r):
        try:
            results[r] = probes[r].run("127.0.0.1", probe_ports(probes[1 - r].ports, lanes=2), quick(4), 20.0)
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for phases in results:
        assert [p["flows"] for p in phases][:2] == [1, 2]
        assert all(p["bytes_per_second"] > 0 and len(p["flow_bytes_per_second"]) == p["flows"] for p in phases)


@pytest.mark.parametrize("ports", [[], list(range(9000, 9009))])
def test_a_wrong_number_of_next_ports_is_refused_by_name(ports):
    with pytest.raises(ValueError, match="next_ports"):
        _C.PathProbe("127.0.0.1", TOKEN, 0, 2, 1).run("127.0.0.1", ports, quick(2), 1.0)
