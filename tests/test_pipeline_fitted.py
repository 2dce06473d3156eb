"""Pipeline stages of a family memcalc has no block model of (a mixture of experts, its experts split or not): the
fitted method fits each checked rank's own step under the schedule, and ``--method trace`` traces the ranks (issue
17)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from memcalc_gui.cli import main
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.fitted import (
    SEPARATE,
    FitModel,
    estimate_fitted,
    pipeline_microbatches,
    worth_calibrating,
)
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc_gui.trace import fit as fitmod
from memcalc_gui.trace.pipeline import PipeRank, trace_pipeline_rank

MIXTRAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=1024, hidden_size=128,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, model_type="mixtral",
               intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=8)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path_factory.getbasetemp() / "pipeline-fits"
    monkeypatch.setenv("MEMCALC_CACHE_DIR", str(folder))
    return folder


def _setup(pp: int, m: int, dp: int, strategy: str, **kw: object) -> TrainingSetup:
    base: dict = dict(params=1, batch=3, seq=80, grad_accum=m, optimizer_impl="foreach", cuda_context_bytes=0,
                      allocator_reserve=0.0, parallel=Parallelism(gpus=pp * dp, pp=pp, strategy=strategy))
    base.update(kw)
    return TrainingSetup(**base)


@pytest.mark.full_suite
def test_each_fitted_rank_equals_its_schedule_traced_with_every_micro_batch() -> None:
    """Calibrated on 3- and 4-layer stages over pp + 1 micro-batches, evaluated on 6-layer stages (12 layers of the
    config) at a shape it never traced with all ``m`` micro-batches: the first and the last rank each equal
    PyTorch's 1F1B schedule traced on the fake process group. DDP adds its buckets, one gradient of the stage. (FSDP2
    and experts split over the stage's GPUs: the CLI test below.)"""
    pp, m, dp = 2, 5, 2
    cfg = dict(MIXTRAL, num_hidden_layers=12)
    setup = _setup(pp, m, dp, "ddp", precision="mixed")
    assert pipeline_microbatches(setup) == pp + 1 < m  # the untraced micro-batches are added by rule
    fit = fitmod.calibrate(cfg, setup, 1)
    assert sorted(fit.stages) == [0, 1]
    assert all(f.num_layers == 6 and f.layers == (3, 4) and max(f.checked[p] for p in PHASES) <= fitmod.TOLERANCE
               for f in fit.stages.values())
    est = estimate_fitted(setup, fit)
    rows = {row["rank"]: row for row in est.details["pipeline_ranks"]}
    assert est.details["pipeline_rank"] == max(rows, key=lambda r: rows[r]["peak_bytes"])
    for rank, row in rows.items():
        traced = trace_pipeline_rank(cfg, PipeRank(pp, rank, "1f1b", 1, m), batch=3, seq=80, precision="mixed",
                                     optimizer_impl="foreach")
        buckets = traced.phases["optimizer_step"].objects["gradients"]
        for phase in PHASES:
            assert row["phases"][phase] == pytest.approx(traced.phases[phase].peak_bytes + buckets, rel=0.002), \
                (rank, phase)
    # JSON keeps the stages; a cached fit reads back whole
    again = FitModel.from_json(json.loads(json.dumps(fit.to_json())))
    assert again == fit


@pytest.mark.full_suite
def test_expert_beside_tensor_parallelism_in_stages_is_fitted_from_the_groups_own_traces() -> None:
    """Each stage's tensor-parallel group run for real beside the split experts (transformers' layout: the group's 2
    ranks hold 2 experts' groups, the tokens split over them before the all-to-all), not as the narrower model that
    stands for a tensor-parallel rank without experts split: at a shape and micro-batch count no calibration traced
    (2-layer stages, traced at their own depth: the test above extrapolates the depth), every checked rank equals its
    1F1B schedule traced with every micro-batch. Megatron-LM's optimizers, whose states would come by rule
    over a replica that does not split its experts, are refused."""
    from memcalc_gui.core.fitted import pipeline_layout

    pp, m, tp, ep = 2, 5, 2, 2
    cfg = dict(MIXTRAL, num_hidden_layers=4)
    setup = _setup(pp, m, 1, "ddp", precision="mixed",
                   parallel=Parallelism(gpus=pp * tp, pp=pp, tp=tp, ep=ep, strategy="ddp"))
    assert (pipeline_layout(setup)["tp"], pipeline_layout(setup)["ep"]) == (tp, ep)
    fit = fitmod.calibrate(cfg, setup, 1)
    est = estimate_fitted(setup, fit)
    rows = {row["rank"]: row for row in est.details["pipeline_ranks"]}
    assert sorted(rows) == [0, 1]
    for rank, row in rows.items():
        traced = trace_pipeline_rank(cfg, PipeRank(pp, rank, "1f1b", 1, m, tp=tp, ep=ep), batch=3, seq=80,
                                     precision="mixed", optimizer_impl="foreach")
        for phase in PHASES:
            assert row["phases"][phase] == pytest.approx(traced.phases[phase].peak_bytes, rel=0.002), (rank, phase)
    with pytest.raises(InputError) as err:
        pipeline_layout(setup.with_changes(parallel=Parallelism(gpus=4, pp=2, tp=2, ep=2, strategy="megatron")))
    assert err.value.field == "strategy"


