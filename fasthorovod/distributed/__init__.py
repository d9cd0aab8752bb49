"""FastHorovod as a torch.distributed backend: ``import fasthorovod.distributed`` registers
``"fasthorovod"``, so that ::

    import fasthorovod.distributed
    torch.distributed.init_process_group("fasthorovod")

gives DDP (and any program written against torch.distributed, launched by ``torchrun``) k TCP
flows per rank for its large collectives, with no Horovod running. A program that keeps Gloo as
its process group can still send DDP's buckets through the proxies with a communication hook,
:func:`~fasthorovod.distributed.hook.allreduce_hook`. See docs/distributed.md.
"""
from torch import distributed as _dist

from fasthorovod.distributed.backend import BACKEND_NAME, ProcessGroupFastHorovod, create  # noqa: F401
from fasthorovod.distributed.hook import allreduce_hook  # noqa: F401

if BACKEND_NAME.upper() not in _dist.Backend._plugins:
    _dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu", "cuda"])
