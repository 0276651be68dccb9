"""``deepspeed.ops``: DeepSpeed's optimizer classes (zerotrain.optim), under its paths, and its
op builders as capability probes (``op_builder``, ``__compatible_ops__``)."""

from zerotrain.ops import adagrad, adam, aio, lamb, lion, op_builder
from zerotrain.ops.op_builder import ALL_OPS

__all__ = ["adagrad", "adam", "aio", "lamb", "lion", "op_builder"]

__compatible_ops__: dict[str, bool] = {name: op.is_compatible() for name, op in ALL_OPS.items()}
"""Whether zerotrain serves each DeepSpeed op, by the op's name (``Builder.NAME``)."""
