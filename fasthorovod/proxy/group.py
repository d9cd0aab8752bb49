"""ProxyGroup: one worker's data plane — its k proxy processes, their lanes, and the collectives it posts.

``ProxyGroup.start`` runs start-up (fasthorovod/proxy/startup.py: token, peers, the plan, the probe,
the channel, the proxies, the rings, the negotiation); the group then holds what start-up built and
its plan (fasthorovod/proxy/plan.py: lanes, sockets, layout, threshold, and why), posts collectives,
joins, traces and closes.

``close()`` (``hvd.shutdown()`` or interpreter exit) aborts collectives in flight and stops, kills
after :data:`SHUTDOWN_GRACE_SECONDS` and reaps the proxies. A worker that dies takes its proxies
with it (they watch it; a stopped one gets SIGHUP and SIGCONT from its orphaned process group); no
shared memory has a name, so no crash leaves anything in /dev/shm (docs/reliability.md).

The public API: ``supports``, ``alloc`` (a zero-copy shared-memory tensor), ``allreduce``,
``broadcast``, ``allgather``, ``allgather_rows``, ``reducescatter`` (asynchronous requests), ``begin_join``/``end_join``,
and what the policies and observers above use: ``before_submit``/``after_submit`` hooks (every collective passes
them on its one submit path), ``lane_stats``, ``lane_progress``, ``set_lane_weights`` (balance.py),
``socket_progress``, ``request_rehash`` (rehash.py).
Nothing here blocks on another rank except a wait on a request or on the join, and nothing talks
to Horovod after start-up. Collectives may be posted from any thread; an allgather of rows posts
its second stage from a thread of the group's own (stages.py).
"""
from __future__ import annotations

import atexit
import contextlib
import math
import os
import subprocess
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from fasthorovod import _C
from fasthorovod.config import Config
from fasthorovod.exceptions import FastHorovodError
from fasthorovod.proxy import alltoall, gather, scatter, startup
from fasthorovod.proxy.buffers import Buffer, BufferPool, stage, zero_tensor
from fasthorovod.proxy.core import BROADCAST_WORDS, DTYPE_CODES, OP_AVERAGE, OP_BROADCAST, OP_SUM, WIRE_CODES, hash64, request
from fasthorovod.proxy.plan import DataPlanePlan
from fasthorovod.proxy.requests import GatherRequest, Request
from fasthorovod.proxy.stages import SecondStages

SHUTDOWN_GRACE_SECONDS = 0.3  # at shutdown, before the proxies are killed (aborting can take seconds)


