"""Tests of the emulated cloud network (fasthorovod.netem).

The spec, shaping and permission tests run anywhere. The ``netem`` tests need root, ``ip netns``,
``tc`` and iperf3; they bring up small networks (prefix ``fhvdtest``), send traffic only between
the namespaces they created, and check afterwards that nothing of theirs is left behind.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import pytest

from tests.netns import skip_unless_usable

from fasthorovod.netem import (
    CloudSpec,
    EmulatedCloud,
    NetemPermissionError,
    cleanup_stale,
    format_rate,
    parse_rate,
    parse_spec,
    run_in_host,
)
from fasthorovod.netem import cloud as cloud_module
from fasthorovod.netem.__main__ import _describe as describe
from fasthorovod.netem.__main__ import main
from fasthorovod.netem.check import CheckResult, PathResult, _measure_pairs, check_paths, measure_mesh, measure_ring, measure_tcp, ring_flows
from fasthorovod.netem.shaping import FIRST_PORT_TABLE, FlowHash, flow_bucket, leaf_classid, shaping_commands
from fasthorovod.netem.state import ETC_NETNS, STATE_DIR, Host, InstanceState, process_running, process_start_ticks

PREFIX = "fhvdtest"
REPO_ROOT = Path(__file__).resolve().parents[1]


# --- spec parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4:1gbit:200mbit", CloudSpec(hosts=4, link_bits_per_s=1e9, per_flow_bits_per_s=2e8)),
        ("2:1GBit:100MBIT", CloudSpec(hosts=2, link_bits_per_s=1e9, per_flow_bits_per_s=1e8)),
        ("1:1000000:500kbit", CloudSpec(hosts=1, link_bits_per_s=1e6, per_flow_bits_per_s=5e5)),
        ("3:1.5gbit:1.5gbit", CloudSpec(hosts=3, link_bits_per_s=1.5e9, per_flow_bits_per_s=1.5e9)),
        (" 8 : 10gbit : 5gbit ", CloudSpec(hosts=8, link_bits_per_s=1e10, per_flow_bits_per_s=5e9)),
    ],
)
def test_parse_spec_accepts_tc_rates(text: str, expected: CloudSpec) -> None:
    assert parse_spec(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("4:1gbit:2gbit", "per-flow rate 2gbit exceeds link rate 1gbit"),
        ("0:1gbit:1mbit", "hosts must be >= 1"),
        ("255:1gbit:1mbit", "<= 254"),
        ("four:1gbit:1mbit", "hosts 'four'"),
        ("4:1gbit", "HOSTS:LINK_RATE:PER_FLOW_RATE"),
        ("4:1gbit:1mbit:9", "HOSTS:LINK_RATE:PER_FLOW_RATE"),
        ("4:fast:1mbit", "link rate"),
        ("4:1gbit:0mbit", "per-flow rate: rate '0mbit' must be greater than zero"),
        ("4:1gbps:1mbit", "bytes/s"),
        ("4:1gbit:1furlong", "unknown unit 'furlong'"),
    ],
)
def test_parse_spec_rejects_bad_specs(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_rates_round_trip() -> None:
    for text in ["1gbit", "200mbit", "1500mbit", "64kbit", "999bit"]:
        assert format_rate(parse_rate(text)) == text
    assert str(parse_spec("4:1gbit:200mbit")) == "4:1gbit:200mbit"


def test_cloud_spec_validates_direct_construction() -> None:
    with pytest.raises(ValueError, match="per-flow rate 2gbit exceeds link rate 1gbit"):
        CloudSpec(hosts=2, link_bits_per_s=1e9, per_flow_bits_per_s=2e9)


UNEVEN = "5:1gbit:200mbit,host1=100mbit,host3=500mbit:150mbit"


def test_uneven_spec_gives_each_host_its_rates() -> None:
    spec = parse_spec(UNEVEN)
    assert spec.overrides == ((1, 1e9, 1e8), (3, 5e8, 1.5e8))
    assert [spec.host_rates(index) for index in range(5)] == [
        (1e9, 2e8), (1e9, 1e8), (1e9, 2e8), (5e8, 1.5e8), (1e9, 2e8),
    ]  # fmt: skip
    assert spec.uneven and not parse_spec("5:1gbit:200mbit").uneven
    assert spec.path_rates(0, 2) == (1e9, 2e8)
    assert spec.path_rates(0, 1) == spec.path_rates(1, 0) == (1e9, 1e8)  # the slower end caps the flow
    assert spec.path_rates(1, 3) == (5e8, 1e8)
    with pytest.raises(IndexError, match="no host5"):
        spec.host_rates(5)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        (UNEVEN, UNEVEN),
        ("5:1gbit:200mbit,host3=500mbit:150mbit,host1=100mbit", UNEVEN),  # overrides sorted by host
        (" 3 : 1gbit : 200mbit , HOST1 = 50Mbit ", "3:1gbit:200mbit,host1=50mbit"),
        ("3:1gbit:200mbit,host1=1gbit:50mbit", "3:1gbit:200mbit,host1=50mbit"),  # the link is the cloud's
        ("3:1gbit:200mbit,host0=2gbit:1gbit", "3:1gbit:200mbit,host0=2gbit:1gbit"),  # a faster host
        ("1:1gbit:200mbit,host0=100mbit:10mbit", "1:1gbit:200mbit,host0=100mbit:10mbit"),
    ],
)
def test_uneven_spec_round_trips(text: str, canonical: str) -> None:
    spec = parse_spec(text)
    assert str(spec) == canonical
    assert parse_spec(str(spec)) == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("5:1gbit:200mbit,host5=100mbit", "'host5=100mbit'.*there is no host5, the 5 hosts are host0..host4"),
        ("1:1gbit:200mbit,host1=100mbit", "there is no host1, the only host is host0"),
        ("5:1gbit:200mbit,host1=100mbit,host1=50mbit", "'host1=50mbit'.*host1 is already set by 'host1=100mbit'"),
        ("5:1gbit:200mbit,host1=2gbit", "'host1=2gbit'.*host1 per-flow rate 2gbit exceeds host1 link rate 1gbit"),
        ("5:1gbit:200mbit,host1=100mbit:200mbit", "host1 per-flow rate 200mbit exceeds host1 link rate 100mbit"),
        ("5:1gbit:200mbit,host1=fast", "'host1=fast'.*host1 per-flow rate: rate 'fast' is not a number"),
        ("5:1gbit:200mbit,host1=1gbps:10mbit", "host1 link rate: .*bytes/s"),
        ("5:1gbit:200mbit,host1=0mbit", "host1 per-flow rate: rate '0mbit' must be greater than zero"),
        ("5:1gbit:200mbit,host1=1gbit:100mbit:10mbit", "'host1=1gbit:100mbit:10mbit' .* has 3 rates"),
        ("5:1gbit:200mbit,h1=100mbit", "'h1' is not a host name hostI .*did you mean host1"),
        ("5:1gbit:200mbit,host01=100mbit", "'host01' is not a host name hostI"),
        ("5:1gbit:200mbit,host1", "'host1' in spec .* must be hostI=PER_FLOW_RATE or hostI=LINK_RATE:PER_FLOW_RATE"),
        ("5:1gbit:200mbit,", "empty part between commas"),
        ("5:1gbit:200mbit,,host1=1mbit", "empty part between commas"),
        ("5:1gbit,host1=1mbit", "HOSTS:LINK_RATE:PER_FLOW_RATE"),
        ("5:1gbit:2gbit,host1=1mbit", "per-flow rate 2gbit exceeds link rate 1gbit"),
    ],
)
def test_uneven_spec_errors_name_the_wrong_part(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_cloud_spec_with_overrides_validates_direct_construction() -> None:
    spec = CloudSpec(hosts=3, link_bits_per_s=1e9, per_flow_bits_per_s=2e8, overrides=[(1, 1e9, 5e7)])
    assert spec == parse_spec("3:1gbit:200mbit,host1=50mbit")
    assert spec.overrides[0].per_flow_bits_per_s == 5e7
    for overrides, message in [
        ([(3, 1e9, 5e7)], "no host3: the hosts are host0..host2"),
        ([(1, 1e9, 5e7), (1, 1e9, 6e7)], "host1 has two overrides"),
        ([(2, 1e8, 2e8)], "host2 per-flow rate 200mbit exceeds host2 link rate 100mbit"),
        ([(2, float("nan"), 2e8)], "host2 link rate must be a positive number"),
    ]:
        with pytest.raises(ValueError, match=message):
            CloudSpec(hosts=3, link_bits_per_s=1e9, per_flow_bits_per_s=2e8, overrides=overrides)


# --- shaping commands and privileges -------------------------------------------------------------


@pytest.mark.parametrize("text, buckets, low_bit, canonical", [
    ("4:1gbit:200mbit,buckets=64", 64, 1, "4:1gbit:200mbit,buckets=64"),
    ("4:1gbit:200mbit, Buckets = 16 ,hashbit=0", 16, 0, "4:1gbit:200mbit,buckets=16,hashbit=0"),
    ("3:1gbit:200mbit,hashbit=2,host1=50mbit", 256, 2, "3:1gbit:200mbit,host1=50mbit,hashbit=2"),
    ("2:1gbit:200mbit,buckets=256,hashbit=1", 256, 1, "2:1gbit:200mbit"),
])
def test_spec_options_choose_the_flow_hash_and_round_trip(text: str, buckets: int, low_bit: int,
                                                          canonical: str) -> None:
    spec = parse_spec(text)
    assert (spec.flow_hash.buckets, spec.flow_hash.low_bit) == (buckets, low_bit)
    assert str(spec) == canonical and parse_spec(str(spec)) == spec


@pytest.mark.parametrize("text, message", [
    ("4:1gbit:200mbit,buckets=50", "buckets must be a power of 4 from 4 to 1024"),
    ("4:1gbit:200mbit,buckets=4096", "got 4096"),
    ("4:1gbit:200mbit,buckets=sixteen", "buckets= in spec .* takes an integer, got 'sixteen'"),
    ("4:1gbit:200mbit,hashbit=13", r"lowest hashed port bit must be 0..12 with 4 bits per port, got 13"),
    ("4:1gbit:200mbit,buckets=16,buckets=64", "sets buckets= twice"),
])
def test_spec_options_errors_name_the_option(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_fewer_buckets_hash_fewer_bits_and_the_shaper_follows() -> None:
    flow_hash = FlowHash.with_buckets(64)  # 3 bits of each port, from bit 1
    assert (flow_hash.source_mask, flow_hash.dest_mask) == (0x000E0000, 0x0000000E)
    assert flow_hash.bucket(0b1010_1, 0b0111_0) == (0b010, 0b111)
    assert flow_hash.bucket(0b1_1010_1, 0b0111_0) == flow_hash.bucket(0b1010_1, 0b0111_0)  # bit 4: not hashed
    lines = shaping_commands("eth0", 1e9, 2e8, flow_hash)
    leaves = {line.split("classid ")[1].split()[0] for line in lines if "ceil 200000000bit" in line}
    assert len(leaves) == 64 and {line.split("flowid ")[1] for line in lines if "flowid" in line} == leaves
    assert any("hashkey mask 0x000e0000 at 20 link 2:" in line for line in lines)
    assert sum("u32 divisor 8" in line for line in lines) == 1 + 8
    # Linux gives connect() even ports: hashing from bit 0 leaves three quarters of the buckets empty
    even_pairs = [(source, dest) for source in range(40000, 40064, 2) for dest in range(5200, 5264, 2)]
    assert len({FlowHash.with_buckets(16).bucket(*pair) for pair in even_pairs}) == 16
    assert len({FlowHash.with_buckets(16, low_bit=0).bucket(*pair) for pair in even_pairs}) == 4


def test_shaper_has_one_capped_leaf_per_bucket() -> None:
    lines = shaping_commands("eth0", 1e9, 2e8)
    leaves = [line for line in lines if "ceil 200000000bit" in line]
    assert len(leaves) == 256
    flowids = {line.split("flowid ")[1] for line in lines if "flowid" in line}
    assert flowids == {line.split("classid ")[1].split()[0] for line in leaves}
    assert any("classid 1:1 htb rate 1000000000bit ceil 1000000000bit" in line for line in lines)


def _caps(lines: list[str], device: str) -> tuple[str, set[str]]:
    """The root class's ceil and the set of leaf ceils that ``lines`` give ``device``."""
    ceils = {
        line.split(" classid ")[1].split()[0]: line.split(" ceil ")[1].split()[0]
        for line in lines
        if line.startswith(f"class add dev {device} ")
    }
    assert len(ceils) == 2 + 256, f"{device}: {len(ceils)} classes"
    return ceils.pop("1:1"), {ceil for classid, ceil in ceils.items() if classid != "1:2"}


