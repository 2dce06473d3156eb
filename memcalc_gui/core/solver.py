"""Does it fit, the largest micro-batch that fits, and the changes that would make it fit.

What to change is a search over combinations of every lever the estimator models (:func:`levers`), ranked by what
each costs the run. Until a time model exists that order is stated, not measured (:data:`LEVER_COSTS`): first the
changes that keep the maths and the GPUs (a chunked loss, a smaller micro-batch with accumulation, checkpointing —
selective, every N-th layer or every layer —, sharding, offload), then more GPUs of the same kind, then changes to
what is trained (precision, optimizer state, adapters). A lossless change only costs step time or a dependency; more
GPUs cost money but train the same model; a recipe change trains a different one. Cards that fit come first in that
order, then those that lower the peak but leave it over; a change that closes under 1 % of the gap is not offered.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Final

from .distributed import PREFERENCE, Parallelism, closest_offload
from .errors import InputError
from .ledger import Estimate
from .setup import LIMITS, TrainingSetup

Estimator = Callable[[TrainingSetup], Estimate]

#: Upper bound for the micro-batch search (beyond it, "fits" is reported as this bound).
MAX_SEARCH_BATCH = 1 << 16


@dataclass(frozen=True)
class Suggestion:
    """One change to the setup, what it saves at the peak, and whether the result fits."""

    key: str
    title: str
    changes: dict[str, Any]
    peak_bytes: int
    saves_bytes: int
    fits: bool | None
    tradeoff: str = ""
    #: Host memory the changed setup needs (offloaded state), per node.
    host_bytes: int = 0
    #: What the change costs the run, for ranking (the sum of its levers' :data:`LEVER_COSTS`).
    cost: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "title": self.title,
            "changes": self.changes,
            "peak_bytes": self.peak_bytes,
            "saves_bytes": self.saves_bytes,
            "fits": self.fits,
            "tradeoff": self.tradeoff,
            "host_bytes": self.host_bytes,
        }


@dataclass(frozen=True)
class Verdict:
    capacity_bytes: int | None
    fits: bool | None
    headroom_bytes: int | None
    max_micro_batch: int | None
    suggestions: tuple[Suggestion, ...] = field(default=())
    #: Changes the method could not answer without a calibration of their own (the fitted method), by title: left out
    #: of the suggestions, not ruled out.
    uncalibrated: tuple[str, ...] = field(default=())


def fits(estimate: Estimate, capacity_bytes: int) -> bool:
    return estimate.peak_bytes <= capacity_bytes


def max_micro_batch(setup: TrainingSetup, estimator: Estimator, capacity_bytes: int) -> int:
    """Largest micro-batch whose peak fits ``capacity_bytes`` (0 if not even 1 fits).

    Exponential then binary search: the peak never decreases with the batch (a property test checks).
    """
    def ok(b: int) -> bool:
        return estimator(setup.with_changes(batch=b)).peak_bytes <= capacity_bytes

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= MAX_SEARCH_BATCH and ok(hi):
        lo, hi = hi, hi * 2
    if hi > MAX_SEARCH_BATCH:
        return lo
    return _bisect_last(ok, lo, hi)


def _bisect_last(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest ``n`` in ``[lo, hi)`` with ``ok(n)`` for a monotone ``ok`` (``lo`` is taken as true)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


Candidate = tuple[str, str, dict[str, Any], str]


def _candidates(setup: TrainingSetup, estimator: Estimator, capacity: int | None) -> list[Candidate]:
    """Each lever alone, with concrete changes (the micro-batch one needs a capacity; more GPUs only come in
    :func:`search_fixes`, which knows how many)."""
    out: list[Candidate] = []
    for lever in levers(setup):
        if lever.key == "gpus":
            continue
        if lever.key == "micro-batch":
            b = _smaller_micro_batch(setup, estimator, capacity) if capacity is not None else None
            if b is None:
                continue
            effective = setup.effective_batch
            out.append((lever.key, f"Micro-batch {b} × {effective // b} accumulation steps (same effective batch "
                                   f"{effective})", {"batch": b, "grad_accum": effective // b}, lever.tradeoff))
            continue
        title = _lever_title(lever, lever.changes, setup.parallel.strategy)
        out.append((lever.key, title[0].upper() + title[1:], dict(lever.changes), lever.tradeoff))
    return out


def micro_batch_changes(setup: TrainingSetup, micro_batch: int) -> dict[str, Any]:
    """The changes for "use micro-batch ``micro_batch``": the nearest micro-batch at or below it that keeps the
    effective batch (accumulation adjusted), else that micro-batch alone (the effective batch then changes)."""
    effective = setup.effective_batch
    d = _largest_divisor_at_most(effective, micro_batch)
    if d != setup.batch and effective // d <= LIMITS["grad_accum"]:
        return {"batch": d, "grad_accum": effective // d}
    return {"batch": micro_batch}


@lru_cache(maxsize=64)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n`` in order (``n`` ≤ 2^40: at most 2^20 trial divisions, once per ``n``)."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
        i += 1
    return tuple(small + large[::-1])


def _largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is ``<= limit`` (1 when ``limit`` < 1)."""
    for d in range(limit, max(0, limit - 64), -1):  # divisors are dense near small limits: try those first
        if n % d == 0:
            return d
    divisors = _divisors(n)
    return divisors[max(0, bisect_right(divisors, limit) - 1)]


