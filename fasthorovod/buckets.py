"""Gradient buckets, shared by DistributedOptimizer (fasthorovod.torch) and the scheduler's OD-SGD:
how parameters are cut into buckets (:func:`reversed_buckets`), and the engine that posts a bucket
as soon as backward has produced all its gradients (:class:`GradientBuckets`).

Imports nothing of FastHorovod: both layers above use it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Generic, Hashable, List, Optional, Sequence, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def reversed_buckets(items: Sequence[T], nbytes: Callable[[T], int], limit: int,
                     compatible: Callable[[T, T], bool] = lambda first, item: True,
                     first_limit: Optional[int] = None) -> List[List[T]]:
    """`items` in reverse order (roughly the order backward produces their gradients), cut into
    consecutive buckets of at most `limit` bytes; an item larger than `limit` gets a bucket of its
    own, and an item not ``compatible(bucket's first item, item)`` starts a new bucket.

    With `first_limit`, the first bucket ends as soon as it holds `first_limit` bytes, so that its
    allreduce starts with the first gradients backward produces rather than waiting for a full
    bucket of them (PyTorch DDP's ``first_bucket_bytes``)."""
    buckets: List[List[T]] = []
    current: List[T] = []
    current_bytes = 0
    for item in reversed(items):
        size = nbytes(item)
        if current and (current_bytes + size > limit or not compatible(current[0], item)):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(item)
        current_bytes += size
        if not buckets and first_limit is not None and current_bytes >= first_limit:
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    return buckets


class GradientBucket:
    """Keys (parameters, or their indices) whose gradients are sent together. Subclass it for the
    sender's own per-bucket data; override :meth:`reset` to clear that data between steps."""

    def __init__(self, index: int, keys: List[Hashable]) -> None:
        self.index = index
        self.keys = keys
        self.ready = 0       # keys whose gradient is complete this step
        self.handle = None   # what `post` returned, once the bucket is posted this step

    def reset(self) -> None:
        self.ready = 0
        self.handle = None


B = TypeVar("B", bound=GradientBucket)


class GradientBuckets(Generic[B]):
    """The one engine that sends gradients bucket by bucket while backward runs (DistributedOptimizer
    and the scheduler's OD-SGD).

    A hook after each gradient's accumulation calls :meth:`gradient_ready`. Every key counts down
    `passes()` backward passes (``countdown``, which the caller may share, e.g. Horovod's
    ``_allreduce_delay``); when it reaches zero its bucket has one more ready key, and a bucket
    whose keys are all ready is posted at once through ``post(bucket)``, which returns a handle.
    A gradient that arrives while its key has no passes left raises ``repeated(key, bucket)``
    (backward ran more often than allowed before the step). ``accept(key, bucket)``, when given,
    runs for every gradient that passed that check, before it is counted (e.g. to copy it out).
    At the step, :meth:`post_remaining` posts what backward did not complete (unused parameters,
    no hooks yet); :meth:`reset` or :meth:`reset_bucket` start the next step.
    """

    def __init__(self, buckets: Sequence[B], post: Callable[[B], object],
                 repeated: Callable[[Hashable, B], BaseException],
                 accept: Optional[Callable[[Hashable, B], None]] = None,
                 passes: Callable[[], int] = lambda: 1,
                 countdown: Optional[Dict[Hashable, int]] = None) -> None:
        self.buckets: List[B] = list(buckets)
        self.bucket_of: Dict[Hashable, B] = {key: bucket for bucket in self.buckets for key in bucket.keys}
        self._post = post
        self._repeated = repeated
        self._accept = accept
        self._passes = passes
        self.countdown: Dict[Hashable, int] = {} if countdown is None else countdown
        for key in self.bucket_of:
            self.countdown[key] = passes()

    def register_hooks(self, tensor_of: Callable[[Hashable], "torch.Tensor"],
                       active: Optional[Callable[[], bool]] = None) -> None:
        """A post-accumulate-grad hook on every key's tensor; gradients arriving while ``active()``
        is False are ignored (the step then sends them)."""
        for bucket in self.buckets:
            for key in bucket.keys:
                tensor_of(key).register_post_accumulate_grad_hook(self._hook(key, active))

    def _hook(self, key: Hashable, active: Optional[Callable[[], bool]]):
        def hook(_tensor) -> None:
            if active is None or active():
                self.gradient_ready(key)
        return hook

    def gradient_ready(self, key: Hashable) -> None:
        bucket = self.bucket_of[key]
        if self.countdown[key] <= 0:
            raise self._repeated(key, bucket)
        if self._accept is not None:
            self._accept(key, bucket)
        self.countdown[key] -= 1
        if self.countdown[key] == 0:
            bucket.ready += 1
            if bucket.ready == len(bucket.keys):
                bucket.handle = self._post(bucket)

    def post_remaining(self, fill: Optional[Callable[[B, List[Hashable]], None]] = None) -> None:
        """Posts every bucket not posted yet, in order; ``fill(bucket, keys)`` first gets the keys
        whose gradient was not counted complete."""
        for bucket in self.buckets:
            if bucket.handle is None:
                if fill is not None:
                    fill(bucket, [key for key in bucket.keys if self.countdown[key] > 0])
                bucket.handle = self._post(bucket)

    def reset_bucket(self, bucket: B) -> None:
        for key in bucket.keys:
            self.countdown[key] = self._passes()
        bucket.reset()

    def reset(self) -> None:
        for bucket in self.buckets:
            self.reset_bucket(bucket)
