"""Padding-free packing (``--packing --tokens-per-batch``) and FlashAttention-2 (``--attention flash``).

Packed documents go in one row whose ``position_ids`` restart at every document; transformers then limits attention
to each document: SDPA through a block-diagonal mask it builds and SDPA keeps per layer, FlashAttention-2 through
its variable-length kernel (run on CPU by ``measure.varlen_attention``). Real CPU steps check the ledger."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import OnDemand, sample

from bench.techniques import FAMILIES
from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.fitted import signature
from memcalc_gui.core.model import block_preset_names, preset_spec, spec_from_config
from memcalc_gui.core.result import evaluate
from memcalc_gui.core.setup import TrainingSetup, find_gpu
from memcalc_gui.core.solver import levers

#: (family, precision, attention, checkpointing): 4 documents of 256 tokens in one row of 1,024
CASES = [("llama", "fp32", "sdpa", "none"), ("llama", "mixed", "sdpa", "full"), ("llama", "bf16", "flash", "none"),
         ("llama", "mixed", "flash", "full"), ("qwen2-tied", "bf16", "sdpa", "full"),
         ("qwen2-tied", "mixed", "flash", "every:2"), ("gpt2", "mixed", "sdpa", "none"),
         ("gpt2", "bf16", "flash", "full"), ("llama", "fp32", "eager", "none")]
DOCS, TOKENS = 4, 1024


def _setup(family: str, precision: str, attention: str, ckpt: str) -> TrainingSetup:
    return TrainingSetup(model=spec_from_config(FAMILIES[family]), batch=DOCS, seq=TOKENS // DOCS, packing=True,
                         precision=precision, attention=attention, checkpointing=ckpt,  # type: ignore[arg-type]
                         optimizer_impl="single-tensor", target_device="cpu")


def test_shape_and_refusals_name_the_field() -> None:
    spec = preset_spec("llama-3.2-1b")
    s = TrainingSetup(model=spec, batch=8, seq=4096, packing=True, tokens_per_batch=12_000)
    assert (s.rows, s.row_len, s.tokens) == (1, 12_000, 12_000)
    assert TrainingSetup(model=spec, batch=8, seq=4096, packing=True).row_len == 8 * 4096
    assert TrainingSetup(model=spec, batch=8, seq=4096).tokens == 8 * 4096
    # a new micro-batch keeps the mean document length; a shorter sequence caps the tokens
    assert s.with_changes(batch=4).tokens_per_batch == 6_000
    assert s.with_changes(seq=1024).tokens_per_batch == 8 * 1024
    for kwargs, field, words in (
            (dict(tokens_per_batch=100), "tokens_per_batch", "need packing"),
            (dict(packing=True, tokens_per_batch=8 * 4096 + 1), "tokens_per_batch", "at most 32,768"),
            (dict(attention="flash", precision="fp32"), "attention", "16-bit"),
            (dict(packing=True, use_cache=True), "packing", "use_cache"),
            (dict(packing=True, checkpointing="selective"), "packing", "selective"),
            (dict(packing=True, checkpointing="full", activation_offload="all"), "packing", "flash"),
            (dict(packing="yes"), "packing", "true or false")):
        with pytest.raises(InputError, match=words) as exc:
            TrainingSetup(model=spec, batch=8, seq=4096, **kwargs)  # type: ignore[arg-type]
        assert exc.value.field == field
    with pytest.raises(InputError, match="trace") as exc:  # the fitted method calibrates padded rows
        signature(TrainingSetup(model=spec, packing=True))
    assert exc.value.field == "packing"


def test_cli_flags_json_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["estimate", "--preset", "llama-3.2-1b", "--tokens-per-batch", "4k"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--tokens-per-batch" in err and len(err.strip().splitlines()) == 1
    assert cli_main(["estimate", "--preset", "llama-3.2-1b", "--batch", "8", "--seq", "4096", "--packing",
                     "--tokens-per-batch", "12k", "--attention", "flash", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["setup"]["packing"] is True and data["setup"]["tokens_per_batch"] == 12 * 1024
    assert data["setup"]["attention"] == "flash"
    assert cli_main(["estimate", "--preset", "llama-3.2-1b", "--batch", "8", "--seq", "4096", "--packing",
                     "--tokens-per-batch", "12k"]) == 0
    out = capsys.readouterr().out
    assert "8 documents of at most 4,096 tokens packed into one row of 12,288 tokens" in out
    assert "block-diagonal" in out  # the assumption says what SDPA keeps


@pytest.mark.parametrize("name", block_preset_names())
def test_packing_fewer_real_tokens_never_raises_the_peak(name: str) -> None:
    """FlashAttention-2 over packed documents never needs more than the padded batch when at most half the padded
    tokens are real, and packed SDPA never less than packed FlashAttention-2 (it adds the masks)."""
    spec = preset_spec(name)
    padded = TrainingSetup(model=spec, batch=4, seq=2048, precision="bf16", attention="flash")
    for ckpt in ("none", "full"):
        base = padded.with_changes(checkpointing=ckpt)
        flash = base.with_changes(packing=True, tokens_per_batch=4096)
        sdpa = flash.with_changes(attention="sdpa")
        a, b, c = (estimate(x, "analytic") for x in (base, flash, sdpa))
        for phase in ("forward", "backward"):
            assert b.phases[phase].tensor_bytes <= a.phases[phase].tensor_bytes, (ckpt, phase)
            assert b.phases[phase].tensor_bytes <= c.phases[phase].tensor_bytes, (ckpt, phase)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 16), seq=st.integers(1, 8192), share=st.floats(0.01, 1.0),
       attention=st.sampled_from(["sdpa", "flash", "eager"]), ckpt=st.sampled_from(["none", "full", "every:2"]))
def test_more_real_tokens_never_need_less(batch: int, seq: int, share: float, attention: str, ckpt: str) -> None:
    spec = preset_spec("qwen2.5-0.5b")
    tokens = max(1, int(batch * seq * share))
    one = TrainingSetup(model=spec, batch=batch, seq=seq, packing=True, tokens_per_batch=tokens, precision="bf16",
                        attention=attention, checkpointing=ckpt)  # type: ignore[arg-type]
    more = one.with_changes(tokens_per_batch=min(batch * seq, tokens + max(1, tokens // 3)))
    a, b = estimate(one, "analytic"), estimate(more, "analytic")
    assert a.peak_bytes <= b.peak_bytes


def test_flash_is_suggested_for_packed_sdpa() -> None:
    spec = preset_spec("llama-3.1-8b")
    setup = TrainingSetup(model=spec, batch=8, seq=8192, packing=True, precision="bf16", optimizer="adamw-8bit",
                          checkpointing="full", loss="chunked")
    assert any(lv.key == "attention-flash" for lv in levers(setup))
    assert not any(lv.key == "attention-flash" for lv in levers(setup.with_changes(attention="flash")))
    gpu = find_gpu("h100-80gb")
    result = evaluate(setup.with_changes(gpu=gpu.id, capacity_bytes=gpu.capacity_bytes), "analytic")
    assert not result.verdict.fits
    flash = [s for s in result.verdict.suggestions if s.changes.get("attention") == "flash"]
    assert flash and "FlashAttention-2" in flash[0].title
    assert any(s.fits for s in flash)


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def measured() -> OnDemand[tuple[str, str, str, str], object]:
    """Each case's real packed step, measured when a test first asks."""
    from memcalc_gui.measure.cpu_step import measure_training_step

    return OnDemand(lambda case: measure_training_step(
        FAMILIES[case[0]], batch=1, seq=TOKENS, documents=DOCS, precision=case[1], attention=case[2],
        checkpointing=case[3], optimizer_impl="single-tensor"))


