"""Optional dependencies, declared as extras in setup.py: a missing one is a one-line error that
names the pip command, never a traceback, and never stops what works without it.

    pip install fasthorovod              horovod, torch, psutil, numpy: training, the data plane,
                                         fasthorovod-trace analyze (table, --json, --chrome)
    pip install 'fasthorovod[plot]'      matplotlib: fasthorovod-trace analyze --plot
    pip install 'fasthorovod[bench]'     matplotlib, scikit-learn: benchmarks/ (plots, the
                                         convergence benchmark's dataset)
    pip install 'fasthorovod[test]'      pytest, mock: tests/ and scripts/horovod_tests.py
"""
from __future__ import annotations

import importlib
from types import ModuleType

# extra -> the packages it adds (setup.py reads this table; keep the import names in MODULES)
EXTRAS = {
    "plot": ["matplotlib"],
    "bench": ["matplotlib", "scikit-learn"],
    "test": ["pytest", "mock"],
}
# pip name -> import name, where they differ
MODULES = {"scikit-learn": "sklearn"}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; str() is the one line to show the user."""


def message(feature: str, package: str, extra: str) -> str:
    return f"{feature} needs {package}: pip install 'fasthorovod[{extra}]'"


def require(package: str, extra: str, feature: str) -> ModuleType:
    """Imports the optional `package` (a pip name from EXTRAS[extra]) or raises MissingExtraError
    with ``"<feature> needs <package>: pip install 'fasthorovod[<extra>]'"``."""
    assert package in EXTRAS[extra], (package, extra)
    try:
        return importlib.import_module(MODULES.get(package, package))
    except ImportError as e:
        raise MissingExtraError(message(feature, package, extra)) from e
