"""Broadcasts through the proxies, run as Horovod ranks by tests/multiproc/test_broadcast.py.

Every rank draws every rank's tensors from seeds, so it knows the root's bytes and checks its
result bit for bit; each broadcast is also run through Horovod itself (``horovod.torch``, same
process) and the two results compared byte for byte. The lanes' collective counters tell which path a
broadcast took. Scenarios exit non-zero on the first wrong value.
"""
import argparse
import sys

import horovod.torch as horovod
import torch

import fasthorovod.torch as hvd
import lanes  # tests/workers/, this script's directory

# The dtypes Horovod's CPU broadcast takes (bool and bfloat16 it rejects; see scenario_errors).
DTYPES = [torch.float32, torch.float64, torch.float16, torch.uint8, torch.int8, torch.int16, torch.int32,
          torch.int64]
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Bit patterns a floating-point sum would not keep (x86 quiets a signalling NaN) or that compare
# equal while differing (-0.0 and +0.0), per float width: ±0, ±inf, quiet and signalling NaNs with
# payloads, the smallest subnormal, the largest finite value.
SPECIAL_BITS = {
    2: [0x8000, 0x0000, 0x7C00, 0xFC00, 0x7E00, 0x7D55, 0xFD01, 0x7E3F, 0x0001, 0x7BFF],
    4: [0x80000000, 0x00000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFA5A5A5, 0x7FC12345,
        0x00000001, 0x7F7FFFFF],
    8: [0x8000000000000000, 0, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000,
        0x7FF0000000000001, 0xFFF4000000000BAD, 0x7FF8DEADBEEF0000, 1, 0x7FEFFFFFFFFFFFFF],
}


def signed(bits: int, width: int) -> int:
    """`bits` as the signed integer of `width` bytes (torch's int16/32/64 cannot hold them unsigned)."""
    return bits - (1 << (8 * width)) if bits >= 1 << (8 * width - 1) else bits


