"""Pipeline ranks of families memcalc has no block model of (mixtures of experts included): the fitted method's rank
against the same rank traced under PyTorch's own schedule with the step's own micro-batch count (issue 17).

    python bench/pipeline_fitted.py [--quick] [--zero-bubble] [MODEL ...]

``--zero-bubble`` runs only the zero-bubble schedules' cases (ZB-V and interleaved zero bubble, DDP, with and without
checkpointing).

The fitted rank (``core.fitted``, ``FitModel.stages``) is calibrated from small traces of that rank's schedule at two
stage depths and two shapes, 1F1B over at most ``pp + 1`` micro-batches (the receive buffers, token ids and losses of
the others added by rule); the reference is ``trace.pipeline.trace_pipeline_rank`` at the case's own shape, depth and
micro-batch count. Prints (fitted − traced) / traced per phase for the first, second and last rank, then a summary.
CUDA context and allocator reserve are left out of both; stages of DDP run one replica (with the experts split, two,
and DDP's buckets on both sides), FSDP2 two. Configs of 12 layers: 6 a stage at pp 2 (extrapolated from 3 and 4), 3 at
pp 4 and in the interleaved schedule's chunks (traced at their own depth).
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.summary import print_summary
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.fitted import estimate_fitted
from memcalc_gui.core.setup import TrainingSetup

COMMON = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=1024, hidden_size=128,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
CONFIGS = {
    "mixtral-12L": dict(COMMON, model_type="mixtral", intermediate_size=128, num_local_experts=4,
                       num_experts_per_tok=2, num_hidden_layers=12),
    "qwen3-moe-12L": dict(COMMON, model_type="qwen3_moe", intermediate_size=256, moe_intermediate_size=64,
                         num_experts=8, num_experts_per_tok=2, head_dim=32, num_hidden_layers=12),
    "gemma2-12L": dict(COMMON, model_type="gemma2", intermediate_size=256, head_dim=32, num_hidden_layers=12),
}
#: The case's own shape (neither a calibration shape nor the check's).
SHAPE = dict(batch=4, seq=80)
PHASES = ("forward", "backward", "optimizer_step")


def case(name: str, pp: int, m: int, schedule: str, v: int, precision: str, ckpt: str, dp: int, strategy: str,
         ep: int = 1) -> dict[int, dict]:
    """{rank: {phase: fitted − traced, % of the trace}} for the ranks the fitted method checks."""
    from memcalc_gui.trace.fit import calibrate
    from memcalc_gui.trace.pipeline import PipeRank, trace_pipeline_rank

    cfg = CONFIGS[name]
    attention = "eager" if cfg["model_type"] == "gemma2" else "sdpa"
    setup = TrainingSetup(params=1, grad_accum=m, precision=precision, attention=attention,  # type: ignore[arg-type]
                          checkpointing=ckpt, optimizer_impl="foreach", target_device="cpu",  # type: ignore
                          cuda_context_bytes=0, allocator_reserve=0.0,
                          parallel=Parallelism(gpus=pp * dp, pp=pp, schedule=schedule,  # type: ignore[arg-type]
                                               virtual_stages=v, strategy=strategy, ep=ep), **SHAPE)  # type: ignore
    fit = calibrate(cfg, setup, 1)
    est = estimate_fitted(setup, fit)
    rows = {row["rank"]: row["phases"] for row in est.details["pipeline_ranks"]}
    out = {}
    for rank, phases in rows.items():
        traced = trace_pipeline_rank(cfg, PipeRank(pp, rank, schedule, v, m, dp_shard=dp if strategy == "fsdp2" else 1,
                                                   ep=ep), precision=precision, checkpointing=ckpt,
                                     optimizer_impl="foreach", attention=attention, **SHAPE)
        # DDP's buckets over its replicas: every gradient of the stage once more (the rule both sides share)
        buckets = traced.phases["optimizer_step"].objects.get("gradients", 0) if strategy == "ddp" and dp > 1 else 0
        out[rank] = {ph: 100 * (phases[ph] / (traced.phases[ph].peak_bytes + buckets) - 1) for ph in PHASES}
    return out


def main(quick: bool = False, only: tuple[str, ...] = (), zero_bubble: bool = False) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MEMCALC_CACHE_DIR", tempfile.mkdtemp(prefix="memcalc-bench-fits-"))
    layouts = [(2, 6, "1f1b", 1), (4, 8, "1f1b", 1), (2, 4, "gpipe", 1), (2, 4, "interleaved-1f1b", 2)]
    if zero_bubble:  # PyTorch's zero-bubble schedules run beside DDP only
        layouts = [(2, 4, "zbv", 2), (2, 4, "interleaved-zb", 1)]
    precisions = ("fp32", "mixed") if quick or only else ("fp32", "mixed", "bf16")
    names = only or (("mixtral-12L",) if quick else tuple(CONFIGS))
    print(f"{'model':<14}{'pp':>3}{'m':>3} {'schedule':<17}{'strat':>6}{'dp':>3}{'ep':>3} {'precision':<9} {'ckpt':<5}"
          f"{'rank':>5}"
          + "".join(f"{p[:8]:>10}" for p in PHASES) + "   (fitted − traced, % of traced)")
    worst: dict[str, list[float]] = {}
    start = time.perf_counter()
    cases = []
    for name, (pp, m, schedule, v), precision, ckpt, dp in itertools.product(
            names, layouts, precisions, ("none", "full"), (1, 2)):
        if dp > 1 and (schedule in ("gpipe", "zbv", "interleaved-zb") or precision == "bf16"):
            continue  # FSDP2 × PP: 1F1B and interleaved 1F1B, fp32 and mixed (its policy)
        cases.append((name, pp, m, schedule, v, precision, ckpt, dp, "fsdp2" if dp > 1 else "ddp", 1))
        if ("moe" in name or "mixtral" in name) and schedule == "1f1b" and pp == 2:
            # the experts split over the stage's 2 data-parallel GPUs
            cases.append((name, pp, m, schedule, v, precision, ckpt, 2, "fsdp2" if dp > 1 else "ddp", 2))
    for name, pp, m, schedule, v, precision, ckpt, dp, strategy, ep in cases:
        label = f"{name:<14}{pp:>3}{m:>3} {schedule:<17}{strategy:>6}{dp:>3}{ep:>3} {precision:<9} {ckpt:<5}"
        try:
            result = case(name, pp, m, schedule, v, precision, ckpt, dp, strategy, ep)
        except Exception as exc:  # a fit the check refuses: said, not counted
            print(f"{label}  refused: {exc}", flush=True)
            worst.setdefault("refused", []).append(0.0)
            continue
        for rank, diff in result.items():
            kind = ("fsdp2 × " if strategy == "fsdp2" else "") + schedule + (f" × ep {ep}" if ep > 1 else "")
            worst.setdefault(kind, []).append(max(abs(d) for d in diff.values()))
            print(f"{label}{rank:>5}" + "".join(f"{diff[p]:>+10.2f}" for p in PHASES), flush=True)
    print_summary(worst, start, title="kind", width=24, limits=(0.5, 1, 2), unit="ranks")


if __name__ == "__main__":
    main("--quick" in sys.argv, tuple(a for a in sys.argv[1:] if a in CONFIGS), "--zero-bubble" in sys.argv)
