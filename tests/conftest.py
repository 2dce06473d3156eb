"""Shared test settings: offscreen Qt, no network, never the user's real settings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "MEMCALC_CACHE_DIR" not in os.environ:  # fitted-method calibrations of the run, never the user's cache
    import tempfile

    os.environ["MEMCALC_CACHE_DIR"] = tempfile.mkdtemp(prefix="memcalc-test-fits-")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


import pytest  # noqa: E402


@pytest.fixture
def quiet_panels(tmp_path, monkeypatch):
    """A window of its own: private settings, no delayed GPU probe, a short trace delay."""
    from memcalc_gui.ui import measure_panel, trace_panel
    from memcalc_gui.ui.settings import SETTINGS_ENV

    monkeypatch.setenv(SETTINGS_ENV, str(tmp_path / "settings"))
    monkeypatch.setattr(measure_panel, "DETECT_DELAY_MS", None)
    monkeypatch.setattr(trace_panel, "TRACE_DELAY_MS", 30)
