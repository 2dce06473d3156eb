"""The chunked fused linear cross-entropy (Liger's ``LigerFusedLinearCrossEntropyFunction``): what it keeps.

transformers' causal-LM loss materialises the tokens × vocabulary logits (and an fp32 copy, the log-softmax and
their gradients: several ``T·V`` tensors at the loss). Liger-Kernel (liger_kernel/ops/fused_linear_cross_entropy.py)
instead walks the tokens in chunks of ``next_power_of_2(ceil(T / ceil(V / H)))`` rows, so that one chunk's logits
are about as large as the hidden states; for each chunk it computes the logits, the loss and the logits' gradient
in place, and then the gradients of the hidden states (``T × H``) and of the head weight (``V × H``, accumulated
in fp32) — in forward. Backward only scales the two. So the forward holds: the hidden-state gradient, the fp32
head-weight gradient, and one chunk's transients; backward starts with the hidden-state gradient and the head's
gradient already made.

Chunk transients, by device:

- ``cuda`` (Liger's Triton kernel): the chunk's logits in the compute dtype, rewritten in place into their
  gradient, and the chunk of the hidden-state gradient;
- ``cpu`` (memcalc's own torch version, ``measure/chunked_loss.py``, which the CPU step and the trace run): the
  chunk's logits and their fp32 copy beside them (the same tensor when the logits are fp32);
- both, under autocast: the head weight's 16-bit cast, made anew for every chunk (the matmul reads
  ``weight.t()``, a view, which autocast's cast cache does not keep) — so the 16-bit copy of the head that
  transformers' loss keeps through the step is a transient here.

Liger's published memory benchmark (benchmark/data/all_benchmark_data.csv: A100, H 4096, V 128256, bf16,
forward and backward, 4k–32k tokens) grows by 0.7495 MiB per token for transformers' loss and by 0.054 MiB per
token for Liger's (v0.4.2, November 2024). :func:`benchmark_per_token_bytes` gives transformers' slope exactly
(3·V + 2·H bf16 values per token) and 0.031 MiB per token for the current kernel; the 2024 kernel also kept a
scaled copy of each chunk's gradient (``grad_logits_chunk = logits_chunk * alpha``) and the rest of the gap is not
accounted for here — both fused figures are an order of magnitude under transformers' (tests/test_loss.py).
"""

from __future__ import annotations


def liger_chunk_rows(rows: int, hidden: int, vocab: int) -> int:
    """Liger's chunk size: ``next_power_of_2(ceil(rows / ceil(vocab / hidden)))``."""
    inc_factor = -(-vocab // hidden)
    want = -(-rows // inc_factor)
    return 1 << max(0, (want - 1).bit_length())


def chunk_transient_bytes(rows: int, vocab: int, hidden: int, matmul_bytes: int, device: str,
                          autocast: bool) -> int:
    """One chunk's transient bytes at its peak (see the module docstring). Under autocast the head weight's
    16-bit cast is made for every chunk (``weight.t()`` is not a leaf, so autocast's cache does not keep it)."""
    rows = max(1, rows)
    cast = vocab * hidden * 2 + rows * hidden * 2 if autocast else 0  # the weight's and the chunk's casts
    if device == "cuda":
        # the logits, rewritten in place into their gradient; the chunk of the hidden-state gradient
        return max(cast + rows * vocab * matmul_bytes, rows * vocab * matmul_bytes + rows * hidden * matmul_bytes)
    # memcalc's torch version: the logits, then their fp32 copy beside them (the same tensor when fp32)
    upcast = rows * vocab * (matmul_bytes + 4 if matmul_bytes != 4 else 4)
    return max(cast + rows * vocab * matmul_bytes, upcast)


def benchmark_per_token_bytes(kind: str, hidden: int, vocab: int, dtype_bytes: int = 2) -> int:
    """Bytes per token of Liger's own memory benchmark (benchmark/scripts/benchmark_fused_linear_cross_entropy.py,
    mode "full": a bias-free ``Linear(H, V)`` and the loss, forward then backward, repeated so the input's
    ``.grad`` accumulates), for ``kind`` "transformers" (``nn.Linear`` + ``nn.CrossEntropyLoss``) or "liger":

    - transformers: at the loss backward, the saved log-softmax, its gradient and the logits' gradient
      (3·V) beside the input's accumulated gradient and its new one (2·H);
    - Liger: the input, its accumulated gradient and the gradient made in forward (3·H) and one chunk's logits,
      ``V / ceil(V / H)`` per token.
    """
    if kind == "transformers":
        return (3 * vocab + 2 * hidden) * dtype_bytes
    if kind == "liger":
        return 3 * hidden * dtype_bytes + -(-vocab * dtype_bytes // -(-vocab // hidden))
    raise ValueError(f"kind must be transformers or liger, got {kind!r}")
