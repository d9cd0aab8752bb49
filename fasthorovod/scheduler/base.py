"""ScheduledOptimizer: the one interface every scheduling policy implements.

A policy wraps the user's optimizer by composition (like torch's ``PostLocalSGDOptimizer``) and
implements one method, :meth:`ScheduledOptimizer._policy_step`: what one training step does once
backward has filled ``p.grad``. Everything else is shared here:

* **Global and local weights.** For the delayed policies (``separate_global_weights``) the user's
  optimizer is re-pointed at the *global* weights ``W``: a copy of every trainable parameter,
  bit-identical on every rank, changed only by the user's optimizer applied to averaged
  gradients. The model's parameters become the *local* weights ``w~`` that forward/backward use.
  ``W`` is (re)loaded from the parameters at the first step (after the user's
  ``broadcast_parameters``) and after ``load_state_dict``. Policies without separate weights
  (synchronous 2-bit SGD, local SGD) let the user's optimizer update the parameters directly.
* **Flat buffers.** Gradients travel as one flat buffer per dtype ("layout"), allocated by the
  communicator (shared memory registered with the proxies, so the allreduce is zero-copy). The
  delayed policies double-buffer: the buffer of step t is in flight while step t+1 fills the
  other one.
* **Warm-up.** :meth:`_ssgd_step` is synchronous data-parallel SGD (average gradients, apply the
  user's optimizer, local weights = global weights), used before a policy's stage switch.
* **Draining and checkpoints.** :meth:`sync_weights` finishes every communication in flight,
  applies it, and sets the parameters to ``W`` on every rank (a collective). ``state_dict()``
  holds the user's optimizer state (for ``W``) plus the policy's counters and state under
  ``"fasthorovod_scheduler"``; the counters are broadcast from rank 0 at the first step, so a run
  resumed from rank 0's checkpoint continues in the right stage on every rank.
* **Elastic training.** When the communicator's ``epoch`` changes (Horovod elastic replaced the
  data plane), :meth:`reset_communication` drops what was in flight and moves the buffers to the
  new transport. :meth:`snapshot`/:meth:`restore_snapshot` and :meth:`shared_state`/
  :meth:`load_shared_state` are what ``fasthorovod.torch.elastic`` commits, restores and
  broadcasts (docs/algorithms.md, "Elastic training").
"""
from __future__ import annotations

import abc
import collections
import copy
import itertools
from typing import Any, Callable, ClassVar, Deque, Dict, List, Optional, Sequence

import torch

from fasthorovod.scheduler.comm import Communicator, Handle

STATE_KEY = "fasthorovod_scheduler"


class Option:
    """One algorithm option: default, a check that raises ValueError, and its documentation."""

    def __init__(self, default: Any, check: Callable[[str, Any], Any], doc: str) -> None:
        self.default = default
        self.check = check
        self.doc = doc


def nonnegative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def nonnegative_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return float(value)


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def one_of(*choices: str) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    return check


class _Layout:
    """The tracked parameters of one dtype, back to back in a flat buffer of `count` elements."""

    def __init__(self, index: int, positions: List[int], params: List[torch.Tensor]) -> None:
        self.index = index
        self.positions = positions  # indices into ScheduledOptimizer._params
        self.dtype = params[0].dtype
        numels = [p.numel() for p in params]
        self.count = sum(numels)
        # parameter index -> (element offset in the flat buffer, shape)
        offsets = itertools.accumulate([0] + numels[:-1])
        self._placement = dict(zip(positions, zip(offsets, (p.shape for p in params))))

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's part of `flat` (i indexes ScheduledOptimizer._params)."""
        offset, shape = self._placement[i]
        return flat[offset:offset + shape.numel()].view(shape)

    def span(self, positions: Sequence[int]) -> slice:
        """The slice of the flat buffer that parameters `positions` (consecutive in it) cover."""
        begin = min(self._placement[i][0] for i in positions)
        end = max(self._placement[i][0] + self._placement[i][1].numel() for i in positions)
        return slice(begin, end)

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [self.view(flat, i) for i in self.positions]

    def pack(self, tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)
        return flat


