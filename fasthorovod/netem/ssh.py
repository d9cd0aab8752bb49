"""sshd on every emulated host, so that launchers reach the hosts as on a real cluster.

``horovodrun -H host0:2,host1:2 ...`` starts remote ranks with ``ssh HOST 'cd DIR; env K=V ... CMD'``
(and ``mpirun`` starts its daemons the same way). With an sshd listening on port 22 of every host's
address, that works on the emulated cloud unchanged, from any namespace of the instance.

Keys and configuration belong to the instance, never to the machine: ``STATE_DIR/ID/ssh/`` holds

- ``host_key``: one ed25519 host key that every host of the instance presents;
- ``id_ed25519``: the client key, the only entry of ``authorized_keys``;
- ``known_hosts``: the host key under every name of every host (``hostI``, namespace, address);
- ``sshd_config``: root logs in with that key only (no passwords, no PAM), on port 22;
- ``ssh_config``: the client side (identity, known_hosts, keep-alives). A copy is
  ``/etc/netns/NS/ssh/ssh_config`` for every namespace NS of the instance, which ``ip netns exec``
  mounts over ``/etc/ssh``, so a plain ``ssh host1`` run in the instance uses it and nothing in
  root's ``~/.ssh`` or the machine's ``/etc/ssh`` is read or written;
- ``sshd-hI.pid`` and ``sshd-hI.log``: each host's daemon.

The daemons run in the host namespaces, so ``down()`` (which kills every process left in them)
ends them with the network; ``host_down(abrupt=True)`` kills a host's daemon with the rest of its
processes, and ``host_up`` starts it again. They need Debian's openssh-server (``/usr/sbin/sshd``;
``scripts/setup_env.sh`` installs it) and its privilege separation directory ``/run/sshd``, which
is created when missing (it is the package's own, empty directory; it is left in place).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from .errors import NetemError
from .state import ETC_NETNS, Host, InstanceState, process_running

SSHD = "/usr/sbin/sshd"  # sshd must be started by its absolute path
SSH_PORT = 22  # every host has a network namespace, hence a port 22, of its own
PRIVSEP_DIR = Path("/run/sshd")
START_TIMEOUT_S = 20.0


def ssh_directory(state: InstanceState) -> Path:
    return state.directory / "ssh"


def identity_file(state: InstanceState) -> Path:
    """The client key that every host accepts (``horovodrun --ssh-identity-file``)."""
    return ssh_directory(state) / "id_ed25519"


def host_names(state: InstanceState, index: int, host: Host) -> list[str]:
    """Every name under which host ``index`` is known inside the instance."""
    return [f"host{index}", host.name, host.address]


def _require_tools() -> None:
    missing = [tool for tool in ("ssh", "ssh-keygen") if shutil.which(tool) is None]
    missing += [] if os.path.exists(SSHD) else [SSHD]
    if missing:
        raise NetemError(
            f"ssh on the emulated hosts needs {', '.join(missing)} (Debian: apt-get install openssh-server "
            "openssh-client; scripts/setup_env.sh installs them)")


def _keygen(path: Path, comment: str) -> None:
    try:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                       check=True, capture_output=True, text=True, timeout=30)
    except subprocess.CalledProcessError as err:
        raise NetemError(f"ssh-keygen failed: {err.stderr.strip()}") from None


def sshd_config(directory: Path) -> str:
    return "\n".join([
        "# sshd of an emulated cloud host, written by fasthorovod.netem; removed with the cloud",
        f"Port {SSH_PORT}",
        f"HostKey {directory / 'host_key'}",
        f"AuthorizedKeysFile {directory / 'authorized_keys'}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "UseDNS no",
        "X11Forwarding no",
        "PrintMotd no",
        "PrintLastLog no",
        # horovodrun opens one session per rank at once (and more for its interface probe)
        "MaxStartups 256:30:512",
        "MaxSessions 256",
        "",
    ])


def ssh_config(directory: Path) -> str:
    return "\n".join([
        "# ssh client inside an emulated cloud, written by fasthorovod.netem; removed with the cloud",
        "Host *",
        f"    IdentityFile {directory / 'id_ed25519'}",
        "    IdentitiesOnly yes",
        f"    UserKnownHostsFile {directory / 'known_hosts'}",
        "    GlobalKnownHostsFile /dev/null",
        "    StrictHostKeyChecking yes",
        "    BatchMode yes",
        "    ConnectTimeout 10",
        # a host taken away abruptly answers nothing: sessions to it end after 15 s
        "    ServerAliveInterval 5",
        "    ServerAliveCountMax 3",
        "    LogLevel ERROR",
        "",
    ])


def prepare(state: InstanceState) -> None:
    """Generate the instance's keys and write its sshd/ssh configuration and known_hosts."""
    _require_tools()
    directory = ssh_directory(state)
    directory.mkdir(mode=0o700, parents=True, exist_ok=False)
    _keygen(directory / "host_key", f"fasthorovod.netem {state.id} host key")
    _keygen(directory / "id_ed25519", f"fasthorovod.netem {state.id} client key")
    (directory / "authorized_keys").write_text((directory / "id_ed25519.pub").read_text())
    key_type, key = (directory / "host_key.pub").read_text().split()[:2]
    names = [name for index, host in enumerate(state.hosts) for name in host_names(state, index, host)]
    (directory / "known_hosts").write_text(f"{','.join(names)} {key_type} {key}\n")
    (directory / "sshd_config").write_text(sshd_config(directory))
    (directory / "ssh_config").write_text(ssh_config(directory))
    for namespace in state.namespaces:
        etc_ssh = ETC_NETNS / namespace / "ssh"
        etc_ssh.mkdir(parents=True, exist_ok=True)
        (etc_ssh / "ssh_config").write_text(ssh_config(directory))


def pid_file(state: InstanceState, index: int) -> Path:
    return ssh_directory(state) / f"sshd-h{index}.pid"


def start_sshd(state: InstanceState, indices: Sequence[int]) -> None:
    """Start the daemons of hosts ``indices`` (in parallel); return once each listens."""
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    directory = ssh_directory(state)
    started = []
    for index in indices:
        host = state.hosts[index]
        argv = ["ip", "netns", "exec", host.name, SSHD, "-f", str(directory / "sshd_config"),
                "-o", f"ListenAddress={host.address}", "-o", f"PidFile={pid_file(state, index)}",
                "-E", str(directory / f"sshd-h{index}.log")]
        # sshd forks into the background once it listens; the foreground process then exits.
        started.append((host, subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.PIPE, text=True)))
    problems = []
    for host, process in started:
        try:
            _, err = process.communicate(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
        if process.returncode != 0:
            problems.append(f"{host.name}: exit code {process.returncode}: {err.strip()}")
    if problems:
        raise NetemError("could not start sshd on the emulated hosts: " + "; ".join(problems))


def sshd_running(state: InstanceState, index: int) -> bool:
    """Whether host ``index``'s daemon (from its pid file) is alive."""
    try:
        pid = int(pid_file(state, index).read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return False
    return process_running(pid)
