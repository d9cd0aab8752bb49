"""``fasthorovodrun --emulate-cloud HOSTS:LINK:PER_FLOW``: a job on an emulated public-cloud network.

What happens, in order:

1. **The network.** ``fasthorovod.netem.EmulatedCloud`` brings up HOSTS network namespaces on a
   bridge, every host link capped at LINK and every TCP flow at PER_FLOW (docs/netem.md). It
   records what it creates before creating it, so a run killed with SIGKILL is cleaned up by the
   next run (``cleanup_stale``).
2. **Where the launcher is reachable.** The ranks live in the host namespaces; the launcher does
   not. The rendezvous server therefore gets an address of the emulated subnet on the bridge
   itself: ``br0`` in the bridge namespace gets the subnet's last address (``10.231.N.254``), and
   the server's listening socket is created inside the bridge namespace (the launcher's main
   thread enters it with ``setns`` just for ``bind``, then returns; a socket stays in the
   namespace it was created in). We chose the bridge over one more emulated host because the
   bridge already exists, is one hop from every host, carries no workload (a rank host would
   share its capped link with the launcher's traffic), and needs no change to the topology or to
   ``fasthorovod.netem``. The rendezvous traffic (a few kB) crosses the hosts' shaped links like
   any other traffic. Nothing is sent to an address outside the namespaces this run created.
3. **Ranks (Gloo, the default).** Horovod's own pieces do what ``horovodrun --gloo`` does:
   ``hosts.get_host_assignments`` plans the slots (host *i* gets ranks ``i*P .. i*P+P-1``, P = N /
   HOSTS), ``RendezvousServer`` serves Gloo's rendezvous, ``gloo_run.create_slot_env_vars`` and
   ``create_run_env_vars`` give each rank its HOROVOD_* variables (with HOROVOD_GLOO_IFACE=eth0,
   the namespace's interface, and FASTHOROVOD_IFACE=eth0 for the proxies), and
   ``safe_shell_exec.prefix_connection`` prefixes every output line like horovodrun
   (``[rank]<stdout>:``). Each rank runs as ``ip netns exec HOST COMMAND`` in a session of its own
   (its proxies share its process group), with the launcher's environment, as horovodrun gives
   local ranks.
4. **Ranks (MPI, ``--mpi``).** Horovod's ``mpi_run`` builds the same mpirun command as
   ``horovodrun --mpi``, with two tools on its PATH: an ``mpirun`` that runs the real one inside the
   bridge namespace (so that the daemons in the hosts can reach it at the bridge address), and a
   ``plm_rsh_agent`` that starts each host's daemon with ``ip netns exec HOST sh -c ...`` where
   mpirun would use ssh. The hosts are the namespace names, which resolve inside the emulation
   (``/etc/netns/NS/hosts``).
5. **The end.** The job ends when every rank exited, at the first failure (the others are
   terminated, the first non-zero exit status is ours), when ranks that started the rendezvous
   wait more than ``--start-timeout`` seconds for the rest, or on SIGINT/SIGTERM/SIGHUP (exit
   status 128 + signal). Whatever happened, the ranks are killed and the network is torn down
   (``finally``, plus ``atexit`` as a last resort).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import ipaddress
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import IO, Any

from fasthorovod.netem import EmulatedCloud, Host, NetemError, NetemPermissionError, exec_prefix
from fasthorovod.netem.cloud import BRIDGE_DEVICE, HOST_DEVICE
from fasthorovod.netem.state import ETC_NETNS

PROG = "fasthorovodrun"
TERMINATION_GRACE_S = 3.0  # SIGTERM, then SIGKILL after this long
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# --------------------------------------------------------------------------------------------
# Entering a network namespace from this process (for the rendezvous server's socket)

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns(CLONE_NEWNET) failed: {os.strerror(errno)}")


@contextlib.contextmanager
def network_namespace(name: str) -> Iterator[None]:
    """Run the body with the calling thread in network namespace ``name`` (``/run/netns/NAME``).

    Sockets created inside stay in that namespace for their whole life; other threads are not
    affected. The thread returns to its own namespace on exit, or the process stops: a launcher
    thread left in the wrong namespace would send its traffic to the wrong network.
    """
    with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{name}") as target:
        _setns(target.fileno())
        try:
            yield
        finally:
            try:
                _setns(home.fileno())
            except OSError as err:  # cannot happen short of a kernel bug; never carry on
                print(f"{PROG}: fatal: could not return to the launcher's network namespace: {err}",
                      file=sys.stderr, flush=True)
                os._exit(70)


# --------------------------------------------------------------------------------------------
# Rendezvous server with a record of which ranks reached it


def _tracking_handler():
    from horovod.runner.http.http_server import RendezvousHandler

    class TrackingRendezvousHandler(RendezvousHandler):
        """Horovod's rendezvous handler; also records which ranks put their address (scope
        ``global``, key = the rank), for the --start-timeout check."""

        def do_PUT(self) -> None:
            parts = self.path.split("/")
            if len(parts) == 3 and parts[1] == "global":
                server = self.server
                with server.cache_lock:
                    if server.first_contact is None:
                        server.first_contact = time.monotonic()
                    server.ranks_seen.add(parts[2])
            super().do_PUT()

    return TrackingRendezvousHandler


class Rendezvous:
    """Horovod's RendezvousServer, listening in ``namespace`` (all its addresses)."""

    def __init__(self, namespace: str, verbose: bool) -> None:
        from horovod.runner.http.http_server import RendezvousServer

        self._server = RendezvousServer(verbose=2 if verbose else 0)
        with network_namespace(namespace):
            self.port = self._server.start(_tracking_handler())
        httpd = self._server._httpd
        httpd.first_contact = None
        httpd.ranks_seen = set()
        self._httpd = httpd
        self._stopped = False

    def init(self, host_alloc_plan: Sequence[Any]) -> None:
        self._server.init(host_alloc_plan)

    def waiting_since(self) -> float | None:
        """When the first rank reached the rendezvous (time.monotonic()), or None."""
        return self._httpd.first_contact

    def ranks_seen(self) -> set[int]:
        with self._httpd.cache_lock:
            keys = set(self._httpd.ranks_seen)
        return {int(key) for key in keys if key.isdigit()}

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._server.stop()
            self._httpd.server_close()


