"""FastHorovod's defaults against a grid of its settings and the raw-TCP ring ceiling.

On one network (``--launcher-prefix``, e.g. ``fasthorovodrun --emulate-cloud 4:1gbit:200mbit``), or
on each of ``--clouds`` in turn, one invocation measures at one message size (``--size``, default
64 MiB), ``--rounds`` times. Every round runs, in this order (so that drift in the machine hits every
configuration alike):

  1. **the ring ceiling** (``tcp-ring``): a job of the sweep's ranks (``--np``; by default one per
     emulated host, so HOSTS of each cloud spec, else 4) started by the same launcher;
     each rank finds its emulated host, the ranks exchange them, Horovod shuts down and rank 0 runs
     iperf3 with every host sending ``--ring-flows`` flows to the next one at once
     (``fasthorovod.netem.check.measure_ring``, what ``python -m fasthorovod.netem check --ring``
     measures on a cloud of its own). The goodput each host receives is what raw TCP carries in a
     ring allreduce's traffic pattern on this network and these CPUs; the ceiling is its mean over
     the hosts (the minimum is kept too). Outside an emulated cloud this job is skipped;
  2. **FastHorovod's defaults** (``fasthorovod``): no FASTHOROVOD_* variable set, so the number of
     lanes, the sockets per lane (chosen by the start-up probe) and the threshold are its own;
  3. **the grid** (``fasthorovod:KxS``): FASTHOROVOD_NUM_LANES=K and
     FASTHOROVOD_SOCKETS_PER_LANE=S for every cell of ``--grid`` (default K in 1, 2, 4, 8 by
     S in 1, 2, 4);
  4. ``--peers``, if any (e.g. ``horovod``).

Each allreduce job is ``allreduce.py``'s worker at the one size (verified results, the slowest
rank's latency per iteration, the median over ``--iters``). Per configuration the report takes the
median over the rounds of those medians and gives it as bus bandwidth, with every round's own;
then defaults / best grid cell and defaults / ceiling. The data plane each FastHorovod job ran with
(lanes x sockets, and whether S came from the probe) is recorded and printed.

    python benchmarks/sweep.py --clouds 4:1gbit:200mbit 3:1gbit:100mbit --rounds 3
"""
import argparse
import os
import re
import shlex
import sys
import tempfile
import time

import _common as common
import allreduce

RING = common.RING  # the ceiling job (_common.ring_worker), as in allreduce.py --ceiling
DEFAULTS = "fasthorovod"  # FastHorovod, no FASTHOROVOD_* variable set
DEFAULT_NP = 4  # ranks on a network that is not an emulated cloud spec (loopback)
DEFAULT_GRID = ",".join(f"{k}x{s}" for k in (1, 2, 4, 8) for s in (1, 2, 4))


def parse_grid(text):
    """'1x1,2x2' -> [(1, 1), (2, 2)]: lanes x sockets per lane, each a positive integer."""
    cells = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", item)
        if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
            raise argparse.ArgumentTypeError(f"bad grid cell {item!r}: use KxS, e.g. 4x2 (4 proxies, "
                                             "2 sockets each)")
        cell = (int(match.group(1)), int(match.group(2)))
        if cell in cells:
            raise argparse.ArgumentTypeError(f"grid cell {item.strip()} given twice")
        cells.append(cell)
    return cells


