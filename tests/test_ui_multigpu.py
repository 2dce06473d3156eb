"""Multi-GPU in the window (pytest-qt, offscreen): GPUs, strategy, node size and offload as inputs; the
per-GPU chart, banner and plan; inline errors for invalid combinations; settings and undo."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import Qt

from memcalc_gui.core.distributed import STRATEGIES, STRATEGY_LABELS, Parallelism
from memcalc_gui.core.result import evaluate
from memcalc_gui.core.units import format_bytes, gib
from memcalc_gui.core.vocab import OBJECTS, PHASES
from memcalc_gui.ui import measure_panel
from memcalc_gui.ui.form import FormState, ModelCache, build_setup, capacity_text, default_state, gpu_by_id
from memcalc_gui.ui.main_window import MainWindow
from memcalc_gui.ui.settings import KEY_SETUP, SETTINGS_ENV, make_settings
from memcalc_gui.ui.tooltips import TOOLTIPS
from memcalc_gui.view.chart import AXIS_LABEL_PER_GPU

H100 = capacity_text(gpu_by_id()["h100-80gb"])
BIG = dict(preset="llama-3.1-70b", batch="1", seq="4096", grad_accum="1", checkpointing="full", gpu="h100-80gb",
           capacity=H100)


@pytest.fixture(autouse=True)
def private_settings(tmp_path, monkeypatch):
    monkeypatch.setenv(SETTINGS_ENV, str(tmp_path / "settings"))
    monkeypatch.setattr(measure_panel, "DETECT_DELAY_MS", None)
    return tmp_path / "settings"


@pytest.fixture
def window(qtbot):
    w = MainWindow(initial_state=default_state().replace(**BIG), persist=False)
    qtbot.addWidget(w)
    w.resize(1300, 860)
    w.show()
    return w


def set_fields(w: MainWindow, **fields: str) -> bool:
    w.inputs.set_state(w.inputs.state().replace(**fields))
    return w.refresh()


def assert_chart_matches(w: MainWindow) -> None:
    est = w.result.estimate
    drawn = w.chart.heights()
    for o in OBJECTS:
        assert drawn[o] == pytest.approx([gib(est.phases[p].objects[o]) for p in PHASES]), o


def test_inputs_exist_with_sources_in_their_tooltips(window):
    w = window
    inputs = w.inputs
    assert [inputs.strategy.itemData(i) for i in range(inputs.strategy.count())] == list(STRATEGIES)
    assert inputs.strategy.itemText(STRATEGIES.index("zero3")) == STRATEGY_LABELS["zero3"]
    assert "(2 + 2 + K)Ψ" in TOOLTIPS["strategy"] and "DeepSpeed" in TOOLTIPS["strategy"]
    assert "FSDP" in TOOLTIPS["strategy"] and "estimate_zero2" in TOOLTIPS["strategy"]
    for name in ("gpus", "strategy", "node_size", "offload"):
        assert inputs.widget_for(name).toolTip(), name
    assert inputs.state().gpus == "1" and inputs.state().strategy == "ddp"
    # a single GPU: nothing says "per GPU" and there is no plan
    # 70B on one GPU needs more than a TiB: the axis, the ledger and the headline share the GPU's unit, in which the
    # fit is decided (units.result_unit: GiB until the peak would read 100,000 in it)
    assert w.result.estimate.peak_bytes > 2**40
    assert w.chart.axis_label() == "Memory (GiB)" and w.chart.title_text() == ""
    assert w.tabs.tabText(0) == "&Ledger (GiB)" and " GiB " in w.banner.text.text()
    assert " TiB " not in w.banner.text.text()
    assert "per GPU" not in w.banner.text.text() and w.advice.plan_text() == ""
    assert not inputs.node_size.isEnabled()  # only HYBRID_SHARD or offload use it


def test_gpus_and_strategy_change_the_per_gpu_chart_banner_and_plan(window, qtbot):
    w = window
    single = [b / 2**30 for b in (w.result.estimate.phases[p].objects["parameters"] for p in PHASES)]  # GiB
    assert w.banner.state() == "over"
    w.inputs.gpus.selectAll()
    with qtbot.waitSignal(w.result_changed, timeout=2000):
        qtbot.keyClicks(w.inputs.gpus, "32")
    assert w.inputs.state().gpus == "32"
    w.inputs.strategy.setCurrentIndex(STRATEGIES.index("zero3"))
    qtbot.waitUntil(lambda: w.result.setup.parallel.strategy == "zero3", timeout=2000)
    setup = w.result.setup
    assert setup.parallel == Parallelism(gpus=32, strategy="zero3")
    assert_chart_matches(w)
    assert w.chart.unit == "GiB" and w.chart.heights()["parameters"][1] < single[1] / 10  # sharded over 32 GPUs
    assert w.chart.axis_label() == AXIS_LABEL_PER_GPU
    assert "32 GPUs" in w.chart.title_text() and "ZeRO-3" in w.chart.title_text()
    assert "per GPU" in w.chart.capacity_label.format
    assert w.banner.state() == "fits"
    assert "per GPU" in w.banner.text.text() and "per GPU" in w.headline()
    assert "32 × NVIDIA H100" in w.banner.detail.text()
    assert "per GPU" in w.method_label.text()
    plan = w.advice.plan_text()
    expected = w.result.plan
    assert expected is not None and expected.best_strategy == "zero3"
    assert f"ZeRO-3 {expected.min_gpus['zero3']}" in plan
    assert f"FSDP full shard {expected.min_gpus['fsdp-full-shard']}" in plan
    assert "Least communication that fits on 32 GPUs: ZeRO-3" in plan
    assert not w.advice.use_plan.isVisible()  # the current strategy is the best one

    # ZeRO-2 is over: the chart follows and the plan offers ZeRO-3 (one undoable step)
    zero3_peak = w.result.estimate.peak_bytes
    w.inputs.strategy.setCurrentIndex(STRATEGIES.index("zero2"))
    qtbot.waitUntil(lambda: w.result.setup.parallel.strategy == "zero2", timeout=2000)
    assert w.result.estimate.peak_bytes > zero3_peak and w.banner.state() == "over"
    assert_chart_matches(w)
    assert w.advice.use_plan.isVisible() and w.advice.use_plan.text() == "Use ZeRO-3"
    qtbot.mouseClick(w.advice.use_plan, Qt.MouseButton.LeftButton)
    assert w.result.setup.parallel.strategy == "zero3" and w.inputs.state().strategy == "zero3"
    w.undo()
    assert w.inputs.state().strategy == "zero2"

    # more GPUs: fewer bytes per GPU
    assert set_fields(w, gpus="64", strategy="zero3")
    assert w.result.estimate.peak_bytes < zero3_peak
    assert "Least communication that fits on 64 GPUs" in w.advice.plan_text()


def test_offload_shows_host_memory_and_enables_node_size(window):
    w = window
    assert set_fields(w, gpus="16", strategy="zero3", offload="optimizer")
    host = w.result.estimate.details["host_bytes"]
    assert host > 0
    assert w.inputs.node_size.isEnabled()
    text = f"Host (CPU) memory for offload: {format_bytes(host)} per node"
    assert text in w.banner.detail.text() and "Host" not in w.advice.plan_text()  # said once, in the banner
    assert set_fields(w, offload="none", strategy="fsdp-hybrid", node_size="4")
    assert w.inputs.node_size.isEnabled() and w.result.setup.parallel.node_size == 4
    assert set_fields(w, strategy="zero3")
    assert not w.inputs.node_size.isEnabled()


def offered(w: MainWindow) -> list[str]:
    combo = w.inputs.offload
    return [combo.itemData(i) for i in range(combo.count())]


def test_offload_offers_only_what_differs_for_the_strategy(window, qtbot):
    """FSDP has one CPUOffload (its "optimizer" and "both" gave the same ledger); ZeRO-1/2 cannot offload
    parameters; DDP cannot offload. Switching strategy keeps the closest offload."""
    w = window
    assert set_fields(w, gpus="8", strategy="zero3", offload="both")
    assert offered(w) == ["none", "optimizer", "both"] and w.inputs.offload.isEnabled()
    w.inputs.strategy.setCurrentIndex(STRATEGIES.index("zero2"))
    qtbot.waitUntil(lambda: w.result.setup.parallel.strategy == "zero2", timeout=2000)
    assert offered(w) == ["none", "optimizer"] and w.result.setup.parallel.offload == "optimizer"
    w.inputs.strategy.setCurrentIndex(STRATEGIES.index("fsdp-full-shard"))
    qtbot.waitUntil(lambda: w.result.setup.parallel.strategy == "fsdp-full-shard", timeout=2000)
    assert offered(w) == ["none", "both"] and w.result.setup.parallel.offload == "both"
    assert "CPUOffload" in w.inputs.offload.currentText()
    w.inputs.strategy.setCurrentIndex(STRATEGIES.index("ddp"))
    qtbot.waitUntil(lambda: w.result.setup.parallel.strategy == "ddp", timeout=2000)
    assert offered(w) == ["none"] and not w.inputs.offload.isEnabled()
    assert w.result.setup.parallel.offload == "none" and w.inputs.errors() == {}
    # a saved FSDP setup with the old "optimizer" spelling opens as CPUOffload, with the same ledger
    assert set_fields(w, strategy="fsdp-hybrid", offload="optimizer")
    assert w.inputs.state().offload == "both"


@pytest.mark.parametrize(("fields", "field", "words"), [
    (dict(gpus="0"), "gpus", "positive"),
    (dict(gpus="many"), "gpus", "positive"),
    (dict(node_size="-2", strategy="fsdp-hybrid", gpus="16"), "node_size", "positive"),
    (dict(model_kind="params", params="7B", strategy="zero3", gpus="8"), "strategy", "largest layer"),
    (dict(gpus="4", tp="2", pp="2", strategy="fsdp2"), "strategy", "shards nothing"),
    (dict(gpus="6", strategy="fsdp2", dp_replicate="4"), "dp_replicate", "equal replicas"),
    (dict(gpus="8", strategy="fsdp2", dp_replicate="two"), "dp_replicate", "positive"),
])
def test_invalid_combination_is_marked_inline_and_the_last_result_stays(window, fields, field, words):
    w = window
    assert set_fields(w, gpus="32", strategy="zero3")
    before = w.result
    heights = w.chart.heights()
    assert not set_fields(w, **fields)
    errors = w.inputs.errors()
    assert field in errors and words in errors[field], errors
    assert w.result is before and w.chart.heights() == heights
    assert w.inputs.widget_for(field).property("invalid") is True
    assert w.banner.stale_note.isVisible()
    w.undo()  # the first undo reverts the invalid entry
    assert w.inputs.errors() == {} and w.result.setup.parallel == Parallelism(gpus=32, strategy="zero3")


def test_each_parallel_edit_is_one_undo_step(window, qtbot):
    w = window
    w.inputs.gpus.selectAll()
    for key in "128":
        qtbot.keyClicks(w.inputs.gpus, key)
        qtbot.wait(5)
    qtbot.waitUntil(lambda: w.result.setup.parallel.gpus == 128, timeout=2000)
    w.inputs.strategy.setCurrentIndex(STRATEGIES.index("fsdp-full-shard"))
    qtbot.waitUntil(lambda: w.result.setup.parallel.strategy == "fsdp-full-shard", timeout=2000)
    w.inputs.offload.setCurrentIndex(w.inputs.offload.findData("both"))
    qtbot.waitUntil(lambda: w.result.setup.parallel.offload == "both", timeout=2000)
    assert "offload" in w.undo_action.text()
    w.undo()
    assert w.result.setup.parallel == Parallelism(gpus=128, strategy="fsdp-full-shard")
    w.undo()
    assert w.result.setup.parallel == Parallelism(gpus=128)
    w.undo()  # the typing of "128" merged into one step
    assert w.result.setup.parallel == Parallelism() and w.inputs.state().gpus == "1"
    w.redo()
    w.redo()
    assert w.inputs.state().strategy == "fsdp-full-shard" and w.inputs.state().gpus == "128"


def test_settings_round_trip_of_the_parallel_fields(qtbot, private_settings):
    w = MainWindow()
    qtbot.addWidget(w)
    assert set_fields(w, **BIG, gpus="24", strategy="fsdp-hybrid", node_size="4", offload="both")
    w.close()
    assert (private_settings / "memcalc.ini").is_file()
    again = MainWindow()
    qtbot.addWidget(again)
    state = again.inputs.state()
    assert (state.gpus, state.strategy, state.node_size, state.offload) == ("24", "fsdp-hybrid", "4", "both")
    assert again.result.setup.parallel == Parallelism(gpus=24, strategy="fsdp-hybrid", node_size=4,
                                                      offload="both")
    again.close()


def test_form_state_reads_old_and_rejects_bad_saved_values():
    old = {k: v for k, v in default_state().to_json().items() if k not in ("gpus", "strategy", "node_size", "offload")}
    state = FormState.from_json(old)
    assert (state.gpus, state.strategy, state.node_size, state.offload) == ("1", "ddp", "8", "none")
    with pytest.raises(ValueError):
        FormState.from_json(dict(old, strategy="zero9"))
    with pytest.raises(ValueError):
        FormState.from_json(dict(old, offload="disk"))
    setup = build_setup(default_state().replace(**BIG, gpus="8", strategy="zero1"), ModelCache())
    assert setup.parallel == Parallelism(gpus=8, strategy="zero1")
    assert evaluate(setup).plan is not None


def _choose_strategy(w: MainWindow, qtbot, strategy: str) -> None:
    w.inputs.strategy.setCurrentIndex(w.inputs.strategy.findData(strategy))
    qtbot.waitUntil(lambda: w.result.setup.parallel.strategy == strategy, timeout=5000)


def test_the_vocabulary_split_follows_the_strategy_until_ticked_and_megatron_fixes_it(window, qtbot):
    """Issue 62: the loss-parallel box shows the strategy's default (on under FSDP2, as torchtitan; off under DDP)
    until the user clicks it; under Megatron-LM it is ticked and fixed (its VocabParallelEmbedding), whatever the
    user's click said, which comes back under another strategy. The estimate runs what the box shows."""
    w = window
    box = w.inputs.loss_parallel
    assert set_fields(w, gpus="16", tp="2", strategy="fsdp2")
    assert w.inputs.state().loss_parallel == "auto" and box.isChecked() and box.isEnabled()
    assert w.result.setup.parallel.loss_parallel and "loss parallel" in w.chart.title_text()
    _choose_strategy(w, qtbot, "ddp")
    assert not box.isChecked() and box.isEnabled() and not w.result.setup.parallel.loss_parallel
    _choose_strategy(w, qtbot, "megatron-distopt")
    assert box.isChecked() and not box.isEnabled() and "VocabParallelEmbedding" in box.toolTip()
    assert w.result.setup.parallel.loss_parallel
    _choose_strategy(w, qtbot, "fsdp2")
    box.click()  # the user clears it
    qtbot.waitUntil(lambda: not w.result.setup.parallel.loss_parallel, timeout=5000)
    assert w.inputs.state().loss_parallel == "false" and not box.isChecked()
    _choose_strategy(w, qtbot, "megatron")
    assert box.isChecked() and w.result.setup.parallel.loss_parallel and not w.inputs.errors()
    _choose_strategy(w, qtbot, "fsdp2")
    assert not box.isChecked() and not w.result.setup.parallel.loss_parallel
    assert set_fields(w, tp="1")  # no tensor parallelism: nothing to split, the box off and its choice kept
    assert not box.isEnabled() and not w.result.setup.parallel.loss_parallel
    assert w.inputs.state().loss_parallel == "false"