# --------------------------------------------------------------------------------------------
# The job


class _Interrupted(BaseException):
    """A handled signal arrived (BaseException: nothing on the way may swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _exit_status(returncode: int) -> int:
    """Popen's returncode as a shell reports it (killed by signal S -> 128 + S)."""
    return 128 - returncode if returncode < 0 else returncode


def _pad_rank(rank: int, size: int) -> str:
    """As horovodrun names rank.<rank> directories (zero-padded for lexicographic order)."""
    return str(rank).zfill(len(str(max(size - 1, 0))))


class _Tee:
    """A text stream that writes to several (horovodrun's gloo_run.MultiFile)."""

    def __init__(self, *streams: IO[str]) -> None:
        self._streams = streams

    def write(self, text: str) -> None:
        for stream in self._streams:
            stream.write(text)

    def flush(self) -> None:
        for stream in self._streams:
            stream.flush()


class _Rank:
    """One rank's process (``ip netns exec HOST COMMAND``, its own session) and output pumps."""

    def __init__(self, rank: int, host: Host, argv: Sequence[str], env: Mapping[str, str],
                 output_dir: str | None, size: int, timestamps: bool, exits: queue.Queue) -> None:
        from horovod.runner.common.util.safe_shell_exec import prefix_connection

        self.rank = rank
        self.host = host
        self._files: list[IO[str]] = []
        stdout: IO[str] | _Tee = sys.stdout
        stderr: IO[str] | _Tee = sys.stderr
        if output_dir:
            rank_dir = os.path.join(output_dir, f"rank.{_pad_rank(rank, size)}")
            os.makedirs(rank_dir, exist_ok=True)
            self._files = [open(os.path.join(rank_dir, name), "w") for name in ("stdout", "stderr")]
            stdout, stderr = _Tee(sys.stdout, self._files[0]), _Tee(sys.stderr, self._files[1])
        self.process = subprocess.Popen([*exec_prefix(host), *argv], env=dict(env), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self._threads = [
            threading.Thread(target=prefix_connection, daemon=True, name=f"rank{rank}-{name}",
                             args=(pipe, stream, name, rank, timestamps))
            for pipe, stream, name in ((self.process.stdout, stdout, "stdout"),
                                       (self.process.stderr, stderr, "stderr"))
        ]
        self._threads.append(threading.Thread(target=self._wait, args=(exits,), daemon=True, name=f"rank{rank}-wait"))
        for thread in self._threads:
            thread.start()

    def _wait(self, exits: queue.Queue) -> None:
        code = self.process.wait()
        exits.put((time.monotonic(), self.rank, _exit_status(code)))

    def signal_group(self, signum: int) -> None:
        """Signal the rank's process group: the rank and its proxies (even after the rank exited)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def finish(self, timeout: float) -> None:
        """Wait for the output pumps (they end when every writer of the pipes has gone)."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for f in self._files:
            f.close()


class EmulatedJob:
    """One ``fasthorovodrun --emulate-cloud`` run; ``run()`` returns the exit status."""

    def __init__(self, args: argparse.Namespace, fasthorovod_env: Mapping[str, str]) -> None:
        self.args = args
        self.spec = args.emulate_cloud
        self.np = args.num_proc
        self.hosts_used = min(self.np, self.spec.hosts)
        self.slots_per_host = max(1, self.np // self.spec.hosts)
        self.fasthorovod_env = dict(fasthorovod_env)
        self.verbose = bool(args.verbose)
        self.start_timeout = float(args.start_timeout or os.environ.get("HOROVOD_START_TIMEOUT", "30"))
        self.cloud = EmulatedCloud(self.spec)
        self.ranks: list[_Rank] = []
        self.rendezvous: Rendezvous | None = None
        self.bridge_address: str | None = None
        self._scratch: str | None = None
        self._signal: int | None = None
        self._tearing_down = False
        self._torn_down = False

    # -- lifecycle ------------------------------------------------------------------------------

    def run(self) -> int:
        previous = {signum: signal.signal(signum, self._on_signal) for signum in _HANDLED_SIGNALS}
        atexit.register(self.teardown)
        try:
            try:
                self._bring_up()
                return self._run_mpi() if self.args.use_mpi else self._run_gloo()
            except _Interrupted as interrupted:
                self._say(f"{interrupted} received: stopping the ranks and tearing the network down")
                return 128 + interrupted.signum
            except NetemPermissionError as err:
                self._say(f"error: --emulate-cloud: {err}")
                self._say("to run the job without the emulated network, drop --emulate-cloud (the ranks then "
                          "talk over this machine's loopback, with no bandwidth caps)")
                return 2
            except (NetemError, OSError) as err:
                self._say(f"error: --emulate-cloud: {err}")
                return 1
            finally:
                self.teardown()
        finally:
            atexit.unregister(self.teardown)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signal is None:
            self._signal = signum
        if not self._tearing_down:
            raise _Interrupted(signum)

    def _say(self, text: str) -> None:
        print(f"{PROG}: {text}", file=sys.stderr, flush=True)

    def _bring_up(self) -> None:
        if self.np < self.spec.hosts:
            self._say(f"note: -np {self.np} < {self.spec.hosts} emulated hosts: one rank on each of the "
                      f"first {self.np} hosts, the others stay idle")
        started = time.monotonic()
        self.cloud.up()
        subnet = ipaddress.IPv4Network(self.cloud.state.subnet)
        taken = {host.address for host in self.cloud.hosts}
        address = next(str(a) for a in reversed(list(subnet.hosts())) if str(a) not in taken)
        subprocess.run(["ip", "-n", self.cloud.bridge_namespace, "addr", "add", f"{address}/{subnet.prefixlen}",
                        "dev", BRIDGE_DEVICE], check=True, capture_output=True, timeout=30)
        self.bridge_address = address
        self._write_bridge_hosts_file()
        if self.verbose:
            self._say(f"emulated cloud {self.cloud.id} ({self.spec}) up in {time.monotonic() - started:.1f} s; "
                      f"launcher at {address} in {self.cloud.bridge_namespace}; hosts: "
                      + ", ".join(f"{h.name}={h.address}" for h in self.cloud.hosts))

    def _write_bridge_hosts_file(self) -> None:
        """/etc/hosts for commands run with ``ip netns exec BRIDGE`` (mpirun): the host names.
        netem's down() removes /etc/netns/NS for every namespace of the instance, this one too."""
        directory = ETC_NETNS / self.cloud.bridge_namespace
        directory.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1\tlocalhost", f"{self.bridge_address}\t{socket.gethostname()}",
                 *(f"{host.address}\t{host.name}" for host in self.cloud.hosts)]
        (directory / "hosts").write_text("# written by fasthorovodrun --emulate-cloud\n" + "\n".join(lines) + "\n")

    def teardown(self) -> None:
        """Kill the ranks, stop the rendezvous, take the network down. Idempotent, never raises."""
        if self._torn_down:
            return
        self._tearing_down = True
        try:
            self._kill_ranks()
            if self.rendezvous is not None:
                with contextlib.suppress(Exception):
                    self.rendezvous.stop()
            try:
                self.cloud.down()  # also kills whatever still runs in its namespaces
            except NetemError as err:
                self._say(f"warning: could not tear the emulated network down: {err} "
                          "(python -m fasthorovod.netem down --all removes it)")
            deadline = time.monotonic() + 5  # every writer of the ranks' pipes is gone by now
            for rank in self.ranks:
                rank.finish(timeout=max(0.0, deadline - time.monotonic()))
            if self._scratch:
                shutil.rmtree(self._scratch, ignore_errors=True)
        finally:
            self._torn_down = True

    def _kill_ranks(self) -> None:
        """SIGTERM the process group (rank and proxies) of every rank still running, SIGKILL after
        TERMINATION_GRACE_S. Groups of ranks that exited are left alone (their id may have been
        reused); whatever they left in the namespaces dies with the network (cloud.down())."""
        alive = [rank for rank in self.ranks if rank.process.poll() is None]
        for rank in alive:
            rank.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + TERMINATION_GRACE_S
        for rank in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rank.process.wait(max(0.0, deadline - time.monotonic()))
        for rank in alive:
            if rank.process.poll() is None:
                rank.signal_group(signal.SIGKILL)

    # -- environment ----------------------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        """What every rank gets: the launcher's environment, horovodrun's tunables from the flags
        (--fusion-threshold-mb, --cycle-time-ms, --timeline-filename, ...), our flags' variables."""
        from horovod.runner.common.util import config_parser

        env = dict(os.environ)
        config_parser.set_env_from_args(env, self.args)
        env = {key: str(value) for key, value in env.items()}
        env.update(self.fasthorovod_env)
        env["FASTHOROVOD_IFACE"] = HOST_DEVICE
        env["PYTHONUNBUFFERED"] = "1"  # as horovodrun: the output arrives line by line
        return env

    def _host_alloc_plan(self) -> list[Any]:
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

        hosts = self.cloud.hosts[: self.hosts_used]
        return get_host_assignments(parse_hosts(",".join(f"{h.name}:{self.slots_per_host}" for h in hosts)), self.np)

    # -- Gloo -----------------------------------------------------------------------------------

    def _run_gloo(self) -> int:
        from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars

        plan = self._host_alloc_plan()
        self.rendezvous = Rendezvous(self.cloud.bridge_namespace, self.verbose)
        self.rendezvous.init(plan)
        env = self._base_env()
        env.update({k: str(v) for k, v in create_run_env_vars(self.bridge_address, [HOST_DEVICE],
                                                              self.rendezvous.port).items()})
        if self.args.output_filename:
            os.makedirs(self.args.output_filename, exist_ok=True)
        hosts = {host.name: host for host in self.cloud.hosts}
        exits: queue.Queue = queue.Queue()
        if self.verbose:
            self._say(f"rendezvous at {self.bridge_address}:{self.rendezvous.port}; command: "
                      + shlex.join(self.args.command))
        # Signals wait while a rank starts, so that every started process is in self.ranks.
        for slot in plan:
            signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED_SIGNALS)
            try:
                self.ranks.append(_Rank(slot.rank, hosts[slot.hostname], self.args.command,
                                        {**env, **create_slot_env_vars(slot)}, self.args.output_filename,
                                        self.np, self.args.prefix_output_with_timestamp, exits))
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED_SIGNALS)
            if self.verbose:
                self._say(f"rank {slot.rank} on {slot.hostname} ({hosts[slot.hostname].address}), "
                          f"pid {self.ranks[-1].process.pid}")
        return self._supervise(exits)

    def _supervise(self, exits: queue.Queue) -> int:
        """Wait for every rank; stop at the first failure or a rendezvous timeout."""
        remaining = {rank.rank for rank in self.ranks}
        while remaining:
            try:
                _, rank, code = exits.get(timeout=0.2)
            except queue.Empty:
                late = self._rendezvous_late()
                if late:
                    self._say(f"error: ranks {late} did not reach Horovod's rendezvous within "
                              f"--start-timeout {self.start_timeout:g} s of the first rank; stopping the job")
                    return 1
                continue
            remaining.discard(rank)
            if code != 0:
                print(f"Process {rank} exit with status code {code}.", flush=True)
                if remaining:
                    print(f"Terminating remaining workers after failure of Process {rank}.", flush=True)
                return code
        return 0

    def _rendezvous_late(self) -> list[int]:
        """Ranks still running that have not reached the rendezvous although the first rank did
        more than start_timeout seconds ago (a rank that never calls hvd.init() is not waited for
        as long as no rank has)."""
        since = self.rendezvous.waiting_since() if self.rendezvous else None
        if since is None or time.monotonic() - since < self.start_timeout:
            return []
        seen = self.rendezvous.ranks_seen()
        return [r.rank for r in self.ranks if r.rank not in seen and r.process.poll() is None]

    # -- MPI ------------------------------------------------------------------------------------

    def _run_mpi(self) -> int:
        from horovod.runner.common.util import secret
        from horovod.runner.common.util import settings as hvd_settings
        from horovod.runner.mpi_run import _LARGE_CLUSTER_THRESHOLD, mpi_run

        real_mpirun = shutil.which("mpirun")
        if real_mpirun is None:
            self._say("error: --mpi: mpirun not found on PATH (apt-get install openmpi-bin)")
            return 2
        self._scratch = tempfile.mkdtemp(prefix="fasthorovodrun-")
        agent = self._write_tool("netns-rsh", _RSH_AGENT)
        self._write_tool("mpirun", _MPIRUN_SHIM.format(
            bridge=shlex.quote(self.cloud.bridge_namespace), mpirun=shlex.quote(real_mpirun)))
        env = self._base_env()
        env["PATH"] = self._scratch + os.pathsep + env.get("PATH", "")
        subnet = self.cloud.state.subnet
        hosts = self.cloud.hosts[: self.hosts_used]
        extra = [f"-mca plm_rsh_agent {agent}", f"-mca oob_tcp_if_include {subnet}"]
        if len(hosts) < _LARGE_CLUSTER_THRESHOLD:  # mpi_run adds it itself for large clusters
            extra.append("-mca plm_rsh_no_tree_spawn 1")
        if self.args.mpi_args:
            extra.append(self.args.mpi_args)
        settings = hvd_settings.Settings(
            verbose=2 if self.verbose else 0, extra_mpi_args=" ".join(extra), tcp_flag=self.args.tcp_flag,
            binding_args=self.args.binding_args, key=secret.make_secret_key(), num_proc=self.np,
            hosts=",".join(f"{h.name}:{self.slots_per_host}" for h in hosts),
            output_filename=self.args.output_filename,
            run_func_mode=True,  # returns (and raises on failure) instead of exec'ing mpirun
            nics={HOST_DEVICE}, prefix_output_with_timestamp=self.args.prefix_output_with_timestamp)
        try:
            mpi_run(settings, {HOST_DEVICE}, env, self.args.command, stdout=sys.stdout, stderr=sys.stderr)
        except RuntimeError as err:
            if self._signal is not None:  # safe_shell_exec stopped mpirun on our signal
                raise _Interrupted(self._signal) from None
            match = re.search(r"exit code (-?\d+)", str(err))
            code = int(match.group(1)) if match else 1
            return code if 0 < code < 256 else 1
        if self._signal is not None:
            raise _Interrupted(self._signal)
        return 0

    def _write_tool(self, name: str, text: str) -> str:
        path = os.path.join(self._scratch, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        return path


# mpirun calls the agent as ssh: ``AGENT [OPTIONS] HOST COMMAND...``; COMMAND is a shell command line
# (PATH=...; export PATH; ... orted ...), which ssh would hand to the remote login shell.
_RSH_AGENT = """#!/bin/sh
# plm_rsh_agent of fasthorovodrun --emulate-cloud: runs mpirun's command in HOST's namespace.
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host="$1"; shift
exec ip netns exec "$host" /bin/sh -c "$*"
"""

# Horovod's mpi_run runs `mpirun ...` from PATH; this one runs the real mpirun in the bridge namespace.
_MPIRUN_SHIM = """#!/bin/sh
exec ip netns exec {bridge} {mpirun} "$@"
"""


def run_emulated(args: argparse.Namespace, fasthorovod_env: Mapping[str, str]) -> int:
    """Run the job of a parsed ``fasthorovodrun --emulate-cloud`` command line; its exit status."""
    return EmulatedJob(args, fasthorovod_env).run()
