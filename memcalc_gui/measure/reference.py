"""Built-in reference decoders: the llama-like families without transformers, op for op.

The measurement engine builds its model with transformers when it is installed. Without it, this
module builds the same model from the config dict: the same modules, parameters (names, shapes,
order, tying), buffers and -- what matters for a memory measurement -- the same ATen ops in the same
order with the same Python lifetimes, so that a live-storage tracker sees the same tensors live at
every moment (checked byte for byte against transformers in tests/test_reference_modules.py).

Mirrored from transformers 5 (``models/{llama,mistral,qwen2,qwen3,gemma,phi3}/modeling_*.py``,
``integrations/sdpa_attention.py``, ``masking_utils.py``, ``loss/loss_utils.py``):

* RMSNorm upcasts to fp32 and casts back before the weight (Gemma: ``(1 + weight)`` in fp32, cast at
  the end); rotary tables are computed in fp32 from ``position_ids`` and cast to the hidden dtype;
  rotary applied elementwise (``q * cos + rotate_half(q) * sin``; Phi-3: on a slice, with ``cat``);
* SDPA with ``is_causal=True`` and ``enable_gqa`` when no mask is needed (no padding: the engine's
  case), else the mask transformers builds (sliding window shorter than the sequence) with
  ``repeat_kv``; eager attention with the float causal mask, fp32 softmax, ``dropout`` and the
  contiguous copies;
* the loss is ``ForCausalLMLoss``: fp32 logits, labels padded with -100 then shifted, mean
  cross-entropy;
* activation checkpointing checkpoints each decoder layer's ``forward`` (module hooks stay outside)
  with ``torch.utils.checkpoint.checkpoint`` and the given kwargs (non-reentrant by default).

Weights are random (normal, std ``initializer_range``), never downloaded. ``torch`` is imported
only inside functions: importing this module does not import it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache, partial
from types import SimpleNamespace
from typing import Any

#: Families the reference modules implement (the llama-like decoders).
REFERENCE_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")
#: Attention implementations the reference modules implement.
REFERENCE_ATTENTION: tuple[str, ...] = ("sdpa", "eager")


class ReferenceUnavailable(NotImplementedError):
    """The built-in reference modules cannot build this model: transformers is needed."""


def _unavailable(what: str) -> ReferenceUnavailable:
    return ReferenceUnavailable(
        f"{what}: the built-in reference modules implement {', '.join(REFERENCE_FAMILIES)} "
        f"with {' or '.join(REFERENCE_ATTENTION)} attention; install transformers for this family "
        "(pip install transformers)"
    )


# ---- config -----------------------------------------------------------------------------------
# The defaults of transformers' config classes (configuration_<family>.py) for the keys used here.
_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "pad_token_id": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None,
        "max_position_embeddings": 2048, "mlp_bias": False,
    },
    "mistral": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None,
        "max_position_embeddings": 4096 * 32, "sliding_window": 4096,
    },
    "qwen2": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": None,
        "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
        "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "gemma": {
        "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "pad_token_id": 0,
        "tie_word_embeddings": True,
    },
    "phi3": {
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None,
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "pad_token_id": 32000, "sliding_window": None, "resid_pdrop": 0.0,
    },
}
#: Activations by transformers' ``ACT2FN`` name (those the reference modules implement).
_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_python_tanh", "relu")


@dataclass
class ReferenceConfig:
    """The resolved architecture of a reference model (the config keys transformers reads)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    pad_token_id: int | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_parameters: dict[str, Any]
    rotary_dim: int
    sliding_window: int | None
    layer_types: list[str]
    attention_dropout: float
    resid_pdrop: float
    initializer_range: float
    _attn_implementation: str = "sdpa"
    use_cache: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rope_type(self) -> str:
        return str(self.rope_parameters.get("rope_type", "default"))


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value or value < 0:
        raise ValueError(f"config key {key!r} must be a non-negative integer, not {value!r}")
    return int(value)


