"""Multi-GPU budgets: published figures, the engines' estimators, and monotonicity properties."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc_gui.cli import main
from memcalc_gui.core.distributed import (
    STRATEGIES,
    Parallelism,
    deepspeed_zero2_estimate,
    deepspeed_zero3_estimate,
    zero_paper_model_states,
)
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.model import block_preset_names, preset_spec
from memcalc_gui.core.result import evaluate
from memcalc_gui.core.setup import TrainingSetup, find_gpu

GB = 1e9


def test_zero_paper_figure_1() -> None:
    """Ψ = 7.5B, N_d = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per GPU."""
    psi, n = 7_500_000_000, 64
    assert zero_paper_model_states(psi, n, 0) / GB == pytest.approx(120)
    assert zero_paper_model_states(psi, n, 1) / GB == pytest.approx(31.4, abs=0.05)
    assert zero_paper_model_states(psi, n, 2) / GB == pytest.approx(16.6, abs=0.05)
    assert zero_paper_model_states(psi, n, 3) / GB == pytest.approx(1.9, abs=0.05)


def _states_at_step(setup: TrainingSetup) -> int:
    o = estimate(setup).phases["optimizer_step"].objects
    return o["parameters"] + o["gradients"] + o["optimizer_state"]


def test_ledger_follows_deepspeed_code_where_it_differs_from_the_paper() -> None:
    """The engine keeps an fp32 gradient partition (4Ψ/N) the paper's K = 12 leaves out."""
    spec = preset_spec("llama-2-7b")
    psi, n = spec.num_params, 64
    base = TrainingSetup(model=spec, precision="mixed", optimizer="adam")
    zero1 = _states_at_step(base.with_changes(parallel=Parallelism(gpus=n, strategy="zero1")))
    zero3 = _states_at_step(base.with_changes(parallel=Parallelism(gpus=n, strategy="zero3")))
    # DeepSpeed's estimate_zero2_model_states_mem_needs: 4Ψ + 16Ψ/N (it does not tell stage 1 from 2)
    assert zero1 == pytest.approx(deepspeed_zero2_estimate(psi, gpus_per_node=8, nodes=8)[1], rel=1e-6)
    # estimate_zero3_model_states_mem_needs: 18Ψ/N (+ 4·largest layer for the gathered unit, not a state)
    ds3 = deepspeed_zero3_estimate(psi, spec.largest_module_params, gpus_per_node=8, nodes=8)[1]
    assert zero3 == pytest.approx(ds3 - 4 * spec.largest_module_params, rel=1e-6)
    assert zero3 > zero_paper_model_states(psi, n, 3)  # +4Ψ/N of fp32 gradients


def test_deepspeed_estimators_reproduce_their_printouts() -> None:
    """DeepSpeed's memory docs, bigscience/T0_3B on 1 node × 8 GPUs (2851M params, largest layer 32.9M):
    71.71/0.12, 127.48/0.12, 63.74/0.79, 127.48/0.79, 1.47/6.10, 127.48/6.10 GB per CPU / per GPU."""
    psi, largest = 2_851_773_440, 32_899_072
    rows = [(True, True, True, 71.71, 0.12), (True, True, False, 127.48, 0.12),
            (True, False, True, 63.74, 0.79), (True, False, False, 127.48, 0.79),
            (False, False, True, 1.47, 6.10), (False, False, False, 127.48, 6.10)]
    for offload_opt, offload_params, zero_init, cpu_gb, gpu_gb in rows:
        cpu, gpu = deepspeed_zero3_estimate(psi, largest, gpus_per_node=8, cpu_offload=offload_opt,
                                            offload_params=offload_params, zero_init=zero_init)
        assert round(cpu / 2**30, 2) == cpu_gb and round(gpu / 2**30, 2) == gpu_gb


@pytest.mark.parametrize("bad", [dict(gpus=0), dict(strategy="zero4"), dict(node_size=0), dict(offload="disk"),
                                 dict(strategy="zero2", offload="params"), dict(strategy="ddp", offload="optimizer")])