def test_uneven_cloud_shapes_each_host_and_its_bridge_port_at_its_own_rates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batches: dict[str, list[str]] = {}  # namespace -> the tc lines run in it

    def record(command: list[str], lines: list[str], timeout: float = 0) -> None:
        assert command[:2] == ["tc", "-n"]
        batches.setdefault(command[2], []).extend(lines)

    monkeypatch.setattr(cloud_module, "_batch", record)
    network = EmulatedCloud("3:1gbit:200mbit,host1=50mbit,host2=500mbit:100mbit", prefix=PREFIX)
    hosts = tuple(Host(name=f"{PREFIX}-abcdef-h{index}", address=f"10.231.9.{index + 1}") for index in range(3))
    network._state = InstanceState(id="abcdef", prefix=PREFIX, spec=str(network.spec), subnet="10.231.9.0/24",
                                   bridge_namespace=f"{PREFIX}-abcdef-br", hosts=hosts, owner_pid=None,
                                   owner_start_ticks=None, created=0.0)  # fmt: skip
    network._shape()
    expected = {0: ("1000000000bit", "200000000bit"), 1: ("1000000000bit", "50000000bit"),
                2: ("500000000bit", "100000000bit")}  # fmt: skip
    for index, (link, per_flow) in expected.items():
        # What host i sends (its eth0) and what it receives (the bridge's port h<i>), both at its rates.
        assert _caps(batches[hosts[index].name], "eth0") == (link, {per_flow})
        assert _caps(batches[network.bridge_namespace], f"h{index}") == (link, {per_flow})
    network._state = None


