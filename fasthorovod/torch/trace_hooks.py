"""Forward and backward spans for the DLC trace (docs/trace.md), measured without the user's help.

While a trace runs, torch's global module hooks stamp the first module forward of an iteration and
the end of the last one; the DistributedOptimizer's gradient hooks stamp each gradient as it is
accumulated. At the first gradient of an iteration the forward span [first forward start, last
forward end] is recorded and the backward span starts where the forward ended (so it includes the
loss); it ends at the last gradient and is recorded when the optimizer synchronizes. Costs one
Python call per module forward and per parameter gradient, only while tracing.
"""
from __future__ import annotations

from typing import Optional

import torch

from fasthorovod.trace import capture as _trace


class ComputeSpans:
    def __init__(self) -> None:
        self._handles = []
        self._forward_start: Optional[int] = None
        self._forward_end: Optional[int] = None
        self._backward_start: Optional[int] = None
        self._backward_end: Optional[int] = None

    def install(self) -> None:
        if not self._handles:
            self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._pre_forward),
                             torch.nn.modules.module.register_module_forward_hook(self._post_forward)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._forward_start = self._forward_end = self._backward_start = self._backward_end = None

    def _pre_forward(self, module, args) -> None:
        if self._forward_start is None:
            self._forward_start = _trace.now_ns()

    def _post_forward(self, module, args, output) -> None:
        if self._forward_start is not None:
            self._forward_end = _trace.now_ns()

    def gradient_ready(self) -> None:
        """A parameter's gradient was accumulated (the optimizer's hook)."""
        now = _trace.now_ns()
        if self._backward_start is None:
            if self._forward_start is not None:
                end = self._forward_end or now
                _trace.complete("forward", "", self._forward_start, end)
                self._backward_start = end
            else:
                self._backward_start = now
            self._forward_start = self._forward_end = None
        self._backward_end = now

    def gradients_done(self) -> None:
        """The optimizer is about to wait for its allreduces: the backward span ends."""
        if self._backward_start is not None:
            _trace.complete("backward", "", self._backward_start, self._backward_end)
        self._backward_start = self._backward_end = None


compute_spans = ComputeSpans()
