"""Training throughput on synthetic data: AlexNet or VGG16, data-parallel, per backend side by side.

The driver runs the list of backends ``--rounds`` times, interleaved (A B C A B C ...: every round
runs each backend once, as a separate job of N ranks; launchers as in _common.py), so that drift in
the machine hits every backend alike. Each rank:

  1. seeds Python, NumPy and torch identically, builds the model (models.py), then reseeds per rank
     and draws one fixed synthetic batch (random images, random labels) that every step reuses;
  2. wraps ``SGD(lr=0.01, momentum=0.9)`` in ``hvd.DistributedOptimizer(opt,
     named_parameters=...)`` (plus ``algorithm=`` for FastHorovod when it is not "ssgd") and
     broadcasts parameters and optimizer state from rank 0;
  3. runs ``--warmup-steps`` untimed and ``--steps`` timed *training steps* -- forward, backward
     (gradients are allreduced as they become ready) and optimizer step (which waits for the
     allreduces) -- and, interleaved with them in the same job, *compute-only steps* (one next to
     each warm-up step and next to ``--compute-steps`` of the timed steps, spread evenly; before
     the training step in even pairs, after it in odd ones): forward, backward with
     ``torch.autograd.grad`` (so no gradient hook fires and nothing is communicated) and SGD's
     arithmetic in place on copies (the weights do not change), each phase timed, then the job's
     barrier (untimed: a compute-only step ends on each rank at its own time, a training step on
     every rank at once, so without it the next step would start with the ranks apart). Both kinds
     of step thus see the same machine, the same background load and the same drift;
     A compute-only step shares the CPUs with whatever is still running when it starts: for
     the delayed algorithms (SSD-SGD, OD-SGD), the communication their previous step left in flight,
     as that step's successor does; ``--peer-steps`` gives the backends that are not
     FastHorovod fewer timed steps (Horovod's network-bound steps barely vary: make bench);
  4. checks that all ranks end with bitwise-identical weights (SHA-256 of every parameter,
     allgathered) and fails the job if they do not.

Per job (the slowest rank's medians; ranks are in lockstep, so they barely differ): images/s = batch
* N / median step time; compute = median compute-only step; per pair of a training step and its
compute-only step (the slowest rank's time of each), step - compute. Per backend over the rounds:
the median of the jobs' figures and their spread (min-max over the rounds); speed-up over the first
backend, with the spread of the round-by-round ratios. *Exposed communication* (the communication
time that backward and the optimizer did not hide) is the median of every pair's step - compute,
reported only when it is measurable: when at least three quarters of the pairs show the training
step longer than its compute-only step (the lower quartile of the differences is above zero).
Otherwise it is "not measurable (within noise)" -- the step is as fast as computing alone, to
within this machine's noise -- and is never printed as a negative time. The JSON also holds every
timed step's and compute-only step's time (the slowest rank's) and, for FastHorovod, the data plane
it ran with (lanes, sockets per lane and where that number came from). Rank 0 prints each step to
stderr (``train step 12/50 1.23 s/step``), the driver a line per finished job (``round 2/3, backend
fasthorovod: ...``) with the elapsed time.

With ``--ceiling`` every round starts with the raw-TCP ring ceiling (iperf3 between the emulated
hosts, _common.ring_worker), and each job's step is set against the *overlap bound*: forward +
max(backward, the gradients' ring allreduce at that round's ceiling) + update, the phases from the
job's compute-only steps (``overlap_bound``). A step at 1.00x the bound hides all communication
behind backward at the ceiling's rate. With ``--loaded-compute`` each compute-only step is followed
by a *loaded* one, the same computation while the backend allreduces zeros the size of the
gradients from the end of forward (the traffic a training step's rings make during backward), and
the step is also set against the *loaded bound*, the overlap bound with the loaded steps' backward:
on a machine whose network work shares the compute's cores (the emulated cloud on one host),
backward computes slower while rings run than alone, and no overlap can beat that. The compute-only
steps also time backward's first parameter gradient, and the step is set against the
*first-gradient bound*, max(forward + backward, first gradient + ring) + update: the ring cannot
start before every rank has a gradient to send, so a model whose first gradients are expensive
(a large output layer, first in backward) cannot hide its ring behind all of backward.

    python benchmarks/train.py --model alexnet --np 4 --backends horovod,fasthorovod:4 \\
        --out results/train.json --plot results/train.png
"""
import time

SCRIPT_STARTED = time.time()  # wall clock when this interpreter reached this file (start-up timeline)

import argparse  # noqa: E402  (after the clock above: importing torch is part of a job's start-up)
import hashlib  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

import _common as common  # noqa: E402
from models import LANGUAGE_MODELS, MAX_SEQ_LEN, MIN_IMAGE_SIZE, MODELS, build_model, default_classes, synthetic_batch  # noqa: E402

IMPORTS_DONE = time.time()

