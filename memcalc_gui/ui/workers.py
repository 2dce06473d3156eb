"""Run one long job (a measurement, a trace, a device probe) off the GUI thread, cancellably.

A job is any callable ``fn(progress, should_stop) -> result``: ``progress(str)`` reports a step,
``should_stop()`` turns true once the user cancels (the job checks it between steps and raises, or
returns early). :class:`TaskRunner` runs one job at a time on a ``QThread`` and re-emits what happens
as ``progress(str)``, ``finished(result)``, ``failed(message)`` or ``cancelled()`` on the GUI thread.
The runner is long-lived: connect to its signals once, before starting a job, and a fast job's
signals are never missed.

Garbage collection: while any job runs, Python's automatic collector is off, and the GUI thread collects
before a job starts and after the last one ends. Qt objects (a chart's plot items, a closed window) often sit
in reference cycles; collected on a worker thread they would be destroyed off the GUI thread, which hangs or
crashes Qt (pyqtgraph's ``GarbageCollector`` exists for the same reason). Measured steps then free memory by
reference counts and their own explicit collections (``memcalc_gui.measure.collect_garbage``), which a runner
hands to the GUI thread and waits for: run on the worker, one froze the window for good (PySide6 passed a closed
window's menu to the GUI thread for deletion, and each thread then waited for a lock the other held).

Shutdown: ``stop()`` asks the job to stop and waits for its thread. Owners call it from
``closeEvent``; every runner also stops itself on ``QCoreApplication.aboutToQuit``, so a thread is
never destroyed while it is running ("QThread: Destroyed while thread is still running" aborts).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QCoreApplication, QObject, QThread, Signal, Slot

from .. import measure
from ..core.errors import MemcalcError, one_line

ProgressFn = Callable[[str], None]
StopFn = Callable[[], bool]
Job = Callable[[ProgressFn, StopFn], Any]

#: How long ``stop()`` waits for a job by default. Jobs check ``should_stop`` between steps, but one step (a
#: model of many layers being built) can take longer than a user waits for a window to close; a job still
#: running after this is kept alive (see ``_ORPHANS``) rather than destroyed, and the application leaves
#: without waiting for it (:func:`running_orphans`).
STOP_TIMEOUT_MS = 1_000

#: Threads that did not stop in time: referenced here so Python never destroys a running QThread.
_ORPHANS: list[QThread] = []


#: How long a worker's collection waits for the GUI thread; past it (the GUI thread waiting for that very worker
#: to stop, say) the step goes on without it.
GC_WAIT_S = 10.0


class _GuiCollector(QObject):
    """Runs the workers' explicit collections on the GUI thread, where it lives (:func:`_collect_on_gui_thread`)."""

    requested = Signal(object)

    def __init__(self) -> None:
        super().__init__()
        self.requested.connect(self._collect)  # queued: emitted from a worker

    @Slot(object)
    def _collect(self, done: threading.Event) -> None:
        try:
            gc.collect()
        finally:
            done.set()


_COLLECTOR: _GuiCollector | None = None


def _collect_on_gui_thread() -> None:
    """``memcalc_gui.measure.collect_garbage`` on a worker thread: the GUI thread collects, the worker waits."""
    collector, done = _COLLECTOR, threading.Event()
    if collector is None:  # installed with the first runner, before any job
        return
    try:
        collector.requested.emit(done)
    except RuntimeError:  # the application is gone: nothing collects any more
        return
    done.wait(GC_WAIT_S)


def _install_collector() -> None:
    """GUI thread, as the first runner is made: the workers' collections run here from now on."""
    global _COLLECTOR
    if _COLLECTOR is None:
        _COLLECTOR = _GuiCollector()
        measure.set_collector(_collect_on_gui_thread)


_gc_holds = 0
_gc_was_enabled = True


def _hold_gc() -> None:
    """GUI thread, as a job starts: collect here, then keep the automatic collector off while jobs run."""
    global _gc_holds, _gc_was_enabled
    if _gc_holds == 0:
        _gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
    _gc_holds += 1


