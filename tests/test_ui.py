"""The main window (pytest-qt, offscreen): live estimates, inline errors, undo, files, settings."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
from pathlib import Path

import pytest
from tiers import sample

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QMimeData, QPointF, QSettings, Qt, QThreadPool, QTimer, QUrl
from PySide6.QtGui import QColor, QDropEvent, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from memcalc_gui import __version__
from memcalc_gui.core.layouts import Layout
from memcalc_gui.core.resources import load_json
from memcalc_gui.core.result import evaluate
from memcalc_gui.core.units import format_bytes, gib
from memcalc_gui.core.vocab import OBJECTS, PHASES
from memcalc_gui.ui.form import FormState, ModelCache, build_setup, default_state
from memcalc_gui.ui.main_window import MainWindow
from memcalc_gui.ui.settings import KEY_SETUP, SETTINGS_ENV, make_settings

OVER = dict(preset="qwen2.5-7b", batch="4", seq="2048", precision="mixed", gpu="a100-80gb")


@pytest.fixture(autouse=True)
def private_settings(tmp_path, monkeypatch):
    """Never the user's settings: an env var for the window, QSettings paths for anything else."""
    folder = tmp_path / "settings"
    monkeypatch.setenv(SETTINGS_ENV, str(folder))
    QSettings.setDefaultFormat(QSettings.Format.IniFormat)
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(tmp_path / "qsettings"))
    QSettings.setPath(QSettings.Format.NativeFormat, QSettings.Scope.UserScope, str(tmp_path / "qsettings"))
    return folder


@pytest.fixture
def window(qtbot):
    w = MainWindow()
    qtbot.addWidget(w)
    w.resize(1280, 800)  # wide enough for "What to change" beside the ledger (narrower: a tab)
    w.show()
    return w


def set_fields(w: MainWindow, **fields: str) -> bool:
    """Apply form fields as a user would (through the widgets) and estimate now."""
    state = w.inputs.state().replace(**fields)
    if "gpu" in fields and "capacity" not in fields:
        from memcalc_gui.ui.form import capacity_text, gpu_by_id

        state = state.replace(capacity=capacity_text(gpu_by_id()[fields["gpu"]]))
    w.inputs.set_state(state)
    return w.refresh()


def assert_chart_matches_result(w: MainWindow) -> None:
    est = w.result.estimate
    drawn = w.chart.heights()
    for o in OBJECTS:
        assert drawn[o] == pytest.approx([gib(est.phases[p].objects[o]) for p in PHASES]), o


# ---- drawing ---------------------------------------------------------------------------------
def test_default_window_draws_the_core_estimate(window):
    w = window
    assert w.result is not None
    assert w.inputs.state() == default_state()
    expected = evaluate(build_setup(default_state(), ModelCache()))
    assert w.result.estimate.phases == expected.estimate.phases
    assert_chart_matches_result(w)
    assert w.banner.text.text() == expected.headline()
    assert w.banner.state() == "fits"
    peak_col = PHASES.index(expected.estimate.peak_phase)
    assert w.table.bytes_at(w.table.total_row, peak_col) == expected.estimate.peak_bytes
    assert "(peak)" in dict(w.chart.plot.getAxis("bottom")._tickLevels[0][0:4])[
        float(PHASES.index(expected.estimate.peak_phase))]
    assert w.chart.capacity_line.isVisible()
    assert not w.chart.plot.getAxis("left").autoSIPrefix


def test_typing_changes_chart_and_verdict_in_place(window, qtbot):
    w = window
    bars_before = dict(w.chart.bars)
    acts_before = w.chart.heights()["activations"]
    headline_before = w.headline()
    w.inputs.batch.selectAll()
    with qtbot.waitSignal(w.result_changed, timeout=2000):
        qtbot.keyClicks(w.inputs.batch, "32")
    assert w.inputs.state().batch == "32"
    assert w.chart.heights()["activations"][1] > acts_before[1] * 4
    assert w.headline() != headline_before
    assert w.banner.state() == "over"
    assert w.headline().startswith("Does not fit")
    assert w.chart.bars == bars_before  # the same plot items, updated in place
    assert all(w.chart.bars[o] is bars_before[o] for o in OBJECTS)
    assert_chart_matches_result(w)


def test_typing_redraws_live(window, qtbot):
    """Keystroke → debounce → estimate → items updated in place (timings: bench/ui_speed.py)."""
    w = window
    w.inputs.seq.setFocus()
    bars = dict(w.chart.bars)
    for i in range(4):
        w.inputs.seq.selectAll()
        value = 512 * (1 + i)
        with qtbot.waitSignal(w.result_changed, timeout=2000):
            qtbot.keyClicks(w.inputs.seq, str(value))
        assert w.result.setup.seq == value
        assert w.result.estimate.method == "analytic"
        assert w.last_refresh_ms > 0
    assert w.chart.bars == bars  # the same plot items, updated in place


def test_capacity_and_gpu(window):
    w = window
    assert set_fields(w, gpu="h100-80gb")
    assert w.result.verdict.capacity_bytes == w.result.setup.capacity_bytes
    assert "H100" in w.chart.capacity_label.format
    assert set_fields(w, gpu="", capacity="24GB")
    assert w.result.verdict.capacity_bytes == 24 * 10**9
    assert set_fields(w, capacity="")
    assert w.result.verdict.fits is None
    assert w.banner.state() == "neutral"
    assert not w.chart.capacity_line.isVisible()


def test_editing_capacity_switches_gpu_to_custom(window, qtbot):
    w = window
    w.inputs.capacity.setText("40 GiB")
    assert w.inputs.state().gpu == ""
    w.inputs.gpu.setCurrentIndex(w.inputs.gpu.findData("rtx-4090"))
    assert w.inputs.state().capacity.endswith("GiB") and w.inputs.state().gpu == "rtx-4090"


# ---- invalid input ---------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "text", "words"), [
    ("batch", "abc", "positive integer"),
    ("seq", "0", "positive integer"),
    ("grad_accum", "1.5", "positive integer"),
    ("capacity", "80 parsecs", "unit"),
    ("cuda_context", "lots", "size"),
    ("allocator_reserve", "150 %", "percentage"),
])
def test_invalid_entry_is_marked_inline_and_keeps_the_result(window, field, text, words):
    w = window
    result = w.result
    heights = w.chart.heights()
    getattr(w.inputs, field).setText(text)
    assert w.refresh() is False
    errors = w.inputs.errors()
    assert set(errors) == {field}
    assert words in errors[field]
    box = w.inputs.boxes[field]
    assert box.error.isVisible() and box.field.property("invalid") is True
    assert w.result is result
    assert w.chart.heights() == heights
    assert "last valid" in w.statusBar().currentMessage()
    getattr(w.inputs, field).setText(getattr(default_state(), field))
    assert w.refresh() is True
    assert w.inputs.errors() == {}
    assert not box.error.isVisible()


def test_cross_field_error_from_the_core_names_its_field(window):
    w = window
    assert set_fields(w, optimizer="adamw-8bit", optimizer_impl="foreach")
    w.inputs.optimizer_impl.setCurrentIndex(w.inputs.optimizer_impl.findData("fused"))
    assert w.refresh() is False
    assert "8-bit" in w.inputs.errors()["optimizer_impl"]


def test_preset_filter_text_is_not_a_crash(window):
    w = window
    w.inputs.preset.setEditText("qwen")
    assert w.refresh() is False
    assert "presets match" in w.inputs.errors()["preset"]
    w.inputs.preset.setEditText("no-such-model")
    assert w.refresh() is False
    w.inputs.preset.setEditText("gpt2")
    assert w.refresh() is True
    assert w.result.setup.model.family == "gpt2"


def test_params_only_uses_quick_method(window):
    w = window
    assert set_fields(w, model_kind="params", params="350M")
    assert w.result.estimate.method == "quick"
    assert w.result.setup.num_params == 350_000_000
    assert "quick" in w.inputs.model_info.text() and "rough" in w.inputs.model_info.text()
    assert "quick" in w.method_label.text()
    for text in ("1.5B", "1.5e9"):
        assert set_fields(w, params=text)
        assert w.result.setup.num_params == 1_500_000_000
    w.inputs.params.setText("lots")
    assert w.refresh() is False and "params" in w.inputs.errors()


# ---- precision presets -----------------------------------------------------------------------
def test_precision_recipe_fills_fields_that_stay_editable(window):
    w = window
    inputs = w.inputs
    inputs.recipe.setCurrentIndex(inputs.recipe.findData("adam8bit"))
    s = inputs.state()
    assert (s.precision, s.optimizer) == ("mixed", "adamw-8bit")
    inputs.recipe.setCurrentIndex(inputs.recipe.findData("fp32"))
    assert (inputs.state().precision, inputs.state().optimizer) == ("fp32", "adamw")
    inputs.optimizer.setCurrentIndex(inputs.optimizer.findData("sgd"))
    assert inputs.recipe.currentData() == "custom"
    assert w.refresh()
    assert w.result.setup.optimizer == "sgd"
    inputs.precision.setCurrentIndex(inputs.precision.findData("bf16"))
    assert w.refresh() and w.result.setup.precision == "bf16"


def test_qlora_recipe_sets_the_method_and_checkpointing(window):
    """The "QLoRA (4-bit base)" preset is the QLoRA paper's recipe: QLoRA, bf16 autocast, paged 32-bit AdamW and
    checkpointing; it matches only while the method is QLoRA, and the fp32-cast switch is editable under QLoRA."""
    w = window
    inputs = w.inputs
    assert not inputs.prepare_kbit.isEnabled()  # full fine-tuning: nothing to cast
    inputs.recipe.setCurrentIndex(inputs.recipe.findData("qlora"))
    s = inputs.state()
    assert (s.tuning, s.precision, s.optimizer, s.checkpointing) == ("qlora", "mixed", "paged-adamw-32bit", "full")
    assert inputs.prepare_kbit.isEnabled() and inputs.prepare_kbit.isChecked()
    assert w.refresh() and w.result.setup.tuning.method == "qlora"
    assert w.result.estimate.phases["optimizer_step"].objects["paged_optimizer_state"] > 0
    with_cast = w.result.estimate.phases["load"].objects["parameters"]
    inputs.prepare_kbit.setChecked(False)
    assert w.refresh() and w.result.setup.tuning.prepare_kbit is False
    assert w.result.setup.precision == "mixed"  # fp32 master weights: the cast changes nothing here
    assert w.result.estimate.phases["load"].objects["parameters"] == with_cast
    inputs.tuning.setCurrentIndex(inputs.tuning.findData("lora"))
    assert inputs.recipe.currentData() == "custom"  # the QLoRA preset no longer describes the setup
    inputs.tuning.setCurrentIndex(inputs.tuning.findData("qlora"))
    assert inputs.recipe.currentData() == "qlora"


def test_every_field_has_a_tooltip_and_is_keyboard_reachable(window):
    w = window
    for name, box in w.inputs.boxes.items():
        if name == "general":
            continue
        assert box.field.toolTip(), name
        assert box.field.focusPolicy() & Qt.FocusPolicy.TabFocus, name
    # Tab order runs through the inputs top to bottom.
    widget = w.inputs.model_kind
    seen = []
    for _ in range(60):
        widget = widget.nextInFocusChain()
        if widget in (w.inputs.batch, w.inputs.seq, w.inputs.grad_accum, w.inputs.capacity):
            seen.append(widget)
    assert seen[:4] == [w.inputs.batch, w.inputs.seq, w.inputs.grad_accum, w.inputs.capacity]


