"""'Measure on this GPU' in the window (pytest-qt, offscreen): a real CPU measurement of a tiny model,
the overlay and the Measured tab, scaled-down setups, cancel, errors, OOM, CUDA overheads, shutdown."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QPointF, Qt
from PySide6.QtWidgets import QApplication

from memcalc_gui.core.errors import MemcalcError
from memcalc_gui.core.result import evaluate
from memcalc_gui.core.units import gib
from memcalc_gui.core.vocab import PHASES
from memcalc_gui.measure import engine
from memcalc_gui.ui import measure_panel
from memcalc_gui.ui.form import default_state
from memcalc_gui.ui.main_window import MainWindow
from memcalc_gui.ui.settings import SETTINGS_ENV
from memcalc_gui.ui.workers import TaskRunner
from memcalc_gui.view.chart import REF_DX

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=1024, hidden_size=128,
            intermediate_size=344, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
OOM = "Does not fit: out of memory in backward at micro-batch 8."
GPU = engine.DeviceInfo("cuda", "NVIDIA Test GPU 80GB", 80 * 2**30, 79 * 2**30)


@pytest.fixture(autouse=True)
def private_settings(tmp_path, monkeypatch):
    monkeypatch.setenv(SETTINGS_ENV, str(tmp_path / "settings"))
    monkeypatch.setattr(measure_panel, "DETECT_DELAY_MS", None)  # tests probe the device explicitly


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
    assert w.result is not None and w.result.setup.model is not None
    return w


def fake_result(w: MainWindow, *, device: engine.DeviceInfo = GPU, oom: str | None = None,
                factor: float = 1.01) -> engine.MeasureResult:
    """A measurement of the window's setup, as the engine would return it (CUDA unless told)."""
    setup = w.result.setup
    est = evaluate(setup)
    phases = {} if oom else {
        p: engine.PhaseReading(int(est.estimate.phases[p].tensor_bytes * factor),
                               int(est.estimate.phases[p].tensor_bytes * 0.9), {}, 0)
        for p in PHASES}
    cuda = device.kind == "cuda"
    peak = max((r.peak_bytes for r in phases.values()), default=0)
    return engine.MeasureResult(
        device, setup, setup, False, "", phases, est, [] if oom else [1000, 1000, 1000],
        context_bytes=300 * 2**20 if cuda else None, peak_reserved_bytes=int(peak * 1.25) if cuda and peak else None,
        oom=oom, seconds=0.5)


def slow_measure(*_args, progress=None, should_stop=None, **_kw):
    """A fake engine.measure that reports progress until it is told to stop."""
    deadline = time.monotonic() + 30
    i = 0
    while time.monotonic() < deadline:
        if should_stop():
            raise engine.Cancelled("measurement cancelled")
        i += 1
        progress(f"iteration {1 + i // 20 % 3} of 3: forward")
        time.sleep(0.01)
    raise AssertionError("the fake measurement was never cancelled")


def click(qtbot, button) -> None:
    assert button.isEnabled() and button.isVisible()
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)


# ---- the worker ------------------------------------------------------------------------------------
def test_task_runner_outcomes(qtbot):
    runner = TaskRunner("test-runner", cancel_types=(engine.Cancelled,))
    seen: list[str] = []
    runner.progress.connect(seen.append)
    with qtbot.waitSignal(runner.finished, timeout=5000) as blocker:
        runner.start(lambda progress, stop: (progress("step 1"), threading.current_thread().name, 42)[-1])
    assert blocker.args == [42] and seen == ["step 1"]
    assert not runner.is_running()
    with qtbot.waitSignal(runner.failed, timeout=5000) as blocker:
        runner.start(lambda progress, stop: (_ for _ in ()).throw(MemcalcError("no such thing")))
    assert blocker.args == ["no such thing"]
    with qtbot.waitSignal(runner.failed, timeout=5000) as blocker:
        runner.start(lambda progress, stop: 1 / 0)
    assert blocker.args[0].startswith("ZeroDivisionError")

    started = threading.Event()

    def loop(progress, stop):
        started.set()
        while not stop():
            time.sleep(0.005)
        raise engine.Cancelled("stop")

    runner.start(loop)
    with pytest.raises(RuntimeError):
        runner.start(loop)
    assert started.wait(5)
    with qtbot.waitSignal(runner.cancelled, timeout=5000):
        assert runner.stop()
    assert not runner.thread_running() and not runner.is_running()


