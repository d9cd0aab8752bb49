"""The delayed-SGD family: OD-SGD, CD-SGD and SSD-SGD (docs/algorithms.md has the equations).

All three keep global weights W (updated by the user's optimizer on averaged gradients, identical
on every rank) apart from the local weights w~ (the model's parameters). After ``warmup_steps``
of synchronous SGD, the averaging of step t's gradients is started in ``step()`` and waited for
one step (OD-SGD, CD-SGD) or one period (SSD-SGD) later, so it runs while the next steps'
forward and backward compute; meanwhile the local weights advance with the rank's own gradient.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence

import torch

from fasthorovod.buckets import GradientBucket, GradientBuckets, reversed_buckets
from fasthorovod.scheduler.base import (
    Option,
    ScheduledOptimizer,
    boolean,
    _InFlight,
    _Layout,
    nonnegative_float,
    nonnegative_int,
    one_of,
    positive_float,
    positive_int,
)
from fasthorovod.scheduler.comm import Handle
from fasthorovod.scheduler.quantize import ErrorFeedbackChannel

_LOCAL_LR_SCALE = Option(4.0, nonnegative_float,
                         "local learning rate as a multiple of each parameter group's current lr "
                         "(follows LR schedules; the research used 4x); 0 disables the local update")


def _wait_all(handles: List[Handle], flat: torch.Tensor) -> torch.Tensor:
    for handle in handles:
        handle.wait()
    return flat


class _Bucket(GradientBucket):
    """Parameters (consecutive in `layout`'s flat buffer) averaged together as soon as backward has
    produced all their gradients."""

    def __init__(self, index: int, layout: _Layout, positions: List[int]) -> None:
        super().__init__(index, positions)
        self.layout = layout
        self.positions = positions
        self.span = layout.span(positions)


class ODSGD(ScheduledOptimizer):
    """One-step-delay SGD (OD-SGD).

    Step t (after warm-up): start averaging g_t; wait for the average of g_{t-1} and apply it,
    ``W <- Opt(W, avg(g_{t-1}))``; then ``w~ <- W - lr_local * D(g_t)`` with
    ``D(g) = g`` (``local_update="sgd"``) or the DC-ASGD compensation
    ``D(g) = g + dc_lambda * g*g*(W_t - W_{t-1})`` (``local_update="dc-asgd"``).

    With ``overlap_backward`` (the default) the averaging of g_t starts during step t's backward,
    bucket by bucket as hooks see the gradients accumulated (as Horovod and FastHorovod's SSGD do),
    so it runs for the rest of backward and all of step t+1's forward and backward.

    Options: ``warmup_steps`` (200), ``local_lr_scale`` (4.0), ``local_update`` ("sgd"),
    ``dc_lambda`` (0.04), ``overlap_backward`` (True), ``bucket_bytes`` (25 MiB).
    """

    algorithm = "od-sgd"
    OPTIONS = {
        "warmup_steps": Option(200, nonnegative_int, "steps of synchronous SGD before the delay starts"),
        "local_lr_scale": _LOCAL_LR_SCALE,
        "local_update": Option("sgd", one_of("sgd", "dc-asgd"),
                               "local update rule: plain SGD on the local gradient, or DC-ASGD-compensated"),
        "dc_lambda": Option(0.04, nonnegative_float, "DC-ASGD compensation strength lambda"),
        "overlap_backward": Option(True, boolean,
                                   "start averaging each bucket of gradients as soon as backward has "
                                   "produced it (gradients are read then, as in Horovod); False: all "
                                   "in step(), after any change made to p.grad"),
        "bucket_bytes": Option(25 << 20, positive_int,
                               "bytes per bucket of gradients with overlap_backward "
                               "(FASTHOROVOD_BUCKET_BYTES's default)"),
    }
    num_slots = 2

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._previous_global: Optional[List[torch.Tensor]] = None  # W_{t-1}, for DC-ASGD
        self._buckets: List[_Bucket] = []
        self._gradient_buckets: Optional[GradientBuckets[_Bucket]] = None
        if self.options.get("overlap_backward"):  # CD-SGD has no such option
            self._plan_buckets()

    def _policy_step(self) -> None:
        if self._step < self.warmup_steps:
            self._ssgd_step()
            return
        grads = self._grads()
        entry = self._post(grads, self._step % 2)
        while self._in_flight:
            self._apply_entry(self._in_flight.popleft())
        self._in_flight.append(entry)
        self._local_update(grads)

    def _post(self, grads: Sequence[torch.Tensor], slot: int) -> _InFlight:
        if not self._buckets:
            return self._post_grads(grads, slot)

        def fill(bucket: _Bucket, missing: List[int]) -> None:
            for i in missing:
                bucket.layout.view(self._buffer(slot, bucket.layout), i).copy_(grads[i])
        # what backward did not finish (unused parameters, no hooks yet)
        self._gradient_buckets.post_remaining(fill)
        handles = []
        for layout in self._layouts:
            mine = [b.handle for b in self._buckets if b.layout is layout]
            flat = self._buffer(slot, layout)
            handles.append(Handle(functools.partial(_wait_all, mine, flat)))
        self._gradient_buckets.reset()
        return _InFlight(handles, 1)

    # -- buckets launched by backward (overlap_backward) ----------------------------------------

    def _plan_buckets(self) -> None:
        """Consecutive parameters of each layout, in reverse order, of at most bucket_bytes (or one
        parameter); a hook on each parameter."""
        for layout in self._layouts:
            itemsize = torch.empty((), dtype=layout.dtype).element_size()
            for positions in reversed_buckets(layout.positions, lambda i: self._params[i].numel() * itemsize,
                                              self.bucket_bytes):
                self._buckets.append(_Bucket(len(self._buckets), layout, positions))
        self._gradient_buckets = GradientBuckets(
            self._buckets, lambda bucket: self._post_bucket(bucket, self._step % 2), self._repeated_gradient,
            accept=self._copy_gradient)
        # Before the first step() the counters may still change (broadcast from rank 0), and
        # warm-up steps are synchronous: step() sends everything then.
        self._gradient_buckets.register_hooks(lambda i: self._params[i],
                                              active=lambda: self._started and self._step >= self.warmup_steps)

    def _repeated_gradient(self, i: int, bucket: _Bucket) -> RuntimeError:
        return RuntimeError(
            f"the gradient of {self._names[i]!r} was computed twice before step() (algorithm "
            f"{self.algorithm!r} sends it as soon as backward produces it); accumulate over "
            "several backward passes with overlap_backward=False")

    def _copy_gradient(self, i: int, bucket: _Bucket) -> None:
        """Backward produced parameter i's gradient: into this step's buffer it goes."""
        p = self._params[i]
        with torch.no_grad():
            g = p.grad.to_dense() if p.grad.is_sparse else p.grad
            bucket.layout.view(self._buffer(self._step % 2, bucket.layout), i).copy_(g)

    def _post_bucket(self, bucket: "_Bucket", slot: int) -> Handle:
        flat = self._buffer(slot, bucket.layout)[bucket.span]
        return self._post_average(flat, self._name(f"bucket{bucket.index}", slot, bucket.layout))

    def _discard_unstepped(self) -> None:
        """Finishes (and drops) buckets that a backward without step() started."""
        for bucket in self._buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
        if self._gradient_buckets is not None:
            self._gradient_buckets.reset()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._discard_unstepped()
        super().load_state_dict(state_dict)

    def _drop_in_flight(self) -> None:
        super()._drop_in_flight()
        if self._gradient_buckets is not None:
            self._gradient_buckets.reset()  # forgets bucket handles without waiting

    def _apply_entry(self, entry: _InFlight) -> None:
        if self.local_update == "dc-asgd":
            if self._previous_global is None:
                self._previous_global = [w.clone() for w in self._global]
            else:
                for prev, w in zip(self._previous_global, self._global):
                    prev.copy_(w)
        super()._apply_entry(entry)

    def _local_update(self, grads: Sequence[torch.Tensor]) -> None:
        """w~ <- W - lr_local * D(g)."""
        dc = self.local_update == "dc-asgd" and self._previous_global is not None
        for i, (p, w, g) in enumerate(zip(self._params, self._global, grads)):
            if dc:
                # D(g) = g + lambda * (g*g*(W_t - W_{t-1}))
                g = g.mul(g).mul_(w - self._previous_global[i]).mul_(self.dc_lambda).add_(g)
            torch.add(w, g, alpha=-self._local_lr(i), out=p)

    def _extra_state(self) -> Dict[str, Any]:
        return {"previous_global": self._previous_global}

    def _load_extra_state(self, state: Dict[str, Any]) -> None:
        prev = state.get("previous_global")
        self._previous_global = None if prev is None else [
            t.to(w.device, w.dtype).clone() for t, w in zip(prev, self._global)]


class CDSGD(ODSGD):
    """Compression + delay SGD (CD-SGD): OD-SGD whose gradients travel 2-bit quantized.

    After ``warmup_steps`` of full-precision synchronous SGD, each step quantizes g_t with error
    feedback (threshold ``threshold``) and allgathers the packed words; every
    ``correction_period``-th delayed step instead averages g_t in full precision (the k-step
    correction; the residual is kept, as in the authors' code). The local update uses the
    full-precision g_t, as in OD-SGD. Choose ``threshold`` on the scale of the gradient's
    elements (see TwoBitCompression).

    Options: ``warmup_steps`` (1000), ``threshold`` (0.5), ``correction_period`` (5), and OD-SGD's
    ``local_lr_scale``, ``local_update``, ``dc_lambda``.
    """

    algorithm = "cd-sgd"
    OPTIONS = {
        # no buckets: one error-feedback quantization covers the whole flat buffer
        **{name: opt for name, opt in ODSGD.OPTIONS.items() if name not in ("overlap_backward", "bucket_bytes")},
        "warmup_steps": Option(1000, nonnegative_int, "steps of full-precision synchronous SGD first"),
        "threshold": Option(0.5, positive_float, "2-bit quantization threshold (MXNet's default 0.5)"),
        "correction_period": Option(5, positive_int,
                                    "every k-th delayed step sends gradient + residual in full precision"),
    }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        require_float32(self, "2-bit quantization")
        self._channel = ErrorFeedbackChannel(self._comm, self._layouts[0].count if self._layouts else 0,
                                             self.threshold, slots=2)

    def _post(self, grads: Sequence[torch.Tensor], slot: int) -> _InFlight:
        layout = self._layouts[0]
        flat = layout.pack(grads, self._buffer(slot, layout))
        self._phase += 1
        if self._phase == self.correction_period:
            self._phase = 0
            return _InFlight([self._post_average(flat, self._name("full", slot, layout))], 1)
        self._stats["allgather_bytes"] += self._channel.payload_bytes()
        self._stats["collectives"] += 1
        return _InFlight([self._channel.post(flat, slot, self._name("2bit", slot, layout))], 1)

    per_process_state = ("residual",)

    def _extra_state(self) -> Dict[str, Any]:
        return {**super()._extra_state(), "residual": self._channel.residual}

    def _load_extra_state(self, state: Dict[str, Any]) -> None:
        super()._load_extra_state(state)
        if state.get("residual") is not None:
            self._channel.residual.copy_(state["residual"])


class SSDSGD(ScheduledOptimizer):
    """Several-steps-delay SGD (SSD-SGD) with GLU.

    After ``warmup_steps`` of synchronous SGD, steps come in periods of ``period`` (k). Every step
    adds its gradient to the period's sum and updates the local weights,
    ``w~ <- (w~ - lr_local * g) + glu * V``, where V is the global weights' movement per step over
    the last synchronization (GLU; 0 before the first one). At the end of a period the sum starts
    averaging in the background and runs during the whole next period; the previous period's
    average is applied as one step of the user's optimizer with the summed gradient (Horovod's
    ``backward_passes_per_step=k`` semantics), and the local weights are reset to W (before this
    step's local update).

    Options: ``warmup_steps`` (500), ``period`` (5), ``local_lr_scale`` (4.0), ``glu`` (1.0).
    """

    algorithm = "ssd-sgd"
    OPTIONS = {
        "warmup_steps": Option(500, nonnegative_int, "steps of synchronous SGD before the steps-delay stage"),
        "period": Option(5, positive_int, "k: steps per synchronization period"),
        "local_lr_scale": _LOCAL_LR_SCALE,
        "glu": Option(1.0, nonnegative_float,
                      "GLU coefficient: weight of the global weights' last per-step movement in "
                      "every local update; 0 disables GLU"),
    }
    num_slots = 2

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._slot = 0  # buffer that accumulates the current period
        self._velocity: Optional[List[torch.Tensor]] = None

    def _policy_step(self) -> None:
        if self._step < self.warmup_steps:
            self._ssgd_step()
            return
        grads = self._grads()
        for layout in self._layouts:
            views = layout.views(self._buffer(self._slot, layout))
            for view, i in zip(views, layout.positions):
                if self._phase == 0:
                    view.copy_(grads[i])
                else:
                    view.add_(grads[i])
        self._phase += 1
        if self._phase == self.period:
            self._end_period()
            self._params_from_global()
        self._local_update(grads)

    def _end_period(self) -> None:
        """Starts averaging the accumulated period, then applies every earlier one."""
        entry = self._post_accumulated(self._phase)
        while self._in_flight:
            self._apply_entry(self._in_flight.popleft())
        self._in_flight.append(entry)
        self._phase = 0

    def _post_accumulated(self, steps: int) -> _InFlight:
        slot = self._slot
        handles = [self._post_average(self._buffer(slot, layout), self._name("period", slot, layout))
                   for layout in self._layouts]
        self._slot ^= 1
        return _InFlight(handles, steps)

    def _apply_entry(self, entry: _InFlight) -> None:
        """One step of the user's optimizer with the period's summed gradient; V <- movement/steps."""
        before = [w.clone() for w in self._global] if self.glu else None
        self._apply_global(entry.wait())
        if before is not None:
            self._velocity = [w.sub(b).div_(entry.steps) for w, b in zip(self._global, before)]

    def _drain(self) -> None:
        if self._phase > 0:  # a partial period: synchronize what it accumulated, too
            self._in_flight.append(self._post_accumulated(self._phase))
        super()._drain()

    def _local_update(self, grads: Sequence[torch.Tensor]) -> None:
        """w~ <- (w~ - lr_local * g) + glu * V."""
        for i, (p, g) in enumerate(zip(self._params, grads)):
            p.add_(g, alpha=-self._local_lr(i))
            if self._velocity is not None:
                p.add_(self._velocity[i], alpha=self.glu)

    def _extra_state(self) -> Dict[str, Any]:
        accumulated = None
        if self._phase > 0:
            accumulated = [self._buffer(self._slot, layout).clone() for layout in self._layouts]
        return {"velocity": self._velocity, "accumulated": accumulated, "slot": self._slot}

    def _load_extra_state(self, state: Dict[str, Any]) -> None:
        self._slot = int(state.get("slot", self._slot))  # names the period's collectives: ranks agree
        velocity = state.get("velocity")
        self._velocity = None if velocity is None else [
            t.to(w.device, w.dtype).clone() for t, w in zip(velocity, self._global)]
        if state.get("accumulated") is not None:
            for layout, saved in zip(self._layouts, state["accumulated"]):
                self._buffer(self._slot, layout).copy_(saved)


def require_float32(opt: ScheduledOptimizer, what: str) -> None:
    for i, p in enumerate(opt._params):
        if p.dtype != torch.float32:
            raise ValueError(f"{what} needs float32 parameters; {opt._names[i]!r} is {p.dtype} "
                             f"(algorithm {opt.algorithm!r})")
