"""FSDP2's hybrid sharding (HSDP, ``--dp-replicate``): replicas of ``fully_shard`` groups on a 2-D mesh, as torchtitan
runs ``data_parallel_replicate_degree``. A GPU holds what FSDP2 over its replica's GPUs holds: the ledger, the trace
of one rank on the fake process group and four real gloo ranks say the same."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import sample

from bench.techniques import FAMILIES
from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.model import preset_spec, spec_from_config
from memcalc_gui.core.result import evaluate
from memcalc_gui.core.setup import TrainingSetup, find_gpu
from memcalc_gui.core.vocab import PHASES


def _hybrid(setup: TrainingSetup, replicas: int) -> TrainingSetup:
    """``setup`` with ``replicas`` times the GPUs, as that many replicas of its FSDP2 group."""
    par = setup.parallel
    return setup.with_changes(parallel=dataclasses.replace(par, gpus=par.gpus * replicas, dp_replicate=replicas))


@pytest.mark.parametrize(("gpus", "tp", "cp", "replicas", "ckpt"), [
    (8, 1, 1, 2, "none"), (8, 1, 1, 4, "full"), (16, 2, 1, 2, "none"), (16, 1, 2, 4, "full"), (4, 1, 2, 3, "none"),
])
def test_a_hybrid_gpu_holds_what_fsdp2_over_its_replica_holds(gpus: int, tp: int, cp: int, replicas: int,
                                                              ckpt: str) -> None:
    """Each phase's objects under R replicas of an FSDP2 group equal that group's alone (the all-reduce across
    replicas runs in place on the reduce-scattered shard), and differ from FSDP2 over all the GPUs."""
    one = TrainingSetup(model=preset_spec("llama-3.1-8b"), seq=8192, checkpointing=ckpt,
                        parallel=Parallelism(gpus=gpus, tp=tp, cp=cp, strategy="fsdp2"))
    group, hybrid = estimate(one), estimate(_hybrid(one, replicas))
    for p in PHASES:
        assert hybrid.phases[p].objects == group.phases[p].objects, p
    flat = estimate(one.with_changes(parallel=dataclasses.replace(one.parallel, gpus=gpus * replicas)))
    assert flat.phases["optimizer_step"].objects["optimizer_state"] < \
        hybrid.phases["optimizer_step"].objects["optimizer_state"]
    assert any(f"in each of {replicas} replicas" in a for a in hybrid.assumptions)


@pytest.mark.parametrize(("changes", "words"), [
    (dict(gpus=8, strategy="zero3", dp_replicate=2), "FSDP2's hybrid sharding"),
    (dict(gpus=6, strategy="fsdp2", dp_replicate=4), "equal replicas"),
    (dict(gpus=4, strategy="fsdp2", dp_replicate=4), "nothing to shard"),
    (dict(gpus=8, strategy="fsdp2", dp_replicate=2, ep=2, pp=2), "expert parallelism in pipeline stages"),
    (dict(gpus=8, strategy="fsdp2", dp_replicate=0), "positive"),
])
def test_a_hybrid_layout_that_cannot_be_is_refused_naming_the_replicas(changes: dict, words: str) -> None:
    with pytest.raises(InputError) as info:
        Parallelism(**changes)
    assert info.value.field == "dp_replicate" and words in info.value.reason


def test_experts_split_within_one_replica() -> None:
    with pytest.raises(InputError, match="one replica's 4") as info:
        Parallelism(gpus=8, strategy="fsdp2", dp_replicate=2, ep=8)
    assert info.value.field == "ep"


def test_the_cli_takes_replicas_prints_them_and_suggests_dropping_them(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["estimate", "--preset", "llama-3.1-70b", "--seq", "4096", "--gpus", "32", "--strategy", "fsdp2",
              "--checkpointing", "full", "--gpu", "h100-80gb"]
    assert cli_main([*common, "--dp-replicate", "4"]) == 0
    out = capsys.readouterr().out
    assert "as 4 replicas of 8 sharded GPUs (hybrid sharding)" in out
    assert "Shard over all 32 data-parallel GPUs (FSDP2 without hybrid replicas)" in out  # the way to fit
    assert "each strategy over all data-parallel GPUs (FSDP2 without hybrid replicas)" in out  # what the plan weighs
    assert cli_main([*common, "--dp-replicate", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dp_replicate"] == 4 and data["setup"]["dp_replicate"] == 4 and not data["fits"]
    for bad, words in (("3", "equal replicas"), ("x", "positive")):
        with pytest.raises(SystemExit) as info:
            cli_main([*common, "--dp-replicate", bad])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--dp-replicate" in err and words in err


def test_the_plan_and_the_gpu_count_suggestion_keep_whole_replicas() -> None:
    """The fewest-GPUs answer of a hybrid layout is a count of whole replicas, each with something to shard; the plan
    weighs each strategy without replicas, so every strategy gets an answer."""
    setup = TrainingSetup(model=preset_spec("llama-3.1-70b"), seq=4096, checkpointing="full",
                          capacity_bytes=find_gpu("h100-80gb").capacity_bytes,
                          parallel=Parallelism(gpus=16, strategy="fsdp2", dp_replicate=4))
    r = evaluate(setup)
    assert not r.verdict.fits and r.plan is not None and not r.plan.unmodelled
    assert r.plan.min_gpus["fsdp2"] == 19  # FSDP2 over every GPU: 19 shards fit
    more = [s for s in r.verdict.suggestions if "GPUs of this kind" in s.title and len(s.changes) == 1]
    assert more and more[0].changes["gpus"] % 4 == 0 and more[0].changes["gpus"] // 4 >= 19
    # GPU counts come in whole replicas of whole model-parallel (and expert-splitting) groups: each such count is a
    # layout, so the fewest-GPUs search never steps on a count the setup refuses
    from memcalc_gui.core.solver import model_parallel_group

    for kw in (dict(tp=2), dict(ep=4), dict(tp=2, ep=4), dict(cp=2)):
        par = Parallelism(gpus=64, strategy="fsdp2", dp_replicate=2, **kw)  # type: ignore[arg-type]
        group = model_parallel_group(par)
        for k in range(2, 6):
            dataclasses.replace(par, gpus=k * group)  # raises where the count is no layout


def _toy(**changes: object) -> TrainingSetup:
    return TrainingSetup(model=spec_from_config(FAMILIES["llama"]), batch=2, seq=128, precision="mixed",
                         checkpointing="full", **changes)  # type: ignore[arg-type]


def test_a_traced_hybrid_rank_runs_the_2d_mesh_and_equals_its_replicas_fsdp2() -> None:
    """One rank of 2 replicas × FSDP2 over 2, traced with ``fully_shard`` on the 2-D mesh of the fake process group:
    to the byte the rank of FSDP2 over 2 alone, and within 0.5 % of the ledger. (Beside TP 2 with sequence
    parallelism: the interleaved pipeline case below.)"""
    from memcalc_gui.trace.fake import trace_estimate

    group = _toy(parallel=Parallelism(gpus=2, strategy="fsdp2"))
    a, b = trace_estimate(group), trace_estimate(_hybrid(group, 2))
    assert any("fully_shard over 2 data-parallel ranks in each of 2 replicas" in r for r in b.rules)
    for p in PHASES:
        assert b.estimate.phases[p].tensor_bytes == a.estimate.phases[p].tensor_bytes, p
    assert max(map(abs, b.difference_pct().values())) < 0.5, b.difference_pct()


def test_four_real_ranks_of_two_replicas_match_the_ledger() -> None:
    """Four gloo processes, 2 replicas × FSDP2 over 2, each rank measured with the tracker: every phase within 0.5 %
    of the ledger, which shards over 2, not 4."""
    from memcalc_gui.measure.engine import measure

    setup = _toy(target_device="cpu", parallel=Parallelism(gpus=4, strategy="fsdp2", dp_replicate=2))
    result = measure(setup, device="cpu")
    assert not result.scaled and len(result.ranks) == 4
    for rank in result.ranks:
        for phase, error in rank.error_pct.items():
            assert abs(error) < 0.5, (rank.label, phase, error)
    flat = estimate(setup.with_changes(parallel=Parallelism(gpus=4, strategy="fsdp2")))
    held = result.ranks[0].phases["optimizer_step"].peak_bytes
    assert held > flat.phases["optimizer_step"].tensor_bytes * 1.2  # the states of 1/2, not 1/4


@pytest.mark.full_suite
def test_a_family_without_a_block_model_fits_its_hybrid_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A mixture of experts (no block model) under hybrid sharding: the fitted method calibrates the rank on the 2-D
    mesh, and ``--method trace`` agrees with it within 0.1 %."""
    from memcalc_gui.trace import fake

    monkeypatch.setattr(fake, "CUDA_ROUNDING", 1)
    config = dict(FAMILIES["llama"], model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                  num_hidden_layers=2)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config))
    common = ["estimate", "--config", str(cfg), "--batch", "2", "--seq", "128", "--precision", "mixed", "--gpus", "4",
              "--strategy", "fsdp2", "--dp-replicate", "2", "--json"]
    assert cli_main(common) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["method"] == "fitted"
    assert any("in each of 2 replicas" in a for a in fitted["assumptions"])
    assert cli_main([*common, "--method", "trace"]) == 0
    traced = json.loads(capsys.readouterr().out)
    for p in PHASES:
        assert fitted["phases"][p]["total_bytes"] == pytest.approx(traced["phases"][p]["total_bytes"], rel=1e-3), p


