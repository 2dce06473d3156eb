"""Context parallelism per rank: each sequence split over ``cp`` GPUs, attention run as ring attention.

torchtitan's ``context_parallel`` (PyTorch's ``torch.distributed.tensor.experimental.context_parallel``) shards every
sequence into ``2·cp`` chunks, each rank taking two (head and tail, for a balanced causal mask), and runs SDPA as ring
attention: a rank keeps its own queries, keys and values and passes key/value chunks round the ring, merging partial
outputs with their log-sum-exp. So one rank runs the step of ``seq/cp`` tokens per sequence (embeddings, layers, the
head and the loss over its own tokens; what attention saves is its local q, k, v, output and log-sum-exp), and:

- saves, in every layer that is not checkpointed, a copy of the attention output beside SDPA's own: the merged output
  comes out in SDPA's (batch, heads, tokens) order, so transformers' ``transpose(1, 2).contiguous()`` copies it;
- shards its parameters, gradients and optimizer state over ``dp × cp`` (torchtitan's ``dp_shard_cp`` mesh; the
  gradients are reduced over the context-parallel ranks too), which is the data-parallel ledger of ``dp·cp`` ranks.

The ring's own buffers (PyTorch's all-gathered key/value chunks, the fp32 merge, the fp32 key/value gradients passed
back) exist only while a layer's attention runs. Measured in isolation (``trace.context``) they reach 6–40 key/value
chunks, but a language model's step peaks at its loss, where they are gone: the ledger leaves them out, and the
trace, which runs PyTorch's ring attention on the fake process group, counts them where they fall (within 0.8 % of
this ledger on Llama-3.2-1B, docs/parallelism.md).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .errors import InputError
from .layout import tensor_parallel_spec

if TYPE_CHECKING:
    from .ledger import Estimate
    from .setup import TrainingSetup


def check_ring(seq: int, cp: int, attention: str) -> None:
    """:class:`InputError` naming ``cp`` unless a sequence of ``seq`` tokens splits into ``2·cp`` equal chunks and
    attention runs as ring attention (the ledger's check, and the trace's)."""
    if cp == 1:
        return
    if seq % (2 * cp):
        raise InputError("cp", f"a sequence of {seq:,} tokens cannot be split into {2 * cp} equal chunks "
                               f"(context parallelism over {cp} GPUs balances the causal mask with 2 chunks each)")
    if attention == "eager":
        raise InputError("cp", "context parallelism runs SDPA as ring attention: choose sdpa or flash attention")


def check_context_parallel(setup: TrainingSetup) -> None:
    """:class:`InputError` naming ``cp`` unless the setup's sequences split for ring attention (:func:`check_ring`)
    and hold no packed documents."""
    check_ring(setup.seq, setup.parallel.cp, setup.attention)
    if setup.parallel.cp > 1 and setup.packing:
        raise InputError("cp", "packed documents beside context parallelism are not modelled yet")


def context_parallel_estimate(setup: TrainingSetup) -> Estimate:
    """The ledger of one context-parallel rank (see the module's docstring)."""
    from .analytic import estimate_analytic
    from .ledger import with_overheads
    from .setup import checkpoint_every

    par = setup.parallel
    cp = par.cp
    check_context_parallel(setup)
    rank = dataclasses.replace(setup, seq=setup.seq // cp, parallel=dataclasses.replace(par, cp=1))
    est = estimate_analytic(rank)
    assert setup.model is not None
    spec = tensor_parallel_spec(setup.model, par.tp, par.loss_parallel)
    t = rank.tokens
    m = 2 if setup.precision in ("mixed", "bf16", "bf16-autocast") else 4
    # the merged output is a new tensor in SDPA's (batch, heads, tokens) order, so the output projection's input is a
    # copy of it (transformers' transpose(1, 2).contiguous()), saved beside SDPA's own by every layer that is not
    # checkpointed (traced: trace.context)
    every = checkpoint_every(setup.checkpointing)
    kept = spec.num_layers - (spec.num_layers // every if every else 0)
    copies = kept * t * spec.q_dim * m if setup.activation_offload == "none" else 0
    saved = {"forward": copies, "backward": copies}
    phases = {}
    for ph, ledger in est.phases.items():
        objects = {k: v for k, v in ledger.objects.items() if k not in ("cuda_context", "allocator_reserve")}
        if ph in saved:
            objects["activations"] = objects.get("activations", 0) + saved[ph]
        phases[ph] = with_overheads(objects, ph, setup)
    note = (f"Context parallelism over {cp} GPUs: each runs {rank.seq:,} of every sequence's {setup.seq:,} tokens "
            f"(ring attention; its key/value chunks exist only while a layer's attention runs, below the peak at the "
            f"loss: the trace counts them); parameters, gradients and optimizer state sharded over data parallel × "
            f"context parallel ({par.dp * cp:,})")
    details = dict(est.details, parallel_notes=(note, *est.details.get("parallel_notes", ())))
    # what a pipeline stage's in-flight micro-batches keep and its moments (core.pipeline) hold the copies too (the
    # first layer's moments before its attention has run excepted)
    details["saved_activations_bytes"] = int(details.get("saved_activations_bytes", 0)) + copies
    if "forward_moments" in details:
        details["forward_moments"] = tuple(
            (at, dict(mo, activations=mo.get("activations", 0) + (0 if at.endswith("-first") else copies)))
            for at, mo in details["forward_moments"])
    if "backward_moments" in details:
        details["backward_moments"] = tuple(dict(mo, activations=mo.get("activations", 0) + copies)
                                            for mo in details["backward_moments"])
    return dataclasses.replace(est, setup=setup, phases=phases, details=details, assumptions=(*est.assumptions, note))
