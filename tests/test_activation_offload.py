"""Activation offloading (``--activation-offload``): the decoder body's saved tensors in host memory, as
``torch.autograd.graph.save_on_cpu`` (``all``) and torchtune's OffloadActivations with checkpointing
(``checkpoint-inputs``) do it. Real CPU steps run the saved-tensor hooks; the analytic ledger, the trace and the host
bytes agree with them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import OnDemand, sample

from bench.techniques import FAMILIES
from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.finetune import FineTuning
from memcalc_gui.core.fitted import signature
from memcalc_gui.core.model import block_preset_names, preset_spec, spec_from_config
from memcalc_gui.core.result import evaluate
from memcalc_gui.core.setup import TrainingSetup, find_gpu
from memcalc_gui.core.solver import levers

#: Small vocabularies and wide MLPs: the layers' activations, which offloading moves, dominate the step.
CONFIGS = FAMILIES
#: (family, precision, checkpointing, offload)
CASES = [("llama", "fp32", "none", "all"), ("llama", "mixed", "full", "checkpoint-inputs"),
         ("llama", "bf16", "full", "all"), ("qwen2-tied", "mixed", "none", "all"),
         ("qwen2-tied", "bf16", "full", "checkpoint-inputs"), ("gpt2", "mixed", "none", "all"),
         ("gpt2", "fp32", "full", "checkpoint-inputs")]


def _setup(family: str, precision: str, ckpt: str, offload: str) -> TrainingSetup:
    return TrainingSetup(model=spec_from_config(CONFIGS[family]), batch=4, seq=256, precision=precision,  # type: ignore
                         optimizer_impl="single-tensor", checkpointing=ckpt, activation_offload=offload,  # type: ignore
                         target_device="cpu")


def test_refusals_name_the_field() -> None:
    spec = preset_spec("llama-3.2-1b")
    with pytest.raises(InputError, match="full checkpointing") as exc:
        TrainingSetup(model=spec, activation_offload="checkpoint-inputs")
    assert exc.value.field == "activation_offload"
    with pytest.raises(InputError, match="every N-th"):
        TrainingSetup(model=spec, checkpointing="every:2", activation_offload="all")
    with pytest.raises(InputError, match="full fine-tuning"):
        TrainingSetup(model=spec, activation_offload="all", tuning=FineTuning(method="lora"))
    with pytest.raises(InputError):
        TrainingSetup(model=spec, activation_offload="sometimes")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="trace"):  # the fitted method does not fit host memory
        signature(TrainingSetup(model=spec, activation_offload="all"))


def test_cli_flag_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["estimate", "--preset", "llama-3.2-1b", "--activation-offload", "checkpoint-inputs"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--activation-offload" in err and "full checkpointing" in err and len(err.strip().splitlines()) == 1
    assert cli_main(["estimate", "--preset", "llama-3.2-1b", "--batch", "4", "--seq", "2048", "--checkpointing",
                     "full", "--activation-offload", "checkpoint-inputs", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["setup"]["activation_offload"] == "checkpoint-inputs"
    spec = preset_spec("llama-3.2-1b")
    # the checkpointed layers' inputs: one fp32 hidden state per layer, plus the final norm's saved tensors
    assert data["host_bytes"] >= spec.num_layers * 4 * 2048 * spec.hidden_size * 4


@pytest.mark.parametrize("name", block_preset_names())
def test_offloading_never_raises_the_peak_it_lowers(name: str) -> None:
    spec = preset_spec(name)
    for precision in ("mixed", "bf16"):
        plain = TrainingSetup(model=spec, batch=2, seq=1024, precision=precision)  # type: ignore[arg-type]
        ckpt = plain.with_changes(checkpointing="full")
        for before, after in ((plain, plain.with_changes(activation_offload="all")),
                              (ckpt, ckpt.with_changes(activation_offload="checkpoint-inputs"))):
            a, b = estimate(before, "analytic"), estimate(after, "analytic")
            for phase in ("forward", "backward"):
                assert b.phases[phase].tensor_bytes <= a.phases[phase].tensor_bytes, (phase, after.activation_offload)
            assert b.details["host_bytes"] > 0 and a.details["host_bytes"] == 0


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(block_preset_names()), batch=st.integers(1, 64), seq=st.integers(1, 32768),
       mode=st.sampled_from(["all", "checkpoint-inputs"]))
def test_host_bytes_grow_with_the_tokens(name: str, batch: int, seq: int, mode: str) -> None:
    setup = TrainingSetup(model=preset_spec(name), batch=batch, seq=seq, checkpointing="full" if mode != "all"
                          else "none", activation_offload=mode)  # type: ignore[arg-type]
    one = estimate(setup, "analytic").details["host_bytes"]
    two = estimate(setup.with_changes(batch=batch + 1), "analytic").details["host_bytes"]
    assert 0 < one < two


def test_a_lever_that_needs_checkpointing_brings_it() -> None:
    spec = preset_spec("llama-3.1-8b")
    plain = {lv.key: lv for lv in levers(TrainingSetup(model=spec))}
    assert plain["checkpointing-offload"].changes == {"checkpointing": "full",
                                                      "activation_offload": "checkpoint-inputs"}
    assert "offload-activations-all" in plain
    ckpt = {lv.key for lv in levers(TrainingSetup(model=spec, checkpointing="full"))}
    assert "offload-checkpoint-inputs" in ckpt and "checkpointing-offload" not in ckpt


def test_the_issue_example_gets_a_fit_on_one_gpu_at_its_micro_batch() -> None:
    """Llama-3.1-8B full fine-tuning at micro-batch 8 × 4096 on one H100: beside sharding over more GPUs, a set of
    techniques that fits the one GPU at micro-batch 8, with the host memory it leaves."""
    gpu = find_gpu("h100-80gb")
    setup = TrainingSetup(model=preset_spec("llama-3.1-8b"), batch=8, seq=4096, gpu=gpu.id,
                          capacity_bytes=gpu.capacity_bytes)
    result = evaluate(setup, "analytic")
    assert result.verdict.fits is False
    fixes = [s for s in result.verdict.suggestions if s.fits]
    here = [s for s in fixes if s.key.startswith("fix-here:")]
    assert here, [s.title for s in fixes]
    local = here[0]
    assert "gpus" not in local.changes and "batch" not in local.changes
    assert local.peak_bytes <= gpu.capacity_bytes
    assert any(s.host_bytes > 0 for s in result.verdict.suggestions)  # the offloading rows say their host memory
    assert any("strategy" in s.changes for s in fixes)  # and sharding across more GPUs


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def measured() -> OnDemand[tuple[str, str, str, str], object]:
    """Each case's real step, measured when a test first asks."""
    from memcalc_gui.measure.cpu_step import measure_training_step

    return OnDemand(lambda case: measure_training_step(
        CONFIGS[case[0]], batch=4, seq=256, precision=case[1], optimizer_impl="single-tensor",
        checkpointing=case[2], activation_offload=case[3]))


