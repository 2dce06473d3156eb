"""Method trace: the training step on fake tensors gives the measured ledger without allocating."""

from __future__ import annotations

import pytest
from tiers import sample

from bench.accuracy import FAMILIES
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.model import spec_from_config
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc_gui.trace.fake import TraceCancelled, TraceError, group_modules, trace_estimate

CASES = [("llama", "mixed", "sdpa", "none"), ("gpt2", "fp32", "eager", "none"), ("qwen3", "bf16", "sdpa", "full"),
         ("phi3", "mixed", "sdpa", "none"), ("gpt_neox", "mixed", "sdpa", "none")]


def _setup(fam: str, prec: str, att: str, ck: str) -> TrainingSetup:
    return TrainingSetup(model=spec_from_config(FAMILIES[fam]), batch=2, seq=128, precision=prec, attention=att,
                         checkpointing=ck, optimizer_impl="single-tensor", cuda_context_bytes=0,
                         allocator_reserve=0.0)


@pytest.mark.parametrize("case", sample(CASES, (0,), single=True), ids=lambda c: "-".join(c))
def test_trace_equals_real_cpu_measurement(case: tuple[str, str, str, str]) -> None:
    from memcalc_gui.measure.cpu_step import measure_training_step

    fam, prec, att, ck = case
    setup = _setup(*case)
    traced = trace_estimate(setup)
    real = measure_training_step(FAMILIES[fam], batch=2, seq=128, precision=prec, attention=att, checkpointing=ck,
                                 optimizer_impl="single-tensor", iterations=2)
    assert traced.estimate.method == "trace"
    for phase in PHASES:
        measured = real.phases[phase].live_bytes if phase == "load" else real.phases[phase].peak_bytes
        # the trace adds CUDA's 512-byte rounding on top of the exact bytes
        assert traced.estimate.phases[phase].tensor_bytes == pytest.approx(measured, rel=0.01), phase
        assert traced.estimate.phases[phase].tensor_bytes >= measured
    # ... and agrees with the analytic ledger within the analytic target
    assert traced.estimate.peak_tensor_bytes == pytest.approx(estimate(setup).peak_tensor_bytes, rel=0.03)
    assert traced.modules and traced.modules[0][1] > 0


def test_big_model_traces_without_allocating() -> None:
    from memcalc_gui.core.model import preset_spec

    setup = TrainingSetup(model=preset_spec("qwen2.5-7b"), batch=1, seq=1024)
    traced = trace_estimate(setup)
    assert traced.estimate.peak_tensor_bytes > 100 * 2**30  # far more than this machine has
    assert abs(traced.difference_pct()["optimizer_step"]) < 0.1
    assert traced.result().verdict.fits is None  # no capacity given


def test_family_without_analytic_model_is_traced() -> None:
    cfg = {"model_type": "olmo", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "pad_token_id": 1, "eos_token_id": 2,
           "bos_token_id": None}
    setup = TrainingSetup(params=10**6, batch=2, seq=32)
    traced = trace_estimate(setup, config=cfg)
    assert traced.estimate.peak_tensor_bytes > 0 and traced.analytic is None


def test_failures_are_clear() -> None:
    with pytest.raises(TraceError, match="model_type"):
        trace_estimate(TrainingSetup(params=10**6), config={"model_type": "no-such-model", "hidden_size": 8})
    with pytest.raises(TraceError, match="Lion"):
        trace_estimate(_setup("llama", "fp32", "sdpa", "none").with_changes(optimizer="lion"))
    steps: list[str] = []
    with pytest.raises(TraceCancelled):
        trace_estimate(_setup("llama", "fp32", "sdpa", "none"), progress=steps.append,
                       should_stop=lambda: len(steps) >= 3)


def test_module_grouping() -> None:
    rows = group_modules([("model.layers.0.mlp", 10), ("model.layers.1.mlp", 10), ("LlamaForCausalLM", 5),
                          ("lm_head", 7)])
    assert rows == [("model.layers.*.mlp", 20), ("lm_head", 7), ("loss and logits (LlamaForCausalLM)", 5)]