def test_settings_saved_before_the_split_became_the_default_open_on_the_strategys_default(qtbot, private_settings):
    """A setup saved by an older memcalc (no format version) has "false" for a box nobody ticked: it opens on the
    strategy's default; a box the user clears now is saved as cleared (format 2); an old "true" stays, and a value no
    version wrote leaves the saved setup unused (the default one opens)."""
    old = default_state().replace(**BIG, gpus="16", tp="2", strategy="fsdp2", loss_parallel="false").to_json()
    settings = make_settings()
    settings.setValue(KEY_SETUP, json.dumps(old))
    settings.sync()
    w = MainWindow()
    qtbot.addWidget(w)
    assert w.inputs.state().loss_parallel == "auto" and w.inputs.loss_parallel.isChecked()
    assert w.result.setup.parallel.loss_parallel and w.result.setup.parallel.tp == 2
    w.inputs.loss_parallel.click()
    qtbot.waitUntil(lambda: not w.result.setup.parallel.loss_parallel, timeout=5000)
    w.close()
    again = MainWindow()
    qtbot.addWidget(again)
    assert again.inputs.state().loss_parallel == "false" and not again.inputs.loss_parallel.isChecked()
    assert not again.result.setup.parallel.loss_parallel
    again.close()
    assert FormState.from_json(dict(old, loss_parallel="true"), 1).loss_parallel == "true"
    with pytest.raises(ValueError):
        FormState.from_json(dict(old, loss_parallel="maybe"))


