"""'Precise (trace)' in the window (pytest-qt, offscreen): a real fake-tensor trace of a tiny model, then
the restart on edits, failures, Cancel, the cache, skipped setups and missing torch with a fake engine."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import Qt

from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.units import gib
from memcalc_gui.core.vocab import OBJECTS, PHASES
from memcalc_gui.trace import fake
from memcalc_gui.trace.fake import TraceCancelled, TraceError, TraceResult
from memcalc_gui.ui import trace_panel
from memcalc_gui.ui.form import default_state
from memcalc_gui.ui.main_window import MainWindow
from memcalc_gui.ui.settings import SETTINGS_ENV

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=1024, hidden_size=128,
            intermediate_size=344, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(autouse=True)
def private_settings(quiet_panels):
    """Private settings and quick panels (conftest.quiet_panels) for every test here."""


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY), encoding="utf-8")
    return path


@pytest.fixture
def window(qtbot, tiny_config):
    state = default_state().replace(model_kind="config", config_path=str(tiny_config), batch="2", seq="64",
                                    grad_accum="1")
    w = MainWindow(initial_state=state, persist=False)
    qtbot.addWidget(w)
    w.resize(1300, 860)
    w.show()
    assert w.result is not None and w.result.estimate.method == "analytic"
    return w


class FakeEngine:
    """Stands in for ``fake.trace_estimate``: records calls; a setup whose batch is in ``slow`` runs until
    cancelled; ``error`` makes every call fail. A result is the analytic ledger, relabelled and 2 % larger."""

    def __init__(self, slow: tuple[int, ...] = (), error: Exception | None = None) -> None:
        self.slow = slow
        self.error = error
        self.calls: list[int] = []
        self.stopped: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, setup, config=None, progress=None, should_stop=None) -> TraceResult:
        with self.lock:
            self.calls.append(setup.batch)
        progress("building the model on fake tensors")
        if self.error is not None:
            raise self.error
        deadline = time.monotonic() + 30
        while setup.batch in self.slow:
            if should_stop():
                with self.lock:
                    self.stopped.append(setup.batch)
                raise TraceCancelled("trace cancelled")
            progress("iteration 1 of 2: forward")
            time.sleep(0.01)
            assert time.monotonic() < deadline, "never cancelled"
        analytic = estimate(setup)
        phases = {p: dataclasses.replace(ph, objects={k: int(v * 1.02) for k, v in ph.objects.items()})
                  for p, ph in analytic.phases.items()}
        traced = dataclasses.replace(analytic, method="trace", phases=phases, assumptions=("rule one", "rule two"))
        progress("iteration 2 of 2: optimizer step")
        return TraceResult(traced, [("model.layers.*.mlp.gate_proj", 3000), ("lm_head", 1000)], 0.25, analytic,
                           ["rule one", "rule two"])


def use_engine(monkeypatch, engine: FakeEngine) -> FakeEngine:
    monkeypatch.setattr(fake, "trace_estimate", engine)
    return engine


def set_fields(w: MainWindow, **fields: str) -> bool:
    w.inputs.set_state(w.inputs.state().replace(**fields))
    return w.refresh()


def assert_chart_is(w: MainWindow, est) -> None:
    drawn = w.chart.heights()
    for o in OBJECTS:
        assert drawn[o] == pytest.approx([gib(est.phases[p].objects[o]) for p in PHASES]), o


def turn_on(qtbot, w: MainWindow, signal) -> object:
    with qtbot.waitSignal(signal, timeout=60_000) as blocker:
        qtbot.mouseClick(w.trace_panel.toggle, Qt.MouseButton.LeftButton)
    return blocker


# ---- a real trace ------------------------------------------------------------------------------
@pytest.mark.skipif(not fake.trace_available(), reason="torch and transformers are not installed")
def test_real_trace_replaces_the_drawn_result_and_shows_the_difference(window, qtbot):
    w = window
    panel = w.trace_panel
    assert panel.toggle.isEnabled() and panel.toggle.isCheckable() and not panel.toggle.isChecked()
    assert w.action_row.indexOf(panel.toggle) < w.action_row.indexOf(w.measure_panel.button)
    steps: list[str] = []
    panel.progress.connect(steps.append)
    blocker = turn_on(qtbot, w, panel.finished)
    traced = blocker.args[0]
    assert any(s.startswith("iteration") for s in steps), steps
    assert w.result.estimate.method == "trace" and w.trace_result is traced
    assert w.result.estimate is traced.estimate
    assert w.analytic_result.estimate.method == "analytic"
    assert w.result.setup == w.analytic_result.setup
    assert_chart_is(w, traced.estimate)
    label = w.method_label.text()
    assert "trace" in label and "vs analytic" in label and "%" in label
    assert "trace" in w.timing_label.text()
    assert w.banner.text.text() == w.result.headline()
    view = panel.view
    for p in PHASES:
        assert view.cell(p, 2).endswith("%"), p
    assert view.module_names() == [name for name, _ in traced.modules]
    assert any("layers.*" in n for n in view.module_names())
    assert "512" in view.rules.text()  # the CUDA rounding rule
    # the ledger table shows the traced totals
    assert w.table.bytes_at(w.table.total_row, PHASES.index(traced.estimate.peak_phase)) == traced.estimate.peak_bytes
    assert not panel.progress_bar.isVisible() and not panel.cancel_button.isVisible()
    # an edit draws the analytic result at once, then the trace of the new setup
    with qtbot.waitSignal(panel.finished, timeout=60_000) as blocker:
        assert set_fields(w, batch="3")
        assert w.result.estimate.method == "analytic" and w.result.setup.batch == 3
    assert blocker.args[0].estimate.setup.batch == 3 and w.result.estimate.method == "trace"
    assert blocker.args[0].estimate.peak_tensor_bytes > traced.estimate.peak_tensor_bytes


@pytest.mark.skipif(not fake.trace_available(), reason="torch and transformers are not installed")
def test_a_family_without_a_block_model_is_traced_from_its_config(qtbot, tmp_path):
    """An OPT config (fitted method): the trace runs the real model from the config, is compared with the fitted
    estimate, and keeps the fitted what-ifs; a layout the trace cannot run is skipped with the reason."""
    pytest.importorskip("transformers")
    cfg = {"model_type": "opt", "hidden_size": 64, "ffn_dim": 128, "num_attention_heads": 4, "num_hidden_layers": 3,
           "vocab_size": 512, "max_position_embeddings": 512, "word_embed_proj_dim": 64, "pad_token_id": 1}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    state = default_state().replace(model_kind="config", config_path=str(path), batch="2", seq="64", grad_accum="1",
                                    gpu="", capacity="4 GiB")
    w = MainWindow(initial_state=state, persist=False)
    qtbot.addWidget(w)
    w.show()
    qtbot.waitUntil(lambda: w.result is not None and w.result.estimate.method == "fitted", timeout=120_000)
    fitted = w.result
    panel = w.trace_panel
    traced = turn_on(qtbot, w, panel.finished).args[0]
    assert w.result.estimate.method == "trace" and w.trace_result is traced
    assert traced.analytic is fitted.estimate and "vs fitted" in w.method_label.text()
    assert panel.view.phase_table.horizontalHeaderItem(0).text() == "Fitted (tensors)"
    assert traced.estimate.peak_tensor_bytes == pytest.approx(fitted.estimate.peak_tensor_bytes, rel=0.02)
    # the what-ifs are the fitted method's, not the quick heuristic's
    assert w.result.verdict.max_micro_batch == fitted.verdict.max_micro_batch > 2
    assert w.result.verdict.suggestions == fitted.verdict.suggestions
    # a layout transformers' own does not lay out (ZeRO-2) is skipped with the reason, the fitted result kept
    with qtbot.waitSignal(panel.skipped, timeout=60_000) as blocker:
        assert set_fields(w, gpus="2", strategy="zero2")
        qtbot.waitUntil(lambda: w.result.setup.parallel.gpus == 2, timeout=60_000)
    assert "DDP" in blocker.args[0] and w.result.estimate.method == "fitted"
    assert "not traced" in panel.view.text()
    # another config with the same parameter count is another trace, not the cached one
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**cfg, "max_position_embeddings": 1024}), encoding="utf-8")
    assert trace_panel.trace_key(fitted.setup) != trace_panel.trace_key(dataclasses.replace(
        fitted.setup, extras={"fit": type(fitted.setup.extras["fit"])(json.loads(other.read_text()), "", "")}))
    w.close()


# ---- with a fake engine ------------------------------------------------------------------------------
def test_an_edit_draws_analytic_at_once_cancels_and_restarts(window, qtbot, monkeypatch):
    w = window
    engine = use_engine(monkeypatch, FakeEngine(slow=(2,)))
    panel = w.trace_panel
    started: list[int] = []
    panel.started.connect(lambda setup: started.append(setup.batch))
    turn_on(qtbot, w, panel.progress)
    assert panel.is_running() and panel.progress_bar.isVisible() and panel.cancel_button.isVisible()
    assert w.result.estimate.method == "analytic"
    with qtbot.waitSignal(panel.finished, timeout=10_000) as blocker:
        w.inputs.batch.setText("3")  # typed: debounce → analytic at once → trace after
        qtbot.waitUntil(lambda: w.result.setup.batch == 3, timeout=2000)
        assert w.result.estimate.method == "analytic"  # drawn at once, while the old trace still runs
        assert w.last_refresh_ms < 100
    assert engine.stopped == [2]
    assert started == [2, 3]
    assert blocker.args[0].estimate.setup.batch == 3
    assert w.result.estimate.method == "trace" and w.result.setup.batch == 3
    assert_chart_is(w, blocker.args[0].estimate)
    assert "+2.0 %" in w.method_label.text()


def test_failure_keeps_the_analytic_result_and_says_why(window, qtbot, monkeypatch):
    w = window
    message = "the trace failed (NotImplementedError: aten::weird_op); the analytic estimate still holds"
    engine = use_engine(monkeypatch, FakeEngine(error=TraceError(message)))
    analytic = w.result
    blocker = turn_on(qtbot, w, w.trace_panel.failed)
    assert blocker.args == [message]
    assert w.result is analytic and w.result.estimate.method == "analytic"
    assert w.trace_result is None
    assert message in w.trace_panel.view.text()
    assert "failed" in w.trace_panel.note().lower()
    assert message in w.statusBar().currentMessage()
    assert w.trace_panel.toggle.isChecked()
    with qtbot.waitSignal(w.trace_panel.failed, timeout=5000):
        assert set_fields(w, batch="3")  # the next edit tries again
    assert engine.calls == [2, 3] and w.result.estimate.method == "analytic"
    w.undo()  # back to a setup that failed: the message again, no retry
    qtbot.wait(100)
    assert engine.calls == [2, 3] and message in w.trace_panel.view.text()


def test_cancel_keeps_the_analytic_result(window, qtbot, monkeypatch):
    w = window
    engine = use_engine(monkeypatch, FakeEngine(slow=(2,)))
    panel = w.trace_panel
    turn_on(qtbot, w, panel.progress)
    with qtbot.waitSignal(panel.cancelled, timeout=10_000):
        qtbot.mouseClick(panel.cancel_button, Qt.MouseButton.LeftButton)
    assert engine.stopped == [2]
    assert not panel.is_running()
    assert w.result.estimate.method == "analytic"
    assert "cancelled" in panel.view.text().lower()
    assert panel.toggle.isChecked() and not panel.cancel_button.isVisible()
    qtbot.wait(100)
    assert engine.calls == [2]  # no restart until the next edit


@pytest.mark.full_suite
def test_toggle_off_undo_and_the_cache(window, qtbot, monkeypatch):
    w = window
    engine = use_engine(monkeypatch, FakeEngine())
    panel = w.trace_panel
    turn_on(qtbot, w, panel.finished)
    assert w.result.estimate.method == "trace"
    with qtbot.waitSignal(panel.finished, timeout=10_000):
        assert set_fields(w, batch="4")
    assert w.result.setup.batch == 4 and w.result.estimate.method == "trace"
    assert engine.calls == [2, 4]
    w.undo()  # back to batch 2: its trace is drawn at once from the cache
    assert w.result.setup.batch == 2 and w.result.estimate.method == "trace"
    assert engine.calls == [2, 4]
    assert w.trace_action.isChecked()  # View → Precise (trace), Ctrl+T, follows the button
    w.trace_action.trigger()  # off
    assert not panel.toggle.isChecked() and panel.toggle.text() == trace_panel.TOGGLE_TEXT
    assert w.result.estimate.method == "analytic" and w.trace_result is None
    assert "trace" not in w.method_label.text().split(":")[1]
    assert "off" in panel.view.text()


@pytest.mark.full_suite
def test_distributed_setups_are_traced_and_parameter_counts_are_not(window, qtbot, monkeypatch):
    w = window
    engine = use_engine(monkeypatch, FakeEngine())
    panel = w.trace_panel
    turn_on(qtbot, w, panel.finished)
    with qtbot.waitSignal(panel.finished, timeout=5000):
        assert set_fields(w, gpus="4", strategy="zero2")
    assert w.result.setup.parallel.gpus == 4
    with qtbot.waitSignal(panel.skipped, timeout=5000) as blocker:
        assert set_fields(w, gpus="1", strategy="ddp", model_kind="params", params="50M")
    assert "architecture" in blocker.args[0]
    assert w.result.estimate.method == "quick"
    assert len(engine.calls) == 2


@pytest.mark.full_suite
def test_export_of_a_drawn_trace_includes_its_modules(window, qtbot, monkeypatch, tmp_path):
    from memcalc_gui.report import dialog

    w = window
    use_engine(monkeypatch, FakeEngine())
    assert dialog.current_modules(w) is None
    turn_on(qtbot, w, w.trace_panel.finished)
    seen = {}
    real = dialog.write_report

    def spy(result, target, **kw):
        seen.update(kw, result=result)
        return real(result, target, **kw)

    monkeypatch.setattr(dialog, "write_report", spy)
    out = w.export_report(tmp_path / "trace.pdf")
    assert out is not None and out.is_file()
    assert seen["result"].estimate.method == "trace"
    assert seen["modules"] == [("model.layers.*.mlp.gate_proj", 3000), ("lm_head", 1000)]
    set_fields(w, batch="5")  # analytic drawn again until the trace arrives: no modules
    assert w.result.estimate.method == "analytic" and dialog.current_modules(w) is None


def test_missing_torch_disables_the_toggle(qtbot, monkeypatch, tiny_config):
    monkeypatch.setattr(fake, "trace_available", lambda: False)
    w = MainWindow(initial_state=default_state().replace(model_kind="config", config_path=str(tiny_config)),
                   persist=False)
    qtbot.addWidget(w)
    toggle = w.trace_panel.toggle
    assert not toggle.isEnabled()
    assert "pip install 'memcalc-gui[measure]'" in toggle.toolTip()
    w.trace_panel.set_enabled(True)
    assert not toggle.isChecked() and w.result.estimate.method == "analytic"


def test_closing_while_tracing_stops_the_worker(qtbot, monkeypatch, tiny_config):
    use_engine(monkeypatch, FakeEngine(slow=(2,)))
    w = MainWindow(initial_state=default_state().replace(model_kind="config", config_path=str(tiny_config),
                                                         batch="2"), persist=False)
    qtbot.addWidget(w)
    w.show()
    with qtbot.waitSignal(w.trace_panel.progress, timeout=5000):
        w.trace_panel.set_enabled(True)
    w.close()
    assert not w.trace_panel.runner.thread_running()


def test_saved_toggle_traces_after_start_without_importing_torch_first(tmp_path):
    settings = tmp_path / "settings"
    settings.mkdir()
    (settings / "memcalc.ini").write_text("[trace]\nenabled=true\n", encoding="utf-8")
    code = textwrap.dedent("""
        import sys
        from memcalc_gui.app import create_application
        from memcalc_gui.trace import fake
        from memcalc_gui.ui.main_window import MainWindow
        calls = []
        fake.trace_estimate = lambda setup, **kw: calls.append(setup) or (_ for _ in ()).throw(
            fake.TraceError("stub"))
        app = create_application([])
        w = MainWindow()
        w.show()
        app.processEvents()
        assert w.trace_action.isChecked()
        print("checked", w.trace_panel.toggle.isChecked(), "torch_loaded", "torch" in sys.modules,
              "calls", len(calls))
        w.close()
    """)
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(ROOT), **{SETTINGS_ENV: str(settings)})
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "checked True torch_loaded False calls 0" in proc.stdout
