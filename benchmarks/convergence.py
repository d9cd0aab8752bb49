"""Time to accuracy: how long each training algorithm of FastHorovod's scheduler takes to reach a
test accuracy, on a real dataset, side by side.

The question it answers: does CD-SGD reach SSGD's final accuracy in >= 30 % less wall-clock time
than synchronous SGD with 2-bit compression (and where do SSD-SGD and OD-SGD land)? Each backend,
written ``fasthorovod:K:ALGORITHM`` (K proxies per rank; ALGORITHM one of ssgd, ssgd-2bit, od-sgd,
ssd-sgd, cd-sgd, local-sgd; ``fasthorovod:K`` alone means ssgd), runs as a separate job of N ranks
(launchers as in _common.py). Every rank of every job:

  1. loads scikit-learn's digits (1797 images of 8x8 px, pixels / 16), splits them stratified 75/25
     with the fixed seed 0 into train (1347) and test (450), and takes every N-th training example
     from its rank on as its shard; each epoch visits the shard in a fresh order (seeded by
     --seed, epoch and rank: the same for every algorithm);
  2. builds the MLP 64-H-...-H-10 (--hidden H, --hidden-layers of them, ReLU) from --seed, so every
     rank and every algorithm starts from the same weights (also broadcast from rank 0), and wraps
     ``SGD(lr=--lr, momentum=0.9)`` in ``hvd.DistributedOptimizer`` with the backend's algorithm
     (ssgd-2bit and cd-sgd with ``threshold=--threshold``, the delayed algorithms and local-sgd
     with ``warmup_steps=--warmup-steps``, more options with --option); the wide layers make the
     gradients large (about 68 MB at H=4096) so that communication matters;
  3. trains --epochs epochs of (train examples / N) // --batch-size steps. After each epoch it calls
     ``opt.sync_weights()`` where the optimizer has it (delayed algorithms, local SGD: the model's
     parameters become the global weights on every rank, see docs/algorithms.md) -- this drains
     the communication in flight and counts as training time; it also starts a new delay period,
     as any evaluation or checkpoint of such a run does -- then *stops the clock*: rank 0
     evaluates test accuracy while the other ranks wait, and the clock resumes only when every rank
     has the result. The curve records (epoch, training seconds so far = the slowest rank's clock,
     test accuracy, mean training loss on the local weights);
  4. at the end checks that all ranks hold bit-identical weights; rank 0 reports the curve, the
     final and best accuracy, steps/s, and the bytes communicated (``opt.communication_stats()``
     for the scheduled algorithms, the gradient size per step for plain SSGD; bytes sent on the
     proxy lanes for all).

The driver then takes the target accuracy: --target, or else the first backend's final accuracy
minus --tolerance percentage points (default 0: the first backend's own final accuracy, which it
reaches by definition in its last epoch or earlier). Time to target = the training time at the end
of the first epoch whose accuracy is >= the target (no interpolation between epochs), or "not
reached". It compares every backend's time to target with the first backend's and, when one of the
backends runs ssgd-2bit, with that one's: "X% less time" = 1 - t / t_reference. When the reference
never reached the target, its whole training time is a lower bound of its time to target and the
saving is reported as "at least". Prints a table, writes --out JSON and a --plot PNG (accuracy vs
training time and vs epoch).

Loopback (every rank on this host, no shaping):

    python benchmarks/convergence.py --np 4 --out results/convergence.json \\
        --plot results/convergence.png

Emulated cloud (4 hosts, 1 Gbit/s per host, 200 Mbit/s per TCP flow; docs/netem.md):

    python benchmarks/convergence.py --np 4 \\
        --launcher-prefix 'fasthorovodrun --emulate-cloud 4:1gbit:200mbit' \\
        --out results/convergence-cloud.json --plot results/convergence-cloud.png
"""
import argparse
import hashlib
import os
import random
import sys
import time

import _common as common

KINDS = ("fasthorovod",)
ALGORITHMS = ("ssgd", "ssgd-2bit", "od-sgd", "ssd-sgd", "cd-sgd", "local-sgd")
WARMUP_ALGORITHMS = ("od-sgd", "ssd-sgd", "cd-sgd", "local-sgd")  # take warmup_steps=
THRESHOLD_ALGORITHMS = ("ssgd-2bit", "cd-sgd")                     # take threshold=
DEFAULT_BACKENDS = ",".join(f"fasthorovod:4:{a}"
                            for a in ("ssgd", "ssgd-2bit", "cd-sgd", "ssd-sgd", "od-sgd"))
