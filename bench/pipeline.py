"""Pipeline ranks: each stage's ledger against the rank traced under PyTorch's own schedules (issue 17). Prints each
case's formula-vs-trace difference per phase for the first, second and last rank, and a summary per kind.

    python bench/pipeline.py [--quick] [--zero-bubble]

``--zero-bubble`` runs only the zero-bubble schedules' rows (ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble,
without checkpointing: the analytic ledger has no rule for it beside them), beside DDP and beside FSDP2 over 2 ranks
of each stage (without resharding after forward, the one way PyTorch's deferred weight step gets the gradients
right).

The trace (``memcalc_gui.trace.pipeline``) cuts the real transformers model into stages, runs ScheduleGPipe,
Schedule1F1B or ScheduleInterleaved1F1B on PyTorch's fake process group (with FSDP2 over each stage's data-parallel
ranks where the case says so), on fake tensors; it equals the same step with real tensors, and a real 2-process gloo
pipeline within one micro-batch's hidden states (``tests/test_pipeline.py``).
"""

from __future__ import annotations

import itertools
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.accuracy import FAMILIES
from bench.summary import print_summary
from memcalc_gui.core.analytic import estimate_analytic
from memcalc_gui.core.distributed import ZERO_BUBBLE, Parallelism
from memcalc_gui.core.model import spec_from_config
from memcalc_gui.core.pipeline import _rank_estimate
from memcalc_gui.core.setup import TrainingSetup

CONFIGS = {"llama-8L": dict(FAMILIES["llama"], num_hidden_layers=8),
           "qwen2-tied-4L": dict(FAMILIES["qwen2"], num_hidden_layers=4),
           "mistral-8L": dict(FAMILIES["mistral"], num_hidden_layers=8)}
STEP = dict(batch=2, seq=64)
PHASES = ("forward", "backward", "optimizer_step")


def case(name: str, pp: int, m: int, schedule: str, v: int, precision: str, ckpt: str, dp: int,
         cp: int = 1, tp: int = 1) -> dict[int, dict]:
    """{rank: {phase: formula − trace, % of the trace}} for the first, second and last rank (context parallelism:
    FSDP2 over dp × cp, as torchtitan applies it)."""
    from memcalc_gui.trace.pipeline import PipeRank, trace_pipeline_rank

    cfg = CONFIGS[name]
    # FSDP2 under a zero-bubble schedule: without resharding after forward (PyTorch's W needs the gathered weights)
    zb_fsdp2 = dp * cp > 1 and schedule in ZERO_BUBBLE
    setup = TrainingSetup(model=spec_from_config(cfg), grad_accum=m, precision=precision,  # type: ignore[arg-type]
                          checkpointing=ckpt, optimizer_impl="foreach", target_device="cpu",  # type: ignore
                          cuda_context_bytes=0, allocator_reserve=0.0,
                          parallel=Parallelism(gpus=pp * dp * cp * tp, pp=pp, schedule=schedule,  # type: ignore
                                               virtual_stages=v, cp=cp, tp=tp,
                                               strategy="fsdp2" if dp * cp > 1 else "ddp",
                                               reshard_after_forward=not zb_fsdp2), **STEP)
    assert setup.model is not None
    out = {}
    for rank in sorted({0, 1, pp - 1}):
        traced = trace_pipeline_rank(cfg, PipeRank(pp, rank, schedule, v, m, dp_shard=dp, cp=cp, tp=tp,
                                                   reshard_after_forward=not zb_fsdp2),
                                     precision=precision,
                                     checkpointing=ckpt, optimizer_impl="foreach", **STEP)
        ledger = _rank_estimate(setup, setup.model, rank, m, estimate_analytic)
        out[rank] = {ph: 100 * (ledger.phases[ph].total_bytes / traced.phases[ph].peak_bytes - 1) for ph in PHASES}
    return out


