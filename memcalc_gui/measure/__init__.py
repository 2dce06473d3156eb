"""memcalc_gui.measure: real training steps (CPU tracker, CUDA allocator); torch is imported inside functions."""

from __future__ import annotations

import builtins
import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

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
        with plain_imports():
            yield
    finally:
        _TORCH_JOB.release()


#: The ``__import__`` PySide6 installs (its C ``__feature_import__``), and what a torch job runs with instead.
_QT_IMPORT_NAME = "__feature_import__"
_swapped: list[Any] = []  # the hook a job took out (at most one: the jobs hold _TORCH_JOB)


def _plain_import() -> Any:
    """The interpreter's own ``__import__`` (captured by ``memcalc_gui`` before PySide6 loaded), else the import
    PySide6 wraps (``builtins.__orig_import__``), else ``None``."""
    from .. import INTERPRETER_IMPORT

    if getattr(INTERPRETER_IMPORT, "__name__", "") == "__import__" and \
            getattr(INTERPRETER_IMPORT, "__self__", None) is builtins:
        return INTERPRETER_IMPORT
    return getattr(builtins, "__orig_import__", None)


@contextlib.contextmanager
def plain_imports() -> Iterator[None]:
    """Run the block with the interpreter's ``__import__`` rather than PySide6's wrapper of it.

    PySide6 routes every ``import`` statement through a Python function that looks for ``from __feature__
    import …`` (its snake_case switch, which memcalc never uses). PyTorch's fake-tensor dispatch and the tracker
    run an import statement inside each operator, millions per calibration: with the wrapper a fake-tensor trace of
    Llama-3.1-8B (1 × 512, mixed precision) took 4.6 s on this 2-core machine rather than 3.7 s (26 % longer), in
    the window and in every test process (pytest-qt loads PySide6 first). The wrapper is put back when the block
    ends; nothing else is touched (another tool's import hook stays)."""
    current = builtins.__import__
    plain = _plain_import() if getattr(current, "__name__", "") == _QT_IMPORT_NAME else None
    if plain is None or _swapped:
        yield
        return
    _swapped.append(current)
    builtins.__import__ = plain
    try:
        yield
    finally:
        _swapped.pop()
        if builtins.__import__ is plain:
            builtins.__import__ = current


#: Where a measurement's explicit collections run when it is not on the main thread (a window's worker): set by
#: the window (``memcalc_gui.ui.workers``) to run them on the GUI thread. ``None``: collect where called.
_collector: Callable[[], None] | None = None


def set_collector(collector: Callable[[], None] | None) -> None:
    """Install the function :func:`collect_garbage` calls off the main thread (``None``: ``gc.collect`` there)."""
    global _collector
    _collector = collector


def collect_garbage() -> None:
    """``gc.collect()`` where it is safe. A collection frees whatever sits in a reference cycle, Qt objects of a closed
    window included; run on a worker thread, PySide6 hands such a widget's deletion to the GUI thread, and the two
    threads then wait for each other (the worker on the interpreter lock inside ``QObject::~QObject``, the GUI thread
    on Qt's object mutex while holding that lock): a window whose worker collected froze for good. With a window
    open the collection therefore runs on its GUI thread, the worker waiting for it."""
    collector = _collector
    if collector is None or threading.current_thread() is threading.main_thread():
        gc.collect()
    else:
        collector()


#: How many :func:`frozen_heap` blocks hold the heap frozen now. ``gc.get_freeze_count()`` walks the whole frozen
#: list (CPython keeps it as a linked list): 34 ms with torch and transformers imported, 13 calls a calibration, a
#: tenth of its time. The blocks therefore count themselves. A freeze made by other code is not seen; the block then
#: freezes again and unfreezes everything at its end, which costs only later collections' time. Changed by one
#: thread at a time: every trace and measurement holds the torch job lock (:func:`exclusive_torch_job`).
_holds = 0


def heap_frozen() -> bool:
    """Whether a :func:`frozen_heap` block holds the heap frozen now (no walk of the frozen objects)."""
    return _holds > 0


@contextlib.contextmanager
def frozen_heap(collect: bool = True, again: bool = False) -> Iterator[None]:
    """Collect once, then keep what exists now (imports, caches) out of the collections that follow until the block
    ends (``gc.freeze``): each step's collections then scan only what the steps make. Before each of a calibration's
    traces a collection of torch's and transformers' whole heap took 250 ms, a fifth of the calibration. A block
    inside another (or a step inside one) keeps the outer one: ``gc.unfreeze`` undoes every freeze.

    ``collect=False`` freezes without that first collection, for a trace on fake tensors: no garbage from before can
    hide memory from it (it counts only the storages it sees made), and whatever garbage is frozen is collected after
    the block like any other. Each trace in a long-running process (a test worker, a window that traced before) then
    skips a scan of the whole heap: 0.1–0.2 s a trace in the test suite's workers.

    ``again``: inside another block, freeze what was made since as well (``gc.freeze`` moves the generations whole,
    at no cost); the outermost block's end unfreezes it all. A fake trace's step does so once its model is built: the
    modules transformers imports on a window's first calibration and the model then stay out of the step's
    collections (they took 1.7 s of that 7 s calibration). Only for fake steps: a real model that dies inside the
    outer block would otherwise wait for its end to be collected."""
    global _holds
    if _holds:
        if again:
            gc.freeze()
        _holds += 1
        try:
            yield
        finally:
            _holds -= 1
        return
    if collect:
        collect_garbage()
    gc.freeze()
    _holds = 1
    try:
        yield
    finally:
        _holds = 0
        gc.unfreeze()
