"""The scheduler's policies against hand-written references, in an in-process world of ranks.

Each rank runs in a thread with its own model and optimizer; a fake communicator averages (in
rank order, then times 1/size, as Horovod does) once every rank has posted. It is as strict as the
real, negotiated data plane: collectives are matched by name in any order, a name may not be in
flight twice on one rank, and ranks that describe one name differently (shape, dtype) fail with
CollectiveMismatchError on every rank. The problem is tiny
and exact: one float64 (float32 for 2-bit) parameter vector, gradients ``a * (w - c_{rank,t})``
set directly into ``p.grad``, and an SGD(lr=1/4, momentum=1/2) with dyadic data, so every
sequence of global and local weights can be compared bit for bit with a reference written out
step by step below — including the switch from warm-up to the delayed stage and sync_weights().
"""
import collections
import copy
import threading

import pytest
import torch

import fasthorovod.torch as hvd
from fasthorovod.scheduler import (
    ALGORITHMS,
    SSGD,
    Communicator,
    DistributedOptimizer,
    Handle,
    TwoBitCompression,
)

LR, MOMENTUM = 0.25, 0.5
A = torch.tensor([1.0, 0.5, 1.0, 0.5])


# -- a world of ranks in one process ----------------------------------------------------------------

class World:
    def __init__(self, size):
        self.size = size
        self.cv = threading.Condition()
        self.posts = {}
        self.log = collections.defaultdict(list)  # rank -> [(kind, name, numel)]
        self.scopes = collections.Counter()


