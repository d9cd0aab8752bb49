"""DistributedOptimizer with gradient buckets that live in the proxies' shared memory.

Horovod's ``_DistributedOptimizer`` is kept for everything that is not communication (argument
checks and their errors, ``step``, ``skip_synchronize``, ``load_state_dict``,
``set_backward_passes_per_step``); this module replaces how gradients travel:

* Parameters are packed, in reverse registration order (roughly the order backward produces
  their gradients), into buckets of at most FASTHOROVOD_BUCKET_BYTES of one dtype, or into the
  explicit ``groups`` when given (formed exactly as Horovod forms them).
* Without compression, each bucket is one flat tensor in a shared-memory segment registered with
  the proxies, and every ``p.grad`` is a view into it: backward accumulates straight into memory
  the proxies reduce in place — no copy in, no copy out.
* A hook after each gradient's accumulation counts down ``backward_passes_per_step``; when every
  gradient of a bucket is ready, the bucket's allreduce starts, so communication overlaps the rest
  of backward (``fasthorovod.buckets.GradientBuckets``, the engine OD-SGD's overlap uses too).
* With ``Compression.fp16``, float32 gradients on the CPU stay zero-copy: the proxies put float16
  on the wire and add in float32, in place of the compressor (``mpi_ops.wire_for``,
  docs/dataplane.md). With any other compressor, or for gradients on a GPU, the bucket's gradients
  are compressed and sent as one grouped allreduce (staged through shared memory), then
  decompressed into ``p.grad``.

Adasum, process sets other than the global one, and jobs without proxies (size 1,
FASTHOROVOD_NUM_PROXIES=0) use Horovod's own DistributedOptimizer unchanged.
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import torch
from horovod.common.process_sets import global_process_set
from horovod.common.util import split_list
from horovod.torch import optimizer as _hvd_optimizer
from horovod.torch.compression import Compression
from horovod.torch.functions import broadcast_object
from horovod.torch.mpi_ops import Adasum, Average, sparse_allreduce_async

from fasthorovod import scheduler as _scheduler
from fasthorovod.buckets import GradientBucket, GradientBuckets, reversed_buckets
from fasthorovod.torch import mpi_ops
from fasthorovod.torch.communicator import HorovodCommunicator
from fasthorovod.torch.trace_hooks import compute_spans
from fasthorovod.trace import capture as _trace


class _Bucket(GradientBucket):
    """Parameters whose gradients are allreduced together."""

    def __init__(self, index: int, params: List[torch.Tensor], name: str, zero_copy: bool,
                 wire: Optional[torch.dtype] = None) -> None:
        super().__init__(index, params)
        self.params = params
        self.name = name
        self.zero_copy = zero_copy
        self.wire = wire  # what the proxies put on the wire instead of the compressor (zero-copy only)
        self.flat: Optional[torch.Tensor] = None
        self.views: Dict[torch.Tensor, torch.Tensor] = {}
        self.ctxs = None
        self.sparse: Dict[torch.Tensor, object] = {}  # params whose gradient came sparse this step
        self.densified: List[torch.Tensor] = []  # sparse gradients sent dense (sparse_as_dense) this step

    def reset(self) -> None:
        super().reset()
        self.ctxs = None
        self.sparse.clear()
        self.densified.clear()


def _repeated_gradient(p: torch.Tensor, bucket: _Bucket) -> AssertionError:
    if bucket.handle is not None:
        return AssertionError(
            "Gradients were computed more than backward_passes_per_step times before call to step(). "
            "Increase backward_passes_per_step to accumulate gradients locally.")
    return AssertionError()  # Horovod's bare `assert self._allreduce_delay[p] > 0`


class _BucketedOptimizerMethods(torch.optim.Optimizer):
    """Methods that replace Horovod's communication; merged into the dynamic optimizer class."""

    def _register_hooks(self):
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._requires_update = set(params)
        buckets: List[_Bucket] = []
        group = mpi_ops.proxy_group()
        self._data_plane = group
        for index, plist in enumerate(self._plan_buckets(params, group.config.bucket_bytes)):
            on_cpu = all(p.device.type == "cpu" for p in plist)
            # Compression.fp16 of float32 gradients is the proxies' job: they stay zero-copy
            wire = mpi_ops.wire_for(self._compression, plist, self.op, self.process_set) if on_cpu else None
            zero_copy = ((self._compression is Compression.none or wire is not None)
                         and group.supports(plist[0].dtype) and on_cpu)
            name = f"fasthorovod.bucket.{index}.{self._parameter_names.get(plist[0])}"
            bucket = _Bucket(index, plist, name, zero_copy, wire)
            if zero_copy:
                self._place_in_shared_memory(bucket, group)
            buckets.append(bucket)
        # Readiness counts Horovod's own _allreduce_delay down (set_backward_passes_per_step and
        # load_state_dict reset it).
        self._gradient_buckets = GradientBuckets(
            buckets, self._launch, _repeated_gradient, accept=self._accept_gradient,
            passes=lambda: self.backward_passes_per_step, countdown=self._allreduce_delay)
        self._buckets = self._gradient_buckets.buckets
        self._bucket_of = self._gradient_buckets.bucket_of
        self._gradient_buckets.register_hooks(lambda p: p)

    def _plan_buckets(self, params: List[torch.Tensor], bucket_bytes: int) -> List[List[torch.Tensor]]:
        if self._groups is not None:
            # Horovod's grouping: rank 0's parameter order, explicit lists, the rest one group each.
            names = broadcast_object([self._parameter_names.get(p) for p in params], root_rank=0,
                                     process_set=self.process_set)
            params = sorted(params, key=lambda p: names.index(self._parameter_names.get(p)))
            if isinstance(self._groups, list):
                ids = {id(p) for p in params}
                groups = [[p for p in g if id(p) in ids] for g in self._groups]
                grouped = {id(p) for g in groups for p in g}
                groups += [[p] for p in params if id(p) not in grouped]
                return [g for g in groups if g]
            return [g for g in split_list(params, self._groups) if g]
        return reversed_buckets(params, lambda p: p.numel() * p.element_size(), bucket_bytes,
                                lambda first, p: p.dtype == first.dtype and p.device == first.device)

    def _follow_data_plane(self) -> None:
        """After ``hvd.shutdown()`` + ``hvd.init()`` (an elastic reset) the proxies are new: move
        every zero-copy bucket, with whatever its gradients hold, into the new data plane's
        shared memory. Without proxies now (one rank left), the buckets keep their memory and
        their allreduces go through Horovod."""
        group = mpi_ops.proxy_group()
        if group is self._data_plane:
            return
        self._data_plane = group
        for bucket in self._buckets:
            if not bucket.zero_copy or group is None or not group.supports(bucket.flat.dtype):
                continue
            old, old_views = bucket.flat, bucket.views
            bucket.flat = group.alloc(old.numel(), old.dtype)
            bucket.flat.copy_(old)
            offset = 0
            for p in bucket.params:
                view = bucket.flat[offset:offset + p.numel()].view_as(p)
                if p.grad is old_views[p]:
                    p.grad = view
                bucket.views[p] = view
                offset += p.numel()

    @staticmethod
    def _place_in_shared_memory(bucket: _Bucket, group) -> None:
        bucket.flat = group.alloc(sum(p.numel() for p in bucket.params), bucket.params[0].dtype)
        offset = 0
        for p in bucket.params:
            view = bucket.flat[offset:offset + p.numel()].view_as(p)
            if p.grad is not None and not p.grad.is_sparse:
                view.copy_(p.grad)
                p.grad = view
            else:
                # Leave p.grad alone (None until the first backward): a sparse gradient (e.g. from
                # nn.Embedding(sparse=True)) must stay sparse, which it cannot if autograd accumulates
                # it into a dense view. _launch binds dense gradients to the view on first use.
                view.zero_()
            bucket.views[p] = view
            offset += p.numel()

    @staticmethod
    def _accept_gradient(p: torch.Tensor, bucket: _Bucket) -> None:
        assert not p.grad.requires_grad
        if _trace.tracer is not None:
            compute_spans.gradient_ready()

    def _scale_factors(self):
        if self.op == Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _launch(self, bucket: _Bucket):
        """Starts the bucket's allreduce; returns its handle."""
        self._follow_data_plane()
        tracer = _trace.tracer
        if tracer is not None:
            tracer.event("grad_ready", bucket.name, bucket=bucket.index)
        prescale, postscale = self._scale_factors()
        dense = []
        for p in bucket.params:
            if p.grad is None:  # not computed here; another rank may have computed it
                p.grad = bucket.views[p].zero_() if bucket.zero_copy else torch.zeros_like(p)
            if p.grad.is_sparse:
                if self.sparse_as_dense:
                    p.grad = p.grad.to_dense()
                    bucket.densified.append(p)
                else:
                    bucket.sparse[p] = sparse_allreduce_async(p.grad, name=self._parameter_names.get(p),
                                                              op=self.op, process_set=self.process_set)
                    if bucket.zero_copy:
                        bucket.views[p].zero_()
                    continue
            dense.append(p)
        if bucket.zero_copy:
            for p in dense:
                view = bucket.views[p]
                if p.grad is not view:  # e.g. model.zero_grad(set_to_none=True) dropped the view
                    view.copy_(p.grad)
                    p.grad = view
            bucket.handle = mpi_ops._allreduce_async(bucket.flat, bucket.flat, bucket.name, self.op, prescale,
                                                     postscale, self.process_set, bucket.wire)
        else:
            compressed, bucket.ctxs = zip(*[self._compression.compress(p.grad) for p in bucket.params])
            bucket.handle = mpi_ops.grouped_allreduce_async_(list(compressed), name=bucket.name, op=self.op,
                                                             prescale_factor=prescale, postscale_factor=postscale,
                                                             process_set=self.process_set)
        self._handles[bucket.index] = bucket.handle
        return bucket.handle

    def synchronize(self):
        if not self.process_set.included():
            self._synchronized = True
            return
        self._gradient_buckets.post_remaining()
        tracer = _trace.tracer
        if tracer is not None:
            compute_spans.gradients_done()
        for bucket in self._buckets:
            outputs = mpi_ops.synchronize(bucket.handle)
            if not bucket.zero_copy:
                for p, out, ctx in zip(bucket.params, outputs, bucket.ctxs):
                    if p not in bucket.sparse:
                        p.grad.set_(self._compression.decompress(out, ctx))
            for p, sparse_handle in bucket.sparse.items():
                reduced = sparse_handle()
                p.grad.zero_().add_(reduced if reduced.is_sparse else reduced.to_sparse())
            for p in bucket.densified:  # as Horovod: back to sparse before the update (e.g. SparseAdam)
                p.grad = p.grad.to_sparse()
            self._gradient_buckets.reset_bucket(bucket)
        self._handles.clear()
        self._synchronized = True
        if tracer is not None:
            self._synchronized_ns = _trace.now_ns()

    def step(self, closure=None):
        tracer = _trace.tracer
        if tracer is None:
            return _hvd_optimizer._DistributedOptimizer.step(self, closure)
        entered = _trace.now_ns()
        self._synchronized_ns = 0
        result = _hvd_optimizer._DistributedOptimizer.step(self, closure)  # synchronize() stamps its end
        tracer.complete("update", "", max(entered, self._synchronized_ns), _trace.now_ns())
        tracer.next_step()
        return result

    def zero_grad(self, set_to_none: bool = True):
        """Zeroes gradients; gradients that are views into shared-memory buckets are zeroed in place."""
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        self._follow_data_plane()
        for group in self.param_groups:
            for p in group["params"]:
                bucket = self._bucket_of.get(p)
                if bucket is not None and bucket.zero_copy and p.grad is bucket.views[p]:
                    p.grad.zero_()
                elif p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().requires_grad_(False).zero_()

    def load_state_dict(self, *args, **kwargs):
        if hasattr(self, "_gradient_buckets"):
            self._gradient_buckets.reset()
        return _hvd_optimizer._DistributedOptimizer.load_state_dict(self, *args, **kwargs)