@pytest.mark.parametrize("case", sample(CASES, (1,), single=True), ids=["-".join(c) for c in CASES])
def test_analytic_matches_a_real_offloaded_step(case: tuple[str, str, str, str], measured: dict) -> None:
    m = measured[case]
    est = estimate(_setup(*case), "analytic")
    for phase in ("forward", "backward", "optimizer_step"):
        real, predicted = m.phases[phase].peak_bytes, est.phases[phase].tensor_bytes
        assert abs(predicted - real) <= 0.03 * real, (phase, predicted, real)
    assert m.host_bytes > 0
    assert abs(est.details["host_bytes"] - m.host_bytes) <= 0.05 * m.host_bytes, (est.details["host_bytes"],
                                                                                  m.host_bytes)


@pytest.mark.full_suite
@pytest.mark.parametrize("case", CASES[:3], ids=["-".join(c) for c in CASES[:3]])
def test_offloading_lowers_the_real_peak(case: tuple[str, str, str, str], measured: dict) -> None:
    from memcalc_gui.measure.cpu_step import measure_training_step

    family, precision, ckpt, _ = case
    plain = measure_training_step(CONFIGS[family], batch=4, seq=256, precision=precision,
                                  optimizer_impl="single-tensor", checkpointing=ckpt)
    m = measured[case]
    assert m.phases["forward"].peak_bytes < plain.phases["forward"].peak_bytes
    assert m.phases["backward"].peak_bytes <= plain.phases["backward"].peak_bytes


@pytest.mark.parametrize("case", CASES[:2], ids=["-".join(c) for c in CASES[:2]])
def test_the_fake_tensor_trace_runs_the_same_hooks(case: tuple[str, str, str, str], measured: dict) -> None:
    from memcalc_gui.measure.cpu_step import measure_training_step
    from memcalc_gui.trace.fake import unpacked_sequences

    family, precision, ckpt, offload = case
    with unpacked_sequences():  # as the trace runs it: no attention mask built for unpadded sequences
        fake = measure_training_step(CONFIGS[family], batch=4, seq=256, precision=precision,
                                     optimizer_impl="single-tensor", checkpointing=ckpt, activation_offload=offload,
                                     fake=True)
    real = measured[case]
    assert fake.host_bytes == real.host_bytes
    for phase in ("forward", "backward"):
        real_peak = real.phases[phase].peak_bytes
        assert abs(fake.phases[phase].peak_bytes - real_peak) <= 0.01 * real_peak


def test_offloaded_gradients_are_those_of_a_plain_step() -> None:
    """The hooks move tensors, not values: the same loss and gradients as without them."""
    from memcalc_gui.measure.cpu_step import build_model, offload_hooks, step_forward
    from memcalc_gui.measure.tracker import LiveStorageTracker

    grads = []
    for mode in ("none", "all"):
        torch.manual_seed(0)
        model = build_model(CONFIGS["llama"], precision="fp32")
        ids = torch.randint(0, 512, (2, 64))
        tracker = LiveStorageTracker()
        hooks = offload_hooks(model, tracker, mode) if mode != "none" else []
        with tracker:
            step_forward(model, ids, "fp32").backward()
        for h in hooks:
            h.remove()
        tracker.close()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
