"""AdamW with its moments in bf16 beside fp32 weights, as torchdistx's ``AnyPrecisionAdamW`` runs it, for measuring.

Why this module exists: Trainer's ``optim="adamw_anyprecision"`` (with ``optim_args="momentum_dtype=bfloat16,
variance_dtype=bfloat16"``) builds torchdistx's ``AnyPrecisionAdamW``, which has no wheel for current PyTorch and
whose constructor refuses a machine without a bf16 CUDA GPU and NCCL. To measure its memory on a CPU this optimizer
runs the same tensor operations in the same order (``torchdistx/optimizers/anyprecision_optimizer.py``): per
parameter, in place on the moments, ``exp_avg_sq.sqrt()`` and its division by the bias correction as two new
tensors of the variance dtype, then ``addcdiv_`` into the weight; Kahan summation is left out (off by default in
Trainer). Its numbers are AdamW's; only the memory is the point.
"""

from __future__ import annotations

from typing import Any


def make(params: list[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0) -> Any:
    """The optimizer over ``params`` with bf16 moments (torch imported here)."""
    import torch

    class BF16StateAdamW(torch.optim.Optimizer):
        def __init__(self) -> None:
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

        @torch.no_grad()  # type: ignore[untyped-decorator]
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["step"] += 1
                    step = float(state["step"])
                    if group["weight_decay"]:
                        p.mul_(1 - group["lr"] * group["weight_decay"])
                    state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    step_size = group["lr"] / (1 - beta1 ** step)
                    denom = (state["exp_avg_sq"].sqrt() / (1 - beta2 ** step) ** 0.5).add_(group["eps"])
                    p.addcdiv_(state["exp_avg"], denom, value=-step_size)

    return BF16StateAdamW()
