"""The memory timeline of a step (issue 16): measured and predicted event streams, memory_viz snapshots out (read
back by PyTorch's own reader), real snapshots in (read without running code), and the comparison with an estimate."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bench.techniques import FAMILIES
from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.timeline import (
    Span,
    Timeline,
    TimelineEvent,
    compare_phases,
    load_snapshot,
    timeline_from_snapshot,
)


def _tiny() -> Timeline:
    ev = [TimelineEvent(1024, "parameters", "load", 0, "model.embed", "empty", 1),
          TimelineEvent(4096, "activations", "forward", 1, "model.layers.0.mlp", "mm", 2),
          TimelineEvent(512, "temporaries", "backward", 1, "model.layers.0.mlp", "mm", 3),
          TimelineEvent(-4096, "activations", "forward", 1, "model.layers.0.mlp", "mm", 2),
          TimelineEvent(-512, "temporaries", "backward", 1, "model.layers.0.mlp", "mm", 3)]
    return Timeline(tuple(ev), "trace", (Span("load", 0, 0, 1), Span("forward", 1, 1, 2), Span("backward", 1, 2, 5)))


def test_series_peaks_and_composition() -> None:
    tl = _tiny()
    assert list(tl.live()) == [1024, 5120, 5632, 1536, 1024]
    assert tl.peak() == (2, 5632)
    assert tl.phase_peaks() == {"load": 1024, "forward": 5120, "backward": 5632}
    assert tl.composition_at(2) == {"parameters": 1024, "activations": 4096, "temporaries": 512}
    assert sum(v[2] for v in tl.series().values()) == 5632
    assert [e.size_bytes for e in tl.largest_live(2, 2)] == [4096, 1024]
    rows = compare_phases(tl, {"backward": {"parameters": 1024, "activations": 2048, "cuda_context": 10**9}})
    assert len(rows) == 1 and rows[0].difference_bytes == 5632 - 3072
    assert rows[0].largest_gap == ("activations", 2048)


def test_snapshot_round_trip() -> None:
    tl = _tiny()
    back = timeline_from_snapshot(load_snapshot(pickle.dumps(tl.to_snapshot())))
    assert back.phase_peaks() == tl.phase_peaks() and back.spans == tl.spans
    assert [(e.size_bytes, e.category, e.phase) for e in back.events] == \
        [(e.size_bytes, e.category, e.phase) for e in tl.events]


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch /tmp/memcalc-pwned",))


@pytest.mark.parametrize("payload, words", [
    (pickle.dumps(_Evil()), "names the Python object"),
    (pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 1, "size": 2, "frames": []}]]})[:-7], "truncated"),
    (pickle.dumps(42), "no device_traces"),
    (b"\x00\x01not a pickle at all", "not a"),
    (pickle.dumps({"device_traces": [[{"action": "alloc", "addr": "x", "size": 2}]]}), "integer address"),
    (pickle.dumps({"device_traces": [["nope"]]}), "not a record"),
    (pickle.dumps({"device_traces": []}), "no trace"),
])
def test_hostile_snapshots_are_refused_without_running_code(payload: bytes, words: str) -> None:
    Path("/tmp/memcalc-pwned").unlink(missing_ok=True)
    with pytest.raises(InputError, match=words) as exc:
        timeline_from_snapshot(load_snapshot(payload))
    assert exc.value.field == "snapshot"
    assert not Path("/tmp/memcalc-pwned").exists()


_plain = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
                      lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
                          st.sampled_from(["action", "addr", "size", "frames", "device_traces", "segments", "blocks",
                                           "state", "filename", "name", "line", "category", "memcalc", "spans",
                                           "total_size", "device"]) | st.text(max_size=6), inner, max_size=6),
                      max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(obj=_plain, as_json=st.booleans(), cut=st.integers(0, 64))
def test_any_plain_file_reads_or_is_refused_with_one_reason(obj: object, as_json: bool, cut: int) -> None:
    """Whatever plain data a file holds, whole or truncated, pickled or JSON, reading it gives a timeline or an
    InputError naming the snapshot; nothing else escapes."""
    from memcalc_gui.core.timeline import read_timeline

    try:
        data = json.dumps(obj).encode() if as_json else pickle.dumps(obj)
    except (ValueError, TypeError):
        return
    for payload in (data, data[: max(0, len(data) - cut)]):
        try:
            tl = read_timeline(payload)
        except InputError as exc:
            assert exc.field == "snapshot"
        else:
            tl.peak()
            tl.phase_peaks()
            compare_phases(tl, {"forward": {"activations": 1}})


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize("case", [("llama", "mixed", "none", 1), ("qwen2-tied", "bf16", "full", 1),
                                  ("gpt2", "fp32", "none", 2)], ids=lambda c: "-".join(map(str, c)))
def test_measured_timeline_reproduces_the_measurement(case: tuple[str, str, str, int]) -> None:
    """The timeline built from a measured step's events has the step's phase peaks and end state exactly; the
    fake-tensor trace's timeline (the prediction) is within 1 % of it at every phase boundary and phase peak."""
    from memcalc_gui.measure.cpu_step import measure_training_step, timeline_from_tracker

    family, precision, ckpt, accum = case
    kw = dict(batch=2, seq=64, precision=precision, checkpointing=ckpt, grad_accum=accum, keep_tracker=True,
              module_names=True)
    real = measure_training_step(FAMILIES[family], **kw)  # type: ignore[arg-type]
    tl = timeline_from_tracker(real.tracker, "measured")
    assert tl.phase_peaks() == {p: m.peak_bytes for p, m in real.phases.items()}
    assert tl.live()[-1] == real.tracker.live_bytes
    fake = measure_training_step(FAMILIES[family], fake=True, **kw)  # type: ignore[arg-type]
    predicted = timeline_from_tracker(fake.tracker, "trace")
    assert [(s.phase, s.iteration) for s in predicted.spans] == [(s.phase, s.iteration) for s in tl.spans]
    live_p, live_r = predicted.live(), tl.live()
    for sp, sr in zip(predicted.spans, tl.spans, strict=True):
        for ip, ir in ((sp.start - 1, sr.start - 1), (sp.end - 1, sr.end - 1)):
            if ip >= 0 and ir >= 0:
                assert abs(live_p[ip] - live_r[ir]) <= 0.01 * live_r[ir], (sp, live_p[ip], live_r[ir])
    for phase, peak in tl.phase_peaks().items():
        assert abs(predicted.phase_peaks()[phase] - peak) <= 0.01 * peak, phase
    at_peak_p, at_peak_r = predicted.composition_at(predicted.peak()[0]), tl.composition_at(tl.peak()[0])
    for category, value in at_peak_r.items():
        assert abs(at_peak_p.get(category, 0) - value) <= 0.01 * tl.peak()[1], category


