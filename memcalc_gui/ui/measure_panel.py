"""'Measure on this GPU': run one real training step of the setup and compare it with the estimate.

:class:`MeasurePanel` adds to the main window a button in the row above the chart (its label names the
device found), a progress label and a Cancel button beside it, the "Measured" tab beside Ledger and
Assumptions, and measured markers on the chart. The step runs on a :class:`~.workers.TaskRunner`
thread; the window stays responsive and closing it cancels and waits for the run.

torch is never imported at start-up: the device is probed on a worker thread a moment after the
window is shown (``DETECT_DELAY_MS``), and until then the button reads "Measure on this machine…".

Staleness: measured values belong to one setup. When an edit changes anything that changes the
tensors (model, shape, precision, optimizer, attention, checkpointing), the chart markers are hidden
and the Measured tab says the measurement is for an earlier setup; undoing back to the measured setup
brings the markers back. Capacity, GPU, CUDA context and allocator reserve do not change what was
measured, so editing them (or "Use measured overheads") keeps the overlay.
"""

from __future__ import annotations

import html
import json
import re
import sys
import time
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QEvent, QObject, Qt, QTimer, Signal, Slot
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPalette
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from .. import install_hint
from ..core.result import Result
from ..core.setup import TrainingSetup
from ..core.units import format_bytes
from ..core.vocab import PHASE_LABELS, PHASES
from ..measure import engine
from ..view.theme import OVER_COLOR, error_color, tinted
from .form import fitted_config
from .tables import fit_height, fixed_table
from .workers import STOP_TIMEOUT_MS, Job, TaskRunner

if TYPE_CHECKING:
    from .main_window import MainWindow

#: Probe the device this long after the window is first shown (torch takes ~1.5 s to import).
DETECT_DELAY_MS = 2000
#: Passed to ``engine.measure``: a larger setup is scaled down to stay near this.
TIME_BUDGET_S = 30.0
ITERATIONS = 3
INSTALL_HINT = install_hint()
NO_TORCH_MESSAGE = "Measuring needs PyTorch, which is not installed. " + (
    f"Install it with:  {INSTALL_HINT}" if INSTALL_HINT.startswith("pip") else
    INSTALL_HINT[:1].upper() + INSTALL_HINT[1:] + ".")
BUTTON_UNKNOWN = "Measure on this machine…"
BUTTON_NO_TORCH = "Measure… (needs PyTorch)"
#: An error above this (in %) is drawn in the warning colour.
ERROR_WARN_PCT = 10.0

#: Setup fields that do not change the measured tensors (editing them keeps the overlay).
_NOT_MEASURED = ("gpu", "capacity_bytes", "cuda_context_bytes", "allocator_reserve")

SIGNAL_TEXT = {
    "inspect_estimate_difference": "The measured peak is more than 10 % above the estimate: inspect the "
                                   "estimate (memory ledger).",
    "inspect_allocator_retained_space": "The allocator holds more than 10 % of capacity beyond what tensors use "
                                        "(cache and fragmentation).",
    "capacity_pressure": "Less than 10 % of capacity is left above the reserved peak.",
}

_ITERATION_RE = re.compile(r"iteration (\d+) of (\d+): (forward|backward|optimizer step)")
_STEP_INDEX = {"forward": 0, "backward": 1, "optimizer step": 2}


# ---- helpers (pure; tests use them) ---------------------------------------------------------------
def button_text(device: engine.DeviceInfo | None) -> str:
    """The measure button's label for the device found (``None``: not probed yet)."""
    return f"Measure {device.label}" if device is not None else BUTTON_UNKNOWN


def device_short(device: engine.DeviceInfo) -> str:
    return device.name if device.kind == "cuda" else "CPU"


def overlay_label(result: engine.MeasureResult) -> str:
    """The legend entry of the measured markers: ``Measured (NVIDIA H100 80GB HBM3)``."""
    scaled = ", scaled-down setup" if result.scaled else ""
    rank = f", rank {result.shown_rank + 1} of {len(result.ranks)}" if result.ranks else ""
    return f"Measured ({device_short(result.device)}{rank}{scaled})"


