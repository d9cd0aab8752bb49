"""Horovod's torch collectives with large Sum/Average allreduces, reduce-scatters, broadcasts,
allgathers and alltoalls routed through the proxies.

Every function here has the signature and behaviour of its namesake in ``horovod.torch`` 0.28.1.
An allreduce goes through FastHorovod's proxies when all of these hold, and through Horovod
unchanged otherwise (small tensors, Min/Max/Product/Adasum, other process sets, unsupported dtypes):

* proxies are running (``hvd.init()`` with size > 1 and FASTHOROVOD_NUM_LANES > 0);
* op is Sum or Average and the process set is the global one;
* the dtype is one the proxies reduce (uint8, int8, int16, int32, int64, float16, bfloat16,
  float32, float64) and the tensor holds at least FASTHOROVOD_PROXY_THRESHOLD_BYTES — or, for
  uint8, int8, int16 and bfloat16, which Horovod's CPU allreduce rejects, any size; and for float32
  tensors compressed with ``Compression.fp16`` or ``Compression.bf16``, any size too: the proxies
  then put float16 (bfloat16) on the wire themselves and the tensor stays float32 (``wire_for``,
  docs/dataplane.md).

The proxy path stages tensors through shared memory, so it also accepts non-contiguous tensors
(out-of-place allreduces of small non-contiguous tensors are made contiguous before Horovod sees
them). Proxy handles are plain ints like Horovod's: a proxy collective's handle is its negotiation
ticket, numbered from a range Horovod never uses (``_ticket_base``), so ``poll``/``synchronize``
accept both kinds. A name stays in flight from the call until its handle is synchronized (the
negotiation's member keeps the names): a second collective of that name meanwhile raises
``ValueError`` with Horovod's message.

A reduce-scatter (``reducescatter``, ``grouped_reducescatter`` and their ``_async`` forms) goes
through the proxies under the allreduce's conditions, once Horovod's own checks of the tensors
passed: the ring's reduce-scatter phase alone (in the hierarchical layout, the hierarchical
allreduce), with Horovod's split of the first dimension (fasthorovod/proxy/scatter.py).

An allgather (``allgather``, ``grouped_allgather`` and their ``_async`` forms, and so Horovod's own
``allgather_object`` and ``sparse_allreduce_async``, rebound to them) of the global process set goes
through the proxies at any size, for a dtype they carry and tensors of at least one dimension: the
first dimensions may differ between ranks, so each rank's row counts (and small payloads) travel
first through Horovod's allgather, then the rows over the lanes (in the hierarchical layout, as a
sum of integer words; fasthorovod/proxy/gather.py).

An alltoall (``alltoall``, ``alltoall_async``) of the global process set goes through the proxies'
mesh at any size, where the data plane has one (at most 256 ranks, in either layout), for a dtype
they carry and a tensor of at least one dimension, once Horovod's own checks of the arguments
passed (a call Horovod refuses goes to Horovod and raises its error): each rank's splits (and small
payloads) travel first through Horovod's allgather, then the blocks, each straight to its rank
(fasthorovod/proxy/alltoall.py).

A broadcast (``broadcast``, ``broadcast_``, ``broadcast_async``, ``broadcast_async_``, and so
``broadcast_parameters``, ``broadcast_optimizer_state`` and ``broadcast_object`` of
fasthorovod/torch/functions.py) goes through the proxies when proxies are running, the process set
is the global one and the tensor holds at least FASTHOROVOD_PROXY_THRESHOLD_BYTES; it runs as an
allreduce of the tensor's bytes as integers to which only the root contributes
(``ProxyGroup.broadcast``), so every rank receives the root's bytes exactly. Horovod's own checks
come first and raise Horovod's own errors (a dtype Horovod cannot broadcast, a non-contiguous
tensor), and a root rank out of range raises the ValueError Horovod raises, so a broadcast fails
or succeeds where Horovod's would.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from horovod.common.process_sets import global_process_set
from horovod.torch import functions as _hvd_functions
from horovod.torch import mpi_ops as _hvd
from fasthorovod.torch.compression import Compression
from horovod.torch.mpi_ops import Average, Sum, handle_average_backwards_compatibility

from fasthorovod.config import Config
from fasthorovod.exceptions import FastHorovodValueError
from fasthorovod.proxy.balance import LaneBalancer
from fasthorovod.proxy.rehash import FlowRehasher, warm_up
from fasthorovod.proxy import plan as planner
from fasthorovod.proxy.core import BROADCAST_WORDS
from fasthorovod.proxy.group import ProxyGroup
from fasthorovod.proxy.requests import Request, lendable
from fasthorovod.torch.rebind import ModuleNamespace, rebound
from fasthorovod.torch.trace_hooks import compute_spans
from fasthorovod.trace import capture as _trace
from fasthorovod.waiting import poll_until

class _Runtime:
    """Everything the facade keeps between calls; one instance, :data:`_runtime`.

    ``group``, ``balancer`` and ``rehasher`` are the running data plane and its policies (None
    without proxies); ``plan`` is the last data plane's plan, whose probe curves a later one among
    the same hosts reuses. ``handles`` maps the handles of proxy collectives in flight (their
    negotiation tickets) to what ``synchronize`` needs; ``horovod_names`` names traced Horovod-path
    handles. ``epoch`` counts the data planes this process started (every ``init()`` and
    ``restart_proxies()``, with proxies or without): buffers and requests of an older epoch are
    void, each epoch numbers its tickets from its own base (``_ticket_base``), and unnamed-tensor
    numbers only ever grow, so a stale handle never aliases a new one.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.group: Optional[ProxyGroup] = None
        self.balancer: Optional[LaneBalancer] = None
        self.rehasher: Optional[FlowRehasher] = None
        self.plan: Optional[planner.DataPlanePlan] = None
        self.handles: Dict[int, "_ProxyHandle"] = {}
        self.names = itertools.count()
        self.horovod_names: Dict[int, str] = {}
        self.epoch = 0
        self.two_stage_handles = itertools.count()  # replaced by every data plane (_start_proxies)
        # The names of allgathers and alltoalls in flight: their first stage is Horovod's, which
        # forgets the name once the heads are in, and their second is submitted later, from a
        # thread of the data plane's own; so the facade keeps the name from the call on.
        self.two_stage_names: Set[str] = set()

    def attach(self, group: ProxyGroup) -> None:
        """Runs `group` with the facade's policies (the lane balancer, the flow re-hasher) and
        observer (the trace)."""
        self.group, self.plan = group, group.plan
        self.balancer = LaneBalancer(group, group.config.rebalance_every)
        group.before_submit.append(self.balancer.before_request)
        if group.config.rehash:
            self.rehasher = FlowRehasher(group, forget=self.balancer.forget)
            group.before_submit.append(self.rehasher.before_request)
        group.after_submit.append(_trace_request)

    def detach(self) -> Optional[ProxyGroup]:
        """Forgets the data plane and every proxy handle; returns the group for the caller to close."""
        with self.lock:
            group, self.group, self.balancer, self.rehasher = self.group, None, None, None
            self.handles.clear()
            self.two_stage_names.clear()
        return group


