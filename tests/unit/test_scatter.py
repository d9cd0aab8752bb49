"""The reduce-scatter's layout (fasthorovod/proxy/scatter.py) without a ring: every rank lays its
input out, the buffers are summed element by element (what the ring's reduce-scatter phase leaves
in each rank's own chunk), and each rank's rows read back must be its share of the summed tensors,
split as Horovod splits the first dimension."""
import itertools

import pytest
import torch

from fasthorovod.proxy.scatter import Layout, rows_in, rows_out, shares


def test_shares_are_horovods_split():
    assert shares(7, 3) == [3, 2, 2] and shares(2, 4) == [1, 1, 0, 0] and shares(0, 2) == [0, 0]
    assert shares(9, 3) == [3, 3, 3]


SHAPES = [[(7, 3)], [(2,)], [(12, 5), (5,), (1, 2, 2)], [(0, 4)], [(3, 1000)]]


@pytest.mark.parametrize("size,lanes,shapes", list(itertools.product([1, 2, 3, 4], [1, 3], SHAPES)))
def test_every_rank_reads_its_rows_of_the_sum(size, lanes, shapes):
    inputs = [[torch.randint(-9, 9, s, generator=torch.Generator().manual_seed(r * 31 + i)).double()
               for i, s in enumerate(shapes)] for r in range(size)]
    layout = Layout(inputs[0], size, lanes)
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
        rows_out(layout, total, outputs, r)
        for i, s in enumerate(shapes):
            first = sum(shares(s[0], size)[:r])
            assert torch.equal(outputs[i], summed[i][first:first + outputs[i].shape[0]]), (r, i, s)


def test_each_lane_carries_equal_shares_of_a_row_in_the_rank_order_of_the_ring():
    layout = Layout([torch.zeros(6, 4)], 3, 2)  # rows of 2 x 4 = 8 elements; lanes of 4 columns
    assert layout.bounds == [0, 4, 8]
    # lane 0's region [0, 12): chunk c holds rank c-1's first 4 columns; rank 0's is chunk 1
    assert layout.pieces(0, 0) == [(4, 0, 4), (12 + 4, 4, 4)]
    assert layout.pieces(0, 2) == [(0, 0, 4), (12, 4, 4)]