def zero_bubble(names: tuple[str, ...], worst: dict[str, list[float]]) -> None:
    """The zero-bubble rows: interleaved zero bubble with 1 and 2 stages per GPU, and ZB-V (its rank 0 holds the
    first and the last stage)."""
    layouts = [(2, 4, "interleaved-zb", 2), (4, 8, "interleaved-zb", 2), (4, 8, "interleaved-zb", 1),
               (2, 4, "zbv", 2), (4, 8, "zbv", 2)]
    for name, (pp, m, schedule, v), precision in itertools.product(names, layouts, ("fp32", "mixed", "bf16")):
        if name == "qwen2-tied-4L" and pp * v > 4:
            continue
        for rank, diff in case(name, pp, m, schedule, v, precision, "none", 1).items():
            kind = f"{schedule} ×{v}"
            worst.setdefault(kind, []).append(max(abs(d) for d in diff.values()))
            print(f"{name:<14}{pp:>3}{m:>3} {schedule:<17}{1:>3} {precision:<9} {'none':<5}{rank:>5}"
                  + "".join(f"{diff[p]:>+10.2f}" for p in PHASES) + f"   v {v}")
    # FSDP2 over 2 data-parallel ranks of each stage, without resharding after forward (its policy: fp32, mixed)
    for name, (pp, m, schedule, v), precision in itertools.product(names, layouts, ("fp32", "mixed")):
        if name == "qwen2-tied-4L" and (pp * v > 4 or schedule == "zbv"):
            continue  # (ZB-V's first GPU would shard the tied matrix apart: refused)
        for rank, diff in case(name, pp, m, schedule, v, precision, "none", 2).items():
            kind = f"fsdp2 × {schedule} ×{v}"
            worst.setdefault(kind, []).append(max(abs(d) for d in diff.values()))
            print(f"{name:<14}{pp:>3}{m:>3} {schedule:<17}{2:>3} {precision:<9} {'none':<5}{rank:>5}"
                  + "".join(f"{diff[p]:>+10.2f}" for p in PHASES) + f"   v {v}")
    # tensor parallelism inside each stage (transformers' plan, no sequence parallelism)
    for name, (pp, m, schedule, v), precision in itertools.product(
            names[:1], [(2, 4, "interleaved-zb", 2), (2, 4, "zbv", 2)], ("fp32", "mixed", "bf16")):
        for rank, diff in case(name, pp, m, schedule, v, precision, "none", 1, tp=2).items():
            kind = f"{schedule} ×{v}, tp 2"
            worst.setdefault(kind, []).append(max(abs(d) for d in diff.values()))
            print(f"{name:<14}{pp:>3}{m:>3} {schedule:<17}{1:>3} {precision:<9} {'none':<5}{rank:>5}"
                  + "".join(f"{diff[p]:>+10.2f}" for p in PHASES) + f"   v {v}, tp 2")


def main(quick: bool = False, only_zero_bubble: bool = False) -> None:
    warnings.filterwarnings("ignore")
    layouts = [(2, 4, "1f1b", 1), (4, 8, "1f1b", 1), (4, 4, "1f1b", 1), (2, 4, "gpipe", 1),
               (2, 4, "interleaved-1f1b", 2)] + ([] if quick else [(4, 8, "interleaved-1f1b", 2)])  # 1-layer chunks
    precisions = ("fp32", "mixed") if quick else ("fp32", "mixed", "bf16")
    names = ("llama-8L",) if quick else tuple(CONFIGS)
    print(f"{'model':<14}{'pp':>3}{'m':>3} {'schedule':<17}{'dp':>3} {'precision':<9} {'ckpt':<5}{'rank':>5}"
          + "".join(f"{p[:8]:>10}" for p in PHASES) + "   (formula − trace, % of trace)")
    worst: dict[str, list[float]] = {}
    start = time.perf_counter()
    if only_zero_bubble:
        zero_bubble(names, worst)
        print_summary(worst, start, title="kind", width=24, limits=(1, 2, 3), unit="ranks")
        return
    for name, (pp, m, schedule, v), precision, ckpt, dp in itertools.product(
            names, layouts, precisions, ("none", "full"), (1, 2)):
        if name == "qwen2-tied-4L" and pp * v > 4:
            continue
        if dp > 1 and (schedule == "gpipe" or precision == "bf16"):
            continue  # FSDP2 × PP: 1F1B and interleaved 1F1B, fp32 and mixed (its policy)
        for rank, diff in case(name, pp, m, schedule, v, precision, ckpt, dp).items():
            kind = ("fsdp2 × " if dp > 1 else "") + schedule
            worst.setdefault(kind, []).append(max(abs(d) for d in diff.values()))
            print(f"{name:<14}{pp:>3}{m:>3} {schedule:<17}{dp:>3} {precision:<9} {ckpt:<5}{rank:>5}"
                  + "".join(f"{diff[p]:>+10.2f}" for p in PHASES))
    # context parallelism inside the stages (2 ranks per sequence, ring attention), FSDP2 over dp × cp
    for name, (pp, m, schedule, v), precision, ckpt, dp in itertools.product(
            names[:1], [(2, 4, "1f1b", 1), (4, 4, "1f1b", 1), (2, 4, "interleaved-1f1b", 2)], ("fp32", "mixed"),
            ("none", "full"), (1, 2)):
        for rank, diff in case(name, pp, m, schedule, v, precision, ckpt, dp, cp=2).items():
            kind = "cp 2 × " + schedule
            worst.setdefault(kind, []).append(max(abs(d) for d in diff.values()))
            print(f"{name:<14}{pp:>3}{m:>3} {schedule:<17}{dp:>3} {precision:<9} {ckpt:<5}{rank:>5}"
                  + "".join(f"{diff[p]:>+10.2f}" for p in PHASES) + "   cp 2")
    zero_bubble(names, worst)
    print_summary(worst, start, title="kind", width=24, limits=(1, 2, 3), unit="ranks")


if __name__ == "__main__":
    main("--quick" in sys.argv, "--zero-bubble" in sys.argv)
