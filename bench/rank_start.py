"""How long a multi-process measurement takes to start its ranks: spawned interpreters against the fork server.

    python bench/rank_start.py [--repeats N]

Each start method runs in a fresh Python process, as a session would: ``measure_sharded_step`` of a 4-layer Llama toy
(hidden 128, 2 × 32 tokens, two iterations) over 2 and 4 gloo ranks, ``N`` times in a row (3 by default). The first
row of ``forkserver`` includes starting the server (its imports of torch and transformers); the rows after reuse it.
``spawn`` starts a new interpreter per rank every time (memcalc's method before, and still on macOS, Windows and in
the frozen app). The time budget of ``memcalc measure`` counts these starts (``measure.layout.start_seconds``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOY = dict(model_type="llama", vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
           eos_token_id=2)


def _child(method: str, world: int, repeats: int) -> None:
    """In the fresh process: ``repeats`` measurements, their seconds printed as one JSON list."""
    sys.path.insert(0, str(ROOT))
    from memcalc_gui.measure import distributed

    if method == "spawn":
        distributed.uses_fork_server = lambda: False  # type: ignore[assignment]
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        distributed.measure_sharded_step(TOY, world=world, strategy="ddp", batch=2, seq=32, precision="fp32",
                                         iterations=2)
        seconds.append(time.perf_counter() - t0)
    print(json.dumps(seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), args.repeats)
        return
    print(f"{'method':<11} {'ranks':>5}  seconds per measurement, in a row (first: a fresh process)")
    for world in (2, 4):
        for method in ("spawn", "forkserver"):
            proc = subprocess.run([sys.executable, __file__, "--repeats", str(args.repeats), "--child", method,
                                   str(world)], capture_output=True, text=True, cwd=ROOT, check=True)
            seconds = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{method:<11} {world:>5}  " + "  ".join(f"{s:6.2f}" for s in seconds))


if __name__ == "__main__":
    main()
