"""AdamW with bf16 moments beside fp32 weights (``--optimizer adamw-bf16-states``): torchdistx's AnyPrecisionAdamW as
Trainer's ``adamw_anyprecision`` runs it with bfloat16 momentum and variance (and Megatron's precision-aware optimizer
when fused). Its CPU stand-in (``measure.anyprecision``) runs the same tensor operations; the ledger matches it."""

from __future__ import annotations

import pytest
from tiers import sample

from bench.techniques import FAMILIES
from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.model import block_preset_names, preset_spec, spec_from_config
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.solver import levers


@pytest.mark.parametrize("name", block_preset_names())
def test_half_of_adamws_state_under_fp32_weights(name: str) -> None:
    spec = preset_spec(name)
    for precision in ("fp32", "mixed"):
        adamw = TrainingSetup(model=spec, precision=precision)  # type: ignore[arg-type]
        a = estimate(adamw, "analytic").phases["optimizer_step"].objects
        b = estimate(adamw.with_changes(optimizer="adamw-bf16-states"), "analytic").phases["optimizer_step"].objects
        assert b["optimizer_state"] * 2 == a["optimizer_state"]
        fused = adamw.with_changes(optimizer="adamw-bf16-states", optimizer_impl="fused")
        assert estimate(fused, "analytic").phases["optimizer_step"].objects.get("optimizer_temporaries", 0) == 0


def test_a_lever_under_fp32_weights_and_a_cli_choice(capsys: pytest.CaptureFixture[str]) -> None:
    spec = preset_spec("llama-3.2-1b")
    assert any(lv.key == "optimizer-bf16-states" for lv in levers(TrainingSetup(model=spec, precision="mixed")))
    assert not any(lv.key == "optimizer-bf16-states" for lv in levers(TrainingSetup(model=spec, precision="bf16")))
    assert cli_main(["estimate", "--preset", "llama-3.2-1b", "--optimizer", "adamw_bf16_states"]) == 0
    assert "AnyPrecisionAdamW" in capsys.readouterr().out


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


STEP_CASES = [pytest.param(family, precision, id=f"{precision}-{family}")
              for precision in ("fp32", "mixed", "bf16") for family in sorted(FAMILIES)]


# the default suite: each precision once, each family once
@pytest.mark.parametrize(("family", "precision"), sample(STEP_CASES, (0, 4, 8)))
def test_analytic_matches_a_real_step(family: str, precision: str) -> None:
    from memcalc_gui.measure.cpu_step import measure_training_step

    m = measure_training_step(FAMILIES[family], batch=2, seq=64, precision=precision, optimizer="adamw-bf16-states")
    est = estimate(TrainingSetup(model=spec_from_config(FAMILIES[family]), batch=2, seq=64, precision=precision,  # type: ignore
                                 optimizer="adamw-bf16-states", optimizer_impl="single-tensor", target_device="cpu"),
                   "analytic")
    real, predicted = m.phases["optimizer_step"], est.phases["optimizer_step"]
    assert abs(predicted.objects["optimizer_state"] - real.objects["optimizer_state"]) <= 1024  # the step counters
    assert predicted.objects["optimizer_temporaries"] == real.objects["optimizer_temporaries"]
    assert abs(predicted.tensor_bytes - real.peak_bytes) <= 0.001 * real.peak_bytes


def test_the_stand_in_updates_as_adamw_does() -> None:
    """Its arithmetic is AdamW's: from the same gradients it moves fp32 weights as torch's AdamW does (to bf16's
    precision in the moments)."""
    from memcalc_gui.measure.anyprecision import make

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 32))
    b = torch.nn.Parameter(a.detach().clone())
    opt_a, opt_b = make([a], weight_decay=0.01), torch.optim.AdamW([b], weight_decay=0.01)
    for _ in range(3):
        g = torch.randn(64, 32)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert opt_a.state[a]["exp_avg"].dtype == torch.bfloat16
    assert torch.allclose(a, b, atol=1e-3)


def test_fused_is_refused_in_a_cpu_measurement() -> None:
    from memcalc_gui.measure.cpu_step import UnsupportedOptimizerError, make_optimizer

    with pytest.raises(UnsupportedOptimizerError, match="Transformer Engine"):
        make_optimizer([torch.nn.Parameter(torch.zeros(2))], "adamw-bf16-states", "fused")
