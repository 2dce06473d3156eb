"""Per-rank ledgers against per-rank traces (issue 17): tensor parallelism, FSDP2 and both, on PyTorch's fake process
group, each FSDP2 layout also with 3 micro-batches of gradient accumulation. Prints each case's formula-vs-trace
difference per phase and a summary.

    python bench/layout.py [--quick]

The trace (``memcalc_gui.trace.ranks``) parallelizes the real transformers model with ``parallelize_module`` and
``fully_shard`` over a fake process group and runs two steps on fake tensors; it equals real gloo steps of the same
layout (``tests/test_layout.py``). Rank 0 is traced; every rank holds the same shard sizes here.
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
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.model import spec_from_config
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES

TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi", "gpt_neox", "llama-wide")


def case(family: str, tp: int, dp: int, precision: str, ckpt: str, impl: str,
         grad_accum: int = 1) -> dict[str, float] | None:
    """Formula − trace, % of the trace, per phase; None when the layout does not apply to the family."""
    from memcalc_gui.trace.ranks import RankLayout, trace_rank

    cfg = FAMILIES[family]
    try:
        setup = TrainingSetup(model=spec_from_config(cfg), batch=2, seq=64, precision=precision,  # type: ignore
                              optimizer_impl=impl, checkpointing=ckpt, target_device="cpu", grad_accum=grad_accum,
                              parallel=Parallelism(gpus=tp * dp, tp=tp, strategy="fsdp2" if dp > 1 else "ddp"))
        est = estimate(setup)
    except InputError:
        return None
    m = trace_rank(cfg, RankLayout(dp, tp), batch=2, seq=64, precision=precision, optimizer_impl=impl,
                   checkpointing=ckpt, grad_accum=grad_accum)
    return {p: 100 * (est.phases[p].tensor_bytes - m.phases[p].peak_bytes) / m.phases[p].peak_bytes for p in PHASES}


def main(quick: bool = False) -> None:
    warnings.filterwarnings("ignore")
    precisions = ("fp32", "mixed") if quick else ("fp32", "mixed", "bf16")
    layouts = [(1, 2), (1, 4), (2, 1), (4, 1), (2, 2), (2, 4)]
    print(f"{'family':<11}{'tp':>3}{'dp':>3}{'m':>3} {'precision':<9} {'ckpt':<5}" +
          "".join(f"{p[:8]:>10}" for p in PHASES) + "   (formula − trace, % of trace)")
    worst: dict[str, list[float]] = {}
    start = time.perf_counter()
    for family, (tp, dp), m, precision, ckpt in itertools.product(TP_FAMILIES, layouts, (1, 3), precisions,
                                                                  ("none", "full")):
        if m > 1 and (dp == 1 or quick):
            continue  # accumulation: FSDP2 reduce-scatters every micro-batch (tensor parallelism alone is the same)
        diff = case(family, tp, dp, precision, ckpt, "foreach", m)
        if diff is None:
            continue
        kind = ("tp" if dp == 1 else "fsdp2" if tp == 1 else "fsdp2×tp") + (f", {m} micro-batches" if m > 1 else "")
        worst.setdefault(kind, []).append(max(abs(v) for v in diff.values()))
        print(f"{family:<11}{tp:>3}{dp:>3}{m:>3} {precision:<9} {ckpt:<5}"
              + "".join(f"{diff[p]:>+10.2f}" for p in PHASES))
    print_summary(worst, start, title="layout", width=28, limits=(1, 2, 3), unit="cases")


if __name__ == "__main__":
    main("--quick" in sys.argv)
