"""Read-only tables as tall as their rows, for the Measured and Trace tabs (no scroll bars of their own: the tab
scrolls)."""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QSizePolicy, QTableWidget


def fixed_table(rows: int, header: Sequence[str], name: str, accessible: str = "") -> QTableWidget:
    """A read-only table, its columns sharing the width; hidden until filled."""
    table = QTableWidget(rows, len(header))
    table.setObjectName(name)
    if accessible:
        table.setAccessibleName(accessible)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.setAlternatingRowColors(True)
    table.setTabKeyNavigation(False)
    table.setWordWrap(False)
    table.setHorizontalHeaderLabels(list(header))
    table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
    table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    table.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
    table.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
    table.setVisible(False)
    return table


def fit_height(table: QTableWidget) -> None:
    """Make ``table`` exactly as tall as its header and rows."""
    table.resizeRowsToContents()
    rows = sum(table.rowHeight(r) for r in range(table.rowCount()))
    table.setFixedHeight(table.horizontalHeader().sizeHint().height() + rows + 2 * table.frameWidth() + 2)
