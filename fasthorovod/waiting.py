"""Waiting asleep for what a poll reports done (a Horovod handle, a proxies' request): the
package's one backoff loop, so that no wait holds a core the compute and the proxies need."""
from __future__ import annotations

import time
from typing import Callable, Optional


def poll_until(done: Callable[[], bool], first: float, most: float, deadline: Optional[float] = None) -> bool:
    """Calls `done` until it returns true, sleeping between calls from `first` seconds, doubling,
    up to `most`; returns True then, or False once ``time.monotonic()`` has passed `deadline` (None:
    never) with `done` still false."""
    pause = first
    while not done():
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, most)
    return True
