"""The seeds' numbers, reproduced by the core (seed 000, 001, 002, 003, 004)."""

from __future__ import annotations

import pytest

from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.ledger import LedgerError, PhaseLedger
from memcalc_gui.core.model import preset_spec, spec_from_config
from memcalc_gui.core.optimizer import optimizer_cost
from memcalc_gui.core.quick import activations_per_token
from memcalc_gui.core.reconcile import reconcile
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES

ZERO = dict(cuda_context_bytes=0, allocator_reserve=0.0)


# ---- seed 000: the HF blog formula ------------------------------------------------------------
def test_seed000_qwen_1_5b_fp32_model_is_6_gb() -> None:
    est = estimate(TrainingSetup(params=1_500_000_000, precision="fp32", **ZERO))
    assert est.method == "quick"
    assert est.phases["load"].objects["parameters"] == 6_000_000_000


@pytest.mark.parametrize("n,b,seq,prec", [(1_500_000_000, 1, 512, "fp32"), (124_000_000, 8, 1024, "fp32"),
                                         (7_000_000_000, 2, 4096, "bf16"), (350_000_000, 64, 2048, "fp32")])
def test_seed000_total_formula_exactly(n: int, b: int, seq: int, prec: str) -> None:
    est = estimate(TrainingSetup(params=n, batch=b, seq=seq, precision=prec, **ZERO))
    p = 4 if prec == "fp32" else 2
    a = 4.6894e-4 * n + 1.8494e6
    expected = n * p + 2 * n * p + max(n * p + n * p, a * b * seq * p)
    assert est.peak_tensor_bytes == pytest.approx(expected, abs=2)
    assert activations_per_token(n) == pytest.approx(a)


def test_seed000_phase_order_and_colours_vocabulary() -> None:
    assert PHASES == ("load", "forward", "backward", "optimizer_step")


# ---- seed 001: Linear(1024, 1024, bias=False) + AdamW ------------------------------------------
LINEAR = ([], [(1024, 1024)], [])


def test_seed001_adamw_state_and_step_temporaries() -> None:
    foreach = optimizer_cost("adamw", "foreach", LINEAR, 1, 4)
    assert foreach.state_bytes == 8_388_608  # first step: +8,388,608 B
    assert foreach.step_temporary_bytes == 4_194_304  # 1× the layer (foreach, torch's CUDA default)
    assert optimizer_cost("adamw", "single-tensor", LINEAR, 1, 4).step_temporary_bytes == 8_388_608  # 2×
    assert optimizer_cost("adamw", "fused", LINEAR, 1, 4).step_temporary_bytes == 0


# ---- seed 002: bytes per parameter ----------------------------------------------------------
def _per_param(setup: TrainingSetup, phase: str, obj: str) -> float:
    return estimate(setup).phases[phase].objects[obj] / setup.num_params


def test_seed002_bytes_per_parameter() -> None:
    spec = preset_spec("llama-3.1-8b")
    mixed = TrainingSetup(model=spec, precision="mixed", **ZERO)
    # 6 B/param while the 16-bit compute copy exists: every matmul weight (not the embedding table,
    # not the norms) gets a 2-byte copy beside the 4-byte master.
    forward = estimate(mixed).phases["forward"].objects["parameters"]
    assert forward == 4 * spec.num_params + 2 * spec.matmul_weight_params
    assert 5.8 < forward / spec.num_params <= 6.0
    assert _per_param(mixed, "optimizer_step", "parameters") == 4
    assert _per_param(mixed, "optimizer_step", "optimizer_state") == pytest.approx(8, abs=1e-9)
    assert _per_param(mixed, "optimizer_step", "gradients") == 4
    bnb = mixed.with_changes(optimizer="adamw-8bit")
    assert 2.0 <= _per_param(bnb, "optimizer_step", "optimizer_state") < 2.05  # quantised Adam ≈ 2 B/param


# ---- seed 003: 200M parameters, fp32, Adam --------------------------------------------------
def test_seed003_200m_fp32_adam_800_800_1600_mb() -> None:
    est = estimate(TrainingSetup(params=200_000_000, precision="fp32", optimizer="adam", **ZERO))
    step = est.phases["optimizer_step"].objects
    assert step["parameters"] == 800_000_000
    assert step["gradients"] == 800_000_000
    assert step["optimizer_state"] == 1_600_000_000


def test_seed003_checkpointing_saves_activations() -> None:
    spec = preset_spec("llama-3.2-1b")
    base = TrainingSetup(model=spec, batch=8, seq=2048, precision="fp32", **ZERO)
    full = estimate(base).details["saved_activations_bytes"]
    ckpt = estimate(base.with_changes(checkpointing="full")).details["saved_activations_bytes"]
    assert ckpt < 0.5 * full  # seed 003: checkpointing saves 40–60 % or more of the activations


# ---- seed 004: the ledger's rules and reconciliation ----------------------------------------
def test_seed004_ledger_rules() -> None:
    with pytest.raises(LedgerError):
        PhaseLedger("load", {"parameters": 10, "activations": 1})
    with pytest.raises(LedgerError):
        PhaseLedger("forward", {"parameters": -1})
    spec = preset_spec("qwen2.5-0.5b")
    est = estimate(TrainingSetup(model=spec, batch=4, seq=1024))
    for phase in est.phases.values():
        assert phase.total_bytes == sum(phase.objects.values())
        assert all(v >= 0 for v in phase.objects.values())
    assert est.peak_bytes == max(p.total_bytes for p in est.phases.values())
    assert est.dominant_object == max(est.peak.objects, key=est.peak.objects.__getitem__)
    assert set(k for k, v in est.phases["load"].objects.items() if v) <= {"parameters", "cuda_context",
                                                                          "allocator_reserve"}


def test_seed004_micro_batch_and_accumulation_trade() -> None:
    spec = preset_spec("qwen2.5-0.5b")
    big = TrainingSetup(model=spec, batch=16, seq=64 * 8, grad_accum=1, **ZERO)
    small = big.with_changes(batch=4, grad_accum=4)
    assert big.effective_batch == small.effective_batch
    acts = lambda s: estimate(s).details["saved_activations_bytes"]  # noqa: E731
    assert acts(small) < acts(big)


def test_seed004_reconciliation_signals() -> None:
    mib = 2**20
    peak = 20 * mib  # the seed's ledger peaks at ~19 MiB
    r = reconcile(peak, peak + 3 * mib, peak + 10 * mib, peak + 11 * mib)
    assert r.estimate_difference_bytes == 3 * mib
    assert r.allocator_gap_bytes == 7 * mib
    assert r.budget_margin_bytes == 1 * mib
    assert set(r.signals) == {"inspect_estimate_difference", "inspect_allocator_retained_space",
                              "capacity_pressure"}
    below = reconcile(20, 18, 19, 30)
    assert below.estimate_difference_bytes == -2
    for bad in ((20, 22, 21, 30), (20, 22, 31, 30), (20, float("nan"), 25, 30)):
        with pytest.raises(InputError):
            reconcile(*bad)


def test_unsupported_architecture_is_not_silently_estimated() -> None:
    with pytest.raises(InputError):
        spec_from_config({"model_type": "t5"})
