"""Rows per rank (fasthorovod/proxy/rows.py) without a ring.

A reduce-scatter (scatter.py): every rank lays its input out, the buffers are summed element by
element (what the ring's reduce-scatter phase leaves in each rank's own chunk), and each rank's
rows read back must be its share of the summed tensors, split as Horovod splits the first dimension.
An allgather (gather.py): every rank lays its own rows out, each rank's own chunks are put
together (what the ring's allgather phase leaves everywhere), and every rank reads back the
concatenation of all ranks' rows, whatever their first dimensions."""
import itertools
import threading
import time

import pytest
import torch

from fasthorovod.proxy.rows import Layout, rows_in, rows_out, shares
from fasthorovod.proxy.stages import SecondStages


def test_shares_are_horovods_split():
    assert shares(7, 3) == [3, 2, 2] and shares(2, 4) == [1, 1, 0, 0] and shares(0, 2) == [0, 0]
    assert shares(9, 3) == [3, 3, 3]


SHAPES = [[(7, 3)], [(2,)], [(12, 5), (5,), (1, 2, 2)], [(0, 4)], [(3, 1000)]]


@pytest.mark.parametrize("size,lanes,shapes", list(itertools.product([1, 2, 3, 4], [1, 3], SHAPES)))
def test_every_rank_reads_its_rows_of_the_sum(size, lanes, shapes):
    inputs = [[torch.randint(-9, 9, s, generator=torch.Generator().manual_seed(r * 31 + i)).double()
               for i, s in enumerate(shapes)] for r in range(size)]
    layout = Layout.split(inputs[0], size, lanes)
    assert layout.width * size >= sum(torch.Size(s).numel() for s in shapes)
    staged = []
    for r in range(size):
        buf = torch.full((size * layout.width,), float("nan"), dtype=torch.float64)  # padding must be zeroed
        rows_in(layout, inputs[r], buf)
        staged.append(buf)
    total = torch.stack(staged).sum(0)
    summed = [sum(inputs[r][i] for r in range(size)) for i in range(len(shapes))]
    for r in range(size):
        outputs = [torch.empty((shares(s[0], size)[r],) + tuple(s[1:]), dtype=torch.float64) for s in shapes]
        rows_out(layout, total, outputs, [r])
        for i, s in enumerate(shapes):
            first = sum(shares(s[0], size)[:r])
            assert torch.equal(outputs[i], summed[i][first:first + outputs[i].shape[0]]), (r, i, s)


def test_each_lane_carries_equal_shares_of_a_row_in_the_rank_order_of_the_ring():
    layout = Layout.split([torch.zeros(6, 4)], 3, 2)  # rows of 2 x 4 = 8 elements; lanes of 4 columns
    assert layout.bounds == [0, 4, 8]
    # lane 0's region [0, 12): chunk c holds rank c-1's first 4 columns; rank 0's is chunk 1
    assert layout.pieces(0, 0) == [(4, 0, 4), (12 + 4, 4, 4)]
    assert layout.pieces(0, 2) == [(0, 0, 4), (12, 4, 4)]


COUNTS = [[[3, 0, 5, 1]], [[0, 0, 0, 0]], [[2, 2, 2, 2], [1, 7, 0, 3]], [[1000, 1, 4, 4]]]


@pytest.mark.parametrize("lanes,counts", list(itertools.product([1, 2, 3], COUNTS)))
def test_every_rank_reads_every_ranks_rows_of_an_allgather(lanes, counts):
    size, rows = 4, [(2, 3), (5,)][:len(counts)]
    inputs = [[torch.randint(-9, 9, (counts[t][r],) + rows[t], generator=torch.Generator().manual_seed(r * 7 + t))
               for t in range(len(counts))] for r in range(size)]
    layout = Layout([torch.Size(shape).numel() for shape in rows], counts, size, lanes)
    gathered = torch.full((size * layout.width,), -100, dtype=torch.int64)
    for r in range(size):
        own = torch.full((size * layout.width,), -100, dtype=torch.int64)
        for t, x in enumerate(inputs[r]):
            layout.place(t, [r], x.reshape(-1), own, True)
        for lo, hi in zip(layout.bounds[:-1], layout.bounds[1:]):  # rank r's chunk of every lane
            chunk = slice(size * lo + ((r + 1) % size) * (hi - lo), size * lo + ((r + 1) % size + 1) * (hi - lo))
            gathered[chunk] = own[chunk]
    for t in range(len(counts)):
        out = torch.empty((sum(counts[t]),) + rows[t], dtype=torch.int64)
        layout.place(t, range(size), out.view(-1), gathered, False)
        assert torch.equal(out, torch.cat([inputs[r][t] for r in range(size)])), (lanes, counts, t)


class _TwoStages:
    """A request whose first stage completes when `done` is set."""

    def __init__(self, posted):
        self.done = threading.Event()
        self.posted = posted
        self.error = None

    def first_done(self):
        return self.done.is_set()

    def post_second(self):
        self.posted.append(self)

    def abandon(self, error):
        self.error = error


def _until(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def test_second_stages_are_posted_in_the_order_their_first_stages_complete():
    posted = []
    stages = SecondStages()
    a, b, c = _TwoStages(posted), _TwoStages(posted), _TwoStages(posted)
    for request in (a, b, c):
        stages.add(request)
    b.done.set()
    assert _until(lambda: posted == [b])  # not stuck behind a, whose first stage is still out
    c.done.set()
    a.done.set()
    assert _until(lambda: len(posted) == 3) and posted[0] is b
    stages.close()


def test_closing_abandons_what_is_pending_and_refuses_more():
    posted = []
    stages = SecondStages()
    waiting, later = _TwoStages(posted), _TwoStages(posted)
    stages.add(waiting)
    stages.close()
    assert waiting.error is not None and "shut down" in str(waiting.error) and posted == []
    stages.add(later)
    assert later.error is not None and posted == []
