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
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from fasthorovod.exceptions import CollectiveMismatchError, FastHorovodError

if TYPE_CHECKING:
    from fasthorovod.proxy.group import ProxyGroup

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


class HeadsFirst:
    """A collective whose first stage is an allgather of every rank's *head* (what the ranks must
    learn of each other: row counts, splits, a hash of the tensors' other dimensions, small payloads)
    and whose second, posted here once the heads are in, is a request of the proxies, or nothing
    when the heads carried everything: the allgather of rows (gather.py) and the alltoall
    (alltoall.py). A subclass implements ``_second_stage()`` (reads ``self._heads.output``, returns
    the posted request or None, calling ``await_inputs()`` before it reads the caller's tensors;
    may raise, and the caller's ``wait()`` raises it) and ``_drop()``
    (gives back what it held for the second stage), and may override ``_finished()`` (after the
    second stage's wait)."""

    verb = "run"  # what the ranks do with their tensors, for the mismatch message
    # Whether a broken data plane ends the wait for the heads: for a collective whose every rank
    # takes the data plane's second stage at the size it has (the alltoall), a rank whose previous
    # collective failed never submits the next heads, which travel through Horovod (no timeout).
    # The allgather of rows leaves it off: a small one completes in its heads, and Horovod's own
    # allgather_object keeps working after a failure (the fault tests report through it).
    heads_end_with_the_data_plane = False

    def __init__(self, group: "ProxyGroup", heads, name: str, description: str,
                 inputs: Sequence[torch.Tensor] = ()) -> None:
        self._group = group
        self._heads = heads  # poll(), wait(), then output: one head per rank
        self._name = name
        self._description = description
        self._second = None
        self._error: Optional[BaseException] = None
        self._posted = threading.Event()
        # The caller's CUDA work that produces `inputs`, which the second stage reads on this
        # module's thread (its own current stream): an event on the caller's current stream.
        self._inputs_ready = None
        if any(t.is_cuda for t in inputs):
            self._inputs_ready = torch.cuda.Event()
            self._inputs_ready.record()

    def await_inputs(self) -> None:
        """Before the second stage reads the inputs: waits for the caller's CUDA work on them."""
        if self._inputs_ready is not None:
            self._inputs_ready.synchronize()

    # -- the second-stage thread's side --

    def first_done(self) -> bool:
        return self._heads.poll()

    def post_second(self) -> None:
        try:
            self._second = self._second_stage()
        except BaseException as e:  # raised to the caller by wait()
            self._error = e
        finally:
            self._drop()
            self._posted.set()

    def abandon(self, error: BaseException) -> None:
        self._error = error
        self._drop()
        self._posted.set()

    def _second_stage(self):
        raise NotImplementedError

    def _drop(self) -> None:
        pass

    def _finished(self) -> None:
        pass

    def check_descriptions(self, hashes: List[int]) -> None:
        """Raises CollectiveMismatchError naming the ranks whose description hash differs from this
        rank's. Every rank holds the same heads, so every rank raises, or none."""
        mine = hashes[self._group.rank]
        if any(h != mine for h in hashes):
            others = sorted(r for r, h in enumerate(hashes) if h != mine)
            raise CollectiveMismatchError(
                f"collective mismatch for tensor '{self._name}': ranks {others} {self.verb} tensors whose shapes "
                f"(but for the first dimension) or dtype differ from rank {self._group.rank}'s "
                f"({self._description}). A tensor name must describe the same collective on every rank.")

    # -- the caller's side --

    def poll(self) -> bool:
        return self._posted.is_set() and (self._error is not None or self._second is None or self._second.poll())

    def wait(self) -> None:
        """Blocks until the result is in; raises what failed. The wait for the heads has no time
        limit of its own, as any wait for other ranks to submit; the data plane's shutdown ends it,
        and with ``heads_end_with_the_data_plane`` so does its failure (on this rank or another)
        while the heads are not in, within 0.1 s. The second stage's wait has the data plane's
        timeout."""
        while not self._posted.wait(timeout=0.1):
            if self._group._closed:
                raise FastHorovodError("FastHorovod proxies are shut down")
            if self.heads_end_with_the_data_plane and not self._heads.poll():
                self._group.member.check()  # heads that are in: the second stage comes, and fails if it must
        if self._error is not None:
            raise self._error
        if self._second is not None:
            self._second.wait()
            self._finished()
