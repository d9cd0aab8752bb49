"""Starting a data plane: from the ranks' first exchange to running rings, as :func:`run` does it.

Inside ``hvd.init()``, only when size > 1 and FASTHOROVOD_NUM_LANES is not 0:

1. rank 0 draws a random 16-byte job token; ``broadcast_object`` gives it to every rank (Horovod's
   control plane, no home-made rendezvous); rank 0 starts the negotiation's coordinator
   (csrc/negotiation/coordinator.h); ``allgather_object`` exchanges each worker's address, CPU
   count, coordinator and path-probe ports;
2. the plan (plan.py) decides the layout, the threshold and whether to probe; when it probes, every
   rank measures its incoming hop of the planned ring, the curves are exchanged, and the plan is
   made again with them (the lanes and the sockets per lane);
3. the worker creates its shared-memory channel for k lanes (an anonymous memfd: no name anywhere)
   and one Unix socket pair per proxy, and spawns ``python -m fasthorovod.proxy FD j`` for j < k,
   each in a process group of its own with its end of the pair inherited as FD; the proxy receives
   the channel's descriptor on it (and later every data buffer's), binds on the job's interface and
   reports its ports in the channel (its ring's, and its alltoall mesh's, which connects at the
   first alltoall); ``allgather_object`` exchanges the ports; lane j of rank r is
   told the address of lane j of the rank after it in the ring, connects, and accepts lane j of the
   rank before (a mutual challenge-response handshake: both ends prove they hold the token, which
   never travels, and agree on ranks, lane and configuration hash; csrc/transport/socket.h);
4. each worker's member connects to the coordinator (the same handshake); from then on every request
   is submitted to the member, which posts it to the proxies in the order the ranks negotiated;
5. from then on the channel reaps any proxy the moment it exits (csrc/proxy/watch.h: a pidfd per
   proxy, or waitpid polling where pidfds are missing), so none stays a zombie.

Every wait is bounded by FASTHOROVOD_TIMEOUT_SECONDS. What start-up builds is handed to the
:class:`~fasthorovod.proxy.group.ProxyGroup` as it is built, so that a failure at any step closes
exactly what exists.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, List, Optional, Tuple

from fasthorovod import _C
from fasthorovod.config import Config, ConfigError
from fasthorovod.exceptions import FastHorovodError
from fasthorovod.proxy import plan as planner
from fasthorovod.proxy import probe
from fasthorovod.proxy.buffers import BufferPool
from fasthorovod.proxy.core import native

if TYPE_CHECKING:
    from fasthorovod.proxy.group import ProxyGroup


def channel_config(cfg: Config, plan: planner.DataPlanePlan, token: bytes, bind_host: str) -> "_C.ChannelConfig":
    """The settings the proxies read from the channel (the wire settings, the plan's lanes, this
    rank's place; the sockets per lane are given at connect time)."""
    return native(_C.ChannelConfig, num_lanes=plan.lanes, rank=plan.rank, size=plan.size,
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


def _known_curves(plan: Optional[planner.DataPlanePlan]) -> Optional[Tuple[FrozenSet[str], List[Dict[int, float]]]]:
    """What `plan`'s path probe measured: the addresses of that world's hosts and every hop's curve."""
    if plan is None or plan.flow_choice is None or plan.probe_run is None:
        return None
    return plan.probe_run.hosts, [dict(hop) for hop in plan.flow_choice.hops]


def run(group: "ProxyGroup", single_host: bool, broadcast_object: Callable, allgather_object: Callable,
        previous: Optional[planner.DataPlanePlan] = None) -> None:
    """Starts `group`'s data plane (the steps above), setting its plan, coordinator, channel, pool,
    processes and member as each comes to exist.

    `previous`: the plan of this process's last data plane. A data plane of the same process (an
    elastic reset, restart_proxies()) whose hosts are all among those that plan probed takes the
    choice from its curves instead of measuring again; rank 0's decides, so every rank agrees. A new
    process (a new job, a worker that joins) has none."""
    cfg, rank, size = group.config, group.rank, group.size
    timings: Dict[str, float] = {}
    mark = _clock(timings)
    token = broadcast_object(os.urandom(16) if rank == 0 else None, 0, name="fasthorovod.token")
    host = bind_address(cfg)
    if rank == 0:  # the negotiation's coordinator (csrc/negotiation/coordinator.h)
        group.coordinator = _C.Coordinator(native(
            _C.CoordinatorOptions, size=size, token=token, bind_host=host,
            timeout_seconds=cfg.timeout_seconds, stall_check_seconds=cfg.stall_check_seconds,
            stall_shutdown_seconds=cfg.stall_shutdown_seconds))
    cpus = len(os.sched_getaffinity(0))
    # Whether to probe depends on the settings and the topology only, so it is known before the
    # exchange (the probe's port travels in it); which ring to measure needs the peers' addresses.
    path_probe = (_C.PathProbe(host, token, rank, size, cfg.wire_hash())
                  if planner.probes(cfg, single_host) else None)
    mark("token")
    me = {"host": host, "config": cfg.wire_hash(), "pid": os.getpid(), "cpus": cpus,
          "coordinator": group.coordinator.port if group.coordinator is not None else None,
          "probe": path_probe.ports if path_probe is not None else None,
          "probed": _known_curves(previous) if rank == 0 and path_probe is not None else None}
    peers = allgather_object(me, name="fasthorovod.peers")
    mark("peers")
    after = (rank + 1) % size
    if peers[after]["config"] != cfg.wire_hash():
        raise ConfigError(f"rank {after} runs with different FASTHOROVOD_* settings than rank {rank} "
                          f"(proxies, sockets, threshold, segment size must match)")
    peer_list = [planner.Peer(peer["host"], peer["cpus"]) for peer in peers]
    plan = planner.plan(cfg, peer_list, rank, single_host)
    # The lanes are chosen before the channel exists (its size is the number of lanes), so the
    # probe runs first, on the ring the hierarchical allreduce will run if the hosts allow it.
    if path_probe is not None:
        hosts = frozenset(peer["host"] for peer in peers)
        known = peers[0]["probed"]
        if known is not None and hosts <= known[0]:
            plan = planner.plan(cfg, peer_list, rank, single_host, hops=known[1])
            plan = dataclasses.replace(plan, probe_run=planner.ProbeRun(runs=0, reused_hosts=len(known[0]),
                                                                        hosts=known[0]))
        else:
            again = _placed(_C.PathProbe(host, token, rank, size, cfg.wire_hash()), plan)
            hops, run = _probe(plan, cfg, _placed(path_probe, plan), again, peers, allgather_object)
            plan = dataclasses.replace(planner.plan(cfg, peer_list, rank, single_host, hops=hops),
                                       probe_run=dataclasses.replace(run, hosts=hosts))
        if rank == 0:
            print(f"[fasthorovod] {plan.summary()}", file=sys.stderr, flush=True)
        mark("probe")
    group.plan = plan
    group.lane_weights = [1.0] * plan.lanes
    group.channel = _C.ProxyChannel(channel_config(cfg, plan, token, host))
    group.pool = BufferPool(group.channel.create_buffer)
    atexit.register(group.close)
    for lane in range(plan.lanes):
        proc = spawn_proxy(group.channel, lane)
        group.processes.append(proc)
        group.channel.watch_proxy(lane, proc.pid)
    ports = group.channel.wait_listening(cfg.timeout_seconds)
    mark("spawn")
    if plan.layout is not None:
        group.plan = plan = _attach_host(group, plan, peers, allgather_object)
    mark("host")
    mesh_ports = group.channel.mesh_ports()
    all_ports = allgather_object((list(ports), mesh_ports), name="fasthorovod.ports")
    after = plan.ring_next()
    group.mesh = all(all(p) for _, p in all_ports)  # every lane of every rank listens for it
    group.channel.connect([peers[after]["host"]] * plan.lanes, [list(p) for p in all_ports[after][0]],
                          plan.sockets_per_lane, cfg.timeout_seconds,
                          mesh_hosts=[p["host"] for p in peers] if group.mesh else [],
                          mesh_ports=[list(p) for _, p in all_ports] if group.mesh else [])
    mark("rings")
    group.member = _C.Member(group.channel, native(
        _C.MemberOptions, rank=rank, size=size, token=token, coordinator_host=peers[0]["host"],
        coordinator_port=peers[0]["coordinator"], timeout_seconds=cfg.timeout_seconds))
    mark("negotiation")
    group.plan = dataclasses.replace(plan, startup_seconds=timings)


def _clock(timings: Dict[str, float]) -> Callable[[str], None]:
    """mark(step) records the seconds since the previous mark under `step` in `timings`."""
    last = [time.monotonic()]

    def mark(step: str) -> None:
        now = time.monotonic()
        timings[step] = round(now - last[0], 3)
        last[0] = now
    return mark


def _placed(path_probe: "_C.PathProbe", plan: planner.DataPlanePlan) -> "_C.PathProbe":
    """`path_probe`, told its host's place when the probe measures the hierarchical layout's ring."""
    if plan.layout is not None:
        path_probe.set_place(plan.layout.host_index, plan.layout.num_hosts)
    return path_probe


def _probe(plan: planner.DataPlanePlan, cfg: Config, path_probe: "_C.PathProbe", again: "_C.PathProbe",
           peers: List[dict], allgather_object: Callable) -> Tuple[List[Dict[int, float]], planner.ProbeRun]:
    """Measures the incoming hop of the planned ring and exchanges the curves: every hop's curve,
    the same on every rank, and how the probe went. Measures a second time, with `again` (which
    listens from the start), when the hops' knees disagree."""
    options = native(_C.ProbeOptions, max_flows=probe.MAX_FLOWS)
    started = time.monotonic()
    nxt = peers[plan.ring_next()]
    # With the hierarchical allreduce, local rank 0 of each host measures the hop between hosts
    # alone (the host's link uncontended); the others wait. Each local rank then gets enough flows
    # to fill the link by itself, as in the flat ring: its rings are not balanced against the
    # other local ranks' (each owns a fixed 1/L of a lane's shard), so with fewer (one socket
    # per lane on 4:1gbit:200mbit) a lane whose flow gets an unlucky share of the link holds its
    # part back; 3 hosts x 2 ranks measured 1.00, 0.75, 0.99 Gbit/s with 4 x 1 against 0.95,
    # 0.98, 0.97 with 4 x 2, in one invocation (docs/hierarchical.md).
    measures = plan.layout is None or plan.layout.local_rank == 0

    def measure(path: "_C.PathProbe", ports: List[int], name: str, opts, also=None):
        """Every hop's curve, and what every rank passed as `also` (one exchange for both)."""
        phases = path.run(nxt["host"], probe_ports(ports, plan.lanes), opts, cfg.timeout_seconds) if measures else None
        gathered = allgather_object((phases, also), name=name)
        return [probe.hop_curve(p) for p, _ in gathered if p is not None], [a for _, a in gathered]

    # The second probe's ports travel with the first curves, so measuring again needs no exchange
    # of its own.
    hops, again_ports = measure(path_probe, nxt["probe"], "fasthorovod.probe", options, again.ports)
    run_seconds, rechecked = [time.monotonic() - started], None
    if probe.disagree(hops):  # the same decision on every rank: the same curves
        low, high = probe.disputed_flows(hops)  # measured again: only what decides between the knees
        recheck = native(_C.ProbeOptions, min_flows=low, max_flows=high)
        rechecked = (low, high)
        hops = probe.merge(hops, measure(again, again_ports[plan.ring_next()], "fasthorovod.probe.2", recheck)[0])
        run_seconds.append(time.monotonic() - started - run_seconds[0])
    return hops, planner.ProbeRun(runs=len(run_seconds), seconds=time.monotonic() - started,
                                  run_seconds=run_seconds, rechecked_flows=rechecked)


def probe_ports(ports: List[int], lanes: int) -> List[int]:
    """Which of the next rank's probe ports the probe's flows go to (flow s to the s-th, cyclically):
    as many as the planned rings' `lanes` listen on (two each), so that n probe flows spread over
    server ports as n flows of the rings will."""
    return ports[:max(1, min(len(ports), 2 * lanes))]


def _attach_host(group: "ProxyGroup", plan: planner.DataPlanePlan, peers: List[dict],
                 allgather_object: Callable) -> planner.DataPlanePlan:
    """Sets up the planned hierarchical allreduce: local rank 0 creates the host segment, the
    others open it through /proc, and the ranks agree that every one of them could. Returns the
    plan that runs: the same, or the flat ring where a rank could not (and with
    FASTHOROVOD_HIERARCHICAL=1 every rank raises, naming why)."""
    layout, channel = plan.layout, group.channel
    fd = channel.create_host(layout.local_size) if layout.local_rank == 0 else None
    owners = allgather_object(fd, name="fasthorovod.host")
    error = None
    if layout.local_rank != 0:
        owner = layout.hosts[layout.host_index][0]
        try:
            channel.open_host(peers[owner]["pid"], owners[owner], layout.local_size)
        except Exception as exc:  # reported below, on every rank alike
            error = str(exc)
    failed = [(r, e) for r, e in enumerate(allgather_object(error, name="fasthorovod.host.opened")) if e]
    if failed:
        r, e = failed[0]
        plan = plan.flat(f"rank {r} cannot share memory with its host: {e}")
        if plan.hierarchical_required:
            raise FastHorovodError(f"FASTHOROVOD_HIERARCHICAL=1, but {plan.flat_because}")
        if plan.rank == 0:
            print(f"[fasthorovod] hierarchical allreduce off: {plan.flat_because}", file=sys.stderr, flush=True)
        return plan
    channel.attach_host(layout.local_rank, layout.host_index, layout.num_hosts)
    if plan.rank == 0:
        across = f"{plan.lanes} rings across hosts per local rank" if layout.num_hosts > 1 else "no network"
        print(f"[fasthorovod] hierarchical allreduce: {layout.describe()} (shared memory inside each host, "
              f"{across}; FASTHOROVOD_HIERARCHICAL=0 turns it off)", file=sys.stderr, flush=True)
    return plan
