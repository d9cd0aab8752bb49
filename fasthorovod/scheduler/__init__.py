"""Scheduling policies for data-parallel training: delayed and compressed SGD variants.

``hvd.DistributedOptimizer(optimizer, named_parameters=..., algorithm=NAME, **options)`` with

=============  ==========================================================================
``ssgd``       synchronous SGD on gradient buckets posted during backward: :class:`SSGD`
               (the default; Horovod's semantics)
``od-sgd``     one-step delay: :class:`ODSGD`
``ssd-sgd``    several-steps delay with GLU: :class:`SSDSGD`
``cd-sgd``     2-bit compression + one-step delay + k-step correction: :class:`CDSGD`
``local-sgd``  (post-)local SGD: :class:`LocalSGD`
``ssgd-2bit``  synchronous SGD on 2-bit gradients: :class:`SSGD2Bit` (also selected by
               ``compression=TwoBitCompression(...)`` with ``algorithm="ssgd"``)
=============  ==========================================================================

Each policy is a small class behind one interface (:class:`ScheduledOptimizer`) that wraps the
user's optimizer by composition and talks to the other ranks only through a :class:`Communicator`.
``fasthorovod.torch.DistributedOptimizer`` returns the policy itself, except for ``ssgd``, where it
returns Horovod's optimizer class as a thin surface over :class:`SSGD` (what Horovod's own code and
tests check of it: isinstance of the user's class, ``__module__``, ``skip_synchronize``). The delayed policies keep the model's parameters as *local*
weights; call ``optimizer.sync_weights()`` (on every rank) before evaluating or checkpointing to
set them to the global weights. The exact update equations are in docs/algorithms.md.
"""
from __future__ import annotations

from typing import Dict, Type

import torch

from fasthorovod.scheduler.base import ScheduledOptimizer
from fasthorovod.scheduler.comm import AVERAGE, SUM, Communicator, Handle
from fasthorovod.scheduler.delayed import CDSGD, ODSGD, SSDSGD
from fasthorovod.scheduler.quantize import TwoBitCompression, dequantize_sum_2bit, quantize_2bit
from fasthorovod.scheduler.ssgd import SSGD
from fasthorovod.scheduler.sync import SSGD2Bit, LocalSGD

ALGORITHMS: Dict[str, Type[ScheduledOptimizer]] = {
    cls.algorithm: cls for cls in (SSGD, ODSGD, SSDSGD, CDSGD, LocalSGD, SSGD2Bit)
}

