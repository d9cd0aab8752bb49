"""Every FastHorovod knob, declared once: what the user set.

Each field of :class:`Config` is read from the environment variable ``FASTHOROVOD_<NAME>`` and
documented in docs/env.md. A malformed or out-of-range value raises :class:`ConfigError` naming the
variable; nothing is silently clamped. A setting the user left unset stays ``None`` here where the
data plane decides it (the lanes, the sockets per lane, the threshold): what was decided, and why,
is the data plane's plan (fasthorovod/proxy/plan.py). A *lane* is one proxy process and the TCP
rings it runs, carrying one shard of every large collective; the two lane settings are also read
under their former names (:data:`ALIASES`). Settings that change what travels on the wire are
folded into :meth:`Config.wire_hash`, which the proxies compare in their handshake, so ranks with
different settings fail at start-up with a clear message instead of hanging later.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Mapping, Optional

PREFIX = "FASTHOROVOD_"
MAX_LANES = 64  # csrc/shm/channel.h kMaxLanes
MAX_SOCKETS_PER_LANE = 64  # csrc/shm/channel.h kMaxSocketsPerLane
# Variables still read under their former names (docs/env.md): {variable: former name}. Where both
# are set they must have the same value.
ALIASES = {
    PREFIX + "NUM_LANES": PREFIX + "NUM_PROXIES",
    PREFIX + "SOCKETS_PER_LANE": PREFIX + "SOCKETS_PER_PROXY",
}


class ConfigError(ValueError):
    """A FASTHOROVOD_* variable has a bad value."""


def _int(env: Mapping[str, str], name: str, default: int, low: int, high: Optional[int] = None) -> int:
    raw = env.get(PREFIX + name)
    if raw is None or raw.strip() == "":
        return default
    return _parse_int(PREFIX + name, raw, low, high)


def _parse_int(variable: str, raw: str, low: int, high: Optional[int]) -> int:
    try:
        value = int(raw.strip(), 0)
    except ValueError:
        raise ConfigError(f"{variable}={raw!r} is not an integer") from None
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{variable}={value} must be {bounds}")
    return value


def _aliased_int(env: Mapping[str, str], name: str, low: int, high: Optional[int] = None) -> Optional[int]:
    """An integer setting from FASTHOROVOD_<name> or its former name (:data:`ALIASES`); None when
    both are unset or blank. An error names the variable that holds the bad value; both set to
    different values is an error naming both."""
    found = [(variable, raw.strip(), _parse_int(variable, raw, low, high))
             for variable in (PREFIX + name, ALIASES[PREFIX + name])
             for raw in [env.get(variable)] if raw is not None and raw.strip() != ""]
    if len(found) == 2 and found[0][2] != found[1][2]:
        (new, new_raw, _), (old, old_raw, _) = found
        raise ConfigError(f"{new}={new_raw} and {old}={old_raw} disagree ({old} is the former name of "
                          f"{new}); set only one of them")
    return found[0][2] if found else None


def _optional_int(env: Mapping[str, str], name: str, low: int, high: Optional[int] = None) -> Optional[int]:
    """An integer setting that stays None when unset or blank."""
    return _int(env, name, 0, low, high) if _text(env, name) is not None else None


def _text(env: Mapping[str, str], name: str) -> Optional[str]:
    """A free-form value with surrounding blanks removed; None when unset or blank."""
    return (env.get(PREFIX + name) or "").strip() or None


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple) -> str:
    value = _text(env, name)
    if value is None:
        return default
    if value.lower() not in allowed:
        raise ConfigError(f"{PREFIX}{name}={value!r} must be one of {', '.join(allowed)}")
    return value.lower()


def _float(env: Mapping[str, str], name: str, default: float, low: float) -> float:
    raw = env.get(PREFIX + name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{PREFIX}{name}={raw!r} is not a number") from None
    if not value > low:
        raise ConfigError(f"{PREFIX}{name}={value} must be > {low}")
    return value


def _seconds(env: Mapping[str, str], name: str, horovod_name: str, default: float) -> float:
    """A duration >= 0 (0: off) from FASTHOROVOD_<name>, else Horovod's own variable, else default."""
    variable = PREFIX + name
    raw = env.get(variable)
    if raw is None or raw.strip() == "":
        variable, raw = horovod_name, env.get(horovod_name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{variable}={raw!r} is not a number") from None
    if not value >= 0:
        raise ConfigError(f"{variable}={value} must be >= 0 (0 turns it off)")
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    num_lanes: Optional[int] = None
    """FASTHOROVOD_NUM_LANES (former name FASTHOROVOD_NUM_PROXIES, still read): lanes per worker, a
    lane being one proxy process and the rings it runs; 0 disables the proxies. None (unset): 4, or
    more where the path probe measures a network faster than 4 lanes' CPU can carry and every
    worker has the CPUs for them (fasthorovod/proxy/plan.py)."""
    sockets_per_lane: Optional[int] = None
    """FASTHOROVOD_SOCKETS_PER_LANE (former name FASTHOROVOD_SOCKETS_PER_PROXY, still read): TCP
    connections from each lane's proxy to its ring neighbour (None, unset: chosen by the path probe,
    fasthorovod/proxy/plan.py, or 1 where the probe does not run)."""
    probe: str = "auto"
    """FASTHOROVOD_PROBE: measure the network at start-up to choose the sockets per lane: ``auto``
    (when the ranks span several hosts), ``1`` (always), ``0`` (never). Ignored when
    FASTHOROVOD_SOCKETS_PER_LANE is set."""
    hierarchical: str = "auto"
    """FASTHOROVOD_HIERARCHICAL: with several ranks on a host, reduce inside the host through shared
    memory and run one ring across hosts per local rank (fasthorovod/proxy/hosts.py): ``auto`` (when
    every host runs the same number L > 1 of ranks and they can share memory), ``1`` (required: an
    error where it cannot run), ``0`` (one flat ring through every rank)."""
    proxy_threshold_bytes: Optional[int] = None
    """FASTHOROVOD_PROXY_THRESHOLD_BYTES: allreduces of at least this many bytes use the proxies
    (None, unset: 1 MiB, or 8 MiB when every rank is on one host; fasthorovod/proxy/plan.py)."""
    rebalance_every: int = 1
    """FASTHOROVOD_REBALANCE_EVERY: consider re-weighing the lanes' shards from their measured rates
    before every N-th proxy request (fasthorovod/proxy/balance.py; 0 = keep equal shards)."""
    rehash: bool = True
    """FASTHOROVOD_REHASH: reconnect a send socket that drains persistently slower than the others
    (a flow hashed onto a shared per-flow cap), so that its new port hashes anew
    (fasthorovod/proxy/rehash.py; 0 = keep the connections of start-up). Shared by every rank: the
    probe's choice of sockets per lane counts on it (probe.capped_knee)."""
    rehash_warm_up: str = "auto"
    """FASTHOROVOD_REHASH_WARM_UP: run the re-hashing rule on a few allreduces of zeros at the end of
    start-up (rehash.warm_up): auto = where the start-up probe saw flows collide, 1 = always, 0 =
    never. Every rank takes part (the ranks must agree on it); the rule acts where
    FASTHOROVOD_REHASH=1."""
    segment_bytes: int = 1 << 20
    """FASTHOROVOD_SEGMENT_BYTES: pipelining unit of the ring (bytes per frame)."""
    bucket_bytes: int = 25 << 20
    """FASTHOROVOD_BUCKET_BYTES: DistributedOptimizer gradient bucket size (a larger tensor gets its own)."""
    first_bucket_bytes: int = 1 << 20
    """FASTHOROVOD_FIRST_BUCKET_BYTES: DistributedOptimizer's first bucket ends once it holds this many
    bytes, so that its allreduce starts with backward's first gradients."""
    socket_buffer_bytes: int = 0
    """FASTHOROVOD_SOCKET_BUFFER_BYTES: SO_SNDBUF/SO_RCVBUF; 0 keeps Linux's autotuning."""
    timeout_seconds: float = 30.0
    """FASTHOROVOD_TIMEOUT_SECONDS: bound on every wait (start-up, and no progress in a collective)."""
    stall_check_seconds: float = 60.0
    """FASTHOROVOD_STALL_CHECK_SECONDS: report a tensor some ranks submitted and others not after this
    long (else HOROVOD_STALL_CHECK_TIME_SECONDS; HOROVOD_STALL_CHECK_DISABLE=1 or 0 turns it off)."""
    stall_shutdown_seconds: float = 0.0
    """FASTHOROVOD_STALL_SHUTDOWN_SECONDS: fail such a tensor on every rank after this long (else
    HOROVOD_STALL_SHUTDOWN_TIME_SECONDS; 0, the default, waits for ever as Horovod does)."""
    iface: Optional[str] = None
    """FASTHOROVOD_IFACE: network interface the proxies bind to (else HOROVOD_GLOO_IFACE, else hostname)."""
    trace_dir: Optional[str] = None
    """FASTHOROVOD_TRACE_DIR: record the DLC trace into this directory from ``hvd.init()`` on
    (docs/trace.md); None when unset or blank."""

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Config":
        env = os.environ if env is None else env
        return cls(
            num_lanes=_aliased_int(env, "NUM_LANES", 0, MAX_LANES),
            sockets_per_lane=_aliased_int(env, "SOCKETS_PER_LANE", 1, MAX_SOCKETS_PER_LANE),
            probe=_choice(env, "PROBE", cls.probe, ("auto", "0", "1")),
            hierarchical=_choice(env, "HIERARCHICAL", cls.hierarchical, ("auto", "0", "1")),
            proxy_threshold_bytes=_optional_int(env, "PROXY_THRESHOLD_BYTES", 0),
            rebalance_every=_int(env, "REBALANCE_EVERY", cls.rebalance_every, 0),
            rehash=_choice(env, "REHASH", "1", ("0", "1")) == "1",
            rehash_warm_up=_choice(env, "REHASH_WARM_UP", cls.rehash_warm_up, ("auto", "0", "1")),
            segment_bytes=_int(env, "SEGMENT_BYTES", cls.segment_bytes, 1024, 1 << 30),
            bucket_bytes=_int(env, "BUCKET_BYTES", cls.bucket_bytes, 1),
            first_bucket_bytes=_int(env, "FIRST_BUCKET_BYTES", cls.first_bucket_bytes, 1),
            socket_buffer_bytes=_int(env, "SOCKET_BUFFER_BYTES", cls.socket_buffer_bytes, 0, 1 << 30),
            timeout_seconds=_float(env, "TIMEOUT_SECONDS", cls.timeout_seconds, 0.0),
            stall_check_seconds=(0.0 if (env.get("HOROVOD_STALL_CHECK_DISABLE") or "").strip() in ("1", "true")
                                 and not (env.get(PREFIX + "STALL_CHECK_SECONDS") or "").strip()
                                 else _seconds(env, "STALL_CHECK_SECONDS", "HOROVOD_STALL_CHECK_TIME_SECONDS",
                                               cls.stall_check_seconds)),
            stall_shutdown_seconds=_seconds(env, "STALL_SHUTDOWN_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                                            cls.stall_shutdown_seconds),
            iface=env.get(PREFIX + "IFACE") or None,
            trace_dir=_text(env, "TRACE_DIR"),
        )

    def wire_hash(self) -> int:
        """Hash of the settings every rank must share (compared in the proxies' handshake)."""
        shared = (self.num_lanes, self.sockets_per_lane, self.probe, self.proxy_threshold_bytes,
                  self.segment_bytes, self.rebalance_every, self.hierarchical, self.rehash_warm_up, self.rehash)
        digest = hashlib.sha256(repr(shared).encode()).digest()
        return int.from_bytes(digest[:8], "little")
