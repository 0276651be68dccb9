"""``deepspeed.runtime.zero.stage_1_and_2``: the class of DeepSpeed's ZeRO stage 1-2 optimizer,
which ``isinstance`` matches with zerotrain's ZeRO optimizer at stages 1 and 2."""

from __future__ import annotations

from zerotrain.runtime.base_optimizer import ServedByStage
from zerotrain.zero import ZeroOptimizer


class DeepSpeedZeroOptimizer(ZeroOptimizer, metaclass=ServedByStage):
    """DeepSpeed's stage 1-2 optimizer: ``isinstance(initialize(...)[1],
    DeepSpeedZeroOptimizer)`` holds at ZeRO stages 1 and 2, as in DeepSpeed."""

    stages = (1, 2)


__all__ = ["DeepSpeedZeroOptimizer"]
