"""Does it fit, the largest micro-batch that fits, and the changes that would make it fit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .distributed import PREFERENCE
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

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "title": self.title,
            "changes": self.changes,
            "peak_bytes": self.peak_bytes,
            "saves_bytes": self.saves_bytes,
            "fits": self.fits,
            "tradeoff": self.tradeoff,
        }


@dataclass(frozen=True)
class Verdict:
    capacity_bytes: int | None
    fits: bool | None
    headroom_bytes: int | None
    max_micro_batch: int | None
    suggestions: tuple[Suggestion, ...] = field(default=())


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
    out: list[Candidate] = []
    if setup.model is not None and setup.checkpointing == "none":
        out.append(("checkpointing", "Turn on gradient checkpointing", {"checkpointing": "full"},
                    "about 20–30 % slower backward (one extra forward)"))
    if setup.optimizer in ("adamw", "adam"):
        out.append(("optimizer-8bit", "Use 8-bit AdamW (bitsandbytes)", {"optimizer": "adamw-8bit",
                    "optimizer_impl": "foreach" if setup.optimizer_impl == "fused" else setup.optimizer_impl},
                    "quantised optimizer state; needs bitsandbytes"))
        if setup.optimizer_impl != "fused":
            out.append(("optimizer-fused", "Use the fused optimizer implementation", {"optimizer_impl": "fused"},
                        "no step temporaries; needs a CUDA build of torch"))
    if setup.precision != "bf16":
        out.append(("precision-bf16", "Keep weights, gradients and optimizer state in bf16", {"precision": "bf16"},
                    "no fp32 master weights: updates lose precision (use Kahan summation or stochastic rounding)"))
    if setup.precision == "fp32":
        out.append(("precision-mixed", "Train in mixed precision (bf16 autocast)", {"precision": "mixed"},
                    "16-bit activations; fp32 master weights"))
    if setup.model is not None and setup.attention == "eager":
        out.append(("attention-sdpa", "Use SDPA attention instead of eager", {"attention": "sdpa"},
                    "no L×L score matrices kept"))
    effective = setup.effective_batch
    b = _smaller_micro_batch(setup, estimator, capacity) if setup.batch > 1 and capacity is not None else None
    if b is not None:
        out.append(("micro-batch", f"Micro-batch {b} × {effective // b} accumulation steps "
                    f"(same effective batch {effective})", {"batch": b, "grad_accum": effective // b},
                    "more forward/backward passes per optimizer step"))
    return out


def _largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is ``<= limit`` (``n`` ≤ 2^40, so at most 2^20 trial divisions)."""
    for d in range(limit, max(0, limit - 4096), -1):  # divisors are dense near small limits: try those first
        if n % d == 0:
            return d
    best, i = 1, 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if best < d <= limit:
                    best = d
        i += 1
    return best


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
        return d is not None and \
            estimator(setup.with_changes(batch=d, grad_accum=effective // d)).peak_bytes <= capacity

    fitting = _bisect_last(ok, 0, setup.batch)  # 0: none fits; the current micro-batch is not tested
    return divisor(max(1, fitting))


def _peak_after(setup: TrainingSetup, estimator: Estimator, changes: dict[str, Any]) -> int | None:
    """The peak after ``changes``, or None when the changes conflict (e.g. 8-bit Adam with fused)."""
    try:
        return estimator(setup.with_changes(**changes)).peak_bytes
    except InputError:
        return None


def suggestions(setup: TrainingSetup, estimator: Estimator, capacity_bytes: int | None) -> tuple[Suggestion, ...]:
    """Each single change with the bytes it saves at the peak; fitting ones first, then by savings.

    When no single change fits, a combined suggestion applies the best changes greedily until it fits.
    """
    base_peak = estimator(setup).peak_bytes
    rows: list[Suggestion] = []
    for key, title, changes, tradeoff in _candidates(setup, estimator, capacity_bytes):
        peak = _peak_after(setup, estimator, changes)
        if peak is None or peak >= base_peak:
            continue
        ok = None if capacity_bytes is None else peak <= capacity_bytes
        rows.append(Suggestion(key, title, changes, peak, base_peak - peak, ok, tradeoff))
    rows.sort(key=lambda s: (not s.fits, -s.saves_bytes))
    if capacity_bytes is not None and base_peak > capacity_bytes and rows and not any(s.fits for s in rows):
        combined: dict[str, Any] = {}
        titles: list[str] = []
        current = setup
        for _ in range(4):
            current_peak = estimator(current).peak_bytes
            options = [(p, s) for s in rows if any(combined.get(k) != v for k, v in s.changes.items())
                       if (p := _peak_after(current, estimator, s.changes)) is not None and p < current_peak]
            if not options:
                break
            peak, best = min(options, key=lambda t: t[0])
            combined.update(best.changes)
            combined = {k: v for k, v in combined.items() if getattr(setup, k) != v}
            titles.append(best.title[0].lower() + best.title[1:])
            current = setup.with_changes(**combined)
            if peak <= capacity_bytes:
                break
        if len(titles) > 1:
            peak = estimator(current).peak_bytes
            rows.insert(0, Suggestion("combined", "Combine: " + "; ".join(titles), combined, peak, base_peak - peak,
                                      peak <= capacity_bytes, "the trade-offs of each change"))
    return tuple(rows)


def solve(setup: TrainingSetup, estimator: Estimator, estimate: Estimate | None = None) -> Verdict:
    """The verdict for ``setup`` against its capacity (all ``None`` without a capacity)."""
    est = estimate if estimate is not None else estimator(setup)
    cap = setup.capacity_bytes
    if cap is None:
        return Verdict(None, None, None, None, suggestions(setup, estimator, None))
    return Verdict(
        capacity_bytes=cap,
        fits=est.peak_bytes <= cap,
        headroom_bytes=cap - est.peak_bytes,
        max_micro_batch=max_micro_batch(setup, estimator, cap),
        suggestions=suggestions(setup, estimator, cap),
    )


# ---- multi-GPU ------------------------------------------------------------------------------
MAX_GPUS = 4096


@dataclass(frozen=True)
class GpuPlan:
    """The fewest GPUs each strategy needs, and the best strategy at the current count."""

    min_gpus: dict[str, int | None]  # None: does not fit even on MAX_GPUS
    best_strategy: str | None  # at setup.parallel.gpus; None if nothing fits
    best_peak_bytes: int | None

    def to_json(self) -> dict[str, Any]:
        return {"min_gpus": dict(self.min_gpus), "best_strategy": self.best_strategy,
                "best_peak_bytes": self.best_peak_bytes}


def _with_parallel(setup: TrainingSetup, **changes: Any) -> TrainingSetup | None:
    try:
        return setup.with_changes(parallel=replace(setup.parallel, **changes))
    except InputError:
        return None


def gpu_plan(setup: TrainingSetup, estimator: Estimator) -> GpuPlan | None:
    """Minimum GPU count per strategy (per-GPU memory never grows with more GPUs) and the best strategy.

    The best strategy at the current count is the first that fits in order of least communication
    (DDP, ZeRO-1, ZeRO-2, FSDP SHARD_GRAD_OP, HYBRID, ZeRO-3, FULL_SHARD), keeping the chosen offload.
    """
    cap = setup.capacity_bytes
    if cap is None or setup.model is None:
        return None

    def peak(strategy: str, gpus: int) -> int | None:
        trial = _with_parallel(setup, strategy=strategy, gpus=gpus)
        return None if trial is None else estimator(trial).peak_bytes

    mins: dict[str, int | None] = {}
    for strategy in PREFERENCE:
        p = peak(strategy, MAX_GPUS)
        if p is None or p > cap:
            mins[strategy] = None
            continue
        lo, hi = 0, MAX_GPUS  # peak(lo) > cap (or lo == 0), peak(hi) <= cap
        while hi - lo > 1:
            mid = (lo + hi) // 2
            pm = peak(strategy, mid)
            if pm is not None and pm <= cap:
                hi = mid
            else:
                lo = mid
        mins[strategy] = hi
    best: str | None = None
    best_peak: int | None = None
    for strategy in PREFERENCE:
        p = peak(strategy, setup.parallel.gpus)
        if p is not None and p <= cap:
            best, best_peak = strategy, p
            break
    return GpuPlan(mins, best, best_peak)
