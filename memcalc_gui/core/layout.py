"""Model parallelism per rank: what one GPU of a tensor-parallel group holds.

Tensor parallelism as transformers' own plans apply it (``base_model_tp_plan`` of each config class; PyTorch's
``ColwiseParallel`` / ``RowwiseParallel``, the layout of Megatron-LM's column- and row-parallel linears, Shoeybi et
al. 2019): q, k, v and the MLP's up (and gate) projections split by output features, so each rank computes
``heads / tp`` attention heads and ``intermediate / tp`` MLP features; the output and down projections split by
input features and all-reduce their output. Embeddings, norms and the LM head stay replicated in the base plans;
with loss parallelism (torchtitan's ``loss_parallel``, Megatron-LM's vocab-parallel embedding and cross-entropy) the
embedding's rows and the head's columns split too (``RowwiseParallel``/``ColwiseParallel`` with sharded logits), and a
rank runs the model with a ``tp``-th of the vocabulary.

So one rank of a ``tp``-way group runs exactly the decoder of a model with ``heads / tp`` query heads,
``kv_heads / tp`` key/value heads and ``intermediate / tp`` MLP features, at full hidden size: the same parameters,
saved tensors and temporaries (the trace of the real parallelized model on the fake process group equals the step of
that narrower model byte for byte, ``tests/test_layout.py``). The ledger of a rank is the ledger of that model.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from .errors import InputError
from .model import ModelSpec

#: Families whose transformers tensor-parallel plan is plain column/row-wise on the decoder's linears (GPT-2's
#: Conv1D has no plan; Phi-3's fused projections gather their outputs).
TP_FAMILIES: Final = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi", "gpt_neox")


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """:class:`InputError` naming ``tp`` unless ``tp`` splits this model's heads and MLP evenly."""
    if tp == 1:
        return
    if spec.family not in TP_FAMILIES:
        raise InputError("tp", f"tensor parallelism of {spec.family} is not modelled (transformers' plan for it is "
                               f"not plain column/row-wise; modelled: {', '.join(TP_FAMILIES)})")
    for what, n in (("attention heads", spec.num_heads), ("key/value heads", spec.num_kv_heads),
                    ("MLP features", spec.intermediate_size)):
        if n % tp:
            raise InputError("tp", f"{spec.name or spec.family} has {n:,} {what}, which {tp} tensor-parallel ranks "
                                   "cannot split evenly")


def tensor_parallel_spec(spec: ModelSpec, tp: int, vocab: bool = False) -> ModelSpec:
    """The model one rank of a ``tp``-way tensor-parallel group runs (see the module's docstring); ``vocab``: the
    vocabulary split too (loss parallel), padded up to a multiple of ``tp`` as Megatron-LM pads it."""
    check_tensor_parallel(spec, tp)
    if tp == 1:
        return spec
    return dataclasses.replace(spec, num_heads=spec.num_heads // tp, num_kv_heads=spec.num_kv_heads // tp,
                               intermediate_size=spec.intermediate_size // tp,
                               vocab_size=-(-spec.vocab_size // tp) if vocab else spec.vocab_size,
                               name=f"{spec.name or spec.family} (one of {tp} tensor-parallel ranks)")
