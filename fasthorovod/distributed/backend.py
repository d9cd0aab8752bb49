"""ProcessGroupFastHorovod: the ``"fasthorovod"`` torch.distributed backend.

A c10d process group (a Python subclass of ``torch.distributed.ProcessGroup``, which torch returns
to the program as the group itself) with two data planes:

* this process's proxies (fasthorovod/proxy/group.py), for the large collectives of the world
  group: ``all_reduce`` (SUM, AVG), ``broadcast``, ``all_gather`` and ``all_gather_into_tensor``
  (``all_gather_single``), ``reduce_scatter`` and ``reduce_scatter_tensor``
  (``reduce_scatter_single``) of one contiguous tensor of a dtype the proxies carry and of at least
  the threshold (FASTHOROVOD_PROXY_THRESHOLD_BYTES; the plan's default), and
  the same collectives when FSDP2 issues them (``all_gather_single``, ``reduce_scatter_single``) or
  functional collectives do (``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``);
  and ``all_to_all_single`` of any size on the lanes' mesh (a dtype the proxies carry);
* an internal Gloo process group on the same store, for everything else: small tensors, other
  ops, ``all_to_all`` of tensor lists, ``barrier``, point-to-point, and every process group created
  after the first (subgroups), whose results are Gloo's own.

The proxies start up over the c10d store (fasthorovod/distributed/exchange.py) instead of
Horovod's collectives. c10d has every rank issue the same collectives in the same order, so a
proxied collective is named by its place in that order, and a thread of the group's own waits for
the proxies' requests in that order and completes their works' futures: ``work.wait()`` returns
once the result is in the tensors, or raises what failed (a mismatch, a dead peer,
``FastHorovodTimeoutError`` after the group's timeout).

``ReduceOp.AVG``, which Gloo refuses, is taken on both paths: the proxies average; a small tensor
is summed by Gloo and divided here.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import threading
import time
from datetime import timedelta
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from fasthorovod.config import PREFIX, Config
from fasthorovod.distributed.exchange import StoreExchange
from fasthorovod.exceptions import FastHorovodTimeoutError
from fasthorovod.proxy import plan as planner
from fasthorovod.proxy.core import BROADCAST_WORDS
from fasthorovod.proxy.group import ProxyGroup
from fasthorovod.proxy.startup import bind_address
from fasthorovod.waiting import poll_until

BACKEND_NAME = "fasthorovod"
_SUM, _AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


def _summing(op) -> bool:
    """SUM or AVG (an options' ``ReduceOp`` compares equal to the enum's values, not the reverse)."""
    return op == _SUM or op == _AVG

# The proxies of this process: one data plane per process, that of its first process group (the
# world, by init_process_group); a group created while they run is Gloo's alone.
_running: List[ProxyGroup] = []


def _on_gloo(method: str) -> Callable:
    """A ProcessGroupFastHorovod method that hands its call to the internal Gloo group's `method`."""
    def forward(self, *args, **kwargs):
        return getattr(self._gloo, method)(*args, **kwargs)
    forward.__name__ = method
    return forward


def start_proxies(store, rank: int, size: int, timeout: timedelta) -> Optional[ProxyGroup]:
    """This process's data plane, started over the c10d `store` (collective: every rank calls it),
    or None where it runs none (one rank, FASTHOROVOD_NUM_LANES=0). Its waits are bounded by
    `timeout` unless FASTHOROVOD_TIMEOUT_SECONDS says otherwise."""
    config = Config.from_env()
    if PREFIX + "TIMEOUT_SECONDS" not in os.environ:
        config = dataclasses.replace(config, timeout_seconds=timeout.total_seconds())
    if not planner.enabled(config, size):
        return None
    exchange = StoreExchange(dist.PrefixStore(BACKEND_NAME, store), rank, size, "startup")
    # One host: one address the proxies bind on (hostnames can coincide between hosts, e.g. network
    # namespaces of one machine)
    hosts = exchange.allgather_object(bind_address(config), name="hosts")
    group = ProxyGroup.start(config, rank, size, exchange.broadcast_object, exchange.allgather_object,
                             single_host=len(set(hosts)) == 1)
    _running.append(group)
    return group


def create(options, backend_options=None) -> "ProcessGroupFastHorovod":
    """The backend's constructor, as torch.distributed calls it (``Backend.register_backend`` with
    ``extended_api``: `options` holds the store, the group's rank and size, its timeout and name)."""
    group = ProcessGroupFastHorovod(options.store, options.group_rank, options.group_size, options.timeout)
    group.name_ = options.group_id  # what getGroupName() answers (DeviceMesh, FSDP2 ask)
    return group