def test_chart_labels_fit_a_narrow_plot_and_the_capacity_text_has_a_plate(window, qtbot):
    w = window  # the single-GPU 70B step peaks in the optimizer step
    assert w.result.estimate.peak_phase == "optimizer_step"
    assert w.chart.tick_labels()[-1] == "Optimizer step\n(peak)"
    assert w.chart.capacity_label.fill.style() != Qt.BrushStyle.NoBrush
    w.main_split.setSizes([900, 400])  # a narrow chart
    qtbot.waitUntil(lambda: w.chart.tick_labels()[-1] != "Optimizer step\n(peak)", timeout=2000)
    assert w.chart.tick_labels()[-1].endswith("\n(peak)")
    axis = w.chart.plot.getAxis("bottom")
    from PySide6.QtGui import QImage, QPainter

    image = QImage(8, 8, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    try:
        drawn = [spec[2] for spec in axis.generateDrawSpecs(painter)[2]]
    finally:
        painter.end()
    assert drawn == w.chart.tick_labels()  # every phase name is drawn (none dropped at the edge)


def test_the_banner_says_why_a_per_gpu_number_moves(window):
    """DDP on 8 GPUs needs more per GPU than on one (its gradient buckets); FSDP's offload kinds give the same
    numbers because FSDP's CPUOffload moves parameters, gradients and the step together — both said on screen."""
    w = window
    w.inputs.set_state(w.inputs.state().replace(preset="qwen2.5-1.5b", gpus="8", strategy="ddp", offload="none"))
    assert w.refresh()
    assert "communication buckets" in w.banner.full_text()
    w.inputs.set_state(w.inputs.state().replace(strategy="fsdp-full-shard", offload="optimizer"))
    assert w.refresh()
    assert "FSDP CPUOffload: parameter and gradient shards and the optimizer step on the host" in w.banner.full_text()
    assert w.banner.more.isVisibleTo(w.banner) and not w.banner.extra.isVisibleTo(w.banner)
    w.banner.more.click()  # "Why? ▸" unfolds the reasons
    assert w.banner.extra.isVisibleTo(w.banner) and "CPUOffload" in w.banner.extra.text()
    w.banner.more.click()
    assert not w.banner.extra.isVisibleTo(w.banner)


def test_model_parallel_fields_set_the_layout_and_apply_only_where_they_can(window, qtbot):
    """Tensor parallel with its sequence-parallel and loss-parallel boxes, pipeline stages with the schedule and the
    stages per GPU: each live only where it applies; the chart's title names the layout; a layout the model cannot
    split marks the field and keeps the last result."""
    w = window
    inputs = w.inputs
    assert not inputs.sp.isEnabled() and not inputs.schedule.isEnabled() and not inputs.virtual_stages.isEnabled()
    assert set_fields(w, gpus="64", tp="8", sp="true", loss_parallel="true", pp="2", strategy="fsdp2",
                      grad_accum="8")
    assert inputs.sp.isEnabled() and inputs.loss_parallel.isEnabled() and inputs.schedule.isEnabled()
    par = w.result.setup.parallel
    assert (par.tp, par.pp, par.dp, par.sp, par.loss_parallel) == (8, 2, 4, True, True)
    assert "TP 8 + SP + loss parallel × PP 2 (1F1B) × FSDP2 over 4" in w.chart.title_text()
    assert_chart_matches(w)
    assert any("Pipeline rank" in a for a in w.result.estimate.assumptions)
    shown = w.result.estimate.details["pipeline_rank"]
    assert f"most loaded pipeline stage is shown: rank {shown + 1} of 2" in w.banner.detail.text()
    inputs.schedule.setCurrentIndex(inputs.schedule.findData("interleaved-1f1b"))
    qtbot.waitUntil(lambda: w.result.setup.parallel.schedule == "interleaved-1f1b", timeout=2000)
    assert inputs.virtual_stages.isEnabled() and w.result.setup.parallel.virtual_stages == 2
    before = w.result
    assert not set_fields(w, pp="3")  # 64 GPUs are not whole groups of tp 8 × 3 stages
    assert "pp" in inputs.errors() and w.result is before
    assert not set_fields(w, gpus="48", pp="3", schedule="1f1b")  # 80 layers do not split into 3 stages
    assert "80 decoder layers" in inputs.errors()["pp"]
    # with tensor parallelism off the boxes keep their ticks but do not apply
    assert set_fields(w, gpus="4", tp="1", pp="2")
    assert not w.result.setup.parallel.sp and inputs.state().sp == "true" and not inputs.sp.isEnabled()


def test_the_zero_bubble_schedules_are_offered_and_what_they_do_not_model_is_marked(window, qtbot):
    """Zero bubble V runs two stages per GPU (the box live, 2 by default); checkpointing beside it is marked on the
    checkpointing field and the last good result stays."""
    w = window
    assert set_fields(w, preset="llama-3.1-8b", gpus="4", tp="1", pp="4", strategy="ddp", grad_accum="8",
                      checkpointing="none", schedule="zbv", virtual_stages="")
    par = w.result.setup.parallel
    assert (par.schedule, par.virtual_stages) == ("zbv", 2) and w.inputs.virtual_stages.isEnabled()
    assert "Zero bubble V" in w.chart.title_text()
    assert_chart_matches(w)
    before = w.result
    assert not set_fields(w, checkpointing="full")
    assert "checkpointing" in w.inputs.errors() and w.result is before
    assert set_fields(w, checkpointing="none", schedule="interleaved-zb", virtual_stages="1")
    assert w.result.setup.parallel.schedule == "interleaved-zb" and w.inputs.virtual_stages.isEnabled()
    # FSDP2 beside it: resharding after forward (the default) is marked on its box, off it runs
    before = w.result
    assert not set_fields(w, gpus="8", strategy="fsdp2")
    assert "wrong" in w.inputs.errors()["reshard_after_forward"] and w.result is before
    assert set_fields(w, reshard_after_forward="false")
    par = w.result.setup.parallel
    assert (par.strategy, par.reshard_after_forward, par.schedule) == ("fsdp2", False, "interleaved-zb")
    assert_chart_matches(w)
    # the layout search offers FSDP2 there without resharding, and applying one sets the box
    dialog = w.show_layouts()
    assert dialog is not None
    found = [x for x in dialog.layouts if x.parallel.strategy == "fsdp2" and x.parallel.pp > 1]
    assert found and all(not x.parallel.reshard_after_forward for x in found)
    assert "no reshard after forward" in found[0].label
    dialog.close()


def test_the_layout_search_lists_ranked_layouts_and_applies_one_as_one_undo_step(window, qtbot):
    w = window
    assert set_fields(w, gpus="64", seq="8192", grad_accum="8", checkpointing="none")
    before = w.result.setup.parallel
    dialog = w.show_layouts()
    assert dialog is not None and dialog.isVisible()
    table = dialog.table
    assert table.rowCount() > 5 and table.item(0, 0).text().startswith("TP")
    top = dialog.layouts[0]
    assert top.fits and table.item(0, 1).text() == format_bytes(top.peak_bytes)
    dialog.use_button.click()
    qtbot.waitUntil(lambda: w.result.setup.parallel.tp == top.parallel.tp, timeout=3000)
    par = w.result.setup.parallel
    assert (par.tp, par.pp, par.strategy, par.sp, par.loss_parallel) == (
        top.parallel.tp, top.parallel.pp, top.parallel.strategy, top.parallel.sp, top.parallel.loss_parallel)
    assert w.result.estimate.peak_bytes == top.peak_bytes  # the window's number is the search's
    w.undo()
    assert w.result.setup.parallel == before


def test_a_long_layout_label_is_never_cut_in_the_layout_table(window, qtbot):
    """The widest label takes one line at the dialog's own width; narrowed, a label wraps and its row grows to show
    every line; the label cell's tooltip holds the whole label."""
    w = window
    assert set_fields(w, gpus="64", seq="8192", grad_accum="8", checkpointing="none")
    dialog = w.show_layouts()
    assert dialog is not None
    table = dialog.table
    rows = range(table.rowCount())
    labels = [table.item(r, 0).text() for r in rows]
    assert len(max(labels, key=len)) > 50
    assert all(table.item(r, 0).toolTip().startswith(labels[r]) for r in rows)
    metrics = table.fontMetrics()
    qtbot.waitUntil(lambda: table.columnWidth(0) > 0)
    widest = max(metrics.horizontalAdvance(text) for text in labels)
    assert widest < table.columnWidth(0)

    def lines_fit() -> bool:  # each row as tall as the cell's text needs at its width, as Qt's delegate measures it
        return all(table.rowHeight(r) >= table.sizeHintForRow(r) for r in rows)

    dialog.resize(560, 420)
    qtbot.waitUntil(lambda: table.columnWidth(0) < widest // 2)
    qtbot.waitUntil(lines_fit, timeout=3000)
    three = 3 * metrics.lineSpacing()
    assert max(table.rowHeight(r) for r in rows) >= three > table.verticalHeader().defaultSectionSize()
    dialog.close()


def test_a_context_parallel_suggestion_applies_and_a_layout_it_breaks_is_marked(window):
    w = window
    assert set_fields(w, preset="llama-3.1-8b", seq="131072", gpus="8", strategy="fsdp2", checkpointing="full")
    assert not w.result.verdict.fits
    fix = next(s for s in w.result.verdict.suggestions if "context parallelism" in s.title)
    w.apply_changes(fix.title, fix.changes)
    assert w.result.setup.parallel.cp == fix.changes["cp"] and w.inputs.state().cp == str(fix.changes["cp"])
    assert "CP " in w.chart.title_text()
    before = w.result
    assert not set_fields(w, tp="8")  # 8 GPUs are not whole groups of tp 8 × cp
    assert "cp" in w.inputs.errors() and w.result is before


def test_the_wheel_over_an_unfocused_choice_scrolls_the_form_and_keeps_the_choice(window, qtbot):
    """Found driving the real window: scrolling the inputs with the wheel changed whichever combo box passed under
    the pointer. A choice without the keyboard focus now passes the wheel to the form's scroll bar."""
    from PySide6.QtCore import QPoint, QPointF
    from PySide6.QtGui import QWheelEvent
    from PySide6.QtWidgets import QApplication

    w = window
    w.resize(1280, 600)
    combo = w.inputs.activation_offload
    before = combo.currentData()
    w.setFocus()
    assert not combo.hasFocus()
    center = QPointF(combo.rect().center())
    event = QWheelEvent(center, QPointF(combo.mapToGlobal(combo.rect().center())), QPoint(0, 0), QPoint(0, -120),
                        Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)
    QApplication.sendEvent(combo, event)
    assert combo.currentData() == before


def test_fsdp2_hybrid_replicas_are_a_window_control(window):
    """The replicas field is live under FSDP2 only and keeps its text under the others; two replicas of 16 GPUs hold
    what FSDP2 over 16 holds (the banner and the report say hybrid), and the suggestion to drop them applies as one
    undoable step."""
    from memcalc_gui.report.content import _setup_rows

    w = window
    assert set_fields(w, gpus="32", strategy="zero3", dp_replicate="2")
    assert not w.inputs.dp_replicate.isEnabled() and w.result.setup.parallel.dp_replicate == 1
    w.inputs.strategy.setCurrentIndex(STRATEGIES.index("fsdp2"))
    assert w.inputs.dp_replicate.isEnabled()
    assert w.refresh()
    par = w.result.setup.parallel
    assert par.dp_replicate == 2 and par.fsdp2_ranks == 16
    assert "hybrid: 2 replicas of 16" in w.banner.detail.text()
    rows = dict(_setup_rows(w.result))
    assert rows["Hybrid sharding"].startswith("2 replicas, each sharded over 16 GPUs")
    alone = evaluate(w.result.setup.with_changes(parallel=Parallelism(gpus=16, strategy="fsdp2")))
    assert w.result.estimate.peak_bytes == alone.estimate.peak_bytes
    assert set_fields(w, gpus="8", dp_replicate="4", checkpointing="none")  # 4 replicas of 2 do not fit
    drop = next(s for s in w.result.verdict.suggestions if s.changes == {"dp_replicate": 1})
    w.apply_changes(drop.title, drop.changes)
    assert w.result.setup.parallel.dp_replicate == 1 and w.inputs.dp_replicate.text() == "1"
    w.undo()
    assert w.result.setup.parallel.dp_replicate == 4
    # a layout chosen in Find layouts sets the replicas too: a hybrid twin's, or 1 for a layout without them
    from memcalc_gui.ui.layouts_dialog import layout_changes

    twin = Parallelism(gpus=32, tp=2, sp=True, loss_parallel=True, strategy="fsdp2", dp_replicate=2)
    w.apply_changes("layout", layout_changes(twin))
    assert w.result.setup.parallel == dataclasses.replace(twin, node_size=w.result.setup.parallel.node_size)
    w.apply_changes("layout", layout_changes(dataclasses.replace(twin, dp_replicate=1)))
    assert w.result.setup.parallel.dp_replicate == 1


def test_every_form_field_has_words_for_its_error() -> None:
    """A marked field is named in the banner and the status bar in words, never by its internal name
    (``dp_replicate``, ``virtual_stages``)."""
    import dataclasses

    from memcalc_gui.ui.form import _FIELD_MAP
    from memcalc_gui.ui.main_window import FIELD_NAMES

    fields = {f.name for f in dataclasses.fields(FormState)} | set(_FIELD_MAP.values())
    assert fields <= set(FIELD_NAMES), sorted(fields - set(FIELD_NAMES))
    assert all("_" not in name or name == "use_cache" for name in FIELD_NAMES.values())


def test_a_long_layout_title_breaks_over_a_narrow_plot_and_joins_over_a_wide_one(window, qtbot):
    """A layout of every dimension names more than fits one line over a narrow plot: the title breaks where the
    layout's parts meet, stays inside the chart and loses no word; a wide plot puts it back on one line."""
    w = window
    assert set_fields(w, gpus="128", tp="4", sp="true", loss_parallel="true", pp="2", cp="2", dp_replicate="2",
                      strategy="fsdp2", checkpointing="full")
    full = f"Per GPU — {w.result.setup.parallel.gpus} GPUs: CP 2 × TP 4 + SP + loss parallel × PP 2 (1F1B)"
    w.resize(1600, 900)
    w.main_split.setSizes([300, 1300])
    qtbot.waitUntil(lambda: len(w.chart.title_lines()) == 1, timeout=3000)
    assert w.chart.title_text().startswith(full) and w.chart.title_text().endswith("(2 replicas)")
    one = w.chart.title_text()
    w.main_split.setSizes([1000, 600])  # a narrow chart
    qtbot.waitUntil(lambda: len(w.chart.title_lines()) > 1, timeout=3000)
    assert w.chart.title_text() == one  # broken, not cut: every word is drawn
    assert w.chart.title_lines()[0].endswith(("×", ":"))
    drawn = w.chart.plot.titleLabel.item.mapRectToScene(w.chart.plot.titleLabel.item.boundingRect())
    assert drawn.left() >= 0 and drawn.right() <= w.chart.width(), (drawn, w.chart.width())
    assert drawn.height() > 1.5 * w.chart.fontMetrics().height()  # the row grew to show both lines
    w.main_split.setSizes([300, 1300])
    qtbot.waitUntil(lambda: len(w.chart.title_lines()) == 1, timeout=3000)
    assert w.chart.title_text() == one


@pytest.mark.parametrize("over", [0.97, 1.03, 1.08, 1.5])
def test_the_capacity_text_covers_no_total(qtbot, over):
    """A peak just under or over the capacity puts its total where the capacity text sat: the text moves below the
    line, to the right, or to its short form, so no total is hidden under it."""
    from memcalc_gui.core.model import preset_spec
    from memcalc_gui.core.setup import TrainingSetup
    from memcalc_gui.view.chart import MemoryChart

    est = evaluate(TrainingSetup(model=preset_spec("llama-3.1-8b"), batch=2, seq=2048)).estimate
    chart = MemoryChart()
    qtbot.addWidget(chart)
    chart.resize(620, 320)
    chart.show()
    qtbot.waitExposed(chart)
    totals = sorted(est.phases[p].total_bytes for p in PHASES)
    for target in (totals[-1], totals[1]):  # the capacity near the peak, then near the second smallest total
        chart.set_estimate(est, int(target * over), "NVIDIA H100 80GB HBM3")
        qtbot.wait(50)
        text = chart.capacity_label.sceneBoundingRect()
        plot = chart.plot.getViewBox().sceneBoundingRect()
        assert plot.left() - 1 <= text.left() and text.right() <= plot.right() + 1  # inside the plot
        assert "GiB" in chart.capacity_label.format
        for label in chart.total_labels:
            assert not text.intersects(label.sceneBoundingRect()), (over, chart.capacity_label_place(),
                                                                    label.toPlainText())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=40),
                      min_size=1, max_size=12),
       seps=st.lists(st.sampled_from([" × ", ": ", ", ", " ", "", "-" * 60]), min_size=12, max_size=12),
       width=st.integers(380, 1400))
