"""Foreign connections during ring set-up are rejected without disturbing the job.

Rank 0 of a real loopback ring (threads, the proxies' own set-up code) is first contacted by
strangers; set-up must reject each one, connect the real neighbour, and the allreduce must still
be exact.
"""
import os
import time

import numpy as np
import torch

from fasthorovod import _C_testing
from fasthorovod.proxy.group import DTYPE_CODES

JOB_TOKEN = bytes([7]) * 16  # the token the loopback test helper uses


def _run(ranks, strangers, capfd=None):
    inputs = [np.full(10_000, r + 1, dtype=np.float32) for r in range(ranks)]
    _C_testing._loopback_allreduce(inputs, DTYPE_CODES[torch.float32], segment_bytes=4096, strangers=strangers,
                           timeout_seconds=30)
    for buf in inputs:
        np.testing.assert_array_equal(buf, np.full(10_000, ranks * (ranks + 1) / 2, dtype=np.float32))


def test_strangers_are_rejected_and_the_ring_still_works(capfd):
    ranks = 3
    prev = ranks - 1  # rank 0 accepts from rank 2
    strangers = [
        os.urandom(64),                                          # random bytes
        _C_testing._hello(JOB_TOKEN, prev, ranks, 0, 0, 0)[:20],         # truncated handshake
        _C_testing._hello(os.urandom(16), prev, ranks, 0, 0, 0),         # another job's valid-looking hello
        _C_testing._hello(JOB_TOKEN, 1, ranks, 0, 0, 0),                 # right job, wrong rank
        _C_testing._hello(JOB_TOKEN, prev, ranks, 5, 0, 0),              # wrong lane
        _C_testing._hello(JOB_TOKEN, prev, ranks, 0, 0, 1234),           # different configuration
    ]
    _run(ranks, strangers)
    err = capfd.readouterr().err
    for reason in ["not a FastHorovod proxy", "job token differs", "expected previous rank 2", "lane 5 != lane 0", "configuration differs"]:
        assert reason in err, err
    # One log line per rejected handshake; the truncated one just times out silently.
    assert err.count("rejected a connection") == 5


def test_a_silent_connection_cannot_stall_setup_for_long():
    start = time.monotonic()
    _run(2, [b"", b""])  # slow-loris: connect and say nothing
    assert time.monotonic() - start < 10  # each silent stranger costs at most its 2 s hello deadline
