"""Measure an emulated cloud with iperf3: does one flow get PER_FLOW and many flows the LINK?

``measure_tcp`` runs one iperf3 test between two hosts: a one-off server (``-s -1``) in the
receiving host, a client with ``-P FLOWS`` parallel flows in the sending host, and returns the
goodput the receiver saw (TCP payload only, so a few percent below the shaped wire rate).
``measure_ring`` runs every host's client at once, host i sending to host i+1 (the traffic of a
ring allreduce), and returns each receiver's goodput: the most any ring collective can reach on
this emulation *on this machine*, where the namespaces' packets share the host's CPUs.
``run_check`` brings a network up, measures 1 flow and 8 flows on each of the ``check_paths``
(and, with ``ring=True``, the ring) and tears it down.

Which paths: on an even cloud, host0 -> host1. On an uneven one (per-host overrides), also every
overridden host in both directions, against the host with the highest per-flow cap among the
others, so that what limits the path is the overridden host's own rates (out of it: its ``eth0``;
into it: the bridge's port toward it). Hosts without overrides are all alike; two of them, when
there are two, stand for the rest. Each path is judged against its own expected caps,
``CloudSpec.path_rates``: one flow against the smaller per-flow cap of its two ends, 8 flows
against the smaller of the path's link and one per-flow cap per flow bucket the 8 flows hashed into
(``CloudSpec.flow_hash`` of the ports iperf3 reports; flows in one bucket share its cap, and when
per-flow caps rather than the link limit a path, as on a slow host, that decides what 8 flows get).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import shutil
import subprocess
import time
from dataclasses import dataclass

from .cloud import DEFAULT_PREFIX, EmulatedCloud, exec_prefix, run_in_host
from .errors import NetemError
from .shaping import DEFAULT_HASH, FlowHash
from .spec import CloudSpec
from .state import Host

IPERF_PORT = 5201
SERVER_START_TIMEOUT_S = 10.0
ONE_FLOW_BOUNDS = (0.75, 1.1)  # accepted 1-flow goodput, as fractions of the path's per-flow cap
MANY_FLOWS = 8
MANY_FLOWS_MIN = 0.6  # accepted 8-flow goodput, as a fraction of the path's min(link, buckets x per-flow cap)


def check_paths(spec: CloudSpec) -> list[tuple[int, int]]:
    """The (sender, receiver) host indices ``run_check`` measures for ``spec`` (see the module docstring)."""
    if spec.hosts < 2:
        raise ValueError(f"check needs at least 2 hosts, spec {spec} has {spec.hosts}")
    default_rates = (spec.link_bits_per_s, spec.per_flow_bits_per_s)
    plain = [index for index in range(spec.hosts) if spec.host_rates(index) == default_rates]
    overridden = [index for index in range(spec.hosts) if index not in plain]
    paths = [(plain[0], plain[1])] if len(plain) >= 2 else []
    for index in overridden:
        others = [other for other in range(spec.hosts) if other != index]
        partner = max(others, key=lambda other: (spec.host_rates(other)[1], spec.host_rates(other)[0], -other))
        paths += [path for path in ((index, partner), (partner, index)) if path not in paths]
    return paths


@dataclass(frozen=True)
class PathResult:
    """1 flow and ``MANY_FLOWS`` flows from host ``sender`` to host ``receiver``, against that path's caps."""

    spec: CloudSpec
    sender: int
    receiver: int
    one_flow_bits_per_s: float
    many_flows_bits_per_s: float
    many_flows_buckets: int = MANY_FLOWS  # distinct flow buckets the MANY_FLOWS flows hashed into

    @property
    def per_flow_cap(self) -> float:
        return self.spec.path_rates(self.sender, self.receiver)[1]

    @property
    def many_flows_cap(self) -> float:
        """The most the flows can get: the path's link, or one per-flow cap per bucket they occupy."""
        link, per_flow = self.spec.path_rates(self.sender, self.receiver)
        return min(link, self.many_flows_buckets * per_flow)

    @property
    def one_flow_ratio(self) -> float:
        return self.one_flow_bits_per_s / self.per_flow_cap

    @property
    def many_flows_ratio(self) -> float:
        return self.many_flows_bits_per_s / self.many_flows_cap

    @property
    def passed(self) -> bool:
        low, high = ONE_FLOW_BOUNDS
        return low <= self.one_flow_ratio <= high and self.many_flows_ratio >= MANY_FLOWS_MIN

    def _whose(self, rate_index: int, cap: float) -> str:
        """On an uneven cloud, which end of the path sets ``cap`` (" of host1"), else ""."""
        if not self.spec.uneven:
            return ""
        ends = [f"host{end}" for end in (self.sender, self.receiver) if self.spec.host_rates(end)[rate_index] == cap]
        return f" of {' and '.join(ends)}" if ends else ""

    def report_lines(self) -> list[str]:
        low, high = ONE_FLOW_BOUNDS
        link, per_flow = self.spec.path_rates(self.sender, self.receiver)
        buckets = self.many_flows_buckets
        if link <= buckets * per_flow:
            many_cap = f"link {link / 1e6:g} Mbit/s{self._whose(0, link)}"
        else:
            many_cap = f"{buckets} x per-flow cap = {buckets * per_flow / 1e6:g} Mbit/s"
        path = f"host{self.sender} -> host{self.receiver}"
        return [
            f"{path}, 1 flow:  {self.one_flow_bits_per_s / 1e6:8.1f} Mbit/s = {self.one_flow_ratio:.2f} x per-flow cap"
            f" {per_flow / 1e6:g} Mbit/s{self._whose(1, per_flow)} (want {low}-{high} x)",
            f"{path}, {MANY_FLOWS} flows: {self.many_flows_bits_per_s / 1e6:8.1f} Mbit/s = {self.many_flows_ratio:.2f}"
            f" x {many_cap} (want >= {MANY_FLOWS_MIN} x; {buckets} flow buckets)",
        ]


