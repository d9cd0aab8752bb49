"""Errors of the emulated network."""

from __future__ import annotations


class NetemError(RuntimeError):
    """Setting up, using or tearing down the emulated network failed; the message says which step."""


class NetemPermissionError(NetemError, PermissionError):
    """The process may not create network namespaces (needs root or CAP_NET_ADMIN)."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"{detail}: the emulated cloud network needs network namespaces, which need root "
            "(or CAP_NET_ADMIN plus write access to /run/netns and /etc/netns). Run as root, or use "
            "loopback mode instead (all ranks on 127.0.0.1, no bandwidth caps)."
        )
