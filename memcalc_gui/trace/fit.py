"""Calibrate the ``fitted`` method (``core.fitted``): a few small fake-tensor traces of the real model.

For each of two layer counts, two traces at shapes ``(b₁, s₁)`` and ``(b₂, s₂)`` whose ratios tell the monomials
apart (``b`` ×3/2, ``s`` ×2: the six monomials change by 1, 3/2, 2, 3, 4 and 6) run the same ops in the same
order; each allocation's size in the second trace over the first names its monomial, so every moment of the
step becomes a polynomial in ``b`` and ``s``. A fifth trace at another layer count and shape checks the fit;
when it is off by more than :data:`TOLERANCE` (layers that differ, an op sequence that changes with the shape)
the fit is refused and the caller traces the full model instead. Fits are cached on disk per config, setup
signature and library versions, each file sealed (``core.cachefile``: a checksum over its content, key and versions)
and checked on read (:func:`check_fit`); a damaged one is set aside with one notice and calibrated again.
Checkpointing every N-th layer repeats every N layers: its two layer counts are N apart (:func:`layer_counts`).

torch and transformers are imported inside functions only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import cachefile
from ..core.configfile import dense_prefix_layers, transformers_kwargs, with_layers
from ..core.errors import MemcalcError
from ..core.files import cache_dir
from ..core.fitted import (
    BASIS,
    FIT_SCHEMA,
    SEPARATE,
    FitModel,
    Moment,
    Poly,
    rank_signature,
    signature,
    traced_precision,
)
from ..core.layouts import stage_group_runs
from ..core.setup import TrainingSetup, checkpoint_every
from ..core.vocab import PHASES
from .meta import structure_on_meta

#: Calibration shapes (micro-batch, sequence): b ×3/2 and s ×2 between them keep the six monomials apart.
SHAPES = ((2, 64), (3, 128))
#: The validation trace's shape (neither a calibration shape nor a multiple that could hide a wrong monomial).
CHECK_SHAPE = (5, 96)
#: Layer counts traced (fit) and the one that checks the extrapolation.
LAYERS = (2, 3)
CHECK_LAYERS = 4  # LAYERS[0] + 2: the counts of layer_counts() without a period
#: The most layers a fit's check traces (checkpointing every N-th layer repeats every N layers; a larger N is traced
#: in full instead).
MAX_FIT_LAYERS = 24
#: The micro-batches of a calibration trace's first iteration, which only makes the optimizer's state and what the step
#: creates lazily (the fit reads the second; a pipeline rank's schedule runs them all): one fewer there is about a
#: fifth of a trace's ops (docs/speed.md).
WARMUP_MICRO_BATCHES = 1
#: The largest relative error per phase the validation trace may show.
TOLERANCE = 0.005
_MONOMIALS = ((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2))  # (power of b, power of s), in BASIS order


class FitError(MemcalcError):
    """The fit cannot be exact for this model (the caller traces the full model)."""


class NotCalibrated(FitError):
    """``calibrate(..., cached_only=True)`` found no fit in the cache (nor a refusal): tracing would make one."""


def _key(cfg: dict[str, Any], setup: TrainingSetup, sig: dict[str, Any] | None = None) -> str:
    """The cache name of a fit: the config, the signature, and the versions that trace it (read without importing
    torch or transformers: a warm estimate needs neither)."""
    from .. import __version__
    from ..measure.tracker import COUNTING_REVISION
    from .meta import package_version

    text = json.dumps({"config": cfg, "signature": sig or signature(setup), "memcalc": __version__,
                       "tracker": COUNTING_REVISION,
                       "torch": package_version("torch"), "transformers": package_version("transformers")},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _versions() -> dict[str, Any]:
    """What a cached fit or refusal was made with (its envelope's ``versions``, ``core.cachefile``): another one is
    stale, calibrated again silently. The fit's own schema is among them (its name does not hold it)."""
    from .. import __version__
    from ..measure.tracker import COUNTING_REVISION
    from .meta import package_version

    return {"memcalc": __version__, "tracker": COUNTING_REVISION, "fit_schema": FIT_SCHEMA,
            "torch": package_version("torch"), "transformers": package_version("transformers")}


def take_cache_notices() -> list[str]:
    """The cache's notices since the last call (a damaged file set aside, a cache folder that cannot be written),
    each once: ``core.cachefile.take_notices``, which the window may call without importing this module."""
    return cachefile.take_notices()


def _trace(cfg: dict[str, Any], layers: int, b: int, s: int, setup: TrainingSetup, rank: int | None = None,
           sharded: bool = False) -> Any:
    """One calibration trace at ``layers`` layers and shape ``(b, s)``; under pipeline parallelism, pipeline rank
    ``rank``'s step under the schedule, ``layers`` a stage-chunk's (the model built with ``pp × virtual`` times as
    many and cut, as ``--method trace`` runs it); ``sharded``: one rank of the setup's FSDP2 layout
    (``core.fitted.rank_layout``), as ``--method trace`` runs it."""
    from ..measure.cpu_step import measure_training_step
    from .fake import TRACED_MICRO_BATCHES, unpacked_sequences

    par = setup.parallel
    # the step in backward steps each parameter as its gradient arrives: there is nothing to accumulate, so its
    # traces run one micro-batch (the steady iteration's accumulating and single fits are then the same)
    micro_batches = 1 if setup.optimizer_in_backward else TRACED_MICRO_BATCHES
    if sharded:
        from ..core.fitted import rank_layout
        from .ranks import RankLayout, trace_rank

        return trace_rank(
            with_layers(cfg, layers), RankLayout(**rank_layout(setup) or {}),
            # FSDP2's MixedPrecisionPolicy in the trace itself; a replicated rank computes as one GPU does (autocast,
            # or bf16 for the strategies that compute in it)
            batch=b, seq=s, precision=setup.precision if par.strategy == "fsdp2" else traced_precision(setup),
            optimizer=setup.optimizer, optimizer_impl=setup.optimizer_impl, attention=setup.attention,
            checkpointing=setup.checkpointing, use_cache=setup.use_cache, grad_accum=micro_batches,
            iterations=2, fake=True, keep_tracker=True, loss=setup.loss, loss_chunk=setup.loss_chunk,
            optimizer_in_backward=setup.optimizer_in_backward, galore_rank=setup.galore_rank, galore_gap=1,
            warmup_micro_batches=WARMUP_MICRO_BATCHES)
    if par.pp > 1:
        from ..core.fitted import pipeline_layout
        from .pipeline import PipeRank, trace_pipeline_rank

        lay = pipeline_layout(setup)
        layout = PipeRank(par.pp, rank or 0, par.schedule, par.virtual_stages, lay["microbatches"],
                          dp_shard=lay["dp_shard"], reshard_after_forward=lay["reshard_after_forward"],
                          ep=lay.get("ep", 1), cp=lay.get("cp", 1), tp=lay.get("tp", 1), sp=lay.get("sp", False),
                          dp_replicate=lay.get("dp_replicate", 1))
        # FSDP2's MixedPrecisionPolicy runs in the trace itself; DDP's stage runs autocast as one GPU does,
        # Megatron-LM's the bf16 step (its states by rule: core.fitted.per_gpu_states)
        return trace_pipeline_rank(
            with_layers(cfg, layers * par.pp * par.virtual_stages), layout, batch=b, seq=s,
            precision=setup.precision if par.strategy == "fsdp2" else traced_precision(setup),
            optimizer=setup.optimizer, optimizer_impl=setup.optimizer_impl,
            attention=setup.attention, checkpointing=setup.checkpointing, use_cache=setup.use_cache, iterations=2,
            keep_tracker=True, galore_rank=setup.galore_rank, galore_gap=1)
    with unpacked_sequences():
        return measure_training_step(
            with_layers(cfg, layers), batch=b, seq=s, precision=traced_precision(setup),
            optimizer=setup.optimizer, optimizer_impl=setup.optimizer_impl, attention=setup.attention,
            checkpointing=setup.checkpointing, use_cache=setup.use_cache,
            grad_accum=micro_batches, iterations=2, fake=True, keep_tracker=True,
            tuning=setup.tuning if setup.tuning.method != "full" else None, loss=setup.loss,
            loss_chunk=setup.loss_chunk, optimizer_in_backward=setup.optimizer_in_backward,
            activation_offload=setup.activation_offload, galore_rank=setup.galore_rank, galore_gap=1,
            warmup_micro_batches=WARMUP_MICRO_BATCHES)


def _monomial(delta_a: int, delta_b: int) -> Poly:
    """The monomial c·bⁱ·sʲ through the two shapes' sizes (exact when one fits; else the nearest)."""
    (b1, s1), (b2, s2) = SHAPES
    coefs = [0.0] * len(BASIS)
    if delta_a == 0 and delta_b == 0:
        return tuple(coefs)  # type: ignore[return-value]
    best, best_err = 0, math.inf
    for k, (i, j) in enumerate(_MONOMIALS):
        if delta_b * b1**i * s1**j == delta_a * b2**i * s2**j:
            best, best_err = k, 0.0
            break
        if delta_a and (delta_b > 0) == (delta_a > 0):
            err = abs(math.log(delta_b / delta_a) - math.log((b2 / b1) ** i * (s2 / s1) ** j))
            if err < best_err:
                best, best_err = k, err
    i, j = _MONOMIALS[best]
    coefs[best] = (delta_a or delta_b) / (b1**i * s1**j if delta_a else b2**i * s2**j)
    return tuple(coefs)  # type: ignore[return-value]


@dataclass
class _Window:
    """One phase window of a calibration trace: its ops and, per allocation, the moment after it."""

    ops: list[str]
    moments: dict[int, Moment]  # position in the window → live polynomials per object


def _windows(run_a: Any, run_b: Any) -> dict[tuple[str, int], _Window]:
    """The steady iteration's phase windows (phase, micro-batch) of two aligned traces at the calibration shapes,
    every allocation's moment a polynomial in b and s."""
    from ..measure.cpu_step import make_classifier

    ta, tb = run_a.tracker, run_b.tracker
    if len(ta.events) != len(tb.events) or any(ea.kind != eb.kind or ea.phase != eb.phase
                                               for ea, eb in zip(ta.events, tb.events, strict=True)):
        raise FitError("the model runs different ops at different shapes")
    category_of, _ = make_classifier(ta)
    steady = {("load", 0), ("forward", 2), ("backward", 2), ("optimizer_step", 2)}
    where: dict[int, tuple[tuple[str, int], int]] = {}
    out: dict[tuple[str, int], _Window] = {}
    for (phase, it, micro), (start, end) in ta.windows().items():
        if (phase, it) in steady:
            key = (phase, micro)
            out[key] = _Window([ta.events[i].op for i in range(start, end + 1)], {})
            for index in range(start, end + 1):
                where[index] = (key, index - start)
    live: dict[str, list[float]] = {}
    obj_of: dict[int, str] = {}
    held: dict[int, list[float]] = {}  # each live storage's size polynomial (a free removes exactly what it added)
    for ea, eb in zip(ta.events, tb.events, strict=True):
        if ea.kind in ("alloc", "resize", "free") and ea.sid:
            obj = obj_of.get(ea.sid)
            if obj is None:
                obj = obj_of[ea.sid] = category_of(ta.records[ea.sid])
            acc = live.setdefault(obj, [0.0] * len(BASIS))
            if ea.kind == "free":
                change = [-c for c in held.pop(ea.sid, [0.0] * len(BASIS))]
            else:
                change = list(_monomial(ea.delta, eb.delta))
                size = held.setdefault(ea.sid, [0.0] * len(BASIS))
                for k, c in enumerate(change):
                    size[k] += c
            for k, c in enumerate(change):
                acc[k] += c
        found = where.get(ea.index)
        if found is None:
            continue
        key, pos = found
        window = out[key]
        if key[0] == "load":
            if pos == len(window.ops) - 1:  # load counts what stays resident
                window.moments[pos] = {o: tuple(v) for o, v in live.items()}  # type: ignore[misc]
        elif (ea.kind in ("alloc", "resize") and ea.delta > 0) or pos == 0:
            window.moments[pos] = {o: tuple(v) for o, v in live.items()}  # type: ignore[misc]
    return out


def _pair(short: _Window, long: _Window) -> list[list[Moment]]:
    """Each moment of the longer window (one more layer) with the same moment of the shorter one. Moments are
    allocations, lined up by their ops: those before the repeated layers from the start, those after them from
    the end, those inside one layer's worth of allocations later."""
    a = sorted(short.moments)
    b = sorted(long.moments)
    ops_a = [short.ops[i] for i in a]
    ops_b = [long.ops[i] for i in b]
    shift = len(b) - len(a)
    prefix = 0
    while prefix < len(a) and ops_a[prefix] == ops_b[prefix]:
        prefix += 1
    suffix = 0
    while suffix < len(a) and ops_a[-1 - suffix] == ops_b[-1 - suffix]:
        suffix += 1
    pairs: list[list[Moment]] = []
    for k, pos in enumerate(b):
        if k < prefix:
            other = k
        elif len(b) - 1 - k < suffix:
            other = k - shift
        else:
            other = k - shift if 0 <= k - shift < len(a) and ops_a[k - shift] == ops_b[k] else k
        if not 0 <= other < len(a) or ops_a[other] != ops_b[k]:
            raise FitError("the layers do not repeat alike (the moments of one more layer do not line up)")
        pairs.append([short.moments[a[other]], long.moments[pos]])
    return pairs


#: The model state: what a per-GPU budget replaces by the strategy's own bytes (core.fitted.per_gpu_states).
_MODEL_STATE = frozenset({"parameters", "gradients", "optimizer_state", "optimizer_temporaries",
                          "paged_optimizer_state"})


def _candidates(pairs: list[list[Moment]]) -> list[list[Moment]]:
    """The moments that can be a phase's largest for some b, s ≥ 1 and any layer count from the shorter trace's on:
    a moment's live bytes are ``m₁ + k·(m₂ − m₁)`` with k ≥ 0 and every monomial ≥ 1, so one at or below another
    in every coefficient of both ``m₁`` and ``m₂ − m₁`` is never the largest. The same must hold for the moment's
    bytes outside the model state, so that the largest stays among the candidates once a sharded strategy
    replaces the model state by a constant of its own (an early backward moment, few gradients beside many
    activations, is then the peak)."""
    def vector(pair: list[Moment]) -> tuple[float, ...]:
        out: tuple[float, ...] = ()
        for keep in (lambda obj: True, lambda obj: obj not in _MODEL_STATE):
            first = [sum(p[k] for o, p in pair[0].items() if keep(o)) for k in range(len(BASIS))]
            second = [sum(p[k] for o, p in pair[1].items() if keep(o)) for k in range(len(BASIS))]
            out += tuple(first) + tuple(y - x for x, y in zip(first, second, strict=True))
        return out

    scored = sorted(((vector(p), p) for p in pairs), key=lambda t: -sum(t[0]))
    kept: list[tuple[tuple[float, ...], list[Moment]]] = []
    for coef, pair in scored:
        if any(all(kc >= c - 1e-6 * max(1.0, abs(c)) for kc, c in zip(kept_coef, coef, strict=True))
               for kept_coef, _ in kept):
            continue
        kept.append((coef, pair))
    return [p for _, p in kept]


def _pareto(moments: list[Moment]) -> list[Moment]:
    """The moments that can be the largest for some b, s ≥ 1 (every monomial ≥ 1 there)."""
    return [pair[0] for pair in _candidates([[m, m] for m in moments])]


def _phase_candidates(short: dict[tuple[str, int], _Window], long: dict[tuple[str, int], _Window],
                      micros: set[int] | None) -> dict[str, list[list[Moment]]]:
    """Each phase's candidate moments from the windows of the micro-batches ``micros`` (``None``: every one, a
    pipeline rank's whole schedule)."""
    out: dict[str, list[list[Moment]]] = {}
    for phase in PHASES:
        if phase in SEPARATE:  # candidates per layer count (core.fitted.FitModel)
            out[phase] = [_pareto([m for key, w in windows.items() if key[0] == phase for m in w.moments.values()])
                          for windows in (short, long)]
            continue
        pairs: list[list[Moment]] = []
        for key in long:
            if key[0] == phase and (phase in ("load", "optimizer_step") or micros is None or key[1] in micros):
                if key not in short:
                    raise FitError(f"no {phase} window to compare")
                pairs += _pair(short[key], long[key])
        out[phase] = _candidates(pairs)
    return out


def layer_counts(layers: int, skip: int, every: int | None, first: int = LAYERS[0]) -> tuple[tuple[int, int], int]:
    """The two layer counts a fit traces and the count its check traces, for a config of ``layers`` layers whose
    first ``skip`` differ from the rest (DeepSeek's dense layers: the fit traces past them).

    Checkpointing every N-th layer (layers N, 2N, … counted from the first) repeats every N layers, not every
    layer. The two counts are then N apart, the shorter holds at least one whole period past ``skip``, and both
    have the config's remainder modulo N: the layers between them are one period, each trace ends the way the
    config does (its last, partial period unchecked), and :meth:`FitModel.peak` extrapolates by periods. Raises
    :class:`FitError` where the config is shorter than the fit, or the check would trace more than
    :data:`MAX_FIT_LAYERS` layers (the caller traces the full model then). ``first``: the fewest layers past ``skip``
    the fit traces."""
    period = every if every is not None and every > 1 else 1
    low = skip + max(first, period)
    if layers < low:
        raise FitError(f"the fit extrapolates from {low} layers on; this config has {layers}")
    low += (layers - low) % period
    check = low + 2 * period
    if check > MAX_FIT_LAYERS:
        raise FitError(f"checkpointing one layer in {period} repeats every {period} layers: its fit would trace "
                       f"{check} layers")
    return (low, low + period), check


def calibrate(config: dict[str, Any], setup: TrainingSetup, num_params: int,
              progress: Callable[[str], None] | None = None, use_cache: bool = True,
              cached_only: bool = False, rank: bool = True) -> FitModel:
    """The fit of ``config`` for ``setup``'s signature: from the cache, or five small traces (a few seconds);
    ``cached_only`` raises :class:`FitError` rather than tracing. Under an FSDP2 layout (and beside expert and
    tensor parallelism) the fit of one of its ranks comes with it (``FitModel.rank``; from the cache only when
    ``cached_only``); ``rank=False`` leaves it out (the one-replica fit and its rule alone)."""
    model_type, kwargs = transformers_kwargs(config)
    cfg = whole = {"model_type": model_type, **kwargs}
    par = setup.parallel
    if par.tp > 1 and not stage_group_runs(par):
        # one tensor-parallel rank: the narrower model transformers' plan makes of it (beside expert or with sequence
        # parallelism in pipeline stages the plan runs for real: core.layouts.stage_group_runs)
        from .ranks import tensor_parallel_config

        # (beside expert parallelism the routed experts run whole, transformers' plan: experts_whole)
        cfg = tensor_parallel_config(cfg, setup.parallel.tp, experts_whole=setup.parallel.ep > 1)
    layers = next((int(cfg[k]) for k in ("num_hidden_layers", "n_layer", "num_layers")
                   if isinstance(cfg.get(k), int)), 0)
    if setup.parallel.pp > 1:  # a fit per checked rank, its layers a stage-chunk's
        layers = pipeline_chunk_layers(cfg, layers, setup)
        pair, check_layers = pipeline_layer_counts(layers)
    else:
        pair, check_layers = layer_counts(layers, dense_prefix_layers(cfg), checkpoint_every(setup.checkpointing))
    path = cache_dir() / f"{_key(cfg, setup)}.json"
    fit = _cached(path, use_cache)
    if setup.parallel.pp > 1 and setup.parallel.ep > 1:
        from ..core.distributed import check_experts

        # a cached fit holds the model's counts: a warm estimate builds nothing on the meta device
        counts_of = fit.structure if fit is not None and "num_experts" in fit.structure else structure_on_meta(cfg)
        check_experts(model_type, int(counts_of["num_experts"]), setup.parallel.ep)
    if par.strategy == "fsdp2" and rank and fit is None and not cached_only:
        from ..core.distributed import check_expert_placement

        # experts PyTorch's fully_shard cannot place as torchtitan does: this layout is refused before anything is
        # traced (not the one-replica fit alone, which other layouts of the signature share)
        counts = structure_on_meta(cfg)  # (the states shard over the data- and context-parallel GPUs together)
        check_expert_placement(dataclasses.replace(par, cp=1), counts["num_experts"], counts["expert_dim1_gcd"])
    if fit is None:
        if cached_only:
            raise NotCalibrated("not calibrated yet")
        fit = _calibrated(path, lambda: _calibrate(cfg, setup, num_params, model_type, layers, (pair, check_layers),
                                                   path, progress))
    sig = rank_signature(setup) if rank else None
    if sig is None:
        return fit
    try:
        counts = rank_layer_counts(layers, dense_prefix_layers(cfg), checkpoint_every(setup.checkpointing))
    except FitError:  # checkpointing one layer in many: the rule stands
        return fit
    # the rank of the FSDP2 layout, beside the replica (which the what-ifs and the GPU plan's other layouts use)
    path = cache_dir() / f"{_key(whole, setup, sig)}.json"  # the rank runs transformers' tensor-parallel plan
    try:
        ranked = _cached(path, use_cache)
    except FitError:  # refused before: the rule stands, as the assumptions say
        return fit
    if ranked is None:
        if cached_only:  # the replica answers by rule until the rank is calibrated
            return fit
        try:
            ranked = _calibrated(path, lambda: _calibrate(whole, setup, num_params, model_type, layers, counts, path,
                                                        progress, sharded=True))
        except FitError:
            return fit
        except MemcalcError:  # cancelled (the window closing), or a field the rank's layout refuses
            raise
        except Exception as exc:  # an op the sharded rank cannot run here: the rule stands (the refusal is kept,
            # so the next run does not trace it again)
            _write(path.with_name(f"{path.stem}.refused"), {"refused": str(exc)})
            return fit
    return dataclasses.replace(fit, rank=ranked)


def cached_fit(config: dict[str, Any], setup: TrainingSetup) -> FitModel | None:
    """The fit :func:`calibrate` would return for ``setup`` if it is cached (its FSDP2 rank's with it, if that is
    cached too), else ``None``: reads files, traces nothing. :class:`InputError` for a layout the config cannot
    take (a tensor-parallel degree its heads do not split into)."""
    try:
        return calibrate(config, setup, setup.num_params, cached_only=True)
    except FitError:  # not calibrated, or refused before
        return None


#: How many fits read from the cache this process keeps parsed. A layout search asks for the same few fits thousands
#: of times (a fitted MoE's over 4 GPUs: 6,000 reads of 9 files, each a JSON parse and a FitModel, about a tenth of
#: its time); the file's inode, size and times tell a rewritten fit from the one kept.
READ_FITS = 64
_READ: dict[Path, tuple[tuple[int, int, int, int], FitModel]] = {}


def _cached(path: Path, use_cache: bool) -> FitModel | None:
    """The fit kept at ``path``; ``None`` when there is none, a stale one, or a damaged one (set aside with one
    notice: ``core.cachefile``); :class:`FitError` with the reason these traces refused it before (they would refuse
    it again). A fit read and checked before and unchanged on disk is not parsed again (:data:`READ_FITS`): a file
    changed since is read and checked anew, so a fit damaged after it was read is never served from memory."""
    if not use_cache:
        return None
    try:
        st = path.stat()
    except OSError:
        st = None
    if st is not None:
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        read = _READ.get(path)
        if read is not None and read[0] == stamp and stat.S_ISREG(st.st_mode):
            return read[1]
        _READ.pop(path, None)
        parsed: list[FitModel] = []

        def check(payload: Any) -> None:
            fit = FitModel.from_json(payload)
            check_fit(fit)
            parsed.append(fit)

        cachefile.read_sealed(path, kind="fit", key=path.stem, versions=_versions(), what="the cached fit",
                              check=check, legacy=_legacy_fit, redo="it is calibrated again")
        if parsed:
            while len(_READ) >= READ_FITS:
                _READ.pop(next(iter(_READ)))
            _READ[path] = (stamp, parsed[0])
            return parsed[0]
    reason = _refusal(path.with_name(f"{path.stem}.refused"))
    if reason is not None:
        raise FitError(reason)
    return None


def check_fit(fit: FitModel) -> None:
    """``ValueError`` where ``fit`` cannot be what :func:`calibrate` made (:meth:`FitModel.check` at the
    calibration shapes and :data:`TOLERANCE`, and notes other than the micro-batch-1 note its own check errors
    give): a cached fit that fails is damaged; a fresh one that fails is refused (a bug, never a wrong answer)."""
    fit.check(SHAPES, TOLERANCE)
    allowed = {_single_note(f.checked.get("micro-batch 1", 0.0)) for f in (fit, *fit.stages.values())}
    if any(note not in allowed for note in fit.notes):
        raise ValueError("it holds a note its calibration did not make")


def _single_note(single: float) -> str:
    """The note of a fit whose micro-batch-1 check is ``single`` off (an empty string within :data:`TOLERANCE`)."""
    if single <= TOLERANCE:
        return ""
    return (f"At micro-batch 1 this model skips copies a batch of several makes: the fit overestimates it by up to "
            f"{single:.1%} (--method trace is exact there)")


def _legacy_fit(data: dict[str, Any]) -> bool:
    """A fit or refusal written before the sealed envelope (``schema`` at the top): stale, not damaged."""
    return type(data.get("schema")) is int and ("model_type" in data or "refused" in data)


def _calibrated(path: Path, run: Callable[[], FitModel]) -> FitModel:
    """``run()``'s fit, one torch job at a time (a trace or a measurement in another thread waits; the heap as it is
    now stays out of the collections of the traces, uncollected: every calibration trace is on fake tensors, which
    garbage from before cannot hide memory from, and a collection of the whole heap took 0.19 s of a 3.6 s
    calibration); a refusal is kept beside ``path``, so the next run answers at once."""
    from ..measure import exclusive_torch_job, frozen_heap

    with exclusive_torch_job(), frozen_heap(collect=False):
        try:
            return run()
        except FitError as exc:
            _write(path.with_name(f"{path.stem}.refused"), {"refused": str(exc)})
            raise


#: The fewest layers a pipeline stage's fit traces: under FSDP2 with checkpointing a stage of two layers, top and
#: bottom with none between, is not a step of the deeper stages with a layer taken out (its check, fitted from 2 and
#: 3 layers, was 0.6–1 % off at 4; from 3 and 4 exact at 5).
PIPELINE_LAYERS = 3


def rank_layer_counts(layers: int, skip: int, every: int | None) -> tuple[tuple[int, int], int]:
    """The layer counts the fit of an FSDP2 rank (``FitModel.rank``) traces and checks: as :func:`layer_counts`, from
    :data:`PIPELINE_LAYERS` past ``skip`` on. Two layers, top and bottom with none between, are not a deeper
    model's step with layers taken out under FSDP2: a Mixtral-shaped toy fitted from 2 and 3 layers was 10 % over
    at 4 layers and micro-batch 2 × 64 tokens, where the units FSDP2 gathers set the backward peak (its check, at a
    shape where the activations set it, passed). A config no deeper than that is traced at its own depth, as
    :func:`pipeline_layer_counts` does."""
    if layers <= skip + PIPELINE_LAYERS and every in (None, 1):
        return (layers, layers + 1), layers
    return layer_counts(layers, skip, every, first=PIPELINE_LAYERS)


def pipeline_layer_counts(chunk: int) -> tuple[tuple[int, int], int]:
    """The layer counts a pipeline rank's fit traces and checks, for stage-chunks of ``chunk`` layers: from
    :data:`PIPELINE_LAYERS` on, extrapolated as :func:`layer_counts` does; a shallower chunk is traced at its own
    depth only (the second count is nominal: each moment is paired with itself), and its check traces that depth
    again at another shape: nothing is extrapolated."""
    if chunk >= PIPELINE_LAYERS:
        return (PIPELINE_LAYERS, PIPELINE_LAYERS + 1), PIPELINE_LAYERS + 2
    return (chunk, chunk + 1), chunk


def pipeline_chunk_layers(cfg: dict[str, Any], layers: int, setup: TrainingSetup) -> int:
    """The decoder layers of one stage-chunk of ``setup``'s pipeline; :class:`InputError` naming ``pp`` where the
    layers do not split evenly, and :class:`FitError` where a stage's fit at another depth would not stand for it
    (the first layers of DeepSeek's mixture of experts are dense; checkpointing every N-th layer counts from the
    model's first)."""
    from ..core.errors import InputError

    par = setup.parallel
    stages = par.pp * par.virtual_stages
    if not layers or layers % stages:
        raise InputError("pp", f"{cfg.get('model_type')!s:.40} has {layers} decoder layers, which {stages} pipeline "
                               "stages cannot split evenly")
    if dense_prefix_layers(cfg):
        raise FitError("the first stage's layers differ from the others' (dense layers before the mixture of "
                       "experts): its pipeline stages are not fitted yet")
    if checkpoint_every(setup.checkpointing) not in (None, 1):
        raise FitError("checkpointing every N-th layer is counted from the model's first layer, which a stage's fit "
                       "at another depth does not keep: its pipeline stages are not fitted")
    return layers // stages


def _refusal(path: Path) -> str | None:
    """The reason a cached refusal gives, or ``None`` for a stale or damaged file (set aside with one notice; the
    caller calibrates). A refusal is sealed as a fit is: a bogus reason written by hand is damaged, never a model
    refused for good. (One written with its checksum recomputed still only sends the estimate to the full trace,
    which is exact: a refusal cannot make a verdict wrong.)"""
    def check(payload: Any) -> None:
        reason = payload.get("refused") if isinstance(payload, dict) and set(payload) == {"refused"} else None
        if not isinstance(reason, str) or not reason.strip() or len(reason) > 2000:
            raise ValueError("it holds no reason")

    data = cachefile.read_sealed(path, kind="refusal", key=path.stem, versions=_versions(),
                                 what="the cached refusal", check=check, legacy=_legacy_fit,
                                 redo="the fit is calibrated again")
    return str(data["refused"]) if data is not None else None


def _write(path: Path, data: dict[str, Any]) -> bool:
    """Keep a fit (``data``: :meth:`FitModel.to_json`) or, at a ``.refused`` path, a refusal (``{"refused": why}``)
    whole, sealed for the key its name holds (``core.cachefile.write_sealed``: a temporary file in the cache folder,
    renamed over the target, removed on any failure). A cache that cannot be written costs a calibration next time
    and one notice; ``False`` then."""
    kind = "refusal" if path.suffix == ".refused" else "fit"
    return cachefile.write_sealed(path, kind=kind, key=path.stem, versions=_versions(), payload=data,
                                  what="the cached " + kind)


def _calibrate(cfg: dict[str, Any], setup: TrainingSetup, num_params: int, model_type: str, layers: int,
               counts: tuple[tuple[int, int], int], path: Path, progress: Callable[[str], None] | None,
               sharded: bool = False) -> FitModel:
    """The traces and the fit of :func:`calibrate` (``counts``: the two layer counts traced, and the check's); under
    pipeline parallelism one fit per checked rank (``FitModel.stages``); ``sharded``: the fit of one rank of the FSDP2
    layout (``FitModel.rank``)."""
    t0 = time.perf_counter()

    def say(text: str) -> None:  # before each trace: the window's worker stops here when asked
        if progress is not None:
            progress(text)

    if setup.parallel.pp > 1:
        from ..core.pipeline import ranks_to_check

        stages = {}
        for r in ranks_to_check(setup.parallel.pp):
            def said(text: str, r: int = r) -> None:
                say(f"pipeline rank {r + 1} of {setup.parallel.pp}: {text}")

            stages[r] = _fit(cfg, setup, num_params, model_type, layers, counts, said, r)
        first = stages[0]
        fit = dataclasses.replace(first, checked={k: max(f.checked.get(k, 0.0) for f in stages.values())
                                                  for k in first.checked},
                                  notes=tuple(dict.fromkeys(n for f in stages.values() for n in f.notes)),
                                  calibration_s=time.perf_counter() - t0, structure=structure_on_meta(cfg),
                                  stages=stages)
    elif sharded:
        def on_rank(text: str) -> None:
            par = setup.parallel
            over = "FSDP2" if par.strategy == "fsdp2" else "the replicas"
            ring = f" and a {par.cp}-way context-parallel ring" if par.cp > 1 else ""
            say(f"one rank of {over} over {par.dp * par.cp}{ring}: {text}")

        fit = dataclasses.replace(_fit(cfg, setup, num_params, model_type, layers, counts, on_rank, sharded=True),
                                  calibration_s=time.perf_counter() - t0, structure=structure_on_meta(cfg))
    else:
        fit = dataclasses.replace(_fit(cfg, setup, num_params, model_type, layers, counts, say),
                                  calibration_s=time.perf_counter() - t0, structure=structure_on_meta(cfg))
    try:  # what a read checks, checked before the fit is kept: a fit the reader would refuse is refused now
        check_fit(fit)
    except ValueError as exc:
        raise FitError(f"the fit fails its own consistency check ({exc}); please report this") from None
    _write(path, fit.to_json())
    return fit


def _fit(cfg: dict[str, Any], setup: TrainingSetup, num_params: int, model_type: str, layers: int,
         counts: tuple[tuple[int, int], int], say: Callable[[str], None], rank: int | None = None,
         sharded: bool = False) -> FitModel:
    """One fit: four traces, the check trace and the micro-batch-1 check (of pipeline rank ``rank``'s step under the
    schedule when given: its windows are all the step's micro-batches, with and without accumulation alike; of one
    rank of the FSDP2 layout when ``sharded``)."""
    pair, check_layers = counts
    t0 = time.perf_counter()
    windows: list[dict[tuple[str, int], _Window]] = []
    # a shallow pipeline stage is evaluated at the depth it is traced at (pipeline_layer_counts): its moments are
    # their own pair, nothing extrapolated
    exact = check_layers == pair[0]
    for n in pair[:1] if exact else pair:
        runs = []
        for b, s in SHAPES:
            say(f"tracing {n} layers at micro-batch {b} × {s}")
            runs.append(_trace(cfg, n, b, s, setup, rank, sharded))
        windows.append(_windows(runs[0], runs[1]))
    short, long = windows[0], windows[-1]
    accum = _phase_candidates(short, long, None if rank is not None else {0, 1})
    moments = accum if rank is not None else _phase_candidates(short, long, {0})
    say("checking the fit on a further trace")
    sig = rank_signature(setup) if sharded else None
    check = FitModel(model_type, num_params, check_layers, sig or signature(setup), pair, moments, accum)
    b, s = CHECK_SHAPE
    real = _trace(cfg, check_layers, b, s, setup, rank, sharded)  # two micro-batches: checks the accumulating fit
    checked: dict[str, float] = {}
    measured: dict[str, int] = {}
    windows_of = real.tracker.windows()
    for phase in PHASES:
        ph = real.phases[phase]
        want = ph.live_bytes if phase == "load" else ph.peak_bytes
        measured[phase] = int(want)
        got = sum(check.peak(phase, b, s, accumulating=True).values())
        errors = [abs(got - want) / want if want else 0.0]
        if phase in ("forward", "backward") and rank is None:  # the first micro-batch alone: no accumulation
            start, end = windows_of[(phase, 2, 0)]
            first = real.tracker.peak(start, end).bytes
            errors.append(abs(sum(check.peak(phase, b, s).values()) - first) / first)
        checked[phase] = max(errors)
    worst = max(checked.values())
    if worst > TOLERANCE:
        raise FitError(f"the fit is off by {worst:.1%} on a check trace (layers that differ, or ops that change "
                       "with the shape)")
    # micro-batch 1: some models skip a copy there that a batch of several needs (a view of one sequence is
    # already contiguous); the fit, calibrated on batches of several, then overestimates it a little
    say("checking micro-batch 1")
    # the fewest layers: the micro-batch, not the depth, is checked
    one = _trace(cfg, pair[0], 1, s, setup, rank, sharded)
    shallow = dataclasses.replace(check, num_layers=pair[0])
    single = max(abs(sum(shallow.peak(p, 1, s, accumulating=True).values())
                     - (one.phases[p].live_bytes if p == "load" else one.phases[p].peak_bytes))
                 / (one.phases[p].live_bytes if p == "load" else one.phases[p].peak_bytes) for p in PHASES)
    checked["micro-batch 1"] = single
    notes = (_single_note(single),) if single > TOLERANCE else ()
    return FitModel(model_type, num_params, layers, check.signature, pair, moments, accum, checked,
                    time.perf_counter() - t0, notes,
                    anchor={"layers": check_layers, "batch": b, "seq": s, "bytes": measured})
