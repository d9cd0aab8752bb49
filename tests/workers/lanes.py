"""The lanes' counters of one rank, reported to the test that launched it (tests/multiproc/harness.py).

A test that claims the proxy path (or Horovod's) proves it from the proxies' own counters: the
worker calls :func:`keep` before ``hvd.init()`` and :func:`report` once its scenario has succeeded;
the harness parses the line and checks every rank's (``run_job(..., proxied=...)``).

:func:`keep` wraps ``ProxyGroup.close`` so that the counters of every data plane this process ran
are kept when it closes (``hvd.shutdown()``, ``hvd.restart_proxies()``, an elastic reset);
:func:`report` prints them, and those of the data plane still running, as one line::

    FASTHOROVOD_LANES {"rank": R, "planes": [{"rank": R, "size": N, "lanes": [{"bytes_sent": ..,
                       "bytes_received": .., "collectives": ..}, ...]}, ...]}

``planes`` is empty when no proxies ran (size 1, ``FASTHOROVOD_NUM_LANES=0``, or Horovod's own
module). A job that runs several scenarios one after another (worker.py's ``SCENARIO,SCENARIO``)
also prints one line per scenario, with ``"scenario": NAME`` and what the lanes did during it
(:func:`since`), so that each test sharing the job checks its own scenario's claim.
"""
import json
import sys

PREFIX = "FASTHOROVOD_LANES "
COUNTERS = ("bytes_sent", "bytes_received", "collectives", "mesh_bytes_sent", "mesh_bytes_received")

_closed_planes = []


def _snapshot(group) -> dict:
    return {"rank": group.rank, "size": group.size,
            "lanes": [{k: int(lane[k]) for k in COUNTERS} for lane in group.lane_stats()]}


def keep() -> None:
    """Keeps the counters of every data plane of this process when it closes. Idempotent; nothing
    to keep in a process that runs Horovod's own module (FastHorovod not imported)."""
    module = sys.modules.get("fasthorovod.proxy.group")
    if module is None:
        return
    ProxyGroup = module.ProxyGroup
    if getattr(ProxyGroup.close, "keeps_lane_counters", False):
        return
    close = ProxyGroup.close

    def close_keeping_counters(self):
        if not self._closed and self.channel is not None:
            _closed_planes.append(_snapshot(self))
        return close(self)

    close_keeping_counters.keeps_lane_counters = True
    ProxyGroup.close = close_keeping_counters


def _settled_snapshot(group, timeout: float = 5.0) -> dict:
    """The counters once the lanes are idle: a proxy counts a collective after the ring's last
    frame, which can trail the worker's return by a moment (a joined rank's zero-filled part ends
    with the others' allreduce, and its join may return first). Read until two reads 50 ms apart
    agree, for at most `timeout` seconds; the claim is then checked against what the lanes did."""
    import time

    deadline = time.monotonic() + timeout
    snapshot = _snapshot(group)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        again = _snapshot(group)
        if again == snapshot:
            break
        snapshot = again
    return snapshot


def planes(hvd=None) -> list:
    """The counters of the data planes closed so far and of the one `hvd` (a module with
    ``proxy_group()``; Horovod's own has none) still runs."""
    group = getattr(hvd, "proxy_group", lambda: None)() if hvd is not None else None
    running = [_settled_snapshot(group)] if group is not None and not group._closed else []
    return _closed_planes + running


def since(before: list, after: list) -> list:
    """What the lanes did between two :func:`planes` readings: data planes are listed in the order
    they ran (closed ones first), so plane i of `before` is plane i of `after`, and a plane that
    started in between counts whole."""
    out = []
    for i, plane in enumerate(after):
        if i < len(before):
            plane = dict(plane, lanes=[{k: lane[k] - old[k] for k in COUNTERS}
                                       for lane, old in zip(plane["lanes"], before[i]["lanes"])])
        out.append(plane)
    return out


def bytes_sent(hvd=None) -> int:
    """What this process's lanes have sent, over all its data planes."""
    return sum(lane["bytes_sent"] for plane in planes(hvd) for lane in plane["lanes"])


def report(rank: int, hvd=None, scenario: str = None, before: list = None) -> None:
    """Prints this rank's line (:func:`planes`); with `scenario`, the line of that scenario: what
    the lanes did since `before` (a :func:`planes` reading taken when it started)."""
    line = {"rank": rank, "planes": planes(hvd)}
    if scenario is not None:
        line = {"rank": rank, "scenario": scenario, "planes": since(before or [], line["planes"])}
    print(PREFIX + json.dumps(line), flush=True)
