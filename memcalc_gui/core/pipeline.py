"""Pipeline parallelism per rank: which stage holds what, how many micro-batches each keeps, and its ledger.

The decoder layers are split evenly into ``pp × virtual_stages`` stages (torchtitan's and Megatron-LM's default
split); the first stage also holds the embedding, the last the final norm, the LM head and the loss (a tied head is
the last stage's own copy, as Megatron-LM keeps it). A rank runs the step's micro-batches (the gradient-accumulation
count ``m``) through its stages as the schedule orders them, and keeps each micro-batch's saved activations from its
forward to its backward. At its peak rank ``r`` keeps:

==================  ==============================================  ===========================================
schedule            micro-batches of activations in flight          source
==================  ==============================================  ===========================================
GPipe               ``m`` (every forward before any backward)       Huang et al. 2019
1F1B                ``min(m, pp − r)``                              Narayanan et al. 2021 (PipeDream-Flush)
interleaved 1F1B    ``min(m·v, 2(pp − r − 1) + (v − 1)·g + 1)``      Narayanan et al. 2021; the warm-up count of
                    stage-chunks of ``L/(pp·v)`` layers, ``g`` the  Megatron-LM and ``ScheduleInterleaved1F1B``
                    micro-batches per round (``pp`` if it divides
                    ``m``)
zero bubble         the forwards whose weight-gradient step ``W``   Qi et al. 2024 (arXiv 2401.10241): ZB1P
(interleaved, V)    has not run, op by op of PyTorch's order        (``ScheduleInterleavedZeroBubble``) and ZB-V
                                                                    (``ScheduleZBVZeroBubble``, §6)
==================  ==============================================  ===========================================

So stage 0 keeps ``pp`` micro-batches of ``L/pp`` layers under 1F1B: ``L`` layers' worth, what one GPU without
pipelining keeps (Korthikanti et al. 2022, §4.2.3), plus the embedding; the interleaved schedule adds the factor
``1 + (pp − 1)/(pp·v)`` Megatron-LM's theoretical memory applies.

A rank's ledger is the analytic ledger of its stage model (``ModelSpec.stage_first``/``stage_last``: the embedding
or the head only where they live) for one micro-batch, plus what the schedule adds:

- the other in-flight micro-batches' saved activations and the stage output the schedule keeps for each;
- gradients during forward once a backward has run (the steady state, when ``m`` exceeds the micro-batches in flight);
- ``torch.distributed.pipelining``'s receive buffers: one per micro-batch of the activations a later stage receives
  and of the gradients an earlier one receives, made at the first step and kept (per stage-chunk when interleaved);
- 1F1B on a stage after the first: the gradient of the stage's input that a backward sends, which ``Schedule1F1B``
  holds until the next backward has run (through the forward between them);
- interleaved: the rank's forwards and backwards in PyTorch's order, each micro-batch in flight keeping what its own
  chunk keeps (:func:`rank_schedule`, ``_chunk_phases``);
- zero bubble: each backward split into the input's gradient (``I``, sent at once) and the weights' (``W``,
  deferred): a micro-batch keeps its activations until its ``W`` and, from its ``I`` on, the output gradients the
  ``W`` starts from (:func:`captured_gradients`); each ``I`` leaves its input's gradient on the receive buffer until
  the step ends; under ZB-V rank 0 holds the first and the last stage (``_zero_bubble_walk``). Modelled beside DDP,
  FSDP2 without resharding after forward (``_Fsdp2Chunks``: the units gathered from each chunk's first forward, each
  ``W``'s gradients set on the gathered weights and moved into the accumulators by the chunk's next ``I``) and tensor
  parallelism, without sequence or context parallelism (:func:`check_zero_bubble` says why) or, in this ledger,
  checkpointing (:func:`check_zero_bubble_ledger`: the fitted method and the trace run it);
- FSDP2 (``fully_shard``) under a pipeline schedule: PyTorch's stage runs every backward but the last without
  gradient sync and without resharding (``PipelineStage.backward_maybe_with_nosync``), so the stage's gathered
  weights stay and its unsharded gradients (fp32 under the mixed-precision policy) accumulate through the step. What
  that means per moment follows FSDP2's own rules: a backward right after another (the cool-down) holds every unit;
  a forward after a backward finds every unit gathered, runs no all-gather and reshards each unit after its own
  forward (so its first layer holds them all, its last layer only itself and the head still to come); the
  reduce-scatter runs once, after the last backward. Interleaved, each of a rank's stage-chunks is a ``fully_shard``
  root of its own, and the walk follows each one's state: while one works, another holds its units gathered if its
  last op was a backward (its root unit only, after a forward) and its unsharded gradients once a backward reached it.

The trace of a rank (``memcalc_gui.trace.pipeline``) runs PyTorch's own schedules on the fake process group and
checks these rules (``tests/test_pipeline.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .distributed import ZERO_BUBBLE
from .errors import InputError
from .layout import tensor_parallel_spec
from .model import ModelSpec

if TYPE_CHECKING:
    from .ledger import Estimate, PhaseLedger
    from .setup import TrainingSetup


def _interleaved_warmup(pp: int, rank: int, microbatches: int, virtual: int) -> tuple[int, int]:
    """(micro-batches per round, warm-up forwards) of ``ScheduleInterleaved1F1B`` (``_get_warmup_ops``)."""
    group = microbatches // max(1, microbatches // pp)
    return group, min((virtual - 1) * group + 2 * (pp - rank - 1), microbatches * virtual)


def check_microbatches(schedule: str, pp: int, microbatches: int) -> None:
    """:class:`InputError` naming ``grad_accum`` where PyTorch's interleaved schedule refuses the micro-batch count:
    it must be a multiple of its rounds, ``max(1, m // pp)``."""
    if schedule in ("interleaved-1f1b", "interleaved-zb") and microbatches % max(1, microbatches // pp):
        rounds = max(1, microbatches // pp)
        raise InputError("grad_accum", f"the interleaved schedule runs micro-batches in {rounds} rounds over {pp} "
                                       f"pipeline stages, so their number must be a multiple of {rounds}; "
                                       f"got {microbatches}")


def rank_schedule(schedule: str, pp: int, rank: int, microbatches: int, virtual: int = 1,
                  window: bool = False) -> list[tuple[str, int]]:
    """Rank ``rank``'s forwards and backwards in the order PyTorch's schedule runs them: ``("F" | "B", chunk)`` with
    the rank's local stage-chunk (0 to ``virtual − 1``).

    GPipe runs every forward before any backward; 1F1B warms up with ``pp − rank − 1`` forwards, then alternates one
    forward and one backward, then cools down (``Schedule1F1B``); interleaved 1F1B is ``ScheduleInterleaved1F1B``'s
    order (``_get_warmup_ops``, ``_calculate_single_rank_operations``): micro-batches go round in groups of
    ``m / max(1, m // pp)`` (``pp`` when ``m`` is a multiple of it, Megatron-LM's requirement), forwards chunk by
    chunk upwards, backwards downwards, after ``(v − 1)·group + 2(pp − rank − 1)`` warm-up forwards.

    ``window``: the interleaved steady state repeats every ``group·v`` steps (each chunk's forwards and backwards
    cancel over it), so all but two of its periods are left out: the same states, in a list of bounded length."""
    m, v = microbatches, virtual
    if schedule == "gpipe":
        return [("F", 0)] * m + [("B", 0)] * m
    if schedule == "1f1b":
        warm = min(m, pp - rank - 1)
        return [("F", 0)] * warm + [op for _ in range(m - warm) for op in (("F", 0), ("B", 0))] + [("B", 0)] * warm
    if schedule == "zbv":
        return _zbv_ops(pp, rank, m, window)
    if schedule not in ("interleaved-1f1b", "interleaved-zb"):
        raise InputError("schedule", f"unknown pipeline schedule {schedule!r}")
    check_microbatches(schedule, pp, m)
    if schedule == "interleaved-zb":
        return _zero_bubble_ops(pp, rank, m, v, window)
    group, warm = _interleaved_warmup(pp, rank, m, v)
    period = group * v
    skip = max(0, (m * v - warm) // period - 2) * period if window else 0
    ops: list[tuple[str, int]] = []
    for step in itertools.chain(range(warm + period), range(warm + period + skip, m * v + warm)):
        if step < m * v:
            ops.append(("F", (step // group) % v))
        if step >= warm:
            ops.append(("B", v - 1 - ((step - warm) // group) % v))
    return ops


def _zero_bubble_ops(pp: int, rank: int, m: int, v: int, window: bool) -> list[tuple[str, int]]:
    """``ScheduleInterleavedZeroBubble``'s order of rank ``rank``'s actions (``_get_1f1b_rank_ops`` with
    ``enable_zero_bubble``, ZB1P of the paper): interleaved 1F1B's chunk order with ``(v − 1)·group + pp − rank − 1``
    warm-up forwards, each backward an ``I`` and its ``W`` deferred by ``rank`` backwards (then run in order at the
    end). ``window``: whole periods of ``group·v`` steady steps in the middle left out (the same states)."""
    group, _ = _interleaved_warmup(pp, rank, m, v)
    warm = min((v - 1) * group + pp - rank - 1, m * v)
    steady = m * v - warm
    period = group * v
    lead = (rank // period + 2) * period  # steady steps kept before the cut (W lags by ``rank`` backwards)
    skip = max(0, (steady - lead) // period - 2) * period if window else 0
    ops: list[tuple[str, int]] = []
    backwards: list[int] = []
    done_w = 0

    def fwd(step: int) -> int:
        return (step // group) % v

    def bwd(step: int) -> int:
        return v - 1 - ((step - warm) // group) % v

    cut = min(warm + lead, m * v + warm)
    for step in itertools.chain(range(cut), range(cut + skip, m * v + warm)):
        if step < warm + steady:
            ops.append(("F", fwd(step)))
        if step >= warm:
            ops.append(("I", bwd(step)))
            backwards.append(step)
            if step - warm >= rank:
                ops.append(("W", bwd(backwards[done_w])))
                done_w += 1
    ops += [("W", bwd(b)) for b in backwards[done_w:]]
    return ops


def _zbv_ops(pp: int, rank: int, m: int, window: bool) -> list[tuple[str, int]]:
    """``ScheduleZBVZeroBubble``'s order of rank ``rank``'s actions (paper §6, ZB-V; exactly two stages per rank, chunk
    0 the stage ``rank`` and chunk 1 the stage ``2·pp − 1 − rank``): warm-up forwards of chunk 0, then of both, then
    chunk 1's forward, I and W; the steady state alternates both chunks' F, I, W; the cool-down runs the I's and
    defers the W's. It plans at least ``2·pp − 1`` micro-batches and drops the actions of those past ``m``.
    ``window``: the steady state repeats one pattern, so at most two more micro-batches than the warm-up's."""
    if window:
        m = min(m, 2 * pp + 2)  # three steady rounds or more, each the same
    n = max(2 * pp - 1, m)
    ops: list[tuple[str, int, int]] = []
    f, b = [0, 0], [0, 0]

    def act(kind: str, c: int) -> None:
        count = f if kind == "F" else b
        ops.append((kind, c, count[c]))
        if kind != "I":
            count[c] += 1
    for _ in range(2 * (pp - rank) - 1):
        act("F", 0)
    for _ in range(rank):
        act("F", 1)
        act("F", 0)
    for _ in range(pp - rank):
        act("F", 1)
        act("I", 1)
        act("W", 1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            act("F", 0)
        act("I", 0)
        act("W", 0)
        act("F", 1)
        act("I", 1)
        act("W", 1)
    w = list(b)
    i = list(b)
    for _ in range(rank):
        ops.append(("I", 0, i[0]))
        ops.append(("I", 1, i[1]))
        i[0] += 1
        i[1] += 1
    for _ in range(pp - rank):
        ops.append(("I", 0, i[0]))
        ops.append(("W", 0, w[0]))
        i[0] += 1
        w[0] += 1
    ops += [("W", 1, k) for k in range(w[1], i[1])] + [("W", 0, k) for k in range(w[0], i[0])]
    return [(kind, c) for kind, c, micro in ops if micro < m]


def in_flight(schedule: str, pp: int, rank: int, microbatches: int, virtual: int = 1) -> int:
    """Micro-batch chunks (of ``L/(pp·virtual)`` layers each) whose activations rank ``rank`` keeps at its peak: the
    most forwards :func:`rank_schedule` has run whose backward has not (its warm-up and the first steady forward)."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, pp - rank)
    if schedule == "interleaved-1f1b":
        _, warm = _interleaved_warmup(pp, rank, microbatches, virtual)
        return min(microbatches * virtual, warm + 1)
    if schedule in ZERO_BUBBLE:  # a micro-batch's activations live until its weights' gradient step (W)
        held = most = 0
        for kind, _ in rank_schedule(schedule, pp, rank, microbatches, virtual, window=True):
            held += {"F": 1, "W": -1}.get(kind, 0)
            most = max(most, held)
        return most
    raise InputError("schedule", f"unknown pipeline schedule {schedule!r}")


def check_zero_bubble_ledger(setup: TrainingSetup) -> None:
    """:class:`InputError` where the analytic zero-bubble ledger has no rule: with checkpointing. PyTorch's deferred
    weight-gradient step recomputes a checkpointed layer once per weight it differentiates and keeps every
    recomputation until it ends (traced: a backward 1.3–1.6× that of interleaved 1F1B on 2-layer stages), which no
    rule here follows yet; the fitted method (traces of the rank's own schedule) and the trace run it."""
    if setup.parallel.schedule in ZERO_BUBBLE and setup.checkpointing != "none":
        raise InputError("checkpointing", "the zero-bubble schedules' deferred weight gradients recompute a "
                                          "checkpointed layer once per weight and keep each recomputation until that "
                                          "weight-gradient step ends, which the analytic ledger does not model: the "
                                          "fitted method or the trace runs it (memcalc estimate --method fitted or "
                                          "--method trace); or use 1F1B or interleaved 1F1B with checkpointing")


def check_zero_bubble(setup: TrainingSetup) -> None:
    """:class:`InputError` for what the zero-bubble schedules are not modelled with: they are traced for block-model
    families on pipeline × DDP and pipeline × FSDP2 layouts (FSDP2 without resharding after forward: ``Parallelism``
    refuses the other, whose weight gradients PyTorch gets wrong), tensor parallelism inside a stage included (not
    sequence or context parallelism). (With checkpointing the analytic ledger refuses them:
    :func:`check_zero_bubble_ledger`.)"""
    par = setup.parallel
    if par.sp:
        raise InputError("sp", "sequence parallelism beside the zero-bubble schedules is not modelled yet: beside DDP "
                               "the ledger's is Megatron-LM's, which saves the linears' inputs split, and PyTorch's "
                               "plan, which these schedules run with, saves them gathered (traced 1.5-4 % under)")
    if par.strategy not in ("ddp", "fsdp2"):
        raise InputError("schedule", "the zero-bubble schedules are PyTorch's (torch.distributed.pipelining): they are "
                                     "modelled beside PyTorch's DDP and FSDP2; ZeRO and Megatron-LM run pipeline "
                                     "schedules of their own")
    if par.schedule == "zbv" and par.strategy == "fsdp2" and par.dp * par.cp > 1 and setup.model is not None \
            and setup.model.tied_embeddings:
        raise InputError("schedule", "ZB-V puts the embedding and the tied head on the first GPU as two FSDP2 units, "
                                     "which shard the tied matrix apart: the real step holds and trains two matrices "
                                     "(measured), which the trace does not reproduce; use interleaved zero bubble, "
                                     "DDP, or a model without tied embeddings")
    if par.cp > 1:
        raise InputError("schedule", "the zero-bubble schedules are modelled with pipeline and data parallelism only "
                                     "and tensor parallelism so far (no context parallelism inside a stage)")


def check_pipeline(spec: ModelSpec, pp: int, virtual: int = 1) -> None:
    """:class:`InputError` naming ``pp`` unless the layers split evenly into ``pp × virtual`` stages."""
    stages = pp * virtual
    if stages > 1 and spec.num_layers % stages:
        raise InputError("pp", f"{spec.name or spec.family} has {spec.num_layers} decoder layers, which "
                               f"{stages} pipeline stages cannot split evenly")


def first_checkpointed(setup: TrainingSetup) -> bool:
    """Whether a stage's first decoder layer is checkpointed (and so saves its input, whatever its norm saves)."""
    from .setup import checkpoint_every  # (setup imports this module)

    return checkpoint_every(setup.checkpointing) == 1


def stage_spec(spec: ModelSpec, pp: int, rank: int, schedule: str = "1f1b") -> ModelSpec:
    """The model rank ``rank`` of ``pp`` holds: ``L/pp`` layers, the embedding on rank 0, the head on the last (under
    the zero-bubble V schedule on rank 0 too: its "v" placement gives rank ``r`` stages ``r`` and ``2·pp − 1 − r``)."""
    if pp == 1:
        return spec
    check_pipeline(spec, pp)
    first, last = rank == 0, rank == (0 if schedule == "zbv" else pp - 1)
    return dataclasses.replace(spec, num_layers=spec.num_layers // pp, stage_first=first, stage_last=last,
                               tied_embeddings=spec.tied_embeddings and first and last,
                               name=f"{spec.name or spec.family} (pipeline rank {rank + 1} of {pp})")


def fsdp2_unsynced(setup: TrainingSetup, rank: int) -> tuple[int, int]:
    """(all units' gathered weights, all unsharded gradients) of a stage under FSDP2 and a pipeline schedule; (0, 0)
    otherwise.

    PyTorch's stage runs every backward without gradient sync or resharding and reduce-scatters once the step's last
    backward is done (``PipelineStage.backward_maybe_with_nosync`` and ``perform_reduce_grad``): from the first
    backward on, the stage's unsharded gradients accumulate in the policy's reduce dtype (fp32 under mixed
    precision) and the units it gathered stay gathered."""
    par = setup.parallel
    if par.strategy != "fsdp2" or par.pp == 1 or par.dp * par.cp == 1 or setup.model is None:
        return 0, 0
    stage = stage_spec(tensor_parallel_spec(setup.model, par.tp, par.loss_parallel), par.pp, rank)
    w = 2 if setup.precision in ("mixed", "bf16", "bf16-autocast") else 4
    grads = stage.num_params + whole_vocabulary_gradient(setup, stage)
    return stage.num_params * w, grads * (4 if setup.precision == "mixed" else w)


def whole_vocabulary_gradient(setup: TrainingSetup, stage: ModelSpec) -> int:
    """The parameters a pipeline stage's unsynced FSDP2 gradients hold beyond its own under loss parallelism: the
    vocabulary-split embedding's gradient comes out of DTensor's embedding backward replicated over the
    tensor-parallel ranks, whole, and FSDP2 accumulates it as it is until the step's reduce-scatter (traced with
    sequence parallelism and without: the first stage of an SP + loss-parallel layout read 4–7 % under without
    it)."""
    par, spec = setup.parallel, setup.model
    if not (par.loss_parallel and stage.stage_first) or spec is None:
        return 0
    return (spec.vocab_size - -(-spec.vocab_size // par.tp)) * spec.hidden_size


def ranks_to_check(pp: int) -> tuple[int, ...]:
    """The ranks whose ledgers can differ most: the first, the second (the busiest middle one), the last."""
    return tuple(sorted({0, min(1, pp - 1), pp - 1}))


def pipeline_estimate(setup: TrainingSetup) -> Estimate:
    """The ledger of the most loaded pipeline rank (see the module's docstring); ``details["pipeline_ranks"]`` has
    each checked rank's phase peaks, ``details["pipeline_rank"]`` which one this is."""
    from .analytic import estimate_analytic

    check_zero_bubble_ledger(setup)
    par = setup.parallel
    assert setup.model is not None
    spec = setup.model
    m = setup.grad_accum
    ranks: list[dict[str, Any]] = []
    best: Estimate | None = None
    best_peak = -1
    for r in ranks_to_check(par.pp):
        est = _rank_estimate(setup, spec, r, m, estimate_analytic)
        peak = max(est.phases[ph].total_bytes for ph in est.phases)
        flights = in_flight(par.schedule, par.pp, r, m, par.virtual_stages)
        ranks.append({"rank": r, "in_flight": flights, "peak_bytes": peak,
                      "phases": {ph: est.phases[ph].total_bytes for ph in est.phases}})
        if peak > best_peak:
            best, best_peak = est, peak
    assert best is not None
    details = dict(best.details, pipeline_ranks=ranks)
    return dataclasses.replace(best, setup=setup, details=details)


def stage_estimate(setup: TrainingSetup, rank: int) -> Estimate:
    """The ledger of pipeline rank ``rank`` (0-based) of ``setup``'s layout, any rank (the estimate itself checks the
    first, the second and the last): what a measurement of every rank is compared with."""
    from .analytic import estimate_analytic

    assert setup.model is not None
    if not 0 <= rank < setup.parallel.pp:
        raise InputError("stage", f"must be a pipeline rank from 0 to {setup.parallel.pp - 1}, got {rank!r}")
    return _rank_estimate(setup, setup.model, rank, setup.grad_accum, estimate_analytic)


@dataclasses.dataclass(frozen=True)
class _View:
    """What FSDP2 holds of one stage, or of one stage-chunk of an interleaved rank (each chunk is a ``fully_shard``
    root of its own): its model, its ledgers of one and of ``m`` micro-batches, its units' gathered weights and
    unsharded gradients in all, its root unit's and a layer's gathered weights, and the receive buffers and token
    ids counted with it (a chunk's are the rank's, counted once)."""

    stage: ModelSpec
    one: Estimate
    acc: Estimate
    gathered: int
    unsynced: int
    root_w: int
    layer_w: int
    buffers: int
    inputs: int


def _rank_estimate(setup: TrainingSetup, spec: ModelSpec, rank: int, m: int,
                   analytic: Callable[[TrainingSetup], Estimate]) -> Estimate:
    from .ledger import with_overheads
    from .vocab import PHASES

    par = setup.parallel
    v = par.virtual_stages
    stage = stage_spec(spec, par.pp, rank, par.schedule)
    inner = dataclasses.replace(par, pp=1, gpus=par.gpus // par.pp, schedule="1f1b", virtual_stages=1)
    one = analytic(dataclasses.replace(setup, model=stage, parallel=inner, grad_accum=1))
    acc = analytic(dataclasses.replace(setup, model=stage, parallel=inner, grad_accum=m)) if m > 1 else one
    flights = in_flight(par.schedule, par.pp, rank, m, v)
    t = setup.tokens // par.cp  # a context-parallel rank's share of the tokens
    h = spec.hidden_size
    # the hidden states a stage sends: fp32 under autocast, 16-bit where FSDP2's policy computes in bf16
    residual = 4 if setup.precision == "fp32" or (setup.precision == "mixed" and par.strategy != "fsdp2") else 2
    # what one micro-batch keeps from its forward to its backward: its saved activations and the stage's output (kept
    # by the schedule; on the last stage the logits, and the loss's log-softmax); a later stage's first layer keeps its
    # input, which is the receive buffer it came in (counted among the buffers)
    # under sequence parallelism a stage sends, receives and starts from its tensor-parallel rank's share of the tokens
    stream = (t // par.tp if par.sp else t) * h * residual
    vocab = tensor_parallel_spec(spec, par.tp, par.loss_parallel).vocab_size  # the logits' width on this rank
    # (interleaved: each of the rank's v chunks keeps its output, and receives its input but the very first); autocast
    # makes each micro-batch's 16-bit weight copies anew, and its matmuls save them
    first, last = int(stage.stage_first), int(stage.stage_last)
    # where the residual stream is saved (fp32 or autocast's fp32 stream, LayerNorm), the ledger of a stage before the
    # last counts one stream tensor for the final norm it does not have: the stage's output, which the schedule keeps
    # (so not counted twice; traced, and the real 2-process gloo pipeline equals the trace on the last stage)
    own_stream = int(one.details.get("stream_kept_bytes", 0))
    # a later stage's first layer saves its input itself where it is checkpointed, or where the stream is saved as it
    # is (a 16-bit stream's RMSNorm saves its fp32 upcast, a tensor of its own: traced): that is the receive buffer,
    # not counted twice
    received = stream if own_stream or first_checkpointed(setup) else 0
    # the at-work micro-batch's input in forward, a receive buffer counted among the buffers: without FSDP2 where the
    # stage saves it as it is; FSDP2's moments count it among what the frames hold where the stream is not saved
    forward_input = received if par.strategy != "fsdp2" \
        else stream if not own_stream or first_checkpointed(setup) else 0
    kept = int(one.details["saved_activations_bytes"]) - (v - first) * received + (v - last) * stream \
        - (1 - last) * own_stream \
        + last * (int(one.details["logits_bytes"]) + t * vocab * 4)
    kept_copies = int(one.details["saved_copy_bytes"])  # under Parameters, as the ledger counts autocast's copies
    per_micro = kept + kept_copies

    def extra(chunks: int) -> int:  # the other micro-batches (chunks) in flight beside the one at work
        return max(0, (chunks - v) * per_micro // v)
    # one receive buffer per micro-batch for each of the rank's stage-chunks' inputs (all but the very first stage's)
    # and for the gradients of each chunk's output (all but the very last stage's)
    buffers = (2 * v - first - last) * m * stream
    if par.schedule == "zbv" and rank == par.pp - 1:
        # the V's turn: this rank's two stages are neighbours, and the later one takes the earlier one's output as
        # its input directly (PyTorch's "V-schedule special case", no send or receive): one set of buffers fewer
        buffers -= m * stream
    inputs = m * t * 8 if (stage.stage_first or stage.stage_last) else 0  # the step's token ids (and labels)
    # Schedule1F1B keeps a backward's send of its input gradient (all but the first stage's) in a local list until
    # the next backward has run, so the following forward and backward hold it too (traced)
    held_input_grad = stream if par.schedule == "1f1b" and m >= par.pp and v == 1 and not stage.stage_first else 0
    gathered, unsynced = fsdp2_unsynced(setup, rank)
    unit_w = 2 if setup.precision in ("mixed", "bf16", "bf16-autocast") else 4  # FSDP2's gathered dtype
    grad_w = 4 if setup.precision == "mixed" else unit_w  # the policy's reduce dtype

    def view(model: ModelSpec, one_: Estimate, acc_: Estimate, buffers_: int, inputs_: int) -> _View:
        tp_model = tensor_parallel_spec(model, par.tp, par.loss_parallel)
        held = tp_model.num_params if gathered else 0
        grads = held + (whole_vocabulary_gradient(setup, model) if gathered else 0)
        return _View(model, one_, acc_, held * unit_w, grads * grad_w, tp_model.root_unit_params * unit_w,
                     tp_model.layer_params * unit_w, buffers_, inputs_)

    def build(vw: _View, ph: str, src: Estimate, more: int, after_backward: bool,
              cool_down: bool = False, logits_held: bool = True) -> dict[str, int]:
        """The phase's objects of ``vw``'s stage from ``src``'s ledger of one micro-batch, ``more`` bytes of other
        micro-batches in flight, whether a backward of this step has run (FSDP2's gradients are then accumulated
        unsharded, and its units gathered) and whether this backward follows another one directly (the schedule's
        cool-down); ``logits_held``: whether the rank's last forward was this stage's (whose output the schedule's
        loop holds)."""
        stage, one, acc, gathered = vw.stage, vw.one, vw.acc, vw.gathered
        bases = [dict(src.phases[ph].objects)]
        if gathered and after_backward and ph in ("forward", "backward"):
            # FSDP2: a stage's backward reshards nothing (``backward_maybe_with_nosync``), so what it gathered is
            # gathered still when the next forward or backward starts. A backward right after another holds every
            # unit throughout; a forward after a backward finds every unit gathered and reshards each after its own
            # forward (``after_backward_forward``)
            if ph == "backward":  # each moment re-weighed (its gradients are the accumulators' and its own)
                every = acc.phases["load"].objects["parameters"] + gathered
                bases = [dict(m, parameters=every) if cool_down else dict(m)
                         for m in src.details.get("backward_moments", ())] or bases
            elif ph == "forward":
                # on the last stage the previous micro-batch's logits live until this forward returns (the
                # schedule's loop still holds that output; traced)
                before = int(one.details["logits_bytes"]) if stage.stage_last and logits_held else 0
                bases = [dict(m, parameters=after_backward_forward(vw, at, m),
                              activations=m.get("activations", 0) + (before if at != "loss" else 0))
                         for at, m in src.details.get("forward_moments", ())] or bases
        return max((adjust(vw, ph, b, more, after_backward) for b in bases), key=lambda o: sum(o.values()))

    def after_backward_forward(vw: _View, at: str, moment: dict[str, int]) -> int:
        """The parameters of forward moment ``at`` after a backward under FSDP2: a unit is gathered still until its
        own forward has run and resharded it, so no forward all-gather runs (traced)."""
        stage, gathered, root_w, layer_w = vw.stage, vw.gathered, vw.root_w, vw.layer_w
        every = vw.acc.phases["load"].objects["parameters"] + gathered
        if not par.reshard_after_forward:
            return every
        if at == "embedding":  # the embedding's own forward: every unit gathered still
            return every
        if at in ("gather-first", "layer-first"):  # every unit but the embedding, which ran before
            return every - (root_w if stage.stage_first else 0)
        if at in ("gather", "layer", "attention") or (at == "loss" and not stage.stage_last):
            # the last layer (a stage before the last ends in it), and the head, whose forward is still to come
            return every - gathered + layer_w + (root_w if stage.stage_last else 0)
        if at == "head":
            return every - gathered + root_w
        return int(moment.get("parameters", 0))

    def adjust(vw: _View, ph: str, objects: dict[str, int], more: int, after_backward: bool) -> dict[str, int]:
        stage, gathered, unsynced, buffers = vw.stage, vw.gathered, vw.unsynced, vw.buffers
        root_w, layer_w, inputs = vw.root_w, vw.layer_w, vw.inputs
        own_stream = int(vw.one.details.get("stream_kept_bytes", 0))
        for k in ("cuda_context", "allocator_reserve"):
            objects.pop(k, None)
        copies_more = more * kept_copies // per_micro if per_micro else 0
        objects["activations"] = objects.get("activations", 0) + more - copies_more
        objects["parameters"] = objects.get("parameters", 0) + copies_more
        if ph == "forward" and v > 1 and par.strategy != "fsdp2":  # (FSDP2 computes without autocast)
            # autocast's cache lives through one chunk's forward: the other chunks' unsaved copies are gone
            unsaved = one.details["compute_copy_bytes"] - one.details["saved_copy_bytes"]
            objects["parameters"] = max(0, objects["parameters"] - max(0, unsaved) * (v - 1) // v)
        if ph == "forward" and not stage.stage_first:
            objects["activations"] = max(0, objects["activations"] - forward_input)
        elif ph == "backward" and not stage.stage_first and not own_stream:
            # a 16-bit stream (its RMSNorm saves the fp32 upcast): the micro-batch at work saved its input, the
            # receive buffer, only where its first layer is checkpointed; a stage before the last holds its output
            # through its backward (the schedule keeps it; a saved stream's ledger counts it as the final norm's
            # input) (traced)
            objects["activations"] = max(0, objects["activations"] + (0 if stage.stage_last else stream)
                                         - (stream if first_checkpointed(setup) else 0))
        if ph == "backward" and stage.stage_last:
            # the schedule holds the stage's output, the logits, through the stage's backward (traced)
            objects["activations"] += vw.one.details["logits_bytes"]
        if ph == "backward" and not stage.stage_last:
            # a stage before the last: its top layer's backward starts from the output's gradient, which is the
            # receive buffer it came in (among the buffers), not a tensor of its own (traced: one stream over)
            objects["temporaries"] = max(0, objects.get("temporaries", 0) - stream)
        if ph != "load":  # the token ids; the receive buffers hold activations (or their gradients)
            objects["inputs"] = inputs
            objects["activations"] = objects.get("activations", 0) + buffers
        if gathered and ((after_backward and ph == "forward") or ph == "backward"):
            # FSDP2: the unsharded gradients accumulate, none reduce-scattered before the step's last backward has
            # ended (under the mixed-precision policy in fp32 accumulators, beside the bf16 gradients the running
            # backward makes: the moment's own); the first backward gathers unit after unit and keeps them: a moment
            # as FSDP2 gathers, or one with every unit gathered and every gradient made beside the micro-batches in
            # flight (its end, the bottom unit's bf16 gradients still alive as they are copied into accumulators)
            mixed = ph == "backward" and setup.precision == "mixed"
            grads = unsynced + (objects.get("gradients", 0) if mixed else 0)
            # (the embedding's bf16 gradient is the whole vocabulary's where loss parallelism splits it: traced)
            last_unit = (root_w + whole_vocabulary_gradient(setup, stage) * unit_w if stage.stage_first
                         else layer_w) if mixed else 0
            everything = {"parameters": vw.acc.phases["load"].objects["parameters"] + gathered,
                          "gradients": unsynced + last_unit,
                          "optimizer_state": objects.get("optimizer_state", 0),
                          "inputs": objects.get("inputs", 0), "activations": more + buffers}
            working = dict(objects, gradients=grads) if after_backward else objects
            objects = max(working, everything, key=lambda o: sum(o.values()))
        if after_backward and held_input_grad and ph in ("forward", "backward"):
            objects["temporaries"] = objects.get("temporaries", 0) + held_input_grad
        return objects

    # (the stage's gathered and unsynced bytes as fsdp2_unsynced counts them)
    stage_view = dataclasses.replace(view(stage, one, acc, buffers, inputs), gathered=gathered, unsynced=unsynced)

    def chunk_moment(vw: _View, kind: str, reached: bool, last_op: str | None) -> dict[str, int]:
        """Under FSDP2, the moment of an interleaved rank's chunk ``vw`` at work (a forward ``F`` or backward ``B``)
        with its own units and gradients: the chunk is a ``fully_shard`` root of its own, its units gathered still
        after a backward of its own (``last_op``) and resharded by its forward, its gradients accumulating unsharded
        once one of its backwards has run (``reached``). The interleaved schedule keeps no earlier micro-batch's logits
        into the head chunk's next forward (traced: counting them was 2–4 % over on the last rank). The other chunks'
        are added by the walk."""
        if kind == "F":  # a forward makes no gradients: those it holds are the chunk's unsharded accumulators
            if reached and last_op != "B":  # its units resharded by its last forward: gathered anew
                return dict(build(vw, "forward", vw.one, 0, False), gradients=vw.unsynced)
            return build(vw, "forward", vw.one, 0, reached, logits_held=False)
        src = vw.one if not reached or setup.precision == "mixed" else vw.acc
        return build(vw, "backward", src, 0, reached, cool_down=last_op == "B")

    chunked = _chunk_phases(setup, stage, rank, m, analytic, stream, vocab, acc, one,
                            (lambda spec, c1, cm: view(spec, c1, cm, 0, 0), chunk_moment) if gathered else None) \
        if v > 1 or par.schedule in ZERO_BUBBLE else {}
    phases: dict[str, PhaseLedger] = {}
    for ph in PHASES:
        if ph in chunked:
            objects = dict(chunked[ph], inputs=inputs)
            objects["activations"] = objects.get("activations", 0) + buffers
            phases[ph] = with_overheads({k: val for k, val in objects.items() if val}, ph, setup)
            continue
        # the first forwards and the first backward run before any gradient exists, beside the most micro-batches in
        # flight; a later forward (steady state) or backward runs with gradients, beside fewer in the cool-down
        if ph in ("load", "optimizer_step"):
            candidates = [build(stage_view, ph, acc, 0, False)]
        else:
            candidates = [build(stage_view, ph, one, extra(flights), False)]
            if m > 1 and ph == "forward" and flights < m * v:
                candidates.append(build(stage_view, ph, acc, extra(flights), True))
            if m > 1 and ph == "backward":
                # under FSDP2's policy the stage's bf16 gradients are made anew by each backward (the fp32
                # accumulators hold the step's sum): one micro-batch's moment, without accumulation's temporaries
                later = one if gathered and setup.precision == "mixed" else acc
                candidates.append(build(stage_view, ph, later, extra(min(flights, (m - 1) * v)), True))
                if flights > 1:  # the cool-down: a backward right after the previous one, one micro-batch fewer
                    candidates.append(build(stage_view, ph, later, extra(flights - 1), True, cool_down=True))
        objects = max(candidates, key=lambda o: sum(o.values()))
        if ph == "optimizer_step" and par.schedule in ZERO_BUBBLE:
            # each I of a stage after the first left its input's gradient on the receive buffer (_zero_bubble_walk)
            objects["temporaries"] = objects.get("temporaries", 0) + (v - first) * m * stream
        phases[ph] = with_overheads({k: val for k, val in objects.items() if val}, ph, setup)
    notes: tuple[str, ...] = (
        f"Pipeline rank {rank + 1} of {par.pp} ({_schedule_label(par.schedule, v)}, {m} micro-batch(es) per step): "
        f"{stage.num_layers} decoder layers"
        + (" and the embedding" if stage.stage_first else "")
        + (", the final norm and the LM head" if stage.stage_last else "")
        + f"; {flights} micro-batch{'es' if flights != 1 else ''}"
        + (f" of {stage.num_layers // v}-layer chunks" if v > 1 else "") + " of activations in flight",)
    if gathered:
        notes += ("FSDP2 under a pipeline schedule: PyTorch's stage runs the backwards without gradient sync or "
                  "resharding and reduce-scatters after the last, so from the first backward on the stage's weights "
                  "stay gathered and its unsharded gradients accumulate",)
    if par.schedule in ZERO_BUBBLE:
        notes += ("Zero bubble (Qi et al. 2024, PyTorch's " + ("ScheduleZBVZeroBubble" if par.schedule == "zbv" else
                                                               "ScheduleInterleavedZeroBubble")
                  + "): each backward is split into the input's gradient, sent at once, and the weights', deferred; a "
                    "micro-batch keeps its activations until its weights' gradient has run, and the output gradients "
                    "that step starts from since its input's",)
    if gathered and v > 1:
        notes += ("Interleaved 1F1B under FSDP2: each of the rank's stages is a fully_shard root of its own, followed "
                  "through the schedule's order: its units gathered from its backward until its next forward "
                  "reshards them, its unsharded gradients accumulating from its first backward",)
    details = dict(acc.details, parallel_notes=notes + tuple(acc.details.get("parallel_notes", ())),
                   pipeline_rank=rank, in_flight=flights, pipeline_buffers_bytes=buffers)
    return dataclasses.replace(acc, phases=phases, details=details,
                               assumptions=acc.assumptions + notes)


def _chunk_phases(setup: TrainingSetup, stage: ModelSpec, rank: int, m: int,
                  analytic: Callable[[TrainingSetup], Estimate], stream: int, vocab: int, acc: Estimate,
                  one: Estimate,
                  fsdp2: tuple[Callable[[ModelSpec, Estimate, Estimate], _View],
                               Callable[[_View, str, bool, str | None], dict[str, int]]] | None = None,
                  ) -> dict[str, dict[str, int]]:
    """The forward and backward peaks of an interleaved rank, op by op of :func:`rank_schedule`, without its receive
    buffers and token ids.

    A rank's ``v`` stage-chunks differ: only the first rank's first chunk holds the embedding and only the last rank's
    last chunk the head, whose micro-batches keep their logits. At each forward or backward the rank holds what the
    micro-batches in flight keep, chunk by chunk, beside the one at work's own moment (its chunk's ledger of one
    micro-batch), and the gradients of the chunks a backward has reached. Averaging over the chunks instead counted
    the head's logits for every chunk in flight: 6–10 % over on a last rank with a 32K vocabulary
    (bench/pipeline.py).

    Under FSDP2 (``fsdp2``: a chunk's view and its moment at work) each chunk is a ``fully_shard`` root of its own:
    beside the one at work the rank holds each other chunk's units gathered since its last backward (resharded by
    its forward, all but its root unit) and, once a backward has reached it, its unsharded gradients."""
    par = setup.parallel
    v = par.virtual_stages
    inner = dataclasses.replace(par, pp=1, gpus=par.gpus // par.pp, schedule="1f1b", virtual_stages=1)
    t = setup.tokens // par.cp
    chunk_layers = stage.num_layers // v

    def chunk_spec(c: int) -> ModelSpec:
        return dataclasses.replace(stage, num_layers=chunk_layers, stage_first=stage.stage_first and c == 0,
                                   stage_last=stage.stage_last and c == v - 1, tied_embeddings=False)
    ledgers: dict[tuple[bool, bool], tuple[Estimate, Estimate]] = {}
    for spec in (chunk_spec(c) for c in range(v)):
        key = (spec.stage_first, spec.stage_last)
        if key not in ledgers:
            c1 = analytic(dataclasses.replace(setup, model=spec, parallel=inner, grad_accum=1))
            cm = analytic(dataclasses.replace(setup, model=spec, parallel=inner, grad_accum=m)) if m > 1 else c1
            ledgers[key] = (c1, cm)

    specs = [chunk_spec(c) for c in range(v)]

    def led(c: int) -> tuple[Estimate, Estimate]:
        return ledgers[(specs[c].stage_first, specs[c].stage_last)]

    def kept(c: int) -> tuple[int, int]:
        """(activations, autocast copies) a finished forward of chunk ``c`` keeps until its backward: its saved
        activations, its output (or, on the head's chunk, the logits and the loss's log-softmax) but not its input
        where it saves that as it is (a receive buffer: see ``received`` in _rank_estimate), and the 16-bit weight
        copies its matmuls saved."""
        c1, spec = led(c)[0], specs[c]
        own = int(c1.details.get("stream_kept_bytes", 0))
        received = 0 if spec.stage_first or not (own or first_checkpointed(setup)) else stream
        acts = int(c1.details["saved_activations_bytes"]) - received \
            + (t * vocab * 4 + int(c1.details["logits_bytes"]) if spec.stage_last
               else stream - own)
        return acts, int(c1.details["saved_copy_bytes"])

    def weights(e: Estimate) -> int:
        return int(e.phases["load"].objects.get("parameters", 0))

    keeps = [kept(c) for c in range(v)]
    grads = [int(led(c)[1].phases["optimizer_step"].objects.get("gradients", 0)) for c in range(v)]
    stage_weights = weights(acc)
    peaks: dict[str, dict[str, int]] = {}
    held: list[int] = []  # the chunks of the micro-batches in flight, in the order their forwards ran
    reached: set[int] = set()  # the chunks a backward has run on
    views = [fsdp2[0](specs[c], *led(c)) for c in range(v)] if fsdp2 is not None else []
    last: dict[int, str] = {}  # each chunk's last forward or backward so far

    def gathered_now(o: int) -> int:  # another chunk's units gathered at this moment (FSDP2)
        if o not in last:
            return 0
        if last[o] == "B" or not par.reshard_after_forward:
            return views[o].gathered
        return views[o].root_w if views[o].stage.stage_first or views[o].stage.stage_last else 0

    if par.schedule in ZERO_BUBBLE:
        return _zero_bubble_walk(setup, rank, m, specs, [led(c) for c in range(v)], keeps, grads, stage_weights,
                                 acc, one, stream, vocab)
    for kind, c in rank_schedule(par.schedule, par.pp, rank, m, v, window=True):
        if kind == "B":
            held.remove(c)
        others = [keeps[o] for o in held]
        ph = "forward" if kind == "F" else "backward"
        if fsdp2 is not None:
            own_moment = fsdp2[1](views[c], kind, c in reached, last.get(c))
            objects = dict((acc if reached else one).phases[ph].objects)
            for k in ("cuda_context", "allocator_reserve", "inputs"):
                objects.pop(k, None)
            objects["parameters"] = stage_weights - weights(led(c)[0]) + own_moment.get("parameters", 0) \
                + sum(gathered_now(o) for o in range(v) if o != c)
            objects["activations"] = own_moment.get("activations", 0) + sum(a for a, _ in others)
            objects["temporaries"] = own_moment.get("temporaries", 0)
            objects["gradients"] = own_moment.get("gradients", 0) + sum(views[o].unsynced for o in reached if o != c)
            last[c] = kind
            if kind == "F":
                held.append(c)
            else:
                reached.add(c)
            if ph not in peaks or sum(objects.values()) > sum(peaks[ph].values()):
                peaks[ph] = objects
            continue
        own = (led(c)[1] if c in reached else led(c)[0]).phases[ph].objects
        base = (acc if reached else one).phases[ph].objects
        spec = specs[c]
        objects = dict(base)
        for k in ("cuda_context", "allocator_reserve", "inputs"):
            objects.pop(k, None)
        objects["parameters"] = stage_weights + int(own.get("parameters", 0)) - weights(led(c)[0]) \
            + sum(cp for _, cp in others)
        activations = int(own.get("activations", 0)) + sum(a for a, _ in others)
        if not spec.stage_first and not led(c)[0].details.get("stream_kept_bytes"):
            # the one at work's input is a receive buffer (see _rank_estimate where the stream is saved)
            activations = max(0, activations - stream)
        if kind == "B" and spec.stage_last:  # the schedule holds the logits through the head's backward (traced)
            activations += int(led(c)[0].details["logits_bytes"])
        objects["activations"] = activations
        temporaries = int(own.get("temporaries", 0))
        if kind == "B" and not spec.stage_last:  # the output's gradient is a receive buffer (as in _rank_estimate)
            temporaries = max(0, temporaries - stream)
        objects["temporaries"] = temporaries
        objects["gradients"] = sum(grads[o] for o in reached if o != c) + \
            (int(own.get("gradients", 0)) if kind == "B" or c in reached else 0)
        if kind == "F":
            held.append(c)
        else:
            reached.add(c)
        if ph not in peaks or sum(objects.values()) > sum(peaks[ph].values()):
            peaks[ph] = objects
    return peaks


def compute_precision(setup: TrainingSetup) -> str:
    """The precision a pipeline stage computes in: FSDP2's mixed-precision policy gathers bf16 weights and computes
    in bf16 without autocast (torchtitan's default), so its stage computes as a bf16 one does."""
    if setup.parallel.strategy == "fsdp2" and setup.precision == "mixed":
        return "bf16"
    return setup.precision


def captured_gradients(setup: TrainingSetup, spec: ModelSpec, tokens: int) -> int:
    """Bytes of the gradients a zero-bubble schedule's input-gradient step ("I") of one micro-batch on stage-chunk
    ``spec`` keeps for its deferred weight-gradient step ("W").

    PyTorch's ``stage_backward_input`` hooks every op that consumes a weight (each linear's matmul, each norm's
    scaling, the head's matmul) and keeps the gradient of its output; ``stage_backward_weight`` starts from them. So a
    micro-batch between its I and its W holds one gradient per weight-consuming op, the width of that op's output, in
    its dtype (16-bit for autocast's matmuls, the stream's for the norms), beside its whole autograd graph
    (``retain_graph``). A stage before the last starts its top layer's backward from the received gradient: where the
    down projection's output has the stream's dtype, its gradient is that receive buffer, not a tensor of its own
    (traced)."""
    precision = compute_precision(setup)
    spec = tensor_parallel_spec(spec, setup.parallel.tp, setup.parallel.loss_parallel)
    lin = 2 if precision in ("mixed", "bf16", "bf16-autocast") else 4
    norm = 4 if precision in ("fp32", "mixed") else 2
    h, q, kv, inter = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    per_layer = (q + 2 * kv + h + (2 if spec.gated_mlp else 1) * inter + h) * lin + spec.norms_per_layer * h * norm
    if spec.qk_norm != "none":
        per_layer += (q + kv) * norm
    total = spec.num_layers * per_layer
    if spec.stage_last:
        total += h * norm + spec.vocab_size * lin
    elif lin == norm:
        total -= h * lin
    return tokens * total


class _Fsdp2Chunks:
    """Under FSDP2 (without resharding after forward), what a zero-bubble rank's chunks hold as the walk goes: each
    chunk's units gathered from its first forward until its last ``W`` (``backward_maybe_with_nosync`` reshards
    nothing and the forward does not), and its unsharded gradients.

    PyTorch's ``W`` differentiates the gathered (unsharded) weights, so each sets their ``.grad`` in the compute dtype;
    FSDP2's post-backward hook, which runs where the gradient reaches a unit's input (in the chunk's next ``I``, or in
    the first stage's full backward), moves that ``.grad`` into the unit's accumulator in the policy's reduce dtype
    (fp32 under mixed precision: ``FSDPParam.to_accumulated_grad_if_needed``). Without a policy the ``.grad`` itself
    accumulates. Each chunk is reduce-scattered and resharded as soon as its last ``W`` has run (the schedule's
    ``REDUCE_GRAD`` action, ``perform_reduce_grad``): from then on it holds its gradients' shard and no gathered
    units (traced: on Llama-3.2-1B's layers counting them to the step's end read 16–22 % over)."""

    def __init__(self, setup: TrainingSetup, specs: list[ModelSpec], m: int) -> None:
        par = setup.parallel
        narrow = [tensor_parallel_spec(spec, par.tp, par.loss_parallel) for spec in specs]
        self.params = [n.num_params for n in narrow]
        self.layer = [n.layer_params for n in narrow]
        self.unit_w = 2 if setup.precision in ("mixed", "bf16", "bf16-autocast") else 4
        self.acc_w = 4 if setup.precision == "mixed" else self.unit_w  # the policy's reduce dtype
        self.mixed = setup.precision == "mixed"
        # the stage's units are sharded over dp × cp (torchtitan's dp_shard_cp), within a replica under hybrid sharding
        self.shards = par.fsdp2_ranks
        self.m = m
        self.forwarded: set[int] = set()
        self.accumulated: set[int] = set()  # chunks whose gradients are in the accumulators
        self.pending: set[int] = set()  # chunks whose W left a 16-bit .grad (mixed precision)
        self.reduced: set[int] = set()  # chunks reduce-scattered and resharded after their last W
        self.weights_steps = [0] * len(specs)

    def gathered(self) -> int:
        return sum(self.params[c] for c in self.forwarded - self.reduced) * self.unit_w

    def gradients(self) -> int:
        return sum(self.params[c] * self.acc_w for c in self.accumulated) \
            + sum(self.params[c] * 2 for c in self.pending) \
            + sum(self.params[c] * self.acc_w // self.shards for c in self.reduced)

    def forward(self, c: int) -> None:
        self.forwarded.add(c)

    def to_accumulators(self, c: int) -> int:
        """The post-backward hooks of chunk ``c`` (its ``I``, or the first stage's full backward), which run as each
        unit's backward ends: at the bottom layer's backward every unit above has moved its 16-bit gradients into
        its accumulator, the bottom one not yet. The bytes that moment holds beyond the chunk's accumulators (less
        where this is the chunk's first move: the bottom unit's accumulator is not made yet)."""
        if not self.mixed or c not in self.pending:
            return 0
        first = c not in self.accumulated
        self.pending.discard(c)
        self.accumulated.add(c)
        return self.layer[c] * 2 - (self.layer[c] * self.acc_w if first else 0)

    def weights_made(self, c: int) -> bool:
        """A ``W`` of chunk ``c`` made its weight gradients: whether it added them into existing ones."""
        into = c in (self.pending if self.mixed else self.accumulated)
        (self.pending if self.mixed else self.accumulated).add(c)
        self.weights_steps[c] += 1
        return into

    def reduce_if_done(self, c: int) -> None:
        """After chunk ``c``'s last ``W``: its gradients reduce-scattered into their shard, its units resharded."""
        if self.weights_steps[c] == self.m:
            self.pending.discard(c)
            self.accumulated.discard(c)
            self.reduced.add(c)


def _working_forward(ledger: Estimate) -> dict[str, int]:
    """Under FSDP2, the moment of a chunk's own forward that holds the most besides the model state: its ledger's
    forward peaks where a unit is gathered (the walk counts the gathered units and the gradients itself), and the
    activations peak later (on a Mistral-shaped stage the phase peak held half of them: 4–10 % under). (The first
    stage's whole backward is walked moment by moment instead: ``_fsdp2_weights``.)"""
    moments = [mo for _at, mo in ledger.details.get("forward_moments", ())]
    return max(moments or [ledger.phases["forward"].objects],
               key=lambda mo: mo.get("activations", 0) + mo.get("temporaries", 0))


def _zero_bubble_walk(setup: TrainingSetup, rank: int, m: int, specs: list[ModelSpec],
                      ledgers: list[tuple[Estimate, Estimate]], keeps: list[tuple[int, int]], grads: list[int],
                      stage_weights: int, acc: Estimate, one: Estimate, stream: int,
                      vocab: int) -> dict[str, dict[str, int]]:
    """The forward and backward peaks of a rank under a zero-bubble schedule, op by op of :func:`rank_schedule`
    (``F``, ``I``, ``W``), without its receive buffers and token ids.

    A micro-batch keeps what its forward saved until its ``W`` (``I`` retains the autograd graph), and from its ``I``
    on also the output gradients the ``W`` starts from (:func:`captured_gradients`); the last stage's logits are freed
    by its ``I`` (the log-softmax stays, saved by the loss). Each ``I`` of a stage after the first leaves the gradient
    of the stage's input on the receive buffer (``input.grad``, PyTorch's ``stage_backward_input``) until the step
    ends. On the first stage, which has no input to differentiate, ``I`` runs nothing and ``W`` the whole backward
    (``PipelineStage.backward_weight_one_chunk``). A ``W`` makes the chunk's weight gradients group by group while
    the graph it releases is still held: its first sets them, a later one adds each in (the moments below; traced).
    ``vocab``: the logits' width on this rank (split under loss parallelism)."""
    par = setup.parallel
    t = setup.tokens // par.cp
    v = len(specs)
    captured = [0 if spec.stage_first else captured_gradients(setup, spec, t) for spec in specs]
    # the last stage's I frees the logits and the loss's log-softmax: the loss and its graph above the head's matmul
    # were held by the loss alone, which the I detaches (traced)
    logits = [int(ledgers[c][0].details["logits_bytes"]) + t * vocab * 4 if specs[c].stage_last else 0
              for c in range(v)]
    # the I peaks in its bottom layer's first norm's backward: four fp32 stream-sized tensors beside what it keeps
    # (the norm computes in fp32 whatever the stream's dtype; traced)
    transient = 4 * t * specs[0].hidden_size * 4
    peaks: dict[str, dict[str, int]] = {}
    # [chunk, activations kept, weight copies kept, after its I, output gradients kept for its W]
    held: list[list[int]] = []
    reached: set[int] = set()
    input_grads = 0  # gradients left on the receive buffers by the I's so far
    whole = int(acc.phases["optimizer_step"].objects.get("gradients", 0))  # the stage's gradients
    # DDP's buckets (every gradient once more, made as DDP wraps each chunk: its load-phase gradients) are held from
    # the start for every chunk, its W reached yet or not; ``grads`` counts them with each chunk's gradients
    buckets = [int(ledgers[c][0].phases["load"].objects.get("gradients", 0)) for c in range(v)]
    # per chunk: an MLP projection's weight (a later W peaks at the top layer's MLP, the head's group after it lower:
    # traced), the 16-bit copies and the output gradients still held there (that projection's and the head's)
    # autocast's 16-bit weight copies, and the 16-bit weight gradients a matmul makes of them before the cast
    precision = compute_precision(setup)
    half = 2 if precision in ("mixed", "bf16-autocast") else 0
    grad_w = 2 if precision == "bf16" else 4  # the weights' (and their gradients') bytes
    lin = 2 if precision in ("mixed", "bf16", "bf16-autocast") else 4
    # (FSDP2 over the stage's dp × cp ranks, as fsdp2_unsynced counts it; over one rank the trace runs no FSDP2)
    fsdp2 = _Fsdp2Chunks(setup, specs, m) if par.strategy == "fsdp2" and par.dp * par.cp > 1 else None
    tops = []
    for spec in specs:
        narrow = tensor_parallel_spec(spec, par.tp, par.loss_parallel)
        h, inter = narrow.hidden_size, narrow.intermediate_size
        mlp = (3 if narrow.gated_mlp else 2) * h * inter
        head = vocab * h if spec.stage_last else 0
        # (by the last MLP projection's group the other two have freed their copies)
        tops.append((h * inter, (mlp // (3 if narrow.gated_mlp else 2) + head) * half,
                     t * ((2 if narrow.gated_mlp else 1) * inter + h + (vocab if spec.stage_last else 0)) * lin))

    def note(ph: str, objects: dict[str, int]) -> None:
        if ph not in peaks or sum(objects.values()) > sum(peaks[ph].values()):
            peaks[ph] = objects

    def base(ph: str, own_params: int, own_acts: int, temporaries: int, gradients: int,
             converting: int = 0) -> dict[str, int]:
        objects = dict((acc if reached else one).phases[ph].objects)
        for k in ("cuda_context", "allocator_reserve", "inputs"):
            objects.pop(k, None)
        if fsdp2 is not None:  # the gathered units and the unsharded gradients are the chunks' states'
            own_params, gradients = fsdp2.gathered(), fsdp2.gradients() + converting
        objects["parameters"] = stage_weights + own_params + sum(e[2] for e in held)
        objects["activations"] = own_acts + sum(e[1] for e in held)
        # the output gradients the W's start from and the input gradients left on the receive buffers: gradients
        # of activations, made by a backward (temporaries, as the trace counts them)
        objects["temporaries"] = temporaries + sum(e[4] for e in held) + input_grads
        objects["gradients"] = gradients
        return objects

    for kind, c in rank_schedule(par.schedule, par.pp, rank, m, v, window=True):
        spec = specs[c]
        # (a tied head on ZB-V's rank 0 is the embedding's weight: its gradient is one, the stage's count)
        made = min(sum(buckets) + sum(grads[o] - buckets[o] for o in reached), whole)
        if kind == "F":
            if fsdp2 is not None:
                fsdp2.forward(c)
            own = (ledgers[c][1] if c in reached else ledgers[c][0]).phases["forward"].objects
            if fsdp2 is not None:
                own = _working_forward(ledgers[c][0])
            acts = int(own.get("activations", 0))
            if not spec.stage_first and not ledgers[c][0].details.get("stream_kept_bytes"):
                acts = max(0, acts - stream)  # its input is a receive buffer
            own_params = int(own.get("parameters", 0)) - int(ledgers[c][0].phases["load"].objects["parameters"])
            note("forward", base("forward", own_params, acts, int(own.get("temporaries", 0)),
                                 min(made + (int(own.get("gradients", 0)) - grads[c] if c in reached else 0), whole)))
            held.append([c, keeps[c][0], keeps[c][1], 0, 0])
            continue
        entry = next(e for e in held if e[0] == c and e[3] == (kind == "W"))
        if kind == "I":
            if spec.stage_first:  # nothing to differentiate: the W runs the whole backward
                entry[3] = 1
                continue
            held.remove(entry)
            if spec.stage_last:  # the loss's backward: two fp32 logits-sized gradients (as a full backward's)
                note("backward", base("backward", entry[2], entry[1], 2 * t * vocab * 4, made))
            # (under FSDP2 the loss's moment and the top layer's come before any unit's post-backward hook, with every
            # 16-bit gradient of the chunk still there; the bottom layer's after every unit's hook but its own)
            if fsdp2 is not None and c in fsdp2.pending:  # (of the output gradients, only the top MLP's made yet)
                note("backward", base("backward", entry[2], entry[1], min(captured[c], tops[c][2]) + transient, made))
            moving = fsdp2 is not None and fsdp2.mixed and c in fsdp2.pending
            converting = fsdp2.to_accumulators(c) if fsdp2 is not None else 0
            note("backward", base("backward", entry[2], entry[1], captured[c] + transient, made, converting))
            if moving:
                # the bottom unit's own hook, at the I's end: every accumulator of the chunk made (fp32), its largest
                # weight's 16-bit gradient still held while its fp32 copy is made, beside the input's gradient and,
                # on the last stage, the logits the I frees after it (traced: ZB-V at 2 micro-batches over 2 stages,
                # where this moment is the peak, was 3.0 % under without it)
                note("backward", base("backward", entry[2], entry[1], captured[c] + stream, made, tops[c][0] * 2))
            held.append([c, max(0, entry[1] - logits[c]), entry[2], 1, captured[c]])
            input_grads += stream
            continue
        held.remove(entry)
        if fsdp2 is not None:
            _fsdp2_weights(fsdp2, note, base, c, spec.stage_first, entry,
                           list(ledgers[c][0].details.get("backward_moments", ()))
                           or [dict(ledgers[c][0].phases["backward"].objects)], tops[c][0], grad_w, stream)
            reached.add(c)
            continue
        if spec.stage_first:  # the whole backward, as a full one of the chunk
            own = (ledgers[c][1] if c in reached else ledgers[c][0]).phases["backward"].objects
            note("backward", base("backward", int(own.get("parameters", 0))
                                  - int(ledgers[c][0].phases["load"].objects["parameters"]),
                                  int(own.get("activations", 0)), int(own.get("temporaries", 0)),
                                  min(made - (grads[c] if c in reached else buckets[c])
                                      + int(own.get("gradients", 0)), whole)))
        else:
            # The W runs weight group by weight group, bottom layer first, each freeing its output gradient and its
            # matmul's saved weight copy as it goes. The first sets each weight's gradient as it makes it and peaks
            # once all are made (beside the 16-bit gradient of the last large weight cast to fp32); a later one adds
            # each into the gradient: at its start, or at the top layer's MLP (and the head), where the previous
            # group's fp32 gradient is still held while the next is made in 16 bits and cast (traced)
            big, top_copies, top_captured = tops[c]
            if c not in reached:
                note("backward", base("backward", 0, entry[1], big * half,
                                      min(made + grads[c] - buckets[c], whole)))
            else:
                note("backward", base("backward", entry[2], entry[1], entry[4] + stream, made))
                note("backward", base("backward", min(entry[2], top_copies), entry[1],
                                      min(entry[4], top_captured) + big * (2 * grad_w + half), made))
                if specs[c].stage_last and not half:
                    # without autocast the head's group peaks higher: its weight-sized gradient made beside the
                    # logits' gradient it starts from (traced; under autocast the MLP's moment is the higher)
                    note("backward", base("backward", 0, entry[1], vocab * specs[c].hidden_size * grad_w
                                          + t * vocab * lin, made))
        reached.add(c)
    return peaks


def _fsdp2_weights(fsdp2: _Fsdp2Chunks, note: Callable[[str, dict[str, int]], None],
                   base: Callable[..., dict[str, int]], c: int, first: bool,
                   entry: list[int], moments: list[dict[str, int]], big: int, grad_w: int, stream: int) -> None:
    """The moments of chunk ``c``'s ``W`` under FSDP2: on the first stage the whole backward, whose post-backward
    hooks move each unit's gradients into its accumulator as it goes; on a later one the weight gradients made group
    by group from the output gradients its ``I`` kept, set on the first ``W`` after an ``I`` and added in on a later
    one (``big``: the largest projection's new gradient beside the one it is added into)."""
    if first:  # (each unit's hook runs as its backward ends: at each moment the unit at work's gradients, those
        # its own ledger makes there, are not moved yet; where the .grad itself accumulates, the projection's new
        # gradient is made beside it)
        into = fsdp2.weights_made(c)
        fsdp2.to_accumulators(c)
        for mo in moments:
            note("backward", base("backward", 0, int(mo.get("activations", 0)),
                                  int(mo.get("temporaries", 0)) + (big * grad_w if into else 0), 0,
                                  int(mo.get("gradients", 0)) if fsdp2.mixed else 0))
    else:
        note("backward", base("backward", 0, entry[1], entry[4] + stream, 0))
        into = fsdp2.weights_made(c)
        # (added in: the previous weight's new gradient still held while the next one is made, as beside DDP)
        note("backward", base("backward", 0, entry[1], 2 * big * grad_w if into else 0, 0))
    fsdp2.reduce_if_done(c)


def _schedule_label(schedule: str, virtual: int) -> str:
    return {"1f1b": "1F1B", "gpipe": "GPipe",
            "interleaved-1f1b": f"interleaved 1F1B, {virtual} stages per GPU",
            "interleaved-zb": f"interleaved zero bubble, {virtual} stage{'s' if virtual > 1 else ''} per GPU",
            "zbv": "zero bubble V, 2 stages per GPU"}[schedule]
