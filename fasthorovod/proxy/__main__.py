"""Entry point of one proxy process: ``python -m fasthorovod.proxy CHANNEL LANE``.

Started by :class:`fasthorovod.proxy.ProxyGroup`, never by hand; it runs the native loop with the
GIL released until the worker stops it or dies.
"""
import argparse
import sys

from fasthorovod import _C
from fasthorovod.exceptions import FastHorovodError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fasthorovod.proxy", description=__doc__)
    parser.add_argument("channel", help="name of the worker's shared-memory channel")
    parser.add_argument("lane", type=int, help="lane (proxy index) this process serves")
    args = parser.parse_args(argv)
    try:
        _C.run_proxy(args.channel, args.lane)
    except (FastHorovodError, ValueError) as e:
        print(f"[fasthorovod proxy lane {args.lane}] {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
