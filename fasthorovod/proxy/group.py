"""ProxyGroup: the k proxy processes of one worker, from spawn to reaping.

Start-up (inside ``hvd.init()``, only when size > 1 and FASTHOROVOD_NUM_PROXIES > 0):

1. rank 0 draws a random 16-byte job token; ``broadcast_object`` gives it to every rank (Horovod's
   control plane, no home-made rendezvous); rank 0 starts the negotiation's coordinator
   (csrc/negotiation/coordinator.h); ``allgather_object`` exchanges each worker's address, CPU
   count, coordinator and path-probe ports;
2. when the ranks span hosts, the path probe measures every ring hop and the ranks choose the
   lanes k and the sockets per lane from the exchanged curves (probe.py; the settings win where set);
3. the worker creates its shared-memory channel for k lanes (an anonymous memfd: no name anywhere)
   and one Unix socket pair per proxy, and spawns ``python -m fasthorovod.proxy FD j`` for j < k,
   each in a process group of its own with its end of the pair inherited as FD; the proxy receives
   the channel's descriptor on it (and later every data buffer's), binds on the job's interface and
   reports its port in the channel; ``allgather_object`` exchanges the ports; lane j of rank r is
   told the address of lane j of rank r+1, connects, and accepts lane j of rank r−1 (a mutual
   challenge-response handshake: both ends prove they hold the token, which never travels, and
   agree on ranks, lane and configuration hash; csrc/transport/socket.h);
4. each worker's member connects to the coordinator (the same handshake); from then on every request is submitted to
   the member, which posts it to the proxies in the order the ranks negotiated;
5. from then on the channel reaps any proxy the moment it exits (csrc/proxy/watch.h: a pidfd per
   proxy, or waitpid polling where pidfds are missing), so none stays a zombie.

``close()`` (``hvd.shutdown()`` or interpreter exit) aborts collectives still in flight, stops the
proxies, gives them :data:`SHUTDOWN_GRACE_SECONDS` to exit, kills any that have not, and reaps them
all. If the worker process dies, whichever thread started the proxies, each proxy sees it at once
(a pidfd of the worker, or getppid() polling) and exits; a proxy that was stopped (SIGSTOP) then
gets SIGHUP and SIGCONT from the kernel, since the worker's death orphans its process group. No
shared memory has a name, so nothing is left in /dev/shm by any crash.

What callers above use (the data plane's public API): :meth:`ProxyGroup.supports` (dtypes the
proxies carry), :meth:`ProxyGroup.alloc` (a zero-copy shared-memory tensor), :meth:`ProxyGroup.allreduce`
and :meth:`ProxyGroup.allgather` (asynchronous requests), and the mechanisms that policies above
steer: :meth:`ProxyGroup.lane_stats`, :meth:`ProxyGroup.set_lane_weights` (lane rebalancing,
fasthorovod/proxy/balance.py) and :meth:`ProxyGroup.begin_join`/:meth:`ProxyGroup.end_join`
(``hvd.join()``, through the negotiation). Nothing here blocks on another rank except a wait on
a request or on the join; nothing here talks to Horovod after start-up.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from fasthorovod import _C
from fasthorovod.config import Config, ConfigError
from fasthorovod.exceptions import FastHorovodError
from fasthorovod.proxy import hosts as host_layout
from fasthorovod.proxy import probe
from fasthorovod.proxy.buffers import Buffer, BufferPool, copy_tensor, zero_tensor

# At shutdown, how long the proxies get to exit on their own before they are killed (a proxy that
# is aborting a collective may spend seconds telling its neighbours; hvd.shutdown() must not).
SHUTDOWN_GRACE_SECONDS = 0.3

# What this process's last path probe measured: the addresses of that world's hosts and every hop's
# curve. A later data plane of the same process (an elastic reset, restart_proxies()) whose hosts
# are all among them takes the choice from these curves instead of measuring again; rank 0's memory
# decides, so every rank agrees. A new process (a new job, a worker that joins) has none.
_last_probe: Optional[Tuple[FrozenSet[str], List[Dict[int, float]]]] = None

# torch dtype -> the core's dtype code, from the names the core exports (one table, in C++).
# Private to the data plane: callers ask ProxyGroup.supports(dtype).
DTYPE_CODES = {getattr(torch, name): code for name, code in _C.DTYPES.items()}
OP_SUM, OP_AVERAGE, OP_GATHER, OP_BROADCAST = _C.OP_SUM, _C.OP_AVERAGE, _C.OP_GATHER, _C.OP_BROADCAST

# A broadcast travels as a sum of the tensor's bytes read as integers of the element's width
# (ProxyGroup.broadcast): the integer dtype for each element size.
BROADCAST_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def native(cls, **fields):
    """An instance of the bound struct `cls` (``_C.Request``, ``_C.ChannelConfig``, ...) with `fields`
    set; the rest keep the core's defaults."""
    obj = cls()
    for name, value in fields.items():
        setattr(obj, name, value)
    return obj


