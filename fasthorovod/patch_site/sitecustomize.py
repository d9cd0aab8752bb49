"""Run by Python at start-up when this directory is on PYTHONPATH: the switch that makes
``import horovod.torch`` give fasthorovod.torch (fasthorovod/patch.py). Then runs the
``sitecustomize`` this one shadows, if there is one further down the path."""
import importlib.machinery
import importlib.util
import os
import sys


def _shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


from fasthorovod import patch  # noqa: E402

patch.install()
_shadowed()