def test_the_collector_never_runs_on_a_worker_thread(qtbot):
    """While a job runs the automatic collector is off (Qt objects in reference cycles must not be destroyed on
    a worker thread); it is back on once the job has reported, and after a stopped job too."""
    import gc

    from PySide6.QtCore import QCoreApplication, QEvent

    # jobs of earlier tests' windows end (a stopped window parks a running thread until it does) and closed windows
    # are deleted: a runner destroyed before its job's outcome was delivered gives its hold back; then the collector
    # is on again
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    qtbot.waitUntil(gc.isenabled, timeout=60000)
    runner = TaskRunner("gc-runner")
    inside: list[bool] = []
    with qtbot.waitSignal(runner.finished, timeout=5000):
        runner.start(lambda progress, stop: inside.append(gc.isenabled()))
    assert inside == [False]
    qtbot.waitUntil(gc.isenabled, timeout=3000)
    started = threading.Event()

    def loop(progress, stop):
        started.set()
        while not stop():
            time.sleep(0.005)

    runner.start(loop)
    assert started.wait(5) and not gc.isenabled()
    assert runner.stop()
    assert gc.isenabled()
    # a runner destroyed with its outcome never delivered gives the hold back as it goes
    other = TaskRunner("gc-dropped")
    other.start(lambda progress, stop: None)
    other._thread.wait()
    assert not gc.isenabled()
    other.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    assert gc.isenabled()



def test_a_jobs_own_collections_run_on_the_gui_thread(qtbot):
    """A measured step collects explicitly (memcalc_gui.measure.collect_garbage). Run on the worker, a collection
    that freed a closed window's widgets deadlocked the two threads for good (the suite's CI runs stopped in
    test_a_family_without_a_block_model_is_fitted_in_the_window: the worker in ``QObject::~QObject`` waiting for the
    interpreter lock, the GUI thread deleting a QMenu on Qt's object mutex while holding it). A runner's worker hands
    the collection to the GUI thread and waits for it."""
    from memcalc_gui import measure

    freed_on: list[str] = []

    class Cycle:
        def __init__(self) -> None:
            self.me = self  # only a collection frees it

        def __del__(self) -> None:
            freed_on.append(threading.current_thread().name)

    runner = TaskRunner("gc-collects")

    def job(progress, stop):
        Cycle()
        measure.collect_garbage()
        return list(freed_on)

    with qtbot.waitSignal(runner.finished, timeout=10000) as blocker:
        runner.start(job)
    assert blocker.args == [[threading.main_thread().name]]
    Cycle()
    measure.collect_garbage()  # the GUI thread itself collects at once
    assert freed_on == [threading.main_thread().name] * 2


# ---- device label ------------------------------------------------------------------------------------
def test_button_names_the_device_found_lazily(window, qtbot):
    panel = window.measure_panel
    assert panel.button.text() == "Measure on this machine…"  # nothing probed at start-up
    assert window.tabs.tabText(window.tabs.indexOf(panel.view)) == "Measured"
    with qtbot.waitSignal(panel.device_found, timeout=30000) as blocker:
        panel.detect_device()
    info = blocker.args[0]
    expected = "Measure on this CPU" if info.kind == "cpu" else f"Measure on {info.name}"
    assert panel.button.text() == expected
    assert measure_panel.button_text(GPU) == "Measure on NVIDIA Test GPU 80GB"


def test_detection_starts_a_moment_after_the_window_is_shown(qtbot, tiny_config, monkeypatch):
    monkeypatch.setattr(measure_panel, "DETECT_DELAY_MS", 50)
    monkeypatch.setattr(engine, "detect_device", lambda device="auto": GPU)
    w = MainWindow(persist=False)
    qtbot.addWidget(w)
    assert not w.measure_panel.detect_timer.isActive()  # not before the window is shown
    with qtbot.waitSignal(w.measure_panel.device_found, timeout=5000):
        w.show()
    assert w.measure_panel.button.text() == "Measure on NVIDIA Test GPU 80GB"


