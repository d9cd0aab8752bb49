"""A rank of the job that holds the token but breaks the negotiation protocol, run by
tests/multiproc/test_hostile.py as Horovod ranks.

Rank HOSTILE's data plane starts as usual (its proxies join the rings), but in place of its
negotiation member it connects to the coordinator with fasthorovod_testing._hostile_member: it proves the
job token, then sends the frames of one variant (an oversized length field, a collective of 2^61
elements, a lane weight that is not a number, a frame cut short and then silence, random bytes). The
other ranks run an allreduce through the proxies; each must raise FastHorovodError naming the
hostile rank and the field, within FASTHOROVOD_TIMEOUT_SECONDS, and its resident memory must not
grow by what the frames claim. Between variants the ranks restart the data plane
(hvd.restart_proxies(); Horovod keeps running). Rank 0 prints one HOSTILE line per variant.
"""
import argparse
import os
import random
import struct
import sys
import time

import psutil
import torch

import fasthorovod.torch as hvd
import fasthorovod_testing
from fasthorovod.proxy import group as group_module

HOSTILE = 1
MAGIC = 0x464E4731  # "FNG1" (csrc/negotiation/wire.h)
ANNOUNCE = 2
WEIGHTS = 9
LANES = 2  # FASTHOROVOD_NUM_LANES of the job (tests/multiproc/test_hostile.py)


def frame(msg_type: int, payload: bytes, length=None) -> bytes:
    return struct.pack("<III", MAGIC, msg_type, len(payload) if length is None else length) + payload


def text(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def weights(values) -> bytes:
    """A kWeights frame: this rank's lane weights (u32 count, f64 each)."""
    return frame(WEIGHTS, struct.pack("<I", len(values)) + b"".join(struct.pack("<d", w) for w in values))


def announcement(name: str, count: int) -> bytes:
    """The equal lane weights a member's start-up sends, then one kAnnounce entry with a full
    description (WireWriter::Desc)."""
    desc = (text(name) + text(str(count)) + struct.pack("<IIQQQdd", 7, 0, count, 1, 2, 1.0, 1.0))  # float32, sum
    return weights([1.0] * LANES) + frame(ANNOUNCE, struct.pack("<I", 1) + b"\x00" + desc)


# variant -> (the hostile bytes, what every honest rank's error must contain)
VARIANTS = {
    "length": (frame(ANNOUNCE, b"", length=0xFFFFFFFF), "too large (length field 4294967295 bytes"),
    "count": (announcement("evil", 1 << 61), "with count 2305843009213693952"),
    "weights": (weights([1.0, float("nan")]), "sent lane weights with entry 1 = nan"),
    "truncated": (frame(ANNOUNCE, b"\x01" * 10, length=60 << 20), "cut short after 0 of 62914560 payload bytes"),
    "random": (bytes(random.Random(15).randrange(256) for _ in range(4096)), "bad magic"),
}


class HostileMember:
    """Stands in for _C.Member on the hostile rank: sends the variant's bytes, then stays silent."""
    payload = b""

    def __init__(self, channel, options) -> None:
        self.fd = fasthorovod_testing._hostile_member(options.coordinator_host, options.coordinator_port, options.token,
                                             options.rank, options.size, HostileMember.payload)

    def number_tickets_from(self, first: int) -> None:
        pass

    def holds(self, name: str) -> bool:  # it submits nothing: no name is in flight
        return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def honest_rank(variant: str, timeout: float) -> dict:
    x = torch.ones(1 << 20)  # 4 MiB: through the proxies
    proc = psutil.Process()
    rss = proc.memory_info().rss
    start = time.monotonic()
    try:
        hvd.allreduce(x, op=hvd.Sum, name=f"victim.{variant}")
        error = None
    except hvd.FastHorovodError as e:
        error = e
    took = time.monotonic() - start
    return {"rank": hvd.rank(), "error": None if error is None else f"{type(error).__name__}: {error}",
            "seconds": took, "rss_growth_mib": (proc.memory_info().rss - rss) / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    timeout = float(os.environ["FASTHOROVOD_TIMEOUT_SECONDS"])
    rank = int(os.environ["HOROVOD_RANK"])
    real_member = group_module._C.Member
    variants = args.variants.split(",")
    hvd.init()
    try:
        for variant in variants:
            payload, field = VARIANTS[variant]
            if rank == HOSTILE:
                HostileMember.payload = payload
                group_module._C.Member = HostileMember
            hvd.restart_proxies()  # a fresh data plane, with the hostile member on rank HOSTILE
            report = {"rank": rank, "error": None} if rank == HOSTILE else honest_rank(variant, timeout)
            reports = hvd.allgather_object(report, name=f"hostile.report.{variant}")
            group_module._C.Member = real_member
            honest = [r for r in reports if r["rank"] != HOSTILE]
            for r in honest:
                assert r["error"] is not None, f"{variant}: rank {r['rank']} did not raise: {r}"
                assert r["error"].startswith("FastHorovodError: "), f"{variant}: {r}"  # a peer's failure
                assert f"rank {HOSTILE}" in r["error"] and field in r["error"], f"{variant}: {r}"
                assert r["seconds"] <= 2 * timeout, f"{variant}: rank {r['rank']} raised after {r['seconds']:.1f} s"
                assert r["rss_growth_mib"] < 32, f"{variant}: RSS grew {r['rss_growth_mib']:.0f} MiB: {r}"
            if rank == 0:
                print(f"HOSTILE {variant}: every honest rank raised within "
                      f"{max(r['seconds'] for r in honest):.2f} s, RSS growth <= "
                      f"{max(r['rss_growth_mib'] for r in honest):.1f} MiB; rank 0: {honest[0]['error'][:400]}",
                      flush=True)
        hvd.restart_proxies()  # and the job still works afterwards
        out = hvd.allreduce(torch.ones(1 << 20), op=hvd.Sum, name="after.hostile")
        assert torch.all(out == hvd.size())
        if rank == 0:
            print(f"HOSTILE done: {len(variants)} variants", flush=True)
    finally:
        hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
