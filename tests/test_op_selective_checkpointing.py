"""Per-op selective checkpointing (``--checkpointing selective``, torchtitan's op policy): every layer checkpointed,
its attention kernel's output and every other matrix product's output kept. Real CPU steps run the policy through
``torch.utils.checkpoint``'s selective contexts; the analytic ledger and the trace agree with them."""

from __future__ import annotations

import pytest
from tiers import OnDemand, sample

from bench.techniques import FAMILIES
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.model import block_preset_names, preset_spec, spec_from_config
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.solver import levers

#: Wide MLPs and small vocabularies: the layers' kept tensors decide the peaks.
CONFIGS = FAMILIES
CASES = [(family, precision) for family in CONFIGS for precision in ("fp32", "mixed", "bf16")]


def test_refusals_and_the_lever() -> None:
    spec = preset_spec("llama-3.2-1b")
    with pytest.raises(InputError, match="SDPA") as exc:
        TrainingSetup(model=spec, checkpointing="selective", attention="eager")
    assert exc.value.field == "checkpointing"
    from memcalc_gui.core.finetune import FineTuning

    with pytest.raises(InputError, match="full fine-tuning"):
        TrainingSetup(model=spec, checkpointing="selective", tuning=FineTuning(method="lora"))
    keys = {lv.key for lv in levers(TrainingSetup(model=spec))}
    assert "checkpointing-selective" in keys


@pytest.mark.parametrize("name", block_preset_names())
def test_selective_lies_between_none_and_full(name: str) -> None:
    spec = preset_spec(name)
    for precision in ("mixed", "bf16"):
        base = TrainingSetup(model=spec, batch=2, seq=2048, precision=precision)  # type: ignore[arg-type]
        peaks = [estimate(base.with_changes(checkpointing=c), "analytic").phases["forward"].tensor_bytes
                 for c in ("full", "selective", "none")]
        assert peaks[0] <= peaks[1] <= peaks[2], peaks


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def measured() -> OnDemand:
    """Each case's real step, measured when a test first asks."""
    from memcalc_gui.measure.cpu_step import measure_training_step

    return OnDemand(lambda case: measure_training_step(CONFIGS[case[0]], batch=4, seq=256, precision=case[1],
                                                       optimizer_impl="single-tensor", checkpointing="selective"))


@pytest.mark.parametrize("case", sample(CASES, (1,), single=True), ids=["-".join(c) for c in CASES])
def test_analytic_matches_a_real_selective_step(case: tuple[str, str], measured: dict) -> None:
    m = measured[case]
    est = estimate(TrainingSetup(model=spec_from_config(CONFIGS[case[0]]), batch=4, seq=256,
                                 precision=case[1], optimizer_impl="single-tensor",  # type: ignore[arg-type]
                                 checkpointing="selective", target_device="cpu"), "analytic")
    for phase in ("forward", "backward", "optimizer_step"):
        real, predicted = m.phases[phase].peak_bytes, est.phases[phase].tensor_bytes
        assert abs(predicted - real) <= 0.03 * real, (phase, predicted, real)


@pytest.mark.full_suite
def test_the_policy_keeps_what_it_says(measured: dict) -> None:
    """Between none and full on real steps too: it keeps more than full checkpointing, less than none."""
    from memcalc_gui.measure.cpu_step import measure_training_step

    cfg = CONFIGS["llama"]
    runs = {c: measure_training_step(cfg, batch=4, seq=256, precision="fp32", optimizer_impl="single-tensor",
                                     checkpointing=c).phases["forward"].peak_bytes for c in ("none", "full")}
    sac = measured[("llama", "fp32")].phases["forward"].peak_bytes
    assert runs["full"] < sac < runs["none"]


@pytest.mark.parametrize("case", CASES[:2], ids=["-".join(c) for c in CASES[:2]])
def test_the_trace_runs_the_same_policy(case: tuple[str, str], measured: dict) -> None:
    from memcalc_gui.measure.cpu_step import measure_training_step
    from memcalc_gui.trace.fake import unpacked_sequences

    with unpacked_sequences():
        fake = measure_training_step(CONFIGS[case[0]], batch=4, seq=256, precision=case[1],
                                     optimizer_impl="single-tensor", checkpointing="selective", fake=True)
    for phase in ("forward", "backward"):
        real = measured[case].phases[phase].peak_bytes
        assert abs(fake.phases[phase].peak_bytes - real) <= 0.01 * real
