"""``deepspeed.ops.lion``."""

from zerotrain.optim.lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
