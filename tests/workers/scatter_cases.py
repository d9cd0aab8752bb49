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
