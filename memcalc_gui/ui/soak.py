"""``memcalc-gui --soak SECONDS``: scripted use of the real window, to prove it survives hours of editing.

The script runs inside the application's own event loop (a timer fires every few milliseconds), so every
repaint, debounce, worker signal and dialog goes through the same code paths as a person's use. Each tick
does one random action, seeded for repeatability (the rare ones, a trace and a measurement, also once early on at
fixed ticks, so a short soak runs them whatever the seed):

- types into a number field (valid values, zero, letters, ``1e12``, a pasted wall of digits, empty),
- switches preset, precision recipe, checkpointing, attention, GPU; undoes and redoes,
- opens and closes the About dialog; exports a PNG report into a temporary folder,
- points the model at hostile config files (a FIFO, a folder, a missing file, invalid JSON, absurd sizes) and opens
  hostile memory snapshots (a FIFO, a link to /dev/zero, nested shared frames, a memo-index bomb),
- turns the trace on and off and starts measurements (when PyTorch is installed) on a small setup.

At the end it prints one summary line (counts, resident memory, and on Python < 3.12 the change in
``sys.getrefcount(None)``: a Qt binding that drops references to None aborts the process once the count
reaches zero, which is what this was written to catch) and closes the window as its close button does.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from PySide6.QtCore import QEvent, QObject, Qt, QTimer, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QApplication, QLineEdit, QWidget

SOAK_OK = "memcalc-gui soak ok"
#: On Python < 3.12 a fall of None's reference count beyond this means the binding leaks (None is not immortal).
NONE_REFCOUNT_TOLERANCE = 10_000

#: The ticks at which the soak turns the trace on and starts a measurement, whatever its dice say.
TRACE_AT, MEASURE_AT = 150, 400

_TYPED = ("1", "2", "4", "8", "16", "32", "0", "-3", "abc", "1e12", "4k", "", " 7 ", "9" * 40, "3.5")
_SEQS = ("128", "512", "2048", "4096", "100000", "0", "x")


def _key(widget: QWidget, key: int | Qt.Key, text: str = "") -> None:
    """Press and release a key on ``widget`` through Qt's event system (as typing does; QtTest is not bundled)."""
    for kind in (QEvent.Type.KeyPress, QEvent.Type.KeyRelease):
        QApplication.sendEvent(widget, QKeyEvent(kind, int(key), Qt.KeyboardModifier.NoModifier, text))


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0


def _none_refs() -> int | None:
    return sys.getrefcount(None) if sys.version_info < (3, 12) else None


def none_refcount_drift(repaints: int = 2000) -> int | None:
    """The change of ``sys.getrefcount(None)`` over ``repaints`` repaints and event-loop passes of a shown label
    (None on Python >= 3.12, where None is immortal). A sound binding gives a small number; PySide6 6.12.0 on
    Python 3.11 gives about -4 per pass and the process aborts once the count reaches zero."""
    if sys.version_info >= (3, 12):
        return None
    from PySide6.QtWidgets import QLabel

    app = QApplication.instance() or QApplication([])
    label = QLabel("0")
    label.show()
    start = sys.getrefcount(None)
    for i in range(repaints):
        label.setText(str(i))
        label.repaint()
        app.processEvents()
    label.close()
    return sys.getrefcount(None) - start


def _hostile_configs(folder: Path) -> list[str]:
    """Paths a careless or hostile user might open, created in ``folder``."""
    paths = [str(folder), str(folder / "missing.json"), "/dev/zero"]
    fifo = folder / "fifo.json"
    with contextlib.suppress(OSError, AttributeError):
        os.mkfifo(fifo)
        paths.append(str(fifo))
    bad = folder / "bad.json"
    bad.write_text('{"model_type": "llama", "hidden_size": ', encoding="utf-8")
    huge = folder / "huge.json"
    huge.write_text('{"model_type": "llama", "hidden_size": 2147483647, "intermediate_size": 2147483647, '
                    '"num_attention_heads": 1, "num_hidden_layers": 100000, "vocab_size": 2147483647}',
                    encoding="utf-8")
    code = folder / "code.json"
    code.write_text('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, '
                    '"num_hidden_layers": 2, "vocab_size": 256, "auto_map": {"AutoModelForCausalLM": "x.Model"}}',
                    encoding="utf-8")
    deep = folder / "deep.json"
    deep.write_text("[" * 5000 + "]" * 5000, encoding="utf-8")
    return [*paths, str(bad), str(huge), str(code), str(deep)]


