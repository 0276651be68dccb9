"""``deepspeed.runtime.zero.partition_parameters``."""

from zerotrain.zero import (
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
    "register_external_parameter",
    "unregister_external_parameter",
]
