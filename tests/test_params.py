"""Exact parameter counts: the analytic count equals transformers' sum(p.numel()) on the meta device."""

from __future__ import annotations

import pytest

from memcalc_gui.core.errors import ConfigError, UnsupportedFamilyError
from memcalc_gui.core.model import (
    preset_config,
    preset_for_hub_id,
    preset_info,
    preset_names,
    preset_spec,
    spec_from_config,
)

# Several shapes per family, covering tied/untied embeddings, GQA, explicit head_dim, biases,
# gated vs plain MLP, LayerNorm vs RMSNorm, learned vs rotary positions and parallel residual.
SMALL = dict(vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=128,
             intermediate_size=344, num_hidden_layers=2,
             num_attention_heads=8, max_position_embeddings=256)
CONFIGS: list[dict] = [
    dict(model_type="gpt2", vocab_size=1000, n_embd=128, n_layer=2, n_head=4, n_positions=256),
    dict(model_type="gpt2", vocab_size=999, n_embd=96, n_layer=3, n_head=6, n_positions=64, n_inner=200,
         tie_word_embeddings=False),
    # both GPT-2's names and the common ones (transformers builds from the common ones: its attribute_map maps them
    # after GPT2Config's own arguments; memcalc read n_layer and measured a model of 3,667 layers as one of 2)
    dict(model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128, hidden_size=96,
         num_hidden_layers=5, num_attention_heads=6, max_position_embeddings=64),
    dict(SMALL, model_type="llama"),
    dict(SMALL, model_type="llama", num_key_value_heads=2, tie_word_embeddings=True),
    dict(SMALL, model_type="llama", num_key_value_heads=4, head_dim=32, attention_bias=True, mlp_bias=True),
    dict(SMALL, model_type="mistral", num_key_value_heads=2),
    dict(SMALL, model_type="mistral", num_key_value_heads=8, head_dim=24, tie_word_embeddings=True),
    dict(SMALL, model_type="qwen2", num_key_value_heads=2),
    dict(SMALL, model_type="qwen2", num_key_value_heads=4, tie_word_embeddings=True),
    dict(SMALL, model_type="qwen3", num_key_value_heads=2, head_dim=32),
    dict(SMALL, model_type="qwen3", num_key_value_heads=4),  # head_dim defaults to 128, not hidden/heads
    dict(SMALL, model_type="qwen3", num_key_value_heads=4, head_dim=16, attention_bias=True,
         tie_word_embeddings=True),
    dict(SMALL, model_type="phi3"),
    dict(SMALL, model_type="phi3", num_key_value_heads=2, tie_word_embeddings=True),
    dict(SMALL, model_type="gemma", num_key_value_heads=1, head_dim=32),
    dict(SMALL, model_type="gemma", num_key_value_heads=8, head_dim=16, attention_bias=True,
         tie_word_embeddings=False),
    dict(SMALL, model_type="gpt_neox"),
    dict(SMALL, model_type="gpt_neox", use_parallel_residual=False, attention_bias=False,
         tie_word_embeddings=True, rotary_pct=0.5),
    dict(SMALL, model_type="phi"),
    dict(SMALL, model_type="phi", num_key_value_heads=2, qk_layernorm=True, tie_word_embeddings=True),
]


def _transformers_count(cfg: dict) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c["model_type"])
def test_count_matches_transformers(cfg: dict) -> None:
    assert spec_from_config(cfg).num_params == _transformers_count(cfg)


@pytest.mark.parametrize("name", preset_names())
def test_preset_count_matches_transformers(name: str) -> None:
    """Block-model presets count their tensors; the others store the count the window lists without torch — both
    equal transformers' model on the meta device (and so does the MoE active count)."""
    cfg = {k: v for k, v in preset_config(name).items() if not k.startswith("_")}
    info = preset_info(name)
    assert info.num_params == _transformers_count(cfg)
    if info.block_model:
        assert preset_spec(name).num_params == info.num_params == info.active_params
    else:
        from memcalc_gui.trace.meta import count_params_and_active_on_meta

        assert (info.num_params, info.active_params) == count_params_and_active_on_meta(cfg)


def test_the_library_covers_the_families_of_the_year() -> None:
    """At least 40 presets; MoE and the families without a block model among them; each Hub id resolves to its
    preset offline."""
    names = preset_names()
    families = {preset_info(n).family for n in names}
    assert len(names) >= 40
    assert {"llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v2",
            "deepseek_v3", "gpt_oss", "gemma2", "gemma3_text", "olmo2", "phi3", "granite"} <= families
    assert preset_for_hub_id("qwen/qwen3-30b-a3b") == "qwen3-30b-a3b" and preset_for_hub_id("no/such") is None


# Published sizes of the real checkpoints (model cards / safetensors metadata).
PUBLISHED = {
    "gpt2": 124_439_808,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "phi-3-mini": 3_821_079_552,
    "pythia-1b": 1_011_781_632,
    "gemma-2b": 2_506_172_416,
}


