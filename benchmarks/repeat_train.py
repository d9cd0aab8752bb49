"""Run the same training job N times: do identical jobs run at the same pace?

Each job is one ``train.py`` job (its workers, its measurement: synthetic data, the slowest rank's
median step time, images/s, bitwise-identical weights checked at the end), started the way
``train.py`` starts it, one after another:

  * ``--jobs`` jobs of ``--backend`` (default ``fasthorovod``, spelled without a count: no
    FASTHOROVOD_* variable is set, so FastHorovod runs with its defaults);
  * with ``--peer-every P`` (default 5; 0 for none), one job of ``--peer`` (default ``horovod``)
    after every block of up to P of them, so that drift in the machine hits both alike:
    10 jobs, P = 5 -> F F F F F H F F F F F H.

It prints each job as it ends (``job 3/12 fasthorovod: 12.34 images/s ...``) and then the
summary: images/s of every job of the backend, their min, median and max, slowest/fastest (min /
max images/s: 1.00 means every job ran at the same pace), the peer's median and the ratio of the
medians. The JSON (``--out``) holds every job's full train.py result (per-step times, the data
plane FastHorovod ran with), the run order and the summary. The compute-only phase of train.py is
skipped by default (``--compute-steps 0``) to keep the run short.

    python benchmarks/repeat_train.py --launcher-prefix ".venv/bin/fasthorovodrun --emulate-cloud 4:1gbit:200mbit"
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import _common as common
import train


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Runs one training job (train.py's workers) --jobs times, a peer job after "
                    "every --peer-every of them, and reports each job's images/s and how far apart "
                    "they are (min, median, max, slowest/fastest, median vs the peer).")
    parser.add_argument("--jobs", type=int, default=10,
                        help="jobs of --backend (default: %(default)s)")
    parser.add_argument("--backend", default="fasthorovod",
                        help="the job repeated: fasthorovod (FastHorovod's defaults: no FASTHOROVOD_* "
                             "variable set), fasthorovod:K[xS][:ALGORITHM], horovod, horovod-mpi "
                             "(default: %(default)s)")
    parser.add_argument("--peer", default="horovod",
                        help="the backend of the interleaved peer jobs (default: %(default)s)")
    parser.add_argument("--peer-every", type=int, default=5, metavar="P",
                        help="one --peer job after every block of up to P jobs of --backend; 0: no "
                             "peer jobs (default: %(default)s)")
    train.add_workload_arguments(parser)
    common.add_driver_arguments(parser)
    parser.set_defaults(np=4, steps=5, warmup_steps=2, compute_steps=0, out="results/repeat_train.json")
    args = parser.parse_args(argv)
    train.check_workload_arguments(parser, args)
    if args.jobs < 1 or args.peer_every < 0:
        parser.error("need --jobs >= 1 and --peer-every >= 0")
    try:
        backends(args)
    except ValueError as err:
        parser.error(str(err))
    return args


def backends(args):
    """(the repeated backend, the peer backend) as parsed specs."""
    return (common.parse_backend(args.backend, train.KINDS, with_algorithm=True),
            common.parse_backend(args.peer, train.KINDS, with_algorithm=True))


def job_order(jobs, peer_every):
    """Roles in run order: ``jobs`` times "main", and "peer" after every block of up to
    ``peer_every`` of them (none when 0)."""
    order = []
    for index in range(1, jobs + 1):
        order.append("main")
        if peer_every and (index % peer_every == 0 or index == jobs):
            order.append("peer")
    return order


def spread(values):
    """min, median, max and slowest/fastest (min / max) of a list of rates; None when empty."""
    if not values:
        return None
    return {"n": len(values), "images_per_s": list(values), "min": min(values),
            "median": statistics.median(values), "max": max(values),
            "slowest_over_fastest": min(values) / max(values)}


def summarize(entries):
    """The summary of the jobs that ran (failed or skipped jobs are counted, not measured)."""
    def rates(role):
        return [e["result"]["images_per_s"] for e in entries if e["role"] == role and e["status"] == "ok"]

    main, peer = spread(rates("main")), spread(rates("peer"))
    return {"main": main, "peer": peer,
            "median_ratio_vs_peer": main["median"] / peer["median"] if main and peer else None,
            "not_ok": [{"job": e["job"], "role": e["role"], "status": e["status"], "reason": e["reason"]}
                       for e in entries if e["status"] != "ok"]}


def job_line(entry, total, units="images/s"):
    head = f"job {entry['job']}/{total} {entry['backend']}{' (peer)' if entry['role'] == 'peer' else ''}:"
    if entry["status"] != "ok":
        return f"{head} {entry['status']}: {entry['reason']}"
    result = entry["result"]
    line = f"{head} {result['images_per_s']:.2f} {units}, {result['step_s']:.2f} s/step"
    if result.get("data_plane"):
        line += f", data plane {common.data_plane_label(result['data_plane'])}"
    return line + f" ({entry['seconds']:g} s)"


def jobs(count):
    return f"{count} job" + ("s" if count != 1 else "")


def print_summary(entries, summary, args):
    total = len(entries)
    print(f"\n{args.model}, {train.workload(args)}, batch {args.batch_size} per rank, {args.np} ranks, "
          f"{args.warmup_steps} untimed + {args.steps} timed steps per job")
    rows = [[e["job"], e["backend"] + (" (peer)" if e["role"] == "peer" else ""),
             f"{e['result']['images_per_s']:.2f}" if e["status"] == "ok" else e["status"],
             f"{e['result']['step_s']:.3f}" if e["status"] == "ok" else "-",
             common.data_plane_label(e["result"].get("data_plane")) if e["status"] == "ok" else "-"]
            for e in entries]
    print(common.format_table(["job", "backend", train.unit(args), "s/step", "data plane"], rows))
    main, peer = summary["main"], summary["peer"]
    if main:
        print(f"{args.backend}: {jobs(main['n'])}: " + " ".join(f"{v:.2f}" for v in main["images_per_s"])
              + " images/s")
        print(f"  min {main['min']:.2f}  median {main['median']:.2f}  max {main['max']:.2f}  "
              f"slowest/fastest {main['slowest_over_fastest']:.2f}")
    if peer:
        print(f"{args.peer} (peer): {jobs(peer['n'])}: " + " ".join(f"{v:.2f}" for v in peer["images_per_s"])
              + f" images/s, median {peer['median']:.2f}")
    if summary["median_ratio_vs_peer"] is not None:
        print(f"median {args.backend} / median {args.peer}: {summary['median_ratio_vs_peer']:.2f}x")
    if summary["not_ok"]:
        print(f"{len(summary['not_ok'])} of {total} jobs did not give a result:")
        for bad in summary["not_ok"]:
            print(f"  job {bad['job']} ({bad['role']}): {bad['status']}: {bad['reason']}")


def plot(entries, summary, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for role, label, color in (("main", args.backend, "tab:blue"), ("peer", f"{args.peer} (peer)", "tab:orange")):
        ok = [e for e in entries if e["role"] == role and e["status"] == "ok"]
        if ok:
            ax.scatter([e["job"] for e in ok], [e["result"]["images_per_s"] for e in ok], color=color,
                       label=label)
        if summary[role]:
            ax.axhline(summary[role]["median"], color=color, linestyle="--", alpha=0.6)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("job (run order)")
    ax.set_ylabel("images/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{args.model} {args.image_size}px, batch {args.batch_size}/rank, {args.np} ranks: "
                 "identical jobs (dashed: medians)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    common.save_figure(fig, path)


def driver(args):
    common.warn_inherited_fasthorovod_env()
    start = time.monotonic()
    order = job_order(args.jobs, args.peer_every)
    main_backend, peer_backend = backends(args)
    trace_root = args.trace_root or "traces"
    entries, counts = [], {"main": 0, "peer": 0}
    with tempfile.TemporaryDirectory(prefix="fasthorovod-repeat-train-") as scratch:
        for index, role in enumerate(order, 1):
            backend = main_backend if role == "main" else peer_backend
            counts[role] += 1
            args.trace_root = os.path.join(trace_root, f"job{index}")  # each job's trace kept ('+trace')
            print(f"== job {index}/{len(order)}: {backend.spec}{' (peer)' if role == 'peer' else ''}",
                  file=sys.stderr, flush=True)
            entry = common.run_backend(backend, args.np, train.worker_argv(backend, args),
                                       os.path.join(scratch, f"{index}.json"), args, args.proxy_threshold)
            entry = dict(entry, job=index, role=role, repeat=counts[role])
            entries.append(entry)
            print(job_line(entry, len(order), train.unit(args)), flush=True)
    args.trace_root = trace_root
    summary = dict(summarize(entries), seconds=round(time.monotonic() - start, 1))
    print_summary(entries, summary, args)
    print(f"{len(order)} jobs in {summary['seconds']:.0f} s")
    if args.out:
        doc = common.report("repeat_train", args, entries)
        doc["args"]["backend"] = args.backend  # report() leaves out the workers' --backend
        doc.update(order=order, summary=summary)
        common.write_json(args.out, doc)
    if args.plot:
        plot(entries, summary, args, args.plot)
    return 1 if any(e["status"] == "failed" for e in entries) else 0


def main(argv=None):
    args = parse_args(argv)
    common.check_extras(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
