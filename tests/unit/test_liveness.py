"""A rank whose host vanishes without a FIN or RST (a preempted instance, a cut link) while the
negotiation waits for it is reported within about FASTHOROVOD_TIMEOUT_SECONDS, as a dead Gloo peer
is under Horovod: the negotiation's connections carry TCP keepalives and TCP_USER_TIMEOUT
(csrc/transport/socket.h, EnableLiveness). Without them the coordinator waited forever (an elastic
job on the emulated cloud hung when a host was preempted between two submissions).

Two network namespaces joined by a veth pair: the coordinator in one, two members that hold the
token in the other. Once everyone is connected and idle, the members' side of the link goes down
(nothing gets out: no FIN, no RST), as the emulated cloud's `host-down --abrupt` does."""
import os
import re
import subprocess
import sys
import time

from fasthorovod.netem._command import run_command
from tests.netns import skip_unless_usable

pytestmark = skip_unless_usable(("ip",), "fhvdliveprobe")

COORDINATOR = r"""
import os, sys, time
from fasthorovod import _C
from fasthorovod.proxy.core import native
c = _C.Coordinator(native(_C.CoordinatorOptions, size=2, token=bytes.fromhex(os.environ["TOKEN"]),
                          bind_host=os.environ["ADDRESS"], timeout_seconds=float(os.environ["TIMEOUT"]),
                          stall_check_seconds=0, stall_shutdown_seconds=0))
print("PORT", c.port, flush=True)
deadline = time.monotonic() + 60
while not c.error and time.monotonic() < deadline:
    time.sleep(0.05)
print(f"ERROR at {time.time():.3f}: {c.error}", flush=True)
"""

MEMBERS = r"""
import os, sys, time
import fasthorovod_testing
token = bytes.fromhex(os.environ["TOKEN"])
fds = [fasthorovod_testing._hostile_member(os.environ["ADDRESS"], int(os.environ["PORT"]), token, rank, 2, b"")
       for rank in range(2)]
print("CONNECTED", flush=True)
time.sleep(120)
"""


def _ip(*args):
    run_command(["ip", *args])


def test_the_coordinator_notices_members_whose_host_vanished_silently():
    a, b = f"fhvdliveA{os.getpid()}", f"fhvdliveB{os.getpid()}"
    octet = 16 + os.getpid() % 200
    address = f"10.251.{octet}.1"
    timeout = 4.0
    procs = []
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", "fhvdlva", "netns", a, "type", "veth", "peer", "name", "fhvdlvb", "netns", b)
        _ip("-n", a, "addr", "add", f"{address}/30", "dev", "fhvdlva")
        _ip("-n", b, "addr", "add", f"10.251.{octet}.2/30", "dev", "fhvdlvb")
        for ns, dev in ((a, "fhvdlva"), (b, "fhvdlvb")):
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        env = dict(os.environ, TOKEN=os.urandom(16).hex(), ADDRESS=address, TIMEOUT=str(timeout))
        coordinator = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, "-c", COORDINATOR], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(coordinator)
        port = re.match(r"PORT (\d+)", coordinator.stdout.readline()).group(1)
        members = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-c", MEMBERS],
                                   env=dict(env, PORT=port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(members)
        assert members.stdout.readline().strip() == "CONNECTED"
        time.sleep(1.0)  # welcomed and idle
        assert coordinator.poll() is None
        cut = time.time()
        _ip("-n", b, "link", "set", "fhvdlvb", "down")  # nothing gets out of the members' host any more
        out, _ = coordinator.communicate(timeout=90)
        line = re.search(r"ERROR at ([\d.]+): (.*)", out)
        assert line, out
        seconds, error = float(line.group(1)) - cut, line.group(2)
        print(f"noticed after {seconds:.1f} s: {error}")
        assert "disconnected from the negotiation's coordinator without shutting down" in error, error
        assert seconds < timeout + 3, seconds
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], timeout=10, capture_output=True)
