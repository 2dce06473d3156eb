"""Real CPU steps in 16-bit precisions with and without ``measure.half_gemm`` (fp32 products on a CPU without
native bf16/fp16 GEMM): seconds per step and whether every phase's peak is the same to the byte.

    python bench/half_gemm.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.techniques import FAMILIES

#: (family, precision, attention, checkpointing, packed documents): the test models of bench/techniques
CASES = [("llama", "mixed", "sdpa", "full", None), ("llama", "mixed", "sdpa", "none", None),
         ("gpt2", "bf16", "eager", "none", None), ("qwen2-tied", "mixed", "sdpa", "none", None),
         ("llama", "bf16", "flash", "none", 4), ("llama", "bf16-autocast", "sdpa", "every:2", None)]


def main() -> None:
    import torch

    from memcalc_gui.measure import cpu_step, half_gemm

    own = half_gemm.slow_half_dtypes
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; this CPU lacks native GEMM in: "
          + (", ".join(str(d) for d in own()) or "nothing (half_gemm changes nothing here)"))
    cpu_step.measure_training_step(FAMILIES["llama"], batch=1, seq=64, precision="fp32")  # imports, warm caches
    print(f"{'case':<42} {'torch s':>8} {'fp32 products s':>16} {'speed-up':>9}  peaks")
    for family, precision, attention, ckpt, docs in CASES:
        seconds, peaks = [], []
        for replace in (False, True):
            half_gemm.slow_half_dtypes = own if replace else (lambda: ())  # type: ignore[assignment]
            start = time.perf_counter()
            m = cpu_step.measure_training_step(FAMILIES[family], batch=1, seq=1024 if docs else 512, documents=docs,
                                               precision=precision, attention=attention, checkpointing=ckpt,
                                               optimizer_impl="single-tensor")
            seconds.append(time.perf_counter() - start)
            peaks.append({name: phase.peak_bytes for name, phase in m.phases.items()})
        half_gemm.slow_half_dtypes = own  # type: ignore[assignment]
        label = f"{family} {precision} {attention} ckpt={ckpt}" + (f" packed×{docs}" if docs else "")
        print(f"{label:<42} {seconds[0]:>8.2f} {seconds[1]:>16.2f} {seconds[0] / seconds[1]:>8.1f}x  "
              + ("same" if peaks[0] == peaks[1] else f"DIFFER {peaks}"))


if __name__ == "__main__":
    main()