def tensor_key(setup: TrainingSetup) -> dict[str, Any]:
    """What a measurement depends on: the setup without capacity and the overheads it does not measure, and a family
    without a block model's config (setups compare without it)."""
    data = setup.describe()
    for name in _NOT_MEASURED:
        data.pop(name, None)
    config = fitted_config(setup)
    if config is not None:
        data["fitted_config"] = json.dumps(config, sort_keys=True, default=str)
    return data


def overhead_changes(result: engine.MeasureResult) -> dict[str, str] | None:
    """The measured CUDA context and allocator reserve as form values, or ``None`` (CPU, OOM)."""
    overheads = result.measured_overheads()
    if overheads is None:
        return None
    reserve = float(overheads["allocator_reserve"]) * 100
    return {"cuda_context": format_bytes(int(overheads["cuda_context_bytes"])),
            "allocator_reserve": f"{reserve:.4g} %"}


def progress_fraction(text: str) -> float | None:
    """How far a run is (0–1) from an engine progress line, or ``None`` when it does not say."""
    m = _ITERATION_RE.search(text)
    if not m:
        return None
    it, total, step = int(m.group(1)), int(m.group(2)), m.group(3)
    if total <= 0:
        return None
    return min(1.0, ((it - 1) + _STEP_INDEX[step] / 3) / total)


def measure_job(setup: TrainingSetup, *, iterations: int | None = None, time_budget_s: float | None = None,
                device: str = "auto", config: dict[str, Any] | None = None) -> Job:
    """The worker job: ``engine.measure`` of ``setup`` (looked up at run time, so tests can replace it); ``config``:
    a family without a block model's, compared with the fitted method's ledger of what ran."""
    iterations = ITERATIONS if iterations is None else iterations
    budget = TIME_BUDGET_S if time_budget_s is None else time_budget_s

    def job(progress: Any, should_stop: Any) -> engine.MeasureResult:
        if "torch" not in sys.modules:
            progress("loading PyTorch…")
        return engine.measure(setup, device=device, iterations=iterations, progress=progress,
                              should_stop=should_stop, time_budget_s=budget, config=config)

    return job


def detect_job(progress: Any, should_stop: Any) -> engine.DeviceInfo:
    return engine.detect_device("auto")


def signed_pct(value: float) -> str:
    """``+1.2 %``, ``-3.4 %``; a value that rounds to zero is ``0.0 %`` (never ``-0.0 %``)."""
    return "0.0 %" if abs(value) < 0.05 else f"{value:+.1f} %"


def headline(result: engine.MeasureResult) -> str:
    """The engine's headline, with a rounded-to-zero error written as 0.0 %."""
    return re.sub(r"[-+]0\.0 %", "0.0 %", result.headline())


class ElidedLabel(QLabel):
    """A one-line label that shrinks with the row and elides its text instead of widening the window."""

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)

    def sizeHint(self):  # type: ignore[no-untyped-def]
        hint = super().sizeHint()
        hint.setWidth(min(hint.width(), 360))
        return hint

    def minimumSizeHint(self):  # type: ignore[no-untyped-def]
        hint = super().minimumSizeHint()
        hint.setWidth(min(hint.width(), 60))
        return hint

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        rect = self.contentsRect()
        text = self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight, rect.width())
        painter.setPen(self.palette().color(QPalette.ColorRole.WindowText))
        painter.drawText(rect, int(Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignRight), text)


def _item(text: str, tooltip: str = "", *, align_right: bool = True) -> QTableWidgetItem:
    item = QTableWidgetItem(text)
    if tooltip:
        item.setToolTip(tooltip)
    flags = Qt.AlignmentFlag.AlignVCenter | (Qt.AlignmentFlag.AlignRight if align_right else Qt.AlignmentFlag.AlignLeft)
    item.setTextAlignment(flags)
    return item


