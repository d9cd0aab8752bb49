"""``hvd.Compression``: Horovod's compressors (``none``, ``fp16``: the same objects) and ``bf16``.

``Compression.bf16`` puts bfloat16 on the wire, as ``fp16`` puts float16: float32's exponent range
(no underflow of small gradients, no overflow of large ones) with 8 bits of mantissa instead of
11. For float32 tensors that the proxies carry, the proxies do it themselves, as they do
``fp16``: the tensor stays float32 and zero-copy on the rank, every hop carries bfloat16 and adds in
float32 (``mpi_ops.wire_for``; docs/dataplane.md gives the error bound). Elsewhere the rank casts,
as Horovod's fp16 compressor does: floating-point tensors travel as bfloat16, which only the
proxies reduce on the CPU (Horovod's CPU operations refuse it; its NCCL operations take it).
"""
import torch
from horovod.torch.compression import Compression as _HorovodCompression
from horovod.torch.compression import Compressor


class BF16Compressor(Compressor):
    """Casts floating-point tensors to bfloat16 for the collective and back afterwards."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.bfloat16:
            return tensor.type(torch.bfloat16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.type(ctx)


class Compression(_HorovodCompression):
    """Horovod's ``Compression`` (``none`` and ``fp16`` are its own objects) with ``bf16``."""

    bf16 = BF16Compressor
