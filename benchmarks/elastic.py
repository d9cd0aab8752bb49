"""Spot preemption on the emulated cloud: Horovod elastic with FastHorovod vs Horovod, one invocation.

For each backend, one elastic job (Horovod's launcher over ssh through ``fasthorovodrun
--emulate-cloud``, ``--min-np H-1 --max-np H``, the cloud's discovery script) trains
tests/workers/elastic_worker.py on H hosts; after ``--before`` steps the host of the last rank is
preempted abruptly (``python -m fasthorovod.netem host-down ID HOST --abrupt``: link cut, every
process on it killed); the survivors detect it (timeouts: FASTHOROVOD_TIMEOUT_SECONDS, Horovod's Gloo
timeout), restore the last commit, re-form and go on with H-1 workers; after ``--during`` steps
the host comes back (``host-up``) and the job grows to H again. Measured from rank 0's step lines:

* recovery: seconds from the preemption to the first completed step on the survivors;
* regrowth: seconds from ``host-up`` to the first completed step with H workers;
* images/s with H workers before, with H-1 during, and with H after (steps x batch x workers over
  the span of those steps, the first step after each reset left out).

    python benchmarks/elastic.py --cloud 4:1gbit:200mbit --model alexnet --out results/elastic.json
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "workers" / "elastic_worker.py"
FASTHOROVODRUN = Path(sys.executable).parent / "fasthorovodrun"
STEP = re.compile(r"STEP size (\d+) batch (\d+) time ([\d.]+)")
BATCH = 16  # elastic_worker.py's batch per worker


def _log_steps(text):
    return [(int(size), int(batch), float(t)) for size, batch, t in STEP.findall(text)]


def _netem(*args, env):
    done = subprocess.run([sys.executable, "-m", "fasthorovod.netem", *args], capture_output=True, text=True,
                          timeout=60, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"netem {' '.join(args)} failed: {done.stderr.strip()}")


def preemption_run(backend, cloud, hosts, model="mlp", before=4, during=4, after=4, timeout_s=30.0,
                   job_timeout=900.0, log_path=None, regrow=True, algorithm="ssgd"):
    """One elastic job with one abrupt preemption (and, with `regrow`, the host's return).

    Returns a dict: backend, recovery_s, regrowth_s, images_per_s {before, during, after}, steps,
    the ranks' final ELASTIC lines and the job's exit status. Raises on a job that fails or hangs.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               FASTHOROVOD_TIMEOUT_SECONDS=str(timeout_s), HOROVOD_GLOO_TIMEOUT_SECONDS=str(int(timeout_s)))
    if backend == "horovod":
        env["ELASTIC_WORKER_HOROVOD"] = "1"
    else:
        env.pop("ELASTIC_WORKER_HOROVOD", None)
    sizes = f"{hosts},{hosts - 1}" + (f",{hosts}" if regrow else "")
    cmd = [str(FASTHOROVODRUN), "--verbose", "--emulate-cloud", cloud, "-np", str(hosts), "--min-np", str(hosts - 1),
           "--max-np", str(hosts), "--blacklist-cooldown-range", "1", "2",
           sys.executable, "-u", str(WORKER), "--sizes", sizes, "--model", model, "--algorithm", algorithm,
           "--after", str(after), "--commit-every", "1", "--batch-sleep", "0"]
    log_path = Path(log_path or f"/tmp/fasthorovod-elastic-{backend}-{os.getpid()}.log")
    marks = {}
    with open(log_path, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + job_timeout

            def wait_for(predicate, what):
                while True:
                    text = log_path.read_text()
                    found = predicate(text)
                    if found:
                        return found
                    if proc.poll() is not None:
                        raise RuntimeError(f"{backend}: the job ended (rc {proc.returncode}) before {what}:\n"
                                           f"{text[-4000:]}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{backend}: no {what} within {job_timeout:.0f} s:\n{text[-4000:]}")
                    time.sleep(0.2)

            wait_for(lambda text: sum(1 for s in _log_steps(text) if s[0] == hosts) >= before, f"{before} steps")
            text = log_path.read_text()
            cloud_id = re.search(r"emulated cloud ([0-9a-f]{6}) ", text).group(1)
            # the host of the last rank: never rank 0's (whose loss costs Horovod's driver extra time
            # in notifying it), and the same role for every backend, wherever Horovod put the ranks
            victim = re.search(rf"HOROVOD_HOSTNAME=(host\d+) HOROVOD_RANK={hosts - 1} ", text).group(1)
            marks["victim"] = victim
            marks["preempted"] = time.time()
            _netem("host-down", cloud_id, victim, "--abrupt", env=env)
            wait_for(lambda text: [s for s in _log_steps(text) if s[0] == hosts - 1], "a step of the survivors")
            if regrow:
                wait_for(lambda text: sum(1 for s in _log_steps(text) if s[0] == hosts - 1) >= during,
                         f"{during} steps of the survivors")
                marks["returned"] = time.time()
                _netem("host-up", cloud_id, victim, env=env)
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
    text = log_path.read_text()
    if rc != 0:
        raise RuntimeError(f"{backend}: the job failed (rc {rc}):\n{text[-4000:]}")
    steps = _log_steps(text)
    phases = _phases(steps)
    result = {
        "backend": backend, "cloud": cloud, "preempted_host": marks["victim"], "model": model, "algorithm": algorithm, "timeout_s": timeout_s,
        "recovery_s": _first_after(steps, hosts - 1, marks["preempted"]) - marks["preempted"],
        "regrowth_s": (_first_after(steps, hosts, marks["returned"]) - marks["returned"]) if regrow else None,
        "images_per_s": {name: _rate(phase) for name, phase in zip(("before", "during", "after"), phases)},
        "steps": steps,
        "final": re.findall(r"ELASTIC rank \d+ size \d+ batch \d+ digest \w+", text),
        "log": str(log_path),
    }
    return result


def _first_after(steps, size, since):
    return min(t for s, _, t in steps if s == size and t >= since)


def _phases(steps):
    """Consecutive runs of steps with one world size."""
    phases = []
    for step in steps:
        if not phases or phases[-1][-1][0] != step[0]:
            phases.append([])
        phases[-1].append(step)
    return phases


def _rate(phase):
    """images/s over a phase, its first step (right after a reset or the start) left out."""
    timed = phase[1:]
    if len(timed) < 2:
        return None
    span = timed[-1][2] - timed[0][2]
    return (len(timed) - 1) * BATCH * timed[0][0] / span if span > 0 else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cloud", default="4:1gbit:200mbit", help="emulated cloud HOSTS:LINK:PER_FLOW (docs/netem.md)")
    parser.add_argument("--model", choices=["mlp", "alexnet"], default="alexnet")
    parser.add_argument("--backends", default="fasthorovod,horovod", help="fasthorovod and/or horovod, in this order")
    parser.add_argument("--before", type=int, default=4, help="steps with every host before the preemption")
    parser.add_argument("--during", type=int, default=4, help="steps of the survivors before the host returns")
    parser.add_argument("--after", type=int, default=4, help="steps after the job grew back")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="FASTHOROVOD_TIMEOUT_SECONDS and HOROVOD_GLOO_TIMEOUT_SECONDS (both default to 30)")
    parser.add_argument("--out", default="results/elastic.json")
    args = parser.parse_args(argv)
    hosts = int(args.cloud.split(":")[0])
    results = []
    for backend in args.backends.split(","):
        print(f"[elastic] {backend}: {hosts} hosts, preempting the last rank's host after {args.before} steps",
              flush=True)
        entry = preemption_run(backend, args.cloud, hosts, model=args.model, before=args.before, during=args.during,
                               after=args.after, timeout_s=args.timeout)
        rates = entry["images_per_s"]
        print(f"[elastic] {backend}: recovery {entry['recovery_s']:.1f} s, regrowth {entry['regrowth_s']:.1f} s, "
              f"images/s before {rates['before']}, during {rates['during']}, after {rates['after']}", flush=True)
        results.append(entry)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"benchmark": "elastic", "args": vars(args), "results": results}, indent=2))
    print(f"[elastic] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