def test_any_title_stays_inside_the_plot_in_at_most_three_lines(qtbot, parts, seps, width):
    """Hostile layout titles (any text, any separators, any chart width): at most three lines, each inside the plot
    (the last ending in "…" where words had to go), and a title that was only broken keeps every character."""
    from memcalc_gui.core.model import preset_spec
    from memcalc_gui.core.setup import TrainingSetup
    from memcalc_gui.view.chart import TITLE_MAX_LINES, MemoryChart

    chart = MemoryChart()
    try:
        chart.resize(width, 360)
        chart.show()
        qtbot.wait(5)
        scope = "".join(p + s for p, s in zip(parts, seps, strict=False)).strip() or "x"
        est = evaluate(TrainingSetup(model=preset_spec("gpt2"), batch=1, seq=128)).estimate
        chart.set_estimate(est, None, per_gpu=scope)
        qtbot.wait(5)
        lines = chart.title_lines()
        assert 1 <= len(lines) <= TITLE_MAX_LINES
        drawn = chart.plot.titleLabel.item.mapRectToScene(chart.plot.titleLabel.item.boundingRect())
        assert drawn.left() >= -1 and drawn.right() <= chart.width() + 1, (drawn, chart.width())
        if not any(line.endswith("…") for line in lines):
            assert chart.title_text().split() == f"Per GPU — {scope}".split()
    finally:
        chart.close()
        chart.deleteLater()