class ProxyGroup:
    def __init__(self, config: Config, rank: int, size: int) -> None:
        self.config = config  # what the user set
        self.rank = rank
        self.size = size
        self.plan: Optional[DataPlanePlan] = None  # what start-up decided
        self.channel: Optional[_C.ProxyChannel] = None
        self.coordinator: Optional[_C.Coordinator] = None  # rank 0 only
        self.member: Optional[_C.Member] = None
        self.pool: Optional[BufferPool] = None
        self.processes: List[subprocess.Popen] = []
        self.lane_weights: List[float] = []
        # The one submit path (_submit) calls these for every collective, whatever its kind:
        # before_submit() just before it is submitted (where the policies above steer the data
        # plane: the lane balancer, balance.py, may set new weights, which that collective then
        # carries), and
        # after_submit(name, nbytes, ticket) once it is posted (where observers see it: the trace).
        self.before_submit: List[Callable[[], None]] = []
        self.after_submit: List[Callable[[str, int, int], None]] = []
        self.second_stages = SecondStages()
        self.mesh = False  # whether the lanes can open the alltoall's mesh (startup.py)
        self._tracing = False
        self._join_ticket: Optional[int] = None
        self._lock = threading.Lock()
        self._submitting = threading.Lock()  # the hooks see one collective at a time, whatever the thread
        self._closed = False

    @classmethod
    def start(cls, config: Config, rank: int, size: int, broadcast_object: Callable, allgather_object: Callable,
              single_host: bool = False, previous: Optional[DataPlanePlan] = None,
              first_ticket: int = 0) -> "ProxyGroup":
        """Starts a data plane for `rank` of `size` (collective: every rank calls it), with Horovod's
        ``broadcast_object``/``allgather_object`` (or any that behave alike) for start-up's
        exchanges; `single_host`: every rank runs on this host (Horovod's local_size == size);
        `previous`: this process's last plan, whose probe curves may be reused (startup.run);
        `first_ticket`: the number of the group's first ticket (the negotiation numbers every
        collective's ticket from it, and the facade uses the tickets as its handles)."""
        group = cls(config, rank, size)
        try:
            startup.run(group, single_host, broadcast_object, allgather_object, previous)
            group.member.number_tickets_from(first_ticket)
        except BaseException:
            group.close()
            raise
        return group

    @property
    def lanes(self) -> int:
        return self.plan.lanes if self.plan is not None else 0

    def describe(self) -> dict:
        """The plan (what the data plane runs with, and why: plan.py) and the lane weights."""
        info = self.plan.describe() if self.plan is not None else {}
        info.update(lane_weights=list(self.lane_weights), rebalance_every=self.config.rebalance_every,
                    rehash=self.config.rehash, rehashes=sum(lane["rehashes"] for lane in self.lane_stats()))
        return info

    def _require_running(self) -> None:
        if self._closed or self.pool is None:
            raise FastHorovodError("FastHorovod proxies are shut down (call hvd.init() first)")

    @contextlib.contextmanager
    def _releasing_on_failure(self, buffer: Buffer, release: bool = True):
        """Gives `buffer` back to the pool (when `release`) if staging or submitting fails."""
        try:
            yield
        except BaseException:
            if release:
                self.pool.release(buffer)
            raise

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
        self._require_running()
        if count == 0:
            return torch.zeros(0, dtype=dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        flat = self.pool.register(count * itemsize).view(dtype, 0, count)
        zero_tensor(flat)
        return flat

    def set_lane_weights(self, weights: Sequence[float]) -> None:
        """The lane weights of the collectives this rank submits from now on (one positive finite
        number per lane). The member tells the coordinator, which cuts each run order by the
        weights of its lead rank (the lowest that submitted it): the ranks need not agree."""
        weights = [float(w) for w in weights]
        if len(weights) != self.lanes or not all(0.0 < w < math.inf for w in weights):
            raise ValueError(f"lane weights must be {self.lanes} positive numbers, got {weights}")
        if self.member is not None:
            self.member.set_lane_weights(weights)
        self.lane_weights = weights

    def lane_boundaries(self, count: int) -> List[int]:
        """Element boundaries of each lane's shard of `count` elements by this rank's lane weights:
        those of a collective it leads (the coordinator's computation, ``_C.shard_boundaries``)."""
        return _C.shard_boundaries(count, self.lane_weights)

    def allreduce(self, tensors: Sequence[torch.Tensor], outputs: Optional[Sequence[torch.Tensor]], name: str,
                  average: bool, prescale: float, postscale: float, wire: Optional[torch.dtype] = None) -> Request:
        """Posts one fused allreduce of same-dtype tensors into `outputs` (None: new outputs, lent
        from the staging buffer, in the request's ``outputs``; only where ``requests.lendable``);
        `wire` (float16 or bfloat16, for float32 tensors): what the proxies put on the wire instead
        (docs/dataplane.md)."""
        shapes = ";".join(",".join(map(str, t.shape)) for t in tensors)
        code = DTYPE_CODES[tensors[0].dtype] if wire is None else WIRE_CODES[(tensors[0].dtype, wire)]
        return self._reduce(tensors, outputs, name, OP_AVERAGE if average else OP_SUM, prescale,
                            postscale / self.size if average else postscale, shapes, code=code)

    def broadcast(self, tensor: torch.Tensor, output: torch.Tensor, name: str, root: int) -> Request:
        """Posts a broadcast of rank `root`'s `tensor` into every rank's `output` (contiguous, one shape
        and dtype; `output` may be `tensor`; only the root reads `tensor`): a ring sum (OP_BROADCAST)
        of the bytes as integers, to which only the root contributes, so every rank receives them
        exactly (docs/dataplane.md). The ranks negotiate the root, dtype and shape."""
        words = BROADCAST_WORDS.get(tensor.element_size())
        if words is None or output.element_size() != tensor.element_size():
            raise ValueError(f"the proxies cannot broadcast {tensor.dtype} (element size {tensor.element_size()})")
        description = f"{','.join(map(str, tensor.shape))} {str(tensor.dtype).replace('torch.', '')} from root rank {root}"
        source = tensor.view(words)
        destination = source if output is tensor else output.view(words)  # in place: zero-copy when in shm
        return self._reduce([source], [destination], name, OP_BROADCAST, 1.0, 1.0, description,
                            contribute=self.rank == root)

    def _reduce(self, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], name: str, op: int,
                prescale: float, postscale: float, description: str, contribute: bool = True,
                code: Optional[int] = None) -> Request:
        """Stages `tensors` (zeros instead when not `contribute`) unless the one tensor already lies in
        a shared-memory buffer, and submits the collective (`description`: what the ranks compare;
        `code`: the core's dtype code, by default the tensors' own)."""
        self._require_running()
        dtype, itemsize = tensors[0].dtype, tensors[0].element_size()
        count = sum(t.numel() for t in tensors)
        located = (self.pool.locate(tensors[0]) if contribute and len(tensors) == 1 and outputs is not None
                   and outputs[0] is tensors[0] else None)
        staged = located is None
        buffer, offset = located if located is not None else (self.pool.acquire(count * itemsize), 0)
        with self._releasing_on_failure(buffer, staged):
            offsets = stage(buffer, tensors, contribute) if staged else [offset]
            ticket = self._submit(buffer, name, description, count * itemsize, buffer_offset=offsets[0], count=count,
                                  dtype=DTYPE_CODES[dtype] if code is None else code, op=op, prescale=prescale,
                                  postscale=postscale)
        return Request(self, ticket, buffer, staged, tensors, outputs, offsets)

    def _submit(self, buffer: Buffer, name: str, description: str, nbytes: int, **fields) -> int:
        """The one way a collective reaches the negotiation: runs the ``before_submit`` hooks,
        submits the request on `buffer` (`description`: what the ranks compare; the run order
        brings its lane boundaries) and runs the ``after_submit`` hooks with `nbytes`, what the
        caller contributed. A name in flight (submitted and not yet waited on) raises
        FastHorovodValueError, a ValueError, with Horovod's message."""
        with self._submitting:
            for hook in self.before_submit:
                hook()
            ticket = self.member.submit(request(buffer_id=buffer.id, name=name, name_hash=hash64(name),
                                                shape_hash=hash64(description), **fields), description)
            for hook in self.after_submit:
                hook(name, nbytes, ticket)
        return ticket

    def allgather(self, tensor: torch.Tensor, name: str) -> GatherRequest:
        """Posts an allgather of every rank's 1-D `tensor` (same length and dtype everywhere):
        wait() fills ``request.output``, a (size, len) tensor whose row r is rank r's (gather.py)."""
        self._require_running()
        return gather.post(self, tensor, name)

    def allgather_rows(self, tensors: Sequence[torch.Tensor], name: str, gather_heads=None) -> "gather.RowsRequest":
        """Posts Horovod's allgather of `tensors` (first dimensions may differ between ranks): wait()
        fills the request's outputs with every rank's rows of each, in rank order (gather.py)."""
        self._require_running()
        return gather.post_rows(self, tensors, name, gather_heads)

    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int], name: str,
                 gather_heads=None) -> "alltoall.AlltoallRequest":
        """Posts Horovod's alltoall of `tensor`, ``splits[d]`` rows to rank d: wait() fills the
        request's ``output`` and ``received_splits`` (alltoall.py)."""
        self._require_running()
        if not self.mesh:
            raise FastHorovodError(f"this data plane has no alltoall mesh (more than {_C.MAX_MESH_RANKS} ranks)")
        return alltoall.post(self, tensor, splits, name, gather_heads)

    def reducescatter(self, tensors: Sequence[torch.Tensor], name: str, average: bool, prescale: float,
                      postscale: float, wire: Optional[torch.dtype] = None) -> Request:
        """Posts Horovod's reduce-scatter of `tensors` (one dtype, same shapes on every rank): wait()
        fills the request's outputs with this rank's rows of each reduced tensor (scatter.py)."""
        self._require_running()
        return scatter.post(self, tensors, name, average, prescale, postscale, wire)

    def begin_join(self) -> None:
        """This rank has joined: until every rank has, its proxies take part in the collectives the
        others submit, with zeros (the member posts them in the negotiated order)."""
        self._require_running()
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
        """Per lane, the proxies' counters: ``bytes_sent``, ``busy_ns``, ``collectives``, ``port``, ..."""
        return [self.channel.lane(j) for j in range(self.lanes)] if self.channel else []

    def lane_progress(self) -> Tuple[Tuple[int, int], ...]:
        """Per lane, (bytes_sent, busy_ns): what a policy reads before every request, without the
        rest of :meth:`lane_stats`."""
        return self.channel.lane_progress() if self.channel else ()

    def socket_progress(self, lane: int) -> List[Tuple[int, int]]:
        """Per send socket of `lane`, (bytes_sent, backlogged_ns): the flows' pace (rehash.py)."""
        return self.channel.socket_progress(lane) if self.channel else []

    def request_rehash(self, lane: int, sockets: Sequence[int]) -> None:
        """Has `lane` replace these send sockets by new connections after its next collective."""
        if self.channel is not None and not self._closed:
            self.channel.request_rehash(lane, sum(1 << s for s in set(sockets)))

    def close(self) -> None:
        """Aborts collectives in flight, stops the proxies and reaps them (killed after
        :data:`SHUTDOWN_GRACE_SECONDS`). Returns in well under a second. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.second_stages.close()
        self.before_submit.clear()  # the policies hold the group: no cycle keeps its channel alive
        self.after_submit.clear()
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
