#!/usr/bin/env python3
"""Run Horovod's own test/parallel/test_torch.py against fasthorovod.torch (or horovod.torch).

    git clone --depth 1 -b v0.28.1 https://github.com/horovod/horovod /tmp/horovod-src
    .venv/bin/python scripts/horovod_tests.py /tmp/horovod-src --out /tmp/hvd-tests
    .venv/bin/python scripts/horovod_tests.py /tmp/horovod-src --module horovod.torch   # the baseline

The test file is copied (with test/utils) into OUT, the one line ``import horovod.torch as hvd``
becomes ``import fasthorovod.torch as hvd`` (or, with ``--module patch``, stays as it is and
FastHorovod's patch switch makes that import give fasthorovod.torch), and the suite runs under ``horovodrun --gloo -np NP``
(--np, default 2; 3 exercises the ring with a middle rank and uneven chunks) with
FASTHOROVOD_PROXY_THRESHOLD_BYTES=0 (every Sum/Average allreduce through the proxies) unless the
environment sets another threshold. Nothing of Horovod's is stored in this repository.

Horovod 0.28.1 with Gloo aborts at random in ``hvd.init()`` right after the previous test's
``hvd.shutdown()`` on a loaded machine (its rendezvous re-initialization race; natively too), which
kills the whole job. So the suite runs in chunks: after a job dies, the tests not yet reported run
in a fresh job. The death is charged to the first test not reported by the rank whose failure
ended the job (the launcher names it; the others were killed wherever they were), or else by every
rank. A test at which the job dies twice is recorded as CRASH, one that exceeds the
chunk timeout as HANG, and one at which the job died once and that then passed as FLAKY — never as
a plain pass: a rerun hides a death that may be ours, so the summary lists every rerun with the
exit status of the job that died. Prints the counts and every test that did not simply pass, and
writes OUT/summary.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Each rank records every test's outcome in its own file (FHVD_TESTS_RESULTS.rank<R>) before the
# next test starts, and reports each failure as soon as it happens: when a rank dies, the launcher
# kills the others, and what passed through its pipes could be lost and the death charged to the
# wrong test.
CONFTEST = '''import os
import sys


def _outcome(report):
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.passed:
            return "XPASS" if xfail else "PASSED"
        if report.skipped:
            return "XFAIL" if xfail else "SKIPPED"
        return "FAILED"
    if report.failed:
        return "ERROR"
    return "SKIPPED" if report.skipped else None


def pytest_runtest_logreport(report):
    if report.failed:
        sys.stdout.write(f"\\n===FAILURE {report.nodeid} [{report.when}]===\\n{report.longreprtext}\\n")
        sys.stdout.flush()
    outcome = _outcome(report)
    path = os.environ.get("FHVD_TESTS_RESULTS")
    if outcome is not None and path:
        with open(f"{path}.rank{os.environ.get('HOROVOD_RANK', '0')}", "a") as f:
            f.write(f"{report.nodeid} {outcome}\\n")
            f.flush()
            os.fsync(f.fileno())
'''


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("horovod_src", help="a Horovod 0.28.1 source checkout (holds test/parallel/test_torch.py)")
    parser.add_argument("--module", default="fasthorovod.torch", choices=["fasthorovod.torch", "horovod.torch", "patch"],
                        help="what the tests import as hvd; 'patch': the file unchanged (it imports "
                             "horovod.torch) with FastHorovod's patch switch on (fasthorovod/patch.py)")
    parser.add_argument("--out", default="/tmp/fasthorovod-horovod-tests", help="scratch directory and logs")
    parser.add_argument("-k", dest="keyword", help="only tests matching this pytest -k expression")
    parser.add_argument("--chunk-timeout", type=int, default=900, help="seconds one job may run")
    parser.add_argument("--np", type=int, default=2, help="ranks (horovodrun -np)")
    return parser.parse_args(argv)


def prepare(src: Path, out: Path, module: str) -> Path:
    """Copies Horovod's test/parallel/test_torch.py and test/utils into OUT; returns the test file."""
    original = src / "test" / "parallel" / "test_torch.py"
    if not original.is_file():
        sys.exit(f"error: {original} not found: pass a Horovod source checkout (git clone -b v0.28.1 ...)")
    try:
        import mock  # noqa: F401  (Horovod's test/utils/common.py imports it)
    except ImportError:
        sys.exit(f"error: Horovod's tests need the 'mock' package: {sys.executable} -m pip install mock")
    shutil.rmtree(out / "test", ignore_errors=True)
    (out / "test" / "parallel").mkdir(parents=True)
    shutil.copytree(src / "test" / "utils", out / "test" / "utils")
    text = original.read_text()
    if "import horovod.torch as hvd\n" not in text:
        sys.exit(f"error: {original} does not contain the line 'import horovod.torch as hvd'")
    target = out / "test" / "parallel" / "test_torch.py"
    if module != "patch":
        text = text.replace("import horovod.torch as hvd\n", f"import {module} as hvd\n", 1)
    target.write_text(text)
    (out / "test" / "parallel" / "conftest.py").write_text(CONFTEST)
    return target


def collect(test_file: Path, keyword: str | None) -> list:
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", test_file.name]
    listed = subprocess.run(argv + (["-k", keyword] if keyword else []), cwd=test_file.parent,
                            capture_output=True, text=True, timeout=600)
    tests = [line.strip() for line in listed.stdout.splitlines() if "::" in line]
    if not tests:
        sys.exit(f"error: no tests collected:\n{listed.stdout[-2000:]}{listed.stderr[-2000:]}")
    return tests