_runtime = _Runtime()


# -- lifecycle ----------------------------------------------------------------------------------------

def init(comm=None, process_sets=None):
    """Horovod's ``init``; then, when size > 1, starts this worker's proxies and connects them.

    Called again after ``shutdown()`` (as Horovod elastic does on every reset), it forms new
    proxies for the new rank and size; optimizers move their buffers to them on first use.
    """
    _stop_proxies()
    _hvd.init(comm, process_sets)
    config = _start_proxies()
    if config.trace_dir:
        start_trace(config.trace_dir)


def start_trace(directory: str) -> None:
    """Starts the DLC trace (docs/trace.md) on this rank: its worker events and its proxies' frames.
    Collective: every rank calls it (clock offsets are estimated against rank 0)."""
    tracer = _trace.start_trace(directory, rank=_hvd.rank(), size=_hvd.size(), barrier=_hvd.barrier,
                                allgather_object=_hvd_functions.allgather_object)
    group = _runtime.group
    if group is not None:
        group.start_trace(directory, tracer.clock_offset_ns)
    compute_spans.install()


def stop_trace() -> None:
    """Stops the trace: the proxies close their files, then the worker's is flushed and closed."""
    compute_spans.remove()
    group = _runtime.group
    if group is not None:
        group.stop_trace()
    _trace.stop_trace()


def shutdown(*args, **kwargs):
    """Stops and reaps the proxies, unlinks shared memory, then shuts Horovod down."""
    stop_trace()
    _stop_proxies()
    _runtime.horovod_names.clear()
    return _hvd.shutdown(*args, **kwargs)


def _ticket_base(epoch: int) -> int:
    """The first ticket (and so handle) of this process's data plane of `epoch`: above 2**48,
    where Horovod's handles (small ints counted from 0) never reach, and 2**32 tickets apart, so
    that a handle of a data plane that is gone (``shutdown()``/``init()``, ``restart_proxies()``)
    never names a collective of a later one."""
    return (1 << 48) + (epoch << 32)


def _two_stage_handles(epoch: int):
    """The handles of `epoch`'s allgathers and alltoalls, whose two collectives have tickets of their own (or,
    the first, a Horovod handle): from the middle of the epoch's range, which tickets never reach."""
    return itertools.count(_ticket_base(epoch) + (1 << 31))


def _start_proxies() -> Config:
    config = Config.from_env()
    _runtime.epoch += 1
    _runtime.two_stage_handles = _two_stage_handles(_runtime.epoch)
    if planner.enabled(config, _hvd.size()):
        _runtime.attach(ProxyGroup.start(config, _hvd.rank(), _hvd.size(),
                                         _hvd_functions.broadcast_object, _hvd_functions.allgather_object,
                                         single_host=_hvd.local_size() == _hvd.size(), previous=_runtime.plan,
                                         first_ticket=_ticket_base(_runtime.epoch)))
        _warm_up()
    return config


