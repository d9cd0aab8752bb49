"""The proxy data plane: spawning, connecting and talking to a worker's proxy processes.

Import ``fasthorovod.proxy.group`` for :class:`ProxyGroup`; this package itself imports nothing
heavy, because every proxy process starts as ``python -m fasthorovod.proxy`` and must not pay for
importing torch.
"""