@pytest.mark.parametrize(
    ("text", "paths"),
    [
        ("4:1gbit:200mbit", [(0, 1)]),
        ("3:1gbit:200mbit,host1=50mbit", [(0, 2), (1, 0), (0, 1)]),
        (UNEVEN, [(0, 2), (1, 0), (0, 1), (3, 0), (0, 3)]),
        ("2:1gbit:200mbit,host1=50mbit", [(1, 0), (0, 1)]),
        ("3:1gbit:200mbit,host0=100mbit,host1=1gbit:50mbit", [(0, 2), (2, 0), (1, 2), (2, 1)]),
        ("2:1gbit:200mbit,host0=100mbit,host1=50mbit", [(0, 1), (1, 0)]),
    ],
)
def test_check_measures_every_overridden_host_both_ways(text: str, paths: list) -> None:
    assert check_paths(parse_spec(text)) == paths


def test_check_judges_each_path_against_its_own_caps() -> None:
    spec = parse_spec("3:1gbit:200mbit,host1=50mbit")
    plain = PathResult(spec, 0, 2, one_flow_bits_per_s=191e6, many_flows_bits_per_s=900e6)
    out_of_slow = PathResult(spec, 1, 0, one_flow_bits_per_s=47.8e6, many_flows_bits_per_s=380e6)
    assert (plain.per_flow_cap, plain.many_flows_cap) == (200e6, 1e9)
    assert (out_of_slow.per_flow_cap, out_of_slow.many_flows_cap) == (50e6, 400e6)  # 8 flows x 50 < link
    assert plain.passed and out_of_slow.passed
    # Flows that share a bucket share its cap: 8 flows in 5 buckets can carry 5 caps, not 8.
    unlucky = PathResult(spec, 0, 1, one_flow_bits_per_s=47.8e6, many_flows_bits_per_s=237e6, many_flows_buckets=5)
    assert unlucky.many_flows_cap == 250e6 and unlucky.passed
    assert "8 flows:    237.0 Mbit/s = 0.95 x 5 x per-flow cap = 250 Mbit/s" in unlucky.report_lines()[1]
    assert PathResult(spec, 0, 2, 191e6, 900e6, many_flows_buckets=4).many_flows_cap == 800e6
    uncapped = PathResult(spec, 0, 1, one_flow_bits_per_s=191e6, many_flows_bits_per_s=900e6)
    assert not uncapped.passed  # 3.8 x the slow host's per-flow cap
    result = CheckResult(spec, (plain, out_of_slow, uncapped))
    report = result.report()
    assert not result.passed and report.endswith("FAIL")
    assert "host1 -> host0, 1 flow:      47.8 Mbit/s = 0.96 x per-flow cap 50 Mbit/s of host1" in report
    assert "host0 -> host1, 1 flow:     191.0 Mbit/s = 3.82 x per-flow cap 50 Mbit/s of host1" in report
    assert "8 flows:    380.0 Mbit/s = 0.95 x 8 x per-flow cap = 400 Mbit/s" in report
    assert "host0 -> host2, 8 flows:    900.0 Mbit/s = 0.90 x link 1000 Mbit/s of host0 and host2" in report
    assert CheckResult(spec, (plain, out_of_slow)).passed
    ring = CheckResult(spec, (plain,), ring_bits_per_s=(330e6, 335e6, 925e6)).report().splitlines()
    assert ring[-4:-1] == [
        "  host0 -> host1:    330.0 Mbit/s = 0.82 x 400 Mbit/s",
        "  host1 -> host2:    335.0 Mbit/s = 0.84 x 400 Mbit/s",
        "  host2 -> host0:    925.0 Mbit/s = 0.93 x 1000 Mbit/s",
    ]


