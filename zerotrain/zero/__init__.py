"""ZeRO: partitioning optimizer states (stage 1) and gradients (stage 2) across ranks."""

from zerotrain.zero.optimizer import ShardSegments, ZeroOptimizer
from zerotrain.zero.partition import FlatBucket, ZeroPolicy
from zerotrain.zero.shard_store import DeviceShardStore, ShardStore

__all__ = [
    "DeviceShardStore",
    "FlatBucket",
    "ShardSegments",
    "ShardStore",
    "ZeroOptimizer",
    "ZeroPolicy",
]