SPLIT_SEED = 0        # the train/test split, fixed so that every run tests on the same 450 images
TEST_FRACTION = 0.25


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Time to accuracy of FastHorovod's training algorithms (SSGD, SSGD+2-bit, "
                    "OD-SGD, SSD-SGD, CD-SGD, local SGD) on scikit-learn's digits with a wide MLP. "
                    "Training time excludes evaluation. Prints a table (final accuracy, time to "
                    "the target accuracy, time compared with the first backend and with the "
                    "ssgd-2bit backend), writes JSON and a PNG of accuracy vs training time.")
    parser.add_argument("--backends", default=DEFAULT_BACKENDS,
                        help="comma-separated fasthorovod:PROXIES:ALGORITHM[+trace], ALGORITHM one "
                             f"of {', '.join(ALGORITHMS)} (fasthorovod:PROXIES alone = ssgd); the "
                             "first backend is the baseline whose final accuracy sets the target "
                             "(see --target, --tolerance); a '+trace' suffix records the "
                             "backend's DLC trace (see --trace-root) (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=20, help="training epochs per backend (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per rank per step (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of SGD (momentum 0.9) -- the global optimizer for the "
                             "delayed algorithms (default: %(default)s)")
    parser.add_argument("--lr-milestones", type=_int_list, default=[], metavar="E1,E2,...",
                        help="multiply the learning rate by 0.1 after these epochs (MultiStepLR); "
                             "default: constant learning rate")
    parser.add_argument("--hidden", type=int, default=4096,
                        help="width H of each hidden layer of the MLP 64-H-...-H-10 (default: %(default)s)")
    parser.add_argument("--hidden-layers", type=int, default=2,
                        help="number of hidden layers (2: 64-H-H-10, about 17.1 M parameters at "
                             "H=4096) (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=20,
                        help="warmup_steps= (steps of synchronous SGD first) for od-sgd, ssd-sgd, "
                             "cd-sgd and local-sgd; their own defaults (200-1000) would cover most "
                             "of a digits run (default: %(default)s)")
    parser.add_argument("--threshold", type=float, default=0.005,
                        help="2-bit threshold tau for ssgd-2bit and cd-sgd; choose it on the scale "
                             "of the gradient's elements (the JSON reports each parameter's mean "
                             "|gradient| at the first step as grad_abs_mean; docs/algorithms.md) (default: %(default)s)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="another DistributedOptimizer option (e.g. period=5, "
                             "correction_period=5, local_lr_scale=4, glu=1, local_update=dc-asgd), "
                             "given to every algorithm of the run that accepts it; repeatable")
    parser.add_argument("--target", type=float,
                        help="target test accuracy as a fraction (e.g. 0.95); default: the first "
                             "backend's final accuracy minus --tolerance")
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="percentage points below the first backend's final accuracy that "
                             "count as reaching it (ignored with --target) (default: %(default)s)")
    parser.add_argument("--proxy-threshold", type=common.parse_size,
                        help="FASTHOROVOD_PROXY_THRESHOLD_BYTES for the jobs (default: "
                             "FastHorovod's own)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights and of the data order (the train/test "
                             f"split always uses seed {SPLIT_SEED}) (default: %(default)s)")
    common.add_driver_arguments(parser)
    common.add_worker_arguments(parser)
    parser.set_defaults(timeout=3600)
    args = parser.parse_args(argv)
    if min(args.epochs, args.batch_size, args.hidden, args.hidden_layers, args.np) < 1:
        parser.error("--epochs, --batch-size, --hidden, --hidden-layers and --np must be >= 1")
    if args.warmup_steps < 0:
        parser.error("--warmup-steps must be >= 0")
    if not args.lr > 0 or not args.threshold > 0:
        parser.error("--lr and --threshold must be > 0")
    if args.target is not None and not 0 < args.target <= 1:
        parser.error(f"--target {args.target:g}: give a fraction in (0, 1], e.g. 0.95 for 95 %")
    if args.tolerance < 0:
        parser.error("--tolerance must be >= 0 (percentage points)")
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    try:
        args.options = dict(_parse_option(text) for text in args.option)
    except ValueError as err:
        parser.error(str(err))
    if args.threads is None:
        args.threads = common.default_threads(args.np)
    return args


def _int_list(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated epochs, e.g. 10,15")
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: epochs must be >= 1")
    return values


def _parse_option(text):
    """'period=5' -> ('period', 5): int, else float, else the string."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name or not raw.strip():
        raise ValueError(f"--option {text!r}: expected NAME=VALUE, e.g. period=5")
    if name in ("warmup_steps", "threshold"):
        raise ValueError(f"--option {name}: use --{name.replace('_', '-')} instead")
    raw = raw.strip()
    for convert in (int, float):
        try:
            return name, convert(raw)
        except ValueError:
            pass
    return name, raw


def parse_backend_list(text):
    """The backends, each with a known algorithm (None = ssgd); ValueError names what is wrong."""
    backends = common.parse_backends(text, KINDS, with_algorithm=True)
    if not backends:
        raise ValueError("no backends given")
    for backend in backends:
        if (backend.algorithm or "ssgd") not in ALGORITHMS:
            raise ValueError(f"backend {backend.spec!r}: unknown algorithm {backend.algorithm!r}; "
                             f"choose one of {', '.join(ALGORITHMS)}")
    specs = [b.spec for b in backends]
    repeated = sorted({s for s in specs if specs.count(s) > 1})
    if repeated:
        raise ValueError(f"backend {repeated[0]!r} is given more than once (results are keyed "
                         "by the spec)")
    return backends


def check_options(options, algorithms):
    """Each --option must be an option of at least one algorithm in the run (where FastHorovod is
    importable here; otherwise the workers report it)."""
    if not options:
        return
    try:
        from fasthorovod.scheduler import ALGORITHMS as CLASSES
    except ImportError:
        return
    for name in options:
        if not any(name in CLASSES[a].OPTIONS for a in algorithms if a in CLASSES):
            takers = sorted(a for a, cls in CLASSES.items() if name in cls.OPTIONS)
            where = f"only {', '.join(takers)} take it" if takers else "no algorithm takes it"
            raise ValueError(f"--option {name}: none of the algorithms of this run "
                             f"({', '.join(algorithms)}) accepts it ({where})")


def optimizer_kwargs(algorithm, args, accepted):
    """DistributedOptimizer keyword arguments for ``algorithm``; ``accepted``: its option names."""
    if algorithm == "ssgd":
        return {}
    kwargs = {"algorithm": algorithm}
    if algorithm in WARMUP_ALGORITHMS:
        kwargs["warmup_steps"] = args.warmup_steps
    if algorithm in THRESHOLD_ALGORITHMS:
        kwargs["threshold"] = args.threshold
    kwargs.update({k: v for k, v in args.options.items() if k in accepted})
    return kwargs


# --------------------------------------------------------------------------------------------
# Worker: one rank.


def load_shard(rank, size):
    """(x_train, y_train) of this rank's shard and the whole (x_test, y_test), as tensors."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y)
    shard = np.arange(rank, len(x_train), size)
    return ((torch.from_numpy(x_train[shard]), torch.from_numpy(y_train[shard])),
            (torch.from_numpy(x_test), torch.from_numpy(y_test)), len(x_train))


def build_mlp(hidden, layers):
    from torch import nn
    widths = [64] + [hidden] * layers
    modules = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        modules += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*modules, nn.Linear(widths[-1], 10))


def weights_digest(model):
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def lane_bytes(hvd):
    group = hvd.proxy_group() if hasattr(hvd, "proxy_group") else None
    return sum(s["bytes_sent"] for s in group.lane_stats()) if group is not None else 0


def worker(args):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import fasthorovod.torch as hvd
    from fasthorovod.scheduler import ALGORITHMS as CLASSES

    backend = common.parse_backend(args.backend, KINDS, with_algorithm=True)
    algorithm = backend.algorithm or "ssgd"
    accepted = set(CLASSES[algorithm].OPTIONS) if algorithm in CLASSES else set()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(args.threads)
    (x, y), (x_test, y_test), n_train = load_shard(rank, size)
    steps_per_epoch = (n_train // size) // args.batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"--batch-size {args.batch_size} is larger than a rank's shard "
                         f"({n_train // size} of {n_train} training examples at {size} ranks)")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    model = build_mlp(args.hidden, args.hidden_layers)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    grad_abs_mean = first_gradient_scale(model, x, y, args, F)

    kwargs = optimizer_kwargs(algorithm, args, accepted)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                   named_parameters=model.named_parameters(), **kwargs)
    sched = (torch.optim.lr_scheduler.MultiStepLR(opt, args.lr_milestones, 0.1)
             if args.lr_milestones else None)
    syncs = hasattr(opt, "sync_weights")

    curve, train_s, sync_s = [], 0.0, 0.0
    hvd.barrier()
    lanes_before = lane_bytes(hvd)
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(
            args.seed * 1_000_003 + epoch * 1009 + rank))
        loss_sum = torch.zeros(())
        start = time.perf_counter()
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
            loss_sum += loss.detach()
        if sched is not None:
            sched.step()
        if syncs:
            sync_start = time.perf_counter()
            opt.sync_weights()
            sync_s += time.perf_counter() - sync_start
        train_s += time.perf_counter() - start
        # The clock is stopped until every rank has the accuracy: nobody trains meanwhile.
        clocks = hvd.allgather_object((train_s, loss_sum.item() / steps_per_epoch),
                                      name="convergence.clocks")
        accuracy = evaluate(model, x_test, y_test) if rank == 0 else None
        # (an explicit name: Horovod names it after the object's type, None on the other ranks)
        accuracy = hvd.broadcast_object(accuracy, root_rank=0, name="convergence.accuracy")
        point = {"epoch": epoch, "train_s": max(c[0] for c in clocks), "accuracy": accuracy,
                 "train_loss": sum(c[1] for c in clocks) / size}
        curve.append(point)
        if rank == 0:
            print(f"{backend.spec} epoch {epoch}/{args.epochs}: accuracy "
                  f"{accuracy * 100:.2f} %, {point['train_s']:.1f} s training, loss "
                  f"{point['train_loss']:.4f}", file=sys.stderr, flush=True)
    lanes = lane_bytes(hvd) - lanes_before

    digests = hvd.allgather_object(weights_digest(model), name="convergence.digests")
    if len(set(digests)) != 1:
        raise RuntimeError(f"{algorithm}: ranks hold different weights after training "
                           f"({', '.join(d[:12] for d in digests)})")
    steps = args.epochs * steps_per_epoch
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if hasattr(opt, "communication_stats"):
        sent = opt.communication_stats()
        source = "opt.communication_stats()"
    else:  # fasthorovod.torch's SSGD: one average of every gradient per step
        sent = {"allreduce_bytes": gradient_bytes * steps, "allgather_bytes": 0}
        source = "gradient bytes x steps"
    total_s = curve[-1]["train_s"]
    result = {
        "algorithm": algorithm, "options": kwargs, "np": size, "threads": args.threads,
        "model": f"64-{'-'.join([str(args.hidden)] * args.hidden_layers)}-10",
        "parameters": sum(p.numel() for p in model.parameters()),
        "gradient_bytes": gradient_bytes, "train_examples": n_train, "test_examples": len(x_test),
        "steps_per_epoch": steps_per_epoch, "epochs": args.epochs, "steps": steps,
        "curve": curve, "final_accuracy": curve[-1]["accuracy"],
        "best_accuracy": max(p["accuracy"] for p in curve),
        "train_s": total_s, "sync_weights_s_rank0": sync_s,
        "steps_per_s": steps / total_s if total_s > 0 else None,
        "communication": dict(sent, source=source, proxy_lane_bytes_sent=lanes,
                              bytes_per_step=sum(v for k, v in sent.items()
                                                 if k.endswith("_bytes")) / steps),
        "grad_abs_mean": grad_abs_mean, "weights_sha256": digests[0],
    }
    if rank == 0:
        common.write_json(args.result_file, result)
    hvd.shutdown()


