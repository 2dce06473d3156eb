"""What a measurement of a multi-GPU setup runs: the layout's ranks as real processes of PyTorch's distributed runtime.

A setup spread over GPUs is measured rank by rank (:mod:`.distributed`): each rank a process on PyTorch's gloo
backend, running the same parallelization the per-rank trace runs, on real tensors, every tensor it holds counted.
This module decides, without torch, which processes that takes and what each runs:

* **DDP** (``--strategy ddp``): ``DistributedDataParallel`` over the data-parallel ranks.
* **FSDP2** (``--strategy fsdp2``, with ``--tp``, ``--sp``, ``--cp``, ``--loss-parallel``): one rank of the
  ``dp_shard × cp × tp`` mesh as :func:`memcalc_gui.trace.ranks.run_rank` builds it (transformers' tensor-parallel
  plan with ``parallelize_module``, torchtitan's sequence-parallel plan, PyTorch's ring attention, ``fully_shard``
  over the data- and context-parallel ranks).
* **Tensor parallelism under DDP**: one replica's tensor-parallel group, the same mesh without FSDP2.
* **Context parallelism under DDP** (with tensor parallelism or without): every rank of the ring holds the model
  whole, wrapped in ``DistributedDataParallel`` over the data- and context-parallel ranks (after PyTorch's
  ``_pre_dp_module_transform`` beside tensor parallelism), so its buckets are measured, not taken by rule.
* **Pipeline parallelism** (``--pp``, any schedule; FSDP2 over each stage's data-parallel ranks): one stage per
  process under PyTorch's schedule, activations and gradients really sent. A tensor-parallel rank inside a stage is
  the model with a tp-th of the heads and MLP features (equal to the parallelized rank to the byte,
  ``tests/test_layout.py``), so a stage costs one process, not tp; sequence parallelism is not run there. With
  context parallelism (under FSDP2) each stage runs on its dp × cp processes, ring attention between them and
  ``fully_shard`` over them all, as torchtitan runs it.

* **Expert parallelism** (a mixture of experts, ``--ep`` under FSDP2, beside tensor or context parallelism or
  neither): one rank of transformers' expert layout as :func:`memcalc_gui.trace.ranks.run_rank` builds it, its
  all-to-all over gloo; in pipeline stages beside tensor parallelism each stage's tensor-parallel group runs for real
  (the narrower model would not split the experts' tokens over it).

Not run (refused, naming ``strategy``): ZeRO and FSDP1, which are DeepSpeed's and FSDP1's engines, not installed here;
Megatron-LM; offload; expert parallelism beside DDP; context beside pipeline parallelism other than under FSDP2; DDP
beside tensor and context parallelism of a mixture of experts (PyTorch's DDP wrapping hands transformers' expert
kernels plain tensors beside DTensors). A family without a block model (compared with its fitted ledger:
:mod:`.fitted`) runs its context-parallel ring as above and its pipeline stages as a block model's do, its experts
split inside them under FSDP2, each rank against its own fitted rank; its first, second and last pipeline ranks are
fitted, so a layout of more stages is measured at 2 or 3 (:func:`scale_layout`).

A layout of more ranks than this machine runs (``MAX_CPU_RANKS`` processes) is scaled down: the data-parallel
dimension first, then context, tensor and pipeline parallelism, each kept at 2 while another can give way, and the
comparison is with the estimate of exactly the layout measured, as a scaled-down single-GPU measurement is.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..core.configfile import routed_experts
from ..core.distributed import Parallelism
from ..core.errors import InputError
from ..core.layouts import stage_group_runs
from ..core.setup import TrainingSetup, one_replica_sequence_parallel
from .fitted import CONFIG_KEY

#: CPU processes a measurement runs at most (the issue's 2–4 ranks of a scaled-down model; each holds torch).
MAX_CPU_RANKS = 4
#: What a rank process costs beside its tensors (Python, torch, transformers and gloo: ~0.45 GB measured here).
PROCESS_BYTES = 512 * 2**20
#: Starting a rank process (importing torch and transformers under ``spawn``), on a 2-core machine.
SPAWN_S = 6.0
#: Starting the fork server the ranks come from on Linux (it imports torch and transformers once,
#: :func:`memcalc_gui.measure.distributed.rank_context`), and a rank forked from it (its model family's modules):
#: four DDP ranks of a 4-layer toy measured in 5.4 s cold and 1.1-1.3 s warm here, 8.3-10.1 s under spawn
#: (bench/rank_start.py).
FORK_SERVER_S = 4.0
FORKED_RANK_S = 0.5
#: The order in which a layout gives way: (dimension, the smallest it may become at that pass).
_SHRINK = (("dp", 2), ("cp", 2), ("tp", 2), ("pp", 2), ("dp", 1), ("cp", 1), ("pp", 1), ("tp", 1))


@dataclass(frozen=True)
class RankJob:
    """The processes of one measurement: ``world`` of them, each running ``strategy`` (``ddp``, ``fsdp2``, ``ranks``
    or ``pipeline:<schedule>``; see :func:`memcalc_gui.measure.distributed.measure_sharded_step`) with ``layout``
    (a :class:`~memcalc_gui.trace.ranks.RankLayout` or :class:`~memcalc_gui.trace.pipeline.PipeRank`) on ``config``;
    ``stage_of[r]`` is rank r's pipeline stage (all 0 without one)."""

    strategy: str
    world: int
    layout: Any
    config: dict[str, Any]
    stage_of: tuple[int, ...]
    notes: tuple[str, ...] = ()


