"""``deepspeed.runtime.zero.config``: the ``zero_optimization`` section as DeepSpeed's users
build it by hand (zerotrain's validated section, zerotrain.config).

DeepSpeed's field names for the ZeRO-3 knobs (``prefetch_bucket_size``,
``param_persistence_threshold``, ...) are accepted as keys and read as attributes beside the
``stage3_`` names zerotrain keeps. Unlike DeepSpeed's, the offload sections are there with
``device: none`` when not given (never None).
"""

from __future__ import annotations

import enum
from typing import Any

from zerotrain.config import OffloadDeviceEnum, ZeroOptimizationConfig
from zerotrain.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)

__all__ = [
    "ZERO_OPTIMIZATION",
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "ZeroStageEnum",
    "get_zero_config",
]

ZERO_OPTIMIZATION = "zero_optimization"


class ZeroStageEnum(int, enum.Enum):
    """DeepSpeed's names of the ZeRO stages."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class DeepSpeedZeroConfig(ZeroOptimizationConfig):
    """The ``zero_optimization`` section: ``DeepSpeedZeroConfig(stage=3, offload_param={"device":
    "cpu"})``; invalid values raise pydantic's ValidationError, as DeepSpeed's do."""

    @property
    def prefetch_bucket_size(self) -> int:
        return self.stage3_prefetch_bucket_size

    @property
    def param_persistence_threshold(self) -> int:
        return self.stage3_param_persistence_threshold

    @property
    def max_live_parameters(self) -> int:
        return self.stage3_max_live_parameters

    @property
    def max_reuse_distance(self) -> int:
        return self.stage3_max_reuse_distance

    @property
    def gather_16bit_weights_on_model_save(self) -> bool:
        return self.stage3_gather_16bit_weights_on_model_save


def get_zero_config(param_dict: dict[str, Any]) -> DeepSpeedZeroConfig:
    """The ``zero_optimization`` section of a whole config dict (DeepSpeed's old boolean form
    read as stage 0 or 1; missing: the defaults)."""
    section = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(section, bool):
        section = {"stage": int(section)}
    return DeepSpeedZeroConfig(**section)