def test_pytorch_reads_every_view_of_a_written_snapshot(tmp_path: Path) -> None:
    from memcalc_gui.core.estimate import estimate
    from memcalc_gui.core.model import spec_from_config
    from memcalc_gui.core.setup import TrainingSetup
    from memcalc_gui.trace.fake import trace_estimate

    setup = TrainingSetup(model=spec_from_config(FAMILIES["llama"]), batch=2, seq=64, optimizer_impl="single-tensor")
    traced = trace_estimate(setup)
    assert traced.timeline is not None and traced.timeline.rounding == 512
    assert all(e.size_bytes % 512 == 0 for e in traced.timeline.events)
    # the trace's timeline peaks where its ledger does
    peaks = traced.timeline.phase_peaks()
    for phase in ("forward", "backward", "optimizer_step"):
        assert peaks[phase] == traced.estimate.phases[phase].tensor_bytes, phase
    path = tmp_path / "predicted.pickle"
    traced.timeline.write_snapshot(path)
    from torch.cuda import _memory_viz

    data = pickle.loads(path.read_bytes())  # our own file, in the test
    assert "<html" in _memory_viz.trace_plot(data).lower()
    assert "<html" in _memory_viz.segment_plot(data).lower()
    assert _memory_viz.segsum(data)
    assert _memory_viz.trace(data)
    out = tmp_path / "out.html"
    run = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(path), "-o", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert out.stat().st_size > 10_000
    assert estimate(setup).phases["forward"].tensor_bytes > 0


