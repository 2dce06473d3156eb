"""The layout search (issue 17): every split of a GPU count over tensor, pipeline and data parallelism, each with its
most loaded GPU's peak from the one estimator, ranked by fit, a stated step-time model and headroom."""

from __future__ import annotations

import dataclasses
import json

import pytest

from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.layouts import candidates, communication, search
from memcalc_gui.core.model import preset_spec
from memcalc_gui.core.setup import TrainingSetup, find_gpu

H100 = find_gpu("h100-80gb").capacity_bytes


def _setup(gpus: int = 64, **kw: object) -> TrainingSetup:
    return TrainingSetup(model=preset_spec("llama-3.1-70b"), seq=8192, grad_accum=8, capacity_bytes=H100,
                         gpu="h100-80gb", parallel=Parallelism(gpus=gpus), **kw)  # type: ignore[arg-type]


def test_candidates_split_the_gpus_and_the_model() -> None:
    setup = _setup()
    spec = setup.model
    assert spec is not None
    found = candidates(setup)
    assert found and len({(p.tp, p.pp, p.strategy, p.dp_replicate) for p in found}) == len(found)
    for p in found:
        assert p.gpus == 64 and p.tp * p.pp * p.dp == 64 and p.tp <= p.node_size
        assert spec.num_layers % p.pp == 0 and spec.num_kv_heads % p.tp == 0
        assert p.sp == p.loss_parallel == (p.tp > 1)


def test_layouts_come_ranked_and_their_peaks_are_the_estimators() -> None:
    setup = _setup()
    layouts = search(setup, estimate, min_gpus_for=3)
    fits = [lay.fits for lay in layouts]
    assert fits == sorted(fits, reverse=True)  # every layout that fits before any that does not
    fitting = [lay for lay in layouts if lay.fits]
    assert fitting, "a 70B model fits 64 H100s in some layout"
    times = [lay.seconds_per_token for lay in fitting]
    assert times == sorted(times)
    # speed is relative to the fastest layout that fits; one that does not fit is in parentheses (it does not run)
    assert layouts.speed_text(fitting[0]) == "100%"
    assert all(not layouts.speed_text(lay).startswith("(") for lay in fitting)
    over = [lay for lay in layouts if lay.fits is False]
    assert over and all(layouts.speed_text(lay).startswith("(") and layouts.speed_text(lay).endswith("%)")
                        for lay in over)
    assert any(lay.seconds_per_token < fitting[0].seconds_per_token for lay in over)  # faster, were it to fit
    for lay in layouts[:5]:
        assert lay.peak_bytes == estimate(setup.with_changes(parallel=lay.parallel)).peak_bytes
    for lay in layouts[:3]:  # the fewest GPUs of that shape fit, one group fewer does not
        group = lay.parallel.tp * lay.parallel.pp
        assert lay.min_gpus_searched and lay.min_gpus is not None and lay.min_gpus % group == 0
        at_min = estimate(setup.with_changes(parallel=Parallelism(**{**_fields(lay.parallel), "gpus": lay.min_gpus})))
        assert at_min.peak_bytes <= H100
        if lay.min_gpus > 2 * group:
            fewer = Parallelism(**{**_fields(lay.parallel), "gpus": lay.min_gpus - group})
            assert estimate(setup.with_changes(parallel=fewer)).peak_bytes > H100


def _fields(p: Parallelism) -> dict:
    import dataclasses

    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}


def test_the_step_model_charges_the_bubble_and_the_network() -> None:
    setup = _setup()
    few = setup.with_changes(grad_accum=2)
    pipe = Parallelism(gpus=64, tp=8, pp=8, sp=True, loss_parallel=True)
    _, bubble_few, slow = communication(few.with_changes(parallel=pipe), pipe)
    _, bubble_many, fast = communication(setup.with_changes(parallel=pipe), pipe)
    assert bubble_few > bubble_many and slow > fast  # more micro-batches hide the bubble
    across = Parallelism(gpus=64, tp=8, sp=True, loss_parallel=True, strategy="zero1")  # 8 nodes of 8
    within = Parallelism(gpus=64, tp=8, sp=True, loss_parallel=True, strategy="zero1", node_size=64)
    assert communication(setup, within)[0] == communication(setup, across)[0]  # the same bytes, a faster link
    assert communication(setup, within)[2] < communication(setup, across)[2]
    assert communication(setup, Parallelism(gpus=64, strategy="fsdp2"))[0] > \
        communication(setup, Parallelism(gpus=64, strategy="zero1"))[0]  # FSDP gathers the weights again


