"""Speed of the timeline: recording it in a trace, reading and writing snapshots, and drawing and panning it.

    QT_QPA_PLATFORM=offscreen python bench/timeline_speed.py [--events 1000000]

Prints one table; docs/timeline.md records it. Targets: a 1M-event timeline pans at interactive rates (≥ 20 frames
per second offscreen), and the trace of a real model takes about as long with its timeline as without.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("MEMCALC_SETTINGS_DIR", tempfile.mkdtemp(prefix="memcalc-bench-"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def synthetic(n: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """``n`` events of a step-shaped timeline: four phases per iteration, allocations freed later, sizes from KiB
    to hundreds of MiB."""
    from memcalc_gui.core.timeline import Span, Timeline, TimelineEvent

    rng = random.Random(seed)
    cats = ("activations", "temporaries", "gradients", "optimizer_temporaries")
    events: list[TimelineEvent] = []
    live: list[tuple[int, int, str]] = []
    spans = []
    phases = ("forward", "backward", "optimizer_step")
    per = n // 6
    addr = 1
    for it in (1, 2):
        for p, phase in enumerate(phases):
            start = len(events)
            while len(events) - start < per:
                if live and (rng.random() < 0.48 or len(live) > 5000):
                    a, size, cat = live.pop(rng.randrange(len(live)))
                    events.append(TimelineEvent(-size, cat, phase, it, addr=a))
                else:
                    size = rng.choice((4096, 65536, 1 << 20, 16 << 20, 256 << 20))
                    cat = cats[p] if rng.random() < 0.7 else cats[1]
                    events.append(TimelineEvent(size, cat, phase, it, "model.layers.3.mlp", "mm", addr))
                    live.append((addr, size, cat))
                    addr += 1
            spans.append(Span(phase, it, start, len(events)))
    return Timeline(tuple(events), "trace", tuple(spans), {"parameters": 8 << 30, "optimizer_state": 16 << 30})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--frames", type=int, default=60)
    args = ap.parse_args()

    from PySide6.QtWidgets import QApplication

    from memcalc_gui.core.timeline import read_timeline
    from memcalc_gui.view.timeline_chart import TimelineChart

    rows: list[tuple[str, float, str]] = []
    t0 = time.perf_counter()
    tl = synthetic(args.events)
    rows.append((f"build a {len(tl.events):,}-event timeline", time.perf_counter() - t0, "s"))
    path = Path(tempfile.mkdtemp()) / "big.pickle"
    t0 = time.perf_counter()
    tl.write_snapshot(path)
    rows.append(("write it as a memory_viz snapshot", time.perf_counter() - t0, "s"))
    t0 = time.perf_counter()
    back = read_timeline(path.read_bytes())
    rows.append(("read it back (plain-data unpickler)", time.perf_counter() - t0, "s"))
    assert len(back.events) == len(tl.events)
    del back

    app = QApplication.instance() or QApplication([])
    chart = TimelineChart()
    chart.resize(1200, 500)
    chart.show()
    app.processEvents()
    t0 = time.perf_counter()
    chart.set_timeline(tl, 80 << 30, 40 << 30)
    app.processEvents()
    chart.repaint()
    rows.append(("draw it (stacked areas, bands, lines)", time.perf_counter() - t0, "s"))
    vb = chart.plot_item.vb
    vb.setXRange(0, len(tl.events) / 10, padding=0)
    app.processEvents()
    t0 = time.perf_counter()
    for i in range(args.frames):
        vb.translateBy(x=len(tl.events) / 200 * (1 if i < args.frames // 2 else -1))
        app.processEvents()
        chart.repaint()
    fps = args.frames / (time.perf_counter() - t0)
    rows.append(("pan (frames per second, 10 % of the step in view)", fps, "fps"))
    t0 = time.perf_counter()
    for i in range(20):
        chart.show_event_info(len(tl.events) * i // 20)
    rows.append(("hover: the largest live allocations", (time.perf_counter() - t0) / 20 * 1000, "ms"))

    from bench.techniques import FAMILIES  # noqa: F401 - the trace below needs the repository on the path
    from memcalc_gui.core.model import preset_spec
    from memcalc_gui.core.setup import TrainingSetup
    from memcalc_gui.trace.fake import trace_estimate

    setup = TrainingSetup(model=preset_spec("qwen2.5-1.5b"), batch=2, seq=1024, checkpointing="full")
    t0 = time.perf_counter()
    traced = trace_estimate(setup)
    seconds = time.perf_counter() - t0
    assert traced.timeline is not None
    rows.append((f"trace qwen2.5-1.5b 2×1024 with its timeline ({len(traced.timeline.events):,} events)", seconds,
                 "s"))
    print(f"{'measure':<72}{'value':>10}")
    for name, value, unit in rows:
        print(f"{name:<72}{value:>8.2f} {unit}")
    chart.close()


if __name__ == "__main__":
    main()
