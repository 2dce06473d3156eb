"""The verdict banner and the "what to change" panel (largest micro-batch and the core's suggestions)."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent, QMouseEvent, QPalette, QResizeEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from ..core.result import Result
from ..core.solver import Suggestion, micro_batch_changes
from ..core.vocab import OBJECT_LABELS
from ..view.plan_text import (
    STILL_OVER_HEADING,
    first_still_over,
    host_text,
    is_per_gpu,
    parallel_label,
    per_gpu_headline,
    pipeline_text,
    plan_action,
    plan_sentences,
    suggestion_figures,
    suggestions_note,
)
from ..view.theme import FIT_COLOR, NEUTRAL_COLOR, OVER_COLOR, tinted

MAX_SUGGESTIONS = 8

METHOD_NOTES = {
    "analytic": "analytic: the model's blocks counted tensor by tensor",
    "quick": "quick: a rough heuristic from the parameter count (Hugging Face blog); activations are overestimated",
    "trace": "trace: measured by tracing one step on fake tensors",
    "fitted": "fitted: small fake-tensor traces of the real model, evaluated for this shape",
}


class VerdictBanner(QFrame):
    """One sentence from ``Result.headline()`` on a green (fits), red (over) or neutral background."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("verdictBanner")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(12, 8, 12, 8)
        lay.setSpacing(10)
        self.mark = QLabel("")
        self.mark.setObjectName("verdictMark")
        f = self.mark.font()
        f.setPointSizeF(max(f.pointSizeF(), 9.0) * 1.8)
        f.setBold(True)
        self.mark.setFont(f)
        self.mark.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.mark.setMinimumWidth(self.mark.fontMetrics().horizontalAdvance("✗") + 8)
        lay.addWidget(self.mark, 0, Qt.AlignmentFlag.AlignTop)
        col = QVBoxLayout()
        col.setSpacing(2)
        self.text = QLabel("")
        self.text.setObjectName("verdictText")
        self.text.setWordWrap(True)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        tf = self.text.font()
        tf.setPointSizeF(max(tf.pointSizeF(), 9.0) * 1.15)
        tf.setBold(True)
        self.text.setFont(tf)
        self.detail = QLabel("")
        self.detail.setObjectName("verdictDetail")
        self.detail.setWordWrap(True)
        self.detail.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.stale_note = QLabel("")
        self.stale_note.setObjectName("verdictStale")
        self.stale_note.setWordWrap(True)
        sf = self.stale_note.font()
        sf.setItalic(True)
        self.stale_note.setFont(sf)
        self.stale_note.setVisible(False)
        # the per-GPU reasons (host memory, what the strategy gathers, DDP's buckets...) fold away so the banner
        # stays two or three lines and the ledger keeps its rows at 1280×720
        self.extra = QLabel("")
        self.extra.setObjectName("verdictExtra")
        self.extra.setWordWrap(True)
        self.extra.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.extra.setVisible(False)
        col.addWidget(self.text)
        col.addWidget(self.detail)
        col.addWidget(self.extra)
        col.addWidget(self.stale_note)
        lay.addLayout(col, 1)
        self.more = QToolButton()
        self.more.setObjectName("verdictMore")
        self.more.setCheckable(True)
        self.more.setAutoRaise(True)
        self.more.setText("Why? ▸")
        self.more.setToolTip("Show the largest object, the tensor peak (what max_memory_allocated would show) and, "
                             "for several GPUs, why the per-GPU numbers are what they are")
        self.more.toggled.connect(self._toggle_extra)
        self.more.setVisible(False)
        lay.addWidget(self.more, 0, Qt.AlignmentFlag.AlignTop)
        self.setAccessibleName("Verdict")
        self._state = "neutral"
        self._stale = False
        self._restyle()

    def set_result(self, result: Result) -> None:
        v = result.verdict
        self._state = "neutral" if v.fits is None else ("fits" if v.fits else "over")
        self.mark.setText({"fits": "✓", "over": "✗", "neutral": "?"}[self._state])
        self.text.setText(per_gpu_headline(result))
        est = result.estimate
        facts = (f"Largest object at the peak: {OBJECT_LABELS[est.dominant_object].lower()} "
                 f"({result.size(est.peak.objects[est.dominant_object])}). Tensor peak, what "
                 f"max_memory_allocated would show: {result.size(est.peak_tensor_bytes)}.")
        # the headline names the peak and its largest object; the details (tensor peak, per-GPU reasons) fold
        # behind "Why?" so the chart keeps its phase names and the ledger its rows on a 1280×720 screen
        detail = ""
        if is_per_gpu(result):
            detail = f"Per GPU: {parallel_label(result.setup)}."
            stages = pipeline_text(result)
            if stages:
                detail += f" {stages}."
        host = host_text(result)  # offloaded state, or offloaded activations on one GPU too
        if host:
            detail += f" {host}."
        reasons = est.details.get("parallel_notes") or ()
        extra = " ".join([facts, *(f"{r}." for r in reasons)])
        for warning in result.warnings:
            detail += f" ⚠ {warning}"
        self.detail.setText(detail.strip())
        self.detail.setVisible(bool(detail))
        self.extra.setText(extra)
        self.more.setVisible(bool(extra))
        self.extra.setVisible(bool(extra) and self.more.isChecked())
        self._restyle()

    def _toggle_extra(self, shown: bool) -> None:
        self.more.setText("Why? ▾" if shown else "Why? ▸")
        self.extra.setVisible(shown and bool(self.extra.text()))

    def full_text(self) -> str:
        """Everything the banner says, folded part included (tests, accessibility)."""
        return " ".join(t for t in (self.text.text(), self.detail.text(), self.extra.text(), self.stale_note.text())
                        if t)

    def set_stale(self, stale: bool, reason: str = "") -> None:
        """Mark the drawn result as belonging to the last valid inputs (an input is invalid now)."""
        if stale == self._stale and (not stale or reason == self.toolTip()):
            return
        self._stale = stale
        self.setToolTip(reason if stale else "")
        shown = "Showing the last valid setup — " if self.text.text() else ""  # none yet: a fit before the first
        self.stale_note.setText(f"{shown}{reason}" if stale else "")
        self.stale_note.setVisible(stale)
        self._restyle()

    def state(self) -> str:
        return self._state

    def _restyle(self) -> None:
        color = {"fits": FIT_COLOR, "over": OVER_COLOR, "neutral": NEUTRAL_COLOR}[self._state]
        border = "dashed" if self._stale else "solid"
        css = (f"#verdictBanner {{ background: {tinted(color, 46)}; border: 2px {border} {color}; "
               f"border-radius: 6px; }} #verdictMark {{ color: {color}; }}")
        if css != self.styleSheet():
            self.setStyleSheet(css)