def test_without_torch_the_button_explains_how_to_install(qtbot, monkeypatch):
    monkeypatch.setattr(engine, "torch_available", lambda: False)
    w = MainWindow(persist=False)
    qtbot.addWidget(w)
    w.show()
    panel = w.measure_panel
    assert "PyTorch" in panel.button.text()
    assert "pip install 'memcalc-gui[measure]'" in panel.button.toolTip()
    click(qtbot, panel.button)
    assert not panel.is_running()
    assert "pip install 'memcalc-gui[measure]'" in panel.view.message.text()
    assert panel.view.message.isVisibleTo(panel.view)
    assert w.tabs.currentWidget() is panel.view


# ---- a real measurement ------------------------------------------------------------------------------
def test_real_cpu_measurement_draws_overlay_and_table(window, qtbot):
    w = window
    panel = w.measure_panel
    seen: list[str] = []
    panel.progress.connect(seen.append)
    with qtbot.waitSignal(panel.finished, timeout=120000) as blocker:
        click(qtbot, panel.button)
        assert not panel.button.isEnabled() and panel.cancel_button.isVisible()
    r: engine.MeasureResult = blocker.args[0]
    assert any("iteration 3 of 3: backward" in s for s in seen), seen
    assert r.device.kind == "cpu" and not r.scaled and r.oom is None
    assert panel.button.text() == "Measure on this CPU" and panel.button.isEnabled()
    assert not panel.cancel_button.isVisible() and not panel.progress_bar.isVisible()

    # Overlay: one marker per phase, on the tensor top of the drawn bar (context + measured).
    est = w.result.estimate
    points = w.chart.measured_points()
    assert [x for x, _ in points] == [float(i) for i in range(len(PHASES))]
    for (_, y), p in zip(points, PHASES, strict=True):
        assert y == pytest.approx(gib(est.phases[p].objects["cuda_context"] + r.phases[p].peak_bytes))
    assert "Measured (CPU)" in [label.text for _, label in w.chart.legend.items]
    assert not w.chart.measured_ref.isVisible()

    # Comparison table: measured, estimate, error under 3 % in every phase.
    view = panel.view
    assert w.tabs.currentWidget() is view and view.table.isVisibleTo(view)
    for p in PHASES:
        assert abs(r.error_pct[p]) < 3, (p, r.error_pct)
        assert abs(float(view.cell(p, 2).split()[0])) < 3
        assert view.cell(p, 0) and view.cell(p, 1)
    text = view.text()
    assert "CPU tensor measurement" in text and "Leak check" in text and "no growth" in text
    assert "-0.0 %" not in text
    assert not view.use_overheads.isEnabled()  # no CUDA context on a CPU
    assert "Measured on this CPU" in w.statusBar().currentMessage()

    # Timeline: the measured step's allocations and frees, its phase peaks the measured ones
    assert r.timeline is not None and r.timeline.source == "measured"
    assert r.timeline.phase_peaks() == {p: m.peak_bytes for p, m in r.phases.items() if p != "load"} | \
        {"load": r.timeline.phase_peaks()["load"]}
    assert w.timeline_panel.measured is r.timeline and "Measured" in w.timeline_panel.source.text()

    # Stale: a change of shape hides the overlay and says so; undo brings it back; capacity does not matter.
    w.inputs.set_state(w.inputs.state().replace(batch="4"))
    assert w.refresh()
    assert panel.is_stale() and not w.chart.measured.isVisible()
    assert "changed since this measurement" in view.text()
    w.undo()
    assert w.result.setup.batch == 2
    assert not panel.is_stale() and w.chart.measured.isVisible()
    w.inputs.set_state(w.inputs.state().replace(gpu="", capacity="24 GiB"))
    assert w.refresh()
    assert not panel.is_stale() and w.chart.measured.isVisible()


