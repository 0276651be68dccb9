"""``deepspeed.moe.layer``."""

from __future__ import annotations

__all__ = ["MoE"]


class MoE:
    """DeepSpeed's Mixture-of-Experts layer; constructing it raises."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "zerotrain.moe.layer.MoE: Mixture-of-Experts layers (expert parallelism) are not "
            "implemented in zerotrain yet; use a dense layer"
        )