def first_gradient_scale(model, x, y, args, F):
    """Mean |gradient element| per parameter on this rank's first batch (outside the clock): the
    scale on which the 2-bit threshold has to be chosen."""
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x[:args.batch_size]), y[:args.batch_size]).backward()
    scale = {name: p.grad.abs().mean().item() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return scale


def evaluate(model, x_test, y_test):
    import torch
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).float().mean().item()


# --------------------------------------------------------------------------------------------
# Driver


def worker_argv(backend, args):
    argv = [sys.executable, "-u", os.path.abspath(__file__), "--worker", "--backend", backend.spec,
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
            "--lr", repr(args.lr), "--hidden", str(args.hidden),
            "--hidden-layers", str(args.hidden_layers), "--warmup-steps", str(args.warmup_steps),
            "--threshold", repr(args.threshold), "--seed", str(args.seed),
            "--threads", str(args.threads)]
    if args.lr_milestones:
        argv += ["--lr-milestones", ",".join(map(str, args.lr_milestones))]
    for text in args.option:
        argv += ["--option", text]
    return argv


def time_to_target(result, target):
    """(epoch, training seconds) at the end of the first epoch with accuracy >= target, or None."""
    for point in result["curve"]:
        if point["accuracy"] >= target:
            return point["epoch"], point["train_s"]
    return None