class FakeComm(Communicator):
    def __init__(self, world, rank):
        self.world, self.rank, self.size = world, rank, world.size
        self.seq = collections.Counter()
        self.in_flight = set()

    def replace(self):
        """What an elastic reset does to the transport: a new one (epoch + 1), nothing in flight."""
        self.in_flight.clear()
        self.epoch += 1

    def new_scope(self):  # the ranks are threads of one process: count per rank
        self.world.scopes[self.rank] += 1
        return self.world.scopes[self.rank]

    def _post(self, kind, name, value):
        if (kind, name) in self.in_flight:
            raise ValueError(f"rank {self.rank}: {kind} {name!r} is already in flight")
        self.in_flight.add((kind, name))
        key = (kind, name, self.seq[(kind, name)])
        self.seq[(kind, name)] += 1
        self.world.log[self.rank].append((kind, name, getattr(value, "numel", lambda: 0)()))
        with self.world.cv:
            self.world.posts.setdefault(key, {})[self.rank] = value
            self.world.cv.notify_all()

        def collect():
            with self.world.cv:
                if not self.world.cv.wait_for(lambda: len(self.world.posts[key]) == self.size, timeout=30):
                    raise TimeoutError(f"rank {self.rank}: {key} never completed")
                values = [self.world.posts[key][r] for r in range(self.size)]
            self.in_flight.discard((kind, name))
            if isinstance(value, torch.Tensor):
                described = [(tuple(v.shape), v.dtype) for v in values]
                if len(set(described)) > 1:
                    raise hvd.CollectiveMismatchError(
                        f"collective mismatch for tensor {name!r}: the ranks disagree on its shape or dtype ("
                        + ", ".join(f"rank {r}: {d}" for r, d in enumerate(described)) + ")")
            return values
        return collect

    def in_place(self, dtype):
        return True  # alloc's buffers are "the transport's": SSGD's buckets are flat, as on the proxies

    def allreduce_async(self, tensors, name, op="average", prescale=1.0, postscale=1.0, wire=None):
        assert wire is None, "this world has no transport that compresses"
        collect = self._post("allreduce", name, torch.cat([t.reshape(-1) for t in tensors]) * prescale)

        def wait():
            values = collect()
            total = values[0].clone()
            for v in values[1:]:
                total += v
            total = total * (1.0 / self.size if op == "average" else 1.0) * postscale
            offset = 0
            for t in tensors:
                t.copy_(total[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            return list(tensors)
        return Handle(wait)

    def sparse_allreduce_async(self, tensor, name, op="average"):
        handle = self.allreduce_async([tensor.to_dense()], name, op)
        return Handle(lambda: handle.wait()[0])

    def allgather_packed_async(self, words, name):
        collect = self._post("allgather", name, words.clone())
        return Handle(lambda: torch.stack(collect()))

    def broadcast_object(self, obj, name="counters"):
        return copy.deepcopy(self._post("broadcast", name, obj)()[0])


def run_world(size, body):
    """Runs body(rank, comm) in one thread per rank; returns [result of rank r]."""
    world = World(size)
    results, errors = [None] * size, []

    def target(rank):
        try:
            results[rank] = body(rank, FakeComm(world, rank))
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)
            with world.cv:
                world.cv.notify_all()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert all(not t.is_alive() for t in threads), "a rank hung"
    return results


def test_the_fake_world_is_as_strict_as_the_negotiation():
    def body(rank, comm):
        # any order works, as with the real data plane
        names = ["a", "b"] if rank == 0 else ["b", "a"]
        handles = {n: comm.allreduce_average_async(torch.full((3,), float(rank)), n) for n in names}
        assert all(torch.equal(handles[n].wait(), torch.full((3,), 0.5)) for n in names)
        first = comm.allreduce_average_async(torch.zeros(2), "c")
        with pytest.raises(ValueError, match="already in flight"):
            comm.allreduce_average_async(torch.zeros(2), "c")
        first.wait()
        bad = comm.allreduce_average_async(torch.zeros(4 + rank), "d")
        with pytest.raises(hvd.CollectiveMismatchError, match="'d'.*rank 0: \\(\\(4,\\).*rank 1: \\(\\(5,\\)"):
            bad.wait()
        return True

    assert run_world(2, body) == [True, True]


# -- the problem ------------------------------------------------------------------------------------

def target(rank, t):
    """c_{rank,t}: dyadic targets that differ per rank and step."""
    return torch.tensor([1.0, -2.0, 0.5, 3.0]) * (rank + 1) + 0.25 * (t % 3)


def grad_of(rank, t, w):
    return A.to(w.dtype) * (w - target(rank, t).to(w.dtype))


W0 = torch.tensor([0.5, 1.0, -1.5, 2.0])


def make(algorithm, comm, dtype=torch.float64, **options):
    p = torch.nn.Parameter(W0.to(dtype).clone())
    base = torch.optim.SGD([p], lr=LR, momentum=MOMENTUM)
    compression = options.pop("compression", None)
    opt = DistributedOptimizer(base, named_parameters=[("w", p)], algorithm=algorithm, communicator=comm,
                               **({"compression": compression} if compression is not None else {}), **options)
    return p, opt


def train(p, opt, rank, steps, start=0):
    """steps of training; returns [(W, w~)] after each step."""
    trace = []
    for t in range(start, start + steps):
        opt.zero_grad()
        p.grad = grad_of(rank, t, p.detach())
        opt.step()
        trace.append((opt.global_weights[0].clone(), p.detach().clone()))
    return trace


def policy_traces(algorithm, size, steps, dtype=torch.float64, **options):
    def body(rank, comm):
        p, opt = make(algorithm, comm, dtype, **options)
        trace = train(p, opt, rank, steps)
        opt.sync_weights()
        return trace, p.detach().clone(), opt
    return run_world(size, body)


class Momentum:
    """torch.optim.SGD(lr, momentum) written out."""

    def __init__(self):
        self.buf = None

    def step(self, w, g):
        self.buf = g.clone() if self.buf is None else self.buf * MOMENTUM + g
        return w + (-LR) * self.buf


def mean(values):
    total = values[0].clone()
    for v in values[1:]:
        total += v
    return total * (1.0 / len(values))


def assert_traces(results, expected):
    """expected[t] = (W, [w~ of rank r]); results[r] = (trace, final params, optimizer)."""
    for r, (trace, _, _) in enumerate(results):
        assert len(trace) == len(expected)
        for t, ((w, local), (w_ref, locals_ref)) in enumerate(zip(trace, expected)):
            assert torch.equal(w, w_ref), f"rank {r} step {t}: W {w} != {w_ref}"
            assert torch.equal(local, locals_ref[r]), f"rank {r} step {t}: w~ {local} != {locals_ref[r]}"


# -- SSGD -------------------------------------------------------------------------------------------

def test_ssgd_matches_reference():
    W, opt_ref, expected = W0.clone(), Momentum(), []
    for t in range(6):
        W = opt_ref.step(W, mean([grad_of(r, t, W) for r in range(3)]))
        expected.append((W.clone(), [W.clone()] * 3))
    results = policy_traces("ssgd", 3, 6)
    assert_traces(results, expected)
    assert all(name.startswith("fasthorovod.bucket.0.w") for kind, name, _ in results[0][2]._comm.world.log[0])


class Net(torch.nn.Module):
    """Three layers whose gradients backward produces last layer first."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
        g = torch.Generator().manual_seed(0)  # the ranks are threads: not the global generator
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def batch(rank, t=0):
    g = torch.Generator().manual_seed(100 * rank + t)
    return torch.randn(5, 4, generator=g)


def reference_grads(size, t=0, passes=1):
    """The average over ranks of each parameter's gradient (summed over `passes` backward passes)."""
    grads = []
    for rank in range(size):
        net = Net()
        for k in range(passes):
            net(batch(rank, t + k)).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    return [mean([g[i] for g in grads]) for i in range(len(grads[0]))]


def ssgd(comm, net, **kwargs):
    return DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters(),
                                communicator=comm, **kwargs)


def posted(comm):
    return [name for kind, name, _ in comm.world.log[comm.rank] if kind == "allreduce"]


def test_ssgd_posts_each_bucket_during_backward_into_flat_buffers():
    def body(rank, comm):
        net = Net()
        opt = ssgd(comm, net)
        net(batch(rank)).pow(2).sum().backward()
        during = posted(comm)  # backward posted the one bucket (25 MiB hold every parameter)
        opt.synchronize()
        flat = opt._buckets[0].flat
        views = all(p.grad.data_ptr() >= flat.data_ptr() and p.grad.data_ptr() < flat.data_ptr() + flat.numel() * 4
                    for p in net.parameters())
        return during, [p.grad.clone() for p in net.parameters()], views
    expected = reference_grads(2)
    for during, grads, views in run_world(2, body):
        assert during == ["fasthorovod.bucket.0.c.bias"]  # the last registered parameter names the bucket
        assert views, "every gradient is a view into the bucket's flat buffer"
        for g, ref in zip(grads, expected):
            assert torch.allclose(g, ref, atol=1e-6)


