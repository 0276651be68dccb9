"""``deepspeed.runtime.engine``: the engine class under DeepSpeed's name."""

from zerotrain.engine import ZeroTrainEngine

DeepSpeedEngine = ZeroTrainEngine
"""``isinstance(x, DeepSpeedEngine)`` is true for zerotrain's engine."""

__all__ = ["DeepSpeedEngine"]