def start_seconds(processes: int, cores: int) -> float:
    """The seconds ``processes`` rank processes take to start on ``cores`` cores, before their models are built: from
    the fork server (started once a session) or, elsewhere, each a spawned interpreter importing torch."""
    from .distributed import fork_server_started, uses_fork_server

    share = max(1.0, processes / max(1, cores))
    if not uses_fork_server():
        return SPAWN_S * share
    return (0.0 if fork_server_started() else FORK_SERVER_S) + FORKED_RANK_S * share


def measured_world(par: Parallelism) -> int:
    """The processes a layout's measurement runs (a stage's tensor-parallel ranks are one narrower model, unless the
    experts are split beside them)."""
    if par.pp > 1:  # (context parallelism in stages runs under FSDP2 only: refusal)
        return par.pp * (par.dp * par.cp if par.strategy == "fsdp2" else 1) * _stage_tp(par)
    return par.gpus


def _stage_tp(par: Parallelism) -> int:
    """The processes of a stage's tensor-parallel group: one (the narrower model stands for its rank) unless the
    experts are split beside it, where transformers' layout runs the group for real (a measurement's stages run
    without sequence parallelism: :func:`scale_layout`)."""
    return par.tp if stage_group_runs(par) else 1


def refusal(setup: TrainingSetup) -> str:
    """Why this layout cannot be measured for real ("" when it can)."""
    return _refused(setup)[1]


def check_measurable(setup: TrainingSetup) -> None:
    """:class:`InputError` naming the field to change where this layout cannot be measured for real."""
    field, reason = _refused(setup)
    if reason:
        raise InputError(field, reason)


def _refused(setup: TrainingSetup) -> tuple[str, str]:
    """The field to change and why (``("", "")`` when the layout is measured): the strategy's, unless another field
    is the one to change."""
    par = setup.parallel
    if par.strategy not in ("ddp", "fsdp2"):
        return "strategy", (f"a real multi-rank step runs PyTorch's own DDP and FSDP2; --strategy {par.strategy} is "
                            "another engine's (DeepSpeed, FSDP1 or Megatron-LM), which memcalc does not run: measure "
                            "the layout with ddp or fsdp2, or estimate it")
    if par.offload != "none":
        return "strategy", "offload is not run in a real multi-rank step; estimate it, or measure without --offload"
    if par.ep > 1 and par.strategy != "fsdp2":
        return "strategy", ("expert parallelism is measured for real under FSDP2 (transformers' expert layout, as the "
                            "trace runs it); --method trace runs its other layouts per rank")
    if setup.tuning.method != "full" and (par.pp > 1 or par.tp > 1 or par.cp > 1 or par.strategy == "fsdp2"):
        return "strategy", ("fine-tuning beside FSDP2 or model parallelism is not run in a real multi-rank step; DDP "
                            "measures it, the others estimate it")
    if par.pp > 1 and par.cp > 1 and par.strategy != "fsdp2":
        return "strategy", ("context beside pipeline parallelism is run for real as torchtitan runs it, each stage "
                            "fully_shard-ed over data parallel × context parallel (--strategy fsdp2)")
    if par.strategy == "ddp" and par.cp > 1 and par.tp > 1 and _has_experts(setup):
        return "strategy", ("DDP beside tensor and context parallelism of a mixture of experts is not run for real: "
                            "PyTorch's way of wrapping a tensor-parallel model in DDP hands transformers' expert "
                            "kernels plain tensors beside DTensors; measure the layout under --strategy fsdp2, or "
                            "estimate it")
    return "", ""


def _has_experts(setup: TrainingSetup) -> bool:
    """Whether ``setup``'s config routes tokens to experts (transformers' mixture-of-experts keys)."""
    config = setup.extras.get(CONFIG_KEY) if setup.model is None else setup.model.raw
    return isinstance(config, dict) and routed_experts(config) > 0