# ---- suggestions and undo ----------------------------------------------------------------------
def test_suggestion_applies_and_undoes(window, qtbot):
    w = window
    assert set_fields(w, **OVER)
    before = w.inputs.state()
    assert w.banner.state() == "over"
    suggestions = w.advice.suggestions()
    assert suggestions
    first = suggestions[0]
    card = w.advice.buttons[0]
    assert card.isVisible() and first.title in card.text()
    with qtbot.waitSignal(w.result_changed, timeout=2000):
        qtbot.mouseClick(card, Qt.MouseButton.LeftButton)
    after = w.inputs.state()
    for key, value in first.changes.items():
        assert getattr(after, key) == str(value)
    assert w.result.estimate.peak_bytes == first.peak_bytes
    assert w.undo_stack.undoText() == first.title
    w.undo()
    assert w.inputs.state() == before
    assert w.result.setup == build_setup(before, ModelCache())
    w.redo()
    assert w.inputs.state() == after


def test_use_largest_micro_batch(window, qtbot):
    w = window
    assert set_fields(w, batch="1")
    best = w.result.verdict.max_micro_batch
    assert best and best > 1
    assert w.advice.use_max.isVisible()
    effective = w.result.setup.effective_batch
    qtbot.mouseClick(w.advice.use_max, Qt.MouseButton.LeftButton)
    # the effective batch is kept: the largest micro-batch ≤ best that divides it, accumulation adjusted
    assert w.result.setup.effective_batch == effective
    assert w.result.setup.batch == max(d for d in range(1, best + 1) if effective % d == 0)
    assert w.result.verdict.fits
    w.undo()
    assert w.result.setup.batch == 1


def test_use_largest_micro_batch_keeps_the_effective_batch_when_over(window, qtbot):
    w = window
    assert set_fields(w, preset="qwen2.5-1.5b", batch="16", grad_accum="4", seq="2048")
    assert w.result.verdict.fits is False
    best = w.result.verdict.max_micro_batch
    assert 0 < best < 16
    qtbot.mouseClick(w.advice.use_max, Qt.MouseButton.LeftButton)
    assert w.result.setup.effective_batch == 64
    assert w.result.setup.batch <= best and w.result.verdict.fits
    assert w.statusBar().currentMessage().startswith("Applied: Use micro-batch")


def test_typing_in_one_field_is_one_undo_step(window, qtbot):
    w = window
    w.inputs.batch.selectAll()
    for ch in "16":
        with qtbot.waitSignal(w.result_changed, timeout=2000):
            qtbot.keyClicks(w.inputs.batch, ch)
    assert w.inputs.state().batch == "16"
    assert w.undo_stack.count() == 1
    w.inputs.checkpointing.setChecked(True)
    w.refresh()
    assert w.undo_stack.count() == 2
    w.undo()
    assert w.inputs.state().checkpointing == "none"
    w.undo()
    assert w.inputs.state().batch == "4"
    assert not w.undo_stack.canUndo()


def test_ctrl_z_reaches_the_window_from_a_line_edit(window, qtbot):
    w = window
    w.activateWindow()
    w.inputs.seq.setFocus()
    w.inputs.seq.setText("4096")
    w.refresh()
    assert w.result.setup.seq == 4096
    qtbot.keyClick(w.inputs.seq, Qt.Key.Key_Z, Qt.KeyboardModifier.ControlModifier)
    assert w.inputs.state().seq == "2048"
    assert w.result.setup.seq == 2048
    qtbot.keyClick(w.inputs.seq, Qt.Key.Key_Z, Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier)
    assert w.result.setup.seq == 4096


def test_undo_first_reverts_an_invalid_entry(window):
    w = window
    w.inputs.batch.setText("x")
    w.undo()
    assert w.inputs.state().batch == "4"
    assert w.inputs.errors() == {}


def test_reset_to_defaults_is_undoable(window):
    w = window
    assert set_fields(w, batch="2", seq="512", attention="eager")
    changed = w.inputs.state()
    w.reset_action.trigger()
    assert w.inputs.state() == default_state()
    w.undo()
    assert w.inputs.state() == changed


def test_up_down_keys_step_the_micro_batch(window, qtbot):
    w = window
    qtbot.keyClick(w.inputs.batch, Qt.Key.Key_Up)
    assert w.inputs.batch.text() == "5"
    qtbot.keyClick(w.inputs.batch, Qt.Key.Key_PageUp)
    assert w.inputs.batch.text() == "10"
    qtbot.keyClick(w.inputs.batch, Qt.Key.Key_PageDown)
    qtbot.keyClick(w.inputs.batch, Qt.Key.Key_Down)
    assert w.inputs.batch.text() == "4"


# ---- config.json -----------------------------------------------------------------------------
def write_config(folder: Path, name: str, cfg: object) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg), encoding="utf-8")
    return path


def test_open_config_and_a_broken_one(window, tmp_path, qtbot):
    w = window
    good = write_config(tmp_path / "good", "config.json", load_json("models/qwen2.5-0.5b.json"))
    assert w.open_config(good)
    assert w.result.setup.model.source == str(good)
    assert w.result.estimate.method == "analytic"
    assert str(good) in w.inputs.model_info.text()
    assert w.inputs.state().model_kind == "config"
    result = w.result

    broken = write_config(tmp_path / "broken", "config.json", "{ not json")
    assert not w.open_config(broken)
    assert "not valid JSON" in w.inputs.errors()["config_path"]
    assert w.result is result
    assert "Could not use" in w.statusBar().currentMessage()

    cfg = dict(load_json("models/qwen2.5-0.5b.json"), model_type="t5")
    unsupported = write_config(tmp_path / "t5", "config.json", cfg)
    assert not w.open_config(unsupported)  # no block model: the fitted method calibrates, and finds no causal LM
    qtbot.waitUntil(lambda: "causal language model" in w.inputs.errors().get("config_path", ""), timeout=30000)
    assert w.result is result

    cfg = dict(load_json("models/qwen2.5-0.5b.json"), hidden_size=-3)
    bad_key = write_config(tmp_path / "bad", "config.json", cfg)
    assert not w.open_config(bad_key)
    assert "positive integer" in w.inputs.errors()["config_path"]
    assert w.result is result
    w.undo()  # reverts the invalid entry to the last valid (the good config)
    assert w.inputs.state().config_path == str(good)


def test_drop_a_config_json(window, tmp_path):
    w = window
    good = write_config(tmp_path, "config.json", load_json("models/gpt2.json"))
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(good))])
    event = QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                       Qt.KeyboardModifier.NoModifier)
    w.dropEvent(event)
    assert w.result.setup.model.family == "gpt2"
    assert w.inputs.state().config_path == str(good)


# ---- ledger, chart details, about --------------------------------------------------------------
def test_ledger_lists_the_parameter_parts_and_a_paged_state_only_when_there(window, qtbot):
    """LoRA: indented sub-rows under Parameters (trainable adapters, frozen base, autocast copies) that add up to
    the parameters row in every phase; a paged optimizer adds its own row and legend entry; full training on AdamW
    has neither."""
    w = window
    plain_rows = w.table.rowCount()
    assert ("object", "paged_optimizer_state") not in w.table.rows
    assert "Paged optimizer state" not in w.chart.legend_labels()
    w.apply_state(w.inputs.state().replace(preset="llama-3.2-1b", tuning="lora", optimizer="paged-adamw-8bit",
                                           precision="mixed", model_kind="preset"))
    qtbot.waitUntil(lambda: w.result is not None and w.result.setup.tuning.method == "lora", timeout=5000)
    est = w.result.estimate
    parts = [key for kind, key in w.table.rows if kind == "part"]
    assert parts == ["trainable adapters", "frozen base", "autocast copies"]
    params_row = w.table.row_of("object", "parameters")
    for c, phase in enumerate(PHASES):
        total = sum(w.table.bytes_at(w.table.row_of("part", key), c) for key in parts)
        assert total == w.table.bytes_at(params_row, c) == est.phases[phase].objects["parameters"]
    assert w.table.bytes_at(w.table.row_of("part", "trainable adapters"), 0) == \
        4 * w.result.setup.tuning.trainable_params(w.result.setup.model)
    paged_row = w.table.row_of("object", "paged_optimizer_state")
    assert w.table.bytes_at(paged_row, PHASES.index("optimizer_step")) == \
        est.phases["optimizer_step"].objects["paged_optimizer_state"] > 0
    assert "Paged optimizer state" in w.chart.legend_labels()
    assert w.table.rowCount() == plain_rows + 4
    tsv = w.table.copy_selection()
    assert "of which trainable adapters\t" in tsv and "Paged optimizer state\t" in tsv


def test_ledger_copies_tsv(window, qtbot):
    w = window
    w.table.clearSelection()
    text = w.table.copy_selection()
    lines = text.strip().split("\n")
    assert lines[0].split("\t") == ["Object (GiB)", "Load", "Forward", "Backward", "Optimizer step"]
    assert len(lines) == 1 + len(OBJECTS) - 1 + 1  # no paged optimizer state row for AdamW
    assert lines[-1].startswith("Total\t")
    peak = w.result.estimate
    assert float(lines[-1].split("\t")[1 + PHASES.index(peak.peak_phase)]) == pytest.approx(gib(peak.peak_bytes),
                                                                                          abs=1e-4)
    assert QGuiApplication.clipboard().text() == text
    w.activateWindow()
    w.tabs.setCurrentWidget(w.table)
    w.table.setFocus()
    w.table.setCurrentCell(0, 0)
    w.table.selectRow(0)
    QGuiApplication.clipboard().clear()
    qtbot.keyClick(w.table, Qt.Key.Key_C, Qt.KeyboardModifier.ControlModifier)  # Ctrl+C: TSV of the selection
    copied = QGuiApplication.clipboard().text().strip().split("\n")
    assert len(copied) == 2 and copied[1].startswith("Parameters\t") and copied[1].count("\t") == 4
    exact = w.table.copy_selection(exact_bytes=True)
    assert exact.split("\n")[1].split("\t")[1] == str(peak.phases["load"].objects["parameters"])


def test_chart_hover_tooltip_names_object_phase_and_bytes(window):
    w = window
    est = w.result.estimate
    params = gib(est.phases["load"].objects["parameters"])
    ctx = gib(est.phases["load"].objects["cuda_context"])
    hit = w.chart.segment_at(0.05, ctx + params / 2)
    assert hit == ("parameters", "load")
    text = w.chart.tooltip_text(*hit)
    assert "Parameters" in text and "Load" in text
    assert f"{est.phases['load'].objects['parameters']:,} bytes" in text
    assert w.chart.segment_at(0.5, 1.0) is None  # between bars
    # A mouse move over the segment shows the tooltip without errors.
    vb = w.chart.plot.getViewBox()
    scene_pos = vb.mapViewToScene(QPointF(0.0, ctx + params / 2))
    w.chart._on_mouse_moved(scene_pos)
    assert "Parameters" in w.chart._tooltip


def test_measured_markers_stub(window):
    w = window
    w.chart.set_measured({"backward": 10 * 2**30})
    assert w.chart.measured.isVisible()
    w.chart.set_measured(None)
    assert not w.chart.measured.isVisible()


def test_about_dialog_lists_version_licences_and_sources(window):
    dialog = window.show_about()
    html = dialog.browser.toPlainText()
    for words in (__version__, "LGPL", "pyqtgraph", "MIT", "DejaVu", "Korthikanti", "ZeRO",
                  "Visualize and understand GPU memory in PyTorch", "GPU memory", "Zhihu", "DeepHub", "ledger"):
        assert words in html, words
    dialog.close()


