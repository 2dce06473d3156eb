"""On a machine with a CUDA GPU: measure a few setups with the allocator's counters and compare with
the estimate. Prints one table (and writes JSON lines to $OUT/gpu_check.jsonl when OUT is set).

    python bench/gpu_check.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memcalc_gui.core.finetune import FineTuning
from memcalc_gui.core.model import SUPPORTED_FAMILIES, preset_config, preset_spec
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.units import format_bytes
from memcalc_gui.measure.engine import detect_device, measure

SETUPS = [
    dict(preset="gpt2", batch=8, seq=1024, precision="mixed", optimizer_impl="foreach"),
    dict(preset="gpt2", batch=8, seq=1024, precision="fp32", optimizer_impl="fused", attention="eager"),
    dict(preset="qwen2.5-0.5b", batch=4, seq=2048, precision="mixed", optimizer_impl="foreach"),
    dict(preset="qwen2.5-0.5b", batch=4, seq=2048, precision="mixed", checkpointing="full"),
    dict(preset="llama-3.2-1b", batch=4, seq=2048, precision="bf16", optimizer_impl="foreach"),
    dict(preset="qwen2.5-1.5b", batch=2, seq=4096, precision="mixed", optimizer_impl="fused"),
    # fine-tuning on CUDA: peft LoRA under bf16 autocast (dropout masks as bool), QLoRA through bitsandbytes' CUDA
    # kernels with the paged 32-bit AdamW (its paged state is outside the allocator's counters)
    dict(preset="llama-3.2-1b", batch=4, seq=2048, precision="bf16-autocast",
         tuning=FineTuning(method="lora", rank=16)),
    dict(preset="llama-3.2-1b", batch=4, seq=2048, precision="mixed", checkpointing="full",
         optimizer="paged-adamw-32bit", tuning=FineTuning(method="qlora", rank=16)),
    # families without a block model, against the fitted ledger (calibrated for the CUDA step on fake tensors first):
    # Gemma 2 (eager attention, soft-capping) and a mixture of experts (OLMoE, 64 experts, transformers' kernel)
    dict(preset="gemma-2-2b", batch=2, seq=2048, precision="mixed", attention="eager"),
    dict(preset="olmoe-1b-7b", batch=2, seq=2048, precision="bf16", checkpointing="full"),
]


def main() -> None:
    info = detect_device("cuda")
    print(f"device: {info.name}, {format_bytes(info.total_bytes)} total, {format_bytes(info.free_bytes)} free")
    out = Path(os.environ["OUT"]) / "gpu_check.jsonl" if os.environ.get("OUT") else None
    header = (f"{'setup':<58}{'phase':<15}{'measured':>12}{'estimated':>12}{'error':>8}"
              f"{'reserved':>12}")
    print(header)
    for row in SETUPS:
        kw = dict(row)
        name = str(kw.pop("preset"))
        config = preset_config(name)
        if str(config.get("model_type")) in SUPPORTED_FAMILIES:
            setup = TrainingSetup(model=preset_spec(name), capacity_bytes=info.total_bytes, **kw)  # type: ignore[arg-type]
            config = None
        else:  # the fitted method: the config itself is measured, its parameters counted on the meta device
            from memcalc_gui.trace.meta import count_params_on_meta

            setup = TrainingSetup(params=count_params_on_meta(config), capacity_bytes=info.total_bytes,
                                  **kw)  # type: ignore[arg-type]
        label = f"{name} b{setup.batch} s{setup.seq} {setup.precision} {setup.optimizer_impl} " \
                f"{setup.attention} ckpt={setup.checkpointing} {setup.tuning_short()}"
        try:
            r = measure(setup, device="cuda", iterations=3, full_size=True, config=config)
        except Exception as exc:  # report and go on: one script, one table
            print(f"{label:<58}failed: {exc}")
            continue
        if out is not None:
            with out.open("a") as fh:
                fh.write(json.dumps(r.to_json()) + "\n")
        if r.oom:
            print(f"{label:<58}{r.oom}")
            continue
        for phase, reading in r.phases.items():
            est = r.estimate.estimate.phases[phase].tensor_bytes
            print(f"{label:<58}{phase:<15}{format_bytes(reading.peak_bytes):>12}{format_bytes(est):>12}"
                  f"{r.error_pct[phase]:>+7.1f}%{format_bytes(reading.reserved_bytes):>12}")
            label = ""
        print(f"{'':<58}context {format_bytes(r.context_bytes or 0)}, overheads {r.measured_overheads()}, "
              f"signals {r.signals}, leak {r.leak['growing']}")
    snapshot_check(info.total_bytes, out.parent if out is not None else Path("."))


def snapshot_check(capacity: int, where: Path) -> None:
    """A real CUDA memory snapshot of one step (torch.cuda.memory._dump_snapshot), read back by memcalc: its phases
    found from the frames and each phase's peak beside the estimate (issue 16)."""
    from memcalc_gui.core.timeline import compare_phases, read_timeline

    setup = TrainingSetup(model=preset_spec("qwen2.5-0.5b"), batch=4, seq=2048, precision="mixed",
                          capacity_bytes=capacity)
    path = where / "qwen2.5-0.5b-step.pickle"
    try:
        r = measure(setup, device="cuda", iterations=3, full_size=True, snapshot=path)
        tl = read_timeline(path.read_bytes())
    except Exception as exc:
        print(f"snapshot check failed: {exc}")
        return
    print(f"snapshot {path}: {len(tl.events):,} events, phases {[s.phase for s in tl.spans][:8]}, "
          f"reserved {format_bytes(tl.reserved_bytes)}")
    for row in compare_phases(tl, {p: dict(ph.objects) for p, ph in r.estimate.estimate.phases.items()}):
        obj, gap = row.largest_gap
        print(f"  {row.phase:<15}{format_bytes(row.timeline_bytes):>12}{format_bytes(row.estimate_bytes):>12}"
              f"  most in {obj} ({format_bytes(abs(gap))})")


if __name__ == "__main__":
    main()
