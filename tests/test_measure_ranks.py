"""`memcalc measure` of a multi-GPU setup: every rank of the layout a real process on PyTorch's gloo backend (DDP,
FSDP2, tensor, context and pipeline parallelism), each compared with its own estimate; the layout scaled to what this
machine runs; what cannot be run refused naming the field; cancel ends every rank."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import sample

from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.model import preset_spec, spec_from_config
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.measure.layout import measured_world, rank_job, refusal, scale_layout

TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=1024, hidden_size=128,
            intermediate_size=344, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: A tied embedding much larger than the layers (as Qwen2.5-0.5B's and Llama-3.2-1B's): under FSDP2's mixed precision
#: the embedding's backward is the peak, where the ledger counted fp32 autograd gradients (+25 % here, 8–9 % on those).
TIED = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=32768, hidden_size=512,
            intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
            max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _setup(**par: object) -> TrainingSetup:
    return TrainingSetup(model=preset_spec("llama-3.1-70b"), batch=1, seq=8192, precision="mixed",
                         parallel=Parallelism(**par))  # type: ignore[arg-type]


# ---- the layout a measurement runs (no torch) ----------------------------------------------------------------------
def test_the_done_when_layout_is_scaled_to_four_processes_keeping_every_kind_of_split() -> None:
    setup, changes = scale_layout(_setup(gpus=64, tp=8, pp=2, sp=True, strategy="fsdp2"))
    par = setup.parallel
    # a stage's tensor-parallel rank is one narrower model: the processes are pp × FSDP2's data-parallel ranks
    assert (par.tp, par.pp, par.dp, par.strategy, par.sp) == (8, 2, 2, "fsdp2", False)
    assert measured_world(par) == 4
    assert any("no sequence parallelism" in c for c in changes) and "data parallel 2 instead of 4" in changes
    kept, _ = scale_layout(_setup(gpus=64, tp=8, sp=True, strategy="fsdp2"))
    assert kept.parallel.sp and rank_job(kept).layout.sp  # without pipeline stages it is run
    # FSDP2's default vocabulary split (issue 62): a stage's narrower model does not run DTensor's embedding gradient
    # of the whole vocabulary, which the ledger counts; the scaled setup keeps it whole and says so (without pipeline
    # stages the split is run: the ranks' RankLayout)
    split, changes = scale_layout(_setup(gpus=64, tp=8, pp=2, sp=True, loss_parallel=True, strategy="fsdp2"))
    assert not split.parallel.loss_parallel and any("embedding and head whole" in c for c in changes)
    kept, _ = scale_layout(_setup(gpus=64, tp=8, sp=True, loss_parallel=True, strategy="fsdp2"))
    assert kept.parallel.loss_parallel and rank_job(kept).layout.loss_parallel


def test_a_tensor_parallel_layout_keeps_two_of_each_dimension() -> None:
    setup, changes = scale_layout(_setup(gpus=64, tp=8, strategy="fsdp2"))
    assert (setup.parallel.tp, setup.parallel.dp) == (2, 2) and measured_world(setup.parallel) == 4
    assert changes == ["tensor parallel 2 instead of 8", "data parallel 2 instead of 8"]
    assert scale_layout(_setup(gpus=4, tp=2, strategy="fsdp2")) == (_setup(gpus=4, tp=2, strategy="fsdp2"), [])


def test_ddp_replicas_of_a_model_parallel_group_give_way_and_say_so() -> None:
    setup, changes = scale_layout(_setup(gpus=4, tp=2))
    assert (setup.parallel.gpus, setup.parallel.tp, setup.parallel.dp) == (2, 2, 1)
    assert "one data-parallel replica instead of 2" in changes[0]
    ring = _setup(gpus=4, cp=2)  # beside context parallelism DDP runs over dp × cp: nothing gives way
    assert scale_layout(ring) == (ring, [])
    job = rank_job(setup)
    assert job.strategy == "ranks" and job.world == 2 and job.layout.tp == 2 and job.layout.dp_shard == 1


def test_each_layout_runs_the_job_of_its_kind() -> None:
    tiny = spec_from_config(TINY)

    def job(**par: object):  # type: ignore[no-untyped-def]
        return rank_job(TrainingSetup(model=tiny, batch=2, seq=64, grad_accum=4,
                                      parallel=Parallelism(**par)))  # type: ignore[arg-type]

    assert job(gpus=2).strategy == "ddp"
    assert job(gpus=4, strategy="fsdp2").strategy == "fsdp2"
    pipe = job(gpus=4, pp=2, strategy="fsdp2")
    assert pipe.strategy == "pipeline:1f1b" and pipe.world == 4 and pipe.stage_of == (0, 0, 1, 1)
    assert pipe.layout.dp_shard == 2 and pipe.layout.microbatches == 4
    narrow = job(gpus=4, pp=2, tp=2)
    assert narrow.world == 2 and narrow.config["num_attention_heads"] == 2 and narrow.notes
    ring = job(gpus=2, cp=2, strategy="fsdp2")
    assert ring.strategy == "ranks" and ring.layout.cp == 2 and not ring.layout.replicate_context
    ddp_ring = job(gpus=4, cp=2)  # DDP over the data- and context-parallel ranks, each holding the model whole
    assert ddp_ring.world == 4 and ddp_ring.layout.replicate_context and ddp_ring.layout.dp_replicate == 2
    staged_ring = job(gpus=8, pp=2, cp=2, strategy="fsdp2")  # each stage over dp 2 × cp 2
    assert staged_ring.strategy == "pipeline:1f1b" and staged_ring.world == 8
    assert staged_ring.stage_of == (0,) * 4 + (1,) * 4 and staged_ring.layout.cp == 2


@pytest.mark.parametrize("par, words", [
    ({"gpus": 8, "strategy": "zero2"}, "DeepSpeed"),
    ({"gpus": 8, "strategy": "megatron-distopt"}, "Megatron"),
    ({"gpus": 8, "strategy": "zero3", "offload": "optimizer"}, "DeepSpeed"),
    ({"gpus": 8, "strategy": "fsdp2", "offload": "optimizer"}, "offload"),
    ({"gpus": 8, "pp": 2, "cp": 2}, "torchtitan"),  # context beside pipeline parallelism: under FSDP2
])
def test_what_is_not_run_for_real_is_refused_with_the_reason(par: dict, words: str) -> None:
    setup = _setup(**par)
    assert words in refusal(setup)
    with pytest.raises(InputError) as exc:
        rank_job(setup)
    assert exc.value.field == "strategy"


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]),
       dp=st.integers(1, 16), strategy=st.sampled_from(["ddp", "fsdp2"]), most=st.integers(1, 8))
def test_any_layout_scales_to_what_the_machine_runs_or_says_why(tp: int, pp: int, cp: int, dp: int, strategy: str,
                                                                most: int) -> None:
    try:
        setup = _setup(gpus=tp * pp * cp * dp, tp=tp, pp=pp, cp=cp, strategy=strategy)
    except InputError:
        return  # a layout the estimate itself refuses
    if refusal(setup):
        return
    try:
        scaled, changes = scale_layout(setup, most)
    except InputError as exc:
        assert exc.field == "gpus" and str(most) in str(exc)
        return
    par = scaled.parallel
    assert measured_world(par) <= most
    assert bool(changes) == (scaled != setup)
    for dim in ("tp", "pp", "cp", "dp"):
        assert getattr(par, dim) <= getattr(setup.parallel, dim)
    if strategy == "fsdp2" and setup.parallel.dp * setup.parallel.cp >= 2:
        assert par.dp * par.cp >= 2  # still FSDP2: something to shard over (a stage's dp × cp ranks too)
    rank_job(scaled)  # and it can be run


# ---- real ranks -----------------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY), encoding="utf-8")
    return path


def _measure(config: Path | dict, capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    if isinstance(config, dict):
        raise TypeError("write the config to a file")
    assert cli_main(["measure", "--config", str(config), "--batch", "2", "--seq", "64", "--precision", "mixed",
                     "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("flags, ranks", sample([
    # DTensor's tensor parallelism, torchtitan's sequence- and loss-parallel plan (FSDP2's default beside tensor
    # parallelism) and fully_shard, really sent; and with the embedding and head whole
    (("--gpus", "4", "--tp", "2", "--sp", "--strategy", "fsdp2"), 4),
    (("--gpus", "2", "--cp", "2", "--strategy", "fsdp2"), 2),  # PyTorch's ring attention over gloo
    (("--gpus", "2", "--cp", "2", "--strategy", "ddp"), 2),  # DDP over the ring's ranks: its buckets, for real
    (("--gpus", "2", "--strategy", "ddp"), 2),  # DDP's buckets from the moment it wraps the model
    (("--gpus", "4", "--tp", "2", "--sp", "--strategy", "fsdp2", "--no-loss-parallel"), 4),
], (0, 3)))
def test_every_rank_of_a_real_step_matches_its_estimate(tiny: Path, capsys: pytest.CaptureFixture[str],
                                                        flags: tuple[str, ...], ranks: int) -> None:
    out = _measure(tiny, capsys, *flags)
    assert not out["scaled"] and len(out["ranks"]) == ranks
    for r in out["ranks"]:
        assert set(r["phases"]) == {"load", "forward", "backward", "optimizer_step"}
        for phase, error in r["error_pct"].items():
            assert abs(error) < 1.0, (r["label"], phase, error)
    shown = out["ranks"][out["shown_rank"]]
    assert {p: v["peak_bytes"] for p, v in out["phases"].items()} == \
        {p: v["peak_bytes"] for p, v in shown["phases"].items()}


def test_each_pipeline_stage_is_compared_with_its_own_ledger(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from memcalc_gui.core.pipeline import stage_estimate
    from memcalc_gui.core.result import evaluate

    out = _measure(tiny, capsys, "--gpus", "2", "--pp", "2", "--grad-accum", "4")
    assert [r["stage"] for r in out["ranks"]] == [0, 1]
    setup = TrainingSetup(model=spec_from_config(TINY), batch=2, seq=64, grad_accum=4, precision="mixed",
                          target_device="cpu", parallel=Parallelism(gpus=2, pp=2))
    for r in out["ranks"]:
        own = stage_estimate(setup, r["stage"])
        assert r["estimate_bytes"]["backward"] == own.phases["backward"].tensor_bytes
        assert max(abs(e) for e in r["error_pct"].values()) < 1.0, r["error_pct"]
    # the table and the chart show the stage the estimate shows, its most loaded
    assert out["ranks"][out["shown_rank"]]["stage"] == evaluate(setup).estimate.details["pipeline_rank"]


@pytest.mark.full_suite
def test_a_tied_embedding_under_fsdp2_mixed_precision_matches_the_real_step(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tied.json"
    path.write_text(json.dumps(TIED), encoding="utf-8")
    out = _measure(path, capsys, "--gpus", "2", "--strategy", "fsdp2")
    for r in out["ranks"]:
        assert abs(r["error_pct"]["backward"]) < 1.0, r["error_pct"]


@pytest.mark.full_suite
def test_the_text_output_lists_every_rank(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["measure", "--config", str(tiny), "--batch", "2", "--seq", "64", "--gpus", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Measured 2 ranks on this CPU (one gloo process each")
    assert "Every rank" in out and "rank 1 of 2" in out and "rank 2 of 2" in out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is used on Linux")
def test_the_ranks_come_from_a_fork_server_started_once(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """After one measurement the next ranks start from the running fork server, which imported torch once: the time
    budget counts a fraction of a second per rank, not a fresh interpreter's imports."""
    from memcalc_gui.measure.distributed import fork_server_started, rank_context
    from memcalc_gui.measure.layout import SPAWN_S, start_seconds

    assert cli_main(["measure", "--config", str(tiny), "--batch", "2", "--seq", "64", "--gpus", "2", "--json"]) == 0
    capsys.readouterr()
    assert fork_server_started()
    assert start_seconds(4, 2) < SPAWN_S / 4
    ctx, server = rank_context()
    out = ctx.Queue()
    proc = ctx.Process(target=_imported_at_start, args=(out,))
    proc.start()
    parent, modules = out.get(timeout=60)
    proc.join(30)
    assert parent == server != os.getpid()
    assert {"torch", "torch.distributed.fsdp", "transformers.modeling_utils"} <= modules


