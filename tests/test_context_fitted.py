"""Context parallelism of a family without a block model (issue 17): the fitted method calibrates one rank of the ring
(PyTorch's ring attention on the fake process group, FSDP2 over the data- and context-parallel GPUs, or every rank
holding the model whole under DDP) and answers with it; the strategies not traced lay their states over that rank's
activations, and what no rank fit covers takes one replica at seq/cp tokens, saying so."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from tiers import sample

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.fitted import CONTEXT_DEGREES, estimate_fitted, rank_layout
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES
from memcalc_gui.trace.meta import count_params_on_meta

OPT = dict(model_type="opt", hidden_size=64, ffn_dim=128, num_attention_heads=4, num_hidden_layers=4, vocab_size=256,
           max_position_embeddings=512, word_embed_proj_dim=64)
MIXTRAL = dict(model_type="mixtral", hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=3, vocab_size=512, max_position_embeddings=512, num_local_experts=4,
               num_experts_per_tok=2)


@pytest.fixture(autouse=True)
def private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This module's fits in a folder of their own, shared by its tests (the ZeRO test reads the DDP case's fits):
    the window's tests open the same Mixtral config and must not find its tensor-parallel fits in the run's cache (the
    layout search weighs the calibrated layouts only, tests/test_ui.py)."""
    run = os.environ.get("MEMCALC_CACHE_DIR")
    folder = Path(run) / "context-fitted" if run else tmp_path_factory.getbasetemp() / "context-fitted"
    monkeypatch.setenv("MEMCALC_CACHE_DIR", str(folder))
    return folder


def _setup(cfg: dict[str, object], **kw: object) -> TrainingSetup:
    par = kw.pop("parallel")
    return TrainingSetup(params=count_params_on_meta(cfg), parallel=par, **kw)  # type: ignore[arg-type]


