"""Adam under sparse gradients: a coordinate steps when its gradient arrives, by as many steps
as the gradient carries.

[Note: catching up]
Top-k and gTop-k send a coordinate only every few steps, and then, through error feedback,
the sum S of the gradients of the n steps since it last travelled; in between it arrives as
zero. Adam fed that sequence moves the coordinate far less than it moves a coordinate that
arrives every step: for a steady gradient g, its momentum still sums to what arrived (n·g
per n steps), but its second moment averages (n·g)²/n = n·g² per step, so over n steps the
coordinate moves lr·n·g/√(n·g²) = lr·√n where dense Adam moves lr·n. Sparsification then
slows most coordinates of the model by √n, n being 10 or more at a 10% ratio (measured on
the tiny GPT under AdamW: +5.0-7.5% final loss, against 1.8-2.6% below uncompressed
catching up; docs/compression.md).

Catching up leaves a coordinate's moments and value alone while nothing arrives. When S
arrives after n steps (the codec counts them), it takes n Adam steps of the mean gradient
S/n at once: the moments become exactly those n steps',

    m = β1^n·m + (1 - β1^n)·S/n,    v = β2^n·v + (1 - β2^n)·(S/n)²,

and the value moves by n·lr·m̂/(√v̂ + ε), n times the last of those steps' update (m̂, v̂
bias-corrected by the optimizer's step count, which every step advances). A coordinate that
arrives every step (n = 1), and every coordinate of the exact (warm-up) steps, takes Adam's
own step. Decoupled weight decay still shrinks every coordinate every step; L2 decay is part
of the gradient, so it travels with it (n steps' worth at an arrival).

The step is the optimizer's: hooks around its ``step`` take the masters that have counts this
step out of the torch step and step them here, with the optimizer's own state (exp_avg,
exp_avg_sq, step), so checkpoints and a later dense step read it as theirs. A bucket whose
copies on other model-parallel ranks sum their gradients (a tied layer, a sequence-parallel
norm) does not catch up: each copy's codec sends other elements, so the sum has no one count
(ShardGroup._arrivals).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from zerotrain.optim.adam import ADAM_FAMILY, keeps_step_on_device

__all__ = ["Arrivals", "CatchUp", "catches_up"]

Arrivals = tuple[torch.Tensor, torch.Tensor]
"""Where in a master gradients arrived (flat positions), and the steps each carries."""


def catches_up(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is an Adam whose update catching up replaces (not AMSGrad, not
    maximizing): the others take the sparse gradients as they are."""
    if not isinstance(optimizer, ADAM_FAMILY):
        return False
    return not any(g.get("amsgrad") or g.get("maximize") for g in optimizer.param_groups)


class CatchUp:
    """Catching up (see [Note: catching up]) for ``optimizer``'s ``masters`` (one per bucket,
    in bucket order): :meth:`arrive` gives this step's counts, and the optimizer's next step
    over a master with counts catches up."""

    def __init__(self, optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor]):
        self._index = {id(m): i for i, m in enumerate(masters)}
        self.arrivals: list[Arrivals | None] = [None] * len(masters)
        self._taken: list[tuple[torch.Tensor, torch.Tensor, Arrivals, dict]] = []
        optimizer.register_step_pre_hook(self._take)
        optimizer.register_step_post_hook(self._step)

    def arrive(self, arrivals: list[Arrivals | None]) -> None:
        """Per bucket: the positions in its master where a gradient arrived and the steps each
        carries (None: every element arrived with this step's)."""
        self.arrivals = list(arrivals)

    def _take(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Before the torch step: hide the gradients of the masters that catch up."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                index = self._index.get(id(param))
                if index is None or param.grad is None:
                    continue
                arrivals = self.arrivals[index]
                if arrivals is None:
                    continue
                self.arrivals[index] = None  # one step each (an offloaded one may come later)
                moved = (arrivals[0].to(param.device), arrivals[1].to(param.device))
                self._taken.append((param, param.grad, moved, group))
                param.grad = None

    @torch.no_grad()
    def _step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """After the torch step: step the hidden masters here, and give their gradients back."""
        taken, self._taken = self._taken, []
        for param, grad, (positions, counts), group in taken:
            catch_up_step(param, grad, positions, counts, optimizer.state[param], group)
            param.grad = grad


def catch_up_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    positions: torch.Tensor,
    counts: torch.Tensor,
    state: dict,
    group: dict,
) -> None:
    """One step of catching up for ``param`` (see [Note: catching up]): at the flat
    ``positions`` (distinct) ``grad`` holds the sum of ``counts`` steps' gradients; nothing
    arrived elsewhere. ``state`` and ``group`` are torch Adam's (or FusedAdam's)."""
    if not state:  # as torch lays it out: a later exact step continues from it
        on_device = keeps_step_on_device(group)
        state["step"] = torch.zeros(
            (), dtype=torch.float32, device=param.device if on_device else "cpu"
        )
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    beta1, beta2 = group["betas"]
    lr, decay, eps = group["lr"], group["weight_decay"], group["eps"]
    decoupled = group.get("decoupled_weight_decay", group.get("adam_w_mode", False))
    state["step"] += 1
    step = float(state["step"])
    # only the elements that arrived change (but for decoupled decay): work on those alone
    flat, exp_avg, exp_avg_sq = (
        param.view(-1),
        state["exp_avg"].view(-1),
        state["exp_avg_sq"].view(-1),
    )
    mean = grad.view(-1)[positions].div_(counts)
    if decay and not decoupled:  # L2: the decay is part of the gradient that arrived
        mean.add_(flat[positions], alpha=decay)
    # beta^n and 1 - beta^n from log(beta) in double: pow(beta, n) in fp32 rounds beta
    # first, and 1 - beta2 comes out 1.3e-5 off (0.00099998713 for 0.999)
    log1, log2 = counts * math.log(beta1), counts * math.log(beta2)
    moment1 = exp_avg[positions].mul_(log1.exp()).add_(mean * -log1.expm1())
    moment2 = exp_avg_sq[positions].mul_(log2.exp()).add_(mean.square_().mul_(-log2.expm1()))
    exp_avg.index_copy_(0, positions, moment1)
    exp_avg_sq.index_copy_(0, positions, moment2)
    if decay and decoupled:
        flat.mul_(1 - lr * decay)
    correct = group.get("bias_correction", True)
    bias1 = 1 - beta1**step if correct else 1.0
    bias2 = 1 - beta2**step if correct else 1.0
    denominator = moment2.div_(bias2).sqrt_().add_(eps)
    flat.index_add_(0, positions, moment1.mul_(counts).div_(denominator), alpha=-lr / bias1)
