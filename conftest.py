"""Test-suite set-up shared by tests/ and lab/tests/.

The test-only native module ``fasthorovod_testing`` (loopback rings, hostile peers, fault switches)
is built into tests/native/ by ``make testing-module`` and never installed. Its folder goes on
``sys.path`` here and on ``PYTHONPATH`` for the ranks, proxies and scripts the tests start.
"""
import os
import sys
from pathlib import Path

NATIVE = Path(__file__).resolve().parent / "tests" / "native"

sys.path.insert(0, str(NATIVE))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(NATIVE), os.environ.get("PYTHONPATH")) if p)


def pytest_report_header(config):
    found = sorted(NATIVE.glob("fasthorovod_testing*.so"))
    return [f"fasthorovod_testing: {found[0].name if found else 'not built (make testing-module)'}"]