def test_ssgd_small_buckets_follow_backward_order():
    def body(rank, comm):
        net = Net()
        opt = SSGD(torch.optim.SGD(net.parameters(), lr=0.1), comm, named_parameters=list(net.named_parameters()),
                   bucket_bytes=40 * 4)  # c (18 floats) + b.bias (8) fit, b.weight (64) alone, then a
        net(batch(rank)).pow(2).sum().backward()
        opt.synchronize()
        return posted(comm), [p.grad.clone() for p in net.parameters()]
    expected = reference_grads(2)
    for names, grads in run_world(2, body):
        assert [n.split(".", 3)[3] for n in names] == ["c.bias", "b.weight", "a.bias"]
        for g, ref in zip(grads, expected):
            assert torch.allclose(g, ref, atol=1e-6)


def test_ssgd_first_bucket_starts_with_backwards_first_gradients():
    def body(rank, comm, first_bucket_bytes):
        net = Net()
        opt = SSGD(torch.optim.SGD(net.parameters(), lr=0.1), comm, named_parameters=list(net.named_parameters()),
                   bucket_bytes=40 * 4, first_bucket_bytes=first_bucket_bytes)
        seen = []  # what was posted when backward reached layer b (before b's own gradients)

        def watch_b_output(module, inputs, out):
            out.register_hook(lambda grad: seen.append(posted(comm)))
        net.b.register_forward_hook(watch_b_output)
        net(batch(rank)).pow(2).sum().backward()
        opt.synchronize()
        return seen[0], posted(comm), [p.grad.clone() for p in net.parameters()]
    expected = reference_grads(2)
    # c (18 floats) reaches 10 floats: the first bucket ends there instead of taking b.bias too.
    for before_b, names, grads in run_world(2, lambda r, c: body(r, c, 10 * 4)):
        assert [n.split(".", 3)[3] for n in before_b] == ["c.bias"]
        assert [n.split(".", 3)[3] for n in names] == ["c.bias", "b.bias", "b.weight", "a.bias"]
        for g, ref in zip(grads, expected):
            assert torch.allclose(g, ref, atol=1e-6)
    for before_b, names, _ in run_world(2, lambda r, c: body(r, c, 1 << 20)):  # c + b.bias, as before
        assert before_b == [] and [n.split(".", 3)[3] for n in names] == ["c.bias", "b.weight", "a.bias"]


def test_ssgd_backward_passes_per_step_accumulates_then_refuses_one_more():
    def body(rank, comm):
        net = Net()
        opt = ssgd(comm, net, backward_passes_per_step=2)
        net(batch(rank, 0)).pow(2).sum().backward()
        after_one = posted(comm)
        net(batch(rank, 1)).pow(2).sum().backward()
        after_two = posted(comm)
        with pytest.raises(AssertionError, match="more than backward_passes_per_step"):
            net(batch(rank, 2)).pow(2).sum().backward()
        opt.synchronize()
        return after_one, after_two, [p.grad.clone() for p in net.parameters()]
    expected = reference_grads(2, passes=2)
    for after_one, after_two, grads in run_world(2, body):
        assert after_one == [] and len(after_two) == 1
        for g, ref in zip(grads, expected):
            assert torch.allclose(g, ref, atol=1e-5)


@pytest.mark.parametrize("groups", [2, "lists"])
def test_ssgd_groups_are_horovods(groups):
    def body(rank, comm):
        net = Net()
        chosen = [[net.a.weight, net.c.weight]] if groups == "lists" else groups
        opt = ssgd(comm, net, groups=chosen)
        net(batch(rank)).pow(2).sum().backward()
        opt.synchronize()
        return [[comm_name for comm_name in (b.name,)] + [opt._name_of[p] for p in b.params] for b in opt._buckets]
    results = run_world(2, body)
    assert results[0] == results[1]
    members = [b[1:] for b in results[0]]
    if groups == 2:  # split_list of the six parameters in rank 0's order
        assert members == [["a.weight", "a.bias", "b.weight"], ["b.bias", "c.weight", "c.bias"]]
    else:
        assert members[0] == ["a.weight", "c.weight"] and sorted(map(len, members[1:])) == [1, 1, 1, 1]


def test_ssgd_sum_and_predivide_factor():
    def body(rank, comm):
        net = Net()
        opt = ssgd(comm, net, op="sum")
        net(batch(rank)).pow(2).sum().backward()
        opt.synchronize()
        summed = [p.grad.clone() for p in net.parameters()]
        net2 = Net()
        opt2 = ssgd(comm, net2, gradient_predivide_factor=4.0)
        net2(batch(rank)).pow(2).sum().backward()
        opt2.synchronize()
        return summed, [p.grad.clone() for p in net2.parameters()]
    expected = reference_grads(2)
    for summed, averaged in run_world(2, body):
        for s, a, ref in zip(summed, averaged, expected):
            assert torch.allclose(s, 2 * ref, atol=1e-5) and torch.allclose(a, ref, atol=1e-6)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported"):
        ssgd(FakeComm(World(1), 0), Net(), op="sum", gradient_predivide_factor=2.0)


class Compressor:
    """A compressor the transport does not know (so the buckets are staged): scales by 2 and back."""

    @staticmethod
    def compress(t):
        return t * 2, None

    @staticmethod
    def decompress(t, ctx):
        return t / 2


