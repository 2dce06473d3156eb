"""Soak test of the real entry point: ``memcalc-gui --soak`` uses the window by script and must survive.

CI runs half a minute of it (``MEMCALC_SOAK_SECONDS`` sets more; an hour is recorded in docs/reliability.md):
thousands of edits, hostile files, dialogs, reports, traces and measurements through the application's own
event loop. It also fails when the Qt binding drops references to None (PySide6 6.12.0 on Python 3.11),
the fault that aborted the window after a minute of typing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECONDS = float(os.environ.get("MEMCALC_SOAK_SECONDS", "30"))
HAS_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


def test_real_window_survives_scripted_use(tmp_path):
    exe = Path(sys.executable).with_name("memcalc-gui")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "memcalc_gui.app"]
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(ROOT),
               MEMCALC_SETTINGS_DIR=str(tmp_path / "settings"), MEMCALC_LOG_DIR=str(tmp_path / "logs"))
    proc = subprocess.run([*cmd, "--soak", str(SECONDS)], capture_output=True, text=True, env=env,
                          timeout=SECONDS + 180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "memcalc-gui soak ok" in proc.stdout
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("memcalc-gui soak:"))
    counts = {name.strip(): int(n) for name, n in re.findall(r"([a-z/ ]+?) (\d+)(?=;|$)", summary.split(": ", 1)[1])}
    # it did use the window: a floor, not a speed (29 edits/s alone on a 2-core machine, 16/s in a CI run beside a
    # trace-heavy test, which failed the 20/s this asked before; speed is bench/ui_speed.py's)
    assert counts.get("edits", 0) >= 5 * SECONDS
    assert counts.get("dialogs", 0) >= 1 and counts.get("hostile configs", 0) >= 10
    assert counts.get("hostile snapshots", 0) >= 1
    if HAS_TORCH:
        assert counts.get("trace finished", 0) >= 1 or counts.get("trace toggles", 0) >= 1
        assert counts.get("measure starts", 0) >= 1
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir()), "uncaught errors were logged"
    if sys.version_info < (3, 12):
        change = int(re.search(r"None refcount change (-?\d+)", summary).group(1))
        assert change > -10_000, "the Qt binding drops references to None"
