"""Soak run of the proxy data plane: many verified allreduces, then a leak check.

Runs ``tests/workers/worker.py soak`` as N Horovod ranks (horovodrun --gloo): COUNT allreduces of
log-uniform random sizes (1 B to MAX_BYTES), random dtypes (fp32, fp64, int32, int64, fp16, uint8)
and ops (Sum, Average), 1 to 4 in flight at a time, every result compared with its exact value on
every rank, the last ones in flight included. Each rank reports how many results it compared and
how many differed (counted, not assumed) and its file-descriptor and RSS figures from 10%
of the run to the end (fds may grow by at most 2, RSS by less than 512 MiB); after the job no
proxy process and no shared-memory segment may be left.

    python benchmarks/soak.py                      # the reliability issue's 10,000 over 3 ranks
    python benchmarks/soak.py --count 1000 --max-bytes 16MiB --out soak.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import _common as common

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for the test harness
from tests.multiproc.harness import run_job  # noqa: E402

# Freed tensors of up to 32 MiB may stay in glibc's heap (its mmap threshold adapts upwards), so
# RSS moves by tens of MiB; a leak of the 64 MiB tensors would grow it by gigabytes.
RSS_GROWTH_LIMIT_MIB = 512
SOAK_LINE = re.compile(r"SOAK rank (\d+): (\d+) allreduces verified, (\d+) mismatches; fds (\d+)->(\d+), "
                       r"rss (\d+)->(\d+) MiB")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--np", type=int, default=3, help="ranks")
    parser.add_argument("--count", type=int, default=10_000, help="allreduces per rank")
    parser.add_argument("--max-bytes", type=common.parse_size, default=64 << 20,
                        help="largest allreduce (e.g. 64MiB)")
    parser.add_argument("--lanes", "--proxies", type=int, default=2,
                        help="FASTHOROVOD_NUM_LANES (--proxies: its former name)")
    parser.add_argument("--proxy-threshold", type=common.parse_size, default=0,
                        help="FASTHOROVOD_PROXY_THRESHOLD_BYTES, bytes or e.g. 64KiB (0: every "
                             "allreduce uses the proxies)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the size/dtype/op sequence")
    parser.add_argument("--timeout", type=float, default=5400, help="seconds before the job is killed")
    parser.add_argument("--out", help="write the result as JSON here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = {"FASTHOROVOD_NUM_LANES": str(args.lanes),
           "FASTHOROVOD_PROXY_THRESHOLD_BYTES": str(args.proxy_threshold)}
    start = time.time()
    # A rank that saw a wrong result still prints its counts before it fails: report them, then fail.
    job = run_job(args.np, "soak", "--count", str(args.count), "--max-bytes", str(args.max_bytes),
                  "--seed", str(args.seed), env=env, timeout=args.timeout,
                  expect_success=False)  # raises on a timeout or leftovers
    seconds = time.time() - start
    ranks = [dict(zip(("rank", "verified", "mismatches", "fds_start", "fds_end", "rss_start_mib", "rss_end_mib"),
                      map(int, m.groups())))
             for m in SOAK_LINE.finditer(job.stdout)]
    ranks.sort(key=lambda r: r["rank"])
    ok = job.returncode == 0 and len(ranks) == args.np and all(r["verified"] == args.count and r["mismatches"] == 0
                                       and r["rss_end_mib"] - r["rss_start_mib"] < RSS_GROWTH_LIMIT_MIB
                                       for r in ranks)
    print(common.format_table(["rank", "verified", "mismatches", "fds (10% -> end)", "RSS MiB (10% -> end)"],
                              [[r["rank"], r["verified"], r["mismatches"], f"{r['fds_start']} -> {r['fds_end']}",
                                f"{r['rss_start_mib']} -> {r['rss_end_mib']}"] for r in ranks]))
    print(f"{args.np} ranks x {args.count} allreduces (1 B..{common.format_size(args.max_bytes)}) in {seconds:.0f} s; "
          f"no proxy or shared-memory segment left; job exit status {job.returncode}; {'PASS' if ok else 'FAIL'}")
    if not ok:
        print(job.stdout[-4000:], file=sys.stderr)
    if args.out:
        common.write_json(args.out, {"benchmark": "soak", "args": vars(args), "seconds": seconds, "ok": ok,
                                     "ranks": ranks, "machine": common.machine_info()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