def rank_tensor(rank: int, count: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Random bytes for `rank` (every kind of value, NaNs with random payloads included), with the
    special patterns at the front for floating-point dtypes."""
    width = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    data = torch.randint(0, 256, (count * width,), dtype=torch.uint8, generator=gen).view(dtype)
    if dtype.is_floating_point:
        special = torch.tensor([signed(b, width) for b in SPECIAL_BITS[width]], dtype=WORDS[width]).view(dtype)
        n = min(count, special.numel())
        data[:n] = special[:n]
    return data


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(WORDS[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def lane_bytes() -> int:
    """The lanes' collectives so far (counted whether they move bytes over TCP or, with the
    hierarchical allreduce on one host, through shared memory only)."""
    return sum(s["collectives"] for s in hvd.proxy_group().lane_stats())


def check_path(before: int, proxied: bool, what: str) -> None:
    moved = lane_bytes() - before
    assert (moved > 0) == proxied, f"{what}: {moved} lane collectives, expected the {'proxy' if proxied else 'Horovod'} path"


def scenario_exact(args):
    """Every dtype, large (proxies) and small (Horovod), roots 0 and size-1, out of place, in place,
    async with poll/synchronize; bit-exact against the root's bytes and against Horovod's result."""
    rank, size = hvd.rank(), hvd.size()
    threshold = hvd.proxy_group().plan.threshold_bytes
    checked = 0
    for root in sorted({0, size - 1}):
        for salt, dtype in enumerate(DTYPES):
            width = torch.empty((), dtype=dtype).element_size()
            for count, proxied in ((threshold // width + 13, True), (37, False)):
                what = f"{dtype} x {count} from root {root}"
                mine = rank_tensor(rank, count, dtype, salt)
                expected = rank_tensor(root, count, dtype, salt)
                original = mine.clone()
                tag = f"{root}.{salt}.{count}"

                before = lane_bytes()
                out = hvd.broadcast(mine, root, name=f"b.{tag}")
                check_path(before, proxied, what)
                assert same_bits(out, expected), f"broadcast {what}: not the root's bytes"
                assert same_bits(mine, original), f"broadcast {what} modified its input"
                theirs = horovod.broadcast(mine, root, name=f"hvd.{tag}")
                assert same_bits(out, theirs), f"broadcast {what}: differs from Horovod's"

                handle = hvd.broadcast_async(mine, root, name=f"ba.{tag}")
                while not hvd.poll(handle):
                    pass
                assert same_bits(hvd.synchronize(handle), expected), f"broadcast_async {what}"

                inplace = original.clone()
                result = hvd.broadcast_(inplace, root, name=f"bi.{tag}")
                assert result is inplace and same_bits(inplace, expected), f"broadcast_ {what}"

                inplace = original.clone().reshape(-1, 1)  # another shape: 2-D
                handle = hvd.broadcast_async_(inplace, root, name=f"bai.{tag}")
                assert hvd.synchronize(handle) is inplace, f"broadcast_async_ {what} must return its tensor"
                assert same_bits(inplace.reshape(-1), expected), f"broadcast_async_ {what}"
                checked += 4
    # A tensor in the proxies' shared memory, in place: the root's zero-copy path.
    flat = hvd.proxy_group().alloc(threshold // 4 + 5, torch.float32)
    flat.copy_(rank_tensor(rank, flat.numel(), torch.float32, 99))
    hvd.broadcast_(flat, size - 1, name="shm")
    assert same_bits(flat, rank_tensor(size - 1, flat.numel(), torch.float32, 99)), "broadcast_ of a shm tensor"
    print(f"rank {rank}: exact ok, {checked} broadcasts", flush=True)


def scenario_functions(args):
    """broadcast_parameters / broadcast_optimizer_state / broadcast_object through the proxies, the
    same bytes as Horovod's own functions; broadcast's gradient as Horovod's."""
    rank, size = hvd.rank(), hvd.size()
    root = size - 1

    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))

    ours, theirs, reference = model(rank), model(rank), model(root)
    before = lane_bytes()
    hvd.broadcast_parameters(ours.state_dict(), root_rank=root)
    check_path(before, True, "broadcast_parameters")  # 2 MiB of weights: the large one is proxied
    horovod.broadcast_parameters(theirs.state_dict(), root_rank=root)
    for (name, a), b, c in zip(ours.state_dict().items(), theirs.state_dict().values(), reference.state_dict().values()):
        assert same_bits(a, b) and same_bits(a, c), f"broadcast_parameters: {name}"

    for net, bcast in ((ours, hvd.broadcast_optimizer_state), (theirs, horovod.broadcast_optimizer_state)):
        opt = torch.optim.SGD(net.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
        if rank == root:  # a state only the root has: momentum from one step
            for p in net.parameters():
                p.grad = torch.full_like(p, 0.5)
            opt.step()
        before = lane_bytes()
        bcast(opt, root_rank=root)
        if bcast is hvd.broadcast_optimizer_state:
            check_path(before, True, "broadcast_optimizer_state")
            ours_state = opt.state_dict()
        else:
            theirs_state = opt.state_dict()
    assert ours_state["param_groups"] == theirs_state["param_groups"], "optimizer options differ from Horovod's"
    assert ours_state["param_groups"][0]["lr"] == 0.1 * (root + 1)
    for key, state in ours_state["state"].items():
        assert same_bits(state["momentum_buffer"], theirs_state["state"][key]["momentum_buffer"]), key
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert same_bits(a, b), "the optimizer-state broadcast changed the weights differently"

    obj = {"rank": rank, "blob": bytes(range(256)) * (8192 if rank == root else 1)}  # 2 MiB on the root
    before = lane_bytes()
    got = hvd.broadcast_object(obj, root_rank=root)
    check_path(before, True, "broadcast_object")
    assert got == {"rank": root, "blob": bytes(range(256)) * 8192}, "broadcast_object"

    # Gradient: Horovod's HorovodBroadcast.backward (average over ranks on the root, zero elsewhere).
    count = (1 << 20) // 4 + 3
    weight = torch.arange(count, dtype=torch.float32) % 7 + rank
    grads = []
    for bcast in (hvd.broadcast, horovod.broadcast):
        x = rank_tensor(rank, count, torch.float32, 7).nan_to_num(0.0, 0.0, 0.0).clamp(-1, 1).requires_grad_()
        (bcast(x, root, name=f"grad.{len(grads)}") * weight).sum().backward()
        grads.append(x.grad)
    expected = (torch.arange(count, dtype=torch.float32) % 7) + (size - 1) / 2 if rank == root else torch.zeros(count)
    for grad in grads:  # (the averages may round differently in the last bit: the proxies scale by 1/size)
        assert torch.allclose(grad, expected, rtol=1e-6, atol=0), "broadcast's gradient differs from Horovod's"
    print(f"rank {rank}: functions ok", flush=True)


def expect(exc_type, text, fn, what):
    try:
        fn()
    except exc_type as e:
        assert text in str(e), f"{what}: {e}"
        return e
    raise AssertionError(f"{what}: no {exc_type.__name__}")


def scenario_errors(args):
    """Horovod's own errors, unchanged (checked against Horovod's), a duplicate name in flight, ranks
    that disagree on the root rank or the dtype (a clean error on every rank, then the next broadcast
    works), and a broadcast while a rank has joined."""
    rank, size = hvd.rank(), hvd.size()
    big = (hvd.proxy_group().plan.threshold_bytes // 4 + 1)
    for bad, text in ((size, f"invalid root rank {size}"), (-1, "invalid root rank -1")):
        for module in (hvd, horovod):
            expect(ValueError, text, lambda: module.broadcast(torch.ones(big), bad, name="bad.root"), "root")
    for tensor, text in ((torch.ones(big, dtype=torch.bool), "BoolTensor is not supported"),
                         (torch.ones(big, dtype=torch.bfloat16), "BFloat16Tensor is not supported"),
                         (torch.ones(2, big).t(), "required to be contiguous")):
        for module in (hvd, horovod):
            expect(ValueError, text, lambda: module.broadcast_(tensor, 0, name="bad.tensor"), str(tensor.dtype))

    handle = hvd.broadcast_async(torch.ones(big), 0, name="twice")
    expect(ValueError, "same name", lambda: hvd.broadcast_async(torch.ones(big), 0, name="twice"), "twice")
    assert torch.all(hvd.synchronize(handle) == 1)

    before = lane_bytes()
    e = expect(hvd.CollectiveMismatchError, "root rank",
               lambda: hvd.broadcast(torch.full((big,), float(rank)), rank % 2, name="mismatch.root"), "root")
    assert "rank 0" in str(e) and "rank 1" in str(e) and "'mismatch.root'" in str(e), str(e)
    assert lane_bytes() == before, "a mismatched broadcast must not reach the lanes"
    expect(hvd.CollectiveMismatchError, "float32",
           lambda: hvd.broadcast(torch.ones(big, dtype=torch.float32 if rank == 0 else torch.int32), 0,
                                 name="mismatch.dtype"), "dtype")
    expect(hvd.CollectiveMismatchError, "'mismatch.kind'",  # one name: a broadcast here, an allreduce there
           lambda: (hvd.broadcast(torch.ones(big), 0, name="mismatch.kind") if rank == 0
                    else hvd.allreduce(torch.ones(big), op=hvd.Sum, name="mismatch.kind")), "kind")
    out = hvd.broadcast(torch.full((big,), float(rank)), size - 1, name="after.mismatch")
    assert torch.all(out == size - 1), "the broadcast after a mismatch must work"

    if rank == size - 1:
        hvd.join()
    else:
        e = expect(hvd.HorovodInternalError, "Broadcast is not supported with Join",
                   lambda: hvd.broadcast(torch.ones(big), 0, name="during.join"), "join")
        hvd.join()
    out = hvd.broadcast(torch.full((big,), float(rank)), 0, name="after.join")
    assert torch.all(out == 0), "the broadcast after join must work"
    print(f"rank {rank}: errors ok", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["exact", "functions", "errors"])
    args = parser.parse_args()
    lanes.keep()
    hvd.init()
    try:
        assert hvd.proxy_group() is not None, "proxies must be running"
        globals()[f"scenario_{args.scenario}"](args)
        lanes.report(hvd.rank(), hvd)
    finally:
        hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
