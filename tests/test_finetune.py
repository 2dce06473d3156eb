"""Fine-tuning's parameter side against the libraries themselves: peft's adapters, bitsandbytes' storage."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.accuracy import FAMILIES
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.finetune import FineTuning, layer_linears, quantized_tensor_bytes
from memcalc_gui.core.model import spec_from_config
from memcalc_gui.core.resources import load_json

TARGET_CASES = [
    ("llama", ("all-linear",)), ("llama", ("q_proj", "v_proj")), ("llama", ("attention",)), ("qwen2", ("mlp",)),
    ("gpt2", ("all-linear",)), ("gpt2", ("c_attn",)), ("gpt2", ("c_proj",)), ("phi3", ("all-linear",)),
    ("phi3", ("qkv_proj", "o_proj")), ("gpt_neox", ("all-linear",)), ("phi", ("all-linear",)), ("gemma", ("up",)),
    ("qwen3", ("q", "k", "v", "o")),
]


@pytest.mark.parametrize(("family", "targets"), TARGET_CASES, ids=lambda v: v if isinstance(v, str) else ",".join(v))
def test_adapter_parameters_equal_what_peft_adds(family: str, targets: tuple[str, ...]) -> None:
    """get_peft_model on the real transformers model adds exactly r·(d_in + d_out) per adapted linear; all-linear
    leaves the output head alone, as peft does."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from memcalc_gui.measure.cpu_step import build_model

    cfg = FAMILIES[family]
    tuning = FineTuning(method="lora", rank=8, targets=targets, dropout=0.0)
    model = build_model(cfg)
    target_modules = "all-linear" if targets == ("all-linear",) else [
        lin.name.rsplit(".", 1)[-1] for lin in tuning.adapted(spec_from_config(cfg))]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=target_modules, lora_dropout=0.0))
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert tuning.adapter_params(spec_from_config(cfg)) == trainable
    assert tuning.trainable_params(spec_from_config(cfg)) == trainable
    assert all(p.dtype.is_floating_point for p in wrapped.parameters())


def test_layer_linears_cover_every_layer_weight_matrix() -> None:
    """The named linears of a layer hold all of its matrix weights (what QLoRA quantizes)."""
    for name in ("llama-3.1-8b", "phi-3-mini", "gpt2", "pythia-1b", "phi-2", "gemma-2b", "qwen3-0.6b"):
        spec = spec_from_config(load_json(f"models/{name}.json"))
        matrices = sum(lin.weight_params for lin in layer_linears(spec))
        h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim
        assert matrices == h * (q + 2 * kv) + q * h + (3 if spec.gated_mlp else 2) * h * i, name


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("shape", [(4096, 4096), (129, 100), (3, 5), (1, 64), (256, 65)])
def test_4bit_storage_equals_what_bitsandbytes_allocates(shape: tuple[int, int], double_quant: bool) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnbf

    weight = torch.randn(*shape, dtype=torch.bfloat16)
    for quant in ("nf4", "fp4"):
        packed, state = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=double_quant, quant_type=quant)
        tensors = [packed, state.absmax, state.code]
        if state.nested:
            tensors += [state.state2.absmax, state.state2.code, state.offset]
        allocated = sum(t.untyped_storage().nbytes() for t in tensors)
        assert quantized_tensor_bytes(weight.numel(), quant, double_quant) == allocated, (quant, shape)


def test_qlora_base_is_about_half_a_byte_per_weight() -> None:
    spec = spec_from_config(load_json("models/llama-3.1-8b.json"))
    nf4 = FineTuning(method="qlora")
    per_weight = nf4.quantized_bytes(spec) / nf4.quantized_params(spec)
    assert per_weight == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256), abs=2e-4)  # ≈ 0.516 B
    plain = FineTuning(method="qlora", double_quant=False)
    assert plain.quantized_bytes(spec) / plain.quantized_params(spec) == pytest.approx(0.5625, abs=2e-4)
    int8 = FineTuning(method="qlora", quant="int8")
    assert 1.0 < int8.quantized_bytes(spec) / int8.quantized_params(spec) < 1.001
    assert FineTuning().quantized_bytes(spec) == 0 == FineTuning(method="lora").quantized_params(spec)


