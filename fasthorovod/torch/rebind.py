"""Horovod's own functions, run with this package's collectives.

A Horovod function calls the collectives its module imported (``allgather_async``,
``synchronize``, ``broadcast_``, ...). :func:`rebound` gives back the very same code object bound
to another namespace: a copy of that module's globals in which those names are
fasthorovod.torch's, so the function's behaviour (argument handling, errors, gradients) stays
Horovod's, line for line, while its large tensors travel through the proxies.
"""
from __future__ import annotations

import functools
import types
from typing import Dict


def rebound(function: types.FunctionType, namespace: Dict[str, object], module: str) -> types.FunctionType:
    """`function`'s code with its global names looked up in `namespace`, reported as part of `module`."""
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    functools.update_wrapper(copy, function)
    copy.__module__ = module
    return copy
