"""Method ``quick``: the Hugging Face blog heuristic from a bare parameter count.

Total = N·P + 2·N·P + max(N·P + N·P, A·B·L·P), with A = 4.6894e-4·N + 1.8494e6 activations per token
(a linear fit over a few models in the Hugging Face blog post, Hugging Face blog). Rough by design: it
overestimates activations by ~70 % at 1.5B and by several hundred % on small models (NOTES.md).
"""

from __future__ import annotations

from .errors import InputError
from .ledger import Estimate, with_overheads
from .setup import TrainingSetup

A_SLOPE = 4.6894e-4
A_INTERCEPT = 1.8494e6

#: Optimizer state in units of N·P (Hugging Face blog uses 2 for AdamW).
_STATE_FACTOR = {"adamw": 2.0, "adam": 2.0, "adamw-8bit": 0.5, "sgd": 0.0, "sgd-momentum": 1.0,
                 "adafactor": 0.0, "lion": 1.0}


def activations_per_token(num_params: int) -> float:
    """Seed 000's A: activation values per token."""
    return A_SLOPE * num_params + A_INTERCEPT


def precision_bytes(setup: TrainingSetup) -> tuple[int, int]:
    """P for the N·P terms and for the activation term (mixed keeps fp32 weights, 16-bit activations)."""
    if setup.precision == "fp32":
        return 4, 4
    if setup.precision == "bf16":
        return 2, 2
    return 4, 2


def estimate_quick(setup: TrainingSetup) -> Estimate:
    """The Hugging Face blog formula as a ledger: forward holds activations, the step holds grads + intermediates."""
    par = setup.parallel
    if par.strategy != "ddp" or par.offload != "none":
        raise InputError("strategy", "sharded strategies and offload need an architecture (a preset or a config.json)")
    n = setup.num_params
    p, p_act = precision_bytes(setup)
    buckets = n * p if par.gpus > 1 else 0  # DDP keeps every gradient once more in its buckets
    model = n * p
    state = round(_STATE_FACTOR[setup.optimizer] * n * p)
    grads = n * p + buckets
    intermediates = n * p
    acts = round(activations_per_token(n) * setup.batch * setup.seq * p_act)
    phases = {
        "load": with_overheads({"parameters": model}, "load", setup),
        "forward": with_overheads({"parameters": model, "optimizer_state": state, "activations": acts,
                                   "gradients": buckets}, "forward", setup),
        "backward": with_overheads({"parameters": model, "optimizer_state": state, "gradients": grads},
                                   "backward", setup),
        "optimizer_step": with_overheads({"parameters": model, "optimizer_state": state, "gradients": grads,
                                          "optimizer_temporaries": intermediates}, "optimizer_step", setup),
    }
    return Estimate(
        setup=setup,
        method="quick",
        phases=phases,
        assumptions=(
            "Rough heuristic (Hugging Face blog): Total = N·P + 2·N·P + max(2·N·P, A·B·L·P), "
            "A = 4.6894e-4·N + 1.8494e6",
            f"P = {p} B for weights, gradients and state; {p_act} B for activations",
        ),
    )