def test_bad_parallelism(bad: dict) -> None:
    with pytest.raises(InputError):
        Parallelism(**bad)


SPECS = {n: preset_spec(n) for n in block_preset_names()}


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(sorted(SPECS)), st.sampled_from([s for s in STRATEGIES if s != "ddp"]),
       st.integers(1, 256), st.integers(1, 256), st.sampled_from(["mixed", "fp32", "bf16"]),
       st.sampled_from(["none", "optimizer"]), st.integers(1, 8), st.integers(128, 4096))
def test_per_gpu_memory_never_grows_with_more_gpus(name: str, strategy: str, a: int, b: int, precision: str,
                                                    offload: str, batch: int, seq: int) -> None:
    lo, hi = sorted((a, b))
    offload = offload if strategy in ("zero1", "zero2", "zero3") or strategy.startswith("fsdp") else "none"
    base = TrainingSetup(model=SPECS[name], batch=batch, seq=seq, precision=precision)
    small = estimate(base.with_changes(parallel=Parallelism(gpus=lo, strategy=strategy, offload=offload)))
    big = estimate(base.with_changes(parallel=Parallelism(gpus=hi, strategy=strategy, offload=offload)))
    for phase in small.phases:
        assert big.phases[phase].total_bytes <= small.phases[phase].total_bytes


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(sorted(SPECS)), st.integers(2, 1024), st.sampled_from(["mixed", "fp32", "bf16"]),
       st.sampled_from(["adamw", "adamw-8bit", "sgd-momentum"]))
def test_zero3_le_zero2_le_zero1_le_ddp_for_model_states(name: str, gpus: int, precision: str, opt: str) -> None:
    base = TrainingSetup(model=SPECS[name], precision=precision, optimizer=opt)
    states = [_states_at_step(base.with_changes(parallel=Parallelism(gpus=gpus, strategy=s)))
              for s in ("zero3", "zero2", "zero1", "ddp")]
    assert states == sorted(states)


def test_min_gpus_and_best_strategy() -> None:
    spec = preset_spec("llama-3.1-70b")
    cap = find_gpu("h100-80gb").capacity_bytes
    setup = TrainingSetup(model=spec, seq=4096, checkpointing="full", capacity_bytes=cap,
                          parallel=Parallelism(gpus=32, strategy="zero3"))
    r = evaluate(setup)
    assert r.plan is not None and r.plan.best_strategy is not None
    n = r.plan.min_gpus["zero3"]
    assert n is not None and n <= 32
    at = lambda g: estimate(setup.with_changes(parallel=Parallelism(gpus=g, strategy="zero3"))).peak_bytes  # noqa: E731
    assert at(n) <= cap < at(n - 1)
    assert r.plan.min_gpus["ddp"] is None  # a replicated 70B model never fits an 80 GB card


def test_a_strategy_the_estimator_cannot_answer_is_not_weighed_rather_than_never() -> None:
    """A what-if the estimator refuses (a fitted model not calibrated for it) is "not weighed yet" in the plan, not
    "never": only an answer over the capacity at the most GPUs means never."""
    from memcalc_gui.core.solver import gpu_plan
    from memcalc_gui.view.plan_text import plan_rows, plan_sentences

    spec = preset_spec("llama-3.1-70b")
    cap = find_gpu("h100-80gb").capacity_bytes
    setup = TrainingSetup(model=spec, seq=4096, checkpointing="full", capacity_bytes=cap,
                          parallel=Parallelism(gpus=32, strategy="zero3"))

    def estimator(s: TrainingSetup):
        if s.parallel.strategy == "fsdp2":
            raise InputError("method", "this change needs its own calibration")
        return estimate(s)

    plan = gpu_plan(setup, estimator)
    assert plan is not None and plan.unweighed == ("fsdp2",) and plan.unmodelled == {}
    assert plan.min_gpus["fsdp2"] is None and plan.min_gpus["ddp"] is None
    r = evaluate(setup)
    r = type(r)(r.estimate, r.verdict, plan)
    first = plan_sentences(r)[0]
    assert "FSDP2: not weighed yet" in first and ": never; " in first  # DDP never fits a 70B model here
    assert dict((row[0], row[1]) for row in plan_rows(r))["FSDP2 (fully_shard)"] == "not weighed"


