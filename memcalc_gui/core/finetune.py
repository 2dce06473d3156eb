"""Fine-tuning methods: which weights train, the LoRA adapters peft adds, and 4-bit/8-bit base storage.

The parameter side of LoRA, QLoRA and partial freezing, exact to the element:

- LoRA (peft ``LoraConfig``): every adapted linear ``W: d_in → d_out`` gets ``lora_A: d_in → r`` and
  ``lora_B: r → d_out`` without biases, ``r·(d_in + d_out)`` trainable parameters; ``target_modules`` are
  matched against the end of a module's name, and ``"all-linear"`` takes every ``nn.Linear``/``Conv1D`` except
  the output head (peft ``tuners_utils._maybe_include_all_linear_layers``). peft keeps adapters in fp32 by
  default (``autocast_adapter_dtype=True``) even on a 16-bit or 4-bit base.
- QLoRA (bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` via transformers' ``BitsAndBytesConfig``): every linear
  of the decoder layers is quantized; the output head stays in the compute dtype (transformers skips it, as
  ``llm_int8_skip_modules`` would). 4-bit storage (``bitsandbytes.functional.quantize_4bit``): packed data
  ``(n + 1) // 2`` bytes, one fp32 absmax per 64-element block; with double quantization the absmax are uint8,
  plus one fp32 absmax per 256 of them and the fp32 offset (``quantize_blockwise`` of the absmax).
  8-bit (LLM.int8, ``Int8Params``): one byte per weight and one fp32 scale per output row.
- Partial freezing trains what ``trainable`` names: ``last:N`` decoder layers, ``norms``, ``lm_head``,
  ``embeddings``.

These counts are checked against peft and bitsandbytes themselves (tests/test_finetune.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

from .errors import InputError
from .model import ModelSpec

Tuning = Literal["full", "lora", "qlora", "frozen"]
Quant = Literal["nf4", "fp4", "int8"]
AdapterDtype = Literal["fp32", "bf16"]
TUNINGS: Final = get_args(Tuning)
QUANTS: Final = get_args(Quant)
ADAPTER_DTYPES: Final = get_args(AdapterDtype)

#: Canonical kinds of a decoder layer's linears (what ``--lora-targets`` names besides peft module names).
ATTENTION_KINDS: Final = ("q", "k", "v", "o", "qkv")
MLP_KINDS: Final = ("gate", "up", "down", "gate_up")
KINDS: Final = ATTENTION_KINDS + MLP_KINDS
#: Target shorthands: peft's "all-linear" and two groups.
TARGET_GROUPS: Final = {"all-linear": KINDS, "attention": ATTENTION_KINDS, "mlp": MLP_KINDS}
#: bitsandbytes' 4-bit block size and the double-quantization block of the absmax.
QUANT_BLOCK: Final = 64
NESTED_BLOCK: Final = 256
#: The most LoRA rank accepted (far past any published recipe; r = d gives a full-rank update).
MAX_RANK: Final = 65536
TRAINABLE_PARTS: Final = ("norms", "lm_head", "embeddings")


@dataclass(frozen=True)
class Linear:
    """One linear of a decoder layer as transformers names it: ``name`` (module name), ``kind``, shape."""

    name: str
    kind: str
    d_in: int
    d_out: int

    @property
    def weight_params(self) -> int:
        return self.d_in * self.d_out


def layer_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """The linears of one decoder layer, in module order, with the names transformers gives them."""
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim
    fam = spec.family
    if fam == "gpt2":  # Conv1D modules; peft adapts them like linears
        return (Linear("c_attn", "qkv", h, q + 2 * kv), Linear("attn.c_proj", "o", q, h),
                Linear("c_fc", "up", h, i), Linear("mlp.c_proj", "down", i, h))
    if fam == "gpt_neox":
        return (Linear("query_key_value", "qkv", h, q + 2 * kv), Linear("attention.dense", "o", q, h),
                Linear("dense_h_to_4h", "up", h, i), Linear("dense_4h_to_h", "down", i, h))
    if fam == "phi":
        return (Linear("q_proj", "q", h, q), Linear("k_proj", "k", h, kv), Linear("v_proj", "v", h, kv),
                Linear("dense", "o", q, h), Linear("fc1", "up", h, i), Linear("fc2", "down", i, h))
    attn: tuple[Linear, ...] = (Linear("qkv_proj", "qkv", h, q + 2 * kv),) if spec.fused_qkv else (
        Linear("q_proj", "q", h, q), Linear("k_proj", "k", h, kv), Linear("v_proj", "v", h, kv))
    attn += (Linear("o_proj", "o", q, h),)
    if spec.gated_mlp:
        mlp: tuple[Linear, ...] = (Linear("gate_up_proj", "gate_up", h, 2 * i),) if spec.fused_gate_up else (
            Linear("gate_proj", "gate", h, i), Linear("up_proj", "up", h, i))
        mlp += (Linear("down_proj", "down", i, h),)
    else:
        mlp = (Linear("fc1", "up", h, i), Linear("fc2", "down", i, h))
    return attn + mlp


def _matches(linear: Linear, target: str) -> bool:
    """A target names a kind (``q``, ``gate_up``) or, as in peft, the end of a module's dotted name."""
    return target == linear.kind or f"layers.0.{linear.name}".endswith("." + target)