class _InFlight:
    """One synchronization in flight: a handle per layout (each yields the averaged flat buffer)
    and how many steps of gradients it sums."""

    def __init__(self, handles: List[Handle], steps: int) -> None:
        self.handles = handles
        self.steps = steps

    def wait(self) -> List[torch.Tensor]:
        return [h.wait() for h in self.handles]


class ScheduledOptimizer(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    """Base of the scheduling policies; see the module docstring.

    Args:
        optimizer: the user's optimizer (its parameter groups must already be complete).
        communicator: the :class:`~fasthorovod.scheduler.comm.Communicator` to use.
        named_parameters: optional ``(name, parameter)`` pairs, for error messages.
        compression: a Horovod compressor applied to full-precision allreduces (``Compression.none``
            or ``Compression.fp16``), where the policy allows it.
        **options: the policy's options (``OPTIONS``).
    """

    algorithm: ClassVar[str] = ""
    OPTIONS: ClassVar[Dict[str, Option]] = {}
    separate_global_weights: ClassVar[bool] = True
    num_slots: ClassVar[int] = 1  # flat buffers per layout (2 = double buffering)
    #: keys of _extra_state() that belong to this process (not broadcast after an elastic reset)
    per_process_state: ClassVar[Sequence[str]] = ()

    def __init__(self, optimizer: torch.optim.Optimizer, communicator: Communicator, named_parameters=None,
                 compression=None, **options) -> None:
        # Deliberately not calling torch.optim.Optimizer.__init__: the state and the parameter
        # groups are the wrapped optimizer's own objects (as in PostLocalSGDOptimizer).
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        self._comm = communicator
        self._compression = compression
        self._instance = communicator.new_scope()  # keeps the names of several optimizers apart
        for name in options:
            if name not in self.OPTIONS:
                raise ValueError(f"unknown option {name!r} for algorithm {self.algorithm!r}; its options are "
                                 f"{', '.join(sorted(self.OPTIONS)) or 'none'}")
        self.options = {name: opt.check(name, options.get(name, opt.default)) for name, opt in self.OPTIONS.items()}
        for name, value in self.options.items():
            setattr(self, name, value)

        names = {}
        if named_parameters is not None:
            names = {id(p): n for n, p in named_parameters}
        self._params: List[torch.Tensor] = []
        self._group_of: List[int] = []
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self._params.append(p)
                    self._group_of.append(gi)
        if len({id(p) for p in self._params}) != len(self._params):
            raise ValueError("a parameter appears more than once in the optimizer's parameter groups")
        self._names = [names.get(id(p), f"param.{i}") for i, p in enumerate(self._params)]
        for i, p in enumerate(self._params):
            if p.is_sparse:
                raise ValueError(f"sparse parameter {self._names[i]!r} is not supported by algorithm "
                                 f"{self.algorithm!r}")

        by_dtype: Dict[torch.dtype, List[int]] = collections.OrderedDict()
        for i, p in enumerate(self._params):
            by_dtype.setdefault(p.dtype, []).append(i)
        self._layouts = [_Layout(li, pos, [self._params[i] for i in pos]) for li, pos in enumerate(by_dtype.values())]
        self._buffers: List[List[Optional[torch.Tensor]]] = [[None] * len(self._layouts) for _ in range(self.num_slots)]

        self._global: List[torch.Tensor] = list(self._params)
        if self.separate_global_weights:
            self._global = self._split_global_weights()

        self._step = 0          # step() calls completed
        self._phase = 0         # steps since the last period boundary (policies with periods)
        self._started = False   # counters broadcast from rank 0 yet?
        self._reload_weights = True  # W <- parameters at the next step
        self._in_flight: Deque[_InFlight] = collections.deque()
        self._stats = {"allreduce_bytes": 0, "allgather_bytes": 0, "collectives": 0}
        self._epoch = communicator.epoch  # the transport the buffers and requests belong to

    # -- what a policy implements ---------------------------------------------------------------

    @abc.abstractmethod
    def _policy_step(self) -> None:
        """One training step, after backward filled ``p.grad`` of the local weights."""

    def _drain(self) -> None:
        """Finishes and applies every synchronization in flight (called by sync_weights)."""
        while self._in_flight:
            self._apply_entry(self._in_flight.popleft())

    def _apply_entry(self, entry: "_InFlight") -> None:
        """Waits for one synchronization and applies it to the global weights."""
        self._apply_global(entry.wait())

    def _extra_state(self) -> Dict[str, Any]:
        """The policy's own state for state_dict() (tensors are returned by reference)."""
        return {}

    def _load_extra_state(self, state: Dict[str, Any]) -> None:
        pass

    # -- the public interface -------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One training step of the policy (communication of this step overlaps the next one)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._begin()
        self._policy_step()
        self._step += 1
        return loss

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Drains in-flight communication and sets every rank's parameters to the global weights.

        A collective: every rank must call it at the same point. Afterwards the model's
        parameters are bit-identical on all ranks (for local SGD: averaged now), and the next
        step starts a fresh period. Call it before evaluating, checkpointing
        (``model.state_dict()``/``optimizer.state_dict()``) or comparing weights across ranks.
        """
        self._begin()
        self._drain()
        self._phase = 0
        if self.separate_global_weights:
            self._params_from_global()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of the model's parameters (the local weights)."""
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.requires_grad_(False)
                    p.grad.zero_()

    def state_dict(self) -> Dict[str, Any]:
        """The user's optimizer's state (for the global weights) plus the policy's counters/state.

        Take it after :meth:`sync_weights`, together with ``model.state_dict()``: the parameters
        then are the global weights. Communication still in flight is not part of it.
        """
        state = self.optimizer.state_dict()
        state[STATE_KEY] = {"algorithm": self.algorithm, "options": dict(self.options), "step": self._step,
                            "phase": self._phase, **self._extra_state()}
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state_dict() of this algorithm (or a plain optimizer's, which starts at step 0).

        Communication in flight is finished and dropped; the global weights are reloaded from
        the parameters at the next step, so load the model's matching state too.
        """
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        if ours is not None and ours.get("algorithm") != self.algorithm:
            raise ValueError(f"state_dict was saved by algorithm {ours.get('algorithm')!r}, "
                             f"this optimizer runs {self.algorithm!r}")
        self.optimizer.load_state_dict(state_dict)
        while self._in_flight:
            self._in_flight.popleft().wait()
        if ours is not None:
            self._step = int(ours["step"])
            self._phase = int(ours["phase"])
            self._load_extra_state(ours)
        self._reload_weights = True

    # -- elastic training (fasthorovod.torch.elastic) ---------------------------------------------

    def reset_communication(self) -> None:
        """Moves this optimizer onto the transport that replaced the old one (an elastic reset,
        or ``hvd.shutdown()`` + ``hvd.init()``). Synchronizations in flight are dropped
        unapplied (their requests died with the old data plane); buffers move, with their
        contents, into memory of the new transport; the step counters are taken from rank 0
        again at the next step. Runs by itself on first use after the epoch changed."""
        self._epoch = self._comm.epoch
        self._drop_in_flight()
        for slot in self._buffers:
            for i, buf in enumerate(slot):
                if buf is not None:
                    slot[i] = self._comm.alloc(buf.numel(), buf.dtype).copy_(buf)
        self._started = False

    def _follow_transport(self) -> None:
        if self._comm.epoch != self._epoch:
            self.reset_communication()

    def _drop_in_flight(self) -> None:
        """Forgets every synchronization in flight without waiting for it."""
        self._in_flight.clear()

    @torch.no_grad()
    def initialize_optimizer_state(self) -> None:
        """Creates the user's optimizer's state if it has none yet (a new worker), as Horovod's
        ``broadcast_optimizer_state`` does for a new optimizer: one step with zero gradients.
        The global weights do not require gradients, so Horovod's function would skip them."""
        if self.optimizer.state_dict()["state"]:
            return
        saved = [w.grad for w in self._global]
        for w in self._global:
            w.grad = torch.zeros_like(w)
        self.optimizer.step()
        for w, g in zip(self._global, saved):
            w.grad = g

    def snapshot(self) -> Dict[str, Any]:
        """A private copy of everything this optimizer needs to continue: the user's optimizer
        state, the global weights, the counters and the policy's state. Nothing in flight is in
        it: take it after :meth:`sync_weights` (elastic's ``commit()`` does)."""
        return {"optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "weights": [w.detach().clone() for w in self._global],
                "counters": {"step": self._step, "phase": self._phase},
                "policy": copy.deepcopy(self._extra_state())}

    @torch.no_grad()
    def restore_snapshot(self, snapshot: Dict[str, Any]) -> None:
        """Goes back to `snapshot` (local weights = its global weights); what was in flight is
        dropped unapplied, without waiting (after a failure it never completes)."""
        self._drop_in_flight()
        self.optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
        for w, saved in zip(self._global, snapshot["weights"]):
            w.copy_(saved)
        self._load_counters_and_policy(snapshot["counters"], copy.deepcopy(snapshot["policy"]))

    def shared_state(self) -> Dict[str, Any]:
        """What every rank takes from rank 0 after an elastic reset besides the user's optimizer
        state and the global weights: the counters and the policy's state, less what belongs
        to each process (``per_process_state``, e.g. 2-bit error-feedback residuals)."""
        policy = {k: v for k, v in self._extra_state().items() if k not in self.per_process_state}
        return {"counters": {"step": self._step, "phase": self._phase}, "policy": policy}

    @torch.no_grad()
    def load_shared_state(self, state: Dict[str, Any]) -> None:
        """Loads rank 0's :meth:`shared_state` once the global weights are rank 0's too; the
        local weights become the global weights."""
        self._load_counters_and_policy(state["counters"], state["policy"])

    def _load_counters_and_policy(self, counters: Dict[str, int], policy: Dict[str, Any]) -> None:
        self._step, self._phase = int(counters["step"]), int(counters["phase"])
        self._load_extra_state(policy)
        if self.separate_global_weights:
            self._params_from_global()
        self._reload_weights = False
        self._started = True

    def add_param_group(self, param_group):
        raise NotImplementedError("add parameter groups to the optimizer before wrapping it in "
                                  f"DistributedOptimizer(algorithm={self.algorithm!r})")

    def communication_stats(self) -> Dict[str, int]:
        """Bytes this rank contributed to collectives since construction (payload, not wire)."""
        return dict(self._stats)

    @property
    def global_weights(self) -> List[torch.Tensor]:
        """The global weights W, one tensor per trainable parameter (the parameters themselves
        for policies without separate global weights)."""
        return self._global

    @property
    def steps(self) -> int:
        return self._step

    # -- shared machinery -----------------------------------------------------------------------

    def _split_global_weights(self) -> List[torch.Tensor]:
        """Re-points the user's optimizer at copies W of the trainable parameters."""
        replacement = {}
        for p in self._params:
            w = p.detach().clone()
            replacement[id(p)] = w
            if p in self.optimizer.state:
                self.optimizer.state[w] = self.optimizer.state.pop(p)
        for group in self.optimizer.param_groups:
            group["params"] = [replacement.get(id(p), p) for p in group["params"]]
        return [replacement[id(p)] for p in self._params]

    def _begin(self) -> None:
        self._follow_transport()
        if not self._started:
            counters = self._comm.broadcast_object({"step": self._step, "phase": self._phase})
            self._step, self._phase = int(counters["step"]), int(counters["phase"])
            self._started = True
        if self._reload_weights:
            if self.separate_global_weights:
                for w, p in zip(self._global, self._params):
                    w.copy_(p)
            self._reload_weights = False

    def _grads(self) -> List[torch.Tensor]:
        """The local gradients (zeros where backward produced none, dense where it was sparse)."""
        out = []
        for p in self._params:
            g = p.grad
            if g is None:
                g = torch.zeros_like(p)
            elif g.is_sparse:
                g = g.to_dense()
            out.append(g)
        return out

    def _buffer(self, slot: int, layout: _Layout) -> torch.Tensor:
        self._follow_transport()
        buf = self._buffers[slot][layout.index]
        if buf is None:
            buf = self._comm.alloc(layout.count, layout.dtype)
            self._buffers[slot][layout.index] = buf
        return buf

    def _name(self, purpose: str, slot: int, layout: _Layout) -> str:
        return f"fasthorovod.{self.algorithm}.{self._instance}.{purpose}.{slot}.{layout.index}"

    def _post_average(self, flat: torch.Tensor, name: str) -> Handle:
        """Starts averaging `flat` in place over all ranks, through the compressor if any."""
        compression = self._compression
        compressed, ctx = (flat, None) if compression is None else compression.compress(flat)
        self._stats["allreduce_bytes"] += compressed.numel() * compressed.element_size()
        self._stats["collectives"] += 1
        handle = self._comm.allreduce_average_async(compressed, name)
        if compressed is flat:
            return handle

        def finish():
            flat.copy_(compression.decompress(handle.wait(), ctx))
            return flat
        return Handle(finish)

    def _post_grads(self, grads: Sequence[torch.Tensor], slot: int, purpose: str = "grad",
                    steps: int = 1) -> _InFlight:
        handles = []
        for layout in self._layouts:
            flat = layout.pack([grads[i] for i in layout.positions], self._buffer(slot, layout))
            handles.append(self._post_average(flat, self._name(purpose, slot, layout)))
        return _InFlight(handles, steps)

    def _apply_global(self, averaged: Sequence[torch.Tensor]) -> None:
        """W <- Opt(W, averaged): one step of the user's optimizer with `averaged` (one flat buffer
        per layout) as the gradient of the global weights."""
        for layout, flat in zip(self._layouts, averaged):
            for i, view in zip(layout.positions, layout.views(flat)):
                w = self._global[i]
                w.grad = view if view.device == w.device else view.to(w.device)
        self.optimizer.step()
        for w in self._global:
            w.grad = None

    def _params_from_global(self) -> None:
        for p, w in zip(self._params, self._global):
            p.copy_(w)

    def _ssgd_step(self, slot: int = 0) -> None:
        """Synchronous SGD: average this step's gradients, apply the user's optimizer, and (with
        separate global weights) copy W into the parameters."""
        grads = self._grads()
        averaged = self._post_grads(grads, slot, purpose="ssgd").wait()
        if self.separate_global_weights:
            self._apply_global(averaged)
            self._params_from_global()
            return
        for layout, flat in zip(self._layouts, averaged):
            for i, view in zip(layout.positions, layout.views(flat)):
                self._set_grad(self._params[i], view)
        self.optimizer.step()

    @staticmethod
    def _set_grad(p: torch.Tensor, value: torch.Tensor) -> None:
        if p.grad is None or p.grad.is_sparse:
            p.grad = value.to(p.device, copy=True)
        else:
            p.grad.copy_(value)

    def _local_lr(self, i: int) -> float:
        """Local learning rate of parameter i: local_lr_scale times its group's current lr."""
        return self.local_lr_scale * self.optimizer.param_groups[self._group_of[i]]["lr"]
