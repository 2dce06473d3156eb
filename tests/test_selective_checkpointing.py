"""Checkpointing every N-th layer (``--checkpointing every:N``, torchtitan's selective layer checkpointing): real CPU
steps run it (transformers' per-layer switch), the analytic ledger and the trace agree with them."""

from __future__ import annotations

import pytest
from tiers import sample

from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.finetune import FineTuning
from memcalc_gui.core.model import block_preset_names, preset_spec, spec_from_config
from memcalc_gui.core.setup import TrainingSetup, checkpoint_every
from memcalc_gui.core.solver import levers

COMMON = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=1024)
# small vocabularies: the decoder layers, not the loss, decide the peaks
CONFIGS = {
    "llama": dict(COMMON, model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=1024,
                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2),
    "gpt2": dict(model_type="gpt2", vocab_size=256, n_embd=256, n_layer=6, n_head=4, n_positions=1024),
    "qwen2-tied": dict(COMMON, model_type="qwen2", vocab_size=256, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}
CASES = [("llama", "fp32", "every:2", 1), ("llama", "mixed", "every:3", 2), ("llama", "bf16", "every:2", 1),
         ("gpt2", "mixed", "every:2", 1), ("gpt2", "fp32", "every:3", 2), ("qwen2-tied", "mixed", "every:2", 2)]


def test_values() -> None:
    assert [checkpoint_every(v) for v in ("none", "full", "every:1", "every:4")] == [None, 1, 1, 4]
    for bad in ("every:0", "every:x", "half", "", 3):
        with pytest.raises(InputError, match="every:N"):
            checkpoint_every(bad)
    with pytest.raises(InputError, match="full fine-tuning"):
        TrainingSetup(model=preset_spec("llama-3.2-1b"), checkpointing="every:2", tuning=FineTuning(method="lora"))
    keys = {lv.key for lv in levers(TrainingSetup(model=preset_spec("llama-3.2-1b")))}
    assert {"checkpointing", "checkpointing-every-2"} <= keys


@pytest.mark.parametrize("name", block_preset_names())
def test_every_other_layer_lies_between_none_and_full(name: str) -> None:
    """Checkpointing more layers never raises the peak: none ≥ every:3 ≥ every:2 ≥ full, and every:1 is full."""
    base = TrainingSetup(model=preset_spec(name), batch=2, seq=2048)
    peaks = [estimate(base.with_changes(checkpointing=c), "analytic").peak_bytes
             for c in ("none", "every:3", "every:2", "full")]
    assert peaks == sorted(peaks, reverse=True)
    assert estimate(base.with_changes(checkpointing="every:1"), "analytic").peak_bytes == peaks[-1]


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize(("family", "precision", "ckpt", "accum"), sample(CASES, (5,)))
def test_analytic_and_trace_agree_with_real_steps(family: str, precision: str, ckpt: str, accum: int) -> None:
    from memcalc_gui.measure.cpu_step import measure_training_step
    from memcalc_gui.trace.fake import trace_estimate

    cfg = CONFIGS[family]
    kw = dict(batch=4, seq=256, precision=precision, optimizer_impl="single-tensor", checkpointing=ckpt,
              grad_accum=accum)
    real = measure_training_step(cfg, **kw)  # type: ignore[arg-type]
    if (family, precision) in (("llama", "fp32"), ("gpt2", "mixed")):  # the switch really applies per layer
        full = measure_training_step(cfg, **dict(kw, checkpointing="full"))  # type: ignore[arg-type]
        none = measure_training_step(cfg, **dict(kw, checkpointing="none"))  # type: ignore[arg-type]
        assert full.peak_bytes < real.peak_bytes < none.peak_bytes
    setup = TrainingSetup(model=spec_from_config(cfg), target_device="cpu", **kw)  # type: ignore[arg-type]
    est = estimate(setup, "analytic")
    for phase in ("forward", "backward", "optimizer_step"):
        assert est.phases[phase].tensor_bytes == pytest.approx(real.phases[phase].peak_bytes, rel=0.02), phase
    traced = trace_estimate(setup.with_changes(cuda_context_bytes=0, allocator_reserve=0.0)).estimate
    assert traced.peak_tensor_bytes == pytest.approx(real.peak_bytes, rel=0.01)