def test_status_lists_each_hosts_rates_on_an_uneven_cloud() -> None:
    hosts = tuple(Host(name=f"{PREFIX}-abcdef-h{index}", address=f"10.231.9.{index + 1}") for index in range(3))
    state = InstanceState(id="abcdef", prefix=PREFIX, spec="3:1gbit:200mbit,host1=50mbit", subnet="10.231.9.0/24",
                          bridge_namespace=f"{PREFIX}-abcdef-br", hosts=hosts, owner_pid=None,
                          owner_start_ticks=None, created=0.0)  # fmt: skip
    lines = describe(state).splitlines()
    assert lines[0].startswith("emulated cloud abcdef: 3:1gbit:200mbit,host1=50mbit,")
    assert lines[2] == f"  {PREFIX}-abcdef-h1\t10.231.9.2\thost1: link 1gbit, per flow 50mbit"
    assert lines[3].endswith("host2: link 1gbit, per flow 200mbit")
    even = describe(InstanceState(**{**state.__dict__, "spec": "3:1gbit:200mbit"})).splitlines()
    assert even[2] == f"  {PREFIX}-abcdef-h1\t10.231.9.2"


def test_a_state_file_with_fields_of_a_newer_version_is_read(tmp_path) -> None:
    """/run/fasthorovod-netem is shared by every checkout on the machine: another version's instance
    (with a field this one does not know) must not make this one's runs fail."""
    hosts = (Host(name=f"{PREFIX}-abcdef-h0", address="10.231.9.1"),)
    state = InstanceState(id="abcdef", prefix=PREFIX, spec="1:1gbit:200mbit", subnet="10.231.9.0/24",
                          bridge_namespace=f"{PREFIX}-abcdef-br", hosts=hosts, owner_pid=1,
                          owner_start_ticks=1, created=0.0)  # fmt: skip
    record = dataclasses.asdict(state)
    record["field_of_a_future_version"] = "10.231.9.254"
    record["hosts"][0]["future"] = True
    path = tmp_path / "abcdef.json"
    path.write_text(json.dumps(record))
    assert InstanceState.read(path) == state


