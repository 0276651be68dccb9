"""``deepspeed.runtime.zero.stage3``: the class of DeepSpeed's ZeRO stage 3 optimizer, which
``isinstance`` matches with zerotrain's ZeRO optimizer at stage 3."""

from __future__ import annotations

from zerotrain.runtime.base_optimizer import ServedByStage
from zerotrain.zero import ZeroOptimizer


class DeepSpeedZeroOptimizer_Stage3(ZeroOptimizer, metaclass=ServedByStage):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's stage 3 optimizer: ``isinstance(initialize(...)[1],
    DeepSpeedZeroOptimizer_Stage3)`` holds at ZeRO stage 3, as in DeepSpeed."""

    stages = (3,)


__all__ = ["DeepSpeedZeroOptimizer_Stage3"]
