"""Running ``ip``/``tc`` with a timeout and turning failures into NetemError."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from .errors import NetemError, NetemPermissionError

DEFAULT_TIMEOUT_S = 30.0
_PERMISSION_MARKERS = ("Operation not permitted", "Permission denied")


def run_command(argv: Sequence[str], *, input: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """Run ``argv`` to completion and return its stdout; raise NetemError when it fails or hangs."""
    try:
        result = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NetemError(f"`{' '.join(argv)}` did not finish within {timeout:g} s") from None
    except FileNotFoundError:
        raise NetemError(f"`{argv[0]}` not found on PATH (install iproute2)") from None
    if result.returncode != 0:
        stderr = result.stderr.strip()
        if any(marker in stderr for marker in _PERMISSION_MARKERS):
            raise NetemPermissionError(f"`{' '.join(argv)}` failed: {stderr}")
        raise NetemError(f"`{' '.join(argv)}` failed with exit code {result.returncode}: {stderr}")
    return result.stdout