def test_scaled_down_measurement_compares_with_that_setup(window, qtbot, monkeypatch):
    monkeypatch.setattr(measure_panel, "TIME_BUDGET_S", 1e-9)  # forces the engine to scale down
    w = window
    panel = w.measure_panel
    with qtbot.waitSignal(panel.finished, timeout=120000) as blocker:
        click(qtbot, panel.button)
    r: engine.MeasureResult = blocker.args[0]
    assert r.scaled and r.setup.model.num_layers < 2
    view = panel.view
    assert view.scale_note.isVisibleTo(view)
    assert "Scaled down" in view.scale_note.text() and r.scale_note in view.scale_note.text()
    assert view.table.horizontalHeaderItem(1).text() == "Estimate\n(measured setup)"
    for p in PHASES:
        assert abs(r.error_pct[p]) < 3, (p, r.error_pct)
        # the table's estimate is the measured setup's, not the full one
        assert view.cell(p, 1) == measure_panel.format_bytes(r.estimate.estimate.phases[p].tensor_bytes)
    # The chart compares with the measured setup's estimate: outlined bars beside each phase, markers on them.
    assert w.chart.measured_ref.isVisible()
    heights = [float(h) for h in w.chart.measured_ref.opts["height"]]
    assert heights == pytest.approx([gib(r.estimate.estimate.phases[p].tensor_bytes) for p in PHASES])
    points = w.chart.measured_points()
    assert [x for x, _ in points] == pytest.approx([i + REF_DX for i in range(len(PHASES))])
    assert [y for _, y in points] == pytest.approx([gib(r.phases[p].peak_bytes) for p in PHASES])
    labels = [label.text for _, label in w.chart.legend.items]
    assert "Measured (CPU, scaled-down setup)" in labels and "Estimate of the measured setup" in labels


@pytest.mark.full_suite
def test_a_family_without_a_block_model_is_measured_against_its_fitted_ledger(window, qtbot, tmp_path,
                                                                              monkeypatch):
    """A Mixtral-shaped config (no block model: the fitted method) is measured for real, scaled down to fewer
    layers, and compared with the fitted ledger of exactly what ran; a layout the real ranks do not run (experts
    split) is refused with the reason."""
    pytest.importorskip("transformers")
    w = window
    cfg = dict(model_type="mixtral", hidden_size=64, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=6, vocab_size=512, max_position_embeddings=512,
               num_local_experts=4, num_experts_per_tok=2)
    path = tmp_path / "mixtral" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg), encoding="utf-8")
    before = w.result
    assert not w.open_config(path)  # the fitted result follows from the worker
    qtbot.waitUntil(lambda: w.result is not before and w.result.estimate.method == "fitted", timeout=60000)
    assert w.result.setup.model is None

    monkeypatch.setattr(measure_panel, "TIME_BUDGET_S", 1e-9)  # forces the engine to scale down
    panel = w.measure_panel
    with qtbot.waitSignal(panel.finished, timeout=120000) as blocker:
        click(qtbot, panel.button)
    r: engine.MeasureResult = blocker.args[0]
    assert r.oom is None and r.device.kind == "cpu" and r.scaled
    assert "2 of 6 layers" in r.scale_note and r.setup.extras["measured_layers"] == 2
    assert r.estimate.estimate.method == "fitted"
    for p in PHASES:
        assert abs(r.error_pct[p]) < 0.5, (p, r.error_pct)
        assert panel.view.cell(p, 1) == measure_panel.format_bytes(r.estimate.estimate.phases[p].tensor_bytes)
    assert w.chart.measured_ref.isVisible() and not panel.is_stale()

    # the staleness key holds the config (two configs of one parameter count are different setups)
    assert measure_panel.tensor_key(w.result.setup)["fitted_config"]
    # a layout the real ranks do not run says why, naming the field
    w.apply_state(w.inputs.state().replace(gpus="2", strategy="ddp", ep="2"))
    w.refresh()
    qtbot.waitUntil(lambda: w.result.setup.parallel.ep == 2 and not w.fit_runner.is_running(), timeout=120000)
    with qtbot.waitSignal(panel.failed, timeout=60000):
        click(qtbot, panel.button)
    assert "expert parallelism is measured for real under FSDP2" in panel.view.message.text()


# ---- cancel, errors, OOM ---------------------------------------------------------------------------
def test_cancel_stops_the_worker_and_the_window_stays_responsive(window, qtbot, monkeypatch):
    monkeypatch.setattr(engine, "measure", slow_measure)
    w = window
    panel = w.measure_panel
    with qtbot.waitSignal(panel.progress, timeout=5000):
        click(qtbot, panel.button)
    assert panel.is_running() and panel.cancel_button.isVisible() and panel.progress_label.isVisible()
    qtbot.waitUntil(lambda: panel.progress_bar.maximum() == 100, timeout=5000)  # iteration progress shown
    assert "Measuring: iteration" in panel.progress_label.text()
    # The window still estimates while the worker runs.
    w.inputs.set_state(w.inputs.state().replace(seq="128"))
    assert w.refresh() and w.result.setup.seq == 128
    with qtbot.waitSignal(panel.cancelled, timeout=5000):
        click(qtbot, panel.cancel_button)
    assert not panel.is_running()
    assert panel.runner.stop(5000) and not panel.runner.thread_running()
    assert panel.button.isEnabled() and not panel.cancel_button.isVisible()
    assert "cancelled" in panel.view.headline.text().lower()
    assert not w.chart.measured.isVisible()


