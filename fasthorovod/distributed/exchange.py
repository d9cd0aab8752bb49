"""Start-up's object exchanges (fasthorovod/proxy/startup.py) over the c10d store, without Horovod.

The data plane's start-up hands objects between ranks twice over: rank 0's job token to every rank
(``broadcast_object``), and every rank's address, ports and probe results to every rank
(``allgather_object``). Under torch.distributed the job's store (``TCPStore``, the one
``init_process_group`` rendezvoused on) carries them: one key per object and rank, under a prefix
of this process group's own and a number per exchange, so that no two exchanges share a key. Every
``get`` waits at most the store's timeout, the process group's.
"""
from __future__ import annotations

import itertools
import pickle
from typing import Any, List, Optional


class StoreExchange:
    def __init__(self, store, rank: int, size: int, prefix: str) -> None:
        self._store, self._rank, self._size, self._prefix = store, rank, size, prefix
        self._numbers = itertools.count()

    def _key(self, name: Optional[str]) -> str:
        return f"{self._prefix}/{next(self._numbers)}.{name or 'object'}"

    def broadcast_object(self, obj: Any, root_rank: int = 0, name: Optional[str] = None) -> Any:
        key = self._key(name)
        if self._rank == root_rank:
            self._store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self._store.get(key))

    def allgather_object(self, obj: Any, name: Optional[str] = None) -> List[Any]:
        key = self._key(name)
        self._store.set(f"{key}/{self._rank}", pickle.dumps(obj))
        return [obj if r == self._rank else pickle.loads(self._store.get(f"{key}/{r}")) for r in range(self._size)]
