"""Context parallelism and dense FSDP2, ledger against trace (issue 17). Prints each case's ledger-vs-trace difference
per phase and a summary.

    python bench/context.py [--quick]

The trace (``memcalc estimate --method trace``) runs one rank of the layout on PyTorch's fake process group: the rank's
``seq/cp`` tokens with SDPA run as PyTorch's own ring attention (``trace.context``), FSDP2's ``fully_shard`` over the
data- and context-parallel ranks, or one replica with the strategy's model states by rule (DDP), and tensor
parallelism as the narrower model (replica) or ``parallelize_module`` (FSDP2). Real models at 2,048 tokens per rank.
"""

from __future__ import annotations

import itertools
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.summary import print_summary
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.model import preset_spec
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES

MODELS = ("llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b")
TOKENS_PER_RANK = 2048


def case(model: str, strategy: str, cp: int, tp: int, precision: str, ckpt: str) -> dict[str, float] | None:
    """Ledger − trace, % of the trace's tensor bytes, per phase; None when the layout does not apply."""
    from memcalc_gui.trace.fake import trace_estimate

    try:
        setup = TrainingSetup(model=preset_spec(model), seq=TOKENS_PER_RANK * cp, precision=precision,  # type: ignore
                              checkpointing=ckpt, optimizer_impl="foreach",
                              parallel=Parallelism(gpus=8, cp=cp, tp=tp, strategy=strategy))  # type: ignore[arg-type]
        traced = trace_estimate(setup)
    except InputError:
        return None
    assert traced.analytic is not None
    return {p: 100 * (traced.analytic.phases[p].tensor_bytes - traced.estimate.phases[p].tensor_bytes)
            / traced.estimate.phases[p].tensor_bytes for p in PHASES}


def main(quick: bool = False) -> None:
    warnings.filterwarnings("ignore")
    models = MODELS[:1] if quick else MODELS
    print(f"{'model':<14}{'strategy':<9}{'cp':>3}{'tp':>3} {'precision':<9} {'ckpt':<5}" +
          "".join(f"{p[:8]:>10}" for p in PHASES) + "   (ledger − trace, % of trace)")
    worst: dict[str, list[float]] = {}
    start = time.perf_counter()
    for model, strategy, cp, tp, precision, ckpt in itertools.product(
            models, ("ddp", "fsdp2"), (1, 2, 4), (1, 2), ("fp32", "mixed"), ("none", "full")):
        diff = case(model, strategy, cp, tp, precision, ckpt)
        if diff is None:
            continue
        kind = f"{strategy}{' cp' if cp > 1 else ''}{' tp' if tp > 1 else ''}"
        worst.setdefault(kind, []).append(max(abs(v) for v in diff.values()))
        print(f"{model:<14}{strategy:<9}{cp:>3}{tp:>3} {precision:<9} {ckpt:<5}" +
              "".join(f"{diff[p]:>+10.2f}" for p in PHASES), flush=True)
    print_summary(worst, start, title="layout", width=14, limits=(0.5, 1, 2), unit="cases")


if __name__ == "__main__":
    main("--quick" in sys.argv)
