"""``deepspeed.ops.adagrad``."""

from zerotrain.optim.adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