def test_process_start_ticks_survive_a_command_name_with_spaces_and_parentheses(tmp_path) -> None:
    """The command name in /proc/PID/stat is free text: a process named ``a) b (c`` must still give
    its start time, it runs until killed, its zombie does not count as running, and a process that
    is gone gives None."""
    odd = tmp_path / "a) b (c"
    odd.symlink_to("/bin/sleep")
    child = subprocess.Popen([str(odd), "30"])
    try:
        assert process_running(child.pid)
        started = psutil.Process(child.pid).create_time() - psutil.boot_time()
        assert process_start_ticks(child.pid) == round(started * os.sysconf("SC_CLK_TCK")) > 0
        assert process_start_ticks(child.pid) >= process_start_ticks(os.getpid())
        child.kill()
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not process_running(child.pid)  # a zombie until waited for
    finally:
        child.kill()
        child.wait()
    assert not process_running(child.pid) and process_start_ticks(child.pid) is None


def test_flow_bucket_is_what_the_u32_hash_picks() -> None:
    # Bits 1-4 of each port (bit 0 is nearly constant: connect() gets even ports).
    assert flow_bucket(0b1_0110_0, 0b0011_1) == (0b0110, 0b0011)
    assert flow_bucket(36850, 5201) == ((36850 >> 1) % 16, (5201 >> 1) % 16)
    source_bucket, dest_bucket = flow_bucket(36852, 5201)
    lines = shaping_commands("eth0", 1e9, 2e8)
    assert any(f"ht {FIRST_PORT_TABLE + source_bucket:x}:{dest_bucket:x}: " in line
               and line.endswith(f"flowid {leaf_classid(source_bucket, dest_bucket)}") for line in lines)


def test_bad_prefix_is_rejected() -> None:
    with pytest.raises(ValueError, match="prefix"):
        EmulatedCloud("2:1gbit:1mbit", prefix="no-dashes")


def test_cli_rejects_a_bad_spec_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["up", "4:1gbit:2gbit"])
    assert exited.value.code == 2
    assert "per-flow rate 2gbit exceeds link rate 1gbit" in capsys.readouterr().err


def test_unprivileged_up_says_what_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError) as raised:
        EmulatedCloud("2:1gbit:100mbit", prefix=PREFIX).up()
    assert isinstance(raised.value, NetemPermissionError)
    assert "CAP_NET_ADMIN" in str(raised.value) and "loopback" in str(raised.value)


# --- the network itself (root only) --------------------------------------------------------------


netem = skip_unless_usable(("ip", "tc", "iperf3"), f"{PREFIX}probe")


def _leftovers(instance_id: str) -> list[str]:
    """Everything on the machine that belongs to instance ``instance_id``."""
    marker = f"{PREFIX}-{instance_id}-"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True).stdout
    namespaces = [line.split()[0] for line in listed.splitlines() if line.startswith(marker)]
    etc_dirs = [str(path) for path in ETC_NETNS.glob(f"{marker}*")]
    state_files = [str(path) for path in STATE_DIR.glob(f"{instance_id}*")]  # ID.json and the ID/ directory
    processes = _live_processes(marker) + _live_processes(f"{STATE_DIR}/{instance_id}/")  # e.g. its sshd
    return namespaces + etc_dirs + state_files + processes