def test_the_hybrid_rank_is_fully_shard_on_the_2d_mesh() -> None:
    """The parallelizer shards each parameter over its replica and replicates it across replicas (FSDP2's HSDP
    placements), where the rank of FSDP2 over every GPU shards it over all four."""
    from torch.distributed.tensor import Replicate, Shard

    from memcalc_gui.measure.cpu_step import build_model
    from memcalc_gui.trace.ranks import RankLayout, device_mesh, fake_process_group, parallelizer

    for layout, placements in ((RankLayout(dp_shard=2, dp_replicate=2), (Replicate(), Shard(0))),
                               (RankLayout(dp_shard=4), (Shard(0),))):
        with fake_process_group(4):
            model = build_model(FAMILIES["llama"], precision="fp32")
            parallelizer(FAMILIES["llama"], layout, "fp32", device_mesh(layout))(model)
            weight = model.model.layers[0].mlp.down_proj.weight
            assert tuple(weight.placements) == placements and weight.device_mesh.ndim == len(placements)


def test_the_layout_search_weighs_one_replica_per_node_beside_fsdp2_across_nodes() -> None:
    """An FSDP2 layout whose data-parallel GPUs span nodes comes with its hybrid twin, one replica per node: more
    memory per GPU (a node's share of the states), faster by the rough step model (the all-gathers on NVLink, only the
    shard's all-reduce between nodes), in pipeline stages too; within one node or under other strategies, none."""
    from memcalc_gui.core.layouts import candidates, layout_label, search

    setup = TrainingSetup(model=preset_spec("llama-3.1-8b"), seq=8192, grad_accum=8,
                          capacity_bytes=find_gpu("h100-80gb").capacity_bytes, gpu="h100-80gb",
                          parallel=Parallelism(gpus=32))
    found = {(lay.parallel.tp, lay.parallel.pp, lay.parallel.strategy, lay.parallel.dp_replicate): lay
             for lay in search(setup, estimate, min_gpus_for=0)}
    hybrids = [key for key in found if key[3] > 1]
    assert {(tp, r) for tp, pp, _s, r in hybrids if pp == 1} == {(1, 4), (2, 4), (4, 4)}  # a node per replica
    # a pipeline's stages too: each stage's data-parallel GPUs, one replica per node
    assert {(tp, pp, r) for tp, pp, _s, r in hybrids if pp == 2} == {(1, 2, 2), (2, 2, 2), (4, 2, 2)}
    assert all(s == "fsdp2" and 32 // (pp * tp * r) * tp == 8 for tp, pp, s, r in hybrids)
    for tp, pp, s, r in hybrids:
        twin, flat = found[(tp, pp, s, r)], found[(tp, pp, s, 1)]
        assert twin.peak_bytes > flat.peak_bytes and twin.seconds_per_token < flat.seconds_per_token
        assert twin.peak_bytes == estimate(setup.with_changes(parallel=twin.parallel)).peak_bytes
    assert layout_label(found[(2, 1, "fsdp2", 4)].parallel).endswith("FSDP2 over 16 (4 replicas of 4)")
    assert not any(p.dp_replicate > 1 for p in candidates(setup, gpus=8))  # one node: nothing to gain


@pytest.mark.full_suite
@pytest.mark.parametrize(("tp", "cp", "schedule", "virtual", "reshard"), sample([
    # (plain 1F1B: the real ranks below equal its trace)
    (2, 1, "interleaved-1f1b", 2, True), (1, 2, "1f1b", 1, True), (1, 1, "zbv", 2, False),
], (1,)))
def test_hybrid_pipeline_stages_are_their_replicas_fsdp2_stages(tp: int, cp: int, schedule: str, virtual: int,
                                                                  reshard: bool) -> None:
    """Pipeline stages each sharded as 2 replicas of FSDP2 over 2 (× TP 2 with torchtitan's plan, × CP 2 with ring
    attention and FSDP2 over dp × cp, under interleaved 1F1B, 1F1B and ZB-V): the stage ledger and the rank traced
    under PyTorch's schedule on the 5-D mesh equal FSDP2 over one replica to the byte, and each other within 0.7 %."""
    from memcalc_gui.trace.fake import trace_estimate

    cfg = dict(FAMILIES["llama"], num_hidden_layers=4)
    group = TrainingSetup(model=spec_from_config(cfg), batch=2, seq=128, precision="mixed", grad_accum=4,
                          parallel=Parallelism(gpus=4 * tp * cp, tp=tp, cp=cp, pp=2, schedule=schedule,
                                               virtual_stages=virtual, strategy="fsdp2", reshard_after_forward=reshard,
                                               sp=tp > 1))
    hybrid = _hybrid(group, 2)
    a, b = trace_estimate(group), trace_estimate(hybrid)
    assert any(f"fully_shard-ed over {2 * cp} ranks in each of 2 replicas" in r for r in b.rules)
    for p in PHASES:
        assert b.estimate.phases[p].tensor_bytes == a.estimate.phases[p].tensor_bytes, p
        assert estimate(hybrid).phases[p].tensor_bytes == estimate(group).phases[p].tensor_bytes, p
    assert max(map(abs, b.difference_pct().values())) < 0.7, b.difference_pct()


@pytest.mark.full_suite
def test_eight_real_ranks_of_hybrid_pipeline_stages_match_their_trace() -> None:
    """Two 1F1B stages, each 2 replicas × FSDP2 over 2: eight gloo processes (beyond what Measure runs on a CPU, four)
    under PyTorch's schedule on the 5-D mesh; every rank's peaks equal its stage's fake-process-group trace."""
    from memcalc_gui.measure.distributed import measure_sharded_step
    from memcalc_gui.trace.pipeline import PipeRank, trace_pipeline_rank

    cfg = dict(FAMILIES["llama"], num_hidden_layers=4)
    pipe = PipeRank(2, 0, "1f1b", 1, 2, dp_shard=2, dp_replicate=2)
    step = dict(batch=2, seq=128, precision="fp32", grad_accum=2)
    real = measure_sharded_step(cfg, world=8, strategy="pipeline:1f1b", layout=pipe, iterations=3, **step)
    for stage in (0, 1):
        traced = trace_pipeline_rank(cfg, dataclasses.replace(pipe, rank=stage), iterations=2, **step)
        for rank in real[4 * stage:4 * stage + 4]:
            for p in ("forward", "backward", "optimizer_step"):
                assert rank.phases[p].peak_bytes == pytest.approx(traced.phases[p].peak_bytes, rel=1e-3), (stage, p)


def test_the_fitted_rule_shards_fused_experts_over_one_replica() -> None:
    """The rule a family without a block model falls back on (FSDP2 shards transformers' fused experts expert by
    expert): 8 experts over 2 replicas of 6 GPUs hold what 6 GPUs alone hold, 2 experts on the most loaded one."""
    from memcalc_gui.core.distributed import expert_parallel_states

    def states(par: Parallelism) -> tuple[dict[str, int], int, str]:
        s = expert_parallel_states(par, 10_000_000, 8_000_000, 1_000, 1_000, "fp32", 80_000_000, 0, 0, 100,
                                   experts=8)
        return s.parameters, s.optimizer_state, s.notes[0]

    assert states(Parallelism(gpus=12, strategy="fsdp2", dp_replicate=2)) == \
        states(Parallelism(gpus=6, strategy="fsdp2"))
    for kw in (dict(ep=2), dict(ep=4, tp=2), dict(ep=4)):  # the experts split too: within each replica
        hybrid = states(Parallelism(gpus=8, strategy="fsdp2", dp_replicate=2, **kw))  # type: ignore[arg-type]
        assert hybrid[:2] == states(Parallelism(gpus=4, strategy="fsdp2", **kw))[:2], kw  # type: ignore[arg-type]
        assert "replicas" in hybrid[2]
    assert "over 6 GPUs are 2 on the most loaded one" in states(Parallelism(gpus=12, strategy="fsdp2",
                                                                            dp_replicate=2))[2]


@pytest.mark.full_suite
def test_a_hybrid_rank_of_expert_parallelism_is_traced_and_run_on_the_replicas_mesh() -> None:
    """The routed experts split over 2 GPUs inside each of 2 replicas (× TP 2 with the experts whole, transformers'
    layout), FSDP2's hybrid sharding on the dense part and on the experts' copies (the experts' mesh ``replicas ×
    copies × ep``): the traced rank equals FSDP2 over one replica to the byte; four real gloo ranks hold the traced
    weights and optimizer step exactly, forward and backward within the router's imbalance."""
    import sys

    from memcalc_gui.measure.distributed import measure_sharded_step
    from memcalc_gui.trace.ranks import RankLayout, trace_rank

    sys.path.insert(0, str(Path(__file__).parent))
    from test_expert import MIXTRAL, STEP, assert_routed_ranks_match

    kw = dict(STEP, precision="fp32", optimizer_impl="foreach", checkpointing="none")
    config = dict(MIXTRAL, num_hidden_layers=2)
    hybrids = {}
    for tp in (1, 2):
        alone = trace_rank(config, RankLayout(dp_shard=2, tp=tp, ep=2), **kw)
        hybrids[tp] = hybrid = trace_rank(config, RankLayout(dp_shard=2, tp=tp, ep=2, dp_replicate=2), **kw)
        for p in PHASES:
            assert hybrid.phases[p].peak_bytes == alone.phases[p].peak_bytes, (tp, p)
    layout, traced = RankLayout(dp_shard=2, dp_replicate=2, ep=2), hybrids[1]
    assert_routed_ranks_match(measure_sharded_step(config, world=4, strategy="ranks", layout=layout, iterations=3,
                                                   **kw), traced)


@settings(max_examples=80, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]),
       shards=st.integers(1, 4), replicas=st.integers(2, 5), ep=st.sampled_from([1, 2, 4, 8]),
       ckpt=st.sampled_from(["none", "full"]), reshard=st.booleans())
