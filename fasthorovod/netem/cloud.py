"""EmulatedCloud: bring the namespaces, bridge, shapers and hosts files up, and take them all down.

See the package docstring for the topology. Every instance gets a random 6-hex-digit id; its
namespaces are ``PREFIX-ID-br`` (the bridge) and ``PREFIX-ID-h0`` ... (the hosts), so two runs never
collide, and ``cleanup_stale`` can recognise leftovers by name.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from ._command import DEFAULT_TIMEOUT_S, run_command
from .errors import NetemError, NetemPermissionError
from .shaping import shaping_commands
from .spec import CloudSpec, parse_spec
from .state import ETC_NETNS, Host, InstanceState, list_instances, process_start_ticks, state_lock

DEFAULT_PREFIX = "fhvd"
SUBNET_POOL = ipaddress.IPv4Network("10.231.0.0/16")  # one /24 per instance
BRIDGE_DEVICE = "br0"
HOST_DEVICE = "eth0"  # the host's end of its veth pair, inside the host namespace
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_]{1,16}$")


def _namespace_re(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}-(?P<id>[0-9a-f]{{6}})-(?:br|h\d+)$")


def _bridge_port(index: int) -> str:
    """The bridge's end of host ``index``'s veth pair, inside the bridge namespace."""
    return f"h{index}"


def exec_prefix(host: Host) -> list[str]:
    """The argv prefix that runs a command inside ``host``'s namespace."""
    return ["ip", "netns", "exec", host.name]


def run_in_host(
    host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None, **popen_kwargs: Any
) -> subprocess.Popen[Any]:
    """Start ``argv`` inside ``host``'s namespace (``ip netns exec``); its /etc/hosts maps the
    machine's hostname to ``host.address``. ``env`` defaults to this process's environment."""
    return subprocess.Popen([*exec_prefix(host), *argv], env=env, **popen_kwargs)