@pytest.mark.parametrize("sparse_as_dense", [False, True])
@pytest.mark.parametrize("staged", [False, True])
def test_ssgd_sparse_gradients(sparse_as_dense, staged):
    """A sparse gradient travels as a sparse allreduce (or dense with sparse_as_dense), whether its
    bucket is flat or staged (compressed), next to a dense gradient in the same bucket."""
    def body(rank, comm):
        emb = torch.nn.Embedding(6, 3, sparse=True)
        torch.nn.init.constant_(emb.weight, 1.0)
        bias = torch.nn.Parameter(torch.zeros(3))
        opt = DistributedOptimizer(torch.optim.SGD([emb.weight, bias], lr=0.5),
                                   named_parameters=[("emb", emb.weight), ("bias", bias)], communicator=comm,
                                   sparse_as_dense=sparse_as_dense, compression=Compressor() if staged else None)
        (emb(torch.tensor([rank, 2])) + bias).sum().backward()
        opt.step()
        return emb.weight.detach().clone(), bias.detach().clone(), opt._buckets[0].zero_copy
    expected = torch.ones(6, 3)
    expected[0] -= 0.5 * 0.5
    expected[1] -= 0.5 * 0.5
    expected[2] -= 0.5 * 1.0
    for w, b, zero_copy in run_world(2, body):
        assert zero_copy is not staged
        assert torch.equal(w, expected) and torch.equal(b, torch.full((3,), -0.5 * 2))


def test_ssgd_groups_of_several_dtypes_are_staged_and_exact():
    def body(rank, comm):
        a = torch.nn.Parameter(torch.zeros(3, dtype=torch.float32))
        b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        opt = DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0), named_parameters=[("a", a), ("b", b)],
                                   communicator=comm, groups=[[a, b]])
        a.grad, b.grad = torch.full((3,), float(rank)), torch.full((2,), 2.0 * rank, dtype=torch.float64)
        opt.step()
        return a.detach().clone(), b.detach().clone(), opt._buckets[0].zero_copy
    for a, b, zero_copy in run_world(2, body):
        assert not zero_copy  # one flat buffer cannot hold two dtypes
        assert torch.equal(a, torch.full((3,), -0.5)) and torch.equal(b, torch.full((2,), -1.0, dtype=torch.float64))


def test_ssgd_compresses_in_the_worker_when_the_transport_does_not():
    def body(rank, comm):
        net = Net()
        opt = ssgd(comm, net, compression=hvd.Compression.fp16)
        net(batch(rank)).pow(2).sum().backward()
        opt.synchronize()
        return opt._buckets[0].zero_copy, [p.grad.clone() for p in net.parameters()]
    expected = reference_grads(2)
    for zero_copy, grads in run_world(2, body):
        assert not zero_copy
        for g, ref in zip(grads, expected):
            assert g.dtype == torch.float32 and torch.allclose(g, ref, rtol=2e-3, atol=2e-3)


def test_ssgd_zero_grad_between_backward_and_step_is_refused_and_buckets_follow_a_new_transport():
    def body(rank, comm):
        net = Net()
        opt = ssgd(comm, net)
        net(batch(rank)).pow(2).sum().backward()
        with pytest.raises(AssertionError, match="race condition"):
            opt.zero_grad()
        opt.step()
        old = opt._buckets[0].flat
        comm.replace()  # an elastic reset
        net(batch(rank, 1)).pow(2).sum().backward()  # accumulates into the old views, then moves
        opt.step()
        return old is not opt._buckets[0].flat, all(p.grad is opt._buckets[0].views[p] for p in net.parameters())
    for moved, bound in run_world(2, body):
        assert moved and bound


# -- OD-SGD -----------------------------------------------------------------------------------------

def reference_od(size, steps, warmup, local_scale, dc_lambda=None, quantize=None):
    """OD-SGD (and CD-SGD when `quantize` = (threshold, correction_period)) written out."""
    dtype = torch.float32 if quantize else torch.float64
    W = W0.to(dtype).clone()
    local = [W.clone() for _ in range(size)]
    opt = Momentum()
    pending, previous = None, None
    residual = [torch.zeros(4, dtype=dtype) for _ in range(size)]
    phase = 0
    out = []
    for t in range(steps):
        g = [grad_of(r, t, local[r]) for r in range(size)]
        if t < warmup:
            W = opt.step(W, mean(g))
            local = [W.clone() for _ in range(size)]
        else:
            if quantize:
                threshold, k = quantize
                phase += 1
                if phase == k:
                    phase = 0
                    sent = g
                else:
                    sent = []
                    for r in range(size):
                        residual[r] = residual[r] + g[r]
                        q = torch.zeros_like(g[r])
                        q[residual[r] >= threshold] = threshold
                        q[residual[r] <= -threshold] = -threshold
                        residual[r] = residual[r] - q
                        sent.append(q)
                message = mean(sent)
            else:
                message = mean(g)
            if pending is not None:
                previous = W.clone()
                W = opt.step(W, pending)
            pending = message
            lr_local = local_scale * LR
            for r in range(size):
                d = g[r]
                if dc_lambda is not None and previous is not None:
                    d = g[r].mul(g[r]).mul_(W - previous).mul_(dc_lambda).add_(g[r])
                local[r] = W + (-lr_local) * d
        out.append((W.clone(), [x.clone() for x in local]))
    final = opt.step(W, pending) if pending is not None else W
    return out, final


