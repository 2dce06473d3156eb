"""The memory timeline chart: live bytes by ledger object over a step, stacked, with phase bands, the capacity
line, the estimate's peak and the timeline's own peak marked.

Shared by the window's Timeline tab (and anything else that draws a :class:`~memcalc_gui.core.timeline.Timeline`).
Long timelines are reduced to at most :data:`MAX_POINTS` columns that keep every bin's highest total (the peaks
stay exact); pyqtgraph then pans and zooms them. Hovering names the live bytes, the phase and the largest live
allocations at that event.
"""

from __future__ import annotations

import gc

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QPointF, Qt, QTimer
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QWidget

from ..core.timeline import CATEGORIES, Timeline
from ..core.units import format_bytes, in_unit, screen_unit
from ..core.vocab import OBJECT_LABELS, PHASE_LABELS
from .theme import OBJECT_COLORS, OVER_COLOR, STACK_ORDER

#: The most columns drawn; every bin keeps the event where the total is highest.
MAX_POINTS = 20_000
PHASE_BAND = {"load": "#9E9E9E", "forward": "#1E88E5", "backward": "#8E24AA", "optimizer_step": "#43A047"}
UNKNOWN_COLOR = "#B0BEC5"


def unit_for(peak_bytes: int) -> str:
    """MiB under a GiB (a small model's step), else the window's unit."""
    return "MiB" if peak_bytes < 2**30 else screen_unit(peak_bytes)