# ---- the "Measured" tab ---------------------------------------------------------------------------
class MeasuredView(QScrollArea):
    """Measured vs estimated per phase, then signals, the leak check, allocator and context readings."""

    use_overheads_requested = Signal()
    COLUMNS = ("Measured peak", "Estimate", "Error")
    RANK_COLUMNS = tuple(PHASE_LABELS[p] for p in PHASES[1:])

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("measuredView")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        inner = QWidget()
        inner.setObjectName("measuredInner")
        lay = QVBoxLayout(inner)
        lay.setContentsMargins(8, 6, 8, 6)
        lay.setSpacing(6)

        self.headline = QLabel("")
        self.headline.setObjectName("measuredHeadline")
        self.headline.setWordWrap(True)
        self.headline.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        f = self.headline.font()
        f.setBold(True)
        self.headline.setFont(f)
        lay.addWidget(self.headline)

        self.message = QLabel("")  # errors, OOM, missing torch
        self.message.setObjectName("measuredMessage")
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.message.setVisible(False)
        lay.addWidget(self.message)

        self.scale_note = QLabel("")
        self.scale_note.setObjectName("measuredScaleNote")
        self.scale_note.setWordWrap(True)
        self.scale_note.setVisible(False)
        self.scale_note.setStyleSheet(f"#measuredScaleNote {{ background: {tinted('#E69F00', 50)}; "
                                      "border: 1px solid #E69F00; border-radius: 4px; padding: 4px; }")
        lay.addWidget(self.scale_note)

        self.stale_note = QLabel("")
        self.stale_note.setObjectName("measuredStale")
        self.stale_note.setWordWrap(True)
        sf = self.stale_note.font()
        sf.setItalic(True)
        self.stale_note.setFont(sf)
        self.stale_note.setVisible(False)
        lay.addWidget(self.stale_note)

        self.table = fixed_table(len(PHASES), self.COLUMNS, "measuredTable",
                                  "Measured versus estimated peak per phase")
        self.table.setVerticalHeaderLabels([PHASE_LABELS[p] for p in PHASES])
        self.table.horizontalHeaderItem(2).setToolTip(
            "(estimate − measured) / measured: positive means the estimate is higher")
        lay.addWidget(self.table)

        # a multi-GPU setup: every rank measured in its own process, each beside its own estimate
        self.ranks_label = QLabel("")
        self.ranks_label.setObjectName("measuredRanksLabel")
        self.ranks_label.setWordWrap(True)
        self.ranks_label.setVisible(False)
        lay.addWidget(self.ranks_label)
        self.ranks_table = fixed_table(0, self.RANK_COLUMNS, "measuredRanks",
                                        "Every rank's measured peak per phase and the estimate's error")
        lay.addWidget(self.ranks_table)

        row = QHBoxLayout()
        self.use_overheads = QPushButton("Use measured overheads")
        self.use_overheads.setObjectName("useMeasuredOverheads")
        self.use_overheads.setEnabled(False)
        self.use_overheads.clicked.connect(self.use_overheads_requested)
        row.addWidget(self.use_overheads)
        self.overheads_hint = QLabel("")
        self.overheads_hint.setObjectName("measuredOverheadsHint")
        self.overheads_hint.setWordWrap(True)
        row.addWidget(self.overheads_hint, 1)
        lay.addLayout(row)

        self.details = QLabel("")
        self.details.setObjectName("measuredDetails")
        self.details.setWordWrap(True)
        self.details.setTextFormat(Qt.TextFormat.RichText)
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details.setVisible(False)
        lay.addWidget(self.details)

        lay.addStretch(1)
        self.setWidget(inner)
        self.result: engine.MeasureResult | None = None
        self.set_idle()

    # ---- states --------------------------------------------------------------------------------
    def _clear(self) -> None:
        self.result = None
        self._stale = False
        self.message.setVisible(False)
        self.scale_note.setVisible(False)
        self.stale_note.setVisible(False)
        self.table.setVisible(False)
        self.ranks_label.setVisible(False)
        self.ranks_table.setVisible(False)
        self.details.setVisible(False)
        self.use_overheads.setEnabled(False)
        self.use_overheads.setVisible(False)
        self.overheads_hint.setText("")
        self.overheads_hint.setVisible(False)

    def set_idle(self) -> None:
        self.set_message("Not measured yet.", "“Measure on …” above the chart runs one real training step of this "
                         "setup (three iterations) and compares each phase's measured peak with the estimate.",
                         error=False)

    def set_running(self, text: str) -> None:
        self._clear()
        self.headline.setText(text)

    def set_message(self, headline: str, text: str, *, error: bool = True) -> None:
        """An error, a cancellation or the missing-torch hint (selectable text)."""
        self._clear()
        self.headline.setText(headline)
        self.message.setText(text)
        color = error_color(self.palette()).name() if error else self.palette().color(
            QPalette.ColorRole.WindowText).name()
        self.message.setStyleSheet(f"#measuredMessage {{ color: {color}; }}")
        self.message.setVisible(bool(text))

    def set_result(self, result: engine.MeasureResult) -> None:
        self._clear()
        self.result = result
        if result.oom:
            self.headline.setText(f"Measured {result.device.label}: does not fit.")
            self.message.setText(result.oom)
            self.message.setStyleSheet(f"#measuredMessage {{ color: {error_color(self.palette()).name()}; "
                                       "font-weight: bold; }")
            self.message.setVisible(True)
        else:
            self.headline.setText(headline(result))
        if result.scaled:
            self.scale_note.setText(f"<b>Scaled down.</b> {html.escape(result.scale_note)} The Estimate column and "
                                    "the dashed bars beside each phase on the chart are for the measured setup, not "
                                    "the full one.")
            self.scale_note.setVisible(True)
        if result.phases and not result.oom:
            self._fill_table(result)
            if len(result.ranks) > 1:
                self._fill_ranks(result)
        self.details.setText(details_html(result))
        self.details.setVisible(True)
        changes = overhead_changes(result)
        self.use_overheads.setVisible(True)
        self.overheads_hint.setVisible(True)
        self.use_overheads.setEnabled(changes is not None)
        if changes is not None:
            text = (f"Sets the CUDA context to {changes['cuda_context']} and the allocator reserve to "
                    f"{changes['allocator_reserve']} in the full-size setup (Ctrl+Z undoes).")
        elif result.device.kind == "cpu":
            text = "Only a CUDA measurement measures the CUDA context and the allocator reserve."
        else:
            text = "No overheads were measured (the step did not complete)."
        self.overheads_hint.setText(text)
        self.use_overheads.setToolTip(text)

    def set_stale(self, stale: bool, reason: str = "") -> None:
        self._stale = stale and self.result is not None
        self.stale_note.setText(reason if self._stale else "")
        self.stale_note.setVisible(self._stale)

    def is_stale(self) -> bool:
        return self._stale

    def _fill_table(self, result: engine.MeasureResult) -> None:
        est_header = "Estimate\n(measured setup)" if result.scaled else "Estimate"
        self.table.horizontalHeaderItem(1).setText(est_header)
        err = result.error_pct
        warn = QColor(OVER_COLOR)
        for r, phase in enumerate(PHASES):
            reading = result.phases.get(phase)
            est = result.estimate.estimate.phases[phase].tensor_bytes
            if reading is None:
                for c in range(3):
                    self.table.setItem(r, c, _item("–"))
                continue
            self.table.setItem(r, 0, _item(format_bytes(reading.peak_bytes), f"{reading.peak_bytes:,} bytes"))
            self.table.setItem(r, 1, _item(format_bytes(est), f"{est:,} bytes (tensors; no context or reserve)"))
            e = err.get(phase)
            cell = _item("–" if e is None else signed_pct(e),
                         "" if e is None else f"{est - reading.peak_bytes:+,} bytes")
            if e is not None and abs(e) > ERROR_WARN_PCT:
                cell.setForeground(warn)
                f = cell.font()
                f.setBold(True)
                cell.setFont(f)
            self.table.setItem(r, 2, cell)
        fit_height(self.table)
        self.table.setVisible(True)

    def _fill_ranks(self, result: engine.MeasureResult) -> None:
        shown = result.ranks[result.shown_rank]
        self.ranks_label.setText(f"<b>Every rank</b> ran in its own process (PyTorch's gloo backend), each beside its "
                                 f"own estimate. The table above is {html.escape(shown.label)}, the rank the estimate "
                                 "describes; here each phase's measured peak and the estimate's error.")
        self.ranks_label.setVisible(True)
        table = self.ranks_table
        table.setRowCount(len(result.ranks))
        table.setVerticalHeaderLabels([f"Rank {r.rank + 1}" + (f", stage {r.stage + 1}" if r.stage is not None else "")
                                       for r in result.ranks])
        warn = QColor(OVER_COLOR)
        for row, r in enumerate(result.ranks):
            errors = r.error_pct
            for col, phase in enumerate(PHASES[1:]):
                reading = r.phases.get(phase)
                if reading is None:
                    table.setItem(row, col, _item("–"))
                    continue
                e = errors.get(phase)
                text = format_bytes(reading.peak_bytes) + ("" if e is None else f"\n{signed_pct(e)}")
                est = r.estimate_bytes.get(phase, 0)
                cell = _item(text, f"measured {reading.peak_bytes:,} bytes; this rank's estimate {est:,} bytes")
                if e is not None and abs(e) > ERROR_WARN_PCT:
                    cell.setForeground(warn)
                table.setItem(row, col, cell)
        fit_height(table)
        table.setVisible(True)

    def rank_cell(self, row: int, phase: str) -> str:
        item = self.ranks_table.item(row, PHASES[1:].index(phase))
        return item.text() if item is not None else ""

    # ---- queries (tests) -------------------------------------------------------------------------
    def cell(self, phase: str, column: int) -> str:
        item = self.table.item(PHASES.index(phase), column)
        return item.text() if item is not None else ""

    def text(self) -> str:
        """Everything the tab says, as plain text."""
        parts = [self.headline.text()]
        for label in (self.message, self.scale_note, self.stale_note, self.ranks_label, self.details):
            if label.isVisibleTo(self) and label.text():
                parts.append(re.sub(r"<[^>]+>", " ", label.text()))
        return "\n".join(parts)