def test_any_hybrid_layout_holds_what_one_replica_holds(tp: int, cp: int, pp: int, shards: int, replicas: int,
                                                        ep: int, ckpt: str, reshard: bool) -> None:
    """Every hybrid layout the setup accepts (or an InputError naming a field: never another exception) gives each
    GPU what FSDP2 over one replica gives it: the block model's ledger, and the experts' rule of a mixture of
    experts."""
    from memcalc_gui.core.distributed import expert_parallel_states

    one = shards * cp * tp * pp
    try:
        hybrid = Parallelism(gpus=one * replicas, tp=tp, cp=cp, pp=pp, strategy="fsdp2", dp_replicate=replicas,
                             reshard_after_forward=reshard, ep=ep, schedule="1f1b")
        alone = dataclasses.replace(hybrid, gpus=one, dp_replicate=1)
    except InputError as exc:
        assert exc.field in ("dp_replicate", "ep", "strategy", "reshard_after_forward"), exc
        return
    args = (10_000_000, 8_000_000 if ep > 1 else 0, 1_000, 1_000, "mixed", 80_000_000, 0, 0, 100)
    a, b = (expert_parallel_states(p, *args, experts=8) for p in (hybrid, alone))  # type: ignore[arg-type]
    assert (a.parameters, a.gradients, a.optimizer_state) == (b.parameters, b.gradients, b.optimizer_state)
    if ep > 1:
        return
    base = TrainingSetup(model=preset_spec("llama-3.2-1b"), seq=4096, checkpointing=ckpt, grad_accum=2)
    try:
        hybrid_est = estimate(base.with_changes(parallel=hybrid))
    except InputError as exc:
        assert exc.field != "dp_replicate", exc
        with pytest.raises(InputError):
            estimate(base.with_changes(parallel=alone))
        return
    alone_est = estimate(base.with_changes(parallel=alone))
    for p in PHASES:
        assert hybrid_est.phases[p].objects == alone_est.phases[p].objects, p