def _smaller_micro_batch(setup: TrainingSetup, estimator: Estimator, capacity: int) -> int | None:
    """The largest micro-batch below the current one that divides the effective batch and fits (else 1; None
    when that micro-batch would need more accumulation steps than allowed).

    Bisection over the micro-batch (at accumulation > 1 the peak grows with the micro-batch alone), then the
    largest divisor of the effective batch at or below it: a few dozen estimates for any input.
    """
    effective = setup.effective_batch
    floor = -(-effective // LIMITS["grad_accum"])  # below it the accumulation count would pass its limit

    def divisor(b: int) -> int | None:
        d = _largest_divisor_at_most(effective, b)
        return d if d >= floor else None

    def ok(b: int) -> bool:
        d = divisor(b)
        if d is None:
            return False
        try:
            return estimator(setup.with_changes(batch=d, grad_accum=effective // d)).peak_bytes <= capacity
        except InputError:  # a count the estimator cannot weigh (a fitted pipeline rank traces its micro-batches)
            return False

    smallest = next((d for d in _divisors(effective) if d >= floor), effective)
    if smallest < setup.batch and not ok(smallest):  # none fits: one estimate says so (the search meets many such sets)
        return divisor(1)
    fitting = _bisect_last(ok, 0, setup.batch)  # 0: none fits; the current micro-batch is not tested
    return divisor(max(1, fitting))


#: The least a suggested change saves, unless it makes the step fit (with 0.1 % of the peak and, over capacity, 1 %
#: of what the step is over by: a change that closes less of the gap is no step towards fitting).
MIN_SAVING_BYTES: Final = 2**20
OVERAGE_SHARE: Final = 100


def suggestions(setup: TrainingSetup, estimator: Estimator, capacity_bytes: int | None) -> tuple[Suggestion, ...]:
    """What to change. Over capacity: the cards that fit — the cheapest sets of changes :func:`search_fixes` finds and
    the single changes that fit alone — in the order of what they cost the run (:data:`LEVER_COSTS`: the same maths
    on the same GPUs, then more GPUs, then another training recipe; ties: the most headroom first), then the single
    changes that lower the peak but leave it over, largest saving first. Otherwise the single changes, largest
    saving first."""
    return _suggestions(setup, estimator, capacity_bytes)[0]


def _suggestions(setup: TrainingSetup, estimator: Estimator,
                 capacity_bytes: int | None) -> tuple[tuple[Suggestion, ...], tuple[str, ...]]:
    """:func:`suggestions`, and the titles of the single changes the method needs another calibration to answer."""
    base_peak = estimator(setup).peak_bytes
    over = capacity_bytes is not None and base_peak > capacity_bytes
    # rounding is not a change worth making (sharding over one GPU saved 563 B); over capacity, neither is a change
    # that closes under 1 % of the gap (8-bit AdamW's 0.26 GiB beside a QLoRA run 91 GiB over)
    floor = max(MIN_SAVING_BYTES, base_peak // 1000,
                (base_peak - capacity_bytes) // OVERAGE_SHARE if capacity_bytes is not None and over else 0)
    rows: list[Suggestion] = []
    uncalibrated: list[str] = []
    for key, title, changes, tradeoff in _candidates(setup, estimator, capacity_bytes):
        try:
            peak: int | None = estimator(apply_changes(setup, changes)).peak_bytes
        except InputError as exc:  # a conflict (8-bit Adam with fused), or a change the fit was not calibrated for
            peak = None
            if exc.field == "method":
                uncalibrated.append(title)
        if peak is None or peak >= base_peak:
            continue
        ok = None if capacity_bytes is None else peak <= capacity_bytes
        if base_peak - peak < floor and not ok:
            continue
        rows.append(Suggestion(key, title, changes, peak, base_peak - peak, ok, tradeoff, cost=lever_cost(key)))
    if capacity_bytes is None or not over:
        rows.sort(key=lambda s: (not s.fits, -s.saves_bytes))
        return _with_host(setup, estimator, tuple(rows)), tuple(uncalibrated)
    fitting = _undominated(_with_host(setup, estimator, tuple(_distinct(
        [*search_fixes(setup, estimator, capacity_bytes), *(r for r in rows if r.fits)]))))
    fitting.sort(key=lambda s: (s.cost, s.peak_bytes))  # (stable: the search's order among equals)
    still_over = sorted((r for r in rows if not r.fits), key=lambda s: -s.saves_bytes)
    return (*fitting, *_with_host(setup, estimator, tuple(still_over))), tuple(uncalibrated)


def _distinct(rows: list[Suggestion]) -> list[Suggestion]:
    """``rows`` without a later one that makes the same changes as an earlier one."""
    seen: set[str] = set()
    out = []
    for row in rows:
        changes = repr(sorted(row.changes.items()))
        if changes not in seen:
            seen.add(changes)
            out.append(row)
    return out


def _undominated(rows: tuple[Suggestion, ...]) -> list[Suggestion]:
    """The fitting ``rows`` but those a row of a cheaper tier (:data:`TIERS`) beats: as low a peak and no more host
    memory, without the GPUs or the recipe change ("checkpointing; use 14 GPUs" at 78.9 GiB beside checkpointing
    and a chunked loss at 34.6 GiB on the GPUs at hand). Within a tier the alternatives stay: their trade-offs differ
    in ways the stated costs do not weigh (a dependency, PCIe traffic)."""
    return [row for row in rows if not any(
        cost_tier(other.cost) < cost_tier(row.cost) and other.peak_bytes <= row.peak_bytes
        and other.host_bytes <= row.host_bytes for other in rows)]


def _with_host(setup: TrainingSetup, estimator: Estimator, rows: tuple[Suggestion, ...]) -> tuple[Suggestion, ...]:
    """Each suggestion with the host memory its setup needs (offload), so a fix says what it leaves on the host."""
    out = []
    for row in rows:
        host = _host_bytes(setup, estimator, row.changes)
        out.append(replace(row, host_bytes=host) if host else row)
    return tuple(out)


# ---- the search over every lever ----------------------------------------------------------------------
#: What each kind of change costs the run, for ranking (higher: dearer). Until a time model exists the order is
#: stated, not measured, and comes in three tiers, so that a set's total sorts by its dearest kind first:
#:
#: 1. the same maths on the same GPUs (1–35, step time or a dependency): a free switch (fused step, SDPA) < splitting
#:    the loss or the layers (chunked loss, tensor/sequence/context parallelism) < a sharding strategy < a smaller
#:    micro-batch with accumulation < recomputation (every other layer < per-op selective < every layer) < offload's
#:    PCIe traffic (checkpointed inputs, the optimizer state, the parameters, every saved tensor);
#: 2. more GPUs of this kind (:data:`HARDWARE_COST`): the same run, paid for in hardware;
#: 3. a change to what is trained (:data:`RECIPE_COST` and up): the step in backward (no clipping by the global
#:    norm, no accumulation) < mixed precision from fp32 < bf16 moments < 8-bit state < GaLore < LoRA < QLoRA <
#:    bf16 weights without fp32 master weights.
#:
#: Any set of first-tier changes (one per group) costs less than :data:`HARDWARE_COST`, and any set without a
#: third-tier one less than :data:`RECIPE_COST`: every lossless set is tried, and ranked, before one that adds GPUs,
#: and that before one that changes the training.
HARDWARE_COST: Final = 1_000
RECIPE_COST: Final = 10_000
LEVER_COSTS: dict[str, int] = {
    "optimizer-fused": 1,
    "attention-sdpa": 1,
    "sp": 2,  # the tensor-parallel all-reduces become reduce-scatter + all-gather of the same volume
    "loss-parallel": 2,  # the head's logits stay split: one all-reduce of per-token statistics
    "loss-chunked": 3,  # a different kernel (Liger-Kernel), about as fast: nothing given up but a dependency
    "attention-flash": 3,  # another package (flash-attn) and an Ampere-or-later GPU
    "strategy:zero2": 5,  # shards optimizer state and gradients only: the least extra communication
    "dp_replicate": 5,  # FSDP2's collectives over every data-parallel GPU, across nodes
    "strategy": 6,
    "offload-checkpoint-inputs": 6,  # with checkpointing already on: one hidden state per layer over PCIe, overlapped
    "tp": 9,  # an all-reduce per layer in forward and backward: fast links (one node) wanted
    "cp": 9,  # key/value chunks passed round a ring in every attention: fast links wanted
    "etp": 9,  # an all-gather and a reduce-scatter of the group's tokens in every MoE layer
    "micro-batch": 10,  # more, smaller passes per optimizer step: the same gradients
    "checkpointing-every-2": 15,
    "checkpointing-selective": 17,  # every layer, but matmul and attention outputs kept: less recomputation
    "checkpointing": 20,  # one extra forward per layer
    "checkpointing-offload": 24,  # checkpointing plus a copy of each layer's input to the host and back
    "offload-optimizer": 30,
    "offload-both": 32,
    "offload-activations-all": 35,  # every saved tensor over PCIe twice, synchronously: slow
    "gpus": HARDWARE_COST,
    "optimizer-in-backward": 12 * RECIPE_COST // 10,  # a custom loop step: no accumulation, no global-norm clipping
    "precision-mixed": 2 * RECIPE_COST,
    "optimizer-bf16-states": 3 * RECIPE_COST,  # bf16 moments: less precise state, a less common package
    "optimizer-8bit": 4 * RECIPE_COST,
    "optimizer-galore": 45 * RECIPE_COST // 10,  # another optimizer: projected gradients, a periodic SVD
    "tuning-lora": 5 * RECIPE_COST,  # a frozen base: only the adapters learn
    "tuning-qlora": 6 * RECIPE_COST,  # a frozen, quantized base: adapters only, dequantization each matmul
    "precision-bf16": 10 * RECIPE_COST,
}
#: The tiers' names, as :attr:`Lever.tier` numbers them.
TIERS: Final = ("the same GPUs and maths", "more GPUs", "another training recipe")
#: How many fitting sets of changes the search returns from the cheapest tier that has one (:data:`TIERS`), and from
#: each dearer tier (the cheapest way to fit with more GPUs, and with another recipe, as alternatives).
MAX_FIXES = 3
LATER_TIER_FIXES = 1
#: "More GPUs" suggests at most this many times the current count (at least 8): a run that needs hundreds of GPUs
#: of this kind to fit is better served by the other levers.
GPU_GROWTH = 8
MAX_EVALUATIONS = 400
#: The sets each tier (:data:`TIERS`) may estimate: most for the lossless ones, which are many and tried first.
TIER_EVALUATIONS: Final = (200, 60, 60)
SHARDED = ("zero2", "zero3", "fsdp-full-shard", "fsdp2")
PARALLEL_KEYS = ("gpus", "strategy", "offload", "node_size", "ep", "etp", "tp", "cp", "sp", "loss_parallel",
                 "dp_replicate")
#: Change keys that edit the fine-tuning method (core.finetune.FineTuning's fields, as the CLI names them).
TUNING_KEYS = {"tuning": "method", "lora_rank": "rank", "lora_targets": "targets", "lora_dropout": "dropout",
               "adapter_dtype": "adapter_dtype", "quant": "quant", "double_quant": "double_quant",
               "trainable": "trainable"}


@dataclass(frozen=True)
class Lever:
    """One change of one kind (``group``: at most one lever per group in a set)."""

    group: str
    key: str
    title: str
    changes: dict[str, Any]
    tradeoff: str

    @property
    def cost(self) -> int:
        return lever_cost(self.key)

    @property
    def tier(self) -> int:
        """0: the same maths on the same GPUs; 1: more GPUs; 2: another training recipe (:data:`TIERS`)."""
        return cost_tier(self.cost)


def lever_cost(key: str) -> int:
    """:data:`LEVER_COSTS` of a lever's key (``tp:4`` costs what ``tp`` costs)."""
    return LEVER_COSTS.get(key, LEVER_COSTS[key.split(":")[0]])


def cost_tier(cost: int) -> int:
    """The tier (:data:`TIERS`) of a lever's or a set's cost: the dearest kind of change in it."""
    return 2 if cost >= RECIPE_COST else 1 if cost >= HARDWARE_COST else 0


def apply_changes(setup: TrainingSetup, changes: dict[str, Any]) -> TrainingSetup:
    """``setup`` with ``changes``: setup fields, and ``gpus``/``strategy``/``offload``/``node_size`` of its
    parallel layout (the names a suggestion and the window's form share). Raises ``InputError`` on a conflict."""
    par = {k: v for k, v in changes.items() if k in PARALLEL_KEYS}
    tune: dict[str, Any] = {TUNING_KEYS[k]: (tuple(v) if isinstance(v, list) else v)
                            for k, v in changes.items() if k in TUNING_KEYS}
    rest = {k: v for k, v in changes.items() if k not in PARALLEL_KEYS and k not in TUNING_KEYS}
    if par:
        base = setup.parallel
        if "strategy" in par and "loss_parallel" not in par:  # the new strategy's own vocabulary split by default
            base = base.with_strategy(par["strategy"])
        rest["parallel"] = replace(base, **par)
    if tune:
        rest["tuning"] = replace(setup.tuning, **tune)
    return setup.with_changes(**rest) if rest else setup


def levers(setup: TrainingSetup) -> list[Lever]:
    """Every change the estimator can express for ``setup`` (the search combines them)."""
    out: list[Lever] = []
    if setup.architecture_known and setup.checkpointing.startswith("every:"):
        out.append(Lever("checkpointing", "checkpointing", "checkpoint every layer", {"checkpointing": "full"},
                         "about 20–30 % slower backward (one extra forward per layer)"))
    if setup.architecture_known and setup.checkpointing == "none":
        out.append(Lever("checkpointing", "checkpointing", "turn on gradient checkpointing",
                         {"checkpointing": "full"}, "about 20–30 % slower backward (one extra forward per layer)"))
        if setup.tuning.method == "full":
            out.append(Lever("checkpointing", "checkpointing-every-2", "checkpoint every other layer "
                             "(torchtitan's selective layer checkpointing)", {"checkpointing": "every:2"},
                             "about 10–15 % slower backward (half the layers run forward twice)"))
            if setup.attention == "sdpa":
                out.append(Lever("checkpointing", "checkpointing-selective", "checkpoint every layer but keep its "
                                 "matmul and attention outputs (torchtitan's per-op selective checkpointing)",
                                 {"checkpointing": "selective"},
                                 "a few percent slower backward (norms, activations and every other matmul run "
                                 "again); needs a training loop with torch.utils.checkpoint's selective contexts"))
    if setup.model is not None and setup.tuning.method == "full" and setup.activation_offload == "none" \
            and not setup.use_cache:
        inputs_tradeoff = ("needs torchtune's OffloadActivations (or a saved-tensors hook of your own): each layer's "
                           "input crosses PCIe twice, overlapped with compute on a side stream; host memory for one "
                           "hidden state per layer")
        if setup.checkpointing == "full":
            out.append(Lever("activation-offload", "offload-checkpoint-inputs", "offload the checkpointed layers' "
                             "inputs to host memory (torchtune's OffloadActivations)",
                             {"activation_offload": "checkpoint-inputs"}, inputs_tradeoff))
        elif setup.checkpointing == "none":
            out.append(Lever("checkpointing", "checkpointing-offload", "checkpoint every layer and offload its input "
                             "to host memory (torchtune's OffloadActivations)",
                             {"checkpointing": "full", "activation_offload": "checkpoint-inputs"},
                             "about 20–30 % slower backward (one extra forward per layer); " + inputs_tradeoff))
            out.append(Lever("activation-offload", "offload-activations-all", "keep every saved activation in host "
                             "memory (PyTorch's save_on_cpu)", {"activation_offload": "all"},
                             "every saved tensor, weights included, crosses PCIe twice, synchronously unless pinned: "
                             "often slower than checkpointing; host memory for all of them"))
    if setup.architecture_known and setup.loss == "full" and not (setup.model and setup.model.lm_head_bias):
        out.append(Lever("loss", "loss-chunked", "compute the loss in chunks (Liger-Kernel's fused linear "
                         "cross-entropy)", {"loss": "chunked"},
                         "needs Liger-Kernel (Triton: NVIDIA and AMD GPUs); about as fast; the tokens × vocabulary "
                         "logits never exist"))
    if setup.model is not None and not setup.optimizer_in_backward and setup.grad_accum == 1 \
            and not setup.parallel.is_distributed:
        out.append(Lever("step", "optimizer-in-backward", "step the optimizer in backward (gradients freed as they "
                         "are made)", {"optimizer_in_backward": True},
                         "a training loop that steps each parameter from a post-accumulate-grad hook (PyTorch's "
                         "recipe, torchtune's optimizer_in_bwd): no gradient accumulation, no clipping by the global "
                         "norm"))
    if setup.optimizer in ("adamw", "adam"):
        out.append(Lever("optimizer", "optimizer-8bit", "use 8-bit AdamW (bitsandbytes)",
                         {"optimizer": "adamw-8bit",
                          **({"optimizer_impl": "foreach"} if setup.optimizer_impl == "fused" else {})},
                         "quantised optimizer state; needs bitsandbytes"))
        if setup.precision in ("fp32", "mixed"):
            out.append(Lever("optimizer", "optimizer-bf16-states", "keep AdamW's moments in bf16 (AnyPrecisionAdamW: "
                             'Trainer\'s adamw_anyprecision with momentum_dtype and variance_dtype "bfloat16")',
                             {"optimizer": "adamw-bf16-states"},
                             "bf16 moments beside fp32 weights: less precise state; needs torchdistx (or Megatron's "
                             "precision-aware optimizer)"))
        if setup.model is not None and setup.model.family != "gpt2" and setup.tuning.method == "full" \
                and not setup.parallel.is_distributed and not setup.optimizer_in_backward:
            out.append(Lever("optimizer", "optimizer-galore", "use GaLore AdamW (galore-torch, rank 128 on the "
                             "attention and MLP weights)", {"optimizer": "galore-adamw"},
                             "Adam's moments of a low-rank projection of the gradients and an SVD every 200 steps; "
                             "full-parameter training with some quality difference from AdamW (GaLore paper)"))
        if setup.optimizer_impl != "fused":
            out.append(Lever("optimizer", "optimizer-fused", "use the fused optimizer implementation",
                             {"optimizer_impl": "fused"}, "no step temporaries; needs a CUDA build of torch"))
    if setup.precision == "fp32":
        out.append(Lever("precision", "precision-mixed", "train in mixed precision (bf16 autocast)",
                         {"precision": "mixed"}, "16-bit activations; fp32 master weights"))
    if setup.precision not in ("bf16", "bf16-autocast"):
        out.append(Lever("precision", "precision-bf16", "keep weights, gradients and optimizer state in bf16",
                         {"precision": "bf16"},
                         "no fp32 master weights: updates lose precision (Kahan summation or stochastic rounding)"))
    if setup.model is not None and setup.tuning.method == "full":
        out.append(Lever("tuning", "tuning-lora", "fine-tune with LoRA (r=16, all linear layers)",
                         {"tuning": "lora", "lora_rank": 16}, "only low-rank adapters learn (0.1–1 % of the "
                         "weights); full fine-tuning can reach a better loss"))
    if setup.model is not None and setup.tuning.method in ("full", "lora"):
        out.append(Lever("tuning", "tuning-qlora", "fine-tune with QLoRA (4-bit NF4 base, r=16)",
                         {"tuning": "qlora", "lora_rank": 16}, "adapters only on a 4-bit base: some quality "
                         "loss and slower matmuls (dequantized each time)"))
    if setup.model is not None and setup.attention == "eager":
        out.append(Lever("attention", "attention-sdpa", "use SDPA attention instead of eager", {"attention": "sdpa"},
                         "no L×L score matrices kept"))
    if setup.model is not None and setup.packing and setup.attention != "flash" and setup.precision != "fp32":
        out.append(Lever("attention", "attention-flash", "use FlashAttention-2 for the packed documents "
                         '(attn_implementation="flash_attention_2")', {"attention": "flash"},
                         "needs the flash-attn package and an Ampere-or-later GPU; no L×L mask per layer"))
    if setup.batch > 1 and not setup.optimizer_in_backward:  # the step in backward cannot accumulate
        out.append(Lever("micro-batch", "micro-batch", "a smaller micro-batch at the same effective batch", {},
                         "more forward/backward passes per optimizer step"))
    if not setup.architecture_known:
        return out  # sharding and offload need the architecture
    par = setup.parallel
    if par.strategy == "ddp":
        for strategy in SHARDED:
            out.append(Lever("strategy", f"strategy:{strategy}", f"shard with {STRATEGY_TITLES[strategy]}",
                             {"strategy": strategy}, "more communication per step than DDP"))
    if par.dp_replicate > 1:
        out.append(Lever("dp_replicate", "dp_replicate", f"shard over all {par.fsdp2_ranks * par.dp_replicate:,} "
                         "data-parallel GPUs (FSDP2 without hybrid replicas)", {"dp_replicate": 1},
                         "the all-gathers and reduce-scatters span every data-parallel GPU, across nodes"))
    # each offload the strategy has once (FSDP's CPUOffload is "both"; ZeRO-1/2 offload the optimizer only); under DDP
    # both, for the sets that shard too
    has = {o for o in ("optimizer", "both") if par.strategy == "ddp" or closest_offload(par.strategy, o) == o}
    if par.offload in ("none", "params") and "optimizer" in has:
        out.append(Lever("offload", "offload-optimizer", "offload the optimizer state to the CPU",
                         {"offload": "optimizer"}, "PCIe traffic every step; host memory for the state"))
    if par.offload != "both" and "both" in has:
        out.append(Lever("offload", "offload-both", "offload the optimizer state and the parameters to the CPU",
                         {"offload": "both"}, "PCIe traffic in every forward and backward; host memory"))
    for tp in _tensor_parallel_degrees(setup):
        out.append(Lever("tp", f"tp:{tp}", f"split each layer over {tp} GPUs (tensor parallelism)", {"tp": tp},
                         "an all-reduce per layer in forward and backward: GPUs in one node (NVLink) wanted"))
    if par.tp > 1 and not par.sp:
        out.append(Lever("sp", "sp", "split the norms and residual stream over the tensor-parallel GPUs (sequence "
                         "parallelism)", {"sp": True}, "none to speak of: the same traffic in other collectives"))
    if par.tp > 1 and not par.loss_parallel:
        out.append(Lever("loss-parallel", "loss-parallel", "split the vocabulary over the tensor-parallel GPUs (loss "
                         "parallelism)", {"loss_parallel": True}, "the embedding and head split: a loss kernel "
                                                                  "that works on sharded logits"))
    for etp in _expert_tensor_degrees(setup):
        out.append(Lever("etp", f"etp:{etp}", f"split each routed expert over {etp} GPUs (Megatron-LM's expert tensor "
                         "parallelism)", {"etp": etp}, "the group's tokens all-gathered before the experts and "
                         f"reduce-scattered after them in every MoE layer, and held {etp} times in its saved inputs"))
    for cp in _context_parallel_degrees(setup):
        out.append(Lever("cp", f"cp:{cp}", f"split each sequence over {cp} GPUs (context parallelism)", {"cp": cp},
                         "key/value chunks passed round a ring in every attention: fast links wanted"))
    out.append(Lever("gpus", "gpus", "spread over more GPUs of this kind", {},
                     "more GPUs (cost); sharded state and more communication"))
    return out


def _context_parallel_degrees(setup: TrainingSetup) -> list[int]:
    """Larger context-parallel degrees (2, 4, 8) that split the sequence into 2·cp chunks and the GPUs evenly (long
    sequences only: from 8,192 tokens, where attention's activations dominate)."""
    par = setup.parallel
    if setup.model is None or setup.seq < 8192 or setup.attention == "eager" or setup.packing \
            or setup.tuning.method != "full" or par.expert_split > 1 or par.offload != "none":
        return []
    rest = par.gpus // (par.tp * par.pp)
    return [cp for cp in (2, 4, 8) if par.cp < cp and rest % cp == 0 and setup.seq % (2 * cp) == 0]


def _expert_tensor_degrees(setup: TrainingSetup) -> list[int]:
    """Larger expert-tensor-parallel degrees (2, 4, 8) under Megatron-LM's strategies for a family without a block
    model (where the mixtures of experts are; a dense one refuses the change), splitting a stage's GPUs evenly."""
    par = setup.parallel
    if setup.model is not None or not par.strategy.startswith("megatron") or setup.tuning.method != "full":
        return []
    return [etp for etp in (2, 4, 8) if par.etp < etp and (par.dp * par.tp) % (par.ep * etp) == 0]


def _tensor_parallel_degrees(setup: TrainingSetup) -> list[int]:
    """Larger tensor-parallel degrees (2, 4, 8: within a node) that split the model and the GPUs evenly."""
    from .layout import TP_FAMILIES

    par, spec = setup.parallel, setup.model
    if spec is None or spec.family not in TP_FAMILIES or setup.tuning.method != "full" or par.offload != "none" \
            or par.expert_split > 1:
        return []
    return [tp for tp in (2, 4, 8) if par.tp < tp <= par.node_size and par.gpus % (tp * par.pp * par.cp) == 0
            and not (spec.num_heads % tp or spec.num_kv_heads % tp or spec.intermediate_size % tp)]


STRATEGY_TITLES: dict[str, str] = {"zero1": "ZeRO-1", "zero2": "ZeRO-2 (DeepSpeed)", "zero3": "ZeRO-3 (DeepSpeed)",
                                   "fsdp-full-shard": "FSDP FULL_SHARD", "fsdp-shard-grad-op": "FSDP SHARD_GRAD_OP",
                                   "fsdp-hybrid": "FSDP HYBRID_SHARD", "fsdp2": "FSDP2 (fully_shard, torchtitan)",
                                   "megatron": "Megatron-LM DDP",
                                   "megatron-distopt": "Megatron-LM's distributed optimizer"}


def _combinations(groups: dict[str, list[Lever]], seeds: tuple[Lever, ...] = (),
                  required: frozenset[str] = frozenset()) -> Iterator[tuple[Lever, ...]]:
    """Every non-empty set with at most one lever per group, cheapest first (ties: fewer changes first), made lazily:
    a best-first walk over each group's choice (none, then its levers by cost), so a search that stops after a few
    hundred sets never builds the tens of thousands there are. With ``seeds`` the walk starts from each of them
    alone: only the sets that hold a seed, or a dearer lever of a seed's group, come out (a tier's own sets); with
    ``required`` groups, only the sets with a lever of each."""
    options = [sorted(levers, key=lambda lv: (lv.cost, lv.key)) for levers in groups.values()]
    costs = [[lv.cost for lv in levers] for levers in options]
    need = [group in required for group in groups]

    def entry(choice: tuple[int, ...]) -> tuple[int, int, list[str], tuple[int, ...]]:
        picked = [options[g][i - 1] for g, i in enumerate(choice) if i]
        return (sum(costs[g][i - 1] for g, i in enumerate(choice) if i), len(picked), [lv.key for lv in picked],
                choice)

    starts = [tuple(levers.index(seed) + 1 if seed in levers else 0 for levers in options) for seed in seeds] \
        or [(0,) * len(options)]
    starts = list(dict.fromkeys(tuple(max(i, int(n)) for i, n in zip(start, need, strict=True)) for start in starts))
    heap = [entry(start) for start in starts]
    heapq.heapify(heap)
    seen = set(starts)
    while heap:
        _, _, _, choice = heapq.heappop(heap)
        if any(choice):
            yield tuple(options[g][i - 1] for g, i in enumerate(choice) if i)
        for g, i in enumerate(choice):
            if i < len(options[g]):
                nxt = (*choice[:g], i + 1, *choice[g + 1:])
                if nxt not in seen:
                    seen.add(nxt)
                    heapq.heappush(heap, entry(nxt))


def search_fixes(setup: TrainingSetup, estimator: Estimator, capacity: int) -> list[Suggestion]:
    """The cheapest sets of changes that make ``setup`` fit ``capacity``, then the cheapest set that fits the same
    GPUs at the same micro-batch (:func:`_on_this_gpu`).

    Sets are tried tier by tier (:data:`TIERS`: the same maths on the same GPUs, then more GPUs, then another training
    recipe), cheapest first within a tier (:data:`LEVER_COSTS`), each tier with its own budget
    (:data:`TIER_EVALUATIONS`), so that the lossless sets are always tried before any that adds hardware:
    :data:`MAX_FIXES` sets from the cheapest tier that has one, then :data:`LATER_TIER_FIXES` from each dearer tier —
    unless a lossless set already fits without host memory, which every dearer set costs more than. A set is kept
    only when it fits and no cheaper kept set is part of it, and only when every lever in it changes the peak (e.g.
    hybrid sharding on one node does not). The micro-batch lever takes the largest micro-batch that then fits (same
    effective batch; 1 when none does); the GPU lever, applied after it, the fewest GPUs of this kind that then fit.
    A set that does no better than a cheaper kept set of the same kinds is dropped. A tier's :data:`ROUTES` tell
    whether any of its sets can fit (no route fitting, the tier is not walked) and which lever groups each needs
    (the walk builds only the sets that have them); when a tier's walk runs out of budget before a set fits, its
    route, minimised, stands in.
    """
    cache: dict[TrainingSetup, Estimate] = {}
    uncached = estimator

    def memo(s: TrainingSetup) -> Estimate:  # sets share setups (bisections, the every-lever check)
        found = cache.get(s)
        if found is None:
            found = cache[s] = uncached(s)
        return found

    estimator = memo
    base_peak = estimator(setup).peak_bytes
    groups: dict[str, list[Lever]] = {}
    for lever in levers(setup):
        groups.setdefault(lever.group, []).append(lever)
    kept: list[tuple[frozenset[str], Suggestion]] = []
    kept_groups: list[tuple[frozenset[str], Suggestion]] = []
    first_tier: int | None = None
    for tier in range(len(TIERS)):
        routes = _routes(setup, estimator, capacity, groups, tier)
        if not routes:
            continue  # not even everything this tier allows fits
        first_tier = tier if first_tier is None else first_tier
        pool = {g: kinds for g, options in groups.items() if (kinds := [lv for lv in options if lv.tier <= tier])}
        seeds = tuple(lv for options in pool.values() for lv in options if lv.tier == tier) if tier else ()
        needed = _needed_groups(setup, estimator, capacity, routes)
        evaluations, before = 0, len(kept)
        quota = before + (MAX_FIXES if tier == first_tier else LATER_TIER_FIXES)
        for combo in _combinations(pool, seeds, needed):
            keys = frozenset(lv.key for lv in combo)
            if any(k <= keys for k, _ in kept):
                continue
            if evaluations >= TIER_EVALUATIONS[tier] or len(kept) >= quota:
                break
            evaluations += 1
            found = _realise(setup, estimator, capacity, combo)
            if found is None:
                continue
            changes, peak = found
            if not _every_lever_counts(setup, estimator, combo, changes, peak):
                continue
            groups_used = frozenset(lv.group for lv in combo)
            if any(g == groups_used and fix.peak_bytes <= peak for g, fix in kept_groups):
                continue  # a cheaper alternative of the same kinds does at least as well
            fix = _fix(setup, combo, changes, peak, base_peak)
            kept.append((keys, fix))
            kept_groups.append((groups_used, fix))
        if len(kept) == before:  # the tier's cheap sets ran out of budget: its route, minimised
            fix = _minimised(setup, estimator, capacity, routes[0], base_peak)
            if all(fix.changes != other.changes for _, other in kept):
                kept.append((frozenset(fix.key.removeprefix("fix:").split("+")), fix))
        if tier == 0 and any(not _host_bytes(setup, estimator, fix.changes) for _, fix in kept):
            break  # the same maths fits on the GPUs at hand without host memory: more GPUs or a recipe cost more
    if first_tier is None:
        return []  # not even everything one way allows fits: no set of these changes does
    local = _on_this_gpu(setup, estimator, capacity, groups, base_peak)
    if local is not None and all(local.changes != fix.changes for _, fix in kept):
        kept.append((frozenset(), local))
    return [s for _, s in kept]


def _host_bytes(setup: TrainingSetup, estimator: Estimator, changes: dict[str, Any]) -> int:
    """The host memory (offloaded state, per node) ``setup`` with ``changes`` needs; 0 where it cannot be weighed."""
    try:
        return int(estimator(apply_changes(setup, changes)).details.get("host_bytes", 0) or 0)
    except InputError:
        return 0


def _fix(setup: TrainingSetup, combo: tuple[Lever, ...], changes: dict[str, Any], peak: int,
         base_peak: int) -> Suggestion:
    """The card of a set of levers that fits: its title, changes, peak, trade-offs and cost."""
    strategy = changes.get("strategy", setup.parallel.strategy)
    title = "; ".join(_lever_title(lv, changes, strategy) for lv in combo)
    return Suggestion("fix:" + "+".join(sorted(lv.key for lv in combo)), title[0].upper() + title[1:], changes, peak,
                      base_peak - peak, True, "; ".join(lv.tradeoff for lv in combo),
                      cost=sum(lv.cost for lv in combo))


#: Lever groups that keep the run as it is planned: the same GPUs, the same micro-batch, full fine-tuning.
SAME_RUN_GROUPS = frozenset({"checkpointing", "activation-offload", "loss", "step", "optimizer", "precision",
                             "attention", "offload"})


def _on_this_gpu(setup: TrainingSetup, estimator: Estimator, capacity: int, groups: dict[str, list[Lever]],
                 base_peak: int) -> Suggestion | None:
    """The cheapest set of techniques that fits without more GPUs, a smaller micro-batch or adapters (the run as
    planned), minimised: the cheapest sets first (:data:`MAX_EVALUATIONS` // 8 of them), then the leanest one — every
    technique at its strongest — with each one it fits without taken out again; ``None`` when even that is over."""
    local = {g: options for g, options in groups.items() if g in SAME_RUN_GROUPS}
    found: tuple[Lever, ...] | None = None
    for evaluations, combo in enumerate(_combinations(local)):
        if evaluations >= MAX_EVALUATIONS // 8:
            break
        if _realise(setup, estimator, capacity, combo) is not None:
            found = combo
            break
    if found is not None:
        fix = _minimised(setup, estimator, capacity, found, base_peak)
    else:  # each leanest route minimised; the cheaper result
        by_key = {lv.key: lv for options in local.values() for lv in options}
        fixes = []
        for route in SAME_RUN_ROUTES:
            leanest = tuple(by_key[k] for k in route if k in by_key)
            if leanest and _realise(setup, estimator, capacity, leanest) is not None:
                fixes.append(_minimised(setup, estimator, capacity, leanest, base_peak))
        if not fixes:
            return None
        fix = min(fixes, key=lambda f: f.cost)
    where = "this GPU" if not setup.parallel.is_distributed else f"these {setup.parallel.gpus} GPUs"
    return replace(fix, key="fix-here:" + fix.key.removeprefix("fix:"),
                   title=f"On {where} at micro-batch {setup.batch:,}: {fix.title[0].lower()}{fix.title[1:]}")


#: Every same-run technique at its strongest (lever keys; those a setup lacks are skipped), without and with the
#: activation offload.
SAME_RUN_ROUTES = (("checkpointing", "loss-chunked", "optimizer-in-backward", "optimizer-8bit", "precision-bf16",
                    "attention-sdpa", "attention-flash"),
                   ("checkpointing-offload", "loss-chunked", "optimizer-in-backward", "optimizer-8bit",
                    "precision-bf16", "attention-sdpa", "attention-flash"))

_OFFLOAD = ("offload-both", "offload-optimizer")  # the strongest offload the set's strategy has
_SAME_MATHS = ("loss-chunked", "micro-batch", "attention-sdpa", "attention-flash", "optimizer-fused", "dp_replicate")
#: Sets of everything one way of fitting allows, tier by tier (:data:`TIERS`; lever keys, a tuple of keys the first
#: a setup has; those a setup lacks are skipped): sharded and offloaded with recomputation or activation offload, or
#: split over the GPUs at hand; sharded over more GPUs; adapters on a quantized base, or one GPU with every single-GPU
#: saving. The first that fits tells the cheapest tier a set can fit in, and those of that tier which groups every
#: fitting set of it needs (:func:`_needed_groups`); none fitting means no set fits.
ROUTES: tuple[tuple[str | tuple[str, ...], ...], ...] = (
    ("strategy:fsdp-full-shard", _OFFLOAD, ("checkpointing-offload", "offload-checkpoint-inputs"), *_SAME_MATHS),
    ("strategy:fsdp-full-shard", _OFFLOAD, "checkpointing", *_SAME_MATHS),
    ("strategy:fsdp-full-shard", _OFFLOAD, "offload-activations-all", *_SAME_MATHS),
    ("strategy:fsdp-full-shard", ("tp:8", "tp:4", "tp:2"), "sp", "loss-parallel", ("cp:8", "cp:4", "cp:2"),
     ("etp:8", "etp:4", "etp:2"), "checkpointing", *_SAME_MATHS),
    ("strategy:fsdp-full-shard", "checkpointing", *_SAME_MATHS, "gpus"),
    ("strategy:fsdp-full-shard", ("tp:8", "tp:4", "tp:2"), "sp", "loss-parallel", ("cp:8", "cp:4", "cp:2"),
     ("etp:8", "etp:4", "etp:2"), "checkpointing", *_SAME_MATHS, "gpus"),
    ("strategy:fsdp-full-shard", _OFFLOAD, "checkpointing", "loss-chunked", "micro-batch", "gpus"),
    ("tuning-qlora", "checkpointing", "loss-chunked", "micro-batch", "attention-sdpa", "attention-flash"),
    ("precision-bf16", "optimizer-8bit", "checkpointing", "loss-chunked", "optimizer-in-backward", "attention-sdpa",
     "attention-flash"),
    ("precision-bf16", "optimizer-8bit", "checkpointing-offload", "loss-chunked", "optimizer-in-backward",
     "attention-sdpa", "attention-flash"),
)


def _routes(setup: TrainingSetup, estimator: Estimator, capacity: int, groups: dict[str, list[Lever]],
            tier: int) -> list[tuple[Lever, ...]]:
    """Those of the :data:`ROUTES` of ``tier`` that fit, as their levers: a few estimates that tell that no set of the
    tier fits (none), or which groups every one needs (:func:`_needed_groups`)."""
    by_key = {lv.key: lv for options in groups.values() for lv in options}
    out: list[tuple[Lever, ...]] = []
    for route in ROUTES:
        combo = tuple(by_key[key] for entry in route
                      if (key := next((k for k in ((entry,) if isinstance(entry, str) else entry) if k in by_key),
                                      None)) is not None)
        # more GPUs or a smaller micro-batch are refused when they change nothing: try the route without them too
        for drop in ((), ("gpus",), ("micro-batch",), ("gpus", "micro-batch")):
            if drop and not set(drop) & {lv.key for lv in combo}:
                continue
            trial = tuple(lv for lv in combo if lv.key not in drop)
            if not trial or max(lv.tier for lv in trial) != tier:
                continue
            if _realise(setup, estimator, capacity, trial) is not None:
                out.append(trial)
                break
    return out


def _needed_groups(setup: TrainingSetup, estimator: Estimator, capacity: int,
                   routes: list[tuple[Lever, ...]]) -> frozenset[str]:
    """The lever groups every fitting route of a tier needs — it does not fit without its lever of the group, all its
    others kept. The routes hold each group's strongest lever, so no set of that tier fits without one of these
    groups either (a lever taken out, or a weaker one, does not lower the peak), and the tier's walk builds only the
    sets that have them: a setup far over its capacity (an 8B model at 64 × 8192 on a T4) needs most groups, and the
    sets without them are most of the cheap ones."""
    needed: set[str] | None = None
    for route in routes:
        candidates = [lv for lv in route if needed is None or lv.group in needed]
        needed = {lever.group for lever in candidates
                  if _realise(setup, estimator, capacity, tuple(lv for lv in route if lv is not lever)) is None}
        if not needed:
            break
    return frozenset(needed or ())


def _minimised(setup: TrainingSetup, estimator: Estimator, capacity: int, combo: tuple[Lever, ...],
               base_peak: int) -> Suggestion:
    """``combo`` (which fits) without every lever it still fits without, dearest first."""
    found = _realise(setup, estimator, capacity, combo)
    assert found is not None
    for lever in sorted(combo, key=lambda lv: -lv.cost):
        rest = tuple(lv for lv in combo if lv is not lever)
        if rest and (again := _realise(setup, estimator, capacity, rest)) is not None:
            combo, found = rest, again
    changes, peak = found
    return _fix(setup, combo, changes, peak, base_peak)


def _lever_title(lever: Lever, changes: dict[str, Any], strategy: str) -> str:
    if lever.key == "offload-both" and strategy.startswith("fsdp"):
        return "turn on FSDP's CPUOffload (parameters, gradients and the optimizer step on the CPU)"
    if lever.key == "micro-batch":
        b, k = changes["batch"], changes["grad_accum"]
        return f"micro-batch {b} × {k} accumulation steps (same effective batch {b * k})"
    if lever.key == "gpus":
        return f"use {changes['gpus']} GPUs of this kind"
    return lever.title


def _realise(setup: TrainingSetup, estimator: Estimator, capacity: int,
             combo: tuple[Lever, ...]) -> tuple[dict[str, Any], int] | None:
    """The concrete changes of ``combo`` and the peak after them, or None when they conflict, do not fit, or the
    estimator cannot estimate them (the fitted method knows one precision, optimizer and checkpointing)."""
    try:
        return _realise_checked(setup, estimator, capacity, combo)
    except InputError:
        return None


def _realise_checked(setup: TrainingSetup, estimator: Estimator, capacity: int,
                     combo: tuple[Lever, ...]) -> tuple[dict[str, Any], int] | None:
    changes: dict[str, Any] = {}
    for lever in combo:
        changes.update(lever.changes)
    try:
        trial = apply_changes(setup, changes)
    except InputError:
        return None
    par = trial.parallel
    if par.offload != closest_offload(par.strategy, par.offload):
        return None  # another spelling of an offload the set's strategy has once (FSDP's CPUOffload)
    keys = {lv.key for lv in combo}
    if "micro-batch" in keys:  # first: the largest that fits with the other changes (1 when none does)
        b = _smaller_micro_batch(trial, estimator, capacity)
        if b is None:
            return None
        changes.update(batch=b, grad_accum=trial.effective_batch // b)
        trial = apply_changes(setup, changes)
    if "gpus" in keys:  # then the fewest GPUs that fit with everything else
        if trial.parallel.strategy == "ddp":
            return None  # more DDP replicas do not lower the memory of one
        gpus = _fewest_gpus(trial, estimator, capacity, limit=max(8, GPU_GROWTH * setup.parallel.gpus))
        if gpus is None or gpus <= setup.parallel.gpus:
            return None
        changes["gpus"] = gpus
        trial = apply_changes(setup, changes)
    peak = estimator(trial).peak_bytes
    return (changes, peak) if peak <= capacity else None


def _every_lever_counts(setup: TrainingSetup, estimator: Estimator, combo: tuple[Lever, ...],
                        changes: dict[str, Any], peak: int) -> bool:
    """False when dropping one lever's own changes leaves the peak as it is (the lever changes nothing)."""
    if len(combo) < 2:
        return peak < estimator(setup).peak_bytes
    for lever in combo:
        own = set(lever.changes) | ({"batch", "grad_accum"} if lever.key == "micro-batch" else set()) | \
            ({"gpus"} if lever.key == "gpus" else set())
        rest = {k: v for k, v in changes.items() if k not in own}
        try:
            without = estimator(apply_changes(setup, rest)).peak_bytes
        except InputError:
            continue  # the others need this one (offload needs a sharded strategy)
        if without <= peak:
            return False
    return True


def model_parallel_group(par: Parallelism) -> int:
    """The GPUs a layout's count comes in multiples of: its tensor-, pipeline- and context-parallel group, as many of
    them as split the experts (``ep × etp`` GPUs of a stage's data- and tensor-parallel ones), times
    FSDP2's hybrid replicas (a count of GPUs is then that many replicas of as many shards as groups)."""
    return par.pp * par.cp * math.lcm(par.tp, par.expert_split) * par.dp_replicate


#: The most GPU counts :func:`_fewest_gpus` tries one by one where refused counts hid the fewest from its bisection.
REFUSED_SCAN = 256


def _fewest_gpus(setup: TrainingSetup, estimator: Estimator, capacity: int, limit: int = 0) -> int | None:
    """The fewest GPUs (at most ``limit``, default :data:`MAX_GPUS`) with which ``setup``'s layout fits: one
    model-parallel group without replicas (no gradient buckets), or from two replicas on, where per-GPU memory never
    grows with more."""
    limit = min(limit or MAX_GPUS, MAX_GPUS)
    par = setup.parallel
    # GPU counts come in whole model-parallel groups, and in as many of them as split the experts (expert
    # parallelism needs a stage's GPUs a count it divides): then more groups never need more memory per GPU
    group = model_parallel_group(par)
    groups = limit // group
    if groups < 1:
        return None

    weighed: dict[int, bool | None] = {}

    def fits_with(k: int) -> bool | None:
        """Whether ``k`` groups fit; ``None`` where the layout refuses that count (FSDP2's placement of the routed
        experts along their second dimension splits only evenly: ``distributed.check_expert_shards``)."""
        if k not in weighed:
            try:
                weighed[k] = estimator(apply_changes(setup, {"gpus": k * group})).peak_bytes <= capacity
            except InputError:
                weighed[k] = None
        return weighed[k]

    if fits_with(1):
        return group
    # the most groups the layout takes: the limit, else the first count below it that it takes (REFUSED_SCAN of them
    # one by one, then powers of two)
    top, fits = groups, fits_with(groups)
    while fits is None and top > 1:
        top = top - 1 if groups - top < REFUSED_SCAN else 1 << ((top - 1).bit_length() - 1)
        fits = fits_with(top)
    if top < 2 or not fits:
        return None
    # a refused count reads as not fitting, so the bisection can step over the fewest: the counts between the largest
    # one weighed that did not fit and its answer are tried in turn (at most REFUSED_SCAN of them; refused counts are
    # sparse beside the ones that run, or the scan is short)
    answer = _bisect_last(lambda k: not fits_with(k), 1, top) + 1
    below = max((k for k, fit in weighed.items() if fit is False and k < answer), default=1)
    if answer - below <= REFUSED_SCAN:
        answer = next(k for k in range(below + 1, answer + 1) if fits_with(k))
    return answer * group


def solve(setup: TrainingSetup, estimator: Estimator, estimate: Estimate | None = None) -> Verdict:
    """The verdict for ``setup`` against its capacity (all ``None`` without a capacity)."""
    est = estimate if estimate is not None else estimator(setup)
    cap = setup.capacity_bytes
    if cap is None:
        return Verdict(None, None, None, None, *_suggestions(setup, estimator, None))
    rows, uncalibrated = _suggestions(setup, estimator, cap)
    return Verdict(
        capacity_bytes=cap,
        fits=est.peak_bytes <= cap,
        headroom_bytes=cap - est.peak_bytes,
        max_micro_batch=max_micro_batch(setup, estimator, cap),
        suggestions=rows,
        uncalibrated=uncalibrated,
    )


# ---- multi-GPU ------------------------------------------------------------------------------
MAX_GPUS = 4096


@dataclass(frozen=True)
class GpuPlan:
    """The fewest GPUs each strategy needs, and the best strategy at the current count."""

    min_gpus: dict[str, int | None]  # None: does not fit even on MAX_GPUS (or not weighed: ``unweighed``)
    best_strategy: str | None  # at setup.parallel.gpus; None if nothing fits
    best_peak_bytes: int | None
    #: Strategies the estimator could not answer for (a fitted model not calibrated for them, or a layout its method
    #: or the setup does not cover): their ``None`` means "not weighed", not "never fits".
    unweighed: tuple[str, ...] = ()
    #: Those of :attr:`unweighed` the setup or the estimator's method does not model for this layout at all (sequence
    #: parallelism of a family without a block model beside DDP, ZeRO in its pipeline stages, an offload DDP has
    #: not), each with the field that rules it out: no calibration would weigh them, where the others wait for one.
    unmodelled: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"min_gpus": dict(self.min_gpus), "best_strategy": self.best_strategy,
                "best_peak_bytes": self.best_peak_bytes, "unweighed": list(self.unweighed),
                "unmodelled": dict(self.unmodelled)}


def gpu_plan(setup: TrainingSetup, estimator: Estimator) -> GpuPlan | None:
    """Minimum GPU count per strategy (per-GPU memory never grows with more GPUs) and the best strategy.

    The best strategy at the current count is the first that fits in order of least communication
    (DDP, ZeRO-1, ZeRO-2, FSDP SHARD_GRAD_OP, HYBRID, ZeRO-3, FULL_SHARD), keeping the chosen offload.
    """
    cap = setup.capacity_bytes
    if cap is None or not setup.architecture_known:
        return None

    unanswered: set[tuple[str, int]] = set()
    refused: dict[tuple[str, int], str] = {}  # → the field that rules the layout out

    def peak(strategy: str, gpus: int) -> int | None:
        # None: a layout the setup does not model under this strategy (sequence parallelism of a family without a
        # block model beside DDP, an offload the strategy has not), or a what-if the estimator cannot answer yet (a
        # fitted model not calibrated for it: the field "method"): not weighed, which "never" would misstate
        # (each strategy over all the data-parallel GPUs: FSDP2's hybrid replicas are FSDP2's alone, and their count
        # would leave most GPU counts without a layout)
        changes: dict[str, Any] = {"strategy": strategy, "gpus": gpus, "dp_replicate": 1}
        try:
            answer: int | None = estimator(setup.with_changes(parallel=replace(setup.parallel, **changes))).peak_bytes
        except InputError as exc:
            answer = None
            if exc.field != "method":
                refused[(strategy, gpus)] = exc.field
        if answer is None:
            unanswered.add((strategy, gpus))
        return answer

    par = replace(setup.parallel, dp_replicate=1)  # (the plan weighs each strategy without hybrid replicas)
    # GPU counts come in whole model-parallel groups, and in as many of them as split the experts (expert
    # parallelism needs a stage's GPUs a count it divides): then more groups never need more memory per GPU
    group = model_parallel_group(par)
    mins: dict[str, int | None] = {}
    for strategy in PREFERENCE:
        top = MAX_GPUS // group
        one = peak(strategy, group)  # one model-parallel group: no replicas, no gradient buckets
        if one is not None and one <= cap:
            mins[strategy] = group
            continue
        p = peak(strategy, top * group)
        if p is None or p > cap:
            mins[strategy] = None
            continue
        lo, hi = 1, top  # groups: peak(lo) > cap, peak(hi) <= cap
        while hi - lo > 1:
            mid = (lo + hi) // 2
            pm = peak(strategy, mid * group)
            if pm is not None and pm <= cap:
                hi = mid
            else:
                lo = mid
        mins[strategy] = hi * group
    best: str | None = None
    best_peak: int | None = None
    for strategy in PREFERENCE:
        p = peak(strategy, setup.parallel.gpus)
        if p is not None and p <= cap:
            best, best_peak = strategy, p
            break
    # not weighed: no answer at the most GPUs, the count that decides "never"
    most = (MAX_GPUS // group) * group
    unweighed = tuple(s for s in PREFERENCE if mins.get(s) is None and (s, most) in unanswered)
    return GpuPlan(mins, best, best_peak, unweighed, {s: refused[(s, most)] for s in unweighed if (s, most) in refused})
