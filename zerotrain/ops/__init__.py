"""``deepspeed.ops``: DeepSpeed's optimizer classes (zerotrain.optim), under its paths."""

from zerotrain.ops import adam, lamb

__all__ = ["adam", "lamb"]
