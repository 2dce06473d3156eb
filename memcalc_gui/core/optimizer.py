"""Optimizer state and step temporaries, tensor by tensor.

Sources: Transformers docs (Adam 8 B/param, quantized Adam 2 B/param), PyTorch memory notes (AdamW step transient), and
the CPU measurements in shared/NOTES.md: the AdamW step temporaries depend on the implementation —
``foreach`` (torch's CUDA default) allocates one ``sqrt(exp_avg_sq)`` buffer for every parameter at
once (1× the parameters), ``single-tensor`` (torch's CPU default) holds the previous parameter's
denominator while building the next one's (max over i of size[i−1] + 2·size[i]), ``fused`` none.
"""

from __future__ import annotations

from dataclasses import dataclass

from .setup import Optimizer, OptimizerImpl

#: bitsandbytes keeps 32-bit state for tensors with fewer elements than this (``min_8bit_size``).
BNB_MIN_8BIT_SIZE = 4096
#: bitsandbytes blockwise quantisation: one fp32 absmax per block of 256 values, per state.
BNB_BLOCK = 256
#: bitsandbytes' paged optimizers page a state tensor only from this many elements on (``Optimizer8bit.
#: get_state_buffer``: ``p.numel() < 1e5`` stays in PyTorch's allocator); on CPU nothing is paged.
BNB_PAGED_MIN_SIZE = 100_000


@dataclass(frozen=True)
class OptimizerCost:
    state_bytes: int  # in PyTorch's allocator
    step_temporary_bytes: int
    note: str
    paged_bytes: int = 0  # in CUDA unified memory (bitsandbytes' paged optimizers), outside the allocator


