"""``export_report(result, path)``: the budget report as a PDF or a PNG, chosen by the file's extension.

The file is rendered to memory first, then written whole by :func:`memcalc_gui.core.files.atomic_write`
(a temporary file in the target folder, ``fsync``, ``os.replace``): an unwritable folder, a full disk, an
interrupted write, a target that is a device, FIFO or socket (or a link to one) or a name too long for the file
system raises :class:`ReportWriteError` (path and reason) and leaves nothing behind — no partial file, and an
existing report of the same name unchanged.

Qt needs an application for fonts and the chart widget: one is created (offscreen when there is no
display) when none exists.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import InputError, MemcalcError
from ..core.files import OutputError, atomic_write, check_output
from ..core.result import Result
from ..core.timeline import Timeline

if TYPE_CHECKING:
    from ..measure.engine import MeasureResult

FORMATS = {".pdf": "pdf", ".png": "png"}
PAGES = ("a4", "letter")
PAGE_LABELS = {"a4": "A4", "letter": "Letter"}

#: Territories (ISO 3166 codes) whose default paper is US Letter; everything else defaults to A4.
LETTER_TERRITORIES = frozenset({
    "US", "CA", "MX", "PH", "CL", "CO", "VE", "CR", "GT", "PA", "DO", "PR", "SV", "NI", "BZ",
    "UM", "VI", "AS", "GU", "MP",
})

_app: Any = None  # the application this module created, kept alive


class ReportError(MemcalcError):
    """A report could not be produced."""


class ReportWriteError(OutputError, ReportError):
    """The report could not be written to ``path``; nothing was left behind (field ``out``)."""

    def __init__(self, path: Path, reason: str) -> None:
        OutputError.__init__(self, "out", path, reason)


@dataclass(frozen=True)
class ReportFile:
    """What :func:`write_report` wrote."""

    path: Path
    format: str  # "pdf" or "png"
    page: str | None  # "a4"/"letter" for a PDF
    pages: int  # 1 for a PNG
    size_bytes: int
    pixels: tuple[int, int] | None = None  # a PNG's size

    def describe(self) -> str:
        if self.format == "pdf":
            assert self.page is not None
            what = f"PDF, {PAGE_LABELS[self.page]}, {self.pages} page{'s' if self.pages != 1 else ''}"
        else:
            assert self.pixels is not None
            what = f"PNG, {self.pixels[0]}×{self.pixels[1]} px"
        return f"{self.path} ({what})"


# ---- inputs ---------------------------------------------------------------------------------------
def default_page(locale: Any = None) -> str:
    """``letter`` where the locale's territory uses US Letter (US, CA, MX, PH, …), else ``a4``."""
    from PySide6.QtCore import QLocale

    loc = locale if locale is not None else QLocale()
    code = QLocale.territoryToCode(loc.territory())
    return "letter" if code.upper() in LETTER_TERRITORIES else "a4"


def report_format(path: str | os.PathLike[str]) -> str:
    """``pdf`` or ``png`` from the file name; anything else is an :class:`InputError` on ``out``."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        shown = f"{suffix!r}" if suffix else "no extension"
        raise InputError("out", f"unknown report format ({shown}): name the file .pdf or .png")
    return FORMATS[suffix]


def parse_page(page: str | None) -> str:
    if page is None:
        return default_page()
    key = str(page).strip().lower()
    if key not in PAGES:
        raise InputError("page", f"must be a4 or letter, got {page!r}")
    return key


def _check_modules(modules: Sequence[tuple[str, int]] | None) -> list[tuple[str, int]] | None:
    if modules is None:
        return None
    out = []
    for item in modules:
        try:
            name, n = item
        except (TypeError, ValueError):
            raise InputError("modules", f"each entry must be (module name, bytes), got {item!r}") from None
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InputError("modules", f"bytes of {name!r} must be a non-negative integer, got {n!r}")
        out.append((str(name), n))
    return out


# ---- Qt -------------------------------------------------------------------------------------------
def ensure_app() -> Any:
    """The running QApplication, or a new one (offscreen without a display); fonts registered."""
    global _app
    from PySide6.QtWidgets import QApplication

    from ..view.assets import register_fonts

    app = QApplication.instance()
    if app is None:
        headless = sys.platform.startswith("linux") and not (os.environ.get("DISPLAY")
                                                            or os.environ.get("WAYLAND_DISPLAY"))
        if headless and not os.environ.get("QT_QPA_PLATFORM"):
            os.environ["QT_QPA_PLATFORM"] = "offscreen"
        app = QApplication([sys.argv[0] if sys.argv and sys.argv[0] else "memcalc"])
        _app = app
    elif not isinstance(app, QApplication):
        raise ReportError("a report needs a QApplication (its chart is a widget), but a QGuiApplication is running")
    register_fonts(app)
    return app


# ---- the API --------------------------------------------------------------------------------------
def write_report(result: Result, path: str | os.PathLike[str], *, page: str | None = None,
                 measurement: MeasureResult | None = None, modules: Sequence[tuple[str, int]] | None = None,
                 notes: Sequence[str] = (), when: datetime | None = None,
                 timeline: Timeline | None = None) -> ReportFile:
    """Render and write the report; returns what was written (see :func:`export_report`). ``timeline`` adds a
    "Memory over time" figure."""
    target = Path(os.fspath(path)).expanduser()
    fmt = report_format(target)
    paper = parse_page(page) if fmt == "pdf" else None
    mods = _check_modules(modules)
    try:
        target = check_output(target, field="out")
    except OutputError as exc:
        raise ReportWriteError(exc.path, exc.why) from None

    ensure_app()
    from .content import build_content
    from .render import png_size, render_pdf, render_png

    content = build_content(result, measurement=measurement, modules=mods, notes=notes, when=when, timeline=timeline)
    if fmt == "pdf":
        assert paper is not None
        data, pages = render_pdf(content, result, paper, timeline)
        pixels = None
    else:
        drawn = timeline if content.timeline_caption else None
        data, pages, pixels = render_png(content, result, timeline=drawn), 1, png_size(drawn)
    try:
        atomic_write(target, data, field="out")
    except OutputError as exc:
        raise ReportWriteError(exc.path, exc.why) from None
    return ReportFile(target, fmt, paper, pages, len(data), pixels)


def export_report(result: Result, path: str | os.PathLike[str], *, page: str | None = None,
                  measurement: MeasureResult | None = None, modules: Sequence[tuple[str, int]] | None = None,
                  notes: Sequence[str] = ()) -> Path:
    """Write the report of ``result`` to ``path`` (``.pdf`` or ``.png``) and return the path.

    ``page``: ``"a4"`` or ``"letter"`` for a PDF (default from the locale). ``measurement``: a
    :class:`~memcalc_gui.measure.engine.MeasureResult` adds the measured-vs-estimated section;
    ``modules``: a trace's ``(module name, bytes)`` breakdown adds a per-module table. ``notes``: extra
    assumptions (e.g. the CLI's fallback notes). Raises :class:`InputError` (``out``, ``page``,
    ``modules``) or :class:`ReportWriteError`; a failed write leaves nothing behind.
    """
    return write_report(result, path, page=page, measurement=measurement, modules=modules, notes=notes).path