def test_the_layouts_command_prints_a_ranked_table_and_json(capsys: pytest.CaptureFixture) -> None:
    args = ["layouts", "--preset", "llama-3.1-70b", "--seq", "8192", "--gpus", "64", "--gpu", "h100-80gb",
            "--grad-accum", "8", "--top", "5"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "layouts of 64 GPUs" in out and "TP 8 + SP + loss parallel" in out and "… " in out
    assert cli_main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["layouts"]) == 5 and data["count"] > 5
    assert data["layouts"][0]["fits"] is True and data["layouts"][0]["min_gpus"] >= 8


def test_bad_layout_input_exits_2_naming_the_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["layouts", "--preset", "llama-3.1-70b", "--gpus", "64", "--top", "many"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--top" in err[0]


def test_one_group_without_replicas_counts_as_the_fewest_gpus() -> None:
    """DDP on one tp × pp group has no gradient buckets (nothing to all-reduce); from two replicas on it has. The GPU
    plan and the layout search both answer the one group where it fits, not "never"."""
    from memcalc_gui.core.solver import gpu_plan

    par = Parallelism(gpus=64, tp=8, pp=8, sp=True, loss_parallel=True)
    # 8,704 tokens: the one group fits with 2.7 GB to spare, two replicas' buckets (5.3 GB) are 2.5 GB over
    setup = _setup().with_changes(seq=8704, parallel=par)
    assert estimate(setup).peak_bytes <= H100
    assert estimate(setup.with_changes(parallel=Parallelism(gpus=128, tp=8, pp=8, sp=True,
                                                            loss_parallel=True))).peak_bytes > H100
    plan = gpu_plan(setup, estimate)
    assert plan is not None and plan.min_gpus["ddp"] == 64
    ddp = next(lay for lay in search(setup, estimate, min_gpus_for=200)
               if (lay.parallel.tp, lay.parallel.pp, lay.parallel.strategy) == (8, 8, "ddp"))
    assert ddp.min_gpus == 64


def test_expert_parallelism_trades_gradient_traffic_for_the_all_to_all() -> None:
    """Mixtral-8x7B's shape over 64 GPUs: with its experts split 8 ways, each GPU reduces the dense gradients over
    all 64 and its eighth of the experts' over the 8 GPUs that share them, and sends every token's top-2 hidden
    states out and back in each MoE layer's all-to-all, forward and backward; the compute counts the active
    parameters. The candidates are the degrees that split the experts and the data-parallel GPUs."""
    from dataclasses import replace

    from memcalc_gui.core.layouts import ModelShape

    n, experts, active, hidden, layers = 46_702_792_704, 45_097_156_608, 12_879_925_248, 4096, 32
    shape = ModelShape(n, hidden, layers, num_experts=8, block_model=False, expert_params=experts,
                       top_k=2, active_params=active)
    setup = TrainingSetup(params=n, batch=1, seq=4096, grad_accum=8, precision="mixed")
    zero2 = Parallelism(gpus=64, strategy="zero2")
    ring64, ring8 = 2 * 63 / 64, 2 * 7 / 8
    sent, _, per_token = communication(setup, zero2, shape)
    assert sent == int(ring64 * n * 4)
    split, _, split_per_token = communication(setup, replace(zero2, ep=8), shape)
    tokens_hidden = 4096 * hidden * 2  # one micro-batch's bf16 hidden states
    assert split == pytest.approx(ring64 * (n - experts) * 4 + ring8 * experts // 8 * 4
                                  + 4 * 7 / 8 * 2 * layers * tokens_hidden * 8, rel=1e-9)
    assert split < sent / 3
    compute = 6 * active * 4096 * 8 * 64 / (64 * 400e12) / (4096 * 8 * 64)
    assert per_token > compute and split_per_token > compute
    eps = {p.ep for p in candidates(setup.with_changes(parallel=zero2), shape=shape)}
    assert eps == {1, 2, 4, 8}  # 16 and more do not split 8 experts
    # beside tensor parallelism the experts split over multiples of tp (transformers' layout), and run whole: the
    # all-to-all carries each GPU's share of its tensor-parallel group's tokens
    found = candidates(setup.with_changes(parallel=zero2), shape=shape)
    assert {(p.tp, p.ep) for p in found if p.tp == 2 and p.pp == 1} == {(2, 1), (2, 2), (2, 4), (2, 8)}
    assert all(p.ep == 1 for p in found if p.pp > 1 and p.tp > 1)
    tp2 = replace(zero2, tp=2, ep=8)
    tp_sent = communication(setup, tp2, shape)[0]
    dense = 2 * 31 / 32 * ((n - experts) // 2) * 4  # over the 32 data-parallel GPUs, a half of it each
    tensor = 1 * 4 * layers * tokens_hidden * 8  # the tensor-parallel all-reduces (ring of 2)
    expert = ring8 * (experts // 8) * 4  # an eighth of the experts, whole, over the 8 GPUs holding the same
    all_to_all = 4 * 7 / 8 * 2 * layers * tokens_hidden / 2 * 8  # half the tokens each
    assert tp_sent == pytest.approx(dense + tensor + expert + all_to_all, rel=1e-9)


def test_megatron_layouts_split_each_expert_within_a_node_and_pay_for_it_on_nvlink() -> None:
    """Megatron-LM's expert tensor parallelism in the search (Mixtral-8x7B's shape over 64 GPUs): each expert split
    over 2, 4 or 8 GPUs of a node beside every expert-parallel degree, ep × etp dividing a stage's data- and
    tensor-parallel GPUs, under Megatron-LM's strategies only and for a mixture of experts only. Its traffic: the
    experts' gradients over the dp·tp/(ep·etp) GPUs holding the same slice, and the etp group's all-gather and
    reduce-scatter of its routed tokens, forward and backward, within a node; the ep GPUs of an all-to-all are then
    etp apart."""
    from dataclasses import replace

    from memcalc_gui.core.layouts import ModelShape

    n, experts, active, hidden, layers = 46_702_792_704, 45_097_156_608, 12_879_925_248, 4096, 32
    shape = ModelShape(n, hidden, layers, num_experts=8, block_model=False, expert_params=experts,
                       top_k=2, active_params=active)
    setup = TrainingSetup(params=n, batch=1, seq=4096, grad_accum=8, precision="mixed",
                          parallel=Parallelism(gpus=64, strategy="megatron-distopt"))
    found = candidates(setup, shape=shape)
    split = [p for p in found if p.etp > 1]
    assert {p.strategy for p in split} == {"megatron", "megatron-distopt"}
    assert {p.etp for p in split} == {2, 4, 8}
    assert all((p.dp * p.tp) % (p.ep * p.etp) == 0 for p in split)
    assert {(p.ep, p.etp) for p in split if p.tp == 1 and p.pp == 1} == \
        {(ep, etp) for ep in (1, 2, 4, 8) for etp in (2, 4, 8)}
    # a node of 4 GPUs: no expert split over 8; a dense model: none at all
    narrow = candidates(setup.with_changes(parallel=replace(setup.parallel, node_size=4)), shape=shape)
    assert {p.etp for p in narrow} == {1, 2, 4}
    assert all(p.etp == 1 for p in candidates(setup, shape=replace(shape, num_experts=0, expert_params=0, top_k=0)))

    base = Parallelism(gpus=64, strategy="megatron-distopt", ep=4)
    whole = communication(setup, base, shape)
    both = communication(setup, replace(base, etp=2), shape)
    tokens_hidden = 4096 * hidden * 2  # one micro-batch's bf16 hidden states
    ring16, ring8 = 2 * 15 / 16, 2 * 7 / 8
    gathers = 4 * 1 * 2 * layers * tokens_hidden * 8  # (etp − 1) shares, top-2, every layer, 8 micro-batches
    fewer_grads = ring16 * (experts // 4) * 4 - ring8 * (experts // 8) * 4  # over 8 copies of half the slice
    assert both[0] == pytest.approx(whole[0] + gathers - fewer_grads, rel=1e-9)
    # ep × etp = 8 GPUs: the all-to-all and the gathers stay in the node, and the gathers on NVLink cost less than
    # the gradients they save on the network
    assert both[2] < whole[2]
    # 8 × 2 spans two nodes (etp innermost, as Megatron-Core orders the ranks): the all-to-all leaves the node
    wide = communication(setup, replace(base, ep=8, etp=2), shape)
    assert wide[2] > communication(setup, replace(base, ep=8), shape)[2]


def test_fsdp2_over_one_data_parallel_gpu_is_refused_and_never_offered(capsys: pytest.CaptureFixture) -> None:
    """FSDP2 whose group (data × context parallel) is one GPU shards nothing, and torchtitan applies no fully_shard
    there: a tensor- or pipeline-parallel layout like that is refused naming the strategy (the ledger took FSDP2's
    bf16 policy and read 8 % under the trace, which runs the stage as DDP's), the layout search lists no such rows
    beside their DDP twins, and a DDP pipeline is not told to "shard" over one GPU."""
    for kw in (dict(gpus=2, pp=2), dict(gpus=8, tp=8), dict(gpus=16, tp=8, pp=2)):
        with pytest.raises(InputError) as err:
            Parallelism(strategy="fsdp2", **kw)  # type: ignore[arg-type]
        assert err.value.field == "strategy" and "shards nothing" in str(err.value)
    # one GPU (fully_shard there is a user's choice, with offload), context parallelism and two GPUs per stage shard
    for kw in (dict(gpus=1), dict(gpus=1, offload="optimizer"), dict(gpus=4, pp=2, cp=2), dict(gpus=4, pp=2)):
        Parallelism(strategy="fsdp2", **kw)  # type: ignore[arg-type]
    setup = TrainingSetup(model=preset_spec("llama-3.2-1b"), seq=2048, parallel=Parallelism(gpus=4))
    found = candidates(setup)
    assert any(p.strategy == "fsdp2" and p.dp > 1 for p in found)
    assert not [p for p in found if p.strategy == "fsdp2" and p.dp * p.cp == 1]
    assert any(p.strategy == "ddp" and p.dp == 1 for p in found)  # their twins stay
    assert cli_main(["estimate", "--preset", "llama-3.2-1b", "--seq", "2048", "--gpus", "2", "--pp", "2"]) == 0
    assert "FSDP2" not in capsys.readouterr().out.split("What would change it", 1)[1].split("Assumptions", 1)[0]
    with pytest.raises(SystemExit) as exit_:
        cli_main(["estimate", "--preset", "llama-3.2-1b", "--gpus", "2", "--pp", "2", "--strategy", "fsdp2"])
    assert exit_.value.code == 2
    err_line = capsys.readouterr().err.strip()
    assert err_line.startswith("memcalc: error: --strategy:") and len(err_line.splitlines()) == 1


def test_a_family_without_a_block_model_is_offered_sequence_parallelism_where_its_traced_rank_runs_it() -> None:
    """torchtitan's sequence-parallel plan on a traced rank (``core.fitted.rank_layout``): FSDP2 with tensor
    parallelism, its hybrid twin too, and DDP with every GPU of the one replica tensor-parallel; never in pipeline
    stages, never with loss parallelism, never where the flag is off."""
    from memcalc_gui.core.fitted import rank_layout
    from memcalc_gui.core.layouts import ModelShape

    setup = TrainingSetup(params=8 * 10**9, seq=2048, gpu="h100-80gb", parallel=Parallelism(gpus=32))
    shape = ModelShape(8 * 10**9, 4096, 32, block_model=False, pipeline_strategies=("ddp", "fsdp2"),
                       rank_sequence_parallel=True)
    pars = candidates(setup, shape=shape)
    split = [p for p in pars if p.sp]
    assert split and not any(p.loss_parallel for p in pars)
    assert all(p.tp > 1 and p.pp == 1 and p.strategy == "fsdp2" for p in split)
    assert any(p.dp_replicate > 1 for p in split)  # FSDP2's hybrid twin beside it
    for p in pars:  # each FSDP2 layout with tensor parallelism and no stages has its twin, and the twin's rank runs
        if p.strategy == "fsdp2" and p.tp > 1 and p.pp == 1 and not p.sp:
            twin = dataclasses.replace(p, sp=True)
            assert twin in split
            assert rank_layout(setup.with_changes(parallel=twin))["sp"] is True
    alone = candidates(setup, gpus=4, shape=shape)
    assert Parallelism(gpus=4, tp=4, sp=True, strategy="ddp") in alone
    assert not any(p.sp and p.strategy == "ddp" and p.dp > 1 for p in alone)
    assert not any(p.sp for p in candidates(setup, shape=dataclasses.replace(shape, rank_sequence_parallel=False)))


def test_a_search_without_a_block_model_weighs_the_pipeline_layouts_it_has_fits_for() -> None:
    """The fitted method's search (a ModelShape without a block model): pipeline stages that split the layers
    evenly, under the strategies its fits run, no sequence or loss parallelism. A stage fit of one data-parallel
    width (FSDP2's) answers that width only: its fewest-GPUs count stays unsearched, where reading the other widths as
    "does not fit" would say "never"; DDP's stage fit answers every width and is searched."""
    from memcalc_gui.core.layouts import NOT_CALIBRATED, ModelShape

    setup = TrainingSetup(model=preset_spec("llama-3.2-1b"), seq=2048, grad_accum=4, capacity_bytes=H100,
                          gpu="h100-80gb", parallel=Parallelism(gpus=8))
    assert setup.model is not None
    shape = ModelShape(setup.model.num_params, setup.model.hidden_size, 12, block_model=False,
                       pipeline_strategies=("ddp", "fsdp2"))
    pars = candidates(setup, shape=shape)
    assert {p.pp for p in pars} == {1, 2, 4}  # 8 stages do not split 12 layers
    assert {p.strategy for p in pars if p.pp > 1} == {"ddp", "fsdp2"} and not any(p.sp or p.loss_parallel for p in pars)
    assert {p.pp for p in candidates(setup, shape=ModelShape(1, 1, 12, block_model=False))} == {1}

    def estimator(s: TrainingSetup):
        if s.parallel.pp > 1 and s.parallel.strategy == "fsdp2" and s.parallel.gpus != 8:
            raise InputError("method", f"a layout of {s.parallel.pp} pipeline stages {NOT_CALIBRATED}")
        return estimate(s)

    found = search(setup, estimator, shape=shape, min_gpus_for=100)
    staged = [lay for lay in found if lay.parallel.pp > 1]
    assert staged and not found.left_out
    for lay in staged:
        assert lay.min_gpus_searched == (lay.parallel.strategy == "ddp"), lay.label
        assert lay.peak_bytes == estimate(setup.with_changes(parallel=lay.parallel)).peak_bytes
    assert all(lay.min_gpus for lay in staged if lay.parallel.strategy == "ddp")


def test_the_fewest_gpus_skip_counts_the_layout_refuses() -> None:
    """A layout can refuse some GPU counts (FSDP2 cannot split the routed experts' second dimension unevenly, so
    Mixtral-8x7B runs over 64 GPUs but not 48): the fewest-GPUs search reads a refused count as not fitting, and a
    refused upper limit no longer hides the answer (it used to give none)."""
    from memcalc_gui.core.solver import MAX_GPUS, _fewest_gpus

    setup = _setup(8, checkpointing="full").with_changes(parallel=Parallelism(gpus=8, strategy="fsdp2"))
    fewest = _fewest_gpus(setup, estimate, H100)
    assert fewest is not None and 2 < fewest < 64

    def refusing(counts: object) -> object:
        def estimator(s: TrainingSetup) -> object:
            if counts(s.parallel.gpus):
                raise InputError("gpus", f"{s.parallel.gpus} GPUs cannot place the experts")
            return estimate(s)
        return estimator

    powers = refusing(lambda g: g > fewest and g & (g - 1))  # above the answer only powers of two run
    assert _fewest_gpus(setup, powers, H100) == fewest
    assert _fewest_gpus(setup, refusing(lambda g: g == MAX_GPUS), H100) == fewest
    skipped = _fewest_gpus(setup, refusing(lambda g: g == fewest), H100)  # the answer itself refused: the next
    assert skipped is not None and skipped > fewest and estimate(setup.with_changes(
        parallel=Parallelism(gpus=skipped, strategy="fsdp2"))).peak_bytes <= H100
    assert _fewest_gpus(setup, refusing(lambda g: g >= fewest), H100) is None  # none that fits runs
