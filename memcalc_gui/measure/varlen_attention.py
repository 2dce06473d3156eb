"""FlashAttention-2's variable-length attention over packed documents, as a CPU stand-in for measuring its memory.

Why this module exists: transformers' ``flash_attention_2`` needs the ``flash_attn`` package and a CUDA GPU, so a
CPU step (and the fake-tensor trace) cannot run it. This registers an attention function with transformers'
public ``AttentionInterface`` that keeps exactly the tensors the real path keeps, so the packed step's memory is
measured rather than claimed:

- transformers' path (``integrations/flash_attention.py``, ``_prepare_from_posids``) transposes q, k and v to
  ``(B, L, heads, D)``, casts fp32 ones to autocast's dtype, and makes each contiguous: copies;
- ``flash_attn_varlen_func`` saves q, k, v, its output and the log-sum-exp (fp32, ``heads × tokens``) for
  backward (flash-attn ``flash_attn_interface.py``); grouped k/v heads are not repeated;
- its backward (``mha_varlen_bwd`` in ``csrc/flash_attn/flash_api.cpp``) allocates dq, dk and dv, for grouped
  heads dk and dv with every head (summed afterwards), an fp32 dq accumulator of ``(tokens + 128·documents) ×
  heads × D rounded up to 32`` and the fp32 softmax row sums ``heads × (tokens + 128·documents)``.

The arithmetic runs PyTorch's CPU flash kernel document by document (causal within each document), so the result
is also numerically attention limited to each document. Only what the step holds is meant to match; speed is not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

#: The name registered with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.
NAME = "memcalc_varlen"

_documents: list[tuple[int, int]] | None = None


@contextlib.contextmanager
def documents(lengths: list[int]) -> Iterator[None]:
    """Run the packed step with documents of these lengths (one row: their sum). Set from the step, which knows
    them, so the fake-tensor trace needs no data-dependent boundaries."""
    global _documents
    bounds, start = [], 0
    for n in lengths:
        bounds.append((start, start + n))
        start += n
    previous, _documents = _documents, bounds
    try:
        yield
    finally:
        _documents = previous


def document_lengths(tokens: int, count: int) -> list[int]:
    """``count`` documents sharing ``tokens`` as evenly as possible (the first ones one token longer)."""
    count = max(1, min(count, tokens))
    base, extra = divmod(tokens, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def register() -> str:
    """Register the attention and its mask function with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)
    return NAME


def varlen_attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                             scaling: float | None = None, **_: Any) -> tuple[Any, None]:
    """transformers' attention signature: q, k, v are ``(B, heads, L, D)``; returns ``(B, L, heads, D)``."""
    import torch

    batch, length = query.shape[0], query.shape[2]
    # packed: the step's documents in one row; otherwise each row is one document
    bounds = _documents if _documents and batch == 1 else [(i * length, (i + 1) * length) for i in range(batch)]
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    if q.dtype == torch.float32 and torch.is_autocast_enabled("cpu"):
        half = torch.get_autocast_dtype("cpu")
        q, k, v = (x.to(half) for x in (q, k, v))
    q, k, v = (x.contiguous().view(-1, x.shape[-2], x.shape[-1]) for x in (q, k, v))
    out = _VarlenFlash.apply(q, k, v, bounds, scaling)
    return out.view(batch, length, *out.shape[-2:]), None


def _flash_cpu(q: Any, k: Any, v: Any, scale: float | None) -> tuple[Any, Any]:
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)[:2]


def _make_function() -> Any:
    import torch

    class VarlenFlash(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, bounds: list[tuple[int, int]],
                    scale: float | None) -> Any:
            rep = q.shape[1] // k.shape[1]
            out = torch.empty_like(q)
            lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
            with torch.autocast("cpu", enabled=False), torch.no_grad():
                for s, e in bounds:
                    kd = k[s:e].repeat_interleave(rep, dim=1) if rep > 1 else k[s:e]
                    vd = v[s:e].repeat_interleave(rep, dim=1) if rep > 1 else v[s:e]
                    o, l_ = _flash_cpu(q[s:e].transpose(0, 1)[None], kd.transpose(0, 1)[None],
                                       vd.transpose(0, 1)[None], scale)
                    out[s:e] = o[0].transpose(0, 1)
                    lse[:, s:e] = l_[0]
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.bounds, ctx.scale = bounds, scale
            return out

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> Any:
            q, k, v, out, lse = ctx.saved_tensors
            heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
            rep = heads // kv_heads
            docs = len(ctx.bounds)
            rows = q.shape[0] + 128 * docs
            dim32 = -(-dim // 32) * 32
            # FlashAttention-2's backward buffers (mha_varlen_bwd): held until the kernel returns
            dq_accum = torch.empty((rows, heads, dim32), dtype=torch.float32, device=q.device)
            softmax_d = torch.empty((heads, rows), dtype=torch.float32, device=q.device)
            dq = torch.empty_like(q)
            dk_all = torch.empty((k.shape[0], heads, dim), dtype=k.dtype, device=k.device) if rep > 1 \
                else torch.empty_like(k)
            dv_all = torch.empty((v.shape[0], heads, dim), dtype=v.dtype, device=v.device) if rep > 1 \
                else torch.empty_like(v)
            with torch.autocast("cpu", enabled=False), torch.no_grad():
                for s, e in ctx.bounds:
                    kd = k[s:e].repeat_interleave(rep, dim=1) if rep > 1 else k[s:e]
                    vd = v[s:e].repeat_interleave(rep, dim=1) if rep > 1 else v[s:e]
                    t = [x.transpose(0, 1)[None] for x in (grad_out[s:e], q[s:e], kd, vd, out[s:e])]
                    g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        t[0], t[1], t[2], t[3], t[4], lse[:, s:e][None], 0.0, True, scale=ctx.scale)
                    dq[s:e] = g[0][0].transpose(0, 1)
                    dk_all[s:e] = g[1][0].transpose(0, 1)
                    dv_all[s:e] = g[2][0].transpose(0, 1)
                del dq_accum, softmax_d
                if rep > 1:  # the kernel sums each group's heads into dk, dv
                    dk = dk_all.view(k.shape[0], kv_heads, rep, dim).sum(2)
                    dv = dv_all.view(v.shape[0], kv_heads, rep, dim).sum(2)
                    del dk_all, dv_all
                else:
                    dk, dv = dk_all, dv_all
            return dq, dk, dv, None, None

    return VarlenFlash


class _Lazy:
    fn: Any = None

    def apply(self, *args: Any) -> Any:
        if self.fn is None:
            self.fn = _make_function()
        return self.fn.apply(*args)


_VarlenFlash = _Lazy()
