"""What real memory snapshots hold, beside the limits memcalc reads them within (issue 61), and what reading costs.

    python -m bench.snapshot_limits [--layers 4] [--iterations 2]

1. Real snapshots: PyTorch builds one from the CPU profile of real training steps (``_profile_to_snapshot``, the
   structure ``torch.cuda.memory._dump_snapshot`` writes, with the profiler's Python stacks) of a small Llama and
   GPT-2; printed: entries, stack depth, the longest frame text, pickle size, and the time to read it.
2. A large run's entry count, from memcalc's own trace of Llama-3.1-70B at micro-batch 1 × 4096 (fake tensors): the
   allocations and frees of one iteration on one GPU; a CUDA snapshot records 3 entries a tensor (alloc,
   free_requested, free_completed).
3. The cost of reading at the limits: a synthetic snapshot of 1 M entries with 60-frame stacks, PyTorch's shape.

Prints tables; docs/reliability.md records them.
"""

from __future__ import annotations

import argparse
import pickle
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _stats(snap: dict[str, Any]) -> tuple[int, int, int, int]:
    trace = snap["device_traces"][0]
    frames = [e.get("frames", []) for e in trace]
    texts = [len(f[k]) for fs in frames for f in fs for k in ("filename", "name")]
    unique = len({id(f) for fs in frames for f in fs})
    return len(trace), max(map(len, frames), default=0), max(texts, default=0), unique


def real_snapshots(layers: int, iterations: int) -> None:
    import torch
    from torch.cuda._memory_viz import _profile_to_snapshot

    from bench.techniques import FAMILIES
    from memcalc_gui.core.timeline import _check_opcodes, read_timeline
    from memcalc_gui.measure.cpu_step import build_model, step_forward

    print(f"{'model':<22}{'entries':>9}{'deepest stack':>15}{'longest text':>14}{'frames':>8}{'pickle':>10}"
          f"{'walk':>8}{'read':>8}")
    for family in ("llama", "gpt2"):
        cfg = dict(FAMILIES[family])
        cfg["num_hidden_layers" if family == "llama" else "n_layer"] = layers
        model = build_model(cfg, precision="fp32")
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        ids = torch.randint(0, 512, (2, 128))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                    record_shapes=True, with_stack=True) as prof:
            for _ in range(iterations):
                step_forward(model, ids, "fp32").backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        snap = _profile_to_snapshot(prof)
        data = pickle.dumps(snap, protocol=4)
        entries, deepest, longest, unique = _stats(snap)
        t0 = time.perf_counter()
        _check_opcodes(data)
        walk = time.perf_counter() - t0
        t0 = time.perf_counter()
        read_timeline(data)
        read = time.perf_counter() - t0
        print(f"{family + f' {layers} layers × {iterations}':<22}{entries:>9,}{deepest:>15}{longest:>14}{unique:>8,}"
              f"{len(data) / 2**20:>8.1f}MB{walk:>7.2f}s{read:>7.2f}s")


def large_run() -> None:
    from memcalc_gui.core.model import preset_spec
    from memcalc_gui.core.setup import TrainingSetup
    from memcalc_gui.trace.fake import trace_estimate

    setup = TrainingSetup(model=preset_spec("llama-3.1-70b"), batch=1, seq=4096, checkpointing="none")
    t0 = time.perf_counter()
    traced = trace_estimate(setup)
    assert traced.timeline is not None
    events = len(traced.timeline.events)
    per_iteration = events // 2  # the trace runs two iterations
    print(f"\nLlama-3.1-70B, 1 × 4096, one GPU (trace, {time.perf_counter() - t0:.0f} s): {per_iteration:,} "
          f"allocations and frees an iteration → about {per_iteration * 3 // 2:,} snapshot entries an iteration")


def synthetic_read(entries: int, depth: int = 60) -> None:
    from memcalc_gui.core.timeline import read_timeline

    rng = random.Random(0)
    frames = [{"filename": f"/usr/lib/python3/site-packages/transformers/models/llama/m{i}.py", "line": i,
               "name": f"forward_{i % 17}"} for i in range(3_000)]
    stacks = [[rng.choice(frames) for _ in range(depth)] for _ in range(5_000)]
    trace = []
    for i in range(entries // 3):
        stack = rng.choice(stacks)
        size = rng.randrange(512, 1 << 28, 512)
        trace.append({"action": "alloc", "addr": 1 << 40 | i << 20, "size": size, "stream": 0, "frames": stack})
        for action in ("free_requested", "free_completed"):
            trace.append({"action": action, "addr": 1 << 40 | i << 20, "size": size, "stream": 0,
                          "frames": stack})
    data = pickle.dumps({"segments": [], "device_traces": [trace]}, protocol=4)
    del trace
    t0 = time.perf_counter()
    tl = read_timeline(data)
    print(f"\nsynthetic {entries:,} entries × {depth}-frame stacks ({len(data) / 2**20:.0f} MB): read in "
          f"{time.perf_counter() - t0:.1f} s, {len(tl.events):,} events")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--entries", type=int, default=1_000_000)
    args = parser.parse_args()
    real_snapshots(args.layers, args.iterations)
    large_run()
    synthetic_read(args.entries)


if __name__ == "__main__":
    main()
