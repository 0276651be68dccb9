"""ZeRO: partitioning optimizer states (stage 1), gradients (stage 2) and parameters (stage 3).

``zerotrain.zero.Init`` and ``zerotrain.zero.GatheredParameters`` are DeepSpeed's stage-3
helpers under the same names.
"""

from zerotrain.zero.gathered import GatheredParameters
from zerotrain.zero.init import Init, full_shape
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
    "ZeroPolicy",
    "full_shape",
]
