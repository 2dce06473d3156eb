"""A training setup: the model and every choice that changes the memory of one training step.

:class:`TrainingSetup` validates itself; every error names the field (the CLI flag without dashes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Final, Literal, get_args

from .context import check_context_parallel
from .distributed import VOCAB_SPLIT_ALWAYS, ZERO_BUBBLE, Parallelism
from .errors import InputError
from .finetune import FineTuning
from .layout import check_tensor_parallel
from .model import ModelSpec
from .pipeline import check_microbatches, check_pipeline, check_zero_bubble
from .resources import load_json
from .units import MAX_COUNT, MAX_SIZE_BYTES, format_bytes

Precision = Literal["fp32", "mixed", "bf16", "bf16-autocast"]
Optimizer = Literal["adamw", "adam", "adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit", "sgd", "sgd-momentum",
                    "adafactor", "lion", "galore-adamw", "adamw-bf16-states"]
OptimizerImpl = Literal["foreach", "single-tensor", "fused"]
#: transformers' ``attn_implementation``: ``sdpa`` (PyTorch's fused kernels), ``eager`` (batched products and a
#: softmax) or ``flash`` (``flash_attention_2``: FlashAttention-2, variable-length over packed documents).
Attention = Literal["sdpa", "eager", "flash"]
#: ``none``, ``full`` (every decoder layer), ``selective`` (every layer, torchtitan's per-op policy: matrix-product and
#: attention outputs kept) or ``every:N`` (every N-th layer: torchtitan's selective layer checkpointing, ``ac_freq``);
#: see :func:`checkpoint_every`.
Checkpointing = str
#: How the loss is computed: transformers' full logits, or a chunked fused linear cross-entropy (Liger's).
Loss = Literal["full", "chunked"]
#: What the decoder body saves for backward goes to host memory: nothing, the checkpointed layers' inputs (torchtune's
#: OffloadActivations with activation checkpointing) or every saved tensor (``torch.autograd.graph.save_on_cpu``).
ActivationOffload = Literal["none", "checkpoint-inputs", "all"]
Method = Literal["quick", "analytic", "trace"]
TargetDevice = Literal["cuda", "cpu"]

PRECISIONS: Final = get_args(Precision)
#: The bitsandbytes optimizers (their own fused kernels; the paged ones keep big states in CUDA unified memory).
BNB_OPTIMIZERS: Final = ("adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit")
OPTIMIZERS: Final = get_args(Optimizer)
OPTIMIZER_IMPLS: Final = get_args(OptimizerImpl)
ATTENTIONS: Final = get_args(Attention)
CHECKPOINTINGS: Final = ("none", "full", "selective", "every:N")
LOSSES: Final = get_args(Loss)
ACTIVATION_OFFLOADS: Final = get_args(ActivationOffload)
METHODS: Final = get_args(Method)
TARGET_DEVICES: Final = get_args(TargetDevice)

PRECISION_LABELS: Final = {
    "fp32": "fp32 (4 B/param weights, grads and activations)",
    "mixed": "Mixed precision (6 B/param: fp32 master + 16-bit compute copy)",
    "bf16": "bf16 (pure 16-bit weights, grads and optimizer state)",
    "bf16-autocast": "bf16 weights under bf16 autocast (a bf16-loaded model with Trainer's bf16=True)",
}
#: Precisions whose weights, gradients and optimizer state are 16-bit.
BF16_WEIGHTS: Final = ("bf16", "bf16-autocast")

#: CUDA context default: PyTorch 2.x with CUDA 12 lazy module loading creates a context of roughly
#: 0.5 GiB on recent GPUs (PyTorch memory notes measured 1.35–1.64 GB with CUDA 10/11 and eager loading).
DEFAULT_CUDA_CONTEXT_BYTES: Final = 512 * 2**20
#: Allocator reserve: cached but unusable memory as a fraction of the tensor peak. Seed 003 gives
#: fragmentation of 5–20 %; we default to 10 % and let the user (or a measurement) override it.
DEFAULT_ALLOCATOR_RESERVE: Final = 0.10


@dataclass(frozen=True)
class GPU:
    """A GPU preset; ``capacity_bytes`` is what the device reports to PyTorch."""

    id: str
    name: str
    nominal: str
    capacity_bytes: int
    source: str = "reported"


def gpu_presets() -> list[GPU]:
    """The bundled GPU table (``resources/gpus.json``)."""
    data = load_json("gpus.json")
    return [GPU(**{k: g[k] for k in ("id", "name", "nominal", "capacity_bytes", "source")}) for g in data["gpus"]]


def find_gpu(name: str) -> GPU:
    """Look a GPU up by id or name, case-insensitively (``a100-80gb``, ``A100 80GB``)."""
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    presets = gpu_presets()
    for gpu in presets:
        if key in (gpu.id, gpu.name.lower().replace(" ", "-")):
            return gpu
    matches = [g for g in presets if key in g.name.lower().replace(" ", "-")]
    if len(matches) == 1:
        return matches[0]
    raise InputError("gpu", f"unknown GPU {name!r}; available: {', '.join(g.id for g in presets)}")


def one_replica_sequence_parallel(par: Parallelism) -> bool:
    """Sequence parallelism with every GPU of the one replica tensor-parallel (``--strategy ddp``, no data- or
    context-parallel GPUs, no pipeline stages): torchtitan's plan with no FSDP applied, as it runs with
    ``dp_shard = 1``; DDP has nothing to reduce there. For a family without a block model this is traced (the other
    strategies' one-replica layouts are refused: FSDP2 would shard nothing)."""
    return par.sp and par.strategy == "ddp" and par.dp * par.cp == 1 and par.pp == 1


def checkpoint_every(value: object) -> int | None:
    """How often layers are checkpointed: ``None`` for none, 1 for every layer (``full``), N for ``every:N`` (layers
    N, 2N, … counted from the first, as torchtitan's ``ac_freq`` picks them). Raises :class:`InputError`."""
    if value == "none":
        return None
    if value in ("full", "selective"):
        return 1
    text = value.strip().lower() if isinstance(value, str) else ""
    if text.startswith("every:"):
        try:
            n = int(text[6:])
        except ValueError:
            n = 0
        if 1 <= n <= 100_000:
            return n
    raise InputError("checkpointing", f"must be none, full, selective or every:N (N ≥ 1, every N-th layer), got "
                                      f"{value!r}")


def _choice(field_name: str, value: object, options: tuple[str, ...]) -> None:
    if value not in options:
        raise InputError(field_name, f"must be one of {', '.join(options)}, got {value!r}")


def _positive_int(field_name: str, value: object, limit: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(field_name, f"must be a positive integer, got {value!r}")
    if limit is not None and value > limit:
        raise InputError(field_name, f"must be at most {limit:,}, got {value:,}")


#: Upper bounds of the shape fields: far past any real run (a million sequences per micro-batch, 16M-token
#: sequences), and they keep every search and sum the estimator does bounded.
LIMITS: Final = {"batch": 2**20, "seq": 2**24, "grad_accum": 2**20}


#: Setup fields that change no tensor of the step: the GPU, its capacity, the memory outside PyTorch's allocator.
OVERHEAD_FIELDS: Final = frozenset({"gpu", "capacity_bytes", "cuda_context_bytes", "allocator_reserve", "extras"})


@dataclass(frozen=True)
class TrainingSetup:
    """Everything that decides the memory of one training step on one GPU."""

    model: ModelSpec | None = None
    params: int | None = None  # parameters-only description (method "quick")
    batch: int = 1
    seq: int = 512
    grad_accum: int = 1
    precision: Precision = "mixed"
    optimizer: Optimizer = "adamw"
    optimizer_impl: OptimizerImpl = "foreach"
    attention: Attention = "sdpa"
    checkpointing: Checkpointing = "none"
    #: Whether the training loop leaves the config's ``use_cache=True`` (transformers then fills a
    #: DynamicCache during forward); Trainer and most loops pass ``use_cache=False``.
    use_cache: bool = False
    #: ``chunked``: Liger's fused linear cross-entropy (the tokens × vocabulary logits never exist);
    #: ``loss_chunk`` rows per chunk (``None``: Liger's rule, see ``core.loss``).
    loss: Loss = "full"
    loss_chunk: int | None = None
    #: Each parameter stepped as soon as its gradient is accumulated, the gradient freed (PyTorch's "optimizer step
    #: in backward" recipe; torchtune's ``optimizer_in_bwd``): no gradients kept, no accumulation.
    optimizer_in_backward: bool = False
    #: Saved activations kept in host memory during the step (see ``ActivationOffload``).
    activation_offload: ActivationOffload = "none"
    #: Padding-free packing (transformers' ``DataCollatorWithFlattening``, TRL's ``padding_free``): the micro-batch's
    #: ``batch`` documents of at most ``seq`` tokens are concatenated into one row of ``tokens_per_batch`` real tokens
    #: (``None``: ``batch × seq``, no padding to drop) whose ``position_ids`` restart at every document, so attention
    #: stays within each document.
    packing: bool = False
    tokens_per_batch: int | None = None
    #: GaLore's projection rank (``optimizer="galore-adamw"``: galore-torch's GaLoreAdamW, Trainer's ``galore_adamw``).
    galore_rank: int = 128
    gpu: str | None = None
    capacity_bytes: int | None = None
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES
    allocator_reserve: float = DEFAULT_ALLOCATOR_RESERVE
    parallel: Parallelism = field(default_factory=Parallelism)
    #: Full fine-tuning, LoRA, QLoRA or frozen parts (core.finetune).
    tuning: FineTuning = field(default_factory=FineTuning)
    #: The device the ledger models: a few kernels keep different tensors on CPU (dropout masks in the input
    #: dtype rather than bool), so a CPU measurement compares with the ``cpu`` ledger.
    target_device: TargetDevice = "cuda"
    extras: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.model is None and self.params is None:
            raise InputError("model", "give a preset, a config.json or a parameter count")
        if self.params is not None:
            _positive_int("params", self.params, MAX_COUNT)
        for name, limit in LIMITS.items():
            _positive_int(name, getattr(self, name), limit)
        _choice("precision", self.precision, PRECISIONS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        _choice("attention", self.attention, ATTENTIONS)
        checkpoint_every(self.checkpointing)  # raises InputError naming the field
        if self.checkpointing == "selective" and self.attention != "sdpa":
            raise InputError("checkpointing", "per-op selective checkpointing keeps the SDPA kernel's output (as "
                                              "torchtitan's policy does): it is modelled with SDPA attention")
        if (self.checkpointing.startswith("every:") or self.checkpointing == "selective") \
                and self.tuning.method != "full":
            raise InputError("checkpointing", f"{'selective' if self.checkpointing == 'selective' else 'every N-th'} "
                                              "checkpointing is modelled for full fine-tuning; LoRA, QLoRA and frozen "
                                              "parts take none or full")
        _choice("loss", self.loss, LOSSES)
        if self.loss_chunk is not None:
            _positive_int("loss_chunk", self.loss_chunk, LIMITS["seq"] * LIMITS["batch"])
            if self.loss != "chunked":
                raise InputError("loss_chunk", "a chunk size needs the chunked loss (--loss chunked)")
        if self.loss == "chunked" and self.model is not None and self.model.lm_head_bias:
            raise InputError("loss", f"the chunked loss is modelled for a head without a bias; {self.model.family}'s "
                                     "LM head has one")
        if not isinstance(self.optimizer_in_backward, bool):
            raise InputError("optimizer_in_backward", f"must be true or false, got {self.optimizer_in_backward!r}")
        if self.optimizer_in_backward and self.grad_accum > 1:
            raise InputError("optimizer_in_backward", "the step in backward applies every micro-batch's gradients "
                                                      "at once: it cannot accumulate (gradient accumulation 1)")
        if self.optimizer_in_backward and self.parallel.is_distributed:
            raise InputError("optimizer_in_backward", "the step in backward is modelled on one GPU")
        _choice("activation_offload", self.activation_offload, ACTIVATION_OFFLOADS)
        if self.activation_offload == "checkpoint-inputs" and self.checkpointing != "full":
            raise InputError("activation_offload", "checkpoint-inputs offloads what checkpointed layers keep: it needs "
                                                   "full checkpointing (every layer, not per op or every N-th)")
        if self.activation_offload == "all" and self.checkpointing.startswith("every:"):
            raise InputError("activation_offload", "offloading every saved tensor is modelled with no or full "
                                                   "checkpointing, not every N-th layer")
        if self.activation_offload != "none" and self.tuning.method != "full":
            raise InputError("activation_offload", "activation offloading is modelled for full fine-tuning")
        if self.activation_offload != "none" and self.use_cache:
            raise InputError("activation_offload", "activation offloading is modelled with use_cache off")
        if not isinstance(self.use_cache, bool):
            raise InputError("use_cache", f"must be true or false, got {self.use_cache!r}")
        self._check_packing()
        self._check_galore()
        if self.capacity_bytes is not None:
            _positive_int("capacity", self.capacity_bytes, MAX_SIZE_BYTES)
        if isinstance(self.cuda_context_bytes, bool) or not isinstance(self.cuda_context_bytes, int) \
                or not 0 <= self.cuda_context_bytes <= MAX_SIZE_BYTES:
            raise InputError("cuda_context", f"must be a non-negative size, got {self.cuda_context_bytes!r}")
        r = self.allocator_reserve
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0 <= r < 1:
            raise InputError("allocator_reserve", f"must be a fraction in [0, 1), got {r!r}")
        if not isinstance(self.parallel, Parallelism):
            raise InputError("strategy", "parallel must be a Parallelism")
        _choice("target_device", self.target_device, TARGET_DEVICES)
        if not isinstance(self.tuning, FineTuning):
            raise InputError("tuning", "tuning must be a FineTuning")
        if self.parallel.tp > 1:
            if self.model is not None and self.parallel.strategy in VOCAB_SPLIT_ALWAYS and \
                    not self.parallel.loss_parallel:
                # Megatron-LM splits the vocabulary whatever the layout says (VocabParallelEmbedding, its
                # column-parallel output layer): a family without a block model keeps it whole (result.py says so)
                object.__setattr__(self, "parallel", replace(self.parallel, loss_parallel=True))
            if self.model is None and self.parallel.loss_parallel:
                raise InputError("loss_parallel", "loss parallelism is modelled for the families memcalc has a block "
                                                  "model of")
            if self.model is not None:  # without one, the fitted method checks the config (trace.ranks)
                check_tensor_parallel(self.model, self.parallel.tp)
            if self.tuning.method != "full":
                raise InputError("tp", f"{self.tuning.method} beside tensor parallelism is not modelled yet")
        par = self.parallel
        if par.cp > 1:  # without a block model, the fitted method and the trace check the config (a bare count: quick)
            if self.tuning.method != "full":
                raise InputError("cp", f"{self.tuning.method} beside context parallelism is not modelled yet")
            check_context_parallel(self)
        if par.pp > 1 or par.sp:
            # without a block model (Korthikanti et al. 2022's split of the norms and residual stream), one rank of
            # torchtitan's plan is traced (a pipeline stage's tensor-parallel group too): beside FSDP2
            if self.model is None and par.sp and par.strategy != "fsdp2" and not one_replica_sequence_parallel(par):
                if par.dp * par.cp == 1:  # FSDP2 would shard nothing there (Parallelism refuses it)
                    raise InputError("sp", "sequence parallelism of a family memcalc has no block model of is traced "
                                           "as torchtitan runs it: beside FSDP2, or with every GPU tensor-parallel "
                                           "under DDP (one replica, no pipeline stages); give twice the GPUs, or leave "
                                           "sequence parallelism out")
                raise InputError("strategy", "sequence parallelism of a family memcalc has no block model of is "
                                             "traced as torchtitan runs it, beside FSDP2 (--strategy fsdp2)")
            if self.model is not None:  # without one, the fitted method and the trace check the config's layers
                check_pipeline(self.model, par.pp, par.virtual_stages)
            check_microbatches(par.schedule, par.pp, self.grad_accum)
            if par.schedule in ZERO_BUBBLE:
                check_zero_bubble(self)
            for on, what in ((self.tuning.method != "full", self.tuning.method),
                             (self.loss == "chunked", "the chunked loss"),
                             (self.activation_offload != "none", "activation offloading"),
                             (self.optimizer_in_backward, "the optimizer step in backward"),
                             (self.packing, "packing")):
                if on and par.pp > 1:
                    raise InputError("pp", f"{what} beside pipeline parallelism is not modelled yet")
        if self.tuning.method != "full":
            if self.model is None:
                raise InputError("tuning", f"{self.tuning.method} needs an architecture (a preset or config.json), "
                                           "not a bare parameter count")
            self.tuning.adapted(self.model)  # the targets must name linears of this family
            if self.parallel.strategy != "ddp" or self.parallel.offload != "none":
                raise InputError("strategy", f"{self.tuning.method} is modelled with DDP (replicated) only so far; "
                                             "sharded strategies and offload need full fine-tuning")
        if self.optimizer in BNB_OPTIMIZERS and self.optimizer_impl == "fused":
            name = {"adamw-8bit": "8-bit AdamW", "paged-adamw-8bit": "paged 8-bit AdamW",
                    "paged-adamw-32bit": "paged 32-bit AdamW"}[self.optimizer]
            raise InputError("optimizer_impl", f"{name} runs bitsandbytes' own kernels; use foreach or single-tensor")

    def _check_packing(self) -> None:
        if not isinstance(self.packing, bool):
            raise InputError("packing", f"must be true or false, got {self.packing!r}")
        if self.tokens_per_batch is not None:
            _positive_int("tokens_per_batch", self.tokens_per_batch)
            if not self.packing:
                raise InputError("tokens_per_batch", "real tokens per micro-batch need packing (--packing)")
            if self.tokens_per_batch > self.batch * self.seq:
                raise InputError("tokens_per_batch", f"the micro-batch's {self.batch:,} documents of at most "
                                                     f"{self.seq:,} tokens hold at most {self.batch * self.seq:,} "
                                                     f"tokens, got {self.tokens_per_batch:,}")
        if self.attention == "flash" and self.precision == "fp32":
            raise InputError("attention", "FlashAttention-2 runs in fp16/bf16 only: choose a 16-bit precision "
                                          "(mixed, bf16) or SDPA")
        if not self.packing:
            return
        if self.use_cache:
            raise InputError("packing", "packing is modelled with use_cache off (a training step fills no cache)")
        if self.checkpointing == "selective":
            raise InputError("packing", "per-op selective checkpointing is modelled without packing")
        if self.activation_offload != "none" and self.attention == "sdpa":
            raise InputError("packing", "activation offloading with packed SDPA attention (its per-layer masks) is "
                                        "not modelled; choose flash attention")

    def _check_galore(self) -> None:
        _positive_int("galore_rank", self.galore_rank, 65_536)
        if self.optimizer != "galore-adamw":
            return
        if self.model is None:
            raise InputError("optimizer", "GaLore projects the decoder's linear weights: it needs an architecture "
                                          "(a preset or config.json)")
        if self.model.family == "gpt2":
            raise InputError("optimizer", "GaLore projects nn.Linear weights; GPT-2's layers are Conv1D, which "
                                          "Trainer's galore_adamw does not target")
        if self.tuning.method != "full":
            raise InputError("optimizer", "GaLore is a full fine-tuning optimizer (it projects the weights' "
                                          "gradients); with LoRA choose AdamW")
        if self.parallel.is_distributed:
            raise InputError("optimizer", "GaLore (galore-torch) is modelled on one GPU")
        if self.optimizer_in_backward:
            raise InputError("optimizer_in_backward", "GaLore's layer-wise step in backward is not modelled")

    @property
    def rows(self) -> int:
        """Rows of the micro-batch's input: the documents, or one row when they are packed."""
        return 1 if self.packing else self.batch

    @property
    def row_len(self) -> int:
        """Tokens per row: the sequence length, or every real token of the micro-batch when packed."""
        if self.packing:
            return self.tokens_per_batch or self.batch * self.seq
        return self.seq

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch, padding included (none when packed)."""
        return self.rows * self.row_len

    @property
    def num_params(self) -> int:
        if self.model is not None:
            return self.model.num_params
        assert self.params is not None
        return self.params

    @property
    def effective_batch(self) -> int:
        return self.batch * self.grad_accum

    @property
    def architecture_known(self) -> bool:
        """A block model, or a config the fitted method traces (``extras["fitted"]``): what sharding, offload and
        checkpointing what-ifs need beyond a bare parameter count."""
        return self.model is not None or bool(self.extras.get("fitted"))

    def with_changes(self, **changes: Any) -> TrainingSetup:
        """A copy with some fields changed (validated again). A new micro-batch of a packed setup with stated real
        tokens keeps their mean per document (tokens scale with the documents), within ``batch × seq``."""
        if self.packing and self.tokens_per_batch and "tokens_per_batch" not in changes:
            b, s = changes.get("batch", self.batch), changes.get("seq", self.seq)
            if all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in (b, s)):
                changes["tokens_per_batch"] = max(1, min(b * s, -(-self.tokens_per_batch * b // self.batch)))
        return replace(self, **changes)

    def same_tensors(self, other: TrainingSetup) -> bool:
        """Whether ``other`` has the same tensors: every field but the GPU, its capacity and the overheads outside
        PyTorch's allocator (a measured or traced step of one is a step of the other)."""
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(self)
                   if f.name not in OVERHEAD_FIELDS)

    def describe(self) -> dict[str, Any]:
        """The inputs as plain JSON values (for ``--json``, reports and settings)."""
        return {
            "model": self.model.to_json() if self.model else None,
            "params": self.num_params,
            "batch": self.batch,
            "seq": self.seq,
            "grad_accum": self.grad_accum,
            "effective_batch": self.effective_batch,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "optimizer_impl": self.optimizer_impl,
            **({"galore_rank": self.galore_rank} if self.optimizer == "galore-adamw" else {}),
            "attention": self.attention,
            "checkpointing": self.checkpointing,
            "loss": self.loss,
            "loss_chunk": self.loss_chunk,
            "optimizer_in_backward": self.optimizer_in_backward,
            "activation_offload": self.activation_offload,
            "use_cache": self.use_cache,
            "packing": self.packing,
            "tokens_per_batch": self.row_len if self.packing else None,
            "gpu": self.gpu,
            "capacity_bytes": self.capacity_bytes,
            "cuda_context_bytes": self.cuda_context_bytes,
            "allocator_reserve": self.allocator_reserve,
            "gpus": self.parallel.gpus,
            "strategy": self.parallel.strategy,
            "node_size": self.parallel.node_size,
            "offload": self.parallel.offload,
            "ep": self.parallel.ep,
            "etp": self.parallel.etp,
            "tp": self.parallel.tp,
            "pp": self.parallel.pp,
            "schedule": self.parallel.schedule,
            "virtual_stages": self.parallel.virtual_stages,
            "sp": self.parallel.sp,
            "cp": self.parallel.cp,
            "loss_parallel": self.parallel.loss_parallel,
            "reshard_after_forward": self.parallel.reshard_after_forward,
            "dp_replicate": self.parallel.dp_replicate,
            "tuning": self.tuning.method,
            **({"lora_rank": self.tuning.rank, "lora_targets": list(self.tuning.targets),
                "lora_dropout": self.tuning.dropout, "adapter_dtype": self.tuning.adapter_dtype}
               if self.tuning.uses_adapters else {}),
            **({"quant": self.tuning.quant, "double_quant": self.tuning.double_quant,
                "prepare_kbit": self.tuning.prepare_kbit,
                "quantized_params": self.tuning.quantized_params(self.model) if self.model else 0,
                "quantized_bytes": self.tuning.quantized_bytes(self.model) if self.model else 0}
               if self.tuning.method == "qlora" else {}),
            **({"trainable": list(self.tuning.trainable)} if self.tuning.method == "frozen" else {}),
            "trainable_params": self.tuning.trainable_params(self.model) if self.model else self.num_params,
        }

    def packing_text(self) -> str:
        """``8 documents of at most 4,096 tokens packed into one row of 16,384 tokens`` ("" without packing)."""
        if not self.packing:
            return ""
        return (f"{self.batch:,} document{'s' if self.batch > 1 else ''} of at most {self.seq:,} tokens packed into "
                f"one row of {self.row_len:,} tokens")

    def tuning_text(self) -> str:
        """``QLoRA (nf4, double quantization) r=16 on all-linear: 41,943,040 trainable parameters (0.52 %)``."""
        ft = self.tuning
        if ft.method == "full" or self.model is None:
            return f"full fine-tuning: all {self.num_params:,} parameters train"
        n = ft.trainable_params(self.model)
        share = f"{n:,} trainable parameters ({n / self.model.num_params:.2%})"
        if ft.method == "frozen":
            return f"frozen except {', '.join(ft.trainable)}: {share}"
        where = ", ".join(ft.targets)
        base = ""
        if ft.method == "qlora":
            dq = ", double quantization" if ft.double_quant and ft.quant != "int8" else ""
            dq += "" if ft.prepare_kbit else ", without prepare_model_for_kbit_training"
            base = (f"; base {ft.quant}{dq}: {format_bytes(ft.quantized_bytes(self.model))} for "
                    f"{ft.quantized_params(self.model):,} weights")
        name = "QLoRA" if ft.method == "qlora" else "LoRA"
        return (f"{name} r={ft.rank} on {where}, dropout {ft.dropout:g}, {ft.adapter_dtype} adapters: {share}{base}")

    def tuning_short(self) -> str:
        """A few words for titles: ``QLoRA r=16 (nf4)``, ``LoRA r=8``, ``frozen except last:4``; "" when full."""
        ft = self.tuning
        if ft.method == "full":
            return ""
        if ft.method == "frozen":
            return f"frozen except {', '.join(ft.trainable)}"
        return f"QLoRA r={ft.rank} ({ft.quant})" if ft.method == "qlora" else f"LoRA r={ft.rank}"

    def summary(self) -> str:
        """One line: model, shape and options."""
        model = self.model.name if self.model else f"{self.num_params:,} params"
        cap = f", {format_bytes(self.capacity_bytes)}" if self.capacity_bytes else ""
        par = self.parallel
        gpus = f", {par.gpus} GPUs {par.strategy}" if par.is_distributed else ""
        gpus += f", {par.model_parallel_text} × data parallel {par.dp}" if par.model_parallel_text else ""
        gpus += f", offload {par.offload}" if par.offload != "none" else ""
        gpus += par.experts_text
        gpus += ", not resharded after forward" if not par.reshard_after_forward else ""
        return (f"{model}: batch {self.batch} × seq {self.seq} × accum {self.grad_accum}, {self.precision}, "
                f"{self.optimizer} ({self.optimizer_impl}), {self.attention}, checkpointing {self.checkpointing}"
                f"{', chunked loss' if self.loss == 'chunked' else ''}"
                f"{', optimizer step in backward' if self.optimizer_in_backward else ''}"
                f"{f', activations offloaded ({self.activation_offload})' if self.activation_offload != 'none' else ''}"
                f"{', use_cache' if self.use_cache else ''}"
                f"{f', packed into {self.row_len:,} tokens' if self.packing else ''}"
                f"{', ' + self.tuning_short() if self.tuning.method != 'full' else ''}{gpus}{cap}")
