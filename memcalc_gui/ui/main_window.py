"""The main window: inputs on the left; verdict, chart, ledger and advice on the right.

Flow: an edit restarts a short debounce timer; ``refresh()`` reads the form, builds a setup, calls
``core.result.evaluate`` and updates the views in place. Every valid change is one undo command
(consecutive typing in the same field merges into one). An invalid field shows its reason inline and
the last valid result stays drawn.
"""

from __future__ import annotations

import contextlib
import json
import time
import traceback
from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, QSize, Qt, QTimer, Signal
from PySide6.QtGui import (
    QAction,
    QCloseEvent,
    QDragEnterEvent,
    QDropEvent,
    QKeySequence,
    QResizeEvent,
    QShowEvent,
    QUndoCommand,
    QUndoStack,
)
from PySide6.QtWidgets import (
    QApplication,
    QFileDialog,
    QFrame,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSplitter,
    QStackedWidget,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from ..core.cachefile import take_notices
from ..core.errors import ConfigError, InputError, one_line
from ..core.result import Result, evaluate
from ..trace.fake import TraceCancelled
from ..view.assets import app_icon
from ..view.chart import MemoryChart
from ..view.plan_text import ADVICE_ORDER, chart_scope, is_per_gpu, per_gpu_headline
from .about import AboutDialog
from .form import (
    FormErrors,
    FormState,
    ModelCache,
    build_setup,
    default_state,
    form_field,
    gpu_by_id,
    state_with_changes,
)
from .inputs import InputPanel
from .layouts_dialog import LayoutsDialog
from .ledger_table import LedgerTable
from .measure_panel import MeasurePanel
from .results import METHOD_NOTES, AdvicePanel, VerdictBanner
from .settings import (
    KEY_GEOMETRY,
    KEY_SPLITTERS,
    KEY_WINDOW_STATE,
    load_bytes,
    load_state,
    make_settings,
    save_bytes,
    save_state,
)
from .timeline_panel import TimelinePanel
from .trace_panel import KEY_ENABLED as KEY_TRACE_ENABLED
from .trace_panel import TracePanel, difference_text
from .workers import STOP_TIMEOUT_MS, TaskRunner

#: Debounce between the last keystroke and the estimate. Analytic estimates take ~1–3 ms and the redraw
#: a few more, so the whole edit-to-redraw stays well under 50 ms.
DEBOUNCE_MS = 15
#: Window width (logical px) below which "What to change" is a tab beside the ledger rather than a column.
NARROW_WIDTH = 1240
#: The input column's and the results' narrowest widths (logical px): on a screen narrower than both (with the
#: window's frame) they give way, so the window never needs more than the screen has.
INPUT_MIN_WIDTH = 340
RESULT_MIN_WIDTH = 360
#: Below this much room for the window (logical px high), the panels that share the chart's and the ledger's place
#: need less height (the timeline, the suggestions: the results scroll less on a 1280×720 screen at 150 %).
COMPACT_HEIGHT = 600
COMPACT_TIMELINE_HEIGHT = 80
COMPACT_LIST_HEIGHT = 36
#: Room left around the window for its frame (title bar and borders) before it is shown and its frame is known.
FRAME_ALLOWANCE = (16, 40)
#: Typing in one field within this many seconds merges into one undo step.
MERGE_WINDOW_S = 2.0
TEXT_FIELDS = frozenset({"preset", "config_path", "hub_id", "params", "batch", "seq", "grad_accum", "capacity",
                         "cuda_context", "allocator_reserve", "gpus", "node_size", "ep", "etp",
                         "loss_chunk", "lora_rank",
                         "lora_targets", "lora_dropout", "trainable"})
FIELD_NAMES = {
    "model_kind": "model source", "preset": "preset", "config_path": "config.json", "hub_id": "Hub id",
    "params": "parameter count",
    "batch": "micro-batch", "seq": "sequence length", "grad_accum": "gradient accumulation",
    "precision": "precision", "optimizer": "optimizer", "optimizer_impl": "optimizer implementation",
    "attention": "attention", "loss": "loss", "loss_chunk": "loss chunk",
    "activation_offload": "activation offload", "packing": "packing",
    "tokens_per_batch": "real tokens per micro-batch", "galore_rank": "GaLore rank",
    "optimizer_in_backward": "step in backward", "ckpt_every": "checkpoint every N-th layer",
    "ckpt_selective": "per-op checkpointing",
    "checkpointing": "checkpointing", "use_cache": "use_cache", "gpu": "GPU",
    "capacity": "capacity",
    "cuda_context": "CUDA context", "allocator_reserve": "allocator reserve", "gpus": "number of GPUs",
    "strategy": "strategy", "node_size": "GPUs per node", "ep": "experts split over",
    "etp": "each expert split over", "offload": "offload",
    "reshard_after_forward": "reshard after forward", "dp_replicate": "FSDP2 replicas",
    "tp": "tensor parallel", "sp": "sequence parallel", "loss_parallel": "loss parallel", "cp": "context parallel",
    "pp": "pipeline stages", "schedule": "pipeline schedule", "virtual_stages": "stages per GPU",
    "general": "input",
    "tuning": "weights trained", "lora_rank": "LoRA rank", "lora_targets": "target modules",
    "lora_dropout": "LoRA dropout", "adapter_dtype": "adapter dtype", "quant": "base quantization",
    "double_quant": "double quantization",
    "prepare_kbit": "fp32 cast of the unquantized weights",
    "trainable": "trainable parts",
}


def window_wording(reason: str) -> str:
    """A core message written for the command line, in the window's words."""
    return (reason.replace("give --preset or --config, not --params", "choose a preset or open a config.json")
            .replace("give --preset or --config", "choose a preset or open a config.json"))


class SetupCommand(QUndoCommand):
    """One change of the form, from ``old`` to ``new`` (both valid)."""

    MERGE_ID = 0x6D63

    def __init__(self, window: MainWindow, old: FormState, new: FormState, text: str, *,
                 merge_key: str | None = None, already_applied: bool = True) -> None:
        super().__init__(text)
        self._window = window
        self.old = old
        self.new = new
        self.merge_key = merge_key
        self.stamp = time.monotonic()
        self._skip_redo = already_applied

    def id(self) -> int:
        return self.MERGE_ID if self.merge_key else -1

    def mergeWith(self, other: QUndoCommand) -> bool:
        if not isinstance(other, SetupCommand) or other.merge_key != self.merge_key:
            return False
        if other.stamp - self.stamp > MERGE_WINDOW_S:
            return False
        self.new = other.new
        self.stamp = other.stamp
        if self.new == self.old:
            self.setObsolete(True)
        return True

    def redo(self) -> None:
        if self._skip_redo:
            self._skip_redo = False
            return
        self._window.apply_state(self.new)

    def undo(self) -> None:
        self._window.apply_state(self.old)


#: Undo/Redo menu items name the change, cut to this many characters (a fix's title can be a paragraph).
MENU_TEXT_CHARS = 48


def _menu_text(text: str) -> str:
    text = text.replace("&", "&&")
    return text if len(text) <= MENU_TEXT_CHARS else text[: MENU_TEXT_CHARS - 1].rstrip() + "…"


class _ChartLedgerSplit(QSplitter):
    """The chart above the ledger. In the results' scroll area its preferred height is its minimum: the area then
    makes the results as tall as the window (as a splitter would), and scrolls only when they cannot be shorter
    (with word-wrapped labels above, it would otherwise make them as tall as the charts' size hints ask)."""

    def sizeHint(self) -> QSize:
        hint = super().sizeHint()
        return QSize(hint.width(), self.minimumSizeHint().height())


class MainWindow(QMainWindow):
    """The memcalc window. ``result_changed`` fires after every successful estimate; ``snapshot_opened(bool)`` when a
    snapshot asked for by :meth:`open_snapshot` has been read and shown (``True``) or refused (``False``)."""

    result_changed = Signal(object)
    snapshot_opened = Signal(bool)

    def __init__(self, initial_state: FormState | None = None, *, persist: bool = True,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("memcalcMainWindow")
        self.setWindowTitle("memcalc — GPU memory for one training step")
        self.setWindowIcon(app_icon())
        self.setAcceptDrops(True)
        self.persist = persist
        self.settings = make_settings() if persist else None
        self.cache = ModelCache()
        self.undo_stack = QUndoStack(self)
        self.result: Result | None = None  # what is drawn: the analytic result, or the trace's
        self.analytic_result: Result | None = None  # the latest analytic (or quick) result
        self.trace_result: Any = None  # the TraceResult drawn, when the drawn result is a trace
        self.last_refresh_ms = 0.0
        self._committed: FormState | None = None
        self._recording = True
        self._closed = False
        self._invalid_message = ""

        self.debounce = QTimer(self)
        self.debounce.setObjectName("debounceTimer")
        self.debounce.setSingleShot(True)
        self.debounce.setInterval(DEBOUNCE_MS)
        self.debounce.timeout.connect(self.refresh)

        self._build_ui()
        self._build_actions()
        self._restore_layout()  # a saved geometry too large for this screen is shrunk into it by Qt
        self._normal_heights: dict[QWidget, int] = {}
        self._fit_minimum_to_screen()
        self._watching_screen = False

        message = ""
        state = initial_state
        if state is None and self.settings is not None:
            state, message = self._saved_state()
        if state is None:
            state = default_state()
        self.inputs.set_state(state)
        # a family without a block model is calibrated first (the fit lands in a moment): only an invalid setup
        # falls back to the default
        if not self.refresh() and self.inputs.errors() and state != default_state():
            reason = "; ".join(f"{FIELD_NAMES.get(k, k)}: {v}" for k, v in self.inputs.errors().items())
            message = f"The saved setup could not be used ({reason}); using the default setup."
            self.inputs.set_state(default_state())
            self.refresh()
        self.undo_stack.clear()
        self.undo_stack.setClean()
        if self.settings is not None and str(self.settings.value(KEY_TRACE_ENABLED, "false")).lower() == "true":
            self.trace_panel.restore_enabled()
            self.trace_action.setChecked(self.trace_panel.toggle.isChecked())
        if message:
            self.statusBar().showMessage(message, 15000)

    # ---- construction -------------------------------------------------------------------------
    def _build_ui(self) -> None:
        self.inputs = InputPanel(self.cache.names(), preset_details=self.cache.details(),
                                 preset_groups=self.cache.groups())
        self.inputs.edited.connect(self.schedule_refresh)
        self.inputs.open_config_requested.connect(self.choose_config)
        self.inputs.fetch_hub_requested.connect(self.fetch_hub)
        self.inputs.layouts_requested.connect(self.show_layouts)
        self.fits: dict[str, Any] = {}  # fitted-method calibrations by config and setup (or why one failed)
        self._fit_job: str | None = None
        self._fit_job_replica = ""
        self._layout_fits: list[tuple[Any, Any]] = []  # calibrations the layout search asked for, in turn
        self._layout_fits_total = 0
        self.layouts_dialog: LayoutsDialog | None = None  # the last one opened
        self.fit_runner = TaskRunner("memcalc-fit", cancel_types=(TraceCancelled,), parent=self)
        self.fit_runner.finished.connect(self._fit_done)
        self.fit_runner.failed.connect(self._fit_failed)
        self.fit_runner.progress.connect(lambda text: self.statusBar().showMessage(f"Fitting: {text}…"))
        self.hub_runner = TaskRunner("memcalc-hub-fetch", parent=self)
        self.hub_runner.finished.connect(self._hub_fetched)
        self.hub_runner.failed.connect(self._hub_failed)
        self.hub_runner.running_changed.connect(lambda on: self.inputs.fetch_button.setEnabled(not on))
        # snapshots are read on a worker: a large one takes seconds, and the GUI thread never waits on a file
        self.snapshot_runner = TaskRunner("memcalc-snapshot-read", parent=self)
        self.snapshot_runner.finished.connect(self._snapshot_read)
        self.snapshot_runner.failed.connect(self._snapshot_failed)
        self.snapshot_runner.cancelled.connect(self._next_snapshot)
        self._snapshot_next: str | None = None
        self._snapshot_reading = ""
        left = QScrollArea()
        left.setObjectName("inputScroll")
        left.setWidgetResizable(True)
        left.setFrameShape(QFrame.Shape.NoFrame)
        left.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        left.setWidget(self.inputs)
        left.setMinimumWidth(INPUT_MIN_WIDTH)
        self.input_scroll = left

        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(6, 8, 8, 4)
        rl.setSpacing(6)
        self.banner = VerdictBanner()
        rl.addWidget(self.banner)
        # A row for actions on the result: "Precise (trace)" and "Measure on this GPU" (with their progress).
        self.action_row = QHBoxLayout()
        self.action_row.setSpacing(8)
        self.method_label = QLabel("")
        self.method_label.setObjectName("methodLabel")
        self.method_label.setWordWrap(True)  # wraps rather than widening the window when the row fills
        self.method_label.setMinimumWidth(self.method_label.fontMetrics().horizontalAdvance("Method: analytic") + 8)
        self.action_row.addWidget(self.method_label, 1)
        rl.addLayout(self.action_row)
        # one line per running job (trace, measurement) under the action row: progress text, bar, Cancel; empty
        # lines take no room, and two jobs never squeeze the method text or widen the window
        self.jobs_box = QVBoxLayout()
        self.jobs_box.setSpacing(2)
        rl.addLayout(self.jobs_box)

        self.chart = MemoryChart()
        self.table = LedgerTable()
        self.assumptions = QPlainTextEdit()
        self.assumptions.setObjectName("assumptions")
        self.assumptions.setReadOnly(True)
        self.assumptions.setTabChangesFocus(True)
        self.tabs = QTabWidget()
        self.tabs.setObjectName("resultTabs")
        self.tabs.addTab(self.table, "&Ledger (GiB)")
        self.table.unit_changed.connect(lambda unit: self.tabs.setTabText(0, f"&Ledger ({unit})"))
        self.tabs.addTab(self.assumptions, "Assumptions")
        # the chart area shows the phase bars or the step's timeline (the Timeline button in the action row)
        self.timeline_panel = TimelinePanel()
        self.timeline_panel.open_requested.connect(self.choose_snapshot)
        self.timeline_panel.export_requested.connect(self.export_snapshot)
        # a hidden page must not widen the window: the stack takes its minimum width from the phase chart
        self.timeline_panel.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.chart_stack = QStackedWidget()
        self.chart_stack.setObjectName("chartStack")
        self.chart_stack.addWidget(self.chart)
        self.chart_stack.addWidget(self.timeline_panel)
        self.advice = AdvicePanel()
        self.advice.apply_changes.connect(self.apply_changes)
        advice_box = self.advice_box = QGroupBox("What to change (click to apply)")
        self.advice_in_tabs = False
        self._fit_timer = QTimer(self)
        self._fit_timer.setSingleShot(True)
        self._fit_timer.setInterval(0)
        self._fit_timer.timeout.connect(self._fit_ledger_height)
        self.table.rows_changed.connect(self._fit_timer.start)  # LoRA's parameter sub-rows, a paged optimizer
        advice_box.setToolTip(f"The largest micro-batch that fits, then what to change. {ADVICE_ORDER} Click one to "
                              "apply it; Ctrl+Z undoes.")
        al = QVBoxLayout(advice_box)
        al.setContentsMargins(4, 4, 4, 4)
        al.addWidget(self.advice)

        self.bottom_split = QSplitter(Qt.Orientation.Horizontal)
        self.bottom_split.setObjectName("bottomSplit")
        self.bottom_split.addWidget(self.tabs)
        self.bottom_split.addWidget(advice_box)
        self.bottom_split.setStretchFactor(0, 3)
        self.bottom_split.setStretchFactor(1, 2)
        self.bottom_split.setChildrenCollapsible(False)
        self.right_split = _ChartLedgerSplit(Qt.Orientation.Vertical)
        self.right_split.setObjectName("rightSplit")
        self.right_split.addWidget(self.chart_stack)
        self.right_split.addWidget(self.bottom_split)
        self.right_split.setStretchFactor(0, 3)
        self.right_split.setStretchFactor(1, 2)
        self.right_split.setChildrenCollapsible(False)
        rl.addWidget(self.right_split, 1)

        # the results scroll only when the window is smaller than their minimum (a 1280×720 screen at 150 %: 853×480
        # logical px); at usual sizes the area is the panel itself, no frame, no bars
        self.result_scroll = QScrollArea()
        self.result_scroll.setObjectName("resultScroll")
        self.result_scroll.setWidgetResizable(True)
        self.result_scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.result_scroll.setWidget(right)
        self.result_scroll.setMinimumWidth(RESULT_MIN_WIDTH)

        self.main_split = QSplitter(Qt.Orientation.Horizontal)
        self.main_split.setObjectName("mainSplit")
        self.main_split.addWidget(left)
        self.main_split.addWidget(self.result_scroll)
        self.main_split.setStretchFactor(0, 0)
        self.main_split.setStretchFactor(1, 1)
        self.main_split.setChildrenCollapsible(False)
        self.setCentralWidget(self.main_split)
        self.resize(*self._default_size())
        self.main_split.setSizes([390, 970])
        self.right_split.setSizes([410, 390])  # the ledger's ten rows stay visible at 1280×720
        self.bottom_split.setSizes([560, 400])

        self.timing_label = QLabel("")
        self.timing_label.setObjectName("timingLabel")
        self.statusBar().addPermanentWidget(self.timing_label)
        QWidget.setTabOrder(self.inputs.last_widget, self.tabs)
        # "Measure on this GPU": button, progress and Cancel in the action row, the Measured tab, chart markers.
        self.measure_panel = MeasurePanel(self)
        # "Precise (trace)": a toggle, progress and Cancel before the measure button, the Trace tab.
        self.trace_panel = TracePanel(self)
        # Tab follows the action row left to right: Precise (trace), then Measure
        QWidget.setTabOrder(self.trace_panel.toggle, self.measure_panel.button)
        # the chart's corner switches to the timeline (and the timeline's header back): no room taken from the
        # action row, so the window keeps its minimum width
        self.timeline_button = QPushButton("Timeline ▸", self.chart)
        self.timeline_button.setObjectName("timelineButton")
        self.timeline_button.setCheckable(True)
        self.timeline_button.setToolTip("Show the step's memory over time (the trace's predicted allocations and "
                                        "frees, or an opened memory snapshot) instead of the phase bars (Ctrl+Shift+T)")
        self.timeline_button.toggled.connect(self.show_timeline)
        self.timeline_button.adjustSize()
        self.timeline_button.move(4, 4)
        self.timeline_panel.back_button.clicked.connect(lambda: self.show_timeline(False))
        QWidget.setTabOrder(self.measure_panel.button, self.timeline_button)
        self.measure_panel.finished.connect(self._measured_timeline)

    def job_row(self, label: QWidget, *rest: QWidget) -> QHBoxLayout:
        """A line under the action row for a background job's progress: ``label`` stretches, ``rest`` follow."""
        row = QHBoxLayout()
        row.setSpacing(8)
        row.addWidget(label, 1)
        for widget in rest:
            row.addWidget(widget)
        self.jobs_box.addLayout(row)
        return row

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        handle = self.windowHandle()
        if not self._watching_screen and handle is not None:
            self._watching_screen = True
            handle.screenChanged.connect(lambda _screen: self.fit_to_screen())

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._adapt_layout()

    def _adapt_layout(self) -> None:
        """Below :data:`NARROW_WIDTH` "What to change" becomes a tab after the ledger, so the ledger keeps its four
        columns (1024×700); above, it is beside the ledger again. Either way the bottom gets the ledger's height
        when the window is tall enough for the chart's minimum too."""
        narrow = self.width() < NARROW_WIDTH
        if narrow and not self.advice_in_tabs:
            self.advice_in_tabs = True
            self.tabs.insertTab(1, self.advice_box, "What to change")
            self.tabs.setTabToolTip(1, self.advice_box.toolTip())
        elif not narrow and self.advice_in_tabs:
            self.advice_in_tabs = False
            current = self.tabs.currentWidget() is self.advice_box
            self.bottom_split.addWidget(self.advice_box)  # leaves the tab widget (its tab goes with it)
            self.advice_box.show()
            self.bottom_split.setSizes([560, 400])
            if current:
                self.tabs.setCurrentWidget(self.table)
        self._fit_timer.start()  # once the splitters have their new sizes

    def _fit_ledger_height(self) -> None:
        """On a resize (or new ledger rows), give the bottom row just the ledger's rows and the chart the rest, when
        the chart keeps its minimum height (a user's drag holds until the window is resized again)."""
        t = self.table
        need = (self.tabs.tabBar().sizeHint().height() + t.horizontalHeader().height() + 2 * t.frameWidth()
                + sum(t.rowHeight(r) for r in range(t.rowCount())) + 4)
        total = sum(self.right_split.sizes())
        if total > 0 and need <= total - self.chart.minimumHeight() and self.right_split.sizes()[1] != need:
            self.right_split.setSizes([total - need, need])

    def _frame_allowance(self) -> tuple[int, int]:
        """The frame's width and height beyond the window's own geometry (the title bar, the borders): measured once
        the window has one, else :data:`FRAME_ALLOWANCE`."""
        frame, inner = self.frameGeometry(), self.geometry()
        if self.isVisible() and frame.size() != inner.size():
            return frame.width() - inner.width(), frame.height() - inner.height()
        return FRAME_ALLOWANCE

    def _available(self) -> tuple[int, int] | None:
        """The largest window (without its frame) the screen's available geometry holds, or None without a screen."""
        screen = self.screen() or QApplication.primaryScreen()
        if screen is None:
            return None
        avail = screen.availableGeometry()
        fw, fh = self._frame_allowance()
        return max(1, avail.width() - fw), max(1, avail.height() - fh)

    def _default_size(self) -> tuple[int, int]:
        """1360×880, or 94 % × 92 % of a smaller screen (at least 900×600), never more than the screen holds."""
        width, height = 1360, 880
        screen = self.screen() or QApplication.primaryScreen()
        room = self._available()
        if screen is not None and room is not None:
            avail = screen.availableGeometry()
            width = min(width, max(900, int(avail.width() * 0.94)), room[0])
            height = min(height, max(600, int(avail.height() * 0.92)), room[1])
        return width, height

    def _fit_minimum_to_screen(self) -> None:
        """Keep the window's minimum size within the screen: on a screen narrower than the two columns' minimum
        widths, they give way (each keeps its share; the results then scroll sideways)."""
        room = self._available()
        if room is None:
            return
        need = INPUT_MIN_WIDTH + RESULT_MIN_WIDTH + self.main_split.handleWidth()
        scale = min(1.0, room[0] / need)
        self.input_scroll.setMinimumWidth(int(INPUT_MIN_WIDTH * scale))
        self.result_scroll.setMinimumWidth(int(RESULT_MIN_WIDTH * scale))
        compact = room[1] < COMPACT_HEIGHT
        if not self._normal_heights:
            self._normal_heights = {widget: widget.minimumHeight() for widget, _ in self._compact_heights()}
        for widget, short in self._compact_heights():
            normal = self._normal_heights[widget]  # 0: the widget's own minimum size hint
            widget.setMinimumHeight(min(normal or widget.minimumSizeHint().height(), short) if compact else normal)
            parent = widget.parentWidget()
            while parent is not None and parent is not self:  # pages of hidden tabs too: none keeps a stale minimum
                parent.updateGeometry()
                parent = parent.parentWidget()

    def _compact_heights(self) -> list[tuple[QWidget, int]]:
        """The widgets whose minimum height a short screen lowers, and to what (logical px): the timeline's chart, so
        that its hidden page needs no more height than the phase chart (which keeps its own minimum: its legend needs
        it), and the list of suggestions, so that their tab needs no more than the ledger's."""
        pairs: list[tuple[QWidget, int]] = []
        timeline = self.timeline_panel.chart
        normal = self._normal_heights.get(timeline, timeline.minimumHeight())
        header = self.timeline_panel.minimumSizeHint().height() - timeline.minimumHeight()  # buttons, texts
        pairs.append((timeline, max(COMPACT_TIMELINE_HEIGHT, min(normal, self.chart.minimumHeight() - header))))
        suggestions = self.advice.findChild(QScrollArea)
        if suggestions is not None:
            pairs.append((suggestions, COMPACT_LIST_HEIGHT))
        return pairs

    def fit_to_screen(self) -> None:
        """Shrink (and move) the window into its screen's available geometry when it runs past it, on a move to
        another screen (the first size and a restored geometry are fitted when the window is made)."""
        self._fit_minimum_to_screen()
        screen = self.screen() or QApplication.primaryScreen()
        room = self._available()
        if screen is None or room is None or self.isMaximized() or self.isFullScreen():
            return
        width, height = min(self.width(), room[0]), min(self.height(), room[1])
        if (width, height) != (self.width(), self.height()):
            self.resize(width, height)
        if self.isVisible():
            avail, frame = screen.availableGeometry(), self.frameGeometry()
            x = min(max(frame.x(), avail.x()), avail.x() + avail.width() - frame.width())
            y = min(max(frame.y(), avail.y()), avail.y() + avail.height() - frame.height())
            if (x, y) != (frame.x(), frame.y()):
                self.move(max(x, avail.x()), max(y, avail.y()))

    def _build_actions(self) -> None:
        menu = self.menuBar()
        self.file_menu = menu.addMenu("&File")
        self.open_action = QAction("&Open config.json…", self)
        self.open_action.setShortcut(QKeySequence.StandardKey.Open)
        self.open_action.triggered.connect(self.choose_config)
        self.file_menu.addAction(self.open_action)
        self.open_snapshot_action = QAction("Open memory &snapshot…", self)
        self.open_snapshot_action.setStatusTip("Read a CUDA memory snapshot (torch.cuda.memory._dump_snapshot) into "
                                               "the Timeline tab, beside this setup's estimate")
        self.open_snapshot_action.triggered.connect(self.choose_snapshot)
        self.file_menu.addAction(self.open_snapshot_action)
        self.export_snapshot_action = QAction("Export predicted snapshot for &memory_viz…", self)
        self.export_snapshot_action.setEnabled(False)
        self.export_snapshot_action.triggered.connect(self.export_snapshot)
        self.file_menu.addAction(self.export_snapshot_action)
        self.file_menu.addSeparator()
        self.export_action = QAction("&Export report…", self)
        self.export_action.setShortcut(QKeySequence("Ctrl+E"))
        self.export_action.setStatusTip("Write the estimate, verdict, suggestions and sources as a PDF or a PNG")
        self.export_action.triggered.connect(lambda: self.export_report())
        self.file_menu.addAction(self.export_action)
        self.export_separator = self.file_menu.addSeparator()
        self.quit_action = QAction("&Quit", self)
        self.quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        self.quit_action.setShortcutContext(Qt.ShortcutContext.ApplicationShortcut)
        self.quit_action.triggered.connect(self.close)
        self.file_menu.addAction(self.quit_action)

        edit = menu.addMenu("&Edit")
        self.undo_action = QAction("&Undo", self)
        self.undo_action.setShortcuts([QKeySequence.StandardKey.Undo])
        self.undo_action.triggered.connect(self.undo)
        self.redo_action = QAction("&Redo", self)
        self.redo_action.setShortcuts([QKeySequence("Ctrl+Shift+Z"), QKeySequence.StandardKey.Redo])
        self.redo_action.triggered.connect(self.redo)
        for a in (self.undo_action, self.redo_action):
            a.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
            edit.addAction(a)
        self.undo_stack.canUndoChanged.connect(self._update_undo_actions)
        self.undo_stack.canRedoChanged.connect(self._update_undo_actions)
        self.undo_stack.undoTextChanged.connect(self._update_undo_actions)
        self.undo_stack.redoTextChanged.connect(self._update_undo_actions)
        edit.addSeparator()
        self.copy_ledger_action = QAction("&Copy ledger as TSV", self)
        self.copy_ledger_action.triggered.connect(lambda: self._copy_ledger())
        edit.addAction(self.copy_ledger_action)
        edit.addSeparator()
        self.reset_action = QAction("Reset to &defaults", self)
        self.reset_action.triggered.connect(self.reset_to_defaults)
        edit.addAction(self.reset_action)

        view = menu.addMenu("&View")
        for text, key, target in (("Go to &inputs", "Ctrl+1", lambda: self.inputs.first_widget.setFocus()),
                                  ("Go to the &ledger", "Ctrl+2", self._focus_ledger),
                                  ("Go to the &suggestions", "Ctrl+3", self._focus_advice)):
            a = QAction(text, self)
            a.setShortcut(QKeySequence(key))
            a.triggered.connect(target)
            view.addAction(a)
            self.addAction(a)

        view.addSeparator()
        self.trace_action = QAction("&Precise (trace)", self)
        self.trace_action.setCheckable(True)
        self.trace_action.setShortcut(QKeySequence("Ctrl+T"))
        self.trace_action.setStatusTip("Trace one training step on fake tensors and draw that ledger (needs PyTorch)")
        self.trace_action.setEnabled(self.trace_panel.available)
        self.trace_action.toggled.connect(self.trace_panel.set_enabled)
        self.trace_panel.toggle.toggled.connect(self.trace_action.setChecked)
        view.addAction(self.trace_action)
        self.addAction(self.trace_action)
        self.timeline_action = QAction("&Timeline (memory over time)", self)
        self.timeline_action.setCheckable(True)
        self.timeline_action.setShortcut(QKeySequence("Ctrl+Shift+T"))
        self.timeline_action.toggled.connect(self.show_timeline)
        view.addAction(self.timeline_action)
        self.addAction(self.timeline_action)

        help_menu = menu.addMenu("&Help")
        self.about_action = QAction("&About memcalc", self)
        self.about_action.triggered.connect(self.show_about)
        help_menu.addAction(self.about_action)
        about_qt = QAction("About &Qt", self)
        about_qt.triggered.connect(QApplication.aboutQt)
        help_menu.addAction(about_qt)
        self._update_undo_actions()

    def _restore_layout(self) -> None:
        if self.settings is None:
            return
        geometry = load_bytes(self.settings, KEY_GEOMETRY)
        if geometry is not None:
            self.restoreGeometry(geometry)
        state = load_bytes(self.settings, KEY_WINDOW_STATE)
        if state is not None:
            self.restoreState(state)
        splits = self.settings.value(KEY_SPLITTERS)
        if isinstance(splits, list) and len(splits) == 3:
            for splitter, data in zip((self.main_split, self.right_split, self.bottom_split), splits, strict=True):
                if isinstance(data, QByteArray):
                    splitter.restoreState(data)

    def _saved_state(self) -> tuple[FormState | None, str]:
        assert self.settings is not None
        saved = load_state(self.settings)
        if saved is None:
            return None, ""
        if saved.model_kind == "config" and not Path(saved.config_path).expanduser().is_file():
            return None, f"The saved config.json ({saved.config_path}) no longer exists; using the default setup."
        return saved, ""

    # ---- estimating ---------------------------------------------------------------------------
    def schedule_refresh(self) -> None:
        if not self._closed:
            self.debounce.start()
            self._update_undo_actions()

    def refresh(self) -> bool:
        """Estimate the form now; ``False`` (and inline errors, old result kept) when an input is invalid. A damaged
        cache file met on the way (here or by a calibration before) is said once in the status bar."""
        try:
            return self._refresh()
        finally:
            notices = take_notices()
            if notices and not self._closed:
                self.statusBar().showMessage(" ".join(notices), 15000)

    def _refresh(self) -> bool:
        self.debounce.stop()
        if self._closed:
            return False
        t0 = time.perf_counter()
        state = self.inputs.state()
        try:
            setup = build_setup(state, self.cache)
            needed = setup.extras.get("fit")
            if needed is not None:  # a family without a block model: its fit, or a calibration on the way
                fitted = self._fitted(needed, setup)
                if fitted is None:
                    return False
                result = fitted
            else:
                result = evaluate(setup)
        except FormErrors as exc:
            return self._invalid(exc.errors)
        except InputError as exc:  # a cross-field rule of the core (e.g. a sharded strategy without architecture)
            return self._invalid({form_field(exc, state): window_wording(exc.reason)})
        except Exception as exc:  # never crash on input: report and keep the last result
            traceback.print_exc()
            return self._invalid({"general": one_line(f"unexpected error: {exc}")})
        previous = self.result
        try:
            self._show(result)
        except Exception as exc:  # a result the views cannot draw: say so and keep the last good one on screen
            traceback.print_exc()
            if previous is not None:
                with contextlib.suppress(Exception):
                    self._show(previous)
            return self._invalid({"general": one_line(f"cannot show this result ({type(exc).__name__}: {exc})")})
        self.inputs.show_errors({})
        self.banner.set_stale(False)
        if self.statusBar().currentMessage() == self._invalid_message:
            self.statusBar().clearMessage()  # valid again: the "Check …" message no longer applies
        self.analytic_result = result
        self.trace_result = None
        if self._committed is not None and state != self._committed and self._recording:
            changed = self._committed.changed_fields(state)
            key = changed[0] if len(changed) == 1 and changed[0] in TEXT_FIELDS else None
            text = "Change " + ", ".join(FIELD_NAMES.get(c, c) for c in changed)
            self.undo_stack.push(SetupCommand(self, self._committed, state, text, merge_key=key))
        self._committed = state
        self.last_refresh_ms = (time.perf_counter() - t0) * 1000
        self.timing_label.setText(f"{result.estimate.method} · {self.last_refresh_ms:.1f} ms")
        self._update_undo_actions()
        self.result_changed.emit(result)
        return True

    # ---- families without a block model: the fitted method ---------------------------------------------------
    def _fit_key(self, needed: Any, setup: Any, ranks: bool = True) -> str:
        """A calibration's key: the config and the setup's signature, and the FSDP2 layout whose rank it traces
        (another layout needs its own rank fit; core.fitted.rank_layout); ``ranks=False``: the one-replica fit's
        key, which answers any layout by rule."""
        from ..core.fitted import rank_layout, signature

        return json.dumps({"config": needed.config, "signature": signature(setup),
                           "ranks": rank_layout(setup) if ranks else None}, sort_keys=True, default=str)

    def _fit_or_replica(self, needed: Any, setup: Any) -> Any:
        """The fit kept for ``setup`` (or why it failed), else the one-replica fit of its signature (an FSDP2 layout
        whose rank is not calibrated yet: the rule answers meanwhile), else ``None``."""
        found = self.fits.get(self._fit_key(needed, setup))
        if found is None:
            replica = self.fits.get(self._fit_key(needed, setup, ranks=False))
            found = replica if replica is not None and not isinstance(replica, (str, InputError)) else None
        return found

    def _fitted(self, needed: Any, setup: Any) -> Result | None:
        """The fitted result when this config and setup are calibrated; else start the calibration (seconds, in a
        worker; the last result stays on screen meanwhile) and return None."""
        from ..core.fitted import evaluate_fitted, rank_signature, signature, worth_calibrating

        fit = self._fit_or_replica(needed, setup)
        if isinstance(fit, str):  # the fit failed for this config and setup: say why
            raise InputError("config" if self.inputs.state().model_kind == "config" else "model_id", fit)
        if isinstance(fit, InputError):  # a layout the config cannot take: its field is marked
            raise fit
        if fit is not None:
            sized = setup.with_changes(params=fit.num_params)
            sized.extras.update(model_type=needed.model_type, model_name=needed.name, model_source=needed.source,
                                fitted=True)
            active = fit.structure.get("active_params", fit.num_params)
            if active != fit.num_params:
                sized.extras["active_params"] = active
            wanted: list[Any] = []

            def more(changed: Any) -> Any:
                """A what-if's fit from memory; checkpointing's is calibrated next, in the worker (the solver's
                suggestions gain it on the refresh that follows)."""
                found = self._fit_or_replica(needed, changed)
                if found is None and worth_calibrating(signature(sized), changed):
                    wanted.append(changed)
                return found if not isinstance(found, (str, InputError)) else None

            result = evaluate_fitted(sized, fit, more)
            # worth the seconds: a lever when it does not fit, or the other strategies' step for the GPU plan
            if wanted and (result.verdict.fits is False or signature(wanted[0])["precision"] != signature(sized)[
                    "precision"]) and not self.fit_runner.is_running():
                self._calibrate(needed, wanted[0], quiet=True)
            elif self._fit_key(needed, setup) not in self.fits and rank_signature(setup) is not None \
                    and not self.fit_runner.is_running():
                # the rule answers this FSDP2 layout until its own rank is calibrated (seconds; the result then
                # refreshes)
                self._calibrate(needed, setup, quiet=True, what="one rank of this FSDP2 layout")
            return result
        if not self.fit_runner.is_running():
            self._calibrate(needed, setup)
        # a pipeline layout traces each checked rank's schedule (41 s cold for Mixtral-8x7B in 4 stages)
        how_long = "tens of seconds to minutes, each checked pipeline rank's schedule" if setup.parallel.pp > 1 \
            else "a few seconds"
        message = (f"Fitting model_type {needed.model_type!r} (memcalc has no block model for it): tracing the real "
                   f"transformers model at a few small sizes, once per config and setup — {how_long}")
        self.banner.set_stale(True, message)
        self.statusBar().showMessage(message)
        return None

    def _calibrate(self, needed: Any, setup: Any, quiet: bool = False,
                   what: str = "the gradient-checkpointing what-if for the suggestions", rank: bool = True) -> None:
        """Calibrate ``needed``'s config for ``setup``'s signature in the worker; ``quiet`` for a fit that refines
        what is on screen (a what-if's, or an FSDP2 rank's: ``what`` says which), which stays current meanwhile;
        ``rank=False``: the one-replica fit alone (a layout search's), kept under the replica's key."""
        self._fit_job_replica = self._fit_key(needed, setup, ranks=False)
        self._fit_job = self._fit_key(needed, setup) if rank else self._fit_job_replica
        config = needed.config

        def job(progress: Any, should_stop: Any) -> Any:
            from ..trace.fit import calibrate
            from ..trace.meta import count_params_on_meta

            def step(text: str) -> None:  # between the small traces: closing the window stops the calibration
                if should_stop():
                    raise TraceCancelled("calibration cancelled")
                progress(text)

            step("counting the parameters on the meta device")
            n = count_params_on_meta(config)
            try:
                return calibrate(config, setup.with_changes(params=n), n, step, rank=rank)
            except ConfigError:
                raise  # the model's: a failed calibration, said on the model's field
            except InputError as exc:  # the setup's own field (a layout the config cannot take), not the model's
                return exc

        self.fit_runner.start(job)
        if quiet:
            self.statusBar().showMessage(f"Calibrating {what}…", 5000)

    def _fit_done(self, fit: Any) -> None:
        if isinstance(fit, InputError) and self._to_eager(str(fit)):
            return
        if self._fit_job is not None:
            self.fits[self._fit_job] = fit
            if not isinstance(fit, InputError):  # (a refusal is this layout's, not its signature's)
                # the one-replica fit inside answers the signature's other layouts by rule
                self.fits.setdefault(self._fit_job_replica, fit)
        self._fit_job = None
        self.statusBar().clearMessage()
        if not self._closed:
            self._next_layout_fit()
            self.refresh()

    def _to_eager(self, message: str) -> bool:
        """A family transformers runs without SDPA (Gemma 2, gpt-oss; the calibration's InputError, returned by its
        job): switch to eager, as the CLI does, and say so; the switch is an ordinary edit (undo brings SDPA back).
        False where ``message`` is another refusal."""
        if "no SDPA attention" not in message or self.inputs.state().attention != "sdpa" or self._closed:
            return False
        self._fit_job = None
        self.inputs.set_state(self.inputs.state().replace(attention="eager"))
        self.statusBar().showMessage(f"Attention set to eager: {message.split(': ', 1)[-1].split(': choose')[0]}",
                                     10000)
        self.schedule_refresh()
        return True

    def _fit_failed(self, message: str) -> None:
        if self._fit_job is not None:
            self.fits[self._fit_job] = message if message.startswith(("model_type", "config")) else \
                f"the fitted method does not hold for this model: {message}"
        self._fit_job = None
        if not self._closed:
            self._next_layout_fit()
            self.refresh()

    def _invalid(self, errors: dict[str, str]) -> bool:
        self.inputs.show_errors(errors)
        names = ", ".join(FIELD_NAMES.get(k, k) for k in errors)
        first = next(iter(errors.items()))
        self.banner.set_stale(True, f"{FIELD_NAMES.get(first[0], first[0])}: {first[1]}")
        self._invalid_message = f"Check {names}: the chart shows the last valid setup."
        self.statusBar().showMessage(self._invalid_message, 8000)
        self._update_undo_actions()
        return False

    def _show(self, result: Result) -> None:
        self.result = result
        setup = result.setup
        est = result.estimate
        self.timeline_panel.show_estimate(est, setup.capacity_bytes)
        self.export_snapshot_action.setEnabled(self.timeline_panel.predicted is not None)
        gpu = gpu_by_id().get(setup.gpu or "")
        self.chart.set_estimate(est, setup.capacity_bytes, gpu.name if gpu else "",
                                per_gpu=chart_scope(setup) if is_per_gpu(result) else None)
        self.table.set_estimate(est)
        self.banner.set_result(result)
        self.advice.set_result(result)
        self.assumptions.setPlainText("\n".join(f"• {a}" for a in est.assumptions))
        per_gpu = " · per GPU" if is_per_gpu(result) else ""
        self.method_label.setText(f"Method: {METHOD_NOTES.get(est.method, est.method)}{per_gpu}")
        self.inputs.show_loss_parallel(setup.parallel.loss_parallel, setup.parallel.strategy, setup.parallel.tp)
        if setup.model is not None:
            m = setup.model
            self.inputs.set_model_info(
                f"<b>{m.family}</b> · <b>{m.num_params:,}</b> parameters · {m.num_layers} layers × "
                f"hidden {m.hidden_size}, vocab {m.vocab_size:,}<br>Source: {m.source or 'config.json'}")
        elif "model_type" in setup.extras:
            self.inputs.set_model_info(
                f"<b>{setup.extras['model_type']}</b> · <b>{setup.num_params:,}</b> parameters"
                + (f", {setup.extras['active_params']:,} active per token" if "active_params" in setup.extras else "")
                + " (transformers, meta device)<br>No block model in memcalc: the <b>fitted</b> method traces the "
                "real model.<br>"
                f"Source: {setup.extras.get('model_source', 'config.json')}")
        elif "heuristic_reason" in setup.extras:
            self.inputs.set_model_info(
                f"<b>{setup.extras['heuristic_model_type']}</b> · <b>{setup.num_params:,}</b> parameters (stored "
                f"with the preset)<br>Method <b>quick</b>: {setup.extras['heuristic_reason']}.")
        else:
            self.inputs.set_model_info(
                f"<b>{setup.num_params:,}</b> parameters, no architecture.<br>Method <b>quick</b>: a rough "
                "heuristic (Hugging Face blog) that overestimates activations; open a config.json or pick a preset "
                "for the analytic method.")
        self.inputs.set_trainable_info("" if setup.tuning.method == "full" else setup.tuning_text())
        what = "documents" if setup.packing else "sequences"
        real = " real" if setup.packing else ""
        self.inputs.set_effective(f"{setup.effective_batch:,} {what} per step ({setup.batch} × {setup.grad_accum})"
                                  f" = {setup.tokens * setup.grad_accum:,}{real} tokens")

    def show_trace(self, result: Result, traced: Any) -> None:
        """Draw a trace's result (same setup as the analytic one) with its difference from the analytic."""
        self._show(result)
        self.trace_result = traced
        timeline = getattr(traced, "timeline", None)
        self.timeline_panel.show_predicted(timeline, result.estimate, result.setup.capacity_bytes)
        self.export_snapshot_action.setEnabled(timeline is not None)
        self.method_label.setText(f"Method: {METHOD_NOTES['trace']} — {difference_text(traced)}")
        self.timing_label.setText(f"trace · {traced.seconds:.1f} s")

    def show_analytic(self) -> None:
        """Draw the latest analytic result again (the trace was turned off)."""
        if self.analytic_result is not None:
            self.trace_result = None
            self._show(self.analytic_result)
            self.timing_label.setText(f"{self.analytic_result.estimate.method} · {self.last_refresh_ms:.1f} ms")

    # ---- undo / redo --------------------------------------------------------------------------
    def apply_state(self, state: FormState) -> None:
        """Show ``state`` and estimate it without recording an undo step (undo/redo use this)."""
        self.debounce.stop()
        self.inputs.set_state(state)
        self._recording = False
        try:
            if not self.refresh():
                self._committed = state
        finally:
            self._recording = True

    def _dirty(self) -> bool:
        return self._committed is not None and self.inputs.state() != self._committed

    def undo(self) -> None:
        if self._dirty() and not self.refresh():
            # The pending edit is invalid: the first undo reverts it to the last valid setup.
            assert self._committed is not None
            self.apply_state(self._committed)
            self.statusBar().showMessage("Reverted the invalid entry.", 5000)
            return
        if self.undo_stack.canUndo():
            text = self.undo_stack.undoText()
            self.undo_stack.undo()
            self.statusBar().showMessage(f"Undid: {text}", 5000)
        self._update_undo_actions()

    def redo(self) -> None:
        if self._dirty():
            self.refresh()
        if self.undo_stack.canRedo():
            text = self.undo_stack.redoText()
            self.undo_stack.redo()
            self.statusBar().showMessage(f"Redid: {text}", 5000)
        self._update_undo_actions()

    def _update_undo_actions(self, *_: Any) -> None:
        if not hasattr(self, "undo_action"):
            return
        dirty = self._dirty() if self._committed is not None else False
        self.undo_action.setEnabled(self.undo_stack.canUndo() or dirty)
        self.redo_action.setEnabled(self.undo_stack.canRedo())
        self.undo_action.setText(f"&Undo {_menu_text(self.undo_stack.undoText())}".rstrip()
                                 if self.undo_stack.canUndo() else "&Undo")
        self.redo_action.setText(f"&Redo {_menu_text(self.undo_stack.redoText())}".rstrip()
                                 if self.undo_stack.canRedo() else "&Redo")

    def push_state(self, new: FormState, text: str) -> bool:
        """Apply ``new`` as one undoable step (suggestions, reset, opened files)."""
        if self._dirty():
            self.refresh()
        assert self._committed is not None
        old = self._committed
        if new == old:
            return True
        self.undo_stack.push(SetupCommand(self, old, new, text, already_applied=False))
        return self.result is not None and self._committed == new

    def apply_changes(self, title: str, changes: dict[str, Any]) -> None:
        """Apply a core suggestion (``Suggestion.changes``) as one undoable step."""
        if self._dirty():
            self.refresh()
        assert self._committed is not None
        try:
            new = state_with_changes(self._committed, changes)
        except KeyError as exc:
            self.statusBar().showMessage(f"Cannot apply {title!r}: {exc}", 8000)
            return
        self.push_state(new, title)
        self.statusBar().showMessage(f"Applied: {title} (Ctrl+Z undoes)", 8000)

    def show_layouts(self) -> LayoutsDialog | None:
        """The layout search of the current setup in a dialog; the layout chosen there is one undoable step."""
        if self._dirty():
            self.refresh()
        setup = self.result.setup if self.result is not None else None
        needed = setup.extras.get("fit") if setup is not None else None
        if setup is None or (setup.model is None and needed is None):
            self.statusBar().showMessage("A layout search needs an architecture: a preset or a config.json", 8000)
            return None
        if needed is not None:  # no block model: the fitted method's search over the fits at hand
            dialog = LayoutsDialog(setup, self, find=self._fitted_layout_search(needed), name=needed.name,
                                   calibrate=lambda layouts: self._calibrate_layouts(needed, setup, layouts))
        else:
            dialog = LayoutsDialog(setup, self)
        dialog.chosen.connect(lambda changes, title: self.apply_changes(title, changes))
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.open()
        self.layouts_dialog = dialog
        return dialog

    def _fitted_layout_search(self, needed: Any) -> Any:
        """The layout search of a family without a block model, over the fits this window holds and those cached on
        disk (``memcalc layouts`` calibrates the others): nothing is traced here, so the dialog opens at once."""
        from ..core.fitted import rank_signature, search_layouts
        from ..trace.fit import cached_fit
        from .layouts_dialog import SHOWN

        looked: dict[str, Any] = {}  # the keys read from disk in this search: the fit, None, or the refusal

        def fit_for(s: Any) -> Any:
            for key in (self._fit_key(needed, s), self._fit_key(needed, s, ranks=False)):
                failed = self.fits.get(key)
                if isinstance(failed, str):  # this signature's calibration failed: the search says why
                    raise InputError("method", failed)
                if isinstance(failed, InputError):  # a layout the config cannot take
                    raise failed
            key = self._fit_key(needed, s)
            found = self._fit_or_replica(needed, s)
            want = rank_signature(s)
            ranked = found is not None and (want is None or (found.rank is not None and found.rank.signature == want))
            if not ranked:
                # not held, or only the one-replica fit where the layout's rank is cached on disk (`memcalc estimate`
                # calibrated it): a sequence-parallel layout is weighed from that rank alone
                if key not in looked:
                    try:
                        looked[key] = cached_fit(needed.config, s)
                    except InputError as exc:  # a layout the config cannot take: said again for each layout
                        looked[key] = exc
                cached = looked[key]
                if isinstance(cached, InputError):
                    raise cached
                if cached is not None and (found is None or (cached.rank is not None
                                                             and cached.rank.signature == want)):
                    self.fits[key] = found = cached
            return found

        def find(setup: Any) -> Any:
            looked.clear()
            base = fit_for(setup)
            if base is None:
                raise InputError("method", "the fitted method has no calibration of this setup yet")
            return search_layouts(setup, base, fit_for, SHOWN, needed.config)

        return find

    def _calibrate_layouts(self, needed: Any, setup: Any, layouts: list[Any]) -> None:
        """Calibrate, one after another in the worker, each signature the layout search left out for want of a fit
        (a tensor-parallel degree, its bf16 step), then open the search again."""
        queued: dict[str, Any] = {}
        for par in layouts:
            trial = setup.with_changes(parallel=par)
            key = self._fit_key(needed, trial, ranks=False)
            if key not in self.fits:
                queued.setdefault(key, trial)
        self._layout_fits = [(needed, trial) for trial in queued.values()]
        self._layout_fits_total = len(self._layout_fits)
        self._next_layout_fit()

    def _next_layout_fit(self) -> None:
        """The next calibration the layout search asked for (when the worker is free); the search again after the
        last."""
        if self.fit_runner.is_running() or self._closed:
            return
        if self._layout_fits and self._layout_fits[0][0].config != getattr(self._fit_request(), "config", None):
            # another model is open now: the search's calibrations were for the one before, and would hold its own
            # calibration back
            self._layout_fits.clear()
            self._layout_fits_total = 0
        if self._layout_fits:
            needed, trial = self._layout_fits.pop(0)
            done = self._layout_fits_total - len(self._layout_fits)
            par = trial.parallel
            what = (f"tensor parallelism over {par.tp} GPUs" if par.tp > 1 else "another step precision") + \
                f" for the layout search ({done} of {self._layout_fits_total})"
            self._calibrate(needed, trial, quiet=True, what=what, rank=False)
        elif self._layout_fits_total:
            self._layout_fits_total = 0
            QTimer.singleShot(0, self.show_layouts)  # after the refresh this fit's end runs

    def _fit_request(self) -> Any:
        """The fitted method's request for the model the form names (``None``: a block model, or an invalid form)."""
        try:
            return build_setup(self.inputs.state(), self.cache).extras.get("fit")
        except Exception:  # an invalid form (FormErrors, a core rule): no model to calibrate for
            return None

    def reset_to_defaults(self) -> None:
        self.push_state(default_state(), "Reset to defaults")
        self.statusBar().showMessage("Reset to the default setup (Ctrl+Z undoes).", 6000)

    # ---- files --------------------------------------------------------------------------------
    def choose_config(self) -> None:
        start = str(Path(self.inputs.config_path.text()).expanduser().parent) if self.inputs.config_path.text() else ""
        path, _ = QFileDialog.getOpenFileName(self, "Open a model config.json", start,
                                              "Model configs (*.json);;All files (*)")
        if path:
            self.open_config(path)

    def _measured_timeline(self, measured: Any) -> None:
        """A finished measurement's timeline in the Timeline view (over the prediction of the same setup)."""
        timeline = getattr(measured, "timeline", None)
        if timeline is not None:
            self.timeline_panel.show_measured(timeline, measured.estimate.estimate,
                                              measured.requested.capacity_bytes, not measured.scaled)

    def show_timeline(self, on: bool = True) -> None:
        """Show the timeline (or the phase bars again) in the chart area."""
        self.chart_stack.setCurrentWidget(self.timeline_panel if on else self.chart)
        for toggle in (self.timeline_button, self.timeline_action):
            if toggle.isChecked() != on:
                toggle.setChecked(on)

    def choose_snapshot(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a CUDA memory snapshot", "",
                                              "Memory snapshots (*.pickle *.pkl);;Profiler memory timelines (*.json);;"
                                              "All files (*)")
        if path:
            self.open_snapshot(path)

    def open_snapshot(self, path: str | Path) -> None:
        """Read a real snapshot (or a profiler memory timeline) on a worker thread, then show it in the Timeline tab
        beside the current estimate; a file that is not one is reported in the status bar and the last timeline
        stays. A second file asked for while one is read replaces it. ``snapshot_opened`` says how it ended."""
        path = str(path)
        if self.snapshot_runner.is_running():
            self._snapshot_next = path
            self.snapshot_runner.cancel()
            return
        from ..core.timeline import read_timeline_file

        self.statusBar().showMessage(f"Reading the snapshot {Path(path).name}…")
        self._snapshot_reading = path
        self.snapshot_runner.start(lambda _progress, _stop: (path, read_timeline_file(path)))

    def _next_snapshot(self) -> bool:
        """Start the snapshot asked for while another was read; whether there was one."""
        path, self._snapshot_next = self._snapshot_next, None
        if path is None:
            return False
        self.open_snapshot(path)
        return True

    def _snapshot_read(self, found: tuple[str, Any]) -> None:
        if self._next_snapshot():
            return
        path, timeline = found
        result = self.result
        reason = self.timeline_panel.show_opened(timeline, path, result.estimate if result else None,
                                                 result.setup.capacity_bytes if result else None)
        if reason:
            self._snapshot_failed(reason, path)
            return
        self.show_timeline(True)
        self.statusBar().showMessage(f"Opened the snapshot {Path(path).name}", 6000)
        self.snapshot_opened.emit(True)

    def _snapshot_failed(self, message: str, path: str | None = None) -> None:
        if path is None and self._next_snapshot():
            return
        name = Path(path or self._snapshot_reading).name
        self.statusBar().showMessage(f"Could not open {name}: {message.removeprefix('snapshot: ')}", 15000)
        self.snapshot_opened.emit(False)

    def export_snapshot(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export the predicted timeline for memory_viz",
                                              "predicted.pickle", "Memory snapshots (*.pickle)")
        if path:
            reason = self.timeline_panel.export_predicted(path)
            self.statusBar().showMessage(reason or f"Wrote {path}: open it at pytorch.org/memory_viz", 10000)

    def fetch_hub(self, model_id: str) -> None:
        """Download a Hub id's config.json off the GUI thread (the network may take seconds); the estimate follows
        from the local cache it lands in."""
        if self.hub_runner.is_running():
            return
        from ..hub import resolve_config

        self.statusBar().showMessage(f"Fetching {model_id or 'the model'}'s config.json from the Hub…")
        self.hub_runner.start(lambda _progress, _stop: resolve_config(model_id))

    def _hub_fetched(self, found: Any) -> None:
        self.cache.forget_hub(found.repo_id)
        if self.inputs.state().hub_id.strip() != found.repo_id:
            self.inputs.set_state(self.inputs.state().replace(model_kind="hub", hub_id=found.repo_id))
        ok = self.refresh()
        self.statusBar().showMessage(f"{found.repo_id}: config.json from the {found.origin}" if ok else
                                     f"{found.repo_id}: {self.inputs.errors().get('hub_id', 'see the marked field')}",
                                     10000)

    def _hub_failed(self, message: str) -> None:
        self.inputs.show_errors({"hub_id": message})
        self.statusBar().showMessage(f"Could not fetch: {message}", 15000)

    def open_config(self, path: str | Path) -> bool:
        """Use a config.json as the model; a broken one is reported inline and the old result stays."""
        if self._dirty():
            self.refresh()
        base = self._committed or default_state()
        self.inputs.set_state(base.replace(model_kind="config", config_path=str(path)))
        ok = self.refresh()
        if ok:
            self.statusBar().showMessage(f"Opened {path}", 6000)
        else:
            reason = self.inputs.errors().get("config_path", "")
            self.statusBar().showMessage(f"Could not use {Path(path).name}: {reason}", 10000)
        return ok

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if self._dropped_path(event) is not None:
            event.acceptProposedAction()
        else:
            event.ignore()

    def dragMoveEvent(self, event: Any) -> None:
        if self._dropped_path(event) is not None:
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        path = self._dropped_path(event)
        if path is None:
            event.ignore()
            return
        event.acceptProposedAction()
        if path.lower().endswith((".pickle", ".pkl")):
            self.open_snapshot(path)
        else:
            self.open_config(path)

    @staticmethod
    def _dropped_path(event: Any) -> str | None:
        mime = event.mimeData()
        if not mime.hasUrls():
            return None
        for url in mime.urls():
            if url.isLocalFile() and url.toLocalFile().lower().endswith((".json", ".pickle", ".pkl")):
                return url.toLocalFile()
        return None

    # ---- misc ---------------------------------------------------------------------------------
    def _copy_ledger(self) -> str:
        text = self.table.to_tsv()
        QApplication.clipboard().setText(text)
        self.statusBar().showMessage(f"Copied the ledger as tab-separated values ({self.table.unit}).", 5000)
        return text

    def _focus_ledger(self) -> None:
        self.tabs.setCurrentWidget(self.table)
        self.table.setFocus()

    def _focus_advice(self) -> None:
        if self.advice_in_tabs:
            self.tabs.setCurrentWidget(self.advice_box)
        for b in [self.advice.use_max, *self.advice.buttons]:
            if b.isVisible():
                b.setFocus()
                return

    def export_report(self, path: str | Path | None = None) -> Path | None:
        """File → Export report…: a PDF or PNG of the current result (``path`` skips the file chooser)."""
        from ..report.dialog import export_from_window  # Qt's PDF/report code loads on first use

        if self._dirty():
            self.refresh()
        return export_from_window(self, path)

    def show_about(self) -> AboutDialog:
        dialog = AboutDialog(self)
        dialog.open()
        return dialog

    def headline(self) -> str:
        return per_gpu_headline(self.result) if self.result else ""

    def save_settings(self) -> None:
        if self.settings is None:
            return
        if self._committed is not None:
            save_state(self.settings, self._committed)
        save_bytes(self.settings, KEY_GEOMETRY, self.saveGeometry())
        save_bytes(self.settings, KEY_WINDOW_STATE, self.saveState())
        self.settings.setValue(KEY_SPLITTERS, [s.saveState() for s in (self.main_split, self.right_split,
                                                                      self.bottom_split)])
        self.settings.sync()

    def closeEvent(self, event: QCloseEvent) -> None:
        # Cancel every worker at once, then wait for them a second in all (a job that cannot stop that fast is
        # left to the process exit: see workers.running_orphans).
        if self.trace_panel.is_running() or self.measure_panel.is_running():
            self.statusBar().showMessage("Stopping the running measurement or trace and closing…")
            self.statusBar().repaint()
        self.trace_panel.runner.cancel()
        self.measure_panel.runner.cancel()
        self.hub_runner.cancel()
        self.fit_runner.cancel()
        self.snapshot_runner.cancel()
        deadline = time.monotonic() + STOP_TIMEOUT_MS / 1000
        self.trace_panel.shutdown(max(0, int((deadline - time.monotonic()) * 1000)))
        self.measure_panel.shutdown(max(0, int((deadline - time.monotonic()) * 1000)))
        self.hub_runner.stop(max(0, int((deadline - time.monotonic()) * 1000)))
        self.fit_runner.stop(max(0, int((deadline - time.monotonic()) * 1000)))
        self.snapshot_runner.stop(max(0, int((deadline - time.monotonic()) * 1000)))
        self.debounce.stop()
        if self._dirty():
            self.refresh()
        self.save_settings()
        self._closed = True
        super().closeEvent(event)