def _warm_up() -> None:
    """Start-up's last step, where the probe saw flows collide: the flow re-hasher's warm-up
    (rehash.warm_up). A failure stops the data plane and raises, as any start-up failure does."""
    try:
        said = warm_up(_runtime.group, _runtime.rehasher)
    except BaseException:
        _stop_proxies()
        raise
    if said and _hvd.rank() == 0:
        print(f"[fasthorovod] start-up: {said}", file=sys.stderr, flush=True)


def restart_proxies() -> None:
    """Replaces this job's proxies with fresh ones, keeping Horovod running (collective: every
    rank must call it). After a FastHorovodError the data plane is unusable; this recovers it
    without the cost of hvd.shutdown()/hvd.init(). Pending proxy handles are dropped."""
    _stop_proxies()
    _start_proxies()
    tracer = _trace.tracer
    group = _runtime.group
    if tracer is not None and group is not None:
        group.start_trace(os.path.dirname(tracer.path), tracer.clock_offset_ns)


def _stop_proxies() -> None:
    group = _runtime.detach()
    if group is not None:
        group.close()


def epoch() -> int:
    """How many data planes this process has started (``init()``, ``restart_proxies()``): a buffer
    or request made under an earlier value belongs to a data plane that is gone (an elastic reset,
    shutdown + init, a restart of the proxies)."""
    return _runtime.epoch


def proxy_group() -> Optional[ProxyGroup]:
    """The running ProxyGroup, or None (size 1, proxies disabled, or not initialized)."""
    return _runtime.group


# -- routing ------------------------------------------------------------------------------------------

def _proxies_for(tensors: Sequence[torch.Tensor], op, process_set,
                 wire: Optional[torch.dtype] = None) -> Optional[ProxyGroup]:
    group = _runtime.group
    if group is None or op not in (Sum, Average) or process_set.process_set_id != global_process_set.process_set_id:
        return None
    dtype = tensors[0].dtype
    if not group.supports(dtype) or any(t.dtype != dtype for t in tensors):
        return None
    if any(t.device.type not in ("cpu", "cuda") for t in tensors):
        return None
    if dtype in _BEYOND_HOROVOD or wire is not None:
        return group
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return group if nbytes >= group.plan.threshold_bytes else None


# Reduced by the proxies but not by Horovod's torch CPU ops: always routed to the proxies.
_BEYOND_HOROVOD = (torch.uint8, torch.int8, torch.int16, torch.bfloat16)

# The compressors the proxies do themselves, on the wire: the type each hop carries.
_WIRE = {Compression.fp16: torch.float16, Compression.bf16: torch.bfloat16}


def wire_for(compression, tensors: Sequence[torch.Tensor], op=Average,
             process_set=global_process_set) -> Optional[torch.dtype]:
    """What the proxies put on the wire for `tensors` compressed with `compression`: float16 for
    Horovod's ``Compression.fp16`` (bfloat16 for ``Compression.bf16``) of float32 tensors that go
    through the proxies (at any size: the proxies then take the place of the compressor, whose
    rounding they reproduce), else None (the compressor runs as in Horovod)."""
    wire = _WIRE.get(compression)
    if wire is None or not tensors or any(t.dtype != torch.float32 for t in tensors):
        return None
    return wire if _proxies_for(tensors, op, process_set, wire) is not None else None


class _ProxyHandle:
    """What ``synchronize`` needs of a proxy collective: its one data-plane request (whose ticket
    is the handle), the outputs it fills, where it lands them first (the same tensors, or
    contiguous stand-ins for non-contiguous outputs), the result to return (or a function that
    returns it once the request is done: an allgather's outputs are made by its second stage) and
    its name."""

    def __init__(self, request: Request, outputs: List[torch.Tensor], landing: List[torch.Tensor],
                 result, name: str) -> None:
        self.request = request
        self.outputs = outputs
        self.landing = landing
        self.result = result
        self.name = name
        self.two_stage = False  # an allgather's or alltoall's (_register)


def _named(name: Optional[str], verb: str, two_stage: Optional[ProxyGroup] = None) -> str:
    """The collective's name: a fresh one when None. A name in flight is refused with Horovod's
    ValueError and message: here when an allgather or alltoall has it, or, for an allgather or
    alltoall (`two_stage`: its group, whose member submits its second stage later), when any
    collective of the data plane has it; else by the negotiation's member when the collective is
    submitted."""
    if name is None:
        return f"{verb}.noname.{next(_runtime.names)}"
    if name in _runtime.two_stage_names or (two_stage is not None and two_stage.member.holds(name)):
        raise ValueError(f"Requested to {verb} a tensor with the same name as another tensor that is currently "
                         f"being processed: '{name}'")
    return name


def _trace_request(name: str, nbytes: int, ticket: int) -> None:
    """The data plane's ``after_submit`` hook: every collective it posts is a trace event."""
    tracer = _trace.tracer
    if tracer is not None:
        tracer.event("request", name, bytes=nbytes, requests=[ticket], proxied=True)


