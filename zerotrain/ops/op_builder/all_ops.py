"""``deepspeed.ops.op_builder.all_ops``."""

from zerotrain.ops.op_builder import ALL_OPS

__all__ = ["ALL_OPS"]
