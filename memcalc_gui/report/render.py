"""Draw a :class:`ReportContent` as a PDF (QPdfWriter + QTextDocument) or as one PNG image.

Both return bytes; :mod:`memcalc_gui.report.export` writes them to disk atomically.

- The chart is the window's own :class:`~memcalc_gui.view.chart.MemoryChart`, rendered offscreen into a
  QImage with a device-pixel ratio (crisp text and bars at ~290 dpi on paper).
- The PDF text is real text in the bundled DejaVu Sans (embedded by Qt's PDF engine). The document is
  laid out at 96 dpi on a page the size of the writer's paint rect (``doc.setDocumentMargin(0)``), then
  painted page by page with a footer. Every table repeats its header row on a new page, rows are never
  cut, and a heading is moved to the next page when its first table row or the chart would not follow it.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QMarginsF, QPointF, QRect, QRectF, QSizeF, Qt, QUrl
from PySide6.QtGui import (
    QAbstractTextDocumentLayout,
    QColor,
    QFont,
    QFontDatabase,
    QFontMetrics,
    QImage,
    QPageLayout,
    QPageSize,
    QPainter,
    QPalette,
    QPdfWriter,
    QTextBlock,
    QTextCursor,
    QTextDocument,
    QTextFrame,
    QTextTable,
)

from ..core.ledger import parameter_rows, shown_objects
from ..core.result import Result
from ..core.solver import MAX_GPUS
from ..core.timeline import Timeline
from ..core.units import in_unit
from ..core.vocab import OBJECT_LABELS, PHASE_LABELS, PHASES
from ..view.assets import BUNDLED_FAMILY
from ..view.plan_text import chart_scope, is_per_gpu
from ..view.theme import FIT_COLOR, NEUTRAL_COLOR, OBJECT_COLORS, OVER_COLOR
from .content import ReportContent, Row, Table, gpu_label

#: Layout resolution of the documents (CSS pixels): 1 px = 1/96 in.
DOC_DPI = 96
#: Resolution of the PDF device (Qt's default is 1200; positions are exact either way).
PDF_DPI = 1200
#: Page margins of the PDF, millimetres (left, top, right, bottom).
PDF_MARGINS_MM = (16.0, 14.0, 16.0, 12.0)
#: Space reserved at the bottom of each PDF page for the footer (CSS px).
FOOTER_PX = 22
#: The chart in the PDF: height / width (the first that keeps the ledger on page 1), and its pixel width
#: (≈ 290 dpi across an A4 text width).
CHART_ASPECTS = (0.5, 0.44, 0.4)
#: The number of the ledger's heading among the ``<h2>`` (after "Memory per phase").
LEDGER_HEADING = 1
CHART_PIXELS = 2000
#: The PNG: one 16:10 image for a slide or a chat message; a timeline adds a strip below (CSS px).
PNG_SIZE = (1600, 1000)
PNG_TIMELINE_PX = 440

BODY_PT = 9.0
TEXT = "#1B1F24"
MUTED = "#57606A"
RULE = "#C9D1D9"
HEAD_BG = "#EEF1F4"
PEAK_BG = "#FFF3CF"
FIT_BG = "#E6F4EA"
OVER_BG = "#FDECEA"
NEUTRAL_BG = "#ECEEF8"

CHART_URL = "memcalc://chart.png"
TIMELINE_URL = "memcalc://timeline.png"
#: Tables with at most this many rows (header included) are never split across pages.
KEEP_WHOLE_ROWS = 14
PAGE_SIZES = {"a4": QPageSize.PageSizeId.A4, "letter": QPageSize.PageSizeId.Letter}


# ---- fonts and the chart -------------------------------------------------------------------------
def report_family() -> str:
    """The bundled DejaVu Sans when registered (it always is after ``ensure_app``), else the app font."""
    if BUNDLED_FAMILY in QFontDatabase.families():
        return BUNDLED_FAMILY
    from PySide6.QtGui import QGuiApplication

    return QGuiApplication.font().family()


def text_font(point_size: float = BODY_PT) -> QFont:
    """The report's text font: no ligatures, so copied or searched text reads "fit", not "ﬁt"."""
    font = QFont(report_family())
    font.setPointSizeF(point_size)
    for tag in ("liga", "clig", "dlig"):
        font.setFeature(QFont.Tag(tag), 0)
    return font


def _light_palette() -> QPalette:
    pal = QPalette()
    for role, color in ((QPalette.ColorRole.Window, "#FFFFFF"), (QPalette.ColorRole.Base, "#FFFFFF"),
                        (QPalette.ColorRole.WindowText, TEXT), (QPalette.ColorRole.Text, TEXT)):
        pal.setColor(role, QColor(color))
    return pal