def _register(request: Request, outputs, landing, result, name: str, handle: Optional[int] = None) -> int:
    """The handle of a posted proxy request: its negotiation ticket unless `handle` is given (a
    two-stage collective's, whose name the facade keeps until it is synchronized)."""
    entry = _ProxyHandle(request, list(outputs), list(landing), result, name)
    if handle is None:
        handle = request.ticket
    else:
        entry.two_stage = True
        _runtime.two_stage_names.add(name)
    _runtime.handles[handle] = entry
    return handle


def _post(group: ProxyGroup, tensors: Sequence[torch.Tensor], outputs: Optional[Sequence[torch.Tensor]],
          name: Optional[str], op, prescale_factor: float, postscale_factor: float, single: bool,
          wire: Optional[torch.dtype] = None) -> int:
    """Posts one fused allreduce of `tensors` (one dtype: ``_proxies_for`` routes nothing else) into
    `outputs`, or new tensors when None (lent from shared memory where ``lendable``); its result:
    the one output when `single`, else the tuple of them."""
    name = _named(name, "allreduce")
    lend = outputs is None and lendable(tensors)
    if outputs is None and not lend:
        outputs = [t.new(t.shape) for t in tensors]
    # A CUDA tensor is copied twice: into shared memory and back (copy_tensor crosses devices);
    # only a non-contiguous output lands in a host tensor first.
    landing = None if lend else [o if o.is_contiguous() else torch.empty(o.shape, dtype=o.dtype) for o in outputs]
    with _horovods_value_error():
        request = group.allreduce(tensors, landing, name, op == Average, prescale_factor, postscale_factor, wire)
    if lend:
        outputs = landing = ()
        result = (lambda: request.outputs[0]) if single else (lambda: tuple(request.outputs))
    else:
        result = outputs[0] if single else tuple(outputs)
    return _register(request, outputs, landing, result, name)


@contextlib.contextmanager
def _horovods_value_error():
    """Raises a bad argument the data plane refuses (a name already in flight among them) as the
    plain ValueError Horovod raises: the data plane's FastHorovodValueError is also a
    HorovodInternalError, which Horovod elastic would take for a failed peer and reset on."""
    try:
        yield
    except FastHorovodValueError as e:
        raise ValueError(str(e)) from None


def _finish(handle: int):
    entry = _runtime.handles.pop(handle)
    try:
        entry.request.wait()  # consumes the ticket, success or not: the name is free again
    finally:
        if entry.two_stage:
            _runtime.two_stage_names.discard(entry.name)
    for out, landed in zip(entry.outputs, entry.landing):
        if out is not landed:
            out.copy_(landed)
    return entry.result() if callable(entry.result) else entry.result


def poll(handle):
    """True when the operation behind `handle` has completed (Horovod's ``poll``)."""
    entry = _runtime.handles.get(handle)
    if entry is None:
        return _hvd.poll(handle)
    return entry.request.poll()


def synchronize(handle):
    """Waits for `handle` and returns its output (Horovod's ``synchronize``)."""
    tracer = _trace.tracer
    if tracer is not None:
        entry = _runtime.handles.get(handle)
        with tracer.span("wait", entry.name if entry is not None else _runtime.horovod_names.pop(handle, "")):
            return _finish(handle) if entry is not None else _horovod_synchronize(handle)
    if handle in _runtime.handles:
        return _finish(handle)
    return _horovod_synchronize(handle)


HOROVOD_POLL_MAX_SECONDS = 1e-3  # the longest pause between two polls of a Horovod handle


def _horovod_synchronize(handle):
    """Horovod's ``synchronize``, but waiting asleep: Horovod's own wait spins on the CPU
    (``sched_yield`` in a loop, holding a core for as long as the collective takes), which on a
    host whose cores also run the compute and the proxies slows both. Polls the handle instead,
    sleeping between polls from 20 us up to :data:`HOROVOD_POLL_MAX_SECONDS`, then lets Horovod's
    ``synchronize`` take the result (or raise its error); a handle Horovod does not know goes
    straight to it, which answers as it always does."""
    try:
        poll_until(lambda: _hvd.poll(handle), 20e-6, HOROVOD_POLL_MAX_SECONDS)
    except (ValueError, RuntimeError):
        pass  # an unknown or cleared handle: Horovod's synchronize answers
    return _hvd.synchronize(handle)


# -- allreduce ----------------------------------------------------------------------------------------

