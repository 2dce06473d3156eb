"""The Timeline tab: the predicted timeline of the traced step, a real memory snapshot beside the estimate, or,
before any trace, a coarse timeline drawn from the ledger.

Thin: it draws a :class:`~memcalc_gui.core.timeline.Timeline` with the shared chart, says where the timeline comes
from, and compares each phase's peak with the estimate it is given (``core.timeline.compare_phases``). Opening and
exporting snapshot files goes through :meth:`show_opened` (the window reads the file on a worker thread) and
:meth:`export_predicted`, which the window's File menu and drag and drop call. The chart is drawn when the tab is
shown (a hidden tab costs nothing per keystroke).
"""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtGui import QShowEvent
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSizePolicy, QVBoxLayout, QWidget

from ..core.errors import InputError
from ..core.ledger import Estimate
from ..core.setup import TrainingSetup
from ..core.timeline import Timeline, compare_phases, ledger_timeline
from ..core.units import format_bytes
from ..core.vocab import OBJECT_LABELS, PHASE_LABELS
from ..view.timeline_chart import TimelineChart

EMPTY_TEXT = ("No timeline yet. <b>Precise (trace)</b> predicts every allocation and free of the step; "
              "<b>Open snapshot…</b> reads a real one (<code>torch.cuda.memory._dump_snapshot</code>).")