def _render_widget(widget: Any, width: int, height: int, ratio: float, font_pt: float,
                   draw: Callable[[QFont], None]) -> QImage:
    """Render a chart widget offscreen on white at ``width``×``height`` logical px, ``ratio`` device px each:
    ``draw(font)`` fills it once it is laid out; the widget is closed afterwards."""
    from PySide6.QtWidgets import QApplication, QWidget

    try:
        widget.setAttribute(Qt.WidgetAttribute.WA_DontShowOnScreen, True)
        font = QFont(report_family())
        font.setPointSizeF(font_pt)
        widget.setFont(font)
        widget.setPalette(_light_palette())  # a report is printed on white, whatever the desktop theme
        widget.resize(width, height)
        widget.show()
        QApplication.processEvents()
        draw(font)
        QApplication.processEvents()
        image = QImage(round(width * ratio), round(height * ratio), QImage.Format.Format_ARGB32_Premultiplied)
        image.setDevicePixelRatio(ratio)
        image.fill(QColor("#FFFFFF"))
        QWidget.render(widget, image)  # QGraphicsView.render would draw the scene without the ratio
        image.setDevicePixelRatio(1.0)
        return image.convertToFormat(QImage.Format.Format_RGB32)
    finally:
        widget.hide()
        widget.close()
        widget.deleteLater()


def render_chart(result: Result, width: int, height: int, ratio: float, content: ReportContent | None = None,
                 font_pt: float = 9.0) -> QImage:
    """The window's phase chart for ``result`` at ``width``×``height`` logical px, ``ratio`` device px each."""
    import pyqtgraph as pg

    from ..view.chart import MemoryChart

    chart = MemoryChart()

    def draw(font: QFont) -> None:
        setup = result.setup
        name = gpu_label(result).split(" (")[0] if setup.gpu else ""
        chart.set_estimate(result.estimate, setup.capacity_bytes, name,
                           per_gpu=chart_scope(setup) if is_per_gpu(result) else None)
        if content is not None and content.measured_peaks:
            chart.set_measured(content.measured_peaks, label=content.measured_label,
                               reference=content.measured_reference or None)
        label = getattr(chart, "capacity_label", None)
        if label is not None and hasattr(label, "fill"):
            label.fill = pg.mkBrush(255, 255, 255, 215)  # keep the capacity text readable over the bars
        chart.plot.getAxis("left").setStyle(tickFont=font)
        # "(peak)" on a second line keeps neighbouring phase names apart on a narrow plot, and the last
        # name may run a little past the plot's right edge rather than be hidden
        bottom = chart.plot.getAxis("bottom")
        peak = result.estimate.peak_phase
        bottom.setTicks([[(float(i), PHASE_LABELS[p] + ("\n(peak)" if p == peak else ""))
                          for i, p in enumerate(PHASES)]])
        bottom.setStyle(tickFont=font, hideOverlappingLabels=60)
        bottom.setHeight(2 * QFontMetrics(font).height() + 14)

    return _render_widget(chart, width, height, ratio, font_pt, draw)


def render_timeline(timeline: Timeline, result: Result, width: int, height: int, ratio: float,
                    font_pt: float = 9.0) -> QImage:
    """The window's timeline chart of ``timeline`` beside ``result``'s capacity and tensor peak, as an image."""
    from ..view.timeline_chart import TimelineChart

    chart = TimelineChart()
    chart.setBackground("w")

    def draw(font: QFont) -> None:
        chart.set_timeline(timeline, result.setup.capacity_bytes, result.estimate.peak_tensor_bytes)
        for axis in ("left", "bottom"):
            chart.plot_item.getAxis(axis).setStyle(tickFont=font)

    return _render_widget(chart, width, height, ratio, font_pt, draw)


# ---- HTML ----------------------------------------------------------------------------------------
def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _verdict_colors(fits: bool | None) -> tuple[str, str]:
    if fits is None:
        return NEUTRAL_COLOR, NEUTRAL_BG
    return (FIT_COLOR, FIT_BG) if fits else (OVER_COLOR, OVER_BG)


def _h2(text: str, page_break: bool = False) -> str:
    brk = " page-break-before:always;" if page_break else ""
    return (f'<h2 style="font-size:12.5pt; font-weight:600; margin-top:16px; margin-bottom:6px;{brk}">'
            f"{_e(text)}</h2>")


def _note(text: str) -> str:
    return f'<p style="color:{MUTED}; margin-top:4px; margin-bottom:0px">{_e(text)}</p>'


def _pairs(header: tuple[str, str], rows: Iterable[tuple[str, str]], key_width: int = 26) -> Table:
    return Table(header, tuple(Row((k, v)) for k, v in rows), widths=(key_width, 100 - key_width))


