"""1-bit Adam's (Tang et al., arXiv:2102.02888) and 0/1 Adam's (Lu et al., arXiv:2202.06009)
updates, under ZeRO stages 0-2.

[Note: 1-bit optimizers under ZeRO]
1-bit Adam runs exact Adam for ``freeze_step`` steps (the warm-up), then freezes the variance
and sends only signs and a scale per piece, with error feedback (the rest of what it had to
send is kept and added next time). DeepSpeed compresses each rank's momentum
m_i = β1·m + (1 - β1)·g_i, which needs the whole momentum m on every rank, and refused ZeRO
(``assert not self.zero_optimization()``). Under ZeRO-1/2 a rank holds m only for its own
shard, and β1·m is the same on every rank: only (1 - β1)·g_i differs. So here the engine's
gradient codec (zerotrain/compression/encoded.py, ``OneBitCodec``) sends each rank's gradient,
plus its kept error, as signs and one scale per block of 2048, and the owner of a piece
sums what it receives; the optimizer then folds that average into its shard's momentum,
m = β1·m + (1 - β1)·ĝ, exactly. Each rank ends with the averaged quantity for its own shard;
what it keeps between steps (its error, one fp32 element per bucket element, and at stage 0
the owner's error for its piece) is counted by ``memory_breakdown()["compression"]``. The
compressor scales linearly, so compressing (1 - β1)·g_i + e_i or g_i + e_i / (1 - β1) is
the same message. The update itself is DeepSpeed's: no bias correction, weight decay added to
the update (decoupled), ``eps`` outside the square root unless ``eps_inside_sqrt``.

After the freeze the signs can give way to another compressor (``comm_compression.gradients.
method``, e.g. top-k): the same exact steps and update, with that method's message. 0/1 Adam's
local steps send, at a synchronization, what several steps did instead of one gradient (see
[Note: 0/1 Adam's local steps] in local_steps.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from zerotrain.optim.local_steps import LocalSteps, LocalStepSchedule

ONE_BIT_OPTIMIZERS = ("onebitadam", "zerooneadam")
"""The optimizer types (lower case) that compress their own gradient exchange."""


@dataclass(frozen=True)
class ExactSteps:
    """The optimizer steps (1-based) whose gradients are reduced exactly, the others in 1 bit:
    the first ``warmup`` steps, and those in ``steps``."""

    warmup: int = 0
    steps: frozenset[int] = frozenset()

    def __contains__(self, step: int) -> bool:
        return step <= self.warmup or step in self.steps


def variance_update_steps(var_freeze_step: int, var_update_scaler: int) -> frozenset[int]:
    """0/1 Adam's steps that update the variance, with the exactly averaged gradient (DeepSpeed's
    schedule): every ``interval``-th step, the interval starting at 1 and doubling after each
    ``var_update_scaler`` updates, up to step ``var_freeze_step + 1``; none after."""
    steps, interval, counter = set(), 1, 0
    for step in range(1, var_freeze_step + 2):
        if step % interval == 0:
            steps.add(step)
            counter += 1
            if counter == var_update_scaler:
                counter, interval = 0, interval * 2
    return frozenset(steps)


class OneBitAdam(torch.optim.Optimizer):
    """DeepSpeed's ``OnebitAdam`` update: Adam for ``freeze_step`` steps, then with the
    variance frozen (see [Note: 1-bit optimizers under ZeRO]). The engine compresses the
    gradients it is given after the warm-up. ``cuda_aware`` and ``comm_backend_name`` are
    DeepSpeed's transport switches, accepted and not needed: zerotrain's communicator
    carries the compressed messages on any backend."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        eps_inside_sqrt: bool = False,
        bias_correction: bool = True,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ):
        if amsgrad:
            raise ValueError("optimizer.params.amsgrad: 1-bit Adam has no AMSGrad variant")
        del bias_correction, cuda_aware, comm_backend_name  # see the class docstring
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.exact = ExactSteps(warmup=freeze_step)
        self.eps_inside_sqrt = eps_inside_sqrt
        # the settings kept out of the groups: where several shard groups need one optimizer
        # each, the engine builds them like the one it is given, from ``defaults``
        # (zerotrain/optimizer_plan.py)
        self.defaults.update(freeze_step=freeze_step, eps_inside_sqrt=eps_inside_sqrt)

    @torch.no_grad()
    def step(self, closure=None):  # pyrefly: ignore[bad-override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_param(param, group)
        return loss

    def _count_step(self, param: torch.Tensor) -> dict:
        """``param``'s state, with this step counted."""
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        return state

    def _denominator(self, exp_avg_sq: torch.Tensor, eps: float) -> torch.Tensor:
        if self.eps_inside_sqrt:
            return (exp_avg_sq + eps).sqrt()
        return exp_avg_sq.sqrt().add_(eps)

    def _step_param(self, param: torch.Tensor, group: dict) -> None:
        """DeepSpeed's update of one parameter with its (averaged) gradient."""
        state, grad = self._count_step(param), param.grad
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        if int(state["step"]) in self.exact:  # exactly averaged: the variance learns
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        update = exp_avg / self._denominator(exp_avg_sq, group["eps"])
        if group["weight_decay"] > 0:
            update.add_(param, alpha=group["weight_decay"])
        param.add_(update, alpha=-group["lr"])


