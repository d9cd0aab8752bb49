"""EmulatedCloud: bring the namespaces, bridge, shapers and hosts files up, and take them all down.

See the package docstring for the topology. Every instance gets a random 6-hex-digit id; its
namespaces are ``PREFIX-ID-br`` (the bridge) and ``PREFIX-ID-h0`` ... (the hosts), so two runs never
collide, and ``cleanup_stale`` can recognise leftovers by name.

Launchers (``horovodrun``, ``mpirun``) run in the bridge namespace, the *launcher namespace*: it has
an ``eth0`` of its own (a veth pair whose other end, ``ln``, is an unshaped bridge port) with the
subnet's last address, so a launcher reaches every host and, like a host, has an ``eth0`` (Horovod
looks its own address up on the interface that the hosts share). With ``ssh=True`` every host
runs an sshd (``ssh``). The hosts that are "up" for elastic jobs are listed in a file that a
discovery script prints; ``host_down``/``host_up`` take a host away (spot preemption) and bring it
back.
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
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from . import ssh as ssh_hosts
from ._command import DEFAULT_TIMEOUT_S, run_command
from .errors import NetemError, NetemPermissionError
from .shaping import shaping_commands
from .spec import CloudSpec, parse_spec
from .state import ETC_NETNS, STATE_DIR, Host, InstanceState, file_lock, list_instances, process_start_ticks, state_lock

DEFAULT_PREFIX = "fhvd"
SUBNET_POOL = ipaddress.IPv4Network("10.231.0.0/16")  # one /24 per instance
BRIDGE_DEVICE = "br0"
HOST_DEVICE = "eth0"  # the host's end of its veth pair, inside the host namespace
LAUNCHER_PORT = "ln"  # the bridge's end of the launcher's veth pair (its other end: eth0 of the bridge namespace)
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


# How long a multiprocessing resource tracker gets to exit on its own once the processes it serves
# are killed: it then unlinks the named semaphores they left (Horovod's launcher creates ten per job,
# safe_shell_exec's spawn-context Events), which a SIGKILL of the tracker too would leave in /dev/shm.
TRACKER_GRACE_S = 2.0


def is_resource_tracker(pid: int) -> bool:
    try:
        return any("multiprocessing.resource_tracker" in arg for arg in psutil.Process(pid).cmdline())
    except (psutil.Error, ValueError):  # gone, a zombie, or a negative pid
        return False


def _ip_netns(command: str, name: str) -> str:
    """``ip netns COMMAND NAME``'s output; "" where it failed because the namespace is gone (another
    remover deleted it meanwhile)."""
    try:
        return run_command(["ip", "netns", command, name])
    except NetemError:
        if name in _list_namespaces():
            raise
        return ""


def _namespace_pids(name: str) -> list[int]:
    """The processes in namespace ``name``; none once it is gone."""
    return [int(pid) for pid in _ip_netns("pids", name).split()]


def kill_rounds(list_pids: Callable[[], list[int]], rounds: int,
                spare: Callable[[int], bool] = lambda pid: False) -> list[int]:
    """SIGKILL every process ``list_pids()`` names but those ``spare`` names, until none is left (a
    process may fork while its siblings die, hence rounds); returns the pids killed."""
    killed: list[int] = []
    for _ in range(rounds):
        pids = [pid for pid in list_pids() if not spare(pid)]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += pids
        time.sleep(0.05)
    return killed


def _kill_namespace_processes(name: str, rounds: int = 10) -> list[int]:
    """SIGKILL every process in namespace ``name`` until none is left; returns the pids killed.
    Python's multiprocessing resource trackers are spared for up to TRACKER_GRACE_S after the rest
    is killed, so that they clean up the semaphores of the processes they served."""
    def pids() -> list[int]:
        return _namespace_pids(name)

    killed = kill_rounds(pids, rounds, spare=is_resource_tracker)
    deadline = time.monotonic() + TRACKER_GRACE_S
    while any(is_resource_tracker(pid) for pid in pids()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed + kill_rounds(pids, rounds)  # trackers that did not exit, and anything started meanwhile


def _delete_namespace(name: str) -> None:
    """Kill what still runs inside ``name`` (it would keep the namespace alive), then delete it."""
    _kill_namespace_processes(name, rounds=1)
    _ip_netns("del", name)


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
    try:
        if state.directory.exists():
            shutil.rmtree(state.directory)
    except OSError as err:
        problems.append(f"{state.directory}: {err}")
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
    return orphans + _remove_orphan_directories()


def _remove_orphan_directories() -> list[str]:
    """Instance directories (STATE_DIR/ID) without a state file: up() writes the state file before
    the directory and down() removes the directory before the state file, so these are leftovers."""
    if not STATE_DIR.is_dir():
        return []
    known = {path.stem for path in STATE_DIR.glob("*.json")}
    orphans = [path for path in STATE_DIR.iterdir()
               if path.is_dir() and re.fullmatch(r"[0-9a-f]{6}", path.name) and path.name not in known]
    for path in orphans:
        shutil.rmtree(path, ignore_errors=True)
    return [str(path) for path in orphans]


def _cleanup(prefix: str, *, only_dead_owners: bool) -> list[str]:
    _require_root()
    with state_lock():  # one remover at a time: two would race on the same namespaces and files
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


def _hosts_file(own_address: str, hosts: Sequence[Host], launcher_address: str | None = None) -> str:
    """/etc/hosts inside a namespace whose address is ``own_address``: the machine's hostname is
    that address (Gloo resolves it to find its own address), and every host is known by its
    namespace name and as ``hostI`` (I counted from 0, as in the spec); the launcher namespace's
    address is ``launcher``."""
    lines = [
        "# written by fasthorovod.netem; removed when the emulated cloud goes down",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        f"{own_address}\t{socket.gethostname()}",
        *(f"{other.address}\t{other.name} host{index}" for index, other in enumerate(hosts)),
    ]
    if launcher_address:
        lines.append(f"{launcher_address}\tlauncher")
    return "\n".join(lines) + "\n"


class EmulatedCloud:
    """A public-cloud-like network of ``spec.hosts`` hosts on this machine (needs root).

    Use as a context manager, or call ``up()`` and ``down()``::

        with EmulatedCloud(parse_spec("4:1gbit:200mbit")) as cloud:
            procs = [run_in_host(host, ["python", "train.py"]) for host in cloud.hosts]

    ``detached=True`` records no owner process, so ``cleanup_stale`` leaves the network alone after
    this process exits (the command line's ``up`` uses it; ``down ID`` removes it).

    ``ssh=True`` starts an sshd on every host (``fasthorovod.netem.ssh``), so that ``horovodrun -H
    host0:P,...`` or ``mpirun`` run in ``launcher_namespace`` start ranks on the hosts over ssh.
    ``slots_per_host`` is what ``discovery_script`` prints after each host name.
    """

    def __init__(self, spec: CloudSpec | str, prefix: str = DEFAULT_PREFIX, *, detached: bool = False,
                 ssh: bool = False, slots_per_host: int = 1) -> None:
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix {prefix!r} must be 1-16 letters, digits or underscores")
        if slots_per_host < 1:
            raise ValueError(f"slots_per_host must be at least 1, got {slots_per_host}")
        self.spec = parse_spec(spec) if isinstance(spec, str) else spec
        self.prefix = prefix
        self.detached = detached
        self.ssh = ssh
        self.slots_per_host = slots_per_host
        self._state: InstanceState | None = None

    @classmethod
    def attach(cls, instance_id: str) -> EmulatedCloud:
        """The instance with ``instance_id`` that is already up (e.g. from the command line)."""
        for state in list_instances():
            if state.id == instance_id:
                cloud = cls(state.spec, state.prefix, detached=state.owner_pid is None, ssh=state.ssh,
                            slots_per_host=state.slots_per_host)
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

    @property
    def launcher_namespace(self) -> str:
        """Where launchers run: the bridge namespace, which reaches every host through its eth0."""
        return self.state.bridge_namespace

    @property
    def launcher_address(self) -> str:
        if self.state.launcher_address is None:
            raise NetemError(f"emulated cloud {self.id} has no launcher address (254 hosts use the whole /24)")
        return self.state.launcher_address

    @property
    def identity_file(self) -> str:
        """The ssh client key every host accepts (only with ``ssh=True``)."""
        if not self.state.ssh:
            raise NetemError(f"emulated cloud {self.id} was brought up without ssh")
        return str(ssh_hosts.identity_file(self.state))

    @property
    def discovery_script(self) -> str:
        """An executable that prints the hosts that are up, ``hostI:SLOTS`` a line, for
        ``horovodrun --host-discovery-script`` (``host_down``/``host_up`` change what it prints)."""
        return str(self.state.directory / "discover-hosts")

    @property
    def discovery_file(self) -> Path:
        return self.state.directory / "hosts"

    def host_names(self) -> list[str]:
        """``host0``, ``host1``, ...: the names every namespace of the instance resolves."""
        return [f"host{index}" for index in range(len(self.state.hosts))]

    exec_prefix = staticmethod(exec_prefix)

    # --- up and down -------------------------------------------------------------------------------

    def up(self) -> EmulatedCloud:
        """Create everything; on any failure remove whatever was already created and re-raise."""
        if self._state is not None:
            raise NetemError(f"emulated cloud {self._state.id} is already up")
        _require_root()
        try:
            cleanup_stale(self.prefix)
        except NetemError as err:  # a dead run's leftovers take no id or subnet from this one
            warnings.warn(f"emulated cloud: could not remove the leftovers of a dead run: {err}", stacklevel=2)
        with state_lock():
            state = self._plan()
            state.write()
        self._state = state
        try:
            self._create_namespaces()
            self._wire()
            self._shape()
            self._write_hosts_files()
            self._write_discovery()
            if state.ssh:
                ssh_hosts.prepare(state)
                ssh_hosts.start_sshd(state, range(len(state.hosts)))
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
        usable = list(subnet.hosts())
        addresses = usable[: self.spec.hosts]
        launcher = str(usable[-1]) if len(usable) > self.spec.hosts else None
        if self.ssh and launcher is None:
            raise NetemError(f"ssh needs a launcher address: at most {len(usable) - 1} hosts")
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
            launcher_address=launcher,
            ssh=self.ssh,
            slots_per_host=self.slots_per_host,
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
        prefix_length = ipaddress.IPv4Network(self.state.subnet).prefixlen
        if self.state.launcher_address:  # the launcher's eth0 on an unshaped port of its own
            bridge_lines += [
                f"link add {LAUNCHER_PORT} type veth peer name {HOST_DEVICE}",
                f"link set {LAUNCHER_PORT} master {BRIDGE_DEVICE}",
                f"link set {LAUNCHER_PORT} up",
                f"link set {HOST_DEVICE} up",
                f"addr add {self.state.launcher_address}/{prefix_length} dev {HOST_DEVICE}",
            ]
        _batch(["ip", "-n", self.bridge_namespace], bridge_lines)
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
            _batch(["tc", "-n", host.name], shaping_commands(HOST_DEVICE, *self.spec.host_rates(index), self.spec.flow_hash))
        bridge_lines = [
            line
            for index in range(len(self.state.hosts))
            for line in shaping_commands(_bridge_port(index), *self.spec.host_rates(index), self.spec.flow_hash)
        ]
        timeout = DEFAULT_TIMEOUT_S + 0.5 * len(self.state.hosts)
        _batch(["tc", "-n", self.bridge_namespace], bridge_lines, timeout=timeout)

    def _write_hosts_files(self) -> None:
        state = self.state
        for host in state.hosts:
            directory = ETC_NETNS / host.name
            directory.mkdir(parents=True, exist_ok=False)
            (directory / "hosts").write_text(_hosts_file(host.address, state.hosts, state.launcher_address))
        if state.launcher_address:
            directory = ETC_NETNS / state.bridge_namespace
            directory.mkdir(parents=True, exist_ok=False)
            (directory / "hosts").write_text(_hosts_file(state.launcher_address, state.hosts, state.launcher_address))

    def _write_discovery(self) -> None:
        """The hosts file (every host up) and the script that prints it."""
        self.state.directory.mkdir(mode=0o755, parents=True, exist_ok=False)
        self._write_available(range(len(self.state.hosts)))
        script = Path(self.discovery_script)
        script.write_text("#!/bin/sh\n"
                          f"# host discovery of emulated cloud {self.id} (fasthorovod.netem): the hosts that are up\n"
                          f"exec cat {self.discovery_file}\n")
        script.chmod(0o755)

    # --- hosts going away and coming back (spot preemption) -------------------------------------

    @contextlib.contextmanager
    def _hosts_lock(self):
        with file_lock(self.state.directory / ".hosts.lock", "another host-down or host-up of this cloud"):
            yield

    def _write_available(self, indices) -> None:
        lines = "".join(f"host{index}:{self.state.slots_per_host}\n" for index in sorted(set(indices)))
        temporary = self.discovery_file.with_suffix(".tmp")
        temporary.write_text(lines)
        os.replace(temporary, self.discovery_file)  # the discovery script never sees half a file

    def available_hosts(self) -> list[int]:
        """The hosts the discovery script lists, by index."""
        text = self.discovery_file.read_text()
        return [int(line.split(":")[0].removeprefix("host")) for line in text.split() if line]

    def host_index(self, name: str | int) -> int:
        """Host ``name`` (``hostI``, ``I`` or the namespace name) as an index."""
        names = {str(index): index for index in range(len(self.state.hosts))}
        names.update({f"host{index}": index for index in range(len(self.state.hosts))})
        names.update({host.name: index for index, host in enumerate(self.state.hosts)})
        if str(name) not in names:
            raise NetemError(f"emulated cloud {self.id} has no host {name!r} "
                             f"(its hosts are host0..host{len(self.state.hosts) - 1})")
        return names[str(name)]

    def link_up(self, index: int) -> bool:
        """Whether host ``index``'s bridge port (its cable) is up."""
        shown = run_command(["ip", "-n", self.bridge_namespace, "-o", "link", "show", _bridge_port(index)])
        flags = shown.split("<", 1)[1].split(">", 1)[0].split(",")  # e.g. BROADCAST,MULTICAST,UP,LOWER_UP
        return "UP" in flags

    def host_down(self, name: str | int, *, abrupt: bool = False) -> list[int]:
        """Take a host away, as a spot instance is reclaimed; returns the pids killed.

        Graceful (the default): the host stops being listed by ``discovery_script`` and nothing else
        changes, like an instance that got its two-minute notice: an elastic job stops using it.
        Abrupt: first its link is cut (its bridge port goes down, so no FIN or RST gets out), then
        every process in it is killed (sshd and ranks included), then it is unlisted: its peers
        see it vanish and notice only through their own timeouts."""
        index = self.host_index(name)
        killed: list[int] = []
        if abrupt:
            run_command(["ip", "-n", self.bridge_namespace, "link", "set", _bridge_port(index), "down"])
            killed = _kill_namespace_processes(self.state.hosts[index].name)
        with self._hosts_lock():
            self._write_available(i for i in self.available_hosts() if i != index)
        return killed

    def host_up(self, name: str | int) -> None:
        """Bring a host back: its link up, its sshd running (with ssh), listed again."""
        index = self.host_index(name)
        host = self.state.hosts[index]
        run_command(["ip", "-n", self.bridge_namespace, "link", "set", _bridge_port(index), "up"])
        # Whoever tried to reach the host while it was away holds a FAILED neighbour entry for it,
        # which answers "no route to host" for a while: forget those, as a new instance's peers would.
        for namespace in [self.bridge_namespace, *(other.name for other in self.state.hosts if other != host)]:
            run_command(["ip", "-n", namespace, "neigh", "flush", "to", host.address])
        run_command(["ip", "-n", host.name, "neigh", "flush", "dev", HOST_DEVICE])
        if self.state.ssh and not ssh_hosts.sshd_running(self.state, index):
            ssh_hosts.start_sshd(self.state, [index])
        with self._hosts_lock():
            self._write_available([*self.available_hosts(), index])
