"""Completes the Gloo rendezvous scopes Horovod's rendezvous server leaves uncleared, so that a
test that calls hvd.init() again in the same processes does not read a peer's stale address.

Horovod's server (horovod/runner/http/http_server.py, ``RendezvousHandler.do_DELETE``) clears a
scope's addresses once each of the scope's ranks has said it is done with it, but on clearing any
scope it also forgets every other scope's progress (``finished_list.clear()``). A rank that
completes its one-rank cross scope between two ranks' "done" for the local scope leaves the local
scope full of addresses that will be stale after hvd.shutdown(); the next hvd.init() can then
connect to a port nobody listens on and abort with a Gloo connect timeout. Horovod's race, not
FastHorovod's: it is rare, and more frequent on a loaded machine.

Gloo stores one key per rank of a scope (its rank number), so "cleared" can be checked with GETs
and an uncleared scope completed with the missing "done"s (DELETEs: each counts one rank).
"""
import os
import urllib.error
import urllib.request



def _has_key(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        raise


def complete_scope(server: str, scope: str, size: int) -> bool:
    """Clears `scope` of the rendezvous server at `server` (http://ADDR:PORT) if it still holds
    addresses, by counting the ranks it misses as done; True if it had to."""
    for done in range(size + 1):  # each DELETE counts one rank as done; the size-th one clears it
        if not any(_has_key(f"{server}/{scope}/{r}") for r in range(size)):
            return done > 0
        if done < size:
            urllib.request.urlopen(urllib.request.Request(f"{server}/{scope}/0", method="DELETE"), timeout=10)
    raise AssertionError(f"rendezvous scope {scope} still holds addresses after {size} ranks said done")


def complete_uncleared_scopes() -> list:
    """Call on every rank after hvd.init() and a collective (every rank's rendezvous is over), and
    before a barrier (nobody initializes again meanwhile). Each scope is checked by its own rank 0;
    returns the scopes this rank had to complete."""
    import fasthorovod.torch as hvd

    server = f"http://{os.environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{os.environ['HOROVOD_GLOO_RENDEZVOUS_PORT']}"
    scopes = [("global", hvd.rank(), hvd.size()),
              (f"local_{os.environ['HOROVOD_HOSTNAME']}", hvd.local_rank(), hvd.local_size()),
              (f"cross_{hvd.local_rank()}", hvd.cross_rank(), hvd.cross_size())]
    return [scope for scope, rank, size in scopes if rank == 0 and complete_scope(server, scope, size)]