def test_od_sgd_matches_reference_through_the_stage_switch():
    results = policy_traces("od-sgd", 2, 7, warmup_steps=2, local_lr_scale=2.0)
    expected, final = reference_od(2, 7, warmup=2, local_scale=2.0)
    assert_traces(results, expected)
    for _, params, opt in results:
        assert torch.equal(params, final), "sync_weights: parameters = drained global weights"
        assert torch.equal(opt.global_weights[0], final)
    # local weights really differ between ranks in the delayed stage, and W never does
    assert not torch.equal(results[0][0][-1][1], results[1][0][-1][1])


def test_od_sgd_dc_asgd_local_update():
    results = policy_traces("od-sgd", 2, 6, warmup_steps=1, local_lr_scale=2.0, local_update="dc-asgd",
                            dc_lambda=0.25)
    expected, final = reference_od(2, 6, warmup=1, local_scale=2.0, dc_lambda=0.25)
    assert_traces(results, expected)
    assert all(torch.equal(params, final) for _, params, _ in results)


def test_od_sgd_communication_overlaps_the_next_step():
    """The allreduce of step t is waited for in step t+1: after step t, one is still in flight."""
    def body(rank, comm):
        p, opt = make("od-sgd", comm, warmup_steps=1)
        train(p, opt, rank, 1)
        assert len(opt._in_flight) == 0  # warm-up: synchronous
        train(p, opt, rank, 1, start=1)
        assert len(opt._in_flight) == 1
        names = [name for kind, name, _ in comm.world.log[rank] if kind == "allreduce"]
        train(p, opt, rank, 1, start=2)
        assert len(opt._in_flight) == 1
        return names
    names = [name.split(".") for name in run_world(2, body)[0]]
    assert [(n[1], n[3], n[4]) for n in names] == [("od-sgd", "ssgd", "0"), ("od-sgd", "bucket0", "1")]


def _backward_run(rank, comm, steps, unused_at=(), **options):
    """OD-SGD on three parameters whose gradients come from a real backward (so the hooks run);
    returns [(W, w~) per step] and how many bucket averages had started before each step()."""
    shapes = [(4,), (3, 2), (5,)]
    params = [torch.nn.Parameter(torch.arange(n, dtype=torch.float64).reshape(s) * 0.25)
              for s, n in zip(shapes, (4, 6, 5))]
    base = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    opt = DistributedOptimizer(base, named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                               algorithm="od-sgd", communicator=comm, warmup_steps=2, local_lr_scale=2.0,
                               **options)
    trace, started = [], []
    for t in range(steps):
        opt.zero_grad()
        loss = sum(0.5 * ((p - (rank + 1) * 0.5 - 0.25 * (t % 3)) ** 2).sum()
                   for i, p in enumerate(params) if not (i == 0 and t in unused_at))
        loss.backward()
        started.append(sum(1 for kind, name, _ in comm.world.log[rank] if ".bucket" in name))
        opt.step()
        trace.append([w.clone() for w in opt.global_weights] + [p.detach().clone() for p in params])
    opt.sync_weights()
    return trace, started


def test_od_sgd_overlap_backward_starts_buckets_in_backward_and_changes_nothing_else():
    """Buckets sent from backward's hooks give the same W and w~, bit for bit, as sending the whole
    buffer in step(); a parameter without a gradient (step 4) is sent as zeros by step()."""
    overlapped = run_world(2, lambda r, c: _backward_run(r, c, 7, unused_at=(4,), bucket_bytes=90))
    in_step = run_world(2, lambda r, c: _backward_run(r, c, 7, unused_at=(4,), overlap_backward=False))
    for (trace, started), (reference, none_started) in zip(overlapped, in_step):
        for t, (got, want) in enumerate(zip(trace, reference)):
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {t}"
        assert not any(none_started)
        # Buckets {p2, p1} (88 bytes) and {p0}. Bucket averages started between one step()'s
        # start and the next backward's end: none in warm-up (steps 0-1), both buckets in steps
        # 2-3's backward; in step 4 only {p2, p1} (p0 has no gradient), so step 4's step() sends
        # {p0}, counted with step 5's two.
        per_step = [b - a for a, b in zip([0] + started, started)]
        assert per_step == [0, 0, 2, 2, 1, 3, 2], per_step


def test_od_sgd_overlap_backward_rejects_a_second_backward_before_step():
    def body(rank, comm):
        p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
        opt = DistributedOptimizer(torch.optim.SGD([p], lr=LR), named_parameters=[("weight", p)],
                                   algorithm="od-sgd", communicator=comm, warmup_steps=0)
        for _ in range(2):
            (p * p).sum().backward()
            opt.step()
        (p * p).sum().backward()
        with pytest.raises(RuntimeError, match="'weight' was computed twice before step"):
            (p * p).sum().backward()
        opt.step()
        opt.sync_weights()
        return p.detach().clone()
    a, b = run_world(2, body)
    assert torch.equal(a, b)


def test_od_sgd_backward_passes_per_step_turns_overlap_off():
    p = torch.nn.Parameter(torch.ones(3))
    comm = FakeComm(World(1), 0)
    opt = DistributedOptimizer(torch.optim.SGD([p], lr=LR), algorithm="od-sgd", communicator=comm,
                               backward_passes_per_step=2)
    assert opt.options["overlap_backward"] is False
    with pytest.raises(ValueError, match="cannot accumulate backward_passes_per_step=2"):
        DistributedOptimizer(torch.optim.SGD([p], lr=LR), algorithm="od-sgd", communicator=comm,
                             backward_passes_per_step=2, overlap_backward=True)