class SuggestionCard(QFrame):
    """A clickable, focusable card: a word-wrapped title and description. Enter/Space/click emit ``clicked``."""

    clicked = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("suggestionCard")
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self.setCursor(Qt.CursorShape.PointingHandCursor)
        self.setAttribute(Qt.WidgetAttribute.WA_Hover, True)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 5, 8, 6)
        lay.setSpacing(1)
        self.title = QLabel("")
        self.title.setWordWrap(True)
        f = self.title.font()
        f.setBold(True)
        self.title.setFont(f)
        self.description = QLabel("")
        self.description.setWordWrap(True)
        self.tradeoff = QLabel("")
        self.tradeoff.setObjectName("suggestionTradeoff")
        self.tradeoff.setWordWrap(True)
        self.tradeoff.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        lay.addWidget(self.title)
        lay.addWidget(self.description)
        lay.addWidget(self.tradeoff)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Minimum)
        self.setStyleSheet(
            "#suggestionCard { border: 1px solid palette(mid); border-radius: 5px; }"
            "#suggestionCard:hover { border: 1px solid palette(highlight); background: palette(alternate-base); }"
            "#suggestionCard:focus { border: 2px solid palette(highlight); }"
        )

    def set_content(self, title: str, description: str, fits: bool | None, tradeoff: str = "") -> None:
        mark = "" if fits is None else ("✓ " if fits else "")
        self.title.setText(mark + title)
        self.description.setText(description)
        self.tradeoff.setText(f"Trade-off: {tradeoff}." if tradeoff else "")
        self.tradeoff.setVisible(bool(tradeoff))
        self.setAccessibleName(title)
        self.setAccessibleDescription(f"{description} {self.tradeoff.text()}".strip())

    def text(self) -> str:
        return self.title.text()

    def click(self) -> None:
        self.clicked.emit()

    def mouseReleaseEvent(self, event: QMouseEvent) -> None:
        if event.button() == Qt.MouseButton.LeftButton and self.rect().contains(event.position().toPoint()):
            self.clicked.emit()
            event.accept()
            return
        super().mouseReleaseEvent(event)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Space, Qt.Key.Key_Return, Qt.Key.Key_Enter):
            self.clicked.emit()
            event.accept()
            return
        super().keyPressEvent(event)