def test_dark_palette_is_applied_to_the_chart(window):
    w = window
    pal = QPalette()
    pal.setColor(QPalette.ColorRole.Window, QColor("#202124"))
    pal.setColor(QPalette.ColorRole.Base, QColor("#17181a"))
    pal.setColor(QPalette.ColorRole.WindowText, QColor("#e8eaed"))
    pal.setColor(QPalette.ColorRole.Text, QColor("#e8eaed"))
    w.setPalette(pal)
    QApplication.processEvents()
    assert w.chart.backgroundBrush().color().name() == "#17181a"
    assert w.refresh()


# ---- settings ----------------------------------------------------------------------------------
def test_settings_round_trip_in_a_temporary_location(qtbot, private_settings):
    w1 = MainWindow()
    qtbot.addWidget(w1)
    w1.show()
    w1.resize(790, 590)
    size = (w1.width(), w1.height())
    assert set_fields(w1, batch="8", gpu="h100-80gb", checkpointing="full")
    saved = w1.inputs.state()
    w1.close()
    assert (private_settings / "memcalc.ini").is_file()
    w2 = MainWindow()
    qtbot.addWidget(w2)
    assert w2.inputs.state() == saved
    assert w2.result.setup.batch == 8 and w2.result.setup.checkpointing == "full"
    assert (w2.width(), w2.height()) == size
    assert not w2.undo_stack.canUndo()
    w2.close()


def test_a_saved_config_path_that_vanished_falls_back_to_the_default(qtbot, tmp_path):
    settings = make_settings()
    gone = tmp_path / "gone" / "config.json"
    state = default_state().replace(model_kind="config", config_path=str(gone), batch="2")
    settings.setValue(KEY_SETUP, json.dumps(state.to_json()))
    settings.sync()
    w = MainWindow()
    qtbot.addWidget(w)
    assert w.inputs.state() == default_state()
    assert "no longer exists" in w.statusBar().currentMessage()
    w.close()


def test_a_corrupt_saved_setup_falls_back_to_the_default(qtbot):
    settings = make_settings()
    settings.setValue(KEY_SETUP, json.dumps(default_state().replace(batch="-3").to_json()))
    settings.sync()
    w = MainWindow()
    qtbot.addWidget(w)
    assert w.inputs.state() == default_state()
    assert "could not be used" in w.statusBar().currentMessage()
    w.close()
    settings.setValue(KEY_SETUP, "{ nonsense")
    settings.sync()
    w = MainWindow()
    qtbot.addWidget(w)
    assert w.inputs.state() == default_state()
    w.close()


@pytest.mark.full_suite
def test_a_saved_family_without_a_block_model_is_fitted_again_not_replaced(qtbot, tmp_path, monkeypatch):
    """The window starts on the saved OPT config: it is calibrated in the worker (no result yet, nothing invalid),
    not swapped for the default as an unusable setup."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("MEMCALC_CACHE_DIR", str(tmp_path / "fits"))
    cfg = {"model_type": "opt", "hidden_size": 64, "ffn_dim": 128, "num_attention_heads": 4, "num_hidden_layers": 3,
           "vocab_size": 512, "max_position_embeddings": 512, "word_embed_proj_dim": 64, "pad_token_id": 1}
    path = write_config(tmp_path / "opt", "config.json", cfg)
    settings = make_settings()
    state = default_state().replace(model_kind="config", config_path=str(path), batch="2", seq="64")
    settings.setValue(KEY_SETUP, json.dumps(state.to_json()))
    settings.sync()
    w = MainWindow()
    qtbot.addWidget(w)
    w.show()
    assert w.inputs.state() == state and not w.inputs.errors()
    assert "could not be used" not in w.statusBar().currentMessage()
    assert w.result is None  # nothing drawn yet: an empty chart, and no "last valid setup" to speak of
    assert not w.chart.peak_band.isVisible() and not w.chart.capacity_line.isVisible()
    assert w.banner.stale_note.text().startswith("Fitting model_type 'opt'")
    assert not w.advice.use_max.isVisible()
    qtbot.waitUntil(lambda: w.result is not None and w.result.estimate.method == "fitted", timeout=120_000)
    assert w.result.setup.extras["model_type"] == "opt" and w.inputs.state() == state
    assert not w.undo_stack.canUndo()
    w.close()


def test_closing_while_fitting_stops_the_calibration(qtbot, tmp_path, monkeypatch):
    """The calibration's worker stops between its small traces when the window closes (no thread left running)."""
    pytest.importorskip("transformers")
    from memcalc_gui.trace import fit as fit_module

    monkeypatch.setenv("MEMCALC_CACHE_DIR", str(tmp_path / "fits"))
    started = threading.Event()
    original = fit_module._trace
    traces: list[int] = []

    def slow_trace(*args, **kwargs):  # the first small trace waits until the window has asked the worker to stop
        traces.append(1)
        started.set()
        time.sleep(0.5)
        return original(*args, **kwargs)

    monkeypatch.setattr(fit_module, "_trace", slow_trace)
    cfg = {"model_type": "opt", "hidden_size": 64, "ffn_dim": 128, "num_attention_heads": 4, "num_hidden_layers": 3,
           "vocab_size": 512, "max_position_embeddings": 512, "word_embed_proj_dim": 64, "pad_token_id": 1}
    state = default_state().replace(model_kind="config", batch="2", seq="64",
                                    config_path=str(write_config(tmp_path / "opt", "config.json", cfg)))
    w = MainWindow(initial_state=state, persist=False)
    qtbot.addWidget(w)
    w.show()
    qtbot.waitUntil(started.is_set, timeout=60_000)
    w.close()
    qtbot.waitUntil(lambda: not w.fit_runner.thread_running(), timeout=60_000)
    assert traces == [1]  # the small trace under way when the window closed, not the rest of the calibration


def test_a_saved_gpu_missing_from_the_table_keeps_its_capacity(qtbot):
    settings = make_settings()
    state = default_state().replace(gpu="retired-gpu", capacity="40 GiB")
    settings.setValue(KEY_SETUP, json.dumps(state.to_json()))
    settings.sync()
    w = MainWindow()
    qtbot.addWidget(w)
    assert w.inputs.state() == state.replace(gpu="")
    assert w.result.verdict.capacity_bytes == 40 * 2**30
    assert not w.undo_stack.canUndo()
    w.close()


def test_unpersisted_window_writes_no_settings(qtbot, private_settings):
    w = MainWindow(initial_state=FormState(capacity=""), persist=False)
    qtbot.addWidget(w)
    w.close()
    assert not (private_settings / "memcalc.ini").exists()


# ---- lifecycle ---------------------------------------------------------------------------------
def test_no_leaked_timers_or_threads(qtbot):
    threads_before = threading.active_count()
    w = MainWindow()
    qtbot.addWidget(w)
    w.show()
    w.inputs.batch.setText("6")  # leaves the debounce timer running
    assert w.debounce.isActive()
    w.close()
    QApplication.processEvents()
    active = [t for t in w.findChildren(QTimer) if t.isActive()]
    assert active == []
    assert QThreadPool.globalInstance().activeThreadCount() == 0
    assert threading.active_count() == threads_before
    assert w.result.setup.batch == 6  # the pending edit was estimated (and saved) on close


def test_state_json_round_trip():
    s = default_state().replace(batch="7", model_kind="params", params="350M")
    assert FormState.from_json(json.loads(json.dumps(s.to_json()))) == s
    with pytest.raises(ValueError):
        FormState.from_json({"batch": 3})
    with pytest.raises(ValueError):
        FormState.from_json({"model_kind": "weights"})
    assert FormState.from_json({"unknown": "x"}) == FormState()


def test_drag_enter_accepts_only_json(window):
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile("/tmp/readme.txt")])
    assert window._dropped_path(_FakeDrop(mime)) is None
    mime.setUrls([QUrl.fromLocalFile("/tmp/config.json")])
    assert window._dropped_path(_FakeDrop(mime)) == "/tmp/config.json"


class _FakeDrop:
    def __init__(self, mime: QMimeData) -> None:
        self._mime = mime

    def mimeData(self) -> QMimeData:
        return self._mime


def test_a_fix_with_sharding_and_offload_applies_to_the_form(window, qtbot):
    w = window
    assert set_fields(w, preset="llama-3.1-70b", batch="4", seq="2048", grad_accum="4", gpu="h100-80gb")
    assert w.result.verdict.fits is False
    first = w.advice.suggestions()[0]
    assert first.key.startswith("fix:") and first.fits
    qtbot.mouseClick(w.advice.buttons[0], Qt.MouseButton.LeftButton)
    assert w.result.verdict.fits
    state = w.inputs.state()
    for key, value in first.changes.items():
        assert getattr(state, key) == str(value), key
    assert w.result.estimate.peak_bytes == first.peak_bytes
    w.undo()
    assert w.inputs.state().strategy == "ddp" and w.result.verdict.fits is False


def _mnemonic(text: str) -> str | None:
    import re

    m = re.search(r"&([^&\s])", text.replace("&&", ""))
    return m.group(1).lower() if m else None


def test_alt_keys_are_unique_and_menus_keep_theirs(window):
    """Alt+E and Alt+V open the Edit and View menus: no field, tab or button takes a menu's letter or another's."""
    from PySide6.QtWidgets import QAbstractButton, QLabel

    w = window
    menus = [_mnemonic(a.text()) for a in w.menuBar().actions()]
    assert {"f", "e", "v", "h"} <= set(menus)
    owners: dict[str, str] = {m: f"menu {m}" for m in menus if m}
    widgets = [x for x in w.findChildren(QLabel) + w.findChildren(QAbstractButton) if x.isVisibleTo(w)]
    texts = [x.text() for x in widgets] + [w.tabs.tabText(i) for i in range(w.tabs.count())]
    for text in texts:
        letter = _mnemonic(text)
        if letter is None:
            continue
        assert letter not in owners, f"{text!r} takes Alt+{letter.upper()} from {owners[letter]}"
        owners[letter] = text


def test_enter_on_a_unique_preset_part_accepts_it(window, qtbot):
    w = window
    edit = w.inputs.preset.lineEdit()
    edit.selectAll()
    qtbot.keyClicks(edit, "nemo")
    qtbot.keyClick(edit, Qt.Key.Key_Return)
    assert w.inputs.preset.currentText() == "mistral-nemo-12b"
    assert w.refresh() and w.result.setup.model.name == "mistral-nemo-12b"
    assert not w.inputs.preset.completer().popup().isVisible()


def test_tab_goes_from_precise_to_measure(window):
    w = window
    assert w.trace_panel.toggle.nextInFocusChain() is w.measure_panel.button or \
        w.trace_panel.toggle.nextInFocusChain().focusProxy() is w.measure_panel.button


