"""``deepspeed.ops.adam``."""

from zerotrain.optim.adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
