"""The proxy data plane: spawning, connecting and talking to a worker's proxy processes.

Its modules, from the bottom: ``core`` (the C++ core's codes and request structs), ``buffers``
(shared memory), ``hosts`` and ``probe`` (where the ranks are, how many flows the path needs),
``plan`` (what the data plane runs with, decided by pure functions), ``startup`` (running the plan:
token, peers, probe, proxies, rings), ``requests`` (posted collectives), ``group`` (the running data
plane), ``balance`` (the lane-rebalancing policy).

Import ``fasthorovod.proxy.group`` for :class:`ProxyGroup`; this package itself imports nothing
heavy, because every proxy process starts as ``python -m fasthorovod.proxy`` and must not pay for
importing torch.
"""
