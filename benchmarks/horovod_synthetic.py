"""Horovod's own examples/pytorch/pytorch_synthetic_benchmark.py, unmodified, under Horovod and under
FastHorovod's patch switch, side by side.

The script is taken as it is from a checkout of Horovod 0.28.1 (``--horovod-src``; nothing of
Horovod's is stored in this repository). It does ``import horovod.torch as hvd`` and ``from
torchvision import models``, so its ranks run in an environment that has torchvision
(``make setup-torchvision`` builds .venv-torchvision: torch 2.14.1 and torchvision 0.29.1, Horovod
built against them, fasthorovod). Two backends, interleaved over ``--rounds`` (A B A B ...):

    horovod      the launcher as given: ``horovodrun --gloo -np N python script ...``
    fasthorovod  the same launcher with ``--patch-horovod`` (fasthorovodrun's opt-in switch: the
                 script's ``import horovod.torch`` gives fasthorovod.torch, with its defaults)

Each job's figure is what the script prints itself ("Total img/sec on N CPU(s): X +-Y"). The
driver checks that the switch was on in every fasthorovod job and off in every horovod job (rank 0
says so on stderr when the import happens): a baseline that was secretly FastHorovod, or the
reverse, fails the job instead of giving a ratio. It reports per backend the median over the rounds
with the spread, and FastHorovod's speed-up over Horovod round by round.

    make setup-torchvision
    git clone --depth 1 -b v0.28.1 https://github.com/horovod/horovod /tmp/horovod-src
    .venv/bin/python benchmarks/horovod_synthetic.py --horovod-src /tmp/horovod-src \\
        --launcher-prefix ".venv-torchvision/bin/fasthorovodrun --emulate-cloud 4:1gbit:200mbit" \\
        --np 4 --rounds 3 --out results/horovod-synthetic.json
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys

import _common as common

SCRIPT = os.path.join("examples", "pytorch", "pytorch_synthetic_benchmark.py")
BACKENDS = ("horovod", "fasthorovod")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PYTHON = os.path.join(REPO, ".venv-torchvision", "bin", "python")
# What rank 0 prints on stderr when the patch switch hands out fasthorovod.torch (fasthorovod/patch.py).
SWITCH_LINE = "horovod.torch is fasthorovod.torch in this job"
_TOTAL = re.compile(r"Total img/sec on (\d+) [CG]PU\(s\): ([0-9.]+) \+-([0-9.]+)")
_ITER = re.compile(r"Iter #(\d+): ([0-9.]+) img/sec per [CG]PU")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Horovod's unmodified pytorch_synthetic_benchmark.py under Horovod and under "
                    "FastHorovod's patch switch (fasthorovodrun --patch-horovod), interleaved "
                    "rounds, the script's own img/sec per job, FastHorovod's speed-up round by round.")
    parser.add_argument("--horovod-src", required=True, metavar="DIR",
                        help=f"a checkout of Horovod 0.28.1; the script run is DIR/{SCRIPT}")
    parser.add_argument("--python", default=DEFAULT_PYTHON,
                        help="the ranks' interpreter, in an environment with torch, torchvision, horovod "
                             "and fasthorovod (default: .venv-torchvision/bin/python, made by `make "
                             "setup-torchvision`)")
    parser.add_argument("--launcher-prefix", type=shlex.split, metavar="CMD",
                        help="a horovodrun-compatible launcher that starts both backends' ranks, e.g. "
                             "'.venv-torchvision/bin/fasthorovodrun --emulate-cloud 4:1gbit:200mbit' "
                             "(default: the interpreter's horovodrun for Horovod, its fasthorovodrun for "
                             "FastHorovod); it receives [--patch-horovod] --gloo -np N and the script")
    parser.add_argument("--np", type=int, default=2, help="number of ranks (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run both backends this many times, interleaved (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds one job may take before it is killed (default: %(default)s)")
    parser.add_argument("--threads", type=int,
                        help="OMP_NUM_THREADS per rank (default: cores / np, at least 1)")
    parser.add_argument("--model", default="alexnet",
                        help="the script's --model, a torchvision model (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="the script's --batch-size (default: %(default)s)")
    parser.add_argument("--num-warmup-batches", type=int, default=2,
                        help="the script's --num-warmup-batches (default: %(default)s)")
    parser.add_argument("--num-batches-per-iter", type=int, default=2,
                        help="the script's --num-batches-per-iter (default: %(default)s)")
    parser.add_argument("--num-iters", type=int, default=3,
                        help="the script's --num-iters (default: %(default)s)")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="pass the script's --fp16-allreduce (Horovod's Compression.fp16)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.script = os.path.join(args.horovod_src, SCRIPT)
    if not os.path.isfile(args.script):
        parser.error(f"--horovod-src {args.horovod_src}: no {SCRIPT} there (a checkout of Horovod 0.28.1 "
                     "is expected)")
    if not os.access(args.python, os.X_OK):
        parser.error(f"--python {args.python}: not an executable (`make setup-torchvision` builds the default)")
    for name in ("np", "rounds", "batch_size", "num_batches_per_iter", "num_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.threads is None:
        args.threads = common.default_threads(args.np)
    return args


def script_argv(args):
    """The script's command line (it runs on the CPU: --no-cuda)."""
    argv = [args.python, "-u", args.script, "--model", args.model, "--batch-size", str(args.batch_size),
            "--num-warmup-batches", str(args.num_warmup_batches),
            "--num-batches-per-iter", str(args.num_batches_per_iter), "--num-iters", str(args.num_iters),
            "--no-cuda"]
    return argv + (["--fp16-allreduce"] if args.fp16_allreduce else [])


