"""The analytic ledger against real CPU training steps measured by the live-storage tracker.

Small configs of several families; the target is ±3 % on the peak (bench/accuracy.py prints the
full table). Most cases agree to the byte on every phase: the block is counted tensor by tensor.
"""

from __future__ import annotations

import pytest

from bench.accuracy import FAMILIES
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.model import spec_from_config
from memcalc_gui.core.setup import TrainingSetup

pytest.importorskip("torch")
pytest.importorskip("transformers")

CASES = [
    ("llama", 2, 64, "fp32", "sdpa", "none", 1),
    ("qwen2", 2, 64, "mixed", "sdpa", "none", 1),
    ("gpt2", 2, 64, "mixed", "eager", "none", 1),
    ("phi3", 1, 128, "bf16", "sdpa", "none", 1),
    ("gemma", 2, 64, "mixed", "sdpa", "full", 1),
    ("gpt_neox", 2, 64, "fp32", "sdpa", "none", 2),
    ("llama-wide", 4, 128, "mixed", "sdpa", "none", 1),
    ("phi", 2, 64, "mixed", "sdpa", "none", 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_analytic_within_3_percent_of_measured(case: tuple) -> None:
    from memcalc_gui.measure.cpu_step import measure_training_step

    fam, b, s, prec, att, ck, acc = case
    cfg = FAMILIES[fam]
    m = measure_training_step(cfg, batch=b, seq=s, precision=prec, attention=att, checkpointing=ck,
                              grad_accum=acc, optimizer="adamw", optimizer_impl="single-tensor")
    est = estimate(TrainingSetup(model=spec_from_config(cfg), batch=b, seq=s, precision=prec, attention=att,
                                 checkpointing=ck, grad_accum=acc, optimizer_impl="single-tensor"))
    assert est.peak_tensor_bytes == pytest.approx(m.peak_bytes, rel=0.03)
    for phase in ("forward", "backward", "optimizer_step"):
        assert est.phases[phase].tensor_bytes == pytest.approx(m.phases[phase].peak_bytes, rel=0.05), phase
    assert est.phases["load"].tensor_bytes == pytest.approx(m.phases["load"].live_bytes, rel=0.001)
