"""How a multi-GPU result and "what to change" are worded, in the window, the report and the CLI (plain text; no Qt).

With ``setup.parallel.is_distributed`` every ledger number is per GPU; these helpers say so, name the
strategy, the host memory offload needs and the core's GPU plan (``Result.plan``). The suggestions' sizes are in the
result's one unit (``Result.unit``), as the verdict and the ledger beside them are.
"""

from __future__ import annotations

from typing import Final

from ..core.distributed import PREFERENCE, STRATEGY_LABELS, STRATEGY_SHORT
from ..core.errors import InputError
from ..core.estimate import estimate
from ..core.result import Result
from ..core.setup import TrainingSetup, gpu_presets
from ..core.solver import Suggestion

#: Appended to the best strategy's label in :func:`plan_rows`.
BEST_MARK: Final = " — best"
OFFLOAD_TEXT: Final = {
    "none": "no offload",
    "optimizer": "optimizer state offloaded to the CPU",
    "params": "parameters and optimizer state offloaded to the CPU",
    "both": "parameters and optimizer state offloaded to the CPU",
}


def is_per_gpu(result: Result) -> bool:
    return result.setup.parallel.is_distributed


def gpu_name(setup: TrainingSetup) -> str:
    for g in gpu_presets():
        if g.id == setup.gpu:
            return g.name
    return "GPUs" if setup.capacity_bytes is None else "custom GPUs"


def strategy_text(setup: TrainingSetup) -> str:
    """``ZeRO-3 (+ parameters sharded)[ (8 GPUs per node)][, optimizer state offloaded to the CPU]``; model
    parallelism under DDP over one replica reads ``TP 2 + SP, one replica (no data parallelism)``."""
    par = setup.parallel
    text = STRATEGY_LABELS.get(par.strategy, par.strategy)
    if par.strategy == "fsdp-hybrid":
        text += f" ({par.node_size} GPUs per node)"
    if not par.reshard_after_forward:
        text += ", not resharded after forward"
    if par.offload != "none":
        text += f", {OFFLOAD_TEXT[par.offload]}"
    if par.model_parallel_text and par.strategy == "ddp" and par.dp == 1:
        text = f"{par.model_parallel_text}, one replica (no data parallelism)"  # DDP has nothing to reduce
    elif par.model_parallel_text:
        text = f"{par.model_parallel_text} × {text} over {par.dp:,}"
    if par.dp_replicate > 1:
        text += f", hybrid: {par.dp_replicate} replicas of {par.dp // par.dp_replicate:,}"
    if par.ep > 1:
        text += f", routed experts split over {par.ep} (expert parallel)"
    if par.etp > 1:
        text += f", each expert over {par.etp} (expert tensor parallel)"
    return text


def parallel_label(setup: TrainingSetup) -> str:
    """``32 × NVIDIA H100 80GB HBM3, ZeRO-3 (+ parameters sharded)[, optimizer state offloaded …]``."""
    par = setup.parallel
    gpus = f"{par.gpus} × {gpu_name(setup)}" if setup.gpu else f"{par.gpus} GPU{'s' if par.gpus != 1 else ''}"
    return f"{gpus}, {strategy_text(setup)}"


def pipeline_text(result: Result) -> str:
    """``The most loaded pipeline stage is shown: rank 2 of 2 (rank 1: 49.78 GiB)``, or "" without stages."""
    details = result.estimate.details
    ranks = details.get("pipeline_ranks") or ()
    if not ranks:
        return ""
    shown = details.get("pipeline_rank")
    pp = result.setup.parallel.pp
    others = "; ".join(f"rank {r['rank'] + 1}: {result.size(r['peak_bytes'])}" for r in ranks if r["rank"] != shown)
    return f"The most loaded pipeline stage is shown: rank {int(shown or 0) + 1} of {pp}" + \
        (f" ({others})" if others else "")


def chart_scope(setup: TrainingSetup) -> str:
    """The chart's short title: ``32 GPUs, ZeRO-3, optimizer offload``."""
    par = setup.parallel
    text = f"{par.gpus:,} GPU{'s' if par.gpus != 1 else ''}, {STRATEGY_SHORT.get(par.strategy, par.strategy)}"
    if par.model_parallel_text:
        text = (f"{par.gpus:,} GPUs: {par.model_parallel_text} × {STRATEGY_SHORT.get(par.strategy, par.strategy)} "
                f"over {par.dp:,}")
    if par.dp_replicate > 1:
        text += f" ({par.dp_replicate} replicas)"
    if not par.reshard_after_forward:
        text += " (no reshard)"
    if par.offload != "none":
        text += f", {'optimizer' if par.offload == 'optimizer' else 'parameter'} offload"
    if par.expert_split > 1:  # a short title: the banner and the plan spell the expert-tensor split out
        text += f", each expert over {par.etp}" if par.ep == 1 else \
            f", experts over {par.ep}" + (f" × {par.etp}" if par.etp > 1 else "")
    return text


