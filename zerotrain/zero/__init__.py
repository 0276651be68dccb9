"""ZeRO: partitioning optimizer states (stage 1), gradients (stage 2) and parameters (stage 3).

``zerotrain.zero.Init``, ``GatheredParameters``, ``register_external_parameter`` and
``ZeroParamStatus`` are DeepSpeed's stage-3 helpers under the same names.
"""

from zerotrain.zero.gathered import GatheredParameters
from zerotrain.zero.init import (
    Init,
    ZeroParamStatus,
    full_shape,
    register_external_parameter,
    unregister_external_parameter,
)
from zerotrain.zero.optimizer import ShardSegments, ZeroOptimizer
from zerotrain.zero.partition import FlatBucket, ZeroPolicy
from zerotrain.zero.shard_store import DeviceShardStore, ShardStore

__all__ = [
    "DeviceShardStore",
    "FlatBucket",
    "GatheredParameters",
    "Init",
    "ShardSegments",
    "ShardStore",
    "ZeroOptimizer",
    "ZeroParamStatus",
    "ZeroPolicy",
    "full_shape",
    "register_external_parameter",
    "unregister_external_parameter",
]
