"""Locate bundled resources the same way from a checkout, an installed wheel and a frozen app.

The wheel maps the checkout's top-level ``resources/`` folder to the package ``memcalc_gui.resources``
(see pyproject.toml); PyInstaller copies it to ``<bundle>/resources``.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import ResourceError


@lru_cache(maxsize=1)
def resources_dir() -> Path:
    """The folder holding ``models/``, ``gpus.json``, icons and fonts."""
    candidates: list[Path] = []
    frozen_root = getattr(sys, "_MEIPASS", None)
    if frozen_root:
        candidates.append(Path(frozen_root) / "resources")
    package_dir = Path(__file__).resolve().parent.parent
    candidates.append(package_dir / "resources")  # installed wheel: memcalc_gui/resources
    candidates.append(package_dir.parent / "resources")  # checkout or editable install
    for path in candidates:
        if (path / "gpus.json").is_file():
            return path
    raise ResourceError("bundled resources not found; looked in " + ", ".join(map(str, candidates)))


def load_json(relative: str) -> Any:
    """Read a JSON resource (``gpus.json``, ``models/llama-3.1-8b.json``)."""
    path = resources_dir() / relative
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ResourceError(f"cannot read resource {relative}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ResourceError(f"resource {relative} is not valid JSON: {exc}") from exc
