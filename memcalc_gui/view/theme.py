"""Colours and palette helpers shared by the chart, the ledger table and the banner.

Seed 000 fixes five colours (parameters blue, activations orange, gradients yellow, optimizer state
green, optimizer intermediates red). They and the remaining objects come from the Okabe–Ito palette,
which stays distinguishable for the common colour-vision deficiencies.
"""

from __future__ import annotations

from typing import Final

from PySide6.QtGui import QColor, QPalette

from ..core.vocab import OBJECTS

#: One colour per ledger object (hex, sRGB).
OBJECT_COLORS: Final[dict[str, str]] = {
    "parameters": "#0072B2",  # blue (Hugging Face blog)
    "activations": "#E69F00",  # orange (Hugging Face blog)
    "gradients": "#F0E442",  # yellow (Hugging Face blog)
    "optimizer_state": "#009E73",  # bluish green (Hugging Face blog)
    "optimizer_temporaries": "#D55E00",  # vermillion (Hugging Face blog: red)
    "temporaries": "#56B4E9",  # sky blue
    "inputs": "#CC79A7",  # reddish purple
    "paged_optimizer_state": "#8CD9BF",  # light bluish green: optimizer state outside the allocator
    "cuda_context": "#6E6E6E",  # dark grey
    "allocator_reserve": "#BDBDBD",  # light grey
}
assert set(OBJECT_COLORS) == set(OBJECTS)

#: Stacking order, bottom to top: the context exists before anything else, the reserve sits on top.
STACK_ORDER: Final = (
    "cuda_context",
    "parameters",
    "optimizer_state",
    "paged_optimizer_state",
    "gradients",
    "optimizer_temporaries",
    "activations",
    "temporaries",
    "inputs",
    "allocator_reserve",
)
assert set(STACK_ORDER) == set(OBJECTS)

FIT_COLOR: Final = "#1A7F37"
OVER_COLOR: Final = "#C62828"
NEUTRAL_COLOR: Final = "#5C6BC0"


def is_dark(palette: QPalette) -> bool:
    """Whether the palette draws light text on a dark window."""
    return palette.color(QPalette.ColorRole.Window).lightnessF() < 0.5


def error_color(palette: QPalette) -> QColor:
    """A red that stays readable on the palette's window colour."""
    return QColor("#FF8A80") if is_dark(palette) else QColor("#B71C1C")


def tinted(color: str, alpha: int) -> str:
    """A CSS ``rgba()`` of ``color`` with ``alpha`` (0–255), for backgrounds that work on light and dark."""
    c = QColor(color)
    return f"rgba({c.red()}, {c.green()}, {c.blue()}, {alpha})"