def _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, process_set, wire=None):
    """`output`: the tensor itself (in place) or None (a new tensor)."""
    group = _proxies_for([tensor], op, process_set, wire)
    if group is None:
        if output is None:
            output = tensor.new(tensor.shape)
            tensor = tensor.contiguous()  # out of place: Horovod needs contiguous input, the caller does not
        handle = _hvd._allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, process_set)
        tracer = _trace.tracer
        if tracer is not None and name:
            _runtime.horovod_names[handle] = name
            tracer.event("request", name, bytes=tensor.numel() * tensor.element_size(), proxied=False)
        return handle
    return _post(group, [tensor], None if output is None else [output], name, op, prescale_factor, postscale_factor,
                 True, wire)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Asynchronous allreduce; the input is not modified. See ``horovod.torch.allreduce_async``."""
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Asynchronous in-place allreduce. See ``horovod.torch.allreduce_async_``."""
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_async(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """In-place allreduce. See ``horovod.torch.allreduce_``."""
    handle = allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return synchronize(handle)


class _Allreduce(torch.autograd.Function):
    """allreduce as an autograd function: the gradient is allreduced with the same op."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set, wire):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        op = handle_average_backwards_compatibility(op, average)
        return synchronize(_allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor, process_set,
                                            wire))

    @staticmethod
    def backward(ctx, grad_output):
        average, op, prescale_factor, postscale_factor, process_set = ctx.args
        grad = allreduce(grad_output, average=average, op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, process_set=process_set)
        return (grad,) + (None,) * 7


def _resolved(op, average):
    """The op an allreduce runs (handle_average_backwards_compatibility's answer, without its warning)."""
    return op if op is not None else (Sum if average is False else Average)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Averages or sums `tensor` over all ranks (differentiable). See ``horovod.torch.allreduce``.
    With ``Compression.fp16`` (or ``Compression.bf16``) a float32 tensor that the proxies carry stays
    float32 on this rank: the proxies put float16 (bfloat16) on the wire and add in float32
    (``wire_for``)."""
    wire = wire_for(compression, [tensor], _resolved(op, average), process_set)
    if wire is not None:
        return _Allreduce.apply(tensor, average, name, op, prescale_factor, postscale_factor, process_set, wire)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor, process_set, None)
    return compression.decompress(reduced, ctx)


# -- grouped allreduce --------------------------------------------------------------------------------

def _grouped_allreduce_async(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set,
                             wire=None):
    """`outputs`: the tensors themselves (in place) or None (new tensors)."""
    group = _proxies_for(tensors, op, process_set, wire) if tensors else None
    if group is None:
        if outputs is None:
            outputs = [t.new(t.shape) for t in tensors]
        return _hvd._grouped_allreduce_async(tensors, outputs, name, op, prescale_factor, postscale_factor,
                                             process_set)
    return _post(group, list(tensors), None if outputs is None else list(outputs), name, op, prescale_factor,
                 postscale_factor, False, wire)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Asynchronous allreduce of a list of tensors as one group. See Horovod's."""
    op = handle_average_backwards_compatibility(op, average)
    return _grouped_allreduce_async(tensors, None, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Asynchronous in-place grouped allreduce. See Horovod's."""
    op = handle_average_backwards_compatibility(op, average)
    return _grouped_allreduce_async(tensors, tensors, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """In-place grouped allreduce. See Horovod's."""
    handle = grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    return synchronize(handle)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, wire, *tensors):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        op = handle_average_backwards_compatibility(op, average)
        handle = _grouped_allreduce_async(list(tensors), None, name, op, prescale_factor, postscale_factor,
                                          process_set, wire)
        return synchronize(handle)

    @staticmethod
    def backward(ctx, *grad_output):
        average, op, prescale_factor, postscale_factor, process_set = ctx.args
        grads = grouped_allreduce(list(grad_output), average=average, op=op, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, process_set=process_set)
        return (None,) * 7 + tuple(grads)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Averages or sums a list of tensors over all ranks as one group (differentiable). See Horovod's;
    ``Compression.fp16`` of float32 tensors as in :func:`allreduce`."""
    wire = wire_for(compression, list(tensors), _resolved(op, average), process_set)
    if wire is not None:
        return list(_GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                            wire, *tensors))
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = _GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set, None,
                                      *compressed)
    return [compression.decompress(t, ctx) for t, ctx in zip(reduced, ctxs)]


# -- reducescatter ------------------------------------------------------------------------------------

def _reducescatter_proxies_for(tensors: Sequence[torch.Tensor], op, process_set,
                               wire: Optional[torch.dtype] = None) -> Optional[ProxyGroup]:
    """The proxies for a reduce-scatter of `tensors` that Horovod would take (its checks run first:
    a dtype it cannot reduce-scatter, a non-contiguous tensor raise its own errors), as for an
    allreduce."""
    for t in tensors:
        _hvd._check_function(_hvd._reducescatter_function_factory, t)
    group = _proxies_for(tensors, op, process_set, wire) if tensors else None
    if group is None or any(t.dim() == 0 for t in tensors):
        return None
    return group


def _scatter_wire(compression, tensors: Sequence[torch.Tensor], op, process_set) -> Optional[torch.dtype]:
    """``wire_for`` of a reduce-scatter: the proxies' wire type only where they take it."""
    wire = wire_for(compression, tensors, op, process_set)
    return wire if wire is not None and _reducescatter_proxies_for(tensors, op, process_set, wire) else None


def _post_scatter(group: ProxyGroup, tensors: Sequence[torch.Tensor], name: Optional[str], op,
                  prescale_factor: float, postscale_factor: float, wire: Optional[torch.dtype], grouped: bool) -> int:
    name = _named(name, "reducescatter")
    with _horovods_value_error():
        request = group.reducescatter(tensors, name, op == Average, prescale_factor, postscale_factor, wire)
    outputs = request.outputs
    return _register(request, outputs, outputs, tuple(outputs) if grouped else outputs[0], name)


def _reducescatter_async(tensor, output, name, op, process_set, prescale_factor, postscale_factor, wire=None):
    group = _reducescatter_proxies_for([tensor], op, process_set, wire)
    if group is None:
        return _hvd._reducescatter_async(tensor, output, name, op, process_set, prescale_factor, postscale_factor)
    return _post_scatter(group, [tensor], name, op, prescale_factor, postscale_factor, wire, grouped=False)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Asynchronous reduce-scatter: this rank's rows of the reduced `tensor` (the first ``dim0 % size``
    ranks get one row more). See ``horovod.torch.reducescatter_async``."""
    return _reducescatter_async(tensor, tensor.new(), name, op, process_set, prescale_factor, postscale_factor)


class _Reducescatter(torch.autograd.Function):
    """reducescatter as an autograd function: Horovod's gradient (an allgather of the scaled gradient)."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor, wire):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return synchronize(_reducescatter_async(tensor, tensor.new(), name, op, process_set, prescale_factor,
                                                postscale_factor, wire))

    @staticmethod
    def backward(ctx, grad_output):
        return (_hvd.allgather(_scattered_gradient(grad_output, *ctx.args), process_set=ctx.args[1]),
                None, None, None, None, None, None)


