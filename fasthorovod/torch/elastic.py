"""Horovod elastic with FastHorovod's proxies: ``hvd.elastic`` of ``import fasthorovod.torch as hvd``.

Everything of ``horovod.torch.elastic`` is here (``run``, ``TorchState``, ``ElasticSampler``,
``ObjectState``, ...). Two things differ, both so that the proxies follow the job as it grows and
shrinks (docs/elastic.md):

* :func:`run` resets with FastHorovod's ``shutdown()`` + ``init()``: on every reset each surviving
  worker's proxies are stopped and reaped and new ones are formed for the new rank and size
  before the state is synchronized; a worker that joins starts its proxies in ``hvd.init()`` as
  at any start. ``DistributedOptimizer`` moves its gradient buckets into the new proxies' shared
  memory on first use.
* An optimizer with a delayed-SGD policy (``algorithm=...``) is committed, restored and
  synchronized by :class:`ScheduledOptimizerStateHandler`; models and other optimizers by
  Horovod's handlers whose ``sync`` broadcasts go through the proxies (large tensors) instead of
  Horovod's single flow. All are registered first in Horovod's handler registry on import, so
  ``horovod.torch.elastic.TorchState`` uses them too.
"""
from __future__ import annotations

from horovod.common.elastic import ObjectState, State, run_fn  # noqa: F401  (as horovod.torch.elastic)
from horovod.torch.elastic import sampler, state  # noqa: F401
from horovod.torch.elastic.sampler import ElasticSampler
from horovod.torch.elastic.state import (
    ModelStateHandler,
    OptimizerStateHandler,
    StateHandler,
    TorchState,
    get_handler_registry,
    set_handler_registry,
)

from fasthorovod.scheduler import ScheduledOptimizer
from fasthorovod.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from fasthorovod.torch.mpi_ops import init, shutdown


def run(func):
    """Horovod's ``hvd.elastic.run`` decorator (same contract): runs ``func(state, ...)`` and, when
    workers are added or removed or a collective fails, restores or keeps the committed state,
    re-forms Horovod *and* the proxies for the new world, synchronizes the state from rank 0 and
    calls ``func`` again."""
    return run_fn(func, _reset)


def _reset():
    shutdown()  # stops and reaps this worker's proxies, then Horovod
    init()      # Horovod for the new rank and size, then new proxies


class ScheduledOptimizerStateHandler(StateHandler):
    """Elastic state of a delayed-SGD optimizer (``DistributedOptimizer(algorithm=...)``).

    * ``save`` (``state.commit()``): :meth:`~ScheduledOptimizer.sync_weights` first, a
      collective like every commit, so nothing is in flight and every rank holds the same global
      weights; then a private copy of the optimizer state, the global weights, the counters and
      the policy's state. A graceful removal (``HostsUpdatedInterrupt``) therefore loses nothing
      committed, delayed gradients included.
    * ``restore`` (after a failure): back to that copy; what was in flight is dropped.
    * ``sync`` (after every reset): every rank takes rank 0's optimizer state, global weights,
      counters and policy state; the local weights become the global weights. 2-bit
      error-feedback residuals stay with each process (zero on a new worker).
    """

    def __init__(self, optimizer: ScheduledOptimizer) -> None:
        super().__init__(optimizer)
        self._saved = optimizer.snapshot()  # no collective here: workers construct states at different times

    def save(self) -> None:
        self.value.sync_weights()
        self._saved = self.value.snapshot()

    def restore(self) -> None:
        self.value.restore_snapshot(self._saved)

    def sync(self) -> None:
        opt = self.value
        opt.reset_communication()
        opt.initialize_optimizer_state()  # every rank then broadcasts the same structure
        broadcast_optimizer_state(opt.optimizer, root_rank=0)
        broadcast_parameters([(f"fasthorovod.elastic.global.{i}", w) for i, w in enumerate(opt.global_weights)],
                             root_rank=0)
        opt.load_shared_state(broadcast_object(opt.shared_state(), root_rank=0,
                                               name="fasthorovod.elastic.scheduler"))


class ModelStateSyncHandler(ModelStateHandler):
    """Horovod's model handler; ``sync`` broadcasts the parameters through the proxies."""

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateSyncHandler(OptimizerStateHandler):
    """Horovod's optimizer handler; ``sync`` broadcasts the state through the proxies."""

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


def _register_handlers() -> None:
    import torch

    registry = get_handler_registry()
    ours = [(ScheduledOptimizer, ScheduledOptimizerStateHandler), (torch.nn.Module, ModelStateSyncHandler),
            (torch.optim.Optimizer, OptimizerStateSyncHandler)]
    if not any(handler is ScheduledOptimizerStateHandler for _, handler in registry):
        # first: the first match wins (ScheduledOptimizer is a torch.optim.Optimizer)
        set_handler_registry([*ours, *registry])


_register_handlers()

__all__ = ["ElasticSampler", "ModelStateSyncHandler", "OptimizerStateSyncHandler", "ScheduledOptimizerStateHandler",
           "TorchState", "run"]