class TimelinePanel(QWidget):
    """Chart, source line, phase comparison; ``open_requested`` and ``export_requested`` ask for file dialogs."""

    open_requested = Signal()
    export_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("timelinePanel")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        row = QHBoxLayout()
        self.back_button = QPushButton("◂ Phases")
        self.back_button.setObjectName("timelineBack")
        self.back_button.setToolTip("Back to the phase bars (Ctrl+Shift+T)")
        row.addWidget(self.back_button)
        self.source = QLabel(EMPTY_TEXT)
        self.source.setObjectName("timelineSource")
        self.source.setWordWrap(True)
        row.addWidget(self.source, 1)
        self.source.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.open_button = QPushButton("Open snapshot…")
        self.open_button.setToolTip("Read a CUDA memory snapshot pickle (torch.cuda.memory._dump_snapshot) and "
                                    "compare it with this setup's estimate; nothing in the file runs")
        self.open_button.clicked.connect(self.open_requested)
        self.export_button = QPushButton("Export for memory_viz…")
        self.export_button.setToolTip("Write the predicted timeline as a snapshot pickle that "
                                      "pytorch.org/memory_viz opens")
        self.export_button.clicked.connect(self.export_requested)
        self.export_button.setEnabled(False)
        row.addWidget(self.open_button)
        row.addWidget(self.export_button)
        layout.addLayout(row)
        self.chart = TimelineChart()
        layout.addWidget(self.chart, 1)
        self.comparison = QLabel("")
        self.comparison.setObjectName("timelineComparison")
        self.comparison.setWordWrap(True)
        layout.addWidget(self.comparison)
        self.timeline: Timeline | None = None
        self.predicted: Timeline | None = None
        self.measured: Timeline | None = None
        self.snapshot_path = ""
        #: What is shown: "ledger" (coarse), "trace", "measured" or "snapshot"; and the setup it is a step of.
        self.kind = ""
        self.timeline_setup: TrainingSetup | None = None
        self._pending: tuple[Timeline, int | None, int | None] | None = None  # drawn when the tab is shown
        self._pending_overlay: tuple[Timeline | None, str] | None = None
        self.overlaid: Timeline | None = None  # the measured line drawn over the prediction

    def show_estimate(self, estimate: Estimate, capacity_bytes: int | None) -> None:
        """A new estimate of the form's setup. An open snapshot stays, compared with it; the trace's or a measured
        timeline stays while the setup has the same tensors; otherwise the ledger's coarse timeline is shown."""
        setup = estimate.setup
        keep = self.kind == "snapshot" or (self.kind in ("trace", "measured") and self.timeline_setup is not None
                                           and self.timeline_setup.same_tensors(setup))
        if keep and self.timeline is not None:
            self._show(self.timeline, estimate, capacity_bytes, self.source.text())
            return
        self.predicted = self.measured = None
        self.export_button.setEnabled(False)
        self._overlay(None)
        layers = setup.model.num_layers if setup.model is not None else 1
        self.kind, self.timeline_setup, self.snapshot_path = "ledger", setup, ""
        try:
            coarse = ledger_timeline({p: ph.objects for p, ph in estimate.phases.items()}, layers)
        except InputError as exc:
            self.timeline = None
            self._pending = (Timeline((), "ledger"), None, None)  # clears the chart
            self.overlaid = None
            self._draw()
            self.source.setText(f"No timeline: {html.escape(exc.reason)}.")
            self.comparison.setText("")
            return
        per_layer = f", {layers} decoder layers one by one" if setup.model is not None else ""
        self._show(coarse, estimate, capacity_bytes,
                   f"<b>Coarse</b>, drawn from the {estimate.method} ledger: each phase reaches the ledger's peak"
                   f"{per_layer}; the shape between the peaks is not predicted. <b>Precise (trace)</b> predicts "
                   "every allocation and free.")
        self.comparison.setText("")  # the ledger beside itself says nothing

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self._draw()

    def _draw(self) -> None:
        """Draw what is pending once the tab is on screen."""
        if not self.isVisible():
            return
        if self._pending is not None:
            timeline, capacity_bytes, peak = self._pending
            self._pending = None
            self.chart.set_timeline(timeline, capacity_bytes, peak)
        if self._pending_overlay is not None:
            other, label = self._pending_overlay
            self._pending_overlay = None
            self.chart.set_overlay(other, label)

    def _overlay(self, other: Timeline | None, label: str = "Measured") -> None:
        self.overlaid = other
        self._pending_overlay = (other, label)
        self._draw()

    def show_predicted(self, timeline: Timeline | None, estimate: Estimate, capacity_bytes: int | None) -> None:
        """The trace's timeline of ``estimate``'s setup (two iterations, sizes as the CUDA allocator rounds)."""
        self.predicted = timeline
        self.export_button.setEnabled(timeline is not None)
        if timeline is None:
            return
        self.snapshot_path = ""
        self.kind, self.timeline_setup = "trace", estimate.setup
        self._show(timeline, estimate, capacity_bytes,
                   f"<b>Predicted</b> by the trace (fake tensors): {len(timeline.events):,} allocations and frees of "
                   f"two iterations, sizes rounded to {timeline.rounding} B as the CUDA allocator does.")

    def show_snapshot(self, timeline: Timeline, path: str, estimate: Estimate | None,
                      capacity_bytes: int | None) -> None:
        """A real snapshot beside the estimate of the setup in the form."""
        self.snapshot_path = path
        self.kind, self.timeline_setup = "snapshot", None
        found = ", ".join(PHASE_LABELS.get(p, p) for p in dict.fromkeys(s.phase for s in timeline.spans))
        kind = "Profiler memory timeline" if timeline.source == "profiler" else "Snapshot"
        self._show(timeline, estimate, capacity_bytes,
                   f"<b>{kind}</b> {html.escape(Path(path).name)}: {len(timeline.events):,} allocations and frees"
                   + (f"; phases found from its stack frames: {found}" if found else
                      "; PyTorch's categories, no phases" if timeline.source == "profiler" else
                      "; no phase of a training step found in its frames")
                   + (f"; {format_bytes(timeline.reserved_bytes)} reserved by the allocator at the end"
                      if timeline.reserved_bytes else "") + ".")

    def _show(self, timeline: Timeline, estimate: Estimate | None, capacity_bytes: int | None, source: str) -> None:
        self.timeline = timeline
        self.source.setText(source)
        peak = estimate.peak_tensor_bytes if estimate is not None else None
        overlay = self.overlaid if self.kind == "trace" else None
        self._pending = (timeline, capacity_bytes, peak)
        self._pending_overlay = None
        self._draw()
        if overlay is not None:  # a redraw of the prediction keeps the measured line over it
            self._overlay(overlay, "Measured (this machine)")
        if estimate is None:
            self.comparison.setText("")
            return
        rows = compare_phases(timeline, {p: dict(ph.objects) for p, ph in estimate.phases.items()})
        parts = []
        for r in rows:
            obj, gap = r.largest_gap
            sign = "+" if r.difference_bytes >= 0 else "−"
            parts.append(f"{PHASE_LABELS.get(r.phase, 'At the peak')}: {format_bytes(r.timeline_bytes)} vs "
                         f"{format_bytes(r.estimate_bytes)} estimated ({sign}{format_bytes(abs(r.difference_bytes))}"
                         + (f"; most in {OBJECT_LABELS.get(obj, obj).lower()}" if obj and gap else "") + ")")
        self.comparison.setText("Peaks by phase — " + "; ".join(parts) if parts else "")

    def show_measured(self, timeline: Timeline | None, estimate: Estimate, capacity_bytes: int | None,
                      same_setup: bool) -> None:
        """A measured step's timeline: a line over the prediction of the same setup, phase by phase; or, with no
        prediction of it, the measured timeline itself."""
        self.measured = timeline
        if timeline is None:
            self._overlay(None)
            return
        if same_setup and self.predicted is not None and self.timeline is self.predicted:
            self._overlay(timeline, "Measured (this machine)")
            self.source.setText(self.source.text().split(" <b>Measured</b>")[0] +
                                " <b>Measured</b> step drawn as a black line, phase by phase.")
            return
        self.snapshot_path = ""
        self.kind, self.timeline_setup = "measured", estimate.setup
        self._show(timeline, estimate, capacity_bytes,
                   f"<b>Measured</b> on this machine: {len(timeline.events):,} allocations and frees of the measured "
                   "iterations" + ("" if same_setup else " (a scaled-down setup: compared with its own estimate)")
                   + ".")

    def show_opened(self, timeline: Timeline, path: str, estimate: Estimate | None, capacity_bytes: int | None) -> str:
        """Show a snapshot the window read off the GUI thread (``core.timeline.read_timeline_file``); returns "" or
        why it is not shown (the last timeline stays)."""
        if not timeline.events:
            return "the snapshot's trace holds no allocations (record with torch.cuda.memory._record_memory_history())"
        self.show_snapshot(timeline, path, estimate, capacity_bytes)
        return ""

    def export_predicted(self, path: str) -> str:
        """Write the predicted timeline for memory_viz; returns "" or why not."""
        if self.predicted is None:
            return "no predicted timeline yet: run Precise (trace) first"
        try:
            self.predicted.write_snapshot(path, field="snapshot")
        except InputError as exc:
            return exc.reason
        return ""