@pytest.mark.full_suite
@pytest.mark.parametrize(("name", "strategy", "gpus", "cp", "tp", "ep", "precision", "batch", "seq", "accum", "sp"),
                         sample([
    # 4 layers: the rank fit extrapolates from 3 and 4, checked at 5
    ("opt", "fsdp2", 4, 2, 1, 1, "mixed", 3, 160, 2, False),
    ("mixtral", "ddp", 8, 2, 2, 1, "fp32", 2, 128, 1, False),  # beside tensor parallelism 2: the ring over its heads
    # beside expert and tensor parallelism: the experts split over 2 consecutive ranks (a tensor-parallel group)
    ("mixtral", "fsdp2", 8, 2, 2, 2, "mixed", 3, 160, 2, False),
    # torchtitan's sequence-parallel plan on each tensor-parallel group of the ring: the norms on seq/cp/tp tokens
    ("mixtral", "fsdp2", 4, 2, 2, 1, "fp32", 2, 128, 1, True),
], (0, 1, 2)))
def test_the_fitted_rank_of_a_context_parallel_layout_is_the_traced_one(
        name: str, strategy: str, gpus: int, cp: int, tp: int, ep: int, precision: str, batch: int, seq: int,
        accum: int, sp: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """At a shape and accumulation no calibration traced, the fitted ledger is ``--method trace``'s rank of the same
    layout to the byte (the trace's 512-byte rounding off, which the fit leaves out, as its assumptions say). Without
    the rank's fit, one replica at seq/cp tokens stands in, says so, and misses what ring attention gathers (with
    sequence parallelism it is an upper bound, and says that)."""
    from memcalc_gui.trace import fake
    from memcalc_gui.trace.fit import calibrate

    monkeypatch.setattr(fake, "CUDA_ROUNDING", 1)
    cfg = OPT if name == "opt" else MIXTRAL
    setup = _setup(cfg, batch=batch, seq=seq, grad_accum=accum, precision=precision,
                   parallel=Parallelism(gpus=gpus, cp=cp, tp=tp, ep=ep, strategy=strategy, sp=sp))
    assert rank_layout(setup) is not None and rank_layout(setup)["cp"] == cp  # type: ignore[index]
    assert rank_layout(setup).get("sp", False) == sp  # type: ignore[union-attr]
    assert (rank_layout(setup)["tp"], rank_layout(setup).get("ep", 1)) == (tp, ep)  # type: ignore[union-attr]
    fit = calibrate(cfg, setup, setup.params or 0)
    assert fit.rank is not None
    fitted = estimate_fitted(setup, fit)
    assert fitted.details["rank_fit"]
    assert any("ring attention" in n and f"{seq // cp:,} tokens" in n for n in fitted.details["parallel_notes"])
    traced = fake.trace_estimate(setup, cfg)
    assert any("context-parallel ring" in r for r in traced.rules)
    for p in PHASES:
        assert fitted.phases[p].tensor_bytes == pytest.approx(traced.estimate.phases[p].tensor_bytes, rel=1e-4), p
    rule = estimate_fitted(setup, dataclasses.replace(fit, rank=None))
    assert "rank_fit" not in rule.details
    assert any("stands for a rank of the ring" in n for n in rule.details["parallel_notes"])
    if sp:
        assert rule.details["upper_bound"] and fitted.details.get("upper_bound") is None
        assert any(f"norms on the rank's {seq // cp // tp:,} tokens" in n for n in fitted.details["parallel_notes"])
        return
    for p in ("forward", "backward"):  # the replica at seq/cp tokens, without the ring's chunks: under it, or over
        # it with the experts split (the rule's all-to-all buffers, a bound)
        assert (rule.phases[p].tensor_bytes < traced.estimate.phases[p].tensor_bytes) == (ep == 1), p


@pytest.mark.full_suite
def test_zero_beside_context_parallelism_lays_its_states_over_the_traced_ranks_activations() -> None:
    """ZeRO-2 is not traced: over the same GPUs its activations are those of the DDP layout's traced rank (one fit
    serves both), its optimizer state the replica's split over every data- and context-parallel GPU."""
    from memcalc_gui.trace.fit import calibrate

    par = dict(gpus=8, cp=2, tp=2)  # the layout of the DDP case above: its fits, from the run's cache
    ddp = _setup(MIXTRAL, batch=2, seq=128, precision="fp32", parallel=Parallelism(strategy="ddp", **par))
    zero = ddp.with_changes(parallel=Parallelism(strategy="zero2", **par))
    assert rank_layout(zero) == rank_layout(ddp) == {"dp_replicate": 2, "tp": 2, "cp": 2, "replicate_context": True}
    fits = [calibrate(MIXTRAL, s, s.params or 0) for s in (ddp, zero)]
    assert fits[0].rank == fits[1].rank is not None
    by_ddp, by_zero = (estimate_fitted(s, f) for s, f in zip((ddp, zero), fits, strict=True))
    assert any("ring attention over 2" in n for n in by_zero.details["parallel_notes"])
    for p in ("forward", "backward"):
        assert by_zero.phases[p].objects["activations"] == by_ddp.phases[p].objects["activations"], p
    # the replica's (a tensor-parallel rank's narrower model): every parameter's moments
    state = fits[0].peak("optimizer_step", 1, 1)["optimizer_state"]
    assert by_zero.phases["optimizer_step"].objects["optimizer_state"] == pytest.approx(state / 4, rel=1e-3)
    assert by_ddp.phases["optimizer_step"].objects["optimizer_state"] == pytest.approx(state, rel=1e-3)


@pytest.mark.full_suite
def test_what_no_rank_fit_covers_is_answered_by_the_replica_and_says_why(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A degree the calibration's sequences do not split into 2·cp chunks takes the one-replica rule at seq/cp tokens
    and names the reason; a bare parameter count, a ring in pipeline stages other than under FSDP2 and context beside
    expert parallelism of a dense family are refused, naming the field."""
    from memcalc_gui.trace.fake import refusal
    from memcalc_gui.trace.fit import CHECK_SHAPE, SHAPES, calibrate

    seqs = [s for _, s in (*SHAPES, CHECK_SHAPE)]
    assert [cp for cp in range(2, 65) if all(s % (2 * cp) == 0 for s in seqs)] == list(CONTEXT_DEGREES)
    wide = _setup(OPT, batch=1, seq=2048, parallel=Parallelism(gpus=32, cp=32, strategy="ddp"))
    assert rank_layout(wide) is None
    fit = calibrate(OPT, wide, wide.params or 0)
    assert fit.rank is None
    est = estimate_fitted(wide, fit)
    assert any("stands for a rank of the ring" in n and "not 32" in n for n in est.details["parallel_notes"])
    # one replica at 2,048/32 tokens: DDP over the 32 GPUs, each a sequence of 64 tokens
    alone = estimate_fitted(_setup(OPT, batch=1, seq=64, parallel=Parallelism(gpus=32, strategy="ddp")), fit)
    for p in PHASES:
        assert est.phases[p].tensor_bytes == alone.phases[p].tensor_bytes, p
    beside_tp = _setup(MIXTRAL, batch=1, seq=2048, parallel=Parallelism(gpus=8, cp=2, tp=2, strategy="fsdp2"))
    assert rank_layout(beside_tp) is not None and not refusal(beside_tp)
    staged = _setup(MIXTRAL, batch=1, seq=2048, parallel=Parallelism(gpus=8, cp=2, pp=2, strategy="ddp"))
    assert rank_layout(staged) is None and "torchtitan" in refusal(staged)  # in stages: under FSDP2 (test below)

    with pytest.raises(InputError) as exc:
        estimate(TrainingSetup(params=7_000_000_000, parallel=Parallelism(gpus=2, cp=2)))
    assert exc.value.field == "cp"
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(OPT))
    common = ["estimate", "--config", str(cfg), "--batch", "1", "--seq", "2048", "--json"]
    for argv, field in (([*common, "--gpus", "4", "--cp", "2", "--pp", "2", "--strategy", "ddp"], "--strategy"),
                        ([*common, "--gpus", "4", "--cp", "2", "--ep", "2", "--strategy", "fsdp2"], "--ep")):
        with pytest.raises(SystemExit) as stop:
            cli_main(argv)
        assert stop.value.code == 2
        assert field in capsys.readouterr().err
    # measured for real except where PyTorch's DDP beside tensor parallelism cannot wrap transformers' experts
    cfg.write_text(json.dumps(MIXTRAL))
    with pytest.raises(SystemExit) as stop:
        cli_main(["measure", *common[1:-1], "--gpus", "4", "--tp", "2", "--cp", "2", "--strategy", "ddp"])
    assert stop.value.code == 2
    assert "--strategy" in capsys.readouterr().err


@pytest.mark.full_suite
@pytest.mark.parametrize(("name", "flags"), sample([
    # PyTorch's ring attention over gloo beside transformers' tensor-parallel plan and torchtitan's sequence-parallel
    # one, fully_shard over the ring
    ("mixtral", ("--gpus", "4", "--tp", "2", "--cp", "2", "--sp", "--strategy", "fsdp2")),
    # DDP over the ring's ranks, each holding the model whole: its buckets really there
    ("opt", ("--gpus", "2", "--cp", "2", "--strategy", "ddp")),
    # the experts split over each tensor-parallel group of the ring, transformers' all-to-all over gloo
    ("mixtral", ("--gpus", "4", "--ep", "2", "--tp", "2", "--cp", "2", "--strategy", "fsdp2")),
], (0,)))
def test_a_real_step_of_the_ring_matches_the_fitted_rank(name: str, flags: tuple[str, ...], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Measured for real, rank by rank on gloo: the rank the estimate describes (the ring's first, the most loaded:
    its chunks meet every other's queries) is the fitted rank within 0.1 %; the others hold no more than it. With the
    experts split the router's real shares move forward and backward around the balanced-routing estimate (here
    within 3 %); the weights and the optimizer step stay exact."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(OPT if name == "opt" else MIXTRAL))
    assert cli_main(["measure", "--config", str(cfg), "--batch", "2", "--seq", "128", "--precision", "mixed",
                     "--json", *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["scaled"] and len(out["ranks"]) == int(flags[1])
    routed = "--ep" in flags
    for r in out["ranks"]:
        for phase, error in r["error_pct"].items():  # the estimate minus the measured, in % of the measured
            if routed:
                assert abs(error) < (3.0 if phase in ("forward", "backward") else 0.1), (r["label"], phase, error)
            else:
                assert (-0.1 < error < 0.1) if r["rank"] == out["shown_rank"] == 0 else (-0.1 < error < 3.0), \
                    (r["label"], phase, error)


@pytest.mark.full_suite
def test_the_fitted_ranks_of_a_ring_in_pipeline_stages_are_their_traced_schedules(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipeline stages of such a family with a ring inside each (torchtitan's layout: FSDP2 over each stage's dp × cp
    ranks, the routed experts split over ep of them): calibrated over pp + 1 micro-batches, evaluated at a shape and a
    micro-batch count it never traced, each checked rank equals its 1F1B schedule traced with every micro-batch. (Its
    2-layer stages are traced at their own depth: extrapolating a stage's depth is tests/test_pipeline_fitted.py's.)
    Under DDP it is refused naming the strategy, as the trace refuses it."""
    from memcalc_gui.core.fitted import pipeline_layout
    from memcalc_gui.trace import fake
    from memcalc_gui.trace.fit import calibrate
    from memcalc_gui.trace.pipeline import PipeRank, trace_pipeline_rank

    monkeypatch.setattr(fake, "CUDA_ROUNDING", 1)
    pp, m, cp, ep = 2, 5, 2, 2
    cfg = dict(MIXTRAL, num_hidden_layers=4)
    setup = _setup(cfg, batch=3, seq=160, grad_accum=m, precision="mixed", cuda_context_bytes=0, allocator_reserve=0.0,
                   parallel=Parallelism(gpus=pp * cp, pp=pp, cp=cp, ep=ep, strategy="fsdp2"))
    assert (pipeline_layout(setup)["cp"], pipeline_layout(setup)["ep"]) == (cp, ep)
    fit = calibrate(cfg, setup, setup.params or 0)
    est = estimate_fitted(setup, fit)
    assert any("ring attention, the rank's 80 tokens" in n and "routed experts split over 2" in n
               for n in est.details["parallel_notes"])
    rows = {row["rank"]: row for row in est.details["pipeline_ranks"]}
    assert sorted(rows) == [0, 1]
    for rank, row in rows.items():
        traced = trace_pipeline_rank(cfg, PipeRank(pp, rank, "1f1b", 1, m, dp_shard=1, cp=cp, ep=ep), batch=3,
                                     seq=160, precision="mixed")
        for phase in PHASES:
            assert row["tensor_bytes"][phase] == pytest.approx(traced.phases[phase].peak_bytes, rel=0.002), \
                (rank, phase)
    with pytest.raises(InputError) as exc:
        pipeline_layout(setup.with_changes(parallel=Parallelism(gpus=4, pp=2, cp=2, strategy="ddp")))
    assert exc.value.field == "strategy"
    with pytest.raises(InputError) as exc:  # context, expert and tensor parallelism together: in stages, not traced
        pipeline_layout(setup.with_changes(parallel=Parallelism(gpus=8, pp=2, cp=2, ep=2, tp=2, strategy="fsdp2")))
    assert exc.value.field == "cp"
