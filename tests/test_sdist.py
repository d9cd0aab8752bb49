"""The README's install into one's own environment, step by step, from an sdist: a fresh virtualenv
gets the project's pip and torch (hard links to the installed files of those this suite runs and
of their dependencies, which pip then accepts as installed: what ``pip install torch`` would
unpack, without unpacking it again), then Horovod from scripts/install_horovod.sh (built as C++17; the
wheel cached by the project's set-up makes this take seconds), then the sdist built with
``python -m build``, whose pip install builds fasthorovod._C from csrc/. The installed
``fasthorovodrun`` then runs a 2-rank allreduce whose bytes cross the proxies' lanes.
"""
import importlib.metadata
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import venv
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
ELEMENTS = 1 << 20  # 4 MiB of float32: above the 1 MiB proxy threshold set below

WORKER = textwrap.dedent(f"""
    import sys

    import torch

    import fasthorovod
    import fasthorovod.torch as hvd

    assert fasthorovod.__file__.startswith(sys.prefix), f"not the installed copy: {{fasthorovod.__file__}}"
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tensor = torch.arange({ELEMENTS}, dtype=torch.float32) * (rank + 1)
    out = hvd.allreduce(tensor, op=hvd.Sum, name="sdist.check")
    expected = torch.arange({ELEMENTS}, dtype=torch.float32) * sum(range(1, size + 1))
    assert torch.equal(out, expected), "wrong sum"
    lanes = hvd.proxy_group().lane_stats()
    sent = sum(lane["bytes_sent"] for lane in lanes)
    # a ring allreduce sends 2 (n - 1) / n of the tensor from every rank, over all lanes together
    assert all(lane["collectives"] == 1 for lane in lanes), lanes
    assert sent >= 2 * (size - 1) * {ELEMENTS} * 4 // size, sent
    print(f"rank {{rank}}: sdist allreduce ok through {{len(lanes)}} lanes, {{sent}} bytes sent", flush=True)
    hvd.shutdown()
""")


def _run(cmd, timeout, **kwargs):
    """Runs `cmd` in a session of its own; on timeout the whole session is killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(map(str, cmd))}\n{out[-6000:]}")
    assert proc.returncode == 0, f"rc {proc.returncode}: {' '.join(map(str, cmd))}\n{out[-8000:]}"
    return out


def _normalised(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _link_distribution(name: str, site: Path, seen: set) -> None:
    """Hard-links the installed files of distribution ``name`` and of what it requires (markers
    evaluated for this interpreter) into the site-packages directory ``site``, but for those
    ``seen`` (normalised names, updated)."""
    dist = importlib.metadata.distribution(name)
    key = _normalised(dist.metadata["Name"])
    if key in seen:
        return
    seen.add(key)
    for file in dist.files or ():
        if file.parts[0] == "..":  # console scripts in bin/: the test never runs torch's
            continue
        target = site / file
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(dist.locate_file(file), target)
    for spec in dist.requires or ():
        requirement = Requirement(spec)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            _link_distribution(requirement.name, site, seen)


@pytest.mark.slow
def test_the_sdist_builds_installs_and_runs_an_allreduce_through_the_proxies(tmp_path):
    pytest.importorskip("build", reason="python -m build is needed: pip install build")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path / "dist"), str(REPO)],
         timeout=300, env=env, cwd=tmp_path)
    (sdist,) = (tmp_path / "dist").glob("fasthorovod-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"CMakeLists.txt", "csrc/common/hmac.cc", "csrc/bindings/module.cc", "fasthorovod/_C.pyi",
            "LICENSE"} <= names
    assert not [n for n in names if n.startswith(("tests/", "lab/", "benchmarks/")) or n.endswith(".so")]

    target = tmp_path / "venv"
    venv.create(target, with_pip=False)  # pip comes linked with torch below, as ensurepip's is too old for it
    python = target / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     timeout=60, env=env, cwd=tmp_path).strip())
    linked = set()
    for name in ("pip", "torch"):
        _link_distribution(name, site, linked)
    _run([*pip, "--no-index", f"torch=={torch.__version__.split('+')[0]}"], timeout=60, env=env, cwd=tmp_path)
    _run([str(REPO / "scripts" / "install_horovod.sh")], timeout=1200, env=dict(env, PYTHON=str(python)),
         cwd=tmp_path)
    _run([*pip, "--no-cache-dir", str(sdist)],
         timeout=900, env=env, cwd=tmp_path)
    installed = _run([str(python), "-c", "import fasthorovod, pathlib; print(pathlib.Path(fasthorovod.__file__).parent)"],
                     timeout=60, env=env, cwd=tmp_path).strip()
    files = {p.name for p in Path(installed).iterdir()}
    assert any(name.startswith("_C.") and name.endswith(".so") for name in files), files
    assert not any("testing" in name for name in files), files
    assert (Path(installed) / "patch_site" / "sitecustomize.py").is_file()  # the patch switch (patch.py)

    (tmp_path / "worker.py").write_text(WORKER)
    job_env = dict(env, FASTHOROVOD_PROXY_THRESHOLD_BYTES=str(1 << 20), FASTHOROVOD_HIERARCHICAL="0",
                   FASTHOROVOD_NUM_LANES="2", FASTHOROVOD_TIMEOUT_SECONDS="60")
    out = _run([str(target / "bin" / "fasthorovodrun"), "-np", "2", str(python), str(tmp_path / "worker.py")],
               timeout=300, env=job_env, cwd=tmp_path)
    assert out.count("sdist allreduce ok through 2 lanes") == 2, out
