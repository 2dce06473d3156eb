"""Where the window keeps the last setup and its geometry.

``QSettings`` with organization and application ``memcalc``. Set ``MEMCALC_SETTINGS_DIR`` to keep
them in ``<dir>/memcalc.ini`` instead (tests and portable installs do; tests never touch the
user's real settings).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Final

from PySide6.QtCore import QByteArray, QSettings

from .form import STATE_VERSION, FormState

ORGANIZATION: Final = "memcalc"
APPLICATION: Final = "memcalc"
SETTINGS_ENV: Final = "MEMCALC_SETTINGS_DIR"

KEY_SETUP: Final = "setup/state"
KEY_SETUP_VERSION: Final = "setup/version"  # the state's format (form.STATE_VERSION); none before version 2
KEY_GEOMETRY: Final = "window/geometry"
KEY_WINDOW_STATE: Final = "window/state"
KEY_SPLITTERS: Final = "window/splitters"


def make_settings() -> QSettings:
    folder = os.environ.get(SETTINGS_ENV)
    if folder:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        return QSettings(str(path / "memcalc.ini"), QSettings.Format.IniFormat)
    return QSettings(ORGANIZATION, APPLICATION)


def save_state(settings: QSettings, state: FormState) -> None:
    settings.setValue(KEY_SETUP, json.dumps(state.to_json(), sort_keys=True))
    settings.setValue(KEY_SETUP_VERSION, STATE_VERSION)


def load_state(settings: QSettings) -> FormState | None:
    """The saved setup (brought up to date when an older version saved it), or ``None`` when there is none or it
    cannot be read."""
    raw = settings.value(KEY_SETUP)
    if not raw:
        return None
    try:
        version = int(str(settings.value(KEY_SETUP_VERSION, 1)))
        return FormState.from_json(json.loads(str(raw)), version)
    except (ValueError, TypeError):
        return None


def save_bytes(settings: QSettings, key: str, data: QByteArray) -> None:
    settings.setValue(key, data)


def load_bytes(settings: QSettings, key: str) -> QByteArray | None:
    value = settings.value(key)
    if isinstance(value, QByteArray) and not value.isEmpty():
        return value
    if isinstance(value, (bytes, bytearray)) and value:
        return QByteArray(bytes(value))
    return None
