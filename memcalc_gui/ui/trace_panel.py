"""'Precise (trace)': trace the training step on fake tensors and draw that ledger instead of the analytic one.

:class:`TracePanel` adds to the main window a checkable "Precise (trace)" button in the row above the
chart, with a progress label, a progress bar and Cancel beside it, and the "Trace" tab (analytic vs
trace per phase, the modules holding the most activations at the forward peak, the CUDA rules the trace
adds). The analytic result is always drawn at once; with the toggle on, each new setup is traced
``TRACE_DELAY_MS`` after the analytic result (typing settles first) on a :class:`~.workers.TaskRunner`
thread, and the trace's ledger then replaces the drawn one (chart, banner, ledger, advice; method
"trace"). An edit cancels a running trace and starts the next one; a failure is reported and the
analytic result stays. Traces of recent setups are kept, so undo back to a traced setup shows it at once.

For a multi-GPU setup the trace runs one replica's step and the strategy's per-GPU model states
replace the traced ones (as in the analytic ledger). A family without a block model (fitted method) is traced
from its config, one rank of its DDP or FSDP2 layout; its what-ifs stay the fitted method's. A bare parameter
count has no architecture to trace. torch and transformers are imported on the worker thread only
(``trace_available`` looks for them without importing).
"""

from __future__ import annotations

