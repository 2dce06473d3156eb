"""Context parallelism of a family without a block model (issue 17): the fitted method's per-GPU ledger against the
traced rank of the same layout, on two toy families (a dense OPT and a Mixtral mixture of experts). Prints each case's
fitted − traced difference per phase and a summary.

    python bench/context_fitted.py [--quick] [--rule] [--tp | --ep]

The traced rank (``memcalc estimate --method trace --cp N``) runs its seq/N tokens with SDPA as PyTorch's own ring
attention on the fake process group, ``fully_shard`` over the data- and context-parallel ranks under FSDP2, or the
model whole on every rank under DDP. The fitted ledger is the fit of that rank (``core.fitted.rank_layout``), or with
``--rule`` the one-replica fit at seq/N tokens that stands in until the rank is calibrated (and for context-parallel
degrees the calibration's sequences do not split into 2·N chunks). The trace's 512-byte rounding of each allocation
is off here: the fit leaves it out, as its assumptions say. ``--tp``: tensor parallelism 2 beside the ring (the
Mixtral toy only: transformers has no tensor-parallel plan for OPT), each layout on twice the GPUs; ``--ep``: the
Mixtral toy's routed experts split over 2 of the data- and context-parallel GPUs.
"""

from __future__ import annotations

import dataclasses
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
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES

FAMILIES = {
    "opt": dict(model_type="opt", hidden_size=64, ffn_dim=128, num_attention_heads=4, num_hidden_layers=4,
                vocab_size=256, max_position_embeddings=2048, word_embed_proj_dim=64),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=64, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=4, vocab_size=512, max_position_embeddings=2048,
                    num_local_experts=4, num_experts_per_tok=2),
}


def case(family: str, cp: int, gpus: int, strategy: str, precision: str, ckpt: str,
         rule: bool = False, tp: int = 1, ep: int = 1) -> dict[str, float]:
    """Fitted − traced, % of the traced rank, per phase (tensor bytes), at 2 × 512 tokens (no calibration shape)."""
    from memcalc_gui.core.fitted import estimate_fitted
    from memcalc_gui.trace import fake
    from memcalc_gui.trace.fit import calibrate
    from memcalc_gui.trace.meta import count_params_on_meta

    fake.CUDA_ROUNDING = 1
    cfg = FAMILIES[family]
    setup = TrainingSetup(params=count_params_on_meta(cfg), batch=2, seq=512, precision=precision,  # type: ignore
                          checkpointing=ckpt,  # type: ignore[arg-type]
                          parallel=Parallelism(gpus=gpus, cp=cp, tp=tp, ep=ep,  # type: ignore[arg-type]
                                               strategy=strategy))
    fit = calibrate(cfg, setup, setup.params or 0)
    fitted = estimate_fitted(setup, dataclasses.replace(fit, rank=None) if rule else fit)
    traced = fake.trace_estimate(setup, cfg).estimate
    return {p: 100 * (fitted.phases[p].tensor_bytes - traced.phases[p].tensor_bytes) / traced.phases[p].tensor_bytes
            for p in PHASES if p != "load"}


def main(quick: bool = False, rule: bool = False, tp: int = 1, ep: int = 1) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MEMCALC_CACHE_DIR", tempfile.mkdtemp(prefix="memcalc-fits-"))
    layouts = [(2, 2), (2, 4), (4, 8), (8, 8)] if not quick else [(2, 4), (8, 8)]  # (cp, gpus)
    shown = [p for p in PHASES if p != "load"]
    families = [f for f in FAMILIES if tp == ep == 1 or f != "opt"]
    print(f"{'model':<9}{'cp':>3}{'tp':>3}{'ep':>3}{'gpus':>5} {'strategy':<6} {'precision':<9} {'ckpt':<5}"
          + "".join(f"{p[:8]:>10}" for p in shown) + "   (fitted − traced, % of traced)")
    worst: dict[str, list[float]] = {}
    start = time.perf_counter()
    for family, (cp, gpus), strategy, precision, ckpt in itertools.product(
            families, layouts, ("ddp", "fsdp2"), ("fp32", "mixed"), ("none", "full")):
        diff = case(family, cp, gpus * tp, strategy, precision, ckpt, rule, tp, ep)
        worst.setdefault(f"{family} {strategy}", []).append(max(abs(v) for v in diff.values()))
        print(f"{family:<9}{cp:>3}{tp:>3}{ep:>3}{gpus * tp:>5} {strategy:<6} {precision:<9} {ckpt:<5}"
              + "".join(f"{diff[p]:>+10.2f}" for p in shown), flush=True)
    print_summary(worst, start, title="model", width=14, limits=(0.1, 1, 5), unit="cases")


if __name__ == "__main__":
    main("--quick" in sys.argv, "--rule" in sys.argv, 2 if "--tp" in sys.argv else 1, 2 if "--ep" in sys.argv else 1)
