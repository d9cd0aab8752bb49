"""Collectives in two stages, whose second is posted by a thread of the data plane's own.

Horovod's allgather takes a different first dimension on every rank, so the proxies' allgather of
rows (gather.py) first gathers every rank's row counts and only then lays the rows out. Horovod
submits a collective when it is called and lets its background thread run it; if the second
stage waited for the caller's ``synchronize``, a program that synchronizes its allgathers in an
order of its own on each rank (or blocks in a barrier first) would wait for a stage no rank has
posted. So the second stage is posted here, as soon as the first completes, whatever the caller
does meanwhile.

A request handed to :meth:`SecondStages.add` offers ``first_done()`` (never blocks),
``post_second()`` (posts the second stage, or records why it could not; never raises) and
``abandon(error)`` (the data plane is going away). The thread polls the pending requests' first
stages (a poll takes no lock another rank holds) with a backoff of 50 to 250 microseconds.
"""
from __future__ import annotations

import threading
import time
from typing import List

from fasthorovod.exceptions import FastHorovodError

FIRST_POLL_SECONDS = 50e-6
LAST_POLL_SECONDS = 250e-6


class SecondStages:
    def __init__(self) -> None:
        self._pending: List = []
        self._wake = threading.Condition()
        self._thread = None
        self._closed = False

    def add(self, request) -> None:
        """Posts `request`'s second stage once its first is done (starts the thread at first use)."""
        with self._wake:
            if self._closed:
                request.abandon(FastHorovodError("FastHorovod proxies are shut down"))
                return
            self._pending.append(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fasthorovod-second-stages", daemon=True)
                self._thread.start()
            self._wake.notify()

    def close(self) -> None:
        """Abandons what is pending (their waiters raise) and stops the thread."""
        with self._wake:
            self._closed = True
            pending, self._pending = self._pending, []
            self._wake.notify()
        for request in pending:
            request.abandon(FastHorovodError("FastHorovod proxies shut down before a collective's second stage"))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        pause = FIRST_POLL_SECONDS
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                    pause = FIRST_POLL_SECONDS
                if self._closed:
                    return
                ready = [r for r in self._pending if r.first_done()]
                self._pending = [r for r in self._pending if r not in ready]
            for request in ready:
                request.post_second()
            if ready:
                pause = FIRST_POLL_SECONDS
            else:
                time.sleep(pause)
                pause = min(2 * pause, LAST_POLL_SECONDS)