def per_gpu_headline(result: Result) -> str:
    """The core's headline, with "per GPU" after the peak when the setup is distributed."""
    headline = result.headline()
    if not is_per_gpu(result):
        return headline
    needs = f"needs {result.size(result.estimate.peak_bytes)}"
    if needs in headline:
        return headline.replace(needs, needs + " per GPU", 1)
    return "Per GPU: " + headline


def host_bytes(result: Result) -> int:
    return int(result.estimate.details.get("host_bytes", 0) or 0)


def host_text(result: Result) -> str:
    """``Host (CPU) memory for offload: 1.2 TiB per node (8 GPUs per node)``, or "" without offload."""
    par = result.setup.parallel
    n = host_bytes(result)
    if not n:
        return ""
    if not par.is_distributed:  # one GPU: only its offloaded activations
        return f"Host (CPU) memory for the offloaded activations: {result.size(n)}"
    what = []
    if par.offload != "none":
        what.append("DeepSpeed's 1.5× buffer factor")
    if result.setup.activation_offload != "none":
        what.append(f"activations {result.size(activation_host_bytes(result))} per GPU")
    return (f"Host (CPU) memory for offload: {result.size(n)} per node ({par.gpus_per_node} GPU"
            f"{'s' if par.gpus_per_node != 1 else ''} per node, {', '.join(what)})")


def activation_host_bytes(result: Result) -> int:
    """The host bytes one GPU's offloaded activations take (0 without activation offloading)."""
    return int(result.estimate.details.get("offloaded_activation_bytes", 0) or 0)


def min_gpus_items(result: Result) -> list[tuple[str, int | None]]:
    """(strategy, fewest GPUs) from the plan, fewest first; strategies that never fit last."""
    plan = result.plan
    if plan is None:
        return []
    order = {s: i for i, s in enumerate(PREFERENCE)}
    items = list(plan.min_gpus.items())
    return sorted(items, key=lambda kv: (kv[1] is None, kv[1] or 0, order.get(kv[0], 99)))


def plan_sentences(result: Result) -> list[str]:
    """The solver's answer in two sentences (empty for a single-GPU setup)."""
    if not is_per_gpu(result):
        return []
    plan = result.plan
    setup = result.setup
    if plan is None:
        if setup.capacity_bytes is None:
            return ["Choose a GPU or a capacity to find the fewest GPUs each strategy needs."]
        return []
    kind = f"GPUs ({gpu_name(setup)})" if setup.gpu else "GPUs of this capacity"
    if setup.parallel.dp_replicate > 1:  # (core.solver.gpu_plan weighs each strategy over all data-parallel GPUs)
        kind += ", each strategy over all data-parallel GPUs (FSDP2 without hybrid replicas),"
    fitting = [f"{STRATEGY_SHORT.get(s, s)} {n:,}" for s, n in min_gpus_items(result) if n is not None]
    never = [STRATEGY_SHORT.get(s, s) for s, n in min_gpus_items(result) if n is None and s not in plan.unweighed]
    without = f"not with {setup.parallel.offload} offload"
    # the strategies no answer weighs, by why: a calibration to come, a layout not modelled, an offload they have not
    unanswered: dict[str, list[str]] = {}
    for s, n in min_gpus_items(result):
        if n is None and s in plan.unweighed:
            field = plan.unmodelled.get(s)
            words = "not weighed yet" if field is None else without if field == "offload" else \
                "not modelled for this layout"
            unanswered.setdefault(words, []).append(STRATEGY_SHORT.get(s, s))
    order = ("not weighed yet", "not modelled for this layout", without)
    head = next((w for w in order if w in unanswered), "")
    first = f"Fewest {kind} per strategy: " + (", ".join(fitting) if fitting else "none fits" if never or not head
                                               else head.replace("not ", "none ", 1) if head != without
                                               else f"none ({without})")
    notes = [f"{', '.join(never)}: never"] if never and fitting else []
    if fitting or never or len(unanswered) > 1:
        notes += [f"{', '.join(unanswered[w])}: {w}" for w in order if w in unanswered]
    if notes:
        first += f" ({'; '.join(notes)})"
    gpus = setup.parallel.gpus
    if plan.best_strategy is None:
        second = f"No strategy fits with {gpus:,} GPU{'s' if gpus != 1 else ''}"
    else:
        peak = f" ({result.size(plan.best_peak_bytes)} per GPU)" if plan.best_peak_bytes else ""
        # the first that fits in order of least communication (core.solver.gpu_plan), not the smallest peak: said so
        second = (f"Least communication that fits on {gpus:,} GPU{'s' if gpus != 1 else ''}: "
                  f"{STRATEGY_SHORT.get(plan.best_strategy, plan.best_strategy)}{peak}")
    return [first + ".", second + "."]


