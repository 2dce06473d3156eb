"""The analytic ledger against real CPU training steps measured by the live-storage tracker.

Small configs of several families; the target is ±3 % on the peak (bench/accuracy.py prints the
full table). Most cases agree to the byte on every phase: the block is counted tensor by tensor.
"""

from __future__ import annotations

import pytest
from tiers import sample

from bench.accuracy import FAMILIES, FROZEN_CASES, LORA_CASES, QLORA_CASES
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.model import spec_from_config
from memcalc_gui.core.setup import TrainingSetup

# The fine-tuning bench cases run here in part (every family, precision, dropout and checkpointing is still
# covered); ``python bench/accuracy.py --tuning`` runs them all.
CI_LORA_CASES = [c for i, c in enumerate(LORA_CASES) if i % 2 == 0 or c[1] == "bf16-autocast" or c[4] == "full"]
CI_QLORA_CASES = [c for c in QLORA_CASES if c[0] == "llama" or c[1] == "bf16"]
CI_FROZEN_CASES = FROZEN_CASES[1::2]

pytest.importorskip("torch")
pytest.importorskip("transformers")

CASES = [
    ("llama", 2, 64, "fp32", "sdpa", "none", 1),
    ("qwen2", 2, 64, "mixed", "sdpa", "none", 1),
    ("gpt2", 2, 64, "mixed", "eager", "none", 1),
    ("phi3", 1, 128, "bf16", "sdpa", "none", 1),
    ("gemma", 2, 64, "mixed", "sdpa", "full", 1),
    ("gpt_neox", 2, 64, "fp32", "sdpa", "none", 2),
    ("llama-wide", 4, 128, "mixed", "sdpa", "none", 1),
    ("phi", 2, 64, "mixed", "sdpa", "none", 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_analytic_within_3_percent_of_measured(case: tuple) -> None:
    from memcalc_gui.measure.cpu_step import measure_training_step

    fam, b, s, prec, att, ck, acc = case
    cfg = FAMILIES[fam]
    m = measure_training_step(cfg, batch=b, seq=s, precision=prec, attention=att, checkpointing=ck,
                              grad_accum=acc, optimizer="adamw", optimizer_impl="single-tensor")
    est = estimate(TrainingSetup(model=spec_from_config(cfg), batch=b, seq=s, precision=prec, attention=att,
                                 checkpointing=ck, grad_accum=acc, optimizer_impl="single-tensor"))
    assert est.peak_tensor_bytes == pytest.approx(m.peak_bytes, rel=0.03)
    for phase in ("forward", "backward", "optimizer_step"):
        assert est.phases[phase].tensor_bytes == pytest.approx(m.phases[phase].peak_bytes, rel=0.05), phase
    assert est.phases["load"].tensor_bytes == pytest.approx(m.phases["load"].live_bytes, rel=0.001)


@pytest.mark.parametrize(("fam", "b", "prec", "acc"), [("llama-wide", 2, "fp32", 2), ("gpt2-wide", 1, "mixed", 4)])
def test_an_accumulating_mlp_backward_has_its_weight_gradient_and_its_products_gradients_apart(
        fam: str, b: int, prec: str, acc: int) -> None:
    """With accumulation the down projection's weight gradient is added into .grad before the product's backward
    makes its I-wide gradients: MLP-heavy models peak in a layer's backward within 0.5 % (counting both at one
    moment read +1.25 % and −1.48 %)."""
    from memcalc_gui.measure.cpu_step import measure_training_step

    cfg = FAMILIES[fam]
    m = measure_training_step(cfg, batch=b, seq=64, precision=prec, grad_accum=acc, optimizer="adamw",
                              optimizer_impl="single-tensor")
    est = estimate(TrainingSetup(model=spec_from_config(cfg), batch=b, seq=64, precision=prec, grad_accum=acc,
                                 optimizer_impl="single-tensor"))
    assert est.phases["backward"].tensor_bytes == pytest.approx(m.phases["backward"].peak_bytes, rel=0.005)


EMBEDDING_HEAVY = {"model_type": "qwen2", "vocab_size": 32000, "hidden_size": 128, "intermediate_size": 256,
                   "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "max_position_embeddings": 512}


ACCUMULATION_CASES = [pytest.param(layers, acc, prec, tied, id=f"{layers}-{acc}-{prec}-{'tied' if tied else 'untied'}")
                      for tied in (True, False) for prec in ("mixed", "fp32", "bf16")
                      for layers, acc in ((1, 2), (2, 3), (1, 1))]


# the default suite: the tied head accumulating under autocast (the case behind the test), and one untied in fp32
@pytest.mark.parametrize(("layers", "acc", "prec", "tied"), sample(ACCUMULATION_CASES, (1, 14)))
def test_accumulation_with_an_embedding_heavy_model(tied: bool, prec: str, layers: int, acc: int) -> None:
    """Gradient accumulation × tied embeddings × few layers (the window's scaled-down measurement of Qwen2.5-1.5B
    was 11 % over the estimate in backward: the tied head's summed gradient is a third vocabulary-sized temporary
    when .grad already exists, and under autocast the head's 16-bit copy is gone when its gradient is cast)."""
    from memcalc_gui.measure.cpu_step import measure_training_step

    cfg = {**EMBEDDING_HEAVY, "tie_word_embeddings": tied, "num_hidden_layers": layers}
    m = measure_training_step(cfg, batch=1, seq=64, precision=prec, grad_accum=acc, optimizer_impl="foreach")
    est = estimate(TrainingSetup(model=spec_from_config(cfg), batch=1, seq=64, precision=prec, grad_accum=acc))
    for phase in ("forward", "backward", "optimizer_step"):
        assert est.phases[phase].tensor_bytes == pytest.approx(m.phases[phase].peak_bytes, rel=0.01), phase


CACHE_CASES = [
    ("gpt2", "fp32", "sdpa"), ("gpt2", "mixed", "eager"), ("llama", "mixed", "sdpa"), ("llama", "fp32", "eager"),
    ("phi3", "mixed", "sdpa"), ("phi3", "bf16", "eager"), ("gpt_neox", "mixed", "sdpa"), ("gemma", "bf16", "sdpa"),
    ("qwen2", "mixed", "eager"), ("phi", "fp32", "eager"),
]


@pytest.mark.parametrize("case", sample(CACHE_CASES, (2,), single=True), ids=lambda c: "-".join(c))
def test_use_cache_true_agrees_with_a_measured_step(case: tuple) -> None:
    """A loop that keeps the config's use_cache=True: transformers' DynamicCache copies k and v in forward. The
    analytic ledger follows it within 1 % per phase (without the cache the same setups differ measurably)."""
    from memcalc_gui.measure.cpu_step import measure_training_step

    fam, prec, att = case
    cfg = FAMILIES[fam]
    kw = dict(batch=2, seq=64, precision=prec, attention=att, optimizer_impl="single-tensor")
    m = measure_training_step(cfg, use_cache=True, **kw)
    setup = TrainingSetup(model=spec_from_config(cfg), use_cache=True, **kw)
    est = estimate(setup)
    for phase in ("forward", "backward", "optimizer_step"):
        assert est.phases[phase].tensor_bytes == pytest.approx(m.phases[phase].peak_bytes, rel=0.01), phase
    assert any("use_cache=True" in a for a in est.assumptions)
    if (fam, prec) in (("gpt2", "fp32"), ("llama", "mixed")):
        plain = estimate(setup.with_changes(use_cache=False))
        assert plain.phases["forward"].tensor_bytes != est.phases["forward"].tensor_bytes


def test_use_cache_changes_nothing_under_checkpointing() -> None:
    """transformers hands checkpointed layers no cache (modeling_layers.GradientCheckpointingLayer)."""
    cfg = FAMILIES["gpt2"]
    setup = TrainingSetup(model=spec_from_config(cfg), batch=2, seq=64, checkpointing="full")
    assert estimate(setup.with_changes(use_cache=True)).phases == estimate(setup).phases




@pytest.mark.parametrize("case", sample(CI_LORA_CASES, (0,), single=True), ids=lambda c: "-".join(map(str, c)))
def test_lora_step_agrees_with_a_real_peft_step(case: tuple) -> None:
    """LoRA through peft on a real CPU step: frozen base, fp32 adapters, per-module input casts, dropout masks
    (CPU: in the input dtype), checkpointing. The analytic ledger is within 3 % on every phase."""
    pytest.importorskip("peft")
    from memcalc_gui.core.finetune import FineTuning
    from memcalc_gui.measure.cpu_step import measure_training_step

    fam, prec, targets, dropout, ck, rank = case
    cfg = FAMILIES[fam]
    tuning = FineTuning(method="lora", rank=rank, targets=tuple(targets.split(",")), dropout=dropout)
    kw = dict(batch=2, seq=128, precision=prec, optimizer_impl="single-tensor", checkpointing=ck)
    m = measure_training_step(cfg, tuning=tuning, **kw)
    est = estimate(TrainingSetup(model=spec_from_config(cfg), tuning=tuning, target_device="cpu", **kw))
    for phase in ("forward", "backward", "optimizer_step"):
        assert est.phases[phase].tensor_bytes == pytest.approx(m.phases[phase].peak_bytes, rel=0.03), phase
    full = estimate(TrainingSetup(model=spec_from_config(cfg), target_device="cpu", **kw))
    assert est.peak_tensor_bytes < full.peak_tensor_bytes




@pytest.mark.parametrize("case", CI_FROZEN_CASES, ids=lambda c: "-".join(c))
def test_frozen_parts_agree_with_a_real_step(case: tuple) -> None:
    """Only some parts train (requires_grad on the named parts): the layers below keep nothing, frozen layers
    above trainable norms or embeddings keep what input gradients need. Within 3 % on every phase."""
    from memcalc_gui.core.finetune import FineTuning
    from memcalc_gui.measure.cpu_step import measure_training_step

    fam, prec, parts = case
    cfg = FAMILIES[fam]
    tuning = FineTuning(method="frozen", trainable=tuple(parts.split(",")))
    kw = dict(batch=2, seq=128, precision=prec, optimizer_impl="single-tensor")
    m = measure_training_step(cfg, tuning=tuning, **kw)
    est = estimate(TrainingSetup(model=spec_from_config(cfg), tuning=tuning, target_device="cpu", **kw))
    for phase in ("forward", "backward", "optimizer_step"):
        assert est.phases[phase].tensor_bytes == pytest.approx(m.phases[phase].peak_bytes, rel=0.03), phase


@pytest.mark.parametrize("case", sample(CI_QLORA_CASES, (0,), single=True), ids=lambda c: "-".join(map(str, c)))
def test_qlora_step_agrees_with_a_real_bitsandbytes_step(case: tuple) -> None:
    """QLoRA as users build it (transformers' BitsAndBytesConfig, peft's prepare_model_for_kbit_training and
    get_peft_model) on a real CPU step: the resident base equals the quantized-storage count to 0.1 %, and every
    phase is within 3 % (Phi-3's fused gate_up under autocast within 4 %: its chunked projection is followed
    less closely)."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from memcalc_gui.core.finetune import FineTuning
    from memcalc_gui.measure.cpu_step import measure_training_step

    fam, prec, quant, dropout, ck, prepare = case
    cfg = FAMILIES[fam]
    tuning = FineTuning(method="qlora", rank=8, quant=quant, dropout=dropout, prepare_kbit=prepare)
    kw = dict(batch=2, seq=128, precision=prec, optimizer_impl="single-tensor", checkpointing=ck)
    m = measure_training_step(cfg, tuning=tuning, **kw)
    est = estimate(TrainingSetup(model=spec_from_config(cfg), tuning=tuning, target_device="cpu", **kw))
    assert est.phases["load"].tensor_bytes == pytest.approx(m.phases["load"].live_bytes, rel=0.001)
    tolerance = 0.04 if fam == "phi3" else 0.03
    for phase in ("forward", "backward", "optimizer_step"):
        assert est.phases[phase].tensor_bytes == pytest.approx(m.phases[phase].peak_bytes, rel=tolerance), phase


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_eager_attention_past_a_thousand_tokens(precision: str) -> None:
    """Eager attention's L×L scores outgrow the loss's logits past a few hundred tokens: the forward peak moves into
    the last layer's softmax (a bf16 model's with its fp32 upcast of the scores). Found while checking sliding windows
    (issue 62): a Llama of hidden 128 at 1,024 tokens read 12.9 % under in fp32 and 9.9 % in bf16."""
    from memcalc_gui.measure.cpu_step import measure_training_step

    cfg = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0)
    real = measure_training_step(cfg, batch=1, seq=1024, precision=precision, attention="eager",
                                 optimizer_impl="single-tensor")
    est = estimate(TrainingSetup(model=spec_from_config(cfg), batch=1, seq=1024, precision=precision,
                                 attention="eager", optimizer_impl="single-tensor", target_device="cpu"))
    for phase in ("forward", "backward"):
        assert est.phases[phase].tensor_bytes == pytest.approx(real.phases[phase].peak_bytes, rel=0.03), phase