def _release_gc() -> None:
    """GUI thread, once a job has ended: the last one turns the collector back on and collects here."""
    global _gc_holds
    _gc_holds = max(0, _gc_holds - 1)
    if _gc_holds == 0:
        if _gc_was_enabled:
            gc.enable()
        gc.collect()


def _drop_hold(hold: list[bool]) -> None:
    """Give back one runner's hold (``hold[0]``), once."""
    if hold[0]:
        hold[0] = hold[1] = False
        _release_gc()


def running_orphans() -> list[QThread]:
    """Worker threads that did not stop in time and are still running (the process must not wait for them:
    ``memcalc-gui`` ends with ``os._exit`` then, since destroying a running QThread aborts)."""
    alive = []
    for thread in list(_ORPHANS):
        with contextlib.suppress(RuntimeError):  # the C++ object is gone: it ended
            if thread.isRunning():
                alive.append(thread)
    return alive


def describe_error(exc: BaseException) -> str:
    """A one-line message for the user: memcalc's own errors as they are, others with their type."""
    if isinstance(exc, MemcalcError):
        return str(exc)
    if isinstance(exc, MemoryError):
        return "out of memory"
    text = one_line(exc)
    return one_line(f"{type(exc).__name__}: {text}") if text else type(exc).__name__


class Worker(QObject):
    """Runs ``fn(progress, should_stop)`` once, on whichever thread calls :meth:`run`.

    The signals are emitted from that thread; receivers on the GUI thread get them queued.
    ``cancel_types`` are the exceptions that mean "cancelled" (e.g. the engine's ``Cancelled``); a job
    that returns after a cancel request also counts as cancelled.
    """

    progress = Signal(str)
    finished = Signal(object)
    failed = Signal(str)
    cancelled = Signal()

    def __init__(self, fn: Job, *, cancel_types: tuple[type[BaseException], ...] = (),
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._fn = fn
        self._cancel_types = cancel_types
        self._stop = threading.Event()

    def request_stop(self) -> None:
        self._stop.set()

    def should_stop(self) -> bool:
        return self._stop.is_set()

    def _progress(self, text: str) -> None:
        self.progress.emit(str(text))

    @Slot()
    def run(self) -> None:
        try:
            result = self._fn(self._progress, self.should_stop)
        except self._cancel_types:
            self.cancelled.emit()
        except Exception as exc:
            if self._stop.is_set():
                self.cancelled.emit()
                return
            if not isinstance(exc, MemcalcError):
                traceback.print_exc()  # a bug, not a user error: keep the trace for the terminal
            self.failed.emit(describe_error(exc))
        else:
            if self._stop.is_set():
                self.cancelled.emit()
            else:
                self.finished.emit(result)


class _WorkerThread(QThread):
    """A thread without an event loop: ``run`` is the job, and the thread ends when the job returns."""

    def __init__(self, worker: Worker, name: str) -> None:
        super().__init__()
        self._worker = worker
        self.setObjectName(name)

    def run(self) -> None:
        self._worker.run()


class TaskRunner(QObject):
    """One job at a time on a worker thread; its outcome re-emitted on the GUI thread.

    Exactly one of ``finished``, ``failed`` or ``cancelled`` follows every ``start()``, and
    :meth:`is_running` is already false when it is emitted.
    """

    started = Signal()
    progress = Signal(str)
    finished = Signal(object)
    failed = Signal(str)
    cancelled = Signal()
    running_changed = Signal(bool)

    def __init__(self, name: str = "memcalc-worker", *, cancel_types: tuple[type[BaseException], ...] = (),
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.setObjectName(name)
        self._name = name
        self._cancel_types = cancel_types
        self._worker: Worker | None = None
        self._thread: _WorkerThread | None = None
        self._active = False
        # this runner's hold on the collector: [held, parked]. A runner destroyed before its outcome was delivered
        # (a closed window's) gives it back then, unless its thread is parked still running: that thread's end
        # does. The collector is never left off for good.
        self._gc_hold = [False, False]
        self.destroyed.connect(lambda *_args, hold=self._gc_hold: None if hold[1] else _drop_hold(hold))
        app = QCoreApplication.instance()
        if app is not None:
            app.aboutToQuit.connect(self._about_to_quit)
        _install_collector()

    # ---- control ------------------------------------------------------------------------------
    def start(self, fn: Job) -> None:
        """Run ``fn(progress, should_stop)`` on a new thread. Raises ``RuntimeError`` while a job runs."""
        if self._active:
            raise RuntimeError(f"{self._name}: a job is already running")
        if self._thread is not None:
            self._thread.wait()  # the previous job has reported; its thread is ending
        worker = Worker(fn, cancel_types=self._cancel_types)
        worker.progress.connect(self._on_progress)
        worker.finished.connect(self._on_finished)
        worker.failed.connect(self._on_failed)
        worker.cancelled.connect(self._on_cancelled)
        self._worker = worker
        self._thread = _WorkerThread(worker, self._name)
        self._active = True
        if not self._gc_hold[0]:
            self._gc_hold[0] = True
            _hold_gc()
        self.running_changed.emit(True)
        self.started.emit()
        self._thread.start()

    def cancel(self) -> None:
        """Ask the running job to stop; ``cancelled`` follows when it has."""
        if self._worker is not None:
            self._worker.request_stop()

    def is_running(self) -> bool:
        """Whether a job has started and not yet reported its outcome."""
        return self._active

    def thread_running(self) -> bool:
        return self._thread is not None and self._thread.isRunning()

    def stop(self, timeout_ms: int | None = STOP_TIMEOUT_MS) -> bool:
        """Cancel the job and wait for its thread (``None``: without limit). ``True`` once it has ended."""
        self.cancel()
        thread = self._thread
        if thread is None:
            return True
        if timeout_ms is None:
            ended = thread.wait()
        else:
            deadline = time.monotonic() + timeout_ms / 1000
            ended = thread.wait(max(0, timeout_ms))
            while not ended and time.monotonic() < deadline:  # wait() may return early on some platforms
                ended = thread.wait(100)
        if not ended:  # never let Python destroy a running QThread: park it until it ends
            _ORPHANS.append(thread)
            thread.finished.connect(lambda t=thread: _ORPHANS.remove(t) if t in _ORPHANS else None)
            self._gc_hold[1] = True
            thread.finished.connect(lambda hold=self._gc_hold: _drop_hold(hold))  # outlives this runner
        else:
            self._release()
        return bool(ended)

    @Slot()
    def _release(self) -> None:
        """Give back this runner's hold on the collector (once per job)."""
        _drop_hold(self._gc_hold)

    @Slot()
    def _about_to_quit(self) -> None:
        with contextlib.suppress(RuntimeError):  # RuntimeError: the C++ object is already gone
            self.stop()

    # ---- outcome (GUI thread) -------------------------------------------------------------------
    def _current(self) -> bool:
        return self.sender() is self._worker and self._active

    @Slot(str)
    def _on_progress(self, text: str) -> None:
        if self._current():
            self.progress.emit(text)

    def _end(self) -> None:
        self._active = False
        if self._thread is None or not self._thread.isRunning() or self._thread.wait(2000):
            self._release()  # the job's thread has returned: nothing runs there any more
        else:
            self._thread.finished.connect(self._release)
        self.running_changed.emit(False)

    @Slot(object)
    def _on_finished(self, result: Any) -> None:
        if self._current():
            self._end()
            self.finished.emit(result)

    @Slot(str)
    def _on_failed(self, message: str) -> None:
        if self._current():
            self._end()
            self.failed.emit(message)

    @Slot()
    def _on_cancelled(self) -> None:
        if self._current():
            self._end()
            self.cancelled.emit()