def compare(entry, reference):
    """entry's time to target relative to reference's, or None when entry did not reach it.

    When the reference did not reach the target, its total training time bounds its time to
    target from below, so the ratio is an upper bound ("at most") and the saving a lower bound.
    """
    mine = entry["time_to_target"]
    if not mine["reached"]:
        return None
    theirs = reference["time_to_target"]
    if theirs["reached"]:
        ref_s, bound = theirs["train_s"], "exact"
    else:
        ref_s, bound = reference["result"]["train_s"], "reference not reached: ratio at most, saving at least"
    if ref_s <= 0:
        return None
    ratio = mine["train_s"] / ref_s
    return {"reference": reference["backend"], "time_ratio": ratio,
            "less_time_pct": (1 - ratio) * 100, "bound": bound}


def analyze(entries, args):
    """Adds time_to_target and the comparisons to every ok entry; returns the target summary."""
    ok = [e for e in entries if e["status"] == "ok"]
    if args.target is not None:
        target, source = args.target, "--target"
    elif entries and entries[0]["status"] == "ok":
        final = entries[0]["result"]["final_accuracy"]
        target = final - args.tolerance / 100
        source = (f"final accuracy of {entries[0]['backend']} ({final * 100:.2f} %) minus "
                  f"{args.tolerance:g} points")
    else:
        return {"target": None, "source": f"none: the first backend {entries[0]['backend']} did "
                                          "not finish (give --target)"}
    for entry in ok:
        hit = time_to_target(entry["result"], target)
        entry["time_to_target"] = ({"reached": True, "epoch": hit[0], "train_s": hit[1]} if hit
                                   else {"reached": False})
    two_bit = next((e for e in ok if e["result"]["algorithm"] == "ssgd-2bit"), None)
    first = entries[0] if entries[0]["status"] == "ok" else None
    for entry in ok:
        entry["vs_first"] = compare(entry, first) if first is not None else None
        entry["vs_ssgd_2bit"] = (compare(entry, two_bit)
                                 if two_bit is not None and two_bit is not entry else None)
    return {"target": target, "source": source,
            "first": entries[0]["backend"], "ssgd_2bit": two_bit["backend"] if two_bit else None}