def _profiled_step() -> object:
    """Two real fp32 training steps of the small Llama (batch 2 × 64, AdamW single-tensor) under the CPU profiler
    with memory profiling on."""
    from memcalc_gui.measure.cpu_step import build_model, step_forward

    model = build_model(FAMILIES["llama"], precision="fp32")
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    ids = torch.randint(0, 512, (2, 64))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as prof:
        for _ in range(2):
            step_forward(model, ids, "fp32").backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return prof


def test_a_pytorch_made_snapshot_is_read_and_reconciled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """PyTorch builds a snapshot from a CPU profile of a real step (``_profile_to_snapshot``, the structure
    ``_dump_snapshot`` writes on a GPU, with the profiler's categories); memcalc finds its phases from the stack
    frames, maps the categories to ledger objects, and its peak is the step's."""
    from torch.cuda._memory_viz import _profile_to_snapshot

    from memcalc_gui.measure.cpu_step import measure_training_step

    prof = _profiled_step()
    path = tmp_path / "real.pickle"
    path.write_bytes(pickle.dumps(_profile_to_snapshot(prof)))
    tl = timeline_from_snapshot(load_snapshot(path.read_bytes()))
    assert [s.phase for s in tl.spans] == ["forward", "backward", "optimizer_step"] * 2
    real = measure_training_step(FAMILIES["llama"], batch=2, seq=64, precision="fp32")
    _, peak = tl.peak()
    assert abs(peak - real.peak_bytes) <= 0.01 * real.peak_bytes
    at_peak = tl.composition_at(tl.peak()[0])
    assert at_peak.get("optimizer_state", 0) > 0 and at_peak.get("parameters", 0) + at_peak.get("unknown", 0) > 0
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(FAMILIES["llama"]))
    assert cli_main(["reconcile", "--config", str(cfg), "--batch", "2", "--seq", "64", "--precision", "fp32",
                     "--optimizer-impl", "single-tensor", "--snapshot", str(path), "--gpu", "a100-80gb",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["phase"] for r in data["phases"]] == ["forward", "backward", "optimizer_step"]
    step = data["phases"][-1]
    assert abs(step["difference_bytes"]) <= 0.02 * step["timeline_bytes"]


def test_cli_snapshot_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["estimate", "--preset", "llama-3.2-1b", "--snapshot-out", str(tmp_path / "x.pickle")])
    assert exit_.value.code == 2
    assert "--snapshot-out" in capsys.readouterr().err
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(SystemExit) as exit_:
        cli_main(["reconcile", "--preset", "llama-3.2-1b", "--snapshot", str(bad)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--snapshot" in err and "names the Python object" in err and len(err.strip().splitlines()) == 1
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(FAMILIES["llama"]))
    out = tmp_path / "predicted.pickle"
    assert cli_main(["estimate", "--config", str(cfg), "--batch", "2", "--seq", "64", "--method", "trace",
                     "--snapshot-out", str(out)]) == 0
    assert "memory_viz" in capsys.readouterr().out
    assert cli_main(["reconcile", "--config", str(cfg), "--batch", "2", "--seq", "64", "--snapshot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "optimizer step" in text and "where they part" in text


@pytest.mark.parametrize("payload, words", [
    (b"[1, 2, 3]", "times, sizes"),
    (b"[[1], [[0, 1, 2]]]", "integers"),
    (b"[[1], [[0, 1, 2, 3, 4, 5, 6, 7, \"x\"]]]", "integers"),
    (b"{\"not\": \"a timeline\"}", "times, sizes"),
    (b"[[1, 2", "does not parse"),
])
def test_hostile_profiler_timelines_are_refused(payload: bytes, words: str) -> None:
    from memcalc_gui.core.timeline import read_timeline

    with pytest.raises(InputError, match=words) as exc:
        read_timeline(payload)
    assert exc.value.field == "snapshot"


@pytest.mark.full_suite
def test_a_profiler_memory_timeline_agrees_by_category_at_the_peak(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``export_memory_timeline`` JSON of a real CPU step: its peak is the measured step's, and by category the
    weights' gradients and optimizer state agree exactly. Where the categories differ in meaning: PyTorch's profiler
    has no optimizer-temporary category, so the step's temporaries (AdamW's denominators) appear under its
    "parameter" and "activation" categories, which memcalc counts as optimizer temporaries."""
    import warnings

    from memcalc_gui.core.timeline import read_timeline
    from memcalc_gui.measure.cpu_step import make_classifier, measure_training_step

    prof = _profiled_step()
    path = tmp_path / "timeline.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        prof.export_memory_timeline(str(path), device="cpu")
    tl = read_timeline(path.read_bytes())
    assert tl.source == "profiler" and not tl.spans
    index, peak = tl.peak()
    theirs = tl.composition_at(index)
    m = measure_training_step(FAMILIES["llama"], batch=2, seq=64, precision="fp32", keep_tracker=True)
    tracker = m.tracker
    at = tracker.peak(*tracker.windows()[("optimizer_step", 2, 0)]).index
    ours = tracker.composition_at(at, make_classifier(tracker)[0])
    assert abs(peak - m.peak_bytes) <= 0.001 * m.peak_bytes
    assert theirs["gradients"] == ours["gradients"] and theirs["optimizer_state"] == ours["optimizer_state"]
    step_temps = theirs.get("parameters", 0) + theirs.get("activations", 0) + theirs.get("temporaries", 0)
    assert abs(step_temps - ours["parameters"] - ours["optimizer_temporaries"]) <= 0.01 * peak
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(FAMILIES["llama"]))
    assert cli_main(["reconcile", "--config", str(cfg), "--batch", "2", "--seq", "64", "--precision", "fp32",
                     "--optimizer-impl", "single-tensor", "--snapshot", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["phases"]
    assert [r["phase"] for r in rows] == ["peak"] and abs(rows[0]["difference_bytes"]) <= 0.02 * peak


def test_the_report_draws_a_timeline_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``memcalc report --snapshot FILE`` adds "Memory over time" (the figure and its caption with each phase's
    peak beside the estimate) to a PDF; a file that is not a timeline is refused, naming --snapshot."""
    import shutil

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(FAMILIES["llama"]))
    predicted = tmp_path / "predicted.pickle"
    common = ["--config", str(cfg), "--batch", "2", "--seq", "64"]
    assert cli_main(["estimate", *common, "--method", "trace", "--snapshot-out", str(predicted)]) == 0
    capsys.readouterr()
    pdf = tmp_path / "report.pdf"
    assert cli_main(["report", *common, "--gpu", "rtx-4090", "--snapshot", str(predicted), "--out", str(pdf)]) == 0
    assert pdf.stat().st_size > 20_000
    if shutil.which("pdftotext"):
        text = subprocess.run(["pdftotext", str(pdf), "-"], capture_output=True, text=True, check=True).stdout
        assert "Memory over time" in text and "Predicted by the trace" in text and "estimate" in text
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"\x80\x04K*.")  # pickled 42
    with pytest.raises(SystemExit) as exit_:
        cli_main(["report", *common, "--snapshot", str(bad), "--out", str(tmp_path / "x.pdf")])
    assert exit_.value.code == 2 and "--snapshot" in capsys.readouterr().err
    png = tmp_path / "report.png"
    assert cli_main(["report", *common, "--snapshot", str(predicted), "--out", str(png)]) == 0
    plain = tmp_path / "plain.png"
    assert cli_main(["report", *common, "--out", str(plain)]) == 0
    from PySide6.QtGui import QImage

    with_strip, without = QImage(str(png)), QImage(str(plain))
    assert (without.width(), without.height()) == (1600, 1000)
    assert (with_strip.width(), with_strip.height()) == (1600, 1440)
    # the strip holds the drawn timeline: many colours (stacked areas), not an empty band
    strip = with_strip.copy(28, 1040, 1544, 360)
    colours = {strip.pixel(x, y) for x in range(0, strip.width(), 7) for y in range(0, strip.height(), 7)}
    assert len(colours) > 20


# ---- the coarse timeline of the analytic ledger ------------------------------------------------------------------
@st.composite
def _any_setup(draw: st.DrawFn) -> object:
    from memcalc_gui.core.distributed import Parallelism
    from memcalc_gui.core.finetune import FineTuning
    from memcalc_gui.core.model import block_preset_names, preset_spec
    from memcalc_gui.core.setup import TrainingSetup

    name = draw(st.sampled_from(sorted(block_preset_names())))
    kw = dict(model=preset_spec(name), batch=draw(st.integers(1, 16)), seq=draw(st.integers(1, 8192)),
              grad_accum=draw(st.integers(1, 4)), precision=draw(st.sampled_from(("fp32", "mixed", "bf16"))),
              optimizer=draw(st.sampled_from(("adamw", "sgd", "adamw-8bit", "adafactor", "lion", "galore-adamw"))),
              checkpointing=draw(st.sampled_from(("none", "full"))), loss=draw(st.sampled_from(("full", "chunked"))),
              optimizer_in_backward=draw(st.booleans()),
              activation_offload=draw(st.sampled_from(("none", "checkpoint-inputs", "all"))),
              packing=draw(st.booleans()),
              tuning=FineTuning(method=draw(st.sampled_from(("full", "lora", "qlora")))),
              parallel=Parallelism(gpus=draw(st.sampled_from((1, 8))),
                                   strategy=draw(st.sampled_from(("ddp", "zero2", "zero3", "fsdp2")))))
    try:
        return TrainingSetup(**kw)  # type: ignore[arg-type]
    except InputError:
        return None


@pytest.mark.full_suite
@settings(max_examples=200, deadline=None)
@given(_any_setup())
def test_the_ledgers_coarse_timeline_peaks_where_the_ledger_does(setup: object) -> None:
    """The analytic method's per-layer timeline: each phase's highest point is exactly that phase's tensor total in
    the ledger (whatever the setup), every free releases a block that was allocated, and nothing is left negative."""
    from memcalc_gui.core.result import evaluate
    from memcalc_gui.core.timeline import ledger_timeline

    assume(setup is not None)
    try:
        est = evaluate(setup).estimate  # type: ignore[arg-type]
    except InputError:
        assume(False)
        return
    layers = setup.model.num_layers  # type: ignore[attr-defined]
    tl = ledger_timeline({p: ph.objects for p, ph in est.phases.items()}, layers)
    assert tl.source == "ledger"
    assert tl.phase_peaks() == {p: ph.tensor_bytes for p, ph in est.phases.items()}
    assert min(tl.live(), default=0) >= 0 and tl.peak()[1] == est.peak_tensor_bytes
    alive: set[int] = set()
    for e in tl.events:  # blocks: an address is allocated once and freed once; a part of one is freed anonymously
        if e.size_bytes > 0:
            assert e.addr and e.addr not in alive
            alive.add(e.addr)
        elif e.addr:
            alive.remove(e.addr)
    assert tl.live()[-1] == sum(est.phases["optimizer_step"].objects[c] for c in ("parameters", "optimizer_state"))
    assert len(tl.events) <= 12 * layers + 40


def test_the_coarse_timeline_builds_layer_by_layer() -> None:
    """Forward saves each layer's activations in turn (named by the layer), the loss adds the forward's temporaries
    at the end; backward frees activations from the top layer down while gradients appear."""
    from memcalc_gui.core.model import preset_spec
    from memcalc_gui.core.result import evaluate
    from memcalc_gui.core.setup import TrainingSetup
    from memcalc_gui.core.timeline import ledger_timeline

    est = evaluate(TrainingSetup(model=preset_spec("llama-3.2-1b"), batch=2, seq=1024)).estimate
    tl = ledger_timeline({p: ph.objects for p, ph in est.phases.items()}, 16)
    fwd = [e for e in tl.events if e.phase == "forward" and e.category == "activations"]
    assert [e.module for e in fwd] == [f"model.layers.{i}" for i in range(16)]
    assert sum(e.size_bytes for e in fwd) == est.phases["forward"].objects["activations"]
    spans = {s.phase: s for s in tl.spans}
    assert tl.events[spans["forward"].end - 1].category == "temporaries"
    bwd = [e for e in tl.events[spans["backward"].start:spans["backward"].end] if e.op == "backward"]
    assert bwd[0].module == "model.layers.15" and bwd[-1].module == "model.layers.0"
    series = tl.series()
    assert series["gradients"][spans["backward"].end - 1] == est.phases["optimizer_step"].objects["gradients"]
