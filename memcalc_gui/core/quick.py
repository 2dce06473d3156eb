"""Method ``quick``: the Hugging Face blog heuristic from a bare parameter count.

Total = N·P + 2·N·P + max(N·P + N·P, A·B·L·P), with A = 4.6894e-4·N + 1.8494e6 activations per token
(a linear fit over a few models in the Hugging Face blog post, Hugging Face blog). Rough by design: it
overestimates activations by ~70 % at 1.5B and by several hundred % on small models (NOTES.md).
"""

from __future__ import annotations

from .distributed import model_states
from .errors import InputError
from .ledger import Estimate, with_overheads
from .setup import TrainingSetup
from .vocab import PHASES

A_SLOPE = 4.6894e-4
A_INTERCEPT = 1.8494e6

#: Optimizer state in units of N·P (Hugging Face blog uses 2 for AdamW).
_STATE_FACTOR = {"adamw": 2.0, "adam": 2.0, "adamw-8bit": 0.5, "paged-adamw-8bit": 0.5, "sgd": 0.0,
                 "sgd-momentum": 1.0, "adafactor": 0.0, "lion": 1.0,
                 "galore-adamw": 2.0}  # GaLore: at most AdamW's (its projected moments are smaller)


def activations_per_token(num_params: int) -> float:
    """Seed 000's A: activation values per token."""
    return A_SLOPE * num_params + A_INTERCEPT


def precision_bytes(setup: TrainingSetup) -> tuple[int, int]:
    """P for the N·P terms and for the activation term (mixed keeps fp32 weights, 16-bit activations)."""
    if setup.precision == "fp32":
        return 4, 4
    if setup.precision in ("bf16", "bf16-autocast"):
        return 2, 2
    return 4, 2


def estimate_quick(setup: TrainingSetup) -> Estimate:
    """The Hugging Face blog formula as a ledger: forward holds activations, the step holds grads + intermediates.

    With ZeRO-1/2 (and their optimizer offload) the model states are split as DeepSpeed's own estimator splits
    them from a bare parameter count; ZeRO-3 and FSDP gather the largest layer, which a count does not give.
    """
    par = setup.parallel
    for name, on in (("loss", setup.loss != "full"), ("optimizer_in_backward", setup.optimizer_in_backward),
                     ("activation_offload", setup.activation_offload != "none")):
        if on:
            raise InputError(name, "the heuristic has no loss or per-parameter step to change: choose a preset or a "
                                   "config.json")
    if par.etp > 1:
        raise InputError("etp", "expert tensor parallelism splits the routed experts, which a bare parameter count "
                                "does not give: choose a preset or a config.json of the mixture of experts")
    if par.ep > 1:
        raise InputError("ep", "expert parallelism splits the routed experts, which a bare parameter count does not "
                               "give: choose a preset or a config.json of the mixture of experts")
    if par.tp > 1:
        raise InputError("tp", "tensor parallelism splits a model's heads and MLP, which a bare parameter count does "
                               "not give: choose a preset or a config.json")
    if par.pp > 1:
        raise InputError("pp", "pipeline parallelism splits a model's layers, which a bare parameter count does not "
                               "give: choose a preset or a config.json")
    if par.cp > 1:
        raise InputError("cp", "context parallelism splits a model's sequences through its attention, which a bare "
                               "parameter count does not give: choose a preset or a config.json")
    if par.strategy not in ("ddp", "zero1", "zero2"):
        raise InputError("strategy", "ZeRO-3 and FSDP gather the largest layer at once, which a bare parameter "
                                     "count does not give: choose a preset or a config.json of a family memcalc "
                                     "models")
    n = setup.num_params
    p, p_act = precision_bytes(setup)
    model = n * p
    # bitsandbytes' 32-bit states are fp32 whatever the parameter dtype
    state = 8 * n if setup.optimizer == "paged-adamw-32bit" else 4 * n if setup.optimizer == "adamw-bf16-states" \
        else round(_STATE_FACTOR[setup.optimizer] * n * p)  # bf16 states: 2 + 2 B/param
    intermediates = n * p
    acts = round(activations_per_token(n) * setup.tokens * p_act)
    notes: tuple[str, ...] = ()
    host = 0
    if par.strategy == "ddp":
        buckets = n * p if par.gpus > 1 else 0  # DDP keeps every gradient once more in its buckets
        params = dict.fromkeys(PHASES, model)
        grads = {"load": 0, "forward": buckets, "backward": n * p + buckets, "optimizer_step": n * p + buckets}
    else:
        states = model_states(par, n, 0, setup.precision, state, intermediates, 0, 0)
        params, grads, state, intermediates = (states.parameters, states.gradients, states.optimizer_state,
                                               states.optimizer_temporaries)
        notes, host = states.notes, states.host_bytes
    # a bare count has no tensor sizes: a paged optimizer's state is taken as paged (big tensors hold nearly all)
    held = "paged_optimizer_state" if setup.optimizer.startswith("paged") and setup.target_device == "cuda" \
        else "optimizer_state"
    phases = {
        "load": with_overheads({"parameters": params["load"]}, "load", setup),
        "forward": with_overheads({"parameters": params["forward"], held: state, "activations": acts,
                                   "gradients": grads["forward"]}, "forward", setup),
        "backward": with_overheads({"parameters": params["backward"], held: state,
                                    "gradients": grads["backward"]}, "backward", setup),
        "optimizer_step": with_overheads({"parameters": params["optimizer_step"], held: state,
                                          "gradients": grads["optimizer_step"],
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
            *(["Model states split from the parameter count alone, as DeepSpeed's "
               "estimate_zero2_model_states_mem_needs does"] if par.strategy != "ddp" else []),
            *notes,
        ),
        details={"host_bytes": host},
    )