def _batch(command: list[str], lines: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Run ``lines`` through one ``ip -batch`` / ``tc -batch`` process; it stops at the first error."""
    run_command([*command, "-batch", "-"], input="\n".join(lines) + "\n", timeout=timeout)


def _require_root() -> None:
    if os.geteuid() != 0:
        raise NetemPermissionError(f"not running as root (euid {os.geteuid()})")


def _list_namespaces() -> list[str]:
    return [line.split()[0] for line in run_command(["ip", "netns", "list"]).splitlines() if line.strip()]


def _delete_namespace(name: str) -> None:
    """Kill what still runs inside ``name`` (it would keep the namespace alive), then delete it."""
    for pid in run_command(["ip", "netns", "pids", name]).split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    run_command(["ip", "netns", "del", name])


def _remove_instance(state: InstanceState) -> None:
    """Delete the instance's namespaces, hosts files and state file; tolerate any already gone."""
    existing = set(_list_namespaces())
    problems = []
    for name in state.namespaces:
        try:
            if name in existing:
                _delete_namespace(name)
            if (ETC_NETNS / name).exists():
                shutil.rmtree(ETC_NETNS / name)
        except (NetemError, OSError) as err:
            problems.append(f"{name}: {err}")
    if problems:  # keep the state file so that a later down/cleanup_stale can retry
        raise NetemError(f"could not remove all of emulated cloud {state.id}: " + "; ".join(problems))
    state.path.unlink(missing_ok=True)


def _remove_orphans(prefix: str, namespaces: Sequence[str], known_ids: set[str]) -> list[str]:
    """Remove namespaces and /etc/netns dirs named like ours whose instance has no state file."""
    pattern = _namespace_re(prefix)
    etc_dirs = [path.name for path in ETC_NETNS.iterdir()] if ETC_NETNS.is_dir() else []
    candidates = {*namespaces, *etc_dirs}
    orphans = sorted(name for name in candidates if (match := pattern.match(name)) and match["id"] not in known_ids)
    for name in orphans:
        if name in namespaces:
            _delete_namespace(name)
        if (ETC_NETNS / name).exists():
            shutil.rmtree(ETC_NETNS / name)
    return orphans


def _cleanup(prefix: str, *, only_dead_owners: bool) -> list[str]:
    _require_root()
    namespaces = _list_namespaces()  # before reading states: a live run writes its state first
    states = list_instances(prefix)
    removed = []
    for state in states:
        if not only_dead_owners or not state.owner_alive():
            _remove_instance(state)
            removed.append(state.id)
    return removed + _remove_orphans(prefix, namespaces, {state.id for state in states})


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove leftovers of dead runs with ``prefix``: instances whose owner process is gone, and
    namespaces or /etc/netns dirs named like ours that no state file accounts for. Detached
    instances (from ``python -m fasthorovod.netem up``) are kept. Returns the ids/names removed."""
    return _cleanup(prefix, only_dead_owners=True)


def down_all(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove every instance with ``prefix`` (live, dead or detached) and all orphans."""
    return _cleanup(prefix, only_dead_owners=False)


def _root_namespace_networks() -> list[ipaddress.IPv4Network]:
    output = run_command(["ip", "-o", "-4", "addr", "show"])
    return [ipaddress.IPv4Interface(line.split()[3]).network for line in output.splitlines() if line.strip()]


def _choose_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUBNET_POOL that no other instance uses and no address of this machine overlaps.
    (The addresses exist only inside our namespaces, but a distinct subnet keeps them unambiguous.)"""
    taken = _root_namespace_networks()
    in_use = {state.subnet for state in list_instances()}
    for subnet in SUBNET_POOL.subnets(new_prefix=24):
        if str(subnet) not in in_use and not any(subnet.overlaps(network) for network in taken):
            return subnet
    raise NetemError(f"no free /24 in {SUBNET_POOL}: other instances or this machine's addresses use them all")


def _hosts_file(host: Host, hosts: Sequence[Host]) -> str:
    """/etc/hosts inside ``host``: the machine's hostname is this host (Gloo resolves it to find its
    own address), and every host's namespace name resolves to that host's address."""
    lines = [
        "# written by fasthorovod.netem; removed when the emulated cloud goes down",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        f"{host.address}\t{socket.gethostname()}",
        *(f"{other.address}\t{other.name}" for other in hosts),
    ]
    return "\n".join(lines) + "\n"


class EmulatedCloud:
    """A public-cloud-like network of ``spec.hosts`` hosts on this machine (needs root).

    Use as a context manager, or call ``up()`` and ``down()``::

        with EmulatedCloud(parse_spec("4:1gbit:200mbit")) as cloud:
            procs = [run_in_host(host, ["python", "train.py"]) for host in cloud.hosts]

    ``detached=True`` records no owner process, so ``cleanup_stale`` leaves the network alone after
    this process exits (the command line's ``up`` uses it; ``down ID`` removes it).
    """

    def __init__(self, spec: CloudSpec | str, prefix: str = DEFAULT_PREFIX, *, detached: bool = False) -> None:
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix {prefix!r} must be 1-16 letters, digits or underscores")
        self.spec = parse_spec(spec) if isinstance(spec, str) else spec
        self.prefix = prefix
        self.detached = detached
        self._state: InstanceState | None = None

    @classmethod
    def attach(cls, instance_id: str) -> EmulatedCloud:
        """The instance with ``instance_id`` that is already up (e.g. from the command line)."""
        for state in list_instances():
            if state.id == instance_id:
                cloud = cls(state.spec, state.prefix, detached=state.owner_pid is None)
                cloud._state = state
                return cloud
        raise NetemError(f"no emulated cloud with id {instance_id!r} (see: python -m fasthorovod.netem status)")

    # --- what is up ------------------------------------------------------------------------------

    @property
    def is_up(self) -> bool:
        return self._state is not None

    @property
    def state(self) -> InstanceState:
        if self._state is None:
            raise NetemError("the emulated cloud is not up; call up() first")
        return self._state

    @property
    def id(self) -> str:
        return self.state.id

    @property
    def hosts(self) -> list[Host]:
        return list(self.state.hosts)

    @property
    def bridge_namespace(self) -> str:
        return self.state.bridge_namespace

    exec_prefix = staticmethod(exec_prefix)

    # --- up and down -------------------------------------------------------------------------------

    def up(self) -> EmulatedCloud:
        """Create everything; on any failure remove whatever was already created and re-raise."""
        if self._state is not None:
            raise NetemError(f"emulated cloud {self._state.id} is already up")
        _require_root()
        cleanup_stale(self.prefix)
        with state_lock():
            state = self._plan()
            state.write()
        self._state = state
        try:
            self._create_namespaces()
            self._wire()
            self._shape()
            self._write_hosts_files()
        except BaseException as failure:
            try:
                self.down()
            except NetemError as cleanup_failure:
                failure.add_note(f"removing the half-built network also failed: {cleanup_failure}")
            raise
        return self

    def down(self) -> None:
        """Remove everything this instance created; does nothing when it is not up."""
        if self._state is None:
            return
        _remove_instance(self._state)
        self._state = None

    def __enter__(self) -> EmulatedCloud:
        return self.up()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.down()

    # --- the steps of up() ----------------------------------------------------------------------

    def _plan(self) -> InstanceState:
        pattern = _namespace_re(self.prefix)
        existing = {match["id"] for name in _list_namespaces() if (match := pattern.match(name))}
        taken_ids = existing | {state.id for state in list_instances()}
        instance_id = secrets.token_hex(3)
        while instance_id in taken_ids:
            instance_id = secrets.token_hex(3)
        subnet = _choose_subnet()
        addresses = list(subnet.hosts())[: self.spec.hosts]
        base = f"{self.prefix}-{instance_id}"
        pid = None if self.detached else os.getpid()
        return InstanceState(
            id=instance_id,
            prefix=self.prefix,
            spec=str(self.spec),
            subnet=str(subnet),
            bridge_namespace=f"{base}-br",
            hosts=tuple(Host(name=f"{base}-h{index}", address=str(address)) for index, address in enumerate(addresses)),
            owner_pid=pid,
            owner_start_ticks=None if pid is None else process_start_ticks(pid),
            created=time.time(),
        )

    def _create_namespaces(self) -> None:
        _batch(["ip"], [f"netns add {name}" for name in self.state.namespaces])

    def _wire(self) -> None:
        """The bridge in its namespace, one veth pair per host, loopback and addresses."""
        bridge_lines = ["link set lo up", f"link add {BRIDGE_DEVICE} type bridge", f"link set {BRIDGE_DEVICE} up"]
        for index, host in enumerate(self.state.hosts):
            port = _bridge_port(index)
            bridge_lines += [
                f"link add {port} type veth peer name {HOST_DEVICE} netns {host.name}",
                f"link set {port} master {BRIDGE_DEVICE}",
                f"link set {port} up",
            ]
        _batch(["ip", "-n", self.bridge_namespace], bridge_lines)
        prefix_length = ipaddress.IPv4Network(self.state.subnet).prefixlen
        for host in self.state.hosts:
            address = f"{host.address}/{prefix_length}"
            host_lines = ["link set lo up", f"link set {HOST_DEVICE} up", f"addr add {address} dev {HOST_DEVICE}"]
            _batch(["ip", "-n", host.name], host_lines)

    def _shape(self) -> None:
        """Per-flow shapers on each host's egress (``eth0``: what it sends) and on the bridge's egress
        toward each host (its port: what it receives), both at that host's own rates
        (``spec.host_rates``). A flow from host A to host B passes A's ``eth0`` and B's port, so it
        gets min(A's per-flow cap, B's per-flow cap), within A's link out and B's link in; a host on
        a slow path is slow in both directions and to every other host (``spec.path_rates``)."""
        for index, host in enumerate(self.state.hosts):
            _batch(["tc", "-n", host.name], shaping_commands(HOST_DEVICE, *self.spec.host_rates(index)))
        bridge_lines = [
            line
            for index in range(len(self.state.hosts))
            for line in shaping_commands(_bridge_port(index), *self.spec.host_rates(index))
        ]
        timeout = DEFAULT_TIMEOUT_S + 0.5 * len(self.state.hosts)
        _batch(["tc", "-n", self.bridge_namespace], bridge_lines, timeout=timeout)

    def _write_hosts_files(self) -> None:
        for host in self.state.hosts:
            directory = ETC_NETNS / host.name
            directory.mkdir(parents=True, exist_ok=False)
            (directory / "hosts").write_text(_hosts_file(host, self.state.hosts))
