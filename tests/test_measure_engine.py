"""The measurement engine on CPU: measured vs estimated, scaling down, OOM, cancel, CLI; CUDA when present."""

from __future__ import annotations

import json

import pytest

from memcalc_gui.cli import main
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.model import preset_spec, spec_from_config
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc_gui.measure import engine  # noqa: E402

TINY = dict(model_type="llama", vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)


def tiny_setup(**kw: object) -> TrainingSetup:
    base = dict(model=spec_from_config(TINY), batch=2, seq=64, precision="mixed", optimizer_impl="foreach")
    base.update(kw)
    return TrainingSetup(**base)  # type: ignore[arg-type]


def test_cpu_measurement_matches_estimate() -> None:
    seen: list[str] = []
    r = engine.measure(tiny_setup(), device="cpu", iterations=3, progress=seen.append)
    assert r.device.kind == "cpu" and r.device.label == "on this CPU"
    assert not r.scaled and r.oom is None
    assert set(r.phases) == set(PHASES)
    for name, err in r.error_pct.items():
        assert abs(err) < 3, (name, err)
    assert r.leak["growing"] is False and len(r.leak["live_bytes_per_iteration"]) == 3
    assert any("iteration 3 of 3: backward" in s for s in seen)
    data = r.to_json()
    assert data["schema"] == 1 and data["device"] == "cpu"
    assert set(data["phases"]["backward"]) >= {"peak_bytes", "live_bytes", "objects"}
    assert data["estimate"]["schema"] == 1 and set(data["error_pct"]) == set(PHASES)
    assert r.measured_overheads() is None  # no CUDA context on a CPU


def test_big_setup_is_scaled_down_and_compared_with_that_setup() -> None:
    setup = TrainingSetup(model=preset_spec("qwen2.5-7b"), batch=4, seq=2048)
    info = engine.DeviceInfo("cpu", "CPU", 24 * 2**30, 16 * 2**30)
    measured, note = engine.plan(setup, info, time_budget_s=10)
    assert measured.model is not None and measured.model.num_layers < 28
    assert "scaled-down" in note and "layers" in note
    assert measured.model.hidden_size == setup.model.hidden_size  # same block, fewer of them


def test_oom_is_a_result(monkeypatch: pytest.MonkeyPatch) -> None:
    from memcalc_gui.measure import cpu_step

    def explode(*a: object, on_phase=None, **k: object):  # type: ignore[no-untyped-def]
        on_phase("forward", 1, 0)
        on_phase("backward", 1, 0)
        raise MemoryError

    monkeypatch.setattr(cpu_step, "measure_training_step", explode)
    r = engine.measure(tiny_setup(batch=8), device="cpu")
    assert r.oom == "Does not fit: out of memory in backward at micro-batch 8."
    assert r.headline() == r.oom and r.signals == []


def test_cancel_stops_between_phases() -> None:
    calls: list[str] = []
    with pytest.raises(engine.Cancelled):
        engine.measure(tiny_setup(), device="cpu", progress=calls.append, should_stop=lambda: len(calls) >= 2)
    assert len(calls) == 2


def test_bad_requests() -> None:
    with pytest.raises(InputError):
        engine.measure(TrainingSetup(params=10**9), device="cpu")
    with pytest.raises(InputError):
        engine.measure(tiny_setup(), device="tpu")
    with pytest.raises(InputError):
        engine.measure(tiny_setup(), device="cpu", iterations=1)
    with pytest.raises(engine.MeasureError, match="Lion"):
        engine.measure(tiny_setup(optimizer="lion"), device="cpu")


def test_missing_torch_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name: str, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        if name == "torch":
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(engine.MeasureError, match=r"pip install 'memcalc-gui\[measure\]'"):
        engine.detect_device("auto")


def test_cli_measure_json(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    code = main(["measure", "--config", str(path), "--batch", "2", "--seq", "64", "--device", "cpu",
                 "--iterations", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["device"] == "cpu"
    assert {"phases", "estimate", "error_pct", "signals", "leak", "setup"} <= set(data)


def test_cli_measure_bad_iterations(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["measure", "--preset", "gpt2", "--iterations", "zero"])
    assert info.value.code == 2 and "--iterations" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_measurement_uses_the_allocator(tmp_path) -> None:  # type: ignore[no-untyped-def]
    snap = tmp_path / "snap.pickle"
    r = engine.measure(tiny_setup(), device="cuda", iterations=3, snapshot=snap)
    assert r.device.kind == "cuda" and r.context_bytes and r.context_bytes > 0
    assert r.peak_reserved_bytes and r.peak_reserved_bytes >= r.measured_peak_bytes
    assert snap.exists() and r.measured_overheads() is not None
    for err in r.error_pct.values():
        assert abs(err) < 10


def test_a_lora_measurement_on_cpu_agrees_with_its_estimate(tmp_path) -> None:
    """The window's Measure runs a real peft LoRA step (scaled down when needed) and compares it with the CPU
    ledger of the same setup."""
    pytest.importorskip("peft")
    from bench.accuracy import FAMILIES
    from memcalc_gui.core.finetune import FineTuning
    from memcalc_gui.core.model import spec_from_file

    path = tmp_path / "config.json"
    path.write_text(json.dumps(FAMILIES["llama"]))
    setup = TrainingSetup(model=spec_from_file(path), batch=2, seq=128, precision="mixed",
                          tuning=FineTuning(method="lora", rank=8, dropout=0.05))
    result = engine.measure(setup, device="cpu", iterations=2)
    assert not result.scaled and result.estimate.setup.target_device == "cpu"
    for phase, reading in result.phases.items():
        if phase != "load":
            assert result.estimate.estimate.phases[phase].tensor_bytes == pytest.approx(reading.peak_bytes, rel=0.03)
