"""Measure one tiny training step on CPU and print peaks, composition and the largest storages.

Example::

    python bench/probe.py --family llama --batch 2 --seq 64 --precision fp32
    python bench/probe.py --family gemma --precision mixed --checkpointing full --top 15
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from memcalc_gui.core.model import SUPPORTED_FAMILIES

_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

FAMILIES = SUPPORTED_FAMILIES


def tiny_config(
    family: str,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 688,
    vocab: int = 1000,
    positions: int = 512,
    tie: bool | None = None,
) -> dict[str, Any]:
    """A small valid HF config dict for ``family`` (tied embeddings: the family's default)."""
    head_dim = hidden // heads
    if family == "gpt2":
        cfg: dict[str, Any] = {
            "n_embd": hidden,
            "n_head": heads,
            "n_layer": layers,
            "n_inner": intermediate,
            "n_positions": positions,
            "vocab_size": vocab,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
    elif family == "gpt_neox":
        cfg = {
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_hidden_layers": layers,
            "intermediate_size": intermediate,
            "max_position_embeddings": positions,
            "vocab_size": vocab,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
    elif family in ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "phi"):
        cfg = {
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "num_hidden_layers": layers,
            "intermediate_size": intermediate,
            "max_position_embeddings": positions,
            "vocab_size": vocab,
            **_TOKENS,
        }
        if family in ("qwen3", "gemma", "mistral"):
            cfg["head_dim"] = head_dim
    else:
        raise SystemExit(
            f"unknown family {family!r}; choose from {', '.join(FAMILIES)}"
        )
    cfg["model_type"] = family
    if tie is not None:
        cfg["tie_word_embeddings"] = tie
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure, print."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from memcalc_gui.measure.cpu_step import (
        CHECKPOINTING,
        OPTIMIZER_IMPLS,
        OPTIMIZERS,
        PRECISIONS,
        TRANSIENT,
        format_measurement,
        measure_training_step,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=FAMILIES, default="llama")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32")
    ap.add_argument("--attention", default="sdpa", help="sdpa or eager")
    ap.add_argument("--checkpointing", choices=CHECKPOINTING, default="none")
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    ap.add_argument(
        "--optimizer-impl", choices=OPTIMIZER_IMPLS, default="single-tensor"
    )
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=1000)
    tie = ap.add_mutually_exclusive_group()
    tie.add_argument("--tie", dest="tie", action="store_true", default=None)
    tie.add_argument("--no-tie", dest="tie", action="store_false")
    ap.add_argument(
        "--top", type=int, default=10, help="largest storages per phase peak"
    )
    ap.add_argument(
        "--all-storages",
        action="store_true",
        help="list weights, optimizer state and inputs too (default: transient objects only)",
    )
    args = ap.parse_args(argv)

    config = tiny_config(
        args.family,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
        positions=max(512, args.seq),
        tie=args.tie,
    )
    t0 = time.perf_counter()
    m = measure_training_step(
        config,
        batch=args.batch,
        seq=args.seq,
        precision=args.precision,
        optimizer=args.optimizer,
        optimizer_impl=args.optimizer_impl,
        attention=args.attention,
        checkpointing=args.checkpointing,
        grad_accum=args.grad_accum,
        iterations=args.iterations,
    )
    elapsed = time.perf_counter() - t0
    print(f"config: {config}")
    categories = None if args.all_storages else TRANSIENT
    print(format_measurement(m, top=args.top, categories=categories))
    print(f"measured in {elapsed:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
