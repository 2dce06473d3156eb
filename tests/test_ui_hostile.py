"""The window under hostile input: it marks the field, keeps the last good result, never blocks or crashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from memcalc_gui.trace import fake
from memcalc_gui.ui import workers
from memcalc_gui.ui.form import default_state
from memcalc_gui.ui.main_window import MainWindow

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def private_settings(quiet_panels):
    """Private settings and quick panels (conftest.quiet_panels) for every test here."""


@pytest.fixture
def window(qtbot):
    w = MainWindow(initial_state=default_state(), persist=False)
    qtbot.addWidget(w)
    w.resize(1280, 720)
    w.show()
    assert w.result is not None
    return w


def hostile_paths(folder: Path) -> dict[str, str]:
    fifo = folder / "fifo.json"
    os.mkfifo(fifo)
    (folder / "latin1.json").write_bytes(b'{"model_type": "llama", "x": "\xe9"}')
    (folder / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (folder / "digits.json").write_text('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}")
    (folder / "act.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                                 "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
                                                 "hidden_act": "bogus"}))
    return {"fifo": str(fifo), "dev-zero": "/dev/zero", "folder": str(folder), "missing": str(folder / "nope.json"),
            "latin1": str(folder / "latin1.json"), "deep": str(folder / "deep.json"),
            "digits": str(folder / "digits.json"), "activation": str(folder / "act.json")}


def test_hostile_config_paths_mark_the_field_and_keep_the_result(window, tmp_path):
    good = window.result
    for name, path in hostile_paths(tmp_path).items():
        window.inputs.set_state(window.inputs.state().replace(model_kind="config", config_path=path))
        t0 = time.perf_counter()
        assert not window.refresh(), name
        assert time.perf_counter() - t0 < 2, name  # a FIFO or /dev/zero is never read
        errors = window.inputs.errors()
        assert "config_path" in errors, (name, errors)
        assert "\n" not in errors["config_path"] and len(errors["config_path"]) <= 400
        assert window.result is good  # the last valid result stays on screen
        assert window.banner.stale_note.isVisible()


def test_values_beyond_int64_are_drawn(window, tmp_path):
    """Sizes past 2^63 bytes (Qt's integer limit) reach the table, the chart and the banner without an error."""
    cfg = {"model_type": "llama", "hidden_size": 2**31 - 2, "intermediate_size": 2**31 - 1,
           "num_attention_heads": 2, "num_hidden_layers": 100_000, "vocab_size": 2**31 - 1}
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(cfg))
    window.inputs.set_state(window.inputs.state().replace(model_kind="config", config_path=str(path),
                                                          batch="1048576", seq="16777216"))
    assert window.refresh(), window.inputs.errors()
    est = window.result.estimate
    assert est.peak_bytes > 2**63
    assert window.table.bytes_at(window.table.rowCount() - 1, 0) == est.phases["load"].total_bytes
    assert window.banner.state() == "over"
    assert "YiB" in window.banner.text.text() and window.table.unit == window.chart.unit == "YiB"


def test_closing_during_a_trace_that_cannot_stop_returns_within_a_second(window, qtbot, monkeypatch):
    """A trace step that ignores cancellation (a model of many layers being built) never holds the window."""
    release = threading.Event()

    def stuck(setup, progress=None, should_stop=None, config=None):
        release.wait(30)
        raise fake.TraceCancelled("released")

    monkeypatch.setattr(fake, "trace_estimate", stuck)
    monkeypatch.setattr(fake, "trace_available", lambda: True)
    window.trace_panel.available = True
    with qtbot.waitSignal(window.trace_panel.runner.started, timeout=5000):
        window.trace_panel.set_enabled(True)
    assert window.trace_panel.runner.thread_running()
    t0 = time.perf_counter()
    window.close()
    assert time.perf_counter() - t0 < 1.5
    assert workers.running_orphans()  # kept referenced: never destroyed while running
    release.set()
    qtbot.waitUntil(lambda: not workers.running_orphans(), timeout=10_000)


def _gui(*args: str, timeout: float, **env: str) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("memcalc-gui")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "memcalc_gui.app"]
    return subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(ROOT), **env))


def test_ctrl_c_closes_the_real_window(tmp_path):
    proc = _gui(timeout=60, MEMCALC_SETTINGS_DIR=str(tmp_path / "settings"), MEMCALC_LOG_DIR=str(tmp_path / "logs"))
    try:
        time.sleep(4)  # the window is up
        assert proc.poll() is None
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:  # a window that did not close is not left running after the test
        proc.kill()
    assert proc.returncode == 0, err
    assert time.perf_counter() - t0 < 5
    assert "Traceback" not in err