def details_html(result: engine.MeasureResult) -> str:
    """The readings below the table: kind of measurement, signals, leak check, allocator and context."""
    items: list[str] = []
    if result.device.kind == "cpu":
        items.append("<b>CPU tensor measurement</b>: a live-storage tracker counts every tensor storage, split "
                     "by ledger object. A CPU has no CUDA context and no allocator cache, so only the tensor "
                     "peak is compared.")
    else:
        items.append(f"<b>CUDA allocator</b> on {html.escape(result.device.name)}: max_memory_allocated per "
                     "phase, after synchronize.")
    if not result.oom and result.phases:
        if result.device.kind == "cuda" and result.peak_reserved_bytes:
            allocated = result.measured_peak_bytes
            extra = (result.peak_reserved_bytes / allocated - 1) * 100 if allocated else 0.0
            items.append(f"<b>Reserved vs allocated</b>: peak reserved {format_bytes(result.peak_reserved_bytes)} "
                         f"vs peak allocated {format_bytes(allocated)} ({extra:+.1f} % held by the caching "
                         "allocator).")
        if result.context_bytes is not None:
            assumed = result.requested.cuda_context_bytes
            items.append(f"<b>CUDA context</b>: {format_bytes(result.context_bytes)} outside PyTorch (the setup "
                         f"assumes {format_bytes(assumed)}).")
        signals = result.signals
        if signals:
            items += [f"<b>Signal</b> <code>{html.escape(s)}</code>: {html.escape(SIGNAL_TEXT.get(s, ''))}"
                      for s in signals]
        else:
            items.append("<b>Signals</b>: none — the estimate, the allocator and the capacity agree within 10 %.")
        leak = result.leak
        live = ", ".join(format_bytes(b) for b in leak["live_bytes_per_iteration"])
        if leak["growing"]:
            items.append(f"<b>Leak check</b>: <span style='color:{OVER_COLOR}'>live memory grows every "
                         f"iteration</span> ({live}) — something keeps tensors alive (memory ledger).")
        else:
            items.append(f"<b>Leak check</b>: no growth across iterations (live after each: {live}).")
    elif result.context_bytes is not None:
        items.append(f"<b>CUDA context</b>: {format_bytes(result.context_bytes)} outside PyTorch.")
    notes = [n for n in result.notes if not n.startswith("CPU tensor measurement")]
    items += [f"<span style='color:palette(mid)'>{html.escape(n)}</span>" for n in notes]
    if result.snapshot:
        items.append(f"Memory snapshot: {html.escape(result.snapshot)} (open it at pytorch.org/memory_viz).")
    if result.seconds:
        items.append(f"Measured in {result.seconds:.1f} s.")
    return "<ul style='margin-left: 0px; -qt-list-indent: 1;'>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>"


