"""memcalc_gui.measure: real training steps (CPU tracker, CUDA allocator); torch is imported inside functions."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

#: One torch job at a time per process. A measurement and a trace both change process-wide torch state (the
#: default dtype while transformers builds a model, the thread count, the random seed) and import
#: transformers' lazy modules, which fail when two threads import them at once ("cannot import name …"); a fit's
#: calibration also patches torch functions for its fake runs, which a second run in another thread would see.
#: Re-entrant: a calibration holds it while it builds the model on the meta device, which takes it too.
_TORCH_JOB = threading.RLock()


@contextlib.contextmanager
def exclusive_torch_job(should_stop: Callable[[], bool] | None = None,
                        cancelled: type[BaseException] = RuntimeError) -> Iterator[None]:
    """Hold the process's torch job lock; while waiting for it, raise ``cancelled`` once ``should_stop()``."""
    while not _TORCH_JOB.acquire(timeout=0.1):
        if should_stop is not None and should_stop():
            raise cancelled("cancelled while another measurement or trace was running")
    try:
        yield
    finally:
        _TORCH_JOB.release()
