"""Speed of the estimator: one analytic estimate (< 1 ms), the max-micro-batch solve (< 50 ms), and the search for
what to change when a setup does not fit (every lever combined; < 100 ms, the window runs it on each edit).

    python bench/speed.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memcalc_gui.core.estimate import estimate
from memcalc_gui.core.model import preset_spec
from memcalc_gui.core.result import evaluate
from memcalc_gui.core.setup import TrainingSetup, find_gpu
from memcalc_gui.core.solver import max_micro_batch


def timeit(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1000


def main() -> None:
    gpu = find_gpu("h100-80gb")
    rows = []
    for name, batch, seq in [("gpt2", 8, 1024), ("qwen2.5-1.5b", 4, 2048), ("llama-3.1-8b", 1, 4096),
                             ("llama-3.1-70b", 1, 8192)]:
        setup = TrainingSetup(model=preset_spec(name), batch=batch, seq=seq, precision="mixed",
                              capacity_bytes=gpu.capacity_bytes, gpu=gpu.id)
        one = timeit(lambda s=setup: estimate(s), 300)
        solve = timeit(lambda s=setup: max_micro_batch(s, estimate, gpu.capacity_bytes), 30)
        full = timeit(lambda s=setup: evaluate(s), 30)
        rows.append((name, batch, seq, one, solve, full))
    print(f"{'model':<16}{'batch':>6}{'seq':>6}{'estimate ms':>13}{'max-batch ms':>14}{'evaluate ms':>13}")
    for r in rows:
        print(f"{r[0]:<16}{r[1]:>6}{r[2]:>6}{r[3]:>13.3f}{r[4]:>14.2f}{r[5]:>13.2f}")
    worst_one = max(r[3] for r in rows)
    worst_solve = max(r[4] for r in rows)
    print(f"\ntargets: estimate < 1 ms ({'met' if worst_one < 1 else 'MISSED'}, worst {worst_one:.3f} ms); "
          f"max-batch solve < 50 ms ({'met' if worst_solve < 50 else 'MISSED'}, worst {worst_solve:.2f} ms)")

    from memcalc_gui.core.distributed import Parallelism

    over = [("llama-3.1-70b", "rtx-4090", dict(batch=4, seq=2048, grad_accum=4)),
            ("llama-3.1-70b", "h100-80gb", dict(batch=4, seq=2048, grad_accum=4,
                                                 parallel=Parallelism(gpus=8, strategy="zero3"))),
            ("qwen2.5-7b", "a100-80gb", dict(batch=4, seq=2048)),
            ("llama-3.1-8b", "t4", dict(batch=64, seq=8192, grad_accum=8, precision="fp32", attention="eager")),
            # a pipeline rank is up to six analytic ledgers (three stages, with and without accumulated gradients)
            ("llama-3.1-70b", "h100-80gb", dict(batch=1, seq=8192, grad_accum=8, parallel=Parallelism(
                gpus=64, tp=8, pp=4, strategy="fsdp2"))),
            ("llama-3.1-8b", "h100-80gb", dict(batch=1, seq=131072, checkpointing="full", parallel=Parallelism(
                gpus=8, strategy="fsdp2"))),
            # issue 62: the lossless tier holds the answer (checkpointing and a chunked loss)
            ("qwen2.5-7b", "h100-80gb", dict(batch=8, seq=4096, parallel=Parallelism(gpus=8, strategy="fsdp2")))]
    print(f"\n{'over capacity':<16}{'gpu':>11}{'evaluate ms':>13}{'fitting':>9}")
    worst_search = 0.0
    for name, gpu_id, kw in over:
        g = find_gpu(gpu_id)
        setup = TrainingSetup(model=preset_spec(name), gpu=g.id, capacity_bytes=g.capacity_bytes, **kw)
        ms = timeit(lambda s=setup: evaluate(s), 5)
        fitting = sum(1 for x in evaluate(setup).verdict.suggestions if x.fits)  # cards that fit
        worst_search = max(worst_search, ms)
        print(f"{name:<16}{gpu_id:>11}{ms:>13.1f}{fitting:>9}")
    print(f"target: evaluate with the search < 100 ms ({'met' if worst_search < 100 else 'MISSED'}, "
          f"worst {worst_search:.1f} ms)")


if __name__ == "__main__":
    main()
