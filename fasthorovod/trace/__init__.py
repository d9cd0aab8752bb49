"""The DLC trace of FastHorovod: capture on every rank, analysis, plots (docs/trace.md).

* :mod:`fasthorovod.trace.capture` — worker events (``start_trace``, ``stop_trace``, ``event``,
  ``span``, ``complete``, ``next_step``); the proxies record frames in C++ (csrc/trace/recorder.h).
* :mod:`fasthorovod.trace.format` — file names, layouts, readers.
* :mod:`fasthorovod.trace.analyze` — statistics; :mod:`.plot` (PNG), :mod:`.chrome` (Chrome trace).
* ``fasthorovod-trace analyze DIR`` (:mod:`fasthorovod.trace.cli`).

This package imports neither torch nor horovod (analysis needs numpy, plots matplotlib).
"""
from fasthorovod.trace.capture import (  # noqa: F401
    ENV_TRACE_DIR,
    Tracer,
    complete,
    event,
    next_step,
    now_ns,
    span,
    start_trace,
    stop_trace,
    trace_dir_from_env,
)