@pytest.mark.full_suite
def test_sequence_parallel_stages_of_a_mixture_of_experts_are_fitted_from_their_own_traces() -> None:
    """torchtitan's layout of a mixture of experts' stages: each fully_shard-ed over its data-parallel GPUs, its
    layers split over its tensor-parallel group with the sequence-parallel plan on top (the stages send the rank's
    seq/tp tokens), the experts over ep of the stage's GPUs. At a shape and micro-batch count no calibration traced
    (the receive buffers of the micro-batches past pp + 1 added by rule at seq/tp tokens), every checked rank equals its
    1F1B schedule traced with every micro-batch."""
    from memcalc_gui.core.fitted import pipeline_layout

    pp, m, dp, tp, ep = 2, 5, 2, 2, 2
    cfg = dict(MIXTRAL, num_hidden_layers=4)
    setup = _setup(pp, m, dp, "fsdp2", precision="mixed",
                   parallel=Parallelism(gpus=pp * dp * tp, pp=pp, tp=tp, ep=ep, sp=True, strategy="fsdp2"))
    assert pipeline_layout(setup)["tp"] == tp and pipeline_layout(setup)["sp"]
    est = estimate_fitted(setup, fitmod.calibrate(cfg, setup, 1))
    assert any("sequence-parallel plan on top (the stages send the rank's 40 tokens)" in n
               for n in est.details["parallel_notes"])
    rows = {row["rank"]: row for row in est.details["pipeline_ranks"]}
    assert sorted(rows) == [0, 1]
    for rank, row in rows.items():
        traced = trace_pipeline_rank(cfg, PipeRank(pp, rank, "1f1b", 1, m, dp_shard=dp, tp=tp, ep=ep, sp=True),
                                     batch=3, seq=80, precision="mixed", optimizer_impl="foreach")
        for phase in PHASES:
            assert row["tensor_bytes"][phase] == pytest.approx(traced.phases[phase].peak_bytes, rel=0.002), \
                (rank, phase)


@pytest.mark.full_suite
def test_what_more_micro_batches_add_to_a_middle_rank() -> None:
    """A middle rank (neither first nor last) of 1F1B receives activations and gradients: each micro-batch beyond
    the traced ones adds one receive buffer of each, and its token ids (the batch every rank loads); what the rule adds
    equals the trace."""
    from memcalc_gui.core.fitted import SEPARATE, _untraced_microbatches

    cfg = dict(MIXTRAL, num_hidden_layers=6)
    setup = _setup(3, 7, 1, "ddp", precision="fp32", batch=2, seq=64)
    runs = {m: trace_pipeline_rank(cfg, PipeRank(3, 1, "1f1b", 1, m), batch=2, seq=64, precision="fp32",
                                   optimizer_impl="foreach") for m in (4, 7)}
    empty = {p: [[], []] if p in SEPARATE else [] for p in PHASES}
    fit = FitModel("mixtral", 1, 2, {}, (2, 3), empty, empty, structure={"hidden_size": 128})
    added = _untraced_microbatches(setup, fit, 1, 4)
    assert added == {"temporaries": 3 * 2 * (2 * 64 * 128 * 4), "inputs": 3 * 2 * 64 * 8}
    for phase in ("forward", "backward", "optimizer_step"):
        assert runs[7].phases[phase].peak_bytes - runs[4].phases[phase].peak_bytes == sum(added.values()), phase