def optimizer_cost(
    optimizer: Optimizer,
    impl: OptimizerImpl,
    layout: tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]],
    num_layers: int,
    state_dtype_bytes: int,
    paging: bool = True,
    galore_rank: int = 128,
) -> OptimizerCost:
    """State kept between steps and the transient peak inside ``optimizer.step()``.

    ``layout`` is ``ModelSpec.param_layout()`` (before, one layer, after) in parameter order;
    ``state_dtype_bytes`` is the parameters' element size (torch keeps state in the param dtype).
    ``paging``: whether the paged optimizers can page (CUDA; on CPU bitsandbytes falls back to plain tensors).
    ``galore_rank``: GaLore's rank (``galore-adamw``; the decoder layers' matrices are projected, see :func:`galore`).
    """
    p = state_dtype_bytes
    before, layer, after = layout
    tensors = [(r, c, 1) for r, c in before] + [(r, c, num_layers) for r, c in layer] + [(r, c, 1) for r, c in after]
    numel_total = sum(r * c * k for r, c, k in tensors)

    def single_tensor(per_elem_temp: int) -> int:
        # Peak while building tensor i's temporaries with tensor i-1's result still referenced;
        # two layers in a row cover every adjacent pair.
        sizes = [r * c for r, c in before + layer * min(num_layers, 2) + after]
        best = 0
        prev = 0
        for s in sizes:
            best = max(best, prev + per_elem_temp * s)
            prev = s
        return best * p

    if optimizer == "galore-adamw":
        return galore(layout, num_layers, p, galore_rank)
    if optimizer == "adamw-bf16-states":
        # torchdistx AnyPrecisionAdamW (Trainer's adamw_anyprecision, momentum and variance in bfloat16): a
        # single-tensor loop whose sqrt and bias-corrected denominator are bf16 tensors, the previous parameter's
        # denominator alive while the next is built; fused (Transformer Engine's FusedAdam with bf16 exp_avg and
        # exp_avg_sq, Megatron's precision-aware optimizer): none
        return OptimizerCost(2 * numel_total * 2, 0 if impl == "fused" else single_tensor(2) * 2 // p,
                             "AdamW with bf16 exp_avg and exp_avg_sq beside the weights (AnyPrecisionAdamW, "
                             "Megatron's precision-aware optimizer): 4 B/param of state")
    if optimizer in ("adamw", "adam"):
        state = 2 * numel_total * p
        if impl == "fused":
            temp = 0
        elif impl == "foreach":
            temp = numel_total * p
        else:
            temp = single_tensor(2)
        return OptimizerCost(state, temp,
                             "Adam: exp_avg + exp_avg_sq in the parameter dtype (Transformers docs: 8 B/param)")
    if optimizer in ("adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit"):
        # bitsandbytes Optimizer2State.init_state: two state buffers per tensor, fp32 for 32-bit or below
        # min_8bit_size elements (whatever the parameter dtype), else uint8 plus one fp32 absmax per 256 values;
        # the paged variants put buffers of at least 1e5 elements in unified memory; one fused kernel, no temporaries
        paged_variant = optimizer.startswith("paged")
        state = paged = 0
        for r, c, k in tensors:
            n = r * c
            eight = optimizer != "paged-adamw-32bit" and n >= BNB_MIN_8BIT_SIZE
            buffers = k * 2 * n * (1 if eight else 4)
            if paged_variant and paging and n >= BNB_PAGED_MIN_SIZE:
                paged += buffers
            else:
                state += buffers
            if eight:
                state += k * 2 * 4 * -(-n // BNB_BLOCK)
        if optimizer == "adamw-8bit":
            note = "bitsandbytes 8-bit AdamW: 2 B/param + blockwise absmax (Transformers docs)"
        else:
            bits = "8-bit: 2 B/param + blockwise absmax" if "8bit" in optimizer else "32-bit: 8 B/param in fp32"
            where = ("tensors of at least 100,000 elements in CUDA unified memory, outside PyTorch's allocator "
                     "(not in max_memory_allocated; the driver can evict them to host memory under pressure, "
                     "slowly); smaller ones in the allocator") if paging else "on CPU nothing is paged"
            note = f"bitsandbytes paged AdamW {bits}; {where}"
        return OptimizerCost(state, 0, note, paged)
    if optimizer == "sgd":
        return OptimizerCost(0, 0, "plain SGD keeps no state")
    if optimizer in ("sgd-momentum", "lion"):
        temp = 0 if optimizer == "sgd-momentum" else (numel_total * p if impl == "foreach" else single_tensor(1))
        return OptimizerCost(numel_total * p, temp, "one momentum buffer per parameter")
    # adafactor (torch.optim.Adafactor): factored second moment for matrices (row + column vectors), full for
    # vectors, in the parameter dtype. Measured on CPU: foreach holds one update buffer for every parameter;
    # single-tensor holds the previous parameter's update while building the next one (1× per element).
    state = 0
    for r, c, k in tensors:
        state += k * ((r + c) * p if c > 1 else r * p)
    temp = numel_total * p if impl == "foreach" else single_tensor(1)
    return OptimizerCost(state, temp, "Adafactor: factored second moment, no first moment")


def galore(layout: tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]], num_layers: int,
           p: int, rank: int) -> OptimizerCost:
    """GaLore's AdamW (galore-torch ``GaLoreAdamW``, Trainer's ``galore_adamw`` on the attention and MLP linears;
    Zhao et al. 2024, arXiv:2403.03507), from its source and checked on CPU steps byte for byte (state):

    - a projected m × n weight keeps Adam's two moments of its r × max(m, n) projected gradient (r ≤ min(m, n)) and
      the projection matrix from an SVD of the gradient (``GaLoreProjector.get_orthogonal_matrix``): for an fp32
      gradient a slice of the SVD factor, a view that keeps the whole min(m, n)² factor alive; for a 16-bit one an
      r × min(m, n) copy;
    - every other tensor keeps plain AdamW's two moments;
    - a projected weight's step holds its projected gradient, denominator and update, and the update projected back
      to m × n and scaled (two full-size tensors); another tensor's step its denominator and update beside the
      previous tensor's update; every ``update_proj_gap`` steps (200) the projection is refreshed: the SVD's
      factors U, S, Vh in fp32 (and an fp32 copy of a 16-bit gradient) beside the previous update. The SVD's own
      workspace (LAPACK's or cuSOLVER's) is not counted.
    """
    before, layer, after = layout
    flagged = [(r, c, 1, False) for r, c in before] + [(r, c, num_layers, c > 1) for r, c in layer] + \
        [(r, c, 1, False) for r, c in after]
    state = 0
    for r, c, k, projected in flagged:
        n = r * c
        if projected:
            small, big = min(r, c), max(r, c)
            rr = min(rank, small)
            state += k * (2 * rr * big * p + (small * small * 4 if p == 4 else rr * small * p))
        else:
            state += k * 2 * n * p
    temp = prev = 0
    order = [(r, c, c > 1) for r, c in layer] * min(num_layers, 2) if num_layers else []
    for r, c, projected in [(r, c, False) for r, c in before] + order + [(r, c, False) for r, c in after]:
        n = r * c
        if projected:
            small, big = min(r, c), max(r, c)
            rr = min(rank, small)
            steady = (2 * n + 3 * rr * big) * p
            svd = (r * small + small + small * c + rr * big + rr * rr) * 4 + (n * 4 if p != 4 else 0) + prev * p
            temp = max(temp, steady, svd)
        else:
            temp = max(temp, (2 * n + prev) * p)
        prev = n
    return OptimizerCost(state, temp, f"GaLore AdamW (galore-torch, rank {rank} on the decoder's attention and MLP "
                                      "linears): low-rank moments and a projection per matrix, the rest AdamW")
