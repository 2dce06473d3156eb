"""Method ``fitted``: small fake-tensor traces turned into polynomials in micro-batch and sequence, extrapolated
over the layers — equal to the full trace and to real CPU steps, cached on disk, refused where it cannot hold."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from tiers import sample

from memcalc_gui.core.configfile import transformers_kwargs
from memcalc_gui.core.distributed import BF16_COMPUTE, STRATEGIES, Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.fitted import FitModel, estimate_fitted
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc_gui.trace import fit as fitmod
from memcalc_gui.trace.fake import trace_estimate
from memcalc_gui.trace.meta import count_params_on_meta

COMMON = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=1024, hidden_size=128,
              num_attention_heads=4, num_hidden_layers=6, max_position_embeddings=2048)
OPT = dict(COMMON, model_type="opt", ffn_dim=256, word_embed_proj_dim=128)
MIXTRAL = dict(COMMON, model_type="mixtral", intermediate_size=128, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2)


@pytest.fixture(scope="module")
def cache_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fits")


@pytest.fixture(autouse=True)
def private_cache(cache_folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEMCALC_CACHE_DIR", str(cache_folder))
    return cache_folder


@pytest.fixture()
def opt_fit() -> FitModel:
    """OPT's fit (calibrated once for the module: later calls read the cache)."""
    setup = _setup(OPT)
    return fitmod.calibrate(OPT, setup, setup.num_params)


def _setup(cfg: dict, **kw: object) -> TrainingSetup:
    base: dict = dict(params=count_params_on_meta(cfg), batch=2, seq=128, optimizer_impl="single-tensor",
                      cuda_context_bytes=0, allocator_reserve=0.0)
    base.update(kw)
    return TrainingSetup(**base)


@pytest.mark.parametrize(("cfg", "precision"), sample([(OPT, "mixed"), (MIXTRAL, "mixed")], (1,)),
                         ids=["opt", "mixtral"])
def test_fit_equals_the_full_trace_and_a_real_step(cfg: dict, precision: str) -> None:
    """Calibrated at 2 and 3 layers, evaluated at the config's 6, at shapes it never traced; MoE included (its
    experts kernel runs on fake fp32 tensors)."""
    from memcalc_gui.measure.cpu_step import measure_training_step

    setup = _setup(cfg, precision=precision)
    fit = fitmod.calibrate(cfg, setup, setup.num_params)
    assert max(fit.checked[p] for p in PHASES) <= fitmod.TOLERANCE
    for b, s, accum in ((1, 200, 1), (3, 700, 1), (2, 300, 3)):
        st = setup.with_changes(batch=b, seq=s, grad_accum=accum)
        fitted = estimate_fitted(st, fit)
        traced = trace_estimate(st, config=cfg).estimate
        for phase in PHASES:  # the trace adds CUDA's 512-byte rounding per allocation; the fit does not
            assert fitted.phases[phase].tensor_bytes == pytest.approx(traced.phases[phase].tensor_bytes, rel=0.02)
    real = measure_training_step(cfg, batch=2, seq=96, precision=precision, optimizer_impl="single-tensor")
    fitted = estimate_fitted(setup.with_changes(seq=96), fit)
    for phase in ("forward", "backward", "optimizer_step"):
        assert fitted.phases[phase].tensor_bytes == pytest.approx(real.phases[phase].peak_bytes, rel=0.005), phase


