"""Which experts each token goes to: DeepSpeed-MoE's top-1 and top-2 gating (GShard,
arXiv:2006.16668), as routing decisions rather than dense dispatch tensors.

[Note: gating as DeepSpeed gates]
The gate is a linear layer without bias, run in fp32, whose softmax over the experts gives
each token's gate values. Top-1 sends a token to its highest-valued expert (with
``noisy_gate_policy="RSample"`` in training: the highest after Gumbel noise), weighted by that
gate value. Top-2 adds the best of the others (with ``top2_2nd_expert_sampling``: after Gumbel
noise), and weights both by their gate values normalised to sum to one. The load-balancing loss
is ``E * sum_e(mean gate of e * share of tokens whose first choice is e)`` over the calling
rank's tokens; ``exp_counts`` counts each expert's assignments before capacity.

With ``drop_tokens`` an expert takes at most ``capacity = max(ceil(k * S / E *
capacity_factor), min_capacity)`` of the S tokens: top-2 fills it with first choices, in token
order, then second choices; top-1 picks among its tokens at random (``use_rts``, DeepSpeed's
random token selection) or in token order. A dropped assignment contributes nothing (its
weight is zero; top-2 normalises over what is kept). Without ``drop_tokens`` nothing is dropped
(DeepSpeed raises the capacity to the largest count; zerotrain's dispatch sends only the
assigned tokens, so there is no capacity at all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.config import ConfigError

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
JITTER_EPS = 1e-2  # DeepSpeed's multiplicative jitter: inputs scaled by U(1 - eps, 1 + eps)


@dataclass
class Routing:
    """A gate's decisions for S tokens with k choices each.

    ``experts`` (S, k): the expert of each choice; ``weights`` (S, k): what its output is
    multiplied by (0 where dropped; differentiable through the gate); ``kept`` (S, k): the
    choices sent to their expert; ``l_aux``: the load-balancing loss (0-d); ``exp_counts`` (E,):
    assignments per expert before capacity; ``capacity``: per expert, None without dropping.
    """

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    l_aux: torch.Tensor
    exp_counts: torch.Tensor
    capacity: int | None

    @property
    def dropped(self) -> int:
        """Assignments beyond their expert's capacity."""
        return int((~self.kept).sum())


def capacity(tokens: int, experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """Tokens one expert takes: ``max(ceil(k * tokens / experts * capacity_factor),
    min_capacity)`` (DeepSpeed's)."""
    return max(math.ceil(tokens / experts * capacity_factor * k), min_capacity)


def gumbel_like(x: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise of ``x``'s shape (the Gumbel-max trick samples a softmax)."""
    uniform = torch.rand_like(x).clamp(min=torch.finfo(x.dtype).tiny)
    return -torch.log(-torch.log(uniform))


def top1(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    *,
    rsample: bool = False,
    drop_tokens: bool = True,
    use_rts: bool = True,
) -> Routing:
    """Top-1 gating of ``logits`` (S, E), fp32 (see [Note: gating as DeepSpeed gates])."""
    tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    choice = torch.argmax(logits + gumbel_like(logits) if rsample else gates, dim=1)
    mask = F.one_hot(choice, num_experts)
    exp_counts = mask.sum(0)
    l_aux = (gates.mean(0) * mask.float().mean(0)).sum() * num_experts
    kept = torch.ones(tokens, dtype=torch.bool, device=logits.device)
    limit = None
    if drop_tokens:
        limit = capacity(tokens, num_experts, 1, capacity_factor, min_capacity)
        if use_rts:  # each expert keeps the tokens of highest random priority
            priority = mask * (1 + torch.rand(mask.shape, device=logits.device))  # > 0 if routed
            top = torch.topk(priority, k=min(limit, tokens), dim=0).indices
            chosen = torch.zeros_like(mask).scatter_(0, top, 1)
            kept = (mask * chosen).sum(1).bool()
        else:  # the first tokens, in order
            kept = ((mask.cumsum(0) - 1) * mask).sum(1) < limit
    weight = gates.gather(1, choice[:, None]) * kept[:, None]
    return Routing(choice[:, None], weight, kept[:, None], l_aux, exp_counts, limit)


def top2(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    *,
    drop_tokens: bool = True,
    second_sampling: bool = True,
) -> Routing:
    """Top-2 gating of ``logits`` (S, E), fp32 (see [Note: gating as DeepSpeed gates])."""
    tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_experts)
    noisy = logits + gumbel_like(logits) if second_sampling else logits
    second = torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_experts)
    exp_counts = (mask1 + mask2).sum(0)
    l_aux = (gates.mean(0) * mask1.float().mean(0)).sum() * num_experts
    experts = torch.stack([first, second], dim=1)
    kept = torch.ones(tokens, 2, dtype=torch.bool, device=logits.device)
    limit = None
    if drop_tokens:
        limit = capacity(tokens, num_experts, 2, capacity_factor, min_capacity)
        # places in the expert's buffer: first choices in token order, then second choices
        place1 = ((mask1.cumsum(0) - 1) * mask1).sum(1)
        place2 = ((mask2.cumsum(0) - 1 + mask1.sum(0, keepdim=True)) * mask2).sum(1)
        kept = torch.stack([place1 < limit, place2 < limit], dim=1)
    chosen = gates.gather(1, experts) * kept
    weights = chosen / chosen.sum(1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
    return Routing(experts, weights, kept, l_aux, exp_counts, limit)


class TopKGate(nn.Module):
    """DeepSpeed's ``TopKGate``: a linear gate (``wg``, no bias) and top-``k`` routing of the
    tokens (S, model_dim) it is given (see [Note: gating as DeepSpeed gates])."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
    ):
        super().__init__()
        if k not in (1, 2):
            raise ConfigError(f"MoE: k={k}; top-1 and top-2 gating are implemented (k=1 or 2)")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ConfigError(
                f"MoE: noisy_gate_policy {noisy_gate_policy!r} is not one of {NOISY_GATE_POLICIES}"
            )
        if noisy_gate_policy == "RSample" and k != 1:
            raise ConfigError(
                "MoE: noisy_gate_policy 'RSample' samples the first choice of top-1 gating; "
                "with k=2 use top2_2nd_expert_sampling (or 'Jitter')"
            )
        if min(capacity_factor, eval_capacity_factor) <= 0 or min_capacity < 0:
            raise ConfigError(
                f"MoE: capacity_factor {capacity_factor} and eval_capacity_factor "
                f"{eval_capacity_factor} must be positive, min_capacity {min_capacity} at least 0"
            )
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def forward(self, tokens: torch.Tensor) -> Routing:
        x = tokens.float()  # the gate runs in fp32 whatever the model's dtype
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * torch.empty_like(x).uniform_(1 - JITTER_EPS, 1 + JITTER_EPS)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1(
                logits,
                factor,
                self.min_capacity,
                rsample=self.noisy_gate_policy == "RSample" and self.training,
                drop_tokens=self.drop_tokens,
                use_rts=self.use_rts,
            )
        return top2(
            logits,
            factor,
            self.min_capacity,
            drop_tokens=self.drop_tokens,
            second_sampling=self.top2_2nd_expert_sampling,
        )
