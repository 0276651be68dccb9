"""``deepspeed.ops.lamb``."""

from zerotrain.optim.lamb import FusedLamb

__all__ = ["FusedLamb"]
