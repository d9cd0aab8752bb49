"""``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object`` and
``allgather_object``: Horovod 0.28.1's own functions (horovod/torch/functions.py), run with this
package's broadcasts and allgathers (rebind.py).

Re-exporting them would keep every broadcast and allgather on Horovod's single TCP flow. Here the
very same code objects are bound to their module's globals in which ``broadcast_``,
``broadcast_async_``, ``allgather`` and ``synchronize`` are fasthorovod.torch's (large tensors go
through the proxies, fasthorovod/torch/mpi_ops.py) and the functions call each other's rebound
versions; nothing else changes, so their behaviour (argument handling, the optimizer-state
initialisation, scalars through ``broadcast_object``, errors) stays Horovod's, line for line.
"""
from __future__ import annotations

from horovod.torch import functions as _hvd_functions

from fasthorovod.torch import mpi_ops as _ops
from fasthorovod.torch.rebind import ModuleNamespace, rebound

_globals = ModuleNamespace(_hvd_functions, broadcast_=_ops.broadcast_, broadcast_async_=_ops.broadcast_async_,
                           allgather=_ops.allgather, synchronize=_ops.synchronize)

broadcast_parameters = rebound(_hvd_functions.broadcast_parameters, _globals, __name__)
broadcast_optimizer_state = rebound(_hvd_functions.broadcast_optimizer_state, _globals, __name__)
broadcast_object = rebound(_hvd_functions.broadcast_object, _globals, __name__)
allgather_object = rebound(_hvd_functions.allgather_object, _globals, __name__)
_globals.update(broadcast_parameters=broadcast_parameters, broadcast_optimizer_state=broadcast_optimizer_state,
                broadcast_object=broadcast_object, allgather_object=allgather_object)
