"""File → Export report… in the window: choose a file, write the report, say what happened.

The format comes from the file's extension, or from the chooser's filter when the name has none (or
another one). The last folder (and format) is remembered in the window's QSettings. A failure is a
file operation's error, so it is shown in a message box; the report is written atomically, so a
failed export leaves nothing behind and an existing file unchanged.
"""

from __future__ import annotations

from datetime import date
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QFileDialog, QMessageBox, QWidget

from ..core.errors import MemcalcError
from ..core.vocab import PHASE_LABELS
from .export import FORMATS, ReportFile, write_report

KEY_LAST_FOLDER = "report/last_folder"
KEY_LAST_FORMAT = "report/last_format"
FOLDER_PROPERTY = "memcalcReportFolder"  # where a window without settings remembers the folder
FILTERS = {"pdf": "PDF document (*.pdf)", "png": "PNG image for a slide or a chat (*.png)"}
TITLE = "Export report"


def _settings(window: QWidget) -> Any:
    return getattr(window, "settings", None)


def last_folder(window: QWidget) -> Path:
    """The folder of the last export (settings, or this window's memory), else the home folder."""
    settings = _settings(window)
    value = settings.value(KEY_LAST_FOLDER) if settings is not None else window.property(FOLDER_PROPERTY)
    if value:
        folder = Path(str(value)).expanduser()
        if folder.is_dir():
            return folder
    return Path.home()


def remember(window: QWidget, written: ReportFile) -> None:
    folder = str(written.path.parent)
    settings = _settings(window)
    if settings is not None:
        settings.setValue(KEY_LAST_FOLDER, folder)
        settings.setValue(KEY_LAST_FORMAT, written.format)
        settings.sync()
    else:
        window.setProperty(FOLDER_PROPERTY, folder)


def suggested_name(result: Any, fmt: str) -> str:
    setup = result.setup
    model = setup.model.name if setup.model is not None and setup.model.name else f"{setup.num_params}-params"
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in model).strip("-.") or "model"
    return f"memcalc-{safe}-{date.today().isoformat()}.{fmt}"


def with_extension(path: str, selected_filter: str) -> Path:
    """``path`` as typed when it ends in .pdf/.png, else with the chosen filter's extension added."""
    p = Path(path).expanduser()
    if p.suffix.lower() in FORMATS:
        return p
    fmt = "png" if selected_filter == FILTERS["png"] else "pdf"
    return p.with_name(f"{p.name}.{fmt}")


def current_measurement(window: QWidget) -> Any:
    """The window's measurement when it still matches the setup on screen (None otherwise)."""
    panel = getattr(window, "measure_panel", None)
    result = getattr(panel, "result", None)
    if result is None:
        return None
    is_stale = getattr(panel, "is_stale", None)
    if callable(is_stale) and is_stale():
        return None
    return result


def _drawn_trace(window: QWidget) -> Any:
    """The window's TraceResult when the drawn result is that trace (None otherwise)."""
    trace = getattr(window, "trace_result", None)
    result = getattr(window, "result", None)
    if trace is None or result is None or result.estimate.method != "trace":
        return None
    if getattr(trace, "estimate", None) is not result.estimate:
        return None
    return trace


def current_modules(window: QWidget) -> list[tuple[str, int]] | None:
    """The per-module breakdown of the trace drawn in the window (None when the analytic result is drawn)."""
    modules = getattr(_drawn_trace(window), "modules", None)
    return list(modules) if modules else None


def current_notes(window: QWidget) -> list[str]:
    """For a drawn trace: how it differs from the analytic estimate, per phase (a note in the report)."""
    trace = _drawn_trace(window)
    if trace is None:
        return []
    diffs = trace.difference_pct()
    if not diffs:
        return []
    phases = ", ".join(f"{PHASE_LABELS[p]} {round(d, 1) or 0.0:+.1f} %" for p, d in diffs.items())
    return [f"Trace vs analytic, tensor bytes per phase (traced in {trace.seconds:.1f} s): {phases}"]


def current_timeline(window: QWidget) -> Any:
    """The Timeline tab's timeline when it is more than the ledger drawn over time (a trace's, a measured step's,
    an opened snapshot): the coarse one adds nothing the phase chart does not say."""
    panel = getattr(window, "timeline_panel", None)
    if panel is None or getattr(panel, "kind", "") == "ledger":
        return None
    return getattr(panel, "timeline", None)


def choose_path(window: QWidget, result: Any) -> Path | None:
    settings = _settings(window)
    fmt = str(settings.value(KEY_LAST_FORMAT) or "pdf") if settings is not None else "pdf"
    fmt = fmt if fmt in FILTERS else "pdf"
    start = last_folder(window) / suggested_name(result, fmt)
    path, selected = QFileDialog.getSaveFileName(window, TITLE, str(start), ";;".join(FILTERS.values()),
                                                 FILTERS[fmt])
    if not path:
        return None
    return with_extension(path, selected)


def export_from_window(window: QWidget, path: str | Path | None = None) -> Path | None:
    """Ask for a file (unless ``path`` is given) and write the report of the window's current result.

    Returns the written path, or None when cancelled or failed (the failure is shown in a message box).
    """
    result = getattr(window, "result", None)
    if result is None:
        QMessageBox.information(window, TITLE, "There is no estimate to export yet: fix the inputs first.")
        return None
    target = Path(path).expanduser() if path is not None else choose_path(window, result)
    if target is None:
        return None
    QApplication.setOverrideCursor(Qt.CursorShape.WaitCursor)
    try:
        written = write_report(result, target, measurement=current_measurement(window),
                               modules=current_modules(window), notes=current_notes(window),
                               timeline=current_timeline(window))
    except MemcalcError as exc:
        QApplication.restoreOverrideCursor()
        QMessageBox.critical(window, TITLE, f"The report was not exported.\n\n{exc}")
        return None
    except Exception as exc:  # a rendering bug must not close the window with unsaved work
        QApplication.restoreOverrideCursor()
        QMessageBox.critical(window, TITLE, f"The report was not exported (unexpected error).\n\n{exc}")
        return None
    QApplication.restoreOverrideCursor()
    remember(window, written)
    status = getattr(window, "statusBar", None)
    if callable(status):
        status().showMessage(f"Exported the report: {written.describe()}", 10000)
    return written.path