def _scattered_gradient(grad, op, process_set, prescale_factor, postscale_factor):
    """Horovod's scaling of a reduce-scatter's gradient before it is allgathered."""
    if op == Sum:
        grad = grad * process_set.size()
    return grad * (prescale_factor * postscale_factor) if prescale_factor * postscale_factor != 1.0 else grad


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """This rank's rows of `tensor` reduced over all ranks (differentiable). See
    ``horovod.torch.reducescatter``; ``Compression.fp16`` (``bf16``) of a float32 tensor the proxies
    carry is done by them on the wire, as for :func:`allreduce`."""
    wire = _scatter_wire(compression, [tensor], op, process_set)
    if wire is not None:
        return _Reducescatter.apply(tensor, name, op, process_set, prescale_factor, postscale_factor, wire)
    compressed, ctx = compression.compress(tensor)
    reduced = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor, None)
    return compression.decompress(reduced, ctx)


def _grouped_reducescatter_async(tensors, outputs, name, op, process_set, prescale_factor, postscale_factor,
                                 wire=None):
    group = _reducescatter_proxies_for(tensors, op, process_set, wire)
    if group is None:
        return _hvd._grouped_reducescatter_async(tensors, outputs, name, op, process_set, prescale_factor,
                                                 postscale_factor)
    return _post_scatter(group, list(tensors), name, op, prescale_factor, postscale_factor, wire, grouped=True)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    """Asynchronous reduce-scatter of a list of tensors as one group. See Horovod's."""
    return _grouped_reducescatter_async(tensors, [t.new() for t in tensors], name, op, process_set,
                                        prescale_factor, postscale_factor)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, wire, *tensors):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return synchronize(_grouped_reducescatter_async(list(tensors), [t.new() for t in tensors], name, op,
                                                        process_set, prescale_factor, postscale_factor, wire))

    @staticmethod
    def backward(ctx, *grad_output):
        grads = [_scattered_gradient(g, *ctx.args) for g in grad_output]
        return (None,) * 6 + tuple(_hvd.grouped_allgather(grads, process_set=ctx.args[1]))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """This rank's rows of each of `tensors` reduced over all ranks, as one group (differentiable).
    See Horovod's; ``Compression.fp16`` of float32 tensors as in :func:`reducescatter`."""
    wire = _scatter_wire(compression, list(tensors), op, process_set)
    if wire is not None:
        return list(_GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor, wire,
                                                *tensors))
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor, None,
                                          *compressed)
    return [compression.decompress(t, ctx) for t, ctx in zip(reduced, ctxs)]


# -- allgather ----------------------------------------------------------------------------------------

def _allgather_proxies_for(tensors: Sequence[torch.Tensor], process_set) -> Optional[ProxyGroup]:
    """The proxies for an allgather of `tensors` that Horovod would take (its checks run first), of
    any size: whether a rank's share is large is known only once every rank's first dimension is
    (gather.py). For one dtype the proxies carry, CPU or CUDA tensors of at least one dimension."""
    for t in tensors:
        _hvd._check_function(_hvd._allgather_function_factory, t)
    group = _runtime.group
    if not tensors or group is None or process_set.process_set_id != global_process_set.process_set_id:
        return None
    dtype = tensors[0].dtype
    if not group.supports(dtype) or any(t.dtype != dtype or t.dim() == 0 for t in tensors):
        return None
    return group if all(t.device.type in ("cpu", "cuda") for t in tensors) else None