@dataclass(frozen=True)
class CheckResult:
    spec: CloudSpec
    paths: tuple[PathResult, ...]
    ring_bits_per_s: tuple = ()  # host i -> host i+1 for each i, when measured (informational, not judged)
    ring_flows: int = MANY_FLOWS  # flows each host sent in that test (ring_flows(spec))

    @property
    def passed(self) -> bool:
        return all(path.passed for path in self.paths)

    def _ring_lines(self) -> list[str]:
        if not self.ring_bits_per_s:
            return []
        goodput = self.ring_bits_per_s
        mean = sum(goodput) / len(goodput)
        if not self.spec.uneven:
            return [
                f"ring, every host -> next with {self.ring_flows} flows at once: mean {mean / 1e6:.1f} Mbit/s per host"
                f" (min {min(goodput) / 1e6:.1f}) = {mean / self.spec.link_bits_per_s:.2f}"
                " x link: the ceiling of a ring allreduce on this machine"
            ]
        lines = [f"ring, every host -> next with {self.ring_flows} flows at once (the ceiling of a ring allreduce here):"]
        for sender, bits in enumerate(goodput):  # measure_ring's pair i is host i -> host i+1
            receiver = (sender + 1) % len(goodput)
            link, per_flow = self.spec.path_rates(sender, receiver)
            cap = min(link, self.ring_flows * per_flow)
            lines.append(
                f"  host{sender} -> host{receiver}: {bits / 1e6:8.1f} Mbit/s = {bits / cap:.2f} x {cap / 1e6:g} Mbit/s"
            )
        return lines

    def report(self) -> str:
        return "\n".join(
            [
                f"spec {self.spec}",
                *(line for path in self.paths for line in path.report_lines()),
                *self._ring_lines(),
                "PASS" if self.passed else "FAIL",
            ]
        )


def _require_iperf3() -> None:
    if shutil.which("iperf3") is None:
        raise NetemError("iperf3 not found on PATH; install it (apt-get install iperf3) to measure the network")


def _wait_until_listening(server: subprocess.Popen[bytes], timeout: float) -> None:
    """Read the server's output until it says it listens (it prints that before accepting)."""
    assert server.stdout is not None
    deadline = time.monotonic() + timeout
    output = b""
    with selectors.DefaultSelector() as selector:
        selector.register(server.stdout, selectors.EVENT_READ)
        while b"Server listening" not in output:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                raise NetemError(f"iperf3 server did not start listening within {timeout:g} s: {output!r}")
            chunk = os.read(server.stdout.fileno(), 4096)
            if not chunk:
                raise NetemError(f"iperf3 server exited before listening (exit code {server.wait()}): {output!r}")
            output += chunk


def measure_tcp(client: Host, server: Host, flows: int = 1, seconds: float = 2.0) -> float:
    """Goodput in bit/s of ``flows`` parallel TCP flows from ``client`` to ``server`` (iperf3)."""
    goodput, _ = measure_tcp_buckets(client, server, flows, seconds)
    return goodput


def measure_tcp_buckets(client: Host, server: Host, flows: int = 1, seconds: float = 2.0,
                        flow_hash: FlowHash = DEFAULT_HASH) -> tuple[float, int]:
    """``measure_tcp``, and into how many of the shaper's flow buckets (hashed by `flow_hash`, the
    cloud's) the flows went: each bucket has one per-flow cap, so ``flows`` flows can carry at
    most that many caps' worth."""
    ((goodput, port_pairs),) = _measure_pairs([(client, server)], flows, seconds)
    return goodput, len({flow_hash.bucket(*ports) for ports in port_pairs})