def reference_config(config: Mapping[str, Any], *, attention: str = "sdpa") -> ReferenceConfig:
    """Resolve a HF ``config.json`` dict with the defaults transformers applies for the family."""
    family = str(config.get("model_type") or "").lower()
    if family not in REFERENCE_FAMILIES:
        raise _unavailable(f"model_type {config.get('model_type')!r}")
    if attention not in REFERENCE_ATTENTION:
        raise _unavailable(f"attention implementation {attention!r}")
    if config.get("use_bidirectional_attention"):
        raise _unavailable("bidirectional attention")
    raw: dict[str, Any] = {**_COMMON, **_DEFAULTS[family]}
    raw.update(config)

    def get_int(key: str) -> int:
        return _int(key, raw[key])

    hidden = get_int("hidden_size")
    heads = get_int("num_attention_heads")
    if heads < 1:
        raise ValueError("num_attention_heads must be >= 1")
    kv = raw.get("num_key_value_heads")
    kv = heads if kv is None else _int("num_key_value_heads", kv)
    if kv < 1 or heads % kv:
        raise ValueError(f"num_key_value_heads {kv} must divide num_attention_heads {heads}")
    head_dim = raw.get("head_dim")
    head_dim = hidden // heads if not head_dim else _int("head_dim", head_dim)
    layers = get_int("num_hidden_layers")

    act = str(raw.get("hidden_act") or "silu")
    if family == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"  # GemmaConfig: the legacy "gelu" means the tanh approximation
    if act not in _ACTIVATIONS:
        raise _unavailable(f"activation {act!r}")

    # rope: transformers 5 standardises rope_scaling/rope_theta into rope_parameters
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if family == "phi3":
        rope.setdefault("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if rope["rope_type"] in ("su", "yarn"):
            rope["rope_type"] = "longrope"
        rope.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    factor = float(rope.get("partial_rotary_factor", 1.0)) if family == "phi3" else 1.0
    rotary_dim = int(head_dim * factor)

    sliding = raw.get("sliding_window")
    layer_types = ["full_attention"] * layers
    if family in ("qwen2", "qwen3"):
        sliding = sliding if raw.get("use_sliding_window") else None
        given = config.get("layer_types")
        if given:
            layer_types = [str(t) for t in given]
        else:
            window_layers = _int("max_window_layers", raw["max_window_layers"])
            layer_types = [
                "sliding_attention" if sliding is not None and i >= window_layers else "full_attention"
                for i in range(layers)
            ]
    elif family in ("llama", "gemma"):
        sliding = None
    if sliding is not None:
        sliding = _int("sliding_window", sliding)

    attention_bias = bool(raw.get("attention_bias"))
    qkv_bias = {"qwen2": True, "mistral": False, "phi3": False}.get(family, attention_bias)
    o_bias = {"qwen2": False, "mistral": False, "phi3": False}.get(family, attention_bias)
    mlp_bias = bool(raw.get("mlp_bias")) if family == "llama" else False
    pad = raw.get("pad_token_id")
    return ReferenceConfig(
        model_type=family,
        vocab_size=get_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=get_int("intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_act=act,
        max_position_embeddings=get_int("max_position_embeddings"),
        rms_norm_eps=float(raw["rms_norm_eps"]),
        pad_token_id=None if pad is None else _int("pad_token_id", pad),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings")),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        rope_parameters=rope,
        rotary_dim=rotary_dim,
        sliding_window=sliding,
        layer_types=layer_types,
        attention_dropout=float(raw.get("attention_dropout") or 0.0),
        resid_pdrop=float(raw.get("resid_pdrop") or 0.0),
        initializer_range=float(raw.get("initializer_range") or 0.02),
        _attn_implementation=attention,
        extra=dict(config),
    )


def _rope_init(cfg: ReferenceConfig, seq_len: int | None = None) -> tuple[Any, float]:
    """``inv_freq`` (fp32) and the attention scaling of the rotary tables (transformers' rope inits)."""
    import torch

    rope = cfg.rope_parameters
    base = float(rope["rope_theta"])
    dim = cfg.rotary_dim
    rope_type = cfg.rope_type
    if rope_type == "longrope":
        orig = int(rope.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        factor = rope.get("factor") or cfg.max_position_embeddings / orig
        scaling = rope.get("attention_factor")
        if scaling is None:
            scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        key = "long_factor" if seq_len and seq_len > orig else "short_factor"
        ext = torch.tensor(rope.get(key) or [1.0] * (dim // 2), dtype=torch.float32)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (ext * base**shape), float(scaling)
    scaling = 1.0
    if rope_type == "default":
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, scaling
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if rope_type == "linear":
        inv_freq /= float(rope["factor"])
    elif rope_type == "llama3":
        factor = float(rope["factor"])
        low_freq_factor, high_freq_factor = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_context_len = float(rope["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    elif rope_type == "yarn":
        factor = float(rope.get("factor", 1.0))
        scaling = float(rope.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0))
    # other rope types ("dynamic", ...) start from the default frequencies; only values differ
    return inv_freq, scaling


# ---- modules ----------------------------------------------------------------------------------
@dataclass
class CausalLMOutput:
    """What the engine reads from a forward: ``loss`` (and the logits, dropped with the output)."""

    loss: Any
    logits: Any


@cache
def _classes() -> Any:
    """Define the ``torch.nn.Module`` classes on first use (torch is imported here, not at import)."""
    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import is_fake
    from torch.nn import functional as F
    from torch.utils.checkpoint import checkpoint

    class Activation(nn.Module):
        """transformers' ACT2FN entry as a module (so module-level attribution names it the same)."""

        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name
            c = math.sqrt(2.0 / math.pi)
            if name in ("silu", "swish"):
                self.act: Any = F.silu
            elif name == "gelu":
                self.act = F.gelu
            elif name == "gelu_pytorch_tanh":
                self.act = partial(F.gelu, approximate="tanh")
            elif name == "relu":
                self.act = F.relu
            elif name == "gelu_new":
                self.act = lambda x: 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))
            else:  # gelu_python_tanh
                self.act = lambda x: x * 0.5 * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(x)

        def extra_repr(self) -> str:
            return self.name

    class RMSNorm(nn.Module):
        def __init__(self, hidden_size: int, eps: float, dtype: Any) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
            self.variance_epsilon = eps

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)

    class GemmaRMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float, dtype: Any) -> None:
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

        def _norm(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            output = self._norm(x.float())
            output = output * (1.0 + self.weight.float())
            return output.type_as(x)

    class ScaledWordEmbedding(nn.Embedding):
        """Gemma: the embedding times sqrt(hidden), the scale a non-persistent buffer."""

        def __init__(self, num: int, dim: int, padding_idx: int | None, embed_scale: float, dtype: Any) -> None:
            super().__init__(num, dim, padding_idx, dtype=dtype)
            self.scalar_embed_scale = embed_scale
            self.embed_scale = nn.Buffer(torch.tensor(embed_scale, dtype=dtype), persistent=False)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)

    class RotaryEmbedding(nn.Module):
        def __init__(self, cfg: ReferenceConfig) -> None:
            super().__init__()
            self.config = cfg
            self.rope_type = cfg.rope_type
            self.max_seq_len_cached = cfg.max_position_embeddings
            self.original_max_seq_len = cfg.max_position_embeddings
            inv_freq, self.attention_scaling = _rope_init(cfg)
            self.inv_freq = nn.Buffer(inv_freq, persistent=False)
            self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

        def _update(self, position_ids: torch.Tensor) -> None:
            # transformers' dynamic_rope_update, for the two types that act at this length
            seq_len = torch.max(position_ids) + 1
            if "dynamic" in self.rope_type:
                # the two length checks (their tiny temporaries); recomputing the tables for a sequence
                # longer than max_position_embeddings is not mirrored (same sizes, other values)
                check = seq_len > self.max_seq_len_cached
                del check
                check = seq_len < self.original_max_seq_len
                del check
            elif self.rope_type == "longrope":
                orig = int(self.config.rope_parameters.get("original_max_position_embeddings") or 0)
                long_inv_freq = getattr(self, "long_inv_freq", None)
                if long_inv_freq is None:
                    long_inv_freq, _ = _rope_init(self.config, seq_len=orig + 1)
                self.long_inv_freq = long_inv_freq
                inv_freq = torch.where(seq_len > orig, long_inv_freq, self.original_inv_freq)
                self.inv_freq.copy_(inv_freq)

        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if "dynamic" in self.rope_type or self.rope_type == "longrope":
                self._update(position_ids)
            freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
            return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return q_embed, k_embed

    def apply_partial_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        rotary_dim = cos.shape[-1]
        q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
        k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
        q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
        k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
        return q_embed, k_embed

    def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
        batch, num_key_value_heads, slen, head_dim = hidden_states.shape
        if n_rep == 1:
            return hidden_states
        hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
        return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)

    def eager_attention_forward(
        module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float, dropout: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key_states = repeat_kv(key, module.num_key_value_groups)
        value_states = repeat_kv(value, module.num_key_value_groups)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
        attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        return attn_output, attn_weights

    def sdpa_attention_forward(
        module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float, dropout: float = 0.0
    ) -> tuple[torch.Tensor, None]:
        sdpa_kwargs = {}
        q_length = query.shape[2]
        if module.num_key_value_groups > 1:
            force = os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA", "0") == "1"
            if force or (attention_mask is None and key.shape[-1] == value.shape[-1] <= 256):
                sdpa_kwargs["enable_gqa"] = True
            else:  # q_length 1 (decoding) is not a training step
                key = repeat_kv(key, module.num_key_value_groups)
                value = repeat_kv(value, module.num_key_value_groups)
        is_causal = q_length > 1 and attention_mask is None and module.is_causal
        attn_output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
            **sdpa_kwargs,
        )
        attn_output = attn_output.reshape(attn_output.shape[0], -1, q_length, value.shape[-1])
        attn_output = attn_output.transpose(1, 2).contiguous()
        return attn_output, None

    attention_functions = {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}

    class Attention(nn.Module):
        def __init__(self, cfg: ReferenceConfig, layer_idx: int, dtype: Any) -> None:
            super().__init__()
            self.config = cfg
            self.layer_idx = layer_idx
            self.head_dim = cfg.head_dim
            self.num_key_value_groups = cfg.num_attention_heads // cfg.num_key_value_heads
            self.num_key_value_heads = cfg.num_key_value_heads
            self.scaling = self.head_dim**-0.5
            self.attention_dropout = cfg.attention_dropout
            self.is_causal = True
            self.fused = cfg.model_type == "phi3"
            q_dim = cfg.num_attention_heads * self.head_dim
            kv_dim = cfg.num_key_value_heads * self.head_dim
            h = cfg.hidden_size
            if self.fused:  # Phi-3: o_proj first, then the fused qkv_proj (parameter order)
                self.o_proj = nn.Linear(q_dim, h, bias=False, dtype=dtype)
                self.qkv_proj = nn.Linear(h, q_dim + 2 * kv_dim, bias=False, dtype=dtype)
            else:
                self.q_proj = nn.Linear(h, q_dim, bias=cfg.qkv_bias, dtype=dtype)
                self.k_proj = nn.Linear(h, kv_dim, bias=cfg.qkv_bias, dtype=dtype)
                self.v_proj = nn.Linear(h, kv_dim, bias=cfg.qkv_bias, dtype=dtype)
                self.o_proj = nn.Linear(q_dim, h, bias=cfg.o_bias, dtype=dtype)
            self.qk_norm = cfg.model_type == "qwen3"
            if self.qk_norm:  # on the head dim only
                self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
                self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)

        def forward(
            self, hidden_states: torch.Tensor, position_embeddings: Any, attention_mask: Any
        ) -> tuple[torch.Tensor, Any]:
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            if self.fused:
                qkv = self.qkv_proj(hidden_states)
                query_pos = self.config.num_attention_heads * self.head_dim
                query_states = qkv[..., :query_pos]
                key_states = qkv[..., query_pos : query_pos + self.num_key_value_heads * self.head_dim]
                value_states = qkv[..., query_pos + self.num_key_value_heads * self.head_dim :]
                query_states = query_states.view(hidden_shape).transpose(1, 2)
                key_states = key_states.view(hidden_shape).transpose(1, 2)
                value_states = value_states.view(hidden_shape).transpose(1, 2)
                cos, sin = position_embeddings
                query_states, key_states = apply_partial_rotary_pos_emb(query_states, key_states, cos, sin)
            else:
                if self.qk_norm:
                    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
                    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
                else:
                    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
                    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
                value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
                cos, sin = position_embeddings
                query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
            attention_interface = attention_functions[self.config._attn_implementation]
            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
            )
            attn_output = attn_output.reshape(*input_shape, -1).contiguous()
            attn_output = self.o_proj(attn_output)
            return attn_output, attn_weights

    class MLP(nn.Module):
        def __init__(self, cfg: ReferenceConfig, dtype: Any) -> None:
            super().__init__()
            h, i = cfg.hidden_size, cfg.intermediate_size
            self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias, dtype=dtype)
            self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias, dtype=dtype)
            self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias, dtype=dtype)
            self.act_fn = Activation(cfg.hidden_act)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class FusedMLP(nn.Module):
        """Phi-3: one gate_up projection, chunked."""

        def __init__(self, cfg: ReferenceConfig, dtype: Any) -> None:
            super().__init__()
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, dtype=dtype)
            self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype)
            self.activation_fn = Activation(cfg.hidden_act)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            up_states = self.gate_up_proj(hidden_states)
            gate, up_states = up_states.chunk(2, dim=-1)
            up_states = up_states * self.activation_fn(gate)
            return self.down_proj(up_states)

    class DecoderLayer(nn.Module):
        def __init__(self, cfg: ReferenceConfig, layer_idx: int, dtype: Any) -> None:
            super().__init__()
            self.hidden_size = cfg.hidden_size
            self.self_attn = Attention(cfg, layer_idx, dtype)
            phi3 = cfg.model_type == "phi3"
            self.mlp = FusedMLP(cfg, dtype) if phi3 else MLP(cfg, dtype)
            norm = GemmaRMSNorm if cfg.model_type == "gemma" else RMSNorm
            self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.resid_dropout = phi3
            if phi3:
                self.resid_attn_dropout = nn.Dropout(cfg.resid_pdrop)
                self.resid_mlp_dropout = nn.Dropout(cfg.resid_pdrop)
            self.gradient_checkpointing = False
            self._gradient_checkpointing_func: Any = None

        def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            # transformers' GradientCheckpointingLayer: checkpoint forward, with the kwargs in a closure
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                return self._gradient_checkpointing_func(partial(self._forward, **kwargs), hidden_states)
            return self._forward(hidden_states, **kwargs)

        def _forward(
            self,
            hidden_states: torch.Tensor,
            attention_mask: Any = None,
            position_ids: Any = None,
            position_embeddings: Any = None,
        ) -> torch.Tensor:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(
                hidden_states=hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
            )
            if self.resid_dropout:
                hidden_states = residual + self.resid_attn_dropout(hidden_states)
            else:
                hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            if self.resid_dropout:
                hidden_states = residual + self.resid_mlp_dropout(hidden_states)
            else:
                hidden_states = residual + hidden_states
            return hidden_states

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> Any:
        if is_fake(position_ids):
            # fake tensors cannot be read; the positions built here are one arange, never packed (what
            # memcalc's fake trace tells transformers too)
            return None
        first_dummy_value = position_ids[:, :1] - 1
        position_diff = torch.diff(position_ids, prepend=first_dummy_value, dim=-1)
        packed_sequence_mask = (position_diff != 1).cumsum(-1)
        if (packed_sequence_mask[:, -1] == 0).all():
            return None
        return packed_sequence_mask

    def causal_mask_function(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx <= q_idx

    def sliding_window_causal_mask_function(sliding_window: int) -> Any:
        def overlay(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kv_idx > q_idx - sliding_window

        def and_mask(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
            result = q_idx.new_ones((), dtype=torch.bool)
            for mask in (overlay, causal_mask_function):
                result = result & mask(batch_idx, head_idx, q_idx, kv_idx).to(result.device)
            return result

        return and_mask

    def sdpa_mask(
        batch_size: int, q_length: int, kv_length: int, mask_function: Any, local_size: int | None,
        allow_is_causal_skip: bool, device: Any,
    ) -> Any:
        """transformers' sdpa_mask without padding: None (``is_causal``) or a (B, 1, q, kv) bool view."""
        if allow_is_causal_skip and (local_size is None or kv_length < local_size):
            return None
        batch_arange = torch.arange(batch_size, device=device)
        head_arange = torch.arange(1, device=device)
        q_arange = torch.arange(q_length, device=device) + 0
        kv_arange = torch.arange(kv_length, device=device) + 0
        attention_mask = mask_function(
            batch_arange[:, None, None, None],
            head_arange[None, :, None, None],
            q_arange[None, None, :, None],
            kv_arange[None, None, None, :],
        )
        attention_mask = attention_mask.expand(batch_size, -1, q_length, kv_length)
        return attention_mask

    def causal_mask(
        cfg: ReferenceConfig, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, sliding_window: int | None
    ) -> Any:
        """transformers' create_causal_mask / create_sliding_window_causal_mask without padding or cache."""
        batch_size, q_length = inputs_embeds.shape[0], inputs_embeds.shape[1]
        if batch_size != position_ids.shape[0]:
            position_ids = position_ids.expand(batch_size, -1)
        if find_packed_sequence_indices(position_ids) is not None:
            raise _unavailable("packed sequences")
        if sliding_window is None:
            mask_function = causal_mask_function
        else:
            mask_function = sliding_window_causal_mask_function(sliding_window)
        eager = cfg._attn_implementation == "eager"
        mask = sdpa_mask(
            batch_size, q_length, q_length, mask_function, sliding_window, not eager, inputs_embeds.device
        )
        if eager and mask is not None:  # eager_mask: 0 where attended, the dtype's min elsewhere
            dtype = inputs_embeds.dtype
            min_dtype = torch.finfo(dtype).min
            mask = torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), min_dtype)
        return mask

    @torch.no_grad()
    def init_weights(root: nn.Module, std: float) -> None:
        """Normal(0, std) weights, zero biases and padding row; rotary tables recomputed (as transformers)."""
        for module in root.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(mean=0.0, std=std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(mean=0.0, std=std)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
            elif isinstance(module, RotaryEmbedding):
                inv_freq, _ = _rope_init(module.config)
                module.inv_freq.copy_(inv_freq)
                module.original_inv_freq.copy_(inv_freq)

    class DecoderModel(nn.Module):
        def __init__(self, cfg: ReferenceConfig, dtype: Any) -> None:
            super().__init__()
            self.config = cfg
            self.padding_idx = cfg.pad_token_id
            self.vocab_size = cfg.vocab_size
            if cfg.model_type == "gemma":
                self.embed_tokens: nn.Embedding = ScaledWordEmbedding(
                    cfg.vocab_size, cfg.hidden_size, self.padding_idx, cfg.hidden_size**0.5, dtype
                )
            else:
                self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, self.padding_idx, dtype=dtype)
            self.layers = nn.ModuleList([DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers)])
            norm = GemmaRMSNorm if cfg.model_type == "gemma" else RMSNorm
            self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.rotary_emb = RotaryEmbedding(cfg)
            self.gradient_checkpointing = False
            self.late_position_embeddings = cfg.model_type in ("mistral", "gemma", "phi3")
            init_weights(self, cfg.initializer_range)  # before the LM head exists, as transformers' post_init

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            cfg = self.config
            inputs_embeds = self.embed_tokens(input_ids)
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + 0
            position_ids = position_ids.unsqueeze(0)
            if cfg.model_type in ("qwen2", "qwen3"):
                masks = {"full_attention": causal_mask(cfg, inputs_embeds, position_ids, None)}
                if "sliding_attention" in cfg.layer_types:
                    masks["sliding_attention"] = causal_mask(cfg, inputs_embeds, position_ids, cfg.sliding_window)
            else:
                mask = causal_mask(cfg, inputs_embeds, position_ids, cfg.sliding_window)
                masks = dict.fromkeys(cfg.layer_types, mask)
            hidden_states = inputs_embeds
            position_embeddings = self.rotary_emb(hidden_states, position_ids)
            for i, decoder_layer in enumerate(self.layers[: cfg.num_hidden_layers]):
                # the keyword order of each family's call (checkpointing frees them in this order)
                if self.late_position_embeddings:
                    hidden_states = decoder_layer(
                        hidden_states,
                        attention_mask=masks[cfg.layer_types[i]],
                        position_ids=position_ids,
                        position_embeddings=position_embeddings,
                    )
                else:
                    hidden_states = decoder_layer(
                        hidden_states,
                        attention_mask=masks[cfg.layer_types[i]],
                        position_embeddings=position_embeddings,
                        position_ids=position_ids,
                    )
            hidden_states = self.norm(hidden_states)
            # drop the references in the order transformers' frame (and the qwen mask_kwargs dict) does
            if cfg.model_type in ("qwen2", "qwen3"):
                del masks
                del inputs_embeds, position_ids
            else:
                del position_ids, inputs_embeds
                del mask, masks
            return hidden_states

    def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, ignore_index: int = -100) -> Any:
        """transformers' ForCausalLMLoss (mean over the non-ignored tokens)."""
        logits = logits.float()
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
        logits = logits.view(-1, vocab_size)
        shift_labels = shift_labels.view(-1)
        shift_labels = shift_labels.to(logits.device)
        return F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="mean")

    class ForCausalLM(nn.Module):
        """A decoder with its LM head; ``forward(input_ids=..., labels=...)`` returns ``.loss``/``.logits``."""

        supports_gradient_checkpointing = True

        def __init__(self, cfg: ReferenceConfig, dtype: Any) -> None:
            super().__init__()
            self.config = cfg
            self.model = DecoderModel(cfg, dtype)
            self.vocab_size = cfg.vocab_size
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
            init_weights(self.lm_head, cfg.initializer_range)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
            hidden_states = self.model(input_ids=input_ids)
            logits = self.lm_head(hidden_states[:, slice(0, None), :])
            loss = None
            if labels is not None:
                loss = causal_lm_loss(logits, labels, self.config.vocab_size)
            return CausalLMOutput(loss=loss, logits=logits)

        # --- activation checkpointing, named as in transformers -------------------------------
        def activation_checkpointing_enable(
            self, activation_checkpointing_kwargs: dict[str, Any] | None = None
        ) -> None:
            """Checkpoint every decoder layer (``torch.utils.checkpoint``, non-reentrant unless told)."""
            kwargs = activation_checkpointing_kwargs
            func = partial(checkpoint, **({"use_reentrant": False} if kwargs is None else kwargs))
            for layer in self._decoder_layers():
                layer.gradient_checkpointing = True
                layer._gradient_checkpointing_func = func
            self.model.gradient_checkpointing = True

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
            """Alias of :meth:`activation_checkpointing_enable` (the transformers 4 name)."""
            self.activation_checkpointing_enable(gradient_checkpointing_kwargs)

        def activation_checkpointing_disable(self) -> None:
            for layer in self._decoder_layers():
                layer.gradient_checkpointing = False
            self.model.gradient_checkpointing = False

        def _decoder_layers(self) -> list[Any]:
            return list(self.model.layers)

        gradient_checkpointing_disable = activation_checkpointing_disable

        @property
        def is_gradient_checkpointing(self) -> bool:
            return bool(self.model.gradient_checkpointing)

    # the root class carries the family's name, as transformers' does (module attribution names the root by it)
    prefixes = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
                "phi3": "Phi3"}
    causal_lm = {
        family: type(f"{prefix}ForCausalLM", (ForCausalLM,), {"__module__": __name__})
        for family, prefix in prefixes.items()
    }
    return SimpleNamespace(
        ForCausalLM=ForCausalLM, causal_lm=causal_lm, DecoderModel=DecoderModel, DecoderLayer=DecoderLayer,
        Attention=Attention, MLP=MLP, FusedMLP=FusedMLP, RMSNorm=RMSNorm, GemmaRMSNorm=GemmaRMSNorm,
        RotaryEmbedding=RotaryEmbedding, ScaledWordEmbedding=ScaledWordEmbedding, Activation=Activation,
        causal_lm_loss=causal_lm_loss, causal_mask=causal_mask,
    )


def build_reference_model(
    config: Mapping[str, Any],
    *,
    precision: str = "fp32",
    attention: str = "sdpa",
    dropout: float | None = None,
) -> Any:
    """A randomly initialised reference causal LM from a HF config dict, in train mode, on CPU.

    Built in bf16 for ``precision="bf16"``, else fp32 (``"mixed"`` runs it under autocast).
    ``dropout`` overrides every dropout probability of the config (the engine passes 0).
    Raises :class:`ReferenceUnavailable` for families, attention implementations or activations the
    reference modules do not implement.
    """
    raw = dict(config)
    if dropout is not None:
        for key, value in list(raw.items()):
            if "drop" in key and isinstance(value, int | float) and not isinstance(value, bool):
                raw[key] = float(dropout)
    cfg = reference_config(raw, attention=attention)  # unsupported families fail before torch is imported
    import torch

    dtype = torch.bfloat16 if precision in ("bf16", "bf16-autocast") else torch.float32
    model = _classes().causal_lm[cfg.model_type](cfg, dtype)
    model.train()
    return model
