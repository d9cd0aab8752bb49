"""Training throughput on synthetic data: AlexNet or VGG16, data-parallel, per backend side by side.

The driver runs every backend in turn as a separate job of N ranks (launchers as in _common.py) and
compares them. Each rank:

  1. seeds Python, NumPy and torch identically, builds the model (models.py), then reseeds per rank
     and draws one fixed synthetic batch (random images, random labels) that every step reuses;
  2. *compute only*: ``--warmup-steps`` + ``--compute-steps`` steps of forward, backward and a plain
     local SGD step -- no communication at all (``--compute-steps 0`` skips this phase);
  3. wraps a fresh ``SGD(lr=0.01, momentum=0.9)`` in ``hvd.DistributedOptimizer(opt,
     named_parameters=...)`` (plus ``algorithm=`` for FastHorovod when it is not "ssgd"), broadcasts
     parameters and optimizer state from rank 0, and times ``--warmup-steps`` + ``--steps`` steps of
     forward, backward (gradients are allreduced as they become ready) and optimizer step (which
     waits for the allreduces);
  4. checks that all ranks end with bitwise-identical weights (SHA-256 of every parameter,
     allgathered) and fails the job if they do not.

Reported per backend (the slowest rank's median; ranks are in lockstep, so they barely differ):
images/s = batch * N / median step time; compute = median compute-only step; exposed comm = step -
compute, the communication time that backward and the optimizer did not hide (negative values are
noise). The JSON also holds every timed step's time (the slowest rank's) and, for FastHorovod, the
data plane it ran with (lanes, sockets per lane and where that number came from). Rank 0 prints progress to stderr (``train step 12/50 1.23 s/step``).

    python benchmarks/train.py --model alexnet --np 4 --backends horovod,fasthorovod:4 \\
        --out results/train.json --plot results/train.png
"""
import argparse
import hashlib
import importlib
import os
import random
import sys
import time

import numpy as np
import torch
from torch import nn

import _common as common
from models import MIN_IMAGE_SIZE, MODELS, build_model

KINDS = ("horovod-gloo", "horovod-mpi", "fasthorovod")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Synthetic-data training throughput of AlexNet/VGG16 for several backends side "
                    "by side. Prints a table (images/s, s/step, compute-only s/step, exposed "
                    "communication s/step, speed-up over the first backend), writes JSON and a "
                    "PNG.")
    parser.add_argument("--backends", default="horovod,fasthorovod:4",
                        help="comma-separated: horovod-gloo (or horovod), horovod-mpi, "
                             "fasthorovod[:PROXIES[xSOCKETS][:ALGORITHM]][+trace]; the first is the "
                             "speed-up baseline; '+trace' records the backend's DLC trace "
                             "(see --trace-root) (default: %(default)s)")
    add_workload_arguments(parser)
    common.add_driver_arguments(parser)
    common.add_worker_arguments(parser)
    args = parser.parse_args(argv)
    check_workload_arguments(parser, args)
    return args