def _ratio_cell(comparison):
    if comparison is None:
        return "-"
    exact = comparison["bound"] == "exact"
    ratio = f"{'' if exact else '<'}{comparison['time_ratio']:.2f}x"
    pct = comparison["less_time_pct"]
    # Not exact: the reference's true time to target is longer than its training time, so a
    # saving is a lower bound and an excess an upper bound.
    saving = (f"{'' if exact else '>='}{pct:.0f}% less" if pct >= 0
              else f"{'' if exact else '<='}{-pct:.0f}% more")
    return f"{ratio} ({saving})"


def print_table(entries, summary, args):
    ok = [e for e in entries if e["status"] == "ok"]
    if ok:
        r0 = ok[0]["result"]
        print(f"digits, MLP {r0['model']} ({r0['parameters']:,} parameters), batch "
              f"{args.batch_size} per rank, {args.np} ranks, {args.epochs} epochs of "
              f"{r0['steps_per_epoch']} steps, lr {args.lr:g}, torch threads per rank: "
              f"{args.threads}")
    if summary["target"] is None:
        print(f"target accuracy: {summary['source']}")
    else:
        print(f"target accuracy: {summary['target'] * 100:.2f} % ({summary['source']})")
    if ok and summary["target"] is not None:
        headers = ["backend", "final acc", "best acc", "train s", "steps/s", "MB/step/rank",
                   "time to target", f"vs {summary['first']}"]
        if summary["ssgd_2bit"]:
            headers.append(f"vs {summary['ssgd_2bit']}")
        rows = []
        for entry in ok:
            r, hit = entry["result"], entry["time_to_target"]
            row = [entry["backend"], f"{r['final_accuracy'] * 100:.2f}%",
                   f"{r['best_accuracy'] * 100:.2f}%", f"{r['train_s']:.1f}",
                   f"{r['steps_per_s']:.2f}" if r["steps_per_s"] else "-",
                   f"{r['communication']['bytes_per_step'] / 1e6:.3f}",
                   f"{hit['train_s']:.1f} s (ep {hit['epoch']})" if hit["reached"]
                   else "not reached", _ratio_cell(entry["vs_first"])]
            if summary["ssgd_2bit"]:
                row.append(_ratio_cell(entry["vs_ssgd_2bit"]))
            rows.append(row)
        print(common.format_table(headers, rows))
        for entry in ok:
            if entry["result"]["algorithm"] in ("ssgd", "ssgd-2bit") or not summary["ssgd_2bit"]:
                continue
            comparison = entry["vs_ssgd_2bit"]
            target = f"{summary['target'] * 100:.2f} %"
            if comparison is None:
                verdict = f"did not reach {target}"
            else:
                pct = comparison["less_time_pct"]
                bound = "" if comparison["bound"] == "exact" else "at least "
                verdict = (f"{bound}{pct:.1f}% less time" if pct >= 0
                           else f"{'' if bound == '' else 'at most '}{-pct:.1f}% more time")
                verdict += f" to reach {target}"
                if comparison["bound"] != "exact":
                    verdict += f" ({summary['ssgd_2bit']} never reached it)"
            print(f"{entry['backend']} vs {summary['ssgd_2bit']}: {verdict}")
    common.print_problems(entries)