def test_frozen_parts_count_what_they_name() -> None:
    spec = spec_from_config(load_json("models/llama-3.1-8b.json"))
    last4 = FineTuning(method="frozen", trainable=("last:4",))
    assert last4.trainable_params(spec) == 4 * spec.layer_params
    everything = FineTuning(method="frozen", trainable=(f"last:{spec.num_layers}", "norms", "lm_head", "embeddings"))
    norms = spec.num_layers * spec.norms_per_layer * spec.hidden_size + spec.hidden_size
    assert everything.trainable_params(spec) == spec.num_params + norms - norms  # every part once
    tied = spec_from_config(load_json("models/qwen2.5-0.5b.json"))
    both = FineTuning(method="frozen", trainable=("lm_head", "embeddings"))
    assert tied.tied_embeddings and both.trainable_params(tied) == tied.vocab_size * tied.hidden_size


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(method="dora"), "tuning"), (dict(rank=0), "lora_rank"), (dict(rank=True), "lora_rank"),
    (dict(targets=()), "lora_targets"), (dict(dropout=1.0), "lora_dropout"), (dict(dropout=-0.1), "lora_dropout"),
    (dict(adapter_dtype="fp8"), "adapter_dtype"), (dict(quant="nf2"), "quant"),
    (dict(method="frozen"), "trainable"), (dict(method="frozen", trainable=("last:0",)), "trainable"),
    (dict(method="frozen", trainable=("bottom",)), "trainable"),
])
def test_bad_fine_tuning_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InputError) as err:
        FineTuning(**kwargs)
    assert err.value.field == field


def test_targets_that_match_nothing_name_the_linears() -> None:
    spec = spec_from_config(load_json("models/gpt2.json"))
    with pytest.raises(InputError, match="c_attn") as err:
        FineTuning(method="lora", targets=("q_proj",)).adapted(spec)
    assert err.value.field == "lora_targets"


@settings(max_examples=60, deadline=None)
@given(rank=st.integers(1, 512), name=st.sampled_from(["llama-3.1-8b", "gpt2", "phi-3-mini", "pythia-1b"]))
def test_adapters_grow_with_rank_and_stay_below_the_model(rank: int, name: str) -> None:
    spec = spec_from_config(load_json(f"models/{name}.json"))
    small, large = FineTuning(method="lora", rank=rank), FineTuning(method="lora", rank=rank + 1)
    assert 0 < small.adapter_params(spec) < large.adapter_params(spec)
    assert small.adapter_params(spec) == rank * (large.adapter_params(spec) - small.adapter_params(spec))
    if rank <= 64:
        assert small.trainable_params(spec) < spec.num_params / 10


@pytest.mark.parametrize("method", ["lora", "qlora", "frozen"])
def test_ddp_with_a_tuned_model_buckets_only_trainable_gradients(method: str) -> None:
    """DDP registers hooks (and buckets) for parameters that require gradients only: per GPU, a LoRA, QLoRA or
    partly frozen run is its single-GPU ledger plus one more copy of the trainable gradients — not of the base."""
    from memcalc_gui.core.distributed import Parallelism
    from memcalc_gui.core.estimate import estimate
    from memcalc_gui.core.model import preset_spec
    from memcalc_gui.core.setup import TrainingSetup

    tuning = FineTuning(method=method, trainable=("lm_head",) if method == "frozen" else ())
    one = TrainingSetup(model=preset_spec("llama-3.2-1b"), batch=2, seq=512, tuning=tuning)
    single = estimate(one)
    per_gpu = estimate(one.with_changes(parallel=Parallelism(gpus=8, strategy="ddp")))
    trainable = single.phases["optimizer_step"].objects["gradients"]
    assert 0 < trainable < one.model.num_params * 4 // 4  # type: ignore[union-attr]
    for phase in ("forward", "backward", "optimizer_step"):
        a, b = single.phases[phase].objects, per_gpu.phases[phase].objects
        assert b["gradients"] == a["gradients"] + trainable
        assert {k: v for k, v in b.items() if k not in ("gradients", "allocator_reserve")} == \
            {k: v for k, v in a.items() if k not in ("gradients", "allocator_reserve")}
    assert per_gpu.phases["load"].objects == single.phases["load"].objects