@pytest.mark.parametrize(("exc", "expected"), [
    (engine.MeasureError("no CUDA device is available to this PyTorch build"),
     "no CUDA device is available to this PyTorch build"),
    (RuntimeError("boom"), "RuntimeError: boom"),
])
def test_errors_are_shown_in_the_panel(window, qtbot, monkeypatch, exc, expected):
    def failing(*_a, **_k):
        raise exc

    monkeypatch.setattr(engine, "measure", failing)
    panel = window.measure_panel
    with qtbot.waitSignal(panel.failed, timeout=5000) as blocker:
        click(qtbot, panel.button)
    assert blocker.args == [expected]
    view = panel.view
    assert view.message.isVisibleTo(view) and expected in view.message.text()
    assert "failed" in view.headline.text()
    assert window.tabs.currentWidget() is view
    assert expected in window.statusBar().currentMessage()
    assert panel.button.isEnabled() and not panel.is_running()


def test_oom_is_shown_as_a_result(window, qtbot, monkeypatch):
    w = window
    result = fake_result(w, oom=OOM)
    monkeypatch.setattr(engine, "measure", lambda *a, **k: result)
    panel = w.measure_panel
    with qtbot.waitSignal(panel.finished, timeout=5000):
        click(qtbot, panel.button)
    view = panel.view
    assert "does not fit" in view.headline.text()
    assert view.message.text() == OOM and view.message.isVisibleTo(view)
    assert not view.table.isVisibleTo(view)
    assert not w.chart.measured.isVisible()
    assert w.statusBar().currentMessage() == OOM
    assert panel.button.text() == "Measure on NVIDIA Test GPU 80GB"


def test_measured_cuda_overheads_apply_as_one_undo_step(window, qtbot, monkeypatch):
    w = window
    result = fake_result(w)
    monkeypatch.setattr(engine, "measure", lambda *a, **k: result)
    panel = w.measure_panel
    with qtbot.waitSignal(panel.finished, timeout=5000):
        click(qtbot, panel.button)
    view = panel.view
    text = view.text()
    assert "Reserved vs allocated" in text and "CUDA context" in text and "300.00 MiB" in text
    assert "CPU tensor measurement" not in text
    assert "Measured (NVIDIA Test GPU 80GB)" in [label.text for _, label in w.chart.legend.items]
    before = w.inputs.state()
    assert view.use_overheads.isEnabled()
    click(qtbot, view.use_overheads)
    setup = w.result.setup
    assert setup.cuda_context_bytes == pytest.approx(300 * 2**20, rel=1e-3)
    assert setup.allocator_reserve == pytest.approx(result.measured_overheads()["allocator_reserve"], abs=1e-4)
    assert w.chart.measured.isVisible() and not panel.is_stale()  # overheads do not change what was measured
    y_backward = w.chart.measured_points()[PHASES.index("backward")][1]
    assert y_backward == pytest.approx(gib(setup.cuda_context_bytes + result.phases["backward"].peak_bytes))
    w.undo()
    assert w.inputs.state() == before


def test_a_bare_parameter_count_cannot_be_measured(qtbot):
    w = MainWindow(initial_state=default_state().replace(model_kind="params", params="350M"), persist=False)
    qtbot.addWidget(w)
    w.show()
    click(qtbot, w.measure_panel.button)
    assert not w.measure_panel.is_running()
    assert "preset or open a config.json" in w.measure_panel.view.message.text()


# ---- shutdown ----------------------------------------------------------------------------------------
def test_closing_the_window_during_a_run_stops_the_worker(window, qtbot, monkeypatch):
    monkeypatch.setattr(engine, "measure", slow_measure)
    panel = window.measure_panel
    with qtbot.waitSignal(panel.progress, timeout=5000):
        click(qtbot, panel.button)
    assert panel.runner.thread_running()
    with qtbot.waitSignal(panel.cancelled, timeout=5000):
        window.close()
        assert not panel.runner.thread_running()  # closeEvent cancelled and waited
    QApplication.processEvents()


