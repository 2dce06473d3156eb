"""The ledger as a table: memory objects × phases in one binary unit (GiB, or TiB and up for a peak past 1 TiB,
``units.screen_unit``), with totals; Ctrl+C copies TSV."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import (
    QAction,
    QBrush,
    QColor,
    QFont,
    QFontMetrics,
    QGuiApplication,
    QIcon,
    QKeySequence,
    QPixmap,
)
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem, QWidget

from ..core.ledger import Estimate
from ..core.units import format_bytes, in_unit, screen_unit
from ..core.vocab import OBJECT_LABELS, OBJECTS, PHASE_LABELS, PHASES
from ..view.theme import OBJECT_COLORS

BYTES_ROLE = Qt.ItemDataRole.UserRole + 1
#: Column headers (short, so four columns fit beside the object names); the full names are tooltips.
HEADER_LABELS = {p: PHASE_LABELS[p] for p in PHASES} | {"optimizer_step": "Step"}
TOTAL_ROW = len(OBJECTS)
TABLE_TIP = ("{unit} per object and phase (hover a cell for exact bytes). Ctrl+C copies the selection (or the whole "
             "table) as tab-separated values.")


def _swatch(color: str) -> QIcon:
    pix = QPixmap(12, 12)
    pix.fill(QColor(color))
    return QIcon(pix)


def _cell_text(n: int, unit: str = "GiB") -> str:
    if n == 0:
        return "–"
    g = in_unit(n, unit)
    return f"{g:.2f}" if g >= 0.005 else "<0.01"


class LedgerTable(QTableWidget):
    """Rows: the nine ledger objects and the total; columns: the four phases. Values in :attr:`unit`;
    ``unit_changed`` tells the window to relabel its tab."""

    unit_changed = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(len(OBJECTS) + 1, len(PHASES), parent)
        self.setObjectName("ledgerTable")
        self.setAccessibleName("Ledger: memory objects by phase, GiB")
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectItems)
        self.setAlternatingRowColors(True)
        self.setWordWrap(False)
        self.setTabKeyNavigation(False)  # Tab leaves the table (keyboard users move on)
        self.setToolTip(TABLE_TIP.format(unit="GiB"))
        self.setVerticalHeaderLabels([OBJECT_LABELS[o] for o in OBJECTS] + ["Total"])
        self.setHorizontalHeaderLabels([HEADER_LABELS[p] + "\n" for p in PHASES])
        for c, p in enumerate(PHASES):
            self.horizontalHeaderItem(c).setToolTip(PHASE_LABELS[p])
        for r, obj in enumerate(OBJECTS):
            self.verticalHeaderItem(r).setIcon(_swatch(OBJECT_COLORS[obj]))
        bold = QFont(self.font())
        bold.setBold(True)
        self.verticalHeaderItem(TOTAL_ROW).setFont(bold)
        hh = self.horizontalHeader()
        hh.setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        # narrow enough for four columns beside the object names at 1280×720 and at 150 % scaling: the widest
        # number or single header word (headers wrap onto their second line)
        words = [w for h in HEADER_LABELS.values() for w in h.split()] + ["▲ peak", "99999.99"]
        hh.setMinimumSectionSize(max(QFontMetrics(bold).horizontalAdvance(w) for w in words) + 10)
        vh = self.verticalHeader()
        vh.setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        vh.setDefaultSectionSize(max(20, self.fontMetrics().height() + 6))
        for r in range(self.rowCount()):
            for c in range(self.columnCount()):
                item = QTableWidgetItem("")
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                item.setFlags(Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemIsEnabled)
                if r == TOTAL_ROW:
                    item.setFont(bold)
                self.setItem(r, c, item)
        copy = QAction("Copy as TSV (GiB)", self)
        copy.setShortcut(QKeySequence.StandardKey.Copy)
        copy.setShortcutContext(Qt.ShortcutContext.WidgetShortcut)
        copy.triggered.connect(self.copy_selection)
        copy_bytes = QAction("Copy as TSV (exact bytes)", self)
        copy_bytes.triggered.connect(lambda: self.copy_selection(exact_bytes=True))
        select_all = QAction("Select all", self)
        select_all.triggered.connect(self.selectAll)
        self.addActions([copy, copy_bytes, select_all])
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.ActionsContextMenu)
        self._peak_col = -1
        self.unit = "GiB"
        self._copy_action = copy

    def set_estimate(self, estimate: Estimate) -> None:
        peak_col = PHASES.index(estimate.peak_phase)
        unit = screen_unit(max(ledger.total_bytes for ledger in estimate.phases.values()))
        if unit != self.unit:
            self.unit = unit
            self.setAccessibleName(f"Ledger: memory objects by phase, {unit}")
            self.setToolTip(TABLE_TIP.format(unit=unit))
            self._copy_action.setText(f"Copy as TSV ({unit})")
            self.unit_changed.emit(unit)
        split = estimate.details.get("parameter_split") or {}
        split_text = "; of which " + ", ".join(f"{k} {format_bytes(v)}" for k, v in split.items()) if split else ""
        for c, phase in enumerate(PHASES):
            ledger = estimate.phases[phase]
            for r, obj in enumerate(OBJECTS):
                n = ledger.objects[obj]
                extra = split_text if obj == "parameters" and n else ""
                self._set(r, c, n, f"{OBJECT_LABELS[obj]}, {PHASE_LABELS[phase]}: {n:,} bytes{extra}")
            self._set(TOTAL_ROW, c, ledger.total_bytes, f"Total, {PHASE_LABELS[phase]}: {ledger.total_bytes:,} bytes")
        if peak_col != self._peak_col:
            self._peak_col = peak_col
            for c, phase in enumerate(PHASES):
                label = HEADER_LABELS[phase] + ("\n▲ peak" if c == peak_col else "\n")
                self.horizontalHeaderItem(c).setText(label)
                f = QFont(self.font())
                f.setBold(c == peak_col)
                self.horizontalHeaderItem(c).setFont(f)
            for r in range(self.rowCount()):
                for c in range(self.columnCount()):
                    self.item(r, c).setBackground(QBrush(QColor(255, 200, 0, 45)) if c == peak_col else QBrush())

    def _set(self, r: int, c: int, n: int, tip: str) -> None:
        item = self.item(r, c)
        text = _cell_text(n, self.unit)
        if item.text() != text:
            item.setText(text)
        item.setData(BYTES_ROLE, str(int(n)))  # as text: Qt's integer roles stop at 2^63, a hostile ledger does not
        item.setToolTip(tip)

    def bytes_at(self, row: int, col: int) -> int:
        """The exact bytes behind a cell (0 for an empty one)."""
        n = self.item(row, col).data(BYTES_ROLE)
        return int(n) if n else 0

    def to_tsv(self, rows: list[int] | None = None, cols: list[int] | None = None, *, exact_bytes: bool = False) -> str:
        """Tab-separated values with a header row and the object names; the table's unit (4 decimals) or bytes."""
        rows = list(range(self.rowCount())) if rows is None else rows
        cols = list(range(self.columnCount())) if cols is None else cols
        unit = "bytes" if exact_bytes else self.unit
        lines = ["\t".join([f"Object ({unit})"] + [PHASE_LABELS[PHASES[c]] for c in cols])]
        for r in rows:
            name = self.verticalHeaderItem(r).text()
            cells = []
            for c in cols:
                n = self.bytes_at(r, c)
                cells.append(str(n) if exact_bytes else f"{in_unit(n, self.unit):.4f}")
            lines.append("\t".join([name, *cells]))
        return "\n".join(lines) + "\n"

    def copy_selection(self, exact_bytes: bool = False) -> str:
        """Copy the selected cells' bounding rows × columns (all when nothing is selected)."""
        indexes = self.selectedIndexes()
        if indexes:
            rows = sorted({i.row() for i in indexes})
            cols = sorted({i.column() for i in indexes})
            text = self.to_tsv(rows, cols, exact_bytes=exact_bytes)
        else:
            text = self.to_tsv(exact_bytes=exact_bytes)
        QGuiApplication.clipboard().setText(text)
        return text
