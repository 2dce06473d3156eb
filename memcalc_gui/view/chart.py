"""The phase chart: one stacked bar per phase, one segment per ledger object, a capacity line.

Every plot item is created once and updated in place (``setOpts``/``setData``); an estimate never
rebuilds the scene. Values are drawn in the result's one unit, ``units.result_unit``: GiB (2**30) on any GPU, or
the larger binary unit of a capacity (without one, a peak) past 1 TiB; the ledger table and the verdict use the same,
and the axis never switches to SI prefixes.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Mapping

import numpy as np
import pyqtgraph as pg
from pyqtgraph.graphicsItems.LegendItem import ItemSample
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QColor, QCursor, QFont, QFontMetrics, QPalette, QTextDocument
from PySide6.QtWidgets import QToolTip, QWidget

from ..core.ledger import Estimate
from ..core.units import format_bytes, in_unit, result_unit
from ..core.vocab import OBJECT_LABELS, OBJECTS, PHASE_LABELS, PHASES, UNIFIED_OBJECTS
from .theme import OBJECT_COLORS, STACK_ORDER, is_dark

BAR_WIDTH = 0.6
X = np.arange(len(PHASES), dtype=float)
#: Where the estimate of a scaled-down measured setup is drawn: a narrow outlined bar right of each phase.
REF_DX = 0.38
REF_WIDTH = 0.1
#: How far (px) a phase name may run past the ends of the bottom axis before pyqtgraph hides it.
OVERFLOW_PX = 48
#: Phase names from the longest to the shortest; the chart uses the first whose names fit one bar's slot.
TICK_VARIANTS = (
    dict(PHASE_LABELS),
    dict(PHASE_LABELS) | {"optimizer_step": "Opt. step"},
    {"load": "Load", "forward": "Fwd.", "backward": "Bwd.", "optimizer_step": "Opt."},
)
AXIS_LABEL = "Memory (GiB)"
AXIS_TEMPLATE = "Memory ({unit})"
AXIS_TEMPLATE_PER_GPU = "Memory per GPU ({unit})"
#: The value axis starts a little below zero so its "0" label is drawn (pyqtgraph drops a label it cannot fit).
ZERO_MARGIN = 0.03
AXIS_LABEL_PER_GPU = "Memory per GPU (GiB)"
#: Where a long chart title may break: after "64 GPUs:", between a layout's dimensions, after a comma.
TITLE_BREAKS = re.compile(r"(?<=: )|(?<= × )|(?<=, )")
#: The most lines the title takes from the plot; a last line that still does not fit ends in "…".
TITLE_MAX_LINES = 3
TITLE_SIZE = "9pt"
#: Where the capacity text may sit along its line, the first free one taken: (position along the line, the text's
#: own point there: 0 its left end, 1 its right end, 0.5 its middle): the left, the right, between the bars.
CAPACITY_PLACES = ((0.02, 0.0), (0.98, 1.0), (0.5, 0.5), (0.25, 0.5), (0.75, 0.5))


class _StaticSample(ItemSample):
    """A legend swatch that does not hide its bars when clicked (a hidden segment would leave a gap)."""

    def mouseClickEvent(self, event):
        event.ignore()


class _TitleLabel(pg.LabelItem):
    """pyqtgraph's label, asking for no width of its own: the chart breaks the title's lines to the plot."""

    def updateMin(self) -> None:
        super().updateMin()
        self.setMinimumWidth(0)
        self._sizeHint[Qt.SizeHint.MinimumSize] = (0, self._sizeHint[Qt.SizeHint.MinimumSize][1])
        self._sizeHint[Qt.SizeHint.PreferredSize] = (0, self._sizeHint[Qt.SizeHint.PreferredSize][1])
        self.updateGeometry()


class MemoryChart(pg.GraphicsLayoutWidget):
    """Stacked bars of an :class:`Estimate` against a capacity."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("memoryChart")
        self.setMinimumSize(360, 180)  # short enough that the ledger keeps its rows on a 1280×720 screen
        self.setAccessibleName("Memory per phase chart")
        self.ci.setContentsMargins(6, 8, 6, 4)
        self.plot: pg.PlotItem = self.addPlot(row=0, col=0)
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.showGrid(x=False, y=True, alpha=0.25)
        vb = self.plot.getViewBox()
        vb.setDefaultPadding(0.0)
        left = self.plot.getAxis("left")
        left.enableAutoSIPrefix(False)
        left.setLabel(AXIS_LABEL)
        left.setWidth(64)
        left.setStyle(hideOverlappingLabels=False)
        bottom = self.plot.getAxis("bottom")
        bottom.enableAutoSIPrefix(False)
        # "(peak)" goes on a second line, and the outer names may run a little past the plot's edge rather
        # than vanish (pyqtgraph drops a tick label that does not fit its axis' rectangle)
        bottom.setStyle(tickLength=0, hideOverlappingLabels=OVERFLOW_PX)
        self._fit_bottom_axis()
        # the title's size follows its lines, not its text (pyqtgraph's label asks for its text's full width,
        # so a long layout would push the plot over the legend)
        self.plot.layout.removeItem(self.plot.titleLabel)
        if self.plot.scene() is not None:
            self.plot.scene().removeItem(self.plot.titleLabel)
        self.plot.titleLabel = _TitleLabel("", size="11pt", parent=self.plot)
        self.plot.layout.addItem(self.plot.titleLabel, 0, 1)
        self.plot.setTitle(None)
        self.plot.setXRange(-0.55, len(PHASES) - 0.45, padding=0)

        # Peak highlight: a pale band behind the peak bar and an outline around it.
        self.peak_band = pg.BarGraphItem(x=[0.0], height=[1.0], y0=[0.0], width=0.86,
                                         brush=QColor(255, 200, 0, 40), pen=pg.mkPen(None))
        self.peak_band.setZValue(-20)
        self.peak_band.setVisible(False)  # until the first estimate (a config being fitted has none yet)
        self.plot.addItem(self.peak_band)

        zeros = np.zeros(len(PHASES))
        self.bars: dict[str, pg.BarGraphItem] = {}
        for obj in STACK_ORDER:
            bar = pg.BarGraphItem(x=X, height=zeros, y0=zeros, width=BAR_WIDTH, brush=QColor(OBJECT_COLORS[obj]),
                                  pen=pg.mkPen(QColor(0, 0, 0, 90), width=1))
            bar.setZValue(0)
            self.plot.addItem(bar)
            self.bars[obj] = bar

        self.peak_outline = pg.BarGraphItem(x=[0.0], height=[0.0], y0=[0.0], width=BAR_WIDTH + 0.04,
                                            brush=QColor(0, 0, 0, 0), pen=pg.mkPen("k", width=2.5))
        self.peak_outline.setZValue(5)
        self.peak_outline.setVisible(False)
        self.plot.addItem(self.peak_outline)

        self.capacity_line = pg.InfiniteLine(angle=0, movable=False,
                                             pen=pg.mkPen("#C62828", width=2, style=Qt.PenStyle.DashLine))
        self.capacity_label = pg.InfLineLabel(self.capacity_line, text="", position=0.02, anchors=[(0, 1), (0, 1)],
                                              color="#C62828", fill=pg.mkBrush(255, 255, 255, 220))
        self.capacity_line.setZValue(10)
        self.capacity_line.setVisible(False)
        self.plot.addItem(self.capacity_line)
        bottom.setTicks([[(float(i), TICK_VARIANTS[0][p]) for i, p in enumerate(PHASES)]])  # before any estimate
        self.plot.setYRange(0.0, 1.0, padding=0)

        self.total_labels: list[pg.TextItem] = []
        for i in range(len(PHASES)):
            label = pg.TextItem("", anchor=(0.5, 1.0))
            label.setPos(float(i), 0.0)
            label.setZValue(11)
            self.plot.addItem(label)
            self.total_labels.append(label)

        # Measured markers ("Measure on this GPU"; hidden until a measurement) and, when the measured setup
        # was scaled down, that setup's estimate as narrow outlined bars beside each phase.
        self.measured = pg.ScatterPlotItem(x=[], y=[], symbol="d", size=14,
                                           pen=pg.mkPen("k", width=1.5), brush=pg.mkBrush("#FFFFFF"))
        self.measured.setZValue(12)
        self.measured.setVisible(False)
        self.plot.addItem(self.measured)
        self.measured_ref = pg.BarGraphItem(x=X + REF_DX, height=zeros, y0=zeros, width=REF_WIDTH,
                                            brush=QColor(0, 0, 0, 0),
                                            pen=pg.mkPen("k", width=1.5, style=Qt.PenStyle.DashLine))
        self.measured_ref.setZValue(11)
        self.measured_ref.setVisible(False)
        self.plot.addItem(self.measured_ref)
        self._measured: dict[str, int] = {}
        self._measured_ref: dict[str, int] = {}

        self.legend = pg.LegendItem(offset=None, sampleType=_StaticSample, labelTextSize="9pt",
                                    verSpacing=-2, frame=False)
        side = self.ci.addLayout(row=0, col=1)
        side.addItem(self.legend, row=0, col=0)
        side.layout.setRowStretchFactor(1, 1)
        side.addLabel("", row=1, col=0)
        width = max(self.fontMetrics().horizontalAdvance(OBJECT_LABELS[o]) for o in OBJECTS)
        side.setMaximumWidth(width + 48)
        self._legend_side = side
        self._legend_width = width + 48
        self.ci.layout.setColumnStretchFactor(0, 1)
        self._legend_objects: tuple[str, ...] = ()
        self._fill_legend(())

        self._estimate: Estimate | None = None
        self._scope: str | None = None
        self._title_color = QColor(0, 0, 0)
        self._y_span = (0.0, 1.0)  # the value axis' range the estimate set
        self._title_lines: tuple[str, ...] = ()
        self.unit = "GiB"
        self._peak_i = 0
        self._ticks: list[tuple[float, str]] = []
        self._capacity_texts: tuple[str, str] | None = None
        self._capacity: int | None = None
        self._stack: dict[str, np.ndarray] = {}
        self._y0: dict[str, np.ndarray] = {}
        self._tooltip = ""
        self.plot.scene().sigMouseMoved.connect(self._on_mouse_moved)
        vb.sigResized.connect(self._fit_labels)
        self._ready = True
        self._apply_palette()

    # ---- data ----------------------------------------------------------------------------------
    def set_estimate(self, estimate: Estimate, capacity_bytes: int | None, capacity_name: str = "", *,
                     per_gpu: str | None = None) -> None:
        """Draw ``estimate`` (updates the existing items in place).

        ``per_gpu``: the ledger is one GPU's of several (a distributed setup); the text (e.g. "32 × H100,
        ZeRO-3") becomes the chart's title and the axis says "per GPU". ``None``: a single GPU."""
        self._estimate = estimate
        self._fill_legend(tuple(o for o in UNIFIED_OBJECTS if any(estimate.object_bytes(o).values())))
        self.unit = result_unit(estimate.peak_bytes, capacity_bytes)  # the verdict's and the ledger's unit
        self._set_scope(per_gpu)
        self._capacity = capacity_bytes
        base = np.zeros(len(PHASES))
        for obj in STACK_ORDER:
            heights = np.array([self._in(estimate.phases[p].objects[obj]) for p in PHASES])
            self._y0[obj] = base.copy()
            self._stack[obj] = heights
            self.bars[obj].setOpts(x=X, y0=base.copy(), height=heights, width=BAR_WIDTH)
            base = base + heights
        totals = base
        peak_i = PHASES.index(estimate.peak_phase)
        peak_total = float(totals[peak_i])
        top = max(peak_total, self._in(capacity_bytes) if capacity_bytes else 0.0)
        ymax = top * 1.14 if top > 0 else 1.0
        self.peak_band.setOpts(x=[float(peak_i)], y0=[0.0], height=[ymax], width=0.86)
        self.peak_outline.setOpts(x=[float(peak_i)], y0=[0.0], height=[peak_total], width=BAR_WIDTH + 0.04)
        self.peak_band.setVisible(True)
        self.peak_outline.setVisible(True)

        self._peak_i = peak_i
        for i, label in enumerate(self.total_labels):
            font = QFont(self.font())
            font.setBold(i == peak_i)
            label.setFont(font)
            label.setPos(float(i), float(totals[i]) + ymax * 0.005)

        if capacity_bytes:
            self.capacity_line.setPos(self._in(capacity_bytes))
            name = f"{capacity_name} capacity" if capacity_name else "Capacity"
            if per_gpu is not None:
                name += " per GPU"
            self._capacity_texts = (f"{name}: {format_bytes(capacity_bytes)}",
                                    f"Capacity: {format_bytes(capacity_bytes)}")
            self.capacity_line.setVisible(True)
        else:
            self.capacity_line.setVisible(False)

        self._y_span = (-ymax * ZERO_MARGIN, ymax)
        self._fit_labels()
        self.plot.setYRange(-ymax * ZERO_MARGIN, ymax, padding=0)
        self.plot.setXRange(-0.55, len(PHASES) - 0.45, padding=0)
        self._layout_measured()

    def _fill_legend(self, present: tuple[str, ...]) -> None:
        """Every object, top-down like the bars; the paged optimizer state only when a setup has it."""
        shown = tuple(o for o in reversed(STACK_ORDER) if o not in UNIFIED_OBJECTS or o in present)
        if shown == self._legend_objects:
            return
        self.legend.clear()
        for obj in shown:
            self.legend.addItem(self.bars[obj], OBJECT_LABELS[obj])
        self._legend_objects = shown

    def legend_labels(self) -> list[str]:
        return [OBJECT_LABELS[o] for o in self._legend_objects]

    def _in(self, nbytes: int | float) -> float:
        """Bytes in the chart's unit."""
        return in_unit(nbytes, self.unit)

    def _fit_labels(self, *_: object) -> None:
        """Phase names, totals and the capacity text that fit the plot's current width.

        A narrow plot (a narrow window, a wide legend) gets shorter phase names ("Opt. step") and totals
        without the unit, so nothing runs into a neighbour or past the plot's edge."""
        self._fit_title()
        est = self._estimate
        if est is None:
            return
        vb = self.plot.getViewBox()
        width = float(vb.width()) or float(self.width()) * 0.6
        slot = width / (len(PHASES) + 0.1)
        axis = self.plot.getAxis("bottom")
        fm = QFontMetrics(axis.style.get("tickFont") or self.font())
        names = TICK_VARIANTS[-1]
        for variant in TICK_VARIANTS:
            if max(fm.horizontalAdvance(n) for n in variant.values()) <= slot - 6:
                names = variant
                break
        ticks = [(float(i), names[p] + ("\n(peak)" if i == self._peak_i else "")) for i, p in enumerate(PHASES)]
        if ticks != self._ticks:
            self._ticks = ticks
            axis.setTicks([ticks])
        color = self._text_color()
        for i, label in enumerate(self.total_labels):
            value = self._in(est.phases[PHASES[i]].total_bytes)
            bold = QFontMetrics(label.textItem.font())
            text = f"{value:.2f} {self.unit}"
            for candidate in (f"{value:.2f} {self.unit}", f"{value:.2f}", f"{value:.0f}"):
                text = candidate
                if bold.horizontalAdvance(candidate) <= slot * 1.05:
                    break
            if label.toPlainText() != text:
                label.setText(text, color=color)
        if self.capacity_line.isVisible() and self._capacity_texts:
            full, short = self._capacity_texts
            value = short.split(": ", 1)[-1]
            texts = (full, short, value) if QFontMetrics(self.font()).horizontalAdvance(full) + 12 <= width * 0.96 \
                else (short, value)
            self._place_capacity_label(texts)

    def _place_capacity_label(self, texts: tuple[str, ...]) -> None:
        """The capacity text where it covers no bar's total: the first of ``texts`` (the full, the short one, the
        bare value) that fits above the line, else below it, at the first of :data:`CAPACITY_PLACES` where it does;
        where none does, the bare value where it covers the least (a peak just under the capacity put its total
        under the text)."""
        est, vb = self._estimate, self.plot.getViewBox()
        width, height = float(vb.width()), float(vb.height())
        label = self.capacity_label
        if est is None or self._capacity is None or width <= 0 or height <= 0:
            if label.format != texts[-1]:
                label.setFormat(texts[-1])
            return
        (x0, x1), (y0, y1) = (-0.55, len(PHASES) - 0.45), self._y_span
        px_x, px_y = width / (x1 - x0), height / (y1 - y0)  # pixels per unit
        line = (self._in(self._capacity) - y0) * px_y  # pixels above the axis' bottom
        boxes = []  # the totals' text, in pixels from the view's bottom-left
        for i, total in enumerate(self.total_labels):
            size = total.textItem.boundingRect()
            bottom = (self._in(est.phases[PHASES[i]].total_bytes) - y0) * px_y
            left = (i - x0) * px_x - size.width() / 2
            boxes.append((left, left + size.width(), bottom, bottom + size.height()))

        def covered(text_w: float, text_h: float, position: float, side: float, above: bool) -> float:
            """The area of the totals the text would cover (3 px kept around each); infinite outside the plot."""
            left = position * width - side * text_w
            low = line if above else line - text_h
            if left < 0 or left + text_w > width:
                return float("inf")
            gap = 3
            return sum(max(0.0, min(left + text_w, b + gap) - max(left, a - gap))
                       * max(0.0, min(low + text_h, d + gap) - max(low, c - gap)) for a, b, c, d in boxes)

        places = [(position, side, above) for position, side in CAPACITY_PLACES for above in (True, False)]
        place: tuple[str, float, float, bool] | None = None
        probe = QTextDocument()  # the label's own layout (its font, its document's margins), the label untouched
        probe.setDefaultFont(label.textItem.font())
        probe.setDocumentMargin(label.textItem.document().documentMargin())
        for text in texts:
            probe.setPlainText(text)
            size = probe.size()
            areas = [covered(size.width(), size.height(), *where) for where in places]
            if min(areas) == 0:
                place = (text, *places[areas.index(0)])
                break
        if place is None:  # nowhere free even for the bare value: where it covers the least
            place = (texts[-1], *places[areas.index(min(areas))]) if min(areas) < float("inf") \
                else (texts[-1], 0.02, 0.0, True)
        text, position, side, above = place
        if label.format != text:
            label.setFormat(text)
        anchor = (side, 1 if above else 0)
        if self.capacity_label.anchors[0] != anchor or self.capacity_label.orthoPos != position:
            self.capacity_label.anchors = [anchor, anchor]
            self.capacity_label.setPosition(position)

    def capacity_label_place(self) -> tuple[float, bool]:
        """Where the capacity text sits: its position along the line (0 left, 1 right), and whether above it
        (tests)."""
        return self.capacity_label.orthoPos, self.capacity_label.anchors[0][1] == 1

    def tick_labels(self) -> list[str]:
        """The phase names drawn under the bars (tests)."""
        return [t for _x, t in self._ticks]

    def _set_scope(self, per_gpu: str | None) -> None:
        label = (AXIS_TEMPLATE if per_gpu is None else AXIS_TEMPLATE_PER_GPU).format(unit=self.unit)
        if per_gpu == self._scope and label == self.axis_label():
            return
        self._scope = per_gpu
        self.plot.getAxis("left").setLabel(label)
        if per_gpu is None:
            self.plot.setTitle(None)
        else:
            self._show_title(self._text_color())
        self.setAccessibleName("Memory per GPU per phase chart" if per_gpu is not None else "Memory per phase chart")

    def _show_title(self, color: QColor) -> None:
        self._title_color = color
        self._title_lines = ()
        self._fit_title()

    def _fit_title(self) -> None:
        """The title on one line when it fits over the plot, else broken where a layout's parts meet (at most
        ``TITLE_MAX_LINES``, the last elided if it still does not fit): a long layout ("CP 2 × TP 4 + SP …
        (2 replicas)") must neither run past the chart's edge nor widen the plot over the legend."""
        if self._scope is None:
            return
        text = f"Per GPU — {self._scope}"
        item = self.plot.titleLabel.item
        probe = QTextDocument()
        probe.setDefaultFont(item.font())

        def width(line: str) -> float:  # as the label's document lays it out (its HTML sets the size in pt)
            probe.setHtml(f"<span style='font-size: {TITLE_SIZE}'>{html.escape(line)}</span>")
            return float(probe.idealWidth())

        room = max(float(self.plot.getViewBox().width()) or float(self.width()) * 0.6, 80.0) - 8
        lines: tuple[str, ...] = (text,)
        if width(text) > room:
            broken = [""]
            for piece in TITLE_BREAKS.split(text):  # each piece ends with its separator
                if broken[-1] and width((broken[-1] + piece).rstrip()) > room:
                    broken.append("")
                broken[-1] += piece
            kept = [*broken[:TITLE_MAX_LINES - 1], "".join(broken[TITLE_MAX_LINES - 1:])]
            lines = tuple(self._elide(line.rstrip(), room, width) for line in kept if line)
        if lines == self._title_lines:
            return
        self._title_lines = lines
        self.plot.setTitle("<br>".join(html.escape(line) for line in lines), size=TITLE_SIZE, color=self._title_color)
        item.setTextWidth(max(width(line) for line in lines) + 4)
        option = item.document().defaultTextOption()
        option.setAlignment(Qt.AlignmentFlag.AlignHCenter)
        item.document().setDefaultTextOption(option)
        height = 30 if len(lines) == 1 else round(item.boundingRect().height()) + 6
        self.plot.titleLabel.setMaximumHeight(height)
        self.plot.layout.setRowFixedHeight(0, height)
        self.plot.titleLabel.resizeEvent(None)

    @staticmethod
    def _elide(line: str, room: float, width: Callable[[str], float]) -> str:
        """``line``, cut short with "…" where it is wider than ``room``."""
        if width(line) <= room:
            return line
        words = line.split(" ")
        while len(words) > 1 and width(" ".join(words) + " …") > room:
            words.pop()
        kept = " ".join(words)
        while len(kept) > 1 and width(kept + " …") > room:  # one word wider than the plot: cut inside it
            kept = kept[:-1]
        return kept + " …"

    def title_text(self) -> str:
        """The chart's title as one line ("" when hidden; tests)."""
        return " ".join(self._title_lines) if self.plot.titleLabel.isVisible() else ""

    def title_lines(self) -> tuple[str, ...]:
        """The title's lines as drawn (tests)."""
        return self._title_lines if self.plot.titleLabel.isVisible() else ()

    def axis_label(self) -> str:
        return str(self.plot.getAxis("left").labelText)

    def _fit_bottom_axis(self) -> None:
        """Room for two lines of phase names (the peak's "(peak)" is the second)."""
        axis = self.plot.getAxis("bottom")
        font = axis.style.get("tickFont") or self.font()
        axis.setHeight(2 * QFontMetrics(font).height() + 8)

    def set_measured(self, measured: Mapping[str, int] | None, *, label: str = "Measured",
                     reference: Mapping[str, int] | None = None) -> None:
        """Overlay measured tensor peaks (phase → bytes) as markers; ``None`` or empty hides them.

        Without ``reference`` the markers sit on the drawn bars, at the CUDA context plus the measured
        tensor peak: level with the top of the estimated tensors, below the allocator reserve. With
        ``reference`` (phase → estimated tensor bytes of a scaled-down setup that was measured instead),
        that estimate is drawn as narrow outlined bars beside each phase and the markers sit on them.
        ``label`` is the legend entry, e.g. "Measured (NVIDIA H100 80GB HBM3)".
        """
        self._measured = {p: int(b) for p, b in (measured or {}).items() if p in PHASES}
        self._measured_ref = {p: int(b) for p, b in (reference or {}).items() if p in PHASES} \
            if self._measured else {}
        for item in (self.measured, self.measured_ref):
            self.legend.removeItem(item)
        width = self._legend_width
        if self._measured:
            self.legend.addItem(self.measured, label)
            width = max(width, self.fontMetrics().horizontalAdvance(label) + 48)
            if self._measured_ref:
                ref_label = "Estimate of the measured setup"
                self.legend.addItem(self.measured_ref, ref_label)
                width = max(width, self.fontMetrics().horizontalAdvance(ref_label) + 48)
        self._legend_side.setMaximumWidth(width)
        self._layout_measured()

    def measured_points(self) -> list[tuple[float, float]]:
        """The drawn markers as (x, value in the chart's unit) pairs (tests)."""
        if not self.measured.isVisible():
            return []
        return [(float(p.pos().x()), float(p.pos().y())) for p in self.measured.points()]

    def _layout_measured(self) -> None:
        if not self._measured:
            self.measured.setData(x=[], y=[])
            self.measured.setVisible(False)
            self.measured_ref.setVisible(False)
            return
        phases = [p for p in PHASES if p in self._measured]
        ys = [self._in(self._measured[p]) for p in phases]
        if self._measured_ref:
            xs = [PHASES.index(p) + REF_DX for p in phases]
            ref = [self._in(self._measured_ref.get(p, 0)) for p in phases]
            self.measured_ref.setOpts(x=xs, y0=[0.0] * len(xs), height=ref, width=REF_WIDTH)
            self.measured_ref.setVisible(True)
            tops = ys + ref
        else:
            xs = [float(PHASES.index(p)) for p in phases]
            if self._estimate is not None:
                est = self._estimate
                ys = [y + self._in(est.phases[p].objects["cuda_context"]) for p, y in zip(phases, ys, strict=True)]
            self.measured_ref.setVisible(False)
            tops = ys
        self.measured.setData(x=xs, y=ys)
        self.measured.setVisible(True)
        ymax = self.plot.getViewBox().viewRange()[1][1]
        if tops and max(tops) * 1.04 > ymax:
            top = max(tops) * 1.12
            self.plot.setYRange(-top * ZERO_MARGIN, top, padding=0)

    # ---- queries (also used by tests) ------------------------------------------------------------
    def heights(self) -> dict[str, list[float]]:
        """The drawn segment heights in the chart's unit (GiB unless the peak passes 1 TiB), object → per phase."""
        return {obj: [float(v) for v in self.bars[obj].opts["height"]] for obj in OBJECTS}

    def segment_at(self, x: float, y: float) -> tuple[str, str] | None:
        """The (object, phase) under a point in data coordinates, if any."""
        if self._estimate is None:
            return None
        i = round(x)
        if not 0 <= i < len(PHASES) or abs(x - i) > BAR_WIDTH / 2:
            return None
        for obj in STACK_ORDER:
            h = self._stack[obj][i]
            y0 = self._y0[obj][i]
            if h > 0 and y0 <= y <= y0 + h:
                return obj, PHASES[i]
        return None

    def tooltip_text(self, obj: str, phase: str) -> str:
        assert self._estimate is not None
        n = self._estimate.phases[phase].objects[obj]
        total = self._estimate.phases[phase].total_bytes
        share = n / total * 100 if total else 0.0
        return (f"<b>{OBJECT_LABELS[obj]}</b> — {PHASE_LABELS[phase]}<br>"
                f"{self._in(n):.3f} {self.unit} ({share:.1f} % of the phase)<br>{n:,} bytes")

    def measured_tooltip_at(self, scene_pos: QPointF, radius_px: float = 9.0) -> str:
        """The measured value (and the estimate's error) of the marker under a scene point, or ""."""
        if not self._measured or not self.measured.isVisible():
            return ""
        vb = self.plot.getViewBox()
        for point in self.measured.points():
            at = vb.mapViewToScene(point.pos())
            if (at - scene_pos).manhattanLength() > radius_px * 1.5:
                continue
            phase = PHASES[round(point.pos().x() - (REF_DX if self._measured_ref else 0.0))]
            measured = self._measured[phase]
            if self._measured_ref:
                against, what = self._measured_ref.get(phase, 0), "estimate of the measured (scaled-down) setup"
            elif self._estimate is not None:
                against, what = self._estimate.phases[phase].tensor_bytes, "estimated tensors"
            else:
                against, what = 0, ""
            error = ""
            if against and measured:
                error = (f"<br>{what}: {self._in(against):.2f} {self.unit} "
                         f"({(against - measured) / measured * 100:+.1f} %)")
            return (f"<b>Measured</b> — {PHASE_LABELS[phase]}<br>{self._in(measured):.2f} {self.unit} tensor peak "
                    f"(allocated){error}")
        return ""

    def _on_mouse_moved(self, pos: QPointF) -> None:
        vb = self.plot.getViewBox()
        seg = None
        text = ""
        if vb.sceneBoundingRect().contains(pos):
            text = self.measured_tooltip_at(pos)
            p = vb.mapSceneToView(pos)
            seg = None if text else self.segment_at(p.x(), p.y())
        text = text or (self.tooltip_text(*seg) if seg else "")
        if text != self._tooltip:
            self._tooltip = text
            if text:
                QToolTip.showText(QCursor.pos(), text, self)
            else:
                QToolTip.hideText()

    # ---- palette -------------------------------------------------------------------------------
    def _text_color(self) -> QColor:
        return self.palette().color(QPalette.ColorRole.WindowText)

    def _apply_palette(self) -> None:
        pal = self.palette()
        bg = pal.color(QPalette.ColorRole.Base)
        fg = pal.color(QPalette.ColorRole.WindowText)
        self.setBackground(bg)
        for name in ("left", "bottom"):
            axis = self.plot.getAxis(name)
            axis.setPen(pg.mkPen(fg))
            axis.setTextPen(pg.mkPen(fg))
        dark = is_dark(pal)
        self.peak_outline.setOpts(pen=pg.mkPen(fg, width=2.5))
        self.peak_band.setOpts(brush=QColor(255, 210, 64, 36 if dark else 48))
        sep = QColor(bg)
        sep.setAlpha(200)
        for bar in self.bars.values():
            bar.setOpts(pen=pg.mkPen(sep, width=1))
        cap = QColor("#FF6E6E") if dark else QColor("#C62828")
        self.capacity_line.setPen(pg.mkPen(cap, width=2, style=Qt.PenStyle.DashLine))
        self.capacity_label.setColor(cap)
        # an opaque-ish plate under the capacity text keeps it readable where it crosses the bars
        plate = QColor(bg)
        plate.setAlpha(225)
        self.capacity_label.fill = pg.mkBrush(plate)
        self.capacity_label.border = pg.mkPen(QColor(cap.red(), cap.green(), cap.blue(), 110), width=1)
        self.capacity_label.update()
        if self._scope is not None:
            self._show_title(fg)
        self.measured.setPen(pg.mkPen(fg, width=1.5))
        self.measured_ref.setOpts(pen=pg.mkPen(fg, width=1.5, style=Qt.PenStyle.DashLine))
        self.legend.setLabelTextColor(fg)
        for _sample, label in self.legend.items:
            label.setText(label.text)  # LabelItem re-renders only on setText
        for label in self.total_labels:
            label.setColor(fg)

    def changeEvent(self, event: QEvent) -> None:
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange) and \
                getattr(self, "_ready", False):
            self._apply_palette()
        if event.type() == QEvent.Type.FontChange and getattr(self, "_ready", False):
            self._fit_bottom_axis()
        super().changeEvent(event)