def test_a_strategy_the_setup_does_not_model_for_the_layout_is_not_weighed_rather_than_never() -> None:
    """Sequence parallelism of a family without a block model is modelled beside FSDP2 alone: the GPU plan says the
    other strategies are not weighed, where "never" would claim they cannot fit."""
    from memcalc_gui.core.solver import gpu_plan

    cap = find_gpu("h100-80gb").capacity_bytes
    setup = TrainingSetup(params=10**9, seq=4096, capacity_bytes=cap,
                          parallel=Parallelism(gpus=8, tp=2, sp=True, strategy="fsdp2"))
    setup.extras["fitted"] = True  # a config the fitted method traces (core.fitted.evaluate_fitted marks it)

    def estimator(s: TrainingSetup):  # a stand-in for the fitted method: a block model's ledger of the layout
        return estimate(TrainingSetup(model=preset_spec("llama-3.1-8b"), seq=4096, parallel=s.parallel))

    plan = gpu_plan(setup, estimator)
    assert plan is not None and plan.min_gpus["fsdp2"] is not None
    assert set(plan.unweighed) == set(plan.unmodelled) == {s for s in plan.min_gpus if s != "fsdp2"}
    assert plan.to_json()["unmodelled"] == {s: "strategy" for s in plan.unweighed}  # the field that rules them out
    # the words say the layout is not modelled under those strategies (no calibration would weigh them), not "yet"
    from memcalc_gui.view.plan_text import plan_rows, plan_sentences

    r = evaluate(setup.with_changes(model=preset_spec("llama-3.1-8b")))
    r = type(r)(r.estimate, r.verdict, plan)
    first = plan_sentences(r)[0]
    assert "DDP, ZeRO-1" in first and "not modelled for this layout" in first
    assert "never" not in first and "not weighed yet" not in first
    rows = dict((row[0], row[1:]) for row in plan_rows(r))
    assert rows["DDP (replicated)"][0] == "not modelled" and rows["FSDP2 (fully_shard) — best"][0] == "4"


def test_an_offload_a_strategy_has_not_is_named_in_the_plan() -> None:
    """With optimizer offload DDP and Megatron-LM are not modelled (DDP cannot offload): the plan names the offload,
    neither "never" nor "not weighed yet"."""
    from memcalc_gui.view.plan_text import plan_rows, plan_sentences

    setup = TrainingSetup(model=preset_spec("llama-3.1-8b"), capacity_bytes=find_gpu("a100-80gb").capacity_bytes,
                          parallel=Parallelism(gpus=8, strategy="zero2", offload="optimizer"))
    r = evaluate(setup)
    assert r.plan is not None and r.plan.unmodelled == dict.fromkeys(("ddp", "megatron", "megatron-distopt"), "offload")
    first = plan_sentences(r)[0]
    assert first.endswith("(DDP, Megatron DDP, Megatron dist-opt: not with optimizer offload).")
    rows = {row[0]: row[1:] for row in plan_rows(r)}
    assert rows["DDP (replicated)"] == ("—", "—", "not with optimizer offload")