def test_megatron_pipeline_ranks_are_fitted_by_its_rule_as_the_analytic_ledger_lays_them_out() -> None:
    """Megatron-LM's optimizers are not run here: a stage's bf16 step is traced as one replica and its model states
    laid out by Megatron's rule (bf16 weights, the fp32 main-grad buffer from load on, the fp32 optimizer sharded
    over the data-parallel GPUs). On a family with a block model that is the analytic pipeline ledger, rank by rank,
    within 2 % (the load phase, the weights and the main-grad buffer, within 0.01 %)."""
    from tiny_models import CONFIGS

    from memcalc_gui.core.estimate import estimate
    from memcalc_gui.core.model import spec_from_config

    cfg = dict(CONFIGS["llama"], num_hidden_layers=4)
    kw: dict = dict(batch=2, seq=64, grad_accum=4, precision="mixed", optimizer_impl="foreach",
                    cuda_context_bytes=0, allocator_reserve=0.0,
                    parallel=Parallelism(gpus=8, pp=2, strategy="megatron-distopt"))
    analytic = estimate(TrainingSetup(model=spec_from_config(cfg), **kw))
    setup = TrainingSetup(params=1, **kw)
    fitted = estimate_fitted(setup, fitmod.calibrate(cfg, setup, 1))
    want = {r["rank"]: r["phases"] for r in analytic.details["pipeline_ranks"]}
    got = {r["rank"]: r["phases"] for r in fitted.details["pipeline_ranks"]}
    assert sorted(got) == sorted(want) == [0, 1]
    for rank, phases in got.items():
        assert phases["load"] == pytest.approx(want[rank]["load"], rel=1e-4)  # the weights and main-grad buffer
        for phase in PHASES:
            assert phases[phase] == pytest.approx(want[rank][phase], rel=0.02), (rank, phase)
    assert any("by the strategy's rule" in a for a in fitted.assumptions)
    # Megatron's own theoretical_memory_usage counts the most loaded shard as block/pp + embedding at 6 + 12/dp bytes
    # a parameter: the first stage's parameters, gradients and optimizer state equal it (Mixtral-8x7B in 4 stages
    # over 64 GPUs, experts and router counted: to 1e-7, docs/parallelism.md)
    from memcalc_gui.core.distributed import megatron_theoretical_memory
    from memcalc_gui.core.fitted import _stage_structure, per_gpu_states

    fit = fitmod.calibrate(cfg, setup, 1)  # cached
    first = fit.stages[0]
    _, states = per_gpu_states(setup, dataclasses.replace(first, structure=_stage_structure(setup, fit, first)))
    ours = states.parameters["optimizer_step"] + states.gradients["optimizer_step"] + states.optimizer_state
    weights, _ = megatron_theoretical_memory(cfg["hidden_size"], cfg["intermediate_size"], 4,
                                             cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"],
                                             pp=2, dp=4, distributed_optimizer=True)
    assert ours == pytest.approx(weights, rel=1e-3)  # Megatron splits the final norm over the stages too
    # Megatron DDP runs the same traced stage: the one calibration serves it (from the cache, nothing traced), and
    # its ledger is the analytic one of its own rule (the optimizer state whole on every data-parallel GPU)
    plain = dict(kw, parallel=dataclasses.replace(kw["parallel"], strategy="megatron"))
    replicated = TrainingSetup(params=1, **plain)
    same = fitmod.calibrate(cfg, replicated, 1, cached_only=True)
    ledger = estimate_fitted(replicated, same)
    assert ledger.peak_bytes == pytest.approx(estimate(TrainingSetup(model=spec_from_config(cfg), **plain)).peak_bytes,
                                              rel=0.02)
    assert ledger.peak_bytes > fitted.peak_bytes


def test_the_layer_counts_a_pipeline_rank_fit_traces() -> None:
    """From 3 layers a stage on, extrapolated (a 2-layer stage has no layer between its top and bottom one, which
    FSDP2 with checkpointing tells apart); a shallower stage is traced at its own depth and checked there."""
    assert fitmod.pipeline_layer_counts(6) == ((3, 4), 5)
    assert fitmod.pipeline_layer_counts(3) == ((3, 4), 5)
    assert fitmod.pipeline_layer_counts(2) == ((2, 3), 2)
    assert fitmod.pipeline_layer_counts(1) == ((1, 2), 1)
    with pytest.raises(fitmod.FitError):  # every N-th layer counts from the model's first
        fitmod.pipeline_chunk_layers(MIXTRAL, 8, _setup(2, 4, 1, "ddp", checkpointing="every:2"))


