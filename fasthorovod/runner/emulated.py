"""``fasthorovodrun --emulate-cloud HOSTS:LINK:PER_FLOW``: Horovod's own launcher on an emulated cloud.

The emulated hosts are real hosts to a launcher: every one runs an sshd, and the launcher namespace
(the bridge's, with an ``eth0`` on the emulated subnet) resolves them as ``host0``, ``host1``, ...
So this mode is a thin wrapper around the launcher that runs real clusters:

1. **The cloud.** ``fasthorovod.netem.EmulatedCloud(spec, ssh=True)`` brings up HOSTS network
   namespaces on a bridge (every host link capped at LINK, every TCP flow at PER_FLOW), an sshd on
   every host with keys made for this cloud only, and a host discovery script. It records what it
   creates before creating it, so a run killed with SIGKILL is cleaned up by the next run.
2. **The job.** The command line minus ``--emulate-cloud SPEC`` runs as ``ip netns exec BRIDGE
   python -m fasthorovod.runner ...``: that is ``fasthorovodrun`` for a real cluster, i.e.
   Horovod's runner (``horovod.runner.launch._run``, what ``horovodrun`` calls), with every
   horovodrun flag (elastic included) and FastHorovod's flags as given. Added only where the user
   gave none: ``--gloo`` (the default of this mode, as before; Horovod's own default is MPI when
   it is built with MPI), ``--network-interfaces eth0`` (skips Horovod's interface probe over
   ssh; every host and the launcher have exactly that interface), ``--disable-cache`` (the hosts
   are new every run, so horovodrun's cached ssh and interface checks in ``~/.horovod`` would
   describe another cloud), and the hosts: ``-H
   host0:P,host1:P,...`` with P = N/HOSTS ranks per host for ``-np N``, or for an elastic job
   (``--min-np``/``--max-np``) ``--host-discovery-script`` of the cloud, which ``python -m
   fasthorovod.netem host-down``/``host-up`` change while the job runs. Horovod then starts each
   remote rank with ``ssh hostI 'cd DIR; env VARS COMMAND'``, forwarding the launcher's
   environment (FASTHOROVOD_IFACE=eth0 is set there, so the proxies bind on the host's address).
3. **The end.** The job's exit status is ours (the first failed rank's, as ``fasthorovodrun``
   reports it on a real cluster). On SIGINT, SIGTERM or SIGHUP the launcher gets SIGTERM (Horovod
   stops its ranks), then its process group SIGKILL after ``STOP_GRACE_S`` (all but its
   multiprocessing resource tracker, which unlinks the launcher's semaphores once the processes it
   serves are gone; the teardown gives it ``TRACKER_GRACE_S``), and the exit status is 128 + signal.
   Whatever happened, the cloud is torn down (``finally``, ``atexit`` as a backstop): every process
   left in its namespaces (sshd, ranks, proxies, the launcher) is killed, the namespaces, hosts
   files, keys and discovery files removed. The launcher also dies with this process
   (``PR_SET_PDEATHSIG``).

What the wrapper no longer does itself (the real launcher does it): rendezvous, rank environment,
output prefixes and ``--output-filename``, killing the other ranks when one fails, and for
``--mpi`` the whole mpirun command (mpirun reaches the hosts over ssh as well).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from types import FrameType

import psutil

from fasthorovod.netem import EmulatedCloud, NetemError, NetemPermissionError
from fasthorovod.netem.cloud import HOST_DEVICE, is_resource_tracker, kill_rounds
from fasthorovod.netem.state import process_running
from fasthorovod.runner.launch import with_flags

PROG = "fasthorovodrun"
STOP_GRACE_S = 10.0  # after forwarding a signal, the launcher has this long to stop its ranks
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def is_elastic(args: argparse.Namespace) -> bool:
    """As horovod.runner.launch._is_elastic (plus --max-np, which Horovod only accepts with them)."""
    return bool(args.host_discovery_script or args.min_num_proc or args.max_num_proc)


def slots_per_host(args: argparse.Namespace, hosts: int) -> int:
    """Ranks per emulated host: --slots-per-host, else -np spread evenly (one per host when
    -np < HOSTS)."""
    if getattr(args, "slots", None):
        return int(args.slots)
    return max(1, (args.num_proc or hosts) // hosts)


def launcher_argv(args: argparse.Namespace, cloud: EmulatedCloud) -> list[str]:
    """The fasthorovodrun command line that runs the job from the cloud's launcher namespace:
    the user's, minus --emulate-cloud, plus the hosts, the interface and the controller when the
    user gave none (see the module docstring)."""
    added: list[str] = []
    if not (args.use_gloo or args.use_mpi or args.use_jsrun):
        added.append("--gloo")
    if not args.nics:
        added += ["--network-interfaces", HOST_DEVICE]
    if not args.disable_cache:  # the hosts are new every run: checks cached from another cloud mean nothing
        added.append("--disable-cache")
    if not (args.hosts or args.hostfile or args.host_discovery_script):
        if is_elastic(args):
            added += ["--host-discovery-script", cloud.discovery_script]
        else:
            used = min(args.num_proc, len(cloud.hosts))
            per_host = slots_per_host(args, len(cloud.hosts))
            added += ["-H", ",".join(f"{name}:{per_host}" for name in cloud.host_names()[:used])]
    return [sys.executable, "-m", "fasthorovod.runner", *added, *args.horovodrun_argv]


class _Interrupted(BaseException):
    """A handled signal arrived (BaseException: nothing on the way may swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _exit_status(returncode: int) -> int:
    """Popen's returncode as a shell reports it (killed by signal S -> 128 + S)."""
    return 128 - returncode if returncode < 0 else returncode


def _group_pids(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    pids = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid and process_running(pid):
                pids.append(pid)
        except ProcessLookupError:  # gone meanwhile
            continue
    return pids


def _die_with_parent() -> None:
    """In the launcher, before exec: SIGTERM when this process dies, even by SIGKILL."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class EmulatedJob:
    """One ``fasthorovodrun --emulate-cloud`` run; ``run()`` returns the exit status."""

    def __init__(self, args: argparse.Namespace, fasthorovod_env: Mapping[str, str]) -> None:
        self.args = args
        self.spec = args.emulate_cloud
        self.fasthorovod_env = dict(fasthorovod_env)
        self.verbose = bool(args.verbose)
        self.cloud = EmulatedCloud(self.spec, ssh=True, slots_per_host=slots_per_host(args, self.spec.hosts))
        self.launcher: subprocess.Popen | None = None
        self._tearing_down = False
        self._torn_down = False

    def run(self) -> int:
        previous = {signum: signal.signal(signum, self._on_signal) for signum in _HANDLED_SIGNALS}
        atexit.register(self.teardown)
        try:
            try:
                self._bring_up()
                return self._run_launcher()
            except _Interrupted as interrupted:
                self._say(f"{interrupted} received: stopping the job and tearing the network down")
                self._stop_launcher(interrupted.signum)
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
        if not self._tearing_down:
            raise _Interrupted(signum)

    def _say(self, text: str) -> None:
        print(f"{PROG}: {text}", file=sys.stderr, flush=True)

    def _bring_up(self) -> None:
        np = self.args.num_proc
        if np and np < self.spec.hosts and not (self.args.hosts or self.args.hostfile or is_elastic(self.args)):
            self._say(f"note: -np {np} < {self.spec.hosts} emulated hosts: one rank on each of the "
                      f"first {np} hosts, the others stay idle")
        started = time.monotonic()
        self.cloud.up()
        if self.verbose:
            self._say(f"emulated cloud {self.cloud.id} ({self.spec}) up in {time.monotonic() - started:.1f} s; "
                      f"launcher at {self.cloud.launcher_address} in {self.cloud.launcher_namespace}; hosts: "
                      + ", ".join(f"{h.name}={h.address}" for h in self.cloud.hosts))

    def _launcher_env(self) -> dict[str, str]:
        env = with_flags(os.environ, self.fasthorovod_env)
        env["FASTHOROVOD_IFACE"] = HOST_DEVICE  # the proxies bind on the host's own address
        return env

    def _run_launcher(self) -> int:
        argv = ["ip", "netns", "exec", self.cloud.launcher_namespace, *launcher_argv(self.args, self.cloud)]
        if self.verbose:
            self._say("running: " + shlex.join(argv))
        # Signals wait while the launcher starts, so that a started launcher is always in self.launcher.
        signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED_SIGNALS)
        try:
            self.launcher = subprocess.Popen(argv, env=self._launcher_env(), stdin=subprocess.DEVNULL,
                                             start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _HANDLED_SIGNALS)
        return _exit_status(self.launcher.wait())

    def _stop_launcher(self, signum: int) -> None:
        """SIGTERM the launcher (Horovod then stops its ranks), SIGKILL its group but resource trackers after
        STOP_GRACE_S."""
        launcher = self.launcher
        if launcher is None or launcher.poll() is not None:
            return
        self._tearing_down = True  # a second signal must not interrupt the stopping
        launcher.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
        try:
            launcher.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        # Not its resource tracker: killed, it would leave the launcher's semaphores in /dev/shm. It
        # runs in the launcher's namespace, where the cloud's teardown kills it if it stays.
        kill_rounds(lambda: _group_pids(launcher.pid), rounds=10, spare=is_resource_tracker)
        launcher.wait()

    def teardown(self) -> None:
        """Stop the launcher if it still runs, take the cloud down. Idempotent, never raises."""
        if self._torn_down:
            return
        self._tearing_down = True
        try:
            if self.launcher is not None and self.launcher.poll() is None:
                self._stop_launcher(signal.SIGTERM)
            try:
                self.cloud.down()  # also kills whatever still runs in its namespaces (sshd, ranks)
            except NetemError as err:
                self._say(f"warning: could not tear the emulated network down: {err} "
                          "(python -m fasthorovod.netem down --all removes it)")
        finally:
            self._torn_down = True


def run_emulated(args: argparse.Namespace, fasthorovod_env: Mapping[str, str]) -> int:
    """Run the job of a parsed ``fasthorovodrun --emulate-cloud`` command line; its exit status."""
    return EmulatedJob(args, fasthorovod_env).run()
