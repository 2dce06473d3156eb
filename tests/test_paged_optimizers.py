"""bitsandbytes' paged optimizers and QLoRA's prepare_model_for_kbit_training switch, in the core, the CLI and a real
CPU step."""

from __future__ import annotations

import importlib.util
import json

import pytest

from bench.accuracy import FAMILIES
from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.finetune import FineTuning
from memcalc_gui.core.ledger import shown_objects
from memcalc_gui.core.model import preset_spec, spec_from_config
from memcalc_gui.core.optimizer import optimizer_cost
from memcalc_gui.core.result import evaluate
from memcalc_gui.core.setup import TrainingSetup

#: one small and two large tensors: 4,000 (fp32 state even in 8-bit), 50,000 (8-bit, in the allocator), 200,000
LAYOUT = ([(40, 100)], [(250, 200)], [(400, 500)])


def test_paged_state_is_the_big_tensors_buffers() -> None:
    """bitsandbytes pages a state buffer from 1e5 elements on (Optimizer8bit.get_state_buffer); absmax and small
    tensors stay in the allocator; on CPU nothing is paged. Paged + allocator = the unpaged optimizer's state."""
    eight = optimizer_cost("adamw-8bit", "foreach", LAYOUT, 1, 4)
    paged8 = optimizer_cost("paged-adamw-8bit", "foreach", LAYOUT, 1, 4)
    assert paged8.paged_bytes == 2 * 200_000  # two uint8 buffers of the one tensor past the threshold
    assert paged8.state_bytes + paged8.paged_bytes == eight.state_bytes
    assert paged8.state_bytes == 2 * 4 * 4_000 + 2 * 50_000 + 2 * 4 * (-(-50_000 // 256) + -(-200_000 // 256))
    paged32 = optimizer_cost("paged-adamw-32bit", "foreach", LAYOUT, 1, 2)
    assert paged32.paged_bytes == 2 * 4 * 200_000  # fp32 state whatever the parameter dtype
    assert paged32.state_bytes == 2 * 4 * (4_000 + 50_000)
    assert paged32.step_temporary_bytes == 0  # one fused kernel
    on_cpu = optimizer_cost("paged-adamw-32bit", "foreach", LAYOUT, 1, 2, paging=False)
    assert on_cpu.paged_bytes == 0 and on_cpu.state_bytes == paged32.state_bytes + paged32.paged_bytes


def test_paged_state_is_outside_max_memory_allocated_but_in_the_total() -> None:
    spec = preset_spec("qwen2.5-1.5b")
    base = TrainingSetup(model=spec, batch=2, seq=1024, optimizer="adamw-8bit")
    paged = base.with_changes(optimizer="paged-adamw-8bit")
    e8, ep = estimate(base), estimate(paged)
    step8, stepp = e8.phases["optimizer_step"], ep.phases["optimizer_step"]
    moved = stepp.objects["paged_optimizer_state"]
    assert moved > 0.9 * step8.objects["optimizer_state"]  # nearly every tensor of a 1.5B model is big
    assert stepp.objects["optimizer_state"] + moved == step8.objects["optimizer_state"]
    assert stepp.tensor_bytes == step8.tensor_bytes - moved  # not what max_memory_allocated shows
    assert stepp.total_bytes < step8.total_bytes  # same device memory, less allocator reserve on top
    assert ep.phases["load"].objects["paged_optimizer_state"] == 0
    assert "paged_optimizer_state" in shown_objects(ep) and "paged_optimizer_state" not in shown_objects(e8)
    assert any("unified memory" in a for a in ep.assumptions)


def test_the_verdict_says_a_paged_state_can_be_evicted() -> None:
    spec = preset_spec("qwen2.5-1.5b")
    setup = TrainingSetup(model=spec, batch=2, seq=1024, optimizer="paged-adamw-32bit")
    est = estimate(setup)
    paged = est.peak.objects["paged_optimizer_state"]
    assert paged > 0
    just_over = evaluate(setup.with_changes(capacity_bytes=est.peak_bytes - paged // 2))
    assert just_over.verdict.fits is False and "evict" in just_over.headline()
    far_over = evaluate(setup.with_changes(capacity_bytes=est.peak_bytes - 2 * paged))
    assert "evict" not in far_over.headline()


def test_bnb_optimizers_refuse_the_fused_torch_step() -> None:
    spec = preset_spec("gpt2")
    for name in ("adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit"):
        with pytest.raises(InputError) as err:
            TrainingSetup(model=spec, optimizer=name, optimizer_impl="fused")  # type: ignore[arg-type]
        assert err.value.field == "optimizer_impl" and "bitsandbytes" in str(err.value)


def test_cli_takes_transformers_spelling_and_prints_the_paged_object(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["estimate", "--preset", "qwen2.5-0.5b", "--optimizer", "paged_adamw_8bit", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["setup"]["optimizer"] == "paged-adamw-8bit"
    assert data["phases"]["optimizer_step"]["objects"]["paged_optimizer_state"] > 0
    code = cli_main(["estimate", "--preset", "qwen2.5-0.5b", "--optimizer", "paged-adamw-32bit"])
    assert code == 0 and "Paged optimizer state" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_a_real_paged_step_on_cpu_matches_the_cpu_ledger() -> None:
    """On CPU bitsandbytes falls back to plain tensors (the cpu ledger pages nothing): the measured state equals it."""
    pytest.importorskip("torch")
    from memcalc_gui.measure.cpu_step import measure_training_step

    cfg = FAMILIES["llama"]
    kw = dict(batch=2, seq=64, precision="fp32", optimizer="paged-adamw-32bit", optimizer_impl="single-tensor")
    m = measure_training_step(cfg, **kw)  # type: ignore[arg-type]
    est = estimate(TrainingSetup(model=spec_from_config(cfg), target_device="cpu", **kw))  # type: ignore[arg-type]
    assert est.phases["optimizer_step"].objects["paged_optimizer_state"] == 0
    state = m.phases["optimizer_step"].objects["optimizer_state"]
    assert est.phases["optimizer_step"].objects["optimizer_state"] == pytest.approx(state, rel=0.01)


def test_prepare_kbit_off_keeps_the_unquantized_weights_in_bf16() -> None:
    spec = preset_spec("llama-3.1-8b")
    prepared = TrainingSetup(model=spec, precision="bf16", checkpointing="full", tuning=FineTuning(method="qlora"))
    kept = prepared.with_changes(tuning=FineTuning(method="qlora", prepare_kbit=False))
    a, b = estimate(prepared), estimate(kept)
    other = spec.num_params - kept.tuning.quantized_params(spec)  # embeddings, norms, output head
    adapters = 4 * kept.tuning.adapter_params(spec)
    assert a.phases["load"].objects["parameters"] - b.phases["load"].objects["parameters"] == 2 * other
    assert b.phases["load"].objects["parameters"] == kept.tuning.quantized_bytes(spec) + 2 * other + adapters
    assert b.peak_bytes < a.peak_bytes  # bf16 activations too: without autocast the fp32 cast runs the step in fp32
    assert kept.describe()["prepare_kbit"] is False and "without prepare_model_for_kbit_training" in \
        kept.tuning_text()
    with pytest.raises(InputError) as err:
        FineTuning(method="qlora", prepare_kbit="no")  # type: ignore[arg-type]
    assert err.value.field == "prepare_kbit"


def test_cli_no_prepare_kbit(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--preset", "llama-3.2-1b", "--tuning", "qlora", "--precision", "bf16", "--json"]
    assert cli_main(args) == 0
    on = json.loads(capsys.readouterr().out)
    assert cli_main([*args, "--no-prepare-kbit"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert on["setup"]["prepare_kbit"] is True and off["setup"]["prepare_kbit"] is False
    assert off["peak_bytes"] < on["peak_bytes"]
