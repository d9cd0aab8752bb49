"""Entry point of one proxy process: ``python -m fasthorovod.proxy FD LANE``.

Started by :class:`fasthorovod.proxy.ProxyGroup`, never by hand: FD is the proxy's end of a socket
pair its worker created, on which the worker hands over the channel and every data buffer (memfd
descriptors). It runs the native loop with the GIL released until the worker stops it or dies.
"""
import argparse
import sys

from fasthorovod import _C
from fasthorovod.exceptions import FastHorovodError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fasthorovod.proxy", description=__doc__)
    parser.add_argument("fd", type=int, help="inherited socket on which the worker hands over shared memory")
    parser.add_argument("lane", type=int, help="lane (proxy index) this process serves")
    args = parser.parse_args(argv)
    try:
        _C.run_proxy(args.fd, args.lane)
    except (FastHorovodError, ValueError) as e:
        print(f"[fasthorovod proxy lane {args.lane}] {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
