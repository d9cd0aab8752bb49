"""Whether this machine lets the tests build emulated networks (network namespaces, tc), shared by
the test modules that need them."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest


def unusable_reason(tools: tuple = ("ip", "tc"), probe_prefix: str = "fhvdprobe") -> str | None:
    """None when namespaces can be created here and `tools` are installed, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, or see docs/netem.md)"
    for tool in tools:
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"{probe_prefix}{os.getpid()}"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if added.returncode != 0:
        return f"`ip netns add` is not permitted here: {added.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10, check=True)
    return None


@contextlib.contextmanager
def loopback_namespace(prefix: str):
    """A private network namespace (named `prefix` and this process's pid) whose loopback has a
    cloud-like MTU, so that tc's htb shapes 1500-byte packets rather than 64 KiB loopback ones;
    deleted on exit. Yields its name."""
    name = f"{prefix}{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "mtu", "1500", "up"],
                       check=True, timeout=10)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], timeout=10)


def skip_unless_usable(tools: tuple = ("ip", "tc"), probe_prefix: str = "fhvdprobe"):
    """A pytest mark that skips a test, with the reason, where emulated networks cannot be built."""
    reason = unusable_reason(tools, probe_prefix)
    return pytest.mark.skipif(reason is not None, reason=f"emulated network unavailable: {reason}")
