"""A chunked fused linear cross-entropy for the measured and traced step: the full tokens × vocabulary logits
never exist.

Why memcalc runs its own: Liger's ``LigerFusedLinearCrossEntropyFunction`` (liger_kernel/ops/
fused_linear_cross_entropy.py) is Triton-only, and a CPU step — real or on fake tensors — must run the same
computation to measure it rather than claim it. The algorithm is Liger's:

- chunk size ``next_power_of_2(ceil(BT / ceil(V / H)))`` rows (:func:`liger_chunk_rows`), so a chunk's logits are
  about as large as the hidden states;
- per chunk: the logits ``x_c @ Wᵀ`` (the compute dtype), the loss and the logits' gradient, then
  ``grad_x[c] = grad_logits @ W`` and ``grad_W += grad_logitsᵀ @ x_c`` (accumulated in fp32, as Liger does on
  CUDA with ``addmm(out_dtype=float32)``);
- ``grad_x`` (BT × H, the input's dtype) and ``grad_W`` (V × H, the weight's dtype) are computed in forward and
  kept for backward, which only scales them by the incoming gradient.

Where the kernels differ: Liger computes the loss and gradient in place on the chunk's logits in one Triton
kernel; here the fp32 softmax of a chunk is a separate tensor (``core.loss`` models both: the ``cpu`` ledger this,
the ``cuda`` ledger Liger's). The labels are shifted as transformers' ``ForCausalLMLoss`` shifts them (a padded
``-100`` for the last position), the mean taken over the non-ignored tokens.

torch is imported inside functions only (the window starts without it).
"""

from __future__ import annotations

from typing import Any

from ..core.loss import liger_chunk_rows

IGNORE_INDEX = -100


def chunked_causal_lm_loss(hidden: Any, weight: Any, labels: Any, chunk_rows: int | None = None) -> Any:
    """The causal-LM loss of ``hidden`` (batch × seq × H) under the head ``weight`` (V × H), chunked.

    ``labels`` are the input ids (shifted here, the last position of each sequence ignored, as transformers
    does); ``chunk_rows`` overrides Liger's rule."""
    import torch.nn.functional as F

    h = hidden.shape[-1]
    x = hidden.reshape(-1, h)
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    batch, seq = labels.shape
    counted = max(1, batch * (seq - 1))  # the tokens with a label (known from the shape: no data-dependent count)
    rows = chunk_rows or liger_chunk_rows(x.shape[0], h, weight.shape[0])
    return _ChunkedLinearCrossEntropy.apply(x, weight, shifted, rows, counted)


def _function() -> Any:
    import torch

    class ChunkedLinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, target: Any, rows: int, counted: int) -> Any:  # type: ignore
            grad_x = torch.zeros_like(x) if x.requires_grad else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
                if weight.requires_grad else None
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            for start in range(0, x.shape[0], rows):
                x_c = x[start:start + rows]
                t_c = target[start:start + rows]
                logits = x_c @ weight.t()  # in autocast's dtype under mixed precision, as Liger's matmul
                with torch.autocast(x.device.type, enabled=False):
                    probs = logits.float()
                    del logits
                    lse = torch.logsumexp(probs, dim=-1)
                    valid = (t_c != IGNORE_INDEX).unsqueeze(1)
                    index = t_c.clamp(min=0).unsqueeze(1)
                    total += ((lse.unsqueeze(1) - probs.gather(1, index)) * valid).sum()
                    probs.sub_(lse.unsqueeze(1)).exp_()  # the softmax, in place
                    probs.scatter_add_(1, index, -valid.to(probs.dtype))  # minus the one-hot target
                    probs.mul_(valid / counted)  # the logits' gradient of the mean loss
                    if grad_x is not None:  # in the weight's dtype, as Liger's kernel leaves the gradient
                        grad_x[start:start + rows] = probs.to(weight.dtype) @ weight
                    if grad_w is not None:  # accumulated in fp32
                        grad_w.addmm_(probs.t(), x_c.float())
                    del probs
            ctx.save_for_backward(grad_x if grad_x is not None else total.new_empty(0),
                                  grad_w.to(weight.dtype) if grad_w is not None else total.new_empty(0))
            ctx.has = (grad_x is not None, grad_w is not None)
            return total / counted

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> Any:  # type: ignore[override]
            grad_x, grad_w = ctx.saved_tensors
            has_x, has_w = ctx.has
            # scaled in place (accumulation divides the loss), as Liger's element_mul kernel does
            return (grad_x.mul_(grad_out) if has_x else None), (grad_w.mul_(grad_out) if has_w else None), \
                None, None, None

    return ChunkedLinearCrossEntropy


class _Lazy:
    """The autograd Function, built on first use (torch stays unimported until then)."""

    _fn: Any = None

    def apply(self, *args: Any) -> Any:
        if _Lazy._fn is None:
            _Lazy._fn = _function()
        return _Lazy._fn.apply(*args)


_ChunkedLinearCrossEntropy = _Lazy()