def plot(entries, summary, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    ok = [e for e in entries if e["status"] == "ok"]
    fig, (time_ax, epoch_ax) = plt.subplots(1, 2, figsize=(13, 4.8))
    for entry in ok:
        curve = entry["result"]["curve"]
        accuracy = [p["accuracy"] * 100 for p in curve]
        time_ax.plot([p["train_s"] for p in curve], accuracy, marker="o", markersize=3,
                     label=entry["backend"])
        epoch_ax.plot([p["epoch"] for p in curve], accuracy, marker="o", markersize=3,
                      label=entry["backend"])
    for ax in (time_ax, epoch_ax):
        if summary["target"] is not None:
            ax.axhline(summary["target"] * 100, color="gray", linestyle="--", linewidth=1,
                       label="target")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        if ok:
            ax.legend(fontsize=8)
    time_ax.set_xlabel("training time (s, evaluation excluded)")
    epoch_ax.set_xlabel("epoch")
    epoch_ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    model = ok[0]["result"]["model"] if ok else f"hidden {args.hidden}"
    time_ax.set_title(f"digits, MLP {model}, {args.np} ranks: accuracy vs time")
    epoch_ax.set_title("accuracy vs epoch")
    fig.tight_layout()
    common.save_figure(fig, path)


def driver(args):
    try:
        backends = parse_backend_list(args.backends)
        check_options(args.options, [b.algorithm or "ssgd" for b in backends])
    except ValueError as err:
        sys.exit(f"error: {err}")
    entries = common.run_backends("convergence", backends, args, worker_argv)
    summary = analyze(entries, args)
    print_table(entries, summary, args)
    if args.out:
        document = common.report("convergence", args, entries)
        document["time_to_accuracy"] = summary
        common.write_json(args.out, document)
    if args.plot:
        plot(entries, summary, args, args.plot)
    return 1 if any(e["status"] == "failed" for e in entries) else 0


def main(argv=None):
    return common.main(parse_args, worker, driver, argv, needs=("scikit-learn",))  # the digits dataset


if __name__ == "__main__":
    sys.exit(main())
