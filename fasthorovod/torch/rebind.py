"""Horovod's own functions, run with this package's collectives.

A Horovod function calls the collectives its module imported (``allgather_async``,
``synchronize``, ``broadcast_``, ...). :func:`rebound` gives back the very same code object bound
to another namespace, a :class:`ModuleNamespace`: that module's globals, except that those names
are fasthorovod.torch's, so the function's behaviour (argument handling, errors, gradients) stays
Horovod's, line for line, while its large tensors travel through the proxies.
"""
from __future__ import annotations

import functools
import types
from typing import Dict


class ModuleNamespace(dict):
    """The globals of functions rebound from `module`: the names set in it, and any other looked up
    in `module` when the function reads it. A snapshot would go stale where the module rebinds a
    global later (Horovod's ``init()`` replaces its handle map)."""

    def __init__(self, module: types.ModuleType, **names: object) -> None:
        # __builtins__ is read when a function is created, without __missing__.
        super().__init__(__builtins__=vars(module)["__builtins__"], **names)
        self.module = module

    def __missing__(self, name: str) -> object:
        return vars(self.module)[name]  # a KeyError: the function raises NameError, as it would


def rebound(function: types.FunctionType, namespace: Dict[str, object], module: str) -> types.FunctionType:
    """`function`'s code with its global names looked up in `namespace`, reported as part of `module`."""
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    functools.update_wrapper(copy, function)
    copy.__module__ = module
    return copy