@pytest.mark.parametrize("case", sample(CASES, (1,), single=True), ids=["-".join(c) for c in CASES])
def test_analytic_matches_a_real_packed_step(case: tuple[str, str, str, str], measured: dict) -> None:
    m = measured[case]
    est = estimate(_setup(*case), "analytic")
    for phase in ("forward", "backward", "optimizer_step"):
        real, predicted = m.phases[phase].peak_bytes, est.phases[phase].tensor_bytes
        assert abs(predicted - real) <= 0.03 * real, (phase, predicted, real)


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=["-".join(c) for c in (CASES[1], CASES[3])])
def test_the_fake_tensor_trace_packs_the_same_way(case: tuple[str, str, str, str], measured: dict) -> None:
    from memcalc_gui.trace.fake import trace_estimate

    traced = trace_estimate(_setup(*case).with_changes(target_device="cuda")).estimate
    real = measured[case]
    for phase in ("forward", "backward"):
        real_peak = real.phases[phase].peak_bytes
        assert abs(traced.phases[phase].tensor_bytes - real_peak) <= 0.01 * real_peak, phase


@pytest.mark.full_suite
def test_packed_sdpa_keeps_a_mask_per_layer(measured: dict) -> None:
    """What the rule adds for packed SDPA is what the real step holds beyond FlashAttention-2's packed step."""
    from memcalc_gui.measure.cpu_step import measure_training_step

    flash = measure_training_step(FAMILIES["llama"], batch=1, seq=TOKENS, documents=DOCS, precision="mixed",
                                  attention="flash", checkpointing="none", optimizer_impl="single-tensor")
    sdpa = measure_training_step(FAMILIES["llama"], batch=1, seq=TOKENS, documents=DOCS, precision="mixed",
                                 attention="sdpa", checkpointing="none", optimizer_impl="single-tensor")
    layers = FAMILIES["llama"]["num_hidden_layers"]
    extra = sdpa.phases["forward"].peak_bytes - flash.phases["forward"].peak_bytes
    assert extra >= layers * TOKENS * TOKENS * 2  # a bf16 additive mask in every layer, at least