def add_workload_arguments(parser):
    """The options that define one training job (model, data, steps, algorithm, seed); the drivers
    that run train.py's workers (this one, repeat_train.py) share them."""
    parser.add_argument("--model", choices=sorted(MODELS), default="alexnet",
                        help="model to train (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=224,
                        help=f"image height and width in px, at least {MIN_IMAGE_SIZE} "
                             "(default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="images per rank per step (default: %(default)s)")
    parser.add_argument("--num-classes", type=int, default=1000,
                        help="classifier outputs (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10,
                        help="timed training steps (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="untimed steps before the compute-only and before the training "
                             "phase (default: %(default)s)")
    parser.add_argument("--compute-steps", type=int, default=3,
                        help="timed compute-only steps, without communication; 0 skips that "
                             "phase (then compute s and exposed comm s are not reported) "
                             "(default: %(default)s)")
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
    if args.image_size < MIN_IMAGE_SIZE:
        parser.error(f"--image-size must be at least {MIN_IMAGE_SIZE}")
    if min(args.steps, args.batch_size, args.np) < 1 or min(args.warmup_steps, args.compute_steps) < 0:
        parser.error("need --steps, --batch-size, --np >= 1 and --warmup-steps, --compute-steps >= 0")
    if args.threads is None:
        args.threads = common.default_threads(args.np)


# --------------------------------------------------------------------------------------------
# Worker: one rank.


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def time_steps(step, warmup, count, label, verbose):
    """Run ``warmup`` + ``count`` steps; return the durations of the last ``count``."""
    times = []
    for i in range(1, warmup + count + 1):
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if i > warmup:
            times.append(elapsed)
        if verbose:
            note = " (warm-up)" if i <= warmup else ""
            print(f"{label} step {i}/{warmup + count} {elapsed:.2f} s/step{note}",
                  file=sys.stderr, flush=True)
    return times


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
    """The model (same initial weights on every rank) and a training step on this rank's batch."""
    seed_everything(args.seed)
    model = build_model(args.model, args.num_classes)
    seed_everything(args.seed + 1 + rank)  # distinct data and dropout per rank
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(args.num_classes, (args.batch_size,))
    loss_fn = nn.CrossEntropyLoss()

    def train_step(optimizer):
        optimizer.zero_grad()
        loss_fn(model(images), labels).backward()
        optimizer.step()

    return model, train_step


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def summarize(hvd, args, steps, compute, algorithm, model, digest):
    """Rank 0's result: the slowest rank's medians and what they imply (compute and exposed
    communication are None when the compute-only phase was skipped), the slowest rank's time of
    every timed step, and the data plane FastHorovod ran with."""
    medians = hvd.allgather_object((float(np.median(steps)),
                                    float(np.median(compute)) if compute else None))
    step_s = max(m[0] for m in medians)
    compute_s = max(m[1] for m in medians) if compute else None
    per_step = np.max(hvd.allgather_object(steps), axis=0)  # per step, the slowest rank
    return {"np": hvd.size(), "threads": args.threads, "algorithm": algorithm,
            "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "images_per_s": args.batch_size * hvd.size() / step_s,
            "step_s": step_s, "compute_s": compute_s,
            "exposed_comm_s": step_s - compute_s if compute else None,
            "step_times_s": [float(t) for t in per_step],
            "per_rank_median_step_s": [m[0] for m in medians],
            "per_rank_median_compute_s": [m[1] for m in medians],
            "data_plane": common.data_plane(hvd),
            "weights_sha256": digest}


def worker(args):
    backend = common.parse_backend(args.backend, KINDS, with_algorithm=True)
    hvd = importlib.import_module(common.HVD_MODULES[backend.kind])
    hvd.init()
    rank = hvd.rank()
    torch.set_num_threads(args.threads)
    model, train_step = synthetic_problem(args, rank)

    compute = []
    if args.compute_steps:
        local = sgd(model)
        compute = time_steps(lambda: train_step(local), args.warmup_steps, args.compute_steps,
                             "compute-only", rank == 0)
        model.zero_grad(set_to_none=True)

    kwargs = optimizer_kwargs(backend, args.algorithm, args.algorithm_warmup)
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
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    steps = time_steps(lambda: train_step(optimizer), args.warmup_steps, args.steps, "train",
                       rank == 0)
    if hasattr(optimizer, "sync_weights"):
        optimizer.sync_weights()  # delayed algorithms: every rank takes the global weights
    digest = check_identical_weights(hvd, model)
    result = summarize(hvd, args, steps, compute, kwargs.get("algorithm", "ssgd"), model, digest)
    if rank == 0:
        common.write_json(args.result_file, result)
    hvd.shutdown()


# --------------------------------------------------------------------------------------------
# Driver


def worker_argv(backend, args):
    return [sys.executable, "-u", os.path.abspath(__file__), "--worker", "--backend", backend.spec,
            "--model", args.model, "--image-size", str(args.image_size),
            "--batch-size", str(args.batch_size), "--num-classes", str(args.num_classes),
            "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
            "--compute-steps", str(args.compute_steps), "--algorithm", args.algorithm,
            "--algorithm-warmup", str(args.algorithm_warmup),
            "--seed", str(args.seed), "--threads", str(args.threads)]


def seconds(value):
    """'1.234', or '-' for a figure that was not measured."""
    return "-" if value is None else f"{value:.3f}"


def print_table(entries, args):
    ok = [e for e in entries if e["status"] == "ok"]
    if ok:
        print(f"{args.model}, {args.image_size} px, batch {args.batch_size} per rank, "
              f"{args.np} ranks, torch threads per rank: {args.threads}")
        baseline = ok[0]["result"]["images_per_s"]
        rows = [[e["backend"], f"{r['images_per_s']:.2f}", f"{r['step_s']:.3f}",
                 seconds(r["compute_s"]), seconds(r["exposed_comm_s"]),
                 f"{r['images_per_s'] / baseline:.2f}x"]
                for e in ok for r in [e["result"]]]
        print(common.format_table(["backend", "images/s", "s/step", "compute s", "exposed comm s",
                                   f"speed-up vs {ok[0]['backend']}"], rows))
    common.print_problems(entries)


def plot(entries, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [e for e in entries if e["status"] == "ok"]
    names = [e["backend"] for e in ok]
    results = [e["result"] for e in ok]
    fig, (rate_ax, step_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = rate_ax.bar(names, [r["images_per_s"] for r in results], color="tab:blue")
    rate_ax.bar_label(bars, fmt="%.1f")
    rate_ax.set_ylabel("images/s")
    rate_ax.set_title(f"{args.model} {args.image_size}px, batch {args.batch_size}/rank, "
                      f"{args.np} ranks")
    compute = [r["compute_s"] or 0.0 for r in results]
    exposed = [max(0.0, r["exposed_comm_s"]) if r["compute_s"] is not None else 0.0 for r in results]
    unsplit = [r["step_s"] if r["compute_s"] is None else 0.0 for r in results]
    step_ax.bar(names, compute, label="compute", color="tab:green")
    step_ax.bar(names, exposed, bottom=compute, label="exposed communication", color="tab:red")
    if any(unsplit):
        step_ax.bar(names, unsplit, label="step (compute not measured)", color="tab:gray")
    step_ax.set_ylabel("seconds per step")
    step_ax.set_title("step time breakdown")
    if ok:
        step_ax.legend()
    for ax in (rate_ax, step_ax):
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    common.save_figure(fig, path)


def driver(args):
    try:
        backends = common.parse_backends(args.backends, KINDS, with_algorithm=True)
    except ValueError as err:
        sys.exit(f"error: {err}")
    entries = common.run_backends("train", backends, args, worker_argv)
    print_table(entries, args)
    if args.out:
        common.write_json(args.out, common.report("train", args, entries))
    if args.plot:
        plot(entries, args, args.plot)
    return 1 if any(e["status"] == "failed" for e in entries) else 0


def main(argv=None):
    return common.main(parse_args, worker, driver, argv)


if __name__ == "__main__":
    sys.exit(main())