class WrappedLabel(QLabel):
    """A word-wrapped label that keeps the height its text needs at its width: a layout short of room (the window at
    1280 × 720) otherwise squeezes a plain one below it and cuts its last line off (the GPU plan's "per GPU)")."""

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setWordWrap(True)

    def _keep_height(self) -> None:
        height = self.heightForWidth(self.width()) if self.width() > 0 else -1
        self.setMinimumHeight(max(height, 0))  # -1: no text to wrap

    def setText(self, text: str) -> None:
        super().setText(text)
        self._keep_height()

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._keep_height()


class AdvicePanel(QWidget):
    """The largest micro-batch that fits and the ranked suggestions; clicking one applies it."""

    apply_changes = Signal(str, dict)  # title, setup changes

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("advicePanel")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.setSpacing(6)
        row = QHBoxLayout()
        self.max_batch = QLabel("")
        self.max_batch.setObjectName("maxMicroBatch")
        self.max_batch.setWordWrap(True)
        row.addWidget(self.max_batch, 1)
        self.use_max = QPushButton("Use it")
        self.use_max.setObjectName("useMaxBatch")
        self.use_max.setToolTip("Set the micro-batch to the largest that fits (Ctrl+Z undoes)")
        self.use_max.clicked.connect(self._use_max)
        self.use_max.setVisible(False)  # until a result has a larger micro-batch to use
        row.addWidget(self.use_max)
        lay.addLayout(row)
        self.heading = QLabel("Changes that fit first, cheapest for the run first; click one to apply it (Ctrl+Z "
                              "undoes).")
        self.heading.setVisible(False)  # said by the box's title and tooltip: the cards get the room
        area = QScrollArea()
        area.setWidgetResizable(True)
        area.setFrameShape(QFrame.Shape.NoFrame)
        area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        inner = QWidget()
        self._list = QVBoxLayout(inner)
        self._list.setContentsMargins(0, 0, 0, 0)
        self._list.setSpacing(4)
        # the GPU plan of a distributed setup (core.solver.gpu_plan): fewest GPUs per strategy, best strategy; it
        # scrolls with the cards below it (at 1280 × 720 the box is too short for both: a plan above the scrolled
        # cards lost its last line, under its button)
        self.plan = WrappedLabel("")
        self.plan.setObjectName("gpuPlan")
        self.plan.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.plan.setToolTip("The fewest GPUs of the chosen kind each strategy needs (same micro-batch, offload "
                             "and GPU), and the strategy with the least communication that fits at the current "
                             "GPU count (order: DDP, ZeRO-1, ZeRO-2, FSDP shard-grad-op, hybrid, ZeRO-3, FSDP "
                             "full shard).")
        self._list.addWidget(self.plan)
        self.use_plan = QPushButton("")
        self.use_plan.setObjectName("usePlan")
        self.use_plan.clicked.connect(self._use_plan)
        self._list.addWidget(self.use_plan, 0, Qt.AlignmentFlag.AlignLeft)
        self.plan.setVisible(False)
        self.use_plan.setVisible(False)
        self._plan_action: tuple[str, dict[str, Any]] | None = None
        self.buttons: list[SuggestionCard] = []
        self.still_over = QLabel(STILL_OVER_HEADING)
        self.still_over.setObjectName("stillOverHeading")
        self.still_over.setWordWrap(True)
        bold = self.still_over.font()
        bold.setBold(True)
        self.still_over.setFont(bold)
        self.still_over.setContentsMargins(0, 6, 0, 0)
        self.still_over.setVisible(False)
        for _ in range(MAX_SUGGESTIONS):
            b = SuggestionCard()
            b.setVisible(False)
            b.clicked.connect(self._clicked)
            self._list.addWidget(b)
            self.buttons.append(b)
        self.empty = QLabel("")
        self.empty.setWordWrap(True)
        self._list.addWidget(self.empty)
        self._list.addStretch(1)
        area.setWidget(inner)
        lay.addWidget(area, 1)
        self._suggestions: tuple[Suggestion, ...] = ()
        self._max: int | None = None
        self._batch = 0

    def set_result(self, result: Result) -> None:
        v = result.verdict
        setup = result.setup
        self._batch = setup.batch
        self._max = v.max_micro_batch
        self._max_changes: dict[str, Any] = {}
        if v.capacity_bytes is None or v.max_micro_batch is None:
            self.max_batch.setText("Largest micro-batch that fits: choose a GPU or a capacity.")
            self.use_max.setVisible(False)
        elif v.max_micro_batch == 0:
            self.max_batch.setText(f"Largest micro-batch that fits: none — even micro-batch 1 at sequence length "
                                   f"{setup.seq:,} is over {result.size(v.capacity_bytes)}.")
            self.use_max.setVisible(False)
        else:
            note = " (the current one)" if v.max_micro_batch == setup.batch else ""
            self.max_batch.setText(f"Largest micro-batch that fits: <b>{v.max_micro_batch}</b>{note}.")
            self.max_batch.setToolTip(f"At sequence length {setup.seq:,}, with everything else as set.")
            self._max_changes = micro_batch_changes(setup, v.max_micro_batch)
            b = self._max_changes["batch"]
            k = self._max_changes.get("grad_accum", setup.grad_accum)
            self.use_max.setText(f"Use micro-batch {b} × {k}" if "grad_accum" in self._max_changes else
                                 f"Use micro-batch {b} (effective batch {b * k})")
            self.use_max.setToolTip("Keeps the effective batch (micro-batch × accumulation) where a divisor allows"
                                    if "grad_accum" in self._max_changes else
                                    f"The effective batch changes from {setup.effective_batch} to {b * k}")
            self.use_max.setVisible(self._max_changes.get("batch") != setup.batch)
        self._set_plan(result)
        self._suggestions = v.suggestions[:MAX_SUGGESTIONS]
        for i, b in enumerate(self.buttons):
            if i < len(self._suggestions):
                s = self._suggestions[i]
                figures = suggestion_figures(s, result)
                b.set_content(s.title, figures[0].upper() + figures[1:], s.fits, s.tradeoff)
                b.setToolTip(f"Saves {result.size(s.saves_bytes)} at the peak. Applies: {format_changes(s.changes)}")
                b.setVisible(True)
            else:
                b.setVisible(False)
        # the cards that fit come first (cheapest for the run first); a heading before those that leave it over
        heading = first_still_over(result)
        self._list.removeWidget(self.still_over)
        if heading is not None and heading < len(self._suggestions):
            self._list.insertWidget(self._list.indexOf(self.buttons[heading]), self.still_over)
        self.still_over.setVisible(heading is not None and heading < len(self._suggestions))
        note = suggestions_note(result)
        self.empty.setText(note)
        self.empty.setVisible(bool(note))

    def _set_plan(self, result: Result) -> None:
        sentences = plan_sentences(result)  # the host memory is in the banner, right above
        self.plan.setText(" ".join(sentences))
        self.plan.setVisible(bool(sentences))
        self._plan_action = plan_action(result)
        if self._plan_action is not None:
            title, changes = self._plan_action
            self.use_plan.setText(title)
            self.use_plan.setToolTip(f"Applies: {format_changes(changes)} (Ctrl+Z undoes)")
        self.use_plan.setVisible(self._plan_action is not None)

    def plan_text(self) -> str:
        return self.plan.text() if self.plan.isVisibleTo(self) else ""

    def _use_plan(self) -> None:
        if self._plan_action is not None:
            title, changes = self._plan_action
            self.apply_changes.emit(title, dict(changes))

    def suggestions(self) -> tuple[Suggestion, ...]:
        return self._suggestions

    def apply(self, index: int) -> None:
        s = self._suggestions[index]
        self.apply_changes.emit(s.title, dict(s.changes))

    def _clicked(self) -> None:
        sender = self.sender()
        if sender in self.buttons:
            self.apply(self.buttons.index(sender))

    def _use_max(self) -> None:
        if self._max and self._max_changes:
            self.apply_changes.emit(self.use_max.text(), dict(self._max_changes))


def format_changes(changes: dict[str, Any]) -> str:
    return ", ".join(f"{k} = {v}" for k, v in changes.items())