def test_varlen_attention_attends_within_each_document() -> None:
    """The CPU stand-in of FlashAttention-2's varlen kernel gives what SDPA gives document by document, values and
    gradients, with grouped k/v heads."""
    from memcalc_gui.measure.varlen_attention import _VarlenFlash

    torch.manual_seed(0)
    lengths = [5, 9, 2]
    q = torch.randn(16, 4, 8, requires_grad=True)
    k = torch.randn(16, 2, 8, requires_grad=True)
    v = torch.randn(16, 2, 8, requires_grad=True)
    bounds = [(0, 5), (5, 14), (14, 16)]
    out = _VarlenFlash.apply(q, k, v, bounds, None)
    out.sum().backward()
    got = [out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
    for x in (q, k, v):
        x.grad = None
    parts = []
    for s, e in bounds:
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1).repeat_interleave(2, 0),
            v[s:e].transpose(0, 1).repeat_interleave(2, 0), is_causal=True)
        parts.append(ref.transpose(0, 1))
    want = torch.cat(parts)
    want.sum().backward()
    assert sum(lengths) == 16
    for a, b in zip(got, [want.detach(), q.grad, k.grad, v.grad], strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_packed_flash_and_sdpa_compute_the_same_loss() -> None:
    """Both attend within each document: the same packed batch gives the same loss under either."""
    from memcalc_gui.measure import varlen_attention
    from memcalc_gui.measure.cpu_step import build_model, step_forward

    ids = torch.randint(0, 512, (1, 96))
    pos = torch.cat([torch.arange(n) for n in (40, 30, 26)]).unsqueeze(0)
    losses = []
    for attention in ("sdpa", "flash"):
        torch.manual_seed(0)
        model = build_model(FAMILIES["llama"], precision="fp32", attention=attention)
        with varlen_attention.documents([40, 30, 26]):
            losses.append(float(step_forward(model, ids, "fp32", position_ids=pos).detach()))
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