def test_a_fit_is_cached_and_a_broken_cache_is_recalibrated(private_cache: Path, opt_fit: FitModel,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    setup = _setup(OPT)
    first = opt_fit
    files = [f for f in private_cache.glob("*.json") if json.loads(f.read_text())["payload"]["model_type"] == "opt"]
    assert len(files) == 1
    real_trace = fitmod._trace

    def no_trace(*_a: object, **_k: object) -> None:
        raise AssertionError("a cached fit needs no trace")

    monkeypatch.setattr(fitmod, "_trace", no_trace)
    again = fitmod.calibrate(OPT, setup, setup.num_params)
    assert again.to_json() == first.to_json()
    files[0].write_text("{not json")
    monkeypatch.setattr(fitmod, "_trace", real_trace)
    fresh = fitmod.calibrate(OPT, setup, setup.num_params)
    assert json.loads(files[0].read_text())["payload"]["schema"] == fresh.to_json()["schema"]


def test_a_fit_read_once_is_kept_until_its_file_changes(private_cache: Path, opt_fit: FitModel,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout search asks for the same fits thousands of times: an unchanged file is parsed once, a file written
    again (a new calibration, or another process's) is read anew, a damaged one is not served from memory, and the
    number kept is bounded."""
    setup = _setup(OPT)
    model_type, kwargs = transformers_kwargs(OPT)
    path = private_cache / f"{fitmod._key({'model_type': model_type, **kwargs}, setup)}.json"
    assert path.is_file()
    fitmod._READ.clear()
    parsed: list[object] = []
    real_from_json = FitModel.from_json

    def counting(data: object) -> FitModel:
        parsed.append(data)
        return real_from_json(data)

    monkeypatch.setattr(fitmod.FitModel, "from_json", staticmethod(counting))
    first = fitmod.calibrate(OPT, setup, setup.num_params, cached_only=True)
    assert fitmod.calibrate(OPT, setup, setup.num_params, cached_only=True) is first
    assert len(parsed) == 1 and first == opt_fit
    data = opt_fit.to_json()
    data["checked"] = dict(data["checked"], forward=0.001)
    fitmod._write(path, data)  # written again (atomically, as a calibration writes it)
    changed = fitmod.calibrate(OPT, setup, setup.num_params, cached_only=True)
    assert len(parsed) == 2 and changed.checked["forward"] == 0.001
    path.write_text("{not json")
    with pytest.raises(fitmod.NotCalibrated):
        fitmod.calibrate(OPT, setup, setup.num_params, cached_only=True)
    fitmod._write(path, opt_fit.to_json())
    monkeypatch.setattr(fitmod, "READ_FITS", 2)
    for name in ("a", "b", "c"):
        copy = private_cache / f"copy-{name}.json"
        fitmod._write(copy, opt_fit.to_json())
        assert fitmod._cached(copy, True) == opt_fit
    assert len(fitmod._READ) == 2 and private_cache / "copy-a.json" not in fitmod._READ


def test_a_fits_shapes_are_evaluated_once_and_a_transform_cannot_change_them(opt_fit: FitModel) -> None:
    """:meth:`FitModel.peak` keeps each shape's extrapolated candidates (a layout search evaluates one fit at one shape
    under every layout's transform): a transform that edits the composition it is given changes that answer only, and
    a copy of the fit at another depth starts afresh."""
    fresh = FitModel.from_json(opt_fit.to_json())
    want = {p: fresh.peak(p, 3, 96, accumulating=True) for p in PHASES}

    def doubling(phase: str, comp: dict[str, float]) -> dict[str, float]:
        for obj in comp:
            comp[obj] *= 2  # in place
        return comp

    for p in PHASES:
        doubled = fresh.peak(p, 3, 96, accumulating=True, transform=doubling)
        assert set(doubled) == set(want[p]) and all(abs(doubled[o] - 2 * v) <= 1 for o, v in want[p].items()), p
        assert fresh.peak(p, 3, 96, accumulating=True) == want[p], p
    deeper = dataclasses.replace(fresh, num_layers=fresh.num_layers * 2)
    other = FitModel.from_json(dict(opt_fit.to_json(), num_layers=fresh.num_layers * 2))
    for p in ("forward", "backward"):
        assert deeper.peak(p, 3, 96) == other.peak(p, 3, 96) != fresh.peak(p, 3, 96), p


def test_a_refused_fit_is_remembered_and_a_broken_record_of_it_is_not(private_cache: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal costs the traces before it (seconds): the next run of the same config and setup answers with the
    same reason at once, while another setup, or a damaged record, calibrates as before."""
    calls: list[str] = []

    def refusing(cfg, setup, *_a, **_k):  # type: ignore[no-untyped-def]
        calls.append(setup.checkpointing)
        raise fitmod.FitError("the layers do not repeat alike")

    monkeypatch.setattr(fitmod, "_calibrate", refusing)
    setup = _setup(OPT, precision="fp32", checkpointing="every:2")
    for _ in range(2):
        with pytest.raises(fitmod.FitError, match="do not repeat alike"):
            fitmod.calibrate(OPT, setup, setup.num_params)
    assert calls == ["every:2"]
    with pytest.raises(fitmod.FitError):
        fitmod.calibrate(OPT, setup.with_changes(checkpointing="full"), setup.num_params)
    assert calls == ["every:2", "full"]
    records = sorted(private_cache.glob("*.refused"))
    assert len(records) == 2
    for record in records:
        record.write_text("{not json")
    with pytest.raises(fitmod.FitError):
        fitmod.calibrate(OPT, setup, setup.num_params)
    assert calls == ["every:2", "full", "every:2"]
    with pytest.raises(fitmod.FitError, match="not calibrated yet"):  # nothing recorded: no trace either
        fitmod.calibrate(OPT, setup.with_changes(checkpointing="selective"), setup.num_params, cached_only=True)


def test_json_round_trip_and_refusals(opt_fit: FitModel) -> None:
    setup = _setup(OPT)
    fit = opt_fit
    assert FitModel.from_json(json.loads(json.dumps(fit.to_json()))) == fit
    for bad in ({}, {"schema": 999}, dict(fit.to_json(), moments={"forward": [[{"activations": [1, 2]}]]}), [1]):
        with pytest.raises(ValueError):
            FitModel.from_json(bad)
    with pytest.raises(InputError, match="calibration"):  # another signature needs its own fit
        estimate_fitted(setup.with_changes(checkpointing="full"), fit)
    stale = FitModel.from_json(dict(fit.to_json(), structure={}))
    with pytest.raises(InputError, match="calibrate again"):
        estimate_fitted(setup.with_changes(parallel=Parallelism(gpus=2, strategy="zero3")), stale)
    shallow = dict(OPT, num_hidden_layers=1)
    with pytest.raises(fitmod.FitError, match="layers"):
        fitmod.calibrate(shallow, _setup(shallow), 10)


def test_over_capacity_the_fitted_verdict_searches_what_it_can(opt_fit: FitModel) -> None:
    """The search over every lever meets changes the fit cannot estimate (checkpointing, precision, 8-bit Adam):
    it leaves them out instead of failing, and keeps the micro-batch changes."""
    from memcalc_gui.core.fitted import evaluate_fitted

    setup = _setup(OPT, batch=8, seq=512)
    peak = estimate_fitted(setup, opt_fit).peak_bytes
    result = evaluate_fitted(setup.with_changes(capacity_bytes=peak * 2 // 3), opt_fit)
    assert result.verdict.fits is False and 0 < result.verdict.max_micro_batch < 8
    keys = {k for s in result.verdict.suggestions for k in s.changes}
    assert {"batch", "grad_accum"} <= keys <= {"batch", "grad_accum", "strategy", "offload", "gpus"}
    # what it left out is said, not dropped: those changes need a calibration of their own
    from memcalc_gui.view.plan_text import suggestions_note

    pending = result.verdict.uncalibrated
    assert any("8-bit" in t for t in pending) and any("checkpointing" in t.lower() for t in pending)
    assert not {t for t in pending} & {s.title for s in result.verdict.suggestions}
    note = suggestions_note(result)
    assert note.startswith("Not weighed yet: " + pending[0][0].lower() + pending[0][1:])
    assert f"and {len(pending) - 3} more" in note and "calibration of its own" in note
    assert result.to_json()["uncalibrated_changes"] == list(pending)
    # with nothing calibrated that helps, the note no longer claims that no change the calculator knows would
    bare = dataclasses.replace(result, verdict=dataclasses.replace(result.verdict, suggestions=()))
    assert suggestions_note(bare).startswith("No calibrated change lowers the peak enough. Not weighed yet: ")
    analytic_none = dataclasses.replace(bare, verdict=dataclasses.replace(bare.verdict, uncalibrated=()))
    assert "a smaller model" in suggestions_note(analytic_none)


LLAMA = dict(COMMON, model_type="llama", intermediate_size=344, num_key_value_heads=2)


@pytest.mark.full_suite
@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s not in BF16_COMPUTE])
def test_the_per_gpu_fitted_ledger_equals_the_analytic_one(strategy: str) -> None:
    """A family with both methods: the fitted single-replica trace made per-GPU (model states replaced by the
    strategy's, as ``analytic.per_gpu_ledger`` does) agrees with the analytic per-GPU ledger phase by phase, with and
    without checkpointing — the sharding rules are shared, the traced moments are the analytic ones."""
    from memcalc_gui.core.analytic import estimate_analytic
    from memcalc_gui.core.model import spec_from_config

    spec = spec_from_config(LLAMA)
    offload = "both" if strategy in ("zero3", "fsdp-full-shard") else "none"
    for ckpt in ("none", "full"):
        single = TrainingSetup(model=spec, batch=2, seq=128, optimizer_impl="single-tensor", checkpointing=ckpt,
                               cuda_context_bytes=0, allocator_reserve=0.0)
        fit = fitmod.calibrate(LLAMA, single, spec.num_params)
        assert fit.structure["layer_params"] == spec.layer_params
        assert fit.structure["largest_module"] == spec.largest_module_params
        assert fit.structure["root_unit"] == spec.root_unit_params
        for gpus, off in ((4, "none"), (8, offload)):
            setup = single.with_changes(batch=3, seq=200, parallel=Parallelism(gpus=gpus, strategy=strategy,
                                                                               offload=off))  # type: ignore[arg-type]
            fitted, analytic = estimate_fitted(setup, fit), estimate_analytic(setup)
            for phase in PHASES:
                want = analytic.phases[phase].total_bytes
                assert fitted.phases[phase].total_bytes == pytest.approx(want, rel=0.03), (ckpt, gpus, phase)
            assert fitted.details["host_bytes"] == pytest.approx(analytic.details["host_bytes"], rel=1e-3)


@pytest.mark.full_suite
@pytest.mark.parametrize("strategy", BF16_COMPUTE)
def test_the_fitted_bf16_compute_budget_follows_the_moment_walk(strategy: str) -> None:
    """FSDP2's analytic ledger goes moment by moment (checked against real gloo steps) and computes in bf16 under
    mixed precision, as Megatron-LM's bf16 model does. The fitted method calibrates that bf16 step too
    (``fitted.traced_precision``) and puts the per-GPU states on it by rule: within 1.5 % of the moment walk (it was
    a third over when it calibrated the autocast step). (FSDP2's own layout is fitted on its traced rank too; the
    rule answers the what-ifs and the GPU plan's other layouts, and is what this checks: ``rank=False``.)"""
    from memcalc_gui.core.analytic import estimate_analytic
    from memcalc_gui.core.model import spec_from_config

    spec = spec_from_config(LLAMA)
    single = TrainingSetup(model=spec, batch=2, seq=128, optimizer_impl="single-tensor", cuda_context_bytes=0,
                           allocator_reserve=0.0)
    setup = single.with_changes(batch=3, seq=200, parallel=Parallelism(gpus=4, strategy=strategy))  # type: ignore
    fit = fitmod.calibrate(LLAMA, setup, spec.num_params, rank=False)
    assert fit.signature["precision"] == "bf16" and fit.rank is None
    fitted, analytic = estimate_fitted(setup, fit), estimate_analytic(setup)
    for phase in ("forward", "backward", "optimizer_step"):
        want = analytic.phases[phase].total_bytes
        assert fitted.phases[phase].total_bytes == pytest.approx(want, rel=0.015), phase


def test_moe_structure_and_per_gpu_state() -> None:
    """A mixture of experts: the routed experts counted apart, ZeRO-3 gathering the largest module (the fused
    experts) and sharding the rest over the GPUs."""
    setup = _setup(MIXTRAL)
    fit = fitmod.calibrate(MIXTRAL, setup, setup.num_params)
    st = fit.structure
    assert st["num_experts"] == 4 and 0 < st["expert_params"] < st["num_params"]
    assert st["active_params"] == st["num_params"] - st["expert_params"] // 2
    one = estimate_fitted(setup, fit)
    eight = estimate_fitted(setup.with_changes(parallel=Parallelism(gpus=8, strategy="zero3")), fit)
    assert eight.phases["optimizer_step"].objects["optimizer_state"] == pytest.approx(
        one.phases["optimizer_step"].objects["optimizer_state"] / 8, abs=8)
    assert eight.phases["forward"].objects["activations"] == one.phases["forward"].objects["activations"]
    assert any("603" not in a and "largest unit" in a for a in eight.assumptions)


def test_expert_parallelism_splits_the_routed_experts() -> None:
    """--ep N: under DDP each GPU keeps the dense part and 1/N of the routed experts (weights, gradients, Adam
    state, all in proportion), plus one MoE layer's all-to-all buffers in forward and backward; under ZeRO-3 over
    the same GPUs the state is sharded 8 ways either way. Expert counts that do not split are refused."""
    from memcalc_gui.core.distributed import expert_parallel_states

    setup = _setup(MIXTRAL, batch=2, seq=64)
    fit = fitmod.calibrate(MIXTRAL, setup, setup.num_params)
    st = fit.structure
    one = estimate_fitted(setup, fit)
    ddp = estimate_fitted(setup.with_changes(parallel=Parallelism(gpus=4, ep=4)), fit)
    keep = (st["num_params"] - st["expert_params"] * 3 / 4) / st["num_params"]
    load = one.phases["load"].objects["parameters"]
    assert ddp.phases["load"].objects["parameters"] == pytest.approx(load * keep, rel=1e-3)
    state = one.phases["optimizer_step"].objects["optimizer_state"]
    assert ddp.phases["optimizer_step"].objects["optimizer_state"] == pytest.approx(state * keep, rel=1e-3)
    buffers = 2 * 2 * 64 * st["top_k"] * st["hidden_size"] * 2  # dispatch + combine, bf16 under mixed precision
    assert ddp.phases["forward"].objects["temporaries"] >= buffers
    assert any("balanced routing" in a for a in ddp.assumptions)
    with pytest.raises(InputError, match="do not split evenly"):
        estimate_fitted(setup.with_changes(parallel=Parallelism(gpus=8, ep=8)), fit)  # 4 experts per layer
    # the states themselves: ZeRO-3 with EP over all GPUs shards everything as often as without it
    par = Parallelism(gpus=8, strategy="zero3", ep=4)
    psi, experts = 10_000_000, 8_000_000
    with_ep = expert_parallel_states(par, psi, experts, 1000, 4000, "mixed", 8 * psi, 0, 0, 500)
    assert with_ep.optimizer_state == pytest.approx(psi, rel=1e-6)
    assert with_ep.parameters["optimizer_step"] == pytest.approx(6 * psi / 8, rel=1e-6)
    with pytest.raises(InputError, match="ep"):
        Parallelism(gpus=6, ep=4)


GPT_OSS = dict(COMMON, model_type="gpt_oss", intermediate_size=128, num_key_value_heads=2, head_dim=32,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
               layer_types=["sliding_attention", "full_attention"] * 3)
DEEPSEEK = dict(COMMON, model_type="deepseek_v3", intermediate_size=256, moe_intermediate_size=64,
                num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16,
                v_head_dim=16, n_group=1, topk_group=1, num_hidden_layers=7)


@pytest.mark.full_suite
@pytest.mark.parametrize(("cfg", "layers"), [(GPT_OSS, (2, 3)), (DEEPSEEK, (3, 4))], ids=["gpt-oss", "deepseek-v3"])
def test_layer_patterns_and_dense_prefixes_fit(cfg: dict, layers: tuple[int, int]) -> None:
    """gpt-oss lists a sliding/full pattern per layer (cut to the traced count); DeepSeek-V3's first layers are
    dense (traced past them): both fit, equal to the full trace."""
    setup = _setup(cfg, attention="eager", batch=2, seq=64)
    fit = fitmod.calibrate(cfg, setup, setup.num_params)
    assert fit.layers == layers
    st = setup.with_changes(batch=3, seq=96)
    traced = trace_estimate(st, config=cfg).estimate
    fitted = estimate_fitted(st, fit)
    for phase in PHASES:
        assert fitted.phases[phase].tensor_bytes == pytest.approx(traced.phases[phase].tensor_bytes, rel=0.005)



@pytest.mark.full_suite
def test_checkpointing_every_nth_layer_is_fitted_over_whole_periods() -> None:
    """torchtitan's every-N-th-layer checkpointing repeats every N layers: the fit traces counts N apart, with the
    config's remainder (its last layers unchecked as the config's are), and equals the full trace. Counts one
    layer apart could not line the layers up, so the fitted method refused every:N (across GPUs an error)."""
    cfg = dict(OPT, num_hidden_layers=7)
    setup = _setup(cfg, checkpointing="every:3")  # layers 3 and 6 of 7 checkpointed
    fit = fitmod.calibrate(cfg, setup, setup.num_params)
    assert fit.layers == (4, 7)
    for b, s, accum in ((1, 200, 1), (2, 100, 3)):
        st = setup.with_changes(batch=b, seq=s, grad_accum=accum)
        fitted = estimate_fitted(st, fit)
        traced = trace_estimate(st, config=cfg).estimate
        for phase in PHASES:
            assert fitted.phases[phase].tensor_bytes == pytest.approx(traced.phases[phase].tensor_bytes, rel=0.005)


@pytest.mark.parametrize(("layers", "skip", "every", "counts"), [
    (48, 0, None, ((2, 3), 4)), (48, 0, 1, ((2, 3), 4)), (61, 3, None, ((5, 6), 7)),
    (48, 0, 2, ((2, 4), 6)), (47, 0, 2, ((3, 5), 7)), (7, 0, 3, ((4, 7), 10)),
    (6, 1, 3, ((6, 9), 12)),  # past a dense layer the shorter trace still holds a whole period
    (61, 3, 4, ((9, 13), 17)),
])
def test_the_layer_counts_a_fit_traces(layers: int, skip: int, every: int | None,
                                       counts: tuple[tuple[int, int], int]) -> None:
    assert fitmod.layer_counts(layers, skip, every) == counts
    (low, high), check = counts
    period = every or 1
    assert high - low == period and (layers - low) % period == 0 and low - skip >= period
    assert check == high + period


def test_a_fit_that_would_trace_too_deep_or_past_the_config_is_refused() -> None:
    with pytest.raises(fitmod.FitError, match="from 7 layers"):
        fitmod.layer_counts(6, 3, 4)
    with pytest.raises(fitmod.FitError, match=r"one layer in 10 .* would trace 38 layers"):
        fitmod.layer_counts(48, 0, 10)


@pytest.mark.full_suite
def test_the_autocast_fit_stands_in_for_a_bf16_strategy_as_a_bound() -> None:
    """A what-if to FSDP2 before its bf16 step is calibrated (the window's GPU plan): the autocast calibration
    stands in, says it is an upper bound, and is one."""
    from memcalc_gui.core.model import spec_from_config

    spec = spec_from_config(LLAMA)
    single = TrainingSetup(model=spec, batch=2, seq=128, cuda_context_bytes=0, allocator_reserve=0.0)
    autocast = fitmod.calibrate(LLAMA, single, spec.num_params)
    sharded = single.with_changes(parallel=Parallelism(gpus=4, strategy="fsdp2"))
    stand_in = estimate_fitted(sharded, autocast)
    assert any("upper bound" in n for n in stand_in.details["parallel_notes"])
    own = estimate_fitted(sharded, fitmod.calibrate(LLAMA, sharded, spec.num_params, rank=False))  # the rule's
    assert not any("upper bound" in n for n in own.details["parallel_notes"])
    for phase in ("forward", "backward"):
        assert stand_in.phases[phase].tensor_bytes >= own.phases[phase].tensor_bytes
    with pytest.raises(InputError):  # a bf16 fit never stands in for the autocast step (it would be under)
        estimate_fitted(single.with_changes(parallel=Parallelism(gpus=4, strategy="zero2")),
                        fitmod.calibrate(LLAMA, sharded, spec.num_params, rank=False))
    # the layout search over the autocast fit alone: the bf16 strategies' peaks are marked as bounds, the tensor-
    # parallel layouts (no fit) left out as waiting for one
    from memcalc_gui.core.fitted import NOT_CALIBRATED, search_layouts, signature

    found = search_layouts(sharded, autocast, lambda s: autocast if signature(s) == autocast.signature else None)
    assert {lay.parallel.strategy for lay in found if lay.upper_bound} == {"fsdp2", "megatron", "megatron-distopt"}
    assert all(lay.parallel.tp == 1 for lay in found)
    waiting = [par for reason, pars in found.left_out.items() if NOT_CALIBRATED in reason for par in pars]
    assert sorted({par.tp for par in waiting if par.pp == 1}) == [2]  # tp 4 would split 2 key/value heads
    # pipeline layouts wait for their own calibration (no autocast bound stands in for a stage's schedule): 2 stages
    # of the 6 layers, not 4
    assert {par.pp for par in waiting} == {1, 2}


@pytest.mark.full_suite
@pytest.mark.parametrize(("cfg", "layout", "ckpt"), [(OPT, None, "full"), (MIXTRAL, {"dp_shard": 2, "tp": 2}, "none")],
                         ids=["opt-one-gpu", "mixtral-fsdp2-tp"])
def test_a_calibration_traces_one_micro_batch_in_its_first_iteration_and_the_same_steady_one(
        cfg: dict, layout: dict | None, ckpt: str) -> None:
    """The calibration's first iteration runs one micro-batch (it only makes the optimizer's state and what the step
    creates lazily): the second iteration, which the fit reads, is the same to the byte as after a whole first one."""
    from memcalc_gui.measure.cpu_step import measure_training_step
    from memcalc_gui.trace.ranks import RankLayout, trace_rank

    assert fitmod.WARMUP_MICRO_BATCHES == 1
    small = dict(cfg, num_hidden_layers=2)
    step = dict(batch=2, seq=64, precision="mixed", optimizer_impl="foreach", checkpointing=ckpt, grad_accum=2,
                iterations=2, fake=True, keep_tracker=True)

    def run(**kw: object) -> object:
        if layout is None:
            return measure_training_step(small, **step, **kw)  # type: ignore[arg-type]
        return trace_rank(small, RankLayout(**layout), **step, **kw)

    whole, warm = run(), run(warmup_micro_batches=1)
    windows = warm.tracker.windows()  # type: ignore[attr-defined]
    assert ("forward", 1, 0) in windows and ("forward", 1, 1) not in windows and ("forward", 2, 1) in windows
    assert len(warm.tracker.events) < 0.85 * len(whole.tracker.events)  # type: ignore[attr-defined]
    for phase in PHASES:
        assert warm.phases[phase].peak_bytes == whole.phases[phase].peak_bytes, phase  # type: ignore[attr-defined]
        assert warm.phases[phase].objects == whole.phases[phase].objects, phase  # type: ignore[attr-defined]
        assert warm.phases[phase].live_bytes == whole.phases[phase].live_bytes, phase  # type: ignore[attr-defined]


def test_a_layer_pattern_repeats_past_the_layers_it_names() -> None:
    """A calibration traces more layers than a shallow config has: a 2-layer gpt-oss is fitted from 3 and 4 layers,
    and transformers checks ``layer_types`` against the count (issue 62: an internal error). The pattern repeats, as
    gpt-oss's and Gemma 3's own defaults repeat theirs; a deeper one is cut as before."""
    from memcalc_gui.core.configfile import with_layers

    two = dict(GPT_OSS, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    assert with_layers(two, 5)["layer_types"] == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    assert with_layers(GPT_OSS, 3)["layer_types"] == GPT_OSS["layer_types"][:3]
    assert with_layers(dict(GPT_OSS, layer_types=[]), 3)["layer_types"] == []


@pytest.mark.full_suite
def test_a_two_layer_gpt_oss_is_estimated(tmp_path, capsys) -> None:
    """The issue's reproducer through the CLI: a 2-layer gpt-oss config answers with the fitted method, within the fit's
    tolerance of the full trace."""
    from memcalc_gui.cli import main

    cfg = tmp_path / "gpt-oss-2.json"
    cfg.write_text(json.dumps(dict(GPT_OSS, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])))
    peaks = {}
    for method in ("fitted", "trace"):
        assert main(["estimate", "--config", str(cfg), "--attention", "eager", "--batch", "2", "--seq", "64",
                     "--method", method, "--json"]) == 0
        peaks[method] = json.loads(capsys.readouterr().out)["peak_tensor_bytes"]
    assert peaks["fitted"] == pytest.approx(peaks["trace"], rel=0.005)