def _facts_html(pairs: tuple[tuple[str, str], ...]) -> str:
    """The verdict's facts in two columns of label/value pairs (peak and object left, GPU and fit right)."""
    half = (len(pairs) + 1) // 2
    left, right = pairs[:half], pairs[half:]
    rows = []
    for i in range(half):
        cells = []
        for side in (left, right):
            k, v = side[i] if i < len(side) else ("", "")
            cells.append(f'<td width="{14 if side is left else 24}%" style="color:{MUTED}; white-space:nowrap">'
                         f'{_e(k)}</td><td width="{36 if side is left else 26}%">{_e(v)}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return '<table width="100%" border="0" cellspacing="0" cellpadding="2">' + "".join(rows) + "</table>"


VERDICT_WORDS = {True: "Fits", False: "Does not fit", None: "No GPU chosen"}


def _headline_rest(headline: str, word: str) -> str:
    """The headline without its leading ``Fits:``/``Does not fit:`` (the box shows that word large)."""
    prefix = word + ":"
    if headline.startswith(prefix):
        rest = headline[len(prefix):].strip()
        return rest[:1].upper() + rest[1:]
    return headline


class ReportHtml:
    """The report as Qt rich text, with the page breaks :func:`paginate` asks for.

    Tables are emitted in chunks: ``splits`` maps a table's number to the body rows (0-based) that start
    a new chunk on a new page, header repeated — how the PDF avoids rows cut across pages. ``chunks``
    lists (table number, first row) per emitted table. ``breaks`` holds the numbers of the ``<h2>``
    headings that start a new page."""

    def __init__(self, content: ReportContent, chart_w: int, chart_h: int,
                 splits: Mapping[int, set[int]] | None = None, breaks: set[int] | None = None,
                 timeline_h: int = 0) -> None:
        self.content = content
        self.chart_w, self.chart_h = chart_w, chart_h
        self.timeline_h = timeline_h  # 0: no timeline figure
        self.splits = splits or {}
        self.breaks = breaks or set()
        self.chunks: list[tuple[int, int]] = []
        self._count = 0
        self._headings = 0

    def h2(self, text: str) -> str:
        number = self._headings
        self._headings += 1
        return _h2(text, number in self.breaks)

    def table(self, table: Table, *, font_pt: float | None = None, pad: int = 4) -> str:
        number = self._count
        self._count += 1
        starts = sorted({0} | {r for r in self.splits.get(number, set()) if 0 < r < len(table.rows)})
        bounds = [*starts, len(table.rows)]
        return "".join(self._chunk(table, number, bounds[i], bounds[i + 1], font_pt, pad)
                       for i in range(len(starts)))

    def _chunk(self, table: Table, number: int, first: int, end: int, font_pt: float | None, pad: int) -> str:
        self.chunks.append((number, first))
        size = f" font-size:{font_pt}pt;" if font_pt else ""
        brk = " page-break-before:always;" if first else ""
        out = [f'<table width="100%" border="1" cellspacing="0" cellpadding="{pad}" '
               f'style="border-collapse:collapse; border-color:{RULE}; border-style:solid;{size}{brk}">',
               "<thead><tr>"]
        for i, h in enumerate(table.header):
            width = f' width="{table.widths[i]}%"' if i < len(table.widths) else ""
            bg = PEAK_BG if i == table.highlight_column else HEAD_BG
            out.append(f'<th{width} align="{table.align.get(i, "left")}" bgcolor="{bg}">{_e(h)}</th>')
        out.append("</tr></thead><tbody>")
        for row in table.rows[first:end]:
            out.append("<tr>")
            for i, cell in enumerate(row.cells):
                text = _e(cell)
                if i == 0 and row.color:
                    text = f'<span style="color:{OBJECT_COLORS.get(row.color, TEXT)}">■</span>&nbsp;{text}'
                if row.strong:
                    text = f"<b>{text}</b>"
                bg = ""
                if i == table.highlight_column:
                    bg = f' bgcolor="{PEAK_BG}"'
                elif row.highlight:
                    bg = f' bgcolor="{FIT_BG}"'
                out.append(f'<td align="{table.align.get(i, "left")}"{bg}>{text}</td>')
            out.append("</tr>")
        out.append("</tbody></table>")
        return "".join(out)

    def build(self) -> str:
        c = self.content
        self.chunks = []
        self._count = 0
        self._headings = 0
        accent, bg = _verdict_colors(c.fits)
        word = VERDICT_WORDS[c.fits]
        parts = [
            f'<p style="font-size:18pt; font-weight:600; margin-bottom:2px">{_e(c.title)}</p>',
            f'<p style="color:{MUTED}; margin-top:0px; margin-bottom:2px">{_e(c.subtitle)}</p>',
            f'<p style="color:{MUTED}; font-size:8pt; margin-top:0px">Generated {_e(c.date)} by memcalc '
            f'{_e(c.version)} · method {_e(c.method)} · all sizes binary (GiB = 2³⁰ bytes)</p>',
            # the verdict box: one cell, the word, the headline and the facts
            f'<table width="100%" border="1" cellspacing="0" cellpadding="8" '
            f'style="border-collapse:collapse; border-color:{accent}; border-style:solid; margin-top:8px">'
            f'<tr><td bgcolor="{bg}">'
            f'<p style="margin:0px"><span style="font-size:14pt; font-weight:700; color:{accent}">{_e(word)}</span>'
            f'</p><p style="font-size:10.5pt; font-weight:600; margin-top:3px; margin-bottom:6px">'
            f"{_e(_headline_rest(c.headline, word))}</p>"
            + _facts_html(c.verdict) + "</td></tr></table>",
            self.h2("Memory per GPU per phase" if c.per_gpu else "Memory per phase"),
            f'<p align="center" style="margin:0px"><img src="{CHART_URL}" width="{self.chart_w}" '
            f'height="{self.chart_h}"></p>',
            _note(c.chart_caption),
            self.h2("Ledger: memory objects × phases"),
            self.table(c.ledger),
            _note("Each cell: bytes live at that phase’s peak" + (" on each GPU" if c.per_gpu else "")
                  + " (binary units). The peak phase is shaded. "
                  "“Tensors (allocated)” leaves out the CUDA context and the allocator reserve."),
            *([self.h2("Memory over time"),
               f'<p align="center" style="margin:0px"><img src="{TIMELINE_URL}" width="{self.chart_w}" '
               f'height="{self.timeline_h}"></p>', _note(c.timeline_caption)]
              if self.timeline_h and c.timeline_caption else []),
            self.h2("Suggestions"),
        ]
        if c.suggestions is not None:
            parts += [self.table(c.suggestions, font_pt=8.5), _note(c.suggestions_note)]
        else:
            parts.append(_note(c.suggestions_note))
        if c.per_gpu:
            parts.append(self.h2("GPU plan"))
            parts += [f'<p style="margin-top:0px; margin-bottom:4px">{_e(n)}</p>' for n in c.plan_notes]
            if c.plan is not None:
                shaded = (" The shaded row is the strategy with the least communication that fits."
                          if any(r.highlight for r in c.plan.rows) else "")
                parts += [self.table(c.plan, font_pt=8.5),
                          _note("Fewest GPUs of the chosen kind each strategy needs with this micro-batch and "
                                f"offload (“never”: not even with {MAX_GPUS:,}, or not with this offload); the peak "
                                "column changes only the strategy."
                                + shaded)]
            if c.host:
                parts.append(_note(c.host + "."))
        parts += [self.h2("Setup"), self.table(_pairs(("Input", "Value"), c.setup))]
        parts += [_note(f"Note: {n}") for n in c.notes]
        if c.measurement is not None:
            m = c.measurement
            parts += [self.h2("Measured vs estimated"),
                      f'<p style="margin-top:0px"><b>Device:</b> {_e(m.device)}<br>{_e(m.headline)}</p>']
            parts += [_note(n) for n in m.notes]
            parts.append(self.table(m.table))
            if m.signals:
                parts.append('<p style="margin-top:8px; margin-bottom:2px"><b>Signals</b></p>'
                             '<ul style="margin-top:0px">' + "".join(f"<li>{_e(s)}</li>" for s in m.signals)
                             + "</ul>")
            if m.extra:
                parts.append(self.table(_pairs(("Measurement", "Value"), m.extra), font_pt=8.5))
        if c.modules is not None:
            parts += [self.h2("Per-module breakdown (trace)"), _note(c.modules_note),
                      self.table(c.modules, font_pt=8.5, pad=3)]
        parts += [
            self.h2("Assumptions"), self.table(c.assumptions, font_pt=8.0, pad=3),
            self.h2("Formulas"), self.table(c.formulas, font_pt=8.0, pad=3),
            self.h2("Units"), f'<p style="margin-top:0px">{_e(c.units)}</p>',
            self.h2("Sources"), self.table(_pairs(("Source", "Reference"), c.references, 18), font_pt=8.0, pad=3),
        ]
        return (f'<html><body style="font-family:\'{report_family()}\'; font-size:{BODY_PT}pt; color:{TEXT}">'
                + "".join(parts) + "</body></html>")


# ---- layout helpers ------------------------------------------------------------------------------
def _layout_device() -> QImage:
    """A 1×1 image at exactly 96 dpi: documents lay out the same on any screen (and with none)."""
    dev = QImage(1, 1, QImage.Format.Format_RGB32)
    dots = round(DOC_DPI / 0.0254)
    dev.setDotsPerMeterX(dots)
    dev.setDotsPerMeterY(dots)
    return dev


def make_document(body_html: str, width: float, resources: Mapping[str, QImage], device: QImage,
                  page_height: float | None = None) -> QTextDocument:
    """A document laid out at 96 dpi, ``width`` px wide, paginated when ``page_height`` is given."""
    doc = QTextDocument()
    doc.documentLayout().setPaintDevice(device)
    doc.setDefaultFont(text_font(BODY_PT))
    doc.setDocumentMargin(0)
    for name, image in resources.items():
        doc.addResource(QTextDocument.ResourceType.ImageResource, QUrl(name), image)
    doc.setHtml(body_html)
    if page_height is not None:
        doc.setPageSize(QSizeF(width, page_height))
    else:
        doc.setTextWidth(width)
    return doc


def _tables(frame: QTextFrame) -> list[QTextTable]:
    out: list[QTextTable] = []
    for child in frame.childFrames():
        if isinstance(child, QTextTable):
            out.append(child)
        out += _tables(child)
    return sorted(out, key=lambda t: t.firstPosition())


def header_rows(doc: QTextDocument) -> list[tuple[int, int]]:
    """(rows, header rows) of every table: ``<thead>`` becomes ``QTextTableFormat.headerRowCount``, which
    makes Qt repeat the header on each page a table runs onto."""
    return [(t.rows(), t.format().headerRowCount()) for t in _tables(doc.rootFrame())]


def _block_rect(doc: QTextDocument, block: QTextBlock) -> QRectF:
    return doc.documentLayout().blockBoundingRect(block)


def _row_span(doc: QTextDocument, table: QTextTable, row: int) -> tuple[float, float]:
    """Top and bottom (document px) of everything in one table row."""
    top, bottom = math.inf, -math.inf
    for col in range(table.columns()):
        cell = table.cellAt(row, col)
        if cell.row() != row:  # spanned from above
            continue
        block = doc.findBlock(cell.firstPosition())
        while block.isValid() and block.position() <= cell.lastPosition():
            rect = _block_rect(doc, block)
            top, bottom = min(top, rect.top()), max(bottom, rect.bottom())
            block = block.next()
    return top, bottom


def _page(y: float, page_height: float) -> int:
    return math.floor(y / page_height)


def _crosses(top: float, bottom: float, page_height: float) -> bool:
    return _page(top, page_height) != _page(bottom - 0.5, page_height)


def _following_bottom(doc: QTextDocument, heading: QTextBlock) -> float | None:
    """The bottom of what must stay with ``heading``: the next paragraph (or the chart), a short table
    whole (the ledger, the suggestions), or a long table's header and first row."""
    block = heading.next()
    while block.isValid():
        table = QTextCursor(block).currentTable()
        if table is not None:
            headers = table.format().headerRowCount()
            last = table.rows() - 1 if table.rows() <= KEEP_WHOLE_ROWS else min(headers, table.rows() - 1)
            return _row_span(doc, table, last)[1]
        if block.text().strip() or _block_rect(doc, block).height() > 30:  # text, or the chart image
            return _block_rect(doc, block).bottom()
        block = block.next()
    return None


def first_problem(doc: QTextDocument, page_height: float,
                  moved: set[int] | frozenset[int] = frozenset()) -> tuple[float, str, int, int] | None:
    """The first place, in reading order, where the layout breaks badly: ``(y, "heading", n, 0)`` for the
    n-th ``<h2>`` separated from what follows it, or ``(y, "row", i, row)`` for a body row of the i-th
    table with a header that runs across a page break (Qt breaks a row between its lines). Rows taller
    than a page cannot be helped and are left alone, and so are the ``moved`` headings (already first on
    their page)."""
    doc.documentLayout().documentSize()  # finish the (lazy) layout before reading positions
    found: list[tuple[float, str, int, int]] = []
    heading = 0
    block = doc.begin()
    while block.isValid():
        if block.blockFormat().headingLevel() == 2:
            top = _block_rect(doc, block).top()
            end = _following_bottom(doc, block)
            if heading not in moved and end is not None and _crosses(top, end, page_height):
                found.append((top, "heading", heading, 0))
                break
            heading += 1
        block = block.next()
    headed = [t for t in _tables(doc.rootFrame()) if t.format().headerRowCount() > 0]
    for i, table in enumerate(headed):
        # the first body row travels with the header (and its heading): start after it
        for row in range(table.format().headerRowCount() + 1, table.rows()):
            top, bottom = _row_span(doc, table, row)
            if top == math.inf or bottom - top > page_height * 0.8:
                continue
            if _crosses(top, bottom, page_height):
                found.append((top, "row", i, row))
                break
        if len(found) == 2 or (found and found[-1][1] == "row"):
            break
    return min(found) if found else None


def paginate(content: ReportContent, width: float, page_height: float, chart: QImage, chart_w: int,
             chart_h: int, device: QImage, max_rounds: int = 60,
             timeline: QImage | None = None, timeline_h: int = 0) -> tuple[QTextDocument, set[int]]:
    """Lay the report out so that no table row is cut and no heading is left at the foot of a page.

    Each round rebuilds the document from HTML with the page breaks found so far (a fresh layout is
    exact; editing a laid-out document leaves parts of Qt's lazy layout stale), finds the first problem
    in reading order and adds one break: before the heading, or a table split before the cut row.
    Returns the document and the numbers of the headings moved to a new page."""
    splits: dict[int, set[int]] = {}
    breaks: set[int] = set()
    doc = QTextDocument()
    for _ in range(max_rounds):
        builder = ReportHtml(content, chart_w, chart_h, splits, breaks, timeline_h if timeline is not None else 0)
        images = {CHART_URL: chart} | ({TIMELINE_URL: timeline} if timeline is not None else {})
        doc = make_document(builder.build(), width, images, device, page_height=page_height)
        problem = first_problem(doc, page_height, breaks)
        if problem is None:
            break
        _y, kind, index, row = problem
        if kind == "heading":
            breaks.add(index)
        else:
            number, first = builder.chunks[index]
            headed = [t for t in _tables(doc.rootFrame()) if t.format().headerRowCount() > 0]
            split = first + row - headed[index].format().headerRowCount()
            if split in splits.get(number, set()):
                break
            splits.setdefault(number, set()).add(split)
    return doc, breaks


# ---- PDF -----------------------------------------------------------------------------------------
def _content_rect_pt(page: str) -> tuple[QPageLayout, QRectF]:
    size = QPageSize(PAGE_SIZES[page])
    left, top, right, bottom = PDF_MARGINS_MM
    layout = QPageLayout(size, QPageLayout.Orientation.Portrait, QMarginsF(left, top, right, bottom),
                         QPageLayout.Unit.Millimeter)
    return layout, layout.paintRect(QPageLayout.Unit.Point)


def render_pdf(content: ReportContent, result: Result, page: str,
               timeline: Timeline | None = None) -> tuple[bytes, int]:
    """The report as PDF bytes and its page count (``timeline``: a "Memory over time" figure too)."""
    layout, rect_pt = _content_rect_pt(page)
    width = rect_pt.width() * DOC_DPI / 72
    height = rect_pt.height() * DOC_DPI / 72
    doc_height = height - FOOTER_PX

    chart_w = math.floor(width)
    ratio = CHART_PIXELS / chart_w
    device = _layout_device()
    doc = QTextDocument()
    timeline_h = round(chart_w * 0.45)
    figure = render_timeline(timeline, result, chart_w, timeline_h, ratio) \
        if timeline is not None and timeline.events and content.timeline_caption else None
    for aspect in CHART_ASPECTS:  # a lower chart when that keeps the ledger on the first page
        chart_h = round(chart_w * aspect)
        chart = render_chart(result, chart_w, chart_h, ratio, content)
        doc, breaks = paginate(content, width, doc_height, chart, chart_w, chart_h, device, timeline=figure,
                               timeline_h=timeline_h)
        if LEDGER_HEADING not in breaks:
            break
    pages = doc.pageCount()

    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    writer = QPdfWriter(buffer)
    writer.setResolution(PDF_DPI)
    writer.setPageLayout(layout)
    writer.setTitle(content.title)
    writer.setCreator(f"memcalc {content.version}")
    painter = QPainter(writer)
    painter.setRenderHint(QPainter.RenderHint.LosslessImageRendering)  # no JPEG artefacts in the chart
    painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
    if not painter.isActive():
        raise RuntimeError("the PDF writer could not start")
    scale = writer.logicalDpiX() / DOC_DPI
    footer_font = text_font()
    footer_font.setPixelSize(10)
    try:
        for i in range(pages):
            if i:
                writer.newPage()
            painter.save()
            painter.scale(scale, scale)
            painter.save()
            painter.translate(0, -i * doc_height)
            # A line that starts exactly on the page boundary belongs to the next page: a clip that touches
            # the boundary would draw it here too (invisible, but still text in the PDF).
            clip = QRectF(0, i * doc_height + 0.25, width, doc_height - 0.5)
            painter.setClipRect(clip)
            ctx = QAbstractTextDocumentLayout.PaintContext()
            ctx.clip = clip
            ctx.palette.setColor(QPalette.ColorRole.Text, QColor(TEXT))
            doc.documentLayout().draw(painter, ctx)
            painter.restore()
            painter.setFont(footer_font)
            painter.setPen(QColor(RULE))
            painter.drawLine(QPointF(0, doc_height + 4), QPointF(width, doc_height + 4))
            painter.setPen(QColor(MUTED))
            text_rect = QRectF(0, doc_height + 6, width, FOOTER_PX - 6)
            painter.drawText(text_rect, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                             f"memcalc {content.version} · {content.title}")
            painter.drawText(text_rect, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                             f"page {i + 1} of {pages}")
            painter.restore()
    finally:
        painter.end()
    buffer.close()
    return bytes(data.data()), pages


# ---- PNG -----------------------------------------------------------------------------------------
#: How each screen unit is defined in a table header.
UNIT_POWERS = {"GiB": "2³⁰", "TiB": "2⁴⁰", "PiB": "2⁵⁰", "EiB": "2⁶⁰", "ZiB": "2⁷⁰", "YiB": "2⁸⁰"}


def _unit_cell(n: int, unit: str) -> str:
    if n == 0:
        return "–"
    g = in_unit(n, unit)
    return f"{g:,.2f}" if g >= 0.005 else "<0.01"


def _png_ledger_html(result: Result, px: int, measured: dict[str, int] | None = None,
                     reference: dict[str, int] | None = None) -> str:
    """The ledger table of the PNG; with a measurement, its tensor peaks and the estimate's error per phase
    (against ``reference``, the estimate of a scaled-down measured setup, when there is one)."""
    est = result.estimate
    unit = result.unit  # the window's ledger uses the same
    peak_i = PHASES.index(est.peak_phase)
    short = {"load": "Load", "forward": "Forward", "backward": "Backward", "optimizer_step": "Opt. step"}
    head = "".join(f'<th align="right" bgcolor="{PEAK_BG if i == peak_i else HEAD_BG}">'
                   f'{short[p]}{" ▲" if i == peak_i else ""}</th>' for i, p in enumerate(PHASES))
    rows = []
    for obj in shown_objects(est):
        cells = "".join(f'<td align="right"{f" bgcolor={PEAK_BG!r}" if i == peak_i else ""}>'
                        f'{_e(_unit_cell(est.phases[p].objects[obj], unit))}</td>' for i, p in enumerate(PHASES))
        rows.append(f'<tr><td><span style="color:{OBJECT_COLORS[obj]}">■</span>&nbsp;{_e(OBJECT_LABELS[obj])}</td>'
                    f"{cells}</tr>")
        if obj == "parameters":  # a fine-tuning run's parts, indented as in the window's ledger
            for name, row in parameter_rows(est):
                cells = "".join(f'<td align="right"{f" bgcolor={PEAK_BG!r}" if i == peak_i else ""}><i>'
                                f'{_e(_unit_cell(row[p], unit))}</i></td>' for i, p in enumerate(PHASES))
                rows.append(f"<tr><td>&nbsp;&nbsp;&nbsp;<i>↳ {_e(name)}</i></td>{cells}</tr>")
    total = "".join(f'<td align="right"{f" bgcolor={PEAK_BG!r}" if i == peak_i else ""}><b>'
                    f'{_e(_unit_cell(est.phases[p].total_bytes, unit))}</b></td>' for i, p in enumerate(PHASES))
    rows.append(f"<tr><td><b>Total</b></td>{total}</tr>")
    if measured:
        against = reference or {p: est.phases[p].tensor_bytes for p in PHASES}
        label = "◇ Measured (scaled)" if reference else "◇ Measured"
        cells = "".join(f'<td align="right">{_e(_unit_cell(measured[p], unit)) if p in measured else "–"}</td>'
                        for p in PHASES)
        rows.append(f"<tr><td><b>{_e(label)}</b></td>{cells}</tr>")
        errs = "".join(
            f'<td align="right">{_e(f"{(against[p] - measured[p]) / measured[p] * 100:+.1f} %")}</td>'
            if measured.get(p) else '<td align="right">–</td>' for p in PHASES)
        rows.append(f'<tr><td style="color:{MUTED}">Estimate error</td>{errs}</tr>')
    return (f'<table width="100%" border="1" cellspacing="0" cellpadding="5" '
            f'style="border-collapse:collapse; border-color:{RULE}; border-style:solid; font-size:{px}px">'
            f'<thead><tr><th align="left" bgcolor="{HEAD_BG}">{unit} ({UNIT_POWERS[unit]} B)</th>{head}</tr></thead>'
            '<tbody>'
            + "".join(rows) + "</tbody></table>")


def _png_side_html(content: ReportContent, result: Result) -> str:
    v = result.verdict
    parts = [_png_ledger_html(result, 15, content.measured_peaks, content.measured_reference or None)]
    keys = ("Largest object", "Tensor peak", "Largest micro-batch that fits")
    if content.per_gpu:
        keys = ("GPU", *keys, "Host memory")
    facts = [(k, val) for k, val in content.verdict if k in keys]
    parts.append('<table width="100%" border="0" cellspacing="0" cellpadding="3" style="font-size:15px; '
                 'margin-top:14px">' + "".join(f'<tr><td width="44%" style="color:{MUTED}">{_e(k)}</td>'
                                               f"<td>{_e(val)}</td></tr>" for k, val in facts) + "</table>")
    if content.plan_notes:
        parts.append('<p style="font-size:14px; margin-top:10px; margin-bottom:0px">'
                     + "<br>".join(_e(n) for n in content.plan_notes) + "</p>")
    if v.suggestions:
        items = "".join(
            f"<li>{_e(s.title)} — peak {_e(result.size(s.peak_bytes))}"
            f"{' (fits)' if s.fits else ' (still over)' if s.fits is False else ''}</li>"
            for s in v.suggestions[:3])
        parts.append(f'<p style="font-size:15px; font-weight:600; margin-top:12px; margin-bottom:2px">'
                     f'Top suggestions</p><ol style="font-size:14px; margin-top:0px">{items}</ol>')
    return (f'<html><body style="font-family:\'{report_family()}\'; color:{TEXT}">' + "".join(parts)
            + "</body></html>")




def png_size(timeline: Timeline | None, size: tuple[int, int] = PNG_SIZE) -> tuple[int, int]:
    """The PNG's pixels: ``size``, taller by a strip when a timeline is drawn."""
    return (size[0], size[1] + (PNG_TIMELINE_PX if timeline is not None and timeline.events else 0))


def render_png(content: ReportContent, result: Result, size: tuple[int, int] = PNG_SIZE,
               timeline: Timeline | None = None) -> bytes:
    """One image with the verdict, the chart and the ledger table (and ``timeline`` in a strip below), as PNG
    bytes."""
    w, h = size
    full_h = png_size(timeline, size)[1]
    margin = 28
    device = _layout_device()
    image = QImage(w, full_h, QImage.Format.Format_RGB32)
    dots = round(DOC_DPI / 0.0254)
    image.setDotsPerMeterX(dots)
    image.setDotsPerMeterY(dots)
    image.fill(QColor("#FFFFFF"))
    accent, bg = _verdict_colors(content.fits)
    family = report_family()

    painter = QPainter(image)
    try:
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setRenderHint(QPainter.RenderHint.TextAntialiasing)
        painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)

        head = (f'<html><body style="font-family:\'{family}\'; color:{TEXT}">'
                f'<p style="font-size:30px; font-weight:600; margin:0px">{_e(content.title)}</p>'
                f'<p style="font-size:17px; color:{MUTED}; margin-top:4px">{_e(content.subtitle)}</p>'
                "</body></html>")
        head_doc = make_document(head, w - 2 * margin - 300, {}, device)
        painter.save()
        painter.translate(margin, 20)
        head_doc.drawContents(painter)
        painter.restore()
        stamp = QFont(family)
        stamp.setPixelSize(14)
        painter.setFont(stamp)
        painter.setPen(QColor(MUTED))
        painter.drawText(QRectF(w - margin - 300, 22, 300, 40),
                         Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignTop,
                         f"memcalc {content.version}\n{content.date}")
        y = 20 + head_doc.size().height() + 10

        banner_html = (f'<html><body style="font-family:\'{family}\'; color:{TEXT}">'
                       f'<p style="font-size:21px; font-weight:600; margin:0px; color:{accent}">'
                       f"{_e(content.headline)}</p></body></html>")
        banner_doc = make_document(banner_html, w - 2 * margin - 36, {}, device)
        bh = banner_doc.size().height() + 24
        painter.setPen(QColor(accent))
        painter.setBrush(QColor(bg))
        painter.drawRoundedRect(QRectF(margin, y, w - 2 * margin, bh), 8, 8)
        painter.save()
        painter.translate(margin + 18, y + 12)
        banner_doc.drawContents(painter)
        painter.restore()
        y += bh + 16

        foot = QFont(family)
        foot.setPixelSize(13)
        foot_text = (f"Setup: {result.setup.summary()} · method {content.method} · binary units "
                     "(1 GiB = 2³⁰ bytes)")
        foot_flags = Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter | Qt.TextFlag.TextWordWrap
        # a long setup line wraps (a layout with experts and offload runs past one line at 1600 px) and the body
        # gives up the height it takes
        foot_h = max(26, QFontMetrics(foot, device).boundingRect(
            QRect(0, 0, w - 2 * margin, 10_000), foot_flags, foot_text).height() + 8)
        body_h = h - y - foot_h - 8
        side_w = 560
        chart_w = w - 2 * margin - side_w - 24
        ratio = 1.4
        chart = render_chart(result, round(chart_w / ratio), round(body_h / ratio), ratio, content)
        painter.drawImage(QRectF(margin, y, chart_w, body_h), chart)

        side_doc = make_document(_png_side_html(content, result), side_w, {}, device)
        painter.save()
        painter.translate(w - margin - side_w, y)
        side_doc.drawContents(painter, QRectF(0, 0, side_w, body_h))
        painter.restore()

        if full_h > h and timeline is not None:
            top = h - foot_h
            painter.setPen(QColor(RULE))
            painter.drawLine(QPointF(margin, top), QPointF(w - margin, top))
            title = QFont(family)
            title.setPixelSize(18)
            title.setWeight(QFont.Weight.DemiBold)
            painter.setFont(title)
            painter.setPen(QColor(TEXT))
            painter.drawText(QRectF(margin, top + 8, w - 2 * margin, 26),
                             Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, "Memory over time")
            caption = QFont(family)
            caption.setPixelSize(13)
            painter.setFont(caption)
            painter.setPen(QColor(MUTED))
            what = content.timeline_caption.split(":")[0] if content.timeline_caption else ""
            painter.drawText(QRectF(margin + 190, top + 8, w - 2 * margin - 190, 26),
                             Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, what)
            fig_h = PNG_TIMELINE_PX - 44
            figure = render_timeline(timeline, result, round((w - 2 * margin) / ratio), round(fig_h / ratio), ratio)
            painter.drawImage(QRectF(margin, top + 38, w - 2 * margin, fig_h), figure)

        painter.setFont(foot)
        painter.setPen(QColor(MUTED))
        painter.drawText(QRectF(margin, full_h - foot_h - 6, w - 2 * margin, foot_h), foot_flags, foot_text)
    finally:
        painter.end()

    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buffer, "PNG"):
        raise RuntimeError("the PNG encoder failed")
    buffer.close()
    return bytes(data.data())
