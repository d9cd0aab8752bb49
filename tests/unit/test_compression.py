"""hvd.Compression: Horovod's compressors unchanged, and bf16 (fasthorovod/torch/compression.py)."""
import horovod.torch as horovod
import torch

from fasthorovod.torch import mpi_ops
from fasthorovod.torch.compression import BF16Compressor, Compression


def test_horovods_compressors_are_its_own_objects():
    assert Compression.none is horovod.Compression.none and Compression.fp16 is horovod.Compression.fp16
    assert issubclass(Compression, horovod.Compression)


def test_bf16_round_trips_floating_point_tensors_through_bfloat16():
    x = torch.tensor([1.0, 1 / 3, 3e-30, 6e30], dtype=torch.float32)
    wire, ctx = BF16Compressor.compress(x)
    assert wire.dtype == torch.bfloat16 and ctx == torch.float32
    back = BF16Compressor.decompress(wire, ctx)
    assert back.dtype == torch.float32 and torch.equal(back, x.bfloat16().float())
    assert back[2] > 0 and torch.isfinite(back[3])  # float32's range: fp16 would flush and overflow these
    assert torch.equal(Compression.fp16.decompress(*Compression.fp16.compress(x))[2:], torch.tensor([0.0, float("inf")]))


def test_bf16_leaves_other_tensors_alone():
    for x in (torch.arange(5), torch.ones(3, dtype=torch.bfloat16)):
        wire, ctx = BF16Compressor.compress(x)
        assert wire is x and ctx is None and BF16Compressor.decompress(wire, ctx) is x


def test_the_proxies_take_fp16_and_bf16_on_the_wire():
    assert mpi_ops._WIRE == {Compression.fp16: torch.float16, Compression.bf16: torch.bfloat16}