# -- CD-SGD -----------------------------------------------------------------------------------------

def test_cd_sgd_matches_reference_quantization_delay_and_correction():
    results = policy_traces("cd-sgd", 2, 9, dtype=torch.float32, warmup_steps=2, local_lr_scale=2.0,
                            threshold=0.5, correction_period=3)
    expected, final = reference_od(2, 9, warmup=2, local_scale=2.0, quantize=(0.5, 3))
    assert_traces(results, expected)
    assert all(torch.equal(params, final) for _, params, _ in results)
    log = [kind for kind, _, _ in results[0][2]._comm.world.log[0]]
    # 2 warm-up allreduces, then delayed steps 1,2 quantized, 3 full, 4,5 quantized, 6 full, 7 quantized
    assert log == ["broadcast"] + ["allreduce"] * 2 + ["allgather"] * 2 + ["allreduce"] + ["allgather"] * 2 + \
        ["allreduce"] + ["allgather"]


def test_cd_sgd_needs_float32():
    with pytest.raises(ValueError, match="float32"):
        make("cd-sgd", FakeComm(World(1), 0), dtype=torch.float64)


# -- SSD-SGD ----------------------------------------------------------------------------------------

def reference_ssd(size, steps, warmup, k, local_scale, glu):
    W = W0.to(torch.float64).clone()
    local = [W.clone() for _ in range(size)]
    opt = Momentum()
    acc = [None] * size
    phase, pending, velocity = 0, None, None
    out = []

    def apply(W, message):
        nonlocal velocity
        before = W.clone()
        W = opt.step(W, message[0])
        if glu:
            velocity = (W - before) / message[1]
        return W

    for t in range(steps):
        g = [grad_of(r, t, local[r]) for r in range(size)]
        if t < warmup:
            W = opt.step(W, mean(g))
            local = [W.clone() for _ in range(size)]
        else:
            acc = [g[r].clone() if phase == 0 else acc[r] + g[r] for r in range(size)]
            phase += 1
            if phase == k:
                message = (mean(acc), k)
                if pending is not None:
                    W = apply(W, pending)
                pending, phase = message, 0
                local = [W.clone() for _ in range(size)]
            for r in range(size):
                local[r] = local[r] + (-local_scale * LR) * g[r]
                if velocity is not None:
                    local[r] = local[r] + glu * velocity
        out.append((W.clone(), [x.clone() for x in local]))
    # sync_weights: the partial period is averaged too, then everything applies in order
    if pending is not None:
        W = apply(W, pending)
    if phase:
        W = apply(W, (mean(acc), phase))
    return out, W


@pytest.mark.parametrize("glu", [0.0, 0.5])
def test_ssd_sgd_matches_reference_with_periods_and_glu(glu):
    # warm-up 2, then periods of 2: syncs after steps 3, 5, 7, 9; 10 steps end mid-period.
    results = policy_traces("ssd-sgd", 2, 11, warmup_steps=2, period=2, local_lr_scale=2.0, glu=glu)
    expected, final = reference_ssd(2, 11, warmup=2, k=2, local_scale=2.0, glu=glu)
    assert_traces(results, expected)
    assert all(torch.equal(params, final) for _, params, _ in results)


def test_ssd_sgd_communicates_once_per_period():
    results = policy_traces("ssd-sgd", 2, 2 + 4 * 5, warmup_steps=2, period=4)
    opt = results[0][2]
    # 2 warm-up steps + 5 periods (4 elements each, float64) + nothing partial at sync_weights
    assert opt.communication_stats() == {"allreduce_bytes": (2 + 5) * 4 * 8, "allgather_bytes": 0,
                                         "collectives": 7}


# -- local SGD, SSGD + 2-bit ------------------------------------------------------------------------

def reference_local_sgd(size, steps, warmup, period):
    w = [W0.to(torch.float64).clone() for _ in range(size)]
    opts = [Momentum() for _ in range(size)]
    phase = 0
    out = []
    for t in range(steps):
        g = [grad_of(r, t, w[r]) for r in range(size)]
        if t < warmup:
            avg = mean(g)
            w = [opts[r].step(w[r], avg) for r in range(size)]
        else:
            w = [opts[r].step(w[r], g[r]) for r in range(size)]
            phase += 1
            if phase == period:
                avg = mean(w)
                w = [avg.clone() for _ in range(size)]
                phase = 0
        out.append((None, [x.clone() for x in w]))
    final = mean(w) if phase else w[0]
    return out, final


def test_post_local_sgd_matches_reference():
    results = policy_traces("local-sgd", 2, 9, warmup_steps=2, period=3)
    expected, final = reference_local_sgd(2, 9, warmup=2, period=3)
    for r, (trace, params, _) in enumerate(results):
        for t, ((_, local), (_, ref)) in enumerate(zip(trace, expected)):
            assert torch.equal(local, ref[r]), f"rank {r} step {t}"
        assert torch.equal(params, final)


