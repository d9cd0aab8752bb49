"""Drop-in replacement for ``horovod.torch``: ``import fasthorovod.torch as hvd``.

Every public name of ``horovod.torch`` 0.28.1 is available here with the same signature. The
lifecycle (``init``/``shutdown``), the allreduce, broadcast, allgather, reducescatter and alltoall
families, ``poll``/``synchronize``, ``join`` and ``DistributedOptimizer`` are FastHorovod's own (large
Sum/Average allreduces, reduce-scatters, broadcasts, allgathers and alltoalls travel through the
proxy processes); ``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``,
``allgather_object``, ``sparse_allreduce_async`` and ``barrier`` are Horovod's functions running
with these collectives (fasthorovod/torch/rebind.py); ``Compression`` is Horovod's with ``bf16`` added
(fasthorovod/torch/compression.py); everything else is Horovod's object itself.
"""
from horovod.torch import (  # noqa: F401  (re-exported unchanged)
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    SyncBatchNorm,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    size,
    start_timeline,
    stop_timeline,
)
from horovod.torch.mpi_ops import handle_average_backwards_compatibility, is_homogeneous  # noqa: F401

from fasthorovod.exceptions import CollectiveMismatchError, FastHorovodError, FastHorovodTimeoutError  # noqa: F401
from fasthorovod.torch.compression import Compression  # noqa: F401  (Horovod's, with bf16)
from fasthorovod.torch.functions import (  # noqa: F401
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from fasthorovod.torch.mpi_ops import (  # noqa: F401
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    join,
    poll,
    proxy_group,
    reducescatter,
    reducescatter_async,
    restart_proxies,
    shutdown,
    sparse_allreduce_async,
    start_trace,
    stop_trace,
    synchronize,
)
from fasthorovod.torch.optimizer import DistributedOptimizer  # noqa: F401
from fasthorovod.torch import elastic  # noqa: F401,E402  (Horovod elastic with the proxies re-formed on reset)
