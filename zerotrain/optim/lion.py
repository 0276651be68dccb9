"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675,
Algorithm 2), with DeepSpeed ``FusedLion``'s arguments and defaults.

    c = beta1 * m + (1 - beta1) * g
    w = w * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

One state tensor (``exp_avg``) per parameter, element-wise: it shards like Adam's moments.
torch has no Lion kernel; the step is foreach operations, one temporary the size of the
parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from zerotrain.optim.closure_step import ClosureStep

__all__ = ["DeepSpeedCPULion", "FusedLion", "Lion"]


class Lion(ClosureStep):
    """Lion with decoupled weight decay (DeepSpeed's ``FusedLion`` and ``DeepSpeedCPULion``)."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ):
        if lr < 0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas) or len(betas) != 2:
            raise ValueError(f"Lion: betas must be two numbers in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    def update(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            grads = [p.grad for p in params]
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            if decay:
                torch._foreach_mul_(params, 1 - lr * decay)
            directions = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
            torch._foreach_sign_(directions)
            torch._foreach_add_(params, directions, alpha=-lr)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)


FusedLion = Lion
"""DeepSpeed's ``deepspeed.ops.lion.FusedLion``."""


class DeepSpeedCPULion(Lion):
    """DeepSpeed's ``deepspeed.ops.lion.DeepSpeedCPULion`` (its arguments): the same update."""

    def __init__(
        self,
        model_params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ):
        del fp32_optimizer_states  # the masters zerotrain steps are fp32
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
