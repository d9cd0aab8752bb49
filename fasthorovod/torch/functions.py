"""``broadcast_parameters``, ``broadcast_optimizer_state`` and ``broadcast_object``: Horovod 0.28.1's
own functions (horovod/torch/functions.py), run with this package's broadcasts.

Horovod's functions call the broadcast ops that their module imported from horovod.torch.mpi_ops,
so re-exporting them would keep every broadcast on Horovod's single TCP flow. Here the very same
code objects are bound to a copy of that module's globals in which ``broadcast_``,
``broadcast_async_`` and ``synchronize`` are fasthorovod.torch's (large tensors go through the
proxies, fasthorovod/torch/mpi_ops.py) and the functions call each other's rebound versions;
nothing else changes, so their behaviour (argument handling, the optimizer-state initialisation,
scalars through ``broadcast_object``, errors) stays Horovod's, line for line.
"""
from __future__ import annotations

import functools
import types

from horovod.torch import functions as _hvd_functions

from fasthorovod.torch import mpi_ops as _ops

_globals = dict(vars(_hvd_functions))
_globals.update(broadcast_=_ops.broadcast_, broadcast_async_=_ops.broadcast_async_, synchronize=_ops.synchronize)


def _rebound(function: types.FunctionType) -> types.FunctionType:
    """`function`'s code with its global names looked up in ``_globals``."""
    copy = types.FunctionType(function.__code__, _globals, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    functools.update_wrapper(copy, function)
    copy.__module__ = __name__
    return copy


broadcast_parameters = _rebound(_hvd_functions.broadcast_parameters)
broadcast_optimizer_state = _rebound(_hvd_functions.broadcast_optimizer_state)
broadcast_object = _rebound(_hvd_functions.broadcast_object)
_globals.update(broadcast_parameters=broadcast_parameters, broadcast_optimizer_state=broadcast_optimizer_state,
                broadcast_object=broadcast_object)
