"""Adagrad (Duchi et al., JMLR 2011) as ``torch.optim.Adagrad``, with its state made at the
first step, as every other optimizer zerotrain steps makes it.

torch's Adagrad fills ``sum`` (and ``step``) in its constructor. zerotrain builds optimizers over
placeholders first where the state lives on NVMe (zerotrain/zero/nvme.py) and decides what a
checkpoint holds from the state a step made; an eager state would be the placeholders' shape.
The update is torch's own (its fused kernel where the tensors allow it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _get_scalar_dtype

__all__ = ["Adagrad", "DeepSpeedCPUAdagrad"]


class Adagrad(torch.optim.Adagrad):
    """``torch.optim.Adagrad`` (its arguments; DeepSpeed's defaults lr 1e-2, eps 1e-10; weight
    decay as L2 on the gradient), its state made at the first step."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        fused: bool | None = None,
    ):
        super().__init__(
            params,
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
            foreach=foreach,
            fused=fused,
        )
        self.state.clear()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if p.grad is None or state:
                    continue
                # what torch's constructor makes (torch/optim/adagrad.py)
                if group["fused"]:
                    dtype = _get_scalar_dtype(is_fused=True)
                    state["step"] = torch.zeros((), dtype=dtype, device=p.device)
                else:
                    state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["sum"] = torch.full_like(p, group["initial_accumulator_value"])
        return super().step(closure)


class DeepSpeedCPUAdagrad(Adagrad):
    """DeepSpeed's ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`` (its arguments): the same
    update, on whatever device the parameters are."""

    def __init__(
        self,
        model_params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ):
        del amsgrad, fp32_optimizer_states  # DeepSpeed's Adagrad ignores amsgrad too
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
