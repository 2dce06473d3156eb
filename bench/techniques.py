"""Accuracy of the memory-saving techniques' rules against real CPU steps (issue 15).

Runs real training steps of small models of three families (Llama, tied Qwen2, GPT-2) with a technique on, and
prints the analytic ledger's forward and backward peaks beside the measured ones, and the host bytes where the
technique uses host memory. Usage::

    python -m bench.techniques [--technique offload|fsdp2|selective|packing|galore] [--family llama]

``fsdp2`` runs ``fully_shard`` over 2 or 4 real CPU processes (gloo) and shows rank 0 against the per-GPU ledger.
``packing`` packs 4 documents of 256 tokens into one row (SDPA with transformers' block-diagonal mask, and
FlashAttention-2's variable-length attention as ``measure.varlen_attention`` runs it on CPU). ``galore`` runs
galore-torch's GaLoreAdamW refreshing its projection every step and shows the backward and optimizer-step peaks.

Prints one table per technique; docs/techniques.md records the output.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

K = 1024
COMMON: dict[str, Any] = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=1024)
#: Small vocabularies and wide MLPs: the layers' activations dominate the step.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(COMMON, model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=1024,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2),
    "qwen2-tied": dict(COMMON, model_type="qwen2", vocab_size=512, hidden_size=256, intermediate_size=768,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gpt2": dict(model_type="gpt2", vocab_size=512, n_embd=256, n_layer=3, n_head=4, n_positions=1024,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


def offload_cases() -> Iterator[dict[str, Any]]:
    for ckpt, offload in (("none", "all"), ("full", "checkpoint-inputs"), ("full", "all")):
        for precision in ("fp32", "mixed", "bf16"):
            yield dict(checkpointing=ckpt, activation_offload=offload, precision=precision)


def fsdp2_cases() -> Iterator[dict[str, Any]]:
    for ranks, reshard, ckpt in ((2, True, "none"), (2, False, "none"), (4, True, "none"), (2, True, "full"),
                                 (4, False, "full")):
        for precision in ("fp32", "mixed", "bf16"):
            yield dict(ranks=ranks, reshard_after_forward=reshard, checkpointing=ckpt, precision=precision)


def selective_cases() -> Iterator[dict[str, Any]]:
    for precision in ("fp32", "mixed", "bf16"):
        yield dict(checkpointing="selective", precision=precision)


def packing_cases() -> Iterator[dict[str, Any]]:
    for attention, precisions in (("sdpa", ("fp32", "mixed", "bf16")), ("flash", ("mixed", "bf16"))):
        for ckpt in ("none", "full"):
            for precision in precisions:
                yield dict(packing=True, attention=attention, checkpointing=ckpt, precision=precision)


def galore_cases() -> Iterator[dict[str, Any]]:
    for precision in ("fp32", "mixed", "bf16"):
        for rank in (32, 200):
            yield dict(optimizer="galore-adamw", galore_rank=rank, precision=precision)


TECHNIQUES = {"offload": offload_cases, "fsdp2": fsdp2_cases, "selective": selective_cases,
              "packing": packing_cases, "galore": galore_cases}


def run(technique: str, families: list[str]) -> list[str]:
    from memcalc_gui.core.distributed import Parallelism
    from memcalc_gui.core.estimate import estimate
    from memcalc_gui.core.model import spec_from_config
    from memcalc_gui.core.setup import TrainingSetup
    from memcalc_gui.measure.cpu_step import measure_training_step
    from memcalc_gui.measure.distributed import measure_sharded_step

    first, second = ("backward", "optimizer step") if technique == "galore" else ("forward", "backward")
    rows = [f"{'family':<11}{'case':<40}{first + ' real → est':>28}{second + ' real → est':>30}{'host real → est':>28}"]
    worst = 0.0
    for family in families:
        cfg = FAMILIES[family]
        spec = spec_from_config(cfg)
        for case in TECHNIQUES[technique]():
            if technique == "fsdp2":  # real gloo processes; every rank holds the same shards here: rank 0 shown
                step = {k: v for k, v in case.items() if k not in ("ranks", "reshard_after_forward")}
                m = measure_sharded_step(cfg, world=case["ranks"], reshard_after_forward=case["reshard_after_forward"],
                                         batch=4, seq=256, optimizer_impl="single-tensor", **step)[0]
                par = Parallelism(gpus=case["ranks"], strategy="fsdp2",
                                  reshard_after_forward=case["reshard_after_forward"])
                e = estimate(TrainingSetup(model=spec, batch=4, seq=256, optimizer_impl="single-tensor",
                                           target_device="cpu", parallel=par, **step), "analytic")
            elif technique == "packing":  # 4 documents of 256 tokens in one row of 1,024
                step = {k: v for k, v in case.items() if k != "packing"}
                m = measure_training_step(cfg, batch=1, seq=1024, documents=4, optimizer_impl="single-tensor", **step)
                e = estimate(TrainingSetup(model=spec, batch=4, seq=256, optimizer_impl="single-tensor",
                                           target_device="cpu", **case), "analytic")
            elif technique == "galore":  # every step refreshes the projection: the worst step (every 200th)
                if family == "gpt2":
                    continue  # Conv1D layers: not GaLore's targets
                m = measure_training_step(cfg, batch=4, seq=256, optimizer_impl="single-tensor", galore_gap=1, **case)
                e = estimate(TrainingSetup(model=spec, batch=4, seq=256, optimizer_impl="single-tensor",
                                           target_device="cpu", **case), "analytic")
            else:
                m = measure_training_step(cfg, batch=4, seq=256, optimizer_impl="single-tensor", **case)
                e = estimate(TrainingSetup(model=spec, batch=4, seq=256, optimizer_impl="single-tensor",
                                           target_device="cpu", **case), "analytic")
            cells = []
            for phase in ("forward", "backward") if technique != "galore" else ("backward", "optimizer_step"):
                real, est = m.phases[phase].peak_bytes, e.phases[phase].tensor_bytes
                err = (est - real) / real
                worst = max(worst, abs(err))
                cells.append(f"{real // K:>9,} → {est // K:>9,} KiB {err:+6.2%}")
            real_h, est_h = m.host_bytes, int(e.details.get("host_bytes", 0))
            cells.append(f"{real_h // K:>8,} → {est_h // K:>8,} KiB {(est_h - real_h) / max(real_h, 1):+6.1%}")
            label = " ".join(str(v) for v in case.values() if v is not True)
            rows.append(f"{family:<11}{label:<40}" + "".join(f"{c:>29}" for c in cells))
    rows.append(f"worst peak error: {worst:.2%}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--technique", action="append", choices=sorted(TECHNIQUES))
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES))
    args = ap.parse_args()
    for technique in args.technique or sorted(TECHNIQUES):
        print(f"## {technique}")
        print("\n".join(run(technique, args.family or list(FAMILIES))))


if __name__ == "__main__":
    main()
