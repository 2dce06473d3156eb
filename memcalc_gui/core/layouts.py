"""The layouts of a GPU count: every split of the model over tensor, pipeline and data parallelism, its most loaded
GPU's peak, and a ranking by what fits and how fast it would train.

A layout is ``tp × pp × cp × dp`` GPUs (the setup's context parallelism kept) with a data-parallel strategy. Tensor
parallelism stays within a node and comes with
sequence and loss parallelism (they only save memory; Megatron-LM always splits the vocabulary and torchtitan's FSDP2
does by default, ``distributed.default_loss_parallel``, and the search splits it under every strategy); the stages
split the layers evenly; the step's micro-batches
are the setup's gradient-accumulation steps, so a layout with more data-parallel replicas trains on more tokens a step.

Ranking (a heuristic, stated so it can be argued with): layouts that fit first, then the most tokens per second by a
rough model of one step, then the most headroom. The step takes its compute, ``6 · parameters · tokens`` FLOPs spread
over the GPUs at :data:`EFFECTIVE_FLOPS` each (Kaplan et al. 2020's 6N per token), stretched by the pipeline's bubble
``(pp − 1)/(m·v + pp − 1)`` (Narayanan et al. 2021; a third of it under interleaved zero bubble and none under
zero bubble V, Qi et al. 2024's analysis with equal forward, input-gradient and weight-gradient times), plus its
communication, not overlapped, at
:data:`NVLINK_BYTES_PER_S` within a node and :data:`NETWORK_BYTES_PER_S` between nodes per GPU. Communication is what
a GPU sends, ring collectives moving ``2(n − 1)/n`` of the buffer for an all-reduce:

- data parallelism: the rank's gradients all-reduced once per step (DDP, ZeRO-1/2, Megatron: reduce-scatter +
  all-gather of the same volume), and the weights gathered again in forward and backward for ZeRO-3/FSDP (3×);
  under FSDP2's hybrid sharding that within a replica, then the reduced shard all-reduced across the replicas. An
  FSDP2 layout whose data-parallel GPUs span nodes comes with its hybrid twin, one replica per node
  (torchtitan's HSDP: the all-gathers on NVLink, more memory per GPU);
- tensor parallelism: four all-reduces (or their sequence-parallel reduce-scatter/all-gather pairs) of the hidden
  states per layer and micro-batch, two in forward and two in backward (Shoeybi et al. 2019);
- pipeline parallelism: the stage's output and its gradient once per micro-batch;
- expert parallelism: the routed experts' gradients reduced over the ``dp·tp/(ep·etp)`` GPUs holding the same
  experts, and each MoE layer's all-to-all, every token's top-k hidden states out and back, in forward and in
  backward (Lepikhin et al. 2020's GShard dispatch), ``(ep − 1)/ep`` of them leaving the GPU; with Megatron-LM's
  expert tensor parallelism the etp GPUs sharing an expert all-gather their routed tokens before it and
  reduce-scatter after it, in forward and in backward (``etp − 1`` shares sent each time, within a node), and an
  all-to-all's ep GPUs lie etp apart (Megatron-Core orders the expert ranks etp first). A mixture of experts computes
  ``6 · active parameters · tokens``.

The constants are an H100-class node's (bf16 at about 40 % of its dense peak, NVLink 4, one 400 Gb/s NIC per GPU);
they rank layouts against each other, they do not predict a run's speed.

A family without a block model (the fitted method, :mod:`memcalc_gui.core.fitted`) is searched by its
:class:`ModelShape` and an estimator over its fits: tensor parallelism without loss parallelism, with sequence
parallelism where a traced rank runs torchtitan's plan (FSDP2, or DDP over the one replica's GPUs; no pipeline
stages: :attr:`ModelShape.rank_sequence_parallel`), pipeline stages that split the layers evenly under the
strategies its fits run (:attr:`ModelShape.pipeline_strategies`), and for a mixture of experts every expert-parallel
degree that splits the experts and the data-parallel GPUs, and under Megatron-LM's strategies each expert split over
2, 4 or 8 GPUs of a node (``etp``, weighed from the fits of whole experts). A layout the estimator has no fit for is
left out and counted (:attr:`Search.left_out`), never guessed; so is the fewest-GPUs count of a layout whose other
GPU counts are not calibrated (FSDP2's stage fits are of one data-parallel width).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

from .distributed import STRATEGY_SHORT, ZERO_BUBBLE, Parallelism
from .errors import InputError
from .ledger import Estimate
from .setup import TrainingSetup

#: The data-parallel strategies whose pipeline stages of a fitted family the schedule's own trace runs (each stage
#: replicated, or ``fully_shard``-ed over its data-parallel ranks), as ``--method trace`` does; the others' states come
#: by rule over a traced replica (``core.fitted``), which does not split the experts beside tensor parallelism.
TRACED_PIPELINE_STRATEGIES: Final = ("ddp", "fsdp2")


def stage_group_runs(par: Parallelism) -> bool:
    """A pipeline stage's tensor-parallel group of a fitted family runs for real in its traces (transformers' plan,
    and torchtitan's sequence-parallel one on top with ``sp``): beside expert parallelism (the tokens split over the
    group before the all-to-all) and with sequence parallelism (the rank's seq/tp tokens between the blocks), neither
    of which the narrower model that otherwise stands for one of its ranks has."""
    return par.pp > 1 and par.tp > 1 and (par.ep > 1 or par.sp)

#: Strategies the search tries, least communication first (``distributed.PREFERENCE``'s order).
LAYOUT_STRATEGIES: Final = ("ddp", "megatron", "zero1", "megatron-distopt", "zero2", "zero3", "fsdp2")
TP_DEGREES: Final = (1, 2, 4, 8)
PP_DEGREES: Final = (1, 2, 4, 8, 16, 32)
#: The throughput model's constants (see the module's docstring).
EFFECTIVE_FLOPS: Final = 400e12
NVLINK_BYTES_PER_S: Final = 450e9
NETWORK_BYTES_PER_S: Final = 50e9
#: The fewest-GPUs search runs for this many of the best layouts (each is a bisection of a dozen estimates).
MIN_GPUS_FOR: Final = 12
#: Expert-parallel degrees tried for a mixture of experts (each must divide the experts and the data-parallel GPUs).
EP_DEGREES: Final = (1, 2, 4, 8, 16, 32, 64)
#: Megatron-LM's expert-tensor-parallel degrees tried beside them (within a node, as tensor parallelism).
ETP_DEGREES: Final = (2, 4, 8)
#: What an estimator's :class:`InputError` says of a layout it would weigh once calibrated (the fitted method's
#: estimators; :attr:`Search.left_out` keeps these apart from layouts that cannot be weighed at all).
NOT_CALIBRATED: Final = "needs a calibration of its own rank (not calibrated yet)"


@dataclass(frozen=True)
class ModelShape:
    """What the search needs of a model: its size for the step model, its width and depth for the communication,
    its routed experts for the expert-parallel degrees. From the block model, or from a fit's structure."""

    num_params: int
    hidden_size: int
    num_layers: int
    num_experts: int = 0
    block_model: bool = True  # sequence and loss parallelism are searched for a block model only
    #: The strategies whose pipeline stages are searched: ``None`` every one (a block model's), ``()`` none
    pipeline_strategies: tuple[str, ...] | None = None
    expert_params: int = 0  # the routed experts' parameters (what expert parallelism splits)
    top_k: int = 0  # experts per token (the all-to-all's copies of each token)
    active_params: int = 0  # parameters a token runs through (the step's compute); 0: all of them
    #: Without a block model: sequence parallelism is searched too, as torchtitan's plan on a traced rank (FSDP2, or
    #: every GPU of one replica tensor-parallel, without pipeline stages), weighed where that rank is calibrated
    rank_sequence_parallel: bool = False

    @staticmethod
    def of(setup: TrainingSetup) -> ModelShape:
        """The block model's shape; :class:`InputError` naming the model without one."""
        spec = setup.model
        if spec is None:
            raise InputError("model", "a layout search splits a model's layers and heads: it needs an architecture")
        return ModelShape(spec.num_params, spec.hidden_size, spec.num_layers)


def layout_label(p: Parallelism) -> str:
    """``TP 8 + SP + loss parallel × PP 2 (1F1B) × FSDP2 over 4[ (2 replicas of 2)][, experts over 2][ (no reshard
    after forward)]``."""
    return (p.model_parallel_text + " × " if p.model_parallel_text else "") + \
        f"{STRATEGY_SHORT.get(p.strategy, p.strategy)} over {p.dp:,}" \
        + (f" ({p.dp_replicate} replicas of {p.dp // p.dp_replicate})" if p.dp_replicate > 1 else "") \
        + p.experts_text \
        + (" (no reshard after forward)" if p.strategy == "fsdp2" and not p.reshard_after_forward else "")


@dataclass(frozen=True)
class Layout:
    """One layout: its per-GPU peak, whether it fits, and the ranking's communication estimate."""

    parallel: Parallelism
    peak_bytes: int
    capacity_bytes: int | None
    communication_bytes: int
    bubble: float
    seconds_per_token: float  # the ranking's step model (module docstring); compare layouts, not runs
    min_gpus: int | None = None  # the fewest GPUs of this tp × pp × strategy that fit (None: never, or not searched)
    min_gpus_searched: bool = False
    #: The peak is an upper bound (a family without a block model: the autocast step's fit standing in for the bf16
    #: step of FSDP2 or Megatron-LM until that is calibrated)
    upper_bound: bool = False

    @property
    def fits(self) -> bool | None:
        return None if self.capacity_bytes is None else self.peak_bytes <= self.capacity_bytes

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.capacity_bytes is None else self.capacity_bytes - self.peak_bytes

    @property
    def label(self) -> str:
        return layout_label(self.parallel)

    def to_json(self) -> dict[str, Any]:
        p = self.parallel
        return {"label": self.label, "gpus": p.gpus, "tp": p.tp, "pp": p.pp, "dp": p.dp, "ep": p.ep, "etp": p.etp,
                "sp": p.sp, "dp_replicate": p.dp_replicate,
                "loss_parallel": p.loss_parallel, "strategy": p.strategy, "schedule": p.schedule,
                "reshard_after_forward": p.reshard_after_forward,
                "peak_bytes": self.peak_bytes, "fits": self.fits, "seconds_per_token": self.seconds_per_token,
                "headroom_bytes": self.headroom_bytes, "communication_bytes": self.communication_bytes,
                "bubble": round(self.bubble, 4), "min_gpus": self.min_gpus, "upper_bound": self.upper_bound}


def candidates(setup: TrainingSetup, gpus: int | None = None, shape: ModelShape | None = None) -> list[Parallelism]:
    """Every layout of ``gpus`` (default the setup's) the model can be split into (see the module's docstring)."""
    par = setup.parallel
    gpus = gpus or par.gpus
    shape = shape or ModelShape.of(setup)
    out: list[Parallelism] = []
    staged = shape.block_model or bool(shape.pipeline_strategies)
    for tp in TP_DEGREES:
        for pp in PP_DEGREES if staged else (1,):
            if gpus % (tp * pp * par.cp) or tp > par.node_size:
                continue
            if pp > 1 and not shape.block_model and shape.num_layers % (pp * par.virtual_stages):
                continue  # a fitted stage is a whole share of the layers (trace.fit.pipeline_chunk_layers)
            dp = gpus // (tp * pp * par.cp)
            for ep in _ep_degrees(shape, dp, tp):
                for strategy in LAYOUT_STRATEGIES:
                    if pp > 1 and shape.pipeline_strategies is not None and strategy not in shape.pipeline_strategies:
                        continue
                    if pp > 1 and tp > 1 and ep > 1 and not shape.block_model \
                            and (strategy not in TRACED_PIPELINE_STRATEGIES or par.cp > 1):
                        # expert beside tensor parallelism in stages: fitted from traced stages only, and not beside
                        # context parallelism too (core.fitted.pipeline_layout)
                        continue
                    try:
                        split = tp > 1 and shape.block_model  # sequence and loss parallelism need a block model
                        # (the zero-bubble schedules are modelled without sequence parallelism, and beside FSDP2
                        # without resharding after forward, the one way PyTorch's W gets the weight gradients right)
                        zb = pp > 1 and par.schedule in ZERO_BUBBLE
                        layout = Parallelism(gpus=gpus, tp=tp, pp=pp, strategy=strategy, ep=ep,
                                             reshard_after_forward=not (zb and strategy == "fsdp2"),
                                             node_size=par.node_size, loss_parallel=split,
                                             sp=split and not zb,
                                             schedule=par.schedule if pp > 1 else "1f1b",
                                             virtual_stages=par.virtual_stages if pp > 1 else 1, cp=par.cp)
                        setup.with_changes(parallel=layout)  # the model must split this way
                    except InputError:
                        continue
                    out.append(layout)
                    hybrid = _hybrid(setup, layout, shape)
                    if hybrid is not None:
                        out.append(hybrid)
                    out.extend(_rank_sequence_parallel(setup, [layout] if hybrid is None else [layout, hybrid],
                                                       shape))
                    out.extend(_expert_tensor(setup, layout, shape))
    return out


def _rank_sequence_parallel(setup: TrainingSetup, pars: list[Parallelism], shape: ModelShape) -> list[Parallelism]:
    """For a family without a block model whose traced rank runs torchtitan's sequence-parallel plan
    (:attr:`ModelShape.rank_sequence_parallel`): each of ``pars`` with sequence parallelism where that rank is what
    runs it (``core.fitted.rank_layout``): FSDP2 over the data-parallel GPUs, or DDP with every GPU of the one replica
    tensor-parallel; no pipeline stages (a stage's traced schedule is a calibration of its own)."""
    if shape.block_model or not shape.rank_sequence_parallel:
        return []
    out = []
    for par in pars:
        alone = par.strategy == "ddp" and par.dp * par.cp == 1  # every GPU of the one replica tensor-parallel
        if par.tp < 2 or par.pp > 1 or not (par.strategy == "fsdp2" or alone):
            continue
        split = _variant(setup, par, sp=True)
        if split is not None:
            out.append(split)
    return out


def _variant(setup: TrainingSetup, par: Parallelism, **changes: Any) -> Parallelism | None:
    """``par`` with ``changes``, or ``None`` where the setup refuses that split of the model."""
    try:
        changed = dataclasses.replace(par, **changes)
        setup.with_changes(parallel=changed)
    except InputError:
        return None
    return changed


def _expert_tensor(setup: TrainingSetup, par: Parallelism, shape: ModelShape) -> list[Parallelism]:
    """``par`` with each routed expert split over 2, 4 or 8 GPUs of a node (Megatron-LM's expert tensor parallelism,
    ``ep × etp`` dividing a stage's data- and tensor-parallel GPUs), under Megatron-LM's strategies for a mixture of
    experts without a block model (where the fitted ledger weighs it, from the fits of ``etp`` 1)."""
    if not par.strategy.startswith("megatron") or shape.block_model or not shape.num_experts:
        return []
    out = []
    for etp in ETP_DEGREES:
        if etp > par.node_size or (par.dp * par.tp) % (par.ep * etp):
            continue
        split = _variant(setup, par, etp=etp)
        if split is not None:
            out.append(split)
    return out


def _hybrid(setup: TrainingSetup, par: Parallelism, shape: ModelShape) -> Parallelism | None:
    """FSDP2's hybrid twin of ``par`` where its data-parallel group spans nodes: one replica per node, each
    ``fully_shard``-ed over its node's data-parallel GPUs (torchtitan's HSDP), or ``None``. (Pipeline stages for a
    block model only, where a family without one would wait for one more calibration of each stage; the experts
    split within a replica, and not in pipeline stages: ``Parallelism`` refuses the others.)"""
    if par.strategy != "fsdp2" or (par.pp > 1 and not shape.block_model):
        return None
    shards = par.node_size // (par.tp * par.cp)
    if shards * par.cp < 2 or shards >= par.dp or par.dp % shards:
        return None
    return _variant(setup, par, dp_replicate=par.dp // shards)


def _ep_degrees(shape: ModelShape, dp: int, tp: int) -> tuple[int, ...]:
    """The expert-parallel degrees of a layout: for a mixture of experts, each of :data:`EP_DEGREES` that divides the
    experts and the GPUs of a model replica's data- and tensor-parallel ranks, a multiple of ``tp`` (transformers'
    layout: the experts run whole, the tokens of a tensor-parallel group split over its GPUs); 1 otherwise."""
    if not shape.num_experts:
        return (1,)
    return tuple(ep for ep in EP_DEGREES if ep <= dp * tp and not (dp * tp) % ep and (ep == 1 or not ep % tp)
                 and not shape.num_experts % ep)


def communication(setup: TrainingSetup, par: Parallelism,
                  shape: ModelShape | None = None) -> tuple[int, float, float]:
    """(bytes a GPU sends per step, the pipeline bubble, seconds per token) by the module's heuristic."""
    if shape is None and setup.model is None:
        return 0, 0.0, 0.0
    spec = shape or ModelShape.of(setup)
    m, v = setup.grad_accum, par.virtual_stages
    act = 4 if setup.precision == "fp32" else 2
    grad = 4 if setup.precision in ("fp32", "mixed") else 2
    split = par.expert_split  # ep × etp: the routed experts split over as many GPUs (whole ones beside tensor
    experts = spec.expert_params if split > 1 else 0  # parallelism, their weights over etp of them in Megatron-LM),
    copies = par.dp * par.tp // split  # reduced over the GPUs that hold the same ones
    rank_params = (spec.num_params - experts) // (par.tp * par.pp)
    hidden = setup.tokens * spec.hidden_size * act  # one micro-batch's hidden states

    def ring(n: int) -> float:
        return 2 * (n - 1) / n if n > 1 else 0.0

    def leaves(group: int, stride: int) -> bool:  # a group of GPUs ``stride`` apart is wider than a node
        return group * stride > par.node_size

    gathers = 3 if par.strategy == "zero3" or par.strategy.startswith("fsdp") else 1
    shards, replicas = par.dp // par.dp_replicate, par.dp_replicate
    parts = [(ring(shards) * rank_params * grad * gathers, leaves(shards, par.tp * par.pp)),
             # FSDP2's hybrid sharding: then each reduce-scattered shard all-reduced across the replicas
             (ring(replicas) * rank_params // shards * grad, leaves(replicas, shards * par.tp * par.pp)),
             (ring(par.tp) * 4 * (spec.num_layers // par.pp) * hidden * m, leaves(par.tp, 1)),
             (2 * hidden * m if par.pp > 1 else 0, leaves(par.pp, par.tp)),
             # expert parallelism: the experts' gradients over the replicas holding the same experts, and each MoE
             # layer's all-to-all, every token's top-k hidden states out and back in forward and again in backward
             # (a tensor-parallel group's GPUs each send their share of its tokens)
             (ring(copies) * experts // (par.pp * split) * grad * gathers, leaves(copies, par.pp * split)),
             (4 * (par.ep - 1) / par.ep * spec.top_k * (spec.num_layers // par.pp) * hidden / par.tp * m,
              leaves(par.ep, par.pp * par.etp)),
             # expert tensor parallelism: the etp group's routed tokens all-gathered before the experts and
             # reduce-scattered after them, in forward and again in backward
             (4 * (par.etp - 1) * spec.top_k * (spec.num_layers // par.pp) * hidden / par.tp * m,
              leaves(par.etp, 1))]
    sent = sum(b for b, _ in parts)
    comm_s = sum(b / (NETWORK_BYTES_PER_S if across else NVLINK_BYTES_PER_S) for b, across in parts)
    bubble = (par.pp - 1) / (m * v + par.pp - 1) if par.pp > 1 else 0.0
    if par.schedule == "interleaved-zb":  # the deferred weight gradients fill two thirds of it (ZB-H1)
        bubble /= 3
    elif par.schedule == "zbv":  # ZB-V: none, with equal F, I and W times
        bubble = 0.0
    tokens = setup.tokens * m * par.dp
    compute_s = 6 * (spec.active_params or spec.num_params) * tokens / (par.gpus * EFFECTIVE_FLOPS)
    return int(sent), bubble, (compute_s / (1 - bubble) + comm_s) / tokens


class Search(list[Layout]):
    """The layouts found, best first; :attr:`left_out` says which the estimator could not weigh, and why."""

    left_out: dict[str, list[Parallelism]]  # the reason → the layouts it left out

    def __init__(self, layouts: Iterable[Layout] = (), left_out: dict[str, list[Parallelism]] | None = None) -> None:
        super().__init__(layouts)
        self.left_out = left_out or {}

    @property
    def left_out_count(self) -> int:
        return sum(len(v) for v in self.left_out.values())

    def speed_text(self, layout: Layout) -> str:
        """``layout``'s tokens per second relative to the fastest layout that fits (``87 %``). A layout that does not
        fit is in parentheses, as if it did (``(130 %)``: it would be faster, but it does not run); ``—`` without a
        layout that fits."""
        best = min((lay.seconds_per_token for lay in self if lay.fits is not False and lay.seconds_per_token),
                   default=None)
        if not best or not layout.seconds_per_token:
            return "—"
        text = f"{best / layout.seconds_per_token:.0%}"
        return f"({text})" if layout.fits is False else text


def search(setup: TrainingSetup, estimator: Callable[[TrainingSetup], Estimate], gpus: int | None = None,
           min_gpus_for: int = MIN_GPUS_FOR, shape: ModelShape | None = None) -> Search:
    """The layouts of ``gpus`` GPUs, best first (the module's ranking), each with its most loaded GPU's peak; the
    fewest GPUs each of the best ``min_gpus_for`` needs. ``shape``: a model without a block model (the fitted
    method's); a layout its ``estimator`` refuses (:class:`InputError`, no fit for it) is left out and counted."""
    shape = shape or ModelShape.of(setup)
    cap = setup.capacity_bytes
    found = Search()
    for par in candidates(setup, gpus, shape):
        trial = setup.with_changes(parallel=par)
        try:
            est = estimator(trial)
        except InputError as exc:
            found.left_out.setdefault(exc.reason, []).append(par)
            continue
        comm, bubble, per_token = communication(trial, par, shape)
        found.append(Layout(par, est.peak_bytes, cap, comm, bubble, per_token,
                            upper_bound=bool(est.details.get("upper_bound"))))
    found.sort(key=lambda lay: (lay.fits is False, round(lay.seconds_per_token, 15),
                                -(lay.headroom_bytes or 0), lay.peak_bytes))
    if cap is not None:
        found[:min_gpus_for] = [_with_fewest(setup, lay, estimator, cap) for lay in found[:min_gpus_for]]
    return found


def _with_fewest(setup: TrainingSetup, layout: Layout, estimator: Callable[[TrainingSetup], Estimate],
                 cap: int) -> Layout:
    """``layout`` with the fewest GPUs of its tp × pp × cp × strategy that fit (the solver's search, in whole
    groups); left unsearched where a GPU count the search weighed is not calibrated (it would read as not fitting)."""
    from .solver import _fewest_gpus

    uncalibrated: list[str] = []

    def weighed(s: TrainingSetup) -> Estimate:
        try:
            return estimator(s)
        except InputError as exc:
            if NOT_CALIBRATED in exc.reason:
                uncalibrated.append(exc.reason)
            raise

    fewest = _fewest_gpus(setup.with_changes(parallel=layout.parallel), weighed, cap)
    return layout if uncalibrated else dataclasses.replace(layout, min_gpus=fewest, min_gpus_searched=True)
