"""For programs that import ``horovod.torch`` themselves (Horovod's examples, horovod.spark's
estimators, Lightning 1.x's Horovod strategy, a team's scripts): an opt-in switch that makes that
import give ``fasthorovod.torch``.

It is on in a process whose PYTHONPATH holds :data:`SITE_DIR` (``fasthorovodrun --patch-horovod``
puts it there for every rank; under plain ``horovodrun``, ``export PYTHONPATH=$(python -m
fasthorovod.patch)``): Python runs that directory's ``sitecustomize`` at start-up, which calls
:func:`install` and then the ``sitecustomize`` it shadows, if any. Never silently: the first rank
says so on stderr when the import happens.

:func:`install` puts a finder first on ``sys.meta_path`` for the one name ``horovod.torch``. The
first import of it loads Horovod's real ``horovod.torch`` (and its submodules, under their own
names, which fasthorovod.torch builds on), then ``fasthorovod.torch``, and hands the latter out as
``horovod.torch``: in ``sys.modules`` and as the ``torch`` attribute of the ``horovod`` package.
Horovod's submodules stay in ``sys.modules`` under their own names (``from horovod.torch.mpi_ops
import X`` is Horovod's X), while attributes of the package are fasthorovod.torch's
(``horovod.torch.elastic.run`` is FastHorovod's elastic run, which re-forms the proxies on reset).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patch_site")
PATCHED = "horovod.torch"


class _HorovodTorchIsFastHorovod(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname == PATCHED else None

    def create_module(self, spec):
        sys.meta_path.remove(self)  # once: what follows imports the real modules
        for name in ("horovod.torch", "horovod.torch.elastic"):  # Horovod's, under their own names
            importlib.import_module(name)
        fast = importlib.import_module("fasthorovod.torch")
        if os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == "0":
            print("[fasthorovod] horovod.torch is fasthorovod.torch in this job (the patch switch: "
                  "fasthorovodrun --patch-horovod, or fasthorovod/patch_site on PYTHONPATH)",
                  file=sys.stderr, flush=True)
        return fast

    def exec_module(self, module):
        pass  # fasthorovod.torch is already imported


def install() -> None:
    """Makes the next ``import horovod.torch`` give fasthorovod.torch (see the module docstring).
    Idempotent; too late once horovod.torch is imported (then it raises, naming the problem)."""
    if any(isinstance(f, _HorovodTorchIsFastHorovod) for f in sys.meta_path):
        return
    if PATCHED in sys.modules:
        raise RuntimeError("horovod.torch is already imported: the patch switch must be on before it is "
                           "(PYTHONPATH at interpreter start)")
    sys.meta_path.insert(0, _HorovodTorchIsFastHorovod())


def with_patch(pythonpath: str | None) -> str:
    """A PYTHONPATH with the switch on: :data:`SITE_DIR` first, then `pythonpath`."""
    return SITE_DIR + (os.pathsep + pythonpath if pythonpath else "")


if __name__ == "__main__":  # python -m fasthorovod.patch: the directory to put on PYTHONPATH
    print(SITE_DIR)