LAYOUT_CHECK = """
import json, os, sys
os.environ["QT_QPA_PLATFORM"] = "offscreen"
from memcalc_gui.app import create_application
app = create_application([])
from memcalc_gui.ui.form import default_state
from memcalc_gui.ui.main_window import MainWindow
width, height, changes = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
w = MainWindow(initial_state=default_state().replace(**changes), persist=False)
w.resize(width, height); w.show()
for _ in range(10): app.processEvents()
t = w.table
rows_fit = t.viewport().height() >= sum(t.rowHeight(r) for r in range(t.rowCount()))
if w.advice_in_tabs:
    w.tabs.setCurrentWidget(w.advice_box)
    for _ in range(5): app.processEvents()
cards = len([b for b in w.advice.buttons if b.isVisible() and b.visibleRegion().boundingRect().height() > 0])
ticks = w.chart.plot.getAxis("bottom").height() <= w.chart.plot.getViewBox().sceneBoundingRect().top() + \
    w.chart.height() - w.chart.plot.getViewBox().sceneBoundingRect().bottom()
plan = w.advice.plan  # the GPU plan's sentences whole: as tall as its text at its width, its button below it
plan_whole = not plan.isVisible() or (plan.height() >= plan.heightForWidth(plan.width()) > 0
                                      and (not w.advice.use_plan.isVisible()
                                           or w.advice.use_plan.geometry().top() > plan.geometry().bottom()))
print("hbar", t.horizontalScrollBar().isVisible(), "rows_fit", rows_fit, "tabs", w.advice_in_tabs,
      "chart", w.chart.height() >= w.chart.minimumHeight() and ticks, "plan", plan_whole, "cards", cards)
"""
MULTI_GPU = {"preset": "llama-3.1-70b", "gpus": "8", "strategy": "fsdp-full-shard", "offload": "both"}
#: a GPU plan of five lines with a strategy to use (its button below it): its last line was cut off at 1280 × 720
PLAN = {"gpus": "8", "strategy": "zero2", "offload": "optimizer", "gpu": "a100-80gb"}


# the default suite: each size, each scale and each form once (tests/tiers.py)
@pytest.mark.parametrize(("scale", "width", "height", "changes"), sample([
    ("1", 1280, 720, {}), ("1.5", 1280, 720, {}), ("1", 1280, 720, MULTI_GPU), ("1.5", 1280, 720, MULTI_GPU),
    ("1", 1366, 768, {}), ("1", 1366, 768, MULTI_GPU), ("1", 1024, 700, {}), ("1", 1024, 700, MULTI_GPU),
    ("1", 1203, 662, {}), ("1", 1203, 662, MULTI_GPU),  # the window's default size on a 1280×720 screen
    ("1", 1280, 720, PLAN), ("1.5", 1280, 720, PLAN),
], (0, 3, 4, 7, 8, 11)),
    ids=lambda v: str(v) if not isinstance(v, dict) else ("plan" if v is PLAN else "multi" if v else "default"))
