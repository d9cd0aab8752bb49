"""FastHorovod: Horovod for PyTorch over k parallel TCP flows per worker.

Use ``import fasthorovod.torch as hvd`` in place of ``import horovod.torch as hvd``. This top-level
package stays light (no torch import) because the proxy processes import it too.
"""
from fasthorovod.config import Config, ConfigError
from fasthorovod.exceptions import (
    CollectiveMismatchError,
    FastHorovodError,
    FastHorovodTimeoutError,
)

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

__all__ = [
    "CollectiveMismatchError",
    "Config",
    "ConfigError",
    "FastHorovodError",
    "FastHorovodTimeoutError",
    "__version__",
]
