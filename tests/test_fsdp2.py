"""FSDP2 (``--strategy fsdp2 [--reshard-after-forward on|off]``): the per-GPU ledger moment by moment, checked
against real sharded steps — ``fully_shard`` over 2 and 4 CPU processes on PyTorch's gloo backend, each rank
measured with the live-storage tracker."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import sample

from bench.techniques import FAMILIES
from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.model import block_preset_names, preset_spec, spec_from_config
from memcalc_gui.core.setup import TrainingSetup

CONFIGS = FAMILIES  # small vocabularies and wide MLPs
#: (family, ranks, precision, reshard after forward, checkpointing): a few real runs (about 10 s each)
CASES = [("llama", 2, "fp32", True, "none"), ("llama", 4, "mixed", False, "full"), ("gpt2", 2, "mixed", True, "none"),
         ("llama", 2, "bf16", True, "full")]


def _setup(family: str, ranks: int, precision: str, reshard: bool, ckpt: str) -> TrainingSetup:
    return TrainingSetup(model=spec_from_config(CONFIGS[family]), batch=4, seq=256, precision=precision,  # type: ignore
                         optimizer_impl="single-tensor", checkpointing=ckpt, target_device="cpu",
                         parallel=Parallelism(gpus=ranks, strategy="fsdp2", reshard_after_forward=reshard))


def test_reshard_is_fsdp2s_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InputError, match="FSDP2") as exc:
        Parallelism(gpus=8, strategy="fsdp-full-shard", reshard_after_forward=False)
    assert exc.value.field == "reshard_after_forward"
    with pytest.raises(SystemExit) as exit_:
        cli_main(["estimate", "--preset", "llama-3.2-1b", "--gpus", "8", "--reshard-after-forward", "off"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--reshard-after-forward" in err and len(err.strip().splitlines()) == 1
    assert cli_main(["estimate", "--preset", "llama-3.2-1b", "--gpus", "8", "--strategy", "fsdp2",
                     "--reshard-after-forward", "off"]) == 0
    assert "not resharded after forward" in capsys.readouterr().out


@pytest.mark.parametrize("name", block_preset_names())
def test_keeping_layers_gathered_never_lowers_the_peak(name: str) -> None:
    spec = preset_spec(name)
    for precision in ("mixed", "bf16"):
        on = TrainingSetup(model=spec, batch=2, seq=1024, precision=precision,  # type: ignore[arg-type]
                           parallel=Parallelism(gpus=8, strategy="fsdp2"))
        off = on.with_changes(parallel=Parallelism(gpus=8, strategy="fsdp2", reshard_after_forward=False))
        a, b = estimate(on, "analytic"), estimate(off, "analytic")
        for phase in ("forward", "backward"):
            assert b.phases[phase].tensor_bytes >= a.phases[phase].tensor_bytes
        assert b.phases["optimizer_step"].tensor_bytes == a.phases["optimizer_step"].tensor_bytes


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(block_preset_names()), gpus=st.integers(2, 512), batch=st.integers(1, 16),
       ckpt=st.sampled_from(["none", "full"]))
def test_more_gpus_never_raise_the_fsdp2_peak(name: str, gpus: int, batch: int, ckpt: str) -> None:
    setup = TrainingSetup(model=preset_spec(name), batch=batch, seq=2048, checkpointing=ckpt,
                          parallel=Parallelism(gpus=gpus, strategy="fsdp2"))
    more = setup.with_changes(parallel=Parallelism(gpus=gpus * 2, strategy="fsdp2"))
    assert estimate(more, "analytic").peak_bytes <= estimate(setup, "analytic").peak_bytes


def test_the_issue_example_offers_fsdp2() -> None:
    from memcalc_gui.core.result import evaluate
    from memcalc_gui.core.setup import find_gpu

    gpu = find_gpu("h100-80gb")
    result = evaluate(TrainingSetup(model=preset_spec("llama-3.1-8b"), batch=8, seq=4096, gpu=gpu.id,
                                    capacity_bytes=gpu.capacity_bytes), "analytic")
    assert any(s.changes.get("strategy") == "fsdp2" for s in result.verdict.suggestions), \
        [s.title for s in result.verdict.suggestions]


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not torch.distributed.is_available():  # pragma: no cover - every CPU wheel has gloo
    pytest.skip("torch.distributed is not available", allow_module_level=True)


@pytest.mark.parametrize("case", sample(CASES, (0, 1), single=True), ids=["-".join(map(str, c)) for c in CASES])
def test_the_ledger_matches_every_rank_of_a_real_fsdp2_step(case: tuple) -> None:
    from memcalc_gui.measure.distributed import measure_sharded_step

    family, ranks, precision, reshard, ckpt = case
    measured = measure_sharded_step(CONFIGS[family], world=ranks, reshard_after_forward=reshard, batch=4, seq=256,
                                    precision=precision, optimizer_impl="single-tensor", checkpointing=ckpt)
    assert len(measured) == ranks
    est = estimate(_setup(*case), "analytic")
    # now and then a rank still holds the root unit's gathered weights during the optimizer step (gloo finishes the
    # root's collectives on its own thread; seen about once in ten runs): the step may exceed the ledger by that much,
    # under mixed precision by the all-gather's output and the bf16 weights made from it (twice the bf16 size, seen
    # once in CI)
    root = spec_from_config(CONFIGS[family]).root_unit_params * (4 if precision == "fp32" else 2)
    for phase in ("forward", "backward", "optimizer_step"):
        predicted = est.phases[phase].tensor_bytes
        for m in measured:  # every rank holds the same shard sizes here
            real = m.phases[phase].peak_bytes
            late = (0, root, 2 * root) if phase == "optimizer_step" else (0,)
            assert min(abs(predicted + extra - real) for extra in late) <= 0.03 * real, (phase, predicted, real)
    step = measured[0].phases["optimizer_step"].objects
    # the sharded state: 1/N of the fp32 (bf16) weights, gradients and Adam's two moments (plus its step counters)
    assert step["optimizer_state"] == pytest.approx(est.phases["optimizer_step"].objects["optimizer_state"], rel=1e-4)
    assert step["gradients"] == pytest.approx(est.phases["optimizer_step"].objects["gradients"], rel=1e-3)
