"""The tensors worker.py's reducescatter scenario reduces, shared with the test that claims their
path (tests/multiproc/test_dataplane.py): torch only, importable from both."""
import torch


def reducescatter_cases(size: int) -> list:
    """scenario_reducescatter's tensors: (shape, dtype, op) — first dimensions that split evenly,
    unevenly and into empty shares, 1-D and 3-D, integer and floating types; the first, of 4.8 MB,
    passes the default threshold."""
    return [((size * 100_000 + 2, 4), torch.float32, "sum"), ((size * 7 + 1,), torch.int32, "sum"),
            ((size - 1, 5, 3), torch.float64, "average"), ((2 * size + 1, 1000), torch.int64, "sum"),
            ((size * 3, 11), torch.float32, "average")]


def allgather_cases(size: int, rank: int) -> list:
    """scenario_allgather's tensors on `rank`: (shape, dtype) — first dimensions that differ
    between ranks (rank 0 gives no rows of the third), 1-D to 3-D, every dtype Horovod's CPU
    allgather takes; the first, of 2.4 MB on rank 0, passes the 1 MiB threshold."""
    return [((rank * 1000 + 150_000, 4), torch.float32), ((rank + 5,), torch.int32), ((rank, 5, 3), torch.float64),
            ((2 * rank + 1, 1000), torch.int64), ((rank + 3, 7), torch.float16), ((7 * rank + 2, 3), torch.uint8),
            ((rank + 1, 9), torch.int8), ((size - rank, 2), torch.int16)]


def alltoall_cases(size: int, rank: int) -> list:
    """scenario_alltoall's tensors on `rank`: (shape, dtype, splits) — splits that differ between
    ranks and destinations (zeros among them, rows left unsent past their sum), equal shares
    (splits None), 1-D to 3-D, every dtype Horovod's CPU alltoall takes; the first sends 2.4 MB or
    more from every rank, past any threshold."""
    def uneven(rows_per_unit):
        return [rows_per_unit * ((rank + d) % size + (d == rank)) for d in range(size)]

    return [((sum(uneven(50_000)) + 3, 4), torch.float32, uneven(50_000)),
            ((size * 20_000, 8), torch.float64, None),
            ((sum(uneven(7)), 5, 3), torch.int32, uneven(7)),
            ((size * 300,), torch.int64, [0] * (size - 1) + [size * 300] if rank % 2 else None),
            ((size * 2_000, 7), torch.float16, None), ((size * 5_000, 3), torch.uint8, None),
            ((size * 900, 9), torch.int8, None), ((sum(uneven(1_000)), 2), torch.int16, uneven(1_000)),
            ((size * 2, 3), torch.float32, None)]