def request(**fields) -> "_C.Request":
    """A ``_C.Request`` with `fields` set."""
    return native(_C.Request, **fields)


def channel_config(cfg: Config, rank: int, size: int, token: bytes, bind_host: str) -> "_C.ChannelConfig":
    """The settings the proxies read from the channel (the wire settings of `cfg`, this rank's place;
    the sockets per lane are given at connect time)."""
    return native(_C.ChannelConfig, num_lanes=cfg.num_proxies, rank=rank, size=size,
                  socket_buffer_bytes=cfg.socket_buffer_bytes,
                  segment_bytes=cfg.segment_bytes, timeout_seconds=cfg.timeout_seconds,
                  config_hash=cfg.wire_hash(), token=token, bind_host=bind_host)


def bind_address(config: Config) -> str:
    """The IPv4 address proxies listen on: FASTHOROVOD_IFACE, HOROVOD_GLOO_IFACE, or the hostname's."""
    iface = config.iface or os.environ.get("HOROVOD_GLOO_IFACE") or None
    if iface:
        import psutil

        addrs = psutil.net_if_addrs().get(iface)
        if addrs is None:
            raise ConfigError(f"network interface {iface!r} (FASTHOROVOD_IFACE/HOROVOD_GLOO_IFACE) does not exist")
        for addr in addrs:
            if addr.family == socket.AF_INET:
                return addr.address
        raise ConfigError(f"network interface {iface!r} has no IPv4 address")
    return socket.gethostbyname(socket.gethostname())


