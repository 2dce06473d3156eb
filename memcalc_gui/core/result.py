"""The one call every front end makes: estimate + verdict, and the JSON contract.

``evaluate(setup)`` returns a :class:`Result`; ``Result.to_json()`` is the object ``memcalc estimate
--json`` prints (schema 1). The window, the report and the CLI all draw from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .distributed import VOCAB_SPLIT_ALWAYS
from .estimate import estimate
from .ledger import SCHEMA, Estimate
from .setup import TrainingSetup
from .solver import GpuPlan, Verdict, gpu_plan, solve
from .units import format_in, result_unit
from .vocab import OBJECT_LABELS, PHASE_LABELS, PHASES


@dataclass(frozen=True)
class Result:
    estimate: Estimate
    verdict: Verdict
    plan: GpuPlan | None = None

    @property
    def setup(self) -> TrainingSetup:
        return self.estimate.setup

    @property
    def warnings(self) -> tuple[str, ...]:
        """Inputs the estimate accepts but a real run would not (or not as the user may expect)."""
        return setup_warnings(self.setup)

    @property
    def unit(self) -> str:
        """The one unit this result's sizes share on a screen (the verdict, the ledger, what to change):
        ``units.result_unit``."""
        return result_unit(self.estimate.peak_bytes, self.setup.capacity_bytes)

    def size(self, nbytes: int) -> str:
        """``nbytes`` in :attr:`unit`."""
        return format_in(nbytes, self.unit)

    def headline(self) -> str:
        """The verdict in one sentence (fits with X GiB headroom / over by X GiB at phase Z), every size in
        :attr:`unit` (a headroom of 328 MiB reads 0.32 GiB beside the GiB peak)."""
        est, v = self.estimate, self.verdict
        size = self.size
        peak = f"{size(est.peak_bytes)} at the {PHASE_LABELS[est.peak_phase].lower()} peak"
        dom = OBJECT_LABELS[est.dominant_object].lower()
        if v.capacity_bytes is None or v.fits is None or v.headroom_bytes is None:
            return f"Needs {peak} (largest object: {dom}); choose a GPU for a verdict."
        if v.fits:
            pct = v.headroom_bytes / v.capacity_bytes * 100
            return (f"Fits: needs {peak}, {size(v.headroom_bytes)} headroom "
                    f"({pct:.0f} % of {size(v.capacity_bytes)}).")
        paged = est.peak.objects["paged_optimizer_state"]
        evictable = (f" bitsandbytes can evict the {size(paged)} of paged optimizer state to host memory, "
                     "so the step would run, but slowed by paging." if 0 < -v.headroom_bytes <= paged else "")
        return (f"Does not fit: over by {size(-v.headroom_bytes)} in the "
                f"{PHASE_LABELS[est.peak_phase].lower()} phase (needs {size(est.peak_bytes)} of "
                f"{size(v.capacity_bytes)}); largest object: {dom}.{evictable}")

    def to_json(self) -> dict[str, Any]:
        est, v = self.estimate, self.verdict
        return {
            "schema": SCHEMA,
            "method": est.method,
            "params": est.setup.num_params,
            "setup": est.setup.describe(),
            "phases": {
                p: {"total_bytes": est.phases[p].total_bytes, "objects": dict(est.phases[p].objects)}
                for p in PHASES
            },
            "peak_phase": est.peak_phase,
            "dominant_object": est.dominant_object,
            "peak_tensor_bytes": est.peak_tensor_bytes,
            "peak_bytes": est.peak_bytes,
            "capacity_bytes": v.capacity_bytes,
            "fits": v.fits,
            "headroom_bytes": v.headroom_bytes,
            "max_micro_batch": v.max_micro_batch,
            "suggestions": [s.to_json() for s in v.suggestions],
            "uncalibrated_changes": list(v.uncalibrated),
            "assumptions": list(est.assumptions),
            "warnings": list(self.warnings),
            "verdict": self.headline(),
            "per_gpu": est.setup.parallel.is_distributed,
            "strategy": est.setup.parallel.strategy,
            "gpus": est.setup.parallel.gpus,
            "offload": est.setup.parallel.offload,
            "ep": est.setup.parallel.ep,
            "etp": est.setup.parallel.etp,
            "tp": est.setup.parallel.tp,
            "dp": est.setup.parallel.dp,
            "pp": est.setup.parallel.pp,
            "sp": est.setup.parallel.sp,
            "loss_parallel": est.setup.parallel.loss_parallel,
            "cp": est.setup.parallel.cp,
            "dp_replicate": est.setup.parallel.dp_replicate,
            "pipeline_rank": est.details.get("pipeline_rank"),
            "pipeline_ranks": list(est.details.get("pipeline_ranks", ())),
            "reshard_after_forward": est.setup.parallel.reshard_after_forward,
            "host_bytes": int(est.details.get("host_bytes", 0)),
            "gpu_plan": self.plan.to_json() if self.plan is not None else None,
        }


def setup_warnings(setup: TrainingSetup) -> tuple[str, ...]:
    """What to double-check before the run: a sequence longer than the model's positions; a layout whose engine splits
    the vocabulary over the tensor-parallel GPUs where the fitted method keeps it whole."""
    out: list[str] = []
    model = setup.model
    par = setup.parallel
    if model is None and par.tp > 1 and par.strategy in VOCAB_SPLIT_ALWAYS and not par.loss_parallel:
        out.append(f"Megatron-LM always splits the embedding and the head over the {par.tp} tensor-parallel GPUs "
                   "(VocabParallelEmbedding, a column-parallel output layer); the fitted method keeps them whole on "
                   "every GPU (the split is modelled for the families memcalc has a block model of), so its weights, "
                   "gradients, optimizer state and logits are an upper bound.")
    if model is not None:
        raw = model.raw
        limit = raw.get("max_position_embeddings", raw.get("n_positions"))
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < setup.seq:
            learned = " (GPT-2's learned position table cannot index past it: the run would fail)" \
                if model.learned_positions else " (needs RoPE scaling or long-context training)"
            out.append(f"Sequence length {setup.seq:,} is longer than the model's max_position_embeddings "
                       f"{limit:,} in config.json{learned}.")
    return tuple(out)


def evaluate(setup: TrainingSetup, method: str | None = None) -> Result:
    """Estimate ``setup`` and judge it against its capacity (solver uses the same method)."""
    def estimator(s: TrainingSetup) -> Estimate:
        return estimate(s, method)

    est = estimator(setup)
    plan = gpu_plan(setup, estimator) if setup.parallel.is_distributed else None
    return Result(est, solve(setup, estimator, est), plan)
