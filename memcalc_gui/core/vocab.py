"""The ledger's vocabulary: phases and memory objects (memory ledger, Hugging Face blog colours).

Every front end (CLI, window, report, measurement) uses these names; keep them stable.
"""

from __future__ import annotations

from typing import Final

PHASES: Final = ("load", "forward", "backward", "optimizer_step")

#: Tensor objects: what ``torch.cuda.max_memory_allocated`` can see.
TENSOR_OBJECTS: Final = (
    "parameters",
    "gradients",
    "optimizer_state",
    "optimizer_temporaries",
    "activations",
    "temporaries",
    "inputs",
)
#: Device memory outside PyTorch's allocator that the step's own state occupies: bitsandbytes' paged optimizers keep
#: large state tensors in CUDA unified memory (``cudaMallocManaged``), which the driver can evict to host memory.
UNIFIED_OBJECTS: Final = ("paged_optimizer_state",)
#: Device overheads outside PyTorch's tensors.
OVERHEAD_OBJECTS: Final = ("cuda_context", "allocator_reserve")
OBJECTS: Final = TENSOR_OBJECTS + UNIFIED_OBJECTS + OVERHEAD_OBJECTS

PHASE_LABELS: Final = {
    "load": "Load",
    "forward": "Forward",
    "backward": "Backward",
    "optimizer_step": "Optimizer step",
}
OBJECT_LABELS: Final = {
    "parameters": "Parameters",
    "gradients": "Gradients",
    "optimizer_state": "Optimizer state",
    "optimizer_temporaries": "Optimizer temporaries",
    "activations": "Activations",
    "temporaries": "Temporaries",
    "inputs": "Inputs",
    "paged_optimizer_state": "Paged optimizer state",
    "cuda_context": "CUDA context",
    "allocator_reserve": "Allocator reserve",
}
