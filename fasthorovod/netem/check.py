"""Measure an emulated cloud with iperf3: does one flow get PER_FLOW and many flows the LINK?

``measure_tcp`` runs one iperf3 test between two hosts: a one-off server (``-s -1``) in the
receiving host, a client with ``-P FLOWS`` parallel flows in the sending host, and returns the
goodput the receiver saw (TCP payload only, so a few percent below the shaped wire rate).
``measure_ring`` runs every host's client at once, host i sending to host i+1 (the traffic of a
ring allreduce), and returns each receiver's goodput: the most any ring collective can reach on
this emulation *on this machine*, where the namespaces' packets share the host's CPUs.
``run_check`` brings a network up, measures 1 flow and 8 flows from host0 to host1 (and, with
``ring=True``, the ring) and tears it down.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import subprocess
import time
from dataclasses import dataclass

from .cloud import DEFAULT_PREFIX, EmulatedCloud, exec_prefix, run_in_host
from .errors import NetemError
from .spec import CloudSpec
from .state import Host

IPERF_PORT = 5201
SERVER_START_TIMEOUT_S = 10.0
ONE_FLOW_BOUNDS = (0.75, 1.1)  # accepted 1-flow goodput, as fractions of PER_FLOW
MANY_FLOWS = 8
MANY_FLOWS_MIN = 0.6  # accepted 8-flow goodput, as a fraction of LINK


@dataclass(frozen=True)
class CheckResult:
    spec: CloudSpec
    one_flow_bits_per_s: float
    many_flows_bits_per_s: float
    ring_bits_per_s: tuple = ()  # per receiving host, when measured (informational, not judged)

    @property
    def one_flow_ratio(self) -> float:
        return self.one_flow_bits_per_s / self.spec.per_flow_bits_per_s

    @property
    def many_flows_ratio(self) -> float:
        return self.many_flows_bits_per_s / self.spec.link_bits_per_s

    @property
    def passed(self) -> bool:
        low, high = ONE_FLOW_BOUNDS
        return low <= self.one_flow_ratio <= high and self.many_flows_ratio >= MANY_FLOWS_MIN

    def report(self) -> str:
        low, high = ONE_FLOW_BOUNDS
        return "\n".join(
            [
                f"spec {self.spec}",
                f"1 flow:  {self.one_flow_bits_per_s / 1e6:8.1f} Mbit/s = {self.one_flow_ratio:.2f} x per-flow cap"
                f" {self.spec.per_flow_bits_per_s / 1e6:g} Mbit/s (want {low}-{high} x)",
                f"{MANY_FLOWS} flows: {self.many_flows_bits_per_s / 1e6:8.1f} Mbit/s = {self.many_flows_ratio:.2f}"
                f" x link {self.spec.link_bits_per_s / 1e6:g} Mbit/s (want >= {MANY_FLOWS_MIN} x)",
                *(
                    [
                        f"ring, every host -> next with {MANY_FLOWS} flows at once: mean"
                        f" {sum(self.ring_bits_per_s) / len(self.ring_bits_per_s) / 1e6:.1f} Mbit/s per host"
                        f" (min {min(self.ring_bits_per_s) / 1e6:.1f}) = "
                        f"{sum(self.ring_bits_per_s) / len(self.ring_bits_per_s) / self.spec.link_bits_per_s:.2f}"
                        " x link: the ceiling of a ring allreduce on this machine"
                    ]
                    if self.ring_bits_per_s
                    else []
                ),
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
    (goodput,) = _measure_pairs([(client, server)], flows, seconds)
    return goodput


def measure_ring(hosts: list, flows: int = MANY_FLOWS, seconds: float = 2.0) -> list:
    """Goodput in bit/s received by each host while every host i sends ``flows`` flows to host i+1."""
    return _measure_pairs([(hosts[i], hosts[(i + 1) % len(hosts)]) for i in range(len(hosts))], flows, seconds)


def _measure_pairs(pairs: list, flows: int, seconds: float) -> list:
    """Runs one iperf3 test per (client, server) pair, all at the same time; each receiver's goodput."""
    _require_iperf3()
    client_timeout = seconds + 20
    with contextlib.ExitStack() as stack:
        for _, server in pairs:
            server_argv = [
                "iperf3", "--server", "--one-off", "--forceflush", "--bind", server.address, "--port", str(IPERF_PORT),
            ]  # fmt: skip
            iperf_server = stack.enter_context(
                run_in_host(server, server_argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            )
            stack.callback(iperf_server.kill)
            _wait_until_listening(iperf_server, SERVER_START_TIMEOUT_S)
        clients = []
        for client, server in pairs:
            client_argv = [
                *exec_prefix(client),
                "iperf3", "--client", server.address, "--port", str(IPERF_PORT),
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
            results.append(float(json.loads(out)["end"]["sum_received"]["bits_per_second"]))
    return results


def run_check(spec: CloudSpec, prefix: str = DEFAULT_PREFIX, seconds: float = 3.0, ring: bool = False) -> CheckResult:
    """Bring up ``spec``, measure 1 and ``MANY_FLOWS`` flows host0 -> host1 (and the ring), tear down."""
    if spec.hosts < 2:
        raise ValueError(f"check needs at least 2 hosts, spec {spec} has {spec.hosts}")
    _require_iperf3()
    with EmulatedCloud(spec, prefix) as cloud:
        sender, receiver = cloud.hosts[0], cloud.hosts[1]
        one_flow = measure_tcp(sender, receiver, flows=1, seconds=seconds)
        many_flows = measure_tcp(sender, receiver, flows=MANY_FLOWS, seconds=seconds)
        ring_goodput = tuple(measure_ring(cloud.hosts, MANY_FLOWS, seconds)) if ring else ()
    return CheckResult(spec=spec, one_flow_bits_per_s=one_flow, many_flows_bits_per_s=many_flows,
                       ring_bits_per_s=ring_goodput)