def test_a_fitted_pipeline_says_what_it_cannot_fit() -> None:
    for strategy in ("zero1", "zero3", "fsdp-full-shard"):  # neither traced in the schedule nor laid out by rule
        with pytest.raises(InputError) as err:
            fitmod.calibrate(MIXTRAL, _setup(2, 4, 2, strategy), 1)
        assert err.value.field == "strategy"
    with pytest.raises(InputError) as err:  # FSDP2 over one GPU per stage
        fitmod.calibrate(MIXTRAL, _setup(2, 4, 1, "fsdp2"), 1)
    assert err.value.field == "strategy"
    with pytest.raises(InputError) as err:  # 8 layers in 3 stages
        fitmod.calibrate(MIXTRAL, _setup(3, 4, 1, "ddp"), 1)
    assert err.value.field == "pp"
    gpipe = _setup(2, 65, 1, "ddp", parallel=Parallelism(gpus=2, pp=2, schedule="gpipe"))
    with pytest.raises(InputError) as err:  # every micro-batch of GPipe is traced: at most 64
        pipeline_microbatches(gpipe)
    assert err.value.field == "grad_accum"
    # of the checkpointing what-ifs only full checkpointing is calibrated under pipeline parallelism
    base = fitmod.signature(_setup(2, 4, 1, "ddp"))
    assert worth_calibrating(base, _setup(2, 4, 1, "ddp", checkpointing="full"))
    assert not worth_calibrating(base, _setup(2, 4, 1, "ddp", checkpointing="selective"))
    with pytest.raises(InputError) as err:  # a bare parameter count has no layers to split
        from memcalc_gui.core.estimate import estimate

        estimate(_setup(2, 4, 1, "ddp", params=7_000_000_000))
    assert err.value.field == "pp"