@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_presets_have_published_sizes(name: str, count: int) -> None:
    assert preset_spec(name).num_params == count


# Sizes as the model cards (or the Hub's safetensors summary) round them, for presets whose exact count is not quoted:
# a wrong width or depth in a preset moves the count by far more than the rounding.
CARD_SIZES = {
    "llama-3.1-405b": 405.9e9, "llama-3.3-70b": 70.6e9, "tinyllama-1.1b": 1.10e9, "smollm2-1.7b": 1.71e9,
    "qwen2.5-3b": 3.09e9, "qwen2.5-14b": 14.7e9, "qwen2.5-32b": 32.8e9, "qwen2.5-72b": 72.7e9, "qwen3-1.7b": 1.72e9,
    "qwen3-4b": 4.02e9, "qwen3-8b": 8.19e9, "qwen3-14b": 14.8e9, "qwen3-32b": 32.8e9, "mistral-nemo-12b": 12.2e9,
    "mistral-small-24b": 23.6e9, "phi-3-medium": 14.0e9, "phi-4": 14.7e9, "gemma-7b": 8.54e9,
}


@pytest.mark.parametrize("name,size", sorted(CARD_SIZES.items()))
def test_presets_have_their_model_card_sizes(name: str, size: float) -> None:
    assert preset_spec(name).num_params == pytest.approx(size, rel=0.005)


# Presets of families without a block model: (total, active) as the model cards round them. Active counts include
# the embedding table and LM head (Mixtral's and Qwen's cards count them; gpt-oss's card leaves one of the two out,
# 3.6B and 5.1B, so its counts here are the card's plus vocab × hidden).
MOE_CARD_SIZES = {
    "mixtral-8x7b": (46.7e9, 12.9e9), "qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9),
    "qwen1.5-moe-a2.7b": (14.3e9, 2.7e9), "olmoe-1b-7b": (6.9e9, 1.3e9), "deepseek-v2-lite": (15.7e9, 2.7e9),
    "deepseek-v3": (671e9, 37.5e9), "gpt-oss-20b": (20.9e9, 3.6e9 + 201088 * 2880),
    "gpt-oss-120b": (116.8e9, 5.1e9 + 201088 * 2880), "gemma-2-2b": (2.61e9, 2.61e9), "gemma-2-9b": (9.24e9, 9.24e9),
    "gemma-2-27b": (27.2e9, 27.2e9), "gemma-3-1b": (1.0e9, 1.0e9), "olmo-2-1b": (1.48e9, 1.48e9),
    "olmo-2-7b": (7.30e9, 7.30e9), "olmo-2-13b": (13.7e9, 13.7e9), "granite-3.1-8b": (8.17e9, 8.17e9),
}


@pytest.mark.parametrize("name,sizes", sorted(MOE_CARD_SIZES.items()))
def test_new_family_presets_have_their_model_card_sizes(name: str, sizes: tuple[float, float]) -> None:
    info = preset_info(name)
    assert not info.block_model
    assert info.num_params == pytest.approx(sizes[0], rel=0.005)
    assert info.active_params == pytest.approx(sizes[1], rel=0.03)


def test_unknown_family_names_supported_ones() -> None:
    with pytest.raises(UnsupportedFamilyError) as info:
        spec_from_config({"model_type": "mamba", "hidden_size": 8})
    assert "mamba" in str(info.value) and "llama" in str(info.value)
    assert info.value.field == "model_type"


@pytest.mark.parametrize(
    "cfg,field",
    [
        ({}, "model_type"),
        ([1, 2], "config"),
        ({"model_type": "llama", "hidden_size": 64}, "num_attention_heads"),
        (dict(SMALL, model_type="llama", hidden_size=-4), "hidden_size"),
        (dict(SMALL, model_type="llama", hidden_size="big"), "hidden_size"),
        (dict(SMALL, model_type="llama", num_key_value_heads=3), "num_key_value_heads"),
        (dict(SMALL, model_type="llama", tie_word_embeddings="yes"), "tie_word_embeddings"),
        (dict(SMALL, model_type="llama", num_attention_heads=7), "num_attention_heads"),
        # GPT-2's heads come from whichever name the config sets (the common one first, as transformers reads it)
        ({"model_type": "gpt2", "vocab_size": 64, "n_embd": 64, "n_layer": 1, "n_head": 3}, "n_head"),
        ({"model_type": "gpt2", "vocab_size": 64, "n_embd": 64, "n_layer": 1, "n_head": 4, "num_attention_heads": 3},
         "num_attention_heads"),
    ],
)
def test_bad_configs_name_the_field(cfg: object, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        spec_from_config(cfg)
    assert info.value.field == field


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(ConfigError, match=r"did you mean qwen2\.5-1\.5b.*memcalc presets"):
        preset_spec("qwen2.5-1.5")
    with pytest.raises(ConfigError, match=r"memcalc presets` lists all"):
        preset_spec("no-such-model")
