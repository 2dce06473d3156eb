"""What PySide6's ``__import__`` wrapper costs a fake-tensor trace, and what taking it out for the job saves
(``memcalc_gui.measure.plain_imports``). Each row runs in its own process: without Qt (the command line), with Qt
loaded and its wrapper left in place, and with Qt loaded as the window runs a trace (memcalc_gui imported first,
as its entry point does).

    python bench/qt_imports.py [--preset llama-3.1-8b] [--seq 512]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import contextlib, sys, time
mode, preset, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, {root!r})
import memcalc_gui  # first, as the window's entry point
if mode != "no-qt":
    import PySide6.QtWidgets  # noqa: F401  (wraps __import__, as in the window)
import memcalc_gui.measure as measure
if mode == "qt-wrapper-kept":
    measure.plain_imports = contextlib.nullcontext  # type: ignore[assignment]
from memcalc_gui.core.model import preset_spec
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.trace.fake import trace_estimate
setup = TrainingSetup(model=preset_spec(preset), batch=1, seq=seq, precision="mixed")
trace_estimate(setup)  # warm: imports and first-call caches
times = []
for _ in range(3):
    t0 = time.perf_counter()
    trace_estimate(setup)
    times.append(time.perf_counter() - t0)
print(min(times))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    rows = []
    for mode in ("no-qt", "qt-wrapper-kept", "qt-plain-imports"):
        out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), mode, args.preset, str(args.seq)],
                             capture_output=True, text=True, check=True)
        rows.append((mode, float(out.stdout.strip().splitlines()[-1])))
    base = rows[0][1]
    print(f"fake-tensor trace of {args.preset}, 1 × {args.seq}, mixed precision (best of 3)")
    print(f"{'process':<20}{'seconds':>9}{'vs no Qt':>10}")
    for mode, s in rows:
        print(f"{mode:<20}{s:>9.2f}{s / base - 1:>+10.0%}")


if __name__ == "__main__":
    main()
