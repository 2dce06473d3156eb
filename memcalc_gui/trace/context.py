"""One context-parallel rank, traced: the real model running its share of every sequence, with its attention run as
PyTorch's own ring attention (``torch.distributed.tensor.experimental.context_parallel``) on the fake process group.

PyTorch's context parallelism shards each sequence into ``2·cp`` chunks, a rank keeping two (head and tail: the
balanced causal mask), and replaces ``scaled_dot_product_attention`` by a version that wraps the rank's queries,
keys and values as DTensors sharded on the sequence; DTensor's dispatcher then sends SDPA's kernel to
``_templated_ring_attention`` (and its backward), which passes key/value chunks round the ring, runs the kernel on
each and merges the partial outputs by their log-sum-exp (in fp32). This trace enables that dispatcher as
``context_parallel`` does and feeds the model the rank's ``seq/cp`` tokens, which is what ``context_parallel``'s
buffer sharding leaves on it.

One adaptation, stated: PyTorch's dispatcher covers SDPA's CUDA kernels (flash, memory-efficient, cuDNN), and on a
CPU SDPA runs ``_scaled_dot_product_flash_attention_for_cpu``, which it does not list; this trace routes that kernel
and its backward to the same ``_templated_ring_attention`` functions (their arguments are the CUDA flash kernel's
by name, and its output and log-sum-exp have the same shapes). So every buffer of the ring (the key/value chunks
gathered or passed on, the fp32 merge, the fp32 key/value gradients travelling back) is PyTorch's own, allocated on
fake storage; only the kernel's own workspace, which the CUDA kernels keep inside the call, is not seen.

torch is imported inside functions only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..core.errors import InputError

#: PyTorch's ways of passing key/value chunks round the ring (``set_rotate_method``), by the names it takes.
ROTATE_METHODS = ("allgather", "alltoall")


class RingNotRun(InputError):
    """The traced step never reached the ring: its attention did not run through SDPA's fused kernel."""


@contextlib.contextmanager
def ring_attention(mesh: Any, rotate: str = "allgather") -> Iterator[list[int]]:
    """PyTorch's context-parallel SDPA over ``mesh`` (the context-parallel dimension of a mesh on the fake process
    group) for the duration; yields a one-item list counting the ring-attention calls, so the caller can tell that
    the step used it."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    if rotate not in ROTATE_METHODS:
        raise InputError("rotate", f"must be one of {', '.join(ROTATE_METHODS)}, got {rotate!r}")
    aten = torch.ops.aten
    forward_op = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward_op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    cp = mesh.size()
    calls = [0]

    def ring(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The CPU kernel's call as DTensor's dispatcher hands it over, run by PyTorch's templated ring attention."""
        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        local, options = list(info.local_args), dict(info.local_kwargs)
        if options.get("attn_mask") is not None:
            raise InputError("cp", "ring attention runs a causal mask only; this step passed SDPA a mask of its own")
        group, seq_dim = info.compute_mesh.get_group(), 2
        if op_call == forward_op:
            q, k, v = local[:3]
            dropout = local[3] if len(local) > 3 else options.get("dropout_p", 0.0)
            causal = local[4] if len(local) > 4 else options.get("is_causal", False)
            out = cp_attention._templated_ring_attention(
                group, seq_dim, forward_op, query=q, key=k, value=v, is_causal=causal, dropout_p=dropout,
                scale=options.get("scale"))
        else:
            grad_out, q, k, v, o, lse, dropout, causal = local[:8]
            out = cp_attention._templated_ring_attention_backward(
                group, seq_dim, backward_op, grad_out=grad_out, grad_out_name="grad_out", query=q, key=k, value=v,
                out=o, logsumexp=lse, is_causal=causal, dropout_p=dropout, scale=options.get("scale"))
        calls[0] += 1
        wrapped = []
        for t in out:  # each output sharded on the sequence, as the CUDA kernels' rules place them
            shape = list(t.shape)
            shape[seq_dim] *= cp
            spec = DTensorSpec(info.compute_mesh, (Shard(seq_dim),),
                               tensor_meta=TensorMeta(torch.Size(shape), t.stride(), t.dtype))
            wrapped.append(DTensor(t, spec, requires_grad=False))
        return tuple(wrapped)

    options = cp_attention._cp_options
    saved = (options.enable_load_balance, options.rotate_method)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    options.enable_load_balance = True  # context_parallel's head-tail split for a causal mask
    cp_attention.set_rotate_method(rotate)
    cp_attention._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
    DTensor._op_dispatcher._custom_op_handlers = {**DTensor._op_dispatcher._custom_op_handlers,
                                                  forward_op: ring, backward_op: ring}
    try:
        yield calls
    finally:
        cp_attention._disable_context_parallel_dispatcher_impl()
        DTensor._op_dispatcher._custom_op_handlers = handlers
        options.enable_load_balance, options.rotate_method = saved
