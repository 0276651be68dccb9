"""ZeRO: partitioning optimizer states (stage 1), gradients (stage 2) and parameters (stage 3).

``zerotrain.zero.Init``, ``GatheredParameters``, ``register_external_parameter`` and
``ZeroParamStatus`` are DeepSpeed's stage-3 helpers under the same names.
"""

from zerotrain.zero.gathered_parameters import GatheredParameters
from zerotrain.zero.group import GroupOptions, GroupState, ShardGroup, ShardSegments
from zerotrain.zero.init import (
    Init,
    ZeroParamStatus,
    full_shape,
    register_external_parameter,
    unregister_external_parameter,
)
from zerotrain.zero.layout import FlatBucket
from zerotrain.zero.optimizer import ZeroOptimizer
from zerotrain.zero.policy import ZeroPolicy
from zerotrain.zero.store import DeviceShardStore, ShardStore

__all__ = [
    "DeviceShardStore",
    "FlatBucket",
    "GatheredParameters",
    "GroupOptions",
    "GroupState",
    "Init",
    "ShardGroup",
    "ShardSegments",
    "ShardStore",
    "ZeroOptimizer",
    "ZeroParamStatus",
    "ZeroPolicy",
    "full_shape",
    "register_external_parameter",
    "unregister_external_parameter",
]
