"""Per-GPU memory under data parallelism: DDP, DeepSpeed ZeRO-1/2/3 and PyTorch FSDP, with CPU offload.

Activations and their temporaries are per micro-batch, so they stay those of the single-GPU ledger;
what changes is the model state each GPU keeps and the buffers each engine adds. Ψ is the parameter
count, N the number of GPUs the state is sharded over, L the parameters of the largest unit that is
gathered at once (a decoder layer, or the embedding/LM-head root unit).

Model states per GPU, mixed precision with Adam (bytes per parameter):

=====================  ===========================  ============================  ======================
strategy               parameters                   gradients                     optimizer state
=====================  ===========================  ============================  ======================
ddp                    4 (fp32) + 16-bit copies     4 + 4 (DDP buckets)           8
zero1                  2 + 4/N (fp32 master)        2 + 4/N (fp32 partition)      8/N
zero2                  2 + 4/N                      2/N + 4/N + reduce bucket     8/N
zero3                  2/N + 4/N + gathered unit    4/N + 2/N + unit grads        8/N
fsdp-full-shard        4/N + gathered units (16b)   4/N + unit grads              8/N
fsdp-shard-grad-op     4/N + all params (16-bit)    4/N + unit grads              8/N
fsdp-hybrid            as full-shard over a node    as full-shard over a node     8/node
fsdp2                  4/N + gathered units (16b)   4/N + unit grads (16b + fp32) 8/N
fsdp2, no reshard      4/N + all params (16-bit)    4/N + unit grads (16b + fp32) 8/N
=====================  ===========================  ============================  ======================

FSDP2 (``fully_shard``, per-parameter DTensor sharding) follows torchtitan's defaults: every decoder layer and then
the root model wrapped, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` under mixed precision (the
gathered weights are bf16 and the step computes in bf16 without autocast; each unit's gradients are reduce-scattered
from an fp32 copy), the root not resharded after forward, and one unit prefetched; ``reshard_after_forward=False``
keeps every unit gathered from its forward to its backward (torchtitan's docs: less communication, more memory).

Sources: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(2020), the (2 + 2 + K)Ψ family and Figure 1 (Ψ = 7.5B, N = 64, K = 12: 120 / 31.4 / 16.6 / 1.9 GB);
DeepSpeed's ``estimate_zero2_model_states_mem_needs`` (4Ψ + 16Ψ/N) and
``estimate_zero3_model_states_mem_needs`` (18Ψ/N + 4·L, host buffers ×1.5) in
deepspeed/runtime/zero/stage_1_and_2.py and stage3.py; the PyTorch FSDP docs (sharding strategies,
MixedPrecision, CPUOffload; limit_all_gathers keeps at most two units gathered). Where the paper and the
code disagree the code wins: DeepSpeed keeps an fp32 gradient partition (4Ψ/N) the paper's K = 12
omits, and its estimator counts the full 16-bit gradients for stage 2 as well (4Ψ + 16Ψ/N), while the
stage-2 engine reduces them into a bucket and keeps only its partition — the ledger follows the engine
and ``deepspeed_zero2_estimate`` reproduces the estimator.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final, Literal, get_args

from .errors import InputError

Strategy = Literal["ddp", "zero1", "zero2", "zero3", "fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-hybrid", "fsdp2",
                   "megatron", "megatron-distopt"]
Offload = Literal["none", "optimizer", "params", "both"]
#: Pipeline schedules (``torch.distributed.pipelining``'s ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, and
#: the zero-bubble ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble of Qi et al. 2024, arXiv 2401.10241).
Schedule = Literal["1f1b", "interleaved-1f1b", "gpipe", "interleaved-zb", "zbv"]
SCHEDULES: Final = get_args(Schedule)
STRATEGIES: Final = get_args(Strategy)
SCHEDULE_LABELS: Final = {"1f1b": "1F1B", "interleaved-1f1b": "Interleaved 1F1B", "gpipe": "GPipe",
                          "interleaved-zb": "Interleaved zero bubble", "zbv": "Zero bubble V"}
#: The zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241): a backward is
#: split into the input's gradient ("I", sent at once) and the weights' ("W", deferred to fill the bubbles).
ZERO_BUBBLE: Final = ("interleaved-zb", "zbv")
#: The schedules that run more than one stage per GPU (``--virtual-stages``): how many each allows.
VIRTUAL_STAGES: Final = {"interleaved-1f1b": "2 or more", "interleaved-zb": "1 or more", "zbv": "exactly 2"}
OFFLOADS: Final = get_args(Offload)

#: DeepSpeed's reduce_bucket_size / allgather_bucket_size default: 5e8 elements.
DS_BUCKET_ELEMENTS: Final = 500_000_000
#: DDP's default bucket_cap_mb (25 MiB); buckets together hold every gradient once.
DDP_BUCKET_BYTES: Final = 25 * 2**20
#: DeepSpeed's additional_buffer_factor for host memory.
HOST_BUFFER_FACTOR: Final = 1.5

STRATEGY_LABELS: Final = {
    "ddp": "DDP (replicated)",
    "zero1": "ZeRO-1 (optimizer state sharded)",
    "zero2": "ZeRO-2 (+ gradients sharded)",
    "zero3": "ZeRO-3 (+ parameters sharded)",
    "fsdp-full-shard": "FSDP FULL_SHARD",
    "fsdp-shard-grad-op": "FSDP SHARD_GRAD_OP",
    "fsdp-hybrid": "FSDP HYBRID_SHARD",
    "fsdp2": "FSDP2 (fully_shard)",
    "megatron": "Megatron-LM DDP (fp32 main grads)",
    "megatron-distopt": "Megatron-LM distributed optimizer",
}
#: Short strategy names for running text (the window's combo shows :data:`STRATEGY_LABELS`).
STRATEGY_SHORT: Final = {
    "ddp": "DDP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3",
    "fsdp-full-shard": "FSDP full shard",
    "fsdp-shard-grad-op": "FSDP shard-grad-op",
    "fsdp-hybrid": "FSDP hybrid shard",
    "fsdp2": "FSDP2",
    "megatron": "Megatron DDP",
    "megatron-distopt": "Megatron dist-opt",
}
#: Strategies whose mixed precision computes in bf16 weights without autocast (FSDP2's MixedPrecisionPolicy;
#: Megatron-LM's bf16 model with fp32 main weights in the optimizer).
BF16_COMPUTE: Final = ("fsdp2", "megatron", "megatron-distopt")
#: Strategies that always split the vocabulary over the tensor-parallel GPUs: Megatron-LM builds the embedding as a
#: ``VocabParallelEmbedding`` (megatron/core/tensor_parallel/layers.py), the output layer as a
#: ``ColumnParallelLinear`` and the loss as ``vocab_parallel_cross_entropy``
#: (megatron/core/models/gpt/gpt_model.py, megatron/core/tensor_parallel/cross_entropy.py); no flag keeps them whole.
VOCAB_SPLIT_ALWAYS: Final = ("megatron", "megatron-distopt")
#: Strategies that split it unless told not to: those, and FSDP2 beside tensor parallelism as torchtitan runs it
#: (``ParallelDims.loss_parallel_enabled``: tensor parallelism on and ``--parallelism.disable_loss_parallel`` off,
#: torchtitan/distributed/parallel_dims.py). DDP, ZeRO and FSDP1 keep transformers' plans, the vocabulary whole.
VOCAB_SPLIT_DEFAULT: Final = (*VOCAB_SPLIT_ALWAYS, "fsdp2")
#: Preference when several strategies fit: least communication first.
PREFERENCE: Final = ("ddp", "megatron", "zero1", "megatron-distopt", "zero2", "fsdp-shard-grad-op", "fsdp-hybrid",
                     "zero3", "fsdp2", "fsdp-full-shard")


def default_loss_parallel(strategy: str, tp: int) -> bool:
    """Whether the vocabulary is split over the ``tp`` tensor-parallel GPUs when nobody says: always under
    Megatron-LM's strategies, by default under FSDP2 as torchtitan does, never for DDP, ZeRO and FSDP1
    (transformers' plans; :data:`VOCAB_SPLIT_DEFAULT`), and never with one GPU's worth of tensor parallelism
    (torchtitan's ``loss_parallel_enabled`` needs ``tp_enabled``)."""
    return tp > 1 and strategy in VOCAB_SPLIT_DEFAULT


def chosen_loss_parallel(choice: bool | None, strategy: str, tp: int, block_model: bool = True) -> bool:
    """The vocabulary split of a layout from what the user said: ``choice`` when given, else
    :func:`default_loss_parallel` where memcalc models the split (a family with a block model; the fitted method keeps
    the vocabulary whole, and ``result.setup_warnings`` says what that leaves out). Keeping it whole under Megatron-LM's
    strategies is an :class:`InputError`: Megatron-LM has no such option."""
    if choice is False and tp > 1 and strategy in VOCAB_SPLIT_ALWAYS:
        raise InputError("loss_parallel", "Megatron-LM always splits the vocabulary over the tensor-parallel GPUs (its "
                                          "VocabParallelEmbedding and column-parallel output layer) and cannot keep "
                                          "the embedding and head whole: drop --no-loss-parallel, or choose another "
                                          "strategy")
    if choice is not None:
        return choice
    return block_model and default_loss_parallel(strategy, tp)


def offload_choices(strategy: str) -> tuple[str, ...]:
    """The offload kinds that differ for ``strategy``: DDP has none; ZeRO-1/2 offload the optimizer
    (ZeRO-Offload); ZeRO-3 also the parameters (ZeRO-Infinity, which here implies the optimizer: ``params``
    and ``both`` are the same); FSDP's one ``CPUOffload`` moves parameters, gradients and the step together,
    so every non-``none`` kind gives the same ledger and ``both`` names it."""
    if strategy in ("ddp", "megatron", "megatron-distopt"):
        return ("none",)
    if strategy in ("zero1", "zero2"):
        return ("none", "optimizer")
    if strategy == "zero3":
        return ("none", "optimizer", "both")
    return ("none", "both")


def closest_offload(strategy: str, offload: str) -> str:
    """The offload of :func:`offload_choices` that gives ``offload``'s ledger (or the nearest one there is)."""
    choices = offload_choices(strategy)
    if offload in choices:
        return offload
    if choices == ("none",):
        return "none"
    if strategy.startswith("fsdp"):
        return "both"
    return "both" if "both" in choices else "optimizer"  # ZeRO-3: params = both; ZeRO-1/2: the optimizer only


#: The most GPUs a layout may name (the largest clusters trained on have ~10^5).
MAX_PARALLEL_GPUS: Final = 2**20


@dataclass(frozen=True)
class Parallelism:
    """How a training step is spread over GPUs."""

    gpus: int = 1
    strategy: Strategy = "ddp"
    node_size: int = 8
    offload: Offload = "none"
    ep: int = 1  # expert parallelism: the routed experts split over this many GPUs (see ``expert_parallel_states``)
    #: FSDP2's ``reshard_after_forward``: free each unit's gathered weights after its forward (gather again in
    #: backward), or keep them until its backward.
    reshard_after_forward: bool = True
    #: Tensor parallelism: each decoder layer's attention heads and MLP width split over this many GPUs, as
    #: transformers' own plans split them (``base_model_tp_plan``: q/k/v and gate/up column-wise, o and down
    #: row-wise; embeddings, norms and the head replicated). The data-parallel strategy runs over ``gpus / tp``.
    tp: int = 1
    #: Pipeline parallelism: the decoder layers split into ``pp`` stages on as many GPUs (``core.pipeline``), run by
    #: ``schedule`` over the step's micro-batches (the gradient-accumulation count), ``virtual_stages`` stages per GPU
    #: under the interleaved schedule.
    pp: int = 1
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    #: Sequence parallelism beside tensor parallelism (Korthikanti et al. 2022): what the tensor-parallel regions
    #: leave whole (norms, residual stream) is split along the sequence over the tensor-parallel ranks.
    sp: bool = False
    #: Vocabulary parallelism beside tensor parallelism (torchtitan's loss parallel, Megatron-LM's vocab-parallel
    #: embedding and cross-entropy): the embedding's rows and the head's columns split over the tensor-parallel
    #: ranks, each computing the loss over its slice of the logits. Off here; the front ends start from
    #: :func:`default_loss_parallel`, and a setup under Megatron-LM's strategies has it on whatever this says
    #: (``TrainingSetup``: Megatron-LM always splits the vocabulary).
    loss_parallel: bool = False
    #: Context parallelism: each sequence split over this many GPUs, attention run as ring attention over the chunks
    #: (torchtitan's ``context_parallel``); the sharded state is split over ``dp × cp``, as torchtitan's mesh does.
    cp: int = 1
    #: FSDP2's hybrid sharding (HSDP, torchtitan's ``data_parallel_replicate_degree``): the data-parallel GPUs form
    #: ``dp_replicate`` replicas, each ``fully_shard``-ed over its ``dp / dp_replicate`` GPUs (× ``cp``), on a 2-D
    #: mesh; the gradients are reduce-scattered within a replica and then all-reduced across replicas in place.
    dp_replicate: int = 1
    #: Expert tensor parallelism, Megatron-LM's ``--expert-tensor-parallel-size``: each routed expert's weights split
    #: over this many GPUs (its first projection column-wise, its last row-wise), beside the ``ep``-way split of the
    #: experts themselves; ``ep × etp`` GPUs then hold one copy of every expert. Megatron-LM's strategies only:
    #: transformers, which the other strategies' traces run, keeps every expert whole.
    etp: int = 1

    def __post_init__(self) -> None:
        for name in ("gpus", "node_size", "ep", "tp", "pp", "virtual_stages", "cp", "dp_replicate", "etp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(name, f"must be a positive integer, got {value!r}")
            if value > MAX_PARALLEL_GPUS:
                raise InputError(name, f"must be at most {MAX_PARALLEL_GPUS:,}, got {value:,}")
        if self.strategy not in STRATEGIES:
            raise InputError("strategy", f"must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise InputError("reshard_after_forward", f"must be on or off, got {self.reshard_after_forward!r}")
        if not self.reshard_after_forward and self.strategy != "fsdp2":
            raise InputError("reshard_after_forward", "reshard after forward is FSDP2's option (--strategy fsdp2); "
                                                      "FSDP1's SHARD_GRAD_OP is its no-reshard strategy")
        if self.offload not in OFFLOADS:
            raise InputError("offload", f"must be one of {', '.join(OFFLOADS)}, got {self.offload!r}")
        if self.offload in ("params", "both") and self.strategy not in ("zero3", "fsdp-full-shard", "fsdp-hybrid",
                                                                          "fsdp-shard-grad-op", "fsdp2"):
            raise InputError("offload", "parameter offload needs a strategy that shards parameters "
                                        "(zero3, fsdp-full-shard or fsdp-hybrid)")
        if self.offload != "none" and self.strategy == "ddp":
            raise InputError("offload", "DDP cannot offload; use zero1/2/3 or FSDP")
        if self.offload != "none" and self.strategy.startswith("megatron"):
            raise InputError("offload", "Megatron-LM's optimizer offload is not modelled; use zero1/2/3 or FSDP")
        if self.gpus % self.ep:
            raise InputError("ep", f"expert parallelism over {self.ep} GPUs needs a GPU count it divides, "
                                   f"got {self.gpus}")
        if self.gpus % self.tp:
            raise InputError("tp", f"{self.gpus:,} GPUs cannot be split into tensor-parallel groups of {self.tp}: "
                                   "the GPU count must be a multiple of tp")
        if self.gpus % (self.tp * self.pp):
            raise InputError("pp", f"{self.gpus:,} GPUs cannot be split into {self.pp} pipeline stages of "
                                   f"{self.tp} tensor-parallel GPU(s): the GPU count must be a multiple of tp × pp")
        if self.gpus % (self.tp * self.pp * self.cp):
            raise InputError("cp", f"{self.gpus:,} GPUs cannot be split into context-parallel groups of {self.cp}: the "
                                   "GPU count must be a multiple of tp × pp × cp")
        if self.cp > 1 and self.offload != "none":
            raise InputError("cp", "context parallelism beside offload is not modelled yet")
        if self.schedule not in SCHEDULES:
            raise InputError("schedule", f"must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        v = self.virtual_stages
        if (self.schedule == "interleaved-1f1b" and v == 1) or (self.schedule == "zbv" and v != 2) \
                or (v > 1 and self.schedule not in VIRTUAL_STAGES):
            runs = VIRTUAL_STAGES.get(self.schedule, "exactly 1")
            raise InputError("virtual_stages", f"{SCHEDULE_LABELS[self.schedule]} runs {runs} stage(s) per GPU, got "
                                               f"{v} (more than one is for " + ", ".join(
                                                   SCHEDULE_LABELS[k] for k in VIRTUAL_STAGES) + ")")
        if self.schedule in ZERO_BUBBLE and self.strategy == "fsdp2" and self.reshard_after_forward:
            raise InputError("reshard_after_forward", "PyTorch's zero-bubble stages under FSDP2 that reshards after "
                                                      "forward leave the weight gradients of every stage but the first "
                                                      "wrong (torch 2.13, measured): turn reshard after forward off, "
                                                      "as torchtitan does beside pipeline parallelism")
        if self.strategy == "fsdp2" and (self.tp > 1 or self.pp > 1) and self.dp * self.cp == 1:
            raise InputError("strategy", f"FSDP2 over one data-parallel GPU shards nothing ({self.gpus:,} GPU(s) in "
                                         f"{self.pp} pipeline stage(s) of {self.tp} tensor-parallel GPU(s)), and "
                                         "torchtitan applies no fully_shard there: choose DDP, or twice the GPUs")
        if self.dp_replicate > 1:
            self._check_hybrid()
        if self.pp == 1 and (self.schedule != "1f1b"):
            raise InputError("schedule", "a pipeline schedule needs pipeline stages (--pp 2 or more)")
        if not isinstance(self.sp, bool):
            raise InputError("sp", f"must be on or off, got {self.sp!r}")
        if not isinstance(self.loss_parallel, bool):
            raise InputError("loss_parallel", f"must be on or off, got {self.loss_parallel!r}")
        if self.loss_parallel and self.tp == 1:
            raise InputError("loss_parallel", "loss parallelism splits the vocabulary over the tensor-parallel GPUs: "
                                              "it needs --tp 2 or more")
        if self.sp and self.tp == 1:
            raise InputError("sp", "sequence parallelism splits what tensor parallelism leaves whole: it needs --tp 2 "
                                   "or more")
        if self.pp > 1 and self.ep > 1 and (self.gpus // self.pp) % self.ep:
            raise InputError("ep", f"expert parallelism splits the experts over {self.ep} of a pipeline stage's "
                                   f"{self.gpus // self.pp:,} GPUs: it must divide them")
        if self.pp > 1 and self.offload != "none":
            raise InputError("offload", "offload beside pipeline parallelism is not modelled yet")
        if self.tp > 1 and self.ep > 1 and self.ep % self.tp:
            raise InputError("ep", f"expert parallelism beside tensor parallelism needs ep a multiple of tp "
                                   f"(transformers' layout: the GPUs of a tensor-parallel group hold experts of one "
                                   f"expert-parallel group), got ep {self.ep}, tp {self.tp}")
        if self.tp > 1 and self.offload != "none":
            raise InputError("offload", "offload beside tensor parallelism is not modelled yet")
        if self.etp > 1:
            self._check_expert_tensor()

    def _check_expert_tensor(self) -> None:
        """Megatron-LM's expert tensor parallelism: its strategies, and ``ep × etp`` dividing the GPUs of a stage's
        tensor- and data-parallel groups (:class:`InputError` naming the field)."""
        if not self.strategy.startswith("megatron"):
            raise InputError("etp", "expert tensor parallelism is Megatron-LM's (--expert-tensor-parallel-size): "
                                    "transformers keeps every expert whole, and so do the DDP, ZeRO and FSDP steps "
                                    "memcalc traces; choose --strategy megatron or megatron-distopt, or leave etp at 1")
        stage = self.dp * self.tp
        if stage % (self.ep * self.etp):
            raise InputError("etp", f"the experts split over ep × etp = {self.ep} × {self.etp} GPUs of a pipeline "
                                    f"stage's {stage:,} data- and tensor-parallel ones: ep × etp must divide them")

    def _check_hybrid(self) -> None:
        """FSDP2's hybrid sharding: replicas of FSDP2 groups that still shard (:class:`InputError` naming the field)."""
        r = self.dp_replicate
        if self.strategy != "fsdp2":
            raise InputError("dp_replicate", "replicas of sharded groups are FSDP2's hybrid sharding (--strategy "
                                             "fsdp2; FSDP1's is --strategy fsdp-hybrid, DDP replicates every GPU "
                                             "already)")
        if self.dp % r:
            raise InputError("dp_replicate", f"{self.dp:,} data-parallel GPU(s) cannot form {r:,} equal replicas: "
                                             "the replica count must divide gpus / (tp × pp × cp)")
        if (self.dp // r) * self.cp < 2:
            raise InputError("dp_replicate", f"{r:,} replicas of {self.dp // r:,} GPU(s) leave FSDP2 nothing to shard: "
                                             "choose DDP, or fewer replicas")
        if self.ep > 1 and self.pp > 1:
            raise InputError("dp_replicate", "FSDP2's hybrid sharding beside expert parallelism in pipeline stages is "
                                             "not modelled yet: leave the replicas at 1")
        if self.ep > 1 and (self.gpus // r) % self.ep:
            raise InputError("ep", f"beside FSDP2's hybrid sharding the experts split over {self.ep} GPUs of one "
                                   f"replica's {self.gpus // r:,}: ep must divide them")

    def with_strategy(self, strategy: Strategy) -> Parallelism:
        """This layout under ``strategy``: a vocabulary split left at its strategy's default follows the new
        strategy's (:func:`default_loss_parallel`: comparing DDP with FSDP2 beside tensor parallelism weighs each as it
        runs by default), one the user chose against it stays."""
        split = self.loss_parallel
        if split == default_loss_parallel(self.strategy, self.tp):
            split = default_loss_parallel(strategy, self.tp)
        return replace(self, strategy=strategy, loss_parallel=split)

    @property
    def fsdp2_ranks(self) -> int:
        """The GPUs FSDP2 shards each parameter over: the data- and context-parallel ones (torchtitan's
        ``dp_shard_cp``), within one replica under hybrid sharding."""
        return self.dp * self.cp // self.dp_replicate

    @property
    def hybrid_text(self) -> str:
        """`` in each of 2 replicas (hybrid sharding: the gradients then all-reduced across them)``, or ""."""
        return (f" in each of {self.dp_replicate} replicas (hybrid sharding: the gradients then all-reduced across "
                "them)") if self.dp_replicate > 1 else ""

    @property
    def dp(self) -> int:
        """Data-parallel replicas of each model-parallel shard (one tensor-parallel group of one pipeline stage): the
        GPUs the strategy runs over."""
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def model_parallel_text(self) -> str:
        """``TP 8 + SP × PP 2 (1F1B)``: the model-parallel dimensions, or "" when there are none."""
        parts = []
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}" + (" + SP" if self.sp else "") + (" + loss parallel" if self.loss_parallel
                                                                            else ""))
        if self.pp > 1:
            label = SCHEDULE_LABELS[self.schedule] + (f" ×{self.virtual_stages}" if self.virtual_stages > 1 else "")
            parts.append(f"PP {self.pp} ({label})")
        return " × ".join(parts)

    @property
    def shards(self) -> int:
        """Over how many GPUs the sharded state is split."""
        if self.strategy in ("ddp", "megatron"):
            return 1
        if self.strategy == "fsdp-hybrid":
            return min(self.dp, max(1, self.node_size // (self.tp * self.pp)))
        return self.dp // self.dp_replicate  # FSDP2's hybrid sharding: within one replica

    @property
    def is_distributed(self) -> bool:
        return self.gpus > 1 or self.strategy != "ddp" or self.offload != "none" or self.ep > 1 or self.etp > 1

    @property
    def expert_split(self) -> int:
        """Over how many GPUs one copy of every routed expert is spread: ``ep × etp``."""
        return self.ep * self.etp

    @property
    def experts_text(self) -> str:
        """``, experts over 8``, ``, experts over 8 × 2 (expert tensor parallel)`` or, with the experts split by
        tensor only, ``, each expert over 2 (expert tensor parallel)``; "" when they are not split."""
        if self.expert_split == 1:
            return ""
        if self.ep == 1:
            return f", each expert over {self.etp} (expert tensor parallel)"
        return f", experts over {self.ep}" + (f" × {self.etp} (expert tensor parallel)" if self.etp > 1 else "")

    @property
    def gpus_per_node(self) -> int:
        return min(self.gpus, self.node_size)


@dataclass(frozen=True)
class ModelStates:
    """Per-GPU bytes of the model state in each phase, and host memory for offload."""

    parameters: dict[str, int]
    gradients: dict[str, int]
    optimizer_state: int
    optimizer_temporaries: int
    host_bytes: int
    notes: tuple[str, ...]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def model_states(
    par: Parallelism,
    num_params: int,
    largest_unit: int,
    precision: str,
    state_bytes_single: int,
    step_temporaries_single: int,
    matmul_copy_bytes: int,
    root_unit: int,
) -> ModelStates:
    """Per-GPU parameters, gradients (per phase), optimizer state and host bytes under ``par``.

    ``state_bytes_single`` and ``step_temporaries_single`` are the single-GPU optimizer costs;
    ``matmul_copy_bytes`` the autocast 16-bit weight copies (mixed, DDP only); ``root_unit`` the
    parameters of FSDP's root unit (embeddings, final norm, LM head), which stays gathered.
    """
    psi, n, s = num_params, par.shards, par.strategy
    mixed = precision == "mixed"
    full_bytes = 2 if precision in ("bf16", "bf16-autocast") else 4  # weights and gradients (autocast keeps fp32)
    w = 2 if precision in ("mixed", "bf16", "bf16-autocast") else 4  # weights as ZeRO/FSDP kernels read them
    g = w  # gradients as backward produces them under ZeRO/FSDP
    notes: list[str] = []
    c = {"w_full": 0, "w_part": 0, "master_part": 0, "gathered": 0, "copies": 0,
         "g_full": 0, "g_part": 0, "g_bucket": 0, "g_fp32_part": 0, "unit_grads": 0, "ddp_buckets": 0, "g_buffer": 0}
    state = _ceil_div(state_bytes_single, n)
    temps = _ceil_div(step_temporaries_single, n)
    if s == "ddp":
        c["w_full"], c["g_full"], c["copies"] = psi * full_bytes, psi * full_bytes, matmul_copy_bytes
        if par.dp > 1:
            c["ddp_buckets"] = psi * full_bytes
            notes.append("DDP keeps every gradient once more in its communication buckets "
                         "(gradient_as_bucket_view=False, the default)")
    elif s in ("zero1", "zero2"):
        c["w_full"] = psi * w
        c["master_part"] = _ceil_div(psi * 4, n) if mixed else 0
        c["g_fp32_part"] = _ceil_div(psi * 4, n) if mixed else 0
        if s == "zero1":
            c["g_full"] = psi * g
        else:
            c["g_part"] = _ceil_div(psi * g, n)
            c["g_bucket"] = min(psi, DS_BUCKET_ELEMENTS) * g
            notes.append("ZeRO-2 reduces gradients through a 5e8-element bucket and keeps its partition; "
                         "DeepSpeed's estimator counts all 16-bit gradients (4Ψ + 16Ψ/N)")
    elif s in ("megatron", "megatron-distopt"):
        # Megatron-LM: the model's weights in 16 bits (bf16 compute), the optimizer's fp32 main weights, and one fp32
        # main-grad buffer every backward accumulates into (gradient_accumulation_fusion) and that is zeroed, not
        # freed, each step; the distributed optimizer splits the main weights and the moments over the data-parallel
        # GPUs. Megatron's theoretical memory: 18 B/param, or 6 + 12/dp.
        c["w_full"] = psi * w
        c["master_part"] = _ceil_div(psi * 4, n) if mixed else 0
        c["g_buffer"] = psi * (4 if mixed else g)
        notes.append(f"{STRATEGY_LABELS[s]}: 16-bit weights, an fp32 main-grad buffer kept through the step"
                     + (", the fp32 main weights and the moments split over the data-parallel GPUs"
                        if s == "megatron-distopt" else ", the fp32 main weights and the moments on every GPU"))
    else:  # zero3 and FSDP shard the parameters
        fsdp = s.startswith("fsdp")
        shard_bytes = 4 if (fsdp and mixed) else w  # FSDP shards fp32 flat parameters; ZeRO-3 16-bit ones
        c["w_part"] = _ceil_div(psi * shard_bytes, n)
        c["master_part"] = _ceil_div(psi * 4, n) if (mixed and not fsdp) else 0
        c["g_part"] = _ceil_div(psi * (4 if mixed else g), n)
        if s == "fsdp-shard-grad-op" or (s == "fsdp2" and not par.reshard_after_forward):
            c["gathered"] = psi * w  # not resharded after forward: every unit stays gathered until backward
        elif fsdp:
            c["gathered"] = root_unit * w + 2 * largest_unit * w  # root unit + current and prefetched unit
        else:
            c["gathered"] = 2 * largest_unit * w  # current and prefetched unit
        c["unit_grads"] = largest_unit * g
        if s == "fsdp2" and mixed:  # reduce_dtype=fp32: the unit's bf16 gradients are cast up to reduce-scatter
            c["unit_grads"] += largest_unit * 4
        notes.append(f"{STRATEGY_LABELS[s]}: the largest unit gathered at once has {largest_unit:,} parameters"
                     + (f"; sharded over {n:,} GPUs{par.hybrid_text}" if par.dp_replicate > 1 else ""))
    host = 0
    if par.offload != "none":
        if s.startswith("fsdp"):
            # FSDP's CPUOffload moves the parameter and gradient shards; the step then runs on the host.
            host += c["w_part"] + c["g_part"] + state
            c["w_part"] = c["g_part"] = 0
            notes.append("FSDP CPUOffload: parameter and gradient shards and the optimizer step on the host")
        else:
            # ZeRO-Offload streams each reduced gradient partition to the host as fp32, where the step runs;
            # the GPU keeps the 16-bit weights and the reduce bucket (DeepSpeed's estimators: 2Ψ for stage 2,
            # 2Ψ/N + 4·L for stage 3).
            host += state + c["master_part"] + _ceil_div(psi * 4, n)
            c["master_part"] = c["g_fp32_part"] = c["g_part"] = 0
            notes.append("ZeRO-Offload: optimizer state, fp32 master weights and gradient partitions on the host; "
                         "the step runs on the CPU")
            if par.offload in ("params", "both"):
                host += c["w_part"]
                c["w_part"] = 0
                notes.append("ZeRO-Infinity parameter offload: only the gathered units live on the GPU")
        state = temps = 0
    params = {}
    grads = {}
    for ph in ("load", "forward", "backward", "optimizer_step"):
        active = ph in ("forward", "backward")
        params[ph] = c["w_full"] + c["w_part"] + (c["master_part"] if ph != "load" else 0) \
            + (c["gathered"] + c["copies"] if active else 0)
        # DDP's buckets and Megatron-LM's main-grad buffer are allocated as the model is wrapped (DDP's Reducer
        # makes its flat buckets in its constructor: a real 2-process DDP run holds them at load)
        grads[ph] = c["ddp_buckets"] + c["g_buffer"]
    grads["forward"] += c["g_bucket"]
    grads["backward"] += c["g_full"] + c["g_part"] + c["g_bucket"] + c["unit_grads"]
    grads["optimizer_step"] += (0 if par.offload != "none" else c["g_full"]) + c["g_part"] + c["g_fp32_part"]
    host_bytes = int(host * par.gpus_per_node * HOST_BUFFER_FACTOR)
    return ModelStates(params, grads, state, temps, host_bytes, tuple(notes))


# ---- the engines' own formulas, for reference and tests -----------------------------------------
def zero_paper_model_states(num_params: int, gpus: int, stage: int, k: int = 12) -> float:
    """ZeRO paper, Figure 1: bytes per GPU for model states at stage 0 (DDP) to 3 (Pos+g+p)."""
    psi = num_params
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 2 * psi + 2 * psi + k * psi / gpus
    if stage == 2:
        return 2 * psi + (2 + k) * psi / gpus
    return (2 + 2 + k) * psi / gpus


def deepspeed_zero2_estimate(num_params: int, gpus_per_node: int = 1, nodes: int = 1,
                             cpu_offload: bool = False, buffer_factor: float = HOST_BUFFER_FACTOR) -> tuple[int, int]:
    """DeepSpeed's ``estimate_zero2_model_states_mem_needs``: (host bytes, GPU bytes)."""
    total = gpus_per_node * nodes
    if cpu_offload:
        gpu = 2 * num_params
        cpu = num_params * max(4 * total, 16) * buffer_factor
    else:
        gpu = 4 * num_params + int(16 * num_params / total)
        cpu = num_params * 4 * gpus_per_node * buffer_factor
    return int(cpu), int(gpu)


def deepspeed_zero3_estimate(num_params: int, largest_layer: int, gpus_per_node: int = 1, nodes: int = 1,
                             cpu_offload: bool = False, offload_params: bool = False, zero_init: bool = True,
                             buffer_factor: float = HOST_BUFFER_FACTOR) -> tuple[int, int]:
    """DeepSpeed's ``estimate_zero3_model_states_mem_needs``: (host bytes, GPU bytes)."""
    total = gpus_per_node * nodes
    per_node = 1 / nodes
    largest = 4 * largest_layer
    if cpu_offload:
        if offload_params:
            gpu = largest
            cpu = num_params * (18 * per_node if zero_init else max(4 * gpus_per_node, 18 * per_node)) * buffer_factor
        else:
            gpu = largest + int(2 * num_params / total)
            cpu = num_params * (16 * per_node if zero_init else max(4 * gpus_per_node, 16 * per_node)) * buffer_factor
    else:
        gpu = largest + int(18 * num_params / total)
        cpu = (largest_layer if zero_init else num_params) * 4 * gpus_per_node * buffer_factor
    return int(cpu), int(gpu)


def megatron_theoretical_memory(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int,
                                *, swiglu: bool = True, rmsnorm: bool = True, untied: bool = True, tp: int = 1,
                                pp: int = 1, dp: int = 1, distributed_optimizer: bool = False, seq: int = 2048,
                                micro_batch: int = 1, microbatches: int | None = None,
                                virtual: int | None = None, experts: int = 1,
                                moe_ffn: int | None = None) -> tuple[float, float]:
    """Megatron-LM's ``theoretical_memory_usage``: (weights and optimizer, activations) in bytes for the most loaded
    rank, under its assumptions (bf16 weights, fp32 main grads and weights, Adam: 18 B/param, or 6 + 12/dp with the
    distributed optimizer; the most loaded shard holds ``(block/pp + embedding)/tp``; activations by Korthikanti et
    al. 2022, Table 2, with sequence parallelism and selective recomputation, on the first stage).

    A mixture of experts (``experts`` > 1, each ``moe_ffn`` wide, every layer an MoE layer): each layer's MLP is the
    experts plus the router (``experts × hidden``), as Megatron counts them. Its function has no expert-parallel
    term: the most loaded shard holds every expert, whatever ``--expert-model-parallel-size`` says."""
    norm = 1 if rmsnorm else 2
    gated = 3 / 2 if swiglu else 1
    attn = 2 * hidden * hidden * (1 + kv_heads / heads)
    mlp = 2 * hidden * ffn * gated if experts == 1 else \
        2 * hidden * (moe_ffn or ffn) * experts * gated + experts * hidden
    layer = mlp + 2 * hidden * norm + attn
    block = layer * layers + norm * hidden
    embedding = hidden * vocab
    shard = (block / pp + embedding) / tp
    if untied and pp == 1:
        shard += embedding / tp
    weights = shard * (6 + 12 / dp if distributed_optimizer else 18)
    act = seq * micro_batch * hidden * (18 + 4 * ffn / hidden) * layers
    act += 8 * seq * micro_batch * pp + seq * micro_batch * hidden * pp
    if virtual is not None:
        act *= 1 + (pp - 1) / (pp * virtual)
    elif pp > 1 and microbatches is not None:
        act *= min(1, microbatches / pp)
    if pp == 1:
        act += seq * micro_batch * hidden * 4 * (1 + vocab / hidden)
    return weights, act / tp


def check_experts(model_type: str, num_experts: int, ep: int, etp: int = 1) -> None:
    """:class:`InputError` naming ``ep`` (or ``etp``) unless they split this model's routed experts evenly."""
    if ep > 1 and not num_experts:
        raise InputError("ep", f"model_type {model_type!r} has no routed experts to split (expert parallelism needs "
                               "a mixture of experts)")
    if etp > 1 and not num_experts:
        raise InputError("etp", f"model_type {model_type!r} has no routed experts to split (expert tensor "
                                "parallelism needs a mixture of experts)")
    if num_experts % ep:
        raise InputError("ep", f"{num_experts} experts per layer do not split evenly over {ep} GPUs")


def _expert_copies(par: Parallelism) -> tuple[int, int]:
    """How many GPUs of one pipeline stage hold the same routed experts, and how many of those one replica has (what
    FSDP2 shards them over; the caller folds context parallelism into ``par.dp``, as the states shard over both)."""
    split = par.expert_split
    # every expert split times over: gpus / (pp · split) copies of each (with tensor parallelism the experts run whole,
    # transformers' plan, so its GPUs count as copies too)
    copies = max(1, par.dp * par.tp // split) if split > 1 else par.dp
    # FSDP2's hybrid sharding: the experts sharded over one replica's copies of them, as FSDP2 over that replica
    return copies, max(1, copies // par.dp_replicate)


def check_expert_shards(shards: int, ep: int, experts: int, dim1_gcd: int) -> None:
    """:class:`InputError` naming ``gpus`` where FSDP2 cannot place the routed experts as torchtitan does: over
    ``shards`` GPUs that, times ``ep``, outnumber the ``experts`` per layer it shards them along their second
    dimension (``Shard(1)``, ``torchtitan/distributed/fsdp.py``), and PyTorch's ``fully_shard`` splits a dimension
    other than the first only evenly (it raises ``NotImplementedError``: "FSDP does not support uneven sharding on
    dim 1"). ``dim1_gcd``: the greatest common divisor of those second dimensions (0: unknown, not checked)."""
    if experts and dim1_gcd and shards * ep > experts and dim1_gcd % shards:
        raise InputError("gpus", f"FSDP2 shards the routed experts along their second dimension over {shards} GPUs "
                                 f"(torchtitan's placement where the GPUs times ep outnumber the {experts} "
                                 f"experts), and PyTorch's fully_shard splits that dimension only evenly: "
                                 f"{dim1_gcd:,} does not divide by {shards} (a layout whose GPUs per copy of the "
                                 "experts divide it runs)")


def check_expert_placement(par: Parallelism, experts: int, dim1_gcd: int) -> None:
    """:func:`check_expert_shards` for a layout (context parallelism folded into ``par.dp`` by the caller): only
    FSDP2 shards along the second dimension."""
    if par.strategy == "fsdp2":
        check_expert_shards(_expert_copies(par)[1], par.ep, experts, dim1_gcd)


def expert_parallel_states(par: Parallelism, num_params: int, expert_params: int, dense_unit: int,
                           expert_unit: int, precision: str, state_bytes_single: int, step_temporaries_single: int,
                           matmul_copy_bytes: int, root_unit: int, experts: int = 0) -> ModelStates:
    """Per-GPU model states with the routed experts split over ``par.ep`` GPUs (expert parallelism, as torchtitan
    and Megatron-LM lay it out): every GPU holds ``1/ep`` of each MoE layer's experts, an expert group is
    replicated (DDP) or sharded (ZeRO/FSDP) over the ``gpus/ep`` GPUs that hold the same experts, and the rest
    of the model (attention, shared experts, router, embeddings) is laid out over all GPUs as the strategy says.
    The single-GPU optimizer costs and autocast copies are split in proportion to the parameters.

    FSDP2 shards each parameter along its first dimension, which for transformers' fused experts is the expert:
    with ``experts`` per layer, the most loaded GPU holds ``ceil(local experts / shards)`` of them (traced: 60
    experts over 8 GPUs are 8 on the first, not 7.5). Where the shards times ``ep`` outnumber the experts, torchtitan
    shards them along their second dimension instead (``torchtitan/distributed/fsdp.py``; the trace does too), evenly:
    Mixtral-8x7B's 8 experts over 64 GPUs are 1/64 of them on each, not one whole expert on the first eight.

    Megatron-LM's expert tensor parallelism (``par.etp``) splits each expert's weights over ``etp`` GPUs more, as
    its ``--expert-tensor-parallel-size`` does: one copy of every expert over ``ep × etp`` GPUs, and
    ``dp · tp / (ep · etp)`` copies of it in a stage (its expert-data-parallel group, which the distributed optimizer
    shards over)."""
    split = par.expert_split
    copies, replica_copies = _expert_copies(par)
    padded = par.strategy == "fsdp2" and experts > 0 and (experts // par.ep) % replica_copies != 0 \
        and replica_copies * par.ep <= experts  # more shards than experts: torchtitan's Shard(1), even
    if split == 1 and not padded:
        unit = expert_unit + dense_unit  # not split: the caller's unit
        return model_states(par, num_params, unit, precision, state_bytes_single, step_temporaries_single,
                            matmul_copy_bytes, root_unit)
    dense = num_params - expert_params
    share = expert_params // split
    if padded:
        local, shards = experts // par.ep, replica_copies
        share = share * -(-local // shards) * shards // local

    def part(n: int) -> tuple[int, int, int]:
        return (state_bytes_single * n // num_params, step_temporaries_single * n // num_params,
                matmul_copy_bytes * n // num_params)

    d = model_states(replace(par, ep=1, etp=1), dense, dense_unit, precision, *part(dense), root_unit)
    e = model_states(replace(par, gpus=replica_copies * par.pp * par.cp, tp=1, ep=1, etp=1, sp=False,
                             loss_parallel=False, dp_replicate=1), share, expert_unit // split, precision,
                     *part(share), 0)
    if split == 1:
        note = (f"FSDP2 shards the fused experts expert by expert: {experts} per layer over {par.shards} GPUs are "
                f"{-(-experts // par.shards)} on the most loaded one")
    else:
        over = (f"Expert parallelism over {par.ep} GPUs" if par.etp == 1 else
                f"Experts split over ep × etp = {par.ep} × {par.etp} GPUs (Megatron-LM's expert tensor parallelism: "
                f"each expert's weights over {par.etp} of them)")
        note = (f"{over}: each holds 1/{split} of the routed experts "
                f"({expert_params // split:,} parameters), " + (
                    "and no other GPU holds the same ones" if copies == 1 else
                    f"whole on one GPU of each of the {par.dp_replicate} replicas (hybrid sharding)"
                    if replica_copies == 1 else
                    f"{'replicated' if par.strategy in ('ddp', 'megatron') else 'sharded'} over the {replica_copies} "
                    "GPUs that hold the same ones"
                    + (f" in each of {par.dp_replicate} replicas" if par.dp_replicate > 1 else ""))
                + (f"; the other {dense:,} parameters over all {par.gpus}" if par.tp == 1 and par.dp_replicate == 1
                                    else f"; the other {dense:,} parameters over each replica's "
                                    f"{par.gpus // par.dp_replicate}" if par.tp == 1 else
                                    f"; the rest of the model ({dense:,} parameters per GPU) split over {par.tp} "
                                    "tensor-parallel GPUs" if par.etp > 1 else
                                    f", each expert whole (transformers' plan; the tokens split over the {par.tp} "
                                    f"tensor-parallel GPUs before the all-to-all); the rest of the model "
                                    f"({dense:,} parameters per GPU) split over {par.tp} tensor-parallel GPUs"))
    return ModelStates(
        {ph: d.parameters[ph] + e.parameters[ph] for ph in d.parameters},
        {ph: d.gradients[ph] + e.gradients[ph] for ph in d.gradients},
        d.optimizer_state + e.optimizer_state, d.optimizer_temporaries + e.optimizer_temporaries,
        d.host_bytes + e.host_bytes, (note, *d.notes))
