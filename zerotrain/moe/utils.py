"""``deepspeed.moe.utils``: telling expert parameters apart, and DeepSpeed's optimizer groups
for them."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to an expert (DeepSpeed marks them ``allreduce=False``)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple | list, max_group_size: int | float = 178956971
) -> list[dict[str, Any]]:
    """DeepSpeed's split of optimizer groups: each group keeps its dense parameters, and its
    expert parameters go to new groups with the same settings, one per expert group name
    (``ep_size_<n>``, with ``"moe": True`` and ``"name"``), each holding at most
    ``max_group_size`` elements."""
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    out = []
    for group in groups:
        params = list(group["params"])
        out.append({**group, "params": [p for p in params if not is_moe_param(p)]})
        by_name: dict[str, list[torch.Tensor]] = {}
        for param in params:
            if is_moe_param(param):
                by_name.setdefault(param.group_name, []).append(param)  # type: ignore[attr-defined]
        for name, experts in by_name.items():
            chunk: list[torch.Tensor] = []
            for param in experts:
                if chunk and sum(p.numel() for p in chunk) + param.numel() > max_group_size:
                    out.append({**group, "params": chunk, "name": name, "moe": True})
                    chunk = []
                chunk.append(param)
            out.append({**group, "params": chunk, "name": name, "moe": True})
    return out