# ---- the controller -------------------------------------------------------------------------------
class MeasurePanel(QObject):
    """Wires "Measure on this GPU" into a :class:`MainWindow`.

    Window-level signals (connect before clicking): ``progress(str)``, ``finished(MeasureResult)``,
    ``failed(str)``, ``cancelled()`` — emitted after the window has been updated — and
    ``device_found(DeviceInfo)``.
    """

    progress = Signal(str)
    finished = Signal(object)
    failed = Signal(str)
    cancelled = Signal()
    device_found = Signal(object)

    def __init__(self, window: MainWindow) -> None:
        super().__init__(window)
        self.setObjectName("measurePanel")
        self.window = window
        self.device: engine.DeviceInfo | None = None
        self.result: engine.MeasureResult | None = None
        self._measured_key: dict[str, Any] | None = None
        self._closed = False

        self.runner = TaskRunner("memcalc-measure", cancel_types=(engine.Cancelled,), parent=self)
        self.runner.progress.connect(self._on_progress)
        self.runner.finished.connect(self._on_finished)
        self.runner.failed.connect(self._on_failed)
        self.runner.cancelled.connect(self._on_cancelled)
        self.detector = TaskRunner("memcalc-detect-device", parent=self)
        self.detector.finished.connect(self._on_device)
        self.detector.failed.connect(self._on_detect_failed)

        self.detect_timer = QTimer(self)
        self.detect_timer.setObjectName("detectDeviceTimer")
        self.detect_timer.setSingleShot(True)
        self.detect_timer.timeout.connect(self.detect_device)

        # The button in the action row; [progress] [bar] [Cancel] on their own line under it (window.job_row)
        self.progress_label = ElidedLabel("")
        self.progress_label.setObjectName("measureProgress")
        self.progress_label.setVisible(False)
        self.progress_bar = QProgressBar()
        self.progress_bar.setObjectName("measureProgressBar")
        self.progress_bar.setTextVisible(False)
        self.progress_bar.setFixedWidth(90)
        self.progress_bar.setMaximumHeight(14)
        self.progress_bar.setVisible(False)
        self.cancel_button = QPushButton("Cancel measurement")
        self.cancel_button.setObjectName("measureCancel")
        self.cancel_button.setToolTip("Stop the measurement after the current phase")
        self.cancel_button.setVisible(False)
        self.cancel_button.clicked.connect(self.cancel)
        self.button = QPushButton(BUTTON_UNKNOWN)
        self.button.setObjectName("measureButton")
        self.button.clicked.connect(self.start)
        window.action_row.addWidget(self.button)
        window.job_row(self.progress_label, self.progress_bar, self.cancel_button)

        self.view = MeasuredView()
        self.view.use_overheads_requested.connect(self.use_measured_overheads)
        self.tab_index = window.tabs.addTab(self.view, "Measured")
        window.tabs.setTabToolTip(self.tab_index, "Measured on this machine vs estimated, per phase")

        window.result_changed.connect(self._on_setup_changed)
        self._torch = engine.torch_available()
        if not self._torch:
            self.button.setText(BUTTON_NO_TORCH)
            self.button.setToolTip(NO_TORCH_MESSAGE)
        else:
            self.button.setToolTip("Run one real training step of this setup (three iterations) and compare "
                                   "each phase's measured peak with the estimate. A setup too large for this "
                                   "device is scaled down, and compared with the estimate of what was measured. "
                                   "A multi-GPU setup runs every rank as its own process (PyTorch's gloo "
                                   "backend, up to 4), each compared with its own estimate.")
            window.installEventFilter(self)

    # ---- device ---------------------------------------------------------------------------------
    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        if obj is self.window and event.type() == QEvent.Type.Show:
            self.window.removeEventFilter(self)
            if not self._closed and self.device is None and DETECT_DELAY_MS is not None:
                self.detect_timer.start(DETECT_DELAY_MS)
        return False

    def detect_device(self) -> None:
        """Probe the device on a worker thread (imports torch there); the button's label follows."""
        self.detect_timer.stop()
        if self._closed or not self._torch or self.detector.is_running() or self.device is not None:
            return
        self.detector.start(detect_job)

    @Slot(object)
    def _on_device(self, info: engine.DeviceInfo) -> None:
        self._set_device(info)

    def _set_device(self, info: engine.DeviceInfo) -> None:
        new = info != self.device
        self.device = info
        self.button.setText(button_text(info))
        if info.kind == "cpu":
            self.button.setToolTip("No CUDA GPU was found, so this runs the step on the CPU and counts every tensor "
                                   "it allocates: the same bytes a GPU step holds, without the CUDA context and the "
                                   "allocator's cache. Large setups are scaled down (said in the result).")
        if new:
            self.device_found.emit(info)

    @Slot(str)
    def _on_detect_failed(self, message: str) -> None:
        self.button.setToolTip(f"Could not look for a GPU: {message}")

    # ---- running --------------------------------------------------------------------------------
    def is_running(self) -> bool:
        return self.runner.is_running()

    @Slot()
    def start(self) -> bool:
        """Measure the current setup (the button). ``False`` when it could not start (the reason is shown)."""
        if self._closed or self.runner.is_running():
            return False
        w = self.window
        if not self._torch:
            self._show_problem("Cannot measure: PyTorch is not installed.", NO_TORCH_MESSAGE)
            return False
        if w.debounce.isActive():
            w.refresh()
        errors = w.inputs.errors()
        if errors or w.result is None:
            reason = "; ".join(f"{k}: {v}" for k, v in errors.items()) or "no valid setup"
            self._show_problem("Cannot measure: an input is invalid.", f"Fix the inputs first ({reason}).")
            return False
        setup = w.result.setup
        config = fitted_config(setup)  # a family without a block model: compared with the fitted ledger
        if setup.model is None and config is None:
            self._show_problem("Cannot measure a bare parameter count.",
                               "Measuring builds the model: choose a preset or open a config.json.")
            return False
        self.result = None
        self._measured_key = tensor_key(setup)
        w.chart.set_measured(None)
        where = button_text(self.device).removeprefix("Measure ") if self.device else "on this machine"
        self.view.set_running(f"Measuring {where}…")
        self._reveal()
        self._set_running(True, "Starting…")
        self.runner.start(measure_job(setup, config=config))
        return True

    @Slot()
    def cancel(self) -> None:
        if self.runner.is_running():
            self.runner.cancel()
            self.cancel_button.setEnabled(False)
            self._set_progress_text("Cancelling after this phase…")

    def _set_running(self, running: bool, text: str = "") -> None:
        self.button.setEnabled(not running)
        self.cancel_button.setVisible(running)
        self.cancel_button.setEnabled(running)
        self.progress_bar.setVisible(running)
        self.progress_bar.setRange(0, 0)  # busy until an iteration is reported
        self.progress_label.setVisible(running)
        self._set_progress_text(text if running else "")

    def _set_progress_text(self, text: str) -> None:
        self.progress_label.setText(text)
        self.progress_label.setToolTip(text)

    @Slot(str)
    def _on_progress(self, text: str) -> None:
        message = f"Measuring: {text}"
        self._set_progress_text(message)
        fraction = progress_fraction(text)
        if fraction is not None:
            self.progress_bar.setRange(0, 100)
            self.progress_bar.setValue(round(fraction * 100))
        if not self._closed:
            self.window.statusBar().showMessage(message)
        self.progress.emit(text)

    @Slot(object)
    def _on_finished(self, result: engine.MeasureResult) -> None:
        self._set_running(False)
        self.result = result
        self._measured_key = tensor_key(result.requested)
        self._set_device(result.device)
        self.view.set_result(result)
        self._draw_overlay()
        self._on_setup_changed()
        self._reveal()
        if not self._closed:
            self.window.statusBar().showMessage(result.oom or headline(result), 15000)
        self.finished.emit(result)

    @Slot(str)
    def _on_failed(self, message: str) -> None:
        self._set_running(False)
        self._show_problem("The measurement failed.", message)
        self.failed.emit(message)

    @Slot()
    def _on_cancelled(self) -> None:
        self._set_running(False)
        self.view.set_message("Measurement cancelled.", "", error=False)
        if not self._closed:
            self.window.statusBar().showMessage("Measurement cancelled.", 8000)
        self.cancelled.emit()

    def _show_problem(self, headline: str, message: str) -> None:
        self.result = None
        self.window.chart.set_measured(None)
        self.view.set_message(headline, message)
        self._reveal()
        if not self._closed:
            self.window.statusBar().showMessage(f"{headline} {message}", 15000)

    def _reveal(self) -> None:
        if not self._closed:
            self.window.tabs.setCurrentWidget(self.view)

    # ---- overlay and staleness ----------------------------------------------------------------
    def _draw_overlay(self) -> None:
        r = self.result
        chart = self.window.chart
        if r is None or r.oom or not r.phases or self.view.is_stale():
            chart.set_measured(None)
            return
        measured = {p: reading.peak_bytes for p, reading in r.phases.items()}
        reference = {p: r.estimate.estimate.phases[p].tensor_bytes for p in measured} if r.scaled else None
        chart.set_measured(measured, label=overlay_label(r), reference=reference)

    def is_stale(self) -> bool:
        return self.view.is_stale()

    def _on_setup_changed(self, *_: Any) -> None:
        if self.result is None or self._measured_key is None:
            return
        current: Result | None = self.window.result
        stale = current is None or tensor_key(current.setup) != self._measured_key
        was = self.view.is_stale()
        self.view.set_stale(stale, "The setup has changed since this measurement: the chart no longer shows "
                                   "it. Measure again, or undo back to the measured setup.")
        if stale != was:
            self._draw_overlay()

    def use_measured_overheads(self) -> bool:
        """Apply the measured CUDA context and allocator reserve to the full-size setup (one undo step)."""
        if self.result is None:
            return False
        changes = overhead_changes(self.result)
        if changes is None:
            return False
        self.window.apply_changes("Use measured overheads", changes)
        return True

    # ---- shutdown -------------------------------------------------------------------------------
    def shutdown(self, timeout_ms: int = STOP_TIMEOUT_MS) -> None:
        """Stop the timer and both workers, waiting for their threads at most ``timeout_ms`` in all."""
        self._closed = True
        self.detect_timer.stop()
        self.runner.cancel()
        self.detector.cancel()
        deadline = time.monotonic() + timeout_ms / 1000
        self.runner.stop(max(0, int((deadline - time.monotonic()) * 1000)))
        self.detector.stop(max(0, int((deadline - time.monotonic()) * 1000)))
