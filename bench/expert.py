"""Mixtures of experts across GPUs (issue 17): the fitted method's per-GPU ledger (expert, tensor and data
parallelism) against the traced rank of the same layout, on two toy models and on published ones at micro-batch
1 × 4096 tokens. Prints each case's formula-vs-trace difference per phase and a summary.

    python bench/expert.py [--quick] [--strategy ddp|fsdp2] [--rule] [--tp-ep] [--sp]

The traced rank (``memcalc_gui.trace.ranks``, ``--method trace --ep``) is transformers' own expert parallelism on
PyTorch's fake process group: the family's ``base_model_ep_plan``, its all-to-all token dispatch with balanced split
sizes, and under FSDP2 ``fully_shard`` over the experts' copies and over all ranks for the rest. The fitted ledger
is the single-GPU fit of the model with ``distributed.expert_parallel_states`` for the layout; under FSDP2 (with or
without tensor parallelism) the fit of the traced rank itself (``core.fitted.rank_layout``), or with ``--rule`` the
single-GPU fit and the rule (what the what-ifs and the GPU plan's other layouts use). ``--tp-ep``: only the rows of
expert beside tensor parallelism. ``--sp``: only the rows with tensor parallelism, under FSDP2 with torchtitan's
sequence-parallel plan on top (the one strategy a family without a block model runs it beside).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.summary import print_summary
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES

COMMON = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=1024, hidden_size=128,
              num_attention_heads=4, num_hidden_layers=4, max_position_embeddings=2048, num_key_value_heads=2)
#: Small mixtures of experts of two families (the layer counts the fit extrapolates from, and one more).
MOE = {
    "mixtral": dict(COMMON, model_type="mixtral", intermediate_size=128, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(COMMON, model_type="qwen3_moe", intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                      num_experts_per_tok=2, head_dim=32),
}


#: Published mixtures of experts at a training shape (fake tensors: nothing is scaled down): micro-batch 1 × 4096.
PRESETS = ("mixtral-8x7b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b")


def config(name: str) -> dict[str, object]:
    if name in MOE:
        return MOE[name]
    return json.loads((Path(__file__).resolve().parent.parent / "resources" / "models" / f"{name}.json").read_text())


def case(family: str, ep: int, gpus: int, strategy: str, precision: str, ckpt: str, tp: int = 1,
         rule: bool = False, sp: bool = False) -> dict[str, float]:
    """Fitted − traced, % of the traced rank, per phase (tensor bytes); ``rule``: without the rank's own fit."""
    import dataclasses

    from memcalc_gui.core.fitted import estimate_fitted
    from memcalc_gui.trace.fake import trace_estimate
    from memcalc_gui.trace.fit import calibrate
    from memcalc_gui.trace.meta import count_params_on_meta

    cfg = config(family)
    batch, seq = (2, 64) if family in MOE else (1, 4096)
    setup = TrainingSetup(params=count_params_on_meta(cfg), batch=batch, seq=seq, precision=precision,  # type: ignore
                          checkpointing=ckpt, target_device="cpu",  # type: ignore[arg-type]
                          parallel=Parallelism(gpus=gpus, ep=ep, tp=tp, strategy=strategy,  # type: ignore[arg-type]
                                               sp=sp))
    fit = calibrate(cfg, setup, setup.params or 0)
    fitted = estimate_fitted(setup, dataclasses.replace(fit, rank=None) if rule else fit)
    traced = trace_estimate(setup, cfg).estimate
    return {p: 100 * (fitted.phases[p].tensor_bytes - traced.phases[p].tensor_bytes) / traced.phases[p].tensor_bytes
            for p in PHASES if p != "load"}


def main(quick: bool = False, strategies: tuple[str, ...] = ("ddp", "fsdp2"), rule: bool = False,
         tp_ep: bool = False, sp: bool = False) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MEMCALC_CACHE_DIR", tempfile.mkdtemp(prefix="memcalc-fits-"))
    # (ep, tp, gpus)
    # expert beside tensor parallelism (transformers' layout, ep a multiple of tp): the last two of each
    toy = [(2, 1, 2), (4, 1, 4), (8, 1, 8), (2, 1, 4), (4, 1, 8), (1, 1, 4), (1, 2, 2), (1, 2, 4), (2, 2, 4),
           (4, 2, 8)]
    full = [(8, 1, 8), (4, 1, 8), (1, 1, 8), (1, 2, 8), (1, 4, 8), (8, 2, 8), (4, 2, 8)]
    if quick:
        toy, full = [(2, 1, 2), (4, 1, 8), (1, 2, 4), (4, 2, 8)], [(8, 1, 8)]
    if tp_ep:  # those rows alone
        toy, full = [x for x in toy if x[0] > 1 and x[1] > 1], [x for x in full if x[0] > 1 and x[1] > 1]
    if sp:  # sequence parallelism: the tensor-parallel rows, beside FSDP2
        toy, full, strategies = [x for x in toy if x[1] > 1], [x for x in full if x[1] > 1], ("fsdp2",)
    shown = [p for p in PHASES if p != "load"]
    print(f"{'model':<18}{'ep':>3}{'tp':>3}{'gpus':>5} {'strategy':<6} {'precision':<9} {'ckpt':<5}"
          + "".join(f"{p[:8]:>10}" for p in shown) + "   (fitted − traced, % of traced)")
    worst: dict[str, list[float]] = {}
    start = time.perf_counter()
    cases = list(itertools.product(MOE, toy, strategies, ("fp32", "mixed"), ("none", "full")))
    cases += list(itertools.product(PRESETS[:1] if quick else PRESETS, full, strategies, ("mixed",),
                                    ("none", "full")))
    for family, (ep, tp, gpus), strategy, precision, ckpt in cases:
        row = f"{family:<18}{ep:>3}{tp:>3}{gpus:>5} {strategy:<6} {precision:<9} {ckpt:<5}"
        try:
            diff = case(family, ep, gpus, strategy, precision, ckpt, tp, rule, sp)
        except InputError as exc:  # e.g. 60 experts over 8 GPUs, 2 key/value heads over 4
            print(f"{row}  n/a: {exc}")
            continue
        kind = strategy + (" (toy)" if family in MOE else "")
        worst.setdefault(kind, []).append(max(abs(v) for v in diff.values()))
        print(row + "".join(f"{diff[p]:>+10.2f}" for p in shown), flush=True)
    print_summary(worst, start, title="strategy", width=14, limits=(1, 2, 3), unit="cases")


if __name__ == "__main__":
    chosen = sys.argv[sys.argv.index("--strategy") + 1] if "--strategy" in sys.argv else None
    main("--quick" in sys.argv, (chosen,) if chosen else ("ddp", "fsdp2"), "--rule" in sys.argv, "--tp-ep" in sys.argv,
         "--sp" in sys.argv)
