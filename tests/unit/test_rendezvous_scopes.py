"""The test workers' fix for a race in Horovod's Gloo rendezvous server (tests/workers/rendezvous.py),
against Horovod's own RendezvousServer: the order of "done"s that leaves a scope uncleared, and
its completion."""
import sys
import urllib.request
from pathlib import Path

import pytest

rendezvous = pytest.importorskip("horovod.runner.http.http_server")
from horovod.runner.common.util.hosts import SlotInfo  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
from rendezvous import _has_key, complete_scope  # noqa: E402


@pytest.fixture
def server():
    """Horovod's rendezvous server for 2 ranks on one host (scopes global and local_h: 2 ranks;
    cross_0 and cross_1: 1 rank each)."""
    srv = rendezvous.RendezvousServer()
    port = srv.start()
    srv.init([SlotInfo("h", r, r, 0, 2, 2, 1) for r in range(2)])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.stop()


def _http(method: str, url: str, data: bytes = None) -> None:
    urllib.request.urlopen(urllib.request.Request(url, data=data, method=method), timeout=10)


def test_a_one_rank_scope_completed_between_two_dones_leaves_the_local_scope_uncleared(server):
    for r in range(2):
        _http("PUT", f"{server}/local_h/{r}", b"address")
    _http("DELETE", f"{server}/local_h/0")   # rank 0 is done with the local scope,
    _http("PUT", f"{server}/cross_0/0", b"address")
    _http("DELETE", f"{server}/cross_0/0")   # completes its cross scope (which forgets the above),
    _http("DELETE", f"{server}/local_h/1")   # and rank 1's done is the only one counted
    assert _has_key(f"{server}/local_h/0") and _has_key(f"{server}/local_h/1"), "Horovod's race"

    assert complete_scope(server, "local_h", 2)
    assert not _has_key(f"{server}/local_h/0") and not _has_key(f"{server}/local_h/1")
    assert not complete_scope(server, "local_h", 2), "a cleared scope is left alone"


def test_the_usual_order_clears_every_scope_and_nothing_is_completed(server):
    for r in range(2):
        _http("PUT", f"{server}/local_h/{r}", b"address")
    for r in range(2):
        _http("DELETE", f"{server}/local_h/{r}")
    _http("PUT", f"{server}/cross_0/0", b"address")
    _http("DELETE", f"{server}/cross_0/0")
    assert not complete_scope(server, "local_h", 2) and not complete_scope(server, "cross_0", 1)
