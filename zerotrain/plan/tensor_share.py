"""One tensor-parallel rank's share of a model, as the planner prices it: its parameters (what
ZeRO then shards over the data-parallel ranks) and the activations its layers all-reduce.

[Note: a tensor-parallel rank's share]
The planner splits the model as training would (zerotrain/tensor_parallel/plan.py's automatic
plan, the same ``apply_plan``) over a group that is one rank alone: ``AloneInGroup`` (in
zerotrain/plan/model_probe.py) says it is rank 0 of ``degree`` ranks, and its collectives do
nothing. Built on the meta device the split model is counted (``count_parameters``: the
parameters of rank 0, whose pieces are the same size on every rank); built for real, the model
probe times and counts the share's forward and backward (zerotrain/plan/model_probe.py): the
same matmuls, copies and saved tensors as a rank of a tensor-parallel job, without the
all-reduces, which the cost model prices on the probed link. Per token a row-wise layer
all-reduces its output features in the forward (again in a checkpointed backward's
recomputation) and a column-wise layer its input features' gradient in the backward
(Megatron-LM's ``g`` and ``f``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zerotrain.estimate.model import ParameterCount
from zerotrain.plan.model_probe import AloneInGroup, ModelProfile

__all__ = ["TensorShare", "split_alone", "tensor_shares"]


@dataclass(frozen=True)
class TensorShare:
    """Rank 0's share of a model split over ``degree`` tensor-parallel ranks."""

    degree: int
    count: ParameterCount
    """The share's parameters."""
    forward_calls: int
    """All-reduces of a forward: the row-wise layers."""
    forward_elements: int
    """Elements they all-reduce per token (the layers' output features, summed)."""
    backward_calls: int
    """All-reduces of a backward: the column-wise layers' input gradients."""
    backward_elements: int
    """Elements they all-reduce per token."""
    profile: ModelProfile | None = None
    """The share's measured compute and activations, where the model could be built here."""


def split_alone(model: nn.Module, degree: int) -> tuple[int, int, int, int]:
    """Split ``model`` in place, as rank 0 of ``degree`` tensor-parallel ranks, by the
    automatic plan; returns (forward_calls, forward_elements, backward_calls,
    backward_elements) per token. ValueError where the plan matches no layer or the degree
    does not divide the model (its heads, its features)."""
    from zerotrain.config.errors import ConfigError
    from zerotrain.tensor_parallel.plan import Colwise, Rowwise, apply_plan, resolve_plan

    plan, _ = resolve_plan(model, None)
    modules = dict(model.named_modules())
    rows = [modules[name] for name, style in plan.items() if isinstance(style, Rowwise)]
    columns = [modules[name] for name, style in plan.items() if isinstance(style, Colwise)]
    if not rows and not columns:
        raise ValueError(f"the automatic plan splits no layer of {type(model).__name__}")
    widths = (
        sum(_features(m, "out") for m in rows),
        sum(_features(m, "in") for m in columns),
    )
    try:
        apply_plan(model, plan, AloneInGroup(degree))  # pyrefly: ignore[bad-argument-type]
    except ConfigError as error:
        raise ValueError(str(error)) from error
    return len(rows), widths[0], len(columns), widths[1]


def _features(module: nn.Module, side: str) -> int:
    """A linear layer's (or transformers' Conv1D's) input or output features, whole."""
    from zerotrain.tensor_parallel.plan import feature_dims

    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{type(module).__name__} has no weight matrix to split")
    out_dim, in_dim = feature_dims(module, "weight")
    return int(weight.shape[out_dim if side == "out" else in_dim])


def tensor_shares(
    meta_model: nn.Module,
    degrees: list[int],
    skipped: Callable[[int, str], object] | None = None,
) -> dict[int, TensorShare]:
    """For each degree of ``degrees`` that can split ``meta_model`` (built on the meta device),
    rank 0's share; each other degree is passed to ``skipped`` with the reason."""
    from zerotrain.config import ZERO_DEFAULTS
    from zerotrain.estimate import count_parameters

    shares = {}
    for degree in degrees:
        try:
            model = copy.deepcopy(meta_model)
            calls = split_alone(model, degree)
        except Exception as error:  # noqa: BLE001 (the user's model: that degree is not planned)
            if skipped is not None:  # the model's shape, or the model failing to split
                plain = isinstance(error, ValueError)
                skipped(degree, str(error) if plain else f"{type(error).__name__}: {error}")
            continue
        count = count_parameters(
            model, persistence_threshold=ZERO_DEFAULTS.stage3_param_persistence_threshold
        )
        shares[degree] = TensorShare(degree, count, *calls)
    return shares
