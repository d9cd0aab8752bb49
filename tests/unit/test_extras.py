"""Optional dependencies: setup.py declares them as extras, and a plain install — here,
a subprocess in which importing matplotlib fails, as it does where it is not installed — still
prints the trace analysis and writes the Chrome trace; --plot alone fails, in one line naming the
extra. Benchmarks that would plot fail the same way before running anything."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.unit.test_trace import write_synthetic

REPO = Path(__file__).resolve().parents[2]

BLOCKER = textwrap.dedent('''
    """Makes the packages named in FASTHOROVOD_TEST_BLOCK unimportable (a plain install)."""
    import importlib.abc
    import os
    import sys

    BLOCKED = set(filter(None, os.environ.get("FASTHOROVOD_TEST_BLOCK", "").split(",")))


    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None


    sys.meta_path.insert(0, Blocker())
''')


def run_without(blocked, tmp_path, *argv):
    """Runs `python *argv` in a subprocess where importing any of `blocked` fails."""
    site = tmp_path / "blocker"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{site}:{REPO}", "FASTHOROVOD_TEST_BLOCK": ",".join(blocked)}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)


def test_the_blocker_really_blocks(tmp_path):
    out = run_without(["matplotlib"], tmp_path, "-c", "import matplotlib")
    assert out.returncode != 0 and "blocked by the test" in out.stderr


def test_trace_analysis_and_chrome_trace_need_no_optional_package(tmp_path):
    trace = tmp_path / "trace"
    write_synthetic(trace)
    png, chrome = tmp_path / "t.png", tmp_path / "t.json"
    out = run_without(["matplotlib"], tmp_path, "-m", "fasthorovod.trace", "analyze", str(trace),
                      "--plot", str(png), "--chrome", str(chrome))
    assert out.returncode == 1, out.stderr
    assert "Per iteration" in out.stdout and "lane imbalance" in out.stdout  # the analysis itself
    assert len(json.loads(chrome.read_text())["traceEvents"]) > 64          # the Chrome trace
    assert not png.exists()
    errors = [line for line in out.stderr.splitlines() if line.startswith("fasthorovod-trace:")]
    assert errors == ["fasthorovod-trace: --plot needs matplotlib: pip install 'fasthorovod[plot]'"], out.stderr
    assert "Traceback" not in out.stderr
    # Without --plot nothing is missing at all.
    ok = run_without(["matplotlib"], tmp_path, "-m", "fasthorovod.trace", "analyze", str(trace), "--chrome",
                     str(tmp_path / "u.json"))
    assert ok.returncode == 0 and "Traceback" not in ok.stderr, ok.stderr


@pytest.mark.parametrize("script,blocked,argv,line", [
    ("benchmarks/allreduce.py", "matplotlib", ["--plot", "x.png"],
     "allreduce.py --plot needs matplotlib: pip install 'fasthorovod[bench]'"),
    ("benchmarks/convergence.py", "sklearn", [],
     "convergence.py needs scikit-learn: pip install 'fasthorovod[bench]'"),
])
def test_benchmarks_name_the_missing_extra_before_running_anything(tmp_path, script, blocked, argv, line):
    out = run_without([blocked], tmp_path, str(REPO / script), *argv)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [line], out.stderr


def test_setup_declares_the_extras(tmp_path):
    """The package's metadata (pyproject.toml, with setup.py adding the extras of extras.py; egg_info:
    no build, no network): the plain requirements and each extra."""
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=REPO,
                   check=True, capture_output=True, timeout=240)
    requires = (tmp_path / "fasthorovod.egg-info" / "requires.txt").read_text()
    plain, *sections = requires.split("\n[")
    assert sorted(plain.split()) == ["horovod==0.28.1", "numpy", "psutil", "torch>=2.1"]
    extras = {s.split("]")[0]: sorted(s.split("]", 1)[1].split()) for s in sections}
    assert extras == {"plot": ["matplotlib"], "bench": ["matplotlib", "scikit-learn"], "test": ["mock", "pytest"]}