KINDS = ("horovod-gloo", "horovod-mpi", "fasthorovod", "torch-gloo", "torch-fasthorovod")
FASTHOROVOD_KINDS = ("fasthorovod", "torch-fasthorovod")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Synthetic-data training throughput of AlexNet/VGG16 for several backends side "
                    "by side. Prints a table (images/s, s/step, compute-only s/step, exposed "
                    "communication s/step, speed-up over the first backend), writes JSON and a "
                    "PNG.")
    parser.add_argument("--backends", default="horovod,fasthorovod",
                        help="comma-separated: horovod-gloo (or horovod), horovod-mpi, "
                             "fasthorovod[:PROXIES[xSOCKETS]][:ALGORITHM][+trace] (plain fasthorovod "
                             "and fasthorovod:ALGORITHM run FastHorovod's defaults: no FASTHOROVOD_* "
                             "set), and DistributedDataParallel on torch-gloo[:DEVICES] (Gloo, the "
                             "interface named DEVICES times in GLOO_SOCKET_IFNAME) or "
                             "torch-fasthorovod (FastHorovod's torch.distributed backend); the first "
                             "is the speed-up baseline; '+trace' records the backend's DLC trace (see "
                             "--trace-root) (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole list of backends this many times, interleaved (A B C A B "
                             "C ...), and report per backend the median over the rounds with the "
                             "spread (min-max) (default: %(default)s)")
    add_workload_arguments(parser)
    parser.add_argument("--ceiling", action="store_true",
                        help="start every round with the raw-TCP ring ceiling (iperf3 between the "
                             "emulated hosts of the ranks; needs a --launcher-prefix with "
                             "--emulate-cloud, skipped elsewhere) and report each backend's step "
                             "against the overlap bound: forward + max(backward, the gradients' "
                             "ring at that ceiling) + update, from the compute-only steps' phases, "
                             "and against the first-gradient bound: max(forward + backward, first "
                             "gradient + ring) + update")
    common.add_ring_arguments(parser)
    parser.add_argument("--peer-steps", type=int,
                        help="timed training steps for the backends that are not FastHorovod "
                             "(Horovod's steps are network-bound and vary by about 1%% from step to "
                             "step, so fewer of them measure it as well and save minutes); their "
                             "compute-only steps are at most this many (default: --steps)")
    common.add_driver_arguments(parser)
    common.add_worker_arguments(parser)
    args = parser.parse_args(argv)
    check_workload_arguments(parser, args)
    if args.rounds < 1:
        parser.error("need --rounds >= 1")
    if args.peer_steps is not None and args.peer_steps < 1:
        parser.error("need --peer-steps >= 1")
    if (args.ring_flows is not None and args.ring_flows < 1) or args.ring_seconds <= 0:
        parser.error("need --ring-flows >= 1 and --ring-seconds > 0")
    return args


def job_steps(backend, args):
    """(timed training steps, timed compute-only steps) of this backend's jobs."""
    peer_steps = getattr(args, "peer_steps", None)  # repeat_train.py's drivers have none
    steps = args.steps if backend.kind in FASTHOROVOD_KINDS or peer_steps is None else peer_steps
    return steps, min(args.compute_steps, steps)