@pytest.mark.full_suite
def test_trace_of_a_sharded_setup_is_per_gpu() -> None:
    from memcalc_gui.core.distributed import Parallelism
    from memcalc_gui.core.model import preset_spec

    setup = TrainingSetup(model=preset_spec("qwen2.5-0.5b"), batch=2, seq=256, capacity_bytes=16 * 2**30,
                          parallel=Parallelism(gpus=8, strategy="zero3", offload="optimizer"))
    traced = trace_estimate(setup)
    single = estimate(setup.with_changes(parallel=Parallelism()))
    assert traced.estimate.peak_tensor_bytes < single.peak_tensor_bytes
    assert traced.estimate.phases["optimizer_step"].objects["optimizer_state"] == 0  # offloaded
    for phase, diff in traced.difference_pct().items():
        assert abs(diff) < 1, phase
    plan = traced.result().plan
    assert plan is not None and plan.min_gpus["zero3"] is not None


@pytest.mark.full_suite
@pytest.mark.parametrize("impl", ["foreach", "single-tensor"])
@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_adafactor_traces_and_matches_analytic_and_measured(fam: str, impl: str) -> None:
    """Adafactor reads norms with ``.item()``, which fake tensors cannot answer; the trace reads them as 1 (memory
    does not depend on them). Trace and analytic both match a real CPU step."""
    from memcalc_gui.measure.cpu_step import measure_training_step

    setup = TrainingSetup(model=spec_from_config(FAMILIES[fam]), batch=2, seq=64, precision="mixed",
                          optimizer="adafactor", optimizer_impl=impl, cuda_context_bytes=0, allocator_reserve=0.0)
    traced = trace_estimate(setup).estimate
    analytic = estimate(setup)
    real = measure_training_step(FAMILIES[fam], batch=2, seq=64, precision="mixed", optimizer="adafactor",
                                 optimizer_impl=impl, iterations=2)
    for phase in ("forward", "backward", "optimizer_step"):
        measured = real.phases[phase].peak_bytes
        assert traced.phases[phase].tensor_bytes == pytest.approx(measured, rel=0.01), phase
        assert analytic.phases[phase].tensor_bytes == pytest.approx(measured, rel=0.01), phase


def test_frozen_parts_trace_like_the_analytic_ledger() -> None:
    """Frozen parts trace like full training with requires_grad off."""
    from memcalc_gui.core.finetune import FineTuning

    spec = spec_from_config(FAMILIES["gpt2"])
    frozen = TrainingSetup(model=spec, batch=2, seq=128, precision="fp32", optimizer_impl="single-tensor",
                           tuning=FineTuning(method="frozen", trainable=("last:1",)))
    traced = trace_estimate(frozen).estimate
    analytic = estimate(frozen)
    for phase in ("forward", "backward", "optimizer_step"):
        assert analytic.phases[phase].tensor_bytes == pytest.approx(traced.phases[phase].tensor_bytes, rel=0.01)


def test_lora_traces_peft_adapters_like_a_real_step() -> None:
    """peft wraps the fake model (adapters moved to the base dtype and back to fp32, dropout per module): the traced
    ledger equals a real peft step within 1 % per phase; QLoRA, which quantizes real weights while loading, says
    why it cannot be traced."""
    pytest.importorskip("peft")
    from memcalc_gui.core.finetune import FineTuning
    from memcalc_gui.measure.cpu_step import measure_training_step

    lora = FineTuning(method="lora", rank=8, targets=("q_proj", "v_proj", "down_proj"), dropout=0.05)
    setup = _setup("qwen2", "bf16", "sdpa", "none").with_changes(tuning=lora, target_device="cpu")
    traced = trace_estimate(setup).estimate
    real = measure_training_step(FAMILIES["qwen2"], batch=2, seq=128, precision="bf16",
                                 optimizer_impl="single-tensor", tuning=lora)
    for phase in PHASES:
        measured = real.phases[phase].live_bytes if phase == "load" else real.phases[phase].peak_bytes
        assert traced.phases[phase].tensor_bytes == pytest.approx(measured, rel=0.01), phase
    # fp32 Adam moments of the adapters only, plus one step counter per adapter tensor (512 B once rounded)
    moments = 2 * 4 * lora.trainable_params(setup.model)
    adapter_tensors = 2 * 3 * 3  # lora_A and lora_B on three modules in each of three layers
    assert traced.phases["optimizer_step"].objects["optimizer_state"] == moments + 512 * adapter_tensors
    with pytest.raises(TraceError, match="analytic ledger"):
        trace_estimate(setup.with_changes(tuning=FineTuning(method="qlora")))
