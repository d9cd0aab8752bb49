"""The patch switch (fasthorovod/patch.py, ``fasthorovodrun --patch-horovod``): a program that
imports horovod.torch gets fasthorovod.torch only when the switch is on, says so, keeps Horovod's
submodules under their own names and still runs the sitecustomize it shadows."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fasthorovod import patch

REPO = Path(__file__).resolve().parents[1]
PROBE = ("import sys, horovod.torch as hvd, horovod.torch.mpi_ops; "
         "print(hvd.__name__, sys.modules['horovod.torch.mpi_ops'].__name__, "
         "getattr(sys.modules.get('sitecustomize'), 'MARK', None))")


def _python(code: str, pythonpath: str = None, **env):
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        full["PYTHONPATH"] = pythonpath
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


def test_off_by_default():
    out = _python(PROBE)
    assert out.returncode == 0 and out.stdout.split()[:2] == ["horovod.torch", "horovod.torch.mpi_ops"], out.stderr
    assert "[fasthorovod]" not in out.stderr


def test_on_the_import_gives_fasthorovod_and_says_so(tmp_path):
    shadowed = tmp_path / "sitecustomize.py"  # a site's own sitecustomize, further down the path
    shadowed.write_text("MARK = 'ran'\n")
    out = _python(PROBE, patch.with_patch(str(tmp_path)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fasthorovod.torch", "horovod.torch.mpi_ops", "ran"]
    assert "horovod.torch is fasthorovod.torch" in out.stderr
    quiet = _python(PROBE, patch.with_patch(None), HOROVOD_RANK="1")  # only the first rank says so
    assert quiet.returncode == 0 and "[fasthorovod]" not in quiet.stderr, quiet.stderr


def test_too_late_once_horovod_torch_is_imported():
    out = _python("import horovod.torch; from fasthorovod import patch; patch.install()")
    assert out.returncode != 0 and "already imported" in out.stderr


def test_the_launcher_flag_puts_it_first_on_pythonpath():
    from fasthorovod.runner.launch import fasthorovod_env, parse_args
    env = fasthorovod_env(parse_args(["--patch-horovod", "-np", "2", "x"]), {"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(os.pathsep) == [patch.SITE_DIR, "/elsewhere"]
    assert "PYTHONPATH" not in fasthorovod_env(parse_args(["-np", "2", "x"]), {})


@pytest.mark.multiproc
def test_an_unmodified_horovod_program_runs_on_the_proxies():
    launcher = Path(sys.executable).parent / "fasthorovodrun"
    script = REPO / "tests" / "workers" / "plain_horovod.py"
    env = dict(os.environ, FASTHOROVOD_HIERARCHICAL="0", FASTHOROVOD_PROXY_THRESHOLD_BYTES="0")
    out = subprocess.run([str(launcher), "--patch-horovod", "-np", "2", sys.executable, str(script)], env=env,
                         capture_output=True, text=True, timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ranks = re.findall(r"rank (\d): module (\S+), proxy collectives \[([\d, ]+)\]", out.stdout)
    assert sorted(r for r, _, _ in ranks) == ["0", "1"], out.stdout[-2000:]
    for _, module, counts in ranks:
        # the allreduce, the broadcasts and the optimizer's bucket went through every lane
        assert module == "fasthorovod.torch" and min(int(c) for c in counts.split(",")) >= 3, (module, counts)
    assert "horovod.torch is fasthorovod.torch" in out.stderr + out.stdout