def _class_dict(cls) -> dict:
    return {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=global_process_set, algorithm="ssgd",
                         **algorithm_options):
    """Wraps `optimizer` so that ``step()`` applies gradients averaged (or summed) over all ranks.

    Same signature, arguments, errors and behaviour as ``horovod.torch.DistributedOptimizer``;
    with proxies running, gradients live in shared-memory buckets and travel over the proxies'
    parallel TCP rings (see the module docstring). ``zero_grad()`` zeroes bucketed gradients in
    place instead of setting them to None, which keeps them zero-copy.

    Two arguments are FastHorovod's own:

    algorithm: ``"ssgd"`` (default: synchronous SGD, as above), or a policy of
        ``fasthorovod.scheduler``: ``"od-sgd"`` (one-step delay), ``"ssd-sgd"`` (several-steps
        delay with GLU), ``"cd-sgd"`` (2-bit compression + delay + k-step correction),
        ``"local-sgd"`` ((post-)local SGD) or ``"ssgd-2bit"`` (synchronous SGD on 2-bit
        gradients; also chosen by ``compression=fasthorovod.scheduler.TwoBitCompression()``). The
        delayed policies keep the model's parameters as local weights: call
        ``optimizer.sync_weights()`` on every rank before evaluating or checkpointing.
    **algorithm_options: options of the chosen algorithm, each with a default:
        ``warmup_steps`` (od-sgd 200, ssd-sgd 500, cd-sgd 1000, local-sgd 0), ``local_lr_scale``
        (4.0; od/ssd/cd-sgd), ``local_update`` ("sgd" or "dc-asgd") and ``dc_lambda`` (0.04;
        od/cd-sgd), ``period`` (ssd-sgd 5, local-sgd 8), ``glu`` (1.0; ssd-sgd), ``threshold``
        (0.5; cd-sgd, ssgd-2bit), ``correction_period`` (5; cd-sgd). See docs/algorithms.md.
        An unknown algorithm or option, or any option with ``algorithm="ssgd"``, raises ValueError.
    """
    if algorithm != "ssgd" or algorithm_options or getattr(compression, "scheduled", False):
        # The scheduler speaks its own terms: None for Horovod's Average, global process set and
        # Compression.none; anything else is passed on for it to refuse (naming the algorithm).
        return _scheduler.DistributedOptimizer(
            optimizer, named_parameters, None if compression is Compression.none else compression,
            backward_passes_per_step, None if op is None or op == Average else op, gradient_predivide_factor,
            num_groups, groups, sparse_as_dense,
            None if process_set.process_set_id == global_process_set.process_set_id else process_set,
            algorithm=algorithm, communicator=HorovodCommunicator(), **algorithm_options)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if (op == Adasum or mpi_ops.proxy_group() is None
            or process_set.process_set_id != global_process_set.process_set_id):
        return _hvd_optimizer.DistributedOptimizer(
            optimizer, named_parameters=named_parameters, compression=compression,
            backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor, groups=groups,
            sparse_as_dense=sparse_as_dense, process_set=process_set)
    methods = {**_class_dict(_hvd_optimizer._DistributedOptimizer), **_class_dict(_BucketedOptimizerMethods)}
    # horovod.torch.broadcast_optimizer_state() tells a DistributedOptimizer by this module name; any
    # other name makes it call step() (a gradient allreduce) on the ranks without optimizer state only.
    methods["__module__"] = _hvd_optimizer._DistributedOptimizer.__module__
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set)
