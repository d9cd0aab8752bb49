"""Drop-in replacement for ``horovod.torch``: ``import fasthorovod.torch as hvd``.

Every public name of ``horovod.torch`` 0.28.1 is available here with the same signature. The
lifecycle (``init``/``shutdown``), the allreduce, broadcast and reducescatter families, ``poll``/``synchronize``,
``join`` and ``DistributedOptimizer`` are FastHorovod's own (large Sum/Average allreduces and large
broadcasts travel through the proxy processes); ``broadcast_parameters``,
``broadcast_optimizer_state`` and ``broadcast_object`` are Horovod's functions running with these
broadcasts (fasthorovod/torch/functions.py); everything else is Horovod's object itself.
"""
from horovod.torch import (  # noqa: F401  (re-exported unchanged)
    Adasum,
    Average,
    Compression,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    SyncBatchNorm,
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    alltoall,
    alltoall_async,
    barrier,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
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
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
)
from horovod.torch.mpi_ops import handle_average_backwards_compatibility, is_homogeneous  # noqa: F401

from fasthorovod.exceptions import CollectiveMismatchError, FastHorovodError, FastHorovodTimeoutError  # noqa: F401
from fasthorovod.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters  # noqa: F401
from fasthorovod.torch.mpi_ops import (  # noqa: F401
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
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
    start_trace,
    stop_trace,
    synchronize,
)
from fasthorovod.torch.optimizer import DistributedOptimizer  # noqa: F401
from fasthorovod.torch import elastic  # noqa: F401,E402  (Horovod elastic with the proxies re-formed on reset)
