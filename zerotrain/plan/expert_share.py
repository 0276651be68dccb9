"""The experts of a model's MoE layers as the planner prices them: the expert-parallel degree
the layers ask for (the model fixes it, not the planner), the expert parameters a rank holds
(what ZeRO shards over the ranks holding the same experts) and the tokens each layer sends to
the experts and back.

[Note: an expert-parallel rank's share]
A model whose MoE layers spread their experts over ``ep_size`` ranks builds only a rank's own
(zerotrain/moe/layer.py), so counted on the meta device it is already a rank's share: the dense
parameters, ZeRO-sharded over every data-parallel rank, and ``num_experts / ep_size`` experts,
sharded over the data-parallel ranks that hold the same experts (one per expert-parallel group:
``Mesh.expert_dp``). Such a layer runs only once placed on a group, so the model probe places
every MoE layer on a group that is rank 0 alone (``AloneInGroup`` in
zerotrain/plan/model_probe.py, world size ``ep_size``): its all-to-alls hand each rank's rows
back to the sender, so rank 0's local experts run on every token it routed, as many rows as a
real rank receives when the gate balances the load, and nothing is sent. The probe's time and
saved activations are then a real rank's (the gate, the dispatch's copies, the experts on their
rows); the cost model adds the wire: per MoE layer and micro-batch, the tokens' hidden states
to their experts and the outputs back, and each unit's slots (a weight and an expert, fp32),
each rank sending (ep-1)/ep of them, forward, again in a checkpointed backward's recomputation,
and reversed in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from zerotrain.plan.model_probe import AloneInGroup

__all__ = ["ExpertShare", "expert_share", "place_alone"]


@dataclass(frozen=True)
class ExpertShare:
    """A rank's experts and what its MoE layers exchange."""

    degree: int
    """The layers' ``ep_size``: ranks the experts are spread over."""
    layers: int
    """MoE layers: each exchanges its tokens in every forward and backward."""
    choices: int
    """Experts per token (the gate's ``k``): without deduplication, rows a token sends."""
    hidden: int
    """Elements of a token's hidden state."""
    trainable: int
    """Trainable expert elements a rank holds."""
    frozen: int
    """Frozen ones."""

    def shards(self, data_parallel: int) -> int:
        """The ranks that hold the same experts among ``data_parallel`` ranks that see
        different data: what ZeRO shards the experts over."""
        return max(1, data_parallel // self.degree)


def expert_share(model: nn.Module) -> ExpertShare | None:
    """``model``'s experts (built on the meta device is enough; see [Note: an expert-parallel
    rank's share]), or None without MoE layers. ValueError where its layers ask for several
    expert-parallel degrees (training refuses that too)."""
    from zerotrain.moe.layer import MoE, expert_tensors

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return None
    degrees = sorted({m.ep_size for m in layers})
    if len(degrees) > 1:
        raise ValueError(f"MoE layers with ep_size {degrees}; training takes one ep_size")
    experts = expert_tensors(model)
    params = [p for p in model.parameters() if id(p) in experts]
    return ExpertShare(
        degree=degrees[0],
        layers=len(layers),
        choices=max(m.deepspeed_moe.gate.k for m in layers),
        hidden=layers[0].deepspeed_moe.gate.wg.in_features,
        trainable=sum(p.numel() for p in params if p.requires_grad),
        frozen=sum(p.numel() for p in params if not p.requires_grad),
    )


def place_alone(model: nn.Module, degree: int) -> None:
    """Place every MoE layer of ``model`` as rank 0 of ``degree`` expert-parallel ranks whose
    exchanges stay here (see [Note: an expert-parallel rank's share])."""
    from zerotrain.moe.layer import MoE

    for layer in model.modules():
        if isinstance(layer, MoE):
            layer.place(AloneInGroup(degree))  # pyrefly: ignore[bad-argument-type]
