"""2-bit gradient compression with error feedback (MXNet's rule), on torch tensors.

The arithmetic lives in C++ (csrc/collectives/quantize.{h,cc}, bound as ``fasthorovod._C``):

* :func:`quantize_2bit` ``(grad, residual, threshold) -> words``: ``r <- r + g``; each element sends
  ``+t`` (``r -= t``) if ``r >= t``, ``-t`` (``r += t``) if ``r <= -t``, else 0; sixteen 2-bit values
  per int32 word; the residual is updated in place.
* :func:`dequantize_sum_2bit` ``(payloads, out, threshold, scale)``: ``out = scale * Σ_rows
  decode(row)``, e.g. the average of every rank's payload with ``scale = 1/size``.

:class:`TwoBitCompression` is the user-facing switch, in the spirit of ``hvd.Compression``:
``hvd.DistributedOptimizer(opt, compression=TwoBitCompression(threshold=0.5))`` trains with
synchronous SGD on 2-bit gradients (the research's "SSGD + 2-bit" baseline), and
``algorithm="cd-sgd"`` takes its threshold from it. Unlike fp16, 2-bit payloads cannot be summed by
an allreduce, so it is not a Horovod ``Compressor``: ``compress``/``decompress`` raise.
"""
from __future__ import annotations

import torch

from fasthorovod import _C


def packed_words(count: int) -> int:
    """int32 words that hold `count` 2-bit values."""
    return _C.packed_words_2bit(count)


def quantize_2bit(grad: torch.Tensor, residual: torch.Tensor, threshold: float,
                  out: torch.Tensor = None) -> torch.Tensor:
    """Quantizes float32 `grad` with error feedback into int32 words; updates `residual` in place."""
    _check_flat(grad, "grad")
    _check_flat(residual, "residual")
    if out is None:
        out = torch.empty(packed_words(grad.numel()), dtype=torch.int32)
    _C.quantize_2bit(grad.numpy(), residual.numpy(), out.numpy(), float(threshold))
    return out


def dequantize_sum_2bit(payloads: torch.Tensor, out: torch.Tensor, threshold: float,
                        scale: float = 1.0) -> torch.Tensor:
    """``out = scale * sum of the dequantized payloads`` (int32, one payload per row, or 1-D)."""
    _check_flat(out, "out")
    if payloads.dtype != torch.int32 or payloads.device.type != "cpu":
        raise ValueError(f"payloads must be an int32 CPU tensor, got {payloads.dtype} on {payloads.device}")
    _C.dequantize_sum_2bit(payloads.contiguous().numpy(), out.numpy(), float(threshold), float(scale))
    return out


def _check_flat(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")


class TwoBitCompression:
    """2-bit gradient compression with error feedback (MXNet's ``{'type': '2bit', 'threshold': t}``).

    Args:
        threshold: the step ``t`` (> 0) an element sends once its residual reaches it. Choose it on
            the scale of the gradient's elements: with ``t`` far above them, an element sends
            ``±t`` only every ``t/|g|`` steps (nothing is lost, but updates arrive late and in
            bursts). MXNet's default is 0.5.

    Example::

        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=TwoBitCompression(threshold=0.01))
    """

    scheduled = True  # DistributedOptimizer routes it to fasthorovod.scheduler (algorithm "ssgd-2bit")

    def __init__(self, threshold: float = 0.5) -> None:
        threshold = float(threshold)
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, got {threshold}")
        self.threshold = threshold

    def __repr__(self) -> str:
        return f"TwoBitCompression(threshold={self.threshold})"

    def compress(self, tensor):
        raise TypeError("2-bit payloads cannot be summed by an allreduce: pass TwoBitCompression to "
                        "hvd.DistributedOptimizer (it allgathers the packed payloads), not to hvd.allreduce")

    decompress = compress


class ErrorFeedbackChannel:
    """Sends flat float32 gradients 2-bit quantized with error feedback; receives their average.

    Holds this rank's residual (one float per element) and one packed-word buffer per slot, so a
    payload can stay in flight while the next one is quantized. ``post(flat, slot, name)``
    quantizes `flat` into the slot's words (updating the residual), starts the packed allgather,
    and returns a handle whose ``wait()`` overwrites `flat` with ``(1/size) Σ_ranks
    dequantize(words_r)`` and returns it.
    """

    def __init__(self, communicator, count: int, threshold: float, slots: int) -> None:
        self.communicator = communicator
        self.threshold = float(threshold)
        self.residual = torch.zeros(count, dtype=torch.float32)
        self.words = [torch.zeros(packed_words(count), dtype=torch.int32) for _ in range(slots)]

    def post(self, flat: torch.Tensor, slot: int, name: str):
        from fasthorovod.scheduler.comm import Handle

        words = quantize_2bit(flat, self.residual, self.threshold, out=self.words[slot])
        handle = self.communicator.allgather_packed_async(words, name)
        scale = 1.0 / self.communicator.size

        def finish():
            return dequantize_sum_2bit(handle.wait(), flat, self.threshold, scale)
        return Handle(finish)

    def payload_bytes(self) -> int:
        return self.words[0].numel() * 4