def _shrink(value: int, floor: int) -> int:
    """The next smaller size of a dimension: half when even, else ``floor``."""
    return max(floor, value // 2 if value % 2 == 0 else floor)


def scale_layout(setup: TrainingSetup, max_ranks: int = MAX_CPU_RANKS) -> tuple[TrainingSetup, list[str]]:
    """``setup`` with a layout this machine runs, at most ``max_ranks`` processes, and what changed (empty when
    nothing did).

    What is not run for real goes first: DDP replicas of a model-parallel group (a DDP run without model parallelism
    measures its buckets) and sequence parallelism. Then each dimension keeps 2 while another can give way (data
    parallel first, then context, tensor, pipeline), so the measured layout exercises every kind of split the user's
    does; FSDP2 keeps at least two ranks to shard over."""
    par = setup.parallel
    changes: list[str] = []
    if par.strategy == "ddp" and par.dp > 1 and (par.pp > 1 or (par.tp > 1 and par.cp == 1)):
        # (beside context parallelism DDP runs over the data- and context-parallel ranks: trace.ranks.parallelizer)
        changes.append(f"one data-parallel replica instead of {par.dp} (DDP beside pipeline or tensor parallelism "
                       "alone is not run for real: the step runs a stage, or one tensor-parallel group)")
        par = _with(par, dp=1)
    if par.sp and (par.pp > 1 or par.strategy != "fsdp2") \
            and not (setup.model is None and one_replica_sequence_parallel(par)):  # torchtitan's plan, no FSDP
        changes.append("no sequence parallelism (" + (
            "a pipeline stage's tensor-parallel rank runs as the narrower model, which has no sequence to split"
            if par.pp > 1 else "beside DDP it is Megatron-LM's way, which is not run here; PyTorch's runs with FSDP2")
            + ")")
        par = dataclasses.replace(par, sp=False)
    if par.loss_parallel and par.pp > 1 and par.strategy == "fsdp2" and _stage_tp(par) == 1:
        # the narrower model has its own share of the vocabulary, not DTensor's embedding gradient of the whole one,
        # which FSDP2 keeps unsynced in a stage and the ledger counts (core.pipeline.whole_vocabulary_gradient)
        changes.append("the embedding and head whole (a pipeline stage's tensor-parallel rank runs as the narrower "
                       "model, not the vocabulary-split plan; --method trace runs that plan)")
        par = dataclasses.replace(par, loss_parallel=False)
    if setup.model is None and par.pp > 3 and (par.pp % 3 == 0 or par.pp % 2 == 0):
        # a family without a block model: its first, second and last pipeline ranks are fitted
        # (core.pipeline.ranks_to_check), what every rank of 2 or 3 stages is compared with
        pp = 3 if par.pp % 3 == 0 else 2
        changes.append(f"pipeline stages {pp} instead of {par.pp} (a family without a block model has its first, "
                       "second and last ranks fitted)")
        par = _with(par, pp=pp)
    if par.dp_replicate > 1 and measured_world(par) > max_ranks:
        # FSDP2's hybrid sharding gives way first: two replicas of (at most) two shards, else one replica
        r, shards = par.dp_replicate, par.dp // par.dp_replicate
        try:  # (the experts must split within a replica)
            trial: Parallelism | None = dataclasses.replace(
                _with(dataclasses.replace(par, dp_replicate=1), dp=2 * min(shards, 2)), dp_replicate=2)
        except InputError:
            trial = None
        if trial is not None and measured_world(trial) <= max_ranks:
            changes.append(f"hybrid sharding over 2 replicas of {min(shards, 2)} GPUs instead of {r} replicas of "
                           f"{shards}")
            par = trial
        else:
            changes.append(f"one replica (FSDP2 over its {shards} GPUs) instead of {r} replicas (hybrid sharding "
                           "beside the other dimensions needs more processes than this machine runs)")
            par = _with(dataclasses.replace(par, dp_replicate=1), dp=shards)
    sizes = {"dp": par.dp, "cp": par.cp, "tp": par.tp, "pp": par.pp}
    original = dict(sizes)

    def sharded_over(s: dict[str, int]) -> int:
        return s["dp"] * s["cp"]

    def ok(s: dict[str, int]) -> bool:  # FSDP2 with nothing to shard over is not FSDP2
        return not (par.strategy == "fsdp2" and sharded_over(s) < 2 <= sharded_over(original))

    def world(s: dict[str, int]) -> int:
        return measured_world(_with(par, **s))

    for dim, floor in _SHRINK:
        while world(sizes) > max_ranks and sizes[dim] > floor:
            trial = dict(sizes, **{dim: _shrink(sizes[dim], floor)})
            if not ok(trial):
                break
            sizes = trial
    if world(sizes) > max_ranks:
        raise InputError("gpus", f"this layout needs at least {world(sizes)} processes to measure, and this machine "
                                 f"runs {max_ranks}")
    names = {"dp": "data parallel", "cp": "context parallel", "tp": "tensor parallel", "pp": "pipeline stages"}
    for dim in ("tp", "pp", "cp", "dp"):
        if sizes[dim] != original[dim]:
            changes.append(f"{names[dim]} {sizes[dim]} instead of {original[dim]}")
    scaled = _with(par, **sizes)
    if scaled.ep != par.ep:
        changes.append(f"experts split over {scaled.ep} GPUs instead of {par.ep}")
    if scaled != setup.parallel:
        setup = setup.with_changes(parallel=scaled)
    return setup, changes


def _with(par: Parallelism, **sizes: int) -> Parallelism:
    dp = sizes.pop("dp", par.dp)
    merged = {"tp": par.tp, "cp": par.cp, "pp": par.pp} | sizes
    if merged["tp"] == 1:
        sizes.update(sp=False, loss_parallel=False)
    if merged["pp"] == 1:
        sizes.update(schedule="1f1b", virtual_stages=1)
    gpus = dp * merged["tp"] * merged["cp"] * merged["pp"]
    # the experts split over as many of the remaining GPUs as they can (a stage's, with pipeline stages)
    sizes["ep"] = math.gcd(par.ep, gpus // merged["pp"])
    return dataclasses.replace(par, gpus=gpus, **sizes)


def rank_job(setup: TrainingSetup) -> RankJob:
    """The processes that measure ``setup``'s layout (already scaled to what this machine runs)."""
    from ..trace.pipeline import PipeRank
    from ..trace.ranks import RankLayout, tensor_parallel_config

    check_measurable(setup)
    par = setup.parallel
    fitted = setup.extras.get(CONFIG_KEY) if setup.model is None else None  # a family without a block model
    if setup.model is None and not isinstance(fitted, dict):
        raise InputError("model", "measuring needs an architecture (a preset or a config.json), not a bare count")
    config = dict(fitted) if isinstance(fitted, dict) else dict(setup.model.raw) if setup.model is not None else {}
    notes: list[str] = []
    if par.pp > 1:
        dp = par.dp if par.strategy == "fsdp2" else 1
        if par.tp > 1 and _stage_tp(par) == 1:
            config = tensor_parallel_config(config, par.tp, par.loss_parallel)
            notes.append(f"each stage's tensor-parallel rank runs as the model with a {par.tp}th of the heads and MLP "
                         "features (the parallelized rank's step to the byte)")
        # (context parallelism: each stage's dp × cp ranks, its units sharded over them all; refusal)
        pipe = PipeRank(par.pp, 0, par.schedule, par.virtual_stages, setup.grad_accum, dp_shard=dp // par.dp_replicate,
                        reshard_after_forward=par.reshard_after_forward, cp=par.cp, ep=par.ep, tp=_stage_tp(par),
                        dp_replicate=par.dp_replicate)
        per_stage = dp * par.cp * _stage_tp(par)
        world = par.pp * per_stage
        return RankJob(f"pipeline:{par.schedule}", world, pipe, config,
                       tuple(r // per_stage for r in range(world)), tuple(notes))
    world = par.gpus
    if par.strategy == "ddp" and par.tp == 1 and par.cp == 1:
        return RankJob("ddp", world, None, config, (0,) * world, tuple(notes))
    if par.ep > 1:  # transformers' expert layout, FSDP2 over each expert's copies (trace.ranks.RankLayout)
        return RankJob("ranks", world, RankLayout(dp_shard=par.dp // par.dp_replicate, dp_replicate=par.dp_replicate,
                                                  tp=par.tp, ep=par.ep, cp=par.cp, sp=par.sp,
                                                  reshard_after_forward=par.reshard_after_forward),
                       config, (0,) * world, tuple(notes))
    if par.strategy == "fsdp2" and par.tp == 1 and par.cp == 1 and par.dp_replicate == 1:
        return RankJob("fsdp2", world, None, config, (0,) * world, tuple(notes))
    fsdp2 = par.strategy == "fsdp2"
    ring = not fsdp2 and par.cp > 1  # DDP over the data- and context-parallel ranks, each holding the model whole
    # (FSDP2's hybrid sharding: its replicas × shards mesh, trace.ranks)
    layout = RankLayout(dp_shard=par.dp // par.dp_replicate if fsdp2 else 1,
                        dp_replicate=par.dp if ring else par.dp_replicate, tp=par.tp, cp=par.cp,
                        loss_parallel=par.loss_parallel, sp=par.sp, reshard_after_forward=par.reshard_after_forward,
                        replicate_context=ring)
    return RankJob("ranks", world, layout, config, (0,) * world, tuple(notes))
