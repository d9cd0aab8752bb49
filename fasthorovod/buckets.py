"""How gradients are cut into buckets, shared by DistributedOptimizer and the scheduler's OD-SGD."""
from __future__ import annotations

from typing import Callable, List, Sequence, TypeVar

T = TypeVar("T")


def reversed_buckets(items: Sequence[T], nbytes: Callable[[T], int], limit: int,
                     compatible: Callable[[T, T], bool] = lambda first, item: True) -> List[List[T]]:
    """`items` in reverse order (roughly the order backward produces their gradients), cut into
    consecutive buckets of at most `limit` bytes; an item larger than `limit` gets a bucket of its
    own, and an item not ``compatible(bucket's first item, item)`` starts a new bucket."""
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
    if current:
        buckets.append(current)
    return buckets