def _allgather_async(tensors, name, process_set, grouped: bool):
    group = _allgather_proxies_for(tensors, process_set)
    if group is None:
        if grouped:
            return _hvd.grouped_allgather_async(tensors, name, process_set)
        return _hvd.allgather_async(tensors[0], name, process_set)
    name = _named(name, "allgather", group)
    with _horovods_value_error():
        request = group.allgather_rows(tensors, name, _HorovodHeads)

    def result():
        return tuple(request.outputs) if grouped else request.outputs[0]
    return _register(request, (), (), result, name, next(_runtime.two_stage_handles))


class _HorovodHeads:
    """The first collective of an allgather or alltoall through the proxies (gather.py, alltoall.py:
    every rank's row counts or splits, and its rows when they are small) is Horovod's own
    allgather: it is small, so it takes Horovod's latency rather than a round of the proxies, and a
    small allgather is no slower than Horovod's. Polled from two threads (the caller's wait and the
    second-stage thread, whose wait synchronizes the handle: Horovod forgets it then), so both go
    through one lock."""

    def __init__(self, head: torch.Tensor, name: str) -> None:
        self._handle = _hvd.allgather_async(head, name=name)
        self._lock = threading.Lock()
        self._done = False
        self.output: Optional[torch.Tensor] = None

    def poll(self) -> bool:
        with self._lock:
            return self._done or _hvd.poll(self._handle)

    def wait(self) -> None:
        with self._lock:
            if self._done:
                return
            try:
                self.output = _horovod_synchronize(self._handle)
            finally:
                self._done = True


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Asynchronous allgather: every rank's `tensor` concatenated on the first dimension, which may
    differ between ranks. See ``horovod.torch.allgather_async``."""
    return _allgather_async([tensor], name, process_set, grouped=False)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Asynchronous allgather of a list of tensors as one group. See Horovod's."""
    return _allgather_async(list(tensors), name, process_set, grouped=True)


# allgather and grouped_allgather are Horovod's autograd functions (forward: allgather_async and
# synchronize; backward: an averaging allreduce and an allgather of the first dimensions), run with
# this module's collectives (rebind.py); sparse_allreduce_async is Horovod's, on these allgathers.
_horovods = ModuleNamespace(_hvd)


def _with_these_collectives(cls):
    return type(cls.__name__, (torch.autograd.Function,), {
        "__doc__": cls.__doc__, "__module__": __name__,
        "forward": staticmethod(rebound(cls.forward, _horovods, __name__)),
        "backward": staticmethod(rebound(cls.backward, _horovods, __name__))})


_Allgather = _with_these_collectives(_hvd.HorovodAllgather)
_GroupedAllgather = _with_these_collectives(_hvd.HorovodGroupedAllgather)


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's `tensor` concatenated on the first dimension (differentiable). See
    ``horovod.torch.allgather``."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Each of `tensors` allgathered, as one group (differentiable). See Horovod's."""
    return _GroupedAllgather.apply(name, process_set, *tensors)


sparse_allreduce_async = rebound(_hvd.sparse_allreduce_async, _horovods, __name__)


# -- alltoall -----------------------------------------------------------------------------------------