def _hostile_snapshots(folder: Path) -> list[str]:
    """Memory snapshots a careless or hostile user might open (docs/reliability.md): a FIFO, a link to /dev/zero,
    a few hundred bytes whose shared nested frame names would print as 2⁴⁰ elements, a memo-index bomb, a profiler
    timeline whose rows are not numbers."""
    paths = []
    with contextlib.suppress(OSError, AttributeError):
        os.mkfifo(folder / "fifo.pickle")
        paths.append(str(folder / "fifo.pickle"))
    with contextlib.suppress(OSError, NotImplementedError):
        (folder / "zero.pickle").symlink_to("/dev/zero")
        paths.append(str(folder / "zero.pickle"))
    nested: list[object] = []
    for _ in range(40):
        nested = [nested, nested]
    (folder / "nested.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 1, "size": 512, "frames": [{"filename": nested, "line": 1, "name": "x"}]}]]}))
    (folder / "memo.pickle").write_bytes(b"\x80\x04Nr" + (10**9).to_bytes(4, "little") + b".")
    (folder / "timeline.json").write_text('[[1], [[0, "x", 0, 0, 0, 0, 0, 0, 0]]]', encoding="utf-8")
    return [*paths, *(str(folder / n) for n in ("nested.pickle", "memo.pickle", "timeline.json"))]


class Soak(QObject):
    """Drives ``window`` for ``seconds``; ``done`` carries the summary line and whether it passed."""

    done = Signal(str, bool)

    def __init__(self, window: Any, seconds: float, seed: int = 1, interval_ms: int = 5) -> None:
        super().__init__(window)
        self.window = window
        self.deadline = time.monotonic() + seconds
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.folder = Path(tempfile.mkdtemp(prefix="memcalc-soak-"))
        self.hostile = _hostile_configs(self.folder)
        self.snapshots = _hostile_snapshots(self.folder)
        self.none_start = _none_refs()
        self.rss_start = _rss_bytes()
        self.timer = QTimer(self)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._tick)
        window.measure_panel.runner.finished.connect(lambda *_: self.counts.update(["measure finished"]))
        self.failures: Counter[str] = Counter()
        window.measure_panel.runner.failed.connect(lambda m: self.failures.update([f"measure: {m[:90]}"]))
        window.trace_panel.runner.finished.connect(lambda *_: self.counts.update(["trace finished"]))
        window.trace_panel.runner.failed.connect(lambda m: self.failures.update([f"trace: {m[:90]}"]))

    def start(self) -> None:
        self.timer.start()

    # ---- actions ------------------------------------------------------------------------------
    def _type(self, edit: QLineEdit, text: str) -> None:
        edit.setFocus()
        edit.selectAll()
        _key(edit, Qt.Key.Key_Backspace)
        for ch in text:
            _key(edit, ord(ch.upper()) if ch.isascii() else Qt.Key.Key_unknown, ch)
        self.counts["edits"] += 1

    def _combo(self, name: str) -> None:
        combo = getattr(self.window.inputs, name)
        if combo.count():
            combo.setCurrentIndex(self.rng.randrange(combo.count()))
            self.counts["choices"] += 1

    def _small_model(self) -> None:
        inputs = self.window.inputs
        inputs.set_state(inputs.state().replace(model_kind="preset", preset="gpt2", batch="1", seq="64",
                                                grad_accum="1"))

    def _tick(self) -> None:
        w = self.window
        if time.monotonic() >= self.deadline:
            self.finish()
            return
        roll = self.rng.random()
        inputs = w.inputs
        # the rare actions (a trace, a measurement: about one tick in 500 each) come once early on whatever the
        # seed, so a short soak runs them too
        if self.counts["actions"] == TRACE_AT:
            roll = 0.849
        elif self.counts["actions"] == MEASURE_AT:
            roll = 0.851
        if roll < 0.45:
            self._type(inputs.batch, self.rng.choice(_TYPED))
        elif roll < 0.55:
            self._type(inputs.seq, self.rng.choice(_SEQS))
        elif roll < 0.62:
            self._type(inputs.grad_accum, self.rng.choice(_TYPED))
        elif roll < 0.70:
            self._combo(self.rng.choice(("preset", "recipe", "attention", "gpu", "strategy", "precision")))
        elif roll < 0.74:
            inputs.checkpointing.toggle()
            self.counts["choices"] += 1
        elif roll < 0.80:
            (w.undo if self.rng.random() < 0.6 else w.redo)()
            self.counts["undo/redo"] += 1
        elif roll < 0.825:
            inputs.set_state(inputs.state().replace(model_kind="config", config_path=self.rng.choice(self.hostile)))
            self.counts["hostile configs"] += 1
        elif roll < 0.83:
            w.open_snapshot(self.rng.choice(self.snapshots))  # read on a worker: the GUI thread never waits on it
            self.counts["hostile snapshots"] += 1
        elif roll < 0.84:
            dialog = w.show_about()
            QApplication.processEvents()
            dialog.close()
            dialog.deleteLater()
            self.counts["dialogs"] += 1
        elif roll < 0.845:
            w.export_report(self.folder / f"report-{self.counts['reports'] % 3}.png")
            self.counts["reports"] += 1
        elif roll < 0.850 and w.trace_panel.available:
            self._small_model()
            w.trace_panel.set_enabled(not w.trace_panel.toggle.isChecked())
            self.counts["trace toggles"] += 1
        elif roll < 0.852 and not w.measure_panel.is_running():
            self._small_model()
            w.refresh()
            if w.measure_panel.start():
                self.counts["measure starts"] += 1
        else:
            _key(inputs.batch, Qt.Key.Key_Up)
            self.counts["keys"] += 1
        self.counts["actions"] += 1
        if os.environ.get("MEMCALC_SOAK_VERBOSE") and self.counts["actions"] % 500 == 0:
            print(f"soak: {self.counts['actions']} actions, rss {_rss_bytes() / 2**20:.0f} MiB, "
                  f"None refs {_none_refs()}, undo {w.undo_stack.count()}", flush=True)

    # ---- end ----------------------------------------------------------------------------------
    def finish(self) -> None:
        self.timer.stop()
        w = self.window
        w.refresh()
        alive = w.isVisible() and isinstance(w.centralWidget(), QWidget)
        none_end = _none_refs()
        none_delta = None if self.none_start is None or none_end is None else none_end - self.none_start
        leak = none_delta is not None and none_delta < -NONE_REFCOUNT_TOLERANCE
        rss_end = _rss_bytes()
        parts = [f"{k} {v}" for k, v in sorted(self.counts.items())]
        parts += [f"{v}× failed ({k})" for k, v in self.failures.most_common(4)]
        parts.append(f"rss {self.rss_start / 2**20:.0f} -> {rss_end / 2**20:.0f} MiB")
        parts.append(f"None refcount change {none_delta if none_delta is not None else 'n/a (immortal)'}")
        ok = alive and not leak
        w.close()
        with contextlib.suppress(OSError):
            for p in self.folder.iterdir():
                p.unlink()
            self.folder.rmdir()
        self.done.emit("; ".join(parts), ok)
