"""Bundled fonts and the application icon."""

from __future__ import annotations

import os
from pathlib import Path

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QFont, QFontDatabase, QGuiApplication, QIcon, QImage, QPainter

from ..core.resources import resources_dir

FONT_FILES = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf")
BUNDLED_FAMILY = "DejaVu Sans"
#: Set to 1 to use the bundled font even when the system has fonts (consistent screenshots).
FONT_ENV = "MEMCALC_BUNDLED_FONT"

_registered: list[str] = []
#: Names fontconfig reports even when no font file exists.
_GENERIC_ALIASES = frozenset({"Sans Serif", "Serif", "Monospace", "Sans", "Mono"})


def fonts_dir() -> Path:
    return resources_dir() / "fonts"


def icon_path(ext: str = "png") -> Path:
    return resources_dir() / "icons" / f"memcalc.{ext}"


def register_fonts(app: QGuiApplication) -> list[str]:
    """Register the bundled DejaVu fonts; make them the application font where the system has none.

    Returns the families registered. Without any system font, Qt draws every glyph as a box and
    says nothing, so the bundled family becomes the default there (or always, with ``MEMCALC_BUNDLED_FONT=1``).
    """
    if _registered:
        return list(_registered)
    system_families = set(QFontDatabase.families())
    for name in FONT_FILES:
        path = fonts_dir() / name
        if not path.is_file():
            continue
        font_id = QFontDatabase.addApplicationFont(str(path))
        if font_id >= 0:
            _registered.extend(QFontDatabase.applicationFontFamilies(font_id))
    if not _registered:
        return []
    only_ours = not (system_families - set(_registered) - _GENERIC_ALIASES)
    if only_ours or os.environ.get(FONT_ENV) == "1":
        font = QFont(BUNDLED_FAMILY)
        size = app.font().pointSizeF()
        font.setPointSizeF(size if size > 0 else 10.0)
        app.setFont(font)
    return list(dict.fromkeys(_registered))


def app_icon() -> QIcon:
    """The window icon (PNG, plus the SVG for sharp large sizes where the SVG plugin exists)."""
    icon = QIcon()
    png = icon_path("png")
    if png.is_file():
        icon.addFile(str(png), QSize(256, 256))
    svg = icon_path("svg")
    if svg.is_file():
        icon.addFile(str(svg))
    return icon


def render_svg_png(svg: Path, png: Path, size: int = 256) -> bool:
    """Render ``svg`` to a square ``size`` PNG with Qt (how ``resources/icons/memcalc.png`` is made)."""
    from PySide6.QtSvg import QSvgRenderer  # only needed for this build step

    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        return False
    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter)
    painter.end()
    return image.save(str(png))