def test_cli_text_says_the_gpu_plan_in_the_windows_words(capsys: pytest.CaptureFixture[str]) -> None:
    """The command line's GPU plan is the window's and the report's sentences: each strategy by its label with its
    fewest GPUs, those that never fit named as such (not a bare dash), and the best with its peak per GPU."""
    from memcalc_gui.view.plan_text import plan_sentences

    argv = ["estimate", "--preset", "llama-3.1-70b", "--seq", "4096", "--batch", "1", "--checkpointing", "full",
            "--gpus", "32", "--strategy", "zero3", "--gpu", "h100-80gb"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    r = evaluate(TrainingSetup(model=preset_spec("llama-3.1-70b"), seq=4096, batch=1, checkpointing="full",
                               gpu="h100-80gb", capacity_bytes=find_gpu("h100-80gb").capacity_bytes,
                               parallel=Parallelism(gpus=32, strategy="zero3")))
    first, second = plan_sentences(r)
    assert first in out and second in out
    assert f"ZeRO-3 {r.plan.min_gpus['zero3']}" in first and "DDP, " in first and ": never" in first
    assert second.startswith("Least communication that fits on 32 GPUs: ZeRO-3 (")


def test_cli_json_per_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--preset", "llama-3.1-8b", "--gpus", "8", "--strategy", "zero2", "--offload",
                 "optimizer", "--gpu", "a100-80gb", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["per_gpu"] is True and data["strategy"] == "zero2" and data["gpus"] == 8
    assert data["host_bytes"] > 0
    assert data["phases"]["optimizer_step"]["objects"]["optimizer_state"] == 0  # offloaded
    assert set(data["gpu_plan"]["min_gpus"]) == set(STRATEGIES)
    with pytest.raises(SystemExit) as info:
        main(["estimate", "--params", "7B", "--gpus", "8", "--strategy", "zero3"])
    assert info.value.code == 2


def test_a_bare_parameter_count_with_zero2_answers_like_deepspeed():
    """DeepSpeed's estimators answer from a count (issue case --params 2851e6 --gpus 8 --strategy zero2)."""
    import pytest

    from memcalc_gui.core.distributed import Parallelism
    from memcalc_gui.core.errors import InputError
    from memcalc_gui.core.estimate import estimate
    from memcalc_gui.core.setup import TrainingSetup

    one = estimate(TrainingSetup(params=2_851_000_000))
    eight = estimate(TrainingSetup(params=2_851_000_000, parallel=Parallelism(gpus=8, strategy="zero2")))
    assert eight.method == "quick" and eight.peak_bytes < one.peak_bytes
    state = eight.phases["optimizer_step"].objects["optimizer_state"]
    assert state == -(-one.phases["optimizer_step"].objects["optimizer_state"] // 8)  # Adam state split 8 ways
    assert any("DeepSpeed" in a for a in eight.assumptions)
    offload = estimate(TrainingSetup(params=2_851_000_000,
                                     parallel=Parallelism(gpus=8, strategy="zero2", offload="optimizer")))
    assert offload.phases["optimizer_step"].objects["optimizer_state"] == 0 and offload.details["host_bytes"] > 0
    with pytest.raises(InputError, match="largest layer"):
        estimate(TrainingSetup(params=2_851_000_000, parallel=Parallelism(gpus=8, strategy="zero3")))


def test_the_banner_names_one_replica_without_a_data_parallel_strategy_over_one() -> None:
    """Every GPU tensor-parallel under DDP is one replica: the banner says so, not "× DDP (replicated) over 1"; with
    replicas the strategy and their count stay."""
    from memcalc_gui.view.plan_text import parallel_label, strategy_text

    one = TrainingSetup(model=preset_spec("llama-3.1-8b"), parallel=Parallelism(gpus=2, tp=2, sp=True,
                                                                                    strategy="ddp"))
    assert strategy_text(one) == "TP 2 + SP, one replica (no data parallelism)"
    assert parallel_label(one).startswith("2 GPUs, TP 2 + SP, one replica")
    two = one.with_changes(parallel=Parallelism(gpus=4, tp=2, sp=True, strategy="ddp"))
    assert strategy_text(two) == "TP 2 + SP × DDP (replicated) over 2"
    zero = one.with_changes(parallel=Parallelism(gpus=2, tp=2, strategy="zero1"))
    assert strategy_text(zero) == "TP 2 × ZeRO-1 (optimizer state sharded) over 1"
