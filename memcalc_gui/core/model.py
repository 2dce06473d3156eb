"""Model architectures from Hugging Face ``config.json`` files, and their exact parameter counts.

A :class:`ModelSpec` is the architecture reduced to what memory depends on. The parameter count is
exact: it equals ``sum(p.numel() for p in model.parameters())`` of the transformers model built from
the same config (tests check this against transformers on the meta device). Defaults for keys a
config leaves out follow each family's transformers ``*Config`` class.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from .configfile import read_config
from .errors import ConfigError, UnsupportedFamilyError
from .resources import load_json, resources_dir

SUPPORTED_FAMILIES: tuple[str, ...] = (
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gpt_neox",
    "phi",
)

Norm = Literal["rmsnorm", "layernorm"]

#: The largest size a config dimension may have (int32, as the kernels index tensors) and the most layers:
#: beyond them no model exists, and the numbers would stop being meaningful sizes.
MAX_DIM = 2**31 - 1
MAX_LAYERS = 100_000

#: Activation names transformers knows (``transformers.activations.ACT2FN``, 5.x); an unknown name cannot be
#: built, so every path refuses it the same way.
ACTIVATIONS: frozenset[str] = frozenset({
    "gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_python_tanh",
    "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu", "linear", "mish", "prelu", "quick_gelu", "relu",
    "relu2", "relu6", "sigmoid", "silu", "sqrtsoftplus", "swish", "tanh", "xielu",
})
#: RoPE scaling types transformers implements (``modeling_rope_utils``; ``su`` is longrope's old name).
ROPE_TYPES: frozenset[str] = frozenset({"default", "linear", "dynamic", "yarn", "longrope", "llama3", "su",
                                        "proportional", "mrope"})


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, reduced to the sizes that decide its memory."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tied_embeddings: bool
    gated_mlp: bool
    norm: Norm
    norm_bias: bool
    learned_positions: int  # rows of a learned position table; 0 for rotary
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    lm_head_bias: bool
    parallel_residual: bool
    norms_per_layer: int
    qk_norm: Literal["none", "rmsnorm", "layernorm"]
    fused_qkv: bool
    fused_gate_up: bool
    hidden_act: str
    rotary_dim: int  # dims of each head that get rotary embedding (0: learned positions)
    #: A sliding attention window (tokens; 0: none) and how many decoder layers use it (transformers' config classes:
    #: every layer of Mistral and Phi-3 when ``sliding_window`` is set; Qwen2's and Qwen3's layers from
    #: ``max_window_layers`` on, or their ``layer_types``, when ``use_sliding_window``).
    sliding_window: int = 0
    sliding_layers: int = 0
    #: A pipeline stage holds a slice of the layers: the first stage the embedding, the last the final norm and the
    #: LM head (a tied head is then the last stage's own copy, as Megatron-LM keeps it; ``core.pipeline``).
    stage_first: bool = True
    stage_last: bool = True
    name: str = ""
    source: str = ""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                "num_key_value_heads",
                f"{self.num_kv_heads} does not divide num_attention_heads {self.num_heads}",
            )
        if self.norms_per_layer not in (1, 2):
            raise ConfigError("norms_per_layer", "must be 1 or 2")

    # ---- parameter counts -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def _norm_params(self, width: int) -> int:
        return width * (2 if self.norm_bias else 1)

    @property
    def attention_params(self) -> int:
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        n = h * (q + 2 * kv) + q * h
        if self.qkv_bias:
            n += q + 2 * kv
        if self.out_bias:
            n += h
        if self.qk_norm == "rmsnorm":
            n += 2 * self.head_dim
        elif self.qk_norm == "layernorm":
            n += 4 * self.head_dim
        return n

    @property
    def mlp_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        if self.gated_mlp:
            return 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        return 2 * h * i + (i + h if self.mlp_bias else 0)

    @property
    def layer_params(self) -> int:
        return self.attention_params + self.mlp_params + self.norms_per_layer * self._norm_params(self.hidden_size)

    @property
    def embedding_params(self) -> int:
        if not self.stage_first:
            return 0
        return self.vocab_size * self.hidden_size + self.learned_positions * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        if not self.stage_last:
            return 0
        if self.tied_embeddings:
            return self.lm_head_bias * self.vocab_size
        return self.vocab_size * self.hidden_size + (self.vocab_size if self.lm_head_bias else 0)

    @property
    def num_params(self) -> int:
        """Exact count of trainable parameters (tied weights counted once)."""
        return (
            self.embedding_params
            + self.num_layers * self.layer_params
            + (self._norm_params(self.hidden_size) if self.stage_last else 0)
            + self.lm_head_params
        )

    @property
    def matmul_weight_params(self) -> int:
        """Weights that autocast copies to 16 bits: every Linear/Conv1D weight and the LM head."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        per_layer = h * (q + 2 * kv) + q * h + (3 if self.gated_mlp else 2) * h * i
        return self.num_layers * per_layer + (self.vocab_size * h if self.stage_last else 0)

    @property
    def largest_module_params(self) -> int:
        """Parameters of the largest single module (DeepSpeed's ``largest_layer_params``, ZeRO-3's gather unit)."""
        before, layer, after = self.param_layout()
        return max(r * c for r, c in before + layer + after)

    @property
    def root_unit_params(self) -> int:
        """FSDP's root unit when every decoder layer is wrapped: embeddings, final norm, LM head."""
        return self.num_params - self.num_layers * self.layer_params

    def param_layout(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """Parameter tensors in ``model.parameters()`` order: ``(before, one_layer, after)``.

        Each tensor is ``(rows, cols)`` (vectors have ``cols == 1``); ``one_layer`` repeats
        ``num_layers`` times. Per-tensor optimizer rules need the order (single-tensor step temporaries)
        and the shapes (8-bit state thresholds, factored second moments).
        """
        h, i, q, kv, v = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim, self.vocab_size

        def linear(rows: int, cols: int, bias: bool) -> list[tuple[int, int]]:
            return [(rows, cols)] + ([(rows, 1)] if bias else [])

        def norm(width: int) -> list[tuple[int, int]]:
            return [(width, 1)] * (2 if self.norm_bias else 1)

        if self.fused_qkv:
            qkv = linear(q + 2 * kv, h, self.qkv_bias)
        else:
            qkv = linear(q, h, self.qkv_bias) + linear(kv, h, self.qkv_bias) + linear(kv, h, self.qkv_bias)
        out = linear(h, q, self.out_bias)
        qk_norm = [] if self.qk_norm == "none" else [(self.head_dim, 1)] * (2 if self.qk_norm == "rmsnorm" else 4)
        if self.gated_mlp:
            up = linear(2 * i, h, self.mlp_bias) if self.fused_gate_up else \
                linear(i, h, self.mlp_bias) + linear(i, h, self.mlp_bias)
        else:
            up = linear(i, h, self.mlp_bias)
        mlp = up + linear(h, i, self.mlp_bias)
        if self.family == "gpt2":
            layer = norm(h) + qkv + out + norm(h) + mlp
        elif self.family == "gpt_neox":
            layer = norm(h) + norm(h) + qkv + out + mlp
        elif self.family == "phi3":
            layer = out + qkv + mlp + norm(h) + norm(h)
        else:  # llama-like and phi: attention, MLP, then the norms
            layer = qkv + out + qk_norm + mlp + norm(h) * self.norms_per_layer
        before = [(v, h)] + ([(self.learned_positions, h)] if self.learned_positions else [])
        after = norm(h)
        if not self.tied_embeddings:
            after.append((v, h))
        if self.lm_head_bias:
            after.append((v, 1))
        return before if self.stage_first else [], layer, after if self.stage_last else []

    def param_tensors(self) -> list[tuple[int, int, int]]:
        """Distinct parameter shapes as ``(rows, cols, how_many)`` (order not kept)."""
        before, layer, after = self.param_layout()
        return [(r, c, 1) for r, c in before] + [(r, c, self.num_layers) for r, c in layer] + \
            [(r, c, 1) for r, c in after]

    def to_json(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "name": self.name,
            "source": self.source,
            "params": self.num_params,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "tied_embeddings": self.tied_embeddings,
        }


# ---- reading configs ------------------------------------------------------------------------
def _get_int(cfg: dict[str, Any], *keys: str, default: int | None = None, required: bool = True) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    (isinstance(value, float) and not math.isfinite(value)):
                raise ConfigError(key, f"must be a positive integer, got {value!r}")
            if int(value) != value or value < 1:
                raise ConfigError(key, f"must be a positive integer, got {value!r}")
            limit = MAX_LAYERS if "layer" in key else MAX_DIM
            if value > limit:
                shown = f"{value:.6g}" if isinstance(value, float) else f"{value:,}" if value < 10**15 else \
                    f"a {len(str(value))}-digit number"
                raise ConfigError(key, f"must be at most {limit:,}, got {shown}")
            return int(value)
    if default is not None:
        return default
    if required:
        raise ConfigError(keys[0], "missing from config.json")
    return 0


def _given(cfg: dict[str, Any], *keys: str) -> str:
    """The first of ``keys`` the config sets: the one :func:`_get_int` read, so an error names what the user wrote."""
    return next((key for key in keys if cfg.get(key) is not None), keys[-1])


def _get_bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}")
    return value