@pytest.mark.full_suite
def test_the_cli_fits_and_traces_pipeline_ranks_with_the_experts_split(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron-LM's layout of a mixture of experts, at toy size: 2 pipeline stages of 4 data-parallel GPUs each,
    the routed experts split over 2 of them (transformers' expert-parallel plan and all-to-all), FSDP2 sharding the
    rest over the 4 and the experts over their 2 copies. The fitted default prints each checked stage and the most
    loaded one's ledger; ``--method trace`` traces each checked rank and reports the most loaded, which the fit
    equals."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(MIXTRAL, num_hidden_layers=4)))  # 2-layer stages: traced at their own depth
    args = ["estimate", "--config", str(config), "--gpus", "8", "--pp", "2", "--ep", "2", "--strategy", "fsdp2",
            "--grad-accum", "4", "--batch", "2", "--seq", "96", "--gpu", "rtx-4090", "--json"]
    assert main(args) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["method"] == "fitted"
    assert [r["rank"] for r in fitted["pipeline_ranks"]] == [0, 1]
    assert any("Pipeline rank" in a and "routed experts split over 2" in a for a in fitted["assumptions"])
    assert fitted["ep"] == 2 and fitted["pp"] == 2
    # the report draws the same fitted ledger (it drew the bare-count heuristic for such a family), titled by the config
    png = tmp_path / "report.png"
    assert main(["report", *args[1:-1], "--out", str(png)]) == 0
    said = capsys.readouterr().out
    assert png.stat().st_size > 10_000 and fitted["verdict"] in said
    assert main([*args, "--method", "trace"]) == 0
    traced = json.loads(capsys.readouterr().out)
    assert any("most loaded of ranks 1, 2" in a for a in traced["assumptions"])
    for phase in PHASES:  # the trace rounds each allocation to 512 B; the fit does not
        want, got = (d["phases"][phase]["total_bytes"] for d in (traced, fitted))
        assert got == pytest.approx(want, rel=0.005), phase
    # the experts split over a number that does not divide a stage's data-parallel GPUs (12 in 2 stages: 6 each)
    with pytest.raises(SystemExit) as exit_:
        main([*args[:3], "--gpus", "12", "--pp", "2", "--ep", "4"])
    assert exit_.value.code == 2
    assert "--ep" in capsys.readouterr().err


@pytest.mark.full_suite
def test_a_fitted_zero_bubble_rank_equals_its_schedule_traced() -> None:
    """A mixture of experts under ZB-V (two one-layer stages per GPU, traced at their own depth): every rank equals
    its schedule traced at the case's shape. (With full checkpointing, which the fit traces as PyTorch runs it, each
    deferred weight-gradient step recomputing a checkpointed layer per weight group, the same holds:
    bench/pipeline_fitted.py --zero-bubble; a minute of CPU, too long for this suite.)"""
    pp, m = 2, 4
    cfg = dict(MIXTRAL, num_hidden_layers=4)
    setup = _setup(pp, m, 1, "ddp", precision="mixed",
                   parallel=Parallelism(gpus=pp, pp=pp, schedule="zbv", virtual_stages=2))
    fit = fitmod.calibrate(cfg, setup, 1)
    est = estimate_fitted(setup, fit)
    for row in est.details["pipeline_ranks"]:
        traced = trace_pipeline_rank(cfg, PipeRank(pp, row["rank"], "zbv", 2, m), batch=3, seq=80, precision="mixed",
                                     optimizer_impl="foreach")
        for phase in PHASES:
            assert row["phases"][phase] == pytest.approx(traced.phases[phase].peak_bytes, rel=0.002), \
                (row["rank"], phase)


@pytest.mark.full_suite
def test_the_pipeline_stages_of_a_fitted_family_are_measured_for_real(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two gloo processes, one stage each under PyTorch's 1F1B, activations and gradients really sent: each rank is
    compared with its own fitted rank (the first stage also holds the activation gloo is sending, as a block model's
    does). (A scaled-down one, 12 layers measured as 6: 0.0 % on every rank, by hand; its calibration takes 30 s.)"""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(MIXTRAL, num_hidden_layers=4)))
    args = ["measure", "--config", str(config), "--gpus", "2", "--pp", "2", "--strategy", "ddp", "--grad-accum", "4",
            "--batch", "2", "--seq", "64", "--iterations", "2", "--full-size", "--json"]
    assert main(args) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["estimate"]["method"] == "fitted" and [r["stage"] for r in measured["ranks"]] == [0, 1]
    for rank in measured["ranks"]:
        for phase, error in rank["error_pct"].items():
            assert abs(error) < 1.0, (rank["label"], phase, error)


def test_a_fitted_pipeline_is_scaled_down_by_whole_stage_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scaled-down measurement of a family without a block model keeps whole stage-chunks, no shallower than the
    stages' fits trace (3 layers a chunk from trace.fit.PIPELINE_LAYERS on), and each rank's fit is evaluated at the
    shorter chunk; a layout of more stages than the fitted ranks (first, second, last) runs 2 or 3 of them."""
    from memcalc_gui.measure.fitted import FittedScaling
    from memcalc_gui.measure.layout import scale_layout

    empty = {p: [[], []] if p in SEPARATE else [] for p in PHASES}
    stage = FitModel("mixtral", 1, 12, {}, (3, 4), empty, empty, structure={"hidden_size": 128})
    fit = dataclasses.replace(stage, stages={0: stage, 1: stage})
    monkeypatch.setattr(FittedScaling, "fit", lambda self, setup, vocab: fit)
    cfg = dict(MIXTRAL, num_hidden_layers=24)
    setup = _setup(2, 4, 1, "ddp", parallel=Parallelism(gpus=2, pp=2))
    scaling = FittedScaling(cfg, setup)
    assert scaling.min_layers(setup) == 6  # 3 a chunk, 2 chunks
    assert [scaling.fewer_layers(n, 6) for n in (24, 12, 10, 8)] == [12, 6, 6, 6]
    interleaved = setup.with_changes(parallel=Parallelism(gpus=2, pp=2, schedule="interleaved-1f1b",
                                                          virtual_stages=2))
    again = FittedScaling(cfg, interleaved)
    assert again.min_layers(interleaved) == 12 and again.fewer_layers(20, 12) == 12  # 4 chunks of 3
    shorter = scaling._fit_at(scaling.setup(setup, 6, scaling.vocab))
    assert shorter is not None and {r: st.num_layers for r, st in shorter.stages.items()} == {0: 3, 1: 3}
    for pp, kept in ((4, 2), (6, 3), (8, 2), (3, 3)):
        deep = TrainingSetup(params=10**6, parallel=Parallelism(gpus=2 * pp, pp=pp, strategy="fsdp2"))
        scaled, changes = scale_layout(deep, max_ranks=64)
        assert scaled.parallel.pp == kept and scaled.parallel.dp == 2, pp
        assert any(f"pipeline stages {kept} instead of {pp}" in c for c in changes) == (kept != pp)