class Request:
    """One posted allreduce (possibly several tensors fused into one staging buffer)."""

    def __init__(self, group: "ProxyGroup", ticket: int, buffer: Buffer, staged: bool,
                 tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
        self._group = group
        self.ticket = ticket  # the negotiation's ticket (also the proxies' trace request number)
        self._buffer = buffer
        self._staged = staged
        self._tensors = tensors
        self._outputs = outputs
        self._offsets = offsets
        self._done = False

    def poll(self) -> bool:
        return self._done or self._group.member.poll(self.ticket)

    def wait(self) -> None:
        """Blocks (GIL released) until done; copies results out; raises FastHorovodError on failure."""
        if self._done:
            return
        try:
            self._group.member.wait(self.ticket, self._group.config.timeout_seconds)
        except BaseException:
            self._finish()
            raise
        if self._staged:
            self._copy_out()
        self._finish()

    def _copy_out(self) -> None:
        for out, offset in zip(self._outputs, self._offsets):
            copy_tensor(out.view(-1), self._buffer.view(out.dtype, offset, out.numel()))

    def _finish(self) -> None:
        self._done = True
        if self._staged:
            self._group.pool.release(self._buffer)
        self._tensors = self._outputs = ()


class GatherRequest(Request):
    """A posted allgather (ProxyGroup.allgather): on wait() the (size, n) output holds rank r's
    words in row r."""

    def __init__(self, group: "ProxyGroup", ticket: int, buffer: Buffer, output: torch.Tensor,
                 bounds: Optional[Sequence[int]]) -> None:
        super().__init__(group, ticket, buffer, True, (), (output,), (0,))
        self._bounds = bounds
        self.output = output  # (size, n); complete once wait() returned

    def _copy_out(self) -> None:
        (out,) = self._outputs
        size = out.shape[0]
        if self._bounds is None:  # summed rows (the hierarchical allreduce): row r is rank r's
            copy_tensor(out.view(-1), self._buffer.view(out.dtype, 0, out.numel()))
            return
        for begin, end in zip(self._bounds[:-1], self._bounds[1:]):
            # The lane's region holds size chunks of its columns; chunk c is rank c-1's (the ring's
            # allgather starts from chunk rank+1), so row r of the output is chunk r+1.
            chunks = self._buffer.view(out.dtype, size * begin * out.element_size(), size * (end - begin)).view(
                size, end - begin)
            for row in range(size):
                copy_tensor(out[row, begin:end], chunks[(row + 1) % size])


def proxy_command(fd: int, lane: int) -> List[str]:
    """``python -P -m fasthorovod.proxy FD LANE``: -P (Python 3.11+) keeps the worker's current
    directory off sys.path, so a file there named like a module (e.g. ``fasthorovod/``, ``torch.py``)
    cannot shadow the proxy's imports."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "fasthorovod.proxy", str(fd), str(lane)]


def spawn_proxy(channel: "_C.ProxyChannel", lane: int) -> subprocess.Popen:
    """Starts lane's proxy with its end of the channel's socket pair as its only inherited descriptor,
    in a process group of its own: if the worker dies while the proxy is stopped, the orphaned group
    makes the kernel send it SIGHUP and SIGCONT, so it exits instead of staying behind stopped."""
    fd = channel.proxy_fd(lane)
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    return subprocess.Popen(proxy_command(fd, lane), env=proxy_environment(), stdin=subprocess.DEVNULL,
                            close_fds=True, pass_fds=(fd,), **group)


def proxy_environment() -> dict:
    """The worker's environment, with the directory this fasthorovod was imported from first on
    PYTHONPATH: the proxies run the worker's copy of the package, wherever it came from."""
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    return env


class ProxyGroup:
    def __init__(self, config: Config, rank: int, size: int) -> None:
        self.config = config
        self.rank = rank
        self.size = size
        self.channel: Optional[_C.ProxyChannel] = None
        self.coordinator: Optional[_C.Coordinator] = None  # rank 0 only
        self.member: Optional[_C.Member] = None
        self.pool: Optional[BufferPool] = None
        self.processes: List[subprocess.Popen] = []
        self.lane_weights = [1.0] * config.num_proxies
        self.sockets_per_lane = config.sockets_per_proxy or 1
        self.probe_seconds = 0.0  # how long the probe and the exchange of its curves took
        self.probe_run_seconds: List[float] = []  # of which each run (first, then the second probe's)
        self.probe_runs = 0  # 2 when the hops' knees disagreed and the probe measured again; 0: reused
        self.rechecked_flows: Optional[Tuple[int, int]] = None  # the flow counts the second probe measured
        self.flow_choice: Optional[probe.FlowChoice] = None  # when the path probe chose the sockets
        self.lanes_because = "lanes from FASTHOROVOD_NUM_PROXIES" if config.num_proxies_from_env else "default lanes"
        self.startup_seconds: Dict[str, float] = {}  # how long each step of _start took (describe())
        self.layout: Optional[host_layout.HostLayout] = None  # set when the hierarchical allreduce runs
        self.flat_because: Optional[str] = None  # why not, when the ranks share hosts
        self._tracing = False
        self._join_ticket: Optional[int] = None
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def start(cls, config: Config, rank: int, size: int,
              broadcast_object: Callable, allgather_object: Callable) -> "ProxyGroup":
        group = cls(config, rank, size)
        try:
            group._start(broadcast_object, allgather_object)
        except BaseException:
            group.close()
            raise
        return group

    def _start(self, broadcast_object: Callable, allgather_object: Callable) -> None:
        global _last_probe
        cfg = self.config
        mark = self._startup_clock()
        token = broadcast_object(os.urandom(16) if self.rank == 0 else None, 0, name="fasthorovod.token")
        host = bind_address(cfg)
        path_probe = (_C.PathProbe(host, token, self.rank, self.size, cfg.wire_hash()) if cfg.probes() else None)
        if self.rank == 0:  # the negotiation's coordinator (csrc/negotiation/coordinator.h)
            self.coordinator = _C.Coordinator(native(
                _C.CoordinatorOptions, size=self.size, token=token, bind_host=host,
                timeout_seconds=cfg.timeout_seconds, stall_check_seconds=cfg.stall_check_seconds,
                stall_shutdown_seconds=cfg.stall_shutdown_seconds))
        mark("token")
        me = {"host": host, "config": cfg.wire_hash(), "pid": os.getpid(), "cpus": len(os.sched_getaffinity(0)),
              "coordinator": self.coordinator.port if self.coordinator is not None else None,
              "probe": path_probe.port if path_probe is not None else None,
              "probed": _last_probe if self.rank == 0 and path_probe is not None else None}
        peers = allgather_object(me, name="fasthorovod.peers")
        mark("peers")
        after = (self.rank + 1) % self.size
        if peers[after]["config"] != cfg.wire_hash():
            raise ConfigError(f"rank {after} runs with different FASTHOROVOD_* settings than rank {self.rank} "
                              f"(proxies, sockets, threshold, segment size must match)")
        # The lanes are chosen before the channel exists (its size is the number of lanes), so the
        # probe runs first, on the ring the hierarchical allreduce will run if the hosts allow it.
        planned = self._plan_hosts(peers)
        if path_probe is not None:
            if planned is not None:
                path_probe.set_place(planned.host_index, planned.num_hosts)
                after = planned.ring_next()
            hosts = frozenset(peer["host"] for peer in peers)
            known = peers[0]["probed"]
            if known is not None and hosts <= known[0]:
                self._reuse_probe(known[1], len(known[0]), len(hosts), peers, planned)
            else:
                self._choose_sockets(path_probe, peers[after], peers, planned, allgather_object,
                                     lambda: self._new_probe(host, token, planned))
                known = (hosts, self.flow_choice.hops)
            _last_probe = known
            mark("probe")
        cfg = self.config  # with the lanes the probe chose
        self.channel = _C.ProxyChannel(channel_config(cfg, self.rank, self.size, token, host))
        self.pool = BufferPool(self.channel.create_buffer)
        atexit.register(self.close)
        for lane in range(cfg.num_proxies):
            proc = spawn_proxy(self.channel, lane)
            self.processes.append(proc)
            self.channel.watch_proxy(lane, proc.pid)
        ports = self.channel.wait_listening(cfg.timeout_seconds)
        mark("spawn")
        if planned is not None:
            self._attach_host(planned, peers, allgather_object)
        mark("host")
        all_ports = allgather_object(list(ports), name="fasthorovod.ports")
        after = self.layout.ring_next() if self.layout is not None else (self.rank + 1) % self.size
        self.channel.connect([peers[after]["host"]] * cfg.num_proxies, list(all_ports[after]),
                             self.sockets_per_lane, cfg.timeout_seconds)
        mark("rings")
        self.member = _C.Member(self.channel, native(
            _C.MemberOptions, rank=self.rank, size=self.size, token=token, coordinator_host=peers[0]["host"],
            coordinator_port=peers[0]["coordinator"], timeout_seconds=cfg.timeout_seconds))
        mark("negotiation")

    def _new_probe(self, host: str, token: bytes, planned: Optional[host_layout.HostLayout]) -> "_C.PathProbe":
        path_probe = _C.PathProbe(host, token, self.rank, self.size, self.config.wire_hash())
        if planned is not None:
            path_probe.set_place(planned.host_index, planned.num_hosts)
        return path_probe

    def _plan_hosts(self, peers: List[dict]) -> Optional[host_layout.HostLayout]:
        """The hierarchical allreduce's layout when the ranks share hosts and FASTHOROVOD_HIERARCHICAL
        allows it (None: the flat ring; and with FASTHOROVOD_HIERARCHICAL=1 every rank raises,
        naming why). Decided from the exchanged addresses alone, so alike on every rank."""
        mode = self.config.hierarchical
        layout = host_layout.layout([peer["host"] for peer in peers], self.rank)
        why = layout.why_flat()
        if why is not None and mode == "1":
            raise ConfigError(f"FASTHOROVOD_HIERARCHICAL=1, but {why} (ranks per host: "
                              f"{[len(ranks) for ranks in layout.hosts]}); unset it to run the flat ring")
        if why is not None or mode == "0":
            if layout.num_hosts < self.size:  # ranks share hosts: say why they still run one flat ring
                self.flat_because = "FASTHOROVOD_HIERARCHICAL=0" if mode == "0" else why
            return None
        return layout

    def _attach_host(self, layout: host_layout.HostLayout, peers: List[dict], allgather_object: Callable) -> None:
        """Sets up the planned hierarchical allreduce: local rank 0 creates the host segment, the
        others open it through /proc, and the ranks agree that every one of them could; else the
        flat ring runs (and with FASTHOROVOD_HIERARCHICAL=1 every rank raises, naming why)."""
        mode = self.config.hierarchical
        fd = self.channel.create_host(layout.local_size) if layout.local_rank == 0 else None
        owners = allgather_object(fd, name="fasthorovod.host")
        error = None
        if layout.local_rank != 0:
            owner = layout.hosts[layout.host_index][0]
            try:
                self.channel.open_host(peers[owner]["pid"], owners[owner], layout.local_size)
            except Exception as exc:  # reported below, on every rank alike
                error = str(exc)
        failed = [(r, e) for r, e in enumerate(allgather_object(error, name="fasthorovod.host.opened")) if e]
        if failed:
            r, e = failed[0]
            self.flat_because = f"rank {r} cannot share memory with its host: {e}"
            if mode == "1":
                raise FastHorovodError(f"FASTHOROVOD_HIERARCHICAL=1, but {self.flat_because}")
            if self.rank == 0:
                print(f"[fasthorovod] hierarchical allreduce off: {self.flat_because}", file=sys.stderr, flush=True)
            return
        self.channel.attach_host(layout.local_rank, layout.host_index, layout.num_hosts)
        self.layout = layout
        if self.rank == 0:
            across = (f"{self.config.num_proxies} rings across hosts per local rank" if layout.num_hosts > 1
                      else "no network")
            print(f"[fasthorovod] hierarchical allreduce: {layout.describe()} (shared memory inside each host, "
                  f"{across}; FASTHOROVOD_HIERARCHICAL=0 turns it off)", file=sys.stderr, flush=True)

    def _startup_clock(self) -> Callable[[str], None]:
        """mark(step) records the seconds since the previous mark under `step` in startup_seconds."""
        last = [time.monotonic()]

        def mark(step: str) -> None:
            now = time.monotonic()
            self.startup_seconds[step] = round(now - last[0], 3)
            last[0] = now
        return mark

    def _choose_sockets(self, path_probe: "_C.PathProbe", nxt: dict, peers: List[dict],
                        planned: Optional[host_layout.HostLayout], allgather_object: Callable,
                        new_probe: Callable[[], "_C.PathProbe"]) -> None:
        """Measures the incoming hop of the planned ring (`planned`: the hierarchical layout, None:
        the flat ring), exchanges the curves, and takes the lanes and sockets per lane every rank
        computes alike from them (probe.py); measures a second time when the hops' knees disagree."""
        options = native(_C.ProbeOptions, max_flows=probe.MAX_FLOWS)
        started = time.monotonic()
        # With the hierarchical allreduce, local rank 0 of each host measures the hop between hosts
        # alone (the host's link uncontended); the others wait. Each local rank then gets enough flows
        # to fill the link by itself, as in the flat ring: its rings are not balanced against the
        # other local ranks' (each owns a fixed 1/L of a lane's shard), so with fewer (one socket
        # per lane on 4:1gbit:200mbit) a lane whose flow gets an unlucky share of the link holds its
        # part back; 3 hosts x 2 ranks measured 1.00, 0.75, 0.99 Gbit/s with 4 x 1 against 0.95,
        # 0.98, 0.97 with 4 x 2, in one invocation (docs/hierarchical.md).
        measures = planned is None or planned.local_rank == 0

        def measure(path: "_C.PathProbe", port: int, name: str, opts,
                    also: Any = None) -> Tuple[List[Dict[int, float]], List[Any]]:
            """Every hop's curve, and what every rank passed as `also` (one exchange for both)."""
            phases = path.run(nxt["host"], port, opts, self.config.timeout_seconds) if measures else None
            gathered = allgather_object((phases, also), name=name)
            return [probe.hop_curve(p) for p, _ in gathered if p is not None], [a for _, a in gathered]

        # The second probe listens from the start and its port travels with the first curves, so
        # measuring again (when the hops disagree) needs no exchange of its own.
        again = new_probe()
        hops, again_ports = measure(path_probe, nxt["probe"], "fasthorovod.probe", options, again.port)
        self.probe_runs, self.rechecked_flows = 1, None
        self.probe_run_seconds = [time.monotonic() - started]
        if probe.disagree(hops):  # the same decision on every rank: the same curves
            low, high = probe.disputed_flows(hops)  # measured again: only what decides between the knees
            after = planned.ring_next() if planned is not None else (self.rank + 1) % self.size
            recheck = native(_C.ProbeOptions, min_flows=low, max_flows=high)
            self.rechecked_flows = (low, high)
            hops = probe.merge(hops, measure(again, again_ports[after], "fasthorovod.probe.2", recheck)[0])
            self.probe_runs = 2
            self.probe_run_seconds.append(time.monotonic() - started - self.probe_run_seconds[0])
        self._choose(hops, peers, planned)
        self.probe_seconds = time.monotonic() - started
        if self.rank == 0:
            print(f"[fasthorovod] data plane: {self.config.num_proxies} lanes x {self.sockets_per_lane} sockets "
                  f"({self.flow_choice.describe()}; {self.lanes_because}; measured in {self.probe_seconds:.1f} s"
                  f"{', twice: the hops disagreed' if self.probe_runs == 2 else ''}; "
                  f"FASTHOROVOD_NUM_PROXIES and FASTHOROVOD_SOCKETS_PER_PROXY override)",
                  file=sys.stderr, flush=True)

    def _reuse_probe(self, hops: List[Dict[int, float]], probed: int, hosts: int, peers: List[dict],
                     planned: Optional[host_layout.HostLayout]) -> None:
        """Takes the lanes and sockets per lane from the curves an earlier start-up of this process
        measured among these hosts (and maybe more): the same choice on every rank, no measurement."""
        self._choose(hops, peers, planned)
        self.probe_runs = 0
        if self.rank == 0:
            print(f"[fasthorovod] data plane: {self.config.num_proxies} lanes x {self.sockets_per_lane} sockets "
                  f"({self.flow_choice.describe()}; {self.lanes_because}; as measured at an earlier start-up of "
                  f"this job among {probed} hosts, these {hosts} among them; FASTHOROVOD_NUM_PROXIES and "
                  f"FASTHOROVOD_SOCKETS_PER_PROXY override)",
                  file=sys.stderr, flush=True)

    def _choose(self, hops: List[Dict[int, float]], peers: List[dict], planned: Optional[host_layout.HostLayout]) -> None:
        """The lanes (unless FASTHOROVOD_NUM_PROXIES is set: probe.choose_lanes, from the ring's best
        measured rate and the fewest CPUs any worker has) and the sockets per lane, from the
        exchanged curves and CPU counts: alike on every rank."""
        lanes = self.config.num_proxies
        if self.config.num_proxies_from_env:
            self.lanes_because = "lanes from FASTHOROVOD_NUM_PROXIES"
        else:
            rate = max(probe.ring_curve(hops).values())
            ranks_on = collections.Counter(peer["host"] for peer in peers)
            cpus = min(peer["cpus"] / ranks_on[peer["host"]] for peer in peers)
            rings = planned.local_size if planned is not None else 1
            lanes = probe.choose_lanes(rate, cpus, rings)
            per_ring = f" over {rings} rings" if rings > 1 else ""
            needed = probe.lanes_needed(rate, rings)
            self.lanes_because = (f"lanes: {probe.mbit(rate)} Mbit/s{per_ring} needs {needed} "
                                  f"prox{'y' if needed == 1 else 'ies'} of {probe.mbit(probe.LANE_BYTES_PER_SECOND)} "
                                  f"Mbit/s; at least {probe.MIN_LANES}, above that at most {cpus:g} CPUs per worker")
            if lanes != self.config.num_proxies:
                self.config = dataclasses.replace(self.config, num_proxies=lanes)
                self.lane_weights = [1.0] * lanes
        self.flow_choice = probe.choose(hops, lanes)
        self.sockets_per_lane = self.flow_choice.sockets_per_lane

    def describe(self) -> dict:
        """What the data plane runs with and why: lanes, sockets per lane and where that number
        came from, the probe's curve (bytes/s per flow count, slowest hop) and the lane weights."""
        source = ("FASTHOROVOD_SOCKETS_PER_PROXY" if self.config.sockets_per_proxy is not None
                  else "probe" if self.flow_choice is not None else "default (one host: no probe)"
                  if self.config.single_host else "default (FASTHOROVOD_PROBE=0)")
        info = {"lanes": self.config.num_proxies, "lanes_because": self.lanes_because,
                "sockets_per_lane": self.sockets_per_lane,
                "flows": self.config.num_proxies * self.sockets_per_lane, "sockets_source": source,
                "lane_weights": list(self.lane_weights), "rebalance_every": self.config.rebalance_every,
                "hierarchical": None if self.layout is None else {
                    "hosts": self.layout.num_hosts, "ranks_per_host": self.layout.local_size,
                    "host_index": self.layout.host_index, "local_rank": self.layout.local_rank},
                "flat_because": self.flat_because,
                "startup_seconds": dict(self.startup_seconds)}
        if self.flow_choice is not None:
            info["probe"] = {"knee_flows": self.flow_choice.knee_flows, "seconds": self.probe_seconds,
                             "runs": self.probe_runs, "run_seconds": list(self.probe_run_seconds),
                             "reused": self.probe_runs == 0,
                             "rechecked_flows": None if self.rechecked_flows is None else list(self.rechecked_flows),
                             "curve_bytes_per_second": dict(self.flow_choice.curve),
                             "hops_bytes_per_second": [dict(h) for h in self.flow_choice.hops]}
        return info

    # -- requests ---------------------------------------------------------------------------------

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        """Whether the proxies reduce and gather `dtype` (the integer types up to 64 bits, float16,
        bfloat16, float32, float64)."""
        return dtype in DTYPE_CODES

    def alloc(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed flat tensor of `count` elements in shared memory that the proxies read and
        write in place: an in-place allreduce of it, or of a contiguous slice of it, copies
        nothing. It stays registered until :meth:`close`; the memory lives as long as any view."""
        if not self.supports(dtype):
            raise ValueError(f"the proxies do not carry {dtype}")
        if self._closed or self.pool is None:
            raise FastHorovodError("FastHorovod proxies are shut down (call hvd.init() first)")
        if count == 0:
            return torch.zeros(0, dtype=dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        flat = self.pool.register(count * itemsize).view(dtype, 0, count)
        zero_tensor(flat)
        return flat

    def set_lane_weights(self, weights: Sequence[float]) -> None:
        """Shard boundaries of later requests follow `weights` (one positive number per lane).
        Every rank must switch at the same request, or the ranks' shards disagree."""
        weights = [float(w) for w in weights]
        if len(weights) != self.config.num_proxies or not all(w > 0.0 for w in weights):
            raise ValueError(f"lane weights must be {self.config.num_proxies} positive numbers, got {weights}")
        self.lane_weights = weights

    def lane_boundaries(self, count: int, weights: Optional[Sequence[float]] = None) -> List[int]:
        """Element boundaries of each lane's shard, proportional to `weights` (the lane weights)."""
        weights = self.lane_weights if weights is None else weights
        total = sum(weights)
        bounds, acc = [0], 0.0
        for w in weights[:-1]:
            acc += w
            bounds.append(int(count * acc / total))
        bounds.append(count)
        return bounds

    def allreduce(self, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], name: str,
                  average: bool, prescale: float, postscale: float) -> Request:
        """Posts one fused allreduce of same-dtype tensors; results land in `outputs` on wait()."""
        shapes = ";".join(",".join(map(str, t.shape)) for t in tensors)
        return self._reduce(tensors, outputs, name, OP_AVERAGE if average else OP_SUM, prescale,
                            postscale / self.size if average else postscale, shapes)

    def broadcast(self, tensor: torch.Tensor, output: torch.Tensor, name: str, root: int) -> Request:
        """Posts a broadcast of rank `root`'s `tensor`; on wait() every rank's `output` holds it.
        Both are contiguous CPU tensors of one shape and dtype (`output` may be `tensor`); only the
        root reads `tensor`.

        It runs as a ring allreduce (op OP_BROADCAST, reduced as a sum) of the tensor's bytes read
        as integers of the element's width: the root contributes its tensor, every other rank
        zeros, and adding integer zeros changes no bit, so every rank receives the root's bytes
        exactly, for any dtype and any value (-0.0, infinities, every NaN payload, signalling
        NaNs, which a floating-point sum would quiet). The description the ranks negotiate names
        the root rank, the dtype and the shape, so ranks that disagree on any of them fail with
        CollectiveMismatchError (the lanes stay up); the negotiation refuses a broadcast while a
        rank is in join(), as Horovod does. Per rank it moves 2(n-1)/n of the tensor, like an
        allreduce, over every lane's flows."""
        words = BROADCAST_WORDS.get(tensor.element_size())
        if words is None or output.element_size() != tensor.element_size():
            raise ValueError(f"the proxies cannot broadcast {tensor.dtype} (element size {tensor.element_size()})")
        description = f"{','.join(map(str, tensor.shape))} {str(tensor.dtype).replace('torch.', '')} from root rank {root}"
        source = tensor.view(words)
        destination = source if output is tensor else output.view(words)  # in place: zero-copy when in shm
        return self._reduce([source], [destination], name, OP_BROADCAST, 1.0, 1.0, description,
                            contribute=self.rank == root)

    def _reduce(self, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], name: str, op: int,
                prescale: float, postscale: float, description: str, contribute: bool = True) -> Request:
        """Stages `tensors` (zeros instead when not `contribute`) unless the one tensor already lies in
        a shared-memory buffer, and submits the collective (`description`: what the ranks compare)."""
        if self._closed or self.channel is None:
            raise FastHorovodError("FastHorovod proxies are shut down (call hvd.init() first)")
        dtype = tensors[0].dtype
        count = sum(t.numel() for t in tensors)
        itemsize = tensors[0].element_size()
        located = (self.pool.locate(tensors[0]) if contribute and len(tensors) == 1 and outputs[0] is tensors[0]
                   else None)
        if located is not None:
            buffer, offset = located
            staged, offsets = False, [offset]
        else:
            buffer = self.pool.acquire(count * itemsize)
            staged, offsets, offset = True, [], 0
            for t in tensors:
                offsets.append(offset)
                staging = buffer.view(dtype, offset, t.numel())
                if contribute:
                    copy_tensor(staging, t.reshape(-1))
                else:
                    zero_tensor(staging)
                offset += t.numel() * itemsize
        try:
            ticket = self.member.submit(request(
                buffer_id=buffer.id, buffer_offset=offsets[0], count=count,
                dtype=DTYPE_CODES[dtype], op=op, prescale=prescale, postscale=postscale,
                name_hash=_hash64(name), shape_hash=_hash64(description), name=name,
                lane_begin=self.lane_boundaries(count)), description)
        except BaseException:
            if staged:
                self.pool.release(buffer)
            raise
        return Request(self, ticket, buffer, staged, tensors, outputs, offsets)

    def allgather(self, tensor: torch.Tensor, name: str) -> GatherRequest:
        """Posts a ring allgather of every rank's 1-D `tensor` (same length and dtype everywhere),
        sharded over the lanes: lane j gathers columns [b_j, b_j+1) of every rank's row. wait()
        fills ``request.output``, a (size, len) tensor whose row r is rank r's.

        The lanes' shares are equal, whatever the lane weights: each rank lays its row out by the
        boundaries before the collective is negotiated, so they must be the same on every rank,
        and rebalancing leaves each rank its own weights (an allreduce runs with the lowest
        submitter's boundaries instead, which needs no layout in advance)."""
        if self._closed or self.channel is None:
            raise FastHorovodError("FastHorovod proxies are shut down (call hvd.init() first)")
        if tensor.dim() != 1 or tensor.dtype not in DTYPE_CODES or tensor.device.type != "cpu":
            raise ValueError(f"allgather takes a 1-D CPU tensor of a supported dtype, got {tuple(tensor.shape)} "
                             f"{tensor.dtype} on {tensor.device}")
        n, width, itemsize = self.size, tensor.numel(), tensor.element_size()
        if self.layout is not None:
            return self._allgather_as_sum(tensor, name)
        bounds = self.lane_boundaries(width, [1.0] * len(self.lane_weights))
        output = torch.empty((n, width), dtype=tensor.dtype)
        buffer = self.pool.acquire(max(1, n * width * itemsize))
        own = _C.allgather_own_chunk(self.rank, n)
        try:
            for begin, end in zip(bounds[:-1], bounds[1:]):
                m = end - begin
                copy_tensor(buffer.view(tensor.dtype, (n * begin + own * m) * itemsize, m), tensor[begin:end])
            ticket = self.member.submit(request(
                buffer_id=buffer.id, buffer_offset=0, count=n * width, dtype=DTYPE_CODES[tensor.dtype],
                op=OP_GATHER, name_hash=_hash64(name), shape_hash=_hash64(str(width)), name=name,
                lane_begin=[n * b for b in bounds]), str(width))
        except BaseException:
            self.pool.release(buffer)
            raise
        return GatherRequest(self, ticket, buffer, output, bounds)

    def _allgather_as_sum(self, tensor: torch.Tensor, name: str) -> "GatherRequest":
        """The hierarchical allreduce has no allgather schedule: each rank writes its row into a
        (size, len) buffer of zeros, read as integer words, and the ranks sum it (adding integer
        zeros changes no bit, so every row arrives exactly). Twice the bytes of a ring allgather;
        the same description as a ring allgather, so a joined rank's zeros fit too."""
        n, width, itemsize = self.size, tensor.numel(), tensor.element_size()
        words = BROADCAST_WORDS.get(itemsize)
        if words is None:
            raise ValueError(f"the proxies cannot allgather {tensor.dtype} (element size {itemsize})")
        output = torch.empty((n, width), dtype=tensor.dtype)
        buffer = self.pool.acquire(max(1, n * width * itemsize))
        count = n * width
        try:
            zero_tensor(buffer.view(words, 0, count))
            copy_tensor(buffer.view(tensor.dtype, self.rank * width * itemsize, width), tensor)
            ticket = self.member.submit(request(
                buffer_id=buffer.id, buffer_offset=0, count=count, dtype=DTYPE_CODES[words], op=OP_SUM,
                name_hash=_hash64(name), shape_hash=_hash64(str(width)), name=name,
                lane_begin=self.lane_boundaries(count)), str(width))
        except BaseException:
            self.pool.release(buffer)
            raise
        return GatherRequest(self, ticket, buffer, output, None)

    def begin_join(self) -> None:
        """This rank has joined: until every rank has, its proxies take part in the collectives the
        others submit, with zeros (the member posts them in the negotiated order)."""
        if self._closed or self.member is None:
            raise FastHorovodError("FastHorovod proxies are shut down (call hvd.init() first)")
        self._join_ticket = self.member.join()

    def end_join(self) -> int:
        """Waits until every rank has joined; returns the last rank to join, in the order the
        coordinator received the joins (the same answer on every rank)."""
        ticket, self._join_ticket = self._join_ticket, None
        return self.member.wait(ticket, self.config.timeout_seconds)

    def start_trace(self, directory: str, clock_offset_ns: int) -> None:
        """Every lane records its frames into DIR/rank<R>.lane<J>.bin from its next request on."""
        if self.channel is not None and not self._closed:
            self.channel.set_trace(os.path.abspath(directory), clock_offset_ns, self.config.timeout_seconds)
            self._tracing = True

    def stop_trace(self) -> None:
        """Every live lane closes its trace file (returns once they have)."""
        if self._tracing and self.channel is not None and not self._closed:
            self._tracing = False
            self.channel.set_trace("", 0, self.config.timeout_seconds)

    def lane_stats(self) -> List[dict]:
        """Per lane: its counters (``bytes_sent``, ``busy_ns``, ``collectives``, ``zero_filled``,
        ``state``, ``port``, ...), as the proxies report them."""
        return [self.channel.lane(j) for j in range(self.config.num_proxies)] if self.channel else []

    # -- shutdown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Aborts collectives in flight, stops the proxies and reaps them (killed after
        :data:`SHUTDOWN_GRACE_SECONDS`). Returns in well under a second. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        started = time.monotonic()
        if self.channel is not None:
            if self.channel.in_flight():
                self.channel.abort()  # a stop alone would wait for them: their waiters raise now
            self.channel.stop()  # the proxies start leaving while the rest shuts down
        if self.pool is not None:
            self.pool.close()
        if self.member is not None:
            self.member.close()  # says goodbye to the coordinator; pending tickets fail
        if self.coordinator is not None:
            self.coordinator.stop()
        if self.channel is not None:
            self.channel.terminate(max(0.0, started + SHUTDOWN_GRACE_SECONDS - time.monotonic()))
            for lane, proc in enumerate(self.processes):
                # Reaped by the channel: Popen must never wait for (or signal) that pid again.
                code = self.channel.exit_code(lane)
                proc.returncode = code if code is not None else proc.returncode
        atexit.unregister(self.close)
