"""Whether this machine lets the tests build emulated networks (network namespaces, tc), shared by
the test modules that need them."""
from __future__ import annotations

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


def skip_unless_usable(tools: tuple = ("ip", "tc"), probe_prefix: str = "fhvdprobe"):
    """A pytest mark that skips a test, with the reason, where emulated networks cannot be built."""
    reason = unusable_reason(tools, probe_prefix)
    return pytest.mark.skipif(reason is not None, reason=f"emulated network unavailable: {reason}")
