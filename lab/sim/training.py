"""Step time of data-parallel training from a DLC trace (or a published profile).

A *profile* is one iteration as one rank saw it: forward seconds, backward seconds, the update's
seconds, and the gradient buckets in the order backward produced them, each with its bytes and
the time after backward's start at which it was ready (``grad_ready``/``request`` events,
docs/trace.md). Policies (assumptions stated in lab/scale.md):

* **SSGD** (Horovod and FastHorovod): each bucket's allreduce starts when it is ready and the
  previous one has finished (one data plane, FIFO, as the negotiation orders them); the update
  waits for the last one. step = forward + max(backward, last allreduce's end) + update.
* **OD-SGD**: step t's allreduces run while step t+1 computes; step t+1's update waits for them.
  Simulated over many steps, the steady period is reported (≈ max(compute, communication)).
* **SSD-SGD** (period k): one allreduce of the period's summed gradient every k steps, posted at
  the end of the period, waited for at the end of the next: per step max(k·compute, comm)/k.
* **CD-SGD** (correction every k steps): every step a 2-bit payload (1/16 of fp32, 16 values per
  32-bit word) is allgathered (each rank decodes n payloads: n·M/16·... CPU/GPU time `decode_rate`),
  hidden one step like OD-SGD; every k-th step a full-precision allreduce instead.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

Bucket = Tuple[float, float]  # (bytes, ready seconds after backward's start)


@dataclasses.dataclass
class Profile:
    forward_s: float
    backward_s: float
    update_s: float
    buckets: List[Bucket]
    batch_per_rank: int = 1
    source: str = ""

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.update_s

    @property
    def gradient_bytes(self) -> float:
        return sum(b for b, _ in self.buckets)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def scaled(self, compute_factor: float) -> "Profile":
        """The same gradients on a device `compute_factor` times slower (<1: faster)."""
        return Profile(self.forward_s * compute_factor, self.backward_s * compute_factor,
                       self.update_s * compute_factor, [(b, t * compute_factor) for b, t in self.buckets],
                       self.batch_per_rank, self.source)


def fifo(buckets: Sequence[Bucket], start: float, duration: Callable[[float], float], free_at: float = 0.0) -> float:
    """Allreduces of `buckets` on one FIFO data plane, bucket i ready at start + ready_i: returns
    when the last one ends."""
    t = free_at
    for nbytes, ready in sorted(buckets, key=lambda b: b[1]):
        t = max(t, start + ready) + duration(nbytes)
    return t


def ssgd_step(profile: Profile, duration: Callable[[float], float]) -> Dict[str, float]:
    start = profile.forward_s
    comm_end = fifo(profile.buckets, start, duration)
    bwd_end = start + profile.backward_s
    step = max(bwd_end, comm_end) + profile.update_s
    comm = sum(duration(b) for b, _ in profile.buckets)
    return {"step_s": step, "comm_s": comm, "exposed_s": step - profile.compute_s}


def delayed_period(profile: Profile, comm_of_step: Callable[[int], List[Bucket]],
                   duration: Callable[[float], float], delay_steps: int = 1, steps: int = 40) -> Dict[str, float]:
    """Simulates `steps` steps where step t's communication (``comm_of_step(t)``: buckets with
    ready times relative to backward's start) must be done before step t+delay's update. Returns
    the mean step over the second half (the steady state)."""
    t = 0.0
    free = 0.0
    ends: Dict[int, float] = {}
    starts = []
    comm_total = 0.0
    for step in range(steps):
        starts.append(t)
        bwd_start = t + profile.forward_s
        bwd_end = bwd_start + profile.backward_s
        buckets = comm_of_step(step)
        if buckets:
            free = fifo(buckets, bwd_start, duration, free)
            comm_total += sum(duration(b) for b, _ in buckets)
        ends[step] = free
        need = ends.get(step - delay_steps, 0.0)
        t = max(bwd_end, need) + profile.update_s
    starts.append(t)
    half = steps // 2
    period = (starts[-1] - starts[half]) / (steps - half)
    return {"step_s": period, "comm_s": comm_total / steps, "exposed_s": period - profile.compute_s}


def policies(profile: Profile, allreduce: Callable[[float], float], allgather: Callable[[float], float],
             n: int, period: int = 5, correction: int = 5, decode_rate: Optional[float] = None
             ) -> Dict[str, Dict[str, float]]:
    """Step time of every algorithm on FastHorovod's data plane (`allreduce(bytes)` seconds,
    `allgather(bytes per rank)` seconds)."""
    out = {"ssgd": ssgd_step(profile, allreduce)}
    out["od-sgd"] = delayed_period(profile, lambda t: profile.buckets, allreduce, 1)
    total = profile.gradient_bytes
    end_of_backward = profile.backward_s
    out["ssd-sgd"] = delayed_period(profile, lambda t: [(total, end_of_backward)] if t % period == period - 1 else [],
                                    allreduce, period)
    decode = (lambda b: n * b * 16 / decode_rate) if decode_rate else (lambda b: 0.0)

    def cd_duration(tagged: float) -> float:
        # negative sizes mark a 2-bit allgather payload (encoded as -bytes of fp32 it stands for)
        if tagged < 0:
            payload = -tagged / 16.0
            return allgather(payload) + decode(payload)
        return allreduce(tagged)

    out["cd-sgd"] = delayed_period(
        profile, lambda t: ([(b, r) for b, r in profile.buckets] if t % correction == correction - 1
                            else [(-b, r) for b, r in profile.buckets]), cd_duration, 1)
    return out


def images_per_s(step_s: float, profile: Profile, n: int) -> float:
    return profile.batch_per_rank * n / step_s


# -- from a trace -------------------------------------------------------------------------------


def profile_from_trace(path: str, skip: int = 1, batch_per_rank: int = 1, rank: Optional[int] = None) -> Profile:
    """The median synchronous iteration of a FASTHOROVOD_TRACE_DIR trace: forward, backward and
    update spans, and every proxied or Horovod-routed gradient request (bytes, time after
    backward's start). Steps before `skip` (warm-up) are left out.

    A collective starts only once every rank has asked for it, and the update waits for the last
    one, so each step is the slowest rank's: per step, with every rank's times taken from its own
    forward's start (the ranks leave the previous step's last allreduce together; no clock offsets
    needed), a bucket is ready at the latest of the ranks' requests and backward ends at the latest
    rank's end; forward and update are the ranks' medians. Then medians over the steps. (Before
    2026-12-02 evening: medians over steps and ranks, the typical rank, which on a loaded machine
    — backward 1.3–4.6 s on the four ranks of one AlexNet step — asked for its buckets seconds
    before the last rank did.) `rank`: that rank's iterations alone."""
    from fasthorovod.trace import format as fmt

    trace = fmt.load_trace_dir(path)
    if not trace.workers:
        raise ValueError(f"{path}: no worker trace (rank*.worker.jsonl)")
    # step -> rank -> (forward s, backward end s, update s, [(bytes, request s)]), from the rank's forward start
    steps: Dict[int, Dict[int, Tuple[float, float, float, List[Bucket]]]] = {}
    for r, parts in sorted(trace.workers.items()):
        if rank is not None and r != rank:
            continue
        events = [e for part in parts for e in part.events]
        by_step: Dict[int, List[dict]] = {}
        for e in events:
            by_step.setdefault(int(e.get("step", 0)), []).append(e)
        for step, evs in sorted(by_step.items()):
            if step < skip:
                continue
            f = [e for e in evs if e["k"] == "forward"]
            b = [e for e in evs if e["k"] == "backward"]
            u = [e for e in evs if e["k"] == "update"]
            reqs = [e for e in evs if e["k"] == "request" and "bytes" in e]
            if not f or not b or not reqs:
                continue
            f0 = f[0]["t"]
            steps.setdefault(step, {})[r] = (
                f[0].get("d", 0) / 1e9, (b[0]["t"] + b[0].get("d", 0) - f0) / 1e9,
                sum(e.get("d", 0) for e in u) / 1e9, [(float(e["bytes"]), (e["t"] - f0) / 1e9) for e in reqs])
    if not steps:
        raise ValueError(f"{path}: no complete iteration after skipping {skip} (need forward, backward and "
                         "request events; trace a DistributedOptimizer run)")
    # buckets: the most common layout (over ranks and steps); a step counts if every rank had it
    layout = statistics.mode(tuple(b for b, _ in v[3]) for ranks in steps.values() for v in ranks.values())
    fwd, bwd, upd = [], [], []
    per_step_buckets: List[List[Bucket]] = []
    for ranks in steps.values():
        if any(tuple(b for b, _ in v[3]) != layout for v in ranks.values()):
            continue
        forward = statistics.median(v[0] for v in ranks.values())
        fwd.append(forward)
        bwd.append(max(v[1] for v in ranks.values()) - forward)
        upd.append(statistics.median(v[2] for v in ranks.values()))
        per_step_buckets.append([(layout[i], max(0.0, max(v[3][i][1] for v in ranks.values()) - forward))
                                 for i in range(len(layout))])
    if not per_step_buckets:
        raise ValueError(f"{path}: no step in which every rank sent the same buckets")
    buckets = [(layout[i], statistics.median(s[i][1] for s in per_step_buckets)) for i in range(len(layout))]
    return Profile(statistics.median(fwd), statistics.median(bwd), statistics.median(upd), buckets,
                   batch_per_rank, source=path)


