"""scripts/horovod_tests.py, the runner of Horovod's own test_torch.py, on a stand-in test file (no
Horovod source is needed): a test at which the job dies once and that passes on its
rerun is reported as FLAKY with the dead job's exit status — never as a plain pass — and the death
is charged to the test the dying rank was in, not to one another rank had not finished yet."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

STAND_IN = '''import os
import time

import horovod.torch as hvd

MARK = os.environ["STAND_IN_MARK"]


def test_first():
    assert hvd.__name__ == "fasthorovod.torch"  # the runner swapped the import
    if int(os.environ["HOROVOD_RANK"]) == 0 and not os.path.exists(MARK):
        time.sleep(5)  # still here when rank 1 dies in the next test: killed before reporting this one


def test_kills_its_job_once():
    if int(os.environ["HOROVOD_RANK"]) == 1 and not os.path.exists(MARK):
        open(MARK, "w").close()
        os._exit(3)


def test_last():
    pass
'''


@pytest.mark.multiproc
def test_a_rerun_after_a_dead_job_is_reported_as_flaky(tmp_path):
    src = tmp_path / "horovod-src"
    (src / "test" / "parallel").mkdir(parents=True)
    (src / "test" / "utils").mkdir()
    (src / "test" / "parallel" / "test_torch.py").write_text(STAND_IN)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "mock.py").write_text("")  # Horovod's test utils import it; the stand-in does not need it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stubs), str(REPO), os.environ.get("PYTHONPATH", "")]),
               STAND_IN_MARK=str(tmp_path / "died-once"))
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "horovod_tests.py"), str(src), "--np", "2",
                          "--out", str(tmp_path / "out"), "--chunk-timeout", "300"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["np"] == 2 and summary["jobs"] == 2, summary
    assert summary["tests"] == {"test_first": "PASSED", "test_kills_its_job_once": "FLAKY", "test_last": "PASSED"}
    assert summary["reruns"] == {"test_kills_its_job_once": {"job_exit": [summary["reruns"]["test_kills_its_job_once"]
                                                                          ["job_exit"][0]], "outcome": "FLAKY"}}
    assert summary["reruns"]["test_kills_its_job_once"]["job_exit"][0] not in (0, None)
    assert "FLAKY   test_kills_its_job_once (job exit [" in out.stdout, out.stdout
    assert '1 rerun after a job died' in out.stdout, out.stdout