def _imported_at_start(out: object) -> None:
    out.put((os.getppid(), set(sys.modules)))  # type: ignore[attr-defined]


def test_a_strategy_that_cannot_run_exits_2_naming_it(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["measure", "--config", str(tiny), "--gpus", "4", "--strategy", "zero3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--strategy" in err and "DeepSpeed" in err and len(err.splitlines()) == 1


def test_cancel_ends_every_rank() -> None:
    from memcalc_gui.measure import engine

    setup = TrainingSetup(model=spec_from_config(TINY), batch=2, seq=64, parallel=Parallelism(gpus=2, tp=2))
    said: list[str] = []
    with pytest.raises(engine.Cancelled):
        engine.measure(setup, device="cpu", progress=said.append,
                       should_stop=lambda: any("iteration" in s for s in said))
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()


def _reduce_scatter_rank(rank: int, port: int, out: object) -> None:
    import torch.distributed as dist

    from memcalc_gui.measure.distributed import nccl_like_reduce_scatter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        data = torch.arange(8, dtype=torch.float32) * (rank + 1)
        theirs, ours = torch.empty(4), torch.empty(4)
        dist.reduce_scatter_single(theirs, data.clone())
        with nccl_like_reduce_scatter():
            dist.reduce_scatter_single(ours, data.clone())
        out.put((rank, theirs.tolist(), ours.tolist()))  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def test_the_copy_free_reduce_scatter_reduces_as_gloos_own() -> None:
    from memcalc_gui.measure.distributed import _free_port, rank_context

    ctx, _ = rank_context()
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_reduce_scatter_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((rank, (a, b)) for rank, a, b in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    assert got[0][0] == got[0][1] == [0.0, 3.0, 6.0, 9.0]
    assert got[1][0] == got[1][1] == [12.0, 15.0, 18.0, 21.0]


#: A mixture of experts (a family without a block model) for the sequence-parallel plan's experts' block.
TINY_MOE = dict(TINY, model_type="mixtral", architectures=["MixtralForCausalLM"], intermediate_size=128,
                num_local_experts=4, num_experts_per_tok=2)


def _sequence_parallel_rank(rank: int, port: int, vocab: bool, out: object, ep: int = 0) -> None:
    import torch.distributed as dist

    from memcalc_gui.trace.ranks import RankLayout, device_mesh, parallelizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        config = TINY_MOE if ep else TINY
        layout = RankLayout(tp=2, sp=True, loss_parallel=vocab, ep=max(ep, 1))
        out.put((rank, *_loss_and_grad(parallelizer(config, layout, "fp32", device_mesh(layout)),  # type: ignore
                                       vocab, config)))
    finally:
        dist.destroy_process_group()


def _loss_and_grad(parallelize: object, vocab: bool, config: dict = TINY) -> tuple[float, float]:
    """The loss and a first-layer projection's gradient (summed: the MLP's down projection, the attention's output
    projection in a mixture of experts) of one step of ``config``, seeded."""
    from memcalc_gui.measure.cpu_step import build_model
    from memcalc_gui.trace.fake import unpacked_sequences
    from memcalc_gui.trace.ranks import _loss_parallel

    torch.manual_seed(0)
    model = build_model(config, precision="fp32")
    if callable(parallelize):
        parallelize(model)
    torch.manual_seed(1)
    ids = torch.randint(0, config["vocab_size"], (2, 64))
    with unpacked_sequences(), _loss_parallel(vocab):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    layer = model.model.layers[0]
    grad = (layer.self_attn.o_proj if hasattr(layer.mlp, "experts") else layer.mlp.down_proj).weight.grad
    grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return float(loss.detach()), float(grad.abs().sum())


@pytest.mark.full_suite
@pytest.mark.parametrize(("vocab", "ep"), [(False, 0), (True, 0), (False, 1), (False, 2)],
                         ids=["head-whole", "loss-parallel", "experts-tp", "experts-ep"])
def test_the_sequence_parallel_plan_computes_the_single_gpu_step(vocab: bool, ep: int) -> None:
    """torchtitan's sequence-parallel plan on transformers' own modules, two real gloo ranks: the loss and a gradient
    are the single-process model's (so the trace and the measurement run a correct step, not only its shapes); for a
    mixture of experts too, its experts split by transformers' tensor-parallel styles or over the two ranks."""
    from memcalc_gui.measure.distributed import _free_port, rank_context

    single = _loss_and_grad(None, False, TINY_MOE if ep else TINY)
    ctx, _ = rank_context()
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_sequence_parallel_rank, args=(r, port, vocab, out, ep)) for r in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    for _, loss, grad in got:
        assert loss == pytest.approx(single[0], rel=1e-5) and grad == pytest.approx(single[1], rel=1e-4)


ORPHANED_RANK = """
import multiprocessing, os, sys, time
from memcalc_gui.measure.distributed import _die_with_parent, rank_context

def rank(parent):
    _die_with_parent(parent)
    time.sleep(600)  # as a rank waiting in a collective whose peers are gone

if __name__ == "__main__":
    # the measurement's own context (a fork server on Linux), or a plain spawned process
    ctx, forker = rank_context() if sys.argv[2] == "measure" else (multiprocessing.get_context("spawn"), os.getpid())
    child = ctx.Process(target=rank, args=(forker,))
    child.start()
    print(child.pid, forker, flush=True)
    time.sleep(float(sys.argv[1]))  # 3: the rank is running (its prctl done); 0: it has not even started Python
    os._exit(1)  # as a window killed or a test stopped for its time: no clean-up runs
"""


@pytest.mark.full_suite
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("start", ["measure", "spawn"])
@pytest.mark.parametrize("lives_s", [3, 0], ids=["after-its-start", "before-its-start"])
def test_a_rank_ends_with_the_process_that_started_it(tmp_path: Path, lives_s: int, start: str) -> None:
    """The kernel ends a rank whose parent ended without a clean-up, instead of leaving it behind (which held the
    parent's output pipes open, and waited in its collective for gloo's timeout); a parent gone before the rank
    could ask the kernel is seen by the rank itself. A measurement's ranks come from a fork server on Linux: it ends
    with the process it serves, and its ranks with it."""
    script = tmp_path / "parent.py"
    script.write_text(ORPHANED_RANK)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(script), str(lives_s), start], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(root)))
    pids = [int(p) for p in proc.stdout.split()[:2]]

    def status(pid: int) -> str:  # "" once the process is gone and reaped
        try:
            return Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return ""

    def ended(pid: int) -> bool:  # gone, or a zombie waiting for init to reap it
        text = status(pid)
        return not text or "State:\tZ" in text

    deadline = time.monotonic() + 20
    while not all(ended(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ended(pids[0]), status(pids[0])
    assert ended(pids[1]), status(pids[1])  # the fork server (or the spawning parent) is gone too