@dataclass(frozen=True)
class FineTuning:
    """How a run trains: everything (``full``), LoRA adapters on a frozen base, LoRA on a quantized base
    (``qlora``), or some parts of the model (``frozen`` + ``trainable``)."""

    method: Tuning = "full"
    rank: int = 16
    targets: tuple[str, ...] = ("all-linear",)
    dropout: float = 0.05
    adapter_dtype: AdapterDtype = "fp32"
    quant: Quant = "nf4"
    double_quant: bool = True
    trainable: tuple[str, ...] = ()
    #: QLoRA: peft's ``prepare_model_for_kbit_training`` casts every unquantized 16-bit weight (embeddings, norms,
    #: output head) to fp32; off, they keep the precision's dtype.
    prepare_kbit: bool = True

    def __post_init__(self) -> None:
        if self.method not in TUNINGS:
            raise InputError("tuning", f"must be one of {', '.join(TUNINGS)}, got {self.method!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_RANK:
            raise InputError("lora_rank", f"must be an integer from 1 to {MAX_RANK:,}, got {self.rank!r}")
        if not isinstance(self.targets, tuple) or not self.targets or \
                not all(isinstance(t, str) and t.strip() for t in self.targets):
            raise InputError("lora_targets", "name at least one module (all-linear, attention, mlp or q,k,v,…)")
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1:
            raise InputError("lora_dropout", f"must be a probability in [0, 1), got {d!r}")
        if self.adapter_dtype not in ADAPTER_DTYPES:
            raise InputError("adapter_dtype", f"must be fp32 or bf16, got {self.adapter_dtype!r}")
        if self.quant not in QUANTS:
            raise InputError("quant", f"must be one of {', '.join(QUANTS)}, got {self.quant!r}")
        if not isinstance(self.double_quant, bool):
            raise InputError("double_quant", f"must be true or false, got {self.double_quant!r}")
        if not isinstance(self.prepare_kbit, bool):
            raise InputError("prepare_kbit", f"must be true or false, got {self.prepare_kbit!r}")
        for part in self.trainable:
            _parse_trainable(part)
        if self.method == "frozen" and not self.trainable:
            raise InputError("trainable", "frozen training needs --trainable (e.g. last:4, norms, lm_head)")

    @property
    def uses_adapters(self) -> bool:
        return self.method in ("lora", "qlora")

    def adapted(self, spec: ModelSpec) -> tuple[Linear, ...]:
        """The decoder-layer linears that get adapters (one layer's; every layer is the same)."""
        if not self.uses_adapters:
            return ()
        linears = layer_linears(spec)
        chosen: list[Linear] = []
        for target in (t.strip() for t in self.targets):
            group = TARGET_GROUPS.get(target)
            found = [lin for lin in linears if any(_matches(lin, t) for t in (group or (target,)))]
            if not found:  # a typo is an error here, not an adapter quietly left out
                names = ", ".join(sorted({lin.name for lin in linears} | {lin.kind for lin in linears}))
                raise InputError("lora_targets", f"{target} matches no linear of a {spec.family} layer (its "
                                                 f"linears: {names})")
            chosen += [lin for lin in found if lin not in chosen]
        return tuple(lin for lin in linears if lin in chosen)

    def adapter_params(self, spec: ModelSpec) -> int:
        """Trainable LoRA parameters in the whole model: r·(d_in + d_out) per adapted linear per layer."""
        return spec.num_layers * sum(self.rank * (lin.d_in + lin.d_out) for lin in self.adapted(spec))

    def trainable_params(self, spec: ModelSpec) -> int:
        """Parameters that get gradients and optimizer state."""
        if self.method == "full":
            return spec.num_params
        if self.uses_adapters:
            return self.adapter_params(spec)
        total = 0
        for part in self.trainable:
            kind, n = _parse_trainable(part)
            if kind == "last":
                total += min(n, spec.num_layers) * spec.layer_params
            elif kind == "norms":
                total += spec.num_layers * spec.norms_per_layer * spec._norm_params(spec.hidden_size) + \
                    spec._norm_params(spec.hidden_size)
            elif kind == "lm_head":
                total += spec.lm_head_params if not spec.tied_embeddings else spec.vocab_size * spec.hidden_size
            elif kind == "embeddings":
                total += spec.embedding_params
        if spec.tied_embeddings and {"lm_head", "embeddings"} <= {_parse_trainable(p)[0] for p in self.trainable}:
            total -= spec.vocab_size * spec.hidden_size  # one tensor, counted once
        return min(total, spec.num_params)

    def quantized_params(self, spec: ModelSpec) -> int:
        """Weights bitsandbytes quantizes under QLoRA: every decoder-layer linear weight (not biases, norms,
        embeddings or the output head)."""
        if self.method != "qlora":
            return 0
        return spec.num_layers * sum(lin.weight_params for lin in layer_linears(spec))

    def quantized_bytes(self, spec: ModelSpec) -> int:
        """Bytes bitsandbytes allocates for the quantized weights (data + quantization state), per tensor."""
        if self.method != "qlora":
            return 0
        per_layer = sum(quantized_tensor_bytes(lin.d_in * lin.d_out, self.quant, self.double_quant, lin.d_out)
                        for lin in layer_linears(spec))
        return spec.num_layers * per_layer


def quantized_tensor_bytes(n: int, quant: str, double_quant: bool = True, rows: int = 1) -> int:
    """Storage of one quantized weight of ``n`` elements (``rows`` output rows, for int8's row scales).

    4-bit (``bitsandbytes.functional.quantize_4bit``, blocksize 64): ``(n + 1) // 2`` packed bytes, ``ceil(n / 64)``
    fp32 absmax and the tensor's own 16-entry fp32 code table (``get_4bit_type`` makes one per call). Double
    quantization (``compress_statistics``) stores the absmax as uint8 via ``quantize_blockwise`` (blocksize 256:
    one fp32 absmax per 256 values, its own 256-entry fp32 code) plus one fp32 offset.
    8-bit (LLM.int8 ``Int8Params``): ``n`` bytes and one fp32 scale per row (``SCB``).
    """
    if quant == "int8":
        return n + 4 * rows
    blocks = -(-n // QUANT_BLOCK)
    data = (n + 1) // 2 + 4 * 16
    if not double_quant:
        return data + 4 * blocks
    return data + blocks + 4 * -(-blocks // NESTED_BLOCK) + 4 * 256 + 4


def _parse_trainable(part: str) -> tuple[str, int]:
    """``last:4`` → ("last", 4); ``norms`` → ("norms", 0)."""
    text = part.strip().lower()
    if text.startswith("last:"):
        count = text.removeprefix("last:")
        if not count.isdigit() or int(count) < 1:
            raise InputError("trainable", f"last:N needs a positive number of layers, got {part!r}")
        return "last", int(count)
    if text in TRAINABLE_PARTS:
        return text, 0
    raise InputError("trainable", f"unknown part {part!r} (use last:N, norms, lm_head or embeddings)")
