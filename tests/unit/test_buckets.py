"""The gradient bucket engine shared by DistributedOptimizer and OD-SGD (fasthorovod.buckets)."""
import pytest
import torch

from fasthorovod.buckets import GradientBucket, GradientBuckets, reversed_buckets


def test_reversed_buckets_respects_the_limit_and_compatibility():
    assert reversed_buckets([1, 2, 3, 4], lambda x: x, 5) == [[4], [3, 2], [1]]
    assert reversed_buckets([1, 2, 3], lambda x: 1, 10, lambda first, x: x != 2) == [[3], [2, 1]]


def test_the_first_bucket_ends_once_it_holds_first_limit_bytes():
    assert reversed_buckets([1, 1, 2, 3, 1], lambda x: x, 5, first_limit=3) == [[1, 3], [2, 1, 1]]
    assert reversed_buckets([4, 1], lambda x: x, 4, first_limit=3) == [[1], [4]]  # `limit` comes first
    assert reversed_buckets([1, 1], lambda x: x, 5, first_limit=3) == [[1, 1]]


def make(passes=1, accepted=None):
    posted = []
    buckets = [GradientBucket(0, ["a", "b"]), GradientBucket(1, ["c"])]

    def post(bucket):
        posted.append(bucket.index)
        return f"handle{bucket.index}"
    engine = GradientBuckets(buckets, post, lambda key, bucket: RuntimeError(f"{key} twice"),
                             accept=None if accepted is None else lambda key, bucket: accepted.append(key),
                             passes=lambda: passes)
    return engine, posted


def test_a_bucket_is_posted_when_all_its_gradients_are_ready():
    accepted = []
    engine, posted = make(accepted=accepted)
    engine.gradient_ready("c")
    engine.gradient_ready("a")
    assert posted == [1] and engine.buckets[1].handle == "handle1"
    engine.gradient_ready("b")
    assert posted == [1, 0] and accepted == ["c", "a", "b"]
    with pytest.raises(RuntimeError, match="a twice"):
        engine.gradient_ready("a")
    engine.reset()
    assert all(b.handle is None and b.ready == 0 for b in engine.buckets)
    engine.gradient_ready("a")  # a new step


def test_leftovers_are_posted_with_their_missing_keys_and_passes_count_down():
    engine, posted = make(passes=2)
    for key in ("a", "a", "b"):
        engine.gradient_ready(key)
    assert posted == []
    filled = []
    engine.post_remaining(lambda bucket, missing: filled.append((bucket.index, missing)))
    assert posted == [0, 1] and filled == [(0, ["b"]), (1, ["c"])]
    engine.reset_bucket(engine.buckets[0])
    assert engine.countdown["a"] == 2 and engine.buckets[0].handle is None


def test_hooks_fire_after_accumulation_and_can_be_inactive():
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    active = [False]
    posted = []
    engine = GradientBuckets([GradientBucket(0, [p, q])], lambda b: posted.append(b.index),
                             lambda key, bucket: RuntimeError("twice"))
    engine.register_hooks(lambda key: key, active=lambda: active[0])
    (p.sum() + q.sum()).backward()
    assert posted == []
    active[0] = True
    (p.sum() + q.sum()).backward()
    assert posted == [0]
