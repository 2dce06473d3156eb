"""Published peak-memory points next to memcalc's estimate of the same recipe: a sanity bench, not a test.

torchtune's tutorials report the peak memory *reserved* of its Llama-2-7B single-device recipes on one GPU
(docs/source/tutorials/qlora_finetune.rst and lora_finetune.rst, 2024): LoRA 15.57 GB, QLoRA 9.29 GB in training
(torchtune prints GiB as "GB"). Their settings, as in recipes/configs/llama2/7B_{lora,qlora}_single_device.yaml:
batch 2, bf16 weights and adapters (no fp32 cast), activation checkpointing, LoRA rank 8 on q, v, output projection
and the MLP, dropout 0, torch AdamW (bf16 state on bf16 adapters), the Alpaca dataset unpacked — so the sequence
length is the longest sample of each batch (a few hundred tokens, rarely past 1,024). What memcalc cannot match:
the padding-driven sequence length (printed for several lengths below), torchtune's own model code and torchao's NF4
tensor in place of transformers and bitsandbytes, and the loss of the version that was measured. The printed
numbers are memcalc's total (reserved-like: tensors + allocator reserve, without the CUDA context, which
``max_memory_reserved`` does not include).

    python bench/reference_points.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.finetune import FineTuning
from memcalc_gui.core.model import preset_spec
from memcalc_gui.core.setup import TrainingSetup

GIB = 2**30
TARGETS = ("q_proj", "v_proj", "o_proj", "mlp")
#: (recipe, tuning, published peak reserved in training, GiB)
POINTS = [
    ("torchtune LoRA", FineTuning(method="lora", rank=8, targets=TARGETS, dropout=0.0, adapter_dtype="bf16"), 15.57),
    ("torchtune QLoRA", FineTuning(method="qlora", rank=8, targets=TARGETS, dropout=0.0, adapter_dtype="bf16",
                                   prepare_kbit=False), 9.29),
]
SEQS = (256, 512, 1024, 2048)


def main() -> None:
    spec = preset_spec("llama-2-7b")
    print(f"{'recipe':<17}{'published':>10}  " + "".join(f"{f'seq {s}':>10}" for s in SEQS) + "   (GiB, peak reserved)")
    for name, tuning, published in POINTS:
        cells = []
        for seq in SEQS:
            setup = TrainingSetup(model=spec, batch=2, seq=seq, precision="bf16", checkpointing="full",
                                  tuning=tuning, cuda_context_bytes=0)
            est = estimate(setup)
            cells.append(f"{est.peak_bytes / GIB:>10.2f}")
        print(f"{name:<17}{published:>10.2f}  " + "".join(cells))


if __name__ == "__main__":
    main()