def ring_flows(spec: CloudSpec) -> int:
    """Flows each host sends in the ring test of ``spec``: enough to fill the fullest link through
    its per-flow caps, with room for flows that share a flow bucket (consecutive ports often do):
    3 x ceil(link / per-flow cap) of the host that needs the most, at least MANY_FLOWS, at most 64.
    8 flows cannot fill a 1 Gbit/s link capped at 100 Mbit/s per flow; 30 can."""
    hops = [spec.path_rates(i, (i + 1) % spec.hosts) for i in range(spec.hosts)]
    need = max(math.ceil(link / per_flow) for link, per_flow in hops)
    return min(64, max(MANY_FLOWS, 3 * need))


def measure_ring(hosts: list, flows: int = MANY_FLOWS, seconds: float = 2.0) -> list:
    """Goodput in bit/s received by each host while every host i sends ``flows`` flows to host i+1."""
    pairs = [(hosts[i], hosts[(i + 1) % len(hosts)]) for i in range(len(hosts))]
    return [goodput for goodput, _ in _measure_pairs(pairs, flows, seconds)]


def measure_mesh(hosts: list, flows: int = MANY_FLOWS, seconds: float = 2.0) -> list:
    """Goodput in bit/s received by each host while every host sends ``flows`` flows to every other
    host at once (the traffic pattern of an alltoall)."""
    pairs = [(hosts[i], hosts[j]) for i in range(len(hosts)) for j in range(len(hosts)) if i != j]
    received = [0.0] * len(hosts)
    for (_, server), (goodput, _) in zip(pairs, _measure_pairs(pairs, flows, seconds)):
        received[hosts.index(server)] += goodput
    return received


def _measure_pairs(pairs: list, flows: int, seconds: float) -> list:
    """Runs one iperf3 test per (client, server) pair, all at the same time (pair i's server on port
    IPERF_PORT + i); for each, the receiver's goodput and the (client port, server port) of every flow."""
    _require_iperf3()
    client_timeout = seconds + 20
    with contextlib.ExitStack() as stack:
        for i, (_, server) in enumerate(pairs):
            server_argv = [
                "iperf3", "--server", "--one-off", "--forceflush", "--bind", server.address,
                "--port", str(IPERF_PORT + i),
            ]  # fmt: skip
            iperf_server = stack.enter_context(
                run_in_host(server, server_argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            )
            stack.callback(iperf_server.kill)
            _wait_until_listening(iperf_server, SERVER_START_TIMEOUT_S)
        clients = []
        for i, (client, server) in enumerate(pairs):
            client_argv = [
                *exec_prefix(client),
                "iperf3", "--client", server.address, "--port", str(IPERF_PORT + i),
                "--time", f"{seconds:g}", "--parallel", str(flows), "--json",
            ]  # fmt: skip
            proc = subprocess.Popen(client_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            stack.callback(proc.wait)
            stack.callback(proc.kill)  # runs first (last in, first out)
            clients.append(proc)
        results = []
        for (client, server), proc in zip(pairs, clients):
            try:
                out, err = proc.communicate(timeout=client_timeout)
            except subprocess.TimeoutExpired:
                raise NetemError(
                    f"iperf3 client {client.name} -> {server.address} did not finish in {client_timeout:g} s"
                ) from None
            if proc.returncode != 0:
                raise NetemError(f"iperf3 client {client.name} -> {server.address} failed: {(out[-2000:] + err).strip()}")
            report = json.loads(out)
            port_pairs = [(flow["local_port"], flow["remote_port"]) for flow in report["start"]["connected"]]
            results.append((float(report["end"]["sum_received"]["bits_per_second"]), port_pairs))
    return results


def run_check(spec: CloudSpec, prefix: str = DEFAULT_PREFIX, seconds: float = 3.0, ring: bool = False) -> CheckResult:
    """Bring up ``spec``, measure 1 and ``MANY_FLOWS`` flows on each of ``check_paths(spec)`` (and the
    ring), tear down."""
    paths = check_paths(spec)
    _require_iperf3()
    results = []
    with EmulatedCloud(spec, prefix) as cloud:
        for sender, receiver in paths:
            client, server = cloud.hosts[sender], cloud.hosts[receiver]
            one_flow = measure_tcp(client, server, flows=1, seconds=seconds)
            many_flows, buckets = measure_tcp_buckets(client, server, MANY_FLOWS, seconds, spec.flow_hash)
            results.append(PathResult(spec, sender, receiver, one_flow, many_flows, buckets))
        flows = ring_flows(spec)
        ring_goodput = tuple(measure_ring(cloud.hosts, flows, seconds)) if ring else ()
    return CheckResult(spec=spec, paths=tuple(results), ring_bits_per_s=ring_goodput, ring_flows=flows)