def parse_message_size(text):
    size = common.parse_size(text)
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError("the size must be a positive multiple of 4 bytes")
    return size


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="On each network, at one allreduce size: the raw-TCP ring ceiling, FastHorovod "
                    "with its defaults, a grid of lanes x sockets per lane and optional peers, "
                    "interleaved over --rounds. Prints a table per network (median bus bandwidth "
                    "per configuration, every round's, defaults / best grid cell, defaults / "
                    "ceiling) and writes JSON.")
    parser.add_argument("--clouds", nargs="+", metavar="HOSTS:LINK:PER_FLOW",
                        help="run the whole sweep on each of these emulated clouds in turn, e.g. "
                             "4:1gbit:200mbit 3:1gbit:100mbit: the launcher is --launcher-prefix "
                             "(default: fasthorovodrun) followed by --emulate-cloud SPEC, with one "
                             "rank per emulated host unless --np is given. Without it, one sweep on "
                             "the network of --launcher-prefix (ranks: --np, else the HOSTS of its "
                             "--emulate-cloud, else 4)")
    parser.add_argument("--size", type=parse_message_size, default="64MiB",
                        help="allreduce size, a multiple of 4 bytes; below FastHorovod's threshold "
                             "(1 MiB across hosts) every configuration would go through Horovod "
                             "(default: %(default)s)")
    parser.add_argument("--grid", type=parse_grid, default=DEFAULT_GRID, metavar="KxS,...",
                        help="the cells: K lanes x S sockets per lane (FASTHOROVOD_NUM_LANES, "
                             "FASTHOROVOD_SOCKETS_PER_LANE) (default: %(default)s)")
    parser.add_argument("--peers", default="",
                        help="comma-separated allreduce.py backends run after the grid in every "
                             "round, e.g. horovod (default: none)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times the whole list (ceiling, defaults, grid, peers) runs in turn "
                             "(default: %(default)s)")
    parser.add_argument("--iters", type=int, default=5,
                        help="timed allreduces per job (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed allreduces before them (default: %(default)s)")
    parser.add_argument("--no-ring", dest="ring", action="store_false",
                        help="do not measure the ring ceiling")
    common.add_ring_arguments(parser)
    common.add_driver_arguments(parser)
    common.add_worker_arguments(parser)
    parser.set_defaults(np=None, out="results/sweep.json")
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if (min(args.rounds, args.iters, 1 if args.np is None else args.np, args.ring_flows or 1) < 1
            or args.warmup < 0 or args.ring_seconds <= 0):
        parser.error("need --rounds, --iters, --np, --ring-flows >= 1, --warmup >= 0 and --ring-seconds > 0")
    if args.clouds and args.launcher_prefix and any(a.startswith("--emulate-cloud") for a in args.launcher_prefix):
        parser.error("--clouds adds --emulate-cloud to the launcher prefix; leave it out of --launcher-prefix")
    try:
        args.peers = [b.spec for b in common.parse_backends(args.peers)]
    except ValueError as err:
        parser.error(str(err))
    return args


# --------------------------------------------------------------------------------------------
# Worker: the ring ceiling (_common.ring_worker; the allreduce jobs run allreduce.py's worker)


def worker(args):
    if args.backend != RING:
        raise SystemExit(f"sweep.py --worker runs the {RING} job only, not {args.backend!r}")
    common.ring_worker(args)


# --------------------------------------------------------------------------------------------
# Driver


def networks(args):
    """[(label, launcher prefix, ranks)]: one per --clouds spec, else the --launcher-prefix network.
    Ranks: --np, else one per emulated host (HOSTS of the spec), else DEFAULT_NP."""
    if args.clouds:
        base = args.launcher_prefix or ["fasthorovodrun"]
        nets = [(spec, base + ["--emulate-cloud", spec]) for spec in args.clouds]
    else:
        nets = [(network_label(args.launcher_prefix), args.launcher_prefix)]
    return [(label, prefix, args.np or cloud_hosts(label) or DEFAULT_NP) for label, prefix in nets]


def cloud_hosts(label):
    """HOSTS of a 'HOSTS:LINK:PER_FLOW[,hostI=...]' cloud spec, else None."""
    match = re.match(r"(\d+):[^:\s]+:\S+$", label)
    return int(match.group(1)) if match else None


def network_label(prefix):
    """The --emulate-cloud spec of a launcher prefix, 'loopback' without a prefix, else the prefix."""
    if not prefix:
        return "loopback"
    for index, arg in enumerate(prefix):
        if arg == "--emulate-cloud" and index + 1 < len(prefix):
            return prefix[index + 1]
        if arg.startswith("--emulate-cloud="):
            return arg.split("=", 1)[1]
    return shlex.join(prefix)


def round_plan(grid, peers, ring=True):
    """The labels of one round's jobs, in order: ceiling, defaults, grid, peers."""
    return ([RING] if ring else []) + [DEFAULTS] + [f"fasthorovod:{k}x{s}" for k, s in grid] + list(peers)


def run_order(plan, rounds):
    """(round, label) of every job of the sweep on one network, in the order they run."""
    return common.interleave(plan, rounds)


