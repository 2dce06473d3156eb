"""Every rank of a real multi-process step against its estimate and its fake-process-group trace (issue 17).

    python bench/ranks.py [--quick] [--only KIND]   (KIND: a layout kind of the summary, e.g. fsdp2×pp)

Each case is ``memcalc measure`` of a multi-GPU setup: every rank a CPU process on PyTorch's gloo backend, running
the layout as the per-rank trace runs it (DDP, FSDP2's ``fully_shard``, ``parallelize_module`` with transformers'
plan, PyTorch's ring attention, PyTorch's pipeline schedules), measured with the live-storage tracker. Beside each
rank's (estimate − measured) / measured per phase it prints the fake-process-group trace of the same rank against the
measurement (DDP has no fake run: its buckets are a rule in the trace), then a summary per kind of layout.
Small models (4 layers of hidden 128, a tied Qwen2 with a 32K vocabulary at hidden 512), 2 × 64 tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.summary import print_summary
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.model import spec_from_config
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES

COMMON: dict[str, Any] = dict(max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MODELS: dict[str, dict[str, Any]] = {
    "llama": dict(COMMON, model_type="llama", vocab_size=1024, hidden_size=128, intermediate_size=344,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4),
    "qwen2-tied": dict(COMMON, model_type="qwen2", vocab_size=32768, hidden_size=512, intermediate_size=512,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True),
}
#: (kind, the layout's Parallelism fields, the step's accumulation micro-batches)
LAYOUTS: list[tuple[str, dict[str, Any], int]] = [
    ("ddp", dict(gpus=2), 1),
    ("ddp", dict(gpus=4), 1),
    ("fsdp2", dict(gpus=2, strategy="fsdp2"), 1),
    ("fsdp2", dict(gpus=4, strategy="fsdp2", reshard_after_forward=False), 1),
    ("fsdp2-accum", dict(gpus=2, strategy="fsdp2"), 3),
    ("tp", dict(gpus=2, tp=2), 1),
    ("tp", dict(gpus=4, tp=4), 1),
    ("fsdp2×tp", dict(gpus=4, tp=2, strategy="fsdp2"), 1),
    ("fsdp2×tp+sp", dict(gpus=4, tp=2, sp=True, strategy="fsdp2"), 1),
    ("cp", dict(gpus=2, cp=2, strategy="fsdp2"), 1),
    ("pp", dict(gpus=2, pp=2), 4),
    ("pp", dict(gpus=4, pp=4, schedule="gpipe"), 4),
    ("pp", dict(gpus=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2), 4),
    ("fsdp2×pp", dict(gpus=4, pp=2, strategy="fsdp2"), 4),
]


def _trace(job: Any, setup: TrainingSetup, rank: int) -> Any:
    """The fake-process-group trace of ``rank`` of ``job`` (None for DDP, which no fake run wraps)."""
    from memcalc_gui.trace.pipeline import trace_pipeline_rank
    from memcalc_gui.trace.ranks import RankLayout, trace_rank

    step = dict(batch=setup.rows, seq=setup.row_len, precision=setup.precision, optimizer_impl=setup.optimizer_impl,
                checkpointing=setup.checkpointing, grad_accum=setup.grad_accum, iterations=3)
    if job.strategy == "ddp":
        return None
    if job.strategy == "fsdp2":
        return trace_rank(job.config, RankLayout(dp_shard=job.world,
                                                 reshard_after_forward=setup.parallel.reshard_after_forward), **step)
    if job.strategy == "ranks":
        return trace_rank(job.config, job.layout, **step)
    return trace_pipeline_rank(job.config, dataclasses.replace(job.layout, rank=job.stage_of[rank]), **step)


def main() -> None:
    from memcalc_gui.measure import engine
    from memcalc_gui.measure.layout import rank_job

    warnings.filterwarnings("ignore")
    quick = "--quick" in sys.argv
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv[:-1] else None
    precisions = ("mixed",) if quick else ("fp32", "mixed", "bf16")
    ckpts = ("none",) if quick else ("none", "full")
    worst: dict[str, list[float]] = {}
    start = time.perf_counter()
    print(f"{'model':<11}{'layout':<34}{'prec':<6}{'ckpt':<5}{'rank':<8}" + "".join(f"{p[:8]:>9}" for p in PHASES[1:])
          + "   trace − measured (max |%|)")
    for (name, cfg), (kind, fields, m), precision, ckpt in itertools.product(MODELS.items(), LAYOUTS, precisions,
                                                                             ckpts):
        if only is not None and kind != only:
            continue
        if name == "qwen2-tied" and kind not in ("ddp", "fsdp2", "fsdp2-accum", "fsdp2×tp"):
            continue  # the tied large vocabulary matters where FSDP2 reduces the embedding
        setup = TrainingSetup(model=spec_from_config(cfg), batch=2, seq=64, grad_accum=m, precision=precision,
                              checkpointing=ckpt, optimizer_impl="foreach",
                              parallel=Parallelism(**fields))  # type: ignore[arg-type]
        result = engine.measure(setup, device="cpu", iterations=3, full_size=True)
        job = rank_job(result.setup)
        traced: dict[int, Any] = {}
        for r in result.ranks:
            stage = job.stage_of[r.rank]
            if stage not in traced:
                traced[stage] = _trace(job, result.setup, r.rank)
            t = traced[stage]
            against = "—" if t is None else \
                f"{max(abs(t.phases[p].peak_bytes / r.phases[p].peak_bytes - 1) * 100 for p in PHASES[1:]):.2f}"
            errors = r.error_pct
            layout = ", ".join(f"{k}={v}" for k, v in fields.items())
            print(f"{name:<11}{layout:<34}{precision:<6}{ckpt:<5}{r.rank + 1:<8}"
                  + "".join(f"{errors[p]:>+8.2f}%" for p in PHASES[1:]) + f"   {against}")
            worst.setdefault(kind, []).append(max(abs(errors[p]) for p in PHASES[1:]))
    print_summary(worst, start, title="layout", unit="ranks", noun="measured ranks (each a gloo process)")


if __name__ == "__main__":
    main()