def _get_float(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(key, f"must be a number between 0 and 1, got {value!r}")
    return float(value)


def _check_names(cfg: dict[str, Any]) -> None:
    """Activation and RoPE names must be ones transformers can build (else every path fails the same way)."""
    for key in ("hidden_act", "hidden_activation", "activation_function"):
        value = cfg.get(key)
        if value is not None and (not isinstance(value, str) or value not in ACTIVATIONS):
            raise ConfigError(key, f"unknown activation {value!r}; transformers knows {', '.join(sorted(ACTIVATIONS))}")
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be an object, got {type(value).__name__}")
        kind = value.get("rope_type", value.get("type", "default"))
        if not isinstance(kind, str) or kind not in ROPE_TYPES:
            raise ConfigError(f"{key}.rope_type", f"unknown RoPE type {kind!r}; transformers knows "
                                                  f"{', '.join(sorted(ROPE_TYPES))}")


def _sliding(cfg: dict[str, Any], family: str, layers: int) -> tuple[int, int]:
    """(window in tokens, decoder layers that use it) as transformers' config classes decide them: Mistral's
    ``sliding_window`` defaults to 4096 (``MistralConfig``), Phi-3's to none; Qwen2's and Qwen3's apply only with
    ``use_sliding_window``, to the layers from ``max_window_layers`` (default 28) on or those ``layer_types`` name. A
    ``sliding_window`` of null is none."""
    if family in ("mistral", "phi3"):
        if "sliding_window" in cfg and cfg["sliding_window"] is None:
            return 0, 0
        window = _get_int(cfg, "sliding_window", default=4096 if family == "mistral" else 0, required=False)
        return (window, layers) if window else (0, 0)
    if family in ("qwen2", "qwen3") and _get_bool(cfg, "use_sliding_window", False):
        if "sliding_window" in cfg and cfg["sliding_window"] is None:
            return 0, 0
        window = _get_int(cfg, "sliding_window", default=4096)
        types = cfg.get("layer_types")
        if isinstance(types, list):
            return window, min(layers, sum(1 for t in types if t == "sliding_attention"))
        first = _get_int(cfg, "max_window_layers", default=28) if cfg.get("max_window_layers") != 0 else 0
        return window, max(0, layers - first)
    return 0, 0


def spec_from_config(cfg: Any, *, name: str = "", source: str = "") -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed ``config.json`` dictionary."""
    if not isinstance(cfg, dict):
        raise ConfigError("config", "config.json must hold a JSON object")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError("model_type", "missing from config.json")
    family = model_type.strip().lower()
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedFamilyError(model_type, SUPPORTED_FAMILIES)
    _check_names(cfg)
    name = name or str(cfg.get("_name_or_path") or family)
    common: dict[str, Any] = {"family": family, "name": name, "source": source, "raw": cfg}

    if family == "gpt2":
        # transformers' GPT2Config maps the common names onto its own (``attribute_map``) after its own arguments, so
        # where a config has both, the common name is the one the model is built with
        h = _get_int(cfg, "hidden_size", "n_embd")
        heads = _get_int(cfg, "num_attention_heads", "n_head")
        if h % heads:
            raise ConfigError(_given(cfg, "num_attention_heads", "n_head"),
                              f"{heads} does not divide {_given(cfg, 'hidden_size', 'n_embd')} {h}")
        return ModelSpec(
            vocab_size=_get_int(cfg, "vocab_size"), hidden_size=h,
            num_layers=_get_int(cfg, "num_hidden_layers", "n_layer"),
            num_heads=heads, num_kv_heads=heads, head_dim=h // heads,
            intermediate_size=_get_int(cfg, "n_inner", default=4 * h),
            tied_embeddings=_get_bool(cfg, "tie_word_embeddings", True), gated_mlp=False,
            norm="layernorm", norm_bias=True,
            learned_positions=_get_int(cfg, "max_position_embeddings", "n_positions"),
            qkv_bias=True, out_bias=True, mlp_bias=True, lm_head_bias=False, parallel_residual=False,
            norms_per_layer=2, qk_norm="none", fused_qkv=True, fused_gate_up=False,
            hidden_act=str(cfg.get("activation_function") or "gelu_new"), rotary_dim=0, **common,
        )

    h = _get_int(cfg, "hidden_size")
    heads = _get_int(cfg, "num_attention_heads")
    kv = _get_int(cfg, "num_key_value_heads", default=heads)
    # transformers' GemmaConfig and Qwen3Config default head_dim to 256 and 128, not hidden/heads
    default_head_dim = {"gemma": 256, "qwen3": 128}.get(family, h // heads)
    head_dim = _get_int(cfg, "head_dim", default=default_head_dim)
    if family not in ("gemma", "qwen3") and "head_dim" not in cfg and h % heads:
        raise ConfigError("num_attention_heads", f"{heads} does not divide hidden_size {h}")
    layers = _get_int(cfg, "num_hidden_layers")
    inter = _get_int(cfg, "intermediate_size")
    vocab = _get_int(cfg, "vocab_size")
    default_act = {"gpt_neox": "gelu", "phi": "gelu_new", "gemma": "gelu_pytorch_tanh"}.get(family, "silu")
    act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or default_act)

    if family in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma"):
        attention_bias = _get_bool(cfg, "attention_bias", False) if family in ("llama", "qwen3", "gemma") else False
        qkv_bias = True if family == "qwen2" else attention_bias
        rope_factor = _get_float(cfg, "partial_rotary_factor", 1.0)
        window, sliding = _sliding(cfg, family, layers)
        return ModelSpec(
            vocab_size=vocab, hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=kv,
            head_dim=head_dim, intermediate_size=inter,
            tied_embeddings=_get_bool(cfg, "tie_word_embeddings", family == "gemma"),
            gated_mlp=True, norm="rmsnorm", norm_bias=False, learned_positions=0,
            qkv_bias=qkv_bias, out_bias=attention_bias,
            mlp_bias=_get_bool(cfg, "mlp_bias", False) if family == "llama" else False,
            lm_head_bias=False, parallel_residual=False, norms_per_layer=2,
            qk_norm="rmsnorm" if family == "qwen3" else "none",
            fused_qkv=family == "phi3", fused_gate_up=family == "phi3",
            hidden_act="gelu_pytorch_tanh" if family == "gemma" else act,
            rotary_dim=int(head_dim * rope_factor), sliding_window=window, sliding_layers=sliding, **common,
        )
    if family == "gpt_neox":
        attention_bias = _get_bool(cfg, "attention_bias", True)
        pct = _get_float(cfg, "rotary_pct", _get_float(cfg, "partial_rotary_factor", 0.25))
        return ModelSpec(
            vocab_size=vocab, hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=heads,
            head_dim=h // heads, intermediate_size=inter,
            tied_embeddings=_get_bool(cfg, "tie_word_embeddings", False), gated_mlp=False,
            norm="layernorm", norm_bias=True, learned_positions=0, qkv_bias=attention_bias,
            out_bias=attention_bias, mlp_bias=True, lm_head_bias=False,
            parallel_residual=_get_bool(cfg, "use_parallel_residual", True), norms_per_layer=2,
            qk_norm="none", fused_qkv=True, fused_gate_up=False, hidden_act=act,
            rotary_dim=int((h // heads) * pct), **common,
        )
    # phi (Phi-1/1.5/2): one LayerNorm per layer, parallel attention and MLP, biased LM head.
    pct = _get_float(cfg, "partial_rotary_factor", 0.5)
    return ModelSpec(
        vocab_size=vocab, hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=kv,
        head_dim=head_dim, intermediate_size=inter,
        tied_embeddings=_get_bool(cfg, "tie_word_embeddings", False), gated_mlp=False,
        norm="layernorm", norm_bias=True, learned_positions=0, qkv_bias=True, out_bias=True,
        mlp_bias=True, lm_head_bias=True, parallel_residual=True, norms_per_layer=1,
        qk_norm="layernorm" if _get_bool(cfg, "qk_layernorm", False) else "none",
        fused_qkv=False, fused_gate_up=False, hidden_act=act, rotary_dim=int(head_dim * pct),
        **common,
    )


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a user's ``config.json`` through the one validated reader (:func:`.configfile.read_config`)."""
    return read_config(path)


def spec_from_file(path: str | Path) -> ModelSpec:
    """A :class:`ModelSpec` from a ``config.json`` path."""
    p = Path(path)
    return spec_from_config(load_config_file(p), source=str(p))


# ---- presets --------------------------------------------------------------------------------
def preset_names() -> list[str]:
    """Names of the built-in model presets (``resources/models/<name>.json``)."""
    return sorted(p.stem for p in (resources_dir() / "models").glob("*.json"))


def preset_config(name: str) -> dict[str, Any]:
    """The config dictionary of a preset; unknown names raise an error listing the presets."""
    key = name.strip().lower()
    names = preset_names()
    if key not in names:
        close = difflib.get_close_matches(key, names, n=4, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError("preset", f"unknown preset {name[:60]!r}; {hint}`memcalc presets` lists all {len(names)}")
    cfg = load_json(f"models/{key}.json")
    if not isinstance(cfg, dict):
        raise ConfigError("preset", f"preset {key} is not a JSON object")
    return cfg


def preset_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of a built-in preset (:class:`UnsupportedFamilyError` for a family without a block
    model: see :func:`preset_info`)."""
    key = name.strip().lower()
    cfg = preset_config(key)
    return spec_from_config(cfg, name=key, source=preset_source(key, cfg))


def preset_source(key: str, cfg: dict[str, Any]) -> str:
    """``preset qwen3-8b (Qwen/Qwen3-8B)``: the source line of a preset's model."""
    return f"preset {key} ({cfg.get('_name_or_path', key)})"


@dataclass(frozen=True)
class PresetInfo:
    """What the preset list shows without building a model: the family (``model_type``), the parameter count, the
    count one token uses (mixture of experts) and the Hub id the config was published under.

    Presets of families without a block model carry their counts as ``_memcalc_num_params`` and
    ``_memcalc_active_params`` (transformers on the meta device; ``tests/test_params.py`` recounts them), so that
    the window lists them without importing torch. transformers ignores keys that start with ``_``."""

    name: str
    family: str
    num_params: int
    active_params: int
    hub_id: str
    block_model: bool


def preset_info(name: str) -> PresetInfo:
    """The :class:`PresetInfo` of a built-in preset."""
    key = name.strip().lower()
    cfg = preset_config(key)
    family = str(cfg.get("model_type", "")).strip().lower()
    hub_id = str(cfg.get("_name_or_path", key))
    if family in SUPPORTED_FAMILIES:
        n = preset_spec(key).num_params
        return PresetInfo(key, family, n, n, hub_id, True)
    total = stored_count(cfg)
    active = cfg.get("_memcalc_active_params", total)
    if total is None or not isinstance(active, int) or not 0 < active <= total:
        raise ConfigError("preset", f"preset {key} has no stored parameter count (_memcalc_num_params)")
    return PresetInfo(key, family, total, active, hub_id, False)


#: What a build without PyTorch and transformers says when it answers a preset of another family with the heuristic.
LITE_NOTE = ("model_type {family!r} has no analytic block model and this build has no PyTorch and transformers to "
             "trace it: the rough heuristic (quick) from the preset's stored parameter count; the full build "
             "estimates it exactly")


def stored_count(cfg: dict[str, Any]) -> int | None:
    """A preset's stored parameter count (``_memcalc_num_params``), if it has a valid one."""
    n = cfg.get("_memcalc_num_params")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def block_preset_names() -> list[str]:
    """The presets whose family memcalc models tensor by tensor (the analytic method applies)."""
    return [n for n in preset_names()
            if str(preset_config(n).get("model_type", "")).strip().lower() in SUPPORTED_FAMILIES]


def preset_for_hub_id(repo_id: str) -> str | None:
    """The bundled preset published under ``repo_id`` (case-insensitive), if any."""
    return _presets_by_hub_id().get(repo_id.strip().lower())


@lru_cache(maxsize=1)
def _presets_by_hub_id() -> dict[str, str]:
    """Hub id (lower case) → preset name, read once: the window looks ids up as the user types, and the bundled
    presets do not change while the program runs."""
    return {str(preset_config(n).get("_name_or_path", "")).lower(): n for n in reversed(preset_names())}
