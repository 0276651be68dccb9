"""``deepspeed.moe.utils``: the parameter-group helpers, which need no MoE layer to work."""

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
    """DeepSpeed's split of optimizer groups into dense and per-expert-group groups. zerotrain
    has no MoE layers, so no parameter is an expert's and every group is returned as it is
    (as a list); an expert parameter (``allreduce=False``) is refused."""
    del max_group_size
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    for group in groups:
        if any(is_moe_param(p) for p in group["params"]):
            raise NotImplementedError(
                "split_params_into_different_moe_groups_for_optimizer: expert parameters need "
                "expert parallelism, which zerotrain does not implement yet"
            )
    return groups
