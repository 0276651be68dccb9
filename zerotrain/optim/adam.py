"""Adam with DeepSpeed ``FusedAdam`` semantics: AdamW or L2 mode, with or without bias
correction.

With bias correction (the default) a step is torch's own Adam/AdamW step: the functional
``torch.optim.adamw.adamw`` (or ``adam``) with its fused kernel on CPU and CUDA tensors, the
same arithmetic as ``torch.optim.AdamW(fused=True)``. Without bias correction torch has no kernel; the step is the
same update with ``bc1 = bc2 = 1`` in foreach operations:

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    w = w * (1 - lr * weight_decay)       (adam_w_mode: decoupled decay)
    w = w - lr * m / (sqrt(v) + eps)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim.adam import adam
from torch.optim.adamw import adamw

from zerotrain.optim.closure_step import ClosureStep

__all__ = ["ADAM_FAMILY", "DeepSpeedCPUAdam", "FusedAdam", "adam_step", "same_state_kind"]


def keeps_step_on_device(group: dict) -> bool:
    """Whether an Adam parameter group keeps ``step`` on its parameters' device: torch's fused
    and capturable kernels read it there, and so does :class:`FusedAdam` (whose groups carry
    ``adam_w_mode``); torch's other Adams keep it on the host."""
    return bool(group.get("fused") or group.get("capturable") or "adam_w_mode" in group)


class FusedAdam(ClosureStep):
    """DeepSpeed's ``deepspeed.ops.adam.FusedAdam`` (same arguments and defaults).

    ``adam_w_mode`` True decays weights decoupled (AdamW), False adds ``weight_decay * w`` to
    the gradient (Adam with L2). ``amsgrad`` is not supported, as in DeepSpeed.
    ``set_grad_none`` is accepted: ``zero_grad`` always sets gradients to None.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (as in DeepSpeed)")
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": tuple(betas),
            "eps": eps,
            "adam_w_mode": adam_w_mode,
            "weight_decay": weight_decay,
            "amsgrad": False,
            "set_grad_none": set_grad_none,
        }
        super().__init__(params, defaults)

    def update(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            options = {k: group[k] for k in ("lr", "betas", "weight_decay", "eps")}
            if group["bias_correction"]:
                adam_step(self.state, params, decoupled=group["adam_w_mode"], **options)
                continue
            _init_state(self.state, params)
            grads = [cast(Tensor, p.grad) for p in params]
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
            _uncorrected_step(params, grads, exp_avgs, exp_avg_sqs, group)
            torch._foreach_add_([self.state[p]["step"] for p in params], 1)


def _init_state(state: dict, params: list[Tensor]) -> None:
    """Adam's state of each of ``params`` that has none; a ``step`` on the host (a
    checkpoint's, loaded there) moves to the parameter's device, where the kernels read it."""
    for p in params:
        if not state[p]:
            state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state[p]["exp_avg"] = torch.zeros_like(p)
            state[p]["exp_avg_sq"] = torch.zeros_like(p)
        elif state[p]["step"].device != p.device:
            state[p]["step"] = state[p]["step"].to(p.device)


def adam_step(
    state: dict,
    params: list[Tensor],
    *,
    decoupled: bool,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
) -> None:
    """One bias-corrected Adam (L2 decay) or AdamW (``decoupled``) step of ``params`` with
    their gradients and their entries of an optimizer's ``state``: torch's own functional
    step, with its fused kernel where the tensors allow it (the same arithmetic as
    ``torch.optim.AdamW(fused=True)``)."""
    _init_state(state, params)
    torch_step = adamw if decoupled else adam
    torch_step(
        params,
        [cast(Tensor, p.grad) for p in params],
        [state[p]["exp_avg"] for p in params],
        [state[p]["exp_avg_sq"] for p in params],
        [],
        [state[p]["step"] for p in params],
        fused=all(_fused_capable(p) for p in params),
        amsgrad=False,
        beta1=betas[0],
        beta2=betas[1],
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )


def _uncorrected_step(params, grads, exp_avgs, exp_avg_sqs, group) -> None:
    beta1, beta2 = group["betas"]
    lr, decay = group["lr"], group["weight_decay"]
    if decay and not group["adam_w_mode"]:  # L2: the decay is part of the gradient
        grads = torch._foreach_add(grads, params, alpha=decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    if decay and group["adam_w_mode"]:
        torch._foreach_mul_(params, 1 - lr * decay)
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denominators, group["eps"])
    torch._foreach_addcdiv_(params, exp_avgs, denominators, value=-lr)


def _fused_capable(tensor: Tensor) -> bool:
    return tensor.device.type in ("cpu", "cuda") and tensor.is_floating_point()


class DeepSpeedCPUAdam(FusedAdam):
    """DeepSpeed's ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (its arguments; note
    ``adamw_mode``): the same update as :class:`FusedAdam`, on whatever device the parameters
    are. ``fp32_optimizer_states`` is accepted: states are kept in the parameters' dtype,
    which is fp32 for the master weights zerotrain steps."""

    def __init__(
        self,
        model_params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ):
        del fp32_optimizer_states
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adamw_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
        )


ADAM_FAMILY = (torch.optim.Adam, FusedAdam)  # torch's AdamW subclasses Adam, CPU Adam FusedAdam
"""The optimizers whose per-element state is Adam's: ``step``, ``exp_avg``, ``exp_avg_sq``."""

_ADAM_NAMES = frozenset({"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam"})


def same_state_kind(saved: str, ours: str) -> bool:
    """Whether optimizer states saved by the class named ``saved`` mean the same to the class
    named ``ours``: the same class, or two of the Adam family (a checkpoint of torch's AdamW
    resumes a FusedAdam run and back)."""
    return saved == ours or {saved, ours} <= _ADAM_NAMES
