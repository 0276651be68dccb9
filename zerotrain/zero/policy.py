"""What ZeRO partitions (the stage), and the one place where that becomes strategies.

[Note: the stage is read once]
A ZeRO stage is three yes/no answers: are the optimizer states, the gradients, the parameters
partitioned? :func:`choose_strategies` turns them into the strategies of a shard group:
which part of each bucket the optimizer steps (:class:`OptimizerPartition`), how gradients are
reduced (zerotrain/zero/reduce.py), and how parameters are made whole for use
(zerotrain/zero/gather.py). No other code asks for the stage or its flags: it asks the
strategy (``reduction.every_backward``, ``residency.holds_whole(param)``...). A new capability
(offload, compression, a mesh) is another strategy chosen here, not a branch elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotrain.comm import Communicator
from zerotrain.zero.gather import GatheredAfterStep, GatheredForUse, ParamResidency, Replicated
from zerotrain.zero.layout import OptimizerPartition
from zerotrain.zero.nvme import NvmePlacement
from zerotrain.zero.offload import HostPlacement, OffloadOptions
from zerotrain.zero.reduce import (
    AllReduceAtBoundary,
    GradientReduction,
    ReduceScatterAtBoundary,
    ReduceScatterInBackward,
)
from zerotrain.zero.store import Placement


@dataclass(frozen=True)
class ZeroPolicy:
    """What is partitioned across data-parallel ranks (ZeRO, arXiv:1910.02054 §5).

    Stage 0 partitions nothing (plain data parallelism), stage 1 the optimizer states and fp32
    master weights, stage 2 also the gradients, stage 3 also the parameters.
    """

    stage: int
    shard_optimizer_states: bool
    shard_gradients: bool
    shard_parameters: bool

    @classmethod
    def for_stage(cls, stage: int) -> ZeroPolicy:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage: must be between 0 and 3, got {stage}")
        return cls(stage, stage >= 1, stage >= 2, stage >= 3)


@dataclass(frozen=True)
class Strategies:
    """The classes a shard group is built from (see [Note: the stage is read once])."""

    partition: OptimizerPartition
    reduction: type[GradientReduction]
    residency: type[ParamResidency]
    placement: Placement


def choose_strategies(
    policy: ZeroPolicy, comm: Communicator, offload: OffloadOptions | None = None
) -> Strategies:
    """The strategies that implement ``policy`` over ``comm``'s ranks, with the masters where
    ``offload`` puts them (None: on the device)."""
    if policy.shard_gradients:
        reduction: type[GradientReduction] = ReduceScatterInBackward
    elif policy.shard_optimizer_states:
        reduction = ReduceScatterAtBoundary
    else:
        reduction = AllReduceAtBoundary
    if policy.shard_parameters:
        residency: type[ParamResidency] = GatheredForUse
    elif policy.shard_optimizer_states:
        residency = GatheredAfterStep
    else:
        residency = Replicated
    return Strategies(
        partition=OptimizerPartition(comm, sharded=policy.shard_optimizer_states),
        reduction=reduction,
        residency=residency,
        placement=_placement(offload),
    )


def _placement(offload: OffloadOptions | None) -> Placement:
    if offload is None:
        return Placement()
    if offload.device == "nvme":
        return NvmePlacement(offload)
    return HostPlacement(offload)
