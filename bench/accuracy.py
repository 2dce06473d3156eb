"""Accuracy of the estimators against real CPU training steps.

Builds transformers models from small configs of several families, runs real training steps on the
CPU (AdamW, the implementation CPU uses by default, at least two iterations) under the live-storage
tracker, and prints the per-phase and peak error of the ``analytic`` method and of seed 000's
heuristic (``quick``) for the same setup. Target: every case within ±3 % on the peak.

    python bench/accuracy.py            # the full table
    python bench/accuracy.py --quick    # fewer cases
    python bench/accuracy.py --fitted   # the families without a block model, by the fitted method
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # memcalc_gui and bench.fitted

from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.model import spec_from_config
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES

COMMON = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES: dict[str, dict] = {
    "gpt2": dict(model_type="gpt2", vocab_size=2048, n_embd=192, n_layer=3, n_head=6, n_positions=512,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(COMMON, model_type="llama", vocab_size=2048, hidden_size=192, intermediate_size=512,
                  num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512),
    "mistral": dict(COMMON, model_type="mistral", vocab_size=1536, hidden_size=256, intermediate_size=640,
                    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512),
    "qwen2": dict(COMMON, model_type="qwen2", vocab_size=3000, hidden_size=128, intermediate_size=384,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=512),
    "qwen3": dict(COMMON, model_type="qwen3", vocab_size=2048, hidden_size=192, intermediate_size=512,
                  num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=512),
    "phi3": dict(COMMON, model_type="phi3", vocab_size=2048, hidden_size=192, intermediate_size=512,
                 num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=512),
    "gemma": dict(COMMON, model_type="gemma", vocab_size=4096, hidden_size=128, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                  max_position_embeddings=512),
    "gpt_neox": dict(COMMON, model_type="gpt_neox", vocab_size=2048, hidden_size=192, intermediate_size=768,
                     num_hidden_layers=3, num_attention_heads=6, max_position_embeddings=512),
    "phi": dict(COMMON, model_type="phi", vocab_size=2048, hidden_size=192, intermediate_size=768,
                num_hidden_layers=3, num_attention_heads=6, max_position_embeddings=512, resid_pdrop=0.0,
                embd_pdrop=0.0),
    # a small vocabulary: the decoder layers, not the logits, decide the backward peak
    "llama-wide": dict(COMMON, model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=1024,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512),
    "gpt2-wide": dict(model_type="gpt2", vocab_size=256, n_embd=256, n_layer=2, n_head=4, n_positions=512,
                      bos_token_id=0, eos_token_id=0),
    # the window's scaled-down measurement of Qwen2.5-1.5B: one layer, the (tied) vocabulary dominates
    "qwen2-embedding-tied": dict(COMMON, model_type="qwen2", vocab_size=32000, hidden_size=128, intermediate_size=256,
                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=True, max_position_embeddings=512),
    "qwen2-embedding-untied": dict(COMMON, model_type="qwen2", vocab_size=32000, hidden_size=128,
                                   intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=512),
}

CASES = [
    # (batch, seq, precision, attention, checkpointing, grad_accum)
    (2, 128, "fp32", "sdpa", "none", 1),
    (2, 128, "mixed", "sdpa", "none", 1),
    (1, 256, "bf16", "sdpa", "none", 1),
    (2, 64, "fp32", "eager", "none", 1),
    (2, 128, "mixed", "sdpa", "full", 1),
    (2, 64, "fp32", "sdpa", "none", 2),
    # activation-heavy shapes: the forward/backward peaks dominate the step
    (8, 256, "mixed", "sdpa", "none", 1),
    (4, 256, "fp32", "eager", "none", 1),
    (8, 256, "bf16", "sdpa", "full", 2),
    # accumulation under autocast (existing gradients change the backward moments)
    (1, 64, "mixed", "sdpa", "none", 4),
    # a loop that keeps the config's use_cache=True (transformers' DynamicCache copies k and v)
    (2, 128, "mixed", "sdpa", "none", 1, True),
    (2, 64, "fp32", "eager", "none", 1, True),
]


#: LoRA through peft: (family, precision, targets, dropout, checkpointing, rank).
LORA_CASES = [
    ("llama", "fp32", "all-linear", 0.0, "none", 16), ("llama", "mixed", "all-linear", 0.0, "none", 16),
    ("llama", "fp32", "q_proj,v_proj", 0.0, "none", 16), ("llama", "fp32", "all-linear", 0.05, "none", 16),
    ("llama", "bf16", "all-linear", 0.0, "none", 16), ("llama", "mixed", "all-linear", 0.0, "full", 8),
    ("gpt2", "fp32", "all-linear", 0.0, "none", 16), ("gpt2", "mixed", "c_attn", 0.05, "none", 8),
    ("phi3", "mixed", "all-linear", 0.0, "none", 8), ("phi3", "bf16", "qkv_proj", 0.1, "none", 16),
    ("gpt_neox", "fp32", "all-linear", 0.05, "none", 16), ("phi", "mixed", "all-linear", 0.0, "none", 16),
    ("gemma", "mixed", "attention", 0.0, "none", 16), ("qwen2", "mixed", "all-linear", 0.05, "full", 16),
    ("qwen3", "bf16", "mlp", 0.0, "none", 32), ("mistral", "mixed", "q,k,v,o", 0.1, "none", 64),
    ("gpt_neox", "fp32", "attention", 0.0, "none", 8), ("phi", "mixed", "attention", 0.0, "none", 16),
    # a bf16-loaded model under autocast (Trainer's bf16=True): peft's fp32 adapters see autocast, the base does not
    ("llama", "bf16-autocast", "all-linear", 0.05, "none", 16), ("phi3", "bf16-autocast", "all-linear", 0.0, "none", 8),
    ("gpt2", "bf16-autocast", "all-linear", 0.0, "full", 16),
]
#: QLoRA through transformers' BitsAndBytesConfig and peft on CPU: (family, precision, quantization, dropout, ckpt,
#: prepare_model_for_kbit_training).
QLORA_CASES = [
    ("llama", "mixed", "nf4", 0.0, "none", True), ("llama", "mixed", "nf4", 0.05, "full", True),
    ("gpt2", "mixed", "nf4", 0.0, "none", True), ("qwen2", "bf16", "nf4", 0.0, "none", True),
    ("mistral", "mixed", "fp4", 0.0, "none", True), ("phi3", "mixed", "nf4", 0.0, "none", True),
    ("llama", "bf16", "nf4", 0.0, "none", False), ("qwen2", "bf16", "nf4", 0.05, "full", False),
    ("llama", "bf16-autocast", "nf4", 0.0, "none", True),
]
#: Frozen parts: (family, precision, what trains).
FROZEN_CASES = [("llama", "fp32", "last:1"), ("llama", "mixed", "last:2"), ("qwen2", "fp32", "lm_head"),
                ("gpt2", "fp32", "last:1"), ("llama", "fp32", "lm_head"), ("llama", "mixed", "norms,last:1"),
                ("llama", "fp32", "embeddings"), ("qwen2", "mixed", "norms")]


def run_tuning(impl: str) -> list[dict]:
    """LoRA (peft) and frozen-part steps on CPU against the CPU ledger."""
    from memcalc_gui.core.finetune import FineTuning
    from memcalc_gui.measure.cpu_step import measure_training_step

    cases: list[tuple[str, str, FineTuning, str, str]] = []
    for fam, prec, targets, dropout, ck, rank in LORA_CASES:
        cases.append((fam, prec, FineTuning(method="lora", rank=rank, targets=tuple(targets.split(",")),
                                            dropout=dropout), ck, f"lora r{rank} {targets} p={dropout} ckpt={ck}"))
    for fam, prec, quant, dropout, ck, prepare in QLORA_CASES:
        cases.append((fam, prec, FineTuning(method="qlora", rank=8, quant=quant, dropout=dropout, prepare_kbit=prepare),
                      ck, f"qlora {quant} r8 p={dropout} ckpt={ck}" + ("" if prepare else " no-prep")))
    for fam, prec, parts in FROZEN_CASES:
        cases.append((fam, prec, FineTuning(method="frozen", trainable=tuple(parts.split(","))), "none",
                      f"frozen, trains {parts}"))
    rows = []
    for fam, prec, tuning, ck, label in cases:
        cfg = FAMILIES[fam]
        kw = dict(batch=2, seq=128, precision=prec, optimizer_impl=impl, checkpointing=ck)
        t0 = time.perf_counter()
        m = measure_training_step(cfg, tuning=tuning, **kw)
        est = estimate(TrainingSetup(model=spec_from_config(cfg), tuning=tuning, target_device="cpu", **kw))
        full = estimate(TrainingSetup(model=spec_from_config(cfg), target_device="cpu", **kw))
        rows.append(compare(fam, f"{prec} {label}", m, est, full.peak_tensor_bytes, t0))
    return rows


def compare(family: str, case: str, measured: Any, est: Any, other_peak: int, t0: float) -> dict:
    """One table row: the peak and per-phase errors of ``est`` against ``measured`` (printed as it comes)."""
    # the step's peak: building a model may pass through transients (QLoRA quantizes a full-precision copy
    # here; from_pretrained streams a real checkpoint), so load counts its resident bytes
    step_peak = max([measured.phases["load"].live_bytes] +
                    [measured.phases[ph].peak_bytes for ph in PHASES if ph != "load"])
    row = {"family": family, "case": case, "measured_peak": step_peak,
           "analytic_peak": est.peak_tensor_bytes, "quick_peak": other_peak, "seconds": time.perf_counter() - t0}
    for ph in PHASES:
        # load: the resident parameters (building a tied model briefly allocates an untied head)
        meas = measured.phases[ph].live_bytes if ph == "load" else measured.phases[ph].peak_bytes
        row[ph] = (est.phases[ph].tensor_bytes - meas) / meas * 100
    print(format_row(row), flush=True)
    return row


def run(families: list[str], cases: list[tuple], impl: str) -> list[dict]:
    from memcalc_gui.measure.cpu_step import measure_training_step

    rows = []
    for fam in families:
        cfg = FAMILIES[fam]
        spec = spec_from_config(cfg)
        for b, s, prec, att, ck, acc, *rest in cases:
            cache = bool(rest and rest[0])
            t0 = time.perf_counter()
            m = measure_training_step(cfg, batch=b, seq=s, precision=prec, attention=att, checkpointing=ck,
                                      grad_accum=acc, optimizer="adamw", optimizer_impl=impl, iterations=2,
                                      use_cache=cache)
            setup = TrainingSetup(model=spec, batch=b, seq=s, precision=prec, attention=att, checkpointing=ck,
                                  grad_accum=acc, optimizer="adamw", optimizer_impl=impl, use_cache=cache)
            est = estimate(setup, method="analytic")
            quick = estimate(setup.with_changes(model=None, params=spec.num_params), method="quick")
            case = f"b{b} s{s} {prec} {att} ckpt={ck} accum={acc}" + (" cache" if cache else "")
            rows.append(compare(fam, case, m, est, quick.peak_tensor_bytes, t0))
    return rows


#: The fitted method's cases: (batch, seq, precision, checkpointing, grad_accum); the family's own attention.
FITTED_CASES = [(2, 128, "fp32", "none", 1), (2, 128, "mixed", "none", 1), (1, 256, "bf16", "none", 1),
                (2, 128, "mixed", "full", 1), (2, 64, "fp32", "none", 2), (8, 256, "mixed", "none", 1),
                (8, 256, "bf16", "full", 2)]


def run_fitted(impl: str, quick: bool) -> list[dict]:
    """Families without a block model (bench/fitted.py's, at a small width): the fitted method against real steps,
    calibrated once per precision and checkpointing (the signature) and evaluated at every case's shape."""
    import tempfile

    from bench.fitted import FAMILIES as FITTED
    from bench.fitted import small
    from memcalc_gui.core.fitted import estimate_fitted
    from memcalc_gui.measure.cpu_step import measure_training_step
    from memcalc_gui.trace.fit import calibrate
    from memcalc_gui.trace.meta import count_params_on_meta

    os.environ["MEMCALC_CACHE_DIR"] = tempfile.mkdtemp(prefix="memcalc-fits-")
    rows = []
    for fam, (big, attention, _prec) in FITTED.items():
        if fam in ("llama", "qwen2"):
            continue  # they have block models: the analytic table above
        cfg = small(big)
        n = count_params_on_meta(cfg)
        for b, s, prec, ck, acc in FITTED_CASES[:2] if quick else FITTED_CASES:
            t0 = time.perf_counter()
            setup = TrainingSetup(params=n, batch=b, seq=s, precision=prec, attention=attention,  # type: ignore
                                  checkpointing=ck, grad_accum=acc, optimizer_impl=impl, target_device="cpu")
            fit = calibrate(cfg, setup, n)
            m = measure_training_step(cfg, batch=b, seq=s, precision=prec, attention=attention, checkpointing=ck,
                                      grad_accum=acc, optimizer="adamw", optimizer_impl=impl, iterations=2)
            est = estimate_fitted(setup, fit)
            quick_peak = estimate(setup, method="quick").peak_tensor_bytes
            rows.append(compare(fam, f"fitted b{b} s{s} {prec} {attention} ckpt={ck} accum={acc}", m, est,
                                quick_peak, t0))
    return rows


def format_row(r: dict) -> str:
    err = (r["analytic_peak"] - r["measured_peak"]) / r["measured_peak"] * 100
    qerr = (r["quick_peak"] - r["measured_peak"]) / r["measured_peak"] * 100
    phases = " ".join(f"{r[p]:+6.1f}" for p in PHASES)
    flag = "" if abs(err) <= 3 else "  <-- over ±3 %"
    return (f"{r['family']:<9} {r['case']:<38} {r['measured_peak'] / 2**20:9.2f} {err:+7.2f}% "
            f"{phases}   {qerr:+8.1f}%{flag}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two cases per family")
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES))
    ap.add_argument("--impl", default="single-tensor", choices=["single-tensor", "foreach", "fused"])
    ap.add_argument("--tuning", action="store_true",
                    help="LoRA (peft) and frozen-part steps instead; the last column is full fine-tuning's estimate")
    ap.add_argument("--fitted", action="store_true",
                    help="families without a block model (OPT, Falcon, Mixtral, Qwen3-MoE, …): the fitted method")
    args = ap.parse_args()
    if args.fitted:
        print(f"{'family':<9} {'case':<38} {'meas MiB':>9} {'peak err':>8} "
              f"{'load':>6} {'fwd':>6} {'bwd':>6} {'step':>6}   {'seed 000':>9}")
        rows = run_fitted(args.impl, args.quick)
        errs = [abs(r["analytic_peak"] - r["measured_peak"]) / r["measured_peak"] * 100 for r in rows]
        print(f"\n{sum(e <= 2 for e in errs)}/{len(rows)} cases within ±2 % on the peak; worst {max(errs):.2f} %")
        return
    if args.tuning:
        print(f"{'family':<9} {'case':<38} {'meas MiB':>9} {'peak err':>8} "
              f"{'load':>6} {'fwd':>6} {'bwd':>6} {'step':>6}   {'full FT':>9}")
        rows = run_tuning(args.impl)
        errs = [abs(r["analytic_peak"] - r["measured_peak"]) / r["measured_peak"] * 100 for r in rows]
        print(f"\n{sum(e <= 3 for e in errs)}/{len(rows)} cases within ±3 % on the peak; worst {max(errs):.2f} %")
        return
    families = args.family or list(FAMILIES)
    cases = CASES[:2] if args.quick else CASES
    print(f"{'family':<9} {'case':<38} {'meas MiB':>9} {'peak err':>8} "
          f"{'load':>6} {'fwd':>6} {'bwd':>6} {'step':>6}   {'seed 000':>9}")
    rows = run(families, cases, args.impl)
    errs = [abs(r["analytic_peak"] - r["measured_peak"]) / r["measured_peak"] * 100 for r in rows]
    within = sum(e <= 3 for e in errs)
    print(f"\n{within}/{len(rows)} cases within ±3 % on the peak; worst {max(errs):.2f} %")


if __name__ == "__main__":
    main()
