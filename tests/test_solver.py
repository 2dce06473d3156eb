"""The search for what to change: every lever the estimator supports, cheapest sets first."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc_gui.core.distributed import Parallelism, closest_offload
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.finetune import FineTuning
from memcalc_gui.core.model import preset_spec
from memcalc_gui.core.result import evaluate
from memcalc_gui.core.setup import TrainingSetup, find_gpu
from memcalc_gui.core.solver import (
    LEVER_COSTS,
    SHARDED,
    apply_changes,
    cost_tier,
    levers,
    micro_batch_changes,
    search_fixes,
    solve,
)


def _setup(preset: str, gpu: str, **kw) -> TrainingSetup:
    g = find_gpu(gpu)
    return TrainingSetup(model=preset_spec(preset), gpu=g.id, capacity_bytes=g.capacity_bytes, **kw)


def _cost(fix) -> int:
    return sum(LEVER_COSTS.get(k, LEVER_COSTS[k.split(":")[0]]) for k in fix.key.removeprefix("fix:").split("+"))


def test_costs_follow_the_stated_order():
    """The stated order (solver's docstring, README "What to change"): recipe changes by what they give up, then more
    GPUs, then the lossless changes by step time; any one-per-group set of lossless levers is cheaper than more GPUs,
    and any set without a recipe change cheaper than the cheapest recipe change."""
    from memcalc_gui.core.solver import HARDWARE_COST, RECIPE_COST

    c = LEVER_COSTS
    assert c["precision-bf16"] > c["tuning-qlora"] > c["tuning-lora"] > c["optimizer-galore"] > c["optimizer-8bit"] \
        > c["optimizer-bf16-states"] > c["precision-mixed"] > c["optimizer-in-backward"] > c["gpus"] \
        > c["offload-activations-all"] > c["offload-both"] > c["offload-optimizer"] > c["checkpointing-offload"] \
        > c["checkpointing"] > c["checkpointing-selective"] > c["checkpointing-every-2"] > c["micro-batch"] \
        > c["strategy"] > c["loss-chunked"] > c["optimizer-fused"]
    rich = [_setup("llama-3.1-8b", "h100-80gb", batch=8, seq=8192, precision="fp32", attention="eager"),
            _setup("llama-3.1-8b", "h100-80gb", batch=8, seq=8192, checkpointing="full", packing=True,
                   parallel=Parallelism(gpus=16, strategy="fsdp2", tp=2, dp_replicate=2))]
    for setup in rich:
        most: dict[str, int] = {}
        for lever in levers(setup):
            if lever.tier < 2:
                most[lever.group] = max(most.get(lever.group, 0), lever.cost)
        assert sum(v for g, v in most.items() if g != "gpus") < HARDWARE_COST <= sum(most.values()) < RECIPE_COST
        assert {cost_tier(lv.cost) for lv in levers(setup)} == {0, 1, 2}


#: Issue 62: Qwen2.5-7B, 8 × 4096, 8 × H100, FSDP2, mixed precision.
QWEN_8_H100 = dict(batch=8, seq=4096, precision="mixed")


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_issue_62_the_lossless_fix_ranks_above_more_gpus(checkpointing: str) -> None:
    """Checkpointing and a chunked loss fit at 34.6 GiB on the 8 GPUs at hand (44 GiB headroom): that, or something
    that fits with as much headroom and no more GPUs, ranks above any suggestion that adds GPUs ("checkpointing; use
    14 GPUs" left 328 MiB)."""
    setup = _setup("qwen2.5-7b", "h100-80gb", checkpointing=checkpointing, **QWEN_8_H100,
                   parallel=Parallelism(gpus=8, strategy="fsdp2"))
    rows = evaluate(setup).verdict.suggestions
    wanted = {"checkpointing": "full", "loss": "chunked"}
    by_hand = estimate(apply_changes(setup, wanted)).peak_bytes
    assert by_hand <= setup.capacity_bytes
    best = next(i for i, s in enumerate(rows) if s.fits and "gpus" not in s.changes and s.peak_bytes <= by_hand)
    more_gpus = [i for i, s in enumerate(rows) if s.changes.get("gpus", 8) > 8]
    assert all(best < i for i in more_gpus), [s.title for s in rows]
    assert any(s.fits and apply_changes(setup, s.changes).loss == "chunked" for s in rows)  # the fix the issue names


def test_cards_that_fit_come_first_by_tier_then_those_still_over_by_saving() -> None:
    cases = [_setup("qwen2.5-7b", "h100-80gb", checkpointing="full", **QWEN_8_H100,
                    parallel=Parallelism(gpus=8, strategy="fsdp2")),
             _setup("llama-3.1-70b", "h100-80gb", batch=4, seq=2048, grad_accum=4,
                    parallel=Parallelism(gpus=8, strategy="zero3")),
             _setup("llama-3.1-8b", "rtx-4090", checkpointing="full", batch=1, seq=512)]
    for setup in cases:
        rows = evaluate(setup).verdict.suggestions
        fits = [s.fits for s in rows]
        assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits), [s.title for s in rows]
        fitting = [s for s in rows if s.fits]
        assert [s.cost for s in fitting] == sorted(s.cost for s in fitting)
        over = [s.saves_bytes for s in rows if not s.fits]
        assert over == sorted(over, reverse=True)
        # a card of a dearer tier is only there when it beats every cheaper one on peak or host memory
        for s in fitting:
            assert not any(cost_tier(o.cost) < cost_tier(s.cost) and o.peak_bytes <= s.peak_bytes
                           and o.host_bytes <= s.host_bytes for o in fitting), s.title


def test_a_change_that_closes_under_1_percent_of_the_gap_is_no_card() -> None:
    """Issue 62: QLoRA of Llama-3.1-8B at 2 × 4096 on an RTX 4090 is 91 GiB over; 8-bit AdamW (its adapters' state:
    0.26 GiB) was listed."""
    setup = _setup("llama-3.1-8b", "rtx-4090", batch=2, seq=4096, tuning=FineTuning(method="qlora", rank=16))
    result = evaluate(setup)
    gap = -result.verdict.headroom_bytes
    assert gap > 80 * 2**30
    eight_bit = estimate(apply_changes(setup, {"optimizer": "adamw-8bit"})).peak_bytes
    assert 0 < estimate(setup).peak_bytes - eight_bit < gap // 100  # it does lower the peak, by a crumb
    rows = result.verdict.suggestions
    assert rows and all(s.fits or s.saves_bytes >= gap // 100 for s in rows)
    assert not any(s.changes == {"optimizer": "adamw-8bit"} for s in rows)


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp-full-shard", "zero2", "zero3"])
def test_each_offload_the_strategy_has_is_offered_once(strategy: str) -> None:
    """FSDP's one CPUOffload is "both" (optimizer alone reads the same ledger); ZeRO-1/2 offload the optimizer only:
    the same card was listed twice, with the same numbers."""
    setup = _setup("qwen2.5-7b", "h100-80gb", **QWEN_8_H100, parallel=Parallelism(gpus=8, strategy=strategy))
    rows = evaluate(setup).verdict.suggestions
    offloads = [s for s in rows if set(s.changes) == {"offload"}]
    assert offloads
    assert len({(s.peak_bytes, s.host_bytes) for s in offloads}) == len(offloads)
    for s in offloads:
        assert closest_offload(strategy, s.changes["offload"]) == s.changes["offload"]
    assert len({repr(sorted(s.changes.items())) for s in rows}) == len(rows)  # no two cards make the same changes


def test_70b_on_8_h100_keeps_full_precision():
    """Issue case: Llama-3.1-70B, 8 × H100, ZeRO-3, micro-batch 4 × 2048 × 4, mixed precision."""
    from memcalc_gui.core.distributed import Parallelism

    setup = _setup("llama-3.1-70b", "h100-80gb", batch=4, seq=2048, grad_accum=4,
                   parallel=Parallelism(gpus=8, strategy="zero3"))
    verdict = solve(setup, estimate)
    assert verdict.fits is False
    fixes = [s for s in verdict.suggestions if s.key.startswith("fix")]  # "fix-here:": on the same 8 GPUs
    assert fixes
    first = fixes[0]
    assert first.fits and "precision" not in first.changes and "optimizer" not in first.changes
    assert first.changes.get("checkpointing") == "full"
    assert "offload" in first.changes or first.changes.get("gpus", 8) > 8
    assert any(f.changes.get("offload") == "optimizer" and set(f.changes) == {"checkpointing", "offload"}
               for f in fixes)
    # every precision change comes after the fixes that keep precision
    keys = [s.key for s in verdict.suggestions]
    assert keys.index(first.key) < keys.index("precision-bf16")


def test_70b_on_one_4090_suggests_sharding_offload_or_more_gpus():
    setup = _setup("llama-3.1-70b", "rtx-4090", batch=4, seq=2048, grad_accum=4)
    fixes = search_fixes(setup, estimate, setup.capacity_bytes)
    assert fixes
    for fix in fixes:
        assert fix.changes.get("strategy") in SHARDED
        assert "offload" in fix.changes or fix.changes.get("gpus", 1) > 1
        assert "precision" not in fix.changes


def test_a_lever_that_changes_nothing_is_dropped():
    """Hybrid sharding or a second offload kind on one node must not appear beside a cheaper equal fix."""
    setup = _setup("qwen2.5-7b", "a100-80gb", batch=4, seq=2048)
    fixes = search_fixes(setup, estimate, setup.capacity_bytes)
    for fix in fixes:
        for key in list(fix.changes):
            if key in ("batch", "grad_accum", "lora_rank"):  # (the adapters' rank comes with the tuning lever)
                continue
            rest = {k: v for k, v in fix.changes.items() if k != key}
            with contextlib.suppress(ValueError):  # the others need it (offload needs a sharded strategy)
                assert estimate(apply_changes(setup, rest)).peak_bytes > fix.peak_bytes, (fix.title, key)
    peaks_by_kinds: dict = {}
    for fix in fixes:
        kinds = frozenset(k.split(":")[0] for k in fix.key.removeprefix("fix:").split("+"))
        assert all(fix.peak_bytes < p for p in peaks_by_kinds.get(kinds, [])), fix.title
        peaks_by_kinds.setdefault(kinds, []).append(fix.peak_bytes)


def test_micro_batch_changes_keep_the_effective_batch():
    setup = _setup("gpt2", "t4", batch=16, grad_accum=4)
    assert micro_batch_changes(setup, 5) == {"batch": 4, "grad_accum": 16}
    assert micro_batch_changes(setup, 1) == {"batch": 1, "grad_accum": 64}
    one = _setup("gpt2", "t4", batch=2, grad_accum=1)
    assert micro_batch_changes(one, 7) == {"batch": 7}  # no divisor above 2 keeps it: said in the button


def test_bare_parameter_count_gets_suggestions_without_crashing():
    g = find_gpu("rtx-4090")
    setup = TrainingSetup(params=7_000_000_000, capacity_bytes=g.capacity_bytes)
    verdict = solve(setup, estimate)
    assert verdict.fits is False
    assert all(not s.key.startswith("fix:") or s.fits for s in verdict.suggestions)


SETUPS = st.builds(
    lambda preset, gpu, batch, seq, accum, prec, ck: _setup(preset, gpu, batch=batch, seq=seq, grad_accum=accum,
                                                           precision=prec, checkpointing=ck),
    st.sampled_from(["qwen2.5-1.5b", "llama-3.1-8b", "mistral-7b", "phi-3-mini", "gemma-2b", "llama-3.1-70b"]),
    st.sampled_from(["t4", "rtx-4090", "a100-40gb", "h100-80gb"]),
    st.integers(1, 64), st.sampled_from([512, 2048, 8192]), st.integers(1, 8),
    st.sampled_from(["fp32", "mixed", "bf16"]), st.sampled_from(["none", "full"]),
)


@settings(max_examples=40, deadline=None)
@given(SETUPS)
def test_every_fix_fits_as_reported_and_fixes_are_minimal_and_ordered(setup):
    cap = setup.capacity_bytes
    found = search_fixes(setup, estimate, cap)
    for fix in found:  # every fix, the same-run one ("fix-here:") too, fits as reported
        after = apply_changes(setup, fix.changes)
        assert estimate(after).peak_bytes == fix.peak_bytes <= cap
        if fix.key.startswith("fix-here:"):
            assert not {"gpus", "batch", "strategy", "tuning"} & set(fix.changes)
    fixes = [f for f in found if f.key.startswith("fix:")]  # the cheapest sets, cheapest first
    costs = [_cost(f) for f in fixes]
    assert costs == sorted(costs)
    lever_sets = [frozenset(f.key.removeprefix("fix:").split("+")) for f in fixes]
    for i, fix in enumerate(fixes):
        after = apply_changes(setup, fix.changes)
        assert estimate(after).peak_bytes == fix.peak_bytes <= cap
        if "batch" in fix.changes:
            assert after.effective_batch == setup.effective_batch
        assert not any(other < lever_sets[i] for other in lever_sets[:i])
    if estimate(setup).peak_bytes <= cap:
        assert fixes == [] or all(f.fits for f in fixes)


def test_levers_cover_what_the_estimator_supports():
    keys = {lv.key for lv in levers(_setup("llama-3.1-8b", "a100-80gb", batch=8, precision="fp32",
                                            attention="eager"))}
    assert {"checkpointing", "optimizer-8bit", "optimizer-fused", "precision-mixed", "precision-bf16",
            "attention-sdpa", "micro-batch", "offload-optimizer", "offload-both", "gpus"} <= keys
    assert {"strategy:zero2", "strategy:zero3", "strategy:fsdp-full-shard"} <= keys


@pytest.mark.parametrize("preset", ["llama-3.1-70b", "qwen2.5-7b"])
def test_search_is_bounded(preset):
    from memcalc_gui.core import solver

    calls = 0

    def counting(setup):
        nonlocal calls
        calls += 1
        return estimate(setup)

    setup = _setup(preset, "t4", batch=64, seq=8192, grad_accum=8, precision="fp32", attention="eager")
    solver.search_fixes(setup, counting, setup.capacity_bytes)
    assert calls < solver.MAX_EVALUATIONS * 40


def test_a_sequence_past_the_model_positions_is_warned_everywhere(capsys):
    import json

    from memcalc_gui import cli
    from memcalc_gui.core.result import evaluate

    long = evaluate(_setup("gpt2", "a100-80gb", seq=100_000))
    assert len(long.warnings) == 1 and "max_position_embeddings 1,024" in long.warnings[0]
    assert evaluate(_setup("gpt2", "a100-80gb", seq=1024)).warnings == ()
    assert "long-context" in evaluate(_setup("llama-3.2-1b", "a100-80gb", seq=200_000)).warnings[0]
    assert cli.main(["estimate", "--preset", "gpt2", "--seq", "100000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == list(long.warnings)
    assert cli.main(["estimate", "--preset", "gpt2", "--seq", "100000"]) == 0
    assert "Warning    Sequence length 100,000" in capsys.readouterr().out


@pytest.mark.parametrize(("text", "value"), [("4k", 4096), ("128K", 131072), ("1M", 1048576), ("2048", 2048),
                                             (" 8k ", 8192)])
def test_sequence_lengths_accept_token_suffixes(text, value):
    from memcalc_gui.core.units import parse_positive_int

    assert parse_positive_int(text, "seq", tokens=True) == value


@pytest.mark.parametrize(("text", "tokens"), [("4k", False), ("1.3k", True), ("k", True), ("4kk", True)])
def test_token_suffixes_only_where_they_mean_tokens(text, tokens):
    from memcalc_gui.core.units import parse_positive_int

    with pytest.raises(ValueError):
        parse_positive_int(text, "batch", tokens=tokens)


def test_a_unique_part_of_a_preset_name_is_that_preset():
    from memcalc_gui.core.errors import InputError
    from memcalc_gui.ui.form import ModelCache

    cache = ModelCache()
    assert cache.preset("405b").name == "llama-3.1-405b"
    assert cache.preset("LLAMA-2").name == "llama-2-7b"
    with pytest.raises(InputError, match="presets match"):
        cache.preset("qwen")


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 200_000), st.integers(0, 250_000))
def test_largest_divisor_matches_brute_force(n, limit):
    from memcalc_gui.core.solver import _largest_divisor_at_most

    expected = max((d for d in range(1, min(n, limit) + 1) if n % d == 0), default=1)
    assert _largest_divisor_at_most(n, limit) == expected


def test_suggestions_say_the_host_memory_they_need():
    """A fix that offloads names the host memory its setup needs (JSON host_bytes); one that does not, none."""
    setup = _setup("llama-3.1-70b", "rtx-4090", batch=1, seq=2048)
    rows = evaluate(setup).verdict.suggestions
    offloading = [s for s in rows if s.changes.get("offload", "none") != "none"]
    assert offloading and all(s.host_bytes > 0 and s.to_json()["host_bytes"] == s.host_bytes for s in offloading)
    for s in offloading:
        assert s.host_bytes == estimate(apply_changes(setup, s.changes)).details["host_bytes"]
    assert all(s.host_bytes == 0 for s in rows if "offload" not in s.changes)


def test_no_suggestion_is_rounding() -> None:
    """A change that saves less than 1 MiB (and 0.1 % of the peak) without making the step fit is not offered
    (sharding a fitted model over its one GPU once saved 563 B of rounding and was listed first); one that makes it
    fit is, however little it saves."""
    import dataclasses

    from memcalc_gui.core.solver import MIN_SAVING_BYTES, suggestions

    setup = TrainingSetup(model=preset_spec("llama-3.1-8b"), seq=4096)

    def rounding(s: TrainingSetup) -> object:  # the analytic ledger, 563 B less under any sharding strategy
        est = estimate(s)
        if s.parallel.strategy == "ddp":
            return est
        phases = {p: dataclasses.replace(ph, objects={**ph.objects, "parameters": ph.objects["parameters"] - 563})
                  if ph.objects.get("parameters", 0) > 563 else ph for p, ph in est.phases.items()}
        return dataclasses.replace(est, phases=phases)

    base = estimate(setup).peak_bytes
    rows = suggestions(setup, rounding, None)  # type: ignore[arg-type]
    assert rows and all(r.saves_bytes >= max(MIN_SAVING_BYTES, base // 1000) for r in rows)
    tight = suggestions(setup, rounding, base - 100)  # type: ignore[arg-type]
    assert any(r.fits and r.saves_bytes == 563 for r in tight)



def test_a_micro_batch_the_estimator_cannot_weigh_is_not_offered_and_nothing_fails():
    """A fitted pipeline rank is calibrated for its own number of micro-batches: a smaller micro-batch with more
    accumulation steps needs another calibration (the estimator's InputError). The micro-batch what-if then waits for
    it, as the other uncalibrated ones do; `memcalc estimate` of such a pipeline failed with exit 2 before."""
    from memcalc_gui.core.errors import InputError

    setup = _setup("llama-3.2-1b", "rtx-4090", batch=4, grad_accum=1)

    def estimator(s: TrainingSetup):
        if s.grad_accum != setup.grad_accum:
            raise InputError("method", "this change needs its own calibration (a few seconds of tracing)")
        return estimate(s)

    verdict = solve(setup, estimator)
    assert verdict.fits is False
    assert not any(row.changes.get("grad_accum") for row in verdict.suggestions)
    assert any("Micro-batch 1 × 4" in title for title in verdict.uncalibrated)


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(1, 160), need=st.integers(1, 200), refused=st.sets(st.integers(1, 160), max_size=120))
def test_the_fewest_gpus_are_the_fewest_that_fit_and_run(limit: int, need: int, refused: set[int]) -> None:
    """Per-GPU memory that falls with the GPU count, and any set of counts the layout refuses (FSDP2's uneven
    placement of the routed experts refuses some): the fewest GPUs are the smallest count that fits and is not
    refused, or none, as counting them one by one says."""
    import types

    from memcalc_gui.core.errors import InputError
    from memcalc_gui.core.solver import _fewest_gpus

    setup = TrainingSetup(params=10**9)
    capacity = 1_000_000

    def estimator(s: TrainingSetup) -> object:
        gpus = s.parallel.gpus
        if gpus in refused:
            raise InputError("gpus", f"{gpus} GPUs cannot place the experts")
        return types.SimpleNamespace(peak_bytes=capacity * need // gpus)

    want = next((k for k in range(1, limit + 1) if k not in refused and capacity * need // k <= capacity), None)
    assert _fewest_gpus(setup, estimator, capacity, limit=limit) == want


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=3), min_size=1, max_size=4), st.data())
def test_the_walk_yields_each_set_of_a_tier_once_cheapest_first(costs: list[list[int]], data) -> None:
    """The best-first walk (solver._combinations) with seeds and required groups yields exactly the sets — one lever
    per group at most — that hold a seed or a dearer lever of a seed's group and a lever of each required group, each
    once, in order of cost: what the tier-by-tier search relies on to try every lossless set before more GPUs."""
    import itertools

    from memcalc_gui.core import solver

    groups = {f"g{g}": [solver.Lever(f"g{g}", f"k{g}.{i}", "", {}, "") for i in range(len(cs))]
              for g, cs in enumerate(costs)}
    cost = {f"k{g}.{i}": c for g, cs in enumerate(costs) for i, c in enumerate(cs)}
    levers_all = [lv for options in groups.values() for lv in options]
    seeds = tuple(data.draw(st.lists(st.sampled_from(levers_all), max_size=2, unique_by=lambda lv: lv.key)))
    required = frozenset(data.draw(st.lists(st.sampled_from(sorted(groups)), max_size=2, unique=True)))
    original = solver.lever_cost
    solver.lever_cost = lambda key: cost[key]  # type: ignore[assignment]
    try:
        walked = [frozenset(lv.key for lv in combo) for combo in solver._combinations(groups, seeds, required)]
    finally:
        solver.lever_cost = original  # type: ignore[assignment]
    rank = {lv.key: sorted(options, key=lambda o: (cost[o.key], o.key)).index(lv)
            for options in groups.values() for lv in options}
    expected = set()
    for choice in itertools.product(*[[None, *options] for options in groups.values()]):
        picked = [lv for lv in choice if lv is not None]
        if not picked or not required <= {lv.group for lv in picked}:
            continue
        if seeds and not any(lv.group == seed.group and rank[lv.key] >= rank[seed.key] for seed in seeds
                             for lv in picked):
            continue
        expected.add(frozenset(lv.key for lv in picked))
    assert len(walked) == len(set(walked)) and set(walked) == expected
    totals = [sum(cost[k] for k in keys) for keys in walked]
    assert totals == sorted(totals)