def add_workload_arguments(parser):
    """The options that define one training job (model, data, steps, algorithm, seed); the drivers
    that run train.py's workers (this one, repeat_train.py) share them."""
    parser.add_argument("--model", choices=sorted(MODELS), default="alexnet",
                        help="model to train: two CNNs of few large tensors, or a transformer "
                             "language model of 78 tensors (models.py) (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=224,
                        help=f"image height and width in px, at least {MIN_IMAGE_SIZE} "
                             "(default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128,
                        help=f"tokens per sequence (transformer), at most {MAX_SEQ_LEN} "
                             "(default: %(default)s)")
    parser.add_argument("--batch-size", type=int,
                        help="images (sequences for the transformer) per rank per step (default: 16 "
                             "images, 4 sequences)")
    parser.add_argument("--num-classes", type=int,
                        help="classifier outputs, the vocabulary for the transformer (default: 1000, "
                             "32000)")
    parser.add_argument("--steps", type=int, default=10,
                        help="timed training steps (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="untimed training steps before the timed ones (each with an untimed "
                             "compute-only step when --compute-steps > 0) (default: %(default)s)")
    parser.add_argument("--compute-steps", type=int, default=3,
                        help="timed compute-only steps (no communication), at most --steps, each "
                             "next to one of the timed training steps in the same job; 0: none "
                             "(then compute s and exposed comm s are not reported) "
                             "(default: %(default)s)")
    parser.add_argument("--loaded-compute", action="store_true",
                        help="follow each timed compute-only step of the Horovod and FastHorovod "
                             "backends with a loaded one: the same computation while the backend "
                             "allreduces a buffer of zeros the size of the gradients, posted when "
                             "forward ends (the load the training step's rings put on the machine "
                             "during backward); with --ceiling the step is also set against the "
                             "loaded bound, forward + max(loaded backward, ring) + update")
    parser.add_argument("--algorithm", default="ssgd",
                        help="DistributedOptimizer algorithm for fasthorovod backends that do not "
                             "name one; passed as algorithm= only when not 'ssgd'. A backend whose "
                             "DistributedOptimizer rejects it is reported as skipped. Horovod "
                             "backends always run synchronous SGD (default: %(default)s)")
    parser.add_argument("--algorithm-warmup", type=int, default=0,
                        help="warmup_steps= of the delayed algorithms (their synchronous stage); "
                             "the benchmark's own --warmup-steps are untimed steps before timing, "
                             "so a short run measures the delayed stage (default: %(default)s)")
    parser.add_argument("--proxy-threshold", type=common.parse_size,
                        help="FASTHOROVOD_PROXY_THRESHOLD_BYTES for fasthorovod backends "
                             "(default: FastHorovod's own)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights; rank r draws its data with seed + 1 + r "
                             "(default: %(default)s)")


def check_workload_arguments(parser, args):
    """Reject impossible values (exits through parser.error); default --threads from --np."""
    if args.batch_size is None:
        args.batch_size = 4 if args.model in LANGUAGE_MODELS else 16
    if args.num_classes is None:
        args.num_classes = default_classes(args.model)
    if args.num_classes < 2 or not 1 <= args.seq_len <= MAX_SEQ_LEN:
        parser.error(f"need --num-classes >= 2 and --seq-len from 1 to {MAX_SEQ_LEN} (the transformer's positions)")
    if args.image_size < MIN_IMAGE_SIZE:
        parser.error(f"--image-size must be at least {MIN_IMAGE_SIZE}")
    if min(args.steps, args.batch_size, args.np) < 1 or min(args.warmup_steps, args.compute_steps) < 0:
        parser.error("need --steps, --batch-size, --np >= 1 and --warmup-steps, --compute-steps >= 0")
    if args.compute_steps > args.steps:
        parser.error("--compute-steps pairs each compute-only step with a timed training step: "
                     "at most --steps")
    if args.threads is None:
        args.threads = common.default_threads(args.np)


# --------------------------------------------------------------------------------------------
# Worker: one rank.


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def step_schedule(warmup, steps, compute_steps, loaded=False):
    """The order of one job's steps: [(kind, timed, pair)], kind "train", "compute" or "loaded".
    Every warm-up training step has an untimed compute-only step next to it (when
    ``compute_steps``), and ``compute_steps`` of the timed training steps (spread evenly over them)
    a timed one; ``pair`` numbers the timed pairs. The compute-only step comes first in even pairs
    and second in odd ones (ABBA), so that a steady drift does not favour either kind. With
    `loaded`, every compute-only step is followed by a loaded one (``--loaded-compute``)."""
    paired = {j * steps // compute_steps for j in range(compute_steps)} if compute_steps else set()
    compute = ("compute", "loaded") if loaded else ("compute",)
    schedule, pair = [], 0
    for index in range(warmup + steps):
        timed = index >= warmup
        if (timed and index - warmup in paired) or (not timed and compute_steps):
            kinds = (*compute, "train") if pair % 2 == 0 else ("train", *compute)
            schedule += [(kind, timed, pair if timed else None) for kind in kinds]
            pair += timed
        else:
            schedule.append(("train", timed, None))
    return schedule


def run_schedule(schedule, train_step, compute_step, verbose, loaded_step=None, barrier=None):
    """Run the steps of ``schedule`` (``step_schedule``); returns the timed training steps'
    durations, the timed compute-only steps' durations (in pair order), per pair the index of its
    training step among the timed ones, the timed compute-only steps' phases (what
    ``compute_step`` returned: {"forward", "backward", "update", "first_gradient"} seconds, or None), and the timed
    loaded steps' phases (what ``loaded_step`` returned).

    ``barrier`` (the job's, untimed) runs after every compute-only and loaded step. A training step
    ends with its gradients' allreduce, so the next step starts on every rank at once; a
    compute-only step communicates nothing and ends on each rank at its own time, and without the
    barrier the step after it would start with the ranks apart and its time (rank 0's) would move
    by that offset, longer or shorter, as would the next compute-only step's phases."""
    train, compute, paired, phases, loaded = [], [], [], [], []
    steps = {"train": train_step, "compute": compute_step, "loaded": loaded_step}
    labels = {"train": "train", "compute": "compute-only", "loaded": "loaded compute-only"}
    totals = {kind: sum(1 for k, _, _ in schedule if k == kind) for kind in steps}
    done = dict.fromkeys(steps, 0)
    for kind, timed, pair in schedule:
        start = time.perf_counter()
        returned = steps[kind]()
        elapsed = time.perf_counter() - start
        if kind != "train" and barrier is not None:
            barrier()
        done[kind] += 1
        if timed and kind == "train":
            train.append(elapsed)
            if pair is not None:
                paired.append(len(train) - 1)
        elif timed and kind == "compute":
            compute.append(elapsed)
            phases.append(returned)
        elif timed:
            loaded.append(returned)
        if verbose:
            print(f"{labels[kind]} step {done[kind]}/{totals[kind]} {elapsed:.2f} s/step"
                  f"{'' if timed else ' (warm-up)'}", file=sys.stderr, flush=True)
    return train, compute, paired, phases, loaded


def optimizer_kwargs(backend, default_algorithm, algorithm_warmup=0):
    algorithm = backend.algorithm or default_algorithm
    if backend.kind == "fasthorovod" and algorithm not in ("ssgd", "ssgd-2bit"):
        return {"algorithm": algorithm, "warmup_steps": algorithm_warmup}
    if backend.kind == "fasthorovod" and algorithm != "ssgd":
        return {"algorithm": algorithm}
    return {}


def weights_digest(model):
    """SHA-256 over every parameter's bytes: equal digests mean bitwise-equal weights."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def check_identical_weights(hvd, model):
    digests = hvd.allgather_object(weights_digest(model))
    if len(set(digests)) != 1:
        listing = ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
        raise RuntimeError(f"ranks hold different weights after training ({listing})")
    return digests[0]


def synthetic_problem(args, rank):
    """The model (same initial weights on every rank), a training step on this rank's batch and a
    compute-only step on it: forward, backward with ``torch.autograd.grad`` (gradients are returned,
    not accumulated, so the DistributedOptimizer's hooks do not fire and nothing is communicated)
    and SGD's arithmetic in place on copies (buf = 0.9 buf + grad, weights -= lr buf), leaving the
    weights as they are. The compute-only step returns the seconds of its three phases and when
    (seconds from its start) backward produced the first parameter gradient."""
    seed_everything(args.seed)
    model = build_model(args.model, args.num_classes)
    seed_everything(args.seed + 1 + rank)  # distinct data and dropout per rank
    inputs, targets, loss_fn = synthetic_batch(args.model, args.batch_size, args.num_classes,
                                               args.image_size, args.seq_len)
    params = [p for p in model.parameters() if p.requires_grad]
    momentum, scratch = [], []

    def train_step(optimizer, net=model):  # net: the model, or a DistributedDataParallel of it
        optimizer.zero_grad()
        loss_fn(net(inputs), targets).backward()
        optimizer.step()

    def compute_step(load=None):
        start = time.perf_counter()
        loss = loss_fn(model(inputs), targets)
        forward = time.perf_counter()
        loading = load() if load is not None else None  # the loaded step's traffic, from here on
        first = []  # when backward produced its first parameter gradient
        hooks = [p.register_hook(lambda grad: first.append(time.perf_counter()) if not first else None)
                 for p in params]
        try:
            grads = torch.autograd.grad(loss, params)
        finally:
            for hook in hooks:
                hook.remove()
        backward = time.perf_counter()
        if not momentum:
            momentum.extend(torch.zeros_like(p) for p in params)
            scratch.extend(p.detach().clone() for p in params)
        torch._foreach_mul_(momentum, 0.9)
        torch._foreach_add_(momentum, grads)
        torch._foreach_add_(scratch, momentum, alpha=-0.01)  # SGD's in-place update, on copies
        phases = {"forward": forward - start, "backward": backward - forward, "update": time.perf_counter() - backward,
                  "first_gradient": first[0] - start}
        if loading is not None:
            loading()  # waits for the traffic to end: after the phases, never in them
        return phases

    return model, train_step, compute_step


def gradient_load(hvd, model):
    """The loaded compute-only step's traffic (``--loaded-compute``): a function that posts an
    allreduce of zeros the size of the model's gradients and returns a function that waits for it.
    FastHorovod's zeros lie in shared memory the proxies reduce in place (nothing is copied on the
    calling thread, as for the DistributedOptimizer's buckets); Horovod's are an ordinary tensor."""
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    group = getattr(hvd, "proxy_group", lambda: None)()
    zeros = group.alloc(count, torch.float32) if group is not None else torch.zeros(count)
    posted = [0]

    def load():
        posted[0] += 1
        handle = hvd.allreduce_async_(zeros, op=hvd.Sum, name=f"loaded.{posted[0]}")
        return lambda: hvd.synchronize(handle)

    return load


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def summarize(hvd, args, steps, compute, paired, phases, loaded, algorithm, model, digest):
    """Rank 0's result: the slowest rank's medians and what they imply (compute figures are None
    without compute-only steps), the slowest rank's time of every timed step and compute-only step,
    each pair's step - compute (the slowest rank's times), the compute-only steps' phases (per step
    and phase the slowest rank's time; their medians in ``compute_phases_s``), the loaded steps'
    the same way (``loaded_phases_s``, None without them), and the data plane FastHorovod ran
    with."""
    medians = hvd.allgather_object((float(np.median(steps)),
                                    float(np.median(compute)) if compute else None))
    step_s = max(m[0] for m in medians)
    compute_s = max(m[1] for m in medians) if compute else None
    per_step = np.max(hvd.allgather_object(steps), axis=0)  # per step, the slowest rank
    per_compute = np.max(hvd.allgather_object(compute), axis=0) if compute else []
    differences = [float(per_step[i] - c) for i, c in zip(paired, per_compute)]
    exposed = exposed_comm(differences)
    per_phases = slowest_phases(hvd, phases)
    per_loaded = slowest_phases(hvd, loaded)
    return {"np": hvd.size(), "threads": args.threads, "algorithm": algorithm,
            "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "images_per_s": args.batch_size * hvd.size() / step_s,
            "step_s": step_s, "compute_s": compute_s,
            "exposed_comm_s": exposed["exposed_comm_s"],
            "exposed_comm": exposed,
            "step_times_s": [float(t) for t in per_step],
            "compute_times_s": [float(t) for t in per_compute],
            "compute_phase_times_s": per_phases,
            "compute_phases_s": median_phases(per_phases),
            "loaded_phase_times_s": per_loaded,
            "loaded_phases_s": median_phases(per_loaded),
            "paired_steps": list(paired),
            "per_rank_median_step_s": [m[0] for m in medians],
            "per_rank_median_compute_s": [m[1] for m in medians],
            "data_plane": common.data_plane(hvd),
            "weights_sha256": digest}


PHASES = ("forward", "backward", "update", "first_gradient")  # of a compute-only step; the last is
# a moment, not a duration: seconds from the step's start to backward's first parameter gradient


def slowest_phases(hvd, phases):
    """Per step of this rank's list of phase dicts (every rank has as many), each phase's slowest
    rank's time (a step that some rank did not time is left out)."""
    every = hvd.allgather_object(phases)
    return [{name: max(rank[i][name] for rank in every) for name in PHASES}
            for i in range(len(phases)) if all(rank[i] for rank in every)]


def median_phases(per_step):
    """Each phase's median over the steps (None without steps)."""
    return {name: float(np.median([p[name] for p in per_step])) for name in PHASES} if per_step else None
NOT_MEASURABLE = "not measurable (within noise)"
NOT_MEASURED = "not measured (no compute-only steps)"


def exposed_comm(differences):
    """Exposed communication from each pair's training step - compute-only step (seconds). It is
    ``measurable`` when the lower quartile of the differences is above zero, i.e. at least three
    quarters of the pairs show the step longer than computing alone: then ``exposed_comm_s`` is
    their median and ``q1_s``/``q3_s`` their interquartile range, all above zero. Otherwise those
    three are None, ``reason`` says why (the table prints it, :func:`exposed_cell`) and, where there
    were pairs, ``bound_s`` is the upper quartile, at least 0: what the pairs allow it to be at
    most. No figure is ever negative: a pair whose compute-only step took longer than its training
    step says nothing about the communication (the differences themselves follow from
    ``step_times_s``, ``compute_times_s`` and ``paired_steps``)."""
    if not differences:
        return {"pairs": 0, "measurable": False, "exposed_comm_s": None, "q1_s": None, "q3_s": None,
                "bound_s": None, "reason": NOT_MEASURED}
    q1, median, q3 = (float(v) for v in np.percentile(differences, [25, 50, 75]))
    if q1 > 0:
        return {"pairs": len(differences), "measurable": True, "exposed_comm_s": median, "q1_s": q1, "q3_s": q3,
                "bound_s": None, "reason": None}
    return {"pairs": len(differences), "measurable": False, "exposed_comm_s": None, "q1_s": None, "q3_s": None,
            "bound_s": max(0.0, q3), "reason": NOT_MEASURABLE}


def process_created():
    """Wall-clock time at which this process was created, to the kernel's 10 ms. psutil's
    create_time() alone adds the boot time, which the kernel gives in whole seconds; less that boot
    time it is exactly the age since boot, which CLOCK_BOOTTIME (the clock of /proc/uptime) turns
    into a wall-clock time."""
    since_boot = psutil.Process().create_time() - psutil.boot_time()
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


def worker(args):
    # Wall-clock times of this rank's start-up, in order (STARTUP_PHASES names what each one ends).
    clock = {"process_created": process_created(), "script_started": SCRIPT_STARTED, "imports_done": IMPORTS_DONE}
    if args.backend == common.RING:
        common.ring_worker(args)
        return
    backend = common.parse_backend(args.backend, KINDS, with_algorithm=True)
    if backend.kind in common.TORCH_BACKENDS:
        return ddp_worker(args, backend, clock)
    hvd = importlib.import_module(common.HVD_MODULES[backend.kind])
    clock["hvd_imported"] = time.time()
    hvd.init()
    clock["hvd_init_done"] = time.time()
    rank = hvd.rank()
    torch.set_num_threads(args.threads)
    model, train_step, compute_step = synthetic_problem(args, rank)

    kwargs = optimizer_kwargs(backend, args.algorithm, args.algorithm_warmup)
    if backend.compression:
        kwargs["compression"] = getattr(hvd.Compression, backend.compression)
    try:
        optimizer = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                             **kwargs)
    except (TypeError, ValueError) as err:
        if not kwargs:
            raise
        if rank == 0:
            reason = f"DistributedOptimizer({kwargs}): {err}"
            common.write_json(args.result_file, {"skipped": reason})
        hvd.shutdown()
        return
    clock["model_ready"] = time.time()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    clock["parameters_broadcast"] = time.time()
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    clock["optimizer_state_broadcast"] = time.time()
    schedule = step_schedule(args.warmup_steps, args.steps, args.compute_steps, args.loaded_compute)
    load = gradient_load(hvd, model) if args.loaded_compute else None
    timings = run_schedule(schedule, lambda: train_step(optimizer), compute_step, rank == 0,
                           loaded_step=lambda: compute_step(load), barrier=hvd.barrier)
    clock["steps_done"] = time.time()
    if hasattr(optimizer, "sync_weights"):
        optimizer.sync_weights()  # delayed algorithms: every rank takes the global weights
    finish(hvd, args, clock, timings, kwargs.get("algorithm", "ssgd"), model)


def ddp_worker(args, backend, clock):
    """A torch-* backend's rank: the same model, data and steps under DistributedDataParallel (its
    defaults; it broadcasts rank 0's parameters when it wraps the model), plain SGD."""
    world = common.TorchWorld(backend, args.rendezvous)
    clock["hvd_imported"] = clock["hvd_init_done"] = time.time()
    torch.set_num_threads(args.threads)
    model, train_step, compute_step = synthetic_problem(args, world.rank())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = sgd(model)
    clock["model_ready"] = clock["parameters_broadcast"] = clock["optimizer_state_broadcast"] = time.time()
    schedule = step_schedule(args.warmup_steps, args.steps, args.compute_steps)
    timings = run_schedule(schedule, lambda: train_step(optimizer, ddp), compute_step, world.rank() == 0,
                           barrier=world.dist.barrier)
    clock["steps_done"] = time.time()
    finish(world, args, clock, timings, "ddp", model)


def finish(hvd, args, clock, timings, algorithm, model):
    """Checks that every rank holds the same weights, and rank 0 writes the result."""
    digest = check_identical_weights(hvd, model)
    result = summarize(hvd, args, *timings, algorithm, model, digest)
    clock["result_ready"] = time.time()
    clocks = hvd.allgather_object(clock)
    result["clock"] = {mark: max(c[mark] for c in clocks) for mark in clock}  # when the last rank got there
    result["rank_clocks"] = clocks
    if hvd.rank() == 0:
        common.write_json(args.result_file, result)
    hvd.shutdown()


# --------------------------------------------------------------------------------------------
# Driver


def worker_argv(backend, args):
    """A rank's argv (a torch-* backend's launch adds --rendezvous)."""
    return [sys.executable, "-u", os.path.abspath(__file__), "--worker", "--backend", backend.spec,
            "--model", args.model, "--image-size", str(args.image_size), "--seq-len", str(args.seq_len),
            "--batch-size", str(args.batch_size), "--num-classes", str(args.num_classes),
            "--steps", str(job_steps(backend, args)[0]), "--warmup-steps", str(args.warmup_steps),
            "--compute-steps", str(job_steps(backend, args)[1]), "--algorithm", args.algorithm,
            *(["--loaded-compute"] if getattr(args, "loaded_compute", False) and backend.kind not in common.TORCH_BACKENDS
              else []),
            "--algorithm-warmup", str(args.algorithm_warmup),
            "--seed", str(args.seed), "--threads", str(args.threads)]


def pair_differences(result):
    """A job's training step - compute-only step, pair by pair (the slowest rank's times)."""
    return [result["step_times_s"][i] - c for i, c in zip(result.get("paired_steps", []),
                                                          result.get("compute_times_s", []))]


def merge_rounds(rounds):
    """One entry per backend from the rounds' jobs (lists in backend order): images/s, s/step and
    compute s as the median over the rounds of each job's figure, with their spread (``spread``:
    median, min, max over the rounds); exposed communication from every pair of every round
    (``exposed_comm``; its spread is the interquartile range of the pairs). The rounds' own entries
    are kept under "rounds". A backend that failed or was skipped in any round is reported as that
    round's entry."""
    merged = []
    for first, entries, bad in common.backend_rounds(rounds):
        if bad is not None:
            merged.append(dict(bad, rounds=entries))
            continue
        results = [e["result"] for e in entries]
        spreads = {key: common.spread([r[key] for r in results])
                   for key in ("images_per_s", "step_s", "compute_s")}
        bounds = [r.get("overlap") for r in results]
        spreads["of_bound"] = common.spread([b["of_bound"] for b in bounds if b])
        for key in ("of_loaded_bound", "of_first_gradient_bound"):
            spreads[key] = common.spread([b[key] for b in bounds if b and key in b])
        differences = [d for r in results for d in pair_differences(r)]
        exposed = exposed_comm(differences)
        result = {key: results[0][key] for key in ("np", "threads", "algorithm", "gradient_bytes",
                                                   "data_plane")}
        result.update({key: spreads[key]["median"] if spreads[key] else None for key in spreads},
                      rounds=len(results), spread=spreads,
                      exposed_comm_s=exposed["exposed_comm_s"], exposed_comm=exposed,
                      round_images_per_s=[r["images_per_s"] for r in results],
                      of_bound=spreads["of_bound"]["median"] if spreads["of_bound"] else None,
                      of_loaded_bound=spreads["of_loaded_bound"]["median"] if spreads["of_loaded_bound"] else None,
                      of_first_gradient_bound=(spreads["of_first_gradient_bound"]["median"]
                                               if spreads["of_first_gradient_bound"] else None),
                      round_overlap=bounds,
                      data_planes=[r.get("data_plane") for r in results])
        merged.append(dict(first, result=result, rounds=entries,
                           seconds=round(sum(e.get("seconds", 0) for e in entries), 1)))
    return merged


def overlap_bound(result, ceiling, wire_factor=1.0):
    """How close a job's step came to overlapping its communication with its computation, given
    its round's ring ceiling (a tcp-ring result): ``ring_s``, the gradients' ring allreduce at the
    ceiling (each host sends and receives 2 (H - 1) / H of ``wire_factor`` x the gradient bytes,
    H the ceiling's hosts, at its mean per-host goodput); ``bound_s`` = forward + max(backward,
    ring_s) + update, from the compute-only steps' phases (the slowest rank's medians): the step
    a data plane at the ceiling that starts each gradient as backward produces it and hides all of
    it behind backward would take (the update cannot start before the last gradient has
    arrived); ``of_bound`` = step / bound. Where the phases hold the first gradient's moment,
    ``first_gradient_bound_s`` = max(forward + backward, first gradient + ring_s) + update: the same
    with the ring started no earlier than it can start, when every rank has its first gradient (a
    model whose first gradients take long to compute cannot hide its ring behind all of backward);
    ``of_first_gradient_bound`` = step / that bound. None without phases or a measured ceiling."""
    phases = result.get("compute_phases_s")
    if not phases or not ceiling or not ceiling.get("mean_gbps") or len(ceiling.get("hosts", ())) < 2:
        return None
    hosts = len(ceiling["hosts"])
    ring_s = wire_factor * result["gradient_bytes"] * 2 * (hosts - 1) / hosts / (ceiling["mean_gbps"] * 1e9 / 8)
    bound_s = phases["forward"] + max(phases["backward"], ring_s) + phases["update"]
    bound = {"ceiling_gbps": ceiling["mean_gbps"], "hosts": hosts, "ring_s": ring_s, "bound_s": bound_s,
             "of_bound": result["step_s"] / bound_s, **{f"{name}_s": phases.get(name) for name in PHASES}}
    if phases.get("first_gradient") is not None:
        bound["first_gradient_bound_s"] = (max(phases["forward"] + phases["backward"], phases["first_gradient"] + ring_s)
                                           + phases["update"])
        bound["of_first_gradient_bound"] = result["step_s"] / bound["first_gradient_bound_s"]
    loaded = result.get("loaded_phases_s")
    if loaded:  # backward as it computes while rings run on this machine (--loaded-compute)
        bound["loaded_backward_s"] = loaded["backward"]
        bound["loaded_bound_s"] = phases["forward"] + max(loaded["backward"], ring_s) + phases["update"]
        bound["of_loaded_bound"] = result["step_s"] / bound["loaded_bound_s"]
    return bound


def attach_overlap(rounds, backends):
    """Gives every ok job of every round (lists in plan order, the ceiling job first) its
    ``overlap`` against that round's ceiling (``overlap_bound``; +fp16 and +bf16 backends send half the
    bytes); returns the rounds without their ceiling jobs, and the ceiling jobs."""
    ring = [e for r in rounds for e in r if e["backend"] == common.RING]
    jobs = [[e for e in r if e["backend"] != common.RING] for r in rounds]
    for number, entries in enumerate(jobs):
        ceiling = next((e["result"] for e in rounds[number] if e["backend"] == common.RING and e["status"] == "ok"),
                       None)
        for backend, entry in zip(backends, entries):
            if entry["status"] == "ok":
                entry["result"]["overlap"] = overlap_bound(entry["result"], ceiling, 0.5 if backend.compression else 1.0)
    return jobs, ring


def speedups(entries):
    """Per ok backend, its images/s over the first ok backend's: the ratio of the medians and the
    spread of the round-by-round ratios. {backend: {"ratio", "rounds"}}."""
    ok = [e for e in entries if e["status"] == "ok"]
    if not ok:
        return {}
    base = ok[0]["result"]
    return {e["backend"]: {"ratio": e["result"]["images_per_s"] / base["images_per_s"],
                           "rounds": common.spread(common.paired_ratios(
                               e["result"].get("round_images_per_s", [e["result"]["images_per_s"]]),
                               base.get("round_images_per_s", [base["images_per_s"]])))}
            for e in ok}


def exposed_cell(exposed):
    """The table's exposed communication: 'median [q1-q3]' of the pairs, or the reason the JSON
    gives for its absence ('-' where there were no pairs, or no result)."""
    if exposed is None or not exposed["pairs"]:
        return "-"
    if not exposed["measurable"]:
        return exposed["reason"]
    if exposed["pairs"] < 2:
        return f"{exposed['exposed_comm_s']:.3f}"
    return f"{exposed['exposed_comm_s']:.3f} [{exposed['q1_s']:.3f}-{exposed['q3_s']:.3f}]"


def planes(entry):
    """The data planes the rounds of a merged entry ran with ('4x2 (probe)'; several if they differ)."""
    labels = [common.data_plane_label(e["result"].get("data_plane")) for e in entry.get("rounds", [entry])
              if e["status"] == "ok"]
    return " / ".join(dict.fromkeys(labels)) or "-"


def print_table(entries, args, ceiling=None):
    ok = [e for e in entries if e["status"] == "ok"]
    loaded_column = ceiling is not None and any(e["result"].get("spread", {}).get("of_loaded_bound") for e in ok)
    first_column = ceiling is not None and any(e["result"].get("spread", {}).get("of_first_gradient_bound") for e in ok)
    if ceiling is not None:
        print(common.ceiling_line(ceiling))
    if ok:
        rounds = max(e["result"].get("rounds", 1) for e in ok)
        print(f"{args.model}, {workload(args)}, batch {args.batch_size} per rank, "
              f"{args.np} ranks, torch threads per rank: {args.threads}; {rounds} round"
              f"{'s' if rounds != 1 else ''} of {args.warmup_steps} untimed + {args.steps} timed steps"
              + (f" ({args.compute_steps} with a compute-only step)" if args.compute_steps else "")
              + (f"; backends other than FastHorovod: {args.peer_steps} timed steps"
                 f" ({min(args.compute_steps, args.peer_steps)} with a compute-only step)"
                 if getattr(args, "peer_steps", None) is not None else ""))
        print(f"{unit(args)}, s/step, compute s: median [min-max] over the rounds of each job's median; "
              "exposed comm s: median [interquartile range] of step - compute over every pair"
              + ("; x bound: step / (forward + max(backward, ring at the round's ceiling) + update), "
                 "median [min-max] over the rounds" if ceiling is not None else "")
              + ("; x loaded bound: the same with the loaded compute-only steps' backward"
                 if loaded_column else "")
              + ("; x first-gradient bound: step / (max(forward + backward, first gradient + ring) + update), "
                 "the ring started when the slowest rank has its first gradient" if first_column else ""))
        ratios = speedups(ok)
        rows = []
        for e in ok:
            r, spread = e["result"], e["result"].get("spread", {})
            rows.append([e["backend"], planes(e),
                         common.format_spread(spread.get("images_per_s") or common.spread([r["images_per_s"]]), 2),
                         common.format_spread(spread.get("step_s") or common.spread([r["step_s"]]), 3),
                         compute_cell(r),
                         exposed_cell(r.get("exposed_comm")),
                         *([common.format_spread(spread.get("of_bound"), 2, "x")] if ceiling is not None else []),
                         *([common.format_spread(spread.get("of_loaded_bound"), 2, "x")] if loaded_column else []),
                         *([common.format_spread(spread.get("of_first_gradient_bound"), 2, "x")] if first_column else []),
                         common.format_spread(dict(ratios[e["backend"]]["rounds"],
                                                   median=ratios[e["backend"]]["ratio"]), 2, "x")])
        print(common.format_table(["backend", "data plane", unit(args), "s/step", "compute s", "exposed comm s",
                                   *(["x bound"] if ceiling is not None else []),
                                   *(["x loaded bound"] if loaded_column else []),
                                   *(["x first-gradient bound"] if first_column else []),
                                   f"speed-up vs {ok[0]['backend']}"], rows))
        bounds = [(e["backend"], b) for e in ok for b in e["result"].get("round_overlap") or [] if b]
        for backend, b in bounds:
            print(f"  {backend}: forward {b['forward_s']:.3f} + max(backward {b['backward_s']:.3f}, ring "
                  f"{b['ring_s']:.3f} at {b['ceiling_gbps']:.3f} Gbit/s) + update {b['update_s']:.3f} = bound "
                  f"{b['bound_s']:.3f} s; step {b['bound_s'] * b['of_bound']:.3f} s = {b['of_bound']:.2f}x"
                  + (f"; loaded backward {b['loaded_backward_s']:.3f}: bound {b['loaded_bound_s']:.3f} s, "
                     f"{b['of_loaded_bound']:.2f}x" if "loaded_bound_s" in b else "")
                  + (f"; first gradient at {b['first_gradient_s']:.3f}: bound {b['first_gradient_bound_s']:.3f} s, "
                     f"{b['of_first_gradient_bound']:.2f}x" if "first_gradient_bound_s" in b else ""))
        if any((r["result"].get("exposed_comm") or {}).get("reason") == NOT_MEASURABLE for r in ok):
            print(f"{NOT_MEASURABLE}: fewer than three quarters of the pairs show the training "
                  "step longer than computing alone, so the step runs at compute speed to within this "
                  "machine's noise")
        slower = [e["backend"] for e in ok if (e["result"].get("compute_s") or 0) > e["result"]["step_s"]]
        if slower:
            print(f"contended: compute-only steps took longer than training steps for {', '.join(slower)} (the "
                  "median in parentheses is not a compute time): they share the CPUs with whatever is still "
                  "running when they start (the communication a delayed algorithm leaves in flight past its "
                  "step, other load), so the step runs at compute speed; the breakdown plot draws its "
                  "compute part as the whole step")
        note = common.settings_note((e["backend"] for e in ok), args.proxy_threshold)
        if note:
            print(note)
    common.print_problems(entries)


def unit(args):
    """What a job's throughput counts: images, or a language model's sequences, per second."""
    return "sequences/s" if args.model in LANGUAGE_MODELS else "images/s"


def workload(args):
    """One sample's size in words: '224 px', or '128-token sequences' for a language model."""
    return f"{args.seq_len}-token sequences" if args.model in LANGUAGE_MODELS else f"{args.image_size} px"


def compute_cell(result):
    """The table's compute cell: the compute-only time with its spread, unless the compute-only
    steps took longer than the training steps, which makes them no measure of the step's compute."""
    if result.get("compute_s") is None:
        return "-"
    cell = common.format_spread(result.get("spread", {}).get("compute_s") or common.spread([result["compute_s"]]), 3)
    return f"contended ({cell})" if result["compute_s"] > result["step_s"] else cell


def breakdown(result):
    """The step-time bar of one backend: {"compute", "exposed", "unsplit"} seconds that add up to
    the median step. The compute part is the measured compute-only time but never more than the
    step; the rest is exposed communication where that is measurable, else "unsplit" (within
    noise, or no compute-only steps)."""
    step = result["step_s"]
    if result.get("compute_s") is None:
        return {"compute": 0.0, "exposed": 0.0, "unsplit": step}
    compute = min(result["compute_s"], step)
    measurable = bool(result.get("exposed_comm") and result["exposed_comm"]["measurable"])
    rest = step - compute
    return {"compute": compute, "exposed": rest if measurable else 0.0, "unsplit": 0.0 if measurable else rest}


def error_bars(values, spreads):
    """Matplotlib's yerr ([below], [above]) from medians and their spreads (0 without one)."""
    below = [v - s["min"] if s else 0.0 for v, s in zip(values, spreads)]
    above = [s["max"] - v if s else 0.0 for v, s in zip(values, spreads)]
    return [[max(0.0, b) for b in below], [max(0.0, a) for a in above]]


def plot(entries, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [e for e in entries if e["status"] == "ok"]
    names = [e["backend"] for e in ok]
    results = [e["result"] for e in ok]
    fig, (rate_ax, step_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    rates = [r["images_per_s"] for r in results]
    bars = rate_ax.bar(names, rates, color="tab:blue",
                       yerr=error_bars(rates, [r.get("spread", {}).get("images_per_s") for r in results]),
                       capsize=5)
    rate_ax.bar_label(bars, fmt="%.1f", label_type="center", color="white")
    rate_ax.set_ylabel("images/s")
    rounds = max((r.get("rounds", 1) for r in results), default=1)
    rate_ax.set_title(f"{args.model} {args.image_size}px, batch {args.batch_size}/rank, "
                      f"{args.np} ranks; median of {rounds} round{'s' if rounds != 1 else ''}"
                      + (", bars: min-max" if rounds > 1 else ""), fontsize="medium")
    parts = [breakdown(r) for r in results]
    compute = [p["compute"] for p in parts]
    exposed = [p["exposed"] for p in parts]
    unsplit = [p["unsplit"] for p in parts]
    bottom = [c + x for c, x in zip(compute, exposed)]
    step_ax.bar(names, compute, label="compute (compute-only steps)", color="tab:green")
    step_ax.bar(names, exposed, bottom=compute, label="exposed communication", color="tab:red")
    if any(unsplit):
        step_ax.bar(names, unsplit, bottom=bottom, label="not separable (within noise / not measured)",
                    color="tab:gray")
    steps = [r["step_s"] for r in results]
    step_ax.errorbar(names, steps, yerr=error_bars(steps, [r.get("spread", {}).get("step_s") for r in results]),
                     fmt="none", ecolor="black", capsize=5, label="step: min-max over rounds")
    step_ax.set_ylabel("seconds per step (median)")
    step_ax.set_title("step time breakdown")
    if ok:
        step_ax.legend(fontsize="small")
    for ax in (rate_ax, step_ax):
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    common.save_figure(fig, path)


# A job's timeline, phase by phase: (name, the clock mark that ends it). The first phase starts when
# the driver starts the job (``started_at``), the last ends when the job has exited (``ended_at``);
# the marks between are the times the last rank reached each mark (worker(): wall clock, the same
# clock as the driver's), so a collective phase lasts from the last rank's start to the last rank's end.
STARTUP_PHASES = (
    ("launch", "process_created"),           # the launcher: emulated cloud, horovodrun, spawning ranks
    ("interpreter", "script_started"),       # Python start-up until train.py runs
    ("imports", "imports_done"),             # numpy, torch, models
    ("hvd_import", "hvd_imported"),          # import horovod.torch / fasthorovod.torch
    ("hvd_init", "hvd_init_done"),           # hvd.init(): Horovod, proxies, path probe
    ("model", "model_ready"),                # model, synthetic batch, DistributedOptimizer
    ("broadcast_parameters", "parameters_broadcast"),
    ("broadcast_optimizer_state", "optimizer_state_broadcast"),
)
LATER_PHASES = (
    ("steps", "steps_done"),                 # warm-up, timed and compute-only steps
    ("finish", "ended_at"),                  # weights check, results, hvd.shutdown(), launcher exit
)


def job_timeline(entry):
    """{phase: seconds} of a finished job (STARTUP_PHASES, then ``startup``, their sum: from the
    driver starting the job to the first training step; then LATER_PHASES and ``path_probe``, the
    part of hvd_init that FastHorovod's path probe took); None without the worker's clock."""
    clock = (entry.get("result") or {}).get("clock")
    if not clock or "started_at" not in entry:
        return None
    marks = dict(clock, started_at=entry["started_at"], ended_at=entry.get("ended_at"))
    phases, previous = {}, "started_at"
    for name, mark in STARTUP_PHASES + LATER_PHASES:
        if marks.get(mark) is None or marks.get(previous) is None:
            return None
        phases[name] = round(marks[mark] - marks[previous], 2)
        previous = mark
    phases["startup"] = round(marks["optimizer_state_broadcast"] - marks["started_at"], 2)
    probe = ((entry["result"].get("data_plane") or {}).get("probe") or {}).get("seconds")
    phases["path_probe"] = round(probe, 2) if probe is not None else None
    return phases


def timeline_line(phases):
    """'start-up 55.1 s (launch 4.0, imports 12.3, ...)' from ``job_timeline``."""
    parts = ", ".join(f"{name} {phases[name]:.1f}" for name, _ in STARTUP_PHASES)
    probe = f"; path probe {phases['path_probe']:.1f} of hvd_init" if phases.get("path_probe") is not None else ""
    return f"start-up {phases['startup']:.1f} s ({parts}{probe}); steps {phases['steps']:.1f} s, finish {phases['finish']:.1f} s"


def job_line(entry, units="images/s"):
    """A finished job in one line (progress), with its start-up breakdown."""
    if entry["backend"] == common.RING:
        return common.ring_line(entry)
    r = entry["result"]
    line = f"{r['images_per_s']:.2f} {units}, {r['step_s']:.2f} s/step"
    if r.get("compute_s") is not None:
        line += f", compute {r['compute_s']:.2f} s"
    if r.get("data_plane"):
        line += f", data plane {common.data_plane_label(r['data_plane'])}"
    phases = job_timeline(entry)
    if phases is not None:
        line += f"; {timeline_line(phases)}"
    return line


def driver(args):
    try:
        backends = common.parse_backends(args.backends, KINDS, with_algorithm=True)
    except ValueError as err:
        sys.exit(f"error: {err}")
    common.warn_inherited_fasthorovod_env()
    start = time.monotonic()
    plan = ([(common.RING_BACKEND, common.ring_worker_argv(__file__, args))] if args.ceiling else []) \
        + [(backend, worker_argv(backend, args)) for backend in backends]
    rounds = common.run_rounds("train", plan, args, lambda entry: job_line(entry, unit(args)), args.proxy_threshold)
    for entry in (e for entries in rounds for e in entries):
        if job_timeline(entry) is not None:
            entry["timeline"] = job_timeline(entry)  # kept in the JSON with each round's entry
    rounds, ring = attach_overlap(rounds, backends)
    ceiling = common.merge_ring(ring) if args.ceiling else None
    entries = merge_rounds(rounds)
    seconds = time.monotonic() - start
    print()
    print_table(entries, args, ceiling)
    print(f"{len(plan) * args.rounds} jobs in {common.clock(seconds)}")
    if args.out:
        doc = common.report("train", args, entries)
        doc.update(seconds=round(seconds, 1), speedups=speedups(entries), ceiling=ceiling,
                   settings=common.settings_note((b.spec for b in backends), args.proxy_threshold))
        common.write_json(args.out, doc)
    if args.plot:
        plot(entries, args, args.plot)
    return 1 if any(e["status"] == "failed" for e in entries + ring) else 0


def main(argv=None):
    return common.main(parse_args, worker, driver, argv)


if __name__ == "__main__":
    sys.exit(main())