def test_ssgd_2bit_matches_reference_and_is_selected_by_the_compressor():
    def body(rank, comm):
        p = torch.nn.Parameter(W0.clone())
        opt = DistributedOptimizer(torch.optim.SGD([p], lr=LR, momentum=MOMENTUM), algorithm="ssgd",
                                   compression=TwoBitCompression(0.5), communicator=comm)
        assert opt.algorithm == "ssgd-2bit" and opt.threshold == 0.5
        return train(p, opt, rank, 5)
    traces = run_world(2, body)
    W, opt = W0.clone(), Momentum()
    residual = [torch.zeros(4), torch.zeros(4)]
    for t in range(5):
        sent = []
        for r in range(2):
            residual[r] = residual[r] + grad_of(r, t, W)
            q = torch.zeros(4)
            q[residual[r] >= 0.5] = 0.5
            q[residual[r] <= -0.5] = -0.5
            residual[r] = residual[r] - q
            sent.append(q)
        W = opt.step(W, mean(sent))
        for r in range(2):
            assert torch.equal(traces[r][t][1], W), (r, t)


# -- state_dict -------------------------------------------------------------------------------------

CASES = {
    "od-sgd": dict(warmup_steps=3, local_update="dc-asgd", dc_lambda=0.25),
    "ssd-sgd": dict(warmup_steps=3, period=2, glu=0.5),
    "cd-sgd": dict(warmup_steps=3, threshold=0.5, correction_period=3),
    "local-sgd": dict(warmup_steps=3, period=2),
    "ssgd-2bit": dict(threshold=0.5),
}


@pytest.mark.parametrize("algorithm", sorted(CASES))
@pytest.mark.parametrize("split", [1, 6])  # resume in the warm-up stage / in the delayed stage
def test_state_dict_round_trip_continues_in_the_right_stage(algorithm, split):
    dtype = torch.float32 if algorithm in ("cd-sgd", "ssgd-2bit") else torch.float64
    total = 11

    saved = run_world(2, lambda rank, comm: _train_and_save(algorithm, dtype, rank, comm, split))

    def resumed(rank, comm):
        params, state = saved[rank]
        p, opt = make(algorithm, comm, dtype, **CASES[algorithm])
        with torch.no_grad():
            p.copy_(params)
        opt.load_state_dict(state)
        assert opt.steps == split
        return _finish(p, opt, rank, split, total)

    _assert_same_runs(run_world(2, _uninterrupted(algorithm, dtype, split, total)), run_world(2, resumed), split)


def _uninterrupted(algorithm, dtype, split, total):
    """A rank's run of `total` steps with a sync_weights() after `split` (the reference)."""
    def body(rank, comm):
        p, opt = make(algorithm, comm, dtype, **CASES[algorithm])
        train(p, opt, rank, split)
        opt.sync_weights()
        return _finish(p, opt, rank, split, total)
    return body


def _finish(p, opt, rank, split, total):
    trace = train(p, opt, rank, total - split, start=split)
    opt.sync_weights()
    return trace, p.detach().clone()


def _assert_same_runs(a, b, split):
    for r in range(2):
        for t, ((wa, la), (wb, lb)) in enumerate(zip(a[r][0], b[r][0])):
            assert torch.equal(wa, wb) and torch.equal(la, lb), f"rank {r} step {split + t}"
        assert torch.equal(a[r][1], b[r][1])


def _train_and_save(algorithm, dtype, rank, comm, split):
    p, opt = make(algorithm, comm, dtype, **CASES[algorithm])
    train(p, opt, rank, split)
    opt.sync_weights()
    state = copy.deepcopy(opt.state_dict())
    assert state["fasthorovod_scheduler"]["step"] == split
    assert state["fasthorovod_scheduler"]["algorithm"] == algorithm
    return p.detach().clone(), state


@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_an_elastic_restore_after_a_failure_continues_exactly_as_if_nothing_happened(algorithm):
    """commit (sync_weights + snapshot), two steps of work that a failure loses (in flight too),
    restore, a new transport: training continues bit for bit as a run without the failure."""
    dtype = torch.float32 if algorithm in ("cd-sgd", "ssgd-2bit") else torch.float64
    split, total = 6, 11

    def interrupted(rank, comm):
        p, opt = make(algorithm, comm, dtype, **CASES[algorithm])
        train(p, opt, rank, split)
        opt.sync_weights()
        snapshot = opt.snapshot()
        train(p, opt, rank, 2, start=split)  # lost: the failure comes before the next commit
        opt.restore_snapshot(snapshot)
        comm.replace()
        return _finish(p, opt, rank, split, total)

    _assert_same_runs(run_world(2, _uninterrupted(algorithm, dtype, split, total)), run_world(2, interrupted), split)


def test_a_new_transport_drops_what_was_in_flight_and_moves_the_buffers_with_their_contents():
    def body(rank, comm):
        p, opt = make("ssd-sgd", comm, warmup_steps=2, period=3)
        train(p, opt, rank, 4)  # delayed stage, in the middle of a period: the buffer holds a partial sum
        accumulated = [b.clone() for b in opt._buffers[opt._slot] if b is not None]
        old = [b for slot in opt._buffers for b in slot]
        comm.replace()
        opt.reset_communication()
        new = [b for slot in opt._buffers for b in slot]
        assert all(n is not o for n, o in zip(new, old) if o is not None)
        assert [torch.equal(a, b) for a, b in zip(accumulated, opt._buffers[opt._slot])] == [True]
        assert not opt._in_flight
        train(p, opt, rank, 5, start=4)  # counters are broadcast again; the periods go on
        opt.sync_weights()
        return opt.steps, p.detach().clone()
    (steps0, p0), (steps1, p1) = run_world(2, body)
    assert steps0 == steps1 == 9 and torch.equal(p0, p1)


