"""GaLore AdamW (``--optimizer galore-adamw [--galore-rank R]``): galore-torch's GaLoreAdamW on the attention and MLP
linears, as Trainer's ``galore_adamw`` runs it. Real CPU steps with the package check the state byte for byte and
the step's peak, including a projection refresh (an SVD of each gradient every ``update_proj_gap`` steps)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import OnDemand, sample

from bench.techniques import FAMILIES
from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.finetune import FineTuning
from memcalc_gui.core.model import block_preset_names, preset_spec, spec_from_config
from memcalc_gui.core.optimizer import galore
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.solver import levers

#: (family, precision, rank): ranks below and above the k/v projections' smaller side (128)
CASES = [("llama", "fp32", 64), ("llama", "mixed", 32), ("llama", "bf16", 64), ("qwen2-tied", "mixed", 200),
         ("qwen2-tied", "bf16", 200)]


def test_refusals_name_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    spec = preset_spec("llama-3.2-1b")
    for kwargs, field, words in (
            (dict(model=preset_spec("gpt2")), "optimizer", "Conv1D"),
            (dict(model=spec, tuning=FineTuning(method="lora")), "optimizer", "full fine-tuning"),
            (dict(model=spec, parallel=Parallelism(gpus=2, strategy="ddp")), "optimizer", "one GPU"),
            (dict(params=10**9), "optimizer", "architecture"),
            (dict(model=spec, optimizer_in_backward=True), "optimizer_in_backward", "layer-wise"),
            (dict(model=spec, galore_rank=0), "galore_rank", "positive")):
        with pytest.raises(InputError, match=words) as exc:
            TrainingSetup(optimizer="galore-adamw", **kwargs)  # type: ignore[arg-type]
        assert exc.value.field == field
    with pytest.raises(SystemExit) as exit_:
        cli_main(["estimate", "--preset", "llama-3.2-1b", "--galore-rank", "64"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--galore-rank" in err and "galore-adamw" in err and len(err.strip().splitlines()) == 1


def test_state_formula_of_one_matrix() -> None:
    """A 4096 × 1024 projected weight at rank 128: moments of 4096 × 128 each; the projection keeps the whole
    1024 × 1024 SVD factor for an fp32 gradient, a 128 × 1024 copy for a bf16 one."""
    layout: tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]] = ([], [(4096, 1024)], [])
    assert galore(layout, 1, 4, 128).state_bytes == 2 * 4096 * 128 * 4 + 1024 * 1024 * 4
    assert galore(layout, 1, 2, 128).state_bytes == 2 * 4096 * 128 * 2 + 128 * 1024 * 2
    assert galore(layout, 1, 2, 4096).state_bytes == 2 * 4096 * 1024 * 2 + 1024 * 1024 * 2  # rank ≤ min side
    vector: tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]] = ([], [(1024, 1)], [])
    assert galore(vector, 1, 4, 128).state_bytes == 2 * 1024 * 4  # norms keep AdamW's moments


@pytest.mark.parametrize("name", [n for n in block_preset_names() if preset_spec(n).family != "gpt2"])
def test_galore_keeps_less_state_than_adamw(name: str) -> None:
    spec = preset_spec(name)
    for precision in ("mixed", "bf16"):
        adamw = TrainingSetup(model=spec, precision=precision)  # type: ignore[arg-type]
        a = estimate(adamw, "analytic").phases["optimizer_step"].objects["optimizer_state"]
        g = estimate(adamw.with_changes(optimizer="galore-adamw"), "analytic").phases["optimizer_step"]
        assert g.objects["optimizer_state"] < a, precision


@settings(max_examples=30, deadline=None)
@given(rank=st.integers(1, 2048), extra=st.integers(1, 2048), precision=st.sampled_from(["fp32", "mixed", "bf16"]))
def test_a_higher_rank_never_keeps_less(rank: int, extra: int, precision: str) -> None:
    spec = preset_spec("qwen2.5-0.5b")
    low = TrainingSetup(model=spec, optimizer="galore-adamw", galore_rank=rank, precision=precision)  # type: ignore
    high = low.with_changes(galore_rank=rank + extra)
    assert estimate(low, "analytic").peak_bytes <= estimate(high, "analytic").peak_bytes


def test_galore_is_a_lever_and_a_cli_choice(capsys: pytest.CaptureFixture[str]) -> None:
    setup = TrainingSetup(model=preset_spec("llama-3.1-8b"), precision="bf16")
    assert any(lv.key == "optimizer-galore" for lv in levers(setup))
    assert not any(lv.key == "optimizer-galore" for lv in levers(TrainingSetup(model=preset_spec("gpt2"))))
    assert cli_main(["estimate", "--preset", "llama-3.2-1b", "--optimizer", "galore_adamw", "--galore-rank", "256",
                     "--json"]) == 0
    out = capsys.readouterr().out
    assert '"galore_rank": 256' in out and "GaLore" in out


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("galore_torch")


def _setup(family: str, precision: str, rank: int) -> TrainingSetup:
    return TrainingSetup(model=spec_from_config(FAMILIES[family]), batch=2, seq=64, precision=precision,  # type: ignore
                         optimizer="galore-adamw", galore_rank=rank, optimizer_impl="single-tensor",
                         target_device="cpu")


@pytest.fixture(scope="module")
def measured() -> OnDemand[tuple[str, str, int], tuple[object, object]]:
    """Each case's two real steps (steady, and the projection refreshed), measured when a test first asks."""
    from memcalc_gui.measure.cpu_step import measure_training_step

    def steps(case: tuple[str, str, int]) -> tuple[object, object]:
        family, precision, rank = case
        kw = dict(batch=2, seq=64, precision=precision, optimizer="galore-adamw", galore_rank=rank)
        steady = measure_training_step(FAMILIES[family], **kw)  # type: ignore[arg-type]
        refresh = measure_training_step(FAMILIES[family], galore_gap=1, **kw)  # type: ignore[arg-type]
        return steady, refresh

    return OnDemand(steps)


@pytest.mark.parametrize("case", sample(CASES, (1,), single=True), ids=[f"{f}-{p}-r{r}" for f, p, r in CASES])
def test_analytic_matches_real_galore_steps(case: tuple[str, str, int], measured: dict) -> None:
    """The state is exact (a step without a refresh); every phase's peak is within 3 % of a step that refreshes
    the projection, the worst step, which recurs every 200 steps."""
    steady, refresh = measured[case]
    est = estimate(_setup(*case), "analytic")
    assert est.phases["optimizer_step"].objects["optimizer_state"] == \
        steady.phases["optimizer_step"].objects["optimizer_state"]
    for phase in ("forward", "backward", "optimizer_step"):
        real, predicted = refresh.phases[phase].peak_bytes, est.phases[phase].tensor_bytes
        assert abs(predicted - real) <= 0.03 * real, (phase, predicted, real)
    assert steady.phases["optimizer_step"].peak_bytes <= refresh.phases["optimizer_step"].peak_bytes


def test_the_trace_runs_a_refreshing_step(measured: dict) -> None:
    from memcalc_gui.trace.fake import trace_estimate

    case = CASES[1]
    traced = trace_estimate(_setup(*case).with_changes(target_device="cuda")).estimate
    _, refresh = measured[case]
    for phase in ("forward", "backward", "optimizer_step"):
        real = refresh.phases[phase].peak_bytes
        assert abs(traced.phases[phase].tensor_bytes - real) <= 0.01 * real, phase
