"""The ledger as a table: memory objects × phases in the result's one binary unit (GiB on any GPU, or TiB and up for
a capacity — without one, a peak — past 1 TiB: ``units.result_unit``), with totals; Ctrl+C copies TSV."""

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

from ..core.ledger import Estimate, parameter_rows, shown_objects
from ..core.units import in_unit, result_unit
from ..core.vocab import OBJECT_LABELS, OBJECTS, PHASE_LABELS, PHASES, UNIFIED_OBJECTS
from ..view.theme import OBJECT_COLORS

BYTES_ROLE = Qt.ItemDataRole.UserRole + 1
#: Column headers (short, so four columns fit beside the object names); the full names are tooltips.
HEADER_LABELS = {p: PHASE_LABELS[p] for p in PHASES} | {"optimizer_step": "Step"}
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
    """Rows: the ledger objects (the paged optimizer state only when a setup has it), the parameters' parts of a
    fine-tuning run as indented sub-rows, and the total; columns: the four phases. Values in :attr:`unit`;
    ``unit_changed`` tells the window to relabel its tab."""

    unit_changed = Signal(str)
    rows_changed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(0, len(PHASES), parent)
        self.setObjectName("ledgerTable")
        self.setAccessibleName("Ledger: memory objects by phase, GiB")
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectItems)
        self.setAlternatingRowColors(True)
        self.setWordWrap(False)
        self.setTabKeyNavigation(False)  # Tab leaves the table (keyboard users move on)
        self.setToolTip(TABLE_TIP.format(unit="GiB"))
        self.setHorizontalHeaderLabels([HEADER_LABELS[p] + "\n" for p in PHASES])
        for c, p in enumerate(PHASES):
            self.horizontalHeaderItem(c).setToolTip(PHASE_LABELS[p])
        self._bold = QFont(self.font())
        self._bold.setBold(True)
        hh = self.horizontalHeader()
        hh.setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        # narrow enough for four columns beside the object names at 1280×720 and at 150 % scaling: the widest
        # number or single header word (headers wrap onto their second line)
        words = [w for h in HEADER_LABELS.values() for w in h.split()] + ["▲ peak", "99999.99"]
        hh.setMinimumSectionSize(max(QFontMetrics(self._bold).horizontalAdvance(w) for w in words) + 10)
        vh = self.verticalHeader()
        vh.setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        vh.setDefaultSectionSize(max(20, self.fontMetrics().height() + 6))
        self.rows: tuple[tuple[str, str], ...] = ()  # (kind, key): ("object", name), ("part", name), ("total", "")
        self._peak_col = -1
        self._layout_rows((*(("object", o) for o in OBJECTS if o not in UNIFIED_OBJECTS), ("total", "")))
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
        self.unit = "GiB"
        self._copy_action = copy

    @property
    def total_row(self) -> int:
        return len(self.rows) - 1

    def row_of(self, kind: str, key: str = "") -> int:
        """The row of an object (``"object"``, name), a parameters part (``"part"``, name) or the total."""
        return self.rows.index((kind, key))

    def _layout_rows(self, rows: tuple[tuple[str, str], ...]) -> None:
        """Set the rows (kept when they do not change: selection and scroll stay)."""
        if rows == self.rows:
            return
        self.clearSelection()
        self.setRowCount(len(rows))
        italic = QFont(self.font())
        italic.setItalic(True)
        for r, (kind, key) in enumerate(rows):
            if kind == "object":
                head = QTableWidgetItem(_swatch(OBJECT_COLORS[key]), OBJECT_LABELS[key])
            elif kind == "part":
                head = QTableWidgetItem(f"   ↳ {key}")
                head.setFont(italic)
                head.setToolTip(f"Parameters: {key}")
            else:
                head = QTableWidgetItem("Total")
                head.setFont(self._bold)
            self.setVerticalHeaderItem(r, head)
            for c in range(self.columnCount()):
                item = QTableWidgetItem("")
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                item.setFlags(Qt.ItemFlag.ItemIsSelectable | Qt.ItemFlag.ItemIsEnabled)
                if kind == "total":
                    item.setFont(self._bold)
                elif kind == "part":
                    item.setFont(italic)
                self.setItem(r, c, item)
        self.rows = rows
        self._peak_col = -1  # new items: paint the peak column again
        self.rows_changed.emit()

    def set_estimate(self, estimate: Estimate) -> None:
        peak_col = PHASES.index(estimate.peak_phase)
        unit = result_unit(estimate.peak_bytes, estimate.setup.capacity_bytes)  # the verdict's and the chart's
        if unit != self.unit:
            self.unit = unit
            self.setAccessibleName(f"Ledger: memory objects by phase, {unit}")
            self.setToolTip(TABLE_TIP.format(unit=unit))
            self._copy_action.setText(f"Copy as TSV ({unit})")
            self.unit_changed.emit(unit)
        parts = parameter_rows(estimate)
        rows: list[tuple[str, str]] = []
        for obj in shown_objects(estimate):
            rows.append(("object", obj))
            if obj == "parameters":
                rows += [("part", name) for name, _ in parts]
        self._layout_rows((*rows, ("total", "")))
        part_bytes = dict(parts)
        for c, phase in enumerate(PHASES):
            ledger = estimate.phases[phase]
            for r, (kind, key) in enumerate(self.rows):
                if kind == "object":
                    n = ledger.objects[key]
                    self._set(r, c, n, f"{OBJECT_LABELS[key]}, {PHASE_LABELS[phase]}: {n:,} bytes")
                elif kind == "part":
                    n = part_bytes[key][phase]
                    self._set(r, c, n, f"Parameters, of which {key}, {PHASE_LABELS[phase]}: {n:,} bytes")
                else:
                    n = ledger.total_bytes
                    self._set(r, c, n, f"Total, {PHASE_LABELS[phase]}: {n:,} bytes")
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
            kind, key = self.rows[r]
            name = OBJECT_LABELS[key] if kind == "object" else (f"of which {key}" if kind == "part" else "Total")
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