import dataclasses
import html
import json
import sys
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, Qt, QTimer, Signal, Slot
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (
    QFrame,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from .. import install_hint
from ..core.result import Result
from ..core.setup import TrainingSetup
from ..core.units import format_bytes
from ..core.vocab import PHASE_LABELS, PHASES
from ..trace import fake
from ..trace.fake import TraceCancelled, TraceResult
from ..view.theme import error_color
from .form import fitted_config
from .measure_panel import ElidedLabel, progress_fraction, signed_pct
from .tables import fit_height, fixed_table
from .workers import STOP_TIMEOUT_MS, Job, TaskRunner

if TYPE_CHECKING:
    from .main_window import MainWindow

#: Start a trace this long after the last analytic result (each keystroke restarts the wait).
TRACE_DELAY_MS = 400
#: Traced setups kept (undo/redo back to one of them shows its trace at once).
CACHE_SIZE = 8
INSTALL_HINT = install_hint()
TOGGLE_TEXT = "Precise (trace)"
TOGGLE_TEXT_ON = "✓ Precise (trace)"
TOGGLE_TIP = ("Trace one training step of this setup on fake tensors (PyTorch + transformers; nothing is "
              "allocated, a 7B model takes a few seconds) and draw that exact tensor ledger, with CUDA's 512-byte "
              "rounding, context and reserve added, instead of the analytic estimate. The analytic result appears "
              "at once; the trace follows and is redone after every edit.")
NO_TORCH_TIP = ("The trace needs PyTorch and transformers, which are not installed. "
                + (f"Install them with:  {INSTALL_HINT}" if INSTALL_HINT.startswith("pip") else
                   INSTALL_HINT[:1].upper() + INSTALL_HINT[1:] + "."))
NO_ARCHITECTURE = ("A bare parameter count has no architecture to trace: choose a preset or open a config.json.")
#: A difference above this (in %) is drawn in the warning colour.
DIFF_WARN_PCT = 10.0
#: Settings key: whether "Precise (trace)" was on when the window closed.
KEY_ENABLED = "trace/enabled"


def trace_key(setup: TrainingSetup) -> tuple[TrainingSetup, str]:
    """What a trace depends on: the setup, and a fitted family's config (setups compare without it)."""
    config = fitted_config(setup)
    return setup, json.dumps(config, sort_keys=True, default=str) if config is not None else ""


def trace_job(setup: TrainingSetup, basis: Result | None = None) -> Job:
    """The worker job: ``fake.trace_estimate`` of ``setup`` (looked up at run time, so tests can replace it),
    then the verdict and suggestions of the traced ledger, so the GUI thread only draws. A fitted family is traced
    from its config; ``basis``, its fitted result, gives the what-ifs and the column the trace is compared with."""

    def job(progress: Any, should_stop: Any) -> tuple[TraceResult, Result]:
        if "torch" not in sys.modules:
            progress("loading PyTorch…")
        traced = fake.trace_estimate(setup, config=fitted_config(setup), progress=progress, should_stop=should_stop)
        if should_stop():
            raise TraceCancelled("trace cancelled")
        progress("verdict and suggestions")
        if setup.model is None and basis is not None and traced.analytic is None:
            traced = dataclasses.replace(traced, analytic=basis.estimate)
        return traced, traced.result(basis if setup.model is None else None)

    return job


def skip_reason(setup: TrainingSetup) -> str:
    """Why this setup is not traced ("" when it is)."""
    if setup.model is None and fitted_config(setup) is None:
        return NO_ARCHITECTURE
    refused = fake.refusal(setup)
    return refused[:1].upper() + refused[1:] + "." if refused else ""


def compared_with(traced: TraceResult) -> str:
    """The method the trace is compared with ("analytic", or "fitted" for a family without a block model)."""
    return traced.analytic.method if traced.analytic is not None else "analytic"


def peak_difference_pct(traced: TraceResult) -> float | None:
    """(trace − analytic) / analytic of the tensor peak, %."""
    if traced.analytic is None:
        return None
    a = traced.analytic.peak_tensor_bytes
    return (traced.estimate.peak_tensor_bytes - a) / a * 100 if a else None


def difference_text(traced: TraceResult) -> str:
    """``peak +1.2 % vs analytic, traced in 3.4 s`` (the method label's tail)."""
    diff = peak_difference_pct(traced)
    vs = f"tensor peak {signed_pct(diff)} vs {compared_with(traced)}" if diff is not None else \
        "no analytic method to compare"
    return f"{vs}, traced in {traced.seconds:.1f} s"


def _item(text: str, tooltip: str = "", *, align_right: bool = True) -> QTableWidgetItem:
    item = QTableWidgetItem(text)
    if tooltip:
        item.setToolTip(tooltip)
    align = Qt.AlignmentFlag.AlignRight if align_right else Qt.AlignmentFlag.AlignLeft
    item.setTextAlignment(Qt.AlignmentFlag.AlignVCenter | align)
    return item


# ---- the "Trace" tab ------------------------------------------------------------------------------
class TraceView(QScrollArea):
    """Analytic vs trace per phase, the per-module breakdown and the rules applied on top."""

    PHASE_COLUMNS = ("Analytic (tensors)", "Trace (tensors)", "Difference")
    MODULE_COLUMNS = ("Module", "Activations", "Share")

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("traceView")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        inner = QWidget()
        inner.setObjectName("traceInner")
        lay = QVBoxLayout(inner)
        lay.setContentsMargins(8, 6, 8, 6)
        lay.setSpacing(6)

        self.headline = QLabel("")
        self.headline.setObjectName("traceHeadline")
        self.headline.setWordWrap(True)
        self.headline.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        f = self.headline.font()
        f.setBold(True)
        self.headline.setFont(f)
        lay.addWidget(self.headline)

        self.message = QLabel("")
        self.message.setObjectName("traceMessage")
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.message.setVisible(False)
        lay.addWidget(self.message)

        self.phase_table = fixed_table(len(PHASES), list(self.PHASE_COLUMNS), "tracePhaseTable")
        self.phase_table.setAccessibleName("Analytic versus traced tensor bytes per phase")
        self.phase_table.setVerticalHeaderLabels([PHASE_LABELS[p] for p in PHASES])
        self.phase_table.horizontalHeaderItem(2).setToolTip(
            "(trace − analytic) / analytic, tensor bytes: positive means the trace found more")
        lay.addWidget(self.phase_table)

        self.modules_title = QLabel("<b>Activations at the forward peak, by module</b> (layers grouped: "
                                    "<code>layers.*</code> sums every layer)")
        self.modules_title.setObjectName("traceModulesTitle")
        self.modules_title.setWordWrap(True)
        self.modules_title.setVisible(False)
        lay.addWidget(self.modules_title)
        self.module_table = fixed_table(0, list(self.MODULE_COLUMNS), "traceModuleTable")
        self.module_table.setAccessibleName("Modules holding the most activations at the forward peak")
        header = self.module_table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for c in (1, 2):
            header.setSectionResizeMode(c, QHeaderView.ResizeMode.ResizeToContents)
        self.module_table.verticalHeader().setVisible(False)
        self.module_table.horizontalHeaderItem(2).setToolTip("Share of the modules listed")
        lay.addWidget(self.module_table)

        self.rules = QLabel("")
        self.rules.setObjectName("traceRules")
        self.rules.setWordWrap(True)
        self.rules.setTextFormat(Qt.TextFormat.RichText)
        self.rules.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.rules.setVisible(False)
        lay.addWidget(self.rules)
        lay.addStretch(1)
        self.setWidget(inner)
        self.traced: TraceResult | None = None
        self.set_off()

    # ---- states --------------------------------------------------------------------------------
    def _clear(self) -> None:
        self.traced = None
        self.message.setVisible(False)
        for w in (self.phase_table, self.modules_title, self.module_table, self.rules):
            w.setVisible(False)

    def set_off(self) -> None:
        self.set_message("The trace is off.", "“Precise (trace)” above the chart traces one training step of this "
                         "setup on fake tensors (nothing is allocated) and draws that exact ledger instead of the "
                         "analytic estimate; this tab then compares the two per phase and lists the modules that "
                         "hold the most activations.", error=False)

    def set_waiting(self, text: str) -> None:
        self._clear()
        self.headline.setText(text)

    def set_message(self, headline: str, text: str, *, error: bool = True) -> None:
        self._clear()
        self.headline.setText(headline)
        self.message.setText(text)
        color = error_color(self.palette()) if error else self.palette().color(QPalette.ColorRole.WindowText)
        self.message.setStyleSheet(f"#traceMessage {{ color: {color.name()}; }}")
        self.message.setVisible(bool(text))

    def set_result(self, traced: TraceResult) -> None:
        self._clear()
        self.traced = traced
        est = traced.estimate
        diff = peak_difference_pct(traced)
        vs = f", {signed_pct(diff)} vs the {compared_with(traced)} estimate" if diff is not None else ""
        self.headline.setText(f"Trace: tensor peak {format_bytes(est.peak_tensor_bytes)} in the "
                              f"{PHASE_LABELS[est.peak_phase].lower()} phase{vs} (traced in {traced.seconds:.1f} s).")
        header = self.phase_table.horizontalHeaderItem(0)
        if header is not None:
            header.setText(f"{compared_with(traced).capitalize()} (tensors)")
        self._fill_phases(traced)
        self._fill_modules(traced.modules)
        rules = "".join(f"<li>{html.escape(r)}</li>" for r in traced.rules)
        self.rules.setText("<b>Rules applied on top of the trace</b><ul style='margin-left: 0px; "
                           f"-qt-list-indent: 1;'>{rules}</ul>" if rules else "")
        self.rules.setVisible(bool(rules))

    def _fill_phases(self, traced: TraceResult) -> None:
        diffs = traced.difference_pct()
        warn = error_color(self.palette())
        for r, phase in enumerate(PHASES):
            t = traced.estimate.phases[phase].tensor_bytes
            a = traced.analytic.phases[phase].tensor_bytes if traced.analytic is not None else None
            self.phase_table.setItem(r, 0, _item("–" if a is None else format_bytes(a),
                                                 "" if a is None else f"{a:,} bytes"))
            self.phase_table.setItem(r, 1, _item(format_bytes(t), f"{t:,} bytes"))
            d = diffs.get(phase)
            cell = _item("–" if d is None else signed_pct(d), "" if a is None else f"{t - a:+,} bytes")
            if d is not None and abs(d) > DIFF_WARN_PCT:
                cell.setForeground(warn)
                font = cell.font()
                font.setBold(True)
                cell.setFont(font)
            self.phase_table.setItem(r, 2, cell)
        fit_height(self.phase_table)
        self.phase_table.setVisible(True)

    def _fill_modules(self, modules: list[tuple[str, int]]) -> None:
        if not modules:
            return
        total = sum(n for _, n in modules)
        self.module_table.setRowCount(len(modules))
        for r, (name, n) in enumerate(modules):
            self.module_table.setItem(r, 0, _item(name, name, align_right=False))
            self.module_table.setItem(r, 1, _item(format_bytes(n), f"{n:,} bytes"))
            self.module_table.setItem(r, 2, _item(f"{n / total * 100:.1f} %" if total else "–"))
        fit_height(self.module_table)
        self.modules_title.setVisible(True)
        self.module_table.setVisible(True)

    # ---- queries (tests) -------------------------------------------------------------------------
    def cell(self, phase: str, column: int) -> str:
        item = self.phase_table.item(PHASES.index(phase), column)
        return item.text() if item is not None else ""

    def module_names(self) -> list[str]:
        if not self.module_table.isVisibleTo(self):
            return []
        return [self.module_table.item(r, 0).text() for r in range(self.module_table.rowCount())]

    def text(self) -> str:
        parts = [self.headline.text()]
        if self.message.isVisibleTo(self) and self.message.text():
            parts.append(self.message.text())
        return "\n".join(parts)


# ---- the controller -------------------------------------------------------------------------------
class TracePanel(QObject):
    """Wires "Precise (trace)" into a :class:`MainWindow`.

    Window-level signals (connect before toggling): ``started(TrainingSetup)``, ``progress(str)``,
    ``finished(TraceResult)`` after the trace is drawn, ``failed(str)``, ``cancelled()`` (the user's
    Cancel; a restart after an edit is silent), ``skipped(str)`` when a setup cannot be traced.
    """

    started = Signal(object)
    progress = Signal(str)
    finished = Signal(object)
    failed = Signal(str)
    cancelled = Signal()
    skipped = Signal(str)

    def __init__(self, window: MainWindow) -> None:
        super().__init__(window)
        self.setObjectName("tracePanel")
        self.window = window
        self.available = fake.trace_available()
        self._cache: list[tuple[tuple[TrainingSetup, str], TraceResult, Result]] = []
        self._target: Result | None = None  # the analytic result whose setup should be traced
        self._running: tuple[TrainingSetup, str] | None = None  # the trace_key of the running trace
        self._restart = False  # a trace is due once the running measurement (or trace) has ended
        self._user_cancel = False
        self._failures: list[tuple[tuple[TrainingSetup, str], str]] = []  # recent setups whose trace failed, and why
        self._closed = False

        self.runner = TaskRunner("memcalc-trace", cancel_types=(TraceCancelled,), parent=self)
        self.runner.progress.connect(self._on_progress)
        self.runner.finished.connect(self._on_finished)
        self.runner.failed.connect(self._on_failed)
        self.runner.cancelled.connect(self._on_cancelled)

        self.delay = QTimer(self)
        self.delay.setObjectName("traceDelayTimer")
        self.delay.setSingleShot(True)
        self.delay.setInterval(TRACE_DELAY_MS)
        self.delay.timeout.connect(self._start_target)

        # [progress] [bar] [Cancel] [Precise (trace)] go right after the method label
        self.progress_label = ElidedLabel("")
        self.progress_label.setObjectName("traceProgress")
        self.progress_label.setVisible(False)
        self.progress_bar = QProgressBar()
        self.progress_bar.setObjectName("traceProgressBar")
        self.progress_bar.setTextVisible(False)
        self.progress_bar.setFixedWidth(80)
        self.progress_bar.setMaximumHeight(14)
        self.progress_bar.setVisible(False)
        self.cancel_button = QPushButton("Cancel trace")
        self.cancel_button.setObjectName("traceCancel")
        self.cancel_button.setToolTip("Stop this trace and keep the analytic result (the next edit traces again; "
                                      "turn “Precise (trace)” off to stop tracing)")
        self.cancel_button.setVisible(False)
        self.cancel_button.clicked.connect(self.cancel)
        self.toggle = QPushButton(TOGGLE_TEXT)
        self.toggle.setObjectName("traceToggle")
        self.toggle.setCheckable(True)
        self.toggle.setAccessibleName(TOGGLE_TEXT)
        self.toggle.toggled.connect(self._on_toggled)
        self.toggle.toggled.connect(lambda on: self.toggle.setText(TOGGLE_TEXT_ON if on else TOGGLE_TEXT))
        row = window.action_row
        row.insertWidget(row.indexOf(window.method_label) + 1, self.toggle)
        window.job_row(self.progress_label, self.progress_bar, self.cancel_button)
        if self.available:
            self.toggle.setToolTip(TOGGLE_TIP)
        else:
            self.toggle.setEnabled(False)
            self.toggle.setToolTip(NO_TORCH_TIP)

        self.view = TraceView()
        measure_view = getattr(getattr(window, "measure_panel", None), "view", None)
        measured = window.tabs.indexOf(measure_view) if measure_view is not None else -1
        index = measured if measured >= 0 else window.tabs.count()  # before "Measured"
        self.tab_index = window.tabs.insertTab(index, self.view, "Trace")
        window.tabs.setTabToolTip(self.tab_index, "The traced ledger vs the analytic estimate, per phase and module")
        if not self.available:
            self.view.set_message("The trace is not available.", NO_TORCH_TIP)

        window.result_changed.connect(self._on_result)
        measure = getattr(window, "measure_panel", None)
        if measure is not None:
            measure.runner.running_changed.connect(self._on_measure_running)

    # ---- state ----------------------------------------------------------------------------------
    def is_enabled(self) -> bool:
        return self.available and self.toggle.isChecked() and not self._closed

    def is_running(self) -> bool:
        return self.runner.is_running()

    def set_enabled(self, on: bool) -> None:
        """Turn the trace on or off (the toggle; ignored when torch/transformers are missing)."""
        if self.available:
            self.toggle.setChecked(on)

    def restore_enabled(self) -> None:
        """Turn the toggle on as saved, tracing after the usual delay (the window is shown first)."""
        if not self.available or self.toggle.isChecked():
            return
        self.toggle.blockSignals(True)
        self.toggle.setChecked(True)
        self.toggle.blockSignals(False)
        self.toggle.setText(TOGGLE_TEXT_ON)
        self._target = self.window.analytic_result
        self._consider(self._target, delay=True)

    def cached(self, setup: TrainingSetup) -> tuple[TraceResult, Result] | None:
        key = trace_key(setup)
        for k, traced, result in self._cache:
            if k == key:
                return traced, result
        return None

    def _remember(self, traced: TraceResult, result: Result) -> None:
        key = trace_key(traced.estimate.setup)
        self._cache = [e for e in self._cache if e[0] != key]
        self._cache.insert(0, (key, traced, result))
        del self._cache[CACHE_SIZE:]

    # ---- reactions --------------------------------------------------------------------------------
    @Slot(bool)
    def _on_toggled(self, on: bool) -> None:
        if self._closed:
            return
        if on:
            self._failures = []  # turning it on again retries the setups that failed
            self._target = self.window.analytic_result
            self._consider(self._target, delay=False)
        else:
            self.delay.stop()
            self._restart = False
            if self.runner.is_running():
                self.runner.cancel()
            self._set_running(False)
            self._set_note("")
            self.view.set_off()
            if self.window.trace_result is not None:
                self.window.show_analytic()
        settings = getattr(self.window, "settings", None)
        if settings is not None:
            settings.setValue(KEY_ENABLED, bool(on))

    @Slot(object)
    def _on_result(self, result: Result) -> None:
        """A new analytic result is drawn (an edit, undo, a suggestion)."""
        if not self.is_enabled():
            return
        self._target = result
        self._consider(result, delay=True)

    def _consider(self, result: Result | None, *, delay: bool) -> None:
        if result is None:
            return
        hit = self.cached(result.setup)
        if hit is not None:
            self.delay.stop()
            self._restart = False
            if self.runner.is_running():
                self.runner.cancel()
            self._apply(*hit)
            return
        failure = next((m for k, m in self._failures if k == trace_key(result.setup)), None)
        if failure is not None:
            self.delay.stop()  # it failed for exactly this setup: say so again rather than retry
            if self.runner.is_running():
                self.runner.cancel()
            self._show_failure(failure, announce=False)
            return
        reason = skip_reason(result.setup)
        if reason:
            self.delay.stop()
            self._restart = False
            if self.runner.is_running():
                self.runner.cancel()
            self._set_running(False)
            self.view.set_message("This setup is not traced.", reason, error=False)
            self._set_note("Trace: not for this setup", reason)
            self.skipped.emit(reason)
            return
        self._set_note("")
        if self.runner.is_running():
            if self._running != trace_key(result.setup):
                self.runner.cancel()  # the running trace is for an earlier setup
                self._restart = True
                self._set_progress_text("Setup changed: restarting the trace…")
            return
        self.view.set_waiting("Tracing this setup shortly…" if delay else "Tracing this setup…")
        if delay:
            self.delay.start()
        else:
            self._start_target()

    @Slot()
    def _start_target(self) -> None:
        self.delay.stop()
        if not self.is_enabled() or self._target is None:
            return
        if self.runner.is_running():
            self._restart = True
            if self._running != trace_key(self._target.setup):
                self.runner.cancel()
            return
        measure = getattr(self.window, "measure_panel", None)
        if measure is not None and measure.is_running():
            self._restart = True  # one torch job at a time: trace when the measurement has ended
            self._set_note("Trace waits for the measurement")
            return
        setup = self._target.setup
        if self.cached(setup) is not None or skip_reason(setup):
            self._consider(self._target, delay=False)
            return
        self._restart = False
        self._user_cancel = False
        self._running = trace_key(setup)
        self.view.set_waiting("Tracing this setup…")
        self._set_running(True, "Tracing: starting…")
        self.started.emit(setup)
        self.runner.start(trace_job(setup, self._target))

    @Slot(bool)
    def _on_measure_running(self, running: bool) -> None:
        if not running and self._restart and self.is_enabled():
            self._set_note("")
            self.delay.start()

    @Slot()
    def cancel(self) -> None:
        """Cancel: stop the running trace and keep the analytic result (the next edit traces again)."""
        self.delay.stop()
        self._restart = False
        if self.runner.is_running():
            self._user_cancel = True
            self.runner.cancel()
            self.cancel_button.setEnabled(False)
            self._set_progress_text("Cancelling the trace…")

    # ---- runner outcome ----------------------------------------------------------------------------
    @Slot(str)
    def _on_progress(self, text: str) -> None:
        message = f"Tracing: {text}"
        self._set_progress_text(message)
        fraction = progress_fraction(text)
        if fraction is not None:
            self.progress_bar.setRange(0, 100)
            self.progress_bar.setValue(round(fraction * 100))
        self.progress.emit(text)

    @Slot(object)
    def _on_finished(self, outcome: tuple[TraceResult, Result]) -> None:
        traced, result = outcome
        self._running = None
        self._set_running(False)
        self._remember(traced, result)
        if self._closed:
            return
        if self.is_enabled():
            self._consider(self._target, delay=False)  # draws it from the cache, or traces the newer setup

    @Slot(str)
    def _on_failed(self, message: str) -> None:
        failed_setup = self._running
        self._running = None
        self._set_running(False)
        if self._closed or not self.is_enabled():
            return
        if self._target is not None and failed_setup != trace_key(self._target.setup):
            self._consider(self._target, delay=False)  # the setup changed while it ran: trace the new one
            return
        if failed_setup is not None:
            self._failures = [(failed_setup, message), *self._failures[:CACHE_SIZE - 1]]
        self._show_failure(message)

    def _show_failure(self, message: str, *, announce: bool = True) -> None:
        self._set_running(False)
        self.view.set_message("The trace failed; the analytic result stays.", message)
        self._set_note("Trace failed (see the Trace tab)", message)
        if announce:
            self.window.statusBar().showMessage(f"The trace failed: {message} — showing the analytic estimate.",
                                                15000)
            self.failed.emit(message)

    @Slot()
    def _on_cancelled(self) -> None:
        self._running = None
        self._set_running(False)
        user, self._user_cancel = self._user_cancel, False
        if self._closed or not self.is_enabled():
            return
        if not user:  # cancelled because the setup changed (or cannot be traced): go on with the new one
            self._consider(self._target, delay=False)
            return
        self.view.set_message("Trace cancelled.", "The analytic result is shown. The next edit traces again; "
                              "turn “Precise (trace)” off to stop tracing.", error=False)
        self._set_note("Trace cancelled")
        self.window.statusBar().showMessage("Trace cancelled: showing the analytic estimate.", 8000)
        self.cancelled.emit()

    def _apply(self, traced: TraceResult, result: Result) -> None:
        """Draw the trace in the window (the analytic plan, if any, is kept)."""
        analytic = self.window.analytic_result
        plan = analytic.plan if analytic is not None and analytic.setup == result.setup else result.plan
        if plan is not result.plan:
            result = Result(result.estimate, result.verdict, plan)
        self._set_running(False)
        self._set_note("")
        self.window.show_trace(result, traced)
        self.view.set_result(traced)
        self.finished.emit(traced)

    # ---- widgets ---------------------------------------------------------------------------------
    def _set_running(self, running: bool, text: str = "") -> None:
        self.cancel_button.setVisible(running)
        self.cancel_button.setEnabled(running)
        self.progress_bar.setVisible(running)
        self.progress_bar.setRange(0, 0)  # busy until an iteration is reported
        self.progress_label.setVisible(running)
        self._set_progress_text(text if running else "")

    def _set_note(self, text: str, tooltip: str = "") -> None:
        """A short word in the action row while idle (skipped, failed, cancelled)."""
        if self.runner.is_running():
            return
        self.progress_label.setText(text)
        self.progress_label.setToolTip(tooltip or text)
        self.progress_label.setVisible(bool(text))

    def _set_progress_text(self, text: str) -> None:
        self.progress_label.setText(text)
        self.progress_label.setToolTip(text)

    def note(self) -> str:
        return self.progress_label.text() if self.progress_label.isVisibleTo(self.window) else ""

    # ---- shutdown --------------------------------------------------------------------------------
    def shutdown(self, timeout_ms: int = STOP_TIMEOUT_MS) -> None:
        """Stop the timer and the worker, waiting for its thread at most ``timeout_ms`` (closeEvent, aboutToQuit)."""
        self._closed = True
        self.delay.stop()
        self.runner.stop(timeout_ms)

