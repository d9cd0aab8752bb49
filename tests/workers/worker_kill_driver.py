"""Workers SIGKILLed at random moments of a training loop: nothing may be left behind.

Run by tests/multiproc/test_lifecycle.py as ``python worker_kill_driver.py --trials N --seed S``.
Each trial forks two workers from this process (torch is imported once, here; no torch op runs
before the fork), each in a session of its own as a launcher would start it. They start real
ProxyGroups (two proxy processes each, real sockets, the real negotiation) with this process
standing in for Horovod's broadcast_object/allgather_object, and run a training loop: a persistent
gradient bucket allreduced in place (zero copy) and staged allreduces whose sizes keep growing, so
new shared-memory buffers are handed to the proxies all along. Then the victim worker dies by
SIGKILL, in one of four ways (in turn):

  random       at a random moment of the loop;
  new_size     by its own hand right after posting an allreduce of a new size (the new buffer's
               descriptor may still be in its proxies' sockets);
  stopped      after one of its proxies was SIGSTOPped (it cannot see anything until the kernel
               sends SIGHUP and SIGCONT to its orphaned process group);
  no_pidfd     at a random moment, with pidfd_open failing in the victim and its proxies (the
               fallback watches, as on Linux < 5.3).

This process is a child subreaper, so orphaned proxies become its children and nothing escapes
the check: the victim's proxies must exit (and be reaped here) right after it, the survivor must
raise and shut down cleanly, no process of the trial may be left, and /dev/shm must hold nothing
of theirs (there are no names to hold). One line per trial and a summary line (LEFTOVERS ...) go to stdout.
"""
import argparse
import ctypes
import os
import pickle
import random
import signal
import socket
import sys
import time

import torch

from fasthorovod.config import Config
from fasthorovod.proxy.group import ProxyGroup

PR_SET_CHILD_SUBREAPER = 36
KINDS = ["random", "new_size", "stopped", "no_pidfd"]
VICTIM = 1


# -- the stand-in for Horovod's object collectives (this process relays) ---------------------------

def _send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj)
    sock.sendall(len(data).to_bytes(8, "little") + data)