class ZeroOneAdam(OneBitAdam):
    """DeepSpeed's ``ZeroOneAdam`` update (0/1 Adam, arXiv:2202.06009): the variance is updated
    on a schedule that thins out (:func:`variance_update_steps`) and frozen after
    ``var_freeze_step``; the engine reduces the gradients of those steps exactly and of the
    others in 1 bit, with error feedback (see [Note: 1-bit optimizers under ZeRO]).

    After the freeze, with ``local_step_clipper`` above 1 (DeepSpeed's default is 16,
    zerotrain's 1: local steps are asked for, not implied), the ranks synchronize only every
    1, 2, 4, ... up to ``local_step_clipper`` steps (doubling every ``local_step_scaler``) and
    step their own replicas in between: 0/1 Adam's local steps (see [Note: 0/1 Adam's local
    steps] in local_steps.py). Only at stage 0, where every rank holds the whole model and
    optimizer state; the engine binds :attr:`local_steps` to its buckets."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 1,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ):
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            eps_inside_sqrt=eps_inside_sqrt,
            bias_correction=bias_correction,
            amsgrad=amsgrad,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
        )
        self.exact = ExactSteps(steps=variance_update_steps(var_freeze_step, var_update_scaler))
        self.defaults.update(  # as OneBitAdam's
            var_freeze_step=var_freeze_step,
            var_update_scaler=var_update_scaler,
            local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper,
        )
        self.local_steps: LocalSteps | None = None
        if local_step_clipper > 1:
            schedule = LocalStepSchedule(var_freeze_step + 2, local_step_scaler, local_step_clipper)
            self.local_steps = LocalSteps(schedule, self._moments, lambda: self.param_groups)

    @torch.no_grad()
    def step(self, closure=None):  # pyrefly: ignore[bad-override]
        local = self.local_steps
        if local is None or not local.masters:  # not bound: every step synchronizes
            return super().step(closure)
        loss = closure() if closure is not None else None
        keeps_local = local.keeps_local()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                index = local.index(param)
                if not keeps_local and not local.open_window(index):
                    self._step_param(param, group)  # DeepSpeed's update
                    continue
                state = self._count_step(param)
                if keeps_local:
                    local.local_step(index, param.grad)
                else:
                    local.synchronize(index, param.grad, state["exp_avg"])
        local.end_step()
        return loss

    def _moments(self, param: torch.Tensor, group: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``param``'s momentum and frozen denominator (local steps' :data:`Moments`)."""
        state = self.state[param]
        return state["exp_avg"], self._denominator(state["exp_avg_sq"], group["eps"])