def suggestions_note(result: Result) -> str:
    """What to say beside (or instead of) the suggestions: why there are none, and which changes the fitted method has
    not answered yet (they need a calibration of their own, not ruled out)."""
    v = result.verdict
    pending = ""
    if v.uncalibrated:
        more = len(v.uncalibrated) - 3
        names = "; ".join(t[0].lower() + t[1:] for t in v.uncalibrated[:3]) + (f"; and {more} more" if more > 0 else "")
        pending = (f"Not weighed yet: {names} — each needs a calibration of its own; set one and it is fitted in "
                   "seconds.")
    if v.suggestions:
        return pending
    if v.fits is not False:
        none = "No single change lowers the peak."
    elif v.uncalibrated:
        none = "No calibrated change lowers the peak enough."
    else:
        none = "No single change the calculator knows lowers the peak; try a smaller model, a shorter sequence or a " \
               "larger GPU."
    return f"{none} {pending}".strip()


def plan_action(result: Result) -> tuple[str, dict[str, object]] | None:
    """One change the plan suggests: the best strategy at this count, or else the fewest GPUs that fit —
    unless a smaller micro-batch or another suggestion already fits on the GPUs at hand."""
    plan = result.plan
    if plan is None:
        return None
    par = result.setup.parallel
    if plan.best_strategy is not None:
        if plan.best_strategy == par.strategy:
            return None
        return (f"Use {STRATEGY_SHORT.get(plan.best_strategy, plan.best_strategy)}",
                {"strategy": plan.best_strategy})
    fitting = [(s, n) for s, n in min_gpus_items(result) if n is not None]
    v = result.verdict
    if not fitting or v.max_micro_batch or any(s.fits for s in v.suggestions):
        return None
    strategy, n = fitting[0]
    return (f"Use {n:,} GPUs with {STRATEGY_SHORT.get(strategy, strategy)}", {"gpus": n, "strategy": strategy})


def plan_rows(result: Result) -> list[tuple[str, str, str, str]]:
    """The GPU plan as table rows: strategy, fewest GPUs, peak per GPU at the current count, fits there.

    The per-strategy peaks are analytic estimates of the same setup with only the strategy changed."""
    plan = result.plan
    if plan is None:
        return []
    setup = result.setup
    cap = setup.capacity_bytes
    rows = []
    for strategy in PREFERENCE:
        if strategy not in plan.min_gpus:
            continue
        n = plan.min_gpus[strategy]
        refused_by = ""
        try:
            trial = setup.with_changes(parallel=setup.parallel.with_strategy(strategy))
            peak: int | None = estimate(trial).peak_bytes
        except InputError as exc:
            peak, refused_by = None, exc.field
        if peak is None:
            peak_text, fit = "—", (f"not with {setup.parallel.offload} offload" if refused_by == "offload"
                                   else "not modelled")
        else:
            peak_text = result.size(peak)
            fit = "—" if cap is None else ("fits" if peak <= cap else "over")
        label = STRATEGY_LABELS.get(strategy, strategy)
        if strategy == plan.best_strategy:
            label += BEST_MARK
        rows.append((label, f"{n:,}" if n is not None else
                     ("—" if plan.unmodelled[strategy] == "offload" else "not modelled") if strategy in plan.unmodelled
                     else "not weighed" if strategy in plan.unweighed else "never",
                     peak_text, fit))
    return rows


#: How the suggestions are ordered (core.solver.suggestions), said where they are listed.
ADVICE_ORDER: Final = ("Changes that fit come first, cheapest for the run first: the same maths on the same GPUs "
                       "(chunked loss, a smaller micro-batch with accumulation, recomputation, sharding, offload), "
                       "then more GPUs, then a change to what is trained (precision, optimizer state, adapters). "
                       "Then changes that lower the peak but leave it over, largest saving first.")
#: Said before the first suggestion that does not fit (after those that do).
STILL_OVER_HEADING: Final = "Still over after the change alone (largest saving first):"


def suggestion_figures(s: Suggestion, result: Result, *, saves: bool = False) -> str:
    """``peak 43.34 GiB (host 7.22 GiB per node) · headroom 35.81 GiB`` (``still over by …`` when it does not fit;
    ``saves …`` without a capacity, or with ``saves``), every size in the result's one unit."""
    size, cap = result.size, result.verdict.capacity_bytes
    parts = [f"peak {size(s.peak_bytes)}" + (f" (host {size(s.host_bytes)} per node)" if s.host_bytes else "")]
    if cap is not None and s.fits is not None:
        parts.append(f"headroom {size(cap - s.peak_bytes)}" if s.peak_bytes <= cap else
                     f"still over by {size(s.peak_bytes - cap)}")
    if saves or cap is None or s.fits is None:
        parts.append(f"saves {size(s.saves_bytes)}")
    return " · ".join(parts)


def first_still_over(result: Result) -> int | None:
    """The index of the first suggestion that leaves the step over after some that fit (where
    :data:`STILL_OVER_HEADING` goes), or ``None``."""
    rows = result.verdict.suggestions
    return next((i for i, s in enumerate(rows) if s.fits is False), None) if result.verdict.fits is False else None
