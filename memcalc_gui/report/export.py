"""``export_report(result, path)``: the budget report as a PDF or a PNG, chosen by the file's extension.

The file is rendered to memory first, written to a temporary file in the target folder, flushed and
``fsync``-ed, then moved over the target with ``os.replace``: an unwritable folder, a full disk or an
interrupted write raises :class:`ReportWriteError` (path and reason) and leaves nothing behind — no
partial file, and an existing report of the same name unchanged.

Qt needs an application for fonts and the chart widget: one is created (offscreen when there is no
display) when none exists.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import InputError, MemcalcError
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


class ReportWriteError(ReportError):
    """The report could not be written to ``path``; nothing was left behind."""

    field = "out"

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cannot write {path}: {reason}; nothing was written")
        self.path = path
        self.reason = reason


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


# ---- writing --------------------------------------------------------------------------------------
def _write_chunk(fd: int, data: memoryview) -> int:
    """One ``os.write`` (tests replace it to simulate a full disk)."""
    return os.write(fd, data)


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "the disk is full (no space left on device)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.EROFS:
        return "the file system is read-only"
    if exc.errno == errno.ENOENT:
        return "the folder does not exist"
    return exc.strerror or str(exc)


def _new_file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` all or nothing (temporary file in the same folder, then ``os.replace``).

    A symbolic link is followed: its target is replaced and the link stays. The temporary file has a short
    name of its own, so a target name at the file system's length limit still works.
    """
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.is_dir():
        raise ReportWriteError(path, "it is a folder")
    if not path.parent.is_dir():
        raise ReportWriteError(path, f"the folder {path.parent} does not exist")
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=".memcalc-", suffix=".part", dir=path.parent)
    except OSError as exc:
        raise ReportWriteError(path, _reason(exc)) from exc
    tmp = Path(tmp_name)
    done = False
    try:
        try:
            view = memoryview(data)
            while view:
                n = _write_chunk(fd, view)
                if n <= 0:
                    raise OSError(errno.EIO, "the write made no progress")
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except OSError:
            mode = _new_file_mode()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        done = True
    except OSError as exc:
        raise ReportWriteError(path, _reason(exc)) from exc
    finally:
        if not done:
            with contextlib.suppress(OSError):
                tmp.unlink()


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
    target = target.absolute()
    if target.is_dir():
        raise ReportWriteError(target, "it is a folder")
    if not target.parent.is_dir():
        raise ReportWriteError(target, f"the folder {target.parent} does not exist")

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
    atomic_write(target, data)
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
