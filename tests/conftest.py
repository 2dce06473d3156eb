"""Shared test settings: offscreen Qt, no network, never the user's real settings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "MEMCALC_CACHE_DIR" not in os.environ:  # fitted-method calibrations of the run, never the user's cache; the
    # xdist workers inherit it, so a fit two tests share is calibrated once a run (tests of a cold fit set their own)
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


#: How long a test's parked worker threads may run on after it (a calibration between two of its small traces).
ORPHAN_WAIT_S = 120


@pytest.fixture(autouse=True)
def no_job_outlives_its_test():
    """A worker thread a closed window left running (workers.running_orphans: it did not stop within the window's
    close timeout) ends before the next test starts: it would otherwise run its torch job beside that test's."""
    yield
    workers = sys.modules.get("memcalc_gui.ui.workers")
    if workers is None:  # no window in this process yet
        return
    import time

    deadline = time.monotonic() + ORPHAN_WAIT_S
    for thread in workers.running_orphans():
        thread.wait(max(1, int((deadline - time.monotonic()) * 1000)))
    left = workers.running_orphans()
    assert not left, f"{len(left)} worker thread(s) still running {ORPHAN_WAIT_S} s after the test"
