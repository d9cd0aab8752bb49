"""What an emulated network instance created, recorded on disk so any process can tear it down.

One JSON file per instance in ``STATE_DIR``, written *before* the first namespace is created and
removed only after the last one is gone: a namespace whose id has no state file is a leftover that
nobody will ever clean up otherwise. Beside it, a directory ``STATE_DIR/ID/`` holds what the
instance keeps while it is up: the discovery hosts file and script (``hosts``), and with ssh the
cloud's keys and sshd/ssh configuration (``ssh``). It goes with the instance. The owner (pid plus the process's start time, so a recycled pid
is not mistaken for the owner) marks instances that live only as long as the process that made
them; instances brought up by the command line are detached (no owner) and live until ``down``.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import psutil

from .errors import NetemError

STATE_DIR = Path("/run/fasthorovod-netem")
ETC_NETNS = Path("/etc/netns")  # `ip netns exec NS` bind-mounts ETC_NETNS/NS/* over /etc/*


@dataclass(frozen=True)
class Host:
    """One emulated host: its network namespace and its address (which exists only inside the emulation)."""

    name: str
    address: str


@dataclass(frozen=True)
class InstanceState:
    """Everything one emulated network instance created."""

    id: str
    prefix: str
    spec: str
    subnet: str
    bridge_namespace: str
    hosts: tuple[Host, ...]
    owner_pid: int | None
    owner_start_ticks: int | None
    created: float
    # Added with the launcher endpoint and sshd (defaults keep older state files readable).
    launcher_address: str | None = None  # eth0 of the bridge namespace, where launchers run
    ssh: bool = False  # whether every host runs an sshd (keys in ``directory / "ssh"``)
    slots_per_host: int = 1  # what the discovery script prints after each host name

    @property
    def directory(self) -> Path:
        """The instance's own files (discovery, ssh keys and configs); removed by down()."""
        return STATE_DIR / self.id

    @property
    def path(self) -> Path:
        return STATE_DIR / f"{self.id}.json"

    @property
    def namespaces(self) -> list[str]:
        """Host namespaces first, then the bridge's (deleting it also deletes every veth pair)."""
        return [host.name for host in self.hosts] + [self.bridge_namespace]

    def owner_alive(self) -> bool:
        """True for a detached instance, else whether the process that created it still runs."""
        if self.owner_pid is None:
            return True
        return process_start_ticks(self.owner_pid) == self.owner_start_ticks

    def write(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(temporary, self.path)

    @classmethod
    def read(cls, path: Path) -> InstanceState:
        """The state in `path`. Fields this version does not know are ignored: the directory is shared
        by every checkout on the machine, and a newer one's instance must not make this one fail."""
        record = json.loads(path.read_text())
        record["hosts"] = tuple(Host(name=host["name"], address=host["address"]) for host in record["hosts"])
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in record.items() if key in known})


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError):  # ValueError: a negative pid
        return False


def process_start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, field 22 of /proc/PID/stat), or None when no
    such process exists. Read directly: psutil gives only ``create_time()``, wall-clock seconds that
    move when the system clock is stepped, while a recorded owner must match its start exactly. The
    command name (field 2) may hold spaces and parentheses, so the split is after its last ``)``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def list_instances(prefix: str | None = None) -> list[InstanceState]:
    """The recorded instances, oldest first; only those with ``prefix`` when one is given."""
    if not STATE_DIR.is_dir():
        return []
    states = []
    for path in STATE_DIR.glob("*.json"):
        try:
            states.append(InstanceState.read(path))
        except FileNotFoundError:  # removed by a concurrent down()
            continue
    return sorted(
        (state for state in states if prefix is None or state.prefix == prefix),
        key=lambda state: state.created,
    )


LOCK_TIMEOUT_S = 120.0


@contextmanager
def file_lock(path: Path, holder: str, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Holds an exclusive ``flock`` on ``path`` (created if missing) between processes. Raises
    NetemError after ``timeout`` seconds of waiting, naming the lock and ``holder`` (who else takes it)."""
    deadline = time.monotonic() + timeout
    with open(path, "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NetemError(f"{path} stayed locked for {timeout:g} s ({holder})") from None
                time.sleep(0.05)
        yield


@contextmanager
def state_lock(timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Serialise the changes to the instances between processes: choosing ids and subnets in
    ``up()`` (milliseconds) and removing leftovers (seconds: their processes are killed first), so
    that two clouds brought up at once never both remove the same dead run's namespaces. Raises
    NetemError after ``timeout`` seconds of waiting."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with file_lock(STATE_DIR / ".lock", "another emulated cloud is being brought up or removed", timeout):
        yield