def allreduce_settings(args):
    """What allreduce.py's worker_argv needs: one size, an allreduce, Sum, no batching."""
    return argparse.Namespace(sizes=[args.size], iters=args.iters, warmup=args.warmup, op="sum",
                              collective="allreduce", threads=args.threads, batch=1)


def busbw(entry):
    """The bus bandwidth (Gbit/s) of an ok allreduce entry at its one size."""
    return entry["result"]["results"][0]["busbw_gbps"]


def job_line(entry):
    if entry["status"] != "ok":
        return f"{entry['backend']}: {entry['status']}: {entry['reason']}"
    result = entry["result"]
    if entry["backend"] == RING:
        return f"{RING}: {common.ring_line(entry)}"
    line = f"{entry['backend']}: {busbw(entry):.3f} Gbit/s ({result['results'][0]['median_s'] * 1e3:.1f} ms)"
    if result.get("data_plane"):
        line += f", data plane {common.data_plane_label(result['data_plane'])}"
    return line


def network_args(args, prefix, np_):
    """The driver's options as one network's jobs see them: its launcher, ranks and threads."""
    net_args = argparse.Namespace(**vars(args))
    net_args.launcher_prefix, net_args.np = prefix, np_
    if net_args.threads is None:
        net_args.threads = common.default_threads(np_)
    return net_args


def run_network(label, net_args, plan, scratch):
    """Every round on one network; the rounds' entries (lists in plan order)."""
    args = net_args
    settings = allreduce_settings(args)
    rounds = [[] for _ in range(args.rounds)]
    for number, spec in run_order(plan, args.rounds):
        if not rounds[number - 1]:
            print(f"== {label}: round {number}/{args.rounds}", file=sys.stderr, flush=True)
        result_file = os.path.join(scratch, f"{number}-{len(rounds[number - 1])}.json")
        if spec == RING:
            entry = common.run_backend(common.RING_BACKEND, args.np, common.ring_worker_argv(__file__, args),
                                       result_file, args)
        else:
            backend = common.parse_backend(spec)
            entry = common.run_backend(backend, args.np, allreduce.worker_argv(backend, settings),
                                       result_file, args)
        rounds[number - 1].append(entry)
        print(f"[{label} round {number}/{args.rounds}] {job_line(entry)}", flush=True)
    return rounds


merge_ring = common.merge_ring


def ratio(a, b):
    return a / b if a is not None and b else None


def summarize(configs, ceiling, grid_labels):
    """Defaults against the best grid cell and against the ceiling (None where one is missing)."""
    rates = {e["backend"]: busbw(e) for e in configs if e["status"] == "ok"}
    defaults = rates.get(DEFAULTS)
    grid = {label: rates[label] for label in grid_labels if label in rates}
    best = max(grid, key=grid.get) if grid else None
    ceiling_gbps = ceiling.get("mean_gbps") if ceiling else None
    return {"defaults_gbps": defaults, "best_grid": best, "best_grid_gbps": grid.get(best),
            "ceiling_gbps": ceiling_gbps,
            "defaults_over_best_grid": ratio(defaults, grid.get(best)),
            "defaults_over_ceiling": ratio(defaults, ceiling_gbps),
            "best_grid_over_ceiling": ratio(grid.get(best), ceiling_gbps)}


def round_rates(entry, np_):
    """Bus bandwidth of every round of a merged allreduce entry."""
    result = entry["result"]["results"][0]
    return [allreduce.bus_bandwidth_gbps(result["bytes"], t, np_) for t in result["round_medians_s"]]


def planes(entry):
    """The data planes the rounds of a merged entry ran with ('4x2 (probe)'; several if they differ)."""
    labels = [common.data_plane_label(e["result"].get("data_plane")) for e in entry.get("rounds", [entry])
              if e["status"] == "ok"]
    return " / ".join(dict.fromkeys(labels)) or "-"


