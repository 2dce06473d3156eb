"""The layout search in the window: every tensor × pipeline × data-parallel split of the current GPU count
(:func:`memcalc_gui.core.layouts.search`), best first; choosing one applies it to the form as one undoable step.

The dialog is given the setup (and, for a family without a block model, the fitted method's search) and returns the
chosen layout as form changes; it knows nothing of the main window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ..core.distributed import Parallelism
from ..core.errors import InputError
from ..core.estimate import estimate
from ..core.layouts import NOT_CALIBRATED, Layout, Search, layout_label, search
from ..core.setup import TrainingSetup
from ..core.units import format_bytes

#: Rows shown (the search ranks them all; the best are what a person compares).
SHOWN = 40
COLUMNS = ("Layout", "Peak per GPU", "Headroom", "Speed", "Bubble", "Fewest GPUs")


def layout_changes(layout: Layout | Parallelism) -> dict[str, str]:
    """The form fields that set ``layout`` (the schedule and stages per GPU stay the form's)."""
    p = layout.parallel if isinstance(layout, Layout) else layout
    return {"gpus": str(p.gpus), "tp": str(p.tp), "pp": str(p.pp), "strategy": p.strategy, "ep": str(p.ep),
            "etp": str(p.etp), "sp": "true" if p.sp else "false",
            "loss_parallel": "true" if p.loss_parallel else "false",
            "reshard_after_forward": "true" if p.reshard_after_forward else "false",
            "dp_replicate": str(p.dp_replicate)}


def _own_rank(par: Parallelism) -> bool:
    """A layout whose calibration is its own rank's (a pipeline stage's schedule, a sequence-parallel rank): the form
    calibrates it once set to it."""
    return par.pp > 1 or par.sp


def _waiting(found: Search) -> tuple[list[Parallelism], list[Parallelism]]:
    """The layouts the search left out for want of a calibration: those the calibrate button starts (a
    tensor-parallel degree, another step precision: seconds each), and those each a calibration of its own rank
    (:func:`_own_rank`; tens of seconds to minutes: the form calibrates the one it is set to)."""
    waiting = [par for reason, pars in found.left_out.items() if NOT_CALIBRATED in reason for par in pars]
    return [par for par in waiting if not _own_rank(par)], [par for par in waiting if _own_rank(par)]


def _count(n: int) -> str:
    """``1 layout``, ``3 layouts``."""
    return f"{n} layout" + ("" if n == 1 else "s")


def _left_out_text(found: Search) -> str:
    """What the search left out: the layouts waiting for a calibration in one sentence (by tensor-parallel degree),
    those each waiting for its own rank's in another, then each other reason with its count."""
    waiting, staged = _waiting(found)
    text = ""
    if waiting:
        tps = sorted({par.tp for par in waiting})
        what = f"tensor parallelism over {', '.join(map(str, tps))} GPUs" if all(tps) and tps != [1] else "some"
        text += f" Not calibrated yet, so left out: {_count(len(waiting))} with {what}."
    if staged:
        pps = sorted({par.pp for par in staged if par.pp > 1})
        kinds = ([f"of {', '.join(map(str, pps))} pipeline stages"] if pps else []) \
            + (["with sequence parallelism"] if any(par.sp and par.pp == 1 for par in staged) else [])
        listed = "listed last" if len(staged) <= SHOWN else f"the first {SHOWN} listed last"
        verb = "is" if len(staged) == 1 else "are"
        text += (f" {_count(len(staged))} {' or '.join(kinds)} {verb} not calibrated yet "
                 f"({listed}): use one and the form fits it (tens of seconds to minutes, then cached), and it joins "
                 "this search.")
    for reason, pars in found.left_out.items():
        if NOT_CALIBRATED not in reason:
            text += f" Left out ({len(pars)}): {reason}."
    bounds = sum(x.upper_bound for x in found)
    if bounds:
        text += (f" {bounds} peaks marked ≤ are upper bounds (the autocast step stands in for the bf16 step until "
                 "that is calibrated).")
    return text


class LayoutsDialog(QDialog):
    """A ranked table of the layouts of ``setup``'s GPU count; :attr:`chosen` carries the form changes."""

    chosen = Signal(dict, str)

    def __init__(self, setup: TrainingSetup, parent: QWidget | None = None,
                 find: Callable[[TrainingSetup], Search] | None = None, name: str = "",
                 calibrate: Callable[[list[Parallelism]], None] | None = None) -> None:
        """``find``: the search of a family without a block model (the fitted method's, over the fits at hand),
        ``name`` its model's; by default the analytic search of ``setup``'s block model. ``calibrate``: starts the
        calibrations the layouts left out for want of one need (the dialog closes; the caller opens it again)."""
        super().__init__(parent)
        self.setWindowTitle(f"Layouts of {setup.parallel.gpus:,} GPUs")
        self.setObjectName("layoutsDialog")
        lay = QVBoxLayout(self)
        try:
            self.layouts = find(setup) if find is not None else search(setup, estimate, min_gpus_for=SHOWN)
            error = ""
        except InputError as exc:
            self.layouts, error = Search(), exc.reason
        cap = setup.capacity_bytes
        fitting = [x for x in self.layouts if x.fits is not False]
        name = name or (setup.model.name if setup.model else "the model")
        split = ("Tensor parallelism stays within a node, without loss parallelism, with sequence parallelism "
                 "under FSDP2: this family has no block model, each layout is fitted from traces of the real model."
                 if find is not None else
                 "Tensor parallelism stays within a node, with sequence and loss parallelism.")
        left = _left_out_text(self.layouts)
        intro = QLabel(
            error or f"{len(self.layouts)} ways to split {name} over {setup.parallel.gpus:,} GPUs"
            + (f" of {format_bytes(cap)}" if cap else " (choose a GPU or a capacity for a verdict)")
            + f"; {len(fitting)} fit. Best first: what fits, then speed by a rough model of one step (compute, the "
              f"pipeline bubble, communication; a ranking, not a forecast), then headroom. {split}{left}")
        intro.setWordWrap(True)
        intro.setObjectName("layoutsIntro")
        self.intro = intro
        lay.addWidget(intro)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setObjectName("layoutsTable")
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for i in range(1, len(COLUMNS)):
            header.setSectionResizeMode(i, QHeaderView.ResizeMode.ResizeToContents)
        calibrated_here, staged = _waiting(self.layouts)
        #: The layouts waiting for their own rank's calibration (pipeline, sequence-parallel), after the weighed ones:
        #: using one sets it in the form, which fits it
        self.waiting = sorted(staged, key=lambda par: (par.pp, par.tp, -par.dp, par.ep))[:SHOWN]
        self._fill(self.layouts[:SHOWN], cap)
        # a long label (every dimension, each expert's split) wraps and its row grows to show it all, never cut
        self.table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.resize(self._width_for_labels(), 480)
        self.table.itemDoubleClicked.connect(lambda *_: self._use())
        lay.addWidget(self.table, 1)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        self.use_button = buttons.addButton("Use this layout", QDialogButtonBox.ButtonRole.AcceptRole)
        self.use_button.setEnabled(bool(self.layouts) or bool(self.waiting))
        self.use_button.clicked.connect(self._use)
        buttons.rejected.connect(self.reject)
        waiting = calibrated_here + [x.parallel for x in self.layouts if x.upper_bound]  # their bf16 step's own fit
        self.calibrate_button = None
        if calibrate is not None and waiting:
            tps = sorted({par.tp for par in waiting if par.tp > 1})
            self.calibrate_button = buttons.addButton(
                "Calibrate the bf16 step" if not tps else
                f"Calibrate tensor parallelism over {', '.join(map(str, tps))} GPUs",
                QDialogButtonBox.ButtonRole.ActionRole)
            self.calibrate_button.setObjectName("calibrateLayouts")
            self.calibrate_button.setToolTip("Trace the real model at a few small sizes for each of these layouts, "
                                             "in the background (seconds each, then cached); the search opens again "
                                             "when they are done")

            def start() -> None:
                calibrate(waiting)
                self.reject()

            self.calibrate_button.clicked.connect(start)
        lay.addWidget(buttons)
        if self.layouts or self.waiting:
            self.table.selectRow(0)

    def _width_for_labels(self) -> int:
        """Wide enough that the longest label takes one line, at least 820 px and at most 90 % of the screen."""
        labels = [self.table.item(r, 0).text() for r in range(self.table.rowCount())]
        metrics = self.table.fontMetrics()
        widest = max((metrics.horizontalAdvance(text) for text in labels), default=0)
        others = sum(self.table.sizeHintForColumn(c) for c in range(1, len(COLUMNS)))
        chrome = 24 * len(COLUMNS) + self.table.verticalScrollBar().sizeHint().width() + 40
        screen = self.screen().availableGeometry().width() if self.screen() is not None else 1280
        return max(820, min(widest + others + chrome, int(screen * 0.9)))

    def _fill(self, rows: list[Layout], cap: int | None) -> None:
        dim = self.palette().color(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text)
        self.table.setRowCount(len(rows) + len(self.waiting))
        for r, par in enumerate(self.waiting, len(rows)):
            for c, text in enumerate((layout_label(par), "not calibrated", "—", "—", "—", "—")):
                item = QTableWidgetItem(text)
                if c:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                item.setForeground(dim)
                item.setToolTip(("" if c else f"{text}\n")
                                + "Not calibrated yet: Use this layout sets it in the form, which fits its "
                                + ("pipeline ranks" if par.pp > 1 else "sequence-parallel rank")
                                + " from small traces (tens of seconds to minutes, then cached); the search weighs "
                                "it from then on")
                self.table.setItem(r, c, item)
        for r, layout in enumerate(rows):
            head = "—" if layout.headroom_bytes is None else \
                format_bytes(layout.headroom_bytes) if layout.fits else "over"
            fewest = f"{layout.min_gpus:,}" if layout.min_gpus else "never" if layout.min_gpus_searched and cap \
                else "—"
            speed = self.layouts.speed_text(layout)
            peak = ("≤ " if layout.upper_bound else "") + format_bytes(layout.peak_bytes)
            cells = (layout.label, peak, head, speed, f"{layout.bubble:.0%}", fewest)
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if c:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                why = ""
                if layout.upper_bound:
                    why = ("An upper bound: the autocast step's calibration stands in for the bf16 step this strategy "
                           "runs until that is calibrated")
                if layout.fits is False:
                    item.setForeground(dim)
                    why = ("Does not fit: the most loaded GPU needs more than the capacity"
                           + ("; in parentheses, its speed were it to fit" if COLUMNS[c] == "Speed" else ""))
                item.setToolTip("\n".join(x for x in (text if not c else "", why) if x))
                self.table.setItem(r, c, item)

    def selected(self) -> Layout | Parallelism | None:
        """The chosen row: a weighed layout, or a pipeline layout waiting for its calibration."""
        rows = self.table.selectionModel().selectedRows()
        if not rows:
            return None
        row = rows[0].row()
        shown = min(len(self.layouts), SHOWN)
        return self.layouts[row] if row < shown else self.waiting[row - shown]

    def _use(self, *_: Any) -> None:
        layout = self.selected()
        if layout is None:
            return
        label = layout.label if isinstance(layout, Layout) else layout_label(layout)
        self.chosen.emit(layout_changes(layout), f"Use layout {label}")
        self.accept()