def reduce_columns(total: np.ndarray, max_points: int = MAX_POINTS) -> np.ndarray:
    """Event indices to draw: all of them when few, else each bin's highest total (the peak survives)."""
    n = len(total)
    if n <= max_points:
        return np.arange(n)
    bins = -(-n // max_points)
    padded = np.full(bins * max_points, -1, dtype=np.int64)
    padded[:n] = total
    best = padded.reshape(max_points, bins).argmax(axis=1) + np.arange(max_points) * bins
    return np.asarray(best[best < n])


class _Arrays:
    """A timeline as numpy columns, built once per drawn timeline: sizes, category codes, live totals, and each
    allocation's lifetime [alloc, free) for the hover's "largest live" query (O(n) in numpy, not Python)."""

    def __init__(self, tl: Timeline) -> None:
        n = len(tl.events)
        index = {c: i for i, c in enumerate(CATEGORIES)}
        self.sizes = np.fromiter((e.size_bytes for e in tl.events), dtype=np.int64, count=n)
        self.codes = np.fromiter((index[e.category] for e in tl.events), dtype=np.int16, count=n)
        self.live = np.cumsum(self.sizes) + tl.baseline_bytes
        starts: list[int] = []
        ends: list[int] = []
        open_at: dict[int, int] = {}
        for i, e in enumerate(tl.events):
            if e.size_bytes > 0:
                if e.addr in open_at:  # an address reused without a free: the first one ends here
                    ends[open_at[e.addr]] = i
                open_at[e.addr] = len(starts)
                starts.append(i)
                ends.append(n)
            else:
                j = open_at.pop(e.addr, None)
                if j is not None:
                    ends[j] = i
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = np.asarray(ends, dtype=np.int64)

    def stacked(self, baseline: dict[str, int]) -> dict[str, np.ndarray]:
        """Live bytes of each category after each event (categories with any)."""
        out = {}
        for i, cat in enumerate(CATEGORIES):
            mask = self.codes == i
            if not mask.any() and not baseline.get(cat):
                continue
            out[cat] = np.cumsum(np.where(mask, self.sizes, 0)) + baseline.get(cat, 0)
        return out

    def largest(self, index: int, n: int) -> np.ndarray:
        """Event indices of the ``n`` largest allocations alive just after event ``index``."""
        alive = np.nonzero((self.starts <= index) & (self.ends > index))[0]
        sizes = self.sizes[self.starts[alive]]
        top = alive[np.argsort(-sizes, kind="stable")[:n]]
        return np.asarray(self.starts[top])


class TimelineChart(pg.PlotWidget):
    """A :class:`Timeline` as a stacked area; :meth:`set_timeline` redraws it."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("timelineChart")
        self.setAccessibleName("Memory timeline chart")
        self.setMinimumSize(320, 160)
        self.setBackground(None)
        self.plot_item = self.getPlotItem()
        self.plot_item.showGrid(x=False, y=True, alpha=0.25)
        self.plot_item.setLabel("bottom", "Allocation or free, in order")
        self.plot_item.getAxis("left").enableAutoSIPrefix(False)
        self.plot_item.getAxis("bottom").enableAutoSIPrefix(False)
        self.plot_item.setMouseEnabled(x=True, y=False)  # pan and zoom along the step
        self.legend = self.plot_item.addLegend(offset=(8, 4), labelTextSize="8pt", colCount=4)
        self.timeline: Timeline | None = None
        self._arrays: _Arrays | None = None
        self._overlay: pg.PlotDataItem | None = None
        self.unit = "GiB"
        self._live: np.ndarray = np.zeros(0, dtype=np.int64)
        self._hover_x: float | None = None
        self._hover = pg.TextItem(anchor=(0, 1), color="#212121", fill=pg.mkBrush(255, 255, 255, 230))
        self._hover.setZValue(50)
        self._hover.hide()
        self._hover_timer = QTimer(self)
        self._hover_timer.setSingleShot(True)
        self._hover_timer.setInterval(40)
        self._hover_timer.timeout.connect(self._update_hover)
        self.scene().sigMouseMoved.connect(self._on_mouse)
        self.hover_text = ""  # the last hover text (tests read it)
        self._apply_palette()

    def _apply_palette(self) -> None:
        """Axes, their labels and the legend in the theme's text colour (a report draws on white)."""
        fg = self.palette().color(QPalette.ColorRole.WindowText)
        for name in ("left", "bottom"):
            axis = self.plot_item.getAxis(name)
            axis.setPen(pg.mkPen(fg))
            axis.setTextPen(pg.mkPen(fg))
        self.legend.setLabelTextColor(fg)

    def changeEvent(self, event: QEvent) -> None:
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange) and \
                hasattr(self, "_hover_timer"):  # built
            self._apply_palette()
        super().changeEvent(event)

    def set_timeline(self, timeline: Timeline | None, capacity_bytes: int | None = None,
                     estimate_peak_bytes: int | None = None) -> None:
        """Draw ``timeline`` (``None`` clears); ``capacity_bytes`` as a red line, ``estimate_peak_bytes`` as a
        dashed one (the analytic ledger's tensor peak)."""
        self.plot_item.clear()
        self.legend.clear()
        self._overlay = None
        # the removed items hold reference cycles (their signals): collect them here, on the GUI thread; left to
        # the collector they could be destroyed on a worker thread, which Qt does not allow
        gc.collect()
        self.plot_item.addItem(self._hover, ignoreBounds=True)
        self._hover.hide()
        self.timeline = timeline
        if timeline is None or not timeline.events:
            self._live = np.zeros(0, dtype=np.int64)
            self._arrays = None
            return
        self._arrays = arrays = _Arrays(timeline)
        series = arrays.stacked(timeline.baseline)
        self._live = arrays.live
        peak_i = int(np.argmax(self._live))
        peak = int(self._live[peak_i])
        # lines far above the timeline (a small snapshot beside a large estimate) neither set the scale nor the unit
        drawn = [v for v in (capacity_bytes, estimate_peak_bytes) if v and peak >= 0.2 * v]
        self.unit = unit_for(max([peak, *drawn]))
        self.plot_item.setLabel("left", f"Live memory ({self.unit})")
        cols = reduce_columns(self._live)
        x = cols.astype(float)
        scale = 1 / in_unit(1, self.unit)  # bytes per unit
        order = [c for c in STACK_ORDER if c in series] + [c for c in CATEGORIES if c in series and
                                                           c not in STACK_ORDER]
        # stacked areas: each category's cumulative curve filled down to zero, the highest drawn first, so each
        # shows as the band between its curve and the one below
        below = np.zeros(len(cols))
        curves = []
        for cat in order:
            below = below + series[cat][cols] / scale
            curves.append((cat, below))
        for z, (cat, top) in enumerate(reversed(curves)):
            color = QColor(OBJECT_COLORS.get(cat, UNKNOWN_COLOR))
            curve = pg.PlotCurveItem(x, top, pen=pg.mkPen(color.darker(125), width=1), fillLevel=0,
                                     brush=pg.mkBrush(color))
            curve.setZValue(z - len(curves))
            self.plot_item.addItem(curve)
        for cat, _ in curves:
            swatch = pg.mkBrush(OBJECT_COLORS.get(cat, UNKNOWN_COLOR))
            sample = pg.PlotDataItem([0, 1], [1, 1], pen=None, fillLevel=0, fillBrush=swatch)
            self.legend.addItem(sample, OBJECT_LABELS.get(cat, "Not placed (before the trace, or unknown)"))
        top_value = float(below.max()) if len(below) else 0.0
        # the capacity and the analytic peak set the scale only when the timeline reaches a fifth of them: a small
        # snapshot beside a large estimate stays readable (the comparison line under the chart gives the numbers)
        highest = max([top_value] + [v / scale for v in drawn])
        for span in timeline.spans:
            if span.end <= span.start:
                continue
            tint = QColor(PHASE_BAND.get(span.phase, "#9E9E9E"))
            tint.setAlpha(28)
            band = pg.LinearRegionItem((span.start, span.end), movable=False, brush=pg.mkBrush(tint))
            band.setZValue(-100)
            for line in band.lines:
                line.setPen(pg.mkPen(None))
            self.plot_item.addItem(band, ignoreBounds=True)
            if (span.end - span.start) * 25 < len(self._live):
                continue  # too narrow for its name: the band and the hover say it
            label = pg.TextItem(PHASE_LABELS.get(span.phase, span.phase) + (f" {span.iteration}" if span.iteration
                                                                            else ""),
                                anchor=(0, 1), color=PHASE_BAND.get(span.phase, "#616161"))
            label.setPos(span.start, highest * 1.2)
            self.plot_item.addItem(label, ignoreBounds=True)
        if capacity_bytes:
            cap = pg.InfiniteLine(pos=capacity_bytes / scale, angle=0, pen=pg.mkPen(OVER_COLOR, width=2),
                                  label=f"Capacity {format_bytes(capacity_bytes)}",
                                  labelOpts={"position": 0.02, "color": OVER_COLOR, "anchors": [(0, 1), (0, 1)]})
            self.plot_item.addItem(cap)
        if estimate_peak_bytes:
            est = pg.InfiniteLine(pos=estimate_peak_bytes / scale, angle=0,
                                  pen=pg.mkPen("#37474F", width=1, style=Qt.PenStyle.DashLine),
                                  label=f"Analytic peak {format_bytes(estimate_peak_bytes)}",
                                  labelOpts={"position": 0.98, "color": "#37474F", "anchors": [(1, 1), (1, 1)]})
            self.plot_item.addItem(est)
        marker = pg.ScatterPlotItem([peak_i], [peak / scale], symbol="t", size=12,
                                    brush=pg.mkBrush("#212121"), pen=pg.mkPen("#FFFFFF"))
        self.plot_item.addItem(marker)
        peak_label = pg.TextItem(f"Peak {format_bytes(peak)}", anchor=(0.5, 1.2), color="#212121")
        peak_label.setPos(peak_i, peak / scale)
        self.plot_item.addItem(peak_label, ignoreBounds=True)
        self.plot_item.setYRange(0, highest * 1.85, padding=0)  # room for the phase names and the legend above
        self.plot_item.setXRange(0, len(self._live), padding=0.01)

    def set_overlay(self, other: Timeline | None, label: str = "Measured") -> None:
        """Draw ``other``'s total live memory as a line over the timeline, its phases aligned to this one's (each
        matching phase window stretched onto the drawn one; events outside matching windows are left out)."""
        if self._overlay is not None:
            self.plot_item.removeItem(self._overlay)
            self._overlay = None
        tl = self.timeline
        if other is None or tl is None or not other.events:
            return
        live = np.frombuffer(other.live(), dtype=np.int64)
        mine = {(s.phase, s.iteration): s for s in tl.spans}
        xs: list[np.ndarray] = []
        ys: list[np.ndarray] = []
        for s in other.spans:
            target = mine.get((s.phase, s.iteration))
            if target is None or s.end <= s.start:
                continue
            idx = np.arange(s.start, s.end)
            xs.append(target.start + (idx - s.start) * ((target.end - target.start) / (s.end - s.start)))
            ys.append(live[s.start:s.end] / (1 / in_unit(1, self.unit)))
        if not xs:
            return
        x, y = np.concatenate(xs), np.concatenate(ys)
        if len(x) > MAX_POINTS:
            keep = reduce_columns(np.round(y * 2**20).astype(np.int64))
            x, y = x[keep], y[keep]
        self._overlay = pg.PlotDataItem(x, y, pen=pg.mkPen("#000000", width=2), name=label)
        self._overlay.setZValue(10)
        self.plot_item.addItem(self._overlay)
        self.legend.addItem(self._overlay, label)

    # ---- hover ------------------------------------------------------------------------------------------------
    def _on_mouse(self, pos: QPointF) -> None:
        if self.timeline is None or not len(self._live) or not self.plot_item.sceneBoundingRect().contains(pos):
            self._hover.hide()
            return
        self._hover_x = self.plot_item.vb.mapSceneToView(pos).x()
        self._hover_timer.start()

    def _update_hover(self) -> None:
        if self._hover_x is None:
            return
        self.show_event_info(round(self._hover_x))

    def show_event_info(self, index: int) -> str:
        """Show (and return) what is live after event ``index``: total, phase, the largest allocations."""
        tl = self.timeline
        if tl is None or not len(self._live):
            return ""
        index = max(0, min(index, len(self._live) - 1))
        phase = next((s for s in tl.spans if s.start <= index < s.end), None)  # a few spans: a short scan
        where = f"{PHASE_LABELS.get(phase.phase, phase.phase)} {phase.iteration}" if phase else "outside the step"
        lines = [f"Event {index:,} ({where}): {format_bytes(int(self._live[index]))} live"]
        top = self._arrays.largest(index, 4) if self._arrays is not None else []
        for e in (tl.events[int(i)] for i in top):
            what = " · ".join(x for x in (e.module, e.op) if x) or "—"
            lines.append(f"  {format_bytes(e.size_bytes)}  {OBJECT_LABELS.get(e.category, e.category)}  {what}")
        self.hover_text = "\n".join(lines)
        scale = 1 / in_unit(1, self.unit)
        self._hover.setText(self.hover_text)
        self._hover.setPos(index, float(self._live[index]) / scale)
        self._hover.show()
        return self.hover_text