def fmt(value, digits=3, suffix=""):
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def print_network(network, args):
    ceiling, summary = network["ceiling"], network["summary"]
    print(f"\n{network['network']}: {common.format_size(args.size)} allreduce, {network['np']} ranks, "
          f"median of {args.rounds} round{'s' if args.rounds != 1 else ''}")
    if ceiling["status"] == "ok":
        print(f"ring ceiling ({RING}, iperf3, {ceiling['flows']} flows from every host to the next at once): "
              f"{ceiling['mean_gbps']:.3f} Gbit/s per host (min {ceiling['min_gbps']:.3f}); rounds "
              + " ".join(f"{v:.3f}" for v in ceiling["round_mean_gbps"]))
    else:
        print(f"ring ceiling: {ceiling['status']}: {ceiling['reason']}")
    rows = []
    for entry in network["configs"]:
        if entry["status"] != "ok":
            rows.append([entry["backend"], "-", entry["status"], "-", "-", "-"])
            continue
        rows.append([entry["backend"], planes(entry), f"{busbw(entry):.3f}",
                     f"{entry['result']['results'][0]['median_s'] * 1e3:.1f}",
                     fmt(ratio(busbw(entry), summary["ceiling_gbps"]), 2),
                     " ".join(f"{v:.3f}" for v in round_rates(entry, entry["result"]["np"]))])
    print(common.format_table(["config", "data plane", "busbw Gbit/s", "ms", "x ceiling", "rounds Gbit/s"],
                              rows))
    if summary["best_grid"]:
        print(f"defaults / best grid cell ({summary['best_grid']}, {summary['best_grid_gbps']:.3f} Gbit/s): "
              f"{fmt(summary['defaults_over_best_grid'], 2, 'x')}")
    print(f"defaults / ceiling: {fmt(summary['defaults_over_ceiling'], 2, 'x')}")
    common.print_problems(network["configs"])


def plot(result_networks, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(result_networks), figsize=(6 * len(result_networks), 5), squeeze=False)
    for ax, network in zip(axes[0], result_networks):
        ok = [e for e in network["configs"] if e["status"] == "ok"]
        colors = ["tab:green" if e["backend"] == DEFAULTS else "tab:blue"
                  if e["backend"].startswith("fasthorovod:") else "tab:gray" for e in ok]
        ax.barh([e["backend"] for e in ok], [busbw(e) for e in ok], color=colors)
        ceiling = network["summary"]["ceiling_gbps"]
        if ceiling:
            ax.axvline(ceiling, color="tab:red", linestyle="--", label=f"ring ceiling {ceiling:.2f}")
            ax.legend(loc="lower right")
        ax.invert_yaxis()
        ax.set_xlabel("bus bandwidth (Gbit/s), median of the rounds")
        ax.set_title(f"{network['network']}, {common.format_size(args.size)}, {network['np']} ranks")
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    common.save_figure(fig, path)


def driver(args):
    common.warn_inherited_fasthorovod_env()
    plan = round_plan(args.grid, args.peers, args.ring)
    grid_labels = round_plan(args.grid, [], ring=False)[1:]
    results = []
    with tempfile.TemporaryDirectory(prefix="fasthorovod-sweep-") as scratch:
        for index, (label, prefix, np_) in enumerate(networks(args)):
            directory = os.path.join(scratch, str(index))
            os.makedirs(directory)
            start = time.monotonic()
            rounds = run_network(label, network_args(args, prefix, np_), plan, directory)
            ring = [e for r in rounds for e in r if e["backend"] == RING]
            configs = allreduce.merge_rounds([[e for e in r if e["backend"] != RING] for r in rounds])
            ceiling = merge_ring(ring)
            network = {"network": label, "launcher_prefix": prefix, "np": np_,
                       "threads": network_args(args, prefix, np_).threads, "plan": plan, "ceiling": ceiling,
                       "configs": configs, "summary": summarize(configs, ceiling, grid_labels),
                       "seconds": round(time.monotonic() - start, 1)}
            results.append(network)
            print_network(network, args)
            print(f"{label}: {len(plan) * args.rounds} jobs in {network['seconds']:.0f} s")
            if args.out:  # after every network, so a long sweep keeps what it measured
                doc = common.report("sweep", args, [])
                del doc["backends"]
                doc["networks"] = results
                common.write_json(args.out, doc)
    if args.plot:
        plot(results, args, args.plot)
    failed = any(e["status"] == "failed" for n in results for e in n["configs"] + n["ceiling"]["rounds"])
    return 1 if failed else 0


def main(argv=None):
    return common.main(parse_args, worker, driver, argv)


if __name__ == "__main__":
    sys.exit(main())
