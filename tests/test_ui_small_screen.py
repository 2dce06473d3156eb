"""The window on small screens (pytest-qt, offscreen): a 1280×720 screen at 150 % scaling is 853×480 logical px, and
the window must fit it — its first size, its minimum size, its frame — with every control still reachable (the
results scroll when the window cannot hold them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QSettings

from memcalc_gui.ui.main_window import MainWindow
from memcalc_gui.ui.settings import SETTINGS_ENV

#: 1280×720 at 150 %, in logical px.
SMALL = (853, 480)


@pytest.fixture(autouse=True)
def private_settings(tmp_path, monkeypatch):
    monkeypatch.setenv(SETTINGS_ENV, str(tmp_path / "settings"))
    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(tmp_path / "qsettings"))


# Runs in its own process: the screen's size and QT_SCALE_FACTOR are fixed when the QApplication starts.
SMALL_SCREEN_CHECK = """
import json, sys
from PySide6.QtCore import QPoint, QRect
from PySide6.QtWidgets import (QAbstractButton, QAbstractSpinBox, QComboBox, QLineEdit, QScrollArea, QTabBar,
                               QWidget)
from memcalc_gui.app import create_application
from memcalc_gui.ui import measure_panel
measure_panel.DETECT_DELAY_MS = None  # no device probe: its thread (importing torch) outlived the check, and Qt aborts
app = create_application([])
from memcalc_gui.ui.form import default_state
from memcalc_gui.ui.main_window import MainWindow
w = MainWindow(initial_state=default_state().replace(**json.loads(sys.argv[1])), persist=False)
w.show()
for _ in range(10): app.processEvents()
avail = w.screen().availableGeometry()
out = {"avail": avail.getRect(), "frame": w.frameGeometry().getRect(), "min": w.minimumSize().toTuple(),
       "min_hint": w.minimumSizeHint().toTuple(), "unreachable": [], "cards": 0, "checked": 0}

def controls():
    for c in w.findChildren(QWidget):
        if not isinstance(c, (QAbstractButton, QLineEdit, QComboBox, QAbstractSpinBox)) or not c.isVisible():
            continue
        if isinstance(c.parentWidget(), (QComboBox, QAbstractSpinBox, QTabBar)):  # parts of a control
            continue
        yield c

def reachable(c):
    areas, p = [], c.parentWidget()
    while p is not None and p is not w:
        if isinstance(p, QScrollArea):
            areas.append(p)
        p = p.parentWidget()
    for area in areas:  # the innermost first: a card in the suggestions' list, then the results
        area.ensureWidgetVisible(c, 0, 0)
    for _ in range(2): app.processEvents()
    seen = c.visibleRegion().boundingRect()  # not hidden by its scroll areas and parents
    seen = QRect(c.mapToGlobal(seen.topLeft()), seen.size()).intersected(avail)  # and on the screen
    return seen.width() >= min(8, c.width()) and seen.height() >= min(8, c.height())

for index in range(w.tabs.count()):  # every page of the ledger's tabs ("What to change" is one when narrow)
    w.tabs.setCurrentIndex(index)
    for _ in range(3): app.processEvents()
    for c in controls():
        out["checked"] += 1
        if not reachable(c):
            out["unreachable"].append(f"{type(c).__name__} {c.objectName()!r} {getattr(c, 'text', lambda: '')()!r}")
    if w.tabs.widget(index) is w.advice_box:
        out["cards"] = sum(1 for b in w.advice.buttons if b.isVisible() and reachable(b))
print(json.dumps(out))
w.close()
"""
MULTI_GPU_OVER = {"preset": "llama-3.1-70b", "gpus": "8", "strategy": "fsdp-full-shard", "offload": "none"}


def test_window_fits_a_small_screen_and_its_minimum_fits_853x480(qtbot):
    """In this process (the offscreen screen, 800 px wide): the first size and the frame stay within the screen's
    available geometry, and the window can be made as small as 853×480."""
    w = MainWindow()
    qtbot.addWidget(w)
    avail = w.screen().availableGeometry()
    assert w.width() <= avail.width() and w.height() <= avail.height()
    w.show()
    qtbot.waitExposed(w)
    assert avail.contains(w.frameGeometry()), (w.frameGeometry(), avail)
    hint = w.minimumSizeHint().expandedTo(w.minimumSize())
    assert hint.width() <= SMALL[0] and hint.height() <= SMALL[1], hint
    inside = (SMALL[0] - 16, SMALL[1] - 40)  # room for a title bar and borders
    w.resize(*inside)
    qtbot.waitUntil(lambda: w.size().toTuple() == inside, timeout=2000)


@pytest.mark.parametrize("changes", [{}, MULTI_GPU_OVER], ids=["default", "multi-gpu-over"])
def test_on_a_1280x720_screen_at_150_percent_the_window_fits_and_every_control_is_reachable(changes, tmp_path):
    """A real 853×480 logical screen (offscreen, QT_SCALE_FACTOR=1.5): the window's frame lies within the available
    geometry, so does its minimum size, and every button and field — in every tab of the ledger, the suggestion cards
    included — can be scrolled into view."""
    screen = tmp_path / "screen.json"
    screen.write_text(json.dumps({"screens": [{"name": "laptop", "x": 0, "y": 0, "width": 1280, "height": 720,
                                               "logicalDpi": 96, "logicalBpi": 96, "dpr": 1}]}))
    env = dict(os.environ, QT_QPA_PLATFORM=f"offscreen:configfile={screen}", QT_SCALE_FACTOR="1.5",
               MEMCALC_SETTINGS_DIR=str(tmp_path / "settings"))
    proc = subprocess.run([sys.executable, "-c", SMALL_SCREEN_CHECK, json.dumps(changes)], capture_output=True,
                          text=True, env=env, timeout=120, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ax, ay, aw, ah = out["avail"]
    assert (aw, ah) == SMALL  # the screen the issue is about
    fx, fy, fw, fh = out["frame"]
    assert ax <= fx and ay <= fy and fx + fw <= ax + aw and fy + fh <= ay + ah, out
    for size in (out["min"], out["min_hint"]):
        assert size[0] <= aw and size[1] <= ah, out
    assert out["checked"] > 40 and out["unreachable"] == [], out
    if changes:
        assert out["cards"] >= 1, out
