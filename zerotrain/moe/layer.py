"""DeepSpeed-MoE's layer (``deepspeed.moe.layer.MoE``): a gate, experts spread over the
expert-parallel ranks, and the all-to-all between them.

[Note: experts by index]
``num_experts`` copies of ``expert`` (deep copies, as DeepSpeed makes them: they start equal)
are spread over ``ep_size`` ranks, ``num_experts / ep_size`` per rank. A rank builds only its
own and registers each under its index among all experts
(``deepspeed_moe.experts.deepspeed_experts.<index>``), so names, and so checkpoints, do not
depend on ``ep_size``. Which experts are a rank's is known once the engine has placed the layer
on its expert-parallel group (:meth:`MoE.place`); until then, with ``ep_size`` > 1, the layer
holds the first rank's and cannot run. Expert parameters are marked ``allreduce = False``
(DeepSpeed's mark; ``zerotrain.moe.utils.is_moe_param``) with ``group_name`` ``ep_size_<n>``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.comm import Communicator
from zerotrain.config import ConfigError
from zerotrain.moe.dispatch import dispatch_combine
from zerotrain.moe.gating import Routing, TopKGate

__all__ = ["MoE", "expert_tensors"]


def expert_tensors(model: nn.Module) -> set[int]:
    """``id`` of every parameter and buffer of ``model``'s experts (adapters added inside them
    included): what lives on the ranks holding those experts only."""
    return {
        id(t)
        for module in model.modules()
        if isinstance(module, Experts)
        for t in [*module.parameters(), *module.buffers()]
    }


class Experts(nn.Module):
    """This rank's experts, under their global indices (see [Note: experts by index])."""

    def __init__(self, expert: nn.Module, num_local: int, group_name: str):
        super().__init__()
        self.num_local = num_local
        self.deepspeed_experts = nn.ModuleDict(
            {str(i): copy.deepcopy(expert) for i in range(num_local)}
        )
        for param in self.deepspeed_experts.parameters():
            param.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed's expert mark
            param.group_name = group_name  # type: ignore[attr-defined]

    def renumber(self, first: int) -> None:
        """Name the experts ``first``, ``first + 1``, ...: their global indices."""
        modules = list(self.deepspeed_experts.values())
        self.deepspeed_experts = nn.ModuleDict(
            {str(first + i): module for i, module in enumerate(modules)}
        )

    def run(self, local: int, rows: torch.Tensor) -> torch.Tensor:
        """Local expert ``local`` on ``rows``."""
        return list(self.deepspeed_experts.values())[local](rows)


class MOELayer(nn.Module):
    """Gate, experts and dispatch (DeepSpeed's ``MOELayer``): ``forward(x)`` gives the
    combined output; ``l_aux``, ``exp_counts`` and ``routing`` are the last forward's."""

    def __init__(self, gate: TopKGate, experts: Experts, num_experts: int, ep_size: int):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.comm: Communicator | None = None  # the expert-parallel group, once placed
        self.dedup = False  # HierMoE's token deduplication (moe.token_dedup; see dispatch.py)
        self.chunks = 1  # parts whose exchanges overlap expert compute (moe.overlap_chunks)
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.routing: Routing | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.comm is None and self.ep_size > 1:
            raise RuntimeError(
                f"MoE: ep_size {self.ep_size} spreads the experts over ranks; build the engine "
                "with zerotrain.initialize first, which places them"
            )
        tokens = hidden.reshape(-1, hidden.shape[-1])
        routing = self.gate(tokens)
        self.routing, self.l_aux, self.exp_counts = routing, routing.l_aux, routing.exp_counts
        out = dispatch_combine(
            tokens,
            routing,
            self.experts.run,
            self.num_local_experts,
            self.comm,
            self.dedup,
            self.chunks,
        )
        return out.reshape(hidden.shape)


class MoE(nn.Module):
    """DeepSpeed's ``MoE`` layer: ``forward(hidden_states)`` returns ``(output, l_aux,
    exp_counts)``; ``l_aux`` is the load-balancing loss over this rank's tokens (add it, scaled,
    to the loss), ``exp_counts`` each expert's assignments before capacity. See
    docs/moe.md and [Note: gating as DeepSpeed gates] in gating.py."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ):
        super().__init__()
        if num_experts < 1 or ep_size < 1 or num_experts % ep_size:
            raise ConfigError(
                f"MoE: num_experts {num_experts} must be a positive multiple of ep_size {ep_size}"
            )
        if use_tutel or enable_expert_tensor_parallelism:
            raise ConfigError(
                "MoE: use_tutel and enable_expert_tensor_parallelism are not supported; leave "
                "them False (zerotrain's dispatch sends only routed tokens, without Tutel)"
            )
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
        )
        experts = Experts(expert, num_experts // ep_size, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, num_experts, ep_size)
        self.use_residual = use_residual
        if use_residual:  # Residual-MoE: a dense copy of the expert, mixed in by a learned gate
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)

    def place(self, comm: Communicator) -> None:
        """Run the experts over ``comm``, the expert-parallel group of this rank (``ep_size``
        ranks): this rank's are numbered from ``comm.rank x num_experts / ep_size``."""
        if comm.world_size != self.ep_size:
            raise ConfigError(
                f"MoE: ep_size {self.ep_size}, but the expert-parallel group has "
                f"{comm.world_size} ranks"
            )
        layer = self.deepspeed_moe
        layer.experts.renumber(comm.rank * layer.num_local_experts)
        layer.comm = comm

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if used_token is not None:
            raise NotImplementedError("MoE: used_token is not supported; pass every token")
        output = self.deepspeed_moe(hidden_states)
        if self.use_residual:
            mixed = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mixed[..., 0:1] + self.mlp(hidden_states) * mixed[..., 1:]
        layer = self.deepspeed_moe
        assert layer.l_aux is not None and layer.exp_counts is not None  # set by its forward
        return output, layer.l_aux, layer.exp_counts
