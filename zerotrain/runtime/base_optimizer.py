"""``deepspeed.runtime.base_optimizer``: the optimizer class under DeepSpeed's name."""

from zerotrain.zero import ZeroOptimizer

DeepSpeedOptimizer = ZeroOptimizer
"""``isinstance(x, DeepSpeedOptimizer)`` is true for the optimizer ``initialize`` returns."""

ZeROOptimizer = ZeroOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
