"""``fasthorovod-trace``: analyze a trace directory written with FASTHOROVOD_TRACE_DIR / hvd.start_trace."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

DESCRIPTION = """\
Analyze a FastHorovod communication trace (the DLC trace, docs/trace.md).

A trace directory holds rank<R>.worker.jsonl (training events of rank R) and rank<R>.lane<J>.bin
(one record per frame sent or received by proxy lane J of rank R). Capture one with
FASTHOROVOD_TRACE_DIR=DIR, or hvd.start_trace(DIR) ... hvd.stop_trace()."""

ANALYZE_EPILOG = """\
statistics (per iteration s of rank r; definitions in docs/trace.md):
  iter      length of the iteration window (end of iteration s-1 to end of iteration s)
  comp      computation: forward/backward/compute spans (else the window minus wait and update)
  comm      communication: allreduces in flight, from post to their last frame
  P1/P2/P3  compute only / compute overlapping communication / communication only
  overlap   P2 / (P1 + P2 + P3)  (= SketchDLC's P2 / (P1 + P3); its phase 3 includes P2)
  hidden    P2 / (P2 + P3): share of communication hidden behind computation
  update    optimizer update spans;  wait: time blocked waiting for allreduces
  sync      per collective, last rank's post minus first rank's post; mean over the iteration
lanes and connections: payload bytes sent / busy time; imbalance = max / min throughput."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fasthorovod-trace", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    a = sub.add_parser("analyze", help="print per-iteration and summary statistics; optionally plot/export",
                       description="Print per-iteration and summary statistics of trace directory DIR.",
                       epilog=ANALYZE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("dir", metavar="DIR", help="trace directory (FASTHOROVOD_TRACE_DIR of the run)")
    a.add_argument("--json", action="store_true",
                   help="print the full result as one JSON object on stdout instead of the table")
    a.add_argument("--plot", metavar="FILE.png",
                   help="write a PNG: timeline of a few iterations (per rank: compute, allreduces, wait/update, "
                        "one row per proxy lane) and histograms (frame sizes, lane throughput, phases per iteration)")
    a.add_argument("--chrome", metavar="FILE.json",
                   help="write a Chrome trace (chrome://tracing, ui.perfetto.dev): one process per rank with a "
                        "worker track, an allreduce track and one track per proxy lane, socket and direction")
    a.add_argument("--skip", type=int, default=0, metavar="N",
                   help="leave the first N iterations (warm-up) out of the summary (default: 0)")
    a.add_argument("--per-rank", action="store_true", help="also print one row per rank and iteration")
    a.add_argument("--plot-steps", type=int, default=3, metavar="K",
                   help="iterations shown in the --plot timeline, from the first one after --skip (default: 3)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from fasthorovod.trace.analyze import Loaded, analyze, format_table
    from fasthorovod.trace.format import TraceFormatError

    if args.skip < 0 or args.plot_steps < 1:
        print("fasthorovod-trace: --skip must be >= 0 and --plot-steps >= 1", file=sys.stderr)
        return 2
    try:
        loaded = Loaded(args.dir)
    except (FileNotFoundError, TraceFormatError) as e:
        print(f"fasthorovod-trace: {e}", file=sys.stderr)
        return 1
    result = analyze(loaded, skip=args.skip)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_table(result, per_rank=args.per_rank))
    # Everything that needs no optional package first: a missing one (--plot: matplotlib) costs
    # only its own output, reported in one line with the pip command, and the exit status.
    if args.chrome:
        from fasthorovod.trace.chrome import write_chrome

        n = write_chrome(loaded, args.chrome)
        print(f"wrote {args.chrome} ({n} events)", file=sys.stderr)
    if args.plot:
        from fasthorovod.extras import MissingExtraError, require

        try:
            require("matplotlib", "plot", "--plot")
        except MissingExtraError as e:
            print(f"fasthorovod-trace: {e}", file=sys.stderr)
            return 1
        from fasthorovod.trace.plot import plot

        plot(loaded, result, args.plot, steps=args.plot_steps)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
