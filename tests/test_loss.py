"""The chunked fused linear cross-entropy (``--loss chunked``): the same loss and gradients as transformers', measured
on real CPU steps and traced on fake tensors, the analytic ledger within 3 % of both, Liger's published benchmark,
and what the solver and the command line make of it."""

from __future__ import annotations

import json

import pytest
from tiers import sample
from tiny_models import CONFIGS

from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.loss import benchmark_per_token_bytes, liger_chunk_rows
from memcalc_gui.core.model import block_preset_names, preset_spec, spec_from_config
from memcalc_gui.core.setup import TrainingSetup

#: (family, precision, batch, seq, accumulation, checkpointing)
CASES = [("llama", "fp32", 4, 256, 1, "none"), ("llama", "mixed", 4, 256, 1, "none"),
         ("llama", "bf16", 2, 128, 2, "none"), ("llama", "mixed", 4, 256, 1, "full"),
         ("qwen2-tied", "mixed", 2, 128, 2, "none"), ("qwen2-tied", "bf16", 4, 256, 1, "full"),
         ("gpt2", "fp32", 2, 128, 2, "none"), ("gpt2", "mixed", 4, 256, 1, "none")]


def test_liger_chunk_rule() -> None:
    """next_power_of_2(ceil(BT / ceil(V / H))): Llama-3's vocabulary over 4096 hidden is 32 chunks' worth."""
    assert liger_chunk_rows(32768, 4096, 128256) == 1024
    assert liger_chunk_rows(512, 2048, 128256) == 16  # ceil(512 / 63) = 9 → 16
    assert liger_chunk_rows(1, 64, 50000) == 1


def test_liger_benchmark_per_token() -> None:
    """Liger's benchmark data (A100, H 4096, V 128256, bf16, forward + backward; MiB as torch reports them):
    transformers' loss grows by (27582.5 - 15302.38) / 16384 MiB per token from 16k to 32k tokens — reproduced —
    and Liger's by 0.054 (its 2024 kernel); the model of today's kernel is further below, an order of magnitude
    under transformers' either way."""
    hf = benchmark_per_token_bytes("transformers", 4096, 128256) / 2**20
    assert hf == pytest.approx((27582.5 - 15302.3759765625) / 16384, rel=0.001)
    liger = benchmark_per_token_bytes("liger", 4096, 128256) / 2**20
    published = (5794.6259765625 - 4910.4384765625) / 16384
    assert liger < published < hf / 10


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_the_chunked_loss_equals_transformers_loss_and_gradients() -> None:
    from memcalc_gui.measure.chunked_loss import chunked_causal_lm_loss
    from memcalc_gui.measure.cpu_step import build_model

    torch.manual_seed(0)
    model = build_model(CONFIGS["llama"], precision="fp32", attention="sdpa")
    ids = torch.randint(0, 8192, (2, 33))
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    hidden = model.model(input_ids=ids).last_hidden_state
    loss = chunked_causal_lm_loss(hidden, model.lm_head.weight, ids, chunk_rows=7)
    (loss * 0.5).backward()  # accumulation scales the gradients made in forward
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name] * 0.5, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(("family", "precision", "batch", "seq", "accum", "ckpt"), sample(CASES, (4,)))
def test_analytic_and_trace_agree_with_real_chunked_steps(family: str, precision: str, batch: int, seq: int,
                                                          accum: int, ckpt: str) -> None:
    """Real CPU steps with the chunked loss: the analytic ledger within 3 % of the step's peak (and every phase
    within 5 %), the trace within 1 %."""
    from memcalc_gui.measure.cpu_step import measure_training_step
    from memcalc_gui.trace.fake import trace_estimate

    cfg = CONFIGS[family]
    kw = dict(batch=batch, seq=seq, precision=precision, grad_accum=accum, checkpointing=ckpt,
              optimizer_impl="single-tensor")
    real = measure_training_step(cfg, loss="chunked", **kw)  # type: ignore[arg-type]
    setup = TrainingSetup(model=spec_from_config(cfg), loss="chunked", target_device="cpu", **kw)  # type: ignore
    est = estimate(setup, "analytic")
    assert est.peak_tensor_bytes == pytest.approx(real.peak_bytes, rel=0.03)
    for phase in ("forward", "backward", "optimizer_step"):
        assert est.phases[phase].tensor_bytes == pytest.approx(real.phases[phase].peak_bytes, rel=0.05), phase
    traced = trace_estimate(setup.with_changes(cuda_context_bytes=0, allocator_reserve=0.0)).estimate
    assert traced.peak_tensor_bytes == pytest.approx(real.peak_bytes, rel=0.01)


@pytest.mark.parametrize("name", block_preset_names())
def test_the_chunked_loss_never_raises_the_peak(name: str) -> None:
    """Every preset, a long and a short sequence, with and without autocast and checkpointing: the chunked loss
    lowers the step's GPU peak or leaves it (it needs no host memory)."""
    spec = preset_spec(name)
    if spec.lm_head_bias:
        pytest.skip("the chunked loss is modelled for heads without a bias")
    for seq in (256, 8192):
        for precision in ("mixed", "bf16"):
            for ckpt in ("none", "full"):
                full = TrainingSetup(model=spec, seq=seq, precision=precision, checkpointing=ckpt)  # type: ignore
                chunked = full.with_changes(loss="chunked")
                a, b = estimate(full, "analytic"), estimate(chunked, "analytic")
                assert b.peak_bytes <= a.peak_bytes, (seq, precision, ckpt)
                assert b.details["host_bytes"] == 0


def test_refusals_and_the_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InputError, match="bias"):
        TrainingSetup(model=preset_spec("phi-2"), loss="chunked")
    with pytest.raises(InputError, match="chunked loss"):
        TrainingSetup(model=preset_spec("gpt2"), loss_chunk=64)
    for args, flag in ((["--preset", "phi-2", "--loss", "chunked"], "--loss:"),
                       (["--preset", "gpt2", "--loss-chunk-size", "0", "--loss", "chunked"], "--loss-chunk-size:")):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["estimate", *args])
        assert exit_.value.code == 2 and flag in capsys.readouterr().err
    # Llama-3.1-8B at 8 × 4096 on one H100: the chunked loss is among the changes, with what it saves
    assert cli_main(["estimate", "--preset", "llama-3.1-8b", "--batch", "8", "--seq", "4096", "--gpu", "h100-80gb",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    chunked = [s for s in data["suggestions"] if s["changes"].get("loss") == "chunked"]
    assert chunked and chunked[0]["saves_bytes"] > 40 * 2**30
    assert "Liger" in chunked[0]["tradeoff"]