def test_quitting_during_a_run_exits_cleanly(tmp_path, tiny_config):
    code = textwrap.dedent(f"""
        import sys, time
        from PySide6.QtCore import QTimer
        from memcalc_gui.app import create_application
        from memcalc_gui.measure import engine
        from memcalc_gui.ui.form import default_state
        from memcalc_gui.ui.main_window import MainWindow

        def slow(*a, progress=None, should_stop=None, **k):
            while not should_stop():
                progress("iteration 1 of 3: forward")
                time.sleep(0.01)
            print("worker saw the stop", flush=True)
            raise engine.Cancelled("cancelled")

        engine.measure = slow
        app = create_application([])
        state = default_state().replace(model_kind="config", config_path={str(tiny_config)!r})
        w = MainWindow(initial_state=state, persist=False)
        w.show()
        # exit() (unlike quit()) closes no window: only aboutToQuit can stop the worker
        w.measure_panel.progress.connect(lambda s: QTimer.singleShot(50, lambda: app.exit(0)))
        QTimer.singleShot(0, w.measure_panel.start)
        app.exec()
        print("running after quit", w.measure_panel.runner.thread_running(), flush=True)
    """)
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env[SETTINGS_ENV] = str(tmp_path / "settings")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "worker saw the stop" in proc.stdout
    assert "running after quit False" in proc.stdout
    assert "Destroyed while thread" not in proc.stderr


def test_helpers():
    assert measure_panel.signed_pct(-0.01) == "0.0 %" and measure_panel.signed_pct(2.345) == "+2.3 %"
    assert measure_panel.progress_fraction("iteration 2 of 4: backward") == pytest.approx((1 + 1 / 3) / 4)
    assert measure_panel.progress_fraction("building the model on the CPU") is None
    assert re.fullmatch(r"Measure on .+", measure_panel.button_text(GPU))


def test_hovering_a_measured_marker_names_its_value_and_the_error(window, qtbot, monkeypatch):
    w = window
    result = fake_result(w, factor=0.96)
    monkeypatch.setattr(engine, "measure", lambda *a, **k: result)
    with qtbot.waitSignal(w.measure_panel.finished, timeout=5000):
        click(qtbot, w.measure_panel.button)
    chart = w.chart
    vb = chart.plot.getViewBox()
    x, y = chart.measured_points()[PHASES.index("backward")]
    text = chart.measured_tooltip_at(vb.mapViewToScene(QPointF(x, y)))
    measured = result.phases["backward"].peak_bytes
    assert "Measured" in text and "Backward" in text
    assert f"{measured / 2**30:.2f} GiB" in text and "+4.2 %" in text
    assert chart.measured_tooltip_at(vb.mapViewToScene(QPointF(x + 0.3, y))) == ""  # away from the marker


def test_a_multi_gpu_setup_is_measured_rank_by_rank(window, qtbot):
    """Two tensor-parallel ranks, each a real gloo process: the table is the rank the estimate describes, the ranks
    table lists both with their errors, the legend names the rank."""
    w = window
    w.inputs.set_state(w.inputs.state().replace(gpus="2", tp="2"))
    assert w.refresh()
    panel = w.measure_panel
    seen: list[str] = []
    panel.progress.connect(seen.append)
    with qtbot.waitSignal(panel.finished, timeout=180000) as blocker:
        click(qtbot, panel.button)
    r: engine.MeasureResult = blocker.args[0]
    assert any("starting 2 rank processes" in s for s in seen) and any("rank 1: iteration" in s for s in seen)
    assert len(r.ranks) == 2 and r.oom is None
    view = panel.view
    assert view.ranks_table.isVisibleTo(view) and view.ranks_table.rowCount() == 2
    for row, rank in enumerate(r.ranks):
        for phase in PHASES[1:]:
            assert abs(rank.error_pct[phase]) < 1, (rank.label, phase, rank.error_pct)
            assert view.rank_cell(row, phase).startswith(measure_panel.format_bytes(rank.phases[phase].peak_bytes))
    assert f"Measured (CPU, rank {r.shown_rank + 1} of 2)" in [label.text for _, label in w.chart.legend.items]
    assert "Every rank" in view.text() and "gloo" in view.text()
    assert r.headline().startswith("Measured 2 ranks on this CPU")