def test_counters_come_from_rank_0_when_only_rank_0_loaded_a_checkpoint():
    def body(rank, comm):
        p, opt = make("od-sgd", comm, warmup_steps=3)
        if rank == 0:
            state = opt.state_dict()
            state["fasthorovod_scheduler"]["step"] = 5
            opt.load_state_dict(state)
        train(p, opt, rank, 1, start=5)
        return opt.steps, len(opt._in_flight)
    assert run_world(2, body) == [(6, 1), (6, 1)]  # both past warm-up: one allreduce in flight


def test_loading_another_algorithms_state_raises():
    _, od = make("od-sgd", FakeComm(World(1), 0))
    _, ssd = make("ssd-sgd", FakeComm(World(1), 0))
    with pytest.raises(ValueError, match="od-sgd"):
        ssd.load_state_dict(od.state_dict())


# -- integration with torch: LR schedulers, closures, zero_grad, the wrapped optimizer --------------

def test_lr_scheduler_closure_zero_grad_and_the_wrapped_optimizer():
    comm = FakeComm(World(1), 0)
    model = torch.nn.Linear(3, 2)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = DistributedOptimizer(base, named_parameters=model.named_parameters(), algorithm="od-sgd",
                               warmup_steps=0, communicator=comm)
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert all(w is not p for w, p in zip(opt.global_weights, model.parameters()))
    assert opt.param_groups[0]["params"][0] is opt.global_weights[0]  # the user's optimizer updates W
    x = torch.ones(4, 3)

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    assert opt.step(closure) is not None
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05
    assert opt._local_lr(0) == 0.05 * 4.0
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.sync_weights()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), opt.global_weights))


def test_no_grad_counts_as_zero_gradient():
    comm = FakeComm(World(1), 0)
    p, opt = make("od-sgd", comm, warmup_steps=1)
    opt.step()  # p.grad is None: a zero gradient, no error
    assert torch.equal(p.detach(), W0.double())


# -- arguments --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(algorithm="bogus"), "unknown algorithm 'bogus'"),
    (dict(algorithm="od-sgd", period=3), "unknown option 'period' for algorithm 'od-sgd'"),
    (dict(algorithm="ssd-sgd", perod=3), "unknown option 'perod'"),
    (dict(algorithm="ssgd", warmup_steps=3), "warmup_steps given with algorithm='ssgd'"),
    (dict(algorithm="ssd-sgd", period=0), "period must be an integer >= 1"),
    (dict(algorithm="od-sgd", warmup_steps=-1), "warmup_steps must be an integer >= 0"),
    (dict(algorithm="od-sgd", local_update="adam"), "local_update must be one of"),
    (dict(algorithm="cd-sgd", threshold=0), "threshold must be a number > 0"),
    (dict(algorithm="od-sgd", op=hvd.Sum), "op must be Average"),
    (dict(algorithm="local-sgd", compression=hvd.Compression.fp16), "not supported with algorithm 'local-sgd'"),
    (dict(algorithm="cd-sgd", compression=hvd.Compression.fp16), "not supported with algorithm 'cd-sgd'"),
    (dict(algorithm="od-sgd", compression=TwoBitCompression()), "TwoBitCompression works with"),
    (dict(algorithm="od-sgd", groups=2), "groups"),
    (dict(algorithm="od-sgd", gradient_predivide_factor=2.0), "gradient_predivide_factor"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, match):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)


def test_every_option_has_a_default_and_documentation():
    assert set(ALGORITHMS) == {"ssgd", "od-sgd", "ssd-sgd", "cd-sgd", "local-sgd", "ssgd-2bit"}
    for cls in ALGORITHMS.values():
        for name, option in cls.OPTIONS.items():
            assert option.doc and option.check(name, option.default) == option.default


def test_fp16_compression_of_delayed_allreduces():
    results = policy_traces("od-sgd", 2, 4, warmup_steps=1, compression=hvd.Compression.fp16)
    for _, params, opt in results:
        assert opt.communication_stats()["allreduce_bytes"] == 4 * 4 * 2  # 4 steps of 4 float16
        assert torch.equal(params, results[0][1])


@pytest.mark.parametrize("algorithm", ["od-sgd", "ssd-sgd", "local-sgd"])
def test_parameters_of_several_dtypes_travel_in_one_buffer_per_dtype(algorithm):
    def body(rank, comm):
        a = torch.nn.Parameter(torch.zeros(3, dtype=torch.float32))
        b = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))
        options = {"warmup_steps": 1, **({} if algorithm == "od-sgd" else {"period": 2})}
        opt = DistributedOptimizer(torch.optim.SGD([a, b], lr=0.5), algorithm=algorithm, communicator=comm,
                                   **options)
        for t in range(5):
            a.grad = torch.full((3,), float(rank + t), dtype=torch.float32)
            b.grad = torch.full((2, 2), float(rank - t), dtype=torch.float64)
            opt.step()
        opt.sync_weights()
        kinds = {(name.split(".")[-1], n) for kind, name, n in comm.world.log[rank] if kind == "allreduce"}
        return a.detach().clone(), b.detach().clone(), kinds
    (a0, b0, kinds), (a1, b1, _) = run_world(2, body)
    assert torch.equal(a0, a1) and torch.equal(b0, b1) and a0.dtype == torch.float32
    assert kinds == {("0", 3), ("1", 4)}  # layout 0: the float32 parameter, layout 1: the float64 one
    assert not torch.equal(a0, torch.zeros(3))
