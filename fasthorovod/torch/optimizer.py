"""DistributedOptimizer: Horovod's, with communication done by a policy of fasthorovod.scheduler.

``DistributedOptimizer(optimizer, ...)`` returns what Horovod's returns: an instance of a class
derived from the user's optimizer class, carrying Horovod's ``_DistributedOptimizer`` methods
(argument checks and their errors, ``step``, ``skip_synchronize``, ``load_state_dict``,
``set_backward_passes_per_step``) and Horovod's ``__module__``. That class is a thin surface: how
gradients travel is the scheduler's SSGD policy (fasthorovod/scheduler/ssgd.py: buckets in the
proxies' shared memory, posted during backward, ``Compression.fp16`` done by the proxies on the
wire), reached through the same :class:`HorovodCommunicator` as every other policy; the surface
hands ``synchronize``, ``zero_grad`` and the hooks to it. ``algorithm=`` names another policy
(OD-SGD, SSD-SGD, CD-SGD, ...), which is then the optimizer itself.

Adasum, process sets other than the global one, and jobs without proxies (size 1,
FASTHOROVOD_NUM_LANES=0) use Horovod's own DistributedOptimizer unchanged.
"""
from __future__ import annotations

import warnings

import torch
from horovod.common.process_sets import global_process_set
from horovod.torch import optimizer as _hvd_optimizer
from horovod.torch.compression import Compression
from horovod.torch.mpi_ops import Adasum, Average, Sum

from fasthorovod import scheduler as _scheduler
from fasthorovod.scheduler.comm import AVERAGE, SUM
from fasthorovod.torch import mpi_ops
from fasthorovod.torch.communicator import HorovodCommunicator
from fasthorovod.trace import capture as _trace


class _SSGDSurface(torch.optim.Optimizer):
    """What replaces Horovod's ``_DistributedOptimizer`` methods in the surface class: each hands
    over to the SSGD policy, ``self._policy``, built where Horovod registers its hooks."""

    def _register_hooks(self):
        config = mpi_ops.proxy_group().config
        self._policy = _scheduler.SSGD(
            self, HorovodCommunicator(), named_parameters=[(n, p) for p, n in self._parameter_names.items()],
            compression=None if self._compression is Compression.none else self._compression,
            op=SUM if self.op == Sum else AVERAGE, gradient_predivide_factor=self.gradient_predivide_factor,
            groups=self._groups, sparse_as_dense=self.sparse_as_dense,
            backward_passes_per_step=self.backward_passes_per_step,
            bucket_bytes=config.bucket_bytes, first_bucket_bytes=config.first_bucket_bytes,
            countdown=self._allreduce_delay)

    def synchronize(self):
        self._policy.synchronize()
        self._synchronized = True
        if _trace.tracer is not None:
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
        self._policy.zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes):
        _hvd_optimizer._DistributedOptimizer.set_backward_passes_per_step(self, passes)
        self._policy.set_backward_passes_per_step(passes)

    def load_state_dict(self, *args, **kwargs):
        policy = getattr(self, "_policy", None)
        if policy is not None:
            policy.reset()
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
    methods = {**_class_dict(_hvd_optimizer._DistributedOptimizer), **_class_dict(_SSGDSurface)}
    # horovod.torch.broadcast_optimizer_state() tells a DistributedOptimizer by this module name; any
    # other name makes it call step() (a gradient allreduce) on the ranks without optimizer state only.
    methods["__module__"] = _hvd_optimizer._DistributedOptimizer.__module__
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set)
