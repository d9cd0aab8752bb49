"""Measure an emulated cloud with iperf3: does one flow get PER_FLOW and many flows the LINK?

``measure_tcp`` runs one iperf3 test between two hosts: a one-off server (``-s -1``) in the
receiving host, a client with ``-P FLOWS`` parallel flows in the sending host, and returns the
goodput the receiver saw (TCP payload only, so a few percent below the shaped wire rate).
``run_check`` brings a network up, measures 1 flow and 8 flows from host0 to host1 and tears it down.
"""

from __future__ import annotations

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
    _require_iperf3()
    server_argv = [
        "iperf3", "--server", "--one-off", "--forceflush", "--bind", server.address, "--port", str(IPERF_PORT),
    ]  # fmt: skip
    client_argv = [
        *exec_prefix(client),
        "iperf3", "--client", server.address, "--port", str(IPERF_PORT),
        "--time", f"{seconds:g}", "--parallel", str(flows), "--json",
    ]  # fmt: skip
    client_timeout = seconds + 20
    with run_in_host(server, server_argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as iperf_server:
        try:
            _wait_until_listening(iperf_server, SERVER_START_TIMEOUT_S)
            try:
                result = subprocess.run(client_argv, capture_output=True, text=True, timeout=client_timeout)
            except subprocess.TimeoutExpired:
                raise NetemError(
                    f"iperf3 client {client.name} -> {server.address} did not finish in {client_timeout:g} s"
                ) from None
        finally:
            iperf_server.kill()
    if result.returncode != 0:
        output = (result.stdout[-2000:] + result.stderr).strip()
        raise NetemError(f"iperf3 client {client.name} -> {server.address} failed: {output}")
    return float(json.loads(result.stdout)["end"]["sum_received"]["bits_per_second"])


def run_check(spec: CloudSpec, prefix: str = DEFAULT_PREFIX, seconds: float = 3.0) -> CheckResult:
    """Bring up ``spec``, measure 1 and ``MANY_FLOWS`` flows host0 -> host1, tear down."""
    if spec.hosts < 2:
        raise ValueError(f"check needs at least 2 hosts, spec {spec} has {spec.hosts}")
    _require_iperf3()
    with EmulatedCloud(spec, prefix) as cloud:
        sender, receiver = cloud.hosts[0], cloud.hosts[1]
        one_flow = measure_tcp(sender, receiver, flows=1, seconds=seconds)
        many_flows = measure_tcp(sender, receiver, flows=MANY_FLOWS, seconds=seconds)
    return CheckResult(spec=spec, one_flow_bits_per_s=one_flow, many_flows_bits_per_s=many_flows)
