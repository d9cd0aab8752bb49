"""Baselines without separate global weights: synchronous SGD on 2-bit gradients, and
(post-)local SGD. Here the user's optimizer updates the model's parameters directly."""
from __future__ import annotations

from typing import Any, Dict

from fasthorovod.scheduler.base import Option, ScheduledOptimizer, nonnegative_int, positive_float, positive_int
from fasthorovod.scheduler.delayed import require_float32
from fasthorovod.scheduler.quantize import ErrorFeedbackChannel


class SSGD2Bit(ScheduledOptimizer):
    """Synchronous SGD whose gradients travel 2-bit quantized with error feedback.

    Every step: quantize g_t with this rank's residual, allgather the packed words, set
    ``p.grad`` to the average of every rank's dequantized payload, and run the user's optimizer.
    The research's baseline for CD-SGD (MXNet's ``2bit`` gradient compression).

    Options: ``threshold`` (0.5).
    """

    algorithm = "ssgd-2bit"
    OPTIONS = {"threshold": Option(0.5, positive_float, "2-bit quantization threshold (MXNet's default 0.5)")}
    separate_global_weights = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        require_float32(self, "2-bit quantization")
        self._channel = ErrorFeedbackChannel(self._comm, self._layouts[0].count if self._layouts else 0,
                                             self.threshold, slots=1)

    def _policy_step(self) -> None:
        grads = self._grads()
        layout = self._layouts[0]
        flat = layout.pack(grads, self._buffer(0, layout))
        self._stats["allgather_bytes"] += self._channel.payload_bytes()
        self._stats["collectives"] += 1
        averaged = self._channel.post(flat, 0, self._name("2bit", 0, layout)).wait()
        for i, view in zip(layout.positions, layout.views(averaged)):
            self._set_grad(self._params[i], view)
        self.optimizer.step()

    per_process_state = ("residual",)

    def _extra_state(self) -> Dict[str, Any]:
        return {"residual": self._channel.residual}

    def _load_extra_state(self, state: Dict[str, Any]) -> None:
        if state.get("residual") is not None:
            self._channel.residual.copy_(state["residual"])


class LocalSGD(ScheduledOptimizer):
    """Local SGD, or post-local SGD with ``warmup_steps`` > 0 (Lin et al., ICLR 2020).

    During the first ``warmup_steps`` steps: synchronous SGD. Afterwards every rank runs the
    user's optimizer on its own gradients, and every ``period`` (H) steps the parameters are
    averaged over all ranks (blocking; optimizer state such as momentum stays per rank, as in
    torch's PostLocalSGDOptimizer).

    Options: ``warmup_steps`` (0), ``period`` (8).
    """

    algorithm = "local-sgd"
    OPTIONS = {
        "warmup_steps": Option(0, nonnegative_int, "steps of synchronous SGD before local SGD (post-local SGD)"),
        "period": Option(8, positive_int, "H: local steps between two averagings of the weights"),
    }
    separate_global_weights = False

    def _policy_step(self) -> None:
        if self._step < self.warmup_steps:
            self._ssgd_step()
            return
        self.optimizer.step()
        self._phase += 1
        if self._phase == self.period:
            self._average_weights()
            self._phase = 0

    def _drain(self) -> None:
        if self._phase > 0:
            self._average_weights()

    def _average_weights(self) -> None:
        params = [p.detach() for p in self._params]
        averaged = self._post_grads(params, 0, purpose="weights").wait()
        for layout, flat in zip(self._layouts, averaged):
            for i, view in zip(layout.positions, layout.views(flat)):
                self._params[i].copy_(view)
