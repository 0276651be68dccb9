"""The config's optimizer as the planner prices it: the bytes of state it keeps per element
(the memory preflight's reading of it) and its step's time against fused AdamW's, which the
machine probe measures.

[Note: the optimizer's cost]
The state: the optimizer the config's ``optimizer`` section builds, read as ``initialize``'s
memory preflight reads it (zerotrain/estimate/preflight.py's ``optimizer_state``): its class's
bytes per element where known, one step over stand-ins where not, Muon's momentum for its
matrices and AdamW's moments for the rest.

The step: an element-wise optimizer (SGD, Adagrad, Lion, Lamb, ...) is timed here over the
same stand-in as fused AdamW, and its step is priced at the probed AdamW rate times the ratio
(Adam and AdamW are the probe's own: ratio 1, not timed). Muon steps its matrices' momentum at
AdamW's rate (an over-count: one buffer, not two) and orthogonalises each matrix whole:
``ns_steps`` Newton-Schulz iterations, whose FLOPs the model's shapes give
(:attr:`ParameterCount.muon_iteration_flops`), at the probed matmul rate; on ZeRO shards each
matrix is orthogonalised on one rank, so the ranks share them; the matrices' trips to those
ranks and back are collectives, priced with the others (zerotrain/plan/cost.py's
``_muon_exchange_seconds``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zerotrain.estimate.model import ParameterCount
from zerotrain.estimate.preflight import optimizer_state
from zerotrain.optim import build_optimizer
from zerotrain.optim.catch_up import catches_up
from zerotrain.optim.registry import find_optimizer
from zerotrain.plan.probe import optimizer_step_seconds

__all__ = ["ADAMW", "OptimizerCost", "optimizer_cost"]

STAND_IN_ELEMENTS = 1 << 20
"""Elements of the stand-in two optimizers are timed over: large enough that a step's fixed
cost is small beside its work, small enough to take milliseconds."""
ADAM_NAMES = ("Adam", "AdamW")


@dataclass(frozen=True)
class OptimizerCost:
    """The optimizer as the cost model prices it (see [Note: the optimizer's cost])."""

    name: str
    """The config's ``optimizer.type``, as the registry spells it."""
    kind: str
    """The estimator's kind: ``adam``, ``lamb`` (needs whole parameters) or ``muon``."""
    state_bytes: float
    """Bytes of state per trainable element."""
    relative_time: float = 1.0
    """Its element-wise step's time over fused AdamW's, on the same elements."""
    ns_steps: int = 0
    """Muon: Newton-Schulz iterations a step (0: not Muon)."""
    catches_up: bool = True
    """Whether it catches up on top-k's sparse gradients (zerotrain/optim/catch_up.py): the
    codec then counts each element's steps."""

    def state_bytes_of(self, count: ParameterCount) -> float:
        """Bytes of state per element of ``count``'s parameters (Muon's depend on which of them
        are its matrices: a pipeline stage's share differs from the model's)."""
        return count.muon_state_bytes() if self.kind == "muon" else self.state_bytes

    def elementwise_seconds(self, elements: float, adam_rate: float) -> float:
        """The element-wise part of the step over ``elements``, where fused AdamW steps
        ``adam_rate`` elements a second."""
        return elements * self.relative_time / adam_rate

    def step_seconds(
        self,
        partition: float,
        *,
        count: ParameterCount,
        adam_rate: float,
        matmul_flops: float,
        ranks: int,
    ) -> float:
        """The step over a rank's ``partition`` of ``count``'s trainable elements, with
        ``ranks`` ranks sharing Muon's matrices."""
        seconds = self.elementwise_seconds(partition, adam_rate)
        if self.ns_steps:
            seconds += self.ns_steps * count.muon_iteration_flops / ranks / matmul_flops
        return seconds


ADAMW = OptimizerCost(name="AdamW", kind="adam", state_bytes=8.0)
"""What a config without an ``optimizer`` section trains with (:meth:`Candidate.config`)."""


def optimizer_cost(section: dict, count: ParameterCount, threads: int | None) -> OptimizerCost:
    """The cost of the optimizer a config's ``optimizer`` ``section`` builds, over a model of
    ``count``'s parameters, timed (when not Adam) on ``threads`` threads (None: not timed, for
    memory alone: its step time is NaN); ValueError where the section names no optimizer
    zerotrain builds."""
    spec = find_optimizer(str(section.get("type", "")))
    if spec is None:
        raise ValueError(
            f"optimizer.type {section.get('type')!r}: not an optimizer zerotrain builds"
        )
    params = section.get("params") or {}

    def build(masters: list[list[torch.Tensor]], probe: bool = False) -> torch.optim.Optimizer:
        return build_optimizer(spec.name, params, [{"params": m} for m in masters])

    kind, state_bytes = optimizer_state(build, 1, count)
    sparse = catches_up(build([[torch.zeros(1)]]))
    if spec.name == "Muon":  # its ns_steps, as given or Muon's default
        steps = int(build([[torch.zeros(1)]]).defaults["ns_steps"])
        return OptimizerCost(spec.name, kind, state_bytes, ns_steps=steps, catches_up=sparse)
    if spec.name in ADAM_NAMES:
        relative = 1.0
    elif threads is None:
        relative = math.nan
    else:
        relative = _relative_time(spec.name, params, threads)
    return OptimizerCost(spec.name, kind, state_bytes, relative, catches_up=sparse)


def _relative_time(name: str, params: dict, threads: int) -> float:
    """The step time of optimizer ``name`` over fused AdamW's on one stand-in."""

    def builder(each: str, given: dict):
        return lambda tensors: build_optimizer(each, given, [{"params": tensors}])

    mine = optimizer_step_seconds(builder(name, params), STAND_IN_ELEMENTS, threads)
    return mine / optimizer_step_seconds(builder("AdamW", {}), STAND_IN_ELEMENTS, threads)