# -- published workloads (lab/scale.md cites each number) -----------------------------------------

MiB = 1 << 20


def _layers(groups: Sequence[Tuple[float, float, float]]) -> List[Bucket]:
    """[(parameters, first ready fraction of backward, last)] -> per-layer (bytes, fraction)."""
    out = []
    for params, a, b in groups:
        pieces = max(1, int(params * 4 // (4 * MiB)) or 1)
        for i in range(pieces):
            frac = a + (b - a) * (i + 1) / pieces
            out.append((params * 4 / pieces, frac))
    return out


# parameters per layer group in backward order, with where in backward its gradients appear
WORKLOADS = {
    # AlexNet (61.1 M parameters): the three FC layers (58.6 M) come first in backward and are cheap
    "alexnet": {"params": 61.1e6, "batch": 16, "compute_s": 0.02318,
                "groups": [(4.1e6, 0.0, 0.01), (16.8e6, 0.01, 0.02), (37.8e6, 0.02, 0.04), (2.5e6, 0.04, 1.0)]},
    # VGG16 (138.4 M): FC layers 123.6 M first
    "vgg16": {"params": 138.4e6, "batch": 16, "compute_s": 0.23255,
              "groups": [(4.1e6, 0.0, 0.005), (16.8e6, 0.005, 0.01), (102.8e6, 0.01, 0.03), (14.7e6, 0.03, 1.0)]},
    # ResNet-50 (25.6 M): fc, then layer4 (15.0 M), layer3 (7.1 M), layer2 (1.2 M), layer1 + stem
    "resnet50": {"params": 25.6e6, "batch": 16, "compute_s": 0.15390,
                 "groups": [(2.05e6, 0.0, 0.01), (15.0e6, 0.01, 0.25), (7.1e6, 0.25, 0.6), (1.2e6, 0.6, 0.85),
                            (0.25e6, 0.85, 1.0)]},
    # BERT-large (335 M): heads, 24 equal encoder layers, embeddings (31.8 M) last
    "bert-large": {"params": 335e6, "batch": 64, "compute_s": 0.418,
                   "groups": [(1.1e6, 0.0, 0.01), (302e6, 0.01, 0.97), (31.8e6, 0.97, 1.0)]},
}


def bucketize(layers: Sequence[Bucket], bucket_bytes: float) -> List[Bucket]:
    """Layers (bytes, ready) in backward order into buckets of at most `bucket_bytes` (a layer
    larger than a bucket is a bucket of its own), each ready when its last layer is."""
    out: List[Bucket] = []
    cur, ready = 0.0, 0.0
    for nbytes, t in layers:
        if cur and cur + nbytes > bucket_bytes:
            out.append((cur, ready))
            cur = 0.0
        cur += nbytes
        ready = t
    if cur:
        out.append((cur, ready))
    return out


def published_profile(name: str, bucket_bytes: float = 25 * MiB, compute_factor: float = 1.0) -> Profile:
    """A workload's profile from its published per-GPU compute time (forward + backward; a third
    forward, two thirds backward, update negligible) and its layers' sizes."""
    w = WORKLOADS[name]
    compute = w["compute_s"] * compute_factor
    fwd, bwd = compute / 3.0, compute * 2.0 / 3.0
    layers = [(b, f * bwd) for b, f in _layers(w["groups"])]
    return Profile(fwd, bwd, 0.0, bucketize(layers, bucket_bytes), w["batch"], source=f"published:{name}")