__all__ = [
    "ALGORITHMS", "AVERAGE", "CDSGD", "Communicator", "DistributedOptimizer", "Handle", "LocalSGD",
    "ODSGD", "SSDSGD", "SSGD", "SSGD2Bit", "SUM", "ScheduledOptimizer", "TwoBitCompression", "dequantize_sum_2bit",
    "quantize_2bit",
]


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         op=None, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=None, algorithm="ssgd", communicator: Communicator = None, **options):
    """Wraps `optimizer` in the scheduling policy `algorithm` (see the module docstring).

    Takes ``fasthorovod.torch.DistributedOptimizer``'s arguments in this package's own terms
    (``fasthorovod.torch`` translates Horovod's values): ``op`` is None (average), :data:`AVERAGE`
    or :data:`SUM` (``ssgd`` only: the other policies average), ``process_set`` must be None (the
    communicator's ranks), ``compression`` is None (no compression), a compressor with
    ``compress``/``decompress`` such as Horovod's ``Compression.fp16`` (ssgd, od-sgd, ssd-sgd: their
    full-precision allreduces), or a :class:`TwoBitCompression` (ssgd, cd-sgd).
    ``backward_passes_per_step``: ``ssgd`` counts passes as Horovod does; the other policies read
    gradients when ``step()`` runs, so several backward passes simply accumulate (od-sgd then
    turns ``overlap_backward`` off). ``gradient_predivide_factor``, ``groups`` and
    ``sparse_as_dense`` are ``ssgd``'s, as Horovod's. ``communicator`` (required) carries the
    collectives: FastHorovod's from ``fasthorovod.torch``, a fake world of ranks in tests.

    Raises:
        ValueError: an unknown algorithm or option, a bad option value, or an argument the
            algorithm does not support (named in the message).
    """
    if communicator is None:
        raise TypeError("DistributedOptimizer(algorithm=...) needs a communicator; use "
                        "fasthorovod.torch.DistributedOptimizer, which passes FastHorovod's")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if process_set is not None:
        raise ValueError(f"algorithm {algorithm!r} runs on the global process set only")
    if algorithm == "ssgd" and isinstance(compression, TwoBitCompression):
        algorithm = "ssgd-2bit"
    if algorithm == "ssgd":
        if options:
            raise ValueError(f"algorithm options {', '.join(sorted(options))} given with algorithm='ssgd', which "
                             f"takes none; choose one of {', '.join(sorted(ALGORITHMS))}")
        if op not in (None, AVERAGE, SUM):
            raise ValueError(f"algorithm 'ssgd' reduces with op {AVERAGE!r} or {SUM!r}, got {op!r}")
        if gradient_predivide_factor != 1.0 and op == SUM:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        return SSGD(optimizer, communicator, named_parameters=_checked_names(optimizer, named_parameters),
                    compression=compression, op=op or AVERAGE, gradient_predivide_factor=gradient_predivide_factor,
                    groups=_checked_groups(groups if groups is not None or not num_groups else num_groups),
                    sparse_as_dense=sparse_as_dense, backward_passes_per_step=backward_passes_per_step)
    cls = ALGORITHMS.get(algorithm)
    if cls is None:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(sorted(ALGORITHMS))}")
    unknown = sorted(set(options) - set(cls.OPTIONS))
    if unknown:
        raise ValueError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
                         f"algorithm {algorithm!r}; its options are {', '.join(sorted(cls.OPTIONS)) or 'none'}")

    if op not in (None, AVERAGE):
        raise ValueError(f"algorithm {algorithm!r} averages gradients: op must be Average")
    if gradient_predivide_factor != 1.0:
        raise ValueError(f"gradient_predivide_factor is not supported with algorithm {algorithm!r}")
    if num_groups or groups is not None:
        raise ValueError(f"groups/num_groups are not supported with algorithm {algorithm!r} "
                         "(gradients travel as one flat buffer per dtype)")
    if backward_passes_per_step > 1 and "overlap_backward" in cls.OPTIONS:
        if options.get("overlap_backward"):
            raise ValueError(f"overlap_backward=True sends gradients during backward, so it cannot "
                             f"accumulate backward_passes_per_step={backward_passes_per_step} passes")
        options["overlap_backward"] = False
    del sparse_as_dense  # sparse gradients are always densified

    compressor = None
    if isinstance(compression, TwoBitCompression):
        if algorithm not in ("ssgd-2bit", "cd-sgd"):
            raise ValueError(f"TwoBitCompression works with algorithm 'ssgd' or 'cd-sgd', not {algorithm!r}")
        if "threshold" in options and options["threshold"] != compression.threshold:
            raise ValueError(f"threshold={options['threshold']} contradicts {compression!r}")
        options["threshold"] = compression.threshold
    elif compression is not None:
        if algorithm not in ("od-sgd", "ssd-sgd"):
            raise ValueError(f"compression {getattr(compression, '__name__', compression)!r} is not supported "
                             f"with algorithm {algorithm!r}")
        compressor = compression

    for name, value in options.items():  # bad values fail before any collective is set up
        cls.OPTIONS[name].check(name, value)
    return cls(optimizer, communicator, named_parameters=_checked_names(optimizer, named_parameters),
               compression=compressor, **options)


def _checked_groups(groups):
    """Horovod's checks on groups: a positive number, or lists of distinct tensors."""
    if groups is None:
        return None
    if not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
    return groups


def _checked_names(optimizer, named_parameters):
    """Horovod's checks on named_parameters (duplicates, unnamed parameters)."""
    if named_parameters is None:
        return None
    named_parameters = list(named_parameters)
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                         "by model.named_parameters().")
    names = [n for n, _ in named_parameters]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    named = {id(p) for _, p in named_parameters}
    unnamed = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in named]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         "Python object ids: " + ", ".join(str(id(p)) for p in unnamed))
    return named_parameters