HOSTILE_TEXT = ["", " ", "0", "-1", "1e400", "nan", "9" * 5000, "abc", "\u202e12", "q_proj,", ",,,", "last:-1",
                "last:99999999999999999999", "1.5", "all-linear,zz", "norms,lm_head,embeddings,last:3"]


@pytest.mark.parametrize("field", ["lora_rank", "lora_dropout", "lora_targets", "trainable"])
def test_hostile_fine_tuning_fields_mark_themselves(window, field):
    """Every fine-tuning field under hostile text: the field is marked (or the value is used), the last good
    result stays on screen, nothing raises."""
    w = window
    method = "frozen" if field == "trainable" else "qlora"
    w.apply_state(w.inputs.state().replace(preset="qwen2.5-0.5b", tuning=method))
    assert w.refresh()
    for text in HOSTILE_TEXT:
        good = w.result
        w.apply_state(w.inputs.state().replace(**{field: text}))
        if w.refresh():
            assert w.result.setup.tuning.method == method
        else:
            assert set(w.inputs.errors()) == {field}, (text, w.inputs.errors())
            assert w.result is good and w.banner.stale_note.isVisible()


def test_hostile_replica_counts_mark_the_field(window):
    """FSDP2's replicas field under hostile text: marked (or used when it divides the GPUs), the last good result
    kept, nothing raises; under another strategy the text is kept and not read."""
    w = window
    w.apply_state(w.inputs.state().replace(preset="qwen2.5-0.5b", gpus="16", strategy="fsdp2"))
    assert w.refresh()
    for text in [*HOSTILE_TEXT, "2", "3", "16", "8"]:
        good = w.result
        w.apply_state(w.inputs.state().replace(dp_replicate=text))
        if w.refresh():
            assert w.result.setup.parallel.dp_replicate == int(text or "1")
        else:
            assert set(w.inputs.errors()) == {"dp_replicate"}, (text, w.inputs.errors())
            assert w.result is good and w.banner.stale_note.isVisible()
    w.apply_state(w.inputs.state().replace(dp_replicate="abc", strategy="zero3"))
    assert w.refresh() and w.result.setup.parallel.dp_replicate == 1 and w.inputs.state().dp_replicate == "abc"


def _drop(window, path: str) -> None:
    """A file dropped on the window, as Qt delivers it."""
    from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
    from PySide6.QtGui import QDropEvent

    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(path)])
    window.dropEvent(QDropEvent(QPointF(20, 20), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                                Qt.KeyboardModifier.NoModifier))


def test_hostile_snapshots_open_and_drop_without_blocking_the_window(window, qtbot, tmp_path):
    """Every file of the hostile snapshot corpus (issue 61), opened from the menu's path and dropped on the window:
    the call returns at once (the file is read on a worker), the outcome is one line in the status bar within the
    issue's 10 s, and the timeline on screen stays unless the file was a real one."""
    from bench import hostile_corpus

    paths = {n: str(p) for n, p in hostile_corpus.write_all(tmp_path).items()}
    paths.update(hostile_corpus.special_paths(tmp_path))
    panel = window.timeline_panel
    for i, (name, path) in enumerate(sorted(paths.items())):
        kept = panel.timeline
        dropped = i % 2 == 0 and path.endswith(".pickle")
        with qtbot.waitSignal(window.snapshot_opened, timeout=10_000) as opened:
            t0 = time.perf_counter()
            _drop(window, path) if dropped else window.open_snapshot(path)
            assert time.perf_counter() - t0 < 2, name  # the GUI thread never waits on the file (a FIFO: for good)
        message = window.statusBar().currentMessage()
        assert "\n" not in message and len(message) <= 500, (name, message)
        if name.startswith("ok-"):
            assert opened.args == [True] and panel.timeline is not kept, name
        else:
            assert opened.args == [False] and message.startswith("Could not open"), (name, message)
            assert panel.timeline is kept, name
        assert window.result is not None


def test_a_second_snapshot_replaces_the_one_being_read(window, qtbot, tmp_path):
    """Asked for while a large snapshot is read, a second file is what the window ends up showing."""
    from bench import hostile_corpus

    big = tmp_path / "big.pickle"
    big.write_bytes(hostile_corpus.pickles()["ok-shared-frames"])
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(hostile_corpus.pickles()["own-line-abc"])
    with qtbot.waitSignal(window.snapshot_opened, timeout=20_000) as opened:
        window.open_snapshot(big)
        window.open_snapshot(bad)
    assert opened.args == [False] and "bad.pickle" in window.statusBar().currentMessage()
    assert not window.snapshot_runner.is_running()
