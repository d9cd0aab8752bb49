"""Synchronous SGD on gradient buckets: the policy behind ``DistributedOptimizer``'s default.

Horovod's semantics, with gradients that travel in buckets instead of one by one:

* Parameters are packed, in reverse registration order (roughly the order backward produces
  their gradients), into buckets of at most ``bucket_bytes`` of one dtype and device (the first
  one ends once it holds ``first_bucket_bytes``, so communication starts with backward's first
  gradients), or into the explicit ``groups`` when given (formed exactly as Horovod forms them:
  rank 0's parameter order, the listed groups, every other parameter alone; or ``groups`` equal
  parts).
* Where the communicator reads a dtype in place (:meth:`Communicator.in_place`: the proxies'
  shared memory) and no compressor runs in the worker, a bucket is one flat tensor from
  :meth:`Communicator.alloc` and every ``p.grad`` is a view into it: backward accumulates straight
  into memory the transport reduces in place. A compressor the transport applies on the wire
  (:meth:`Communicator.wire_for`: the proxies' float16) keeps that. Otherwise the bucket's
  gradients are compressed and sent as one group, then decompressed into ``p.grad``.
* A hook after each gradient's accumulation counts down ``backward_passes_per_step`` (in
  ``countdown``, Horovod's ``_allreduce_delay`` when the Horovod surface shares it); when every
  gradient of a bucket is ready, the bucket's allreduce starts, so communication overlaps the rest
  of backward (:class:`fasthorovod.buckets.GradientBuckets`).
* :meth:`SSGD.synchronize` posts what backward did not (unused parameters), waits for every
  bucket and leaves the averaged (or summed) gradients in ``p.grad``; a sparse gradient travels
  as Horovod's sparse allreduce unless ``sparse_as_dense``.

``fasthorovod.torch.DistributedOptimizer`` is a thin Horovod-compatible surface over this policy
(fasthorovod/torch/optimizer.py): Horovod's own class, arguments, errors and ``step``, with this
policy's ``synchronize`` and ``zero_grad``.
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Sequence

import torch

from fasthorovod.buckets import GradientBucket, GradientBuckets, reversed_buckets
from fasthorovod.scheduler.base import ScheduledOptimizer
from fasthorovod.scheduler.comm import AVERAGE, SUM, Communicator, Handle


class _Bucket(GradientBucket):
    """Parameters whose gradients are allreduced together."""

    def __init__(self, index: int, params: List[torch.Tensor], name: str, zero_copy: bool, wire: Any) -> None:
        super().__init__(index, params)
        self.params = params
        self.name = name
        self.zero_copy = zero_copy
        self.wire = wire  # what the transport puts on the wire in place of the compressor (zero-copy only)
        self.flat: Optional[torch.Tensor] = None
        self.views: Dict[torch.Tensor, torch.Tensor] = {}
        self.staged: List[torch.Tensor] = []  # params whose (compressed) gradients went as a group this step
        self.ctxs: Sequence[Any] = ()
        self.sparse: Dict[torch.Tensor, Handle] = {}  # params whose gradient came sparse this step
        self.densified: List[torch.Tensor] = []  # sparse gradients sent dense (sparse_as_dense) this step

    def reset(self) -> None:
        super().reset()
        self.staged = []
        self.ctxs = ()
        self.sparse.clear()
        self.densified.clear()


def _repeated_gradient(p: Hashable, bucket: _Bucket) -> AssertionError:
    if bucket.handle is not None:
        return AssertionError(
            "Gradients were computed more than backward_passes_per_step times before call to step(). "
            "Increase backward_passes_per_step to accumulate gradients locally.")
    return AssertionError()  # Horovod's bare `assert self._allreduce_delay[p] > 0`


class SSGD(ScheduledOptimizer):
    """Synchronous SGD (see the module docstring).

    Besides the policies' common arguments it takes Horovod's ``DistributedOptimizer`` arguments in
    this package's terms: ``op`` (:data:`AVERAGE` or :data:`SUM`), ``gradient_predivide_factor``,
    ``groups``, ``sparse_as_dense``, ``backward_passes_per_step``; and ``bucket_bytes`` (the
    largest bucket), ``first_bucket_bytes`` (where the first bucket ends) and ``countdown`` (a dict
    to count backward passes in, shared with the caller).
    ``step()`` synchronizes (unless :meth:`synchronize` already did since the last step) and runs
    the user's optimizer.
    """

    algorithm = "ssgd"
    separate_global_weights = False

    def __init__(self, optimizer: torch.optim.Optimizer, communicator: Communicator, named_parameters=None,
                 compression=None, *, op: str = AVERAGE, gradient_predivide_factor: float = 1.0, groups=None,
                 sparse_as_dense: bool = False, backward_passes_per_step: int = 1, bucket_bytes: int = 25 << 20,
                 first_bucket_bytes: int = 1 << 20, countdown: Optional[Dict[torch.Tensor, int]] = None) -> None:
        if named_parameters is None:  # Horovod's names for unnamed parameters
            named_parameters = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(optimizer.param_groups)
                                for j, p in enumerate(group["params"])]
        super().__init__(optimizer, communicator, named_parameters, compression)
        if op not in (AVERAGE, SUM):
            raise ValueError(f"op must be {AVERAGE!r} or {SUM!r}, got {op!r}")
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        self._name_of = {p: n for p, n in zip(self._params, self._names)}
        self._synchronized = False
        self._started = True  # no counters to take from rank 0: every step is alike
        buckets = [self._bucket(index, params)
                   for index, params in enumerate(self._plan(groups, bucket_bytes, first_bucket_bytes))]
        self._gradient_buckets = GradientBuckets(
            buckets, self._post_bucket, _repeated_gradient, accept=self._accept_gradient,
            passes=lambda: self.backward_passes_per_step, countdown=countdown)
        self._buckets: List[_Bucket] = self._gradient_buckets.buckets
        self._gradient_buckets.register_hooks(lambda p: p)

    # -- buckets --------------------------------------------------------------------------------

    def _plan(self, groups, bucket_bytes: int, first_bucket_bytes: int) -> List[List[torch.Tensor]]:
        params = self._params
        if groups is None:
            return reversed_buckets(params, lambda p: p.numel() * p.element_size(), bucket_bytes,
                                    lambda first, p: p.dtype == first.dtype and p.device == first.device,
                                    first_limit=first_bucket_bytes)
        # Horovod's grouping: rank 0's parameter order, explicit lists, the rest one group each.
        names = self._comm.broadcast_object([self._name_of[p] for p in params], name="fasthorovod.ssgd.groups")
        params = sorted(params, key=lambda p: names.index(self._name_of[p]))
        if isinstance(groups, list):
            ids = {id(p) for p in params}
            listed = [[p for p in g if id(p) in ids] for g in groups]
            grouped = {id(p) for g in listed for p in g}
            listed += [[p] for p in params if id(p) not in grouped]
            return [g for g in listed if g]
        size, extra = divmod(len(params), groups)  # Horovod's split_list: `groups` near-equal parts
        cuts = [i * size + min(i, extra) for i in range(groups + 1)]
        return [params[a:b] for a, b in zip(cuts[:-1], cuts[1:]) if b > a]

    def _bucket(self, index: int, params: List[torch.Tensor]) -> _Bucket:
        on_cpu = all(p.device.type == "cpu" for p in params)
        wire = self._comm.wire_for(self._compression, params, self.op) if on_cpu else None
        zero_copy = ((self._compression is None or wire is not None) and on_cpu
                     and len({p.dtype for p in params}) == 1 and self._comm.in_place(params[0].dtype))
        bucket = _Bucket(index, params, f"fasthorovod.bucket.{index}.{self._name_of[params[0]]}", zero_copy, wire)
        if zero_copy:
            self._place(bucket)
        return bucket

    def _place(self, bucket: _Bucket) -> None:
        """Gives `bucket` a flat buffer from the communicator; a bucket that had one brings its
        contents along, and the gradients that were views into it become views into the new one."""
        old_flat, old_views = bucket.flat, bucket.views
        bucket.flat = self._comm.alloc(sum(p.numel() for p in bucket.params), bucket.params[0].dtype)
        if old_flat is not None:
            bucket.flat.copy_(old_flat)
        bucket.views = {}
        offset = 0
        for p in bucket.params:
            view = bucket.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            bucket.views[p] = view
            if old_flat is not None:
                if p.grad is old_views[p]:
                    p.grad = view
            elif p.grad is not None and not p.grad.is_sparse:
                view.copy_(p.grad)
                p.grad = view
            # Else p.grad stays (None until the first backward): a sparse gradient (e.g. from
            # nn.Embedding(sparse=True)) must stay sparse, which it cannot if autograd accumulates
            # it into a dense view. _post_bucket binds dense gradients to the view on first use.

    def reset_communication(self) -> None:
        """Moves every flat bucket, with whatever its gradients hold, onto the transport that
        replaced the old one (an elastic reset, ``hvd.shutdown()`` + ``hvd.init()``)."""
        self._epoch = self._comm.epoch
        for bucket in self._buckets:
            if bucket.zero_copy:
                self._place(bucket)

    def _accept_gradient(self, p: torch.Tensor, bucket: _Bucket) -> None:
        assert not p.grad.requires_grad
        self._comm.note("gradient")

    def _scale_factors(self):
        if self.op == AVERAGE:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _post_bucket(self, bucket: _Bucket) -> Handle:
        """Starts the bucket's allreduce (and its sparse gradients'); returns its handle."""
        self._follow_transport()
        self._comm.note("posted", bucket.name, bucket=bucket.index)
        dense = []
        for p in bucket.params:
            if p.grad is None:  # not computed here; another rank may have computed it
                p.grad = bucket.views[p].zero_() if bucket.zero_copy else torch.zeros_like(p)
            if p.grad.is_sparse:
                if self.sparse_as_dense:
                    p.grad = p.grad.to_dense()
                    bucket.densified.append(p)
                else:
                    bucket.sparse[p] = self._comm.sparse_allreduce_async(p.grad, self._name_of[p], self.op)
                    if bucket.zero_copy:
                        bucket.views[p].zero_()
                    continue
            dense.append(p)
        prescale, postscale = self._scale_factors()
        if bucket.zero_copy:
            for p in dense:
                view = bucket.views[p]
                if p.grad is not view:  # e.g. model.zero_grad(set_to_none=True) dropped the view
                    view.copy_(p.grad)
                    p.grad = view
            return self._comm.allreduce_async([bucket.flat], bucket.name, self.op, prescale, postscale, bucket.wire)
        # Staged: only the dense gradients are compressed and sent as a group (a sparse one went
        # above, as Horovod's sparse allreduce).
        bucket.staged = dense
        if not dense:
            return Handle(lambda: [])
        compress = self._compression.compress if self._compression is not None else (lambda t: (t, None))
        compressed, bucket.ctxs = zip(*[compress(p.grad) for p in dense])
        return self._comm.allreduce_async(list(compressed), bucket.name, self.op, prescale, postscale)

    # -- the step -------------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Posts every bucket backward did not complete, waits for all of them and leaves the
        reduced gradients in ``p.grad`` (Horovod's ``synchronize``)."""
        self._follow_transport()
        self._gradient_buckets.post_remaining()
        self._comm.note("gradients_done")
        for bucket in self._buckets:
            outputs = bucket.handle.wait()
            if not bucket.zero_copy:
                decompress = (self._compression.decompress if self._compression is not None
                              else (lambda t, ctx: t))
                for p, out, ctx in zip(bucket.staged, outputs, bucket.ctxs):
                    p.grad.set_(decompress(out, ctx))
            for p, sparse in bucket.sparse.items():
                reduced = sparse.wait()
                p.grad.zero_().add_(reduced if reduced.is_sparse else reduced.to_sparse())
            for p in bucket.densified:  # as Horovod: back to sparse before the update (e.g. SparseAdam)
                p.grad = p.grad.to_sparse()
            self._gradient_buckets.reset_bucket(bucket)
        self._synchronized = True

    def in_flight(self) -> bool:
        """Whether a bucket was posted since the last synchronize (backward ran, step did not)."""
        return any(bucket.handle is not None for bucket in self._buckets)

    def reset(self) -> None:
        """Forgets what backward posted and counted this step (a loaded state starts afresh)."""
        self._gradient_buckets.reset()
        self._synchronized = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._gradient_buckets.reset()

    def _begin(self) -> None:
        self._follow_transport()

    def _policy_step(self) -> None:
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes gradients; gradients that are views into flat buckets are zeroed in place, so
        they stay where the transport reads them."""
        if self.in_flight():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        self._follow_transport()
        bucket_of = self._gradient_buckets.bucket_of
        for group in self.param_groups:
            for p in group["params"]:
                bucket = bucket_of.get(p)
                if bucket is not None and bucket.zero_copy and p.grad is bucket.views[p]:
                    p.grad.zero_()
                elif p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().requires_grad_(False).zero_()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.reset()
        super().load_state_dict(state_dict)
