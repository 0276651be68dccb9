"""``deepspeed.runtime.zero`` (also ``deepspeed.zero``)."""

from zerotrain.runtime.zero import (
    config,
    offload_config,
    partition_parameters,
    stage3,
    stage_1_and_2,
)
from zerotrain.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "config",
    "offload_config",
    "partition_parameters",
    "register_external_parameter",
    "stage3",
    "stage_1_and_2",
    "unregister_external_parameter",
]