class ProcessGroupFastHorovod(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        # What torch dispatches to by device rather than through this object's methods (the
        # coalesced collectives this class does not define) runs on Gloo
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._names = itertools.count()
        self._completions = Completions()
        # None: every collective is Gloo's
        self.proxies: Optional[ProxyGroup] = None if _running else start_proxies(store, rank, size, timeout)

    name_ = ""  # the group's name in torch.distributed (create)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self.name_

    def getGroupDesc(self) -> str:
        return f"{BACKEND_NAME}:{self.name_}"

    def shutdown(self) -> None:
        """Stops the proxies (collectives in flight fail) and the Gloo group (``destroy_process_group``
        calls it); a later ``init_process_group`` starts new ones."""
        if self.proxies is not None:
            self.proxies.close()
            _running.remove(self.proxies)
            self.proxies = None
        self._completions.close()
        self._gloo.shutdown()

    # -- routing --

    def _large(self, tensor: torch.Tensor, nbytes: Optional[int] = None) -> bool:
        """Whether the proxies take a collective of `tensor` moving `nbytes` (by default its own)."""
        group = self.proxies
        return (group is not None and group.supports(tensor.dtype) and tensor.is_contiguous()
                and tensor.device.type in ("cpu", "cuda")
                and (tensor.numel() * tensor.element_size() if nbytes is None else nbytes) >= group.plan.threshold_bytes)

    def _proxied(self, verb: str, post: Callable, finish: Optional[Callable], result) -> dist.Work:
        """Posts a collective to the proxies (`post(name)` returns the request) and returns its
        work: done once the request is and `finish()` copied the result out."""
        name = f"c10d.{verb}.{next(self._names)}"
        return _Work(self._completions.complete(name, post(name), finish, result, self.proxies.config.timeout_seconds))

    # -- the collectives the proxies take --

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        op = opts.reduceOp
        if len(tensors) == 1 and _summing(op) and self._large(tensors[0]):
            (t,) = tensors
            return self._proxied("allreduce", lambda name: self.proxies.allreduce([t], [t], name, op == _AVG, 1.0, 1.0),
                                 None, tensors)
        if op == _AVG:  # Gloo has no average: its sum, divided
            summed = dist.AllreduceOptions()
            summed.reduceOp = _SUM
            summed.timeout = opts.timeout
            work = self._gloo.allreduce(tensors, summed)
            return _Work(work.get_future().then(lambda f: [t.div_(self.size()) for t in f.value()]))
        return self._gloo.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        if len(tensors) == 1 and tensors[0].element_size() in BROADCAST_WORDS and self._large(tensors[0]):
            (t,) = tensors
            return self._proxied("broadcast", lambda name: self.proxies.broadcast(t, t, name, opts.rootRank), None,
                                 tensors)
        return self._gloo.broadcast(tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        if len(input_tensors) == 1 and self._gathers(input_tensors[0], output_tensors[0]):
            (x,), outputs = input_tensors, output_tensors[0]

            def finish():
                for out, row in zip(outputs, request.output):
                    out.copy_(row.view(out.shape))
            request = None

            def post(name):
                nonlocal request
                request = self.proxies.allgather(x.view(-1), name)
                return request
            return self._proxied("allgather", post, finish, output_tensors)
        return self._gloo.allgather(output_tensors, input_tensors, opts)

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        if output.is_contiguous() and output.numel() == self.size() * input.numel() and self._gathers(input, [output]):
            request = None

            def post(name):
                nonlocal request
                request = self.proxies.allgather(input.view(-1), name)
                return request
            return self._proxied("allgather", post, lambda: output.view(self.size(), -1).copy_(request.output),
                                 [output])
        return self._gloo._allgather_base(output, input, opts)

    _allgather_base = all_gather_single  # the name of earlier torch versions

    def _gathers(self, x: torch.Tensor, outputs) -> bool:
        """The proxies' allgather takes rows of one CPU tensor, gathered into tensors of its dtype."""
        return (x.device.type == "cpu" and all(o.dtype == x.dtype for o in outputs)
                and self._large(x, self.size() * x.numel() * x.element_size()))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if (len(output_tensors) == 1 and len(input_tensors[0]) == self.size() and _summing(opts.reduceOp)
                and self._scatters(output_tensors[0], input_tensors[0])):
            rows = torch.stack([x.reshape(-1) for x in input_tensors[0]])
            return self._scatter(output_tensors[0], rows, opts.reduceOp == _AVG)
        return self._gloo.reduce_scatter(output_tensors, input_tensors, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if (input.is_contiguous() and input.numel() == self.size() * output.numel()
                and _summing(opts.reduceOp) and self._scatters(output, list(input.view(self.size(), -1)))):
            return self._scatter(output, input.view(self.size(), -1), opts.reduceOp == _AVG)
        return self._gloo._reduce_scatter_base(output, input, opts)

    _reduce_scatter_base = reduce_scatter_single

    def _scatters(self, output: torch.Tensor, inputs) -> bool:
        return (self.proxies is not None
                and all(x.dtype == output.dtype and x.numel() == output.numel() for x in inputs)
                and self._large(output, self.size() * output.numel() * output.element_size()))

    def _scatter(self, output: torch.Tensor, rows: torch.Tensor, average: bool) -> dist.Work:
        """Reduce-scatters `rows` (size, n): this rank's row of the reduced rows into `output`."""
        request = None

        def post(name):
            nonlocal request
            request = self.proxies.reducescatter([rows], name, average, 1.0, 1.0)
            return request
        return self._proxied("reducescatter", post, lambda: output.copy_(request.outputs[0].view(output.shape)),
                             [output])

    # Functional collectives (torch.distributed._functional_collectives, which torch.compile and
    # DTensor issue) reach the group through these two and ``allreduce``: pair by pair as above.

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return _together([self.all_gather_single(o, x, opts) for o, x in zip(outputs, inputs)], outputs)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return _together([self.reduce_scatter_single(o, x, opts) for o, x in zip(outputs, inputs)], outputs)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        """``dist.all_to_all_single`` on the lanes' mesh (fasthorovod/proxy/alltoall.py) at any size:
        the ranks' splits may differ, so whether a rank's share is large is known only once the
        split matrix is, and every rank decides alike from what is the same everywhere (the dtype,
        the device kind, the data plane)."""
        opts = opts if opts is not None else dist.AllToAllOptions()
        group, n = self.proxies, self.size()
        if (group is None or not group.mesh or not group.supports(input.dtype) or input.dim() == 0
                or output.dtype != input.dtype or input.device.type not in ("cpu", "cuda")):
            return self._gloo.alltoall_base(output, input, output_split_sizes or [], input_split_sizes or [], opts)
        splits = list(input_split_sizes) if input_split_sizes else [input.shape[0] // n] * n
        request = None

        def post(name):
            nonlocal request
            request = group.alltoall(input, splits, name)
            return request

        def finish():
            if request.output.shape != output.shape:
                raise ValueError(f"all_to_all_single received {tuple(request.output.shape)} rows, the output "
                                 f"holds {tuple(output.shape)} (output_split_sizes: {output_split_sizes})")
            output.copy_(request.output)
        return self._proxied("alltoall", post, finish, [output])

    alltoall_base = all_to_all_single  # the name the process group calls

    # -- Gloo's alone (the internal group's method of the same name, or of the name Gloo gives it) --

    alltoall = _on_gloo("alltoall")
    barrier = _on_gloo("barrier")
    reduce = _on_gloo("reduce")
    gather = _on_gloo("gather")
    scatter = _on_gloo("scatter")
    send = _on_gloo("send")
    recv = _on_gloo("recv")
    recv_anysource = _on_gloo("recv_anysource")
    allreduce_coalesced = _on_gloo("allreduce_coalesced")
    allgather_coalesced = _on_gloo("allgather_coalesced")


def _together(works: List[dist.Work], outputs) -> dist.Work:
    """One work for several: done when all are, raising the first failure from ``wait()``."""
    if len(works) == 1:
        return works[0]

    def finish(done: torch.futures.Future):
        for future in done.value():
            future.value()  # raises what failed
        return outputs
    return _Work(torch.futures.collect_all([w.get_future() for w in works]).then(finish))


class _Work(dist._Work):
    """A collective's work, done when its future is: ``wait()`` raises what failed (a work made by
    ``_create_work_from_future`` returns instead), ``get_future()`` is what DDP chains its hooks on."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout=None) -> bool:
        self._future.wait()  # raises the future's exception
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            raise RuntimeError("the work is not completed yet")
        try:
            self._future.value()
        except BaseException:
            return False
        return True

    def exception(self):
        try:
            self._future.value()
        except BaseException as e:
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self):
        return self._future.value()


class Completions:
    """Completes the works of proxied collectives: one thread waits for their requests in the
    order they were posted, copies results out and sets the futures, or sets the exception that
    ended the wait. A request not done within the group's timeout (counted from its post: c10d's
    rule, where Horovod lets a collective wait for its peers as long as they take) fails with
    FastHorovodTimeoutError; the thread polls it meanwhile (50 microseconds, doubling to 1 ms)."""

    def __init__(self) -> None:
        self._queue: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def complete(self, name: str, request, finish: Optional[Callable], result,
                 timeout_seconds: float) -> torch.futures.Future:
        """The future of `request` (named `name`): set to `result` once it is done and `finish()`
        copied its result out, or to the exception that ended it."""
        future = torch.futures.Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fasthorovod-c10d", daemon=True)
                self._thread.start()
        self._queue.put((name, request, finish, future, result, time.monotonic() + timeout_seconds, timeout_seconds))
        return future

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            name, request, finish, future, result, deadline, timeout_seconds = item
            try:
                if not poll_until(request.poll, 50e-6, 1e-3, deadline):
                    raise FastHorovodTimeoutError(
                        f"collective {name} did not complete within the process group's timeout "
                        f"({timeout_seconds:g} s): a rank did not issue it, or is stopped or gone")
                request.wait()
                if finish is not None:
                    finish()
            except BaseException as e:  # raised by the work's wait()
                future.set_exception(e)
            else:
                future.set_result(result)