def test_ledger_is_whole_and_advice_reachable_on_laptop_screens(scale, width, height, changes, tmp_path):
    """The ledger shows its four phase columns and ten rows without scrolling at 1280×720 (also at 150 % scaling,
    a 1080p screen), 1366×768 and 1024×700, for one GPU and for a distributed setup (whose banner folds its
    reasons away); the GPU plan's sentences are whole (they scroll with the cards); at least one suggestion card is
    on screen — beside the ledger, or in its own tab when the window is narrow."""
    import subprocess
    import sys

    env = dict(os.environ, QT_SCALE_FACTOR=scale, MEMCALC_SETTINGS_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", LAYOUT_CHECK, str(width), str(height), json.dumps(changes)],
                          capture_output=True, text=True, env=env, timeout=120, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    narrow = width < 1240
    assert line.startswith(f"hbar False rows_fit True tabs {narrow} chart True plan True cards "), line
    assert int(line.split()[-1]) >= 1


def test_use_cache_is_a_choice_that_moves_the_estimate_and_is_stated(window, qtbot):
    """A loop that leaves the config's use_cache=True holds DynamicCache copies: the window lets the user say so,
    the estimate follows, the assumptions say which was assumed, and undo reverts it."""
    w = window
    w.apply_state(w.inputs.state().replace(preset="gpt2", precision="fp32"))
    assert w.refresh() and not w.result.setup.use_cache
    before = w.result.estimate.phases["forward"].tensor_bytes
    assert "use_cache=False" in w.assumptions.toPlainText()
    w.inputs.use_cache.click()
    qtbot.waitUntil(lambda: w.result.setup.use_cache, timeout=2000)
    assert w.result.estimate.phases["forward"].tensor_bytes > before  # GPT-2's fused qkv: + k and v copies
    assert "use_cache=True" in w.assumptions.toPlainText()
    assert w.inputs.state().use_cache == "true"
    w.undo()
    assert not w.inputs.use_cache.isChecked() and w.refresh() and not w.result.setup.use_cache


def test_no_internal_source_labels_in_what_users_read(window):
    """Words users read name public sources, never "seed 00x" (tooltips, labels, menus, assumptions)."""
    from PySide6.QtWidgets import QAbstractButton, QLabel, QWidget

    w = window
    texts = [w.assumptions.toPlainText()]
    for widget in w.findChildren(QWidget):
        texts.append(widget.toolTip())
        if isinstance(widget, (QLabel, QAbstractButton)):
            texts.append(widget.text())
    for action in w.findChildren(type(w.undo_action)):
        texts += [action.text(), action.toolTip()]
    bad = [t for t in texts if "seed 0" in t.lower() or "seed0" in t.lower()]
    assert not bad, bad[:3]


def test_one_unit_on_one_screen_even_for_absurd_sizes(window):
    """A peak of hundreds of EiB: the ledger, its tab, the chart's axis and totals and the headline all read in
    EiB — no "243681.76 GiB" beside "237.97 TiB", no 17-digit raw numbers."""
    import re

    w = window
    w.apply_state(w.inputs.state().replace(preset="llama-3.1-70b", batch="1000000", seq="16M"))
    assert w.refresh()
    unit = w.table.unit
    assert unit == "EiB" and w.chart.unit == unit and w.tabs.tabText(0) == f"&Ledger ({unit})"
    assert w.chart.axis_label() == f"Memory ({unit})"
    cells = [w.table.item(r, c).text() for r in range(w.table.rowCount()) for c in range(w.table.columnCount())]
    assert all(len(t) <= 8 for t in cells), cells  # "1023.99" at most
    assert f" {unit} " in w.banner.text.text()
    assert all(re.fullmatch(r"[\d.]+( EiB)?", label.toPlainText()) and len(label.toPlainText()) <= 12
               for label in w.chart.total_labels)
    w.timeline_button.click()  # past what a timeline holds: said, not drawn
    assert w.timeline_panel.timeline is None and "No timeline" in w.timeline_panel.source.text()
    # back to a normal model: GiB again everywhere
    w.apply_state(w.inputs.state().replace(preset="gpt2", batch="4", seq="1024"))
    assert w.refresh() and w.table.unit == w.chart.unit == "GiB" and w.tabs.tabText(0) == "&Ledger (GiB)"
    assert w.timeline_panel.timeline is not None and w.timeline_panel.chart.timeline is w.timeline_panel.timeline


def test_source_switch_keeps_each_model_row_level_with_its_label(window):
    """Switching Source to config.json and back used to leave the Preset field centred in a two-row-tall stack,
    below its label. Every page now takes only its own height, and its field is level with the label. The Hub page
    with its error line ("give a Hub id") was 106 px tall for a 92 px page: a QStackedWidget takes the tallest
    height-for-width of all its pages, hidden ones too. The check waits for the refresh that shows the error lines;
    it used to pass on the layout before them, and failed every time on a loaded machine."""
    from PySide6.QtCore import QPoint

    w = window
    inputs = w.inputs

    def centre_y(widget) -> int:
        return widget.mapTo(inputs, QPoint(0, widget.height() // 2)).y()

    fields = {"preset": inputs.preset, "config": inputs.config_path, "hub": inputs.hub_id, "params": inputs.params}
    for kind in ("config", "preset", "params", "hub", "preset", "config"):
        inputs.model_kind.setCurrentIndex(inputs.model_kind.findData(kind))
        field = fields[kind]
        w.refresh()  # the estimate of this source, and its fields' error lines, now
        settled = time.monotonic() + 10  # the layout settles over a few posted LayoutRequest events
        while time.monotonic() < settled:
            QApplication.processEvents()
            if inputs.model_stack.height() <= inputs.model_stack.currentWidget().sizeHint().height() + 2 and \
                    abs(centre_y(field) - centre_y(inputs.model_label)) <= 3:
                break
            time.sleep(0.005)
        index = inputs.model_stack.currentIndex()
        assert field.isVisible() and inputs.model_label.buddy() is field, kind
        assert abs(centre_y(field) - centre_y(inputs.model_label)) <= 3, index
        page = inputs.model_stack.currentWidget()
        assert inputs.model_stack.height() <= page.sizeHint().height() + 2, index
    assert inputs.open_button.isVisible()  # the config page's button row is there when it is the page


def test_status_bar_forgets_the_check_message_once_the_input_is_valid_again(window):
    w = window
    w.apply_state(w.inputs.state().replace(batch="zero"))
    assert not w.refresh()
    assert w.statusBar().currentMessage().startswith("Check micro-batch")
    w.apply_state(w.inputs.state().replace(batch="2"))
    assert w.refresh()
    assert w.statusBar().currentMessage() == ""
    w.statusBar().showMessage("Report saved")  # other messages stay
    assert w.refresh() and w.statusBar().currentMessage() == "Report saved"


def test_preset_list_shows_each_size_and_family(window):
    """The preset drop-down and the completion popup draw "1.544B · qwen2" beside each name."""
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtWidgets import QStyleOptionViewItem

    w = window
    details = w.inputs.preset_delegate.details
    assert set(details) == set(w.cache.names())
    assert details["qwen2.5-1.5b"] == "1.544B · qwen2" and details["gpt2"] == "124.4M · gpt2"
    assert w.inputs.preset.itemDelegate() is w.inputs.preset_delegate
    assert w.inputs.preset.completer().popup().itemDelegate() is w.inputs.preset_delegate
    # the delegate really paints the detail: a row with it has more ink than the name alone
    view = w.inputs.preset.view()
    index = view.model().index(w.inputs.preset.findText("qwen2.5-1.5b"), 0)
    option = QStyleOptionViewItem()
    option.initFrom(view)
    option.rect = view.visualRect(index).adjusted(0, 0, 0, 0)
    option.rect.setSize(option.rect.size().expandedTo(w.inputs.preset_delegate.sizeHint(option, index)))

    def ink(with_detail: bool) -> int:
        image = QImage(option.rect.size(), QImage.Format.Format_ARGB32)
        image.fill(0)
        painter = QPainter(image)
        option.rect.moveTo(0, 0)
        saved = dict(details)
        if not with_detail:
            details.clear()
        w.inputs.preset_delegate.paint(painter, option, index)
        details.update(saved)
        painter.end()
        return sum(1 for x in range(image.width()) for y in range(image.height()) if image.pixel(x, y) >> 24)

    assert ink(True) > ink(False) + 20


def test_narrow_window_moves_what_to_change_into_a_tab_and_back(window, qtbot):
    w = window
    w.resize(1000, 700)
    qtbot.waitUntil(lambda: w.advice_in_tabs, timeout=2000)
    assert w.tabs.indexOf(w.advice_box) == 1 and w.tabs.tabText(1) == "What to change"
    w._focus_advice()  # Ctrl+3 reaches the suggestions in their tab
    assert w.tabs.currentWidget() is w.advice_box
    w.resize(1300, 860)
    qtbot.waitUntil(lambda: not w.advice_in_tabs, timeout=2000)
    assert w.tabs.indexOf(w.advice_box) == -1 and w.bottom_split.indexOf(w.advice_box) == 1
    assert w.tabs.currentWidget() is w.table and w.advice_box.isVisible()


def test_a_trace_and_a_measurement_in_progress_get_their_own_lines(window):
    """Each job's progress (text, bar, labelled Cancel) is a line under the action row: two running jobs neither
    squeeze the method text into a column nor widen the window past a 1024 px screen."""
    w = window
    w.resize(1024, 700)
    long_texts = ("tracing qwen2.5-1.5b: iteration 1 of 2, backward (layer 12 of 28)",
                  "waiting for the trace to finish (one PyTorch job at a time)")
    for panel, text in zip((w.trace_panel, w.measure_panel), long_texts, strict=True):
        panel.progress_label.setText(text)
        for widget in (panel.progress_label, panel.progress_bar, panel.cancel_button):
            widget.setVisible(True)
    for _ in range(5):
        QApplication.processEvents()
    assert w.minimumSizeHint().width() <= 1024 and w.width() <= 1024
    assert w.method_label.width() >= 250
    for panel in (w.trace_panel, w.measure_panel):
        assert panel.progress_label.width() >= 250
        assert panel.cancel_button.text().startswith("Cancel ")
    assert w.trace_panel.progress_label.y() != w.measure_panel.progress_label.y()


def test_fine_tuning_group_drives_the_estimate(window, qtbot):
    """Weights trained: LoRA/QLoRA/frozen change what trains; only the fields the method reads are enabled; a
    bad rank is marked on its field while the last result stays; undo walks back."""
    w = window
    inputs = w.inputs
    w.apply_state(inputs.state().replace(preset="llama-3.1-8b", checkpointing="full", batch="4", seq="2048",
                                         grad_accum="1"))
    assert w.refresh()
    full_peak = w.result.estimate.peak_bytes
    assert not inputs.lora_rank.isEnabled() and not inputs.trainable.isEnabled()
    inputs.tuning.setCurrentIndex(inputs.tuning.findData("qlora"))
    qtbot.waitUntil(lambda: w.result.setup.tuning.method == "qlora", timeout=2000)
    assert inputs.lora_rank.isEnabled() and inputs.quant.isEnabled() and not inputs.trainable.isEnabled()
    assert w.result.estimate.peak_bytes < full_peak / 3
    assert "41,943,040 trainable parameters" in inputs.trainable_info.text()
    qlora = w.result
    inputs.lora_rank.setText("0")
    assert not w.refresh()
    assert "lora_rank" in inputs.errors() and w.result is qlora
    inputs.lora_rank.setText("64")
    assert w.refresh() and w.result.setup.tuning.rank == 64
    assert w.result.estimate.peak_bytes > qlora.estimate.peak_bytes  # more rank, more memory
    inputs.tuning.setCurrentIndex(inputs.tuning.findData("frozen"))
    qtbot.waitUntil(lambda: w.result.setup.tuning.method == "frozen", timeout=2000)
    assert inputs.trainable.isEnabled() and not inputs.lora_rank.isEnabled()
    assert w.result.setup.tuning.trainable == ("last:4",)
    w.undo()
    assert w.inputs.state().tuning == "qlora"


def test_suggesting_lora_applies_it_to_the_form(window):
    """A full fine-tuning run that does not fit gets LoRA/QLoRA among its fixes; applying one sets the form."""
    w = window
    w.apply_state(w.inputs.state().replace(preset="llama-3.1-8b", gpu="rtx-4090", capacity="23.64 GiB",
                                           checkpointing="full", batch="1", seq="512", grad_accum="1"))
    assert w.refresh()
    titles = [s.title for s in w.advice.suggestions()]
    index = next(i for i, s in enumerate(w.advice.suggestions()) if s.changes.get("tuning") in ("lora", "qlora"))
    w.advice.apply(index)
    assert w.refresh() and w.result.setup.tuning.method in ("lora", "qlora"), titles
    assert w.inputs.state().lora_rank == "16"


def test_preset_list_groups_families_smallest_first(window):
    """Separators split the preset list by family; within one, sizes ascend; every preset is listed once."""
    combo = window.inputs.preset
    groups: list[list[str]] = [[]]
    for i in range(combo.count()):
        text = combo.itemText(i)
        if not text:  # a separator
            groups.append([])
        else:
            groups[-1].append(text)
    cache = window.cache
    assert sorted(n for g in groups for n in g) == sorted(cache.names())
    assert len(groups) == len({cache.info(n).family for n in cache.names()})
    for group in groups:
        assert len({cache.info(n).family for n in group}) == 1
        sizes = [cache.info(n).num_params for n in group]
        assert sizes == sorted(sizes)


@pytest.mark.full_suite
def test_a_family_without_a_block_model_is_fitted_in_the_window(window, qtbot, tmp_path):
    """An OPT config: the window calibrates the fitted method in a worker (the last result stays meanwhile), then
    estimates it exactly; a new micro-batch needs no new calibration."""
    pytest.importorskip("transformers")
    from memcalc_gui.trace.meta import count_params_on_meta

    w = window
    cfg = {"model_type": "opt", "hidden_size": 64, "ffn_dim": 128, "num_attention_heads": 4, "num_hidden_layers": 3,
           "vocab_size": 512, "max_position_embeddings": 512, "word_embed_proj_dim": 64, "pad_token_id": 1}
    path = write_config(tmp_path / "opt", "config.json", cfg)
    before = w.result
    assert not w.open_config(path)
    assert w.result is before and "Fitting model_type 'opt'" in w.banner.full_text()
    qtbot.waitUntil(lambda: w.result is not before and w.result.estimate.method == "fitted", timeout=60000)
    assert w.result.setup.num_params == count_params_on_meta(cfg)
    assert "opt" in w.inputs.model_info.text() and "fitted" in w.inputs.model_info.text()
    peak = w.result.estimate.peak_bytes
    w.apply_state(w.inputs.state().replace(batch="8"))
    assert w.refresh() and not w.fit_runner.is_running()  # the same fit: no new traces
    assert w.result.estimate.method == "fitted" and w.result.estimate.peak_bytes > peak
    from memcalc_gui.ui.trace_panel import skip_reason

    assert skip_reason(w.result.setup) == ""  # traced from its config (tests/test_ui_trace.py), not "a bare count"
    # per GPU: the same fit, its model states replaced by the strategy's (at once; the worker may go on to
    # calibrate the bf16 step FSDP2 and Megatron-LM run, for the GPU plan)
    single = w.result.estimate
    w.apply_state(w.inputs.state().replace(gpus="4", strategy="zero3"))
    assert w.refresh()
    qtbot.waitUntil(lambda: not w.fit_runner.is_running(), timeout=60000)
    est = w.result.estimate
    assert est.method == "fitted" and est.setup.parallel.gpus == 4 and est.details["parallel_notes"]
    assert est.phases["optimizer_step"].objects["optimizer_state"] < single.phases["optimizer_step"].objects[
        "optimizer_state"] / 3
    # over capacity: the checkpointing what-if is calibrated quietly in the worker, then suggested
    w.apply_state(w.inputs.state().replace(gpus="1", strategy="ddp", gpu="",
                                           capacity=f"{single.peak_bytes * 0.8 / 2**20:.2f} MiB"))
    assert w.refresh() and w.result.verdict.fits is False

    def suggested() -> bool:
        return any(s.changes.get("checkpointing") == "full" for s in w.result.verdict.suggestions)

    qtbot.waitUntil(suggested, timeout=60000)


TINY_MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 512,
                "num_local_experts": 4, "num_experts_per_tok": 2}


def open_mixtral(w: MainWindow, qtbot, tmp_path: Path, layers: int) -> None:
    """Open a small Mixtral-shaped config.json and wait for its fitted (single-GPU) result."""
    pytest.importorskip("transformers")
    cfg = dict(TINY_MIXTRAL, num_hidden_layers=layers)
    path = write_config(tmp_path / "mixtral", "config.json", cfg)
    before = w.result
    assert not w.open_config(path)
    qtbot.waitUntil(lambda: w.result is not before and w.result.estimate.method == "fitted", timeout=60000)


@pytest.mark.full_suite
def test_a_layout_whose_experts_fsdp2_cannot_place_marks_the_gpu_count_not_the_model(window, qtbot, tmp_path):
    """FSDP2 over 6 GPUs of a config with 4 experts: torchtitan would shard them along their second dimension, which
    PyTorch splits only evenly (64 rows over 6 do not). The calibration refuses before tracing, and the window marks
    the number of GPUs with the reason and keeps the last result, where before it marked the model as one the fitted
    method does not hold for."""
    w = window
    open_mixtral(w, qtbot, tmp_path, layers=2)
    good = w.result
    w.apply_state(w.inputs.state().replace(gpus="6", strategy="fsdp2"))
    w.refresh()
    qtbot.waitUntil(lambda: bool(w.inputs.gpus.property("invalid")), timeout=60000)
    errors = w.inputs.errors()
    assert set(errors) == {"gpus"} and "64 does not divide by 6" in errors["gpus"]
    assert w.result.setup == good.setup  # the last valid setup stays drawn
    assert "number of GPUs: FSDP2 shards the routed experts" in w.banner.stale_note.text()
    assert not w.fit_runner.is_running()


@pytest.mark.full_suite
def test_a_mixture_of_experts_across_gpus_in_the_window(window, qtbot, tmp_path):
    """A Mixtral-shaped config with its experts split over 4 GPUs under FSDP2: the window calibrates the bf16 step
    and one rank of the FSDP2 layout in its worker, and the ledger is that rank's, below one GPU's. More GPUs then
    (the same signature) are answered at once by the rule from the one-replica fit in memory, while the worker traces
    that layout's rank. (Tensor parallelism of such a family: tests/test_expert.py, through the CLI.)"""
    w = window
    open_mixtral(w, qtbot, tmp_path, layers=3)
    single = w.result.estimate
    w.apply_state(w.inputs.state().replace(gpus="4", ep="4", strategy="fsdp2"))
    w.refresh()
    qtbot.waitUntil(lambda: w.result.setup.parallel.ep == 4 and w.result.estimate.method == "fitted",
                    timeout=60000)
    est = w.result.estimate
    assert est.setup.parallel.strategy == "fsdp2"
    assert est.peak_tensor_bytes < single.peak_tensor_bytes
    assert not any("upper bound" in n for n in est.details["parallel_notes"])  # its own bf16 calibration
    assert est.details.get("rank_fit")  # the FSDP2 rank as traced: its fit came with the calibration
    assert any("routed experts split over 4" in n for n in est.details["parallel_notes"])
    # the layout search over the fits at hand, at once: the 4 GPUs split by data and expert parallelism (tensor
    # parallelism left out until `memcalc layouts` calibrates it), this layout's peak the ledger's
    dialog = w.show_layouts()
    assert dialog is not None and not w.fit_runner.is_running()
    layouts = dialog.layouts
    assert {lay.parallel.ep for lay in layouts} == {1, 2, 4} and all(lay.parallel.tp == 1 for lay in layouts)
    intro = dialog.intro.text()
    assert "Not calibrated yet, so left out" in intro and "with tensor parallelism over 2 GPUs." in intro
    assert "4 tensor-parallel ranks cannot split" in intro  # 2 key/value heads: never, whatever is calibrated
    # (under every strategy: the bf16 ones too, whose stand-in is the autocast step; and Megatron-LM's split of each
    # expert waits with its tensor-parallel degree, weighed at once without one, never refused as not Megatron-LM's)
    assert "Megatron-LM's (--expert-tensor-parallel-size)" not in intro
    kv = next(pars for reason, pars in dialog.layouts.left_out.items() if "key/value heads" in reason)
    assert {par.strategy for par in kv} >= {"ddp", "zero1", "zero3", "megatron-distopt"}
    assert any(lay.parallel.etp > 1 for lay in layouts)
    same = next(lay for lay in layouts if lay.parallel == est.setup.parallel)
    assert same.peak_bytes == est.peak_bytes
    row = next(i for i, lay in enumerate(layouts) if lay.parallel.strategy == "ddp" and lay.parallel.ep == 2)
    dialog.table.selectRow(row)
    dialog.use_button.click()
    qtbot.waitUntil(lambda: w.result.setup.parallel.ep == 2, timeout=5000)
    assert w.result.setup.parallel.strategy == "ddp" and w.result.estimate.peak_bytes == layouts[row].peak_bytes
    w.undo()
    assert w.result.setup.parallel == est.setup.parallel
    w.apply_state(w.inputs.state().replace(gpus="8"))
    assert w.refresh()  # at once, by rule: the one-replica fit of the same signature is in memory
    ruled = w.result.estimate
    assert ruled.setup.parallel.gpus == 8 and not ruled.details.get("rank_fit")
    assert any("Expert parallelism over 4" in n for n in ruled.details["parallel_notes"])
    assert w.fit_runner.is_running()  # that layout's rank, in the worker (closing the window stops it)


@pytest.mark.full_suite
def test_megatron_expert_tensor_parallelism_in_the_window(window, qtbot, tmp_path):
    """Each expert split over 2 GPUs besides expert parallelism (Megatron-LM's --expert-tensor-parallel-size): the
    field is live under Megatron-LM's strategies only and keeps its text under the others; the ledger is the core's
    for the same setup, below the one without it, and the banner, the plan's assumptions and the report say the
    split; an etp that does not divide the GPUs is marked and the last result kept."""
    from memcalc_gui.report.content import _setup_rows

    w = window
    open_mixtral(w, qtbot, tmp_path, layers=2)
    w.apply_state(w.inputs.state().replace(gpus="8", ep="2", strategy="megatron-distopt"))
    w.refresh()
    qtbot.waitUntil(lambda: w.result.setup.parallel.strategy == "megatron-distopt"
                    and w.result.estimate.method == "fitted", timeout=60000)
    whole = w.result
    assert w.inputs.etp.isEnabled() and w.inputs.labels["etp"].isEnabled()
    w.inputs.etp.setText("2")
    qtbot.waitUntil(lambda: w.result.setup.parallel.etp == 2, timeout=5000)
    split = w.result
    assert split.estimate.phases["load"].objects["parameters"] < whole.estimate.phases["load"].objects["parameters"]
    assert any("ep × etp = 2 × 2" in n for n in split.estimate.assumptions)
    assert "each expert over 2 (expert tensor parallel)" in w.banner.detail.text()
    rows = dict(_setup_rows(split))
    assert rows["Routed experts"] == ("split over 2 GPUs (expert parallel), each expert's weights over 2 GPUs "
                                      "(Megatron-LM's expert tensor parallel)")
    w.inputs.etp.setText("8")  # 2 × 8 does not divide 8 GPUs
    assert w.refresh() is False
    assert set(w.inputs.errors()) == {"etp"} and "must divide" in w.inputs.errors()["etp"]
    assert w.result is split and w.inputs.etp.property("invalid") is True
    w.undo()
    assert w.result.setup.parallel.etp == 2
    # another strategy: the field is off and ignored, its text kept for when Megatron-LM's comes back
    w.inputs.strategy.setCurrentIndex(w.inputs.strategy.findData("zero1"))
    qtbot.waitUntil(lambda: w.result.setup.parallel.strategy == "zero1", timeout=60000)
    assert not w.inputs.etp.isEnabled() and w.result.setup.parallel.etp == 1 and w.inputs.state().etp == "2"


@pytest.mark.full_suite
def test_the_layout_search_calibrates_the_tensor_parallel_layouts_it_left_out(window, qtbot, tmp_path):
    """Find layouts for a family without a block model: the fits at hand answer at once, the tensor-parallel
    degree without a fit is left out and offered for calibration; the worker calibrates it and the search opens
    again with its layouts, one of which, applied, is the window's ledger. Pipeline layouts wait, listed last, until
    calibrated, not queued (each is a calibration of its own schedule): one used sets the form, whose fit then joins
    the search with the window's peak."""
    w = window
    w.apply_state(w.inputs.state().replace(precision="fp32", gpus="2"))
    open_mixtral(w, qtbot, tmp_path, layers=2)
    first = w.show_layouts()
    assert first is not None and {lay.parallel.ep for lay in first.layouts} == {1, 2}
    assert all(lay.parallel.tp == 1 for lay in first.layouts) and first.calibrate_button is not None
    split = [lay.parallel for lay in first.layouts if lay.parallel.etp > 1]  # each expert over both GPUs
    assert {(par.strategy, par.ep, par.etp) for par in split} == {("megatron", 1, 2), ("megatron-distopt", 1, 2)}
    assert first.calibrate_button.text() == "Calibrate tensor parallelism over 2 GPUs"
    # 2 stages of one GPU: DDP and Megatron-LM's two optimizers (FSDP2 would shard over one GPU)
    # and tensor parallelism over both GPUs with torchtitan's sequence-parallel plan, the experts whole or over both
    # GPUs (each its own rank's calibration)
    staged = "5 layouts of 2 pipeline stages or with sequence parallelism are not calibrated yet"
    assert staged in first.intro.text()
    first.calibrate_button.click()
    # tensor parallelism over 2, and beside the experts split over both GPUs (the experts whole); no stage queued
    assert not first.isVisible() and w.fit_runner.is_running() and w._layout_fits_total == 2
    qtbot.waitUntil(lambda: w.layouts_dialog is not first and w.layouts_dialog is not None, timeout=60000)
    again = w.layouts_dialog
    assert again.calibrate_button is None and "so left out" not in again.intro.text()
    assert staged in again.intro.text() and all(lay.parallel.pp == 1 for lay in again.layouts)
    assert [(par.pp, par.sp, par.ep) for par in again.waiting] == [(1, True, 1), (1, True, 2)] + [(2, False, 1)] * 3
    assert {lay.parallel.ep for lay in again.layouts if lay.parallel.tp == 2} == {1, 2}
    row = next(i for i, lay in enumerate(again.layouts)
               if lay.parallel.tp == 2 and lay.parallel.ep == 1 and lay.parallel.strategy == "ddp")
    again.table.selectRow(row)
    again.use_button.click()
    qtbot.waitUntil(lambda: w.result.setup.parallel.tp == 2, timeout=5000)
    assert w.result.estimate.method == "fitted" and w.result.estimate.peak_bytes == again.layouts[row].peak_bytes
    chosen = w.result.setup
    # the sequence-parallel layout waiting, used, sets the form, which calibrates its rank; the search then weighs it
    # with the window's peak, under its twin without
    waiting = w.show_layouts()
    assert waiting is not None
    labels = [waiting.table.item(r, 0).text() for r in range(waiting.table.rowCount())]
    waiting.table.selectRow(labels.index("TP 2 + SP × DDP over 1"))
    waiting.use_button.click()
    qtbot.waitUntil(lambda: bool(w.result.setup.parallel.sp and w.result.estimate.details.get("rank_fit")),
                    timeout=90000)  # (a callback returning None would pass at once: pytest-qt reads it as no error)
    weighed = w.show_layouts()
    assert weighed is not None and [par.ep for par in weighed.waiting if par.sp] == [2]
    sp_row = next(lay for lay in weighed.layouts if lay.parallel.sp)
    twin = next(lay for lay in weighed.layouts if lay.parallel == dataclasses.replace(sp_row.parallel, sp=False))
    assert sp_row.peak_bytes == w.result.estimate.peak_bytes < twin.peak_bytes
    weighed.close()
    w.undo()
    assert w.result.setup == chosen
    # layouts whose calibration failed (here tensor parallelism over 2 without expert parallelism: the key its
    # layouts share) are left out with the reason
    w.fits[w._fit_key(chosen.extras["fit"], chosen)] = "the fitted method does not hold: no trace"
    w.undo()
    assert w.result.setup.parallel.tp == 1
    failed = w.show_layouts()
    def tp_alone(lay: Layout) -> bool:
        return lay.parallel.tp == 2 and lay.parallel.ep == 1

    assert failed is not None and not any(tp_alone(lay) for lay in failed.layouts)
    assert [lay.parallel for lay in failed.layouts] == [lay.parallel for lay in again.layouts if not tp_alone(lay)]
    tp2 = sum(tp_alone(lay) for lay in again.layouts)
    # (and the sequence-parallel layout beside them, the experts whole, whose one-replica fit is that key's)
    assert tp2 > 1 and f"Left out ({tp2 + 1}): the fitted method does not hold: no trace." in failed.intro.text()
    # the pipeline layouts are listed last, not calibrated; using one sets it in the form, which fits it
    assert [failed.table.item(r, 1).text() for r in range(failed.table.rowCount())][-3:] == ["not calibrated"] * 3
    labels = [failed.table.item(r, 0).text() for r in range(failed.table.rowCount())]
    row = labels.index("PP 2 (1F1B) × DDP over 1")
    failed.table.selectRow(row)
    failed.use_button.click()
    qtbot.waitUntil(lambda: w.result.setup.parallel.pp == 2 and w.result.estimate.method == "fitted", timeout=60000)
    assert w.result.setup.parallel.strategy == "ddp"
    joined = w.show_layouts()
    # (and the sequence-parallel one with the experts over both GPUs, whose one-replica fit has not failed)
    assert joined is not None and "3 layouts of 2 pipeline stages or with sequence parallelism" in joined.intro.text()
    staged_row = next(lay for lay in joined.layouts if lay.parallel.pp == 2)
    assert staged_row.parallel.strategy == "ddp" and staged_row.peak_bytes == w.result.estimate.peak_bytes
    # a layout with each expert split over both GPUs, used, sets the form's field and is the window's ledger
    row = next(i for i, lay in enumerate(joined.layouts)
               if lay.parallel.etp == 2 and lay.parallel.strategy == "megatron-distopt")
    joined.table.selectRow(row)
    joined.use_button.click()
    qtbot.waitUntil(lambda: w.result.setup.parallel.etp == 2 and w.result.setup.parallel.pp == 1, timeout=60000)
    assert w.inputs.etp.text() == "2" and w.inputs.etp.isEnabled()
    assert w.result.estimate.method == "fitted" and w.result.estimate.peak_bytes == joined.layouts[row].peak_bytes


@pytest.mark.full_suite
def test_opening_another_model_drops_the_layout_searchs_queued_calibrations(window, qtbot, tmp_path):
    """The layout search's calibrations run one after another in the worker; opening another model meanwhile drops
    those still queued (they were for the model before, and held the new model's own calibration back), and the
    search does not reopen for the old model."""
    w = window
    w.apply_state(w.inputs.state().replace(precision="fp32", gpus="2"))
    open_mixtral(w, qtbot, tmp_path, layers=2)
    setup = w.result.setup
    needed = setup.extras["fit"]
    first = setup.with_changes(checkpointing="full")
    second = setup.with_changes(parallel=dataclasses.replace(setup.parallel, tp=2))
    w._layout_fits = [(needed, first), (needed, second)]
    w._layout_fits_total = 2
    w._next_layout_fit()
    assert w.fit_runner.is_running() and len(w._layout_fits) == 1
    other = dict(TINY_MIXTRAL, hidden_size=32, num_hidden_layers=3)
    before = w.result
    assert not w.open_config(write_config(tmp_path / "other", "config.json", other))
    qtbot.waitUntil(lambda: w.result is not before and w.result.estimate.method == "fitted"
                    and w.result.setup.extras["fit"].config["hidden_size"] == 32, timeout=120000)
    qtbot.waitUntil(lambda: not w.fit_runner.is_running(), timeout=60000)
    assert w._layout_fits == [] and w._layout_fits_total == 0
    assert w._fit_key(needed, second, ranks=False) not in w.fits  # never traced
    assert w.layouts_dialog is None


@pytest.mark.full_suite
def test_pipeline_stages_of_a_mixture_of_experts_in_the_window(window, qtbot, tmp_path):
    """A Mixtral-shaped config in 2 pipeline stages of 2 GPUs (DDP in each): the worker calibrates each checked
    rank's schedule, the ledger is the most loaded rank's and the plan names every stage; expert parallelism beside
    it over more GPUs than a stage has marks the field and keeps that result."""
    w = window
    open_mixtral(w, qtbot, tmp_path, layers=4)
    w.apply_state(w.inputs.state().replace(gpus="4", pp="2", grad_accum="4", strategy="ddp"))
    w.refresh()
    # the wait it announces is a pipeline calibration's, not a one-replica fit's few seconds
    assert "tens of seconds to minutes, each checked pipeline rank's schedule" in w.statusBar().currentMessage()
    qtbot.waitUntil(lambda: w.result.setup.parallel.pp == 2 and w.result.estimate.method == "fitted",
                    timeout=120000)
    est = w.result.estimate
    rows = est.details["pipeline_ranks"]
    assert [r["rank"] for r in rows] == [0, 1]
    assert est.peak_bytes == max(r["peak_bytes"] for r in rows)
    from memcalc_gui.view.plan_text import plan_sentences

    # the strategies a pipeline fit would cover are not weighed yet, those it does not model (ZeRO and FSDP1 in
    # stages) say so; neither is "never"
    first = plan_sentences(w.result)[0]
    assert "FSDP2: not weighed yet; " in first and "ZeRO-3, FSDP full shard: not modelled for this layout)" in first
    assert "never" not in first
    shown = w.result
    # experts split over more GPUs than a stage has (2 of the 4 in each of 2 stages): ep marked, the result kept
    w.inputs.ep.setText("4")
    assert w.refresh() is False
    assert set(w.inputs.errors()) == {"ep"} and "must divide" in w.inputs.errors()["ep"]
    assert w.result is shown


def test_without_torch_a_new_family_preset_is_the_heuristic_with_its_reason(window, monkeypatch):
    """The lite build cannot trace: a Mixtral preset shows the heuristic from its stored count and says so."""
    import memcalc_gui.trace.fake as fake
    from memcalc_gui.core.model import preset_info

    monkeypatch.setattr(fake, "trace_available", lambda: False)
    w = window
    w.apply_state(w.inputs.state().replace(model_kind="preset", preset="mixtral-8x7b", gpus="1", strategy="ddp"))
    assert w.refresh()
    assert w.result.estimate.method == "quick"
    assert w.result.setup.num_params == preset_info("mixtral-8x7b").num_params
    assert "no PyTorch and transformers" in w.inputs.model_info.text() and "mixtral" in w.inputs.model_info.text()


def test_the_new_techniques_are_window_controls(window):
    """Checkpoint every N-th layer, the chunked loss and the step in backward: each a control, each in the setup
    the core estimates, a bad every-N value marked on its own field with the last result kept."""
    w = window
    w.apply_state(w.inputs.state().replace(model_kind="preset", preset="llama-3.2-1b", gpus="1", strategy="ddp",
                                           grad_accum="1"))
    assert w.refresh()
    w.inputs.checkpointing.setChecked(True)
    w.inputs.ckpt_every.setText("2")
    w.inputs.loss.setCurrentIndex(w.inputs.loss.findData("chunked"))
    w.inputs.optimizer_in_backward.setChecked(True)
    state = w.inputs.state()
    assert (state.checkpointing, state.loss, state.optimizer_in_backward) == ("every:2", "chunked", "true")
    assert w.refresh()
    s = w.result.setup
    assert (s.checkpointing, s.loss, s.optimizer_in_backward) == ("every:2", "chunked", True)
    good = w.result
    w.inputs.ckpt_every.setText("0")
    assert not w.refresh() and w.result is good
    assert "every:N" in w.inputs.errors()["ckpt_every"]
    w.apply_state(w.inputs.state())  # round trip through the saved form
    assert w.inputs.state().checkpointing == "every:0"


def test_activation_offload_is_a_window_control(window):
    """The offload choice reaches the setup, the result says the host memory, and checkpoint inputs without
    checkpointing marks the offload field and keeps the last result."""
    w = window
    w.apply_state(w.inputs.state().replace(model_kind="preset", preset="llama-3.2-1b", gpus="1", strategy="ddp",
                                           checkpointing="full", batch="4", seq="2048"))
    assert w.refresh()
    combo = w.inputs.activation_offload
    combo.setCurrentIndex(combo.findData("checkpoint-inputs"))
    assert w.refresh()
    assert w.result.setup.activation_offload == "checkpoint-inputs"
    assert w.result.estimate.details["host_bytes"] > 0
    assert "Host (CPU) memory for the offloaded activations" in w.banner.detail.text()  # one GPU: said too
    good = w.result
    w.inputs.checkpointing.setChecked(False)
    assert not w.refresh() and w.result is good
    assert "checkpointing" in w.inputs.errors()["activation_offload"]
    w.apply_state(w.inputs.state())  # round trip through the saved form
    assert w.inputs.state().activation_offload == "checkpoint-inputs"


def test_per_op_selective_checkpointing_is_a_window_control(window):
    """The per-op box makes checkpointing "selective", disables the every-N-th field, and lands between none and full;
    with eager attention its box is marked and the last result kept."""
    w = window
    w.apply_state(w.inputs.state().replace(model_kind="preset", preset="llama-3.2-1b", gpus="1", strategy="ddp",
                                           checkpointing="full", attention="sdpa", batch="4", seq="2048"))
    assert w.refresh()
    full = w.result.estimate.phases["forward"].tensor_bytes
    w.inputs.ckpt_selective.setChecked(True)
    assert not w.inputs.ckpt_every.isEnabled()
    assert w.inputs.state().checkpointing == "selective"
    assert w.refresh()
    assert w.result.setup.checkpointing == "selective"
    assert w.result.estimate.phases["forward"].tensor_bytes > full
    good = w.result
    w.inputs.attention.setCurrentIndex(w.inputs.attention.findData("eager"))
    assert not w.refresh() and w.result is good
    assert "SDPA" in w.inputs.errors()["ckpt_selective"]
    w.apply_state(w.inputs.state())
    assert w.inputs.ckpt_selective.isChecked()


def test_fsdp2_and_its_reshard_option_are_window_controls(window):
    """FSDP2 is a strategy; its reshard-after-forward box is live for it only, reaches the setup, and raises the
    per-GPU peak when cleared (every layer stays gathered from forward to backward)."""
    w = window
    w.apply_state(w.inputs.state().replace(model_kind="preset", preset="llama-3.2-1b", gpus="8", strategy="ddp"))
    assert w.refresh()
    assert not w.inputs.reshard_after_forward.isEnabled()
    w.inputs.strategy.setCurrentIndex(w.inputs.strategy.findData("fsdp2"))
    assert w.inputs.reshard_after_forward.isEnabled()
    assert w.refresh()
    on = w.result
    assert on.setup.parallel.strategy == "fsdp2" and on.setup.parallel.reshard_after_forward
    w.inputs.reshard_after_forward.setChecked(False)
    assert w.inputs.state().reshard_after_forward == "false"
    assert w.refresh()
    assert not w.result.setup.parallel.reshard_after_forward
    assert w.result.estimate.phases["forward"].total_bytes > on.estimate.phases["forward"].total_bytes
    w.apply_state(w.inputs.state())  # round trip through the saved form
    assert not w.inputs.reshard_after_forward.isChecked()


def test_packing_and_flash_attention_are_window_controls(window):
    """The packing box enables the real-tokens field and reaches the setup; fewer real tokens lower the peak;
    FlashAttention-2 is an attention choice; more tokens than the documents hold marks the field and keeps the last
    result; the form round-trips."""
    w = window
    w.apply_state(w.inputs.state().replace(model_kind="preset", preset="llama-3.2-1b", gpus="1", strategy="ddp",
                                           precision="mixed", checkpointing="full", batch="8", seq="4096"))
    assert w.refresh()
    padded = w.result
    assert not w.inputs.tokens_per_batch.isEnabled()
    w.inputs.packing.setChecked(True)
    assert w.inputs.tokens_per_batch.isEnabled()
    w.inputs.tokens_per_batch.setText("12k")
    w.inputs.attention.setCurrentIndex(w.inputs.attention.findData("flash"))
    assert w.refresh()
    packed = w.result
    assert packed.setup.packing and packed.setup.row_len == 12 * 1024 and packed.setup.attention == "flash"
    assert packed.estimate.phases["backward"].tensor_bytes < padded.estimate.phases["backward"].tensor_bytes
    w.inputs.tokens_per_batch.setText("40000")
    assert not w.refresh() and w.result is packed
    assert "32,768" in w.inputs.errors()["tokens_per_batch"]
    w.inputs.tokens_per_batch.setText("12288")
    assert w.refresh()
    w.apply_state(w.inputs.state())  # round trip through the saved form
    assert w.inputs.packing.isChecked() and w.inputs.tokens_per_batch.text() == "12288"
    assert w.inputs.state().attention == "flash"


def test_galore_and_its_rank_are_window_controls(window):
    """GaLore is an optimizer choice; its rank field is live for it only, reaches the setup and lowers the state;
    a bad rank marks the field and keeps the last result; GPT-2 marks the optimizer."""
    w = window
    w.apply_state(w.inputs.state().replace(model_kind="preset", preset="llama-3.2-1b", gpus="1", strategy="ddp",
                                           precision="bf16", optimizer="adamw"))
    assert w.refresh()
    adamw = w.result.estimate.phases["optimizer_step"].objects["optimizer_state"]
    assert not w.inputs.galore_rank.isEnabled()
    w.inputs.optimizer.setCurrentIndex(w.inputs.optimizer.findData("galore-adamw"))
    assert w.inputs.galore_rank.isEnabled()
    w.inputs.galore_rank.setText("64")
    assert w.refresh()
    good = w.result
    assert good.setup.optimizer == "galore-adamw" and good.setup.galore_rank == 64
    assert good.estimate.phases["optimizer_step"].objects["optimizer_state"] < adamw
    w.inputs.galore_rank.setText("0")
    assert not w.refresh() and w.result is good
    assert "galore_rank" in w.inputs.errors()
    w.inputs.galore_rank.setText("64")
    w.apply_state(w.inputs.state().replace(preset="gpt2"))
    assert not w.refresh()
    assert "Conv1D" in w.inputs.errors()["optimizer"]


@pytest.mark.full_suite
def test_timeline_shows_the_trace_and_opens_snapshots(window, tmp_path, qtbot):
    """The Timeline button swaps the phase bars for the timeline; a trace fills it (predicted, exportable for
    memory_viz); File → Open memory snapshot reads a snapshot beside the estimate; a file that is not one is
    reported and the last timeline stays."""
    pytest.importorskip("torch")
    import pickle

    from memcalc_gui.trace.fake import trace_estimate

    w = window
    w.apply_state(w.inputs.state().replace(model_kind="preset", preset="qwen2.5-0.5b", batch="1", seq="256",
                                           grad_accum="1", gpus="1", strategy="ddp", gpu="a100-80gb"))
    assert w.refresh()
    assert w.chart_stack.currentWidget() is w.chart
    w.timeline_button.click()
    assert w.chart_stack.currentWidget() is w.timeline_panel
    # before any trace: the coarse timeline of the ledger, said so, its phase peaks the ledger's, not exportable
    coarse = w.timeline_panel.timeline
    assert coarse is not None and coarse.source == "ledger" and "Coarse" in w.timeline_panel.source.text()
    assert coarse.phase_peaks() == {p: ph.tensor_bytes for p, ph in w.result.estimate.phases.items()}
    assert w.timeline_panel.chart.timeline is coarse  # drawn, the tab being on screen
    assert not w.export_snapshot_action.isEnabled() and not w.timeline_panel.export_button.isEnabled()
    traced = trace_estimate(w.result.setup)
    w.show_trace(traced.result(), traced)
    panel = w.timeline_panel
    assert panel.timeline is traced.timeline and "Predicted" in panel.source.text()
    assert w.export_snapshot_action.isEnabled()
    assert "Optimizer step" in panel.comparison.text()
    peak_index, peak = traced.timeline.peak()
    info = panel.chart.show_event_info(peak_index)
    assert "live" in info and "Optimizer" in info
    out = tmp_path / "predicted.pickle"
    assert panel.export_predicted(str(out)) == ""
    with qtbot.waitSignal(w.snapshot_opened, timeout=30_000) as opened:
        w.open_snapshot(out)
    assert opened.args == [True]
    assert "Snapshot" in panel.source.text() and panel.snapshot_path == str(out)
    assert panel.timeline.peak()[1] == peak
    kept = panel.timeline
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps({"no": "trace"}))
    with qtbot.waitSignal(w.snapshot_opened, timeout=30_000) as opened:
        w.open_snapshot(bad)
    assert opened.args == [False]
    assert "device_traces" in w.statusBar().currentMessage() and panel.timeline is kept
    # a new setup: the snapshot stays, compared with the new estimate
    assert set_fields(w, batch="2")
    assert panel.timeline is kept and str(format_bytes(w.result.estimate.phases["optimizer_step"].tensor_bytes)) \
        in panel.comparison.text()
    w.timeline_button.click()
    assert w.chart_stack.currentWidget() is w.chart


@pytest.mark.full_suite
def test_the_trace_timeline_gives_way_to_the_ledger_when_the_setup_changes(window):
    """A predicted timeline belongs to the setup it traced: the GPU may change under it, a new micro-batch brings
    back the coarse timeline of the new estimate (never a stale prediction), and drawing waits for the tab."""
    pytest.importorskip("torch")
    from memcalc_gui.trace.fake import trace_estimate

    w = window
    assert set_fields(w, model_kind="preset", preset="qwen2.5-0.5b", batch="1", seq="128", grad_accum="1", gpus="1",
                      strategy="ddp", gpu="a100-80gb")
    panel = w.timeline_panel
    traced = trace_estimate(w.result.setup)
    w.show_trace(traced.result(), traced)
    assert panel.timeline is traced.timeline and panel.chart.timeline is not traced.timeline  # tab not shown yet
    w.timeline_button.click()
    assert panel.chart.timeline is traced.timeline
    assert set_fields(w, gpu="rtx-4090")  # no tensor changes
    assert panel.timeline is traced.timeline and panel.export_button.isEnabled()
    assert set_fields(w, batch="2")
    assert panel.timeline.source == "ledger" and "Coarse" in panel.source.text()
    assert not panel.export_button.isEnabled() and not w.export_snapshot_action.isEnabled()
    assert panel.timeline.phase_peaks()["backward"] == w.result.estimate.phases["backward"].tensor_bytes


def test_a_measured_timeline_overlays_the_prediction_phase_by_phase(window):
    """The measured step's total is drawn over the predicted stack, each phase window stretched onto the
    prediction's; a measurement of another (scaled-down) setup is shown on its own."""
    pytest.importorskip("torch")
    from bench.techniques import FAMILIES
    from memcalc_gui.core.estimate import estimate
    from memcalc_gui.core.model import spec_from_config
    from memcalc_gui.core.setup import TrainingSetup
    from memcalc_gui.measure import exclusive_torch_job
    from memcalc_gui.measure.cpu_step import measure_training_step, timeline_from_tracker

    kw = dict(batch=2, seq=64, precision="mixed", keep_tracker=True)
    with exclusive_torch_job():  # torch's dispatch-mode stack is global: never beside the window's own workers
        measured = timeline_from_tracker(measure_training_step(FAMILIES["llama"], **kw).tracker, "measured")
        predicted = timeline_from_tracker(measure_training_step(FAMILIES["llama"], fake=True, **kw).tracker, "trace",
                                          512)
    est = estimate(TrainingSetup(model=spec_from_config(FAMILIES["llama"]), batch=2, seq=64))
    panel = window.timeline_panel
    window.timeline_button.click()  # the chart draws when its tab is on screen
    panel.show_predicted(predicted, est, None)
    panel.show_measured(measured, est, None, same_setup=True)
    overlay = panel.chart._overlay
    assert overlay is not None and panel.timeline is predicted
    xs, ys = overlay.getData()
    assert xs.max() <= len(predicted.events) and ys.max() > 0
    assert "Measured" in panel.source.text()
    panel.show_measured(measured, est, None, same_setup=False)
    assert panel.timeline is measured and "scaled-down" in panel.source.text()


@pytest.mark.full_suite
def test_a_family_without_sdpa_switches_the_window_to_eager(window, qtbot, tmp_path):
    """Gemma 2 runs without SDPA in transformers: the calibration says so, and the window switches attention to
    eager (an edit the user can undo) and estimates it, rather than leaving an error on a default setting."""
    pytest.importorskip("transformers")
    w = window
    cfg = {"model_type": "gemma2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_hidden_layers": 3,
           "pad_token_id": 0}
    path = write_config(tmp_path / "gemma2", "config.json", cfg)
    w.apply_state(w.inputs.state().replace(attention="sdpa", gpus="1", strategy="ddp"))
    assert not w.open_config(path)
    qtbot.waitUntil(lambda: w.result.estimate.method == "fitted", timeout=90000)
    assert w.inputs.state().attention == "eager" and w.result.setup.attention == "eager"


def test_the_layout_dialog_says_how_many_waiting_pipeline_layouts_it_lists():
    """The dialog lists at most SHOWN waiting pipeline layouts; its text says so when there are more (64 GPUs of
    Mixtral-8x7B leave 112 out)."""
    from memcalc_gui.core.distributed import Parallelism
    from memcalc_gui.core.layouts import NOT_CALIBRATED, Search
    from memcalc_gui.ui.layouts_dialog import SHOWN, _left_out_text

    def text(n: int) -> str:
        return _left_out_text(Search([], {f"a layout of 2 pipeline stages {NOT_CALIBRATED}": [
            Parallelism(gpus=64, pp=2)] * n}))

    assert "(listed last)" in text(SHOWN)
    assert "1 layout of 2 pipeline stages is not calibrated yet" in text(1)
    assert f"{SHOWN + 5} layouts of 2 pipeline stages are not calibrated yet (the first {SHOWN} listed last)" in \
        text(SHOWN + 5)


def test_waiting_sequence_parallel_layouts_are_listed_for_the_form_to_calibrate_not_the_button(qtbot):
    """A sequence-parallel layout of a family without a block model waits for its own rank's calibration, as a
    pipeline layout does: listed last as "not calibrated" (the form fits it once used), not given to the button that
    calibrates tensor-parallel degrees (whose one-replica fits would never weigh it)."""
    from memcalc_gui.core.distributed import Parallelism
    from memcalc_gui.core.layouts import NOT_CALIBRATED, Search
    from memcalc_gui.core.setup import TrainingSetup
    from memcalc_gui.ui.layouts_dialog import LayoutsDialog, _left_out_text, _waiting

    sp = Parallelism(gpus=8, tp=2, sp=True, strategy="fsdp2")
    tp4 = Parallelism(gpus=8, tp=4, strategy="fsdp2")
    staged = Parallelism(gpus=8, pp=2, strategy="ddp")
    found = Search([], {f"sequence parallelism over 2 GPUs {NOT_CALIBRATED}": [sp],
                        f"tensor parallelism over 4 GPUs {NOT_CALIBRATED}": [tp4],
                        f"a layout of 2 pipeline stages {NOT_CALIBRATED}": [staged]})
    assert _waiting(found) == ([tp4], [sp, staged])
    text = _left_out_text(found)
    assert "1 layout with tensor parallelism over 4 GPUs" in text
    assert "2 layouts of 2 pipeline stages or with sequence parallelism are not calibrated yet" in text
    asked: list[list[Parallelism]] = []
    setup = TrainingSetup(params=10**9, parallel=Parallelism(gpus=8, strategy="fsdp2"))
    dialog = LayoutsDialog(setup, find=lambda s: found, name="toy", calibrate=asked.append)
    qtbot.addWidget(dialog)
    rows = {dialog.table.item(r, 0).text(): dialog.table.item(r, 1).text() for r in range(dialog.table.rowCount())}
    assert rows == {"TP 2 + SP × FSDP2 over 4": "not calibrated", "PP 2 (1F1B) × DDP over 4": "not calibrated"}
    assert "sequence-parallel rank" in dialog.table.item(0, 0).toolTip()
    assert dialog.calibrate_button is not None and dialog.calibrate_button.text() == \
        "Calibrate tensor parallelism over 4 GPUs"
    dialog.calibrate_button.click()
    assert asked == [[tp4]]


def test_what_to_change_fits_first_in_one_unit_with_the_still_over_heading_between(window):
    """Issue 62 in the window: Qwen2.5-7B, 8 × 4096 (× 4 accumulation), 8 × H100, FSDP2, checkpointing. The cards that
    fit come first — the lossless ones above any that adds GPUs —, the heading of those still over sits right before
    the first that does not fit, and every size of the panel is in the verdict's one unit (a 44 MiB headroom stood
    beside GiB values, a card that fits after those that do not)."""
    w = window
    assert set_fields(w, preset="qwen2.5-7b", batch="8", seq="4096", gpus="8", strategy="fsdp2", gpu="h100-80gb",
                      precision="mixed", checkpointing="full")
    result = w.result
    assert result.verdict.fits is False
    shown = [b for b in w.advice.buttons if b.isVisibleTo(w.advice)]
    rows = w.advice.suggestions()
    assert len(shown) == len(rows) and rows
    fits = [s.fits for s in rows]
    assert fits == sorted(fits, reverse=True) and fits[0] and not fits[-1]
    first_gpu = next((i for i, s in enumerate(rows) if "gpus" in s.changes), len(rows))
    assert any(s.fits and "gpus" not in s.changes for s in rows[:first_gpu])
    layout = w.advice._list
    heading = layout.indexOf(w.advice.still_over)
    assert w.advice.still_over.isVisibleTo(w.advice) and heading == layout.indexOf(shown[fits.index(False)]) - 1
    text = " ".join([w.banner.text.text(), *(b.description.text() for b in shown), *(b.toolTip() for b in shown)])
    assert set(re.findall(r"\d (B|KiB|MiB|GiB|TiB)\b", text)) == {result.unit}
