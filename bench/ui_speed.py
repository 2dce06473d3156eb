"""Edit-to-redraw time of the window for analytic estimates (target well under 50 ms).

Types into the sequence-length field and waits for the redraw, as a user would:
    QT_QPA_PLATFORM=offscreen python bench/ui_speed.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("MEMCALC_SETTINGS_DIR", tempfile.mkdtemp(prefix="memcalc-bench-"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtTest import QTest
    from PySide6.QtWidgets import QApplication

    from memcalc_gui.ui.main_window import DEBOUNCE_MS, MainWindow

    app = QApplication.instance() or QApplication([])
    w = MainWindow()
    w.show()
    QTest.qWaitForWindowExposed(w)
    total: list[float] = []
    work: list[float] = []
    for i in range(30):
        loop = QEventLoop()
        w.result_changed.connect(loop.quit)
        QTimer.singleShot(2000, loop.quit)
        w.inputs.seq.setFocus()
        w.inputs.seq.selectAll()
        t0 = time.perf_counter()
        QTest.keyClicks(w.inputs.seq, str(512 * (1 + i % 4)))
        loop.exec()
        w.result_changed.disconnect(loop.quit)
        w.repaint()
        total.append((time.perf_counter() - t0) * 1000)
        work.append(w.last_refresh_ms)
    print(f"{'measure':<38}{'median ms':>10}{'max ms':>9}")
    print(f"{'keystroke to painted window':<38}{statistics.median(total):>10.1f}{max(total):>9.1f}")
    print(f"{'estimate + plot item updates':<38}{statistics.median(work):>10.1f}{max(work):>9.1f}")
    print(f"(includes the {DEBOUNCE_MS} ms debounce; target well under 50 ms)")
    w.close()
    app.processEvents()


if __name__ == "__main__":
    main()