def run_chunks(tests: list, test_file: Path, out: Path, chunk_timeout: int, np_: int = 2) -> tuple:
    """Runs the tests in as many jobs as it takes; returns ({test: {rank: outcome}}, jobs,
    {test: [exit status of each job that died at it]})."""
    horovodrun = Path(sys.executable).parent / "horovodrun"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("FASTHOROVOD_PROXY_THRESHOLD_BYTES", "0")
    # Unbuffered, so that the log shows what each rank printed up to a death (the outcomes are in
    # the ranks' own files: CONFTEST).
    env["PYTHONUNBUFFERED"] = "1"
    results, deaths, remaining, chunk = {}, {}, list(tests), 0
    while remaining:
        chunk += 1
        log = out / f"chunk{chunk:02d}.log"
        recorded = out / f"chunk{chunk:02d}.results"
        env["FHVD_TESTS_RESULTS"] = str(recorded)
        argv = [str(horovodrun), "--gloo", "-np", str(np_), sys.executable, "-m", "pytest", "-v", "-p",
                "no:cacheprovider", *remaining]
        start = time.time()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(argv, cwd=test_file.parent, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=chunk_timeout, start_new_session=True).returncode
            except subprocess.TimeoutExpired:
                rc = None
        for rank in range(np_):
            per_rank = recorded.with_name(f"{recorded.name}.rank{rank}")
            for line in (per_rank.read_text(errors="replace").splitlines() if per_rank.exists() else []):
                test, _, result = line.rpartition(" ")
                results.setdefault(test, {})[rank] = result  # the last phase's word wins (a teardown ERROR)
        left = [t for t in remaining if len(results.get(t, {})) < np_]
        print(f"job {chunk}: exit {rc} after {time.time() - start:.0f} s, {len(remaining) - len(left)} reported, "
              f"{len(left)} left", flush=True)
        if left:
            first = charged_test(left, results, log.read_text(errors="replace"))
            deaths.setdefault(first, []).append(rc)
            if rc is None or len(deaths[first]) >= 2:
                kind = "HANG" if rc is None else "CRASH"
                for rank in range(np_):
                    results.setdefault(first, {}).setdefault(rank, kind)
                left.remove(first)
                print(f"  {first.split('::')[-1]}: {kind}", flush=True)
            else:
                print(f"  {first.split('::')[-1]}: the job died at it (exit {rc}); rerunning it in a fresh job",
                      flush=True)
        remaining = left
    return results, chunk, deaths


def charged_test(left: list, results: dict, log_text: str) -> str:
    """The test a dead job is charged with: the first that the rank whose failure ended the job
    (Horovod's launcher names it: "Terminating remaining workers after failure of Process N") did
    not report; the others were killed wherever they were, perhaps still before a test it had
    passed. Without that line, the first test not reported by every rank."""
    named = re.search(r"Terminating remaining workers after failure of Process (\d+)", log_text)
    if named:
        rank = int(named.group(1))
        for test in left:
            if rank not in results.get(test, {}):
                return test
    return left[0]


def outcome(per_rank: dict, died: int = 0) -> str:
    """One test's outcome over the ranks; `died`: how many jobs died at it before it was reported."""
    outs = set(per_rank.values())
    for kind in ("HANG", "CRASH"):
        if kind in outs:
            return kind
    if outs <= {"PASSED"}:
        return "FLAKY" if died else "PASSED"
    if outs <= {"SKIPPED"}:
        return "SKIPPED"
    return "FAILED"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    test_file = prepare(Path(args.horovod_src).resolve(), out, args.module)
    if args.module == "patch":  # every interpreter started from here on: collection and the ranks
        from fasthorovod import patch
        os.environ["PYTHONPATH"] = patch.with_patch(os.environ.get("PYTHONPATH"))
    tests = collect(test_file, args.keyword)
    print(f"{len(tests)} tests, hvd = {args.module}, {args.np} ranks", flush=True)
    start = time.time()
    results, jobs, deaths = run_chunks(tests, test_file, out, args.chunk_timeout, args.np)
    summary = {t.split("::")[-1]: outcome(results.get(t, {}), len(deaths.get(t, []))) for t in tests}
    reruns = {t.split("::")[-1]: {"job_exit": codes, "outcome": summary[t.split("::")[-1]]}
              for t, codes in deaths.items()}
    counts = {}
    for value in summary.values():
        counts[value] = counts.get(value, 0) + 1
    with open(out / "summary.json", "w") as f:
        json.dump({"module": args.module, "np": args.np, "counts": counts, "jobs": jobs,
                   "seconds": round(time.time() - start), "reruns": reruns, "tests": summary}, f, indent=1)
    print(json.dumps(counts), f"in {jobs} jobs, {time.time() - start:.0f} s, {len(reruns)} rerun after a job died")
    for name, value in summary.items():
        if value not in ("PASSED", "SKIPPED"):
            died = f" (job exit {reruns[name]['job_exit']})" if name in reruns else ""
            print(f"  {value:7s} {name}{died}")
    # A FLAKY test passed on its rerun: reported above, not a failure of the run.
    return 0 if set(summary.values()) <= {"PASSED", "SKIPPED", "FLAKY"} else 1


if __name__ == "__main__":
    sys.exit(main())
