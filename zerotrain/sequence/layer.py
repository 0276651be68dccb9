"""DeepSpeed's ``deepspeed.sequence.layer`` path: ``DistributedAttention`` for custom models."""

from zerotrain.sequence.attention import DistributedAttention

__all__ = ["DistributedAttention"]