def _live_processes(pattern: str) -> list[str]:
    """Processes (not zombies) whose command line contains ``pattern``, e.g. an instance's sshd
    (its config path names the instance)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z" and pattern in command and str(os.getpid()) != stat.parent.name:
            found.append(f"pid {stat.parent.name}: {command.strip()}")
    return found


def _cloud_for_the_module(spec: str):
    """An emulated cloud for a module-scoped fixture; afterwards, checks that nothing is left."""
    network = EmulatedCloud(spec, prefix=PREFIX).up()
    instance_id = network.id
    try:
        yield network
    finally:
        network.down()
    assert _leftovers(instance_id) == []


@pytest.fixture(scope="module")
def cloud():
    yield from _cloud_for_the_module("2:200mbit:50mbit")


@netem
@pytest.mark.netem
def test_hosts_reach_each_other_over_tcp_and_resolve_the_hostname(cloud: EmulatedCloud) -> None:
    server, client = cloud.hosts[1], cloud.hosts[0]
    serve = (
        f"import socket; s = socket.create_server(({server.address!r}, 7000)); print('ready', flush=True); "
        "c, _ = s.accept(); c.sendall(socket.gethostbyname(socket.gethostname()).encode())"
    )
    with run_in_host(server, [sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True) as listener:
        try:
            assert listener.stdout.readline().strip() == "ready"
            connect = f"socket.create_connection(({server.address!r}, 7000), timeout=5)"
            fetch = f"import socket; print({connect}.recv(99).decode())"
            answer = subprocess.run(
                [*cloud.exec_prefix(client), sys.executable, "-c", fetch],
                capture_output=True, text=True, timeout=20, check=True,
            )  # fmt: skip
        finally:
            listener.kill()
    assert answer.stdout.strip() == server.address  # the server's hostname resolves to its own address


@netem
@pytest.mark.netem
def test_each_flow_is_capped_but_more_flows_get_more(cloud: EmulatedCloud) -> None:
    sender, receiver = cloud.hosts
    per_flow = cloud.spec.per_flow_bits_per_s
    one_flow = measure_tcp(sender, receiver, flows=1, seconds=2)
    four_flows = measure_tcp(sender, receiver, flows=4, seconds=2)
    assert one_flow <= 1.2 * per_flow, f"1 flow got {one_flow / 1e6:.1f} Mbit/s, cap {per_flow / 1e6:g}"
    assert four_flows >= 1.8 * one_flow, f"4 flows {four_flows / 1e6:.1f} Mbit/s vs 1 flow {one_flow / 1e6:.1f}"
    assert four_flows <= 1.1 * cloud.spec.link_bits_per_s


@netem
@pytest.mark.netem
@pytest.mark.parametrize("measure", [measure_ring, measure_mesh])
def test_ring_and_mesh_measurements_send_both_ways_at_once_within_each_link(cloud: EmulatedCloud, measure) -> None:
    # Two hosts: host0 -> host1 and host1 -> host0 at the same time, each link capped on egress (with
    # two hosts the mesh, every host to every other, is that ring); each host's goodput is what it
    # received in all.
    goodput = measure(cloud.hosts, flows=4, seconds=2)
    assert len(goodput) == 2
    for bits in goodput:
        assert 0.3 * cloud.spec.link_bits_per_s <= bits <= 1.1 * cloud.spec.link_bits_per_s, goodput


@pytest.fixture(scope="module")
def uneven_cloud():
    yield from _cloud_for_the_module("3:1gbit:200mbit,host1=50mbit")


@netem
@pytest.mark.netem
def test_a_slow_host_caps_flows_out_of_it_and_into_it(uneven_cloud: EmulatedCloud) -> None:
    host0, host1, host2 = uneven_cloud.hosts
    for sender, receiver in [(host1, host0), (host0, host1), (host2, host1)]:
        goodput = measure_tcp(sender, receiver, flows=1, seconds=1.5)
        assert 0.7 * 50e6 <= goodput <= 1.2 * 50e6, f"{sender.name} -> {receiver.name}: {goodput / 1e6:.1f} Mbit/s"


@netem
@pytest.mark.netem
def test_the_other_hosts_keep_the_cloud_rates(uneven_cloud: EmulatedCloud) -> None:
    host0, _, host2 = uneven_cloud.hosts
    goodput = measure_tcp(host0, host2, flows=1, seconds=1.5)
    # Not host1's 50 Mbit/s class (a flow of it measures at most 1.2 x 50 = 60 above) and not
    # above the cloud's 200: what one flow reaches below its cap depends on the CPU the machine
    # leaves the TCP stack (105 Mbit/s seen with two busy loops and a test suite running).
    assert 1.5 * 50e6 <= goodput <= 1.2 * 200e6, f"host0 -> host2: {goodput / 1e6:.1f} Mbit/s, cap 200"


def _class_bytes(namespace: str, device: str) -> dict[str, int]:
    """htb class -> bytes sent so far, from ``tc -s class show``."""
    shown = subprocess.run(["tc", "-n", namespace, "-s", "class", "show", "dev", device],
                           capture_output=True, text=True, timeout=10, check=True).stdout  # fmt: skip
    counts, classid = {}, None
    for line in shown.splitlines():
        words = line.split()
        if words[:2] == ["class", "htb"]:
            classid = words[2]
        elif words[:1] == ["Sent"] and classid is not None:
            counts[classid] = int(words[1])
    return counts


@netem
@pytest.mark.netem
def test_the_kernel_puts_a_flow_in_the_bucket_flow_bucket_names(uneven_cloud: EmulatedCloud) -> None:
    sender, receiver = uneven_cloud.hosts[1], uneven_cloud.hosts[0]
    before = _class_bytes(sender.name, "eth0")
    ((_, [(source_port, dest_port)]),) = _measure_pairs([(sender, receiver)], flows=1, seconds=1)
    after = _class_bytes(sender.name, "eth0")
    busiest = max(after, key=lambda classid: (after[classid] - before.get(classid, 0)) if classid != "1:1" else -1)
    assert busiest == leaf_classid(*flow_bucket(source_port, dest_port)), (source_port, dest_port)


@netem
@pytest.mark.netem
def test_a_cloud_with_16_buckets_puts_each_flow_where_its_hash_says() -> None:
    """buckets=16 in the spec: 16 capped leaves per host, and each of 8 flows' bytes land in the
    leaf that FlowHash names for its port pair (so flows collide as the hash predicts)."""
    spec = parse_spec("2:1gbit:200mbit,buckets=16")
    with EmulatedCloud(spec, prefix=PREFIX) as cloud:
        sender, receiver = cloud.hosts
        before = _class_bytes(sender.name, "eth0")
        assert len([c for c in before if c not in ("1:1", "1:2")]) == 16
        ((_, pairs),) = _measure_pairs([(sender, receiver)], flows=8, seconds=1)
        after = _class_bytes(sender.name, "eth0")
    moved = {c for c in after if c not in ("1:1", "1:2") and after[c] - before.get(c, 0) > 100_000}
    assert moved == {spec.flow_hash.classid(*spec.flow_hash.bucket(*ports)) for ports in pairs}, pairs


@netem
@pytest.mark.netem
def test_down_removes_everything_and_is_idempotent() -> None:
    network = EmulatedCloud("3:100mbit:10mbit", prefix=PREFIX).up()
    instance_id = network.id
    # namespaces, hosts files (the launcher's too), state file and directory
    assert len(_leftovers(instance_id)) == 3 + 1 + 3 + 1 + 2
    network.down()
    assert _leftovers(instance_id) == []
    network.down()


SEMAPHORE_JOB = """
import multiprocessing, time
event = multiprocessing.get_context("spawn").Event()  # as Horovod's launcher does, per rank
print(event._flag._semlock.name, event._cond._lock._semlock.name, flush=True)
time.sleep(120)
"""


@netem
@pytest.mark.netem
def test_down_lets_python_clean_up_the_semaphores_of_what_it_kills() -> None:
    """A process in a host (here: as Horovod's launcher) with named multiprocessing semaphores is
    SIGKILLed by down(); its resource tracker, spared for a moment, unlinks them (before: ten
    /dev/shm/sem.mp-* left per killed launcher)."""
    network = EmulatedCloud("2:100mbit:10mbit", prefix=PREFIX).up()
    try:
        proc = run_in_host(network.hosts[0], [sys.executable, "-c", SEMAPHORE_JOB], stdout=subprocess.PIPE, text=True)
        names = proc.stdout.readline().split()
        assert len(names) == 2 and all(Path("/dev/shm/sem." + n.lstrip("/")).exists() for n in names), names
    finally:
        network.down()
    proc.wait(timeout=10)
    assert [n for n in names if Path("/dev/shm/sem." + n.lstrip("/")).exists()] == []


@netem
@pytest.mark.netem
def test_failure_in_the_middle_of_up_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    seen_ids = []

    def fail_while_shaping(network: EmulatedCloud) -> None:
        seen_ids.append(network.id)
        assert _leftovers(network.id) != []  # namespaces exist at this point
        raise RuntimeError("injected failure")

    monkeypatch.setattr(EmulatedCloud, "_shape", fail_while_shaping)
    network = EmulatedCloud("2:100mbit:10mbit", prefix=PREFIX)
    with pytest.raises(RuntimeError, match="injected failure"):
        network.up()
    assert not network.is_up
    assert _leftovers(seen_ids[0]) == []
    network.down()


def _killed_owners_network(spec: str) -> str:
    """The id of a network brought up by a process that was then SIGKILLed (so never taken down)."""
    bring_up = (
        "import time; from fasthorovod.netem import EmulatedCloud; "
        f"print(EmulatedCloud({spec!r}, prefix={PREFIX!r}).up().id, flush=True); time.sleep(60)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with subprocess.Popen([sys.executable, "-c", bring_up], stdout=subprocess.PIPE, text=True, env=env) as owner:
        try:
            instance_id = owner.stdout.readline().strip()
        finally:
            owner.send_signal(signal.SIGKILL)
    assert instance_id and _leftovers(instance_id) != []
    return instance_id


@netem
@pytest.mark.netem
def test_cleanup_stale_removes_a_killed_owners_network() -> None:
    instance_id = _killed_owners_network("2:100mbit:10mbit")
    assert instance_id in cleanup_stale(PREFIX)
    assert _leftovers(instance_id) == []


@netem
@pytest.mark.netem
def test_two_clouds_brought_up_at_once_remove_a_dead_runs_leftovers_once() -> None:
    """Both up() calls find the same killed owner's network; one removes it while the other waits,
    and neither fails for it (before: both deleted the same namespaces, and both jobs failed)."""
    stale_id = _killed_owners_network("3:100mbit:10mbit")
    networks = [EmulatedCloud("2:100mbit:10mbit", prefix=PREFIX) for _ in range(2)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a failed removal would only warn
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                list(pool.map(EmulatedCloud.up, networks))  # re-raises the first failure
        assert all(network.is_up for network in networks) and networks[0].id != networks[1].id
        assert _leftovers(stale_id) == []
    finally:
        for network in networks:
            network.down()


# --- launcher, ssh, host discovery and spot preemption (root only) ----------------------------------


netem_ssh = skip_unless_usable(("ip", "tc", "ssh", "ssh-keygen", "/usr/sbin/sshd"), f"{PREFIX}probe")


def _in(namespace: str, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", namespace, "sh", "-c", command],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _discovered(network: EmulatedCloud) -> list[str]:
    return subprocess.run([network.discovery_script], capture_output=True, text=True, timeout=10,
                          check=True).stdout.split()  # fmt: skip


@netem_ssh
@pytest.mark.netem
def test_ssh_cloud_reaches_every_host_from_the_launcher_and_leaves_nothing() -> None:
    home_ssh = Path.home() / ".ssh"
    home_before = sorted(home_ssh.iterdir()) if home_ssh.exists() else None
    network = EmulatedCloud("3:200mbit:50mbit", prefix=PREFIX, ssh=True, slots_per_host=2).up()
    instance_id = network.id
    try:
        state_dir = STATE_DIR / instance_id
        assert (state_dir / "ssh" / "host_key").exists() and network.identity_file.startswith(str(state_dir))
        for index, host in enumerate(network.hosts):
            # as horovodrun does it: ssh -o StrictHostKeyChecking=no HOST COMMAND, from the launcher
            answer = _in(network.launcher_namespace,
                         f"ssh -o PasswordAuthentication=no -o StrictHostKeyChecking=no host{index} "
                         "'echo $SSH_CONNECTION; getent hosts $(hostname) host0'")
            assert answer.returncode == 0, answer.stderr
            lines = answer.stdout.splitlines()
            assert lines[0].split()[0] == network.launcher_address and lines[0].split()[2] == host.address
            assert lines[1].split()[0] == host.address  # the machine's hostname is the host itself there
            assert lines[2].split()[0] == network.hosts[0].address
        # hosts reach each other too (mpirun's tree spawn does that)
        assert _in(network.hosts[0].name, "ssh host2 true").returncode == 0
        assert _discovered(network) == ["host0:2", "host1:2", "host2:2"]
        assert _live_processes(f"{STATE_DIR}/{instance_id}/ssh/sshd_config")  # 3 daemons
    finally:
        network.down()
    assert _leftovers(instance_id) == []
    assert (sorted(home_ssh.iterdir()) if home_ssh.exists() else None) == home_before  # ~/.ssh untouched


@netem_ssh
@pytest.mark.netem
def test_hosts_go_away_gracefully_or_abruptly_and_come_back() -> None:
    network = EmulatedCloud("3:200mbit:50mbit", prefix=PREFIX, ssh=True).up()
    instance_id = network.id
    try:
        host1 = network.hosts[1]
        sleepers = [run_in_host(host1, ["sleep", "300"]) for _ in range(2)]
        # Graceful: only what the discovery script prints changes.
        assert main(["host-down", instance_id, "host1"]) == 0
        assert _discovered(network) == ["host0:1", "host2:1"]
        assert all(sleeper.poll() is None for sleeper in sleepers) and network.link_up(1)
        assert main(["host-up", instance_id, "1"]) == 0
        assert _discovered(network) == ["host0:1", "host1:1", "host2:1"]
        # Abrupt: link cut, every process in the host killed (its sshd too), unlisted.
        assert main(["host-down", instance_id, host1.name, "--abrupt"]) == 0
        assert [sleeper.wait(timeout=10) for sleeper in sleepers] == [-signal.SIGKILL] * 2
        listed = subprocess.run(["ip", "netns", "pids", host1.name], capture_output=True, text=True, timeout=10)
        assert listed.stdout.split() == []
        assert not network.link_up(1)
        assert "NO-CARRIER" in _in(host1.name, "ip link show eth0").stdout  # the host's side sees the cut
        assert _discovered(network) == ["host0:1", "host2:1"]
        unreachable = _in(network.launcher_namespace, "ssh -o ConnectTimeout=2 host1 true")
        assert unreachable.returncode == 255
        assert _in(network.launcher_namespace, "ssh host2 true").returncode == 0  # the others are unaffected
        # Back: link up, sshd running again, listed, still shaped.
        assert main(["host-up", instance_id, "host1"]) == 0
        assert network.link_up(1) and _discovered(network) == ["host0:1", "host1:1", "host2:1"]
        assert _in(network.launcher_namespace, "ssh host1 hostname -I").stdout.split() == [host1.address]
        shaper = subprocess.run(["tc", "-n", network.bridge_namespace, "class", "show", "dev", "h1"],
                                capture_output=True, text=True, timeout=10).stdout  # fmt: skip
        assert shaper.count("ceil 50Mbit") == 256
    finally:
        network.down()
    assert _leftovers(instance_id) == []


def test_status_names_the_launcher_ssh_and_discovery() -> None:
    hosts = tuple(Host(name=f"{PREFIX}-abcdef-h{index}", address=f"10.231.9.{index + 1}") for index in range(2))
    state = InstanceState(id="abcdef", prefix=PREFIX, spec="2:1gbit:200mbit", subnet="10.231.9.0/24",
                          bridge_namespace=f"{PREFIX}-abcdef-br", hosts=hosts, owner_pid=None,
                          owner_start_ticks=None, created=0.0, launcher_address="10.231.9.254", ssh=True)  # fmt: skip
    text = describe(state)
    assert f"bridge namespace {PREFIX}-abcdef-br, launcher address 10.231.9.254 (eth0)" in text
    assert f"identity file {STATE_DIR}/abcdef/ssh/id_ed25519" in text
    assert f"host discovery script {STATE_DIR}/abcdef/discover-hosts" in text


def test_the_ring_test_sends_enough_flows_to_fill_the_links_through_their_per_flow_caps():
    # 3 x ceil(link / per-flow) of the hop that needs the most, at least 8, at most 64
    assert ring_flows(parse_spec("4:1gbit:200mbit")) == 15
    assert ring_flows(parse_spec("3:1gbit:100mbit")) == 30       # 8 flows would carry at most 0.8 Gbit/s
    assert ring_flows(parse_spec("5:800mbit:200mbit")) == 12
    assert ring_flows(parse_spec("2:1gbit:1gbit")) == 8
    assert ring_flows(parse_spec("5:1gbit:200mbit,host3=100mbit")) == 30  # the slow host's hops decide
    assert ring_flows(parse_spec("2:10gbit:100mbit")) == 64
    result = CheckResult(spec=parse_spec("3:1gbit:100mbit"), paths=(), ring_bits_per_s=(9e8, 9e8, 9e8), ring_flows=30)
    assert "with 30 flows at once" in result.report()
