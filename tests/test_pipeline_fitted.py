"""Pipeline stages of a family memcalc has no block model of (a mixture of experts): the fitted method fits each
checked rank's own step under the schedule, and ``--method trace`` traces the ranks (issue 17)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memcalc_gui.cli import main
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.fitted import FitModel, estimate_fitted, pipeline_microbatches, worth_calibrating
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


def test_each_fitted_rank_equals_its_schedule_traced_with_every_micro_batch() -> None:
    """Calibrated on 2- and 3-layer stages over pp + 1 micro-batches, evaluated on 4-layer stages (8 layers of the
    config) at a shape it never traced with all ``m`` micro-batches: the first, a middle and the last rank each equal
    PyTorch's 1F1B schedule traced on the fake process group. DDP adds its buckets, one gradient of the stage. (FSDP2's
    stages: the CLI test below.)"""
    pp, m, dp, strategy, precision = 4, 7, 2, "ddp", "mixed"
    setup = _setup(pp, m, dp, strategy, precision=precision)
    assert pipeline_microbatches(setup) == pp + 1 < m  # the untraced micro-batches are added by rule
    fit = fitmod.calibrate(MIXTRAL, setup, 1)
    assert sorted(fit.stages) == sorted({0, 1, pp - 1})
    assert all(f.num_layers == 8 // pp and max(f.checked[p] for p in PHASES) <= fitmod.TOLERANCE
               for f in fit.stages.values())
    est = estimate_fitted(setup, fit)
    rows = {row["rank"]: row for row in est.details["pipeline_ranks"]}
    assert est.details["pipeline_rank"] == max(rows, key=lambda r: rows[r]["peak_bytes"])
    for rank, row in rows.items():
        traced = trace_pipeline_rank(MIXTRAL, PipeRank(pp, rank, "1f1b", 1, m, dp_shard=dp if strategy == "fsdp2"
                                                       else 1), batch=3, seq=80, precision=precision,
                                     optimizer_impl="foreach")
        buckets = traced.phases["optimizer_step"].objects.get("gradients", 0) if strategy == "ddp" else 0
        for phase in ("forward", "backward", "optimizer_step"):
            assert row["phases"][phase] == pytest.approx(traced.phases[phase].peak_bytes + buckets, rel=0.002), \
                (rank, phase)
    # JSON keeps the stages; a cached fit reads back whole
    again = FitModel.from_json(json.loads(json.dumps(fit.to_json())))
    assert again == fit


def test_a_fitted_pipeline_says_what_it_cannot_fit() -> None:
    setup = _setup(2, 4, 2, "zero3")
    with pytest.raises(InputError) as err:
        fitmod.calibrate(MIXTRAL, setup, 1)
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


def test_the_cli_fits_and_traces_pipeline_ranks_of_a_mixture_of_experts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fitted default prints each checked stage and the most loaded one's ledger; ``--method trace`` traces each
    checked rank and reports the most loaded, which the fit equals (FSDP2 over each stage's two data-parallel GPUs,
    in both)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(MIXTRAL))
    args = ["estimate", "--config", str(config), "--gpus", "4", "--pp", "2", "--strategy", "fsdp2", "--grad-accum",
            "4", "--batch", "2", "--seq", "96", "--gpu", "rtx-4090", "--json"]
    assert main(args) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["method"] == "fitted"
    assert [r["rank"] for r in fitted["pipeline_ranks"]] == [0, 1]
    assert any("Pipeline rank" in a and "1f1b" in a for a in fitted["assumptions"])
    assert main([*args, "--method", "trace"]) == 0
    traced = json.loads(capsys.readouterr().out)
    assert any("most loaded of ranks 1, 2" in a for a in traced["assumptions"])
    for phase in PHASES:  # the trace rounds each allocation to 512 B; the fit does not
        want, got = (d["phases"][phase]["total_bytes"] for d in (traced, fitted))
        assert got == pytest.approx(want, rel=0.005), phase
    # pipeline parallelism beside expert parallelism is still refused, naming --pp
    with pytest.raises(SystemExit) as exit_:
        main([*args[:-1], "--ep", "2"])
    assert exit_.value.code == 2
    assert "--pp" in capsys.readouterr().err