def launch_argv(backend, args):
    """One job's command line: the launcher ([--patch-horovod] for fasthorovod), --gloo -np N, the script."""
    if args.launcher_prefix:
        launcher = list(args.launcher_prefix)
    else:
        tool = "horovodrun" if backend == "horovod" else "fasthorovodrun"
        launcher = [os.path.join(os.path.dirname(args.python), tool)]
    if backend == "fasthorovod":
        launcher.append("--patch-horovod")
    return launcher + ["--gloo", "-np", str(args.np)] + script_argv(args)


def parse_output(lines, np):
    """The script's figures from a job's output: {"total_img_s", "total_conf", "iters"} (img/s per
    rank of each timed iteration), and whether the patch switch said it was on; raises ValueError
    when the total is missing or counts another number of ranks."""
    total = next((m for m in map(_TOTAL.search, reversed(lines)) if m), None)
    if total is None:
        raise ValueError("the script printed no 'Total img/sec' line")
    if int(total.group(1)) != np:
        raise ValueError(f"the script ran on {total.group(1)} ranks, not {np}")
    iters = {}
    for match in filter(None, map(_ITER.search, lines)):
        iters[int(match.group(1))] = float(match.group(2))
    return {"total_img_s": float(total.group(2)), "total_conf": float(total.group(3)),
            "iters": [iters[i] for i in sorted(iters)],
            "patched": any(SWITCH_LINE in line for line in lines)}


def run_one(backend, args):
    """One job; its entry (status "ok" with the script's figures, else "failed" with the reason)."""
    argv = launch_argv(backend, args)
    entry = {"backend": backend, "commands": [common.portable_command(argv)]}
    print(f"== {backend}: {entry['commands'][0]}", file=sys.stderr, flush=True)
    env = common.base_env(args.threads)
    job = common.run_job([common.Process(argv)], args.timeout, env)
    entry["seconds"] = round(job.seconds, 1)
    if job.timed_out:
        return dict(entry, status="failed", reason=f"timed out after {args.timeout:g} s", tail=job.tail)
    if job.returncode != 0:
        return dict(entry, status="failed", reason=f"exit status {job.returncode}",
                    error=common.first_error(job.tail), tail=job.tail)
    try:
        result = parse_output(job.tail, args.np)
    except ValueError as err:
        return dict(entry, status="failed", reason=str(err), tail=job.tail)
    if result["patched"] != (backend == "fasthorovod"):
        state = "on" if result["patched"] else "off"
        return dict(entry, status="failed", reason=f"the patch switch was {state} in a {backend} job",
                    tail=job.tail)
    return dict(entry, status="ok", result=result)


def summarize(rounds):
    """Per backend the median total img/s over the rounds with its spread, and FastHorovod's
    speed-up over Horovod round by round."""
    totals = {b: [e["result"]["total_img_s"] if e["status"] == "ok" else None for e in r]
              for b, r in zip(BACKENDS, zip(*rounds))}
    ratios = common.paired_ratios(totals["fasthorovod"], totals["horovod"])
    return {"img_s": {b: common.spread(v) for b, v in totals.items()},
            "speedup": common.spread(ratios), "speedup_rounds": ratios}


def interpreter_versions(python):
    """torch, torchvision, horovod and fasthorovod as the ranks' interpreter has them."""
    code = ("import importlib.metadata as m, json\n"
            "v = {}\n"
            "for p in ('torch', 'torchvision', 'horovod', 'fasthorovod'):\n"
            "    try: v[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: v[p] = None\n"
            "print(json.dumps(v))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr.strip()[-300:]}


def driver(args):
    common.warn_inherited_fasthorovod_env()
    rounds = [[] for _ in range(args.rounds)]
    for number, backend in common.interleave(BACKENDS, args.rounds):
        entry = run_one(backend, args)
        rounds[number - 1].append(entry)
        figure = (f"{entry['result']['total_img_s']:.2f} img/s" if entry["status"] == "ok"
                  else f"{entry['status']}: {entry['reason']}")
        print(f"round {number}/{args.rounds}, {backend}: {figure} (job {entry['seconds']:.0f} s)", flush=True)
    summary = summarize(rounds)
    rows = [[b, common.format_spread(summary["img_s"][b])] for b in BACKENDS]
    print()
    print(f"{os.path.basename(SCRIPT)} --model {args.model} --batch-size {args.batch_size}, {args.np} ranks, "
          f"{args.rounds} rounds (median [min-max])")
    print(common.format_table(["backend", "total img/s"], rows))
    print(f"FastHorovod / Horovod, round by round: {common.format_spread(summary['speedup'], suffix='x')}")
    for entry in (e for r in rounds for e in r if e["status"] != "ok"):
        print(f"{entry['backend']}: {entry['reason']}" + (f"\n    {entry['error']}" if entry.get("error") else ""))
    if args.out:
        doc = common.report("horovod_synthetic", args, [e for r in rounds for e in r])
        doc["args"].update(script=SCRIPT, horovod_src="$HOROVOD_SRC",  # no path of this machine
                           python=common.portable_command([args.python]))
        doc["ranks_packages"] = interpreter_versions(args.python)
        doc["summary"] = summary
        common.write_json(args.out, doc)
    failed = any(e["status"] != "ok" for r in rounds for e in r)
    return 1 if failed else 0


def main(argv=None):
    return driver(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
