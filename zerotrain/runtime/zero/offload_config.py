"""``deepspeed.runtime.zero.offload_config``: the offload sections under DeepSpeed's class
names (zerotrain's validated sections, zerotrain.config)."""

from zerotrain.config import (
    OffloadDeviceEnum,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OffloadStateTypeEnum,
)

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
"""``zero_optimization.offload_param``."""
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
"""``zero_optimization.offload_optimizer``."""

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]