def _recv(sock: socket.socket):
    def exactly(n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    return pickle.loads(exactly(int.from_bytes(exactly(8), "little")))


class Relay:
    """A worker's end: every call sends its object and gets the collective's result."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def broadcast_object(self, obj, root, name=None):
        _send(self.sock, ("broadcast", root, obj))
        return _recv(self.sock)

    def allgather_object(self, obj, name=None):
        _send(self.sock, ("allgather", None, obj))
        return _recv(self.sock)

    def report(self, **fields) -> None:
        _send(self.sock, ("report", None, fields))


# -- a worker -----------------------------------------------------------------------------------------

def worker(rank: int, sock: socket.socket, kind: str, rng: random.Random) -> None:
    os.setsid()
    relay = Relay(sock)
    victim = rank == VICTIM
    if victim and kind == "no_pidfd":
        import fasthorovod_testing

        fasthorovod_testing.deny_pidfd_open()
    config = Config(num_lanes=2, timeout_seconds=10.0, proxy_threshold_bytes=0, probe="0")
    group = ProxyGroup.start(config, rank, 2, relay.broadcast_object, relay.allgather_object, single_host=True)
    bucket = group.alloc(1 << 18, torch.float32)  # a gradient bucket: views of shared memory
    relay.report(ready=True, proxies=[p.pid for p in group.processes], pidfds=group.channel.uses_pidfds)
    suicide_step = rng.randrange(2, 8) if kind == "new_size" else -1
    try:
        for step in range(1000):
            bucket.fill_(float(rank + step))
            group.allreduce([bucket], [bucket], f"bucket.{step}", False, 1.0, 1.0).wait()
            assert torch.all(bucket == 2 * step + 1), "wrong bucket sum"
            count = (1 << 14) << (step % 10)  # 64 KiB .. 32 MiB: a new size class for 10 steps
            x = torch.full((count + step,), float(rank + 1))
            out = torch.empty_like(x)
            request = group.allreduce([x], [out], f"staged.{step}", False, 1.0, 1.0)
            if victim and step == suicide_step:
                os.kill(os.getpid(), signal.SIGKILL)
            request.wait()
            assert torch.all(out == 3.0), "wrong staged sum"
        relay.report(error=None)
    except Exception as e:  # the survivor: its peer died
        relay.report(error=f"{type(e).__name__}: {e}"[:300])
    finally:
        started = time.monotonic()
        group.close()
        relay.report(closed_in=time.monotonic() - started)


# -- the driver ---------------------------------------------------------------------------------------

def _reap(pids) -> None:
    """Reaps those of `pids` that are this process's children now (orphaned proxies) and exited;
    never waitpid(-1), which could take a worker this driver still waits for."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def _exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def trial(index: int, kind: str, rng: random.Random) -> dict:
    socks, pids = [], []
    for rank in range(2):
        mine, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            mine.close()
            code = 0
            try:
                worker(rank, theirs, kind, random.Random(rng.random()))
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        theirs.close()
        socks.append(mine)
        pids.append(pid)
    for s in socks:
        s.settimeout(60)
    reports = [[], []]
    # Relay the set-up collectives until both workers report ready.
    while not all(any("ready" in r for r in reports[i]) for i in range(2)):
        msgs = [_recv(s) for s in socks]
        if msgs[0][0] == "report":
            for i, m in enumerate(msgs):
                reports[i].append(m[2])
            continue
        op, root, _ = msgs[0]
        result = msgs[root][2] if op == "broadcast" else [m[2] for m in msgs]
        for s in socks:
            _send(s, result)
    proxies = [r for rep in reports for r in rep if "proxies" in r]
    victim_proxies = proxies[VICTIM]["proxies"]
    everyone = set(pids) | {p for r in proxies for p in r["proxies"]}
    assert proxies[VICTIM]["pidfds"] is (kind != "no_pidfd"), proxies

    if kind in ("random", "no_pidfd"):
        time.sleep(rng.uniform(0.0, 1.0))
        os.kill(pids[VICTIM], signal.SIGKILL)
    elif kind == "stopped":
        time.sleep(rng.uniform(0.05, 0.5))
        os.kill(victim_proxies[rng.randrange(2)], signal.SIGSTOP)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(pids[VICTIM], signal.SIGKILL)
    os.waitpid(pids[VICTIM], 0)
    died = time.monotonic()
    # Its proxies are orphans now, this subreaper's children: reap them as they exit.
    while any(_exists(p) for p in victim_proxies) and time.monotonic() - died < 10:
        _reap(victim_proxies)
        time.sleep(0.002)
    proxies_gone = time.monotonic() - died

    survivor = 1 - VICTIM
    socks[survivor].settimeout(30)
    while not any("closed_in" in r for r in reports[survivor]):
        reports[survivor].append(_recv(socks[survivor])[2])
    os.waitpid(pids[survivor], 0)
    error = next(r["error"] for r in reports[survivor] if "error" in r)
    closed_in = next(r["closed_in"] for r in reports[survivor] if "closed_in" in r)
    deadline = time.monotonic() + 5
    while any(_exists(p) for p in everyone) and time.monotonic() < deadline:
        _reap(everyone - set(pids))
        time.sleep(0.005)
    left = sorted(p for p in everyone if _exists(p))
    shm = [n for n in os.listdir("/dev/shm") if any(f".{p}." in n for p in everyone)]
    for s in socks:
        s.close()
    return {"trial": index, "kind": kind, "left": left, "shm": shm, "survivor_error": error,
            "survivor_close_s": round(closed_in, 3), "victim_proxies_gone_s": round(proxies_gone, 3)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    rng = random.Random(args.seed)
    results = []
    for i in range(args.trials):
        r = trial(i, KINDS[i % len(KINDS)], rng)
        results.append(r)
        print(f"TRIAL {r}", flush=True)
    bad = [r for r in results if r["left"] or r["shm"] or r["survivor_error"] is None]
    gone = sorted(r["victim_proxies_gone_s"] for r in results)
    by_kind = {k: max(r["victim_proxies_gone_s"] for r in results if r["kind"] == k)
               for k in KINDS if any(r["kind"] == k for r in results)}
    print(f"LEFTOVERS trials={len(results)} bad={len(bad)} victim_proxies_gone_max={gone[-1]:.3f}s "
          f"median={gone[len(gone) // 2]:.3f}s max_by_kind={by_kind} "
          f"survivor_close_max={max(r['survivor_close_s'] for r in results):.3f}s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