def _alltoall_splits(tensor: torch.Tensor, splits, size: int) -> Optional[List[int]]:
    """The rows for each rank as Horovod takes them (EnqueueTensorAlltoall), or None where Horovod
    would refuse the call (so that its own error is raised on its path): `splits` a 1-D int32
    tensor or a list of one count per rank summing to at most the first dimension, or None for
    equal shares of a first dimension divisible by the size."""
    if tensor.dim() == 0:
        return None
    rows = tensor.shape[0]
    if splits is None:
        return [rows // size] * size if rows % size == 0 else None
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1 or splits.dtype != torch.int32:
            return None
        counts = splits.tolist()
    else:
        try:
            counts = [int(c) for c in splits]
        except (TypeError, ValueError):
            return None
    if len(counts) != size or min(counts) < 0 or sum(counts) > rows:
        return None
    return counts


def _alltoall_proxies_for(tensor: torch.Tensor, splits, process_set) -> Optional[Tuple[ProxyGroup, List[int]]]:
    """The proxies and the rows for each rank, for an alltoall Horovod would take (its dtype check
    runs first), of any size (whether a block is large is known only once every rank's splits are:
    alltoall.py): where the data plane has the alltoall's mesh, for a dtype the proxies carry, CPU or
    CUDA. None: Horovod's path."""
    _hvd._check_function(_hvd._alltoall_function_factory, tensor)
    group = _runtime.group
    if (group is None or not group.mesh or process_set.process_set_id != global_process_set.process_set_id
            or not group.supports(tensor.dtype) or tensor.device.type not in ("cpu", "cuda")):
        return None
    rows = _alltoall_splits(tensor, splits, group.size)
    return (group, rows) if rows is not None else None


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Asynchronous alltoall: ``splits[d]`` rows of `tensor` to rank d (equal shares without
    splits); ``synchronize`` returns the rows received from every rank in rank order and the
    received splits. See ``horovod.torch.alltoall_async``."""
    route = _alltoall_proxies_for(tensor, splits, process_set)
    if route is None:
        return _hvd.alltoall_async(tensor, splits, name, process_set)
    group, rows = route
    name = _named(name, "alltoall", group)
    with _horovods_value_error():
        request = group.alltoall(tensor, rows, name, _HorovodHeads)

    def result():
        received = request.received_splits
        if isinstance(splits, torch.Tensor):  # Horovod's: splits.new(), filled
            return request.output, torch.tensor(received, dtype=splits.dtype, device=splits.device)
        return request.output, torch.tensor(received, dtype=torch.int32)
    return _register(request, (), (), result, name, next(_runtime.two_stage_handles))


_Alltoall = _with_these_collectives(_hvd.HorovodAlltoall)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """``splits[d]`` rows of `tensor` to rank d, the rows from every rank back (differentiable);
    with `splits`, also the received splits. See ``horovod.torch.alltoall``."""
    return _Alltoall.apply(tensor, splits, name, process_set)


_horovods.update(allgather_async=allgather_async, grouped_allgather_async=grouped_allgather_async,
                 allgather=allgather, grouped_allgather=grouped_allgather, synchronize=synchronize,
                 allreduce=allreduce, grouped_allreduce=grouped_allreduce, alltoall_async=alltoall_async,
                 alltoall=alltoall)

# -- barrier ------------------------------------------------------------------------------------------

# Horovod's barrier, waiting with this module's synchronize: asleep, where Horovod's own wait holds a
# core until the last rank arrives (the ranks that are ahead would spin on the cores the others
# compute on).
barrier = rebound(_hvd.barrier, _horovods, __name__)
_horovod_join = rebound(_hvd.join, _horovods, __name__)  # the same for the Horovod path's join


# -- broadcast ----------------------------------------------------------------------------------------

def _broadcast_proxies_for(tensor: torch.Tensor, process_set) -> Optional[ProxyGroup]:
    group = _runtime.group
    if group is None or process_set.process_set_id != global_process_set.process_set_id:
        return None
    if tensor.device.type not in ("cpu", "cuda") or tensor.element_size() not in BROADCAST_WORDS:
        return None
    return group if tensor.numel() * tensor.element_size() >= group.plan.threshold_bytes else None


def _broadcast_async(tensor, output, root_rank, name, process_set):
    # Horovod's own checks first (a dtype it cannot broadcast, a non-contiguous tensor: ValueError),
    # so that the proxies take only what Horovod would have taken.
    _hvd._check_function(_hvd._broadcast_function_factory, tensor)
    group = _broadcast_proxies_for(tensor, process_set)
    if group is None:
        handle = _hvd._broadcast_async(tensor, output, root_rank, name, process_set)
        tracer = _trace.tracer
        if tracer is not None and name:
            _runtime.horovod_names[handle] = name
            tracer.event("request", name, bytes=tensor.numel() * tensor.element_size(), proxied=False)
        return handle
    if not 0 <= root_rank < group.size:  # Horovod's message (EnqueueTensorBroadcast)
        raise ValueError(f"broadcast received invalid root rank {root_rank} for provided process set")
    name = _named(name, "broadcast")
    # Horovod's checks made both contiguous; a CUDA tensor is copied into shared memory (the root's
    # only) and back, as an allreduce's.
    with _horovods_value_error():
        req = group.broadcast(tensor, output, name, root_rank)
    return _register(req, [output], [output], output, name)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Asynchronous broadcast of the root's `tensor`; the input is not modified. See
    ``horovod.torch.broadcast_async``."""
    output = tensor.new(tensor.shape)
    return _broadcast_async(tensor, output, root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Asynchronous in-place broadcast. See ``horovod.torch.broadcast_async_``."""
    return _broadcast_async(tensor, tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast. See ``horovod.torch.broadcast_``."""
    handle = broadcast_async_(tensor, root_rank, name, process_set)
    return synchronize(handle)


class _Broadcast(torch.autograd.Function):
    """broadcast as an autograd function: Horovod's gradient (the average of the ranks' gradients on
    the root, zero elsewhere)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad_reduced = allreduce(grad_output, average=True, process_set=ctx.process_set)
        if _hvd.rank() != ctx.root_rank:
            grad_reduced *= 0
        return grad_reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """The root's `tensor` on every rank (differentiable); the input is not modified. See
    ``horovod.torch.broadcast``."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# -- join ---------------------------------------------------------------------------------------------

def join(device=-1) -> int:
    """Horovod's ``join``: blocks until every rank has joined; returns the rank that joined last.

    Until then this rank contributes zeros to the other ranks' allreduces, on Horovod's path (by
    Horovod) and on the proxies' path (by this rank's proxies, in the negotiated order). Allreduces
    this rank posted before joining still complete normally. The last rank is the negotiation's:
    the order in which rank 0's coordinator received the joins.
    """
    group = _runtime.group
    if group is None:
        return _horovod_join(device)
    group.begin_join()
    _horovod_join(device)  # the Horovod path's join; the proxies' path joins through the negotiation
    return group.end_join()
