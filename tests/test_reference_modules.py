"""The built-in reference decoders against transformers: parameters, and every phase of a step to the byte.

``memcalc_gui.measure.reference`` rebuilds the llama-like families op for op so that the measurement
engine works without transformers. These tests hold it to transformers: the same parameters (names,
shapes, dtypes, tying) and buffers, the same peak and end-of-phase live bytes and composition in
every phase, and -- stronger -- the same live-storage event log (allocations and frees in order, with
their op and size), so that the analytic estimate validated against transformers holds for both.

The one tolerated difference in the event log: the order of frees within one run of consecutive
frees (autocast drops its cache of 16-bit weight copies from a hash map, in address order). A run
of frees cannot hold a peak, so the logs are compared with each such run sorted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tiers import sample

from bench.probe import tiny_config
from memcalc_gui.measure.reference import REFERENCE_FAMILIES, ReferenceUnavailable, reference_config

ROOT = Path(__file__).resolve().parent.parent
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_TRANSFORMERS = HAS_TORCH and importlib.util.find_spec("transformers") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="compares with transformers")
UNSUPPORTED = ("gpt2", "gpt_neox", "phi", "bert", "mamba")


@pytest.fixture(autouse=True)
def _frozen_heap() -> Any:
    """Keep the objects that exist before a test (torch, transformers) out of the engine's gc.collect().

    Each measured step collects three times; with transformers imported that dominates the run time
    (about 0.2 s a collection). What the test creates is still collected.
    """
    from memcalc_gui.measure import frozen_heap

    with frozen_heap(collect=False):  # the engine's own steps see it and keep it (gc.freeze would be frozen twice)
        yield


def small(family: str, **overrides: Any) -> dict[str, Any]:
    """A 2-layer config of ``family``: hidden 64, 4 heads on 2 kv heads (GQA), vocabulary 500."""
    cfg = tiny_config(family, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=500)
    cfg.update(overrides)
    return cfg


# ---- without torch ----------------------------------------------------------------------------
def test_importing_does_not_import_torch() -> None:
    code = "import sys, memcalc_gui.measure.reference, memcalc_gui.measure.cpu_step; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("family", UNSUPPORTED)
def test_unsupported_families_say_install_transformers(family: str) -> None:
    with pytest.raises(ReferenceUnavailable) as info:
        reference_config({"model_type": family, "hidden_size": 64})
    message = str(info.value)
    assert repr(family) in message and "install transformers for this family" in message
    assert all(f in message for f in REFERENCE_FAMILIES)
    assert isinstance(info.value, NotImplementedError)


def test_unsupported_features_raise() -> None:
    with pytest.raises(ReferenceUnavailable, match="flash_attention_2"):
        reference_config(small("llama"), attention="flash_attention_2")
    with pytest.raises(ReferenceUnavailable, match="activation 'xielu'"):
        reference_config(small("llama", hidden_act="xielu"))
    with pytest.raises(ReferenceUnavailable, match="model_type None"):
        reference_config({"hidden_size": 64})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        reference_config(small("llama", num_key_value_heads=3))


def test_config_defaults_follow_transformers() -> None:
    qwen3 = reference_config({"model_type": "qwen3", "hidden_size": 1024})
    assert qwen3.head_dim == 128 and qwen3.num_key_value_heads == 32  # Qwen3Config: head_dim 128, kv 32
    gemma = reference_config({"model_type": "gemma", "hidden_act": "gelu"})
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.tie_word_embeddings and gemma.head_dim == 256
    assert gemma.pad_token_id == 0
    qwen2 = reference_config(small("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.layer_types == ["full_attention", "sliding_attention"]
    assert reference_config(small("qwen2", sliding_window=16)).sliding_window is None  # not used unless asked
    assert reference_config(small("mistral")).sliding_window == 4096
    phi3 = reference_config(small("phi3", partial_rotary_factor=0.5, rope_theta=500.0))
    assert phi3.rotary_dim == 8 and phi3.rope_parameters["rope_theta"] == 500.0 and phi3.rms_norm_eps == 1e-5
    llama = reference_config(small("llama", attention_bias=True, mlp_bias=True))
    assert llama.qkv_bias and llama.o_bias and llama.mlp_bias
    mistral = reference_config(small("mistral", attention_bias=True, mlp_bias=True))
    assert not (mistral.qkv_bias or mistral.o_bias or mistral.mlp_bias)


# ---- the reference model on its own -----------------------------------------------------------
@needs_torch
def test_builder_argument() -> None:
    import torch

    from memcalc_gui.measure.cpu_step import build_model

    model = build_model(small("gemma"), precision="bf16", builder="reference")
    assert type(model).__name__ == "GemmaForCausalLM" and type(model).__module__ == "memcalc_gui.measure.reference"
    assert model.training and model.config.vocab_size == 500
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="builder"):
        build_model(small("llama"), builder="onnx")
    with pytest.raises(ReferenceUnavailable, match="install transformers"):
        build_model(tiny_config("gpt2"), builder="reference")


@needs_torch
def test_auto_falls_back_to_the_reference_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    from memcalc_gui.measure.cpu_step import build_model

    if HAS_TRANSFORMERS:
        assert type(build_model(small("llama"))).__module__.startswith("transformers.")
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "transformers" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    model = build_model(small("llama"))
    assert type(model).__module__ == "memcalc_gui.measure.reference"
    with pytest.raises(ReferenceUnavailable, match="install transformers"):
        build_model(tiny_config("gpt_neox"))


@pytest.mark.full_suite
@needs_torch
def test_measures_in_a_process_without_transformers() -> None:
    code = (
        "import sys, json; sys.modules['transformers'] = None\n"
        "from bench.probe import tiny_config\n"
        "from memcalc_gui.measure.cpu_step import measure_training_step\n"
        "cfg = tiny_config('qwen3', hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=500)\n"
        "m = measure_training_step(cfg, batch=1, seq=16, precision='mixed', checkpointing='full')\n"
        "print(json.dumps([m.params, m.peak_bytes, [r.live_bytes_end for r in m.iterations]]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    params, peak, ends = json.loads(out.stdout.strip().splitlines()[-1])
    assert params > 0 and peak > 0 and ends[0] == ends[1]


@needs_torch
@pytest.mark.parametrize("family", REFERENCE_FAMILIES)
def test_checkpointing_keeps_the_numbers(family: str) -> None:
    import torch

    from memcalc_gui.measure.reference import build_reference_model

    torch.manual_seed(0)
    model = build_reference_model(small(family), dropout=0.0)
    ids = torch.randint(0, 500, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and 5.5 < loss.item() < 7.0  # about ln(500) from random weights
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    again = model(input_ids=ids, labels=ids).loss
    again.backward()
    assert torch.equal(loss, again)
    assert all(torch.allclose(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))


# ---- against transformers: parameters -----------------------------------------------------------
def _structure(model: Any) -> tuple[Any, ...]:
    return (
        [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()],
        [(n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()],
        [n for n, _ in model.named_modules()],
        type(model).__name__,
    )


PARAM_CASES = [
    *((f, {}) for f in REFERENCE_FAMILIES),
    *((f, {"tie_word_embeddings": f != "gemma"}) for f in REFERENCE_FAMILIES),
    ("llama", {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 4}),
    ("llama", {"num_key_value_heads": 1, "head_dim": 32}),
    ("qwen2", {"head_dim": 24}),
    ("qwen3", {"attention_bias": True}),
    ("gemma", {"attention_bias": True, "head_dim": 40}),
    ("mistral", {"attention_bias": True, "mlp_bias": True}),  # both ignored by Mistral
    ("phi3", {"partial_rotary_factor": 0.5}),
]


@needs_transformers
@pytest.mark.parametrize(("family", "overrides"), PARAM_CASES, ids=[f"{f}-{o}" for f, o in PARAM_CASES])
def test_parameters_equal_transformers(family: str, overrides: dict[str, Any]) -> None:
    from memcalc_gui.measure.cpu_step import build_model

    cfg = small(family, **overrides)
    for precision in ("fp32", "bf16"):
        hf = build_model(cfg, precision=precision, builder="transformers")
        ref = build_model(cfg, precision=precision, builder="reference")
        assert _structure(ref) == _structure(hf)
        assert sum(p.numel() for p in ref.parameters()) == sum(p.numel() for p in hf.parameters())
        tied = ref.lm_head.weight is ref.model.embed_tokens.weight
        assert tied == (hf.lm_head.weight is hf.model.embed_tokens.weight)


@pytest.mark.full_suite
@needs_transformers
def test_presets_and_defaults_equal_transformers_on_meta() -> None:
    """Real sizes (all presets of these families, and each family's bare defaults) without memory."""
    import torch

    from memcalc_gui.core.model import preset_config, preset_names
    from memcalc_gui.measure.cpu_step import build_model

    configs = [preset_config(n) for n in preset_names()]
    configs = [c for c in configs if c["model_type"] in REFERENCE_FAMILIES]
    configs += [{"model_type": f, "num_hidden_layers": 1} for f in REFERENCE_FAMILIES]
    assert len(configs) >= 12
    for cfg in configs:
        with torch.device("meta"):
            hf = build_model(cfg, precision="bf16", builder="transformers")
            ref = build_model(cfg, precision="bf16", builder="reference")
        assert _structure(ref) == _structure(hf), cfg.get("_name_or_path", cfg["model_type"])


@needs_transformers
@pytest.mark.parametrize("family", REFERENCE_FAMILIES)
def test_same_weights_give_the_same_loss(family: str) -> None:
    import torch

    from memcalc_gui.measure.cpu_step import build_model

    cfg = small(family, rms_norm_eps=1e-5)
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    for attention in ("sdpa", "eager"):
        hf = build_model(cfg, attention=attention, builder="transformers")
        ref = build_model(cfg, attention=attention, builder="reference")
        with torch.no_grad():  # random norms too, so that Gemma's (1 + w) and the q/k norms matter
            for p in hf.parameters():
                p.normal_(0.0, 0.05)
        ref.load_state_dict(hf.state_dict())
        expected = hf(input_ids=ids, labels=ids)
        got = ref(input_ids=ids, labels=ids)
        torch.testing.assert_close(got.logits, expected.logits)
        torch.testing.assert_close(got.loss, expected.loss)


# ---- against transformers: a measured training step, to the byte -----------------------------------
def _events(tracker: Any) -> list[tuple[Any, ...]]:
    """The event log as (kind, bytes, op, dtype, shape, phase, iteration, micro), free runs sorted."""
    rows: list[tuple[Any, ...]] = []
    run: list[tuple[Any, ...]] = []
    for ev in tracker.events:
        if ev.kind in ("alloc", "free") and ev.delta == 0:
            continue  # transformers' init lifts two empty tensors
        rec = tracker.records.get(ev.sid) if ev.sid else None
        row = (ev.kind, ev.delta, rec.op if rec else ev.op, rec.dtype if rec else "", rec.shape if rec else (),
               ev.phase, ev.iteration, ev.micro)
        if ev.kind == "free":
            run.append(row)
            continue
        rows.extend(sorted(run))
        run = []
        rows.append(row)
    rows.extend(sorted(run))
    return rows


def _measure(monkeypatch: pytest.MonkeyPatch, config: dict[str, Any], builder: str, **kw: Any) -> tuple[Any, Any]:
    from memcalc_gui.measure import cpu_step

    seen: list[Any] = []

    class Recording(cpu_step.LiveStorageTracker):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            seen.append(self)

    monkeypatch.setattr(cpu_step, "LiveStorageTracker", Recording)
    m = cpu_step.measure_training_step(config, batch=2, seq=64, builder=builder, **kw)
    return m, (_events(seen[0]) if seen else None)


def _assert_same_step(monkeypatch: pytest.MonkeyPatch, config: dict[str, Any], *, events: bool = True,
                      **kw: Any) -> None:
    hf, hf_events = _measure(monkeypatch, config, "transformers", **kw)
    ref, ref_events = _measure(monkeypatch, config, "reference", **kw)
    assert ref.params == hf.params
    for name, phase in hf.phases.items():
        mine = ref.phases[name]
        assert mine.peak_bytes == phase.peak_bytes, name
        assert (mine.live_bytes, mine.objects, mine.compute_copy_bytes) == (
            phase.live_bytes, phase.objects, phase.compute_copy_bytes), name
        assert mine.modules == phase.modules and mine.transient_objects == phase.transient_objects, name
    assert [r.phase_peaks for r in ref.iterations] == [r.phase_peaks for r in hf.iterations]
    assert [r.live_bytes_end for r in ref.iterations] == [r.live_bytes_end for r in hf.iterations]
    if events and hf_events is not None:
        assert len(ref_events) == len(hf_events)
        first = next((i for i, (a, b) in enumerate(zip(ref_events, hf_events, strict=True)) if a != b), None)
        assert first is None, f"event {first}: reference {ref_events[first]} != transformers {hf_events[first]}"


# Every family in every precision, attention and checkpointing (72 steps, about 15 s with the heap frozen).
STEP_CASES = [
    (f, p, a, c)
    for f in REFERENCE_FAMILIES
    for p in ("fp32", "mixed", "bf16")
    for a in ("sdpa", "eager")
    for c in ("none", "full")
]


# the default suite: each family once, each precision, attention and checkpointing twice among them
STEP_KEPT = [i * 12 + k for i, k in enumerate((0, 7, 9, 6, 3, 10))]


@needs_transformers
@pytest.mark.parametrize(("family", "precision", "attention", "checkpointing"), sample(STEP_CASES, STEP_KEPT),
                         ids=["-".join(c) for c in STEP_CASES])
def test_step_equals_transformers_to_the_byte(
    monkeypatch: pytest.MonkeyPatch, family: str, precision: str, attention: str, checkpointing: str
) -> None:
    _assert_same_step(monkeypatch, small(family), precision=precision, attention=attention,
                      checkpointing=checkpointing)


VARIANTS = [
    # a sliding window shorter than the sequence: a mask even for SDPA, hence repeated k/v
    ("mistral", {"sliding_window": 16}, {"precision": "mixed", "attention": "sdpa"}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
     {"precision": "bf16", "attention": "eager", "checkpointing": "full"}),
    # tied head with biases; head_dim above SDPA's GQA limit (256); llama3 rope and module attribution
    ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
     {"precision": "mixed", "optimizer_impl": "foreach", "grad_accum": 2}),
    ("gemma", {"head_dim": 272}, {"precision": "bf16", "attention": "sdpa"}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 256}},
     {"precision": "fp32", "module_names": True}),
]


@needs_transformers
@pytest.mark.parametrize(("family", "overrides", "kw"), VARIANTS, ids=[f"{v[0]}-{i}" for i, v in enumerate(VARIANTS)])
def test_config_variants_equal_transformers(
    monkeypatch: pytest.MonkeyPatch, family: str, overrides: dict[str, Any], kw: dict[str, Any]
) -> None:
    _assert_same_step(monkeypatch, small(family, **overrides), **kw)


@needs_transformers
@pytest.mark.parametrize(("family", "precision", "attention", "checkpointing"),
                         [("qwen3", "mixed", "eager", "none"), ("phi3", "bf16", "sdpa", "full")])
def test_fake_trace_equals_transformers(
    monkeypatch: pytest.MonkeyPatch, family: str, precision: str, attention: str, checkpointing: str
) -> None:
    """The fake-tensor trace (CUDA rounding, module names) as memcalc_gui.trace runs it."""
    from memcalc_gui.trace.fake import unpacked_sequences

    with unpacked_sequences():
        _assert_same_step(monkeypatch, small(family), events=False, precision=precision, attention=attention,
                          checkpointing=checkpointing, fake=True, round_to=512, module_names=True)
