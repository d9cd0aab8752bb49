"""Foreign connections during ring set-up are rejected without disturbing the job.

Rank 0 of a real loopback ring (threads, the proxies' own set-up code) is first contacted by
strangers; set-up must reject each one, connect the real neighbour, and the allreduce must still
be exact. The handshake is a mutual challenge-response over the job token (csrc/transport/socket.h):
a stranger without the token gets no reason, only a closed connection; a peer that proves the token
but is the wrong rank, lane or configuration is told why.
"""
import os
import time

import numpy as np
import torch

import fasthorovod_testing
from fasthorovod.proxy.core import DTYPE_CODES

JOB_TOKEN = bytes([7]) * 16  # the token the loopback test helper uses


def _run(ranks, strangers, impostors=()):
    inputs = [np.full(10_000, r + 1, dtype=np.float32) for r in range(ranks)]
    told = fasthorovod_testing._loopback_allreduce(inputs, DTYPE_CODES[torch.float32], segment_bytes=4096,
                                          strangers=strangers, timeout_seconds=30, impostors=list(impostors))
    for buf in inputs:
        np.testing.assert_array_equal(buf, np.full(10_000, ranks * (ranks + 1) / 2, dtype=np.float32))
    return told


def test_strangers_are_rejected_and_the_ring_still_works(capfd):
    ranks = 3
    prev = ranks - 1  # rank 0 accepts from rank 2
    hello = fasthorovod_testing._hello(prev, ranks, 0, 0, 0)
    assert JOB_TOKEN not in hello
    strangers = [
        os.urandom(64),                 # foreign bytes
        hello[:20],                     # truncated handshake
        hello + os.urandom(32),         # a well-formed Hello and a proof made up without the token
        b"",                            # silent
    ]
    _run(ranks, strangers)
    err = capfd.readouterr().err
    assert "not a FastHorovod peer" in err, err
    assert "job token differs" in err, err
    # One log line per refused handshake; the truncated and the silent ones just time out.
    assert err.count("rejected a connection") == 2, err


def test_only_peers_that_prove_the_token_learn_why_they_are_refused(capfd):
    ranks = 3
    prev = ranks - 1
    told = _run(ranks, [], impostors=[
        (os.urandom(16), prev, 0, 0, 0),  # another job's token, otherwise the right identity
        (JOB_TOKEN, 1, 0, 0, 0),          # right job, wrong rank
        (JOB_TOKEN, prev, 5, 0, 0),       # wrong lane
        (JOB_TOKEN, prev, 0, 0, 1234),    # different configuration
    ])
    assert "did not accept this connection's proof of the job token" in told[0], told
    assert "token differs" not in told[0] and "rejected our connection" not in told[0], told
    assert "expected previous rank 2" in told[1], told
    assert "lane 5 != lane 0" in told[2], told
    assert "configuration differs (FASTHOROVOD_* settings must be equal on every rank)" in told[3], told
    err = capfd.readouterr().err
    for reason in ["job token differs", "expected previous rank 2", "lane 5 != lane 0", "configuration differs"]:
        assert reason in err, err


def test_a_silent_connection_cannot_stall_setup():
    start = time.monotonic()
    _run(2, [b"", b"", b""])  # slow-loris: connect and say nothing
    # pending handshakes progress together; waiting them out one by one would take 3 x 2 s
    assert time.monotonic() - start < 4


def test_many_silent_and_garbage_connections_barely_delay_setup():
    def timed(strangers):
        start = time.monotonic()
        _run(2, strangers)
        return time.monotonic() - start

    baseline = min(timed([]) for _ in range(2))
    # more than a backlog of 64; the better of two runs (a loaded machine can stall either one)
    crowded = min(timed([b""] * 50 + [os.urandom(64) for _ in range(50)]) for _ in range(2))
    assert crowded - baseline < 1.5, (baseline, crowded)
